"""The frontend's input limits (docs/frontend.md, "Limits"), each at a small configured value."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.frontend.live_frontend import MODEL, LiveFrontend, live_frontend
from tests.frontend.tokenizer_dirs import build_chatml
from tests.waiting import wait_until

READ_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 8


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveFrontend]:
    with live_frontend(
        build_chatml(tmp_path_factory.mktemp("chatml")),
        num_workers=1,
        max_stop_strings=2,
        read_timeout_s=READ_TIMEOUT_S,
        max_connections=MAX_CONNECTIONS,
        stream_stall_timeout_s=1.0,
    ) as frontend:
        yield frontend


def _post(live: LiveFrontend, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json={"model": MODEL, **body}, timeout=30)


def _error(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    return str(error["message"])


def test_stop_string_count_and_length(live: LiveFrontend) -> None:
    assert "at most 2 stop strings" in _error(
        _post(live, "/v1/completions", prompt="x", stop=["a", "b", "c"]), "stop"
    )
    assert "256 characters" in _error(_post(live, "/v1/completions", prompt="x", stop=["a" * 257]), "stop")
    assert _post(live, "/v1/completions", prompt="x", stop=["a", "b"], max_tokens=2).status_code == 200


def test_choice_count_is_checked_before_tokenizing(live: LiveFrontend) -> None:
    start = time.perf_counter()
    # Tokenizing these would take seconds; the prompt count, checked as the body is read,
    # answers at once; prompts x n, checked before tokenizing, too.
    _error(_post(live, "/v1/completions", prompt=["x" * 20_000] * 300), "prompt")
    _error(_post(live, "/v1/completions", prompt=["x" * 20_000] * 200, n=2), "n")
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}},
        {
            "messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"add_generation_prompt": 0},
        },
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}},
    ],
    ids=["no content", "null content", "kwargs messages", "kwargs add_generation_prompt", "kwargs tools"],
)
def test_template_and_message_shape_errors_are_400(live: LiveFrontend, body: dict[str, Any]) -> None:
    response = _post(live, "/v1/chat/completions", **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in ("messages", "chat_template_kwargs")


def _port(live: LiveFrontend) -> int:
    return int(live.url.rsplit(":", 1)[1])


def _closed(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    with contextlib.suppress(ConnectionResetError):
        return sock.recv(1) == b""
    return True


def test_headers_that_do_not_arrive_in_time_close_the_connection(live: LiveFrontend) -> None:
    with socket.create_connection(("127.0.0.1", _port(live))) as sock:
        start = time.perf_counter()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert _closed(sock, READ_TIMEOUT_S * 10)
        assert time.perf_counter() - start >= READ_TIMEOUT_S * 0.9


def test_connections_beyond_the_cap_are_closed(live: LiveFrontend) -> None:
    held = [socket.create_connection(("127.0.0.1", _port(live))) for _ in range(MAX_CONNECTIONS)]
    try:
        with socket.create_connection(("127.0.0.1", _port(live))) as extra:
            assert _closed(extra, READ_TIMEOUT_S / 2)  # at once, well before the header timeout
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: httpx.get(f"{live.url}/health", timeout=5).status_code == 200, "the cap to free up")


def _disconnects(live: LiveFrontend) -> float:
    lines = httpx.get(f"{live.url}/metrics", timeout=10).text.splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith("weir_frontend_client_disconnects_total"))


def test_a_stalled_reader_is_cancelled_with_its_worker_request(live: LiveFrontend) -> None:
    body = json.dumps(
        {"model": MODEL, "prompt": "x", "n": 8, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    ).encode()
    before = _disconnects(live)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", _port(live)))
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        # Never read: the stall timeout gives up on the stream and counts the client as gone.
        wait_until(lambda: _disconnects(live) > before, "the stalled stream to be dropped", timeout=30)
        assert live.active_requests() == 0
        # Dropped mid-stream: a reset, or an end without the stream's [DONE].
        received = b""
        sock.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 16):
                received += chunk
        assert b"data: [DONE]" not in received
    finally:
        sock.close()


def test_openapi_describes_the_request_models(live: LiveFrontend) -> None:
    schema = httpx.get(f"{live.url}/openapi.json", timeout=10).json()
    chat = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert chat["schema"]["$ref"] == "#/components/schemas/ChatCompletionRequest"
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "n", "stop", "max_tokens"} <= set(props)
    assert httpx.get(f"{live.url}/docs", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt", ["a"] * 100_000),
        ("prompt", [1, *["a"] * 100_000]),
    ],
    ids=["many prompts", "token ids with a stray string"],
)
def test_huge_prompt_lists_are_refused_at_their_shape(live: LiveFrontend, field: str, value: Any) -> None:
    _error(_post(live, "/v1/completions", **{field: value}), "prompt")


def test_too_many_chat_messages_are_refused(live: LiveFrontend) -> None:
    messages = [{"role": "user", "content": "a"}] * 20_000
    _error(_post(live, "/v1/chat/completions", messages=messages), "messages")
