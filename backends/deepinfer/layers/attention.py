"""Paged attention over a per-layer KV cache, in plain torch (CPU and CUDA alike).

The cache of a layer is `[num_blocks, block_size, *entry]`; a token at position p of a sequence
lives in slot `block_table[p // block_size] * block_size + p % block_size`. Each step first
writes the new tokens' entries into their slots, then attends: decode tokens together over
their padded contexts, prefill chunks one by one with a causal mask offset by the cached prefix.

Decode contexts are read from a per-layer workspace `[B, Hk, capacity, d]` kept across steps
(see `DecodePlan`): gathering every context out of the paged cache at every step and layer cost
as much as the attention itself on CPU, while a step of a stable batch adds one entry per row.
The head-major layout also lets the query heads that share a KV head attend as G queries of one
head, which is faster than SDPA's `enable_gqa` on CPU. (A paged-attention kernel reading blocks
in place would make the workspace unnecessary; its cost is a second copy of the decoding
sequences' KV, and a row's copy when a sequence joins or leaves the batch.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.deepinfer.forward_batch import DecodePlan, ForwardBatch, PrefillSpan, StaticDecode
from backends.deepinfer.layers import cpu_attention

# The CPU flash kernel behind SDPA, called directly for the log-sum-exp it also returns (it
# takes grouped KV heads as they are, as SDPA's enable_gqa does).
_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def store(cache: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor) -> None:
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, entries.to(cache.dtype))


def gather(cache: torch.Tensor, blocks: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """The entries of block tables `blocks` `[..., N]` -> `[..., N * block_size, *entry]`,
    cut to the first `length` positions when given."""
    # index_select on whole blocks as rows: ~5x faster on CPU than advanced indexing.
    rows = cache.view(cache.shape[0], -1).index_select(0, blocks.reshape(-1))
    entries = rows.view(*blocks.shape[:-1], blocks.shape[-1] * cache.shape[1], *cache.shape[2:])
    return entries if length is None else entries.narrow(blocks.dim() - 1, 0, length)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """q `[n, H, d]` are the last n of the L positions in k `[L, Hk, d]`, v `[L, Hk, dv]`;
    query i sees keys 0 .. L - n + i, or only the last `window` of those. Returns `[n, H, dv]`."""
    n, length = q.shape[0], k.shape[0]
    windowed = window is not None and length > window
    if (
        not windowed
        and cpu_attention.usable(q.device, q.dtype)
        and cpu_attention.worth_it(n, length)
        and cpu_attention.faster_than_flash(q.shape[1], k.shape[1], q.shape[2])
    ):
        return cpu_attention.blocked_attention(q, k, v, scale)
    # Head-major copies on CPU: its flash kernel runs 4-7 % faster on contiguous inputs
    # than on views of the fused projection (1,000 to 8,000 tokens), far more than the
    # copies cost; a GPU's kernels take the views as they are.
    on_cpu = q.device.type == "cpu"
    # 4-D, with a batch of one: on CPU, SDPA takes its flash kernel only for 4-D inputs; 3-D
    # ones fall to the math path, which materialises every score (7x slower at 2,048 tokens).
    qh, kh, vh = _heads_first(q, on_cpu), _heads_first(k, on_cpu), _heads_first(v, on_cpu)
    if n != length and not windowed and on_cpu and k.shape[-1] == v.shape[-1]:
        out = _after_cached_prefix(qh, kh, vh, scale)
    else:
        mask = None
        if n != length or windowed:
            ones = torch.ones(n, length, dtype=torch.bool, device=q.device)
            mask = ones.tril(diagonal=length - n)
            if windowed:
                assert window is not None
                mask &= ~ones.tril(diagonal=length - n - window)
        out = F.scaled_dot_product_attention(
            qh,
            kh,
            vh,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    return out.squeeze(0).transpose(0, 1)


def _after_cached_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """CPU attention of a chunk `q` `[1, H, n, d]` whose keys `k` `[1, Hk, L, d]` start with
    a prefix computed before it: every query sees the whole prefix, and the chunk's own keys
    causally. One masked call computes every score of the chunk's own square, then discards
    half of them (a quarter of the work when the chunk is as long as its prefix); two unmasked
    flash calls skip them, and their outputs merge by each part's share of the softmax mass
    (from the log-sum-exps the kernel returns). A 2,048-token chunk after 2,048 cached tokens
    took 18.4 s to its first token on SmolLM2, now 14.4 (`benchmarks/prefill.py --sizes 512
    2048 --cached-prefix 2048`); no shape down to 112 tokens after 320 got slower."""
    prefix = k.shape[2] - q.shape[2]
    out_prefix, lse_prefix = _flash_cpu(q, k[:, :, :prefix], v[:, :, :prefix], scale=scale)
    out_chunk, lse_chunk = _flash_cpu(q, k[:, :, prefix:], v[:, :, prefix:], is_causal=True, scale=scale)
    # exp(lse_prefix) / (exp(lse_prefix) + exp(lse_chunk)), without overflow
    share = torch.sigmoid(lse_prefix - lse_chunk).unsqueeze(-1).to(out_chunk.dtype)
    return torch.lerp(out_chunk, out_prefix, share)


def _heads_first(x: torch.Tensor, copy: bool) -> torch.Tensor:
    """`[L, H, d]` -> `[1, H, L, d]`, contiguous if `copy`."""
    x = x.transpose(0, 1)
    return (x.contiguous() if copy else x).unsqueeze(0)


def grouped_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One query per sequence: q `[B, H, d]` over head-major k, v `[B, Hk, L, d]`, `mask`
    `[B, 1, 1, L]` (None: all real). The G = H / Hk query heads of a KV head attend as G
    queries of that head (heads grouped as `enable_gqa` does). Returns `[B, H, d]`."""
    b, h, d = q.shape
    out = F.scaled_dot_product_attention(
        q.view(b, k.shape[1], h // k.shape[1], d), k, v, attn_mask=mask, scale=scale
    )
    return out.reshape(b, h, -1)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One query per sequence: q `[B, H, d]` over k `[B, L, Hk, d]`, v `[B, L, Hk, dv]`, with
    `mask` `[B, 1, 1, L]` marking real context (None: all real). Returns `[B, H, dv]`."""
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[2],
    )
    return out.squeeze(2)


class Attention(nn.Module):
    """Multi-head / grouped-query attention whose K and V live in the paged cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = (
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        )
        self.cache_layer = 0  # this layer's place among the model's cache layers (KVArrival.wait)
        self.sliding_window: int | None = None  # keys a query sees, itself included (set by the runner)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_decode = torch.empty(0)  # the decode workspaces, [B, Hk, capacity, d]
        self.v_decode = torch.empty(0)

    def cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtype.itemsize

    def allocate_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q `[T, H, d]`, k and v `[T, Hk, d]` for the batch's tokens -> `[T, H, d]`."""
        if batch.kv_arrival is not None:
            batch.kv_arrival.wait(self.cache_layer)
        store(self.k_cache, batch.slot_mapping, k)
        store(self.v_cache, batch.slot_mapping, v)
        if batch.static is not None:
            return self._static_decode(q, k, v, batch.static)
        out = torch.empty_like(q)
        for span in batch.prefills:
            keys, values = self._context(span, k, v)
            out[span.begin : span.end] = prefill_attention(
                q[span.begin : span.end], keys, values, self.scale, self.sliding_window
            )
        if batch.decode_index is not None:
            assert batch.decode_blocks is not None and batch.decode_plan is not None
            index, plan = batch.decode_index, batch.decode_plan
            self.k_decode = _workspace(self.k_decode, self.k_cache, batch.decode_blocks, plan, k[index])
            self.v_decode = _workspace(self.v_decode, self.v_cache, batch.decode_blocks, plan, v[index])
            b = index.shape[0]
            keys = self.k_decode[:b].narrow(2, 0, plan.length)
            values = self.v_decode[:b].narrow(2, 0, plan.length)
            mask = (
                plan.window_mask
                if self.sliding_window is not None and plan.window_mask is not None
                else plan.mask
            )
            out[index] = grouped_decode_attention(q[index], keys, values, mask, self.scale).to(q.dtype)
        return out

    def _static_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, static: StaticDecode
    ) -> torch.Tensor:
        keys, values = static.workspaces[self.cache_layer]
        keys[static.rows, :, static.positions] = k
        values[static.rows, :, static.positions] = v
        window = self.sliding_window is not None and static.window_mask is not None
        mask = static.window_mask if window else static.mask
        return grouped_decode_attention(q, keys, values, mask, self.scale).to(q.dtype)

    def _context(
        self, span: PrefillSpan, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if span.context_blocks is None:  # nothing cached before the chunk: use it as computed
            return k[span.begin : span.end], v[span.begin : span.end]
        blocks = span.context_blocks
        return gather(self.k_cache, blocks, span.length), gather(self.v_cache, blocks, span.length)


def _workspace(
    previous: torch.Tensor, cache: torch.Tensor, blocks: torch.Tensor, plan: DecodePlan, new: torch.Tensor
) -> torch.Tensor:
    """This step's decode workspace `[rows, Hk, capacity, d]` for the block tables `blocks`
    `[B, N]`: the previous one, updated in place, or reallocated to the plan's shape with
    what its first rows held, and the paged `cache`; `new` `[B, Hk, d]` are this step's
    entries. A workspace starts as zeros and only ever receives KV entries, so the
    masked-out positions past a row's context hold finite values, never a NaN (a masked NaN
    still poisons the softmax)."""
    if plan.move_from is not None:  # from rows past the batch: before a smaller copy drops them
        assert plan.move_to is not None
        previous.index_copy_(0, plan.move_to, previous.index_select(0, plan.move_from))
    heads, dim = cache.shape[2], cache.shape[3]
    workspace = previous
    if previous.shape != (plan.rows, heads, plan.capacity, dim):
        workspace = cache.new_zeros(plan.rows, heads, plan.capacity, dim)
        if previous.dim() == 4:
            rows, positions = min(previous.shape[0], plan.rows), min(previous.shape[2], plan.capacity)
            workspace[:rows, :, :positions] = previous[:rows, :, :positions]
    if plan.fresh is not None:
        gathered = gather(cache, blocks.index_select(0, plan.fresh), plan.length)  # [F, length, Hk, d]
        workspace[plan.fresh, :, : plan.length] = gathered.transpose(1, 2)
    if plan.append_rows is not None:
        workspace[plan.append_rows, :, plan.append_positions] = new.index_select(0, plan.append_rows)
    return workspace
