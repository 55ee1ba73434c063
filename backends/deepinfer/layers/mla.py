"""DeepSeek multi-head latent attention (MLA) over a compressed paged cache.

Per token the cache holds one latent entry, `[c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]`:
the normalized compressed KV and the roped shared key, instead of per-head K and V. With
r = kv_lora_rank and W_UK, W_UV the two halves of kv_b_proj (per head):

- prefill chunks expand the latents of their context into per-head K = [W_UK c | k_pe] and
  V = W_UV c and run ordinary causal attention (cheaper when many queries share the context);
- decode tokens use absorbed projections: q_nope . (W_UK c) = (W_UK^T q_nope) . c, so each
  head's query becomes `[W_UK^T q_nope | q_pe]` and attends directly over the latents
  (multi-query attention with one shared key/value head); the output `o . c` is lifted back
  through W_UV. Nothing per head is materialized for the context.
"""

from __future__ import annotations

import torch
from torch import nn

from backends.deepinfer.forward_batch import ForwardBatch, PrefillSpan
from backends.deepinfer.hf_config import HFConfig
from backends.deepinfer.layers.attention import decode_attention, gather, prefill_attention, store
from backends.deepinfer.layers.linear import Linear
from backends.deepinfer.layers.norm import RMSNorm
from backends.deepinfer.layers.rotary import RotaryEmbedding, rope_from_config, yarn_mscale

# DeepSeek's latent norms use the RMSNorm default, not the model's rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


def mla_rope(config: HFConfig, max_positions: int) -> RotaryEmbedding:
    """The rotation of the `qk_rope_head_dim` part, one table shared by the model's layers."""
    interleaved = bool(config.get("rope_interleave", True))
    return rope_from_config(config.rope_parameters, config.qk_rope_head_dim, max_positions, interleaved)


class MLAttention(nn.Module):
    def __init__(self, config: HFConfig, rotary_emb: RotaryEmbedding) -> None:
        """`rotary_emb`: the model's `mla_rope`."""
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = heads
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = (
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
        )
        qk_dim = self.nope_dim + self.rope_dim
        bias = bool(config.get("attention_bias", False))
        self.q_lora_rank = config.get("q_lora_rank")
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * qk_dim)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, heads * qk_dim)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        # Its weight is also read whole, split into the absorbed projections of `_decode`.
        self.kv_b_proj = Linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), packable=False)
        self.o_proj = Linear(heads * self.v_dim, hidden, bias=bias)

        rope = config.rope_parameters
        self.rotary_emb = rotary_emb
        self.scale = qk_dim**-0.5
        if rope["rope_type"] == "yarn" and rope.get("mscale_all_dim"):
            self.scale *= yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
        self.cache_layer = 0  # this layer's place among the model's cache layers (KVArrival.wait)
        self.kv_cache = torch.empty(0)

    def cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        return (self.kv_lora_rank + self.rope_dim) * dtype.itemsize

    def allocate_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.kv_cache = torch.zeros(
            num_blocks, block_size, self.kv_lora_rank + self.rope_dim, dtype=dtype, device=device
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        latent = torch.cat((self.kv_a_layernorm(c_kv), k_pe.squeeze(1)), dim=-1)
        if batch.kv_arrival is not None:
            batch.kv_arrival.wait(self.cache_layer)
        store(self.kv_cache, batch.slot_mapping, latent)

        out = x.new_empty(tokens, self.num_heads, self.v_dim)
        for span in batch.prefills:
            chunk = slice(span.begin, span.end)
            context = latent[chunk] if span.context_blocks is None else self._gather(span)
            out[chunk] = self._prefill(q_nope[chunk], q_pe[chunk], context)
        if batch.decode_index is not None:
            assert batch.decode_blocks is not None and batch.decode_plan is not None
            index, plan = batch.decode_index, batch.decode_plan
            out[index] = self._decode(q_nope[index], q_pe[index], batch.decode_blocks, plan.length, plan.mask)
        return self.o_proj(out.view(tokens, -1))

    def _gather(self, span: PrefillSpan) -> torch.Tensor:
        assert span.context_blocks is not None
        return gather(self.kv_cache, span.context_blocks, span.length)

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        length = context.shape[0]
        c_kv, k_pe = context.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(length, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)), dim=-1)
        return prefill_attention(torch.cat((q_nope, q_pe), dim=-1), k, v, self.scale)

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        blocks: torch.Tensor,
        length: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.nope_dim, self.v_dim], dim=1)
        q_latent = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
        context = gather(self.kv_cache, blocks, length).unsqueeze(2)  # [B, L, 1, r + rope]: one shared head
        o_latent = decode_attention(
            torch.cat((q_latent, q_pe), dim=-1), context, context[..., : self.kv_lora_rank], mask, self.scale
        )
        return torch.einsum("bhr,hvr->bhv", o_latent, w_uv)
