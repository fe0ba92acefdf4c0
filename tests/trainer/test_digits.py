"""Real data: the small CNN reaches at least 95% test accuracy on the digits images."""

from __future__ import annotations

import optax
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.data.digits import load_digits_split
from composerjax.models import SmallCNN


def test_small_cnn_reaches_95_percent_on_digits():
    (x_train, y_train), (x_test, y_test) = load_digits_split(seed=0)
    trainer = Trainer(
        ComposerClassifier(SmallCNN(num_classes=10, channels=16, rngs=nnx.Rngs(0)), num_classes=10),
        ArrayLoader((x_train, y_train), batch_size=32, seed=0),
        max_duration="4ep",
        optimizers=optax.adam(3e-3),
        eval_dataloader=ArrayLoader((x_test, y_test), batch_size=99, shuffle=False),
        progress_bar=False,
    )
    trainer.fit()
    results = trainer.state.metrics["eval"]  # the end-of-epoch eval of the last epoch
    assert results["MulticlassAccuracy"] >= 0.95, results
    assert trainer.eval() == results  # evaluating again gives the same numbers
    assert trainer.compile_count == 2  # one train step, one eval step
