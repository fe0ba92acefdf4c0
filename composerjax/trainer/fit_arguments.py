"""What ``Trainer.fit(...)`` may change between runs, as Composer's ``fit`` arguments, and the evaluators.

``Trainer.fit`` takes Composer's keyword arguments (``train_dataloader``, ``duration``,
``reset_time``, ``schedulers``, ``eval_dataloader``, ...). Each is applied here before the loop
starts; one that cannot apply to a compiled run (a different precision) is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from composerjax.core.evaluator import Evaluator, ensure_evaluators
from composerjax.core.logger import Logger
from composerjax.core.state import State
from composerjax.core.time import Time, Timestamp, TimeUnit
from composerjax.core.validation import loader_length, to_time
from composerjax.data.array_loader import as_batch_iterable
from composerjax.step.runner import StepRunner
from composerjax.step.summary import format_summary, parameter_summary
from composerjax.trainer.sections import TrainerSettings, check_subset

__all__ = ["Scheduling", "apply_fit_arguments", "apply_schedulers", "log_run_summary", "set_evaluators"]


@dataclass
class Scheduling:
    """The optimizer before any schedule was compiled into it, and the Composer schedulers that were.

    Example: ``trainer.scheduling.schedulers`` lists the schedulers of the run (empty without).
    """

    base: Any = None
    schedulers: list[Any] = field(default_factory=list)


def set_evaluators(state: State, evaluate: Callable[[Sequence[Evaluator]], None], eval_dataloader: Any,
                   eval_interval: Any, subset_num_batches: int, *, counts_tokens: bool,
                   field: str = "eval_dataloader", replace_interval: bool = False) -> None:
    """Normalise ``eval_dataloader`` into ``state.evaluators`` and make sure an EvalRunner runs them.

    Each evaluator keeps its own ``eval_interval`` and ``subset_num_batches``; the others take
    ``eval_interval`` (default 1 epoch) and ``subset_num_batches``. An EvalRunner the user passed
    keeps its interval unless ``replace_interval`` (``fit(eval_interval=...)``). The runner
    evaluates through ``evaluate`` (the trainer's, between the EVAL_BEFORE_ALL/EVAL_AFTER_ALL events).

    Raises:
        ValueError: a bad loader, label, interval or batch count, naming the argument.
    """
    from composerjax.trainer.eval_runner import EvalRunner

    check_subset(subset_num_batches)
    evaluators = ensure_evaluators(eval_dataloader, field)
    for evaluator in evaluators:
        evaluator.dataloader = as_batch_iterable(evaluator.dataloader)
        if evaluator.subset_num_batches is None:
            evaluator.subset_num_batches = subset_num_batches
    interval = 1 if eval_interval is None else eval_interval
    if isinstance(interval, (str, Time)) or not callable(interval):
        time = to_time(interval, "eval_interval")
        if time is not None and time.unit == TimeUnit.TOKEN and not counts_tokens:
            raise ValueError(f"eval_interval={interval!r}: 'tok' intervals need Trainer(tokens_per_batch=...), "
                             "else no token is counted and it never evaluates")
    state.evaluators = evaluators
    callbacks = state.callbacks
    runner = next((c for c in callbacks if isinstance(c, EvalRunner)), None)
    if runner is None:
        if not evaluators:
            return
        runner = EvalRunner(interval)
        # After the checkpoint saver (its FIT_END save comes first, as in Composer), before the stoppers.
        at = next((i for i, c in enumerate(callbacks) if type(c).__name__ in ("TimeLimit", "SignalHandler")),
                  len(callbacks))
        callbacks.insert(at, runner)
    elif replace_interval and eval_interval is not None:
        runner.eval_interval = EvalRunner(interval).eval_interval
    runner.bind(evaluate, state.evaluators)


def apply_schedulers(state: State, runner: StepRunner | None, scheduling: Scheduling, schedulers: Any,
                     scale_schedule_ratio: float, step_schedulers_every_batch: bool | None,
                     in_fit: bool = False) -> None:
    """Compile Composer schedulers into the optimizer (``with_schedule``), scaling the run by ``scale_schedule_ratio``.

    In ``Trainer(...)`` it runs after INIT, before the optimizer state is built. In ``fit`` new
    schedulers replace the old ones when the Trainer was built with schedulers (the optimizer state
    is kept) or before the first batch (the optimizer state is rebuilt); otherwise they are refused.

    Raises:
        ValueError: a bad ratio, a ratio without schedulers (Composer's rule), a time a scheduler
            cannot convert to steps, or schedulers ``fit`` cannot apply.
    """
    from composerjax.optim import ScheduleContext, compile_schedulers, scale_max_duration, with_schedule

    where = "fit(" if in_fit else "Trainer("
    if isinstance(scale_schedule_ratio, bool) or not isinstance(scale_schedule_ratio, (int, float)) or not (
            0 < scale_schedule_ratio < float("inf")):
        raise ValueError(f"{where}scale_schedule_ratio={scale_schedule_ratio!r}): expected a positive number")
    if step_schedulers_every_batch is not None and not isinstance(step_schedulers_every_batch, bool):
        raise ValueError(f"{where}step_schedulers_every_batch={step_schedulers_every_batch!r}): expected True, False "
                         "or None")
    if schedulers is None or (isinstance(schedulers, (list, tuple)) and not schedulers):
        if scale_schedule_ratio != 1.0:
            raise ValueError(f"{where}scale_schedule_ratio={scale_schedule_ratio}): specifying scale_schedule_ratio "
                             "without schedulers has no effect (Composer's rule); pass schedulers=[...]")
        return
    if state.max_duration is None:
        raise ValueError(f"{where}schedulers=...): schedulers need max_duration (their times are fractions or "
                         "counts of the run); pass max_duration")
    built = runner is not None and getattr(runner, "builder", None) is not None
    base = scheduling.base
    rescheduling = base is not None  # the optimizer state already has the schedule's structure
    if built and not rescheduling and int(state.timestamp.batch) > 0:
        raise ValueError(f"fit(schedulers=...): this Trainer was built without schedulers and has trained "
                         f"{int(state.timestamp.batch)} batches, so its optimizer state has no schedule to replace; "
                         "pass schedulers= to Trainer(...)")
    if scale_schedule_ratio != 1.0:
        state.max_duration = scale_max_duration(state.max_duration, scale_schedule_ratio)
    loader = state.dataloader
    samples = getattr(loader, "global_batch_size", None) if getattr(loader, "drop_last", True) else None
    context = ScheduleContext.from_state(state, samples_per_step=samples, scale_schedule_ratio=scale_schedule_ratio)
    multiplier = compile_schedulers(schedulers, context, step_schedulers_every_batch)
    if base is None:
        base = scheduling.base = state.optimizer
    state.optimizer = with_schedule(base, multiplier)
    scheduling.schedulers = list(schedulers) if isinstance(schedulers, (list, tuple)) else [schedulers]
    if built:
        runner.replace_optimizer(state.optimizer, keep_state=rescheduling)


def apply_fit_arguments(state: State, runner: StepRunner, scheduling: Scheduling, duration: Any,
                        train_dataloader: Any, reset_time: bool, schedulers: Any, scale_schedule_ratio: float,
                        step_schedulers_every_batch: bool | None, device_train_microbatch_size: Any,
                        precision: str | None, batches_per_epoch: Callable[[Any], int | None] = loader_length) -> None:
    """Apply ``Trainer.fit``'s run arguments to the state and the step runner (Composer's meanings).

    The evaluation arguments go to :func:`set_evaluators`.

    Raises:
        ValueError: an argument that cannot apply, naming it, the value and what is accepted.
    """
    if precision is not None and precision != state.precision:
        raise ValueError(f"fit(precision={precision!r}): the precision is compiled into the train step when the "
                         f"Trainer is built (precision={state.precision!r}); pass precision= to Trainer(...)")
    if device_train_microbatch_size is not None and device_train_microbatch_size != runner.microbatch_size:
        if isinstance(device_train_microbatch_size, bool) or not isinstance(device_train_microbatch_size, int) or (
                device_train_microbatch_size < 1):
            raise ValueError(f"fit(device_train_microbatch_size={device_train_microbatch_size!r}): expected a "
                             "positive integer ('auto' is chosen once, in Trainer(...))")
        runner.microbatch_size = runner.builder.microbatch_size = device_train_microbatch_size
        runner.builder.clear()  # the steps compiled for the old split
    if train_dataloader is not None:
        loader = as_batch_iterable(train_dataloader)
        state.dataloader, state.dataloader_len = loader, batches_per_epoch(loader)
    if reset_time:
        state.timestamp, state.previous_timestamp = Timestamp(), None
        clock = state.train_state.clock
        state.train_state = state.train_state._replace(
            clock=jax.device_put(clock.at[0].set(jnp.int32(0)), clock.sharding))
        if duration is not None:
            state.max_duration = to_time(duration, "duration")
    elif duration is not None:
        extra = to_time(duration, "duration")
        now = state.timestamp.get(extra.unit) if extra.unit != TimeUnit.DURATION else None
        if now is None:
            raise ValueError(f"fit(duration={duration!r}): expected a time in ep, ba, sp, tok, iter or sec "
                             "(a fraction of the run has nothing to be a fraction of)")
        state.max_duration = Time(now.value + extra.value, extra.unit)
    duration_now = state.max_duration
    if duration_now is not None and duration_now.unit == TimeUnit.ITERATION and state.iteration_length is None:
        raise ValueError(f"max_duration={str(duration_now)!r}: 'iter' durations need state.iteration_length (epochs "
                         "per iteration, e.g. trainer.state.iteration_length = '2ep'); without it the whole run is "
                         "one iteration")
    if schedulers is not None or scale_schedule_ratio != 1.0 or step_schedulers_every_batch is not None:
        apply_schedulers(state, runner, scheduling, schedulers, scale_schedule_ratio, step_schedulers_every_batch,
                         in_fit=True)


def log_run_summary(settings: TrainerSettings, state: State, logger: Logger, mesh: jax.sharding.Mesh,
                    compilation_cache_dir: str | None, blocked_by: list[str], hparams: dict[str, Any]) -> None:
    """Log and print the run summary (and with ``auto_log_hparams`` the hparams) once, before the first FIT_START."""
    state.run_summary = summary = {
        "run_name": state.run_name,
        **parameter_summary(state.train_state.params),
        "devices": int(mesh.devices.size),
        "platform": jax.devices()[0].platform,
        "precision": state.precision,
        "algorithms": [type(a).__name__ for a in state.algorithms],
        "flops_per_step": None,
    }
    if compilation_cache_dir is not None:
        summary["compilation_cache"] = {"folder": compilation_cache_dir, "steps_loaded": 0, "steps_compiled": 0}
    steps_per_call = settings.step.steps_per_call
    if steps_per_call == "auto" or steps_per_call > 1:
        # One shape from the start: 'auto' fills in chosen, reason and the cost it read once it decides.
        chosen = None if steps_per_call == "auto" else steps_per_call
        summary.update(steps_per_call={"given": steps_per_call, "chosen": chosen, "reason": None, "flops": None,
                                       "bytes_accessed": None, "estimated_step_ms": None},
                       grouping_blocked_by=blocked_by)
    if settings.run.auto_log_hparams:
        logger.log_hyperparameters(hparams)
    if settings.run.run_summary:
        logger.log_hyperparameters({f"run_summary/{k}": v for k, v in summary.items()})
        from tqdm import tqdm

        tqdm.write(format_summary(summary))  # above any active progress bar
