"""Models: the ComposerModel protocol and small reference models for examples and benchmarks."""

from composerjax.models.causal_lm import ComposerCausalLM, LMOutputs
from composerjax.models.composer_model import ComposerClassifier, ComposerModel, MetricSums
from composerjax.models.generation import generate, generate_without_cache, sample_logits
from composerjax.models.gpt import (
    CausalSelfAttention,
    DecoderBlock,
    FeedForward,
    PositionEmbedding,
    TinyGPT,
    language_metrics,
)
from composerjax.models.gpt2 import (
    GPT2,
    GPT2_CONFIGS,
    GPT2Config,
    KVCache,
    apply_rotary,
    flops_per_token,
    parameter_count,
)
from composerjax.models.hf import hf_parameter_names, load_pretrained, save_pretrained
from composerjax.models.llama import (
    LLAMA_CONFIGS,
    Llama,
    LlamaConfig,
    llama_flops_per_token,
    llama_parameter_count,
)
from composerjax.models.mlp import MLP
from composerjax.models.resnet import BasicBlock, SmallResNet
from composerjax.models.small_cnn import SmallCNN

__all__ = [
    "BasicBlock",
    "CausalSelfAttention",
    "ComposerCausalLM",
    "ComposerClassifier",
    "ComposerModel",
    "DecoderBlock",
    "FeedForward",
    "GPT2",
    "GPT2Config",
    "GPT2_CONFIGS",
    "KVCache",
    "LLAMA_CONFIGS",
    "LMOutputs",
    "Llama",
    "LlamaConfig",
    "MLP",
    "MetricSums",
    "PositionEmbedding",
    "SmallCNN",
    "SmallResNet",
    "TinyGPT",
    "apply_rotary",
    "flops_per_token",
    "generate",
    "generate_without_cache",
    "hf_parameter_names",
    "language_metrics",
    "llama_flops_per_token",
    "llama_parameter_count",
    "load_pretrained",
    "parameter_count",
    "sample_logits",
    "save_pretrained",
]
