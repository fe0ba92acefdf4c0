"""ComposerCausalLM: a next-token language model whose loss and metrics never hold the whole batch's logits.

``forward`` returns the final hidden states (:class:`LMOutputs`), ``loss`` is the chunked
cross-entropy of :mod:`composerjax.models.lm_loss` against the head, and ``eval_forward`` adds each
token's loss and argmax, computed chunk by chunk, from which Composer's language metrics
(``LanguageCrossEntropy``, ``LanguagePerplexity``, ``MaskedAccuracy``) take their states. Any other
metric gets the logits (``module.logits``), as ``ComposerClassifier`` would give it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from composerjax.metrics import CrossEntropy, MaskedAccuracy, Metric, named_metrics
from composerjax.models.composer_model import ComposerModel, MetricsArgument
from composerjax.models.gpt import language_metrics
from composerjax.models.lm_loss import cross_entropy_loss, token_statistics

__all__ = ["ComposerCausalLM", "LMOutputs"]

_maximum = np.maximum.reduce
_UNSIGNED = {np.dtype(f"i{size}"): np.dtype(f"u{size}") for size in (1, 2, 4, 8)}


@struct.dataclass
class LMOutputs:
    """What :class:`ComposerCausalLM` computes for a batch: hidden states, not logits.

    Attributes:
        hidden: ``(B, T, n_embd)`` final hidden states (the LM head's input).
        token_losses: ``(B, T)`` float32 cross-entropy per token (0 where the target is ignored);
            filled by ``eval_forward``.
        predictions: ``(B, T)`` int32 argmax over the vocabulary per token; filled by ``eval_forward``.
    """

    hidden: jax.Array
    token_losses: jax.Array | None = None
    predictions: jax.Array | None = None

    def __getattr__(self, name: str) -> Any:
        # Code that takes the outputs for logits (an algorithm reading ``state.outputs.shape``) is told why not.
        if name in ("shape", "dtype", "ndim", "astype", "reshape"):
            raise AttributeError(
                f"state.outputs is LMOutputs (hidden states), not logits, so it has no {name!r}: "
                "ComposerCausalLM computes the loss over the vocabulary in chunks and never holds the whole "
                "batch's logits. An algorithm that needs the logits (LabelSmoothing, MixUp, SelectiveBackprop) "
                "needs ComposerClassifier(module, vocab_size, val_metrics=language_metrics()) instead")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def _inputs_and_targets(batch: Any) -> tuple[jax.Array, jax.Array | None]:
    if isinstance(batch, (tuple, list)):
        return batch[0], (batch[1] if len(batch) > 1 else None)
    return batch, None


def _segment_ids(batch: Any) -> jax.Array | None:
    """A packed batch's third element: ``(B, T)`` segment ids (one per document), else None."""
    return batch[2] if isinstance(batch, (tuple, list)) and len(batch) > 2 else None


class ComposerCausalLM(ComposerModel):
    """Wrap a :class:`~composerjax.models.GPT2` into a next-token model for ``(inputs, targets)`` batches.

    A third batch element, ``(inputs, targets, segment_ids)`` (packed documents:
    :func:`~composerjax.data.lm_loader` with ``segment_ids``), goes to ``module.features(...,
    segment_ids=...)``: no token attends across a document boundary and positions restart per document.

    The training loss is the mean cross-entropy over the tokens whose target is not
    ``ignore_index``, computed over the vocabulary in chunks of ``chunk_size`` sequence positions
    (:func:`~composerjax.models.lm_loss.cross_entropy_loss`): the ``(B, T, vocab)`` float32 logits
    never exist at once, in the forward or the backward pass. ``state.outputs`` holds
    :class:`LMOutputs` (hidden states), not logits: algorithms that read logits from the outputs
    (``LabelSmoothing``, ``MixUp``, ``SelectiveBackprop``) need ``ComposerClassifier(module,
    vocab_size, val_metrics=language_metrics())`` instead, which computes the logits whole.

    Args:
        module: a ``GPT2`` (any module with ``features``, ``head_weight``, ``logits`` and a
            ``config.vocab_size`` works).
        train_metrics: metrics on train batches, as ``ComposerClassifier`` takes them; None for none.
        val_metrics: eval metrics; default :func:`~composerjax.models.gpt.language_metrics`.
        ignore_index: the target id left out of the loss and the metrics (padding, prompt tokens).
        chunk_size: sequence positions per chunk of the loss; None chooses it
            (:func:`~composerjax.models.lm_loss.chunk_length`).

    Example:
        >>> from composerjax.models.gpt2 import GPT2, GPT2Config
        >>> model = ComposerCausalLM(GPT2(GPT2Config.preset("gpt2-tiny"), rngs=nnx.Rngs(0)))
        >>> batch = (jnp.zeros((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32))
        >>> model.forward(batch).hidden.shape, round(float(model.loss(model.forward(batch), batch)), 1)
        ((2, 8, 64), 6.0)
    """

    def __init__(self, module: nnx.Module, train_metrics: MetricsArgument | None = None,
                 val_metrics: MetricsArgument | None = None, ignore_index: int = -100,
                 chunk_size: int | None = None) -> None:
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise ValueError(f"ignore_index={ignore_index!r}: expected an integer (Composer's is -100)")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                       or chunk_size < 1):
            raise ValueError(f"chunk_size={chunk_size!r}: expected a positive number of sequence positions, or None")
        self.module = module
        self.vocab_size = int(module.config.vocab_size)
        self.ignore_index, self.chunk_size = ignore_index, chunk_size
        if val_metrics is None:
            val_metrics = language_metrics(ignore_index)
        # Kept as (name, metric) pairs: a module's static attributes must be hashable.
        self.train_metrics = tuple(named_metrics(train_metrics or {}).items())
        self.val_metrics = tuple(named_metrics(val_metrics).items())

    def forward(self, batch: Any) -> LMOutputs:
        """The final hidden states of ``inputs = batch[0]`` (documents kept apart by ``batch[2]``, if any)."""
        segment_ids = _segment_ids(batch)
        if segment_ids is None:
            return LMOutputs(self.module.features(_inputs_and_targets(batch)[0]))
        return LMOutputs(self.module.features(batch[0], segment_ids=segment_ids))

    def loss(self, outputs: LMOutputs, batch: Any) -> jax.Array:
        """Mean next-token cross-entropy against ``batch[1]``, over the vocabulary in chunks."""
        return cross_entropy_loss(outputs.hidden, self.module.head_weight(), batch[1], vocab_size=self.vocab_size,
                                  ignore_index=self.ignore_index, chunk_size=self.chunk_size)

    def loss_token_count(self, batch: Any) -> jax.Array | None:
        """The tokens :meth:`loss` averages over: targets in ``[0, vocab_size)`` other than ``ignore_index``.

        Composer's 'loss_generating' tokens, for ``Trainer(accumulate_train_batch_on_tokens=True)``
        (see :meth:`ComposerModel.loss_token_count`); None for a batch without targets.

        Example:
            >>> from composerjax.models.gpt2 import GPT2, GPT2Config
            >>> model = ComposerCausalLM(GPT2(GPT2Config.preset("gpt2-tiny"), rngs=nnx.Rngs(0)))
            >>> int(model.loss_token_count((jnp.zeros((2, 3), jnp.int32), jnp.array([[1, 2, -100], [-100, -100, 5]]))))
            3
        """
        targets = _inputs_and_targets(batch)[1]
        if targets is None:
            return None
        targets = jnp.asarray(targets)
        return jnp.sum((targets != self.ignore_index) & (targets >= 0) & (targets < self.vocab_size), dtype=jnp.int32)

    def eval_forward(self, batch: Any, outputs: Any | None = None) -> Any:
        """:class:`LMOutputs` with each token's loss and argmax; a batch without targets gets the logits."""
        inputs, targets = _inputs_and_targets(batch)
        hidden = outputs.hidden if isinstance(outputs, LMOutputs) else self.forward(batch).hidden
        if targets is None:
            return self.module.logits(hidden)
        targets = jnp.asarray(targets)
        losses, predictions = token_statistics(hidden, self.module.head_weight(),
                                               jnp.where(targets == self.ignore_index, -1, targets),
                                               vocab_size=self.vocab_size, chunk_size=self.chunk_size)
        return LMOutputs(hidden, losses, predictions)

    def get_metrics(self, is_train: bool = False) -> dict[str, Metric]:
        """``{name: metric}``: the train metrics or the eval metrics."""
        return dict(self.train_metrics if is_train else self.val_metrics)

    def update_metric(self, batch: Any, outputs: Any, metric: Metric) -> Metric:
        """``metric`` updated with one batch: from the per-token losses and argmax where it can, else the logits.

        Example:
            >>> from composerjax.models.gpt2 import GPT2, GPT2Config
            >>> model = ComposerCausalLM(GPT2(GPT2Config.preset("gpt2-tiny"), rngs=nnx.Rngs(0)))
            >>> batch = (jnp.zeros((1, 4), jnp.int32), jnp.array([[1, 2, 3, -100]]))
            >>> int(model.update_metric(batch, model.eval_forward(batch), model.get_metrics()["MaskedAccuracy"]).count)
            3
        """
        targets = jnp.asarray(batch[1])
        if not isinstance(outputs, LMOutputs):
            return metric.update(outputs, targets)
        integer_targets = targets.ndim == outputs.hidden.ndim - 1
        if integer_targets and outputs.token_losses is None:
            outputs = self.eval_forward(batch, outputs)
        if integer_targets and type(metric).batch_state is CrossEntropy.batch_state:
            return metric.merge(metric.batch_state_from_losses(outputs.token_losses, targets))
        if integer_targets and type(metric).batch_state is MaskedAccuracy.batch_state:
            return metric.merge(metric.batch_state_from_predictions(outputs.predictions, targets))
        return metric.update(self.module.logits(outputs.hidden), targets)

    def check_batch(self, batch: Any) -> None:
        """Refuse, on the host, integer targets outside ``[0, vocab_size)`` other than ``ignore_index``.

        A target at or above the vocabulary would make the loss silently wrong. Only numpy integer
        targets are read (a ``jax.Array`` would wait for the device); one ``max`` over the targets
        read as unsigned in the common case.

        Raises:
            ValueError: naming ``batch[1]``, the first bad target and where it is, and what is accepted.
        """
        if type(batch) is not tuple and type(batch) is not list or len(batch) < 2:
            return
        labels = batch[1]
        if type(labels) is not np.ndarray or not labels.size or labels.dtype.kind not in "iu":
            return
        unsigned = _UNSIGNED.get(labels.dtype)
        top = _maximum(labels.view(unsigned) if unsigned is not None else labels, None)
        if top < self.vocab_size:
            return
        bad = (labels != self.ignore_index) & ((labels < 0) | (labels >= self.vocab_size))
        if not bad.any():
            return
        where = np.unravel_index(int(np.argmax(bad)), labels.shape)
        raise ValueError(
            f"batch[1] (targets) holds {int(labels[where])} at index {tuple(int(i) for i in where)}: expected token "
            f"ids from 0 to {self.vocab_size - 1} (vocab_size={self.vocab_size}) or ignore_index={self.ignore_index}; "
            f"{int(bad.sum())} of {labels.size} targets are out of range")
