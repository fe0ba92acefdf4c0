"""``composerjax train`` and ``composerjax explain`` on YAML recipes: the examples, errors, overrides, help."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import LM_RECIPE_OVERRIDES, prepare_example

from composerjax import registry
from composerjax.cli import main
from composerjax.trainer.config import ConfigError, load_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RECIPES = sorted(EXAMPLES.glob("*.yaml"))

# The smallest registered model that fits the digits data: an MLP compiles in a blink.
TINY_RECIPE = {
    "run_name": "tiny",
    "model": {"name": "mlp", "sizes": [64, 16, 10]},
    "data": {"name": "digits", "batch_size": 16},
    "max_duration": "1ep",
}

# A model factory that fails at build time, and one that stops the run like a signal would.
FAILING_FACTORIES = '''
import signal

from composerjax import TrainingInterrupted


def broken_model():
    raise RuntimeError("the model factory broke")


def interrupted_model():
    raise TrainingInterrupted(signal.SIGTERM)
'''


def composerjax(*args, cwd, pythonpath=None):
    """Run ``python -m composerjax ARGS`` in ``cwd``; return the CompletedProcess."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "composerjax", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def write_recipe(folder, values, name="recipe.yaml"):
    path = Path(folder) / name
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


def test_there_are_example_recipes():
    assert {path.name for path in RECIPES} >= {"digits_baseline.yaml", "digits_speedup.yaml", "gpt_pydoc.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_example_recipe_validates_and_explains(recipe, tmp_path):
    config = load_config(recipe)
    assert config.model.name and config.data.name and config.max_duration

    cpu_sized = [word for override in LM_RECIPE_OVERRIDES.get(recipe.name, []) for word in ("--set", override)]
    prepare_example(recipe.name, tmp_path)
    before = sorted(str(path) for path in tmp_path.rglob("*"))
    result = composerjax("explain", recipe, *cpu_sized, cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    assert sorted(str(path) for path in tmp_path.rglob("*")) == before  # explain writes nothing (no tokenizer)
    for spec in config.algorithms:
        assert registry.algorithms.get(spec.name).__name__ in result.stdout
    assert "conflicts" in result.stdout and "train step plans to compile" in result.stdout


def test_speedup_recipe_holds_the_documented_algorithms():
    config = load_config(EXAMPLES / "digits_speedup.yaml")

    assert [(spec.name, spec.hparams) for spec in config.algorithms] == [
        ("label_smoothing", {"smoothing": 0.1}),
        ("ema", {"half_life": "30ba"}),
        ("gradient_clipping", {"clipping_type": "norm", "clipping_threshold": 1.0}),
    ]
    assert (config.schedule.name, config.schedule.warmup, config.max_duration) == ("cosine", "10%", "4ep")


def test_explain_json_is_the_explanation_as_a_dict(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the recipe's FileLogger path is relative

    status = main(["explain", str(EXAMPLES / "digits_speedup.yaml"), "--json"])

    assert status == 0
    explanation = json.loads(capsys.readouterr().out)
    names = [name for plan in explanation["events"] for name in plan["algorithms"]]
    assert {"LabelSmoothing", "EMA", "GradientClipping"} <= set(names)


def test_set_overrides_the_recipe():
    config = load_config(EXAMPLES / "digits_speedup.yaml",
                         ["max_duration=2ba", "algorithms[0].label_smoothing.smoothing=0.2", "optimizer.lr=0.01"])

    assert config.max_duration == "2ba"
    assert config.algorithms[0].hparams == {"smoothing": 0.2}
    assert config.optimizer.lr == 0.01


def test_train_runs_a_recipe_end_to_end_with_overrides(tmp_path):
    recipe = write_recipe(tmp_path, TINY_RECIPE)

    result = composerjax("train", recipe, "--set", "max_duration=2ba", "--set", "progress_bar=false",
                         "--set", "run_summary=false", cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    assert "run tiny: 2 batches (0 epochs complete)" in result.stdout  # --set max_duration=2ba beat the recipe's 1ep
    assert "final train loss" in result.stdout
    assert "MulticlassAccuracy" in result.stdout and "CrossEntropy" in result.stdout
    assert "s wall" in result.stdout


def test_an_invalid_recipe_lists_every_problem_and_exits_2(tmp_path):
    recipe = write_recipe(tmp_path, {
        **TINY_RECIPE,
        "optimizer": {"name": "adamm"},
        "algorithms": [{"mixup": {"alpha": "lots", "nope": 2}}, {"mixpu": {}}],
    })

    for command in ("train", "explain"):
        result = composerjax(command, recipe, cwd=tmp_path)

        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        assert result.stderr.startswith(f"composerjax {command}: error: ")
        assert "algorithms[0].mixup.alpha" in result.stderr
        assert "algorithms[0].mixup.nope" in result.stderr
        assert "algorithms[1].name" in result.stderr and "did you mean 'mixup'" in result.stderr
        assert "optimizer.name" in result.stderr and "'adam'" in result.stderr
        assert result.stdout == ""


def test_an_out_of_range_hyperparameter_names_its_field():
    with pytest.raises(ConfigError) as error:
        load_config({**TINY_RECIPE, "algorithms": [{"mixup": {"alpha": -1}}]})

    assert any(problem.startswith("algorithms[0].mixup.alpha") for problem in error.value.problems)


def test_a_bad_override_or_a_missing_recipe_exits_2(tmp_path, capsys):
    recipe = write_recipe(tmp_path, TINY_RECIPE)

    assert main(["train", str(recipe), "--set", "max_duration"]) == 2
    assert "expected key.path=value" in capsys.readouterr().err
    assert main(["explain", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_runtime_error_is_one_line_and_debug_shows_the_traceback(tmp_path):
    (tmp_path / "failing_factories.py").write_text(FAILING_FACTORIES)
    recipe = write_recipe(tmp_path, {**TINY_RECIPE, "model": {"name": "failing_factories:broken_model"}})

    plain = composerjax("train", recipe, cwd=tmp_path, pythonpath=tmp_path)
    debug = composerjax("train", recipe, "--debug", cwd=tmp_path, pythonpath=tmp_path)
    global_debug = composerjax("--debug", "train", recipe, cwd=tmp_path, pythonpath=tmp_path)

    assert plain.returncode == 1
    assert "composerjax train: error: RuntimeError: the model factory broke" in plain.stderr
    assert "--debug" in plain.stderr and "Traceback" not in plain.stderr
    for result in (debug, global_debug):
        assert result.returncode == 1
        assert "Traceback" in result.stderr and "RuntimeError: the model factory broke" in result.stderr


def test_an_interrupted_run_exits_with_the_signal_status(tmp_path):
    (tmp_path / "failing_factories.py").write_text(FAILING_FACTORIES)
    recipe = write_recipe(tmp_path, {**TINY_RECIPE, "model": {"name": "failing_factories:interrupted_model"}})

    result = composerjax("train", recipe, cwd=tmp_path, pythonpath=tmp_path)

    assert result.returncode == 143, result.stderr  # 128 + SIGTERM, not the generic 1
    assert "error:" not in result.stderr


HELP_MENTIONS = {
    "train": ["RECIPE", "--set", "--debug", "exit statuses", "example"],
    "explain": ["RECIPE", "--set", "--json", "--debug", "exit statuses", "example"],
    "traces": ["RUN_DIR", "--diff", "--debug", "exit statuses", "example"],
    "plot": ["RUN_DIR", "--out", "--debug", "exit statuses", "example"],
    "generate": ["RUN_DIR", "--prompt", "--max-new-tokens", "--temperature", "--top-k", "--seed", "--checkpoint",
                 "--debug", "exit statuses", "example"],
    "launch": ["--num-processes", "--devices-per-process", "--port", "--grace-period", "SCRIPT", "ARGS", "--debug",
               "exit statuses", "example"],
}


@pytest.mark.parametrize("command", sorted(HELP_MENTIONS))
def test_every_subcommand_help_describes_its_arguments(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])

    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for word in HELP_MENTIONS[command]:
        assert word in text, f"composerjax {command} --help does not mention {word}"


def test_top_level_help_lists_train_and_explain(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])

    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "train" in text and "explain" in text and "--debug" in text
