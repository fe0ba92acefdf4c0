"""What every ``composerjax`` subcommand shares: its usage error, its help layout and ``--debug``."""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter", "UsageError", "add_debug"]


class UsageError(Exception):
    """Invalid input for a subcommand: reported as ``composerjax <command>: error: <message>``, exit status 2."""


class HelpFormatter(argparse.HelpFormatter):
    """Wraps one-line paragraphs (descriptions) and keeps multi-line ones (exit statuses, examples) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        paragraphs = []
        for paragraph in text.split("\n\n"):
            if "\n" in paragraph:
                paragraphs.append("\n".join(indent + line for line in paragraph.splitlines()))
            else:
                paragraphs.append(textwrap.fill(paragraph, width, initial_indent=indent, subsequent_indent=indent))
        return "\n\n".join(paragraphs)


def add_debug(parser: argparse.ArgumentParser) -> None:
    """Give a subcommand's ``parser`` the ``--debug`` option (also accepted before the subcommand)."""
    # SUPPRESS: when not given here, the top-level `composerjax --debug` value is kept.
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an unexpected error instead of a one-line message")
