"""Recipes: five or more algorithms composed in one trainer compile, train and are ordered by the passes."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Event, Trainer
from composerjax.algorithms import (
    EMA,
    SAM,
    Alibi,
    BlurPool,
    CutMix,
    CutOut,
    GatedLinearUnits,
    GradientClipping,
    LabelSmoothing,
    LowPrecisionLayerNorm,
    MixUp,
    SelectiveBackprop,
    SeqLengthWarmup,
)
from composerjax.data.text import byte_windows, load_pydoc_bytes
from composerjax.models import SmallResNet, TinyGPT


def images(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(n, 8, 8)).astype(np.float32)
    y = (x[:, :4].mean(axis=(1, 2)) > x[:, 4:].mean(axis=(1, 2))).astype(np.int32)
    return x, y


def test_image_recipe_of_seven_algorithms_trains_with_bounded_compiles():
    x, y = images()
    recipe = [
        LabelSmoothing(0.1),
        CutOut(num_holes=1, length=0.25),
        EMA(half_life="4ba"),
        GradientClipping("norm", 1.0),
        SAM(rho=0.05),
        BlurPool(min_channels=1),
        SelectiveBackprop(start=0.5, end=1.0, keep=0.5, interrupt=0),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no conflicting loss interpolation, no surgery that did nothing
        trainer = Trainer(ComposerClassifier(SmallResNet(num_classes=2, width=4, rngs=nnx.Rngs(0)), 2),
                          ArrayLoader((x, y), 16, seed=0), "8ba", optax.adam(1e-2), algorithms=recipe,
                          eval_dataloader=ArrayLoader((x, y), 32, shuffle=False), eval_interval="8ba",
                          progress_bar=False)
        trainer.fit()
    losses = jax.device_get(trainer.state.loss)
    assert np.isfinite(losses)
    # Selective backprop switches on halfway: two train plans, plus one eval step.
    assert trainer.compile_count == 3
    assert "EMA" in trainer.state.algorithm_state
    before_forward = [t.name for t in trainer.engine.trace_log if t.event == Event.BEFORE_FORWARD and t.batch == 6]
    assert before_forward[0] == "SelectiveBackprop"  # run_first, although listed last
    assert set(before_forward) == {"SelectiveBackprop", "CutOut"}
    traced_keys = {t.key for t in trainer.engine.trace_log if t.traced}
    assert {"LabelSmoothing/BEFORE_LOSS", "SAM/AFTER_BACKWARD", "EMA/AFTER_OPTIMIZER_STEP"} <= traced_keys
    assert 0.0 <= trainer.state.metrics["eval"]["MulticlassAccuracy"] <= 1.0


def test_two_loss_interpolations_warn():
    x, y = images(32)
    trainer = Trainer(ComposerClassifier(SmallResNet(num_classes=2, width=4, rngs=nnx.Rngs(0)), 2),
                      ArrayLoader((x, y), 16), "1ba", optax.sgd(0.1),
                      algorithms=[MixUp(0.2, interpolate_loss=True), CutMix(1.0, interpolate_loss=True)],
                      progress_bar=False)
    with pytest.warns(UserWarning, match="MixUp, CutMix"):
        trainer.fit()


def test_language_model_recipe_trains_and_orders_low_precision_layernorm_last():
    x, y = byte_windows(load_pydoc_bytes()[:20_000], 32)
    recipe = [
        LowPrecisionLayerNorm(),  # converts in an amp_bf16 run, as Composer's
        Alibi(max_sequence_length=64, train_sequence_length_scaling=1.0),
        GatedLinearUnits(),
        SeqLengthWarmup(duration=0.5, min_seq_length=8, max_seq_length=32, step_size=8),
        GradientClipping("norm", 1.0),
        EMA(half_life="4ba"),
    ]
    model = TinyGPT(dim=32, depth=1, num_heads=2, max_length=32, rngs=nnx.Rngs(0))
    trainer = Trainer(ComposerClassifier(model, 256), ArrayLoader((x, y), 16, seed=0), "8ba", optax.adam(3e-3),
                      algorithms=recipe, progress_bar=False, precision="amp_bf16")
    init_order = [t.name for t in trainer.engine.trace_log if t.event == Event.INIT]
    assert init_order[-1] == "LowPrecisionLayerNorm"
    assert "position" not in trainer.state.train_state.params["module"] or not jax.tree.leaves(
        trainer.state.train_state.params["module"]["position"])
    trainer.fit()
    assert np.isfinite(float(trainer.state.loss))
    # sequence lengths 8, 16, 24 during warmup then 32: one compile per length
    assert trainer.compile_count == 4
