"""continue_jsonl: a resumed run's JSON-lines file keeps batches up to the checkpoint's, then one marker; atomically."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from composerjax.loggers import jsonl_resume
from composerjax.loggers.jsonl_resume import continue_jsonl, is_resume_marker, kept_on_resume


def read_fresh(path) -> str:
    """The file's text as another process reads it."""
    return subprocess.run([sys.executable, "-c", "import sys; sys.stdout.write(open(sys.argv[1]).read())", str(path)],
                          capture_output=True, text=True, check=True).stdout


def trace(event: str, batch: int, traced: bool = False) -> dict:
    return {"name": "A", "event": event, "batch": batch, "traced": traced}


@pytest.mark.parametrize(("record", "kept"), [
    ({"step": 40, "loss/train/total": 0.5}, True),
    ({"step": 41, "loss/train/total": 0.5}, False),
    ({"hyperparameters": {"lr": 0.1}}, True),
    ({"step": None, "metric": 1.0}, True),
    (trace("batch_checkpoint", 40), True),  # after batch 40's step
    (trace("eval_end", 40), True),
    (trace("batch_start", 40), False),  # before batch 41's step: counts 40 batches
    (trace("after_dataloader", 40), False),
    (trace("epoch_start", 40), False),
    (trace("before_loss", 40, traced=True), False),  # traced into batch 41's step
    (trace("before_loss", 39, traced=True), True),
    (trace("batch_end", 41), False),
    ({"step": 40, "traces": [trace("batch_start", 40)]}, False),  # FileLogger(traces=True) rows
    ({"step": 40, "traces": [trace("batch_end", 40)]}, True),
    ({"resumed_from": "/c/ep0-ba20", "batch": 20}, True),
    ({"resumed_from": "/c/ep0-ba60", "batch": 60}, False),
])
def test_which_records_a_resume_from_batch_40_keeps(record, kept):
    assert kept_on_resume(record, 40) is kept


def test_the_file_keeps_earlier_records_in_order_then_one_marker(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps(record) for record in (
        {"hyperparameters": {"lr": 0.1}}, {"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0},
        {"resumed_from": "/c/ep0-ba1", "batch": 1}, {"step": 2, "loss": 2.5}, {"step": 3, "loss": 1.0})]
    path.write_text("\n".join(lines[:4]) + "\nnot json\n" + "\n".join(lines[4:]) + '\n{"step": 4, "lo')
    assert continue_jsonl(path, "/c/ep0-ba2", 2) == 2  # step 3 and the line cut short
    kept = [lines[0], lines[1], lines[2], lines[3], "not json", lines[4],
            json.dumps({"resumed_from": "/c/ep0-ba2", "batch": 2})]
    assert read_fresh(path) == "\n".join(kept) + "\n"
    assert [name for name in os.listdir(tmp_path)] == ["metrics.jsonl"]  # no temporary file left


def test_a_missing_file_gets_the_marker_alone(tmp_path):
    path = tmp_path / "run" / "traces.jsonl"
    assert continue_jsonl(path, "s3://bucket/ckpt/ep1-ba8", 8) == 0
    assert read_fresh(path) == '{"resumed_from": "s3://bucket/ckpt/ep1-ba8", "batch": 8}\n'
    assert is_resume_marker(json.loads(read_fresh(path)))


def test_a_failed_rewrite_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')

    def crash(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(jsonl_resume.os, "replace", crash)
    with pytest.raises(OSError, match="No space left"):
        continue_jsonl(path, "/c/ep0-ba1", 1)
    assert read_fresh(path) == '{"step": 1}\n{"step": 2}\n'
    assert os.listdir(tmp_path) == ["metrics.jsonl"]
