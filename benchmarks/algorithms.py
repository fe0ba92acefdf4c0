"""Per-algorithm cost: steady-state step-time ratio against the same trainer without it, and compiles.

Each algorithm gets its own trainer; a baseline trainer on the same model and data runs interleaved
with it (round-robin, several rounds, in one process) and the ratio is total time over total time,
so machine noise hits both alike. Image algorithms run on SmallResNet over 16x16 images (the digits
upsampled), language algorithms on TinyGPT over pydoc bytes. Compiles are counted over the whole
benchmark run of that trainer; shape schedules (progressive resizing, sequence-length warmup) are
measured over a run that crosses their schedule, leaving out the rounds in which they compiled.

Run: ``.venv/bin/python benchmarks/algorithms.py [--rounds 5] [--batches 10] [--only MixUp,EMA]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax import algorithms as alg
from composerjax.data.digits import load_digits_split
from composerjax.data.text import byte_windows, load_pydoc_bytes
from composerjax.models import SmallResNet, TinyGPT

IMAGE_ALGORITHMS: dict[str, Callable[[], Any]] = {
    "LabelSmoothing": lambda: alg.LabelSmoothing(0.1),
    "MixUp": lambda: alg.MixUp(0.2),
    "CutMix": lambda: alg.CutMix(1.0),
    "CutOut": lambda: alg.CutOut(),
    "ColOut": lambda: alg.ColOut(),
    "RandAugment": lambda: alg.RandAugment(),
    "AugMix": lambda: alg.AugMix(),
    "ProgressiveResizing": lambda: alg.ProgressiveResizing(initial_scale=0.5, size_increment=4),
    "SelectiveBackprop": lambda: alg.SelectiveBackprop(start=0.0, end=1.0, keep=0.5, interrupt=0),
    "GradientClipping": lambda: alg.GradientClipping("norm", 1.0),
    "SAM": lambda: alg.SAM(rho=0.05),
    "EMA": lambda: alg.EMA(half_life="10ba"),
    "SWA": lambda: alg.SWA(swa_start="0.0dur", swa_end="1.0dur", update_interval="1ba"),
    "LayerFreezing": lambda: alg.LayerFreezing(freeze_start=0.0, freeze_level=0.5),
    "BlurPool": lambda: alg.BlurPool(min_channels=1),
    "SqueezeExcite": lambda: alg.SqueezeExcite(latent_channels=0.25, min_channels=16),
    "StochasticDepth": lambda: alg.StochasticDepth("BasicBlock", drop_rate=0.2),
    "GhostBatchNorm": lambda: alg.GhostBatchNorm(ghost_batch_size=16),
    "WeightStandardization": lambda: alg.WeightStandardization(),
    "Factorize": lambda: alg.Factorize(min_channels=16, latent_channels=0.25, min_features=16, latent_features=0.25),
    "NoOpModel": lambda: alg.NoOpModel(),
}
TEXT_ALGORITHMS: dict[str, Callable[[], Any]] = {
    "SeqLengthWarmup": lambda: alg.SeqLengthWarmup(duration=0.5, min_seq_length=16, max_seq_length=64,
                                                   step_size=16),
    "Alibi": lambda: alg.Alibi(max_sequence_length=64, train_sequence_length_scaling=1.0),
    "GatedLinearUnits": lambda: alg.GatedLinearUnits(),
    "LowPrecisionLayerNorm": lambda: alg.LowPrecisionLayerNorm(precision="bf16"),
}
SCHEDULES = {"ProgressiveResizing", "SeqLengthWarmup"}


def image_data() -> tuple[np.ndarray, np.ndarray]:
    (x, y), _ = load_digits_split()
    x = np.asarray(jax.image.resize(x, (x.shape[0], 16, 16), "bilinear"))
    return x, y


def text_data() -> tuple[np.ndarray, np.ndarray]:
    return byte_windows(load_pydoc_bytes()[:200_000], 64)


def make_trainer(kind: str, data: tuple[np.ndarray, np.ndarray], algorithms: list[Any], total: int) -> Trainer:
    if kind == "image":
        model = ComposerClassifier(SmallResNet(num_classes=10, width=32, rngs=nnx.Rngs(0)), 10)
        batch_size = 64
    else:
        model = ComposerClassifier(TinyGPT(dim=64, depth=2, num_heads=4, max_length=64, rngs=nnx.Rngs(0)), 256)
        batch_size = 32
    return Trainer(model, ArrayLoader(data, batch_size, seed=0), f"{total}ba", optax.adam(1e-3),
                   algorithms=algorithms, progress_bar=False, run_summary=False)


def timed_fit(trainer: Trainer, batches: int) -> float:
    start = time.perf_counter()
    trainer.fit(f"{batches}ba")
    jax.block_until_ready(trainer.state.train_state)
    return time.perf_counter() - start


def measure(kind: str, name: str, factory: Callable[[], Any], data: Any, rounds: int, batches: int,
            baseline: Trainer) -> tuple[float, int]:
    total = 3 + rounds * batches
    trainer = make_trainer(kind, data, [factory()], total)
    timed_fit(trainer, 3)  # compile the first plan
    algorithm_time = baseline_time = 0.0
    for _ in range(rounds):
        compiles = trainer.compile_count
        base, algo = timed_fit(baseline, batches), timed_fit(trainer, batches)
        # Rounds in which a schedule compiled a new shape measure the compiler, not the step: skip them.
        if trainer.compile_count == compiles:
            baseline_time += base
            algorithm_time += algo
    if baseline_time == 0.0:
        return float("nan"), trainer.compile_count
    return algorithm_time / baseline_time, trainer.compile_count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=10, help="batches per round")
    parser.add_argument("--only", default="", help="comma-separated algorithm names")
    args = parser.parse_args()
    only = {name for name in args.only.split(",") if name}
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {args.rounds} interleaved rounds of "
          f"{args.batches} batches; ratio = algorithm step time / baseline step time")
    print(f"{'algorithm':24s} {'model':22s} {'step-time ratio':>16s} {'compiles':>9s}")
    for kind, table, data_fn, model_name in (
        ("image", IMAGE_ALGORITHMS, image_data, "SmallResNet 16x16 b64"),
        ("text", TEXT_ALGORITHMS, text_data, "TinyGPT T64 b32"),
    ):
        names = [name for name in table if not only or name in only]
        if not names:
            continue
        data = data_fn()
        baseline = make_trainer(kind, data, [], 10**9)
        timed_fit(baseline, 3)
        for name in names:
            ratio, compiles = measure(kind, name, table[name], data, args.rounds, args.batches, baseline)
            note = " (schedule: ratio over its run)" if name in SCHEDULES else ""
            print(f"{name:24s} {model_name:22s} {ratio:16.2f} {compiles:9d}{note}", flush=True)


if __name__ == "__main__":
    main()
