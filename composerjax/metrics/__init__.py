"""Eval metrics as values: computed inside the compiled eval step, merged exactly across batches, devices and processes.

Built on google-metrax and clu's ``Metric`` (``from_model_output`` / ``merge`` / ``compute``); the
names and meanings are torchmetrics' and Composer's, the values sklearn's.
"""

from composerjax.metrics.auroc import BinaryAUROC, MulticlassAUROC, rank_auc
from composerjax.metrics.classification import (
    BinaryAccuracy,
    MaskedAccuracy,
    MulticlassAccuracy,
    MulticlassF1Score,
    MulticlassPrecision,
    MulticlassRecall,
)
from composerjax.metrics.collection import compute_values, merge_states, named_metrics, select_metrics
from composerjax.metrics.cross_entropy import CrossEntropy, LanguageCrossEntropy, LanguagePerplexity
from composerjax.metrics.mean import MeanMetric, mean_metrics
from composerjax.metrics.metric import Metric
from composerjax.metrics.regression import MeanAbsoluteError, MeanSquaredError

__all__ = [
    "BinaryAUROC",
    "BinaryAccuracy",
    "CrossEntropy",
    "LanguageCrossEntropy",
    "LanguagePerplexity",
    "MaskedAccuracy",
    "MeanAbsoluteError",
    "MeanMetric",
    "MeanSquaredError",
    "Metric",
    "MulticlassAUROC",
    "MulticlassAccuracy",
    "MulticlassF1Score",
    "MulticlassPrecision",
    "MulticlassRecall",
    "compute_values",
    "mean_metrics",
    "merge_states",
    "named_metrics",
    "rank_auc",
    "select_metrics",
]
