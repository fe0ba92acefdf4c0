"""ddp, fsdp, ParallelismConfig and tensor-parallel rules on 4 and 8 simulated devices equal one device."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from composerjax.parallel import GPT_TENSOR_PARALLEL_RULES, ParallelismConfig, resolve_devices

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np, optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from composerjax import ArrayLoader, ComposerClassifier, Trainer
    from composerjax.algorithms import EMA
    from composerjax.models import GPT2, GPT2Config, TinyGPT
    from composerjax.parallel import GPT_TENSOR_PARALLEL_RULES, ParallelismConfig

    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype(np.float32)
    y = rng.integers(0, 4, size=128).astype(np.int32)
    tokens = rng.integers(0, 256, size=(64, 17)).astype(np.int32)

    def mlp():
        rngs = nnx.Rngs(0)
        return ComposerClassifier(nnx.Sequential(nnx.Linear(8, 64, rngs=rngs), nnx.relu,
                                                 nnx.Linear(64, 4, rngs=rngs)), 4)

    def values(tree):
        return [np.asarray(leaf).ravel().tolist() for leaf in jax.tree.leaves(jax.device_get(tree))]

    def per_device_param_bytes(trainer):
        device = trainer.mesh.devices.flat[0]
        total = 0
        for leaf in jax.tree.leaves(trainer.state.train_state.params):
            total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
        return total

    def train(kind, parallelism, devices):
        if kind == "mlp":
            trainer = Trainer(mlp(), ArrayLoader((x, y), batch_size=16, seed=3), "10ba", optax.adam(1e-2),
                              algorithms=[EMA(half_life="2ba")], parallelism=parallelism, devices=devices,
                              progress_bar=False, run_summary=False)
        elif kind == "gpt2":  # partition metadata only (no rules): Megatron tensor splits, fsdp on a free dimension
            model = GPT2(GPT2Config.preset("gpt2-tiny", vocab_size=256, n_positions=16, n_embd=32, n_layer=1),
                         rngs=nnx.Rngs(0))
            trainer = Trainer(ComposerClassifier(model, 256), ArrayLoader((tokens[:, :-1], tokens[:, 1:]), 8, seed=0),
                              "4ba", optax.sgd(0.3), parallelism=parallelism, devices=devices,
                              progress_bar=False, run_summary=False)
        else:
            # SGD: the key bias's gradient is zero up to rounding, and adam would blow that rounding up.
            model = TinyGPT(dim=32, depth=1, num_heads=2, max_length=16, rngs=nnx.Rngs(0))
            trainer = Trainer(ComposerClassifier(model, 256), ArrayLoader((tokens[:, :-1], tokens[:, 1:]), 8, seed=0),
                              "4ba", optax.sgd(0.3), parallelism=parallelism, devices=devices,
                              progress_bar=False, run_summary=False)
        trainer.fit()
        state = trainer.state.train_state
        specs = {"/".join(str(getattr(k, "key", k)) for k in path): str(leaf.sharding.spec)
                 for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]}
        return {"params": values(state.params), "ema": values(state.algorithm_state),
                "specs": specs, "bytes": per_device_param_bytes(trainer), "mesh": dict(trainer.mesh.shape),
                "compiles": trainer.compile_count}

    configs = {
        "ddp": "ddp", "fsdp": "fsdp",
        "data2_fsdp2": ParallelismConfig(fsdp=2),
        "tensor2": ParallelismConfig(tensor=2, rules=GPT_TENSOR_PARALLEL_RULES),
    }
    # Every strategy for this device count in one process: one JAX start, one single-device reference per model.
    report = {}
    kinds = [("mlp", ["ddp", "fsdp", "data2_fsdp2"]), ("gpt", ["tensor2"])]
    if jax.device_count() == 4:
        configs["fsdp2_tensor2"] = ParallelismConfig(fsdp=2, tensor=2)
        kinds.append(("gpt2", ["fsdp2_tensor2"]))
    for kind, names in kinds:
        one = train(kind, "ddp", 1)
        for name in names:
            report[f"{kind}/{name}"] = {"one": one, "many": train(kind, configs[name], "auto")}
    print(json.dumps(report))
    """
)


@functools.cache
def run_all(devices: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(devices: int, kind: str, parallelism: str) -> dict:
    return run_all(devices)[f"{kind}/{parallelism}"]


def assert_close(a: list, b: list) -> None:
    assert len(a) == len(b)
    for left, right in zip(a, b):
        np.testing.assert_allclose(left, right, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("devices,parallelism", [(4, "ddp"), (8, "ddp"), (4, "fsdp"), (8, "fsdp"), (8, "data2_fsdp2")])
def test_strategies_train_to_the_single_device_parameters(devices, parallelism):
    report = run(devices, "mlp", parallelism)
    one, many = report["one"], report["many"]
    assert_close(one["params"], many["params"])
    assert_close(one["ema"], many["ema"])  # EMA's averages mirror the parameters' layout
    assert many["compiles"] == 1
    fsdp = {"ddp": 1, "fsdp": devices, "data2_fsdp2": 2}[parallelism]
    assert many["mesh"] == {"data": devices // fsdp, "fsdp": fsdp, "tensor": 1}
    if fsdp == 1:
        assert many["bytes"] == one["bytes"]
    else:
        # Parameters (8x64, 64, 64x4, 4) split on a dimension fsdp divides; the rest stay whole.
        shapes = [(64,), (8, 64), (4,), (64, 4)]
        expected = sum(4 * int(np.prod(s)) // (fsdp if any(d % fsdp == 0 for d in s) else 1) for s in shapes)
        assert many["bytes"] == expected and expected <= one["bytes"] / fsdp + 4 * 4
        assert many["specs"]["module/layers/0/kernel"] == str(P(None, "fsdp"))
        assert many["specs"]["module/layers/2/kernel"] == str(P("fsdp"))


@pytest.mark.parametrize("devices", [4, 8])
def test_tensor_parallel_gpt_equals_the_unsharded_one(devices):
    report = run(devices, "gpt", "tensor2")
    one, many = report["one"], report["many"]
    assert many["mesh"] == {"data": devices // 2, "fsdp": 1, "tensor": 2}
    assert many["specs"]["module/blocks/0/attention/qkv/kernel"] == str(P(None, "tensor"))
    assert many["specs"]["module/blocks/0/mlp/down/kernel"] == str(P("tensor"))
    assert many["specs"]["module/tokens/embedding"] == str(P())
    assert many["bytes"] < one["bytes"]
    assert_close(one["params"], many["params"])


def test_gpt2_partition_metadata_with_fsdp_and_tensor_parallelism_equals_one_device():
    report = run(4, "gpt2", "fsdp2_tensor2")
    one, many = report["one"], report["many"]
    assert many["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}
    specs = many["specs"]
    assert specs["module/blocks/0/attention/qkv/kernel"] == str(P("fsdp", "tensor"))  # columns over 'tensor'
    assert specs["module/blocks/0/attention/proj/kernel"] == str(P("tensor", "fsdp"))  # rows over 'tensor'
    assert specs["module/blocks/0/mlp/up/bias"] == str(P("tensor"))
    assert specs["module/tokens/embedding"] == str(P("fsdp"))  # no metadata: fsdp on the largest dimension
    assert many["bytes"] < one["bytes"] / 2.5  # the matrices are split 4 ways; norms and biases mostly not
    assert_close(one["params"], many["params"])


def test_spec_for_rules_metadata_and_fsdp():
    mesh = {"data": 1, "fsdp": 2, "tensor": 2}
    config = ParallelismConfig(fsdp=2, tensor=2, rules=GPT_TENSOR_PARALLEL_RULES)
    # A rule's spec, with fsdp on the dimension it leaves free.
    assert config.spec_for("module/blocks/0/mlp/up/kernel", (64, 256), mesh) == P("fsdp", "tensor")
    # NNX partitioning metadata wins over the rule.
    assert config.spec_for("module/blocks/0/mlp/up/kernel", (64, 256), mesh, P("tensor", None)) == P("tensor", "fsdp")
    # No rule: fsdp on the largest dimension it divides; nothing divisible stays replicated.
    assert config.spec_for("module/norm/scale", (6, 64), mesh) == P(None, "fsdp")
    assert config.spec_for("module/odd", (3, 5), mesh) == P()
    assert ParallelismConfig(fsdp=2, min_fsdp_size=1000).spec_for("w", (64, 4), mesh) == P()
    with pytest.raises(ValueError, match="does not divide"):
        ParallelismConfig(tensor=2, rules=[("w", P("tensor"))]).spec_for("w", (3,), mesh)


def test_bad_parallelism_arguments_name_the_field():
    with pytest.raises(ValueError, match=r"ParallelismConfig\(fsdp=0\)"):
        ParallelismConfig(fsdp=0)
    with pytest.raises(ValueError, match="axis 'model' is not a mesh axis"):
        ParallelismConfig(rules=[("kernel", P("model"))])
    with pytest.raises(ValueError, match=r"rules\[0\]"):
        ParallelismConfig(rules=[("kernel",)])


def test_device_requests_the_machine_cannot_satisfy_fail_with_what_is_available():
    count = len(jax.devices("cpu"))
    assert resolve_devices("cpu", "auto") == jax.devices("cpu")
    assert resolve_devices("auto", 1) == jax.devices()[:1]
    with pytest.raises(ValueError, match=r"accelerator='tpu': no tpu devices on this machine; available: cpu"):
        resolve_devices("tpu", "auto")
    with pytest.raises(ValueError, match=rf"devices={count + 1}: this process has {count} cpu device"):
        resolve_devices("cpu", count + 1)
    with pytest.raises(ValueError, match=r"devices=\[0, 0\]: expected distinct indices"):
        resolve_devices("cpu", [0, 0])
    with pytest.raises(ValueError, match="accelerator='npu'"):
        resolve_devices("npu", "auto")


def test_nnx_partitioning_metadata_wins_over_rules_in_the_trainer():
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from composerjax import ArrayLoader, Trainer

    with nnx.use_eager_sharding(False):
        rngs = nnx.Rngs(0)
        annotated = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "tensor"))
        model = nnx.Sequential(nnx.Linear(4, 8, kernel_init=annotated, rngs=rngs), nnx.Linear(8, 2, rngs=rngs))
    x = np.ones((8, 4), np.float32)
    rules = [(r"kernel$", P("tensor", None))]
    trainer = Trainer(model, ArrayLoader((x, x[:, :2]), batch_size=4), "1ba", optax.sgd(0.1),
                      loss_fn=lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), devices=1,
                      parallelism=ParallelismConfig(rules=rules), progress_bar=False, run_summary=False)
    trainer.fit()
    params = trainer.state.train_state.params["layers"]
    assert params[0]["kernel"].sharding.spec == P(None, "tensor")  # from with_partitioning
    assert params[1]["kernel"].sharding.spec == P("tensor")  # from the rule
