"""Attention for any layout of a step on a grid that depends on the step's size alone: what a CUDA graph of a
mixed step needs (engine/mixed_graph.py).

The step's work is a list of items, padded with empty ones to a fixed length: item i = (sequence, query tile,
split, splits), and program (i, kv head) of the prefill kernel (kernels/prefill_attention.py, WORK) computes the
tile's rows, WORK_ROWS of them: query tokens x the KV head's query heads (so a decode, a chunk of one token, reads
its keys once for the whole group, not once a query head). A decode's keys may be cut into `splits` shares, one item
each, as the decode kernel splits them: the shares write a partial output and its log-sum-exp, and _merge_kernel
combines them. Which decodes split and how far is the host's choice (work_items), inside a budget of extra items
that is part of the list's fixed length.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from picovllm.kernels.decode_attention import (NO_WINDOW, check_layout, dot_precision, fp8_f16_dots, fp8_scales,
                                               merge_splits, score_scale, sink_logits)
from picovllm.kernels.prefill_attention import _prefill_kernel

WORK_ROWS = 64        # rows of a program's tile: query tokens x the KV head's query heads
MAX_SPLITS = 16       # shares of a decode's keys at most
SPLIT_TOKENS = 512    # a decode's keys a share aims for
SPLIT_BUDGET = 256    # extra items (shares past a decode's first) a step may have


def work_tile(group: int) -> int:
    """Query tokens of a work item when a KV head serves `group` query heads."""
    heads = triton.next_power_of_2(group)
    if heads > WORK_ROWS:
        raise ValueError(f"work_attention: at most {WORK_ROWS} query heads a KV head, got {group}")
    return WORK_ROWS // heads


def max_work_items(num_tokens: int, max_seqs: int, tile: int) -> int:
    """The list's length for steps of at most num_tokens tokens in at most max_seqs sequences: every tile of
    every sequence, and the split budget."""
    return num_tokens // tile + min(num_tokens, max_seqs) + SPLIT_BUDGET


def decode_splits(seq_lens: np.ndarray) -> np.ndarray:
    """Shares of each decode's keys: one per SPLIT_TOKENS, at most MAX_SPLITS, all halved until the extra items
    fit SPLIT_BUDGET (many decodes fill the GPU without splitting)."""
    splits = np.clip(-(-np.asarray(seq_lens) // SPLIT_TOKENS), 1, MAX_SPLITS)
    while splits.sum() - len(splits) > SPLIT_BUDGET:
        splits = -(-splits // 2)
    return splits


def work_items(query_lens: list[int], seq_lens: list[int], length: int, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """A step's work list: [length, 4] int32 rows (sequence, query tile of `tile` tokens, split, splits), then
    (-1, ...) rows; and each sequence's splits ([len(query_lens)] int32: 1 unless a decode's keys are split).
    Vectorized: this is host work on every mixed step."""
    ql = np.asarray(query_lens)
    decode = ql == 1
    per_seq = np.ones(len(ql), dtype=np.int32)
    per_seq[decode] = decode_splits(np.asarray(seq_lens)[decode])
    count = np.where(decode, per_seq, -(-ql // tile))           # items a sequence
    seq = np.repeat(np.arange(len(ql)), count)
    k = np.arange(len(seq)) - np.repeat(np.cumsum(count) - count, count)   # the item's index in its sequence
    split = decode[seq]
    out = np.full((length, 4), -1, dtype=np.int32)
    n = len(seq)
    out[:n, 0] = seq
    out[:n, 1] = np.where(split, 0, k)
    out[:n, 2] = np.where(split, k, 0)
    out[:n, 3] = per_seq[seq]
    return out, per_seq


@triton.jit
def _merge_kernel(part_o_ptr, part_lse_ptr, splits_ptr, query_start_ptr, o_ptr, stride_pseq, stride_psplit,
                  stride_ot, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (seq, head): a split decode's output from its shares' (output, log-sum-exp); others return."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(splits_ptr + seq)
    if n <= 1:
        return
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    out = merge_splits(part_o_ptr, part_lse_ptr, seq.to(tl.int64) * stride_pseq + h * BLOCK_D, stride_psplit, n,
                       offs_d, mask_d, BLOCK_D)
    row = tl.load(query_start_ptr + seq).to(tl.int64)
    tl.store(o_ptr + row * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=mask_d)


def work_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, query_start_loc: torch.Tensor, work: torch.Tensor, splits: torch.Tensor,
                   scale: float, out: torch.Tensor, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                   window: int | None = None, softcap: float | None = None,
                   kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over a work list (work_items): q, out [T, Hq, D]; the caches, block tables [S, W], seq_lens [S] and
    query_start_loc [S + 1] as for prefill_attention; work [I, 4] int32 (tiles of work_tile(Hq // Hkv) tokens);
    splits [S] int32, each sequence's (work_items' second answer, padded with 0 or 1). Two launches, sized by I and
    S alone. window, softcap, kv_scales, sinks: see AttentionBackend.forward (a split decode's sink is in its first
    share's partial only, so the merge counts it once)."""
    check_layout(q, k_cache, v_cache, out, "work_attention")
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"work_attention: {hq} query heads is not a multiple of {hkv} kv heads")
    group = hq // hkv
    work_tile(group)                               # raises past WORK_ROWS heads
    fp8 = fp8_scales(k_cache, kv_scales, "work_attention")
    sinks = sink_logits(sinks, softcap, hq, "work_attention")
    block_d = triton.next_power_of_2(d)
    num_seqs = splits.shape[0]
    part_o = torch.empty(num_seqs, MAX_SPLITS, hq, block_d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, MAX_SPLITS, hq, dtype=torch.float32, device=q.device)
    _prefill_kernel[(work.shape[0], 1, hkv)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, work, part_o, part_lse,
        *(kv_scales if fp8 else (seq_lens, seq_lens)), seq_lens if sinks is None else sinks, 0,
        score_scale(scale, softcap), window or NO_WINDOW,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part_o.stride(0), part_o.stride(1),
        BLOCK_SIZE=k_cache.shape[1], GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=WORK_ROWS, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype), SOFTCAP=float(softcap or 0.0), FP8=fp8, F16_DOTS=fp8_f16_dots(q, fp8),
        WORK=True, HEADS=triton.next_power_of_2(group), SINKS=sinks is not None, num_warps=num_warps,
        num_stages=num_stages)
    _merge_kernel[(num_seqs, hq)](part_o, part_lse, splits, query_start_loc, out, part_o.stride(0), part_o.stride(1),
                                  out.stride(0), out.stride(1), HEAD_DIM=d, BLOCK_D=block_d, num_warps=1)
    return out
