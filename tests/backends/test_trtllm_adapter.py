"""The TensorRT-LLM adapter: requests, outputs, errors and KV events on payloads recorded from
TensorRT-LLM's source, and the real engine where TensorRT-LLM is installed.

The payloads follow TensorRT-LLM's LLM API (tensorrt_llm/...):
- sampling_params.py: SamplingParams fields (end_id, pad_id, max_tokens, min_tokens, top_k
  "None means ... 0, i.e., all logits", stop_token_ids, ignore_eos, detokenize, logprobs,
  guided_decoding) and GuidedDecodingParams (json, regex, grammar, json_object).
- executor/result.py: a streamed RequestOutput's first CompletionOutput grows (token_ids,
  logprobs as {token_id: Logprob(logprob, rank)} per token), finish_reason is one of stop,
  length, timeout, cancelled; GenerationResultBase.cached_tokens.
- _utils.py, KVCacheEventSerializer: {"event_id", "data", "window_size"} with data
  {"type": "stored", "parent_hash", "blocks": [{"type": "stored_block", "block_hash",
  "tokens": [{"type": "unique_token", "token_id", "token_extra_id"}], "cache_level",
  "priority"}]}, {"type": "removed", "block_hashes"}, {"type": "created",
  "num_blocks_per_cache_level"}, {"type": "updated", "block_hash", "cache_level", "priority"}.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from backends.adapter import prompt_tokens
from backends.kv_events import KvMirror
from backends.registry import add_backend_arguments, backend_spec
from backends.trtllm.args import trtllm_llm_args
from backends.trtllm.params import DeltaMaker, kv_fields, priority, sampling_kwargs
from orchestrator.runtime.errors import EngineError
from orchestrator.runtime.hashing import block_hashes
from orchestrator.runtime.protocol import (
    BlockRemoved,
    BlockStored,
    GuidedSpec,
    SamplingOptions,
    WorkerRequest,
)
from tests.backends.requests import request, wait_stored

BS = 4
TOKENS = list(range(300, 312))  # three blocks of 4
EOS = [2, 0]  # SmolLM2's generation_config: <|im_end|>, then <|endoftext|>


# --------------------------------------------------------------------------- requests


def test_a_full_request_becomes_sampling_params_with_the_models_end_id() -> None:
    req = request(
        sampling=SamplingOptions(
            temperature=0.6,
            top_p=0.95,
            top_k=0,
            min_p=0.1,
            seed=3,
            presence_penalty=0.2,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
        ),
        min_tokens=2,
        stop_token_ids=[77],
        logprobs=0,
    )
    assert sampling_kwargs(req, EOS) == {
        "end_id": 2,
        "pad_id": 2,
        "max_tokens": 10,
        "min_tokens": 2,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 0,  # all logits, as Weir's 0 means
        "min_p": 0.1,
        "seed": 3,
        "presence_penalty": 0.2,
        "frequency_penalty": 0.3,
        "repetition_penalty": 1.2,
        "stop_token_ids": [77, 0],  # the request's, then the model's other eos
        "ignore_eos": False,
        "detokenize": False,
        "logprobs": 1,  # at least one, so the sampled token's comes back
    }


def test_ignore_eos_keeps_the_other_eos_ids_out_of_the_stop_tokens() -> None:
    kwargs = sampling_kwargs(request(ignore_eos=True), EOS)
    assert kwargs["ignore_eos"] is True and kwargs["stop_token_ids"] is None


def test_migration_prefills_generated_tokens_and_counts_them_as_output() -> None:
    req = request(max_tokens=10, min_tokens=5, generated_token_ids=[40, 41, 42])
    assert prompt_tokens(req) == [5, 6, 7, 40, 41, 42]
    kwargs = sampling_kwargs(req, EOS)
    assert (kwargs["max_tokens"], kwargs["min_tokens"]) == (7, 2)


def test_weirs_priority_maps_monotonically_onto_trtllms_unit_interval() -> None:
    values = [priority(request(priority=p)) for p in (-100, -1, 0, 1, 100)]
    assert values[2] == 0.5  # TensorRT-LLM's default
    assert values == sorted(values, reverse=True) and all(0 < v < 1 for v in values)


@pytest.mark.parametrize(
    ("guided", "expected"),
    [
        (GuidedSpec(kind="json_schema", value='{"type": "integer"}'), {"json": '{"type": "integer"}'}),
        (GuidedSpec(kind="json_object"), {"json_object": True}),
        (GuidedSpec(kind="regex", value="[0-9]+"), {"regex": "[0-9]+"}),
        (GuidedSpec(kind="grammar", value='root ::= "a"'), {"grammar": 'root ::= "a"'}),
        (GuidedSpec(kind="choice", value=["x+y", "z"]), {"regex": r"(x\+y|z)"}),
    ],
)
def test_guided_specs_map_to_guided_decoding_params(guided: GuidedSpec, expected: dict[str, object]) -> None:
    assert sampling_kwargs(request(guided=guided), EOS)["guided_decoding"] == expected


@pytest.mark.parametrize(
    "req",
    [
        request(sampling=SamplingOptions(logit_bias={5: 1.0})),
        request(guided=GuidedSpec(kind="json_schema", value="{}"), generated_token_ids=[1]),
        request(max_tokens=2, generated_token_ids=[1, 2]),
        request(prefill_only=True),
    ],
    ids=["logit-bias", "guided-migration", "nothing-left", "prefill-only"],
)
def test_requests_trtllm_cannot_serve_are_invalid(req: WorkerRequest) -> None:
    with pytest.raises(EngineError) as refused:
        sampling_kwargs(req, EOS)
    assert refused.value.code == "invalid_request"


# --------------------------------------------------------------------------- outputs


@dataclass
class Logprob:
    """executor/result.py's Logprob."""

    logprob: float
    rank: int | None = None


@dataclass
class Completion:
    """The fields of executor/result.py's CompletionOutput the adapter reads."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob] | float] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Output:
    """A streamed RequestOutput: one object whose first completion grows."""

    outputs: list[Completion]
    cached_tokens: int = 0
    finished: bool = False


def test_a_growing_completion_becomes_deltas() -> None:
    maker = DeltaMaker(request())
    out = Output([Completion()], cached_tokens=2)
    deltas = []
    for new, done in (([31], False), ([32, 33], False), ([34], True)):
        out.outputs[0].token_ids.extend(new)
        out.finished = done
        out.outputs[0].finish_reason = "length" if done else None
        deltas.append(maker.delta(out))
    assert [d.token_ids for d in deltas] == [[31], [32, 33], [34]]
    assert [d.cached_tokens for d in deltas] == [2, None, None]
    assert [d.finish_reason for d in deltas] == [None, None, "length"]
    usage = deltas[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (
        3,
        4,
        2,
    )


@pytest.mark.parametrize(
    ("trt", "weir"), [("stop", "stop"), ("length", "length"), ("cancelled", "abort"), ("timeout", "abort")]
)
def test_finish_reasons_map_to_weirs(trt: str, weir: str) -> None:
    delta = DeltaMaker(request(generated_token_ids=[9])).delta(
        Output([Completion([31], finish_reason=trt)], finished=True)
    )
    assert delta.finish_reason == weir
    assert delta.usage is not None and delta.usage.completion_tokens == 2  # 1 migrated + 1


def test_logprob_maps_give_the_sampled_token_and_the_top_by_rank() -> None:
    maker = DeltaMaker(request(logprobs=1))
    out = Output(
        [
            Completion(
                [31, 40],
                [
                    {31: Logprob(-0.2, 1), 9: Logprob(-1.9, 2)},
                    {8: Logprob(-0.4, 1), 40: Logprob(-2.2, 3)},  # sampled below the top 1
                ],
            )
        ]
    )
    [first, second] = maker.delta(out).logprobs or []
    assert (first.token_id, first.logprob, [(t.token_id, t.logprob) for t in first.top]) == (
        31,
        -0.2,
        [(31, -0.2)],
    )
    assert (second.token_id, second.logprob, [(t.token_id, t.logprob) for t in second.top]) == (
        40,
        -2.2,
        [(8, -0.4)],
    )
    # The TRT backend's plain float per token: the sampled token's logprob alone.
    [plain] = DeltaMaker(request(logprobs=0)).delta(Output([Completion([5], [-0.7])])).logprobs or []
    assert (plain.token_id, plain.logprob, plain.top) == (5, -0.7, [])


def test_a_logprob_map_without_the_sampled_token_is_an_error() -> None:
    out = Output([Completion([31], [{8: Logprob(-0.4, 1)}])])
    with pytest.raises(EngineError) as missing:
        DeltaMaker(request(logprobs=1)).delta(out)
    assert missing.value.code == "internal"


# --------------------------------------------------------------------------- KV events


def block(block_hash: int, tokens: list[int], level: int = 0, extra: int = 0) -> dict[str, object]:
    return {
        "type": "stored_block",
        "block_hash": block_hash,
        "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": extra} for t in tokens],
        "cache_level": level,
        "priority": 35,
    }


def event(event_id: int, data: Mapping[str, object]) -> dict[str, object]:
    return {"event_id": event_id, "data": data, "window_size": 4096}


def test_stored_and_removed_events_are_mirrored_in_weirs_hashes() -> None:
    mirror = KvMirror(BS)
    created = event(0, {"type": "created", "num_blocks_per_cache_level": [1024, 0]})
    chain = [block(9001, TOKENS[:4]), block(9002, TOKENS[4:8]), block(9003, TOKENS[8:])]
    mirror.apply(kv_fields([created, event(1, {"type": "stored", "parent_hash": None, "blocks": chain})]))
    mirror.apply(kv_fields([event(2, {"type": "removed", "block_hashes": [9003, 424242]})]))
    stored, removed = mirror.take_events()
    weir = block_hashes(TOKENS, BS)
    assert stored.events == [BlockStored(blocks=weir, parent_seq_hash=None, tier="device")]
    assert removed.events == [BlockRemoved(seq_hashes=[weir[2]], tier="device")]
    assert mirror.snapshot().blocks == {"device": weir[:2]}


def test_a_stored_chain_under_a_known_parent_continues_it() -> None:
    mirror = KvMirror(BS)
    mirror.apply(
        kv_fields([event(1, {"type": "stored", "parent_hash": None, "blocks": [block(1, TOKENS[:4])]})])
    )
    mirror.apply(
        kv_fields([event(2, {"type": "stored", "parent_hash": 1, "blocks": [block(2, TOKENS[4:8])]})])
    )
    _, child = mirror.take_events()
    weir = block_hashes(TOKENS[:8], BS)
    assert child.events == [BlockStored(blocks=[weir[1]], parent_seq_hash=weir[0], tier="device")]


def test_cache_levels_become_tiers_and_a_removal_finds_either() -> None:
    gpu = event(1, {"type": "stored", "parent_hash": None, "blocks": [block(1, TOKENS[:4])]})
    host = event(2, {"type": "stored", "parent_hash": None, "blocks": [block(2, TOKENS[4:8], level=1)]})
    fields = kv_fields([gpu, host])
    assert [(f["block_hashes"], f["medium"]) for f in fields] == [([1], "GPU"), ([2], "CPU")]
    mirror = KvMirror(BS)
    mirror.apply(fields)
    # "removed" names no level: the block goes from whichever tier holds it.
    mirror.apply(kv_fields([event(3, {"type": "removed", "block_hashes": [2]})]))
    *_, removed = mirror.take_events()
    assert removed.events == [BlockRemoved(seq_hashes=block_hashes(TOKENS[4:8], BS), tier="host")]
    assert mirror.snapshot().blocks == {"device": block_hashes(TOKENS[:4], BS)}


def test_partial_blocks_extra_token_ids_and_updates_are_left_out() -> None:
    mirror = KvMirror(BS)
    partial = {"type": "stored", "parent_hash": None, "blocks": [block(1, TOKENS[:4]), block(2, TOKENS[4:6])]}
    mirror.apply(kv_fields([event(1, partial)]))
    [kept] = mirror.take_events()
    assert kept.events == [BlockStored(blocks=block_hashes(TOKENS[:4], BS), tier="device")]
    assert mirror.untranslated_blocks == 1  # the 2-token block
    multimodal = {"type": "stored", "parent_hash": None, "blocks": [block(3, TOKENS[:4], extra=17)]}
    updated = {
        "type": "updated",
        "block_hash": 1,
        "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
        "priority": {"type": "event_diff", "new_value": 35, "old_value": 35},
    }
    assert kv_fields([event(2, multimodal), event(3, updated)]) == []


# --------------------------------------------------------------------------- flags


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_backend_arguments(parser)
    return parser.parse_args(["--backend", "trtllm", *argv])


def test_shared_flags_become_llm_args(tmp_path: Path) -> None:
    args = parse(
        [
            "--block-size",
            "64",
            "--max-num-batched-tokens",
            "2048",
            "--trtllm-llm-args",
            '{"tensor_parallel_size": 2, "kv_cache_config": {"free_gpu_memory_fraction": 0.5}}',
        ]
    )
    assert trtllm_llm_args(args, tmp_path) == {
        "tensor_parallel_size": 2,
        "model": str(tmp_path),
        "max_num_tokens": 2048,
        "kv_cache_config": {"free_gpu_memory_fraction": 0.5, "tokens_per_block": 64},
    }
    spec = backend_spec("trtllm")
    assert spec.roles == ("aggregated",) and set(spec.defaults.values()) == {None}


def test_llm_args_the_adapter_owns_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(
            ["--trtllm-llm-args", '{"max_batch_size": 4, "kv_cache_config": {"enable_block_reuse": false}}']
        )
    err = capsys.readouterr().err
    assert "max_batch_size is set by --max-num-seqs" in err
    assert "kv_cache_config.enable_block_reuse is set by the adapter" in err


# --------------------------------------------------------------------------- the real engine


async def test_the_real_engine_streams_and_reports_its_cache() -> None:
    if importlib.util.find_spec("tensorrt_llm") is None:
        pytest.skip("tensorrt_llm is not installed: it needs NVIDIA GPUs (pip install tensorrt-llm)")
    from backends.deepinfer.smollm2 import ensure_default_model
    from backends.trtllm.engine import TrtllmWorker

    model = ensure_default_model()
    worker = TrtllmWorker(
        {"model": str(model), "kv_cache_config": {"tokens_per_block": 32, "free_gpu_memory_fraction": 0.2}},
        "smollm2",
    )
    await worker.start()
    try:
        assert (worker.card.backend, worker.card.block_size) == ("trtllm", 32)
        tokens = [100 + i * 37 % 5000 for i in range(3 * 32 + 1)]
        req = WorkerRequest(
            request_id="it1",
            token_ids=tokens,
            max_tokens=4,
            sampling=SamplingOptions(temperature=0.0),
            ignore_eos=True,
        )
        deltas = [d async for d in worker.generate(req)]
        assert sum(len(d.token_ids) for d in deltas) == 4 and deltas[-1].finish_reason == "length"
        await wait_stored(worker, block_hashes(tokens, 32))
    finally:
        await worker.stop()
