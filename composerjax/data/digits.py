"""The digits data set bundled with scikit-learn: 1,797 8x8 images, offline, our small real data set."""

from __future__ import annotations

import numpy as np

__all__ = ["load_digits_split"]


def load_digits_split(
    train_size: int = 1500, seed: int = 0
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Return ``((x_train, y_train), (x_test, y_test))``: images scaled to [0, 1], int32 labels.

    The split is a fixed-seed permutation. Needs scikit-learn (the ``examples`` extra).

    Example:
        >>> (x_train, y_train), (x_test, y_test) = load_digits_split()
        >>> x_train.shape, x_test.shape, y_train.dtype
        ((1500, 8, 8), (297, 8, 8), dtype('int32'))
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("load_digits_split needs scikit-learn: pip install 'composerjax[examples]'") from error
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int32)
    if not 0 < train_size < len(images):
        raise ValueError(f"train_size={train_size}: expected an integer between 1 and {len(images) - 1}")
    order = np.random.default_rng(seed).permutation(len(images))
    train, test = order[:train_size], order[train_size:]
    return (images[train], labels[train]), (images[test], labels[test])
