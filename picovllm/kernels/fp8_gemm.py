"""y = x @ (w * scale).T for a weight stored in float8 e4m3 with a float32 scale per output feature
(quantization="fp8", layers/fp8_weights.py): each weight tile is read as 8-bit, widened to x's dtype in registers,
multiplied on the tensor cores, and the sums scaled by the features' scales once at the end. The weight bytes a
decode step streams are halved against bfloat16; activations and sums keep the model's dtype (weight-only).

Decode batches (up to TRITON_MAX_ROWS rows) take all their rows and a narrow slice of the features a program, so
that enough programs stream the weight (fp8_config). Larger batches (prefill, compute-bound) widen the weight to x's
dtype (times its scales) and multiply by cuBLAS: this kernel's tensor-core tiles ran those shapes at 0.4x of
cuBLAS on bfloat16 weights, the widened weight at about 0.85x (BENCHMARKS.md).
The torch reference is layers.fp8_weights.fp8_linear_reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from picovllm.kernels.decode_attention import dot_precision
from picovllm.kernels.pdl import launch_options, wait_for_previous


@triton.jit(do_not_specialize=["M"])        # one compiled kernel for every batch size of a tile
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_sn,
                     stride_sk, SBN, SBK,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     W_KN: tl.constexpr, BLOCKED: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """W_KN: each weight tile loaded as [BLOCK_K, BLOCK_N] (the dot's B as it is), else as [BLOCK_N, BLOCK_K] rows
    and transposed (fp8_config's: as fast or faster at most shapes of the sweep; benchmarks/fp8_gemm.py). BLOCKED:
    a scale per SBN x SBK block of w (an FP8 checkpoint's), each chunk's sums times its blocks' scales (BLOCK_K
    divides SBK); else one per row, the sums scaled once at the end."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    if W_KN:
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]     # [BLOCK_K, BLOCK_N]: w.T
    else:
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]     # [BLOCK_N, BLOCK_K]
    if not BLOCKED:
        scale = tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0)  # a weight's: before the wait (pdl.py)
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = k0 + offs_k < K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & in_k[None, :], other=0.0)
        if W_KN:
            w = tl.load(w_ptrs, mask=in_k[:, None] & mask_n[None, :], other=0.0).to(x.dtype)
        else:
            w = tl.trans(tl.load(w_ptrs, mask=mask_n[:, None] & in_k[None, :], other=0.0).to(x.dtype))
        if BLOCKED:
            s = tl.load(s_ptr + (offs_n // SBN) * stride_sn + (k0 // SBK) * stride_sk, mask=mask_n, other=0.0)
            acc += tl.dot(x, w, input_precision=DOT_PRECISION) * s[None, :]
        else:
            acc += tl.dot(x, w, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not BLOCKED:
        acc *= scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _widen_kernel(w_ptr, s_ptr, out_ptr, K, stride_sn, stride_sk, SBN, SBK, BLOCK_K: tl.constexpr):
    """out[n, k] = w[n, k] * its scale in out's dtype, a row a program (the widened weight cuBLAS multiplies); the
    scale of (n, k) at (n // SBN, k // SBK) (a row's own: SBN 1, stride_sk 0)."""
    n = tl.program_id(0).to(tl.int64)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n * K + k, mask=k < K, other=0.0)
        scale = tl.load(s_ptr + (n // SBN) * stride_sn + (k // SBK) * stride_sk, mask=k < K, other=0.0)
        tl.store(out_ptr + n * K + k, (w.to(tl.float32) * scale).to(out_ptr.dtype.element_ty), mask=k < K)


def scale_grid(scale: torch.Tensor, block: tuple[int, int] | None) -> tuple[int, int, int, int]:
    """(stride_sn, stride_sk, SBN, SBK) of a weight's scales: [N] one a row (block None), or [ceil(N / bn),
    ceil(K / bk)] one a bn x bk block."""
    if block is None:
        return scale.stride(0), 0, 1, 1
    return scale.stride(0), scale.stride(1), block[0], block[1]


def widen(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
          block: tuple[int, int] | None = None) -> torch.Tensor:
    """w [N, K] float8 (contiguous) times its scales, in dtype: fp8_weights.dequantize in one kernel."""
    out = torch.empty(w.shape, dtype=dtype, device=w.device)
    _widen_kernel[(w.shape[0],)](w, scale, out, w.shape[1], *scale_grid(scale, block), BLOCK_K=1024, num_warps=4)
    return out


def fp8_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, W_KN) for m <= TRITON_MAX_ROWS rows of x and an [n, k]
    weight: every program takes all the rows and a narrow slice of the features, streaming its slice of the weight.
    The fastest of 36 configs at Qwen3-0.6B's, -8B's and -30B-A3B's shapes, 1, 16 and 64 rows, on an H100
    (BENCHMARKS.md): 256-wide chunks but for the longest rows, slices of 16-64 features by the width."""
    block_m = max(16, triton.next_power_of_2(m))
    block_k = 1024 if k >= 8192 and block_m == 16 else 256 if k % 256 == 0 else 128
    block_n = 64 if m > 32 and n >= 5120 else 32 if n > 2048 else 16
    return block_m, block_n, block_k, 4, 3, False


def block_divisor(cols: int) -> int:
    """The largest power of two (at least 16, tl.dot's least K) dividing a scale block's columns; ValueError past
    that."""
    d = cols & -cols
    if d < 16:
        raise ValueError(f"FP8 scale blocks of {cols} columns: the kernels take blocks of a multiple of 16 columns")
    return d


# x with more rows than this (prefill) goes to cuBLAS on the weight widened to x's dtype (fp8_linear)
TRITON_MAX_ROWS = 64


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               block: tuple[int, int] | None = None, config: tuple[int, int, int, int, int, bool] | None = None,
               method: str | None = None) -> torch.Tensor:
    """x [..., K] @ (w [N, K] float8 * its scales).T (+ bias [N]) -> [..., N] in x's dtype. scale: [N] float32, one
    a row; or with block (bn, bk), [ceil(N / bn), ceil(K / bk)], one a block. method: "triton" (the kernel) or
    "widen" (cuBLAS on w times its scales, widened to x's dtype by `widen`); None: the kernel up to TRITON_MAX_ROWS
    rows."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, (n, k) = x2.shape[0], w.shape
    # what the kernels would read past, or read as other entries, silently: refused
    want = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    if x.shape[-1] != k or not w.is_contiguous() or tuple(scale.shape) != want \
            or (bias is not None and (bias.shape != (n,) or bias.stride(0) != 1)):
        raise ValueError(f"fp8_linear: x [..., K], a contiguous w [N, K], scales {list(want)} and bias [N] (or None) "
                         f"for w {tuple(w.shape)}, block {block}; got x {tuple(x.shape)}, w strides {w.stride()}, "
                         f"scale {tuple(scale.shape)}{'' if bias is None else f', bias {tuple(bias.shape)}'}")
    if (method or ("triton" if m <= TRITON_MAX_ROWS else "widen")) == "widen":
        return torch.nn.functional.linear(x2, widen(w, scale, x.dtype, block), bias).view(*lead, n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        bm, bn, bk, warps, stages, w_kn = config or fp8_config(m, n, k)
        if block is not None:       # a chunk within one block of columns
            bk = min(bk, block_divisor(block[1]))
        _fp8_gemm_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
            x2, w, scale, bias if bias is not None else scale, y, m, n, k, x2.stride(0), w.stride(0), y.stride(0),
            *scale_grid(scale, block), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, W_KN=w_kn,
            BLOCKED=block is not None, DOT_PRECISION=dot_precision(x.dtype), num_warps=warps, num_stages=stages,
            **launch_options(x))
    return y.view(*lead, n)
