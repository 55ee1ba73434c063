"""Grammar masks on random logits: whatever the "model" prefers, the output obeys the spec.

These drive `GuidedDecoding` with seeded random logits and the real sampler over the tiny
tokenizer; the engine-level test (test_engine.py) repeats the schema case with a model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from backends.deepinfer.guided import GuidedDecoding
from backends.deepinfer.sampler import Sampler
from backends.deepinfer.sequence import Sequence
from backends.deepinfer.tiny import build_tokenizer
from orchestrator.runtime.protocol import GuidedSpec, SamplingOptions, WorkerRequest

VOCAB = 512
EOS = 2  # <|im_end|> in the tiny tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["router", "engine", "cache"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "ok", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def guided(tokenizer_dir: Path) -> GuidedDecoding:
    return GuidedDecoding.from_model_dir(tokenizer_dir, VOCAB, [EOS])


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def generate(
    guided: GuidedDecoding, tokenizer: Tokenizer, specs: list[GuidedSpec], seed: int, max_steps: int = 200
) -> list[list[int]]:
    """Sample a batch under the specs from random logits until every grammar terminates.

    Inside an unbounded JSON string hundreds of tokens are allowed and only '"' closes it, so
    the random "model" leans towards closing characters to finish in reasonable time."""
    gen = torch.Generator().manual_seed(seed)
    closers = torch.zeros(VOCAB)
    closers[[tid for c in '"}]' if (tid := tokenizer.token_to_id(c)) is not None]] = 4.0
    seqs = [
        Sequence(
            WorkerRequest(request_id=f"g{i}", token_ids=[0], max_tokens=max_steps, sampling=SamplingOptions())
        )
        for i in range(len(specs))
    ]
    for seq, spec in zip(seqs, specs, strict=True):
        guided.add(seq.request_id, guided.compile(spec))
    sampler = Sampler(VOCAB, [EOS], seed=seed)
    live = list(seqs)
    for _ in range(max_steps):
        if not live:
            break
        logits = 3 * torch.randn(len(live), VOCAB, generator=gen) + closers
        guided.apply_mask(logits, [s.request_id for s in live])
        for seq, token in zip(live, sampler(logits, live), strict=True):
            assert guided.accept(seq.request_id, token.token_id)
            seq.token_ids.append(token.token_id)
        live = [s for s in live if not guided.is_terminated(s.request_id)]
    assert not live, "a grammar did not terminate"
    for seq in seqs:
        guided.release(seq.request_id)
    return [seq.token_ids[1:] for seq in seqs]


def text_of(tokenizer: Tokenizer, ids: list[int]) -> str:
    assert ids[-1] == EOS  # the grammar ends on the stop token
    return tokenizer.decode(ids[:-1], skip_special_tokens=False)


def test_json_schema_outputs_validate(guided: GuidedDecoding, tokenizer: Tokenizer) -> None:
    spec = GuidedSpec(kind="json_schema", value=json.dumps(SCHEMA))
    outputs = generate(guided, tokenizer, [spec] * 10, seed=0)
    for ids in outputs:
        jsonschema.validate(json.loads(text_of(tokenizer, ids)), SCHEMA)
    assert len({tuple(o) for o in outputs}) > 1  # random logits, different valid documents


def test_json_object_regex_choice_and_grammar(guided: GuidedDecoding, tokenizer: Tokenizer) -> None:
    choices = ['Paris "city"', "Lyon", "Saint-\u00c9tienne"]
    specs = [
        GuidedSpec(kind="json_object"),
        GuidedSpec(kind="regex", value=r"[a-z]{3}-[0-9]{2}"),
        GuidedSpec(kind="choice", value=choices),
        GuidedSpec(kind="grammar", value='root ::= "(" [0-9] (" + " [0-9])? ")"'),
    ]
    for seed in range(3):
        obj, rx, choice, expr = (
            text_of(tokenizer, ids) for ids in generate(guided, tokenizer, specs, seed=seed, max_steps=400)
        )
        assert isinstance(json.loads(obj), dict)
        assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", rx)
        assert choice in choices
        assert re.fullmatch(r"\([0-9]( \+ [0-9])?\)", expr)


def test_unguided_rows_are_untouched(guided: GuidedDecoding) -> None:
    guided.add("only", guided.compile(GuidedSpec(kind="choice", value=["yes", "no"])))
    logits = torch.zeros(3, VOCAB)
    guided.apply_mask(logits, ["free", "only", "other"])
    guided.release("only")
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    assert 0 < int(torch.isfinite(logits[1]).sum()) < 10


def test_compiled_once_per_spec(guided: GuidedDecoding) -> None:
    spec = GuidedSpec(kind="json_schema", value=json.dumps(SCHEMA))
    assert guided.compile(spec) is guided.compile(GuidedSpec(kind="json_schema", value=json.dumps(SCHEMA)))


@pytest.mark.parametrize(
    "spec",
    [
        GuidedSpec(kind="json_schema", value="{not json"),
        GuidedSpec(kind="json_schema", value='{"type": "no-such-type"}'),
        GuidedSpec(kind="regex", value="(unclosed"),
        GuidedSpec(kind="grammar", value="root ::= undefined_rule"),
        GuidedSpec(kind="choice", value=[]),
        GuidedSpec(kind="regex"),
    ],
)
def test_bad_specs_raise_value_error(guided: GuidedDecoding, spec: GuidedSpec) -> None:
    with pytest.raises(ValueError):
        guided.compile(spec)
