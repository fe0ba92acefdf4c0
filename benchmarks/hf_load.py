"""Load time of a 1B-parameter-shaped Hugging Face checkpoint: ``load_pretrained`` beside transformers.

Writes a local ``LlamaForCausalLM`` folder with TinyLlama-1.1B's shapes (22 layers, 2048 wide,
grouped-query attention 32/4, SwiGLU 5632, vocabulary 32,000; 1.1B parameters) and random bf16
weights, as sharded safetensors with their index, then loads it, alternating, several times with:

- ``composerjax.models.load_pretrained(folder)``: one tensor at a time from safetensors, straight
  into its target sharding;
- ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` in PyTorch (the reference a user
  would otherwise run), when ``transformers`` imports;
- a bare ``safetensors`` read of every tensor into numpy (the floor: the file reading alone).

It prints each one's median seconds and the ratios. The folder is made once under ``--folder``
(default: a temporary folder, removed at the end).

Run: ``.venv/bin/python benchmarks/hf_load.py [--repeats 3] [--folder DIR] [--preset tinyllama-1.1b]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np

from composerjax.models.llama import LlamaConfig

SHARD_BYTES = 2 * 1024**3  # transformers' default max_shard_size is 5GB; smaller shards exercise the index


def write_random_checkpoint(folder: str, preset: str) -> int:
    """Write a random-weight HF Llama folder with ``preset``'s shapes; return its parameter count."""
    import ml_dtypes
    from safetensors.numpy import save_file

    config = LlamaConfig.preset(preset)
    d, f, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = d // heads
    shapes = {"model.embed_tokens.weight": (config.vocab_size, d), "model.norm.weight": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        shapes.update({
            prefix + "input_layernorm.weight": (d,), prefix + "post_attention_layernorm.weight": (d,),
            prefix + "self_attn.q_proj.weight": (heads * head_dim, d),
            prefix + "self_attn.k_proj.weight": (kv * head_dim, d),
            prefix + "self_attn.v_proj.weight": (kv * head_dim, d),
            prefix + "self_attn.o_proj.weight": (d, heads * head_dim),
            prefix + "mlp.gate_proj.weight": (f, d), prefix + "mlp.up_proj.weight": (f, d),
            prefix + "mlp.down_proj.weight": (d, f),
        })
    rng = np.random.default_rng(0)
    shards: list[dict[str, np.ndarray]] = [{}]
    size, weight_map, total = 0, {}, 0
    for name, shape in shapes.items():
        array = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        if size + array.nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
        total += array.size
    count = len(shards)
    for index, tensors in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {"total_size": 2 * total}, "weight_map": weight_map}, handle)
    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": d, "intermediate_size": f, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    }
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump(hf_config, handle, indent=2)
    return total


def load_composerjax(folder: str) -> float:
    from composerjax.models import load_pretrained

    start = time.perf_counter()
    model = load_pretrained(folder)
    from flax import nnx

    jax.block_until_ready(nnx.state(model))
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    return elapsed


def load_transformers(folder: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16)
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    return elapsed


def read_safetensors(folder: str) -> float:
    from safetensors import safe_open

    start = time.perf_counter()
    for file in sorted(name for name in os.listdir(folder) if name.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), framework="numpy") as handle:
            for name in handle.keys():
                handle.get_tensor(name)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", default=None, help="where to write the checkpoint (default: a temporary folder)")
    parser.add_argument("--preset", default="tinyllama-1.1b")
    args = parser.parse_args()
    folder = args.folder or tempfile.mkdtemp(prefix="hf_load_")
    os.makedirs(folder, exist_ok=True)
    try:
        start = time.perf_counter()
        parameters = write_random_checkpoint(folder, args.preset)
        written = time.perf_counter() - start
        on_disk = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))
        print(f"{args.preset}-shaped LlamaForCausalLM, random bf16 weights: {parameters / 1e9:.3f}B parameters, "
              f"{on_disk / 2**30:.2f} GiB of safetensors (written in {written:.1f} s); backend "
              f"{jax.default_backend()}, {os.cpu_count()} CPUs")
        try:
            import transformers  # noqa: F401
            loaders = {"composerjax load_pretrained": load_composerjax,
                       "transformers from_pretrained": load_transformers}
        except ImportError as error:
            print(f"transformers side skipped: {error}")
            loaders = {"composerjax load_pretrained": load_composerjax}
        loaders["safetensors read (floor)"] = read_safetensors
        times: dict[str, list[float]] = {name: [] for name in loaders}
        for _ in range(args.repeats):
            for name, load in loaders.items():
                times[name].append(load(folder))
        ours = statistics.median(times["composerjax load_pretrained"])
        print(f"{'loader':32s} {'median s':>9s} {'ours / this':>12s}")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"{name:32s} {median:9.2f} {ours / median:12.2f}")
    finally:
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
