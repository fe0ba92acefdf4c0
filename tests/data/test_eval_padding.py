"""An eval set's last, short batch filled with ignored sequences: one compiled eval step, the same metrics."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from composerjax import Trainer
from composerjax.data import lm_loader, pack_documents, text_files_lm
from composerjax.data.grain_loader import GrainLoader
from composerjax.models.factories import gpt2

STREAM = [list(range(1, 60))]  # 59 tokens + EOS: 14 windows of 4 (+ 1 target)


def test_lm_loader_fills_the_last_batch_with_sequences_whose_targets_are_ignored():
    packed = pack_documents(STREAM, seq_len=4, eos_id=0)
    batches = list(lm_loader(packed, batch_size=4, shuffle=False, drop_remainder=False, pad_remainder=True))
    assert len(packed) == 14 and [batch[0].shape for batch in batches] == [(4, 4)] * 4  # 4 + 4 + 4 + 2 real
    inputs, targets = batches[-1]
    np.testing.assert_array_equal(inputs[:2], packed[12:14, :-1])
    np.testing.assert_array_equal(targets[:2], packed[12:14, 1:])
    assert inputs[2:].tolist() == [[0] * 4] * 2 and targets[2:].tolist() == [[-100] * 4] * 2
    assert inputs.dtype == targets.dtype == np.int32
    # Unfilled, the last batch is short: what made the eval step compile twice.
    assert [batch[0].shape[0] for batch in lm_loader(packed, 4, shuffle=False, drop_remainder=False)] == [4, 4, 4, 2]


def test_packed_documents_keep_a_segment_id_field_in_the_filled_rows():
    packed, documents = pack_documents([[5, 6, 7], [8, 9], [1, 2, 3, 4]], seq_len=3, eos_id=0, segment_ids=True)
    loader = lm_loader(packed, batch_size=3, shuffle=False, drop_remainder=False, segment_ids=documents,
                       pad_remainder=True)
    assert [field.shape for field in next(iter(loader))] == [(3, 3)] * 3  # 3 windows: one full batch, as it is
    last = list(lm_loader(packed, batch_size=2, shuffle=False, drop_remainder=False, segment_ids=documents,
                          pad_remainder=True))[-1]
    assert [field.shape for field in last] == [(2, 3)] * 3
    assert last[1][1].tolist() == [-100] * 3 and last[2][1].tolist() == [0] * 3


@pytest.mark.parametrize(("options", "message"), [
    ({"pad_remainder": (0, -100)}, r"pad_remainder=\(0, -100\): expected a tuple of fill values, one per field of "
                                   r"a record, with drop_remainder=False"),
    ({"pad_remainder": 0, "drop_remainder": False}, r"pad_remainder=0: expected a tuple of fill values"),
])
def test_a_fill_without_an_incomplete_batch_or_not_a_tuple_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        GrainLoader(np.zeros((5, 2), np.int32), batch_size=2, **options)
    with pytest.raises(ValueError, match=r"lm_loader\(pad_remainder='yes'\): expected True"):
        lm_loader(pack_documents(STREAM, seq_len=4, eos_id=0), 4, drop_remainder=False, pad_remainder="yes")


def test_a_fill_with_the_wrong_number_of_fields_names_it():
    loader = GrainLoader(np.zeros((5, 2), np.int32), batch_size=2, drop_remainder=False, pad_remainder=(0, -100),
                         shuffle=False)
    with pytest.raises(ValueError, match=r"pad_remainder=\(0, -100\): the records have 1 field\(s\); expected one "
                                         "fill value per field"):
        list(loader)


def test_one_evaluation_compiles_the_eval_step_once_with_the_metrics_of_the_real_sequences():
    packed = pack_documents([list(np.random.default_rng(0).integers(1, 64, 420))], seq_len=16, eos_id=0)
    assert len(packed) % 8  # 26 windows: three batches of 8 and one of 2
    model = gpt2("gpt2-tiny", vocab_size=64, n_positions=16, n_embd=32, n_layer=1)
    trainer = Trainer(model, lm_loader(packed, 8), "1ba", optax.sgd(0.1), progress_bar=False, run_summary=False)

    def evaluate(**options) -> tuple[dict[str, float], int]:
        before = len(trainer.state.compiled_steps)
        results = trainer.eval(lm_loader(packed, 8, shuffle=False, drop_remainder=False, **options))
        return results, sum(record.kind == "eval" for record in trainer.state.compiled_steps[before:])

    filled, compiles = evaluate(pad_remainder=True)
    assert compiles == 1
    again, compiles = evaluate(pad_remainder=True)
    assert compiles == 0 and again == filled  # a second evaluation reuses the compiled step
    short, compiles = evaluate()
    assert compiles == 1  # the short last batch's own step
    assert set(filled) == {"LanguageCrossEntropy", "LanguagePerplexity", "MaskedAccuracy"}
    assert filled == short


def test_the_lm_pipelines_fill_the_last_eval_batch(tmp_path):
    for index in range(3):
        (tmp_path / f"doc{index}.txt").write_text(f"def f{index}(x):\n    return x * {index} + 1\n" * 12)
    splits = text_files_lm(str(tmp_path / "doc[01].txt"), eval=[str(tmp_path / "doc2.txt")], seq_len=8,
                           batch_size=4, eval_batch_size=4, vocab_size=280)
    windows = len(splits.eval._data_source)
    assert windows > 4 and windows % 4, windows  # a short last batch to fill
    batches = list(splits.eval)
    assert [batch[0].shape for batch in batches] == [(4, 8)] * len(batches)
    assert (batches[-1][1][windows % 4:] == -100).all()
