"""Carry PRNG keys through the step as raw key data: typed keys are slow to pass into jit."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["KeyCodec", "is_key"]


def is_key(leaf: Any) -> bool:
    """Whether ``leaf`` is a typed PRNG key array."""
    return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


class KeyCodec:
    """Swap the typed keys of a pytree (NNX ``RngKey`` variables) for their raw ``uint32`` data and back.

    Every step call flattens its arguments; a typed key costs a Python-level unflatten per call, raw
    key data costs nothing extra. The codec remembers which leaves were keys (and their impl) from
    a template, so ``decode`` can rebuild them inside the trace.

    Example:
        >>> codec = KeyCodec({'key': jax.random.key(0), 'count': jnp.zeros(())})
        >>> raw = codec.encode({'key': jax.random.key(0), 'count': jnp.zeros(())})
        >>> raw['key'].dtype, is_key(codec.decode(raw)['key'])
        (dtype('uint32'), True)
    """

    def __init__(self, template: Any) -> None:
        leaves, self.treedef = jax.tree.flatten(template)
        self.impls = [jax.random.key_impl(leaf) if is_key(leaf) else None for leaf in leaves]
        self.has_keys = any(impl is not None for impl in self.impls)

    def encode(self, tree: Any) -> Any:
        """Typed keys -> raw key data."""
        if not self.has_keys:
            return tree
        return jax.tree.map(lambda leaf: jax.random.key_data(leaf) if is_key(leaf) else leaf, tree)

    def decode(self, tree: Any) -> Any:
        """Raw key data -> typed keys, where the template had keys."""
        if not self.has_keys:
            return tree
        leaves = jax.tree.leaves(tree)
        leaves = [leaf if impl is None or is_key(leaf) else jax.random.wrap_key_data(leaf, impl=impl)
                  for leaf, impl in zip(leaves, self.impls)]
        return jax.tree.unflatten(self.treedef, leaves)
