"""``config.json`` both ways: a Hugging Face configuration to our GPT2Config / LlamaConfig and back.

Fields the native models do not implement are refused by name, with what is accepted, so a
checkpoint never loads into a model that computes something else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from composerjax.models.gpt2 import GPT2, GPT2Config
from composerjax.models.llama import Llama, LlamaConfig

__all__ = ["ARCHITECTURES", "config_from_hf", "config_to_hf", "hf_architecture"]

#: The Hugging Face architectures (``config.json``'s ``architectures``) ``load_pretrained`` reads.
ARCHITECTURES = ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2"}


def _architecture_of(hf_config: dict[str, Any]) -> str:
    architectures = hf_config.get("architectures") or []
    if not architectures:
        raise ValueError(f"config.json has no 'architectures': expected one of {', '.join(ARCHITECTURES)}")
    architecture = architectures[0]
    if architecture not in ARCHITECTURES:
        raise ValueError(f"config.json: architectures={architectures!r} is not supported; expected one of "
                         f"{', '.join(ARCHITECTURES)}")
    return architecture


def _refuse(architecture: str, hf_config: dict[str, Any], field: str, accepted: Callable[[Any], bool],
            default: Any, expected: str) -> None:
    value = hf_config.get(field, default)
    if not accepted(value):
        raise ValueError(f"config.json: {field}={value!r} is not supported for {architecture}; expected {expected}")


def config_from_hf(hf_config: dict[str, Any], *, param_dtype: Any = jnp.float32,
                   **overrides: Any) -> GPT2Config | LlamaConfig:
    """Our :class:`~composerjax.models.GPT2Config` or :class:`~composerjax.models.LlamaConfig` for a ``config.json``.

    Raises:
        ValueError: an architecture or a field value the native models do not implement, naming it.

    Example:
        >>> config = config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 32,
        ...                          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4})
        >>> config.num_key_value_heads, config.tie_word_embeddings
        (4, False)
    """
    architecture = _architecture_of(hf_config)
    if architecture == "GPT2LMHeadModel":
        return _gpt2_config(hf_config, param_dtype, overrides)
    return _llama_config(architecture, hf_config, param_dtype, overrides)


def _gpt2_config(hf: dict[str, Any], param_dtype: Any, overrides: dict[str, Any]) -> GPT2Config:
    arch = "GPT2LMHeadModel"
    n_embd = hf.get("n_embd", 768)
    _refuse(arch, hf, "activation_function", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"), "gelu_new",
            "'gelu_new' (GPT-2's tanh GELU)")
    _refuse(arch, hf, "n_inner", lambda v: v in (None, 4 * n_embd), None, f"None or 4 * n_embd = {4 * n_embd}")
    _refuse(arch, hf, "scale_attn_weights", lambda v: v is True, True, "True")
    _refuse(arch, hf, "scale_attn_by_inverse_layer_idx", lambda v: v is False, False, "False")
    _refuse(arch, hf, "add_cross_attention", lambda v: v is False, False, "False")
    resid, embd = hf.get("resid_pdrop", 0.1), hf.get("embd_pdrop", 0.1)
    if resid != embd:
        raise ValueError(f"config.json: embd_pdrop={embd!r} and resid_pdrop={resid!r} differ; the native GPT2 has one "
                         "dropout rate for both (expected them equal)")
    fields = {"vocab_size": hf.get("vocab_size", 50257), "n_positions": hf.get("n_positions", 1024), "n_embd": n_embd,
              "n_layer": hf.get("n_layer", 12), "n_head": hf.get("n_head", 12), "dropout": resid,
              "attention_dropout": hf.get("attn_pdrop", 0.1), "position": "learned",
              "tie_embeddings": hf.get("tie_word_embeddings", True),
              "layer_norm_epsilon": hf.get("layer_norm_epsilon", 1e-5), "param_dtype": param_dtype}
    return GPT2Config(**{**fields, **overrides})


def _llama_config(arch: str, hf: dict[str, Any], param_dtype: Any, overrides: dict[str, Any]) -> LlamaConfig:
    _refuse(arch, hf, "hidden_act", lambda v: v == "silu", "silu", "'silu' (SwiGLU)")
    _refuse(arch, hf, "mlp_bias", lambda v: v is False, False, "False")
    _refuse(arch, hf, "attention_dropout", lambda v: not v, 0.0, "0.0 (the native Llama has no attention dropout)")
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = rope or hf.get("rope_scaling")
    partial = (scaling or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"config.json: partial_rotary_factor={partial!r} is not supported for {arch}; expected 1.0 "
                         "(RoPE over the whole head)")
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    if scaling and scaling.get("rope_type", scaling.get("type")) != "llama3":
        kind = scaling.get("rope_type", scaling.get("type"))
        raise ValueError(f"config.json: rope_scaling rope_type={kind!r} is not supported for {arch}; expected 'llama3' "
                         "or none (default RoPE)")
    if scaling:
        scaling = {key: value for key, value in scaling.items() if key != "partial_rotary_factor"}
    sliding_window = None
    attention_bias = False
    if arch == "LlamaForCausalLM":
        _refuse(arch, hf, "attention_bias", lambda v: v is False, False,
                "False (Llama's attention_bias adds an output-projection bias the native model lacks)")
    elif arch == "MistralForCausalLM":
        sliding_window = hf.get("sliding_window", 4096)
    else:  # Qwen2: biases on q, k and v; sliding windows only on some layers, which the native model lacks
        attention_bias = True
        _refuse(arch, hf, "use_sliding_window", lambda v: v is False, False, "False")
        layer_types = hf.get("layer_types")
        if layer_types and any(kind != "full_attention" for kind in layer_types):
            raise ValueError(f"config.json: layer_types={layer_types!r} is not supported for {arch}; expected "
                             "'full_attention' for every layer")
    heads = hf.get("num_attention_heads", 32)
    hidden = hf.get("hidden_size", 4096)
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * heads == hidden:
        head_dim = None
    fields = {"vocab_size": hf.get("vocab_size", 32000), "hidden_size": hidden,
              "intermediate_size": hf.get("intermediate_size", 11008),
              "num_hidden_layers": hf.get("num_hidden_layers", 32), "num_attention_heads": heads,
              "num_key_value_heads": hf.get("num_key_value_heads") or heads, "head_dim": head_dim,
              "max_position_embeddings": hf.get("max_position_embeddings", 2048),
              "rms_norm_eps": hf.get("rms_norm_eps", 1e-6), "rope_theta": float(theta),
              "rope_scaling": scaling or None, "tie_word_embeddings": hf.get("tie_word_embeddings", False),
              "attention_bias": attention_bias, "sliding_window": sliding_window, "param_dtype": param_dtype}
    return LlamaConfig(**{**fields, **overrides})


def hf_architecture(module: nnx.Module) -> str:
    """The Hugging Face architecture a GPT2 or Llama exports as: Qwen2 with attention biases, Mistral with a window.

    Example:
        >>> from composerjax.models.llama import LlamaConfig
        >>> hf_architecture(Llama(LlamaConfig.preset("llama-tiny", sliding_window=8), rngs=nnx.Rngs(0)))
        'MistralForCausalLM'
    """
    if isinstance(module, GPT2):
        return "GPT2LMHeadModel"
    config = module.config
    if config.attention_bias:
        return "Qwen2ForCausalLM"
    if config.sliding_window is not None:
        return "MistralForCausalLM"
    return "LlamaForCausalLM"


def _dtype_name(dtype: Any) -> str:
    return jnp.dtype(dtype).name


def config_to_hf(module: nnx.Module) -> dict[str, Any]:
    """The ``config.json`` Hugging Face needs to rebuild ``module`` (a GPT2 or Llama).

    Raises:
        ValueError: a configuration with no Hugging Face counterpart, naming the field.

    Example:
        >>> from composerjax.models.llama import LlamaConfig
        >>> config_to_hf(Llama(LlamaConfig.preset("llama-tiny"), rngs=nnx.Rngs(0)))["architectures"]
        ['LlamaForCausalLM']
    """
    if not isinstance(module, (GPT2, Llama)):
        raise ValueError(f"model={type(module).__name__}: expected a composerjax GPT2 or Llama")
    architecture = hf_architecture(module)
    dtype = _dtype_name(module.tokens.embedding.get_value().dtype)
    config = module.config
    base = {"architectures": [architecture], "model_type": _MODEL_TYPES[architecture], "dtype": dtype,
            "torch_dtype": dtype}
    if isinstance(module, GPT2):
        if config.position != "learned":
            raise ValueError(f"GPT2Config(position={config.position!r}): Hugging Face's GPT2LMHeadModel has only "
                             "learned positions (expected 'learned'); this model cannot be exported")
        return {**base, "vocab_size": config.vocab_size, "n_positions": config.n_positions, "n_embd": config.n_embd,
                "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
                "activation_function": "gelu_new", "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
                "attn_pdrop": config.attention_dropout, "layer_norm_epsilon": config.layer_norm_epsilon,
                "tie_word_embeddings": config.tie_embeddings, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    if config.attention_bias and config.sliding_window is not None:
        raise ValueError(f"LlamaConfig(attention_bias=True, sliding_window={config.sliding_window}): no Hugging Face "
                         "architecture has both (Qwen2 has the biases, Mistral the window)")
    rope_scaling = None if config.rope_scaling is None else config.rope_scaling.to_dict()
    hf = {**base, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
          "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
          "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
          "head_dim": config.head_size, "max_position_embeddings": config.max_position_embeddings,
          "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta, "rope_scaling": rope_scaling,
          "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default", **(rope_scaling or {})},
          "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu", "attention_dropout": 0.0}
    if architecture == "LlamaForCausalLM":
        hf.update(attention_bias=False, mlp_bias=False)
    elif architecture == "MistralForCausalLM":
        hf.update(sliding_window=config.sliding_window)
    else:
        hf.update(use_sliding_window=False, sliding_window=None,
                  layer_types=["full_attention"] * config.num_hidden_layers)
    return hf
