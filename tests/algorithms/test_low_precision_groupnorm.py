"""LowPrecisionGroupNorm: bf16 GroupNorm against a plain bf16 reference, surgery counts, Composer's no-op cases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Event, Trainer
from composerjax.algorithms.low_precision_groupnorm import (
    LowPrecisionGroupNorm,
    LPGroupNorm,
    apply_low_precision_groupnorm,
    low_precision_group_norm,
)
from composerjax.models.surgery import count_modules


def bf16_group_norm(x: jax.Array, groups: int, scale: jax.Array, bias: jax.Array, epsilon: float) -> jax.Array:
    """GroupNorm of an (N, H, C) input with every operation in bfloat16, written out group by group."""
    xb = x.astype(jnp.bfloat16)
    size = x.shape[-1] // groups
    parts = []
    for g in range(groups):
        part = xb[..., g * size:(g + 1) * size]
        mean = part.mean(axis=(1, 2), keepdims=True)
        centered = part - mean
        variance = (centered * centered).mean(axis=(1, 2), keepdims=True)
        parts.append(centered * jax.lax.rsqrt(variance + jnp.bfloat16(epsilon)))
    normalized = jnp.concatenate(parts, axis=-1)
    return (normalized * scale.astype(jnp.bfloat16) + bias.astype(jnp.bfloat16)).astype(x.dtype)


def trained_group_norm() -> nnx.GroupNorm:
    norm = nnx.GroupNorm(4, num_groups=2, rngs=nnx.Rngs(0))
    norm.scale[...] = jnp.array([0.5, 1.0, 1.5, 2.0])
    norm.bias[...] = jnp.array([-1.0, 0.0, 0.5, 1.0])
    return norm


def test_output_is_the_bf16_computation_and_close_to_fp32():
    x = 3.0 * jax.random.normal(jax.random.key(0), (2, 3, 4)) + 1.0
    norm = trained_group_norm()
    fp32 = norm(x)
    low = LPGroupNorm(norm)
    y = low(x)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, bf16_group_norm(x, 2, norm.scale[...], norm.bias[...], 1e-6))
    np.testing.assert_allclose(y, fp32, atol=3e-2, rtol=2e-2)  # bf16 keeps 8 significant bits
    assert not np.array_equal(y, fp32)  # it really did compute in bf16
    assert low.scale is norm.scale and low.scale.dtype == jnp.float32  # the same float32 parameters
    # the pure form in float32 is nnx.GroupNorm itself
    np.testing.assert_allclose(low_precision_group_norm(x, 2, norm.scale[...], norm.bias[...], 1e-6, jnp.float32),
                               fp32, rtol=1e-5, atol=1e-5)


def test_hand_computed_groups():
    # one sample, two groups of two channels: [1, 3] and [10, 30] are each normalized on their own
    y = low_precision_group_norm(jnp.array([[1.0, 3.0, 10.0, 30.0]]), 2, None, None, epsilon=0.0)
    assert y.tolist() == [[-1.0, 1.0, -1.0, 1.0]]
    with pytest.raises(ValueError, match="num_groups=3"):
        low_precision_group_norm(jnp.ones((1, 4)), 3, None, None)


def test_counts_and_parameters_stay_float32():
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(4, 4, rngs=rngs), nnx.GroupNorm(4, 2, rngs=rngs),
                           nnx.Sequential(nnx.GroupNorm(4, 4, rngs=rngs)),
                           nnx.GroupNorm(4, 2, axis_name="data", rngs=rngs))  # cross-device: left alone
    before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert apply_low_precision_groupnorm(model) == 2
    assert count_modules(model, LPGroupNorm) == 2 and count_modules(model, nnx.GroupNorm) == 1
    after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert jax.tree.structure(after) == jax.tree.structure(before)
    assert {leaf.dtype for leaf in jax.tree.leaves(after)} == {jnp.dtype(jnp.float32)}
    assert apply_low_precision_groupnorm(model) == 0
    with pytest.warns(UserWarning, match="precision='fp32': no GroupNorm replaced"):
        assert apply_low_precision_groupnorm(nnx.Sequential(nnx.GroupNorm(4, 2, rngs=rngs)), "fp32") == 0


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="apply_at=<Event.FIT_START.*Event.INIT"):
        LowPrecisionGroupNorm(apply_at=Event.FIT_START)
    with pytest.raises(ValueError, match="precision='fp32'"):
        LowPrecisionGroupNorm(precision="fp32")
    assert LowPrecisionGroupNorm().apply_at is Event.INIT
    assert LowPrecisionGroupNorm("before_load").events == {Event.BEFORE_LOAD}


def trainer_for(network: nnx.Module, algorithms: list, precision: str) -> Trainer:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3, 4)).astype(np.float32)
    y = (x.mean(axis=(1, 2)) > 0).astype(np.int32)
    return Trainer(ComposerClassifier(network, 2), ArrayLoader((x, y), 8, shuffle=False), "2ba", optax.sgd(0.1),
                   algorithms=algorithms, precision=precision, progress_bar=False)


def group_norm_network() -> nnx.Module:
    rngs = nnx.Rngs(0)
    return nnx.Sequential(nnx.GroupNorm(4, 2, rngs=rngs), lambda h: h.mean(axis=1), nnx.Linear(4, 2, rngs=rngs))


def test_amp_bf16_run_trains_with_the_converted_model():
    trainer = trainer_for(group_norm_network(), [LowPrecisionGroupNorm()], "amp_bf16")
    assert isinstance(trainer.state.model.module.layers[0], LPGroupNorm)
    trainer.fit()
    assert trainer.compile_count == 1 and np.isfinite(float(trainer.state.loss))
    assert trainer.state.train_state.params["module"]["layers"][0]["scale"].dtype == jnp.float32


def test_no_effect_warnings_as_in_composer():
    with pytest.warns(UserWarning, match="applies only to low-precision runs"):
        trainer = trainer_for(group_norm_network(), [LowPrecisionGroupNorm()], "fp32")
    assert count_modules(trainer.state.model, LPGroupNorm) == 0
    with pytest.warns(UserWarning, match="the model has no nnx.GroupNorm"):
        trainer_for(nnx.Sequential(lambda h: h.mean(axis=1), nnx.Linear(4, 2, rngs=nnx.Rngs(0))),
                    [LowPrecisionGroupNorm()], "amp_bf16")
