"""The Engine: runs algorithms, then callbacks, at each event, and records what ran."""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

from composerjax.core.algorithm import Algorithm
from composerjax.core.callback import Callback, overridden_events
from composerjax.core.event import Event
from composerjax.core.passes import DEFAULT_PASSES, AlgorithmPass
from composerjax.core.state import State
from composerjax.core.trace import Trace

__all__ = ["Engine", "Plan", "UndeclaredEventWarning", "events_check_mode"]

log = logging.getLogger(__name__)

#: The algorithms that will run at each traced event, in order: the compiled step's cache key.
Plan = tuple[tuple[Event, tuple[Algorithm, ...]], ...]


class UndeclaredEventWarning(UserWarning):
    """An algorithm's ``match`` accepts an event its ``events`` leave out: it never runs there."""


def events_check_mode() -> str:
    """How the engine checks algorithms' ``events`` declarations, from ``COMPOSERJAX_CHECK_EVENTS``.

    ``'warn'`` (unset, empty or ``warn``): at INIT, each algorithm that declares ``events`` is asked
    about every other event, once, against the INIT state; an event its ``match`` accepts there is
    an :class:`UndeclaredEventWarning`. ``'off'`` (``0``): no check. ``'error'`` (``1`` or anything
    else): that INIT check raises instead, and every algorithm is also asked at every event of the
    run, which raises as soon as one matches outside its ``events``.

    Example:
        >>> events_check_mode() in ("warn", "off", "error")
        True
    """
    value = os.environ.get("COMPOSERJAX_CHECK_EVENTS", "").strip().lower()
    if value in ("", "warn"):
        return "warn"
    return "off" if value == "0" else "error"


class Engine:
    """Run the algorithms that match an event, ordered by the passes, then the callbacks.

    At ``INIT`` callbacks run before algorithms; at every other event algorithms run first, then
    callbacks, then logger destinations. Traced events are planned on the host (``plan``) and
    applied while the step is traced (``apply_planned``); their traces are recorded once per
    executed step (``record_plan``).

    Args:
        state: the run's state.
        logger: the logger passed to ``apply`` and to callbacks.
        algorithm_passes: extra passes, appended after the defaults; a ``(pass, index)`` pair is
            inserted at ``index``.
        trace_log_size: how many traces ``trace_log`` keeps.

    Example:
        >>> from composerjax.loggers import Logger
        >>> state = State(model=None)
        >>> engine = Engine(state, Logger(state))
        >>> engine.run_event('batch_start')
        OrderedDict()
    """

    def __init__(
        self,
        state: State,
        logger: Any,
        algorithm_passes: Sequence[AlgorithmPass | tuple[AlgorithmPass, int]] | None = None,
        trace_log_size: int = 10_000,
    ) -> None:
        self.state = state
        self.logger = logger
        self.algorithm_passes: list[AlgorithmPass] = list(DEFAULT_PASSES)
        self._pass_memo: dict[tuple[Event, tuple[Algorithm, ...]], tuple[Algorithm, ...]] = {}
        for algorithm_pass in algorithm_passes or ():
            if isinstance(algorithm_pass, tuple):
                self.register_pass(*algorithm_pass)
            else:
                self.register_pass(algorithm_pass)
        self.trace_log: deque[Trace] = deque(maxlen=trace_log_size)
        self._closed = False
        self._listeners: dict[Event, tuple[Callable[[State, Any], None], ...]] = {}
        self._rebuild_listeners()
        self._plan_records: dict[Plan, tuple[tuple[str, Event, int], ...]] = {}
        self._candidate_key: tuple[Algorithm, ...] | None = None
        self._candidate_table: dict[Event, tuple[Algorithm, ...]] = {}
        #: How INIT checks the algorithms' ``events`` (:func:`events_check_mode`: 'warn', 'off', 'error').
        self.events_check = events_check_mode()
        #: Ask every algorithm at every event and fail if one matches outside its ``events``.
        self.check_events = self.events_check == "error"

    # -- passes ----------------------------------------------------------------------------------
    def register_pass(self, algorithm_pass: AlgorithmPass, index: int = -1) -> None:
        """Add a pass; ``index=-1`` appends, any other index inserts before that position."""
        if index == -1:
            self.algorithm_passes.append(algorithm_pass)
        else:
            self.algorithm_passes.insert(index, algorithm_pass)
        self._pass_memo.clear()

    def order(self, event: Event, matched: tuple[Algorithm, ...]) -> tuple[Algorithm, ...]:
        """``matched`` (the algorithms that matched ``event``) in the order the passes give, memoised.

        Example: ``engine.order(Event.AFTER_LOSS, (ema, smoothing))``.
        """
        key = (event, matched)
        ordered = self._pass_memo.get(key)
        if ordered is None:
            algorithms: list[Algorithm] = list(matched)
            for algorithm_pass in self.algorithm_passes:
                algorithms = list(algorithm_pass(algorithms, event))
            ordered = self._pass_memo[key] = tuple(algorithms)
        return ordered

    # -- events ----------------------------------------------------------------------------------
    def run_event(self, event: Event | str) -> OrderedDict[str, Trace]:
        """Run ``event``: matching algorithms in pass order, then callbacks; return the traces.

        Raises:
            RuntimeError: after ``close()``.
            ValueError: for an unknown event name.
        """
        if self._closed:
            raise RuntimeError(f"Engine.run_event({event!r}) after close(): the engine is closed")
        if type(event) is not Event:
            event = Event(event)
        state = self.state
        if event is Event.INIT:
            self._run_callbacks(event, state)
            if self.events_check != "off":
                self._check_declared_events(state)
            return self._run_algorithms(event, state)
        traces = self._run_algorithms(event, state) if state.algorithms else OrderedDict()
        # _refresh_listeners inlined: this runs for every host event of every batch.
        callbacks, destinations = state.callbacks, self._destinations
        if (
            callbacks is not self._callbacks_seen
            or len(callbacks) != self._callbacks_len
            or len(destinations) != self._destinations_len
        ):
            self._rebuild_listeners()
        listeners = self._listeners.get(event)
        if listeners:
            logger = self.logger
            for listener in listeners:
                listener(state, logger)
        return traces

    def _run_algorithms(self, event: Event, state: State) -> OrderedDict[str, Trace]:
        traces: OrderedDict[str, Trace] = OrderedDict()
        if not state.algorithms:
            return traces
        candidates = self._candidates()[event]
        if not candidates and not self.check_events:
            return traces
        matched = self._match(event, state, candidates)
        if not matched:
            return traces
        traced = event.is_traced
        batch = state.timestamp.counts.batch
        for order, (key, algorithm) in enumerate(_keyed(self.order(event, matched), event)):
            start = time.perf_counter()
            exit_code = self._apply(algorithm, event, state)
            duration = None if traced else time.perf_counter() - start
            trace = Trace(key.split("/")[0], event, exit_code, order, True, traced, batch, duration)
            traces[key] = trace
            self.trace_log.append(trace)
        log_traces = getattr(self.logger, "log_traces", None)
        if log_traces is not None:
            log_traces(traces)
        return traces

    def candidates(self, event: Event) -> tuple[Algorithm, ...]:
        """The algorithms whose ``events`` include ``event`` (or that declare none), in list order."""
        return self._candidates()[event]

    def _candidates(self) -> dict[Event, tuple[Algorithm, ...]]:
        algorithms, key = self.state.algorithms, self._candidate_key
        if key is None or len(algorithms) != len(key) or tuple(algorithms) != key:
            self._candidate_key = key = tuple(algorithms)
            self._active = {}
            self._candidate_table = {
                event: tuple(a for a in key if a.events is None or event in a.events) for event in Event
            }
        return self._candidate_table

    def _match(self, event: Event, state: State, candidates: tuple[Algorithm, ...]) -> tuple[Algorithm, ...]:
        matched = tuple(a for a in candidates if a.match(event, state)) if candidates else ()
        if self.check_events:
            for algorithm in state.algorithms:
                if algorithm not in matched and algorithm.match(event, state):
                    raise RuntimeError(
                        f"{type(algorithm).__name__}.match returned True at {event.name}, which its "
                        f"events={sorted(e.name for e in algorithm.events or ())} leave out: add the event"
                    )
        return matched

    def undeclared_events(self, state: State | None = None) -> dict[Algorithm, list[Event]]:
        """The events each algorithm's ``match`` accepts against ``state`` though its ``events`` leave them out.

        Each algorithm that declares ``events`` is asked once about every other event. A ``match``
        that raises there (it reads what ``state`` does not hold yet) tells nothing and is skipped.

        Example:
            >>> class Forgetful(Algorithm):
            ...     events = frozenset({Event.AFTER_LOSS})
            ...     def match(self, event, state):
            ...         return event in (Event.AFTER_LOSS, Event.BATCH_END)
            >>> from composerjax.loggers import Logger
            >>> state = State(model=None, algorithms=[Forgetful()])
            >>> [(type(a).__name__, [e.name for e in events])
            ...  for a, events in Engine(state, Logger(state)).undeclared_events().items()]
            [('Forgetful', ['BATCH_END'])]
        """
        state = state or self.state
        found: dict[Algorithm, list[Event]] = {}
        for algorithm in state.algorithms:
            declared = algorithm.events
            if declared is None:
                continue
            for event in Event:
                if event in declared:
                    continue
                try:
                    accepted = bool(algorithm.match(event, state))
                except Exception:  # noqa: BLE001, S112 - it needs a state INIT does not have: nothing to learn
                    continue
                if accepted:
                    found.setdefault(algorithm, []).append(event)
        return found

    def _check_declared_events(self, state: State) -> None:
        """At INIT: warn (raise with ``COMPOSERJAX_CHECK_EVENTS=1``) of events ``match`` accepts, ``events`` omit."""
        for algorithm, events in self.undeclared_events(state).items():
            name = type(algorithm).__name__
            missed = ", ".join(event.name for event in events)
            message = (f"{name}.match accepts {missed} (asked at INIT), which its "
                       f"events={sorted(event.name for event in algorithm.events or ())} leave out, so it never runs "
                       f"there: add {', '.join('Event.' + event.name for event in events)} to {name}.events "
                       "(COMPOSERJAX_CHECK_EVENTS=0 turns this check off, =1 makes it an error)")
            if self.events_check == "error":
                raise RuntimeError(message)
            warnings.warn(message, UndeclaredEventWarning, stacklevel=2)

    def _apply(self, algorithm: Algorithm, event: Event, state: State) -> int | None:
        try:
            return algorithm.apply(event, state, self.logger)
        except Exception as error:
            raise _with_context(error, f"{type(algorithm).__name__} failed at {event.name}") from error

    def _run_callbacks(self, event: Event, state: State) -> None:
        for listener in self._listeners_for(event):
            listener(state, self.logger)

    def _listeners_for(self, event: Event) -> tuple[Callable[[State, Any], None], ...]:
        self._refresh_listeners()
        return self._listeners.get(event, ())

    def _refresh_listeners(self) -> None:
        """Rebuild the listener table when a callback list was replaced or changed length."""
        callbacks, destinations = self.state.callbacks, self._destinations
        if (
            callbacks is not self._callbacks_seen
            or len(callbacks) != self._callbacks_len
            or len(destinations) != self._destinations_len
        ):
            self._rebuild_listeners()

    def is_quiet(self, events: tuple[Event, ...]) -> bool:
        """Whether running ``events`` now would do nothing: no algorithm declares them, no callback listens."""
        return not any(self.active(events))

    def active(self, events: tuple[Event, ...]) -> tuple[bool, ...]:
        """For each of ``events``: whether running it now could do anything (an algorithm or a listener).

        The trainer asks once per batch and runs only the batch's host events that are active, so an
        engine with nothing registered for them costs almost nothing per batch.
        """
        if self._closed:
            return (True,) * len(events)
        table = self._candidates()
        self._refresh_listeners()
        flags = self._active.get(events)
        if flags is None:
            check = self.check_events and bool(self.state.algorithms)
            flags = self._active[events] = tuple(
                check or bool(table[event]) or event in self._listeners for event in events)
        return flags

    def _rebuild_listeners(self) -> None:
        self._callbacks_seen = self.state.callbacks
        self._callbacks_len = len(self._callbacks_seen)
        self._destinations = getattr(self.logger, "destinations", ())
        self._destinations_len = len(self._destinations)
        self._listeners = _listener_table(self._all_callbacks(), self.trace_log, self.logger)
        self._active: dict[Any, tuple[bool, ...]] = {}

    def _all_callbacks(self) -> list[Callback]:
        destinations = getattr(self.logger, "destinations", ())
        return [*self.state.callbacks, *destinations]

    # -- traced events ---------------------------------------------------------------------------
    def plan(self, events: Sequence[Event], state: State | None = None) -> Plan:
        """Match algorithms on the host for each traced event and order them: the step's cache key."""
        state = state or self.state
        if not state.algorithms:
            return ()
        plan = []
        table, check = self._candidates(), self.check_events
        for event in events:
            candidates = table[event]
            if not candidates and not check:
                continue
            matched = self._match(event, state, candidates)
            if matched:
                plan.append((event, self.order(event, matched)))
        return tuple(plan)

    def apply_planned(self, plan: Plan, event: Event, view: State) -> None:
        """Apply the planned algorithms of ``event`` to the traced ``view``, then its callbacks."""
        for planned_event, algorithms in plan:
            if planned_event is event:
                for algorithm in algorithms:
                    self._apply(algorithm, event, view)
        for listener in self._listeners_for(event):
            listener(view, self.logger)

    def record_plan(self, plan: Plan, batch: int) -> None:
        """Append one trace per planned algorithm to ``trace_log`` for an executed step."""
        records = self._plan_records.get(plan)
        if records is None:
            records = self._plan_records[plan] = tuple(
                (key.split("/")[0], event, order)
                for event, algorithms in plan
                for order, (key, _) in enumerate(_keyed(algorithms, event))
            )
        append = self.trace_log.append
        for name, event, order in records:
            append(Trace(name, event, None, order, True, True, batch, None))

    # -- shutdown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Call ``close`` on every callback, then ``post_close`` on those whose close did not raise.

        Exceptions from ``close`` are logged, not raised. Later ``run_event`` calls raise.
        """
        if self._closed:
            return
        self._closed = True
        closed_ok = []
        for callback in self._all_callbacks():
            try:
                callback.close(self.state, self.logger)
            except Exception:
                log.exception("Error while closing callback %s", type(callback).__name__)
            else:
                closed_ok.append(callback)
        for callback in closed_ok:
            try:
                callback.post_close()
            except Exception:
                log.exception("Error in post_close of callback %s", type(callback).__name__)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has run."""
        return self._closed


def _keyed(algorithms: Sequence[Algorithm], event: Event) -> list[tuple[str, Algorithm]]:
    """Trace keys ``Name/EVENT``, with ``Name#k`` for the k-th repeat of a class in one event."""
    seen: dict[str, int] = {}
    keyed = []
    for algorithm in algorithms:
        name = type(algorithm).__name__
        count = seen.get(name, 0)
        seen[name] = count + 1
        keyed.append((f"{name}#{count}/{event.name}" if count else f"{name}/{event.name}", algorithm))
    return keyed


def _listener_table(callbacks: Sequence[Callback], trace_log: Any = None,
                    logger: Any = None) -> dict[Event, tuple[Callable[[State, Any], None], ...]]:
    table: dict[Event, list[Callable[[State, Any], None]]] = {}
    for callback in callbacks:
        overrides_run_event = type(callback).run_event is not Callback.run_event
        for event in overridden_events(callback):
            if overrides_run_event:
                listener = _bind_run_event(callback, event)
            else:
                listener = getattr(callback, event.value)
            if getattr(callback, "trace_actions", False) and trace_log is not None:
                listener = _traced_listener(callback, event, listener, trace_log, logger)
            table.setdefault(event, []).append(listener)
    return {event: tuple(listeners) for event, listeners in table.items()}


def _traced_listener(callback: Callback, event: Event, listener: Callable[[State, Any], Any], trace_log: Any,
                     logger: Any) -> Callable[[State, Any], None]:
    """Record a Trace, with its duration, each time ``listener`` returns True (the callback acted)."""
    name = type(callback).__name__
    key = f"{name}/{event.name}"

    def traced(state: State, logger_: Any) -> None:
        start = time.perf_counter()
        if listener(state, logger_):
            trace = Trace(name, event, None, 0, True, False, state.timestamp.counts.batch, time.perf_counter() - start,
                          "callback")
            trace_log.append(trace)
            log_traces = getattr(logger, "log_traces", None)
            if log_traces is not None:
                log_traces(OrderedDict([(key, trace)]))

    return traced


def _bind_run_event(callback: Callback, event: Event) -> Callable[[State, Any], None]:
    def listener(state: State, logger: Any) -> None:
        callback.run_event(event, state, logger)

    return listener


def _with_context(error: Exception, context: str) -> Exception:
    """The same kind of exception with ``context`` in front of its message, where it can be built."""
    message = f"{context}: {error}"
    try:
        wrapped = type(error)(message)
    except Exception:
        return RuntimeError(message)
    if str(wrapped) != message:
        return RuntimeError(message)
    return wrapped
