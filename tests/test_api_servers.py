"""Several API server processes in front of one engine process (`picovllm serve --api-server-count N`).

The engine's side (SharedChildLoop, in a thread here, on real pipes): each request's outputs go back on the pipe
it came in on, an API server's AbortAll and Shutdown reach only its own requests, one that leaves or breaks its
pipe has its requests aborted while the engine goes on for the others, and a request id another API server holds
is refused. Oracle: LLM.generate on the same model (greedy tokens).
The whole server (subprocess): outputs equal LLM.generate's over many concurrent connections; /metrics, in
whichever process answers, counts every request once and the engine's blocks once; SIGTERM stops every process and
removes the metrics files; a killed API server takes the server down (exit 1) instead of leaving it half-alive;
bad flags are refused by name.
"""
import json
import multiprocessing as mp
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from picovllm import LLM, SamplingParams
from picovllm.config import EngineConfig
from picovllm.engine.llm_engine import Engine
from picovllm.entrypoints.cli import main as cli_main
from picovllm.entrypoints.openai.engine_client import AbortAll, AddRequest, CommandAnswer, LoopEnded, Shutdown
from picovllm.entrypoints.openai.engine_process import SharedChildLoop
from picovllm.entrypoints.openai.output_deltas import OutputsFromDeltas
from serving_fixtures import ServerProcess, chat_model  # noqa: F401 - a fixture
from test_engine_process import spawned
from test_server_lifecycle import assert_exited, children_of

ENGINE_ARGS = ["--block-size", "16", "--num-kv-blocks", "512", "--max-model-len", "256"]
PROMPTS = ["Hello, how are you", "The capital of France is", "Numbers: 0 1 2", "A server streams tokens"]


class Side:
    """One API server's two pipe ends, read as PipeEngineClient reads them (outputs by request id)."""

    def __init__(self, commands, outputs) -> None:
        self.commands, self.outputs = commands, outputs
        self.decoder = OutputsFromDeltas()
        self.last: dict = {}        # request id -> its latest RequestOutput
        self.answers: dict = {}     # request id -> None (accepted) or the exception
        self.ended = None

    def pump(self, until, timeout_s: float = 60.0) -> None:
        deadline = time.time() + timeout_s
        while not until():
            assert time.time() < deadline, (self.last, self.answers, self.ended)
            if not self.outputs.poll(0.05):
                continue
            msg = self.outputs.recv()
            if isinstance(msg, LoopEnded):
                self.ended = msg.why
                continue
            for m in msg.items:
                if isinstance(m, CommandAnswer):
                    self.answers[m.request_id] = m.error
                else:
                    out = self.decoder.decode(m)
                    self.last[out.request_id] = out

    def done(self, rid: str) -> bool:
        return rid in self.last and self.last[rid].finished


@pytest.fixture
def shared_loop(chat_model):
    """The engine loop of a server with two API servers, in a thread, on real pipes: (pipe 0's command end,
    the two API servers' Sides, the engine)."""
    engine = Engine(EngineConfig(chat_model, block_size=16, num_kv_blocks=64, max_model_len=256))
    pairs = [(mp.Pipe(duplex=False), mp.Pipe(duplex=False)) for _ in range(3)]
    loop = SharedChildLoop(engine, [p[0][0] for p in pairs], [p[1][1] for p in pairs])
    thread = threading.Thread(target=loop._run, daemon=True)
    thread.start()
    sides = [Side(p[0][1], p[1][0]) for p in pairs[1:]]
    yield pairs[0][0][1], sides, engine
    pairs[0][0][1].send(Shutdown())
    thread.join(30)
    assert not thread.is_alive()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks   # every block free


def add(side: Side, rid: str, ids: list[int], max_tokens: int) -> None:
    side.commands.send(AddRequest(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                  time.time()))


def start_long(a: Side, b: Side, id_a: str, id_b: str) -> None:
    """A long request from each API server, both under way."""
    add(a, id_a, [5, 6, 7], 200)
    add(b, id_b, [5, 6, 8], 200)
    a.pump(lambda: id_a in a.last)
    b.pump(lambda: id_b in b.last)


def test_each_api_server_gets_its_own_requests_outputs(shared_loop, chat_model):
    _, (a, b), engine = shared_loop
    llm = LLM(chat_model, block_size=16, num_kv_blocks=64, max_model_len=256)
    ids = [llm.engine.tokenize(p) for p in PROMPTS]
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    for k, i in enumerate(ids):
        add(a if k % 2 == 0 else b, f"r{k}", i, 8)
    a.pump(lambda: a.done("r0") and a.done("r2"))
    b.pump(lambda: b.done("r1") and b.done("r3"))
    assert set(a.last) == {"r0", "r2"} and set(b.last) == {"r1", "r3"}      # nothing crossed over
    assert a.answers == {"r0": None, "r2": None} and b.answers == {"r1": None, "r3": None}
    for k in range(4):
        assert (a if k % 2 == 0 else b).last[f"r{k}"].outputs[0].token_ids == want[k]


def test_abort_all_and_a_taken_id_reach_only_the_senders_requests(shared_loop):
    _, (a, b), engine = shared_loop
    start_long(a, b, "long-a", "long-b")
    add(b, "long-a", [9, 9], 4)                 # a's id: refused to b, a's request untouched
    b.pump(lambda: "long-a" in b.answers)
    assert isinstance(b.answers["long-a"], ValueError) and "already in use" in str(b.answers["long-a"])
    b.commands.send(AbortAll())
    b.pump(lambda: b.done("long-b"))
    assert b.last["long-b"].outputs[0].finish_reason == "abort"
    a.pump(lambda: len(a.last["long-a"].outputs[0].token_ids) >= 8)     # a's goes on
    assert not a.last["long-a"].finished and "long-a" in engine.requests
    a.commands.send(AbortAll())
    a.pump(lambda: a.done("long-a"))
    assert a.last["long-a"].outputs[0].finish_reason == "abort"


def test_an_api_server_that_leaves_or_breaks_has_only_its_requests_aborted(shared_loop):
    _, (a, b), engine = shared_loop
    start_long(a, b, "a1", "b1")
    b.commands.send(Shutdown())                 # b leaves: its request aborted, then LoopEnded to b only
    b.pump(lambda: b.ended is not None)
    assert b.done("b1") and b.last["b1"].outputs[0].finish_reason == "abort"
    a.pump(lambda: len(a.last["a1"].outputs[0].token_ids) >= 8)
    assert a.ended is None and "a1" in engine.requests and "b1" not in engine.requests
    a.commands.close()                          # a's process dies: its pipe reads EOF
    deadline = time.time() + 30
    while "a1" in engine.requests:
        assert time.time() < deadline
        time.sleep(0.05)


def metrics_dir(pid: int) -> str:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return env[b"PROMETHEUS_MULTIPROC_DIR"].decode()


def test_two_api_servers_serve_as_one(chat_model, tmp_path):
    srv = ServerProcess(chat_model, str(tmp_path / "server.log"), *ENGINE_ARGS, "--engine-process",
                        "--api-server-count", "2")
    try:
        kids = children_of(srv.proc.pid)
        procs = spawned(srv.proc.pid)
        assert len(procs) == 3, srv.log()           # the engine and two API servers
        files = metrics_dir(procs[1])
        assert os.path.isdir(files)
        llm = LLM(chat_model, block_size=16, num_kv_blocks=512, max_model_len=256)
        want = {p: o.outputs[0].text for p, o in zip(PROMPTS, llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False))}

        def one(k: int) -> tuple[str, str]:
            prompt = PROMPTS[k % len(PROMPTS)]
            body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": k % 2 == 1}
            with httpx.Client(base_url=srv.url, timeout=60) as c:      # a connection of its own
                if not body["stream"]:
                    return prompt, c.post("/v1/completions", json=body).json()["choices"][0]["text"]
                text = ""
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                return prompt, text

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(one, range(24)))
        assert all(text == want[prompt] for prompt, text in got), got
        # a streamed request whose client hangs up: its API server aborts it, its blocks come back
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "Hello", "max_tokens": 200, "stream": True,
                                                            "ignore_eos": True}) as r:
                next(r.iter_lines())
        deadline = time.time() + 30
        while True:
            m = srv.metrics()
            if m["picovllm:num_requests_running"] == 0 and \
                    m["picovllm:kv_cache_free_blocks"] == m["picovllm:kv_cache_num_blocks"] == 512:
                break
            assert time.time() < deadline, m
            time.sleep(0.1)
        # every request counted once, whichever API server served it and whichever answers /metrics (the one that
        # hung up had its first token: it counts in TTFT, and in vLLM's e2e, which counts every end)
        for _ in range(4):
            m = srv.metrics()
            assert m["picovllm:requests_total.length"] == 24 and m["picovllm:requests_total.abort"] == 1, m
            assert m["picovllm:time_to_first_token_seconds_count"] == m["vllm:time_to_first_token_seconds_count"] \
                == 25, m
            assert m["picovllm:e2e_request_latency_seconds_count"] == 24, m
            assert m["vllm:e2e_request_latency_seconds_count"] == 25, m
        assert srv.stop(signal.SIGTERM) == 0, srv.log()
        assert_exited(kids)
        assert not os.path.exists(files), "the metrics files were left behind"
    finally:
        srv.stop()


def test_a_dead_api_server_stops_the_whole_server(chat_model, tmp_path):
    srv = ServerProcess(chat_model, str(tmp_path / "server.log"), *ENGINE_ARGS, "--engine-process",
                        "--api-server-count", "2")
    try:
        kids = children_of(srv.proc.pid)
        engine, *apis = spawned(srv.proc.pid)
        os.kill(apis[-1], signal.SIGKILL)
        srv.proc.wait(60)
        assert srv.proc.returncode == 1, srv.log()
        assert "exited: stopping the server" in srv.log()
        assert_exited(kids)
        assert not os.path.exists(f"/proc/{engine}")
    finally:
        srv.stop()


@pytest.mark.parametrize("flags, says", [
    (["--api-server-count", "0"], "must be at least 1"),
    (["--api-server-count", "2", "--no-engine-process"], "--api-server-count"),
    (["--api-server-count", "2", "--role", "p"], "--api-server-count"),
])
def test_bad_api_server_flags_are_refused_by_name(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--model", "unused", *flags])
    assert e.value.code != 0 and says in f"{e.value.code} {capsys.readouterr().err}"


def test_sigterm_while_the_engine_is_built_stops_everything(chat_model, tmp_path):
    """A server told to stop while it starts (a rolling restart): the parent exits at once instead of waiting for
    the engine, and every process it started ends."""
    srv = ServerProcess(chat_model, str(tmp_path / "server.log"), *ENGINE_ARGS, "--engine-process",
                        "--api-server-count", "2", startup_timeout=None)
    try:
        kids, deadline = [], time.time() + 60
        while len(kids) < 3:            # the engine and both API servers started (none is serving yet)
            assert srv.proc.poll() is None and time.time() < deadline, srv.log()
            kids = spawned(srv.proc.pid)
            time.sleep(0.02)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 130, srv.log()
        assert_exited(children_of(srv.proc.pid) + kids, timeout_s=60)
    finally:
        srv.stop()
