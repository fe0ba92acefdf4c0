"""Models: the ComposerModel protocol and small reference models for examples and benchmarks."""

from composerjax.models.composer_model import ComposerClassifier, ComposerModel, MetricSums
from composerjax.models.gpt import (
    CausalSelfAttention,
    DecoderBlock,
    FeedForward,
    PositionEmbedding,
    TinyGPT,
    language_metrics,
)
from composerjax.models.mlp import MLP
from composerjax.models.resnet import BasicBlock, SmallResNet
from composerjax.models.small_cnn import SmallCNN

__all__ = [
    "BasicBlock",
    "CausalSelfAttention",
    "ComposerClassifier",
    "ComposerModel",
    "DecoderBlock",
    "FeedForward",
    "MLP",
    "MetricSums",
    "PositionEmbedding",
    "SmallCNN",
    "SmallResNet",
    "TinyGPT",
    "language_metrics",
]
