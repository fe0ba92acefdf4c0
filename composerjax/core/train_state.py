"""The compiled step's state: one typed pytree, donated to and returned by every train step."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

__all__ = ["TrainState"]


class TrainState(NamedTuple):
    """Everything the train step reads and replaces, as named fields (a pytree, like optax's states).

    Attributes:
        params: the model's ``nnx.Param`` values, a nested dict like ``nnx.to_pure_dict``.
        rest: every other model variable (batch-norm statistics, RNG counters), encoded as arrays.
        opt_state: the optax state of ``params``.
        algorithm_state: each algorithm's device state by name (``Algorithm.init_state``).
        clock: ``[optimizer steps so far, steps in max_duration (0 when unknown)]`` as int32.

    Example:
        >>> import jax.numpy as jnp
        >>> state = TrainState(params={"w": jnp.ones(2)}, rest={}, opt_state=(), algorithm_state={},
        ...                    clock=jnp.zeros(2, jnp.int32))
        >>> state._replace(params={"w": jnp.zeros(2)}).params["w"].tolist()
        [0.0, 0.0]
    """

    params: Any
    rest: Any
    opt_state: Any
    algorithm_state: dict[str, Any]
    clock: jax.Array

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainState:
        """Rebuild from ``_asdict()`` (how checkpoints and ``State.state_dict`` store it).

        Raises:
            ValueError: ``values`` lacks a field or has one TrainState does not know.
        """
        expected, got = set(cls._fields), set(values)
        if expected != got:
            raise ValueError(f"train_state: fields {sorted(got)}, expected {sorted(expected)} "
                             f"(missing {sorted(expected - got)}, unknown {sorted(got - expected)})")
        return cls(**values)
