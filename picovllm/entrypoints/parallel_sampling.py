"""n samples of one prompt (SamplingParams.n; the server's n and best_of) as separate engine requests.

The engine runs one sample per request. Sample i gets a copy of the params with n=1 and, when seeded,
seed + i: its own reproducible stream. The first sample of a prompt is added alone and its siblings
once it has computed the prompt, so that (with prefix caching on) they take the prompt's full KV
blocks from the cache instead of computing them again: only the last, partial block is recomputed.
"""
from __future__ import annotations

import dataclasses

from picovllm.outputs import CompletionOutput, RequestOutput
from picovllm.sampling_params import SamplingParams


def sample_params(params: SamplingParams, count: int | None = None) -> list[SamplingParams]:
    """The params of each of `count` (default params.n) samples."""
    count = params.n if count is None else count
    if count == 1 and params.n == 1:
        return [params]
    # the prompt is scored once, by the first sample (its siblings then share its cached blocks)
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i,
                                prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            for i in range(count)]


def merge_samples(request_id: str, outs: list[RequestOutput]) -> RequestOutput:
    """One RequestOutput whose outputs are the samples', indexed in order. num_cached_tokens is the first
    sample's (the prompt's hit in the cache; its siblings' hits are on the first sample's blocks)."""
    first = outs[0]
    comps = [dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(outs)]
    error = next((o.error for o in outs if o.error), None)
    return RequestOutput(request_id, first.prompt, first.prompt_token_ids, comps, all(o.finished for o in outs),
                         first.metrics, error, first.num_cached_tokens, first.prompt_logprobs)


def best_of(out: RequestOutput, n: int) -> list[CompletionOutput]:
    """The n samples with the highest cumulative logprob (vLLM's best_of), best first, re-indexed."""
    best = sorted(out.outputs, key=lambda c: -c.cumulative_logprob)[:n]
    return [dataclasses.replace(c, index=i) for i, c in enumerate(best)]
