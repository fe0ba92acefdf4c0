"""grain operations GrainLoader adds itself (this module imports grain: GrainLoader imports it only when needed)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any

import grain

__all__ = ["ExitWithTrainer"]

_PR_SET_PDEATHSIG = 1


class ExitWithTrainer(grain.transforms.Map):
    """Ties each grain worker process's life to the process that built the loader; records pass unchanged.

    grain's workers are daemons: a trainer that exits normally stops them, but one killed by
    SIGKILL (the OOM killer, a preempted node) would leave them running, orphaned, holding memory
    and shared memory. On its first record in a worker, this asks Linux to SIGKILL the worker when
    its parent dies (``PR_SET_PDEATHSIG``), and exits at once if the parent is already gone. In the
    process that built the loader it does nothing.

    Example:
        >>> import os
        >>> ExitWithTrainer(os.getpid()).map({"x": 1})  # in the trainer itself: a no-op
        {'x': 1}
    """

    def __init__(self, trainer_pid: int) -> None:
        self.trainer_pid = trainer_pid
        self._armed_in: int | None = None

    def map(self, element: Any) -> Any:
        pid = os.getpid()
        if self._armed_in != pid:
            self._armed_in = pid
            if pid != self.trainer_pid and sys.platform.startswith("linux"):
                try:
                    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
                except (OSError, AttributeError):
                    pass
                if os.getppid() != self.trainer_pid:  # the trainer died before the line above took effect
                    os._exit(1)
        return element

    def __repr__(self) -> str:
        return "ExitWithTrainer()"  # no pid: it must not make iterator states of two processes differ
