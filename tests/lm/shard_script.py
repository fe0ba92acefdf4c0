"""One process of ``composerjax launch``: one epoch of the stdlib_lm train loader, written to disk.

    composerjax launch -n 2 --devices-per-process 1 shard_script.py OUT_DIR RUN_DIR

Process ``p`` writes ``OUT_DIR/batches-p.npz`` (``inputs`` and ``targets``, stacked batches),
``OUT_DIR/tokenizer-p.json`` (the tokenizer it encoded with) and ``OUT_DIR/info-p.json``
(process index and count, the source's length and the loader's length).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

from composerjax.data.lm import stdlib_lm

# Shared with the test, which rebuilds the single-process pipeline from the same settings.
SETTINGS = {"seq_len": 32, "batch_size": 8, "vocab_size": 320, "max_files": 10, "validation_fraction": 0.2,
            "seed": 5, "worker_count": 0}


def main() -> None:
    out, run_dir = Path(sys.argv[1]), sys.argv[2]
    rank = jax.process_index()
    splits = stdlib_lm(**SETTINGS, run_dir=run_dir)
    loader = splits.train
    batches = list(loader)  # one epoch
    np.savez(out / f"batches-{rank}.npz", inputs=np.stack([inputs for inputs, _ in batches]),
             targets=np.stack([targets for _, targets in batches]))
    (out / f"tokenizer-{rank}.json").write_text(loader.tokenizer.to_str())
    info = {"process_index": rank, "process_count": jax.process_count(), "records": len(loader._data_source),
            "batches": len(loader), "devices": jax.device_count()}
    (out / f"info-{rank}.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main()
