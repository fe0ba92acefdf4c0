"""Data factories: named train/eval loaders for recipes and the CLI.

Each is registered by name in ``composerjax.registry.data`` (entry-point group ``composerjax.data``)
and returns :class:`DataSplits`, so a YAML recipe says ``data: {name: digits, batch_size: 64}``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from composerjax.data.array_loader import ArrayLoader

__all__ = ["DataSplits", "digits", "pydoc_text"]


class DataSplits(NamedTuple):
    """What a data factory returns: the train loader and the eval loader (``None`` when there is none)."""

    train: Iterable[Any]
    eval: Iterable[Any] | None = None


def digits(batch_size: int = 32, eval_batch_size: int = 99, seed: int = 0) -> DataSplits:
    """Return scikit-learn's digits (1,500 train / 297 eval 8x8 images, int32 labels) as shuffled batches.

    Needs scikit-learn (the ``examples`` extra). Pairs with the ``digits_cnn`` model.

    Args:
        batch_size: examples per training batch (the last partial batch is dropped).
        eval_batch_size: examples per eval batch (all 297 are evaluated).
        seed: seeds the train/eval split and the shuffling.

    Example:
        >>> splits = digits(batch_size=32)
        >>> x, y = next(iter(splits.train))
        >>> x.shape, y.dtype, len(splits.eval)
        ((32, 8, 8), dtype('int32'), 3)
    """
    from composerjax.data.digits import load_digits_split

    (x_train, y_train), (x_eval, y_eval) = load_digits_split(seed=seed)
    return DataSplits(
        train=ArrayLoader((x_train, y_train), batch_size=batch_size, seed=seed),
        eval=ArrayLoader((x_eval, y_eval), batch_size=eval_batch_size, shuffle=False, drop_last=False),
    )


def pydoc_text(seq_len: int = 64, batch_size: int = 16, eval_fraction: float = 0.1, seed: int = 0) -> DataSplits:
    """Return next-byte prediction batches ``(inputs, targets)`` cut from Python's own help text (offline).

    Windows of ``seq_len`` int32 tokens (bytes, vocabulary 256) do not overlap; ``targets`` are the
    inputs shifted by one byte. The last ``eval_fraction`` of the text is the eval split. Pairs with
    the ``tiny_gpt`` model.

    Args:
        seq_len: tokens per example.
        batch_size: examples per batch, for both splits.
        eval_fraction: the share of windows (taken from the end of the text) held out for eval, in [0, 1).
        seed: seeds the shuffling.

    Example:
        >>> splits = pydoc_text(seq_len=32, batch_size=4)
        >>> inputs, targets = next(iter(splits.train))
        >>> inputs.shape, targets.dtype, bool((inputs[:, 1:] == targets[:, :-1]).all())
        ((4, 32), dtype('int32'), True)
    """
    from composerjax.data.text import byte_windows, load_pydoc_bytes

    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) or not 0 <= eval_fraction < 1:
        raise ValueError(f"pydoc_text(eval_fraction={eval_fraction!r}): expected a number in [0, 1)")
    inputs, targets = byte_windows(load_pydoc_bytes(), seq_len)
    held_out = int(len(inputs) * eval_fraction)
    split = len(inputs) - held_out
    train = ArrayLoader((inputs[:split], targets[:split]), batch_size=batch_size, seed=seed)
    if held_out == 0:
        return DataSplits(train=train, eval=None)
    return DataSplits(train=train, eval=ArrayLoader((inputs[split:], targets[split:]), batch_size=batch_size,
                                                    shuffle=False, drop_last=False))
