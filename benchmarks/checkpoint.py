"""Checkpoint overhead: step time while an async save is in flight, and save / restore cost in steps.

Part 1 trains the medium MLP with two trainers interleaved in one process (round-robin, several
rounds): one never saves, the other saves every ``--save-every`` batches through orbax, async. A
callback blocks on each step's loss at BATCH_END and takes the time, so every step is timed on its
own despite async dispatch. The saving run's steps fall in three kinds: the step right after a save
was due (it also pays the synchronous part of ``save()``), steps while orbax reports the save still
running, and steps with no save in flight. The table shows each kind's median step time over the
no-save run's median and over the same run's quiet steps (the target is in-flight / normal <= 1.2).
The warm-up shifts the saves to an eighth of an interval into each round, so a save has most of an
interval to finish before ``fit()``'s closing wait; the header counts any it cut short.

Part 1 blocks on every step, so the host's Python and the device's compute take turns and every
bit of background work lands on the step's critical path: the worst case. A real run does not
block: dispatch is asynchronous and the host runs ahead of the device. Part 1b measures that: the
same two trainers, one long ``fit`` each, blocking only at the edges of windows of ``--window``
steps. A saving run's window starts one step after the save (that step pays the synchronous part)
and the header counts the windows whose save was still running at their end (so the whole window
was in flight). The ratio is the saving run's median window time over the no-save run's median
window time on the same batch indices. Both runs also block at each due batch, which gives a
third row: a whole interval, from one due batch to the next, with its save included.

Part 2 times ``Checkpointer.save(state)`` returning, the save reaching disk (``wait()``) and
``Checkpointer.restore(state)`` (the calls the Trainer makes for ``save_interval`` and ``load_path``),
interleaved with train steps of the same trainer, in seconds and in train steps.

Run: ``.venv/bin/python benchmarks/checkpoint.py [--rounds 10] [--save-every 100]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from composerjax import ArrayLoader, Callback, Trainer
from composerjax.checkpoint.checkpointer import Checkpointer
from composerjax.models import MLP

CASE = "medium MLP 784-512-512-10, batch 128"
SIZES = (784, 512, 512, 10)
BATCH_SIZE = 128
LOADER_BATCHES = 32
KEEP = 2  # checkpoints kept on disk, as a long run would; deleting the oldest is part of the cost
FALLBACK_FLIGHT_STEPS = 5  # steps counted as in flight when the manager cannot say



def make_loader() -> ArrayLoader:
    rng = np.random.default_rng(0)
    samples = BATCH_SIZE * LOADER_BATCHES
    x = rng.normal(size=(samples, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], size=(samples,)).astype(np.int32)
    return ArrayLoader((x, y), batch_size=BATCH_SIZE, seed=0)


def loss_fn(model: nnx.Module, batch: Any) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1]).mean()


def saving_in_progress(checkpointer: Any) -> bool | None:
    """Whether orbax is still writing a started save; None when this orbax cannot say.

    The checkpointer writes with an ``orbax.checkpoint.AsyncCheckpointer``, whose commit runs on a
    thread of its async manager: the save is in flight while that thread is alive.
    """
    manager = getattr(getattr(checkpointer, "writer", None), "_async_manager", None)
    if manager is None or not hasattr(manager, "_thread"):
        return None
    thread = manager._thread
    return thread is not None and thread.is_alive()


class StepTimer(Callback):
    """Time each step (BATCH_END to BATCH_END, blocking on the loss) and sort it by save activity.

    ``save_every`` is the trainer's save interval in batches (0: it never saves). The trainer saves
    right after BATCH_END of a due batch, so the next step is the one that pays for ``save()``.
    """

    def __init__(self, save_every: int = 0) -> None:
        self.save_every = save_every
        self.checkpointer: Any = None  # set once the Trainer (which owns it) exists
        self.times: dict[str, list[float]] = {"start": [], "flight": [], "quiet": []}
        self.flight_lengths: list[int] = []  # steps each save stayed in flight
        self.cut_short = 0  # saves still in flight when fit() ended (its closing wait() finished them)
        self._last: float | None = None
        self._save_started = False
        self._flight = 0

    def reset(self) -> None:
        for samples in self.times.values():
            samples.clear()
        self.flight_lengths.clear()
        self.cut_short = 0

    def fit_start(self, state: Any, logger: Any) -> None:
        self._last = None  # the gap since the previous fit holds its closing wait(), not a step
        if self._save_started or self._flight:
            self.cut_short += 1
        self._save_started, self._flight = False, 0

    def batch_end(self, state: Any, logger: Any) -> None:
        state.loss.block_until_ready()
        now = time.perf_counter()
        if self._save_started:
            kind = "start"
        elif self._flight:
            kind = "flight"
        else:
            kind = "quiet"
        # A new epoch's first step also builds the loader's iterator: left out of every kind.
        if self._last is not None and state.timestamp.batch_in_epoch.value != 1:
            self.times[kind].append(now - self._last)
        self._last = now

        if self._save_started or self._flight:
            running = saving_in_progress(self.checkpointer)
            if running is None:
                running = self._flight + 1 < FALLBACK_FLIGHT_STEPS
            self._flight += 1
            if not running:
                self.flight_lengths.append(self._flight)
                self._flight = 0
        self._save_started = bool(self.save_every) and state.timestamp.batch.value % self.save_every == 0
        if self._save_started and self._flight:  # the previous save outlived the interval
            self.flight_lengths.append(self._flight)
            self._flight = 0


def make_trainer(timer: StepTimer, save_folder: str | None = None, save_every: int = 0) -> Trainer:
    saving = {"save_folder": save_folder, "save_interval": f"{save_every}ba",
              "save_num_checkpoints_to_keep": KEEP} if save_folder else {}
    trainer = Trainer(
        MLP(SIZES, rngs=nnx.Rngs(0)),
        make_loader(),
        max_duration="0ba",
        optimizers=optax.adam(1e-3),
        loss_fn=loss_fn,
        callbacks=[timer],
        progress_bar=False,
        run_summary=False,
        **saving,
    )
    timer.checkpointer = trainer.checkpointer
    return trainer


def measure_in_flight(rounds: int, save_every: int) -> dict[str, Any]:
    """Interleave a no-save trainer and one saving every ``save_every`` batches; pool the step times."""
    plain_timer, saving_timer = StepTimer(), StepTimer(save_every)
    with tempfile.TemporaryDirectory() as folder:
        plain = make_trainer(plain_timer)
        saving = make_trainer(saving_timer, folder, save_every)
        # Compile, then one discarded round (the first save sets up orbax); the offset puts each
        # round's saves an eighth of an interval after its start, far from fit()'s closing wait().
        warmup = f"{3 * save_every - max(save_every // 8, 1)}ba"
        for trainer in (plain, saving):
            trainer.fit(warmup)
        plain_timer.reset()
        saving_timer.reset()
        for _ in range(rounds):
            plain.fit(f"{2 * save_every}ba")
            saving.fit(f"{2 * save_every}ba")
        plain.close()
        saving.close()
    baseline = plain_timer.times["quiet"]
    times = saving_timer.times
    return {
        "plain": baseline, **times, "flight_lengths": saving_timer.flight_lengths,
        "cut_short": saving_timer.cut_short,
        # Every measured step of each run (the same batch indices): what saving costs a run in all.
        "all": times["start"] + times["flight"] + times["quiet"],
    }


class WindowTimer(Callback):
    """Time windows of ``window`` steps that start one step after each due save, blocking only at the edges.

    Between the edges the host dispatches steps asynchronously, as a training run does, so the
    window time is the pipelined step time. The no-save trainer times the same batch indices.
    """

    def __init__(self, save_every: int, window: int) -> None:
        self.save_every, self.window = save_every, window
        self.checkpointer: Any = None
        self.windows: list[float] = []
        self.intervals: list[float] = []  # due batch to due batch: a whole interval, save() included
        self.in_flight_at_end: list[bool] = []
        self._start: float | None = None
        self._interval_start: float | None = None

    def fit_start(self, state: Any, logger: Any) -> None:
        self._start = self._interval_start = None  # only spans inside one fit (the other trainer runs between)

    def batch_end(self, state: Any, logger: Any) -> None:
        offset = state.timestamp.batch.value % self.save_every
        if offset == 0:  # BATCH_END of a due batch comes before the trainer's save()
            state.loss.block_until_ready()
            now = time.perf_counter()
            if self._interval_start is not None:
                self.intervals.append(now - self._interval_start)
            self._interval_start = now
        elif offset == 1:  # the step after a due save (its sync part is paid): the window opens
            state.loss.block_until_ready()
            self._start = time.perf_counter()
        elif offset == 1 + self.window and self._start is not None:
            state.loss.block_until_ready()
            self.windows.append(time.perf_counter() - self._start)
            self._start = None
            if self.checkpointer is not None:
                self.in_flight_at_end.append(bool(saving_in_progress(self.checkpointer)))


def measure_pipelined(rounds: int, save_every: int, window: int) -> dict[str, Any]:
    """Median window time while a save is in flight, steps dispatched without blocking, against no saves."""
    timers = {"plain": WindowTimer(save_every, window), "saving": WindowTimer(save_every, window)}
    with tempfile.TemporaryDirectory() as folder:
        trainers = {"plain": make_trainer(timers["plain"]),
                    "saving": make_trainer(timers["saving"], folder, save_every)}
        timers["saving"].checkpointer = trainers["saving"].checkpointer
        for name, trainer in trainers.items():  # compile and the first save (orbax setup)
            trainer.fit(f"{2 * save_every - max(save_every // 8, 1)}ba")
            timers[name].windows.clear()
            timers[name].intervals.clear()
            timers[name].in_flight_at_end.clear()
        for _ in range(rounds):
            for trainer in trainers.values():
                trainer.fit(f"{2 * save_every}ba")  # two due batches: one whole interval between them
        for trainer in trainers.values():
            trainer.close()
    plain, saving = timers["plain"], timers["saving"]
    return {"plain": statistics.median(plain.windows), "saving": statistics.median(saving.windows),
            "windows": len(saving.windows), "in_flight": sum(saving.in_flight_at_end),
            "plain interval": statistics.median(plain.intervals),
            "saving interval": statistics.median(saving.intervals), "intervals": len(saving.intervals)}


def measure_save_restore(rounds: int, steps_between: int) -> dict[str, Any]:
    """Per round: a few timed train steps, then ``save()``, ``wait()`` and ``restore()`` of that state.

    The trainer has no save_folder (``fit()`` may save when it ends, which would leave nothing for
    the timed save to do); a Checkpointer of its own, the class the Trainer saves with, saves it.
    """
    timer = StepTimer()
    samples: dict[str, list[float]] = {"save": [], "on disk": [], "restore": []}
    with tempfile.TemporaryDirectory() as folder:
        trainer = make_trainer(timer)
        checkpointer, state = Checkpointer(folder, keep=KEEP), trainer.state
        trainer.fit("2ba")
        nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state.train_state))
        timer.reset()
        for _ in range(rounds + 1):  # the first round (orbax setup) is discarded
            trainer.fit(f"{steps_between}ba")
            jax.block_until_ready(state.train_state)
            start = time.perf_counter()
            checkpointer.save(state)
            returned = time.perf_counter()
            checkpointer.wait()
            on_disk = time.perf_counter()
            checkpointer.restore(state)
            jax.block_until_ready(state.train_state)
            restored = time.perf_counter()
            samples["save"].append(returned - start)
            samples["on disk"].append(on_disk - start)
            samples["restore"].append(restored - on_disk)
        checkpointer.close()
        trainer.close()
    return {"step": statistics.median(timer.times["quiet"]), "bytes": nbytes,
            **{name: statistics.median(values[1:]) for name, values in samples.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=100, help="save interval in batches (part 1)")
    parser.add_argument("--window", type=int, default=20, help="steps per pipelined window (part 1b)")
    args = parser.parse_args()
    if args.save_every < 2:
        parser.error("--save-every must be at least 2")

    row = measure_in_flight(args.rounds, args.save_every)
    plain, quiet = statistics.median(row["plain"]), statistics.median(row["quiet"])
    flights = row["flight_lengths"]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {CASE}, adam; {args.rounds} interleaved rounds "
          f"of {2 * args.save_every} batches per trainer, async save every {args.save_every} batches "
          f"(keep {KEEP})")
    print(f"each step timed alone (blocking on its loss); ratios are median step time over median step time; "
          f"a save stayed in flight for a median {statistics.median(flights) if flights else 0:.0f} steps "
          f"({len(flights)} saves, {row['cut_short']} cut short by fit()'s closing wait)")
    print(f"{'steps':56s} {'count':>6s} {'median ms':>10s} {'/ no-save run':>14s} {'/ quiet steps':>14s}")
    rows = [
        ("no-save trainer", row["plain"]),
        ("saving trainer: no save in flight", row["quiet"]),
        ("saving trainer: step after save() (pays its sync part)", row["start"]),
        ("saving trainer: save in flight (after that step)", row["flight"]),
    ]
    for name, values in rows:
        if not values:
            print(f"{name:56s} {0:6d} {'-':>10s} {'-':>14s} {'-':>14s}")
            continue
        median = statistics.median(values)
        print(f"{name:56s} {len(values):6d} {median * 1e3:10.2f} {median / plain:14.3f} {median / quiet:14.3f}")
    # Total over total on the same batch indices: the whole run's cost of saving, stalls included.
    total = sum(row["all"]) / sum(row["plain"])
    print(f"{'saving trainer: all steps, total time / total time':56s} {len(row['all']):6d} {'':>10s} "
          f"{total:14.3f}")

    piped = measure_pipelined(3 * args.rounds, args.save_every, args.window)  # windows are short: more of them
    print(f"\npipelined (no per-step blocking): windows of {args.window} steps from one step after each save; "
          f"{piped['in_flight']}/{piped['windows']} windows ended with the save still in flight")
    print(f"{'window':56s} {'median ms':>10s} {'/ no-save run':>14s}")
    print(f"{'no-save trainer':56s} {piped['plain'] * 1e3:10.2f} {1.0:14.3f}")
    print(f"{'saving trainer: save in flight':56s} {piped['saving'] * 1e3:10.2f} "
          f"{piped['saving'] / piped['plain']:14.3f}")
    print(f"{'no-save trainer: a whole interval of ' + str(args.save_every) + ' steps':56s} "
          f"{piped['plain interval'] * 1e3:10.2f} {1.0:14.3f}")
    print(f"{'saving trainer: a whole interval, save() included':56s} {piped['saving interval'] * 1e3:10.2f} "
          f"{piped['saving interval'] / piped['plain interval']:14.3f}")

    timings = measure_save_restore(args.rounds, steps_between=10)
    step = timings["step"]
    print(f"\nsave and restore of the train state ({timings['bytes'] / 2**20:.1f} MiB: params + adam state), "
          f"medians over {args.rounds} rounds, one train step = {step * 1e3:.2f} ms")
    print(f"{'operation':56s} {'seconds':>10s} {'train steps':>12s}")
    for name, key in (("checkpointer.save(state) returns (async start)", "save"),
                      ("save on disk (save() + wait())", "on disk"),
                      ("checkpointer.restore(state)", "restore")):
        print(f"{name:56s} {timings[key]:10.4f} {timings[key] / step:12.1f}")


if __name__ == "__main__":
    main()
