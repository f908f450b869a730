"""Write the step's new K/V [T, Hkv, D] into the paged caches [num_blocks, block_size, Hkv, D] by slot.
An fp8 cache stores clamp(x / scale, -448, 448) as float8_e4m3fn, scale per KV head (layers.attention.quantize)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(x):
    """float32 x, |x| <= 448 -> the nearest float8_e4m3fn value (ties to even), still float32, so the cast after it
    is exact. The cast alone rounds right on a GPU, but TRITON_INTERPRET's emulation rounds half up without a
    carry (125.9 -> 64); rounding here makes the stored bytes torch's on both. Adding then subtracting
    c = 1.5 * 2^(e + 20), e = |x|'s binade (at least e4m3's smallest, -6), rounds |x| to a multiple of 2^(e - 3),
    e4m3's spacing there, in float32's own round-to-nearest-even."""
    bits = x.to(tl.int32, bitcast=True)
    binade = tl.maximum((bits & 0x7F800000).to(tl.float32, bitcast=True), 0.015625)
    c = binade * 1572864.0
    r = (tl.abs(x) + c) - c
    return tl.where(bits < 0, -r, r)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:          # padding row (CUDA-graph batches): nothing to store
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    if FP8:
        ks = tl.load(k_scale_ptr + h, mask=h < NUM_HEADS, other=1.0)
        vs = tl.load(v_scale_ptr + h, mask=h < NUM_HEADS, other=1.0)
        k = round_to_e4m3(tl.minimum(tl.maximum(k.to(tl.float32) / ks, -448.0), 448.0))
        v = round_to_e4m3(tl.minimum(tl.maximum(v.to(tl.float32) / vs, -448.0), 448.0))
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """k, v: [T, Hkv, D] (last dim contiguous); slot -1 means skip. Same result as layers.attention.store_kv.
    kv_scales: (k_scale, v_scale) [Hkv] float32, given exactly when the caches are fp8."""
    t, h, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("store_kv: k and v need a contiguous last dimension")
    if v.shape != k.shape or k_cache.dim() != 4 or tuple(k_cache.shape[2:]) != (h, d) \
            or v_cache.shape != k_cache.shape or slot_mapping.dim() != 1 or slot_mapping.shape[0] < t:
        raise ValueError(f"store_kv: k, v [T, Hkv, D] into caches [blocks, block_size, Hkv, D] by slots [T] (or "
                         f"more); got k {tuple(k.shape)}, v {tuple(v.shape)}, caches {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}, slots {tuple(slot_mapping.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("store_kv: k_cache and v_cache must share strides with a contiguous last dimension")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 != (kv_scales is not None):
        raise ValueError(f"store_kv: a {k_cache.dtype} cache with kv_scales {'missing' if fp8 else 'given'}")
    ks, vs = kv_scales if fp8 else (slot_mapping, slot_mapping)   # unread placeholders
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, ks, vs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], NUM_HEADS=h, HEAD_DIM=d,
        BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d), FP8=fp8, num_warps=4)
