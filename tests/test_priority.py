"""The "priority" scheduling policy (vLLM's `--scheduling-policy priority`, each request's `priority`, lower first).

Oracles: the order requests are admitted in, worked out by hand from (priority, arrival); which running request a
block shortage preempts (the last by that order, checked against the running set at each preemption); every
request's tokens against HF transformers' greedy generation on the same weights. With the default policy ("fcfs")
a non-zero priority is refused, naming the field, at every entry (LLM, Engine, the async engine).
"""
import asyncio

import pytest

from picovllm import LLM, EngineConfig, SamplingParams
from picovllm.engine.scheduler import priority_key
from picovllm.entrypoints.openai.async_engine import AsyncEngine
from test_parity_hf import hf_greedy, make_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def finish_order(llm: LLM, prompts, priorities, params=GREEDY) -> tuple[list[str], dict]:
    eng = llm.engine
    ids = [eng.add_request(p, params, priority=pr) for p, pr in zip(prompts, priorities)]
    order, outs = [], {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                order.append(out.request_id)
                outs[out.request_id] = out.outputs[0].token_ids
    return [ids.index(r) for r in order], [outs[r] for r in ids]


def test_admission_follows_priority_then_arrival_and_tokens_match_hf(tiny_models):
    prompts = make_prompts(6)
    ref, _ = hf_greedy(tiny_models["llama"], prompts, 6)
    llm = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=128, max_num_seqs=1, scheduling_policy="priority",
              device="cpu")
    priorities = [3, 1, 2, 1, 0, -2]
    order, tokens = finish_order(llm, prompts, priorities)
    # one at a time, all queued before the first step: lowest value first, equal ones by arrival (1 before 3)
    assert order == [5, 4, 1, 3, 2, 0]
    assert tokens == ref
    # the same through LLM.generate: its outputs come back in prompt order whatever the engine's order
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=priorities)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_a_block_shortage_preempts_the_last_request_by_priority(tiny_models):
    """Three requests of priority 5 start; five of priority 0 come while they run. The cache cannot hold them all:
    each preemption takes the running request last by (priority, arrival), a priority-5 one, where FCFS takes the
    most recently admitted (priority 0). Every request's tokens still match HF's."""
    prompts = make_prompts(8)
    ref, _ = hf_greedy(tiny_models["llama"], prompts, 8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=26, enable_prefix_caching=False,
              scheduling_policy="priority", device="cpu")
    eng = llm.engine
    sched, seen = eng.scheduler, []
    real = sched.preempt

    def preempt(req):
        seen.append((priority_key(req), max(priority_key(r) for r in sched.running), sched.running[-1].priority))
        real(req)
    sched.preempt = preempt
    ids = {i: eng.add_request(prompts[i], params, priority=5) for i in (4, 5, 3)}
    eng.step()
    eng.step()
    ids |= {i: eng.add_request(prompts[i], params, priority=0) for i in (0, 1, 2, 6, 7)}
    tokens = {}
    while eng.has_unfinished_requests():
        tokens |= {o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished}
    assert seen, "the cache was meant to be too small to hold every request"
    assert all(victim == worst and victim[0] == 5 for victim, worst, _ in seen), seen
    assert any(last == 0 for _, _, last in seen), "FCFS would have chosen the same victims"
    assert [tokens[ids[i]] for i in range(8)] == ref


def test_the_async_engine_passes_priority(tiny_models):
    """AddRequest carries the priority (the server's path: a thread's loop, or the engine process's pipe)."""
    llm = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=128, max_num_seqs=1, scheduling_policy="priority",
              device="cpu")
    prompts = make_prompts(4)

    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        order = []

        async def one(i, pr):
            stream = await ae.add_request(prompts[i], GREEDY, f"r{i}", priority=pr)
            async for out in stream.outputs():
                if out.finished:
                    order.append(i)
        try:
            # the loop may take the first request before the others arrive: send them in one go, then step
            await asyncio.gather(*(one(i, pr) for i, pr in enumerate([2, 0, 1, 3])))
        finally:
            await ae.shutdown()
        return order
    order = asyncio.run(main())
    assert sorted(order) == [0, 1, 2, 3]
    assert order[1:] == sorted(order[1:], key=lambda i: [2, 0, 1, 3][i])   # the first may run before the rest came


def test_fcfs_refuses_priority_by_name(tiny_models):
    llm = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=64, device="cpu")
    with pytest.raises(ValueError, match=r"^priority 1 needs the priority scheduling policy"):
        llm.generate([[1, 2], [3, 4]], GREEDY, use_tqdm=False, priority=[0, 1])
    assert not llm.engine.requests                       # the first prompt's request was taken back
    with pytest.raises(ValueError, match="priority must be a list with one int per prompt"):
        llm.generate([[1, 2], [3, 4]], GREEDY, use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match="priority must be an int"):
        llm.engine.add_request([1, 2], GREEDY, priority=1.5)
    assert llm.generate([[1, 2]], GREEDY, use_tqdm=False, priority=[0])[0].outputs[0].token_ids   # 0 is FCFS's
    with pytest.raises(ValueError, match="EngineConfig.scheduling_policy must be 'fcfs' or 'priority'"):
        EngineConfig(scheduling_policy="lifo")
