"""Structured outputs' masks on the logits: every token a row's grammar forbids set to -inf, in one launch.

A row's mask is packed 32 tokens a word (int32; token t is bit t % 32 of word t // 32, as xgrammar fills it). Each
program reads a BLOCK of one row's logits and the words that cover it, and writes the masked copy; rows the step did
not constrain (word_rows[row] < 0) are copied as they are. The raw logits are left as they are (the logprobs mask
them on their own). Reference: layers.structured_output.mask_logits (one gather and one minimum in torch).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit(do_not_specialize=["vocab", "num_words"])
def _mask_kernel(logits_ptr, words_ptr, word_rows_ptr, out_ptr, vocab, num_words, stride_l, stride_w, stride_o,
                 ALL_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ALL_ROWS: row r's mask is words row r (no word_rows table)."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + offs, mask=inside)
    if ALL_ROWS:
        wrow = row
    else:
        wrow = tl.load(word_rows_ptr + row)
    if wrow >= 0:
        word = tl.load(words_ptr + wrow.to(tl.int64) * stride_w + offs // 32, mask=inside & (offs // 32 < num_words),
                       other=0)    # tokens past the words are forbidden
        x = tl.where(((word >> (offs % 32)) & 1) != 0, x, float("-inf"))
    tl.store(out_ptr + row.to(tl.int64) * stride_o + offs, x, mask=inside)


def mask_logits(logits: torch.Tensor, words: torch.Tensor, word_rows: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] -> a new tensor with row r's forbidden tokens at -inf. words [M, W] int32 on logits' device;
    word_rows [R] int32 (on the device): the words row of each logits row, -1 for a row left as it is; None:
    row r's words are words[r]."""
    r, vocab = logits.shape
    out = torch.empty_like(logits)
    if r == 0:
        return out
    if logits.stride(1) != 1 or words.stride(1) != 1:
        raise ValueError("mask_logits: logits and words need contiguous rows")
    all_rows = word_rows is None
    _mask_kernel[(r, triton.cdiv(vocab, BLOCK))](
        logits, words, words if all_rows else word_rows, out, vocab, words.shape[1],
        logits.stride(0), words.stride(0), out.stride(0), ALL_ROWS=all_rows, BLOCK=BLOCK)
    return out
