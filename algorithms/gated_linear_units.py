"""Gated Linear Units: turn each transformer feed-forward ``down(act(up(x)))`` into ``down(act(gate(x)) * up(x))``.

The gated form (Shazeer, 2020, "GLU Variants Improve Transformer") multiplies the up projection
elementwise by an activated gate projection. The surgery keeps the block's ``up`` and ``down``
kernels and adds a freshly initialised ``gate`` Linear, so the model gains ``dim * hidden``
parameters per block.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from composerjax import Algorithm, Event, Logger, State
from composerjax.models import FeedForward
from composerjax.models.surgery import replace_modules

__all__ = ["GatedLinearUnits", "GLUFeedForward", "apply_gated_linear_units", "glu_from_feed_forward"]

Activation = Callable[[jax.Array], jax.Array]


class GLUFeedForward(nnx.Module):
    """``down(act_fn(gate(x)) * up(x))``: a gated feed-forward block.

    Example:
        >>> rngs = nnx.Rngs(0)
        >>> glu = GLUFeedForward(nnx.Linear(4, 8, rngs=rngs), nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs))
        >>> glu(jnp.ones((2, 4))).shape
        (2, 4)
    """

    def __init__(self, gate: nnx.Linear, up: nnx.Linear, down: nnx.Linear, act_fn: Activation = nnx.gelu) -> None:
        self.gate = gate
        self.up = up
        self.down = down
        self.act_fn = act_fn

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.act_fn(self.gate(x)) * self.up(x))


def _constant(value: jax.Array) -> Any:
    return lambda key, shape, dtype=None: jnp.asarray(value, dtype if dtype is not None else value.dtype)


def _per_layer(initializer: Any, layers: tuple[int, ...]) -> Any:
    """``initializer`` drawn once per layer along the leading ``layers`` axes (scanned blocks), each its own key."""
    if not layers:
        return initializer
    inner = _per_layer(initializer, layers[1:])

    def draw(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return jax.vmap(lambda layer_key: inner(layer_key, shape, dtype))(jax.random.split(key, layers[0]))

    return draw


def _named(initializer: Any, names: tuple[str | None, ...] | None) -> Any:
    """``initializer`` with partition metadata ``names`` (none: as it is)."""
    return initializer if names is None else nnx.with_partitioning(initializer, names, eager_sharding=False)


def glu_from_feed_forward(
    feed_forward: FeedForward,
    act_fn: Activation | None = None,
    gated_layer_bias: bool = False,
    non_gated_layer_bias: bool = False,
    *,
    rngs: nnx.Rngs,
) -> GLUFeedForward:
    """Build the gated version of ``feed_forward``: its ``up`` kernel (and bias, if kept) and its ``down`` Linear.

    The new ``gate`` Linear (``dim -> hidden``) has nnx.Linear's default initialisation from ``rngs``
    and a zero bias when ``gated_layer_bias``. ``up`` keeps its kernel; it keeps its bias only with
    ``non_gated_layer_bias`` (a zero bias is added if it had none). ``act_fn`` defaults to the block's
    own ``act_fn`` attribute, else GELU (``FeedForward``'s activation). Scanned blocks (GPT-2 with
    ``scan_layers=True``: one block whose arrays have a leading layer axis) get a gate per layer,
    stacked the same way. The gate and ``up`` keep the old ``up``'s partition metadata.
    """
    old_up = feed_forward.up
    layers = old_up.kernel[...].shape[:-2]  # () for one block; (n_layer,) for scanned blocks
    common = {"dtype": old_up.dtype, "param_dtype": old_up.param_dtype, "precision": old_up.precision}
    # The gate and the new up split over the devices as the old up did (its kernel's names; the bias's
    # drop the input axis).
    kernel_names = old_up.kernel.get_metadata().get("out_sharding")
    bias_names = None if kernel_names is None else (*kernel_names[:-2], kernel_names[-1])
    bias_init = _named(_per_layer(nnx.initializers.zeros_init(), layers), bias_names)
    gate = nnx.Linear(old_up.in_features, old_up.out_features, use_bias=gated_layer_bias,
                      kernel_init=_named(_per_layer(nnx.nn.linear.default_kernel_init, layers), kernel_names),
                      bias_init=bias_init, rngs=rngs, **common)
    up_bias = _named(_constant(old_up.bias[...]), bias_names) if old_up.use_bias else bias_init
    up = nnx.Linear(old_up.in_features, old_up.out_features, use_bias=non_gated_layer_bias,
                    kernel_init=_named(_constant(old_up.kernel[...]), kernel_names), bias_init=up_bias, rngs=rngs,
                    **common)
    activation = act_fn if act_fn is not None else getattr(feed_forward, "act_fn", nnx.gelu)
    return GLUFeedForward(gate, up, feed_forward.down, activation)


def apply_gated_linear_units(
    model: nnx.Module,
    act_fn: Activation | None = None,
    gated_layer_bias: bool = False,
    non_gated_layer_bias: bool = False,
    rngs: nnx.Rngs | int = 0,
) -> int:
    """Replace every ``FeedForward`` of ``model`` by a ``GLUFeedForward``, in place; return how many.

    Args:
        model: the module to change (e.g. a ``TinyGPT``).
        act_fn: the gate's activation (default: the block's own, GELU for ``FeedForward``).
        gated_layer_bias: give the new ``gate`` Linear a bias.
        non_gated_layer_bias: keep a bias on ``up``.
        rngs: ``nnx.Rngs`` or an integer seed for the new gate kernels.

    Example:
        >>> from composerjax.models import TinyGPT
        >>> model = TinyGPT(dim=8, depth=2, num_heads=2, max_length=8, rngs=nnx.Rngs(0))
        >>> apply_gated_linear_units(model)
        2
        >>> model.blocks[0].mlp.gate.kernel.shape
        (8, 32)
    """
    _validate(act_fn, gated_layer_bias, non_gated_layer_bias)
    rngs = rngs if isinstance(rngs, nnx.Rngs) else nnx.Rngs(params=rngs)
    return replace_modules(model, {FeedForward: lambda old: glu_from_feed_forward(
        old, act_fn, gated_layer_bias, non_gated_layer_bias, rngs=rngs)})


def _why_no_feed_forward(model: nnx.Module) -> str:
    """Why :func:`apply_gated_linear_units` found nothing: a Llama-class MLP is already gated (SwiGLU)."""
    from composerjax.models.llama import LlamaMLP

    if any(isinstance(module, LlamaMLP) for _, module in nnx.iter_modules(model)):
        return ("the model's MLPs are Llama-class (LlamaMLP), already gated linear units "
                "(SwiGLU: down(silu(gate(x)) * up(x))), so there is nothing to convert")
    return "the model has no FeedForward block"


def _validate(act_fn: Any, gated_layer_bias: Any, non_gated_layer_bias: Any) -> None:
    if act_fn is not None and not callable(act_fn):
        raise ValueError(f"act_fn={act_fn!r}: expected None (keep the block's activation) or a callable")
    for name, value in (("gated_layer_bias", gated_layer_bias), ("non_gated_layer_bias", non_gated_layer_bias)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: expected True or False")


class GatedLinearUnits(Algorithm):
    """Gate every transformer feed-forward block at INIT: ``down(act(gate(x)) * up(x))``.

    Runs once at ``Event.INIT`` (host): surgery on ``state.model`` (``FeedForward`` ->
    ``GLUFeedForward``) before its parameters are placed, so the optimizer state covers the new gate.
    The gate kernels are drawn from a key derived from the trainer's seed (``state.rng`` is not
    advanced). Logs ``gated_linear_units/num_replacements``.

    Args:
        act_fn: the gate's activation; ``None`` keeps the block's (GELU).
        gated_layer_bias: give the gate Linear a bias (default: no bias, as in the GLU paper).
        non_gated_layer_bias: keep the ``up`` Linear's bias (default: dropped).

    Example::

        trainer = Trainer(ComposerClassifier(TinyGPT(rngs=nnx.Rngs(0)), 256), loader, '1ep',
                          algorithms=[GatedLinearUnits()])
    """

    required_modules = (FeedForward,)

    def __init__(self, act_fn: Activation | None = None, gated_layer_bias: bool = False,
                 non_gated_layer_bias: bool = False) -> None:
        _validate(act_fn, gated_layer_bias, non_gated_layer_bias)
        self.act_fn = act_fn
        self.gated_layer_bias = gated_layer_bias
        self.non_gated_layer_bias = non_gated_layer_bias

    events = frozenset({Event.INIT})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        # A fixed fold of the run's key: the gates depend on the seed, and state.rng stays as it was.
        rngs = nnx.Rngs(params=jax.random.fold_in(state.rng, 0x474C55))
        replaced = apply_gated_linear_units(state.model, self.act_fn, self.gated_layer_bias,
                                            self.non_gated_layer_bias, rngs)
        logger.log_hyperparameters({"gated_linear_units/num_replacements": replaced})
        if replaced == 0:
            warnings.warn(f"GatedLinearUnits had no effect: {_why_no_feed_forward(state.model)}", UserWarning,
                          stacklevel=2)

    def __repr__(self) -> str:
        return (f"GatedLinearUnits(act_fn={getattr(self.act_fn, '__name__', self.act_fn)}, "
                f"gated_layer_bias={self.gated_layer_bias}, non_gated_layer_bias={self.non_gated_layer_bias})")
