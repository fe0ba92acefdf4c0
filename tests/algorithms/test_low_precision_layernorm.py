"""LowPrecisionLayerNorm: bf16 LayerNorm against a bf16 reference and fp32, float32 params, run-last at INIT."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, ComposerClassifier, Event, Trainer
from composerjax.algorithms.low_precision_layernorm import (
    LowPrecisionLayerNorm,
    LPLayerNorm,
    apply_low_precision_layernorm,
)
from composerjax.data.text import byte_windows, load_pydoc_bytes
from composerjax.models import TinyGPT
from composerjax.models.surgery import count_modules


def bf16_layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float) -> jax.Array:
    """A LayerNorm whose every operation is in bfloat16, written out with plain jax."""
    xb = x.astype(jnp.bfloat16)
    mean = xb.mean(-1, keepdims=True)
    centered = xb - mean
    variance = (centered * centered).mean(-1, keepdims=True)
    normalized = centered * jax.lax.rsqrt(variance + jnp.bfloat16(epsilon))
    return (normalized * scale.astype(jnp.bfloat16) + bias.astype(jnp.bfloat16)).astype(x.dtype)


def test_output_is_the_bf16_computation_and_close_to_fp32():
    layer_norm = nnx.LayerNorm(64, rngs=nnx.Rngs(0))
    layer_norm.scale[...] = jnp.linspace(0.5, 2.0, 64)
    layer_norm.bias[...] = jnp.linspace(-1.0, 1.0, 64)
    x = 3.0 * jax.random.normal(jax.random.key(0), (8, 64)) + 1.0
    fp32 = layer_norm(x)
    low = LPLayerNorm(layer_norm)
    y = low(x)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, bf16_layer_norm(x, layer_norm.scale[...], layer_norm.bias[...], 1e-6))
    np.testing.assert_allclose(y, fp32, atol=3e-2, rtol=2e-2)  # bf16 keeps 8 significant bits
    assert not np.array_equal(y, fp32)  # it really did compute in bf16
    assert low.scale.dtype == jnp.float32 and low.bias.dtype == jnp.float32
    assert low.scale is layer_norm.scale  # the same parameters, not copies


def test_counts_and_parameters_stay_float32():
    model = TinyGPT(dim=32, depth=1, num_heads=2, max_length=32, rngs=nnx.Rngs(0))
    before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert apply_low_precision_layernorm(model) == 3  # norm1, norm2, final norm
    assert count_modules(model, nnx.LayerNorm) == 0
    after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert jax.tree.structure(after) == jax.tree.structure(before)  # same parameter tree
    assert {leaf.dtype for leaf in jax.tree.leaves(after)} == {jnp.dtype(jnp.float32)}
    assert apply_low_precision_layernorm(model) == 0
    cross_device = nnx.Sequential(nnx.LayerNorm(4, axis_name="data", rngs=nnx.Rngs(0)))
    assert apply_low_precision_layernorm(cross_device) == 0


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="precision='fp32'"):
        LowPrecisionLayerNorm(precision="fp32")
    with pytest.raises(ValueError, match="apply_at=<Event.FIT_START.*Event.INIT"):
        LowPrecisionLayerNorm(apply_at=Event.FIT_START)
    with pytest.raises(ValueError, match="apply_at='later'"):
        LowPrecisionLayerNorm(apply_at="later")
    with pytest.raises(ValueError, match="precision='fp8'"):
        apply_low_precision_layernorm(nnx.LayerNorm(4, rngs=nnx.Rngs(0)), "fp8")


def test_composer_constructor_and_defaults():
    algorithm = LowPrecisionLayerNorm()
    assert algorithm.apply_at is Event.INIT and algorithm.precision is None
    assert LowPrecisionLayerNorm(apply_at="after_load").apply_at is Event.AFTER_LOAD
    assert LowPrecisionLayerNorm(Event.BEFORE_LOAD).match(Event.BEFORE_LOAD, None)
    assert not LowPrecisionLayerNorm(Event.BEFORE_LOAD).match(Event.INIT, None)


def tiny_text_trainer(algorithms: list, precision: str = "fp32", **kwargs) -> Trainer:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.LayerNorm(8, rngs=nnx.Rngs(0)),
                           nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
    return Trainer(ComposerClassifier(model, 2), ArrayLoader((x, y), 16, shuffle=False), "2ba", optax.sgd(0.5),
                   algorithms=algorithms, precision=precision, progress_bar=False, **kwargs)


def test_fp32_run_is_left_alone_with_a_warning_as_in_composer():
    with pytest.warns(UserWarning, match="applies only to low-precision runs"):
        trainer = tiny_text_trainer([LowPrecisionLayerNorm()])
    assert count_modules(trainer.state.model, LPLayerNorm) == 0
    with pytest.warns(UserWarning, match="precision='fp32': no LayerNorm replaced"):
        assert apply_low_precision_layernorm(nnx.LayerNorm(4, rngs=nnx.Rngs(0)), "fp32") == 0
    # precision='bf16' forces it in an fp32 run
    assert count_modules(tiny_text_trainer([LowPrecisionLayerNorm(precision="bf16")]).state.model, LPLayerNorm) == 1


def test_amp_bf16_run_is_converted():
    trainer = tiny_text_trainer([LowPrecisionLayerNorm()], precision="amp_bf16")
    layer = trainer.state.model.module.layers[1]
    assert isinstance(layer, LPLayerNorm) and layer.compute_dtype == jnp.bfloat16


@pytest.mark.parametrize("apply_at, event", [("after_load", "AFTER_LOAD"), ("before_load", "BEFORE_LOAD")])
def test_load_time_surgery_hands_the_model_back_and_keeps_the_weights(tmp_path, apply_at, event):
    saver = tiny_text_trainer([], save_folder=str(tmp_path), save_interval="2ba")
    saver.fit()
    saved = jax.device_get(saver.state.params)
    saver.close()
    trainer = tiny_text_trainer([LowPrecisionLayerNorm(apply_at=apply_at, precision="bf16")],
                                load_path=str(tmp_path), load_weights_only=True)
    assert [t.key for t in trainer.engine.trace_log if t.name == "LowPrecisionLayerNorm"] == [
        f"LowPrecisionLayerNorm/{event}"]
    # the compiled steps run the converted model, with the checkpoint's weights (checked before
    # anything reads state.model, which would hand the device weights back to the host model)
    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    predicted = np.concatenate(trainer.predict(ArrayLoader((x,), 16, shuffle=False)))
    for a, b in zip(jax.tree.leaves(jax.device_get(trainer.state.params)), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(a, b)
    assert count_modules(trainer.state.model, LPLayerNorm) == 1
    network = trainer.state.model.module
    np.testing.assert_array_equal(predicted, nnx.jit(lambda m, v: m(v))(network, jnp.asarray(x)))
    fp32 = nnx.Sequential(network.layers[0], nnx.LayerNorm(8, rngs=nnx.Rngs(0)), network.layers[2])
    fp32.layers[1].scale, fp32.layers[1].bias = network.layers[1].scale, network.layers[1].bias
    assert not np.allclose(predicted, fp32(jnp.asarray(x)), rtol=0, atol=1e-4)  # bf16, not the fp32 LayerNorm
    trainer.fit("1ba")
    assert np.isfinite(float(trainer.state.loss))


class NormalizeHead(Algorithm):
    """Another INIT surgery that adds a LayerNorm in front of TinyGPT's head."""

    def match(self, event, state):
        return event == Event.INIT

    def apply(self, event, state, logger):
        gpt = state.model.module
        gpt.head = nnx.Sequential(nnx.LayerNorm(32, rngs=nnx.Rngs(1)), gpt.head)


def test_runs_last_at_init_so_it_converts_layernorms_added_by_other_surgery():
    x, y = byte_windows(load_pydoc_bytes()[:20000], 32)
    loader = ArrayLoader((x[:32], y[:32]), 16, shuffle=False)
    model = ComposerClassifier(TinyGPT(dim=32, depth=1, num_heads=2, max_length=32, rngs=nnx.Rngs(0)), 256)
    trainer = Trainer(model, loader, "4ba", optax.adam(1e-2), algorithms=[LowPrecisionLayerNorm(), NormalizeHead()],
                      precision="amp_bf16", progress_bar=False)
    init = [trace.key for trace in trainer.engine.trace_log if trace.event == Event.INIT]
    assert init == ["NormalizeHead/INIT", "LowPrecisionLayerNorm/INIT"]
    converted = trainer.state.model
    assert count_modules(converted, LPLayerNorm) == 4 and count_modules(converted, nnx.LayerNorm) == 0
    trainer.fit()
    params = trainer.state.train_state.params["module"]
    assert params["norm"]["scale"].dtype == jnp.float32 and params["head"]["layers"][0]["scale"].dtype == jnp.float32
    assert np.isfinite(float(trainer.state.loss)) and float(trainer.state.loss) < np.log(256)
    assert trainer.compile_count == 1
