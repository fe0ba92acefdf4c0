"""The Trainer: builds the state, engine and compiled steps, and runs fit / eval / predict."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from composerjax import dist
from composerjax.core.algorithm import Algorithm
from composerjax.core.callback import Callback
from composerjax.core.engine import Engine
from composerjax.core.event import Event
from composerjax.core.passes import AlgorithmPass
from composerjax.core.state import State, instance_names
from composerjax.core.time import Time, TimeUnit
from composerjax.data.array_loader import as_batch_iterable
from composerjax.launch import heartbeat
from composerjax.loggers.destinations import ProgressBarLogger
from composerjax.loggers.logger import Logger, LoggerDestination
from composerjax.models.function_model import model_functions
from composerjax.parallel.mesh import build_mesh
from composerjax.parallel.sharding import (
    batch_sharding,
    global_batch,
    replicated,
    train_state_shardings,
)
from composerjax.parallel.strategy import (
    ParallelismConfig,
    config_for,
    partition_metadata,
    resolve_devices,
    resolve_parallelism,
)
from composerjax.step.builder import StepBuilder, add_metric_sums, split_model
from composerjax.step.keys import KeyCodec
from composerjax.step.precision import compute_dtype
from composerjax.trainer.checkpoint import Checkpointer, CheckpointSaveError
from composerjax.trainer.interrupt import (
    StopDecision,
    TrainingInterrupted,
    describe_batch,
    diagnose_batch,
    note_batch,
)
from composerjax.trainer.summary import (
    CompiledStep,
    cost_of,
    format_compiled,
    format_summary,
    memory_of,
    parameter_summary,
)
from composerjax.trainer.validation import check_interval, check_run_length, check_seed

__all__ = ["Trainer", "TrainingInterrupted"]

#: When ``fit`` fails, how long it waits for a checkpoint in flight to reach the disk before giving up.
ABANDON_SAVE_TIMEOUT_S = 120.0

@functools.partial(jax.jit, donate_argnums=0)
def _with_total_steps(clock: jax.Array, total: int) -> jax.Array:
    """``clock`` with its second entry (the steps in ``max_duration``) set to ``total``."""
    return clock.at[1].set(total)


# The host events of every training batch.
_BATCH_EVENTS = (Event.BEFORE_DATALOADER, Event.AFTER_DATALOADER, Event.BATCH_START, Event.BATCH_END,
                 Event.BATCH_CHECKPOINT)

# Which Timestamp counter a max_duration unit is measured on.
_COUNTER = {
    TimeUnit.EPOCH: "epoch",
    TimeUnit.ITERATION: "iteration",
    TimeUnit.BATCH: "batch",
    TimeUnit.SAMPLE: "sample",
    TimeUnit.TOKEN: "token",
    TimeUnit.SECOND: "total_wct",
}


class Trainer:
    """Train an NNX model with optax, composing algorithms and callbacks around one compiled step.

    INIT runs in the constructor; ``fit`` trains, ``eval`` returns metrics, ``predict`` returns
    outputs. ``trainer.state`` and ``trainer.engine`` are public. Between steps the trained values
    live on the device (``state.train_state``); reading ``trainer.state.model`` merges them in.

    Args:
        model: a ``ComposerModel`` (e.g. ``ComposerClassifier``), or a plain ``nnx.Module`` with
            ``loss_fn``.
        train_dataloader: an ``ArrayLoader`` or any re-iterable of numpy/jax pytrees.
        max_duration: how long ``fit`` trains: a Time or a string such as ``'10ep'`` or ``'500ba'``;
            at most 2**31 - 1 batches, and ``'tok'`` only with ``tokens_per_batch`` (else refused:
            it would never end).
        optimizers: an optax ``GradientTransformation`` (default ``optax.adam(1e-3)``).
        loss_fn: for plain modules: ``fn(model, batch)`` or ``fn(model, batch, rng, step)``
            returning a scalar loss or ``(loss, metrics_dict)``.
        algorithms: algorithms to compose into training.
        callbacks: callbacks to run at events.
        loggers: logger destinations.
        eval_dataloader: data for ``eval()`` and periodic evaluation.
        eval_interval: how often to evaluate during ``fit``: a positive number of epochs or batches
            (``'1ep'`` by default when there is eval data; an int means epochs; other units are
            refused, as the trainer would never act on them).
        device_train_microbatch_size: split each batch into microbatches of this size and
            accumulate gradients inside the step (a ``lax.scan``). ``'auto'`` picks, before the
            first step runs, the largest divisor of the batch whose compiled step fits
            ``device_memory_budget`` (read from ``compiled.memory_analysis()``: arguments + outputs
            - donated + temporaries); the choice is in ``trainer.microbatch_size`` and
            ``state.run_summary['microbatch_candidates']``.
        steps_per_call: run this many batches per compiled call (a ``lax.scan`` over stacked
            batches) whenever nothing needs a per-batch view in between: no callback or logger
            listens to the per-batch host events, the plan is the same for all of them, and no
            epoch end, end of training, batch-interval save or eval falls inside the group.
            Each grouped step sees exactly the batch, step number, ``progress`` and
            ``step_rng`` of the matching single step; the floating-point state equals per-step
            training up to rounding, not bit for bit (XLA compiles a scan body differently from
            a standalone step). Every batch's loss and metrics still reach the loggers. Signals
            and ``time_limit`` are checked between calls.
        device_memory_budget: bytes a train step may use, for ``'auto'`` (on GPU/TPU the default
            is 90% of the device's ``bytes_limit``; CPU has no limit to read, so it must be given).
        precision: ``'fp32'`` or ``'bf16'`` (bf16 compute, fp32 weights and optimizer state).
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
        save_overwrite: let this run replace checkpoints another run left in ``save_folder``.
            Without it (and without ``autoresume``), a ``save_folder`` that already holds
            checkpoints is refused here: a new run never silently mixes with or hides behind an
            old one. Either way, a folder a live run is writing is refused
            (:class:`~composerjax.trainer.checkpoint.SaveFolderInUseError`).
        load_path: load at start: a ``save_folder`` (its newest checkpoint) or one checkpoint's
            folder inside it (``'runs/x/checkpoints/1200'``). Checked against the run first: a
            checkpoint that does not fit the model, optimizer or algorithms raises
            :class:`~composerjax.trainer.checkpoint.CheckpointMismatchError` listing every difference.
        load_weights_only: from ``load_path`` take only the model's variables; time, optimizer
            and algorithm state start fresh.
        autoresume: continue from the newest complete checkpoint in ``save_folder`` that reads
            back intact (then ``load_path`` is ignored), else start as usual. Corrupt checkpoints
            (a missing item, an unreadable file, arrays whose checksum differs from the one saved)
            are skipped, newest first, each named on stderr with why.
        time_limit: a wall-clock budget for this process's training, e.g. ``'2h30m'`` or
            ``'45m'``: once it is spent, ``fit`` finishes the current step, saves a checkpoint
            (with ``save_folder``) and returns with ``trainer.stop_reason == 'time_limit'``; a
            new run with ``autoresume=True`` continues it.
        skip_nonfinite_updates: inside the compiled step, leave parameters, optimizer, model and
            algorithm state unchanged when the loss or any gradient is NaN or infinite (the
            batch still counts); ``train/skipped_nonfinite`` is 1.0 for such steps.
        handle_signals: during ``fit``, SIGTERM and SIGINT finish the current step, save a
            checkpoint (with ``save_folder``), close callbacks and loggers and raise
            :class:`TrainingInterrupted`, a ``SystemExit`` whose exit status is ``128 + signal``
            (143 for SIGTERM, 130 for SIGINT). A second signal while stopping interrupts at once.
        tokens_per_batch: ``fn(batch) -> int`` counting the tokens of a host batch (e.g.
            ``lambda batch: batch[0].size`` for token ids), so ``timestamp.token``, token
            throughput and ``'tok'`` durations work; tokens are not counted without it, and a
            ``'tok'`` max_duration is refused.
        run_dir: the run folder for files callbacks and loggers write (traces, profiles, logs);
            ``runs/<run_name>`` by default. Created by whoever writes first.
        run_summary: log (``log_hyperparameters``) and print a run summary at the first FIT_START
            (parameters and bytes, devices, precision, algorithms) and one line per compiled step
            variant as it compiles (compile time, FLOPs per step, memory analysis; no extra
            compile). Every variant is recorded in ``state.compiled_steps``; the first train
            step's FLOPs also land in ``state.run_summary['flops_per_step']``.

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
        8
    """

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
        eval_dataloader: Iterable[Any] | None = None,
        eval_interval: Time | str | int | None = None,
        device_train_microbatch_size: int | str | None = None,
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
        run_dir: str | None = None,
        tokens_per_batch: Callable[[Any], int] | None = None,
        save_folder: str | None = None,
        save_interval: Time | str = "1ep",
        save_num_checkpoints_to_keep: int = -1,
        save_weights_only: bool = False,
        save_overwrite: bool = False,
        load_path: str | None = None,
        load_weights_only: bool = False,
        autoresume: bool = False,
        time_limit: Time | str | None = None,
        skip_nonfinite_updates: bool = False,
        handle_signals: bool = True,
        device_memory_budget: int | None = None,
        steps_per_call: int = 1,
    ) -> None:
        if not isinstance(model, nnx.Module):
            raise TypeError(f"model is a {type(model).__name__}; expected a flax nnx.Module")
        compute_dtype(precision)  # validates
        if not isinstance(log_interval, int) or log_interval < 1:
            raise ValueError(f"log_interval={log_interval!r}: expected a positive integer (batches)")
        if device_train_microbatch_size is not None and device_train_microbatch_size != "auto" and (
            isinstance(device_train_microbatch_size, bool) or not isinstance(device_train_microbatch_size, int)
            or device_train_microbatch_size < 1
        ):
            raise ValueError(f"device_train_microbatch_size={device_train_microbatch_size!r}: expected a "
                             "positive integer, 'auto' or None")
        if isinstance(steps_per_call, bool) or not isinstance(steps_per_call, int) or steps_per_call < 1:
            raise ValueError(f"steps_per_call={steps_per_call!r}: expected a positive integer (batches per call)")
        if device_memory_budget is not None and (isinstance(device_memory_budget, bool) or not isinstance(
                device_memory_budget, int) or device_memory_budget < 1):
            raise ValueError(f"device_memory_budget={device_memory_budget!r}: expected a positive number of bytes")
        seed = check_seed(seed)  # 2**70 would overflow in jax.random.key, -1 or 2**32 would repeat another seed
        optimizer = optimizers if optimizers is not None else optax.adam(1e-3)
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"optimizers is a {type(optimizer).__name__}; expected an optax GradientTransformation")

        self.time_limit = _to_time_limit(time_limit)
        for flag, value in (("save_weights_only", save_weights_only), ("load_weights_only", load_weights_only),
                            ("save_overwrite", save_overwrite),
                            ("autoresume", autoresume), ("skip_nonfinite_updates", skip_nonfinite_updates),
                            ("handle_signals", handle_signals)):
            if not isinstance(value, bool):
                raise ValueError(f"{flag}={value!r}: expected True or False")
        if load_path is not None and not isinstance(load_path, (str, os.PathLike)):
            raise ValueError(f"load_path={load_path!r}: expected a folder path (str) or None")
        if save_folder is not None and not isinstance(save_folder, (str, os.PathLike)):
            raise ValueError(f"save_folder={save_folder!r}: expected a folder path (str) or None")
        if autoresume and save_folder is None:
            raise ValueError("autoresume=True needs save_folder: the folder to resume from")
        if autoresume and save_weights_only:
            raise ValueError("autoresume=True needs full checkpoints, but save_weights_only=True saves only the "
                             "model's variables; drop one of them")
        if isinstance(save_num_checkpoints_to_keep, bool) or not isinstance(save_num_checkpoints_to_keep, int) or (
                save_num_checkpoints_to_keep < 1 and save_num_checkpoints_to_keep != -1):
            raise ValueError(f"save_num_checkpoints_to_keep={save_num_checkpoints_to_keep!r}: expected a positive "
                             "integer, or -1 to keep all")
        if load_path is not None and not os.path.isdir(load_path):
            raise FileNotFoundError(f"load_path={os.fspath(load_path)!r} does not exist; expected a save_folder or "
                                    "one checkpoint folder inside it")
        self._seed = seed
        self.loss_fn = loss_fn
        self.functions = model_functions(model, loss_fn)  # validated now, rebuilt after INIT
        strategy = resolve_parallelism(parallelism)
        mesh_devices = resolve_devices(accelerator, devices)
        layout = config_for(strategy, len(mesh_devices))
        self.mesh = build_mesh(mesh_devices, fsdp=layout.fsdp, tensor=layout.tensor)
        train_loader = as_batch_iterable(train_dataloader) if train_dataloader is not None else None
        self.state = State(
            model=model,
            optimizer=optimizer,
            max_duration=_to_time(max_duration, "max_duration"),
            rng=jax.random.key(seed),
            algorithms=_as_list(algorithms, Algorithm, "algorithms"),
            callbacks=_as_list(callbacks, Callback, "callbacks"),
            dataloader=train_loader,
            dataloader_len=_length(train_loader),
            precision=precision,
            run_name=run_name or time.strftime("run-%Y%m%d-%H%M%S"),
            mesh=self.mesh,
        )
        self.state.run_dir = run_dir or os.path.join("runs", self.state.run_name)
        # '1tok' without a token counter never ends; '1e15ba' overflows the step's int32 counter.
        check_run_length(self.state.max_duration, batches=self.state.batches_in_duration(),
                         counts_tokens=tokens_per_batch is not None, given=max_duration)
        self.eval_dataloader = as_batch_iterable(eval_dataloader) if eval_dataloader is not None else None
        self.eval_interval = _to_time(
            eval_interval if eval_interval is not None else ("1ep" if eval_dataloader is not None else None),
            "eval_interval",
        )
        check_interval(self.eval_interval, "eval_interval", given=eval_interval)  # '1tok', '0ba' never evaluate
        destinations = _as_list(loggers, LoggerDestination, "loggers")
        self._given_loggers = list(destinations)
        if progress_bar:
            bar = ProgressBarLogger()
            if not bar.disable:  # a hidden bar would still make the trainer fetch losses
                destinations.append(bar)
        self.logger = Logger(self.state, destinations)
        self._destinations = self.logger.destinations
        self.engine = Engine(self.state, self.logger, algorithm_passes)
        # Plugins that read the engine itself (its trace log) declare attach(engine).
        for plugin in (*self.state.callbacks, *destinations):
            attach = getattr(plugin, "attach", None)
            if callable(attach):
                attach(self.engine)
        self.log_interval = log_interval
        self.parallelism = strategy
        self._auto_microbatch = device_train_microbatch_size == "auto"
        self.microbatch_size = None if self._auto_microbatch else device_train_microbatch_size
        self.device_memory_budget = device_memory_budget
        self.steps_per_call = steps_per_call
        self.run_summary = run_summary
        if tokens_per_batch is not None and not callable(tokens_per_batch):
            raise TypeError(f"tokens_per_batch={tokens_per_batch!r}: expected a callable fn(batch) -> int or None")
        self.tokens_per_batch = tokens_per_batch
        self._summarized = False
        self._model_variables: Any = None  # (key, [(path, variable, is_param)]) for _sync_model
        self._pending: list[tuple[int, Any, Any, int | None]] = []
        self._multi_process = jax.process_count() > 1
        self.handle_signals = handle_signals
        self.stop_reason: str | None = None
        self.resumed_from: int | None = None
        self.config: Any = None  # the TrainerConfig, when built from one
        self._stop_signal: int | None = None
        self._stop_decision: StopDecision | None = None
        self._fit_started_at: float | None = None
        self._batch_signature: Any = None
        self.state.skip_nonfinite_updates = skip_nonfinite_updates

        self.checkpointer = None
        if save_folder is not None:
            keep = None if save_num_checkpoints_to_keep == -1 else save_num_checkpoints_to_keep
            self.checkpointer = Checkpointer(os.fspath(save_folder), save_interval, keep, save_weights_only,
                                             owner=self.state.run_name, overwrite=save_overwrite)
        try:
            if self.checkpointer is not None and not autoresume and not save_overwrite:
                _refuse_old_checkpoints(self.checkpointer)
            if self._auto_microbatch and device_memory_budget is None:
                self.device_memory_budget = _default_memory_budget(self.mesh.devices.flat[0])
            self.engine.run_event(Event.INIT)
            self._build_device_state()
            self.hparams = self._hyperparameters(max_duration, save_interval, save_weights_only, time_limit)
            # Loading comes after INIT: surgery has already reshaped the model the weights must fit.
            if autoresume and self.checkpointer.latest() is not None:
                self._load(self.checkpointer, None, False, "save_folder")
            elif load_path is not None:
                folder, step = _checkpoint_location(os.fspath(load_path))
                loader = Checkpointer(folder)
                try:
                    self._load(loader, step, load_weights_only, "load_path")
                finally:
                    loader.close()
        except BaseException:
            if self.checkpointer is not None:
                self.checkpointer.close()
            raise

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

    # -- checkpoints -----------------------------------------------------------------------------
    def _load(self, checkpointer: Checkpointer, step: int | None, weights_only: bool, field: str) -> None:
        """Restore a checkpoint into the state, between BEFORE_LOAD and AFTER_LOAD."""
        self.engine.run_event(Event.BEFORE_LOAD)
        if step is None:  # the newest that reads back intact
            self.resumed_from = checkpointer.restore_newest_valid(self.state, field, weights_only=weights_only,
                                                                  report=_print_error)
        else:
            self.resumed_from = checkpointer.restore(self.state, step, weights_only=weights_only, field=field)
        self.engine.run_event(Event.AFTER_LOAD)

    def _hyperparameters(self, max_duration: Any, save_interval: Any, save_weights_only: bool,
                         time_limit: Any) -> dict[str, Any]:
        """The run's settings as JSON-able values: saved with every checkpoint and logged at FIT_START."""
        state = self.state
        return {
            "run_name": state.run_name,
            "max_duration": None if state.max_duration is None else str(state.max_duration),
            "seed": self._seed,
            "precision": state.precision,
            "optimizer": _describe(state.optimizer),
            "algorithms": [{"name": type(a).__name__, "hparams": _public_settings(a)} for a in state.algorithms],
            "callbacks": [{"name": type(c).__name__, "hparams": _public_settings(c)} for c in state.callbacks],
            "loggers": [type(d).__name__ for d in self._destinations],
            "device_train_microbatch_size": "auto" if self._auto_microbatch else self.microbatch_size,
            "device_memory_budget": self.device_memory_budget,
            "log_interval": self.log_interval,
            "parallelism": self.parallelism if isinstance(self.parallelism, str) else repr(self.parallelism),
            "mesh": dict(self.mesh.shape),
            "devices": int(self.mesh.devices.size),
            "processes": jax.process_count(),
            "eval_interval": None if self.eval_interval is None else str(self.eval_interval),
            "save_interval": str(save_interval),
            "save_weights_only": save_weights_only,
            "time_limit": None if time_limit is None else str(time_limit),
            "skip_nonfinite_updates": state.skip_nonfinite_updates,
            "dataloader_len": state.dataloader_len,
            "versions": _versions(),
        }

    def save_checkpoint(self, wait: bool = False) -> int:
        """Save a checkpoint now into ``save_folder`` (async unless ``wait``); return its batch index.

        With ``wait``, the checkpoint is on disk and verified when this returns.

        Raises:
            CheckpointSaveError: the save was refused or failed (with ``wait``, or for the previous
                async save); a save that did not happen is never returned as done.

        Example::

            trainer.fit('100ba'); trainer.save_checkpoint(wait=True)
        """
        if self.checkpointer is None:
            raise ValueError("save_checkpoint(): Trainer(save_folder=None); pass a save_folder to save")
        step = self.checkpointer.save(self.state, self.hparams)
        if wait:
            self.checkpointer.wait()
        return step

    # -- device state ----------------------------------------------------------------------------
    def _build_device_state(self) -> None:
        state = self.state
        model = state._model
        # INIT may have replaced the model (NoOpModel, wrappers): call whatever model is there now.
        self.functions = model_functions(model, self.loss_fn)
        model.eval()
        eval_graphdef = nnx.split(model, nnx.Param, ...)[0]
        model.train()
        train_graphdef, params, rest = split_model(model)
        names = instance_names(state.algorithms)
        algorithm_state = {}
        for name, algorithm in zip(names, state.algorithms):
            algorithm._state_key = name
            initial = algorithm.init_state(state)
            if initial is not None:
                algorithm_state[name] = initial
        state.algorithm_state = algorithm_state
        state.model_changed = False  # init_state may read state.model; nothing changed it since the split
        state.rng, step_key = jax.random.split(state.rng)
        step_key_data = np.asarray(jax.random.key_data(step_key))
        rest_codec = KeyCodec(rest)
        train_state = {
            "params": params,
            "rest": rest_codec.encode(rest),
            "opt_state": state.optimizer.init(params),
            "algorithm_state": algorithm_state,
            "clock": jnp.asarray([0, self._total_steps()], jnp.int32),
        }
        self._partition_metadata = partition_metadata(model)
        self._train_state_sharding = train_state_shardings(self.mesh, train_state, self.parallelism,
                                                           self._partition_metadata)
        state.shardings = self._train_state_sharding
        state.train_state = jax.device_put(train_state, self._train_state_sharding)
        state._sync_model = self._sync_model
        self._batch_sharding = batch_sharding(self.mesh)
        self.builder = StepBuilder(
            self.engine,
            state,
            self.functions,
            train_graphdef,
            eval_graphdef,
            state.optimizer,
            self.microbatch_size,
            self._train_state_sharding,
            self._batch_sharding,
            replicated(self.mesh),
            rest_codec,
            step_key_data,
        )

    def _sync_model(self) -> None:
        """Merge the device values into ``state.model`` (only when host code reads it)."""
        state = self.state
        train_state = state.train_state
        params, rest = train_state["params"], self.builder.rest_codec.decode(train_state["rest"])
        # The module's variables, found once per model and graph: nnx.update walks the whole graph
        # (milliseconds per fit() call even for a tiny model); setting each variable is microseconds.
        key = (state._model, self.builder.train_graphdef, self.builder.rest_codec)
        cached = self._model_variables
        if cached is None or any(old is not new for old, new in zip(cached[0], key)):
            variables = [(path, node, isinstance(node, nnx.Param))
                         for path, node in nnx.iter_graph(state._model) if isinstance(node, nnx.Variable)]
            self._model_variables = cached = (key, variables)
        try:
            for path, variable, is_param in cached[1]:
                value = params if is_param else rest
                for part in path:
                    value = value[part]
                variable.set_value(value)
        except (KeyError, IndexError, TypeError):  # the graph moved under us: the general route
            self._model_variables = None
            nnx.update(state._model, nnx.State(params), nnx.State(rest))
        state._model_stale = False

    def _refresh_from_model(self) -> None:
        """Host code may have changed ``state.model``: take its values (and graph) into the device state."""
        state = self.state
        state.model_changed = False
        model = state._model
        model.eval()
        eval_graphdef = nnx.split(model, nnx.Param, ...)[0]
        model.train()
        graphdef, params, rest = split_model(model)
        self.builder.rest_codec = KeyCodec(rest)
        rest = self.builder.rest_codec.encode(rest)
        if graphdef != self.builder.train_graphdef:
            self.builder.train_graphdef, self.builder.eval_graphdef = graphdef, eval_graphdef
            self.builder.clear()
        train_state = state.train_state
        if jax.tree.structure(params) != jax.tree.structure(train_state["params"]):
            opt_state = state.optimizer.init(params)
        else:
            opt_state = train_state["opt_state"]
        updated = {**train_state, "params": params, "rest": rest, "opt_state": opt_state}
        self._partition_metadata = partition_metadata(model)
        self._train_state_sharding = train_state_shardings(self.mesh, updated, self.parallelism,
                                                           self._partition_metadata)
        self.builder.train_state_sharding = self._train_state_sharding
        state.train_state = jax.device_put(updated, self._train_state_sharding)

    def _total_steps(self) -> int:
        """Optimizer steps in ``max_duration``, for ``state.progress`` inside the step; 0 if unknown.

        Token and wall-clock durations have no step count known in advance: progress stays 0.
        """
        return self.state.batches_in_duration() or 0

    # -- fit -------------------------------------------------------------------------------------
    def fit(self, duration: Time | str | int | None = None) -> None:
        """Train until ``max_duration``, or, with ``duration``, that much more from where it stands.

        Example: ``trainer.fit()`` then ``trainer.fit('1ep')`` trains one more epoch.
        """
        state = self.state
        if state.dataloader is None:
            raise ValueError("fit(): train_dataloader is None; pass one to Trainer(...)")
        if duration is not None:
            extra = _to_time(duration, "duration")
            now = getattr(state.timestamp, _COUNTER[extra.unit])
            state.max_duration = Time(now + extra.value, extra.unit)
        if state.max_duration is None:
            raise ValueError("fit(): max_duration is None; pass max_duration to Trainer or a duration to fit()")
        # Again here: fit(duration) and a state.max_duration set since __init__ are new run lengths.
        check_run_length(state.max_duration, batches=state.batches_in_duration(),
                         counts_tokens=self.tokens_per_batch is not None,
                         field="duration" if duration is not None else "max_duration", given=duration)
        self._set_total_steps()
        if not self._summarized:
            self._summarized = True
            self._log_run_summary()
        if self._fit_started_at is None:
            self._fit_started_at = time.perf_counter()
        self.stop_reason = None
        self.engine.run_event(Event.FIT_START)
        heartbeat()
        previous_handlers = self._install_signal_handlers()
        self._stop_decision = None
        try:
            self._train_loop()
            self._flush_logs()
            self._stop_now()  # a signal that came during the last batch or the flush still counts
            decision = self._stop_decision
            if self.checkpointer is not None and (decision is not None or self._done()):
                # Nothing lost: the end of training, a time limit or a signal always leaves a checkpoint.
                self.checkpointer.save(state, self.hparams)
            if decision is not None and decision.signum:
                self._exit_on_signal(decision.signum)
        except TrainingInterrupted:
            raise
        except BaseException as error:
            self._finish_saves_after(error)
            raise
        finally:
            _restore_signal_handlers(previous_handlers)
        if self._stop_decision is not None and self._stop_decision.time_limit:
            self.stop_reason = "time_limit"
        # The first step donated the arrays the user's module held: give it the trained ones back
        # (once per fit, not per step), so the caller's own handle on the model stays usable.
        if state._model_stale:
            self._sync_model()
        if self.checkpointer is not None:
            self.checkpointer.wait()
        self.engine.run_event(Event.FIT_END)

    # -- stopping early: signals and the time limit ----------------------------------------------
    def _install_signal_handlers(self) -> dict[int, Any]:
        """Catch SIGTERM and SIGINT for the length of ``fit`` (main thread only)."""
        self._stop_signal = None
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                previous[signum] = signal.signal(signum, self._on_signal)
            except (ValueError, OSError):  # not allowed here (embedded interpreters)
                pass
        return previous

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stop_signal is not None:  # a second signal: stop now, without saving
            raise TrainingInterrupted(signum, saved_batch=None)
        self._stop_signal = signum

    def _stop_now(self) -> bool:
        """After a batch or group: whether training stops here. The same answer on every process.

        It stops when ``max_duration`` is reached, a signal arrived or ``time_limit`` is spent. With
        several processes each one's view is combined (any process's signal, time limit or stop
        stops them all, at the same batch) through the coordination service, so no process waits in
        a collective or a save barrier that another has left.
        """
        heartbeat()  # progress, for `composerjax launch --heartbeat-timeout`
        if self._stop_decision is not None:
            return True
        state = self.state
        duration = state.max_duration
        reached = getattr(state.timestamp, _COUNTER[duration.unit]) >= duration.value
        signum, time_up = self._stop_signal or 0, self._time_is_up()
        if self._multi_process:
            signum, time_up, any_reached = dist.agree_max("composerjax-stop", (signum, int(time_up), int(reached)))
            if any_reached and not reached:  # another process's callback stopped the run
                state.stop_training()
                reached = True
        if signum or time_up:
            self._stop_decision = StopDecision(signum=signum, time_limit=bool(time_up))
            return True
        return bool(reached)

    def _time_is_up(self) -> bool:
        limit = self.time_limit
        return limit is not None and time.perf_counter() - self._fit_started_at >= limit

    def _exit_on_signal(self, signum: int) -> None:
        """Wait for the checkpoint, close callbacks and loggers, and raise TrainingInterrupted."""
        name = signal.Signals(signum).name
        self.stop_reason = name
        saved = None
        if self.checkpointer is not None:
            self.checkpointer.wait()  # raises CheckpointSaveError if the save did not reach the disk
            saved = self.checkpointer.last_saved
            _print(f"{name}: saved checkpoint {saved} in {self.checkpointer.folder}; exiting with status "
                   f"{128 + signum}")
        else:
            _print(f"{name}: no save_folder, so no checkpoint; exiting with status {128 + signum}")
        self.close()
        raise TrainingInterrupted(signum, saved_batch=saved)

    def _finish_saves_after(self, error: BaseException) -> None:
        """``fit`` is failing with ``error``: let the save in flight finish (bounded), then release the folder.

        The original error is the one the caller sees; what happened to the save is one line on
        stderr above it, so orbax's shutdown is never the first (or only) thing a user reads.
        """
        checkpointer = self.checkpointer
        if checkpointer is None:
            return
        pending = checkpointer.in_flight
        try:
            checkpointer.close(timeout_s=ABANDON_SAVE_TIMEOUT_S)
            if pending is not None:
                _print_error(f"composerjax: fit failed ({type(error).__name__}); checkpoint {pending}, in flight, was "
                             f"finished and verified in {checkpointer.folder}")
        except CheckpointSaveError as save_error:
            _print_error(f"composerjax: fit failed ({type(error).__name__}); and {save_error}")

    def _set_total_steps(self) -> None:
        train_state = self.state.train_state
        # One cached compiled call (an eager .at[].set costs milliseconds per fit() call).
        train_state["clock"] = jax.device_put(_with_total_steps(train_state["clock"], self._total_steps()),
                                              self._train_state_sharding["clock"])

    def _done(self) -> bool:
        duration = self.state.max_duration
        # Once per epoch: a callback may have set state.max_duration to tokens the trainer does not count.
        check_run_length(duration, batches=None, counts_tokens=self.tokens_per_batch is not None,
                         field="state.max_duration")
        return getattr(self.state.timestamp, _COUNTER[duration.unit]) >= duration.value

    def _train_loop(self) -> None:
        state, engine = self.state, self.engine
        run_event, active_events = engine.run_event, engine.active
        loader = state.dataloader
        eval_every_batches = self._eval_every(TimeUnit.BATCH)
        eval_every_epochs = self._eval_every(TimeUnit.EPOCH)
        train_batch = self._train_batch
        count_tokens = self.tokens_per_batch
        checkpointer = self.checkpointer
        perf_counter = time.perf_counter
        stop_now = self._stop_now
        save_after_epoch = False
        grouping = self.steps_per_call if self.steps_per_call > 1 and not self._multi_process else 0
        while not self._done():
            if state.timestamp.batch_in_epoch == 0:
                run_event(Event.EPOCH_START)
            epoch_ended = True
            iterator = iter(loader)
            while True:
                # One check, then only the per-batch host events something listens to or may match.
                before_loader, after_loader, batch_start, batch_end, batch_checkpoint = active_events(_BATCH_EVENTS)
                plan = self._group_plan(grouping) if grouping and self._group_room() >= grouping else None
                if plan is not None:
                    if self._train_group(iterator, grouping, plan) is None:
                        break  # the iterator ran dry inside the group
                else:
                    if before_loader:
                        run_event(Event.BEFORE_DATALOADER)
                    try:
                        state.batch = next(iterator)
                    except StopIteration:
                        break
                    if after_loader:
                        run_event(Event.AFTER_DATALOADER)
                    if batch_start:
                        run_event(Event.BATCH_START)
                    start = perf_counter()
                    tokens = count_tokens(state.batch) if count_tokens is not None else 0
                    samples = train_batch()
                    state.timestamp = state.timestamp.to_next_batch(samples, tokens, perf_counter() - start)
                    if batch_end:
                        run_event(Event.BATCH_END)
                    if batch_checkpoint:
                        run_event(Event.BATCH_CHECKPOINT)
                # After a batch or a group alike (a group never crosses a save, an eval or an epoch end).
                timestamp = state.timestamp
                if checkpointer is not None and checkpointer.due(state, TimeUnit.BATCH):
                    if timestamp.batch_in_epoch == state.dataloader_len:
                        save_after_epoch = True  # saved once the epoch is closed: a clean epoch boundary
                    else:
                        checkpointer.save(state, self.hparams)
                if eval_every_batches and timestamp.batch % eval_every_batches == 0:
                    self._eval_during_fit()
                if timestamp.batch_in_epoch == state.dataloader_len:
                    break
                if stop_now():
                    epoch_ended = False
                    break
            if epoch_ended:
                if state.timestamp.batch_in_epoch == 0:
                    raise ValueError("train_dataloader yielded no batches in an epoch")
                self._flush_logs()
                state.timestamp = state.timestamp.to_next_epoch()
                run_event(Event.EPOCH_END)
                run_event(Event.EPOCH_CHECKPOINT)
                if checkpointer is not None and (save_after_epoch or checkpointer.due(state, TimeUnit.EPOCH)):
                    checkpointer.save(state, self.hparams)
                save_after_epoch = False
                if eval_every_epochs and state.timestamp.epoch % eval_every_epochs == 0:
                    self._eval_during_fit()
            if stop_now():
                return

    def _group_room(self) -> int:
        """How many batches can run before something needs the host: epoch end, run end, a save or an eval."""
        state = self.state
        timestamp = state.timestamp
        if self._auto_microbatch or state.model_changed or state.dataloader_len is None:
            return 0
        room = state.dataloader_len - timestamp.batch_in_epoch
        total = state.batches_in_duration() if state.max_duration.unit in (TimeUnit.BATCH, TimeUnit.EPOCH) else None
        if total is None:
            return 0
        room = min(room, total - timestamp.batch)
        intervals = [int(self.checkpointer.interval.value)] if (
            self.checkpointer is not None and self.checkpointer.interval.unit == TimeUnit.BATCH) else []
        if self._eval_every(TimeUnit.BATCH):
            intervals.append(self._eval_every(TimeUnit.BATCH))
        for every in intervals:
            room = min(room, every - timestamp.batch % every)
        return room

    def _group_plan(self, count: int) -> Any:
        """The plan shared by the next ``count`` batches, or None if they cannot run as one call.

        They can when no callback or logger listens to the per-batch host events, no algorithm
        matches one of them at any of those batches, and every batch has the same train-step plan.
        Timestamps are predicted with the last batch's size (a group never crosses an epoch end).
        """
        state, engine = self.state, self.engine
        if engine.has_listeners(_BATCH_EVENTS) or state.batch is None:
            return None
        algorithms = state.algorithms
        if not algorithms:
            return ()
        size = (state.batch[0] if type(state.batch) is tuple else jax.tree.leaves(state.batch)[0]).shape[0]
        saved = state.timestamp
        plans = set()
        try:
            for _ in range(count):
                if any(a.match(e, state) for e in _BATCH_EVENTS[:3] for a in engine.candidates(e)):
                    return None
                plans.add(self.builder.plan_train() if algorithms else ())
                state.timestamp = state.timestamp.to_next_batch(size, 0, 0.0)
                if any(a.match(e, state) for e in _BATCH_EVENTS[3:] for a in engine.candidates(e)):
                    return None
                if len(plans) > 1:
                    return None
        finally:
            state.timestamp = saved
        return plans.pop()

    def _train_group(self, iterator: Any, count: int, plan: Any) -> bool | None:
        """Run ``count`` batches in one compiled call; None if the iterator ended first (those ran singly)."""
        state = self.state
        count_tokens = self.tokens_per_batch
        take = getattr(state.dataloader, "next_stacked", None)
        stacked = take(count) if take is not None else None
        if stacked is not None:  # one gather for the whole group (ArrayLoader)
            leading = jax.tree.leaves(stacked)[0].shape[1]
            sizes = [leading] * count
            if count_tokens is not None:
                tokens = [count_tokens(jax.tree.map(lambda leaf, i=i: leaf[i], stacked)) for i in range(count)]
            else:
                tokens = [0] * count
            self._run_group(stacked, count, plan, sizes, tokens)
            state.batch = jax.tree.map(lambda leaf: leaf[-1], stacked)
            return True
        batches = []
        for _ in range(count):
            try:
                batches.append(next(iterator))
            except StopIteration:
                break
        sizes = [(b[0] if type(b) is tuple else jax.tree.leaves(b)[0]).shape[0] for b in batches]
        tokens = [count_tokens(b) if count_tokens is not None else 0 for b in batches]
        if len(batches) < count or len(set(sizes)) > 1:
            for batch, token_count in zip(batches, tokens):  # a short or ragged group: one step each
                state.batch = batch
                start = time.perf_counter()
                samples = self._train_batch()
                state.timestamp = state.timestamp.to_next_batch(samples, token_count, time.perf_counter() - start)
            return None if len(batches) < count else True
        self._run_group(jax.tree.map(lambda *leaves: np.stack(leaves), *batches), count, plan, sizes, tokens)
        state.batch = batches[-1]
        return True

    def _run_group(self, stacked: Any, count: int, plan: Any, sizes: list[int], tokens: list[int]) -> None:
        """One compiled call over ``count`` stacked batches; time, traces and logs as ``count`` steps."""
        state, builder, engine = self.state, self.builder, self.engine
        first = state.timestamp.batch
        self.functions.check_batch(state._model, stacked, "train_dataloader", f"{first}-{first + count - 1} (stacked)")
        step = builder.train_steps(plan, count)
        compiles, start = state.compile_count, time.perf_counter()
        try:
            state.train_state, losses, metrics, (state.loss, state.step_metrics) = step(state.train_state, stacked)
        except Exception as error:
            self._batch_failed(error, jax.tree.map(lambda leaf: leaf[0], stacked), state.compile_count != compiles)
            raise
        if state.compile_count != compiles:
            self._batch_signature = describe_batch(jax.tree.map(lambda leaf: leaf[0], stacked))
            self._record_compile("train", plan, step, time.perf_counter() - start, state.train_state, stacked)
        first = state.timestamp.batch
        if plan:
            for index in range(count):
                engine.record_plan(plan, first + index)
        state.timestamp = state.timestamp.to_next_batches(count, sum(sizes), sum(tokens), time.perf_counter() - start)
        state._model_stale = True
        if self._destinations:
            self._pending.append((first + 1, losses, metrics, count))
            if len(self._pending) >= 2 * self.log_interval:
                self._flush_logs(self.log_interval)

    def _batch_failed(self, error: Exception, batch: Any, traced: bool) -> None:
        """The step failed on ``batch``: raise a BatchError saying what is wrong with it, or annotate ``error``."""
        index = self.state.timestamp.batch
        problem = diagnose_batch(batch, index, self._batch_signature)
        if problem is not None:
            raise problem from error
        if traced:
            note_batch(error, batch, index)

    def _train_batch(self) -> int:
        """Run one compiled step on ``state.batch``; return its global sample count. No host sync."""
        state, builder = self.state, self.builder
        if state.model_changed:
            self._refresh_from_model()
        plan = builder.plan_train() if state.algorithms else ()
        batch = state.batch
        # Host numpy check before the batch leaves (ComposerClassifier: labels in [0, num_classes)); no device read.
        self.functions.check_batch(state._model, batch, "train_dataloader", state.timestamp.batch)
        if self._auto_microbatch:
            self._choose_microbatch(plan, batch)
        step = builder._train.get(plan) or builder.train_step(plan)
        samples = (batch[0] if type(batch) is tuple else jax.tree.leaves(batch)[0]).shape[0]
        if self._multi_process:
            batch = global_batch(batch, self._batch_sharding)
            samples *= jax.process_count()
        compiles = state.compile_count
        start = time.perf_counter()
        try:
            state.train_state, state.loss, state.step_metrics = step(state.train_state, batch)
        except Exception as error:
            self._batch_failed(error, state.batch, state.compile_count != compiles)
            raise
        if state.compile_count != compiles:
            self._batch_signature = describe_batch(state.batch)
            self._record_compile("train", plan, step, time.perf_counter() - start, state.train_state, batch)
        state._model_stale = True
        if plan:
            self.engine.record_plan(plan, state.timestamp.batch)
        if self._destinations:
            self._pending.append((state.timestamp.batch + 1, state.loss, state.step_metrics, None))
            # Fetch one interval behind the newest step: those values are already computed, so the
            # transfer does not stall the device queue.
            if len(self._pending) >= 2 * self.log_interval:
                self._flush_logs(self.log_interval)
        return samples

    def _choose_microbatch(self, plan: Any, batch: Any) -> None:
        """Pick the largest microbatch whose compiled step fits the memory budget (before any step runs)."""
        self._auto_microbatch = False
        builder, budget = self.builder, self.device_memory_budget
        global_batch_size = jax.tree.leaves(batch)[0].shape[0] * jax.process_count()
        ways = int(np.prod([self.mesh.shape[axis] for axis in ("data", "fsdp")]))
        divisors = [m for m in range(global_batch_size, 0, -1) if global_batch_size % m == 0]
        candidates = [m for m in divisors if m % ways == 0] or divisors
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                self.state.train_state)
        batch_abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((a.shape[0] * jax.process_count(), *a.shape[1:]), a.dtype,
                                           sharding=self._batch_sharding), batch)
        tried = []
        for size in candidates:
            builder.microbatch_size = None if size == global_batch_size else size
            builder.clear()
            stats = builder.train_step(plan).lower(abstract, batch_abstract).compile().memory_analysis()
            need = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
                    + stats.temp_size_in_bytes)
            tried.append({"microbatch_size": size, "bytes": int(need)})
            if need <= budget:
                break
        else:
            raise ValueError(f"device_train_microbatch_size='auto': no microbatch of the {global_batch_size}-sample "
                             f"batch fits device_memory_budget={budget} bytes; the smallest ({candidates[-1]}) needs "
                             f"{tried[-1]['bytes']} bytes")
        self.microbatch_size = builder.microbatch_size
        self.microbatch_candidates = tried
        self.state.run_summary["microbatch_candidates"] = tried

    def _log_run_summary(self) -> None:
        """Log and print the run summary once, before the first FIT_START."""
        state = self.state
        summary: dict[str, Any] = {
            "run_name": state.run_name,
            **parameter_summary(state.train_state["params"]),
            "devices": int(self.mesh.devices.size),
            "platform": jax.devices()[0].platform,
            "precision": state.precision,
            "algorithms": [type(a).__name__ for a in state.algorithms],
            "flops_per_step": None,
        }
        state.run_summary = summary
        if self.run_summary:
            self.logger.log_hyperparameters({f"run_summary/{k}": v for k, v in summary.items()})
            _print(format_summary(summary))

    def _record_compile(self, kind: str, plan: Any, step: Any, seconds: float, *args: Any) -> None:
        """Record (and with run_summary, print) a step variant that was just traced and compiled."""
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None))
                                if hasattr(a, "shape") else a, args)
        record = CompiledStep(
            kind=kind,
            algorithms=tuple(f"{type(a).__name__}/{event.name}" for event, algorithms in plan for a in algorithms),
            batch_shapes=tuple(tuple(leaf.shape) for leaf in jax.tree.leaves(args[-1])),
            compile_seconds=seconds,
            flops=cost_of(step, *abstract),
            memory=memory_of(step, *abstract),
            batch=self.state.timestamp.batch,
        )
        self.state.compiled_steps.append(record)
        if kind == "train" and self.state.run_summary.get("flops_per_step") is None:
            # Tracing the step ahead of FIT_START would run traced events before it: FLOPs come with
            # the first compile instead.
            self.state.run_summary["flops_per_step"] = record.flops
        if self.run_summary:
            self.logger.log_hyperparameters({f"compiled_steps/{len(self.state.compiled_steps) - 1}": record.to_dict()})
            _print(format_compiled(record))

    def _flush_logs(self, count: int | None = None) -> None:
        """Fetch the oldest ``count`` (default: all) pending losses and step metrics in one transfer."""
        if not self._pending:
            return
        count = len(self._pending) if count is None else count
        pending, self._pending = self._pending[:count], self._pending[count:]
        values = jax.device_get([(loss, metrics) for _, loss, metrics, _ in pending])
        for (batch, _, _, group), (loss, metrics) in zip(pending, values):
            rows = [(batch, loss, metrics)] if group is None else [
                (batch + i, loss[i], {name: value[i] for name, value in metrics.items()}) for i in range(group)]
            for step, step_loss, step_metrics in rows:
                row = {"loss/train/total": float(step_loss)}
                row.update({f"train/{name}": float(np.mean(value)) for name, value in step_metrics.items()})
                self.logger.log_metrics(row, step=step)

    # -- eval ------------------------------------------------------------------------------------
    def _eval_every(self, unit: TimeUnit) -> int:
        interval = self.eval_interval
        if self.eval_dataloader is None or interval is None or interval.unit != unit:
            return 0
        return int(interval.value)

    def _eval_during_fit(self) -> None:
        self._flush_logs()
        self.eval()

    def eval(self, eval_dataloader: Iterable[Any] | None = None) -> dict[str, float]:
        """Evaluate on ``eval_dataloader`` (or the trainer's) and return ``{metric: value}``.

        Metrics are summed on the device and fetched once at the end; they are also logged as
        ``metrics/eval/<name>`` and stored in ``state.metrics['eval']``.
        """
        loader = as_batch_iterable(eval_dataloader) if eval_dataloader is not None else self.eval_dataloader
        if loader is None:
            raise ValueError("eval(): no eval_dataloader given to Trainer(...) or to eval()")
        state, engine, builder = self.state, self.engine, self.builder
        if state.model_changed:
            self._refresh_from_model()
        engine.run_event(Event.EVAL_BEFORE_ALL)
        engine.run_event(Event.EVAL_START)
        totals = None
        train_state = state.train_state
        for index, batch in enumerate(_epoch_of(loader)):
            state.batch = batch
            engine.run_event(Event.EVAL_BATCH_START)
            if state.model_changed:
                self._refresh_from_model()
                train_state = state.train_state
            plan = builder.plan_eval()
            step = builder.eval_step(plan)
            self.functions.check_batch(state._model, batch, "eval_dataloader", index)
            if self._multi_process:
                batch = global_batch(batch, self._batch_sharding)
            compiles, start = state.compile_count, time.perf_counter()
            args = (train_state["params"], train_state["rest"], train_state["algorithm_state"], batch)
            sums = step(*args)
            if state.compile_count != compiles:
                self._record_compile("eval", plan, step, time.perf_counter() - start, *args)
            if plan:
                engine.record_plan(plan, state.timestamp.batch)
            totals = sums if totals is None else add_metric_sums(totals, sums)
            engine.run_event(Event.EVAL_BATCH_END)
            heartbeat()
        if totals is None:
            raise ValueError("eval(): the eval dataloader yielded no batches")
        fetched = jax.device_get(totals)
        results = {name: float(total / max(count, 1e-12)) for name, (total, count) in fetched.items()}
        state.metrics["eval"] = results
        self.logger.log_metrics({f"metrics/eval/{name}": value for name, value in results.items()})
        engine.run_event(Event.EVAL_END)
        engine.run_event(Event.EVAL_AFTER_ALL)
        return results

    # -- predict ---------------------------------------------------------------------------------
    def predict(self, dataloader: Iterable[Any]) -> list[Any]:
        """Return the model's outputs for every batch of ``dataloader`` (fetched in one transfer)."""
        loader = as_batch_iterable(dataloader)
        state, engine, builder = self.state, self.engine, self.builder
        if state.model_changed:
            self._refresh_from_model()
        engine.run_event(Event.PREDICT_START)
        outputs = []
        for batch in _epoch_of(loader):
            state.batch = batch
            engine.run_event(Event.PREDICT_BATCH_START)
            if state.model_changed:
                self._refresh_from_model()
            train_state = state.train_state
            plan = builder.plan_predict()
            step = builder.predict_step(plan)
            if self._multi_process:
                batch = global_batch(batch, self._batch_sharding)
            compiles, start = state.compile_count, time.perf_counter()
            args = (train_state["params"], train_state["rest"], train_state["algorithm_state"], batch)
            state.outputs = step(*args)
            if state.compile_count != compiles:
                self._record_compile("predict", plan, step, time.perf_counter() - start, *args)
            if plan:
                engine.record_plan(plan, state.timestamp.batch)
            outputs.append(state.outputs)
            engine.run_event(Event.PREDICT_BATCH_END)
            heartbeat()
        engine.run_event(Event.PREDICT_END)
        return jax.device_get(outputs)

    # -- shutdown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Flush pending logs and close every callback and logger destination."""
        if not self.engine.closed:
            self._flush_logs()
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.engine.close()

    @property
    def compile_count(self) -> int:
        """How many steps (train, eval and predict) have been traced and compiled."""
        return self.state.compile_count


def _refuse_old_checkpoints(checkpointer: Checkpointer) -> None:
    """A new run may not write into a folder that holds another run's checkpoints (nothing lost, nothing mixed)."""
    steps = checkpointer.steps()
    if steps:
        raise ValueError(
            f"save_folder={checkpointer.folder!r} already holds checkpoints {steps} from an earlier run; expected an "
            "empty or new folder. Pass autoresume=True to continue that run, save_overwrite=True to replace its "
            "checkpoints, or a new save_folder")


def _print_error(text: str) -> None:
    """One line on stderr, flushed (reports that must come before an error's traceback)."""
    print(text, file=sys.stderr, flush=True)


def _print(text: str) -> None:
    """Print above any active progress bar instead of through it."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stdout)


def _default_memory_budget(device: jax.Device) -> int:
    """90% of an accelerator's memory limit; CPU has none to read."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        raise ValueError(f"device_train_microbatch_size='auto' on {device.platform} needs "
                         "device_memory_budget=<bytes>: this device reports no memory limit to fit the step into")
    return int(limit * 0.9)


def _to_time_limit(value: Time | str | int | float | None) -> float | None:
    """``time_limit`` in seconds: a wall-clock Time or string ('2h30m', '45m', '90s'), or seconds."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"time_limit={value!r}: expected a wall-clock duration such as '2h30m', '45m' or '90s'")
    try:
        limit = value if isinstance(value, Time) else Time.from_input(value, TimeUnit.SECOND)
    except ValueError as error:
        raise ValueError(f"time_limit={value!r}: {error}") from error
    if limit.unit != TimeUnit.SECOND or limit.value <= 0:
        raise ValueError(f"time_limit={value!r}: expected a positive wall-clock duration such as '2h30m', '45m' or "
                         "'90s'")
    return float(limit.value)


def _restore_signal_handlers(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def _checkpoint_location(path: str) -> tuple[str, int | None]:
    """``(folder, step)`` for a save_folder (newest step) or one checkpoint folder inside it."""
    path = os.path.abspath(path)
    name = os.path.basename(path)
    if name.isdigit() and os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA")):
        return os.path.dirname(path), int(name)
    return path, None


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _public_settings(plugin: Any) -> dict[str, Any]:
    """A plugin's public scalar settings (its hyperparameters, as far as they are JSON values)."""
    settings = {}
    for name, value in vars(plugin).items():
        if name.startswith("_"):
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            settings[name] = value
        elif isinstance(value, (Time, TimeUnit)):
            settings[name] = str(value)
        elif isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str)) for v in value):
            settings[name] = list(value)
    return settings


def _versions() -> dict[str, str]:
    import flax
    import orbax.checkpoint

    from composerjax import __version__

    return {"composerjax": __version__, "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "orbax-checkpoint": getattr(orbax.checkpoint, "__version__", "unknown")}


def _epoch_of(loader: Iterable[Any]) -> Iterable[Any]:
    """One full pass over ``loader``; an ArrayLoader is reset to the start of its epoch first."""
    if hasattr(loader, "set_epoch") and hasattr(loader, "epoch"):
        loader.set_epoch(loader.epoch)
    return iter(loader)


def _to_time(value: Time | str | int | None, field: str) -> Time | None:
    if value is None or isinstance(value, Time):
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{field}={value!r}: expected a Time, a time string such as '10ep' or '500ba', or an "
                         "int (epochs)")
    try:
        return Time.from_input(value, TimeUnit.EPOCH)
    except ValueError as error:
        raise ValueError(f"{field}: {error}") from error


def _as_list(items: Any, kind: type, field: str) -> list[Any]:
    if items is None:
        return []
    if isinstance(items, kind):
        return [items]
    items = list(items)
    for index, item in enumerate(items):
        if not isinstance(item, kind):
            raise TypeError(f"{field}[{index}] is a {type(item).__name__}; expected a {kind.__name__}")
    return items


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


