"""A third-party plugin, pip-installed, is found by name in every registry and trains like a built-in."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "composerjax_plugin_example"
DISTRIBUTION = "composerjax-plugin-example"


def pip(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"pip {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory):
    """Install the example plugin into this interpreter's environment for the module, then remove it."""
    # Building in a copy keeps build/ and *.egg-info out of the repository.
    source = tmp_path_factory.mktemp("plugin") / FIXTURE.name
    shutil.copytree(FIXTURE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    # An isolated build, like `make test`'s own install: the environment need not hold setuptools or wheel
    # (Python 3.12 venvs ship neither; this one's setuptools lacks bdist_wheel without the wheel package).
    pip("install", "--quiet", "--no-deps", str(source))
    yield DISTRIBUTION
    pip("uninstall", "--quiet", "--yes", DISTRIBUTION)


# Runs in a fresh interpreter, so the registries read the entry points the install just wrote.
SCRIPT = textwrap.dedent("""
    import json

    import optax

    from composerjax import Trainer, registry
    from composerjax.loggers import InMemoryLogger

    PLUGINS = {"algorithms": "scale_loss", "callbacks": "batch_counter", "loggers": "list_logger",
               "models": "tiny_linear", "data": "random_blobs"}
    found = {kind: [registry.REGISTRIES[kind].get(name).__module__, name in registry.REGISTRIES[kind].names()]
             for kind, name in PLUGINS.items()}


    def train(factor):
        splits = registry.data.get("RandomBlobs")(samples=64, batch_size=16)
        model = registry.models.get("tiny-linear")(features=4)
        scale_loss = registry.algorithms.get("scale_loss")
        hparams = registry.hparams_model(scale_loss)(factor=factor)
        counter = registry.callbacks.get("batch_counter")()
        listed = registry.loggers.get("list_logger")()
        memory = InMemoryLogger()
        trainer = Trainer(model, splits.train, "2ba", optax.sgd(0.1), algorithms=[scale_loss(**hparams.model_dump())],
                          callbacks=[counter], loggers=[listed, memory], log_interval=1, progress_bar=False,
                          run_summary=False)
        trainer.fit()
        traces = sorted({t.key for t in trainer.engine.trace_log if t.traced})
        return {"batches": counter.batches, "losses": [value for _, value in memory.data["loss/train/total"]],
                "listed_steps": [step for step, metrics in listed.records if "loss/train/total" in metrics],
                "traces": traces, "algorithm_name": registry.algorithms.name_of(trainer.state.algorithms[0])}


    print(json.dumps({"found": found, "describe": registry.describe_hparams(registry.algorithms.get("scale_loss")),
                      "half": train(0.5), "whole": train(1.0)}))
""")


def test_installed_plugin_is_found_and_trains(installed_plugin, tmp_path):
    # cwd=tmp_path: nothing the run writes lands in the repository, and no source tree shadows the install.
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])

    package = "composerjax_plugin_example"
    assert report["found"] == {
        "algorithms": [f"{package}.scale_loss", True],
        "callbacks": [f"{package}.batch_counter", True],
        "loggers": [f"{package}.list_logger", True],
        "models": [f"{package}.models", True],
        "data": [f"{package}.data", True],
    }
    assert report["describe"] == [{"name": "factor", "type": "float", "default": 1.0, "required": False,
                                   "description": "what the loss is multiplied by."}]

    half, whole = report["half"], report["whole"]
    assert half["batches"] == whole["batches"] == 2
    assert half["listed_steps"] == [1, 2]
    assert "ScaleLoss/AFTER_LOSS" in half["traces"]
    assert half["algorithm_name"] == "scale_loss"
    # Same weights and batch at step one: the scaled loss is exactly half (scaling by 2 is exact).
    assert half["losses"][0] == 0.5 * whole["losses"][0]
    # Half the loss is half the gradient: the second step moved less, so its losses differ.
    assert half["losses"][1] != 0.5 * whole["losses"][1]


def test_plugin_fixture_sources_stay_clean():
    leftovers = [p.name for p in FIXTURE.iterdir() if p.name == "build" or p.name.endswith(".egg-info")]
    assert leftovers == []


RECIPE = textwrap.dedent("""
    model: {name: tiny_linear, features: 4}
    data: {name: random_blobs, samples: 64, batch_size: 16}
    optimizer: {name: sgd, lr: 0.1}
    max_duration: 3ba
    progress_bar: false
    run_summary: false
    algorithms:
      - scale_loss: {factor: 0.5}
    callbacks: [batch_counter]
    loggers: [list_logger]
""")


def test_installed_plugin_is_used_by_name_from_a_yaml_recipe(installed_plugin, tmp_path):
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    trained = subprocess.run([sys.executable, "-m", "composerjax", "train", "recipe.yaml"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300, env=env)
    assert trained.returncode == 0, trained.stderr
    assert "3 batches" in trained.stdout
    explained = subprocess.run([sys.executable, "-m", "composerjax", "explain", "recipe.yaml", "--json"],
                               cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert explained.returncode == 0, explained.stderr
    events = {plan["event"]: plan["algorithms"] for plan in json.loads(explained.stdout)["events"]}
    assert events == {"AFTER_LOSS": ["ScaleLoss"]}
    # A typo in the plugin's hyperparameter is caught before anything runs, with its field path.
    (tmp_path / "bad.yaml").write_text(RECIPE.replace("factor: 0.5", "factr: 0.5"))
    bad = subprocess.run([sys.executable, "-m", "composerjax", "train", "bad.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and "algorithms[0].scale_loss.factr" in bad.stderr and "Traceback" not in bad.stderr
