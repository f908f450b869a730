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
from picovllm.engine.sampling import num_top, prompt_logprob_tensors, sample_logits
from picovllm.engine.scheduler import PROMPT_LOGPROB_ROWS, max_logit_rows, max_sampled_rows
from picovllm.engine.step_input import SamplingRow
from picovllm.layers.attention import AttentionMetadata
from picovllm.layers.logits_processors import PenaltyCounts


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


def profile_num_blocks(model: torch.nn.Module, config: EngineConfig, device: torch.device,
                       max_model_len: int, penalty_counts: PenaltyCounts | None = None) -> int:
    """How many KV blocks fit the memory budget: on a GPU, what the largest step leaves of
    gpu_memory_utilization; on the CPU, cpu_kv_cache_gib. max_model_len: the runner's (the longest sequence).
    penalty_counts: the engine's kept penalty counts on the rank that samples (None: a rank that never samples, a
    tensor-parallel worker), whose table the profile step fills to its full size (_profile_sampling)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_bytes_per_block(model, config.block_size, config.torch_kv_cache_dtype)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        _profile_forward(model, config, device, max_model_len, penalty_counts)
        free, total = torch.cuda.mem_get_info()
        peak_extra = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        budget = total * config.gpu_memory_utilization - (total - free) - peak_extra
        return max(1, int(budget // per_block))
    return max(1, int(config.cpu_kv_cache_gib * 2**30 // per_block))


def profile_sequences(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """The lengths of the profile step's sequences: the largest step the scheduler can make, as whole prompts of
    at most max_model_len tokens (at most max_num_seqs of them). One sequence of max_num_batched_tokens put
    positions past max_model_len, and past the rotary table where the model's max_position_embeddings is below the
    step budget (Gemma-2-2B: 8192 rows, benchmarks/families_gpu.py's 16384-token budget): the GPU's rope kernel reads
    cos/sin at any position unchecked, so it read up to 8 MiB past the table, which faults ("illegal memory access")
    wherever nothing is mapped behind it (the likely cause of that model's start-up crash after a Mistral-7B engine in
    the same process, BENCHMARKS.md)."""
    n = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    whole, rest = divmod(n, max_model_len)
    return [max_model_len] * whole + [rest] * (rest > 0)


def _profile_forward(model: torch.nn.Module, config: EngineConfig, device: torch.device, max_model_len: int,
                     penalty_counts: PenaltyCounts | None = None) -> None:
    """One forward of the largest step (profile_sequences) into a scratch cache, then its logits and their sampling
    (_profile_logits): the peak activation memory."""
    bs, dtype = config.block_size, config.torch_kv_cache_dtype
    lens = profile_sequences(config.max_num_batched_tokens, config.max_num_seqs, max_model_len)
    n, blocks = sum(lens), [-(-length // bs) for length in lens]
    first = np.cumsum([0] + blocks)           # each sequence its own blocks of the scratch cache
    positions = torch.cat([torch.arange(length) for length in lens]).to(device)
    slots = torch.cat([torch.arange(length) + int(b) * bs for length, b in zip(lens, first)]).to(device)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    for row, (b, k) in enumerate(zip(first, blocks)):
        tables[row, :k] = torch.arange(int(b), int(b) + k)
    ids = torch.zeros(n, dtype=torch.long, device=device)
    saved = [(a.k_cache, a.v_cache) for a in model.attention_layers()]
    attn = model.attention_layers()[0]
    scratch = torch.zeros(int(first[-1]), bs, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=device)
    for a in model.attention_layers():
        a.k_cache = a.v_cache = scratch
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.tensor(np.cumsum([0] + lens), dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), num_decodes=0, max_query_len=max(lens), max_seq_len=max(lens),
        query_lens_cpu=list(lens), seq_lens_cpu=list(lens))
    with torch.inference_mode():
        h = model(ids, positions, meta)
        if model.lm_head is not None:      # a pooling model has none (engine/pooling.py)
            _profile_logits(model, config, h, penalty_counts)
    for a, (k, v) in zip(model.attention_layers(), saved):
        a.k_cache, a.v_cache = k, v
    del scratch, h
    if device.type == "cuda":
        torch.cuda.synchronize()


def _profile_logits(model: torch.nn.Module, config: EngineConfig, hidden: torch.Tensor,
                    penalty_counts: PenaltyCounts | None = None) -> None:
    """The most logits a step has (scheduler.max_logit_rows: sampled rows and prompt-logprob rows), then, while they
    live, their sampling at its costliest (_profile_sampling, on the rank that samples) and, while its outputs live (as
    in sampling.launch_sampling), the prompt-logprob rows' float32 log-softmax, ranks and top-k (engine/sampling.py),
    at the largest top-k a request may ask (EngineConfig.max_logprobs)."""
    logits = model.compute_logits(hidden[-min(hidden.shape[0], max_logit_rows(config)):])
    rows = min(logits.shape[0], PROMPT_LOGPROB_ROWS)
    vocab = logits.shape[-1]
    topk = min(num_top(config.max_logprobs, vocab), vocab)
    # the sampled rows' outputs stay while the prompt rows are scored, as in a step
    sampled = () if penalty_counts is None else _profile_sampling(logits, config, topk, penalty_counts)
    prompt_logprob_tensors(logits[-rows:], [0] * rows, topk)
    del sampled


def _profile_sampling(logits: torch.Tensor, config: EngineConfig, logprobs: int, counts: PenaltyCounts) -> tuple:
    """The engine's sampler (sampling.sample_logits) on the most rows a step samples, each row asking for all that
    takes memory: logit bias, banned and allowed tokens, the three penalties, top-k, top-p and min-p at temperature 1,
    and `logprobs` logprobs. Row 0 has no filter (when there are others): a batch mixing the fused sampler's rows with
    the torch sampler's copies the latter's logits (layers/sampler.sample). The engine's penalty count table takes
    its full size (max_num_seqs rows) first and keeps it (its slots free again after): the budget counts it once, as
    memory in use, and it never grows later. Seeds and grammar masks are left out: a seed costs a row, a grammar mask
    a copy of the logits where fewer are live than at the sampler's peak. Returns the sampled tokens and logprob
    tensors."""
    counts.allocate(logits.shape[-1])
    n = min(logits.shape[0], max_sampled_rows(config))
    filters, plain = dict(top_k=1, top_p=0.9, min_p=0.1), dict(top_k=0, top_p=1.0, min_p=0.0)
    rows = [SamplingRow(temperature=1.0, seed=None, banned=[1], logprobs=logprobs,
                        **(plain if i == 0 < n - 1 else filters), presence_penalty=0.5, frequency_penalty=0.5,
                        repetition_penalty=1.1, bias_token_ids=[0], bias_values=[1.0], allowed=[0, 1],
                        penalty_key=f"memory profile {i % config.max_num_seqs}")
            for i in range(n)]
    # its draws on a generator of its own: a run draws the same numbers with or without the profile (as the warm-up)
    with torch.random.fork_rng(devices=[logits.device] if logits.is_cuda else []):
        tokens, logprob_tensors = sample_logits(logits[:n], rows, penalty_counts=counts)
    counts.forget()         # the rows' slots: no request's
    return tokens, *logprob_tensors


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
