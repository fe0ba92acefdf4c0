"""Griffe extension for the API reference: our Google-style ``Example:`` sections are doctests.

Griffe reads ``Example:`` (singular) as a note in Markdown and ``Examples:`` as code and prose
split apart; every ``Example:`` holding ``>>>`` lines becomes ``Examples:`` so the doctests render
as code instead of as Markdown (where ``[[0, 1], [2, 3]]`` would read as a link).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(?P<indent>[ ]*)Example:[ ]*$(?=\n(?:(?P=indent)[ ]+.*\n|\s*\n)*?(?P=indent)[ ]+>>>)", re.M)


class DoctestExamples(griffe.Extension):
    """Rename ``Example:`` to ``Examples:`` in docstrings whose example is a doctest."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is not None and "Example:" in docstring.value:
            docstring.value = _EXAMPLE.sub(r"\g<indent>Examples:", docstring.value)
