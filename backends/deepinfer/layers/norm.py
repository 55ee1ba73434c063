"""RMSNorm, computed in float32 like the reference implementations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' order: normalise in float32, cast back, then scale by the weight.
        # torch's fused rms_norm gives the same bits as the pow/mean/rsqrt chain on the CPU
        # (float32 and bfloat16), 2.2x faster on a 2,048-token prefill, and is one kernel
        # instead of five on a GPU, where a decode step's time is its kernel launches.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
