"""One settings schema: the recipe schema, --set, hparams and to_config all follow Trainer.__init__."""

from __future__ import annotations

import inspect
import json
import typing

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ComposerClassifier, Trainer
from composerjax.callbacks import SpeedMonitor
from composerjax.data import ArrayLoader
from composerjax.trainer import settings
from composerjax.trainer.config import ConfigError, TrainerConfig, load_config
from composerjax.trainer.settings import REQUIRED, hyperparameters, recipe_arguments, schema_problems

RECIPE = {
    "model": {"name": "mlp", "sizes": [64, 16, 10]},
    "data": {"name": "digits", "batch_size": 100},
    "max_duration": "4ba",
    "progress_bar": False,
    "run_summary": False,
}


def count_tokens(batch) -> int:
    """A tokens_per_batch for the tests: one token per example."""
    return int(batch[0].shape[0])


def keep_order(algorithms, event):
    """An engine pass that changes nothing."""
    return list(algorithms)


def recipe_defaults(model: type[TrainerConfig] = TrainerConfig) -> dict[str, typing.Any]:
    """``{field: default}`` of a recipe schema, REQUIRED for a field that must be given."""
    return {name: REQUIRED if info.is_required() else info.get_default(call_default_factory=True)
            for name, info in model.model_fields.items()}


def with_extra(*extra: inspect.Parameter):
    """A stand-in for Trainer.__init__ with more arguments: its signature and type hints."""
    signature = inspect.signature(Trainer.__init__)

    def init(*args, **kwargs):
        pass

    init.__signature__ = signature.replace(parameters=[*signature.parameters.values(), *extra])
    init.__annotations__ = {**typing.get_type_hints(Trainer.__init__), **{p.name: p.annotation for p in extra}}
    return init


def keyword(name: str, annotation, default) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)


# -- the schema follows the signature --------------------------------------------------------------
def test_every_trainer_argument_is_a_recipe_field_with_its_default_or_listed():
    assert schema_problems(settings.trainer_signature(), recipe_defaults()) == []
    fields = TrainerConfig.model_fields
    for name in ("steps_per_call", "handle_signals", "tokens_per_batch", "algorithm_passes", "loss_fn", "devices"):
        assert name in fields, name
    assert fields["steps_per_call"].default == "auto" and fields["handle_signals"].default is True
    assert fields["max_duration"].is_required()  # RECIPE_DEFAULTS, with its reason
    # Sections stand where the Trainer's arguments they build stand.
    assert list(fields)[:4] == ["model", "data", "max_duration", "optimizer"]


def test_the_check_catches_an_argument_the_schema_does_not_follow():
    extra = keyword("new_setting", int, 3)
    problems = schema_problems(inspect.signature(with_extra(extra)), recipe_defaults())
    assert len(problems) == 1 and problems[0].startswith("new_setting: a Trainer argument (default 3)")


def test_the_check_catches_a_changed_default_and_a_field_with_no_argument():
    signature = settings.trainer_signature()
    parameters = [p.replace(default=5) if p.name == "seed" else p for p in signature.parameters.values()]
    problems = schema_problems(signature.replace(parameters=parameters), recipe_defaults())
    assert problems == ["seed: the recipe default is 0, the Trainer's is 5"]
    problems = schema_problems(signature, {**recipe_defaults(), "old_setting": 1})
    assert problems == ["old_setting: a recipe field that is no Trainer argument nor a recipe section"]


def test_a_new_argument_joins_the_schema_with_its_default_unless_it_has_no_recipe_form():
    init = with_extra(keyword("new_setting", int | None, 3), keyword("mesh", jax.sharding.Mesh | None, None))
    derived = recipe_arguments(init)
    assert derived["new_setting"].default == 3 and derived["new_setting"].recipe_type == int | None
    assert "mesh" not in derived  # no YAML form: the check says where to declare one
    fields = {**recipe_defaults(), **{name: argument.default for name, argument in derived.items()}}
    problems = schema_problems(inspect.signature(init), fields)
    assert len(problems) == 1 and problems[0].startswith("mesh: a Trainer argument (default None)")
    assert "RECIPE_FORMS" in problems[0] and "NOT_IN_RECIPE" in problems[0]


def test_recipe_types_come_from_the_type_hints():
    from composerjax.core.time import Time

    assert settings.recipe_type(Time | str | int | None) == typing.Union[str, int, None]  # noqa: UP007
    assert settings.recipe_type(typing.Sequence[int]) == list[int]  # noqa: UP006
    assert settings.recipe_type(typing.Literal["a", "b"]) == typing.Literal["a", "b"]
    assert settings.recipe_type(optax.GradientTransformation | None) is None
    assert settings.recipe_type(type(None)) is type(None)


# -- settable from a recipe and --set, and back ----------------------------------------------------
def test_new_settings_from_set_build_the_trainer_and_round_trip():
    overrides = ["steps_per_call=2", "handle_signals=false", "tokens_per_batch=test_settings_schema:count_tokens",
                 "algorithm_passes=[test_settings_schema:keep_order, [test_settings_schema:keep_order, 5]]"]
    config = load_config(RECIPE, overrides)
    assert (config.steps_per_call, config.handle_signals) == (2, False)
    trainer = Trainer.from_config(config)
    assert trainer.settings.run.tokens_per_batch is count_tokens
    assert trainer.settings.run.algorithm_passes == [keep_order, (keep_order, 5)]
    trainer.fit()
    assert trainer.state.timestamp.token == 4 * 100  # the function the recipe named counted them
    back = trainer.to_config()
    assert back.tokens_per_batch == "test_settings_schema:count_tokens"
    assert (back.steps_per_call, back.handle_signals) == (2, False)
    assert back.algorithm_passes == ["test_settings_schema:keep_order", ("test_settings_schema:keep_order", 5)]
    again = Trainer.from_config(json.loads(json.dumps(back.to_dict())))
    assert again.to_config() == back
    trainer.close()
    again.close()


def test_every_setting_round_trips_through_the_trainer():
    values = {**RECIPE, "seed": 7, "log_interval": 3, "eval_interval": "2ba", "save_interval": "2ba",
              "devices": [0], "parallelism": "ddp", "precision": "bf16", "run_name": "schema-test",
              "time_limit": "1h", "skip_nonfinite_updates": True, "device_memory_budget": 2**30,
              "device_train_microbatch_size": 50, "save_num_checkpoints_to_keep": 2}
    config = load_config(values)
    trainer = Trainer.from_config(config)
    back = trainer.to_config().to_dict()
    for name, value in values.items():
        assert back[name] == value, name
    assert back["steps_per_call"] == "auto" and back["handle_signals"] is True and back["tokens_per_batch"] is None
    trainer.close()


def test_a_setting_passed_in_python_is_written_as_its_import_path_or_refused():
    config = load_config(RECIPE)
    trainer = Trainer.from_config(config, tokens_per_batch=count_tokens)
    assert trainer.to_config().tokens_per_batch == "test_settings_schema:count_tokens"
    trainer.close()
    trainer = Trainer.from_config(config, tokens_per_batch=lambda batch: 1)
    with pytest.raises(ValueError, match=r"to_config\(\): tokens_per_batch=.*lambda.* no import path"):
        trainer.to_config()
    trainer.close()


def test_parallelism_as_a_mapping_builds_a_parallelism_config():
    from composerjax.parallel import ParallelismConfig

    rules = "composerjax.parallel:GPT_TENSOR_PARALLEL_RULES"
    config = load_config(RECIPE, [f"parallelism={{fsdp: 1, tensor: 1, rules: {rules}}}"])
    arguments = settings.recipe_to_arguments(config.arguments())
    assert isinstance(arguments["parallelism"], ParallelismConfig) and len(arguments["parallelism"].rules) == 8
    assert settings.arguments_to_recipe(arguments, config.to_dict())["parallelism"] == {
        "fsdp": 1, "tensor": 1, "min_fsdp_size": 0, "rules": rules}


def test_bad_settings_are_all_listed_with_their_path_value_and_what_is_accepted():
    bad = ["steps_per_call=0", "handle_signals=maybe", "tokens_per_batch=count_tokens",
           "loss_fn=no_such_module:loss", "algorithm_passes=[math:pi]", "parallelism={fsdp: 0}",
           "devices=[gpu]"]
    with pytest.raises(ConfigError) as caught:
        load_config(RECIPE, bad)
    problems = caught.value.problems
    text = "\n".join(problems)
    assert any(p.startswith("steps_per_call:") and "greater than or equal to 1" in p and "(got 0)" in p
               for p in problems), text
    assert any(p.startswith("handle_signals:") and "'maybe'" in p for p in problems), text
    assert "tokens_per_batch: expected an import path 'package.module:attr' (got 'count_tokens')" in problems
    assert any(p.startswith("loss_fn:") and "no_such_module" in p for p in problems), text
    assert "algorithm_passes[0]: 'math:pi' is a float; expected a function" in problems
    assert any(p.startswith("parallelism:") and "fsdp=0" in p for p in problems), text
    assert any(p.startswith("devices") and "'gpu'" in p for p in problems), text


# -- hparams ---------------------------------------------------------------------------------------
def test_hyperparameters_are_read_from_the_arguments_and_the_state():
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    loader = ArrayLoader((x, y), batch_size=16)
    trainer = Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2), loader, max_duration="2ep",
                      optimizers=optax.sgd(0.1), eval_dataloader=loader, callbacks=SpeedMonitor(window_size=3),
                      progress_bar=False, run_summary=False, seed=5, run_name="hp", time_limit="1h",
                      save_interval="3ba")
    hparams = hyperparameters(trainer.settings, trainer.state, trainer.runner, trainer.logger.destinations,
                              trainer.mesh)
    assert list(hparams) == ["run_name", "max_duration", "seed", "precision", "optimizer", "algorithms", "callbacks",
                             "loggers", "device_train_microbatch_size", "accumulate_train_batch_on_tokens",
                             "device_memory_budget", "log_interval",
                             "parallelism", "mesh", "devices", "processes", "eval_interval", "save_interval",
                             "save_weights_only", "time_limit", "skip_nonfinite_updates", "dataloader_len",
                             "versions"]
    assert hparams["run_name"] == "hp" and hparams["max_duration"] == "2ep" and hparams["seed"] == 5
    assert hparams["eval_interval"] == "1ep"  # the default with eval data
    assert [c["name"] for c in hparams["callbacks"]] == ["SpeedMonitor"]
    assert hparams["callbacks"][0]["hparams"]["window_size"] == 3
    assert (hparams["save_interval"], hparams["time_limit"], hparams["dataloader_len"]) == ("3ba", "1h", 4)
    assert hparams["devices"] == jax.device_count() and hparams["parallelism"] == "auto"
    assert json.loads(json.dumps(hparams)) == hparams
    assert trainer.hparams == hparams  # what Trainer.__init__ records (before issue 15: its own copy of this code)
    trainer.close()
