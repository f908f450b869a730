"""Role "d": an Engine that takes requests whose prompt a P engine computed, and decodes them to the end.

An Offer waits in `offers` until this engine can allocate its blocks (flow control: P's cache
holds the KV meanwhile); then the blocks are allocated, the transfer started, and Accept sent.
When the KV has arrived the request joins the running batch with num_computed_tokens = its
prompt length, and D acks, which lets P free its copy. From the Ack on, D emits its outputs.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from picovllm.config import EngineConfig
from picovllm.disagg.channel import Channel
from picovllm.disagg.link import PeerLink, cache_layout, full_head_io
from picovllm.disagg.messages import (Accept, Ack, Bye, Cancel, EndOfStream, HandoverRequest, Offer, Release,
                                      logprobs_from_wire)
from picovllm.disagg.transfer import TransferConfig, TransferSpec
from picovllm.engine.llm_engine import Engine
from picovllm.engine.model_runner import ModelRunner
from picovllm.engine.request import FinishReason, Request, RequestStatus
from picovllm.outputs import RequestOutput
from picovllm.sampling_params import SamplingParams


@dataclass
class Receiving:
    req: Request
    num_kv_tokens: int
    cancelled: bool = False


class DecodeEngine(Engine):
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        if config.role != "d":
            raise ValueError(f"EngineConfig.role must be 'd' for a DecodeEngine, got {config.role!r}")
        super().__init__(config, runner)
        self.offers: OrderedDict[str, HandoverRequest] = OrderedDict()   # FCFS
        self.receiving: dict[str, Receiving] = {}
        self.link: PeerLink | None = None
        self.stream_ended = False          # EndOfStream came, P is gone, or we closed: no more Offers
        self._tags = itertools.count(1)

    def connect(self, channel: Channel, transfer: TransferConfig, session: int = 0) -> None:
        """Handshake with the P engine on `channel` (blocks up to transfer.connect_timeout_s).

        Starts a session; an engine whose last session is done may connect again.
        """
        if self.link is not None and not self.is_done():
            raise RuntimeError("the decode engine's session is still running")
        link = PeerLink.open("d", channel, self.runner.kv_cache, cache_layout(self.runner), transfer, session,
                             full_head_io(self.runner))
        self.stream_ended = False
        self.link = link

    # -- the design's surface ------------------------------------------------------------------
    def submit(self, *args, **kwargs) -> str:
        raise RuntimeError("a decode engine takes requests from its prefill engine, not submit()")

    def close(self) -> None:
        """Leave early: give pending offers back to P and stop taking new ones; decode what is here."""
        if not self.stream_ended:
            for rid in list(self.offers):
                self.offers.pop(rid)
                self.link.send(Release(rid, "the decode engine is closing"))
            self.stream_ended = True

    def is_done(self) -> bool:
        return (self.stream_ended and not self.offers and not self.receiving
                and not super().has_unfinished_requests() and (self.link is None or self.link.closed))

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or bool(self.offers or self.receiving)

    def step(self, unfinished_outputs: bool = True) -> list[RequestOutput]:
        assert self.link is not None, "connect() the decode engine to a prefill engine first"
        outputs = self._handle_peer()
        outputs += self._poll_transfers()
        outputs += self._admit()
        outputs += super().step(unfinished_outputs)
        self._leave_when_stream_ended()
        self.scheduler.num_held_outside = len(self.receiving)
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        if request_id in self.offers or request_id in self.receiving:
            self._cancel(request_id, "aborted on the decode engine")
            return None
        return super().abort(request_id)

    # -- the protocol --------------------------------------------------------------------------
    def _handle_peer(self) -> list[RequestOutput]:
        outputs = []
        for msg in self.link.receive():
            if isinstance(msg, Offer):
                self._on_offer(msg.request)
            elif isinstance(msg, Cancel):
                if msg.request_id in self.requests:
                    out = super().abort(msg.request_id)      # decoding here: we own its output
                    outputs += [out] if out is not None else []
                else:
                    self._cancel(msg.request_id, msg.reason)
            elif isinstance(msg, EndOfStream):
                self.stream_ended = True
        if self.link.gone is not None and not self.link.closed:
            outputs += self._lose_peer(f"prefill engine lost: {self.link.gone}")
        return outputs

    def _on_offer(self, offer: HandoverRequest) -> None:
        rid, bm = offer.request_id, self.block_manager
        why = None
        if self.stream_ended:
            why = "the decode engine is closing"
        elif rid in self.offers or rid in self.receiving or rid in self.requests:
            why = f"request_id {rid!r} is already in use on the decode engine"
        elif len(offer.prompt_token_ids) + offer.max_tokens > bm.num_blocks * bm.block_size:
            why = (f"prompt ({len(offer.prompt_token_ids)}) + max_tokens ({offer.max_tokens}) tokens exceed the "
                   f"decode engine's KV cache ({bm.num_blocks * bm.block_size} tokens)")
        elif len(offer.prompt_token_ids) >= self.max_model_len:
            why = f"prompt is longer than the decode engine's max_model_len - 1 = {self.max_model_len - 1}"
        if why is not None:
            self.link.send(Release(rid, why))
        else:
            self.offers[rid] = offer

    def _cancel(self, request_id: str, reason: str) -> None:
        if request_id in self.offers:
            del self.offers[request_id]
            self.link.send(Release(request_id, reason))
        elif request_id in self.receiving:
            self.receiving[request_id].cancelled = True      # its blocks go when the transfer ends

    def _admit(self) -> list[RequestOutput]:
        """Start transfers for offers, oldest first, while blocks and batch slots allow."""
        outputs, bm = [], self.block_manager
        while self.offers and self.link.alive and not self.scheduler.waiting:
            if len(self.scheduler.running) + len(self.receiving) >= self.config.max_num_seqs:
                break
            rid, offer = next(iter(self.offers.items()))
            try:
                req = self._build_request(offer)
            except ValueError as e:
                del self.offers[rid]
                self.link.send(Release(rid, f"bad offer: {e}"))
                continue
            # Leave a block of headroom per running request, so admitting does not force preemption.
            need = bm.blocks_needed(req, offer.num_kv_tokens + 1)
            if bm.num_free_blocks - need < len(self.scheduler.running) or not bm.allocate(req, offer.num_kv_tokens + 1):
                break                       # flow control: P keeps the KV until we have room
            del self.offers[rid]
            n = len(offer.src_block_ids)
            spec = TransferSpec(rid, next(self._tags), list(offer.src_block_ids), req.block_table[:n])
            try:
                self.link.transfer.start_recv(spec)
            except (RuntimeError, ValueError) as e:
                bm.free(req)
                self.link.send(Release(rid, f"could not start the KV transfer: {e}"))
                continue
            self.receiving[rid] = Receiving(req, offer.num_kv_tokens)
            self.scheduler.num_held_outside = len(self.receiving)
            self.link.send(Accept(rid, spec.tag, spec.dst_block_ids))
            if not self.link.config.async_transfer:
                outputs += self._poll_transfers(wait_for=rid)
        return outputs

    def _build_request(self, offer: HandoverRequest) -> Request:
        if len(offer.src_block_ids) != -(-offer.num_kv_tokens // self.block_manager.block_size):
            raise ValueError(f"{len(offer.src_block_ids)} src blocks for {offer.num_kv_tokens} tokens")
        req = Request(offer.request_id, offer.prompt_token_ids, SamplingParams(**offer.params), offer.prompt,
                      offer.arrival_time)
        req.output_token_ids = list(offer.output_token_ids)
        req.max_tokens = offer.max_tokens
        if req.logprobs is not None:
            req.logprobs = logprobs_from_wire(offer.logprobs) or []
        req.cumulative_logprob = offer.cumulative_logprob
        req.num_cached_tokens = offer.num_cached_tokens
        m = req.metrics
        m.first_scheduled_time, m.first_token_time = offer.first_scheduled_time, offer.first_token_time
        m.token_times = list(offer.token_times)
        return req

    def _poll_transfers(self, wait_for: str | None = None) -> list[RequestOutput]:
        if not self.link.alive:
            return []
        for done in self.link.transfer.poll(wait_for):
            r = self.receiving.pop(done.request_id, None)
            if r is None:
                continue
            if done.error is not None or r.cancelled:
                self.block_manager.free(r.req)
                self.link.send(Release(done.request_id, done.error or "cancelled"))
            else:
                self._start_decoding(r)
                self.link.send(Ack(done.request_id))
        self.scheduler.num_held_outside = len(self.receiving)
        return []

    def _start_decoding(self, r: Receiving) -> None:
        req = r.req
        for token in req.output_token_ids:         # same text state as if we had sampled them
            req.text += self.detokenizer.append(req, token)
        req.num_computed_tokens = r.num_kv_tokens
        req.status = RequestStatus.DECODING
        self.block_manager.cache_full_blocks(req)
        self.requests[req.request_id] = req
        self.scheduler.running.append(req)

    def _lose_peer(self, why: str) -> list[RequestOutput]:
        """P died or went silent: fail what we were waiting for (P cannot), free it, decode the rest."""
        self.link.close()                           # first: no transfer may still write our blocks
        outputs = []
        for offer in self.offers.values():
            try:
                req = self._build_request(offer)
            except ValueError:
                continue
            req.finish(FinishReason.ERROR, error=why)
            outputs.append(self.make_output(req))
        for r in self.receiving.values():
            self.block_manager.free(r.req)
            if not r.cancelled:
                r.req.finish(FinishReason.ERROR, error=why)
                outputs.append(self.make_output(r.req))
        self.offers.clear()
        self.receiving.clear()
        self.stream_ended = True
        return outputs

    def _leave_when_stream_ended(self) -> None:
        """After EndOfStream (or close()): once nothing is in flight, say Bye and drop the link."""
        if self.stream_ended and not self.receiving and not self.link.closed:
            self.offers.clear()
            self.link.send(Bye())
            self.link.close()
