"""StepLoop: the one loop every caller drives an Engine with, and its one wait policy."""
from __future__ import annotations

import pytest

from picovllm import LLM, SamplingParams
from picovllm.engine.step_loop import IN_FLIGHT_POLL_S, POLL_S, StepLoop
from test_kv_connector import linked_pair, run_pair

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tiny models on a shared 2-core machine


def test_colocated_waits_only_when_idle_and_never_while_a_step_is_in_flight(tiny_models):
    llm = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=32, async_scheduling=True)
    eng = llm.engine
    taken = []

    def take_input(wait_s):
        taken.append(wait_s)
        return True

    loop = StepLoop(eng, take_input)
    assert loop.wait_s() is None                       # nothing at all: until input comes
    assert loop.run_once() == [] and taken == [None]   # and no step
    eng.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), request_id="a")
    finals = []
    while eng.has_unfinished_requests():
        assert loop.wait_s() == 0.0                    # work, or a step in flight whose tokens to read
        finals += [o for o in loop.run_once() if o.finished]
    assert [o.request_id for o in finals] == ["a"] and len(finals[0].outputs[0].token_ids) == 2
    assert StepLoop(eng, lambda wait_s: False).run_once() is None    # the input ends the loop: no step


def test_a_connector_engine_polls_its_peer(tiny_models, monkeypatch):
    p, d, _ = linked_pair(tiny_models["llama"], False, dict(block_size=4, num_kv_blocks=32),
                          dict(block_size=4, num_kv_blocks=32))
    loop = StepLoop(p)
    assert loop.wait_s() == POLL_S                     # idle, but the peer may speak
    rid = p.add_request([4, 5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while rid not in p.connector.sending:
        assert loop.wait_s() == 0.0
        loop.run_once()
    assert not p.has_work() and p.has_unfinished_requests()    # held for the peer only
    assert loop.wait_s() == POLL_S
    monkeypatch.setattr(type(p.connector), "transfers_in_flight", property(lambda self: bool(self.sending)))
    assert loop.wait_s() == IN_FLIGHT_POLL_S
    finals = {}
    while p.has_unfinished_requests() or d.has_unfinished_requests():
        for out in p.step() + d.step():
            finals[out.request_id] = out
    assert finals[rid].finished and len(finals[rid].outputs[0].token_ids) == 3


def test_a_full_prefill_engine_polls_instead_of_spinning(tiny_models):
    """P's cache is full of KV held for the peer and a request waits for blocks: only the peer's release frees them,
    so the loop polls (the served loop spun at 0 s here and held the GIL from the KV server's threads) and admits the
    waiting request once the first is released. Oracle: blocks counted by hand (block_size 4, 4 blocks)."""
    p, d, _ = linked_pair(tiny_models["llama"], False, dict(block_size=4, num_kv_blocks=4),
                          dict(block_size=4, num_kv_blocks=32))
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = p.add_request(list(range(10, 19)), sp)            # 9 tokens: 3 of the 4 blocks
    second = p.add_request(list(range(20, 29)), sp)           # 3 more: waits
    loop = StepLoop(p)
    while first not in p.connector.sending:
        assert loop.wait_s() == 0.0
        loop.run_once()
    loop.run_once()                                           # nothing admitted, nothing to compute
    assert [r.request_id for r in p.scheduler.waiting] == [second] and p.block_manager.num_free_blocks == 1
    assert not p.has_work() and p.has_unfinished_requests() and loop.wait_s() == POLL_S
    finals = run_pair(p, d)
    assert sorted(finals) == sorted([first, second]) and all(len(o.outputs[0].token_ids) == 3 for o in finals.values())
    assert p.block_manager.num_free_blocks == 4 and d.block_manager.num_free_blocks == 32


def test_a_finished_request_ends_the_stall_at_once(tiny_models):
    """Overlapped D with one slot: while its request's last token is in flight the schedule has nothing (the next one
    waits for the slot), so the engine is stalled; the step that finishes it frees the slot, and the loop steps
    again at once instead of waiting a poll interval."""
    p, d, _ = linked_pair(tiny_models["llama"], True, dict(block_size=4, num_kv_blocks=32),
                          dict(block_size=4, num_kv_blocks=32, max_num_seqs=1))
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first, second = p.add_request(list(range(10, 15)), sp), p.add_request(list(range(20, 25)), sp)
    loop, finals, waits = StepLoop(d), {}, []
    for _ in range(200):
        for out in p.step():
            finals[out.request_id] = out
        for out in loop.run_once():
            finals[out.request_id] = out
            if out.request_id == first and out.finished:
                waits.append(loop.wait_s())
        if not (p.has_unfinished_requests() or d.has_unfinished_requests()):
            break
    assert waits == [0.0]                          # the second request was waiting for the slot: step at once
    assert all(finals[r].finished and len(finals[r].outputs[0].token_ids) == 3 for r in (first, second))
