"""``composerjax launch`` under failure: a hung rank, a SIGTERM while ranks are blocked, blame among victims.

Real processes and real signals. Each launcher runs in its own process (``python -c ... launch(...)``) so
that it can be signalled and timed. The scenarios are built so that their outcome does not depend on timing:
a hung rank has beaten once while its peer keeps beating; the ranks the launcher must SIGKILL cannot leave on
their own (one ignores SIGTERM, the other waits in a collective its peer never joins); the rank that only lost
a peer exits first, on purpose.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import composerjax.parallel.heartbeat as heartbeat_module
from composerjax.parallel.heartbeat import HEARTBEAT_FILE_ENV, HUNG_STATUS, heartbeat
from composerjax.parallel.launch import child_environment, launch
from composerjax.parallel.supervisor import _PEER_LOST, _blame, _Child

LAUNCHER = textwrap.dedent(
    """
    import sys
    from composerjax.parallel.launch import launch
    sys.exit(launch(sys.argv[1], [], num_processes=2, devices_per_process=1, grace_period_s=float(sys.argv[2]),
                    heartbeat_timeout_s=float(sys.argv[3])))
    """
)


def start_launcher(script: Path, grace_period_s: float = 1.0, heartbeat_timeout_s: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, str(script), str(grace_period_s),
                             str(heartbeat_timeout_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_launcher(script: Path, grace_period_s: float = 1.0, heartbeat_timeout_s: float = 0.0,
                 timeout: float = 60) -> tuple[int, str, str, float]:
    """(status, stdout, stderr, seconds) of one launch."""
    start = time.monotonic()
    launcher = start_launcher(script, grace_period_s, heartbeat_timeout_s)
    try:
        stdout, stderr = launcher.communicate(timeout=timeout)
    finally:
        launcher.kill()
    return launcher.returncode, stdout, stderr, time.monotonic() - start


def report_of(stderr: str) -> str:
    assert "composerjax launch: " in stderr, stderr
    return stderr[stderr.index("composerjax launch: "):]


# -- heartbeats --------------------------------------------------------------------------------------
def test_heartbeat_touches_the_launchers_file_at_most_once_a_second(tmp_path, monkeypatch):
    beat_file = tmp_path / "rank-0"
    monkeypatch.setattr(heartbeat_module, "_next_beat", 0.0)
    monkeypatch.delenv(HEARTBEAT_FILE_ENV, raising=False)
    assert heartbeat() is False and not beat_file.exists()  # outside the launcher: nothing to do

    monkeypatch.setattr(heartbeat_module, "_next_beat", 0.0)
    monkeypatch.setenv(HEARTBEAT_FILE_ENV, str(beat_file))
    assert heartbeat() is True and beat_file.exists()  # a missing file is created
    os.utime(beat_file, ns=(0, 0))
    assert heartbeat() is False and beat_file.stat().st_mtime_ns == 0  # within the interval: only the clock
    monkeypatch.setattr(heartbeat_module, "_next_beat", time.monotonic() - 0.001)
    assert heartbeat() is True and beat_file.stat().st_mtime_ns > 0

    monkeypatch.setattr(heartbeat_module, "_next_beat", 0.0)
    monkeypatch.setenv(HEARTBEAT_FILE_ENV, str(tmp_path / "no" / "such" / "dir"))
    assert heartbeat() is False  # errors are ignored


def test_each_rank_gets_its_own_heartbeat_file_and_only_from_this_launcher():
    env = child_environment(1, 2, "127.0.0.1:5555", heartbeat_file="/tmp/beats/rank-1",
                            base={HEARTBEAT_FILE_ENV: "/outer/rank-0"})
    assert env[HEARTBEAT_FILE_ENV] == "/tmp/beats/rank-1"
    assert HEARTBEAT_FILE_ENV not in child_environment(1, 2, "127.0.0.1:5555", base={HEARTBEAT_FILE_ENV: "/outer"})


def test_a_rank_that_stops_beating_is_named_and_the_job_stopped(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(textwrap.dedent(
        f"""
        import os, time
        import jax
        from composerjax.parallel.heartbeat import heartbeat

        marker = {str(tmp_path / "rank-0-beats")!r}
        if jax.process_index() == 1:
            while not os.path.exists(marker):  # rank 1's only beat comes after rank 0's first
                time.sleep(0.01)
            heartbeat()
            print("rank 1 stuck", flush=True)
            time.sleep(600)
        heartbeat()
        open(marker, "w").close()
        while True:  # rank 0 keeps making progress
            heartbeat()
            time.sleep(0.05)
        """
    ))
    status, _, stderr, _ = run_launcher(script, heartbeat_timeout_s=3.0, timeout=300)
    assert status == HUNG_STATUS == 124, stderr
    report = report_of(stderr)
    first = report.splitlines()[0]
    # How long past the timeout the launcher noticed depends on the machine's load: any time from 3 s on.
    assert re.fullmatch(r"composerjax launch: rank 1 made no progress for ([3-9]|\d\d+)\.\d s "
                        r"\(heartbeat timeout 3 s\); stopped the job\.", first), first
    # SIGTERM, or SIGKILL after the grace period: jax.distributed's preemption notifier catches SIGTERM.
    assert re.search(r"rank 0 was killed by signal SIG(TERM|KILL) \(sent by the launcher\); "
                     r"rank 1 was killed by signal SIG(TERM|KILL) \(sent by the launcher\)\.", report), report
    assert "seconds since the last heartbeat: rank 0 " in report
    assert "    rank 1 stuck" in report.split("lines of rank 1:")[1]


def test_a_script_that_never_beats_is_not_timed(tmp_path):
    script = tmp_path / "quiet.py"
    # Importing composerjax alone takes longer than the timeout. Both ranks leave jax.distributed before exiting:
    # a rank that exits without it makes JAX abort the other.
    script.write_text("import os, time, jax\ntime.sleep(1.0)\njax.distributed.shutdown()\nos._exit(0)\n")
    status, _, stderr, _ = run_launcher(script, heartbeat_timeout_s=0.5)
    assert status == 0, stderr
    assert "composerjax launch" not in stderr


# -- SIGTERM to the launcher -----------------------------------------------------------------------
def test_sigterm_to_the_launcher_ends_ranks_blocked_in_a_collective_or_ignoring_it(tmp_path):
    script = tmp_path / "blocked.py"
    script.write_text(textwrap.dedent(
        """
        import signal, sys, time
        import jax
        from composerjax.parallel import dist

        dist.barrier("started")
        if jax.process_index() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print("ready", flush=True)
            time.sleep(600)
        stopping = []
        signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))  # as the Trainer does
        print("ready", flush=True)
        dist.barrier("never")  # rank 0 never comes: the handler cannot run before this returns
        print("left the collective", flush=True)
        sys.exit(143)
        """
    ))
    launcher = start_launcher(script, grace_period_s=1.0)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in launcher.stdout:
            lines.append(line.rstrip("\n"))
            if sum(line.endswith("] ready") for line in lines) == 2:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(300), lines  # a hang guard
        launcher.send_signal(signal.SIGTERM)
        status = launcher.wait(300)  # a hang guard: rank 0 ignores SIGTERM and sleeps 600 s
        stderr = launcher.stderr.read()
    finally:
        launcher.kill()
    reader.join(5)
    assert status == 128 + signal.SIGTERM == 143, stderr
    # Both ranks outlived the grace period and were killed: the launcher escalated instead of waiting for them.
    report = report_of(stderr)
    assert report.startswith("composerjax launch: the launcher received SIGTERM and passed it on to every process.")
    assert ("rank 0 was killed by signal SIGKILL (sent by the launcher); "
            "rank 1 was killed by signal SIGKILL (sent by the launcher).") in report
    assert "[rank 1] left the collective" not in lines


# -- blame -----------------------------------------------------------------------------------------
def test_a_rank_that_only_lost_a_peer_is_not_blamed_even_when_it_exits_first(tmp_path):
    script = tmp_path / "victim_first.py"
    script.write_text(textwrap.dedent(
        """
        import os, time
        import jax
        from composerjax.parallel import dist

        dist.barrier("started")
        jax.distributed.shutdown()  # so that rank 0 leaving does not make JAX abort rank 1
        if jax.process_index() == 0:  # what gloo prints when the peer of a collective is gone
            print("ValueError: UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] "
                  "Connection closed by peer [127.0.0.1]:28071", flush=True)
            os._exit(1)
        time.sleep(0.5)
        raise ValueError("bad batch on rank 1")
        """
    ))
    status, _, stderr, _ = run_launcher(script)
    assert status == 1
    report = report_of(stderr)
    assert report.startswith("composerjax launch: rank 1 failed first: it exited with code 1.\n"), report
    assert "rank 0 exited with code 1 after losing a peer." in report
    assert "ValueError: bad batch on rank 1" in report and "Gloo AllGather failed" not in report


def child(rank: int, returncode: int, exit_time: float, lost_peer: str | None = None) -> _Child:
    return _Child(rank, SimpleNamespace(returncode=returncode), exit_time=exit_time, lost_peer=lost_peer)


@pytest.mark.parametrize(("children", "blamed"), [
    # The issue's case: rank 0's "connection closed by peer" exit is seen first; rank 1 raised.
    ([child(0, 1, 10.0, "Connection closed by peer"), child(1, 1, 10.2)], 1),
    ([child(0, 1, 10.2, "Connection closed by peer"), child(1, 1, 10.0)], 1),
    # A cause is blamed even when it exits well after the burst of victims.
    ([child(0, -signal.SIGABRT, 10.0, "another task died"), child(1, -signal.SIGABRT, 10.1, "Socket closed"),
      child(2, 1, 14.0)], 2),
    # Only victims: the first one (nothing better is known).
    ([child(0, 1, 10.3, "Socket closed"), child(1, 1, 10.0, "Connection reset by peer")], 1),
    # Among causes: a process killed outright goes before one that exited in the same burst...
    ([child(0, 1, 10.0), child(1, -signal.SIGKILL, 10.4)], 1),
    # ...but not before one that failed in an earlier burst.
    ([child(0, 1, 10.0), child(1, -signal.SIGKILL, 12.0)], 0),
    # A child still running or that exited with 0 is never blamed.
    ([child(0, 0, 9.0), child(1, 3, 10.0), _Child(2, SimpleNamespace(returncode=None))], 1),
])
def test_blame_prefers_a_rank_that_failed_on_its_own(children, blamed):
    assert _blame(children).rank == blamed


@pytest.mark.parametrize("line", [  # as printed by jaxlib 0.10 when the other process of a 2-process run died
    "ValueError: UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read error "
    "[127.0.0.1]:26527: Connection reset by peer",
    "ValueError: UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection closed "
    "by peer [127.0.0.1]:28071",
    "W1124 17:18:30.043517    3966 preemption_sync_manager.cc:147] Failed to retrieve preemption notice from "
    "coordination service: UNAVAILABLE: Socket closed",
    "F1124 17:18:30.043703    3966 client.h:80] Terminating process because the JAX distributed service detected "
    "fatal errors. This most likely indicates that another task died; see the other task logs for more details.",
    "The following tasks are unhealthy (stopped sending heartbeats):",
])
def test_lost_peer_messages_are_recognized(line):
    assert _PEER_LOST.search(line)


@pytest.mark.parametrize("line", ["ValueError: bad batch on rank 1", "Traceback (most recent call last):",
                                  "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer "
                                  "ranks is : 1", "KeyboardInterrupt"])
def test_a_ranks_own_errors_are_not_lost_peer_messages(line):
    assert not _PEER_LOST.search(line)


def test_bad_heartbeat_timeouts_are_refused(tmp_path):
    script = tmp_path / "noop.py"
    script.write_text("")
    with pytest.raises(ValueError, match=r"`heartbeat_timeout_s` must be a number >= 0 \(0: no timeout\) or None, "
                                         r"got -1"):
        launch(script, [], num_processes=1, heartbeat_timeout_s=-1)
    with pytest.raises(ValueError, match="`heartbeat_timeout_s` must be .*got 'soon'"):
        launch(script, [], num_processes=1, heartbeat_timeout_s="soon")
