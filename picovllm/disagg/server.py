"""A prefill or a decode engine as an HTTP server: `picovllm serve --role p|d`, reached through `picovllm proxy`.

P and D servers are linked pairwise: P listens for its D on --kv-port, D connects to it with
--kv-peer HOST:PORT, and the two engines speak the handover protocol of picovllm.disagg over that
PeerLink (Offer / Accept / KV blocks / Ack). One request, as the proxy (picovllm/disagg/proxy.py)
drives it, both calls on the same P-D pair and under the same request id:

    1. proxy -> D  POST /pd/decode {request_id}       D registers a listener for the id; its response
                                                      headers come back once it is registered.
    2. proxy -> P  POST /pd/prefill {request_id, prompt_token_ids, params, arrival_time}
                   P prefills, streams the first-token output back, and offers the request to D.
                   When D acknowledges the KV, P's last line carries "handed_off": true and P's
                   stream ends (P freed the blocks). A request that finishes at its first token
                   (EOS, max_tokens=1, a stop string) or fails on P ends on P with a final output.
    3. D decodes the request to its end and streams the outputs to the listener: cumulative, so
       the first token (P's) is in them too.

Both /pd routes answer NDJSON (picovllm/disagg/pd_http.py, shared with a fleet's servers). A client that goes
away aborts the request there (on P, an abort during the handover is forwarded to D). If D dies, P
fails what it was handing over and frees the blocks; it stays up, but later requests fail at once (no
re-linking yet). If P dies, D fails what it was receiving and decodes the rest to the end.

Both servers and the proxy share the P/D secret (--pd-secret-file, else $PICOVLLM_PD_SECRET;
picovllm.disagg.auth): the link starts with a mutual HMAC handshake (P refuses a D that fails it and
keeps waiting for its own; a D that P refuses stops with an error naming the flag), and every /pd
route needs the proxy's signature header (401 otherwise). /health, /metrics and /v1/models stay open.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from picovllm.config import EngineConfig
from picovllm.disagg.auth import AuthError, FleetSecret
from picovllm.disagg.channel import Channel, Listener, PeerGone
from picovllm.disagg.pd_http import (PDAsyncEngine, PDChildLoop, PDClient, add_prefill_route, listen_response,
                                     open_pd_engine, run_pd_server, setup_logging)
from picovllm.disagg.transfer import TransferConfig
from picovllm.engine.llm_engine import Engine
from picovllm.entrypoints.openai.api_server import ServerSettings
from picovllm.entrypoints.openai.serving import ServingContext

logger = logging.getLogger("picovllm.server")


@dataclass
class LinkSettings:
    """How a P server and its D server find each other, and the secret both prove."""
    secret: FleetSecret
    kv_host: str = "127.0.0.1"          # P: where it listens for its D
    kv_port: int = 0                    # P: the port (required for role p)
    kv_peer: str | None = None          # D: P's HOST:PORT (required for role d)
    backend: str = "torch_dist"
    lease_s: float = 10.0
    transfer_timeout_s: float = 30.0
    connect_timeout_s: float = 300.0    # D may start long before or after P

    def check(self, role: str) -> None:
        if role == "p" and not 0 < self.kv_port < 65536:
            raise ValueError(f"--kv-port: a prefill server needs the port its decode server connects to, "
                             f"got {self.kv_port}")
        if role == "d":
            if not self.kv_peer or ":" not in self.kv_peer:
                raise ValueError(f"--kv-peer: a decode server needs its prefill server's HOST:PORT, "
                                 f"got {self.kv_peer!r}")
            host, port = self.kv_peer.rsplit(":", 1)
            if not port.isdigit():
                raise ValueError(f"--kv-peer: port must be a number, got {port!r}")


# -- the /pd routes (the shared ones, and the engine under them: picovllm/disagg/pd_http.py) ----------
class DecodeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str


def add_pd_routes(app: FastAPI, ctx: ServingContext, role: str) -> None:
    engine: PDClient = ctx.engine

    @app.get("/pd/info")
    async def info() -> dict:
        return {**engine.role_info(), "link_alive": engine.stats.connector.get("link_alive", False)}

    if role == "p":
        add_prefill_route(app, ctx)
    else:
        @app.post("/pd/decode")
        async def decode(body: DecodeBody) -> StreamingResponse:
            return listen_response(engine, body.request_id)


# -- start-up -------------------------------------------------------------------------------------
def link_engine(engine: Engine, link: LinkSettings) -> None:
    """P: wait for the D server on kv_host:kv_port; D: connect to kv_peer (retrying while P starts)."""
    tc = TransferConfig(backend=link.backend, timeout_s=link.transfer_timeout_s, lease_s=link.lease_s,
                        connect_timeout_s=link.connect_timeout_s, host=link.kv_host)
    if engine.config.role == "p":
        listener = Listener(link.kv_host, link.kv_port, secret=link.secret)
        logger.info("prefill server: waiting for its decode server on %s:%d", link.kv_host, link.kv_port)
        try:
            channel = listener.accept(link.connect_timeout_s)
        finally:
            listener.close()
    else:
        host, port = link.kv_peer.rsplit(":", 1)
        deadline = time.monotonic() + link.connect_timeout_s
        while True:
            try:
                channel = Channel.connect((host, int(port)), timeout_s=10.0, secret=link.secret)
                break
            except PeerGone:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    engine.connect(channel, tc)
    logger.info("%s server: linked to its peer", "prefill" if engine.config.role == "p" else "decode")


def build_linked(config: EngineConfig, link: LinkSettings) -> Engine:
    """The role's engine, linked to its peer server (where the engine's loop runs: this process or its own)."""
    engine = Engine(config)     # the role's connector comes with the config
    try:
        link_engine(engine, link)
    except AuthError as e:
        engine.shutdown()
        raise SystemExit(f"error: --pd-secret-file: the link to the peer server failed authentication: {e}") \
            from None
    except BaseException:
        engine.shutdown()
        raise
    return engine


def serve_pd(engine_config: EngineConfig, settings: ServerSettings, link: LinkSettings) -> None:
    """Load the model, link to the peer server, then serve the /pd routes until SIGTERM/SIGINT."""
    setup_logging(settings)
    role = engine_config.role
    link.check(role)
    async_engine, tokenizer, sock = open_pd_engine(engine_config, settings, partial(build_linked, link=link),
                                                   PDAsyncEngine, PDChildLoop)
    run_pd_server(async_engine, tokenizer, engine_config, settings, link.secret,
                  lambda app, ctx: add_pd_routes(app, ctx, role),
                  f"a {'prefill' if role == 'p' else 'decode'} server (linked pair)", sock)
