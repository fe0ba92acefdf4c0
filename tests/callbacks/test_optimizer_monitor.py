"""OptimizerMonitor: in-step norms equal norms of gradients computed independently with plain JAX (optax.tree.norm)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from composerjax import ArrayLoader, Callback, Trainer
from composerjax.callbacks.optimizer_monitor import OptimizerMonitor, l2_norms
from composerjax.loggers import InMemoryLogger

LR = 0.1


class RecordBatchAndParams(Callback):
    """Host copies of each batch and of the parameters it is trained from."""

    def __init__(self) -> None:
        self.batches: list = []
        self.params: list = []

    def batch_start(self, state, logger):
        self.batches.append(jax.device_get(state.batch))
        self.params.append(jax.device_get(state.params))


def plain_grads(params: dict, batch: tuple) -> dict:
    """The classifier's cross-entropy gradient, written without the trainer."""
    x, y = batch

    def loss(p):
        logits = x @ p["module"]["kernel"] + p["module"]["bias"]
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))

    return jax.grad(loss)(params)


def norm(tree) -> float:
    return float(optax.tree.norm(tree))


def train(classification_arrays, make_tiny_classifier, monitor, duration="4ba", **kwargs):
    x, y = classification_arrays
    recorder = RecordBatchAndParams()
    memory = InMemoryLogger()
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration=duration,
                      optimizers=optax.sgd(LR), callbacks=[recorder, monitor], loggers=[memory], log_interval=1,
                      progress_bar=False, run_summary=False, **kwargs)
    trainer.fit()
    return trainer, recorder, {name: dict(values) for name, values in memory.data.items()}


def test_norms_equal_plain_jax_every_batch(classification_arrays, make_tiny_classifier):
    trainer, recorder, logged = train(classification_arrays, make_tiny_classifier,
                                      OptimizerMonitor(batch_log_interval=1))
    final = jax.device_get(trainer.state.params)
    for step in range(1, 5):
        params, batch = recorder.params[step - 1], recorder.batches[step - 1]
        after = recorder.params[step] if step < 4 else final
        grads = plain_grads(params, batch)
        update = jax.tree.map(lambda new, old: new - old, after, params)
        assert logged["train/l2_norm/grad/global"][step] == pytest.approx(norm(grads), rel=1e-6)
        assert logged["train/l2_norm/grad/module.kernel"][step] == pytest.approx(norm(grads["module"]["kernel"]),
                                                                               rel=1e-6)
        assert logged["train/l2_norm/grad/module.bias"][step] == pytest.approx(norm(grads["module"]["bias"]),
                                                                             rel=1e-6)
        assert logged["train/l2_norm/param/global"][step] == pytest.approx(norm(after), rel=1e-6)
        assert logged["train/l2_norm/param/module.bias"][step] == pytest.approx(norm(after["module"]["bias"]),
                                                                              rel=1e-6)
        # SGD's update is -lr * grad.
        assert logged["train/l2_norm/update/global"][step] == pytest.approx(LR * norm(grads), rel=1e-5)
        assert logged["train/l2_norm/update/module.kernel"][step] == pytest.approx(norm(update["module"]["kernel"]),
                                                                                 rel=1e-5)
        assert logged["train/l2_norm_ratio/update_param/global"][step] == pytest.approx(
            norm(update) / norm(after), rel=1e-5)
    assert trainer.compile_count == 1


def test_only_every_batch_log_interval_is_logged(classification_arrays, make_tiny_classifier):
    trainer, recorder, logged = train(classification_arrays, make_tiny_classifier,
                                      OptimizerMonitor(batch_log_interval=3), duration="2ep")
    assert sorted(logged["train/l2_norm/grad/global"]) == [3, 6]
    assert sorted(logged["loss/train/total"]) == list(range(1, 9))  # the trainer's own rows are untouched
    for step in (3, 6):
        grads = plain_grads(recorder.params[step - 1], recorder.batches[step - 1])
        assert logged["train/l2_norm/grad/global"][step] == pytest.approx(norm(grads), rel=1e-6)
    assert trainer.compile_count == 1


def test_without_optimizer_metrics_and_with_microbatches(classification_arrays, make_tiny_classifier):
    trainer, recorder, logged = train(classification_arrays, make_tiny_classifier,
                                      OptimizerMonitor(log_optimizer_metrics=False, batch_log_interval=1),
                                      duration="2ba", device_train_microbatch_size=8)
    assert not any("update" in name for name in logged)
    # The mean of two microbatches' gradients is the whole batch's gradient.
    grads = plain_grads(recorder.params[1], recorder.batches[1])
    assert logged["train/l2_norm/grad/global"][2] == pytest.approx(norm(grads), rel=1e-5)
    assert trainer.compile_count == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_log_interval": 0}, "batch_log_interval=0"),
    ({"log_optimizer_metrics": "yes"}, "log_optimizer_metrics='yes'"),
])
def test_invalid_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimizerMonitor(**kwargs)


def test_l2_norms_of_bf16_leaves_are_float32():
    norms = l2_norms({"w": jnp.full((300,), 0.1, jnp.bfloat16)}, "param")
    assert norms["l2_norm/param/global"].dtype == jnp.float32
    assert float(norms["l2_norm/param/w"]) == pytest.approx(np.sqrt(300 * float(jnp.bfloat16(0.1)) ** 2), rel=1e-6)
