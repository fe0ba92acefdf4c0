"""Composer's ``Trainer`` arguments this Trainer does not take, each with what to use instead.

One table, :data:`INSTEAD`, read by the error for an argument the Trainer does not know
(``Trainer(device='cpu')``) and listed in docs/migrating-from-composer.md (a test keeps the two
equal, and checks that every name of :data:`COMPOSER_TRAINER_ARGUMENTS` is either accepted by
``Trainer.__init__`` or in the table).

Example:
    >>> print(unknown_arguments_message("Trainer", {"device": "cpu"}, ["accelerator", "devices"]))
    Trainer(device='cpu'): device= is Composer's argument; here use accelerator='auto', 'cpu', 'gpu' or 'tpu' \
(and devices= for which devices, or how many)
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

__all__ = ["COMPOSER_TRAINER_ARGUMENTS", "INSTEAD", "refuse_unknown_arguments", "unknown_arguments_message"]

#: Composer's ``Trainer.__init__`` arguments, in its order (mosaicml/composer, composer/trainer/trainer.py,
#: commit 6405188805a0 of 2026-04-29).
COMPOSER_TRAINER_ARGUMENTS = (
    "model", "train_dataloader", "train_dataloader_label", "train_subset_num_batches", "spin_dataloaders",
    "max_duration", "algorithms", "algorithm_passes", "optimizers", "schedulers", "scale_schedule_ratio",
    "step_schedulers_every_batch", "eval_dataloader", "eval_interval", "eval_subset_num_batches", "callbacks",
    "loggers", "run_name", "progress_bar", "log_to_console", "console_stream", "console_log_interval", "log_traces",
    "auto_log_hparams", "load_path", "load_object_store", "load_weights_only", "load_strict_model_weights",
    "load_progress_bar", "load_ignore_keys", "load_exclude_algorithms", "save_folder", "save_filename",
    "save_latest_filename", "save_overwrite", "save_interval", "save_weights_only", "save_ignore_keys",
    "save_num_checkpoints_to_keep", "save_metrics", "autoresume", "parallelism_config", "device", "precision",
    "precision_config", "device_train_microbatch_size", "accumulate_train_batch_on_tokens", "seed",
    "deterministic_mode", "dist_timeout", "ddp_sync_strategy", "profiler", "python_log_level", "compile_config",
)

#: Composer's Trainer arguments not taken here -> what to use instead (Markdown: the docs list it as written).
INSTEAD: dict[str, str] = {
    "train_dataloader_label": "drop it: train metrics are always logged under the label `train` "
                              "(`metrics/train/<Name>`)",
    "spin_dataloaders": "drop it: a checkpoint holds the train loader's position (its `state_dict()`), and a "
                        "resumed run continues from there",
    "log_to_console": "`loggers=[ConsoleLogger()]`",
    "console_stream": "`loggers=[ConsoleLogger(stream=...)]`",
    "console_log_interval": "`loggers=[ConsoleLogger(interval=N)]` (every N batches)",
    "log_traces": "`callbacks=[TraceRecorder()]` writes the traces to the run folder; `trainer.engine.trace_log` "
                  "holds them in memory",
    "load_object_store": "`load_path='s3://bucket/path'` (or `gs://`): the object store is part of the path",
    "load_progress_bar": "drop it: there is no download progress bar",
    "save_ignore_keys": "drop it: a checkpoint holds the whole state; leave keys out when loading, with "
                        "`load_ignore_keys`",
    "save_metrics": "drop it: checkpoints hold no metric values; `trainer.eval()` computes them again",
    "parallelism_config": "`parallelism='ddp'`, `'fsdp'` or a `ParallelismConfig(...)`",
    "device": "`accelerator='auto'`, `'cpu'`, `'gpu'` or `'tpu'` (and `devices=` for which devices, or how many)",
    "precision_config": "drop it (Composer's FP8 settings): `precision=` takes `'fp32'`, `'amp_bf16'` or `'bf16'`",
    "deterministic_mode": "drop it: there is no such switch; on GPU, set `XLA_FLAGS=--xla_gpu_deterministic_ops=true` "
                          "before JAX starts",
    "dist_timeout": "drop it: `composerjax launch --heartbeat-timeout SECONDS` stops a job whose process makes no "
                    "progress",
    "ddp_sync_strategy": "drop it: gradients are reduced across devices inside the compiled step",
    "profiler": "`callbacks=[Profiler(skip_first=..., active=..., trace_dir=...)]` (a `jax.profiler` trace)",
    "python_log_level": "drop it: set the level with Python's `logging` (`logging.basicConfig(level=...)`)",
    "compile_config": "drop it: every step is compiled with `jax.jit`; `compilation_cache=` sets the persistent "
                      "compilation cache",
}

_Init = TypeVar("_Init", bound=Callable[..., Any])


def unknown_arguments_message(call: str, given: Mapping[str, Any], accepted: Iterable[str]) -> str:
    """The message for keyword arguments ``call`` does not take: what to use instead of Composer's, close names.

    Example:
        >>> unknown_arguments_message("Trainer", {"max_duraton": "1ep"}, ["max_duration", "seed"])
        "Trainer(max_duraton='1ep'): unknown argument max_duraton=; did you mean max_duration=?"
    """
    accepted = list(accepted)
    parts = []
    for name in given:
        if name in INSTEAD:
            parts.append(f"{name}= is Composer's argument; here use {INSTEAD[name].replace('`', '')}")
            continue
        close = difflib.get_close_matches(name, accepted, n=3)
        hint = f"; did you mean {' or '.join(f'{match}=' for match in close)}?" if close else \
            f"; see help({call}) for the arguments it takes"
        parts.append(f"unknown argument {name}={hint}")
    shown = ", ".join(f"{name}={value!r}" for name, value in given.items())
    return f"{call}({shown}): " + "; ".join(parts)


def refuse_unknown_arguments(init: _Init) -> _Init:
    """Wrap a class's ``__init__`` so an unknown keyword argument is a TypeError saying what to pass instead.

    The signature (``inspect.signature``, type hints) stays ``init``'s. Positional arguments and
    known keywords go straight to ``init``.

    Example:
        >>> class Run:
        ...     @refuse_unknown_arguments
        ...     def __init__(self, accelerator: str = "auto") -> None:
        ...         self.accelerator = accelerator
        >>> Run(device="cpu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: Run(device='cpu'): device= is Composer's argument; here use accelerator='auto', ...
    """
    parameters = inspect.signature(init).parameters
    accepted = frozenset(name for name, parameter in parameters.items() if name != "self" and parameter.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))
    call = init.__qualname__.rsplit(".", 1)[0]

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        unknown = {name: value for name, value in kwargs.items() if name not in accepted}
        if unknown:
            raise TypeError(unknown_arguments_message(call, unknown, sorted(accepted)))
        return init(self, *args, **kwargs)

    return checked  # type: ignore[return-value]
