"""``composerjax explain``: what a recipe will run where, without training.

The recipe's Trainer is built (INIT runs, so surgery happens and its traces are real), then the
schedule is walked on the host: at every batch of ``max_duration`` each algorithm's ``match`` is
asked, exactly as the trainer asks it, and the engine's passes order the matches. The result names,
per event, the algorithms in the order they will run, whether the event is traced (inside the
compiled step) or a host event, which passes moved them, the conflicts (more than one loss
interpolation at one event; an algorithm whose module types the model lacks), and how many
distinct train-step plans the schedule compiles.

Example::

    from composerjax.explain import explain
    from composerjax.trainer.config import load_config
    print(explain(load_config("examples/digits_speedup.yaml")).render())
"""

from __future__ import annotations

import dataclasses
from typing import Any

from composerjax.core.event import TRACED_EVENTS, TRAIN_STEP_EVENTS, Event
from composerjax.core.state import instance_names
from composerjax.core.time import Timestamp

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


def explain(config: Any) -> Explanation:
    """Explain a ``TrainerConfig`` (or a dict / recipe path) without training.

    Nothing is saved or loaded: checkpoint settings are left out of the Trainer built here.
    """
    from composerjax.trainer.config import TrainerConfig, _instantiate, build_trainer, load_config

    if not isinstance(config, TrainerConfig):
        config = load_config(config)
    conflicts = _missing_modules(config, _instantiate("models", config.model))
    trainer = build_trainer(config, progress_bar=False, run_summary=False, save_folder=None, load_path=None,
                            autoresume=False, time_limit=None)
    try:
        return _walk(trainer, conflicts)
    finally:
        trainer.close()


def _missing_modules(config: Any, model: Any) -> list[str]:
    from composerjax import registry
    from composerjax.surgery import count_modules

    found = []
    for spec in config.algorithms:
        factory = registry.resolve("algorithms", spec.name)
        required = getattr(factory, "required_modules", ())
        if required and count_modules(model, *required) == 0:
            kinds = " or ".join(("nnx." if cls.__module__.startswith("flax.nnx") else "") + cls.__qualname__
                                for cls in required)
            found.append(f"{getattr(factory, '__name__', spec.name)} acts on {kinds} modules, and the model "
                         f"({type(model).__name__}) has none: it will change nothing")
    return found


def _batches(trainer: Any) -> tuple[list[int], int | None, int | None]:
    """The batch indices walked (sampled evenly past the limit), the total, and batches per epoch."""
    state = trainer.state
    per_epoch = state.dataloader_len
    total = state.batches_in_duration() if hasattr(state, "batches_in_duration") else None
    if total is None:
        return list(range(min(per_epoch or 100, _MAX_WALKED_BATCHES))), None, per_epoch
    if total <= _MAX_WALKED_BATCHES:
        return list(range(total)), total, per_epoch
    stride = total / _MAX_WALKED_BATCHES
    batches = {int(i * stride) for i in range(_MAX_WALKED_BATCHES)}
    if per_epoch:
        batches |= {epoch * per_epoch for epoch in range(total // per_epoch)}
    return sorted(batches), total, per_epoch


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

def _walk(trainer: Any, conflicts: list[str]) -> Explanation:
    """Replay the schedule's host side: match (and for host events apply) at the times the trainer would."""
    import warnings

    from composerjax.core.event import EVAL_STEP_EVENTS

    state, engine = trainer.state, trainer.engine
    algorithms = list(state.algorithms)
    names = _names(algorithms)
    batches, total, per_epoch = _batches(trainer)
    saved_timestamp = state.timestamp
    matched_at: dict[Event, dict[int, Any]] = {event: {} for event in Event}
    batches_matched: dict[Event, int] = {event: 0 for event in Event}
    plans: list[tuple[int, tuple[str, ...]]] = []
    init_traces = [t for t in engine.trace_log if t.event == Event.INIT and t.run]

    def ordered(event: Event, hits: list[Any]) -> tuple[Any, ...]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return engine._order(event, tuple(hits))

    def host(event: Event) -> None:
        hits = [a for a in engine.candidates(event) if a.match(event, state)]
        for algorithm in hits:
            matched_at[event].setdefault(id(algorithm), algorithm)
        for algorithm in ordered(event, hits) if hits else ():
            try:  # stateful algorithms (SWA's window, schedules) move on as they would in training
                algorithm.apply(event, state, trainer.logger)
            except Exception:  # noqa: BLE001 - a walk without data cannot run everything; matching still counts
                pass

    try:
        previous = None
        for index, batch in enumerate(batches):
            epoch, in_epoch = divmod(batch, per_epoch) if per_epoch else (0, batch)
            state.timestamp = Timestamp(epoch=epoch, batch=batch, batch_in_epoch=in_epoch)
            if index == 0:
                host(Event.FIT_START)
            if in_epoch == 0:
                host(Event.EPOCH_START)
            for event in (Event.BEFORE_DATALOADER, Event.AFTER_DATALOADER, Event.BATCH_START):
                host(event)
            plan = []
            for event in TRAIN_STEP_EVENTS:
                hits = [a for a in engine.candidates(event) if a.match(event, state)]
                if hits:
                    batches_matched[event] += 1
                    for algorithm in hits:
                        matched_at[event].setdefault(id(algorithm), algorithm)
                    plan.append(f"{event.name}: " + ", ".join(names[id(a)] for a in ordered(event, hits)))
            key = tuple(plan)
            if key != previous:
                plans.append((batch, key))
                previous = key
            state.timestamp = Timestamp(epoch=epoch, batch=batch + 1, batch_in_epoch=in_epoch + 1)
            host(Event.BATCH_END)
            host(Event.BATCH_CHECKPOINT)
            if per_epoch and in_epoch + 1 == per_epoch:
                state.timestamp = Timestamp(epoch=epoch + 1, batch=batch + 1, batch_in_epoch=0)
                host(Event.EPOCH_END)
                host(Event.EPOCH_CHECKPOINT)
        host(Event.FIT_END)
        for event in (Event.EVAL_BEFORE_ALL, Event.EVAL_START, Event.EVAL_BATCH_START, *EVAL_STEP_EVENTS,
                      Event.EVAL_BATCH_END, Event.EVAL_END, Event.EVAL_AFTER_ALL):
            hits = [a for a in engine.candidates(event) if a.match(event, state)]
            for algorithm in hits:
                matched_at[event].setdefault(id(algorithm), algorithm)
    finally:
        state.timestamp = saved_timestamp
    events = []
    interpolations: dict[tuple[str, ...], list[str]] = {}
    if init_traces:
        events.append(EventPlan(Event.INIT.name, False, [t.name for t in init_traces], [], None))
    for event in Event:
        if event == Event.INIT or not matched_at[event]:
            continue
        matched = [a for a in algorithms if id(a) in matched_at[event]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            final, moves = _order_with_moves(engine, event, matched)
        traced = event in TRACED_EVENTS
        events.append(EventPlan(event.name, traced, [names[id(a)] for a in final], moves,
                                batches_matched[event] if event in TRAIN_STEP_EVENTS else None))
        interpolating = tuple(names[id(a)] for a in final if getattr(a, "interpolates_loss", False))
        if len(interpolating) > 1:
            interpolations.setdefault(interpolating, []).append(event.name)
    for group, at in interpolations.items():
        conflicts.append(f"{len(group)} algorithms interpolate the loss ({', '.join(group)}) at {', '.join(at)}; "
                         "their effects compound")
    return Explanation(
        events=events,
        conflicts=conflicts,
        train_plans=len({key for _, key in plans}),
        plan_changes=[{"batch": batch, "algorithms": list(key)} for batch, key in plans],
        walked_batches=len(batches),
        total_batches=total,
        passes=[getattr(p, "__name__", repr(p)) for p in engine.algorithm_passes],
    )
