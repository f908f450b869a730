"""y = x @ (w * scale).T for a weight stored in float8 e4m3 with a float32 scale per output feature
(quantization="fp8", layers/fp8_weights.py): each weight tile is read as 8-bit, widened to x's dtype in registers,
multiplied on the tensor cores, and the sums scaled by the features' scales once at the end. The weight bytes a
decode step streams are halved against bfloat16; activations and sums keep the model's dtype (weight-only).

One kernel for every batch; the tile follows the rows (fp8_config): few rows (decode) take 16-row tiles and a
narrow slice of features each, so that enough programs stream the weight; many rows (prefill) take 128 x 128 tiles.
The torch reference is layers.fp8_weights.fp8_linear_reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from picovllm.kernels.decode_attention import dot_precision
from picovllm.kernels.pdl import launch_options, wait_for_previous


@triton.jit(do_not_specialize=["M"])        # one compiled kernel for every batch size of a tile
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    scale = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)     # a weight's: before the wait (pdl.py's rule)
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = k0 + offs_k < K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[:, None] & in_k[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc *= scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def fp8_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for m rows of x and an [n, k] weight."""
    if m <= 16:     # decode: every byte of the weight read once, by at least ~n / 32 programs
        return 16, 16 if n <= 4096 else 32, 512 if k >= 4096 else 256, 4, 4
    if m <= 64:
        return 64, 32 if n <= 4096 else 64, 128, 4, 4
    if m <= 256:
        return 64, 128, 64, 4, 4
    return 128, 128, 64, 8, 3


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] @ (w [N, K] float8 * scale [N] float32 per row).T (+ bias [N]) -> [..., N] in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, (n, k) = x2.shape[0], w.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        bm, bn, bk, warps, stages = config or fp8_config(m, n, k)
        _fp8_gemm_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
            x2, w, scale, bias if bias is not None else scale, y, m, n, k, x2.stride(0), w.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=dot_precision(x.dtype),
            num_warps=warps, num_stages=stages, **launch_options(x))
    return y.view(*lead, n)
