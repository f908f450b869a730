"""The client side of the /pd routes: one request streamed through a P server and then a D server.

`picovllm proxy` (a linked pair, picovllm/disagg/proxy.py) and `picovllm router` (a fleet,
picovllm/disagg/router.py) differ in how they pick the servers and in what P's hand-over line
carries; the wire and the loop are these:

    open_pd_stream(...)         a signed POST to a /pd route, its response streamed; refusals sorted
                                into the client's fault (ValueError) and the server's (EngineDeadError)
    ndjson_outputs(resp, who)   a route's NDJSON lines as (RequestOutput, line): the first whole, later
                                ones as deltas (picovllm.disagg.messages.OutputDecoder)
    prefill_then_decode(...)    P's outputs up to the line that hands the request over, then D's
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from picovllm.disagg.auth import FleetSecret, sign_request
from picovllm.disagg.messages import OutputDecoder
from picovllm.entrypoints.openai.async_engine import EngineDeadError, EngineStepError
from picovllm.outputs import RequestOutput

Lines = AsyncIterator[tuple[RequestOutput, dict]]


class StreamBroken(EngineStepError):
    """A server's stream broke (it died, or the network did), as opposed to an error it reported."""


async def open_pd_stream(client: httpx.AsyncClient, base: str, path: str, body: bytes, secret: FleetSecret,
                         who: str) -> httpx.Response:
    """POST a JSON body to base + path, signed with the P/D secret; the response, streamed (status 200).

    who names the server in errors ("the prefill server URL"). ValueError: it refused the request
    itself (a 4xx other than 401/404/405, with its message: the client's fault); EngineDeadError: it
    cannot be reached, refused our signature, or failed."""
    headers = {"content-type": "application/json", **sign_request(secret, "POST", path, body)}
    request = client.build_request("POST", base + path, content=body, headers=headers)
    try:
        resp = await client.send(request, stream=True)
    except httpx.HTTPError as e:
        raise EngineDeadError(f"{who} is unreachable: {type(e).__name__}: {e}") from None
    if resp.status_code == 200:
        return resp
    try:
        message = json.loads(await resp.aread())["error"]["message"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        message = f"HTTP {resp.status_code}"
    finally:
        await resp.aclose()
    if resp.status_code == 401:
        message += " (--pd-secret-file: not the server's secret?)"
    elif 400 <= resp.status_code < 500 and resp.status_code not in (404, 405):
        raise ValueError(message)
    raise EngineDeadError(f"{who} answered {resp.status_code}: {message}")


async def ndjson_outputs(resp: httpx.Response, who: str) -> Lines:
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
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as e:
        raise StreamBroken(f"{who} failed mid-request: {type(e).__name__}: {e}") from None


async def prefill_then_decode(prefill: Lines, handover_of: Callable[[dict], Any],
                              open_decode: Callable[[Any], Awaitable[Lines]], who: Callable[[str], str],
                              metrics=None) -> AsyncIterator[RequestOutput]:
    """One request's outputs: P's until the line whose handover_of(line) is not None (its output, the
    first token, comes unfinished), then those of open_decode(that handover), D's, cumulative.

    who(role) names the server of role "p" or "d" in errors (asked when one happens: a router may
    have moved the request). An output that failed, or a stream that ends before a finished
    output, raises EngineStepError; metrics (ServerMetrics) counts it, and observes what finishes."""
    try:
        handover = None
        async for out, line in prefill:
            _check(out)
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
            _check(out)
            _observe(metrics, out)
            yield out
            if out.finished:
                return
        raise EngineStepError(f"{who('d')} ended the request's stream early")
    except EngineStepError:
        if metrics is not None:
            metrics.count_outcome("error")
        raise


def _check(out: RequestOutput) -> None:
    if out.outputs[0].finish_reason == "error":
        raise EngineStepError(out.error or "the request failed on a prefill or decode server")


def _observe(metrics, out: RequestOutput) -> None:
    if out.finished and metrics is not None:
        metrics.observe_finished(out)
