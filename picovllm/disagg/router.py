"""`picovllm router`: the OpenAI API in front of a fleet of prefill and decode instances (any P to any D).

(Its flags: picovllm/entrypoints/openai/cli_router.py; the instances: picovllm/disagg/fleet_server.py.)

The router runs the same completion and chat handlers as `picovllm serve`, with its own tokenizer;
RouterEngine sits under them. Per request it picks a P (policy: round_robin, least_loaded or prefix,
picovllm/disagg/router_policy.py), streams its first token, takes the kv_handover from P's last
line, then picks a D (round_robin or least_loaded) and streams D's outputs; an instance that cannot
be reached, or whose stream breaks before its first line, had not started the request: it is marked down
and the next one is tried (a D's turn comes after P published the KV, which stays published meanwhile);
a failure after that ends the request with an OpenAI error.

Instances come from --prefill/--decode at start-up and from the admin API at run time (POST
/admin/instances {url, role}; POST /admin/instances/remove {url}; GET /admin/instances), which needs
the fleet's signature (picovllm.disagg.auth), as every call the router makes to an instance carries it.
Every lease / 4 the router reads each instance's /pd/load; one that has not answered for a lease is
out of rotation until it answers again, and the streams open on it fail (a frozen process: they would wait
forever); one whose engine is not running (alive: false) is out at once. An instance whose KV layout or
max_model_len does not fit the fleet's is refused when it is added. /metrics adds, per instance, requests routed,
failures, up, load and in-flight requests, and per routing decision a counter by role, policy and reason.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable

import httpx
from prometheus_client import Counter, Gauge

from picovllm.disagg.auth import FleetSecret, sign_request
from picovllm.disagg.handover_stream import RemoteEngine, StreamBroken, aborted_output, fail_stream, ndjson_outputs, \
    open_pd_stream, prefill_body, prefill_then_decode
from picovllm.disagg.http_stream import StreamedResponse
from picovllm.disagg.messages import KVLayout
from picovllm.disagg.router_policy import Instance
from picovllm.entrypoints.openai.engine_client import EngineDeadError, EngineStepError
from picovllm.outputs import RequestOutput
from picovllm.sampling_params import SamplingParams

logger = logging.getLogger("picovllm.router")


class RouterMetrics:
    """The router's own series, in the server's registry (one /metrics for both)."""

    def __init__(self, registry) -> None:
        lbl = ["instance", "role"]
        self.routed = Counter("picovllm:router_requests", "Requests routed to an instance", lbl, registry=registry)
        self.failures = Counter("picovllm:router_instance_failures", "Calls to an instance that failed "
                                "(unreachable, refused, or broken mid-stream)", lbl, registry=registry)
        self.up = Gauge("picovllm:router_instance_up", "1 if the instance is in rotation", lbl, registry=registry)
        self.load = Gauge("picovllm:router_instance_load", "The instance's load as the policies see it", lbl,
                          registry=registry)
        self.in_flight = Gauge("picovllm:router_instance_in_flight", "The router's requests on the instance now",
                               lbl, registry=registry)
        self.decisions = Counter("picovllm:router_decisions", "Routing decisions by role, policy and reason",
                                 ["role", "policy", "reason"], registry=registry)

    def observe(self, inst: Instance) -> None:
        self.up.labels(inst.url, inst.role).set(1 if inst.up and not inst.removed else 0)
        self.load.labels(inst.url, inst.role).set(inst.load)
        self.in_flight.labels(inst.url, inst.role).set(inst.in_flight)


class InstancePool:
    """The fleet as the router sees it: instances by URL, their health and load."""

    def __init__(self, secret: FleetSecret, lease_s: float, metrics: RouterMetrics | None = None) -> None:
        self.secret, self.lease_s, self.metrics = secret, lease_s, metrics
        self.instances: dict[str, Instance] = {}
        # called for an instance silent for a lease (the router fails the streams open on it)
        self.on_silent: Callable[[Instance, str], None] | None = None

    def headers(self, method: str, path: str, body: bytes = b"") -> dict[str, str]:
        return sign_request(self.secret, method, path, body)

    def add(self, url: str, role: str, info: object) -> Instance:
        """Add (or bring back) an instance from its /pd/info. InstanceRefused, naming the field, if it does not fit.
        One already in the fleet in that role is updated in place: the requests open on it stay counted in its
        in_flight and fail with it (RouterStream.lose compares identity)."""
        if role not in ("p", "d"):
            raise InstanceRefused(f"role must be 'p' or 'd', got {role!r}", "role")
        info = _read_info(url, info)
        if info.get("role") != role:
            raise InstanceRefused(f"role: {url} is a {info.get('role')!r} instance, not {role!r}", "role")
        if not info.get("fleet"):
            raise InstanceRefused(f"url: {url} is a linked-pair server (--kv-peer/--kv-port), not a fleet instance")
        others = [i for i in self.instances.values() if i.url != url]
        if others and others[0].block_size != info.get("block_size"):
            raise InstanceRefused(f"url: {url} has block size {info.get('block_size')}, the fleet "
                                  f"{others[0].block_size}")
        layout = info.get("layout")
        for other in others:     # a P's KV must copy as-is into every D's cache (messages.KVLayout.mismatch)
            if layout is not None and other.layout is not None:
                p_side, d_side = (layout, other.layout) if role == "p" else (other.layout, layout)
                why = KVLayout(**d_side).mismatch(KVLayout(**p_side)) if other.role != role else None
                if why:
                    raise InstanceRefused(f"url: {url}'s KV cache does not fit the fleet's ({other.url}): {why}")
        length = info.get("max_model_len")
        ps = [i.max_model_len for i in others if i.role == "p" and i.max_model_len] + ([length] if role == "p" else [])
        ds = [i.max_model_len for i in others if i.role == "d" and i.max_model_len] + ([length] if role == "d" else [])
        if length and ps and ds and min(ds) < max(ps):    # a D cuts short what a P admitted
            raise InstanceRefused(f"max_model_len: {url} ({role}) has {length}; every decode instance needs at least "
                                  f"the prefill instances' ({max(ps)}), the fleet's decode instances have {min(ds)}")
        fields = dict(instance_id=str(info.get("instance_id")), block_size=info.get("block_size") or 16,
                      layout=layout, max_model_len=length)
        inst = self.instances.get(url)
        if inst is not None and inst.role == role:
            for name, value in fields.items():
                setattr(inst, name, value)
            inst.up, inst.down_reason, inst.last_ok = True, None, time.monotonic()    # it just answered
        else:        # new (or a server restarted in the other role: its old requests went with it)
            inst = self.instances[url] = Instance(url, role, **fields)
        self.observe(inst)
        return inst

    def remove(self, url: str) -> Instance:
        inst = self.instances.pop(url, None)
        if inst is None:
            raise KeyError(url)
        inst.removed = True
        self.observe(inst)
        return inst

    def candidates(self, role: str) -> list[Instance]:
        return [i for i in self.instances.values() if i.role == role and i.up and not i.removed]

    def mark_down(self, inst: Instance, why: str) -> None:
        if inst.up:
            logger.warning("instance %s (%s) out of rotation: %s", inst.url, inst.role, why)
        inst.up, inst.down_reason = False, why
        if self.metrics is not None:
            self.metrics.failures.labels(inst.url, inst.role).inc()
        self.observe(inst)

    def saw_load(self, inst: Instance, load: dict) -> None:
        """A health check's answer, as _read_load gives it."""
        inst.running, inst.waiting, inst.kv_usage = load["running"], load["waiting"], load["kv_usage"]
        inst.last_ok = time.monotonic()
        if not inst.up:
            logger.info("instance %s (%s) back in rotation", inst.url, inst.role)
        inst.up, inst.down_reason = True, None
        self.observe(inst)

    def saw_failure(self, inst: Instance, why: str) -> None:
        """A health check failed: out of rotation once it has not answered for a lease, and the requests open on
        it fail (a frozen instance sends nothing more: its clients would wait forever)."""
        if time.monotonic() - inst.last_ok > self.lease_s:
            self.mark_down(inst, f"no answer for {self.lease_s:g} s: {why}")
            if self.on_silent is not None:
                self.on_silent(inst, inst.down_reason)

    async def check(self, client: httpx.AsyncClient, inst: Instance) -> None:
        """One health check. An answer that is not a load (not JSON, not an object, a count not a number) fails it,
        as no answer does: it must not raise, or the health task would end with it."""
        try:
            r = await client.get(inst.url + "/pd/load", headers=self.headers("GET", "/pd/load"), timeout=5.0)
            if r.status_code != 200:
                raise ValueError(f"/pd/load answered HTTP {r.status_code}")
            load = _read_load(r.json())
        except (httpx.HTTPError, ValueError) as e:
            why = f"{type(e).__name__}: {e}"
            if inst.up:      # once out of rotation, the checks that would bring it back fail quietly
                logger.warning("instance %s (%s): health check failed: %s", inst.url, inst.role, why)
            self.saw_failure(inst, why)
            return
        if not load["alive"]:     # its server answers, its engine is gone: no use trying it
            self.mark_down(inst, "its engine is not running (/pd/load: alive false)")
            return
        if load["instance_id"] not in (None, inst.instance_id) and self.instances.get(inst.url) is inst:
            # another server at this URL (restarted, perhaps with other flags): it must fit the fleet, as when added
            try:
                r = await client.get(inst.url + "/pd/info", headers=self.headers("GET", "/pd/info"), timeout=5.0)
                self.add(inst.url, inst.role, r.json() if r.status_code == 200 else f"HTTP {r.status_code}")
            except InstanceRefused as e:
                self.mark_down(inst, f"restarted as an instance that does not fit the fleet: {e}")
                return
            except (httpx.HTTPError, ValueError) as e:
                self.saw_failure(inst, f"its /pd/info after a restart: {type(e).__name__}: {e}")
                return
        self.saw_load(inst, load)

    def observe(self, inst: Instance) -> None:
        if self.metrics is not None:
            self.metrics.observe(inst)


class InstanceRefused(ValueError):
    """InstancePool.add's refusal. param: the admin request's field it is about (url or role); status: 502 where the
    instance's /pd/info cannot be read (the instance's fault, not the caller's), else 400."""

    def __init__(self, message: str, param: str = "url", status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def _read_info(url: str, info: object) -> dict:
    """info, checked to be a /pd/info this router can read (InstanceRefused, status 502, if not)."""
    if not isinstance(info, dict):
        raise InstanceRefused(f"url: {url}/pd/info is not a JSON object: {str(info)[:100]}", status=502)
    for name in ("block_size", "max_model_len"):
        value = info.get(name)
        if value is not None and (type(value) is not int or value < 1):
            raise InstanceRefused(f"url: {url}/pd/info has {name} {value!r}, not a positive integer", status=502)
    try:
        if info.get("layout") is not None:
            KVLayout(**info["layout"])
    except TypeError as e:       # not an object, or fields this router does not know (a newer instance)
        raise InstanceRefused(f"url: {url}/pd/info has a KV layout this router cannot read: {e}", status=502) from None
    return info


def _read_load(load: object) -> dict:
    """/pd/load's answer as {alive, running, waiting, kv_usage, instance_id}; ValueError if it is not one."""
    try:
        read = {"alive": load.get("alive", True) is not False, "running": int(load.get("running", 0)),
                "waiting": int(load.get("waiting", 0)), "kv_usage": float(load.get("kv_usage", 0.0)),
                "instance_id": None if load.get("instance_id") is None else str(load["instance_id"])}
    except (AttributeError, TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"/pd/load answered {str(load)[:100]}, not a load ({type(e).__name__}: {e})") from None
    if not math.isfinite(read["kv_usage"]):
        raise ValueError(f"/pd/load answered kv_usage {read['kv_usage']}")
    return read


class RouterStream:
    """One request's outputs through a P and then a D, as AsyncEngine's RequestStream: outputs(), close()."""

    def __init__(self, router: "RouterEngine", request_id: str, prefill: Instance, resp: StreamedResponse,
                 body: dict) -> None:
        self.router, self.pool, self.request_id, self.body = router, router.pool, request_id, body
        self.prefill, self.decode = prefill, None
        self._responses = [resp]
        self._left: set[str] = set()         # instances whose in-flight count this request left
        self.finished = self._failed = self._stopped = False

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        last = None
        try:
            async for out in prefill_then_decode(self._prefill_lines(), lambda line: line.get("kv_handover"),
                                                 self._open_decode, self._who,
                                                 self.router.metrics if self.router else None,
                                                 lambda: self._stopped):
                self.finished = out.finished
                last = out
                yield out
        except EngineStepError:
            if self._stopped:                    # aborted here (the router is stopping): not the instances' failure
                yield aborted_output(last, self.request_id, self.body["prompt_token_ids"])
                return
            self._failed = True                  # counted as an error (prefill_then_decode)
            raise
        finally:
            self.close()

    def stop(self) -> None:
        """Abort it here (RouterEngine.abort_all): where its outputs are read they end with an abort output."""
        self._stopped = not self.finished and not self._failed
        self.close()

    def _who(self, role: str) -> str:
        inst = self.prefill if role == "p" else self.decode
        return f"the {'prefill' if role == 'p' else 'decode'} instance {inst.url if inst else None}"

    def _prefill_lines(self) -> AsyncIterator[tuple[RequestOutput, dict]]:
        """P's lines. A P lost before its first line had not started the request: it goes to another P."""
        async def reopen(tried: set[str]) -> StreamedResponse:
            self.prefill, resp = await self.router.reopen_prefill(self, tried)
            return resp
        return self._retried_lines("p", reopen)

    async def _open_decode(self, handover: dict) -> AsyncIterator[tuple[RequestOutput, dict]]:
        """P published the KV: on to a D. A D lost before its first line had not claimed the KV, which P still
        publishes: the request goes to another D."""
        self._leave(self.prefill)
        await self._took(await self.router.open_decode(self, handover))   # sets self.decode: D answers for the KV now
        return self._retried_lines("d", lambda tried: self.router.open_decode(self, handover, tried))

    def _current(self, role: str) -> Instance:
        return self.prefill if role == "p" else self.decode

    async def _retried_lines(self, role: str, reopen) -> AsyncIterator[tuple[RequestOutput, dict]]:
        """The lines of the role's instance; one whose stream breaks before its first line is left for the next,
        which reopen(the instances tried) opens (setting this stream's instance of the role) and returns."""
        tried = {self._current(role).url}
        while True:
            started = False
            try:
                async for item in self._lines(self._responses[-1], self._current(role)):
                    started = True
                    yield item
                return
            except StreamBroken:
                if started or self.router is None:
                    raise
            self._leave(self._current(role))
            await self._took(await reopen(tried))
            tried.add(self._current(role).url)

    async def _lines(self, resp: StreamedResponse, inst: Instance) -> AsyncIterator[tuple[RequestOutput, dict]]:
        """An instance's lines; one whose stream broke is marked down."""
        try:
            async for item in ndjson_outputs(resp, self._who(inst.role)):
                yield item
        except StreamBroken as e:
            if not self._stopped:        # (closed here: the instance is fine)
                self.pool.mark_down(inst, str(e))
            raise

    async def _took(self, resp: StreamedResponse) -> None:
        """The stream of the instance just opened for this request. A request closed meanwhile without a
        cancellation (abort_all) leaves that instance here, where nothing else would give back its count."""
        self._responses.append(resp)
        if self.router is None:
            self._leave(self.decode or self.prefill)
            await resp.aclose()
            raise EngineStepError(f"request {self.request_id} was closed")

    def lose(self, inst: Instance, why: str) -> None:
        """inst stopped answering (InstancePool.on_silent): the stream open on it ends in StreamBroken where it is
        read (an error naming it, or, before its first line, the next instance)."""
        current = self.decode if self.decode is not None else self.prefill
        if current is inst and self._responses:
            fail_stream(self._responses[-1], f"{inst.url} stopped answering: {why}")

    def _leave(self, inst: Instance | None) -> None:
        if inst is not None and inst.url not in self._left:
            self._left.add(inst.url)
            inst.in_flight = max(0, inst.in_flight - 1)
            self.pool.observe(inst)

    def close(self) -> None:
        """Drop the connections: an instance whose client went away aborts the request (frees its KV)."""
        if self.router is None:
            return
        ended, self.finished = self.finished, True
        if not ended and not self._failed and self.router.metrics is not None:
            self.router.metrics.count_outcome("abort")      # its client left (or the router is stopping)
        self._leave(self.prefill)
        self._leave(self.decode)
        self.router.forget(self)
        for resp in self._responses:
            asyncio.ensure_future(resp.aclose())
        if self.decode is None and not ended:
            # its client left before a D took the request: P may have published its KV (a line this stream
            # never read, too), which P frees now rather than at the lease's end; a no-op where it has not
            asyncio.ensure_future(self.router.release(self.prefill, self.request_id))
        self.router = None


class RouterEngine(RemoteEngine):
    """The engine under the OpenAI handlers, over a fleet of instances; it checks their health every lease / 4."""

    name = "router"

    def __init__(self, pool: InstancePool, prefill_policy, decode_policy, model_info: dict, metrics=None,
                 router_metrics: RouterMetrics | None = None, connect_timeout_s: float = 10.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        """transport: instead of the network (tests)."""
        super().__init__(model_info, metrics, connect_timeout_s, transport)
        self.pool, self.prefill_policy, self.decode_policy = pool, prefill_policy, decode_policy
        self.router_metrics = router_metrics
        self.health_interval_s = pool.lease_s / 4
        self.answer_timeout_s = pool.lease_s
        pool.on_silent = self._silent

    def _silent(self, inst: Instance, why: str) -> None:
        for stream in list(self._streams):
            stream.lose(inst, why)

    def model_info(self) -> dict:
        """The model card's, with the max_model_len of the smallest P in the fleet now (instances come and go; every
        D has at least that, InstancePool.add); the card's where no P says (None: the handlers skip their checks)."""
        lengths = [i.max_model_len for i in self.pool.instances.values() if i.role == "p" and i.max_model_len]
        return {**self._model_info, "max_model_len": min(lengths, default=self._model_info.get("max_model_len"))}

    @property
    def unavailable(self) -> str | None:
        missing = [name for role, name in (("p", "prefill"), ("d", "decode")) if not self.pool.candidates(role)]
        return " and ".join(f"no {name} instance" for name in missing) + " is in rotation" if missing else None

    async def check_health(self) -> None:
        """Every instance's check; one that raises anyway is logged, never ends the health task (no instance
        would be checked again: a frozen one never taken out)."""
        instances = list(self.pool.instances.values())
        done = await asyncio.gather(*(self.pool.check(self.client, i) for i in instances), return_exceptions=True)
        for inst, result in zip(instances, done):
            if isinstance(result, Exception):
                logger.error("health check of %s failed: %r", inst.url, result, exc_info=result)

    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                          arrival_time: float | None = None, priority: int = 0) -> RouterStream:
        """Open the request on a P. Raises ValueError (a 400 from P), EngineDeadError (no D in rotation, or no P
        could take it)."""
        if not self.pool.candidates("d"):    # P would compute the prompt and publish KV that no D could take
            raise EngineDeadError("no decode instance could take the request: no decode instance is in rotation")
        body = prefill_body(prompt_token_ids, params, request_id, arrival_time, priority)
        inst, resp = await self._open_on_one("p", self.prefill_policy, "/pd/prefill", body, prompt_token_ids)
        stream = RouterStream(self, request_id, inst, resp, body)
        self.track(stream)
        return stream

    async def reopen_prefill(self, stream: RouterStream, tried: set[str]) -> tuple[Instance, StreamedResponse]:
        """The request again on another P (the last one was lost before it started); EngineStepError if none."""
        try:
            return await self._open_on_one("p", self.prefill_policy, "/pd/prefill", stream.body,
                                           stream.body["prompt_token_ids"], exclude=tried)
        except (EngineDeadError, ValueError) as e:
            raise EngineStepError(f"the prefill instance {stream.prefill.url} was lost before the request started, "
                                  f"and no other could take it: {e}") from None

    async def open_decode(self, stream: RouterStream, handover: dict,
                          tried: set[str] = frozenset()) -> StreamedResponse:
        """Hand a published request to a D (not one of those tried); EngineStepError if none could take it."""
        body = {"request_id": stream.request_id, "handover": handover}
        try:
            stream.decode, resp = await self._open_on_one("d", self.decode_policy, "/pd/decode", body, [],
                                                          exclude=tried)
        except (EngineDeadError, ValueError) as e:
            raise EngineStepError(str(e)) from None
        return resp

    async def release(self, inst: Instance, request_id: str) -> None:
        """Tell P to free a request's published KV that no D will take (POST /pd/release); if P cannot be
        reached, the lease frees it."""
        data = json.dumps({"request_id": request_id}).encode()
        try:
            await self.client.post(inst.url + "/pd/release", content=data, timeout=5.0,
                                   headers={"content-type": "application/json",
                                            **self.pool.headers("POST", "/pd/release", data)})
        except httpx.HTTPError as e:
            logger.info("request %s: %s did not take back its KV (%s): its lease frees it", request_id, inst.url, e)

    async def _open_on_one(self, role: str, policy, path: str, body: dict, prompt_token_ids: list[int],
                           exclude: set[str] = frozenset()) -> tuple[Instance, StreamedResponse]:
        """POST to one instance of the role, chosen by the policy; an unreachable one is marked down and
        the next is tried (the request had not started there)."""
        what = "prefill" if role == "p" else "decode"
        tried, errors = set(exclude), []
        data = json.dumps(body).encode()
        while True:
            candidates = [i for i in self.pool.candidates(role) if i.url not in tried]
            if not candidates:
                why = "; ".join(errors) or f"no {what} instance is in rotation"
                raise EngineDeadError(f"no {what} instance could take the request: {why}")
            inst, reason = policy.choose(candidates, prompt_token_ids)
            if self.router_metrics is not None:     # a second choice for the same request: a retry
                self.router_metrics.decisions.labels(role, policy.name, "retry" if tried else reason).inc()
            tried.add(inst.url)
            inst.in_flight += 1          # now, not once it answers: the requests choosing meanwhile see it busier
            self.pool.observe(inst)
            try:
                resp = await self._post(inst, path, data)
            except BaseException as e:   # refused, unreachable, or the caller cancelled: not on it after all
                inst.in_flight = max(0, inst.in_flight - 1)
                self.pool.observe(inst)
                if not isinstance(e, EngineDeadError):
                    raise
                self.pool.mark_down(inst, str(e))
                errors.append(str(e))
                continue
            if self.router_metrics is not None:
                self.router_metrics.routed.labels(inst.url, role).inc()
            return inst, resp

    async def _post(self, inst: Instance, path: str, data: bytes):
        what = "prefill" if inst.role == "p" else "decode"
        return await open_pd_stream(self, inst.url, path, data, self.pool.secret,
                                    f"the {what} instance {inst.url}")
