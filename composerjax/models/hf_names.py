"""Our parameter paths and Hugging Face's tensor names, for GPT-2 and Llama: the one mapping every export uses.

:func:`~composerjax.models.hf.load_pretrained`, :func:`~composerjax.models.hf.save_pretrained` and the
PEFT adapter export (:func:`~composerjax.models.lora.save_lora_adapter`) all read it.

Example:
    >>> from flax import nnx
    >>> from composerjax.models.gpt2 import GPT2, GPT2Config
    >>> names = hf_parameter_names(GPT2(GPT2Config.preset("gpt2-tiny"), rngs=nnx.Rngs(0)))
    >>> names["tokens/embedding"]
    'transformer.wte.weight'
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from composerjax.models.gpt2 import GPT2
from composerjax.models.hf_config import hf_architecture
from composerjax.models.llama import Llama

__all__ = ["ParameterMapping", "bare_model", "hf_parameter_names", "parameter_mappings", "path_text", "weights_state"]

# Inside one block: our path -> (Hugging Face name, transposed). GPT-2's Conv1D weights are stored
# (in, out), as nnx.Linear's kernels; its fused c_attn is our fused qkv (queries, keys, values in order).
_GPT2_BLOCK = {
    "norm1/scale": ("ln_1.weight", False), "norm1/bias": ("ln_1.bias", False),
    "attention/qkv/kernel": ("attn.c_attn.weight", False), "attention/qkv/bias": ("attn.c_attn.bias", False),
    "attention/proj/kernel": ("attn.c_proj.weight", False), "attention/proj/bias": ("attn.c_proj.bias", False),
    "norm2/scale": ("ln_2.weight", False), "norm2/bias": ("ln_2.bias", False),
    "mlp/up/kernel": ("mlp.c_fc.weight", False), "mlp/up/bias": ("mlp.c_fc.bias", False),
    "mlp/down/kernel": ("mlp.c_proj.weight", False), "mlp/down/bias": ("mlp.c_proj.bias", False),
}
_GPT2_TOP = {"tokens/embedding": ("transformer.wte.weight", False),
             "position/embedding": ("transformer.wpe.weight", False),
             "norm/scale": ("transformer.ln_f.weight", False), "norm/bias": ("transformer.ln_f.bias", False),
             "head/kernel": ("lm_head.weight", True)}
# Llama's nn.Linear weights are (out, in): transposed against nnx.Linear's (in, out) kernels.
_LLAMA_BLOCK = {"norm1/scale": ("input_layernorm.weight", False),
                "norm2/scale": ("post_attention_layernorm.weight", False),
                **{f"attention/{name}/kernel": (f"self_attn.{name}.weight", True)
                   for name in ("q_proj", "k_proj", "v_proj", "o_proj")},
                **{f"attention/{name}/bias": (f"self_attn.{name}.bias", False)
                   for name in ("q_proj", "k_proj", "v_proj")},
                **{f"mlp/{name}/kernel": (f"mlp.{name}.weight", True)
                   for name in ("gate_proj", "up_proj", "down_proj")}}
_LLAMA_TOP = {"tokens/embedding": ("model.embed_tokens.weight", False), "norm/scale": ("model.norm.weight", False),
              "head/kernel": ("lm_head.weight", True)}
@dataclasses.dataclass(frozen=True)
class ParameterMapping:
    """Where one of our parameters lives in the Hugging Face checkpoint."""

    names: tuple[str, ...]  # one per layer for a scanned (stacked) parameter, else one
    transposed: bool  # the HF tensor is the transpose of ours (per layer)
    vocab_axis: int | None  # our axis padded to padded_vocab_size
    stacked: bool


def bare_model(model: Any) -> nnx.Module:
    """The GPT2 or Llama itself: ``model``, or the module a ComposerCausalLM holds.

    Raises:
        ValueError: anything else, naming its type.

    Example:
        >>> bare_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
        Traceback (most recent call last):
        ...
        ValueError: model=Linear: expected a composerjax GPT2 or Llama (or a ComposerCausalLM holding one)
    """
    module = getattr(model, "module", model)
    if not isinstance(module, (GPT2, Llama)):
        raise ValueError(f"model={type(module).__name__}: expected a composerjax GPT2 or Llama (or a ComposerCausalLM "
                         "holding one)")
    return module


def path_text(path: tuple[Any, ...]) -> str:
    """An NNX path as the mapping spells it.

    Example:
        >>> path_text(("blocks", 0, "attention", "q_proj", "kernel"))
        'blocks/0/attention/q_proj/kernel'
    """
    return "/".join(str(part) for part in path)


def parameter_mappings(module: nnx.Module, param_paths: list[str]) -> dict[str, ParameterMapping]:
    """Our parameter path -> its :class:`ParameterMapping`; a parameter that maps nowhere raises ValueError."""
    gpt2 = isinstance(module, GPT2)
    block, top = (_GPT2_BLOCK, _GPT2_TOP) if gpt2 else (_LLAMA_BLOCK, _LLAMA_TOP)
    prefix = "transformer.h." if gpt2 else "model.layers."
    config = module.config
    layers = config.n_layer if gpt2 else config.num_hidden_layers
    mappings = {}
    for path in param_paths:
        parts = path.split("/")
        if parts[0] == "blocks" and config.scan_layers:
            found = block.get("/".join(parts[1:]))
            if found is not None:
                names = tuple(f"{prefix}{layer}.{found[0]}" for layer in range(layers))
                mappings[path] = ParameterMapping(names, found[1], None, True)
                continue
        elif parts[0] == "blocks" and len(parts) > 2 and parts[1].isdigit():
            found = block.get("/".join(parts[2:]))
            if found is not None:
                mappings[path] = ParameterMapping((f"{prefix}{parts[1]}.{found[0]}",), found[1], None, False)
                continue
        elif path in top:
            name, transposed = top[path]
            vocab_axis = {"tokens/embedding": 0, "head/kernel": 1}.get(path)
            mappings[path] = ParameterMapping((name,), transposed, vocab_axis, False)
            continue
        raise ValueError(f"parameter {path!r} has no counterpart in Hugging Face's {hf_architecture(module)}: the "
                         "model's structure no longer maps onto it (merge or remove what added it)")
    return mappings


def hf_parameter_names(model: Any) -> dict[str, str]:
    """``{our parameter path: Hugging Face tensor name}`` for a GPT2 or Llama (or a ComposerCausalLM holding one).

    Paths are the bare module's (``'blocks/0/attention/q_proj/kernel'``, without a ComposerCausalLM's
    ``'module/'``). A scanned model's stacked parameters name the first layer's tensor with the layer
    number replaced by ``{layer}``. Our kernels are ``(in, out)``: Llama's weights are their
    transposes, GPT-2's Conv1D weights are not. PEFT-style exports reuse this mapping.

    Raises:
        ValueError: a parameter with no Hugging Face counterpart (naming it).

    Example:
        >>> from composerjax.models.llama import LlamaConfig
        >>> names = hf_parameter_names(Llama(LlamaConfig.preset("llama-tiny"), rngs=nnx.Rngs(0)))
        >>> names["blocks/1/attention/q_proj/kernel"]
        'model.layers.1.self_attn.q_proj.weight'
    """
    module = bare_model(model)
    paths = [path_text(path) for path, _ in nnx.to_flat_state(weights_state(module))]
    names = {}
    for path, mapping in parameter_mappings(module, paths).items():
        prefix = "transformer.h.0." if isinstance(module, GPT2) else "model.layers.0."
        names[path] = (mapping.names[0].replace(prefix, prefix.replace(".0.", ".{layer}."), 1) if mapping.stacked
                       else mapping.names[0])
    return names


def weights_state(module: nnx.Module) -> nnx.State:
    """Every array but the random streams: parameters, and weights an adapter froze under another Variable type.

    Example:
        >>> sorted(weights_state(nnx.Linear(2, 3, rngs=nnx.Rngs(0))).keys())
        ['bias', 'kernel']
    """
    return nnx.state(module, nnx.Not(nnx.RngState))
