"""Server pieces that need no server: streamed deltas under stop strings, request validation, bench statistics."""
import asyncio
import json
import random
import statistics
import threading

import pytest

from picovllm.bench.serve import RequestResult, arrival_gaps, meets, parse_goodput, summarize
from picovllm.engine.detokenizer import check_stop
from picovllm.engine.request import Request
from picovllm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest
from picovllm.entrypoints.openai.serving import TextDeltas
from picovllm.sampling_params import StructuredOutputsParams
from picovllm.sampling_params import SamplingParams


def test_streamed_deltas_add_up_to_final_text_under_stop_strings():
    """Drive the engine's own check_stop and make_output with random text pieces: whatever a stop string trims at
    the end, the cumulative outputs never take back text, and the deltas streamed from them along the way
    concatenate to exactly the final text (with and without include_stop_str_in_output)."""
    for seed in range(300):
        one_stream(random.Random(seed))


def one_stream(rng: random.Random) -> None:
    from types import SimpleNamespace
    from picovllm.engine.llm_engine import Engine
    alphabet = "abc "
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    req = Request("r", [1], SamplingParams(max_tokens=40, stop=stops, ignore_eos=True,
                                           include_stop_str_in_output=rng.random() < 0.3))
    req.max_tokens = 40
    engine = SimpleNamespace(_decode_tokens=lambda d: None, stream_deltas=False)
    deltas, streamed, shown = TextDeltas(), "", ""
    while not req.is_finished:
        piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))
        req.output_token_ids.append(7)
        req.text += piece
        check_stop(req, 7, piece, [], 10**6)
        if rng.random() < 0.7 or req.is_finished:     # the reader sometimes skips outputs (coalescing)
            c = Engine.make_output(engine, req).outputs[0]
            assert c.text.startswith(shown)           # nothing taken back
            shown = c.text
            streamed += deltas.text(c, req.is_finished)
    assert streamed == req.text


def test_request_models_are_strict_and_name_fields():
    with pytest.raises(Exception, match="max_tokens"):
        CompletionRequest.model_validate_json('{"prompt": "a", "max_tokens": "5"}')
    with pytest.raises(Exception, match="temperature"):
        CompletionRequest.model_validate_json('{"prompt": "a", "temperature": Infinity}')
    with pytest.raises(Exception, match="n\n.*greater than or equal to 1"):
        CompletionRequest.model_validate_json('{"prompt": "a", "n": 0}')
    r = CompletionRequest.model_validate_json('{"prompt": [[1, 2]], "temperature": 0, "stop": "x"}')
    assert r.prompts() == [[1, 2]] and r.max_tokens == 16
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[5]).prompts() == [[5]]
    sp = r.sampling_params(r.max_tokens, None)
    assert sp.temperature == 0 and sp.stop == ["x"] and sp.max_tokens == 16
    with pytest.raises(APIError, match="min_tokens"):
        CompletionRequest.model_validate_json('{"prompt": "a", "max_tokens": 2, "min_tokens": 5}').sampling_params(2, None)
    c = ChatCompletionRequest.model_validate_json(
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],'
        ' "max_completion_tokens": 7, "logprobs": true, "top_logprobs": 3}')
    from picovllm.entrypoints.chat_template import content_for_template
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert c.messages[0].as_template_dict() == {"role": "user", "content": parts}
    assert content_for_template([c.messages[0].as_template_dict()], "{{ m.content }}") == [{"role": "user", "content": "a\nb"}]
    assert c.max_new_tokens == 7 and c.num_logprobs == 3
    with pytest.raises(Exception, match="messages"):
        ChatCompletionRequest.model_validate_json('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}')


def test_arrival_gaps_are_gamma_with_the_asked_rate():
    rng = random.Random(0)
    for rate, burst in [(4.0, 1.0), (10.0, 0.25), (2.0, 4.0)]:
        gaps = arrival_gaps(40000, rate, burst, rng)
        # gamma(k, theta): mean k*theta = 1/rate, variance k*theta^2 = 1/(rate^2 * k)
        assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
        assert statistics.pvariance(gaps) == pytest.approx(1 / (rate**2 * burst), rel=0.08)
    assert arrival_gaps(3, float("inf"), 1.0, rng) == [0.0, 0.0, 0.0]


def test_summary_statistics_by_hand():
    a = RequestResult(True, "", 0.0, ttft=0.1, latency=0.5, itls=[0.1, 0.2, 0.1], chunk_times=[.1, .2, .4, .5],
                      prompt_len=10, output_tokens=5)
    b = RequestResult(True, "", 0.2, ttft=0.3, latency=0.4, itls=[0.1], chunk_times=[.5, .6],
                      prompt_len=6, output_tokens=2)
    bad = RequestResult(False, "HTTP 400", 0.3)
    s = summarize([a, b, bad], duration=2.0, slos=parse_goodput(["ttft:200", "tpot:150"]), config={})
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 400"]
    assert s["total_output_tokens"] == 7 and s["total_input_tokens"] == 16
    assert s["request_throughput"] == pytest.approx(1.0) and s["output_throughput"] == pytest.approx(3.5)
    # TPOT: a = (0.5 - 0.1) / 4 = 0.1, b = (0.4 - 0.3) / 1 = 0.1
    assert s["mean_tpot_ms"] == pytest.approx(100.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_itl_ms"] == pytest.approx(125.0) and s["p99_itl_ms"] == pytest.approx(197.0)  # numpy's linear interpolation: 100 + 0.97 * 100
    # goodput: a meets ttft 200 ms and tpot 150 ms, b misses ttft (300 ms): 1 request / 2 s
    assert s["request_goodput"] == pytest.approx(0.5)
    assert meets(b, {"itl": 0.1}) and not meets(a, {"itl": 0.15})
    with pytest.raises(ValueError, match="--goodput 'foo:1'"):
        parse_goodput(["foo:1"])



class _ScriptedStream:
    """An httpx client stand-in for run_request: one response whose SSE lines arrive on a fake clock, each
    (seconds after the previous line, line)."""

    def __init__(self, script):
        self.now, self.script, self.status_code = 0.0, script, 200

    def perf_counter(self):
        return self.now

    def stream(self, *args, **kwargs):
        outer = self

        class Context:
            async def __aenter__(self):
                return outer

            async def __aexit__(self, *exc):
                return False
        return Context()

    async def aiter_lines(self):
        for gap, line in self.script:
            self.now += gap
            yield line


def test_bench_serve_times_every_chunk_with_a_choice_as_vllm_does(monkeypatch):
    """vLLM's bench serve times every streamed chunk that has a choice, its text empty or not: a request ending
    on its end-of-sequence token gets a last chunk with empty text (the token's text stays out), and one that
    stops on its first token has nothing else. That request succeeded (it was counted failed, 'no text came
    back'), and the last gap of the other is an ITL (it was left out) inside the end-to-end latency."""
    import types

    from picovllm.bench import serve

    def sse(obj):
        return "data: " + json.dumps(obj)

    def choice(text, finish=None):
        return sse({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})

    def run(script):
        client = _ScriptedStream(script)
        monkeypatch.setattr(serve, "time", types.SimpleNamespace(perf_counter=client.perf_counter))
        return asyncio.run(serve.run_request(client, "u", {"prompt": [1, 2]}, -1.0, {}))

    usage = [(0.0, sse({"choices": [], "usage": {"completion_tokens": 3}})), (0.0, "data: [DONE]")]
    r = run([(0.5, choice("a")), (0.25, choice("b")), (0.125, choice("", "stop"))] + usage)
    assert r.success and r.ttft == 0.5 and r.itls == [0.25, 0.125] and r.latency == 0.875
    assert r.chunk_times == [1.5, 1.75, 1.875] and r.output_tokens == 3
    assert serve.tpot(r) == (0.875 - 0.5) / 2
    r = run([(0.5, choice("", "stop")), (0.0, sse({"choices": [], "usage": {"completion_tokens": 1}})),
             (0.0, "data: [DONE]")])
    assert r.success and r.error == "" and r.ttft == 0.5 and r.itls == [] and r.output_tokens == 1
    r = run(usage)          # no chunk with a choice: failed
    assert not r.success and r.error


# -- fields OpenAI or vLLM define that this server does not honour: refused by name, never ignored -------------------
def _refusal_cases():
    from picovllm.entrypoints.openai import protocol as P
    chat = {"messages": [{"role": "user", "content": "a"}]}
    comp = {"prompt": "a"}
    for base, model, table in [(comp, CompletionRequest, P.REFUSED_COMMON | P.REFUSED_COMPLETION),
                               (chat, ChatCompletionRequest, P.REFUSED_COMMON | P.REFUSED_CHAT)]:
        for name, noop in table.items():
            yield base, model, name, noop


@pytest.mark.parametrize("base,model,name,noop", list(_refusal_cases()),
                         ids=lambda x: x if isinstance(x, str) else None)
def test_every_unhonoured_field_is_refused_by_name(base, model, name, noop):
    import json
    for bad in ({"x": 1}, "yes", 7, [1]):     # never a no-op value of any field
        with pytest.raises(Exception) as e:
            model.model_validate_json(json.dumps({**base, name: bad}))
        assert name in str(e.value) and "not supported" in str(e.value)
    for ok in (None, *noop):                  # asking for nothing is served
        assert getattr(model.model_validate_json(json.dumps({**base, name: ok})), name) == ok


def test_structured_output_fields_become_one_constraint_named_by_its_field():
    chat = '{"messages": [{"role": "user", "content": "a"}], '
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for body, expect in [
        (chat + '"response_format": {"type": "json_object"}}', dict(json_object=True, source="response_format")),
        (chat + '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}'
         % json.dumps(schema), dict(json=schema, source="response_format.json_schema.schema")),
        (chat + '"guided_json": "{}"}', dict(json="{}", source="guided_json")),
        (chat + '"guided_regex": "[a-z]+"}', dict(regex="[a-z]+", source="guided_regex")),
        ('{"prompt": "a", "guided_choice": ["yes", "no"]}', dict(choice=["yes", "no"], source="guided_choice")),
        ('{"prompt": "a", "guided_grammar": "root ::= \\"a\\""}', dict(grammar='root ::= "a"', source="guided_grammar")),
        ('{"prompt": "a", "structured_outputs": {"regex": "b+"}}', dict(regex="b+", source="structured_outputs")),
    ]:
        model = ChatCompletionRequest if body.startswith(chat[:12]) else CompletionRequest
        got = model.model_validate_json(body).sampling_params(4, None).structured_outputs
        assert got == StructuredOutputsParams(**expect), body
    plain = ChatCompletionRequest.model_validate_json(chat + '"response_format": {"type": "text"}}')
    assert plain.sampling_params(4, None).structured_outputs is None


@pytest.mark.parametrize("body,param", [
    ('"guided_regex": "a", "guided_choice": ["b"]', "guided_choice"),
    ('"response_format": {"type": "json_object"}, "guided_json": {}', "guided_json"),
    ('"guided_choice": []', "guided_choice"),
    ('"structured_outputs": {"jsn": {}}', "structured_outputs"),
    ('"structured_outputs": {"json": {}, "regex": "a"}', "structured_outputs"),
    ('"response_format": {"type": "json_schema"}', "response_format"),
    ('"response_format": {"type": "xml"}', "response_format"),
    ('"guided_decoding_backend": "outlines"', "guided_decoding_backend"),
])
def test_bad_structured_output_fields_are_named(body, param):
    with pytest.raises(Exception) as e:
        CompletionRequest.model_validate_json('{"prompt": "a", ' + body + '}').sampling_params(4, None)
    if isinstance(e.value, APIError):
        assert e.value.status == 400 and e.value.param == param
    else:   # pydantic's error (a 400 naming the field in the server)
        assert param in str(e.value)


CUSTOM = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")


def test_chat_template_flag_replaces_the_models_template(tmp_path):
    """--chat-template (a file, or the text itself): the server renders chat with it, as HF's apply_chat_template
    renders the same template (the oracle); neither a file nor Jinja, or Jinja that does not compile, stops the
    command before it loads a model; a P or D server, which reads no OpenAI request, refuses it (and the generation
    config's flags, and --reasoning-parser, whose unknown names the command refuses too, and a model whose tokenizer
    has no think tokens)."""
    import asyncio
    import os
    import subprocess
    import sys

    from serving_fixtures import build_tiny_chat_model

    from picovllm.entrypoints.chat_template import load_chat_template
    from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
    from transformers import AutoTokenizer
    path = build_tiny_chat_model(str(tmp_path / "model"))
    tok = AutoTokenizer.from_pretrained(path)
    (tmp_path / "t.jinja").write_text(CUSTOM)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, how are you?"}]
    want = tok.encode(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, chat_template=CUSTOM),
                      add_special_tokens=False)
    for value in (str(tmp_path / "t.jinja"), CUSTOM):
        worker = TokenizerWorker(tok, load_chat_template(value))
        try:
            assert asyncio.run(worker.encode_chat(conv, True)) == want
        finally:
            worker.shutdown()
    assert want != tok.encode(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    assert tok.chat_template != CUSTOM           # the worker's copy changed, not the tokenizer it was given
    for bad in ("no-such-file.jinja", "{% for m in messages %}"):
        with pytest.raises(ValueError, match="--chat-template"):
            load_chat_template(bad)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    for extra, why in ((["--chat-template", "{% if %}"]), "not a valid Jinja template"), \
            ((["--chat-template", CUSTOM, "--role", "p"]), "reads no OpenAI request"), \
            ((["--override-generation-config", '{"top_k": 5}', "--role", "d"]), "reads no OpenAI request"), \
            ((["--reasoning-parser", "qwen3", "--role", "p"]), "--reasoning-parser: a prefill or decode server"), \
            ((["--reasoning-parser", "qwen"]), "argument --reasoning-parser: invalid choice: 'qwen'"), \
            ((["--reasoning-parser", "qwen3"]), "--reasoning-parser qwen3: the tokenizer has no <think> and"):
        r = subprocess.run([sys.executable, "-m", "picovllm.entrypoints.cli", "serve", "--model", path, *extra],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode != 0 and why in r.stderr, r.stderr[-2000:]
    for command in (["proxy", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"], ["router"]):
        r = subprocess.run([sys.executable, "-m", "picovllm.entrypoints.cli", *command, "--chat-template", "{% if %}"],
                           capture_output=True, text=True, timeout=120, env=env)   # the front ends take it too
        assert r.returncode != 0 and "not a valid Jinja template" in r.stderr, r.stderr[-2000:]


def test_a_server_freezes_what_it_built_before_serving():
    """Full garbage collections scan every tracked object that is not frozen. A serving process freezes what
    exists once its engine and app are built (_Server.run, before uvicorn serves), so the collections it does
    while serving scan only what serving made. Run in a child: freezing here would pin the test process."""
    import subprocess
    import sys
    code = """
import gc, uvicorn
from picovllm.entrypoints.openai import api_server
seen = {}
uvicorn.Server.run = lambda self, sockets=None: seen.setdefault("tracked", len(gc.get_objects()))
before = len(gc.get_objects())
api_server._Server(uvicorn.Config(app=None), engine=None, grace=1.0).run()
print(before, seen["tracked"], gc.get_freeze_count())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, tracked, frozen = map(int, out.stdout.split())
    assert before > 20000 and frozen >= before * 0.9 and tracked < before * 0.05, (before, tracked, frozen)


def test_bench_serve_clients_warm_up_before_the_clock_starts(tmp_path):
    """Each bench serve client process sends one request to each server before the common start, so that its first
    timed request does not pay for the client's own lazy imports and first connection (25-45 ms on this CPU). A stub
    server logs every request: all GETs (the parent's /v1/models and /metrics, one /v1/models per worker and server)
    come before the first completion, and every completion is sent on the workload's schedule."""
    import itertools
    import os
    import subprocess
    import sys
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from picovllm.bench.serve import random_dataset

    log, lock = [], threading.Lock()

    class Stub(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, code, body, kind="application/json"):
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            with lock:
                log.append((time.perf_counter(), "GET", self.path))
            if self.path == "/v1/models":
                self._send(200, json.dumps({"data": [{"id": "stub", "vocab_size": 50}]}).encode())
            else:
                self._send(404, b"{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                log.append((time.perf_counter(), "POST", len(body["prompt"])))
            chunks = [{"choices": [{"text": "a"}]} for _ in range(body["max_tokens"])]
            chunks.append({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
            sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            self._send(200, sse.encode(), "text/event-stream")

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Stub) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        n, rate, workers, seed = 10, 20.0, 2, 5
        urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
        cmd = [sys.executable, "-m", "picovllm.entrypoints.cli", "bench", "serve", "--base-url", *urls,
               "--num-prompts", str(n), "--request-rate", str(rate), "--burstiness", "50", "--input-len", "12",
               "--random-range-ratio", "0.5", "--output-len", "3", "--num-workers", str(workers), "--seed", str(seed),
               "--result-json", str(tmp_path / "b.json")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
    log.sort()
    first_post = next(i for i, (_, method, _) in enumerate(log) if method == "POST")
    gets = [path for _, method, path in log[:first_post]]
    # the parent's /v1/models, its /metrics try (404 here: no counters), then each worker's one to each server
    assert gets.count("/v1/models") == 1 + workers * len(urls), gets
    posts = [(t, plen) for t, method, plen in log if method == "POST"]
    assert len(posts) == n and len(log) == first_post + n    # nothing but the workload after the start
    rng = random.Random(seed)
    want = random_dataset(n, 12, 3, 0.5, 50, rng)
    due = list(itertools.accumulate(arrival_gaps(n, rate, 50.0, rng)))
    # in the schedule's order (burstiness 50: gaps of 50 +- 7 ms), each within 0.15 s of its time after the first
    assert [plen for _, plen in posts] == [len(r.prompt) for r in want]
    t_first = posts[0][0]
    assert all(abs((t - t_first) - (d - due[0])) < 0.15 for (t, _), d in zip(posts, due))
    s = json.loads((tmp_path / "b.json").read_text())
    assert s["completed"] == n and s["prefix_cache_hit_rate"] is None


def test_servers_parse_http_with_httptools_on_uvloop(tmp_path):
    """run_app (every server's) serves on uvloop with httptools' parser, which the serve extra installs: ~20% less
    of the server process's CPU a request than h11 on asyncio (BENCHMARKS.md, twentieth session). Asked of a
    running server: its handler's event loop, and which of uvicorn's HTTP implementations it loaded."""
    import subprocess
    import sys
    import time

    import httpx
    from serving_fixtures import free_port
    port = free_port()
    code = f"""
import asyncio, sys
from fastapi import FastAPI
from picovllm.entrypoints.openai.api_server import ServerSettings, run_app
app = FastAPI()

@app.get("/stack")
async def stack():
    return {{"loop": type(asyncio.get_running_loop()).__module__,
             "http": sorted(m.rsplit(".", 1)[1] for m in sys.modules if m.startswith("uvicorn.protocols.http."))}}

run_app(app, None, ServerSettings(port={port}, log_level="warning"))
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while True:
            try:
                got = httpx.get(f"http://127.0.0.1:{port}/stack", timeout=5).json()
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "slow"
                time.sleep(0.2)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert got["loop"].startswith("uvloop"), got
    assert "httptools_impl" in got["http"] and "h11_impl" not in got["http"], got
    assert proc.returncode == 0 and "install uvloop" not in err, err


def test_a_request_the_engine_ends_in_error_is_a_500_or_an_sse_error(tmp_path, monkeypatch):
    """A request the engine finishes with FinishReason.ERROR (here its grammar refuses every token: a fault put in
    on purpose) reaches the client as a 500 with the engine's reason, or, streamed, as an SSE error event before
    [DONE]; never as a 200 whose finish_reason is "error". Other requests are served; every block is free after."""
    from fastapi.testclient import TestClient

    from picovllm import EngineConfig
    from picovllm.engine.llm_engine import Engine
    from picovllm.entrypoints.openai.api_server import ServerSettings, build_app
    from picovllm.entrypoints.openai.async_engine import AsyncEngine
    from picovllm.entrypoints.openai.metrics import ServerMetrics
    from picovllm.entrypoints.openai.serving import ServingContext
    from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
    from picovllm.layers.structured_output import GrammarState
    from serving_fixtures import build_tiny_chat_model

    engine = Engine(EngineConfig(model=build_tiny_chat_model(str(tmp_path / "model")), num_kv_blocks=64,
                                 max_model_len=256, async_scheduling=False))
    monkeypatch.setattr(GrammarState, "accept", lambda self, token: False)
    ctx = ServingContext(AsyncEngine(engine), TokenizerWorker(engine.tokenizer), ServerMetrics("m"), "m")
    why = "does not match the structured output's grammar"
    guided = {"max_tokens": 4, "guided_choice": ["yes", "no"]}
    with TestClient(build_app(ctx, ServerSettings())) as http:
        for path, body in (("/v1/completions", {"prompt": "hi", **guided}),
                           ("/v1/completions", {"prompt": "hi", "n": 2, "temperature": 1.0, **guided}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **guided})):
            r = http.post(path, json=body)
            assert r.status_code == 500 and why in r.json()["error"]["message"], (path, body, r.text)
            with http.stream("POST", path, json={**body, "stream": True}) as s:
                assert s.status_code == 200
                events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and why in json.loads(events[-2])["error"]["message"], events
            assert all(c.get("finish_reason") != "error" for e in events[:-1] for c in json.loads(e).get("choices", []))
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


_BIG_STARTED, _BIG_RELEASE = threading.Event(), threading.Event()


class _HeldOnBigTexts:
    """A tokenizer (one id a character) whose encode of a big text waits until the test lets it go."""

    def encode(self, text, add_special_tokens=True):
        from picovllm.entrypoints.openai.tokenizer_worker import BIG_PROMPT_CHARS
        if len(text) >= BIG_PROMPT_CHARS:
            _BIG_STARTED.set()
            assert _BIG_RELEASE.wait(30)
        return [ord(c) % 97 for c in text]


def test_a_big_prompt_tokenizing_holds_back_no_other_prompt():
    """A 4 MB prompt tokenizes for seconds; on one worker thread every other request's prompt waited it out. A prompt
    of BIG_PROMPT_CHARS or more goes to a thread of its own: a small one is tokenized (one id a character, the
    oracle) while the big one is still held, and the big one's ids are right once it is let go."""
    from picovllm.entrypoints.openai.tokenizer_worker import BIG_PROMPT_CHARS, TokenizerWorker
    worker = TokenizerWorker(_HeldOnBigTexts())
    big = "ab" * BIG_PROMPT_CHARS

    async def main():
        held = asyncio.ensure_future(worker.encode(big))
        await asyncio.get_running_loop().run_in_executor(None, _BIG_STARTED.wait, 30)
        small = await asyncio.wait_for(worker.encode("hello"), 20)     # while the big one is held
        assert not held.done()
        _BIG_RELEASE.set()
        return small, await asyncio.wait_for(held, 30)

    try:
        small, ids = asyncio.run(main())
    finally:
        _BIG_RELEASE.set()
        worker.shutdown()
    assert small == [ord(c) % 97 for c in "hello"] and ids == [ord(c) % 97 for c in big]
