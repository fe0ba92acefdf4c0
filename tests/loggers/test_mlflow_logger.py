"""Tests for MLFlowLogger: runs in a local SQLite tracking store, read back with MLflow's own client."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import optax
import pytest
from mlflow import MlflowClient
from PIL import Image

from composerjax import ArrayLoader, Callback, Trainer
from composerjax.loggers import InMemoryLogger
from composerjax.loggers.mlflow_logger import MLFlowLogger

LOSS = "loss/train/total"
ACCURACY = "metrics/eval/MulticlassAccuracy"
SAMPLES = np.linspace(0.0, 1.0, 2 * 3 * 4 * 3, dtype=np.float32).reshape(2, 3, 4, 3)  # two 3x4 RGB images


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A local file tracking store in a scratch folder, which is also the working directory.

    MLflow 3 prefers SQLite (``sqlite:///mlflow.db``, what the docs show) and refuses the file store
    unless ``MLFLOW_ALLOW_FILE_STORE=true``; the logger works the same with either, and creating a
    SQLite store runs MLflow's schema migrations (3-7 s), so the tests use the file store. The
    process-wide settings MLflow and the logger change (tracking URI, buffering) are restored after.
    """
    tmp = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "MLFLOW_RUN_ID",
                     "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME", "RUN_NAME", "DATABRICKS_TOKEN"):
            patch.delenv(name, raising=False)
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        yield SimpleNamespace(uri=(tmp / "mlruns").as_uri(), tmp=tmp)
        mlflow.set_tracking_uri(None)


class ImagesAndTableAtEpochEnd(Callback):
    def epoch_end(self, state, logger):
        logger.log_images(jnp.asarray(SAMPLES), name="samples")
        logger.log_table(["class", "count"], [["zero", jnp.int32(30)], ["one", 34]], name="classes")


@pytest.fixture(scope="module")
def mlflow_run(store, classification_arrays, make_tiny_classifier):
    """6 batches (4 per epoch, eval after epoch 0 and at fit end), log_interval=2, checkpoints each epoch."""
    x, y = classification_arrays
    memory = InMemoryLogger()
    destination = MLFlowLogger(experiment_name="composerjax-tests", tags={"team": "jax"}, tracking_uri=store.uri,
                               run_group="g")
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="6ba",
                      eval_dataloader=ArrayLoader((x, y), batch_size=32, shuffle=False), optimizers=optax.sgd(0.1),
                      callbacks=[ImagesAndTableAtEpochEnd()], loggers=[memory, destination], log_interval=2,
                      progress_bar=False, run_dir=str(store.tmp / "run"),
                      save_folder=str(store.tmp / "run" / "checkpoints"))
    trainer.fit()
    checkpoint = Path(trainer.checkpointer.last_saved_path)
    # The checkpoint saver handed each verified checkpoint (ep1-ba4, ep1-ba6) and the latest pointer over.
    destination.upload_file(trainer.state, f"{trainer.state.run_name}/commit.txt", checkpoint / "commit_success.txt")
    trainer.close()
    client = MlflowClient(store.uri)
    return SimpleNamespace(trainer=trainer, memory=memory, destination=destination, checkpoint=checkpoint,
                           client=client, run=client.get_run(destination.run_id), tmp=store.tmp)


def history(run, name):
    return [(metric.step, metric.value) for metric in run.client.get_metric_history(run.run.info.run_id, name)]


def without_repeats(logged):
    """What MLflowLogger sends: a value equal to the previous one is skipped (all within 100 steps here)."""
    return [entry for index, entry in enumerate(logged) if index == 0 or entry[1] != logged[index - 1][1]]


def test_metrics_are_logged_at_the_batch_count(mlflow_run):
    assert history(mlflow_run, LOSS) == mlflow_run.memory.data[LOSS]
    assert [step for step, _ in history(mlflow_run, LOSS)] == [1, 2, 3, 4, 5, 6]
    assert history(mlflow_run, ACCURACY) == without_repeats(mlflow_run.memory.data[ACCURACY])
    assert [step for step, _ in mlflow_run.memory.data[ACCURACY]] == [4, 6]


def test_run_is_named_after_the_trainer_run_and_tagged(mlflow_run):
    info, tags = mlflow_run.run.info, mlflow_run.run.data.tags
    run_name = mlflow_run.trainer.state.run_name
    assert (info.run_name, info.status) == (run_name, "FINISHED")
    assert mlflow_run.client.get_experiment(info.experiment_id).name == "composerjax-tests"
    assert (tags["run_name"], tags["team"], tags["run_group"]) == (run_name, "jax", "g")


def test_hyperparameters_are_run_parameters(mlflow_run):
    params = mlflow_run.run.data.params
    assert params["run_summary/run_name"] == mlflow_run.trainer.state.run_name
    assert params["run_summary/parameters"] == "10"
    assert params["run_summary/algorithms"] == "[]"
    assert params["compiled_steps/0/kind"] == "train"  # nested dicts flattened to a/b names
    # As Composer: at AFTER_LOAD every destination learns where the MLflow run is.
    assert (params["mlflow_run_id"], params["mlflow_experiment_id"]) == (
        mlflow_run.run.info.run_id, mlflow_run.run.info.experiment_id)
    assert mlflow_run.memory.hyperparameters["mlflow_run_id"] == mlflow_run.run.info.run_id


def test_checkpoint_folder_and_file_are_artifacts_with_the_same_bytes(mlflow_run, tmp_path):
    run_id, run_name = mlflow_run.run.info.run_id, mlflow_run.trainer.state.run_name
    downloaded = Path(mlflow_run.client.download_artifacts(run_id, f"{run_name}/checkpoints/ep1-ba6", str(tmp_path)))
    local = {p.relative_to(mlflow_run.checkpoint): p.read_bytes() for p in mlflow_run.checkpoint.rglob("*")
             if p.is_file()}
    stored = {p.relative_to(downloaded): p.read_bytes() for p in downloaded.rglob("*") if p.is_file()}
    assert len(local) >= 4 and stored == local
    listed = [a.path for a in mlflow_run.client.list_artifacts(run_id, f"{run_name}/checkpoints")]
    assert listed == [f"{run_name}/checkpoints/{name}" for name in ("ep1-ba4", "ep1-ba6", "latest.symlink")]
    pointer = mlflow_run.client.download_artifacts(run_id, f"{run_name}/checkpoints/latest.symlink", str(tmp_path))
    assert Path(pointer).read_text() == f"{run_name}/checkpoints/ep1-ba6"  # Composer's pointer file
    (single,) = [a for a in mlflow_run.client.list_artifacts(run_id, run_name) if not a.is_dir]
    assert single.path == f"{run_name}/commit.txt"
    text = Path(mlflow_run.client.download_artifacts(run_id, single.path, str(tmp_path))).read_bytes()
    assert text == (mlflow_run.checkpoint / "commit_success.txt").read_bytes()


def test_images_are_mlflow_images_with_the_logged_pixels(mlflow_run, tmp_path):
    run_id = mlflow_run.run.info.run_id
    pngs = [a.path for a in mlflow_run.client.list_artifacts(run_id, "images") if a.path.endswith(".png")]
    for index, image in enumerate(SAMPLES):
        (path,) = [p for p in pngs if Path(p).name.startswith(f"samples_{index}+step+4+")]
        stored = np.asarray(Image.open(mlflow_run.client.download_artifacts(run_id, path, str(tmp_path))))
        np.testing.assert_array_equal(stored, np.round(image * 255).astype(np.uint8))


def test_tables_are_json_artifacts(mlflow_run, tmp_path):
    path = mlflow_run.client.download_artifacts(mlflow_run.run.info.run_id, "classes.json", str(tmp_path))
    table = json.loads(Path(path).read_text())
    assert (table["columns"], table["data"]) == (["class", "count"], [["zero", 30], ["one", 34]])


def test_resume_continues_the_run_tagged_with_the_trainer_run_name(mlflow_run, store):
    resumed = MLFlowLogger(experiment_name="composerjax-tests", tracking_uri=store.uri, resume=True,
                           log_system_metrics=False, synchronous=True)
    resumed.init(SimpleNamespace(run_name=mlflow_run.trainer.state.run_name), None)
    resumed.log_metrics({"after_resume": 2.0}, step=7)
    resumed.post_close()
    assert resumed.run_id == mlflow_run.run.info.run_id
    assert mlflow_run.client.get_metric_history(resumed.run_id, "after_resume")[0].step == 7


class FailAtBatch2(Callback):
    def batch_end(self, state, logger):
        if state.timestamp.batch.value == 2:
            raise RuntimeError("boom")


def test_a_failed_fit_ends_the_run_as_failed(store, classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    destination = MLFlowLogger(experiment_name="failing", tracking_uri=store.uri, log_system_metrics=False)
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="4ba",
                      optimizers=optax.sgd(0.1), callbacks=[FailAtBatch2()], loggers=[destination], log_interval=1,
                      progress_bar=False, run_summary=False, run_dir=str(store.tmp / "failing"))
    with pytest.raises(RuntimeError, match="boom"):
        try:
            trainer.fit()
        except RuntimeError:
            trainer.close()  # closing while the error is handled, as a `with`/`finally` block does
            raise
    client = MlflowClient(store.uri)
    assert client.get_run(destination.run_id).info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(destination.run_id, LOSS)] == [1, 2]


def test_metric_options_rename_ignore_and_skip_repeats(store):
    destination = MLFlowLogger(experiment_name="options", tracking_uri=store.uri, log_system_metrics=False,
                               synchronous=True, rename_metrics={"b": "B"}, ignore_metrics=["skip/*"],
                               ignore_hyperparameters=["secret*"], log_duplicated_metric_every_n_steps=5)
    destination.log_metrics({"a": 1.0, "skip/x": 2.0, "b": 3.0}, step=1)
    destination.log_metrics({"a": 1.0, "b": 4.0}, step=5)  # a repeats within 5 steps: skipped
    destination.log_metrics({"a": 1.0}, step=6)  # 5 steps after it was last logged: logged again
    destination.log_hyperparameters({"lr": 0.1, "secret_key": "x", "model": {"width": 8, "act": "relu"}})
    with pytest.warns(UserWarning, match=r"'lr' was logged as '0.1'; MLflow cannot change"):
        destination.log_hyperparameters({"lr": 0.2})
    destination.post_close()
    client = MlflowClient(store.uri)
    run = client.get_run(destination.run_id)
    assert [(m.step, m.value) for m in client.get_metric_history(destination.run_id, "a")] == [(1, 1.0), (6, 1.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(destination.run_id, "B")] == [(1, 3.0), (5, 4.0)]
    assert set(run.data.metrics) == {"a", "B"}
    assert run.data.params == {"lr": "0.1", "model/width": "8", "model/act": "relu"}
    assert run.info.status == "FINISHED" and run.info.run_name != ""


def test_other_processes_log_nothing_unless_rank_zero_only_is_false(store, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    quiet_store = store.tmp / "quiet"
    quiet = MLFlowLogger(tracking_uri=quiet_store.as_uri(), log_system_metrics=False)
    quiet.init(SimpleNamespace(run_name="r"), None)
    quiet.log_metrics({"loss": 1.0}, step=1)
    quiet.log_hyperparameters({"lr": 0.1})
    quiet.post_close()
    assert quiet.run_id is None and not quiet_store.exists()

    every = MLFlowLogger(experiment_name="ranks", tracking_uri=store.uri, rank_zero_only=False,
                         log_system_metrics=False)
    every.init(SimpleNamespace(run_name="r"), None)
    every.post_close()
    assert MlflowClient(store.uri).get_run(every.run_id).info.run_name == "r-rank1"


def test_upload_of_a_missing_file_names_it(store):
    destination = MLFlowLogger(experiment_name="missing", tracking_uri=store.uri, log_system_metrics=False)
    try:
        with pytest.raises(FileNotFoundError, match=r"file_path='/no/such/file'"):
            destination.upload_file(None, "x", "/no/such/file")
    finally:
        destination.post_close()


def test_constructor_validation_names_the_argument():
    with pytest.raises(ValueError, match=r"experiment_name=5"):
        MLFlowLogger(experiment_name=5)
    with pytest.raises(ValueError, match=r"tags=\['a'\]"):
        MLFlowLogger(tags=["a"])
    with pytest.raises(ValueError, match=r"synchronous='no'"):
        MLFlowLogger(synchronous="no")
    with pytest.raises(ValueError, match=r"log_duplicated_metric_every_n_steps=0"):
        MLFlowLogger(log_duplicated_metric_every_n_steps=0)
    with pytest.raises(ValueError, match=r"ignore_metrics='loss'"):
        MLFlowLogger(ignore_metrics="loss")
    with pytest.raises(ValueError, match=r"model_registry_prefix='main'.*databricks-uc"):
        MLFlowLogger(model_registry_uri="databricks-uc", model_registry_prefix="main")


def test_without_mlflow_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'composerjax\[mlflow\]'"):
        MLFlowLogger()


def test_importing_composerjax_and_the_logger_modules_imports_neither_wandb_nor_mlflow():
    code = ("import sys, composerjax, composerjax.loggers, composerjax.loggers.wandb_logger, "
            "composerjax.loggers.mlflow_logger; print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert result.stdout.strip() == "[]"


def test_a_recipe_names_the_logger_and_its_arguments(store):
    from composerjax.trainer import build_trainer
    from composerjax.trainer.config import load_config

    # Once registered (entry point `mlflow`), `name: mlflow` is the same class.
    spec = {"name": "composerjax.loggers.mlflow_logger:MLFlowLogger", "experiment_name": "recipe",
            "tracking_uri": store.uri, "log_system_metrics": False, "ignore_metrics": ["metrics/*"]}
    recipe = {"model": {"name": "mlp", "sizes": [64, 8, 10]}, "data": {"name": "digits", "batch_size": 100},
              "optimizer": {"name": "sgd", "lr": 0.1}, "max_duration": "2ba", "loggers": [spec],
              "progress_bar": False, "run_summary": False}
    trainer = build_trainer(load_config(recipe))  # INIT starts the run; AFTER_LOAD logs its ids
    (destination,) = [d for d in trainer.logger.destinations if isinstance(d, MLFlowLogger)]
    assert (destination.experiment_name, destination.ignore_metrics) == ("recipe", ["metrics/*"])
    assert trainer.to_config().to_dict()["loggers"] == [spec]
    trainer.close()
    run = MlflowClient(store.uri).get_run(destination.run_id)
    assert (run.info.run_name, run.info.status) == (trainer.state.run_name, "FINISHED")
    assert run.data.params["mlflow_run_id"] == destination.run_id


def test_without_a_tracking_uri_the_store_is_mlflows_setting_or_mlflow_db_here(tmp_path, monkeypatch):
    from composerjax.loggers.mlflow_logger import default_tracking_uri

    monkeypatch.chdir(tmp_path)
    for name in ("MLFLOW_TRACKING_URI", "DATABRICKS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    previous = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    mlflow.set_tracking_uri(None)
    try:
        (tmp_path / "mlruns" / "0").mkdir(parents=True)  # MLflow's own default would pick this refused file store
        (tmp_path / "mlruns" / "0" / "meta.yaml").write_text("experiment_id: '0'\n")
        assert mlflow.get_tracking_uri() == (tmp_path / "mlruns").as_uri()
        monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
        with pytest.raises(mlflow.exceptions.MlflowException, match="maintenance mode"):
            MlflowClient(mlflow.get_tracking_uri()).search_experiments()
        assert default_tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
        assert default_tracking_uri() == "http://tracking:5000"
        monkeypatch.delenv("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri("sqlite:///elsewhere.db")
        assert default_tracking_uri() == "sqlite:///elsewhere.db"
        monkeypatch.setenv("DATABRICKS_TOKEN", "token")
        assert default_tracking_uri() == "databricks"
    finally:
        mlflow.set_tracking_uri(previous)


def test_a_with_block_ends_the_run_finished_or_failed(store, classification_arrays, make_tiny_classifier):
    x, y = classification_arrays

    def trainer_logging_to(experiment: str):
        destination = MLFlowLogger(experiment_name=experiment, tracking_uri=store.uri, log_system_metrics=False)
        return destination, Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="3ba",
                                    optimizers=optax.sgd(0.1), loggers=[destination], log_interval=1,
                                    progress_bar=False, run_summary=False, run_dir=str(store.tmp / experiment))

    finished, trainer = trainer_logging_to("with-block")
    with trainer:
        trainer.fit()
    failed, trainer = trainer_logging_to("with-block-error")
    with pytest.raises(KeyError):
        with trainer:
            trainer.fit()
            raise KeyError("after fit")
    client = MlflowClient(store.uri)
    assert [client.get_run(d.run_id).info.status for d in (finished, failed)] == ["FINISHED", "FAILED"]
    assert [[m.step for m in client.get_metric_history(d.run_id, LOSS)] for d in (finished, failed)] == [[1, 2, 3]] * 2
