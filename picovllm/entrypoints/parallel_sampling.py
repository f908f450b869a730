"""n samples of one prompt (SamplingParams.n; the server's n and best_of) as separate engine requests.

The engine runs one sample per request. Sample i gets a copy of the params with n=1 and, when seeded,
seed + i modulo 2**64 (never -1, which is "no seed"): its own reproducible stream. The first sample of a
prompt is added alone and its siblings once it has computed the prompt, so that (with prefix caching on)
they take the prompt's full KV blocks from the cache instead of computing them again: only the last,
partial block is recomputed.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from picovllm.engine.request import RequestStatus
from picovllm.outputs import CompletionOutput, RequestOutput
from picovllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from picovllm.engine.llm_engine import Engine


def sample_params(params: SamplingParams, count: int | None = None) -> list[SamplingParams]:
    """The params of each of `count` (default params.n) samples."""
    count = params.n if count is None else count
    if count == 1 and params.n == 1:
        return [params]
    # the prompt is scored once, by the first sample (its siblings then share its cached blocks)
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else (params.seed + i) % 2**64,
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


def prompt_output(ids: list[str], final: dict[str, RequestOutput]) -> RequestOutput:
    """A prompt's RequestOutput from its samples' final outputs (by request id): a lone sample's as it is, else
    merged under the first sample's id."""
    return final[ids[0]] if len(ids) == 1 else merge_samples(ids[0], [final[i] for i in ids])


def best_of(out: RequestOutput, n: int) -> list[CompletionOutput]:
    """The n samples with the highest cumulative logprob (vLLM's best_of), best first, re-indexed."""
    best = sorted(out.outputs, key=lambda c: -c.cumulative_logprob)[:n]
    return [dataclasses.replace(c, index=i) for i, c in enumerate(best)]


@dataclasses.dataclass
class PromptSamples:
    """One prompt's samples as engine requests: ids of those added so far (the first at once), and the params of the
    siblings that wait until the first has computed the prompt."""
    prompt: str | list[int]
    ids: list[str]
    siblings: list[SamplingParams]
    priority: int = 0


class SampleBatch:
    """An offline batch of prompts (LLM.generate, `picovllm batch`), each with its params.n samples: whole outputs
    (FINAL_ONLY, as vLLM's LLM returns them), one RequestOutput per prompt with its samples merged."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.prompts: list[PromptSamples] = []
        self.ids: set[str] = set()       # every sample's request id added so far (the engine may run others too)

    def add(self, prompt: str | list[int], params: SamplingParams, priority: int = 0) -> None:
        """Add a prompt's first sample (its siblings wait: add_ready_siblings). Raises ValueError as
        Engine.add_request does, having added nothing."""
        if params.output_kind != RequestOutputKind.FINAL_ONLY:
            params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        first, *siblings = sample_params(params)
        rid = self.engine.add_request(prompt, first, priority=priority)
        self.ids.add(rid)
        self.prompts.append(PromptSamples(prompt, [rid], siblings, priority))

    def add_request(self, prompt: str | list[int], params) -> None:
        """A prompt as one request with these params as they are (a pooling prompt's PoolingParams)."""
        rid = self.engine.add_request(prompt, params)
        self.ids.add(rid)
        self.prompts.append(PromptSamples(prompt, [rid], []))

    @property
    def num_requests(self) -> int:
        """Every sample's request, added or waiting."""
        return sum(len(p.ids) + len(p.siblings) for p in self.prompts)

    @property
    def waiting(self) -> bool:
        return any(p.siblings for p in self.prompts)

    def add_ready_siblings(self) -> None:
        """Add the siblings of each prompt whose first sample has computed the prompt (or ended)."""
        for p in self.prompts:
            if not p.siblings:
                continue
            req = self.engine.requests.get(p.ids[0])
            if req is None or req.status == RequestStatus.DECODING:   # its full blocks are cached now
                added = [self.engine.add_request(p.prompt, sp, priority=p.priority) for sp in p.siblings]
                p.ids.extend(added)
                self.ids.update(added)
                p.siblings = []

    def abort(self, final: dict[str, RequestOutput] | None = None) -> None:
        """Abort every added sample without a final output: the engine as it was before the batch."""
        for rid in (i for p in self.prompts for i in p.ids):
            if final is None or rid not in final:
                self.engine.abort(rid)

    def outputs(self, final: dict[str, RequestOutput]) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order, from every sample's final output."""
        return [prompt_output(p.ids, final) for p in self.prompts]
