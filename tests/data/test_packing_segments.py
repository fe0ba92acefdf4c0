"""Packed sequences with segment ids: document indices, boundary targets ignored, (inputs, targets, segment_ids)."""

import numpy as np
import pytest

from composerjax.data import IGNORE_INDEX, PackedSequences, lm_loader, pack_documents, stdlib_lm, text_files_lm
from composerjax.data.tokenizer import eos_id


def test_pack_documents_gives_each_token_its_document_and_the_same_windows():
    docs = [[5, 6, 7], [8], [], [9, 10, 11, 12]]  # stream 5 6 7 0 | 8 0 | 0 | 9 10 11 12 0
    windows, document_ids = pack_documents(docs, seq_len=4, eos_id=0, segment_ids=True)
    np.testing.assert_array_equal(windows, pack_documents(docs, seq_len=4, eos_id=0))
    assert windows.tolist() == [[5, 6, 7, 0, 8], [8, 0, 0, 9, 10]]
    assert document_ids.tolist() == [[0, 0, 0, 0, 1], [1, 1, 2, 3, 3]]


def test_records_ignore_the_target_across_each_boundary_and_renumber_segments_per_row():
    windows, document_ids = pack_documents([[5, 6, 7], [8], [], [9, 10, 11, 12]], seq_len=4, eos_id=0,
                                           segment_ids=True)
    source = PackedSequences(windows, segment_ids=document_ids)
    assert [part.tolist() for part in source[0]] == [[5, 6, 7, 0], [6, 7, 0, IGNORE_INDEX], [0, 0, 0, 0]]
    assert [part.tolist() for part in source[1]] == [[8, 0, 0, 9], [0, IGNORE_INDEX, IGNORE_INDEX, 10], [0, 0, 1, 2]]
    assert all(part.dtype == np.int32 for part in source[1])
    assert repr(source) == "PackedSequences(num_records=2, seq_len=4, segment_ids=True)"
    assert repr(PackedSequences(windows)) == "PackedSequences(num_records=2, seq_len=4)"  # unchanged by default


def test_lm_loader_serves_three_part_batches():
    windows, document_ids = pack_documents([list(range(1, 6)), list(range(6, 13))], seq_len=4, eos_id=0,
                                           segment_ids=True)
    inputs, targets, segments = next(iter(lm_loader(windows, 2, shuffle=False, segment_ids=document_ids)))
    # stream 1 2 3 4 5 0 6 ... 12 0
    assert inputs.tolist() == [[1, 2, 3, 4], [5, 0, 6, 7]]
    assert targets.tolist() == [[2, 3, 4, 5], [0, IGNORE_INDEX, 7, 8]]
    assert segments.tolist() == [[0, 0, 0, 0], [0, 0, 1, 1]]


def test_bad_segment_ids_are_refused_naming_the_argument():
    windows, document_ids = pack_documents([[1, 2, 3, 4, 5]], seq_len=2, eos_id=0, segment_ids=True)
    with pytest.raises(ValueError, match=r"`segment_ids` must be an integer array of the packed windows' shape "
                                         r"\(2, 3\), got shape \(2, 2\)"):
        PackedSequences(windows, segment_ids=document_ids[:, :2])
    with pytest.raises(ValueError, match=r"lm_loader\(segment_ids=...\): `packed` is a PackedSequences already"):
        lm_loader(PackedSequences(windows), 1, segment_ids=document_ids)
    with pytest.raises(ValueError, match=r"segment_ids='yes': expected True .* or False"):
        pack_documents([[1, 2, 3]], seq_len=2, eos_id=0, segment_ids="yes")


def test_stdlib_lm_with_segment_ids_keeps_every_target_inside_its_document():
    splits = stdlib_lm(seq_len=32, batch_size=4, vocab_size=300, max_files=6, segment_ids=True)
    eos = eos_id(splits.train.tokenizer)
    plain = stdlib_lm(seq_len=32, batch_size=4, vocab_size=300, max_files=6)
    boundaries = 0
    for (inputs, targets, segments), (plain_inputs, plain_targets) in zip(splits.train, plain.train):
        np.testing.assert_array_equal(inputs, plain_inputs)  # the same windows in the same order
        crossing = segments[:, 1:] != segments[:, :-1]
        np.testing.assert_array_equal(crossing, inputs[:, :-1] == eos)  # a new document starts after each EOS
        np.testing.assert_array_equal(targets == IGNORE_INDEX, np.pad(crossing, ((0, 0), (0, 1))))
        kept = targets != IGNORE_INDEX
        np.testing.assert_array_equal(targets[kept], plain_targets[kept])
        assert (segments[:, 0] == 0).all()
        boundaries += int(crossing.sum())
    assert boundaries > 0
    assert len(next(iter(splits.eval))) == 3


def test_text_files_lm_takes_segment_ids_too(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("the quick brown fox jumps over the lazy dog " * 5)
    splits = text_files_lm(str(tmp_path / "*.txt"), seq_len=8, batch_size=2, vocab_size=300, segment_ids=True)
    assert len(next(iter(splits.train))) == 3
