"""Layer-wise onboarding: loaded blocks arrive in the cache a layer at a time, and each layer of
the forward waits for exactly its own layer's blocks before it stores or attends.

The overlap this buys is measured in `benchmarks/kvbm_onboard.py`; here: what each layer sees
once its wait returns, that a real forward waits for every layer in order, that its output
equals a forward over blocks written beforehand, and that a loader failure reaches the step
instead of hanging it.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch

from backends.deepinfer.config import EngineConfig
from backends.deepinfer.kv_arrival import KVArrival
from backends.deepinfer.kv_cache import PagedKVCache
from backends.deepinfer.model_runner import ModelRunner
from backends.deepinfer.outputs import BlockLoad, ScheduledChunk, SchedulerOutput
from backends.deepinfer.sequence import Sequence
from orchestrator.runtime.protocol import SamplingOptions, WorkerRequest
from tests.deepinfer.device import DEVICE, DTYPE

BLOCK_SIZE = 4


def test_each_layer_is_complete_when_its_wait_returns() -> None:
    torch.manual_seed(0)
    source = PagedKVCache([torch.randn(6, BLOCK_SIZE, 2, 3) for _ in range(6)], [2, 2, 2])
    target = PagedKVCache([torch.zeros(6, BLOCK_SIZE, 2, 3) for _ in range(6)], [2, 2, 2])
    payloads = source.read_blocks([1, 4])
    arrival = target.start_write([3, 0], payloads)
    for layer in range(3):
        arrival.wait(layer)
        for i in (2 * layer, 2 * layer + 1):
            assert torch.equal(target.tensors[i][[3, 0]], source.tensors[i][[1, 4]])
    arrival.wait_all()
    assert target.read_blocks([3, 0]) == payloads


def test_layers_must_partition_the_tensors() -> None:
    tensors = [torch.zeros(2, BLOCK_SIZE, 3) for _ in range(4)]
    with pytest.raises(ValueError, match="partition"):
        PagedKVCache(tensors, [2, 1])
    with pytest.raises(ValueError, match="partition"):
        PagedKVCache(tensors, [4, 0])


def test_a_failed_load_wakes_every_waiter_with_its_error() -> None:
    arrival = KVArrival(3)
    arrival.mark_written(0)
    arrival.wait(0)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            arrival.wait(2)
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    arrival.fail(OSError("device lost"))
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0].__cause__, OSError)
    with pytest.raises(RuntimeError, match="loading KV blocks"):
        arrival.wait_all()


class RecordingArrival(KVArrival):
    """A real KVArrival that also records, for every instance made, the layers waited for."""

    made: list[RecordingArrival] = []

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        self.waits: list[int] = []
        self.made.append(self)

    def wait(self, layer: int) -> None:
        self.waits.append(layer)
        super().wait(layer)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_forward_waits_per_layer_and_matches_blocks_written_first(
    arch: str, tiny_llama_dir: Path, tiny_deepseek_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3-block prefix onboarded while its sequence's last 5 tokens prefill: every layer
    waits for its blocks, in layer order, and the logits equal those of the same step with
    the blocks written before the forward."""
    model_dir = tiny_llama_dir if arch == "llama" else tiny_deepseek_dir
    runner = ModelRunner(
        EngineConfig(
            model=str(model_dir), device=DEVICE, dtype=DTYPE, block_size=BLOCK_SIZE, num_kv_blocks=16
        )
    )
    rng = random.Random(0)
    tokens = [rng.randrange(3, 500) for _ in range(17)]
    seq = Sequence(
        WorkerRequest(
            request_id="a", token_ids=tokens, max_tokens=1, sampling=SamplingOptions(temperature=0.0)
        )
    )
    seq.block_table = [5, 2, 9, 7, 11]
    prefix = [5, 2, 9]
    full = SchedulerOutput(chunks=[ScheduledChunk(seq, 0, len(tokens), True)])
    runner.execute(full)  # computes the prefix's KV, to be offloaded and onboarded
    payloads = runner.kv_cache.read_blocks(prefix)
    for t in runner.kv_cache.tensors:
        t.zero_()
    runner.kv_cache.write_blocks(prefix, payloads)
    rest = SchedulerOutput(chunks=[ScheduledChunk(seq, 12, 5, True)])
    expected = runner.execute(rest)

    for t in runner.kv_cache.tensors:
        t.zero_()
    monkeypatch.setattr("backends.deepinfer.kv_cache.KVArrival", RecordingArrival)
    RecordingArrival.made.clear()
    rest.loads = [BlockLoad(b, "host", p) for b, p in zip(prefix, payloads, strict=True)]
    got = runner.execute(rest)
    [arrival] = RecordingArrival.made
    num_layers = runner.hf_config.num_hidden_layers
    # Each layer once in the forward, in order; then the step's closing wait_all.
    assert arrival.waits == [*range(num_layers), num_layers - 1]
    assert torch.equal(got, expected)
