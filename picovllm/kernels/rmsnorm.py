"""RMSNorm, optionally fused with the residual add, one program per row (reference: layers.layernorm)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from picovllm.kernels.pdl import launch_options, wait_for_previous


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps,
                    stride_x, stride_r, stride_o, stride_ro,
                    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)   # a weight: before the wait
    wait_for_previous(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # round the sum to the activation dtype, as the torch reference does
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    y = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [T, N] -> out, or (out, x + residual) when residual is given (same as layers.layernorm.RMSNorm)."""
    n = x.shape[-1]
    if weight.shape != (n,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm: weight [{n}] and a residual shaped as x {tuple(x.shape)}; got weight "
                         f"{tuple(weight.shape)}{'' if residual is None else f', residual {tuple(residual.shape)}'}")
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    res_out = res2 = None
    if residual is not None:
        res2 = residual.reshape(-1, n)
        if res2.stride(-1) != 1:      # the kernel reads a row's entries at unit stride, as x's
            res2 = res2.contiguous()
        res_out = torch.empty_like(out)
    block = triton.next_power_of_2(n)
    if rows:
        _rmsnorm_kernel[(rows,)](
            x2, res2 if res2 is not None else x2, weight, out, res_out if res_out is not None else out, eps,
            x2.stride(0), res2.stride(0) if res2 is not None else 0, out.stride(0),
            res_out.stride(0) if res_out is not None else 0,
            N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=min(16, max(1, block // 256)),
            **launch_options(x2))
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))
