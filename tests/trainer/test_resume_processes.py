"""Real processes: SIGKILL mid-epoch, SIGKILL mid-save, SIGTERM/SIGINT, and restores across device counts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "resume_script.py")
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def run(out, *args: str, expect: int = 0) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, SCRIPT, str(out), *args], env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == expect, done.stderr[-3000:]
    return done


def final(out) -> list[np.ndarray]:
    with np.load(os.path.join(out, "final.npz")) as data:
        return [data[name] for name in sorted(data.files, key=lambda n: int(n.split("_")[1]))]


def result(out) -> dict:
    with open(os.path.join(out, "result.json")) as handle:
        return json.load(handle)


def complete_steps(folder) -> list[int]:
    """The batch counts of the complete checkpoints in ``folder``, read from their names (``ep{epoch}-ba{batch}``)."""
    return sorted(int(match[1]) for match in (re.fullmatch(r"ep\d+-ba(\d+)", n) for n in os.listdir(folder)) if match)


# grain's loader (with worker processes) is covered by tests/lm/test_lm_resume.py on the real LM job.
@pytest.mark.parametrize("loader", ["array"])
def test_sigkill_mid_epoch_then_autoresume_is_bit_identical(tmp_path, loader):
    """MixUp + EMA + a shuffled loader; 6 batches an epoch, killed at batch 9 once checkpoint 8 is on disk.

    Checkpoint 8 is batch 2 of epoch 2: the resume starts strictly inside an epoch, through a real
    checkpoint (the loader's position, grain's iterator state included, comes from the disk).
    """
    run(tmp_path / "reference", "--loader", loader)
    folder = tmp_path / "checkpoints"
    run(tmp_path / "killed", "--loader", loader, "--save-folder", str(folder), "--kill-at", "9",
        "--kill-when-saved", "8", expect=-signal.SIGKILL)
    assert not os.path.exists(tmp_path / "killed" / "final.npz")
    assert complete_steps(folder)[-1] == 8
    run(tmp_path / "resumed", "--loader", loader, "--save-folder", str(folder), "--autoresume")
    resumed = result(tmp_path / "resumed")
    assert resumed == {"resumed_from": 8, "batch": 18, "prefetch_threaded": False}  # 8: epoch 2, batch 2 of 6
    reference, after = final(tmp_path / "reference"), final(tmp_path / "resumed")
    assert len(reference) == len(after) > 10  # params, adam moments, EMA averages, clock
    for a, b in zip(reference, after):
        np.testing.assert_array_equal(a, b)


def test_sigkill_while_prefetching_then_autoresume_is_bit_identical_to_a_run_without_prefetch(tmp_path):
    """A grain loader with host work: the prefetch thread reads batches ahead of the step when batch 8 is saved.

    The checkpoint must hold the loader's position after batch 8 (not the loader's own, which is
    ahead), and the resumed run must end with every leaf equal to a run that never prefetched.
    """
    run(tmp_path / "reference", "--loader", "grain-work", "--device-prefetch", "0")
    folder = tmp_path / "checkpoints"
    run(tmp_path / "killed", "--loader", "grain-work", "--save-folder", str(folder), "--kill-at", "9",
        "--kill-when-saved", "8", expect=-signal.SIGKILL)
    assert complete_steps(folder)[-1] == 8
    run(tmp_path / "resumed", "--loader", "grain-work", "--save-folder", str(folder), "--autoresume")
    assert result(tmp_path / "reference")["prefetch_threaded"] is None
    assert result(tmp_path / "resumed") == {"resumed_from": 8, "batch": 18, "prefetch_threaded": True}
    reference, after = final(tmp_path / "reference"), final(tmp_path / "resumed")
    assert len(reference) == len(after) > 10
    for a, b in zip(reference, after):
        np.testing.assert_array_equal(a, b)


def test_sigkill_while_a_checkpoint_is_written_leaves_the_previous_one_loadable(tmp_path):
    folder = tmp_path / "checkpoints"
    # A wider model, so that writing checkpoint 4 is still going on when the process dies.
    run(tmp_path / "killed", "--width", "20000", "--save-folder", str(folder), "--kill-after-save", "4",
        expect=-signal.SIGKILL)
    names = os.listdir(folder)
    assert complete_steps(folder) == [2]
    assert any(re.fullmatch(r"ep\d+-ba4\..*tmp.*", name) for name in names), names  # the half-written one
    run(tmp_path / "resumed", "--width", "20000", "--max-duration", "6ba", "--save-folder", str(folder),
        "--autoresume")
    assert result(tmp_path / "resumed") == {"resumed_from": 2, "batch": 6, "prefetch_threaded": False}
    assert complete_steps(folder) == [2, 4, 6]


@pytest.mark.parametrize("signum,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_finishes_the_step_saves_closes_and_exits_with_its_status(tmp_path, signum, status):
    folder = tmp_path / "checkpoints"
    process = subprocess.Popen(
        [sys.executable, SCRIPT, str(tmp_path / "run"), "--max-duration", "100000ba", "--save-folder", str(folder),
         "--save-interval", "100000ba", "--ready-at", "3"],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stdout:
            if line.strip() == "READY":
                break
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == status, stderr[-3000:]
    saved = complete_steps(folder)
    assert len(saved) == 1 and saved[0] >= 3  # the step in progress finished, then one checkpoint
    with open(tmp_path / "run" / "metrics.jsonl") as handle:  # the logger was closed with its rows flushed
        rows = [json.loads(line) for line in handle]
    assert max(row.get("step", 0) for row in rows) == saved[0]
    run(tmp_path / "resumed", "--max-duration", f"{saved[0] + 2}ba", "--save-folder", str(folder), "--autoresume")
    resumed = result(tmp_path / "resumed")
    assert (resumed["resumed_from"], resumed["batch"]) == (saved[0], saved[0] + 2)


CROSS_DEVICE = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np, optax
    from flax import nnx
    from composerjax import ArrayLoader, ComposerClassifier, Trainer

    x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)

    def trainer(devices, parallelism="ddp", **kwargs):
        rngs = nnx.Rngs(0)
        model = ComposerClassifier(nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), nnx.relu,
                                                  nnx.Linear(16, 2, rngs=rngs)), 2)
        return Trainer(model, ArrayLoader((x, y), batch_size=16, seed=1), "6ba", optax.adam(1e-2),
                       devices=jax.devices()[:devices], parallelism=parallelism, progress_bar=False,
                       run_summary=False, **kwargs)

    def values(t):
        return [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(t.state.train_state))]

    report = {}
    folder = sys.argv[1]
    cases = ((4, "ddp", 1, "ddp"), (4, "ddp", 2, "ddp"), (1, "ddp", 4, "ddp"), (2, "ddp", 4, "ddp"),
             (4, "fsdp", 1, "ddp"), (1, "ddp", 4, "fsdp"))
    for saved_on, saved_as, loaded_on, loaded_as in cases:
        name = f"{saved_on}{saved_as}-to-{loaded_on}{loaded_as}"  # one folder per run: a folder holds one run
        source = trainer(saved_on, saved_as, save_folder=f"{folder}/{name}", save_interval="3ba")
        source.fit()
        source.close()
        target = trainer(loaded_on, loaded_as, load_path=f"{folder}/{name}")
        leaf = target.state.train_state.params["module"]["layers"][0]["kernel"]
        same = all(np.array_equal(a, b) for a, b in zip(values(source), values(target)))
        # A sharded leaf holds 1/N of the kernel on each device; a replicated one all of it.
        shard = leaf.addressable_shards[0].data.size / leaf.size
        # and it keeps training on its own mesh
        target.fit("2ba")
        report[f"{saved_on} {saved_as}->{loaded_on} {loaded_as}"] = {
            "same": same, "devices": len(leaf.sharding.device_set), "shard": shard,
            "batch": target.state.timestamp.batch.value}
    print(json.dumps(report))
    """
)


def test_a_checkpoint_restores_across_device_counts(tmp_path):
    env = dict(ENV, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    done = subprocess.run([sys.executable, "-c", CROSS_DEVICE, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "4 ddp->1 ddp": {"same": True, "devices": 1, "shard": 1.0, "batch": 8},
        "4 ddp->2 ddp": {"same": True, "devices": 2, "shard": 1.0, "batch": 8},
        "1 ddp->4 ddp": {"same": True, "devices": 4, "shard": 1.0, "batch": 8},
        "2 ddp->4 ddp": {"same": True, "devices": 4, "shard": 1.0, "batch": 8},
        "4 fsdp->1 ddp": {"same": True, "devices": 1, "shard": 1.0, "batch": 8},
        "1 ddp->4 fsdp": {"same": True, "devices": 4, "shard": 0.25, "batch": 8},
    }
