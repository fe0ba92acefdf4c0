"""The Trainer: builds the state, engine, step runner and built-in callbacks, and walks fit / eval / predict."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import jax
import optax
from flax import nnx

from composerjax.checkpoint.saver import load_at_start, refuse_old_checkpoints, save_now
from composerjax.console import print_error, print_line
from composerjax.core.algorithm import Algorithm
from composerjax.core.callback import Callback
from composerjax.core.engine import Engine
from composerjax.core.evaluator import Evaluator, ensure_evaluators
from composerjax.core.event import Event
from composerjax.core.lifecycle import EVAL_DURING_FIT, EVAL_STANDALONE, walk_fit
from composerjax.core.passes import AlgorithmPass
from composerjax.core.state import State
from composerjax.core.time import Time
from composerjax.data.array_loader import as_batch_iterable
from composerjax.loggers.logger import Logger, LoggerDestination
from composerjax.loggers.progress_bar import ProgressBarLogger
from composerjax.models.function_model import model_functions
from composerjax.parallel.mesh import build_mesh
from composerjax.parallel.strategy import ParallelismConfig, config_for, resolve_devices, resolve_parallelism
from composerjax.step.compile_cache import enable_compilation_cache
from composerjax.step.precision import compute_dtype
from composerjax.step.runner import StepRunner, default_memory_budget
from composerjax.trainer import exit_hook
from composerjax.trainer.auto_grouping import AutoStepsPerCall
from composerjax.trainer.builtins import install_builtins
from composerjax.trainer.composer_arguments import refuse_unknown_arguments
from composerjax.trainer.fit_arguments import apply_fit_arguments, apply_schedulers, log_run_summary, set_evaluators
from composerjax.trainer.fit_loop import FitLoop, PendingLogs, grouping_blocked_by
from composerjax.trainer.interrupt import StopDecision, TrainingInterrupted
from composerjax.trainer.nonfinite_loss import NonFiniteLoss
from composerjax.trainer.settings import hyperparameters
from composerjax.trainer.stopping import to_time_limit
from composerjax.trainer.validation import (
    as_list,
    check_arguments,
    check_ready_to_fit,
    check_run_length,
    check_seed,
    loader_length,
    to_time,
)

__all__ = ["Trainer", "TrainingInterrupted"]


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
        model: a ``ComposerModel`` (e.g. ``ComposerClassifier``), or a plain ``nnx.Module`` with
            ``loss_fn``.
        train_dataloader: an ``ArrayLoader`` or any re-iterable of numpy/jax pytrees.
        max_duration: how long ``fit`` trains: a Time or a string such as ``'10ep'`` or ``'500ba'``;
            at most 2**31 - 1 batches, and ``'tok'`` only with ``tokens_per_batch`` (else refused:
            it would never end).
        optimizers: an optax ``GradientTransformation`` (default ``optax.adam(1e-3)`` with its
            hyperparameters injected, so the learning rate is logged), e.g. ``DecoupledAdamW``.
        schedulers: Composer schedulers (``composerjax.optim``: ``CosineAnnealingWithWarmupScheduler``,
            ...), compiled into the step as a multiplier of the optimizer's learning rate.
        scale_schedule_ratio: scale ``max_duration`` and the schedulers' times by this ratio.
        step_schedulers_every_batch: step schedulers every batch (True, the default with schedulers)
            or at epoch starts only (False).
        loss_fn: for plain modules: ``fn(model, batch)`` or ``fn(model, batch, rng, step)``
            returning a scalar loss or ``(loss, metrics_dict)``; at eval (its loss and metrics are the eval
            metrics) ``step`` is None, as ``state.step`` is, and ``rng`` fixed: branch on ``step is None``.
        algorithms: algorithms to compose into training.
        callbacks: callbacks to run at events.
        loggers: logger destinations.
        eval_dataloader: a loader, an :class:`~composerjax.core.evaluator.Evaluator`, a list of them
            or a ``{label: loader}`` dict; metrics are logged as ``metrics/<label>/<MetricName>``.
        eval_interval: how often to evaluate during ``fit``: an int (epochs), a time in any unit
            (``'1ep'`` default, ``'500ba'``, ``'10000sp'``, ``'0.25dur'``) or a callable
            ``(state, event) -> bool``; 0 disables. Fit also evaluates at its end when the last
            evaluation was not on its last batch (Composer's rule).
        eval_subset_num_batches: evaluate on at most this many batches (-1: all).
        device_train_microbatch_size: split each batch into microbatches of this size and
            accumulate gradients inside the step. ``'auto'`` picks the largest divisor of the batch
            whose compiled step fits ``device_memory_budget`` (``trainer.microbatch_size``).
        accumulate_train_batch_on_tokens: weigh each microbatch by its loss tokens (``model.loss_token_count``, e.g.
            targets other than -100), not equally: the gradient is the batch's mean over them (Composer's).
        steps_per_call: run this many batches per compiled call whenever nothing needs a
            per-batch view in between (``grouping_blocked_by`` names the plugins that do; no epoch
            end, end of training or plugin's ``next_due`` falls inside the group). ``'auto'`` (the
            default) groups by up to 32 when the first compiled step's cost says it is host-bound
            (``AutoStepsPerCall``: no clock; ``state.run_summary['steps_per_call']`` says why).
            A grouped step sees exactly what the single step would; on CPU bit-identical, else
            equal up to rounding (docs/performance.md). Multi-process: per step.
        device_prefetch: train batches a thread loads and places on the devices ahead of the step
            (0: none), started when producing and placing a batch takes over 1 ms (timed on the
            first batches; a batch sliced from memory goes to the step directly). Results, saved
            loader positions and resumes are the same with and without it.
        compilation_cache: JAX's persistent compilation cache: True (default) is
            ``$COMPOSERJAX_CACHE_DIR`` or ``~/.cache/composerjax/jax`` (on from ``import composerjax``;
            ``COMPOSERJAX_COMPILATION_CACHE=0`` keeps it off); a path picks the folder; False turns it off.
        device_memory_budget: bytes a train step may use, for ``'auto'`` (on GPU/TPU the default
            is 90% of the device's ``bytes_limit``; CPU has no limit to read, so it must be given).
        precision: ``'fp32'``, ``'amp_bf16'`` (bf16 compute, fp32 weights and optimizer state) or
            ``'bf16'`` (weights, optimizer state and compute in bf16); ``'amp_fp16'`` is refused.
        seed: seeds ``state.rng`` and the per-step ``state.step_rng``: an integer from 0 to
            2**32 - 1 (2**63 - 1 with ``jax_enable_x64``); others are refused, since JAX would
            overflow or repeat a smaller seed.
        run_name: the run's name (defaults to a timestamped one).
        progress_bar: show a tqdm progress bar (on terminals).
        log_interval: hand the loss and step metrics to the loggers every this many batches,
            fetched in one transfer, one interval behind the newest step so the device never
            waits (everything pending is flushed at epoch end, before eval and at fit end).
        algorithm_passes: extra engine passes.
        devices: which devices form the mesh: ``'auto'`` (every device of the backend, on every
            process), a count N (the first N local devices of each process), a list of local
            device indices, or a list of ``jax.Device``.
        parallelism: ``'auto'`` or ``'ddp'`` (parameters replicated, the batch split), ``'fsdp'``
            (parameters and optimizer state split on their largest divisible dimension over all
            devices), or a :class:`~composerjax.parallel.ParallelismConfig` with mesh axis sizes
            and tensor-parallel rules. NNX ``with_partitioning`` metadata wins over rules.
        accelerator: ``'auto'`` (JAX's default backend), ``'cpu'``, ``'gpu'`` or ``'tpu'``; a
            request the machine cannot satisfy fails here, naming what is available.
        save_folder: save checkpoints (orbax, async) into this folder; none when None.
        save_interval: how often to save: ``'1ep'``, ``'500ba'``.
        save_num_checkpoints_to_keep: keep the newest N checkpoints (-1 keeps all).
        save_weights_only: save only the model's variables (for fine-tuning or serving; such a
            checkpoint cannot resume a run).
        save_overwrite: let this run replace checkpoints another run left in ``save_folder``
            (else such a folder is refused, unless ``autoresume``); a live run's folder is always refused.
        save_filename: each checkpoint's folder name, a template as Composer's (``'ep{epoch}-ba{batch}'``
            gives ``ep1-ba8``; also ``{sample}``, ``{token}``, ``{run_name}``, ``{rank}``, ...).
        save_latest_filename: a symlink in ``save_folder`` to the newest verified checkpoint; None for none.
        load_path: load at start: a ``save_folder`` (its newest checkpoint) or one checkpoint's
            folder inside it (``'runs/x/checkpoints/ep3-ba1200'``). Checked against the run first: a
            checkpoint that does not fit the model, optimizer or algorithms raises
            :class:`~composerjax.checkpoint.checkpointer.CheckpointMismatchError` listing every difference.
        load_weights_only: from ``load_path`` take only the model's variables; time, optimizer
            and algorithm state start fresh.
        load_strict_model_weights: model names and shapes must match the checkpoint's exactly; False
            loads the weights both have and warns about the rest.
        load_ignore_keys: Composer state-dict paths not loaded (globs: ``['state/optimizers/*', 'rng']``),
            or ``fn(state_dict)`` that edits it first (docs/checkpointing.md has the paths).
        load_exclude_algorithms: algorithm class names whose saved state is neither loaded nor compared.
        autoresume: continue from the newest complete checkpoint in ``save_folder`` that reads
            back intact (then ``load_path`` is ignored); corrupt ones are skipped, each named on stderr.
        time_limit: a wall-clock budget (``'2h30m'``): then ``fit`` finishes the step, saves (with
            ``save_folder``) and returns with ``trainer.stop_reason == 'time_limit'``.
        skip_nonfinite_updates: inside the compiled step, leave parameters, optimizer, model and
            algorithm state unchanged when the loss or any gradient is NaN or infinite (the
            batch still counts); ``train/skipped_nonfinite`` is 1.0 for such steps; how many were
            skipped is in ``state.run_summary['skipped_nonfinite_updates']`` (and a line) at fit end.
        allow_nonfinite_loss: a NaN or infinite loss is expected: no line about the first one
            (``state.run_summary['nonfinite_loss']`` has it anyway); ``composerjax train`` exits 0, not 3.
        handle_signals: during ``fit``, SIGTERM/SIGINT finish the step, save (with ``save_folder``),
            close plugins and raise :class:`TrainingInterrupted` (exit status ``128 + signal``).
        tokens_per_batch: ``fn(batch) -> int`` counting the tokens of a host batch (e.g.
            ``lambda batch: batch[0].size`` for token ids), so ``timestamp.token``, token
            throughput and ``'tok'`` durations work; tokens are not counted without it, and a
            ``'tok'`` max_duration is refused.
        run_dir: the run folder for files callbacks and loggers write (traces, profiles, logs);
            ``runs/<run_name>`` by default. Created by whoever writes first.
        run_summary: log and print a run summary at the first FIT_START and one line per compiled
            step variant (compile time, FLOPs, memory); every variant is in ``state.compiled_steps``.
        auto_log_hparams: log ``trainer.hparams`` (the run's settings) to every logger at the first
            FIT_START, as Composer's ``auto_log_hparams``.

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
    def __init__(
        self,
        model: nnx.Module,
        train_dataloader: Iterable[Any] | None = None,
        max_duration: Time | str | int | None = None,
        optimizers: optax.GradientTransformation | None = None,
        *,
        loss_fn: Callable[..., Any] | None = None,
        algorithms: Algorithm | Sequence[Algorithm] = (),
        callbacks: Callback | Sequence[Callback] = (),
        loggers: LoggerDestination | Sequence[LoggerDestination] = (),
        eval_dataloader: Iterable[Any] | Evaluator | Sequence[Evaluator] | dict[str, Iterable[Any]] | None = None,
        eval_interval: Time | str | int | Callable[..., bool] | None = None,
        eval_subset_num_batches: int = -1,
        schedulers: Any = None,
        scale_schedule_ratio: float = 1.0,
        step_schedulers_every_batch: bool | None = None,
        device_train_microbatch_size: int | str | None = None,
        accumulate_train_batch_on_tokens: bool = False,
        precision: str = "fp32",
        seed: int = 0,
        run_name: str | None = None,
        progress_bar: bool = True,
        log_interval: int = 10,
        algorithm_passes: Sequence[AlgorithmPass | tuple[AlgorithmPass, int]] | None = None,
        devices: str | int | Sequence[int] | Sequence[jax.Device] | None = "auto",
        parallelism: str | ParallelismConfig = "auto",
        accelerator: str = "auto",
        run_summary: bool = True,
        auto_log_hparams: bool = False,
        run_dir: str | None = None,
        tokens_per_batch: Callable[[Any], int] | None = None,
        save_folder: str | None = None,
        save_interval: Time | str = "1ep",
        save_num_checkpoints_to_keep: int = -1,
        save_weights_only: bool = False,
        save_overwrite: bool = False,
        save_filename: str = "ep{epoch}-ba{batch}",
        save_latest_filename: str | None = "latest",
        load_path: str | None = None,
        load_weights_only: bool = False,
        load_strict_model_weights: bool = True,
        load_ignore_keys: list[str] | Callable[[dict], None] | None = None,
        load_exclude_algorithms: list[str] | None = None,
        autoresume: bool = False,
        time_limit: Time | str | None = None,
        skip_nonfinite_updates: bool = False,
        allow_nonfinite_loss: bool = False,
        handle_signals: bool = True,
        device_memory_budget: int | None = None,
        steps_per_call: int | Literal["auto"] = "auto",
        device_prefetch: int = 2,
        compilation_cache: str | bool = True,
    ) -> None:
        self.arguments = {k: v for k, v in locals().items() if k != "self"}
        if not isinstance(model, nnx.Module):
            raise TypeError(f"model is a {type(model).__name__}; expected a flax nnx.Module")
        compute_dtype(precision)  # validates
        check_arguments(self.arguments)
        #: The persistent compilation cache's folder (None: off); see ``compilation_cache``.
        self.compilation_cache_dir = enable_compilation_cache(compilation_cache)
        seed = check_seed(seed)  # 2**70 would overflow in jax.random.key, -1 or 2**32 would repeat another seed
        optimizer = optimizers if optimizers is not None else optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"optimizers is a {type(optimizer).__name__}; expected an optax GradientTransformation")
        self.time_limit = to_time_limit(time_limit)
        model_functions(model, loss_fn)  # validated now, rebuilt after INIT
        strategy = resolve_parallelism(parallelism)
        mesh_devices = resolve_devices(accelerator, devices)
        layout = config_for(strategy, len(mesh_devices))
        self.mesh = build_mesh(mesh_devices, fsdp=layout.fsdp, tensor=layout.tensor)
        train_loader = as_batch_iterable(train_dataloader) if train_dataloader is not None else None
        self.state = state = State(
            model=model, optimizer=optimizer, max_duration=to_time(max_duration, "max_duration"),
            rng=jax.random.key(seed), algorithms=as_list(algorithms, Algorithm, "algorithms"),
            callbacks=as_list(callbacks, Callback, "callbacks"), dataloader=train_loader,
            dataloader_len=loader_length(train_loader), precision=precision,
            run_name=run_name or time.strftime("run-%Y%m%d-%H%M%S"), mesh=self.mesh)
        state.run_dir = run_dir or os.path.join("runs", state.run_name)
        state.skip_nonfinite_updates = skip_nonfinite_updates
        # '1tok' without a token counter never ends; '1e15ba' overflows the step's int32 counter.
        check_run_length(state.max_duration, batches=state.batches_in_duration(),
                         counts_tokens=tokens_per_batch is not None, given=max_duration)
        destinations = as_list(loggers, LoggerDestination, "loggers")
        if progress_bar:
            bar = ProgressBarLogger()
            if not bar.disable:  # a hidden bar would still make the trainer fetch losses
                destinations.append(bar)
        self.logger = Logger(state, destinations)
        self.engine = Engine(state, self.logger, algorithm_passes)
        self.log_interval, self.parallelism, self.run_summary = log_interval, strategy, run_summary
        self.auto_log_hparams, self.handle_signals = auto_log_hparams, handle_signals
        self.steps_per_call, self.tokens_per_batch = steps_per_call, tokens_per_batch
        self.auto_grouping, self.device_prefetch = AutoStepsPerCall(), device_prefetch
        self.prefetch_threaded: bool | None = None  # decided by timing on the first pass
        self.nonfinite_loss = NonFiniteLoss(state, allowed=allow_nonfinite_loss)  # says so once, in the run summary
        self.pending_logs = PendingLogs(self.logger, log_interval, on_loss=self.nonfinite_loss.see)
        self.stop_reason: str | None = None
        self.stop_decision: StopDecision | None = None
        self._stop_request = StopDecision()
        self.resumed_from: int | None = None
        self.config: Any = None  # the TrainerConfig, when built from one
        self.hparams: dict[str, Any] = {}
        self._summarized = False
        self.checkpointer = install_builtins(self, save_folder)
        set_evaluators(self, eval_dataloader, eval_interval, eval_subset_num_batches)
        if self.checkpointer is not None and save_folder is not None and not autoresume and not save_overwrite:
            refuse_old_checkpoints(self.checkpointer)
        try:
            if device_train_microbatch_size == "auto" and device_memory_budget is None:
                device_memory_budget = default_memory_budget(self.mesh.devices.flat[0])
            self.runner = StepRunner(state, self.engine, self.logger, loss_fn, self.mesh, strategy,
                                     device_train_microbatch_size, device_memory_budget,
                                     print_line if run_summary else None, accumulate_train_batch_on_tokens)
            self.engine.run_event(Event.INIT)
            apply_schedulers(self, schedulers, scale_schedule_ratio, step_schedulers_every_batch)
            self.runner.build()
            self.hparams = hyperparameters(self)
            # Loading comes after INIT: surgery has already reshaped the model the weights must fit.
            self.engine.run_event(Event.BEFORE_LOAD)
            if self.state.model_changed:  # surgery at BEFORE_LOAD: the loaded weights must land in the new model
                self.runner.take_model()
            self.resumed_from = load_at_start(self, report=print_error)
            self.engine.run_event(Event.AFTER_LOAD)
        except BaseException:
            if self.checkpointer is not None:
                self.checkpointer.close()
            raise
        exit_hook.register(self)  # closed at interpreter exit if nobody closes it

    # -- declarative use -------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Any, overrides: Sequence[str] = (), **arguments: Any) -> Trainer:
        """Build a Trainer from a ``TrainerConfig``, a dict or a YAML/JSON recipe path.

        Example::

            trainer = Trainer.from_config("examples/digits_speedup.yaml", overrides=["max_duration=1ep"])
        """
        from composerjax.trainer.config import TrainerConfig, build_trainer, load_config

        if not isinstance(config, TrainerConfig) or overrides:
            config = load_config(config.to_dict() if isinstance(config, TrainerConfig) else config, overrides)
        return build_trainer(config, **arguments)

    def to_config(self) -> Any:
        """This run as a ``TrainerConfig`` (needs a trainer built from a config; see ``from_config``)."""
        from composerjax.trainer.config import trainer_to_config

        return trainer_to_config(self)

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
        request = self._stop_request
        self._stop_request = StopDecision(signum=signum or request.signum, time_limit=time_limit or request.time_limit)

    def save_checkpoint(self, name: str = "ep{epoch}-ba{batch}", *, weights_only: bool = False) -> str:
        """Save into ``save_folder`` as ``name`` (a template) and return its folder, on disk and verified.

        Example: ``trainer.save_checkpoint("final")``; an existing name needs ``save_overwrite=True``.
        """
        return save_now(self, name, weights_only=weights_only)

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
        apply_fit_arguments(self, duration, train_dataloader, reset_time, schedulers, scale_schedule_ratio,
                            step_schedulers_every_batch, eval_dataloader, eval_subset_num_batches, eval_interval,
                            device_train_microbatch_size, precision)
        check_ready_to_fit(state, counts_tokens=self.tokens_per_batch is not None, duration=duration)
        self.runner.set_total_steps()
        if not self._summarized:
            self._summarized = True
            log_run_summary(self)
        self.stop_reason, self.stop_decision, self._stop_request = None, None, StopDecision()
        loop = FitLoop(self)
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
        if self.stop_decision is not None and self.stop_decision.time_limit:
            self.stop_reason = "time_limit"

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


