"""The wire: typed messages as JSON (no pickle), and the framed control channel."""
import dataclasses
import json
import socket
import threading
import time

import pytest

from picovllm.disagg.auth import AuthError, FleetSecret
from picovllm.disagg.channel import Channel, Listener, PeerGone
from picovllm.disagg.messages import (Accept, Bye, Hello, HandoverRequest, KVAuthChallenge, KVAuthResult, KVLayout,
                                      Offer, Output, OutputDecoder, OutputEncoder, decode, encode, from_wire,
                                      output_from_wire, output_to_wire, to_wire)
from picovllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=10, dtype="float32",
                  total_kv_heads=2)


def offer():
    return Offer(HandoverRequest("r1", "hi", [1, 2, 3], [7], {"temperature": 0.0, "stop": ["x"]}, 5, 3, [4],
                                 [[[7, -0.5, 1], [8, -1.5, 2]]], -0.5, 0, 10.0, 10.5, 11.0, [11.0]))


def test_messages_round_trip_as_json():
    for msg in (Hello("p", 3, "torch_dist", LAYOUT, {"store": ["127.0.0.1", 5]}), offer(), Accept("r1", 9, [2, 0])):
        data = encode(msg)
        obj = json.loads(data)                        # plain JSON on the wire
        assert obj == {"type": type(msg).__name__, "body": dataclasses.asdict(msg)}
        assert to_wire(msg) == obj and from_wire(to_wire(msg)) == msg
        assert decode(data) == msg                    # nested dataclasses (KVLayout, HandoverRequest) rebuilt


def test_priority_crosses_to_d_and_a_bad_one_is_refused():
    from picovllm.disagg.decode import request_from_handover
    msg = Offer(dataclasses.replace(offer().request, priority=-3))
    back = decode(encode(msg))
    assert back == msg and request_from_handover(back.request, 4).priority == -3
    body = to_wire(msg)
    del body["body"]["request"]["priority"]                  # a peer that does not send it: FCFS's 0
    assert request_from_handover(from_wire(body).request, 4).priority == 0
    with pytest.raises(ValueError, match="priority must be an int"):
        request_from_handover(dataclasses.replace(offer().request, priority="high"), 4)


def test_decode_refuses_what_is_not_a_message():
    with pytest.raises(ValueError, match="unknown wire message type"):
        decode(json.dumps({"type": "os.system", "body": {}}).encode())
    with pytest.raises(TypeError, match="not a wire message"):
        encode(LAYOUT)
    with pytest.raises(TypeError, match="not JSON serializable"):
        encode(Accept("r1", 9, [object()]))


def test_layout_mismatch_names_the_field():
    other = KVLayout(2, 2, 16, 4, 10, "float32", 2)
    assert "head_dim" in LAYOUT.mismatch(other)
    assert LAYOUT.mismatch(KVLayout(2, 2, 8, 4, 99, "float32", 2)) is None    # cache sizes may differ


def test_request_output_round_trip():
    out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "ab", [5, 6], -1.25,
                                                            [{5: Logprob(-0.5, 1, "a")}, {6: Logprob(-0.75, 2, "b")}],
                                                            "length")],
                        True, RequestMetrics(1.0, 1.5, 2.0, 3.0, [2.0, 2.5]), None, 0)
    back = output_from_wire(json.loads(encode(Output(output_to_wire(out))))["body"]["output"])
    assert back == out and back.metrics.ttft == 1.0 and back.metrics.itls == [0.5]
    # the wire's shape is dataclasses.asdict's, each completion's logprobs and the prompt's as lists
    out.prompt_logprobs, out.kv_handover = [None, {2: Logprob(-0.25, 1, "x")}], {"type": "PublishedKV"}
    expect = dataclasses.asdict(out)
    expect["outputs"][0]["logprobs"] = [[[5, -0.5, 1, "a"]], [[6, -0.75, 2, "b"]]]
    expect["prompt_logprobs"] = [None, [[2, -0.25, 1, "x"]]]
    assert output_to_wire(out) == expect
    back = output_from_wire(json.loads(encode(Output(output_to_wire(out))))["body"]["output"])
    assert back == out         # the prompt's logprobs come back too (JSON made their token keys strings)


def test_channel_frames_partial_writes_and_reports_eof():
    a, b = socket.socketpair()
    ca, cb = Channel(a), Channel(b)
    data = encode(offer())
    frame = len(data).to_bytes(4, "big") + data
    a.sendall(frame[:7])                              # a frame split across writes
    assert cb.recv(0.05) is None
    a.sendall(frame[7:] + frame)
    assert cb.recv_all() == [offer(), offer()]
    ca.close()
    with pytest.raises(PeerGone):
        cb.recv(1.0)
    cb.close()


def test_heartbeat_keeps_a_quiet_peer_audible():
    a, b = socket.socketpair()
    ca, cb = Channel(a), Channel(b)
    ca.start_heartbeat(0.02)
    time.sleep(0.15)
    assert cb.recv_all() == []                        # heartbeats are swallowed...
    assert cb.silent_for() < 0.1                      # ...but count as hearing from the peer
    ca.close()
    cb.close()


def test_output_stream_deltas_rebuild_every_output():
    """OutputEncoder/OutputDecoder: each decoded output equals the engine's whole output, through token
    growth, logprobs, a text that shrinks (a stop string trimmed at the end) and the final with metrics;
    after the first line, a line's size does not grow with the prompt."""
    prompt = list(range(5000))
    outs, toks, text, lps = [], [], "", []
    for i in range(6):
        toks = toks + [100 + i]
        text = text + f" w{i}"
        lps = lps + [{100 + i: Logprob(-0.1 * i, 1, f" w{i}"), 7: Logprob(-3.0, 2, "x")}]
        outs.append(RequestOutput("r", "p", prompt, [CompletionOutput(0, text, list(toks), -0.5 * i, list(lps))],
                                  False, RequestMetrics(1.0, 1.5, 2.0, None, [2.0 + j for j in range(i + 1)]), None, 3))
    final = RequestOutput("r", "p", prompt, [CompletionOutput(0, text[:-4], list(toks), -2.5, list(lps), "stop", "w5")],
                          True, RequestMetrics(1.0, 1.5, 2.0, 9.0, [2.0 + j for j in range(6)]), None, 3)
    outs.append(final)
    enc, dec = OutputEncoder(), OutputDecoder()
    sizes = []
    for out in outs:
        line = json.loads(json.dumps(enc.encode(out)))
        sizes.append(len(json.dumps(line)))
        back = dec.decode(line)
        assert back.outputs == out.outputs and back.finished == out.finished
        assert back.prompt_token_ids == prompt and back.num_cached_tokens == 3
    assert back == final and back.metrics.itls == [1.0] * 5
    assert sizes[0] > 5000 * 4 and max(sizes[1:]) < 500
    with pytest.raises(ValueError, match="before the stream's first whole output"):
        OutputDecoder().decode(line)
    with pytest.raises(ValueError, match="in the stream of"):
        other = OutputDecoder()
        other.decode(json.loads(json.dumps(OutputEncoder().encode(dataclasses.replace(outs[0], request_id="q")))))
        other.decode(line)


def test_listener_refuses_peers_without_the_secret_and_waits_for_one_with_it():
    """The P/D link's and the driver's listener: a peer with the wrong secret, none, or no picovllm messages at
    all is refused (and told why) before any message of its is read; accept() goes on to the one that proves
    the secret; that channel then carries messages both ways. Not a byte of the secret goes on the wire."""
    secret = FleetSecret(b"pd-secret-for-the-wire-test-0123")
    listener = Listener("127.0.0.1", secret=secret)
    accepted = []
    t = threading.Thread(target=lambda: accepted.append(listener.accept(20.0)))
    t.start()
    try:
        with pytest.raises(AuthError, match="refused: authentication failed: not the shared secret"):
            Channel.connect(listener.address, 5.0, secret=FleetSecret(b"not-the-pd-secret-0123456789"))
        bare = Channel.connect(listener.address, 5.0)        # no handshake: says Bye at once
        bare.send(Bye())
        assert isinstance(bare.recv(5.0), KVAuthChallenge)
        refusal = bare.recv(5.0)
        assert isinstance(refusal, KVAuthResult) and "authentication failed" in refusal.error
        with pytest.raises(PeerGone):
            bare.recv(5.0)
        with socket.create_connection(tuple(listener.address), timeout=5) as raw:     # not our framing at all
            raw.sendall(b"\x00\x00\x00\x05hello")
            raw.settimeout(5)
            got = b""
            while chunk := raw.recv(1 << 16):
                got += chunk
            assert b"authentication failed" in got and secret.key not in got
        assert not accepted
        good = Channel.connect(listener.address, 5.0, secret=secret)
        t.join(10)
        assert len(accepted) == 1 and listener.refused == 3
        accepted[0].send(Accept("r1", 9, [2, 0]))
        assert good.recv(5.0) == Accept("r1", 9, [2, 0])
        good.send(Bye())
        assert isinstance(accepted[0].recv(5.0), Bye)
    finally:
        t.join(10)
        listener.close()
        for ch in accepted:
            ch.close()


def test_a_listener_that_cannot_prove_the_secret_is_refused_by_the_connecting_side():
    """The other direction: a stranger listening where D expects P gets nothing but D's proof."""
    secret = FleetSecret(b"pd-secret-for-the-wire-test-0123")
    stranger = Listener("127.0.0.1", secret=FleetSecret(b"a-stranger-s-own-secret-000000"))
    seen = []

    def serve():
        with pytest.raises(TimeoutError):     # it refuses D's proof, and D never comes back
            stranger.accept(3.0)
        seen.append(stranger.refused)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with pytest.raises(AuthError, match="refused"):
            Channel.connect(stranger.address, 5.0, secret=secret)
    finally:
        t.join(10)
        stranger.close()
    assert seen == [1]
