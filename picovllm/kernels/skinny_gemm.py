"""y = x @ w.T for a few rows of x (decode batches of 1-8): a weight-streaming Triton kernel.

At batch 1 a decode step's linear layers read every weight once and do almost no arithmetic, so their time is
the weight bytes over the memory bandwidth. cuBLAS picks tile shapes for such calls that leave most of an H200
idle: on Qwen3-0.6B's o_proj and down_proj (N = 1024 outputs) it ran at 0.6-0.7 TB/s, with a split-K pass
and its separate reduce kernel (BENCHMARKS.md). Here each program owns BLOCK_N output features, for all the
rows at once (padded to 16 for the tensor-core dot), and streams its BLOCK_N x K slice of w through shared
memory in BLOCK_K chunks, num_stages of them in flight: one kernel, every byte of w read once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 8            # larger batches go to cuBLAS, whose tiles fit them


@triton.jit(do_not_specialize=["M"])        # one compiled kernel serves every batch of 1-8 rows
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, SILU_GATED: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """SILU_GATED: x's rows are [gate | up] (2K wide) and the kernel multiplies silu(gate) * up as it loads them."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):         # K is a multiple of BLOCK_K (skinny_fits)
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        if SILU_GATED:
            gate = x.to(tl.float32)
            up = tl.load(x_ptrs + K, mask=mask_m[:, None], other=0.0).to(tl.float32)
            x = (gate * tl.sigmoid(gate) * up).to(w_ptr.dtype.element_ty)
        w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def skinny_config(n: int, k: int, silu_gated: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a [n, k] weight: the fastest of 15 configs on an H200 for
    Qwen3-0.6B's and -8B's row-parallel shapes (BENCHMARKS.md). silu_gated holds two float32 [16, BLOCK_K] tiles
    (gate and up) besides: 1024-wide ones spilled registers and ran 50x slower, so it streams 256 at a time."""
    if silu_gated:
        return (16 if n <= 2048 else 32), 256, 4, 4
    if n <= 2048:
        return 16, next(b for b in (1024, 512, 256) if k % b == 0), 4, 3
    return 32, (512 if k % 512 == 0 else 256), 4, 4


def skinny_fits(x: torch.Tensor, w: torch.Tensor, silu_gated: bool = False) -> bool:
    """Whether skinny_linear takes this call: a half-precision x of at most MAX_ROWS rows (of [gate | up] when
    silu_gated), a contiguous w whose K is a multiple of 256 (the device is the caller's: kernels.use_triton)."""
    k = w.shape[1] * (2 if silu_gated else 1)
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == k and x.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and w.is_contiguous()
            and w.shape[1] % 256 == 0)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, silu_gated: bool = False,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) -> [M, N], M <= MAX_ROWS (the caller checks skinny_fits).
    silu_gated: x is [M, 2K], [gate | up], and silu(gate) * up is what multiplies w (the MLP's down projection
    with its activation folded in: one kernel fewer)."""
    m = x.shape[0]
    n, k = w.shape
    block_n, block_k, warps, stages = config or skinny_config(n, k, silu_gated)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SILU_GATED=silu_gated, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)
    return y
