"""Rotary embedding ('rotate half' layout), optionally after a per-head RMSNorm (Qwen3's q/k norm).

One program per token handles all its q and k heads and writes contiguous outputs, so the
strided q/k views of the fused QKV projection need no copy first. rope_qkv takes the QKV
projection's output itself (one launch, no split into views on the host) and returns q, k and
v (a view: the KV store reads it strided). Given a KVWrite (the layer's paged caches, the step's
slots and fp8 scales), the same program also stores its token's rotated k and its v rows in the
cache, as kernels.store_kv would (the same bytes; slot -1 skipped), so the store is no launch of
its own. A KVWrite with a rotation (an fp8 cache's kv_rotation) has q and k returned, and k and v stored, times
it: Attention.forward's three matmuls and the store in this one pass. Reference: layers.rotary (and
layers.layernorm for the norm; layers.attention.store_kv and Attention.forward for the rotation).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from picovllm.kernels.decode_attention import dot_precision
from picovllm.kernels.pdl import launch_options, wait_for_previous
from picovllm.kernels.store_kv import round_to_e4m3
from picovllm.layers.attention import KVWrite


@triton.jit
def _rotate(x1, x2, r11, r12, r21, r22, DOT_PRECISION: tl.constexpr):
    """[x1 | x2] @ [[r11, r12], [r21, r22]] by halves (each [BLOCK_H, BLOCK_HALF], zero-padded), in x1's dtype."""
    y1 = tl.dot(x1, r11, input_precision=DOT_PRECISION) + tl.dot(x2, r21, input_precision=DOT_PRECISION)
    y2 = tl.dot(x1, r12, input_precision=DOT_PRECISION) + tl.dot(x2, r22, input_precision=DOT_PRECISION)
    return y1.to(x1.dtype), y2.to(x1.dtype)


@triton.jit
def _rope_heads(x_ptr, out_ptr, w_ptr, t, cos, sin, eps, stride_xt, stride_xh, stride_ot, stride_oh,
                r11, r12, r21, r22,
                NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                HAS_NORM: tl.constexpr, ROTATE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """ROTATE: the rotated heads then times the cache's rotation (r11 .. r22, its quarters)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_HEADS) & (j < HALF)
    src = x_ptr + t * stride_xt + h * stride_xh + j
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dt = out_ptr.dtype.element_ty
    if HAS_NORM:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
        x1 = ((a * rstd).to(dt).to(tl.float32) * w1).to(dt)
        x2 = ((b * rstd).to(dt).to(tl.float32) * w2).to(dt)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    o1 = (a * cos - b * sin).to(dt)
    o2 = (b * cos + a * sin).to(dt)
    if ROTATE:
        o1, o2 = _rotate(o1, o2, r11, r12, r21, r22, DOT_PRECISION)
    dst = out_ptr + t * stride_ot + h * stride_oh + j
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)
    return o1, o2


@triton.jit
def _cache_rows(cache_ptr, dst, x1, x2, scale_ptr, h, mask, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                FP8: tl.constexpr):
    """One token's head rows (halves x1, x2 [BLOCK_H, BLOCK_HALF]) into the cache at dst, as _store_kv_kernel
    writes them: in the cache's dtype, or fp8(clamp(x / scale, -448, 448)) with the head's scale."""
    if FP8:
        s = tl.load(scale_ptr + h, mask=h < NUM_HEADS, other=1.0)
        x1 = round_to_e4m3(tl.minimum(tl.maximum(x1.to(tl.float32) / s, -448.0), 448.0))
        x2 = round_to_e4m3(tl.minimum(tl.maximum(x2.to(tl.float32) / s, -448.0), 448.0))
    dt = cache_ptr.dtype.element_ty
    tl.store(cache_ptr + dst, x1.to(dt), mask=mask)
    tl.store(cache_ptr + dst + HALF, x2.to(dt), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_sin_ptr, qw_ptr, kw_ptr, eps, k_first,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                 stride_cs,
                 k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, v_first, stride_cb, stride_cslot,
                 stride_ch, rot_ptr,
                 NUM_Q: tl.constexpr, NUM_K: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                 STORE: tl.constexpr, CACHE_BLOCK: tl.constexpr, FP8: tl.constexpr, ROTATE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """ROTATE (with STORE): q and k leave, and k and v enter the cache, times the cache's rotation rot_ptr [D, D]
    (layers.attention.kv_rotation), as Attention.forward would multiply them after this kernel."""
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + j, mask=j < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + j, mask=j < HALF, other=0.0)
    r11, r12, r21, r22 = cos, cos, cos, cos       # unread unless ROTATE
    if ROTATE:
        i = tl.arange(0, BLOCK_HALF)[:, None]
        quarter = rot_ptr + i * (2 * HALF) + j
        inside = (i < HALF) & (j < HALF)
        r11 = tl.load(quarter, mask=inside, other=0.0)
        r12 = tl.load(quarter + HALF, mask=inside, other=0.0)
        r21 = tl.load(quarter + HALF * (2 * HALF), mask=inside, other=0.0)
        r22 = tl.load(quarter + HALF * (2 * HALF) + HALF, mask=inside, other=0.0)
    _rope_heads(q_ptr, q_out_ptr, qw_ptr, t, cos, sin, eps, stride_qt, stride_qh, stride_qot, stride_qoh,
                r11, r12, r21, r22, NUM_Q, BLOCK_Q, HALF, BLOCK_HALF, HAS_NORM, ROTATE, DOT_PRECISION)
    k1, k2 = _rope_heads(k_ptr + k_first * stride_kh, k_out_ptr, kw_ptr, t, cos, sin, eps, stride_kt, stride_kh,
                         stride_kot, stride_koh, r11, r12, r21, r22, NUM_K, BLOCK_K, HALF, BLOCK_HALF, HAS_NORM,
                         ROTATE, DOT_PRECISION)
    if STORE:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:     # -1: a padding row (CUDA-graph batches, warm-up), nothing stored
            h = tl.arange(0, BLOCK_K)[:, None]
            mask = (h < NUM_K) & (j < HALF)
            dst = (slot // CACHE_BLOCK) * stride_cb + (slot % CACHE_BLOCK) * stride_cslot + h * stride_ch + j
            _cache_rows(k_cache_ptr, dst, k1, k2, k_scale_ptr, h, mask, NUM_K, HALF, FP8)
            src = k_ptr + t * stride_kt + (v_first + h) * stride_kh + j
            v1 = tl.load(src, mask=mask, other=0.0)
            v2 = tl.load(src + HALF, mask=mask, other=0.0)
            if ROTATE:
                v1, v2 = _rotate(v1, v2, r11, r12, r21, r22, DOT_PRECISION)
            _cache_rows(v_cache_ptr, dst, v1, v2, v_scale_ptr, h, mask, NUM_K, HALF, FP8)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
         q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
         eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] (any strides, last dim contiguous); cos_sin [max_pos, D] float32
    (cos | sin). With norm weights, each head is RMS-normalized first. Returns new contiguous q, k."""
    if k.stride(-1) != 1:
        raise ValueError("rope: q, k and cos_sin need a contiguous last dimension")
    return _launch(positions, q, k, 0, k.shape[1], cos_sin, q_norm_weight, k_norm_weight, eps)


def rope_qkv(positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos_sin: torch.Tensor,
             q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
             eps: float = 1e-6, kv_write: KVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hk) * D], the QKV projection's output (rows of any stride, each contiguous) -> q [T, Hq, D]
    and k [T, Hk, D], new and contiguous, each head normed (with weights) and rotated, and v [T, Hk, D], a view.
    kv_write: also store k and v in its caches at its slots (what kernels.store_kv(k, v, ...) would write)."""
    t = qkv.shape[0]
    heads = qkv.view(t, num_heads + 2 * num_kv_heads, -1)
    q, k = _launch(positions, heads, heads, num_heads, num_kv_heads, cos_sin, q_norm_weight, k_norm_weight, eps,
                   num_q=num_heads, kv_write=kv_write)
    return q, k, heads[:, num_heads + num_kv_heads:]


def _launch(positions, q, k, k_first, hk, cos_sin, q_norm_weight, k_norm_weight, eps, num_q=None, kv_write=None):
    """q_out = rope(q's first num_q heads), k_out = rope(k's heads k_first .. k_first + hk - 1); with kv_write,
    k_out and k's heads k_first + hk .. k_first + 2 hk - 1 (v) go to the caches too."""
    t, hq, d = q.shape[0], num_q or q.shape[1], q.shape[2]
    has_norm = q_norm_weight is not None
    if has_norm != (k_norm_weight is not None):
        raise ValueError("rope: give both q_norm_weight and k_norm_weight, or neither")
    if q.stride(-1) != 1 or cos_sin.stride(-1) != 1:
        raise ValueError("rope: q, k and cos_sin need a contiguous last dimension")
    # the kernel reads cos at cos_sin[pos, :d/2] and sin at cos_sin[pos, d/2:d]: a table of another width (a partial
    # rotary's raw [max_pos, rotary_dim] one, say) would give other rows' values, silently
    if d % 2 or k.shape[2] != d or cos_sin.dim() != 2 or cos_sin.shape[1] != d:
        raise ValueError(f"rope: an even head_dim shared by q and k, and a cos_sin table [max_pos, head_dim]; got "
                         f"q [..., {d}], k [..., {k.shape[2]}], cos_sin {tuple(cos_sin.shape)} (a partial rotary "
                         f"pads its table to head_dim: layers.rotary.RotaryEmbedding)")
    if has_norm and not (q_norm_weight.numel() == d and k_norm_weight.numel() == d):
        raise ValueError(f"rope: q/k norm weights of {d} entries, not {q_norm_weight.numel()} and "
                         f"{k_norm_weight.numel()}")
    if kv_write is not None and kv_write.rotation is not None and kv_write.rotation.dtype != q.dtype:
        raise ValueError(f"rope_qkv: a {kv_write.rotation.dtype} rotation for {q.dtype} heads")
    q_out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(t, hk, d, dtype=k.dtype, device=k.device)
    if t:
        half = d // 2
        cache_args, cache_consts = _cache_args(kv_write, k_first + hk, hk, d, cos_sin)
        rows = 16 if cache_consts["ROTATE"] else 1     # tl.dot's least M: the rotation's heads padded to 16
        _rope_kernel[(t,)](
            q, k, q_out, k_out, positions, cos_sin,
            q_norm_weight if has_norm else cos_sin, k_norm_weight if has_norm else cos_sin, eps, k_first,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
            k_out.stride(0), k_out.stride(1), cos_sin.stride(0), *cache_args,
            NUM_Q=hq, NUM_K=hk, BLOCK_Q=max(rows, triton.next_power_of_2(hq)),
            BLOCK_K=max(rows, triton.next_power_of_2(hk)),
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half), HAS_NORM=has_norm, **cache_consts,
            DOT_PRECISION=dot_precision(q.dtype), num_warps=4, **launch_options(q))
    return q_out, k_out


def _cache_args(w: KVWrite | None, v_first: int, hk: int, d: int, placeholder: torch.Tensor) -> tuple[tuple, dict]:
    """The kernel's cache arguments and constexprs for a KVWrite (checked as kernels.store_kv checks them), or
    unread placeholders and STORE=False without one."""
    if w is None:
        p = placeholder
        return (p, p, p, p, p, 0, 0, 0, 0, p), dict(STORE=False, CACHE_BLOCK=1, FP8=False, ROTATE=False)
    kc, vc = w.k_cache, w.v_cache
    if kc.stride() != vc.stride() or kc.stride(-1) != 1 or tuple(kc.shape[2:]) != (hk, d):
        raise ValueError(f"rope_qkv: caches [blocks, block_size, {hk}, {d}] sharing strides, last dim contiguous, "
                         f"not {tuple(kc.shape)} with strides {kc.stride()} and {vc.stride()}")
    fp8 = kc.dtype == torch.float8_e4m3fn
    if fp8 != (w.kv_scales is not None):
        raise ValueError(f"rope_qkv: a {kc.dtype} cache with kv_scales {'missing' if fp8 else 'given'}")
    ks, vs = w.kv_scales if fp8 else (w.slot_mapping, w.slot_mapping)   # unread placeholders
    r = w.rotation
    if r is not None and not rotation_fits(d, r):
        raise ValueError(f"rope_qkv: a contiguous [{d}, {d}] rotation of head_dim 32-128, not {tuple(r.shape)}")
    return ((kc, vc, w.slot_mapping, ks, vs, v_first, kc.stride(0), kc.stride(1), kc.stride(2),
             r if r is not None else w.slot_mapping),
            dict(STORE=True, CACHE_BLOCK=kc.shape[1], FP8=fp8, ROTATE=r is not None))


def rotation_fits(head_dim: int, rotation: torch.Tensor | None = None) -> bool:
    """Whether rope_qkv can apply a cache rotation: its half-head products are tl.dot's, at least 16 wide, and the
    rotation's four quarters stay in a program's registers (head_dim at most 128)."""
    ok = head_dim % 2 == 0 and 16 <= triton.next_power_of_2(head_dim // 2) <= 64
    return ok and (rotation is None or (tuple(rotation.shape) == (head_dim, head_dim) and rotation.is_contiguous()))
