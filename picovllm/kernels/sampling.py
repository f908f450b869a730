"""Sampling in one pass over the logits: greedy rows take the argmax, the others the Gumbel-max.

argmax(logits / T + G) with G = -log(E), E ~ Exp(1), draws from softmax(logits / T): the same
distribution as the torch sampler's exponential race, in one read of the logits instead of
about eight passes (scale, softmax, noise, divide, two argmaxes, select). The noise comes from
Philox keyed by the row's seed and the token id, so a seeded request's token depends only on
(seed, output index) and its logits, never on the rest of the batch. Each row's vocabulary is cut
into chunks handled by separate programs (enough of them to fill the GPU); a second small kernel
picks each row's winner. Rows that need top-k / top-p / min-p keep the torch sampler
(picovllm.layers.sampler), which is also the reference for greedy rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_chunk_kernel(logits_ptr, temp_ptr, seed_ptr, best_ptr, best_idx_ptr, vocab, chunk, stride_l,
                         NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    seed = tl.load(seed_ptr + row)
    inv_t = 1.0 / tl.where(temp > 0, temp, 1.0)
    base = logits_ptr + row.to(tl.int64) * stride_l
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, vocab)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        e = -tl.log(tl.rand(seed, offs))                  # Exp(1) noise, one draw per vocabulary entry
        score = tl.where(temp > 0, x * inv_t - tl.log(e), x)
        take = score > best                               # strict: each lane keeps its first maximum
        best = tl.where(take, score, best)
        best_idx = tl.where(take, offs, best_idx)
    top = tl.max(best, 0)
    out = row * NUM_CHUNKS + c
    tl.store(best_ptr + out, top)
    tl.store(best_idx_ptr + out, tl.min(tl.where(best == top, best_idx, 2147483647), 0))


@triton.jit
def _gumbel_pick_kernel(best_ptr, best_idx_ptr, out_ptr, NUM_CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    offs = row * NUM_CHUNKS + tl.arange(0, NUM_CHUNKS)
    best = tl.load(best_ptr + offs)
    idx = tl.load(best_idx_ptr + offs)
    top = tl.max(best, 0)
    # chunks are in vocabulary order, so the smallest index among the maxima is the first maximum
    tl.store(out_ptr + row, tl.min(tl.where(best == top, idx, 2147483647), 0).to(tl.int64))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  block: int = 2048, num_chunks: int | None = None) -> torch.Tensor:
    """logits [B, V] (any float dtype); temperature [B] float32 (0 = greedy); seeds [B] int64 -> ids [B] int64."""
    b, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(b, dtype=torch.long, device=logits.device)
    if b == 0:
        return out
    if num_chunks is None:   # about 1024 programs in all, each a whole number of blocks
        num_chunks = min(64, triton.next_power_of_2(-(-1024 // b)), triton.next_power_of_2(-(-v // block)))
    chunk = -(-v // num_chunks)
    best = torch.empty(b, num_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(b, num_chunks, dtype=torch.int32, device=logits.device)
    _gumbel_chunk_kernel[(b, num_chunks)](logits, temperature, seeds, best, best_idx, v, chunk, logits.stride(0),
                                          NUM_CHUNKS=num_chunks, BLOCK=block, num_warps=8)
    _gumbel_pick_kernel[(b,)](best, best_idx, out, NUM_CHUNKS=num_chunks, num_warps=1)
    return out
