"""`usage.prompt_tokens_details.cached_tokens` when a stop string ends the request early.

The frontend cancels the worker at the stop string, before the worker's final usage; the
count must come from the first delta (`TokenDelta.cached_tokens`), in-process and over TCP."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.frontend.live_frontend import MODEL, live_frontend
from tests.frontend.tokenizer_dirs import build_chatml

PROMPT = "The scheduler batches prefill chunks and decode steps together. " * 20
SEEDED = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chatml(tmp_path_factory.mktemp("chatml"))


@pytest.mark.parametrize("tcp", [False, True], ids=["in-process", "tcp"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_cached_tokens_survive_a_stop_string(model_dir: Path, tcp: bool, stream: bool) -> None:
    # speedup 10: a 2,000-token run would take seconds, so the stop string surely comes first.
    with live_frontend(model_dir, num_workers=1, speedup=10.0, tcp=tcp) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)
        # The same prompt and seed give the same tokens: learn the text, and cache the prompt.
        first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=7, extra_body=SEEDED)
        text = first.choices[0].text
        stop = text[-3:]
        assert len(stop) == 3
        expected = text[: text.find(stop)]
        if stream:
            chunks = list(
                client.completions.create(
                    model=MODEL,
                    prompt=PROMPT,
                    max_tokens=2000,
                    seed=7,
                    stop=[stop],
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=SEEDED,
                )
            )
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            out = client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=2000, seed=7, stop=[stop], extra_body=SEEDED
            )
            got, finish, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
        assert (got, finish) == (expected, "stop")
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.completion_tokens <= 8  # stopped long before the worker would have finished
        # The first request cached the prompt's full 64-token blocks; the last prompt token is
        # always computed, so a prompt of whole blocks finds all but its last block.
        assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 64 * 64 > 0
