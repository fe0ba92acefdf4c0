"""``composerjax launch``: N local processes, one training run, and a clean stop when a process fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from composerjax.cli import main
from composerjax.parallel.launch import child_environment, launch


def run_launcher(script: Path, *args: str, processes: int = 2, devices: int = 2,
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "composerjax", "launch", "-n", str(processes), "--devices-per-process",
               str(devices), str(script), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def rank_lines(stdout: str, rank: int) -> list[str]:
    return [line.removeprefix(f"[rank {rank}] ") for line in stdout.splitlines() if line.startswith(f"[rank {rank}] ")]


# -- the training run ------------------------------------------------------------------------------
TRAIN_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np, optax
    from flax import nnx
    from jax.experimental import multihost_utils
    from composerjax import ArrayLoader, ComposerClassifier, Trainer
    from composerjax.data import ProcessShardedLoader
    from composerjax.loggers import FileLogger

    out = sys.argv[1]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype(np.float32)
    y = rng.integers(0, 4, size=128).astype(np.int32)
    rngs = nnx.Rngs(0)
    model = ComposerClassifier(nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), nnx.relu, nnx.Linear(16, 4, rngs=rngs)), 4)
    loader = ArrayLoader((x, y), batch_size=16 // jax.process_count(), seed=3)  # a global batch of 16
    save_folder = sys.argv[2] if len(sys.argv) > 2 else None
    trainer = Trainer(model, loader, "12ba", optax.adam(1e-2), progress_bar=False, run_summary=False,
                      loggers=[FileLogger(f"{out}/metrics-{jax.process_index()}.jsonl")], save_folder=save_folder,
                      save_interval="6ba")
    trainer.fit()
    trainer.close()

    # The same global batches from a loader that knows nothing of processes, split by ProcessShardedLoader.
    rngs = nnx.Rngs(0)
    model = ComposerClassifier(nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), nnx.relu, nnx.Linear(16, 4, rngs=rngs)), 4)
    global_batches = ArrayLoader((x, y), batch_size=16, seed=3, process_index=0, process_count=1)
    sharded = Trainer(model, ProcessShardedLoader(global_batches), "12ba", optax.adam(1e-2), progress_bar=False,
                      run_summary=False)
    sharded.fit()

    def gathered(trainer):  # every process takes part in the gather
        return [np.asarray(multihost_utils.process_allgather(leaf, tiled=True)).ravel().tolist()
                for leaf in jax.tree.leaves(trainer.state.train_state.params)]

    params, sharded_params = gathered(trainer), gathered(sharded)
    if jax.process_index() == 0:
        print("PARAMS " + json.dumps({"processes": jax.process_count(), "devices": jax.device_count(),
                                      "params": params, "sharded_params": sharded_params}))
    """
)


def train_alone(script: Path, out: Path, devices: int) -> dict:
    """One process, no launcher, ``devices`` CPU devices."""
    out.mkdir()
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1].removeprefix("PARAMS "))


def losses(path: Path) -> list[float]:
    return [record["loss/train/total"] for record in map(json.loads, path.read_text().splitlines())
            if "loss/train/total" in record]


def test_two_processes_of_two_devices_train_like_one_process(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    out = tmp_path / "launched"
    out.mkdir()
    run = run_launcher(script, str(out), str(tmp_path / "checkpoints"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    printed = [line for line in rank_lines(run.stdout, 0) if line.startswith("PARAMS ")]
    assert len(printed) == 1 and not [line for line in rank_lines(run.stdout, 1) if line.startswith("PARAMS ")]
    launched = json.loads(printed[0].removeprefix("PARAMS "))
    four, one = train_alone(script, tmp_path / "four", 4), train_alone(script, tmp_path / "one", 1)

    assert (launched["processes"], launched["devices"], four["devices"], one["devices"]) == (2, 4, 4, 1)
    for reference in (four, one):
        assert len(launched["params"]) == len(reference["params"]) == 4
        for got, expected in zip(launched["params"], reference["params"]):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    for run_params in (launched, four, one):  # ProcessShardedLoader over global batches trains the same
        for got, expected in zip(run_params["sharded_params"], one["params"]):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # Only process 0 writes its logger's file, and it logs the same losses as a single process.
    assert sorted(path.name for path in out.iterdir()) == ["metrics-0.jsonl"]
    assert len(losses(out / "metrics-0.jsonl")) == 12
    np.testing.assert_allclose(losses(out / "metrics-0.jsonl"), losses(tmp_path / "one" / "metrics-0.jsonl"),
                               rtol=1e-5, atol=1e-5)
    # The checkpoints the two processes wrote together load in one process, on one device, bit for bit.
    loaded = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(tmp_path / "checkpoints")],
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    restored = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert restored["resumed_from"] == 12 and restored["steps"] == [6, 12]
    for got, expected in zip(restored["params"], launched["params"]):
        np.testing.assert_array_equal(got, expected)


LOAD_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import jax, numpy as np, optax
    from flax import nnx
    from composerjax import ArrayLoader, ComposerClassifier, Trainer

    rngs = nnx.Rngs(0)
    model = ComposerClassifier(nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), nnx.relu, nnx.Linear(16, 4, rngs=rngs)), 4)
    x = np.zeros((128, 8), np.float32)  # the data's shape: the loader's position is restored too
    trainer = Trainer(model, ArrayLoader((x, np.zeros(128, np.int32)), batch_size=16), "12ba", optax.adam(1e-2),
                      devices=1, load_path=sys.argv[1], progress_bar=False, run_summary=False)
    print(json.dumps({"resumed_from": trainer.resumed_from,
                      "steps": sorted(int(n.split("-ba")[1]) for n in os.listdir(sys.argv[1]) if "-ba" in n),
                      "params": [np.asarray(p).ravel().tolist()
                                 for p in jax.tree.leaves(trainer.state.train_state.params)]}))
    """
)


# -- exit statuses ---------------------------------------------------------------------------------
def test_every_process_succeeds_exit_status_0_and_prefixed_output(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(textwrap.dedent(
        """
        import os, sys
        import jax
        print("rank", jax.process_index(), "of", jax.process_count(), "devices", jax.local_device_count(),
              "args", sys.argv[1:], "name", __name__, "local", os.environ["COMPOSERJAX_LOCAL_RANK"])
        print("to stderr", file=sys.stderr)
        """
    ))
    run = run_launcher(script, "--lr", "0.1", "-n", "7", devices=3)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in (0, 1):
        lines = rank_lines(run.stdout, rank)
        assert f"rank {rank} of 2 devices 3 args ['--lr', '0.1', '-n', '7'] name __main__ local {rank}" in lines
        assert "to stderr" in lines
    assert "composerjax launch" not in run.stderr


def test_a_script_that_raises_fails_the_launch_naming_its_rank_and_last_lines(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent(
        """
        import time
        import jax
        from composerjax.parallel import dist

        dist.barrier("started")
        if jax.process_index() == 1:
            print("about to fail", flush=True)
            raise ValueError("bad batch on rank 1")
        while True:  # rank 0 keeps training until the launcher stops it
            dist.barrier("step")
            time.sleep(0.01)
        """
    ))
    run = run_launcher(script, devices=1, timeout=300)  # a hang guard: rank 0 loops until the launcher stops it
    assert run.returncode == 1
    report = run.stderr[run.stderr.index("composerjax launch: "):]
    assert report.startswith("composerjax launch: rank 1 failed first: it exited with code 1.")
    assert "about to fail" in report and "ValueError: bad batch on rank 1" in report
    assert 'fails.py", line 9, in <module>' in report  # the script's own traceback, not the launcher's


def test_a_killed_worker_stops_the_launch_within_seconds(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(textwrap.dedent(
        """
        import os, signal, time
        import jax
        from composerjax.parallel import dist

        dist.barrier("started")
        if jax.process_index() == 1:
            print("rank 1 going down", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        step = 0
        while True:  # rank 0 trains until the launcher stops it
            dist.all_reduce(step)
            dist.barrier("step")
            step += 1
            time.sleep(0.01)
        """
    ))
    run = run_launcher(script, timeout=300)  # a hang guard, not a pass criterion
    assert run.returncode == 128 + signal.SIGKILL
    assert "composerjax launch: rank 1 failed first: it was killed by signal SIGKILL." in run.stderr
    assert "rank 1 going down" in run.stderr.split("last ")[1]


def test_sigterm_to_the_launcher_reaches_every_process(tmp_path):
    script = tmp_path / "waits.py"
    script.write_text(textwrap.dedent(
        f"""
        import os, signal, sys, time
        import jax

        def stop(signum, frame):
            rank = jax.process_index()
            print("rank", rank, "got", signal.Signals(signum).name, flush=True)
            open(os.path.join({str(tmp_path)!r}, f"stopped-{{rank}}"), "w").close()
            # Process 0 hosts jax.distributed's coordination service: when it leaves, the others abort.
            # It waits for them so that each can show it handled the signal itself.
            deadline = time.monotonic() + 120  # a hang guard
            while rank == 0 and not os.path.exists(os.path.join({str(tmp_path)!r}, "stopped-1")):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            sys.exit(3)

        signal.signal(signal.SIGTERM, stop)
        print("ready", flush=True)
        time.sleep(60)
        """
    ))
    launcher = subprocess.Popen([sys.executable, "-m", "composerjax", "launch", "-n", "2", "--devices-per-process",
                                 "1", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
        assert launcher.wait(300) == 128 + signal.SIGTERM  # the launcher's own status, whatever the processes'
    finally:
        launcher.kill()
    reader.join(5)
    assert "[rank 0] rank 0 got SIGTERM" in lines and "[rank 1] rank 1 got SIGTERM" in lines
    report = launcher.stderr.read()
    assert "the launcher received SIGTERM and passed it on to every process" in report
    assert "rank 0 exited with code 3; rank 1 exited with code 3." in report


# -- arguments and environment ---------------------------------------------------------------------
def test_bad_arguments_are_refused(tmp_path, capsys):
    script = tmp_path / "noop.py"
    script.write_text("")
    with pytest.raises(ValueError, match=r"`num_processes` must be a positive integer, got 0"):
        launch(script, [], num_processes=0)
    with pytest.raises(ValueError, match=r"`devices_per_process` must be a positive integer, got -2"):
        launch(script, [], num_processes=2, devices_per_process=-2)
    with pytest.raises(ValueError, match=r"`port` must be an integer in \[1, 65535\] or None .*got 70000"):
        launch(script, [], num_processes=2, port=70000)
    with pytest.raises(FileNotFoundError, match="no_such.py: no such script"):
        launch(tmp_path / "no_such.py", [], num_processes=2)
    assert main(["launch", "-n", "0", str(script)]) == 2
    assert "composerjax launch: error: --num-processes must be a positive integer, got 0" in capsys.readouterr().err
    assert main(["launch", "-n", "2", "--port", "0", str(script)]) == 2
    assert "--port must be an integer in [1, 65535]" in capsys.readouterr().err


def test_help_describes_launch(capsys):
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    help_text = capsys.readouterr().out
    for option in ("-n N, --num-processes N", "--devices-per-process K", "--port P", "--grace-period SECONDS",
                   "--heartbeat-timeout SECONDS",
                   "SCRIPT", "ARGS"):
        assert option in help_text
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "launch" in capsys.readouterr().out


def test_child_environment():
    env = child_environment(1, 4, "127.0.0.1:5555", devices_per_process=2,
                            base={"XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8",
                                  "PATH": "/bin"})
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=2"
    assert {key: env[key] for key in env if key.startswith("COMPOSERJAX_") and key != "COMPOSERJAX_LAUNCHER_PID"} == {
        "COMPOSERJAX_COORDINATOR": "127.0.0.1:5555", "COMPOSERJAX_NUM_PROCESSES": "4", "COMPOSERJAX_PROCESS_ID": "1",
        "COMPOSERJAX_LOCAL_RANK": "1", "COMPOSERJAX_NODE_RANK": "0", "COMPOSERJAX_DEVICES_PER_PROCESS": "2"}
    assert env["JAX_PLATFORMS"] == "cpu" and env["PATH"] == "/bin"
    kept = child_environment(0, 2, "127.0.0.1:5555", devices_per_process=2, base={"JAX_PLATFORMS": "cuda"})
    assert kept["JAX_PLATFORMS"] == "cuda"
    plain = child_environment(0, 2, "127.0.0.1:5555", base={"XLA_FLAGS": "--xla_dump_to=/tmp/d"})
    assert plain["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
    assert "COMPOSERJAX_DEVICES_PER_PROCESS" not in plain and "JAX_PLATFORMS" not in plain


def test_a_process_killed_outright_is_blamed_before_peers_that_exited_or_aborted():
    from composerjax.parallel.supervisor import _killed_outright

    assert _killed_outright(-signal.SIGKILL) and _killed_outright(-signal.SIGSEGV)
    assert not _killed_outright(-signal.SIGABRT)  # what JAX does to the peers of a dead process
    assert not _killed_outright(-signal.SIGTERM)  # what the launcher sends when it stops the rest
    assert not _killed_outright(1) and not _killed_outright(0)
