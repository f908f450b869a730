from __future__ import annotations

import functools

import torch
from torch import nn

from picovllm import kernels
from picovllm.distributed import SINGLE, TPGroup
from picovllm.kernels.cpu import elementwise as cpu


@functools.cache
def _triton():
    """kernels.rmsnorm, imported at the first CUDA call (it imports triton). Cached: an import statement in
    forward costs about a microsecond, at every norm of every layer of every step."""
    from picovllm.kernels import rmsnorm
    return rmsnorm


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; with a residual it first adds it (returning the new residual).
    offset: added to the checkpoint's weight once, at load (Gemma's norms scale by 1 + weight)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        if offset:
            self.offset = offset
            self.weight.weight_loader = self.load

    def load(self, param: nn.Parameter, w: torch.Tensor, shard: object = None, name: str = "") -> None:
        if w.shape != param.shape:
            raise ValueError(f"weight {name}: shape mismatch, model expects {tuple(param.shape)}, "
                             f"checkpoint has {tuple(w.shape)}")
        param.data.copy_(w.float() + self.offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if kernels.use_triton(x):   # one fused Triton pass; this torch code is its reference
            return _triton().rms_norm(x, self.weight, self.eps, residual)
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


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole projection's features (OLMo 2's q and k norms: every head's dims together), computed in
    float32. Under tensor parallelism a rank holds features [start, start + dim) of `total` (its heads'): it sums its
    squares, all-reduces the sum (divided by `replicas` where each feature lives on that many ranks: KV heads
    replicated over the ranks) and scales its own features by its slice of the weight."""

    def __init__(self, total: int, start: int, dim: int, eps: float, tp: TPGroup = SINGLE, replicas: int = 1) -> None:
        super().__init__()
        self.total, self.start, self.eps, self.tp, self.replicas = total, start, eps, tp, replicas
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.weight.weight_loader = self.load

    def load(self, param: nn.Parameter, w: torch.Tensor, shard: object = None, name: str = "") -> None:
        if tuple(w.shape) != (self.total,):
            raise ValueError(f"weight {name}: shape mismatch, model expects ({self.total},), checkpoint has "
                             f"{tuple(w.shape)}")
        param.data.copy_(w.narrow(0, self.start, len(param)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        squares = h.pow(2).sum(-1, keepdim=True)
        if self.tp.size > 1:
            squares = self.tp.all_reduce(squares) / self.replicas
        return self.weight * (h * torch.rsqrt(squares / self.total + self.eps)).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with a weight and no bias (Cohere's), computed in float32; with a residual it first adds it
    (returning the new residual), as RMSNorm does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        h = torch.nn.functional.layer_norm(x.float(), x.shape[-1:], self.weight.float(), None, self.eps)
        out = h.to(x.dtype)
        return out if residual is None else (out, residual)

