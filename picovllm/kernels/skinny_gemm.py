"""y = x @ w.T for a few rows of x (decode batches of 1-8): a weight-streaming Triton kernel.

At batch 1 a decode step's linear layers read every weight once and do almost no arithmetic, so their time is
the weight bytes over the memory bandwidth. cuBLAS picks tile shapes for such calls that leave most of an H200
idle on Qwen3-0.6B's o_proj (N = 1024 outputs, K = 2048): a split-K pass and its separate reduce kernel, 0.34-0.6
TB/s (BENCHMARKS.md). Here each program owns BLOCK_N output features, for all the
rows at once (padded to 16 for the tensor-core dot), and streams its BLOCK_N x K slice of w through shared
memory in BLOCK_K chunks, num_stages of them in flight: one kernel, every byte of w read once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from picovllm.kernels.pdl import launch_options, wait_for_previous

MAX_ROWS = 8            # larger batches go to cuBLAS, whose tiles fit them


@triton.jit(do_not_specialize=["M"])        # one compiled kernel serves every batch of 1-8 rows
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)   # the first chunk of the weight: before the wait
    wait_for_previous(PDL)
    x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
    acc = tl.dot(x, tl.trans(w))
    x_ptrs += BLOCK_K
    w_ptrs += BLOCK_K
    for k0 in range(BLOCK_K, K, BLOCK_K):         # K is a multiple of BLOCK_K (skinny_fits)
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def skinny_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a [n, k] weight: the fastest of 15 configs on an H200 for
    Qwen3-0.6B's and -8B's shapes (BENCHMARKS.md)."""
    if n <= 2048:
        return 16, next(b for b in (1024, 512, 256) if k % b == 0), 4, 3
    return 32, (512 if k % 512 == 0 else 256), 4, 4


def skinny_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether skinny_linear takes this call: a half-precision x of at most MAX_ROWS rows, a contiguous w whose K is
    a multiple of 256 (the device is the caller's: kernels.use_triton)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == w.shape[1] and x.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and w.is_contiguous()
            and w.shape[1] % 256 == 0)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) -> [M, N], M <= MAX_ROWS (the caller checks skinny_fits)."""
    m = x.shape[0]
    n, k = w.shape
    block_n, block_k, warps, stages = config or skinny_config(n, k if k % 256 == 0 else 256)   # k: checked below
    # what the kernel cannot compute (it reads past K, or drops rows past its 16-row tile, silently): refused
    if (x.dim() != 2 or not 0 < m <= MAX_ROWS or x.shape[1] != k or not k or k % block_k or x.stride(1) != 1
            or w.stride(1) != 1 or (bias is not None and (bias.shape != (n,) or bias.stride(0) != 1))):
        raise ValueError(f"skinny_linear: x [1..{MAX_ROWS}, K] and w [N, K] with contiguous rows, K a multiple of "
                         f"BLOCK_K={block_k}, bias [N] contiguous (skinny_fits); got x {tuple(x.shape)} strides "
                         f"{x.stride()}, w {tuple(w.shape)} strides {w.stride()}"
                         f"{'' if bias is None else f', bias {tuple(bias.shape)}'}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        **launch_options(x))
    return y
