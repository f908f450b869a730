from __future__ import annotations

import torch
from torch import nn

from picovllm.kernels.cpu import elementwise as cpu


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; with a residual it first adds it (returning the new residual)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda:   # one fused Triton pass; this torch code is its reference
            from picovllm.kernels.rmsnorm import rms_norm
            return rms_norm(x, self.weight, self.eps, residual)
        if cpu.usable(x, self.weight, *(() if residual is None else (residual,))):   # one C pass
            return cpu.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
