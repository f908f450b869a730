"""What changes a step's logits before sampling, per row, as batched tensor ops on the device.

In vLLM's order: logit bias (added), banned tokens (-inf: EOS and stop ids before min_tokens), then
the penalties. The repetition penalty (HF/CTRL style) divides the positive logits and multiplies the
negative ones of every token seen in the prompt or the output; the frequency penalty subtracts
penalty * count and the presence penalty subtracts the penalty once, for each token the request has
generated (as OpenAI and vLLM, the prompt does not count for these two). Last, a row with allowed_token_ids
keeps those tokens only (the others at -inf).

No state lives between steps: each row carries its token ids (plain lists, see SamplingRow) and one
upload plus one scatter per step turns them into per-row counts. So preemption, a P/D handover and a
finished request need no bookkeeping here. The one token the host does not have yet (overlapped
scheduling: sampled by the step in flight) is read from that step's token tensor on the device.
Logprobs are taken from the raw logits, before any of this (vLLM's default).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from picovllm.engine.model_runner import SamplingRow


def adjust_logits(logits: torch.Tensor, rows: Sequence["SamplingRow"],
                  prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> the logits to sample from: `logits` itself if no row asks for a change, else a
    float32 copy. prev_tokens: the tokens of the step still in flight (rows' pending_src index it)."""
    biased = [i for i, r in enumerate(rows) if r.bias_token_ids]
    banned = [i for i, r in enumerate(rows) if r.banned]
    penalized = [i for i, r in enumerate(rows) if r.has_penalties]
    limited = [i for i, r in enumerate(rows) if r.allowed]
    if not (biased or banned or penalized or limited):
        return logits
    out = logits.to(torch.float32, copy=True)
    dev = out.device
    if biased:
        which, ids = _flatten([rows[i].bias_token_ids for i in biased], biased)
        values = [v for i in biased for v in rows[i].bias_values]
        out.index_put_((_to(which, dev), _to(ids, dev)), _to(values, dev, torch.float32), accumulate=True)
    if banned:
        which, ids = _flatten([rows[i].banned for i in banned], banned)
        out[_to(which, dev), _to(ids, dev)] = float("-inf")
    if penalized:
        _apply_penalties(out, [rows[i] for i in penalized], _to(penalized, dev), prev_tokens)
    if limited:       # allowed_token_ids: every other token of the row at -inf
        which, ids = _flatten([rows[i].allowed for i in limited], range(len(limited)))
        keep = torch.full((len(limited), out.shape[-1]), float("-inf"), device=dev)
        keep[_to(which, dev), _to(ids, dev)] = 0.0
        out[_to(limited, dev)] += keep
    return out


def _apply_penalties(logits: torch.Tensor, rows: list["SamplingRow"], idx: torch.Tensor,
                     prev_tokens: torch.Tensor | None) -> None:
    """In place on logits[idx] (rows: those rows)."""
    dev, vocab = logits.device, logits.shape[-1]
    counts = token_counts([r.output_token_ids for r in rows], vocab, dev)
    pending = [(j, r.pending_src) for j, r in enumerate(rows) if r.pending_src >= 0]
    if pending:
        if prev_tokens is None:
            raise ValueError("a row's last output token is pending, but no step in flight was given")
        js, src = zip(*pending)
        counts.index_put_((_to(js, dev), prev_tokens[_to(src, dev)]), torch.ones(len(js), device=dev),
                          accumulate=True)
    sub = logits[idx]
    if any(r.repetition_penalty != 1 for r in rows):   # decided on the host: a device check would sync
        rep = _to([r.repetition_penalty for r in rows], dev, torch.float32)[:, None]
        seen = (counts > 0) | (token_counts([r.prompt_token_ids for r in rows], vocab, dev) > 0)
        sub = torch.where(seen, torch.where(sub < 0, sub * rep, sub / rep), sub)
    freq = _to([r.frequency_penalty for r in rows], dev, torch.float32)[:, None]
    pres = _to([r.presence_penalty for r in rows], dev, torch.float32)[:, None]
    logits[idx] = sub - freq * counts - pres * (counts > 0)


def token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token occurs in each list (one upload, one scatter)."""
    which, ids = _flatten(token_lists, range(len(token_lists)))
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32, device=device)
    if ids:
        counts.index_put_((_to(which, device), _to(ids, device)), torch.ones(len(ids), device=device),
                          accumulate=True)
    return counts


def _flatten(lists: list[list[int]], row_ids) -> tuple[list[int], list[int]]:
    """(row id of each element, the elements), concatenated."""
    which, flat = [], []
    for row, values in zip(row_ids, lists):
        which += [row] * len(values)
        flat += values
    return which, flat


def _to(data, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    if device.type == "cuda":
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(data, dtype=dtype, device=device)
