"""Tiny pretrained-style tokenizer folders, made locally with tokenizers + transformers (no network)."""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = ["def add(a, b):\n    return a + b\n", "What is two plus two? It is four.", "hello world, how are you today?",
          "The quick brown fox jumps over the lazy dog.", "Translate 'chat' to English: cat"] * 8
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
#: ChatML with transformers' {% generation %} markers around what the assistant says (and the newline after).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer_object(bos=True):
    """A byte-level BPE with Llama's habit of putting BOS first (a post-processor) when ``bos``."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                                 special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    return tokenizer


def save_folder(folder, chat_template=CHAT_TEMPLATE, bos=True):
    """``save_pretrained`` of a fast tokenizer (eos ``</s>``, bos ``<s>``) into ``folder``; returns the folder."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer_object(bos), bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>")
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(str(folder))
    return folder
