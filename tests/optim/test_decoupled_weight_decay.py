"""DecoupledAdamW and DecoupledSGDW: a few steps equal Composer's update rule, written here in numpy."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from composerjax.optim import DecoupledAdamW, DecoupledSGDW, optimizer_name, with_schedule

GRADS = [np.array([0.5, -1.0, 2.0], np.float32), np.array([-0.25, 0.75, 1.5], np.float32),
         np.array([1.0, 0.5, -0.5], np.float32), np.array([0.1, -0.2, 0.3], np.float32)]
START = np.array([1.0, -2.0, 0.5], np.float32)


def composer_adamw(grads, lrs, initial_lr, beta1, beta2, eps, weight_decay, amsgrad=False):
    """Composer's DecoupledAdamW.adamw, one parameter, in float64."""
    param = START.astype(np.float64)
    exp_avg, exp_avg_sq, max_exp_avg_sq = np.zeros(3), np.zeros(3), np.zeros(3)
    for step, (grad, lr) in enumerate(zip(grads, lrs), start=1):
        if weight_decay != 0:
            decay_factor = (lr / initial_lr) if initial_lr else 1.0
            param = param * (1 - decay_factor * weight_decay)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        exp_avg = exp_avg * beta1 + grad * (1 - beta1)
        exp_avg_sq = exp_avg_sq * beta2 + grad * grad * (1 - beta2)
        if amsgrad:
            max_exp_avg_sq = np.maximum(max_exp_avg_sq, exp_avg_sq)
            denom = np.sqrt(max_exp_avg_sq) / math.sqrt(bias_correction2) + eps
        else:
            denom = np.sqrt(exp_avg_sq) / math.sqrt(bias_correction2) + eps
        param = param - (lr / bias_correction1) * exp_avg / denom
    return param


def composer_sgdw(grads, lrs, initial_lr, momentum, dampening, weight_decay, nesterov):
    """Composer's DecoupledSGDW.sgdw, one parameter, in float64."""
    param, buf = START.astype(np.float64), None
    for grad, lr in zip(grads, lrs):
        d_p = grad.astype(np.float64)
        if momentum != 0:
            buf = d_p.copy() if buf is None else buf * momentum + d_p * (1 - dampening)
            d_p = d_p + momentum * buf if nesterov else buf
        if weight_decay != 0:
            decay_factor = (lr / initial_lr) if initial_lr else 1.0
            param = param * (1 - decay_factor * weight_decay)
        param = param - lr * d_p
    return param


def run(optimizer, grads=GRADS):
    params = jnp.asarray(START)
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    for grad in grads:
        updates, state = update(jnp.asarray(grad), state, params)
        params = optax.apply_updates(params, updates)
    return np.asarray(params), state


HALVING = lambda count: 0.5 ** count.astype(jnp.float32)  # noqa: E731
HALVING_LRS = [0.5**step for step in range(len(GRADS))]


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("scheduled", [False, True])
def test_decoupled_adamw_follows_composer(amsgrad, scheduled):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weight_decay=0.01 is 'high' for Composer
        optimizer = DecoupledAdamW(lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.01, amsgrad=amsgrad)
    factors = HALVING_LRS if scheduled else [1.0] * len(GRADS)
    params, state = run(with_schedule(optimizer, HALVING) if scheduled else optimizer)
    expected = composer_adamw(GRADS, [0.1 * f for f in factors], 0.1, 0.8, 0.9, 1e-6, 0.01, amsgrad)
    np.testing.assert_allclose(params, expected, rtol=1e-6, atol=1e-7)
    rates = state.inner_state.hyperparams if scheduled else state.hyperparams
    assert float(rates["learning_rate"]) == pytest.approx(0.1 * factors[-1])


def test_decoupled_adamw_decay_follows_the_schedule_not_the_rate():
    # Zero gradients: Adam's step is 0, only the decay moves the weights: w *= 1 - factor * weight_decay.
    optimizer = with_schedule(DecoupledAdamW(lr=0.001, weight_decay=1e-4), HALVING)
    params, _ = run(optimizer, [np.zeros(3, np.float32)] * 3)
    np.testing.assert_allclose(params, START * (1 - 1e-4) * (1 - 0.5e-4) * (1 - 0.25e-4), rtol=1e-7)


@pytest.mark.parametrize(("momentum", "dampening", "nesterov"), [(0.0, 0.0, False), (0.9, 0.0, False),
                                                                 (0.9, 0.3, False), (0.9, 0.0, True)])
@pytest.mark.parametrize("scheduled", [False, True])
def test_decoupled_sgdw_follows_composer(momentum, dampening, nesterov, scheduled):
    optimizer = DecoupledSGDW(lr=0.05, momentum=momentum, dampening=dampening, weight_decay=5e-4, nesterov=nesterov)
    factors = HALVING_LRS if scheduled else [1.0] * len(GRADS)
    params, _ = run(with_schedule(optimizer, HALVING) if scheduled else optimizer)
    expected = composer_sgdw(GRADS, [0.05 * f for f in factors], 0.05, momentum, dampening, 5e-4, nesterov)
    np.testing.assert_allclose(params, expected, rtol=1e-6, atol=1e-7)


def test_defaults_and_names_are_composers():
    state = DecoupledAdamW().init(jnp.zeros(2))
    values = {key: float(value) for key, value in state.hyperparams.items()}
    assert values == pytest.approx({"learning_rate": 1e-3, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 1e-5,
                                    "initial_lr": 1e-3})
    assert optimizer_name(DecoupledAdamW()) == "DecoupledAdamW"
    assert optimizer_name(with_schedule(DecoupledSGDW(lr=0.1), HALVING)) == "DecoupledSGDW"
    assert DecoupledSGDW(lr=0.1).init(jnp.zeros(2)).inner_state.momentum_buffer == ()  # no momentum: no buffer


def test_a_zero_learning_rate_decays_by_the_full_weight_decay():
    # Composer: decay_factor = lr / initial_lr if initial_lr else 1.0.
    params, _ = run(DecoupledSGDW(lr=0.0, weight_decay=1e-4), GRADS[:2])
    np.testing.assert_allclose(params, START * (1 - 1e-4) ** 2, rtol=1e-7)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: DecoupledAdamW(lr=-0.1), r"DecoupledAdamW\(lr=-0.1\): expected a number at least 0"),
    (lambda: DecoupledAdamW(betas=(0.9, 1.0)), r"DecoupledAdamW\(betas\[1\]=1.0\): expected a number in \[0.0, 1.0\)"),
    (lambda: DecoupledAdamW(lr=optax.linear_schedule(0.1, 0.0, 10)), r"expected a finite number \(schedule the rate"),
    (lambda: DecoupledSGDW(lr=0.1, nesterov=True), "Nesterov momentum requires a momentum and zero dampening"),
    (lambda: DecoupledSGDW(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "zero dampening"),
    (lambda: DecoupledSGDW(lr=0.1, weight_decay=-1.0), r"DecoupledSGDW\(weight_decay=-1.0\)"),
])
def test_bad_hyperparameters_are_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_high_weight_decay_warns_like_composer():
    with pytest.warns(UserWarning, match=r"multiplied by 0.99 on every step"):
        DecoupledSGDW(lr=0.1, weight_decay=0.01)


def test_update_without_params_says_what_is_missing():
    optimizer = DecoupledAdamW()
    with pytest.raises(ValueError, match=r"update\(grads, state, params\)"):
        optimizer.update(jnp.ones(2), optimizer.init(jnp.zeros(2)))
