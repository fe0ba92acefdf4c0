"""The ``composerjax`` command line: traces tables and diffs, plots, and errors for bad input."""

import json
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import optax
import pytest

from composerjax import Algorithm, ArrayLoader, Callback, Event, Trainer
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


class SaysDone(Callback):
    """A user callback that records its actions: it acts (returns True) at every second EPOCH_END."""

    trace_actions = True

    def epoch_end(self, state, logger):
        return state.timestamp.epoch.value % 2 == 0


def recipe_run(folder, arrays, make_model, algorithms, callbacks=(), **kwargs):
    x, y = arrays
    # TraceRecorder is a callback: the trainer attaches it to the engine, traced runs included.
    trainer = Trainer(make_model(), ArrayLoader((x, y), batch_size=16), max_duration="2ep", optimizers=optax.sgd(0.1),
                      algorithms=algorithms, callbacks=[TraceRecorder(), *callbacks], progress_bar=False,
                      run_summary=False, run_dir=str(folder), **kwargs)
    trainer.fit()
    trainer.close()
    return str(folder)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, classification_arrays, make_tiny_classifier):
    root = tmp_path_factory.mktemp("runs")
    full = recipe_run(root / "full", classification_arrays, make_tiny_classifier, [Smooth(), Sharpen(), Announce()])
    lean = recipe_run(root / "lean", classification_arrays, make_tiny_classifier, [Smooth(), Announce()])
    return full, lean


def sections(output: str) -> dict[str, list[list[str]]]:
    """The traces table: ``{EVENT: [[order, name, runs, kind, batches, exit codes, host time], ...]}``."""
    tables: dict[str, list[list[str]]] = {}
    current = None
    for line in output.splitlines():
        if line and not line.startswith(" ") and line.isupper():
            current = tables[line] = []
        elif current is not None and line.startswith("  ") and not line.strip().startswith("order"):
            current.append(re.split(r"\s{2,}", line.strip()))  # cells are padded apart by two spaces or more
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
    assert announce[:6] == ["0", "Announce", "2", "host", "0-4", "7 (2 runs)"]  # apply returned 7 both times
    assert announce[6].endswith((" us", " ms"))
    assert [row[5:] for row in tables["BEFORE_LOSS"]] == [["-", "-"], ["-", "-"]]  # no exit code, no host time
    assert output.rstrip().splitlines()[-1].startswith("total host time in algorithms: ")


def test_traces_diff_names_the_algorithm_only_one_run_has(runs, capsys):
    full, lean = runs
    assert main(["traces", full, "--diff", lean]) == 1  # as diff(1): they differ
    assert capsys.readouterr().out.splitlines() == [
        f"differences between {full} (A) and {lean} (B):",
        "  BEFORE_LOSS: only in A: Sharpen",
        "  AFTER_LOSS: only in A: Sharpen",
    ]
    assert main(["traces", lean, "--diff", os.path.join(lean, "traces.jsonl")]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "  none: the same algorithms and callbacks ran at the same events, in the same order, as often")


def test_traces_lists_callbacks_that_record_actions_as_callbacks(tmp_path, classification_arrays,
                                                                  make_tiny_classifier, capsys):
    x, y = classification_arrays
    folder = recipe_run(tmp_path / "callbacks", classification_arrays, make_tiny_classifier, [Announce()],
                        callbacks=[SaysDone()], eval_dataloader=ArrayLoader((x, y), batch_size=32, shuffle=False))
    assert main(["traces", folder]) == 0
    output = capsys.readouterr().out
    # Announce at the two EPOCH_STARTs; EvalRunner after each epoch, SaysDone after the second.
    assert output.splitlines()[0] == (f"traces of {folder}: 2 algorithm runs and 3 callback actions at 2 events, "
                                      "batches 0-8")
    tables = sections(output)
    assert list(tables) == ["EPOCH_START", "EPOCH_END"]
    assert tables["EPOCH_START"][0][:6] == ["0", "Announce", "2", "host", "0-4", "7 (2 runs)"]
    assert [row[:6] for row in tables["EPOCH_END"]] == [["0", "EvalRunner", "2", "callback", "4-8", "-"],
                                                        ["0", "SaysDone", "1", "callback", "8", "-"]]
    last = output.rstrip().splitlines()[-1]
    assert last.startswith("total host time in algorithms: ") and "; in callbacks: " in last
    # Against a run without them, the diff names them as callbacks.
    lean = recipe_run(tmp_path / "lean", classification_arrays, make_tiny_classifier, [Announce()])
    assert main(["traces", folder, "--diff", lean]) == 1
    assert capsys.readouterr().out.splitlines()[1:] == [
        "  EPOCH_END: only in A: EvalRunner (callback), SaysDone (callback)"]


def test_traces_shows_the_exit_codes_apply_returned(tmp_path, capsys):
    rows = [{"name": "Vote", "event": "epoch_start", "order": 0, "run": True, "exit_code": code, "batch": batch}
            for batch, code in enumerate([1, None, 0, 1])]
    (tmp_path / "traces.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["traces", str(tmp_path)]) == 0
    (vote,) = sections(capsys.readouterr().out)["EPOCH_START"]
    assert vote[:6] == ["0", "Vote", "4", "host", "0-3", "0 (1 run), 1 (2 runs)"]


def test_traces_diff_answers_with_its_exit_status_like_diff(runs, tmp_path):
    """0 the same, 1 different, 2 an error: through the real command line, in a fresh process."""
    full, lean = runs
    (tmp_path / "broken.jsonl").write_text('{"name": "A", "event": "init"}\n{oops\n')

    def traces(*args):
        return subprocess.run([sys.executable, "-m", "composerjax", "traces", *map(str, args)], capture_output=True,
                              text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))

    same = traces(lean, "--diff", os.path.join(lean, "traces.jsonl"))
    different = traces(full, "--diff", lean)
    missing = traces(full, "--diff", tmp_path / "missing")
    unreadable = traces(tmp_path / "broken.jsonl", "--diff", full)
    assert (same.returncode, different.returncode, missing.returncode, unreadable.returncode) == (0, 1, 2, 2)
    assert "none: the same algorithms and callbacks ran" in same.stdout
    assert "only in A: Sharpen" in different.stdout and different.stderr == ""
    assert missing.stderr == f"composerjax traces: error: {tmp_path / 'missing'}: no such run folder\n"
    assert unreadable.stderr.startswith(f"composerjax traces: error: {tmp_path / 'broken.jsonl'}:2: not a JSON line")


def test_an_unexpected_error_in_traces_diff_is_2_not_1(runs, monkeypatch, capsys):
    full, lean = runs

    def broken(*args):
        raise RuntimeError("the summary broke")

    monkeypatch.setattr("composerjax.cli_traces._trace_differences", broken)
    assert main(["traces", full, "--diff", lean]) == 2  # 1 would read as "they differ"
    assert "RuntimeError: the summary broke" in capsys.readouterr().err
    monkeypatch.setattr("composerjax.cli_traces._format_traces", broken)
    assert main(["traces", full]) == 1  # without --diff, the usual status of an unexpected error


def test_traces_diff_reports_order_and_count_differences(tmp_path, capsys):
    def write(folder, rows):
        folder.mkdir()
        with open(folder / "traces.jsonl", "w") as file:
            for name, order, batch in rows:
                file.write(json.dumps({"name": name, "event": "after_dataloader", "order": order, "run": True,
                                       "traced": False, "batch": batch, "duration_s": 0.001}) + "\n")

    write(tmp_path / "a", [("X", 0, 0), ("Y", 1, 0), ("X", 0, 1), ("Y", 1, 1)])
    write(tmp_path / "b", [("Y", 0, 0), ("X", 1, 0)])
    assert main(["traces", str(tmp_path / "a"), "--diff", str(tmp_path / "b")]) == 1
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
