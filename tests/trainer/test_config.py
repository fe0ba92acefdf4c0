"""TrainerConfig: round trips, every error path at once, schedules in Time units, explain against the trace log."""

from __future__ import annotations

import json

import numpy as np
import optax
import pytest

from composerjax import Trainer
from composerjax.core.event import TRAIN_STEP_EVENTS
from composerjax.explain import explain
from composerjax.trainer import build_trainer
from composerjax.trainer.config import ConfigError, TrainerConfig, learning_rate, load_config

RECIPE = {
    "model": {"name": "mlp", "sizes": [64, 16, 10]},
    "data": {"name": "digits", "batch_size": 100},
    "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.001},
    "schedule": {"name": "cosine", "warmup": "10%", "final_lr_fraction": 0.1},
    "max_duration": "2ep",
    "algorithms": [{"label_smoothing": {"smoothing": 0.1}}, {"name": "ema", "half_life": "5ba"},
                   "gradient_clipping"],
    "callbacks": [{"name": "speed_monitor", "window_size": 5}],
    "loggers": [{"in_memory": {}}],
    "progress_bar": False,
    "run_summary": False,
    "seed": 3,
}


def test_config_to_trainer_to_config_round_trips():
    config = load_config(RECIPE)
    trainer = Trainer.from_config(config)
    assert [type(a).__name__ for a in trainer.state.algorithms] == ["LabelSmoothing", "EMA", "GradientClipping"]
    assert trainer.state.algorithms[0].smoothing == 0.1 and trainer.settings.run.seed == 3
    back = trainer.to_config()
    assert back.to_dict()["algorithms"][0] == {"name": "label_smoothing", "smoothing": 0.1}
    assert back.algorithms[1].hparams["half_life"] == "5ba"
    # Every setting survives (components with all their hyperparameters, defaults written out).
    again = Trainer.from_config(back).to_config()
    assert again.to_dict() == back.to_dict()
    assert TrainerConfig.from_dict(json.loads(json.dumps(back.to_dict()))) == back


def test_config_names_are_exported_from_the_package_and_the_trainer_module():
    import composerjax
    import composerjax.trainer

    assert composerjax.TrainerConfig is composerjax.trainer.TrainerConfig is TrainerConfig
    assert composerjax.load_config is load_config and composerjax.trainer.ConfigError is ConfigError
    with pytest.raises(AttributeError, match="no attribute 'TrainerConfg'"):
        composerjax.TrainerConfg  # noqa: B018


def test_yaml_json_files_and_overrides(tmp_path):
    import yaml

    (tmp_path / "r.yaml").write_text(yaml.safe_dump(RECIPE))
    (tmp_path / "r.json").write_text(json.dumps(RECIPE))
    from_yaml = load_config(tmp_path / "r.yaml", ["optimizer.lr=0.5", "algorithms[1].half_life=7ba",
                                                 "algorithms.0.label_smoothing.smoothing=0.2", "max_duration=3ba"])
    assert from_yaml.optimizer.lr == 0.5 and from_yaml.max_duration == "3ba"
    assert from_yaml.algorithms[1].hparams["half_life"] == "7ba"
    assert from_yaml.algorithms[0].hparams["smoothing"] == 0.2
    assert load_config(tmp_path / "r.json") == load_config(RECIPE)
    assert TrainerConfig.from_dict(yaml.safe_load(load_config(RECIPE).to_yaml())) == load_config(RECIPE)
    (tmp_path / "broken.yaml").write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")


def test_every_problem_is_listed_at_once_with_its_field_path():
    bad = {
        **RECIPE,
        "max_durration": "2ep",
        "algorithms": ["label_smoothing", {"mixup": {"alpha": "lots", "nope": 1}}, {"mixpu": {}},
                       {"cutmix": {"alpha": -1.0}}],
        "callbacks": [{"name": "speed_monitr"}],
        "optimizer": {"name": "adamm", "lr": 0.1},
        "seed": "zero",
    }
    with pytest.raises(ConfigError) as caught:
        load_config(bad)
    problems = caught.value.problems
    text = "\n".join(problems)
    assert any(p.startswith("max_durration:") and "Extra inputs are not permitted" in p for p in problems)
    assert any(p.startswith("seed:") for p in problems)
    assert any(p.startswith("algorithms[1].mixup.alpha:") and "'lots'" in p for p in problems)
    assert any(p.startswith("algorithms[1].mixup.nope:") for p in problems)
    assert any(p.startswith("algorithms[2].name:") and "did you mean 'mixup'" in p for p in problems)
    assert any(p.startswith("algorithms[3].cutmix.alpha:") and "-1" in p for p in problems)  # the range check
    assert any(p.startswith("callbacks[0].name:") and "'speed_monitor'" in p for p in problems)
    assert any(p.startswith("optimizer.name:") and "'adam'" in p for p in problems)
    assert len(problems) == 8, text


def test_a_misspelt_hyperparameter_gets_a_did_you_mean_at_every_depth(tmp_path):
    (tmp_path / "r.yaml").write_text(
        "model: {name: digits_cnn, num_class: 3}\n"
        "data: {name: digits}\n"
        "max_duraton: 2ep\n"
        "max_duration: 2ep\n"
        "schedule: {name: cosine, warmpu: 1ep}\n"
        "optimizer: {name: sgd, lr: 0.1, momentun: 0.9}\n"
        "algorithms: [{label_smoothing: {smoothng: 0.1}}, {mixup: {alhpa: 0.2}}, {mixup: {zzz: 1}}]\n")
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "r.yaml")
    assert sorted(caught.value.problems) == sorted([
        "max_duraton: Extra inputs are not permitted (got '2ep'); did you mean 'max_duration'?",
        "schedule.warmpu: Extra inputs are not permitted (got '1ep'); did you mean 'warmup'?",
        "model.num_class: Extra inputs are not permitted (got 3); did you mean 'num_classes'?",
        "algorithms[0].label_smoothing.smoothng: Extra inputs are not permitted (got 0.1); did you mean 'smoothing'?",
        "algorithms[1].mixup.alhpa: Extra inputs are not permitted (got 0.2); did you mean 'alpha'?",
        "algorithms[2].mixup.zzz: Extra inputs are not permitted (got 1); accepted: alpha, interpolate_loss, "
        "input_key, target_key, num_classes",
        "optimizer.momentun: optax.sgd has no argument 'momentun'; did you mean 'momentum'? Accepted: "
        "accumulator_dtype, momentum, nesterov",
    ])


def test_a_bad_set_override_does_not_hide_the_other_problems():
    overrides = ["algorithms.9.smoothing=0.2", "model[0]=1", "algorithms[0].label_smoothing.smoothng=0.2",
                 "max_duraton=3ba", "optimizer.lr=0.5"]
    with pytest.raises(ConfigError) as caught:
        load_config(RECIPE, overrides)
    assert caught.value.problems == [
        "--set algorithms.9.smoothing: algorithms has 3 items; no item 9",
        "--set model[0]: model is a mapping, so it has no item [0]; name the key instead (e.g. model.name)",
        "max_duraton: Extra inputs are not permitted (got '3ba'); did you mean 'max_duration'?",
        "algorithms[0].label_smoothing.smoothng: Extra inputs are not permitted (got 0.2); did you mean "
        "'smoothing'?",
    ]
    # A failed override leaves nothing half-set ('newsection' would be an unknown setting of its own).
    with pytest.raises(ConfigError) as caught:
        load_config(RECIPE, ["newsection.items[3].x=1", "optimizer.lr=0.5"])
    assert caught.value.problems == ["--set newsection.items[3].x: newsection.items has 0 items; no item 3"]


def test_time_strings_are_checked_at_validation_with_their_field():
    bad = {**RECIPE, "max_duration": "4 epochs", "eval_interval": "xx", "save_interval": "3q",
           "schedule": {"name": "cosine", "warmup": "3sp"}, "time_limit": "2hours"}
    with pytest.raises(ConfigError) as caught:
        load_config(bad)
    problems = caught.value.problems
    assert [p.split(":")[0] for p in problems] == ["max_duration", "eval_interval", "save_interval",
                                                    "schedule.warmup", "time_limit"]
    assert "'4 epochs'" in problems[0] and "'10ep'" in problems[0]
    assert "'3sp'" in problems[3] and "percentage" in problems[3]
    assert "'2hours'" in problems[4]
    good = load_config({**RECIPE, "schedule": {"name": "cosine", "warmup": "20ba"}, "time_limit": "2h30m",
                        "eval_interval": "1ep"})
    assert good.time_limit == "2h30m"
    with pytest.raises(ConfigError, match=r"max_duration: .*'iter' needs state.iteration_length.*use ep, ba, sp, "
                                          r"tok or sec"):
        load_config({**RECIPE, "max_duration": "2iter"})


def test_optimizer_arguments_and_import_paths():
    with pytest.raises(ConfigError, match=r"optimizer.momentun: optax.sgd has no argument 'momentun'"):
        load_config({**RECIPE, "optimizer": {"name": "sgd", "lr": 0.1, "momentun": 0.9}})
    config = load_config({**RECIPE, "algorithms": [{"name": "composerjax.algorithms:MixUp", "alpha": 0.3}]})
    assert type(build_trainer(config).state.algorithms[0]).__name__ == "MixUp"
    with pytest.raises(ConfigError, match=r"algorithms\[0\].name: .*no_such_module"):
        load_config({**RECIPE, "algorithms": [{"name": "no_such_module:Thing"}]})


def test_schedule_in_time_units_matches_optax_closed_forms():
    config = load_config(RECIPE)  # 1500 samples / 100 = 15 batches an epoch, 2 epochs: 30 steps, warmup 10% = 3
    schedule = learning_rate(config, steps_per_epoch=15)
    assert schedule(0) == 0.0
    np.testing.assert_allclose(schedule(3), 0.01, rtol=1e-6)
    # cosine from step 3 to 30 down to 10% of the peak
    cosine = optax.cosine_decay_schedule(0.01, 27, alpha=0.1)
    for step in (4, 10, 20, 30):
        np.testing.assert_allclose(schedule(step), cosine(step - 3), rtol=1e-6)
    np.testing.assert_allclose(schedule(30), 0.001, rtol=1e-5)
    linear = learning_rate(load_config({**RECIPE, "schedule": {"name": "linear", "warmup": "1ep"}}), 15)
    np.testing.assert_allclose([linear(15), linear(30)], [0.01, 0.0], atol=1e-9)
    assert learning_rate(load_config({**RECIPE, "schedule": None}), 15) == 0.01
    with pytest.raises(ConfigError, match="schedule.warmup"):
        learning_rate(load_config({**RECIPE, "schedule": {"name": "cosine", "warmup": "5ep"}}), 15)


def test_a_recipes_cosine_schedule_is_composers_cosine_with_warmup():
    from composerjax.core.state import State
    from composerjax.core.time import Timestamp
    from composerjax.optim import CosineAnnealingWithWarmupScheduler

    config = load_config(RECIPE)  # 30 steps, warmup 10% = 3 steps, down to 10% of the peak
    schedule = learning_rate(config, steps_per_epoch=15)
    composer = CosineAnnealingWithWarmupScheduler(t_warmup="3ba", alpha_f=0.1)
    state = State(model=None, max_duration="30ba")
    for step in range(31):
        state.timestamp = Timestamp(batch=step)
        np.testing.assert_allclose(schedule(step), 0.01 * composer(state), rtol=1e-5, atol=1e-9)


def test_explain_matches_the_order_the_engine_used():
    swa = {"swa_start": "0.5dur", "swa_end": "0.9dur", "update_interval": "1ba"}
    recipe = {**RECIPE, "max_duration": "10ba", "schedule": None,
              "algorithms": [{"ema": {"half_life": "5ba"}}, {"selective_backprop": {"start": 0.0, "end": 1.0}},
                             {"label_smoothing": {"smoothing": 0.1}}, {"swa": swa}]}
    config = load_config(recipe)
    explanation = explain(config)
    trainer = build_trainer(config)
    trainer.fit()
    # What the engine really ran, step by step, from the trace log: "EVENT: A, B" per traced event.
    ran: dict[int, dict[str, list[str]]] = {}
    for trace in trainer.engine.trace_log:
        if trace.traced:
            ran.setdefault(trace.batch, {}).setdefault(trace.event.name, []).append(trace.name)
    changes = explanation.plan_changes
    for batch in range(10):
        predicted = [change for change in changes if change["batch"] <= batch][-1]["algorithms"]
        actual = [f"{event}: {', '.join(names)}" for event, names in ran.get(batch, {}).items()]
        assert predicted == actual, (batch, predicted, actual)
    # Per event, explain lists every algorithm that runs there at some step, in the engine's order.
    explained = {plan.event: plan.algorithms for plan in explanation.events
                 if plan.traced and plan.event in {e.name for e in TRAIN_STEP_EVENTS}}
    for steps in ran.values():
        for event, names in steps.items():
            assert [n for n in explained[event] if n in names] == names
    assert set(explained["AFTER_OPTIMIZER_STEP"]) == {"EMA", "SWA"}
    # passes: selective backprop runs first; AFTER_ events run in reverse (first in, last out)
    assert explained["AFTER_OPTIMIZER_STEP"][-1] == "EMA"
    moved = {(plan.event, move["pass"]) for plan in explanation.events for move in plan.moved_by}
    assert ("AFTER_OPTIMIZER_STEP", "set_filo_order") in moved
    # the plans the walk predicted are the train steps that compiled
    train_compiles = sum(1 for record in trainer.state.compiled_steps if record.kind == "train")
    assert explanation.train_plans == train_compiles == len({tuple(c["algorithms"]) for c in changes}) > 1
    assert explanation.conflicts == []
    assert "AFTER_OPTIMIZER_STEP (traced" in explanation.render()


def test_explain_reports_conflicts():
    config = load_config({**RECIPE, "algorithms": [{"mixup": {"interpolate_loss": True}},
                                                   {"cutmix": {"interpolate_loss": True}}, {"blurpool": {}}]})
    with pytest.warns(UserWarning):  # BlurPool's own warning at INIT, and the engine's interpolation warning
        conflicts = explain(config).conflicts
    assert conflicts == [
        "BlurPool acts on nnx.Conv modules, and the model (ComposerClassifier) has none: it will change nothing",
        "2 algorithms interpolate the loss (MixUp, CutMix) at BEFORE_FORWARD, BEFORE_BACKWARD; their effects compound",
    ]
