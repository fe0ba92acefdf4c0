"""The Trainer's settings in five typed sections: run, step, evaluation, checkpoint and stopping.

Every ``Trainer`` keyword argument is one field of one section, declared once with
:func:`~composerjax.core.settings.setting` (type hint, default, doc, check, recipe spelling).
``Trainer(**kwargs)`` builds a :class:`TrainerSettings` from them and nothing else; its
signature and its docstring's argument list, the recipe schema (``--set``), ``hparams`` and
``trainer.to_config()`` are derived from these fields. Adding an option is adding a field here
(or to :class:`~composerjax.checkpoint.settings.CheckpointSettings`), and using it where its
section is read.

Example:
    >>> settings = TrainerSettings.from_arguments({"model": None, "log_interval": 5}, check=False)
    >>> settings.run.log_interval, settings.step.steps_per_call, TrainerSettings.owner("save_folder")
    (5, 'auto', 'checkpoint')
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from composerjax.checkpoint.settings import CheckpointSettings
from composerjax.core.algorithm import Algorithm
from composerjax.core.callback import Callback
from composerjax.core.settings import REQUIRED, Section, default_of, flag, positive_int, setting, setting_fields
from composerjax.core.time import Time
from composerjax.core.validation import as_list, check_seed, loader_length, to_time
from composerjax.loggers.logger import LoggerDestination
from composerjax.trainer.stopping import to_time_limit

if TYPE_CHECKING:
    import jax
    import optax
    from flax import nnx

    from composerjax.core.evaluator import Evaluator
    from composerjax.core.passes import AlgorithmPass
    from composerjax.parallel.strategy import ParallelismConfig

__all__ = ["CheckpointSettings", "EvaluationSettings", "RunSettings", "StepSettings", "StoppingSettings",
           "TrainerSettings", "check_subset"]


# -- checks ---------------------------------------------------------------------------------------
def _module(value: Any, field: str) -> None:
    from flax import nnx

    if not isinstance(value, nnx.Module):
        raise TypeError(f"{field} is a {type(value).__name__}; expected a flax nnx.Module")


def _optimizer(value: Any, field: str) -> None:
    import optax

    if value is not None and not isinstance(value, optax.GradientTransformation):
        raise TypeError(f"{field} is a {type(value).__name__}; expected an optax GradientTransformation")


def _plugins(kind: type) -> Callable[[Any, str], None]:
    def check(value: Any, field: str) -> None:
        as_list(value, kind, field)
    return check


def _seed(value: Any, field: str) -> None:
    check_seed(value, field)


def _time(value: Any, field: str) -> None:
    to_time(value, field)


def _time_limit(value: Any, field: str) -> None:
    to_time_limit(value)


def _parallelism(value: Any, field: str) -> None:
    from composerjax.parallel.strategy import resolve_parallelism

    resolve_parallelism(value)


def _precision(value: Any, field: str) -> None:
    from composerjax.step.precision import compute_dtype

    compute_dtype(value)


def _function(value: Any, field: str) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{field}={value!r}: expected a callable fn(batch) -> int or None")


def _microbatch(value: Any, field: str) -> None:
    if value is not None and value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{field}={value!r}: expected a positive integer, 'auto' or None")


def _steps_per_call(value: Any, field: str) -> None:
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{field}={value!r}: expected a positive integer (batches per call) or 'auto'")


def _prefetch(value: Any, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field}={value!r}: expected a number of batches >= 0 (0: no prefetching)")


def _budget(value: Any, field: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{field}={value!r}: expected a positive number of bytes")


def _cache(value: Any, field: str) -> None:
    if not isinstance(value, (bool, str, os.PathLike)) or value == "":
        raise ValueError(f"{field}={value!r}: expected True (the default folder), a folder path, or False (off)")


def check_subset(value: Any, field: str = "eval_subset_num_batches") -> None:
    """A number of eval batches: positive, or -1 for every batch."""
    if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -1:
        raise ValueError(f"{field}={value!r}: expected a positive number of batches or -1 (every batch)")


# -- the sections ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSettings(Section):
    """What is trained, on what, for how long, on which devices, and what is reported."""

    model: nnx.Module = setting(
        check=_module, positional=True, recipe="sections:model",
        doc="a ``ComposerModel`` (e.g. ``ComposerClassifier``), or a plain ``nnx.Module`` with ``loss_fn``.")
    train_dataloader: Iterable[Any] | None = setting(
        None, positional=True, recipe="sections:data",
        doc="an ``ArrayLoader`` or any re-iterable of numpy/jax pytrees.")
    max_duration: Time | str | int | None = setting(
        None, check=_time, positional=True,
        recipe_default=(REQUIRED, "a recipe describes a whole run, so it says how long (fit() takes no duration "
                                  "from the command line)"),
        doc="how long ``fit`` trains: a Time or a string such as ``'10ep'`` or ``'500ba'``; at most 2**31 - 1 "
            "batches, and ``'tok'`` only with ``tokens_per_batch`` (else refused: it would never end).")
    optimizers: optax.GradientTransformation | None = setting(
        None, check=_optimizer, positional=True, recipe="sections:optimizer,schedule",
        doc="an optax ``GradientTransformation`` (default ``optax.adam(1e-3)`` with its hyperparameters injected, "
            "so the learning rate is logged), e.g. ``DecoupledAdamW``.")
    loss_fn: Callable[..., Any] | None = setting(
        None,
        doc="for plain modules: ``fn(model, batch)`` or ``fn(model, batch, rng, step)`` returning a scalar loss or "
            "``(loss, metrics_dict)``; at eval (its loss and metrics are the eval metrics) ``step`` is None, as "
            "``state.step`` is, and ``rng`` fixed: branch on ``step is None``.")
    algorithms: Algorithm | Sequence[Algorithm] = setting(
        (), check=_plugins(Algorithm), recipe="sections:algorithms", doc="algorithms to compose into training.")
    callbacks: Callback | Sequence[Callback] = setting(
        (), check=_plugins(Callback), recipe="sections:callbacks", doc="callbacks to run at events.")
    loggers: LoggerDestination | Sequence[LoggerDestination] = setting(
        (), check=_plugins(LoggerDestination), recipe="sections:loggers", doc="logger destinations.")
    schedulers: Any = setting(
        None, recipe="absent:Composer scheduler objects exist only in Python; a recipe's `schedule:` section "
                     "(warmup, then cosine, linear or constant decay) builds the learning-rate schedule into the "
                     "optimizer",
        doc="Composer schedulers (``composerjax.optim``: ``CosineAnnealingWithWarmupScheduler``, ...), compiled "
            "into the step as a multiplier of the optimizer's learning rate.")
    scale_schedule_ratio: float = setting(
        1.0, doc="scale ``max_duration`` and the schedulers' times by this ratio.")
    step_schedulers_every_batch: bool | None = setting(
        None, doc="step schedulers every batch (True, the default with schedulers) or at epoch starts only (False).")
    seed: int = setting(
        0, check=_seed,
        doc="seeds ``state.rng`` and the per-step ``state.step_rng``: an integer from 0 to 2**32 - 1 (2**63 - 1 "
            "with ``jax_enable_x64``); others are refused, since JAX would overflow or repeat a smaller seed.")
    run_name: str | None = setting(None, doc="the run's name (defaults to a timestamped one).")
    run_dir: str | None = setting(
        None, doc="the run folder for files callbacks and loggers write (traces, profiles, logs); "
                  "``runs/<run_name>`` by default. Created by whoever writes first.")
    progress_bar: bool = setting(True, doc="show a tqdm progress bar (on terminals).")
    log_interval: int = setting(
        10, check=positive_int("batches"), constraints={"ge": 1},
        doc="hand the loss and step metrics to the loggers every this many batches, fetched in one transfer, one "
            "interval behind the newest step so the device never waits (everything pending is flushed at epoch "
            "end, before eval and at fit end).")
    algorithm_passes: Sequence[AlgorithmPass | tuple[AlgorithmPass, int]] | None = setting(
        None, doc="extra engine passes.")
    devices: str | int | Sequence[int] | Sequence[jax.Device] | None = setting(
        "auto",
        doc="which devices form the mesh: ``'auto'`` (every device of the backend, on every process), a count N "
            "(the first N local devices of each process), a list of local device indices, or a list of "
            "``jax.Device``.")
    parallelism: str | ParallelismConfig = setting(
        "auto", check=_parallelism,
        doc="``'auto'`` or ``'ddp'`` (parameters replicated, the batch split), ``'fsdp'`` (parameters and "
            "optimizer state split on their largest divisible dimension over all devices), or a "
            ":class:`~composerjax.parallel.ParallelismConfig` with mesh axis sizes and tensor-parallel rules. NNX "
            "``with_partitioning`` metadata wins over rules.")
    accelerator: str = setting(
        "auto", doc="``'auto'`` (JAX's default backend), ``'cpu'``, ``'gpu'`` or ``'tpu'``; a request the machine "
                    "cannot satisfy fails here, naming what is available.")
    run_summary: bool = setting(
        True, doc="log and print a run summary at the first FIT_START and one line per compiled step variant "
                  "(compile time, FLOPs, memory); every variant is in ``state.compiled_steps``.")
    auto_log_hparams: bool = setting(
        False, check=flag, doc="log ``trainer.hparams`` (the run's settings) to every logger at the first "
                               "FIT_START, as Composer's ``auto_log_hparams``.")
    tokens_per_batch: Callable[[Any], int] | None = setting(
        None, check=_function,
        doc="``fn(batch) -> int`` counting the tokens of a host batch (e.g. ``lambda batch: batch[0].size`` for "
            "token ids), so ``timestamp.token``, token throughput and ``'tok'`` durations work; tokens are not "
            "counted without it, and a ``'tok'`` max_duration is refused.")
    compilation_cache: str | bool = setting(
        True, check=_cache,
        doc="JAX's persistent compilation cache: True (default) is ``$COMPOSERJAX_CACHE_DIR`` or "
            "``~/.cache/composerjax/jax`` (on from ``import composerjax``; ``COMPOSERJAX_COMPILATION_CACHE=0`` keeps "
            "it off); a path picks the folder; False turns it off.")
    train_subset_num_batches: int = setting(
        -1, check=check_subset,
        doc="end every epoch after this many batches of the train loader (-1: the whole loader; no effect when the "
            "loader is shorter), as Composer's: an ``'ep'`` run, the schedulers' epochs and the loader's position "
            "count these batches.")
    config: Any = setting(
        None, recipe="absent:the recipe itself: build_trainer passes it",
        doc="the ``TrainerConfig`` this run was built from (``build_trainer`` passes it; ``trainer.to_config()`` "
            "starts from it); None for a Trainer built in Python.")

    def batches_per_epoch(self, loader: Any) -> int | None:
        """The batches of one epoch on ``loader``: its length, cut to ``train_subset_num_batches`` (None: unknown).

        Example:
            >>> RunSettings.batches_per_epoch(TrainerSettings.from_arguments(
            ...     {"model": None, "train_subset_num_batches": 3}, check=False).run, range(10))
            3
        """
        length = loader_length(loader)
        subset = self.train_subset_num_batches
        if subset == -1:
            return length
        return subset if length is None else min(subset, length)

    def check(self) -> None:
        """A ``loss_fn`` fits the model (a plain module needs one)."""
        from composerjax.models.function_model import model_functions

        model_functions(self.model, self.loss_fn)


@dataclass(frozen=True)
class StepSettings(Section):
    """How the compiled train step runs: precision, microbatching, batches per call, prefetching."""

    precision: str = setting(
        "fp32", check=_precision,
        doc="``'fp32'``, ``'amp_bf16'`` (bf16 compute, fp32 weights and optimizer state) or ``'bf16'`` (weights, "
            "optimizer state and compute in bf16); ``'amp_fp16'`` is refused.")
    device_train_microbatch_size: int | str | None = setting(
        None, check=_microbatch,
        doc="split each batch into microbatches of this size and accumulate gradients inside the step. ``'auto'`` "
            "picks the largest divisor of the batch whose compiled step fits ``device_memory_budget`` "
            "(``trainer.microbatch_size``).")
    accumulate_train_batch_on_tokens: bool = setting(
        False, check=flag,
        doc="weigh each microbatch by its loss tokens (``model.loss_token_count``, e.g. targets other than -100), "
            "not equally: the gradient is the batch's mean over them (Composer's).")
    steps_per_call: int | Literal["auto"] = setting(
        "auto", check=_steps_per_call, constraints={"ge": 1},
        doc="run this many batches per compiled call whenever nothing needs a per-batch view in between "
            "(``grouping_blocked_by`` names the plugins that do; no epoch end, end of training or plugin's "
            "``next_due`` falls inside the group). ``'auto'`` (the default) groups by up to 32 when the first "
            "compiled step's cost says it is host-bound (``AutoStepsPerCall``: no clock; "
            "``state.run_summary['steps_per_call']`` says why). A grouped step sees exactly what the single step "
            "would; on CPU bit-identical, else equal up to rounding (docs/performance.md). Multi-process: per step.")
    device_prefetch: int = setting(
        2, check=_prefetch, constraints={"ge": 0},
        doc="train batches a thread loads and places on the devices ahead of the step (0: none), started when "
            "producing and placing a batch takes over 1 ms (timed on the first batches; a batch sliced from memory "
            "goes to the step directly). Results, saved loader positions and resumes are the same with and without "
            "it.")
    device_memory_budget: int | None = setting(
        None, check=_budget, constraints={"ge": 1},
        doc="bytes a train step may use, for ``'auto'`` (on GPU/TPU the default is 90% of the device's "
            "``bytes_limit``; CPU has no limit to read, so it must be given).")
    skip_nonfinite_updates: bool = setting(
        False, check=flag,
        doc="inside the compiled step, leave parameters, optimizer, model and algorithm state unchanged when the "
            "loss or any gradient is NaN or infinite (the batch still counts); ``train/skipped_nonfinite`` is 1.0 "
            "for such steps; how many were skipped is in ``state.run_summary['skipped_nonfinite_updates']`` (and a "
            "line) at fit end.")


@dataclass(frozen=True)
class EvaluationSettings(Section):
    """What is evaluated during ``fit``, how often, on how many batches."""

    eval_dataloader: Iterable[Any] | Evaluator | Sequence[Evaluator] | dict[str, Iterable[Any]] | None = setting(
        None, recipe="sections:data",
        doc="a loader, an :class:`~composerjax.core.evaluator.Evaluator`, a list of them or a ``{label: loader}`` "
            "dict; metrics are logged as ``metrics/<label>/<MetricName>``.")
    eval_interval: Time | str | int | Callable[..., bool] | None = setting(
        None,
        doc="how often to evaluate during ``fit``: an int (epochs), a time in any unit (``'1ep'`` default, "
            "``'500ba'``, ``'10000sp'``, ``'0.25dur'``) or a callable ``(state, event) -> bool``; 0 disables. Fit "
            "also evaluates at its end when the last evaluation was not on its last batch (Composer's rule).")
    eval_subset_num_batches: int = setting(
        -1, check=check_subset, doc="evaluate on at most this many batches (-1: all).")


@dataclass(frozen=True)
class StoppingSettings(Section):
    """When ``fit`` stops early, and what a NaN loss or a signal does."""

    time_limit: Time | str | None = setting(
        None, check=_time_limit,
        doc="a wall-clock budget (``'2h30m'``): then ``fit`` finishes the step, saves (with ``save_folder``) and "
            "returns with ``trainer.stop_reason == 'time_limit'``.")
    allow_nonfinite_loss: bool = setting(
        False, check=flag,
        doc="a NaN or infinite loss is expected: no line about the first one "
            "(``state.run_summary['nonfinite_loss']`` has it anyway); ``composerjax train`` exits 0, not 3.")
    handle_signals: bool = setting(
        True, check=flag,
        doc="during ``fit``, SIGTERM/SIGINT finish the step, save (with ``save_folder``), close plugins and raise "
            ":class:`TrainingInterrupted` (exit status ``128 + signal``).")


SECTIONS: dict[str, type[Section]] = {"run": RunSettings, "step": StepSettings, "evaluation": EvaluationSettings,
                                      "checkpoint": CheckpointSettings, "stopping": StoppingSettings}


@dataclass(frozen=True)
class TrainerSettings:
    """A run's five sections. ``Trainer(**kwargs)`` is ``TrainerSettings.from_arguments(kwargs)``, then the build.

    Example:
        >>> TrainerSettings.from_arguments({"model": None, "precision": "bf16"}, check=False).step.precision
        'bf16'
    """

    run: RunSettings
    step: StepSettings
    evaluation: EvaluationSettings
    checkpoint: CheckpointSettings
    stopping: StoppingSettings

    @staticmethod
    def fields() -> dict[str, tuple[str, dataclasses.Field]]:
        """``{argument: (section, field)}`` for every Trainer argument, in signature order."""
        return {f.name: (section, f) for section, kind in SECTIONS.items() for f in setting_fields(kind)}

    @classmethod
    def owner(cls, name: str) -> str:
        """The section that declares argument ``name`` (``'checkpoint'`` for ``'save_folder'``)."""
        return cls.fields()[name][0]

    @classmethod
    def from_arguments(cls, arguments: dict[str, Any], *, check: bool = True) -> TrainerSettings:
        """Route each argument to its section and build (check) the sections; unknown names are refused.

        ``check=False`` skips the checks (the docs' examples, ``explain``'s dry looks).

        Raises:
            TypeError: an argument no section declares, with the closest names; a check's TypeError.
            ValueError: a check's ValueError, naming the field, the value and what is accepted.
        """
        fields = cls.fields()
        unknown = [name for name in arguments if name not in fields]
        if unknown:
            close = difflib.get_close_matches(unknown[0], fields, n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise TypeError(f"Trainer.__init__() got an unexpected keyword argument {unknown[0]!r}{hint}")
        grouped: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for name, value in arguments.items():
            grouped[fields[name][0]][name] = value
        if "model" not in arguments:
            raise TypeError("Trainer.__init__() missing 1 required positional argument: 'model'")
        built = {}
        for section, kind in SECTIONS.items():
            if check:
                built[section] = kind(**grouped[section])
            else:  # frozen dataclasses built without __post_init__'s checks
                obj = object.__new__(kind)
                for f in setting_fields(kind):
                    value = grouped[section].get(f.name, default_of(f))
                    object.__setattr__(obj, f.name, value)
                built[section] = obj
        return cls(**built)

    def arguments(self) -> dict[str, Any]:
        """``{argument: value}``: what the Trainer was given (defaults included), in signature order."""
        return {name: getattr(getattr(self, section), name) for name, (section, _) in self.fields().items()}

    def replace(self, **changes: Any) -> TrainerSettings:
        """A copy with some arguments changed, each section checked again (``settings.replace(seed=3)``)."""
        return TrainerSettings.from_arguments({**self.arguments(), **changes})

    @classmethod
    def signature(cls) -> inspect.Signature:
        """The Trainer's signature: the positional fields first, then every other field keyword-only.

        Example:
            >>> str(TrainerSettings.signature().parameters["log_interval"])
            "log_interval: 'int' = 10"
        """
        parameters = []
        for name, (_, f) in cls.fields().items():
            kind = (inspect.Parameter.POSITIONAL_OR_KEYWORD if f.metadata["positional"]
                    else inspect.Parameter.KEYWORD_ONLY)
            default = default_of(f)
            parameters.append(inspect.Parameter(name, kind, annotation=f.type,
                                                default=inspect.Parameter.empty if default is REQUIRED else default))
        return inspect.Signature(parameters, return_annotation="None")

    @classmethod
    def docstring(cls, indent: str = "        ") -> str:
        """The ``Args:`` lines of every field, for the Trainer's docstring."""
        import textwrap

        lines = []
        for name, (_, f) in cls.fields().items():
            lines += textwrap.wrap(f"{name}: {f.metadata['doc']}", width=112, initial_indent=indent,
                                   subsequent_indent=indent + "    ")
        return "\n".join(lines)
