"""Hugging Face checkpoints in and out: :func:`load_pretrained` and :func:`save_pretrained`, never over the network.

:func:`load_pretrained` reads a local folder as ``transformers.save_pretrained`` writes it
(``config.json`` and ``model.safetensors``, or shards listed in ``model.safetensors.index.json``)
into the native families: ``GPT2LMHeadModel`` into :class:`~composerjax.models.GPT2`;
``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen2ForCausalLM`` into
:class:`~composerjax.models.llama.Llama`. The model is built abstractly (``nnx.eval_shape``: no
weights allocated) and filled tensor by tensor: each is read with ``safetensors``' ``safe_open``
(numpy), laid out as ours (transposed, the vocabulary padded) and placed straight into its
target sharding with ``jax.make_array_from_callback``, so each device receives only its shard and a
model larger than one device loads under FSDP.

:func:`save_pretrained` writes the other direction: ``config.json`` and safetensors (sharded with an
index above ``max_shard_size``) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads with
the same logits. A model whose structure no longer maps (surgery such as gated linear units on
GPT-2, ALiBi or rotary positions on GPT-2, wrapped linears) is refused with the reason.
:func:`hf_parameter_names` is the mapping both directions use.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from composerjax.models.gpt2 import GPT2, GPT2MLP, GPT2Attention, GPT2Block, GPT2Config
from composerjax.models.hf_config import ARCHITECTURES, config_from_hf, config_to_hf, hf_architecture
from composerjax.models.hf_names import (
    ParameterMapping,
    bare_model,
    hf_parameter_names,
    parameter_mappings,
    path_text,
    weights_state,
)
from composerjax.models.llama import Llama, LlamaAttention, LlamaBlock, LlamaMLP, RMSNorm
from composerjax.parallel.strategy import ParallelismConfig, partition_metadata

__all__ = ["ARCHITECTURES", "SAFETENSORS_FILE", "SAFETENSORS_INDEX_FILE", "hf_parameter_names", "load_pretrained",
           "save_pretrained"]

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
#: Overrides :func:`load_pretrained` takes: how the model runs, not its shape.
OVERRIDES = ("attention", "remat", "scan_layers", "pad_vocab_to_multiple")
# Tensors some checkpoints carry that hold no weights (buffers of older transformers versions).
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")

# The module types each family is made of; anything else is structure Hugging Face has no place for.
_GPT2_MODULES = (GPT2, GPT2Block, GPT2Attention, GPT2MLP, nnx.List, nnx.Linear, nnx.LayerNorm, nnx.Embed, nnx.Dropout)
_LLAMA_MODULES = (Llama, LlamaBlock, LlamaAttention, LlamaMLP, nnx.List, nnx.Linear, RMSNorm, nnx.Embed)


# -- load ---------------------------------------------------------------------------------------
def load_pretrained(path: str | os.PathLike, *, dtype: Any = None, mesh: Mesh | None = None,
                    parallelism: ParallelismConfig | None = None, **overrides: Any) -> GPT2 | Llama:
    """Read a local Hugging Face folder into a native :class:`~composerjax.models.GPT2` or :class:`Llama`.

    The module returns ``(batch, length, vocab_size)`` logits for ``(batch, length)`` integer token
    ids; it comes in eval mode (no dropout), as transformers' ``from_pretrained`` returns it.
    Tensors are read one at a time and each is placed straight into its sharding on ``mesh``: the
    partition metadata, then ``parallelism``'s rules, then FSDP on the largest dimension the
    mesh's 'fsdp' axis divides (as the Trainer shards parameters), so no device ever holds a whole
    sharded weight. Nothing is downloaded.

    Args:
        path: a local folder with ``config.json`` and ``model.safetensors`` (or safetensors shards
            with ``model.safetensors.index.json``).
        dtype: the parameters' dtype; None is float32 (what training wants), whatever the
            checkpoint stores; ``jnp.bfloat16`` halves the memory.
        mesh: place the parameters on this mesh; None uses the mesh set with ``jax.set_mesh``
            if there is one, else the default device.
        parallelism: rules and ``min_fsdp_size`` for the placement (its ``fsdp``/``tensor`` counts
            are the mesh's); None: the partition metadata, then FSDP.
        **overrides: how the model runs, not its shape: ``attention``, ``remat``, ``scan_layers``,
            ``pad_vocab_to_multiple``.

    Raises:
        ValueError: a path that is not a local folder (a hub id: download it first), a missing
            ``config.json`` or safetensors, an architecture or config field that is not supported,
            tensors missing from or unexpected in the checkpoint, a shape that does not fit.

    Example::

        model = load_pretrained("checkpoints/SmolLM-135M")      # a folder, e.g. from `hf download ... --local-dir`
        logits = model(jnp.asarray([[1, 2, 3]]))                # (1, 3, 49152)
    """
    folder = _local_folder(path)
    hf_config = _read_json(os.path.join(folder, CONFIG_FILE), "config.json")
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        raise ValueError(f"load_pretrained({unknown[0]}=...): not an override; expected one of "
                         f"{', '.join(OVERRIDES)} (the shape comes from config.json)")
    param_dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
    config = config_from_hf(hf_config, param_dtype=param_dtype, **overrides)
    family = GPT2 if isinstance(config, GPT2Config) else Llama
    abstract = nnx.eval_shape(lambda: family(config, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    flat = list(nnx.to_flat_state(params))
    mappings = parameter_mappings(abstract, [path_text(p) for p, _ in flat])
    weight_files = _weight_files(folder)
    located = _check_names(abstract, mappings, weight_files)
    mesh = _active_mesh(mesh)
    metadata = partition_metadata(abstract) if mesh is not None else {}
    rules = parallelism or ParallelismConfig()
    reader = _Reader(folder, located)
    try:
        for key, variable in flat:
            name = path_text(key)
            shape = tuple(variable.get_value().shape)
            sharding = None
            if mesh is not None:
                sharding = NamedSharding(mesh, rules.spec_for(name, shape, dict(mesh.shape), metadata.get(name)))
            if sharding is None:  # one device: arrange on the device, where it is several times faster
                variable.set_value(_ours_on_device(reader, mappings[name], shape, config, name, param_dtype))
            else:
                host = _ours_from_hf(reader, mappings[name], shape, config, name)
                variable.set_value(_place(host.astype(param_dtype, copy=False), sharding))
    finally:
        reader.close()
    params = nnx.from_flat_state(flat)
    if jax.tree.leaves(rest):
        # Random-stream state (dropout keys) is tiny; make it for real, replicated.
        rest = jax.jit(lambda: nnx.state(family(config, rngs=nnx.Rngs(0)), nnx.Not(nnx.Param)))()
    model = nnx.merge(graphdef, params, rest)
    model.eval()  # as transformers' from_pretrained: dropout off until model.train() (the Trainer switches modes)
    return model


def _local_folder(path: Any) -> str:
    text = os.fspath(path)
    if os.path.isdir(text):
        return text
    if os.path.exists(text):
        raise ValueError(f"load_pretrained({text!r}): a file, expected a Hugging Face model folder (config.json and "
                         "model.safetensors)")
    parts = text.split("/")
    if len(parts) == 2 and all(parts) and not text.startswith((".", "~")):  # reads as a hub id: 'owner/name'
        raise ValueError(f"load_pretrained({text!r}): no such local folder. Nothing is downloaded (no network "
                         "access): a hub id such as 'HuggingFaceTB/SmolLM-135M' must be downloaded first (e.g. `hf "
                         f"download {text} --local-dir DIR`), then pass the local folder")
    raise ValueError(f"load_pretrained({text!r}): no such local folder (looked for {os.path.abspath(text)}); "
                     "expected a Hugging Face model folder on this machine (config.json and model.safetensors). "
                     "Nothing is downloaded: pass the local folder")


def _read_json(path: str, what: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ValueError(f"{os.path.dirname(path) or '.'} has no {what}: expected a Hugging Face model folder as "
                         "transformers' save_pretrained writes it")
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def _weight_files(folder: str) -> dict[str, str]:
    """``{tensor name: safetensors file}`` from the index, or every tensor of ``model.safetensors``."""
    from safetensors import safe_open

    index = os.path.join(folder, SAFETENSORS_INDEX_FILE)
    if os.path.isfile(index):
        weight_map = _read_json(index, SAFETENSORS_INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: expected a 'weight_map' of tensor names to files")
        for file in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(folder, file)):
                raise ValueError(f"{index} lists {file}, which is not in {folder}")
        return dict(weight_map)
    single = os.path.join(folder, SAFETENSORS_FILE)
    if not os.path.isfile(single):
        found = sorted(name for name in os.listdir(folder) if name.endswith((".bin", ".pt", ".pth", ".h5", ".msgpack")))
        hint = f" (it has {', '.join(found)}: only safetensors are read)" if found else ""
        raise ValueError(f"{folder} has neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX_FILE}{hint}")
    with safe_open(single, framework="numpy") as handle:
        return dict.fromkeys(handle.keys(), SAFETENSORS_FILE)


def _check_names(module: nnx.Module, mappings: dict[str, ParameterMapping],
                 weight_files: dict[str, str]) -> dict[str, tuple[str, str]]:
    """``{name the mapping uses: (file, name stored)}``; missing or unexpected tensors raise ValueError.

    A checkpoint saved from the base model (``GPT2Model``, as the published GPT-2 is) names its
    tensors without the ``transformer.`` / ``model.`` prefix; those are read under the full names.
    """
    prefix = "transformer." if isinstance(module, GPT2) else "model."
    located = {name: (file, name) for name, file in weight_files.items()}
    if not any(name.startswith(prefix) for name in weight_files):
        located = {(name if name == "lm_head.weight" else prefix + name): (file, name)
                   for name, file in weight_files.items()}
    weight_files = {name: file for name, (file, _) in located.items()}
    wanted = {name for mapping in mappings.values() for name in mapping.names}
    missing = sorted(wanted - set(weight_files))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) {hf_architecture(module)} needs, e.g. "
                         f"{missing[:3]}")
    tied = module.config.tie_embeddings if isinstance(module, GPT2) else module.config.tie_word_embeddings
    extra = sorted(name for name in set(weight_files) - wanted
                   if not name.endswith(_BUFFERS) and not (tied and name == "lm_head.weight"))
    if extra:
        raise ValueError(f"the checkpoint holds {len(extra)} tensor(s) the {hf_architecture(module)} layout has no "
                         f"place for, e.g. {extra[:3]}")
    return located


class _Reader:
    """Open safetensors files (numpy), one tensor read at a time."""

    def __init__(self, folder: str, located: dict[str, tuple[str, str]]) -> None:
        self.folder, self.located, self.handles = folder, located, {}

    def read(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        file, stored = self.located[name]
        if file not in self.handles:
            self.handles[file] = safe_open(os.path.join(self.folder, file), framework="numpy")
        return self.handles[file].get_tensor(stored)

    def close(self) -> None:
        for handle in self.handles.values():
            exit_ = getattr(handle, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self.handles.clear()


def _ours_from_hf(reader: _Reader, mapping: ParameterMapping, shape: tuple[int, ...], config: Any, name: str
                  ) -> np.ndarray:
    layers = []
    for hf_name in mapping.names:
        tensor = reader.read(hf_name)
        layers.append(tensor.T if mapping.transposed else tensor)
    host = np.stack(layers) if mapping.stacked else layers[0]
    axis = mapping.vocab_axis
    if axis is not None and host.shape[axis] == config.vocab_size != shape[axis]:
        pad = [(0, 0)] * host.ndim
        pad[axis] = (0, shape[axis] - config.vocab_size)
        host = np.pad(host, pad)
    if tuple(host.shape) != shape:
        raise ValueError(f"{', '.join(mapping.names[:1])}: shape {tuple(host.shape)} in the checkpoint does not fit "
                         f"{name} of shape {shape} (as config.json describes the model)")
    return host


def _ours_on_device(reader: _Reader, mapping: ParameterMapping, shape: tuple[int, ...], config: Any, name: str,
                    dtype: Any) -> jax.Array:
    """:func:`_ours_from_hf` on the default device: the stored tensors go over as they are (contiguous,
    in the checkpoint's dtype), and the transpose, stacking, vocabulary padding and cast run compiled."""
    tensors = tuple(jax.device_put(reader.read(hf_name)) for hf_name in mapping.names)
    stored = tensors[0].shape[::-1] if mapping.transposed else tensors[0].shape
    stored = (len(tensors), *stored) if mapping.stacked else stored
    axis = mapping.vocab_axis
    pad = shape[axis] - config.vocab_size if axis is not None and stored[axis] == config.vocab_size else 0
    expected = tuple(size + pad if index == axis else size for index, size in enumerate(stored))
    if expected != shape:
        raise ValueError(f"{', '.join(mapping.names[:1])}: shape {tuple(stored)} in the checkpoint does not fit "
                         f"{name} of shape {shape} (as config.json describes the model)")
    return _arrange(tensors, mapping.transposed, mapping.stacked, axis if pad else None, pad, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _arrange(tensors: tuple[jax.Array, ...], transposed: bool, stacked: bool, axis: int | None, pad: int,
             dtype: Any) -> jax.Array:
    layers = [tensor.T if transposed else tensor for tensor in tensors]
    array = jnp.stack(layers) if stacked else layers[0]
    if axis is not None:
        widths = [(0, 0)] * array.ndim
        widths[axis] = (0, pad)
        array = jnp.pad(array, widths)
    return array.astype(dtype)


def _active_mesh(mesh: Mesh | None) -> Mesh | None:
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise ValueError(f"mesh={mesh!r}: expected a jax.sharding.Mesh (composerjax.parallel.build_mesh)")
        return mesh
    current = jax.sharding.get_mesh()
    return current if isinstance(current, Mesh) and not current.empty else None


def _place(host: np.ndarray, sharding: NamedSharding | None) -> jax.Array:
    if sharding is None:
        return jax.device_put(host)
    # Each device receives only the slice its shard covers.
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


# -- save ---------------------------------------------------------------------------------------
def _merge_wrappers(module: nnx.Module) -> nnx.Module:
    """``module``, or a copy whose wrappers with a ``merged()`` method (LoRA adapters) are replaced by what it returns.

    The copy (``nnx.clone``: the arrays are shared, not copied) leaves the caller's model as it was,
    adapters and all, to go on training.
    """
    allowed = _GPT2_MODULES if isinstance(module, GPT2) else _LLAMA_MODULES
    wrapped = [path for path, node in nnx.iter_graph(module)
               if path and isinstance(node, nnx.Module) and type(node) not in allowed
               and callable(getattr(node, "merged", None))]
    if not wrapped:
        return module
    module = nnx.clone(module)
    for path in sorted(wrapped, key=len, reverse=True):
        parent: Any = module
        for part in path[:-1]:
            parent = parent[part] if isinstance(part, int) else getattr(parent, part)
        child = parent[path[-1]] if isinstance(path[-1], int) else getattr(parent, path[-1])
        merged = child.merged()
        if isinstance(path[-1], int):
            parent[path[-1]] = merged
        else:
            setattr(parent, path[-1], merged)
    return module


def _check_structure(module: nnx.Module) -> None:
    allowed = _GPT2_MODULES if isinstance(module, GPT2) else _LLAMA_MODULES
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module) and type(node) not in allowed:
            where = path_text(path) or "the model"
            raise ValueError(f"{where} is a {type(node).__module__}.{type(node).__qualname__}, which Hugging Face's "
                             f"{hf_architecture(module)} has no place for (surgery or a wrapper changed the structure; "
                             "merge or undo it before exporting)")


def save_pretrained(model: Any, path: str | os.PathLike, *, merge: bool = True,
                    max_shard_size: int = 5 * 2**30) -> list[str]:
    """Write ``model`` as a Hugging Face folder: ``config.json`` and safetensors that transformers loads.

    ``transformers.AutoModelForCausalLM.from_pretrained(path)`` rebuilds it with the same logits. The
    weights are written in their own dtype, without the vocabulary padding; above
    ``max_shard_size`` bytes they are split into ``model-0000i-of-0000n.safetensors`` files listed in
    ``model.safetensors.index.json``. A wrapper with a ``merged()`` method returning an
    ``nnx.Linear`` (a LoRA adapter) is exported merged, from a copy: ``model`` keeps its adapters.
    In a multi-process run every process must call it (sharded parameters are gathered); process 0
    writes.

    Args:
        model: a :class:`~composerjax.models.GPT2` or :class:`~composerjax.models.llama.Llama`, or a
            :class:`~composerjax.models.ComposerCausalLM` holding one (``trainer.state.model``).
        path: the folder to write (created if missing).
        merge: LoRA adapters are merged into the weights (the default); ``False`` writes only the
            adapters, as a PEFT adapter folder (:func:`~composerjax.models.lora.save_lora_adapter`:
            ``adapter_config.json`` and ``adapter_model.safetensors``, which
            ``peft.PeftModel.from_pretrained(base, path)`` loads over the original model).
        max_shard_size: the most bytes of tensors in one file.

    Returns:
        The files written (paths), ``config.json`` (or ``adapter_config.json``) first.

    Raises:
        ValueError: a model whose structure or configuration no longer maps onto the Hugging Face
            architecture (naming the module or field and why), or a bad ``max_shard_size``.

    Example::

        save_pretrained(trainer.state.model, "export/my-llama")
        # transformers.AutoModelForCausalLM.from_pretrained("export/my-llama")
    """
    from safetensors.numpy import save_file

    if not isinstance(merge, bool):
        raise ValueError(f"merge={merge!r}: expected True (merge LoRA adapters into the weights) or False (write "
                         "a PEFT adapter folder)")
    if not merge:
        from composerjax.models.lora import save_lora_adapter

        return save_lora_adapter(model, path)
    module = bare_model(model)
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise ValueError(f"max_shard_size={max_shard_size!r}: expected a positive number of bytes")
    module = _merge_wrappers(module)
    _check_structure(module)
    hf_config = config_to_hf(module)
    flat = [(path_text(key), variable.get_value()) for key, variable in nnx.to_flat_state(weights_state(module))]
    mappings = parameter_mappings(module, [name for name, _ in flat])
    config = module.config
    sizes = []
    for name, value in flat:  # plan the files from shapes alone
        per_layer = math.prod(value.shape[1:] if mappings[name].stacked else value.shape)
        if mappings[name].vocab_axis is not None:
            per_layer = per_layer // value.shape[mappings[name].vocab_axis] * config.vocab_size
        sizes.extend((hf_name, per_layer * value.dtype.itemsize) for hf_name in mappings[name].names)
    shards = _plan_shards(sizes, max_shard_size)
    file_of = {hf_name: file for file, names in shards.items() for hf_name in names}
    writing = jax.process_index() == 0
    folder = os.fspath(path)
    if writing:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, CONFIG_FILE), "w", encoding="utf-8") as file:
            json.dump(hf_config, file, indent=2)
    pending: dict[str, dict[str, np.ndarray]] = {file: {} for file in shards}
    written = [os.path.join(folder, CONFIG_FILE)]
    for name, value in flat:
        host = _host(value)
        mapping = mappings[name]
        if mapping.vocab_axis is not None:
            host = np.take(host, np.arange(config.vocab_size), axis=mapping.vocab_axis)
        for layer, hf_name in enumerate(mapping.names):
            tensor = host[layer] if mapping.stacked else host
            pending[file_of[hf_name]][hf_name] = np.ascontiguousarray(tensor.T if mapping.transposed else tensor)
            if len(pending[file_of[hf_name]]) == len(shards[file_of[hf_name]]):  # a file is complete: write it
                file = file_of[hf_name]
                if writing:
                    save_file(pending[file], os.path.join(folder, file), metadata={"format": "pt"})
                written.append(os.path.join(folder, file))
                pending[file] = {}
    if len(shards) > 1 and writing:
        index = {"metadata": {"total_size": sum(size for _, size in sizes)},
                 "weight_map": {hf_name: file_of[hf_name] for hf_name, _ in sorted(sizes)}}
        with open(os.path.join(folder, SAFETENSORS_INDEX_FILE), "w", encoding="utf-8") as file:
            json.dump(index, file, indent=2)
        written.append(os.path.join(folder, SAFETENSORS_INDEX_FILE))
    return written


def _plan_shards(sizes: list[tuple[str, int]], max_shard_size: int) -> dict[str, list[str]]:
    groups: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if groups[-1] and used + size > max_shard_size:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    if len(groups) == 1:
        return {SAFETENSORS_FILE: groups[0]}
    count = len(groups)
    return {f"model-{i + 1:05d}-of-{count:05d}.safetensors": names for i, names in enumerate(groups)}


def _host(value: jax.Array) -> np.ndarray:
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        value = multihost_utils.process_allgather(value, tiled=True)
    return np.asarray(jax.device_get(value))
