"""Prefill attention of a chunk that follows a cached prefix, against attention computed the
plain way (every score, a causal mask offset by the prefix, float64), by each CPU path: SDPA's
flash kernel and the blocked oneDNN one (layers/cpu_attention.py), whichever this CPU would
pick."""

from __future__ import annotations

import pytest
import torch

from backends.deepinfer.layers import cpu_attention
from backends.deepinfer.layers.attention import prefill_attention


@pytest.fixture(autouse=True, params=["flash", "blocked"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    blocked = request.param == "blocked"
    monkeypatch.setattr(cpu_attention, "faster_than_flash", lambda *shape: blocked)
    if blocked:  # every size, the smallest too
        monkeypatch.setattr(cpu_attention, "MIN_SCORES", 0)
    return str(request.param)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[n, H, d]`, the last n of k's and v's L positions `[L, Hk, d]` -> `[n, H, d]`."""
    n, heads = q.shape[0], q.shape[1]
    length, group = k.shape[0], heads // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    visible = torch.ones(n, length, dtype=torch.bool).tril(diagonal=length - n)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", weights, v)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "n", "length"),
    [
        (9, 3, 112, 432),  # SmolLM2's grouped heads, a chat turn after its history
        (4, 4, 64, 65),  # one cached token
        (4, 2, 1, 50),  # a single query
        (6, 2, 300, 600),  # a chunk as long as its prefix
        (9, 3, 600, 900),  # several query blocks of the blocked path, the last one partial
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_after_a_cached_prefix_sees_the_prefix_and_itself_causally(
    heads: int, kv_heads: int, n: int, length: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(n + length)
    d, scale = 32, 32**-0.5
    # Large logits, so a merge of the two parts' softmax that lost their mass would show.
    q = (torch.randn(n, heads, d) * 3).to(dtype)
    k = (torch.randn(length, kv_heads, d) * 3).to(dtype)
    v = torch.randn(length, kv_heads, d).to(dtype)
    out = prefill_attention(q, k, v, scale)
    assert out.shape == (n, heads, d) and out.dtype == dtype
    tolerance = 3e-5 if dtype == torch.float32 else 3e-2  # float32: 900 keys with large logits
    torch.testing.assert_close(out.double(), reference(q, k, v, scale), atol=tolerance, rtol=0)


def test_a_whole_prompt_is_causal() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(40, 4, 16), torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    torch.testing.assert_close(
        prefill_attention(q, k, v, 0.25).double(), reference(q, k, v, 0.25), atol=1e-5, rtol=0
    )
