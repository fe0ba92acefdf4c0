"""Nothing lost, counted: kill a real training process at random moments and resume it until it finishes.

Each trial starts the same run (MixUp + EMA + a shuffled loader, a checkpoint every 2 batches,
async saves) as a child process, sends it SIGKILL or SIGTERM after a random delay, restarts it
with ``autoresume=True``, and repeats until a start finishes. The final parameters, Adam moments,
EMA averages and clock are compared bit for bit with one run never interrupted. It prints how many
interruptions landed (and how many SIGKILLs hit a save in flight: a ``*.orbax-checkpoint-tmp``
folder was left behind), how many starts there were, and how many trials ended bit-identical:
"lost" counts every trial that did not.

Run: ``.venv/bin/python benchmarks/reliability.py [--trials 8] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

DURATION = "24ba"


def child(out: str, folder: str | None) -> None:
    """One start of the run: train to DURATION (resuming from ``folder``), write the final leaves to ``out``."""
    import jax
    import optax
    from flax import nnx

    from composerjax import ArrayLoader, Callback, ComposerClassifier, Trainer
    from composerjax.algorithms import EMA, MixUp

    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=96).astype(np.int32)
    rngs = nnx.Rngs(0)
    layers = nnx.Sequential(nnx.Linear(8, 20000, rngs=rngs), nnx.relu, nnx.Linear(20000, 3, rngs=rngs))
    model = ComposerClassifier(layers, 3)
    class Training(Callback):
        def batch_end(self, state, logger) -> None:
            if not self.__dict__.get("said"):
                self.said = True
                print("TRAINING", flush=True)  # the first step of this start is done: interruptions count from here

    trainer = Trainer(model, ArrayLoader((x, y), batch_size=16, shuffle=True, seed=5), DURATION, optax.adam(1e-2),
                      algorithms=[MixUp(alpha=0.4), EMA(half_life="2ba")], callbacks=[Training()],
                      progress_bar=False, run_summary=False,
                      save_folder=folder, save_interval="2ba", autoresume=folder is not None)
    print(f"START {trainer.resumed_from}", flush=True)
    trainer.fit()
    trainer.close()
    leaves = jax.tree.leaves(jax.device_get(trainer.state.train_state))
    np.savez(out, *[np.asarray(leaf) for leaf in leaves])


def load(path: str) -> list[np.ndarray]:
    with np.load(path) as data:
        return [data[name] for name in sorted(data.files, key=lambda n: int(n.split("_")[1]))]


def start(out: str, folder: str | None) -> subprocess.Popen[str]:
    command = [sys.executable, __file__, "--child", out] + (["--folder", folder] if folder else [])
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))


def trial(work: str, picker: random.Random, reference: list[np.ndarray]) -> dict[str, int]:
    folder, out = os.path.join(work, "checkpoints"), os.path.join(work, "final.npz")
    counts = {"interrupted": 0, "sigkill": 0, "sigterm": 0, "mid_save": 0, "starts": 0, "exact": 0,
              "failed_starts": 0}
    while True:
        counts["starts"] += 1
        process = start(out, folder)
        process.stdout.readline()  # START: JAX is up and the checkpoint (if any) loaded
        training = process.stdout.readline()  # TRAINING: the first step ran
        if counts["interrupted"] < 3 and training.startswith("TRAINING"):
            time.sleep(picker.uniform(0.0, 1.0))
            signum = picker.choice([signal.SIGKILL, signal.SIGTERM])
            if process.poll() is None:
                process.send_signal(signum)
                counts["interrupted"] += 1
                counts["sigkill" if signum == signal.SIGKILL else "sigterm"] += 1
        _, stderr = process.communicate(timeout=600)
        if process.returncode == -signal.SIGKILL and any("tmp" in name for name in os.listdir(folder)):
            counts["mid_save"] += 1  # killed while a checkpoint was being written: its tmp folder is left
        if process.returncode == 0:
            break
        if process.returncode not in (-signal.SIGKILL, -signal.SIGTERM, 143):
            counts["failed_starts"] += 1
            print(f"  a start failed with status {process.returncode}: {stderr.strip().splitlines()[-1:]}")
            if counts["failed_starts"] > 2:
                return counts
    after = load(out)
    counts["exact"] = int(len(after) == len(reference) and all(np.array_equal(a, b) for a, b in zip(reference, after)))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child")
    parser.add_argument("--folder")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.folder)
        return
    picker = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as work:
        reference_out = os.path.join(work, "reference.npz")
        done = start(reference_out, None)
        _, stderr = done.communicate(timeout=600)
        assert done.returncode == 0, stderr
        reference = load(reference_out)
        totals: dict[str, int] = {}
        for index in range(args.trials):
            counts = trial(os.path.join(work, f"trial-{index}"), picker, reference)
            print(f"trial {index}: {counts}", flush=True)
            for key, value in counts.items():
                totals[key] = totals.get(key, 0) + value
    lost = args.trials - totals.get("exact", 0)
    print("\n| trials | interruptions (SIGKILL / SIGTERM) | SIGKILLs during a save | starts | failed starts | "
          "bit-identical | lost |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {args.trials} | {totals['interrupted']} ({totals['sigkill']} / {totals['sigterm']}) | "
          f"{totals['mid_save']} | {totals['starts']} | {totals['failed_starts']} | {totals['exact']} | {lost} |")


if __name__ == "__main__":
    main()
