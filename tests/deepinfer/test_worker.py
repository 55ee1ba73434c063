"""DeepInfer behind the runtime's Engine seam: streaming, cancellation, KV events, the card,
and (slow) the default SmolLM2 answering a real question."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.deepinfer.config import EngineConfig
from backends.deepinfer.worker import DeepInferWorker
from backends.registry import add_backend_arguments, make_engine
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import BlockStored, SamplingOptions, TokenDelta, WorkerRequest
from router.step_time import StepTime

GREEDY = SamplingOptions(temperature=0.0)


@pytest.fixture
async def worker(tiny_llama_dir: Path) -> AsyncIterator[DeepInferWorker]:
    w = DeepInferWorker(
        EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=64, block_size=16)
    )
    await w.start()
    yield w
    await w.stop()


async def collect(stream: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [d async for d in stream]


async def test_stream_ends_with_usage(worker: DeepInferWorker) -> None:
    req = WorkerRequest(
        request_id="a", token_ids=list(range(3, 40)), max_tokens=9, ignore_eos=True, logprobs=2
    )
    deltas = await collect(worker.generate(req))
    tokens = [t for d in deltas for t in d.token_ids]
    last = deltas[-1]
    assert last.finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (37, 9) == (37, len(tokens))
    logprobs = [lp for d in deltas for lp in d.logprobs or ()]
    assert [lp.token_id for lp in logprobs] == tokens and all(len(lp.top) == 2 for lp in logprobs)


async def test_concurrent_streams_and_cached_tokens(worker: DeepInferWorker) -> None:
    prompt = list(range(10, 50))

    def req(rid: str) -> WorkerRequest:
        return WorkerRequest(request_id=rid, token_ids=prompt, max_tokens=6, sampling=GREEDY, ignore_eos=True)

    first = await collect(worker.generate(req("first")))
    others = await asyncio.gather(*(collect(worker.generate(req(f"again{i}"))) for i in range(4)))
    usage = first[-1].usage
    assert usage is not None and usage.cached_tokens == 0 == first[0].cached_tokens
    for deltas in others:
        again = deltas[-1].usage
        assert again is not None and again.cached_tokens == 32
        assert deltas[0].cached_tokens == 32, "the first delta announces the cache hit"
        assert [t for d in deltas for t in d.token_ids] == [t for d in first for t in d.token_ids]


async def test_the_load_report_carries_the_step_curves_fitted_to_its_forwards(
    worker: DeepInferWorker,
) -> None:
    assert worker.load().step_time is None  # nothing run yet: routers use their default
    # Prompts of several lengths, one after another: prefill steps and decode steps.
    for n in (8, 24, 40, 56, 72, 88, 104, 120):
        request = WorkerRequest(request_id=f"r{n}", token_ids=list(range(3, 3 + n)), max_tokens=6)
        await collect(worker.generate(request))
    curves = worker.load().step_time
    assert curves is not None and curves.samples == worker.engine.step_fit.samples >= 32
    fitted = StepTime.from_curves(curves)
    assert fitted != StepTime()  # fitted to this engine, not the default
    for tokens in (16, 64, 128):
        assert 0 < fitted.prefill(tokens) < 10_000  # a tiny model's forward on a CPU: ms, not s


async def test_a_slow_reader_gets_tokens_merged(worker: DeepInferWorker) -> None:
    req = WorkerRequest(request_id="slow", token_ids=[5, 6, 7], max_tokens=12, ignore_eos=True, logprobs=0)
    stream = worker.generate(req)
    first = await anext(stream)
    while worker.load().active_requests:  # the engine runs ahead while nobody reads
        await asyncio.sleep(0.01)
    rest = await collect(stream)
    assert len(rest) == 1 and rest[0].finish_reason == "length"
    assert len(first.token_ids) + len(rest[0].token_ids) == 12
    assert rest[0].logprobs is not None and len(rest[0].logprobs) == len(rest[0].token_ids)


async def test_closing_the_stream_frees_blocks_at_once(worker: DeepInferWorker) -> None:
    req = WorkerRequest(request_id="c", token_ids=list(range(3, 70)), max_tokens=500, ignore_eos=True)
    stream = worker.generate(req)
    await anext(stream)
    assert worker.load().active_blocks > 0
    await stream.aclose()  # type: ignore[attr-defined]
    load = worker.load()
    assert (load.active_blocks, load.active_requests, load.waiting_requests) == (0, 0, 0)
    # The prompt's full blocks stay cached for the next request.
    assert worker.kv_snapshot().blocks["device"]


async def test_kv_events_use_the_shared_block_hash(worker: DeepInferWorker) -> None:
    prompt = list(range(100, 150))
    await collect(worker.generate(WorkerRequest(request_id="k", token_ids=prompt, max_tokens=1)))
    batches = worker.take_kv_events()
    assert [b.event_id for b in batches] == list(range(1, len(batches) + 1))
    stored = [h for b in batches for e in b.events if isinstance(e, BlockStored) for h in e.blocks]
    assert stored[:3] == block_hashes(prompt, 16)
    snapshot = worker.kv_snapshot()
    assert snapshot.event_id == batches[-1].event_id
    assert set(block_hashes(prompt, 16)) <= set(snapshot.blocks["device"])
    assert worker.take_kv_events() == []


async def test_card_and_rejections(worker: DeepInferWorker, tiny_llama_dir: Path) -> None:
    card = worker.card
    assert (card.backend, card.role, card.block_size, card.total_kv_blocks) == (
        "deepinfer",
        "aggregated",
        16,
        64,
    )
    assert card.model_path == str(tiny_llama_dir) and (tiny_llama_dir / "tokenizer.json").is_file()
    assert card.kv_bytes_per_token > 0 and card.eos_token_ids
    with pytest.raises(EngineError) as err:
        await collect(worker.generate(WorkerRequest(request_id="x", token_ids=[1, 99999], max_tokens=3)))
    assert err.value.code == "invalid_request"
    with pytest.raises(EngineError, match=r"holds|limit"):
        await collect(worker.generate(WorkerRequest(request_id="y", token_ids=[1] * 2000, max_tokens=3)))


async def test_stop_aborts_requests_in_flight(tiny_llama_dir: Path) -> None:
    w = DeepInferWorker(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=64))
    await w.start()
    stream = w.generate(WorkerRequest(request_id="s", token_ids=[5, 6, 7], max_tokens=800, ignore_eos=True))
    await anext(stream)
    await w.stop()
    rest = await collect(stream)
    assert rest[-1].finish_reason == "abort" and rest[-1].usage is not None


def cli_worker(argv: list[str], model_dir: Path) -> DeepInferWorker:
    """The DeepInfer worker `weir worker --backend deepinfer --model MODEL_DIR ARGV` builds."""
    parser = argparse.ArgumentParser()
    add_backend_arguments(parser)
    args = parser.parse_args(["--backend", "deepinfer", "--model", str(model_dir), *argv])
    worker = make_engine(args, model_dir, "aggregated", "worker-a")
    assert isinstance(worker, DeepInferWorker)
    return worker


def test_cli_flags_build_the_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    flags = (
        "--block-size 32 --num-kv-blocks 50 --deterministic --no-prefix-caching --max-num-seqs 8 --device cpu"
    )
    config = cli_worker(flags.split(), tiny_llama_dir).config
    assert (config.block_size, config.num_kv_blocks, config.max_num_seqs) == (32, 50, 8)
    assert config.deterministic and not config.enable_prefix_caching and config.model == str(tiny_llama_dir)
    assert config.served_model_name == tiny_llama_dir.name and config.worker_id == "worker-a"
    with pytest.raises(ValueError, match="checkpoint"):
        cli_worker([], tmp_path)  # no config.json


async def test_kv_tier_flags_reach_the_engine_and_its_card(tiny_llama_dir: Path, tmp_path: Path) -> None:
    tiers = f"--host-cache-gb 0.01 --disk-cache-dir {tmp_path} --disk-cache-gb 0.02 --disk-cache-min-reuse 2"
    worker = cli_worker(["--device", "cpu", "--num-kv-blocks", "16", *tiers.split()], tiny_llama_dir)
    config = worker.config
    assert (config.host_cache_gb, config.disk_cache_dir, config.disk_cache_gb) == (0.01, str(tmp_path), 0.02)
    assert config.disk_cache_min_reuse == 2 and config.redis_url is None
    await worker.start()
    try:
        assert worker.engine.tiers is not None and worker.engine.tiers.disk_min_reuse == 2
        # Its weir_kvbm_* series carry the worker's instance id, as its weir_worker_* ones do.
        assert worker.engine.tiers.worker == "worker-a"
        assert set(worker.card.kv_tiers) == {"host", "disk"} and all(worker.card.kv_tiers.values())
        assert list(tmp_path.glob("*.slab"))  # the disk tier's file is there
    finally:
        await worker.stop()


@pytest.mark.slow
async def test_smollm2_knows_the_capital_of_france(smollm2_dir: Path) -> None:
    """Through the worker with the model's own chat template (the frontend's Preprocessor)."""
    from orchestrator.frontend.preprocessor import Preprocessor

    pre = Preprocessor.load(smollm2_dir)
    text = pre.render_chat(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    ids = pre.encode(text, add_special_tokens=False)
    w = DeepInferWorker(EngineConfig(model=str(smollm2_dir), device="cpu", num_kv_blocks=64))
    await w.start()
    try:
        req = WorkerRequest(
            request_id="paris",
            token_ids=ids,
            max_tokens=40,
            sampling=GREEDY,
            stop_token_ids=pre.eos_token_ids,
        )
        deltas = await collect(w.generate(req))
    finally:
        await w.stop()
    answer = pre.decode([t for d in deltas for t in d.token_ids])
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_smollm2_json_schema_through_the_openai_client(smollm2_dir: Path) -> None:
    """OpenAI client -> frontend -> DeepInfer worker: response_format json_schema, real model."""
    import json

    import jsonschema
    import openai

    from tests.frontend.live_frontend import MODEL, live_frontend

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "maxLength": 40},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    config = EngineConfig(model=str(smollm2_dir), served_model_name=MODEL, device="cpu", num_kv_blocks=128)
    with live_frontend(smollm2_dir, num_workers=1, engine_factory=lambda: DeepInferWorker(config)) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}],
            max_tokens=60,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
        )
    doc = json.loads(reply.choices[0].message.content or "")
    jsonschema.validate(doc, schema)
    assert reply.choices[0].finish_reason == "stop"
    assert "Paris" in doc["city"], doc
