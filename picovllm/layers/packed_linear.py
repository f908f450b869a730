"""CPU fast path for float32 linear layers: each weight packed once, oneDNN for many rows, a C kernel for few.

On the CPU, torch's F.linear goes to MKL's sgemm, which re-packs the weight on every call; oneDNN
with a pre-packed weight is 10-40% faster at the shapes a decoder runs (measured on a 2-core AMD
EPYC, fp32). At decode (a few rows, one per running sequence) the time is the weights streaming
from memory, where oneDNN reaches about half the bandwidth: there the small-M kernel of
picovllm/kernels/cpu/small_gemm.py, with its own panel-packed copy of the weight, is 1.3-1.7x faster
at M <= 32 and still ahead up to a few hundred rows (same machine; benchmarks/cpu_small_gemm.py).
The panels are packed at load time; the oneDNN copy when a step first has more than small_m rows
(both copies cost about 540 MB each for SmolLM2-135M). The packed copies sit next to the plain weight,
which stays the source of truth (the loader fills it, tied embeddings share it); pack after loading.
Results equal F.linear up to fp32 summation order.
"""
from __future__ import annotations

from typing import Iterator

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

    def __init__(self, weight: torch.Tensor, small_m: int = SMALL_M, panels: torch.Tensor | None = None,
                 panel_dtype: torch.dtype = torch.float32) -> None:
        """panels: pack_panels(weight) made earlier (the engine-weights cache), else packed here, in panel_dtype.
        bfloat16 (quantization="bf16"): the weight itself is rounded to bfloat16 values first, in place, so that
        every path (these panels, oneDNN for long prompts) computes with the same weights; the panels are half
        the bytes a decode step reads, and the sums stay float32."""
        if panels is None and panel_dtype == torch.bfloat16:
            weight.data.copy_(weight.detach().to(torch.bfloat16))
        self.source = weight
        self.out_features = weight.shape[0]
        self.small_m = small_m
        if panels is None and small_m > 0 and small_gemm.available():
            panels = small_gemm.pack_panels(weight, panel_dtype)
        self.panels = panels if small_m > 0 else None
        self._onednn: torch.Tensor | None = None   # packed on the first call with more than small_m rows

    @property
    def weight(self) -> torch.Tensor:
        """The oneDNN-packed copy, made when first needed: a server that never sees a long prompt, or a
        short `generate`, does not pay for it (about 0.5 s and 540 MB for SmolLM2-135M)."""
        if self._onednn is None:
            self._onednn = torch.ops.mkldnn._reorder_linear_weight(self.source.detach(), None)
        return self._onednn

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.panels is not None and rows <= self.small_m and x.dtype == torch.float32:
            y = small_gemm.small_gemm(x.reshape(rows, x.shape[-1]), self.panels, self.out_features, bias)
            return y.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")


def packed_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every module with a `packed` slot (linear layers, LM head) and a float32 CPU weight."""
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if hasattr(m, "packed") and w is not None and w.device.type == "cpu" and w.dtype == torch.float32:
            yield name, m


def pack_linear_weights(model: nn.Module, panels: dict[str, torch.Tensor] | None = None,
                        panel_dtype: torch.dtype = torch.float32) -> int:
    """Give every packed_modules() module a packed copy of its weight, taking its panels from `panels`
    (module name -> pack_panels result) where given, else packing them in panel_dtype. A no-op without
    oneDNN; returns how many were packed."""
    if not onednn_packing_available():
        return 0
    n = 0
    for name, m in packed_modules(model):
        m.packed = PackedWeight(m.weight, panels=(panels or {}).get(name), panel_dtype=panel_dtype)
        n += 1
    return n
