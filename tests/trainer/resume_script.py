"""A training run for the process tests: killed, signalled, resumed, compared bit for bit.

    python resume_script.py OUT_DIR --max-duration 18ba [--save-folder F] [--kill-at N]
        [--kill-after-save N] [--kill-when-saved N] [--ready-at N] [--loader array|grain|grain-work]
        [--device-prefetch N] [--autoresume]

Writes ``OUT_DIR/final.npz`` (every leaf of the final train state) and ``OUT_DIR/result.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx

from composerjax import ArrayLoader, Callback, ComposerClassifier, Trainer
from composerjax.algorithms import EMA, MixUp
from composerjax.loggers import FileLogger

SAMPLES, FEATURES, CLASSES = 96, 8, 3


class Records:
    """A grain-style data source: ``len`` and ``__getitem__`` returning one sample."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[index], self.y[index]


def HostWork():  # noqa: N802 - builds a grain operation; grain is imported only when used
    import grain

    class Work(grain.transforms.Map):
        def map(self, record):
            time.sleep(3e-4)
            return record

    return Work()


class Kill(Callback):
    """SIGKILL this process at BATCH_END of batch ``at`` (no cleanup of any kind runs).

    With ``saved``, first wait until checkpoint ``saved`` is complete in ``folder`` (orbax renames
    it into place when it is whole), so the run dies with exactly that checkpoint as its newest.
    """

    def __init__(self, at: int, folder: str | None = None, saved: int | None = None) -> None:
        self.at, self.folder, self.saved = at, folder, saved

    def batch_end(self, state, logger) -> None:
        if state.timestamp.batch == self.at:
            if self.saved is not None:  # its folder is named ep{epoch}-ba{batch}
                while not any(name.endswith(f"-ba{self.saved}") for name in os.listdir(self.folder)):
                    time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)


class Ready(Callback):
    """Print READY once batch ``at`` is done, so the test knows when to send its signal."""

    def __init__(self, at: int) -> None:
        self.at = at

    def batch_end(self, state, logger) -> None:
        if state.timestamp.batch == self.at:
            print("READY", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--max-duration", default="18ba")
    parser.add_argument("--save-folder")
    parser.add_argument("--save-interval", default="2ba")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--kill-after-save", type=int)
    parser.add_argument("--kill-when-saved", type=int, help="with --kill-at: first wait for this checkpoint")
    parser.add_argument("--ready-at", type=int)
    parser.add_argument("--loader", default="array")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--device-prefetch", type=int, default=2)
    parser.add_argument("--autoresume", action="store_true")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=SAMPLES).astype(np.int32)
    if args.loader in ("grain", "grain-work"):
        from composerjax.data.grain_loader import GrainLoader

        # grain-work: each record costs 0.3 ms of host work, so the prefetch thread reads batches ahead.
        operations = [HostWork()] if args.loader == "grain-work" else []
        loader = GrainLoader(Records(x, y), batch_size=16, shuffle=True, seed=5, operations=operations)
    else:
        loader = ArrayLoader((x, y), batch_size=16, shuffle=True, seed=5)
    rngs = nnx.Rngs(0)
    model = ComposerClassifier(nnx.Sequential(nnx.Linear(FEATURES, args.width, rngs=rngs), nnx.relu,
                                              nnx.Linear(args.width, CLASSES, rngs=rngs)), CLASSES)
    callbacks = []
    if args.kill_at is not None:
        callbacks.append(Kill(args.kill_at, args.save_folder, args.kill_when_saved))
    if args.ready_at is not None:
        callbacks.append(Ready(args.ready_at))
    os.makedirs(args.out, exist_ok=True)
    trainer = Trainer(
        model, loader, args.max_duration, optax.adam(1e-2),
        algorithms=[MixUp(alpha=0.4), EMA(half_life="2ba")],
        callbacks=callbacks,
        loggers=[FileLogger(os.path.join(args.out, "metrics.jsonl"))],
        log_interval=1,
        progress_bar=False, run_summary=False,
        save_folder=args.save_folder, save_interval=args.save_interval, autoresume=args.autoresume,
        device_prefetch=args.device_prefetch,
    )
    if args.kill_after_save is not None:
        checkpointer = trainer.checkpointer
        save = checkpointer.save

        def save_then_die(state, hparams=None, **options):
            path = save(state, hparams, **options)
            if int(state.timestamp.batch) == args.kill_after_save:
                os.kill(os.getpid(), signal.SIGKILL)  # while orbax is still writing it
            return path

        checkpointer.save = save_then_die
    resumed_from = trainer.resumed_from
    trainer.fit()
    trainer.close()
    leaves = jax.tree.leaves(jax.device_get(trainer.state.train_state))
    np.savez(os.path.join(args.out, "final.npz"), *[np.asarray(leaf) for leaf in leaves])
    with open(os.path.join(args.out, "result.json"), "w") as handle:
        json.dump({"resumed_from": resumed_from, "batch": int(trainer.state.timestamp.batch),
                   "prefetch_threaded": trainer.prefetch_threaded}, handle)


if __name__ == "__main__":
    sys.exit(main())
