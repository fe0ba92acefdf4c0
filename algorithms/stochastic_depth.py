"""Stochastic depth: skip a residual block's branch at random while training (Huang et al., 2016).

Surgery at ``Event.INIT``: each residual block of the target class (one with a ``residual(x)``
method, like ``BasicBlock`` and ``DecoderBlock``) is wrapped in a :class:`StochasticBlock`. Block
``l`` of ``L`` is dropped with probability ``drop_rate * (l + 1) / L`` ('linear') or ``drop_rate``
('uniform').

Two methods, as in Composer:

* ``'block'`` (the paper): the whole batch drops the branch (computed and masked, as a cond is slow on
  XLA:CPU; a dropped branch leaves its batch-norm statistics unchanged). A dropped ``BasicBlock``
  returns ``x``, or ``relu(shortcut(x))`` when it has a shortcut conv, as Composer's bottleneck does.
* ``'sample'`` (EfficientNet's drop-path): each sample skips the branch on its own.

Two scalings (``scaling``), for both methods:

* ``'eval'`` (Composer's, the default): training uses the kept branch as is; evaluation scales the
  branch by ``1 - p``, its expected value.
* ``'train'`` (inverted drop-path, as timm / ``nnx.Dropout``): kept branches are scaled by
  ``1 / (1 - p)`` in training, so evaluation uses the branch as is.

Evaluation is deterministic. Randomness comes from an ``nnx.Rngs`` stream owned by each wrapper
(``rngs.dropout``), carried through the compiled step like any other module state.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from composerjax import Algorithm, Event, Logger, State, Time, TimeUnit
from composerjax.models import BasicBlock, DecoderBlock
from composerjax.models.surgery import replace_modules

__all__ = [
    "RESIDUAL_POLICIES",
    "ResidualPolicy",
    "StochasticBlock",
    "StochasticDepth",
    "StochasticDepthRate",
    "apply_stochastic_depth",
    "block_drop_rates",
    "policy_for",
    "warmup_drop_rates",
]

STOCHASTIC_METHODS = ("block", "sample")
DROP_DISTRIBUTIONS = ("uniform", "linear")
SCALINGS = ("eval", "train")


def _identity(block: nnx.Module, x: jax.Array) -> jax.Array:
    return x


def _add(identity: jax.Array, residual: jax.Array) -> jax.Array:
    return identity + residual


def _basic_block_identity(block: BasicBlock, x: jax.Array) -> jax.Array:
    return x if block.shortcut is None else block.shortcut(x)


def _add_relu(identity: jax.Array, residual: jax.Array) -> jax.Array:
    return nnx.relu(identity + residual)


def _basic_block_dropped(block: BasicBlock, x: jax.Array, identity: jax.Array) -> jax.Array:
    # Composer's dropped bottleneck: its input unchanged, or relu(downsample(x)) with a downsample.
    return x if block.shortcut is None else nnx.relu(identity)


@dataclasses.dataclass(frozen=True)
class ResidualPolicy:
    """How a block joins its branch to its input: ``combine(identity(block, x), residual)``.

    ``dropped(block, x, identity)`` is what a block dropped whole (``'block'`` method) returns;
    ``None`` means ``combine(identity, 0)``.
    """

    identity: Callable[[nnx.Module, jax.Array], jax.Array]
    combine: Callable[[jax.Array, jax.Array], jax.Array]
    dropped: Callable[[nnx.Module, jax.Array, jax.Array], jax.Array] | None = None


#: Per block class; a class with a ``residual`` method that is not listed here (nor a subclass of one
#: that is) must compute ``x + residual(x)``. Add an entry for any other form.
RESIDUAL_POLICIES: dict[type, ResidualPolicy] = {
    BasicBlock: ResidualPolicy(_basic_block_identity, _add_relu, _basic_block_dropped),
    DecoderBlock: ResidualPolicy(_identity, _add),
}
_ADD = ResidualPolicy(_identity, _add)
#: Composer's name, 'ResNetBottleneck', is accepted for the residual block of this project's ResNets.
_TARGETS_BY_NAME: dict[str, type] = {"BasicBlock": BasicBlock, "DecoderBlock": DecoderBlock,
                                     "ResNetBottleneck": BasicBlock}


def block_drop_rates(num_blocks: int, drop_rate: float, drop_distribution: str = "linear") -> list[float]:
    """Drop probability of each of ``num_blocks`` blocks, in model order.

    Example:
        >>> block_drop_rates(4, 0.2), block_drop_rates(2, 0.2, 'uniform')
        ([0.05, 0.1, 0.15, 0.2], [0.2, 0.2])
    """
    if drop_distribution == "uniform":
        return [drop_rate] * num_blocks
    return [round(drop_rate * (index + 1) / num_blocks, 12) for index in range(num_blocks)]


class StochasticDepthRate(nnx.Variable):
    """The current drop probability of a :class:`StochasticBlock` (state, not a trained parameter)."""


class StochasticBlock(nnx.Module):
    """A residual block whose branch is dropped at random in training (``deterministic=False``).

    ``model.train()`` / ``model.eval()`` set ``deterministic`` (as they do for ``nnx.Dropout``).

    Args:
        block: a module with a ``residual(x)`` method; kept as ``block`` with all its weights.
        drop_rate: the probability of dropping the branch (``target_drop_rate``; ``drop_rate`` holds
            the current value, lower during warmup).
        stochastic_method: ``'block'`` (whole batch) or ``'sample'`` (per sample).
        rngs: draws the drops from its ``dropout`` stream.
        policy: how ``block`` joins identity and branch; looked up in ``RESIDUAL_POLICIES`` by default.
        scaling: ``'eval'`` (Composer's: branch times ``1 - p`` in evaluation) or ``'train'``
            (inverted: kept branches times ``1 / (1 - p)`` in training).
    """

    def __init__(self, block: nnx.Module, drop_rate: float, stochastic_method: str = "block", *,
                 rngs: nnx.Rngs, policy: ResidualPolicy | None = None, scaling: str = "eval") -> None:
        _check_method_and_rate(stochastic_method, drop_rate)
        _check_scaling(scaling)
        self.block = block
        self.scaling = scaling
        self.target_drop_rate = float(drop_rate)
        self.drop_rate = StochasticDepthRate(jnp.asarray(drop_rate, jnp.float32))
        self.stochastic_method = stochastic_method
        self.policy = policy if policy is not None else policy_for(type(block))
        self.rngs = rngs
        self.deterministic = False

    def __call__(self, x: jax.Array) -> jax.Array:
        identity = self.policy.identity(self.block, x)
        keep_probability = 1 - self.drop_rate[...]
        if self.deterministic:
            residual = self.block.residual(x)
            if self.scaling == "eval":
                residual = residual * keep_probability.astype(residual.dtype)
            return self.policy.combine(identity, residual)
        # 'train' scaling: kept branches times 1 / (1 - p); 0 when p == 1 (nothing is kept then).
        inverse = jnp.where(keep_probability > 0, 1 / jnp.where(keep_probability > 0, keep_probability, 1.0), 0.0)
        if self.stochastic_method == "block":
            keep = jax.random.bernoulli(self.rngs.dropout(), keep_probability)
            # The branch is computed and masked rather than skipped with a cond: XLA:CPU runs convs
            # inside a conditional ~35x slower (benchmarks/algorithms.py). A dropped branch still
            # leaves its batch-norm statistics as they were.
            stats_before = nnx.to_pure_dict(nnx.state(self.block, nnx.BatchStat))  # values, not variables
            residual = self.block.residual(x)
            stats_after = nnx.to_pure_dict(nnx.state(self.block, nnx.BatchStat))
            kept_stats = jax.tree.map(lambda new, old: jnp.where(keep, new, old), stats_after, stats_before)
            nnx.update(self.block, nnx.State(kept_stats))
            if self.scaling == "train":
                residual = residual * inverse.astype(residual.dtype)
            kept = self.policy.combine(identity, residual)
            if self.policy.dropped is None:
                dropped = self.policy.combine(identity, jnp.zeros_like(residual))
            else:
                dropped = self.policy.dropped(self.block, x, identity)
            return jnp.where(keep, kept, dropped)
        residual = self.block.residual(x)
        keep = jax.random.bernoulli(self.rngs.dropout(), keep_probability, (x.shape[0],) + (1,) * (residual.ndim - 1))
        scale = jnp.where(keep, inverse if self.scaling == "train" else 1.0, 0.0).astype(residual.dtype)
        return self.policy.combine(identity, residual * scale)


def policy_for(block_class: type) -> ResidualPolicy:
    """The ``RESIDUAL_POLICIES`` entry for ``block_class`` or its nearest listed base; ``x + residual`` if none."""
    for cls in block_class.__mro__:
        if cls in RESIDUAL_POLICIES:
            return RESIDUAL_POLICIES[cls]
    return _ADD


def apply_stochastic_depth(model: nnx.Module, target_layer_name: str | type = "BasicBlock",
                           stochastic_method: str = "block", drop_rate: float = 0.2,
                           drop_distribution: str = "linear", seed: int | jax.Array = 0,
                           scaling: str = "eval") -> int:
    """Wrap every block of the target class in ``model`` in a :class:`StochasticBlock`; return how many.

    Blocks are numbered in definition order (the order ``replace_modules`` walks the model); block
    ``l`` gets its own random stream, ``fold_in(seed, l)``. Blocks already wrapped are left alone.

    Example:
        >>> from composerjax.models import SmallResNet
        >>> model = SmallResNet(width=4, rngs=nnx.Rngs(0))
        >>> apply_stochastic_depth(model, 'BasicBlock', drop_rate=0.2)
        2
        >>> [block.target_drop_rate for block in model.blocks]
        [0.1, 0.2]
    """
    target = _target_class(target_layer_name)
    _check_method_and_rate(stochastic_method, drop_rate)
    _check_distribution(drop_distribution)
    _check_scaling(scaling)
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    wrapped = {id(module.block) for _, module in nnx.iter_modules(model) if isinstance(module, StochasticBlock)}
    blocks: list[nnx.Module] = []

    def collect(block: nnx.Module) -> nnx.Module:
        if id(block) not in wrapped:
            blocks.append(block)
        return block

    replace_modules(model, {target: collect})
    rates = dict(zip(map(id, blocks), block_drop_rates(len(blocks), drop_rate, drop_distribution)))
    index_of = {id(block): index for index, block in enumerate(blocks)}

    def wrap(block: nnx.Module) -> nnx.Module:
        if id(block) not in index_of:
            return block
        rngs = nnx.Rngs(dropout=jax.random.fold_in(key, index_of[id(block)]))
        return StochasticBlock(block, rates[id(block)], stochastic_method, rngs=rngs, scaling=scaling)

    replace_modules(model, {target: wrap})
    return len(blocks)


def warmup_drop_rates(model: nnx.Module, fraction_done: jax.Array) -> None:
    """Set every :class:`StochasticBlock`'s ``drop_rate`` to ``target_drop_rate * clip(fraction_done, 0, 1)``."""
    ramp = jnp.clip(jnp.asarray(fraction_done, jnp.float32), 0.0, 1.0)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, StochasticBlock):
            module.drop_rate[...] = module.target_drop_rate * ramp


class StochasticDepth(Algorithm):
    """Drop residual branches at random in training, deeper blocks more often (surgery at ``Event.INIT``).

    Args:
        target_layer_name: ``'BasicBlock'`` (or Composer's ``'ResNetBottleneck'``, the same block),
            ``'DecoderBlock'``, or a block class with a ``residual(x)`` method (see
            ``RESIDUAL_POLICIES`` for how it must combine).
        stochastic_method: ``'block'`` (whole batch, the paper) or ``'sample'`` (per sample).
        drop_rate: the drop probability of the last block ('linear') or of every block ('uniform').
        drop_distribution: ``'linear'`` in depth or ``'uniform'``.
        drop_warmup: ramp the drop rates up linearly from 0 over this much of training: a fraction
            of ``max_duration`` (float, or a ``'dur'`` time) or a number of batches (``'100ba'``).
            Done inside the compiled step at ``BEFORE_TRAIN_BATCH``; a fraction needs a known
            ``max_duration``.
        seed: the random streams of the blocks; ``None`` derives it from the trainer's ``seed``.
        scaling: ``'eval'`` (Composer's, default): training keeps the branch unscaled and
            evaluation multiplies it by ``1 - p``; ``'train'`` (inverted drop-path): kept branches are
            multiplied by ``1 / (1 - p)`` in training and evaluation uses them as is.

    Example::

        trainer = Trainer(ComposerClassifier(SmallResNet(rngs=nnx.Rngs(0)), 10), loader, '10ep',
                          algorithms=[StochasticDepth('BasicBlock', drop_rate=0.2, drop_warmup='0.1dur')])
    """

    def __init__(self, target_layer_name: str | type = "BasicBlock", stochastic_method: str = "block",
                 drop_rate: float = 0.2, drop_distribution: str = "linear",
                 drop_warmup: float | str | Time = 0.0, seed: int | None = None, scaling: str = "eval") -> None:
        self.target = _target_class(target_layer_name)
        _check_method_and_rate(stochastic_method, drop_rate)
        _check_distribution(drop_distribution)
        _check_scaling(scaling)
        self.scaling = scaling
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed={seed!r}: expected an integer or None (derive it from the trainer's seed)")
        self.target_layer_name = target_layer_name
        self.stochastic_method = stochastic_method
        self.drop_rate = drop_rate
        self.drop_distribution = drop_distribution
        self.drop_warmup = _warmup_time(drop_warmup)
        self.seed = seed

    events = frozenset({Event.INIT, Event.BEFORE_TRAIN_BATCH})

    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT or (event == Event.BEFORE_TRAIN_BATCH and self.drop_warmup.value > 0)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            seed = jax.random.key(self.seed) if self.seed is not None else jax.random.fold_in(state.rng, 0x5D)
            replaced = apply_stochastic_depth(state.model, self.target, self.stochastic_method, self.drop_rate,
                                              self.drop_distribution, seed, self.scaling)
            logger.log_hyperparameters({"stochastic_depth/num_replaced": replaced})
            logger.log_metrics({"stochastic_depth/num_stochastic_layers": replaced})  # Composer's name
            if replaced == 0:
                warnings.warn(f"StochasticDepth replaced no modules: the model has no {self.target.__name__}"
                              f"{_unsupported_blocks(state.model)}", stacklevel=2)
            elif self.drop_warmup.value > 0:
                warmup_drop_rates(state.model, jnp.zeros(()))
            return
        # BEFORE_TRAIN_BATCH, traced: the rates are module state the step carries, so no recompile.
        if self.drop_warmup.unit == TimeUnit.BATCH:
            done = state.step / self.drop_warmup.value
        else:
            done = state.progress / self.drop_warmup.value
        warmup_drop_rates(state.model, done)

    def __repr__(self) -> str:
        return (f"StochasticDepth(target_layer_name={self.target.__name__!r}, "
                f"stochastic_method={self.stochastic_method!r}, drop_rate={self.drop_rate}, "
                f"drop_distribution={self.drop_distribution!r}, drop_warmup={self.drop_warmup!r}, "
                f"scaling={self.scaling!r})")


def _unsupported_blocks(model: nnx.Module) -> str:
    """A note naming the language-model blocks in ``model`` that StochasticDepth cannot wrap ('' if none)."""
    from composerjax.models.gpt2 import GPT2Block
    from composerjax.models.llama import LlamaBlock

    found = sorted({type(module).__name__ for _, module in nnx.iter_modules(model)
                    if isinstance(module, (GPT2Block, LlamaBlock))})
    if not found:
        return ""
    return (f" (its blocks, {', '.join(found)}, are not supported: they take positions and a KV cache and have no "
            "residual(x) method to drop; StochasticDepth wraps BasicBlock and TinyGPT's DecoderBlock)")


def _target_class(target_layer_name: str | type) -> type:
    if isinstance(target_layer_name, str):
        if target_layer_name not in _TARGETS_BY_NAME:
            raise ValueError(f"target_layer_name={target_layer_name!r}: expected one of "
                             f"{sorted(_TARGETS_BY_NAME)} or an nnx.Module class with a residual(x) method")
        return _TARGETS_BY_NAME[target_layer_name]
    if isinstance(target_layer_name, type) and issubclass(target_layer_name, nnx.Module) and callable(
            getattr(target_layer_name, "residual", None)):
        return target_layer_name
    raise ValueError(f"target_layer_name={target_layer_name!r}: expected one of {sorted(_TARGETS_BY_NAME)} "
                     "or an nnx.Module class with a residual(x) method")


def _check_method_and_rate(stochastic_method: str, drop_rate: float) -> None:
    if stochastic_method not in STOCHASTIC_METHODS:
        raise ValueError(f"stochastic_method={stochastic_method!r}: expected one of {STOCHASTIC_METHODS}")
    if isinstance(drop_rate, bool) or not isinstance(drop_rate, (int, float)) or not 0.0 <= drop_rate <= 1.0:
        raise ValueError(f"drop_rate={drop_rate!r}: expected a probability in [0, 1]")


def _check_scaling(scaling: str) -> None:
    if scaling not in SCALINGS:
        raise ValueError(f"scaling={scaling!r}: expected 'eval' (Composer's: scale the branch by 1 - p in "
                         "evaluation) or 'train' (inverted drop-path: scale kept branches by 1 / (1 - p) in training)")


def _check_distribution(drop_distribution: str) -> None:
    if drop_distribution not in DROP_DISTRIBUTIONS:
        raise ValueError(f"drop_distribution={drop_distribution!r}: expected one of {DROP_DISTRIBUTIONS}")


def _warmup_time(drop_warmup: float | str | Time) -> Time:
    message = (f"drop_warmup={drop_warmup!r}: expected a fraction of training in [0, 1) (a float or a 'dur' "
               "time such as '0.1dur') or a number of batches such as '100ba'")
    if isinstance(drop_warmup, bool):
        raise ValueError(message)
    if isinstance(drop_warmup, (int, float)):
        drop_warmup = Time(float(drop_warmup), TimeUnit.DURATION)
    elif isinstance(drop_warmup, str):
        try:
            drop_warmup = Time.from_timestring(drop_warmup)
        except ValueError as error:
            raise ValueError(message) from error
    if not isinstance(drop_warmup, Time):
        raise ValueError(message)
    if drop_warmup.unit == TimeUnit.DURATION and 0.0 <= drop_warmup.value < 1.0:
        return drop_warmup
    if drop_warmup.unit == TimeUnit.BATCH and drop_warmup.value >= 0:
        return drop_warmup
    raise ValueError(message)
