"""Bad input that was silently wrong (or a bare traceback) is refused, naming the field, the value and what is accepted.

Command-line cases run ``composerjax.cli.main`` in-process and check the exact exit status (2 for bad
input) and that the one error names the field and the value; Python API cases check the exception.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import nnx

from composerjax import ArrayLoader, Callback, ComposerClassifier, Trainer
from composerjax.cli import main
from composerjax.core.time import Time
from composerjax.core.validation import check_seed
from composerjax.trainer import BatchError
from composerjax.trainer.config import ConfigError, load_config

# The smallest registered model that fits the digits data (10 classes): an MLP compiles in a blink.
TINY_RECIPE = {
    "run_name": "tiny",
    "model": {"name": "mlp", "sizes": [64, 16, 10]},
    "data": {"name": "digits", "batch_size": 16},
    "max_duration": "1ep",
    "seed": 0,
    "progress_bar": False,
    "run_summary": False,
}

HUGE_SEED = 2**70  # 1180591620717411303424


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(TINY_RECIPE, sort_keys=False))
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """``(exit status, stderr)`` of ``composerjax ARGV`` run in-process."""
    status = main([str(arg) for arg in argv])
    return status, capsys.readouterr().err


def assert_bad_input(status: int, error: str, command: str, *names: str) -> None:
    """Exit status 2, a readable message (no traceback) that names each of ``names``."""
    assert status == 2, error
    assert error.startswith(f"composerjax {command}: error: "), error
    assert "Traceback" not in error and "--debug" not in error, error
    for name in names:
        assert name in error, (name, error)


# -- recipe files ----------------------------------------------------------------------------------
def test_a_binary_recipe_file_exits_2_and_says_it_is_not_text(tmp_path, capsys):
    path = tmp_path / "weights.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    status, error = run_cli(capsys, "explain", path)
    assert_bad_input(status, error, "explain", str(path), "not a text file", "byte 0 is 0x89",
                     "expected a YAML or JSON recipe")


def test_a_directory_as_recipe_exits_2_and_says_it_is_a_directory(tmp_path, capsys):
    status, error = run_cli(capsys, "train", tmp_path)
    assert_bad_input(status, error, "train", str(tmp_path), "is a directory", "expected a YAML or JSON recipe file")
    assert "does not exist" not in error


@pytest.mark.parametrize(("text", "got"), [("", "got nothing (the file is empty)"), ("- a\n- b\n", "got a list")])
def test_a_recipe_that_is_not_a_mapping_exits_2_even_with_overrides(tmp_path, capsys, text, got):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    status, error = run_cli(capsys, "explain", path, "--set", "seed=1")
    assert_bad_input(status, error, "explain", "(top level)", "expected a mapping of settings", got)


def test_invalid_yaml_in_a_recipe_names_the_line(tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text("model: {name: mlp\n")
    status, error = run_cli(capsys, "explain", path)
    assert_bad_input(status, error, "explain", str(path), "is not valid YAML", "line 2")


# -- --set -----------------------------------------------------------------------------------------
def test_set_with_a_value_that_is_not_yaml_exits_2(recipe, capsys):
    status, error = run_cli(capsys, "explain", recipe, "--set", "model={name: [x")
    assert_bad_input(status, error, "explain", "--set model={name: [x", "not valid YAML")


def test_set_inside_a_plain_value_exits_2(recipe, capsys):
    status, error = run_cli(capsys, "explain", recipe, "--set", "seed.sub=1")
    assert_bad_input(status, error, "explain", "--set seed.sub", "seed is 0 (an int)", "not a mapping or a list",
                     "--set seed=VALUE")


def test_set_inside_a_missing_plain_setting_exits_2(recipe, capsys):
    status, error = run_cli(capsys, "explain", recipe, "--set", "log_interval.every=3")
    assert_bad_input(status, error, "explain", "log_interval", "valid integer", "(got {'every': 3})")


def test_set_a_list_index_on_a_mapping_exits_2(recipe, capsys):
    status, error = run_cli(capsys, "explain", recipe, "--set", "model[0]=x")
    assert_bad_input(status, error, "explain", "--set model[0]", "model is a mapping", "no item [0]")


def test_set_an_unknown_key_suggests_the_close_one(recipe, capsys):
    status, error = run_cli(capsys, "explain", recipe, "--set", "max_duraton=2ep")
    assert_bad_input(status, error, "explain", "max_duraton", "(got '2ep')", "did you mean 'max_duration'?")


# -- run length, seed, intervals -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "names"),
    [
        (f"seed={HUGE_SEED}", [f"seed={HUGE_SEED}", "expected an integer from 0 to 4294967295"]),
        ("seed=-1", ["seed=-1", "expected an integer from 0 to 4294967295"]),
        ("seed=true", ["seed=True", "got a bool"]),
        ("max_duration=1e20ba", ["max_duration", "'1e20ba'", "at most 9223372036854775807"]),
        ("max_duration=1e15ba", ["max_duration='1e15ba'", "spans 1000000000000000 batches", "at most 2147483647"]),
        ("eval_interval=2dur", ["eval_interval='2dur'", "at most 1 in 'dur'"]),
        ("save_interval=10sp", ["save_interval='10sp'", "epochs or batches"]),
        ("log_interval=0", ["log_interval", "greater than or equal to 1", "(got 0)"]),
        ("save_num_checkpoints_to_keep=0", ["save_num_checkpoints_to_keep", "-1 to keep all", "(got 0)"]),
        ("device_train_microbatch_size=0", ["device_train_microbatch_size", "'auto'", "(got 0)"]),
        ("precision=fp17", ["precision='fp17'", "'fp32', 'amp_bf16', 'bf16'"]),
        # YAML reads 1e400 as a string that pydantic turns into inf: every update would be NaN.
        ("optimizer.lr=1e400", ["optimizer.lr", "finite number", "(got '1e400')"]),
        ("optimizer={name: adamw, weight_decay: .inf}", ["optimizer.weight_decay", "finite number", "(got inf)"]),
    ],
)
def test_bad_settings_are_refused_at_validation_with_exit_2(recipe, capsys, override, names):
    status, error = run_cli(capsys, "explain", recipe, "--set", override)
    assert_bad_input(status, error, "explain", *names)


@pytest.mark.parametrize(
    ("override", "names"),
    [
        # 'tok' needs tokens_per_batch, which a recipe cannot give: it would train forever.
        ("max_duration=1tok", ["max_duration='1tok'", "tokens_per_batch", "ep, ba, sp or sec"]),
        # Epochs are counted in batches once the data's length is known: 1e12 epochs overflow the step counter.
        ("max_duration=1e12ep", ["max_duration='1e12ep'", "batches; expected at most 2147483647"]),
        # The model factory's own range check, and a seed too large for nnx.Rngs.
        ("model.sizes=[64, 16, 1]", ["model", "num_classes=1", "expected an integer >= 2"]),
        (f"model.seed={HUGE_SEED}", ["model.seed", f"{HUGE_SEED} is too large"]),
        ("data.batch_size=0", ["data.batch_size", "got 0"]),
        ("data.batch_size=100000", ["data.batch_size", "no batch would be produced", "batch_size=100000"]),
    ],
)
def test_bad_settings_only_the_data_or_factories_show_exit_2(recipe, capsys, override, names):
    status, error = run_cli(capsys, "train", recipe, "--set", override)
    assert_bad_input(status, error, "train", *names)


def test_every_settings_problem_is_listed_at_once():
    with pytest.raises(ConfigError) as error:
        load_config({**TINY_RECIPE, "seed": HUGE_SEED, "eval_interval": "2dur", "log_interval": 0})
    fields = sorted(problem.split(":")[0].split("=")[0] for problem in error.value.problems)
    assert fields == ["eval_interval", "log_interval", "seed"], error.value.problems


# -- Time and seed, in Python ----------------------------------------------------------------------
def test_a_time_count_over_64_bits_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"invalid time string '1e20ba': batch counts must fit in 64 bits: at most "
                                         r"9223372036854775807"):
        Time.from_timestring("1e20ba")
    with pytest.raises(ValueError, match="token counts must fit in 64 bits"):
        Time(2**63, "tok")
    assert Time(2**63 - 1, "sp").value == 2**63 - 1


@pytest.mark.parametrize("seed", [HUGE_SEED, -1, 2**32, True, 1.0, "3"])
def test_check_seed_refuses_what_jax_cannot_key_distinctly(seed):
    with pytest.raises(ValueError, match=rf"seed={seed!r}: expected an integer from 0 to 4294967295"):
        check_seed(seed)
    assert check_seed(np.int64(7)) == 7 and type(check_seed(np.int64(7))) is int


# -- the Trainer (needs the trainer.py patch of issue item 8) --------------------------------------
def data(labels: np.ndarray | None = None, size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    size = size if labels is None else len(labels)
    x = np.random.default_rng(0).normal(size=(size, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) if labels is None else labels
    return x, y


def make_trainer(labels: np.ndarray | None = None, **arguments) -> Trainer:
    # time_limit: were a run that never ends let through, the test fails instead of hanging.
    arguments = {"max_duration": "2ba", "optimizers": optax.sgd(0.1), "progress_bar": False, "run_summary": False,
                 "time_limit": "20s", **arguments}
    return Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2),
                   ArrayLoader(data(labels), batch_size=16, shuffle=False), **arguments)


def test_trainer_refuses_a_token_duration_it_cannot_count():
    with pytest.raises(ValueError, match=r"max_duration='1tok': a run measured in tokens needs tokens_per_batch"):
        make_trainer(max_duration="1tok")
    trainer = make_trainer(max_duration="1tok", tokens_per_batch=lambda batch: batch[0].size)
    trainer.fit()  # 16 * 4 tokens in the first batch: done
    assert trainer.state.timestamp.batch == 1


def test_fit_refuses_a_token_duration_and_a_state_max_duration_in_tokens():
    trainer = make_trainer()
    with pytest.raises(ValueError, match=r"duration='1tok': a run measured in tokens needs tokens_per_batch"):
        trainer.fit(duration="1tok")
    trainer.state.max_duration = "100tok"
    with pytest.raises(ValueError, match=r"max_duration='100tok': a run measured in tokens"):
        trainer.fit()
    assert trainer.state.timestamp.batch == 0


class SwitchToTokens(Callback):
    """Sets ``state.max_duration`` to tokens in the middle of the first epoch."""

    def batch_end(self, state, logger):
        state.max_duration = "1000tok"


def test_a_token_duration_set_during_fit_stops_at_the_epoch_end():
    trainer = make_trainer(max_duration="2ep", callbacks=[SwitchToTokens()])
    with pytest.raises(ValueError, match=r"state.max_duration='1000tok': a run measured in tokens"):
        trainer.fit()
    assert trainer.state.timestamp.batch == 4  # one epoch, not forever


def test_trainer_refuses_a_run_longer_than_the_step_counter():
    with pytest.raises(ValueError, match=r"max_duration='1e15ba' spans 1000000000000000 batches; expected at most "
                                         r"2147483647"):
        make_trainer(max_duration="1e15ba")
    with pytest.raises(ValueError, match=r"max_duration: invalid time string '1e20ba'"):
        make_trainer(max_duration="1e20ba")


@pytest.mark.parametrize("seed", [HUGE_SEED, 2**64, -1, True])
def test_trainer_refuses_a_seed_jax_cannot_key(seed):
    with pytest.raises(ValueError, match=rf"seed={seed!r}: expected an integer from 0 to 4294967295"):
        make_trainer(seed=seed)


def test_trainer_refuses_a_token_eval_interval_without_a_token_counter():
    with pytest.raises(ValueError, match=r"eval_interval='1tok': 'tok' intervals need Trainer\(tokens_per_batch"):
        make_trainer(eval_dataloader=ArrayLoader(data(), batch_size=16), eval_interval="1tok")


@pytest.mark.parametrize(("interval", "message"), [("2dur", "at most 1 in 'dur'"), ("3 weeks", "")])
def test_trainer_refuses_an_eval_interval_that_is_not_one(interval, message):
    with pytest.raises(ValueError, match=rf"eval_interval(='{interval}')?: .*{message}"):
        make_trainer(eval_dataloader=ArrayLoader(data(), batch_size=16), eval_interval=interval)


@pytest.mark.parametrize(("bad", "position"), [(2, 20), (-1, 37), (7, 63)])
def test_labels_outside_the_classes_are_refused_at_the_batch_that_holds_them(bad, position):
    labels = data()[1].copy()
    labels[position] = bad
    trainer = make_trainer(labels, max_duration="1ep")
    with pytest.raises(BatchError) as error:
        trainer.fit()
    batch, index = divmod(position, 16)
    assert str(error.value).startswith(
        f"train_dataloader batch {batch}: batch[1] (labels) holds {bad} at index ({index},): expected class indices "
        "from 0 to 1 (num_classes=2)")
    assert trainer.state.timestamp.batch == batch  # refused before the step, nothing trained on it


def test_labels_outside_the_classes_are_refused_in_eval_and_in_stacked_groups():
    labels = data()[1].copy()
    labels[5] = 9
    trainer = make_trainer(eval_dataloader=ArrayLoader(data(labels), batch_size=16, shuffle=False))
    with pytest.raises(BatchError, match=r"^eval_dataloader batch 0: batch\[1\] \(labels\) holds 9 at index \(5,\)"):
        trainer.eval()
    # Batch 0 runs alone, then batches 1-4 in one call: the bad label is in batch 2, sample 5.
    labels = data(size=128)[1].copy()
    labels[2 * 16 + 5] = 9
    grouped = make_trainer(labels, steps_per_call=4, max_duration="1ep")
    with pytest.raises(BatchError, match=r"^train_dataloader batch 1-4 \(stacked\): batch\[1\] \(labels\) holds 9 at "
                                         r"index \(1, 5\)"):
        grouped.fit()
    assert grouped.state.timestamp.batch == 1


def test_the_label_check_skips_device_arrays_and_soft_targets():
    classifier = ComposerClassifier(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), num_classes=3)
    x = np.zeros((2, 4), np.float32)
    classifier.check_batch((x, jnp.asarray([0, 5])))  # reading a jax.Array would wait for the device
    classifier.check_batch((x, np.asarray([[0.2, 0.8, 0.0], [1.0, 0.0, 0.0]], np.float32)))
    classifier.check_batch((x, np.asarray([[0, 2], [1, 1]], np.uint8)))  # (N, T) sequence labels
    with pytest.raises(ValueError, match=r"holds 3 at index \(1, 0\).*2 of 4 labels are out of range \(min -4, max 3"):
        classifier.check_batch((x, np.asarray([[0, 2], [3, -4]], np.int64)))


def test_labels_outside_the_recipe_model_exit_2(recipe, capsys):
    # digits has 10 classes; a 5-class model would train on NaN losses.
    status, error = run_cli(capsys, "train", recipe, "--set", "model.sizes=[64, 16, 5]")
    assert_bad_input(status, error, "train", "train_dataloader batch 0", "batch[1] (labels)",
                     "expected class indices from 0 to 4 (num_classes=5)")
