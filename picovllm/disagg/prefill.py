"""Role "p": the Engine with a PrefillConnector computes prompts and first tokens, then hands each
request to a D engine.

A request here goes WAITING -> PREFILL -> (first token sampled) -> handing over -> gone to D.
Handing over: the scheduler holds it out of the batch (no decode here), blocks kept
(hold_after_prefill); once its first token is known, start_send offers it to D; D accepts when it
has room and the KV moves; D's Ack releases P's blocks. Until then P's cache is the buffer, and P
keeps prefilling while blocks remain. Whoever holds a request emits its final output: P until D's
Ack (finished at the first token, aborted, refused by D, failed), D after.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass

from picovllm.disagg.messages import Accept, Ack, Bye, Cancel, EndOfStream, HandoverRequest, Offer, Release, \
    logprobs_to_wire, prompt_steps_to_wire
from picovllm.disagg.peer_connector import PeerConnector
from picovllm.disagg.transfer import TransferSpec
from picovllm.engine.kv_connector import ConnectorReport
from picovllm.engine.llm_engine import EngineClosedError
from picovllm.engine.request import Request

__all__ = ["EngineClosedError", "Handover", "HandoverState", "PrefillConnector"]


def handover_request(req: Request, block_size: int) -> HandoverRequest:
    """All a decode engine needs of a request P prefilled and sampled once, its KV blocks included."""
    n_blocks = -(-req.num_computed_tokens // block_size)
    m = req.metrics
    return HandoverRequest(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
        output_token_ids=list(req.output_token_ids), params=dataclasses.asdict(req.params),
        max_tokens=req.max_tokens, num_kv_tokens=req.num_computed_tokens,
        src_block_ids=list(req.block_table[:n_blocks]), logprobs=logprobs_to_wire(req.logprobs),
        cumulative_logprob=req.cumulative_logprob, num_cached_tokens=req.num_cached_tokens,
        arrival_time=m.arrival_time, first_scheduled_time=m.first_scheduled_time,
        first_token_time=m.first_token_time, token_times=list(m.token_times), priority=req.priority,
        prompt_logprobs=prompt_steps_to_wire(req.prompt_logprobs), num_streamed_tokens=req.num_streamed_tokens,
        num_streamed_chars=req.num_streamed_chars)


class HandoverState(enum.Enum):
    OFFERED = "offered"      # Offer sent; D has not accepted yet (flow control: it may be full)
    SENDING = "sending"      # D accepted; the KV is moving; waiting for D's Ack


@dataclass
class Handover:
    req: Request
    state: HandoverState = HandoverState.OFFERED
    since: float = 0.0           # monotonic time of the last state change
    cancelled: bool = False      # aborted here: the final output went out; waiting for D to let go


class PrefillConnector(PeerConnector):
    role = "p"

    def __init__(self) -> None:
        super().__init__()
        self.handovers: dict[str, Handover] = {}
        self.handed_off: set[str] = set()     # acked by D: aborts for these are forwarded to it
        self.closed = False
        self.eos_sent = False
        self.eos_time = 0.0
        self.peer_said_bye = False

    def new_session(self) -> None:
        self.closed = self.eos_sent = self.peer_said_bye = False
        self.handed_off.clear()

    # -- scheduler half --------------------------------------------------------------------------
    def hold_after_prefill(self, req: Request) -> bool:
        return True          # P never decodes: every request goes to D after its first token

    def request_finished(self, req: Request) -> bool:
        """Aborted while handing over: tell D to drop it; our blocks wait for D's Ack or Release."""
        h = self.handovers.get(req.request_id)
        if h is None:
            return False
        if not h.cancelled:
            h.cancelled = True
            self.link.send(Cancel(req.request_id, "aborted"))
        return True

    # -- worker half -----------------------------------------------------------------------------
    def start_send(self, req: Request) -> None:
        """Offer the request to D; the KV moves once D accepts (flow control: D may be full)."""
        self.handovers[req.request_id] = Handover(req, since=time.monotonic())
        self.link.send(Offer(handover_request(req, self.block_size)))

    def poll(self, idle: bool) -> ConnectorReport:
        rep = self.take_report()
        self._handle_peer(rep)
        self._poll_transfers(rep)
        self._check_timeouts(rep)
        self._end_stream_when_drained(idle)
        return rep

    def take_handed_off(self) -> list[str]:
        """The requests D acknowledged since the last call (a server ends their streams on P). An abort for
        one of them is no longer forwarded to D here: whoever took it talks to D directly."""
        taken = list(self.handed_off)
        self.handed_off.clear()
        return taken

    def forward_abort(self, request_id: str) -> None:
        if request_id in self.handed_off:
            self.link.send(Cancel(request_id, "aborted"))   # D holds it now and answers with the output

    @property
    def transfers_in_flight(self) -> bool:
        return any(h.state == HandoverState.SENDING for h in self.handovers.values())

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """No more requests: hand over what is here, then tell D (EndOfStream)."""
        self.closed = True

    def is_done(self, idle: bool) -> bool:
        return self.eos_sent and (self.link is None or self.link.closed)

    # -- the protocol ----------------------------------------------------------------------------
    def _handle_peer(self, rep: ConnectorReport) -> None:
        for msg in self.link.receive():
            if isinstance(msg, Accept):
                self._on_accept(msg, rep)
            elif isinstance(msg, Ack):
                h = self.handovers.pop(msg.request_id, None)
                if h is not None:
                    if not h.cancelled:
                        self.handed_off.add(msg.request_id)
                    rep.released.append(msg.request_id)
            elif isinstance(msg, Release):
                h = self.handovers.pop(msg.request_id, None)
                if h is not None:
                    self._drop(h, rep, f"the decode engine gave it back: {msg.reason}")
            elif isinstance(msg, Bye):
                self.peer_said_bye = True
                if not self.eos_sent and self.link.gone is None:
                    self.link.gone = "the decode engine closed the link"
        if self.link.gone is not None:
            self._lose_peer(f"decode engine lost: {self.link.gone}", rep)

    def _on_accept(self, msg: Accept, rep: ConnectorReport) -> None:
        h = self.handovers.get(msg.request_id)
        if h is None or h.state != HandoverState.OFFERED:
            return           # cannot happen: an entry lives until D's Ack or Release
        n = len(msg.dst_block_ids)
        spec = TransferSpec(msg.request_id, msg.tag, list(h.req.block_table[:n]), list(msg.dst_block_ids))
        h.state, h.since = HandoverState.SENDING, time.monotonic()
        try:
            self.link.transfer.start_send(spec)
        except (RuntimeError, ValueError) as e:
            self._give_up(h, f"could not start the KV transfer: {e}", rep)
            return
        if not self.link.config.async_transfer:
            self._poll_transfers(rep, wait_for=msg.request_id)

    def _poll_transfers(self, rep: ConnectorReport, wait_for: str | None = None) -> None:
        if not self.link.alive:
            return
        for done in self.link.transfer.poll(wait_for):
            h = self.handovers.get(done.request_id)
            if done.error is not None and h is not None:
                self._give_up(h, done.error, rep)

    def _check_timeouts(self, rep: ConnectorReport) -> None:
        limit, now = self.link.config.timeout_s, time.monotonic()
        for h in list(self.handovers.values()):
            if h.state == HandoverState.SENDING and now - h.since > limit:
                self._give_up(h, f"KV transfer not acknowledged by the decode engine within {limit:g} s", rep)

    def _give_up(self, h: Handover, error: str, rep: ConnectorReport) -> None:
        """A transfer failed or timed out: the request fails, its blocks are freed, D drops it."""
        del self.handovers[h.req.request_id]
        self.link.send(Cancel(h.req.request_id, error))
        self._drop(h, rep, error)

    def _lose_peer(self, why: str, rep: ConnectorReport) -> None:
        """D died or went silent: fail what it was to take, free the blocks; later handovers fail at once."""
        for h in self.handovers.values():
            self._drop(h, rep, why)
        self.handovers.clear()
        self.link.close()

    @staticmethod
    def _drop(h: Handover, rep: ConnectorReport, error: str) -> None:
        """A handover ended without D taking it: fail it, or, aborted here already, just free it."""
        if h.cancelled:
            rep.released.append(h.req.request_id)
        else:
            rep.failed[h.req.request_id] = error

    def _end_stream_when_drained(self, idle: bool) -> None:
        if not self.closed or not idle or self.handovers:
            return
        if not self.eos_sent:
            self.link.send(EndOfStream())
            self.eos_sent = True
            self.eos_time = time.monotonic()
        if self.peer_said_bye or not self.link.alive or time.monotonic() - self.eos_time > self.link.config.lease_s:
            self.link.close()
