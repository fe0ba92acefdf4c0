"""The Trainer: builds the state, engine, step runner and built-in callbacks from its settings sections.

``Trainer(**kwargs)`` is Composer's front: it builds a
:class:`~composerjax.trainer.sections.TrainerSettings` (five typed sections, each checked once) and
then the run from those sections; ``fit`` walks the lifecycle, ``eval`` returns metrics,
``predict`` returns outputs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import optax

from composerjax.checkpoint.saver import load_at_start, refuse_old_checkpoints, save_now
from composerjax.console import print_error, print_line
from composerjax.core.algorithm import Algorithm
from composerjax.core.callback import Callback
from composerjax.core.engine import Engine
from composerjax.core.evaluator import Evaluator, ensure_evaluators
from composerjax.core.event import Event
from composerjax.core.lifecycle import EVAL_DURING_FIT, EVAL_STANDALONE, walk_fit
from composerjax.core.state import State
from composerjax.core.time import Time
from composerjax.core.validation import (
    as_list,
    check_ready_to_fit,
    check_run_length,
    check_seed,
    to_time,
)
from composerjax.data.array_loader import as_batch_iterable
from composerjax.loggers.logger import Logger, LoggerDestination
from composerjax.loggers.progress_bar import ProgressBarLogger
from composerjax.parallel.mesh import build_mesh
from composerjax.parallel.strategy import config_for, resolve_devices, resolve_parallelism
from composerjax.step.compile_cache import enable_compilation_cache
from composerjax.step.runner import StepRunner, default_memory_budget
from composerjax.trainer import exit_hook
from composerjax.trainer.auto_grouping import AutoStepsPerCall
from composerjax.trainer.builtins import install_builtins
from composerjax.trainer.composer_arguments import refuse_unknown_arguments
from composerjax.trainer.config import TrainerConfig, as_config_error, load_config, recipe_arguments_of, to_config
from composerjax.trainer.fit_arguments import (
    Scheduling,
    apply_fit_arguments,
    apply_schedulers,
    log_run_summary,
    set_evaluators,
)
from composerjax.trainer.fit_loop import FitLoop, PendingLogs, grouping_blocked_by
from composerjax.trainer.interrupt import StopControl, StopDecision, TrainingInterrupted
from composerjax.trainer.nonfinite_loss import NonFiniteLoss
from composerjax.trainer.sections import TrainerSettings
from composerjax.trainer.settings import hyperparameters
from composerjax.trainer.stopping import to_time_limit

__all__ = ["Trainer", "TrainingInterrupted", "build_trainer"]


def _settings_signature(init: Callable[..., None]) -> Callable[..., None]:
    """Give ``init`` the signature the settings sections declare (``inspect.signature(Trainer)``, ``help``)."""
    import inspect

    signature = TrainerSettings.signature()
    self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    init.__signature__ = signature.replace(parameters=[self, *signature.parameters.values()])  # type: ignore[attr-defined]
    return init


class Trainer:
    """Train an NNX model with optax, composing algorithms and callbacks around one compiled step.

    A thin event loop: INIT runs in the constructor; ``fit`` walks the lifecycle
    (``composerjax.core.lifecycle``), ``eval`` returns metrics, ``predict`` returns outputs. The
    compiled steps are run by a :class:`~composerjax.step.runner.StepRunner`; checkpoint saving,
    evaluation during fit, the time limit and the signal exit are callbacks installed from the
    arguments below (:class:`CheckpointSaver`, :class:`EvalRunner`, :class:`TimeLimit`,
    :class:`SignalHandler`), after the user's callbacks, so they show up in traces; pass your own
    instance in ``callbacks`` to replace one. ``trainer.state`` and ``trainer.engine`` are public.
    Between steps the trained values live on the device (``state.train_state``, a
    :class:`~composerjax.core.train_state.TrainState`); reading ``trainer.state.model`` merges them
    in, and ``state.update_model()`` takes host edits back.

    Args:
{arguments}

    Example:
        >>> import numpy as np, optax
        >>> from flax import nnx
        >>> from composerjax import Trainer, ComposerClassifier
        >>> from composerjax.data import ArrayLoader
        >>> x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
        >>> y = (x[:, 0] > 0).astype(np.int32)
        >>> trainer = Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2),
        ...                   ArrayLoader((x, y), batch_size=16), max_duration='2ep',
        ...                   optimizers=optax.sgd(0.1), progress_bar=False, run_summary=False)
        >>> trainer.fit()
        >>> trainer.state.timestamp.batch
        Time(8, TimeUnit.BATCH)
    """

    @refuse_unknown_arguments  # Composer's names it does not take (device=...) say what to pass instead
    @_settings_signature
    def __init__(self, model: Any, train_dataloader: Iterable[Any] | None = None,
                 max_duration: Time | str | int | None = None, optimizers: optax.GradientTransformation | None = None,
                 **arguments: Any) -> None:
        #: The run's settings: five frozen, checked sections (``settings.run.seed``, ``settings.checkpoint``...).
        self.settings = TrainerSettings.from_arguments({"model": model, "train_dataloader": train_dataloader,
                                                        "max_duration": max_duration, "optimizers": optimizers,
                                                        **arguments})
        self._build(self.settings)

    def _build(self, settings: TrainerSettings) -> None:
        """INIT: the state, engine, step runner and built-ins from ``settings``; then loading."""
        run, step, checkpoint, stopping = settings.run, settings.step, settings.checkpoint, settings.stopping
        #: The persistent compilation cache's folder (None: off); see ``compilation_cache``.
        self.compilation_cache_dir = enable_compilation_cache(run.compilation_cache)
        optimizer = run.optimizers if run.optimizers is not None else optax.inject_hyperparams(optax.adam)(
            learning_rate=1e-3)
        strategy = resolve_parallelism(run.parallelism)
        mesh_devices = resolve_devices(run.accelerator, run.devices)
        layout = config_for(strategy, len(mesh_devices))
        self.mesh = build_mesh(mesh_devices, fsdp=layout.fsdp, tensor=layout.tensor)
        train_loader = as_batch_iterable(run.train_dataloader) if run.train_dataloader is not None else None
        self.state = state = State(
            model=run.model, optimizer=optimizer, max_duration=to_time(run.max_duration, "max_duration"),
            rng=jax.random.key(check_seed(run.seed)), algorithms=as_list(run.algorithms, Algorithm, "algorithms"),
            callbacks=as_list(run.callbacks, Callback, "callbacks"), dataloader=train_loader,
            dataloader_len=run.batches_per_epoch(train_loader), precision=step.precision,
            run_name=run.run_name or time.strftime("run-%Y%m%d-%H%M%S"), mesh=self.mesh)
        state.run_dir = run.run_dir or os.path.join("runs", state.run_name)
        state.skip_nonfinite_updates = step.skip_nonfinite_updates
        # '1tok' without a token counter never ends; '1e15ba' overflows the step's int32 counter.
        check_run_length(state.max_duration, batches=state.batches_in_duration(),
                         counts_tokens=run.tokens_per_batch is not None, given=run.max_duration)
        destinations = as_list(run.loggers, LoggerDestination, "loggers")
        if run.progress_bar:
            bar = ProgressBarLogger()
            if not bar.disable:  # a hidden bar would still make the trainer fetch losses
                destinations.append(bar)
        self.logger = Logger(state, destinations)
        self.engine = Engine(state, self.logger, run.algorithm_passes)
        #: Decides ``steps_per_call='auto'`` from the first compiled step's cost.
        self.auto_grouping = AutoStepsPerCall()
        #: Whether the device prefetch runs in a thread: decided by timing on the first pass (None: not yet).
        self.prefetch_threaded: bool | None = None
        self.stop_control = StopControl()
        self.scheduling = Scheduling()
        self.nonfinite_loss = NonFiniteLoss(state, allowed=stopping.allow_nonfinite_loss)  # said once, in the summary
        self.pending_logs = PendingLogs(self.logger, run.log_interval, on_loss=self.nonfinite_loss.see)
        self.resumed_from: int | None = None
        #: The run's settings as JSON values: logged with ``auto_log_hparams`` and saved in every checkpoint.
        self.hparams: dict[str, Any] = {}
        self._summarized = False
        saver = install_builtins(state, self.engine, checkpoint, self.stop_control, time_limit=self.time_limit,
                                 handle_signals=stopping.handle_signals, hparams=lambda: self.hparams,
                                 close=self.close)
        #: The :class:`~composerjax.checkpoint.checkpointer.Checkpointer` of the run's saver (None: no saving).
        self.checkpointer = saver.checkpointer if saver is not None else None
        evaluation = settings.evaluation
        set_evaluators(state, self._eval_during_fit, evaluation.eval_dataloader, evaluation.eval_interval,
                       evaluation.eval_subset_num_batches, counts_tokens=run.tokens_per_batch is not None)
        if self.checkpointer is not None and checkpoint.save_folder is not None and not (
                checkpoint.autoresume or checkpoint.save_overwrite):
            refuse_old_checkpoints(self.checkpointer)
        try:
            budget = step.device_memory_budget
            if step.device_train_microbatch_size == "auto" and budget is None:
                budget = default_memory_budget(self.mesh.devices.flat[0])
            self.runner = StepRunner(state, self.engine, self.logger, run.loss_fn, self.mesh, strategy,
                                     step.device_train_microbatch_size, budget,
                                     print_line if run.run_summary else None, step.accumulate_train_batch_on_tokens)
            self.engine.run_event(Event.INIT)
            apply_schedulers(state, self.runner, self.scheduling, run.schedulers, run.scale_schedule_ratio,
                             run.step_schedulers_every_batch)
            self.runner.build()
            self.hparams = hyperparameters(settings, state, self.runner, self.logger.destinations, self.mesh)
            # Loading comes after INIT: surgery has already reshaped the model the weights must fit.
            self.engine.run_event(Event.BEFORE_LOAD)
            if self.state.model_changed:  # surgery at BEFORE_LOAD: the loaded weights must land in the new model
                self.runner.take_model()
            self.resumed_from = load_at_start(checkpoint, self.checkpointer, state, report=print_error)
            self.engine.run_event(Event.AFTER_LOAD)
        except BaseException:
            if self.checkpointer is not None:
                self.checkpointer.close()
            raise
        exit_hook.register(self)  # closed at interpreter exit if nobody closes it

    # -- declarative use -------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: TrainerConfig | dict[str, Any] | str | os.PathLike[str],
                    overrides: Sequence[str] = (), *, keep_files: bool = True, **arguments: Any) -> Trainer:
        """Build a Trainer from a ``TrainerConfig``, a dict or a YAML/JSON recipe path (INIT runs; nothing trains).

        ``arguments`` replace the recipe's. With ``keep_files=False`` (``composerjax explain``) data
        factories are not given the run folder, so nothing is written there.

        Example::

            trainer = Trainer.from_config("examples/digits_speedup.yaml", overrides=["max_duration=1ep"])
        """
        if not isinstance(config, TrainerConfig) or overrides:
            config = load_config(config.to_dict() if isinstance(config, TrainerConfig) else config, overrides)
        built = recipe_arguments_of(config, keep_files=keep_files, **arguments)
        try:
            return cls(**built, config=config)
        except (ValueError, FileNotFoundError) as error:
            raise as_config_error(error) from None

    def to_config(self) -> TrainerConfig:
        """This run as a ``TrainerConfig`` (needs a trainer built from a config; see ``from_config``)."""
        return to_config(self.settings, self.state, self.microbatch_size)

    @property
    def config(self) -> TrainerConfig | None:
        """The ``TrainerConfig`` this trainer was built from (``from_config``); None for one built in Python."""
        return self.settings.run.config

    @property
    def time_limit(self) -> float | None:
        """The ``time_limit`` in seconds (None: none)."""
        return to_time_limit(self.settings.stopping.time_limit)

    # -- properties the built-ins and users read -------------------------------------------------
    microbatch_size = property(lambda self: self.runner.microbatch_size,
                               doc="The microbatch size in use ('auto' has picked it once the first step ran).")
    microbatch_candidates = property(lambda self: self.runner.microbatch_candidates,
                                     doc="What device_train_microbatch_size='auto' tried: [{microbatch_size, bytes}].")
    device_memory_budget = property(lambda self: self.runner.device_memory_budget,
                                    doc="Bytes a train step may use, for device_train_microbatch_size='auto'.")
    builder = property(lambda self: self.runner.builder, doc="The step builder (compiled steps per plan).")

    @property
    def grouping_blocked_by(self) -> list[str]:
        """The plugins that prevent ``steps_per_call`` grouping (they must act between two batches).

        Example::

            Trainer(..., steps_per_call=32, callbacks=[NaNMonitor()]).grouping_blocked_by  # ['NaNMonitor']
        """
        return grouping_blocked_by(self.engine)

    @property
    def compile_count(self) -> int:
        """How many steps (train, eval and predict) have been traced and compiled."""
        return self.state.compile_count

    def request_stop(self, signum: int = 0, time_limit: bool = False) -> None:
        """Ask ``fit`` to stop after this batch or group and save; unlike ``state.stop_training()`` it can resume.

        Every process stops at the same batch once any one asks. Example: ``trainer.request_stop(time_limit=True)``.
        """
        self.stop_control.ask(signum=signum, time_limit=time_limit)

    @property
    def stop_reason(self) -> str | None:
        """Why the last ``fit`` stopped early: ``'time_limit'``, a signal's name (``'SIGTERM'``), or None."""
        return self.stop_control.reason

    @property
    def stop_decision(self) -> StopDecision | None:
        """The stop every process agreed on in the last ``fit`` (None: it ran to ``max_duration``)."""
        return self.stop_control.decision

    def save_checkpoint(self, name: str = "ep{epoch}-ba{batch}", *, weights_only: bool = False) -> str:
        """Save into ``save_folder`` as ``name`` (a template) and return its folder, on disk and verified.

        Example: ``trainer.save_checkpoint("final")``; an existing name needs ``save_overwrite=True``.
        """
        return save_now(self.checkpointer, self.state, self.hparams, name, weights_only=weights_only)

    # -- fit -------------------------------------------------------------------------------------
    def fit(self, duration: Time | str | int | None = None, *, train_dataloader: Iterable[Any] | None = None,
            reset_time: bool = False, schedulers: Any = None, scale_schedule_ratio: float = 1.0,
            step_schedulers_every_batch: bool | None = None, eval_dataloader: Any = None,
            eval_subset_num_batches: int = -1, eval_interval: Time | str | int | Callable[..., bool] | None = None,
            device_train_microbatch_size: int | None = None, precision: str | None = None) -> None:
        """Train until ``max_duration``, or, with ``duration``, that much more from where it stands.

        The keyword arguments are Composer's: each replaces the Trainer's for this and later fits
        (``reset_time`` restarts the clock at 0, with ``duration`` as the new ``max_duration``).
        A different ``precision`` is refused (it is compiled in; give it to ``Trainer``).

        Example: ``trainer.fit()`` then ``trainer.fit('1ep')`` trains one more epoch.
        """
        state = self.state
        counts_tokens = self.settings.run.tokens_per_batch is not None
        apply_fit_arguments(state, self.runner, self.scheduling, duration, train_dataloader, reset_time, schedulers,
                            scale_schedule_ratio, step_schedulers_every_batch, device_train_microbatch_size, precision,
                            batches_per_epoch=self.settings.run.batches_per_epoch)
        if eval_dataloader is not None or eval_interval is not None:
            given = eval_dataloader if eval_dataloader is not None else (list(state.evaluators) or None)
            set_evaluators(state, self._eval_during_fit, given, eval_interval, eval_subset_num_batches,
                           counts_tokens=counts_tokens, replace_interval=True)
        self.nonfinite_loss.start_fit()  # the batches before this fit (or before reset_time) are not its to check
        check_ready_to_fit(state, counts_tokens=counts_tokens, duration=duration)
        self.runner.set_total_steps()
        if not self._summarized:
            self._summarized = True
            log_run_summary(self.settings, state, self.logger, self.mesh, self.compilation_cache_dir,
                            self.grouping_blocked_by, self.hparams)
        self.stop_control.reset()
        loop = FitLoop(state, self.engine, self.logger, self.runner, self.settings.step, pending=self.pending_logs,
                       control=self.stop_control, nonfinite=self.nonfinite_loss, auto=self.auto_grouping,
                       count_tokens=self.settings.run.tokens_per_batch, prefetch_threaded=self.prefetch_threaded,
                       report=self.settings.run.run_summary)
        try:
            walk_fit(loop)
        except TrainingInterrupted:
            raise
        except BaseException as error:
            loop.close()  # the loader back right after the last batch trained, before plugins see the error
            for plugin in [*state.callbacks, *self.logger.destinations]:
                plugin.fit_error(state, self.logger, error)
            raise
        finally:
            loop.close()
            self.prefetch_threaded = loop.prefetch_threaded
        decision = self.stop_control.decision
        if decision is not None and decision.time_limit:
            self.stop_control.reason = "time_limit"

    # -- eval and predict --------------------------------------------------------------------------
    def _eval_during_fit(self, evaluators: Sequence[Evaluator]) -> None:
        """Run ``evaluators`` between EVAL_BEFORE_ALL and EVAL_AFTER_ALL (the EvalRunner's call)."""
        self.pending_logs.flush()
        self.engine.run_event(EVAL_DURING_FIT[0])
        for evaluator in evaluators:
            self._evaluate(evaluator, -1)
        self.engine.run_event(EVAL_DURING_FIT[1])

    def _evaluate(self, evaluator: Evaluator, subset_num_batches: int) -> dict[str, float]:
        subset = subset_num_batches if subset_num_batches != -1 else evaluator.subset_num_batches
        return self.runner.evaluate(evaluator.dataloader, label=evaluator.label, metric_names=evaluator.metric_names,
                                    subset_num_batches=-1 if subset is None else subset)

    def eval(self, eval_dataloader: Any = None, subset_num_batches: int = -1) -> dict[str, float]:
        """Evaluate on ``eval_dataloader`` (as ``Trainer(eval_dataloader=...)``) or the trainer's evaluators.

        Runs between ``EVAL_STANDALONE_START`` and ``EVAL_STANDALONE_END``. Each evaluator's metrics are
        computed on the device, fetched once, logged as ``metrics/<label>/<MetricName>`` and kept in
        ``state.metrics[<label>]``. Returns ``{MetricName: value}`` when there is one evaluator, and
        ``{'<label>/<MetricName>': value}`` for several.

        Example: ``trainer.eval()['MulticlassAccuracy']``.
        """
        evaluators = ensure_evaluators(eval_dataloader) if eval_dataloader is not None else self.state.evaluators
        if not evaluators:
            raise ValueError("eval(): no eval_dataloader given to Trainer(...) or to eval()")
        for evaluator in evaluators:
            evaluator.dataloader = as_batch_iterable(evaluator.dataloader)
        self.engine.run_event(EVAL_STANDALONE[0])
        results = {evaluator.label: self._evaluate(evaluator, subset_num_batches) for evaluator in evaluators}
        self.engine.run_event(EVAL_STANDALONE[1])
        if len(results) == 1:
            return next(iter(results.values()))
        return {f"{label}/{name}": value for label, values in results.items() for name, value in values.items()}

    def predict(self, dataloader: Iterable[Any], subset_num_batches: int = -1,
                return_outputs: bool = True) -> list[Any]:
        """The model's outputs for every batch of ``dataloader`` (at most ``subset_num_batches``), fetched once.

        With ``return_outputs=False`` nothing is kept or fetched (callbacks see each batch's
        ``state.outputs`` at ``PREDICT_BATCH_END``) and an empty list is returned.
        """
        return self.runner.predict(as_batch_iterable(dataloader), subset_num_batches, return_outputs)

    # -- shutdown --------------------------------------------------------------------------------
    def __enter__(self) -> Trainer:
        """``with Trainer(...) as trainer: trainer.fit()`` closes the trainer (:meth:`close`) when the block ends."""
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()  # while the block's exception (if any) is handled: trackers end their runs as failed

    def close(self) -> None:
        """Flush pending logs; close every callback (the saver waits), logger destination and data loader.

        Trackers end their runs (failed while an exception is handled, interrupted after SIGTERM/SIGINT); a
        Trainer never closed is closed at interpreter exit (``composerjax.trainer.exit_hook``). A loader
        with ``close()`` and ``state_dict()`` (a GrainLoader) stops its workers and keeps its position.
        """
        exit_hook.forget(self)
        if not self.engine.closed:
            self.pending_logs.flush()
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.engine.close()
        state = self.state
        for loader in [state.dataloader, *(evaluator.dataloader for evaluator in state.evaluators)]:
            if hasattr(loader, "state_dict") and callable(getattr(loader, "close", None)):
                loader.close()




Trainer.__doc__ = (Trainer.__doc__ or "").replace("{arguments}", TrainerSettings.docstring())


def build_trainer(config: TrainerConfig | dict[str, Any], *, keep_files: bool = True, **overrides: Any) -> Trainer:
    """Build the Trainer a config describes (INIT runs; nothing trains yet): ``Trainer.from_config``.

    The trainer keeps the config as ``trainer.config``; ``trainer.to_config()`` rebuilds it from the
    trainer's own objects.

    Example::

        trainer = build_trainer(load_config("examples/digits_speedup.yaml"))
        trainer.fit()
    """
    return Trainer.from_config(config, keep_files=keep_files, **overrides)
