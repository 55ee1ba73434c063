"""Structured outputs through llguidance: a token bitmask per step, a matcher per request.

A `GuidedSpec` (JSON schema, any JSON object, regex, a list of choices, or a grammar in
GBNF/EBNF or Lark syntax) compiles once against the model's vocabulary into a `Grammar`: a
matcher that has consumed nothing, kept in a small LRU, so the thousandth request with the
same schema costs a dictionary lookup and a copy. Each guided request owns a copy; before
sampling, the matcher writes the set of tokens that keep the output valid into one row of a
shared bitmask, the bitmask is applied to the logits in place (disallowed tokens become
-inf), and after sampling the chosen token advances the matcher.

The grammar ends only on one of the model's EOS tokens: once the output is complete, EOS is
the only allowed token, so the scheduler's ordinary EOS check ends the request and
`is_terminated` reports it.

JSON is constrained to canonical spacing (`, ` and `: `, no free whitespace) rather than
vLLM's any-whitespace default: with free whitespace a weak model can pad forever and never
close the object.

llguidance rather than xgrammar: the same masks from a 3 MB wheel with no dependencies,
where xgrammar pulls triton (about 1 GB) and transformers into every install.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance as llg
import torch
from llguidance.gbnf_to_lark import any_to_lark

from orchestrator.runtime.protocol import GuidedSpec

if TYPE_CHECKING:  # a TypedDict of the stub only
    from llguidance._lib import JsonCompileOptions

_CACHE_SIZE = 256
_JSON_OPTIONS: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}
_BIT = torch.arange(32, dtype=torch.int32)

# A compiled grammar: a matcher that has consumed nothing. Requests get deep copies.
Grammar = llg.LLMatcher


def tokenizer_info(tokenizer_json: Path, vocab_size: int, stop_token_ids: list[int]) -> llg.LLTokenizer:
    """llguidance's view of a `tokenizer.json`, sized to the model's vocabulary (which may be
    padded past the tokenizer's; padding ids decode to nothing and are never allowed)."""
    return llg.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab_size, eos_token=stop_token_ids)


def _grammar_text(spec: GuidedSpec) -> str:
    """The spec as an llguidance grammar; ValueError for a malformed spec."""
    value = spec.value
    if spec.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if spec.kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ValueError("a choice constraint needs a non-empty list of strings")
        # JSON string literals are valid Lark literals, escapes included.
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if not isinstance(value, str):
        raise ValueError(f"a {spec.kind} constraint needs a string value")
    if spec.kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(json.loads(value), defaults=_JSON_OPTIONS)
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(value)
    return llg.LLMatcher.grammar_from_lark(any_to_lark(value))


class GuidedDecoding:
    """Compiles specs (thread-safe, so callers can compile off the engine thread) and holds
    the matchers of the guided requests in flight."""

    def __init__(self, tokenizer: llg.LLTokenizer) -> None:
        self.vocab_size = tokenizer.vocab_size
        self._tokenizer = tokenizer
        self._compiled: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self._stop_tokens = frozenset(tokenizer.eos_tokens)
        self._matchers: dict[str, llg.LLMatcher] = {}
        self._ended: set[str] = set()  # guided requests whose grammar consumed its stop token
        self._bitmask = torch.zeros(0, (self.vocab_size + 31) // 32, dtype=torch.int32)

    @classmethod
    def from_model_dir(cls, model_dir: Path, vocab_size: int, stop_token_ids: list[int]) -> GuidedDecoding:
        return cls(tokenizer_info(model_dir / "tokenizer.json", vocab_size, stop_token_ids))

    # ------------------------------------------------------------------ compiling

    def compile(self, spec: GuidedSpec) -> Grammar:
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

    def _compile(self, spec: GuidedSpec) -> Grammar:
        try:
            grammar = _grammar_text(spec)
        except ValueError:
            raise
        except Exception as exc:  # the GBNF converter raises whatever its parser hits
            raise ValueError(f"invalid {spec.kind} constraint: {exc}") from exc
        matcher = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind} constraint: {matcher.get_error()}")
        return matcher

    # ------------------------------------------------------------------ per request

    def add(self, request_id: str, compiled: Grammar, consumed: Sequence[int] = ()) -> None:
        """Start a request's matcher, advanced over `consumed` (a migrated request's tokens so
        far); ValueError if the grammar rejects them."""
        matcher = compiled.deep_copy()
        for token_id in consumed:
            if not matcher.consume_token(token_id):
                raise ValueError("the tokens generated so far do not match the request's constraint")
        self._matchers[request_id] = matcher
        if consumed and consumed[-1] in self._stop_tokens:
            self._ended.add(request_id)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._ended.discard(request_id)

    def is_guided(self, request_id: str) -> bool:
        return request_id in self._matchers

    @torch.inference_mode()  # the runner's logits are inference tensors
    def apply_mask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Mask, in place, the rows of `logits` (row i is `request_ids[i]`) that are guided."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = torch.zeros(len(rows), self._bitmask.shape[1], dtype=torch.int32)
        bitmask = self._bitmask[: len(rows)]
        for slot, i in enumerate(rows):
            row = bitmask[slot]
            self._matchers[request_ids[i]].unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        # Bit j of word w allows token 32 * w + j.
        allowed = ((bitmask.unsqueeze(-1) >> _BIT) & 1).flatten(1)[:, : self.vocab_size].bool()
        index = torch.tensor(rows, device=logits.device)
        guided = logits.index_select(0, index)[:, : self.vocab_size]
        guided.masked_fill_(~allowed.to(logits.device), float("-inf"))
        logits[index, : self.vocab_size] = guided
        logits[index, self.vocab_size :] = float("-inf")

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher; False if the grammar rejects the token (only possible
        when the sampler chose outside the mask, e.g. a row whose every token was masked)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return True
        if not matcher.consume_token(token_id):
            return False
        # llguidance stops as soon as only a stop token can follow; the request ends on it.
        if token_id in self._stop_tokens:
            self._ended.add(request_id)
        return True

    def is_terminated(self, request_id: str) -> bool:
        return request_id in self._ended
