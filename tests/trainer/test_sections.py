"""Every Trainer argument is one field of one settings section; the sections are checked once, when built."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.checkpoint.settings import CheckpointSettings
from composerjax.core.settings import setting_fields
from composerjax.trainer import sections
from composerjax.trainer.config import TrainerConfig
from composerjax.trainer.sections import (
    EvaluationSettings,
    RunSettings,
    StepSettings,
    StoppingSettings,
    TrainerSettings,
)
from composerjax.trainer.settings import NOT_IN_RECIPE, RECIPE_SECTIONS, recipe_arguments

SECTION_CLASSES = {"run": RunSettings, "step": StepSettings, "evaluation": EvaluationSettings,
                   "checkpoint": CheckpointSettings, "stopping": StoppingSettings}
X = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32)


def make(**kwargs) -> Trainer:
    return Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2), ArrayLoader((X, Y), batch_size=16),
                   "1ep", optax.sgd(0.1), progress_bar=False, run_summary=False, **kwargs)


def test_every_trainer_argument_maps_to_exactly_one_section_field():
    parameters = [name for name in inspect.signature(Trainer).parameters]
    owners = {name: [section for section, kind in SECTION_CLASSES.items()
                     if name in {f.name for f in setting_fields(kind)}] for name in parameters}
    assert {name: found for name, found in owners.items() if len(found) != 1} == {}
    declared = [f.name for kind in SECTION_CLASSES.values() for f in setting_fields(kind)]
    assert sorted(declared) == sorted(parameters)  # and no section field is missing from the signature
    assert len(declared) == len(set(declared))
    assert list(TrainerSettings.fields()) == parameters  # the signature is the sections', in their order
    assert [f.name for f in dataclasses.fields(TrainerSettings)] == list(sections.SECTIONS) == list(SECTION_CLASSES)


def test_the_signature_docstring_and_recipe_schema_come_from_the_fields():
    signature = inspect.signature(Trainer)
    for name, (_, f) in TrainerSettings.fields().items():
        parameter = signature.parameters[name]
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else inspect.Parameter.empty)
        assert parameter.default == default, name
        assert f"    {name}: " in Trainer.__doc__, name  # the Args: entry, from the field's doc
    assert [name for name, p in signature.parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == [
        "model", "train_dataloader", "max_duration", "optimizers"]
    recipe = recipe_arguments()
    for name in TrainerSettings.fields():
        assert (name in recipe) + (name in RECIPE_SECTIONS) + (name in NOT_IN_RECIPE) == 1, name
        if name in recipe:
            assert name in TrainerConfig.model_fields


def test_sections_are_frozen_and_checked_when_built_and_replaced():
    settings = make().settings
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.step.steps_per_call = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"^log_interval=0: expected a positive integer \(batches\)$"):
        settings.run.replace(log_interval=0)
    with pytest.raises(ValueError, match=r"^steps_per_call='x': expected a positive integer"):
        StepSettings(steps_per_call="x")
    with pytest.raises(ValueError, match=r"^save_num_checkpoints_to_keep=0: expected a positive integer, or -1"):
        CheckpointSettings(save_num_checkpoints_to_keep=0)
    assert settings.replace(seed=3).run.seed == 3 and settings.run.seed == 0
    assert TrainerSettings.owner("save_folder") == "checkpoint" and TrainerSettings.owner("precision") == "step"


def test_an_unknown_argument_is_refused_with_the_closest_names():
    with pytest.raises(TypeError, match=r"unknown argument log_intervall=; did you mean log_interval="):
        make(log_intervall=3)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'log_intervall'; did you mean 'log_interval'"):
        TrainerSettings.from_arguments({"model": None, "log_intervall": 3}, check=False)


def test_the_sections_hold_what_the_trainer_was_given():
    trainer = make(steps_per_call=2, save_interval="3ba", time_limit="1h", eval_subset_num_batches=2,
                   eval_dataloader=ArrayLoader((X, Y), batch_size=16))
    settings = trainer.settings
    assert (settings.step.steps_per_call, settings.checkpoint.save_interval, settings.stopping.time_limit,
            settings.evaluation.eval_subset_num_batches) == (2, "3ba", "1h", 2)
    assert trainer.time_limit == 3600.0 and trainer.config is None
    assert not hasattr(trainer, "arguments")
    trainer.close()


# -- an option added end to end: one field in RunSettings, read where the run's epochs are counted -------------
def test_train_subset_num_batches_ends_every_epoch_early_as_composer():
    from composerjax import Callback

    class Seen(Callback):
        def __init__(self) -> None:
            self.rows: list[tuple[int, float]] = []

        def after_dataloader(self, state, logger) -> None:
            self.rows.append((int(state.timestamp.epoch), float(np.asarray(state.batch[0])[0, 0])))

    full, cut = Seen(), Seen()
    loader = ArrayLoader((X, Y), batch_size=8, shuffle=True, seed=3)  # 4 batches an epoch
    reference = make_with(loader, full, "2ep")
    trainer = make_with(ArrayLoader((X, Y), batch_size=8, shuffle=True, seed=3), cut, "2ep",
                        train_subset_num_batches=2)
    assert trainer.state.dataloader_len == 2 and int(trainer.state.timestamp.batch) == 4
    assert int(trainer.state.timestamp.epoch) == 2
    by_epoch = {epoch: [row for e, row in full.rows if e == epoch] for epoch in (0, 1)}
    assert cut.rows == [(0, r) for r in by_epoch[0][:2]] + [(1, r) for r in by_epoch[1][:2]]
    assert int(reference.state.timestamp.batch) == 8
    with pytest.raises(ValueError, match=r"^train_subset_num_batches=0: expected a positive number of batches or -1"):
        make(train_subset_num_batches=0)


def make_with(loader, callback, duration, **kwargs) -> Trainer:
    trainer = Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2), loader, duration, optax.sgd(0.1),
                      callbacks=[callback], progress_bar=False, run_summary=False, **kwargs)
    trainer.fit()
    trainer.close()
    return trainer


def test_train_subset_num_batches_is_a_recipe_field_and_a_set_override():
    from composerjax.trainer.config import load_config

    recipe = {"model": {"name": "digits_cnn"}, "data": {"name": "digits"}, "max_duration": "1ep"}
    assert load_config(recipe, ["train_subset_num_batches=3"]).train_subset_num_batches == 3
    assert TrainerConfig.model_fields["train_subset_num_batches"].default == -1


def test_the_run_summarys_steps_per_call_entry_has_one_shape_from_fit_start_on():
    from composerjax import Callback

    class Peek(Callback):
        def fit_start(self, state, logger) -> None:
            self.seen = dict(state.run_summary["steps_per_call"])

    peek = Peek()
    trainer = make(callbacks=[peek])  # steps_per_call='auto', the default
    trainer.fit()
    assert peek.seen == {"given": "auto", "chosen": None, "reason": None, "flops": None, "bytes_accessed": None,
                         "estimated_step_ms": None}
    after = trainer.state.run_summary["steps_per_call"]
    assert list(after) == list(peek.seen) and after["given"] == "auto" and after["chosen"] == 1
    assert after["reason"].startswith("1 batches left")
    trainer.close()
    fixed = make(steps_per_call=2)
    fixed.fit()
    entry = fixed.state.run_summary["steps_per_call"]
    assert entry["given"] == entry["chosen"] == 2
    fixed.close()
