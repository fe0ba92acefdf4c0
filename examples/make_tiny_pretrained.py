"""Make a small Hugging Face model folder to fine-tune, and instruction data to fine-tune it on, offline.

``examples/finetune_llama.yaml`` fine-tunes a pretrained folder. A real one (SmolLM-135M, TinyLlama)
is a download; this script makes a stand-in locally, with no network, in the same layout:

- ``OUT/model``: a ``LlamaForCausalLM`` with random weights saved by ``transformers``
  (``config.json`` + ``model.safetensors``), and its tokenizer (``tokenizer.json``,
  ``tokenizer_config.json`` with an EOS token and a ChatML chat template), a byte-level BPE
  trained on a few standard-library files;
- ``OUT/train.jsonl`` and ``OUT/eval.jsonl``: arithmetic questions and answers, one JSON object a
  line with ``prompt`` and ``response`` fields.

``transformers`` and ``torch`` are needed here only (the test dependencies); ``composerjax``
itself reads the folder with ``safetensors``.

Run: ``.venv/bin/python examples/make_tiny_pretrained.py runs/tiny-llama``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sysconfig

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(vocab_size: int) -> object:
    """A byte-level BPE trained on a few standard-library modules, saved the way transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    library = sysconfig.get_paths()["stdlib"]
    texts = []
    for name in ("json/__init__.py", "textwrap.py", "string.py", "random.py", "fractions.py"):
        with open(os.path.join(library, name), encoding="utf-8") as handle:
            texts.append(handle.read())
    texts += [f"What is {a} plus {b}? {a + b}" for a in range(20) for b in range(20)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(vocab_size: int, eos_id: int, seed: int) -> object:
    """A small random ``LlamaForCausalLM``: 4 layers, 128 wide, grouped-query attention 4/2, SwiGLU 256."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    return LlamaForCausalLM(config)


def write_examples(path: str, count: int, seed: int) -> None:
    """``count`` lines of ``{"prompt": "What is a plus b?", "response": " c"}``."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(count):
            a, b = rng.randrange(50), rng.randrange(50)
            handle.write(json.dumps({"prompt": f"What is {a} plus {b}?", "response": f" {a + b}"}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the folder to write (model/, train.jsonl, eval.jsonl)")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--train-examples", type=int, default=2000)
    parser.add_argument("--eval-examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model_dir = os.path.join(args.out, "model")
    os.makedirs(model_dir, exist_ok=True)
    tokenizer = make_tokenizer(args.vocab_size)
    tokenizer.save_pretrained(model_dir)
    make_model(len(tokenizer), tokenizer.eos_token_id, args.seed).save_pretrained(model_dir)
    write_examples(os.path.join(args.out, "train.jsonl"), args.train_examples, args.seed)
    write_examples(os.path.join(args.out, "eval.jsonl"), args.eval_examples, args.seed + 1)
    print(f"wrote {model_dir} (LlamaForCausalLM, vocabulary {len(tokenizer)}) and {args.out}/train.jsonl, "
          f"{args.out}/eval.jsonl")


if __name__ == "__main__":
    main()
