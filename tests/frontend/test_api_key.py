"""`api_key`: the OpenAI routes need the bearer token; probes and metrics do not."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from orchestrator.frontend.config import FrontendConfig
from tests.frontend.live_frontend import MODEL, LiveFrontend, live_frontend
from tests.frontend.tokenizer_dirs import build_chatml

KEY = "sk-weir-test-key"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveFrontend]:
    model_dir = build_chatml(tmp_path_factory.mktemp("chatml"))
    with live_frontend(model_dir, num_workers=1, api_key=KEY) as frontend:
        yield frontend


def _client(live: LiveFrontend, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=30)


def test_the_right_key_is_served(live: LiveFrontend) -> None:
    client = _client(live, KEY)
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert out.choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list()] == [MODEL]
    stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True)
    assert [c.choices[0].finish_reason for c in stream][-1] == "length"


def test_a_wrong_key_is_rejected(live: LiveFrontend) -> None:
    client = _client(live, "sk-wrong")
    with pytest.raises(openai.AuthenticationError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": KEY},  # no scheme
        {"authorization": f"Basic {KEY}"},
        {"authorization": f"Bearer {KEY}x"},
        {"authorization": f"Bearer {KEY[:-1]}"},
    ],
)
def test_missing_or_malformed_credentials_get_openais_401(
    live: LiveFrontend, headers: dict[str, str]
) -> None:
    for path in ("/v1/models", "/v1/unknown", "//v1/models"):
        response = httpx.get(f"{live.url}{path}", headers=headers, timeout=10)
        assert response.status_code == 401, (path, response.text)
        assert response.headers["www-authenticate"].startswith("Bearer")
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key"
        assert error["type"] == "invalid_request_error"
        assert set(error) == {"message", "type", "param", "code"}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{live.url}/v1/completions", json=body, headers=headers).status_code == 401


def test_probes_and_metrics_need_no_key(live: LiveFrontend) -> None:
    for path in ("/health", "/live", "/metrics"):
        assert httpx.get(f"{live.url}{path}", timeout=10).status_code == 200, path


def test_the_key_never_shows_in_the_config_repr() -> None:
    assert KEY not in repr(FrontendConfig(api_key=KEY))
    with pytest.raises(ValueError, match="api_key"):
        FrontendConfig(api_key="  ")
