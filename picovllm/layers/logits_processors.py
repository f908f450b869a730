"""What changes a step's logits before sampling, per row, as batched tensor ops on the device.

In vLLM's order: logit bias (added), banned tokens (-inf: EOS and stop ids before min_tokens, and
bad words), then the penalties. The repetition penalty (HF/CTRL style) divides the positive logits and multiplies the
negative ones of every token seen in the prompt or the output; the frequency penalty subtracts
penalty * count and the presence penalty subtracts the penalty once, for each token the request has
generated (as OpenAI and vLLM, the prompt does not count for these two). Last, a row with allowed_token_ids
keeps those tokens only (the others at -inf).

Bad words (vLLM's): a word of one token is banned at every step; a word of several tokens has its last token
banned when the output so far ends with its other tokens (the prompt does not count, as vLLM's). The host
decides from the tokens it has (bad_word_bans); a word whose second-to-last token would be the pending one
becomes a pair (that token, the banned one) checked on the device against the step in flight.

The penalties' counts: an engine's rows carry their request's id (SamplingRow.penalty_key) and its own output list,
and PenaltyCounts keeps each request's counts on the device from step to step, adding only the outputs that came
since its last step (the prompt's tokens are marked once). A row without a key (a test's, the warm-up's) has its
counts built anew from its lists. Drafted tokens (speculative rows) and the one token the host does not have yet
(overlapped scheduling: sampled by the step in flight, read from that step's token tensor on the device) are added
to the row's copy each step, never kept. Logprobs are taken from the raw logits, before any of this (vLLM's default).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from picovllm.layers.sampler import GREEDY_BELOW

if TYPE_CHECKING:
    from picovllm.engine.model_runner import SamplingRow

# The most a repetition penalty moves a logit to, either way: still finite in float32 (max 3.4e38) once divided by the
# smallest temperature that samples, with room for rounding (an inf makes the row's softmax NaN, and its token 0)
PENALIZED_MAX = torch.finfo(torch.float32).max * GREEDY_BELOW / 4


def adjust_logits(logits: torch.Tensor, rows: Sequence["SamplingRow"],
                  prev_tokens: torch.Tensor | None = None, counts: "PenaltyCounts | None" = None) -> torch.Tensor:
    """logits [B, V] -> the logits to sample from: `logits` itself if no row asks for a change, else a
    float32 copy. prev_tokens: the tokens of the step still in flight (rows' pending_src index it).
    counts: the engine's kept penalty counts, for rows with a penalty_key."""
    biased = [i for i, r in enumerate(rows) if r.bias_token_ids]
    banned = [i for i, r in enumerate(rows) if r.banned]
    penalized = [i for i, r in enumerate(rows) if r.has_penalties]
    limited = [i for i, r in enumerate(rows) if r.allowed]
    hanging = [i for i, r in enumerate(rows) if r.bad_after]
    if not (biased or banned or penalized or limited or hanging):
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
    if hanging:       # bad words whose last token is banned if the pending token is the one before it
        if prev_tokens is None:
            raise ValueError("a row's bad word hangs on a pending token, but no step in flight was given")
        which, after = _flatten([rows[i].bad_after for i in hanging], hanging)
        src = [rows[i].pending_src for i in hanging for _ in rows[i].bad_after]
        ban = [t for i in hanging for t in rows[i].bad_ban]
        hit = prev_tokens[_to(src, dev)] == _to(after, dev)
        out.index_put_((_to(which, dev), _to(ban, dev)), torch.where(hit, float("-inf"), 0.0), accumulate=True)
    if penalized:
        _apply_penalties(out, [rows[i] for i in penalized], _to(penalized, dev), prev_tokens, counts)
    if limited:       # allowed_token_ids: every other token of the row at -inf
        which, ids = _flatten([rows[i].allowed for i in limited], range(len(limited)))
        keep = torch.full((len(limited), out.shape[-1]), float("-inf"), device=dev)
        keep[_to(which, dev), _to(ids, dev)] = 0.0
        out[_to(limited, dev)] += keep
    return out


def _apply_penalties(logits: torch.Tensor, rows: list["SamplingRow"], idx: torch.Tensor,
                     prev_tokens: torch.Tensor | None, kept: "PenaltyCounts | None" = None) -> None:
    """In place on logits[idx] (rows: those rows)."""
    dev, vocab = logits.device, logits.shape[-1]
    repeat = any(r.repetition_penalty != 1 for r in rows)    # decided on the host: a device check would sync
    if kept is not None and all(r.penalty_key is not None for r in rows):
        counts, in_prompt = kept.rows(rows, vocab, repeat)
        drafts = [r.ahead for r in rows]
        if any(drafts):
            which, ids = _flatten(drafts, range(len(rows)))
            counts.index_put_((_to(which, dev), _to(ids, dev)), torch.ones(len(ids), device=dev), accumulate=True)
    else:
        counts = token_counts([r.counted_outputs() for r in rows], vocab, dev)
        in_prompt = token_counts([r.prompt_token_ids for r in rows], vocab, dev) > 0 if repeat else None
    pending = [(j, r.pending_src) for j, r in enumerate(rows) if r.pending_src >= 0]
    if pending:
        if prev_tokens is None:
            raise ValueError("a row's last output token is pending, but no step in flight was given")
        js, src = zip(*pending)
        counts.index_put_((_to(js, dev), prev_tokens[_to(src, dev)]), torch.ones(len(js), device=dev),
                          accumulate=True)
    sub = logits[idx]
    if repeat:
        # an extreme penalty leaves float32's range (1e-300 is 0 there; 1e-38 takes a logit of 5 past it): held within
        # +-PENALIZED_MAX, the seen tokens it favours tie at the top, those it disfavours sink; a banned one stays -inf
        rep = _to([r.repetition_penalty for r in rows], dev, torch.float32).clamp(min=torch.finfo(torch.float32).tiny)
        seen = ((counts > 0) | in_prompt) & sub.isfinite()
        penalized = torch.where(sub < 0, sub * rep[:, None], sub / rep[:, None]).clamp(-PENALIZED_MAX, PENALIZED_MAX)
        sub = torch.where(seen, penalized, sub)
    freq = _to([r.frequency_penalty for r in rows], dev, torch.float32)[:, None]
    pres = _to([r.presence_penalty for r in rows], dev, torch.float32)[:, None]
    logits[idx] = sub - freq * counts - pres * (counts > 0)


class _Slot:
    __slots__ = ("index", "outputs", "counted", "prompt", "used")

    def __init__(self, index: int, outputs: list[int]) -> None:
        self.index, self.outputs, self.counted, self.prompt, self.used = index, outputs, 0, None, 0


class PenaltyCounts:
    """Each penalized request's counts, kept on the device from step to step (one per engine, rank 0's): how often
    each token occurs in the outputs the host has, and which tokens its prompt holds (the repetition penalty's). A
    step uploads only the outputs that came since the request's last step, where building every row's counts anew
    cost host time in proportion to all the batch's tokens each step (~30 ms at batch 256 with 1,000-token outputs).

    A request's slot holds the list objects it counted (SamplingRow.output_token_ids, only appended to): another
    list under the same key (a new request reusing the id, a D's handover) starts the count again. Slots of requests
    not in a step are taken over, least recently used first, once the table is full; it grows (doubling) to the most
    requests a step has penalized, never past max_slots (the engine's max_num_seqs) unless a step needs more; a GPU
    engine's takes max_slots at once, in its memory profile (allocate), so that the KV budget counts it. Nothing to
    free: a finished request's slot is the first taken over."""

    MIN_SLOTS = 8

    def __init__(self, device: torch.device, max_slots: int | None = None) -> None:
        self.device = device
        self.max_slots = max_slots
        self.counts: torch.Tensor | None = None       # [slots, vocab] float32
        self.in_prompt: torch.Tensor | None = None    # [slots, vocab] bool
        self.slots: dict[str, _Slot] = {}
        self.free: list[int] = []
        self.steps = 0

    def rows(self, rows: list["SamplingRow"], vocab: int, prompts: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """For rows with a penalty_key: a copy of their counts ([len(rows), vocab] float32: each row's
        output_token_ids[:num_outputs]), and whether each token is in its prompt ([len(rows), vocab] bool) if
        `prompts` (rows with a repetition penalty carry their prompt_token_ids)."""
        self.steps += 1
        keys = {r.penalty_key for r in rows}
        self._reserve(len(keys), vocab)
        dev = self.device
        reset, new_which, new_ids, marked, slot_of = [], [], [], [], []
        for r in rows:
            s = self.slots.get(r.penalty_key)
            n = r.num_outputs if r.num_outputs >= 0 else len(r.output_token_ids)
            if s is None or s.outputs is not r.output_token_ids or s.counted > n:
                s = self._take(r.penalty_key, r.output_token_ids, keys)
                reset.append(s.index)
            if s.counted < n:
                new = r.output_token_ids[s.counted:n]
                new_which += [s.index] * len(new)
                new_ids += new
                s.counted = n
            if r.repetition_penalty != 1 and s.prompt is not r.prompt_token_ids:
                s.prompt = r.prompt_token_ids
                marked.append(s)
            s.used = self.steps
            slot_of.append(s.index)
        if reset:
            self.counts[_to(reset, dev)] = 0.0
        if new_ids:
            self.counts.index_put_((_to(new_which, dev), _to(new_ids, dev)), torch.ones(len(new_ids), device=dev),
                                   accumulate=True)
        if marked:
            self.in_prompt[_to([s.index for s in marked], dev)] = False
            which, ids = _flatten([s.prompt for s in marked], [s.index for s in marked])
            if ids:
                self.in_prompt[_to(which, dev), _to(ids, dev)] = True
        idx = _to(slot_of, dev)
        return self.counts.index_select(0, idx), self.in_prompt.index_select(0, idx) if prompts else None

    def allocate(self, vocab: int) -> None:
        """The table at its full size (max_slots) now, where it would grow as steps penalize more requests: the
        GPU memory profile's (engine/kv_cache.py), whose budget then counts it as memory in use."""
        self._reserve(self.max_slots or self.MIN_SLOTS, vocab)

    def forget(self) -> None:
        """No request's counts kept: every slot free (the memory profile's made-up requests, once it has run)."""
        self.slots.clear()
        self.free = [] if self.counts is None else list(range(self.counts.shape[0]))

    def _reserve(self, needed: int, vocab: int) -> None:
        """At least `needed` slots, the old ones kept (the table doubles)."""
        have = 0 if self.counts is None else self.counts.shape[0]
        if self.counts is not None and self.counts.shape[1] != vocab:
            raise ValueError(f"PenaltyCounts: logits of {vocab} tokens after {self.counts.shape[1]}")
        if have >= needed:
            return
        size = max(needed, 2 * have, self.MIN_SLOTS)
        if self.max_slots is not None:
            size = max(needed, min(size, self.max_slots))
        counts = torch.zeros(size, vocab, dtype=torch.float32, device=self.device)
        in_prompt = torch.zeros(size, vocab, dtype=torch.bool, device=self.device)
        if have:
            counts[:have], in_prompt[:have] = self.counts, self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self.free += range(have, size)

    def _take(self, key: str, outputs: list[int], in_step: set) -> _Slot:
        """A slot for key, counting nothing yet: its own again, a free one, or the least recently used one of a
        request not in this step."""
        old = self.slots.pop(key, None)
        if old is not None:
            index = old.index
        elif self.free:
            index = self.free.pop()
        else:
            victim = min((k for k in self.slots if k not in in_step), key=lambda k: self.slots[k].used)
            index = self.slots.pop(victim).index
        slot = self.slots[key] = _Slot(index, outputs)
        return slot


def bad_word_bans(words: list[list[int]], output: list[int], pending: bool) -> tuple[list[int], list[int], list[int]]:
    """The bans of bad words (token ids) before the next token: (banned now, then pairs after[j] -> ban[j]:
    ban[j] is banned if the pending token, which the host does not have yet, is after[j]).
    output: the output tokens the host has; pending: one more is on the device."""
    now, after, ban = [], [], []
    n = len(output) + pending
    for word in words:
        *prefix, last = word
        if len(prefix) > n:
            continue
        if pending and prefix:       # the prefix's last token is the pending one
            head = prefix[:-1]
            if not head or output[-len(head):] == head:
                after.append(prefix[-1])
                ban.append(last)
        elif not prefix or output[-len(prefix):] == prefix:
            now.append(last)
    return now, after, ban


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's reading of bad words: each word (leading spaces dropped) as it is tokenized at the start of a text,
    and after a space when that gives as many tokens and a different first one (a word inside a text)."""
    out = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:      # nothing to ban: the request cannot be honoured as asked
            raise ValueError(f"SamplingParams.bad_words: {word!r} is no token of the model's tokenizer")
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(bare)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return out


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
