"""The writing side of checkpoints: the save folder's owner lock, writer-thread priority, orbax's error output.

* :class:`OwnerLock`: an exclusive ``flock`` on ``<save folder>/.composerjax-owner`` held while a run
  writes checkpoints there, so two live runs never write one folder.
* :data:`SWITCH_INTERVAL` and :func:`thread_ids`: while a save is in flight the interpreter's GIL switch
  interval is lowered, and the threads orbax starts to write are found (to lower their priority), so
  the train loop is not stalled by the writer.
* :func:`call_with_timeout`: wait for orbax with a deadline.
* Importing this module makes orbax's writer-thread errors print one line each instead of a traceback
  per thread (the cause is in :class:`~composerjax.trainer.checkpoint_checks.CheckpointSaveError`).

Example:
    >>> call_with_timeout(lambda: None, timeout_s=None, message="unused")
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

from composerjax.trainer.checkpoint_checks import CheckpointSaveError, SaveFolderInUseError, first_line

__all__ = ["OWNER_FILE", "SWITCH_INTERVAL", "OwnerLock", "SwitchInterval", "call_with_timeout", "thread_ids"]

# The file in a save folder that the writing run holds an exclusive lock on (flock: the kernel
# releases it when the process dies, SIGKILL included), with the owner's pid, host and run name.
OWNER_FILE = ".composerjax-owner"


class OwnerLock:
    """An exclusive ``flock`` on ``folder/.composerjax-owner``, held while a run writes checkpoints there.

    The kernel drops the lock when the owning process dies (SIGKILL included), so a crashed run
    never blocks the next. Within one process the lock is shared: a second Trainer on the same
    folder (a resume in a notebook) takes it over.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> lock = OwnerLock.acquire(folder, "my-run")
        >>> os.path.exists(os.path.join(folder, OWNER_FILE))
        True
        >>> lock.release()
    """

    _held: dict[str, list[Any]] = {}  # folder -> [fd, holders]
    _guard = threading.Lock()

    def __init__(self, folder: str) -> None:
        self.folder = folder

    @classmethod
    def acquire(cls, folder: str, run_name: str) -> OwnerLock:
        """Take the lock on ``folder`` (created if missing) for ``run_name``.

        Raises:
            SaveFolderInUseError: another live process holds it (the message names its owner).
            CheckpointSaveError: the owner file cannot be written.
        """
        with cls._guard:
            if folder in cls._held:
                cls._held[folder][1] += 1
                return cls(folder)
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, OWNER_FILE)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                try:
                    owner = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
                finally:
                    os.close(fd)
                raise SaveFolderInUseError(
                    f"save_folder={folder!r} is in use by another live run ({owner or 'owner unknown'}); two runs "
                    "writing one folder would replace each other's checkpoints: give this run its own save_folder, "
                    "or stop the other run first") from error
            record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "run_name": run_name,
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")})
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, record.encode(), 0)
            except OSError as error:
                os.close(fd)
                raise CheckpointSaveError(f"save_folder={folder!r} cannot be written: {error}") from error
            cls._held[folder] = [fd, 1]
            return cls(folder)

    def release(self) -> None:
        """Let go of the lock; the last holder in this process closes the file, which drops the flock."""
        with self._guard:
            entry = self._held.get(self.folder)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[self.folder]
                os.close(entry[0])  # closing the last descriptor drops the flock


class SwitchInterval:
    """The GIL switch interval, lowered while any checkpointer's save may be in flight.

    Several checkpointers (two trainers in one process) share the one interpreter setting: the
    first to save records the interval it found, the last one done puts it back. Lowering again
    while holding it, or releasing without holding it, changes nothing.

    Example:
        >>> import sys
        >>> before, interval, saver = sys.getswitchinterval(), SwitchInterval(), object()
        >>> interval.lower(saver, 0.0005)
        >>> sys.getswitchinterval()
        0.0005
        >>> interval.release(saver)
        >>> sys.getswitchinterval() == before
        True
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[int, float] = {}
        self._original: float | None = None

    def lower(self, holder: object, seconds: float) -> None:
        """Set the interval to the lowest asked for while ``holder`` (and any other holder) holds it."""
        with self._lock:
            if not self._holders:
                self._original = sys.getswitchinterval()
            self._holders[id(holder)] = seconds
            sys.setswitchinterval(min(self._holders.values()))

    def release(self, holder: object) -> None:
        """``holder`` is done: put back the interval found by the first holder once no holder is left."""
        with self._lock:
            if self._holders.pop(id(holder), None) is None:
                return
            if self._holders:
                sys.setswitchinterval(min(self._holders.values()))
            elif self._original is not None:
                sys.setswitchinterval(self._original)
                self._original = None


#: The one GIL switch interval setting every checkpointer of the process shares.
SWITCH_INTERVAL = SwitchInterval()


def thread_ids() -> set[int]:
    """This process's thread ids (empty where /proc is missing).

    Example:
        >>> import threading
        >>> threading.get_native_id() in thread_ids() or not thread_ids()
        True
    """
    try:
        return set(map(int, os.listdir("/proc/self/task")))
    except OSError:
        return set()


def call_with_timeout(function: Any, timeout_s: float | None, message: str) -> None:
    """``function()``, giving up after ``timeout_s`` seconds (None waits for ever) with CheckpointSaveError.

    ``function`` goes on in a daemon thread after a timeout; its own exception is raised here.

    Example:
        >>> call_with_timeout(lambda: None, 1.0, "too slow")
    """
    if timeout_s is None:
        function()
        return
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            function()
            outcome.append(None)
        except BaseException as error:  # handed back to the caller
            outcome.append(error)

    worker = threading.Thread(target=run, name="composerjax-checkpoint-wait", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        raise CheckpointSaveError(message)
    if outcome[0] is not None:
        raise outcome[0]


class _OrbaxTracebacks(logging.Filter):
    """Keep orbax's error log lines but drop their tracebacks (the cause is in our own error's message).

    A failed write makes orbax log the same chained traceback from several threads: hundreds of
    lines that bury the one error a user needs, which :class:`CheckpointSaveError` states.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and "orbax" in record.pathname:
            error = record.exc_info[1]
            record.msg = f"{record.getMessage()} ({first_line(error) if error else 'error'})"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


def _quiet_orbax_thread_errors(previous: Any) -> Any:
    """A ``threading.excepthook`` printing one line for an orbax writer thread's error, the rest as before."""

    def hook(args: Any) -> None:
        frames = []
        tb = args.exc_traceback
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        if any("orbax" in name for name in frames):
            print(f"composerjax: checkpoint writer thread {args.thread.name if args.thread else '?'} failed: "
                  f"{first_line(args.exc_value)}", file=sys.stderr, flush=True)
            return
        previous(args)

    hook.composerjax = True  # type: ignore[attr-defined]
    return hook


def _quiet_late_writes(previous: Any) -> Any:
    """A ``sys.unraisablehook`` folding writes that end after orbax's event loop closed into one line.

    When a save is abandoned (``fit`` failed, the disk is full), tensorstore completes the pending
    writes from its own threads after orbax closed the asyncio loop they report to; each completion
    is an unraisable ``RuntimeError: Event loop is closed`` that would print a bare traceback.
    """
    reported = []

    def hook(args: Any) -> None:
        frames = []
        tb = args.exc_traceback
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        late = (isinstance(args.exc_value, RuntimeError) and str(args.exc_value) == "Event loop is closed"
                and bool(frames) and all("asyncio" in name for name in frames))
        if not late:
            previous(args)
        elif not reported:
            reported.append(True)
            print("composerjax: an abandoned checkpoint's background writes ended after their event loop closed "
                  "(ignored)", file=sys.stderr, flush=True)

    hook.composerjax = True  # type: ignore[attr-defined]
    return hook


logging.getLogger("absl").addFilter(_OrbaxTracebacks())
if not getattr(sys.unraisablehook, "composerjax", False):
    sys.unraisablehook = _quiet_late_writes(sys.unraisablehook)
if not getattr(threading.excepthook, "composerjax", False):
    threading.excepthook = _quiet_orbax_thread_errors(threading.excepthook)
