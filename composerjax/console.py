"""The trainer's own lines on the terminal: reports on stderr, and lines printed above a progress bar."""

from __future__ import annotations

import sys

__all__ = ["print_error", "print_line"]


def print_error(text: str) -> None:
    """One line on stderr, flushed (reports that must come before an error's traceback).

    Example:
        >>> print_error("composerjax: checkpoint ep1-ba8 was skipped")  # doctest: +SKIP
    """
    print(text, file=sys.stderr, flush=True)


def print_line(text: str) -> None:
    """One line on stdout, printed above any active progress bar instead of through it.

    Example:
        >>> print_line("steps_per_call='auto': 32 per call")
        steps_per_call='auto': 32 per call
    """
    from tqdm import tqdm

    tqdm.write(text, file=sys.stdout)
