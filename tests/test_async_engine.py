"""AsyncEngine in-process: outputs equal LLM.generate's, rejects and aborts leave the engine clean, and a
failing step fails only the requests in flight while the loop keeps serving."""
import asyncio
import random

import pytest

from picovllm import LLM, SamplingParams
from picovllm.entrypoints.openai.async_engine import AsyncEngine
from picovllm.entrypoints.openai.engine_client import EngineStepError

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(384) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@pytest.fixture(params=[False, True], ids=["sync", "overlapped"])
def llm(tiny_models, request):
    return LLM(tiny_models["llama"], block_size=8, num_kv_blocks=64, async_scheduling=request.param)


async def collect(ae, ids, params, rid):
    last = None
    async for out in ae.generate(ids, params, rid):
        last = out
    return last


def test_concurrent_outputs_match_llm_generate(llm):
    ps = prompts(6)
    ref = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]

    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        try:
            outs = await asyncio.gather(*(collect(ae, p, GREEDY, f"r{i}") for i, p in enumerate(ps)))
        finally:
            await ae.shutdown()
        return outs

    outs = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_reject_and_abort_leave_engine_clean(llm):
    bm = llm.engine.block_manager

    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        try:
            with pytest.raises(ValueError, match="max_model_len"):
                await ae.add_request([5] * 600, GREEDY, "too-long")
            with pytest.raises(ValueError, match=r"token ids must be in \[0, 384\)"):
                await ae.add_request([1, 2, 999], GREEDY, "bad-id")
            with pytest.raises(ValueError, match="stop_token_ids"):   # would index past the logits
                await ae.add_request([1, 2], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[999]), "bad-stop")
            # a long request, left after its first output: leaving the iteration aborts it
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            stream = await ae.add_request(prompts(1)[0], long, "leaver")
            async for out in stream.outputs():
                assert not out.finished
                break
            await stream_closed_and_idle(ae)
            assert ae.stats.num_free_blocks == bm.num_blocks
            # the engine still serves
            out = await collect(ae, prompts(1, seed=3)[0], GREEDY, "after")
            assert len(out.outputs[0].token_ids) == 10
        finally:
            await ae.shutdown()

    asyncio.run(main())
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests


def test_an_id_given_up_is_reused_only_once_its_abort_is_in(llm):
    """A client that leaves and sends the same request_id at once (the same event-loop tick): the id is still the
    old request's until its abort's output comes back, so the new one is refused (it had been accepted, then ended
    by the old one's abort output, its acceptance sent to no one: add_request never returned); once it is in, the
    id serves a new request in full."""
    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        try:
            old = await ae.add_request(prompts(1)[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                       "R")
            gen = old.outputs()
            await gen.__anext__()       # one output, then the client leaves: its stream closes, the abort goes out
            old.close()
            with pytest.raises(ValueError, match="already in use"):
                await asyncio.wait_for(ae.add_request([8, 9], GREEDY, "R"), 5)
            await stream_closed_and_idle(ae)
            while "R" in ae._streams:
                await asyncio.sleep(0.01)
            out = await asyncio.wait_for(collect(ae, [8, 9], GREEDY, "R"), 30)
            assert out.finished and len(out.outputs[0].token_ids) == 10
        finally:
            await ae.shutdown()

    asyncio.run(main())
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


async def stream_closed_and_idle(ae, timeout=10.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while ae.engine.requests or ae.stats.num_running or ae.stats.num_waiting:
        assert loop.time() < end, "the aborted request was never freed"
        await asyncio.sleep(0.01)


def test_failing_step_fails_inflight_requests_only(llm, monkeypatch):
    runner = llm.engine.runner
    real = runner.launch         # execute() = resolve(launch()); overlapped steps call launch() alone
    calls = {"n": 0}

    def flaky(step, *a):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real(step, *a)

    monkeypatch.setattr(runner, "launch", flaky)
    ps = prompts(3, seed=5)

    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        try:
            results = await asyncio.gather(*(collect(ae, p, GREEDY, f"f{i}") for i, p in enumerate(ps)),
                                           return_exceptions=True)
            assert all(isinstance(r, EngineStepError) for r in results), results
            assert ae.is_running
            return await collect(ae, ps[0], GREEDY, "after-failure")
        finally:
            await ae.shutdown()

    out = asyncio.run(main())
    monkeypatch.setattr(runner, "launch", real)
    ref = llm.generate([ps[0]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_shutdown_aborts_inflight(llm):
    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        stream = await ae.add_request(prompts(1)[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                      "inflight")
        await ae.shutdown()
        outs = [o async for o in stream.outputs()]
        return outs[-1]

    last = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks

