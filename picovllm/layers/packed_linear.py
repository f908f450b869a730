"""CPU fast path for float32 linear layers: each weight packed once, oneDNN for many rows, a C kernel for few.

On the CPU, torch's F.linear goes to MKL's sgemm, which re-packs the weight on every call; oneDNN
with a pre-packed weight is 10-40% faster at the shapes a decoder runs (measured on a 2-core AMD
EPYC, fp32). At decode (a few rows, one per running sequence) the time is the weights streaming
from memory, where oneDNN reaches about half the bandwidth: there the small-M kernel of
picovllm/kernels/cpu/small_gemm.py, with its own panel-packed copy of the weight, is 1.3-1.7x faster
at M <= 32 and still ahead up to a few hundred rows (same machine; benchmarks/cpu_small_gemm.py).
Keeping both copies doubles the packed weights' memory (about 540 MB more for SmolLM2-135M). The
packed copies sit next to the plain weight, which stays the source of truth (the loader fills it,
tied embeddings share it); pack after loading. Results equal F.linear up to fp32 summation order.
"""
from __future__ import annotations

import torch
from torch import nn

from picovllm.kernels.cpu import small_gemm

SMALL_M = 256   # rows up to which small_gemm is used: 1.07x oneDNN at 256, even at 512, 0.98x at 1024 (2-core EPYC)


def onednn_packing_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedWeight:
    """y = x @ weight.T (+ bias) with `weight` packed once: through small_gemm for up to `small_m` rows
    (where its C kernel builds), else through oneDNN."""

    def __init__(self, weight: torch.Tensor, small_m: int = SMALL_M) -> None:
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.out_features = weight.shape[0]
        self.small_m = small_m
        self.panels = small_gemm.pack_panels(weight) if small_m > 0 and small_gemm.available() else None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.panels is not None and rows <= self.small_m and x.dtype == torch.float32:
            y = small_gemm.small_gemm(x.reshape(rows, x.shape[-1]), self.panels, self.out_features, bias)
            return y.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")


def pack_linear_weights(model: nn.Module) -> int:
    """Give every module with a `packed` slot (linear layers, LM head) a packed copy of its weight.

    Only for float32 weights on the CPU; returns how many modules were packed.
    """
    if not onednn_packing_available():
        return 0
    n = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if hasattr(m, "packed") and w is not None and w.device.type == "cpu" and w.dtype == torch.float32:
            m.packed = PackedWeight(w)
            n += 1
    return n
