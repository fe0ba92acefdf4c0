"""A pretrained model's tokenizer used as it is: its folder's ``tokenizer.json``, its EOS, its chat template.

Fine-tuning keeps the pretrained model's ids, so nothing is trained: :func:`load_pretrained_tokenizer`
reads a local Hugging Face folder (``tokenizer.json``, and ``tokenizer_config.json`` /
``special_tokens_map.json`` / ``chat_template.jinja`` where present) and never touches the network.
The end-of-text token is the folder's own ``eos_token``, not this project's ``<|endoftext|>``.
:func:`render_chat` renders chat messages through the folder's template with jinja2 the way
``transformers``' ``apply_chat_template`` does (sandboxed, ``trim_blocks`` and ``lstrip_blocks``,
the special tokens as variables).

Example:
    >>> import json, os, tempfile
    >>> from composerjax.data.tokenizer import save_tokenizer, train_tokenizer
    >>> folder = tempfile.mkdtemp()
    >>> _ = save_tokenizer(train_tokenizer(["hello world"] * 10, 270, special_tokens=("<s>", "</s>")),
    ...                    os.path.join(folder, "tokenizer.json"))
    >>> with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    ...     json.dump({"eos_token": "</s>", "bos_token": "<s>"}, f)
    >>> pretrained = load_pretrained_tokenizer(folder)
    >>> pretrained.eos_token, pretrained.eos_id, pretrained.vocab_size <= 270
    ('</s>', 1, True)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from composerjax.data.tokenizer import EOS_TOKEN, _import_tokenizers

__all__ = ["CHAT_TEMPLATE_FILE", "PretrainedTokenizer", "TOKENIZER_CONFIG_FILE", "load_pretrained_tokenizer",
           "render_chat"]

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
#: Where ``transformers`` (4.43 on) saves a chat template beside the tokenizer.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class PretrainedTokenizer:
    """A pretrained folder's tokenizer, untouched, with what the data pipeline needs from its config.

    Attributes:
        tokenizer: the ``tokenizers.Tokenizer`` read from ``tokenizer.json`` (encodes with its own
            post-processor, so a Llama tokenizer still puts its BOS first).
        path: the ``tokenizer.json`` it was read from.
        eos_token: the end-of-text token from the folder's config.
        eos_id: its id.
        special_tokens: ``{'bos_token': '<s>', 'eos_token': '</s>', ...}`` as the config names them
            (what a chat template sees).
        chat_template: the folder's chat template (jinja source), or None.
    """

    tokenizer: Any
    path: Path
    eos_token: str
    eos_id: int
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    chat_template: str | None = None

    @property
    def vocab_size(self) -> int:
        """The number of ids the tokenizer can produce, added tokens included (the model needs at least this)."""
        return int(self.tokenizer.get_vocab_size())


def load_pretrained_tokenizer(path: str | Path) -> PretrainedTokenizer:
    """Read a local Hugging Face tokenizer folder (or its ``tokenizer.json``) as it is; nothing is trained.

    The EOS token is ``eos_token`` of ``tokenizer_config.json``, else of ``special_tokens_map.json``,
    else ``<|endoftext|>`` when the vocabulary has it. The chat template is ``chat_template.jinja``,
    else ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates of
    which ``'default'`` is taken).

    Args:
        path: a folder holding ``tokenizer.json`` (say a downloaded ``SmolLM-135M``), or the file itself.

    Raises:
        ValueError: the path does not exist (a hub id is refused: pass a local folder), the folder
            has no ``tokenizer.json``, or no EOS token can be found (naming the files read).

    Example: ``load_pretrained_tokenizer("checkpoints/SmolLM-135M").eos_token`` -> ``'<|endoftext|>'``.
    """
    tokenizers = _import_tokenizers()
    path = Path(path)
    if not path.exists():
        raise ValueError(f"tokenizer={str(path)!r}: no such local folder or file; expected a folder holding "
                         "tokenizer.json (a Hugging Face model folder on this machine: hub ids are never "
                         "downloaded)")
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"tokenizer={str(path)!r}: the folder has no tokenizer.json; expected a Hugging Face "
                         "tokenizer folder (tokenizer.json from a fast tokenizer's save_pretrained)")
    folder = file.parent
    tokenizer = tokenizers.Tokenizer.from_file(str(file))
    config = _read_json(folder / TOKENIZER_CONFIG_FILE)
    special = {**_special_tokens(_read_json(folder / _SPECIAL_TOKENS_MAP_FILE)), **_special_tokens(config)}
    eos_token = special.get("eos_token")
    if eos_token is None and tokenizer.token_to_id(EOS_TOKEN) is not None:
        eos_token = special["eos_token"] = EOS_TOKEN
    if eos_token is None:
        raise ValueError(f"tokenizer={str(path)!r}: no eos_token in {TOKENIZER_CONFIG_FILE} or "
                         f"{_SPECIAL_TOKENS_MAP_FILE}, and the vocabulary has no {EOS_TOKEN!r}; expected the "
                         "folder's config to name its end-of-text token")
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
        raise ValueError(f"tokenizer={str(path)!r}: eos_token={eos_token!r} from the folder's config is not in "
                         "tokenizer.json's vocabulary")
    return PretrainedTokenizer(tokenizer, file, eos_token, int(eos_id), special, _chat_template(folder, config))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    return data if isinstance(data, dict) else {}


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """``{name: text}`` of the special tokens a config names (older configs write ``{"content": text, ...}``)."""
    tokens = {}
    for name in _SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    file = folder / CHAT_TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
                special_tokens: Mapping[str, str] | None = None) -> str:
    """Render ``messages`` through a chat ``template`` as ``transformers``' ``apply_chat_template(tokenize=False)``.

    The environment is jinja2's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, the
    ``loopcontrols`` extension, a ``tojson`` filter that leaves non-ASCII as it is,
    ``raise_exception`` and ``strftime_now``; ``{% generation %}`` blocks render their body. The
    template sees ``messages``, ``add_generation_prompt`` and the special tokens by name
    (``bos_token``, ``eos_token``, ...).

    Raises:
        ImportError: jinja2 is not installed.

    Example:
        >>> render_chat("{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}",
        ...             [{"role": "user", "content": "hi"}], special_tokens={"eos_token": "</s>"})
        '[user] hi</s>'
    """
    environment = _environment()
    return environment.from_string(template).render(messages=[dict(message) for message in messages],
                                                    add_generation_prompt=add_generation_prompt,
                                                    **dict(special_tokens or {}))


_ENVIRONMENT: Any = None


def _environment() -> Any:
    global _ENVIRONMENT
    if _ENVIRONMENT is not None:
        return _ENVIRONMENT
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as error:
        raise ImportError("chat templates need jinja2: `pip install jinja2`") from error

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-token marker) renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    _ENVIRONMENT = environment
    return environment
