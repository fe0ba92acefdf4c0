"""LRMonitor: logged learning rates equal the schedule at each step; a warning without inject_hyperparams."""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from composerjax import ArrayLoader, Trainer
from composerjax.callbacks.lr_monitor import LRMonitor, find_learning_rates
from composerjax.cli import main
from composerjax.loggers import InMemoryLogger
from composerjax.optim import (
    DecoupledAdamW,
    LinearScheduler,
    LinearWithWarmupScheduler,
    ScheduleContext,
    compile_schedulers,
    with_schedule,
)
from composerjax.trainer import build_trainer
from composerjax.trainer.config import load_config


def schedule(count):
    return 0.1 / (1.0 + count)


def fit(classification_arrays, make_tiny_classifier, optimizer, monitor, duration="2ep"):
    x, y = classification_arrays
    memory = InMemoryLogger()
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration=duration,
                      optimizers=optimizer, callbacks=[monitor], loggers=[memory], progress_bar=False,
                      run_summary=False)
    trainer.fit()
    return trainer, memory


def test_logged_rates_follow_the_schedule(classification_arrays, make_tiny_classifier):
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    trainer, memory = fit(classification_arrays, make_tiny_classifier, optimizer, LRMonitor(fetch_interval=3))
    logged = memory.data["lr-sgd/group0"]
    assert [step for step, _ in logged] == list(range(1, 9))
    # Step n used schedule(n - 1): the optimizer's count before its update.
    np.testing.assert_allclose([rate for _, rate in logged], [schedule(n - 1) for n in range(1, 9)], rtol=1e-6)
    assert trainer.compile_count == 1


def test_rates_inside_a_chain_are_found_and_numbered_as_groups(classification_arrays, make_tiny_classifier):
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.inject_hyperparams(optax.adam)(learning_rate=optax.linear_schedule(0.1, 0.0, 4)))
    _, memory = fit(classification_arrays, make_tiny_classifier, optimizer, LRMonitor(), duration="5ba")
    # A chain has no factory name to read: the rule's fallback name.
    np.testing.assert_allclose([rate for _, rate in memory.data["lr-optimizer/group0"]],
                               [0.1, 0.075, 0.05, 0.025, 0.0], atol=1e-7)


def test_warns_once_without_inject_hyperparams(classification_arrays, make_tiny_classifier):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, memory = fit(classification_arrays, make_tiny_classifier, optax.sgd(0.1), LRMonitor())
    messages = [str(w.message) for w in caught if "LRMonitor" in str(w.message)]
    assert len(messages) == 1 and "optax.inject_hyperparams" in messages[0]
    assert not any(name.startswith("lr-") for name in memory.data)


def test_find_learning_rates_skips_states_without_a_learning_rate():
    opt_state = optax.chain(optax.inject_hyperparams(optax.add_decayed_weights)(weight_decay=0.1),
                            optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)).init(jnp.zeros(3))
    assert list(find_learning_rates(opt_state)) == ["lr-optimizer/group0"]


def test_invalid_fetch_interval_is_named():
    with pytest.raises(ValueError, match="fetch_interval=0"):
        LRMonitor(fetch_interval=0)


def test_decoupled_adamw_under_a_schedule_logs_the_scheduled_rate(classification_arrays, make_tiny_classifier):
    # 64 samples / 16 = 4 batches an epoch, 2 epochs: 8 updates; warm up over 2, then down to 0 at 8.
    multiplier = compile_schedulers([LinearWithWarmupScheduler(t_warmup="2ba")],
                                    ScheduleContext("2ep", steps_per_epoch=4))
    optimizer = with_schedule(DecoupledAdamW(lr=0.01), multiplier)
    trainer, memory = fit(classification_arrays, make_tiny_classifier, optimizer, LRMonitor(fetch_interval=2))
    logged = memory.data["lr-DecoupledAdamW/group0"]
    assert [step for step, _ in logged] == list(range(1, 9))
    # The n-th update (batch n - 1) used 0.01 * multiplier(n - 1).
    np.testing.assert_allclose([rate for _, rate in logged],
                               [0.0, 0.005, 0.01, 0.01 * 5 / 6, 0.01 * 4 / 6, 0.005, 0.01 / 3, 0.01 / 6], rtol=1e-6)
    assert trainer.compile_count == 1


def test_a_plain_optimizer_under_a_schedule_logs_the_multiplier(classification_arrays, make_tiny_classifier):
    multiplier = compile_schedulers([LinearScheduler()], ScheduleContext("4ba"))  # 1 down to 0 over the run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, memory = fit(classification_arrays, make_tiny_classifier, with_schedule(optax.sgd(0.1), multiplier),
                        LRMonitor(), duration="4ba")
    assert any("lr-optimizer/multiplier" in str(w.message) for w in caught)
    np.testing.assert_allclose([rate for _, rate in memory.data["lr-optimizer/multiplier"]],
                               [1.0, 0.75, 0.5, 0.25])


def test_a_recipe_run_logs_its_rate_and_plot_draws_it(tmp_path, capsys):
    recipe = {"model": {"name": "mlp", "sizes": [64, 16, 10]}, "data": {"name": "digits", "batch_size": 100},
              "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.001},
              "schedule": {"name": "linear", "warmup": "5ba"}, "max_duration": "10ba",
              "callbacks": [{"lr_monitor": {"fetch_interval": 3}}],
              "loggers": [{"file": {"path": str(tmp_path / "run" / "metrics.jsonl")}}],
              "progress_bar": False, "run_summary": False}
    build_trainer(load_config(recipe)).fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [(row["step"], row["lr-adamw/group0"]) for row in rows if "lr-adamw/group0" in row]
    # Warmup 0 -> 0.01 over 5 steps, then linear to 0 at step 10: the n-th update used schedule(n - 1).
    assert [step for step, _ in rates] == list(range(1, 11))
    np.testing.assert_allclose([rate for _, rate in rates],
                               [0.0, 0.002, 0.004, 0.006, 0.008, 0.01, 0.008, 0.006, 0.004, 0.002], atol=1e-8)
    assert main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "charts")]) == 0
    assert "learning_rate.png (1 series)" in capsys.readouterr().out
