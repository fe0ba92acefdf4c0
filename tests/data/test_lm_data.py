"""Language-model data: stdlib corpus discovery and split, byte-level BPE round trip, packing, grain sharding."""

import json
import re

import grain  # in the dev extras: a missing grain fails this file instead of skipping it
import jax
import numpy as np
import pytest

from composerjax.data.packing import PackedSequences, dropped_tokens, lm_loader, pack_documents, token_stream
from composerjax.data.stdlib_corpus import read_documents, split_files, stdlib_files
from composerjax.data.tokenizer import (
    decode,
    encode_documents,
    eos_id,
    load_tokenizer,
    save_tokenizer,
    train_or_load_tokenizer,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def corpus():
    files = stdlib_files()
    train, validation = split_files(files, validation_fraction=0.05, seed=0)
    return files, train, validation


@pytest.fixture(scope="module")
def tokenizer(corpus):
    _, train, _ = corpus
    return train_tokenizer(read_documents(train[:30]), vocab_size=512)


def test_stdlib_discovery_finds_the_library_without_tests(corpus):
    files, _, _ = corpus
    names = {file.name for file in files}
    assert len(files) > 500
    assert {"os.py", "functools.py", "ast.py"} <= names
    assert not any({"test", "tests", "idle_test", "site-packages"} & set(file.parts) for file in files)
    assert not any(file.name.startswith("test_") for file in files)
    assert files == sorted(files) and len(set(files)) == len(files)
    total = sum(file.stat().st_size for file in files)
    assert total > 5_000_000


def test_stdlib_discovery_on_a_folder(tmp_path):
    for relative, content in {
        "a.py": b"x = 1\n", "pkg/b.py": b"y = 2\n", "pkg/tests/t.py": b"", "test/u.py": b"", "test_v.py": b"",
        "site-packages/w.py": b"", "latin1.py": "z = 'é'\n".encode("latin-1"), "notes.txt": b"",
    }.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_bytes(content)
    found = [file.relative_to(tmp_path).as_posix() for file in stdlib_files(tmp_path)]
    assert found == ["a.py", "pkg/b.py"]
    with_tests = [file.relative_to(tmp_path).as_posix() for file in stdlib_files(tmp_path, exclude_tests=False)]
    assert with_tests == ["a.py", "pkg/b.py", "pkg/tests/t.py", "test/u.py", "test_v.py"]
    assert list(read_documents([tmp_path / "a.py"])) == ["x = 1\n"]
    with pytest.raises(ValueError, match="`root`"):
        stdlib_files(tmp_path / "missing")


def test_split_is_by_file_deterministic_disjoint_and_complete(corpus):
    files, train, validation = corpus
    assert len(validation) == round(0.05 * len(files))
    assert not set(train) & set(validation)
    assert sorted(train + validation) == files
    assert split_files(files, 0.05, seed=0) == (train, validation)
    assert split_files(files, 0.05, seed=1)[1] != validation
    assert split_files(files, 0.0, seed=0) == (files, [])
    # The held-out files are the first ones of numpy's fixed-seed permutation.
    chosen = np.random.default_rng(0).permutation(len(files))[: len(validation)]
    assert validation == [files[index] for index in sorted(chosen)]


def test_tokenizer_round_trips_every_validation_file_byte_exactly(corpus, tokenizer):
    _, _, validation = corpus
    assert tokenizer.get_vocab_size() == 512
    assert eos_id(tokenizer) == 0
    documents = list(read_documents(validation))
    encoded = encode_documents(tokenizer, documents)
    for file, document, ids in zip(validation, documents, encoded, strict=True):
        text = decode(tokenizer, ids)
        assert text == document and text.encode("utf-8") == file.read_bytes(), file
    # BPE merges compress: fewer tokens than bytes.
    assert sum(map(len, encoded)) < 0.6 * sum(len(document.encode()) for document in documents)


def test_tokenizer_round_trips_awkward_text(tokenizer):
    for text in ["  leading spaces", "\ttab\r\nCRLF\rCR", "é ü 中文 😀 \x00\x7f", "", "x<|endoftext|>y", " "]:
        assert decode(tokenizer, tokenizer.encode(text).ids) == text, repr(text)
    assert tokenizer.encode("x<|endoftext|>y").ids[1] == eos_id(tokenizer)


def test_saved_tokenizer_reloads_with_identical_ids(tmp_path, corpus, tokenizer):
    _, _, validation = corpus
    path = save_tokenizer(tokenizer, tmp_path / "run" / "tokenizer.json")
    reloaded = load_tokenizer(path)
    documents = list(read_documents(validation[:5]))
    assert encode_documents(reloaded, documents) == encode_documents(tokenizer, documents)
    # A resumed run loads the saved file and never reads (or retrains on) new texts.
    resumed = train_or_load_tokenizer(path, texts=iter(["other text"] * 50), vocab_size=300)
    assert resumed.get_vocab_size() == 512
    assert json.loads(resumed.to_str()) == json.loads(tokenizer.to_str())


def test_packing_is_the_eos_joined_stream_up_to_the_dropped_tail(corpus, tokenizer):
    _, _, validation = corpus
    encoded = encode_documents(tokenizer, read_documents(validation[:8]))
    eos, seq_len = eos_id(tokenizer), 64
    stream = np.concatenate([np.array([*ids, eos]) for ids in encoded])
    np.testing.assert_array_equal(token_stream(encoded, eos), stream)
    packed = pack_documents(encoded, seq_len=seq_len, eos_id=eos)
    count = (len(stream) - 1) // seq_len
    assert packed.shape == (count, seq_len + 1) and packed.dtype == np.int32
    # Consecutive windows share exactly one token; the inputs, concatenated, are the stream.
    np.testing.assert_array_equal(packed[:-1, -1], packed[1:, 0])
    np.testing.assert_array_equal(packed[:, :-1].reshape(-1), stream[: count * seq_len])
    np.testing.assert_array_equal(packed[:, 1:].reshape(-1), stream[1 : count * seq_len + 1])
    assert dropped_tokens(len(stream), seq_len) == len(stream) - (count * seq_len + 1) < seq_len
    assert (packed == eos).sum() >= 7  # the separators are in the sequences


def test_packing_by_hand():
    assert pack_documents([[5, 6, 7], [8, 9]], seq_len=3, eos_id=0).tolist() == [[5, 6, 7, 0], [0, 8, 9, 0]]
    assert pack_documents([[5, 6, 7], [8, 9, 1]], seq_len=3, eos_id=0).tolist() == [[5, 6, 7, 0], [0, 8, 9, 1]]
    assert dropped_tokens(8, 3) == 1
    inputs, targets = PackedSequences(np.array([[1, 2, 3], [3, 4, 5]], dtype=np.int64))[1]
    assert inputs.tolist() == [3, 4] and targets.tolist() == [4, 5]
    assert inputs.dtype == targets.dtype == np.int32


def window_ids(batches) -> list[int]:
    """Each sequence's window, read back from its first input token (windows here start at distinct tokens)."""
    return [(int(start) - 1) // 8 for inputs, _ in batches for start in inputs[:, 0]]


@pytest.mark.parametrize("worker_count", [0, 2])
def test_two_process_shards_see_every_window_exactly_once(worker_count, monkeypatch):
    # One document 1..320 (+ EOS): window i starts with token 8 * i + 1, so its first input names it.
    packed = pack_documents([list(range(1, 8 * 40 + 1))], seq_len=8, eos_id=0)
    source = PackedSequences(packed)
    seen = []
    for process_index in range(2):
        monkeypatch.setattr(jax, "process_index", lambda index=process_index: index)
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        loader = lm_loader(source, batch_size=5, seed=3, worker_count=worker_count)
        assert len(loader) == 4  # 20 windows per process; with 2 workers 10 each, so none is dropped
        seen.append(window_ids(loader))
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(40))
    # grain's ShardOptions by index give the same two shares of each epoch's shuffle.
    for index in range(2):
        dataloader = grain.DataLoader(data_source=source, sampler=loader._sampler(0, 3),
                                      operations=[grain.transforms.Batch(5)],
                                      shard_options=grain.sharding.ShardOptions(index, 2, drop_remainder=True))
        assert sorted(window_ids(dataloader)) == sorted(seen[index])


def test_lm_loader_resumes_mid_epoch_exactly():
    packed = pack_documents([list(range(1, 400))], seq_len=8, eos_id=0)
    reference = [inputs for inputs, _ in lm_loader(packed, batch_size=4, seed=1)]
    loader = lm_loader(packed, batch_size=4, seed=1)
    iterator = iter(loader)
    taken = [next(iterator)[0] for _ in range(3)]
    resumed = lm_loader(packed, batch_size=4, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    rest = [inputs for inputs, _ in resumed]
    assert len(taken + rest) == len(reference) == 12
    for got, want in zip(taken + rest, reference, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: split_files([], 0.05), "`files`"),
        (lambda: split_files(["a.py", "b.py"], 1.0), "`validation_fraction`"),
        (lambda: split_files(["a.py", "b.py"], 0.5, seed=-1), "`seed`"),
        (lambda: split_files(["a.py", "a.py"], 0.5), "`files`"),
        (lambda: train_tokenizer(["x"], vocab_size=257), "`vocab_size` must be at least 258"),
        (lambda: train_tokenizer(["x"], vocab_size=300, special_tokens="<eos>"), "`special_tokens`"),
        (lambda: train_tokenizer(["x"], vocab_size=300, special_tokens=("<a>", "<a>")), "`special_tokens`"),
        (lambda: pack_documents([[1, 2]], seq_len=0, eos_id=0), "`seq_len`"),
        (lambda: pack_documents([[1, 2]], seq_len=2, eos_id=-1), "`eos_id`"),
        (lambda: pack_documents([[1, 2]], seq_len=3, eos_id=0), "`seq_len`"),
        (lambda: pack_documents([[1.5, 2]], seq_len=1, eos_id=0), "`token_lists[0]`"),
        (lambda: pack_documents([[1], [-1]], seq_len=1, eos_id=0), "`token_lists[1]`"),
        (lambda: PackedSequences(np.arange(4)), "`packed`"),
        (lambda: lm_loader(np.ones((4, 3), np.int32), batch_size=0), "`batch_size`"),
    ],
)
def test_bad_arguments_raise_value_errors_naming_them(call, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        call()


def test_eos_and_load_errors_name_the_argument(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="`token`='<eos>'"):
        eos_id(tokenizer, "<eos>")
    with pytest.raises(ValueError, match="`path`"):
        load_tokenizer(tmp_path / "missing.json")
