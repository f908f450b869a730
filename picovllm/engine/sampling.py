"""Sampling of a step: logits -> LaunchedStep (tokens queued on the device) -> StepResult (read on the host).

The logit adjustments live in layers/logits_processors.py and the samplers in layers/sampler.py; this
module batches a step's SamplingRows into them, asks for logprobs, and owns the step's one host sync.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import torch

from picovllm.engine.step_input import SamplingRow, StepInput, to_device
from picovllm.layers.logits_processors import PenaltyCounts, adjust_logits
from picovllm.layers.sampler import SamplingTensors, greedy_tokens, sample, sample_temperature_only
from picovllm.layers.structured_output import TokenBitmasks, apply_token_bitmasks, device_masks
from picovllm.outputs import Logprob


@dataclass
class StepResult:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]
    # SamplingParams.prompt_logprobs: (sequence index in the step, position, the logprobs of the
    # prompt token at position + 1), in the step's order
    prompt_logprobs: list[tuple[int, int, dict[int, Logprob]]] = field(default_factory=list)
    # a pooling engine's step: one float32 row (on the host) per StepInput.pooled_rows range (engine/pooling.py)
    pooled: torch.Tensor | None = None


@dataclass
class LaunchedStep:
    """A step whose device work is queued: the sampled tokens stay on the device (the next step's
    inputs read them there) and are copied to host memory that resolve() reads once `done` is reached."""
    tokens: torch.Tensor | None            # [num sampled rows] on the device; None if nothing samples
    host: list[torch.Tensor]               # tokens, then the logprob tensors, as host copies
    rows: list[SamplingRow]
    done: torch.cuda.Event | None          # recorded after the copies (CUDA); None on CPU
    prompt_host: list[torch.Tensor] = field(default_factory=list)   # prompt-logprob tensors, host copies
    prompt_rows: list[tuple[int, int, int, int]] = field(default_factory=list)  # (sequence, position, target, k)
    pooled: torch.Tensor | None = None     # a pooling step's rows, host copy (engine/pooling.py); nothing samples


def launch_sampling(logits: torch.Tensor | None, step: StepInput, prev_tokens: torch.Tensor | None = None,
                    penalty_counts: PenaltyCounts | None = None) -> LaunchedStep:
    """Queue sampling, the prompt logprobs and the host copies. logits: the sampled rows', then the
    prompt-logprob rows'. prev_tokens: the in-flight step's sampled tokens (penalties count a pending
    output from there). penalty_counts: the engine's, kept from step to step."""
    if logits is None:
        return LaunchedStep(None, [], [], None)
    k = len(step.sample_indices)
    tokens, host = None, []
    if k:
        tokens, logprob_tensors = sample_logits(logits[:k], step.sampling, prev_tokens, step.token_bitmasks,
                                                penalty_counts)
        host = [_to_host(t) for t in (tokens, *logprob_tensors)]
    launched = LaunchedStep(tokens, host, step.sampling, None)
    if step.prompt_indices:
        topk = max(num_top(n, logits.shape[-1]) for n in step.prompt_topk)
        launched.prompt_host = [_to_host(t) for t in prompt_logprob_tensors(logits[k:], step.prompt_targets, topk)]
        qsl, lens = step.query_start_loc, step.seq_lens
        seqs = [bisect_right(qsl, i) - 1 for i in step.prompt_indices]
        # a row's token index in its sequence (not step.positions: the rotary's, LongRoPE's offset included)
        launched.prompt_rows = [(q, lens[q] - qsl[q + 1] + i, target, topk) for q, i, target, topk
                                in zip(seqs, step.prompt_indices, step.prompt_targets, step.prompt_topk)]
    if logits.is_cuda:
        launched.done = torch.cuda.Event()
        launched.done.record()
    return launched


def resolve(launched: LaunchedStep) -> StepResult:
    """Wait for a launched step and read its sampled tokens (the step loop's one host sync)."""
    if launched.done is not None:
        launched.done.synchronize()
    result = StepResult([], [])
    if launched.tokens is not None:
        tokens = launched.host[0].tolist()
        result = StepResult(tokens, _logprob_dicts(tokens, launched.host[1:], launched.rows))
    if launched.prompt_rows:
        result.prompt_logprobs = _prompt_logprob_dicts(launched.prompt_host, launched.prompt_rows)
    result.pooled = launched.pooled
    return result


def sample_logits(logits: torch.Tensor, rows: list[SamplingRow], prev_tokens: torch.Tensor | None = None,
                  token_bitmasks: TokenBitmasks | None = None, penalty_counts: PenaltyCounts | None = None
                  ) -> tuple[torch.Tensor, tuple]:
    """Sampled token ids [B] on the device, and the logprob tensors the rows ask for (or ()).
    token_bitmasks: the rows' grammar masks (structured outputs), if any; penalty_counts: the engine's kept counts.
    logits in the model's dtype: the fused GPU sampler reads them as they are, the torch
    sampler and logprobs upcast to float32 themselves."""
    dev = logits.device
    raw = logits
    logits = adjust_logits(logits, rows, prev_tokens, penalty_counts)   # bias, banned tokens, penalties
    temps = [r.temperature for r in rows]
    masked = token_bitmasks is not None and bool(token_bitmasks.filled)
    if logits.is_cuda and (masked or any(temps)) and not any(r.filtered for r in rows):
        # one upload and one kernel: the fused Gumbel-max sampler, the grammar masks applied in its pass
        masks = device_masks(token_bitmasks, dev) if masked else (None, None)
        tokens = sample_temperature_only(logits, temps, [r.seed if r.temperature > 0 else None for r in rows], *masks)
        return tokens, _logprob_tensors(raw, tokens, rows, token_bitmasks)
    logits = apply_token_bitmasks(logits, token_bitmasks)   # structured outputs
    if all(x == 0 for x in temps):   # greedy batch: no sampling tensors to upload
        tokens = greedy_tokens(logits)
        return tokens, _logprob_tensors(raw, tokens, rows, token_bitmasks)
    t = SamplingTensors(
        temperature=to_device(temps, torch.float32, dev),
        top_k=to_device([r.top_k for r in rows], torch.long, dev),
        top_p=to_device([r.top_p for r in rows], torch.float32, dev),
        min_p=to_device([r.min_p for r in rows], torch.float32, dev),
        seeds=[r.seed if r.temperature > 0 else None for r in rows],
        all_greedy=all(x == 0 for x in temps),
        any_top_k=any(r.top_k > 0 for r in rows),
        any_top_p=any(r.top_p < 1 for r in rows),
        any_min_p=any(r.min_p > 0 for r in rows),
        filtered=[r.filtered for r in rows])
    tokens = sample(logits, t)
    return tokens, _logprob_tensors(raw, tokens, rows, token_bitmasks)


def num_top(n: int | None, vocab: int) -> int:
    """How many top logprobs SamplingParams.logprobs (prompt_logprobs) n asks for: -1 is the whole vocabulary."""
    return vocab if n == -1 else n or 0


def _logprob_tensors(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow],
                     token_bitmasks: TokenBitmasks | None = None) -> tuple:
    """(chosen token's logprob, its rank, top-k values, top-k ids) on the device, or () if no row asks.
    vLLM's default logprobs mode, raw_logprobs: the model's own distribution, before logit bias, penalties, bans,
    temperature and top-k/p, but within a structured output's grammar (vLLM masks the logits with it before its
    sampler: a token the grammar forbids has logprob -inf), so the masks are applied again here."""
    want = [r.logprobs for r in rows]
    if all(w is None for w in want):
        return ()
    logp = apply_token_bitmasks(raw, token_bitmasks).float().log_softmax(-1)
    return _gathered(logp, tokens, max(num_top(w, raw.shape[-1]) for w in want))


def _gathered(logp: torch.Tensor, targets: torch.Tensor, k: int) -> tuple:
    """(each target's logprob, its rank, the top-k values and ids) of logprob rows. The rank is vLLM's: how many
    tokens are at least as likely, the target included (so a tie ranks it after the tokens it ties with)."""
    chosen = logp.gather(-1, targets[:, None])[:, 0]
    ranks = (logp >= chosen[:, None]).sum(-1)
    top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], ranks[:, None][:, :0])
    return chosen, ranks, top_v, top_i


def prompt_logprob_tensors(logits: torch.Tensor, targets: list[int], topk: int) -> tuple:
    """(each target's logprob, its rank, top-k values, top-k ids) of the prompt-logprob rows, on the device: one
    float32 log-softmax of at most scheduler.PROMPT_LOGPROB_ROWS rows (a step scores no more; the memory profile
    reserves that many)."""
    return _gathered(logits.float().log_softmax(-1), to_device(targets, torch.long, logits.device), topk)


def _prompt_logprob_dicts(host: list[torch.Tensor], rows: list[tuple[int, int, int, int]]) -> list:
    """(sequence, position, {prompt token: its Logprob, then the top-k}) per row, as vLLM's prompt_logprobs."""
    chosen_l, ranks_l, top_v_l, top_i_l = (t.tolist() for t in host)
    return [(seq, pos, _logprob_dict(target, chosen_l[i], ranks_l[i], top_v_l[i], top_i_l[i], topk))
            for i, (seq, pos, target, topk) in enumerate(rows)]


def _logprob_dicts(tokens: list[int], host: list[torch.Tensor], rows: list[SamplingRow]) -> list:
    if not host:
        return [None] * len(rows)
    chosen_l, ranks_l, top_v_l, top_i_l = (t.tolist() for t in host)
    return [None if r.logprobs is None else
            _logprob_dict(tokens[i], chosen_l[i], ranks_l[i], top_v_l[i], top_i_l[i], r.logprobs)
            for i, r in enumerate(rows)]


def _logprob_dict(token: int, logprob: float, rank: int, top_v: list[float], top_i: list[int],
                  n: int) -> dict[int, Logprob]:
    """vLLM's dict of one position: the token first, then the top n (-1: all of top_v), each ranked by its place. A
    token among the top n takes that place's rank (vLLM's), which differs from `rank` only where it ties with
    another: every rank in the dict is then a different one."""
    d = {token: Logprob(logprob, rank)}
    for j in range(len(top_i) if n == -1 else n):
        d[top_i[j]] = Logprob(top_v[j], j + 1)
    return d


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor, made without blocking (the caller waits on an event)."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
