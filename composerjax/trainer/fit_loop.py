"""The fit loop: the driver :func:`~composerjax.core.lifecycle.walk_fit` walks, and the buffered loss logs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from composerjax.core.callback import overridden_events
from composerjax.core.engine import Engine
from composerjax.core.event import Event
from composerjax.core.lifecycle import BATCH, BATCH_HOST_EVENTS, FETCH, STEP
from composerjax.core.logger import Logger
from composerjax.core.state import BatchRecord, State
from composerjax.core.time import TimeUnit
from composerjax.core.timestamp import UNIT_FIELDS
from composerjax.core.validation import check_run_length, loader_length
from composerjax.data.prefetch import DevicePrefetcher
from composerjax.parallel.heartbeat import heartbeat
from composerjax.step.runner import StepRunner, batch_size_of
from composerjax.trainer.auto_grouping import AutoStepsPerCall
from composerjax.trainer.interrupt import StopControl, StopDecision
from composerjax.trainer.nonfinite_loss import NonFiniteLoss
from composerjax.trainer.sections import StepSettings

__all__ = ["FitLoop", "PendingLogs", "COUNTER", "grouping_blocked_by"]

# Which Timestamp counter a max_duration unit is measured on.
COUNTER = UNIT_FIELDS

# BatchRecord's own __new__ is Python code: a record per batch is made with the tuple's directly.
_new_tuple = tuple.__new__


class PendingLogs:
    """Losses and step metrics still on the device, fetched for the loggers in one transfer per interval.

    Fetching one interval behind the newest step means the values are already computed, so the
    transfer never stalls the device queue.
    """

    def __init__(self, logger: Any, log_interval: int, on_loss: Callable[[int, float], None] | None = None) -> None:
        self.logger, self.log_interval = logger, log_interval
        #: Called with each fetched ``(batch, loss)``: the non-finite loss check reads what is fetched anyway.
        self.on_loss = on_loss
        self._pending: list[tuple[int, Any, Any, int | None]] = []

    def add(self, batch: int, loss: Any, metrics: Any, group: int | None = None) -> None:
        """Keep batch ``batch``'s loss and metrics (``group`` batches of them for a grouped call)."""
        self._pending.append((batch, loss, metrics, group))
        if len(self._pending) >= 2 * self.log_interval:
            self.flush(self.log_interval)

    def flush(self, count: int | None = None) -> None:
        """Fetch the oldest ``count`` (default: all) pending entries and log them."""
        if not self._pending:
            return
        count = len(self._pending) if count is None else count
        pending, self._pending = self._pending[:count], self._pending[count:]
        values = jax.device_get([(loss, metrics) for _, loss, metrics, _ in pending])
        on_loss = self.on_loss
        for (batch, _, _, group), (loss, metrics) in zip(pending, values):
            rows = [(batch, loss, metrics)] if group is None else [
                (batch + i, loss[i], {name: value[i] for name, value in metrics.items()}) for i in range(group)]
            for step, step_loss, step_metrics in rows:
                row = {"loss/train/total": float(step_loss)}
                if on_loss is not None:
                    on_loss(step, row["loss/train/total"])
                row.update({name if name.startswith("metrics/") else f"train/{name}": float(np.mean(value))
                            for name, value in step_metrics.items()})
                self.logger.log_metrics(row, step=step)


def grouping_blocked_by(engine: Any) -> list[str]:
    """The plugins that listen between two batches and do not accept grouped batches (so no grouping).

    Example::

        grouping_blocked_by(trainer.engine)   # ['NaNMonitor']
    """
    plugins = [*engine.state.callbacks, *getattr(engine.logger, "destinations", ())]
    return [type(plugin).__name__ for plugin in plugins
            if not getattr(plugin, "accepts_grouped_batches", False) and overridden_events(plugin) & _BATCH_EVENTS]


_BATCH_EVENTS = frozenset(BATCH_HOST_EVENTS)


def end_iteration(state: Any) -> bool:
    """Move ``state.timestamp`` to the next iteration if ``state.iteration_length`` epochs are done."""
    length = state.iteration_length
    if length is None or int(state.timestamp.epoch_in_iteration) < length.value:
        return False
    state.previous_timestamp = state.timestamp
    state.timestamp = state.timestamp.to_next_iteration()
    return True


class FitLoop:
    """The real driver of :func:`~composerjax.core.lifecycle.walk_fit`: batches, steps, time, stopping.

    Runs a per-batch host event only when something could act on it (an algorithm that may match,
    a listening plugin), groups ``steps_per_call`` batches into one compiled call when nothing
    needs to run between them, and decides, the same way on every process, when to stop.
    """

    def __init__(self, state: State, engine: Engine, logger: Logger, runner: StepRunner, step: StepSettings, *,
                 pending: PendingLogs, control: StopControl, nonfinite: NonFiniteLoss, auto: AutoStepsPerCall,
                 count_tokens: Callable[[Any], int] | None, prefetch_threaded: bool | None, report: bool) -> None:
        self.state, self.engine, self.logger, self.runner = state, engine, logger, runner
        self.pending, self.control, self.nonfinite = pending, control, nonfinite
        self.count_tokens, self.report = count_tokens, report
        self.device_prefetch = step.device_prefetch
        #: Whether the prefetch runs in a thread: decided by timing on the first pass, kept for the next fits.
        self.prefetch_threaded = prefetch_threaded
        grouping = step.steps_per_call
        # 'auto' decides once per trainer (AutoStepsPerCall); several processes always run per step.
        self.auto = auto if grouping == "auto" and not self.runner.multi_process else None
        self.grouping = grouping if isinstance(grouping, int) and grouping > 1 and not self.runner.multi_process else 0
        self.iterator: Any = None
        #: The prefetcher serving this pass (its items carry their device copies), or None: the loader's own iterator.
        self._prefetcher: DevicePrefetcher | None = None
        self._destinations = logger.destinations  # the logger's own list: destinations added later are seen
        self._clock = time.perf_counter
        self._flags: Any = None
        self._skip: frozenset[Event] = frozenset()
        self._points: tuple[Event | str, ...] = BATCH
        self._plan: Any = None
        self._plain = False  # the next train_group is a plain run (one batch per call)
        self._blocked: tuple[Any, list[str]] = ((), [])

    # -- events --------------------------------------------------------------------------------
    def event(self, event: Event) -> None:
        if event not in self._skip:
            self.engine.run_event(event)

    def _refresh_skip(self) -> None:
        flags = self.engine.active(BATCH_HOST_EVENTS)
        if flags is not self._flags:  # the engine hands back the same tuple while nothing changed
            self._flags = flags
            self._skip = frozenset(e for e, active in zip(BATCH_HOST_EVENTS, flags) if not active)
            self._points = tuple(point for point in BATCH if point not in self._skip)

    def batch_points(self) -> tuple[Event | str, ...]:
        """The batch's points that can do anything now: the events something listens to or may match."""
        return self._points

    # -- where we are ----------------------------------------------------------------------------
    def done(self) -> bool:
        state = self.state
        duration = state.max_duration
        # Once per epoch: a callback may have set state.max_duration to tokens the trainer does not count.
        check_run_length(duration, batches=None, counts_tokens=self.count_tokens is not None,
                         field="state.max_duration")
        return getattr(state.timestamp.counts, COUNTER[duration.unit]) >= duration.value

    def at_epoch_start(self) -> bool:
        return self.state.timestamp.counts.batch_in_epoch == 0

    def at_iteration_start(self) -> bool:
        counts = self.state.timestamp.counts
        return counts.epoch_in_iteration == 0 and counts.batch_in_epoch == 0

    def end_iteration(self) -> bool:
        return end_iteration(self.state)

    def epoch_complete(self) -> bool:
        return self.state.timestamp.counts.batch_in_epoch == self.state.dataloader_len

    def start_epoch(self) -> None:
        self.close()
        state = self.state
        loader = state.dataloader
        if (state.timestamp.counts.batch_in_epoch == 0 and hasattr(loader, "set_epoch")
                and state.dataloader_len != loader_length(loader)):
            # An epoch cut short (train_subset_num_batches): the next one is a new pass, as Composer's sampler epoch.
            loader.set_epoch(int(state.timestamp.epoch))
        if self.device_prefetch:
            # The decision to prefetch in a thread is timed on the first pass and kept for the next ones.
            self.iterator = self._prefetcher = DevicePrefetcher(state.dataloader, self.runner.place,
                                                                self.device_prefetch,
                                                                start_thread=self.prefetch_threaded)
            state.dataloader_position = self.iterator.position
        else:
            self.iterator = iter(state.dataloader)

    def close(self) -> None:
        """Stop prefetching: the loader goes back right after the last batch taken (a new pass, fit end, error)."""
        prefetcher = self._prefetcher
        if prefetcher is not None:
            self.prefetch_threaded = prefetcher.threaded if prefetcher.decided else None
            prefetcher.close()
            self.state.dataloader_position = None
        self.iterator = self._prefetcher = None

    def end_epoch(self) -> None:
        state = self.state
        if state.timestamp.counts.batch_in_epoch == 0:
            raise ValueError("train_dataloader yielded no batches in an epoch")
        self.pending.flush()
        state.previous_timestamp = state.timestamp
        state.timestamp = state.timestamp.to_next_epoch()

    def end_fit(self) -> None:
        self.close()
        self.pending.flush()
        self.nonfinite.end_fit(self.runner.skipped_updates)  # fetches the last loss only if unlogged
        self.stop()  # a signal that came during the last batch or the flush still counts
        state = self.state
        # The first step donated the arrays the user's module held: give it the trained ones back
        # (once per fit, not per step), so the caller's own handle on the model stays usable.
        state.sync_model()

    # -- one batch: the route from the loader to the compiled step ---------------------------------
    # Every batch, in a walk of the lifecycle, a plain run or a group, is fetched by _fetch as one
    # BatchRecord (the host batch and, when prefetched, its device copy) and reaches the step with it:
    # train_step for one batch per call, train_group for a stacked group.
    def _fetch(self) -> BatchRecord | None:
        """The loader's next batch as a record (with its device copy when prefetched); None at the end of the data."""
        try:
            taken = next(self.iterator)
        except StopIteration:
            return None
        prefetcher = self._prefetcher
        if prefetcher is None:
            return _new_tuple(BatchRecord, (taken, None))
        if prefetcher.inline:  # decided against the thread: the loader's own iterator from now on, no wrapper
            self.prefetch_threaded = False
            self.iterator, self._prefetcher, self.state.dataloader_position = prefetcher.source, None, None
        return _new_tuple(BatchRecord, (taken.host, taken.device))

    def next_batch(self) -> bool:
        """Fetch the next batch into ``state.batch_record`` (``state.batch`` is its host form); False at the end."""
        record = self._fetch()
        if record is None:
            return False
        self.state.batch_record = record
        return True

    def train_step(self, plan: Any = None) -> None:
        """Run the step on ``state.batch_record`` and move the clock; ``plan`` when it is known already (a plain run).

        The record's device copy goes with it unless a host event replaced ``state.batch`` since the
        fetch: that made a new record, without one.
        """
        state, clock, count_tokens = self.state, self._clock, self.count_tokens
        start = clock()
        batch, device = state.batch_record
        samples, state.loss, state.step_metrics = self.runner.train_batch(batch, device, plan)
        timestamp = state.timestamp
        if self._destinations:
            self.pending.add(timestamp.counts.batch + 1, state.loss, state.step_metrics)
        state.previous_timestamp = timestamp
        state.timestamp = timestamp.to_next_batch(samples, count_tokens(batch) if count_tokens is not None else 0,
                                                  clock() - start)
        auto = self.auto
        if auto is not None and auto.count is None:
            self._decide_grouping(auto)

    def _decide_grouping(self, auto: Any) -> None:
        """'auto': decide from the first compiled train step's cost analysis (no timing), and say so."""
        state = self.state
        records = [record for record in state.compiled_steps if record.kind == "train"]
        if not records:
            return
        if self.runner.builder.convolving:
            auto.decline(state, "the step convolves: on CPU a convolution in a loop is slow")
        else:
            auto.decide(state, records[0], self.runner.mesh.devices.flat[0].platform)
        if self.report:
            self.runner.report(auto.describe())

    # -- several batches per call ----------------------------------------------------------------
    def group(self) -> int:
        """How many batches the next :meth:`train_group` runs: ``steps_per_call`` in one call, or a plain run; else 0.

        A *plain run* trains one batch per call, but in one tight loop, when no plugin listens to
        a batch's host events, the batches share a plan and this is a single process: then
        nothing happens between two batches but the step, so the loop skips the per-batch walk.
        It ends where a group would (the epoch's or run's end, a plugin's ``next_due``), and
        after any batch at which a stop was requested (a signal).
        """
        self._refresh_skip()
        self._plain = False
        count = self.grouping if self.auto is None else (self.auto.count or 0)
        if count >= 2:
            if self._room() < count or self._blocking():
                return 0
            self._plan = self.runner.group_plan(count)
            return count if self._plan is not None else 0
        if (len(self._skip) < len(BATCH_HOST_EVENTS) or self.runner.multi_process
                or (self.auto is not None and self.auto.count is None)):
            return 0
        room = self._room()
        if room < 2:
            return 0
        self._plan = self.runner.group_plan(room)
        self._plain = self._plan is not None
        return room if self._plain else 0

    def _blocking(self) -> list[str]:
        callbacks, destinations = self.state.callbacks, self.logger.destinations
        key = (id(callbacks), len(callbacks), len(destinations))
        if self._blocked[0] != key:
            self._blocked = (key, grouping_blocked_by(self.engine))
        return self._blocked[1]

    def _room(self) -> int:
        """Batches before something needs the host: the epoch's end, the run's end, a plugin's next_due."""
        state = self.state
        timestamp = state.timestamp
        counts = timestamp.counts
        if state.dataloader_len is None or state.max_duration.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH):
            return 0
        total = state.batches_in_duration()
        room = min(state.dataloader_len - counts.batch_in_epoch, total - counts.batch)
        for plugin in (*state.callbacks, *self.logger.destinations):
            due = plugin.next_due(timestamp) if hasattr(plugin, "next_due") else None
            if due is not None:
                room = min(room, int(due) - counts.batch)
        return room

    def train_group(self, count: int) -> bool:
        """Run ``count`` batches in one call, then their host events batch by batch; False if data ran out."""
        if self._plain:
            return self._train_plain(count)
        state = self.state
        count_tokens = self.count_tokens
        # One gather for the whole group (ArrayLoader), unless a prefetch thread reads the loader ahead.
        threaded = self._prefetcher is not None and self._prefetcher.threaded
        take = None if threaded else getattr(state.dataloader, "next_stacked", None)
        stacked = take(count) if take is not None else None
        if stacked is not None:  # one gather for the whole group (ArrayLoader)
            size = jax.tree.leaves(stacked)[0].shape[1]
            batches = None
        else:
            records = []
            while len(records) < count:
                record = self._fetch()
                if record is None:
                    break
                records.append(record)
            batches = [record.host for record in records]
            sizes = {batch_size_of(b) for b in batches}
            if len(records) < count or len(sizes) > 1:  # a short or ragged group: one step each, device copies kept
                for record in records:
                    state.batch_record = record
                    self._walk_batch(self.train_step)
                return len(records) == count
            size = sizes.pop()
            stacked = jax.tree.map(lambda *leaves: np.stack(leaves), *batches)
        start = time.perf_counter()
        losses, metrics = self.runner.train_group(stacked, count, self._plan)
        if self._destinations:
            self.pending.add(state.timestamp.counts.batch + 1, losses, metrics, count)
        seconds = time.perf_counter() - start
        if batches is None:
            batches = [jax.tree.map(lambda leaf, i=i: leaf[i], stacked) for i in range(count)] if (
                count_tokens is not None) else [None] * count
        state.batch = jax.tree.map(lambda leaf: leaf[-1], stacked)
        tokens = [count_tokens(batch) if count_tokens is not None else 0 for batch in batches]
        if len(self._skip) == len(BATCH_HOST_EVENTS):  # nobody listens: one clock update for the group
            state.previous_timestamp = state.timestamp
            state.timestamp = state.timestamp.to_next_batches(count, size * count, sum(tokens), seconds)
            return True
        # The group's host events after its call, batch by batch, each with that batch's timestamp.
        for batch_tokens in tokens:
            self._walk_batch(lambda t=batch_tokens: self._advance(size, t, seconds / count))
        return True

    def _train_plain(self, count: int) -> bool:
        """``count`` batches one call each, with nothing between them (see :meth:`group`); False if data ran out."""
        state, control, plan = self.state, self.control, self._plan
        fetch, train_step = self._fetch, self.train_step
        request = control.request
        for _ in range(count):
            record = fetch()
            if record is None:
                return False
            state.batch_record = record
            train_step(plan)
            heartbeat()
            if control.request is not request:  # a signal: stop() decides after this batch
                break
        return True

    def _advance(self, samples: int, tokens: int, seconds: float) -> None:
        state = self.state
        state.previous_timestamp = state.timestamp
        state.timestamp = state.timestamp.to_next_batch(samples, tokens, seconds)

    def _walk_batch(self, step: Any) -> None:
        """One batch's host events in lifecycle order, with ``step`` where the compiled step goes."""
        for point in self._points:
            if point is STEP:
                step()
            elif point is not FETCH:  # the batch was fetched with its group
                self.event(point)  # type: ignore[arg-type]

    # -- stopping --------------------------------------------------------------------------------
    def stop(self) -> bool:
        """After a batch or group: whether training stops here. The same answer on every process.

        It stops when ``max_duration`` is reached or a plugin asked to stop (a signal, the time
        limit). With several processes each one's view is combined (any process's signal, time
        limit or stop stops them all, at the same batch) through the coordination service, so no
        process waits in a collective or a save barrier that another has left.
        """
        heartbeat()  # progress, for `composerjax launch --heartbeat-timeout`
        control = self.control
        if control.decision is not None:
            return True
        state = self.state
        duration = state.max_duration
        reached = getattr(state.timestamp.counts, COUNTER[duration.unit]) >= duration.value
        request = control.request
        signum, time_up = request.signum, request.time_limit
        if self.runner.multi_process:
            from composerjax.parallel import dist

            signum, time_up, any_reached = dist.agree_max("composerjax-stop", (signum, int(time_up), int(reached)))
            if any_reached and not reached:  # another process's callback stopped the run
                state.stop_training()
                reached = True
        if signum or time_up:
            control.decision = StopDecision(signum=signum, time_limit=bool(time_up))
            return True
        return bool(reached)
