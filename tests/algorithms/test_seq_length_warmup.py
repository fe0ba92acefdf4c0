"""SeqLengthWarmup: the length schedule's closed form, truncation and regrouping, one compile per length."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Callback, ComposerClassifier, State, Trainer
from composerjax.algorithms.seq_length_warmup import (
    SeqLengthWarmup,
    set_batch_sequence_length,
    warmup_sequence_length,
)
from composerjax.data import ArrayLoader
from composerjax.data.text import byte_windows, load_pydoc_bytes
from composerjax.models import TinyGPT


def closed_form_length(progress: float, duration: float, low: int, high: int, step: int) -> int:
    if progress >= duration:
        return high
    return low + step * math.floor(progress / duration * (high - low) / step)


@pytest.mark.parametrize("progress", [0.0, 0.05, 0.1, 0.15, 0.2, 0.29, 0.3, 0.6])
def test_length_follows_the_closed_form(progress):
    assert warmup_sequence_length(progress, 0.3, 8, 1024, 8) == closed_form_length(progress, 0.3, 8, 1024, 8)
    assert SeqLengthWarmup(0.3, 8, 1024, 8).length_at(progress) % 8 == 0


def test_zero_duration_starts_at_full_length():
    assert warmup_sequence_length(0.0, 0.0, 8, 64, 8) == 64


def test_uneven_ranges_end_exactly_at_the_maximum():
    lengths = [warmup_sequence_length(p / 100, 1.0, 8, 30, 8) for p in range(101)]
    assert sorted(set(lengths)) == [8, 16, 24, 30]


def test_truncate_keeps_the_first_tokens_of_every_array():
    x = np.arange(4 * 16).reshape(4, 16)
    soft = np.ones((4, 16, 3), np.float32)
    batch = {"inputs": x, "targets": x + 1, "soft": soft}
    cut = set_batch_sequence_length(batch, 8)
    np.testing.assert_array_equal(cut["inputs"], x[:, :8])
    np.testing.assert_array_equal(cut["targets"], x[:, :8] + 1)
    assert cut["soft"].shape == (4, 8, 3)
    assert set_batch_sequence_length(batch, 16) is batch  # full length: untouched


def test_regrouping_keeps_every_token_up_to_the_remainder_and_the_pairs_aligned():
    inputs, targets = byte_windows(load_pydoc_bytes()[:2000], 32)
    inputs, targets = inputs[:8], targets[:8]
    for seq_len in (8, 16, 24):
        new_inputs, new_targets = set_batch_sequence_length((inputs, targets), seq_len, truncate=False)
        kept = 8 * 32 // seq_len * seq_len
        assert new_inputs.shape == new_targets.shape == (kept // seq_len, seq_len)
        np.testing.assert_array_equal(new_inputs.ravel(), inputs.ravel()[:kept])
        np.testing.assert_array_equal(new_targets[:, :-1], new_inputs[:, 1:])  # still next-byte pairs


def test_preserve_end_of_sequence_moves_each_last_real_token_into_the_cut_sequence():
    # Composer's docstring example: [10, 11, 12, 13, 14, 15] cut to 3 keeps 15 at the end
    input_ids = np.array([[10, 11, 12, 13, 14, 15],   # 6 real tokens: the end 15 goes to position 2
                          [20, 21, 22, 23, 0, 0],     # 4 real tokens: the end 23 goes to position 2
                          [30, 31, 0, 0, 0, 0]])      # 2 real tokens: already inside, position 1 keeps 31
    mask = (input_ids > 0).astype(np.int32)
    labels = input_ids + 100
    features = np.stack([input_ids, -input_ids], axis=-1)  # (N, T, 2): whole positions move
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "features": features}
    cut = set_batch_sequence_length(batch, 3, preserve_end_of_sequence=True)
    assert cut["input_ids"].tolist() == [[10, 11, 15], [20, 21, 23], [30, 31, 0]]
    assert cut["labels"].tolist() == [[110, 111, 115], [120, 121, 123], [130, 131, 100]]
    assert cut["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 1], [1, 1, 0]]
    np.testing.assert_array_equal(cut["features"][..., 1], -cut["input_ids"])
    np.testing.assert_array_equal(batch["input_ids"][0], [10, 11, 12, 13, 14, 15])  # the input is not modified
    # without it, plain truncation; with truncate=False it is ignored, as in Composer
    assert set_batch_sequence_length(batch, 3)["input_ids"].tolist() == [[10, 11, 12], [20, 21, 22], [30, 31, 0]]
    regrouped = set_batch_sequence_length(batch, 3, truncate=False, preserve_end_of_sequence=True)
    assert regrouped["input_ids"].tolist() == input_ids.reshape(6, 3).tolist()
    # jax arrays take the same path
    cut_jax = set_batch_sequence_length({k: jnp.asarray(v) for k, v in batch.items()}, 3, preserve_end_of_sequence=True)
    assert cut_jax["input_ids"].tolist() == [[10, 11, 15], [20, 21, 23], [30, 31, 0]]


def test_preserve_end_of_sequence_needs_an_attention_mask():
    with pytest.raises(ValueError, match="preserve_end_of_sequence=True.*'attention_mask'.*tuple"):
        set_batch_sequence_length((np.zeros((2, 6)), np.zeros((2, 6))), 3, preserve_end_of_sequence=True)
    with pytest.raises(ValueError, match=r"keys \['input_ids'\]"):
        set_batch_sequence_length({"input_ids": np.zeros((2, 6))}, 3, preserve_end_of_sequence=True)


def test_defaults_are_composers():
    algorithm = SeqLengthWarmup()
    assert (algorithm.duration, algorithm.min_seq_length, algorithm.max_seq_length, algorithm.step_size,
            algorithm.truncate, algorithm.preserve_end_of_sequence) == (0.3, 8, 1024, 8, True, False)


def test_bad_batches_are_rejected():
    with pytest.raises(ValueError, match=r"\(N, T"):
        set_batch_sequence_length((np.zeros((2, 8)), np.zeros(2)), 4)
    with pytest.raises(ValueError, match="same"):
        set_batch_sequence_length((np.zeros((2, 8)), np.zeros((4, 4))), 2, truncate=False)
    with pytest.raises(ValueError, match="seq_len"):
        set_batch_sequence_length((np.zeros((2, 8)),), 0)


class RecordShapes(Callback):
    """The input shapes the step receives (AFTER_DATALOADER callbacks run after the algorithms)."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def after_dataloader(self, state, logger) -> None:
        self.shapes.append(tuple(state.batch[0].shape))
        assert state.batch[1].shape == state.batch[0].shape


def gpt_run(algorithm: SeqLengthWarmup, max_duration: str) -> tuple[Trainer, RecordShapes, list[int]]:
    inputs, targets = byte_windows(load_pydoc_bytes()[:20000], 32)
    model = ComposerClassifier(TinyGPT(dim=32, depth=1, num_heads=2, max_length=32, rngs=nnx.Rngs(0)), 256)
    recorder = RecordShapes()
    trainer = Trainer(model, ArrayLoader((inputs, targets), batch_size=8, shuffle=False), max_duration=max_duration,
                      optimizers=optax.sgd(0.1), algorithms=[algorithm], callbacks=[recorder], progress_bar=False)
    planned = algorithm.planned_lengths(trainer.state, 32)
    trainer.fit()
    return trainer, recorder, planned


def test_truncated_run_follows_the_schedule_and_compiles_once_per_length():
    algorithm = SeqLengthWarmup(duration=0.5, min_seq_length=16, max_seq_length=32, step_size=8)
    trainer, recorder, planned = gpt_run(algorithm, "6ba")
    expected = [closed_form_length(step / 6, 0.5, 16, 32, 8) for step in range(6)]
    assert expected == [16, 16, 24, 32, 32, 32]
    assert recorder.shapes == [(8, length) for length in expected]
    assert planned == [16, 24, 32] == algorithm.planned_lengths(trainer.state)
    assert trainer.compile_count == len(planned)
    assert trainer.state.timestamp.sample == 6 * 8


def test_regrouped_run_keeps_the_token_count_up_to_the_remainder():
    algorithm = SeqLengthWarmup(duration=0.5, min_seq_length=24, max_seq_length=32, step_size=8, truncate=False)
    trainer, recorder, planned = gpt_run(algorithm, "4ba")
    # lengths 24, 24, 32, 32: 8 x 32 = 256 tokens per batch, 256 % 24 = 16 of them dropped at length 24
    assert recorder.shapes == [(10, 24), (10, 24), (8, 32), (8, 32)]
    assert [rows * length for rows, length in recorder.shapes] == [240, 240, 256, 256]
    assert planned == [24, 32]
    assert trainer.compile_count == len(planned)


def test_planned_lengths_needs_a_known_number_of_batches_and_the_data_length():
    algorithm = SeqLengthWarmup(duration=0.5, min_seq_length=8, max_seq_length=1024, step_size=8)
    with pytest.raises(ValueError, match="max_duration"):
        algorithm.planned_lengths(State(model=None, max_duration="100tok"), 32)
    with pytest.raises(ValueError, match="sequence_length"):
        algorithm.planned_lengths(State(model=None, max_duration="4ba"))
    # lengths beyond the data's own length leave the batch whole: one compile for all of them
    assert algorithm.planned_lengths(State(model=None, max_duration="4ba"), 16) == [8, 16]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"duration": 1.5}, "duration"),
        ({"min_seq_length": 0}, "min_seq_length"),
        ({"max_seq_length": 4, "min_seq_length": 8}, "max_seq_length"),
        ({"step_size": 0}, "step_size"),
        ({"step_size": 2.5}, "step_size"),
        ({"truncate": "yes"}, "truncate"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SeqLengthWarmup(**kwargs)
