"""Composer's Trainer arguments: each one is taken here, or refused with what to use instead, as the docs list.

``COMPOSER_TRAINER_ARGUMENTS`` (composerjax.trainer.composer_arguments) is Composer's
``Trainer.__init__``, argument for argument, from Composer's source.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.trainer.composer_arguments import COMPOSER_TRAINER_ARGUMENTS, INSTEAD
from composerjax.trainer.config import ConfigError, load_config

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-composer.md"


def tiny_trainer(**kwargs) -> Trainer:
    x = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    loader = kwargs.pop("loader", None) or ArrayLoader((x, y), batch_size=4)
    return Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2), loader, max_duration="1ep",
                   progress_bar=False, run_summary=False, **kwargs)


def test_every_composer_trainer_argument_is_taken_or_listed_with_what_to_use_instead():
    taken = set(inspect.signature(Trainer).parameters)
    assert len(COMPOSER_TRAINER_ARGUMENTS) == len(set(COMPOSER_TRAINER_ARGUMENTS)) == 54
    not_taken = [name for name in COMPOSER_TRAINER_ARGUMENTS if name not in taken]
    assert not_taken == list(INSTEAD)  # in Composer's order, each listed, nothing listed that is taken
    assert len(INSTEAD) == 19
    assert "accumulate_train_batch_on_tokens" in taken  # issue 28: taken, with Composer's default
    assert inspect.signature(Trainer).parameters["accumulate_train_batch_on_tokens"].default is False


def test_the_migration_guide_lists_the_table_as_written():
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("## Composer `Trainer` arguments not taken here", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| (.+) \|$", section, flags=re.MULTILINE))
    assert rows == INSTEAD


def test_a_composer_argument_is_a_type_error_saying_what_to_use_instead():
    with pytest.raises(TypeError) as error:
        tiny_trainer(device="cpu")
    assert str(error.value) == ("Trainer(device='cpu'): device= is Composer's argument; here use accelerator='auto', "
                                "'cpu', 'gpu' or 'tpu' (and devices= for which devices, or how many)")
    with pytest.raises(TypeError) as error:
        tiny_trainer(console_log_interval="1ep", max_duraton="2ep")
    assert str(error.value) == (
        "Trainer(console_log_interval='1ep', max_duraton='2ep'): console_log_interval= is Composer's argument; here "
        "use loggers=[ConsoleLogger(interval=N)] (every N batches); unknown argument max_duraton=; did you mean "
        "max_duration=?")
    assert tiny_trainer(accelerator="cpu").settings.run.accelerator == "cpu"


def test_a_recipe_with_a_composer_argument_gets_the_same_advice():
    with pytest.raises(ConfigError) as error:
        load_config({"model": {"name": "digits_cnn"}, "data": {"name": "digits"}, "max_duration": "1ep",
                     "device": "gpu"})
    assert error.value.problems == [
        "device: Extra inputs are not permitted (got 'gpu'); device is Composer's argument; here use "
        "accelerator='auto', 'cpu', 'gpu' or 'tpu' (and devices= for which devices, or how many)"]


def test_array_loader_drops_the_last_partial_batch_unless_told_not_to():
    x = np.zeros((10, 4), np.float32)
    assert [len(batch[0]) for batch in ArrayLoader((x,), batch_size=4)] == [4, 4]
    assert [len(batch[0]) for batch in ArrayLoader((x,), batch_size=4, drop_last=False, shuffle=False)] == [4, 4, 2]


def test_a_last_batch_that_does_not_split_into_microbatches_fails_instead_of_being_split():
    x = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    trainer = tiny_trainer(loader=ArrayLoader((x, y), batch_size=6, drop_last=False, shuffle=False),
                           device_train_microbatch_size=3)
    with pytest.raises(ValueError, match=r"^device_train_microbatch_size=3 does not divide the batch size 4; "):
        trainer.fit()
    assert trainer.state.timestamp.batch == 1  # the full batch of 6 trained as two microbatches of 3
    trainer.close()
