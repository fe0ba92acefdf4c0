"""Time to accuracy on the digits data: how long a recipe takes to reach the baseline's final test accuracy.

For each seed the baseline (SmallCNN, adam) trains for ``--epochs`` epochs; its final test accuracy
is the target. Each recipe then trains epoch by epoch on the same seed, and the training wall time
(compiles included, evaluation excluded) at the first epoch whose test accuracy reaches the target
is compared with the baseline's own time to that accuracy. Runs are interleaved per seed; the table
prints the median ratio over the seeds.

Run: ``.venv/bin/python benchmarks/time_to_accuracy.py [--seeds 0,1,2] [--epochs 6]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax import algorithms as alg
from composerjax.data.digits import load_digits_split
from composerjax.models import SmallCNN

RECIPES: dict[str, Callable[[], list[Any]]] = {
    "baseline": lambda: [],
    "ls+ema+clip": lambda: [alg.LabelSmoothing(0.1), alg.EMA(half_life="30ba"), alg.GradientClipping("norm", 1.0)],
    "ls+cutout+ema": lambda: [alg.LabelSmoothing(0.1), alg.CutOut(length=0.25), alg.EMA(half_life="30ba")],
    "sam+ema": lambda: [alg.SAM(rho=0.05), alg.EMA(half_life="30ba")],
}


def accuracy_curve(seed: int, algorithms: list[Any], epochs: int) -> list[tuple[float, float]]:
    """``[(training seconds so far, test accuracy)]`` after each epoch."""
    (x_train, y_train), (x_test, y_test) = load_digits_split(seed=seed)
    trainer = Trainer(ComposerClassifier(SmallCNN(num_classes=10, rngs=nnx.Rngs(seed)), 10),
                      ArrayLoader((x_train, y_train), batch_size=32, seed=seed), f"{epochs}ep",
                      optax.adam(3e-3), algorithms=algorithms, progress_bar=False, seed=seed,
                      run_summary=False)
    test = ArrayLoader((x_test, y_test), batch_size=99, shuffle=False)
    curve, seconds = [], 0.0
    for _ in range(epochs):
        start = time.perf_counter()
        trainer.fit("1ep")
        jax.block_until_ready(trainer.state.train_state)
        seconds += time.perf_counter() - start
        curve.append((seconds, trainer.eval(test)["MulticlassAccuracy"]))
    return curve


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((seconds for seconds, accuracy in curve if accuracy >= target - 1e-9), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    ratios: dict[str, list[float | None]] = {name: [] for name in RECIPES if name != "baseline"}
    finals: dict[str, list[float]] = {name: [] for name in RECIPES}
    targets = []
    for seed in seeds:
        curves = {name: accuracy_curve(seed, recipe(), args.epochs) for name, recipe in RECIPES.items()}
        target = curves["baseline"][-1][1]
        targets.append(target)
        baseline_time = time_to(curves["baseline"], target)
        for name, curve in curves.items():
            finals[name].append(curve[-1][1])
            if name != "baseline":
                reached = time_to(curve, target)
                ratios[name].append(None if reached is None else reached / baseline_time)
    print(f"digits, SmallCNN, {args.epochs} epochs max, seeds {seeds}; target = baseline final test accuracy "
          f"(median {statistics.median(targets):.4f})")
    print(f"{'recipe':16s} {'median time ratio':>18s} {'reached':>8s} {'median final acc':>17s}")
    print(f"{'baseline':16s} {1.0:18.2f} {len(seeds):>5d}/{len(seeds)} {statistics.median(finals['baseline']):17.4f}")
    for name, values in ratios.items():
        reached = [v for v in values if v is not None]
        ratio = f"{statistics.median(reached):18.2f}" if reached else f"{'not reached':>18s}"
        print(f"{name:16s} {ratio} {len(reached):>5d}/{len(seeds)} {statistics.median(finals[name]):17.4f}")


if __name__ == "__main__":
    main()
