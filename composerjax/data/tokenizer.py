"""A byte-level BPE subword tokenizer (GPT-2 style), trained offline with Hugging Face ``tokenizers``.

Text is turned into its UTF-8 bytes, each byte is one of 256 base symbols, and BPE merges are
learned on top, so every string encodes without unknown tokens and ``decode(encode(text))``
gives ``text`` back exactly. The trained tokenizer is one JSON file: save it beside the run and
load it on resume so the ids never change.

Example:
    >>> tok = train_tokenizer(['def f(x):\\n    return x\\n'] * 20, vocab_size=300)
    >>> ids = tok.encode('def g(y):\\n\\treturn y  # é\\n').ids
    >>> tok.decode(ids, skip_special_tokens=False)
    'def g(y):\\n\\treturn y  # é\\n'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from composerjax.data.array_loader import _check_int

__all__ = ["EOS_TOKEN", "decode", "encode_documents", "eos_id", "load_tokenizer", "save_tokenizer",
           "train_or_load_tokenizer", "train_tokenizer"]

EOS_TOKEN = "<|endoftext|>"
_BYTE_ALPHABET_SIZE = 256


def _import_tokenizers() -> Any:
    # `tokenizers` is an optional dependency: importing composerjax must not need it.
    try:
        import tokenizers
    except ImportError as error:
        raise ImportError("the subword tokenizer needs Hugging Face tokenizers; install it with "
                          "`pip install tokenizers`") from error
    return tokenizers


def _check_special_tokens(special_tokens: Any) -> tuple[str, ...]:
    if isinstance(special_tokens, str) or not isinstance(special_tokens, Sequence):
        raise ValueError(f"`special_tokens` must be a list or tuple of strings, got {special_tokens!r}")
    if not all(isinstance(token, str) and token for token in special_tokens):
        raise ValueError(f"`special_tokens` must hold non-empty strings, got {special_tokens!r}")
    if len(set(special_tokens)) != len(special_tokens):
        raise ValueError(f"`special_tokens` holds duplicates: {special_tokens!r}")
    return tuple(special_tokens)


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 8192,
    special_tokens: Sequence[str] = (EOS_TOKEN,),
    min_frequency: int = 2,
) -> Any:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on ``texts`` (offline, in Rust).

    The pipeline is GPT-2's: no normalizer; a ``ByteLevel`` pre-tokenizer with
    ``add_prefix_space=False`` (a prefix space would be decoded back as an extra leading space)
    and GPT-2's split regex; a BPE model whose initial alphabet is all 256 byte symbols; a
    ``ByteLevel`` decoder. No post-processor is set (``trim_offsets`` only changes character
    offsets, never ids or decoded text). Hence ``tok.decode(tok.encode(text).ids,
    skip_special_tokens=False) == text`` for every ``str`` (see :func:`decode`). The special tokens
    take ids ``0, 1, ...`` in the given order; a special token's literal text inside a document is
    encoded as that special token.

    Args:
        texts: The training documents (say the train split's files, :func:`read_documents`).
        vocab_size: The vocabulary size, special tokens included; must exceed
            ``256 + len(special_tokens)`` so at least one merge is learned. The trainer may stop
            below it when no pair occurs ``min_frequency`` times.
        special_tokens: Tokens never split or merged; the first is the end-of-text separator by default.
        min_frequency: A pair must occur this often to be merged.

    Raises:
        ValueError: ``vocab_size`` too small or not an integer, bad ``special_tokens`` or ``min_frequency``.

    Example:
        >>> tok = train_tokenizer(['hello world'] * 10, vocab_size=270)
        >>> tok.get_vocab_size() <= 270, eos_id(tok)
        (True, 0)
    """
    tokenizers = _import_tokenizers()
    special_tokens = _check_special_tokens(special_tokens)
    smallest = _BYTE_ALPHABET_SIZE + len(special_tokens) + 1
    vocab_size = _check_int("vocab_size", vocab_size, 1)
    if vocab_size < smallest:
        raise ValueError(f"`vocab_size` must be at least {smallest} (256 byte symbols + {len(special_tokens)} "
                         f"special tokens + at least one merge), got {vocab_size}")
    min_frequency = _check_int("min_frequency", min_frequency, 1)
    byte_level = tokenizers.pre_tokenizers.ByteLevel
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = byte_level(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=byte_level.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Any, path: str | Path) -> Path:
    """Write ``tokenizer`` to ``path`` as one JSON file (parent folders are created); return the path.

    Example: ``save_tokenizer(tok, run_dir / 'tokenizer.json')``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def load_tokenizer(path: str | Path) -> Any:
    """Load a tokenizer saved by :func:`save_tokenizer`; it encodes to the very same ids.

    Raises:
        ValueError: ``path`` is not a file.

    Example: ``tok = load_tokenizer(run_dir / 'tokenizer.json')``.
    """
    tokenizers = _import_tokenizers()
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"`path` must be a tokenizer JSON file written by save_tokenizer, got {str(path)!r}")
    return tokenizers.Tokenizer.from_file(str(path))


def train_or_load_tokenizer(path: str | Path, texts: Iterable[str], **train_kwargs: Any) -> Any:
    """Load the tokenizer at ``path`` if it exists (a resumed run), else train it on ``texts`` and save it there.

    ``texts`` is only read when training. ``train_kwargs`` go to :func:`train_tokenizer`.

    Example: ``tok = train_or_load_tokenizer(run_dir / 'tokenizer.json', read_documents(train), vocab_size=8192)``.
    """
    if Path(path).is_file():
        return load_tokenizer(path)
    tokenizer = train_tokenizer(texts, **train_kwargs)
    save_tokenizer(tokenizer, path)
    return tokenizer


def eos_id(tokenizer: Any, token: str = EOS_TOKEN) -> int:
    """Return the id of the end-of-text separator ``token``.

    Raises:
        ValueError: the tokenizer has no such token.

    Example: ``eos_id(train_tokenizer(texts))`` is ``0``: the first special token gets the first id.
    """
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"`token`={token!r} is not in the tokenizer's vocabulary; train it with "
                         f"special_tokens=({token!r}, ...)")
    return int(token_id)


def encode_documents(tokenizer: Any, texts: Iterable[str]) -> list[list[int]]:
    """Encode each document to its token ids (in parallel, in Rust); no separator is added.

    Example: ``encode_documents(tok, ['a = 1\\n', 'b = 2\\n'])`` -> two lists of ids.
    """
    return [encoding.ids for encoding in tokenizer.encode_batch(list(texts))]


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Decode ``ids`` to text, keeping special tokens, so that ``decode(tok, tok.encode(t).ids) == t``.

    ``Tokenizer.decode`` drops special tokens by default (``skip_special_tokens=True``), which
    would lose a literal ``<|endoftext|>`` inside a document; this keeps them.

    Example: ``decode(tok, tok.encode('x = 1\\n').ids)`` -> ``'x = 1\\n'``.
    """
    return tokenizer.decode(list(ids), skip_special_tokens=False)
