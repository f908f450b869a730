"""Role "p" in a fleet: the Engine with a FleetPrefillConnector prefills, samples the first token, and
publishes the request's KV for whichever decode instance the router picks.

No peer is linked: the connector runs a PullTransfer (picovllm.disagg.transfer.base) whose KV server
any decode instance of the fleet may claim from, pull from and release to. A request here goes
WAITING -> PREFILL -> (first token) -> published -> gone. Published: the scheduler holds it, blocks
kept (hold_after_prefill); the engine's last output for it carries the handle (kv_handover); its
blocks are freed when a D releases it, when the router gives it back (POST /pd/release: its client left
before a D took it), or when nobody claimed it within the lease, or when its claimant died. From
publishing on, whoever decodes it answers for it.
"""
from __future__ import annotations

import logging

from picovllm.disagg.link import cache_layout
from picovllm.disagg.messages import PublishedKV, to_wire
from picovllm.disagg.prefill import handover_request
from picovllm.disagg.transfer import PullConfig, PullTransfer, make_pull_transfer
from picovllm.engine.kv_connector import ConnectorReport, KVConnector
from picovllm.engine.request import Request

logger = logging.getLogger("picovllm.fleet")


def open_pull_transfer(role: str, runner, config: PullConfig) -> PullTransfer:
    """The engine's PullTransfer over its KV cache (TP=1 only: a fleet moves one rank's cache)."""
    layout = cache_layout(runner)
    if layout.tp_size != 1:
        raise ValueError(f"tensor_parallel_size: a fleet instance runs TP=1 for now (this one has "
                         f"{layout.tp_size}); use a linked pair (--kv-peer) with torch_dist for TP")
    return make_pull_transfer(role, runner.kv_cache, layout, config)


class FleetPrefillConnector(KVConnector):
    def __init__(self, config: PullConfig) -> None:
        self.config = config
        self.transfer: PullTransfer | None = None
        self.block_size = 0
        self.published: dict[str, Request] = {}       # held here until released or expired
        self._report = ConnectorReport()
        self.stats = {"published": 0, "released": 0, "expired": 0, "withdrawn": 0}

    def open(self, runner) -> None:
        """Start serving the engine's KV cache (runner: Engine.executor, once the cache is allocated)."""
        self.transfer = open_pull_transfer("p", runner, self.config)
        self.block_size = runner.block_size

    @property
    def address(self) -> list:
        """Where D instances reach this instance's KV server: [host, port]."""
        return self.transfer.address

    # -- scheduler half --------------------------------------------------------------------------
    def hold_after_prefill(self, req: Request) -> bool:
        return True

    def request_finished(self, req: Request) -> bool:
        """Aborted after publishing (the server is stopping, or the router's client left before a D took it:
        /pd/release): take the handle back, free at once."""
        if self.published.pop(req.request_id, None) is not None:
            self.transfer.unpublish(req.request_id)    # returns once no read of its blocks is in flight
            self.stats["withdrawn"] += 1
        return False

    def answers_for(self, req: Request) -> bool:
        return req.request_id not in self.published

    # -- worker half -----------------------------------------------------------------------------
    def start_send(self, req: Request) -> None:
        offer = handover_request(req, self.block_size)
        handle = self.transfer.publish(req.request_id, offer.src_block_ids, offer.num_kv_tokens)
        self.published[req.request_id] = req
        self.stats["published"] += 1
        self._report.published[req.request_id] = to_wire(PublishedKV(offer, handle))

    def poll(self, idle: bool) -> ConnectorReport:
        assert self.transfer is not None, "open() the fleet connector on the engine's runner first"
        rep, self._report = self._report, ConnectorReport()
        for done in self.transfer.poll():
            if self.published.pop(done.request_id, None) is None:
                continue
            rep.released.append(done.request_id)
            if done.error is None:
                self.stats["released"] += 1
            else:
                self.stats["expired"] += 1
                logger.warning("request %s: KV freed without a decode instance taking it: %s", done.request_id,
                               done.error)
        return rep

    def shutdown(self) -> None:
        """Stop the KV server (the engine is going away)."""
        if self.transfer is not None:
            self.transfer.close()
