"""The SGLang adapter: requests, outputs, errors and KV events on payloads recorded from
SGLang 0.5.23's source, and the real engine where SGLang is installed.

The payloads follow what SGLang 0.5.23 builds, file by file (python/sglang/srt/...):
- managers/tokenizer_manager.py, `_handle_batch_output`: a streamed output is
  {"text", "output_ids", "meta_info"}, `output_ids` cumulative unless
  --incremental-streaming-output; meta_info has id, finish_reason (None until the end),
  prompt_tokens, weight_version, num_retractions, reasoning_tokens, completion_tokens,
  cached_tokens, and with return_logprob output_token_logprobs (cumulative) of
  (logprob, token_id, text or None) and output_top_logprobs of such lists.
- managers/schedule_batch.py, FINISH_*.to_json: {"type": "length", "length": n},
  {"type": "stop", "matched": id}, {"type": "abort", "message", "status_code", "err_type"}.
- disaggregation/kv_events.py: events are tagged msgpack maps ("type" is the class name,
  None-valued optional fields omitted) in an array batch [ts, [events], attn_dp_rank];
  BlockStored has block_hashes, parent_block_hash, token_ids, block_size, lora_id and the
  optional medium ("GPU", "CPU_PINNED", "DISK", "EXTERNAL"), cache_salt, session_id,
  lora_name; mem_cache/events.py coalesces consecutive pages into one BlockStored.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from backends.kv_events import KvMirror, decode_batch
from backends.registry import add_backend_arguments, backend_spec
from backends.sglang.args import sglang_server_args
from backends.sglang.params import (
    DeltaMaker,
    abort_error,
    generate_kwargs,
    sampling_params,
)
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    GuidedSpec,
    KvTransfer,
    SamplingOptions,
    TokenDelta,
    WorkerRequest,
)
from tests.backends.requests import request, wait_stored

PAGE = 4
TOKENS = list(range(200, 212))  # three pages of 4


# --------------------------------------------------------------------------- requests


def test_a_full_request_becomes_sglangs_sampling_params() -> None:
    req = request(
        sampling=SamplingOptions(
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            seed=11,
            presence_penalty=0.5,
            frequency_penalty=0.25,
            repetition_penalty=1.1,
            logit_bias={42: -100.0, 7: 2.5},
        ),
        min_tokens=3,
        stop_token_ids=[99, 100],
        ignore_eos=True,
    )
    assert sampling_params(req) == {
        "max_new_tokens": 10,
        "min_new_tokens": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "stop_token_ids": [99, 100],
        "sampling_seed": 11,
        "logit_bias": {"42": -100.0, "7": 2.5},  # SGLang keys it by the id as a string
    }


def test_weirs_top_k_off_is_sglangs_minus_one() -> None:
    # sampling_params.py verify(): "top_k must be -1 (disable) or at least 1"; 0 is refused.
    assert sampling_params(request())["top_k"] == -1
    assert sampling_params(request(sampling=SamplingOptions(top_k=1)))["top_k"] == 1


def test_generate_kwargs_carry_ids_logprobs_priority_and_salt() -> None:
    kwargs = generate_kwargs(request(logprobs=3, priority=-2, cache_salt="tenant-a"))
    assert kwargs["input_ids"] == [5, 6, 7]
    assert (kwargs["rid"], kwargs["priority"], kwargs["cache_salt"]) == ("r1", -2, "tenant-a")
    assert (kwargs["return_logprob"], kwargs["top_logprobs_num"]) == (True, 3)
    plain = generate_kwargs(request())
    assert "return_logprob" not in plain and "cache_salt" not in plain


def test_migration_prefills_generated_tokens_and_counts_them_as_output() -> None:
    req = request(max_tokens=10, min_tokens=6, generated_token_ids=[50, 51, 52, 53])
    kwargs = generate_kwargs(req)
    assert kwargs["input_ids"] == [5, 6, 7, 50, 51, 52, 53]
    assert (kwargs["sampling_params"]["max_new_tokens"], kwargs["sampling_params"]["min_new_tokens"]) == (
        6,
        2,
    )
    with pytest.raises(EngineError) as done:
        sampling_params(request(max_tokens=4, generated_token_ids=[50, 51, 52, 53]))
    assert done.value.code == "invalid_request"


@pytest.mark.parametrize(
    ("guided", "expected"),
    [
        (GuidedSpec(kind="json_schema", value='{"type": "integer"}'), {"json_schema": '{"type": "integer"}'}),
        # As SGLang's own OpenAI server maps response_format json_object (serving_completions.py).
        (GuidedSpec(kind="json_object"), {"json_schema": '{"type": "object"}'}),
        (GuidedSpec(kind="regex", value="[a-z]+"), {"regex": "[a-z]+"}),
        (GuidedSpec(kind="grammar", value='root ::= "yes" | "no"'), {"ebnf": 'root ::= "yes" | "no"'}),
        (GuidedSpec(kind="choice", value=["a.b", "c d", "(e)"]), {"regex": r"(a\.b|c d|\(e\))"}),
    ],
)
def test_guided_specs_map_to_sglangs_constraint_fields(guided: GuidedSpec, expected: dict[str, str]) -> None:
    params = sampling_params(request(guided=guided))
    assert {k: params[k] for k in ("json_schema", "regex", "ebnf") if k in params} == expected


@pytest.mark.parametrize(
    "req",
    [
        request(guided=GuidedSpec(kind="choice", value="not a list")),
        request(guided=GuidedSpec(kind="regex")),
        request(guided=GuidedSpec(kind="regex", value="a+"), generated_token_ids=[1]),
        request(prefill_only=True),
        request(kv_transfer=KvTransfer(transfer_id="t")),
    ],
    ids=["choice-not-a-list", "regex-without-value", "guided-migration", "prefill-only", "kv-transfer"],
)
def test_requests_sglang_cannot_serve_are_invalid(req: WorkerRequest) -> None:
    with pytest.raises(EngineError) as refused:
        sampling_params(req)
    assert refused.value.code == "invalid_request" and not refused.value.retryable


# --------------------------------------------------------------------------- outputs


def meta(completion: int, finish: object = None, cached: int = 0, **extra: object) -> dict[str, object]:
    """meta_info as tokenizer_manager.py builds it for a streamed generate request."""
    return {
        "id": "r1",
        "finish_reason": finish,
        "prompt_tokens": 3,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": completion,
        "cached_tokens": cached,
        **extra,
    }


def test_cumulative_outputs_become_deltas_with_cached_tokens_first_and_usage_last() -> None:
    maker = DeltaMaker(request())
    outputs: list[dict[str, Any]] = [
        {"text": None, "output_ids": [31], "meta_info": meta(1, cached=2)},
        {"text": None, "output_ids": [31, 32, 33], "meta_info": meta(3, cached=2)},
        {
            "text": "x",
            "output_ids": [31, 32, 33, 34],
            "meta_info": meta(4, {"type": "length", "length": 4}, 2),
        },
    ]
    deltas = [maker.delta(out) for out in outputs]
    assert [d.token_ids for d in deltas] == [[31], [32, 33], [34]]
    assert [d.cached_tokens for d in deltas] == [2, None, None]
    assert [d.finish_reason for d in deltas] == [None, None, "length"]
    assert deltas[0].usage is None and deltas[-1].usage is not None
    assert (deltas[-1].usage.prompt_tokens, deltas[-1].usage.completion_tokens) == (3, 4)
    assert deltas[-1].usage.cached_tokens == 2


def test_a_matched_stop_token_ends_with_stop_and_counts_migrated_tokens() -> None:
    maker = DeltaMaker(request(generated_token_ids=[50, 51]))
    last = maker.delta({"output_ids": [60, 2], "meta_info": meta(2, {"type": "stop", "matched": 2}, 3)})
    assert last.token_ids == [60, 2] and last.finish_reason == "stop"
    assert last.usage is not None and last.usage.completion_tokens == 4  # 2 migrated + 2 here
    assert last.cached_tokens == 3


def test_logprobs_are_the_sampled_tokens_with_their_top_k() -> None:
    maker = DeltaMaker(request(logprobs=2))
    first = {
        "output_ids": [31],
        "meta_info": meta(
            1,
            output_token_logprobs=[(-0.1, 31, None)],
            output_top_logprobs=[[(-0.1, 31, None), (-2.5, 8, None)]],
        ),
    }
    second = {
        "output_ids": [31, 40],
        "meta_info": meta(
            2,
            {"type": "length", "length": 2},
            output_token_logprobs=[(-0.1, 31, None), (-3.0, 40, None)],
            output_top_logprobs=[[(-0.1, 31, None), (-2.5, 8, None)], [(-0.5, 9, None), (-1.0, 10, None)]],
        ),
    }
    a, b = maker.delta(first), maker.delta(second)
    assert a.logprobs is not None and b.logprobs is not None
    assert [(lp.token_id, lp.logprob) for lp in a.logprobs] == [(31, -0.1)]
    [sampled] = b.logprobs  # only the new position, though SGLang repeats the first
    assert (sampled.token_id, sampled.logprob) == (40, -3.0)
    assert [(t.token_id, t.logprob) for t in sampled.top] == [(9, -0.5), (10, -1.0)]


def test_sglangs_aborts_become_errors_by_status() -> None:
    bad = {"type": "abort", "message": "The input is too long", "status_code": 400, "err_type": None}
    with pytest.raises(EngineError) as invalid:
        DeltaMaker(request()).delta({"output_ids": [], "meta_info": meta(0, bad)})
    assert (invalid.value.code, invalid.value.message) == ("invalid_request", "The input is too long")
    full = abort_error({"type": "abort", "message": "queue full", "status_code": 503})
    assert full is not None and (full.code, full.retryable) == ("overloaded", True)
    crash = abort_error({"type": "abort", "message": "boom", "status_code": 500})
    assert crash is not None and crash.code == "internal"
    # A plain abort (abort_request, shutdown) carries no status: the request just ends.
    plain = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert abort_error(plain) is None
    delta = DeltaMaker(request()).delta({"output_ids": [31], "meta_info": meta(1, plain)})
    assert delta.finish_reason == "abort" and delta.token_ids == [31]


# --------------------------------------------------------------------------- KV events


def stored(
    hashes: list[int], tokens: list[int], parent: int | None = None, **extra: object
) -> dict[str, object]:
    """A BlockStored as SGLang 0.5.23 encodes it: a tagged map, None-valued optionals omitted."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": PAGE,
        "lora_id": None,
        "medium": "GPU",
        **extra,
    }


def frame(*events: dict[str, object]) -> bytes:
    """One published payload: EventBatch is an array [ts, events, attn_dp_rank]."""
    return msgspec.msgpack.encode([1796170000.5, list(events), 0])


def test_stored_pages_are_mirrored_in_weirs_hashes_and_removed_by_sglangs() -> None:
    mirror = KvMirror(PAGE)
    # mem_cache/events.py coalesces a node's consecutive pages into one event.
    mirror.apply(decode_batch(frame(stored([-11, -12, -13], TOKENS))))
    mirror.apply(decode_batch(frame({"type": "BlockRemoved", "block_hashes": [-13], "medium": "GPU"})))
    mirror.apply(decode_batch(frame({"type": "AllBlocksCleared"})))
    first, second, third = mirror.take_events()
    weir = block_hashes(TOKENS, PAGE)
    assert first.events == [BlockStored(blocks=weir, parent_seq_hash=None, tier="device")]
    assert second.events == [BlockRemoved(seq_hashes=[weir[2]], tier="device")]
    assert third.events == [AllCleared()]
    assert [b.event_id for b in (first, second, third)] == [1, 2, 3]


def test_a_child_node_chains_to_its_parent_page() -> None:
    mirror = KvMirror(PAGE)
    mirror.apply([stored([-11], TOKENS[:4])])
    mirror.apply([stored([-12, -13], TOKENS[4:], parent=-11)])
    _, child = mirror.take_events()
    weir = block_hashes(TOKENS, PAGE)
    assert child.events == [BlockStored(blocks=weir[1:], parent_seq_hash=weir[0], tier="device")]


def test_a_salted_prompts_blocks_carry_the_salt_in_weirs_hash() -> None:
    mirror = KvMirror(PAGE)
    mirror.apply([stored([-21, -22], TOKENS[:8], cache_salt="tenant-a", session_id="s9")])
    mirror.apply([stored([-23], TOKENS[8:], parent=-22, cache_salt="tenant-a")])
    salted = block_hashes(TOKENS, PAGE, "tenant-a")
    assert salted != block_hashes(TOKENS, PAGE)
    assert [
        h for b in mirror.take_events() for e in b.events if isinstance(e, BlockStored) for h in e.blocks
    ] == salted


def test_sglangs_media_map_to_tiers() -> None:
    mirror = KvMirror(PAGE)
    mirror.apply([stored([-31], TOKENS[:4], medium="CPU_PINNED")])
    mirror.apply([stored([-32], TOKENS[4:8], medium="DISK")])
    mirror.apply([stored([-33], TOKENS[8:], medium="EXTERNAL")])
    mirror.apply([{"type": "BlockRemoved", "block_hashes": [-31], "medium": "CPU_PINNED"}])
    host, disk, remote, removed = mirror.take_events()
    assert remote.events == [BlockStored(blocks=block_hashes(TOKENS[8:], PAGE), tier="remote")]
    assert host.events == [BlockStored(blocks=block_hashes(TOKENS[:4], PAGE), tier="host")]
    assert disk.events == [BlockStored(blocks=block_hashes(TOKENS[4:8], PAGE), tier="disk")]
    assert removed.events == [BlockRemoved(seq_hashes=block_hashes(TOKENS[:4], PAGE), tier="host")]
    assert mirror.snapshot().blocks == {
        "disk": block_hashes(TOKENS[4:8], PAGE),
        "remote": block_hashes(TOKENS[8:], PAGE),  # HiCache's shared storage backend
    }


def test_partial_pages_and_lora_pages_are_left_out() -> None:
    mirror = KvMirror(PAGE)
    # The last page of a node shorter than a page: block_size is its length (events.py).
    mirror.apply([stored([-41], TOKENS[:2], block_size=2)])
    mirror.apply([stored([-42], TOKENS[:4], lora_name="adapter-1")])
    assert mirror.take_events() == [] and mirror.untranslated_blocks == 2


# --------------------------------------------------------------------------- flags


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_backend_arguments(parser)
    return parser.parse_args(["--backend", "sglang", *argv])


def test_shared_flags_become_server_args_and_priority_runs_lower_first(tmp_path: object) -> None:
    args = parse(
        ["--block-size", "16", "--max-num-seqs", "8", "--sglang-server-args", '{"mem-fraction-static": 0.4}']
    )
    fields = sglang_server_args(args, tmp_path, "smol")  # type: ignore[arg-type]
    assert fields == {
        "enable_priority_scheduling": True,
        "schedule_low_priority_values_first": True,
        "default_priority_value": 0,
        "mem_fraction_static": 0.4,
        "model_path": str(tmp_path),
        "served_model_name": "smol",
        "page_size": 16,
        "max_running_requests": 8,
    }
    spec = backend_spec("sglang")
    assert spec.roles == ("aggregated",) and set(spec.defaults.values()) == {None}


def test_server_args_the_adapter_owns_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--sglang-server-args", '{"page_size": 32, "kv-events-config": "{}"}'])
    err = capsys.readouterr().err
    assert "kv_events_config is set by the adapter" in err and "page_size is set by --block-size" in err


# --------------------------------------------------------------------------- the real engine


async def test_the_real_engine_streams_and_reports_its_cache() -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip(
            "sglang is not installed: it targets GPUs (its CPU engine needs a source build of "
            "sgl-kernel and SGLANG_USE_CPU_ENGINE=1)"
        )
    from backends.deepinfer.smollm2 import ensure_default_model
    from backends.sglang.engine import SglangWorker

    model = ensure_default_model()
    args = {"model_path": str(model), "page_size": PAGE, "mem_fraction_static": 0.3}
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        args["device"] = "cpu"
    worker = SglangWorker(args, "smollm2")
    await worker.start()
    try:
        assert (worker.card.backend, worker.card.block_size) == ("sglang", PAGE)
        tokens = [100 + i * 37 % 5000 for i in range(3 * PAGE + 1)]
        req = WorkerRequest(
            request_id="it1",
            token_ids=tokens,
            max_tokens=4,
            sampling=SamplingOptions(temperature=0.0),
            ignore_eos=True,
        )
        stream: AsyncIterator[TokenDelta] = worker.generate(req)
        deltas = [d async for d in stream]
        assert sum(len(d.token_ids) for d in deltas) == 4 and deltas[-1].finish_reason == "length"
        assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == 4
        await wait_stored(worker, block_hashes(tokens, PAGE))
    finally:
        await worker.stop()
