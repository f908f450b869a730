"""Disaggregated serving: P and D as separate server processes (`serve --role p|d`) behind `picovllm proxy`.

Oracle: LLM.generate / LLM.chat in this process on the same weights (greedy). Also: a D killed mid-stream
gives the client an error within a bounded time while P stays up with every KV block free; SIGTERM
stops all three processes cleanly (exit 0, no process left); the P/D secret: a D server or a proxy
with the wrong one is refused and stops, naming the flag, unsigned /pd calls get 401, and the pairs
serve on, every block free."""
import json
import signal
import time

import httpx
import openai
import pytest

from picovllm import LLM, SamplingParams
from picovllm.disagg.auth import FleetSecret, sign_request
from picovllm.disagg.messages import OutputDecoder
from serving_fixtures import ServerProcess, build_tiny_chat_model, free_port
from test_server_lifecycle import assert_exited, children_of

ENGINE_ARGS = ["--block-size", "16", "--num-kv-blocks", "256", "--max-model-len", "1024"]
PROMPTS = ["Hello, how are you", "The capital of France is", "Tell me a story about a cat"]
SECRET = "pd-pair-test-secret-0123456789"


def start_proxy(log_path: str, prefill: list[str], decode: list[str], secret_file: str,
                startup_timeout: float | None = 120.0, extra: tuple[str, ...] = ()) -> ServerProcess:
    return ServerProcess(None, log_path, "--prefill", *prefill, "--decode", *decode, "--startup-timeout", "120",
                         "--pd-secret-file", secret_file, *extra, command=("proxy",), startup_timeout=startup_timeout)


def start_pairs(model: str, logdir, n: int, secret_file: str) -> tuple[list[dict[str, ServerProcess]], ServerProcess]:
    """n P-D server pairs, each linked on a fresh port, all started at once (a P is up once its D linked).
    Before pair 0's own D, a D server with the wrong secret tries P0's port: P0 refuses it and waits on;
    the impostor stops (returned, exited). Pair 0's servers and the impostor run their engine loops in processes
    of their own (--engine-process, serve's default), pair 1's as threads (serving_fixtures' default)."""
    wrong = logdir / "wrong.secret"
    wrong.write_text("not-the-pd-secret-0123456789\n")
    pairs, impostor = [], None
    for i in range(n):
        kv = free_port()
        pair = {}
        for role, extra in (("p", ["--kv-port", str(kv)]), ("d", ["--kv-peer", f"127.0.0.1:{kv}"])):
            if i == 0 and role == "d":
                impostor = ServerProcess(model, str(logdir / "impostor.log"), "--role", "d", *extra, *ENGINE_ARGS,
                                         "--pd-secret-file", str(wrong), "--engine-process", startup_timeout=None)
                impostor.proc.wait(180)
            pair[role] = ServerProcess(model, str(logdir / f"{role}{i}.log"), "--role", role, *extra, *ENGINE_ARGS,
                                       "--pd-secret-file", secret_file, *(["--engine-process"] if i == 0 else []),
                                       startup_timeout=None)
        pairs.append(pair)
    for pair in pairs:
        for srv in pair.values():
            srv.wait_ready(180.0)
    return pairs, impostor


def signed(method: str, url: str, path: str, body: dict | None = None, secret: str = SECRET) -> httpx.Response:
    data = json.dumps(body).encode() if body is not None else b""
    headers = {"content-type": "application/json", **sign_request(FleetSecret(secret.encode()), method, path, data)}
    return httpx.request(method, url + path, content=data, headers=headers, timeout=30)


def wait_idle(srv, timeout=20.0) -> dict:
    deadline = time.time() + timeout
    while True:
        m = srv.metrics()
        if m["picovllm:num_requests_running"] == 0 and \
                m["picovllm:kv_cache_free_blocks"] == m["picovllm:kv_cache_num_blocks"]:
            return m
        assert time.time() < deadline, f"not idle: {m}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_chat_model(str(tmp_path_factory.mktemp("tinypd") / "model"), max_position_embeddings=2048)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, block_size=16, num_kv_blocks=256, max_model_len=1024)


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    """Two P-D pairs behind one proxy, the --decode URLs in the other order than their --prefill URLs."""
    logdir = tmp_path_factory.mktemp("pdlog")
    secret_file = logdir / "pd.secret"
    secret_file.write_text(SECRET + "\n")
    pairs = []
    try:
        pairs, impostor = start_pairs(model, logdir, 2, str(secret_file))
        proxy = start_proxy(str(logdir / "proxy.log"), [pair["p"].url for pair in pairs],
                            [pair["d"].url for pair in reversed(pairs)], str(secret_file))
        yield {"pairs": pairs, "proxy": proxy, "impostor": impostor, "logdir": logdir}
    finally:
        for srv in [s for pair in pairs for s in pair.values()] + ([proxy] if "proxy" in locals() else []):
            srv.stop(signal.SIGKILL, timeout=10)


def all_servers(cluster) -> list[ServerProcess]:
    return [s for pair in cluster["pairs"] for s in pair.values()]


def test_outputs_equal_colocated(cluster, llm):
    client = openai.OpenAI(base_url=cluster["proxy"].url + "/v1", api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    for prompt, r in zip(PROMPTS, llm.generate(PROMPTS, sp, use_tqdm=False)):
        rc = r.outputs[0]
        got = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                        extra_body={"ignore_eos": True})
        c = got.choices[0]
        assert c.text == rc.text and c.finish_reason == "length"
        assert got.usage.completion_tokens == 12 and got.usage.prompt_tokens == len(r.prompt_token_ids)
        assert c.logprobs.token_logprobs == pytest.approx([d[t].logprob for d, t in zip(rc.logprobs, rc.token_ids)],
                                                          abs=1e-4)
        parts = [ch.choices[0].text for ch in client.completions.create(
            model=name, prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True})
            if ch.choices]
        assert "".join(parts) == rc.text and parts[0] != ""          # the first chunk (P's token) is not empty
    conv = [{"role": "user", "content": "Tell me a story"}]
    rc = llm.chat(conv, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    got = client.chat.completions.create(model=name, messages=conv, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == rc.text and got.choices[0].finish_reason == rc.finish_reason
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=name, messages=conv, max_tokens=10, temperature=0, stream=True)]
    assert "".join(parts) == rc.text
    # seeded sampling: the stream seed is per (seed, output index), so D continues P's stream exactly
    seeded = llm.generate(["Once upon"], SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert client.completions.create(model=name, prompt="Once upon", max_tokens=10, temperature=1.0, seed=7,
                                     extra_body={"ignore_eos": True}).choices[0].text == seeded.text
    # penalties and logit bias travel through the proxy to P and on to D (prompt ids included)
    pen = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={"17": 4.0})
    want = llm.generate(["Once upon"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                      repetition_penalty=1.5, **pen), use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=name, prompt="Once upon", max_tokens=12, temperature=0, **pen,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    assert got.choices[0].text == want.text
    # n samples through the proxy: each its own P-D request, seeded with seed + i
    want = llm.generate(["Once upon"], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs
    got = client.completions.create(model=name, prompt="Once upon", n=2, max_tokens=8, temperature=1.0, seed=3,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in got.choices] == [w.text for w in want] and want[0].text != want[1].text
    # prompt logprobs: P scores the prompt, the handover carries the scores to D's outputs (streamed: the first
    # chunk; not streamed: D's final output); echo with logprobs leads with the prompt's
    want = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                             prompt_logprobs=2, logprobs=1), use_tqdm=False)[0]
    got = client.completions.create(model=name, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=1,
                                    echo=True, extra_body={"ignore_eos": True, "prompt_logprobs": 2})
    scored = got.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(want.prompt_token_ids)
    for d, w in zip(scored[1:], want.prompt_logprobs[1:]):
        assert sorted(map(int, d)) == sorted(w) and all(d[str(t)]["logprob"] == pytest.approx(w[t].logprob, abs=1e-4)
                                                        for t in w)
    n_prompt = len(want.prompt_token_ids)
    assert got.choices[0].logprobs.token_logprobs[1:n_prompt] == pytest.approx(
        [d[t].logprob for d, t in zip(want.prompt_logprobs[1:], want.prompt_token_ids[1:])], abs=1e-4)
    # a request that ends at its first token never reaches D
    one = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0].outputs[0]
    assert client.completions.create(model=name, prompt="Hello", max_tokens=1, temperature=0).choices[0].text == one.text
    # bad input: a 400 from P, naming the problem, nothing left behind
    with pytest.raises(openai.BadRequestError, match="max_model_len|longer"):
        client.completions.create(model=name, prompt=list(range(5, 300)) * 4, max_tokens=4)
    # structured outputs and forced tool calls: P samples the first token under the grammar, D the rest (the
    # engines' parity: test_disagg_engines.py); served as the colocated engine answers
    from picovllm import StructuredOutputsParams
    for kw, so in [(dict(extra_body={"guided_choice": ["alpha", "beta gamma"]}),
                    StructuredOutputsParams(choice=["alpha", "beta gamma"])),
                   (dict(extra_body={"guided_regex": "[a-z]{2,6} [0-9]+"}),
                    StructuredOutputsParams(regex="[a-z]{2,6} [0-9]+"))]:
        want = llm.chat(conv, SamplingParams(temperature=0, max_tokens=12, structured_outputs=so),
                        use_tqdm=False)[0].outputs[0]
        got = client.chat.completions.create(model=name, messages=conv, max_tokens=12, temperature=0, **kw)
        assert got.choices[0].message.content == want.text, (kw, want.text)
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["x"], "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
    got = client.chat.completions.create(model=name, messages=conv, max_tokens=150, temperature=0, tools=[tool],
                                         tool_choice="required")
    calls = got.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "f" and json.loads(calls[0].function.arguments)["x"] in range(10)
    # beam search runs its steps as engine requests: not through a proxy's pairs
    with pytest.raises(openai.BadRequestError, match="disaggregation") as e:
        client.completions.create(model=name, prompt="Hello", n=2, max_tokens=4, extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "use_beam_search", e.value.body
    # a priority reaches P, whose policy (FCFS here) refuses it, naming the field
    with pytest.raises(openai.BadRequestError, match="scheduling policy") as e:
        client.completions.create(model=name, prompt="Hello", max_tokens=4, extra_body={"priority": 1})
    assert e.value.body["param"] == "priority", e.value.body
    for srv in all_servers(cluster):
        wait_idle(srv)


def test_the_pd_secret_is_required(cluster):
    """A D server with the wrong secret was refused by P (and stopped, naming the flag) while P waited for its
    own; /pd calls without the secret's signature get 401 and leave nothing behind; a proxy with the wrong
    secret stops at start-up, naming the flag; the pairs serve on, token for token, every block free."""
    impostor = cluster["impostor"]
    assert impostor.proc.returncode not in (0, None)
    assert "--pd-secret-file" in impostor.log() and "refused" in impostor.log(), impostor.log()[-2000:]
    p0 = cluster["pairs"][0]["p"]
    assert "refused a peer" in p0.log()
    body = {"request_id": "x", "prompt_token_ids": [5, 6, 7], "params": {"max_tokens": 2}, "arrival_time": 0.0}
    for srv, path, data in ((p0, "/pd/prefill", body), (cluster["pairs"][0]["d"], "/pd/decode", {"request_id": "y"})):
        r = httpx.post(srv.url + path, json=data, timeout=10)
        assert r.status_code == 401 and "shared secret" in r.json()["error"]["message"], r.text
        r = signed("POST", srv.url, path, data, secret="another-secret-0123456789")
        assert r.status_code == 401 and "wrong signature" in r.json()["error"]["message"], r.text
    assert httpx.get(p0.url + "/pd/info", timeout=10).status_code == 401
    assert signed("GET", p0.url, "/pd/info").json()["link_alive"] is True
    assert httpx.get(p0.url + "/health", timeout=10).status_code == 200
    wrong = cluster["logdir"] / "wrong.secret"
    bad_proxy = start_proxy(str(cluster["logdir"] / "bad_proxy.log"), [p0.url], [cluster["pairs"][0]["d"].url],
                            str(wrong), startup_timeout=None)
    assert bad_proxy.proc.wait(60) != 0
    assert "--pd-secret-file" in bad_proxy.log() and "refused the proxy's signature" in bad_proxy.log(), \
        bad_proxy.log()[-2000:]
    r = httpx.post(cluster["proxy"].url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200, r.text
    for srv in all_servers(cluster):
        m = wait_idle(srv)
        assert m["picovllm:num_requests_waiting"] == 0


def test_round_robin_and_client_disconnect(cluster):
    """Each pair serves every other request; a client that leaves mid-stream frees the KV on both sides."""
    proxy, ds = cluster["proxy"], [pair["d"] for pair in cluster["pairs"]]
    before = [wait_idle(d)["picovllm:requests_total.length"] for d in ds]
    texts = []
    for _ in range(4):
        r = httpx.post(proxy.url + "/v1/completions", json={
            "prompt": "Numbers: 0 1 2", "max_tokens": 8, "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert len(set(texts)) == 1 and texts[0]
    assert [wait_idle(d)["picovllm:requests_total.length"] - b for d, b in zip(ds, before)] == [2, 2]
    body = {"prompt": "Tell me a story", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                break
    for srv in all_servers(cluster):
        wait_idle(srv)
    assert sum(wait_idle(d)["picovllm:requests_total.abort"] for d in ds) == 1


def test_a_proxy_stopping_ends_its_open_streams_as_aborted(cluster):
    """SIGTERM to a proxy with streams open past --shutdown-timeout: they end with finish_reason "abort" (README),
    not an error blaming a server; exit 0; the pairs stay in rotation, every block free."""
    from test_pd_router import assert_aborted, stopped_streams
    pairs = cluster["pairs"]
    proxy = start_proxy(str(cluster["logdir"] / "proxy_stop.log"), [pair["p"].url for pair in pairs],
                        [pair["d"].url for pair in pairs], str(cluster["logdir"] / "pd.secret"),
                        extra=("--shutdown-timeout", "0"))
    assert_aborted(stopped_streams(proxy))
    assert "out of rotation" not in proxy.log(), proxy.log()[-2000:]
    for srv in all_servers(cluster):
        wait_idle(srv)


def test_decode_killed_mid_stream(cluster):
    """D dies mid-stream: the client gets a final SSE error event, not a hang; its P stays up with every
    block free; the proxy routes new requests to the pair still whole."""
    proxy = cluster["proxy"]
    before = proxy.metrics()     # this module's other tests may run before, or on another xdist worker
    body = {"prompt": "Tell me a story", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    events, t0, victim = [], None, None
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:          # P's token and two of D's: kill the D that is decoding it
                victim = next(pair for pair in cluster["pairs"]
                              if pair["d"].metrics()["picovllm:num_requests_running"] == 1)
                victim["d"].proc.send_signal(signal.SIGKILL)
                cluster["dead"] = [victim["d"]]     # the tests after this one leave it be, even if this one fails
                t0 = time.monotonic()
    assert time.monotonic() - t0 < 10
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert "error" in last and "decode server" in last["error"]["message"], events[-3:]
    assert len(events) < 900
    assert httpx.get(victim["p"].url + "/health", timeout=5).status_code == 200
    wait_idle(victim["p"])
    for _ in range(2):            # round-robin skips the pair whose D is gone
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
    # P itself, asked directly, fails the handover at once and frees the blocks
    r = signed("POST", victim["p"].url, "/pd/prefill", {"request_id": "x", "prompt_token_ids": [5, 6, 7],
                                                         "params": {"max_tokens": 4}, "arrival_time": time.time()})
    decoder = OutputDecoder()     # one whole output, then deltas (a first token may come before the error)
    lines = [json.loads(line) for line in r.text.strip().splitlines()]
    last = [decoder.decode(line) for line in lines if "output" in line or "delta" in line][-1]
    assert last.finished and last.outputs[0].finish_reason == "error" and "decode engine" in last.error
    wait_idle(victim["p"])
    m = proxy.metrics()
    counted = {k: m[f"picovllm:requests_total.{k}"] - before.get(f"picovllm:requests_total.{k}", 0)
               for k in ("error", "length")}
    assert counted == {"error": 1, "length": 2}      # the killed stream; the two requests after it
    # now the other pair's P dies too: no pair can take a request, and the client gets a clean 503 at once
    survivor = next(pair for pair in cluster["pairs"] if pair is not victim)
    survivor["p"].proc.send_signal(signal.SIGKILL)
    cluster["dead"].append(survivor["p"])
    survivor["p"].proc.wait(10)
    t0 = time.monotonic()
    r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
    assert r.status_code == 503 and "prefill server" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 10
    wait_idle(survivor["d"])        # the listener the proxy opened there was dropped


def test_sigterm_stops_every_process_cleanly(cluster):
    """The proxy and the P and D servers still up: SIGTERM, exit 0, no process left behind."""
    for srv in [cluster["proxy"]] + [s for s in all_servers(cluster) if s not in cluster.get("dead", [])]:
        kids = children_of(srv.proc.pid)
        assert srv.stop(signal.SIGTERM, timeout=30) == 0, srv.log()[-3000:]
        assert_exited(kids)
