"""What generation returns, with vLLM's names: RequestOutput holding CompletionOutputs; and what LLM.embed returns,
EmbeddingRequestOutput, and LLM.encode's PoolingRequestOutput."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """vLLM's: a token's logprob (SamplingParams.logprobs says which distribution), its rank (1: the most likely; vLLM's
    count of the tokens at least as likely, a top-k entry's its place among them) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


MIN_LOGPROB = -9999.0     # what a logprob of -inf (a token a grammar forbids) reads as in JSON, as vLLM's and OpenAI's


def json_logprob(logprob: float | None) -> float | None:
    """A logprob as JSON can carry it: -inf (json.dumps would write -Infinity, which is not JSON) as MIN_LOGPROB."""
    return None if logprob is None else max(logprob, MIN_LOGPROB)


class ListPrefix(Sequence):
    """The first len(items) items of a list that is only ever appended to, read-only: what a list copy of it would
    hold, taken in O(1). A served request's outputs are cumulative, and the API server adds each step's new tokens to
    one list a request (output_deltas.OutputsFromDeltas): every output it hands out is a prefix of that list, which
    later steps never change, where copying the list for each output cost every step in proportion to each request's
    length (and the garbage collector's walks over the copies). Reads as a list: slices are lists, it equals a list
    of the same items, and pickles as one."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list) -> None:
        self._items, self._n = items, len(items)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            return self._items[start:stop] if step == 1 else [self._items[j] for j in range(start, stop, step)]
        if not -self._n <= i < self._n:
            raise IndexError("list index out of range")
        return self._items[i + self._n if i < 0 else i]

    def __iter__(self):
        return itertools.islice(self._items, self._n)

    def prefix_of(self, items: list | ListPrefix) -> bool:
        """Whether this is known, in O(1), to be a prefix of items: a view of that very list, or of the list that
        items views, and no longer. False says only that it is not known (compare the items)."""
        return (items._items if isinstance(items, ListPrefix) else items) is self._items and len(items) >= self._n

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, ListPrefix)):
            return len(other) == self._n and self[:] == other[:]
        return NotImplemented

    __hash__ = None     # as a list's

    def __add__(self, other) -> list:
        return self[:] + list(other)

    def __radd__(self, other) -> list:
        return list(other) + self[:]

    def __repr__(self) -> str:
        return repr(self[:])

    def __reduce__(self):
        return list, (self[:],)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # wall time of each output token

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # A prefill instance of a fleet: where the request's KV waits for a decode instance (a PublishedKV as
    # JSON), on its last output (finished, no finish reason: the request goes on elsewhere).
    kv_handover: dict | None = None
    # A pooling engine's request (engine/pooling.py), finished: its embedding (its one CompletionOutput is empty)
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    """vLLM's: one prompt's embedding."""
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's: what LLM.embed returns per prompt."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0      # vLLM's: the prompt's tokens found in the prefix cache


@dataclass
class PoolingOutput:
    """vLLM's: one prompt's pooled output (here an embedding) as a tensor."""
    data: Any       # torch.Tensor


@dataclass
class PoolingRequestOutput:
    """vLLM's: what LLM.encode returns per prompt."""
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


def merge_deltas(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One DELTA output holding what two consecutive ones of a request hold (older first): each completion's text,
    token ids and logprobs joined, by index (a completion only one of them has is kept as it is); the newer one's
    running totals and state (cumulative_logprob, finish and stop reasons, finished, metrics, num_cached_tokens), its
    error or the older one's, the prompt's logprobs of whichever has them (the first output alone does). Neither is
    changed."""
    merged = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        o = merged.get(c.index)
        if o is not None:
            logprobs = None if o.logprobs is None and c.logprobs is None else (o.logprobs or []) + (c.logprobs or [])
            c = CompletionOutput(c.index, o.text + c.text, o.token_ids + c.token_ids, c.cumulative_logprob, logprobs,
                                 c.finish_reason, c.stop_reason)
        merged[c.index] = c
    first = older.prompt_logprobs is not None
    return dataclasses.replace(newer, outputs=[merged[i] for i in sorted(merged)], error=newer.error or older.error,
                               prompt_logprobs=older.prompt_logprobs if first else newer.prompt_logprobs,
                               kv_handover=newer.kv_handover or older.kv_handover,
                               embedding=newer.embedding if newer.embedding is not None else older.embedding)
