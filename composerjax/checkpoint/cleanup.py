"""What a failed save leaves in the save folder, removed: orbax's half-written temporary folders.

A save that fails (a full disk, a refused write) leaves ``<name>.orbax-checkpoint-tmp*`` behind;
on a full disk that folder keeps the disk full. :class:`FailedSaves` removes the temporary folders
of each failed save once its other writes have ended, and again when the writer is closed.
Complete checkpoints are never touched.

Example:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> for entry in ("ep0-ba2", "ep0-ba4.orbax-checkpoint-tmp-17", "ep0-ba40.orbax-checkpoint-tmp"):
    ...     os.mkdir(os.path.join(folder, entry))
    >>> remove_unfinished(folder, "ep0-ba4"), sorted(os.listdir(folder))
    (['ep0-ba4.orbax-checkpoint-tmp-17'], ['ep0-ba2', 'ep0-ba40.orbax-checkpoint-tmp'])
"""

from __future__ import annotations

import os
import sys
from typing import Any

from composerjax.checkpoint.checks import first_line
from composerjax.checkpoint.writer import remove_checkpoint
from composerjax.parallel import dist

__all__ = ["SETTLE_TIMEOUT_S", "FailedSaves", "remove_unfinished"]

#: How long each of a failed save's other writes may take to end before its folders are removed anyway.
SETTLE_TIMEOUT_S = 60.0
_ORBAX_TMP = ".orbax-checkpoint-tmp"  # orbax's folder for a checkpoint it is still writing


def remove_unfinished(folder: str, name: str) -> list[str]:
    """Delete orbax's temporary folders of checkpoint ``name`` in ``folder``; return their names.

    Only ``<name>.orbax-checkpoint-tmp*`` entries go: ``name`` itself and every other checkpoint stay.
    """
    try:
        entries = sorted(os.listdir(folder))
    except OSError:
        return []
    doomed = [entry for entry in entries if entry.startswith(name + _ORBAX_TMP)]
    for entry in doomed:
        remove_checkpoint(os.path.join(folder, entry))
    return doomed


class FailedSaves:
    """The saves into ``folder`` that failed: their temporary folders are removed (on process 0 only).

    Example:
        >>> import tempfile
        >>> failed = FailedSaves(tempfile.mkdtemp())
        >>> failed.discard(None, "ep0-ba2")
        >>> failed.names
        {'ep0-ba2'}
    """

    def __init__(self, folder: str, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        self.folder, self.timeout_s = folder, timeout_s
        self.names: set[str] = set()

    def discard(self, writer: Any, name: str) -> None:
        """Save ``name`` failed: let its other writes end, then remove its temporary folders.

        orbax reports a save's first failed write while the others go on in their own threads, and
        those recreate the folder they write into; so they are waited for first (at most
        ``timeout_s`` each). A removal that fails is one line on stderr: the save's own error is
        the one to report.
        """
        if not dist.is_process_zero():
            return
        self.names.add(name)
        # orbax keeps the failed save's commit futures on its async manager (there is no public handle).
        futures = getattr(getattr(writer, "_async_manager", None), "_commit_futures", None) or ()
        for commit in futures:
            try:
                commit.result(timeout=self.timeout_s)
            except Exception:  # noqa: BLE001, S110 - their errors are the failed save's, already reported
                pass
        try:
            remove_unfinished(self.folder, name)
        except OSError as error:
            print(f"composerjax: the failed checkpoint {name}'s temporary folder in {self.folder} could not be "
                  f"removed: {first_line(error)}", file=sys.stderr, flush=True)

    def discard_again(self, writer: Any) -> None:
        """Once the writer is closed: remove what writes that outlived the first removal left."""
        for name in sorted(self.names):
            self.discard(writer, name)
