"""Large request bodies are validated in a child process: the result is the model the event
loop would have built, and a rejected body the same 400."""

from __future__ import annotations

import asyncio
import json

import pydantic
import pytest

from orchestrator.frontend.bodies import BodyParser
from orchestrator.frontend.errors import InvalidRequest, to_frontend_error
from orchestrator.frontend.protocol import ChatCompletionRequest, CompletionRequest


def test_a_large_body_validates_in_the_child_as_it_would_on_the_loop() -> None:
    async def scenario() -> None:
        parser = BodyParser(offload_bytes=1024)
        try:
            chat = json.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "hi " * 2000}], "unknown_field": 1}
            ).encode()
            offloaded = await parser.parse(ChatCompletionRequest, chat)
            assert parser._pool is not None  # it really went to the child
            assert offloaded == ChatCompletionRequest.model_validate_json(chat)
            assert offloaded.model_extra == {"unknown_field": 1}

            bad = json.dumps({"model": "m", "prompt": [[1]] * 1000, "max_tokens": 1}).encode()
            with pytest.raises(pydantic.ValidationError) as on_loop:
                CompletionRequest.model_validate_json(bad)
            with pytest.raises(InvalidRequest) as in_child:
                await parser.parse(CompletionRequest, bad)
            expected = to_frontend_error(on_loop.value)
            assert (in_child.value.message, in_child.value.param) == (expected.message, expected.param)
            assert "at most 256 prompts" in in_child.value.message

            small = b'{"model": "m", "prompt": "x"}'
            assert (await parser.parse(CompletionRequest, small)).prompt == "x"
        finally:
            await parser.close()
        assert parser._pool is None

    asyncio.run(scenario())
