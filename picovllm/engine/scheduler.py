"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running decodes first (one token each, never starved), then running prefills
(their next chunk), then waiting requests in FCFS order while budget, blocks and
max_num_seqs allow. When a running request needs a block and none is free, the most
recently admitted running request is preempted: its blocks are freed (kept as cached
prefix blocks) and it goes back to the front of the queue, to be recomputed later.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from picovllm.engine.block_manager import BlockManager
from picovllm.engine.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int            # tokens computed for it this step (1 for a decode)
    # Taken when the chunk is made: the engine advances the request before the step's results are in.
    start: int = field(init=False)          # position of the first new token
    samples: bool = field(init=False)       # does this step produce a token for it?
    is_decode: bool = field(init=False)

    def __post_init__(self) -> None:
        req = self.request
        self.start = req.num_computed_tokens
        self.samples = self.start + self.num_new_tokens == req.num_tokens
        self.is_decode = req.status == RequestStatus.DECODING


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)   # decodes first, then prefills
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def num_decodes(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)

    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []   # admission order; the last is preempted first
        # Requests outside these queues that still hold blocks (a PD engine's handovers). While any
        # exist, a waiting request that does not fit waits for their blocks instead of failing.
        self.num_held_outside = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decodes = [r for r in self.running if r.status == RequestStatus.DECODING]
        prefills = [r for r in self.running if r.status != RequestStatus.DECODING]
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status == RequestStatus.WAITING:   # preempted earlier in this loop (O(1), not a list scan)
                continue
            if req.awaiting_last_token:               # overlapped scheduling: it finishes when that token lands
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve(req, n, out):
                continue
            out.chunks.append(ScheduledChunk(req, n))
            budget -= n
        if not out.preempted:
            self._admit_waiting(out, budget)
        out.chunks.sort(key=lambda c: not c.is_decode)
        return out

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Find blocks for n more tokens of a running request, preempting others if needed."""
        while not self.block_manager.allocate(req, req.num_computed_tokens + n):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            out.chunks = [c for c in out.chunks if c.request is not victim]
            if victim is req:
                return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            looked_up = not req.block_table
            if looked_up:
                bm.allocate_prefix(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not bm.allocate(req, req.num_computed_tokens + n):
                if looked_up:          # waiting requests hold no blocks; the cached ones stay cached
                    bm.cancel_prefix(req)
                else:
                    bm.free(req)
                if not self.running and not self.num_held_outside:   # nothing will free a block: fail
                    raise RuntimeError(f"request {req.request_id}: the KV cache ({bm.num_blocks} blocks of "
                                       f"{bm.block_size}) cannot hold even its first chunk")
                break
            self.waiting.popleft()
            req.status = RequestStatus.PREFILL
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, n))
            budget -= n

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and free its blocks (finished, aborted or failed)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req)
