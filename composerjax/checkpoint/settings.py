"""The checkpoint section: where and how often a run saves, and what it loads at start.

Declared here, beside the code that reads it (:class:`~composerjax.checkpoint.saver.CheckpointSaver`
and :func:`~composerjax.checkpoint.saver.load_at_start`); the Trainer takes every field as a keyword
argument of the same name, and a recipe as a field of its own.

Example:
    >>> CheckpointSettings(save_folder="runs/x/checkpoints", save_interval="100ba").save_num_checkpoints_to_keep
    -1
    >>> CheckpointSettings(autoresume=True)
    Traceback (most recent call last):
    ...
    ValueError: autoresume=True needs save_folder: the folder to resume from
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from composerjax.checkpoint.load import LoadOptions
from composerjax.checkpoint.storage import is_remote, storage_for
from composerjax.checkpoint.writer import check_template
from composerjax.core.settings import Section, flag, optional_path, setting
from composerjax.core.time import Time, TimeUnit

__all__ = ["DEFAULT_FILENAME", "DEFAULT_LATEST", "DEFAULT_SAVE_INTERVAL", "KEEP_ALL", "CheckpointSettings",
           "check_keep", "save_interval_of"]

#: The name template of checkpoints (``save_filename``): Composer's ``'ep{epoch}-ba{batch}-rank{rank}.pt'``
#: without the rank (every process writes its part of one orbax folder) or a file extension (a folder).
DEFAULT_FILENAME = "ep{epoch}-ba{batch}"
#: The link to the newest verified checkpoint (``save_latest_filename``), one for all processes.
DEFAULT_LATEST = "latest"
#: How often a run saves unless told (``save_interval``).
DEFAULT_SAVE_INTERVAL = "1ep"
#: ``save_num_checkpoints_to_keep`` that keeps every checkpoint.
KEEP_ALL = -1


def check_keep(value: Any, field: str = "save_num_checkpoints_to_keep") -> None:
    """A number of checkpoints to keep: a positive integer, or -1 for all (the one check of it)."""
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ValueError(f"{field}={value!r}: expected a positive integer, or -1 to keep all")


def save_interval_of(value: Time | str | int, field: str = "save_interval") -> Time:
    """``save_interval`` as a Time: a positive number of epochs or batches (an int counts epochs).

    Example:
        >>> save_interval_of("100ba")
        Time(100, TimeUnit.BATCH)
    """
    if isinstance(value, bool):
        raise ValueError(f"{field}={value!r}: expected a positive number of epochs or batches, e.g. '1ep'")
    try:
        interval = value if isinstance(value, Time) else Time.from_input(value, TimeUnit.EPOCH)
    except ValueError as error:
        raise ValueError(f"{field}={value!r}: {error}") from error
    if interval.unit not in (TimeUnit.EPOCH, TimeUnit.BATCH) or interval.value < 1:
        raise ValueError(f"{field}={value!r}: expected a positive number of epochs or batches, e.g. "
                         "'1ep' or '500ba'")
    return interval


def _check_interval(value: Any, field: str) -> None:
    save_interval_of(value, field)


def _check_template(value: Any, field: str) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{field}={value!r}: expected a name template such as 'ep{{epoch}}-ba{{batch}}'")
    check_template(value, field)


def _check_latest(value: Any, field: str) -> None:
    if value is not None:
        if not isinstance(value, str):
            raise ValueError(f"{field}={value!r}: expected a link name such as 'latest', or None")
        check_template(value, field, one_per_run=False)


def _check_ignore_keys(value: Any, field: str) -> None:
    LoadOptions(ignore_keys=value)  # the load options' own check, naming the field


def _check_names(value: Any, field: str) -> None:
    LoadOptions(exclude_algorithms=value)


@dataclass(frozen=True)
class CheckpointSettings(Section):
    """Saving during ``fit`` (``save_*``), loading at start (``load_*``) and ``autoresume``."""

    save_folder: str | None = setting(
        None, check=optional_path,
        doc="save checkpoints (orbax, async) into this folder; none when None.")
    save_interval: Time | str = setting(
        DEFAULT_SAVE_INTERVAL, check=_check_interval, doc="how often to save: ``'1ep'``, ``'500ba'``.")
    save_num_checkpoints_to_keep: int = setting(
        KEEP_ALL, check=check_keep, doc="keep the newest N checkpoints (-1 keeps all).")
    save_weights_only: bool = setting(
        False, check=flag,
        doc="save only the model's variables (for fine-tuning or serving; such a checkpoint cannot resume a run).")
    save_overwrite: bool = setting(
        False, check=flag,
        doc="let this run replace checkpoints another run left in ``save_folder`` (else such a folder is refused, "
            "unless ``autoresume``); a live run's folder is always refused.")
    save_filename: str = setting(
        DEFAULT_FILENAME, check=_check_template,
        doc="each checkpoint's folder name, a template as Composer's (``'ep{epoch}-ba{batch}'`` gives ``ep1-ba8``; "
            "also ``{sample}``, ``{token}``, ``{run_name}``, ``{rank}``, ...).")
    save_latest_filename: str | None = setting(
        DEFAULT_LATEST, check=_check_latest,
        doc="a symlink in ``save_folder`` to the newest verified checkpoint; None for none.")
    load_path: str | None = setting(
        None, check=optional_path,
        doc="load at start: a ``save_folder`` (its newest checkpoint) or one checkpoint's folder inside it "
            "(``'runs/x/checkpoints/ep3-ba1200'``). Checked against the run first: a checkpoint that does not fit "
            "the model, optimizer or algorithms raises "
            ":class:`~composerjax.checkpoint.checkpointer.CheckpointMismatchError` listing every difference.")
    load_weights_only: bool = setting(
        False, check=flag,
        doc="from ``load_path`` take only the model's variables; time, optimizer and algorithm state start fresh.")
    load_strict_model_weights: bool = setting(
        True, check=flag,
        doc="model names and shapes must match the checkpoint's exactly; False loads the weights both have and "
            "warns about the rest.")
    load_ignore_keys: list[str] | Callable[[dict], None] | None = setting(
        None, check=_check_ignore_keys,
        doc="Composer state-dict paths not loaded (globs: ``['state/optimizers/*', 'rng']``), or "
            "``fn(state_dict)`` that edits it first (docs/checkpointing.md has the paths).")
    load_exclude_algorithms: list[str] | None = setting(
        None, check=_check_names,
        doc="algorithm class names whose saved state is neither loaded nor compared.")
    autoresume: bool = setting(
        False, check=flag,
        doc="continue from the newest complete checkpoint in ``save_folder`` that reads back intact (then "
            "``load_path`` is ignored); corrupt ones are skipped, each named on stderr.")

    def check(self) -> None:
        """``autoresume`` needs a ``save_folder`` and full checkpoints; ``load_path`` exists (or is a bucket)."""
        if self.autoresume and self.save_folder is None:
            raise ValueError("autoresume=True needs save_folder: the folder to resume from")
        if self.autoresume and self.save_weights_only:
            raise ValueError("autoresume=True needs full checkpoints, but save_weights_only=True saves only the "
                             "model's variables; drop one of them")
        if self.save_folder is not None:
            storage_for(self.save_folder, "save_folder")  # an unsupported URI scheme fails now, not at the first save
        value = self.load_path
        if value is not None and is_remote(value):
            storage_for(value, "load_path")  # an unsupported scheme (ftp://) is refused now; a bucket is read at load
        elif value is not None and not os.path.exists(value):
            raise FileNotFoundError(f"load_path={os.fspath(value)!r} does not exist; expected a save_folder or one "
                                    "checkpoint folder inside it")
