"""``python -m composerjax``: the same command line as the ``composerjax`` script."""

from composerjax.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
