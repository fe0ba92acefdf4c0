"""Composer's eval metrics equal scikit-learn's values: by hand, and through Trainer.eval on 1 device, 4, 2 processes.

The predictions (metric_cases.py) have ties in argmax, ranks and thresholds, and come in batches of
unequal sizes; every metric is compared with scikit-learn on all of them at float32 precision.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerModel, Trainer
from composerjax.loggers import InMemoryLogger
from composerjax.metrics import compute_values, merge_states

from . import metric_cases as cases

HERE = Path(__file__).resolve().parent
#: float32 on the device against float64 in scikit-learn: a few ulps.
REL = 1e-6


def assert_equals_sklearn(values: dict[str, float], expected: dict[str, float]) -> None:
    assert sorted(values) == sorted(expected)
    wrong = {name: (values[name], value) for name, value in expected.items()
             if values[name] != pytest.approx(value, rel=REL, abs=1e-7)}
    assert wrong == {}, f"(ours, sklearn) differ: {wrong}"


@pytest.fixture(scope="module")
def data() -> dict[str, np.ndarray]:
    return cases.predictions()


@pytest.fixture(scope="module")
def evaluated(data):
    """One Trainer.eval of every metric on this process's single device."""
    memory = InMemoryLogger()
    trainer = Trainer(cases.PredictionsModel(), loggers=[memory], progress_bar=False, run_summary=False)
    values = trainer.eval(cases.batches(data))
    return trainer, memory, values


@jax.jit
def batch_states(batch: dict[str, jax.Array]) -> dict[str, Any]:
    """Every metric's state of one batch, as the model's ``update_metric`` gives it."""
    return {name: cases.update(metric, batch, batch) for name, metric in cases.eval_metrics().items()}


def test_each_metric_by_hand_equals_sklearn(data):
    """update per batch, merge, compute: the plain API, without the trainer."""
    totals = {}
    for batch in cases.batches(data):
        for name, state in batch_states(batch).items():
            totals[name] = state if name not in totals else totals[name].merge(state)
    computed = jax.jit(lambda states: {name: state.compute() for name, state in states.items()})(totals)
    assert_equals_sklearn({name: float(value) for name, value in computed.items()}, cases.sklearn_values(data))


def test_trainer_eval_on_one_device_equals_sklearn(data, evaluated):
    trainer, _, values = evaluated
    assert trainer.mesh.devices.size == 1
    assert_equals_sklearn(values, cases.sklearn_values(data))
    assert trainer.state.metrics["eval"] == values


def test_logged_names_are_metrics_eval_metric_name(evaluated):
    _, memory, values = evaluated
    logged = {name: series[-1][1] for name, series in memory.data.items() if name.startswith("metrics/")}
    assert logged == {f"metrics/eval/{name}": value for name, value in values.items()}


def test_a_second_eval_compiles_nothing_more(data, evaluated):
    trainer, _, values = evaluated
    compiles = trainer.compile_count  # one eval step per batch shape
    assert compiles == len(set(cases.SIZES))
    assert trainer.eval(cases.batches(data)) == values
    assert trainer.compile_count == compiles


def test_metric_names_are_regexes_and_subset_num_batches_limits_the_batches(data, evaluated):
    trainer, memory, _ = evaluated
    values = trainer.runner.evaluate(cases.batches(data), label="val", metric_names=["auroc", "^MeanSquared"],
                                     subset_num_batches=2)
    assert sorted(values) == ["BinaryAUROC", "MeanSquaredError", "MulticlassAUROC"]
    expected = cases.sklearn_values(cases.subset(data, sum(cases.SIZES[:2])))
    assert_equals_sklearn(values, {name: expected[name] for name in values})
    assert trainer.state.metrics["val"] == values
    assert memory.latest("metrics/val/BinaryAUROC") == values["BinaryAUROC"]
    with pytest.raises(ValueError, match="metric_names='auroc': expected a list of regex strings"):
        trainer.runner.evaluate(cases.batches(data), metric_names="auroc")


def test_states_merge_without_waiting_and_compute_once(data):
    """merge_states dispatches one compiled merge per batch (samples of AUROC append); compute_values fetches once."""
    totals = None
    for batch in cases.batches(data):
        totals = merge_states(totals, batch_states(batch))
    assert len(totals["BinaryAUROC"].scores) == len(cases.SIZES)  # kept per batch, concatenated in compute
    assert totals["MulticlassPrecision"].confusion.shape == (cases.CLASSES, cases.CLASSES)
    assert_equals_sklearn(compute_values(totals), cases.sklearn_values(data))


# -- models of the older kind: (sum, count) pairs --------------------------------------------------
class SumsModel(ComposerModel):
    """Reports its metrics as ``{name: (sum, count)}``, as models did before ``get_metrics``."""

    def __init__(self) -> None:
        self.linear = nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    def forward(self, batch):
        return self.linear(batch[0])[:, 0]

    def loss(self, outputs, batch):
        return jnp.mean((outputs - batch[1]) ** 2)

    def metrics(self, outputs, batch):
        count = jnp.asarray(outputs.shape[0], jnp.float32)
        return {"mae": (jnp.sum(jnp.abs(outputs - batch[1])), count),
                "loss": (self.loss(outputs, batch) * count, count)}


def test_a_model_with_sum_count_metrics_keeps_its_exact_means():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(21, 2)).astype(np.float32), rng.normal(size=21).astype(np.float32)
    model = SumsModel()
    outputs = np.asarray(model.forward((jnp.asarray(x), None)))
    trainer = Trainer(model, progress_bar=False, run_summary=False)
    values = trainer.eval([(x[:16], y[:16]), (x[16:], y[16:])])  # uneven batches: means over samples
    assert sorted(values) == ["loss", "mae"]
    assert values["mae"] == pytest.approx(np.mean(np.abs(outputs - y)), rel=REL)
    assert values["loss"] == pytest.approx(np.mean((outputs - y) ** 2), rel=REL)


def test_a_loss_fn_model_reports_its_loss_and_extra_metrics():
    x = np.ones((6, 2), np.float32)

    def loss_fn(model, batch):
        error = model(batch[0])[:, 0] - batch[1]
        return jnp.mean(error**2), {"bias": jnp.mean(error)}

    trainer = Trainer(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), loss_fn=loss_fn, progress_bar=False, run_summary=False)
    values = trainer.eval(ArrayLoader((x, np.zeros(6, np.float32)), 3, shuffle=False))
    assert sorted(values) == ["bias", "loss"]
    assert values["loss"] == pytest.approx(values["bias"] ** 2, rel=1e-5)  # every sample has the same error


def test_update_metric_must_return_the_updated_metric(data):
    class Mutating(cases.PredictionsModel):
        def update_metric(self, batch, outputs, metric):
            metric.update(outputs["logits"], batch["labels"])  # Composer's in-place habit: the result is lost

    trainer = Trainer(Mutating(), progress_bar=False, run_summary=False)
    with pytest.raises(TypeError, match=r"update_metric\(batch, outputs, metric\) returned NoneType"):
        trainer.eval(cases.batches(data)[:1])


# -- 4 simulated devices and 2 processes -----------------------------------------------------------
FOUR_DEVICES = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import metric_cases as cases
    from composerjax import Trainer

    trainer = Trainer(cases.PredictionsModel(), progress_bar=False, run_summary=False)
    batches = cases.batches(cases.predictions())
    values = trainer.eval(batches)
    first, last = (trainer.runner._eval_batch(batch)["labels"] for batch in (batches[0], batches[-1]))
    print("RESULT " + json.dumps({"devices": int(trainer.mesh.devices.size), "values": values,
                                  "first_batch_split": not first.sharding.is_fully_replicated,
                                  "last_batch_placed": hasattr(last, "sharding")}))
    """
)


def test_four_simulated_devices_equal_sklearn(data):
    """Batches split over a 4-device mesh (the 13-sample one kept whole on every device) give the same values."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", FOUR_DEVICES, str(HERE)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["devices"] == 4
    assert result["first_batch_split"] and not result["last_batch_placed"]  # 16 samples split, 13 kept whole
    assert_equals_sklearn(result["values"], cases.sklearn_values(data))


TWO_PROCESSES = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import jax
    import metric_cases as cases
    from composerjax import Trainer

    # Each process loads its half of every global batch; the eval step sees the global batches.
    local = cases.batches(cases.predictions(), cases.EVEN_SIZES, jax.process_index(), jax.process_count())
    trainer = Trainer(cases.PredictionsModel(), progress_bar=False, run_summary=False)
    values = trainer.eval(local)
    print("RESULT " + json.dumps({"processes": jax.process_count(), "devices": jax.device_count(),
                                  "local_rows": sum(len(batch["labels"]) for batch in local), "values": values}))
    """
)


def test_two_launched_processes_equal_sklearn_on_the_global_data(tmp_path, data):
    script = tmp_path / "eval_metrics.py"
    script.write_text(TWO_PROCESSES)
    run = subprocess.run([sys.executable, "-m", "composerjax", "launch", "-n", "2", "--devices-per-process", "2",
                          str(script), str(HERE)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = {}
    for line in run.stdout.splitlines():
        prefix, _, payload = line.partition("] RESULT ")
        if payload:
            results[int(prefix.removeprefix("[rank "))] = json.loads(payload)
    assert sorted(results) == [0, 1]
    expected = cases.sklearn_values(cases.subset(data, sum(cases.EVEN_SIZES)))
    for result in results.values():
        assert (result["processes"], result["devices"], result["local_rows"]) == (2, 4, sum(cases.EVEN_SIZES) // 2)
        assert_equals_sklearn(result["values"], expected)
