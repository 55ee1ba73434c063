"""Prefill attention on a CPU by oneDNN's matmul, a block of queries at a time.

Torch's CPU flash kernel (behind SDPA) multiplies by MKL's sgemm, which on an AMD CPU runs its
AVX2 code even where the CPU has AVX-512: on a Zen 5 machine here, SDPA reached 60-88 GFLOP/s
on SmolLM2's heads (1,000 to 8,000 tokens, one thread) and this path 130-170. On an Intel CPU
MKL is at home, and the flash kernel may be the faster; so `faster_than_flash` times the two
once per head shape in the running process, and the model runner uses this path only where it
wins.

For each KV head, the queries of the heads that share it (GQA) and of one block of positions
are one matrix: their scores against every key they may see are one matmul, a softmax (in base
2, normalised after the values), and a second matmul against the values. The block's own keys
are masked causally; a cached prefix before the chunk is simply more keys. A block's scores
are materialised (its group's rows by the context: 12 MB for SmolLM2 at 8,000 tokens), which
costs memory traffic a fused kernel would not.
"""

from __future__ import annotations

import functools
import math
import statistics
import time

import torch
import torch.nn.functional as F

# Of 64 to 1,024 queries a block, 128 was the fastest or level with the fastest at 1,000, 4,000
# and 8,000 tokens (SmolLM2's heads, one thread, one-off): 3-5 % ahead of 256 from 4,000 on,
# where a group's scores (3 x 128 rows by the context) stay nearer the core.
QUERY_BLOCK = 128
# Below this many scores per head (queries x keys), the blocked path's fixed cost (about 0.35 ms
# a layer for SmolLM2's three KV heads, where the flash kernel took 0.14-0.23 ms for up to 4
# queries over 300 keys) outweighs its faster matmuls: speculative verification and short
# chunks over short contexts stay with the flash kernel. One query over 4,000 keys or more is
# faster blocked (1.3 against 1.9 ms).
MIN_SCORES = 4096
# The calibration's size: long enough that attention outweighs the per-block overhead, short
# enough to cost well under a second at start-up.
_CALIBRATION_TOKENS = 1024

_matmul = torch.ops.mkldnn._linear_pointwise  # x @ w.T by oneDNN
LOG2_E = 1 / math.log(2)


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this path can take a call at all: float32 on a CPU with oneDNN."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def worth_it(num_queries: int, num_keys: int) -> bool:
    """Whether a call this size gains from the blocked path, where it is the faster one."""
    return num_queries * num_keys >= MIN_SCORES


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[n, H, d]` are the last n of the L positions in k `[L, Hk, d]`, v `[L, Hk, dv]`;
    query i sees keys 0 .. L - n + i. Returns `[n, H, dv]`."""
    n, num_heads, _ = q.shape
    length, num_kv_heads, dv = v.shape
    group = num_heads // num_kv_heads
    prefix = length - n
    # Scores in base 2: torch's exp2 runs several times faster than its exp on a CPU (and than
    # the exp inside its softmax), so the scale takes log2(e) too and the softmax is written out.
    qh = q.transpose(0, 1).mul(scale * LOG2_E).contiguous()  # [H, n, d], scaled once
    kh = k.transpose(0, 1).contiguous()  # [Hk, L, d]
    vh = v.transpose(0, 1).contiguous()  # [Hk, L, dv]
    out = q.new_empty(num_heads, n, dv)
    block = min(QUERY_BLOCK, n)
    causal = torch.full((block, block), float("-inf"), dtype=q.dtype).triu_(1)
    for h in range(num_kv_heads):
        heads = slice(h * group, (h + 1) * group)
        keys, values = kh[h], vh[h]
        for start in range(0, n, block):
            end = min(start + block, n)
            rows, seen = end - start, prefix + end
            queries = qh[heads, start:end].reshape(group * rows, -1)
            scores = _matmul(queries, keys[:seen], None, "none", [], "").view(group, rows, seen)
            scores[:, :, prefix + start : seen].add_(causal[:rows, :rows])
            weights = scores.view(group * rows, seen)
            weights.sub_(weights.amax(-1, keepdim=True)).exp2_()
            # values[:seen].t() is a transposed view, which oneDNN reads as it is (a column
            # slice of a transposed copy is another layout, which it copies at every call).
            part = _matmul(weights, values[:seen].t(), None, "none", [], "")
            out[heads, start:end] = part.div_(weights.sum(-1, keepdim=True)).view(group, rows, dv)
    return out.transpose(0, 1)


@functools.cache
def faster_than_flash(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `blocked_attention` beats SDPA's flash kernel on this CPU, at this head shape and
    the current thread count: each timed three times in turn, medians compared. Cached for the
    process."""
    tokens = _CALIBRATION_TOKENS
    q = torch.randn(tokens, num_heads, head_dim)
    k = torch.randn(tokens, num_kv_heads, head_dim)
    v = torch.randn(tokens, num_kv_heads, head_dim)
    scale = head_dim**-0.5

    def flash() -> None:
        # As `attention.prefill_attention` calls it on a CPU: on head-major copies.
        F.scaled_dot_product_attention(
            q.transpose(0, 1).contiguous().unsqueeze(0),
            k.transpose(0, 1).contiguous().unsqueeze(0),
            v.transpose(0, 1).contiguous().unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )

    def blocked() -> None:
        blocked_attention(q, k, v, scale)

    times: dict[str, list[float]] = {"flash": [], "blocked": []}
    for _ in range(4):  # the first round warms both up and is not counted
        for name, run in (("flash", flash), ("blocked", blocked)):
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return statistics.median(times["blocked"][1:]) < statistics.median(times["flash"][1:])
