"""Hugging Face checkpoints both ways: logits equal to transformers' (float32, max abs diff <= 1e-4), sharded
files, FSDP loading on 4 simulated devices, and refusals (hub ids, unsupported fields, changed structure)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx

from composerjax import ArrayLoader, Trainer
from composerjax.models import GPT2, ComposerCausalLM, Llama, hf_parameter_names, load_pretrained, save_pretrained
from composerjax.models.gpt2 import GPT2Config
from composerjax.models.llama import LlamaConfig

VOCAB = 99  # not a multiple of 64: our models pad it to 128 rows
TOLERANCE = 1e-4
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
SHAPE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4),
    "gpt2-untied": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                                   tie_word_embeddings=False),
    "llama3-untied": lambda: transformers.LlamaConfig(**SHAPE, rope_theta=500.0, rope_scaling=LLAMA3,
                                                      tie_word_embeddings=False),
    "llama-tied": lambda: transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=4),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True),
}


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every weight random (norm scales around 1, biases non-zero), so each mapping is exercised."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator) * 0.1
            parameter.copy_(1.0 + noise if "norm" in name or ".ln_" in name else noise * 2)
    return model.eval()


def hf_model(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return randomized(transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()), seed)


def hf_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def sample_tokens(seed: int = 0, shape: tuple[int, int] = (2, 16)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, shape)


def assert_same_logits(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.shape == theirs.shape
    assert np.abs(np.asarray(ours) - theirs).max() <= TOLERANCE


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_load_then_save_gives_transformers_logits_both_ways(kind, tmp_path):
    reference = hf_model(kind)
    reference.save_pretrained(tmp_path / "hf")
    tokens = sample_tokens()
    expected = hf_logits(reference, tokens)

    model = load_pretrained(tmp_path / "hf")
    assert isinstance(model, GPT2 if kind.startswith("gpt2") else Llama)
    assert model.tokens.embedding.shape[0] == 128  # padded; the padding never reaches the logits
    assert_same_logits(model(jnp.asarray(tokens)), expected)  # eval mode: GPT-2's dropout (0.1) is off

    save_pretrained(model, tmp_path / "ours")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(reloaded) is type(reference)
    assert_same_logits(hf_logits(reloaded, tokens), expected)


def test_the_llama3_scaling_and_the_sliding_window_matter_in_the_reference(tmp_path):
    # Without them transformers' logits move well beyond the tolerance: the equality above checks them.
    tokens = sample_tokens(shape=(1, 32))
    plain_configs = {"llama3-untied": transformers.LlamaConfig(**SHAPE, rope_theta=500.0, tie_word_embeddings=False),
                     "mistral": transformers.MistralConfig(**SHAPE, sliding_window=None)}
    for kind, plain_config in plain_configs.items():
        reference = hf_model(kind)
        plain = transformers.AutoModelForCausalLM.from_config(plain_config).eval()
        plain.load_state_dict(reference.state_dict())
        assert np.abs(hf_logits(plain, tokens) - hf_logits(reference, tokens)).max() > 100 * TOLERANCE
        reference.save_pretrained(tmp_path / kind)
        assert_same_logits(load_pretrained(tmp_path / kind)(jnp.asarray(tokens)), hf_logits(reference, tokens))


def test_sharded_safetensors_with_an_index_load_and_save(tmp_path):
    reference = hf_model("llama3-untied")
    reference.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    tokens = sample_tokens(1)
    model = load_pretrained(tmp_path / "hf")
    assert_same_logits(model(jnp.asarray(tokens)), hf_logits(reference, tokens))

    written = save_pretrained(model, tmp_path / "ours", max_shard_size=20_000)
    shards = sorted(p for p in os.listdir(tmp_path / "ours") if p.startswith("model-"))
    assert len(shards) > 1 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == set(reference.state_dict())
    assert not (tmp_path / "ours" / "model.safetensors").exists()
    assert {os.path.basename(p) for p in written} == {"config.json", "model.safetensors.index.json", *shards}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert_same_logits(hf_logits(reloaded, tokens), hf_logits(reference, tokens))
    assert_same_logits(load_pretrained(tmp_path / "ours")(jnp.asarray(tokens)), hf_logits(reference, tokens))


@pytest.mark.parametrize("kind", ["gpt2", "llama3-untied"])
def test_scanned_layers_load_and_export_the_same_model(kind, tmp_path):
    reference = hf_model(kind)
    reference.save_pretrained(tmp_path / "hf")
    tokens = sample_tokens(2)
    model = load_pretrained(tmp_path / "hf", scan_layers=True, remat="full")
    assert model.config.scan_layers and model.config.remat == "full"
    assert_same_logits(model(jnp.asarray(tokens), deterministic=True), hf_logits(reference, tokens))
    save_pretrained(model, tmp_path / "ours")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert_same_logits(hf_logits(reloaded, tokens), hf_logits(reference, tokens))


def test_dtype_sets_the_parameters_dtype_whatever_the_checkpoint_stores(tmp_path):
    hf_model("qwen2").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(load_pretrained(tmp_path / "bf16"), nnx.Param))} == {
        jnp.dtype(jnp.float32)}
    halved = load_pretrained(tmp_path / "bf16", dtype=jnp.bfloat16)
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(halved, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    assert halved(jnp.asarray(sample_tokens())).dtype == jnp.bfloat16


def train_a_few_batches(model: ComposerCausalLM, save_folder: str | None = None) -> Trainer:
    data = np.random.default_rng(0).integers(0, VOCAB, (16, 17)).astype(np.int32)
    trainer = Trainer(model, ArrayLoader((data[:, :-1], data[:, 1:]), batch_size=4, seed=0), "3ba",
                      optax.adam(1e-2), save_folder=save_folder, save_interval="3ba", progress_bar=False,
                      run_summary=False)
    trainer.fit()
    return trainer


@pytest.mark.parametrize("kind", ["gpt2", "llama3-untied", "mistral", "qwen2"])
def test_a_model_trained_by_the_trainer_and_restored_from_its_checkpoint_exports(kind, tmp_path):
    from composerjax.cli_generate import load_model_weights

    hf_model(kind).save_pretrained(tmp_path / "hf")
    start = load_pretrained(tmp_path / "hf")
    initial = jax.tree.map(np.asarray, nnx.state(start, nnx.Param))
    trainer = train_a_few_batches(ComposerCausalLM(start), str(tmp_path / "checkpoints"))
    trained = trainer.state.model
    trainer.close()
    tokens = sample_tokens(3)
    ours = np.asarray(trained.module(jnp.asarray(tokens), deterministic=True))
    moved = [not np.allclose(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(initial),
                                                                jax.tree.leaves(nnx.state(trained.module, nnx.Param)))]
    assert all(moved)  # every tensor was trained

    save_pretrained(trained, tmp_path / "trained")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trained").eval()
    assert_same_logits(hf_logits(reloaded, tokens), ours)

    restored, batch = load_model_weights(ComposerCausalLM(load_pretrained(tmp_path / "hf")),
                                         str(tmp_path / "checkpoints"))
    assert batch == 3
    save_pretrained(restored, tmp_path / "restored")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "restored").eval()
    assert_same_logits(hf_logits(reloaded, tokens), ours)


def test_a_natively_built_llama_exports_as_each_architecture(tmp_path):
    tokens = sample_tokens(4)
    for overrides, architecture in (({}, "LlamaForCausalLM"), ({"sliding_window": 5}, "MistralForCausalLM"),
                                    ({"attention_bias": True}, "Qwen2ForCausalLM")):
        config = LlamaConfig(**SHAPE, **overrides, tie_word_embeddings=False, rope_scaling=LLAMA3)
        model = Llama(config, rngs=nnx.Rngs(0))
        save_pretrained(model, tmp_path / architecture)
        assert json.loads((tmp_path / architecture / "config.json").read_text())["architectures"] == [architecture]
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / architecture).eval()
        assert type(reloaded).__name__ == architecture
        assert_same_logits(hf_logits(reloaded, tokens), np.asarray(model(jnp.asarray(tokens))))


def test_a_recipe_names_a_pretrained_folder_as_its_model(tmp_path):
    from composerjax import registry

    reference = hf_model("mistral")
    reference.save_pretrained(tmp_path / "hf")
    model = registry.models.get("pretrained")(path=str(tmp_path / "hf"), remat="dots")
    assert isinstance(model, ComposerCausalLM) and model.module.config.remat == "dots"
    tokens = sample_tokens(7)
    assert_same_logits(model.module(jnp.asarray(tokens)), hf_logits(reference, tokens))
    halved = registry.models.get("pretrained")(path=str(tmp_path / "hf"), dtype="bfloat16")
    assert halved.module.tokens.embedding.dtype == jnp.bfloat16


def test_a_hub_id_is_refused_without_touching_the_network(tmp_path, monkeypatch):
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError("load_pretrained opened a socket")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="'HuggingFaceTB/SmolLM-135M'.*no such local folder.*pass the local folder"):
        load_pretrained("HuggingFaceTB/SmolLM-135M")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        load_pretrained(tmp_path / "empty")


def edited_checkpoint(tmp_path, kind: str, **fields) -> str:
    hf_model(kind).save_pretrained(tmp_path / kind)
    path = tmp_path / kind / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))
    return str(tmp_path / kind)


@pytest.mark.parametrize(("kind", "fields", "message"), [
    ("gpt2", {"architectures": ["BertForMaskedLM"]}, "architectures=\\['BertForMaskedLM'\\] is not supported"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True .*expected False"),
    ("gpt2", {"activation_function": "relu"}, "activation_function='relu'"),
    ("llama-tied", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope_type='yarn' is not supported for LlamaForCausalLM"),
    ("llama-tied", {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type='linear'"),
    ("llama-tied", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama-tied", {"attention_bias": True}, "attention_bias=True"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True"),
])
def test_unsupported_architectures_and_fields_are_refused_by_name(kind, fields, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        load_pretrained(edited_checkpoint(tmp_path, kind, **fields))


def test_a_checkpoint_saved_from_the_base_model_loads_as_the_published_gpt2_does(tmp_path):
    # openai-community/gpt2's model.safetensors names 'h.0.attn.c_attn.weight', without 'transformer.',
    # and carries the causal-mask buffers 'h.N.attn.bias'.
    from safetensors.numpy import load_file, save_file

    reference = hf_model("gpt2")
    reference.save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    bare = {name.removeprefix("transformer."): value for name, value in tensors.items()}
    bare.update({f"h.{layer}.attn.bias": np.tril(np.ones((1, 1, 32, 32), np.float32)) for layer in range(2)})
    assert "wte.weight" in bare and not any(name.startswith("transformer.") for name in bare)
    save_file(bare, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    tokens = sample_tokens(6)
    assert_same_logits(load_pretrained(tmp_path / "hf")(jnp.asarray(tokens), deterministic=True),
                       hf_logits(reference, tokens))


def test_tensors_missing_or_extra_are_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = edited_checkpoint(tmp_path, "llama-tied")
    tensors = load_file(f"{folder}/model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 tensor.*model.layers.1.mlp.up_proj.weight"):
        load_pretrained(folder)
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((64, 32), np.float32)
    tensors["model.layers.1.mlp.extra.weight"] = np.zeros((2,), np.float32)
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no place.*model.layers.1.mlp.extra.weight"):
        load_pretrained(folder)


def test_hf_parameter_names_map_our_paths_to_transformers_names():
    gpt2 = GPT2(GPT2Config.preset("gpt2-tiny", n_layer=2), rngs=nnx.Rngs(0))
    names = hf_parameter_names(ComposerCausalLM(gpt2))
    assert names["blocks/1/attention/qkv/kernel"] == "transformer.h.1.attn.c_attn.weight"
    assert names["tokens/embedding"] == "transformer.wte.weight"
    llama = Llama(LlamaConfig(**SHAPE, tie_word_embeddings=False), rngs=nnx.Rngs(0))
    names = hf_parameter_names(llama)
    assert names["blocks/0/attention/v_proj/kernel"] == "model.layers.0.self_attn.v_proj.weight"
    assert names["head/kernel"] == "lm_head.weight"
    assert set(names.values()) == set(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SHAPE, tie_word_embeddings=False)).state_dict())
    scanned = Llama(LlamaConfig(**SHAPE, scan_layers=True), rngs=nnx.Rngs(0))
    assert hf_parameter_names(scanned)["blocks/mlp/gate_proj/kernel"] == "model.layers.{layer}.mlp.gate_proj.weight"


def test_a_structure_that_no_longer_maps_is_refused_with_the_reason(tmp_path):
    from composerjax.algorithms.alibi import apply_alibi
    from composerjax.algorithms.gated_linear_units import apply_gated_linear_units

    glu = GPT2(GPT2Config.preset("gpt2-tiny", n_layer=1), rngs=nnx.Rngs(0))
    apply_gated_linear_units(glu)
    with pytest.raises(ValueError, match="blocks/0/mlp is a .*GLUFeedForward.*no place for"):
        save_pretrained(glu, tmp_path / "glu")
    alibi = GPT2(GPT2Config.preset("gpt2-tiny", n_layer=1), rngs=nnx.Rngs(0))
    apply_alibi(alibi, max_sequence_length=64)
    with pytest.raises(ValueError, match="position='alibi'.*only learned positions"):
        save_pretrained(alibi, tmp_path / "alibi")
    with pytest.raises(ValueError, match="position='rotary'"):
        save_pretrained(GPT2(GPT2Config.preset("gpt2-tiny", position="rotary"), rngs=nnx.Rngs(0)), tmp_path / "rot")

    class WrappedLinear(nnx.Module):  # what an adapter wrapper looks like before it is merged
        def __init__(self, base: nnx.Linear) -> None:
            self.base = base

    llama = Llama(LlamaConfig(**SHAPE), rngs=nnx.Rngs(0))
    llama.blocks[0].attention.q_proj = WrappedLinear(llama.blocks[0].attention.q_proj)
    with pytest.raises(ValueError, match="blocks/0/attention/q_proj is a .*WrappedLinear.*merge or undo it"):
        save_pretrained(llama, tmp_path / "wrapped")
    with pytest.raises(ValueError, match="model=MLP: expected a composerjax GPT2 or Llama"):
        from composerjax.models import MLP
        save_pretrained(MLP([4, 2], rngs=nnx.Rngs(0)), tmp_path / "mlp")
    assert not any((tmp_path / name).exists() for name in ("glu", "alibi", "rot", "wrapped", "mlp"))


def test_a_wrapper_that_can_merge_is_exported_merged_and_frozen_weights_are_exported(tmp_path):
    class Frozen(nnx.Variable):  # a weight held out of nnx.Param, as an adapter method freezes the base
        pass

    class AddedDelta(nnx.Module):  # a LoRA-like wrapper: kernel + delta, merged() gives the plain Linear
        def __init__(self, base: nnx.Linear) -> None:
            self.base = base
            self.delta = nnx.Param(jnp.full(base.kernel.shape, 0.05))

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.base(x) + x @ self.delta[...]

        def merged(self) -> nnx.Linear:
            self.base.kernel = nnx.Param(self.base.kernel[...] + self.delta[...])
            return self.base

    model = Llama(LlamaConfig(**SHAPE), rngs=nnx.Rngs(0))
    model.blocks[1].mlp.up_proj = AddedDelta(model.blocks[1].mlp.up_proj)
    model.norm.scale = Frozen(model.norm.scale[...] * 1.5)
    tokens = sample_tokens(8)
    expected = np.asarray(model(jnp.asarray(tokens)))
    save_pretrained(model, tmp_path / "merged")
    assert isinstance(model.blocks[1].mlp.up_proj, AddedDelta)  # the model itself keeps its wrapper
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert_same_logits(hf_logits(reloaded, tokens), expected)
    np.testing.assert_allclose(reloaded.model.norm.weight.detach().numpy(), np.asarray(model.norm.scale[...]))


FSDP_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from composerjax.models import load_pretrained
    from composerjax.parallel import build_mesh

    folder, tokens_file = sys.argv[1], sys.argv[2]
    mesh = build_mesh(fsdp=4)
    report = {"devices": len(jax.devices()), "params": {}}
    for source in ("argument", "set_mesh"):
        if source == "argument":
            model = load_pretrained(folder, mesh=mesh)
        else:
            with jax.set_mesh(mesh):
                model = load_pretrained(folder)
        for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            value = variable.get_value()
            shards = {tuple(shard.data.shape) for shard in value.addressable_shards}
            report["params"][source + ":" + "/".join(map(str, path))] = {
                "shape": list(value.shape), "shards": sorted(map(list, shards)),
                "devices": len({shard.device for shard in value.addressable_shards})}
        tokens = jnp.asarray(np.load(tokens_file))
        report[source + ":logits"] = np.asarray(model(tokens)).tolist()
    print(json.dumps(report))
""")


def test_fsdp_loading_on_4_devices_never_puts_a_whole_weight_on_one_device(tmp_path):
    reference = hf_model("llama3-untied")
    reference.save_pretrained(tmp_path / "hf")
    tokens = sample_tokens(5, (2, 8))
    np.save(tmp_path / "tokens.npy", tokens)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", FSDP_SCRIPT, str(tmp_path / "hf"), str(tmp_path / "tokens.npy")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["devices"] == 4
    assert len(report["params"]) == 2 * 21  # 9 per block, the embedding, the final norm and the head; twice
    for name, entry in report["params"].items():
        assert entry["devices"] == 4, name
        assert len(entry["shards"]) == 1, name  # one quarter on each device, never the whole
        shard, whole = entry["shards"][0], entry["shape"]
        assert np.prod(shard) * 4 == np.prod(whole), (name, shard, whole)
    assert report["params"]["argument:tokens/embedding"]["shards"] == [[32, 32]]  # 128 padded rows / 4
    for source in ("argument", "set_mesh"):
        assert_same_logits(np.asarray(report[source + ":logits"], np.float32), hf_logits(reference, tokens))


def test_a_missing_local_path_is_named_with_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"load_pretrained\('runs/tiny-llama/model'\): no such local folder \(looked "
                                         rf"for {re.escape(str(tmp_path))}/runs/tiny-llama/model\); .*pass the local "
                                         "folder"):
        load_pretrained("runs/tiny-llama/model")
