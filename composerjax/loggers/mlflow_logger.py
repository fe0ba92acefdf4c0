"""MLFlowLogger: log metrics, parameters, images, tables and checkpoint files to an MLflow run."""

from __future__ import annotations

import fnmatch
import os
import shutil
import tempfile
import time
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from composerjax.loggers.images import to_uint8
from composerjax.loggers.logger import LoggerDestination, closing_outcome, is_process_zero
from composerjax.parallel.dist import process_index

if TYPE_CHECKING:
    from composerjax.core.state import State
    from composerjax.loggers.logger import Logger

__all__ = ["MLFlowLogger", "DEFAULT_MLFLOW_EXPERIMENT_NAME", "default_tracking_uri"]

#: The experiment runs go to when neither ``experiment_name`` nor ``MLFLOW_EXPERIMENT_NAME`` names one.
DEFAULT_MLFLOW_EXPERIMENT_NAME = "my-mlflow-experiment"


def _import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError as error:
        raise ImportError("MLFlowLogger needs the mlflow package, which is not installed: "
                          "pip install 'composerjax[mlflow]'") from error
    return mlflow


def default_tracking_uri() -> str:
    """Where runs go when ``MLFlowLogger(tracking_uri=None)``: MLflow's own setting, else ``./mlflow.db``.

    In order: ``'databricks'`` when ``DATABRICKS_TOKEN`` is set (as Composer); the URI MLflow was
    given (``MLFLOW_TRACKING_URI`` or ``mlflow.set_tracking_uri``); otherwise the SQLite database
    ``mlflow.db`` in the working directory, as an absolute ``sqlite:///`` URI. That is MLflow 3's own
    default, without its fallback to an existing ``./mlruns`` file store (which MLflow 3 refuses to
    open unless ``MLFLOW_ALLOW_FILE_STORE=true``) and instead of MLflow 2's ``./mlruns`` default.

    Example::

        default_tracking_uri()   # 'sqlite:////home/me/project/mlflow.db' with no MLflow settings, in /home/me/project
    """
    if os.environ.get("DATABRICKS_TOKEN"):
        return "databricks"
    mlflow = _import_mlflow()
    is_set = getattr(mlflow, "is_tracking_uri_set", None)
    if (is_set() if callable(is_set) else bool(os.environ.get("MLFLOW_TRACKING_URI"))):
        return mlflow.get_tracking_uri()
    return "sqlite:///" + os.path.abspath("mlflow.db").replace(os.sep, "/")


class MLFlowLogger(LoggerDestination):
    """Log to an `MLflow <https://mlflow.org>`_ run, created at INIT in ``experiment_name``.

    What goes where: metrics are MLflow metrics at ``step`` = the batch count (a value equal to the
    last one logged for that name is skipped until ``log_duplicated_metric_every_n_steps`` steps
    have passed); hyperparameters are run parameters (nested dicts as ``a/b`` names); images are
    ``client.log_image`` under ``<name>_<i>``; tables are ``<name>.json`` artifacts; files and folders
    handed to :meth:`upload_file` (checkpoints) are artifacts under their ``remote_file_name``.

    When values reach the store: MLflow's background writer (``synchronous=False``) is drained at
    every ``FIT_END``, so what ``fit`` logged is in the store when it returns; the run stays open,
    so a later ``fit()`` or ``eval()`` logs into the same run. The run ends when the Trainer closes
    (``trainer.close()``, the end of a ``with`` block, or interpreter exit for a Trainer never
    closed): ``FINISHED``; ``FAILED`` when ``fit`` failed or the Trainer is closed while an
    exception is handled; ``KILLED`` when SIGTERM/SIGINT stopped ``fit``.

    Any tracking store works: ``tracking_uri='sqlite:///runs/mlflow.db'`` keeps everything local
    (artifacts go to ``./mlruns``), ``http://host:5000`` is a tracking server. Without
    ``tracking_uri``, MLflow's own setting (``MLFLOW_TRACKING_URI``, ``mlflow.set_tracking_uri``) is
    used, else ``sqlite:///<working directory>/mlflow.db`` (:func:`default_tracking_uri`; MLflow 3
    refuses to create ``./mlruns`` file stores). ``MLFLOW_EXPERIMENT_ID``, ``MLFLOW_EXPERIMENT_NAME``
    and ``MLFLOW_RUN_ID`` are read as Composer reads them.

    Args:
        experiment_name: the experiment (created if missing); by default ``MLFLOW_EXPERIMENT_NAME``
            or ``'my-mlflow-experiment'``.
        run_name: the run's name; by default the Trainer's ``run_name``.
        tags: tags for the run; the tag ``run_name`` (the Trainer's run name, or ``RUN_NAME``) is
            added, and found again by ``resume``.
        tracking_uri: where runs are stored; by default MLflow's tracking URI if one is set, else
            ``./mlflow.db`` (see :func:`default_tracking_uri`).
        rank_zero_only: log only on process 0; with False every process logs its own run, named
            ``<run_name>-rank<process index>``.
        flush_interval: accepted for Composer's signature (Composer does not use it either): batching
            is ``logging_buffer_seconds``.
        model_registry_prefix: prefix of the names :meth:`register_model` registers under
            (``{catalog}.{schema}`` for Unity Catalog).
        model_registry_uri: the model registry (``'databricks-uc'`` for Unity Catalog).
        synchronous: log each call before returning; False queues metrics and parameters and
            writes them in the background (drained at every ``FIT_END`` and when the Trainer closes).
        log_system_metrics: let MLflow record CPU, memory and GPU use (sampled every 5 s, logged
            every 30 s; needs ``psutil``).
        rename_metrics: ``{logged name: name in MLflow}``, exact names.
        ignore_metrics: glob patterns of metric names not to log.
        ignore_hyperparameters: glob patterns of hyperparameter names (``a/b`` for nested ones) not
            to log.
        run_group: a ``run_group`` tag for the run.
        resume: continue the run of this experiment tagged with this Trainer's run name, if any.
        logging_buffer_seconds: how long the background writer gathers values before writing them
            (sets ``MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS`` for the process, as Composer does).
        log_duplicated_metric_every_n_steps: log a repeated metric value again after this many steps.

    Raises:
        ImportError: mlflow is not installed (``pip install 'composerjax[mlflow]'``).
        ValueError: an argument has the wrong type or range, naming it.

    Example::

        trainer = Trainer(model, loader, max_duration="2ep",
                          loggers=[MLFlowLogger(experiment_name="digits", tracking_uri="sqlite:///mlflow.db")])
        with trainer:      # the run ends with the block (FAILED if an exception leaves it)
            trainer.fit()  # the metrics are in mlflow.db when fit returns
    """

    def __init__(self, experiment_name: str | None = None, run_name: str | None = None,
                 tags: dict[str, Any] | None = None, tracking_uri: str | os.PathLike[str] | None = None,
                 rank_zero_only: bool = True, flush_interval: int = 10, model_registry_prefix: str = "",
                 model_registry_uri: str | None = None, synchronous: bool = False, log_system_metrics: bool = True,
                 rename_metrics: dict[str, str] | None = None, ignore_metrics: list[str] | None = None,
                 ignore_hyperparameters: list[str] | None = None, run_group: str | None = None,
                 resume: bool = False, logging_buffer_seconds: int | None = 10,
                 log_duplicated_metric_every_n_steps: int = 100) -> None:
        _check_arguments(locals())
        mlflow = _import_mlflow()
        self.experiment_name, self.run_name, self.run_group = experiment_name, run_name, run_group
        self.tags = dict(tags or {})
        self.tracking_uri = None if tracking_uri is None else str(os.fspath(tracking_uri))
        self.rank_zero_only, self.flush_interval = rank_zero_only, flush_interval
        self.model_registry_prefix, self.model_registry_uri = model_registry_prefix, model_registry_uri
        self.synchronous, self.log_system_metrics, self.resume = synchronous, log_system_metrics, resume
        self.rename_metrics = dict(rename_metrics or {})
        self.ignore_metrics = list(ignore_metrics or [])
        self.ignore_hyperparameters = list(ignore_hyperparameters or [])
        self.logging_buffer_seconds = logging_buffer_seconds
        self.log_duplicated_metric_every_n_steps = log_duplicated_metric_every_n_steps
        if logging_buffer_seconds:
            os.environ["MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS"] = str(logging_buffer_seconds)
        if log_system_metrics:  # sampled every 5 s, logged as the mean of 6 samples (every 30 s)
            mlflow.set_system_metrics_samples_before_logging(6)
            mlflow.set_system_metrics_sampling_interval(5)
        #: The tracking URI the run is stored at (``tracking_uri`` or the default), once the run has started.
        self.run_tracking_uri: str | None = None
        #: The experiment's and the run's MLflow ids, and the run's page, once the run has started.
        self.experiment_id: str | None = None
        self.run_id: str | None = None
        self.run_url: str | None = None
        self._client: Any = None
        self._enabled: bool | None = None  # decided when the run starts: process 0, or every process
        self._owns_active_run = False
        self._metrics_cache: dict[str, tuple[float, int]] = {}
        self._params: dict[str, str] = {}
        self._failed = False
        self._closed = False

    # -- the run -------------------------------------------------------------------------------
    def _start(self, run_name: str | None) -> None:
        self._enabled = not self.rank_zero_only or is_process_zero()
        if not self._enabled:
            return
        mlflow = _import_mlflow()
        from mlflow import MlflowClient

        tracking_uri = self.tracking_uri if self.tracking_uri is not None else default_tracking_uri()
        self.run_tracking_uri = tracking_uri
        mlflow.set_tracking_uri(tracking_uri)
        if self.model_registry_uri is not None:
            mlflow.set_registry_uri(self.model_registry_uri)
        self._client = client = MlflowClient(tracking_uri)
        experiment_name = self.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME",
                                                                 DEFAULT_MLFLOW_EXPERIMENT_NAME)
        self.experiment_id = os.environ.get("MLFLOW_EXPERIMENT_ID")
        if self.experiment_id is None:
            experiment = client.get_experiment_by_name(experiment_name)
            self.experiment_id = (experiment.experiment_id if experiment is not None
                                  else client.create_experiment(experiment_name))
        tags = dict(self.tags)
        if run_name is not None:
            tags["run_name"] = os.environ.get("RUN_NAME", run_name)
        if self.run_group:
            tags["run_group"] = self.run_group
        name = self.run_name or run_name
        if not self.rank_zero_only and name is not None:
            name = f"{name}-rank{process_index()}"
        self.run_id = os.environ.get("MLFLOW_RUN_ID")
        if self.run_id is None and self.resume and "run_name" in tags:
            found = client.search_runs([self.experiment_id], filter_string=f"tags.run_name = '{tags['run_name']}'",
                                       max_results=1)
            self.run_id = found[0].info.run_id if found else None
        if self.run_id is None:
            self.run_id = client.create_run(self.experiment_id, run_name=name).info.run_id
        if mlflow.active_run() is None:  # the active run: mlflow.log_* calls in user code land in it too
            mlflow.start_run(run_id=self.run_id, tags=tags, log_system_metrics=self.log_system_metrics)
            self._owns_active_run = True
        else:
            for key, value in tags.items():
                client.set_tag(self.run_id, key, value)
        self.run_url = f"{os.environ.get('DATABRICKS_HOST', '')}/ml/experiments/{self.experiment_id}/runs/{self.run_id}"

    def _active(self) -> bool:
        """Whether this process logs (never after close); the run is started on first use outside a Trainer."""
        if self._closed:
            return False
        if self._enabled is None:
            self._start(None)
        return bool(self._enabled)

    def init(self, state: State, logger: Logger) -> None:
        if self._enabled is None:
            self._start(state.run_name)

    def after_load(self, state: State, logger: Logger) -> None:
        if self._enabled:  # as Composer: every destination learns where the run is
            logger.log_hyperparameters({"mlflow_experiment_id": self.experiment_id, "mlflow_run_id": self.run_id})

    # -- values --------------------------------------------------------------------------------
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if not self._active():
            return
        from mlflow.entities import Metric

        step = step or 0
        now = int(time.time() * 1000)
        to_log = []
        for name, value in metrics.items():
            if any(fnmatch.fnmatch(name, pattern) for pattern in self.ignore_metrics):
                continue
            value = float(value)
            last = self._metrics_cache.get(name)
            if last is not None and last[0] == value and step < last[1] + self.log_duplicated_metric_every_n_steps:
                continue  # the same value again within the window: MLflow's chart already shows it
            self._metrics_cache[name] = (value, step)
            to_log.append(Metric(self.rename_metrics.get(name, name), value, now, step))
        if to_log:
            self._client.log_batch(self.run_id, metrics=to_log, synchronous=self.synchronous)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        if not self._active():
            return
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        params = []
        for name, value in _flatten(hyperparameters).items():
            if any(fnmatch.fnmatch(name, pattern) for pattern in self.ignore_hyperparameters):
                continue
            text = str(value)[:MAX_PARAM_VAL_LENGTH]
            logged = self._params.get(name)
            if logged == text:
                continue
            if logged is not None:  # MLflow parameters are immutable: the first value stays
                warnings.warn(f"MLFlowLogger: hyperparameter {name!r} was logged as {logged!r}; MLflow cannot "
                              f"change a parameter, so {text!r} is not logged", stacklevel=2)
                continue
            self._params[name] = text
            params.append(Param(name, text))
        if params:
            self._client.log_batch(self.run_id, params=params, synchronous=self.synchronous)

    def log_images(self, images: np.ndarray, name: str, step: int | None = None) -> None:
        if not self._active():
            return
        for index, image in enumerate(images):
            self._client.log_image(self.run_id, _mlflow_image(image), key=f"{name}_{index}", step=step or 0)

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str, step: int | None = None) -> None:
        if not self._active():
            return
        import pandas as pd

        self._client.log_table(self.run_id, data=pd.DataFrame.from_records(rows, columns=columns),
                               artifact_file=f"{name}.json")

    # -- files and models ----------------------------------------------------------------------
    def can_upload_files(self) -> bool:
        """Whether :meth:`upload_file` stores files (True: as artifacts of the run)."""
        return True

    def upload_file(self, state: State, remote_file_name: str, file_path: str | os.PathLike[str], *,
                    overwrite: bool = False) -> None:
        """Store ``file_path`` (a file, or a folder such as an orbax checkpoint) as the artifact ``remote_file_name``.

        A folder's files go under ``remote_file_name/``. MLflow's artifact stores replace a file of
        the same name, so ``overwrite`` has no effect.

        Args:
            state: the training state (unused; part of the upload hook's signature).
            remote_file_name: the artifact path in the run (``run/checkpoints/ep1-ba8``).
            file_path: the file or folder to upload.
            overwrite: accepted for Composer's signature.

        Raises:
            FileNotFoundError: ``file_path`` does not exist.
        """
        del state, overwrite
        if not self._active():
            return
        path = os.fspath(file_path)
        remote = remote_file_name.strip("/")
        if os.path.isdir(path):
            self._client.log_artifacts(self.run_id, path, artifact_path=remote)
        elif os.path.isfile(path):
            folder, base = os.path.split(remote)
            with tempfile.TemporaryDirectory() as staging:  # MLflow names a file after its local name
                staged = os.path.join(staging, base)
                shutil.copyfile(path, staged)
                self._client.log_artifact(self.run_id, staged, artifact_path=folder or None)
        else:
            raise FileNotFoundError(f"MLFlowLogger.upload_file(file_path={path!r}): no such file or folder")

    def register_model(self, model_uri: str, name: str, await_registration_for: int = 300,
                       tags: dict[str, Any] | None = None) -> Any:
        """Register ``model_uri`` as ``<model_registry_prefix>.<name>``; return the new ``ModelVersion``.

        Example::

            version = mlflow_logger.register_model(f"runs:/{mlflow_logger.run_id}/model", "digits-cnn")
        """
        if not self._active():
            return None
        full_name = f"{self.model_registry_prefix}.{name}" if self.model_registry_prefix else name
        return _import_mlflow().register_model(model_uri=model_uri, name=full_name,
                                               await_registration_for=await_registration_for, tags=tags)

    # -- end -----------------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait until MLflow's background writer has stored everything logged so far; the run stays open.

        Called at ``FIT_END`` and on close. Example: ``mlflow_logger.flush()`` before reading the run back.
        """
        if self._enabled and not self._closed:
            self._drain()

    def _drain(self) -> None:
        # The queue belongs to the client's store (the one log_batch wrote through), whatever the
        # process-wide tracking URI is now.
        store = getattr(getattr(self._client, "_tracking_client", None), "store", None)
        drain = getattr(store, "flush_async_logging", None)
        if callable(drain):
            drain()
        else:
            _import_mlflow().flush_async_logging()

    def fit_end(self, state: State, logger: Logger) -> None:
        self.flush()

    def fit_error(self, state: State, logger: Logger, error: BaseException) -> None:
        self._failed = True

    def post_close(self) -> None:
        # After every callback's close, so files uploaded while closing (the last checkpoint) are in the run.
        if not self._enabled or self._closed:
            return
        self._closed = True
        mlflow = _import_mlflow()
        self._drain()
        status = _STATUS[closing_outcome(self._failed).status]
        active = mlflow.active_run()
        if self._owns_active_run and active is not None and active.info.run_id == self.run_id:
            mlflow.end_run(status=status)
        elif self._client.get_run(self.run_id).info.status == "RUNNING" or status != "FINISHED":
            self._client.set_terminated(self.run_id, status=status)
        self._owns_active_run = False


#: MLflow's run status for each way a run ends (``closing_outcome``).
_STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


def _check_arguments(arguments: dict[str, Any]) -> None:
    def fail(name: str, expected: str) -> None:
        raise ValueError(f"MLFlowLogger({name}={arguments[name]!r}): expected {expected}")

    for name in ("experiment_name", "run_name", "model_registry_uri", "run_group"):
        if arguments[name] is not None and not isinstance(arguments[name], str):
            fail(name, "a string or None")
    if not isinstance(arguments["model_registry_prefix"], str):
        fail("model_registry_prefix", "a string ('' for none)")
    if arguments["tags"] is not None and not isinstance(arguments["tags"], dict):
        fail("tags", "a dict of tag names to values, or None")
    tracking_uri = arguments["tracking_uri"]
    if tracking_uri is not None and not isinstance(tracking_uri, (str, os.PathLike)):
        fail("tracking_uri", "a URI or path (str or os.PathLike) or None")
    for name in ("rank_zero_only", "synchronous", "log_system_metrics", "resume"):
        if not isinstance(arguments[name], bool):
            fail(name, "True or False")
    for name in ("flush_interval", "log_duplicated_metric_every_n_steps"):
        value = arguments[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail(name, "a positive integer")
    buffer = arguments["logging_buffer_seconds"]
    if buffer is not None and (isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 0):
        fail("logging_buffer_seconds", "a number of seconds (int >= 0) or None")
    if arguments["rename_metrics"] is not None and not isinstance(arguments["rename_metrics"], dict):
        fail("rename_metrics", "a dict of metric names to new names, or None")
    for name in ("ignore_metrics", "ignore_hyperparameters"):
        value = arguments[name]
        if value is not None and (isinstance(value, str) or not all(isinstance(v, str) for v in value)):
            fail(name, "a list of glob patterns (strings) or None")
    if arguments["model_registry_uri"] == "databricks-uc" and len(arguments["model_registry_prefix"].split(".")) != 2:
        fail("model_registry_prefix", "'{catalog_name}.{schema_name}' when model_registry_uri='databricks-uc'")


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{'a': {'b': 1}}`` -> ``{'a/b': 1}``."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def _mlflow_image(image: np.ndarray) -> np.ndarray:
    """One ``(H, W, C)`` image as uint8 with 1, 3 or 4 channels (grey + alpha becomes RGBA), as MLflow takes."""
    pixels = to_uint8(np.asarray(image))
    if pixels.shape[-1] == 2:
        grey, alpha = pixels[..., :1], pixels[..., 1:]
        pixels = np.concatenate([grey, grey, grey, alpha], axis=-1)
    return pixels
