"""Engine overhead: Trainer.fit throughput against a hand-written jax.jit + optax loop.

Both contenders train the same NNX model on the same pre-built numpy batches with the same
optimizer; runs are interleaved in one process (round-robin, several rounds) and the table shows
the median throughput ratio Trainer / hand loop, so machine noise hits both alike.

Run: ``.venv/bin/python benchmarks/overhead.py [--rounds 5] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from composerjax import Trainer


class MLP(nnx.Module):
    def __init__(self, sizes: tuple[int, ...], rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


@dataclass
class Case:
    name: str
    sizes: tuple[int, ...]
    batch_size: int
    batches: int
    classify: bool


# batches = per round; many short interleaved rounds average out a noisy shared machine.
CASES = [
    Case("tiny MLP 16-32-32-1, batch 8", (16, 32, 32, 1), 8, 500, False),
    Case("medium MLP 784-512-512-10, batch 128", (784, 512, 512, 10), 128, 25, True),
]


def make_batches(case: Case, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(count):
        x = rng.normal(size=(case.batch_size, case.sizes[0])).astype(np.float32)
        if case.classify:
            y = rng.integers(0, case.sizes[-1], size=(case.batch_size,)).astype(np.int32)
        else:
            y = rng.normal(size=(case.batch_size, 1)).astype(np.float32)
        batches.append((x, y))
    return batches


def loss_of(case: Case) -> Callable[[nnx.Module, Any], jax.Array]:
    if case.classify:
        return lambda model, batch: optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1]).mean()
    return lambda model, batch: jnp.mean((model(batch[0]) - batch[1]) ** 2)


class HandLoop:
    """What a careful user writes by hand: one jitted step over (params, opt_state), donated."""

    def __init__(self, case: Case, batches: list[Any]) -> None:
        model = MLP(case.sizes, nnx.Rngs(0))
        self.graphdef, params = nnx.split(model)
        self.params = nnx.to_pure_dict(params)
        self.tx = optax.adam(1e-3)
        self.opt_state = self.tx.init(self.params)
        self.batches = batches
        loss_fn = loss_of(case)
        graphdef, tx = self.graphdef, self.tx

        def step(params: Any, opt_state: Any, batch: Any) -> Any:
            def loss(p: Any) -> jax.Array:
                return loss_fn(nnx.merge(graphdef, nnx.State(p)), batch)

            value, grads = jax.value_and_grad(loss)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        self.step = jax.jit(step, donate_argnums=(0, 1))
        self.run()  # compile

    def run(self) -> float:
        start = time.perf_counter()
        params, opt_state, loss = self.params, self.opt_state, None
        for batch in self.batches:
            params, opt_state, loss = self.step(params, opt_state, batch)
        jax.block_until_ready((params, loss))
        self.params, self.opt_state = params, opt_state
        return len(self.batches) / (time.perf_counter() - start)


class EngineLoop:
    """The same training through Trainer.fit, no algorithms, no loggers (unless given)."""

    def __init__(self, case: Case, batches: list[Any], algorithms: list[Any] | None = None,
                 loggers: list[Any] | None = None, log_interval: int = 10) -> None:
        self.batches = batches
        self.trainer = Trainer(
            MLP(case.sizes, nnx.Rngs(0)),
            batches,
            max_duration="0ba",
            optimizers=optax.adam(1e-3),
            loss_fn=loss_of(case),
            algorithms=algorithms or [],
            loggers=loggers or [],
            log_interval=log_interval,
            progress_bar=False,
            run_summary=False,
        )
        self.run()  # compile

    def run(self) -> float:
        start = time.perf_counter()
        self.trainer.fit(f"{len(self.batches)}ba")
        jax.block_until_ready(self.trainer.state.train_state)
        return len(self.batches) / (time.perf_counter() - start)


def measure(case: Case, rounds: int) -> dict[str, float]:
    batches = make_batches(case, case.batches)
    hand, engine = HandLoop(case, batches), EngineLoop(case, batches)
    hand_rates, engine_rates = [], []
    for _ in range(rounds):
        hand_rates.append(hand.run())
        engine_rates.append(engine.run())
    return {
        "hand steps/s": statistics.median(hand_rates),
        "engine steps/s": statistics.median(engine_rates),
        # Harmonic means: total steps over total time for each contender across all rounds.
        "ratio": statistics.harmonic_mean(engine_rates) / statistics.harmonic_mean(hand_rates),
        "compiles": engine.trainer.compile_count,
    }


def every_destination(folder: str) -> list[Any]:
    """One of each logger destination, writing to ``folder`` or to /dev/null."""
    from composerjax.loggers import ConsoleLogger, FileLogger, InMemoryLogger, ProgressBarLogger, TensorboardLogger

    null = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the benchmark
    return [ConsoleLogger(stream=null), ProgressBarLogger(stream=null, force=True),
            TensorboardLogger(log_dir=os.path.join(folder, "tb")), FileLogger(os.path.join(folder, "m.jsonl")),
            InMemoryLogger()]


def measure_logging(case: Case, rounds: int) -> dict[str, float]:
    """Every destination logging every batch against no loggers, both through Trainer.fit."""
    batches = make_batches(case, case.batches)
    with tempfile.TemporaryDirectory() as folder:
        quiet = EngineLoop(case, batches)
        logged = EngineLoop(case, batches, loggers=every_destination(folder), log_interval=1)
        quiet_rates, logged_rates = [], []
        for _ in range(rounds):
            quiet_rates.append(quiet.run())
            logged_rates.append(logged.run())
        logged.trainer.close()
    return {
        "hand steps/s": statistics.median(quiet_rates),
        "engine steps/s": statistics.median(logged_rates),
        "ratio": statistics.harmonic_mean(logged_rates) / statistics.harmonic_mean(quiet_rates),
        "compiles": logged.trainer.compile_count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="fewer batches, for a smoke run")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {args.rounds} interleaved rounds; steps/s are "
          "medians, engine/hand is total steps over total time")
    print(f"{'case':40s} {'hand steps/s':>13s} {'engine steps/s':>15s} {'engine/hand':>12s} {'compiles':>9s}")
    for case in CASES:
        if args.quick:
            case.batches = max(case.batches // 10, 5)
        row = measure(case, args.rounds)
        print(f"{case.name:40s} {row['hand steps/s']:13.0f} {row['engine steps/s']:15.0f} "
              f"{row['ratio']:12.3f} {row['compiles']:9d}", flush=True)
    case = CASES[1]
    row = measure_logging(case, args.rounds)
    print(f"\nlogging every batch to every destination (console, progress bar, tensorboard, jsonl, in-memory)\n"
          f"{'case':40s} {'no loggers/s':>13s} {'all loggers/s':>15s} {'logged/none':>12s}")
    print(f"{case.name:40s} {row['hand steps/s']:13.0f} {row['engine steps/s']:15.0f} {row['ratio']:12.3f}")


if __name__ == "__main__":
    main()
