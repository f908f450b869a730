"""Perplexity of a model on a token sequence, computed by the engine itself (its weights, kernels and KV cache).

The sequence runs as one request's prompt (max_tokens=1); a forward hook on the model catches the hidden states of
every prompt position, step after step (chunked prefill runs them in order), and the LM head turns them into the
log-probability of each next token. Used by benchmarks/perplexity.py and tests/test_perplexity.py.
"""
from __future__ import annotations

import math

import torch


def token_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[:i + 1]) for i in 0 .. len(ids) - 2, float64, from `llm` (an LLM)."""
    from picovllm.sampling_params import SamplingParams

    runner = llm.engine.runner
    model = runner.model
    chunks: list[torch.Tensor] = []

    def keep(_module, _inputs, hidden):
        chunks.append(model.compute_logits(hidden).double().log_softmax(-1))

    hook = model.register_forward_hook(keep)
    try:
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    finally:
        hook.remove()
    logprobs = torch.cat(chunks)[:len(ids) - 1]
    if logprobs.shape[0] != len(ids) - 1:
        raise RuntimeError(f"perplexity: saw {logprobs.shape[0]} prompt positions, expected {len(ids) - 1}")
    return logprobs.gather(1, torch.tensor(ids[1:], device=logprobs.device)[:, None])[:, 0].cpu()


def perplexity(logprobs: torch.Tensor) -> float:
    return math.exp(-logprobs.mean().item())
