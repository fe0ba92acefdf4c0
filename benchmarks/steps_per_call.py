"""Several batches per compiled call: Trainer(steps_per_call=K) against hand-written loops, tiny MLP.

Contenders, interleaved in one process over several rounds (median steps/s, ratios against the
hand-written per-step loop):

* hand per-step: ``jax.jit`` of one adam step, called once per batch;
* hand scan: ``jax.jit`` of a ``lax.scan`` over K stacked batches, one call per K batches;
* engine per-step: ``Trainer.fit`` with ``steps_per_call=1``;
* engine K: ``Trainer.fit`` with ``steps_per_call=K`` (the batches are stacked on the host).

Rounds are long (4096 batches) so that each ``fit()`` call's fixed start-up cost (events, the
loader's iterator) weighs as little as it does in a real run; the ratios are steady-state steps/s.

Run: ``.venv/bin/python benchmarks/steps_per_call.py [--k 32] [--rounds 9] [--batches 4096]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from composerjax import ArrayLoader, Trainer
from composerjax.models import MLP

SIZES = (16, 32, 32, 1)
BATCH = 8



def loss_fn(model: nnx.Module, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def data(batches: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.normal(size=(batches * BATCH, SIZES[0])).astype(np.float32),
            rng.normal(size=(batches * BATCH, 1)).astype(np.float32))


def hand_loops(x: np.ndarray, y: np.ndarray, k: int) -> tuple:
    graphdef, state = nnx.split(MLP(SIZES, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)  # plain dicts: cheap to flatten on every call, as benchmarks/overhead.py
    optimizer = optax.adam(1e-3)

    def one(state: tuple, batch: tuple) -> tuple:
        params, opt_state = state
        grads = jax.grad(lambda p: loss_fn(nnx.merge(graphdef, nnx.State(p)), batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state)

    step = jax.jit(one, donate_argnums=0)
    many = jax.jit(lambda state, stacked: jax.lax.scan(lambda s, b: (one(s, b), None), state, stacked)[0],
                   donate_argnums=0)
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]
    stacked = [(np.stack([b[0] for b in batches[i:i + k]]), np.stack([b[1] for b in batches[i:i + k]]))
               for i in range(0, len(batches), k)]
    state = [(params, optimizer.init(params))]

    def per_step() -> int:
        s = state[0]
        for batch in batches:
            s = step(s, batch)
        state[0] = jax.block_until_ready(s)
        return len(batches)

    def scanned() -> int:
        s = state[0]
        for group in stacked:
            s = many(s, group)
        state[0] = jax.block_until_ready(s)
        return len(batches)

    return per_step, scanned


def engine(x: np.ndarray, y: np.ndarray, k: int) -> tuple:
    trainer = Trainer(MLP(SIZES, rngs=nnx.Rngs(0)), ArrayLoader((x, y), batch_size=BATCH, shuffle=False), None,
                      optax.adam(1e-3), loss_fn=loss_fn, steps_per_call=k, progress_bar=False, run_summary=False)
    batches = len(x) // BATCH

    def run() -> int:
        trainer.fit(f"{batches}ba")
        jax.block_until_ready(trainer.state.train_state)
        return batches

    return run, trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batches", type=int, default=4096, help="batches per round (a multiple of k)")
    args = parser.parse_args()
    x, y = data(args.batches)
    per_step, scanned = hand_loops(x, y, args.k)
    engine_one, trainer_one = engine(x, y, 1)
    engine_k, trainer_k = engine(x, y, args.k)
    contenders = {"hand per-step": per_step, f"hand scan x{args.k}": scanned, "engine per-step": engine_one,
                  f"engine steps_per_call={args.k}": engine_k}
    for run in contenders.values():  # compile, and a first pass
        run()
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, run in contenders.items():
            start = time.perf_counter()
            steps = run()
            rates[name].append(steps / (time.perf_counter() - start))
    base = statistics.median(rates["hand per-step"])
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; tiny MLP 16-32-32-1, batch {BATCH}, adam; "
          f"{args.rounds} interleaved rounds of {args.batches} batches")
    print(f"{'contender':34s} {'steps/s / hand per-step':>24s}")
    for name in contenders:
        print(f"{name:34s} {statistics.median(rates[name]) / base:24.2f}")
    print(f"compiles: engine per-step {trainer_one.compile_count}, engine K {trainer_k.compile_count}")


if __name__ == "__main__":
    main()
