"""The built-in algorithms on the language models: what each does to ``llama('llama-tiny')`` (and GPT-2) in a Trainer.

Each case is a short run (1-4 batches of 4 x 16 tokens) that checks the algorithm's effect in
closed form, or that a refusal / no-op says why. The method cards' "Language models" lines are
these tests. LoRA on Llama and GPT-2 is covered in ``test_lora.py``.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Callback, Trainer
from composerjax.algorithms import (
    EMA,
    SAM,
    SWA,
    Alibi,
    AugMix,
    BlurPool,
    ChannelsLast,
    ColOut,
    CutMix,
    CutOut,
    Factorize,
    GatedLinearUnits,
    GhostBatchNorm,
    GradientClipping,
    GyroDropout,
    LabelSmoothing,
    LayerFreezing,
    LowPrecisionLayerNorm,
    MixUp,
    ProgressiveResizing,
    RandAugment,
    SelectiveBackprop,
    SeqLengthWarmup,
    SqueezeExcite,
    StochasticDepth,
    WeightStandardization,
)
from composerjax.algorithms.alibi import apply_alibi
from composerjax.algorithms.factorize import FactorizedLinear
from composerjax.algorithms.gated_linear_units import GLUFeedForward
from composerjax.algorithms.layer_freezing import NEVER, frozen_from_steps, layer_indices
from composerjax.algorithms.low_precision_layernorm import LPLayerNorm
from composerjax.algorithms.stochastic_depth import StochasticBlock
from composerjax.explain import explain
from composerjax.models.factories import gpt2, llama
from composerjax.models.llama import LlamaMLP, RMSNorm

VOCAB, LENGTH, BATCH = 64, 16, 4


def tiny(**overrides):
    return llama("llama-tiny", vocab_size=VOCAB, max_position_embeddings=32, **overrides)


def tiny_gpt2(**overrides):
    return gpt2("gpt2-tiny", vocab_size=VOCAB, n_positions=32, **overrides)


FAMILIES = {"llama": tiny, "gpt2": tiny_gpt2}
family = pytest.mark.parametrize("family", FAMILIES)


def loader(batches: int = 4) -> ArrayLoader:
    data = np.random.default_rng(0).integers(0, VOCAB, (BATCH * batches, LENGTH + 1)).astype(np.int32)
    return ArrayLoader((data[:, :-1], data[:, 1:]), BATCH, shuffle=False)


def trainer(algorithms: list, duration: str = "2ba", optimizer=None, callbacks: list = (), model=None,
            **kwargs) -> Trainer:
    return Trainer(model or tiny(), loader(), duration, optimizer or optax.sgd(0.5), algorithms=algorithms,
                   callbacks=list(callbacks), progress_bar=False, run_summary=False, **kwargs)


class ParamsAfterEachBatch(Callback):
    def __init__(self) -> None:
        self.history: list = []

    def batch_end(self, state, logger):
        self.history.append(jax.device_get(state.params))


class SeenLengths(Callback):
    """The sequence length of each training batch after the algorithms (callbacks run after them)."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def after_dataloader(self, state, logger):
        self.lengths.append(int(state.batch[0].shape[1]))


def leaves(tree) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


# --- algorithms that act on Llama ------------------------------------------------------------------------


@family
def test_seq_length_warmup_cuts_the_batches_by_the_schedule(family):
    seen = SeenLengths()
    run = trainer([SeqLengthWarmup(duration=0.5, min_seq_length=8, max_seq_length=LENGTH, step_size=8)], "4ba",
                  callbacks=[seen], model=FAMILIES[family]())
    run.fit()
    assert seen.lengths == [8, 8, 16, 16]  # progress 0, 1/4 -> 8 tokens; from 1/2 on -> all 16
    assert run.compile_count == 2


@family
def test_ema_is_the_closed_form_average_of_the_last_two_steps(family):
    record = ParamsAfterEachBatch()
    ema = EMA(half_life="1ba")  # smoothing 0.5: the first update copies, the second averages
    run = trainer([ema], "2ba", callbacks=[record], model=FAMILIES[family]())
    run.fit()
    averaged, first, second = (leaves(tree) for tree in (ema.ema_params(run.state), *record.history))
    assert averaged.keys() == second.keys()
    for name, value in averaged.items():
        np.testing.assert_allclose(value, 0.5 * first[name] + 0.5 * second[name], rtol=1e-6, atol=1e-7)
    assert any(not np.array_equal(averaged[name], second[name]) for name in averaged)


@family
def test_gradient_clipping_bounds_the_update_to_the_threshold(family):
    before = leaves(nnx.to_pure_dict(nnx.state(FAMILIES[family](), nnx.Param)))
    run = trainer([GradientClipping("norm", 1e-3)], "1ba", optimizer=optax.sgd(1.0), model=FAMILIES[family]())
    run.fit()
    after = leaves(jax.device_get(run.state.params))
    assert before.keys() == after.keys()
    # The raw gradient's norm is far above 1e-3, so plain SGD with lr 1 moves the weights by exactly 1e-3.
    norm = np.sqrt(sum(np.sum((after[k].astype(np.float64) - before[k]) ** 2) for k in after))
    assert norm == pytest.approx(1e-3, rel=1e-4)


@family
def test_sam_descends_with_the_gradient_at_the_perturbed_weights(family):
    model = FAMILIES[family]()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    inputs, targets = next(iter(loader()))

    def loss(p):
        merged = nnx.merge(graphdef, p, rest)
        return merged.loss(merged.forward((inputs, targets)), (inputs, targets))

    grads = jax.grad(loss)(params)
    norm = optax.tree.norm(grads)
    perturbed = jax.tree.map(lambda w, g: w + 0.05 * g / (norm + 1e-12), params, grads)
    expected = jax.tree.map(lambda w, g: w - 0.5 * g, params, jax.grad(loss)(perturbed))
    run = trainer([SAM(rho=0.05)], "1ba", model=FAMILIES[family]())
    run.fit()
    got, want = leaves(jax.device_get(run.state.params)), leaves(nnx.to_pure_dict(expected))
    assert got.keys() == want.keys()
    for name in got:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


class Snapshots(Callback):
    """``trained[t - 1]``: the weights the optimizer produced at batch t (before SWA swaps in its average)."""

    def __init__(self) -> None:
        self.trained: list = []

    def after_optimizer_step(self, state, logger):  # traced: hand the updated weights out as step metrics
        state.step_metrics["params"] = state.params

    def batch_end(self, state, logger):
        self.trained.append(jax.device_get(state.step_metrics["params"]))


@family
def test_swa_replaces_the_weights_by_the_mean_over_its_window(family):
    snapshots = Snapshots()
    run = trainer([SWA(swa_start="0.5dur", swa_end="1.0dur", update_interval="1ba")], "4ba", callbacks=[snapshots],
                  model=FAMILIES[family]())
    run.fit()
    trained = [leaves(params) for params in snapshots.trained]
    final = leaves(jax.device_get(run.state.params))
    for name, value in final.items():  # the window holds batches 2, 3 and 4
        np.testing.assert_allclose(value, np.mean([trained[t - 1][name] for t in (2, 3, 4)], axis=0),
                                   rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(final[name], trained[3][name]) for name in final)


@pytest.mark.parametrize("family, layers", [
    ("llama", 20),  # embedding, 2 blocks x (2 RMSNorms, q/k/v/o, gate/up/down), the final norm
    ("gpt2", 15),  # token and position embeddings, 2 blocks x (2 LayerNorms, qkv, proj, up, down), the final norm
])
def test_layer_freezing_keeps_layers_fixed_from_their_freeze_step(family, layers):
    record = ParamsAfterEachBatch()
    run = trainer([LayerFreezing(freeze_start=0.0, freeze_level=1.0)], "4ba", callbacks=[record],
                  model=FAMILIES[family]())
    indices, count = layer_indices(run.state.model)
    assert count == layers
    firsts = leaves(frozen_from_steps(indices, count, 4, freeze_start=0.0, freeze_level=1.0))
    run.fit()
    history = [leaves(params) for params in record.history]  # after steps 0, 1, 2, 3
    assert firsts["['module']['tokens']['embedding']"] == 1 and firsts["['module']['norm']['scale']"] == NEVER
    for name, first in firsts.items():
        for step in (1, 2, 3):
            same = np.array_equal(history[step][name], history[step - 1][name])
            assert same == (step >= first), f"{name} at step {step} (frozen from step {first})"


@pytest.mark.parametrize("family, names", [
    # hidden 64: q / o (64 -> 64), gate / up (64 -> 128), down (128 -> 64); k / v (64 -> 32) are too narrow
    ("llama", ("attention/o_proj", "attention/q_proj", "mlp/down_proj", "mlp/gate_proj", "mlp/up_proj")),
    ("gpt2", ("attention/proj", "attention/qkv", "mlp/down", "mlp/up")),
])
def test_factorize_replaces_the_large_projections_and_trains(family, names):
    run = trainer([Factorize(min_features=64, latent_features=16)], "2ba", model=FAMILIES[family]())
    module = run.state.model.module
    factorized = sorted("/".join(map(str, path)) for path, m in nnx.iter_modules(module)
                        if isinstance(m, FactorizedLinear))
    assert factorized == [f"blocks/{i}/{name}" for i in (0, 1) for name in names]
    run.fit()
    assert np.isfinite(float(run.state.loss))


# --- algorithms refused on Llama, with the reason --------------------------------------------------------


def test_alibi_is_refused_on_llama_naming_rotary_positions():
    with pytest.raises(ValueError, match=r"Alibi failed at INIT: .*'module/blocks/0/attention' is Llama-class "
                                         r"\(LlamaAttention\).*rotary embeddings \(RoPE\)"):
        trainer([Alibi()])
    scanned = tiny(scan_layers=True).module
    with pytest.raises(ValueError, match=r"'blocks/attention' is Llama-class"):
        apply_alibi(scanned)


@pytest.mark.parametrize("algorithm, message", [
    (MixUp(), r"MixUp: the inputs are integer sequences \(int32 of shape \(4, 16\)\) with a target per position"),
    (LabelSmoothing(0.1), r"LabelSmoothing failed at BEFORE_LOSS: state.outputs is LMOutputs .*never holds the "
                          r"whole batch's logits.*ComposerClassifier\(module, vocab_size, "
                          r"val_metrics=language_metrics\(\)\)"),
    (SelectiveBackprop(start=0.0, end=1.0, interrupt=0), r"SelectiveBackprop failed at BEFORE_FORWARD: .*LMOutputs "
                                                         r".*ComposerClassifier\(module, vocab_size, "),
    (CutMix(), r"CutMix failed at BEFORE_FORWARD: .*expected images \(N, H, W\) or \(N, H, W, C\)"),
    (ProgressiveResizing(), r"ProgressiveResizing failed at AFTER_DATALOADER: .*expected images of shape"),
    (AugMix(), r"AugMix failed at BEFORE_FORWARD: .*expected \(N, H, W\) or \(N, H, W, C\)"),
    (ColOut(), r"ColOut failed at BEFORE_FORWARD: .*expected images \(N, H, W\) or \(N, H, W, C\)"),
    (CutOut(), r"CutOut failed at BEFORE_FORWARD: .*expected images \(N, H, W\) or \(N, H, W, C\)"),
    (RandAugment(), r"RandAugment failed at BEFORE_FORWARD: .*expected \(N, H, W\) or \(N, H, W, C\)"),
], ids=["mixup", "label_smoothing", "selective_backprop", "cutmix", "progressive_resizing", "augmix", "colout",
        "cutout", "randaugment"])
@family
def test_logit_and_image_algorithms_are_refused_saying_why(algorithm, message, family):
    with pytest.raises(Exception, match=message):
        trainer([algorithm], "1ba", model=FAMILIES[family]()).fit()


# --- algorithms that find nothing to change in Llama: a warning says so ----------------------------------


@pytest.mark.parametrize("algorithm, kwargs, message", [
    (GatedLinearUnits(), {}, "the model's MLPs are Llama-class (LlamaMLP), already gated linear units (SwiGLU"),
    (LowPrecisionLayerNorm(), {"precision": "amp_bf16"}, "LowPrecisionLayerNorm had no effect: the model has no "
                                                         "nnx.LayerNorm"),
    (StochasticDepth("DecoderBlock"), {}, "StochasticDepth replaced no modules: the model has no DecoderBlock (its "
                                          "blocks, LlamaBlock, are not supported: they take positions and a KV cache"),
    (GyroDropout(), {}, "GyroDropout replaced no modules: the model has no nnx.Dropout"),
    (BlurPool(), {}, "BlurPool replaced no modules: the model has no strided 2-D nnx.Conv"),
    (SqueezeExcite(), {}, "SqueezeExcite added no blocks: the model has no nnx.Conv"),
    (WeightStandardization(), {}, "WeightStandardization changed no modules: the model has no nnx.Conv"),
    (GhostBatchNorm(), {}, "GhostBatchNorm replaced no modules: the model has no nnx.BatchNorm"),
    (ChannelsLast(), {}, "ChannelsLast has no effect in composerjax"),
], ids=["gated_linear_units", "low_precision_layernorm", "stochastic_depth", "gyro_dropout", "blurpool",
        "squeeze_excite", "weight_standardization", "ghost_batchnorm", "channels_last"])
def test_no_op_algorithms_warn_and_leave_llama_unchanged(algorithm, kwargs, message):
    reference = nnx.to_pure_dict(nnx.state(tiny().module))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = trainer([algorithm], "1ba", **kwargs)
    assert any(message in str(warning.message) for warning in caught), [str(w.message) for w in caught]
    module = run.state.model.module
    assert sum(isinstance(m, LlamaMLP) for _, m in nnx.iter_modules(module)) == 2
    assert sum(isinstance(m, RMSNorm) for _, m in nnx.iter_modules(module)) == 5
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), reference, nnx.to_pure_dict(nnx.state(module)))
    assert all(jax.tree.leaves(same))
    run.fit()
    assert np.isfinite(float(run.state.loss))


# --- the surgeries Llama refuses or has no target for act on GPT-2 ---------------------------------------


@pytest.mark.parametrize("algorithm, kwargs", [
    (Alibi(max_sequence_length=64), {}), (GatedLinearUnits(), {}), (LowPrecisionLayerNorm(), {"precision": "amp_bf16"}),
], ids=["alibi", "gated_linear_units", "low_precision_layernorm"])
def test_the_surgeries_llama_does_not_take_apply_to_gpt2(algorithm, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "had no effect" warning
        run = trainer([algorithm], "1ba", model=tiny_gpt2(), **kwargs)
    module = run.state.model.module
    if isinstance(algorithm, Alibi):
        assert module.config.position == "alibi" and module.config.n_positions == 64
        assert not hasattr(module, "position")  # the learned table is gone
    elif isinstance(algorithm, GatedLinearUnits):
        assert sum(isinstance(m, GLUFeedForward) for _, m in nnx.iter_modules(module)) == 2
    else:
        assert sum(isinstance(m, LPLayerNorm) for _, m in nnx.iter_modules(module)) == 5
    run.fit()
    assert np.isfinite(float(run.state.loss))


def test_explain_reports_what_llama_has_no_target_for_and_stops_at_alibi():
    recipe = {"run_name": "llama-algorithms", "model": {"name": "llama", "config": "llama-tiny", "vocab_size": 256},
              "data": {"name": "pydoc_text", "seq_len": 16, "batch_size": 4}, "optimizer": {"name": "sgd", "lr": 0.1},
              "max_duration": "1ba", "algorithms": [{"gated_linear_units": {}}, {"low_precision_layernorm": {}}]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conflicts = explain(recipe).conflicts
    assert conflicts == [
        f"{name} acts on {kind} modules, and the model (ComposerCausalLM) has none: it will change nothing"
        for name, kind in (("GatedLinearUnits", "FeedForward"), ("LowPrecisionLayerNorm", "nnx.LayerNorm"))]
    with pytest.raises(ValueError, match=r"Llama-class \(LlamaAttention\).*\(RoPE\)"):
        explain({**recipe, "algorithms": [{"alibi": {}}]})


def test_stochastic_depth_names_the_gpt2_blocks_it_cannot_wrap():
    with pytest.warns(UserWarning, match=r"the model has no DecoderBlock \(its blocks, GPT2Block, are not supported"):
        run = trainer([StochasticDepth("DecoderBlock")], "1ba", model=tiny_gpt2())
    assert sum(isinstance(m, StochasticBlock) for _, m in nnx.iter_modules(run.state.model)) == 0
