"""The records of an offline W&B run's ``.wandb`` file, for tests: wandb 0.31 has no Python reader.

A ``.wandb`` file is a 7-byte header (``:W&B``, magic 0xBEE1, version 0) followed by LevelDB-log
blocks of 32 KiB: each chunk has a 7-byte header (CRC, length, kind: 1 full, 2 first, 3 middle,
4 last) and a record may span chunks.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def records_in(path: str | Path) -> Iterator[Any]:
    """Each ``wandb_internal_pb2.Record`` of the ``.wandb`` file at ``path``, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    block, position, pending = 32768, 7, b""
    while position < len(data):
        left = block - position % block
        if left < 7:
            position += left  # a block's tail too short for a chunk header is padding
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            position += left
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or a record's last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""
