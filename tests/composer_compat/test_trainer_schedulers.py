"""Schedulers through the Trainer: the step applies lr * Composer's multiplier, ssr scales the run, LR is logged."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Trainer
from composerjax.callbacks import LRMonitor
from composerjax.data import ArrayLoader
from composerjax.loggers import InMemoryLogger
from composerjax.optim import CosineAnnealingWithWarmupScheduler, DecoupledSGDW, LinearScheduler

LR = 0.5


def data():
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)).astype(np.float32)
    return x, y


def mse(model, batch):
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def make(**kwargs) -> Trainer:
    arguments = dict(max_duration="2ep", optimizers=optax.sgd(LR), loss_fn=mse, progress_bar=False,
                     run_summary=False)
    arguments.update(kwargs)
    return Trainer(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), ArrayLoader(data(), batch_size=16, shuffle=False),
                   **arguments)


def reference(multipliers: list[float]) -> dict:
    """Plain-JAX SGD with lr = LR * multiplier(step), on the same unshuffled batches."""
    params = jax.device_get(nnx.to_pure_dict(nnx.state(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), nnx.Param)))
    x, y = data()
    for step, alpha in enumerate(multipliers):
        xb, yb = x[(step % 4) * 16:(step % 4 + 1) * 16], y[(step % 4) * 16:(step % 4 + 1) * 16]
        grads = jax.grad(lambda p, xb=xb, yb=yb: jnp.mean((xb @ p["kernel"] + p["bias"] - yb) ** 2))(params)
        params = jax.tree.map(lambda p, g, alpha=alpha: p - LR * alpha * g, params, grads)
    return params


def cosine_with_warmup(step: int, warmup: int, total: int) -> float:
    """Composer's CosineAnnealingWithWarmupScheduler (alpha_f=0): linear warmup, then half a cosine."""
    if step < warmup:
        return step / warmup
    frac = (step - warmup) / (total - warmup)
    return 0.5 * (1 + math.cos(math.pi * frac))


def assert_params(trainer, expected):
    for a, b in zip(jax.tree.leaves(jax.device_get(trainer.state.train_state.params)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_a_scheduler_scales_every_update_by_composers_multiplier():
    memory = InMemoryLogger()
    trainer = make(schedulers=[CosineAnnealingWithWarmupScheduler(t_warmup="0.25dur")], loggers=[memory],
                   optimizers=optax.inject_hyperparams(optax.sgd)(learning_rate=LR), callbacks=[LRMonitor()],
                   log_interval=1)
    trainer.fit()
    multipliers = [cosine_with_warmup(step, 2, 8) for step in range(8)]
    assert_params(trainer, reference(multipliers))
    logged = [value for _, value in memory.data["lr-sgd/group0"]]
    np.testing.assert_allclose(logged, [LR * m for m in multipliers], rtol=1e-6, atol=1e-7)


def test_a_plain_optax_optimizer_is_scheduled_too():
    trainer = make(schedulers=[CosineAnnealingWithWarmupScheduler(t_warmup="0.25dur")])
    trainer.fit()
    assert_params(trainer, reference([cosine_with_warmup(step, 2, 8) for step in range(8)]))


def test_scale_schedule_ratio_scales_the_run_and_the_schedule():
    trainer = make(max_duration="4ep", schedulers=[LinearScheduler(alpha_i=1.0, alpha_f=0.0, t_max="1dur")],
                   scale_schedule_ratio=0.5)
    assert str(trainer.state.max_duration) == "2ep"  # Composer: max_duration * ratio
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == 8
    assert_params(trainer, reference([1 - step / 8 for step in range(8)]))


def test_epoch_stepping_holds_the_multiplier_for_an_epoch():
    trainer = make(schedulers=[LinearScheduler(alpha_i=1.0, alpha_f=0.0, t_max="2ep")],
                   step_schedulers_every_batch=False)
    trainer.fit()
    assert_params(trainer, reference([1.0] * 4 + [0.5] * 4))


def test_decoupled_sgdw_under_a_schedule_is_visible_to_lr_monitor():
    memory = InMemoryLogger()
    trainer = make(optimizers=DecoupledSGDW(lr=LR), schedulers=LinearScheduler(alpha_f=0.5, t_max="8ba"),
                   loggers=[memory], callbacks=[LRMonitor()], log_interval=1)
    trainer.fit()
    logged = [value for _, value in memory.data["lr-DecoupledSGDW/group0"]]
    np.testing.assert_allclose(logged, [LR * (1 - 0.5 * step / 8) for step in range(8)], rtol=1e-6)


def test_fit_replaces_the_schedulers_and_keeps_the_optimizer_state():
    trainer = make(max_duration="1ep", schedulers=LinearScheduler(alpha_i=1.0, alpha_f=1.0))
    trainer.fit()
    trainer.fit(duration="1ep", schedulers=LinearScheduler(alpha_i=0.5, alpha_f=0.5))
    assert_params(trainer, reference([1.0] * 4 + [0.5] * 4))


def test_scheduler_arguments_that_cannot_apply_are_refused():
    with pytest.raises(ValueError, match=r"scale_schedule_ratio without schedulers has no effect"):
        make(scale_schedule_ratio=0.5)
    trainer = make(max_duration="1ba")
    trainer.fit()
    with pytest.raises(ValueError, match=r"fit\(schedulers=...\): this Trainer was built without schedulers"):
        trainer.fit(duration="1ba", schedulers=LinearScheduler())
    with pytest.raises(ValueError, match=r"scale_schedule_ratio=-1"):
        make(schedulers=LinearScheduler(), scale_schedule_ratio=-1)


def test_fit_schedulers_before_the_first_batch_build_a_fresh_optimizer_state():
    trainer = make()
    trainer.fit(schedulers=[CosineAnnealingWithWarmupScheduler(t_warmup="0.25dur")])
    assert_params(trainer, reference([cosine_with_warmup(step, 2, 8) for step in range(8)]))
