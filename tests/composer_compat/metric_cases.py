"""The predictions, metrics and scikit-learn references that tests/composer_compat/test_metrics.py compares.

A helper module (not a test file), imported by the tests and by the scripts they run on 4 simulated
devices and in 2 launched processes, so every run sees the same numbers.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from sklearn import metrics as sk

from composerjax import ComposerModel
from composerjax.metrics import (
    BinaryAccuracy,
    BinaryAUROC,
    CrossEntropy,
    LanguageCrossEntropy,
    LanguagePerplexity,
    MaskedAccuracy,
    MeanAbsoluteError,
    MeanMetric,
    MeanSquaredError,
    MulticlassAccuracy,
    MulticlassAUROC,
    MulticlassF1Score,
    MulticlassPrecision,
    MulticlassRecall,
)

CLASSES = 5
#: Global batch sizes: unequal, each a multiple of 4 (2 processes x 2 devices split them evenly) ...
EVEN_SIZES = (16, 8, 20, 12, 4)
#: ... and a last batch that 4 devices do not divide (one process keeps it whole on every device).
SIZES = (*EVEN_SIZES, 13)


def predictions(seed: int = 0) -> dict[str, np.ndarray]:
    """Random predictions with ties, for ``sum(SIZES)`` samples; every class occurs in the first 60."""
    rng = np.random.default_rng(seed)
    count = sum(SIZES)
    labels = rng.integers(0, CLASSES, count).astype(np.int32)
    labels[:CLASSES] = np.arange(CLASSES)
    logits = np.round(rng.normal(size=(count, CLASSES)), 1).astype(np.float32)  # ties in argmax and ranks
    probs = np.exp(logits.astype(np.float64))
    probs /= probs.sum(axis=1, keepdims=True)
    lm_labels = labels.copy()
    lm_labels[rng.random(count) < 0.15] = -100  # padding the language metrics leave out
    return {
        "logits": logits,
        "smooth_logits": rng.normal(size=(count, CLASSES)).astype(np.float32),  # no ties: top-k is unambiguous
        "probs": probs.astype(np.float32),
        "labels": labels,
        "lm_labels": lm_labels,
        "binary_scores": (np.round(rng.random(count) * 20) / 20).astype(np.float32),  # steps of 0.05: ties
        "binary_labels": rng.integers(0, 2, count).astype(np.int32),
        "preds": np.round(rng.normal(size=count), 2).astype(np.float32),
        "targets": np.round(rng.normal(size=count), 2).astype(np.float32),
    }


def batches(data: dict[str, np.ndarray], sizes: tuple[int, ...] = SIZES, process: int = 0,
            processes: int = 1) -> list[dict[str, np.ndarray]]:
    """``data`` cut into batches of ``sizes``; with several processes, this process's equal share of each."""
    out, start = [], 0
    for size in sizes:
        share = size // processes
        first = start + process * share
        out.append({key: value[first:first + share] for key, value in data.items()})
        start += size
    return out


def eval_metrics() -> dict[str, Any]:
    """Every metric, by the name it is logged under."""
    return {
        "MulticlassAccuracy": MulticlassAccuracy(num_classes=CLASSES),
        "MulticlassAccuracyTop2": MulticlassAccuracy(num_classes=CLASSES, top_k=2),
        "MulticlassAccuracyMacro": MulticlassAccuracy(num_classes=CLASSES, average="macro"),
        "BinaryAccuracy": BinaryAccuracy(),
        "MaskedAccuracy": MaskedAccuracy(),
        "CrossEntropy": CrossEntropy(),
        "LanguageCrossEntropy": LanguageCrossEntropy(),
        "LanguagePerplexity": LanguagePerplexity(),
        "MulticlassPrecision": MulticlassPrecision(num_classes=CLASSES),
        "MulticlassPrecisionMicro": MulticlassPrecision(num_classes=CLASSES, average="micro"),
        "MulticlassRecall": MulticlassRecall(num_classes=CLASSES),
        "MulticlassRecallMicro": MulticlassRecall(num_classes=CLASSES, average="micro"),
        "MulticlassF1Score": MulticlassF1Score(num_classes=CLASSES),
        "MulticlassF1ScoreMicro": MulticlassF1Score(num_classes=CLASSES, average="micro"),
        "MulticlassF1ScoreWeighted": MulticlassF1Score(num_classes=CLASSES, average="weighted"),
        "BinaryAUROC": BinaryAUROC(),
        "MulticlassAUROC": MulticlassAUROC(num_classes=CLASSES),
        "MeanSquaredError": MeanSquaredError(),
        "MeanAbsoluteError": MeanAbsoluteError(),
        "MeanMetric": MeanMetric(),
    }


def route(metric: Any) -> tuple[str, str | None]:
    """Which predictions and targets of a batch ``metric`` reads."""
    if isinstance(metric, (BinaryAccuracy, BinaryAUROC)):
        return "binary_scores", "binary_labels"
    if isinstance(metric, (MeanSquaredError, MeanAbsoluteError)):
        return "preds", "targets"
    if isinstance(metric, MeanMetric):
        return "preds", None
    if isinstance(metric, (LanguageCrossEntropy, MaskedAccuracy)):
        return "logits", "lm_labels"
    if isinstance(metric, MulticlassAUROC):
        return "probs", "labels"
    if isinstance(metric, MulticlassAccuracy) and metric.top_k > 1:
        return "smooth_logits", "labels"
    return "logits", "labels"


def update(metric: Any, outputs: dict[str, Any], batch: dict[str, Any]) -> Any:
    """``metric`` updated with the batch's predictions for it."""
    prediction, target = route(metric)
    return metric.update(outputs[prediction]) if target is None else metric.update(outputs[prediction], batch[target])


class PredictionsModel(ComposerModel):
    """Outputs the predictions its batch carries (times a parameter of 1): metrics see exactly those numbers."""

    def __init__(self) -> None:
        self.scale = nnx.Param(jnp.ones(()))

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {key: value * self.scale if value.dtype.kind == "f" else value for key, value in batch.items()}

    def loss(self, outputs: dict[str, Any], batch: dict[str, Any]) -> Any:
        return jnp.mean((outputs["preds"] - batch["targets"]) ** 2)

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return {} if is_train else eval_metrics()

    def update_metric(self, batch: dict[str, Any], outputs: dict[str, Any], metric: Any) -> Any:
        return update(metric, outputs, batch)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def sklearn_values(data: dict[str, np.ndarray]) -> dict[str, float]:
    """scikit-learn's value of every metric of :func:`eval_metrics` on all of ``data``."""
    labels, logits = data["labels"], data["logits"]
    predicted = np.argmax(logits, axis=1)
    classes = list(range(CLASSES))
    kept = data["lm_labels"] != -100
    language = sk.log_loss(data["lm_labels"][kept], softmax(logits[kept]), labels=classes)
    preds, targets = data["preds"].astype(np.float64), data["targets"].astype(np.float64)
    return {
        "MulticlassAccuracy": sk.accuracy_score(labels, predicted),
        "MulticlassAccuracyTop2": sk.top_k_accuracy_score(labels, data["smooth_logits"], k=2, labels=classes),
        "MulticlassAccuracyMacro": sk.balanced_accuracy_score(labels, predicted),
        "BinaryAccuracy": sk.accuracy_score(data["binary_labels"], data["binary_scores"] > 0.5),
        "MaskedAccuracy": sk.accuracy_score(data["lm_labels"][kept], predicted[kept]),
        "CrossEntropy": sk.log_loss(labels, softmax(logits), labels=classes),
        "LanguageCrossEntropy": language,
        "LanguagePerplexity": float(np.exp(language)),
        "MulticlassPrecision": sk.precision_score(labels, predicted, average="macro", zero_division=0),
        "MulticlassPrecisionMicro": sk.precision_score(labels, predicted, average="micro", zero_division=0),
        "MulticlassRecall": sk.recall_score(labels, predicted, average="macro", zero_division=0),
        "MulticlassRecallMicro": sk.recall_score(labels, predicted, average="micro", zero_division=0),
        "MulticlassF1Score": sk.f1_score(labels, predicted, average="macro", zero_division=0),
        "MulticlassF1ScoreMicro": sk.f1_score(labels, predicted, average="micro", zero_division=0),
        "MulticlassF1ScoreWeighted": sk.f1_score(labels, predicted, average="weighted", zero_division=0),
        "BinaryAUROC": sk.roc_auc_score(data["binary_labels"], data["binary_scores"]),
        "MulticlassAUROC": sk.roc_auc_score(labels, data["probs"].astype(np.float64), multi_class="ovr",
                                            average="macro"),
        "MeanSquaredError": sk.mean_squared_error(targets, preds),
        "MeanAbsoluteError": sk.mean_absolute_error(targets, preds),
        "MeanMetric": float(np.mean(preds)),
    }


def subset(data: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
    """The first ``count`` samples of ``data``."""
    return {key: value[:count] for key, value in data.items()}
