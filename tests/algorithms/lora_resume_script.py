"""A LoRA fine-tuning run for the resume test: trained straight, or in two processes with a checkpoint between.

    python lora_resume_script.py OUT_DIR --max-duration 8ba [--save-folder F] [--load-path P]

Writes ``OUT_DIR/final.npz``: every leaf of the final params (the adapters), rest (the frozen
weights) and optimizer state.
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np
import optax
from flax import nnx

from composerjax import ArrayLoader, Trainer
from composerjax.algorithms import LoRA
from composerjax.models import ComposerCausalLM
from composerjax.models.llama import Llama, LlamaConfig

VOCAB, LENGTH = 96, 16


def build_trainer(max_duration: str, save_folder: str | None, load_path: str | None) -> Trainer:
    config = LlamaConfig.preset("llama-tiny", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, max_position_embeddings=LENGTH)
    model = ComposerCausalLM(Llama(config, rngs=nnx.Rngs(0)))
    tokens = np.random.default_rng(0).integers(0, VOCAB, (32, LENGTH + 1)).astype(np.int32)
    loader = ArrayLoader((tokens[:, :-1], tokens[:, 1:]), 8, seed=1)  # 4 batches an epoch
    return Trainer(model, loader, max_duration, optax.adamw(1e-2), seed=5, progress_bar=False, run_summary=False,
                   algorithms=[LoRA(rank=4, alpha=8, target_modules=("q_proj", "v_proj"), dropout=0.1)],
                   save_folder=save_folder, save_interval="4ba" if save_folder else "1ep", load_path=load_path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--max-duration", required=True)
    parser.add_argument("--save-folder")
    parser.add_argument("--load-path")
    args = parser.parse_args()
    trainer = build_trainer(args.max_duration, args.save_folder, args.load_path)
    trainer.fit()
    state = trainer.state.train_state
    leaves = {}
    for group in ("params", "rest", "opt_state"):
        for path, leaf in jax.tree_util.tree_flatten_with_path(getattr(state, group))[0]:
            leaves[group + jax.tree_util.keystr(path)] = np.asarray(jax.device_get(leaf))
    trainer.close()
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, "final.npz"), **leaves)


if __name__ == "__main__":
    main()
