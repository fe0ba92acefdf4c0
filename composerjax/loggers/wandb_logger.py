"""WandBLogger: log metrics, hyperparameters, images, tables and checkpoint files to Weights & Biases."""

from __future__ import annotations

import os
import re
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from composerjax.loggers.images import to_uint8
from composerjax.loggers.logger import LoggerDestination, closing_outcome, is_process_zero
from composerjax.parallel.dist import process_count, process_index

if TYPE_CHECKING:
    from composerjax.core.state import State
    from composerjax.loggers.logger import Logger

__all__ = ["WandBLogger"]


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as error:
        raise ImportError("WandBLogger needs the wandb package, which is not installed: "
                          "pip install 'composerjax[wandb]'") from error
    return wandb


class WandBLogger(LoggerDestination):
    """Log to `Weights & Biases <https://wandb.ai/>`_: one W&B run per Trainer, started at INIT.

    What goes where: metrics are ``run.log(metrics, step=batch)`` (the step is the batch count, as
    the Trainer logs it); hyperparameters update ``run.config`` (nested dicts stay nested); images
    are lists of ``wandb.Image`` under their name; tables are ``wandb.Table``; with
    ``log_artifacts=True`` every file or folder handed to :meth:`upload_file` (checkpoints) becomes a
    W&B artifact with the aliases ``latest`` and ``ep{epoch}-ba{batch}``.

    The run is finished (``run.finish``) when the Trainer closes: ``trainer.close()``, the end of a
    ``with`` block, or interpreter exit for a Trainer never closed; a ``fit`` that returns leaves it
    open, so a later ``fit()`` or ``eval()`` logs into the same run. Its exit code is 0; 1 when
    ``fit`` failed or the Trainer is closed while an exception is handled; ``128 + signal`` when
    SIGTERM/SIGINT stopped ``fit``. W&B has no flush for a running run: it keeps the newest step's
    row open until a later step arrives (an ``eval()`` at the same step joins it) and its service
    writes the offline ``.wandb`` file periodically and at finish, so :meth:`flush` does nothing.

    W&B itself reads its usual settings: ``WANDB_MODE=offline`` (or ``init_kwargs={'mode': 'offline'}``)
    writes the run under ``<dir>/wandb/offline-run-*`` with no account and no network; ``wandb sync``
    uploads it later. ``WANDB_MODE=disabled`` turns the logger into a no-op.

    Args:
        project: the W&B project.
        group: the W&B group.
        name: the W&B run name; by default the Trainer's ``run_name``.
        entity: the W&B entity (user or team).
        tags: the W&B tags.
        log_artifacts: upload files handed to :meth:`upload_file` (checkpoints) as W&B artifacts.
        rank_zero_only: log only on process 0. With False every process starts its own run, named
            ``<name>-rank<process index>`` and grouped under ``<name>`` unless ``group`` is given.
        init_kwargs: more arguments for ``wandb.init`` (``mode``, ``dir``, ``config``, ``settings``
            ...); the named arguments above take precedence.

    Raises:
        ImportError: wandb is not installed (``pip install 'composerjax[wandb]'``).

    Example::

        trainer = Trainer(model, loader, max_duration="2ep", run_dir="runs/a",
                          loggers=[WandBLogger(project="digits", init_kwargs={"mode": "offline"})])
        with trainer:      # the W&B run is finished with the block
            trainer.fit()
    """

    def __init__(self, project: str | None = None, group: str | None = None, name: str | None = None,
                 entity: str | None = None, tags: list[str] | None = None, log_artifacts: bool = False,
                 rank_zero_only: bool = True, init_kwargs: dict[str, Any] | None = None) -> None:
        for argument, value in (("project", project), ("group", group), ("name", name), ("entity", entity)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"WandBLogger({argument}={value!r}): expected a string or None")
        if tags is not None and (isinstance(tags, str) or not all(isinstance(tag, str) for tag in tags)):
            raise ValueError(f"WandBLogger(tags={tags!r}): expected a list of strings or None")
        for argument, value in (("log_artifacts", log_artifacts), ("rank_zero_only", rank_zero_only)):
            if not isinstance(value, bool):
                raise ValueError(f"WandBLogger({argument}={value!r}): expected True or False")
        if init_kwargs is not None and not isinstance(init_kwargs, dict):
            raise ValueError(f"WandBLogger(init_kwargs={init_kwargs!r}): expected a dict of wandb.init arguments "
                             "or None")
        _import_wandb()
        self.project, self.group, self.name, self.entity = project, group, name, entity
        self.tags = None if tags is None else list(tags)
        self.log_artifacts = log_artifacts
        self.rank_zero_only = rank_zero_only
        self.init_kwargs = init_kwargs
        self.run: Any = None
        #: The run's local folder of files (``run.dir``) and its web page (None offline), once started.
        self.run_dir: str | None = None
        self.run_url: str | None = None
        self._enabled: bool | None = None  # decided when the run would start: process 0, or every process
        self._failed = False

    def _wandb_init_kwargs(self, run_name: str | None) -> dict[str, Any]:
        kwargs = dict(self.init_kwargs or {})
        for key in ("project", "group", "name", "entity", "tags"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        if kwargs.get("name") is None and run_name is not None:
            kwargs["name"] = run_name
        if "mode" not in kwargs and os.environ.get("WANDB_MODE"):
            # W&B reads its environment once per process; WANDB_MODE set later still counts for this run.
            kwargs["mode"] = os.environ["WANDB_MODE"]
        if not self.rank_zero_only and kwargs.get("name") is not None:
            kwargs.setdefault("group", kwargs["name"])
            kwargs["name"] = f"{kwargs['name']}-rank{process_index()}"
        return kwargs

    def _start(self, run_name: str | None) -> None:
        self._enabled = not self.rank_zero_only or is_process_zero()
        if not self._enabled:
            return
        if self.log_artifacts and self.rank_zero_only and process_count() > 1:
            warnings.warn("WandBLogger(log_artifacts=True, rank_zero_only=True): only process 0 uploads files; "
                          "pass rank_zero_only=False to keep every process's files", stacklevel=3)
        wandb = _import_wandb()
        self.run = wandb.init(**self._wandb_init_kwargs(run_name))
        self.run_dir = getattr(self.run, "dir", None)
        get_url = getattr(self.run, "get_url", None)
        self.run_url = get_url() if callable(get_url) else None

    def _active_run(self) -> Any:
        """The W&B run, started on first use outside a Trainer; None on processes that do not log."""
        if self._enabled is None:
            self._start(None)
        return self.run

    def init(self, state: State, logger: Logger) -> None:
        if self._enabled is None:
            self._start(state.run_name)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        run = self._active_run()
        if run is not None:
            run.log(dict(metrics), step=step)  # wandb.log adds keys to the dict it gets: a copy

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        run = self._active_run()
        if run is not None:
            # A later call may log a new value for a name (Composer's wandb.config.update would raise).
            run.config.update(hyperparameters, allow_val_change=True)

    def log_images(self, images: np.ndarray, name: str, step: int | None = None) -> None:
        run = self._active_run()
        if run is not None:
            wandb = _import_wandb()
            pictures = [wandb.Image(_plain_image(image)) for image in images]
            run.log({name: pictures}, step=step)

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str, step: int | None = None) -> None:
        run = self._active_run()
        if run is not None:
            wandb = _import_wandb()
            run.log({name: wandb.Table(columns=columns, data=rows)}, step=step)

    def can_upload_files(self) -> bool:
        """Whether :meth:`upload_file` stores files (True: as W&B artifacts, with ``log_artifacts=True``)."""
        return True

    def upload_file(self, state: State, remote_file_name: str, file_path: str | os.PathLike[str], *,
                    overwrite: bool = False) -> None:
        """Log ``file_path`` (a file, or a folder such as an orbax checkpoint) as the artifact ``remote_file_name``.

        Does nothing unless ``log_artifacts=True``. W&B keeps every version of an artifact, so
        ``overwrite`` has no effect. Characters W&B does not allow in artifact names (anything but
        letters, digits, ``-``, ``_`` and ``.``) become ``.``, with a warning.

        Args:
            state: the training state (its timestamp names the version and fills the metadata).
            remote_file_name: the artifact's name.
            file_path: the file or folder to upload.
            overwrite: accepted for Composer's signature; W&B versions artifacts instead.

        Raises:
            FileNotFoundError: ``file_path`` does not exist.
        """
        del overwrite  # W&B artifacts are versioned, never replaced
        if not self.log_artifacts:
            return
        run = self._active_run()
        if run is None:
            return
        path = os.path.abspath(os.fspath(file_path))
        if not os.path.exists(path):
            raise FileNotFoundError(f"WandBLogger.upload_file(file_path={os.fspath(file_path)!r}): no such file "
                                    "or folder")
        artifact_name = re.sub(r"[^a-zA-Z0-9_.-]", ".", remote_file_name)
        if artifact_name != remote_file_name:
            warnings.warn(f"W&B artifact names allow only letters, digits, '-', '_' and '.': {remote_file_name!r} "
                          f"is stored as {artifact_name!r}", stacklevel=2)
        wandb = _import_wandb()
        timestamp = state.timestamp
        metadata = {f"timestamp/{key}": value for key, value in timestamp.state_dict().items()}
        artifact = wandb.Artifact(name=artifact_name, type=_artifact_type(path), metadata=metadata)
        if os.path.isdir(path):
            artifact.add_dir(path)
        else:
            artifact.add_file(path)
        run.log_artifact(artifact, aliases=["latest", f"ep{int(timestamp.epoch)}-ba{int(timestamp.batch)}"])

    def fit_error(self, state: State, logger: Logger, error: BaseException) -> None:
        self._failed = True

    def post_close(self) -> None:
        # After every callback's close, so files uploaded while closing (the last checkpoint) are in the run.
        # Exit code 1 when fit failed, or (as Composer) when the Trainer is closed while an error is handled.
        if self.run is not None:
            self.run.finish(exit_code=closing_outcome(self._failed).exit_code)
            self.run = None


def _artifact_type(path: str) -> str:
    """The artifact type: 'model' for checkpoints (W&B's model registry lists those), else the file's extension."""
    if os.path.isdir(path):
        return "model"
    extension = os.path.splitext(path)[1].lstrip(".")
    return "model" if extension in ("", "pt", "ckpt") else extension


def _plain_image(image: np.ndarray) -> np.ndarray:
    """One ``(H, W, C)`` image as uint8, grey images as ``(H, W)`` (what PIL and so W&B read)."""
    pixels = to_uint8(np.asarray(image))
    return pixels[..., 0] if pixels.shape[-1] == 1 else pixels
