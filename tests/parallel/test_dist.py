"""composerjax.parallel.dist: single-process semantics, error paths, and the collectives across 2 launched processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from composerjax.parallel import dist

CLUSTER_VARIABLES = (
    "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX", "TPU_PROCESS_ADDRESSES",
    "TPU_WORKER_HOSTNAMES", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "COMPOSERJAX_COORDINATOR",
    "COMPOSERJAX_NUM_PROCESSES", "COMPOSERJAX_PROCESS_ID", "COMPOSERJAX_DEVICES_PER_PROCESS",
    "COMPOSERJAX_LOCAL_RANK", "COMPOSERJAX_NODE_RANK",
)


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher or cluster variable from the machine running the tests."""
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# -- one process -----------------------------------------------------------------------------------
def test_ranks_of_a_single_process(clean_env):
    assert (dist.process_index(), dist.process_count(), dist.is_global_zero()) == (0, 1, True)
    assert (dist.local_process_index(), dist.node_rank()) == (0, 0)
    assert dist.launched() is False


def test_local_and_node_rank_come_from_the_first_variable_set(clean_env):
    clean_env.setenv("LOCAL_RANK", "5")
    clean_env.setenv("GROUP_RANK", "4")
    assert (dist.local_process_index(), dist.node_rank()) == (5, 4)
    clean_env.setenv("SLURM_LOCALID", "2")
    clean_env.setenv("SLURM_NODEID", "1")
    assert (dist.local_process_index(), dist.node_rank()) == (2, 1)
    clean_env.setenv("COMPOSERJAX_LOCAL_RANK", "3")
    clean_env.setenv("COMPOSERJAX_NODE_RANK", "0")
    assert (dist.local_process_index(), dist.node_rank()) == (3, 0)
    clean_env.setenv("COMPOSERJAX_LOCAL_RANK", "three")
    with pytest.raises(ValueError, match=r"COMPOSERJAX_LOCAL_RANK must be an integer >= 0, got 'three'"):
        dist.local_process_index()


def test_local_rank_without_any_variable_in_a_multi_process_run_is_an_error(clean_env):
    clean_env.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(RuntimeError, match="2 processes run but none of COMPOSERJAX_LOCAL_RANK, SLURM_LOCALID"):
        dist.local_process_index()


def test_collectives_of_one_process_are_identities():
    assert dist.barrier() is None and dist.barrier("named") is None
    value = {"lr": np.float32(0.5), "seed": 7, "flags": np.array([True, False]), "xs": np.arange(3.0)}
    shared = dist.broadcast(value)
    assert shared["seed"] == 7 and type(shared["seed"]) is int
    assert shared["lr"].dtype == np.float32 and shared["lr"] == np.float32(0.5)
    np.testing.assert_array_equal(shared["flags"], [True, False])
    assert shared["flags"].dtype == np.bool_
    np.testing.assert_array_equal(shared["xs"], [0.0, 1.0, 2.0])

    gathered = dist.all_gather({"rank": 0, "xy": np.array([[1, 2]], dtype=np.int16)})
    assert gathered["rank"].shape == (1,) and gathered["rank"].tolist() == [0]
    assert gathered["xy"].shape == (1, 1, 2) and gathered["xy"].dtype == np.int16


@pytest.mark.parametrize(("op", "expected"), [("sum", 6), ("mean", 6.0), ("max", 6), ("min", 6)])
def test_all_reduce_of_one_process(op, expected):
    result = dist.all_reduce(6, op=op)
    assert result == expected and type(result) is type(expected)
    np.testing.assert_array_equal(dist.all_reduce(np.array([1.5, -2.0]), op=op), [1.5, -2.0])
    tree = dist.all_reduce({"a": 1.25, "b": [np.int32(3)]}, op=op)
    assert tree["a"] == 1.25 and int(tree["b"][0]) == 3


def test_reduce_metrics_of_one_process_keeps_names_and_order():
    reduced = dist.reduce_metrics({"loss/train": 0.5, "accuracy": np.float32(0.25), "count": 3})
    assert reduced == {"loss/train": 0.5, "accuracy": 0.25, "count": 3.0}
    assert list(reduced) == ["loss/train", "accuracy", "count"]
    assert all(type(value) is float for value in reduced.values())
    assert dist.reduce_metrics({}) == {}


def test_bad_op_and_src_name_the_parameter_and_what_is_accepted():
    with pytest.raises(ValueError, match=r"all_reduce: `op` must be one of 'sum', 'mean', 'max', 'min', got 'avg'"):
        dist.all_reduce(1.0, op="avg")
    with pytest.raises(ValueError, match=r"reduce_metrics: `op` must be one of .*got 'median'"):
        dist.reduce_metrics({"loss": 1.0}, op="median")
    with pytest.raises(ValueError, match=r"broadcast: `src` must be a process index in \[0, 1\) .*got 1"):
        dist.broadcast(1.0, src=1)
    with pytest.raises(ValueError, match=r"got -1"):
        dist.broadcast(1.0, src=-1)
    with pytest.raises(TypeError, match="only numbers and arrays of numbers"):
        dist.all_gather({"name": "run-1"})


# -- initialize ------------------------------------------------------------------------------------
def test_initialize_without_launcher_or_cluster_does_nothing(clean_env):
    assert dist.initialize() is False
    assert dist.detect_cluster() is None
    assert jax.process_count() == 1


@pytest.mark.parametrize(("variables", "cluster"), [
    ({"SLURM_JOB_ID": "17", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "slurm"),
    ({"SLURM_JOB_ID": "17", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, None),  # a single-task job
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "openmpi"),
    ({"OMPI_COMM_WORLD_SIZE": "1"}, None),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "3"}, "kubernetes"),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, None),  # a pod, not an indexed job
    ({"TPU_WORKER_HOSTNAMES": "host-a,host-b"}, "tpu"),
    ({"TPU_WORKER_HOSTNAMES": "host-a"}, None),
])
def test_detect_cluster(clean_env, variables, cluster):
    for name, value in variables.items():
        clean_env.setenv(name, value)
    assert dist.detect_cluster() == cluster


def test_initialize_after_the_backend_started_says_what_to_do(clean_env):
    jax.devices()  # the backend of this test process is running
    with pytest.raises(RuntimeError, match=r"cannot join 127.0.0.1:1234 as process 0 of 2: JAX's backend already "
                                           r"started.*Import composerjax before creating any JAX array"):
        dist.initialize("127.0.0.1:1234", num_processes=2, process_id=0)
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="cannot join the openmpi cluster"):
        dist.initialize()


def test_initialize_rejects_incomplete_or_bad_settings(clean_env):
    with pytest.raises(ValueError, match=r"missing `num_processes` \(or COMPOSERJAX_NUM_PROCESSES\), `process_id`"):
        dist.initialize("127.0.0.1:1234")
    with pytest.raises(ValueError, match=r"`process_id` must be in \[0, num_processes=2\), got 2"):
        dist.initialize("127.0.0.1:1234", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match=r"`coordinator_address` must be 'host:port', got 'localhost'"):
        dist.initialize("localhost", num_processes=2, process_id=0)
    with pytest.raises(ValueError, match=r"`local_device_count` must be an integer >= 1, got 0"):
        dist.initialize("127.0.0.1:1234", num_processes=2, process_id=0, local_device_count=0)
    clean_env.setenv("COMPOSERJAX_COORDINATOR", "127.0.0.1:1234")
    clean_env.setenv("COMPOSERJAX_NUM_PROCESSES", "two")
    clean_env.setenv("COMPOSERJAX_PROCESS_ID", "0")
    with pytest.raises(ValueError, match=r"COMPOSERJAX_NUM_PROCESSES must be an integer >= 1, got 'two'"):
        dist.initialize()


# -- two processes ---------------------------------------------------------------------------------
COLLECTIVES_SCRIPT = textwrap.dedent(
    """
    import json
    import numpy as np
    from composerjax.parallel import dist

    rank = dist.process_index()
    results = {
        "ranks": [rank, dist.process_count(), dist.local_process_index(), dist.node_rank(), dist.is_global_zero()],
        "launched": dist.launched(),
        "all_gather": dist.all_gather(rank).tolist(),
        "all_gather_rows": dist.all_gather(np.array([rank, 10 * rank], dtype=np.int32)).tolist(),
        "broadcast": dist.broadcast({"who": rank, "xs": np.full(3, rank + 0.5, dtype=np.float32)}, src=1),
        "sum": dist.all_reduce(rank + 1, op="sum"),
        "mean": dist.all_reduce(np.array([rank, 4.0]), op="mean").tolist(),
        "max": dist.all_reduce({"a": rank * 3, "b": -rank}, op="max"),
        "min": dist.all_reduce(rank + 1.5, op="min"),
        "metrics": dist.reduce_metrics({"loss": 1.0 + rank, "accuracy": 0.5 * rank}),
        "metrics_max": dist.reduce_metrics({"loss": 1.0 + rank}, op="max"),
    }
    results["broadcast"] = {"who": results["broadcast"]["who"], "xs": results["broadcast"]["xs"].tolist()}
    # MemoryMonitor's dist_aggregate_batch_interval and SystemMetricsMonitor's device statistics.
    from composerjax.callbacks.memory_monitor import aggregate_over_processes
    from composerjax.callbacks.system_metrics_monitor import _all_processes
    import jax
    own = {"host_rss_bytes": 100.0 * (rank + 1)} | ({"device_bytes_in_use": 7.0} if rank == 0 else {})
    results["memory"] = aggregate_over_processes(own, ["device_bytes_in_use", "host_rss_bytes"])
    results["devices"] = _all_processes({d.id: {"bytes_in_use": 10.0 * d.id} for d in jax.local_devices()})
    results["device_ids"] = sorted(d.id for d in jax.devices())
    dist.barrier("before-mismatch")
    try:
        dist.reduce_metrics({"loss": 1.0, "extra": 2.0} if rank == 0 else {"loss": 1.0})
    except ValueError as error:
        results["mismatch"] = str(error)
    dist.barrier("done")
    print("RESULT " + json.dumps(results))
    """
)


def test_collectives_across_two_launched_processes(tmp_path):
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES_SCRIPT)
    run = subprocess.run([sys.executable, "-m", "composerjax", "launch", "-n", "2", "--devices-per-process", "2",
                          str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = {}
    for line in run.stdout.splitlines():
        prefix, _, payload = line.partition("] RESULT ")
        if payload:
            results[int(prefix.removeprefix("[rank "))] = json.loads(payload)
    assert sorted(results) == [0, 1]
    for rank, result in results.items():
        assert result["ranks"] == [rank, 2, rank, 0, rank == 0]
        assert result["launched"] is True
        assert result["all_gather"] == [0, 1]
        assert result["all_gather_rows"] == [[0, 0], [1, 10]]
        assert result["broadcast"] == {"who": 1, "xs": [1.5, 1.5, 1.5]}
        assert result["sum"] == 3
        assert result["mean"] == [0.5, 4.0]
        assert result["max"] == {"a": 3, "b": 0}
        assert result["min"] == 1.5
        assert result["metrics"] == {"loss": 1.5, "accuracy": 0.25}
        assert result["metrics_max"] == {"loss": 2.0}
        assert result["memory"] == {"device_bytes_in_use_avg": 7.0, "device_bytes_in_use_min": 7.0,
                                    "device_bytes_in_use_max": 7.0, "host_rss_bytes_avg": 150.0,
                                    "host_rss_bytes_min": 100.0, "host_rss_bytes_max": 200.0}
        assert len(result["device_ids"]) == 4
        assert result["devices"] == {str(d): {"bytes_in_use": 10.0 * d} for d in result["device_ids"]}
        assert result["mismatch"] == ("reduce_metrics: every process must pass the same metric names; "
                                      "process 1 lacks ['extra']")
