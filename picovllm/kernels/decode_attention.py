"""Paged decode attention: one query token per sequence, GQA, split-K over long contexts.

Pass 1 (_decode_partial_kernel): program (seq, kv_head, split) attends the GROUP query heads that
share kv_head to one of num_splits equal slices of the context (the last `window` tokens of it under a
sliding window) (a multiple of BLOCK_N tokens each),
reading K/V token by token through the block table, so any block size works. It writes the
slice's normalized output and its log-sum-exp (base 2). Pass 2 (_decode_reduce_kernel) merges
the slices of each head. The grid depends only on the batch size and head count, never on the
context lengths: no host-device sync, and one CUDA graph per batch size serves every context.

Attention sinks (SINKS, a constexpr; GPT-OSS): a query head's softmax also takes a zero-valued key of logit sinks[h],
which is the online softmax's starting state (running max the sink, running sum 1) in split 0 only: the split every
non-empty context has, so the reduce, which weights each split by its log-sum-exp, counts it once. A padding row
(length 0) runs no split and stays zeros.

An fp8 cache (FP8, a constexpr: the other path compiles as before) is read as x8 * scale with one scale per
KV head: a program sees one KV head, so K's scale joins the score scale. V is dequantized (times its scale) in
registers before its dot: V is that dot's transposed operand, and 8-bit data has no transposed shared-memory read
(ldmatrix.trans), so converting it later made the compiler read the fp8 tile from shared memory byte by byte, which
halved the kernel's bandwidth (BENCHMARKS.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from picovllm.kernels.pdl import launch_options, wait_for_previous

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30   # the window of a layer without one: longer than any context


def score_scale(scale: float, softcap: float | None) -> float:
    """What the kernels multiply q.k by: to base-2 logits, unless soft_cap converts after capping."""
    return scale if softcap else scale * LOG2E


@triton.jit
def soft_cap(s, SOFTCAP: tl.constexpr):
    """Scores s (q.k * scale) -> SOFTCAP * tanh(s / SOFTCAP), in base-2 units (times log2 e); tanh as a sigmoid."""
    # the literal, not LOG2E: compiled Triton reads no module globals but constexprs (the interpreter does)
    return SOFTCAP * 1.4426950408889634 * (2.0 * tl.sigmoid(2.0 * s / SOFTCAP) - 1.0)


def fp8_scales(k_cache: torch.Tensor, kv_scales, who: str) -> bool:
    """Whether the caches are fp8; raises unless kv_scales are given exactly then."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 != (kv_scales is not None):
        raise ValueError(f"{who}: a {k_cache.dtype} cache with kv_scales {'missing' if fp8 else 'given'}")
    return fp8


def check_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None,
                 who: str) -> None:
    """Raises unless q [*, Hq, D] and out (its shape) have a contiguous last dim and the caches are
    [num_blocks, block_size, Hkv, D] alike, sharing strides (the kernels read V with K's), last dim contiguous:
    another layout would be read as other entries, silently."""
    d = q.shape[-1]
    if (q.dim() != 3 or q.stride(-1) != 1 or k_cache.dim() != 4 or k_cache.shape[-1] != d
            or k_cache.stride(-1) != 1 or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride()
            or v_cache.dtype != k_cache.dtype or (out is not None and (out.shape != q.shape or out.stride(-1) != 1))):
        raise ValueError(f"{who}: q [T, Hq, D] and out alike, caches [blocks, block_size, Hkv, D] sharing strides, "
                         f"last dims contiguous; got q {tuple(q.shape)} {q.stride()}, k_cache {tuple(k_cache.shape)} "
                         f"{k_cache.stride()}, v_cache {tuple(v_cache.shape)} {v_cache.stride()}"
                         f"{'' if out is None else f', out {tuple(out.shape)} {out.stride()}'}")


def sink_logits(sinks: torch.Tensor | None, softcap: float | None, num_heads: int, who: str) -> torch.Tensor | None:
    """sinks as the kernels read them ([Hq] float32, contiguous), or None; raises with softcap (the kernels keep
    capped scores in other units, and no model has both) or for a length other than the query heads'."""
    if sinks is None:
        return None
    if softcap:
        raise ValueError(f"{who}: attention sinks with softcap")
    if sinks.shape != (num_heads,):
        raise ValueError(f"{who}: sinks of shape {tuple(sinks.shape)}, not one per query head ({num_heads})")
    return sinks.float().contiguous()


def fp8_f16_dots(q: torch.Tensor, fp8: bool) -> bool:
    """Whether the kernels take an fp8 cache's dot products in float16: for a half-precision q. Every e4m3 value is
    exact in float16 and the conversion is one instruction per two values, where e4m3 -> bfloat16 goes through
    float32 and left the fp8 decode kernel compute-bound, slower than bf16 at half the bytes (BENCHMARKS.md)."""
    return fp8 and q.dtype != torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 models get exact fp32 dot products (not tf32), so they match the torch reference closely."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _slice_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per split: the context cut in num_splits, rounded up to whole BLOCK_N tiles."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N), 1) * BLOCK_N


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])   # vary per step: no recompiles
def _decode_partial_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr, o_ptr,
        k_scale_ptr, v_scale_ptr, sinks_ptr, qk_scale, num_splits, window,
        stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
        stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
        DIRECT: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr, F16_DOTS: tl.constexpr,
        SINKS: tl.constexpr, PDL: tl.constexpr):
    """DIRECT (one split): write the final output, no partials and no reduce pass. SOFTCAP 0: none.
    SINKS: sinks_ptr[query head] is the logit of a zero-valued key, counted in split 0 (the module doc).
    FP8: the caches hold float8_e4m3fn, dequantized by k_scale_ptr[kv head], v_scale_ptr[kv head];
    F16_DOTS: their dot products in float16 (fp8_f16_dots)."""
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = tl.maximum(seq_len - window, 0)      # the first token in the window
    part = _slice_len(seq_len - lo, num_splits, BLOCK_N)
    start = lo + split * part
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    o_rows = o_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if start >= seq_len:      # past the end of the context: the reduce skips this split
        if DIRECT:            # an empty (padding) row: zeros
            tl.store(o_rows, tl.zeros([GROUP_PAD, BLOCK_D], tl.float32).to(o_ptr.dtype.element_ty),
                     mask=mask_g[:, None] & mask_d[None, :])
        return
    end = tl.minimum(start + part, seq_len)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    v_scale = 1.0         # fp8: V's scale, applied to V itself (see the module doc)
    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kvh)
        v_scale = tl.load(v_scale_ptr + kvh)
    if F16_DOTS:
        q = q.to(tl.float16)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    if SINKS:             # the head's sink as a key already seen, in base 2 (never with softcap: sink_logits)
        if split == 0:    # in one split only: the reduce counts it once
            m_i = tl.load(sinks_ptr + heads, mask=mask_g, other=float("-inf")) * 1.4426950408889634
            l_i = tl.where(mask_g, 1.0, 0.0)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t0 in range(start, end, BLOCK_N):
        t = t0 + offs_n
        mask_n = t < end
        blk = tl.load(table + t // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        row = blk * stride_cb + (t % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if FP8:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale   # [GROUP_PAD, BLOCK_N], base 2
        if SOFTCAP > 0:
            s = soft_cap(s, SOFTCAP)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if FP8:
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    if DIRECT:
        tl.store(o_rows, out.to(o_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    else:
        lse = m_i + tl.log2(l_i)
        base = seq.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_o_ptr + base[:, None] + offs_d[None, :], out, mask=mask_g[:, None] & mask_d[None, :])
        tl.store(part_lse_ptr + base // BLOCK_D, lse, mask=mask_g)


@triton.jit
def merge_splits(part_o_ptr, part_lse_ptr, base, stride_split, num, offs_d, mask_d, BLOCK_D: tl.constexpr):
    """The output of `num` splits of one (sequence, head), each a partial output (at base + s * stride_split) and its
    base-2 log-sum-exp (at that offset // BLOCK_D), weighted by their sums; zeros where no split saw a key."""
    m = float("-inf")
    den = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, num):
        lse = tl.load(part_lse_ptr + (base + s * stride_split) // BLOCK_D)
        o = tl.load(part_o_ptr + base + s * stride_split + offs_d, mask=mask_d, other=0.0)
        m_new = tl.maximum(m, lse)
        a = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * a + o * w
        den = den * a + w
        m = m_new
    return tl.where(den > 0, acc / tl.maximum(den, 1e-30), 0.0)   # an empty (padding) row gives zeros


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(part_o_ptr, part_lse_ptr, seq_lens_ptr, o_ptr, num_splits, window,
                          stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    n = seq_len - tl.maximum(seq_len - window, 0)    # tokens in the window
    used = tl.cdiv(n, _slice_len(n, num_splits, BLOCK_N))
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    out = merge_splits(part_o_ptr, part_lse_ptr, seq.to(tl.int64) * stride_pb + h * stride_ph, stride_ps, used,
                       offs_d, mask_d, BLOCK_D)
    tl.store(o_ptr + seq.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty),
             mask=mask_d)


# Programs the split-K grid aims for. On an H200, batches of 64-128 sequences of 100-2048 tokens
# ran 3-20% faster at ~3k programs than at ~500 (benchmarks/attention_kernels.py splits); at 256
# sequences x 8 KV heads one program each was best.
SPLIT_TARGET_PROGRAMS = 3072


def num_splits_for(num_seqs: int, num_kv_heads: int) -> int:
    """Splits per (sequence, kv head) so that the grid has about SPLIT_TARGET_PROGRAMS programs, at most 32."""
    return max(1, min(32, SPLIT_TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads)))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                     block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
                     num_splits: int | None = None, window: int | None = None,
                     softcap: float | None = None,
                     kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, W] int32; seq_lens [B] int32
    (0 for a padding row, which gets zeros, sinks or not). Returns [B, Hq, D]. window: attend to the last `window`
    tokens only; softcap: scores soft-capped; kv_scales: (k_scale, v_scale) [Hkv] float32, given exactly when the
    caches are fp8; sinks: [Hq] logits of a zero-valued key, never with softcap (see AttentionBackend.forward)."""
    check_layout(q, k_cache, v_cache, out, "decode_attention")
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"decode_attention: {hq} query heads is not a multiple of {hkv} kv heads")
    out = torch.empty_like(q) if out is None else out
    if b == 0:
        return out
    fp8 = fp8_scales(k_cache, kv_scales, "decode_attention")
    sinks = sink_logits(sinks, softcap, hq, "decode_attention")
    group = hq // hkv
    block_d = triton.next_power_of_2(d)
    splits = num_splits or num_splits_for(b, hkv)
    # 128-token tiles, but for the many short slices of a small batch (more than 12 splits: batches of at most 16
    # sequences here). On an H200 at batches of 32-256 nano-like contexts, 128 against 64 was 8-10% faster over an
    # fp8 cache and 1-3% over bf16 (benchmarks/attention_kernels.py sweep; BENCHMARKS.md). Cache rows of more than
    # 256 bytes (head_dim 256 in half precision, float32 caches) keep 64: their 128-token K and V tiles, double
    # buffered, are past an H200's 227 KB of shared memory (286 KB for float32 at head_dim 256)
    if block_n is None:
        block_n = 64 if splits > 12 or block_d * k_cache.element_size() > 256 else 128
    direct = splits == 1
    pdl = launch_options(q)
    part_o = torch.empty(0 if direct else b, hq, splits, block_d, dtype=torch.float32, device=q.device)
    # part_lse is laid out as part_o without its last dim, so its offsets are part_o's // block_d
    part_lse = torch.empty(0 if direct else b, hq, splits, dtype=torch.float32, device=q.device)
    _decode_partial_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_o, part_lse, out,
        *(kv_scales if fp8 else (seq_lens, seq_lens)), seq_lens if sinks is None else sinks,
        score_scale(scale, softcap), splits, window or NO_WINDOW,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), out.stride(0), out.stride(1),
        BLOCK_SIZE=k_cache.shape[1], GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=block_n, DOT_PRECISION=dot_precision(q.dtype), DIRECT=direct,
        SOFTCAP=float(softcap or 0.0), FP8=fp8, F16_DOTS=fp8_f16_dots(q, fp8), SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages, **pdl)
    if direct:
        return out
    _decode_reduce_kernel[(b, hq)](
        part_o, part_lse, seq_lens, out, splits, window or NO_WINDOW,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=1, **pdl)
    return out
