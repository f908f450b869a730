"""Structured outputs' masked logits on the CPU in float32, through token_mask.c: one pass over the logits.
layers/structured_output.mask_logits (torch) stays the reference (tests/test_structured_output.py)."""
from __future__ import annotations

import ctypes
import functools

import torch

from picovllm.kernels.cpu.build import compile_library, run_split

MIN_ELEMENTS_PER_THREAD = 1 << 18     # a row of a 49k vocabulary is a fifth of this: small batches stay on one


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = compile_library("token_mask.c")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.mask_logits.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64]
    lib.mask_logits.restype = None
    return lib


def usable(logits: torch.Tensor) -> bool:
    """May these logits go through the C path (CPU, float32, contiguous, library built)?"""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
            and _library() is not None)


def mask_logits(logits: torch.Tensor, words: torch.Tensor, word_row: list[int]) -> torch.Tensor:
    """logits [R, V] float32 -> a new tensor, row r masked by words[word_row[r]] ([*, W] int32, packed), or
    copied as it is where word_row[r] is -1."""
    rows, vocab = logits.shape
    assert len(word_row) == rows and words.dtype == torch.int32
    words = words.contiguous()
    index = torch.tensor(word_row, dtype=torch.int64)
    out = torch.empty_like(logits)
    threads = max(1, min(torch.get_num_threads(), rows * vocab // MIN_ELEMENTS_PER_THREAD, rows))
    bounds = [rows * i // threads for i in range(threads + 1)]
    run_split(_library().mask_logits, (logits.data_ptr(), words.data_ptr(), index.data_ptr(), out.data_ptr(),
                                       vocab, words.shape[1]), bounds)
    return out
