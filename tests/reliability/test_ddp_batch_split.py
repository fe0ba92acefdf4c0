"""ddp splits the batch: inside the compiled step on 4 devices, each device holds a quarter of the rows.

Equal parameters on 1 and 4 devices (tests/parallel) would hold just as well for a batch copied to
every device, so this looks inside the step: ``jax.debug.inspect_array_sharding`` reports how the
partitioned step lays out the batch it received, and a ``partitioned=True`` debug callback hands
over each device's own piece of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, threading
    import jax, numpy as np, optax
    from flax import nnx
    from composerjax import Algorithm, ArrayLoader, ComposerClassifier, Event, Trainer

    class BatchProbe(Algorithm):
        # At BEFORE_FORWARD, inside the compiled step: the batch's sharding and each device's rows.
        events = frozenset({Event.BEFORE_FORWARD})

        def __init__(self):
            self.shardings, self.pieces, self.lock = [], [], threading.Lock()

        def match(self, event, state):
            return event == Event.BEFORE_FORWARD

        def apply(self, event, state, logger):
            x = state.batch[0]
            jax.debug.inspect_array_sharding(x, callback=self.shardings.append)  # once, when compiled
            jax.debug.callback(self.piece, x, partitioned=True)  # every step, once per device

        def piece(self, local):
            with self.lock:
                self.pieces.append(np.asarray(local).tolist())

    # Row i of x holds i in every column, so a piece tells which rows it is.
    x = np.repeat(np.arange(64, dtype=np.float32)[:, None], 8, axis=1)
    y = (np.arange(64) % 4).astype(np.int32)
    report = {}
    for parallelism in ("ddp", "fsdp"):
        rngs = nnx.Rngs(0)
        model = ComposerClassifier(nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), nnx.relu,
                                                  nnx.Linear(16, 4, rngs=rngs)), 4)
        probe = BatchProbe()
        trainer = Trainer(model, ArrayLoader((x, y), batch_size=16, shuffle=False), "2ba", optax.sgd(0.01),
                          algorithms=[probe], parallelism=parallelism, progress_bar=False, run_summary=False)
        trainer.fit()
        jax.block_until_ready(trainer.state.train_state)
        (sharding,) = probe.shardings
        layout = sharding.devices_indices_map((16, 8))
        report[parallelism] = {
            "devices": int(trainer.mesh.devices.size),
            "mesh": dict(trainer.mesh.shape),
            "spec": [list(axis) if isinstance(axis, tuple) else axis for axis in sharding.spec],
            "shard_shape": list(sharding.shard_shape((16, 8))),
            "rows_by_device": sorted(index[0].indices(16)[:2] for index in layout.values()),
            "pieces": sorted([int(row[0]) for row in piece] for piece in probe.pieces),
        }
    print(json.dumps(report))
    """
)


def test_ddp_and_fsdp_give_each_of_4_devices_a_quarter_of_the_batch():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # Batch 0 is rows 0-15, batch 1 rows 16-31 (no shuffling): each device gets 4 consecutive rows of each.
    quarters = [list(range(start, start + 4)) for start in range(0, 32, 4)]
    for parallelism in ("ddp", "fsdp"):
        result = report[parallelism]
        assert result["devices"] == 4
        assert result["shard_shape"] == [4, 8], result  # a replicated batch would be [16, 8]
        assert result["rows_by_device"] == [[0, 4], [4, 8], [8, 12], [12, 16]], result
        assert result["pieces"] == quarters, result  # 2 steps x 4 devices: each row once
    # The batch dimension is split over the data-parallel axis of each mesh.
    assert report["ddp"]["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    assert report["ddp"]["spec"][0] in ("data", ["data"], ["data", "fsdp"])
    assert report["fsdp"]["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert report["fsdp"]["spec"][0] in ("fsdp", ["fsdp"], ["data", "fsdp"])
