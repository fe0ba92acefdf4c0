"""``composerjax explain``: what a recipe will run where, without training.

The recipe's Trainer is built (INIT runs, so surgery happens and its traces are real; no loggers,
callbacks or checkpoints, so no file is written), or a constructed Trainer is taken as it is.
Then the schedule is walked with the same lifecycle walker ``fit`` uses
(:func:`~composerjax.core.lifecycle.walk_fit`), with a driver that only asks: at every event of
every batch of ``max_duration`` (and of every evaluation the Trainer's ``EvalRunner`` would run)
each algorithm's ``match`` is asked, exactly as the trainer asks it, and the engine's passes order
the matches. Nothing is applied: ``match`` is a function of the state and clock, so the walk
predicts what a real run of the same recipe records in ``engine.trace_log``. The result names,
per event, the algorithms in the order they will run, whether the event is traced (inside the
compiled step) or a host event, which passes moved them, the conflicts (more than one loss
interpolation at one event; an algorithm whose module types the model lacks), and how many
distinct train-step plans the schedule compiles.

Example::

    from composerjax.explain import explain
    print(explain("examples/digits_speedup.yaml").render())   # a recipe, or a constructed Trainer
"""

from __future__ import annotations

import dataclasses
from typing import Any

from composerjax.core.event import EVAL_STEP_EVENTS, TRACED_EVENTS, TRAIN_STEP_EVENTS, Event
from composerjax.core.lifecycle import BATCH, EVAL_BATCH, EVAL_CLOSE, EVAL_DURING_FIT, EVAL_OPEN, STEP, walk_fit
from composerjax.core.state import instance_names
from composerjax.trainer.trainer import Trainer

__all__ = ["EventPlan", "Explanation", "explain"]

# The most batches walked; longer schedules are sampled evenly (epoch boundaries always included).
_MAX_WALKED_BATCHES = 20_000


@dataclasses.dataclass
class EventPlan:
    """The algorithms that run at one event, in order, and how the passes got there."""

    event: str
    traced: bool
    algorithms: list[str]
    moved_by: list[dict[str, Any]]
    batches: int | None = None  # traced events: at how many walked batches something matched
    notes: list[str] = dataclasses.field(default_factory=list)  # what INIT surgery did (``explain_notes()``)


@dataclasses.dataclass
class Explanation:
    """What ``explain`` found; ``render()`` for people, ``to_dict()`` for tools."""

    events: list[EventPlan]
    conflicts: list[str]
    train_plans: int
    plan_changes: list[dict[str, Any]]
    walked_batches: int
    total_batches: int | None
    passes: list[str]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return dataclasses.asdict(self)

    def render(self) -> str:
        """Readable text: one block per event with algorithms, then conflicts and compile count."""
        lines = [f"passes, in order: {', '.join(self.passes)}", ""]
        for plan in self.events:
            where = "traced" if plan.traced else "host"
            extra = f", matched at {plan.batches} of {self.walked_batches} batches" if plan.batches is not None else ""
            lines.append(f"{plan.event} ({where}{extra})")
            for index, name in enumerate(plan.algorithms, 1):
                lines.append(f"  {index}. {name}")
            lines += [f"     {note}" for note in plan.notes]
            for move in plan.moved_by:
                lines.append(f"  moved by {move['pass']}: {' -> '.join(move['before'])}  =>  "
                             f"{' -> '.join(move['after'])}")
        lines.append("")
        lines.append("conflicts:" if self.conflicts else "conflicts: none")
        lines += [f"  - {conflict}" for conflict in self.conflicts]
        total = "unknown" if self.total_batches is None else str(self.total_batches)
        lines.append(f"train step plans to compile: {self.train_plans} (over {self.walked_batches} walked of {total} "
                     "batches)")
        for change in self.plan_changes:
            lines.append(f"  from batch {change['batch']}: {', '.join(change['algorithms']) or 'no algorithms'}")
        return "\n".join(lines)


def explain(target: Any) -> Explanation:
    """Explain a recipe (``TrainerConfig``, dict or path) or a constructed ``Trainer``, without training.

    Side-effect free: no host ``apply`` beyond INIT's surgery (a recipe's Trainer is built for the
    walk, without loggers, callbacks or checkpoint settings), no run folder, no logger output; a
    given Trainer's state and clock are as they were afterwards.

    Example::

        print(explain(trainer).render())
    """

    if isinstance(target, Trainer):
        # Surgery at INIT has already changed the model: check only the algorithms that did not run there.
        surgeons = {t.name for t in target.engine.trace_log if t.event is Event.INIT}
        others = [a for a in target.state.algorithms if type(a).__name__ not in surgeons]
        return _walk(target, _missing_modules(others, target.state.host_model))
    from composerjax.trainer import build_trainer
    from composerjax.trainer.config import TrainerConfig, instantiate, load_config

    config = target if isinstance(target, TrainerConfig) else load_config(target)
    conflicts = _missing_modules(_algorithm_classes(config), instantiate("models", config.model))
    trainer = build_trainer(config, keep_files=False, progress_bar=False, run_summary=False, save_folder=None,
                            load_path=None, autoresume=False, time_limit=None, loggers=[], callbacks=[],
                            handle_signals=False)
    try:
        return _walk(trainer, conflicts)
    finally:
        trainer.close()


def _algorithm_classes(config: Any) -> list[Any]:
    from composerjax import registry

    return [registry.resolve("algorithms", spec.name) for spec in config.algorithms]


def _missing_modules(algorithms: list[Any], model: Any) -> list[str]:
    from composerjax.models.surgery import count_modules

    found = []
    for algorithm in algorithms:
        required = getattr(algorithm, "required_modules", ())
        if required and count_modules(model, *required) == 0:
            kinds = " or ".join(("nnx." if cls.__module__.startswith("flax.nnx") else "") + cls.__qualname__
                                for cls in required)
            name = algorithm.__name__ if isinstance(algorithm, type) else type(algorithm).__name__
            found.append(f"{name} acts on {kinds} modules, and the model ({type(model).__name__}) has none: it will "
                         "change nothing")
    return found


def _order_with_moves(engine: Any, event: Event, matched: list[Any]) -> tuple[list[Any], list[dict[str, Any]]]:
    names = _names(matched)
    moves = []
    algorithms = list(matched)
    for algorithm_pass in engine.algorithm_passes:
        before = list(algorithms)
        algorithms = list(algorithm_pass(algorithms, event))
        if [id(a) for a in before] != [id(a) for a in algorithms]:
            moves.append({"pass": getattr(algorithm_pass, "__name__", repr(algorithm_pass)),
                          "before": [names[id(a)] for a in before if id(a) in names],
                          "after": [names.get(id(a), type(a).__name__) for a in algorithms]})
    return algorithms, moves


def _names(algorithms: list[Any]) -> dict[int, str]:
    """Trace-style names by identity: ``MixUp``, a second instance ``MixUp#1``."""
    return {id(a): name for a, name in zip(algorithms, instance_names(algorithms))}


_EVAL_AFTER = frozenset({Event.BATCH_END, Event.EPOCH_END, Event.ITERATION_END, Event.FIT_END})


class _Prediction:
    """A :class:`~composerjax.core.lifecycle.FitDriver` that asks ``match`` and records, running nothing.

    It moves the clock as ``fit`` would (a batch at the step, an epoch at its close) and, where
    the Trainer's ``EvalRunner`` would evaluate, walks the evaluation's events too. Schedules
    longer than ``_MAX_WALKED_BATCHES`` are walked with a stride (every epoch start included).
    """

    def __init__(self, trainer: Trainer) -> None:
        from composerjax.core.evaluator import evaluate_periodically
        from composerjax.trainer.eval_runner import EvalRunner

        self.state, self.engine = trainer.state, trainer.engine
        state = self.state
        self.per_epoch = state.dataloader_len
        self.total = state.batches_in_duration()
        self.walk_total = self.total if self.total is not None else min(self.per_epoch or 100, _MAX_WALKED_BATCHES)
        self.stride = max(1, -(-self.walk_total // _MAX_WALKED_BATCHES))
        loader = state.dataloader
        self.batch_size = getattr(loader, "global_batch_size", None) or getattr(loader, "batch_size", 0) or 0
        # Fresh interval rules (they remember their last evaluation): a prediction must not move the real ones.
        # A callable interval cannot be predicted without calling user code: it is left out.
        self.rules = [evaluate_periodically(rule.interval) for runner in state.callbacks
                      if isinstance(runner, EvalRunner) for rule in map(runner.rule, runner.evaluators)
                      if hasattr(rule, "interval")]
        self.matched_at: dict[Event, dict[int, Any]] = {event: {} for event in Event}
        self.batches_matched: dict[Event, int] = {event: 0 for event in Event}
        self.plans: list[tuple[int, tuple[str, ...]]] = []
        self.walked = 0
        self.names = _names(list(state.algorithms))

    def _ask(self, event: Event) -> list[Any]:
        hits = [a for a in self.engine.candidates(event) if a.match(event, self.state)]
        for algorithm in hits:
            self.matched_at[event].setdefault(id(algorithm), algorithm)
        return hits

    def event(self, event: Event) -> None:
        self._ask(event)
        if event in _EVAL_AFTER and any([rule(self.state, event) for rule in self.rules]):
            self._evaluation()

    def _evaluation(self) -> None:
        self._ask(EVAL_DURING_FIT[0])
        for event in EVAL_OPEN:
            self._ask(event)
        for point in EVAL_BATCH:  # one batch: every eval batch asks the same
            for event in EVAL_STEP_EVENTS if point is STEP else (point,):
                self._ask(event)
        for event in EVAL_CLOSE:
            self._ask(event)
        self._ask(EVAL_DURING_FIT[1])

    def done(self) -> bool:
        return self.state.timestamp.counts.batch >= self.walk_total

    def at_epoch_start(self) -> bool:
        return self.state.timestamp.counts.batch_in_epoch == 0

    def at_iteration_start(self) -> bool:
        timestamp = self.state.timestamp
        return int(timestamp.epoch_in_iteration) == 0 and int(timestamp.batch_in_epoch) == 0

    def end_iteration(self) -> bool:
        from composerjax.trainer.fit_loop import end_iteration

        return end_iteration(self.state)

    def start_epoch(self) -> None:
        pass

    def group(self) -> int:
        if self.stride == 1:
            return 0
        left_in_epoch = (self.per_epoch - self.state.timestamp.counts.batch_in_epoch) if self.per_epoch else self.stride
        return min(self.stride, left_in_epoch, self.walk_total - self.state.timestamp.counts.batch)

    def train_group(self, count: int) -> bool:
        self.train_step()
        state = self.state
        state.previous_timestamp = state.timestamp
        state.timestamp = state.timestamp.to_next_batches(count - 1, self.batch_size * (count - 1), 0, 0.0)
        return True

    def batch_points(self) -> tuple[Any, ...]:
        return BATCH

    def next_batch(self) -> bool:
        return True

    def train_step(self) -> None:
        state, names = self.state, self.names
        plan = []
        for event in TRAIN_STEP_EVENTS:
            hits = self._ask(event)
            if hits:
                self.batches_matched[event] += 1
                plan.append(f"{event.name}: " + ", ".join(names[id(a)] for a in _ordered(self.engine, event, hits)))
        key = tuple(plan)
        if not self.plans or self.plans[-1][1] != key:
            self.plans.append((state.timestamp.counts.batch, key))
        self.walked += 1
        state.previous_timestamp = state.timestamp
        state.timestamp = state.timestamp.to_next_batch(self.batch_size, 0, 0.0)

    def epoch_complete(self) -> bool:
        return self.per_epoch is not None and self.state.timestamp.counts.batch_in_epoch == self.per_epoch

    def stop(self) -> bool:
        return self.done()

    def end_epoch(self) -> None:
        self.state.previous_timestamp = self.state.timestamp
        self.state.timestamp = self.state.timestamp.to_next_epoch()

    def end_fit(self) -> None:
        pass


def _ordered(engine: Any, event: Event, hits: list[Any]) -> tuple[Any, ...]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return engine.order(event, tuple(hits))


def _walk(trainer: Trainer, conflicts: list[str]) -> Explanation:
    """Walk the fit lifecycle with a driver that only asks ``match``; turn what matched into an Explanation."""
    import warnings

    state, engine = trainer.state, trainer.engine
    algorithms = list(state.algorithms)
    names = _names(algorithms)
    init_traces = [t for t in engine.trace_log if t.event == Event.INIT and t.run]
    prediction = _Prediction(trainer)
    saved = state.timestamp, state.previous_timestamp
    try:
        walk_fit(prediction)
    finally:
        state.timestamp, state.previous_timestamp = saved
    events = []
    interpolations: dict[tuple[str, ...], list[str]] = {}
    if init_traces:
        ran = {t.name for t in init_traces}
        notes = [f"{names[id(a)]}: {note}" for a in algorithms if names[id(a)] in ran
                 for note in (a.explain_notes() if callable(getattr(a, "explain_notes", None)) else [])]
        events.append(EventPlan(Event.INIT.name, False, [t.name for t in init_traces], [], None, notes))
    for event in Event:
        if event == Event.INIT or not prediction.matched_at[event]:
            continue
        matched = [a for a in algorithms if id(a) in prediction.matched_at[event]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            final, moves = _order_with_moves(engine, event, matched)
        traced = event in TRACED_EVENTS
        events.append(EventPlan(event.name, traced, [names[id(a)] for a in final], moves,
                                prediction.batches_matched[event] if event in TRAIN_STEP_EVENTS else None))
        interpolating = tuple(names[id(a)] for a in final if getattr(a, "interpolates_loss", False))
        if len(interpolating) > 1:
            interpolations.setdefault(interpolating, []).append(event.name)
    for group, at in interpolations.items():
        conflicts.append(f"{len(group)} algorithms interpolate the loss ({', '.join(group)}) at {', '.join(at)}; "
                         "their effects compound")
    return Explanation(
        events=events,
        conflicts=conflicts,
        train_plans=len({key for _, key in prediction.plans}),
        plan_changes=[{"batch": batch, "algorithms": list(key)} for batch, key in prediction.plans],
        walked_batches=prediction.walked,
        total_batches=prediction.total,
        passes=[getattr(p, "__name__", repr(p)) for p in engine.algorithm_passes],
    )
