"""A small training run for the reliability tests: real processes, real signals, real folders.

    python train_script.py --save-folder F [--max-duration 12ba] [--save-interval 5ba]
        [--fail-at N] [--autoresume] [--overwrite] [--ready-at N] [--hold-at N]
        [--time-limit-rank R --time-limit S] [--out FILE]

``--fail-at N``: the data loader raises at batch N. ``--ready-at N``: print READY after batch N.
``--hold-at N``: after batch N, wait until the file ``<save folder>.release`` exists. Under
``composerjax launch`` every process runs it; ``--time-limit`` applies only on rank ``--time-limit-rank``.
Writes ``--out`` (JSON; ``RANK`` in the name becomes the process index): the batch reached, the stop
reason and the checkpoint resumed from, also when a signal stopped the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from composerjax import ArrayLoader, Callback, Trainer


class FailingLoader:
    """An ArrayLoader whose iterator raises at global batch ``fail_at``."""

    def __init__(self, loader: ArrayLoader, fail_at: int | None) -> None:
        self.loader, self.fail_at, self.seen = loader, fail_at, 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            self.seen += 1
            if self.seen == self.fail_at:
                raise OSError(f"the data source went away at batch {self.seen}")
            yield batch

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)


class Marks(Callback):
    def __init__(self, ready_at: int | None, hold_at: int | None, release: str) -> None:
        self.ready_at, self.hold_at, self.release = ready_at, hold_at, release

    def batch_end(self, state, logger) -> None:
        batch = state.timestamp.batch
        if batch == self.ready_at:
            print(f"READY {jax.process_index()} {os.getpid()}" if jax.process_count() > 1 else
                  f"READY {jax.process_index()}", flush=True)
        if batch == self.hold_at:
            while not os.path.exists(self.release):
                time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save-folder", required=True)
    parser.add_argument("--max-duration", default="12ba")
    parser.add_argument("--save-interval", default="5ba")
    parser.add_argument("--fail-at", type=int)
    parser.add_argument("--ready-at", type=int)
    parser.add_argument("--hold-at", type=int)
    parser.add_argument("--autoresume", action="store_true")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--time-limit")
    parser.add_argument("--time-limit-rank", type=int, default=0)
    parser.add_argument("--sleep-per-batch", type=float, default=0.0)
    parser.add_argument("--out")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6)).astype(np.float32)
    y = rng.normal(size=(96, 1)).astype(np.float32)
    loader = FailingLoader(ArrayLoader((x, y), batch_size=8, seed=1, shuffle=True), args.fail_at)
    model = nnx.Sequential(nnx.Linear(6, 16, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(16, 1, rngs=nnx.Rngs(1)))

    class Slow(Callback):
        def batch_end(self, state, logger) -> None:
            time.sleep(args.sleep_per_batch)

    callbacks = [Marks(args.ready_at, args.hold_at, args.save_folder.rstrip("/") + ".release")]
    if args.sleep_per_batch:
        callbacks.append(Slow())
    time_limit = args.time_limit if jax.process_index() == args.time_limit_rank else None
    trainer = Trainer(model, loader, args.max_duration, optax.adam(1e-2),
                      loss_fn=lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), callbacks=callbacks,
                      progress_bar=False, run_summary=False, save_folder=args.save_folder,
                      save_interval=args.save_interval, autoresume=args.autoresume, save_overwrite=args.overwrite,
                      time_limit=time_limit)
    resumed = trainer.resumed_from
    try:
        trainer.fit()
        trainer.close()
    finally:  # a signal's TrainingInterrupted too: what each process decided is what the tests compare
        if args.out:
            out = args.out.replace("RANK", str(jax.process_index()))
            with open(out, "w") as file:
                json.dump({"batch": int(trainer.state.timestamp.batch), "stop_reason": trainer.stop_reason,
                           "resumed_from": resumed, "process": jax.process_index()}, file)
    print(f"DONE {int(trainer.state.timestamp.batch)}", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
