"""Checkpoints in a bucket: a real S3-compatible server (moto) on loopback, save, load, SIGKILL and autoresume."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import types

import boto3
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from moto.server import ThreadedMotoServer

from composerjax import ArrayLoader, Trainer
from composerjax.checkpoint.checkpointer import CheckpointSaveError
from composerjax.checkpoint.saver import checkpoint_location
from composerjax.checkpoint.storage import MARKER, RemoteFolder, storage_for

SCRIPT = os.path.join(os.path.dirname(__file__), "remote_resume_script.py")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 (a free port), reached through the standard ``AWS_*`` variables; its client."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
                            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                            "COMPOSERJAX_CHECKPOINT_STAGING": str(tmp_path_factory.mktemp("staging"))}.items():
            patch.setenv(name, value)
        client = boto3.client("s3")
        client.create_bucket(Bucket="ckpt")
        yield client
    server.stop()


def keys(client, prefix: str) -> list[str]:
    return sorted(item["Key"] for item in client.list_objects_v2(Bucket="ckpt", Prefix=prefix).get("Contents", []))


def regression_trainer(seed: int = 0, **kwargs) -> Trainer:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype(np.float32), rng.normal(size=(32, 1)).astype(np.float32)
    rngs = nnx.Rngs(seed)
    model = nnx.Sequential(nnx.Linear(6, 8, rngs=rngs), nnx.relu, nnx.Linear(8, 1, rngs=rngs))
    return Trainer(model, ArrayLoader((x, y), batch_size=8, seed=3), kwargs.pop("max_duration", "4ba"),
                   optax.adam(1e-2), loss_fn=lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), progress_bar=False,
                   run_summary=False, **kwargs)


def values(trainer: Trainer) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(trainer.state.train_state))]


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b) > 4  # params, adam moments and count, clock
    for left, right in zip(a, b):
        np.testing.assert_array_equal(left, right)


def test_save_to_s3_then_load_path_restores_bit_identical(s3):
    trainer = regression_trainer(save_folder="s3://ckpt/save", save_interval="2ba")
    trainer.fit()
    trainer.close()
    stored = keys(s3, "save/")
    assert [k for k in stored if k.endswith(MARKER)] == [f"save/ep0-ba2/{MARKER}", f"save/ep1-ba4/{MARKER}"]
    assert "save/ep1-ba4/_CHECKPOINT_METADATA" in stored and any(k.startswith("save/ep1-ba4/state/") for k in stored)
    assert s3.get_object(Bucket="ckpt", Key="save/latest")["Body"].read() == b"ep1-ba4\n"
    marker = json.loads(s3.get_object(Bucket="ckpt", Key=f"save/ep1-ba4/{MARKER}")["Body"].read())
    assert marker["batch"] == 4 and marker["files"] == {  # the manifest names every file with its size
        key[len("save/ep1-ba4/"):]: s3.head_object(Bucket="ckpt", Key=key)["ContentLength"]
        for key in stored if key.startswith("save/ep1-ba4/") and not key.endswith(MARKER)}
    assert trainer.checkpointer.last_saved_path == "s3://ckpt/save/ep1-ba4"
    staging = os.path.join(os.environ["COMPOSERJAX_CHECKPOINT_STAGING"], "s3", "ckpt", "save")
    assert os.listdir(staging) == [".composerjax-owner"]  # each staged copy is dropped once the bucket has it
    for load_path in ("s3://ckpt/save/ep1-ba4", "s3://ckpt/save/latest", "s3://ckpt/save"):
        loaded = regression_trainer(seed=1, load_path=load_path)  # other initial weights: all of them replaced
        assert loaded.resumed_from == 4 and loaded.state.timestamp.batch == 4
        assert_same(values(trainer), values(loaded))
        loaded.close()
    older = regression_trainer(seed=1, load_path="s3://ckpt/save/ep0-ba2", load_weights_only=True)
    assert older.resumed_from == 2 and older.state.timestamp.batch == 0
    assert not all(np.array_equal(a, b) for a, b in zip(values(trainer), values(older)))


def test_an_upload_cut_short_is_not_saved_and_autoresume_takes_the_one_before(s3, monkeypatch):
    upload = RemoteFolder.upload

    def cut_after_half_the_files(self, local, name, record):
        if name.endswith("-ba4"):  # half the files go up, then the connection drops
            real = self.fs.put

            def put_half(sources, targets, **options):
                real(sources[: len(sources) // 2], targets[: len(targets) // 2], **options)
                raise OSError("connection reset")

            self.fs.put = put_half
        return upload(self, local, name, record)

    monkeypatch.setattr(RemoteFolder, "upload", cut_after_half_the_files)
    trainer = regression_trainer(save_folder="s3://ckpt/cut", save_interval="2ba")
    with pytest.raises(CheckpointSaveError, match=r"ep1-ba4 was not saved .*upload failed: OSError: connection reset"):
        trainer.fit()
    trainer.close()
    assert trainer.checkpointer.last_saved == 2  # never reported as saved
    stored = keys(s3, "cut/ep1-ba4/")
    assert stored and f"cut/ep1-ba4/{MARKER}" not in stored  # some files, no marker
    assert s3.get_object(Bucket="ckpt", Key="cut/latest")["Body"].read() == b"ep0-ba2\n"
    monkeypatch.setattr(RemoteFolder, "upload", upload)
    resumed = regression_trainer(seed=1, save_folder="s3://ckpt/cut", save_interval="2ba", autoresume=True)
    assert resumed.resumed_from == 2 and resumed.checkpointer.steps() == [2]
    resumed.fit()  # saves ep1-ba4 again: the leftovers of the cut upload are replaced, not mixed in
    resumed.close()
    assert resumed.checkpointer.steps() == [2, 4]
    assert_same(values(trainer), values(resumed))  # the cut run's own batch 4: the resume is exact


def test_sigkill_mid_upload_then_autoresume_from_the_bucket_is_bit_identical(s3, tmp_path):
    """Killed uploading checkpoint 10 (files up, marker not): the resume starts from 8, mid-epoch, and matches."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")

    def start(out, *args):
        return subprocess.Popen([sys.executable, SCRIPT, str(tmp_path / out), *args], env=env, text=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def run(out, *args, expect=0, process=None):
        process = process or start(out, *args)
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == expect, stderr[-3000:]

    reference = start("reference")  # uninterrupted, no checkpoints; alongside the killed run
    run("killed", "--save-folder", "s3://ckpt/killed", "--kill-uploading", "10", expect=-signal.SIGKILL)
    stored = keys(s3, "killed/")
    assert sorted(k.split("/")[1] for k in stored if k.endswith(MARKER)) == ["ep0-ba2", "ep0-ba4", "ep1-ba6",
                                                                             "ep1-ba8"]
    assert any(k.startswith("killed/ep1-ba10/") for k in stored)  # half uploaded: files, no marker
    run("resumed", "--save-folder", "s3://ckpt/killed", "--autoresume")
    with open(tmp_path / "resumed" / "result.json") as handle:
        assert json.load(handle) == {"resumed_from": 8, "batch": 12}  # 8 = batch 2 of epoch 1's 6
    run("reference", process=reference)
    with np.load(tmp_path / "reference" / "final.npz") as reference, np.load(tmp_path / "resumed" / "final.npz") as got:
        assert_same([reference[n] for n in sorted(reference.files)], [got[n] for n in sorted(got.files)])


def test_unsupported_schemes_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"save_folder='ftp://host/run': unsupported scheme 'ftp://'; expected a "
                                         r"local folder, 's3://bucket/path' or 'gs://bucket/path'"):
        regression_trainer(save_folder="ftp://host/run")
    with pytest.raises(ValueError, match=r"load_path='ftp://host/run': unsupported scheme 'ftp://'"):
        regression_trainer(load_path="ftp://host/run")
    with pytest.raises(ValueError, match=r"load_path='s3://': no bucket"):
        checkpoint_location("s3://")


def test_gs_uris_go_to_gcsfs_through_fsspec(monkeypatch):
    """No GCS emulator here: the URI is parsed, and the file system asked of fsspec is gcsfs's 'gcs'."""
    import fsspec

    asked = []
    monkeypatch.setitem(sys.modules, "gcsfs", types.ModuleType("gcsfs"))
    monkeypatch.setattr(fsspec, "filesystem", lambda protocol, **options: asked.append((protocol, options)) or "fs")
    store = storage_for("gs://bucket/runs/x/", "save_folder")
    assert (store.uri, store.key("ep1-ba8", MARKER), store.path("ep1-ba8")) == (
        "gs://bucket/runs/x", f"bucket/runs/x/ep1-ba8/{MARKER}", "gs://bucket/runs/x/ep1-ba8")
    assert store.fs == "fs" and asked == [("gcs", {"use_listings_cache": False, "skip_instance_cache": True})]


def test_gs_without_gcsfs_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # import gcsfs fails
    with pytest.raises(ImportError, match=r"save_folder='gs://bucket/run' needs the 'gcsfs' package for gs:// URIs: "
                                          r"pip install gcsfs"):
        regression_trainer(save_folder="gs://bucket/run")
