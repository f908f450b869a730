import functools

import torch
import torch.nn.functional as F
from torch import nn

from picovllm import kernels
from picovllm.kernels.cpu import elementwise as cpu


@functools.cache
def _triton():
    """kernels.activation, imported at the first CUDA call (cached: see layers.layernorm)."""
    from picovllm.kernels import activation
    return activation


class SiluAndMul(nn.Module):
    """x = [gate | up] -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.use_triton(x):   # one fused Triton pass; this torch code is its reference
            return _triton().silu_and_mul(x)
        if cpu.usable(x):   # one C pass (float32 on the CPU)
            return cpu.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """x = [gate | up] -> gelu(gate, tanh approximation) * up (Gemma's GeGLU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class ClampedSwiGLU(nn.Module):
    """GPT-OSS's experts: x = [gate | up] -> (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), with
    g = gate clamped above at limit (torch ops: elementwise, so a CUDA graph captures them)."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * gate * torch.sigmoid(gate * self.alpha)


def gated_activation(name: str) -> nn.Module:
    """ModelConfig.hidden_act -> the gated MLP's activation module."""
    return {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluAndMul}[name]()
