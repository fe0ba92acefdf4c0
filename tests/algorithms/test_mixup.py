"""MixUp: closed forms of the pure functions, and one SGD step inside a Trainer against plain JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, ComposerClassifier, Event, State, Trainer
from composerjax.algorithms.mixup import MixUp, mixup_batch, mixup_sample, mixup_targets

LR = 0.1
BATCH = 16
STEPS = 4


def classification_data(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 3, size=n).astype(np.int32)


class StepKeyProbe(Algorithm):
    """Keeps the raw data of every step's random key, so a test can redraw what MixUp drew."""

    def init_state(self, state):
        return jnp.zeros((STEPS, 2), jnp.uint32)

    def match(self, event, state):
        return event == Event.BEFORE_TRAIN_BATCH

    def apply(self, event, state, logger):
        keys = state.algorithm_state[self.name]
        state.algorithm_state[self.name] = keys.at[state.step].set(jax.random.key_data(state.step_rng))


def make_trainer(algorithms: list[Algorithm], max_duration: str = f"{STEPS}ba") -> Trainer:
    x, y = classification_data()
    return Trainer(
        ComposerClassifier(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), num_classes=3),
        ArrayLoader((x, y), batch_size=BATCH, shuffle=False),
        max_duration=max_duration,
        optimizers=optax.sgd(LR),
        algorithms=algorithms,
        progress_bar=False,
    )


def drawn(trainer: Trainer, mixup: MixUp) -> list[tuple[float, np.ndarray]]:
    """The (mixing, indices) MixUp drew at each step, redrawn from the probed step keys."""
    key_data = np.asarray(jax.device_get(trainer.state.train_state.algorithm_state["StepKeyProbe"]))
    draws = []
    for row in key_data:
        mixing, indices = mixup_sample(mixup.sample_key(jax.random.wrap_key_data(row)), BATCH, mixup.alpha)
        draws.append((float(mixing), np.asarray(indices)))
    return draws


def reference_params(draws: list[tuple[float, np.ndarray]], interpolate_loss: bool) -> dict:
    """SGD on the same linear classifier over the same batches, mixed up in plain JAX."""
    linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    params = {"kernel": linear.kernel[...], "bias": linear.bias[...]}
    x_all, y_all = classification_data()
    eye = np.eye(3, dtype=np.float32)
    for step, (lam, perm) in enumerate(draws):
        x, y = x_all[step * BATCH:(step + 1) * BATCH], y_all[step * BATCH:(step + 1) * BATCH]
        x_mixed = lam * x + (1 - lam) * x[perm]

        def loss(p, x_mixed=x_mixed, y=y, lam=lam, perm=perm):
            logits = x_mixed @ p["kernel"] + p["bias"]
            if interpolate_loss:
                return (lam * optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
                        + (1 - lam) * optax.softmax_cross_entropy_with_integer_labels(logits, y[perm]).mean())
            return optax.softmax_cross_entropy(logits, lam * eye[y] + (1 - lam) * eye[y[perm]]).mean()

        grads = jax.grad(loss)(params)
        params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return params


def test_sample_is_a_permutation_and_a_weight_of_at_least_one_half():
    mixing, indices = mixup_sample(jax.random.key(3), BATCH, 1.0)
    assert sorted(np.asarray(indices).tolist()) == list(range(BATCH))
    assert 0.5 <= float(mixing) <= 1.0
    no_mixing, _ = mixup_sample(jax.random.key(3), BATCH, 0.0)
    assert float(no_mixing) == 1.0


def test_alpha_one_draws_max_of_a_uniform_and_its_complement():
    # z ~ Beta(1, 1) = U(0, 1), so max(z, 1 - z) ~ U(0.5, 1): mean 0.75, variance 1/48.
    keys = jax.random.split(jax.random.key(0), 1000)
    samples = np.array([float(mixup_sample(key, BATCH, 1.0)[0]) for key in keys])
    assert samples.min() >= 0.5 and samples.max() <= 1.0
    assert abs(samples.mean() - 0.75) < 0.015  # 3 standard errors
    assert abs(samples.var() - 1 / 48) < 0.004


def test_mixup_batch_is_the_convex_combination_with_the_permuted_batch():
    x = np.random.default_rng(1).normal(size=(BATCH, 3, 2)).astype(np.float32)
    y = np.arange(BATCH, dtype=np.int32)
    mixing, indices = mixup_sample(jax.random.key(7), BATCH, 1.0)
    mixed, permuted = mixup_batch(jnp.asarray(x), jnp.asarray(y), mixing, indices)
    lam, perm = float(mixing), np.asarray(indices)
    np.testing.assert_allclose(np.asarray(mixed), lam * x + (1 - lam) * x[perm], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(permuted), perm)
    assert mixed.dtype == jnp.float32


def test_mixup_targets_one_hot_encodes_labels_and_keeps_dense_targets():
    perm = jnp.array([2, 0, 1])
    mixed = mixup_targets(jnp.array([0, 1, 2]), 0.7, perm, num_classes=3)
    eye = np.eye(3, dtype=np.float32)
    np.testing.assert_allclose(np.asarray(mixed), 0.7 * eye + 0.3 * eye[[2, 0, 1]], rtol=1e-6)
    soft = jnp.asarray([[0.2, 0.8], [1.0, 0.0], [0.5, 0.5]])
    np.testing.assert_allclose(np.asarray(mixup_targets(soft, 0.6, perm)), 0.6 * soft + 0.4 * soft[perm], rtol=1e-6)
    with pytest.raises(ValueError, match="num_classes"):
        mixup_targets(jnp.array([0, 1]), 0.5, jnp.array([1, 0]))


@pytest.mark.parametrize(
    ("interpolate_loss", "second_event"),
    [(False, "BEFORE_LOSS"), (True, "BEFORE_BACKWARD")],
    ids=["mixed-targets", "interpolated-loss"],
)
def test_training_equals_plain_jax_mixup_with_one_compile(interpolate_loss, second_event):
    mixup = MixUp(alpha=1.0, interpolate_loss=interpolate_loss)
    trainer = make_trainer([mixup, StepKeyProbe()])
    trainer.fit()
    assert trainer.compile_count == 1
    keys = [trace.key for trace in trainer.engine.trace_log if trace.traced]
    assert keys.count("MixUp/BEFORE_FORWARD") == STEPS
    assert keys.count(f"MixUp/{second_event}") == STEPS

    draws = drawn(trainer, mixup)
    assert len({lam for lam, _ in draws}) == STEPS  # a new draw every step
    params = jax.device_get(trainer.state.train_state.params["module"])
    expected = reference_params(draws, interpolate_loss)
    np.testing.assert_allclose(params["kernel"], expected["kernel"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(params["bias"], expected["bias"], rtol=1e-5, atol=1e-6)
    unmixed = reference_params([(1.0, np.arange(BATCH))] * STEPS, interpolate_loss)
    assert not np.allclose(params["kernel"], unmixed["kernel"], rtol=1e-3, atol=1e-5)


def test_without_logits_num_classes_one_hot_encodes_the_labels():
    # A plain module trained with loss_fn has no state.outputs: MixUp relies on num_classes.
    x, y = (array[:BATCH] for array in classification_data())
    mixup = MixUp(alpha=1.0, num_classes=3)
    state = State(model=None)
    state.batch, state.outputs, state.step_rng = (jnp.asarray(x), jnp.asarray(y)), None, jax.random.key(1)
    mixup.apply(Event.BEFORE_FORWARD, state, None)
    mixup.apply(Event.BEFORE_LOSS, state, None)
    lam, perm = mixup_sample(mixup.sample_key(jax.random.key(1)), BATCH, 1.0)
    lam, perm = float(lam), np.asarray(perm)
    eye = np.eye(3, dtype=np.float32)
    np.testing.assert_allclose(np.asarray(state.batch[0]), lam * x + (1 - lam) * x[perm], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.batch[1]), lam * eye[y] + (1 - lam) * eye[y[perm]], rtol=1e-6)
    state.batch, state.outputs = (jnp.asarray(x), jnp.asarray(y)), jnp.zeros((BATCH, 4))
    with pytest.raises(ValueError, match="num_classes=3, but the model's outputs have 4 classes"):
        mixup.apply(Event.BEFORE_LOSS, state, None)


def test_interpolated_loss_needs_a_composer_model():
    x, y = classification_data()
    trainer = Trainer(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), ArrayLoader((x, y), batch_size=BATCH), "1ba",
                      optax.sgd(LR), loss_fn=lambda m, b: optax.softmax_cross_entropy_with_integer_labels(
                          m(b[0]), b[1]).mean(), algorithms=[MixUp(interpolate_loss=True)], progress_bar=False)
    with pytest.raises(TypeError, match="ComposerModel"):
        trainer.fit()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": -1.0}, "alpha=-1.0"),
        ({"interpolate_loss": 1}, "interpolate_loss=1"),
        ({"input_key": None}, "input_key=None"),
        ({"num_classes": 1}, "num_classes=1"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MixUp(**kwargs)


def test_integer_inputs_are_mixed_into_floats_not_truncated():
    images = jnp.array([[0], [255]], jnp.uint8)
    mixed, _ = mixup_batch(images, jnp.array([0, 1]), 0.75, jnp.array([1, 0]))
    assert mixed.dtype == jnp.float32 and mixed.tolist() == [[63.75], [191.25]]
    bf16, _ = mixup_batch(images.astype(jnp.bfloat16), jnp.array([0, 1]), 0.5, jnp.array([1, 0]))
    assert bf16.dtype == jnp.bfloat16
