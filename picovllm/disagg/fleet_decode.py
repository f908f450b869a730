"""Role "d" in a fleet: the Engine with a FleetDecodeConnector decodes requests that any prefill instance
published, pulling their KV from it.

A request comes in as a PublishedKV (from the router, through the D server: offer(), the one method
another thread may call). The next poll() claims it on its P (which then keeps the KV for as long as
this instance lives) and reports it offered: a waiting request whose first num_tokens tokens are
external. The scheduler admits it when it can allocate its blocks (flow control: P's cache holds the
KV meanwhile); start_recv starts the pull; when it is done the request decodes, and the handle is
released, which frees P's copy. From the offer on, this engine answers for the request: a refusal, a
failed claim or pull ends it here with an error output.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from picovllm.disagg.decode import request_from_handover
from picovllm.disagg.fleet_prefill import open_pull_transfer
from picovllm.disagg.messages import PublishedKV
from picovllm.disagg.transfer import PullConfig, PullTransfer
from picovllm.engine.kv_connector import ConnectorReport, KVConnector
from picovllm.engine.request import Request


@dataclass
class Pulling:
    offer: PublishedKV
    req: Request
    cancelled: bool = False       # aborted meanwhile: its blocks go when the pull ends


class FleetDecodeConnector(KVConnector):
    def __init__(self, config: PullConfig) -> None:
        self.config = config
        self.transfer: PullTransfer | None = None
        self.block_size = 0
        self._inbox: list[PublishedKV] = []       # offer() -> next poll(); under _lock
        self._lock = threading.Lock()
        self.offers: dict[str, tuple[PublishedKV, Request]] = {}  # claimed, queued in the scheduler, no pull yet
        self.pulling: dict[str, Pulling] = {}
        self._report = ConnectorReport()
        self.stats = {"offered": 0, "pulled": 0, "failed": 0}

    def open(self, runner) -> None:
        """Start pulling into the engine's KV cache (runner: Engine.executor, once the cache is allocated)."""
        self.transfer = open_pull_transfer("d", runner, self.config)
        self.block_size = runner.block_size

    def check(self, offer: PublishedKV) -> None:
        """ValueError or TypeError naming what is wrong with an offer, before it is made (any thread)."""
        check_offer(offer, self.block_size)

    def offer(self, offer: PublishedKV) -> None:
        """A request to decode (any thread): queued by the next poll()."""
        with self._lock:
            self._inbox.append(offer)

    # -- scheduler half --------------------------------------------------------------------------
    def num_external_tokens(self, req: Request) -> int:
        entry = self.offers.get(req.request_id)
        return entry[0].handle.num_tokens if entry is not None and entry[1] is req else 0

    def request_finished(self, req: Request) -> bool:
        rid = req.request_id
        entry = self.offers.get(rid)
        if entry is not None and entry[1] is req:   # refused or aborted before its pull: P may free it now
            del self.offers[rid]
            self.transfer.release(entry[0].handle)
            return False
        p = self.pulling.get(rid)
        if p is None or p.req is not req:        # not ours (a refused duplicate id)
            return False
        p.cancelled = True                       # the pull may still write its blocks
        return True

    # -- worker half -----------------------------------------------------------------------------
    def start_recv(self, req: Request) -> None:
        offer, _ = self.offers.pop(req.request_id)
        dst = req.block_table[:len(offer.handle.block_ids)]
        try:
            self.transfer.start_pull(offer.handle, dst)
        except (ValueError, RuntimeError) as e:
            self.transfer.release(offer.handle)
            self._report.failed[req.request_id] = f"cannot pull its KV: {e}"
            return
        self.pulling[req.request_id] = Pulling(offer, req)

    def poll(self, idle: bool) -> ConnectorReport:
        assert self.transfer is not None, "open() the fleet connector on the engine's runner first"
        rep, self._report = self._report, ConnectorReport()
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for offer in inbox:
            self._take(offer, rep)
        for done in self.transfer.poll():
            self._settle(done.request_id, done.error, rep)
        return rep

    def forward_abort(self, request_id: str) -> None:
        """Aborted before the next poll() took its offer: give it back to P."""
        with self._lock:
            gone = [o for o in self._inbox if o.request.request_id == request_id]
            self._inbox = [o for o in self._inbox if o.request.request_id != request_id]
        for offer in gone:
            self.transfer.release(offer.handle)

    @property
    def transfers_in_flight(self) -> bool:
        return bool(self.pulling or self._inbox)

    def shutdown(self) -> None:
        if self.transfer is not None:
            self.transfer.close()

    # -- the protocol ----------------------------------------------------------------------------
    def _take(self, offer: PublishedKV, rep: ConnectorReport) -> None:
        rid = offer.request.request_id
        req = request_from_handover(offer.request, self.block_size)   # checked by the caller of offer()
        rep.offered.append(req)
        self.stats["offered"] += 1
        if rid in self.offers or rid in self.pulling:
            return                               # the engine refuses the duplicate id (and answers it)
        self.offers[rid] = (offer, req)
        try:
            self.transfer.claim(offer.handle)
        except (ValueError, RuntimeError) as e:  # applied after `offered`: the engine fails it at once
            del self.offers[rid]
            self.transfer.release(offer.handle)
            rep.failed[rid] = f"cannot take its KV: {e}"

    def _settle(self, rid: str, error: str | None, rep: ConnectorReport) -> None:
        """A claim failed, or a pull ended: the request fails, decodes, or (aborted) goes."""
        if self.offers.pop(rid, None) is not None:   # a failed claim: P no longer has it
            self.stats["failed"] += 1
            rep.failed[rid] = error or "the prefill instance refused the claim"
            return
        p = self.pulling.pop(rid, None)
        if p is None:
            return
        self.transfer.release(p.offer.handle)
        if p.cancelled:
            rep.released.append(rid)
        elif error is not None:
            self.stats["failed"] += 1
            rep.failed[rid] = error
        else:
            self.stats["pulled"] += 1
            rep.arrived.append(rid)


def check_offer(offer: PublishedKV, block_size: int) -> None:
    """ValueError or TypeError naming what is wrong with an offer to a D of this block size (the HTTP side checks it
    before the engine's loop takes it)."""
    request_from_handover(offer.request, block_size)
    if offer.request.request_id != offer.handle.request_id:
        raise ValueError(f"handle.request_id {offer.handle.request_id!r} is not request.request_id "
                         f"{offer.request.request_id!r}")
