"""A server that runs for weeks: whatever it keeps per request is let go when the request ends, however it ends.

Oracle: the containers keyed by request id (the event loop's streams, the engine loop's grammars compiling, the
engine's requests and queues, an engine process's pipe maps on both ends) are back to empty once every request has
ended, and every KV block is free (conftest's no_kv_leaks checks the engines at each test's end). The requests end
every way a server sees: finished, stopped by a stop string, n > 1, a grammar, a client that leaves mid-stream, a
400 from the server or the engine, and a failed engine step, the last also while the client leaves.

Servers here run in-process: uvicorn in a thread over the engine loop in a thread, or the engine process's loop
(ChildLoop) in a thread on real pipes, as in test_metrics.py."""
import asyncio
import multiprocessing as mp
import threading
import time

import httpx
import pytest
import uvicorn

from picovllm import EngineConfig, SamplingParams
from picovllm.engine.llm_engine import Engine
from picovllm.entrypoints.openai.api_server import ServerSettings, build_app
from picovllm.entrypoints.openai.async_engine import AsyncEngine
from picovllm.entrypoints.openai.engine_client import EngineReady, EngineStepError
from picovllm.entrypoints.openai.engine_process import ChildLoop, PipeEngineClient
from picovllm.entrypoints.openai.metrics import ServerMetrics
from picovllm.entrypoints.openai.serving import ServingContext
from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
from serving_fixtures import chat_model, free_port  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = dict(temperature=0, ignore_eos=True)


class Served:
    """An engine behind its loop (a thread, or ChildLoop on pipes as an engine process runs it) and its client."""

    def __init__(self, model: str, where: str, **engine_kw) -> None:
        self.engine = Engine(EngineConfig(**{"model": model, "block_size": 16, "num_kv_blocks": 128,
                                             "max_model_len": 256, **engine_kw}))
        self.child = self.thread = None
        if where == "process":
            cmd_r, cmd_w = mp.Pipe(duplex=False)
            out_r, out_w = mp.Pipe(duplex=False)
            self.child = self.loop = ChildLoop(self.engine, cmd_r, out_w)
            self.thread = threading.Thread(target=self.child._run, daemon=True)
            self.thread.start()
            ready = EngineReady(self.child.model_info(), {}, self.child.eos_token_ids())
            self.client = PipeEngineClient(cmd_w, out_r, ServerMetrics("m"), ready)
        else:
            self.client = self.loop = AsyncEngine(self.engine, ServerMetrics("m"))

    def kept(self) -> dict[str, int]:
        """The sizes of what is kept per request; all 0 when none is in flight."""
        eng = self.engine
        sizes = {"streams": len(self.client._streams), "compiling": len(self.loop._compiling),
                 "delta ids": len(getattr(self.client, "_delta_ids", ())),     # AsyncEngine's, where it has them
                 "engine.requests": len(eng.requests), "waiting": len(eng.scheduler.waiting),
                 "running": len(eng.scheduler.running), "held": len(eng.scheduler.held),
                 "blocks held": eng.block_manager.num_blocks - eng.block_manager.num_free_blocks}
        if self.child is not None:
            sizes.update({"deltas sent": len(self.child._deltas._sent),
                          "outputs so far": len(self.client._outputs._so_far)})
        return sizes

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(10)


def launches_calling(engine: Engine, at: int, before_failing) -> dict:
    """Engine's launch number `at` (counted from now) calls before_failing() and then raises RuntimeError("injected
    failure"); returns {"n": launches so far}."""
    real, calls = engine.runner.launch, {"n": 0}

    def flaky(step, *args):
        calls["n"] += 1
        if calls["n"] == at:
            before_failing()
            raise RuntimeError("injected failure")
        return real(step, *args)
    engine.runner.launch = flaky
    return calls


@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_stream_closed_while_its_step_fails_is_let_go(chat_model, where):
    """The client leaves (its stream closes once and queues the abort: RequestStream.close keeps an accepted stream
    until the abort's output comes) while the step that fails runs: the failure aborts the engine's requests and
    answers each with the error; the abort then finds no request, so no output comes to let the stream go. The
    error's answer must let it go (the stream was kept, forever, by its id). (The OpenAI routes close a stream twice,
    its reader and its handler, and the second close lets it go: test_every_ending_lets_go passes either way.)"""
    served = Served(chat_model, where, async_scheduling=False)
    client = served.client
    params = SamplingParams(max_tokens=50, **GREEDY)
    # the first decode's launch waits until the failure is set up: else a fast engine decodes all 50 tokens first
    set_up, real_launch, launches = threading.Event(), served.engine.runner.launch, [0]

    def held(step, *args):
        launches[0] += 1
        if launches[0] == 2:
            set_up.wait(10)
        return real_launch(step, *args)
    served.engine.runner.launch = held

    async def main():
        client.start()
        loop = asyncio.get_running_loop()
        stream = await client.add_request([5, 6, 7], params, "leaves")
        reader = stream.outputs()
        await reader.__anext__()            # the prefill's token: the request decodes

        left = asyncio.Event()

        async def leave() -> None:
            await reader.aclose()           # the client's disconnect: RequestStream.close, the abort queued
            left.set()
        # the next launch: the client leaves while it runs, then it fails (on the engine loop's thread)
        launches_calling(served.engine, 1, lambda: asyncio.run_coroutine_threadsafe(leave(), loop).result(10))
        set_up.set()
        await left.wait()
        async for _ in client.generate([10, 11], SamplingParams(max_tokens=2, **GREEDY), "after"):
            pass                            # added after the abort: the loop has taken that abort
        sizes = served.kept()
        await client.shutdown()
        return sizes

    sizes = asyncio.run(asyncio.wait_for(main(), 60))
    served.join()
    assert not any(sizes.values()), sizes


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
CHAT = [{"role": "user", "content": "Tell me a story about a cat"}]
PROMPT = "The capital of France is"
# (route, body, what the client does: "read" all of it, "leave" a stream after its first lines, or "hang up" on a
# response not yet sent), every way a request ends but the failed step (test_every_ending_lets_go's own)
MIX = [
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=8), "read"),
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=16, stop=[" ", "e"], ignore_eos=True), "read"),
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=8, stream=True, stream_options={"include_usage": True}),
     "read"),
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=6, n=2, best_of=3, temperature=1.0), "read"),
    ("/v1/completions", dict(prompt=[PROMPT, "Hello"], max_tokens=6, n=2, temperature=1.0, stream=True), "read"),
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=4, n=2, use_beam_search=True, temperature=0), "read"),
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=4, prompt_logprobs=2, logprobs=2), "read"),
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=10, structured_outputs={"json": SCHEMA}), "read"),
    ("/v1/chat/completions", dict(messages=CHAT, max_tokens=12, tools=TOOLS, tool_choice="required", stream=True),
     "read"),
    ("/v1/responses", dict(input="Hello", max_output_tokens=8, stream=True), "read"),
    ("/tokenize", dict(messages=CHAT), "read"),
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=8, temperature=-1), "read"),            # 400: the server's
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=8, priority=3), "read"),                # 400: the engine's
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=8, structured_outputs={"regex": "a("}), "read"),  # compiled
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=200, ignore_eos=True, stream=True), "leave"),
    ("/v1/chat/completions", dict(messages=CHAT, max_tokens=200, ignore_eos=True, stream=True, n=2), "leave"),
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=200, stream=True,
                             structured_outputs={"regex": "[a-z ]{1,300}"}), "leave"),
    ("/v1/responses", dict(input="Hello", max_output_tokens=200, stream=True), "leave"),
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=200, ignore_eos=True, n=2), "hang up"),
]


async def _send(http: httpx.AsyncClient, url: str, route: str, body: dict, how: str) -> int | None:
    """One request, the client doing `how`; its status (None: it hung up before an answer)."""
    if how == "hang up":      # (on an idle machine the answer may come first: then nothing is left to let go)
        try:
            return (await http.post(url + route, json=body, timeout=0.2)).status_code
        except httpx.TimeoutException:
            return None
    if not body.get("stream"):
        return (await http.post(url + route, json=body)).status_code
    async with http.stream("POST", url + route, json=body) as r:
        lines = 0
        async for _ in r.aiter_lines():
            lines += 1
            if how == "leave" and lines == 3:
                break       # leaving the block closes the connection: the client hangs up mid-stream
        return r.status_code


async def _leave_while_the_step_fails(http: httpx.AsyncClient, url: str, served: Served) -> None:
    """A stream whose client hangs up while the step that then fails runs (its abort finds no request)."""
    go = threading.Event()

    def before_failing() -> None:     # on the engine loop's thread: the client leaves now, the step fails after
        (stream,) = served.client._streams.values()      # the one request in flight
        go.set()
        deadline = time.monotonic() + 30
        while not stream.finished and time.monotonic() < deadline:     # closed: its abort is queued
            time.sleep(0.01)

    body = dict(prompt=PROMPT, max_tokens=200, ignore_eos=True, stream=True)
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        lines = r.aiter_lines()     # held (not left to the garbage collector, whose close would hang up early)
        while not (await lines.__anext__()).startswith("data: "):
            pass
        launches_calling(served.engine, 1, before_failing)
        await asyncio.get_running_loop().run_in_executor(None, go.wait, 30)


@pytest.mark.parametrize("where", ["thread", "process"])
def test_every_ending_lets_go(chat_model, where):
    """The oracle: a served engine (uvicorn in a thread) takes the mix, twice over and concurrently, then a stream
    whose client leaves while its step fails; afterwards nothing is kept per request (a leak shows here as a
    container that stays above 0, where a few thousand such requests over weeks would grow it without bound)."""
    served = Served(chat_model, where, max_model_len=512)
    metrics = ServerMetrics("m")
    ctx = ServingContext(served.client, TokenizerWorker(served.engine.tokenizer), metrics, "m")
    server = uvicorn.Server(uvicorn.Config(build_app(ctx, ServerSettings()), host="127.0.0.1", port=free_port(),
                                           log_level="warning", loop="asyncio"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.config.port}"

    async def main() -> list:
        while not server.started:
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(timeout=60) as http:
            statuses = await asyncio.gather(*(_send(http, url, *m) for m in MIX * 2))
            while served.client._streams:       # the last aborts' outputs may still be on their way
                await asyncio.sleep(0.05)
            await _leave_while_the_step_fails(http, url, served)
            assert (await http.post(url + "/v1/completions", json=dict(prompt=PROMPT, max_tokens=2))).status_code \
                == 200      # added after that abort: the loop has taken it
        return statuses

    try:
        statuses = asyncio.run(asyncio.wait_for(main(), 120))
        deadline = time.monotonic() + 30       # the last aborts' outputs may still be on their way
        while any(served.kept().values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        kept = served.kept()
    finally:
        server.should_exit = True
        thread.join(30)
        served.join()
    assert statuses.count(400) == 6 and statuses.count(None) <= 2, statuses     # None: hung up (if not answered first)
    assert all(s in (200, 400, None) for s in statuses), statuses
    assert not any(kept.values()), kept


@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_failed_step_ends_every_sample_of_a_group(chat_model, where):
    """n > 1: a failed step answers each sample with the error; the group's reader raises at the first and closes
    the others, whose error answers it may never read."""
    from picovllm.entrypoints.openai.serving import SampleGroup
    served = Served(chat_model, where, async_scheduling=False)
    client = served.client
    ctx = ServingContext(client, TokenizerWorker(served.engine.tokenizer), ServerMetrics("m"), "m")
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True) for i in range(3)]

    async def main():
        client.start()
        group = await SampleGroup(ctx, [5, 6, 7, 8], params, "group", time.time()).start()
        seen = set()
        with pytest.raises(EngineStepError, match="injected failure"):
            async for i, _ in group.outputs():
                seen.add(i)
                if seen == {0, 1, 2}:       # every sample decodes: a step soon fails them all
                    launches_calling(served.engine, 1, lambda: None)
                    seen.add("failing")
        async for _ in client.generate([10, 11], SamplingParams(max_tokens=2, **GREEDY), "after"):
            pass
        sizes = served.kept()
        await client.shutdown()
        return sizes

    try:
        sizes = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        served.join()
        ctx.tokenizer.shutdown()
    assert not any(sizes.values()), sizes
