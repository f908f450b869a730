"""Rotary position embedding (the 'rotate half' layout of HF checkpoints), with Llama-3 or linear scaling."""
from __future__ import annotations

import math

import torch
from torch import nn

from picovllm.kernels.cpu import elementwise as cpu


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv.float()
    if scaling.get("rope_type") == "linear":   # positions divided by `factor`
        return (inv / scaling["factor"]).float()
    # Llama 3: long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    blend = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
    scaled = (1 - blend) * inv / factor + blend * inv
    return scaled.float()


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        inv = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D]."""
        if _c_path(q, k, positions, self.cos_sin):    # one C pass each (float32 on the CPU)
            return cpu.rope(q, positions, self.cos_sin), cpu.rope(k, positions, self.cos_sin)
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _c_path(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> bool:
    heads_contiguous = all(x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (q, k))
    return heads_contiguous and positions.dtype == torch.int64 and positions.device.type == "cpu" \
        and cos_sin.is_contiguous() and cpu.usable(q, k, cos_sin, contiguous=False)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
