"""Sampling in one pass over the logits: greedy rows take the argmax, the others the Gumbel-max.

argmax(logits / T + G) with G = -log(E), E ~ Exp(1), draws from softmax(logits / T): the same
distribution as the torch sampler's exponential race, in one read of the logits instead of
about eight passes (scale, softmax, noise, divide, two argmaxes, select). The noise comes from
Philox keyed by the row's seed and the token id, so a seeded request's token depends only on
(seed, output index) and its logits, never on the rest of the batch. Each row's vocabulary is cut
into chunks handled by separate programs (enough of them to fill the GPU); a second small kernel
picks each row's winner. Philox makes 4 numbers per call, so each call serves 4 adjacent entries.
Rows that need top-k / top-p / min-p keep the torch sampler (picovllm.layers.sampler), which is
also the reference for greedy rows. Seeded GPU samples differ from seeded CPU samples (another
noise source), but each is reproducible. Structured outputs' grammar masks (packed 32 tokens a word)
may be read in the same pass: a forbidden token's logit counts as -inf.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


MIN_UNIFORM = tl.constexpr(2.0 ** -32)    # tl.rand's draws are multiples of ~2**-31


@triton.jit(do_not_specialize=["chunk", "num_chunks"])   # one compiled variant for every batch size
def _gumbel_chunk_kernel(logits_ptr, temp_ptr, seed_ptr, best_ptr, best_idx_ptr, words_ptr, word_rows_ptr, vocab,
                         chunk, num_chunks, stride_l, num_words, stride_w, BLOCK: tl.constexpr, MASKED: tl.constexpr,
                         ALL_ROWS: tl.constexpr):
    """Program (row, c) scans vocabulary entries [c * chunk, (c + 1) * chunk), BLOCK at a time, as
    BLOCK // 4 quads: one Philox call gives the noise for the 4 entries of a quad. MASKED: the row's grammar mask
    (packed words, as kernels/token_mask.py reads them; word_rows[row] < 0 or ALL_ROWS as there) forbids tokens."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    seed = tl.load(seed_ptr + row)
    inv_t = 1.0 / tl.where(temp > 0, temp, 1.0)
    base = logits_ptr + row.to(tl.int64) * stride_l
    wrow = row                                    # the row's mask words (a row < 0: unmasked)
    if MASKED and not ALL_ROWS:
        wrow = tl.load(word_rows_ptr + row)
    words = words_ptr + wrow.to(tl.int64) * stride_w
    # an unmasked row reads no word and takes every bit set; a masked one reads its words (tokens past them: none)
    covered = tl.where(wrow >= 0, num_words * 32, 0)
    free_bits = tl.where(wrow >= 0, 0, -1)
    QUADS: tl.constexpr = BLOCK // 4
    best = tl.full([QUADS], float("-inf"), tl.float32)
    best_idx = tl.full([QUADS], 2147483647, tl.int32)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, vocab)
    for start in range(lo, hi, BLOCK):
        quad = start // 4 + tl.arange(0, QUADS)
        u0, u1, u2, u3 = tl.rand4x(seed, quad)
        best, best_idx = _gumbel_step(base, quad * 4, hi, u0, temp, inv_t, best, best_idx, words,
                                      covered, free_bits, MASKED)
        best, best_idx = _gumbel_step(base, quad * 4 + 1, hi, u1, temp, inv_t, best, best_idx, words,
                                      covered, free_bits, MASKED)
        best, best_idx = _gumbel_step(base, quad * 4 + 2, hi, u2, temp, inv_t, best, best_idx, words,
                                      covered, free_bits, MASKED)
        best, best_idx = _gumbel_step(base, quad * 4 + 3, hi, u3, temp, inv_t, best, best_idx, words,
                                      covered, free_bits, MASKED)
    top = tl.max(best, 0)
    out = row * num_chunks + c
    tl.store(best_ptr + out, top)
    tl.store(best_idx_ptr + out, tl.min(tl.where(best == top, best_idx, 2147483647), 0))


@triton.jit
def _gumbel_step(base, offs, hi, u, temp, inv_t, best, best_idx, words, covered, free_bits, MASKED: tl.constexpr):
    x = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
    if MASKED:
        word = tl.load(words + offs // 32, mask=(offs < hi) & (offs < covered), other=0) | free_bits
        x = tl.where(((word >> (offs % 32)) & 1) != 0, x, float("-inf"))
    # -log(u) ~ Exp(1); minus its log is Gumbel. A u of exactly 0 (1 in 2**31 draws) would make the token's score -inf:
    # a row with one token left (allowed_token_ids, a grammar) would then have no winner and take token 0, which it
    # forbids. Clamped to half the smallest nonzero draw, it is the Gumbel's far lower tail; every other u is as drawn.
    u = tl.maximum(u, MIN_UNIFORM)
    score = tl.where(temp > 0, x * inv_t - tl.log(-tl.log(u)), x)
    take = score > best                     # strict, and quads go in index order: a lane keeps its first maximum
    return tl.where(take, score, best), tl.where(take, offs, best_idx)


@triton.jit(do_not_specialize=["num_chunks"])
def _gumbel_pick_kernel(best_ptr, best_idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    best = tl.load(best_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    idx = tl.load(best_idx_ptr + row * num_chunks + c, mask=c < num_chunks, other=2147483647)
    top = tl.max(best, 0)
    # chunks are in vocabulary order, so the smallest index among the maxima is the first maximum; a row its mask
    # leaves no token (a grammar with nothing next) takes 0, as torch's argmax over -inf does: a token in the
    # vocabulary, which the grammar then refuses (the request ends in an error), never an id past the embedding
    pick = tl.min(tl.where(best == top, idx, 2147483647), 0)
    tl.store(out_ptr + row, tl.where(pick == 2147483647, 0, pick).to(tl.int64))


MAX_CHUNKS = 64


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  block: int = 2048, num_chunks: int | None = None, words: torch.Tensor | None = None,
                  word_rows: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] (any float dtype); temperature [B] float32 (0 = greedy); seeds [B] int64 -> ids [B] int64.
    words [M, W] int32, word_rows [B] int32 (or None: row r's words are words[r]): grammar masks as
    kernels.token_mask.mask_logits takes them, read in the same pass: the draw is the one from the logits with the
    forbidden tokens at -inf."""
    b, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(b, dtype=torch.long, device=logits.device)
    if b == 0:
        return out
    if num_chunks is None:   # about 1024 programs in all
        num_chunks = min(MAX_CHUNKS, -(-1024 // b), -(-v // block))
    if not 1 <= num_chunks <= MAX_CHUNKS or block % 4:
        raise ValueError(f"gumbel_sample: num_chunks must be in [1, {MAX_CHUNKS}] and block a multiple of 4")
    chunk = -(-(-(-v // num_chunks)) // block) * block      # whole blocks, so quads never straddle chunks
    best = torch.empty(b, num_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(b, num_chunks, dtype=torch.int32, device=logits.device)
    if words is not None and words.stride(1) != 1:
        raise ValueError("gumbel_sample: the mask words need contiguous rows")
    masked, all_rows = words is not None, word_rows is None
    _gumbel_chunk_kernel[(b, num_chunks)](logits, temperature, seeds, best, best_idx, words if masked else seeds,
                                          word_rows if not all_rows else seeds, v, chunk, num_chunks, logits.stride(0),
                                          words.shape[1] if masked else 0, words.stride(0) if masked else 0,
                                          BLOCK=block, MASKED=masked, ALL_ROWS=all_rows, num_warps=8)
    _gumbel_pick_kernel[(b,)](best, best_idx, out, num_chunks, BLOCK_C=MAX_CHUNKS, num_warps=1)
    return out
