"""The ``composerjax`` command line: traces tables and diffs, plots, and errors for bad input."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import optax
import pytest

from composerjax import Algorithm, ArrayLoader, Event, Trainer
from composerjax.callbacks.trace_recorder import TraceRecorder
from composerjax.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Smooth(Algorithm):
    """Traced at BEFORE_LOSS and AFTER_LOSS."""

    def match(self, event, state):
        return event in (Event.BEFORE_LOSS, Event.AFTER_LOSS)

    def apply(self, event, state, logger):
        state.step_metrics[f"{type(self).__name__}/{event.value}"] = jnp.float32(0)


class Sharpen(Smooth):
    pass


class Announce(Algorithm):
    """A host algorithm at every EPOCH_START."""

    def match(self, event, state):
        return event == Event.EPOCH_START

    def apply(self, event, state, logger):
        return 7


def recipe_run(folder, arrays, make_model, algorithms):
    x, y = arrays
    recorder = TraceRecorder()
    trainer = Trainer(make_model(), ArrayLoader((x, y), batch_size=16), max_duration="2ep", optimizers=optax.sgd(0.1),
                      algorithms=algorithms, loggers=[recorder], progress_bar=False, run_summary=False,
                      run_dir=str(folder))
    recorder.attach(trainer.engine)
    trainer.fit()
    return str(folder)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, classification_arrays, make_tiny_classifier):
    root = tmp_path_factory.mktemp("runs")
    full = recipe_run(root / "full", classification_arrays, make_tiny_classifier, [Smooth(), Sharpen(), Announce()])
    lean = recipe_run(root / "lean", classification_arrays, make_tiny_classifier, [Smooth(), Announce()])
    return full, lean


def sections(output: str) -> dict[str, list[list[str]]]:
    """The traces table: ``{EVENT: [[order, algorithm, runs, kind, batches, host time], ...]}``."""
    tables: dict[str, list[list[str]]] = {}
    current = None
    for line in output.splitlines():
        if line and not line.startswith(" ") and line.isupper():
            current = tables[line] = []
        elif current is not None and line.startswith("  ") and not line.strip().startswith("order"):
            current.append(line.split(maxsplit=5))
        elif not line:
            current = None
    return tables


def test_traces_names_every_algorithm_at_its_events_in_pass_order(runs, capsys):
    assert main(["traces", runs[0]]) == 0
    output = capsys.readouterr().out
    assert output.splitlines()[0] == f"traces of {runs[0]}: 34 algorithm runs at 3 events, batches 0-7"
    tables = sections(output)
    assert list(tables) == ["EPOCH_START", "BEFORE_LOSS", "AFTER_LOSS"]  # lifecycle order
    assert [row[:5] for row in tables["BEFORE_LOSS"]] == [["0", "Smooth", "8", "traced", "0-7"],
                                                          ["1", "Sharpen", "8", "traced", "0-7"]]
    assert [row[:5] for row in tables["AFTER_LOSS"]] == [["0", "Sharpen", "8", "traced", "0-7"],
                                                         ["1", "Smooth", "8", "traced", "0-7"]]
    (announce,) = tables["EPOCH_START"]
    assert announce[:5] == ["0", "Announce", "2", "host", "0-4"] and announce[5].endswith((" us", " ms"))
    assert [row[5] for row in tables["BEFORE_LOSS"]] == ["-", "-"]
    assert output.rstrip().splitlines()[-1].startswith("total host time in algorithms: ")


def test_traces_diff_names_the_algorithm_only_one_run_has(runs, capsys):
    full, lean = runs
    assert main(["traces", full, "--diff", lean]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"differences between {full} (A) and {lean} (B):",
        "  BEFORE_LOSS: only in A: Sharpen",
        "  AFTER_LOSS: only in A: Sharpen",
    ]
    assert main(["traces", lean, "--diff", os.path.join(lean, "traces.jsonl")]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "  none: the same algorithms ran at the same events, in the same order, as often")


def test_traces_diff_reports_order_and_count_differences(tmp_path, capsys):
    def write(folder, rows):
        folder.mkdir()
        with open(folder / "traces.jsonl", "w") as file:
            for name, order, batch in rows:
                file.write(json.dumps({"name": name, "event": "after_dataloader", "order": order, "run": True,
                                       "traced": False, "batch": batch, "duration_s": 0.001}) + "\n")

    write(tmp_path / "a", [("X", 0, 0), ("Y", 1, 0), ("X", 0, 1), ("Y", 1, 1)])
    write(tmp_path / "b", [("Y", 0, 0), ("X", 1, 0)])
    assert main(["traces", str(tmp_path / "a"), "--diff", str(tmp_path / "b")]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "  AFTER_DATALOADER: order differs: A runs X, Y; B runs Y, X",
        "  AFTER_DATALOADER: X ran 2 times in A, 1 in B",
        "  AFTER_DATALOADER: Y ran 2 times in A, 1 in B",
    ]


def write_metrics(folder):
    folder.mkdir(parents=True, exist_ok=True)
    lines = [{"hyperparameters": {"run_summary/parameters": 10}}]
    for step in range(1, 6):
        lines.append({"step": step, "loss/train/total": 1.0 / step, "lr-sgd/group0": 0.1 * step,
                      "throughput/samples_per_sec": 100.0 + step})
    lines.append({"step": 5, "metrics/eval/accuracy": 0.9})
    with open(folder / "metrics.jsonl", "w") as file:
        file.writelines(json.dumps(line) + "\n" for line in lines)


def test_plot_writes_a_png_per_chart(tmp_path, capsys):
    write_metrics(tmp_path / "run")
    assert main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "charts")]) == 0
    written = sorted(os.listdir(tmp_path / "charts"))
    assert written == ["learning_rate.png", "loss.png", "metrics.png", "throughput.png"]
    for name in written:
        with open(tmp_path / "charts" / name, "rb") as file:
            assert file.read(8) == PNG_MAGIC
    assert f"wrote {tmp_path / 'charts' / 'loss.png'} (1 series)" in capsys.readouterr().out


def test_plot_defaults_to_a_plots_folder_and_skips_empty_charts(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss/train/total": 0.5}) + "\n")
    assert main(["plot", str(folder)]) == 0
    assert os.listdir(folder / "plots") == ["loss.png"]


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    write_metrics(tmp_path / "run")
    for module in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(tmp_path / "run")]) == 1
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "run" / "plots").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["traces", "{tmp}/missing"], "composerjax traces: error: {tmp}/missing: no such run folder"),
        (["traces", "{tmp}"], "composerjax traces: error: {tmp} has no traces.jsonl (record it with "
                              "composerjax.callbacks.trace_recorder.TraceRecorder)"),
        (["traces", "{tmp}/bad.jsonl"], "composerjax traces: error: {tmp}/bad.jsonl:2: not a JSON line"),
        (["traces", "{tmp}/list.jsonl"], "composerjax traces: error: {tmp}/list.jsonl:1: expected a JSON object"),
        (["traces", "{tmp}/nameless.jsonl"], "composerjax traces: error: {tmp}/nameless.jsonl:1: a trace needs"),
        (["plot", "{tmp}"], "composerjax plot: error: {tmp} has no metrics.jsonl"),
        (["plot", "{tmp}/nameless.jsonl"], "composerjax plot: error: {tmp}/nameless.jsonl: no loss, metrics"),
    ],
)
def test_invalid_input_exits_with_status_2_and_one_readable_line(tmp_path, capsys, argv, message):
    (tmp_path / "bad.jsonl").write_text('{"name": "A", "event": "init"}\n{oops\n')
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    (tmp_path / "nameless.jsonl").write_text('{"event": "init", "step": 1}\n')
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith(message.format(tmp=tmp_path)) and len(error.splitlines()) == 1


def test_python_dash_m_runs_the_command_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "composerjax", "traces", str(tmp_path / "nope")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "no such run folder" in result.stderr and "Traceback" not in result.stderr


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "traces" in help_text and "plot" in help_text
