import torch
import torch.nn.functional as F
from torch import nn

from picovllm.kernels.cpu import elementwise as cpu


class SiluAndMul(nn.Module):
    """x = [gate | up] -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:   # one fused Triton pass; this torch code is its reference
            from picovllm.kernels.activation import silu_and_mul
            return silu_and_mul(x)
        if cpu.usable(x):   # one C pass (float32 on the CPU)
            return cpu.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """x = [gate | up] -> gelu(gate, tanh approximation) * up (Gemma's GeGLU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def gated_activation(name: str) -> nn.Module:
    """ModelConfig.hidden_act -> the gated MLP's activation module."""
    return {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluAndMul}[name]()
