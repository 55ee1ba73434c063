"""The mocker's settings: one dataclass, defaults as NVIDIA Dynamo's mocker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from backends.deepinfer.block_pool import Eviction, check_eviction
from backends.mocker.timing import TimingModel

OutputLengthDistribution = Literal["lognormal", "geometric", "fixed"]
OUTPUT_LENGTH_DISTRIBUTIONS: tuple[str, ...] = get_args(OutputLengthDistribution)


@dataclass(slots=True)
class MockerConfig:
    model_name: str = "mocker"
    worker_id: str = ""  # the serving worker's instance id: the `worker` of its weir_kvbm_* series
    model_path: str | None = None  # tokenizer directory the frontend reads; the mocker never does
    num_blocks: int = 16_384
    block_size: int = 64
    max_num_batched_tokens: int = 8_192
    max_num_seqs: int = 256
    context_length: int = 32_768
    vocab_size: int = 32_000  # generated ids fall in [0, vocab_size): match the tokenizer
    speedup: float = 1.0  # wall time = simulated time / speedup; large means near-zero delay
    enable_prefix_caching: bool = True
    kv_eviction: Eviction = "lru"  # DeepInfer's block pool's policy (block_pool.py)
    enable_chunked_prefill: bool = True
    timing: TimingModel = field(default_factory=TimingModel)
    # Each request ends with EOS after a length drawn from its seed (unless ignore_eos), as a
    # model would, instead of running on to max_tokens. `weir serve`/`weir worker` set the
    # tokenizer's EOS ids; the first is the one emitted, and random tokens never hit any.
    output_length_mean: float = 200.0
    output_length_distribution: OutputLengthDistribution = "lognormal"
    output_length_sigma: float = 0.7  # lognormal's sigma: median = mean * exp(-sigma^2 / 2)
    eos_token_ids: list[int] = field(default_factory=lambda: [0])
    # KV tiers below the simulated device (kvbm): blocks per tier, 0 for none. Onboarding a
    # block costs its bytes over the tier's bandwidth, pipelined layer by layer with the step
    # that loads it (TimingModel.with_loads), as DeepInfer onboards; the write-through offload
    # overlaps compute, as it does in a real engine, and costs nothing.
    host_cache_blocks: int = 0
    disk_cache_blocks: int = 0
    # Llama-3-8B in bf16: 32 layers x 2 x 8 KV heads x 128 x 2 bytes per token.
    kv_bytes_per_token: int = 131_072
    num_layers: int = 32
    host_bandwidth_gbps: float = 25.0  # host -> device copies (PCIe 4.0 x16, pinned)
    disk_bandwidth_gbps: float = 5.0  # one local NVMe drive
    remote_bandwidth_gbps: float = 12.5  # a shared store over 100 Gb/s networking
    # Disaggregation: a decode request waits for its prompt's KV from the prefill worker for
    # its bytes over this bandwidth (RDMA into the device over a 200 Gb/s NIC), then loads it
    # as prefix hits at no further cost.
    transfer_bandwidth_gbps: float = 25.0

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError(f"speedup must be positive, got {self.speedup}")
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.host_cache_blocks < 0 or self.disk_cache_blocks < 0:
            raise ValueError("host_cache_blocks and disk_cache_blocks must not be negative")
        if self.disk_cache_blocks and not self.host_cache_blocks:
            raise ValueError("a disk tier needs a host tier above it (host_cache_blocks)")
        if not (
            self.host_bandwidth_gbps > 0
            and self.disk_bandwidth_gbps > 0
            and self.remote_bandwidth_gbps > 0
            and self.transfer_bandwidth_gbps > 0
        ):
            raise ValueError("tier bandwidths must be positive")
        check_eviction(self.kv_eviction)
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {self.num_layers}")
        if self.context_length <= 0:
            raise ValueError(f"context_length must be positive, got {self.context_length}")
        if not self.output_length_mean >= 1:
            raise ValueError(f"output_length_mean must be at least 1, got {self.output_length_mean}")
        if self.output_length_distribution not in OUTPUT_LENGTH_DISTRIBUTIONS:
            raise ValueError(
                f"output_length_distribution must be one of {', '.join(OUTPUT_LENGTH_DISTRIBUTIONS)}, "
                f"got {self.output_length_distribution!r}"
            )
        if self.output_length_sigma < 0:
            raise ValueError(f"output_length_sigma must not be negative, got {self.output_length_sigma}")
        if not self.eos_token_ids or not all(0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be ids in [0, vocab_size), got {self.eos_token_ids}")
        if len(set(self.eos_token_ids)) >= self.vocab_size:
            raise ValueError("eos_token_ids must leave some of the vocabulary for ordinary tokens")
