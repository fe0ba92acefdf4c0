"""LoRA: train low-rank adapters beside frozen linear layers (Hu et al., 2021, as Hugging Face PEFT does it).

The algorithm: at ``Event.INIT`` it wraps the targeted ``nnx.Linear`` layers in
:class:`~composerjax.models.lora.LoRALinear` (``y = x W (+ b) + (dropout(x) A B) * (alpha / rank)``,
``B`` zero so the wrapped model starts as the base model) and freezes every other weight
(:class:`~composerjax.models.lora.FrozenWeight`), so only the adapters train and the optimizer
state holds only them. The modules, :func:`merge_lora` and :func:`save_lora_adapter` live in
:mod:`composerjax.models.lora` (export uses them) and are re-exported here.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import jax
from flax import nnx

from composerjax import Algorithm, Event, Logger, State
from composerjax.models.lora import (
    DEFAULT_TARGET_MODULES,
    FrozenWeight,
    LoRALinear,
    _validate,
    apply_lora,
    lora_parameter_count,
    merge_lora,
    save_lora_adapter,
)

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "FrozenWeight",
    "LoRA",
    "LoRALinear",
    "apply_lora",
    "lora_parameter_count",
    "merge_lora",
    "save_lora_adapter",
]


class LoRA(Algorithm):
    """Fine-tune with low-rank adapters: wrap the targeted Linear layers at INIT; only the adapters train.

    Runs once at ``Event.INIT`` (host): surgery on ``state.model`` before its parameters are
    placed, so the optimizer state holds the adapters only (the frozen base weights are
    :class:`FrozenWeight`, kept with the model's state and checkpoints). ``A`` is drawn from a key
    derived from the trainer's seed (``state.rng`` is not advanced). Logs ``lora/num_wrapped`` and
    ``lora/trainable_parameters``; ``composerjax explain`` lists the wrapped modules.

    Args:
        rank: the adapters' rank ``r``.
        alpha: the adapter output is scaled by ``alpha / rank`` (PEFT's ``lora_alpha``).
        target_modules: names matched against each Linear's path components (``('q_proj', 'v_proj')``,
            GPT-2's ``('qkv', 'proj')``, or ``('attention',)`` for every attention Linear); ``None``
            takes those of :data:`DEFAULT_TARGET_MODULES` the model has.
        dropout: dropout on the adapter's input while training (PEFT's ``lora_dropout``).

    Example::

        trainer = Trainer(load_pretrained("smollm"), loader, "100ba",
                          algorithms=[LoRA(rank=8, alpha=16, target_modules=("q_proj", "v_proj"))])
    """

    required_modules = (nnx.Linear,)
    events = frozenset({Event.INIT})

    def __init__(self, rank: int = 8, alpha: float = 16, target_modules: Sequence[str] | None = None,
                 dropout: float = 0.0) -> None:
        _validate(rank, alpha, target_modules, dropout)
        self.rank = rank
        self.alpha = alpha
        self.target_modules = None if target_modules is None else tuple(target_modules)
        self.dropout = dropout
        self.wrapped: list[str] = []

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        rngs = nnx.Rngs(params=jax.random.fold_in(state.rng, 0x4C6F5241))  # "LoRA": the seed's, rng unmoved
        self.wrapped = apply_lora(state.model, self.rank, self.alpha, self.target_modules, self.dropout, rngs=rngs)
        logger.log_hyperparameters({"lora/num_wrapped": len(self.wrapped),
                                    "lora/trainable_parameters": lora_parameter_count(state.model)})
        if not self.wrapped:  # unreachable through apply_lora's checks; kept for subclasses that filter
            warnings.warn("LoRA wrapped no Linear layer", UserWarning, stacklevel=2)

    def explain_notes(self) -> list[str]:
        """What ``composerjax explain`` prints under this algorithm: the modules it wrapped."""
        if not self.wrapped:
            return []
        return [f"wraps {len(self.wrapped)} Linear layers (rank {self.rank}, alpha {self.alpha}): "
                + ", ".join(self.wrapped)]

    def __repr__(self) -> str:
        return (f"LoRA(rank={self.rank}, alpha={self.alpha}, target_modules={self.target_modules!r}, "
                f"dropout={self.dropout})")
