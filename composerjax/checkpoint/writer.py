"""The writing side of checkpoints: the save folder's layout, its owner lock, writer-thread priority, orbax's errors.

* :func:`format_name`: a checkpoint's folder name from a template (``'ep{epoch}-ba{batch}'``), as
  Composer formats ``save_filename``; :func:`list_checkpoints` finds the complete checkpoints of a
  folder, ordered by the clock each one recorded (not by name); :func:`point_latest` keeps the
  ``latest`` link to the newest verified one.
* :class:`OwnerLock`: an exclusive ``flock`` on ``<save folder>/.composerjax-owner`` held while a run
  writes checkpoints there, so two live runs never write one folder.
* :data:`SWITCH_INTERVAL` and :func:`thread_ids`: while a save is in flight the interpreter's GIL switch
  interval is lowered, and the threads orbax starts to write are found (to lower their priority), so
  the train loop is not stalled by the writer.
* :func:`call_with_timeout`: wait for orbax with a deadline.
* Importing this module makes orbax's writer-thread errors print one line each instead of a traceback
  per thread (the cause is in :class:`~composerjax.checkpoint.checks.CheckpointSaveError`).

Example:
    >>> call_with_timeout(lambda: None, timeout_s=None, message="unused")
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import string
import sys
import threading
import time
from typing import Any, NamedTuple

from composerjax.checkpoint.checks import CheckpointSaveError, SaveFolderInUseError, first_line
from composerjax.parallel import dist

__all__ = ["NAME_FIELDS", "OWNER_FILE", "REPLACED", "SWITCH_INTERVAL", "CheckpointInfo", "OwnerLock", "SwitchInterval",
           "call_with_timeout", "check_template", "format_name", "list_checkpoints", "point_latest", "read_info",
           "remove_checkpoint", "resolve_pointer", "thread_ids"]

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
            CheckpointSaveError: the folder cannot be created or the owner file cannot be written (the message
                names save_folder).
        """
        with cls._guard:
            if folder in cls._held:
                cls._held[folder][1] += 1
                return cls(folder)
            path = os.path.join(folder, OWNER_FILE)
            try:
                os.makedirs(folder, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as error:  # read-only, no permission, a file on the way: the folder is unusable
                raise CheckpointSaveError(_unwritable(folder, error)) from error
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
                raise CheckpointSaveError(_unwritable(folder, error)) from error
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


def _unwritable(folder: str, error: OSError) -> str:
    """The message for a save folder this process cannot create or write into."""
    return (f"save_folder={folder!r} cannot be written ({first_line(error)}); expected a folder this process can "
            "create and write files in: pass a writable save_folder, or save_folder=None to save no checkpoints")


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


# -- the save folder's layout -----------------------------------------------------------------------
#: Marks of folders in a save folder that are not (yet, or any more) checkpoints: orbax's folder for a
#: checkpoint being written, and ours for one being deleted.
_TMP_MARK = ".orbax-checkpoint-tmp"
_DELETING = ".composerjax-deleting"
#: A checkpoint moved aside while a save of the same name replaces it (``save_overwrite=True``); it is
#: deleted once the new one is verified, and loads under its own name until then.
REPLACED = ".composerjax-replaced"
_STEP_METADATA = "_CHECKPOINT_METADATA"
#: The fields a name template may use (Composer's ``format_name_with_dist_and_time``).
NAME_FIELDS = ("run_name", "rank", "local_rank", "node_rank", "world_size", "epoch", "batch", "batch_in_epoch",
               "sample", "sample_in_epoch", "token", "token_in_epoch", "iteration", "total_wct", "epoch_wct",
               "batch_wct")


class _Fields(dict):
    """The template fields of one moment of a run, computed when a template asks for them."""

    def __init__(self, counts: dict[str, Any], run_name: str, rank: int | None = None) -> None:
        super().__init__()
        self.counts, self.run_name, self.rank = counts, run_name, rank

    def __missing__(self, key: str) -> Any:
        if key == "run_name":
            return self.run_name
        if key == "rank":
            return dist.process_index() if self.rank is None else self.rank
        if key == "local_rank":
            return dist.local_process_index() if self.rank is None else self.rank
        if key == "node_rank":
            return dist.node_rank() if self.rank is None else self.rank
        if key == "world_size":
            return dist.process_count() if self.rank is None else 1
        if key in NAME_FIELDS:
            value = self.counts.get(key, 0)
            return float(value) if key.endswith("_wct") else int(value)
        raise KeyError(key)


def format_name(template: str, timestamp: Any, run_name: str, field: str = "save_filename", path: bool = False,
                ) -> str:
    """The checkpoint folder name ``template`` gives at ``timestamp``: ``'ep{epoch}-ba{batch}'`` -> ``'ep1-ba8'``.

    Fields: ``{run_name}``, ``{rank}`` (the process index), ``{local_rank}``, ``{node_rank}``,
    ``{world_size}`` (the process count), the clock's counters (``{epoch}``, ``{batch}``,
    ``{batch_in_epoch}``, ``{sample}``, ``{sample_in_epoch}``, ``{token}``, ``{token_in_epoch}``,
    ``{iteration}``) and its wall-clock seconds (``{total_wct}``, ``{epoch_wct}``, ``{batch_wct}``);
    format specs work (``{batch:06d}``).

    Raises:
        ValueError: an unknown field, or a name that is not one folder name (empty, hidden, a path).

    Example:
        >>> from composerjax.core.time import Timestamp
        >>> format_name("ep{epoch}-ba{batch:04d}", Timestamp(epoch=1, batch=8), "my-run")
        'ep1-ba0008'
    """
    counts = timestamp.state_dict() if hasattr(timestamp, "state_dict") else dict(timestamp)
    return _format(template, _Fields(counts, run_name), field, path)


def _format(template: str, fields: _Fields, field: str, path: bool = False) -> str:
    if not isinstance(template, str):
        raise ValueError(f"{field}={template!r}: expected a name template such as 'ep{{epoch}}-ba{{batch}}'")
    try:
        name = string.Formatter().vformat(template, (), fields)
    except KeyError as error:
        raise ValueError(f"{field}={template!r}: unknown field {{{error.args[0]}}}; the fields are "
                         f"{', '.join('{' + f + '}' for f in NAME_FIELDS)}") from None
    except (IndexError, ValueError) as error:
        raise ValueError(f"{field}={template!r}: not a name template ({error}); name fields as in "
                         "'ep{epoch}-ba{batch}'") from None
    if path:  # a folder or remote object path: slashes allowed, still not empty
        if not name.strip("/"):
            raise ValueError(f"{field}={template!r} gives {name!r}: expected a non-empty path")
        return name
    if not name or name in (".", "..") or name.startswith(".") or "/" in name or os.sep in name or (
            _TMP_MARK in name or name.endswith((_DELETING, REPLACED))):
        raise ValueError(f"{field}={template!r} gives {name!r}: expected one folder name inside the save folder "
                         "(not empty, not hidden, no '/')")
    return name


def check_template(template: str, field: str = "save_filename", one_per_run: bool = True, path: bool = False) -> bool:
    """Refuse a name template that cannot name a checkpoint folder; return whether its name differs by process.

    With ``one_per_run``, a template whose name changes with the process (``{rank}``,
    ``{local_rank}``, ``{node_rank}``) is refused when several processes run: every process writes
    its part of the same checkpoint folder.

    Raises:
        ValueError: naming ``field``.

    Example:
        >>> check_template("ep{epoch}-ba{batch}"), check_template("latest-rank{rank}", one_per_run=False)
        (False, True)
    """
    names = {_format(template, _Fields({}, "run", rank), field, path) for rank in (0, 1)}
    if one_per_run and len(names) > 1 and dist.process_count() > 1:
        raise ValueError(f"{field}={template!r}: a checkpoint is one folder that every process writes its part "
                         "of; a name that differs by process ({rank}, {local_rank}, {node_rank}) would split it")
    return len(names) > 1


class CheckpointInfo(NamedTuple):
    """One complete checkpoint in a save folder, as :func:`list_checkpoints` finds it.

    Attributes:
        name: its name in the folder (what the template gave).
        path: its folder (the moved-aside copy's while a replacement is being written).
        batch: the batch count it recorded (-1 when unreadable: listed oldest, so tried last).
        weights_only: it holds the model's variables only.
        rotate: it counts towards ``num_checkpoints_to_keep`` (the saver's own saves do;
            ``Trainer.save_checkpoint`` ones are kept).
        committed_ns: when orbax committed it (orders checkpoints of the same batch).
    """

    name: str
    path: str
    batch: int
    weights_only: bool
    rotate: bool
    committed_ns: int


def read_info(path: str, name: str | None = None) -> CheckpointInfo:
    """What checkpoint folder ``path`` recorded about itself (orbax's ``_CHECKPOINT_METADATA``), cheaply.

    The clock comes from the ``composerjax`` entry composerjax writes there; for checkpoints written
    before it did, from the host record in the ``meta`` item, else from a numeric folder name.

    Example:
        >>> import tempfile
        >>> read_info(tempfile.mkdtemp(), "8").batch
        8
    """
    name = name or os.path.basename(path)
    record, committed = {}, 0
    try:
        with open(os.path.join(path, _STEP_METADATA)) as handle:
            step = json.load(handle)
        record = (step.get("custom_metadata") or {}).get("composerjax") or {}
        committed = int(step.get("commit_timestamp_nsecs") or step.get("init_timestamp_nsecs") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    batch = record.get("batch") if isinstance(record, dict) else None
    weights_only = bool(record.get("weights_only", False)) if isinstance(record, dict) else False
    if not isinstance(batch, int):
        batch, weights_only = _batch_from_meta(path, name)
    rotate = bool(record.get("rotate", True)) if isinstance(record, dict) else True
    return CheckpointInfo(name, path, batch, weights_only, rotate, committed)


def _batch_from_meta(path: str, name: str) -> tuple[int, bool]:
    try:
        with open(os.path.join(path, "meta", "metadata")) as handle:
            host = json.load(handle)["host"]
        return int(host["timestamp"]["batch"]), bool(host.get("weights_only", False))
    except (OSError, ValueError, TypeError, KeyError):
        base = name.split(".")[0]
        return (int(base) if base.isdigit() else -1), False


def list_checkpoints(folder: str, cache: dict[str, tuple[int, CheckpointInfo]] | None = None) -> list[CheckpointInfo]:
    """The complete checkpoints in ``folder``, oldest first by the clock they recorded (then commit time).

    Skipped: orbax's temporary folders (a checkpoint still being written, or abandoned), folders
    being deleted, links (``latest``) and files. A checkpoint moved aside for a replacement counts
    under its own name until the replacement exists. ``cache`` (name -> (mtime, info)) saves
    re-reading checkpoints already seen.

    Example:
        >>> import tempfile
        >>> list_checkpoints(tempfile.mkdtemp())
        []
    """
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    names = {entry.name for entry in entries}
    found = []
    for entry in entries:
        name = entry.name
        if name.startswith(".") or _TMP_MARK in name or name.endswith(_DELETING) or entry.is_symlink() or (
                not entry.is_dir()):
            continue
        if name.endswith(REPLACED):
            name = name[: -len(REPLACED)]
            if name in names:  # the replacement is complete: the old copy is about to go
                continue
        if not any(os.path.exists(os.path.join(entry.path, item)) for item in (_STEP_METADATA, "meta", "state")):
            continue
        stamp = entry.stat().st_mtime_ns
        seen = cache.get(entry.name) if cache is not None else None
        info = seen[1] if seen is not None and seen[0] == stamp else read_info(entry.path, name)
        if cache is not None:
            cache[entry.name] = (stamp, info)
        found.append(info)
    return sorted(found, key=lambda info: (info.batch, info.committed_ns, info.name))


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint folder: renamed first (atomic), so a half-deleted one is never listed.

    Example:
        >>> import tempfile
        >>> remove_checkpoint(tempfile.mkdtemp())
    """
    doomed = path.rstrip(os.sep) + _DELETING
    try:
        os.replace(path, doomed)
    except FileNotFoundError:
        return
    except OSError:
        doomed = path
    if os.path.isdir(doomed) and not os.path.islink(doomed):
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        os.remove(doomed)


def point_latest(folder: str, link: str, target: str) -> str:
    """Point ``folder/link`` at checkpoint ``target`` (a relative symlink, replaced atomically); return its kind.

    Where the file system has no symlinks, ``link`` becomes a small file holding ``target``'s name
    (``load_path`` follows either). Returns ``'symlink'`` or ``'file'``.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> os.mkdir(os.path.join(folder, "ep1-ba8"))
        >>> point_latest(folder, "latest", "ep1-ba8"), os.path.realpath(os.path.join(folder, "latest"))[-7:]
        ('symlink', 'ep1-ba8')
    """
    staged = os.path.join(folder, f".{link}.{os.getpid()}.tmp")
    final = os.path.join(folder, link)
    if os.path.isdir(final) and not os.path.islink(final):
        raise OSError(f"{final!r} is a checkpoint folder, not a link; choose another latest_filename")
    try:
        if os.path.lexists(staged):
            os.remove(staged)
        os.symlink(target, staged)
        kind = "symlink"
    except OSError:
        with open(staged, "w") as handle:
            handle.write(target + "\n")
        kind = "file"
    os.replace(staged, final)
    return kind


def resolve_pointer(path: str) -> str:
    """The checkpoint folder ``path`` names: itself, or what a ``latest`` link or pointer file points at.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> resolve_pointer(folder) == folder
        True
    """
    if os.path.islink(path):
        return os.path.realpath(path)
    if os.path.isfile(path) and os.path.getsize(path) < 4096:
        with open(path) as handle:
            target = handle.read().strip()
        candidate = os.path.join(os.path.dirname(path), target)
        if target and "/" not in target and os.path.isdir(candidate):
            return candidate
    return path


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
