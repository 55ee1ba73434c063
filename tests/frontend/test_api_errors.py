"""Bad input gets a clean 4xx in OpenAI's error shape and never hurts the server or other requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.frontend.live_frontend import MODEL, LiveFrontend, live_frontend
from tests.frontend.tokenizer_dirs import build_chatml

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveFrontend]:
    with live_frontend(build_chatml(tmp_path_factory.mktemp("chatml")), num_workers=1) as frontend:
        yield frontend


def _post(live: LiveFrontend, path: str, content: bytes) -> httpx.Response:
    return httpx.post(
        f"{live.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=30
    )


def _assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return dict(error)


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": MESSAGES, **fields}).encode()


BAD_CHAT_BODIES = {
    "malformed json": b'{"model": "mock-model", "messages": [',
    "not an object": b"[1, 2, 3]",
    "missing messages": json.dumps({"model": MODEL}).encode(),
    "empty messages": _chat(messages=[]),
    "wrong role": _chat(messages=[{"role": "robot", "content": "x"}]),
    "content wrong type": _chat(messages=[{"role": "user", "content": 5}]),
    "temperature wrong type": _chat(temperature="hot"),
    "temperature out of range": _chat(temperature=5),
    "top_p out of range": _chat(top_p=0),
    "negative max_tokens": _chat(max_tokens=-1),
    "huge max_tokens": _chat(max_tokens=10**12),
    "n out of range": _chat(n=1000),
    "bad logit_bias key": _chat(logit_bias={"abc": 1}),
    "logit_bias outside vocab": _chat(logit_bias={"99999999": 1}),
    "stop_token_ids outside vocab": _chat(stop_token_ids=[-1]),
    "empty stop": _chat(stop=[""]),
    "image part": _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
    "schema missing": _chat(response_format={"type": "json_schema"}),
    "two constraints": _chat(response_format={"type": "json_object"}, guided_regex="a+"),
}


@pytest.mark.parametrize("body", BAD_CHAT_BODIES.values(), ids=BAD_CHAT_BODIES.keys())
def test_bad_chat_bodies_get_400(live: LiveFrontend, body: bytes) -> None:
    _assert_openai_error(_post(live, "/v1/chat/completions", body), 400)


def test_bad_completion_bodies_get_400(live: LiveFrontend) -> None:
    fields: dict[str, Any]
    for fields in (
        {"prompt": []},
        {"prompt": [1, 2, 10**9]},
        {"prompt": "x", "suffix": "y"},
        {"prompt": "x", "logprobs": 99},
        {"prompt": "x" * 20000},  # longer than the context
    ):
        body = json.dumps({"model": MODEL, **fields}).encode()
        _assert_openai_error(_post(live, "/v1/completions", body), 400)


def test_prompt_over_context_names_the_limit(live: LiveFrontend) -> None:
    error = _assert_openai_error(_post(live, "/v1/chat/completions", _chat(max_tokens=10**12)), 400)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "max_tokens"


@pytest.mark.parametrize("chars", [100_000, 5_000_000])
def test_long_prompts_are_rejected_without_stalling(live: LiveFrontend, chars: int) -> None:
    # 100k characters are tokenized off the event loop; 5M cannot fit whatever the tokens are.
    body = _chat(messages=[{"role": "user", "content": "hello world " * (chars // 12)}])
    error = _assert_openai_error(_post(live, "/v1/chat/completions", body), 400, "messages")
    assert error["code"] == "context_length_exceeded"
    completion = json.dumps({"model": MODEL, "prompt": "hello world " * (chars // 12)}).encode()
    _assert_openai_error(_post(live, "/v1/completions", completion), 400, "prompt")


def test_unknown_model_is_404(live: LiveFrontend) -> None:
    error = _assert_openai_error(
        _post(live, "/v1/chat/completions", _chat(model="no-such-model")), 404, "model"
    )
    assert error["code"] == "model_not_found"
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)


def test_ten_megabyte_body_is_413(live: LiveFrontend) -> None:
    body = (
        b'{"model": "mock-model", "messages": [{"role": "user", "content": "'
        + b"a" * (10 * 1024 * 1024)
        + b'"}]}'
    )
    _assert_openai_error(_post(live, "/v1/chat/completions", body), 413)


def test_unknown_fields_are_ignored_and_logged_once(
    live: LiveFrontend, caplog: pytest.LogCaptureFixture
) -> None:
    for _ in range(3):
        response = _post(live, "/v1/chat/completions", _chat(max_tokens=2, a_field_from_the_future={"x": 1}))
        assert response.status_code == 200, response.text
    reports = [r for r in caplog.records if "a_field_from_the_future" in r.getMessage()]
    assert len(reports) == 1


def test_unknown_route_and_method_are_openai_shaped(live: LiveFrontend) -> None:
    _assert_openai_error(httpx.get(f"{live.url}/v1/nothing-here"), 404)
    _assert_openai_error(httpx.get(f"{live.url}/v1/chat/completions"), 405)


def test_server_still_serves_after_bad_input(live: LiveFrontend) -> None:
    for body in BAD_CHAT_BODIES.values():
        _post(live, "/v1/chat/completions", body)
    assert httpx.get(f"{live.url}/health").status_code == 200
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert out.choices[0].message.content is not None
