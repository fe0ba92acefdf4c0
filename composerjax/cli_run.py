"""A run's folder as the subcommands read it: its files, recipe, newest checkpoint and model.

``composerjax train`` leaves ``recipe.yaml`` there (``cli_generate.write_run_recipe``), the
``TraceRecorder`` ``traces.jsonl`` and a ``FileLogger`` ``metrics.jsonl``; ``traces`` and ``plot``
read the files, ``generate`` and ``export`` rebuild the model and load its weights. Problems are
:class:`~composerjax.cli_common.UsageError` naming the folder, file or field.

Example:
    >>> run_file("/no/such/run", TRACES_FILE, "traces")
    Traceback (most recent call last):
    ...
    composerjax.cli_common.UsageError: /no/such/run: no such run folder
"""

from __future__ import annotations

import json
import os
from typing import Any

from composerjax.cli_common import UsageError

__all__ = ["METRICS_FILE", "RECIPE_FILE", "TRACES_FILE", "load_model_weights", "load_weights", "model_after_init",
           "read_jsonl", "run_file", "run_recipe", "save_folder"]

#: What the ``TraceRecorder`` callback writes in a run folder (read by ``composerjax traces``).
TRACES_FILE = "traces.jsonl"
#: What ``FileLogger(os.path.join(run_dir, 'metrics.jsonl'))`` writes (read by ``composerjax plot``).
METRICS_FILE = "metrics.jsonl"
#: The recipe a run ran, in its run folder (written by ``composerjax train``, read by ``composerjax generate``).
RECIPE_FILE = "recipe.yaml"


# -- files ----------------------------------------------------------------------------------------
def run_file(run: str, file_name: str, what: str) -> str:
    """The path of ``file_name`` in run folder ``run`` (or ``run`` itself when it is that file)."""
    if os.path.isfile(run):
        return run
    if not os.path.isdir(run):
        raise UsageError(f"{run}: no such run folder")
    path = os.path.join(run, file_name)
    if not os.path.isfile(path):
        hint = {"traces": "record it with composerjax.callbacks.trace_recorder.TraceRecorder",
                "metrics": "write it with composerjax.loggers.FileLogger(os.path.join(run_dir, 'metrics.jsonl'))"}
        raise UsageError(f"{run} has no {file_name} ({hint[what]})")
    return path


def read_jsonl(path: str) -> list[tuple[str, int, dict[str, Any]]]:
    """``(path, line number, object)`` for each non-blank line of a JSON-lines file, resume markers left out."""
    from composerjax.loggers.jsonl_resume import is_resume_marker  # {"resumed_from": ..., "batch": N} lines

    records = []
    try:
        with open(path, encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise UsageError(f"{path}:{number}: not a JSON line ({error.msg})") from None
                if not isinstance(record, dict):
                    raise UsageError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
                if not is_resume_marker(record):
                    records.append((path, number, record))
    except OSError as error:
        raise UsageError(f"{path}: cannot read: {error.strerror}") from None
    return records


# -- recipe, checkpoint and model ------------------------------------------------------------------
def run_recipe(run_dir: str) -> Any:
    """The validated recipe in ``run_dir``; a missing folder or file, or a recipe with problems -> UsageError."""
    from composerjax.trainer.config import ConfigError, load_config

    if not os.path.isdir(run_dir):
        raise UsageError(f"{run_dir}: no such run folder")
    path = os.path.join(run_dir, RECIPE_FILE)
    if not os.path.isfile(path):
        raise UsageError(f"{run_dir} has no {RECIPE_FILE}: the run was not started with 'composerjax train' (which "
                         "writes the recipe it runs there); without it the model cannot be rebuilt")
    try:
        return load_config(path)
    except ConfigError as error:
        raise UsageError(str(error)) from None


def save_folder(config: Any, run_dir: str) -> str:
    """The run's ``save_folder`` as the Trainer formats it: ``'{run_name}/checkpoints'`` -> ``'my-run/checkpoints'``."""
    from composerjax.checkpoint.writer import format_name
    from composerjax.core.time import Timestamp

    folder = config.save_folder
    if folder is None:
        raise UsageError(f"{os.path.join(run_dir, RECIPE_FILE)} has no save_folder, so the run saved no checkpoint; "
                         "pass --checkpoint PATH")
    folder = os.fspath(folder)
    if "{" in folder:
        run_name = config.run_name or os.path.basename(os.path.normpath(run_dir))
        try:
            folder = format_name(folder, Timestamp(), run_name, "save_folder", path=True)
        except ValueError as error:
            raise UsageError(str(error)) from None
    return folder


def load_weights(model: Any, path: str, field: str) -> tuple[Any, int]:
    """:func:`load_model_weights` for a subcommand: a missing, mismatched or corrupt checkpoint -> UsageError."""
    from composerjax.checkpoint.checkpointer import CheckpointCorruptError, CheckpointMismatchError

    try:
        return load_model_weights(model, path, field)
    except FileNotFoundError as error:
        raise UsageError(f"no checkpoint found: searched {path!r} ({error})") from None
    except (CheckpointMismatchError, CheckpointCorruptError) as error:
        raise UsageError(str(error)) from None


def load_model_weights(model: Any, path: str, field: str = "load_path") -> tuple[Any, int]:
    """``(model with the checkpoint's weights, the batch it recorded)``; no Trainer, data or optimizer needed.

    ``path`` is what ``Trainer(load_path=...)`` takes: a save folder (its newest checkpoint that reads
    back intact), one checkpoint's folder, or its ``latest`` link. The checkpoint is read as
    ``load_weights_only=True`` reads it: names and shapes checked against ``model``'s, checksums
    verified. ``model`` is the module the Trainer trained (e.g. the ``ComposerClassifier`` a model
    factory returns); a new module is returned and ``model`` is left as it was.

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (the message names the folder searched).
        CheckpointMismatchError: the checkpoint's arrays do not fit ``model`` (every difference listed).
        CheckpointCorruptError: no checkpoint there reads back as written.

    Example::

        model, batch = load_model_weights(gpt2("gpt2-tiny"), "runs/my-run/checkpoints")
    """
    import jax.numpy as jnp

    from composerjax.checkpoint.checkpointer import Checkpointer
    from composerjax.checkpoint.saver import checkpoint_location
    from composerjax.core.state import State
    from composerjax.core.train_state import TrainState
    from composerjax.step.builder import merge_model, split_model
    from composerjax.step.keys import KeyCodec

    folder, name = checkpoint_location(os.fspath(path))
    graphdef, params, rest = split_model(model)
    codec = KeyCodec(rest)
    state = State(model=model)
    state.train_state = TrainState(params=params, rest=codec.encode(rest), opt_state=(), algorithm_state={},
                                   clock=jnp.zeros(2, jnp.int32))
    loader = Checkpointer(folder, async_save=False)
    try:
        if name is None:
            batch = loader.restore_newest_valid(state, field, weights_only=True)
        else:
            batch = loader.restore(state, name, weights_only=True, field=field)
    finally:
        loader.close()
    loaded = state.train_state
    return merge_model(graphdef, loaded.params, codec.decode(loaded.rest)), batch


def model_after_init(config: Any) -> Any:
    """The recipe's model, untrained, after the recipe's algorithms' surgery at ``Event.INIT``.

    A checkpoint of a run whose algorithms changed the model at INIT (``LoRA``,
    ``GatedLinearUnits``, ``Alibi``) holds the changed model's arrays: this is the model they fit.
    No optimizer, data, loggers or callbacks are built.

    Raises:
        UsageError: the recipe's model or an algorithm cannot be built (the message names the field).
    """
    from composerjax.core.engine import Engine
    from composerjax.core.event import Event
    from composerjax.core.state import State
    from composerjax.loggers.logger import Logger
    from composerjax.trainer.config import ConfigError, instantiate

    try:
        model = instantiate("models", config.model)
        algorithms = [instantiate("algorithms", spec, f"algorithms[{index}].{spec.name}")
                      for index, spec in enumerate(config.algorithms)]
    except ConfigError as error:
        raise UsageError(str(error)) from None
    if algorithms:
        state = State(model=model, algorithms=algorithms)
        engine = Engine(state, logger=Logger(state))
        engine.events_check = "off"
        engine.run_event(Event.INIT)
        model = state.model
    return model
