"""Instruction data: prompt/response pairs and chat messages, prompt tokens masked out of the loss, token by token."""

import json
import warnings

import numpy as np
import pytest
from tokenizer_folders import CHAT_TEMPLATE, save_folder
from transformers import AutoTokenizer

from composerjax import registry
from composerjax.data import IGNORE_INDEX, instruction_lm

SEQ_LEN = 40
PAIRS = [{"prompt": "What is two plus two?", "response": " It is four."},
         {"prompt": "Translate 'chat' to English:", "response": " cat"},
         {"prompt": "def add(a, b):\n", "response": "    return a + b\n"}]
CHATS = [
    [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "It is four."}],
    [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "hello world"}, {"role": "user", "content": "how are you today?"},
     {"role": "assistant", "content": "The quick brown fox."}],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_folder(tmp_path_factory.mktemp("pretrained"))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def expected_row(ids, trained, pad):
    """The row computed independently: ids cut to SEQ_LEN + 1, padded; a target counts where it is trained."""
    ids, trained = list(ids)[: SEQ_LEN + 1], list(trained)[: SEQ_LEN + 1]
    ids += [pad] * (SEQ_LEN + 1 - len(ids))
    trained += [False] * (SEQ_LEN + 1 - len(trained))
    targets = [token if keep else IGNORE_INDEX for token, keep in zip(ids[1:], trained[1:])]
    return ids[:-1], targets


def rows(loader):
    """Every row of an unshuffled loader, the filling of its last batch (rows with no target at all) left out."""
    batches = [tuple(np.asarray(part) for part in batch) for batch in loader]
    inputs, targets = (np.concatenate([batch[part] for batch in batches]) for part in (0, 1))
    real = (targets != IGNORE_INDEX).any(axis=1)
    assert real[: real.sum()].all()  # filling only at the end
    return inputs[real].tolist(), targets[real].tolist()


def test_prompt_tokens_are_masked_token_by_token(folder, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    splits = instruction_lm(data, eval=data, tokenizer=str(folder), seq_len=SEQ_LEN, batch_size=2)
    reference = AutoTokenizer.from_pretrained(str(folder))
    eos = reference.eos_token_id
    inputs, targets = rows(splits.eval)
    for index, pair in enumerate(PAIRS):
        prompt = reference(pair["prompt"])["input_ids"]
        response = reference(pair["response"], add_special_tokens=False)["input_ids"] + [eos]
        assert prompt[0] == reference.bos_token_id
        want_inputs, want_targets = expected_row(prompt + response, [False] * len(prompt) + [True] * len(response),
                                                 eos)
        assert inputs[index] == want_inputs
        assert targets[index] == want_targets
        assert sum(target != IGNORE_INDEX for target in targets[index]) == len(response)


def test_chat_messages_train_only_the_assistant_tokens_as_transformers_marks_them(folder, tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": chat} for chat in CHATS])
    splits = instruction_lm(data, eval=data, tokenizer=str(folder), seq_len=SEQ_LEN, batch_size=1)
    reference = AutoTokenizer.from_pretrained(str(folder))
    inputs, targets = rows(splits.eval)
    for index, chat in enumerate(CHATS):
        rendered = reference.apply_chat_template(chat, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
        assert any(rendered["assistant_masks"]) and not all(rendered["assistant_masks"])
        want_inputs, want_targets = expected_row(rendered["input_ids"], map(bool, rendered["assistant_masks"]),
                                                 reference.eos_token_id)
        assert inputs[index] == want_inputs
        assert targets[index] == want_targets


def test_a_template_in_tokenizer_config_json_is_used_and_field_names_are_configurable(tmp_path):
    folder = save_folder(tmp_path / "older", chat_template=None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    data = write_jsonl(tmp_path / "chats.jsonl", [{"conversation": chat} for chat in CHATS]
                       + [{"question": pair["prompt"], "answer": pair["response"]} for pair in PAIRS])
    splits = instruction_lm(data, eval=data, tokenizer=str(folder), seq_len=SEQ_LEN, batch_size=1,
                            messages_field="conversation", prompt_field="question", response_field="answer")
    reference = AutoTokenizer.from_pretrained(str(folder))
    inputs, targets = rows(splits.eval)
    rendered = reference.apply_chat_template(CHATS[0], chat_template=CHAT_TEMPLATE, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
    assert (inputs[0], targets[0]) == expected_row(rendered["input_ids"], map(bool, rendered["assistant_masks"]),
                                                   reference.eos_token_id)
    assert len(inputs) == len(CHATS) + len(PAIRS)


def test_long_examples_are_cut_and_those_left_without_a_target_dropped(folder, tmp_path):
    long_prompt = "hello world " * 40
    data = write_jsonl(tmp_path / "long.jsonl", PAIRS + [{"prompt": long_prompt, "response": " ok"}])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        splits = instruction_lm(data, eval=data, tokenizer=str(folder), seq_len=16, batch_size=2)
    assert [str(warning.message) for warning in caught if warning.category is RuntimeWarning] == [
        f"instruction_lm: 1 of 4 {split} examples have no response token within seq_len=16 and are left out"
        for split in ("train", "eval")]
    inputs, targets = rows(splits.eval)
    assert len(inputs) == 3 and all(len(row) == 16 for row in inputs)
    assert len(splits.train) == 1  # 3 examples left, batches of 2


def test_a_trained_tokenizer_serves_prompt_response_pairs_without_a_folder(tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 4)
    splits = instruction_lm(data, seq_len=SEQ_LEN, batch_size=4, vocab_size=300, run_dir=str(tmp_path / "run"))
    inputs, targets = (np.asarray(part) for part in next(iter(splits.train)))
    assert inputs.shape == targets.shape == (4, SEQ_LEN)
    kept = targets != IGNORE_INDEX
    np.testing.assert_array_equal(targets[:, :-1][kept[:, :-1]], inputs[:, 1:][kept[:, :-1]])
    assert (tmp_path / "run" / "tokenizer.json").is_file()
    assert splits.train.vocab_size <= 300


def test_bad_lines_and_chat_without_a_template_are_refused(folder, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [PAIRS[0], {"prompt": "x", "text": "y"}])
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: fields \['prompt', 'text'\]; expected string fields "
                                         r"'prompt' and 'response', or a 'messages' list"):
        instruction_lm(bad, tokenizer=str(folder))
    (tmp_path / "broken.jsonl").write_text('{"prompt": "x", "response": "y"}\n{not json\n')
    with pytest.raises(ValueError, match=r"broken.jsonl, line 2: not JSON"):
        instruction_lm(str(tmp_path / "broken.jsonl"), tokenizer=str(folder))
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": chat} for chat in CHATS])
    with pytest.raises(ValueError, match=r"messages: chat messages need a chat template; pass tokenizer=DIR"):
        instruction_lm(chats, tokenizer=str(save_folder(tmp_path / "plain", chat_template=None)), batch_size=1)


def test_instruction_lm_is_a_registered_data_factory():
    assert registry.resolve("data", "instruction_lm") is instruction_lm
