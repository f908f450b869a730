"""What every P or D HTTP server shares, a linked pair's (picovllm/disagg/server.py) and a fleet instance's
(picovllm/disagg/fleet_server.py): the async engine over a role's Engine, the /pd routes' NDJSON
streams, the /pd/prefill route, and start-up (the OpenAI app without generation routes, the P/D
secret's signature on every /pd route, uvicorn with the graceful shutdown of `picovllm serve`).

The /pd routes answer NDJSON, one output per line: the first whole ({"output": ...}), the later
ones as what changed ({"delta": ...}, picovllm.disagg.messages.OutputEncoder: a whole output holds
the prompt's ids and every token so far), {"error": "..."} if the engine loop failed. The client
side of them: picovllm/disagg/handover_stream.py.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from picovllm.config import EngineConfig
from picovllm.disagg.auth import FleetSecret, SignedRoutes
from picovllm.disagg.messages import OutputEncoder
from picovllm.disagg.prefill import PrefillConnector
from picovllm.engine.llm_engine import Engine
from picovllm.entrypoints.openai.api_server import ServerSettings, build_app, run_app, served_name
from picovllm.entrypoints.openai.api_workers import bind
from picovllm.entrypoints.openai.async_engine import AsyncEngine
from picovllm.entrypoints.openai.engine_client import EngineClient, EngineDeadError, RequestStream
from picovllm.entrypoints.openai.engine_process import PipeEnds, ProcessAsyncEngine, open_async_engine
from picovllm.entrypoints.openai.metrics import ServerMetrics
from picovllm.entrypoints.openai.protocol import APIError
from picovllm.entrypoints.openai.serving import ENGINE_ERRORS, ServingContext
from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
from picovllm.outputs import RequestOutput
from picovllm.sampling_params import SamplingParams

logger = logging.getLogger("picovllm.server")


def is_handed_off(out: RequestOutput) -> bool:
    """P's last output for a request D took over: finished on P, without a finish reason."""
    return out.finished and out.outputs[0].finish_reason is None


class PDClient:
    """The HTTP side of a P or D engine, wherever its loop runs (a thread: PDAsyncEngine; a process of its own:
    ProcessPDEngine). Mixed into an EngineClient."""

    def listen(self, request_id: str) -> RequestStream:
        """D: a stream for a request that will arrive from P. Closing it before it finished aborts it."""
        if not self.is_running:
            raise EngineDeadError(self.ended_why or "the engine loop is not running")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = self._streams[request_id] = RequestStream(request_id, self)
        stream.accepted.set_result(None)
        return stream

    def offer(self, offer) -> None:
        """A fleet's D: a request to pull and decode (picovllm.disagg.messages.PublishedKV), checked by the caller."""
        self._commands.put(OfferKV(offer))

    def _finish_outputs(self, outputs: list) -> None:
        super()._finish_outputs([o for o in outputs if not (isinstance(o, RequestOutput) and is_handed_off(o))])


@dataclass
class OfferKV:
    """The command PDClient.offer sends the loop."""
    offer: object


class PDAsyncEngine(PDClient, AsyncEngine):
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
        if self.adds_deltas:        # a D's requests come from its connector, not from this loop's adds
            engine.stream_deltas = True

    @property
    def adds_deltas(self) -> bool:
        """A D's outputs are made as deltas and added up on the loop's thread (AsyncEngine's); a P's stay cumulative:
        a linked P re-sends a request's last output when D takes it over (_after_step)."""
        return self.engine.config.role == "d"

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
            for rid in engine.connector.take_handed_off():     # acked by D since the last step: D owns it now
                last = self._last.pop(rid, None)
                if last is not None:
                    outputs.append(dataclasses.replace(last, finished=True))
        return outputs

    def _iteration(self) -> bool:
        """AsyncEngine's iteration; once the engine cannot step again (a tensor-parallel rank died) it also drops the
        link: the peer fails and frees what it waited for, and /pd/info says the link is down, which takes the pair
        out of the proxy's rotation (else the proxy kept routing to it and the peer kept offering to it)."""
        going = super()._iteration()
        if going or self._cannot_step() is None:
            return going
        self.release()
        self._publish_stats()        # link_alive False reaches the HTTP side (a process's: with its last delivery)
        self._deliver([])
        return False

    def _abort_into(self, request_id: str, outputs: list) -> None:
        self._last.pop(request_id, None)
        super()._abort_into(request_id, outputs)

    def _abort_all_into(self, outputs: list) -> None:
        for rid in self.engine.requests:
            self._last.pop(rid, None)
        super()._abort_all_into(outputs)

    def _handle(self, cmd, outputs: list) -> bool:
        if isinstance(cmd, OfferKV):
            self.engine.connector.offer(cmd.offer)
            return False
        return super()._handle(cmd, outputs)

    def role_info(self) -> dict:
        """A linked pair's: the role and the link's two socket ends (the proxy pairs servers by them)."""
        link = self.engine.connector.link
        sock = link.channel.sock if link is not None and not link.closed else None
        pair = None
        if sock is not None:
            try:
                pair = [list(sock.getsockname()[:2]), list(sock.getpeername()[:2])]
            except OSError:
                pair = None
        return {"role": self.engine.config.role, "link": pair, "max_model_len": self.engine.max_model_len}

    def _connector_stats(self) -> dict:
        link = self.engine.connector.link
        return {"link_alive": link is not None and link.alive}

    def release(self) -> None:
        self.engine.connector.shutdown()            # the peer sees us leave

    async def shutdown(self) -> None:
        await super().shutdown()
        self.release()


class PDPipeEnds(PipeEnds):
    """PipeEnds for a P or D engine. A D's engine makes its CUMULATIVE requests' outputs as DELTA ones
    (Engine.stream_deltas), as a colocated engine does: making every request's whole output every step had cost ~11 ms
    a step at batch 256 with 2,000-token outputs (benchmarks/served_outputs.py), and the server's side adds them up
    (output_deltas.OutputsFromDeltas). A P's stay cumulative: a linked P re-sends a request's last output when D
    takes it over (PDAsyncEngine._after_step), and a P's requests have an output or two each."""

    @property
    def stream_deltas(self) -> bool:
        return self.engine.config.role == "d"


class PDChildLoop(PDPipeEnds, PDAsyncEngine):
    """PDAsyncEngine's loop in a server's engine process (ProcessPDEngine)."""


class ProcessPDEngine(PDClient, ProcessAsyncEngine):
    """The HTTP side of a P or D engine whose loop runs in a process of its own."""


# -- the /pd routes ---------------------------------------------------------------------------------
class PrefillBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str
    prompt_token_ids: list[int]
    params: dict
    arrival_time: float
    priority: int = 0


async def _ndjson_lines(stream: RequestStream) -> AsyncIterator[str]:
    wire = OutputEncoder()
    published, ended = False, False
    try:
        async for out in stream.outputs():
            line = wire.encode(out)
            if is_handed_off(out):
                line["handed_off"] = True
            if out.kv_handover is not None:          # a fleet's P: where D pulls the KV from
                line["kv_handover"] = out.kv_handover
                published = True
            yield json.dumps(line) + "\n"
        ended = True
    except ENGINE_ERRORS as e:
        ended = True
        yield json.dumps({"error": str(e)}) + "\n"
    finally:
        if published and not ended:   # the reader left as the handle went out: no D will take this KV, free it now
            stream.abort()
        stream.close()


class _ClosingStreamingResponse(StreamingResponse):
    """A /pd stream whose generator is closed however the response ends. A client that goes away while a line is
    being sent cancels the send, not the generator, which stays suspended at that line until a garbage collection
    finds it (its traceback keeps it in a cycle); a fleet P's published KV then waited for the lease."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def ndjson_response(stream: RequestStream) -> StreamingResponse:
    return _ClosingStreamingResponse(_ndjson_lines(stream), media_type="application/x-ndjson")


def add_prefill_route(app: FastAPI, ctx: ServingContext) -> None:
    """POST /pd/prefill: the request added to P's engine, its outputs streamed."""
    @app.post("/pd/prefill")
    async def prefill(body: PrefillBody) -> StreamingResponse:
        try:
            params = SamplingParams(**body.params)
        except (TypeError, ValueError) as e:
            raise APIError(400, f"params: {e}", param="params") from None
        stream = await ctx.add(body.prompt_token_ids, params, body.request_id, body.arrival_time, body.priority)
        return ndjson_response(stream)


def listen_response(engine: PDAsyncEngine, request_id: str) -> StreamingResponse:
    """D: the stream of a request that will arrive from P; a 400 naming request_id if it is taken, a 503
    if the engine loop is down."""
    try:
        stream = engine.listen(request_id)
    except ValueError as e:
        raise APIError(400, str(e), param="request_id") from None
    except EngineDeadError as e:
        raise APIError(503, str(e), type="service_unavailable") from None
    return ndjson_response(stream)


def open_pd_engine(config: EngineConfig, settings: ServerSettings, build: Callable[[EngineConfig], Engine],
                   loop_cls: type[PDAsyncEngine], child_loop_cls: type) -> tuple[EngineClient, Any, socket.socket]:
    """A P or D server's engine client (its loop a thread, or a process of its own: settings.engine_process), the
    tokenizer for the HTTP side, and its listening socket, bound before the engine is built (api_workers.bind: a port
    in use is said at once); build(config) makes the engine where the loop runs."""
    metrics = ServerMetrics(served_name(settings, config.model), speculative=config.speculative_config is not None)
    sock = bind(settings.host, settings.port)
    try:
        async_engine, tokenizer, _ = open_async_engine(config, settings, metrics, build, loop_cls, child_loop_cls,
                                                       ProcessPDEngine)
    except BaseException:
        sock.close()
        raise
    return async_engine, tokenizer, sock


def run_pd_server(async_engine: EngineClient, tokenizer, config: EngineConfig, settings: ServerSettings,
                  secret: FleetSecret, add_routes: Callable[[FastAPI, ServingContext], None], what: str,
                  sock: socket.socket) -> None:
    """Serve an engine's /pd routes (add_routes adds them; every one needs the secret's signature) until
    SIGTERM/SIGINT; what: the log line's description of the server; sock: its socket (open_pd_engine's)."""
    name = served_name(settings, config.model)
    ctx = ServingContext(async_engine, TokenizerWorker(tokenizer), async_engine.metrics, name)
    app = build_app(ctx, settings, openai_routes=False)
    add_routes(app, ctx)
    app.add_middleware(SignedRoutes, secret=secret, prefixes=("/pd/",))
    logger.info("serving %s as %s on http://%s:%d", name, what, settings.host, settings.port)
    run_app(app, async_engine, settings, sock)


def setup_logging(settings: ServerSettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
