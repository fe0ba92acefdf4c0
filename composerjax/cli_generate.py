"""``composerjax generate``: text from a trained language model's run folder, and the recipe ``train`` leaves there.

``composerjax train`` writes the recipe it ran to ``RUN_DIR/recipe.yaml`` (:func:`write_run_recipe`);
``composerjax generate RUN_DIR`` rebuilds the recipe's model from it (the data is not built: no
corpus is read, no tokenizer trained), loads the weights of the run's newest checkpoint
(:func:`load_model_weights`, the Trainer's own checkpoint reader), encodes the prompt with
``RUN_DIR/tokenizer.json`` and prints the prompt and what
:func:`composerjax.models.generation.generate` adds: greedy, or temperature/top-k sampling, all new
tokens in one compiled call with a KV cache.

Example::

    composerjax train recipe.yaml                      # a gpt2 model on stdlib_lm, with a save_folder
    composerjax generate runs/my-run --prompt "def " --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from composerjax.cli_common import HelpFormatter, UsageError, add_debug
from composerjax.cli_run import RECIPE_FILE, load_model_weights, load_weights, model_after_init, run_recipe, save_folder

if TYPE_CHECKING:
    from composerjax.trainer.trainer import Trainer

__all__ = ["RECIPE_FILE", "add_generate", "generate_command", "load_model_weights", "write_run_recipe"]

_EXIT_STATUSES_GENERATE = """exit statuses:
  0    success
  1    an unexpected error (one line; --debug shows the traceback)
  2    bad input: a missing run folder, recipe.yaml, tokenizer.json or checkpoint; a recipe with problems; a
       model that is not a GPT2 or Llama; a prompt or --max-new-tokens that does not fit the model's n_positions;
       --max-new-tokens < 1, --temperature < 0, --top-k < 1"""

_RECIPE_HEADER = ("# The recipe this run ran, written by 'composerjax train' (--set overrides applied).\n"
                  "# 'composerjax generate RUN_DIR' rebuilds the model from it; 'composerjax train' runs it again.\n")


def write_run_recipe(trainer: Trainer) -> str | None:
    """Write ``trainer.config`` as YAML to ``<run_dir>/recipe.yaml`` on process 0; return its path (None elsewhere).

    ``run_name`` is written as the run has it (a recipe without one gets a timestamped name), so a
    ``save_folder`` such as ``'{run_name}/checkpoints'`` names the same folder when read back.

    Example::

        trainer = build_trainer(load_config("recipe.yaml"))
        write_run_recipe(trainer)   # 'runs/<run_name>/recipe.yaml'
    """
    import yaml

    from composerjax.parallel.dist import is_process_zero

    if not is_process_zero():
        return None
    values = trainer.config.to_dict()
    values["run_name"] = trainer.state.run_name
    run_dir = os.fspath(trainer.state.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, RECIPE_FILE)
    with open(path, "w", encoding="utf-8") as file:
        file.write(_RECIPE_HEADER + yaml.safe_dump(values, sort_keys=False))
    return path


# -- composerjax generate --------------------------------------------------------------------------
def add_generate(subparsers: Any) -> None:
    """Declare ``composerjax generate`` and its arguments."""
    parser = subparsers.add_parser(
        "generate",
        help="continue a prompt with a trained language model (greedy or sampled)",
        description=(
            "Rebuild the model of RUN_DIR/recipe.yaml (written by 'composerjax train'; the data is not built), load "
            "the weights of the run's newest checkpoint (in the recipe's save_folder, or --checkpoint), encode "
            "--prompt with RUN_DIR/tokenizer.json and print the prompt followed by --max-new-tokens generated "
            "tokens. Temperature 0 takes the most likely token each step (greedy); above 0, tokens are sampled "
            "from softmax(logits / temperature), among the --top-k most likely if given, reproducibly for a "
            "--seed. A KV cache keeps each step to one new token, and every new token is generated in one "
            "compiled call. Needs a GPT2 or Llama model (e.g. model: {name: gpt2} or {name: llama}) and a "
            "language-model data factory that saves its tokenizer in the run folder (e.g. data: {name: stdlib_lm})."
        ),
        epilog=_EXIT_STATUSES_GENERATE + "\n\nexamples:\n"
          "  composerjax generate runs/gpt2-stdlib --prompt \"def \" --max-new-tokens 64\n"
          "  composerjax generate runs/gpt2-stdlib --prompt \"import \" --temperature 0.8 --top-k 40 --seed 1",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run folder written by 'composerjax train': recipe.yaml, tokenizer.json and (by "
                             "default) the checkpoints of the recipe's save_folder")
    parser.add_argument("--prompt", default="", metavar="TEXT",
                        help="the text to continue (default: empty, i.e. the start of a new document: generation "
                             "starts after the end-of-text separator)")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="how many tokens to generate; the prompt's tokens plus N must fit the model's "
                             "n_positions (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 is greedy (the most likely token each step); above 0, sample from "
                             "softmax(logits / T) (default: 0)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K",
                        help="when sampling, draw only among the K most likely tokens (default: all)")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="seeds the sampling: the same seed gives the same text (default: 0)")
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="load these weights instead: a save folder (its newest checkpoint), one checkpoint's "
                             "folder or its latest link (default: the newest checkpoint in the recipe's save_folder)")
    add_debug(parser)
    parser.set_defaults(handler=generate_command)


def generate_command(args: argparse.Namespace) -> int:
    """``composerjax generate RUN_DIR [--prompt TEXT] [--max-new-tokens N] [--temperature T] [--top-k K] ...``."""
    import jax.numpy as jnp
    import numpy as np

    from composerjax.data.tokenizer import decode
    from composerjax.models.generation import generate

    _check_options(args)
    config = run_recipe(args.run_dir)
    tokenizer = _run_tokenizer(args.run_dir, config)
    model = _build_model(config)
    prompt, shown = _prompt_tokens(tokenizer, args.prompt, model.module.config, args.max_new_tokens,
                                   _end_of_text(config, tokenizer))
    checkpoint = args.checkpoint if args.checkpoint is not None else save_folder(config, args.run_dir)
    field = "--checkpoint" if args.checkpoint is not None else "save_folder"
    model, batch = load_weights(model, checkpoint, field)
    print(f"composerjax generate: the weights of batch {batch} from {checkpoint}", file=sys.stderr)
    try:
        tokens = generate(model.module, jnp.asarray([prompt], jnp.int32), args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, rng=args.seed)
    except ValueError as error:  # token ids outside the model's vocabulary (a tokenizer from another run)
        raise UsageError(str(error)) from None
    print(decode(tokenizer, np.asarray(tokens)[0, len(prompt) - shown:].tolist()))
    return 0


def _check_options(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens={args.max_new_tokens}: expected a positive number of tokens")
    if not args.temperature >= 0:
        raise UsageError(f"--temperature={args.temperature}: expected a number >= 0 (0 is greedy)")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k={args.top_k}: expected a positive integer (or leave it out to sample among all)")


def _run_tokenizer(run_dir: str, config: Any) -> Any:
    """The tokenizer the run trained: the recipe's ``data.tokenizer_path``, else ``RUN_DIR/tokenizer.json``."""
    from composerjax.data.lm import TOKENIZER_FILE
    from composerjax.data.tokenizer import load_tokenizer

    path = config.data.hparams.get("tokenizer_path") or os.path.join(run_dir, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise UsageError(f"{run_dir} has no {os.path.basename(path)} (looked for {path}): the language-model data "
                         "factories (stdlib_lm, text_files_lm, hf_dataset_lm) save the tokenizer they train there")
    return load_tokenizer(path)


def _build_model(config: Any) -> Any:
    """The recipe's model, untrained, after its INIT surgery (LoRA); one that is not a GPT2 or Llama -> UsageError."""
    from composerjax.models.gpt2 import GPT2
    from composerjax.models.llama import Llama

    model = model_after_init(config)  # with the recipe's surgery at INIT (LoRA): the checkpoint's arrays fit it
    module = getattr(model, "module", None)
    if not isinstance(module, (GPT2, Llama)):
        built = type(module if module is not None else model).__name__
        raise UsageError(f"model.name={config.model.name!r} builds a {built}, not a composerjax.models.GPT2 or Llama: "
                         "it has no generation support (a KV-cache decode); train a model: {name: gpt2} or "
                         "{name: llama} to generate")
    return model


def _end_of_text(config: Any, tokenizer: Any) -> int:
    """The EOS id: the pretrained folder's (``data.tokenizer``: its config names it), else the trained tokenizer's."""
    from composerjax.data.tokenizer import eos_id

    folder = config.data.hparams.get("tokenizer")
    if isinstance(folder, str) and os.path.exists(folder):
        from composerjax.data.pretrained_tokenizer import load_pretrained_tokenizer

        return load_pretrained_tokenizer(folder).eos_id
    return eos_id(tokenizer)


def _prompt_tokens(tokenizer: Any, text: str, model_config: Any, max_new_tokens: int,
                   end_of_text: int) -> tuple[list[int], int]:
    """``(prompt ids, how many of them to print)``: an empty prompt starts a new document after the separator."""
    ids = list(tokenizer.encode(text).ids)
    shown = len(ids)
    if not ids:
        ids = [end_of_text]
    limit = model_config.n_positions
    if len(ids) > limit:
        raise UsageError(f"--prompt: {len(ids)} tokens, longer than the model's n_positions={limit}; expected at most "
                         f"{limit - 1} tokens, to leave room for new ones")
    if len(ids) + max_new_tokens > limit:
        raise UsageError(f"--max-new-tokens={max_new_tokens}: the prompt ({len(ids)} tokens) plus the new tokens "
                         f"exceed the model's n_positions={limit}; expected at most {max(limit - len(ids), 0)}")
    return ids, shown
