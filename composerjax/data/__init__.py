"""Data loading: checkpointable, per-process sharded batch iterables, and the language-model pipeline."""

from composerjax.data.array_loader import ArrayLoader, as_batch_iterable

# GrainLoader imports grain only when one is built, so grain stays an optional extra.
from composerjax.data.grain_loader import GrainLoader
from composerjax.data.instruction import instruction_lm
from composerjax.data.lm import TOKENIZER_FILE, hf_dataset_lm, stdlib_lm, text_files_lm
from composerjax.data.packing import (
    IGNORE_INDEX,
    PackedSequences,
    dropped_tokens,
    lm_loader,
    pack_documents,
    token_stream,
)
from composerjax.data.prefetch import DevicePrefetcher, Prefetched
from composerjax.data.pretrained_tokenizer import PretrainedTokenizer, load_pretrained_tokenizer
from composerjax.data.process_sharding import ProcessShardedLoader, shard_by_process, slice_for_process
from composerjax.data.stdlib_corpus import read_documents, split_files, stdlib_files
from composerjax.data.tokenizer import (
    EOS_TOKEN,
    decode,
    encode_documents,
    eos_id,
    load_tokenizer,
    save_tokenizer,
    train_or_load_tokenizer,
    train_tokenizer,
)

__all__ = ["ArrayLoader", "DevicePrefetcher", "EOS_TOKEN", "GrainLoader", "IGNORE_INDEX", "PackedSequences",
           "Prefetched", "PretrainedTokenizer", "ProcessShardedLoader", "TOKENIZER_FILE",
           "as_batch_iterable", "decode", "dropped_tokens", "encode_documents", "eos_id", "hf_dataset_lm",
           "instruction_lm", "lm_loader", "load_pretrained_tokenizer", "load_tokenizer", "pack_documents",
           "read_documents", "save_tokenizer", "shard_by_process",
           "slice_for_process", "split_files", "stdlib_files", "stdlib_lm", "text_files_lm", "token_stream",
           "train_or_load_tokenizer", "train_tokenizer"]
