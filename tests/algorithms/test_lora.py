"""LoRA: wrapped linears start as the base, only adapters train, merge / PEFT export, exact resume, composition."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Trainer, registry
from composerjax.algorithms import EMA, GradientClipping, LoRA, apply_lora, merge_lora, save_lora_adapter
from composerjax.algorithms.lora import FrozenWeight, LoRALinear, lora_parameter_count
from composerjax.models import ComposerCausalLM
from composerjax.models.gpt2 import GPT2, GPT2Config
from composerjax.models.llama import Llama, LlamaConfig

HERE = Path(__file__).parent
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(**overrides) -> Llama:
    config = LlamaConfig.preset("llama-tiny", **{"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
                                                 "num_hidden_layers": 2, "max_position_embeddings": 16, **overrides})
    return Llama(config, rngs=nnx.Rngs(0))


def tiny_gpt2(**overrides) -> GPT2:
    config = GPT2Config.preset("gpt2-tiny", **{"vocab_size": 96, "n_positions": 16, "n_embd": 32, "n_layer": 2,
                                               "n_head": 2, **overrides})
    return GPT2(config, rngs=nnx.Rngs(0))


def tokens(shape=(2, 16), seed=0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 0, 96)


def loader(batches=4, seed=1) -> ArrayLoader:
    data = np.random.default_rng(0).integers(0, 96, (8 * batches, 17)).astype(np.int32)
    return ArrayLoader((data[:, :-1], data[:, 1:]), 8, seed=seed)


def leaves_by_path(tree) -> dict[str, jax.Array]:
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def randomize_adapters(model: nnx.Module, seed: int = 3) -> None:
    for index, (_, module) in enumerate(nnx.iter_modules(model)):
        if isinstance(module, LoRALinear):
            module.lora_b[...] = 0.2 * jax.random.normal(jax.random.key(seed + index), module.lora_b.shape)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_wrapped_gpt2_starts_equal_and_holds_exactly_the_adapter_count(scan_layers):
    model = tiny_gpt2(scan_layers=scan_layers)
    x = tokens()
    base = model(x)
    wrapped = apply_lora(model, rank=4, alpha=16, target_modules=("qkv", "proj"), rngs=nnx.Rngs(1))
    per_layer = ["attention/proj", "attention/qkv"]
    assert wrapped == ([f"blocks/{i}/{name}" for i in range(2) for name in per_layer] if not scan_layers
                       else [f"blocks/{name}" for name in per_layer])
    np.testing.assert_array_equal(model(x), base)  # B = 0: exactly the base model
    # rank * (in + out) per wrapped linear: qkv 32 -> 96, proj 32 -> 32, two layers
    assert lora_parameter_count(model) == 2 * (4 * (32 + 96) + 4 * (32 + 32)) == 1536
    params = nnx.state(model, nnx.Param)
    assert sum(leaf.size for leaf in jax.tree.leaves(params)) == 1536  # nothing else is a parameter
    assert jax.tree.leaves(nnx.state(model, FrozenWeight))  # the base weights are still there, frozen


def test_a_is_kaiming_uniform_as_peft_draws_it_and_b_is_zero():
    lora = LoRALinear.from_linear(nnx.Linear(400, 8, rngs=nnx.Rngs(0)), rank=64, alpha=16, rngs=nnx.Rngs(1))
    a = np.asarray(lora.lora_a[...])
    bound = 1 / np.sqrt(400)
    assert a.shape == (400, 64) and np.abs(a).max() <= bound and np.abs(a).max() > 0.98 * bound
    assert abs(a.std() - bound / np.sqrt(3)) < 0.02 * bound  # uniform(-b, b) has std b / sqrt(3)
    np.testing.assert_array_equal(lora.lora_b[...], np.zeros((64, 8)))
    assert lora.scale == 16 / 64


def test_forward_is_base_plus_scaled_low_rank_update():
    linear = nnx.Linear(6, 5, rngs=nnx.Rngs(0))
    kernel, bias = np.asarray(linear.kernel[...]), np.asarray(linear.bias[...])
    lora = LoRALinear.from_linear(linear, rank=2, alpha=3, rngs=nnx.Rngs(1))
    lora.lora_b[...] = jnp.arange(10, dtype=jnp.float32).reshape(2, 5) / 10
    x = jax.random.normal(jax.random.key(2), (4, 6))
    a, b = np.asarray(lora.lora_a[...]), np.asarray(lora.lora_b[...])
    expected = x @ kernel + bias + (x @ a @ b) * 1.5
    np.testing.assert_allclose(lora(x), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lora.kernel, kernel + a @ b * 1.5, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_merged_model_has_the_plain_structure_and_the_wrapped_logits(family):
    model = tiny_llama() if family == "llama" else tiny_gpt2()
    apply_lora(model, rank=4, target_modules=LLAMA_TARGETS if family == "llama" else ("qkv", "proj", "up", "down"),
               rngs=nnx.Rngs(1))
    randomize_adapters(model)
    x = tokens()
    wrapped_logits = np.asarray(model(x))
    merged = merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for _, m in nnx.iter_modules(merged))
    assert not jax.tree.leaves(nnx.state(merged, FrozenWeight))  # every weight is an nnx.Param again
    fresh = tiny_llama() if family == "llama" else tiny_gpt2()
    assert jax.tree.structure(nnx.state(merged, nnx.Param)) == jax.tree.structure(nnx.state(fresh, nnx.Param))
    np.testing.assert_allclose(merged(x), wrapped_logits, rtol=0, atol=2e-5)


def test_trainer_trains_only_the_adapters_and_the_optimizer_state_holds_only_them():
    model = ComposerCausalLM(tiny_llama())
    before = {path: np.asarray(leaf) for path, leaf in leaves_by_path(nnx.state(model.module)).items()}
    trainer = Trainer(model, loader(), "4ba", optax.adamw(1e-2), progress_bar=False, run_summary=False,
                      algorithms=[LoRA(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))])
    params = trainer.state.train_state.params
    names = {path.split("]")[-2].strip("['") for path in leaves_by_path(params)}
    assert names == {"lora_a", "lora_b"}
    # q_proj 32 -> 32, v_proj 32 -> 16 (two key/value heads of 8), rank 4, two layers
    assert sum(leaf.size for leaf in jax.tree.leaves(params)) == 2 * (4 * (32 + 32) + 4 * (32 + 16)) == 896
    adam = trainer.state.train_state.opt_state[0]
    for moment in (adam.mu, adam.nu):
        assert leaves_by_path(moment).keys() == leaves_by_path(params).keys()
    trainer.fit()
    module = trainer.state.model.module
    after = leaves_by_path(nnx.state(module, FrozenWeight))
    assert len(after) == len(before)  # every original weight is frozen
    for path, value in after.items():
        np.testing.assert_array_equal(value, before[path.replace("['base_layer']", "")])
    assert float(jnp.abs(module.blocks[0].attention.q_proj.lora_b[...]).max()) > 0  # the adapters moved


def test_lora_composes_with_gradient_clipping_and_ema():
    trainer = Trainer(ComposerCausalLM(tiny_llama()), loader(), "4ba", optax.adamw(1e-2), progress_bar=False,
                      run_summary=False,
                      algorithms=[LoRA(rank=4, target_modules=("q_proj", "v_proj")),
                                  GradientClipping("norm", 0.5), EMA(half_life="2ba")])
    trainer.fit()
    names = {trace.name for trace in trainer.engine.trace_log}
    assert {"LoRA", "GradientClipping", "EMA"} <= names
    ema_state = trainer.state.algorithm_state["EMA"]
    # EMA's averaged weights are the adapters (the frozen weights are among its buffers, as Composer's)
    assert leaves_by_path(ema_state["params"]).keys() == leaves_by_path(trainer.state.train_state.params).keys()
    assert np.isfinite(float(trainer.state.loss))


def test_resume_in_a_fresh_process_is_bit_identical(tmp_path):
    script = str(HERE / "lora_resume_script.py")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    straight = subprocess.run([sys.executable, script, str(tmp_path / "straight"), "--max-duration", "8ba"],
                              env=env, capture_output=True, text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-2000:]
    first = subprocess.run([sys.executable, script, str(tmp_path / "first"), "--max-duration", "4ba",
                            "--save-folder", str(tmp_path / "checkpoints")], env=env, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert (tmp_path / "checkpoints" / "ep1-ba4").is_dir()
    resumed = subprocess.run([sys.executable, script, str(tmp_path / "resumed"), "--max-duration", "8ba",
                              "--load-path", str(tmp_path / "checkpoints" / "ep1-ba4")], env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    expected, got = np.load(tmp_path / "straight" / "final.npz"), np.load(tmp_path / "resumed" / "final.npz")
    halfway = np.load(tmp_path / "first" / "final.npz")
    assert sorted(expected.files) == sorted(got.files)
    assert any(name.startswith("params") and "lora_b" in name for name in expected.files)
    for name in expected.files:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    moved = [name for name in expected.files if name.startswith("params")
             and not np.array_equal(halfway[name], expected[name])]
    assert moved  # the second half did train


def test_save_lora_adapter_loads_in_peft_with_our_logits(tmp_path):
    import torch
    import transformers
    from peft import PeftModel

    from composerjax.models import save_pretrained

    model = tiny_llama(num_key_value_heads=2)
    base = nnx.clone(model)
    apply_lora(model, rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"), rngs=nnx.Rngs(1))
    randomize_adapters(model)
    save_pretrained(base, tmp_path / "base")
    files = save_lora_adapter(model, tmp_path / "adapter")
    assert [Path(f).name for f in files] == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    from safetensors.numpy import load_file

    weights = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert weights["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"].shape == (4, 32)
    assert weights["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (16, 4)
    assert len(weights) == 2 * 3 * 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    x = tokens()
    with torch.no_grad():
        theirs = peft_model(torch.tensor(np.asarray(x))).logits.numpy()
    np.testing.assert_allclose(theirs, model(x), rtol=0, atol=1e-4)


def test_merged_export_loads_in_transformers_with_the_wrapped_logits(tmp_path):
    import torch
    import transformers

    from composerjax.models import save_pretrained

    trainer = Trainer(ComposerCausalLM(tiny_llama()), loader(), "3ba", optax.adamw(1e-2), progress_bar=False,
                      run_summary=False, algorithms=[LoRA(rank=4, target_modules=LLAMA_TARGETS)])
    trainer.fit()
    module = trainer.state.model.module
    x = tokens()
    wrapped = np.asarray(module(x))
    save_pretrained(trainer.state.model, tmp_path / "merged")  # merges by default, from a copy
    assert sum(isinstance(m, LoRALinear) for _, m in nnx.iter_modules(module)) == 14  # the model keeps them
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(np.asarray(x))).logits.numpy()
    np.testing.assert_allclose(theirs, wrapped, rtol=0, atol=1e-4)
    save_pretrained(merge_lora(nnx.clone(module)), tmp_path / "merged-by-hand")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "merged-by-hand" / name).read_bytes()
    # merge=False: the PEFT adapter folder, as save_lora_adapter writes it.
    files = save_pretrained(trainer.state.model, tmp_path / "adapter", merge=False)
    assert [Path(f).name for f in files] == ["adapter_config.json", "adapter_model.safetensors"]
    save_lora_adapter(module, tmp_path / "adapter-by-hand")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "adapter" / name).read_bytes() == (tmp_path / "adapter-by-hand" / name).read_bytes()
    with pytest.raises(ValueError, match=r"merge='no': expected True .* or False"):
        save_pretrained(module, tmp_path / "x", merge="no")
    with pytest.raises(ValueError):
        save_pretrained(tiny_llama(), tmp_path / "y", merge=False)  # no adapters to write


def test_explain_names_lora_and_the_wrapped_modules():
    from composerjax.explain import explain

    trainer = Trainer(ComposerCausalLM(tiny_llama()), loader(), "2ba", optax.adamw(1e-2), progress_bar=False,
                      run_summary=False, algorithms=[LoRA(rank=4, target_modules=("q_proj",))])
    text = explain(trainer).render()
    init = text.split("INIT (host)")[1].split("\n\n")[0]
    assert "1. LoRA" in init
    assert ("LoRA: wraps 2 Linear layers (rank 4, alpha 16): module/blocks/0/attention/q_proj, "
            "module/blocks/1/attention/q_proj") in init


def test_lora_is_registered_under_lora():
    assert registry.resolve("algorithms", "lora") is LoRA


@pytest.mark.parametrize("argument, value, accepted", [
    ("rank", 0, "positive integer"), ("rank", 2.0, "positive integer"), ("rank", True, "positive integer"),
    ("alpha", 0, "positive number"), ("alpha", "16", "positive number"),
    ("dropout", 1.0, r"\[0, 1\)"), ("dropout", -0.1, r"\[0, 1\)"),
    ("target_modules", "q_proj", "list of module names"), ("target_modules", (), "list of module names"),
    ("target_modules", ("q_proj", ""), "list of module names"),
])
def test_bad_hyperparameters_name_the_field_the_value_and_what_is_accepted(argument, value, accepted):
    with pytest.raises(ValueError, match=accepted) as error:
        LoRA(**{argument: value})
    assert f"{argument}={value!r}" in str(error.value)


def test_a_target_that_matches_nothing_is_refused_at_init_naming_the_names_that_exist():
    with pytest.raises(Exception) as error:
        Trainer(ComposerCausalLM(tiny_gpt2()), loader(), "1ba", optax.adamw(1e-2), progress_bar=False,
                run_summary=False, algorithms=[LoRA(target_modules=("q_proj", "qkv"))])
    message = str(error.value)
    assert "'q_proj' matches no Linear layer" in message
    assert "named down, proj, qkv, up" in message


def test_default_targets_follow_peft_per_family():
    llama, gpt2 = tiny_llama(), tiny_gpt2()
    assert apply_lora(llama) == [f"blocks/{i}/attention/{n}" for i in range(2) for n in ("q_proj", "v_proj")]
    assert apply_lora(gpt2) == ["blocks/0/attention/qkv", "blocks/1/attention/qkv"]


def test_dropout_is_refused_where_its_stream_would_not_advance():
    with pytest.raises(ValueError, match=r"dropout=0.1.*scan"):
        apply_lora(tiny_llama(scan_layers=True), dropout=0.1)
    model = tiny_llama()
    apply_lora(model, target_modules=("q_proj",), dropout=0.5, rngs=nnx.Rngs(1))
    randomize_adapters(model)
    x = tokens()
    model.eval()
    evaluated = np.asarray(model(x))
    np.testing.assert_array_equal(model(x), evaluated)  # eval: no dropout
    model.train()
    assert not np.allclose(model(x), evaluated)  # train: the adapter's input is dropped


FSDP_SCRIPT = """
import json, sys
import jax, numpy as np, optax
from flax import nnx
sys.path.insert(0, {folder!r})
from test_lora import LLAMA_TARGETS, loader, tiny_llama
from composerjax import Trainer
from composerjax.algorithms import LoRA
from composerjax.models import ComposerCausalLM

results = {{"devices": jax.device_count()}}
for parallelism in ("ddp", "fsdp"):
    trainer = Trainer(ComposerCausalLM(tiny_llama()), loader(), "3ba", optax.adamw(1e-2), progress_bar=False,
                      run_summary=False, parallelism=parallelism,
                      algorithms=[LoRA(rank=4, alpha=8, target_modules=LLAMA_TARGETS)])
    trainer.fit()
    rest = trainer.state.train_state.rest
    frozen = {{jax.tree_util.keystr(p): (list(leaf.shape),
                                        sorted({{tuple(s.data.shape) for s in leaf.addressable_shards}}))
              for p, leaf in jax.tree_util.tree_flatten_with_path(rest)[0]
              if getattr(leaf, "ndim", 0) >= 2 and np.issubdtype(leaf.dtype, np.floating)}}
    params = {{jax.tree_util.keystr(p): np.asarray(leaf).tolist()
              for p, leaf in jax.tree_util.tree_flatten_with_path(trainer.state.train_state.params)[0]}}
    results[parallelism] = {{"frozen": frozen, "params": params}}
    trainer.close()
print(json.dumps(results))
"""


def test_under_fsdp_the_frozen_weights_are_sharded_and_training_is_unchanged():
    # LoRA's frozen base is most of a fine-tuned model: under FSDP no device holds a whole frozen matrix.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    script = FSDP_SCRIPT.format(folder=str(HERE))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["devices"] == 4
    frozen = results["fsdp"]["frozen"]
    assert any("embed" in path for path in frozen) and any("base_layer" in path for path in frozen)
    for path, (shape, shard_shapes) in frozen.items():
        assert len(shard_shapes) == 1 and np.prod(shard_shapes[0]) * 4 == np.prod(shape), (path, shape, shard_shapes)
    for path, (shape, shard_shapes) in results["ddp"]["frozen"].items():
        assert shard_shapes == [shape], path  # ddp replicates
    for path, value in results["fsdp"]["params"].items():
        np.testing.assert_allclose(value, results["ddp"]["params"][path], rtol=1e-5, atol=1e-6, err_msg=path)
