"""steps_per_call=K: K batches per compiled call, the same training as per-step and every batch's metrics logged.

What is guaranteed (and tested here with a stochastic recipe: MixUp, label smoothing, EMA and a
shuffling loader): step ``i`` of a group sees exactly what the ``i``-th single step sees (its
batch, step number, ``progress`` and ``step_rng``), and on CPU, where one step and a group are the
same program (a loop whose trip count the compiler cannot see), the whole train state (parameters,
Adam's moments, the EMA average, the clock) is bit-identical to per-step training, as is every
logged loss. Reusing a group's first step number for every step of the group (the same key and
progress for all of them) changes MixUp's parameters by about 0.1 and fails both tests; compiling
the group as a ``lax.scan`` of known length changes the last bits and fails them too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, Callback, ComposerClassifier, Event, Trainer
from composerjax.algorithms import EMA, LabelSmoothing, MixUp
from composerjax.loggers import InMemoryLogger

X = np.random.default_rng(0).normal(size=(80, 6)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32)


class Probe(Algorithm):
    """Log what each traced step sees: its step number, its progress and a draw from its key.

    All three are integer arithmetic or one correctly rounded division, so they are the same bits
    however XLA compiles the step.
    """

    events = frozenset({Event.AFTER_TRAIN_BATCH})

    def match(self, event, state) -> bool:
        return event == Event.AFTER_TRAIN_BATCH

    def apply(self, event, state, logger) -> None:
        state.step_metrics["probe/step"] = state.step
        state.step_metrics["probe/progress"] = state.progress
        state.step_metrics["probe/bits"] = jax.random.bits(state.step_rng, dtype=jnp.uint32)


def make(steps_per_call: int = 1, duration: str = "3ep", **kwargs) -> tuple[Trainer, InMemoryLogger]:
    memory = InMemoryLogger()
    rngs = nnx.Rngs(0)
    model = ComposerClassifier(nnx.Sequential(nnx.Linear(6, 16, rngs=rngs), nnx.relu, nnx.Linear(16, 2, rngs=rngs)), 2)
    algorithms = [MixUp(alpha=0.4), LabelSmoothing(0.1), EMA(half_life="3ba"), Probe()]
    trainer = Trainer(model, ArrayLoader((X, Y), batch_size=8, shuffle=True, seed=1), duration,  # 10 batches/epoch
                      optax.adam(1e-2), algorithms=algorithms, loggers=[memory], log_interval=1,
                      steps_per_call=steps_per_call, progress_bar=False, **{"run_summary": False, **kwargs})
    return trainer, memory


def logged(memory: InMemoryLogger, name: str) -> list:
    return memory.data[name]


def assert_same_training(single: Trainer, grouped: Trainer) -> None:
    """Every leaf of the train state bit for bit: parameters, Adam's moments, the EMA average, the clock."""
    single_state = jax.tree_util.tree_leaves_with_path(jax.device_get(single.state.train_state))
    grouped_state = jax.tree_util.tree_leaves_with_path(jax.device_get(grouped.state.train_state))
    assert [path for path, _ in single_state] == [path for path, _ in grouped_state]
    for (path, a), (_, b) in zip(single_state, grouped_state):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))


def test_grouped_steps_see_what_single_steps_see_and_train_alike():
    single, single_log = make(1)
    single.fit()
    grouped, grouped_log = make(4)
    grouped.fit()
    # The first batch runs alone (EMA starts at its BATCH_END); then groups of 4 wherever 4 fit in the epoch.
    kinds = [(record.kind, record.batch_shapes[0][0]) for record in grouped.state.compiled_steps]
    assert kinds == [("train", 8), ("train", 4)]  # the single step (batch of 8), the stacked call (4 batches)
    assert grouped.state.timestamp.batch == single.state.timestamp.batch == 30
    np.testing.assert_array_equal(np.asarray(grouped.state.train_state.clock), [30, 30])
    # Every batch is logged, at its own step, and saw its own step number, progress and key: bit for bit.
    for name in ("train/probe/step", "train/probe/progress", "train/probe/bits"):
        assert logged(grouped_log, name) == logged(single_log, name), name
    assert [value for _, value in logged(single_log, "train/probe/step")] == list(range(30))
    assert [value for _, value in logged(single_log, "train/probe/progress")] == [
        float(np.float32(step) / np.float32(30)) for step in range(30)]
    assert len({value for _, value in logged(single_log, "train/probe/bits")}) == 30  # a new key every step
    assert [step for step, _ in logged(grouped_log, "loss/train/total")] == list(range(1, 31))
    assert logged(grouped_log, "loss/train/total") == logged(single_log, "loss/train/total")
    assert_same_training(single, grouped)
    batches = [t.batch for t in grouped.engine.trace_log if t.traced and t.name == "EMA"]
    assert batches == list(range(30))  # the trace log still has every step


def test_one_grouped_call_equals_its_single_steps_from_the_same_state():
    """The same statement for one call, from one state: K single steps against one K-step call."""
    trainer, _ = make(1, "1ba")
    trainer.fit()
    builder = trainer.builder
    plan = builder.plan_train()
    start = jax.device_get(trainer.state.train_state)
    batches = [(X[i:i + 8], Y[i:i + 8]) for i in range(0, 32, 8)]
    state = jax.device_put(start)
    single_bits = []
    for batch in batches:
        state, _, metrics = builder.train_step(plan)(state, batch)
        single_bits.append(int(metrics["probe/bits"]))
    stacked = jax.tree.map(lambda *leaves: np.stack(leaves), *batches)
    grouped, _, metrics, _ = builder.train_steps(plan, 4)(jax.device_put(start), stacked)
    assert [int(bits) for bits in metrics["probe/bits"]] == single_bits
    np.testing.assert_array_equal(np.asarray(metrics["probe/step"]), [1, 2, 3, 4])
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(state)),
                                 jax.tree_util.tree_leaves_with_path(jax.device_get(grouped))):
        np.testing.assert_array_equal(b, a, err_msg=jax.tree_util.keystr(path))


class Listener(Callback):
    def __init__(self) -> None:
        self.seen = []

    def batch_end(self, state, logger) -> None:
        self.seen.append(state.timestamp.batch)


def test_a_per_batch_listener_or_a_save_inside_the_group_keeps_steps_single(tmp_path):
    listener = Listener()
    trainer, _ = make(4, "1ep", callbacks=[listener])
    trainer.fit()
    assert listener.seen == list(range(1, 11))
    assert [r.batch_shapes[0][0] for r in trainer.state.compiled_steps] == [8]  # never grouped
    saving, _ = make(4, "1ep", save_folder=str(tmp_path), save_interval="3ba")
    saving.fit()
    saving.close()
    assert sorted(int(p.name.split("-ba")[1]) for p in tmp_path.iterdir() if "-ba" in p.name) == [3, 6, 9, 10]
    with pytest.raises(ValueError, match="steps_per_call=0"):
        make(0)


class GroupedListener(Listener):
    """The same listener, declaring that it may see a group's batches after the call."""

    accepts_grouped_batches = True


def grouped_calls(trainer: Trainer) -> int:
    """How many train variants compiled were grouped (a stacked batch: 3 dims for these 2-D inputs)."""
    return sum(1 for r in trainer.state.compiled_steps if r.kind == "train" and len(r.batch_shapes[0]) == 3)


def test_groups_stop_exactly_at_each_save_and_eval_the_built_ins_say_are_due(tmp_path):
    """CheckpointSaver and EvalRunner say when they are next due; a 4-batch group never runs past it."""
    listener = GroupedListener()
    trainer, _ = make(4, "2ep", save_folder=str(tmp_path), save_interval="4ba", callbacks=[listener],
                      eval_dataloader=ArrayLoader((X, Y), batch_size=40), eval_interval="8ba")
    assert trainer.grouping_blocked_by == []
    trainer.fit()
    trainer.close()
    assert grouped_calls(trainer) == 1
    traces = [(t.name, t.event.name, t.batch) for t in trainer.engine.trace_log if not t.traced]
    saves = [batch for name, event, batch in traces if name == "CheckpointSaver"]
    evals = [batch for name, event, batch in traces if name == "EvalRunner"]
    assert saves == [4, 8, 12, 16, 20]  # 20: the end of fit (an epoch's last batch saves once the epoch closes)
    assert evals == [8, 16, 20]  # 20: at FIT_END, since the run ended off the interval (Composer's rule)
    assert listener.seen == list(range(1, 21))  # every batch's BATCH_END, grouped or not
    assert sorted(int(p.name.split("-ba")[1]) for p in tmp_path.iterdir() if "-ba" in p.name) == [4, 8, 12, 16, 20]
    for step in (4, 8, 12, 16):  # each save holds the state right after its batch, not the end of a group
        loaded, _ = make(1, "2ep", load_path=str(next(tmp_path.glob(f"ep*-ba{step}"))))
        assert int(loaded.state.train_state.clock[0]) == loaded.state.timestamp.batch == step
        loaded.close()
    # The same run one step per call: the same saves and evals.
    single, _ = make(1, "2ep", save_folder=str(tmp_path / "single"), save_interval="4ba",
                     eval_dataloader=ArrayLoader((X, Y), batch_size=40), eval_interval="8ba")
    single.fit()
    single.close()
    assert [(t.name, t.batch) for t in single.engine.trace_log if not t.traced and t.name != "EMA"] == [
        (name, batch) for name, _, batch in traces if name != "EMA"]


def test_a_progress_bar_keeps_grouping_and_counts_every_batch():
    import io

    from composerjax.loggers import ProgressBarLogger

    class CountingBar(ProgressBarLogger):
        def batch_end(self, state, logger) -> None:
            super().batch_end(state, logger)
            self.ends.append(state.timestamp.batch)

    bar = CountingBar(stream=io.StringIO(), force=True)
    bar.ends = []
    trainer, _ = make(5, "1ep")
    trainer.logger.destinations.append(bar)
    assert trainer.grouping_blocked_by == []
    trainer.fit()
    assert grouped_calls(trainer) == 1
    assert bar.ends == list(range(1, 11))  # the bar moved once per batch, grouped or not


def test_grouping_blocked_by_names_the_plugins_that_must_act_between_batches(capsys):
    trainer, _ = make(4, "1ep", callbacks=[Listener()], run_summary=True)
    assert trainer.grouping_blocked_by == ["Listener"]
    trainer.fit()
    assert trainer.state.run_summary["grouping_blocked_by"] == ["Listener"]
    assert "steps_per_call=4: grouping blocked by Listener" in capsys.readouterr().out
    assert grouped_calls(trainer) == 0


def test_speed_monitor_keeps_grouping_and_logs_a_rate_for_every_batch_after_its_window():
    from composerjax.callbacks import SpeedMonitor

    trainer, memory = make(4, "1ep", callbacks=[SpeedMonitor(window_size=4)])
    assert trainer.grouping_blocked_by == []
    trainer.fit()
    assert grouped_calls(trainer) == 1
    rates = logged(memory, "throughput/samples_per_sec")
    single, single_memory = make(1, "1ep", callbacks=[SpeedMonitor(window_size=4)])
    single.fit()
    assert [step for step, _ in rates] == [step for step, _ in logged(single_memory, "throughput/samples_per_sec")]
    assert [step for step, _ in rates] == list(range(5, 11))
    assert all(rate > 0 for _, rate in rates)


def test_a_file_logger_keeps_grouping_and_writes_every_batchs_row_as_single_steps_do(tmp_path):
    # The rows are read back by a fresh process after the writer's trainer closed its file.
    import json
    import subprocess
    import sys

    from composerjax.loggers import FileLogger

    rows = {}
    for steps_per_call in (1, 5):
        path = tmp_path / f"metrics-{steps_per_call}.jsonl"
        trainer, _ = make(steps_per_call, "1ep")
        trainer.logger.destinations.append(FileLogger(str(path)))
        assert trainer.grouping_blocked_by == []
        trainer.fit()
        trainer.close()
        assert grouped_calls(trainer) == (1 if steps_per_call == 5 else 0)  # a grouped step was compiled
        read = subprocess.run([sys.executable, "-c", "import sys; print(open(sys.argv[1]).read())", str(path)],
                              capture_output=True, text=True, check=True).stdout
        rows[steps_per_call] = [row for row in map(json.loads, read.split("\n")[:-2]) if "loss/train/total" in row]
    assert [row["step"] for row in rows[5]] == list(range(1, 11))
    assert [row["loss/train/total"] for row in rows[5]] == [row["loss/train/total"] for row in rows[1]]
