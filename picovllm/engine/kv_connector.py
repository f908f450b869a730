"""The KV-connector seam: what an engine asks of whoever moves KV between engines. Read this class first.

Roles (EngineConfig.role) are configuration plus a connector, not subclasses: "pd" (colocated) runs
without one; "p" and "d" are the same Engine with picovllm.disagg's PrefillConnector and
DecodeConnector, which speak the handover protocol with the peer engine and drive a KVTransfer
backend. A connector never assigns the scheduler's queues, never frees or allocates blocks and never
finishes a request: it answers the scheduler's questions (scheduler half) and does the I/O when the
engine's step tells it to (worker half); what it saw comes back as a ConnectorReport, which the
engine applies through the scheduler.

A request's path through the hooks (ARCHITECTURE.md draws it):

    P engine                                          D engine
    add_request -> waiting -> running (prefill)       poll(): report.offered -> waiting
    last prompt chunk launched:                       schedule(): num_external_tokens(req) = n > 0:
      hold_after_prefill(req) -> running to held        blocks for n + 1 tokens, waiting to held,
    its first token appended: start_send(req)           SchedulerOutput.kv_to_receive; start_recv(req)
    poll(): report.released (the peer has it):        poll(): report.arrived -> held to running,
      its blocks are freed, it leaves P                 decoding from token n on
    aborted while held: request_finished(req) -> True: its blocks stay held until poll() releases it
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from picovllm.engine.request import Request


@dataclass
class ConnectorReport:
    """What a connector's worker half saw since its last poll. The engine applies it, in field order."""
    offered: list[Request] = field(default_factory=list)   # new requests whose KV is elsewhere: queue them
    arrived: list[str] = field(default_factory=list)       # their KV is in their blocks: they may decode
    released: list[str] = field(default_factory=list)      # done with them: free their blocks, no output here
    failed: dict[str, str] = field(default_factory=dict)   # request id -> error: free, final error output
    aborted: list[str] = field(default_factory=list)       # the peer cancelled them: Engine.abort each, last
    # request id -> where its KV waits for whoever decodes it (a fleet's P: JSON, picovllm.disagg.messages.
    # PublishedKV): the engine emits the request's last output here with it; its blocks stay held
    published: dict[str, dict] = field(default_factory=dict)


class KVConnector(ABC):
    """One engine's end of a KV hand-over. Every method is called on the thread that steps the engine.

    Scheduler half (num_external_tokens, hold_after_prefill, request_finished): asked by the
    Scheduler while it decides (answers_for by Engine.abort; request_finished by the Engine too,
    for an offer it refuses); they keep the connector's own books and may send a control message
    to the peer, but never wait on the peer and never touch the KV cache. Worker half (start_send,
    start_recv, poll): called by the engine's step; they move blocks, asynchronously, and report
    what completed. A connector that only sends (P) or only receives (D) leaves the other's
    hooks at their defaults.
    """

    # -- scheduler half --------------------------------------------------------------------------
    def num_external_tokens(self, req: Request) -> int:
        """How many of a waiting request's leading tokens will have their KV written by this
        connector rather than computed here; 0: compute the request here.

        Asked each time the scheduler considers admitting req. For n > 0 the scheduler allocates
        blocks for n + 1 tokens (admitting only with room to spare: the peer keeps the KV
        meanwhile), sets num_computed_tokens = n, moves req to its held requests and lists it in
        SchedulerOutput.kv_to_receive. No side effects: it may be asked many times.
        """
        return 0

    def hold_after_prefill(self, req: Request) -> bool:
        """Asked when req's last prompt chunk (or, after a preemption, its recomputation) has been
        launched: its first token is being sampled, still on the device under overlapped scheduling.

        True: req is not decoded here; the scheduler moves it out of the batch at once, blocks kept,
        to its held requests, and the engine calls start_send(req) once that token is appended.
        """
        return False

    def request_finished(self, req: Request) -> bool:
        """req leaves this engine (finished, aborted, refused): may its blocks be freed now?

        Asked by the scheduler for a request it removes, and by the engine for an offered
        request it refuses (req.error says why). True: not yet, a transfer may still read or
        write them; the scheduler keeps req held until poll() lists it released or failed.
        Not asked for requests the connector itself reported released or failed.
        """
        return False

    def answers_for(self, req: Request) -> bool:
        """Does this engine emit req's final output when req is aborted or refused here? False while
        the peer still owns the request (D of a linked pair: its KV has not arrived, P answers for
        it; P of a fleet: it published the request, whoever decodes it answers)."""
        return True

    # -- worker half -----------------------------------------------------------------------------
    def start_send(self, req: Request) -> None:
        """After hold_after_prefill(req): its first token is appended. Start moving its blocks
        (req.block_table, num_computed_tokens tokens) to the peer, or publish them for whoever
        pulls them (a fleet: poll() lists it published, with where); return at once. Completion
        comes from poll(): released (the peer has them, or nobody took them in time) or failed."""
        raise NotImplementedError(f"{type(self).__name__} does not send KV")

    def start_recv(self, req: Request) -> None:
        """For each request in SchedulerOutput.kv_to_receive, right after schedule(): its blocks
        are allocated. Start receiving its external tokens' KV into them; return at once (a pulling
        backend may copy here). Completion comes from poll(): arrived, released or failed."""
        raise NotImplementedError(f"{type(self).__name__} does not receive KV")

    @abstractmethod
    def poll(self, idle: bool) -> ConnectorReport:
        """Once at the start of every engine step: the peer's messages, finished transfers and
        timeouts since the last poll. Returns at once. idle: the engine holds no request (none
        waiting, running, held or in flight), which is when a closing engine ends its stream.

        A request is reported released or failed at most once, after which the connector forgets
        it; the engine applies `aborted` last, so it may name a request another list just settled.
        """

    def forward_abort(self, request_id: str) -> None:
        """Engine.abort of an id this engine does not hold: the peer may hold it (P: handed off)."""

    @property
    def transfers_in_flight(self) -> bool:
        """A transfer may complete with no message from the peer: an idle loop should poll again
        soon instead of sleeping until input comes."""
        return False

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """No more requests (Engine.close): finish what is here, then end the session."""

    def is_done(self, idle: bool) -> bool:
        """The session is over (after close()); idle as in poll()."""
        return idle

    def shutdown(self) -> None:
        """The engine is going away: drop links, stop threads, close ports. Idempotent."""
