"""LoRA's modules: low-rank adapters beside frozen linear layers (Hu et al., 2021, as Hugging Face PEFT does it).

Each targeted ``nnx.Linear`` becomes a :class:`LoRALinear`:
``y = x W (+ b) + (dropout(x) A B) * (alpha / rank)``, with ``A`` (``in x rank``) drawn as PEFT
draws it (Kaiming-uniform, ``U(-1/sqrt(in), 1/sqrt(in))``) and ``B`` (``rank x out``) zero, so the
wrapped model starts as the base model. The base kernel and bias stop being ``nnx.Param``: they
become :class:`FrozenWeight` variables, as do all the model's other parameters (embeddings, norms,
the Linears not targeted), which the trainer keeps with the model's other state (saved
in checkpoints, never differentiated, not in the optimizer state). Only ``lora_a`` / ``lora_b``
(``nnx.LoRAParam``, a kind of ``nnx.Param``) train.

:func:`merge_lora` folds the adapters back into plain ``nnx.Linear`` layers (``W + A B alpha/rank``)
for export; :func:`save_lora_adapter` writes a PEFT adapter folder instead. The algorithm that
applies it during training is :class:`composerjax.algorithms.LoRA`; these are the model pieces,
which export (``composerjax export``, :func:`composerjax.models.save_pretrained`) uses too.

flax ships ``nnx.LoRA`` / ``nnx.LoRALinear``, but without the ``alpha / rank`` scale or dropout and
with the base weights left trainable; its ``nnx.LoRAParam`` variable type is used for the adapters.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "FrozenWeight",
    "LoRALinear",
    "apply_lora",
    "lora_parameter_count",
    "merge_lora",
    "save_lora_adapter",
]

#: models (``q_proj``, ``v_proj``) and GPT-2 (its fused ``c_attn``, our ``qkv``).
DEFAULT_TARGET_MODULES = ("q_proj", "v_proj", "qkv")
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


class FrozenWeight(nnx.Variable):
    """A weight that does not train: kept (and checkpointed) with the model's state, outside ``nnx.Param``."""


def _sharding_names(variable: nnx.Variable) -> tuple[Any, ...] | None:
    metadata = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
    for key in ("out_sharding", "sharding_names", "sharding"):
        if metadata.get(key):
            return tuple(metadata[key])
    return None


def _with_sharding(names: tuple[Any, ...] | None) -> dict[str, Any]:
    # Metadata only, as the model families declare it: the Trainer places the arrays on its mesh.
    return {} if names is None else {"out_sharding": names, "eager_sharding": False}


class LoRALinear(nnx.Module):
    """``base_layer(x) + (dropout(x) @ lora_a @ lora_b) * scale``: a frozen ``nnx.Linear`` with a trainable adapter.

    Built from an existing Linear with :meth:`from_linear`; ``base_layer`` is that Linear, its kernel
    and bias turned into :class:`FrozenWeight`. A kernel with leading (layer) axes, as in a
    scanned model's stacked blocks, gets adapters with the same leading axes.

    Example:
        >>> linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> x = jnp.ones((2, 4))
        >>> before = linear(x)
        >>> lora = LoRALinear.from_linear(linear, rank=2, alpha=4, rngs=nnx.Rngs(1))
        >>> lora.lora_a.shape, lora.lora_b.shape, lora.scale
        ((4, 2), (2, 3), 2.0)
        >>> bool((lora(x) == before).all())  # B starts at zero
        True
    """

    def __init__(self, base_layer: nnx.Linear, lora_a: nnx.Variable, lora_b: nnx.Variable, scale: float,
                 dropout: nnx.Module | None) -> None:
        self.base_layer = base_layer
        self.lora_a = lora_a
        self.lora_b = lora_b
        self.scale = scale
        self.rank = lora_a.shape[-1]
        self.dropout = dropout

    @classmethod
    def from_linear(cls, linear: nnx.Linear, rank: int, alpha: float, dropout: float = 0.0, *,
                    rngs: nnx.Rngs) -> LoRALinear:
        """Wrap ``linear`` (changed in place: its kernel and bias become :class:`FrozenWeight`)."""
        kernel = linear.kernel
        *lead, fan_in, fan_out = kernel.shape
        names = _sharding_names(kernel)
        dtype = linear.param_dtype
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) on PEFT's (rank, in) weight
        a = jax.random.uniform(rngs.params(), (*lead, fan_in, rank), dtype, -bound, bound)
        lora_a = nnx.LoRAParam(a, **_with_sharding(None if names is None else (*names[:-1], None)))
        lora_b = nnx.LoRAParam(jnp.zeros((*lead, rank, fan_out), dtype),
                               **_with_sharding(None if names is None else (*names[:-2], None, names[-1])))
        linear.kernel = FrozenWeight(kernel[...], **kernel.get_metadata())
        if linear.bias is not None:
            linear.bias = FrozenWeight(linear.bias[...], **linear.bias.get_metadata())
        drop = None
        if dropout > 0:
            if lead:
                raise ValueError(f"dropout={dropout!r}: LoRA dropout is not supported on stacked (scanned) layers; "
                                 "use dropout=0.0 or a model built with scan_layers=False")
            drop = nnx.Dropout(dropout, rngs=nnx.Rngs(dropout=rngs.params()))
        return cls(linear, lora_a, lora_b, alpha / rank, drop)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.base_layer(x)
        h = self.dropout(x) if self.dropout is not None else x
        a, b = self.lora_a[...], self.lora_b[...]
        dtype = self.base_layer.dtype or y.dtype
        update = (h.astype(dtype) @ a.astype(dtype)) @ b.astype(dtype)
        return y + update * jnp.asarray(self.scale, dtype)

    @property
    def kernel(self) -> jax.Array:
        """The effective kernel ``W + A B scale`` (no dropout), for models that read a head's weight directly."""
        kernel = self.base_layer.kernel[...]
        update = (self.lora_a[...].astype(kernel.dtype) @ self.lora_b[...].astype(kernel.dtype)) * self.scale
        return kernel + update.astype(kernel.dtype)

    def merged(self) -> nnx.Linear:
        """The base Linear with ``W + A B scale`` as its (trainable again) kernel; this wrapper is spent."""
        linear = self.base_layer
        kernel = linear.kernel
        a = jnp.asarray(self.lora_a[...], jnp.float32)
        b = jnp.asarray(self.lora_b[...], jnp.float32)
        merged = jnp.asarray(kernel[...], jnp.float32) + (a @ b) * self.scale
        linear.kernel = nnx.Param(merged.astype(kernel.dtype), **kernel.get_metadata())
        if linear.bias is not None:
            linear.bias = nnx.Param(linear.bias[...], **linear.bias.get_metadata())
        return linear


def _validate(rank: Any, alpha: Any, target_modules: Any, dropout: Any) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA(rank={rank!r}): expected a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"LoRA(alpha={alpha!r}): expected a positive number (the adapter is scaled by alpha / rank)")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"LoRA(dropout={dropout!r}): expected a probability in [0, 1)")
    if target_modules is None:
        return
    if (isinstance(target_modules, str) or not isinstance(target_modules, Sequence) or not target_modules
            or not all(isinstance(name, str) and name for name in target_modules)):
        raise ValueError(f"LoRA(target_modules={target_modules!r}): expected a non-empty list of module names "
                         "(path components such as 'q_proj' or 'attention'), or None for "
                         f"{', '.join(DEFAULT_TARGET_MODULES)}")


def _linears(model: nnx.Module) -> list[tuple[tuple[Any, ...], nnx.Linear]]:
    seen: set[int] = set()
    found = []
    for path, module in nnx.iter_modules(model):
        if isinstance(module, nnx.Linear) and id(module) not in seen:
            seen.add(id(module))
            found.append((tuple(path), module))
    return found


def _set_child(model: nnx.Module, path: tuple[Any, ...], value: nnx.Module) -> None:
    parent: Any = model
    for part in path[:-1]:
        parent = parent[part] if isinstance(part, int) else getattr(parent, part)
    if isinstance(path[-1], int):
        parent[path[-1]] = value
    else:
        setattr(parent, path[-1], value)


def _path_text(path: tuple[Any, ...]) -> str:
    return "/".join(str(part) for part in path)


def _runs_blocks_eagerly(model: nnx.Module, path: tuple[Any, ...]) -> bool:
    """Whether the modules above ``path`` call it directly (no remat / scan replaying a pure copy)."""
    node: Any = model
    for part in path[:-1]:
        config = getattr(node, "config", None)
        if getattr(config, "scan_layers", False) or getattr(config, "remat", "none") not in ("none", None):
            return False
        node = node[part] if isinstance(part, int) else getattr(node, part)
    return True


def apply_lora(model: nnx.Module, rank: int = 8, alpha: float = 16, target_modules: Sequence[str] | None = None,
               dropout: float = 0.0, *, rngs: nnx.Rngs | None = None) -> list[str]:
    """Wrap the targeted ``nnx.Linear`` layers of ``model`` in :class:`LoRALinear`, in place; return their paths.

    A Linear is targeted when one of the components of its path (``blocks/0/attention/q_proj``) is
    in ``target_modules``. Every other ``nnx.Param`` of the model (embeddings, norms, the Linears not
    targeted) becomes a :class:`FrozenWeight`: only the adapters remain parameters. Every name given
    must match at least one Linear; ``None`` takes those of :data:`DEFAULT_TARGET_MODULES` the model has.

    Raises:
        ValueError: a bad hyperparameter, or a name that matches no Linear (naming the Linear
            names the model has).

    Example:
        >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(8, 2, rngs=nnx.Rngs(0)))
        >>> apply_lora(model, rank=2, target_modules=("layers",), rngs=nnx.Rngs(1))
        ['layers/0', 'layers/2']
        >>> lora_parameter_count(model)
        44
    """
    _validate(rank, alpha, target_modules, dropout)
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    wrappers = [tuple(path) for path, module in nnx.iter_modules(model) if isinstance(module, LoRALinear)]
    # Linears already wrapped (a second application) are left alone.
    linears = [(path, linear) for path, linear in _linears(model)
               if not any(path[:len(wrapper)] == wrapper for wrapper in wrappers)]
    names = {str(part) for path, _ in linears for part in path}
    leaf_names = sorted({str(path[-1]) for path, _ in linears if path})
    if target_modules is None:
        wanted = [name for name in DEFAULT_TARGET_MODULES if name in names]
        if not wanted:
            raise ValueError(f"LoRA(target_modules=None): the model has none of the default targets "
                             f"{', '.join(DEFAULT_TARGET_MODULES)}; its Linear layers are named "
                             f"{', '.join(leaf_names) or '(none)'}: pass target_modules=(...) from those")
    else:
        wanted = list(target_modules)
        missing = [name for name in wanted if name not in names]
        if missing:
            raise ValueError(f"LoRA(target_modules={tuple(target_modules)!r}): {', '.join(map(repr, missing))} "
                             f"matches no Linear layer; the model's Linear layers are named "
                             f"{', '.join(leaf_names) or '(none)'} (any component of a path such as "
                             f"{_path_text(linears[0][0]) if linears else 'blocks/0/attention/q_proj'} matches)")
    wrapped = []
    for path, linear in linears:
        if not any(str(part) in wanted for part in path):
            continue
        if dropout > 0 and not _runs_blocks_eagerly(model, path):
            raise ValueError(f"LoRA(dropout={dropout!r}): {_path_text(path)} runs inside remat or scanned layers, "
                             "where the adapter's dropout stream would not advance; use dropout=0.0 or a model "
                             "with remat='none' and scan_layers=False")
        _set_child(model, path, LoRALinear.from_linear(linear, rank, alpha, dropout, rngs=rngs))
        wrapped.append(_path_text(path))
    _retype_variables(model, nnx.Param, FrozenWeight, skip=nnx.LoRAParam)  # only the adapters train
    return wrapped


def _retype_variables(model: nnx.Module, old: type, new: type, skip: type | None = None) -> None:
    """Give every ``old`` variable of ``model`` (not ``skip``) the type ``new``, keeping value and sharding."""
    for _, module in list(nnx.iter_modules(model)):
        for name, value in list(vars(module).items()):
            if isinstance(value, old) and not (skip is not None and isinstance(value, skip)):
                setattr(module, name, new(value[...], **value.get_metadata()))


def lora_parameter_count(model: nnx.Module) -> int:
    """The number of trainable adapter weights (``lora_a`` and ``lora_b``) in ``model``.

    Example:
        >>> lora_parameter_count(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
        0
    """
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Fold every adapter into its Linear (``W + A B alpha/rank``), in place, and return ``model``.

    The :class:`LoRALinear` wrappers are replaced by their base ``nnx.Linear`` layers and every
    :class:`FrozenWeight` is an ``nnx.Param`` again: the model has its original structure (what
    :func:`composerjax.models.save_pretrained` exports) and computes what the wrapped model did.
    Merge a copy (``nnx.clone``) to keep training the adapters.

    Example:
        >>> model = nnx.Sequential(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
        >>> _ = apply_lora(model, rank=2, target_modules=("layers",))
        >>> type(merge_lora(model).layers[0]).__name__
        'Linear'
    """
    for path, module in list(nnx.iter_modules(model)):
        if isinstance(module, LoRALinear):
            if not path:
                raise ValueError("merge_lora: the model itself is a LoRALinear; call its merged() instead")
            _set_child(model, tuple(path), module.merged())
    _retype_variables(model, FrozenWeight, nnx.Param)
    return model


def save_lora_adapter(model: Any, path: str | os.PathLike) -> list[str]:
    """Write the adapters as a PEFT folder: ``adapter_config.json`` and ``adapter_model.safetensors``.

    ``peft.PeftModel.from_pretrained(transformers_model, path)`` loads it onto the Hugging Face model
    :func:`composerjax.models.save_pretrained` writes for the merged base (or the original
    checkpoint the base was loaded from). Tensor names are PEFT's
    (``base_model.model.<module>.lora_A.weight``, shape ``(rank, in)``; ``lora_B`` ``(out, rank)``);
    ``target_modules`` lists the wrapped modules' full Hugging Face names.

    Args:
        model: a GPT2 or Llama with LoRA applied (or a ComposerCausalLM holding one).
        path: the folder to write (created if missing).

    Returns:
        The two files written.

    Raises:
        ValueError: a model without adapters, adapters of different rank or scale, or a model
            Hugging Face has no architecture for.

    Example::

        save_lora_adapter(trainer.state.model, "export/adapter")
        # peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("export/base"), "export/adapter")
    """
    from safetensors.numpy import save_file

    from composerjax.models.hf_names import hf_parameter_names

    module = getattr(model, "module", model)
    wrappers = [(tuple(p), m) for p, m in nnx.iter_modules(module) if isinstance(m, LoRALinear)]
    if not wrappers:
        raise ValueError("save_lora_adapter: the model has no LoRA adapters (apply LoRA first)")
    ranks = {m.rank for _, m in wrappers}
    scales = {m.scale for _, m in wrappers}
    if len(ranks) != 1 or len(scales) != 1:
        raise ValueError(f"save_lora_adapter: the adapters have ranks {sorted(ranks)} and scales {sorted(scales)}; "
                         "a PEFT adapter folder holds one rank and one alpha")
    rank, scale = ranks.pop(), scales.pop()
    names = hf_parameter_names(merge_lora(nnx.clone(module)))
    config = module.config
    vocab = getattr(config, "vocab_size", None)
    tensors: dict[str, np.ndarray] = {}
    targets = []
    dropouts = set()
    for where, wrapper in wrappers:
        hf_name = names[_path_text(where) + "/kernel"]
        if not hf_name.endswith(".weight"):
            raise ValueError(f"save_lora_adapter: {_path_text(where)} maps to {hf_name!r}, not a Linear weight")
        a = np.asarray(jax.device_get(wrapper.lora_a[...]))
        b = np.asarray(jax.device_get(wrapper.lora_b[...]))
        if where[-1] == "head" and vocab is not None:
            b = b[..., :vocab]  # our head is padded to a multiple; Hugging Face's is not
        stacked = "{layer}" in hf_name
        for layer in range(a.shape[0] if stacked else 1):
            name = hf_name[: -len(".weight")].replace("{layer}", str(layer))
            layer_a, layer_b = (a[layer], b[layer]) if stacked else (a, b)
            tensors[f"base_model.model.{name}.lora_A.weight"] = np.ascontiguousarray(layer_a.T)
            tensors[f"base_model.model.{name}.lora_B.weight"] = np.ascontiguousarray(layer_b.T)
            targets.append(name)
        dropouts.add(wrapper.dropout.rate if wrapper.dropout is not None else 0.0)
    from composerjax.models.gpt2 import GPT2

    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "inference_mode": True,
        "r": rank, "lora_alpha": scale * rank, "lora_dropout": max(dropouts), "bias": "none",
        "target_modules": sorted(targets), "fan_in_fan_out": isinstance(module, GPT2), "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": None,
    }
    folder = os.fspath(path)
    written = [os.path.join(folder, ADAPTER_CONFIG_FILE), os.path.join(folder, ADAPTER_WEIGHTS_FILE)]
    if jax.process_index() == 0:
        os.makedirs(folder, exist_ok=True)
        with open(written[0], "w", encoding="utf-8") as file:
            json.dump(adapter_config, file, indent=2)
        save_file(tensors, written[1], metadata={"format": "pt"})
    return written
