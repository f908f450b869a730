"""Paged decode attention on the CPU (float32) through a small C kernel, and the attention backend using it
for every new token (a prefill token is a decode of its own prefix, see CpuAttentionBackend).

The torch reference (TorchAttentionBackend._decode) gathers every decode's K/V blocks into a dense
copy and runs SDPA on it: on the cpu-small workload that gather is two thirds of decode attention.
paged_decode.c reads each K/V row once, straight from the paged cache. It is compiled with the
machine's C compiler when first needed (well under a second; no torch headers) and called through
ctypes, which releases the GIL, so the sequences are split between threads here.
It is built once per model shape (heads, head dim and block size are compile-time constants). Without a
compiler, or if the build fails, CpuAttentionBackend is not used (see available()).
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from picovllm.kernels.cpu.build import compile_library, compile_openmp_library, run_split, shape_defines
from picovllm.layers.attention import AttentionBackend, store_kv


@functools.lru_cache(maxsize=8)
def _library(shape: tuple[int, int, int, int]) -> ctypes.CDLL | None:
    """Build and load the kernel for (query heads, kv heads, head dim, block size), once per process;
    None if there is no working C compiler."""
    defines = shape_defines(shape)
    lib = compile_openmp_library("paged_decode.c", defines) or compile_library("paged_decode.c", defines)
    if lib is None:
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.paged_attention.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, f32, i64, f32, ptr, i64, i64]
    lib.paged_attention.restype = None
    lib.openmp = hasattr(lib, "paged_attention_runs")   # else the runs go to a Python thread pool
    if lib.openmp:
        lib.paged_attention_runs.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, f32, i64, f32, ptr, ptr, i64]
        lib.paged_attention_runs.restype = None
    built = (ctypes.c_int64 * 4)()
    lib.paged_decode_shape(built)
    assert tuple(built) == shape, (tuple(built), shape)
    return lib


def available(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Can this process build the kernel for this shape (a C compiler that works)?"""
    if num_heads % num_kv_heads or num_heads * (head_dim + block_size) > 65536:   # keep its arrays on the stack small
        return False
    return _library((num_heads, num_kv_heads, head_dim, block_size)) is not None


@dataclass(frozen=True)
class DecodeBatch:
    """What every layer's call shares in one step: the decodes' block tables and lengths as the
    kernel reads them, and the sequences cut into one run per thread (about equal context each)."""
    tables: torch.Tensor        # [B, W] int32, contiguous
    lens: torch.Tensor          # [B] int32
    bounds: list[int]           # runs [bounds[i], bounds[i + 1]) of sequences, one per thread
    bounds_array: torch.Tensor  # the same, int64, for the OpenMP entry


def decode_batch(block_tables: torch.Tensor, seq_lens: list[int], threads: int | None = None) -> DecodeBatch:
    """block_tables [B, W]; seq_lens: B ints; threads: default torch's intra-op thread count."""
    b = len(seq_lens)
    threads = max(1, min(threads or torch.get_num_threads(), b))
    bounds = [0, b]
    if threads > 1:   # a sequence's cost is its length
        cost = torch.tensor(seq_lens, dtype=torch.float64).cumsum(0)
        cuts = torch.searchsorted(cost, cost[-1] * torch.arange(1, threads, dtype=torch.float64) / threads).tolist()
        bounds = [0, *cuts, b]
    return DecodeBatch(block_tables.to(torch.int32).contiguous(), torch.tensor(seq_lens, dtype=torch.int32), bounds,
                       torch.tensor(bounds, dtype=torch.int64))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch,
                           scale: float, window: int | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; batch: decode_batch(block tables, lengths) of the
    B sequences (a length 0 gives zeros). float32, CPU. Returns [B, Hq, D]. window: each sequence attends to
    its last `window` tokens only; softcap: scores soft-capped; sinks [Hq]: see AttentionBackend.forward."""
    _, hq, d = q.shape
    lib = _library((hq, k_cache.shape[2], d, k_cache.shape[1]))
    q = q.contiguous()
    out = torch.empty_like(q)
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), batch.tables.data_ptr(), batch.tables.stride(0),
            batch.lens.data_ptr(), out.data_ptr(), scale, window or 0, softcap or 0.0,
            None if sinks is None else sinks.data_ptr())
    if lib.openmp:
        lib.paged_attention_runs(*args, batch.bounds_array.data_ptr(), len(batch.bounds) - 1)
    else:
        run_split(lib.paged_attention, args, batch.bounds)
    return out


class CpuAttentionBackend(AttentionBackend):
    """Attention on the CPU through the C kernel (float32 caches): after the step's K/V are stored, each new
    token, a prefill chunk's as well as a decode's, is one query attending to its own prefix in the paged
    cache (position p of a sequence: its first p + 1 cached tokens). Prefill this way is causal by
    construction, needs no gathered copy of a chunk's earlier context, and runs 1.5-2.5x faster than
    SDPA per sequence at the cpu-small workload's prompt lengths (SDPA's per-call overhead dominates there).
    A sliding window is the same per token: a query at position p sees its prefix's last `window` tokens."""

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window=None, softcap=None, kv_scales=None, sinks=None):
        if kv_scales is not None:   # make_attention_backend never pairs them; a direct caller must not either
            raise ValueError("EngineConfig.kv_cache_dtype 'fp8': the CPU's C attention kernel reads float32 KV only")
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        batch = meta.scratch.get("cpu_tokens")
        if batch is None:
            batch = meta.scratch["cpu_tokens"] = token_batch(meta)
        if sinks is not None:
            sinks = sinks.float().contiguous()
        return paged_decode_attention(q, k_cache, v_cache, batch, scale, window, softcap, sinks)


def token_batch(meta) -> DecodeBatch:
    """One kernel task per new token of the step: its sequence's block table and its position + 1."""
    nd = meta.num_decodes
    if nd == meta.num_seqs:
        return decode_batch(meta.block_tables, meta.seq_lens_cpu)
    rows, lens = [], []
    for s, (ql, sl) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        rows += [s] * ql
        lens += range(sl - ql + 1, sl + 1)
    tables = meta.block_tables.index_select(0, torch.tensor(rows, dtype=torch.long))
    return decode_batch(tables, lens)
