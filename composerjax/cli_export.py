"""``composerjax export``: the newest checkpoint of a run as a Hugging Face folder.

``composerjax export RUN_DIR OUT_DIR`` rebuilds the model of ``RUN_DIR/recipe.yaml`` (written by
``composerjax train``; the data is not built), applies the recipe's surgery at ``INIT`` (``LoRA``
wraps its linears, so the checkpoint's adapters fit), loads the weights of the run's newest
checkpoint that reads back intact and writes them with
:func:`composerjax.models.save_pretrained`: ``config.json`` and safetensors that
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads, with the run's tokenizer
files beside them. LoRA adapters are merged into the weights, or written as a PEFT adapter folder
with ``--adapter``.

Example::

    composerjax train examples/finetune_llama.yaml
    composerjax export runs/finetune-llama runs/finetune-llama/hf
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

from composerjax.cli_common import HelpFormatter, UsageError, add_debug
from composerjax.cli_run import load_weights, model_after_init, run_recipe, save_folder

__all__ = ["TOKENIZER_FILES", "add_export", "export_command", "model_after_init"]

#: The tokenizer files an exported folder carries, where the run (or its pretrained folder) has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")

_EXIT_STATUSES_EXPORT = """exit statuses:
  0    success
  1    an unexpected error (one line; --debug shows the traceback)
  2    bad input: a missing run folder, recipe.yaml or checkpoint; a recipe with problems; a model whose
       structure has no Hugging Face architecture (e.g. GLU surgery or ALiBi on GPT-2); an OUT_DIR that
       is a file or a non-empty folder without --overwrite"""


def add_export(subparsers: Any) -> None:
    """Declare ``composerjax export`` and its arguments."""
    parser = subparsers.add_parser(
        "export",
        help="write a run's newest checkpoint as a Hugging Face model folder",
        description=(
            "Rebuild the model of RUN_DIR/recipe.yaml (written by 'composerjax train'; the data is not built), apply "
            "the recipe's surgery at INIT (LoRA's adapters), load the weights of the newest checkpoint that reads "
            "back intact (in the recipe's save_folder, or --checkpoint) and write OUT_DIR: config.json and "
            "safetensors that transformers' AutoModelForCausalLM.from_pretrained(OUT_DIR) loads, with the run's "
            "tokenizer files. LoRA adapters are merged into the weights unless --adapter is given."
        ),
        epilog=_EXIT_STATUSES_EXPORT + "\n\nexamples:\n"
          "  composerjax export runs/finetune-llama runs/finetune-llama/hf\n"
          "  composerjax export runs/finetune-llama runs/finetune-llama/adapter --adapter",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written by 'composerjax train'")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the Hugging Face folder to write (created if missing)")
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="export these weights instead: a save folder (its newest checkpoint), one checkpoint's "
                             "folder or its latest link (default: the newest checkpoint in the recipe's save_folder)")
    parser.add_argument("--adapter", action="store_true",
                        help="write only the LoRA adapters, as a PEFT adapter folder (adapter_config.json and "
                             "adapter_model.safetensors), instead of merging them into the weights")
    parser.add_argument("--overwrite", action="store_true", help="write into an OUT_DIR that already has files")
    add_debug(parser)
    parser.set_defaults(handler=export_command)


def export_command(args: argparse.Namespace) -> int:
    """``composerjax export RUN_DIR OUT_DIR [--checkpoint PATH] [--adapter] [--overwrite]``."""
    out_dir = os.fspath(args.out_dir)
    if os.path.isfile(out_dir):
        raise UsageError(f"OUT_DIR={out_dir!r} is a file: expected a folder to write the model into")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not args.overwrite:
        raise UsageError(f"OUT_DIR={out_dir!r} already has files: expected a new or empty folder (or --overwrite)")
    config = run_recipe(args.run_dir)
    model = model_after_init(config)
    checkpoint = args.checkpoint if args.checkpoint is not None else save_folder(config, args.run_dir)
    field = "--checkpoint" if args.checkpoint is not None else "save_folder"
    model, batch = load_weights(model, checkpoint, field)
    module = getattr(model, "module", model)
    try:
        from composerjax.models.hf import save_pretrained

        save_pretrained(module, out_dir, merge=not args.adapter)
    except ValueError as error:  # a structure with no HF architecture, or --adapter on a model without LoRA
        raise UsageError(str(error)) from None
    copied = _copy_tokenizer(config, args.run_dir, out_dir)
    what = "LoRA adapters" if args.adapter else "model"
    print(f"composerjax export: the {what} of batch {batch} from {checkpoint} written to {out_dir}"
          + (f" with {', '.join(copied)}" if copied else " (no tokenizer files found to copy)"), file=sys.stderr)
    return 0


def _copy_tokenizer(config: Any, run_dir: str, out_dir: str) -> list[str]:
    """Copy the run's tokenizer files (or its pretrained folder's) into ``out_dir``; return the names copied."""
    folders = [os.path.dirname(path) for path in (config.data.hparams.get("tokenizer_path"),) if path]
    for spec in (config.model, config.data):
        for key in ("path", "tokenizer"):
            value = spec.hparams.get(key)
            if isinstance(value, str) and os.path.isdir(value):
                folders.append(value)
    folders.append(run_dir)
    copied = []
    for name in TOKENIZER_FILES:
        for folder in folders:
            source = os.path.join(folder, name)
            if os.path.isfile(source):
                shutil.copyfile(source, os.path.join(out_dir, name))
                copied.append(name)
                break
    return copied
