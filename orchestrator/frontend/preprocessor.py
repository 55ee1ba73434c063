"""Text in: a model directory's tokenizer and chat template, as the frontend uses them.

Workers see token ids only, so everything textual about a model lives here: `tokenizer.json`
(HF `tokenizers`, no transformers at run time), the chat template and special tokens from
`tokenizer_config.json` (or `chat_template.jinja`), and the end-of-sequence ids from
`tokenizer_config.json`, `generation_config.json` and `config.json`.

Chat templates are untrusted code from a model repository, so they run in Jinja's immutable
sandbox with the same globals and filters transformers provides (`raise_exception`,
`strftime_now`, a non-escaping `tojson`, loop controls), which makes our prompts byte-identical
to `apply_chat_template`'s.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from orchestrator.frontend.bpe import FastBPE, fast_bpe
from orchestrator.frontend.detokenizer import ByteDetokenizer, Detokenizer, StreamDetokenizer, byte_tables
from orchestrator.runtime.model_files import eos_token_ids, read_json, special_token_text

# The special-token names transformers hands every chat template (`special_tokens_map`).
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Preprocessor:
    """One model's tokenizer and chat template. Immutable after construction, shared by all
    requests for the model: build it with `Preprocessor.load(model_dir)`, which caches per path."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        name: str = "",
        fast_bpe: FastBPE | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._fast_bpe = fast_bpe  # the same encoding by tiktoken, where it gives the same ids
        self.name = name
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        bos = self.special_tokens.get("bos_token")
        self._bos_text = bos
        self._bos_id = tokenizer.token_to_id(bos) if bos else None
        self._token_text: dict[int, str] = {}
        self._byte_tables = byte_tables(tokenizer)  # for ByteDetokenizer; None: not byte-level

    @classmethod
    def load(cls, model_dir: str | Path) -> Preprocessor:
        """The preprocessor for a directory holding tokenizer.json (cached per resolved path)."""
        return _load_cached(str(Path(model_dir).expanduser().resolve()))

    # ------------------------------------------------------------------ prompts

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """The prompt text for OpenAI-style chat messages. Raises ValueError for messages the
        template cannot take (bad shape, non-text content, the template's own checks)."""
        if self._template is None:
            raise ValueError(f"model {self.name!r} has no chat template; use /v1/completions")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        context = {
            **self.special_tokens,
            **template_kwargs,
            "messages": [_normalize_message(i, m) for i, m in enumerate(messages)],
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(context)
        except Exception as exc:
            # Templates index what they expect (`message['content'] + ...`, `tool_call.function`)
            # without checking it, so a message of another shape fails in arbitrary ways
            # (TypeError, UndefinedError, the sandbox's SecurityError): all of them are the
            # messages' fault, not the server's.
            raise ValueError(f"chat template rejected the messages: {exc}") from exc

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids for `text`. Chat prompts carry BOS from their template, so pass
        add_special_tokens=False for them; a completion prompt that already begins with the
        BOS text does not get a second BOS from the tokenizer's post-processor."""
        ids = self._fast_bpe.encode(text, add_special_tokens) if self._fast_bpe is not None else None
        if ids is None:
            # encode_batch_fast releases the GIL (encode does not), so a long prompt encoded in
            # a worker thread leaves the event loop serving other requests; it skips offsets.
            ids = self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        if (
            add_special_tokens
            and self._bos_id is not None
            and len(ids) >= 2
            and ids[0] == ids[1] == self._bos_id
            and self._bos_text
            and text.startswith(self._bos_text)
        ):
            del ids[0]
        return ids

    # ------------------------------------------------------------------ text out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (a lone byte of a multi-byte character comes out as
        U+FFFD, as in vLLM and OpenAI). Memoized: logprobs ask for the same ids again and again."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenizer:
        """A fresh incremental detokenizer for one request's output."""
        if self._byte_tables is not None:
            return ByteDetokenizer(self._byte_tables[skip_special_tokens])
        return StreamDetokenizer(self.tokenizer, skip_special_tokens)


# ---------------------------------------------------------------------- loading


@functools.lru_cache(maxsize=32)
def _load_cached(model_dir: str) -> Preprocessor:
    root = Path(model_dir)
    tokenizer_file = root / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{tokenizer_file} not found: a model directory needs an HF tokenizer.json")
    source = tokenizer_file.read_text()
    tokenizer = Tokenizer.from_str(source)
    config = read_json(root / "tokenizer_config.json")
    special = {key: text for key in _SPECIAL_TOKEN_KEYS if (text := special_token_text(config.get(key)))}
    template_file = root / "chat_template.jinja"
    template = (
        template_file.read_text() if template_file.is_file() else _pick_template(config.get("chat_template"))
    )
    return Preprocessor(
        tokenizer,
        chat_template=template,
        special_tokens=special,
        eos_token_ids=eos_token_ids(root, tokenizer),
        name=root.name,
        fast_bpe=fast_bpe(tokenizer, json.loads(source)),
    )


def _pick_template(value: Any) -> str | None:
    # Either one template, or a list of named ones of which "default" is the chat template.
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes and sorts keys; templates expect plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not compile: {exc}") from exc


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    """A copy of an OpenAI message with its content as one string (or None, for an assistant
    turn that only calls tools): text-only models' templates expect a string."""
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be an object")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{index}].role must be a non-empty string")
    content = message.get("content")
    if isinstance(content, list):
        content = _join_text_parts(index, content)
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts")
    return {**message, "content": content}


def _join_text_parts(index: int, parts: list[Any]) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text":
            raise ValueError(
                f"messages[{index}].content[{j}] has type {kind!r}: this model only accepts 'text' parts"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"messages[{index}].content[{j}].text must be a string")
        texts.append(text)
    # vLLM joins text parts with newlines; so do we, so prompts match across servers.
    return "\n".join(texts)
