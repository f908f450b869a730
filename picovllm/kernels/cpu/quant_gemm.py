"""Linear layers whose weights stay quantized (4 or 8 bits) on the CPU: quant_gemm.c, and the weights' layout.

QuantizedWeight holds one linear layer's weight as one or more segments of output rows (q, k and v of a fused
layer may come in different ggml types), each packed from gguf_quants.DecodedBlocks into the panels quant_gemm.c
reads (see its header). Its call quantizes the activations per block of 32 and runs integer dot products; any
number of rows (decode steps and prefill chunks alike). The kernel is built for AVX-512 (VNNI) where the CPU has
it, else AVX2 (isa(); PICOVLLM_CPU_ISA=avx2 forces the latter), and runs on torch's OpenMP threads.
"""
from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

from picovllm.kernels.cpu.build import ISA_FLAGS, compile_openmp_library, cpu_isas
from picovllm.loader.gguf_quants import DecodedBlocks

ROWS, BLOCK = 16, 32            # output rows per panel, elements per block (quant_gemm.c's QROWS, QBLOCK)
KINDS = {"q4": 1, "q8": 2}      # quant_gemm.c's QKIND_*
CODE_BYTES = {"q4": 256, "q8": 512}   # per panel and block
LAYOUT = "panels16-blocks32-v1"       # what a stored QuantizedSegment's bytes mean (engine-weights cache key)


class QSeg(ctypes.Structure):   # as in quant_gemm.c
    _fields_ = [("kind", ctypes.c_int64), ("scale_f32", ctypes.c_int64), ("n", ctypes.c_int64),
                ("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p)]


def preferred_isa() -> str | None:
    """PICOVLLM_CPU_ISA if set (ValueError if this CPU lacks it), else the best this CPU has; builds nothing."""
    forced = os.environ.get("PICOVLLM_CPU_ISA")
    if forced:
        if forced not in ISA_FLAGS:
            raise ValueError(f"PICOVLLM_CPU_ISA={forced!r} must be one of {sorted(ISA_FLAGS)}")
        if forced not in cpu_isas():
            raise ValueError(f"PICOVLLM_CPU_ISA={forced!r}: this CPU lacks it (it has: {', '.join(cpu_isas())})")
        return forced
    return next(iter(cpu_isas()), None)


def isa() -> str | None:
    """The instruction set the quantized kernels run with: preferred_isa() if forced, else the best of cpu_isas()
    whose build works; None where none does."""
    if os.environ.get("PICOVLLM_CPU_ISA"):
        return preferred_isa()
    return next((name for name in cpu_isas() if library(name) is not None), None)


@functools.lru_cache(maxsize=4)
def library(name: str) -> ctypes.CDLL | None:
    """quant_gemm.c built for ISA `name`; None if it does not build or load (no compiler, the CPU lacks it)."""
    if name not in cpu_isas():
        return None
    lib = compile_openmp_library("quant_gemm.c", None, ISA_FLAGS[name])
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.quant_gemm.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, i64, ptr, i64]
    lib.quant_gemm.restype = None
    lib.quant_activations.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
    lib.quant_activations.restype = None
    lib.quant_rows.argtypes = [ptr, i64, i64, ptr, i64, ptr]
    lib.quant_rows.restype = None
    lib.quant_gemm_isa.restype = i64
    assert lib.quant_gemm_isa() == (name == "avx512"), name
    return lib


@dataclass
class QuantizedSegment:
    """n output rows of a [n, k] weight in panels (quant_gemm.c's layout)."""
    kind: str                   # "q4" or "q8"
    n: int
    k: int
    codes: torch.Tensor         # uint8 [ceil(n / 16), k / 32, CODE_BYTES[kind]]
    scales: torch.Tensor        # float16 or float32 [ceil(n / 16), k / 32, 2, 16]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()


def pack(blocks: DecodedBlocks) -> QuantizedSegment:
    """DecodedBlocks [n, k] -> its panels (rows padded to a multiple of 16 with zeros)."""
    n, k = blocks.codes.shape
    pad = -n % ROWS
    codes = np.pad(blocks.codes, ((0, pad), (0, 0)))
    panels, nb = (n + pad) // ROWS, k // BLOCK
    g = codes.reshape(panels, ROWS, nb, 8, 4).transpose(0, 2, 3, 1, 4)     # [panel, block, group, row, 4]
    if blocks.kind == "q4":
        g = g[:, :, :4] | (g[:, :, 4:] << 4)
        pair = (blocks.scales, blocks.offsets)                             # per 32: d, m
    else:
        d = blocks.scales.reshape(n, nb, 2)
        pair = (d[..., 0], d[..., 1])                                      # per 16: first, second half
    scales = np.stack([np.pad(s, ((0, pad), (0, 0))).reshape(panels, ROWS, nb).transpose(0, 2, 1) for s in pair],
                      axis=2).astype(np.float32)
    with np.errstate(over="ignore"):
        narrow = scales.astype(blocks.scale_dtype)
        if np.array_equal(narrow.astype(np.float32), scales, equal_nan=True):   # float32 where float16 loses any
            scales = narrow                                                       # (Q4_0's -8 d past 65504)
    return QuantizedSegment(blocks.kind, n, k,
                            torch.from_numpy(np.ascontiguousarray(g).view(np.uint8).reshape(panels, nb, -1)),
                            torch.from_numpy(np.ascontiguousarray(scales)))


def unpack(seg: QuantizedSegment, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The segment's weight [n, k] (or those rows of it), float32: what pack() was given, dequantized."""
    rows = torch.arange(seg.n) if rows is None else rows
    p, lane = rows // ROWS, rows % ROWS
    nb = seg.k // BLOCK
    codes = seg.codes[p].view(len(rows), nb, -1, ROWS, 4)                 # [row, block, chunk, lane, 4]
    codes = codes[torch.arange(len(rows)), :, :, lane]                     # [row, block, chunk, 4]
    scales = seg.scales[p].float()[torch.arange(len(rows)), :, :, lane]    # [row, block, 2]
    if seg.kind == "q4":
        u = torch.cat([codes & 0x0F, codes >> 4], dim=2).reshape(len(rows), nb, BLOCK).float()
        w = u * scales[..., :1] + scales[..., 1:]
    else:
        q = codes.view(torch.int8).reshape(len(rows), nb, 2, 16).float()
        w = q * scales[..., None]
    return w.reshape(len(rows), seg.k)


class QuantizedWeight:
    """A linear layer's weight [sum of the segments' n, k], quantized: y = x @ W.T (+ bias) through quant_gemm.c."""

    def __init__(self, segments: list[QuantizedSegment], isa_name: str | None = None) -> None:
        """isa_name: the kernel build to run (default isa())."""
        if not segments or len({s.k for s in segments}) != 1:
            raise ValueError("QuantizedWeight: segments must be given and share their k")
        self.segments = segments
        self.out_features, self.in_features = sum(s.n for s in segments), segments[0].k
        self.isa = isa_name or isa()
        self.lib = library(self.isa) if self.isa else None
        if self.lib is None:
            raise RuntimeError(f"the quantized CPU kernel does not build here (isa {self.isa})")
        self.table = (QSeg * len(segments))(*[QSeg(KINDS[s.kind], s.scales.dtype == torch.float32, s.n,
                                                   s.codes.data_ptr(), s.scales.data_ptr()) for s in segments])

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[out_features, in_features] float32 (or those rows: the embedding's lookup, in C)."""
        if rows is None:
            return torch.cat([unpack(s) for s in self.segments])
        rows = rows.to(torch.int64).contiguous()
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= self.out_features):
            raise IndexError(f"row ids must be in [0, {self.out_features})")
        out = torch.empty(len(rows), self.in_features)
        self.lib.quant_rows(self.table, len(self.segments), self.in_features, rows.data_ptr(), len(rows),
                            out.data_ptr())
        return out

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        k = self.in_features
        if x.shape[-1] != k:
            raise ValueError(f"x has {x.shape[-1]} columns, the quantized weight {k}")
        x2 = x.reshape(-1, k).float().contiguous()
        m = x2.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        scratch = torch.empty(scratch_bytes(m, k), dtype=torch.uint8)
        bias = bias.detach().float().contiguous() if bias is not None else None
        self.lib.quant_gemm(self.table, len(self.segments), x2.data_ptr(), m, k,
                            bias.data_ptr() if bias is not None else None, y.data_ptr(), self.out_features,
                            scratch.data_ptr(), threads or torch.get_num_threads())
        return y.view(*x.shape[:-1], self.out_features)


REFINE_TOP = 8   # logits recomputed exactly per row after a quantized LM head (refine_top_logits)


def refine_top_logits(logits: torch.Tensor, hidden: torch.Tensor, weight: QuantizedWeight,
                      top: int = REFINE_TOP) -> torch.Tensor:
    """The `top` largest logits of each row recomputed from float32 `hidden` and the dequantized rows, in place.

    The int8 activations of a quantized LM head move each logit by ~1e-3 of its scale: enough, on a 135M model, to
    flip a greedy choice between two close candidates (the default model answered "What is the capital of
    France?" with something else than Paris). Exact logits for the few candidates that can win cost a few rows."""
    m, k = hidden.shape
    idx = logits.topk(min(top, logits.shape[1]), dim=1).indices
    rows = weight.dequantize(idx.reshape(-1)).view(m, -1, k)
    logits.scatter_(1, idx, torch.bmm(rows, hidden.float()[:, :, None])[:, :, 0])
    return logits


def scratch_bytes(m: int, k: int) -> int:
    """The scratch quant_gemm.c's quant_gemm takes for m rows of k: int8 codes, then scales and sums."""
    return -(-m * k // 64) * 64 + m * (k // BLOCK) * 3 * 4


def quantize_activations(x: torch.Tensor, isa_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k] float32 as the kernel quantizes it: (xq int8 [m, k], scales [m, k / 32], sums [m, k / 32, 2])."""
    m, k = x.shape
    x = x.float().contiguous()
    xq, xd = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // BLOCK)
    xs = torch.empty(m, k // BLOCK, 2, dtype=torch.int32)
    library(isa_name).quant_activations(x.data_ptr(), m, k, xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    return xq, xd, xs
