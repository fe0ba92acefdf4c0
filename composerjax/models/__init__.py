"""Models: the ComposerModel protocol and small reference models."""

from composerjax.models.composer_model import ComposerClassifier, ComposerModel, MetricSums
from composerjax.models.small_cnn import SmallCNN

__all__ = ["ComposerModel", "ComposerClassifier", "MetricSums", "SmallCNN"]
