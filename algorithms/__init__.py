"""Speedup algorithms, written only against composerjax's public API.

Each module holds a pure functional form (jnp, usable without a Trainer) and an ``Algorithm``.
Method cards live in ``docs/algorithms/``.

Example::

    from composerjax.algorithms import EMA, LabelSmoothing, MixUp
    trainer = Trainer(model, loader, "10ep", algorithms=[LabelSmoothing(0.1), MixUp(0.2), EMA("500ba")])
"""

from composerjax.algorithms.alibi import ALiBi, Alibi, alibi_bias, alibi_slopes, apply_alibi
from composerjax.algorithms.augmix import AugMix, augmix_batch, augmix_image
from composerjax.algorithms.blurpool import BlurPool, apply_blurpool, blur_2d
from composerjax.algorithms.channels_last import ChannelsLast, apply_channels_last
from composerjax.algorithms.colout import ColOut, colout_batch
from composerjax.algorithms.cutmix import CutMix, cutmix_batch
from composerjax.algorithms.cutout import CutOut, cutout_batch
from composerjax.algorithms.ema import EMA, compute_ema
from composerjax.algorithms.factorize import Factorize, apply_factorization
from composerjax.algorithms.gated_linear_units import GatedLinearUnits, apply_gated_linear_units
from composerjax.algorithms.ghost_batchnorm import GhostBatchNorm, apply_ghost_batchnorm, ghost_batch_norm
from composerjax.algorithms.gradient_clipping import GradientClipping, clip_gradients
from composerjax.algorithms.gyro_dropout import GyroDropout, apply_gyro_dropout
from composerjax.algorithms.label_smoothing import LabelSmoothing, smooth_labels
from composerjax.algorithms.layer_freezing import LayerFreezing, freeze_layers
from composerjax.algorithms.lora import LoRA, apply_lora, merge_lora, save_lora_adapter
from composerjax.algorithms.low_precision_groupnorm import LowPrecisionGroupNorm, apply_low_precision_groupnorm
from composerjax.algorithms.low_precision_layernorm import LowPrecisionLayerNorm, apply_low_precision_layernorm
from composerjax.algorithms.mixup import MixUp, mixup_batch
from composerjax.algorithms.no_op_model import NoOpModel, NoOpModelClass
from composerjax.algorithms.progressive_resizing import ProgressiveResizing, resize_batch
from composerjax.algorithms.randaugment import RandAugment, randaugment_batch, randaugment_image
from composerjax.algorithms.sam import SAM, sam_gradients
from composerjax.algorithms.selective_backprop import SelectiveBackprop, select_using_loss
from composerjax.algorithms.seq_length_warmup import SeqLengthWarmup, set_batch_sequence_length
from composerjax.algorithms.squeeze_excite import SqueezeExcite, apply_squeeze_excite
from composerjax.algorithms.stochastic_depth import StochasticDepth, apply_stochastic_depth
from composerjax.algorithms.swa import SWA, swa_update
from composerjax.algorithms.weight_standardization import WeightStandardization, apply_weight_standardization

__all__ = [
    "ALiBi",
    "Alibi",
    "AugMix",
    "BlurPool",
    "ChannelsLast",
    "ColOut",
    "CutMix",
    "CutOut",
    "EMA",
    "Factorize",
    "GatedLinearUnits",
    "GhostBatchNorm",
    "GradientClipping",
    "GyroDropout",
    "LabelSmoothing",
    "LayerFreezing",
    "LoRA",
    "LowPrecisionGroupNorm",
    "LowPrecisionLayerNorm",
    "MixUp",
    "NoOpModel",
    "NoOpModelClass",
    "ProgressiveResizing",
    "RandAugment",
    "SAM",
    "SWA",
    "SelectiveBackprop",
    "SeqLengthWarmup",
    "SqueezeExcite",
    "StochasticDepth",
    "WeightStandardization",
    "alibi_bias",
    "alibi_slopes",
    "apply_alibi",
    "apply_blurpool",
    "apply_channels_last",
    "apply_factorization",
    "apply_gated_linear_units",
    "apply_ghost_batchnorm",
    "apply_gyro_dropout",
    "apply_low_precision_groupnorm",
    "apply_lora",
    "apply_low_precision_layernorm",
    "apply_squeeze_excite",
    "apply_stochastic_depth",
    "apply_weight_standardization",
    "augmix_batch",
    "augmix_image",
    "blur_2d",
    "clip_gradients",
    "colout_batch",
    "compute_ema",
    "cutmix_batch",
    "cutout_batch",
    "freeze_layers",
    "ghost_batch_norm",
    "merge_lora",
    "mixup_batch",
    "randaugment_batch",
    "randaugment_image",
    "resize_batch",
    "sam_gradients",
    "save_lora_adapter",
    "select_using_loss",
    "set_batch_sequence_length",
    "smooth_labels",
    "swa_update",
]
