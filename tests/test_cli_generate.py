"""``composerjax generate RUN_DIR``: text from a trained GPT2's run folder, and the recipe ``train`` leaves there.

One tiny run (gpt2 on 6 standard-library files, 4 batches, a checkpoint at the end) is trained
once through ``composerjax train``; every test reads its folder.
"""

import shutil
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from composerjax.cli import main
from composerjax.cli_generate import RECIPE_FILE, load_model_weights, write_run_recipe
from composerjax.data.tokenizer import decode, eos_id, load_tokenizer
from composerjax.models import generation
from composerjax.models.factories import gpt2
from composerjax.models.generation import generate
from composerjax.trainer import build_trainer
from composerjax.trainer.config import load_config

MODEL = {"name": "gpt2", "config": "gpt2-tiny", "vocab_size": 300, "n_positions": 64, "n_embd": 32, "n_layer": 1,
         "n_head": 2}
RECIPE = {
    "run_name": "lm",
    "model": MODEL,
    "data": {"name": "stdlib_lm", "seq_len": 32, "batch_size": 4, "vocab_size": 300, "max_files": 6,
             "validation_fraction": 0.0},
    "optimizer": {"name": "adam", "lr": 0.01},
    "max_duration": "1ep",
    "save_folder": "runs/{run_name}/checkpoints",
    "progress_bar": False,
    "run_summary": False,
}
RUN = "runs/lm"
CHECKPOINTS = "runs/lm/checkpoints"


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    """The folder ``composerjax train`` ran in (relative paths: ``runs/lm``, its checkpoints and tokenizer)."""
    root = tmp_path_factory.mktemp("generate")
    (root / "recipe.yaml").write_text(yaml.safe_dump(RECIPE, sort_keys=False))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        assert main(["train", "recipe.yaml", "--set", "max_duration=4ba"]) == 0
    return root


@pytest.fixture
def in_run_root(run_root, monkeypatch, capsys):
    monkeypatch.chdir(run_root)
    capsys.readouterr()  # what the training printed
    return run_root


def generated(capsys, *args):
    """``composerjax generate ARGS``'s stdout, without the newline ``print`` adds."""
    assert main(["generate", *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out.removesuffix("\n")


@pytest.fixture(scope="module")
def trainer_loaded(run_root):
    """The GPT2 as the Trainer loads the checkpoint (``load_path``, ``load_weights_only``): the reference."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(run_root)
        trainer = build_trainer(load_config(f"{RUN}/{RECIPE_FILE}"), load_path=CHECKPOINTS, load_weights_only=True,
                                save_folder=None, loggers=[], callbacks=[])
        try:
            return on_one_device(trainer.state.model.module)
        finally:
            trainer.close()


def untrained():
    """The recipe's model as initialised, before training."""
    return on_one_device(gpt2(**{key: value for key, value in MODEL.items() if key != "name"}))


def on_one_device(module):
    """``module`` with its arrays committed to one device, as the command's are (so they share its compiles)."""
    nnx.update(module, jax.device_put(nnx.state(module), jax.devices()[0]))
    return module


def prompt_ids(text):
    return jnp.asarray([load_tokenizer(f"{RUN}/tokenizer.json").encode(text).ids], jnp.int32)


def test_train_writes_the_recipe_it_ran_to_the_run_folder(in_run_root):
    written = in_run_root / RUN / RECIPE_FILE

    assert written.is_file()
    ran = load_config("recipe.yaml", ["max_duration=4ba"])
    assert load_config(written).to_dict() == ran.to_dict()  # the --set override included
    assert load_config(written).max_duration == "4ba"


def test_a_recipe_without_a_run_name_is_written_with_the_one_the_run_got(tmp_path):
    config = load_config({"model": MODEL, "data": {"name": "stdlib_lm"}, "max_duration": "1ba",
                          "save_folder": "{run_name}/ckpt"})
    trainer = types.SimpleNamespace(config=config, state=types.SimpleNamespace(run_name="run-20250101-000000",
                                                                               run_dir=str(tmp_path / "run")))

    path = write_run_recipe(trainer)

    assert path == str(tmp_path / "run" / RECIPE_FILE)
    reread = load_config(path)
    assert reread.run_name == "run-20250101-000000" and reread.save_folder == "{run_name}/ckpt"
    assert reread.model.to_dict() == MODEL


def test_the_weights_loaded_are_the_checkpoints(in_run_root, trainer_loaded):
    loaded, batch = load_model_weights(untrained(), CHECKPOINTS)
    reference, fresh = trainer_loaded, untrained().module

    assert batch == 4
    ours, theirs, initial = (jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (loaded.module, reference, fresh))
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(np.asarray(a), np.asarray(c)) for a, c in zip(ours, initial))


def test_greedy_generation_prints_the_trained_models_continuation(in_run_root, trainer_loaded, capsys):
    text = generated(capsys, RUN, "--prompt", "return ", "--max-new-tokens", "12")

    tokenizer = load_tokenizer(f"{RUN}/tokenizer.json")
    expected = decode(tokenizer, generate(trainer_loaded, prompt_ids("return "), 12)[0].tolist())
    fresh = decode(tokenizer, generate(untrained().module, prompt_ids("return "), 12)[0].tolist())
    assert text == expected
    assert text.startswith("return ") and len(text) > len("return ")
    assert text != fresh  # the checkpoint's weights, not the recipe's initialisation
    # --checkpoint names one checkpoint (its folder or the latest link): the same, only one to load here.
    assert generated(capsys, RUN, "--prompt", "return ", "--max-new-tokens", "12", "--checkpoint",
                     f"{CHECKPOINTS}/latest") == expected


def test_sampling_is_reproducible_for_a_seed_and_differs_between_seeds(in_run_root, capsys):
    options = (RUN, "--prompt", "return ", "--max-new-tokens", "12", "--temperature", "1.0")
    first = generated(capsys, *options, "--seed", "1")
    again = generated(capsys, *options, "--seed", "1")
    other = generated(capsys, *options, "--seed", "2")
    top_1 = generated(capsys, *options, "--seed", "2", "--top-k", "1")
    greedy = generated(capsys, RUN, "--prompt", "return ", "--max-new-tokens", "12")

    assert first == again
    assert first != other
    assert top_1 == greedy  # among the single most likely token, sampling is greedy
    assert first != greedy


def test_all_new_tokens_come_from_one_compiled_function_compiled_once_per_length(in_run_root, capsys):
    compiles = []

    def listener(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    generation._generate_cached.clear_cache()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        cache_sizes, compiled = [], []
        for new_tokens in ("8", "8", "16", "16"):
            compiles.clear()
            generated(capsys, RUN, "--max-new-tokens", new_tokens)
            cache_sizes.append(generation._generate_cached._cache_size())
            compiled.append(len(compiles))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)

    # 8 new tokens: the generation loop compiles once; the same lengths again: nothing compiles at all;
    # 16: it compiles once more (one program for all 16 tokens, not one per token).
    assert cache_sizes == [1, 1, 2, 2]
    assert compiled[0] >= 1 and compiled[1] == 0 and compiled[2] >= 1 and compiled[3] == 0


def test_an_empty_prompt_starts_a_new_document(in_run_root, trainer_loaded, capsys):
    text = generated(capsys, RUN, "--max-new-tokens", "8")

    tokenizer = load_tokenizer(f"{RUN}/tokenizer.json")
    separator = jnp.asarray([[eos_id(tokenizer)]], jnp.int32)
    after_separator = generate(trainer_loaded, separator, 8)[0, 1:].tolist()
    assert text == decode(tokenizer, after_separator)  # the separator itself is not printed
    assert text != decode(tokenizer, generate(untrained().module, separator, 8)[0, 1:].tolist())


def run_copy(root, name, recipe=None, tokenizer=True):
    """A run folder ``name`` with the trained run's recipe (or ``recipe``) and tokenizer (if ``tokenizer``)."""
    folder = Path(root) / name
    folder.mkdir()
    values = yaml.safe_load((Path(root) / RUN / RECIPE_FILE).read_text())
    (folder / RECIPE_FILE).write_text(yaml.safe_dump({**values, **(recipe or {})}, sort_keys=False))
    if tokenizer:
        shutil.copy(Path(root) / RUN / "tokenizer.json", folder / "tokenizer.json")
    return str(folder)


ERRORS = {
    "no recipe": (lambda root: [str(root / "runs")], ["runs has no recipe.yaml", "composerjax train"]),
    "no tokenizer": (lambda root: [run_copy(root, "no_tokenizer", tokenizer=False)],
                     ["no_tokenizer has no tokenizer.json"]),
    "no checkpoint": (lambda root: [run_copy(root, "elsewhere", {"save_folder": "elsewhere/checkpoints"})],
                      ["no checkpoint", "elsewhere/checkpoints"]),
    "checkpoint option": (lambda root: [RUN, "--checkpoint", "runs/empty"],
                          ["no checkpoint", "runs/empty", "--checkpoint"]),
    "no save folder": (lambda root: [run_copy(root, "unsaved", {"save_folder": None})],
                       ["has no save_folder", "--checkpoint"]),
    "not a GPT2": (lambda root: [run_copy(root, "mlp", {"model": {"name": "mlp", "sizes": [4, 2]}})],
                   ["model.name='mlp'", "MLP", "GPT2", "no generation support"]),
    "prompt too long": (lambda root: [RUN, "--prompt", "x = 1\n" * 40],
                        ["--prompt", "n_positions=64"]),
    "too many new tokens": (lambda root: [RUN, "--prompt", "def ", "--max-new-tokens", "64"],
                            ["--max-new-tokens=64", "n_positions=64"]),
    "no new tokens": (lambda root: [RUN, "--max-new-tokens", "0"], ["--max-new-tokens=0", "positive"]),
    "negative temperature": (lambda root: [RUN, "--temperature", "-0.5"], ["--temperature=-0.5", ">= 0"]),
    "top-k below 1": (lambda root: [RUN, "--temperature", "1", "--top-k", "0"], ["--top-k=0", "positive"]),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_input_exits_2_naming_what_is_missing_or_wrong(case, in_run_root, capsys):
    make_args, mentions = ERRORS[case]
    (in_run_root / "runs" / "empty").mkdir(exist_ok=True)
    args = make_args(in_run_root)
    if "--max-new-tokens" not in args:
        args += ["--max-new-tokens", "8"]  # the default 64 would not fit n_positions=64

    status = main(["generate", *args])

    error = capsys.readouterr().err
    assert status == 2, error
    assert error.startswith("composerjax generate: error: ") and "Traceback" not in error
    for word in mentions:
        assert word in error, f"{case}: {word!r} not in {error!r}"


def test_help_describes_every_option_with_an_example(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])

    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for word in ("RUN_DIR", "--prompt", "--max-new-tokens", "--temperature", "--top-k", "--seed", "--checkpoint",
                 "recipe.yaml", "tokenizer.json", "exit statuses", "examples:", "composerjax generate runs/"):
        assert word in text, word
