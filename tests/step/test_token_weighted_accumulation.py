"""accumulate_train_batch_on_tokens (Composer's): with padding, microbatches weigh by their real tokens.

The reference is the whole batch's gradient of the mean cross-entropy over its real tokens (targets
other than -100), taken with ``jax.grad`` on the model outside the Trainer. One SGD step at learning
rate 1 moves the parameters by exactly the gradient the step accumulated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.models.causal_lm import ComposerCausalLM
from composerjax.models.composer_model import ComposerModel
from composerjax.models.function_model import model_functions
from composerjax.models.gpt2 import GPT2, GPT2Config
from composerjax.step.token_weights import microbatch_weights
from composerjax.trainer.config import ConfigError, load_config

BATCH, LENGTH, VOCAB = 8, 12, 64
#: Real (not -100) targets per row: microbatches of 2 rows hold 24, 1, 13 and 0 real tokens.
REAL_PER_ROW = [12, 12, 1, 0, 7, 6, 0, 0]


def make_model() -> ComposerCausalLM:
    config = GPT2Config.preset("gpt2-tiny", vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=LENGTH)
    return ComposerCausalLM(GPT2(config, rngs=nnx.Rngs(0)))


def padded_batch(real_per_row: list[int] = REAL_PER_ROW) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, VOCAB, size=(BATCH, LENGTH)).astype(np.int32)
    targets = rng.integers(0, VOCAB, size=(BATCH, LENGTH)).astype(np.int32)
    for row, real in enumerate(real_per_row):
        targets[row, real:] = -100  # right padding: its targets are left out of the loss
    return inputs, targets


def params_of(model: nnx.Module) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def full_batch_loss_and_grads(batch: tuple) -> tuple[float, dict]:
    model = make_model()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        merged = nnx.merge(graphdef, p, rest)
        return merged.loss(merged.forward(batch), batch)

    value, grads = jax.value_and_grad(loss)(params)
    return float(value), nnx.to_pure_dict(grads)


def train_one_step(batch: tuple, **kwargs) -> Trainer:
    trainer = Trainer(make_model(), ArrayLoader(batch, batch_size=BATCH, shuffle=False), max_duration="1ba",
                      optimizers=optax.sgd(1.0), progress_bar=False, run_summary=False, **kwargs)
    trainer.fit()
    return trainer


def step_taken(trainer: Trainer) -> dict:
    """The gradient the optimizer applied: initial minus updated parameters (SGD at learning rate 1)."""
    return jax.tree.map(lambda before, after: before - after, params_of(make_model()), params_of(trainer.state.model))


def max_difference(a: dict, b: dict) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("microbatch", [2, 4])
def test_token_weighted_microbatches_give_the_full_batch_mean_over_real_tokens(microbatch):
    batch = padded_batch()
    loss, grads = full_batch_loss_and_grads(batch)
    trainer = train_one_step(batch, device_train_microbatch_size=microbatch, accumulate_train_batch_on_tokens=True)
    assert max_difference(step_taken(trainer), grads) <= 1e-6
    assert float(trainer.state.loss) == pytest.approx(loss, abs=1e-6)  # the loss is weighted as the gradient
    trainer.close()


def test_the_full_batch_step_is_the_reference():
    batch = padded_batch()
    loss, grads = full_batch_loss_and_grads(batch)
    trainer = train_one_step(batch)
    assert max_difference(step_taken(trainer), grads) <= 1e-6
    assert float(trainer.state.loss) == pytest.approx(loss, abs=1e-6)
    trainer.close()


def test_without_the_flag_microbatches_weigh_equally_and_miss_the_reference_measurably():
    batch = padded_batch()
    _, reference = full_batch_loss_and_grads(batch)
    microbatches = [full_batch_loss_and_grads(tuple(part[i:i + 2] for part in batch)) for i in range(0, BATCH, 2)]
    equal_weights = jax.tree.map(lambda *grads: sum(grads) / 4, *[grads for _, grads in microbatches])
    trainer = train_one_step(batch, device_train_microbatch_size=2)  # Composer's default: False
    assert trainer.settings.step.accumulate_train_batch_on_tokens is False
    assert max_difference(step_taken(trainer), equal_weights) <= 1e-6
    assert max_difference(step_taken(trainer), reference) > 1e-3  # what the flag fixes, so the test above can fail
    assert float(trainer.state.loss) == pytest.approx(sum(loss for loss, _ in microbatches) / 4, abs=1e-6)
    trainer.close()


def test_a_batch_without_real_tokens_leaves_the_parameters_as_the_full_batch_does():
    batch = padded_batch([0] * BATCH)
    trainer = train_one_step(batch, device_train_microbatch_size=2, accumulate_train_batch_on_tokens=True)
    assert max_difference(step_taken(trainer), jax.tree.map(jnp.zeros_like, params_of(make_model()))) == 0.0
    assert float(trainer.state.loss) == 0.0
    trainer.close()


def test_the_counts_are_the_targets_other_than_ignore_index():
    inputs, targets = padded_batch()
    stacked = tuple(part.reshape(4, 2, LENGTH) for part in (inputs, targets))
    model = make_model()
    assert int(model.loss_token_count((inputs, targets))) == sum(REAL_PER_ROW)
    assert model.loss_token_count(inputs) is None  # no targets: no count
    weights = microbatch_weights(model_functions(model, None), model, stacked)
    np.testing.assert_allclose(np.asarray(weights), np.array([24, 1, 13, 0]) / 38, rtol=1e-7)


def test_a_model_that_counts_no_tokens_weighs_microbatches_equally(classification_arrays, make_tiny_classifier):
    x, y = classification_arrays

    def run(on_tokens: bool) -> dict:
        trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16, shuffle=False),
                          max_duration="2ba", optimizers=optax.sgd(0.5), device_train_microbatch_size=4,
                          accumulate_train_batch_on_tokens=on_tokens, progress_bar=False, run_summary=False)
        trainer.fit()
        params = params_of(trainer.state.model)
        trainer.close()
        return params

    assert ComposerClassifier.loss_token_count is ComposerModel.loss_token_count  # None: a mean over samples
    for on, off in zip(jax.tree.leaves(run(True)), jax.tree.leaves(run(False))):
        np.testing.assert_array_equal(np.asarray(on), np.asarray(off))


class OneCountPerRow(ComposerClassifier):
    def loss_token_count(self, batch):
        return jnp.full((2,), jnp.sum(batch[1] >= 0))  # wrong: two counts


def test_a_count_that_is_not_a_scalar_is_refused_naming_the_method(classification_arrays):
    x, y = classification_arrays
    trainer = Trainer(OneCountPerRow(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2),
                      ArrayLoader((x, y), batch_size=16), max_duration="1ba",
                      device_train_microbatch_size=4, accumulate_train_batch_on_tokens=True,
                      progress_bar=False, run_summary=False)
    with pytest.raises(ValueError, match=r"^OneCountPerRow\.loss_token_count\(batch\) gave \(4, 2\) for 4 "
                                         r"microbatches \(stacked\): expected one scalar count per batch"):
        trainer.fit()
    trainer.close()


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_value_other_than_true_or_false_is_refused_naming_the_field(value, classification_arrays):
    x, y = classification_arrays
    with pytest.raises(ValueError) as error:
        Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2), ArrayLoader((x, y), batch_size=16),
                max_duration="1ba", accumulate_train_batch_on_tokens=value, progress_bar=False, run_summary=False)
    assert str(error.value) == f"accumulate_train_batch_on_tokens={value!r}: expected True or False"


RECIPE = {"model": {"name": "mlp", "sizes": [64, 16, 10]}, "data": {"name": "digits", "batch_size": 100},
          "max_duration": "1ba", "progress_bar": False, "run_summary": False}


def test_a_recipe_takes_the_setting_and_refuses_a_bad_value():
    assert load_config(RECIPE).accumulate_train_batch_on_tokens is False
    config = load_config(RECIPE, ["accumulate_train_batch_on_tokens=true"])
    assert config.arguments()["accumulate_train_batch_on_tokens"] is True
    trainer = Trainer.from_config(config)
    assert trainer.builder.accumulate_on_tokens is True  # reaches the compiled step
    assert trainer.hparams["accumulate_train_batch_on_tokens"] is True
    assert trainer.to_config().accumulate_train_batch_on_tokens is True
    trainer.close()
    with pytest.raises(ConfigError) as error:
        load_config({**RECIPE, "accumulate_train_batch_on_tokens": "maybe"})
    [problem] = error.value.problems
    assert problem.startswith("accumulate_train_batch_on_tokens:") and "'maybe'" in problem, problem


SHARDED_SCRIPT = """
import json, sys
sys.path.insert(0, {folder!r})
import jax
from test_token_weighted_accumulation import full_batch_loss_and_grads, max_difference, padded_batch, step_taken
from test_token_weighted_accumulation import train_one_step

batch = padded_batch()
loss, grads = full_batch_loss_and_grads(batch)
results = {{"devices": jax.device_count()}}
for parallelism in ("ddp", "fsdp"):
    trainer = train_one_step(batch, device_train_microbatch_size=4, accumulate_train_batch_on_tokens=True,
                             parallelism=parallelism)
    results[parallelism] = [max_difference(step_taken(trainer), grads), abs(float(trainer.state.loss) - loss)]
    trainer.close()
print(json.dumps(results))
"""


def test_on_four_devices_the_counts_are_the_whole_batchs():
    # Each device holds 2 of the 8 rows; a microbatch of 4 rows spans 2 devices: the counts are global.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    script = SHARDED_SCRIPT.format(folder=str(Path(__file__).resolve().parent))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["devices"] == 4
    for parallelism in ("ddp", "fsdp"):
        grads_difference, loss_difference = results[parallelism]
        assert grads_difference <= 1e-6 and loss_difference <= 1e-6, (parallelism, results)
