r"""``composerjax launch``: run a training script as N local ``jax.distributed`` processes.

For development and tests on one machine: each process gets the launcher's variables
(``COMPOSERJAX_COORDINATOR``, ``COMPOSERJAX_NUM_PROCESSES``, ``COMPOSERJAX_PROCESS_ID``, ...),
and with ``devices_per_process`` its own K simulated CPU devices, so ``N x K`` devices in all.
Each process starts in a small bootstrap that imports composerjax (which starts
``jax.distributed`` from those variables) and then runs the script as ``__main__``: scripts need
no distributed boilerplate.

Output lines are streamed prefixed with ``[rank i]``. The launcher supervises the processes:

* **A process fails** (JAX aborts the others' collectives when a peer dies): the launcher stops
  the rest (SIGTERM, then SIGKILL after a grace period) and reports the rank that caused it, how
  it ended, and its last lines of output. A rank whose output shows that it lost a peer (gloo's
  "Connection closed by peer", the coordination service's "another task died", ...) is a
  victim, not the cause: the launcher blames a rank that failed on its own, even when a victim
  exited first.
* **A process hangs**: each process gets a heartbeat file (``COMPOSERJAX_HEARTBEAT_FILE``) that
  :func:`heartbeat` touches; the Trainer beats after every batch. Once any rank has beaten, a
  rank silent for ``heartbeat_timeout_s`` (since its last beat, or since it started) stops the
  job; the launcher names the rank silent longest and exits with status 124. Output does not
  count as progress: a rank printing in a loop can still be stuck.
* **The launcher gets SIGTERM or SIGINT**: it passes the signal on to every process, SIGKILLs
  whatever still runs after the grace period (a process blocked in a collective runs its Python
  signal handlers only once the collective returns), and exits with ``128 + signal``.

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
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from composerjax import dist

__all__ = [
    "HEARTBEAT_FILE_ENV",
    "HEARTBEAT_INTERVAL_S",
    "HUNG_STATUS",
    "LAST_LINES",
    "child_environment",
    "free_port",
    "heartbeat",
    "launch",
]

#: Lines of output kept per rank for the failure report.
LAST_LINES = 20
#: The variable naming this process's heartbeat file (set by the launcher, one file per rank).
HEARTBEAT_FILE_ENV = "COMPOSERJAX_HEARTBEAT_FILE"
#: :func:`heartbeat` touches its file at most once per this many seconds.
HEARTBEAT_INTERVAL_S = 1.0
#: The launcher's exit status when a rank made no progress for the heartbeat timeout (as ``timeout(1)``).
HUNG_STATUS = 124

# Each child runs this instead of `python script.py ARGS`: importing composerjax starts jax.distributed from the
# launcher's variables before the script can touch JAX's backend; _child_main then runs the script.
_BOOTSTRAP = "import composerjax.launch; composerjax.launch._child_main()"
_LAUNCHER_PID_ENV = "COMPOSERJAX_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1
# After the first failure, how long the launcher waits for the rest of the burst (peers fail within milliseconds),
# and how much longer when every rank that failed so far only lost a peer (the cause may be slower to exit).
_SETTLE_S = 1.0
_VICTIM_WAIT_S = 5.0
_HEARTBEAT_POLL_S = 0.25
# What a process prints when it fails because a peer went away: gloo's transport errors and the messages of
# jax.distributed's coordination service (as printed by jaxlib 0.4-0.10).
_PEER_LOST = re.compile(
    r"Gloo [\w -]+ failed"
    r"|Connection (?:closed|reset) by peer"
    r"|Socket closed"
    r"|another task died"
    r"|tasks are unhealthy"
    r"|stopped sending heartbeats"
    r"|heartbeat timeout\. This indicates that the remote task has failed"
    r"|Failed to send RPC to coordination service"
    r"|only expected if one of the tasks is unhealthy",
    re.IGNORECASE,
)

_next_beat = 0.0


def heartbeat() -> bool:
    """Tell ``composerjax launch`` that this process is making progress; a no-op outside the launcher.

    Touches the file named by ``COMPOSERJAX_HEARTBEAT_FILE`` at most once per
    :data:`HEARTBEAT_INTERVAL_S` (calls in between only read the clock, about 0.1 µs), so it can be
    called after every step. The Trainer calls it after each batch and during evaluation; a custom
    training loop under ``composerjax launch --heartbeat-timeout`` should call it as often (once any
    rank has beaten, a rank silent for the timeout stops the job). Errors (a removed file) are ignored.

    Returns:
        True when this call touched the heartbeat file.

    Example:
        A custom training loop beats once per step:

        >>> from composerjax.launch import heartbeat
        >>> for step in range(3):
        ...     loss = 0.5 * step  # one training step
        ...     _ = heartbeat()
        >>> heartbeat()  # not started by `composerjax launch`: nothing to touch
        False
    """
    global _next_beat
    now = time.monotonic()
    if now < _next_beat:
        return False
    _next_beat = now + HEARTBEAT_INTERVAL_S
    path = os.environ.get(HEARTBEAT_FILE_ENV)
    if not path:
        return False
    try:
        os.utime(path)
    except FileNotFoundError:
        try:
            open(path, "ab").close()
        except OSError:
            return False
    except OSError:
        return False
    return True


def launch(
    script: str | os.PathLike[str],
    args: Sequence[str],
    num_processes: int,
    devices_per_process: int | None = None,
    port: int | None = None,
    *,
    grace_period_s: float = 5.0,
    heartbeat_timeout_s: float | None = 1800.0,
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
        grace_period_s: When the launcher stops the processes (a failure, a heartbeat timeout, a signal to the
            launcher), how long they get between SIGTERM and SIGKILL.
        heartbeat_timeout_s: Once any process has called :func:`heartbeat`, stop the job when one has not for
            this many seconds (counting from its start until its first beat). 0 or None: no timeout.
        output: Where the ``[rank i]`` lines go (default ``sys.stdout``).
        errors: Where the report goes when the run fails (default ``sys.stderr``).

    Returns:
        0 when every process exits with 0; otherwise the exit code of the process that failed first
        (128 + signal number when a signal killed it), :data:`HUNG_STATUS` (124) after a heartbeat timeout,
        or 128 + signal number when the launcher received SIGTERM/SIGINT before any process failed.

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
    if isinstance(grace_period_s, bool) or not isinstance(grace_period_s, (int, float)) or not grace_period_s >= 0:
        raise ValueError(f"`grace_period_s` must be a number >= 0, got {grace_period_s!r}")
    if heartbeat_timeout_s is not None and (isinstance(heartbeat_timeout_s, bool)
                                            or not isinstance(heartbeat_timeout_s, (int, float))
                                            or not heartbeat_timeout_s >= 0):
        raise ValueError(f"`heartbeat_timeout_s` must be a number >= 0 (0: no timeout) or None, "
                         f"got {heartbeat_timeout_s!r}")
    if not os.path.isfile(script):
        raise FileNotFoundError(f"{script}: no such script")
    output = output if output is not None else sys.stdout
    errors = errors if errors is not None else sys.stderr
    coordinator = f"127.0.0.1:{port if port is not None else free_port()}"
    group = _ProcessGroup(output, grace_period_s, heartbeat_timeout_s or None)
    command = [sys.executable, "-u", "-c", _BOOTSTRAP, script, *map(str, args)]
    heartbeats = tempfile.mkdtemp(prefix="composerjax-launch-") if group.heartbeat_timeout_s else None
    try:
        commands = []
        for rank in range(num_processes):
            beat_file = None
            if heartbeats is not None:
                beat_file = os.path.join(heartbeats, f"rank-{rank}")
                open(beat_file, "ab").close()
            commands.append((command, child_environment(rank, num_processes, coordinator, devices_per_process,
                                                        heartbeat_file=beat_file)))
        with _forwarded_signals(group):
            group.start(commands)
            outcome = group.supervise()
    finally:
        if heartbeats is not None:
            shutil.rmtree(heartbeats, ignore_errors=True)
    if outcome is None:
        return 0
    errors.write(group.report(outcome))
    errors.flush()
    return outcome.status


def child_environment(
    rank: int, num_processes: int, coordinator: str, devices_per_process: int | None = None,
    base: dict[str, str] | None = None, heartbeat_file: str | None = None,
) -> dict[str, str]:
    """The environment of process ``rank``: ``base`` (default ``os.environ``) plus the launcher's variables.

    ``heartbeat_file`` (when given) becomes ``COMPOSERJAX_HEARTBEAT_FILE``, the file :func:`heartbeat` touches.

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
    if heartbeat_file is None:
        env.pop(HEARTBEAT_FILE_ENV, None)  # a launcher inside a launched process: not the outer one's file
    else:
        env[HEARTBEAT_FILE_ENV] = heartbeat_file
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
    lost_peer: str | None = None  # the first line of its output that shows it lost a peer
    heartbeat_file: str | None = None
    heartbeat_mtime: int | None = None  # st_mtime_ns when the launcher last looked
    last_progress: float = 0.0  # time.monotonic() of its start, then of each beat the launcher saw
    beaten: bool = False

    def how(self) -> str:
        """How it ended: ``exited with code 1``, ``was killed by signal SIGKILL (sent by the launcher)``..."""
        code = self.process.returncode
        if code is None:
            return "was still running"
        if code >= 0:
            return "exited with 0" if code == 0 else f"exited with code {code}"
        sent = " (sent by the launcher)" if -code in self.signals_sent else ""
        return f"was killed by signal {_signal_name(-code)}{sent}"


def _killed_outright(returncode: int) -> bool:
    """Killed by a signal other than the ones peers get when another process dies (abort, term)."""
    return returncode < 0 and -returncode not in (signal.SIGABRT, signal.SIGTERM)


def _blame(children: Sequence[_Child]) -> _Child:
    """The child that caused a failure, among those that exited non-zero.

    A child whose output shows it lost a peer is a victim: a child that failed on its own goes
    first, whenever it exited. Among those, the burst that started first counts (peers fail within
    milliseconds of each other); in it, a child killed outright (SIGKILL, SIGSEGV...) goes before
    one that exited or aborted, and otherwise the first to exit.
    """
    failed = [child for child in children
              if child.exit_time is not None and child.process.returncode not in (None, 0)]
    causes = [child for child in failed if child.lost_peer is None] or failed
    earliest = min(child.exit_time for child in causes)
    burst = [child for child in causes if child.exit_time - earliest < _SETTLE_S]
    return min(burst, key=lambda child: (not _killed_outright(child.process.returncode), child.exit_time))


@dataclass
class _Outcome:
    """Why the run did not succeed: a rank ``failed``, a rank ``hung``, or the launcher got a ``signal``."""

    kind: str
    status: int
    rank: int | None = None
    silent_s: float | None = None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


class _ProcessGroup:
    """The children of one launch: start them, stream their output, stop them all when one fails or hangs."""

    def __init__(self, output: IO[str], grace_period_s: float, heartbeat_timeout_s: float | None = None) -> None:
        self.children: list[_Child] = []
        self.exits: queue.Queue[tuple[int, int]] = queue.Queue()  # (rank, returncode) in the order they exit
        self.exited: set[int] = set()  # ranks taken from `exits`: their last lines are in
        self.output = output
        self.output_lock = threading.Lock()
        self.grace_period_s = grace_period_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.signals_received: list[int] = []
        self.outcome: _Outcome | None = None
        self.kill_at: float | None = None  # time.monotonic() when whatever still runs gets SIGKILL
        self.silence: dict[int, float] = {}  # at a heartbeat timeout: rank -> seconds since its last beat
        self._next_heartbeat_check = 0.0

    def start(self, commands: list[tuple[list[str], dict[str, str]]]) -> None:
        """Start one child per ``(command, env)``, rank by rank, then stream their output."""
        for rank, (command, env) in enumerate(commands):
            beat_file = env.get(HEARTBEAT_FILE_ENV)
            mtime = self._mtime(beat_file)
            process = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: signals reach the child and whatever it starts
            )
            self.children.append(_Child(rank, process, heartbeat_file=beat_file, heartbeat_mtime=mtime,
                                        last_progress=time.monotonic()))
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
            if child.lost_peer is None and _PEER_LOST.search(line):
                child.lost_peer = line.strip()
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

    def _next_exit(self, timeout: float) -> int | None:
        """The return code of the next child to exit within ``timeout`` seconds, or None.

        Short timeouts keep the launcher's signal handlers and deadlines running.
        """
        try:
            rank, returncode = self.exits.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        self.exited.add(rank)
        return returncode

    def supervise(self) -> _Outcome | None:
        """Wait for every child; on the first failure or heartbeat timeout stop the others.

        Returns:
            Why the run did not succeed, or None when every child exited with 0.
        """
        while len(self.exited) < len(self.children):
            returncode = self._next_exit(0.1)
            if returncode not in (None, 0) and self.outcome is None and not self.signals_received:
                self._settle()
                cause = _blame(self.children)
                self.outcome = _Outcome("failed", _exit_status(cause.process.returncode), cause.rank)
                self.stop(signal.SIGTERM)
            self._check_heartbeats()
            self._kill_when_due()
        if self.outcome is None and self.signals_received:
            self.outcome = _Outcome("signal", 128 + self.signals_received[0])
        return self.outcome

    def _settle(self) -> None:
        """After a first failure, take in the rest of the burst, and wait longer for a cause if all are victims."""
        start = time.monotonic()
        while len(self.exited) < len(self.children) and not self.signals_received:
            cause_seen = any(self.children[rank].process.returncode not in (None, 0)
                             and self.children[rank].lost_peer is None for rank in self.exited)
            remaining = start + _SETTLE_S + (0.0 if cause_seen else _VICTIM_WAIT_S) - time.monotonic()
            if remaining <= 0:
                break
            self._next_exit(min(0.1, remaining))
        deadline = time.monotonic() + 2.0  # children that exited but are not in `exits` yet: their last lines
        for child in self.children:
            if child.exit_time is not None and child.reader is not None:
                child.reader.join(timeout=max(0.0, deadline - time.monotonic()))

    def _check_heartbeats(self) -> None:
        """Stop the job when a running child has been silent for the heartbeat timeout (once any child has beaten)."""
        now = time.monotonic()
        if (self.heartbeat_timeout_s is None or self.outcome is not None or self.signals_received
                or now < self._next_heartbeat_check):
            return
        self._next_heartbeat_check = now + _HEARTBEAT_POLL_S
        running = [child for child in self.children if child.process.poll() is None]
        for child in running:
            mtime = self._mtime(child.heartbeat_file)
            if mtime is not None and mtime != child.heartbeat_mtime:
                child.heartbeat_mtime, child.last_progress, child.beaten = mtime, now, True
        if not running or not any(child.beaten for child in self.children):
            return
        silent = min(running, key=lambda child: child.last_progress)
        if now - silent.last_progress <= self.heartbeat_timeout_s:
            return
        self.silence = {child.rank: now - child.last_progress for child in running}
        self.outcome = _Outcome("hung", HUNG_STATUS, silent.rank, now - silent.last_progress)
        self.stop(signal.SIGTERM)

    @staticmethod
    def _mtime(path: str | None) -> int | None:
        if path is None:
            return None
        try:
            return os.stat(path).st_mtime_ns
        except OSError:
            return None

    def stop(self, signum: int) -> None:
        """Send ``signum`` to every child still running; SIGKILL whatever still runs after the grace period."""
        self.stop_all(signum)
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace_period_s

    def _kill_when_due(self) -> None:
        if self.kill_at is not None and time.monotonic() >= self.kill_at:
            self.kill_at = float("inf")  # once
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

    def report(self, outcome: _Outcome) -> str:
        """What went wrong, for the launcher's stderr: who, how each rank ended, the last lines of the one to blame."""
        blamed = self.children[outcome.rank] if outcome.rank is not None else None
        lines = []
        if outcome.kind == "failed":
            assert blamed is not None
            lines.append(f"composerjax launch: rank {blamed.rank} failed first: it {blamed.how()}.")
            if blamed.lost_peer is not None:
                shown = blamed.lost_peer if len(blamed.lost_peer) <= 160 else blamed.lost_peer[:157] + "..."
                lines.append(f"  (its output shows it lost a peer, and no rank failed on its own: {shown})")
        elif outcome.kind == "hung":
            assert blamed is not None and outcome.silent_s is not None
            lines.append(f"composerjax launch: rank {blamed.rank} made no progress for {outcome.silent_s:.1f} s "
                         f"(heartbeat timeout {self.heartbeat_timeout_s:g} s); stopped the job.")
            lines.append("  seconds since the last heartbeat: " + ", ".join(
                f"rank {rank} {seconds:.1f}" + ("" if self.children[rank].beaten else " (none yet)")
                for rank, seconds in sorted(self.silence.items())) + ".")
        names = ", ".join(map(_signal_name, self.signals_received))
        if outcome.kind == "signal":
            lines.append(f"composerjax launch: the launcher received {names} and passed it on to every process.")
        elif self.signals_received:
            lines.append(f"  (the launcher received {names} and passed it on to every process)")
        ends = []
        for child in self.children:
            if child is blamed and outcome.kind == "failed":
                continue
            victim = (" after losing a peer" if child.lost_peer is not None and child.process.returncode
                      and outcome.kind == "failed" else "")
            ends.append(f"rank {child.rank} {child.how()}{victim}")
        if ends:
            lines.append("  " + "; ".join(ends) + ".")
        if blamed is not None:
            if blamed.last_lines:
                lines.append(f"  last {len(blamed.last_lines)} lines of rank {blamed.rank}:")
                lines.extend(f"    {line}" for line in blamed.last_lines)
            else:
                lines.append(f"  rank {blamed.rank} printed nothing.")
        return "\n".join(lines) + "\n"


def _exit_status(returncode: int) -> int:
    """The launcher's exit status for a child's return code: the code, or 128 + the signal that killed it."""
    return returncode if returncode > 0 else 128 - returncode


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
    """While active, SIGINT/SIGTERM sent to the launcher go to every child; SIGKILL follows after the grace period.

    A second signal sends SIGKILL at once.
    """

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
        if repeated:
            self.group.stop_all(signal.SIGKILL)
        else:  # SIGKILL after the grace period: a process blocked in a collective defers its Python handlers
            self.group.stop(signum)

    def __exit__(self, *exc_info: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        if exc_info[0] is not None:  # the launcher itself failed: leave no process behind
            self.group.stop_all(signal.SIGKILL)
