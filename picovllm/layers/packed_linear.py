"""CPU fast path for float32 linear layers: oneDNN with each weight reordered once into its blocked layout.

On the CPU, torch's F.linear goes to MKL's sgemm, which re-packs the weight on every call; oneDNN
with a pre-packed weight is 10-40% faster at the shapes a decoder runs (measured on a 2-core AMD
EPYC, fp32). The packed copy sits next to the plain weight, which stays the source of truth (the
loader fills it, tied embeddings share it); pack after loading. Results equal F.linear up to fp32
summation order.
"""
from __future__ import annotations

import torch
from torch import nn


def onednn_packing_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedWeight:
    """y = x @ weight.T (+ bias) through oneDNN, with `weight` packed once."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
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
