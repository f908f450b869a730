"""Role "p": an Engine that computes prompts and first tokens, then hands each request to a D engine.

A request here goes WAITING -> PREFILL -> (first token sampled) -> handing over -> gone to D.
Handing over: it leaves the running batch (no decode here) but keeps its blocks; P offers it to
D; D accepts when it has room and the KV moves; D's Ack frees P's blocks. Until then P's cache is
the buffer, and P keeps prefilling while blocks remain. Whoever holds a request emits its final
output: P until D's Ack (finished at the first token, aborted, refused by D, failed), D after.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass

from picovllm.config import EngineConfig
from picovllm.disagg.channel import Channel
from picovllm.disagg.link import PeerLink, cache_layout, full_head_io
from picovllm.disagg.messages import (Accept, Ack, Bye, Cancel, EndOfStream, HandoverRequest, Offer, Release,
                                      logprobs_to_wire)
from picovllm.disagg.transfer import TransferConfig, TransferSpec
from picovllm.engine.llm_engine import Engine
from picovllm.engine.model_runner import ModelRunner
from picovllm.engine.request import FinishReason, Request, RequestStatus
from picovllm.engine.scheduler import SchedulerOutput
from picovllm.outputs import RequestOutput
from picovllm.sampling_params import SamplingParams


class EngineClosedError(RuntimeError):
    """submit() after close(): the engine takes no more requests."""


class HandoverState(enum.Enum):
    OFFERED = "offered"      # Offer sent; D has not accepted yet (flow control: it may be full)
    SENDING = "sending"      # D accepted; the KV is moving; waiting for D's Ack


@dataclass
class Handover:
    req: Request
    state: HandoverState = HandoverState.OFFERED
    since: float = 0.0           # monotonic time of the last state change
    cancelled: bool = False      # aborted here: the final output went out; waiting for D to let go


class PrefillEngine(Engine):
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        if config.role != "p":
            raise ValueError(f"EngineConfig.role must be 'p' for a PrefillEngine, got {config.role!r}")
        super().__init__(config, runner)
        self.handovers: dict[str, Handover] = {}
        self.handed_off: set[str] = set()     # acked by D: aborts for these are forwarded to it
        self.link: PeerLink | None = None
        self.closed = False
        self.eos_sent = False
        self.eos_time = 0.0
        self.peer_said_bye = False

    def connect(self, channel: Channel, transfer: TransferConfig, session: int = 0) -> None:
        """Handshake with the D engine on `channel` (blocks up to transfer.connect_timeout_s).

        Starts a session: an engine whose last session is done may connect again (same weights
        and cache, a new link), which is how a worker process serves many sessions.
        """
        if self.link is not None and not self.is_done():
            raise RuntimeError("the prefill engine's session is still running")
        link = PeerLink.open("p", channel, self.runner.kv_cache, cache_layout(self.runner), transfer, session,
                             full_head_io(self.runner))
        self.closed = self.eos_sent = self.peer_said_bye = False
        self.handed_off.clear()
        self.link = link

    # -- the design's surface: submit, step, close, is_done -----------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
               arrival_time: float | None = None) -> str:
        if self.closed:
            raise EngineClosedError("the prefill engine is closed (no more requests): submit refused")
        return self.add_request(prompt, params, request_id, arrival_time)

    def close(self) -> None:
        """No more requests: refuse submit(), finish and hand over what is here, then tell D (EndOfStream)."""
        self.closed = True

    def is_done(self) -> bool:
        return self.eos_sent and (self.link is None or self.link.closed)

    def step(self, unfinished_outputs: bool = True) -> list[RequestOutput]:
        assert self.link is not None, "connect() the prefill engine to a decode engine first"
        outputs = self._handle_peer()
        outputs += self._poll_transfers()
        outputs += super().step(unfinished_outputs)
        outputs += self._check_timeouts()
        self._end_stream_when_drained()
        self.scheduler.num_held_outside = len(self.handovers)
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        h = self.handovers.get(request_id)
        if h is not None:
            if h.cancelled:
                return None
            h.cancelled = True
            self.link.send(Cancel(request_id, "aborted"))
            h.req.finish(FinishReason.ABORT)
            return self.make_output(h.req)
        if request_id in self.handed_off:
            self.link.send(Cancel(request_id, "aborted"))   # D holds it now and answers with the output
            return None
        return super().abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or bool(self.handovers)

    # -- handing over --------------------------------------------------------------------------
    def postprocess(self, sched: SchedulerOutput, result, unfinished_outputs: bool = True) -> list[RequestOutput]:
        outputs = super().postprocess(sched, result, unfinished_outputs)
        for req in [r for r in self.scheduler.running if r.status == RequestStatus.DECODING]:
            self._hand_over(req)
        return outputs

    def _hand_over(self, req: Request) -> None:
        self.scheduler.running.remove(req)          # out of the batch, blocks kept
        self.handovers[req.request_id] = Handover(req, since=time.monotonic())
        self.scheduler.num_held_outside = len(self.handovers)
        n_blocks = -(-req.num_computed_tokens // self.block_manager.block_size)
        m = req.metrics
        self.link.send(Offer(HandoverRequest(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
            output_token_ids=list(req.output_token_ids), params=dataclasses.asdict(req.params),
            max_tokens=req.max_tokens, num_kv_tokens=req.num_computed_tokens,
            src_block_ids=list(req.block_table[:n_blocks]), logprobs=logprobs_to_wire(req.logprobs),
            cumulative_logprob=req.cumulative_logprob, num_cached_tokens=req.num_cached_tokens,
            arrival_time=m.arrival_time, first_scheduled_time=m.first_scheduled_time,
            first_token_time=m.first_token_time, token_times=list(m.token_times))))

    def _handle_peer(self) -> list[RequestOutput]:
        outputs = []
        for msg in self.link.receive():
            if isinstance(msg, Accept):
                outputs += self._on_accept(msg)
            elif isinstance(msg, Ack):
                h = self._release(msg.request_id)
                if h is not None and not h.cancelled:
                    self.handed_off.add(msg.request_id)
            elif isinstance(msg, Release):
                h = self._release(msg.request_id)
                if h is not None and not h.cancelled:
                    outputs.append(self._fail(h.req, f"the decode engine gave it back: {msg.reason}"))
            elif isinstance(msg, Bye):
                self.peer_said_bye = True
                if not self.eos_sent and self.link.gone is None:
                    self.link.gone = "the decode engine closed the link"
        if self.link.gone is not None:
            outputs += self._lose_peer(f"decode engine lost: {self.link.gone}")
        return outputs

    def _on_accept(self, msg: Accept) -> list[RequestOutput]:
        h = self.handovers.get(msg.request_id)
        if h is None or h.state != HandoverState.OFFERED:
            return []        # cannot happen: an entry lives until D's Ack or Release
        n = len(msg.dst_block_ids)
        spec = TransferSpec(msg.request_id, msg.tag, list(h.req.block_table[:n]), list(msg.dst_block_ids))
        h.state, h.since = HandoverState.SENDING, time.monotonic()
        try:
            self.link.transfer.start_send(spec)
        except (RuntimeError, ValueError) as e:
            return self._give_up(h, f"could not start the KV transfer: {e}")
        if not self.link.config.async_transfer:
            return self._poll_transfers(wait_for=msg.request_id)
        return []

    def _poll_transfers(self, wait_for: str | None = None) -> list[RequestOutput]:
        if not self.link.alive:
            return []
        outputs = []
        for done in self.link.transfer.poll(wait_for):
            h = self.handovers.get(done.request_id)
            if done.error is not None and h is not None:
                outputs += self._give_up(h, done.error)
        return outputs

    def _check_timeouts(self) -> list[RequestOutput]:
        limit, now, outputs = self.link.config.timeout_s, time.monotonic(), []
        for h in list(self.handovers.values()):
            if h.state == HandoverState.SENDING and now - h.since > limit:
                outputs += self._give_up(h, f"KV transfer not acknowledged by the decode engine within {limit:g} s")
        return outputs

    def _give_up(self, h: Handover, error: str) -> list[RequestOutput]:
        """A transfer failed or timed out: fail the request, free its blocks, tell D to drop it."""
        self._release(h.req.request_id)
        self.link.send(Cancel(h.req.request_id, error))
        return [] if h.cancelled else [self._fail(h.req, error)]

    def _lose_peer(self, why: str) -> list[RequestOutput]:
        """D died or went silent: fail what it was to take, free the blocks; later handovers fail at once."""
        outputs = []
        for h in list(self.handovers.values()):
            self._release(h.req.request_id)
            if not h.cancelled:
                outputs.append(self._fail(h.req, why))
        self.link.close()
        return outputs

    def _release(self, request_id: str) -> Handover | None:
        h = self.handovers.pop(request_id, None)
        if h is not None:
            self.block_manager.free(h.req)
            self.requests.pop(request_id, None)
            self.scheduler.num_held_outside = len(self.handovers)
        return h

    def _fail(self, req: Request, error: str) -> RequestOutput:
        req.finish(FinishReason.ERROR, error=error)
        return self.make_output(req)

    def _end_stream_when_drained(self) -> None:
        if not self.closed or super().has_unfinished_requests() or self.handovers:
            return
        if not self.eos_sent:
            self.link.send(EndOfStream())
            self.eos_sent = True
            self.eos_time = time.monotonic()
        if self.peer_said_bye or not self.link.alive or time.monotonic() - self.eos_time > self.link.config.lease_s:
            self.link.close()
