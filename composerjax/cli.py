"""The ``composerjax`` command line: train and explain recipes, launch multi-process runs, inspect finished ones.

Each subcommand is one ``_add_<name>(subparsers)`` function that declares its arguments and one
``<name>_command(args) -> int`` that runs it; ``main`` dispatches. Bad input (a recipe with
problems, a missing run folder or file, an unreadable line) exits with status 2 and a message,
never a traceback. Any other error exits with status 1 and one line naming the exception;
``--debug`` (before or after the subcommand) shows its traceback instead. Two commands answer
with their status too: ``train`` exits 3 when the final training loss is NaN or infinite (unless
the recipe sets ``allow_nonfinite_loss: true``), and ``traces A --diff B`` exits 0 when the runs
are the same, 1 when they differ and 2 on any error, as ``diff`` does.

Example:
    >>> main(['traces', '/no/such/run'])
    2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from composerjax.cli_common import HelpFormatter, UsageError, add_debug
from composerjax.cli_run import METRICS_FILE, read_jsonl, run_file

if TYPE_CHECKING:
    from composerjax.trainer.trainer import Trainer

__all__ = ["main", "build_parser", "NONFINITE_LOSS_STATUS", "train_command", "explain_command", "traces_command",
           "plot_command", "launch_command", "UsageError"]

def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``) and return the exit status.

    ``SystemExit`` passes through untouched, so a run stopped by a signal
    (:class:`composerjax.TrainingInterrupted`) exits with its own status (130, 143).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = bool(getattr(args, "debug", False) or getattr(args, "global_debug", False))
    try:
        return args.handler(args)
    except UsageError as error:
        print(f"composerjax {args.command}: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if debug:
            raise
        print(f"composerjax {args.command}: error: {type(error).__name__}: {error}", file=sys.stderr)
        print(f"composerjax {args.command}: run with --debug for the traceback", file=sys.stderr)
        return getattr(args, "unexpected_error_status", 1)  # 2 for `traces --diff`, whose 1 means "they differ"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="composerjax",
        description=(
            "Train a recipe (train), show what a recipe will run without training (explain), start a multi-process "
            "run on this machine (launch) and inspect finished runs: which algorithms ran where (traces), how "
            "training went (plot) and what a language model learned (generate), and write a run's model as a "
            "Hugging Face folder (export). 'composerjax COMMAND --help' describes each command."
        ),
        epilog=_EXIT_STATUSES + "\n\nexample: composerjax train examples/digits_speedup.yaml --set max_duration=1ep",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--debug", dest="global_debug", action="store_true",
                        help="show the full traceback of an unexpected error instead of a one-line message")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_subcommand in _SUBCOMMANDS:
        add_subcommand(subparsers)
    return parser


_EXIT_STATUSES = """exit statuses:
  0    success
  1    an unexpected error (one line; --debug shows the traceback)
  2    bad input: a recipe or --set with problems (every one listed), a missing or unreadable file or
       folder, a data batch the model cannot train on (e.g. labels outside [0, num_classes))"""


def _add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", metavar="RECIPE",
                        help="a YAML or JSON recipe (a TrainerConfig: model, data, optimizer, schedule, "
                             "algorithms, callbacks, loggers and every Trainer argument, e.g. max_duration); see "
                             "examples/*.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="change one recipe value before validation, parsed as YAML; repeatable. Dots for "
                             "mappings, [i] for list items: --set max_duration=2ep --set optimizer.lr=0.01 "
                             "--set algorithms[0].mixup.alpha=0.4. Every Trainer argument is a key: "
                             "--set steps_per_call=8 --set handle_signals=false "
                             "--set tokens_per_batch=package.module:function")
    add_debug(parser)


def _load_recipe(args: argparse.Namespace) -> Any:
    """The validated TrainerConfig of ``args.recipe`` with ``--set`` overrides; problems -> UsageError."""
    from composerjax.trainer.config import ConfigError, load_config

    try:
        return load_config(args.recipe, args.overrides)
    except ConfigError as error:
        raise UsageError(str(error)) from None


# -- composerjax train -----------------------------------------------------------------------------
def _add_train(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train the model a recipe describes, then evaluate it",
        description=(
            "Load RECIPE (YAML or JSON), apply the --set overrides, validate it (every problem is listed with its "
            "field path, e.g. algorithms[0].mixup.alpha, and close matches for misspelt names), build the Trainer, "
            "fit() for max_duration, evaluate once more when the data has an eval split, and print the results: "
            "run name, batches trained, final train loss, eval metrics and wall time. The recipe as run is written to "
            "the run folder (run_dir/recipe.yaml, read by 'composerjax generate'); logs and checkpoints go "
            "where the recipe's loggers, run_dir and save_folder say. A run stopped by SIGTERM or SIGINT exits "
            "with 143 or 130 after its checkpoint is saved."
        ),
        epilog=_EXIT_STATUSES + "\n  3    the final training loss is NaN or infinite (the recipe's "
                                "allow_nonfinite_loss: true accepts it)"
                                "\n  130  interrupted by SIGINT (143: by SIGTERM), after saving a checkpoint\n\n"
                                "examples:\n"
                                "  composerjax train examples/digits_baseline.yaml\n"
                                "  composerjax train examples/digits_speedup.yaml --set max_duration=2ep "
                                "--set progress_bar=false",
        formatter_class=HelpFormatter,
    )
    _add_recipe_arguments(parser)
    parser.set_defaults(handler=train_command)


def train_command(args: argparse.Namespace) -> int:
    """``composerjax train RECIPE [--set KEY.PATH=VALUE ...] [--debug]``."""
    import time

    from composerjax.cli_generate import write_run_recipe
    from composerjax.trainer import build_trainer
    from composerjax.trainer.config import ConfigError
    from composerjax.trainer.interrupt import BatchError

    config = _load_recipe(args)
    start = time.perf_counter()
    try:
        trainer = build_trainer(config)
    except ConfigError as error:  # problems only the data can show (a warmup longer than the run)
        raise UsageError(str(error)) from None
    try:
        write_run_recipe(trainer)  # the run folder says how to rebuild its model (composerjax generate)
        trainer.fit()
        results = trainer.eval() if trainer.state.evaluators else None
    except BatchError as error:  # the data does not fit the recipe's model (labels >= num_classes, shapes)
        raise UsageError(str(error)) from None
    finally:
        trainer.close()
    loss = _final_loss(trainer)
    if loss is not None:  # read for the results anyway: a NaN no logger saw is said here
        trainer.nonfinite_loss.last(loss)
    print(_format_results(trainer, results, time.perf_counter() - start))
    return _train_exit_status(trainer)


#: ``composerjax train``'s exit status when the final training loss is NaN or infinite.
NONFINITE_LOSS_STATUS = 3


def _final_loss(trainer: Trainer) -> float | None:
    try:
        return float(trainer.state.loss)
    except (TypeError, ValueError):
        return None


def _train_exit_status(trainer: Trainer) -> int:
    """0, or :data:`NONFINITE_LOSS_STATUS` and one line on stderr for a final loss that is not finite (not allowed)."""
    import math

    loss = _final_loss(trainer)
    if loss is None or math.isfinite(loss) or trainer.nonfinite_loss.allowed:
        return 0
    print(f"composerjax train: the final training loss is {loss}: exit status {NONFINITE_LOSS_STATUS} "
          "(allow_nonfinite_loss: true in the recipe, or --set allow_nonfinite_loss=true, accepts it)",
          file=sys.stderr)
    return NONFINITE_LOSS_STATUS


def _format_results(trainer: Trainer, results: dict[str, float] | None, seconds: float) -> str:
    state = trainer.state
    timestamp = state.timestamp
    epochs = int(timestamp.epoch)
    epochs_done = f"{epochs} epoch{'' if epochs == 1 else 's'} complete"
    lines = [f"run {state.run_name}: {int(timestamp.batch)} batches ({epochs_done}), {seconds:.1f} s wall "
             "(compiles included)"]
    loss = _final_loss(trainer)
    if loss is not None:
        lines.append(f"  final train loss  {loss:.4f}")
    nonfinite = state.run_summary.get("nonfinite_loss")
    if nonfinite:
        lines.append(f"  non-finite loss   {nonfinite['message']}")
    skipped = state.run_summary.get("skipped_nonfinite_updates")
    if skipped:
        lines.append(f"  skipped updates   {skipped['skipped']} of {skipped['updates']} (skip_nonfinite_updates: "
                     "NaN or infinite loss or gradients)")
    if results:
        width = max(len(name) for name in results)
        lines.append("  eval")
        lines.extend(f"    {name.ljust(width)}  {value:.4f}" for name, value in results.items())
    elif results is None:
        lines.append("  eval              (the data has no eval split)")
    cache = state.run_summary.get("compilation_cache")
    if cache:
        lines.append(f"  compiled steps    {cache['steps_compiled']} compiled, {cache['steps_loaded']} loaded from the "
                     f"compilation cache ({cache['folder']})")
    return "\n".join(lines)


# -- composerjax explain ---------------------------------------------------------------------------
def _add_explain(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "explain",
        help="show what a recipe will run, event by event, without training",
        description=(
            "Load and validate RECIPE like 'composerjax train' does, then print without training: for each event, "
            "the algorithms that will run there in order once the ordering passes have run, and any conflicts "
            "between them. --json prints the same as one JSON object."
        ),
        epilog=_EXIT_STATUSES + "\n\nexamples:\n"
                                "  composerjax explain examples/digits_speedup.yaml\n"
                                "  composerjax explain examples/gpt_pydoc.yaml --json",
        formatter_class=HelpFormatter,
    )
    _add_recipe_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the explanation as JSON instead of text")
    parser.set_defaults(handler=explain_command)


def explain_command(args: argparse.Namespace) -> int:
    """``composerjax explain RECIPE [--set KEY.PATH=VALUE ...] [--json] [--debug]``."""
    from composerjax.explain import explain
    from composerjax.trainer.config import ConfigError

    config = _load_recipe(args)
    try:
        explanation = explain(config)
    except ConfigError as error:  # problems only the data can show (a warmup longer than the run)
        raise UsageError(str(error)) from None
    if args.json:
        print(json.dumps(explanation.to_dict(), indent=2, default=str))
    else:
        print(explanation.render())
    return 0


# -- composerjax traces ----------------------------------------------------------------------------
def _add_traces(subparsers: Any) -> None:
    from composerjax.cli_traces import add_traces  # its own module (composerjax.cli_traces)

    add_traces(subparsers)


def traces_command(args: argparse.Namespace) -> int:
    """``composerjax traces RUN_DIR [--diff OTHER_RUN]`` (:func:`composerjax.cli_traces.traces_command`)."""
    from composerjax.cli_traces import traces_command as run

    return run(args)


# -- composerjax plot ------------------------------------------------------------------------------
#: Charts and the metric names they hold (matched on the name logged, e.g. 'loss/train/total').
_CHARTS: tuple[tuple[str, str, Callable[[str], bool]], ...] = (
    ("loss", "Loss", lambda name: name == "loss" or name.startswith("loss/")),
    ("metrics", "Metrics", lambda name: name.startswith("metrics/")),
    ("learning_rate", "Learning rate",
     lambda name: re.search(r"(^|[/_-])(lr|learning_rate)([/_-]|$)", name.lower()) is not None),
    ("throughput", "Throughput", lambda name: "throughput" in name.lower()),
)


def _add_plot(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="PNG charts of loss, metrics, learning rate and throughput",
        description=(
            "Chart RUN_DIR/metrics.jsonl (written by composerjax.loggers.FileLogger: one JSON object per line with "
            "'step' and metric values) against the batch: loss.png (names starting with 'loss/'), metrics.png "
            "('metrics/...'), learning_rate.png (names with an 'lr' or 'learning_rate' part) and throughput.png "
            "(names containing 'throughput'). Charts without values are skipped. Needs matplotlib "
            "(pip install matplotlib)."
        ),
        epilog=_EXIT_STATUSES.replace("(one line;", "or matplotlib missing (one line;")
        + "\n\nexample: composerjax plot runs/digits-baseline --out charts/",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder holding metrics.jsonl (or the file itself)")
    parser.add_argument("--out", metavar="DIR", help="where to write the PNG files (default: RUN_DIR/plots)")
    add_debug(parser)
    parser.set_defaults(handler=plot_command)


def plot_command(args: argparse.Namespace) -> int:
    """``composerjax plot RUN_DIR [--out DIR]``."""
    path = run_file(args.run_dir, METRICS_FILE, "metrics")
    series = _read_metric_series(read_jsonl(path))
    charts = [(file_name, title, {name: points for name, points in series.items() if belongs(name)})
              for file_name, title, belongs in _CHARTS]
    charts = [chart for chart in charts if chart[2]]
    if not charts:
        raise UsageError(f"{path}: no loss, metrics, learning-rate or throughput values to plot "
                         f"(found: {', '.join(sorted(series)) or 'no metrics'})")
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("composerjax plot: error: charts need matplotlib, which is not installed: pip install matplotlib",
              file=sys.stderr)
        return 1
    run_dir = args.run_dir if os.path.isdir(args.run_dir) else os.path.dirname(os.path.abspath(args.run_dir))
    out = args.out or os.path.join(run_dir, "plots")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as error:
        raise UsageError(f"--out {out}: cannot create the folder: {error.strerror}") from None
    for file_name, title, chart_series in charts:
        figure = Figure(figsize=(8, 4.5), layout="constrained")
        axes = figure.subplots()
        for name, points in sorted(chart_series.items()):
            steps, values = zip(*points)
            axes.plot(steps, values, label=name, marker="." if len(points) < 50 else None)
        axes.set_title(title)
        axes.set_xlabel("batch")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="small")
        target = os.path.join(out, f"{file_name}.png")
        figure.savefig(target, dpi=100)
        print(f"wrote {target} ({len(chart_series)} series)")
    return 0


def _read_metric_series(records: list[tuple[str, int, dict[str, Any]]]) -> dict[str, list[tuple[float, float]]]:
    """``{metric: [(step, value), ...]}`` from FileLogger lines (hyperparameter lines are skipped)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for index, (_, _, record) in enumerate(records):
        if "hyperparameters" in record:
            continue
        step = record.get("step")
        step = step if isinstance(step, (int, float)) and not isinstance(step, bool) else index
        for name, value in record.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(name, []).append((step, float(value)))
    return series


# -- composerjax launch ----------------------------------------------------------------------------
def _add_launch(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="run a script as N local jax.distributed processes",
        description=(
            "Run SCRIPT [ARGS...] as N processes of one jax.distributed run on this machine (coordinator on "
            "127.0.0.1). Each process imports composerjax first, which starts jax.distributed from the variables "
            "the launcher sets (COMPOSERJAX_COORDINATOR, COMPOSERJAX_NUM_PROCESSES, COMPOSERJAX_PROCESS_ID, "
            "COMPOSERJAX_LOCAL_RANK, COMPOSERJAX_NODE_RANK, COMPOSERJAX_DEVICES_PER_PROCESS), so the script needs "
            "no distributed code. Output lines are prefixed with [rank i]. When a process fails, the others are "
            "stopped (SIGTERM, then SIGKILL) and the launcher exits with that process's status, naming its rank "
            "and printing its last lines (a rank that only lost a peer is not blamed). Once any process has called "
            "composerjax.parallel.heartbeat.heartbeat() (the Trainer does, every batch), one that has not for "
            "--heartbeat-timeout "
            "seconds stops the job the same way. SIGINT/SIGTERM sent to the launcher are passed on to every process, "
            "and what still runs after --grace-period is killed (a second signal kills at once)."
        ),
        epilog=(
            "exit statuses:\n"
            "  0    every process exited with 0\n"
            "  N    the status of the first process that failed (its rank and last lines are printed)\n"
            "  124  a process made no progress for --heartbeat-timeout seconds (its rank and last lines are printed)\n"
            "  130  the launcher received SIGINT (143: SIGTERM) before any process failed\n"
            "  1    an unexpected error in the launcher (one line; --debug shows the traceback)\n"
            "  2    bad arguments (N < 1, a missing SCRIPT, a port out of range)\n\n"
            "example: composerjax launch -n 2 --devices-per-process 4 train.py --epochs 3"
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("-n", "--num-processes", type=int, required=True, metavar="N",
                        help="how many processes to start (ranks 0..N-1)")
    parser.add_argument("--devices-per-process", type=int, metavar="K",
                        help="simulated CPU devices per process (--xla_force_host_platform_device_count=K added to "
                             "XLA_FLAGS, JAX_PLATFORMS=cpu unless set); default: JAX's own devices")
    parser.add_argument("--port", type=int, metavar="P", help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--grace-period", type=float, default=5.0, metavar="SECONDS",
                        help="when the launcher stops the processes (a failure, a heartbeat timeout, a signal), "
                             "seconds between SIGTERM and SIGKILL (default: 5)")
    parser.add_argument("--heartbeat-timeout", type=float, default=1800.0, metavar="SECONDS",
                        help="once any process has called composerjax.parallel.heartbeat.heartbeat(), stop the job "
                             "when one has "
                             "not for SECONDS (since its start until its first beat); 0 disables (default: 1800)")
    add_debug(parser)
    parser.add_argument("script", metavar="SCRIPT", help="the Python script every process runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments passed on to SCRIPT (options after SCRIPT belong to it)")
    parser.set_defaults(handler=launch_command)


def launch_command(args: argparse.Namespace) -> int:
    """``composerjax launch -n N [--devices-per-process K] [--port P] [--heartbeat-timeout S] SCRIPT [ARGS...]``."""
    from composerjax.parallel.launch import launch

    try:
        return launch(args.script, args.script_args, args.num_processes, devices_per_process=args.devices_per_process,
                      port=args.port, grace_period_s=args.grace_period, heartbeat_timeout_s=args.heartbeat_timeout)
    except (ValueError, FileNotFoundError) as error:
        message = str(error)
        for name in ("num_processes", "devices_per_process", "port", "grace_period_s", "heartbeat_timeout_s"):
            option = "--" + name.removesuffix("_s").replace("_", "-")
            message = message.replace(f"`{name}`", option)
        raise UsageError(message) from None


def _add_generate(subparsers: Any) -> None:
    from composerjax.cli_generate import add_generate  # its own module (composerjax.cli_generate)

    add_generate(subparsers)


def _add_export(subparsers: Any) -> None:
    from composerjax.cli_export import add_export  # its own module (composerjax.cli_export)

    add_export(subparsers)


_SUBCOMMANDS: tuple[Callable[[Any], None], ...] = (_add_train, _add_explain, _add_launch, _add_traces, _add_plot,
                                                   _add_generate, _add_export)
