"""PD disaggregation under tensor parallelism (CPU, gloo), stressed: a TP rank that dies under a served pair (or a
served engine, busy or idle), n > 1 through DisaggLLM, and its errors.

Oracle: the colocated engine (LLM, TP=1) on the same tiny random checkpoint, greedy, token for token.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from conftest import build_tiny_checkpoint
from picovllm import LLM, EngineConfig, SamplingParams
from picovllm.disagg import TransferConfig
from picovllm.disagg.channel import Channel
from picovllm.disagg.pd_http import PDAsyncEngine
from picovllm.engine.llm_engine import Engine
from picovllm.entrypoints.openai.engine_client import EngineDeadError, EngineStepError
from serving_fixtures import ServerProcess, chat_model  # noqa: F401 - a fixture
from test_engine_process import spawned

GREEDY = dict(temperature=0, ignore_eos=True)
KW = dict(block_size=4, num_kv_blocks=64)
KILLED = r"tensor-parallel worker rank 1 \(pid \d+\) was killed by SIGKILL"


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_thread_in_children):
    """One intra-op thread here and in the spawned engines and ranks."""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    # 3 KV heads over 2 ranks: an uneven split (2 + 1), re-split on the way between TP sizes
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("pdtp") / "m"), "llama", hidden_size=72,
                                 num_attention_heads=9, num_key_value_heads=3)


def linked_pair(path: str, p_tp: int, d_tp: int, lease_s: float = 30.0) -> tuple[Engine, Engine]:
    """A P and a D engine of this process, linked over a socketpair (torch_dist), as a served pair's are."""
    p = Engine(EngineConfig(path, role="p", tensor_parallel_size=p_tp, **KW))
    d = Engine(EngineConfig(path, role="d", tensor_parallel_size=d_tp, **KW))
    a, b = socket.socketpair()
    tc = dict(backend="torch_dist", async_transfer=True, timeout_s=30.0, lease_s=lease_s)
    t = threading.Thread(target=d.connect, args=(Channel(b), TransferConfig(**tc)))
    t.start()
    p.connect(Channel(a), TransferConfig(**tc))
    t.join()
    return p, d


async def serve_one(p: PDAsyncEngine, d: PDAsyncEngine, rid: str, prompt: list[int], params) -> list:
    """A request as the proxy drives it: listen on D, add on P, P's outputs up to the hand-over, then D's."""
    listening = d.listen(rid)
    outs = [o async for o in (await p.add_request(prompt, params, rid)).outputs()]
    if outs[-1].outputs[0].finish_reason is None:       # handed over: D has the rest
        outs += [o async for o in listening.outputs()]
    else:
        listening.close()
    return outs


async def wait_for(cond, what: str, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {limit_s:g} s: {what}"
        await asyncio.sleep(0.05)


def test_a_served_prefill_engine_whose_tp_rank_dies_leaves_its_pair(model):
    """P (TP=2) serves, then a TP rank of P dies: the request in flight fails naming the rank; then P's loop ends
    (/health 503, later requests refused at once) and the link goes down, so D frees what it waited for and the
    proxy takes the pair out of rotation. Before, P stepped on with a dead engine and a live link: every request
    routed to the pair failed, forever, behind a healthy /health and /pd/info."""
    prompt, params = [5, 17, 42, 7, 99, 3, 250], SamplingParams(max_tokens=6, **GREEDY)
    ref = LLM(model, **KW).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    p_eng, d_eng = linked_pair(model, 2, 1)
    p, d = PDAsyncEngine(p_eng), PDAsyncEngine(d_eng)

    async def scenario() -> None:
        p.start()
        d.start()
        try:
            outs = await serve_one(p, d, "ok", prompt, params)
            assert outs[-1].outputs[0].token_ids == ref          # the healthy pair: the colocated engine's tokens
            os.kill(p_eng.executor.worker_pids[0], signal.SIGKILL)
            with pytest.raises((EngineStepError, EngineDeadError), match="tensor-parallel worker rank 1"):
                await serve_one(p, d, "doomed", prompt, params)
            await wait_for(lambda: not p.is_running, "P's loop ends")
            assert p.stats.connector["link_alive"] is False      # /pd/info: the proxy's signal to drop the pair
            await wait_for(lambda: d.stats.connector["link_alive"] is False, "D sees the link down")
            assert d.stats.num_free_blocks == d.stats.num_blocks
            with pytest.raises(EngineDeadError):
                await p.add_request(prompt, params, "late")
        finally:
            await p.shutdown()
            await d.shutdown()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        p_eng.shutdown()
        d_eng.shutdown()


def test_a_served_colocated_engine_whose_tp_rank_dies_stops_taking_requests(model):
    """The colocated server's loop (AsyncEngine, TP=2): after a rank dies, the request in flight fails naming it,
    then the loop ends (/health 503) and a new request is refused at once. Before, the loop stepped on: /health
    said 200 and every later request failed in a step of its own, forever."""
    from picovllm.entrypoints.openai.async_engine import AsyncEngine
    prompt, params = [5, 17, 42, 7, 99, 3, 250], SamplingParams(max_tokens=6, **GREEDY)
    ref = LLM(model, **KW).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    engine = Engine(EngineConfig(model, tensor_parallel_size=2, **KW))
    loop_engine = AsyncEngine(engine)

    async def generate(rid: str) -> list:
        return [o async for o in (await loop_engine.add_request(prompt, params, rid)).outputs()]

    async def scenario() -> None:
        loop_engine.start()
        try:
            assert (await generate("ok"))[-1].outputs[0].token_ids == ref
            os.kill(engine.executor.worker_pids[0], signal.SIGKILL)
            with pytest.raises((EngineStepError, EngineDeadError), match="tensor-parallel worker rank 1"):
                await generate("doomed")
            await wait_for(lambda: not loop_engine.is_running, "the loop ends")
            with pytest.raises(EngineDeadError):
                await loop_engine.add_request(prompt, params, "late")
        finally:
            await loop_engine.shutdown()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        engine.shutdown()


def test_a_served_colocated_engine_whose_tp_rank_dies_while_idle_stops_within_a_second(model):
    """A rank that dies while the served engine is idle: its loop, waiting for work, finds it within about a second
    (Executor.check_alive, no step) and stops as after a failed step: the loop ends (/health 503) and the first
    request is refused at once, naming the rank. Before, nothing looked until a request came: /health said 200
    meanwhile, and that request failed in a step of its own (a 500)."""
    from picovllm.entrypoints.openai.async_engine import AsyncEngine
    engine = Engine(EngineConfig(model, tensor_parallel_size=2, **KW))
    loop_engine = AsyncEngine(engine)

    async def scenario() -> None:
        loop_engine.start()
        try:
            await asyncio.sleep(0.3)                              # the loop is waiting for work
            os.kill(engine.executor.worker_pids[0], signal.SIGKILL)
            killed = time.monotonic()
            await wait_for(lambda: not loop_engine.is_running, "the idle loop ends", limit_s=5)
            assert time.monotonic() - killed < 3
            with pytest.raises(EngineDeadError, match=KILLED):
                await loop_engine.add_request([5, 17, 42], SamplingParams(max_tokens=2, **GREEDY), "first")
        finally:
            await loop_engine.shutdown()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        engine.shutdown()


def test_a_served_prefill_engine_whose_tp_rank_dies_while_idle_leaves_its_pair(model):
    """P (TP=2) idle, linked to D: a rank of P dies. P's loop polls its peer every few ms but no step ran on the
    ranks, so nothing noticed until a request came; now P's loop finds it within about a second, ends (/health 503,
    a request refused naming the rank) and drops the link, so D (still up) and the proxy see the pair down."""
    p_eng, d_eng = linked_pair(model, 2, 1)
    p, d = PDAsyncEngine(p_eng), PDAsyncEngine(d_eng)

    async def scenario() -> None:
        p.start()
        d.start()
        try:
            await asyncio.sleep(0.3)
            os.kill(p_eng.executor.worker_pids[0], signal.SIGKILL)
            await wait_for(lambda: not p.is_running, "P's idle loop ends", limit_s=5)
            assert p.stats.connector["link_alive"] is False
            await wait_for(lambda: d.stats.connector["link_alive"] is False, "D sees the link down")
            assert d.is_running
            with pytest.raises(EngineDeadError, match=KILLED):
                await p.add_request([5, 17, 42], SamplingParams(max_tokens=2, **GREEDY), "first")
        finally:
            await p.shutdown()
            await d.shutdown()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        p_eng.shutdown()
        d_eng.shutdown()


def test_a_tp_server_whose_rank_dies_while_idle_answers_503_naming_it(chat_model, tmp_path):
    """`picovllm serve -tp 2` (the loop as a thread): a rank killed while no request is running turns /health to
    503 within seconds, naming the rank, and the first request is a 503 naming it too (before: /health said 200
    until a request came, and that request got a 500)."""
    srv = ServerProcess(chat_model, str(tmp_path / "server.log"), "--tensor-parallel-size", "2",
                        "--block-size", "16", "--num-kv-blocks", "64", "--max-model-len", "128")
    try:
        rank, = spawned(srv.proc.pid)
        os.kill(rank, signal.SIGKILL)
        dead = f"tensor-parallel worker rank 1 (pid {rank}) was killed by SIGKILL"
        deadline = time.monotonic() + 5
        while (health := httpx.get(srv.url + "/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "/health still says 200"
            time.sleep(0.1)
        assert health.status_code == 503 and dead in health.json()["error"]["message"], health.text
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
        assert r.status_code == 503 and dead in r.json()["error"]["message"], r.text
    finally:
        srv.stop()


def test_a_tp_server_whose_engine_process_finds_a_dead_rank_while_idle_exits(chat_model, tmp_path):
    """The same under serve's default, the engine in a process of its own: the loop there ends within seconds and
    so does the server, exit 1 (as for any end of its engine: a supervisor restarts it), its log naming the rank.
    Before, it went on saying 200 until a request came."""
    srv = ServerProcess(chat_model, str(tmp_path / "server.log"), "--tensor-parallel-size", "2", "--engine-process",
                        "--block-size", "16", "--num-kv-blocks", "64", "--max-model-len", "128")
    try:
        engine_proc, = spawned(srv.proc.pid)
        rank, = spawned(engine_proc)
        os.kill(rank, signal.SIGKILL)
        assert srv.proc.wait(10) == 1, srv.log()
        assert f"tensor-parallel worker rank 1 (pid {rank}) was killed by SIGKILL" in srv.log()
    finally:
        srv.stop()


# -- DisaggLLM: P TP=2, D TP=1 in processes of their own ---------------------------------------------------------
@pytest.fixture(scope="module")
def pd(model):
    from picovllm.disagg import DisaggLLM
    llm = DisaggLLM(model, prefill={"tensor_parallel_size": 2, "max_num_batched_tokens": 16},
                    decode={"num_kv_blocks": 40}, block_size=4, num_kv_blocks=128, lease_s=5.0)
    yield llm
    t0 = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - t0 < 15


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(384) for _ in range(rng.randint(1, 50))] for _ in range(n)]


def assert_clean(session) -> None:
    for role, end in session.ended.items():
        assert end.free_blocks == end.num_blocks, f"{role}: {end.num_blocks - end.free_blocks} blocks leaked"
        assert end.unfinished == 0 and end.error is None, (role, end)


def test_n_samples_through_hetero_tp_match_colocated(pd, model):
    """SamplingParams.n > 1: DisaggLLM.generate fans the samples out as LLM.generate does (each its own request,
    seed + i), instead of refusing the whole batch with Engine.add_request's "n must be 1"."""
    ps = mixed_prompts(10, seed=3)
    params = [SamplingParams(max_tokens=1 + i % 7, n=1 + i % 3, **GREEDY) if i % 2 else
              SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=11 + i, ignore_eos=True) for i in range(10)]
    ref = LLM(model, **KW).generate(ps, params, use_tqdm=False)
    outs = pd.generate(ps, params, timeout_s=60)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in r.outputs] for r in ref]
    assert all(len(o.outputs) == sp.n and o.error is None for o, sp in zip(outs, params))
    assert_clean(pd._active)


def test_prefill_tp_rank_killed_mid_session_fails_requests_naming_it(pd):
    """Last in the module (the P process dies): a P TP rank killed mid-stream, with the close ("no more requests")
    already sent. Every request ends within a bounded time, those that fail naming the dead rank (before: only "the
    prefill engine process died (exit code 1)"), and D frees every block and stays up."""
    s = pd.session(stream=True)
    ids = [s.submit(p, SamplingParams(max_tokens=30, **GREEDY)) for p in mixed_prompts(16, seed=5)]
    s.close()
    firsts = set()
    deadline = time.monotonic() + 30
    while len(firsts) < 3:
        assert time.monotonic() < deadline, "no first tokens"
        firsts |= {o.request_id for o in s.poll(0.02)}
    ranks = [pid for pid in _children(pd.pids["p"])]
    assert len(ranks) == 1, ranks
    os.kill(ranks[0], signal.SIGKILL)
    t0 = time.monotonic()
    s.wait(timeout_s=20)
    assert time.monotonic() - t0 < 10
    outs = [s.results[rid] for rid in ids]
    assert all(o.finished for o in outs)
    errors = [o.error for o in outs if o.error]
    assert errors, "some requests were still on P"
    on_p = [e for e in errors if not e.startswith("prefill engine lost")]    # D's word for those it waited for
    assert on_p and all("tensor-parallel worker rank 1" in e for e in on_p), on_p
    pd.procs["p"].join(10)        # it said why and exits: this engine cannot step again
    assert pd.procs["p"].exitcode == 1 and pd.procs["d"].is_alive()
    end = s.ended["d"]
    assert end.free_blocks == end.num_blocks and end.unfinished == 0


def _children(pid: int) -> list[int]:
    """Live processes whose parent is pid (an engine's TP worker ranks)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(d))
    return out
