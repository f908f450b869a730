"""Prefill / chunked-prefill attention over a varlen batch, reading all K/V from the paged cache.

Sequence s has query_len new tokens at positions seq_len - query_len .. seq_len - 1; its earlier
context is already in the cache, and the new K/V was stored there before this kernel runs. So
every key comes from the cache through the block table, and a query at position p attends to
keys 0..p (p - window + 1 .. p under a sliding window). Program (q_tile, seq, q_head) runs a flash-attention loop over those keys.
With a work list (WORK, a constexpr; kernels/work_attention.py) program (i, 0, kv_head) reads its sequence, query
tile and share of the keys from item i instead and takes all of the KV head's query heads (HEADS).
An fp8 cache (FP8, a constexpr) is read as x8 * scale: K's scale of the program's KV head joins the score scale,
V's multiplies the output. Attention sinks (SINKS, a constexpr): each row's online softmax starts from its head's
sink, a zero-valued key already seen (decode_attention's module doc); of a work item's shares only split 0 does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from picovllm.kernels.decode_attention import (NO_WINDOW, check_layout, dot_precision, fp8_f16_dots, fp8_scales,
                                               score_scale, sink_logits, soft_cap)


@triton.jit(do_not_specialize=["first_seq", "stride_bt"])   # vary per step: no recompiles
def _prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, work_ptr,
        part_o_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr, first_seq, qk_scale, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
        stride_pseq, stride_psplit,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
        FP8: tl.constexpr, F16_DOTS: tl.constexpr, WORK: tl.constexpr, HEADS: tl.constexpr, SINKS: tl.constexpr):
    # HEADS: query heads a program takes. 1: program (., ., h) takes query head h; else the power of two at
    # least GROUP: program (., ., kvh) takes KV head kvh's GROUP query heads, row r of a tile being query token
    # r // HEADS, head r % HEADS (rows of heads past GROUP masked), so the KV is read once for all of them.
    # WORK: item i = (seq, q_tile, split, splits): the split-th of `splits` equal shares of the tile's keys
    # (kernels/work_attention.py; splits > 1 only for a decode, whose partial result _merge_kernel combines)
    split = 0
    splits = 1
    if WORK:
        seq = tl.load(work_ptr + 4 * tl.program_id(0))
        tile = tl.load(work_ptr + 4 * tl.program_id(0) + 1)
        split = tl.load(work_ptr + 4 * tl.program_id(0) + 2)
        splits = tl.load(work_ptr + 4 * tl.program_id(0) + 3)
    else:
        tile = tl.program_id(0)
        seq = first_seq + tl.program_id(1)
    if seq < 0:
        return
    if HEADS == 1:
        kvh = tl.program_id(2) // GROUP
        h0 = tl.program_id(2)
    else:
        kvh = tl.program_id(2)
        h0 = kvh * GROUP
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * (BLOCK_M // HEADS) >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len                      # tokens cached before this chunk

    r = tl.arange(0, BLOCK_M)
    offs_m = tile * (BLOCK_M // HEADS) + r // HEADS    # each row's query token, within the chunk
    heads = h0 + r % HEADS
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = (offs_m < q_len) & (r % HEADS < GROUP)
    mask_d = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q_pos = ctx + offs_m
    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kvh)
    if F16_DOTS:                               # decode_attention.fp8_f16_dots
        q = q.to(tl.float16)

    # Finite: under a window a row can see no key of a whole tile, and -inf - -inf would be NaN.
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:             # the row's head's sink as a key already seen, in base 2 (never with softcap: sink_logits)
        if split == 0:    # a split decode's first share only: the merge counts it once
            m_i = tl.where(mask_m, tl.load(sinks_ptr + heads, mask=mask_m, other=0.0) * 1.4426950408889634, m_i)
            l_i = tl.where(mask_m, 1.0, 0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_start = tl.maximum(ctx + tile * (BLOCK_M // HEADS) - window + 1, 0)   # the tile's first query sees from here
    kv_end = tl.minimum(seq_len, ctx + (tile + 1) * (BLOCK_M // HEADS))   # the tile's last query sees up to here
    if WORK:                                   # this program's share of them, whole key tiles
        share = tl.cdiv(tl.cdiv(kv_end - kv_start, splits), BLOCK_N) * BLOCK_N
        kv_start = kv_start + split * share
        kv_end = tl.minimum(kv_end, kv_start + share)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t0 in range(kv_start, kv_end, BLOCK_N):
        t = t0 + offs_n
        mask_n = t < kv_end
        blk = tl.load(table + t // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        row = blk * stride_cb + (t % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if FP8:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP > 0:
            s = soft_cap(s, SOFTCAP)
        visible = (t[None, :] <= q_pos[:, None]) & (t[None, :] > q_pos[:, None] - window) & mask_n[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.maximum(l_i, 1e-30)[:, None]   # rows past the chunk see no key under a window: no 0 / 0
    if FP8:
        out = out * tl.load(v_scale_ptr + kvh)
    if splits > 1:                             # a share of a decode's keys: its output and log-sum-exp, per head
        part = seq.to(tl.int64) * stride_pseq + split * stride_psplit + heads * BLOCK_D
        tl.store(part_o_ptr + part[:, None] + offs_d[None, :], out, mask=mask_m[:, None] & mask_d[None, :])
        tl.store(part_lse_ptr + part // BLOCK_D, m_i + tl.log2(l_i), mask=mask_m)
    else:
        tl.store(o_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_d[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, first_seq: int, num_seqs: int,
                      max_query_len: int, scale: float, out: torch.Tensor,
                      block_m: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                      window: int | None = None, softcap: float | None = None,
                      kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for sequences first_seq .. first_seq + num_seqs - 1 of the batch, written into out.

    q, out: [T, Hq, D] for the whole flat batch; query_start_loc [B + 1] int32; max_query_len is a
    host-side bound on those sequences' query lengths (it sizes the grid). window, softcap, kv_scales (given
    exactly when the caches are fp8), sinks (never with softcap): see AttentionBackend.forward.
    """
    check_layout(q, k_cache, v_cache, out, "prefill_attention")
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"prefill_attention: {hq} query heads is not a multiple of {hkv} kv heads")
    if num_seqs == 0 or max_query_len == 0:
        return out
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, hq)
    fp8 = fp8_scales(k_cache, kv_scales, "prefill_attention")
    sinks = sink_logits(sinks, softcap, hq, "prefill_attention")
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, seq_lens, out, out,
        *(kv_scales if fp8 else (seq_lens, seq_lens)), seq_lens if sinks is None else sinks, first_seq,
        score_scale(scale, softcap), window or NO_WINDOW,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), 0, 0,
        BLOCK_SIZE=k_cache.shape[1], GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=dot_precision(q.dtype), SOFTCAP=float(softcap or 0.0),
        FP8=fp8, F16_DOTS=fp8_f16_dots(q, fp8), WORK=False, HEADS=1, SINKS=sinks is not None, num_warps=num_warps,
        num_stages=num_stages)
    return out
