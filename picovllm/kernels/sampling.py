"""Sampling in one pass over the logits: greedy rows take the argmax, the others the Gumbel-max.

argmax(logits / T + G) with G = -log(E), E ~ Exp(1), draws from softmax(logits / T): the same
distribution as the torch sampler's exponential race, in one read of the logits instead of
about eight passes (scale, softmax, noise, divide, two argmaxes, select). The noise comes from
Philox keyed by the row's seed, so a seeded request's token depends only on (seed, output index)
and the logits, never on the rest of the batch. Rows that need top-k / top-p / min-p keep the
torch sampler (picovllm.layers.sampler), which is also this kernel's reference for greedy rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, temp_ptr, seed_ptr, out_ptr, vocab, stride_l, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    temp = tl.load(temp_ptr + row)
    seed = tl.load(seed_ptr + row)
    inv_t = 1.0 / tl.where(temp > 0, temp, 1.0)
    base = logits_ptr + row.to(tl.int64) * stride_l
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        e = -tl.log(tl.rand(seed, offs))                  # Exp(1) noise, one draw per vocabulary entry
        score = tl.where(temp > 0, x * inv_t - tl.log(e), x)
        take = score > best                               # strict: each lane keeps its first maximum
        best = tl.where(take, score, best)
        best_idx = tl.where(take, offs, best_idx)
    top = tl.max(best, 0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_idx, vocab), 0))   # first index among ties


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  block: int = 2048) -> torch.Tensor:
    """logits [B, V]; temperature [B] float32 (0 = greedy); seeds [B] int64 -> token ids [B] int64."""
    b, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(b, dtype=torch.int32, device=logits.device)
    if b:
        _gumbel_argmax_kernel[(b,)](logits, temperature, seeds, out, v, logits.stride(0), BLOCK=block,
                                    num_warps=8)
    return out.long()
