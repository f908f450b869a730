"""The proxy's pairs without processes: picovllm/disagg/proxy.py's start-up checks against fake /pd/info answers,
and its health checks against fake pair servers on real sockets (a frozen one). (test_pd_serving.py runs the pairs as
processes; these stay out of its module, whose tests share one cluster and count its requests.)"""
import json
import time

import pytest

from picovllm import SamplingParams
from picovllm.disagg.auth import FleetSecret

SECRET = "pd-pair-test-secret-0123456789"


def test_a_pair_whose_decode_server_takes_less_is_refused(monkeypatch):
    """The proxy pairs each P with the D on its link's other end, and refuses a D whose max_model_len is below its
    P's (naming the field), as the router does: P would admit what D then fails as a 500, after the prefill."""
    from picovllm.disagg import proxy

    def info(role, length, local, remote):
        return {"role": role, "link_alive": True, "link": [local, remote], "max_model_len": length}

    ends = (["127.0.0.1", 1], ["127.0.0.1", 2])
    for d_length, ok in ((2048, True), (1024, True), (256, False)):
        served = {"http://p/pd/info": info("p", 1024, *ends), "http://d/pd/info": info("d", d_length, *ends[::-1])}
        monkeypatch.setattr(proxy, "_get", lambda url, deadline, secret=None: served[url])
        if ok:
            assert proxy.discover_pairs(["http://p"], ["http://d"], None, 1.0) == [proxy.PDPair("http://p",
                                                                                                  "http://d")]
        else:
            with pytest.raises(ValueError, match="max_model_len: the decode server http://d has 256"):
                proxy.discover_pairs(["http://p"], ["http://d"], None, 1.0)


def test_a_server_that_has_not_yet_said_its_link_is_up_is_asked_again(monkeypatch):
    """A server answers /pd/info before its engine loop has published its link's state (link_alive false for a
    moment after start-up): a proxy started beside its servers pairs them once they say it, and only a link still
    down after a few seconds stops it, naming the server."""
    from picovllm.disagg import proxy

    ends = (["127.0.0.1", 1], ["127.0.0.1", 2])
    asked = {"http://p/pd/info": 0, "http://d/pd/info": 0}

    def get(url, deadline, secret=None):
        asked[url] += 1
        role = url[7]
        return {"role": role, "link": list(ends if role == "p" else ends[::-1]), "max_model_len": 1024,
                "link_alive": asked[url] > 2 or role == "p"}

    monkeypatch.setattr(proxy, "_get", get)
    assert proxy.discover_pairs(["http://p"], ["http://d"], None, 10.0) == [proxy.PDPair("http://p", "http://d")]
    assert asked["http://d/pd/info"] == 3
    monkeypatch.setattr(proxy, "LINK_GRACE_S", 0.3)
    monkeypatch.setattr(proxy, "_get", lambda url, deadline, secret=None: {**get(url, deadline), "link_alive": False})
    with pytest.raises(ValueError, match="http://p has no live link"):
        proxy.discover_pairs(["http://p"], ["http://d"], None, 10.0)


def test_a_request_tries_each_pair_once_while_others_arrive(monkeypatch):
    """A P that cannot be reached (killed, not yet out of rotation): each request goes on to the next pair, every
    pair tried once, whatever the requests arriving meanwhile take of the round-robin. It had retried the dead pair
    (a 503 though a pair was whole) and listened twice on its D (whose "request_id ... is already in use" came back
    as a 400)."""
    import asyncio

    from picovllm.disagg import proxy
    from picovllm.entrypoints.openai.engine_client import EngineDeadError

    listening, tried = set(), []

    class Resp:
        async def aclose(self):     # (a D notices its client gone later: the id stays listened to meanwhile)
            pass

    async def fake_open(self, base, path, body, what):
        await asyncio.sleep(0.01)
        tried.append((body["request_id"], base))
        if base == "http://p1":
            raise EngineDeadError("the prefill server http://p1 is unreachable")
        if path == "/pd/decode":
            if (base, body["request_id"]) in listening:
                raise ValueError(f"request_id {body['request_id']!r} is already in use")
            listening.add((base, body["request_id"]))
        return Resp()

    monkeypatch.setattr(proxy.ProxyEngine, "_open", fake_open)

    async def run():
        engine = proxy.ProxyEngine([proxy.PDPair("http://p0", "http://d0"), proxy.PDPair("http://p1", "http://d1")],
                                   FleetSecret(SECRET.encode()), {}, lease_s=30.0)
        engine.start()
        try:
            streams = await asyncio.gather(*(engine.add_request([1, 2], SamplingParams(max_tokens=2), f"r{i}")
                                             for i in range(6)), return_exceptions=True)
        finally:
            await engine.shutdown()
        return streams

    streams = asyncio.run(run())
    assert all(isinstance(s, proxy.PDStream) and s.pair.prefill == "http://p0" for s in streams), streams
    for i in range(6):
        bases = [b for rid, b in tried if rid == f"r{i}"]
        assert len(bases) == len(set(bases)), (i, bases)


def test_a_frozen_decode_server_ends_its_streams_and_leaves_the_rotation():
    """Real sockets against fake pair servers: D sends a line and then nothing, and its /pd/info stops answering
    (a frozen process): the stream open on it ends within about a lease with an error naming it (it had waited
    forever), and the pair leaves the rotation, so a new request is refused at once and the proxy is unavailable
    (/health: 503) while no pair is in rotation."""
    import asyncio

    from picovllm.disagg.messages import OutputEncoder
    from picovllm.disagg.proxy import PDPair, ProxyEngine
    from picovllm.entrypoints.openai.engine_client import EngineDeadError, EngineStepError
    from picovllm.outputs import CompletionOutput, RequestOutput

    def lines(*outs, **last):
        wire = OutputEncoder()
        encoded = [wire.encode(RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "", t, None, None, None)],
                                             False)) for t in outs]
        encoded[-1].update(last)
        return [json.dumps(x).encode() + b"\n" for x in encoded]

    async def main():
        frozen, ports = asyncio.Event(), []

        async def serve(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ")[1].decode()
            length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                           if h.lower().startswith(b"content-length")), 0)
            await reader.readexactly(length)
            port = writer.get_extra_info("sockname")[1]
            if path == "/pd/info":
                if frozen.is_set() and port == ports[1]:
                    await asyncio.sleep(3600)          # a frozen process: no answer
                body = b'{"link_alive": true}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                for line in (lines([5], handed_off=True) if path == "/pd/prefill" else lines([5, 6])):
                    writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                if path == "/pd/decode":
                    await writer.drain()
                    frozen.set()
                    await asyncio.sleep(3600)
                writer.write(b"0\r\n\r\n")
            await writer.drain()
            writer.close()

        servers = [await asyncio.start_server(serve, "127.0.0.1", 0) for _ in range(2)]
        ports += [srv.sockets[0].getsockname()[1] for srv in servers]
        pair = PDPair(f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}")
        engine = ProxyEngine([pair], FleetSecret(SECRET.encode()), {}, lease_s=0.4)
        engine.start()
        start, got = time.monotonic(), []
        try:
            assert engine.unavailable is None
            stream = await engine.add_request([1, 2, 3], SamplingParams(max_tokens=3), "r")
            with pytest.raises(EngineStepError, match=f"127.0.0.1:{ports[1]}"):
                async for out in stream.outputs():
                    got.append(out.outputs[0].token_ids)
            took = time.monotonic() - start
            with pytest.raises(EngineDeadError, match="has not answered"):
                await engine.add_request([1, 2, 3], SamplingParams(max_tokens=3), "r2")
            # what /health answers 503 with (it had said ok while no request could be served)
            assert f"no prefill/decode pair is in rotation: {pair.prefill} -> {pair.decode}: " \
                   f"{pair.decode} has not answered" in engine.unavailable
        finally:
            await engine.shutdown()
            for srv in servers:
                srv.close()
        return got, took

    got, took = asyncio.run(asyncio.wait_for(main(), 30))
    assert got == [[5], [5, 6]] and took < 5.0, (got, took)
