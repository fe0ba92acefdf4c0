"""Sequence length warmup: train language models on short sequences first, growing them to full length.

The sequence length grows linearly from ``min_seq_length`` to ``max_seq_length`` over the first
``duration`` of training, in steps of ``step_size`` tokens, then stays at ``max_seq_length``. Batches
are cut to that length on the host (``AFTER_DATALOADER``), so the compiled step is built once per
distinct length: a handful, listed up front by :meth:`SeqLengthWarmup.planned_lengths`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from composerjax import Algorithm, Event, Logger, State
from composerjax.algorithms.schedule_times import planned_progress

__all__ = ["warmup_sequence_length", "set_batch_sequence_length", "SeqLengthWarmup"]


def warmup_sequence_length(progress: float, duration: float, min_seq_length: int, max_seq_length: int,
                           step_size: int) -> int:
    """Return the sequence length at ``progress`` (fraction of training elapsed) of the warmup.

    ``min_seq_length + step_size * floor(f * (max_seq_length - min_seq_length) / step_size)`` where
    ``f = min(progress / duration, 1)``; ``max_seq_length`` once the warmup is over.

    Example:
        >>> [warmup_sequence_length(p, 0.5, 8, 32, 8) for p in (0.0, 0.2, 0.3, 0.45, 0.5, 0.9)]
        [8, 16, 16, 24, 32, 32]
    """
    warmed = 1.0 if duration <= 0 else min(progress / duration, 1.0)
    if warmed >= 1.0:
        return max_seq_length
    steps = int(np.floor(warmed * (max_seq_length - min_seq_length) / step_size))
    return min(min_seq_length + step_size * steps, max_seq_length)


def _sequence_length(batch: Any) -> int:
    for leaf in jax.tree.leaves(batch):
        if np.ndim(leaf) > 1:
            return int(np.shape(leaf)[1])
    raise ValueError("set_batch_sequence_length: no array of the batch has a sequence dimension "
                     "(expected arrays of shape (N, T, ...))")


def set_batch_sequence_length(batch: Any, seq_len: int, truncate: bool = True,
                              preserve_end_of_sequence: bool = False) -> Any:
    """Cut every ``(N, T, ...)`` array of ``batch`` (any pytree) to sequences of ``seq_len`` tokens.

    ``truncate=True`` keeps the first ``seq_len`` tokens of each sequence. With
    ``preserve_end_of_sequence`` (a dict batch with an ``'attention_mask'``, as Composer requires)
    each sequence's last real token, at ``attention_mask.sum(1) - 1``, is written over position
    ``min(that, seq_len - 1)`` of the cut sequence, in every array: ``[10, 11, 12, 13, 14, 15]`` cut to
    3 becomes ``[10, 11, 15]``. ``truncate=False`` keeps every token instead: each array is flattened
    to ``N * T`` tokens, the last ``N * T % seq_len`` are dropped and the rest reshaped into
    ``N * T // seq_len`` sequences of ``seq_len`` (all arrays must then share their ``(N, T)``;
    ``preserve_end_of_sequence`` is ignored). A ``seq_len`` at least ``T`` returns the batch unchanged.

    Example:
        >>> x = np.arange(12).reshape(2, 6)
        >>> set_batch_sequence_length((x, x + 1), 4)[0].tolist()
        [[0, 1, 2, 3], [6, 7, 8, 9]]
        >>> set_batch_sequence_length((x, x + 1), 4, truncate=False)[0].tolist()
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        >>> batch = {"input_ids": np.array([[10, 11, 12, 13, 14, 15]]), "attention_mask": np.ones((1, 6), int)}
        >>> set_batch_sequence_length(batch, 3, preserve_end_of_sequence=True)["input_ids"].tolist()
        [[10, 11, 15]]
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r}: expected a positive integer")
    length = _sequence_length(batch)
    if seq_len >= length:
        return batch
    leaves = jax.tree.leaves(batch)
    for leaf in leaves:
        if np.ndim(leaf) < 2:
            raise ValueError(f"set_batch_sequence_length: every array must be (N, T, ...); one has shape "
                             f"{np.shape(leaf)}")
    if truncate and preserve_end_of_sequence:
        return _truncate_keeping_end(batch, seq_len)
    if truncate:
        return jax.tree.map(lambda leaf: leaf[:, :seq_len], batch)
    size = np.shape(leaves[0])[0]
    for leaf in leaves:
        if np.shape(leaf)[:2] != (size, length):
            raise ValueError(f"set_batch_sequence_length(truncate=False): every array must have the same (N, T) "
                             f"= {(size, length)} to be regrouped; one has shape {np.shape(leaf)}")
    kept = size * length // seq_len * seq_len

    def regroup(leaf: Any) -> Any:
        tokens = leaf.reshape(size * length, *np.shape(leaf)[2:])[:kept]
        return tokens.reshape(kept // seq_len, seq_len, *np.shape(leaf)[2:])

    return jax.tree.map(regroup, batch)


def _truncate_keeping_end(batch: Any, seq_len: int) -> Any:
    if not isinstance(batch, Mapping) or "attention_mask" not in batch:
        keys = f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else ""
        raise ValueError("set_batch_sequence_length(preserve_end_of_sequence=True) needs a dict batch with an "
                         f"'attention_mask' (it marks where each sequence ends); got a {type(batch).__name__}{keys}")
    mask = np.asarray(batch["attention_mask"])
    rows = np.arange(mask.shape[0])
    end = mask.sum(axis=1).astype(np.int64) - 1  # -1 for an empty mask: the last position, as torch indexes
    end_kept = np.minimum(end, seq_len - 1)

    def cut(leaf: Any) -> Any:
        last = leaf[rows, end]
        if isinstance(leaf, np.ndarray):
            kept = leaf[:, :seq_len].copy()
            kept[rows, end_kept] = last
            return kept
        return leaf[:, :seq_len].at[rows, end_kept].set(last)

    return jax.tree.map(cut, batch)




class SeqLengthWarmup(Algorithm):
    """Warm up the sequence length: train on short sequences first, growing them linearly to full length.

    Runs on the host at ``AFTER_DATALOADER`` and cuts every ``(N, T, ...)`` array of the batch
    (inputs and targets alike) to the current length; the compiled step is built once per distinct
    length (see :meth:`planned_lengths`). Eval batches are left whole.

    Args:
        duration: the fraction of training over which the length grows, in ``[0, 1]``.
        min_seq_length: the length at the start.
        max_seq_length: the length at the end of the warmup (longer batches are cut to it for the
            whole run; shorter ones are never padded).
        step_size: the length grows in steps of this many tokens (multiples of 8 suit accelerators).
        truncate: keep the first tokens of each sequence (``True``), or regroup all tokens of the
            batch into more, shorter sequences (``False``; the remainder is dropped).
        preserve_end_of_sequence: when truncating, keep each sequence's last real token (found
            from the batch's ``'attention_mask'``) as the last token of the cut sequence; see
            :func:`set_batch_sequence_length`.

    Example::

        trainer = Trainer(ComposerClassifier(TinyGPT(rngs=nnx.Rngs(0)), 256), loader, '1000ba',
                          algorithms=[SeqLengthWarmup(duration=0.3, min_seq_length=8, max_seq_length=256)])
    """

    def __init__(
        self,
        duration: float = 0.3,
        min_seq_length: int = 8,
        max_seq_length: int = 1024,
        step_size: int = 8,
        truncate: bool = True,
        preserve_end_of_sequence: bool = False,
    ) -> None:
        if not 0 <= duration <= 1:
            raise ValueError(f"duration={duration!r}: expected a fraction of training in [0, 1]")
        for name, value in (("min_seq_length", min_seq_length), ("max_seq_length", max_seq_length),
                            ("step_size", step_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer (tokens)")
        if max_seq_length < min_seq_length:
            raise ValueError(f"max_seq_length={max_seq_length!r}: expected at least min_seq_length={min_seq_length}")
        if not isinstance(truncate, bool):
            raise ValueError(f"truncate={truncate!r}: expected True (cut sequences) or False (regroup tokens)")
        if not isinstance(preserve_end_of_sequence, bool):
            raise ValueError(f"preserve_end_of_sequence={preserve_end_of_sequence!r}: expected True or False")
        self.duration = duration
        self.min_seq_length = min_seq_length
        self.max_seq_length = max_seq_length
        self.step_size = step_size
        self.truncate = truncate
        self.preserve_end_of_sequence = preserve_end_of_sequence
        self._full_length: int | None = None

    def length_at(self, progress: float) -> int:
        """The sequence length the schedule gives at ``progress`` of training."""
        return warmup_sequence_length(progress, self.duration, self.min_seq_length, self.max_seq_length,
                                      self.step_size)

    def planned_lengths(self, state: State, sequence_length: int | None = None) -> list[int]:
        """The distinct sequence lengths of the whole run, in order: the train step compiles once per length.

        Args:
            state: the trainer's state (its ``max_duration`` must be in batches, or in epochs with a
                sized dataloader).
            sequence_length: the length of the batches the dataloader yields; by default the length
                of the last batch seen.
        """
        if sequence_length is None:
            if self._full_length is None:
                raise ValueError("planned_lengths: pass sequence_length; no batch has been seen yet")
            sequence_length = self._full_length
        lengths: dict[int, None] = {}
        for progress in planned_progress(state):
            lengths.setdefault(min(self.length_at(progress), sequence_length), None)
        return list(lengths)

    events = frozenset({Event.AFTER_DATALOADER})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        self._full_length = _sequence_length(state.batch)
        seq_len = self.length_at(state.progress)
        state.batch = set_batch_sequence_length(state.batch, seq_len, self.truncate, self.preserve_end_of_sequence)
        leaf = jax.tree.leaves(state.batch)[0]
        logger.log_metrics({"seq_length_warmup/curr_seq_len": min(seq_len, self._full_length),
                            "seq_length_warmup/curr_bs": int(np.shape(leaf)[0])})

    def __repr__(self) -> str:
        return (f"SeqLengthWarmup(duration={self.duration}, min_seq_length={self.min_seq_length}, "
                f"max_seq_length={self.max_seq_length}, step_size={self.step_size}, truncate={self.truncate}, "
                f"preserve_end_of_sequence={self.preserve_end_of_sequence})")
