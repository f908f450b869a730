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
(GrammarState.valid_drafts, fill_ahead); inside a reasoning gate's think block it does not speculate.

What does not speculate (a plain decode instead): one with a token in flight (overlapped scheduling: refused with speculative_config), any step
where the token budget or the decode rows (EngineConfig.max_decode_rows) leave no room, and any step with more running
requests than disable_by_batch_size.
"""
from __future__ import annotations

import numpy as np

from picovllm.config import SpeculativeConfig
from picovllm.engine.request import Request


class NgramProposer:
    """The scheduler's `drafts` callable for method "ngram"."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.batch_limit = config.disable_by_batch_size
        self.max_model_len = max_model_len

    def __call__(self, req: Request, room: int, running: int) -> list[int]:
        """Drafts for a decoding request's next step, at most room of them (what the step's token budget leaves),
        or [] where it does not speculate; running: how many requests the scheduler runs."""
        if req.num_pending_tokens or req.pooling is not None:
            return []
        if self.batch_limit is not None and running > self.batch_limit:
            return []
        # positions up to max_model_len - 1; no more than the tokens it may still produce, less the one of its own
        k = min(self.k, room, self.max_model_len - req.num_tokens, req.max_tokens - req.num_output_tokens - 1)
        if k <= 0 or (req.grammar is not None and req.grammar.num_accepted < len(req.output_token_ids)):
            return []
        drafts = ngram_drafts(_tokens(req), k, self.min_n, self.max_n)
        return req.grammar.valid_drafts(drafts) if req.grammar is not None and drafts else drafts


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


class TokenArray:
    """A request's token ids as an int64 array, kept on the request (Request.lookup_tokens) and extended by what is
    new at each lookup instead of built again from the lists."""

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int64)
        self.n = 0

    def of(self, req: Request) -> np.ndarray:
        total = req.num_known_tokens
        if total > len(self.buf):
            grown = np.empty(max(total, 2 * len(self.buf)), dtype=np.int64)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        if total > self.n:
            self.buf[self.n:total] = req.token_ids(self.n, total)
        self.n = total
        return self.buf[:total]


def _tokens(req: Request) -> np.ndarray:
    if req.lookup_tokens is None:
        req.lookup_tokens = TokenArray()
    return req.lookup_tokens.of(req)
