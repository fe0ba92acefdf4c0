r"""``composerjax launch``: run a training script as N local ``jax.distributed`` processes.

For development and tests on one machine: each process gets the launcher's variables
(``COMPOSERJAX_COORDINATOR``, ``COMPOSERJAX_NUM_PROCESSES``, ``COMPOSERJAX_PROCESS_ID``, ...),
and with ``devices_per_process`` its own K simulated CPU devices, so ``N x K`` devices in all.
Each process starts in a small bootstrap that imports composerjax (which starts
``jax.distributed`` from those variables) and then runs the script as ``__main__``: scripts need
no distributed boilerplate.

Output lines are streamed prefixed with ``[rank i]``. The launcher supervises the processes
(:mod:`composerjax.parallel.supervisor`):

* **A process fails** (JAX aborts the others' collectives when a peer dies): the launcher stops
  the rest (SIGTERM, then SIGKILL after a grace period) and reports the rank that caused it, how
  it ended, and its last lines of output. A rank whose output shows that it lost a peer (gloo's
  "Connection closed by peer", the coordination service's "another task died", ...) is a
  victim, not the cause: the launcher blames a rank that failed on its own, even when a victim
  exited first.
* **A process hangs**: each process gets a heartbeat file (``COMPOSERJAX_HEARTBEAT_FILE``) that
  :func:`~composerjax.parallel.heartbeat.heartbeat` touches; the Trainer beats after every batch.
  Once any rank has beaten, a rank silent for ``heartbeat_timeout_s`` (since its last beat, or
  since it started) stops the job; the launcher names the rank silent longest and exits with
  status 124. Output does not count as progress: a rank printing in a loop can still be stuck.
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

import ctypes
import os
import runpy
import shutil
import signal
import socket
import sys
import tempfile
import traceback
from collections.abc import Sequence
from typing import IO, Any

from composerjax.parallel import dist
from composerjax.parallel.heartbeat import HEARTBEAT_FILE_ENV
from composerjax.parallel.supervisor import ProcessGroup, forwarded_signals

__all__ = ["child_environment", "free_port", "launch"]

# Each child runs this instead of `python script.py ARGS`: importing composerjax starts jax.distributed from the
# launcher's variables before the script can touch JAX's backend; _child_main then runs the script.
_BOOTSTRAP = "import composerjax.parallel.launch as launch; launch._child_main()"
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
        heartbeat_timeout_s: Once any process has called :func:`~composerjax.parallel.heartbeat.heartbeat`,
            stop the job when one has not for this many seconds (counting from its start until its first
            beat). 0 or None: no timeout.
        output: Where the ``[rank i]`` lines go (default ``sys.stdout``).
        errors: Where the report goes when the run fails (default ``sys.stderr``).

    Returns:
        0 when every process exits with 0; otherwise the exit code of the process that failed first
        (128 + signal number when a signal killed it), :data:`~composerjax.parallel.heartbeat.HUNG_STATUS`
        (124) after a heartbeat timeout, or 128 + signal number when the launcher received SIGTERM/SIGINT
        before any process failed.

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
    group = ProcessGroup(output, grace_period_s, heartbeat_timeout_s or None)
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
        with forwarded_signals(group):
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

    ``heartbeat_file`` (when given) becomes ``COMPOSERJAX_HEARTBEAT_FILE``, the file
    :func:`~composerjax.parallel.heartbeat.heartbeat` touches.

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
    """A TCP port on 127.0.0.1 that is free now (the OS picks it).

    Example:
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}")


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
