"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running decodes first (one token each, never starved), then running prefills
(their next chunk), then waiting requests in FCFS order while budget, blocks and
max_num_seqs allow. When a running request needs a block and none is free, the most
recently admitted running request is preempted: its blocks are freed (kept as cached
prefix blocks) and it goes back to the front of the queue, to be recomputed later.

The "priority" policy (vLLM's): the waiting queue is kept in order of (priority, arrival) instead, a lower
priority value first, and the request preempted for blocks is the running one last in that order. A waiting
request never preempts a running one: it is admitted first once there is room.

With a KV connector (roles p and d, picovllm/engine/kv_connector.py) a third queue holds requests
out of the batch whose blocks the connector uses: P's requests being handed over, D's requests
whose KV is arriving. Only this class moves requests between its queues; the connector answers
its questions, the engine applies what the connector reports through release() and kv_arrived().

Logit rows. A step computes vocabulary-wide logits at each row that samples and, for SamplingParams.prompt_logprobs,
at each prompt position it scores: a chunk of such a request has about a row a token. The memory profile that sizes
the KV cache computes max_logit_rows of them (engine/kv_cache.py), so a step must never have more: sampled rows are
bounded by max_num_seqs and the drafts, and a step scores at most PROMPT_LOGPROB_ROWS prompt positions, the chunks of
prompt_logprobs requests shrinking to fit (a request left none goes on at the next step, in its place).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from picovllm.engine.block_manager import BlockManager
from picovllm.engine.kv_connector import KVConnector
from picovllm.engine.request import DECODING, PREFILL, WAITING, Request

if TYPE_CHECKING:
    from picovllm.config import EngineConfig

# The most prompt positions a step scores (prompt_logprobs): the float32 log-softmax of that many rows at once
# (engine/sampling.py prompt_logprob_tensors) is what the memory profile reserves
PROMPT_LOGPROB_ROWS = 256


def max_logit_rows(config: EngineConfig) -> int:
    """The most logit rows a step computes, what the memory profile computes (engine/kv_cache.py): its sampled rows
    (max_sampled_rows) and PROMPT_LOGPROB_ROWS scoring prompt tokens; never more than the step's tokens."""
    return min(config.max_num_batched_tokens, max_sampled_rows(config) + PROMPT_LOGPROB_ROWS)


def max_sampled_rows(config: EngineConfig) -> int:
    """The most rows a step samples: a row a sequence (max_num_seqs) and with speculative decoding a row a draft
    (fewer than max_decode_rows); never more than the step's tokens."""
    sampled = config.max_decode_rows if config.speculative_config is None else \
        config.max_num_seqs + config.max_decode_rows
    return min(config.max_num_batched_tokens, sampled)


def prompt_logprob_positions(req: Request, start: int, n: int) -> range:
    """The positions of req's chunk of n tokens from `start` whose logits score a prompt token (prompt_logprobs):
    position p's scores token p + 1. Positions scored before a preemption are not scored again."""
    if req.prompt_logprobs is None:
        return range(0)
    return range(max(start, len(req.prompt_logprobs) - 1), min(start + n, req.num_prompt_tokens - 1))


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    num_new_tokens: int            # tokens computed for it this step (1 for a decode; 1 + drafts for a speculative one)
    # speculative decoding (engine/spec_decode.py): tokens drafted after a decode's last one; the chunk samples a
    # token at each of its 1 + len(drafts) positions
    drafts: list[int] = field(default_factory=list)
    # Taken when the chunk is made: the engine advances the request before the step's results are in.
    start: int = field(init=False)          # position of the first new token
    samples: bool = field(init=False)       # does this step produce a token for it?
    pools: bool = field(init=False)         # a pooling request's: does it give a pooled row (engine/pooling.py)?
    is_decode: bool = field(init=False)     # a decoding request's: its last token (and drafts), each row sampled

    def __post_init__(self) -> None:
        req = self.request
        self.start = req.num_computed_tokens
        at_end = self.start + self.num_new_tokens - len(self.drafts) == req.num_tokens
        assert at_end or not self.drafts, req
        self.samples = at_end and req.pooling is None
        # mean pooling sums every chunk's rows; last-token pooling needs the prompt's last chunk only
        self.pools = req.pooling is not None and (at_end or req.pooling.mean)
        self.is_decode = req.status is DECODING

    @property
    def num_samples(self) -> int:
        """Rows of the step's sampled tokens that are this chunk's."""
        return (1 + len(self.drafts)) if self.samples else 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)   # decodes first, then prefills
    preempted: list[Request] = field(default_factory=list)
    kv_to_receive: list[Request] = field(default_factory=list)    # admitted with external KV: start_recv

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def num_decodes(self) -> int:
        """Decode rows: one a decoding request, and one more a draft (step_input.build_step_input)."""
        return sum(c.num_new_tokens for c in self.chunks if c.is_decode)

    def is_empty(self) -> bool:
        return not self.chunks

    def sampling_chunks(self) -> Iterator[tuple[int, ScheduledChunk]]:
        """(first row, chunk) for each chunk that samples: its rows of the step's sampled tokens are that row and the
        num_samples - 1 after it (its token, then one a draft)."""
        row = 0
        for chunk in self.chunks:
            if chunk.samples:
                yield row, chunk
                row += chunk.num_samples


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 connector: KVConnector | None = None, policy: str = "fcfs",
                 propose_drafts: Callable[[Request, int, int], list[int]] | None = None,
                 max_decode_rows: int | None = None, window: int | None = None) -> None:
        self.block_manager = block_manager
        self.max_decode_rows = max_decode_rows or max_num_seqs    # decode rows a step may have, drafts included
        self.max_prompt_rows = PROMPT_LOGPROB_ROWS    # prompt positions a step may score (the module doc)
        # speculative decoding: (a decoding request, the most it may take, the running requests) -> the tokens
        # drafted for its next step
        self.propose_drafts = propose_drafts
        self.by_priority = policy == "priority"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.window = window     # every layer's KV window (the engine's; None: some layer attends to all): blocks
                                 # behind it are not read
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []   # admission order; the last is preempted first
        # Out of the batch, blocks kept for the connector (P: handing over; D: KV arriving). While
        # any exist, a waiting request that does not fit waits for their blocks instead of failing.
        self.held: dict[str, Request] = {}
        self.num_preemptions = 0           # cumulative (the server's vllm:num_preemptions_total)
        # The head of the queue that found no room, and what it found: (request, free blocks, blocks the prefix cache
        # registered, token budget, prompt rows). It is not looked up again (its prefix hashed, its cached blocks
        # taken and given back: ~1 ms a step at 32k tokens) until more blocks are free, more are cached, or it
        # would ask for less.
        self._no_room: tuple | None = None

    def add(self, req: Request) -> None:
        if self.by_priority:
            self._queue_in_order(req)
        else:
            self.waiting.append(req)

    def _queue_in_order(self, req: Request) -> None:
        """Into the waiting queue after every request that goes before it (FCFS among equals)."""
        key, i = priority_key(req), len(self.waiting)
        while i > 0 and priority_key(self.waiting[i - 1]) > key:    # most requests go at the end: scan from there
            i -= 1
        self.waiting.insert(i, req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    def has_work(self) -> bool:
        """Is there anything to compute (as opposed to requests held for the connector)?"""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decodes = [r for r in self.running if r.status is DECODING]
        prefills = [r for r in self.running if r.status is not DECODING]
        # speculative decoding: drafts are decode rows, max_decode_rows in all (EngineConfig.max_decode_rows: the sizes
        # the decode graphs and the warm-up cover, and the rows the memory profile samples)
        draft_rows = self.max_decode_rows - len(decodes)
        prompt_rows = self.max_prompt_rows
        for i, req in enumerate(decodes + prefills):
            if budget == 0:
                break
            if req.status is WAITING:   # preempted earlier in this loop (O(1), not a list scan)
                continue
            if req.awaiting_last_token:               # overlapped scheduling: it finishes when that token lands
                continue
            if req.speculating:      # overlapped: its speculative chunk is in flight, how many tokens it kept unknown
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.prompt_logprobs is not None:     # its chunk scores prompt positions: as many as the step has left
                n, scored = self._within_prompt_rows(req, n, prompt_rows)
                if n == 0:           # none left: on at the next step
                    continue
                prompt_rows -= scored
            drafts = []
            # the drafts get what the budget leaves after a token for each decode to come
            if self.propose_drafts is not None and n == 1:
                drafts = self._draft(req, min(budget - n - max(0, len(decodes) - i - 1), draft_rows))
                draft_rows -= len(drafts)
            if not self._reserve(req, n + len(drafts), out):
                continue
            out.chunks.append(ScheduledChunk(req, n + len(drafts), drafts))
            budget -= n + len(drafts)
        if not out.preempted:
            self._admit_waiting(out, budget, prompt_rows)
        out.chunks.sort(key=lambda c: not c.is_decode)
        return out

    @staticmethod
    def _within_prompt_rows(req: Request, n: int, rows: int) -> tuple[int, int]:
        """(tokens, prompt positions scored) of req's next chunk, at most n tokens scoring at most `rows` positions."""
        scored = prompt_logprob_positions(req, req.num_computed_tokens, n)
        if len(scored) <= rows:
            return n, len(scored)
        return scored.start + rows - req.num_computed_tokens, rows

    def _draft(self, req: Request, room: int) -> list[int]:
        """A decoding request's drafts, if the blocks they need are free beyond a block of headroom per running
        request: speculation never preempts anyone."""
        if req.status is not DECODING or room <= 0:
            return []
        drafts = self.propose_drafts(req, room, len(self.running))
        bm = self.block_manager
        if drafts and bm.blocks_needed(req, req.num_tokens + len(drafts)) > bm.num_free_blocks - len(self.running):
            return []
        return drafts

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Find blocks for n more tokens of a running request, preempting others if needed."""
        while not self.block_manager.allocate(req, req.num_computed_tokens + n):
            victim = max(self.running, key=priority_key) if self.by_priority else self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            out.chunks = [c for c in out.chunks if c.request is not victim]
            if victim is req:
                return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int, prompt_rows: int) -> None:
        bm = self.block_manager
        passed: list[Request] = []    # prompt_logprobs requests the step has no prompt rows left for: keep their place
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            external = self.connector.num_external_tokens(req) if self.connector is not None else 0
            if external:
                if not self._admit_external(req, external, out):
                    break
                continue
            if budget == 0:
                break
            if self._no_room is not None and self._no_room[0] is req and self.running and \
                    bm.num_free_blocks <= self._no_room[1] and bm.num_registered == self._no_room[2] and \
                    budget >= self._no_room[3] and prompt_rows >= self._no_room[4]:
                break           # nothing it could use has changed: it still finds no room
            looked_up = not req.block_table
            if looked_up:
                bm.allocate_prefix(req)
                if self.window is not None:    # cached blocks behind the window are never read: give them back
                    bm.free_slid_out(req, self.window)
            n, scored = min(req.num_tokens - req.num_computed_tokens, budget), 0
            if req.prompt_logprobs is not None:
                n, scored = self._within_prompt_rows(req, n, prompt_rows)
            if n == 0 or not bm.allocate(req, req.num_computed_tokens + n):
                if looked_up:          # waiting requests hold no blocks; the cached ones stay cached
                    bm.cancel_prefix(req)
                else:
                    bm.free(req)
                if n == 0:             # it keeps its place; those behind it may go
                    passed.append(self.waiting.popleft())
                    continue
                if not self.running and not self.held:   # nothing will free a block: fail
                    raise RuntimeError(f"request {req.request_id}: the KV cache ({bm.num_blocks} blocks of "
                                       f"{bm.block_size}) cannot hold even its first chunk")
                self._no_room = (req, bm.num_free_blocks, bm.num_registered, budget, prompt_rows)
                break
            self.waiting.popleft()
            self._no_room = None
            if req.metrics.first_scheduled_time is None:     # a preempted one keeps what its first admission saw
                req.num_cached_tokens = min(req.prefix_hit_tokens, req.num_prompt_tokens)
            req.status = PREFILL
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, n))
            budget -= n
            prompt_rows -= scored
        self.waiting.extendleft(reversed(passed))

    def _admit_external(self, req: Request, external: int, out: SchedulerOutput) -> bool:
        """Admit a request whose first `external` tokens' KV the connector brings: blocks for them
        and the next token, then held until it arrives. False (FCFS: the queue waits) if no room."""
        bm = self.block_manager
        if len(self.running) + len(self.held) >= self.max_num_seqs:
            return False
        # A block of headroom per running request, so admitting does not force a preemption: until
        # we admit it, the peer's cache holds the KV (flow control).
        if bm.num_free_blocks - bm.blocks_needed(req, external + 1) < len(self.running) \
                or not bm.allocate(req, external + 1):
            return False
        self.waiting.popleft()
        req.num_computed_tokens = external     # being written by the connector; read once arrived
        self.held[req.request_id] = req
        out.kv_to_receive.append(req)
        return True

    def prompt_computed(self, req: Request) -> None:
        """req's last prompt chunk was launched: a role that hands requests over holds it now."""
        if self.connector is not None and self.connector.hold_after_prefill(req):
            self.running.remove(req)
            self.held[req.request_id] = req

    def kv_arrived(self, req: Request) -> None:
        """The connector wrote a held request's external KV: it decodes from here on."""
        del self.held[req.request_id]
        req.status = DECODING
        self.block_manager.cache_full_blocks(req)
        self.running.append(req)

    def preempt(self, req: Request) -> None:
        self.num_preemptions += 1
        self.running.remove(req)
        self.block_manager.free(req)
        req.status = WAITING
        if self.by_priority:
            self._queue_in_order(req)
        else:
            self.waiting.appendleft(req)

    def finish(self, req: Request) -> bool:
        """Take a finished (or aborted, or failed) request out of the queues and free its blocks, unless the
        connector still uses them: then it stays held until release(). Returns whether it is held."""
        if self.connector is not None and self.connector.request_finished(req):
            self._unqueue(req)
            self.held[req.request_id] = req
            return True
        self.release(req)
        return False

    def release(self, req: Request) -> None:
        """Drop a request from whichever queue holds it and free its blocks."""
        self._unqueue(req)
        self.held.pop(req.request_id, None)
        self.block_manager.free(req)

    def _unqueue(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)


def priority_key(req: Request) -> tuple:
    """The "priority" policy's order: a lower priority value first, then the earlier arrival."""
    return req.priority, req.metrics.arrival_time
