"""Language-model data factories: documents -> byte-level BPE -> EOS-packed sequences -> grain batches.

One pipeline, three sources: the Python standard library's own source (:func:`stdlib_lm`, offline
on every machine), the user's text files (:func:`text_files_lm`) and a Hugging Face ``datasets``
dataset read from local files (:func:`hf_dataset_lm`). Each returns :class:`DataSplits` whose
loaders yield ``(inputs, targets)`` int32 batches of shape ``(batch_size, seq_len)``.

The tokenizer is trained on the train split only and saved as ``tokenizer.json`` beside the run
(``run_dir``, which a recipe passes automatically); a resumed run finds that file and loads it,
so it encodes to the very same ids. With several processes, process 0 trains it and every other
process receives the same JSON. Fine-tuning passes ``tokenizer=DIR`` instead: the pretrained
folder's ``tokenizer.json`` as it is (no training), its vocabulary and its config's EOS token.
``segment_ids=True`` keeps packed documents apart (batches ``(inputs, targets, segment_ids)``).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from composerjax.data.array_loader import _check_int
from composerjax.data.factories import DataSplits

__all__ = ["TOKENIZER_FILE", "hf_dataset_lm", "stdlib_lm", "text_files_lm"]

#: The tokenizer's file name inside the run folder (``composerjax generate`` reads it there).
TOKENIZER_FILE = "tokenizer.json"


def stdlib_lm(
    seq_len: int = 128,
    batch_size: int = 16,
    vocab_size: int = 4096,
    validation_fraction: float = 0.05,
    seed: int = 0,
    eval_batch_size: int | None = None,
    worker_count: int = 0,
    max_files: int | None = None,
    tokenizer_path: str | None = None,
    run_dir: str | None = None,
    tokenizer: str | None = None,
    segment_ids: bool = False,
) -> DataSplits:
    """Next-token batches from the standard library's ``.py`` files (found with ``sysconfig``, tests left out).

    The files are split into train and validation by file (:func:`~composerjax.data.split_files`,
    ``validation_fraction`` and ``seed``), a byte-level BPE tokenizer of ``vocab_size`` is trained
    on the train files, each split's documents are joined with EOS separators and cut into
    ``seq_len + 1``-token windows (:func:`~composerjax.data.pack_documents`), and grain serves
    them (:func:`~composerjax.data.lm_loader`: ``worker_count`` worker processes, split across JAX
    processes, checkpointable for exact resume).

    Args:
        seq_len: Tokens per example (the model's context must be at least this).
        batch_size: Training sequences per batch on each process.
        vocab_size: The tokenizer's vocabulary size (the model's ``vocab_size`` must be at least this).
        validation_fraction: The share of files held out for evaluation, in ``[0, 1)``.
        seed: Seeds the file split and the shuffles.
        eval_batch_size: Sequences per eval batch (defaults to ``batch_size``).
        worker_count: grain worker processes for the train loader (0 reads in this process).
        max_files: Use only the first ``max_files`` files of the (sorted) list: a smaller corpus for tests.
        tokenizer_path: Where the tokenizer is saved and reloaded; defaults to ``run_dir/tokenizer.json``.
        run_dir: The run folder (a recipe passes it); with neither path the tokenizer is not saved.
        tokenizer: A pretrained tokenizer folder (a Hugging Face model folder with ``tokenizer.json``)
            used as it is, with no training: its vocabulary (``vocab_size`` is then not used) and its
            config's EOS token (:func:`~composerjax.data.load_pretrained_tokenizer`); a copy of its
            ``tokenizer.json`` goes where a trained one would be saved.
        segment_ids: Keep packed documents apart: batches are ``(inputs, targets, segment_ids)``, no
            target crosses a document boundary and the model attends within a document only, with
            positions restarting per document (:func:`~composerjax.data.pack_documents`).

    Example:
        >>> splits = stdlib_lm(seq_len=16, batch_size=2, vocab_size=300, max_files=3)
        >>> inputs, targets = next(iter(splits.train))
        >>> inputs.shape, inputs.dtype.name, bool((inputs[:, 1:] == targets[:, :-1]).all())
        ((2, 16), 'int32', True)
    """
    from composerjax.data.stdlib_corpus import split_files, stdlib_files

    files = stdlib_files()
    if max_files is not None:
        files = files[: _check_int("max_files", max_files, 2)]
    train_files, eval_files = split_files(files, validation_fraction, seed)
    return _lm_splits(_read(train_files), _read(eval_files), seq_len=seq_len, batch_size=batch_size,
                      vocab_size=vocab_size, seed=seed, eval_batch_size=eval_batch_size, worker_count=worker_count,
                      tokenizer_path=_tokenizer_path(tokenizer_path, run_dir), pretrained=tokenizer,
                      segment_ids=segment_ids)


def text_files_lm(
    train: str | Sequence[str],
    eval: str | Sequence[str] | None = None,
    seq_len: int = 128,
    batch_size: int = 16,
    vocab_size: int = 4096,
    seed: int = 0,
    eval_batch_size: int | None = None,
    worker_count: int = 0,
    tokenizer_path: str | None = None,
    run_dir: str | None = None,
    tokenizer: str | None = None,
    segment_ids: bool = False,
) -> DataSplits:
    """The same pipeline as :func:`stdlib_lm` over your own UTF-8 text files (one document per file).

    Args:
        train: Files or glob patterns (``'corpus/**/*.txt'``) of the training documents.
        eval: Files or glob patterns of the evaluation documents, or None for no eval split.
        seq_len: Tokens per example.
        batch_size: Training sequences per batch on each process.
        vocab_size: The tokenizer's vocabulary size.
        seed: Seeds the shuffles.
        eval_batch_size: Sequences per eval batch (defaults to ``batch_size``).
        worker_count: grain worker processes for the train loader (0 reads in this process).
        tokenizer_path: Where the tokenizer is saved and reloaded; defaults to ``run_dir/tokenizer.json``.
        run_dir: The run folder (a recipe passes it); with neither path the tokenizer is not saved.
        tokenizer: A pretrained tokenizer folder (a Hugging Face model folder with ``tokenizer.json``)
            used as it is, with no training: its vocabulary (``vocab_size`` is then not used) and its
            config's EOS token (:func:`~composerjax.data.load_pretrained_tokenizer`); a copy of its
            ``tokenizer.json`` goes where a trained one would be saved.
        segment_ids: Keep packed documents apart: batches are ``(inputs, targets, segment_ids)``, no
            target crosses a document boundary and the model attends within a document only, with
            positions restarting per document (:func:`~composerjax.data.pack_documents`).

    Example:
        >>> import os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> for name in ("a.txt", "b.txt"):
        ...     with open(os.path.join(folder, name), "w") as f:
        ...         _ = f.write("the quick brown fox jumps over the lazy dog " * 20)
        >>> splits = text_files_lm(os.path.join(folder, "*.txt"), seq_len=8, batch_size=2, vocab_size=300)
        >>> next(iter(splits.train))[0].shape, splits.eval is None
        ((2, 8), True)
    """
    train_files = _expand("train", train)
    eval_files = _expand("eval", eval) if eval is not None else []
    return _lm_splits(_read(train_files), _read(eval_files), seq_len=seq_len, batch_size=batch_size,
                      vocab_size=vocab_size, seed=seed, eval_batch_size=eval_batch_size, worker_count=worker_count,
                      tokenizer_path=_tokenizer_path(tokenizer_path, run_dir), pretrained=tokenizer,
                      segment_ids=segment_ids)


def hf_dataset_lm(
    path: str,
    text_column: str = "text",
    train_split: str = "train",
    eval_split: str | None = "validation",
    seq_len: int = 128,
    batch_size: int = 16,
    vocab_size: int = 4096,
    seed: int = 0,
    eval_batch_size: int | None = None,
    worker_count: int = 0,
    tokenizer_path: str | None = None,
    run_dir: str | None = None,
    tokenizer: str | None = None,
    segment_ids: bool = False,
) -> DataSplits:
    """The same pipeline over a Hugging Face ``datasets`` dataset read from LOCAL files (never the Hub).

    ``path`` is a folder written by ``Dataset.save_to_disk``/``DatasetDict.save_to_disk``, or a
    local data file (``.json``/``.jsonl``, ``.csv``, ``.parquet``, ``.txt``) loaded with the
    matching ``datasets`` builder. Each row's ``text_column`` is one document.

    Args:
        path: A local dataset folder or data file.
        text_column: The column holding each document's text.
        train_split: The split to train on.
        eval_split: The split to evaluate on; None (or a split the dataset lacks) for no eval split.
        seq_len: Tokens per example.
        batch_size: Training sequences per batch on each process.
        vocab_size: The tokenizer's vocabulary size.
        seed: Seeds the shuffles.
        eval_batch_size: Sequences per eval batch (defaults to ``batch_size``).
        worker_count: grain worker processes for the train loader (0 reads in this process).
        tokenizer_path: Where the tokenizer is saved and reloaded; defaults to ``run_dir/tokenizer.json``.
        run_dir: The run folder (a recipe passes it); with neither path the tokenizer is not saved.
        tokenizer: A pretrained tokenizer folder (a Hugging Face model folder with ``tokenizer.json``)
            used as it is, with no training: its vocabulary (``vocab_size`` is then not used) and its
            config's EOS token (:func:`~composerjax.data.load_pretrained_tokenizer`); a copy of its
            ``tokenizer.json`` goes where a trained one would be saved.
        segment_ids: Keep packed documents apart: batches are ``(inputs, targets, segment_ids)``, no
            target crosses a document boundary and the model attends within a document only, with
            positions restarting per document (:func:`~composerjax.data.pack_documents`).

    Raises:
        ImportError: ``datasets`` is not installed.
        ValueError: ``path`` does not exist, or the split or column is missing (naming what there is).

    Example: ``hf_dataset_lm("corpus.jsonl", text_column="text")``.
    """
    columns = _hf_splits(path, text_column, train_split, eval_split)
    return _lm_splits(columns[0], columns[1], seq_len=seq_len, batch_size=batch_size, vocab_size=vocab_size,
                      seed=seed, eval_batch_size=eval_batch_size, worker_count=worker_count,
                      tokenizer_path=_tokenizer_path(tokenizer_path, run_dir), pretrained=tokenizer,
                      segment_ids=segment_ids)


# -- the shared pipeline ---------------------------------------------------------------------------
def _lm_splits(train_texts: list[str], eval_texts: list[str], *, seq_len: int, batch_size: int, vocab_size: int,
               seed: int, eval_batch_size: int | None, worker_count: int, tokenizer_path: Path | None,
               pretrained: str | None = None, segment_ids: bool = False) -> DataSplits:
    from composerjax.data.packing import PackedSequences, lm_loader, pack_documents
    from composerjax.data.tokenizer import encode_documents

    seq_len = _check_int("seq_len", seq_len, 1)
    batch_size = _check_int("batch_size", batch_size, 1)
    eval_batch_size = batch_size if eval_batch_size is None else _check_int("eval_batch_size", eval_batch_size, 1)
    worker_count = _check_int("worker_count", worker_count, 0)
    if not isinstance(segment_ids, bool):
        raise ValueError(f"segment_ids={segment_ids!r}: expected True (keep packed documents apart) or False")
    if not train_texts:
        raise ValueError("train: no training document; expected at least one non-empty text")
    tokenizer, eos = _tokenizer_and_eos(pretrained, tokenizer_path, train_texts, vocab_size)

    def packed(texts: list[str]) -> PackedSequences:
        windows = pack_documents(encode_documents(tokenizer, texts), seq_len, eos, segment_ids=segment_ids)
        return PackedSequences(*windows) if segment_ids else PackedSequences(windows)

    train_packed = packed(train_texts)
    if len(train_packed) < batch_size:
        raise ValueError(f"batch_size={batch_size}: the train split packs into only {len(train_packed)} sequences "
                         f"of seq_len={seq_len}; expected at most that many per batch")
    train = lm_loader(train_packed, batch_size, seed=seed, worker_count=worker_count)
    _describe(train, tokenizer, eos, seq_len)
    evaluation = None
    if eval_texts:
        eval_packed = packed(eval_texts)
        if len(eval_packed):
            # The last batch is filled with ignored sequences: one shape, one compiled eval step.
            evaluation = lm_loader(eval_packed, min(eval_batch_size, len(eval_packed)), shuffle=False, seed=seed,
                                   drop_remainder=False, pad_remainder=True)
    return DataSplits(train=train, eval=evaluation)


def _describe(loader: Any, tokenizer: Any, eos: int, seq_len: int) -> None:
    """What recipes check against the model (``vocab_size``, ``seq_len``) and what a user may want, on the loader."""
    loader.tokenizer, loader.seq_len = tokenizer, seq_len
    loader.vocab_size, loader.eos_id = int(tokenizer.get_vocab_size()), eos


def _tokenizer_and_eos(pretrained: str | None, path: Path | None, texts: list[str], vocab_size: int
                       ) -> tuple[Any, int]:
    """A pretrained folder's tokenizer as it is (its copy saved at ``path``), else the run's trained one."""
    from composerjax.data.tokenizer import eos_id

    if pretrained is None:
        tokenizer = _tokenizer(path, texts, vocab_size)
        return tokenizer, eos_id(tokenizer)
    from composerjax.data.pretrained_tokenizer import load_pretrained_tokenizer
    from composerjax.parallel import dist

    loaded = load_pretrained_tokenizer(pretrained)
    if path is not None and dist.process_index() == 0 and path.resolve() != loaded.path.resolve():
        import shutil

        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(loaded.path, path)  # byte for byte: `composerjax generate` reads the run's copy
    return loaded.tokenizer, loaded.eos_id


def _tokenizer(path: Path | None, texts: list[str], vocab_size: int) -> Any:
    """Load the run's tokenizer (resume) or train it; process 0 decides and every process gets its JSON."""
    from composerjax.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
    from composerjax.parallel import dist

    vocab_size = _check_int("vocab_size", vocab_size, 1)
    text = None
    if dist.process_index() == 0:
        if path is not None and path.is_file():
            tokenizer = load_tokenizer(path)
            if tokenizer.get_vocab_size() > vocab_size:
                raise ValueError(f"vocab_size={vocab_size}: the run's saved tokenizer {str(path)!r} has "
                                 f"{tokenizer.get_vocab_size()} tokens; expected at most vocab_size (delete the file "
                                 "to train a new one, or raise vocab_size)")
        else:
            tokenizer = train_tokenizer(texts, vocab_size=vocab_size)
            if path is not None:
                save_tokenizer(tokenizer, path)
        text = tokenizer.to_str()
    if dist.process_count() == 1:
        return tokenizer
    return _from_json(_broadcast_text(text))


def _broadcast_text(text: str | None) -> str:
    from composerjax.parallel import dist

    data = np.frombuffer((text or "").encode("utf-8"), np.uint8)
    length = int(dist.broadcast(np.int64(len(data))))
    buffer = data if dist.process_index() == 0 else np.zeros(length, np.uint8)
    return bytes(dist.broadcast(buffer)).decode("utf-8")


def _from_json(text: str) -> Any:
    from composerjax.data.tokenizer import _import_tokenizers

    return _import_tokenizers().Tokenizer.from_str(text)


def _tokenizer_path(tokenizer_path: str | None, run_dir: str | None) -> Path | None:
    if tokenizer_path is not None:
        return Path(tokenizer_path)
    return Path(run_dir) / TOKENIZER_FILE if run_dir is not None else None


def _read(files: Sequence[str | Path]) -> list[str]:
    from composerjax.data.stdlib_corpus import read_documents

    return [text for text in read_documents(files) if text]


def _expand(field: str, patterns: str | Sequence[str]) -> list[str]:
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(path for path in glob.glob(os.fspath(pattern), recursive=True) if os.path.isfile(path))
        if not matched:
            raise ValueError(f"{field}: {os.fspath(pattern)!r} matches no file; expected paths or glob patterns of "
                             "UTF-8 text files")
        files += [path for path in matched if path not in files]
    return files


def _hf_splits(path: str, column: str, train_split: str, eval_split: str | None) -> tuple[list[str], list[str]]:
    try:
        import datasets
    except ImportError as error:
        raise ImportError("hf_dataset_lm needs Hugging Face datasets: `pip install datasets`") from error
    if not os.path.exists(path):
        raise ValueError(f"path={path!r}: no such local file or folder; expected a dataset folder written by "
                         "save_to_disk or a .json/.jsonl/.csv/.parquet/.txt file (the Hub is never contacted)")
    if os.path.isdir(path):
        loaded = datasets.load_from_disk(path)
    else:
        suffix = Path(path).suffix.lstrip(".")
        builder = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet", "txt": "text"}.get(suffix)
        if builder is None:
            raise ValueError(f"path={path!r}: expected a .json, .jsonl, .csv, .parquet or .txt file, or a dataset "
                             "folder")
        loaded = datasets.load_dataset(builder, data_files={train_split: path})
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({train_split: loaded})
    if train_split not in loaded:
        raise ValueError(f"train_split={train_split!r}: the dataset has splits {sorted(loaded)}")
    if column not in loaded[train_split].column_names:
        raise ValueError(f"text_column={column!r}: the dataset has columns {loaded[train_split].column_names}")
    texts = [text for text in loaded[train_split][column] if text]
    held_out = [text for text in loaded[eval_split][column] if text] if eval_split in loaded else []
    return texts, held_out
