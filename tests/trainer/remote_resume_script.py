"""A training run saving to a bucket, for the remote checkpoint tests: SIGKILLed mid-upload, resumed, compared.

    python remote_resume_script.py OUT_DIR [--save-folder s3://bucket/run] [--autoresume]
        [--kill-uploading N]

The bucket's endpoint and credentials come from the ``AWS_*`` environment variables. With
``--kill-uploading N`` the process SIGKILLs itself while uploading checkpoint ``N``: after its
files, before its marker. Writes ``OUT_DIR/final.npz`` (every leaf of the final train state) and
``OUT_DIR/result.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import jax
import numpy as np
import optax
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.checkpoint.storage import MARKER, RemoteFolder


def kill_before_marker(batch: int) -> None:
    """SIGKILL this process when the marker of checkpoint ``*-ba{batch}`` is about to be uploaded."""
    upload = RemoteFolder.upload

    def upload_then_die(self, local, name, record):
        if name.endswith(f"-ba{batch}"):
            pipe_file = self.fs.pipe_file

            def die_at_marker(path, *args, **kwargs):
                if path.endswith(MARKER):
                    os.kill(os.getpid(), signal.SIGKILL)
                return pipe_file(path, *args, **kwargs)

            self.fs.pipe_file = die_at_marker
        return upload(self, local, name, record)

    RemoteFolder.upload = upload_then_die


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--save-folder")
    parser.add_argument("--autoresume", action="store_true")
    parser.add_argument("--kill-uploading", type=int)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=48).astype(np.int32)
    rngs = nnx.Rngs(0)
    model = ComposerClassifier(nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), nnx.relu,
                                              nnx.Linear(16, 3, rngs=rngs)), 3)
    if args.kill_uploading is not None:
        kill_before_marker(args.kill_uploading)
    trainer = Trainer(model, ArrayLoader((x, y), batch_size=8, shuffle=True, seed=5), "12ba", optax.adam(1e-2),
                      progress_bar=False, run_summary=False, save_folder=args.save_folder, save_interval="2ba",
                      autoresume=args.autoresume)
    resumed_from = trainer.resumed_from
    trainer.fit()
    trainer.close()
    os.makedirs(args.out, exist_ok=True)
    leaves = jax.tree.leaves(jax.device_get(trainer.state.train_state))
    np.savez(os.path.join(args.out, "final.npz"), *[np.asarray(leaf) for leaf in leaves])
    with open(os.path.join(args.out, "result.json"), "w") as handle:
        json.dump({"resumed_from": resumed_from, "batch": int(trainer.state.timestamp.batch)}, handle)


if __name__ == "__main__":
    sys.exit(main())
