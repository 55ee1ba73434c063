"""OpenAI request fields -> worker request fields: the mappings with no I/O."""

from __future__ import annotations

import json

import pytest

from orchestrator.frontend.errors import InvalidRequest
from orchestrator.frontend.params import guided_spec, per_choice, resolve_max_tokens, sampling_options
from orchestrator.frontend.protocol import INT64_MAX, ChatCompletionRequest
from orchestrator.runtime.protocol import GuidedSpec, SamplingOptions, WorkerRequest


def _chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    )


def test_sampling_defaults_leave_the_workers_defaults() -> None:
    assert sampling_options(_chat()) == SamplingOptions()


def test_sampling_fields_map_and_top_k_minus_one_means_off() -> None:
    opts = sampling_options(
        _chat(
            temperature=0.3,
            top_p=0.9,
            top_k=-1,
            min_p=0.05,
            seed=4,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.1,
            logit_bias={"7": -100},
        )
    )
    assert opts == SamplingOptions(
        temperature=0.3,
        top_p=0.9,
        top_k=0,
        min_p=0.05,
        seed=4,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={7: -100.0},
    )


def test_guided_spec_from_each_spelling() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    from_format = guided_spec(
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    )
    assert from_format is not None and from_format.kind == "json_schema"
    assert isinstance(from_format.value, str) and json.loads(from_format.value) == schema
    assert guided_spec(_chat(response_format={"type": "json_object"})) == GuidedSpec(kind="json_object")
    assert guided_spec(_chat(response_format={"type": "text"})) is None
    assert guided_spec(_chat(guided_json=schema)) == GuidedSpec(kind="json_schema", value=json.dumps(schema))
    assert guided_spec(_chat(guided_regex="a+")) == GuidedSpec(kind="regex", value="a+")
    assert guided_spec(_chat(guided_choice=["x", "y"])) == GuidedSpec(kind="choice", value=["x", "y"])
    assert guided_spec(_chat(guided_grammar="root ::= 'a'")) == GuidedSpec(
        kind="grammar", value="root ::= 'a'"
    )
    with pytest.raises(InvalidRequest):
        guided_spec(_chat(guided_regex="a", guided_choice=["a"]))


def test_max_tokens_defaults_to_the_rest_of_the_context_and_rejects_overflow() -> None:
    assert resolve_max_tokens(None, 100, 4096, "messages") == 3996
    assert resolve_max_tokens(96, 4000, 4096, "messages") == 96
    with pytest.raises(InvalidRequest) as too_long:
        resolve_max_tokens(97, 4000, 4096, "messages")
    assert too_long.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as prompt_too_long:
        resolve_max_tokens(None, 4096, 4096, "prompt")
    assert prompt_too_long.value.param == "prompt"


def test_choices_get_their_own_ids_and_consecutive_seeds() -> None:
    base = WorkerRequest(
        request_id="r", token_ids=[1], max_tokens=2, sampling=SamplingOptions(seed=INT64_MAX - 1)
    )
    assert per_choice(base, 1) == [base]
    choices = per_choice(base, 3)
    assert [c.request_id for c in choices] == ["r-0", "r-1", "r-2"]
    assert [c.sampling.seed for c in choices] == [INT64_MAX - 1, INT64_MAX, INT64_MAX - 3]
    unseeded = per_choice(WorkerRequest(request_id="u", token_ids=[1], max_tokens=2), 2)
    assert [c.sampling.seed for c in unseeded] == [None, None]
