"""Train the small CNN on scikit-learn's bundled digits images (offline): a baseline and a speedup recipe.

Run with ``make demo``. Both runs print a progress bar; the table at the end compares test accuracy
and wall time (compiles included). Logs go to ``runs/digits-*/metrics.jsonl``.
``python examples/digits.py --max-duration 2ba`` trains each run for just that long (a quick check).
"""

from __future__ import annotations

import argparse
import time

import optax
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.algorithms import EMA, GradientClipping, LabelSmoothing
from composerjax.data.digits import load_digits_split
from composerjax.loggers import FileLogger, ProgressBarLogger
from composerjax.models import SmallCNN

SEED = 0


def train(name: str, duration: str, algorithms: list) -> dict:
    """Train one run and return its test metrics, wall time and compile count."""
    (x_train, y_train), (x_test, y_test) = load_digits_split(seed=SEED)
    log_path = f"runs/digits-{name}/metrics.jsonl"
    trainer = Trainer(
        ComposerClassifier(SmallCNN(num_classes=10, rngs=nnx.Rngs(SEED)), num_classes=10),
        ArrayLoader((x_train, y_train), batch_size=32, seed=SEED),
        max_duration=duration,
        optimizers=optax.adam(3e-3),
        algorithms=algorithms,
        eval_dataloader=ArrayLoader((x_test, y_test), batch_size=99, shuffle=False),
        loggers=[FileLogger(log_path)],
        progress_bar=False,
        seed=SEED,
        run_name=f"digits-{name}",
    )
    # The demo always shows the bar, even when make's output is not a terminal.
    trainer.logger.destinations.append(ProgressBarLogger(force=True))
    print(f"\n== {name}: {duration}, algorithms: {', '.join(type(a).__name__ for a in algorithms) or 'none'}")
    start = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - start
    results = trainer.eval()
    trainer.close()
    return {"name": name, "duration": duration, "seconds": seconds, "compiles": trainer.compile_count,
            "batches": trainer.state.timestamp.batch.value, "log": log_path, **results}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the digits CNN as a baseline and with a speedup recipe.")
    parser.add_argument("--max-duration", metavar="DURATION",
                        help="train each run for DURATION (e.g. 2ba) instead of 6ep and 4ep: a quick check")
    duration = parser.parse_args(argv).max_duration
    runs = [
        train("baseline", duration or "6ep", []),
        train("recipe", duration or "4ep",
              [LabelSmoothing(0.1), EMA(half_life="30ba"), GradientClipping("norm", 1.0)]),
    ]
    print("\ndigits: 1500 train / 297 test 8x8 images, SmallCNN, adam 3e-3, batch 32\n")
    print(f"{'run':10s} {'duration':>8s} {'batches':>8s} {'test acc':>9s} {'test CE':>8s} {'wall s':>7s} "
          f"{'compiles':>8s}  logs")
    for run in runs:
        print(f"{run['name']:10s} {run['duration']:>8s} {run['batches']:8d} {run['MulticlassAccuracy']:9.4f} "
              f"{run['CrossEntropy']:8.4f} {run['seconds']:7.2f} {run['compiles']:8d}  {run['log']}")


if __name__ == "__main__":
    main()
