"""A GPT-2 recipe on the stdlib corpus learns: eval cross-entropy falls well below chance and below a unigram model."""

from __future__ import annotations

import math

import numpy as np

from composerjax import Callback
from composerjax.data.lm import TOKENIZER_FILE
from composerjax.data.tokenizer import load_tokenizer
from composerjax.trainer import build_trainer

VOCAB, SEQ_LEN, BATCHES = 384, 32, 80


class TrainLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def batch_end(self, state, logger) -> None:
        self.losses.append(float(state.loss))


def test_gpt2_recipe_on_stdlib_beats_chance_and_unigram_within_80_batches(tmp_path):
    recipe = {
        "run_name": "lm-learns", "run_dir": str(tmp_path / "run"), "seed": 0,
        "model": {"name": "gpt2", "config": "gpt2-tiny", "vocab_size": VOCAB, "n_positions": SEQ_LEN, "n_embd": 96,
                  "n_layer": 2, "n_head": 2},
        "data": {"name": "stdlib_lm", "seq_len": SEQ_LEN, "batch_size": 16, "vocab_size": VOCAB, "max_files": 12,
                 "validation_fraction": 0.2, "eval_batch_size": 32},
        "optimizer": {"name": "adamw", "lr": 3.0e-3, "weight_decay": 0.01},
        "max_duration": f"{BATCHES}ba", "eval_interval": f"{BATCHES}ba", "progress_bar": False, "run_summary": False,
    }
    losses = TrainLosses()
    trainer = build_trainer(recipe, callbacks=[losses])
    train_loader, eval_loader = trainer.state.dataloader, trainer.state.evaluators[0].dataloader
    assert len(train_loader) > BATCHES  # less than one epoch: every batch is new data
    tokenizer = load_tokenizer(tmp_path / "run" / TOKENIZER_FILE)  # the recipe's run folder keeps it
    assert tokenizer.get_vocab_size() == VOCAB

    # A unigram model of the train targets (add-one smoothed), scored on the eval targets: the loss a
    # model reaches by learning token frequencies alone, with no context.
    counts = np.bincount(train_loader._data_source.packed[:, 1:].ravel(), minlength=VOCAB) + 1.0
    eval_targets = np.concatenate([targets.ravel() for _, targets in eval_loader])
    eval_targets = eval_targets[eval_targets != -100]  # the last batch's filling, which the metrics ignore too
    unigram = float(-np.log(counts / counts.sum())[eval_targets].mean())
    assert 4.8 < unigram < 5.3

    before = trainer.eval()["LanguageCrossEntropy"]
    assert abs(before - math.log(VOCAB)) < 0.05  # a fresh model is close to uniform: ln(384) = 5.95
    trainer.fit()
    after = trainer.eval()["LanguageCrossEntropy"]
    trainer.close()
    assert len(losses.losses) == BATCHES and all(math.isfinite(loss) for loss in losses.losses)
    assert after < 0.8 * math.log(VOCAB)  # 4.76 nats
    assert after < unigram - 0.3  # it uses context, not only frequencies
    assert after < before - 1.2
    first, last = np.mean(losses.losses[:10]), np.mean(losses.losses[-10:])
    assert first - last > 0.8
    assert np.mean(losses.losses[-20:-10]) > last - 0.05  # still going down (or flat) at the end
