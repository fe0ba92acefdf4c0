"""``steps_per_call='auto'`` in fresh processes on a busy machine: the same choice every run, and its speed.

Each of ``--runs`` rounds (3 by default) trains the tiny MLP (``overhead.CASES[0]``, batch 8) for
``--batches`` batches (20,000) in two fresh processes, one per contender, timed from building the
model to the last trained batch: compile included on both sides, the persistent compilation cache
off, and nothing one contender compiled left for the other. Each process first starts the JAX
backend and builds the model once (NNX's initialisers compile op by op on first use), so the
clock measures the loop each side offers, not process start-up:

* ``hand``: the strongest host-fed hand loop (``overhead.HandLoop``: numpy batches straight into a
  donated ``jax.jit`` step, parameters as plain dicts), built and run once;
* ``engine``: ``Trainer(...)`` with its defaults (``steps_per_call='auto'``, ``device_prefetch=2``)
  built and fitted once.

The order alternates between rounds. With ``--load N`` (2 by default) N busy processes spin on
the CPU for the whole measurement, as another job on the machine would. It prints each run's
steps/s, engine / hand, what ``'auto'`` chose, and the slowest engine run over the fastest.

Targets (issue 26): every run's engine / hand at least 1.5; the slowest engine run at least 0.7 of
the fastest; the same choice in every run.

Run: ``.venv/bin/python benchmarks/auto_fresh.py [--runs 3] [--batches 20000] [--load 2]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(batches: int, which: str) -> None:
    """One contender in this fresh process: seconds from building the model to the last trained batch."""
    sys.path.insert(0, HERE)
    import jax
    import optax
    from overhead import CASES, HandLoop, make_batches

    from composerjax import ComposerClassifier, Trainer

    case = CASES[0]
    data = make_batches(case, batches)
    # Start the backend and build the model once first, on both sides: the first JAX call of a process
    # pays for the backend, and NNX's initialisers run op by op, each compiled on first use (2 s on
    # 2 busy cores for this model, with the compilation cache off), which is user code, not the loop's.
    jax.block_until_ready(jax.jit(lambda x: x + 1)(jax.numpy.zeros(4)))
    case.module()
    start = time.perf_counter()
    if which == "hand":
        HandLoop(case, data, recipe=False)  # builds, compiles, then one pass over the batches
        print(json.dumps({"seconds": time.perf_counter() - start}))
        return
    trainer = Trainer(ComposerClassifier(case.module(), case.num_classes), data, max_duration=f"{batches}ba",
                      optimizers=optax.adam(1e-3), progress_bar=False, run_summary=False)
    trainer.fit()
    jax.block_until_ready(trainer.state.train_state)
    seconds = time.perf_counter() - start
    chosen = trainer.state.run_summary["steps_per_call"]
    print(json.dumps({"seconds": seconds, "chosen": chosen["chosen"], "reason": chosen["reason"],
                      "prefetch_thread": trainer.prefetch_threaded}))


def spin(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--load", type=int, default=2, help="busy processes spinning during the runs")
    parser.add_argument("--child", choices=("hand", "engine"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.batches, args.child)
        return
    stop = multiprocessing.Event()
    load = [multiprocessing.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.load)]
    for process in load:
        process.start()
    env = {**os.environ, "COMPOSERJAX_COMPILATION_CACHE": "0"}

    def launch(which: str) -> dict:
        command = [sys.executable, __file__, "--child", which, "--batches", str(args.batches)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{which} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    results = []
    try:
        for run in range(args.runs):
            order = ("engine", "hand") if run % 2 else ("hand", "engine")
            measured = {which: launch(which) for which in order}
            results.append({"seconds": {which: measured[which]["seconds"] for which in order},
                            "chosen": measured["engine"]["chosen"], "reason": measured["engine"]["reason"],
                            "prefetch_thread": measured["engine"]["prefetch_thread"]})
    finally:
        stop.set()
        for process in load:
            process.join()
    print(f"## steps_per_call='auto', tiny MLP, {args.batches} batches, compile included, {args.runs} fresh "
          f"processes, {args.load} busy processes beside them; steps/s")
    print(f"{'run':>4s} {'hand':>10s} {'engine':>10s} {'engine/hand':>12s}  chosen  prefetch thread")
    rates = []
    for index, result in enumerate(results):
        hand = args.batches / result["seconds"]["hand"]
        engine = args.batches / result["seconds"]["engine"]
        rates.append(engine)
        print(f"{index:4d} {hand:10.0f} {engine:10.0f} {engine / hand:12.2f}  {result['chosen']:6d}  "
              f"{result['prefetch_thread']}")
    print(f"choice in every run: {sorted({r['chosen'] for r in results})} ({results[0]['reason']})")
    print(f"slowest engine run / fastest: {min(rates) / max(rates):.2f}; targets: engine/hand >= 1.5 every run, "
          "slowest/fastest >= 0.7, one choice")


if __name__ == "__main__":
    main()
