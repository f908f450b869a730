"""A fleet as processes: `serve --role p|d --kv-transfer tcp` instances behind `picovllm router`.

Oracle: LLM.generate in this process on the same weights (greedy). Also: the control routes refuse a
caller without the fleet's secret; a D killed mid-stream ends its request with an error, leaves the
rotation, and P ends with every block free; a D started with --router joins and takes work; SIGTERM
stops every process cleanly. The routing policies are checked on their own first (no processes).
"""
import json
import signal
import time

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
            stream_ = await engine.add_request([1, 2, 3], SamplingParams(max_tokens=3), "r")
            got = []
            with pytest.raises(EngineStepError, match=f"127.0.0.1:{ports[1]}"):
                async for o in stream_.outputs():
                    got.append(o.outputs[0].token_ids)
            took = time.monotonic() - start
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
    assert after["released"] == before["released"]  # no D ever took them
    # each taken back once published (withdrawn), or aborted while P still prefilled it (an abort output)
    aborted = wait_idle(p)["picovllm:requests_total.abort"] - aborts
    assert after["withdrawn"] - before["withdrawn"] + aborted == 2, (before, after, aborted)
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


def test_decode_killed_then_one_joins(fleet):
    procs, router = fleet["procs"], fleet["procs"]["router"]
    body = {"prompt": "Tell me a story", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    events, victim, t0 = [], None, None
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
    assert m["picovllm:requests_total.error"] == 1
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
