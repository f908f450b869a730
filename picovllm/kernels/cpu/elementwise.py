"""RMSNorm (+ residual add), SiLU-and-mul and rotary embedding on the CPU in float32, through elementwise.c.

Used by picovllm/layers (RMSNorm, SiluAndMul, RotaryEmbedding) for contiguous float32 CPU tensors when the library
builds; their torch code stays the reference (tests/test_cpu_elementwise.py). Rows are split between
torch's threads once a call has enough of them to pay for the hand-off.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from picovllm.kernels.cpu.build import compile_library, run_split

MIN_ELEMENTS_PER_THREAD = 1 << 16


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = compile_library("elementwise.c")
    if lib is None:
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.rms_norm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, f32, i64, i64]
    lib.silu_mul.argtypes = [ptr, ptr, i64, i64, i64]
    lib.rope.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64]
    lib.rms_norm.restype = lib.silu_mul.restype = lib.rope.restype = None
    return lib


def available() -> bool:
    return _library() is not None


def usable(*tensors: torch.Tensor, contiguous: bool = True) -> bool:
    """May these tensors go through the C path (CPU, float32, contiguous, library built)?"""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and (t.is_contiguous() or not contiguous)
               for t in tensors) and available()


def _bounds(rows: int, n: int) -> list[int]:
    threads = max(1, min(torch.get_num_threads(), rows * n // MIN_ELEMENTS_PER_THREAD, rows))
    return [rows * i // threads for i in range(threads + 1)]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """As RMSNorm.forward: out, or (out, x + residual) with a residual. x [..., n] contiguous float32."""
    n = x.shape[-1]
    rows = x.numel() // n
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    args = (x.data_ptr(), residual.data_ptr() if residual is not None else None,
            res_out.data_ptr() if res_out is not None else None, weight.data_ptr(), out.data_ptr(), n, eps)
    run_split(_library().rms_norm, args, _bounds(rows, n))
    return out if residual is None else (out, res_out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2n] = [gate | up] contiguous float32 -> silu(gate) * up [..., n]."""
    n = x.shape[-1] // 2
    rows = x.numel() // (2 * n)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    run_split(_library().silu_mul, (x.data_ptr(), out.data_ptr(), n), _bounds(rows, n))
    return out


def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] whose heads are contiguous (a row stride of its own is fine); positions [T] int64;
    cos_sin [max_position, D] contiguous -> rotated x, contiguous [T, H, D]."""
    t, h, d = x.shape
    assert x.stride(2) == 1 and x.stride(1) == d and positions.dtype == torch.int64
    positions = positions.contiguous()
    out = torch.empty(t, h, d, dtype=x.dtype)
    run_split(_library().rope, (x.data_ptr(), x.stride(0), h, d, positions.data_ptr(), cos_sin.data_ptr(),
                                out.data_ptr()), _bounds(t, h * d))
    return out
