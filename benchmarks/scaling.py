"""Data-parallel and FSDP overhead on simulated CPU devices, against one device.

The same Trainer trains the medium MLP (784-512-512-10, global batch 128, adam) on one device, with
'ddp' over N devices and with 'fsdp' over N devices; runs are interleaved in one process and the
table shows median throughput ratios against one device. Simulated devices share this machine's
cores, so the ratio measures what a strategy costs (collectives, resharding, more dispatch), not a
speed-up; on real accelerators each device brings its own compute.

Run: ``.venv/bin/python benchmarks/scaling.py [--devices 4] [--rounds 8]``.
"""

from __future__ import annotations

import argparse
import os
import sys


def _devices_from_argv() -> int:
    for index, arg in enumerate(sys.argv):
        if arg == "--devices" and index + 1 < len(sys.argv):
            return int(sys.argv[index + 1])
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
    return 4


# The simulated device count must be set before JAX starts.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={_devices_from_argv()}").strip()

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from composerjax import ArrayLoader, ComposerClassifier, Trainer  # noqa: E402
from composerjax.models import MLP  # noqa: E402

SIZES = (784, 512, 512, 10)
BATCH = 128



def make_trainer(parallelism: str, devices: int | str, batches: int) -> Trainer:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * batches, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], size=BATCH * batches).astype(np.int32)
    model = ComposerClassifier(MLP(SIZES, rngs=nnx.Rngs(0)), SIZES[-1])
    return Trainer(model, ArrayLoader((x, y), batch_size=BATCH, seed=0), None, optax.adam(1e-3),
                   parallelism=parallelism, devices=devices, progress_bar=False, run_summary=False)


def per_device_param_bytes(trainer: Trainer) -> int:
    device = trainer.mesh.devices.flat[0]
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(trainer.state.train_state.params)
               for shard in leaf.addressable_shards if shard.device == device)


def timed_fit(trainer: Trainer, batches: int) -> float:
    start = time.perf_counter()
    trainer.fit(f"{batches}ba")
    jax.block_until_ready(trainer.state.train_state)
    return batches / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batches", type=int, default=40, help="batches per round")
    args = parser.parse_args()
    contenders = {
        "1 device": make_trainer("ddp", 1, args.batches),
        f"ddp x{args.devices}": make_trainer("ddp", "auto", args.batches),
        f"fsdp x{args.devices}": make_trainer("fsdp", "auto", args.batches),
    }
    for trainer in contenders.values():  # compile outside the timed rounds
        trainer.fit("2ba")
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, trainer in contenders.items():
            rates[name].append(timed_fit(trainer, args.batches))
    base = statistics.median(rates["1 device"])
    print(f"jax {jax.__version__}, {jax.device_count()} simulated CPU devices on {os.cpu_count()} cores; medium MLP "
          f"784-512-512-10, global batch {BATCH}, adam; {args.rounds} interleaved rounds of {args.batches} batches")
    print(f"{'strategy':14s} {'steps/s / 1 device':>19s} {'param bytes per device':>23s} {'compiles':>9s}")
    for name, trainer in contenders.items():
        ratio = statistics.median(rates[name]) / base
        print(f"{name:14s} {ratio:19.3f} {per_device_param_bytes(trainer):23d} {trainer.compile_count:9d}")


if __name__ == "__main__":
    main()
