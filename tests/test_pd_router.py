"""A fleet as processes: `serve --role p|d --kv-transfer tcp` instances behind `picovllm router`.

Oracle: LLM.generate in this process on the same weights (greedy). Also: the control routes refuse a
caller without the fleet's secret; a D killed mid-stream ends its request with an error, leaves the
rotation, and P ends with every block free; a D started with --router joins and takes work; SIGTERM
stops every process cleanly. The routing policies are checked on their own first (no processes).
"""
import argparse
import json
import signal
import time
from collections import Counter

import httpx
import openai
import pytest

from picovllm import LLM, SamplingParams
from picovllm.disagg.auth import FleetSecret, sign_request
from picovllm.disagg.router_policy import Instance, LeastLoaded, PrefixAware, RoundRobin
from picovllm.entrypoints.openai.engine_client import EngineStepError
from picovllm.disagg.transfer import PULL_BACKENDS
from picovllm.entrypoints.openai.cli_serve import FLEET_ONLY_BACKENDS
from serving_fixtures import ServerProcess, build_tiny_chat_model
from test_pd_serving import wait_idle
from test_server_lifecycle import assert_exited, children_of

ENGINE_ARGS = ["--block-size", "16", "--num-kv-blocks", "256", "--max-model-len", "1024"]
SECRET = "router-test-secret-0123456789"
PROMPTS = ["Hello, how are you", "The capital of France is", "Tell me a story about a cat",
           "Numbers: 0 1 2 3 4 5 6 7 8 9. The quick brown fox jumps over the lazy dog. A server streams"]  # > 16 tokens


def test_policies():
    ps = [Instance(f"http://p{i}", "p", f"p{i}", block_size=4) for i in range(3)]
    rr = RoundRobin()
    assert [rr.choose(ps, [])[0].url for _ in range(4)] == ["http://p0", "http://p1", "http://p2", "http://p0"]
    ps[0].running, ps[1].in_flight, ps[2].waiting = 3, 1, 2
    assert LeastLoaded().choose(ps, []) == (ps[1], "least_loaded")
    prefix = PrefixAware(max_imbalance=2)
    shared = list(range(100, 116))                    # four full blocks of 4
    first, why = prefix.choose(ps, shared + [1, 2])
    assert (first, why) == (ps[1], "prefix_miss")
    ps[1].in_flight = 3                               # busier now, but within the imbalance
    assert prefix.choose(ps, shared + [7]) == (ps[1], "prefix_hit")
    assert prefix.choose(ps, shared[:8] + [9] * 8) == (ps[1], "prefix_hit")   # two shared leading blocks
    assert prefix.choose(ps, [5] * 16)[1] == "prefix_miss"
    ps[1].in_flight = 9                               # too busy: the least loaded takes it (and the prefix)
    assert prefix.choose(ps, shared) == (ps[2], "prefix_overloaded")
    assert prefix.choose(ps, shared)[0] is ps[2]
    assert set(FLEET_ONLY_BACKENDS) <= set(PULL_BACKENDS)


def _output_lines(*outs, handover=None) -> list[bytes]:
    from picovllm.disagg.messages import OutputEncoder
    wire, res = OutputEncoder(), []
    for o in outs:
        res.append(wire.encode(o))
    if handover is not None:
        res[-1]["kv_handover"] = handover
    return [json.dumps(x).encode() + b"\n" for x in res]


def _out(tokens, finished, reason=None):
    from picovllm.outputs import CompletionOutput, RequestOutput
    return RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "", tokens, None, None, reason)], finished)


async def _body(lines, broken=False):
    """A fake instance's streamed body: the lines, then (broken) a reset connection."""
    for line in lines:
        yield line
    if broken:
        raise httpx.ReadError("connection reset")


def test_a_prefill_lost_before_it_started_passes_the_request_on():
    """The router against fake instances (httpx.MockTransport): P1 accepts the request, then its stream breaks
    before a line: P2 takes it, P1 leaves the rotation, the client sees one clean stream. A D whose stream breaks
    after its first line ends the request with an error naming it."""
    import asyncio

    from picovllm.disagg.router import InstancePool, RouterEngine

    d_lines = _output_lines(_out([5, 6], False), _out([5, 6, 7], True, "length"))
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        seen.append(host)
        if host == "p1":
            return httpx.Response(200, content=_body([], broken=True))
        if host == "p2":
            return httpx.Response(200, content=_body(_output_lines(_out([5], True), handover={"opaque": True})))
        if host == "d1":
            return httpx.Response(200, content=_body(d_lines))
        return httpx.Response(200, content=_body(d_lines[:1], broken=True))

    async def run(decode: str):
        pool = InstancePool(FleetSecret(SECRET.encode()), lease_s=30.0)
        for url, role in (("http://p1", "p"), ("http://p2", "p"), (decode, "d")):
            pool.add(url, role, {"role": role, "fleet": True, "instance_id": url[7:], "block_size": 4})
        engine = RouterEngine(pool, RoundRobin(), RoundRobin(), {}, transport=httpx.MockTransport(handler))
        engine.start()
        try:
            stream = await engine.add_request([1, 2, 3], SamplingParams(max_tokens=3), "r")
            got = [o async for o in stream.outputs()]
        except EngineStepError as e:   # the second case checks it
            got = e
        finally:
            await engine.shutdown()
        return got, pool

    got, pool = asyncio.run(run("http://d1"))
    assert [o.outputs[0].token_ids for o in got] == [[5], [5, 6], [5, 6, 7]] and got[-1].finished
    assert seen == ["p1", "p2", "d1"]
    assert not pool.instances["http://p1"].up and pool.instances["http://p2"].up
    assert all(i.in_flight == 0 for i in pool.instances.values())
    seen.clear()
    got, pool = asyncio.run(run("http://d2"))
    assert isinstance(got, Exception) and "decode instance http://d2" in str(got), got
    assert all(i.in_flight == 0 for i in pool.instances.values())


def test_a_decode_lost_before_its_first_line_passes_the_request_on():
    """D1 takes the request, then its stream breaks before a line (it never claimed the KV, which P still
    publishes): D2 takes it and the client sees one clean stream; D1 leaves the rotation."""
    import asyncio

    from picovllm.disagg.router import InstancePool, RouterEngine

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        if request.url.host == "p1":
            return httpx.Response(200, content=_body(_output_lines(_out([5], True), handover={"opaque": True})))
        if request.url.host == "d1":
            return httpx.Response(200, content=_body([], broken=True))
        return httpx.Response(200, content=_body(_output_lines(_out([5, 6], False), _out([5, 6, 7], True, "length"))))

    async def run():
        pool = InstancePool(FleetSecret(SECRET.encode()), lease_s=30.0)
        for url, role in (("http://p1", "p"), ("http://d1", "d"), ("http://d2", "d")):
            pool.add(url, role, {"role": role, "fleet": True, "instance_id": url[7:], "block_size": 4})
        engine = RouterEngine(pool, RoundRobin(), RoundRobin(), {}, transport=httpx.MockTransport(handler))
        engine.start()
        try:
            stream_ = await engine.add_request([1, 2, 3], SamplingParams(max_tokens=3), "r")
            return [o.outputs[0].token_ids async for o in stream_.outputs()], pool
        finally:
            await engine.shutdown()

    got, pool = asyncio.run(run())
    assert got == [[5], [5, 6], [5, 6, 7]] and seen == ["p1", "d1", "d2"]
    assert not pool.instances["http://d1"].up and pool.instances["http://d2"].up
    assert all(i.in_flight == 0 for i in pool.instances.values())


def test_a_frozen_decode_ends_its_streams_and_a_dead_engine_leaves_the_rotation():
    """Real sockets against fake instances: a D that sent a line and then nothing (a frozen process) and whose
    /pd/load stops answering fails the stream open on it within about a lease, with an error naming it, where
    the client had waited forever; an instance whose /pd/load says its engine is not running leaves the rotation
    at the next check."""
    import asyncio

    from picovllm.disagg.router import InstancePool, RouterEngine

    async def main():
        frozen, routes, ports = asyncio.Event(), {}, []
        routes["/pd/prefill"] = _output_lines(_out([5], True), handover={"opaque": True})
        routes["/pd/decode"] = _output_lines(_out([5, 6], False))

        async def serve(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ")[1].decode()
            length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(
                b"content-length")), 0)
            await reader.readexactly(length)
            if path == "/pd/load":
                port = writer.get_extra_info("sockname")[1]
                alive = b"true" if port != ports[2] else b"false"
                body = b'{"running": 0, "waiting": 0, "kv_usage": 0.0, "alive": ' + alive + b"}"
                status = b"503 Service Unavailable" if frozen.is_set() and port == ports[1] else b"200 OK"
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: " + str(len(body)).encode() +
                             b"\r\ncontent-type: application/json\r\n\r\n" + body)
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                for line in routes[path]:
                    writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                if path == "/pd/decode":
                    frozen.set()          # a line, then nothing: the process froze
                    await asyncio.sleep(3600)
                writer.write(b"0\r\n\r\n")
            await writer.drain()
            writer.close()

        servers = [await asyncio.start_server(serve, "127.0.0.1", 0) for _ in range(3)]
        ports[:] = [srv.sockets[0].getsockname()[1] for srv in servers]
        pool = InstancePool(FleetSecret(SECRET.encode()), lease_s=0.4)
        for port, role in zip(ports, ("p", "d", "p")):
            pool.add(f"http://127.0.0.1:{port}", role, {"role": role, "fleet": True, "instance_id": str(port),
                                                         "block_size": 4})
        pool.instances[f"http://127.0.0.1:{ports[2]}"].up = False     # not chosen before the checks run
        engine = RouterEngine(pool, RoundRobin(), RoundRobin(), {})
        engine.start()
        start = time.monotonic()
        try:
            assert engine.unavailable is None
            stream_ = await engine.add_request([1, 2, 3], SamplingParams(max_tokens=3), "r")
            got = []
            with pytest.raises(EngineStepError, match=f"127.0.0.1:{ports[1]}"):
                async for o in stream_.outputs():
                    got.append(o.outputs[0].token_ids)
            took = time.monotonic() - start
            # no D in rotation: what /health answers 503 with (it had said ok while every request was refused)
            assert engine.unavailable == "no decode instance is in rotation"
        finally:
            await engine.shutdown()
            for srv in servers:
                srv.close()
        return got, took, pool, ports

    got, took, pool, ports = asyncio.run(asyncio.wait_for(main(), 30))
    assert got == [[5], [5, 6]] and took < 5.0, took
    inst = {port: pool.instances[f"http://127.0.0.1:{port}"] for port in ports}
    assert not inst[ports[1]].up and inst[ports[0]].up
    assert not inst[ports[2]].up and "alive false" in inst[ports[2]].down_reason
    assert all(i.in_flight == 0 for i in inst.values())


def test_instances_whose_kv_or_length_do_not_fit_the_fleet_are_refused():
    """A D whose KV layout differs from the fleet's P (its blocks could not be copied as they are), or whose
    max_model_len is below a P's (it would cut short what P admitted), is refused by the name of what differs."""
    from picovllm.disagg.messages import KVLayout
    from picovllm.disagg.router import InstancePool

    def info(role, length=1024, **layout):
        lay = dict(KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, num_blocks=64,
                            dtype="float32", total_kv_heads=2).__dict__, **layout)
        return {"role": role, "fleet": True, "instance_id": role, "block_size": lay["block_size"], "layout": lay,
                "max_model_len": length}

    pool = InstancePool(FleetSecret(SECRET.encode()), lease_s=30.0)
    pool.add("http://p", "p", info("p"))
    pool.add("http://d0", "d", info("d", length=2048, num_blocks=999))     # more blocks and room: fine
    with pytest.raises(ValueError, match="KVLayout.dtype differs"):
        pool.add("http://d1", "d", info("d", dtype="bfloat16"))
    with pytest.raises(ValueError, match="block size 8"):
        pool.add("http://d2", "d", info("d", block_size=8))
    with pytest.raises(ValueError, match="max_model_len: http://d3"):
        pool.add("http://d3", "d", info("d", length=512))
    with pytest.raises(ValueError, match="max_model_len: http://p1"):
        pool.add("http://p1", "p", info("p", length=4096))
    assert sorted(pool.instances) == ["http://d0", "http://p"]


def _fake_fleet(handler, *urls: str, policy=None, lease_s: float = 30.0):
    """A RouterEngine over fake instances (httpx.MockTransport handler); each url's role is its host's first letter
    (http://p0: a P). policy: the prefill policy (least_loaded by default)."""
    from picovllm.disagg.router import InstancePool, RouterEngine

    pool = InstancePool(FleetSecret(SECRET.encode()), lease_s=lease_s)
    for url in urls:
        pool.add(url, url[7], {"role": url[7], "fleet": True, "instance_id": url[7:], "block_size": 4})
    return RouterEngine(pool, policy or LeastLoaded(), LeastLoaded(), {}, transport=httpx.MockTransport(handler))


def test_requests_are_counted_on_their_instance_from_the_moment_it_is_chosen():
    """A burst of requests spreads over idle instances: each is counted on its instance when chosen, not once the
    instance answered (all would see the same load and go to one). The count goes back whatever ends the call:
    a refusal, an instance down (the next takes it), the caller cancelled, or the request closed meanwhile."""
    import asyncio

    gate = asyncio.Event()                             # dslow answers once it is set

    async def hang():
        await asyncio.sleep(3600)
        yield b""

    async def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host == "pslow":
            await asyncio.sleep(3600)                  # never answers
        await asyncio.sleep(0.02)                      # the round trip before the headers
        if host == "pbad":
            return httpx.Response(400, json={"error": {"message": "prompt: too long"}})
        if host == "pdown":
            return httpx.Response(503, json={"error": {"message": "draining"}})
        if host == "ph":
            return httpx.Response(200, content=_body(_output_lines(_out([5], True), handover={"opaque": True})))
        if host == "dslow":
            await gate.wait()
            return httpx.Response(200, content=_body(_output_lines(_out([5, 6], True, "length"))))
        return httpx.Response(200, content=hang())    # a P that took the request and computes it

    def counts(engine):
        return {url: i.in_flight for url, i in engine.pool.instances.items()}

    async def burst():
        engine = _fake_fleet(handler, "http://p0", "http://p1", "http://p2", "http://p3", "http://d0")
        engine.start()
        streams = await asyncio.gather(*(engine.add_request([k] * 8, SamplingParams(max_tokens=3), f"r{k}")
                                         for k in range(8)))
        placed, during = Counter(s.prefill.url for s in streams), counts(engine)
        for s in streams:
            s.close()
        await engine.shutdown()
        return placed, during, counts(engine)

    placed, during, after = asyncio.run(burst())
    assert sorted(placed.values()) == [2, 2, 2, 2], placed
    assert during == {"http://p0": 2, "http://p1": 2, "http://p2": 2, "http://p3": 2, "http://d0": 0}
    assert set(after.values()) == {0}

    async def every_path():
        engine = _fake_fleet(handler, "http://pslow", "http://dslow", "http://d9")
        engine.start()
        seen = []
        task = asyncio.ensure_future(engine.add_request([1] * 8, SamplingParams(max_tokens=3), "r"))
        await asyncio.sleep(0.05)
        seen.append(counts(engine)["http://pslow"])    # counted while it is asked
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        seen.append(counts(engine)["http://pslow"])    # the caller gave up: given back
        await engine.shutdown()
        engine = _fake_fleet(handler, "http://pbad", "http://pdown", "http://d0", policy=RoundRobin())
        engine.start()
        for _ in range(2):    # pbad refuses; then pdown is down, and pbad, tried next, refuses
            with pytest.raises(ValueError, match="too long"):
                await engine.add_request([1] * 8, SamplingParams(max_tokens=3), "r")
        assert not engine.pool.instances["http://pdown"].up
        seen.append(counts(engine))
        await engine.shutdown()
        # on to a D that takes its time: counted while asked, given back when the consumer is cancelled, or when
        # the request is closed meanwhile (abort_all) and D answers after all
        for close in ("cancel", "abort_all"):
            gate.clear()
            engine = _fake_fleet(handler, "http://ph", "http://dslow")
            engine.start()
            stream = await engine.add_request([1] * 8, SamplingParams(max_tokens=3), "r")
            task = asyncio.ensure_future(asyncio.wait_for(_drain(stream), 10))
            await asyncio.sleep(0.1)
            seen.append(counts(engine))
            if close == "cancel":
                task.cancel()
            else:
                engine.abort_all()
                gate.set()
            await asyncio.gather(task, return_exceptions=True)
            seen.append(counts(engine))
            await engine.shutdown()
        return seen

    async def _drain(stream):
        return [o async for o in stream.outputs()]

    seen = asyncio.run(every_path())
    assert seen[:2] == [1, 0]
    assert seen[2] == {"http://pbad": 0, "http://pdown": 0, "http://d0": 0}
    for during, after in (seen[3:5], seen[5:7]):
        assert during == {"http://ph": 0, "http://dslow": 1} and after == {"http://ph": 0, "http://dslow": 0}


def test_an_instance_added_again_is_updated_in_place(monkeypatch):
    """POST /admin/instances for a URL already in the fleet (serve --router at a restart, or by hand) keeps the
    Instance: its running requests stay counted on it (least_loaded sees them) and fail with it when it stops
    answering; its info is the new one."""
    import asyncio

    import picovllm.disagg.router as router_mod

    failed = []
    monkeypatch.setattr(router_mod, "fail_stream", lambda resp, why: failed.append(resp))

    async def handler(request: httpx.Request) -> httpx.Response:
        async def hang():
            await asyncio.sleep(3600)
            yield b""
        return httpx.Response(200, content=hang())

    async def run():
        engine = _fake_fleet(handler, "http://p0", "http://p1", "http://d0")
        engine.start()
        pool = engine.pool
        a = await engine.add_request([1] * 8, SamplingParams(max_tokens=3), "a")
        b = await engine.add_request([2] * 8, SamplingParams(max_tokens=3), "b")
        pool.mark_down(pool.instances["http://p0"], "a blip")
        pool.add("http://p0", "p", {"role": "p", "fleet": True, "instance_id": "p0-restarted", "block_size": 4,
                                    "max_model_len": 512})
        p0 = pool.instances["http://p0"]
        state = (p0 is a.prefill, p0.in_flight, p0.up, p0.instance_id, p0.max_model_len, b.prefill.url)
        engine._silent(p0, "no answer for 30 s")       # p0 froze: a's stream fails
        lost = a._responses[-1] in failed
        for s in (a, b):
            s.close()
        await engine.shutdown()
        return state, lost, {url: i.in_flight for url, i in pool.instances.items()}

    state, lost, after = asyncio.run(run())
    assert state == (True, 1, True, "p0-restarted", 512, "http://p1") and lost
    assert set(after.values()) == {0}


def test_a_malformed_load_answer_fails_the_check_and_the_health_task_goes_on():
    """An instance whose /pd/load answers 200 with what is not a load ({"running": null}, a list), or whose check
    raises what was not foreseen, fails its checks (out of rotation after a lease); the others are still checked."""
    import asyncio

    calls = Counter()

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        calls[host] += 1
        if host == "dnull":
            return httpx.Response(200, json={"running": None, "waiting": 0, "kv_usage": 0.0})
        if host == "dlist":
            return httpx.Response(200, json=[1, 2])
        if host == "dboom":
            raise RuntimeError("a bug in a check")
        return httpx.Response(200, json={"running": calls[host], "waiting": 0, "kv_usage": 0.0})

    async def run():
        engine = _fake_fleet(handler, "http://p0", "http://dnull", "http://dlist", "http://dboom", lease_s=0.2)
        engine.start()                                  # a check every 50 ms
        await asyncio.sleep(1.0)
        alive = not engine._health.done()
        await engine.shutdown()
        return alive, engine.pool.instances

    alive, instances = asyncio.run(run())
    assert alive and instances["http://p0"].running >= 5 and instances["http://p0"].up, calls
    assert not instances["http://dnull"].up and "not a load" in instances["http://dnull"].down_reason
    assert not instances["http://dlist"].up and calls["dboom"] >= 5


def test_an_instance_restarted_at_its_url_is_checked_again_as_when_it_was_added():
    """A D restarted at its URL (a new instance_id in /pd/load) with a --max-model-len below the P's must not come
    back into rotation unchecked (requests routed there would fail): it is out, naming the field, until a server
    that fits answers there; then it is in again, its new id and length read."""
    import asyncio

    d0 = {"instance_id": "d0", "max_model_len": 1024}

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        ident = d0["instance_id"] if host == "d0" else host
        if request.url.path == "/pd/info":
            return httpx.Response(200, json={"role": host[0], "fleet": True, "instance_id": ident, "block_size": 4,
                                             "max_model_len": d0["max_model_len"] if host == "d0" else 1024})
        return httpx.Response(200, json={"running": 0, "waiting": 0, "kv_usage": 0.0, "instance_id": ident})

    async def run():
        from picovllm.disagg.router import InstancePool
        pool = InstancePool(FleetSecret(SECRET.encode()), lease_s=30.0)
        for url in ("http://p0", "http://d0", "http://d1"):
            pool.add(url, url[7], {"role": url[7], "fleet": True, "instance_id": url[7:], "block_size": 4,
                                   "max_model_len": 1024})
        d = pool.instances["http://d0"]
        seen = []
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            for ident, length in (("d0", 1024), ("d0-restarted", 512), ("d0-again", 2048)):
                d0.update(instance_id=ident, max_model_len=length)
                await pool.check(client, d)
                seen.append((d.up, d.instance_id, d.max_model_len, d.down_reason))
        return seen

    same, short, fits = asyncio.run(run())
    assert same == (True, "d0", 1024, None)
    assert short[0] is False and "max_model_len" in short[3] and "restarted" in short[3], short
    assert fits == (True, "d0-again", 2048, None)


def test_a_router_started_without_prefill_instances_takes_their_max_model_len_when_they_join(tmp_path, monkeypatch):
    """`picovllm router --model M` and no --prefill: a completion is refused with a 503 (no instance), not a 500,
    and /health says so (503, not ok); once a P joins, the length checks use its max_model_len (the smallest P's), and
    /v1/models says it."""
    from fastapi.testclient import TestClient

    from picovllm.disagg import router_server
    from picovllm.entrypoints.openai import api_server, cli_router

    built = {}
    monkeypatch.setattr(api_server, "run_app", lambda app, engine, settings: built.update(app=app, engine=engine))
    monkeypatch.setenv("PICOVLLM_PD_SECRET", SECRET)
    parser = argparse.ArgumentParser()
    cli_router.add_parser(parser.add_subparsers(dest="command"))
    router_server.main(parser.parse_args(["router", "--model", build_tiny_chat_model(str(tmp_path / "m"))]))
    pool = built["engine"].pool
    with TestClient(built["app"]) as client:
        r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5})
        assert r.status_code == 503 and "no decode instance" in r.json()["error"]["message"], r.text
        r = client.get("/health")
        assert r.status_code == 503 and "no prefill instance and no decode instance" in r.text, r.text
        for url, length in (("http://p0", 64), ("http://p1", 48), ("http://d0", 128)):
            pool.add(url, url[7], {"role": url[7], "fleet": True, "instance_id": url[7:], "block_size": 16,
                                   "max_model_len": length})
        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 100})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert "maximum context length is 48" in r.json()["error"]["message"]
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 48
        pool.remove("http://p1")
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 64


def test_the_admin_api_answers_bad_input_by_the_field(caplog):
    """POST /admin/instances: a url that is not one, or a bad role, is a 400 naming it (the role checked before the
    instance is asked); an instance whose /pd/info cannot be read (not JSON, not an object, a KV layout of fields
    this router does not know) a 502 naming the url; one that does not fit the fleet a 400."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from picovllm.disagg.messages import KVLayout
    from picovllm.disagg.router_server import add_admin_routes
    from picovllm.entrypoints.openai.protocol import APIError

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, num_blocks=64, dtype="float32",
                      total_kv_heads=2).__dict__
    infos = {"/p": {"role": "p", "fleet": True, "instance_id": "p", "block_size": 16, "layout": layout},
             "/d": {"role": "d", "fleet": True, "instance_id": "d", "block_size": 16, "layout": layout},
             "/list": [1, 2], "/newlayout": {"role": "d", "fleet": True, "instance_id": "n", "block_size": 16,
                                             "layout": {**layout, "kv_cache_version": 2}}}
    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        base = request.url.path.removesuffix("/pd/info")
        asked.append(base)
        if base == "/nonjson":
            return httpx.Response(200, text="<html>hello</html>")
        return httpx.Response(200, json=infos[base])

    app = FastAPI()
    app.add_exception_handler(APIError, lambda request, e: JSONResponse(e.body(), e.status))
    engine = _fake_fleet(handler)
    add_admin_routes(app, engine)

    async def post(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            r = await client.post("/admin/instances", json=body)
        return r.status_code, r.json().get("error", {}).get("param")

    async def run():
        engine.start()
        try:
            got = [await post({"url": url, "role": "p"}) for url in ("http://host:abc", "http://[::1", "http://",
                                                                     "http://fake:99999", "http://exa mple.com", 7)]
            got.append(await post({"url": "http://fake/p", "role": "x"}))
            first_asked = list(asked)
            for path, role in (("/nonjson", "p"), ("/list", "p"), ("/p", "p"), ("/newlayout", "d"), ("/d", "p")):
                got.append(await post({"url": "http://fake" + path, "role": role}))
            return got, first_asked
        finally:
            await engine.shutdown()

    got, first_asked = asyncio.run(run())
    assert got[:6] == [(400, "url")] * 6 and got[6] == (400, "role") and first_asked == []
    assert got[7:] == [(502, "url"), (502, "url"), (200, None), (502, "url"), (400, "role")]
    assert list(engine.pool.instances) == ["http://fake/p"]


def test_router_flags_and_start_up_errors(tmp_path, monkeypatch, capsys):
    """--lease must be a positive number of seconds (0 had the health checks run back to back); an instance that
    never answers at start-up ends the router with an error line, as the other start-up errors do."""
    from picovllm.disagg import router_server
    from picovllm.entrypoints.openai import cli_router

    parser = argparse.ArgumentParser()
    cli_router.add_parser(parser.add_subparsers(dest="command"))
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            parser.parse_args(["router", "--lease", bad])
        assert "argument --lease: must be a positive number of seconds" in capsys.readouterr().err
    assert parser.parse_args(["router", "--lease", "2.5"]).lease == 2.5
    monkeypatch.setenv("PICOVLLM_PD_SECRET", SECRET)
    args = parser.parse_args(["router", "--prefill", "http://127.0.0.1:1", "--startup-timeout", "0.3"])
    with pytest.raises(SystemExit, match="^error: http://127.0.0.1:1 did not answer in time"):
        router_server.main(args)


def test_no_decode_instance_refuses_the_request_before_a_prefill_runs_it():
    """No D in rotation: the request is refused at once (a 503), rather than P computing the prompt and the client
    getting a first token, then an error."""
    import asyncio

    from picovllm.entrypoints.openai.engine_client import EngineDeadError

    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        return httpx.Response(200, content=_body(_output_lines(_out([5], True), handover={"opaque": True})))

    async def run():
        engine = _fake_fleet(handler, "http://p0", "http://d0")
        engine.pool.mark_down(engine.pool.instances["http://d0"], "gone")
        engine.start()
        try:
            with pytest.raises(EngineDeadError, match="no decode instance is in rotation"):
                await engine.add_request([1, 2, 3], SamplingParams(max_tokens=3), "r")
        finally:
            await engine.shutdown()

    asyncio.run(run())
    assert asked == []


def signed(method: str, url: str, path: str, body: dict | None = None, secret: str = SECRET) -> httpx.Response:
    data = json.dumps(body).encode() if body is not None else b""
    headers = {"content-type": "application/json", **sign_request(FleetSecret(secret.encode()), method, path, data)}
    return httpx.request(method, url + path, content=data or None, headers=headers, timeout=30)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """1 P and 2 D instances behind a router (decode policy round_robin, so both Ds take work); d1's engine loop is
    a thread (serving_fixtures' default), the others' run in processes of their own (--engine-process, serve's)."""
    root = tmp_path_factory.mktemp("fleet")
    model = build_tiny_chat_model(str(root / "model"), max_position_embeddings=2048)
    secret_file = root / "secret"
    secret_file.write_text(SECRET + "\n")
    common = ["--kv-transfer", "tcp", "--pd-secret-file", str(secret_file), "--kv-lease", "2", *ENGINE_ARGS]
    procs = {}

    def instance(name, role, *extra):
        procs[name] = ServerProcess(model, str(root / f"{name}.log"), "--role", role, *common, *extra,
                                    startup_timeout=None)
        return procs[name]

    try:
        for name, role, *extra in (("p", "p", "--engine-process"), ("d0", "d", "--engine-process"), ("d1", "d")):
            instance(name, role, *extra)
        for srv in procs.values():
            srv.wait_ready(180.0)
        procs["router"] = ServerProcess(None, str(root / "router.log"), "--prefill", procs["p"].url, "--decode",
                                        procs["d0"].url, procs["d1"].url, "--decode-policy", "round_robin",
                                        "--pd-secret-file", str(secret_file), "--lease", "2",
                                        "--startup-timeout", "120", command=("router",))
        yield {"model": model, "procs": procs, "instance": instance, "dead": []}
    finally:
        for srv in procs.values():
            srv.stop(signal.SIGKILL, timeout=10)


def test_outputs_equal_colocated(fleet):
    procs = fleet["procs"]
    llm = LLM(fleet["model"], block_size=16, num_kv_blocks=256, max_model_len=1024)
    client = openai.OpenAI(base_url=procs["router"].url + "/v1", api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt, r in zip(PROMPTS * 2, llm.generate(PROMPTS * 2, sp, use_tqdm=False)):
        got = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == r.outputs[0].text and got.choices[0].finish_reason == "length"
    parts = [ch.choices[0].text for ch in client.completions.create(
        model=name, prompt=PROMPTS[3], max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if ch.choices]
    assert "".join(parts) == llm.generate([PROMPTS[3]], sp, use_tqdm=False)[0].outputs[0].text
    one = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0].outputs[0]
    assert client.completions.create(model=name, prompt="Hello", max_tokens=1, temperature=0).choices[0].text == one.text
    want = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1),
                        use_tqdm=False)[0]
    got = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True, "prompt_logprobs": 1})   # P's scores, via D
    assert [None if d is None else {int(t): v["logprob"] for t, v in d.items()}
            for d in got.choices[0].model_extra["prompt_logprobs"]] == \
        [None] + [pytest.approx({t: lp.logprob for t, lp in d.items()}, abs=1e-4) for d in want.prompt_logprobs[1:]]
    with pytest.raises(openai.BadRequestError, match="longer"):
        client.completions.create(model=name, prompt=list(range(5, 300)) * 4, max_tokens=4)
    m = procs["router"].metrics()
    assert m["picovllm:requests_total.length"] >= 9
    for srv in (procs["p"], procs["d0"], procs["d1"]):
        wait_idle(srv)
    served = [wait_idle(procs[d])["picovllm:requests_total.length"] for d in ("d0", "d1")]
    assert min(served) >= 4, f"round-robin over two decode instances: {served}"


def test_control_routes_need_the_secret(fleet):
    procs = fleet["procs"]
    body = {"request_id": "x", "prompt_token_ids": [5, 6, 7], "params": {"max_tokens": 2}, "arrival_time": 0.0}
    for url, path, data in ((procs["p"].url, "/pd/prefill", body), (procs["router"].url, "/admin/instances",
                                                                     {"url": "http://127.0.0.1:1", "role": "d"})):
        assert httpx.post(url + path, json=data, timeout=10).status_code == 401
        r = signed("POST", url, path, data, secret="another-secret-0123456789")
        assert r.status_code == 401 and "secret" in r.json()["error"]["message"]
    assert signed("GET", procs["d0"].url, "/pd/load").json()["running"] == 0
    listed = signed("GET", procs["router"].url, "/admin/instances").json()["instances"]
    assert sorted(i["role"] for i in listed) == ["d", "d", "p"] and all(i["up"] for i in listed)
    r = signed("POST", procs["router"].url, "/admin/instances", {"url": procs["p"].url, "role": "d"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "role"
    # removed at run time: no request goes there; added back: it does again
    router, d1 = procs["router"].url, procs["d1"]
    assert signed("POST", router, "/admin/instances/remove", {"url": d1.url}).status_code == 200
    before = wait_idle(d1)["picovllm:requests_total.length"]
    for _ in range(2):
        assert httpx.post(router + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30).status_code == 200
    assert wait_idle(d1)["picovllm:requests_total.length"] == before
    assert signed("POST", router, "/admin/instances/remove", {"url": d1.url}).status_code == 404
    assert signed("POST", router, "/admin/instances", {"url": d1.url, "role": "d"}).status_code == 200
    for _ in range(2):
        assert httpx.post(router + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30).status_code == 200
    assert wait_idle(d1)["picovllm:requests_total.length"] == before + 1
    wait_idle(procs["p"])


def test_a_client_gone_before_a_decode_took_the_kv_frees_it_on_p_at_once(fleet):
    """A client that leaves before its request reached a D: the KV published on P is taken back at once (P's connector
    counts it withdrawn) or the request aborted while P still prefilled it, never left until the lease frees it
    (expired). The router drops P's stream when it sees its client gone, and gives the handle back (/pd/release) if
    P's first line came; P aborts a request whose stream breaks, the handle's line included."""
    procs, router, p = fleet["procs"], fleet["procs"]["router"], fleet["procs"]["p"]
    before, aborts = signed("GET", p.url, "/pd/load").json(), p.metrics()["picovllm:requests_total.abort"]
    prompt = [5 + i % 370 for i in range(900)]     # 900 tokens (of the tiny vocabulary): P prefills for a while
    with httpx.stream("POST", router.url + "/v1/completions",
                      json={"prompt": prompt, "max_tokens": 50, "stream": True}, timeout=30) as r:
        assert r.status_code == 200                # and gone, before any token
    with pytest.raises(httpx.TimeoutException):
        httpx.post(router.url + "/v1/completions", json={"prompt": prompt[1:], "max_tokens": 50},
                   timeout=httpx.Timeout(30, read=0.02))
    time.sleep(3.0)                                # past the lease (2 s): an expiry would have counted by now
    after = signed("GET", p.url, "/pd/load").json()
    assert after["expired"] == before["expired"], (before, after)
    # each taken back once published (withdrawn), or aborted while P still prefilled it (an abort output), or (a
    # race the router cannot close: the handle went to a D in the instant before the hang-up was seen) released by
    # the D that took it
    aborted = wait_idle(p)["picovllm:requests_total.abort"] - aborts
    taken = {k: after[k] - before[k] for k in ("withdrawn", "released")}
    assert taken["withdrawn"] + taken["released"] + aborted == 2, (before, after, aborted)
    for d in ("d0", "d1"):
        wait_idle(procs[d])


def test_a_prefill_stream_cut_as_its_handle_goes_out_gives_the_kv_back():
    """P's /pd/prefill stream whose reader is gone as the line with the KV's handle is sent (the generator closed at
    that line, as the server closes it when the write fails): the request is aborted, which takes the published KV
    back; a stream read to its end leaves it published for its D."""
    import asyncio

    from picovllm.disagg.pd_http import _ndjson_lines
    from picovllm.outputs import CompletionOutput, RequestOutput

    class Stream:      # a RequestStream's surface: the last output carries the handle, as a fleet P's does
        request_id, aborted, closed = "r", 0, 0

        async def outputs(self):
            out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "a", [7], None, None)], True)
            out.kv_handover = {"instance": "p0"}
            yield out

        def abort(self):
            self.aborted += 1

        def close(self):
            self.closed += 1

    async def run(read_to_end: bool) -> Stream:
        stream = Stream()
        lines = _ndjson_lines(stream)
        assert json.loads(await lines.__anext__())["kv_handover"] == {"instance": "p0"}
        if read_to_end:
            assert [x async for x in lines] == []
        else:
            await lines.aclose()
        return stream

    cut, whole = asyncio.run(run(False)), asyncio.run(run(True))
    assert (cut.aborted, cut.closed) == (1, 1) and (whole.aborted, whole.closed) == (0, 1)


def stopped_streams(front: ServerProcess, n: int = 2) -> list[list[dict]]:
    """n long streams through front (a router or proxy started with --shutdown-timeout 0); once each has sent a few
    chunks, SIGTERM front (exit code 0); each stream's data events, [DONE] left out."""
    import threading
    body = {"prompt": "Tell me a story", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    events, started = [[] for _ in range(n)], threading.Barrier(n + 1, timeout=60)

    def read(i):
        with httpx.stream("POST", front.url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events[i].append(json.loads(line[6:]))
                    if len(events[i]) == 3:
                        started.wait()
    threads = [threading.Thread(target=read, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    started.wait()
    assert front.stop(signal.SIGTERM, timeout=30) == 0, front.log()[-3000:]
    for t in threads:
        t.join(30)
    return events


def assert_aborted(events: list[list[dict]]) -> None:
    """Each stream ended with finish_reason "abort", no error event, before its max_tokens."""
    for ev in events:
        assert all("error" not in e for e in ev), ev[-2:]
        assert ev[-1]["choices"][0]["finish_reason"] == "abort", ev[-2:]
        assert sum(len(e["choices"]) for e in ev) < 900


def test_a_router_stopping_ends_its_open_streams_as_aborted(fleet):
    """README: SIGTERM aborts what still runs after --shutdown-timeout, the streams ending with finish_reason
    "abort", and exits 0. Through a router, too: not an error blaming the instances, which are fine (they stay in
    their rotation and end with every block free)."""
    procs, root = fleet["procs"], fleet["procs"]["p"].log_path.rsplit("/", 1)[0]
    decodes = [procs[d].url for d in ("d0", "d1") if d not in fleet["dead"]]
    router = ServerProcess(None, root + "/router_stop.log", "--prefill", procs["p"].url, "--decode", *decodes,
                           "--pd-secret-file", root + "/secret", "--lease", "2", "--shutdown-timeout", "0",
                           "--startup-timeout", "120", command=("router",))
    assert_aborted(stopped_streams(router))
    assert "out of rotation" not in router.log(), router.log()[-2000:]
    for name in ("p", "d0", "d1"):
        if name not in fleet["dead"]:
            wait_idle(procs[name])


def test_decode_killed_then_one_joins(fleet):
    procs, router = fleet["procs"], fleet["procs"]["router"]
    body = {"prompt": "Tell me a story", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    events, victim, t0 = [], None, None
    errors = router.metrics().get("picovllm:requests_total.error", 0.0)   # the module fleet's earlier tests count too
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:      # P's token and two of D's: kill the D decoding it
                victim = next(d for d in ("d0", "d1") if procs[d].metrics()["picovllm:num_requests_running"] == 1)
                procs[victim].proc.send_signal(signal.SIGKILL)
                t0 = time.monotonic()
    fleet["dead"].append(victim)
    assert time.monotonic() - t0 < 10 and events[-1] == "[DONE]"
    assert "decode instance" in json.loads(events[-2])["error"]["message"], events[-3:]
    wait_idle(procs["p"])
    for _ in range(3):            # the dead D is out of rotation: every request goes to the other
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
    for _ in range(2):            # the same 16+ token prompt twice: the prefix policy's hit (this module's tests may
        r = httpx.post(router.url + "/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text     # run on different xdist workers, each with a fleet of its own)
    m = router.metrics()
    assert m["picovllm:requests_total.error"] - errors == 1
    up = {i["url"]: i["up"] for i in signed("GET", router.url, "/admin/instances").json()["instances"]}
    assert up[procs[victim].url] is False and up[procs["p"].url] is True
    text = httpx.get(router.url + "/metrics", timeout=10).text   # per instance and per routing decision
    assert f'picovllm:router_instance_up{{instance="{procs[victim].url}",role="d"}} 0.0' in text
    assert f'picovllm:router_instance_failures_total{{instance="{procs[victim].url}",role="d"}}' in text
    assert 'picovllm:router_decisions_total{policy="prefix",reason="prefix_hit",role="p"}' in text
    assert 'picovllm:router_decisions_total{policy="round_robin",reason="round_robin",role="d"}' in text
    # a new D registers itself with the router and takes work at once
    new = fleet["instance"]("d2", "d", "--router", router.url).wait_ready(120.0)
    deadline = time.time() + 30
    while new.url not in {i["url"] for i in signed("GET", router.url, "/admin/instances").json()["instances"]}:
        assert time.time() < deadline, new.log()[-2000:]
        time.sleep(0.2)
    for _ in range(4):
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
    assert wait_idle(new)["picovllm:requests_total.length"] >= 1
    wait_idle(procs["p"])


def test_sigterm_stops_every_process_cleanly(fleet):
    for name, srv in fleet["procs"].items():
        if name in fleet["dead"]:
            continue
        kids = children_of(srv.proc.pid)
        assert srv.stop(signal.SIGTERM, timeout=30) == 0, srv.log()[-3000:]
        assert_exited(kids)


def test_a_client_that_leaves_counts_as_an_abort():
    """The router's requests_total: a client that leaves mid-stream counts as an abort (it had counted nothing);
    a request its instance failed counts as an error, once; one that finished, by its reason."""
    import asyncio

    from picovllm.entrypoints.openai.metrics import ServerMetrics

    async def held():        # a D that has sent one line and goes on (the client leaves before the rest)
        yield _output_lines(_out([5, 6], False))[0]
        await asyncio.sleep(30)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p0":
            return httpx.Response(200, content=_body(_output_lines(_out([5], True), handover={"opaque": True})))
        if request.url.path == "/pd/release":
            return httpx.Response(200, json={})
        if request.url.host == "d0":
            return httpx.Response(200, content=held())
        if request.url.host == "dbroken":       # one line, then the connection breaks
            return httpx.Response(200, content=_body(_output_lines(_out([5, 6], False)), broken=True))
        return httpx.Response(200, content=_body(_output_lines(_out([5, 6], True, "length"))))

    def counts(metrics) -> dict:
        return {o: c._value.get() for o, c in metrics.outcomes.items() if c._value.get()}

    async def run(decode: str) -> dict:
        engine = _fake_fleet(handler, "http://p0", decode)
        engine.metrics = metrics = ServerMetrics("m")
        engine.start()
        try:
            stream = await engine.add_request([1, 2, 3], SamplingParams(max_tokens=3), "r")
            gen = stream.outputs()
            if decode == "http://d0":
                await gen.__anext__()            # the first token, from P
                await gen.__anext__()            # D's first line: then the client leaves
                stream.close()
            else:
                try:
                    _ = [o async for o in gen]
                except EngineStepError:
                    pass
        finally:
            await engine.shutdown()
        return counts(metrics)

    assert asyncio.run(run("http://d0")) == {"abort": 1.0}
    assert asyncio.run(run("http://dfinished")) == {"length": 1.0}
    assert asyncio.run(run("http://dbroken")) == {"error": 1.0}
