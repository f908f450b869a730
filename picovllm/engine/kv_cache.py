"""The paged KV cache's sizing and allocation: bytes per block, how many blocks fit, one tensor
[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim] bound to the attention layers.
Its dtype is EngineConfig.torch_kv_cache_dtype: the model's, or float8_e4m3fn (half bf16's bytes per block, so
twice the blocks in the same memory; each layer's scales are bound beside its cache, engine/kv_scales.py).
"""
from __future__ import annotations

import mmap

import numpy as np
import torch

from picovllm.config import EngineConfig
from picovllm.layers.attention import AttentionMetadata


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but on the CPU in an anonymous memory map, whose pages the OS zero-fills on first touch: a
    1 GiB KV cache then costs nothing at start-up (torch.zeros writes every page, ~1 s on 2 cores)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def kv_bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block in every layer, for this rank's KV heads."""
    layers = model.attention_layers()
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * len(layers) * block_size * layers[0].num_kv_heads * layers[0].head_dim * elem


def profile_num_blocks(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> int:
    """How many KV blocks fit the memory budget: on a GPU, what the largest step leaves of
    gpu_memory_utilization; on the CPU, cpu_kv_cache_gib."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_bytes_per_block(model, config.block_size, config.torch_kv_cache_dtype)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        _profile_forward(model, config, device)
        free, total = torch.cuda.mem_get_info()
        peak_extra = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        budget = total * config.gpu_memory_utilization - (total - free) - peak_extra
        return max(1, int(budget // per_block))
    return max(1, int(config.cpu_kv_cache_gib * 2**30 // per_block))


def _profile_forward(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> None:
    """One forward of max_num_batched_tokens into a scratch cache: the peak activation memory."""
    n, bs, dtype = config.max_num_batched_tokens, config.block_size, config.torch_kv_cache_dtype
    ids = torch.zeros(n, dtype=torch.long, device=device)
    saved = [(a.k_cache, a.v_cache) for a in model.attention_layers()]
    attn = model.attention_layers()[0]
    scratch = torch.zeros(-(-n // bs), bs, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=device)
    for a in model.attention_layers():
        a.k_cache = a.v_cache = scratch
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(scratch.shape[0], dtype=torch.int32, device=device)[None],
        num_decodes=0, max_query_len=n, max_seq_len=n, query_lens_cpu=[n], seq_lens_cpu=[n])
    with torch.inference_mode():
        h = model(ids, torch.arange(n, device=device), meta)
        model.compute_logits(h[-min(n, config.max_num_seqs):])
    for a, (k, v) in zip(model.attention_layers(), saved):
        a.k_cache, a.v_cache = k, v
    del scratch, h
    torch.cuda.synchronize()


def allocate_kv_cache(model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """The one cache tensor; each attention layer gets views of its K and V slices."""
    layers = model.attention_layers()
    cache = lazy_zeros((len(layers), 2, num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim),
                       dtype, device)
    for i, a in enumerate(layers):
        a.k_cache, a.v_cache = cache[i, 0], cache[i, 1]
    return cache


def wire_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as KV transfers and TP gathers move it: an fp8 cache as a uint8 view of its bytes (gloo,
    sockets and the CPU's index_copy_ know no float8), any other as it is."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
