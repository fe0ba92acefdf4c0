"""Data parallel by default: 4 simulated CPU devices train to the same parameters as 1 device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np, optax
    from flax import nnx
    from composerjax import ArrayLoader, ComposerClassifier, Trainer

    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype(np.float32)
    y = rng.integers(0, 4, size=128).astype(np.int32)
    rngs = nnx.Rngs(0)
    model = ComposerClassifier(nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), nnx.relu, nnx.Linear(16, 4, rngs=rngs)), 4)
    trainer = Trainer(model, ArrayLoader((x, y), batch_size=16, seed=3), "12ba", optax.adam(1e-2),
                      progress_bar=False)
    trainer.fit()
    params = trainer.state.train_state.params
    leaf = jax.tree.leaves(params)[0]
    print(json.dumps({
        "devices": trainer.mesh.devices.size,
        "param_devices": len(leaf.sharding.device_set),
        "params": [np.asarray(p).ravel().tolist() for p in jax.tree.leaves(params)],
        "compiles": trainer.compile_count,
    }))
    """
)


def run(devices: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_four_devices_match_one_device():
    one, four = run(1), run(4)
    assert one["devices"] == 1 and four["devices"] == 4
    assert four["param_devices"] == 4  # parameters replicated over the whole mesh
    assert one["compiles"] == four["compiles"] == 1
    for a, b in zip(one["params"], four["params"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
