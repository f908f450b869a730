"""`picovllm proxy --prefill URL... --decode URL...`: the OpenAI API in front of P-D server pairs.

(Its flags: picovllm/entrypoints/openai/cli_proxy.py.)

The proxy runs the same completion and chat handlers as `picovllm serve` (picovllm/entrypoints/openai),
with its own tokenizer; only the engine under them differs: ProxyEngine sends each request to one
P-D pair (round-robin over pairs; P and D servers are linked pairwise, see picovllm/disagg/server.py
for the two calls and their order) and PDStream yields P's first-token output, then D's outputs.
Pairs are found at start-up from each server's /pd/info (the two ends of one link), so the URLs
may be given in any order. A failure on either side (an error output, a dropped connection, a
server that cannot be reached) ends the client's request with an OpenAI error object (HTTP 5xx
before the response starts, a final SSE error event after); the request's other connection is
closed, which aborts it on that server. Every call to a /pd route is signed with the P/D secret
(--pd-secret-file or $PICOVLLM_PD_SECRET, the servers' own; picovllm.disagg.auth): a server that
refuses the signature (401) stops the proxy at start-up and fails a request later, naming the flag.
Every lease / 4 the proxy reads each server's /pd/info: a pair one of whose servers has not answered for a lease
(a frozen process), or whose P reports its link down, leaves the rotation until both answer again, and the
requests open on it end in an error (their reads would otherwise wait forever).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from picovllm.disagg.auth import FleetSecret, sign_request
from picovllm.disagg.handover_stream import RemoteEngine, aborted_output, fail_stream, ndjson_outputs, \
    open_pd_stream, prefill_body, prefill_then_decode
from picovllm.disagg.http_stream import StreamedResponse
from picovllm.entrypoints.openai.engine_client import EngineDeadError, EngineStepError
from picovllm.outputs import RequestOutput
from picovllm.sampling_params import SamplingParams

logger = logging.getLogger("picovllm.proxy")


@dataclass(frozen=True)
class PDPair:
    prefill: str       # base URLs
    decode: str


class PDStream:
    """One request's outputs through a pair, as AsyncEngine's RequestStream: outputs(), close()."""

    def __init__(self, request_id: str, pair: PDPair, prefill: StreamedResponse, decode: StreamedResponse,
                 owner: "ProxyEngine", prompt_token_ids: list[int] = ()) -> None:
        self.request_id, self.pair, self.prompt_token_ids = request_id, pair, prompt_token_ids
        self._prefill, self._decode, self._owner = prefill, decode, owner
        self.finished = self._failed = self._stopped = False

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        async def open_decode(_) -> AsyncIterator:
            return ndjson_outputs(self._decode, self._who("d"))     # opened with P's: D listened first

        last = None
        try:
            async for out in prefill_then_decode(ndjson_outputs(self._prefill, self._who("p")),
                                                 lambda line: line.get("handed_off") or None, open_decode,
                                                 self._who, self._owner.metrics if self._owner else None,
                                                 lambda: self._stopped):
                self.finished = out.finished
                last = out
                yield out
        except EngineStepError:
            if self._stopped:                    # aborted here (the proxy is stopping): not the servers' failure
                yield aborted_output(last, self.request_id, self.prompt_token_ids)
                return
            self._failed = True                  # counted as an error (prefill_then_decode)
            raise
        finally:
            self.close()

    def stop(self) -> None:
        """Abort it here (ProxyEngine.abort_all): where its outputs are read they end with an abort output."""
        self._stopped = not self.finished and not self._failed
        self.close()

    def _who(self, role: str) -> str:
        return f"the prefill server {self.pair.prefill}" if role == "p" else f"the decode server {self.pair.decode}"

    def lose(self, why: str) -> None:
        """Its pair is lost (ProxyEngine's health checks): the reads of both streams end in an error."""
        for resp in (self._prefill, self._decode):
            fail_stream(resp, why)

    def close(self) -> None:
        """Drop both connections: a server whose client went away aborts the request (frees its KV)."""
        if self._owner is None:
            return
        if not self.finished and not self._failed and self._owner.metrics is not None:
            self._owner.metrics.count_outcome("abort")      # its client left (or the proxy is stopping)
        self.finished = True
        self._owner.forget(self)
        self._owner = None
        for resp in (self._prefill, self._decode):
            asyncio.ensure_future(resp.aclose())


class ProxyEngine(RemoteEngine):
    """The engine under the OpenAI handlers, over P-D server pairs."""

    name = "proxy"

    def __init__(self, pairs: list[PDPair], secret: FleetSecret, model_info: dict, metrics=None,
                 connect_timeout_s: float = 10.0, lease_s: float = 10.0) -> None:
        if not pairs:
            raise ValueError("pairs: at least one prefill/decode pair is needed")
        super().__init__(model_info, metrics, connect_timeout_s)
        self.pairs, self.secret, self.lease_s = pairs, secret, lease_s
        self._next = itertools.count()
        self._last_ok = {url: time.monotonic() for p in pairs for url in (p.prefill, p.decode)}
        self.down: dict[PDPair, str] = {}       # pairs out of rotation, and why
        self.health_interval_s = lease_s / 4
        self.answer_timeout_s = lease_s

    @property
    def unavailable(self) -> str | None:
        if len(self.down) < len(self.pairs):
            return None
        return "no prefill/decode pair is in rotation: " + "; ".join(
            f"{p.prefill} -> {p.decode}: {why}" for p, why in self.down.items())

    async def check_health(self) -> None:
        """Each server's /pd/info: a pair with one silent for a lease, or whose P's link is down, leaves the rotation
        (its open streams fail); it comes back once both answer and the link is up."""
        urls = list(self._last_ok)
        infos = dict(zip(urls, await asyncio.gather(*(self._info(url) for url in urls))))
        now = time.monotonic()
        for url, info in infos.items():
            if info is not None:
                self._last_ok[url] = now
        for pair in self.pairs:
            silent = [u for u in (pair.prefill, pair.decode) if now - self._last_ok[u] > self.lease_s]
            info = infos[pair.prefill]
            why = (f"{silent[0]} has not answered for {self.lease_s:g} s" if silent else
                   f"the prefill server {pair.prefill} reports its link to {pair.decode} down"
                   if info is not None and not info.get("link_alive", True) else None)
            if why is None:
                if self.down.pop(pair, None) is not None:
                    logger.info("pair %s -> %s back in rotation", pair.prefill, pair.decode)
                continue
            if pair not in self.down:
                logger.warning("pair %s -> %s out of rotation: %s", pair.prefill, pair.decode, why)
            self.down[pair] = why
            for stream in list(self._streams):
                if stream.pair == pair:
                    stream.lose(why)

    async def _info(self, url: str) -> dict | None:
        try:
            headers = sign_request(self.secret, "GET", "/pd/info") if self.secret is not None else {}
            r = await self.client.get(url + "/pd/info", headers=headers, timeout=min(5.0, self.lease_s))
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                          arrival_time: float | None = None, priority: int = 0) -> PDStream:
        """Open the request on D (listen), then on P. Raises ValueError (a 400 from P), EngineDeadError."""
        if not self.is_running:
            raise EngineDeadError("the proxy is not running")
        body = prefill_body(prompt_token_ids, params, request_id, arrival_time, priority)
        errors = []
        first = next(self._next)     # round-robin; a pair that cannot be reached, or is down, is skipped: the
        for k in range(len(self.pairs)):     # next pairs in order (the counter moves with the other requests)
            pair = self.pairs[(first + k) % len(self.pairs)]
            if pair in self.down:
                errors.append(f"{pair.prefill} -> {pair.decode}: {self.down[pair]}")
                continue
            try:
                decode = await self._open(pair.decode, "/pd/decode", {"request_id": request_id}, "decode")
            except EngineDeadError as e:
                errors.append(str(e))
                continue
            try:
                prefill = await self._open(pair.prefill, "/pd/prefill", body, "prefill")
            except EngineDeadError as e:
                await decode.aclose()
                errors.append(str(e))
                continue
            except BaseException:
                await decode.aclose()
                raise
            stream = PDStream(request_id, pair, prefill, decode, self, prompt_token_ids)
            self.track(stream)
            return stream
        raise EngineDeadError("no prefill/decode pair could take the request: " + "; ".join(errors))

    async def _open(self, base: str, path: str, body: dict, what: str):
        return await open_pd_stream(self, base, path, json.dumps(body).encode(), self.secret,
                                    f"the {what} server {base}")


# -- start-up -------------------------------------------------------------------------------------
def _get(url: str, deadline: float, secret: FleetSecret | None = None) -> dict:
    """GET a JSON document (signed, given the secret), retrying while the server is still starting."""
    while True:
        try:
            headers = sign_request(secret, "GET", httpx.URL(url).path) if secret is not None else {}
            r = httpx.get(url, timeout=5.0, headers=headers)
            if r.status_code == 200:
                return r.json()
            if r.status_code == 401:
                raise ValueError(f"--pd-secret-file: {url} refused the proxy's signature: not the servers' "
                                 f"shared secret")
            if r.status_code != 503:
                raise ValueError(f"{url} answered HTTP {r.status_code}: is it a `picovllm serve --role p|d` server?")
            why = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            why = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer in time ({why})")
        time.sleep(0.25)


LINK_GRACE_S = 5.0      # how long a server that answers may say its link is down before the proxy believes it


def _linked_info(url: str, deadline: float, secret: FleetSecret | None) -> dict:
    """A server's /pd/info, asked again for a few seconds (within the deadline) while it says its link is down: a
    server that has just started answers before its engine loop has published the link's state (link_alive false),
    and a proxy started beside its servers met that."""
    grace = min(deadline, time.monotonic() + LINK_GRACE_S)
    while True:
        info = _get(url + "/pd/info", deadline, secret)
        if info.get("link_alive") or time.monotonic() > grace:
            return info
        time.sleep(0.1)


def discover_pairs(prefill: list[str], decode: list[str], secret: FleetSecret, timeout_s: float) -> list[PDPair]:
    """Match each P server to the D server on the other end of its link (from /pd/info)."""
    deadline = time.monotonic() + timeout_s
    links, lengths = {}, {}
    for what, urls, role in (("--prefill", prefill, "p"), ("--decode", decode, "d")):
        for url in urls:
            info = _linked_info(url, deadline, secret)
            lengths[url] = info.get("max_model_len")
            if info.get("role") != role:
                raise ValueError(f"{what}: {url} is a {info.get('role')!r} server, not {role!r}")
            if not info.get("link_alive") or not info.get("link"):
                raise ValueError(f"{what}: {url} has no live link to its peer server")
            local, remote = (tuple(x) for x in info["link"])
            links[(role, local, remote)] = url
    pairs = []
    for (role, local, remote), url in links.items():
        if role == "p":
            d = links.get(("d", remote, local))
            if d is None:
                raise ValueError(f"--decode: the decode server linked to {url} is not among {decode}")
            if lengths[url] and lengths[d] and lengths[d] < lengths[url]:     # D would cut short what P admits
                raise ValueError(f"max_model_len: the decode server {d} has {lengths[d]}, below its prefill "
                                 f"server {url}'s {lengths[url]}: start them with the same --max-model-len")
            pairs.append(PDPair(url, d))
    if len(pairs) != len(decode):
        raise ValueError(f"--prefill: the prefill server of some decode server in {decode} is not among {prefill}")
    return pairs


def main(args: argparse.Namespace) -> int:
    """`picovllm proxy`: find the pairs, load the tokenizer, serve until SIGTERM/SIGINT."""
    from picovllm.entrypoints.chat_template import load_chat_template
    from picovllm.entrypoints.openai.api_server import front_end_app, run_app
    from picovllm.entrypoints.openai.metrics import ServerMetrics
    from picovllm.loader.source import open_model_source

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prefill = [u.rstrip("/") for u in args.prefill]
    decode = [u.rstrip("/") for u in args.decode]
    try:
        template = load_chat_template(args.chat_template) if args.chat_template is not None else None
        secret = FleetSecret.load(args.pd_secret_file)
        pairs = discover_pairs(prefill, decode, secret, args.startup_timeout)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    card = _get(pairs[0].prefill + "/v1/models", time.monotonic() + args.startup_timeout)["data"][0]
    name = args.served_model_name or card["id"]
    info = {k: card[k] for k in ("root", "revision", "max_model_len", "vocab_size") if k in card}
    model, revision = (args.model, args.revision) if args.model else (card["root"], card.get("revision"))
    source = open_model_source(model, weights_needed=False, revision=revision, download_dir=args.download_dir)
    tokenizer = source.load_tokenizer() if source.load_tokenizer is not None else None
    metrics = ServerMetrics(name)
    engine = ProxyEngine(pairs, secret, info, metrics, lease_s=args.lease)
    app, settings = front_end_app(engine, tokenizer, args, name, metrics, template, model, revision,
                                  args.download_dir)
    logger.info("proxy for %d prefill/decode pairs on http://%s:%d: %s", len(pairs), args.host, args.port,
                ", ".join(f"{p.prefill} -> {p.decode}" for p in pairs))
    run_app(app, engine, settings)
    return 0
