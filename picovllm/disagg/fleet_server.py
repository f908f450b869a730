"""A prefill or decode instance of a fleet as an HTTP server: `picovllm serve --role p|d --kv-transfer tcp`,
behind `picovllm router` (picovllm/disagg/router.py). No pairwise link: any D pulls from any P.

One request, as the router drives it (the /pd routes answer NDJSON, as a linked pair's do:
picovllm/disagg/server.py):

    1. router -> P  POST /pd/prefill {request_id, prompt_token_ids, params, arrival_time}
                    P prefills and streams the first-token output; its last line carries
                    "kv_handover": a PublishedKV (the request as D needs it, and a KVHandle: which
                    instance, KV server address, layout, block ids). P's blocks stay held.
    2. router -> D  POST /pd/decode {request_id, handover}
                    D claims the handle on P, queues the request, pulls the KV when it has room,
                    releases it (P frees its blocks), decodes to the end and streams the outputs.

Every /pd route needs the fleet's signature header (picovllm.disagg.auth), and so does every KV
socket; /health, /metrics and /v1/models stay open. GET /pd/info says what the instance is, GET
/pd/load how busy (the router's least-loaded policy reads it; a failing one takes the instance out
of rotation). With --router URL the instance adds itself to that router once it is up.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from functools import partial

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from picovllm.config import EngineConfig
from picovllm.disagg.auth import FleetSecret, sign_request
from picovllm.disagg.fleet_decode import FleetDecodeConnector, check_offer
from picovllm.disagg.fleet_prefill import FleetPrefillConnector
from picovllm.disagg.messages import PublishedKV, from_wire
from picovllm.disagg.pd_http import (PDAsyncEngine, PDClient, PDPipeEnds, add_prefill_route, listen_response,
                                     open_pd_engine, run_pd_server, setup_logging)
from picovllm.disagg.transfer import PULL_BACKENDS, PullConfig
from picovllm.engine.llm_engine import Engine
from picovllm.entrypoints.openai.api_server import ServerSettings
from picovllm.entrypoints.openai.protocol import APIError
from picovllm.entrypoints.openai.serving import ServingContext

logger = logging.getLogger("picovllm.server")


@dataclass
class FleetSettings:
    """How a fleet instance moves KV and whom it trusts."""
    secret: FleetSecret
    backend: str = "tcp"
    kv_host: str = "127.0.0.1"          # P: where its KV server listens
    kv_port: int = 0                    # P: 0 takes any free port
    advertise_host: str | None = None   # where D instances and the router reach this instance
    lease_s: float = 10.0
    transfer_timeout_s: float = 30.0
    router: str | None = None           # a router's base URL to register with once up

    def check(self) -> None:
        if self.backend not in PULL_BACKENDS:
            raise ValueError(f"--kv-transfer: a fleet instance moves KV with one of {sorted(PULL_BACKENDS)}, "
                             f"got {self.backend!r}")

    def pull_config(self) -> PullConfig:
        return PullConfig(self.secret, instance_id=uuid.uuid4().hex[:12], backend=self.backend, host=self.kv_host,
                          port=self.kv_port, advertise_host=self.advertise_host, lease_s=self.lease_s,
                          timeout_s=self.transfer_timeout_s)


class FleetAsyncEngine(PDAsyncEngine):
    """A fleet instance's loop polls fast only while a pull may finish (D) or an offer waits to be taken;
    a P holding published KV checks for releases every poll_s (they only free blocks)."""

    def _poll_timeout(self, wait_s: float | None) -> float | None:
        if wait_s == 0:
            return 0
        return self.busy_poll_s if self.engine.connector.transfers_in_flight else self.poll_s

    def role_info(self) -> dict:
        e = self.engine
        t = e.connector.transfer
        return {"role": e.config.role, "fleet": True, "instance_id": t.config.instance_id, "backend": t.name,
                "kv_address": t.address if e.config.role == "p" else None, "block_size": e.config.block_size,
                "layout": dict(t.layout.__dict__), "max_model_len": e.max_model_len}

    def _connector_stats(self) -> dict:
        return dict(self.engine.connector.stats)


class FleetChildLoop(PDPipeEnds, FleetAsyncEngine):
    """FleetAsyncEngine's loop in a fleet instance's engine process."""


class ReleaseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str


def add_fleet_routes(app: FastAPI, ctx: ServingContext, role: str) -> None:
    engine: PDClient = ctx.engine

    @app.get("/pd/info")
    async def info() -> dict:
        return engine.role_info()

    @app.get("/pd/load")
    async def load() -> dict:
        s = engine.stats
        return {"running": s.num_running, "waiting": s.num_waiting, "free_blocks": s.num_free_blocks,
                "num_blocks": s.num_blocks, "kv_usage": 1.0 - s.num_free_blocks / max(s.num_blocks, 1),
                "alive": engine.is_running, "instance_id": engine.role_info().get("instance_id"), **s.connector}

    if role == "p":
        add_prefill_route(app, ctx)

        @app.post("/pd/release")
        async def release(body: ReleaseBody) -> dict:
            """The router's client left before a D took the request: its published KV is freed now, not at the
            lease's end (an abort; a request already gone, or never published here, is left as it is)."""
            engine.abort(body.request_id)
            return {"request_id": body.request_id}
    else:
        block_size = engine.role_info()["block_size"]

        @app.post("/pd/decode")
        async def decode(raw: Request) -> StreamingResponse:
            try:
                data = await raw.json()
            except ValueError as e:
                raise APIError(400, f"the body is not valid JSON: {e}") from None
            offer = _read_offer(data, block_size)
            response = listen_response(engine, offer.request.request_id)
            engine.offer(offer)
            return response


def _read_offer(body, block_size: int) -> PublishedKV:
    """The body of /pd/decode: {request_id, handover}; a 400 naming the field if it is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("request_id"), str):
        raise APIError(400, "request_id: a string is required", param="request_id")
    try:
        offer = from_wire(body.get("handover"), PublishedKV)
        check_offer(offer, block_size)
    except (ValueError, TypeError, KeyError) as e:
        raise APIError(400, f"handover: {e}", param="handover") from None
    if offer.request.request_id != body["request_id"]:
        raise APIError(400, f"request_id {body['request_id']!r} is not the handover's "
                            f"{offer.request.request_id!r}", param="request_id")
    return offer


def register_with_router(router: str, secret: FleetSecret, url: str, role: str, timeout_s: float = 60.0) -> None:
    """Add this instance to a router (retrying while the router starts); logs, never raises."""
    path, deadline = "/admin/instances", time.monotonic() + timeout_s
    body = json.dumps({"url": url, "role": role}).encode()
    while True:
        try:
            r = httpx.post(router.rstrip("/") + path, content=body, timeout=10.0,
                           headers={"content-type": "application/json", **sign_request(secret, "POST", path, body)})
            if r.status_code == 200:
                logger.info("registered with the router %s as %s", router, url)
                return
            why = f"HTTP {r.status_code}: {r.text[:200]}"
            if r.status_code < 500:
                break
        except httpx.HTTPError as e:
            why = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    logger.error("could not register with the router %s: %s", router, why)


def build_fleet(config: EngineConfig, pull: PullConfig) -> Engine:
    """The instance's engine with its KV transfer open (where the engine's loop runs: this process or its own)."""
    connector = FleetPrefillConnector(pull) if config.role == "p" else FleetDecodeConnector(pull)
    engine = Engine(config, connector=connector)
    connector.open(engine.executor)
    return engine


def serve_fleet(engine_config: EngineConfig, settings: ServerSettings, fleet: FleetSettings) -> None:
    """Load the model, open the KV transfer, serve the /pd routes until SIGTERM/SIGINT."""
    setup_logging(settings)
    fleet.check()
    role = engine_config.role
    async_engine, tokenizer, sock = open_pd_engine(engine_config, settings,
                                                   partial(build_fleet, pull=fleet.pull_config()),
                                                   FleetAsyncEngine, FleetChildLoop)
    info = async_engine.role_info()
    if fleet.router:
        url = f"http://{fleet.advertise_host or settings.host}:{settings.port}"
        threading.Thread(target=register_with_router, args=(fleet.router, fleet.secret, url, role),
                         name="picovllm-register", daemon=True).start()
    kv = f", KV on {info['kv_address'][0]}:{info['kv_address'][1]}" if role == "p" else ""
    run_pd_server(async_engine, tokenizer, engine_config, settings, fleet.secret,
                  lambda app, ctx: add_fleet_routes(app, ctx, role),
                  f"a fleet {'prefill' if role == 'p' else 'decode'} instance ({info['instance_id']}{kv})", sock)
