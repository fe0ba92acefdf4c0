"""The shape of a Llama-class model: :class:`LlamaConfig`, its presets, parameter and FLOP counts, RoPE frequencies.

Kept apart from :mod:`composerjax.models.llama` (the module) so the counts and presets are read
without building anything.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from composerjax.models.attention import IMPLEMENTATIONS
from composerjax.models.remat import REMAT

__all__ = [
    "LLAMA_CONFIGS",
    "Llama3RopeScaling",
    "LlamaConfig",
    "llama_flops_per_token",
    "llama_parameter_count",
    "rope_frequencies",
]

#: ``LlamaConfig.remat``: what the backward pass keeps of each block (``jax.checkpoint`` policies).


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3's rope scaling (``rope_type: 'llama3'``): long wavelengths slowed by ``factor``, a smooth band between.

    The fields are Hugging Face's ``rope_scaling`` keys; Llama 3.1 uses ``factor=8``,
    ``low_freq_factor=1``, ``high_freq_factor=4``, ``original_max_position_embeddings=8192``.

    Example:
        >>> Llama3RopeScaling.from_dict({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        ...                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}).factor
        8.0
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"LlamaConfig(rope_scaling.{name}={value!r}): expected a positive number")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"LlamaConfig(rope_scaling.high_freq_factor={self.high_freq_factor!r}): expected more "
                             f"than low_freq_factor={self.low_freq_factor!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Llama3RopeScaling:
        """Read Hugging Face's ``rope_scaling`` / ``rope_parameters`` dict; only ``rope_type`` 'llama3' is accepted."""
        kind = values.get("rope_type", values.get("type"))
        if kind != "llama3":
            raise ValueError(f"LlamaConfig(rope_scaling.rope_type={kind!r}): expected 'llama3' (or rope_scaling=None "
                             "for plain RoPE); other rope types are not supported")
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names) - {"rope_type", "type", "rope_theta"})
        if unknown:
            raise ValueError(f"LlamaConfig(rope_scaling): unknown key(s) {unknown}; expected {names}")
        missing = [name for name in names if name not in values]
        if missing:
            raise ValueError(f"LlamaConfig(rope_scaling): missing key(s) {missing} for rope_type 'llama3'")
        return cls(**{name: values[name] for name in names})

    def to_dict(self) -> dict[str, Any]:
        """Hugging Face's form: ``{'rope_type': 'llama3', 'factor': ..., ...}``."""
        return {"rope_type": "llama3", **dataclasses.asdict(self)}


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a :class:`Llama` model; the field names are Hugging Face's ``LlamaConfig``'s.

    The defaults are SmolLM-135M's shape.

    Args:
        vocab_size: the number of distinct tokens.
        hidden_size: the width of the residual stream.
        intermediate_size: the width of the SwiGLU MLP.
        num_hidden_layers: the number of decoder blocks.
        num_attention_heads: query heads per block.
        num_key_value_heads: key/value heads per block (grouped-query attention); must divide
            ``num_attention_heads``.
        head_dim: the size of one head; None is ``hidden_size // num_attention_heads``.
        max_position_embeddings: the longest sequence (context length) the model takes.
        rms_norm_eps: RMSNorm's epsilon.
        rope_theta: the RoPE frequency base.
        rope_scaling: None (plain RoPE) or Llama 3's scaling, as a :class:`Llama3RopeScaling` or
            Hugging Face's dict (``{'rope_type': 'llama3', 'factor': 8.0, ...}``).
        tie_word_embeddings: the LM head is the token embedding (one matrix).
        attention_bias: biases on the query, key and value projections (Qwen2); the output
            projection has none.
        sliding_window: None, or Mistral's window: a query attends only to the ``sliding_window``
            most recent keys (itself included).
        attention: the attention kernel: ``'auto'``, ``'xla'`` or ``'cudnn'`` (see
            :func:`~composerjax.models.attention.choose_kernel`).
        remat: what the backward pass recomputes: ``'none'``, ``'dots'`` or ``'full'`` (as GPT-2's).
        scan_layers: the blocks are one stacked module run by ``lax.scan`` (parameter paths
            become ``blocks/<name>`` with a leading layer axis).
        pad_vocab_to_multiple: the embedding (and an untied head) get ``padded_vocab_size`` rows;
            the padding rows start at zero and their logits are never returned.
        dtype: the dtype the layers compute in; None follows the parameters.
        param_dtype: the dtype the parameters are created in.

    Raises:
        ValueError: naming the field, its value and what is accepted.

    Example:
        >>> config = LlamaConfig.preset("tinyllama-1.1b")
        >>> config.num_key_value_heads, config.head_size, llama_parameter_count(config)
        (4, 64, 1100048384)
    """

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    sliding_window: int | None = None
    attention: str = "auto"
    remat: str = "none"
    scan_layers: bool = False
    pad_vocab_to_multiple: int = 64
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings", "pad_vocab_to_multiple"):
            _check_positive_int(name, getattr(self, name))
        for name in ("head_dim", "sliding_window"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name), " or None")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"LlamaConfig(hidden_size={self.hidden_size}): expected a multiple of "
                             f"num_attention_heads={self.num_attention_heads} (or give head_dim)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"LlamaConfig(num_key_value_heads={self.num_key_value_heads}): expected a divisor of "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.head_size % 2:
            raise ValueError(f"LlamaConfig(head_dim={self.head_size}): RoPE needs an even head size")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"LlamaConfig({name}={value!r}): expected a positive number")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", Llama3RopeScaling.from_dict(self.rope_scaling))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ValueError(f"LlamaConfig(rope_scaling={self.rope_scaling!r}): expected None, a Llama3RopeScaling "
                             "or a dict with rope_type 'llama3'")
        for name in ("tie_word_embeddings", "attention_bias", "scan_layers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LlamaConfig({name}={getattr(self, name)!r}): expected True or False")
        for name, accepted in (("attention", IMPLEMENTATIONS), ("remat", REMAT)):
            value = getattr(self, name)
            if value not in accepted:
                raise ValueError(f"LlamaConfig({name}={value!r}): expected one of {', '.join(map(repr, accepted))}")

    @property
    def head_size(self) -> int:
        """The size of one head: ``head_dim``, or ``hidden_size // num_attention_heads`` when that is None."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def n_positions(self) -> int:
        """``max_position_embeddings`` under GPT-2's name, for generation and ``composerjax generate``."""
        return self.max_position_embeddings

    @property
    def n_layer(self) -> int:
        """``num_hidden_layers`` under GPT-2's name."""
        return self.num_hidden_layers

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the head: ``vocab_size`` rounded up to ``pad_vocab_to_multiple``.

        Example:
            >>> LlamaConfig(vocab_size=100).padded_vocab_size
            128
        """
        multiple = self.pad_vocab_to_multiple
        return -(-self.vocab_size // multiple) * multiple

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named configuration from :data:`LLAMA_CONFIGS`, with any field replaced.

        Example:
            >>> LlamaConfig.preset("llama-tiny", tie_word_embeddings=False).tie_word_embeddings
            False
        """
        if name not in LLAMA_CONFIGS:
            raise ValueError(f"LlamaConfig.preset(name={name!r}): expected one of "
                             f"{', '.join(map(repr, LLAMA_CONFIGS))}")
        return dataclasses.replace(LLAMA_CONFIGS[name], **overrides)


def _check_positive_int(name: str, value: Any, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"LlamaConfig({name}={value!r}): expected a positive integer{alternative}")


#: A tiny model for tests on CPU and the published shapes of SmolLM-135M and TinyLlama-1.1B.
LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    "smollm-135m": LlamaConfig(),
    "tinyllama-1.1b": LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                  num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                                  tie_word_embeddings=False),
}


def _resolve(config: LlamaConfig | str) -> LlamaConfig:
    if isinstance(config, str):
        return LlamaConfig.preset(config)
    if not isinstance(config, LlamaConfig):
        raise ValueError(f"config={config!r}: expected a LlamaConfig or a preset name ({', '.join(LLAMA_CONFIGS)})")
    return config


def llama_parameter_count(config: LlamaConfig | str, padded: bool = True) -> int:
    """The number of parameters of ``Llama(config)``, in closed form (tied embeddings count once).

    Per block: the query and output projections ``2·D·H·Q``, keys and values ``2·D·K·Q`` (``H``
    query heads, ``K`` key/value heads of size ``Q``), their biases when ``attention_bias``, the
    SwiGLU MLP ``3·D·I`` and two RMSNorms ``2·D``; plus the embedding ``V·D``, the final norm
    ``D`` and an untied head ``D·V``.

    Args:
        config: a :class:`LlamaConfig` or a preset name.
        padded: ``V`` is ``padded_vocab_size``; False counts the real ``vocab_size`` (the published figure).

    Example:
        >>> llama_parameter_count("smollm-135m")
        134515008
    """
    config = _resolve(config)
    d, q = config.hidden_size, config.head_size
    v = config.padded_vocab_size if padded else config.vocab_size
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    block = 2 * d * heads * q + 2 * d * groups * q + 3 * d * config.intermediate_size + 2 * d
    if config.attention_bias:
        block += heads * q + 2 * groups * q
    count = v * d + config.num_hidden_layers * block + d
    if not config.tie_word_embeddings:
        count += d * v
    return count


def llama_flops_per_token(config: LlamaConfig | str, seq_len: int) -> int:
    """Training FLOPs per token (forward and backward): ``6·N + 12·L·H·Q·T``, as GPT-2's ``flops_per_token``.

    ``N`` counts the parameters in a matmul over the real vocabulary: all of them except, when the
    head is untied, the input embedding (a lookup); ``H·Q`` is the query heads' width.

    Example:
        >>> llama_flops_per_token("llama-tiny", 128) == 6 * (llama_parameter_count("llama-tiny", padded=False)) + (
        ...     12 * 2 * 64 * 128)
        True
    """
    config = _resolve(config)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r}: expected a positive integer")
    matmul = llama_parameter_count(config, padded=False)
    if not config.tie_word_embeddings:
        matmul -= config.vocab_size * config.hidden_size
    width = config.num_attention_heads * config.head_size
    return 6 * matmul + 12 * config.num_hidden_layers * width * seq_len


@functools.lru_cache(maxsize=32)
def rope_frequencies(config: LlamaConfig) -> np.ndarray:
    """RoPE's ``head_dim / 2`` inverse frequencies (float32), with Llama 3's scaling where configured.

    ``1 / theta^(2i / head_dim)``; under ``rope_scaling`` wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those shorter
    than ``... / high_freq_factor`` kept, and those between interpolated, as Hugging Face computes
    ``inv_freq`` for ``rope_type='llama3'``.

    Example:
        >>> rope_frequencies(LlamaConfig.preset("llama-tiny", head_dim=4)).tolist()
        [1.0, 0.009999999776482582]
    """
    dim = config.head_size
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** (np.arange(0, dim, 2).astype(np.float32) / dim)))
    inv_freq = inv_freq.astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    low_wavelength = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelength = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    scaled = np.where(wavelength > low_wavelength, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_position_embeddings / wavelength - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelength < high_wavelength) & ~(wavelength > low_wavelength)
    return np.where(medium, smoothed, scaled).astype(np.float32)
