"""The mocker's settings: one dataclass, defaults as NVIDIA Dynamo's mocker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from backends.mocker.timing import TimingModel

OutputLengthDistribution = Literal["lognormal", "geometric", "fixed"]
OUTPUT_LENGTH_DISTRIBUTIONS: tuple[str, ...] = get_args(OutputLengthDistribution)


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
    # Each request ends with EOS after a length drawn from its seed (unless ignore_eos), as a
    # model would, instead of running on to max_tokens. `weir serve`/`weir worker` set the
    # tokenizer's EOS ids; the first is the one emitted, and random tokens never hit any.
    output_length_mean: float = 200.0
    output_length_distribution: OutputLengthDistribution = "lognormal"
    output_length_sigma: float = 0.7  # lognormal's sigma: median = mean * exp(-sigma^2 / 2)
    eos_token_ids: list[int] = field(default_factory=lambda: [0])

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError(f"speedup must be positive, got {self.speedup}")
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
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
