"""Greedy tokens: each row's argmax, its vocabulary split across many programs, then one small reduce.

torch.argmax gives a row to few thread blocks, so a batch of a few rows over a 152k vocabulary keeps most of the
GPU idle; here each row is cut into chunks (about 1024 programs in all, at most MAX_CHUNKS a row) and a second
kernel picks each row's winner from its chunks'. The result is torch.argmax's, ties and NaNs included: the first
index of the maximum, where -0.0 equals +0.0 and NaN is above everything (so a row with NaN gives its first NaN).
That follows from one int64 key per entry, compared by max alone: the float's order as an int32 in the high half
(NaN above +inf), the complement of the index in the low half (so of equal values the first wins).
Reference: torch.argmax (layers.sampler.greedy_tokens takes it elsewhere).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from picovllm.kernels.pdl import launch_options, wait_for_previous


@triton.jit
def _argmax_key(x, offs):
    """float32 x, int32 offs -> int64 keys: a larger key is a larger value, or an equal value at a smaller index."""
    x = tl.where(x == 0.0, 0.0, x)                    # -0.0 ties +0.0 (its bits would put it below)
    bits = x.to(tl.int32, bitcast=True)
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)   # negatives: larger magnitude, smaller key
    order = tl.where(x != x, 0x7FFFFFFF, order)       # every NaN above +inf (0x7F800000), and equal to each other
    return (order.to(tl.int64) << 32) | (0x7FFFFFFF - offs).to(tl.int64)


@triton.jit(do_not_specialize=["chunk", "num_chunks"])   # one compiled variant for every batch size
def _argmax_chunk_kernel(logits_ptr, key_ptr, vocab, chunk, num_chunks, stride_l, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    """Program (row, c): the best key of vocabulary entries [c * chunk, (c + 1) * chunk)."""
    wait_for_previous(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_l
    lowest = -9223372036854775807 - 1                 # below every key (an entry's order is at least -inf's)
    best = tl.full([BLOCK], lowest, tl.int64)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, vocab)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < hi, other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.where(offs < hi, _argmax_key(x, offs), lowest))
    tl.store(key_ptr + row * num_chunks + c, tl.max(best, 0))


@triton.jit(do_not_specialize=["num_chunks"])
def _argmax_pick_kernel(key_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    keys = tl.load(key_ptr + row * num_chunks + c, mask=c < num_chunks, other=-9223372036854775807 - 1)
    best = tl.max(keys, 0)
    tl.store(out_ptr + row, 0x7FFFFFFF - (best & 0x7FFFFFFF))


MAX_CHUNKS = 128
PROGRAMS = 1024      # chunks a batch is cut into, in all (fewer when rows are short)


def argmax(logits: torch.Tensor, block: int = 1024, num_chunks: int | None = None) -> torch.Tensor:
    """logits [B, V] (float32, bfloat16 or float16; rows of any stride) -> torch.argmax(logits, -1), int64 [B].
    Allocates the same for the same shape, and syncs nothing (CUDA-graph capturable)."""
    b, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if not 0 < v < 2 ** 31 - 1:
        raise ValueError(f"argmax: a vocabulary of {v} entries (1 .. 2**31 - 2 have a maximum and an int32 index)")
    out = torch.empty(b, dtype=torch.long, device=logits.device)
    if b == 0:
        return out
    if num_chunks is None:
        num_chunks = min(MAX_CHUNKS, -(-PROGRAMS // b), -(-v // block))
    if not 1 <= num_chunks <= MAX_CHUNKS:
        raise ValueError(f"argmax: num_chunks must be in [1, {MAX_CHUNKS}]")
    chunk = -(-(-(-v // num_chunks)) // block) * block      # whole blocks: aligned loads
    keys = torch.empty(b, num_chunks, dtype=torch.int64, device=logits.device)
    pdl = launch_options(logits)
    _argmax_chunk_kernel[(b, num_chunks)](logits, keys, v, chunk, num_chunks, logits.stride(0), BLOCK=block,
                                          num_warps=4, **pdl)
    _argmax_pick_kernel[(b,)](keys, out, num_chunks, BLOCK_C=MAX_CHUNKS, num_warps=1, **pdl)
    return out
