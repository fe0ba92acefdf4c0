"""Pack tokenized documents into fixed-length language-model sequences, and serve them with grain.

Documents are joined into one token stream, each followed by the end-of-text id, and the stream
is cut into windows of ``seq_len + 1`` tokens that start every ``seq_len`` tokens: window ``i``
is ``stream[i * seq_len : (i + 1) * seq_len + 1]``, its inputs ``w[:-1]`` and its targets
``w[1:]``. Consecutive windows share one token (the last of window ``i`` is the first of window
``i + 1``), so every token of the kept stream is an input exactly once and, after the first, a
target exactly once: nothing is lost or seen twice within an epoch.

Example:
    >>> packed = pack_documents([[5, 6, 7], [8, 9]], seq_len=3, eos_id=0)
    >>> packed.tolist()  # the stream is 5 6 7 0 8 9 0
    [[5, 6, 7, 0], [0, 8, 9, 0]]
    >>> inputs, targets = PackedSequences(packed)[1]
    >>> inputs.tolist(), targets.tolist()
    ([0, 8, 9], [8, 9, 0])

With ``segment_ids`` the documents stay apart (packing without leaks): each token also carries its
document's index, records become ``(inputs, targets, segment_ids)``, a model given the segment ids
attends only within a document and restarts positions there, and the one target per boundary
that would cross it (a document's EOS predicting the next document's first token) is
``IGNORE_INDEX``. Each document's loss is then exactly its loss run alone (llm-foundry and
Levanter keep that target, predicted from the EOS, which attends only to its own document; here
it is dropped so nothing of one document conditions a prediction of another).

    >>> packed, documents = pack_documents([[5, 6, 7], [8, 9]], seq_len=3, eos_id=0, segment_ids=True)
    >>> [a.tolist() for a in PackedSequences(packed, segment_ids=documents)[0]]
    [[5, 6, 7], [6, 7, 0], [0, 0, 0]]
    >>> [a.tolist() for a in PackedSequences(packed, segment_ids=documents)[1]]
    [[0, 8, 9], [-100, 9, 0], [0, 1, 1]]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, overload

import numpy as np

from composerjax.data.array_loader import _check_int
from composerjax.data.grain_loader import GrainLoader

__all__ = ["IGNORE_INDEX", "PackedSequences", "dropped_tokens", "lm_loader", "pack_documents", "token_stream"]

#: The target id left out of the loss (Composer's and PyTorch's ``ignore_index``): boundary-crossing targets.
IGNORE_INDEX = -100


def token_stream(token_lists: Iterable[Iterable[int]], eos_id: int, dtype: Any = np.int32) -> np.ndarray:
    """Return the documents' tokens joined into one array, each document followed by ``eos_id``.

    Example:
        >>> token_stream([[5, 6], [], [7]], eos_id=0).tolist()
        [5, 6, 0, 0, 7, 0]
    """
    eos_id = _check_int("eos_id", eos_id, 0)
    eos = np.array([eos_id], dtype=dtype)
    pieces = []
    for index, tokens in enumerate(token_lists):
        array = np.asarray(tokens)
        if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
            raise ValueError(f"`token_lists[{index}]` must be a flat list of integer token ids, got an array of "
                             f"shape {array.shape} and dtype {array.dtype}")
        if array.size and (array.min() < 0 or array.max() > np.iinfo(dtype).max):
            raise ValueError(f"`token_lists[{index}]` holds ids outside [0, {np.iinfo(dtype).max}] "
                             f"(min {array.min()}, max {array.max()})")
        pieces.extend((array.astype(dtype, copy=False), eos))
    if not pieces:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(pieces)


def dropped_tokens(stream_length: int, seq_len: int) -> int:
    """How many tokens at the end of a stream of ``stream_length`` tokens :func:`pack_documents` drops.

    ``(stream_length - 1) % seq_len`` when at least one window fits, else the whole stream: the
    last ``(stream_length - 1) % seq_len`` tokens are never a target (the partial final window).

    Example:
        >>> dropped_tokens(7, seq_len=3), dropped_tokens(8, seq_len=3), dropped_tokens(3, seq_len=3)
        (0, 1, 3)
    """
    stream_length = _check_int("stream_length", stream_length, 0)
    seq_len = _check_int("seq_len", seq_len, 1)
    if stream_length < seq_len + 1:
        return stream_length
    return (stream_length - 1) % seq_len


@overload
def pack_documents(token_lists: Iterable[Iterable[int]], seq_len: int, eos_id: int, dtype: Any = ...,
                   *, segment_ids: Literal[False] = ...) -> np.ndarray: ...
@overload
def pack_documents(token_lists: Iterable[Iterable[int]], seq_len: int, eos_id: int, dtype: Any = ...,
                   *, segment_ids: Literal[True]) -> tuple[np.ndarray, np.ndarray]: ...
def pack_documents(
    token_lists: Iterable[Iterable[int]], seq_len: int, eos_id: int, dtype: Any = np.int32, *,
    segment_ids: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Pack documents into windows: an array of shape ``(n, seq_len + 1)``, one training sequence a row.

    The stream is every document followed by ``eos_id`` (:func:`token_stream`). Row ``i`` is
    ``stream[i * seq_len : (i + 1) * seq_len + 1]``, so consecutive rows overlap by one token and
    ``n = (len(stream) - 1) // seq_len``. Only the final partial window is dropped: the last
    ``(len(stream) - 1) % seq_len`` tokens of the stream (:func:`dropped_tokens`), fewer than
    ``seq_len``. Documents are not padded, and a sequence may span several documents (the EOS
    between them marks the boundary); attention is not masked at document boundaries unless the
    segment ids go along (``segment_ids=True``, then :class:`PackedSequences` / :func:`lm_loader`
    with ``segment_ids``).

    Args:
        token_lists: Each document's token ids, in order (say :func:`~composerjax.data.tokenizer.encode_documents`).
        seq_len: Inputs (and targets) per sequence.
        eos_id: The end-of-text id appended after every document.
        dtype: The integer dtype of the result.
        segment_ids: Also return, for every token of every window, the index of its document in
            ``token_lists`` (a document's EOS belongs to it): ``(windows, document_ids)``, both
            ``(n, seq_len + 1)``.

    Raises:
        ValueError: ``seq_len`` or ``eos_id`` not a valid integer, a document that is not a flat list
            of ids in the dtype's range, or a stream too short for one window.

    Example:
        >>> pack_documents([[1, 2, 3, 4, 5, 6]], seq_len=2, eos_id=9).tolist()  # stream 1..6 9
        [[1, 2, 3], [3, 4, 5], [5, 6, 9]]
        >>> pack_documents([[1, 2], [3]], seq_len=2, eos_id=9, segment_ids=True)[1].tolist()  # 1 2 9 | 3 9
        [[0, 0, 0], [0, 1, 1]]
    """
    seq_len = _check_int("seq_len", seq_len, 1)
    if not isinstance(segment_ids, bool):
        raise ValueError(f"segment_ids={segment_ids!r}: expected True (also return each token's document index) "
                         "or False")
    token_lists = [tokens if isinstance(tokens, (list, tuple, np.ndarray)) else list(tokens)
                   for tokens in token_lists]
    stream = token_stream(token_lists, eos_id, dtype)
    count = (len(stream) - 1) // seq_len if len(stream) else 0
    if count == 0:
        raise ValueError(f"the documents make a stream of {len(stream)} tokens (EOS included), too short for one "
                         f"window of seq_len + 1 = {seq_len + 1} tokens; pass more documents or a smaller `seq_len`")
    rows = np.arange(count)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    if not segment_ids:
        return stream[rows]
    lengths = np.fromiter((len(tokens) + 1 for tokens in token_lists), np.int64, len(token_lists))
    documents = np.repeat(np.arange(len(token_lists), dtype=np.int64), lengths)
    return stream[rows], documents[rows]


class PackedSequences:
    """A grain random-access source of packed sequences: record ``i`` is ``(inputs, targets)`` of window ``i``.

    ``inputs = packed[i, :-1]`` and ``targets = packed[i, 1:]``, both ``int32`` of length
    ``seq_len``. Picklable, so grain worker processes can read it. With ``segment_ids`` record
    ``i`` is ``(inputs, targets, segment_ids)``: the inputs' document ids renumbered from 0 in the
    window, and every target whose document differs from its input's set to :data:`IGNORE_INDEX`.

    Args:
        packed: A 2-D integer array of shape ``(n, seq_len + 1)`` from :func:`pack_documents`.
        segment_ids: The document index of every token of ``packed`` (the same shape), from
            ``pack_documents(..., segment_ids=True)``; None for plain ``(inputs, targets)`` records.

    Raises:
        ValueError: ``packed`` is not a non-empty 2-D integer array with at least 2 columns, or
            ``segment_ids`` is not an integer array of its shape.

    Example:
        >>> source = PackedSequences(np.array([[1, 2, 3], [3, 4, 5]]))
        >>> len(source), source.seq_len, [a.tolist() for a in source[0]]
        (2, 2, [[1, 2], [2, 3]])
    """

    def __init__(self, packed: Any, segment_ids: Any | None = None) -> None:
        array = np.asarray(packed)
        if array.ndim != 2 or array.shape[0] == 0 or array.shape[1] < 2 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"`packed` must be a non-empty 2-D integer array of shape (n, seq_len + 1) with "
                             f"seq_len >= 1, got shape {array.shape} and dtype {array.dtype}")
        self._packed = array
        self._segment_ids = None
        if segment_ids is not None:
            documents = np.asarray(segment_ids)
            if documents.shape != array.shape or not np.issubdtype(documents.dtype, np.integer):
                raise ValueError(f"`segment_ids` must be an integer array of the packed windows' shape {array.shape}, "
                                 f"got shape {documents.shape} and dtype {documents.dtype}")
            self._segment_ids = documents

    @property
    def seq_len(self) -> int:
        """Tokens per inputs (and per targets) sequence."""
        return self._packed.shape[1] - 1

    @property
    def packed(self) -> np.ndarray:
        """The packed windows, shape ``(len(self), seq_len + 1)``."""
        return self._packed

    def __len__(self) -> int:
        return self._packed.shape[0]

    @property
    def segment_ids(self) -> np.ndarray | None:
        """The document index of every token of :attr:`packed`, or None when the documents are not kept apart."""
        return self._segment_ids

    def __getitem__(self, index: int) -> tuple[np.ndarray, ...]:
        window = self._packed[index].astype(np.int32, copy=False)
        if self._segment_ids is None:
            return window[:-1], window[1:]
        documents = self._segment_ids[index]
        targets = np.where(documents[1:] == documents[:-1], window[1:], np.int32(IGNORE_INDEX)).astype(np.int32)
        return window[:-1], targets, (documents[:-1] - documents[0]).astype(np.int32)

    def __repr__(self) -> str:
        # grain puts repr(data_source) in its iterator state: keep it short and free of the data.
        segments = "" if self._segment_ids is None else ", segment_ids=True"
        return f"PackedSequences(num_records={len(self)}, seq_len={self.seq_len}{segments})"


def lm_loader(
    packed: Any,
    batch_size: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    worker_count: int = 0,
    shard_by_process: bool = True,
    drop_remainder: bool = True,
    segment_ids: Any | None = None,
    pad_remainder: bool = False,
) -> GrainLoader:
    """Serve packed sequences as batches ``(inputs, targets)`` of shape ``(batch_size, seq_len)`` with grain.

    A :class:`~composerjax.data.GrainLoader` over :class:`PackedSequences`: a ``grain.DataLoader``
    per epoch (worker processes with ``worker_count > 0``), split across JAX processes with
    ``grain.sharding.ShardByJaxProcess`` (process ``p`` of ``P`` takes records ``p, p + P, ...`` of
    each epoch's global shuffle), and a checkpointable iterator (``state_dict`` /
    ``load_state_dict``) for exact mid-epoch resume.

    Args:
        packed: The array from :func:`pack_documents`, or a :class:`PackedSequences`.
        batch_size: Sequences per batch on THIS process.
        seed: Non-negative seed of the per-epoch shuffles.
        shuffle: Shuffle the sequences every epoch (use False for evaluation).
        worker_count: grain worker processes; 0 reads in this process.
        shard_by_process: Split the sequences across JAX processes; if False every process reads all.
        drop_remainder: Drop the last, incomplete batch.
        segment_ids: The document ids from ``pack_documents(..., segment_ids=True)``: batches become
            ``(inputs, targets, segment_ids)`` and no target crosses a document (:class:`PackedSequences`).
        pad_remainder: With ``drop_remainder=False``, fill the last, incomplete batch up to
            ``batch_size`` with sequences whose inputs are 0 and whose targets are all
            :data:`IGNORE_INDEX` (left out of the loss and the language metrics), so an eval step
            compiles once and the metrics are those of the real sequences.

    Example:
        >>> packed = pack_documents([list(range(1, 40))], seq_len=4, eos_id=0)
        >>> inputs, targets = next(iter(lm_loader(packed, batch_size=2, shuffle=False)))
        >>> inputs.tolist(), targets.tolist()
        ([[1, 2, 3, 4], [5, 6, 7, 8]], [[2, 3, 4, 5], [6, 7, 8, 9]])
    """
    if isinstance(packed, PackedSequences):
        if segment_ids is not None:
            raise ValueError("lm_loader(segment_ids=...): `packed` is a PackedSequences already; give the segment ids "
                             "to PackedSequences(packed, segment_ids=...) or pass the packed array")
        source = packed
    else:
        source = PackedSequences(packed, segment_ids)
    if not isinstance(pad_remainder, bool):
        raise ValueError(f"lm_loader(pad_remainder={pad_remainder!r}): expected True (fill the last batch with "
                         "ignored sequences) or False")
    fill = ((0, IGNORE_INDEX) if source.segment_ids is None else (0, IGNORE_INDEX, 0)) if pad_remainder else None
    return GrainLoader(
        source,
        batch_size,
        shuffle=shuffle,
        seed=seed,
        drop_remainder=drop_remainder,
        worker_count=worker_count,
        shard_by_process=shard_by_process,
        pad_remainder=fill,
    )
