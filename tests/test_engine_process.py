"""`picovllm serve`'s engine loop in a child process (the default, --engine-process), the HTTP side in the parent.

Oracle: LLM.generate / LLM.chat in this process on the same model. Also: an engine-side refusal is still a 400
naming the field, a client that hangs up frees its blocks, the engine's metrics reach /metrics, a dead child fails
in-flight streams cleanly, and SIGTERM stops both processes (the module server's teardown). The loop as a thread
(--no-engine-process): test_server_units.py's chat-template server (colocated), test_pd_serving.py and
test_pd_router.py (P and D servers).
"""
import json
import os
import shutil
import signal
import time

import httpx
import openai
import pytest

from picovllm import LLM, SamplingParams
from conftest import fail_a_launch
from serving_fixtures import ServerProcess, chat_model  # noqa: F401 - a fixture
from test_server_lifecycle import assert_exited, children_of

ENGINE_ARGS = ["--block-size", "16", "--num-kv-blocks", "512", "--max-model-len", "256"]
PROCESS = "--engine-process"     # serve's default; serving_fixtures' servers run the thread unless told
PROMPTS = ["Hello, how are you", "The capital of France is", "Numbers: 0 1 2"]


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    """The module's server (the default: the engine in a process of its own); at the end, SIGTERM must stop every
    process of it."""
    srv = ServerProcess(chat_model, str(tmp_path_factory.mktemp("log") / "server.log"), *ENGINE_ARGS, PROCESS)
    kids = children_of(srv.proc.pid)
    engine_child(srv)
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.log()
    assert_exited(kids)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def spawned(pid: int) -> list[int]:
    """A server's spawned children, oldest first: its engine's process, then any API servers (not multiprocessing's
    resource tracker)."""
    out = []
    for child in children_of(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    with open(f"/proc/{child}/stat") as st:
                        out.append((int(st.read().rsplit(")", 1)[1].split()[19]), child))     # start time
        except OSError:     # gone meanwhile
            pass
    return [child for _, child in sorted(out)]


def engine_child(server) -> int:
    """The engine's process among the server's children (the other is multiprocessing's resource tracker)."""
    kids = spawned(server.proc.pid)
    assert kids, "no engine process"
    return kids[0]


def test_outputs_equal_the_offline_api(server, client, chat_model):
    llm = LLM(chat_model, block_size=16, num_kv_blocks=512, max_model_len=256)
    model = client.models.list().data[0]
    assert model.max_model_len == 256 and model.vocab_size == llm.engine.model_config.vocab_size
    ref = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, logprobs=1), use_tqdm=False)
    for prompt, r in zip(PROMPTS, ref):
        got = client.completions.create(model=model.id, prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
        assert got.choices[0].text == r.outputs[0].text
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(
            [d[t].logprob for d, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)], abs=1e-4)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model.id, prompt=prompt, max_tokens=12, temperature=0, stream=True) if c.choices)
        assert streamed == r.outputs[0].text
    conv = [{"role": "user", "content": "Tell me a story about a cat"}]
    want = llm.chat(conv, SamplingParams(temperature=0.8, seed=3, max_tokens=10), use_tqdm=False)[0].outputs[0]
    got = client.chat.completions.create(model=model.id, messages=conv, temperature=0.8, seed=3, max_tokens=10)
    assert got.choices[0].message.content == want.text
    m = server.wait_idle()
    assert m["picovllm:requests_total.length"] >= 2 * len(PROMPTS) + 1     # finished requests counted by the parent
    assert m["picovllm:decode_tokens_total"] > 0                            # the child's stats


def test_beam_search_through_the_process(server, client, chat_model):
    """The beams need the engine's end-of-sequence ids, which the engine process sends when it is ready."""
    from picovllm import BeamSearchParams
    llm = LLM(chat_model, block_size=16, num_kv_blocks=512, max_model_len=256)
    want = llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=2, max_tokens=6))[0].sequences
    got = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[1], n=2, max_tokens=6,
                                    extra_body={"use_beam_search": True})
    assert [c.text for c in got.choices] == [b.text for b in want]
    server.wait_idle()


def test_engine_refusals_and_hang_ups(server, client, chat_model):
    model = client.models.list().data[0]
    with pytest.raises(openai.BadRequestError) as e:       # checked by the engine, in the child
        client.completions.create(model=model.id, prompt="Hi", max_tokens=2,
                                  extra_body={"allowed_token_ids": [model.vocab_size + 5]})
    assert e.value.body["param"] == "allowed_token_ids"
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"prompt": "Hello", "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break                                       # hang up after the first chunk
    server.wait_idle()                                            # the abort reached the child: every block is free


def test_a_dead_engine_process_fails_streams_and_health(chat_model, tmp_path):
    srv = ServerProcess(chat_model, str(tmp_path / "server.log"), *ENGINE_ARGS, PROCESS)
    try:
        child = engine_child(srv)
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={"prompt": "Hello", "max_tokens": 240, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            os.kill(child, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2], rest[-3:]     # ended with an error, not cut
        # then the server ends, exit 1, as vLLM's does (and as several API servers do): a supervisor restarts it
        assert srv.proc.wait(30) == 1, srv.log()
    finally:
        srv.stop()


@pytest.mark.parametrize("engine_deltas", [False, True])
def test_output_deltas_rebuild_every_output(chat_model, engine_deltas):
    """What crosses the pipe each step is what changed: decoded, every engine output equals the original (the
    metrics ride with the last one only), through stop strings that trim the text, logprobs, prompt logprobs that
    grow over prefill chunks, and an abort. engine_deltas (a colocated engine process's way): the engine makes
    DELTA outputs of its CUMULATIVE requests (Engine.stream_deltas), and decoded they equal the cumulative outputs of
    a twin engine stepped in lockstep."""
    import dataclasses
    from picovllm.entrypoints.openai.engine_client import OutputDelta
    from picovllm.entrypoints.openai.output_deltas import OutputDeltas, OutputsFromDeltas
    from picovllm.outputs import RequestOutput
    args = dict(block_size=16, num_kv_blocks=512, max_model_len=256, max_num_batched_tokens=8)
    llm = LLM(chat_model, **args)
    eng, enc, dec = llm.engine, OutputDeltas(engine_deltas), OutputsFromDeltas()
    twin = LLM(chat_model, **args).engine if engine_deltas else None
    eng.stream_deltas = engine_deltas
    tok = llm.get_tokenizer()
    plain = llm.generate(["Tell me a story"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    stop = plain.outputs[0].text[6:9]                  # a stop string the greedy text runs into
    for e in (eng, twin) if twin else (eng,):
        e.add_request("Tell me a story", SamplingParams(temperature=0, max_tokens=12, stop=[stop]), "stop")
        e.add_request(tok.encode("Numbers: 0 1 2 3 4 5"), SamplingParams(temperature=0.9, seed=1, max_tokens=10,
                                                                         logprobs=2, prompt_logprobs=1), "scored")
        e.add_request("Hello there", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), "aborted")
    seen, kinds, held = 0, set(), []
    for step in range(200):
        outs = eng.step()
        wants = twin.step() if twin else outs
        scored = eng.requests.get("scored")
        if engine_deltas and scored is not None:    # positions out already: let go (not walked by the collector)
            assert all(d is None for d in scored.logprobs[:scored.num_streamed_tokens])
            assert all(d is not None for d in scored.logprobs[scored.num_streamed_tokens:])
        if step == 6:
            outs.append(eng.abort("aborted"))
            if twin:
                wants.append(twin.abort("aborted"))
        assert len(outs) == len(wants)
        for made, want in zip(outs, wants):     # want: the cumulative output (the twin's, under engine_deltas)
            msg = enc.encode(made)
            kinds.add(type(msg))
            got = dec.decode(msg)
            assert (got.metrics is not None) == (want.metrics is not None)
            if not want.finished or engine_deltas:      # (the twin's timings are its own)
                got, want = dataclasses.replace(got, metrics=None), dataclasses.replace(want, metrics=None)
            assert got == want, (step, want.request_id)
            held.append((got, want))      # (the engine's outputs: lists of their own)
            seen += 1
        if not eng.has_unfinished_requests():
            break
    assert kinds == {RequestOutput, OutputDelta} and seen > 20
    # each decoded output is a snapshot: the deltas decoded after it (which extend its request's lists in place,
    # OutputsFromDeltas) left it as it was
    assert all(got == want for got, want in held)
    assert not enc._sent and not enc._chars and not dec._so_far      # nothing kept for finished requests


def test_a_failed_step_leaves_no_delta_state_behind(chat_model):
    """The engine-process pipe sends outputs as deltas against what each end saw last. A step that fails answers
    its requests with the exception: both ends must forget them, or a later request with the same id (a client
    retrying with its own request_id) is decoded against the dead one's prompt and tokens. The engine loop runs
    in a thread on real pipes; the oracle is LLM.generate of the retried prompt."""
    import asyncio
    import multiprocessing as mp
    import threading

    from picovllm.entrypoints.openai.engine_client import EngineReady, EngineStepError
    from picovllm.entrypoints.openai.engine_process import ChildLoop, PipeEngineClient
    llm = LLM(chat_model, block_size=16, num_kv_blocks=64, max_model_len=256, async_scheduling=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first, retried = [5, 6, 7, 8, 9], [100, 101, 102, 103, 104, 105, 106]
    want = llm.generate([retried], params, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    calls = fail_a_launch(engine)
    cmd_r, cmd_w = mp.Pipe(duplex=False)
    out_r, out_w = mp.Pipe(duplex=False)
    loop = ChildLoop(engine, cmd_r, out_w)
    thread = threading.Thread(target=loop._run, daemon=True)
    thread.start()

    async def main():
        client = PipeEngineClient(cmd_w, out_r, None, EngineReady({"max_model_len": 256}, {}, [2]))
        client.start()
        calls["fail_at"] = calls["n"] + 2        # the prefill gives token 1, the next step fails
        with pytest.raises(EngineStepError, match="injected failure"):
            async for _ in client.generate(first, params, "my-id"):
                pass
        last = None
        async for last in client.generate(retried, params, "my-id"):
            pass
        state = (dict(loop._deltas._sent), dict(client._outputs._so_far))
        await client.shutdown()
        return last, state

    last, state = asyncio.run(asyncio.wait_for(main(), 60))
    thread.join(10)
    assert last.prompt_token_ids == retried and last.outputs[0].token_ids == want
    assert state == ({}, {})


def test_delta_outputs_cross_the_pipe_whole(chat_model):
    """A DELTA request's outputs each hold only what is new: the pipe's encoder took them for cumulative ones and
    sent what they held past the last one's length, nothing (every token after the first was lost). Through a
    ChildLoop on real pipes, a reader that keeps up and one that reads only after the request finished (its unread
    deltas merged) both get every token, text and logprob; the oracle is LLM.generate's FINAL_ONLY output."""
    import asyncio
    import multiprocessing as mp
    import threading

    from picovllm.entrypoints.openai.engine_client import EngineReady
    from picovllm.entrypoints.openai.engine_process import ChildLoop, PipeEngineClient
    from picovllm.sampling_params import RequestOutputKind
    llm = LLM(chat_model, block_size=16, num_kv_blocks=64, max_model_len=256)
    prompt = [5, 6, 7, 8, 9]

    def params(kind):
        return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, output_kind=kind)
    want = llm.generate([prompt], params(RequestOutputKind.FINAL_ONLY), use_tqdm=False)[0].outputs[0]
    cmd_r, cmd_w = mp.Pipe(duplex=False)
    out_r, out_w = mp.Pipe(duplex=False)
    loop = ChildLoop(llm.engine, cmd_r, out_w)
    thread = threading.Thread(target=loop._run, daemon=True)
    thread.start()

    async def main():
        client = PipeEngineClient(cmd_w, out_r, None, EngineReady({"max_model_len": 256}, {}, [2]))
        client.start()
        fast = [o async for o in client.generate(prompt, params(RequestOutputKind.DELTA), "fast")]
        stream = await client.add_request(prompt, params(RequestOutputKind.DELTA), "slow")
        for _ in range(600):             # read nothing until the request has finished
            if "slow" not in client._streams:
                break
            await asyncio.sleep(0.05)
        slow = [o async for o in stream.outputs()]
        state = (dict(loop._deltas._sent), set(loop._deltas._whole), dict(client._outputs._so_far))
        await client.shutdown()
        return fast, slow, state

    fast, slow, state = asyncio.run(asyncio.wait_for(main(), 60))
    thread.join(10)
    for outs in (fast, slow):      # (the fast reader too may find several deltas merged: the loop runs ahead)
        pieces = [o.outputs[0] for o in outs]
        assert [t for p in pieces for t in p.token_ids] == want.token_ids
        assert "".join(p.text for p in pieces) == want.text
        assert [lp for p in pieces for lp in p.logprobs] == want.logprobs
        assert outs[-1].finished and pieces[-1].finish_reason == "length"
    assert state == ({}, set(), {})


@pytest.mark.parametrize("api_servers", [[], ["--api-server-count", "2"]], ids=["one", "two-api-servers"])
def test_a_model_the_engine_refuses_ends_the_server_as_the_thread_does(chat_model, tmp_path, api_servers):
    """Engine() raising in the child: the command line reports it as it reports the thread's (exit 2, the reason),
    and with several API servers (started while the engine is built) no process is left. The model's tokenizer
    loads (the server's side gets that far) and its weights do not fit its config (the engine's side fails)."""
    bad = tmp_path / "model"
    shutil.copytree(chat_model, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * config["hidden_size"]}))
    srv = ServerProcess(str(bad), str(tmp_path / "server.log"), PROCESS, *api_servers, startup_timeout=None)
    kids, deadline = [], time.time() + 60
    while len(kids) < (3 if api_servers else 1) and srv.proc.poll() is None and time.time() < deadline:
        kids = spawned(srv.proc.pid)        # the engine (and the API servers) import torch before it fails
        time.sleep(0.05)
    assert kids, "no process was spawned"
    assert srv.proc.wait(120) == 2
    assert "serve: error: weight lm_head.weight: shape mismatch" in srv.log()
    assert_exited(kids)


def test_the_thread_mode_serves_as_the_offline_api(chat_model, tmp_path):
    """--no-engine-process: the loop as a thread in the server's process (no child), the same outputs."""
    llm = LLM(chat_model, block_size=16, num_kv_blocks=512, max_model_len=256)
    srv = ServerProcess(chat_model, str(tmp_path / "server.log"), *ENGINE_ARGS, "--no-engine-process")
    try:
        assert not children_of(srv.proc.pid), "a thread-mode server started a process"
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        ref = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
        assert client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12,
                                         temperature=0).choices[0].text == ref.text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True) if c.choices)
        assert streamed == ref.text
        srv.wait_idle()
    finally:
        assert srv.stop(signal.SIGTERM) == 0, srv.log()


def test_metrics_show_the_kv_cache_before_any_request(chat_model):
    """The engine in a process of its own: /metrics has the cache's blocks (all free) from the start, as the thread
    mode has (they read 0 until the first request's step: a fresh server looked full to a dashboard)."""
    from fastapi.testclient import TestClient
    from picovllm import EngineConfig
    from picovllm.entrypoints.openai.api_server import ServerSettings, app_for
    config = EngineConfig(model=chat_model, num_kv_blocks=64, max_model_len=256)
    app, _, stop = app_for(config, ServerSettings(served_model_name="m"))
    try:
        with TestClient(app) as http:
            deadline = time.time() + 30
            while True:
                lines = [line for line in http.get("/metrics").text.splitlines()
                         if line.startswith("picovllm:kv_cache_")]
                blocks = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in lines if "_blocks" in line}
                if blocks.get("picovllm:kv_cache_num_blocks") or time.time() > deadline:
                    break
                time.sleep(0.1)
            assert blocks == {"picovllm:kv_cache_num_blocks": 64.0, "picovllm:kv_cache_free_blocks": 64.0}, lines
    finally:
        stop()


def test_a_refused_add_leaves_the_running_requests_deltas():
    """A second add under a running request's id is refused at once (SharedPipeEnds answers it ahead of outputs
    encoded before): the refusal, a ValueError, leaves that request's delta state on both ends, so its next delta
    still decodes (it had been forgotten: a KeyError that killed the API server's reader thread); an EngineStepError
    ends the request, and then its state goes."""
    from picovllm.entrypoints.openai.engine_client import CommandAnswer, EngineStepError, OutputDelta
    from picovllm.entrypoints.openai.output_deltas import OutputDeltas, OutputsFromDeltas
    from picovllm.outputs import CompletionOutput, RequestOutput

    def out(text: str, ids: list[int], finished: bool = False) -> RequestOutput:
        return RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, ids, None, None,
                                                                  "stop" if finished else None)], finished)
    enc, dec = OutputDeltas(), OutputsFromDeltas()
    first, second = enc.encode(out("a", [5])), enc.encode(out("ab", [5, 6]))
    refusal = enc.encode(CommandAnswer("r", ValueError("request_id 'r' is already in use")))
    last = enc.encode(out("abc", [5, 6, 7], True))
    assert type(second) is type(last) is OutputDelta
    got = [dec.decode(m) for m in (first, refusal, second, last)]
    assert [o.outputs[0].text for o in (got[0], got[2], got[3])] == ["a", "ab", "abc"] and got[3].finished
    assert got[3].outputs[0].token_ids == [5, 6, 7] and isinstance(got[1].error, ValueError)
    enc.encode(out("a", [5]))
    assert isinstance(enc.encode(CommandAnswer("r", EngineStepError("step failed"))), CommandAnswer)
    assert isinstance(enc.encode(out("x", [9])), RequestOutput)     # a new request under the id: sent whole


def test_the_reader_thread_outlives_a_closed_event_loop_quietly():
    """run-batch --engine-process under Ctrl-C: asyncio.run is interrupted and closes its loop, then the engine
    process (which ignores SIGINT) ends and closes its pipe. The reader thread handed that end to the closed loop:
    `Exception in thread picovllm-engine-reader: RuntimeError: Event loop is closed`, a traceback on the way out."""
    import asyncio
    import multiprocessing as mp
    import threading

    from picovllm.entrypoints.openai.engine_client import EngineReady
    from picovllm.entrypoints.openai.engine_process import PipeEngineClient
    cmd_r, cmd_w = mp.Pipe(duplex=False)
    out_r, out_w = mp.Pipe(duplex=False)
    client = PipeEngineClient(cmd_w, out_r, None, EngineReady({"max_model_len": 256}, {}, [2]))

    async def main():
        client.start()

    asyncio.run(main())          # the loop is closed, the reader still waits on the pipe
    failures = []
    old_hook, threading.excepthook = threading.excepthook, failures.append
    try:
        out_w.close()            # the engine process ends
        client._reader.join(10)
    finally:
        threading.excepthook = old_hook
    assert not client._reader.is_alive()
    assert not failures, [f.exc_value for f in failures]
