"""Engine overhead: Trainer.fit throughput against a hand-written jax.jit + optax loop.

Every case trains the same NNX model on the same pre-built numpy batches with the same optimizer,
twice: plain, and with a five-algorithm recipe, where the hand loop has the same transforms written
into its jitted step (built from the same functional forms the algorithms use: ``mixup_sample``,
``smooth_labels``, ``cutout_batch``, ``sam_gradients``, ``compute_ema``, ``apply_alibi`` and
``optax.clip_by_global_norm``). Runs are interleaved in one process (round-robin, many short
rounds) and the table shows total steps over total time, engine / hand, so machine noise hits both
alike.

Run: ``.venv/bin/python benchmarks/overhead.py [--rounds 20] [--quick] [--only CNN]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from composerjax import ComposerClassifier, Trainer
from composerjax import algorithms as alg
from composerjax.algorithms.alibi import apply_alibi
from composerjax.algorithms.cutout import cutout_batch
from composerjax.algorithms.ema import compute_ema
from composerjax.algorithms.label_smoothing import smooth_labels
from composerjax.algorithms.mixup import mixup_sample, mixup_targets
from composerjax.algorithms.sam import sam_gradients
from composerjax.models import MLP, SmallCNN, TinyGPT
from composerjax.models.composer_model import cross_entropy

#: The recipe's hyperparameters, shared by the engine's algorithms and the hand-written transforms.
SMOOTHING, ALPHA, CLIP, EMA_DECAY, RHO = 0.1, 0.2, 1.0, 0.9, 0.05


@dataclass
class Case:
    name: str
    module: Callable[[], nnx.Module]
    num_classes: int
    batch_size: int
    input_shape: tuple[int, ...]
    batches: int  # per round (rounds of ~0.1-0.5 s: fit()'s fixed cost stays small)
    recipe: tuple[str, ...]  # five of: ls, mixup, cutout, clip, ema, sam, alibi
    tokens: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case("tiny MLP 16-32-32-4, b8", lambda: MLP((16, 32, 32, 4), rngs=nnx.Rngs(0)), 4, 8, (16,), 1000,
         ("ls", "mixup", "clip", "ema", "sam")),
    Case("medium MLP 784-512-512-10, b128", lambda: MLP((784, 512, 512, 10), rngs=nnx.Rngs(0)), 10, 128, (784,), 60,
         ("ls", "mixup", "clip", "ema", "sam")),
    Case("small CNN 8x8 digits, b128", lambda: SmallCNN(num_classes=10, rngs=nnx.Rngs(0)), 10, 128, (8, 8), 30,
         ("ls", "mixup", "cutout", "clip", "ema")),
    Case("small GPT d64 L2 T64, b16",
         lambda: TinyGPT(dim=64, depth=2, num_heads=4, max_length=64, rngs=nnx.Rngs(0)), 256, 16, (64,), 20,
         ("ls", "clip", "ema", "sam", "alibi"), tokens=True),
]

RECIPE_ALGORITHMS: dict[str, Callable[[], Any]] = {
    "ls": lambda: alg.LabelSmoothing(SMOOTHING),
    "mixup": lambda: alg.MixUp(ALPHA),
    "cutout": lambda: alg.CutOut(num_holes=1, length=0.5),
    "clip": lambda: alg.GradientClipping("norm", CLIP),
    "ema": lambda: alg.EMA(half_life=None, smoothing=EMA_DECAY),
    "sam": lambda: alg.SAM(rho=RHO),
    "alibi": lambda: alg.Alibi(max_sequence_length=64, train_sequence_length_scaling=1.0),
}


def make_batches(case: Case, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(count):
        shape = (case.batch_size, *case.input_shape)
        if case.tokens:
            x = rng.integers(0, case.num_classes, size=shape).astype(np.int32)
            y = rng.integers(0, case.num_classes, size=shape).astype(np.int32)
        else:
            x = rng.normal(size=shape).astype(np.float32)
            y = rng.integers(0, case.num_classes, size=(case.batch_size,)).astype(np.int32)
        batches.append((x, y))
    return batches


class HandLoop:
    """What a careful user writes by hand: one jitted step over the whole training carry, donated.

    With ``recipe`` the step also does the recipe's transforms: CutOut and MixUp on the inputs,
    label smoothing of the (mixed) targets, SAM's second gradient, gradient clipping in the optax
    chain, and an EMA of the weights; ALiBi is model surgery done once before splitting.
    """

    def __init__(self, case: Case, batches: list[Any], recipe: bool) -> None:
        module = case.module()
        steps = set(case.recipe) if recipe else set()
        if "alibi" in steps:
            apply_alibi(module, max_sequence_length=64)
        # Plain dicts, not nnx.State: far cheaper for jit to flatten on every call.
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
        tx = optax.chain(optax.clip_by_global_norm(CLIP), optax.adam(1e-3)) if "clip" in steps else optax.adam(1e-3)
        base_key = jax.random.key(0)
        classes = case.num_classes

        def forward(p: Any, r: Any, x: jax.Array) -> tuple[jax.Array, Any]:
            model = nnx.merge(graphdef, nnx.State(p), nnx.State(r))
            logits = model(x)
            return logits, nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2])

        def step(carry: Any, batch: Any) -> Any:
            params, rest, opt_state, ema, count = carry
            x, y = batch
            key = jax.random.fold_in(base_key, count)
            targets = y
            if "cutout" in steps:
                x = cutout_batch(x, 1, 0.5, rng=jax.random.fold_in(key, 1))
            if "mixup" in steps:
                mixing, indices = mixup_sample(jax.random.fold_in(key, 2), x.shape[0], ALPHA)
                x = (mixing * x + (1.0 - mixing) * x[indices]).astype(x.dtype)
                targets = mixup_targets(y, mixing, indices, classes)

            def loss(p: Any) -> tuple[jax.Array, Any]:
                logits, new_rest = forward(p, rest, x)
                dense = smooth_labels(logits, targets, SMOOTHING) if "ls" in steps else targets
                return cross_entropy(logits, dense), new_rest

            (value, new_rest), grads = jax.value_and_grad(loss, has_aux=True)(params)
            if "sam" in steps:
                grads = sam_gradients(lambda p: jax.grad(lambda q: loss(q)[0])(p), params, grads, RHO)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            if "ema" in steps:
                ema = compute_ema(params, ema, EMA_DECAY)
            return (params, new_rest, opt_state, ema, count + 1), value

        ema = jax.tree.map(jnp.array, params) if "ema" in steps else None
        self.carry = (params, rest, tx.init(params), ema, jnp.zeros((), jnp.int32))
        self.step = jax.jit(step, donate_argnums=0)
        self.batches = batches
        self.run()  # compile

    def run(self) -> float:
        start = time.perf_counter()
        carry, loss = self.carry, None
        for batch in self.batches:
            carry, loss = self.step(carry, batch)
        jax.block_until_ready((carry, loss))
        self.carry = carry
        return len(self.batches) / (time.perf_counter() - start)


class EngineLoop:
    """The same training through Trainer.fit, a batch per call: no loggers (unless given), the recipe as algorithms."""

    def __init__(self, case: Case, batches: list[Any], recipe: bool, loggers: list[Any] | None = None,
                 log_interval: int = 10, steps_per_call: int | str = 1) -> None:
        self.batches = batches
        self.trainer = Trainer(
            ComposerClassifier(case.module(), case.num_classes),
            batches,
            max_duration="0ba",
            optimizers=optax.adam(1e-3),
            algorithms=[RECIPE_ALGORITHMS[name]() for name in case.recipe] if recipe else [],
            loggers=loggers or [],
            log_interval=log_interval,
            steps_per_call=steps_per_call,  # per step: the hand loop's unit (benchmarks/fast_defaults.py: 'auto')
            progress_bar=False,
            run_summary=False,
        )
        self.run()  # compile

    def run(self) -> float:
        start = time.perf_counter()
        self.trainer.fit(f"{len(self.batches)}ba")
        jax.block_until_ready(self.trainer.state.train_state)
        return len(self.batches) / (time.perf_counter() - start)


def race(first: Any, second: Any, rounds: int) -> dict[str, float]:
    """Interleave ``first.run()`` and ``second.run()``; second / first as total steps over total time."""
    first_rates, second_rates = [], []
    for round_index in range(rounds):
        pair = [(first, first_rates), (second, second_rates)]
        for contender, rates in pair if round_index % 2 == 0 else pair[::-1]:
            rates.append(contender.run())
    return {
        "first": statistics.median(first_rates),
        "second": statistics.median(second_rates),
        "ratio": statistics.harmonic_mean(second_rates) / statistics.harmonic_mean(first_rates),
    }


def every_destination(folder: str) -> list[Any]:
    """One of each logger destination, writing to ``folder`` or to /dev/null."""
    from composerjax.loggers import ConsoleLogger, FileLogger, InMemoryLogger, ProgressBarLogger, TensorboardLogger

    null = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the benchmark
    return [ConsoleLogger(stream=null), ProgressBarLogger(stream=null, force=True),
            TensorboardLogger(log_dir=os.path.join(folder, "tb")), FileLogger(os.path.join(folder, "m.jsonl")),
            InMemoryLogger()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="fewer batches and rounds, for a smoke run")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {rounds} interleaved rounds; steps/s are "
          "medians, engine/hand is total steps over total time; targets: >= 0.97 medium MLP and CNN, "
          ">= 0.8 tiny MLP")
    print(f"{'case':34s} {'recipe':28s} {'hand steps/s':>13s} {'engine steps/s':>15s} {'engine/hand':>12s} "
          f"{'compiles':>9s}")
    for case in CASES:
        if args.only.lower() not in case.name.lower():
            continue
        if args.quick:
            case.batches = max(case.batches // 5, 3)
        batches = make_batches(case, case.batches)
        for recipe in (False, True):
            hand, engine = HandLoop(case, batches, recipe), EngineLoop(case, batches, recipe)
            row = race(hand, engine, rounds)
            label = "+".join(case.recipe) if recipe else "none"
            print(f"{case.name:34s} {label:28s} {row['first']:13.0f} {row['second']:15.0f} {row['ratio']:12.3f} "
                  f"{engine.trainer.compile_count:9d}", flush=True)
    if args.only and args.only.lower() not in CASES[1].name.lower():
        return
    case = CASES[1]
    batches = make_batches(case, case.batches)
    with tempfile.TemporaryDirectory() as folder:
        quiet = EngineLoop(case, batches, recipe=False)
        logged = EngineLoop(case, batches, recipe=False, loggers=every_destination(folder), log_interval=1)
        row = race(quiet, logged, rounds)
        logged.trainer.close()
    print(f"\nlogging every batch to every destination (console, progress bar, tensorboard, jsonl, in-memory)\n"
          f"{'case':34s} {'no loggers/s':>13s} {'all loggers/s':>15s} {'logged/none':>12s}")
    print(f"{case.name:34s} {row['first']:13.0f} {row['second']:15.0f} {row['ratio']:12.3f}")


if __name__ == "__main__":
    main()
