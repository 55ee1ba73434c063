"""Engine configuration: one dataclass, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from backends.deepinfer.block_pool import Eviction, check_eviction


@dataclass(slots=True)
class EngineConfig:
    model: str = ""  # checkpoint directory (config.json, *.safetensors, tokenizer.json)
    served_model_name: str = ""
    worker_id: str = ""  # the serving worker's instance id: the `worker` of its weir_kvbm_* series
    device: str = "auto"  # "auto" picks cuda when torch sees a GPU, else cpu
    dtype: str = "auto"  # "auto": bfloat16 on cuda, float32 on cpu
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: size from memory (kv_cache_memory_gb)
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 0  # 0: the checkpoint's context length
    enable_prefix_caching: bool = True
    # Which cached blocks go first when a fresh one is needed (block_pool.py): least recently
    # used, or segmented LRU, which keeps reused prefixes through a stream of one-off prompts.
    kv_eviction: Eviction = "lru"
    enable_chunked_prefill: bool = True
    deterministic: bool = False  # batch-invariant numerics: a seeded request ignores its batch
    enforce_eager: bool = False  # on a GPU, no CUDA graphs for decode steps (decode_graphs.py)
    seed: int = 0
    # KV tiers below the device cache (kvbm; kv_tiers.py). Host memory is the first of them:
    # 0 turns every tier off.
    host_cache_gb: float = 0.0
    disk_cache_dir: str | None = None
    disk_cache_gb: float = 0.0
    # A block evicted from host memory goes to disk only once it has been loaded back this
    # often: disk writes are the scarcest bandwidth, and most blocks are never reused.
    disk_cache_min_reuse: int = 1
    redis_url: str | None = None  # shared by every worker of the model
    # Speculative decoding: up to num_speculative_tokens draft tokens per decode step (0: off),
    # from a recurring suffix of prompt_lookup_min..prompt_lookup_max tokens (ngram.py), or from
    # the model's own multi-token-prediction layer (DeepSeek-V3's MTP, chained for more than one).
    speculative_method: Literal["ngram", "mtp"] = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.num_kv_blocks < 0:
            raise ValueError(f"num_kv_blocks must be >= 0, got {self.num_kv_blocks}")
        if self.host_cache_gb < 0 or self.disk_cache_gb < 0:
            raise ValueError("host_cache_gb and disk_cache_gb must be >= 0")
        if (self.disk_cache_dir or self.redis_url) and not self.host_cache_gb:
            raise ValueError("the disk and Redis KV tiers sit below the host tier: set host_cache_gb too")
        if self.disk_cache_dir and not self.disk_cache_gb:
            raise ValueError("disk_cache_dir needs disk_cache_gb")
        check_eviction(self.kv_eviction)
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.speculative_method not in ("ngram", "mtp"):
            raise ValueError(f"speculative_method must be ngram or mtp, got {self.speculative_method!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if not self.enable_prefix_caching and self.host_cache_gb:
            raise ValueError("KV tiers hold prefix-cached blocks: they need prefix caching on")
