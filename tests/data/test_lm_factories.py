"""The language-model data factories: the tokenizer kept beside the run, recipes' checks, other sources, close()."""

import json

import datasets  # in the dev extras: a missing datasets fails this file instead of skipping it
import numpy as np
import pytest

import composerjax.data.lm as lm
from composerjax.data import TOKENIZER_FILE, hf_dataset_lm, lm_loader, pack_documents, stdlib_lm, text_files_lm
from composerjax.trainer import build_trainer
from composerjax.trainer.config import ConfigError

SMALL = {"seq_len": 16, "batch_size": 2, "vocab_size": 300, "max_files": 4}


def batches(loader, count):
    iterator = iter(loader)
    return [tuple(np.asarray(part) for part in next(iterator)) for _ in range(count)]


def test_the_tokenizer_is_saved_beside_the_run_and_reloaded_without_training(tmp_path, monkeypatch):
    first = stdlib_lm(**SMALL, run_dir=str(tmp_path))
    saved = (tmp_path / TOKENIZER_FILE).read_text()
    assert json.loads(saved)["model"]["type"] == "BPE"

    def no_training(*args, **kwargs):
        raise AssertionError("a resumed run must load the saved tokenizer, not train a new one")

    monkeypatch.setattr("composerjax.data.tokenizer.train_tokenizer", no_training)
    second = stdlib_lm(**SMALL, run_dir=str(tmp_path))
    assert second.train.tokenizer.to_str() == first.train.tokenizer.to_str()
    for one, two in zip(batches(first.train, 3), batches(second.train, 3)):
        np.testing.assert_array_equal(one[0], two[0])


def test_a_saved_tokenizer_larger_than_vocab_size_is_refused(tmp_path):
    stdlib_lm(**SMALL, run_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"vocab_size=290: the run's saved tokenizer .* has 300 tokens"):
        stdlib_lm(**{**SMALL, "vocab_size": 290}, run_dir=str(tmp_path))


def test_splits_are_by_file_and_targets_are_the_next_tokens():
    splits = stdlib_lm(**SMALL)
    inputs, targets = batches(splits.train, 1)[0]
    assert inputs.shape == targets.shape == (2, 16) and inputs.dtype == np.int32
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    assert splits.eval is not None and not splits.eval._shuffle
    with pytest.raises(ValueError, match="batch_size=100000: the train split packs into only"):
        stdlib_lm(**{**SMALL, "batch_size": 100_000})


RECIPE = {
    "run_name": "lm-factory",
    "model": {"name": "gpt2", "config": "gpt2-tiny", "vocab_size": 300, "n_positions": 16, "n_embd": 16,
              "n_layer": 1, "n_head": 2},
    "data": {"name": "stdlib_lm", **SMALL},
    "max_duration": "1ba",
}


def test_a_recipe_keeps_the_tokenizer_in_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = build_trainer(RECIPE)
    try:
        assert trainer.state.run_dir == "runs/lm-factory"
        assert (tmp_path / "runs" / "lm-factory" / TOKENIZER_FILE).is_file()
    finally:
        trainer.close()
    monkeypatch.chdir(tmp_path)
    trainer = build_trainer({**RECIPE, "run_name": None, "run_dir": "elsewhere"})
    try:
        assert (tmp_path / "elsewhere" / TOKENIZER_FILE).is_file()
    finally:
        trainer.close()


@pytest.mark.parametrize(("model", "message"), [
    ({"vocab_size": 299}, r"model.vocab_size: 299 is smaller than the data's tokenizer \(300 tokens\)"),
    ({"n_positions": 8}, r"model.n_positions: 8 is shorter than data.seq_len=16"),
])
def test_a_model_too_small_for_the_data_is_a_recipe_problem(tmp_path, monkeypatch, model, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        build_trainer({**RECIPE, "model": {**RECIPE["model"], **model}})


def test_text_files_are_the_same_pipeline(tmp_path):
    for index in range(3):
        (tmp_path / f"doc{index}.txt").write_text(f"document {index}: " + "alpha beta gamma delta " * 30)
    splits = text_files_lm(str(tmp_path / "doc[01].txt"), eval=[str(tmp_path / "doc2.txt")], seq_len=8,
                           batch_size=2, vocab_size=280, tokenizer_path=str(tmp_path / "tok.json"))
    tokenizer = splits.train.tokenizer
    expected = pack_documents([tokenizer.encode((tmp_path / f"doc{i}.txt").read_text()).ids for i in (0, 1)], 8,
                              tokenizer.token_to_id("<|endoftext|>"))
    served = np.concatenate([np.concatenate([x, y[:, -1:]], axis=1) for x, y in
                             lm_loader(expected, 2, shuffle=False)])
    got = np.concatenate([np.concatenate([x, y[:, -1:]], axis=1) for x, y in splits.train])
    assert sorted(map(tuple, got)) == sorted(map(tuple, served))
    assert (tmp_path / "tok.json").is_file() and splits.eval is not None
    with pytest.raises(ValueError, match=r"train: '.*nothing\*\.txt' matches no file"):
        text_files_lm(str(tmp_path / "nothing*.txt"))


def test_a_local_hugging_face_dataset_is_the_same_pipeline(tmp_path):
    rows = [{"text": f"def f{i}(x):\n    return x + {i}\n" * 8, "id": i} for i in range(12)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    splits = hf_dataset_lm(str(path), seq_len=8, batch_size=2, vocab_size=280, eval_split=None)
    tokenizer = splits.train.tokenizer
    total = sum(len(tokenizer.encode(row["text"]).ids) + 1 for row in rows)
    assert len(splits.train._data_source) == (total - 1) // 8 and splits.eval is None
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:10]),
                          "validation": datasets.Dataset.from_list(rows[10:])}).save_to_disk(str(folder))
    assert hf_dataset_lm(str(folder), seq_len=8, batch_size=2, vocab_size=280).eval is not None
    with pytest.raises(ValueError, match=r"text_column='body': the dataset has columns \['text', 'id'\]"):
        hf_dataset_lm(str(path), text_column="body")
    with pytest.raises(ValueError, match="path=.*missing.jsonl.*no such local file"):
        hf_dataset_lm(str(tmp_path / "missing.jsonl"))


def test_close_stops_the_workers_and_keeps_the_position():
    packed = pack_documents([list(range(1, 400))], seq_len=4, eos_id=0)
    reference = batches(lm_loader(packed, 2, seed=3, worker_count=1), 6)
    loader = lm_loader(packed, 2, seed=3, worker_count=1)
    first = batches(loader, 3)
    inner = loader._live_iterator._iterator
    loader.close()
    assert loader._live_iterator is None and inner._closed
    rest = batches(loader, 3)
    loader.close()
    for got, want in zip(first + rest, reference):
        np.testing.assert_array_equal(got[0], want[0])


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="max_files"):
        stdlib_lm(max_files=1)
    with pytest.raises(ValueError, match="seq_len"):
        lm._lm_splits(["text"], [], seq_len=0, batch_size=1, vocab_size=300, seed=0, eval_batch_size=None,
                      worker_count=0, tokenizer_path=None)
