"""Where a benchmark sends its turns, and how each is timed.

`OpenAITarget` streams from any OpenAI-compatible server (Weir, vLLM, SGLang, Dynamo), chat or
completions; `WorkerTarget` sends the same token ids straight to a Weir worker over the
request plane, which is the engine with no frontend, router or HTTP in front of it.

Timing follows vLLM's `bench serve` and aiperf: the clock starts when the request is sent; a
chunk counts as output when it carries text (an OpenAI server) or tokens (a worker), and its
arrival time is kept; the output token count is the server's `usage.completion_tokens` when it
reports one, else the number of output chunks.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import aiohttp
import msgspec

from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.protocol import SamplingOptions, WorkerRequest
from orchestrator.runtime.request_plane.client import RequestPlaneClient
from orchestrator.runtime.request_plane.security import PlaneSecurity
from orchestrator.runtime.request_plane.worker_client import TcpWorkerClient

Endpoint = Literal["completions", "chat"]


@dataclass(slots=True)
class RequestRecord:
    """One turn as the client saw it; times in seconds on the run's clock."""

    session: int
    turn: int
    start_s: float
    input_tokens: int  # sent; replaced by the server's usage.prompt_tokens when it reports one
    chunk_s: list[float] = field(default_factory=list)
    end_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None  # a short type: http_429, stream_error, connection, timeout
    error_detail: str = ""
    reply_text: str = ""
    reply_ids: list[int] | None = None  # a worker's exact output ids; None from an HTTP server

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None and bool(self.chunk_s)

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.start_s

    @property
    def e2e_s(self) -> float:
        assert self.end_s is not None
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """vLLM's time per output token: (e2e - ttft) / (output - 1)."""
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]


@dataclass(frozen=True, slots=True)
class Turn:
    """What a target is asked to send: the prompt as ids (completions, worker) and as chat
    messages (chat), and how many tokens to generate."""

    session: int
    turn: int
    prompt_ids: list[int]
    messages: list[dict[str, str]]
    output_tokens: int


class Target(Protocol):
    name: str

    async def send(self, turn: Turn, clock: Clock) -> RequestRecord: ...

    async def describe(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class Clock:
    """Seconds since the run began (perf_counter: monotonic and fine-grained)."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.origin


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Error(msgspec.Struct):
    message: str = ""
    type: str = ""


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: _Error | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


class OpenAITarget:
    def __init__(
        self,
        name: str,
        url: str,
        model: str | None,
        endpoint: Endpoint,
        *,
        api_key: str | None = None,
        sampling: dict[str, Any] | None = None,
        ignore_eos: bool = True,
        extra_body: dict[str, Any] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.model = model
        self.endpoint = endpoint
        self.sampling = sampling or {}
        self.ignore_eos = ignore_eos
        self.extra_body = extra_body or {}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No connection cap: the load driver decides concurrency, the pool must not.
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        self._http = aiohttp.ClientSession(
            headers=headers,
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            read_bufsize=2**18,
        )
        self._models: dict[str, Any] | None = None

    async def describe(self) -> dict[str, Any]:
        """The server's /v1/models card, and the model the benchmark asks for."""
        if self._models is None:
            async with self._http.get(f"{self.url}/v1/models") as response:
                response.raise_for_status()
                self._models = await response.json()
        if self.model is None:
            self.model = str(self._models["data"][0]["id"])
        return {"kind": "openai", "url": self.url, "endpoint": self.endpoint, "models": self._models}

    async def send(self, turn: Turn, clock: Clock) -> RequestRecord:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": turn.output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.sampling,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "chat":
            body["messages"] = turn.messages
        else:
            body["prompt"] = turn.prompt_ids
        body.update(self.extra_body)
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        record = RequestRecord(turn.session, turn.turn, clock.now(), len(turn.prompt_ids))
        text: list[str] = []
        try:
            async with self._http.post(self.url + path, json=body) as response:
                if response.status != 200:
                    record.error = f"http_{response.status}"
                    record.error_detail = (await response.text())[:300]
                    return record
                async for line in response.content:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    self._chunk(_decode_chunk(payload), record, text, clock)
        except (aiohttp.ClientError, msgspec.DecodeError) as exc:
            record.error, record.error_detail = "connection", f"{type(exc).__name__}: {exc}"[:300]
            return record
        except TimeoutError:
            record.error = "timeout"
            return record
        if record.error is None:
            record.end_s = clock.now()
            record.output_tokens = record.output_tokens or len(record.chunk_s)
            if not record.chunk_s:
                record.error, record.error_detail = "no_output", "the stream ended with no text"
        record.reply_text = "".join(text)
        return record

    @staticmethod
    def _chunk(chunk: _Chunk, record: RequestRecord, text: list[str], clock: Clock) -> None:
        if chunk.error is not None:
            record.error, record.error_detail = "stream_error", chunk.error.message[:300]
            return
        piece = ""
        for choice in chunk.choices:
            if choice.text:
                piece += choice.text
            elif choice.delta is not None:
                piece += (choice.delta.content or "") + (choice.delta.reasoning_content or "")
        if piece:
            record.chunk_s.append(clock.now())
            text.append(piece)
        if chunk.usage is not None:
            record.output_tokens = chunk.usage.completion_tokens
            record.input_tokens = chunk.usage.prompt_tokens or record.input_tokens
            details = chunk.usage.prompt_tokens_details
            if details is not None and details.cached_tokens is not None:
                record.cached_tokens = details.cached_tokens

    async def close(self) -> None:
        await self._http.close()


class WorkerTarget:
    """A Weir worker, dialled at its request-plane address (`weir status` lists them;
    `weir serve` prints its own), with the cluster secret if the cluster has one."""

    def __init__(
        self,
        name: str,
        address: str,
        *,
        security: PlaneSecurity | None = None,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = True,
    ) -> None:
        self.name = name
        self.address = address
        self.sampling = SamplingOptions(temperature=temperature, seed=seed)
        self.ignore_eos = ignore_eos
        self._plane = RequestPlaneClient(security=security)
        self._worker = TcpWorkerClient(self._plane, address)

    async def describe(self) -> dict[str, Any]:
        files = await self._worker.model_files()
        return {"kind": "weir-worker", "address": self.address, "tokenizer_files": sorted(files.files)}

    async def tokenizer_json(self) -> bytes | None:
        """The worker's tokenizer.json: the engine's own tokenizer, so prompts built with it
        tokenize as the server will."""
        return (await self._worker.model_files()).files.get("tokenizer.json")

    async def send(self, turn: Turn, clock: Clock) -> RequestRecord:
        request = WorkerRequest(
            request_id=f"bench-{uuid.uuid4().hex[:12]}",
            token_ids=turn.prompt_ids,
            max_tokens=turn.output_tokens,
            sampling=self.sampling,
            ignore_eos=self.ignore_eos,
        )
        record = RequestRecord(turn.session, turn.turn, clock.now(), len(turn.prompt_ids))
        ids: list[int] = []
        stream = self._worker.generate(request)
        try:
            async for delta in stream:
                if delta.token_ids:
                    record.chunk_s.append(clock.now())
                    ids += delta.token_ids
                if delta.cached_tokens is not None:
                    record.cached_tokens = delta.cached_tokens
                if delta.usage is not None:
                    record.cached_tokens = delta.usage.cached_tokens
        except EngineError as exc:
            record.error, record.error_detail = f"engine_{exc.code}", str(exc)[:300]
            return record
        except (TimeoutError, OSError) as exc:
            record.error, record.error_detail = "connection", f"{type(exc).__name__}: {exc}"[:300]
            return record
        finally:
            await stream.aclose()
        record.end_s = clock.now()
        record.output_tokens = len(ids)
        record.reply_ids = ids
        return record

    async def close(self) -> None:
        await self._plane.close()
