"""The mocker's settings: one dataclass, defaults as NVIDIA Dynamo's mocker."""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.mocker.timing import TimingModel


@dataclass(slots=True)
class MockerConfig:
    model_name: str = "mocker"
    model_path: str | None = None  # tokenizer directory the frontend reads; the mocker never does
    num_blocks: int = 16_384
    block_size: int = 64
    max_num_batched_tokens: int = 8_192
    max_num_seqs: int = 256
    context_length: int = 32_768
    vocab_size: int = 32_000  # generated ids fall in [0, vocab_size): match the tokenizer
    speedup: float = 1.0  # wall time = simulated time / speedup; large means near-zero delay
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    timing: TimingModel = field(default_factory=TimingModel)

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError(f"speedup must be positive, got {self.speedup}")
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.context_length <= 0:
            raise ValueError(f"context_length must be positive, got {self.context_length}")
