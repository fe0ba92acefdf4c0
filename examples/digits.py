"""Train the small CNN on scikit-learn's bundled digits images (offline) and report test accuracy.

Run with ``make demo``. Logs go to ``runs/digits/metrics.jsonl``.
"""

from __future__ import annotations

import time

import optax
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.data.digits import load_digits_split
from composerjax.loggers import FileLogger, ProgressBarLogger
from composerjax.models import SmallCNN

SEED = 0
LOG_PATH = "runs/digits/metrics.jsonl"


def main() -> None:
    (x_train, y_train), (x_test, y_test) = load_digits_split(seed=SEED)
    model = ComposerClassifier(SmallCNN(num_classes=10, rngs=nnx.Rngs(SEED)), num_classes=10)
    trainer = Trainer(
        model,
        ArrayLoader((x_train, y_train), batch_size=32, seed=SEED),
        max_duration="6ep",
        optimizers=optax.adam(3e-3),
        eval_dataloader=ArrayLoader((x_test, y_test), batch_size=99, shuffle=False),
        loggers=[FileLogger(LOG_PATH)],
        progress_bar=False,
        seed=SEED,
        run_name="digits",
    )
    # The demo always shows the bar, even when make's output is not a terminal.
    trainer.logger.destinations.append(ProgressBarLogger(force=True))
    start = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - start
    results = trainer.eval()
    trainer.close()
    print(f"\ndigits: {len(x_train)} train / {len(x_test)} test images, {trainer.state.timestamp.epoch} epochs, "
          f"{trainer.state.timestamp.batch} batches in {seconds:.1f}s ({trainer.compile_count} compiles)")
    print(f"test accuracy: {results['accuracy']:.4f}   test cross-entropy: {results['cross_entropy']:.4f}")
    print(f"logs: {LOG_PATH}")


if __name__ == "__main__":
    main()
