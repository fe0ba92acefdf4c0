"""Tests for WandBLogger: an offline W&B run (no account, no network) read back from its .wandb file."""

import base64
import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import wandb
from PIL import Image

from composerjax import ArrayLoader, Callback, Trainer
from composerjax.loggers import InMemoryLogger
from composerjax.loggers.wandb_logger import WandBLogger

sys.path.insert(0, str(Path(__file__).parent))
from wandb_records import records_in  # noqa: E402

LOSS = "loss/train/total"
ACCURACY = "metrics/eval/MulticlassAccuracy"
SAMPLES = np.linspace(0.0, 1.0, 2 * 3 * 4 * 3, dtype=np.float32).reshape(2, 3, 4, 3)  # two 3x4 RGB images


def offline_environment(tmp: Path) -> dict[str, str]:
    """W&B settings that keep everything under ``tmp``: offline, quiet, no console capture."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
            "WANDB_DATA_DIR": str(tmp / "data"), "WANDB_CACHE_DIR": str(tmp / "cache"),
            "WANDB_CONFIG_DIR": str(tmp / "config"), "WANDB_ARTIFACT_DIR": str(tmp / "artifacts")}


@pytest.fixture(scope="module", autouse=True)
def fresh_wandb_settings():
    """W&B reads its environment once per process (at its first run): start this module from a clean slate,
    so the settings below apply even when another test in this process already ran W&B."""
    wandb.teardown()
    yield
    wandb.teardown()


@pytest.fixture
def offline(tmp_path, monkeypatch):
    for name, value in offline_environment(tmp_path).items():
        monkeypatch.setenv(name, value)
    return tmp_path


def read_records(wandb_dir: Path) -> list:
    """The records of the one offline run under ``wandb_dir``, once W&B has written them.

    ``run.finish()`` returns before W&B's service has written an offline run's file;
    ``wandb.teardown()`` (what W&B runs at exit) waits until it has.

    The file is read by ``wandb_records.records_in`` (wandb has no Python reader).
    """
    wandb.teardown()
    (path,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    return list(records_in(path))


def records_of(records, kind: str) -> list:
    return [getattr(record, kind) for record in records if record.WhichOneof("record_type") == kind]


def history(records) -> list[dict]:
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in row.item}
            for row in records_of(records, "history")]


def config(records) -> dict:
    values = {}
    for update in [run.config for run in records_of(records, "run")] + records_of(records, "config"):
        values.update({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in update.update})
    return values


class ImagesAndTableAtEpochEnd(Callback):
    def epoch_end(self, state, logger):
        logger.log_images(jnp.asarray(SAMPLES), name="samples")
        logger.log_table(["class", "count"], [["zero", jnp.int32(30)], ["one", 34]], name="classes")


@pytest.fixture(scope="module")
def wandb_run(classification_arrays, make_tiny_classifier, tmp_path_factory):
    """6 batches (4 per epoch, eval after epoch 0 and at fit end), log_interval=2, checkpoints each epoch."""
    x, y = classification_arrays
    tmp = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in offline_environment(tmp).items():
            patch.setenv(name, value)
        memory = InMemoryLogger()
        destination = WandBLogger(project="composerjax-tests", group="g", tags=["tiny"], log_artifacts=True,
                                  init_kwargs={"dir": str(tmp)})
        trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="6ba",
                          eval_dataloader=ArrayLoader((x, y), batch_size=32, shuffle=False),
                          optimizers=optax.sgd(0.1), callbacks=[ImagesAndTableAtEpochEnd()],
                          loggers=[memory, destination], log_interval=2, progress_bar=False,
                          run_dir=str(tmp / "run"), save_folder=str(tmp / "run" / "checkpoints"))
        # The checkpoint saver hands each verified checkpoint over (W&B renames the '/' in its name).
        with pytest.warns(UserWarning, match=r"is stored as '.*\.checkpoints\.ep1-ba6'"):
            trainer.fit()
        checkpoint = trainer.checkpointer.last_saved_path
        trainer.close()
    return SimpleNamespace(trainer=trainer, memory=memory, destination=destination, checkpoint=Path(checkpoint),
                           records=read_records(tmp), tmp=tmp)


def test_metrics_are_logged_at_the_batch_count(wandb_run):
    rows = history(wandb_run.records)
    losses = [(row["_step"], row[LOSS]) for row in rows if LOSS in row]
    assert losses == wandb_run.memory.data[LOSS]
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 6]
    accuracy = [(row["_step"], row[ACCURACY]) for row in rows if ACCURACY in row]
    assert accuracy == wandb_run.memory.data[ACCURACY]
    assert [step for step, _ in accuracy] == [4, 6]


def test_run_is_named_after_the_trainer_run_with_the_given_project_group_and_tags(wandb_run):
    (run,) = records_of(wandb_run.records, "run")
    assert (run.display_name, run.project, run.run_group, list(run.tags)) == (
        wandb_run.trainer.state.run_name, "composerjax-tests", "g", ["tiny"])


def test_hyperparameters_are_the_run_config(wandb_run):
    values = config(wandb_run.records)
    assert values["run_summary/run_name"] == wandb_run.trainer.state.run_name
    assert values["run_summary/parameters"] == 10
    assert values["run_summary/algorithms"] == []
    assert values["compiled_steps/0"]["kind"] == "train"  # nested dicts stay nested


def test_images_and_tables_are_wandb_media_at_their_step(wandb_run):
    # History rows hold media as nested keys ('samples/_type', ...) pointing at files of the run.
    (row,) = [row for row in history(wandb_run.records) if "samples/_type" in row]
    assert (row["_step"], row["samples/_type"], row["samples/count"]) == (4, "images/separated", 2)
    run_files = next((wandb_run.tmp / "wandb").glob("offline-run-*")) / "files"
    for name, image in zip(row["samples/filenames"], SAMPLES, strict=True):
        np.testing.assert_array_equal(np.asarray(Image.open(run_files / name)), np.round(image * 255).astype(np.uint8))
    assert row["classes/_type"] == "table-file"
    table = json.loads((run_files / row["classes/path"]).read_text())
    assert (table["columns"], table["data"]) == (["class", "count"], [["zero", 30], ["one", 34]])


def test_checkpoint_folder_is_an_artifact_with_every_file(wandb_run):
    run_name = wandb_run.trainer.state.run_name
    artifacts = [a for a in records_of(wandb_run.records, "artifact") if a.type != "run_table"]
    # Both verified checkpoints and Composer's latest pointer, each time it moved.
    assert [a.name for a in artifacts] == [f"{run_name}.checkpoints.{name}" for name in (
        "ep1-ba4", "latest.symlink", "ep1-ba6", "latest.symlink")]
    assert sorted(artifacts[0].aliases) == ["ep1-ba4", "latest"]  # the clock of the save, not of the hand-over
    artifact = artifacts[2]
    name = f"{run_name}.checkpoints.ep1-ba6"
    assert (artifact.name, artifact.type, sorted(artifact.aliases)) == (name, "model", ["ep1-ba6", "latest"])
    metadata = json.loads(artifact.metadata)
    assert (metadata["timestamp/batch"], metadata["timestamp/epoch"]) == (6, 1)
    files = sorted(p for p in wandb_run.checkpoint.rglob("*") if p.is_file())
    entries = {entry.path: entry.digest for entry in artifact.manifest.contents}
    assert sorted(entries) == [str(p.relative_to(wandb_run.checkpoint)) for p in files]
    for path in files:  # W&B's digest is the base64 MD5 of the content
        expected = base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()
        assert entries[str(path.relative_to(wandb_run.checkpoint))] == expected


def test_run_is_finished_when_the_trainer_closes(wandb_run):
    (exit_record,) = records_of(wandb_run.records, "exit")
    assert exit_record.exit_code == 0
    assert wandb_run.destination.run is None


class FailAtBatch2(Callback):
    def batch_end(self, state, logger):
        if state.timestamp.batch.value == 2:
            raise RuntimeError("boom")


def test_a_failed_fit_finishes_the_run_with_exit_code_1(offline, classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="4ba",
                      optimizers=optax.sgd(0.1), callbacks=[FailAtBatch2()],
                      loggers=[WandBLogger(init_kwargs={"dir": str(offline)})], log_interval=1,
                      progress_bar=False, run_summary=False, run_dir=str(offline / "run"))
    with pytest.raises(RuntimeError, match="boom"):
        try:
            trainer.fit()
        except RuntimeError:
            trainer.close()  # closing while the error is handled, as a `with`/`finally` block does
            raise
    records = read_records(offline)
    assert [exit_record.exit_code for exit_record in records_of(records, "exit")] == [1]
    assert [row[LOSS] is not None for row in history(records) if LOSS in row] == [True, True]


def test_other_processes_log_nothing_unless_rank_zero_only_is_false(offline, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    quiet = WandBLogger(name="shared", init_kwargs={"dir": str(offline / "quiet")})
    quiet.init(SimpleNamespace(run_name="r"), None)
    quiet.log_metrics({"loss": 1.0}, step=1)
    quiet.log_hyperparameters({"lr": 0.1})
    quiet.post_close()
    assert quiet.run is None and not (offline / "quiet").exists()

    every = WandBLogger(name="shared", rank_zero_only=False, init_kwargs={"dir": str(offline)})
    every.init(SimpleNamespace(run_name="r"), None)
    every.log_metrics({"loss": 1.0}, step=1)
    every.post_close()
    (run,) = records_of(read_records(offline), "run")
    assert (run.display_name, run.run_group) == ("shared-rank1", "shared")


def test_outside_a_trainer_the_run_starts_on_first_use(offline):
    destination = WandBLogger(project="p", init_kwargs={"dir": str(offline)})
    destination.log_metrics({"loss": 0.5}, step=3)
    destination.log_hyperparameters({"lr": 0.1})
    destination.log_hyperparameters({"lr": 0.2})  # a changed value replaces the old one
    destination.upload_file(None, "ignored", "/no/such/file")  # log_artifacts=False: nothing happens
    destination.post_close()
    records = read_records(offline)
    assert [(row["_step"], row["loss"]) for row in history(records)] == [(3, 0.5)]
    assert config(records)["lr"] == 0.2


def test_upload_of_a_missing_file_names_it(offline):
    destination = WandBLogger(log_artifacts=True, init_kwargs={"dir": str(offline)})
    try:
        with pytest.raises(FileNotFoundError, match=r"file_path='/no/such/file'"):
            destination.upload_file(None, "x", "/no/such/file")
    finally:
        destination.post_close()


def test_constructor_validation_names_the_argument():
    with pytest.raises(ValueError, match=r"project=5"):
        WandBLogger(project=5)
    with pytest.raises(ValueError, match=r"tags='a'"):
        WandBLogger(tags="a")
    with pytest.raises(ValueError, match=r"log_artifacts='yes'"):
        WandBLogger(log_artifacts="yes")
    with pytest.raises(ValueError, match=r"init_kwargs=\['mode'\]"):
        WandBLogger(init_kwargs=["mode"])


def test_without_wandb_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'composerjax\[wandb\]'"):
        WandBLogger()


def test_the_offline_run_stays_under_the_given_folder(wandb_run):
    assert wandb_run.destination.run_dir.startswith(str(wandb_run.tmp / "wandb" / "offline-run-"))
    assert wandb_run.destination.run_url is None  # offline: no web page


def test_a_recipe_can_name_the_logger_with_composer_arguments():
    from composerjax import registry
    from composerjax.trainer.config import ConfigError, load_config

    # Once registered (entry point `wandb`), `name: wandb` is the same class.
    factory = registry.resolve("loggers", "composerjax.loggers.wandb_logger:WandBLogger")
    assert factory is WandBLogger
    spec = {"name": "composerjax.loggers.wandb_logger:WandBLogger", "project": "digits", "tags": ["a"],
            "log_artifacts": True, "init_kwargs": {"mode": "offline"}}
    config = load_config({"model": {"name": "mlp", "sizes": [64, 10]}, "data": {"name": "digits"},
                          "optimizer": {"name": "sgd", "lr": 0.1}, "max_duration": "1ba", "loggers": [spec]})
    assert config.to_dict()["loggers"] == [spec]
    with pytest.raises(ConfigError, match=r"log_artifacts"):
        load_config({**config.to_dict(), "loggers": [{**spec, "log_artifacts": "sometimes"}]})
