"""Structured outputs through xgrammar: a token bitmask per step, a matcher per request.

A `GuidedSpec` (JSON schema, any JSON object, regex, a list of choices, or an EBNF grammar)
compiles once against the model's vocabulary; compiled grammars are kept in a small LRU, so
the thousandth request with the same schema costs a dictionary lookup. Each guided request
owns a `GrammarMatcher`; before sampling, the matcher writes the set of tokens that keep the
output valid into one row of a shared bitmask, xgrammar applies it to the logits in place
(disallowed tokens become -inf), and after sampling the chosen token advances the matcher.

The grammar ends only on one of the model's EOS tokens (xgrammar's stop tokens): once the
output is complete, EOS is the only allowed token, so the scheduler's ordinary EOS check ends
the request and `is_terminated` reports it.

JSON is constrained to xgrammar's canonical spacing (`, ` and `: `, no free whitespace) rather
than vLLM's any-whitespace default: with free whitespace a weak model can pad forever and
never close the object.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import xgrammar as xgr

from orchestrator.runtime.protocol import GuidedSpec

_CACHE_SIZE = 256


def tokenizer_info(tokenizer_json: Path, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a `tokenizer.json`, sized to the model's vocabulary (which may be
    padded past the tokenizer's; padding ids decode to nothing and are never allowed)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    encoded = [""] * vocab_size
    for token, idx in tokenizer.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    # Byte-level vs byte-fallback vs raw, and the prefix-space rule, read from the tokenizer's
    # own serialized pipeline; the same detection `TokenizerInfo.from_huggingface` runs.
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_str())
    return xgr.TokenizerInfo(
        encoded,
        meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=meta["add_prefix_space"],
    )


# xgrammar 0.2.9 spells the characters of a length-bounded JSON string as [^"\\\r\n], which
# lets raw control characters (a tab, say) through; strict JSON parsers reject those. Its
# unbounded strings already exclude \0-\x1f, so we narrow the bounded class the same way.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_STRICT_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


def _json_schema_grammar(schema: Any) -> str:
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return str(grammar).replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR)


def _choice_grammar(choices: list[str]) -> str:
    # JSON string literals are valid EBNF literals in xgrammar, escapes included.
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GuidedDecoding:
    """Compiles specs (thread-safe, so callers can compile off the engine thread) and holds
    the matchers of the guided requests in flight."""

    def __init__(self, info: xgr.TokenizerInfo, max_threads: int = 2) -> None:
        self.vocab_size = info.vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        self._compiled: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)

    @classmethod
    def from_model_dir(cls, model_dir: Path, vocab_size: int, stop_token_ids: list[int]) -> GuidedDecoding:
        return cls(tokenizer_info(model_dir / "tokenizer.json", vocab_size, stop_token_ids))

    # ------------------------------------------------------------------ compiling

    def compile(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        """The compiled grammar for `spec`, from the cache when seen before. Raises ValueError
        for a spec that does not parse (bad schema, regex or grammar)."""
        key = (spec.kind, spec.value if isinstance(spec.value, str) else json.dumps(spec.value))
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        compiled = self._compile(spec)
        with self._lock:
            self._compiled[key] = compiled
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        value = spec.value
        try:
            if spec.kind == "json_object":
                return self._compiler.compile_grammar(_json_schema_grammar({"type": "object"}))
            if spec.kind == "choice":
                if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                    raise ValueError("a choice constraint needs a non-empty list of strings")
                return self._compiler.compile_grammar(_choice_grammar(value))
            if not isinstance(value, str):
                raise ValueError(f"a {spec.kind} constraint needs a string value")
            if spec.kind == "json_schema":
                return self._compiler.compile_grammar(_json_schema_grammar(json.loads(value)))
            if spec.kind == "regex":
                return self._compiler.compile_regex(value)
            return self._compiler.compile_grammar(value)
        except ValueError:
            raise
        except RuntimeError as exc:  # xgrammar reports parse errors as RuntimeError
            raise ValueError(f"invalid {spec.kind} constraint: {exc}") from exc

    # ------------------------------------------------------------------ per request

    def add(self, request_id: str, compiled: xgr.CompiledGrammar) -> None:
        self._matchers[request_id] = xgr.GrammarMatcher(compiled)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def is_guided(self, request_id: str) -> bool:
        return request_id in self._matchers

    def apply_mask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Mask, in place, the rows of `logits` (row i is `request_ids[i]`) that are guided."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return
        if self._bitmask.shape[0] < len(request_ids):
            self._bitmask = xgr.allocate_token_bitmask(len(request_ids), self.vocab_size)
        bitmask = self._bitmask[: len(request_ids)]
        for i in rows:
            self._matchers[request_ids[i]].fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size, indices=rows
        )

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher; False if the grammar rejects the token (only possible
        when the sampler chose outside the mask, e.g. a row whose every token was masked)."""
        matcher = self._matchers.get(request_id)
        return matcher is None or matcher.accept_token(token_id)

    def is_terminated(self, request_id: str) -> bool:
        matcher = self._matchers.get(request_id)
        return matcher is not None and matcher.is_terminated()
