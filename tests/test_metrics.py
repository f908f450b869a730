"""/metrics on hand-computed cases: every count where the outputs arrive (the engine loop in this process or in its
own), the first token and token gaps of requests that end early, rejected embeddings requests, and vLLM's series
(vllm:*) beside picovllm's with vLLM's meanings, also added up over several API server processes.

Servers here run in-process (TestClient, the engine loop in a thread); the engine process's side of the pipe runs in
a thread on real pipes (ChildLoop), as in test_engine_process.py."""
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from picovllm import EngineConfig, SamplingParams
from picovllm.engine.llm_engine import Engine
from picovllm.entrypoints.openai.api_server import ServerSettings, build_app
from picovllm.entrypoints.openai.async_engine import AsyncEngine
from picovllm.entrypoints.openai.engine_client import EngineReady, EngineStepError
from picovllm.entrypoints.openai.engine_process import ChildLoop, PipeEngineClient
from picovllm.entrypoints.openai.metrics import ServerMetrics
from picovllm.entrypoints.openai.serving import ServingContext
from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
from picovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from conftest import fail_a_launch
from serving_fixtures import chat_model  # noqa: F401 - a fixture

GREEDY = dict(temperature=0, ignore_eos=True)


def values(text: str | bytes) -> dict[str, float]:
    """/metrics' samples by name, a labelled one as name.value.value (its labels but model_name, sorted)."""
    text = text.decode() if isinstance(text, bytes) else text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[".".join([s.name] + [v for k, v in sorted(s.labels.items()) if k != "model_name"])] = s.value
    return out


def engine(model: str, **kw) -> Engine:
    return Engine(EngineConfig(**{"model": model, "block_size": 16, "num_kv_blocks": 64, "max_model_len": 256,
                                  "async_scheduling": False, **kw}))


def app_over(eng: Engine) -> tuple[TestClient, ServerMetrics]:
    metrics = ServerMetrics("m")
    ctx = ServingContext(AsyncEngine(eng, metrics), TokenizerWorker(eng.tokenizer), metrics, "m")
    return TestClient(build_app(ctx, ServerSettings())), metrics


# -- a failed step: one error, wherever the loop runs ---------------------------------------------------------------
@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_failed_step_counts_one_error_wherever_the_loop_runs(chat_model, where):
    """The engine in its own process (serve's default) answers a failed step's requests over the pipe; the server
    counts them there, once (the child's loop has no metrics), as the thread's loop is counted."""
    eng = engine(chat_model)
    calls = fail_a_launch(eng)
    metrics = ServerMetrics("m")
    thread = None
    if where == "process":
        cmd_r, cmd_w = mp.Pipe(duplex=False)
        out_r, out_w = mp.Pipe(duplex=False)
        thread = threading.Thread(target=ChildLoop(eng, cmd_r, out_w)._run, daemon=True)
        thread.start()
        client = PipeEngineClient(cmd_w, out_r, metrics, EngineReady({"max_model_len": 256}, {}, [2]))
    else:
        client = AsyncEngine(eng, metrics)
    params = SamplingParams(max_tokens=6, **GREEDY)

    async def main():
        client.start()
        calls["fail_at"] = calls["n"] + 2        # the prefill gives token 1, the next step fails
        with pytest.raises(EngineStepError, match="injected failure"):
            async for _ in client.generate([5, 6, 7], params, "failed"):
                pass
        async for _ in client.generate([8, 9], params, "served"):
            pass
        await client.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))
    if thread is not None:
        thread.join(10)
    m = values(metrics.render()[0])
    assert (m["picovllm:requests_total.error"], m["picovllm:requests_total.length"]) == (1, 1)
    assert (m["vllm:request_success_total.error"], m["vllm:request_success_total.length"]) == (1, 1)


# -- requests that end early keep their first token and gaps --------------------------------------------------------
def ended(rid: str, reason: str, prompt: int, times: list[float], arrival: float, scheduled: float | None,
          finished: float) -> RequestOutput:
    metrics = RequestMetrics(arrival, scheduled, times[0] if times else None, finished, times)
    return RequestOutput(rid, None, list(range(prompt)), [CompletionOutput(0, "", [7] * len(times), None, None,
                                                                           reason)], True, metrics)


def test_requests_that_end_early_feed_ttft_and_itl():
    """A client that hangs up (abort) or a request the engine fails (error) after its first tokens: they count in
    TTFT and ITL (the slow tail whose clients give up), not in picovllm's e2e (the time the client waited, not the
    server's); vLLM's series counts every end in its e2e, and one token gap a step."""
    metrics = ServerMetrics("m")
    # aborted: first token 0.5 s after arrival, then gaps of 0.25, 0.25 and a speculative step's second token (0)
    metrics.observe_finished(ended("a", "abort", 3, [100.5, 100.75, 101.0, 101.0], 100.0, 100.25, 101.5))
    metrics.observe_finished(ended("e", "error", 5, [200.25, 200.5], 200.0, 200.125, 201.0))
    metrics.observe_finished(ended("w", "abort", 4, [], 300.0, None, 300.1))    # left while it waited
    m = values(metrics.render()[0])
    assert (m["picovllm:requests_total.abort"], m["picovllm:requests_total.error"]) == (2, 1)
    assert (m["picovllm:time_to_first_token_seconds_count"], m["picovllm:time_to_first_token_seconds_sum"]) == \
        (2, 0.75)
    assert (m["picovllm:inter_token_latency_seconds_count"], m["picovllm:inter_token_latency_seconds_sum"]) == \
        (4, 0.75)
    assert m["picovllm:e2e_request_latency_seconds_count"] == 0
    assert (m["vllm:request_success_total.abort"], m["vllm:request_success_total.error"]) == (2, 1)
    assert (m["vllm:time_to_first_token_seconds_count"], m["vllm:time_to_first_token_seconds_sum"]) == (2, 0.75)
    assert (m["vllm:inter_token_latency_seconds_count"], m["vllm:inter_token_latency_seconds_sum"]) == (3, 0.75)
    assert m["vllm:e2e_request_latency_seconds_count"] == 3
    assert m["vllm:e2e_request_latency_seconds_sum"] == pytest.approx(1.5 + 1.0 + 0.1)
    assert (m["vllm:request_queue_time_seconds_count"], m["vllm:request_queue_time_seconds_sum"]) == (2, 0.375)
    assert m["vllm:prompt_tokens_total"] == 3 + 5          # the third's prompt was never computed
    assert m["vllm:generation_tokens_total"] == 4 + 2
    assert (m["vllm:request_prompt_tokens_count"], m["vllm:request_prompt_tokens_sum"]) == (3, 3 + 5 + 4)


def test_a_stream_the_client_leaves_keeps_its_first_token_and_gaps(chat_model):
    """The same through the engine loop: a stream closed after three outputs is aborted, and its TTFT and its
    tokens' gaps (one fewer than its tokens, one a step) are observed."""
    metrics = ServerMetrics("m")
    client = AsyncEngine(engine(chat_model), metrics)

    async def main():
        client.start()
        stream = await client.add_request([5, 6, 7], SamplingParams(max_tokens=200, **GREEDY), "leaver")
        seen = 0
        async for _ in stream.outputs():
            seen += 1
            if seen == 3:
                break
        stream.close()      # the client has gone: the request is aborted
        while values(metrics.render()[0])["picovllm:requests_total.abort"] == 0:
            await asyncio.sleep(0.01)
        await client.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))
    m = values(metrics.render()[0])
    tokens = m["vllm:generation_tokens_total"]
    assert 3 <= tokens < 200 and m["vllm:request_success_total.abort"] == 1
    assert m["picovllm:time_to_first_token_seconds_count"] == m["vllm:time_to_first_token_seconds_count"] == 1
    assert m["picovllm:inter_token_latency_seconds_count"] == m["vllm:inter_token_latency_seconds_count"] == tokens - 1
    assert m["picovllm:e2e_request_latency_seconds_count"] == 0 and m["vllm:e2e_request_latency_seconds_count"] == 1


# -- a pooling server's rejections --------------------------------------------------------------------------------
def test_a_pooling_servers_rejected_embeddings_are_counted(chat_model):
    client, metrics = app_over(engine(chat_model, runner="pooling"))
    with client as c:
        assert c.post("/v1/embeddings", json={"input": [[5, 6, 7], [8, 9]]}).status_code == 200
        bad = [c.post("/v1/embeddings", json={"input": "hi", "dimensions": 3}),
               c.post("/v1/embeddings", json={"input": "hi", "model": "nope"}),
               c.post("/v1/embeddings", json={"input": []})]
        assert [r.status_code for r in bad] == [400, 404, 400]
        m = values(c.get("/metrics").text)
    assert (m["picovllm:requests_total.rejected"], m["picovllm:requests_total.stop"]) == (3, 2)
    assert m["vllm:request_success_total.stop"] == 2 and m["vllm:prompt_tokens_total"] == 3 + 2
    assert m["vllm:generation_tokens_total"] == 0 and m["vllm:time_to_first_token_seconds_count"] == 0


def test_refusals_before_the_app_count_as_rejected(chat_model):
    """A body over the limit is refused by the middleware when its Content-Length says so, by the app's body reader
    when it streams in chunked, and a missing API key by the middleware: each a 4xx of a request route, counted as
    rejected whoever answered it (a 413 counted only without Content-Length had left the others out). A 413 of a
    route that is no request (/tokenize) is not counted."""
    eng = engine(chat_model)
    metrics = ServerMetrics("m")
    ctx = ServingContext(AsyncEngine(eng, metrics), TokenizerWorker(eng.tokenizer), metrics, "m")
    key = {"Authorization": "Bearer k", "content-type": "application/json"}
    big = json.dumps({"prompt": "x" * 2000}).encode()
    statuses = []
    with TestClient(build_app(ctx, ServerSettings(max_request_bytes=1000, api_key="k"))) as c:
        for route in ("/v1/completions", "/v1/chat/completions"):
            statuses.append(c.post(route, content=big, headers=key).status_code)
            statuses.append(c.post(route, content=(big[i:i + 500] for i in range(0, len(big), 500)),
                                   headers=key).status_code)
            statuses.append(c.post(route, json={"prompt": "hi"}).status_code)
        assert c.post("/tokenize", content=big, headers=key).status_code == 413
        m = values(c.get("/metrics").text)
    assert statuses == [413, 413, 401] * 2
    assert m["picovllm:requests_total.rejected"] == len(statuses)
    assert sum(m[f"vllm:request_success_total.{r}"] for r in ("stop", "length", "abort", "error")) == 0


# -- vLLM's series -----------------------------------------------------------------------------------------------------
def test_vllm_series_count_as_vllm_does(chat_model):
    """Five completions of known lengths (the last two the same 40-token prompt: the second finds its first two
    16-token blocks cached) and one rejected: vLLM's counters hand-computed. Every prompt token counts, cached or
    not; every generated token, the first included; one gap a token after the first."""
    client, metrics = app_over(engine(chat_model))
    cases = [(list(range(3, 3 + n)), 5) for n in (4, 7, 10)] + [(list(range(100, 140)), 2)] * 2
    with client as c:
        for prompt, n in cases:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, **GREEDY})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n, r.text
        assert c.post("/v1/completions", json={"prompt": [5, 6], "top_p": 7}).status_code == 400
        m = values(c.get("/metrics").text)
    prompts, generated = 4 + 7 + 10 + 40 + 40, 3 * 5 + 2 * 2
    assert m["vllm:prompt_tokens_total"] == m["vllm:request_prompt_tokens_sum"] == prompts
    assert m["vllm:generation_tokens_total"] == m["vllm:request_generation_tokens_sum"] == generated
    assert m["vllm:request_prompt_tokens_count"] == m["vllm:request_generation_tokens_count"] == 5
    assert m["vllm:request_generation_tokens_bucket.5.0"] == 5 and m["vllm:request_generation_tokens_bucket.2.0"] == 2
    assert {r: m[f"vllm:request_success_total.{r}"] for r in ("stop", "length", "abort", "error")} == \
        {"stop": 0, "length": 5, "abort": 0, "error": 0}        # the rejected one never reached the engine
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert m[f"vllm:{h}_count"] == 5, h
    assert m["vllm:inter_token_latency_seconds_count"] == generated - 5
    assert (m["vllm:prefix_cache_queries_total"], m["vllm:prefix_cache_hits_total"]) == (prompts, 32)
    assert m["vllm:num_preemptions_total"] == 0
    assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == m["vllm:kv_cache_usage_perc"] == 0
    assert m["picovllm:requests_total.length"] == 5 and m["picovllm:requests_total.rejected"] == 1   # still there


def test_preemptions_and_prefix_lookups_count_as_vllm_does(chat_model):
    """Two requests of 16 prompt and 40 generated tokens in 5 blocks of 16: at their 33rd token both need a third
    block, one is free, so the later one (b) is preempted, once. Its two cached blocks are freed tail first, and a's
    fourth block evicts that tail (16-31), so b's lookup when it comes back (33 tokens, 2 full blocks) hits 16.
    picovllm counts that lookup; vLLM leaves a preempted request's lookups out of vllm:prefix_cache_*."""
    eng = engine(chat_model, num_kv_blocks=5, max_model_len=64)
    params = SamplingParams(max_tokens=40, **GREEDY)
    eng.add_request(list(range(10, 26)), params, "a")
    eng.add_request(list(range(50, 66)), params, "b")
    ends = []
    while eng.has_unfinished_requests():
        ends += [out.outputs[0].finish_reason for out in eng.step() if out.finished]
    assert ends == ["length", "length"]
    metrics = ServerMetrics("m")
    AsyncEngine(eng, metrics)           # publishes the engine's stats
    m = values(metrics.render()[0])
    assert m["vllm:num_preemptions_total"] == 1
    assert (m["picovllm:prefix_cache_queries_total"], m["picovllm:prefix_cache_hits_total"]) == (16 + 16 + 33, 16)
    assert (m["vllm:prefix_cache_queries_total"], m["vllm:prefix_cache_hits_total"]) == (16 + 16, 0)


def test_prompt_logprobs_requests_are_no_prefix_cache_lookups(chat_model):
    """A request that scores its prompt (prompt_logprobs, or echo with logprobs: OpenAI's prompt scoring) takes no
    block from the prefix cache (cached positions have no logits), so, as vLLM's (skip_reading_prefix_cache), its
    prompt is no lookup: the counters' queries are the prompt tokens of the requests that could hit, and their hits
    the cached tokens those requests' usage reports."""
    client, _ = app_over(engine(chat_model))
    prompt = list(range(3, 40))          # two full 16-token blocks, cached by the first request
    looked_up = cached = 0
    with client as c:
        for scoring in ({}, {"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}, {}):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, **scoring, **GREEDY})
            assert r.status_code == 200, r.text
            use = r.json()["usage"]
            cached += use["prompt_tokens_details"]["cached_tokens"]
            looked_up += 0 if scoring else use["prompt_tokens"]
        m = values(c.get("/metrics").text)
    assert cached == 32
    assert (m["vllm:prefix_cache_queries_total"], m["vllm:prefix_cache_hits_total"]) == (looked_up, cached)
    assert (m["picovllm:prefix_cache_queries_total"], m["picovllm:prefix_cache_hits_total"]) == (looked_up, cached)


WRITER = textwrap.dedent("""
    import sys
    from picovllm.entrypoints.openai.engine_client import EngineStats
    from picovllm.entrypoints.openai.metrics import ServerMetrics
    from picovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
    k = int(sys.argv[1])
    metrics = ServerMetrics("m")
    metrics.observe_engine(EngineStats(num_running=2 * k - 1, num_free_blocks=4 - k, num_blocks=4,
                                       preemptions=2 if k == 1 else 0))
    times = [10.5, 10.75]
    metrics.observe_finished(RequestOutput("r", None, [1, 2, 3, 4], [CompletionOutput(0, "", [7, 7], None, None,
                                           "length")], True, RequestMetrics(10.0, 10.25, 10.5, 11.0, times)))
    metrics.count_outcome("rejected")
""")


def test_vllm_series_add_up_over_api_server_processes(tmp_path, monkeypatch):
    """--api-server-count: each API server process writes its files; /metrics in any adds counters and histograms
    up, and takes gauges' maximum (API server 1 alone publishes the engine's stats; here both do, with other
    values)."""
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1])] + sys.path))
    for k in (1, 2):
        subprocess.run([sys.executable, "-c", WRITER, str(k)], env=env, check=True, timeout=60)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    m = values(ServerMetrics("m").render()[0])
    assert m["vllm:num_requests_running"] == 3 and m["vllm:kv_cache_usage_perc"] == 0.5
    assert m["vllm:num_preemptions_total"] == 2
    assert (m["vllm:request_success_total.length"], m["picovllm:requests_total.rejected"]) == (2, 2)
    assert (m["vllm:prompt_tokens_total"], m["vllm:generation_tokens_total"]) == (8, 4)
    assert (m["vllm:time_to_first_token_seconds_count"], m["vllm:time_to_first_token_seconds_sum"]) == (2, 1.0)
    assert (m["vllm:inter_token_latency_seconds_count"], m["vllm:e2e_request_latency_seconds_sum"]) == (2, 2.0)


def test_bench_reads_one_prefix_counter_name_a_server(monkeypatch):
    """bench serve's prefix-cache reading takes picovllm's counters where a server has both names (it had added
    picovllm's and vLLM's: every query and hit twice), and vLLM's from a server that has only those."""
    import httpx
    from picovllm.bench.serve import prefix_cache_counters
    texts = {"http://a": "picovllm:prefix_cache_queries_total 100\npicovllm:prefix_cache_hits_total 40\n"
                         "vllm:prefix_cache_queries_total 90\nvllm:prefix_cache_hits_total 35\n",
             "http://b": "vllm:prefix_cache_queries_total 10\nvllm:prefix_cache_hits_total 5\n"}
    monkeypatch.setattr(httpx, "get", lambda url, **kw: httpx.Response(200, text=texts[url.rsplit("/", 1)[0]]))
    assert prefix_cache_counters(["http://a"], {}, 1.0) == {"queries": 100.0, "hits": 40.0}
    assert prefix_cache_counters(["http://a", "http://b"], {}, 1.0) == {"queries": 110.0, "hits": 45.0}
