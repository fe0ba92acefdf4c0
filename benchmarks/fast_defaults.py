"""The engine against the loops people write by hand, with its fast defaults: auto grouping, prefetch, warm starts.

Each section runs its contenders interleaved in one process (round-robin, alternating order) and
prints ratios, except the warm start, which needs fresh processes:

* ``auto``: the tiny MLP (batch 8) with ``Trainer``'s defaults (``steps_per_call='auto'``) against
  the strongest host-fed hand loop: numpy batches straight into a donated ``jax.jit`` step,
  parameters as plain dicts (``overhead.HandLoop``).
* ``data``: a grain pipeline whose host work costs about as much as the step (an MLP sized so its
  step is at least grain's own per-batch cost, batch 64), twice: a per-sample numpy augmentation
  (CPU work) and slow record reads without CPU work (as remote storage). The engine with its
  defaults (GrainLoader's read options, the prefetch thread) against the naive hand loop that
  loads a batch with ``grain.DataLoader``'s defaults, steps, and reads the step's loss before
  loading the next; the asynchronous hand loop that never reads a value back; and the naive loop
  given the GrainLoader's read options, which separates the two effects.
* ``eval``: ``trainer.eval()`` (cross-entropy and accuracy) against a hand-written jitted eval loop
  over the same loader that carries its sums in one donated accumulator.
* ``memory``: the compiled train step's arguments + temporaries (``memory_analysis()``) against the
  hand loop's, medium MLP and small GPT.
* ``warm``: time to the first trained batch of the small GPT with a five-algorithm recipe, in fresh
  processes: a cold compilation cache against a warm one (the second identical run).

Run: ``.venv/bin/python benchmarks/fast_defaults.py [--only auto,data,eval,memory,warm] [--rounds 7]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import CASES, EngineLoop, HandLoop, make_batches  # noqa: E402

from composerjax import ArrayLoader, ComposerClassifier, Trainer  # noqa: E402
from composerjax.models import MLP  # noqa: E402


def race(contenders: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Run every contender once per round, order alternating; each returns items/s. Median items/s per contender."""
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            rates[name].append(contenders[name]())
    return {name: statistics.median(values) for name, values in rates.items()}


# -- auto grouping ---------------------------------------------------------------------------------
def auto_section(rounds: int) -> None:
    case = CASES[0]
    batches = make_batches(case, 4096)
    hand = HandLoop(case, batches, recipe=False)
    trainer = Trainer(ComposerClassifier(case.module(), case.num_classes), batches, optimizers=optax.adam(1e-3),
                      progress_bar=False, run_summary=False)  # steps_per_call='auto', device_prefetch=2
    trainer.fit("40000ba")  # the first fit decides (a long run repays the group's compile)
    per_step = EngineLoop(case, batches, recipe=False, steps_per_call=1)

    def engine() -> float:
        start = time.perf_counter()
        trainer.fit(f"{len(batches)}ba")
        jax.block_until_ready(trainer.state.train_state)
        return len(batches) / (time.perf_counter() - start)

    rates = race({"hand": hand.run, "engine steps_per_call=1": per_step.run, "engine defaults": engine}, rounds)
    chosen = trainer.state.run_summary["steps_per_call"]
    print(f"\n## auto: {case.name}, {rounds} interleaved rounds of {len(batches)} batches; steps/s and / hand loop")
    print(f"steps_per_call='auto' chose {chosen['chosen']} ({chosen['reason']}); "
          "target: defaults >= 3x the hand loop, per step >= 0.9")
    for name, rate in rates.items():
        print(f"{name:28s} {rate:10.0f} {rate / rates['hand']:8.2f}")


# -- a data path with host work -----------------------------------------------------------------
SAMPLES, FEATURES, BATCH = 4096, 784, 64


class Records:
    """``(image, label)`` records, as a grain source; ``latency`` seconds per read (as remote storage)."""

    def __init__(self, latency: float = 0.0) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(SAMPLES, FEATURES)).astype(np.float32)
        self.y = rng.integers(0, 10, size=SAMPLES).astype(np.int32)
        self.latency = latency

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        if self.latency:
            time.sleep(self.latency)
        return self.x[index], self.y[index]


def augmentation(repeats: int) -> Any:
    import grain

    class Augment(grain.transforms.Map):
        """Per-sample jitter and clipping, ``repeats`` passes: numpy work on each record."""

        def map(self, record: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
            x, y = record
            for _ in range(repeats):
                x = np.clip(x * 0.999 + 0.001, -3.0, 3.0)
            return x, y

    return Augment()


def data_section(rounds: int, kind: str = "cpu") -> None:
    """``kind``: 'cpu', a per-sample numpy augmentation; 'read', per-record read latency and no CPU work."""
    import grain
    from absl import flags

    from composerjax.data import GrainLoader

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    optimizer = optax.adam(1e-3)
    tuned = GrainLoader(Records(), batch_size=BATCH).read_options  # the engine's loader's default

    def pipeline(amount: float) -> tuple[Records, list[Any]]:
        """The source and operations for a host-work ``amount``: numpy passes, or seconds of latency per read."""
        if kind == "cpu":
            return Records(), [augmentation(int(amount))]
        return Records(latency=amount), []

    def grain_batches(seed: int, amount: float, read_options: Any = None, limit: int | None = None) -> Any:
        source, operations = pipeline(amount)
        loader = grain.DataLoader(
            data_source=source,
            sampler=grain.samplers.IndexSampler(num_records=SAMPLES, shuffle=True, seed=seed, num_epochs=1,
                                                shard_options=grain.sharding.NoSharding()),
            operations=[*operations, grain.transforms.Batch(BATCH, drop_remainder=True)],
            worker_count=0, **({"read_options": read_options} if read_options is not None else {}))
        for index, batch in enumerate(loader):
            if limit is not None and index >= limit:
                return
            yield batch

    def loader_seconds(amount: float, read_options: Any = None) -> float:
        batches = grain_batches(0, amount, read_options, limit=12)
        next(batches)  # grain starts its threads
        start = time.perf_counter()
        count = sum(1 for _ in batches)
        return (time.perf_counter() - start) / count

    def hand_step(width: int) -> tuple[Any, list[Any], float]:
        sizes = (FEATURES, width, width, 10)
        graphdef, state = nnx.split(MLP(sizes, rngs=nnx.Rngs(0)))
        params = nnx.to_pure_dict(state)

        def loss(p: Any, batch: Any) -> jax.Array:
            logits = nnx.merge(graphdef, nnx.State(p))(batch[0])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

        def one(carry: Any, batch: Any) -> Any:
            p, opt = carry
            value, grads = jax.value_and_grad(loss)(p, batch)
            updates, opt = optimizer.update(grads, opt, p)
            return (optax.apply_updates(p, updates), opt), value

        step = jax.jit(one, donate_argnums=0)
        carry = [(params, optimizer.init(params))]
        probe = (Records().x[:BATCH], Records().y[:BATCH])
        carry[0], value = step(carry[0], probe)
        jax.block_until_ready(value)
        start = time.perf_counter()
        for _ in range(5):
            carry[0], value = step(carry[0], probe)
        jax.block_until_ready(value)
        return step, carry, (time.perf_counter() - start) / 5

    # A model whose step costs at least what grain itself spends per batch (its default options),
    # then host work that brings producing a batch to about one step.
    base = loader_seconds(0)
    for width in (512, 1024, 2048, 2896, 4096):
        step, carry, step_s = hand_step(width)
        if step_s >= base:
            break
    amount = 1 if kind == "cpu" else 2e-5
    load_s = loader_seconds(amount)
    while load_s < step_s and amount < 4096:
        amount *= 2
        load_s = loader_seconds(amount)
    tuned_load_s = loader_seconds(amount, tuned)
    sizes = (FEATURES, width, width, 10)
    batches_per_epoch = SAMPLES // BATCH

    def naive(read_options: Any = None) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            for batch in grain_batches(1, amount, read_options):
                carry[0], value = step(carry[0], batch)
                float(value)  # the loop reads each step's loss before loading the next batch
            return batches_per_epoch / (time.perf_counter() - start)

        return run

    def asynchronous() -> float:
        start = time.perf_counter()
        value = None
        for batch in grain_batches(1, amount):
            carry[0], value = step(carry[0], batch)
        jax.block_until_ready(value)
        return batches_per_epoch / (time.perf_counter() - start)

    def engine_loop(device_prefetch: int = 2) -> Callable[[], float]:
        source, operations = pipeline(amount)
        loader = GrainLoader(source, batch_size=BATCH, shuffle=True, seed=0, operations=operations)
        trainer = Trainer(ComposerClassifier(MLP(sizes, rngs=nnx.Rngs(0)), 10), loader, optimizers=optax.adam(1e-3),
                          progress_bar=False, run_summary=False, device_prefetch=device_prefetch)
        trainer.fit("8ba")  # compile, and the prefetch decision

        def run() -> float:
            start = time.perf_counter()
            trainer.fit("1ep")
            jax.block_until_ready(trainer.state.train_state)
            return batches_per_epoch / (time.perf_counter() - start)

        run.trainer = trainer  # type: ignore[attr-defined]
        return run

    engine, no_prefetch = engine_loop(), engine_loop(device_prefetch=0)
    threads, buffer = tuned.num_threads, tuned.prefetch_buffer_size
    rates = race({"naive hand loop (load, step, read loss)": naive(),
                  "async hand loop (no read-back)": asynchronous,
                  f"naive hand loop, {threads} threads/{buffer} buffer": naive(tuned),
                  "engine defaults (prefetch thread)": engine,
                  "engine, device_prefetch=0": no_prefetch}, rounds)
    for run in (engine, no_prefetch):
        run.trainer.close()
    work = (f"{int(amount)} numpy passes over each record" if kind == "cpu" else
            f"{amount * 1e3:.2f} ms of latency per record read, no CPU work")
    title = "a per-sample augmentation (CPU work)" if kind == "cpu" else "slow reads (as remote storage)"
    print(f"\n## data ({kind}): grain + {title}, MLP 784-{width}-{width}-10, batch {BATCH}; {rounds} rounds "
          f"of {batches_per_epoch} batches; batches/s and / naive")
    print(f"a step takes {step_s * 1e3:.1f} ms; producing a batch ({work}) {load_s * 1e3:.1f} ms with grain's "
          f"default read options (16 threads, 500 records; {base * 1e3:.1f} ms without the host work), "
          f"{tuned_load_s * 1e3:.1f} ms with the GrainLoader's ({threads} threads, {buffer} records); the hand "
          f"loops use grain's defaults unless named; prefetch thread started: {engine.trainer.prefetch_threaded}; "
          "target: engine >= 1.5x naive")
    first = rates["naive hand loop (load, step, read loss)"]
    for name, rate in rates.items():
        print(f"{name:42s} {rate:8.2f} {rate / first:8.2f}")


# -- eval ------------------------------------------------------------------------------------------
def eval_section(rounds: int) -> None:
    sizes = (784, 512, 512, 10)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8192, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=8192).astype(np.int32)
    loader = ArrayLoader((x, y), batch_size=256, shuffle=False)
    model = ComposerClassifier(MLP(sizes, rngs=nnx.Rngs(0)), 10)
    trainer = Trainer(model, ArrayLoader((x, y), batch_size=256), optimizers=optax.adam(1e-3), eval_dataloader=loader,
                      progress_bar=False, run_summary=False)
    graphdef, state = nnx.split(MLP(sizes, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)

    def accumulate(totals: Any, p: Any, batch: Any) -> Any:
        logits = nnx.merge(graphdef, nnx.State(p))(batch[0])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch[1])
        correct = jnp.sum(jnp.argmax(logits, -1) == batch[1])
        return (totals[0] + losses.sum(), totals[1] + correct, totals[2] + batch[1].shape[0])

    step = jax.jit(accumulate, donate_argnums=0)

    def hand() -> float:
        start = time.perf_counter()
        totals = (jnp.zeros(()), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
        for batch in loader:
            totals = step(totals, params, batch)
        loss_sum, correct, count = jax.device_get(totals)
        _ = (float(loss_sum / count), float(correct / count))
        return len(loader) / (time.perf_counter() - start)

    def engine() -> float:
        start = time.perf_counter()
        trainer.eval()
        return len(loader) / (time.perf_counter() - start)

    hand(), engine()
    rates = race({"hand jitted eval loop": hand, "trainer.eval()": engine}, rounds)
    print(f"\n## eval: MLP 784-512-512-10 on 8192 samples, batch 256; {rounds} rounds; batches/s and / hand; "
          "target >= 0.95")
    for name, rate in rates.items():
        print(f"{name:28s} {rate:8.1f} {rate / rates['hand jitted eval loop']:8.3f}")
    print(f"metrics: {sorted(trainer.eval())}")


# -- memory ----------------------------------------------------------------------------------------
def memory_section() -> None:
    print("\n## memory: compiled train step, arguments + temporaries (memory_analysis); target engine/hand <= 1.05")
    print(f"{'case':34s} {'hand MiB':>10s} {'engine MiB':>11s} {'engine/hand':>12s}")
    for case in (CASES[1], CASES[3]):
        batches = make_batches(case, 2)
        hand = HandLoop(case, batches, recipe=False)
        stats = hand.step.lower(hand.carry, batches[0]).compile().memory_analysis()
        hand_bytes = stats.argument_size_in_bytes + stats.temp_size_in_bytes
        engine = EngineLoop(case, batches, recipe=False)
        record = [r for r in engine.trainer.state.compiled_steps if r.kind == "train"][0].memory
        engine_bytes = record["argument_size"] + record["temp_size"]
        print(f"{case.name:34s} {hand_bytes / 2**20:10.2f} {engine_bytes / 2**20:11.2f} "
              f"{engine_bytes / hand_bytes:12.3f}")


# -- warm starts -----------------------------------------------------------------------------------
WARM_SCRIPT = """
import sys, time, json
started = float(sys.argv[1])
sys.path.insert(0, {here!r})
import jax, optax
from overhead import CASES, RECIPE_ALGORITHMS, make_batches
from composerjax import Callback, ComposerClassifier, Trainer
imported = time.time()
case = CASES[3]
batches = make_batches(case, 4)
class First(Callback):
    def batch_end(self, state, logger):
        if state.timestamp.batch == 1:
            jax.block_until_ready(state.loss)
            self.at = time.time()
first = First()
built = time.time()
trainer = Trainer(ComposerClassifier(case.module(), case.num_classes), batches, "1ba", optax.adam(1e-3),
                  algorithms=[RECIPE_ALGORITHMS[name]() for name in case.recipe], callbacks=[first],
                  progress_bar=False, run_summary=False)
trainer.fit()
print(json.dumps({{"from_start": first.at - started, "from_trainer": first.at - built,
                   "imports": imported - started,
                   "loaded": trainer.state.run_summary["compilation_cache"]["steps_loaded"]}}))
"""


def warm_section(pairs: int) -> None:
    script = WARM_SCRIPT.format(here=os.path.dirname(os.path.abspath(__file__)))
    cold, warm = [], []
    for _ in range(pairs):
        with tempfile.TemporaryDirectory() as folder:
            env = dict(os.environ, COMPOSERJAX_CACHE_DIR=folder)
            for runs in (cold, warm):
                done = subprocess.run([sys.executable, "-c", script, repr(time.time())], env=env, capture_output=True,
                                      text=True, check=True)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"\n## warm: time to the first trained batch, small GPT + ls+clip+ema+sam+alibi, fresh processes, "
          f"median of {pairs} cold/warm pairs; target warm/cold <= 0.3")
    print(f"{'measured from':34s} {'cold s':>8s} {'warm s':>8s} {'warm/cold':>10s}")
    for key, label in (("from_trainer", "model + Trainer to batch 1 done"),
                       ("from_start", "process start (imports too)")):
        c, w = statistics.median(r[key] for r in cold), statistics.median(r[key] for r in warm)
        print(f"{label:34s} {c:8.2f} {w:8.2f} {w / c:10.2f}")
    print(f"steps loaded from the cache: cold {[r['loaded'] for r in cold]}, warm {[r['loaded'] for r in warm]}; "
          f"imports took {statistics.median(r['imports'] for r in cold):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="auto,data,eval,memory,warm")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    chosen = args.only.split(",")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores")
    if "auto" in chosen:
        auto_section(args.rounds)
    if "data" in chosen:
        data_section(max(3, args.rounds // 2), "cpu")
        data_section(max(3, args.rounds // 2), "read")
    if "eval" in chosen:
        eval_section(args.rounds)
    if "memory" in chosen:
        memory_section()
    if "warm" in chosen:
        warm_section(3)


if __name__ == "__main__":
    main()
