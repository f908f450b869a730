"""Speculative decoding by n-gram lookup (EngineConfig.speculative_config, method "ngram": vLLM's prompt lookup).

Each step, a decoding request may feed drafted tokens after its last one: the tokens that followed the latest
earlier occurrence of its sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min; the
longest match wins, then the latest). The step computes the last token and the drafts as one chunk and samples a
token at every one of its positions, each with the request's own sampling (its temperature, filters, seed stream,
penalties and bans as if the drafts before it were outputs: step_input.sampling_row's `ahead`). The engine keeps
the sampled tokens while each equals the draft that was fed after it, and the first that does not (or a token past
the last draft): at least one token a step, at most drafts + 1.

That is exact, not an approximation. A draft is a fixed token d, so keeping the model's own sample t when t == d
and taking t otherwise gives each token with the model's probability: P(d) when d was drafted, and P(x) for any
other x (the rejection-sampling rule of speculative decoding with a one-hot draft). Greedy and seeded requests get
the very tokens they get without speculation (a token's seed stream is its output index's), up to the numerics of
another batch shape; the KV of rejected drafts sits past the request's computed tokens and is overwritten by the next
step.

A request under a structured output's grammar drafts only what its grammar takes (the drafts cut before the first
it refuses, or a stop token), and each row gets the mask of the grammar advanced by the drafts before it
(GrammarState.valid_drafts, fill_ahead); it does not speculate inside a reasoning gate's think block, nor with a
token in flight (overlapped: the grammar has not taken it yet).

Overlapped scheduling (the next step is scheduled before this one's tokens are known) keeps on. A request whose
last token is still in flight drafts from its known tokens: the match's next token stands for the one in flight,
the tokens after it are the drafts, and the chunk's first row reads the real token on the device (a wrong guess
costs drafts, never a wrong token). While its speculative chunk is in flight the request sits the next step out
(how many tokens it keeps is not known yet); then, its tokens all known, it drafts from them. Sitting out costs a
step, so a request that keeps fewer than 2 drafts backs off (LookupState); requests without matches decode every
step, overlapped, as without speculation.

What does not speculate (a plain decode instead): a request with bad words or a grammar whose last token is in
flight (both follow that token), one backing off (overlapped), any step
where the token budget or the decode rows (EngineConfig.max_decode_rows) leave no room, and any step with more running
requests than disable_by_batch_size.
"""
from __future__ import annotations

import numpy as np

from picovllm.config import SpeculativeConfig
from picovllm.engine.request import Request


# overlapped scheduling: a speculative chunk costs its request the next step (it sits that one out), so one that keeps
# fewer than 2 drafts backs off: it drafts through a token in flight again only after 2 ** misses more tokens (at
# most 2 ** MAX_BACKOFF)
MAX_BACKOFF = 5


class NgramProposer:
    """The scheduler's `drafts` callable for method "ngram"."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, overlapped: bool = False) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.batch_limit = config.disable_by_batch_size
        self.max_model_len = max_model_len
        self.overlapped = overlapped     # the engine's async_scheduling: a speculative chunk costs a step sat out

    def __call__(self, req: Request, room: int, running: int) -> list[int]:
        """Drafts for a decoding request's next step, at most room of them (what the step's token budget leaves),
        or [] where it does not speculate; running: how many requests the scheduler runs.

        A request with a token in flight (overlapped scheduling) looks up its known tokens: the match's next token
        stands for the one in flight, and the tokens after it are the drafts (a request under a grammar or with bad
        words does not: both follow the token in flight)."""
        if req.pooling is not None or (self.batch_limit is not None and running > self.batch_limit):
            return []
        # positions up to max_model_len - 1; no more than the tokens it may still produce, less the one of its own
        k = min(self.k, room, self.max_model_len - req.num_tokens, req.max_tokens - req.num_output_tokens - 1)
        if k <= 0:
            return []
        state = _state(req)
        if self.overlapped and req.num_output_tokens < state.resume_at:      # backing off
            return []
        if req.num_pending_tokens:
            if req.grammar is not None or req.bad_words_ids:
                return []
            return ngram_drafts(state.tokens(req), k + 1, self.min_n, self.max_n)[1:]
        if req.grammar is not None and req.grammar.num_accepted < len(req.output_token_ids):
            return []
        drafts = ngram_drafts(state.tokens(req), k, self.min_n, self.max_n)
        return req.grammar.valid_drafts(drafts) if drafts and req.grammar is not None else drafts

    @staticmethod
    def record(req: Request, kept: int) -> None:
        """The drafts a request kept of its last speculative chunk (the overlapped engine's backoff)."""
        state = _state(req)
        state.misses = 0 if kept >= 2 else state.misses + 1
        state.resume_at = req.num_output_tokens + (2 ** min(state.misses, MAX_BACKOFF) if state.misses else 0)


def ngram_drafts(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of tokens' last n (the longest n in
    [min_n, max_n] that occurs), or [] if none does."""
    last = len(tokens) - 1
    if last < min_n:
        return []
    alive = np.flatnonzero(tokens[:last] == tokens[last])     # ends j of matches of length 1 (j < last)
    best = int(alive[-1]) if alive.size and min_n <= 1 else -1
    for m in range(1, min(max_n, last)):       # extend every surviving match one token back
        alive = alive[alive >= m]
        alive = alive[tokens[alive - m] == tokens[last - m]]
        if not alive.size:
            break
        if m + 1 >= min_n:
            best = int(alive[-1])
    if best < 0:
        return []
    return tokens[best + 1:best + 1 + k].tolist()


class LookupState:
    """What the proposer keeps on a request (Request.lookup): its token ids as an int64 array, extended by what is
    new at each lookup instead of built again from the lists; and the overlapped engine's backoff."""

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int64)
        self.n = 0
        self.misses = 0           # speculative chunks in a row that kept fewer than 2 drafts
        self.resume_at = 0        # no drafts through a token in flight before this many output tokens

    def tokens(self, req: Request) -> np.ndarray:
        total = req.num_known_tokens
        if total > len(self.buf):
            grown = np.empty(max(total, 2 * len(self.buf)), dtype=np.int64)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        if total > self.n:
            self.buf[self.n:total] = req.token_ids(self.n, total)
        self.n = total
        return self.buf[:total]


def _state(req: Request) -> LookupState:
    if req.lookup is None:
        req.lookup = LookupState()
    return req.lookup
