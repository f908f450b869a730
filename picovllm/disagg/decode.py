"""Role "d": the Engine with a DecodeConnector takes requests whose prompt a P engine computed, and
decodes them to the end.

An Offer becomes a request in the scheduler's waiting queue whose first num_kv_tokens tokens are
external (num_external_tokens); the scheduler admits it when it can allocate its blocks (flow
control: P's cache holds the KV meanwhile), and the engine calls start_recv, which starts the
transfer and sends Accept. When the KV has arrived the scheduler moves the request into the running
batch and D acks, which lets P free its copy. From the Ack on, D emits its outputs.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from picovllm.disagg.messages import Accept, Ack, Bye, Cancel, EndOfStream, HandoverRequest, Offer, Release, \
    logprobs_from_wire, prompt_steps_from_wire
from picovllm.disagg.peer_connector import PeerConnector
from picovllm.disagg.transfer import TransferSpec
from picovllm.engine.kv_connector import ConnectorReport
from picovllm.engine.request import Request
from picovllm.sampling_params import RequestOutputKind, SamplingParams


def request_from_handover(offer: HandoverRequest, block_size: int) -> Request:
    """The Request a decode engine queues for an offer; ValueError or TypeError naming what is wrong."""
    if len(offer.src_block_ids) != -(-offer.num_kv_tokens // block_size):
        raise ValueError(f"{len(offer.src_block_ids)} src blocks for {offer.num_kv_tokens} tokens")
    if isinstance(offer.priority, bool) or not isinstance(offer.priority, int):
        raise ValueError(f"priority must be an int, got {offer.priority!r}")
    streamed = (offer.num_streamed_tokens, offer.num_streamed_chars)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in streamed) \
            or offer.num_streamed_tokens > len(offer.output_token_ids):
        raise ValueError(f"num_streamed_tokens and num_streamed_chars must be ints >= 0, the tokens at most the "
                         f"output's, got {streamed}")
    req = Request(offer.request_id, offer.prompt_token_ids, SamplingParams(**offer.params), offer.prompt,
                  offer.arrival_time)
    req.output_token_ids = list(offer.output_token_ids)
    req.max_tokens = offer.max_tokens
    req.priority = offer.priority
    if req.params.output_kind == RequestOutputKind.DELTA:    # P's outputs gave these out: D's hold what follows
        req.num_streamed_tokens, req.num_streamed_chars = offer.num_streamed_tokens, offer.num_streamed_chars
    if req.logprobs is not None:
        req.logprobs = logprobs_from_wire(offer.logprobs) or []
    if req.prompt_logprobs is not None:           # P scored the prompt; D computes none of it
        scored = prompt_steps_from_wire(offer.prompt_logprobs)
        if scored is None or len(scored) != len(offer.prompt_token_ids):
            raise ValueError("prompt_logprobs: the handover must carry one entry per prompt token")
        req.prompt_logprobs = scored
    req.cumulative_logprob = offer.cumulative_logprob
    req.num_cached_tokens = offer.num_cached_tokens
    m = req.metrics
    m.first_scheduled_time, m.first_token_time = offer.first_scheduled_time, offer.first_token_time
    m.token_times = list(offer.token_times)
    return req


@dataclass
class Receiving:
    req: Request
    cancelled: bool = False       # aborted meanwhile: its blocks go (and P is told) when the transfer ends


class DecodeConnector(PeerConnector):
    role = "d"

    def __init__(self) -> None:
        super().__init__()
        self.offers: dict[str, HandoverRequest] = {}     # queued in the scheduler, no transfer yet
        self.receiving: dict[str, Receiving] = {}
        self.stream_ended = False          # EndOfStream came, P is gone, or we closed: no more Offers
        self._tags = itertools.count(1)
        self._reasons: dict[str, str] = {}  # offers P cancelled: its reason goes back in the Release

    def new_session(self) -> None:
        self.stream_ended = False

    # -- scheduler half --------------------------------------------------------------------------
    def num_external_tokens(self, req: Request) -> int:
        offer = self.offers.get(req.request_id)
        return offer.num_kv_tokens if offer is not None else 0

    def request_finished(self, req: Request) -> bool:
        """Aborted or refused before its KV arrived: P answers for it once we give it back."""
        rid = req.request_id
        if rid in self.offers:
            del self.offers[rid]
            self.link.send(Release(rid, req.error or self._reasons.pop(rid, "aborted on the decode engine")))
            return False
        r = self.receiving.get(rid)
        if r is None:
            return False
        r.cancelled = True       # the transfer may still write its blocks
        return True

    def answers_for(self, req: Request) -> bool:
        return req.request_id not in self.offers and req.request_id not in self.receiving

    # -- worker half -----------------------------------------------------------------------------
    def start_recv(self, req: Request) -> None:
        rid = req.request_id
        offer = self.offers.pop(rid)
        n = len(offer.src_block_ids)
        spec = TransferSpec(rid, next(self._tags), list(offer.src_block_ids), req.block_table[:n])
        try:
            self.link.transfer.start_recv(spec)
        except (RuntimeError, ValueError) as e:
            self.link.send(Release(rid, f"could not start the KV transfer: {e}"))
            self._report.released.append(rid)
            return
        self.receiving[rid] = Receiving(req)
        self.link.send(Accept(rid, spec.tag, spec.dst_block_ids))
        if not self.link.config.async_transfer:
            self._poll_transfers(self._report, wait_for=rid)

    def poll(self, idle: bool) -> ConnectorReport:
        rep = self.take_report()
        self._handle_peer(rep)
        if self.receiving:         # else no transfer of ours can finish: a decode step asks the backend nothing
            self._poll_transfers(rep)
        self._leave_when_stream_ended(rep)
        return rep

    @property
    def transfers_in_flight(self) -> bool:
        return bool(self.receiving)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Leave early: give offers not yet taken back to P and take no new ones; decode what is here."""
        if not self.stream_ended:
            self._release_offers("the decode engine is closing", self._report)
            self.stream_ended = True

    def is_done(self, idle: bool) -> bool:
        return (self.stream_ended and not self.offers and not self.receiving and idle
                and (self.link is None or self.link.closed))

    # -- the protocol ----------------------------------------------------------------------------
    def _handle_peer(self, rep: ConnectorReport) -> None:
        for msg in self.link.receive():
            if isinstance(msg, Offer):
                self._on_offer(msg.request, rep)
            elif isinstance(msg, Cancel):
                self._on_cancel(msg, rep)
            elif isinstance(msg, EndOfStream):
                self.stream_ended = True
        if self.link.gone is not None and not self.link.closed:
            self._lose_peer(f"prefill engine lost: {self.link.gone}", rep)

    def _on_cancel(self, msg: Cancel, rep: ConnectorReport) -> None:
        """P aborted it (or gave up its transfer): the engine aborts it, with an output if decoding here."""
        rid = msg.request_id
        if rid in self.offers:
            self._reasons[rid] = msg.reason
        elif rid in self.receiving:
            self.receiving[rid].cancelled = True     # before this poll's transfers: no Ack for it
        rep.aborted.append(rid)

    def _on_offer(self, offer: HandoverRequest, rep: ConnectorReport) -> None:
        rid, why = offer.request_id, None
        if self.stream_ended:
            why = "the decode engine is closing"
        elif rid in self.offers or rid in self.receiving:
            why = f"request_id {rid!r} is already in use on the decode engine"
        else:
            try:
                req = request_from_handover(offer, self.block_size)
            except (ValueError, TypeError) as e:
                why = f"bad offer: {e}"
        if why is not None:
            self.link.send(Release(rid, why))
            return
        self.offers[rid] = offer
        rep.offered.append(req)

    def _poll_transfers(self, rep: ConnectorReport, wait_for: str | None = None) -> None:
        if not self.link.alive:
            return
        for done in self.link.transfer.poll(wait_for):
            r = self.receiving.pop(done.request_id, None)
            if r is None:
                continue
            if done.error is not None or r.cancelled:
                self.link.send(Release(done.request_id, done.error or "cancelled"))
                rep.released.append(done.request_id)
            else:
                self.link.send(Ack(done.request_id))
                rep.arrived.append(done.request_id)

    def _release_offers(self, why: str, rep: ConnectorReport) -> None:
        for rid in self.offers:
            self.link.send(Release(rid, why))
            rep.released.append(rid)
        self.offers.clear()
        self._reasons.clear()

    def _lose_peer(self, why: str, rep: ConnectorReport) -> None:
        """P died or went silent: fail what we were waiting for (P cannot), free it, decode the rest."""
        self.link.close()                           # first: no transfer may still write our blocks
        for rid in self.offers:
            rep.failed[rid] = why
        for rid, r in self.receiving.items():
            if r.cancelled:
                rep.released.append(rid)
            else:
                rep.failed[rid] = why
        self.offers.clear()
        self.receiving.clear()
        self._reasons.clear()
        self.stream_ended = True

    def _leave_when_stream_ended(self, rep: ConnectorReport) -> None:
        """After EndOfStream (or close()): once nothing is in flight, say Bye and drop the link."""
        if self.stream_ended and not self.receiving and not self.link.closed:
            self._release_offers("the decode engine is closing", rep)
            self.link.send(Bye())
            self.link.close()
