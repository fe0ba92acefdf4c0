"""SelectiveBackprop: the loss-ranked sampling, the selected update against plain jax, plans and ordering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, ComposerClassifier, Event, State, Timestamp, Trainer
from composerjax.algorithms.selective_backprop import (
    SelectiveBackprop,
    per_example_loss,
    select_using_loss,
    selection_indices,
    selection_probabilities,
    should_selective_backprop,
)

LR = 0.5


def closed_form_probabilities(size: int, keep: float) -> np.ndarray:
    weights = ((np.arange(size) + 0.5) / size) ** (1 / keep - 1)
    return weights / weights.sum()


def test_per_example_loss_for_labels_soft_targets_and_sequences():
    logits = jnp.array([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    log_probs = np.asarray(jax.nn.log_softmax(logits))
    np.testing.assert_allclose(per_example_loss(logits, jnp.array([0, 1])), [-log_probs[0, 0], -log_probs[1, 1]],
                               rtol=1e-6)
    soft = jnp.array([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    np.testing.assert_allclose(per_example_loss(logits, soft), -(np.asarray(soft) * log_probs).sum(axis=1),
                               rtol=1e-6)
    sequences = jnp.stack([logits, logits[::-1]], axis=1)  # (N=2, T=2, C=3)
    labels = jnp.array([[0, 2], [1, 0]])
    expected = [(-log_probs[0, 0] - log_probs[1, 2]) / 2, (-log_probs[1, 1] - log_probs[0, 0]) / 2]
    np.testing.assert_allclose(per_example_loss(sequences, labels), expected, rtol=1e-6)


def test_selection_probabilities_follow_the_loss_percentiles():
    np.testing.assert_allclose(selection_probabilities(4, 0.5), [1 / 16, 3 / 16, 5 / 16, 7 / 16], rtol=1e-6)
    np.testing.assert_allclose(selection_probabilities(10, 0.25), closed_form_probabilities(10, 0.25), rtol=1e-5)
    np.testing.assert_allclose(selection_probabilities(5, 1.0), np.full(5, 0.2), rtol=1e-6)


def test_selection_is_rank_sampling_without_replacement_with_the_given_key():
    losses = jnp.array([0.3, 2.0, 0.1, 5.0, 1.0, 0.7])  # ranks: 2 0 5 4 1 3 from lowest
    key = jax.random.key(7)
    expected_ranks = jax.random.choice(key, 6, (3,), replace=False, p=jnp.asarray(closed_form_probabilities(6, 0.5)))
    np.testing.assert_array_equal(selection_indices(losses, 0.5, key), np.argsort(np.asarray(losses))[expected_ranks])
    x = jnp.arange(6.0) * 10
    y = jnp.arange(6)
    x_kept, y_kept = select_using_loss(x, y, losses, 0.5, key)
    assert x_kept.shape == (3,) and len(set(np.asarray(y_kept).tolist())) == 3
    np.testing.assert_array_equal(x_kept, np.asarray(y_kept) * 10.0)  # pairs stay together


def test_keeping_everything_keeps_every_example():
    kept = selection_indices(jnp.array([3.0, 1.0, 2.0]), 1.0, jax.random.key(0))
    assert sorted(np.asarray(kept).tolist()) == [0, 1, 2]


def test_inclusion_frequencies_match_sampling_without_replacement():
    # Keep 2 of 4: rank r is drawn first with p_r, second with p_s * p_r / (1 - p_s) after s.
    p = closed_form_probabilities(4, 0.5)
    inclusion = [p[r] + sum(p[s] * p[r] / (1 - p[s]) for s in range(4) if s != r) for r in range(4)]
    losses = jnp.array([4.0, 1.0, 3.0, 2.0])  # example i has rank [3, 0, 2, 1][i]
    keys = jax.random.split(jax.random.key(0), 4000)
    kept = jax.vmap(lambda key: selection_indices(losses, 0.5, key))(keys)
    frequency = np.array([(np.asarray(kept) == example).any(axis=1).mean() for example in range(4)])
    np.testing.assert_allclose(frequency, [inclusion[3], inclusion[0], inclusion[2], inclusion[1]], atol=0.03)
    assert frequency[0] > frequency[2] > frequency[3] > frequency[1]


def test_the_schedule_is_composers_window_with_interruptions():
    assert [should_selective_backprop(0.4, b, 0.5, 0.9, 2) for b in range(2)] == [False, False]
    assert [should_selective_backprop(0.5, b, 0.5, 0.9, 3) for b in range(6)] == [True, True, False] * 2
    assert [should_selective_backprop(0.7, b, 0.5, 0.9, 0) for b in range(3)] == [True] * 3
    assert not should_selective_backprop(0.9, 0, 0.5, 0.9, 0)
    state = State(model=None, max_duration="10ba")
    algorithm = SelectiveBackprop(start=0.5, end=0.9, keep=0.5, interrupt=2)
    matched = []
    for batch in range(10):
        state.timestamp = Timestamp(batch=batch, batch_in_epoch=batch)
        matched.append(algorithm.match(Event.BEFORE_FORWARD, state))
    assert matched == [False] * 5 + [False, True, False, True, False]
    assert not SelectiveBackprop(start=0.0, end=1.0, keep=1.0).match(Event.BEFORE_FORWARD, state)


class RecordBatch(Algorithm):
    """Store the batch the forward pass receives, and the step's key, in this algorithm's device state."""

    def __init__(self, kept: int, features: tuple[int, ...]) -> None:
        self.kept, self.features = kept, features

    def init_state(self, state):
        return {"x": jnp.zeros((self.kept, *self.features)), "y": jnp.zeros((self.kept,), jnp.int32),
                "key": jnp.zeros((2,), jnp.uint32)}

    def match(self, event, state):
        return event == Event.BEFORE_FORWARD

    def apply(self, event, state, logger):
        x, y = state.batch
        state.algorithm_state[self.name] = {"x": x, "y": y.astype(jnp.int32),
                                            "key": jax.random.key_data(state.step_rng)}


def linear_trainer(algorithms, max_duration="1ba", x=None, y=None) -> Trainer:
    model = ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), num_classes=2)
    return Trainer(model, ArrayLoader((x, y), batch_size=16, shuffle=False), max_duration=max_duration,
                   optimizers=optax.sgd(LR), algorithms=algorithms, progress_bar=False)


def test_an_active_step_trains_on_the_selected_examples_exactly_like_plain_jax(classification_arrays):
    x, y = classification_arrays
    initial = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    params = {"kernel": initial.kernel[...], "bias": initial.bias[...]}
    recorder = RecordBatch(8, (4,))
    selective = SelectiveBackprop(start=0.0, end=1.0, keep=0.5, interrupt=0)
    trainer = linear_trainer([recorder, selective], x=x, y=y)  # listed second, sorted first
    trainer.fit()

    seen = jax.device_get(trainer.state.train_state.algorithm_state["RecordBatch"])
    batch_x, batch_y = x[:16], y[:16]
    logits = batch_x @ params["kernel"] + params["bias"]
    key = jax.random.fold_in(jax.random.wrap_key_data(seen["key"]), SelectiveBackprop.rng_stream)
    expected_x, expected_y = select_using_loss(batch_x, batch_y, per_example_loss(logits, batch_y), 0.5, key)
    np.testing.assert_array_equal(seen["x"], expected_x)
    np.testing.assert_array_equal(seen["y"], expected_y)

    def loss(p):
        logits = expected_x @ p["kernel"] + p["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, expected_y).mean()

    reference = jax.tree.map(lambda p, g: p - LR * g, params, jax.grad(loss)(params))
    trained = jax.device_get(trainer.state.train_state.params["module"])
    np.testing.assert_allclose(trained["kernel"], reference["kernel"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trained["bias"], reference["bias"], rtol=1e-5, atol=1e-6)

    order = sorted((t for t in trainer.engine.trace_log if t.event == Event.BEFORE_FORWARD), key=lambda t: t.order)
    assert [t.name for t in order] == ["SelectiveBackprop", "RecordBatch"]


def test_a_run_crossing_the_start_compiles_two_steps(classification_arrays):
    x, y = classification_arrays
    trainer = linear_trainer([SelectiveBackprop(start=0.5, end=1.0, keep=0.5, interrupt=2)], "4ba", x, y)
    trainer.fit()
    assert trainer.compile_count == 2
    selected = [t.batch for t in trainer.engine.trace_log if t.name == "SelectiveBackprop"]
    assert selected == [2]  # batch 3 is the interrupting plain step


class CornerPixel(nnx.Module):
    """Logits from the top-left pixel only: sensitive to how the inputs were downscaled."""

    def __init__(self) -> None:
        self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def __call__(self, images: jax.Array) -> jax.Array:
        return self.linear(images[:, 0, 0])


def test_scale_factor_scores_on_downscaled_inputs():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 8, 8, 2)).astype(np.float32)
    y = rng.integers(0, 2, 16).astype(np.int32)
    recorder = RecordBatch(4, (8, 8, 2))
    model = ComposerClassifier(CornerPixel(), num_classes=2)
    params = {"kernel": np.asarray(model.module.linear.kernel[...]), "bias": np.asarray(model.module.linear.bias[...])}
    trainer = Trainer(model, ArrayLoader((x, y), batch_size=16, shuffle=False), max_duration="1ba",
                      optimizers=optax.sgd(LR), progress_bar=False,
                      algorithms=[SelectiveBackprop(start=0.0, end=1.0, keep=0.25, scale_factor=0.5, interrupt=0),
                                  recorder])
    trainer.fit()
    seen = jax.device_get(trainer.state.train_state.algorithm_state["RecordBatch"])
    # torch's bilinear 8 -> 4 (no antialias): output pixel (0, 0) reads source (0.5, 0.5), the mean of a 2x2 block
    corner = x[:, :2, :2].mean(axis=(1, 2))
    losses = per_example_loss(corner @ params["kernel"] + params["bias"], y)
    key = jax.random.fold_in(jax.random.wrap_key_data(seen["key"]), SelectiveBackprop.rng_stream)
    expected_x, _ = select_using_loss(x, y, losses, 0.25, key)
    np.testing.assert_array_equal(seen["x"], expected_x)  # full-size inputs are trained on


def test_scale_factor_needs_image_inputs(classification_arrays):
    x, y = classification_arrays
    trainer = linear_trainer([SelectiveBackprop(start=0.0, end=1.0, scale_factor=0.5, interrupt=0)], x=x, y=y)
    with pytest.raises(ValueError, match="scale_factor"):
        trainer.fit()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"start": -0.1}, "start"),
        ({"start": 0.6, "end": 0.5}, "end"),
        ({"keep": 0.0}, "keep"),
        ({"keep": 1.5}, "keep"),
        ({"scale_factor": 2.0}, "scale_factor"),
        ({"interrupt": -1}, "interrupt"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SelectiveBackprop(**kwargs)


def test_keeping_no_example_is_an_error():
    with pytest.raises(ValueError, match="keep"):
        selection_indices(jnp.ones(3), 0.2, jax.random.key(0))
