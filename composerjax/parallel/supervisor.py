"""Supervising the processes of ``composerjax launch``: stream their output, blame a failure, stop a hung job.

:class:`ProcessGroup` starts the children of one launch and watches them: it prefixes their output
with ``[rank i]``, tells a rank that failed on its own from one that only lost a peer (see
:data:`LAST_LINES` for what the report keeps), stops every rank when one fails or stays silent past
the heartbeat timeout, and writes the report. :class:`forwarded_signals` passes SIGINT/SIGTERM sent
to the launcher on to the children. :func:`composerjax.parallel.launch.launch` is the entry point.
"""

from __future__ import annotations

import collections
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from composerjax.parallel.heartbeat import HEARTBEAT_FILE_ENV, HUNG_STATUS

__all__ = ["LAST_LINES", "ProcessGroup", "forwarded_signals"]

#: Lines of output kept per rank for the failure report.
LAST_LINES = 20

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


class ProcessGroup:
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


class forwarded_signals:
    """While active, SIGINT/SIGTERM sent to the launcher go to every child; SIGKILL follows after the grace period.

    A second signal sends SIGKILL at once. Outside the main thread it changes nothing (only the main
    thread may set signal handlers).

    Example:
        >>> import io
        >>> group = ProcessGroup(io.StringIO(), grace_period_s=1.0)
        >>> with forwarded_signals(group):
        ...     pass  # group.start(...) and group.supervise() run here
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> forwarded_signals:
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
