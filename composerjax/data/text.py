"""Byte-level text that ships with Python itself: ``pydoc_data.topics``, for offline language modelling."""

from __future__ import annotations

import numpy as np

__all__ = ["load_pydoc_bytes", "byte_windows"]


def load_pydoc_bytes() -> np.ndarray:
    """Return the text of ``pydoc_data.topics`` (Python's own help topics) as a ``uint8`` array.

    Example:
        >>> data = load_pydoc_bytes()
        >>> data.dtype, len(data) > 100_000
        (dtype('uint8'), True)
    """
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def byte_windows(data: np.ndarray, seq_len: int, stride: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Cut ``data`` into next-byte prediction pairs ``(inputs, targets)`` of shape ``(N, seq_len)``.

    Targets are the inputs shifted by one byte; windows start every ``stride`` bytes (default
    ``seq_len``, non-overlapping).

    Example:
        >>> x, y = byte_windows(np.arange(10, dtype=np.uint8), seq_len=4)
        >>> x.tolist(), y.tolist()
        ([[0, 1, 2, 3], [4, 5, 6, 7]], [[1, 2, 3, 4], [5, 6, 7, 8]])
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: expected a positive integer")
    stride = stride or seq_len
    starts = np.arange(0, len(data) - seq_len, stride)
    index = starts[:, None] + np.arange(seq_len)[None]
    return data[index].astype(np.int32), data[index + 1].astype(np.int32)
