"""The client side of the /pd routes: one request streamed through a P server and then a D server.

`picovllm proxy` (a linked pair, picovllm/disagg/proxy.py) and `picovllm router` (a fleet,
picovllm/disagg/router.py) differ in how they pick the servers and in what P's hand-over line
carries; the wire and the loop are these:

    open_pd_stream(...)         a signed POST to a /pd route, its response streamed (RemoteEngine.post_stream:
                                a connection of its own, picovllm/disagg/http_stream.py); refusals sorted
                                into the client's fault (ValueError) and the server's (EngineDeadError)
    ndjson_outputs(resp, who)   a route's NDJSON lines as (RequestOutput, line): the first whole, later
                                ones as deltas (picovllm.disagg.messages.OutputDecoder)
    prefill_then_decode(...)    P's outputs up to the line that hands the request over, then D's
    RemoteEngine                what the OpenAI handlers need of an engine (start, add_request, abort_all,
                                shutdown, ...) when the engine is other servers: the HTTP client (for the
                                short calls), the streams open through it
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from picovllm.disagg.auth import FleetSecret, sign_request
from picovllm.disagg.http_stream import StreamedResponse, post_stream
from picovllm.disagg.messages import OutputDecoder
from picovllm.entrypoints.openai.engine_client import EngineDeadError, EngineStepError, checked
from picovllm.outputs import CompletionOutput, RequestOutput
from picovllm.sampling_params import SamplingParams

Lines = AsyncIterator[tuple[RequestOutput, dict]]


class RemoteEngine:
    """The AsyncEngine surface of an engine made of other servers (the proxy's pairs, the router's fleet):
    one HTTP client, started with the server's event loop, and the request streams open through it.
    A stream registers with track() and leaves with forget() (its close()); add_request is the owner's. An owner
    that watches its servers sets health_interval_s: check_health() then runs that often while it is started."""

    name = "engine"          # in errors: "the proxy is not running"
    health_interval_s: float | None = None
    # a server that sends no status and headers this long after a request went to it is taken for frozen: the
    # request fails there (StreamError), as one it could not reach (the owner sets its lease; None: no limit)
    answer_timeout_s: float | None = None

    def __init__(self, model_info: dict, metrics=None, connect_timeout_s: float = 10.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        """transport: instead of the network (tests); the streams then go through the HTTP client too."""
        self._model_info, self.metrics = model_info, metrics
        self._connect_timeout_s = connect_timeout_s
        self._timeout = httpx.Timeout(connect=connect_timeout_s, read=None, write=connect_timeout_s, pool=None)
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._streams: set = set()
        self._health: asyncio.Task | None = None

    def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self._timeout, transport=self._transport,
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        if self.health_interval_s is not None:
            self._health = asyncio.get_running_loop().create_task(self._watch_health())

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_health()

    async def check_health(self) -> None:
        """Check the servers (the owner's; run every health_interval_s)."""

    @property
    def is_running(self) -> bool:
        return self._client is not None

    @property
    def unavailable(self) -> str | None:
        """Why no request could be served now (the servers' state; /health answers 503 with it), else None."""
        return None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise EngineDeadError(f"the {self.name} is not running")
        return self._client

    def model_info(self) -> dict:
        return dict(self._model_info)

    def eos_token_ids(self) -> None:
        """Unknown here (beam search, which needs them, is refused through a proxy or router)."""
        return None

    async def post_stream(self, base: str, path: str, body: bytes, headers: dict[str, str]):
        """POST to a /pd route, the response streamed (status_code, aiter_lines, aread, aclose): a connection of
        its own, not the client's pool. StreamError or httpx.HTTPError if the server cannot be reached."""
        if self._transport is None:
            return await post_stream(base, path, body, headers, self._connect_timeout_s, self.answer_timeout_s)
        return await self.client.send(self.client.build_request("POST", base + path, content=body, headers=headers),
                                      stream=True)

    def track(self, stream) -> None:
        self._streams.add(stream)

    def forget(self, stream) -> None:
        self._streams.discard(stream)

    def abort_all(self) -> None:
        """Abort every open stream (the server is stopping: the end of its graceful period, a second signal): each
        ends with an abort output where it is read, as a colocated engine's requests do, and each server whose client
        went away aborts its request."""
        for stream in list(self._streams):
            stream.stop()

    async def shutdown(self) -> None:
        if self._health is not None:
            self._health.cancel()
        self.abort_all()
        if self._client is not None:
            await asyncio.sleep(0)            # let the closes scheduled by abort_all run
            await self._client.aclose()
            self._client = None


def fail_stream(resp, why: str) -> None:
    """End the reads of a /pd stream whose server stopped answering, in an error (StreamBroken where read)."""
    if isinstance(resp, StreamedResponse):
        resp.fail(why)
    else:      # an httpx stream (tests' transports)
        asyncio.ensure_future(resp.aclose())


class StreamBroken(EngineStepError):
    """A server's stream broke (it died, or the network did), as opposed to an error it reported."""


async def open_pd_stream(engine: RemoteEngine, base: str, path: str, body: bytes, secret: FleetSecret, who: str):
    """POST a JSON body to base + path, signed with the P/D secret; the response, streamed (status 200).

    who names the server in errors ("the prefill server URL"). ValueError: it refused the request
    itself (a 4xx other than 401/404/405, with its message: the client's fault); EngineDeadError: it
    cannot be reached, refused our signature, or failed."""
    headers = {"content-type": "application/json", **sign_request(secret, "POST", path, body)}
    try:
        resp = await engine.post_stream(base, path, body, headers)
    except (OSError, httpx.HTTPError) as e:
        raise EngineDeadError(f"{who} is unreachable: {type(e).__name__}: {e}") from None
    if resp.status_code == 200:
        return resp
    try:
        message = json.loads(await resp.aread())["error"]["message"]
    except (OSError, httpx.HTTPError, ValueError, KeyError, TypeError):
        message = f"HTTP {resp.status_code}"
    finally:
        await resp.aclose()
    if resp.status_code == 401:
        message += " (--pd-secret-file: not the server's secret?)"
    elif 400 <= resp.status_code < 500 and resp.status_code not in (404, 405):
        raise ValueError(message)
    raise EngineDeadError(f"{who} answered {resp.status_code}: {message}")


async def ndjson_outputs(resp, who: str) -> Lines:
    """A /pd route's stream as (output, line) pairs. EngineStepError for an error line the server sent,
    StreamBroken for a stream that broke or does not parse."""
    wire = OutputDecoder()
    try:
        async for text in resp.aiter_lines():
            if not text:
                continue
            line = json.loads(text)
            if "error" in line:
                raise EngineStepError(f"{who} failed: {line['error']}")
            yield wire.decode(line), line
    except (OSError, httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as e:
        raise StreamBroken(f"{who} failed mid-request: {type(e).__name__}: {e}") from None


def prefill_body(prompt_token_ids: list[int], params: SamplingParams, request_id: str, arrival_time: float | None,
                 priority: int) -> dict:
    """The body of POST /pd/prefill (pd_http.PrefillBody)."""
    return {"request_id": request_id, "prompt_token_ids": list(prompt_token_ids), "params": dataclasses.asdict(params),
            "arrival_time": arrival_time or time.time(), "priority": priority}


FAILED_ON_P_OR_D = "the request failed on a prefill or decode server"     # an error output that says no more


def aborted_output(last: RequestOutput | None, request_id: str, prompt_token_ids: list[int]) -> RequestOutput:
    """The final output of a request aborted here (RemoteEngine.abort_all) after its last output `last` (None: before
    any): what it had, finished with finish_reason "abort", as an engine ends a request it aborts."""
    if last is None:
        return RequestOutput(request_id, None, list(prompt_token_ids),
                             [CompletionOutput(0, "", [], None, None, "abort")], True)
    return dataclasses.replace(last, finished=True, kv_handover=None,
                               outputs=[dataclasses.replace(c, finish_reason="abort", stop_reason=None)
                                        for c in last.outputs])


async def prefill_then_decode(prefill: Lines, handover_of: Callable[[dict], Any],
                              open_decode: Callable[[Any], Awaitable[Lines]], who: Callable[[str], str],
                              metrics=None,
                              stopped: Callable[[], bool] = lambda: False) -> AsyncIterator[RequestOutput]:
    """One request's outputs: P's until the line whose handover_of(line) is not None (its output, the
    first token, comes unfinished), then those of open_decode(that handover), D's, cumulative.

    who(role) names the server of role "p" or "d" in errors (asked when one happens: a router may
    have moved the request). An output that failed, or a stream that ends before a finished
    output, raises EngineStepError; metrics (ServerMetrics) counts it (not where stopped() says the stream was
    aborted here: its streams' ends broke because they were closed), and observes what finishes."""
    try:
        handover = None
        async for out, line in prefill:
            checked(out, FAILED_ON_P_OR_D)
            handover = handover_of(line)
            if handover is not None:
                out.finished = False
                yield out                      # the first token, from P; D has (or takes) the request now
                break
            _observe(metrics, out)
            yield out
            if out.finished:
                return
        if handover is None:
            raise EngineStepError(f"{who('p')} ended the request's stream early")
        async for out, _ in await open_decode(handover):
            checked(out, FAILED_ON_P_OR_D)
            _observe(metrics, out)
            yield out
            if out.finished:
                return
        raise EngineStepError(f"{who('d')} ended the request's stream early")
    except EngineStepError:
        if metrics is not None and not stopped():
            metrics.count_outcome("error")
        raise


def _observe(metrics, out: RequestOutput) -> None:
    if out.finished and metrics is not None:
        metrics.observe_finished(out)
