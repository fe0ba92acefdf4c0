"""What ``Trainer.fit(...)`` may change between runs, as Composer's ``fit`` arguments, and the evaluators.

``Trainer.fit`` takes Composer's keyword arguments (``train_dataloader``, ``duration``,
``reset_time``, ``schedulers``, ``eval_dataloader``, ...). Each is applied here before the loop
starts; one that cannot apply to a compiled run (a different precision) is refused with the reason.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from composerjax.core.evaluator import ensure_evaluators
from composerjax.core.time import Time, Timestamp, TimeUnit
from composerjax.data.array_loader import as_batch_iterable
from composerjax.step.summary import format_summary, parameter_summary
from composerjax.trainer.validation import loader_length, to_time

__all__ = ["apply_fit_arguments", "log_run_summary", "set_evaluators"]


def set_evaluators(trainer: Any, eval_dataloader: Any, eval_interval: Any, subset_num_batches: int,
                   field: str = "eval_dataloader", replace_interval: bool = False) -> None:
    """Normalise ``eval_dataloader`` into ``state.evaluators`` and make sure an EvalRunner runs them.

    Each evaluator keeps its own ``eval_interval`` and ``subset_num_batches``; the others take
    ``eval_interval`` (default 1 epoch) and ``subset_num_batches``. An EvalRunner the user passed
    keeps its interval unless ``replace_interval`` (``fit(eval_interval=...)``).

    Raises:
        ValueError: a bad loader, label, interval or batch count, naming the argument.
    """
    from composerjax.trainer.eval_runner import EvalRunner

    if isinstance(subset_num_batches, bool) or not isinstance(subset_num_batches, int) or (
            subset_num_batches == 0 or subset_num_batches < -1):
        raise ValueError(f"eval_subset_num_batches={subset_num_batches!r}: expected a positive number of batches "
                         "or -1 (every batch)")
    evaluators = ensure_evaluators(eval_dataloader, field)
    for evaluator in evaluators:
        evaluator.dataloader = as_batch_iterable(evaluator.dataloader)
        if evaluator.subset_num_batches is None:
            evaluator.subset_num_batches = subset_num_batches
    interval = 1 if eval_interval is None else eval_interval
    if isinstance(interval, (str, Time)) or not callable(interval):
        time = to_time(interval, "eval_interval")
        if time is not None and time.unit == TimeUnit.TOKEN and trainer.tokens_per_batch is None:
            raise ValueError(f"eval_interval={interval!r}: 'tok' intervals need Trainer(tokens_per_batch=...), "
                             "else no token is counted and it never evaluates")
    state = trainer.state
    state.evaluators = evaluators
    callbacks = state.callbacks
    runner = next((c for c in callbacks if isinstance(c, EvalRunner)), None)
    if runner is None:
        if not evaluators:
            return
        runner = EvalRunner(interval)
        at = next((i for i, c in enumerate(callbacks) if type(c).__name__ == "SignalHandler"), len(callbacks))
        callbacks.insert(at, runner)  # before the signal exit, which ends FIT_END
        runner.attach_trainer(trainer)
    else:
        if replace_interval and eval_interval is not None:
            runner.eval_interval = EvalRunner(interval).eval_interval
        runner.attach_trainer(trainer)


def apply_fit_arguments(trainer: Any, duration: Any, train_dataloader: Any, reset_time: bool, schedulers: Any,
                        scale_schedule_ratio: float, step_schedulers_every_batch: bool | None,
                        eval_dataloader: Any, eval_subset_num_batches: int, eval_interval: Any,
                        device_train_microbatch_size: Any, precision: str | None) -> None:
    """Apply ``Trainer.fit``'s arguments to the trainer before its loop runs (Composer's meanings).

    Raises:
        ValueError: an argument that cannot apply, naming it, the value and what is accepted.
    """
    state, runner = trainer.state, trainer.runner
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
        state.dataloader, state.dataloader_len = loader, loader_length(loader)
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
        trainer.set_schedulers(schedulers, scale_schedule_ratio, step_schedulers_every_batch, field="fit")
    if eval_dataloader is not None or eval_interval is not None:
        given = eval_dataloader if eval_dataloader is not None else (list(state.evaluators) or None)
        set_evaluators(trainer, given, eval_interval, eval_subset_num_batches, replace_interval=True)


def log_run_summary(trainer: Any) -> None:
    """Log and print the run summary once, before the first FIT_START (``Trainer.fit`` calls it)."""
    state = trainer.state
    state.run_summary = summary = {
        "run_name": state.run_name,
        **parameter_summary(state.train_state.params),
        "devices": int(trainer.mesh.devices.size),
        "platform": jax.devices()[0].platform,
        "precision": state.precision,
        "algorithms": [type(a).__name__ for a in state.algorithms],
        "flops_per_step": None,
    }
    if trainer.steps_per_call > 1:
        summary.update(steps_per_call=trainer.steps_per_call, grouping_blocked_by=trainer.grouping_blocked_by)
    if trainer.run_summary:
        trainer.logger.log_hyperparameters({f"run_summary/{k}": v for k, v in summary.items()})
        from tqdm import tqdm

        tqdm.write(format_summary(summary))  # above any active progress bar
