"""Instruction data: JSONL prompt/response pairs or chat messages, one example a row, prompts out of the loss.

Each JSONL line is one example, either

* ``{"prompt": ..., "response": ...}`` (field names configurable): the tokens are
  ``encode(prompt) + encode(response, no special tokens) + [EOS]`` (the prompt with the
  tokenizer's own special tokens, so a Llama tokenizer puts its BOS first), and the response and
  its EOS are the targets, as llm-foundry's prompt/response fine-tuning does; or
* ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered through the tokenizer folder's
  chat template (:func:`~composerjax.data.pretrained_tokenizer.render_chat`) and encoded without
  added special tokens, as ``apply_chat_template(tokenize=True)`` does. Assistant turn ``i`` is
  the text between ``render(messages[:i], add_generation_prompt=True)`` and
  ``render(messages[:i + 1])`` (llm-foundry's rule: whatever the template closes the turn with,
  ``<|im_end|>\\n`` say, is trained too); its tokens are the targets, every other token (system,
  user, the template's headers) is not.

A target is ``IGNORE_INDEX`` (-100) unless the token it predicts belongs to the response. Rows are
``seq_len + 1`` tokens: longer examples are cut at the end, shorter ones padded with EOS whose
targets are ignored (attention is causal, so padding after the example never changes it). Batches
are ``(inputs, targets)`` of shape ``(batch_size, seq_len)``; examples left with no target after
the cut are dropped, with a warning saying how many.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from composerjax.data.array_loader import _check_int
from composerjax.data.factories import DataSplits
from composerjax.data.packing import IGNORE_INDEX

__all__ = ["InstructionExamples", "chat_tokens", "instruction_lm", "instruction_rows", "prompt_response_tokens"]


def prompt_response_tokens(tokenizer: Any, prompt: str, response: str, eos_id: int) -> tuple[list[int], list[bool]]:
    """The token ids of one prompt/response example and which of them are response (trained) tokens.

    Example:
        >>> from composerjax.data.tokenizer import train_tokenizer, eos_id
        >>> tok = train_tokenizer(["question answer"] * 10, vocab_size=270)
        >>> ids, response = prompt_response_tokens(tok, "question", " answer", eos_id(tok))
        >>> ids[-1] == eos_id(tok), response[-1], response[0]
        (True, True, False)
    """
    prompt_ids = list(tokenizer.encode(prompt).ids)
    response_ids = list(tokenizer.encode(response, add_special_tokens=False).ids) + [int(eos_id)]
    return prompt_ids + response_ids, [False] * len(prompt_ids) + [True] * len(response_ids)


def chat_tokens(tokenizer: Any, template: str, messages: Sequence[Mapping[str, Any]],
                special_tokens: Mapping[str, str] | None = None) -> tuple[list[int], list[bool]]:
    """The token ids of one rendered conversation and which of them belong to assistant turns.

    A token is an assistant token when its characters overlap an assistant turn's span (as
    ``transformers`` marks the tokens of a ``{% generation %}`` block).

    Raises:
        ValueError: a message without ``role``, or a template that renders a shorter conversation
            as something other than a prefix of the whole one (the turns cannot be located).

    Example:
        >>> from composerjax.data.tokenizer import train_tokenizer
        >>> tok = train_tokenizer(["user:\\nhi\\nassistant:\\nhello\\n"] * 10, vocab_size=270)
        >>> template = ("{% for m in messages %}{{ m.role }}:\\n{{ m.content }}\\n{% endfor %}"
        ...             "{% if add_generation_prompt %}assistant:\\n{% endif %}")
        >>> ids, assistant = chat_tokens(tok, template, [{"role": "user", "content": "hi"},
        ...                                              {"role": "assistant", "content": "hello"}])
        >>> tok.decode([i for i, a in zip(ids, assistant) if a])
        'hello\\n'
    """
    from composerjax.data.pretrained_tokenizer import render_chat

    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(f"messages[{index}]={message!r}: expected a mapping with 'role' and 'content'")
    whole = render_chat(template, messages, special_tokens=special_tokens)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_chat(template, messages[:index], add_generation_prompt=True, special_tokens=special_tokens)
        through = render_chat(template, messages[: index + 1], special_tokens=special_tokens)
        if not (whole.startswith(before) and whole.startswith(through) and len(before) <= len(through)):
            raise ValueError(f"messages[{index}] (assistant): the chat template renders the conversation up to this "
                             "turn as something other than a prefix of the whole conversation, so the turn cannot be "
                             "located; expected a template whose renderings of shorter conversations are prefixes")
        spans.append((len(before), len(through)))
    encoding = tokenizer.encode(whole, add_special_tokens=False)
    assistant = [any(start < end and token_end > start and token_start < end for start, end in spans)
                 for token_start, token_end in encoding.offsets]
    return list(encoding.ids), assistant


def instruction_rows(examples: Sequence[tuple[Sequence[int], Sequence[bool]]], seq_len: int, pad_id: int
                     ) -> tuple[np.ndarray, np.ndarray, int]:
    """``(inputs, targets, dropped)``: one ``seq_len`` row per example with a target left, targets -100 off-response.

    Row ``r``: ``inputs[r, t] = ids[t]`` and ``targets[r, t] = ids[t + 1]`` where token ``t + 1``
    is a response token, else ``IGNORE_INDEX``; ids past ``seq_len + 1`` are cut, missing ones are
    ``pad_id`` (ignored as targets).

    Example:
        >>> inputs, targets, dropped = instruction_rows([([1, 2, 3, 4], [False, False, True, True])], 5, pad_id=0)
        >>> inputs.tolist(), targets.tolist(), dropped
        ([[1, 2, 3, 4, 0]], [[-100, 3, 4, -100, -100]], 0)
    """
    seq_len = _check_int("seq_len", seq_len, 1)
    inputs, targets, dropped = [], [], 0
    for ids, response in examples:
        ids = np.asarray(list(ids)[: seq_len + 1], np.int64)
        trained = np.asarray(list(response)[: seq_len + 1], bool)
        if len(ids) < 2 or not trained[1:].any():
            dropped += 1
            continue
        row = np.full(seq_len + 1, pad_id, np.int64)
        row[: len(ids)] = ids
        mask = np.zeros(seq_len + 1, bool)
        mask[: len(trained)] = trained
        inputs.append(row[:-1])
        targets.append(np.where(mask[1:], row[1:], IGNORE_INDEX))
    shape = (len(inputs), seq_len)
    return (np.asarray(inputs, np.int32).reshape(shape), np.asarray(targets, np.int32).reshape(shape), dropped)


class InstructionExamples:
    """A grain random-access source of ``(inputs, targets)`` rows from :func:`instruction_rows`; picklable.

    Example:
        >>> source = InstructionExamples(np.array([[1, 2]]), np.array([[-100, 3]]))
        >>> len(source), [a.tolist() for a in source[0]]
        (1, [[1, 2], [-100, 3]])
    """

    def __init__(self, inputs: np.ndarray, targets: np.ndarray) -> None:
        inputs, targets = np.asarray(inputs, np.int32), np.asarray(targets, np.int32)
        if inputs.ndim != 2 or inputs.shape != targets.shape or not len(inputs):
            raise ValueError(f"inputs and targets must be non-empty 2-D arrays of one shape, got {inputs.shape} and "
                             f"{targets.shape}")
        self._inputs, self._targets = inputs, targets

    @property
    def seq_len(self) -> int:
        """Tokens per row."""
        return self._inputs.shape[1]

    def __len__(self) -> int:
        return len(self._inputs)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self._inputs[index], self._targets[index]

    def __repr__(self) -> str:
        # grain puts repr(data_source) in its iterator state: short and free of the data.
        return f"InstructionExamples(num_records={len(self)}, seq_len={self.seq_len})"


def instruction_lm(
    train: str | Sequence[str],
    eval: str | Sequence[str] | None = None,
    tokenizer: str | None = None,
    prompt_field: str = "prompt",
    response_field: str = "response",
    messages_field: str = "messages",
    seq_len: int = 128,
    batch_size: int = 16,
    vocab_size: int = 4096,
    seed: int = 0,
    eval_batch_size: int | None = None,
    worker_count: int = 0,
    tokenizer_path: str | None = None,
    run_dir: str | None = None,
) -> DataSplits:
    """Instruction-tuning batches from JSONL files: prompt tokens are masked out of the loss.

    Args:
        train: JSONL files or glob patterns of training examples (one JSON object a line).
        eval: JSONL files or glob patterns of evaluation examples, or None.
        tokenizer: A pretrained tokenizer folder used as it is (its EOS, its chat template); None
            trains a byte-level BPE on the prompts and responses as :func:`~composerjax.data.stdlib_lm` does
            (chat messages then have no template and are refused).
        prompt_field: The field holding the prompt.
        response_field: The field holding the response.
        messages_field: The field holding chat messages (``[{"role", "content"}, ...]``); a line with it
            is rendered through the chat template.
        seq_len: Tokens per row (longer examples are cut at the end).
        batch_size: Training rows per batch on each process.
        vocab_size: The trained tokenizer's size (not used with ``tokenizer``).
        seed: Seeds the shuffles.
        eval_batch_size: Rows per eval batch (defaults to ``batch_size``).
        worker_count: grain worker processes for the train loader.
        tokenizer_path: Where a trained tokenizer is saved and reloaded (a pretrained one is copied
            there); defaults to ``run_dir/tokenizer.json``.
        run_dir: The run folder (a recipe passes it).

    Raises:
        ValueError: a line that is not a JSON object with the prompt and response fields or the
            messages field (naming the file and line), chat messages without a chat template, or no
            example with a target left.

    Example: ``instruction_lm("sft/train.jsonl", tokenizer="checkpoints/SmolLM-135M", seq_len=512)``.
    """
    from composerjax.data.grain_loader import GrainLoader
    from composerjax.data.lm import _describe, _expand, _tokenizer_and_eos, _tokenizer_path

    seq_len = _check_int("seq_len", seq_len, 1)
    batch_size = _check_int("batch_size", batch_size, 1)
    eval_batch_size = batch_size if eval_batch_size is None else _check_int("eval_batch_size", eval_batch_size, 1)
    worker_count = _check_int("worker_count", worker_count, 0)
    fields = (prompt_field, response_field, messages_field)
    train_records = _read_jsonl(_expand("train", train), fields)
    eval_records = _read_jsonl(_expand("eval", eval), fields) if eval is not None else []
    if not train_records:
        raise ValueError(f"train: no example in {train!r}; expected JSONL lines")
    texts = [text for record in train_records if record.get(messages_field) is None
             for text in (record[prompt_field], record[response_field])]
    path = _tokenizer_path(tokenizer_path, run_dir)
    encoder, eos = _tokenizer_and_eos(tokenizer, path, texts or ["\n"], vocab_size)
    template, special = None, {}
    if tokenizer is not None:
        from composerjax.data.pretrained_tokenizer import load_pretrained_tokenizer

        pretrained = load_pretrained_tokenizer(tokenizer)
        template, special = pretrained.chat_template, dict(pretrained.special_tokens)

    def source(records: list[dict[str, Any]], split: str) -> InstructionExamples | None:
        examples = [_tokens(encoder, record, fields, eos, template, special) for record in records]
        inputs, targets, dropped = instruction_rows(examples, seq_len, eos)
        if dropped:
            warnings.warn(f"instruction_lm: {dropped} of {len(records)} {split} examples have no response token "
                          f"within seq_len={seq_len} and are left out", RuntimeWarning, stacklevel=3)
        return InstructionExamples(inputs, targets) if len(inputs) else None

    train_source = source(train_records, "train")
    if train_source is None or len(train_source) < batch_size:
        count = 0 if train_source is None else len(train_source)
        raise ValueError(f"batch_size={batch_size}: the train split has {count} examples with a response token "
                         f"within seq_len={seq_len}; expected at least batch_size")
    train_loader = GrainLoader(train_source, batch_size, shuffle=True, seed=seed, worker_count=worker_count)
    _describe(train_loader, encoder, eos, seq_len)
    evaluation = None
    eval_source = source(eval_records, "eval") if eval_records else None
    if eval_source is not None:
        # The last batch is filled with ignored rows: one shape, one compiled eval step (as lm_loader's).
        evaluation = GrainLoader(eval_source, min(eval_batch_size, len(eval_source)), shuffle=False, seed=seed,
                                 drop_remainder=False, pad_remainder=(eos, IGNORE_INDEX))
    return DataSplits(train=train_loader, eval=evaluation)


def _tokens(encoder: Any, record: dict[str, Any], fields: tuple[str, str, str], eos: int, template: str | None,
            special: Mapping[str, str]) -> tuple[list[int], list[bool]]:
    prompt_field, response_field, messages_field = fields
    messages = record.get(messages_field)
    if messages is None:
        return prompt_response_tokens(encoder, record[prompt_field], record[response_field], eos)
    if template is None:
        raise ValueError(f"{messages_field}: chat messages need a chat template; pass tokenizer=DIR whose folder "
                         "has one (chat_template.jinja, or chat_template in tokenizer_config.json), or write the "
                         f"examples as {prompt_field!r}/{response_field!r} pairs")
    return chat_tokens(encoder, template, messages, special)


def _read_jsonl(files: Sequence[str | os.PathLike], fields: tuple[str, str, str]) -> list[dict[str, Any]]:
    prompt_field, response_field, messages_field = fields
    records = []
    for file in files:
        with open(file, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                where = f"{os.fspath(file)}, line {number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{where}: not JSON ({error.msg}); expected one JSON object a line") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{where}: {type(record).__name__}, expected a JSON object")
                messages = record.get(messages_field)
                if messages is not None:
                    if not isinstance(messages, list) or not messages:
                        raise ValueError(f"{where}: {messages_field}={messages!r}, expected a non-empty list of "
                                         "{'role', 'content'} objects")
                elif not all(isinstance(record.get(name), str) for name in (prompt_field, response_field)):
                    raise ValueError(f"{where}: fields {sorted(record)}; expected string fields {prompt_field!r} and "
                                     f"{response_field!r}, or a {messages_field!r} list (the names are the "
                                     "prompt_field, response_field and messages_field arguments)")
                records.append(record)
    return records
