"""Batched sampling: per-request temperature, top-k, top-p, min-p and seeds as tensor ops.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) (as -log U) draws from p. Seeded requests
draw E from a generator seeded by (seed, output index), so a seeded request's tokens depend on
nothing else in the batch, nor on preemption, nor on which engine (P or D) samples them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from picovllm import kernels


@dataclass
class SamplingTensors:
    temperature: torch.Tensor   # [B] float; 0 -> greedy
    top_k: torch.Tensor         # [B] long; 0 -> off
    top_p: torch.Tensor         # [B] float; 1 -> off
    min_p: torch.Tensor         # [B] float; 0 -> off
    seeds: list[int | None]     # per row: stream seed for this token, or None
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    filtered: list[bool] | None = None   # per row: uses top-k, top-p or min-p (host copy)

    def subset(self, rows: list[int]) -> "SamplingTensors":
        idx = torch.tensor(rows, device=self.temperature.device)
        f = [self.filtered[i] for i in rows]
        return SamplingTensors(self.temperature[idx], self.top_k[idx], self.top_p[idx], self.min_p[idx],
                               [self.seeds[i] for i in rows], self.all_greedy, any(f) and self.any_top_k,
                               any(f) and self.any_top_p, any(f) and self.any_min_p, f)


GREEDY_BELOW = 1e-5   # as vLLM: a smaller temperature is greedy (1 / T would overflow to inf and NaN)


def seeded_stream(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7_919 + 1) % (2 ** 63)


def apply_top_k_top_p_min_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Mask filtered-out tokens of temperature-scaled logits with -inf."""
    if t.any_min_p:
        probs = logits.softmax(-1)
        thresh = probs.max(-1, keepdim=True).values * t.min_p[:, None]
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    if not (t.any_top_k or t.any_top_p):
        return logits
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    if t.any_top_k:
        k = torch.where(t.top_k > 0, t.top_k, logits.shape[-1]).clamp(max=logits.shape[-1])
        kth = sorted_logits.gather(-1, (k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if t.any_top_p:
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs        # mass strictly ahead of each token
        # only rows asking for top-p: a float32 cumsum can reach 1 well before a row's last tokens (a top_p of 1 would
        # then cut its tail, and a seeded row's draw would depend on whether a batch-mate uses top-p)
        drop = (before >= t.top_p[:, None]) & (t.top_p[:, None] < 1)
        drop[:, 0] = False     # the most likely token stays, as HF's: a top_p that is 0 in float32 (1e-50) is greedy
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)


ARGMAX_KERNEL_ROWS = 64   # up to this many rows, greedy_tokens spreads each row over >= 16 programs (1024 in all)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> logits.argmax(-1) (int64; ties: the first maximum; NaN: the first NaN). Where the layers run
    Triton (CUDA), batches of few rows take kernels.argmax, which cuts each row across many programs where torch
    gives it few; larger batches already fill the GPU row by row and keep torch's one launch."""
    if kernels.use_triton(logits) and logits.shape[0] <= ARGMAX_KERNEL_ROWS and logits.dim() == 2 \
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16):
        from picovllm.kernels.argmax import argmax
        return argmax(logits)
    return logits.argmax(-1)


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits [B, V] (float32, or the model's dtype on CUDA) -> token ids [B]."""
    if t.all_greedy:
        return greedy_tokens(logits)
    if logits.is_cuda and t.filtered is not None:
        # Which sampler a row gets depends on its own parameters only, never on its batch-mates:
        # otherwise a seeded request would draw different tokens in different batches.
        plain = [i for i, f in enumerate(t.filtered) if not f]
        if len(plain) == len(t.filtered):
            return _sample_on_gpu(logits, t)
        if plain:
            rest = [i for i, f in enumerate(t.filtered) if f]
            out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
            out[plain] = _sample_on_gpu(logits[plain], t.subset(plain))
            out[rest] = _sample_torch(logits[rest], t.subset(rest))
            return out
    return _sample_torch(logits, t)


def _sample_torch(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    logits = logits.float()
    greedy = logits.argmax(-1)
    sampled_rows = t.temperature >= GREEDY_BELOW
    temp = torch.where(sampled_rows, t.temperature, 1.0)
    scaled = apply_top_k_top_p_min_p(logits / temp[:, None], t)
    probs = scaled.softmax(-1)
    # E ~ Exp(1) drawn as -log(U), U ~ Uniform[0, 1): on the CPU 6x faster than exponential_ (4.4 against 0.74 ms for
    # 4 rows of a 49k vocabulary), whose cost had nearly halved a small model's sampled decode rate (BENCHMARKS.md)
    seeded = [(row, seed) for row, seed in enumerate(t.seeds) if seed is not None]
    uniform = torch.rand_like(probs) if len(seeded) < probs.shape[0] else torch.empty_like(probs)
    for row, seed in seeded:
        g = torch.Generator(device=probs.device).manual_seed(seed)
        uniform[row] = torch.rand(probs.shape[-1], device=probs.device, generator=g)
    # a draw of exactly 0 makes its token's exponential infinite and its key 0: a row with one token left (the others'
    # probs 0) then has no winner, and argmax takes token 0, which the row forbids. The smallest positive float instead.
    sampled = (probs / uniform.clamp_(min=torch.finfo(uniform.dtype).tiny).log_().neg_()).argmax(-1)
    return torch.where(sampled_rows, sampled, greedy)


def _row_seeds(seeds: list[int | None]) -> list[int]:
    """The fused sampler's seed per row: a seeded row's stream seed, a fresh one from torch's default CPU generator
    for the others (drawn for every row, so the generator moves the same way whichever rows are seeded)."""
    fresh = torch.randint(0, 2 ** 62, (len(seeds),)).tolist()
    return [f if s is None else s for s, f in zip(seeds, fresh)]


def sample_temperature_only(logits: torch.Tensor, temperatures: list[float], seeds: list[int | None],
                            words: torch.Tensor | None = None, word_rows: torch.Tensor | None = None) -> torch.Tensor:
    """What sample() gives a CUDA batch of rows without top-k, top-p or min-p (the fused Gumbel-max kernel), from host
    lists: the temperatures and seeds go up in one copy (float32 temperatures in the int64 seeds' buffer), where
    sample() takes four tensors up and a where. words, word_rows: grammar masks (layers/structured_output.device_masks),
    applied in the same kernel."""
    from picovllm.kernels.sampling import gumbel_sample
    b = len(temperatures)
    host, at = packed_rows(temperatures, _row_seeds(seeds), pin=True)
    dev = host.to(logits.device, non_blocking=True)
    return gumbel_sample(logits, dev[at:].view(torch.float32)[:b], dev[:b], words=words, word_rows=word_rows)


def packed_rows(temperatures: list[float], seeds: list[int], pin: bool = False) -> tuple[torch.Tensor, int]:
    """One int64 buffer for one upload: the seeds at 0, the float32 temperatures (0 below GREEDY_BELOW) from int64
    index `at`. `at` is even, so the temperatures start 16-byte aligned for every batch size: Triton compiles a
    kernel per pointer alignment, and an odd batch's temperatures at index b had made a variant of the sampling
    kernel of their own (one the start-up warm-up could miss, engine/warmup.py)."""
    b = len(temperatures)
    at = b + (b & 1)
    host = torch.empty(at + (b + 1) // 2, dtype=torch.long, pin_memory=pin)
    host[:b] = torch.tensor(seeds, dtype=torch.long)
    host[at:].view(torch.float32)[:b] = torch.tensor([x if x >= GREEDY_BELOW else 0.0 for x in temperatures],
                                                     dtype=torch.float32)
    return host, at


def _sample_on_gpu(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Temperature-only batches on CUDA: one fused Gumbel-max kernel (temperature 0 = greedy there, so
    rows below GREEDY_BELOW are passed as 0). Unseeded rows get fresh seeds from torch's default CPU
    generator (no device sync); seeded rows their own stream seed."""
    from picovllm.kernels.sampling import gumbel_sample
    seeds_t = torch.tensor(_row_seeds(t.seeds), dtype=torch.long, pin_memory=True).to(logits.device, non_blocking=True)
    temps = torch.where(t.temperature >= GREEDY_BELOW, t.temperature, 0.0)
    return gumbel_sample(logits, temps, seeds_t)
