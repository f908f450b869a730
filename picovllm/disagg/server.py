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

Both /pd routes answer NDJSON, one output per line: the first whole ({"output": ...}), the later ones
as what changed ({"delta": ...}, picovllm.disagg.messages.OutputEncoder: a whole output holds the
prompt's ids and every token so far), {"error": "..."} if the engine loop failed. A client that goes
away aborts the request there (on P, an abort during the handover is forwarded to D). If D dies, P
fails what it was handing over and frees the blocks; it stays up, but later requests fail at once (no
re-linking yet). If P dies, D fails what it was receiving and decodes the rest to the end.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from picovllm.config import EngineConfig
from picovllm.disagg.channel import Channel, Listener, PeerGone
from picovllm.disagg.messages import OutputEncoder
from picovllm.disagg.prefill import PrefillConnector
from picovllm.disagg.transfer import TransferConfig
from picovllm.engine.llm_engine import Engine
from picovllm.entrypoints.openai.api_server import BACKSTOP_SECONDS, ServerSettings, _Server, build_app, \
    default_model_name
from picovllm.entrypoints.openai.async_engine import AsyncEngine, EngineDeadError, RequestStream
from picovllm.entrypoints.openai.metrics import ServerMetrics
from picovllm.entrypoints.openai.protocol import APIError
from picovllm.entrypoints.openai.serving import ENGINE_ERRORS, ServingContext
from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
from picovllm.outputs import RequestOutput
from picovllm.sampling_params import SamplingParams

logger = logging.getLogger("picovllm.server")


@dataclass
class LinkSettings:
    """How a P server and its D server find each other."""
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


def is_handed_off(out: RequestOutput) -> bool:
    """P's last output for a request D took over: finished on P, without a finish reason."""
    return out.finished and out.outputs[0].finish_reason is None


class PDAsyncEngine(AsyncEngine):
    """AsyncEngine over a P or D engine: it keeps stepping to watch the peer link (or a fleet's KV
    transfers); on the P of a linked pair it turns D's Ack into a last output for the request
    (is_handed_off: a fleet's P engine emits that output itself, with its kv_handover); on D requests
    are listened to, not added."""
    # The peer's messages cannot wake the loop thread (it waits on a command queue): it polls for them,
    # often while a request waits on the peer (an Accept, an Ack, a transfer), now and then otherwise.
    poll_s = 0.005
    busy_poll_s = 0.0005

    def __init__(self, engine: Engine, metrics=None) -> None:
        super().__init__(engine, metrics)
        self._last: dict[str, RequestOutput] = {}    # P: each request's latest output (loop thread only)

    def _poll_timeout(self, wait_s: float | None) -> float | None:
        if wait_s == 0:
            return 0
        return self.busy_poll_s if self.engine.has_unfinished_requests() else self.poll_s

    def _after_step(self, outputs: list) -> list:
        engine = self.engine
        if isinstance(engine.connector, PrefillConnector):
            for out in outputs:
                if out.finished:
                    self._last.pop(out.request_id, None)
                else:
                    self._last[out.request_id] = out
            handed_off = engine.connector.handed_off
            for rid in list(handed_off):        # acked by D since the last step: D owns it now
                handed_off.discard(rid)
                last = self._last.pop(rid, None)
                if last is not None:
                    outputs.append(dataclasses.replace(last, finished=True))
        return outputs

    def _abort_into(self, request_id: str, outputs: list) -> None:
        self._last.pop(request_id, None)
        super()._abort_into(request_id, outputs)

    def _finish_outputs(self, outputs: list) -> None:
        super()._finish_outputs([o for o in outputs if not (isinstance(o, RequestOutput) and is_handed_off(o))])

    def listen(self, request_id: str) -> RequestStream:
        """D: a stream for a request that will arrive from P. Closing it before it finished aborts it."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = self._streams[request_id] = RequestStream(request_id, self)
        stream.accepted.set_result(None)
        return stream

    async def shutdown(self) -> None:
        await super().shutdown()
        self.engine.connector.shutdown()            # the peer sees us leave


# -- the /pd routes ---------------------------------------------------------------------------------
class PrefillBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str
    prompt_token_ids: list[int]
    params: dict
    arrival_time: float


class DecodeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str


async def _ndjson(stream: RequestStream) -> AsyncIterator[str]:
    wire = OutputEncoder()
    try:
        async for out in stream.outputs():
            line = wire.encode(out)
            if is_handed_off(out):
                line["handed_off"] = True
            if out.kv_handover is not None:          # a fleet's P: where D pulls the KV from
                line["kv_handover"] = out.kv_handover
            yield json.dumps(line) + "\n"
    except ENGINE_ERRORS as e:
        yield json.dumps({"error": str(e)}) + "\n"
    finally:
        stream.close()


def _ndjson_response(stream: RequestStream) -> StreamingResponse:
    return StreamingResponse(_ndjson(stream), media_type="application/x-ndjson")


def add_pd_routes(app: FastAPI, ctx: ServingContext, role: str) -> None:
    engine: PDAsyncEngine = ctx.engine

    @app.get("/pd/info")
    async def info() -> dict:
        link = engine.engine.connector.link
        sock = link.channel.sock if link is not None and not link.closed else None
        pair = None
        if sock is not None:
            try:
                pair = [list(sock.getsockname()[:2]), list(sock.getpeername()[:2])]
            except OSError:
                pair = None
        return {"role": role, "link": pair, "link_alive": link is not None and link.alive}

    if role == "p":
        @app.post("/pd/prefill")
        async def prefill(body: PrefillBody) -> StreamingResponse:
            try:
                params = SamplingParams(**body.params)
            except (TypeError, ValueError) as e:
                raise APIError(400, f"params: {e}", param="params") from None
            stream = await ctx.add(body.prompt_token_ids, params, body.request_id, body.arrival_time)
            return _ndjson_response(stream)
    else:
        @app.post("/pd/decode")
        async def decode(body: DecodeBody) -> StreamingResponse:
            try:
                stream = engine.listen(body.request_id)
            except ValueError as e:
                raise APIError(400, str(e), param="request_id") from None
            except EngineDeadError as e:
                raise APIError(503, str(e), type="service_unavailable") from None
            return _ndjson_response(stream)


# -- start-up -------------------------------------------------------------------------------------
def link_engine(engine: Engine, link: LinkSettings) -> None:
    """P: wait for the D server on kv_host:kv_port; D: connect to kv_peer (retrying while P starts)."""
    tc = TransferConfig(backend=link.backend, timeout_s=link.transfer_timeout_s, lease_s=link.lease_s,
                        connect_timeout_s=link.connect_timeout_s, host=link.kv_host)
    if engine.config.role == "p":
        listener = Listener(link.kv_host, link.kv_port)
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
                channel = Channel.connect((host, int(port)), timeout_s=10.0)
                break
            except PeerGone:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    engine.connect(channel, tc)
    logger.info("%s server: linked to its peer", "prefill" if engine.config.role == "p" else "decode")


def serve_pd(engine_config: EngineConfig, settings: ServerSettings, link: LinkSettings) -> None:
    """Load the model, link to the peer server, then serve the /pd routes until SIGTERM/SIGINT."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    role = engine_config.role
    link.check(role)
    engine = Engine(engine_config)     # the role's connector comes with the config
    link_engine(engine, link)
    name = settings.served_model_name or default_model_name(engine_config.model)
    metrics = ServerMetrics(name)
    async_engine = PDAsyncEngine(engine, metrics)
    ctx = ServingContext(async_engine, TokenizerWorker(engine.tokenizer), metrics, name)
    app = build_app(ctx, settings, openai_routes=False)
    add_pd_routes(app, ctx, role)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=settings.access_log,
                            timeout_graceful_shutdown=settings.shutdown_timeout + BACKSTOP_SECONDS)
    logger.info("serving %s (%s role) on http://%s:%d", name, "prefill" if role == "p" else "decode",
                settings.host, settings.port)
    _Server(config, async_engine, settings.shutdown_timeout).run()
