"""A pretrained folder's tokenizer.json used as it is by the LM data factories: its ids, its EOS, its vocabulary."""

import json

import datasets  # noqa: F401  (dev extra; hf_dataset_lm needs it)
import numpy as np
import pytest
from tokenizer_folders import CORPUS, save_folder
from transformers import AutoTokenizer

from composerjax.data import (
    TOKENIZER_FILE,
    hf_dataset_lm,
    load_pretrained_tokenizer,
    pack_documents,
    stdlib_lm,
    text_files_lm,
)
from composerjax.trainer import build_trainer
from composerjax.trainer.config import ConfigError


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_folder(tmp_path_factory.mktemp("pretrained"))


def corpus_files(tmp_path, count=6):
    paths = []
    for index in range(count):
        path = tmp_path / f"doc{index}.txt"
        path.write_text(" ".join(CORPUS[index: index + 5]))
        paths.append(path)
    return paths


def test_the_folder_gives_its_eos_vocabulary_and_chat_template(folder):
    reference = AutoTokenizer.from_pretrained(str(folder))
    pretrained = load_pretrained_tokenizer(folder)
    assert (pretrained.eos_token, pretrained.eos_id) == ("</s>", reference.eos_token_id)
    assert pretrained.vocab_size == len(reference)
    assert pretrained.special_tokens["bos_token"] == "<s>"
    assert pretrained.chat_template == reference.chat_template
    assert load_pretrained_tokenizer(folder / "tokenizer.json").eos_id == reference.eos_token_id


def test_text_files_lm_encodes_with_the_folder_tokenizer_as_transformers_does(folder, tmp_path, monkeypatch):
    monkeypatch.setattr("composerjax.data.tokenizer.train_tokenizer",
                        lambda *a, **k: pytest.fail("a pretrained tokenizer must not be trained"))
    paths = corpus_files(tmp_path)
    run_dir = tmp_path / "run"
    # vocab_size is far below the folder's: not used, the folder's vocabulary is.
    files = [str(path) for path in paths]
    splits = text_files_lm(files, eval=files, seq_len=16, batch_size=2, vocab_size=10, tokenizer=str(folder),
                           run_dir=str(run_dir))
    reference = AutoTokenizer.from_pretrained(str(folder))
    expected = pack_documents([reference(path.read_text())["input_ids"] for path in paths], 16,
                              reference.eos_token_id)
    assert expected[0, 0] == reference.bos_token_id  # the folder's post-processor put its BOS first
    batches = [tuple(np.asarray(part) for part in batch) for batch in splits.eval]  # the windows in order
    inputs, targets = (np.concatenate([batch[part] for batch in batches]) for part in (0, 1))
    np.testing.assert_array_equal(inputs[: len(expected)], expected[:, :-1])  # after them, the last batch's filling
    np.testing.assert_array_equal(targets[: len(expected)], expected[:, 1:])
    assert (targets[len(expected):] == -100).all()
    assert splits.train.vocab_size == len(reference) and splits.train.eos_id == reference.eos_token_id
    assert splits.train.tokenizer.get_vocab_size() == len(reference)
    assert (run_dir / TOKENIZER_FILE).read_bytes() == (folder / "tokenizer.json").read_bytes()


def test_stdlib_and_hf_dataset_lm_take_the_folder_too(folder, tmp_path):
    reference = AutoTokenizer.from_pretrained(str(folder))
    stdlib = stdlib_lm(seq_len=16, batch_size=2, max_files=3, tokenizer=str(folder))
    assert stdlib.train.eos_id == reference.eos_token_id and stdlib.train.vocab_size == len(reference)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in CORPUS))
    hf = hf_dataset_lm(str(data), seq_len=8, batch_size=2, tokenizer=str(folder))
    inputs, _ = next(iter(hf.train))
    assert int(np.asarray(inputs).max()) < len(reference)
    assert hf.train.eos_id == reference.eos_token_id


def test_the_recipe_checks_the_model_against_the_folder_vocabulary(folder, tmp_path):
    paths = corpus_files(tmp_path)
    recipe = {"model": {"name": "gpt2", "config": "gpt2-tiny", "vocab_size": 100},
              "data": {"name": "text_files_lm", "train": [str(path) for path in paths], "seq_len": 16,
                       "batch_size": 2, "tokenizer": str(folder)},
              "max_duration": "1ba", "run_dir": str(tmp_path / "run")}
    with pytest.raises(ConfigError, match=r"model.vocab_size: 100 is smaller than the data's tokenizer "
                                          rf"\({load_pretrained_tokenizer(folder).vocab_size} tokens\)"):
        build_trainer(recipe)


def test_a_folder_without_tokenizer_json_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=rf"tokenizer='{tmp_path}': the folder has no tokenizer.json"):
        load_pretrained_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"tokenizer='HuggingFaceTB/SmolLM-135M': no such local folder or file; .*"
                                         r"hub ids are never downloaded"):
        text_files_lm(str(corpus_files(tmp_path)[0]), tokenizer="HuggingFaceTB/SmolLM-135M")


def test_the_eos_comes_from_the_config_and_a_folder_without_one_is_refused(folder, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match=r"no eos_token in tokenizer_config.json or special_tokens_map.json, and "
                                         r"the vocabulary has no '<\|endoftext\|>'"):
        load_pretrained_tokenizer(tmp_path)
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert load_pretrained_tokenizer(tmp_path).eos_token == "<|im_end|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match=r"eos_token='<nope>' from the folder's config is not in tokenizer.json"):
        load_pretrained_tokenizer(tmp_path)
