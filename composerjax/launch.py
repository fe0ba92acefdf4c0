r"""``composerjax launch``: run a training script as N local ``jax.distributed`` processes.

For development and tests on one machine: each process gets the launcher's variables
(``COMPOSERJAX_COORDINATOR``, ``COMPOSERJAX_NUM_PROCESSES``, ``COMPOSERJAX_PROCESS_ID``, ...),
and with ``devices_per_process`` its own K simulated CPU devices, so ``N x K`` devices in all.
Each process starts in a small bootstrap that imports composerjax (which starts
``jax.distributed`` from those variables) and then runs the script as ``__main__``: scripts need
no distributed boilerplate.

Output lines are streamed prefixed with ``[rank i]``. When a process fails (JAX aborts the
others' collectives when a peer dies) the launcher stops the rest (SIGTERM, then SIGKILL after a
grace period) and reports the first rank that failed, how, and its last lines of output.

Example:
    >>> import pathlib, tempfile
    >>> script = pathlib.Path(tempfile.mkdtemp()) / 'hello.py'
    >>> _ = script.write_text(
    ...     'import jax\n'
    ...     'if jax.process_index() == 0:\n'
    ...     '    print(jax.process_count(), "processes,", jax.device_count(), "devices")\n')
    >>> launch(script, [], num_processes=2, devices_per_process=2)
    [rank 0] 2 processes, 4 devices
    0

From a shell: ``composerjax launch -n 2 --devices-per-process 2 train.py --epochs 3``.
"""

from __future__ import annotations

import collections
import ctypes
import os
import queue
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from composerjax import dist

__all__ = ["launch", "child_environment", "free_port", "LAST_LINES"]

#: Lines of output kept per rank for the failure report.
LAST_LINES = 20

# Each child runs this instead of `python script.py ARGS`: importing composerjax starts jax.distributed from the
# launcher's variables before the script can touch JAX's backend; _child_main then runs the script.
_BOOTSTRAP = "import composerjax.launch; composerjax.launch._child_main()"
_LAUNCHER_PID_ENV = "COMPOSERJAX_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def launch(
    script: str | os.PathLike[str],
    args: Sequence[str],
    num_processes: int,
    devices_per_process: int | None = None,
    port: int | None = None,
    *,
    grace_period_s: float = 5.0,
    output: IO[str] | None = None,
    errors: IO[str] | None = None,
) -> int:
    """Run ``python script ARGS`` as ``num_processes`` processes of one ``jax.distributed`` run; return the exit status.

    Args:
        script: The Python script every process runs (as ``__main__``).
        args: Its command-line arguments (``sys.argv[1:]`` in the script).
        num_processes: How many processes to start (ranks ``0 .. num_processes - 1``).
        devices_per_process: Simulated CPU devices per process (``--xla_force_host_platform_device_count``;
            ``JAX_PLATFORMS=cpu`` unless already set). None: JAX's default devices.
        port: The coordinator's port on 127.0.0.1; None picks a free one.
        grace_period_s: After a failure, how long the other processes get between SIGTERM and SIGKILL.
        output: Where the ``[rank i]`` lines go (default ``sys.stdout``).
        errors: Where the failure report goes (default ``sys.stderr``).

    Returns:
        0 when every process exits with 0; otherwise the first failed process's exit code
        (128 + signal number when a signal killed it).

    Raises:
        ValueError: A bad argument (the message names it and what is accepted).
        FileNotFoundError: ``script`` does not exist.

    Example:
        A script that only prints its rank (a training script runs the same way):

        >>> import io, pathlib, tempfile
        >>> script = pathlib.Path(tempfile.mkdtemp()) / "hello.py"
        >>> _ = script.write_text("import os, sys; print('rank', os.environ['COMPOSERJAX_PROCESS_ID'], sys.argv[1:])")
        >>> printed = io.StringIO()
        >>> launch(script, ["--epochs", "2"], num_processes=2, output=printed)
        0
        >>> for line in sorted(printed.getvalue().splitlines()):
        ...     print(line)
        [rank 0] rank 0 ['--epochs', '2']
        [rank 1] rank 1 ['--epochs', '2']
    """
    script = os.fspath(script)
    _check_count("num_processes", num_processes)
    if devices_per_process is not None:
        _check_count("devices_per_process", devices_per_process)
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        raise ValueError(f"`port` must be an integer in [1, 65535] or None (a free port), got {port!r}")
    if not isinstance(grace_period_s, (int, float)) or grace_period_s < 0:
        raise ValueError(f"`grace_period_s` must be a number >= 0, got {grace_period_s!r}")
    if not os.path.isfile(script):
        raise FileNotFoundError(f"{script}: no such script")
    output = output if output is not None else sys.stdout
    errors = errors if errors is not None else sys.stderr
    coordinator = f"127.0.0.1:{port if port is not None else free_port()}"
    group = _ProcessGroup(output, grace_period_s)
    command = [sys.executable, "-u", "-c", _BOOTSTRAP, script, *map(str, args)]
    with _forwarded_signals(group):
        group.start([(command, child_environment(rank, num_processes, coordinator, devices_per_process))
                     for rank in range(num_processes)])
        failure = group.supervise()
    if failure is None:
        return 0
    errors.write(group.report(failure))
    errors.flush()
    return failure.status


def child_environment(
    rank: int, num_processes: int, coordinator: str, devices_per_process: int | None = None,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of process ``rank``: ``base`` (default ``os.environ``) plus the launcher's variables.

    Example:
        >>> env = child_environment(1, 2, '127.0.0.1:1234', devices_per_process=2,
        ...                         base={'XLA_FLAGS': '--xla_dump_to=/d'})
        >>> env['COMPOSERJAX_PROCESS_ID'], env['XLA_FLAGS'], env['JAX_PLATFORMS']
        ('1', '--xla_dump_to=/d --xla_force_host_platform_device_count=2', 'cpu')
    """
    env = dict(os.environ if base is None else base)
    env.update({
        dist.COORDINATOR_ENV: coordinator,
        dist.NUM_PROCESSES_ENV: str(num_processes),
        dist.PROCESS_ID_ENV: str(rank),
        dist.LOCAL_RANK_ENV: str(rank),
        dist.NODE_RANK_ENV: "0",
        "PYTHONUNBUFFERED": "1",
        _LAUNCHER_PID_ENV: str(os.getpid()),
    })
    if devices_per_process is None:
        env.pop(dist.DEVICES_PER_PROCESS_ENV, None)
        return env
    env[dist.DEVICES_PER_PROCESS_ENV] = str(devices_per_process)
    flags = [flag for flag in env.get("XLA_FLAGS", "").split()
             if not flag.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_process}"])
    if not env.get("JAX_PLATFORMS"):
        env["JAX_PLATFORMS"] = "cpu"
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}")


@dataclass
class _Child:
    rank: int
    process: subprocess.Popen[bytes]
    last_lines: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=LAST_LINES))
    reader: threading.Thread | None = None
    signals_sent: list[int] = field(default_factory=list)
    exit_time: float | None = None


def _killed_outright(returncode: int) -> bool:
    """Killed by a signal other than the ones peers get when another process dies (abort, term)."""
    return returncode < 0 and -returncode not in (signal.SIGABRT, signal.SIGTERM)


@dataclass
class _Failure:
    rank: int
    returncode: int

    @property
    def status(self) -> int:
        """The launcher's exit status: the exit code, or 128 + the signal that killed the process."""
        return self.returncode if self.returncode > 0 else 128 - self.returncode

    def describe(self) -> str:
        if self.returncode > 0:
            return f"exited with code {self.returncode}"
        return f"was killed by signal {_signal_name(-self.returncode)}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


class _ProcessGroup:
    """The children of one launch: start them, stream their output, stop them all when one fails."""

    def __init__(self, output: IO[str], grace_period_s: float) -> None:
        self.children: list[_Child] = []
        self.exits: queue.Queue[tuple[int, int]] = queue.Queue()  # (rank, returncode) in the order they exit
        self.output = output
        self.output_lock = threading.Lock()
        self.grace_period_s = grace_period_s
        self.signals_received: list[int] = []

    def start(self, commands: list[tuple[list[str], dict[str, str]]]) -> None:
        """Start one child per ``(command, env)``, rank by rank, then stream their output."""
        for rank, (command, env) in enumerate(commands):
            process = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: signals reach the child and whatever it starts
            )
            self.children.append(_Child(rank, process))
        for child in self.children:
            child.reader = threading.Thread(target=self._stream, args=(child,), name=f"launch-rank-{child.rank}",
                                            daemon=True)
            child.reader.start()
            threading.Thread(target=self._wait, args=(child,), name=f"launch-wait-{child.rank}", daemon=True).start()

    def _stream(self, child: _Child) -> None:
        """Copy the child's output line by line with a ``[rank i]`` prefix."""
        assert child.process.stdout is not None
        for raw in iter(child.process.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            child.last_lines.append(line)
            with self.output_lock:
                try:
                    self.output.write(f"[rank {child.rank}] {line}\n")
                    self.output.flush()
                except (OSError, ValueError):  # our own output was closed: keep draining the pipe
                    pass
        child.process.stdout.close()

    def _wait(self, child: _Child) -> None:
        """Record the child's exit once its last lines are in (a process it started may hold the pipe)."""
        returncode = child.process.wait()
        child.exit_time = time.monotonic()
        assert child.reader is not None
        child.reader.join(timeout=2.0)
        self.exits.put((child.rank, returncode))

    def supervise(self) -> _Failure | None:
        """Wait for every child; on the first failure stop the others. Returns that failure, or None."""
        failure: _Failure | None = None
        running = len(self.children)
        while running:
            try:
                _, returncode = self.exits.get(timeout=0.2)  # a timeout keeps signal handlers running
            except queue.Empty:
                continue
            running -= 1
            if returncode != 0 and failure is None:
                # A peer's death makes the others fail within milliseconds (a collective error, or
                # JAX's own abort), and exit threads can report in either order: let the burst
                # settle, then blame a process killed outright (SIGKILL, SIGSEGV...) over one
                # that merely exited or aborted, and otherwise the one that went first.
                settle = time.monotonic() + 1.0
                while running and time.monotonic() < settle:
                    try:
                        self.exits.get(timeout=max(0.0, settle - time.monotonic()))
                        running -= 1
                    except queue.Empty:
                        break
                failed = [child for child in self.children
                          if child.exit_time is not None and child.process.returncode not in (None, 0)]
                earliest = min(child.exit_time for child in failed)
                burst = [child for child in failed if child.exit_time - earliest < 1.0]
                first = min(burst, key=lambda child: (not _killed_outright(child.process.returncode),
                                                      child.exit_time))
                failure = _Failure(first.rank, first.process.returncode)
                self.stop_all(signal.SIGTERM)
                threading.Thread(target=self._kill_after_grace, daemon=True).start()
        return failure

    def _kill_after_grace(self) -> None:
        deadline = time.monotonic() + self.grace_period_s
        while time.monotonic() < deadline and any(child.process.poll() is None for child in self.children):
            time.sleep(0.05)
        self.stop_all(signal.SIGKILL)

    def stop_all(self, signum: int) -> None:
        """Send ``signum`` to every child still running and to the processes it started.

        Rank 0 goes last: it hosts jax.distributed's coordination service, and the others abort as
        soon as it is gone, before they could handle the signal themselves.
        """
        for child in reversed(self.children):
            if child.process.poll() is not None:
                continue
            child.signals_sent.append(signum)
            try:
                os.killpg(child.process.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def report(self, failure: _Failure) -> str:
        failed = self.children[failure.rank]
        others = []
        for child in self.children:
            if child.rank == failure.rank:
                continue
            code = child.process.returncode
            how = "exited with 0" if code == 0 else _Failure(child.rank, code).describe()
            sent = " (sent by the launcher)" if code is not None and -code in child.signals_sent else ""
            others.append(f"rank {child.rank} {how}{sent}")
        lines = [f"composerjax launch: rank {failure.rank} failed first: it {failure.describe()}."]
        if self.signals_received:
            lines.append(f"  (the launcher received {', '.join(map(_signal_name, self.signals_received))} "
                         "and passed it on to every process)")
        if others:
            lines.append("  " + "; ".join(others) + ".")
        if failed.last_lines:
            lines.append(f"  last {len(failed.last_lines)} lines of rank {failure.rank}:")
            lines.extend(f"    {line}" for line in failed.last_lines)
        else:
            lines.append(f"  rank {failure.rank} printed nothing.")
        return "\n".join(lines) + "\n"


def _child_main() -> None:
    """In a child: run SCRIPT as ``python SCRIPT ARGS`` would (argv, sys.path, ``__main__``); die with the launcher."""
    if sys.platform.startswith("linux"):
        # No process may outlive the launcher (a killed test run, a closed terminal): SIGKILL when it dies.
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
        if os.environ.get(_LAUNCHER_PID_ENV) not in (None, str(os.getppid())):
            raise SystemExit("composerjax launch: the launcher exited before this process started")
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except BaseException as error:  # SystemExit and KeyboardInterrupt too: every failure ends the same way
        _exit_failed(error)


def _exit_failed(error: BaseException) -> None:
    """Report why the script failed and end the process now, with a non-zero status.

    A normal exit would run jax.distributed's shutdown barrier, which waits (up to 5 minutes) for
    peers that are still computing or blocked in a collective with this process; leaving at once
    lets the launcher see the failure and stop the others.
    """
    if isinstance(error, SystemExit):
        if error.code is None or error.code == 0:
            raise error
        status = error.code if isinstance(error.code, int) else 1
        if not isinstance(error.code, int):
            print(error.code, file=sys.stderr)
    else:
        frames = error.__traceback__  # from the script's own frames on, as `python SCRIPT` shows it
        while frames is not None and (frames.tb_frame.f_code.co_filename == __file__
                                      or "runpy" in frames.tb_frame.f_code.co_filename):
            frames = frames.tb_next
        traceback.print_exception(type(error), error, frames)
        status = 130 if isinstance(error, KeyboardInterrupt) else 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


class _forwarded_signals:
    """While active, SIGINT/SIGTERM sent to the launcher go to every child; a second one sends SIGKILL."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, group: _ProcessGroup) -> None:
        self.group = group
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _forwarded_signals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self.previous[signum] = signal.signal(signum, self._forward)
        return self

    def _forward(self, signum: int, frame: Any) -> None:
        repeated = signum in self.group.signals_received
        self.group.signals_received.append(signum)
        self.group.stop_all(signal.SIGKILL if repeated else signum)

    def __exit__(self, *exc_info: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        if exc_info[0] is not None:  # the launcher itself failed: leave no process behind
            self.group.stop_all(signal.SIGKILL)
