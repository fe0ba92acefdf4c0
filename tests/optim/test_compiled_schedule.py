"""compile_schedulers and with_schedule: the scheduled rate drives each update inside jit, as in Composer."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from composerjax.optim import (
    ConstantScheduler,
    CosineAnnealingWithWarmupScheduler,
    LinearScheduler,
    ScheduleContext,
    ScheduleState,
    StepScheduler,
    compile_schedulers,
    learning_rate_states,
    with_schedule,
)

TARGET = np.array([1.0, -2.0, 3.0], np.float32)
MULTIPLIER = compile_schedulers([CosineAnnealingWithWarmupScheduler(t_warmup="2ba")], ScheduleContext("6ba"))


def train_quadratic(optimizer, steps=6):
    """Minimise 0.5 * |w - TARGET|^2 from w = 0 (gradient w - TARGET); the weights after each step."""
    params = jnp.zeros(3, jnp.float32)
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    trajectory = []
    for _ in range(steps):
        updates, state = update(params - TARGET, state, params)
        params = optax.apply_updates(params, updates)
        trajectory.append(np.asarray(params))
    return np.array(trajectory), state, update


def hand_written_sgd(steps=6):
    """SGD with learning rate 0.1 * multiplier(t) at update t, in float32."""
    weights, trajectory = np.zeros(3, np.float32), []
    for step in range(steps):
        rate = np.float32(0.1) * np.float32(MULTIPLIER(jnp.int32(step)))
        weights = weights + (-rate) * (weights - TARGET)
        trajectory.append(weights)
    return np.array(trajectory)


def test_multiplier_values_are_the_cosine_with_warmup():
    values = [float(MULTIPLIER(jnp.int32(step))) for step in range(7)]
    np.testing.assert_allclose(values, [0.0, 0.5, 1.0, 0.853553, 0.5, 0.146447, 0.0], atol=1e-6)


def test_scheduled_inject_hyperparams_sgd_equals_hand_written_sgd_exactly():
    trajectory, state, update = train_quadratic(with_schedule(optax.inject_hyperparams(optax.sgd)(0.1), MULTIPLIER))
    np.testing.assert_array_equal(trajectory, hand_written_sgd())
    assert trajectory[0].tolist() == [0.0, 0.0, 0.0]  # multiplier(0) = 0: the first update does nothing
    assert isinstance(state, ScheduleState) and int(state.count) == 6
    assert float(state.inner_state.hyperparams["learning_rate"]) == pytest.approx(0.1 * 0.146447, rel=1e-5)
    assert update._cache_size() == 1  # one compile: the schedule runs inside the step


def test_scheduled_plain_sgd_equals_hand_written_sgd():
    trajectory, state, _ = train_quadratic(with_schedule(optax.sgd(0.1), MULTIPLIER))
    np.testing.assert_allclose(trajectory, hand_written_sgd(), rtol=1e-6)
    assert state.base_learning_rates == () and float(state.multiplier) == pytest.approx(0.146447, rel=1e-5)


def test_rates_nested_in_a_chain_are_scheduled_and_shown():
    adam = optax.inject_hyperparams(optax.adam)(learning_rate=0.01)
    _, state, _ = train_quadratic(with_schedule(optax.chain(optax.clip_by_global_norm(1.0), adam), MULTIPLIER), 3)
    (rate_state,) = learning_rate_states(state)
    assert float(rate_state.hyperparams["learning_rate"]) == pytest.approx(0.01 * 1.0)  # update 2 used multiplier(2)
    assert float(state.base_learning_rates[0]) == pytest.approx(0.01)


def test_an_optax_schedule_is_multiplied_and_shown_multiplied():
    schedule = optax.linear_schedule(0.2, 0.0, 4)
    _, state, _ = train_quadratic(with_schedule(optax.inject_hyperparams(optax.sgd)(schedule), MULTIPLIER), 2)
    # The second update used schedule(1) * multiplier(1) = 0.15 * 0.5.
    assert float(state.inner_state.hyperparams["learning_rate"]) == pytest.approx(0.075)
    trajectory, _, _ = train_quadratic(with_schedule(optax.inject_hyperparams(optax.sgd)(schedule), MULTIPLIER), 2)
    np.testing.assert_allclose(trajectory[1], -0.075 * (0 - TARGET), rtol=1e-6)


def test_numeric_and_scheduled_rates_together_are_refused():
    mixed = optax.chain(optax.inject_hyperparams(optax.sgd)(0.1),
                        optax.inject_hyperparams(optax.sgd)(optax.constant_schedule(0.1)))
    with pytest.raises(ValueError, match="as numbers and as optax schedules"):
        with_schedule(mixed, MULTIPLIER).init(jnp.zeros(2))


def test_with_several_schedulers_the_last_one_sets_the_rate_as_in_composer():
    context = ScheduleContext("10ba")
    with pytest.warns(UserWarning, match=r"only the last one, LinearScheduler\(.*\), takes effect"):
        multiplier = compile_schedulers([ConstantScheduler(alpha=0.1), LinearScheduler()], context)
    assert [float(multiplier(jnp.int32(step))) for step in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])


def test_no_schedulers_is_a_constant_rate_and_none_steps_every_batch():
    context = ScheduleContext("2ep", steps_per_epoch=4)
    assert float(compile_schedulers(None, context)(jnp.int32(3))) == 1.0
    assert float(compile_schedulers([], context)(jnp.int32(3))) == 1.0
    default = compile_schedulers(StepScheduler("1ba", gamma=0.5), context, step_every_batch=None)
    per_epoch = compile_schedulers(StepScheduler("1ba", gamma=0.5), context, step_every_batch=False)
    assert [float(default(jnp.int32(step))) for step in (0, 3, 5)] == [1.0, 0.125, 0.03125]
    assert [float(per_epoch(jnp.int32(step))) for step in (0, 3, 4, 7)] == [1.0, 1.0, 0.0625, 0.0625]


def test_what_cannot_be_compiled_is_refused_with_the_reason():
    context = ScheduleContext("10ba")
    with pytest.raises(TypeError, match=r"schedulers\[1\]=<function .*expected a ComposerScheduler"):
        compile_schedulers([LinearScheduler(), lambda state: 1.0], context)
    with pytest.raises(ValueError, match="step_schedulers_every_batch=False .* has no length"):
        compile_schedulers([LinearScheduler()], context, step_every_batch=False)


def test_the_multiplier_is_traced_once_and_runs_under_vmap():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        values = jax.jit(jax.vmap(MULTIPLIER))(jnp.arange(7, dtype=jnp.int32))
    assert values.dtype == jnp.float32
    np.testing.assert_allclose(values, [0.0, 0.5, 1.0, 0.853553, 0.5, 0.146447, 0.0], atol=1e-6)
