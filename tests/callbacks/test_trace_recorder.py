"""TraceRecorder: traces.jsonl and a Chrome/Perfetto timeline of a run with traced and host algorithms."""

import json
import re
import time
from pathlib import Path

import jax.numpy as jnp
import optax
import pytest

from composerjax import Algorithm, ArrayLoader, Event, Trainer, registry
from composerjax.callbacks.trace_recorder import TraceRecorder


class AddOne(Algorithm):
    """Traced at BEFORE_LOSS and AFTER_LOSS (AFTER_ events run in reverse pass order)."""

    def match(self, event, state):
        return event in (Event.BEFORE_LOSS, Event.AFTER_LOSS)

    def apply(self, event, state, logger):
        state.step_metrics[f"{type(self).__name__}/{event.value}"] = jnp.float32(1)


class AddTwo(AddOne):
    pass


class HostSleep(Algorithm):
    """A host algorithm that takes a measurable 3 ms after each batch is loaded."""

    def match(self, event, state):
        return event == Event.AFTER_DATALOADER

    def apply(self, event, state, logger):
        time.sleep(0.003)


STEP_PLAN = ["AddOne/BEFORE_LOSS", "AddTwo/BEFORE_LOSS", "AddTwo/AFTER_LOSS", "AddOne/AFTER_LOSS"]


def fit(tmp_path, arrays, make_model, recorder, attach=True, as_logger=True, **kwargs):
    x, y = arrays
    trainer = Trainer(make_model(), ArrayLoader((x, y), batch_size=16), max_duration="2ep",
                      optimizers=optax.sgd(0.1), algorithms=[AddOne(), AddTwo(), HostSleep()],
                      loggers=[recorder] if as_logger else [], callbacks=[] if as_logger else [recorder],
                      progress_bar=False, run_summary=False, run_dir=str(tmp_path), **kwargs)
    if attach:
        recorder.attach(trainer.engine)
    trainer.fit()
    return trainer


def read_traces(folder):
    with open(folder / "traces.jsonl") as file:
        return [json.loads(line) for line in file]


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory, classification_arrays, make_tiny_classifier):
    folder = tmp_path_factory.mktemp("run")
    x, y = classification_arrays
    trainer = fit(folder, classification_arrays, make_tiny_classifier, TraceRecorder(),
                  eval_dataloader=ArrayLoader((x[:40], y[:40]), batch_size=16, shuffle=False, drop_last=False))
    trainer.close()
    with open(folder / "trace.json") as file:
        timeline = json.load(file)
    return trainer, folder, timeline


def spans(timeline, name=None, category=None):
    return [e for e in timeline["traceEvents"] if e["ph"] == "X" and (name is None or e["name"] == name)
            and (category is None or e["cat"] == category)]


def inside(inner, outer, slack_us=1.0):
    return outer["ts"] - slack_us <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + slack_us


def test_traces_jsonl_holds_every_host_and_traced_algorithm_run_once_in_order(recorded_run):
    _, folder, timeline = recorded_run
    everything = read_traces(folder)
    # The trainer's built-in evaluation is a plugin too: one trace per evaluation, with its duration and span.
    evaluations = [t for t in everything if t["name"] == "EvalRunner"]
    assert [(t["event"], t["batch"]) for t in evaluations] == [("epoch_end", 4), ("epoch_end", 8)]
    assert all(t["duration_s"] > 0 for t in evaluations)
    assert len(spans(timeline, "EvalRunner/EPOCH_END", category="callback")) == 2
    traces = [t for t in everything if t["name"] != "EvalRunner"]
    assert len(traces) == 8 * 5
    assert {t["kind"] for t in evaluations} == {"callback"} and {t["kind"] for t in traces} == {"algorithm"}
    first_batch = [(t["name"], t["event"], t["order"], t["traced"]) for t in traces if t["batch"] == 0]
    assert first_batch == [("HostSleep", "after_dataloader", 0, False), ("AddOne", "before_loss", 0, True),
                           ("AddTwo", "before_loss", 1, True), ("AddTwo", "after_loss", 0, True),
                           ("AddOne", "after_loss", 1, True)]
    host = [t for t in traces if not t["traced"]]
    assert [t["batch"] for t in host] == list(range(8))
    assert all(t["duration_s"] >= 0.003 for t in host)
    assert all(t["duration_s"] is None for t in traces if t["traced"])
    times = [t["time_s"] for t in everything]
    assert times == sorted(times)


def test_timeline_has_a_train_step_span_per_batch_listing_its_traced_algorithms(recorded_run):
    _, _, timeline = recorded_run
    steps = spans(timeline, "train_step")
    assert [s["args"]["batch"] for s in steps] == list(range(8))
    assert all(s["args"]["algorithms"] == STEP_PLAN for s in steps)
    assert all(s["dur"] > 0 and s["tid"] == 1 for s in steps)
    assert [s["args"]["epoch"] for s in spans(timeline, "epoch")] == [0, 1]
    (fit_span,) = spans(timeline, "fit")
    assert all(inside(s, fit_span) for s in steps)
    assert len(spans(timeline, "eval")) == 2 and len(spans(timeline, "eval_step")) == 2 * 3
    names = {e["args"]["name"] for e in timeline["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"training loop", "host algorithms", "compiles"}


def test_each_compiled_step_is_marked_inside_the_step_that_compiled_it(recorded_run):
    trainer, _, timeline = recorded_run
    compiled = trainer.state.compiled_steps
    compiles = spans(timeline, category="compile")
    # train once, eval twice (full batches, then the last batch of 8)
    assert [c["name"] for c in compiles] == [f"compile {record.kind} step" for record in compiled]
    assert [c["name"] for c in compiles] == ["compile train step", "compile eval step", "compile eval step"]
    step_spans = spans(timeline, "train_step") + spans(timeline, "eval_step")
    for marker, record in zip(compiles, compiled):
        assert marker["dur"] == pytest.approx(record.compile_seconds * 1e6, abs=1e-3)
        assert marker["args"]["algorithms"] == list(record.algorithms) and marker["tid"] == 3
        assert any(marker["ts"] == step["ts"] and inside(marker, step) for step in step_spans)
    assert compiles[0]["ts"] == spans(timeline, "train_step")[0]["ts"]


def test_host_algorithms_are_spans_inside_the_dataloader_wait(recorded_run):
    _, _, timeline = recorded_run
    algorithm_spans = spans(timeline, "HostSleep/AFTER_DATALOADER")
    loads = spans(timeline, "dataloader")
    assert [a["args"]["batch"] for a in algorithm_spans] == list(range(8))
    assert all(a["dur"] >= 3000 and a["tid"] == 2 for a in algorithm_spans)
    assert all(any(inside(a, load) for load in loads) for a in algorithm_spans)


def test_the_trainer_attaches_the_engine_so_traced_runs_are_recorded_too(tmp_path, classification_arrays,
                                                                          make_tiny_classifier):
    fit(tmp_path, classification_arrays, make_tiny_classifier, TraceRecorder(), attach=False)
    traces = read_traces(tmp_path)
    assert [(t["name"], t["batch"]) for t in traces if not t["traced"]] == [("HostSleep", b) for b in range(8)]
    assert len(traces) == 40 and sum(t["traced"] for t in traces) == 32  # recorded once each


def test_as_a_callback_with_attach_into_a_given_folder(tmp_path, classification_arrays, make_tiny_classifier):
    recorder = TraceRecorder(path=tmp_path / "traces")
    fit(tmp_path / "run", classification_arrays, make_tiny_classifier, recorder, as_logger=False)
    traces = read_traces(tmp_path / "traces")
    assert len(traces) == 40 and sum(t["traced"] for t in traces) == 32
    assert not (tmp_path / "run" / "traces.jsonl").exists()


def test_invalid_arguments_name_the_argument():
    with pytest.raises(ValueError, match="path=3"):
        TraceRecorder(path=3)
    with pytest.raises(ValueError, match="attach"):
        TraceRecorder().attach(object())


def test_the_docs_call_it_a_callback_as_the_registry_does():
    """One answer everywhere: a callback (registered under callbacks, passed in callbacks=), never 'in the loggers'."""
    assert registry.callbacks.get("trace_recorder") is TraceRecorder
    root = Path(__file__).resolve().parents[2]
    mentions = []
    for page in [*sorted((root / "docs").glob("*.md")), root / "README.md"]:
        lines = [line for line in page.read_text().splitlines() if not line.startswith("#")]  # no headings
        text = " ".join(" ".join(lines).split())
        for sentence in re.split(r"(?<=[.;])\s|\|", text):  # sentences, and table cells
            if "TraceRecorder" in sentence or "trace_recorder" in sentence:
                mentions.append(sentence)
                assert not re.search(r"\bloggers\b", sentence), f"{page.name}: {sentence}"
    assert sum("callback" in sentence for sentence in mentions) >= 4
    docstring = " ".join(TraceRecorder.__doc__.split())
    assert docstring.startswith("A callback that records") and "loggers=" not in docstring
