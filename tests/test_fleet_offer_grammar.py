"""A fleet's decode engine takes an offered request with a grammar: the grammar compiles off D's loop (a request
decoding there runs on meanwhile), then the request joins D's batch; a compile that fails, or an abort while it
compiles, ends the request on D (D answers for it in a fleet) and releases its KV on P. Oracle: the colocated
engine. conftest checks every engine ends each test with every block free."""
from __future__ import annotations

import threading

import pytest

from picovllm import LLM
from serving_fixtures import chat_model  # noqa: F401 - a fixture
from test_disagg_engines import PLAIN, assert_same, choice_params, d_compiles
from test_pd_fleet import Fleet, fleet_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class OnePair:
    """d_compiles' view of a fleet of one P and one D."""

    def __init__(self, fleet: Fleet) -> None:
        self.p, self.d = fleet.ps[0], fleet.ds[0]


def step_until(fleet: Fleet, cond, limit_steps: int = 20000) -> None:
    for _ in range(limit_steps):
        if cond():
            return
        fleet.step()
    raise AssertionError("condition never reached")


@pytest.mark.parametrize("how", ["compiles", "fails", "aborted"])
def test_a_fleet_decode_compiles_an_offered_grammar_off_its_loop(chat_model, monkeypatch, how):
    ref = LLM(chat_model, block_size=4, num_kv_blocks=256).generate(["A story:", "Answer:"], [PLAIN, choice_params()],
                                                                    use_tqdm=False)
    fleet = Fleet([fleet_engine(chat_model, "p")], [fleet_engine(chat_model, "d")])
    d = fleet.ds[0]
    try:
        release, calls = d_compiles(OnePair(fleet), monkeypatch, fail=how == "fails")
        a = fleet.submit("A story:", PLAIN)
        step_until(fleet, lambda: any(r.request_id == a for r in d.scheduler.running))
        b = fleet.submit("Answer:", choice_params())
        step_until(fleet, lambda: calls)
        if how == "compiles":
            step_until(fleet, lambda: a in fleet.finals)
            assert calls[0][1] is None, "D's loop waited the compile out"
            assert b not in d.requests and b in d.grammar_masks.offers
            release.set()
        elif how == "aborted":
            out = d.abort(b)
            assert out.finished and out.outputs[0].finish_reason == "abort"
            fleet.finals[b] = out
            release.set()
            step_until(fleet, lambda: calls[0][1] is not None)      # the compile ended: it adds nothing
        fleet.run([a, b])
        assert_same([fleet.finals[a]], ref[:1])
        if how == "compiles":
            assert_same([fleet.finals[b]], ref[1:])
        elif how == "fails":
            assert fleet.finals[b].outputs[0].finish_reason == "error"
            assert "guided_choice: invalid choice list: not on this decode engine" in fleet.finals[b].error
        assert all(thread is not threading.main_thread() for thread, _ in calls[:1])
        assert b not in d.requests and not d.grammar_masks.offers
    finally:
        release.set()
        fleet.close()
