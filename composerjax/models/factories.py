"""Model factories: build a reference model from plain hyperparameters, for recipes and the CLI.

Each is registered by name in ``composerjax.registry.models`` (entry-point group ``composerjax.models``),
so a YAML recipe says ``model: {name: digits_cnn, num_classes: 10}``.
"""

from __future__ import annotations

from flax import nnx

from composerjax.models.causal_lm import ComposerCausalLM
from composerjax.models.composer_model import ComposerClassifier
from composerjax.models.gpt import TinyGPT, language_metrics
from composerjax.models.mlp import MLP
from composerjax.models.resnet import SmallResNet
from composerjax.models.small_cnn import SmallCNN

__all__ = ["digits_cnn", "gpt2", "llama", "mlp", "pretrained", "small_resnet", "tiny_gpt"]


def digits_cnn(num_classes: int = 10, seed: int = 0) -> ComposerClassifier:
    """Return a :class:`SmallCNN` classifier for 8x8 single-channel images (the ``digits`` data).

    Args:
        num_classes: the number of classes.
        seed: seeds the parameter initialisation.

    Example:
        >>> import jax.numpy as jnp
        >>> digits_cnn(num_classes=10).forward((jnp.zeros((2, 8, 8)), None)).shape
        (2, 10)
    """
    return ComposerClassifier(SmallCNN(num_classes=num_classes, rngs=nnx.Rngs(seed)), num_classes)


def small_resnet(num_classes: int = 10, width: int = 16, in_channels: int = 1, seed: int = 0) -> ComposerClassifier:
    """Return a :class:`SmallResNet` classifier (two residual stages) for small images.

    Args:
        num_classes: the number of classes.
        width: channels of the first stage (the second has twice as many).
        in_channels: channels of the input images (1 for ``(N, H, W)`` inputs).
        seed: seeds the parameter initialisation.

    Example:
        >>> import jax.numpy as jnp
        >>> small_resnet(num_classes=3, width=4).forward((jnp.zeros((2, 8, 8)), None)).shape
        (2, 3)
    """
    module = SmallResNet(num_classes=num_classes, width=width, in_channels=in_channels, rngs=nnx.Rngs(seed))
    return ComposerClassifier(module, num_classes)


def tiny_gpt(vocab_size: int = 256, dim: int = 64, depth: int = 2, num_heads: int = 4, max_length: int = 128,
             seed: int = 0) -> ComposerClassifier:
    """Return a :class:`TinyGPT` next-token model: ``(N, T)`` int tokens to ``(N, T, vocab_size)`` logits.

    Pairs with the ``pydoc_text`` data (bytes, ``vocab_size=256``). Its eval metrics are the
    language-model ones (:func:`~composerjax.models.gpt.language_metrics`).

    Args:
        vocab_size: the number of distinct tokens.
        dim: the width of the residual stream.
        depth: the number of decoder blocks.
        num_heads: attention heads per block (must divide ``dim``).
        max_length: the longest sequence the position embedding covers.
        seed: seeds the parameter initialisation.

    Example:
        >>> import jax.numpy as jnp
        >>> model = tiny_gpt(dim=16, depth=1, num_heads=2, max_length=8)
        >>> model.forward((jnp.zeros((2, 8), jnp.int32), None)).shape
        (2, 8, 256)
    """
    module = TinyGPT(vocab_size=vocab_size, dim=dim, depth=depth, num_heads=num_heads, max_length=max_length,
                     rngs=nnx.Rngs(seed))
    return ComposerClassifier(module, vocab_size, val_metrics=language_metrics())


def gpt2(config: str = "gpt2-tiny", vocab_size: int | None = None, n_positions: int | None = None,
         n_embd: int | None = None, n_layer: int | None = None, n_head: int | None = None,
         dropout: float | None = None, attention_dropout: float | None = None, position: str | None = None,
         tie_embeddings: bool | None = None, attention: str | None = None, remat: str | None = None,
         scan_layers: bool | None = None, pad_vocab_to_multiple: int | None = None,
         seed: int = 0) -> ComposerCausalLM:
    """Return a :class:`~composerjax.models.GPT2` next-token model from a preset, with any field replaced.

    A :class:`~composerjax.models.ComposerCausalLM`: ``(N, T)`` int tokens in; the loss is the mean
    next-token cross-entropy, computed over the vocabulary in chunks (never the whole batch's
    float32 logits), and the eval metrics are the language-model ones (cross-entropy, perplexity
    and token accuracy, :func:`~composerjax.models.gpt.language_metrics`). Pairs with the
    ``stdlib_lm`` data (its ``vocab_size`` must not exceed the model's, its ``seq_len`` not
    ``n_positions``).

    Args:
        config: a preset of :data:`~composerjax.models.GPT2_CONFIGS`: ``'gpt2-tiny'``,
            ``'gpt2-small'`` (124M), ``'gpt2-medium'`` or ``'gpt2-large'``.
        vocab_size: the number of distinct tokens (at least the data's tokenizer's).
        n_positions: the longest sequence the model takes (at least the data's ``seq_len``).
        n_embd: the width of the residual stream.
        n_layer: the number of decoder blocks.
        n_head: attention heads per block (must divide ``n_embd``).
        dropout: dropout on the embeddings and each residual branch, in training.
        attention_dropout: dropout on the attention weights, in training.
        position: ``'learned'``, ``'rotary'`` or ``'alibi'``.
        tie_embeddings: use the token embedding as the LM head.
        attention: the attention kernel: ``'auto'``, ``'xla'`` or ``'cudnn'``.
        remat: what the backward pass recomputes: ``'none'``, ``'dots'`` or ``'full'``.
        scan_layers: run the blocks with ``lax.scan`` (compile time independent of depth).
        pad_vocab_to_multiple: pad the embedding's rows to this multiple (64 by default).
        (Each replaces the preset's field when given; see :class:`~composerjax.models.GPT2Config`.)
        seed: seeds the parameter initialisation and the dropout masks.

    Example:
        >>> import jax.numpy as jnp
        >>> model = gpt2("gpt2-tiny", vocab_size=300, n_positions=16)
        >>> model.module(jnp.zeros((2, 16), jnp.int32)).shape  # logits over the 300 tokens (320 rows padded)
        (2, 16, 300)
    """
    from composerjax.models.gpt2 import GPT2, GPT2Config

    fields = {"vocab_size": vocab_size, "n_positions": n_positions, "n_embd": n_embd, "n_layer": n_layer,
              "n_head": n_head, "dropout": dropout, "attention_dropout": attention_dropout, "position": position,
              "tie_embeddings": tie_embeddings, "attention": attention, "remat": remat, "scan_layers": scan_layers,
              "pad_vocab_to_multiple": pad_vocab_to_multiple}
    settings = GPT2Config.preset(config, **{key: value for key, value in fields.items() if value is not None})
    return ComposerCausalLM(GPT2(settings, rngs=nnx.Rngs(seed)))


def llama(config: str = "llama-tiny", vocab_size: int | None = None, hidden_size: int | None = None,
          intermediate_size: int | None = None, num_hidden_layers: int | None = None,
          num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
          max_position_embeddings: int | None = None, rope_theta: float | None = None,
          tie_word_embeddings: bool | None = None, sliding_window: int | None = None, attention: str | None = None,
          remat: str | None = None, scan_layers: bool | None = None, pad_vocab_to_multiple: int | None = None,
          seed: int = 0) -> ComposerCausalLM:
    """Return a :class:`~composerjax.models.Llama` next-token model from a preset, with any field replaced.

    A :class:`~composerjax.models.ComposerCausalLM`, as :func:`gpt2` returns (chunked loss,
    language metrics); ``composerjax generate`` takes it. Untrained: to start from published
    weights, use :func:`~composerjax.models.load_pretrained` on a local Hugging Face folder.

    Args:
        config: a preset of :data:`~composerjax.models.LLAMA_CONFIGS`: ``'llama-tiny'``,
            ``'smollm-135m'`` or ``'tinyllama-1.1b'``.
        vocab_size: the number of distinct tokens (at least the data's tokenizer's).
        hidden_size: the width of the residual stream.
        intermediate_size: the width of the SwiGLU MLP.
        num_hidden_layers: the number of decoder blocks.
        num_attention_heads: query heads per block.
        num_key_value_heads: key/value heads per block (must divide ``num_attention_heads``).
        max_position_embeddings: the longest sequence the model takes (at least the data's ``seq_len``).
        rope_theta: the RoPE frequency base.
        tie_word_embeddings: use the token embedding as the LM head.
        sliding_window: Mistral's attention window, or None.
        attention: the attention kernel: ``'auto'``, ``'xla'`` or ``'cudnn'``.
        remat: what the backward pass recomputes: ``'none'``, ``'dots'`` or ``'full'``.
        scan_layers: run the blocks with ``lax.scan``.
        pad_vocab_to_multiple: pad the embedding's rows to this multiple (64 by default).
        (Each replaces the preset's field when given; see :class:`~composerjax.models.LlamaConfig`.)
        seed: seeds the parameter initialisation.

    Example:
        >>> import jax.numpy as jnp
        >>> model = llama("llama-tiny", vocab_size=300, max_position_embeddings=16)
        >>> model.module(jnp.zeros((2, 16), jnp.int32)).shape
        (2, 16, 300)
    """
    from composerjax.models.llama import Llama, LlamaConfig

    fields = {"vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
              "num_hidden_layers": num_hidden_layers, "num_attention_heads": num_attention_heads,
              "num_key_value_heads": num_key_value_heads, "max_position_embeddings": max_position_embeddings,
              "rope_theta": rope_theta, "tie_word_embeddings": tie_word_embeddings, "sliding_window": sliding_window,
              "attention": attention, "remat": remat, "scan_layers": scan_layers,
              "pad_vocab_to_multiple": pad_vocab_to_multiple}
    settings = LlamaConfig.preset(config, **{key: value for key, value in fields.items() if value is not None})
    return ComposerCausalLM(Llama(settings, rngs=nnx.Rngs(seed)))


def pretrained(path: str, dtype: str | None = None, attention: str | None = None, remat: str | None = None,
               scan_layers: bool | None = None) -> ComposerCausalLM:
    """Return the model of a local Hugging Face folder (:func:`~composerjax.models.load_pretrained`) to fine-tune.

    A recipe says ``model: {name: pretrained, path: checkpoints/SmolLM-135M}``: ``GPT2LMHeadModel``,
    ``LlamaForCausalLM``, ``MistralForCausalLM`` or ``Qwen2ForCausalLM`` weights, read from
    ``config.json`` and safetensors; nothing is downloaded.

    Args:
        path: the local folder (a hub id is refused: download it first).
        dtype: the parameters' dtype (``'float32'``, the default, or ``'bfloat16'``).
        attention: the attention kernel: ``'auto'``, ``'xla'`` or ``'cudnn'``.
        remat: what the backward pass recomputes: ``'none'``, ``'dots'`` or ``'full'``.
        scan_layers: run the blocks with ``lax.scan``.

    Example::

        model = pretrained("checkpoints/SmolLM-135M", remat="dots")
    """
    from composerjax.models.hf import load_pretrained

    overrides = {key: value for key, value in (("attention", attention), ("remat", remat),
                                               ("scan_layers", scan_layers)) if value is not None}
    return ComposerCausalLM(load_pretrained(path, dtype=dtype, **overrides))


def mlp(sizes: list[int], seed: int = 0) -> ComposerClassifier:
    """Return an :class:`MLP` classifier; ``sizes`` runs from input features to classes.

    Inputs are flattened, so ``sizes=[64, 32, 10]`` fits the 8x8 ``digits`` images.

    Args:
        sizes: layer widths, input features first and the number of classes last.
        seed: seeds the parameter initialisation.

    Example:
        >>> import jax.numpy as jnp
        >>> mlp([64, 32, 10]).forward((jnp.zeros((2, 8, 8)), None)).shape
        (2, 10)
    """
    return ComposerClassifier(MLP(sizes, rngs=nnx.Rngs(seed)), list(sizes)[-1])
