"""Per-batch cost of the trainer's clock: this tree's ``Timestamp`` against a previous one, side by side.

The previous ``composerjax/core/time.py`` is read from git (``git show <ref>:composerjax/core/time.py``;
by default the newest revision in which it still defined the dataclass ``Timestamp`` of ints) into a
temporary module, so one run times both on the same machine. Each
simulated batch does what the fit loop does with the clock: read the batch count for the pending
loss log, ``to_next_batch(samples, tokens, seconds)``, the epoch-complete and max-duration checks,
and ``to_next_epoch`` every ``--per-epoch`` batches. The "with callbacks" rows add what the built-in
evaluation and checkpoint callbacks read every batch (is a '50ba' / '100ba' interval due?), written
against each version's public fields: ints before, ``Time`` objects (``int(timestamp.batch)``) now.
Each figure is the best of ``--repeats`` runs over ``--batches`` batches, in CPU time of this
process (other processes on a busy machine do not count), the two versions taking turns so what
load remains hits both alike; the ratio is new / previous.

Run: ``.venv/bin/python benchmarks/timestamp_ops.py [--batches 200000] [--repeats 5] [--ref REVISION]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import types
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from composerjax.core.time import Time, Timestamp  # noqa: E402

SAMPLES, TOKENS, SECONDS = 32, 4096, 0.001
MAX_BATCHES = 10**9  # a 'ba' max_duration that is never reached
COUNTER = "batch"  # the fit loop reads the max_duration's counter by name (fit_loop.COUNTER[unit])


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout


def last_dataclass_revision() -> str:
    """The newest commit whose ``time.py`` defined ``Timestamp`` as a frozen dataclass of ints."""
    for commit in git("log", "--format=%h", "--", "composerjax/core/time.py").split():
        if "@dataclasses.dataclass(frozen=True)\nclass Timestamp" in git("show", f"{commit}:composerjax/core/time.py"):
            return commit
    raise SystemExit("no revision of composerjax/core/time.py with the dataclass Timestamp; pass --ref")


def load_previous_module(ref: str) -> types.ModuleType:
    """``composerjax/core/time.py`` at git ``ref``, as a module of its own (not the one imported above)."""
    source = git("show", f"{ref}:composerjax/core/time.py")
    module = types.ModuleType("previous_composerjax_time")
    module.__file__ = f"{ref}:composerjax/core/time.py"
    sys.modules[module.__name__] = module  # dataclasses look their module up while building the class
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def previous_loop(timestamp_class: type, batches: int, per_epoch: int, callbacks: bool) -> Any:
    """The fit loop's clock work on the previous Timestamp, whose fields were plain numbers."""
    timestamp = timestamp_class()
    for _ in range(batches):
        logged_step = timestamp.batch + 1  # PendingLogs.add
        timestamp = timestamp.to_next_batch(SAMPLES, TOKENS, SECONDS)
        if callbacks:  # EvalRunner / CheckpointSaver: is the interval due?
            batch = timestamp.batch
            _ = batch > 0 and batch % 50 == 0
            _ = batch > 0 and batch % 100 == 0
        if timestamp.batch_in_epoch == per_epoch:  # epoch_complete
            timestamp = timestamp.to_next_epoch()
        elif getattr(timestamp, COUNTER) >= MAX_BATCHES:  # stop: max_duration reached?
            break
    return timestamp, logged_step


def new_loop(timestamp_class: type, batches: int, per_epoch: int, callbacks: bool) -> Any:
    """The same work on this tree's Timestamp: the loop reads ``counts``, callbacks the public Time fields."""
    timestamp = timestamp_class()
    for _ in range(batches):
        logged_step = timestamp.counts.batch + 1
        timestamp = timestamp.to_next_batch(SAMPLES, TOKENS, SECONDS)
        if callbacks:
            batch = int(timestamp.batch)
            _ = batch > 0 and batch % 50 == 0
            _ = batch > 0 and batch % 100 == 0
        if timestamp.counts.batch_in_epoch == per_epoch:
            timestamp = timestamp.to_next_epoch()
        elif getattr(timestamp.counts, COUNTER) >= MAX_BATCHES:
            break
    return timestamp, logged_step


def best_seconds(loops: list[tuple[Callable[..., Any], type]], batches: int, per_epoch: int, callbacks: bool,
                 repeats: int) -> list[float]:
    """The best time of each ``(loop, Timestamp class)``, run in turn each repeat so load hits them alike."""
    best = [float("inf")] * len(loops)
    for _ in range(repeats):
        for index, (loop, timestamp_class) in enumerate(loops):
            start = time.process_time()
            loop(timestamp_class, batches, per_epoch, callbacks)
            best[index] = min(best[index], time.process_time() - start)
    return best


def check_same_counts(previous: types.ModuleType, batches: int, per_epoch: int) -> None:
    """Both loops must end on the same clock, or the timings compare different work."""
    old, _ = previous_loop(previous.Timestamp, batches, per_epoch, True)
    new, _ = new_loop(Timestamp, batches, per_epoch, True)
    shared = {name: value for name, value in new.state_dict().items() if name in old.state_dict()}
    if shared != {name: value for name, value in old.state_dict().items() if name in shared}:
        raise AssertionError(f"the loops disagree: previous {old.state_dict()}, new {new.state_dict()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--per-epoch", type=int, default=100)
    parser.add_argument("--ref", default=None, help="the git revision whose Timestamp is 'previous' (default: the "
                        "newest one with the dataclass Timestamp)")
    args = parser.parse_args()
    args.ref = args.ref or last_dataclass_revision()
    previous = load_previous_module(args.ref)
    check_same_counts(previous, 1000, args.per_epoch)

    print(f"{args.batches} simulated batches ({args.per_epoch} per epoch), best of {args.repeats}; "
          f"Python {sys.version.split()[0]}\n")
    print(f"| {'per batch':<36} | {'previous (' + args.ref + ')':>20} | {'new':>10} | {'new / previous':>14} |")
    print(f"| {'-' * 36} | {'-' * 20}:| {'-' * 10}:| {'-' * 14}:|")
    for label, callbacks in (("fit loop", False), ("fit loop + eval/checkpoint callbacks", True)):
        old, new = best_seconds([(previous_loop, previous.Timestamp), (new_loop, Timestamp)], args.batches,
                                args.per_epoch, callbacks, args.repeats)
        old_ns, new_ns = old / args.batches * 1e9, new / args.batches * 1e9
        print(f"| {label:<36} | {old_ns:>17.0f} ns | {new_ns:>7.0f} ns | {new_ns / old_ns:>14.2f} |")

    # What one read costs now that a field builds a Time (or a timedelta), for callbacks that read many.
    clock = Timestamp().to_next_batch(SAMPLES, TOKENS, SECONDS)
    old_clock = previous.Timestamp().to_next_batch(SAMPLES, TOKENS, SECONDS)
    reads = [("timestamp.batch (previous: int)", lambda: old_clock.batch),
             ("timestamp.batch (new: Time)", lambda: clock.batch),
             ("timestamp.batch.value (new)", lambda: clock.batch.value),
             ("timestamp.counts.batch (new: int)", lambda: clock.counts.batch),
             ("timestamp.total_wct (new: timedelta)", lambda: clock.total_wct),
             ("Time(5, 'ba') (checked constructor)", lambda: Time(5, "ba"))]
    best = [float("inf")] * len(reads)
    for _ in range(args.repeats):
        for index, (_, read) in enumerate(reads):
            start = time.process_time()
            for _ in range(args.batches):
                read()
            best[index] = min(best[index], time.process_time() - start)
    print()
    for (label, _), seconds in zip(reads, best):
        print(f"{label:<40} {seconds / args.batches * 1e9:5.0f} ns per read (a lambda call included)")

if __name__ == "__main__":
    main()
