"""Two real processes (``composerjax launch``) read one epoch of stdlib_lm: one tokenizer, every window once.

Each process writes the batches it got (``shard_script.py``); this test rebuilds the single-process
pipeline from public pieces and checks that the two shares are disjoint, that together with the
remainder the sharding and batching drop (computed from the source's length, the process count and
the batch size) they are every packed window, in the order grain's global shuffle gives, and that
the windows are the train documents' token stream with only the documented tail left out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from composerjax.data.lm import TOKENIZER_FILE, stdlib_lm
from composerjax.data.packing import dropped_tokens, pack_documents, token_stream
from composerjax.data.stdlib_corpus import read_documents, split_files, stdlib_files
from composerjax.data.tokenizer import encode_documents, eos_id, train_tokenizer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from shard_script import SETTINGS  # noqa: E402

PROCESSES = 2


def launch(out: Path, run_dir: Path) -> None:
    command = [sys.executable, "-m", "composerjax", "launch", "-n", str(PROCESSES), "--devices-per-process", "1",
               str(HERE / "shard_script.py"), str(out), str(run_dir)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def windows_of(out: Path, rank: int) -> np.ndarray:
    """The process's sequences as packed windows ``(n, seq_len + 1)``: the inputs plus the last target."""
    with np.load(out / f"batches-{rank}.npz") as data:
        inputs, targets = data["inputs"], data["targets"]
    assert inputs.dtype == targets.dtype == np.int32
    assert inputs.shape == targets.shape and inputs.shape[1:] == (SETTINGS["batch_size"], SETTINGS["seq_len"])
    np.testing.assert_array_equal(inputs[..., 1:], targets[..., :-1])  # next-token targets
    flat_inputs = inputs.reshape(-1, SETTINGS["seq_len"])
    return np.concatenate([flat_inputs, targets.reshape(-1, SETTINGS["seq_len"])[:, -1:]], axis=1)


def test_two_processes_share_one_tokenizer_and_cover_every_window_once(tmp_path):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    launch(out, run_dir)
    infos = [json.loads((out / f"info-{rank}.json").read_text()) for rank in range(PROCESSES)]
    assert [(info["process_index"], info["process_count"], info["devices"]) for info in infos] == [(0, 2, 2), (1, 2, 2)]

    # One tokenizer: process 0 trained and saved it; process 1 received the same JSON; it is what a
    # single process trains on the same train files (training is deterministic).
    texts = [text for text in read_documents(split_files(stdlib_files()[: SETTINGS["max_files"]],
                                                         SETTINGS["validation_fraction"], SETTINGS["seed"])[0])
             if text]
    used = [(out / f"tokenizer-{rank}.json").read_text() for rank in range(PROCESSES)]
    assert used[0] == used[1]
    assert json.loads((run_dir / TOKENIZER_FILE).read_text()) == json.loads(used[0])
    tokenizer = train_tokenizer(texts, vocab_size=SETTINGS["vocab_size"])
    assert json.loads(tokenizer.to_str()) == json.loads(used[0])

    # The single-process pipeline, and the same windows rebuilt from public pieces.
    seq_len, batch_size = SETTINGS["seq_len"], SETTINGS["batch_size"]
    single = stdlib_lm(**SETTINGS, tokenizer_path=str(run_dir / TOKENIZER_FILE)).train
    encoded = encode_documents(tokenizer, texts)
    packed = pack_documents(encoded, seq_len, eos_id(tokenizer))
    np.testing.assert_array_equal(single._data_source.packed, packed)
    records = len(packed)
    assert infos[0]["records"] == infos[1]["records"] == records
    rows = {row.tobytes(): index for index, row in enumerate(packed)}
    assert len(rows) == records  # every window is distinct, so a window's content names its index

    # Each process: records // P records of the epoch, in whole batches of batch_size.
    per_process = records // PROCESSES
    batches = per_process // batch_size
    dropped = records - PROCESSES * batches * batch_size
    assert dropped == records % PROCESSES + PROCESSES * (per_process % batch_size)
    assert infos[0]["batches"] == infos[1]["batches"] == batches > 10
    assert len(single) == records // batch_size  # one process alone reads them all
    seen = [[rows[row.tobytes()] for row in windows_of(out, rank)] for rank in range(PROCESSES)]
    assert [len(indices) for indices in seen] == [batches * batch_size] * PROCESSES
    assert all(len(set(indices)) == len(indices) for indices in seen)  # no window twice in a process
    assert not set(seen[0]) & set(seen[1])  # nor in both
    left_out = sorted(set(range(records)) - set(seen[0]) - set(seen[1]))
    assert len(left_out) == dropped  # the union plus the documented remainder is every window
    # Exactly grain's global shuffle of epoch 0, process p taking positions p, p + P, ... of it.
    order = [single._sampler(0, SETTINGS["seed"])[position].record_key for position in range(records)]
    for rank in range(PROCESSES):
        assert seen[rank] == order[rank::PROCESSES][: batches * batch_size]

    # The windows are the token stream: inputs tile it; only the last dropped_tokens tokens are never a target.
    stream = token_stream(encoded, eos_id(tokenizer))
    assert len(stream) == sum(len(ids) + 1 for ids in encoded)
    tail = dropped_tokens(len(stream), seq_len)
    assert records * seq_len + 1 + tail == len(stream) and 0 <= tail < seq_len
    positions = np.concatenate([np.arange(seq_len) + index * seq_len for index in [*seen[0], *seen[1], *left_out]])
    np.testing.assert_array_equal(np.sort(positions), np.arange(records * seq_len))  # each position once
    for rank in range(PROCESSES):
        starts = np.asarray(seen[rank]) * seq_len
        np.testing.assert_array_equal(windows_of(out, rank), stream[starts[:, None] + np.arange(seq_len + 1)])
