"""Where the engine's host time goes: cProfile over Trainer.fit for one overhead.py case.

Prints the share of fit()'s wall time spent in the compiled call (``StepRunner.train_batch``'s own time,
which is where the step is dispatched and, when the device queue is full, waited for) against the
Python around it, then the functions with the most own time. This is the profile that found the
per-batch ``match`` calls and the per-fit() clock update (docs/performance.md).

First it prints the host work per batch: fit()'s time per batch with the compiled call replaced by
a Python no-op (fastest of several fits, no profiler). It does not depend on the device or on how
long the step takes, so it is the figure to compare before and after a change to the per-batch path.

Run: ``.venv/bin/python benchmarks/profile_engine.py [--case tiny] [--recipe] [--batches 2000]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import jax
from overhead import CASES, EngineLoop, make_batches

from composerjax.step.builder import TripCounted


def host_work_per_batch(engine: EngineLoop, fits: int = 15) -> float:
    """Seconds of host work per batch: the fastest of ``fits`` fits with every compiled train step a no-op."""
    builder = engine.trainer.runner.builder
    saved = dict(builder._train)
    loss = jax.numpy.zeros(())

    def no_op(train_state, batch, trips=None):
        return train_state, loss, {}

    for plan, step in saved.items():
        builder._train[plan] = TripCounted(no_op, step.trips) if type(step) is TripCounted else no_op
    try:
        engine.run()
        best = float("inf")
        for _ in range(fits):
            start = time.perf_counter()
            engine.trainer.fit(f"{len(engine.batches)}ba")
            best = min(best, (time.perf_counter() - start) / len(engine.batches))
    finally:
        builder._train.update(saved)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", default="tiny", help="a case of overhead.py whose name contains this")
    parser.add_argument("--recipe", action="store_true", help="with the case's five-algorithm recipe")
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    case = next(c for c in CASES if args.case.lower() in c.name.lower())
    batches = make_batches(case, args.batches)
    engine = EngineLoop(case, batches, args.recipe)  # compiles
    host = host_work_per_batch(engine)
    engine.run()  # warm

    profile = cProfile.Profile()
    profile.enable()
    engine.run()
    profile.disable()
    stats = pstats.Stats(profile)
    own = {f"{path.rsplit('/', 1)[-1]}:{line}({name})": row[2] for (path, line, name), row in stats.stats.items()}
    total = sum(own.values())
    dispatch = sum(t for key, t in own.items() if key.endswith("(train_batch)")) + \
        sum(t for key, t in own.items() if key.endswith("(block_until_ready)"))
    label = "+".join(case.recipe) if args.recipe else "no algorithms"
    print(f"jax {jax.__version__}; {case.name}, {label}, {args.batches} batches under cProfile "
          "(which inflates small Python calls)")
    print(f"host work per batch, the compiled call a no-op (fastest of 15 fits): {host * 1e6:.2f} us")
    print(f"compiled call (dispatch + waiting for the device): {dispatch / total:.3f} of fit()'s time")
    print(f"engine and trainer Python around it:               {1 - dispatch / total:.3f}\n")
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])


if __name__ == "__main__":
    main()
