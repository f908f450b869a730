"""Beam search on top of the engine, as vLLM's LLM.beam_search and its server's `use_beam_search` do it: each step
runs every live beam for one token with its top log-probabilities (SamplingParams(max_tokens=1, logprobs=2W)), and
the prefix cache keeps a beam's step from recomputing the blocks it shares with its parent. The engine needs
nothing for it.

One step, W = beam_width (the rule of HF transformers' beam search):
  - each live beam proposes its max(2, 1 + E) W most likely next tokens (E: the end-of-sequence ids, 0 with
    ignore_eos), so that W live beams remain whichever of them end; a candidate's score is its beam's cumulative
    log-probability plus the token's (the model's log-softmax; temperature 0 only);
  - the candidates in order of score, best first: one that ends with an end-of-sequence token (not with
    ignore_eos) is finished if it is among the first W, else dropped; the others become the next live beams, up to W.
After max_tokens steps (or once no beam is live), the finished and the live beams are ranked by
    cumulative log-probability / (generated tokens, a final end-of-sequence token counted) ** length_penalty
(HF transformers 5's rule; vLLM's leaves the end-of-sequence token out and counts the prompt's; the power
saturated at e^+-700, so a large penalty orders beams instead of overflowing) and the best W are
returned, best first. A beam's text leaves out its final end-of-sequence token unless include_stop_str_in_output
(vLLM's field).
"""
from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

from picovllm.outputs import Logprob
from picovllm.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False     # vLLM's: the end-of-sequence token's text kept in a beam's text

    def validate(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"BeamSearchParams.{name} must be an int >= 1, got {v!r}")
        if self.temperature != 0:
            raise ValueError(f"BeamSearchParams.temperature: beam search ranks by the model's log-probabilities, "
                             f"only 0 is supported, got {self.temperature!r}")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) \
                or not math.isfinite(self.length_penalty):
            raise ValueError(f"BeamSearchParams.length_penalty must be a finite number, got {self.length_penalty!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BeamSearchParams.{name} must be a bool, got {getattr(self, name)!r}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]                       # the prompt's, then the generated ones (as vLLM's)
    num_prompt_tokens: int
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)   # per generated token: its step's top 2W
    cum_logprob: float = 0.0
    finish_reason: str | None = None        # "stop" (an end-of-sequence token) or "length"
    text: str | None = None                 # the generated tokens decoded (None without a tokenizer); vLLM's
                                            # offline beam search decodes the prompt's too
    stop_reason: int | str | None = None    # vLLM's field: always None (no stop strings or stop ids in a search)

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]

    def text_token_ids(self, include_stop_str_in_output: bool = False) -> list[int]:
        """The generated tokens a beam's text is decoded from: a final end-of-sequence token left out, unless
        include_stop_str_in_output."""
        ids = self.output_token_ids
        return ids[:-1] if self.finish_reason == "stop" and not include_stop_str_in_output else ids

    def score(self, length_penalty: float) -> float:
        n = len(self.tokens) - self.num_prompt_tokens
        power = min(max(length_penalty * math.log(max(n, 1)), -700.0), 700.0)
        return self.cum_logprob * math.exp(-power)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]     # best first


def candidates(params: BeamSearchParams, eos_ids: Sequence[int]) -> int:
    """How many next tokens each live beam proposes: enough that W stay live however many of them end."""
    return max(2, 1 + (0 if params.ignore_eos else len(set(eos_ids)))) * params.beam_width


class BeamStepParams(SamplingParams):
    """A beam's step: the candidates' count is the search's (beam_width's), so EngineConfig.max_logprobs does not
    limit it (vLLM's does: a beam_width past max_logprobs / 2 fails there)."""
    within_max_logprobs = False


def step_params(params: BeamSearchParams, eos_ids: Sequence[int], vocab_size: int) -> SamplingParams:
    """What each beam runs for one step: its next token's top log-probabilities, candidates() of them, or the whole
    vocabulary where that is fewer (a beam_width past half the vocabulary: HF's search takes it too)."""
    return BeamStepParams(temperature=0, max_tokens=1, logprobs=min(candidates(params, eos_ids), vocab_size),
                          ignore_eos=True)


def expand(beams: list[BeamSearchSequence], tops: list[dict[int, Logprob]], params: BeamSearchParams,
           eos_ids: Sequence[int]) -> tuple[list[BeamSearchSequence], list[BeamSearchSequence]]:
    """One step of one prompt's search: (the next live beams, the beams finished at this step)."""
    w, k = params.beam_width, candidates(params, eos_ids)
    cands = []
    for beam, top in zip(beams, tops):
        best = sorted(top.items(), key=lambda kv: (-kv[1].logprob, kv[0]))[:k]
        for tok, lp in best:
            cands.append(BeamSearchSequence(beam.tokens + [tok], beam.num_prompt_tokens, beam.logprobs + [top],
                                            beam.cum_logprob + lp.logprob))
    cands.sort(key=lambda c: -c.cum_logprob)     # stable: a beam's earlier parent, then the token's own order
    live, done = [], []
    for i, c in enumerate(cands):
        if not params.ignore_eos and c.tokens[-1] in eos_ids:
            if i < w:
                c.finish_reason = "stop"
                done.append(c)
        elif len(live) < w:
            live.append(c)
    return live, done


def best_of(finished: list[BeamSearchSequence], live: list[BeamSearchSequence],
            params: BeamSearchParams) -> list[BeamSearchSequence]:
    for beam in live:
        beam.finish_reason = "length"
    ranked = sorted(finished + live, key=lambda b: -b.score(params.length_penalty))
    return ranked[:params.beam_width]


def search(prompts: list[list[int]], params: BeamSearchParams, eos_ids: Sequence[int]
           ) -> Generator[list[list[int]], list[dict[int, Logprob]], list[list[BeamSearchSequence]]]:
    """Every prompt's best beams, as a generator its caller drives (LLM.beam_search through LLM.generate, the
    server through its engine): it yields the token id lists to run for one step with step_params, and takes back
    each one's next-token top log-probabilities; it returns the beams, best first per prompt."""
    params.validate()
    live = [[BeamSearchSequence(list(p), len(p))] for p in prompts]
    finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not flat:
            break
        tops = yield [beam.tokens for _, beam in flat]
        for i in range(len(prompts)):
            mine = [(beam, top) for (j, beam), top in zip(flat, tops) if j == i]
            if mine:
                live[i], done = expand([b for b, _ in mine], [t for _, t in mine], params, eos_ids)
                finished[i].extend(done)
    return [best_of(finished[i], live[i], params) for i in range(len(prompts))]
