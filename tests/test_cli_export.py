"""Fine-tuning from the command line: a pretrained folder in, ``composerjax train``, ``export``, transformers out.

``examples/make_tiny_pretrained.py`` makes a small random ``LlamaForCausalLM`` folder (with its
tokenizer and a chat template) and arithmetic instruction data; ``examples/finetune_llama.yaml``
fine-tunes it with LoRA, shortened here to a few batches. Each command runs in its own process;
the exported folders are read back here, after every writer exited, by ``transformers`` and
``peft``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "composerjax"]
SHORT = ["--set", "max_duration=6ba", "--set", "eval_interval=6ba", "--set", "save_interval=6ba",
         "--set", "progress_bar=false", "--set", "run_summary=false"]


def run(args, cwd, expect=0):
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == expect, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """The example's folders in a fresh root: runs/tiny-llama (the pretrained stand-in) and runs/finetune-llama."""
    root = tmp_path_factory.mktemp("finetune")
    run([sys.executable, str(ROOT / "examples/make_tiny_pretrained.py"), "runs/tiny-llama", "--train-examples", "96",
         "--eval-examples", "16", "--vocab-size", "400"], root)
    run([*CLI, "train", str(ROOT / "examples/finetune_llama.yaml"), *SHORT], root)
    run([*CLI, "export", "runs/finetune-llama", "runs/finetune-llama/hf"], root)
    run([*CLI, "export", "runs/finetune-llama", "runs/finetune-llama/adapter", "--adapter"], root)
    return root


def our_logits(root, tokens):
    """Logits of the fine-tuned model as composerjax restores it (LoRA adapters unmerged), in this process."""
    import jax.numpy as jnp

    from composerjax.cli_export import model_after_init
    from composerjax.cli_generate import load_model_weights
    from composerjax.trainer.config import load_config

    cwd = os.getcwd()
    os.chdir(root)
    try:
        config = load_config("runs/finetune-llama/recipe.yaml")
        model, batch = load_model_weights(model_after_init(config), "runs/finetune-llama/checkpoints")
    finally:
        os.chdir(cwd)
    assert batch == 6
    return np.asarray(model.module(jnp.asarray(tokens)), np.float32)


def test_the_exported_folder_loads_in_transformers_with_the_fine_tuned_logits(finetuned):
    import torch
    from transformers import AutoModelForCausalLM

    tokens = np.random.default_rng(0).integers(0, 400, size=(2, 12))
    exported = AutoModelForCausalLM.from_pretrained(finetuned / "runs/finetune-llama/hf", torch_dtype=torch.float32)
    with torch.no_grad():
        theirs = exported(torch.as_tensor(tokens)).logits.numpy()
    ours = our_logits(finetuned, tokens)
    assert np.abs(theirs - ours).max() <= 1e-4
    # The fine-tuning changed the model: the pretrained folder's logits are not these.
    base = AutoModelForCausalLM.from_pretrained(finetuned / "runs/tiny-llama/model", torch_dtype=torch.float32)
    with torch.no_grad():
        assert np.abs(base(torch.as_tensor(tokens)).logits.numpy() - ours).max() > 1e-3


def test_the_adapter_folder_loads_in_peft_over_the_pretrained_model(finetuned):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = finetuned / "runs/finetune-llama/adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16
    tokens = np.random.default_rng(1).integers(0, 400, size=(2, 12))
    base = AutoModelForCausalLM.from_pretrained(finetuned / "runs/tiny-llama/model", torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter)
    with torch.no_grad():
        theirs = model(torch.as_tensor(tokens)).logits.numpy()
    assert np.abs(theirs - our_logits(finetuned, tokens)).max() <= 1e-4


def test_the_exported_tokenizer_is_the_pretrained_one(finetuned):
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained(finetuned / "runs/tiny-llama/model")
    exported = AutoTokenizer.from_pretrained(finetuned / "runs/finetune-llama/hf")
    text = "What is 12 plus 30? 42"
    assert exported(text)["input_ids"] == original(text)["input_ids"]
    assert exported.eos_token == original.eos_token == "<|endoftext|>"
    messages = [{"role": "user", "content": "What is 1 plus 2?"}]
    assert exported.apply_chat_template(messages, tokenize=False) == original.apply_chat_template(messages,
                                                                                                  tokenize=False)


def test_an_out_dir_with_files_is_refused_without_overwrite(finetuned):
    done = run([*CLI, "export", "runs/finetune-llama", "runs/finetune-llama/hf"], finetuned, expect=2)
    assert "OUT_DIR='runs/finetune-llama/hf' already has files" in done.stderr
    (finetuned / "a-file").write_text("x")
    done = run([*CLI, "export", "runs/finetune-llama", "a-file"], finetuned, expect=2)
    assert "OUT_DIR='a-file' is a file" in done.stderr


def test_a_structure_with_no_hf_architecture_is_refused_with_the_reason(tmp_path):
    recipe = {"run_name": "glu", "model": {"name": "gpt2", "config": "gpt2-tiny", "vocab_size": 300,
                                           "n_positions": 32, "n_embd": 32, "n_layer": 1, "n_head": 2},
              "data": {"name": "stdlib_lm", "seq_len": 16, "batch_size": 4, "vocab_size": 300, "max_files": 4,
                       "validation_fraction": 0.0},
              "optimizer": {"name": "adam", "lr": 0.01}, "max_duration": "2ba",
              "save_folder": "runs/{run_name}/checkpoints", "progress_bar": False, "run_summary": False,
              "algorithms": [{"gated_linear_units": {}}]}
    (tmp_path / "glu.yaml").write_text(yaml.safe_dump(recipe))
    run([*CLI, "train", "glu.yaml"], tmp_path)
    done = run([*CLI, "export", "runs/glu", "out"], tmp_path, expect=2)
    assert "GatedLinearUnits" in done.stderr or "GLU" in done.stderr or "gate" in done.stderr, done.stderr
    assert not (tmp_path / "out" / "config.json").exists()
    done = run([*CLI, "export", "runs/glu", "adapter", "--adapter"], tmp_path, expect=2)
    assert "LoRA" in done.stderr, done.stderr


def test_generate_on_the_fine_tuned_run_equals_transformers_greedy_on_the_export(finetuned):
    # generate rebuilds the model with LoRA's wrappers (the recipe's INIT surgery) before loading the checkpoint.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done = run([*CLI, "generate", "runs/finetune-llama", "--prompt", "What is 12 plus 7?", "--max-new-tokens", "6"],
               finetuned)
    tokenizer = AutoTokenizer.from_pretrained(finetuned / "runs/finetune-llama/hf")
    model = AutoModelForCausalLM.from_pretrained(finetuned / "runs/finetune-llama/hf", torch_dtype=torch.float32)
    ids = tokenizer("What is 12 plus 7?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert done.stdout.rstrip("\n") == tokenizer.decode(out[0])
