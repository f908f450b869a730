"""P and D engines in this process, linked by a socketpair and a real backend, stepped in turn.

Deterministic stepping reaches every phase of a handover on purpose (aborts, cut links, silent
peers, lost transfers). The oracle for outputs is the colocated engine (LLM) on the same weights,
itself checked against HF transformers in test_parity_hf.py. conftest checks both engines end
every test with every block free.
"""
from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import torch

from picovllm import LLM, EngineConfig, SamplingParams
from picovllm.disagg import EngineClosedError, TransferConfig
from picovllm.disagg.channel import Channel
from picovllm.disagg.prefill import HandoverState
from picovllm.engine.detokenizer import Detokenizer
from picovllm.engine.llm_engine import Engine
from picovllm.sampling_params import RequestOutputKind
from conftest import build_tiny_checkpoint
from serving_fixtures import chat_model, thinking_model  # noqa: F401 - fixtures

BACKENDS = ["torch_dist", "cuda_ipc"]     # cuda_ipc on CPU: the same pull path over shared memory


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tiny models on a shared 2-core machine


class LocalPair:
    def __init__(self, path, backend="torch_dist", p_kw=None, d_kw=None, timeout_s=30.0, lease_s=30.0,
                 p_async=True, tokenizer=None, overlap=False):
        # overlap: both engines schedule step N+1 before they read step N's tokens (async_scheduling)
        self.p = Engine(EngineConfig(path, role="p", async_scheduling=overlap, **(p_kw or {})))
        self.d = Engine(EngineConfig(path, role="d", async_scheduling=overlap, **(d_kw or {})))
        assert self.p.overlap == self.d.overlap == overlap
        for eng in (self.p, self.d):
            if tokenizer is not None:
                eng.tokenizer, eng.detokenizer = tokenizer, Detokenizer(tokenizer)
        a, b = socket.socketpair()
        self.p_sock, self.d_sock = a, b
        tc = dict(backend=backend, timeout_s=timeout_s, lease_s=lease_s)
        # D never waits in poll here: in one thread, P could not send while D waited.
        t = threading.Thread(target=self.d.connect, args=(Channel(b), TransferConfig(async_transfer=True, **tc)))
        t.start()
        self.p.connect(Channel(a), TransferConfig(async_transfer=p_async, **tc))
        t.join()
        self.final: dict[str, object] = {}
        self.all_finals: list = []

    def step(self, which="pd"):
        outs = (self.p.step() if "p" in which else []) + (self.d.step() if "d" in which else [])
        for o in outs:
            if o.finished:
                self.all_finals.append(o)
                self.final.setdefault(o.request_id, o)
        return outs

    def run(self, timeout_s=60.0):
        t0 = time.monotonic()
        while not (self.p.is_done() and self.d.is_done()):
            self.step()
            assert time.monotonic() - t0 < timeout_s, "the pair did not finish"


class CharTokenizer:
    """A tokenizer stand-in: token i decodes to one letter, so text and stop strings are easy to follow."""
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def prompts(n=8, seed=0, vocab=384, lens=(1, 5, 16, 17, 31, 32, 47, 90)):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(L)] for L in lens[:n]]


def mixed_params():
    return [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=1.2, top_k=20, seed=5, max_tokens=12, ignore_eos=True, logprobs=1),
            SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)]          # done at P


def assert_same(outs, ref):
    for o, r in zip(outs, ref):
        a, b = o.outputs[0], r.outputs[0]
        assert a.token_ids == b.token_ids, (o.request_id, a.token_ids, b.token_ids)
        assert (a.finish_reason, a.stop_reason, a.text) == (b.finish_reason, b.stop_reason, b.text)
        if b.logprobs is not None:
            assert [sorted(d) for d in a.logprobs] == [sorted(d) for d in b.logprobs]
            for da, db in zip(a.logprobs, b.logprobs):
                for t in db:
                    assert da[t].logprob == pytest.approx(db[t].logprob, abs=1e-4)
                    assert da[t].rank == db[t].rank
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)
        assert (o.prompt_logprobs is None) == (r.prompt_logprobs is None), o.request_id
        if r.prompt_logprobs is not None:
            assert len(o.prompt_logprobs) == len(r.prompt_logprobs) and o.prompt_logprobs[0] is None
            for da, db in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:]):
                assert sorted(da) == sorted(db)
                for t in db:
                    assert (da[t].rank, da[t].decoded_token) == (db[t].rank, db[t].decoded_token)
                    assert da[t].logprob == pytest.approx(db[t].logprob, abs=1e-4)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_parity_with_colocated_under_chunking_and_flow_control(tiny_models, arch, backend, overlap):
    ps = prompts() * 2
    params = [mixed_params()[i % 4] for i in range(len(ps))]
    ref = LLM(tiny_models[arch], block_size=4, num_kv_blocks=256).generate(ps, params, use_tqdm=False)
    # P: chunks of 8 tokens; D: 30 blocks of 4 (120 tokens) for 16 requests of up to 102 tokens.
    pair = LocalPair(tiny_models[arch], backend, p_kw=dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=8),
                     d_kw=dict(block_size=4, num_kv_blocks=30), overlap=overlap)
    ids = [pair.p.submit(p, sp) for p, sp in zip(ps, params)]
    pair.p.close()
    waited = held = 0
    t0 = time.monotonic()
    while not (pair.p.is_done() and pair.d.is_done()):
        pair.step()
        waited += bool(pair.d.connector.offers)           # offers D had no room for yet...
        held = max(held, sum(h.state == HandoverState.OFFERED for h in pair.p.connector.handovers.values()))
        assert time.monotonic() - t0 < 60
    assert waited and held >= 2, "the decode cache was meant to be too small to take every request at once"
    assert_same([pair.final[i] for i in ids], ref)
    assert all(pair.final[i].metrics.ttft is not None for i in ids)
    assert pair.d.stats.decode_tokens > 0 and pair.p.stats.decode_tokens == 0


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_text_and_stop_strings_match_colocated(tiny_models, backend, overlap):
    tok = CharTokenizer()
    ps = prompts(8, seed=3)
    llm = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=128)
    llm.engine.tokenizer, llm.engine.detokenizer = tok, Detokenizer(tok)
    free = llm.generate(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    # Stop strings the colocated text does contain: at the first token (so P finishes the request),
    # later (D does), spanning two tokens, and one that never occurs.
    cuts = [(0, 1), (4, 5), (6, 8), None]
    stops = [[t[c[0]:c[1]]] if c else ["#"] for t, c in zip((o.outputs[0].text for o in free), cuts * 2)]
    params = [SamplingParams(temperature=0, max_tokens=12, stop=st, ignore_eos=True) for st in stops]
    ref = llm.generate(ps, params, use_tqdm=False)
    assert sum(r.outputs[0].finish_reason == "stop" for r in ref) >= 6
    pair = LocalPair(tiny_models["llama"], backend, p_kw=dict(block_size=4, num_kv_blocks=128),
                     d_kw=dict(block_size=4, num_kv_blocks=128), tokenizer=tok, overlap=overlap)
    ids = [pair.p.submit(p, sp) for p, sp in zip(ps, params)]
    pair.p.close()
    pair.run()
    assert_same([pair.final[i] for i in ids], ref)


def test_sync_prefill_side_matches(tiny_models):
    ps = prompts()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = LLM(tiny_models["llama"], block_size=8, num_kv_blocks=64).generate(ps, sp, use_tqdm=False)
    pair = LocalPair(tiny_models["llama"], "torch_dist", p_kw=dict(block_size=8, num_kv_blocks=64),
                     d_kw=dict(block_size=8, num_kv_blocks=64), p_async=False)
    ids = [pair.p.submit(p, sp) for p in ps]
    pair.p.close()
    pair.run()
    assert_same([pair.final[i] for i in ids], ref)


def test_penalties_and_logit_bias_travel_to_d(tiny_models):
    """D gets the sampling params over the JSON wire (logit_bias keys become strings there) and the
    prompt's ids with the request, so its repetition penalty counts the prompt as the colocated one does."""
    ps = prompts(4, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.6),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, frequency_penalty=1.5,
                             presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={7: 4.0, 9: -100}),
              SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True, repetition_penalty=2.0,
                             frequency_penalty=2.0, logit_bias={11: 3.0})]
    llm = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=128)
    ref = llm.generate(ps, params, use_tqdm=False)
    plain = llm.generate(ps, [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 3 +
                         [SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True)], use_tqdm=False)
    assert [r.outputs[0].token_ids != q.outputs[0].token_ids for r, q in zip(ref, plain)] == [True] * 4
    pair = LocalPair(tiny_models["llama"], "torch_dist", p_kw=dict(block_size=4, num_kv_blocks=128),
                     d_kw=dict(block_size=4, num_kv_blocks=128))
    ids = [pair.p.submit(p, sp) for p, sp in zip(ps, params)]
    pair.p.close()
    pair.run()
    assert_same([pair.final[i] for i in ids], ref)
    assert pair.d.stats.decode_tokens > 0


@pytest.fixture(scope="module")
def sliding_model(tmp_path_factory) -> str:
    """Every layer attends to its last 8 positions only."""
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("sliding")), "qwen2", use_sliding_window=True,
                                 sliding_window=8, max_window_layers=0)


SMALL_SLIDING = dict(block_size=4, num_kv_blocks=12, max_num_batched_tokens=16, max_model_len=128)   # 48 tokens


def test_a_sliding_window_decode_engine_refuses_a_prompt_its_cache_cannot_receive_whole(sliding_model):
    """Every layer slides: a colocated engine whose cache is smaller than a prompt runs it (blocks behind the window
    go back chunk by chunk), but D receives the prompt's KV whole. D with that cache refuses such an offer, naming the
    prompt; it never waited for room that cannot come, holding up the requests queued behind it."""
    ps = prompts(2, seed=3, lens=(60, 5))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = LLM(sliding_model, **SMALL_SLIDING).generate(ps, sp, use_tqdm=False)
    assert [len(r.outputs[0].token_ids) for r in ref] == [6, 6]
    pair = LocalPair(sliding_model, p_kw=dict(block_size=4, num_kv_blocks=64, max_model_len=128), d_kw=SMALL_SLIDING)
    long, short = [pair.p.submit(p, sp) for p in ps]
    pair.p.close()
    pair.run()
    out = pair.final[long]
    assert out.outputs[0].finish_reason == "error" and "prompt (60)" in out.error and "48" in out.error, out.error
    assert_same([pair.final[short]], ref[1:])


def test_a_sliding_window_models_prefill_engine_admits_as_its_decode_engine_holds(sliding_model):
    """P keeps every block of a prompt it hands over, but D decodes within the window: P resolves and checks
    max_tokens as a colocated engine of that config does (an unset one is the context's room, not the cache's; a
    prompt + max_tokens beyond the cache is admitted), and refuses only a prompt it cannot hold whole, naming it."""
    ps = prompts(3, seed=4, lens=(20, 20, 9))
    params = [SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=2, max_tokens=50, ignore_eos=True)]
    llm = LLM(sliding_model, **SMALL_SLIDING)
    ref = llm.generate(ps, params, use_tqdm=False)
    assert len(ref[0].outputs[0].token_ids) == 128 - 20       # the context's room, beyond the 48-token cache
    pair = LocalPair(sliding_model, p_kw=SMALL_SLIDING, d_kw=SMALL_SLIDING)
    ids = [pair.p.submit(p, sp) for p, sp in zip(ps, params)]
    too_long = prompts(1, seed=5, lens=(60,))[0]
    assert llm.generate([too_long], params[1], use_tqdm=False)[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"prompt \(60\) tokens exceed the KV cache \(48 tokens\)"):
        pair.p.submit(too_long, params[1])
    pair.p.close()
    pair.run()
    assert_same([pair.final[i] for i in ids], ref)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_delta_requests_outputs_on_d_follow_what_p_gave_out(tiny_models, overlap):
    """output_kind DELTA: each output holds only what is new. P's first output gave out the first token, its
    logprobs, the prompt's logprobs and the text no stop string could still cut; D's outputs hold what follows, so
    the outputs add up to the colocated engine's, output by output."""
    tok = CharTokenizer()
    ps = prompts(2, seed=6)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                             output_kind=RequestOutputKind.DELTA),
              SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True, stop=["###"], logprobs=0,
                             output_kind=RequestOutputKind.DELTA)]     # a stop string holds back the text's tail
    colocated = Engine(EngineConfig(tiny_models["llama"], block_size=4, num_kv_blocks=128))
    colocated.tokenizer, colocated.detokenizer = tok, Detokenizer(tok)
    want = {colocated.add_request(p, sp): [] for p, sp in zip(ps, params)}
    while colocated.has_unfinished_requests():
        for out in colocated.step():
            want[out.request_id].append(out)
    pair = LocalPair(tiny_models["llama"], p_kw=dict(block_size=4, num_kv_blocks=128),
                     d_kw=dict(block_size=4, num_kv_blocks=128), tokenizer=tok, overlap=overlap)
    got = {pair.p.submit(p, sp): [] for p, sp in zip(ps, params)}
    pair.p.close()
    t0 = time.monotonic()
    while not (pair.p.is_done() and pair.d.is_done()):
        for out in pair.step():
            got[out.request_id].append(out)
        assert time.monotonic() - t0 < 60, "the pair did not finish"
    assert list(got) == list(want)
    for rid in want:
        assert [o.outputs[0].token_ids for o in got[rid]] == [o.outputs[0].token_ids for o in want[rid]]
        assert [o.outputs[0].text for o in got[rid]] == [o.outputs[0].text for o in want[rid]]
        lps = [[sorted(d) for d in o.outputs[0].logprobs] for o in got[rid]]
        assert lps == [[sorted(d) for d in o.outputs[0].logprobs] for o in want[rid]]
        assert [o.prompt_logprobs is not None for o in got[rid]] == [o.prompt_logprobs is not None
                                                                      for o in want[rid]]
        assert got[rid][-1].outputs[0].finish_reason == want[rid][-1].outputs[0].finish_reason


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_are_p_s_and_reach_d_s_outputs(tiny_models, overlap):
    """P scores the prompt as the colocated engine does (chunked: 8 tokens a step, so prompts span chunks) and the
    handover carries the scores: every output D makes has them, equal to the colocated engine's (the oracle)."""
    ps = prompts(4, seed=9)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=k, logprobs=1)
              for k in (0, 1, 3, 2)]
    kw = dict(block_size=4, num_kv_blocks=128, max_num_batched_tokens=8)
    ref = LLM(tiny_models["llama"], **kw).generate(ps, params, use_tqdm=False)
    assert any(len(p) > 8 for p in ps) and all(r.prompt_logprobs is not None for r in ref)
    pair = LocalPair(tiny_models["llama"], "torch_dist", p_kw=kw, d_kw=dict(block_size=4, num_kv_blocks=128),
                     overlap=overlap)
    ids = [pair.p.submit(p, sp) for p, sp in zip(ps, params)]
    pair.p.close()
    d_outputs = []
    t0 = time.monotonic()
    while not (pair.p.is_done() and pair.d.is_done()):
        pair.step("p")
        d_outputs += pair.step("d")
        assert time.monotonic() - t0 < 60
    assert_same([pair.final[i] for i in ids], ref)
    assert d_outputs and all(o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(o.prompt_token_ids)
                             for o in d_outputs)


# -- close ------------------------------------------------------------------------------------------
def test_close_refuses_submit_drains_then_ends_the_stream(tiny_models):
    pair = LocalPair(tiny_models["llama"], p_kw=dict(block_size=4, num_kv_blocks=64),
                     d_kw=dict(block_size=4, num_kv_blocks=64))
    rid = pair.p.submit(prompts(1, lens=(9,))[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    pair.p.close()
    with pytest.raises(EngineClosedError, match="closed"):
        pair.p.submit([1, 2, 3])
    assert not pair.p.is_done() and not pair.d.is_done()     # closed is not done: it still has work
    pair.run()
    assert pair.final[rid].outputs[0].finish_reason == "length" and len(pair.final[rid].outputs[0].token_ids) == 5
    assert pair.p.connector.link.closed and pair.d.connector.link.closed


def test_close_with_nothing_submitted_finishes_at_once(tiny_models):
    pair = LocalPair(tiny_models["llama"], p_kw=dict(num_kv_blocks=16), d_kw=dict(num_kv_blocks=16))
    pair.p.close()
    for _ in range(5):
        pair.step()
    assert pair.p.is_done() and pair.d.is_done()


# -- aborts in every phase -----------------------------------------------------------------------------
def step_until(pair, cond, which="pd", limit_s=30.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if cond():
            return
        pair.step(which)
    raise AssertionError("condition never reached")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_in_every_phase_frees_both_sides(tiny_models, backend, overlap):
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    pair = LocalPair(tiny_models["llama"], backend, p_kw=dict(block_size=4, num_kv_blocks=64,
                                                             max_num_batched_tokens=8),
                     d_kw=dict(block_size=4, num_kv_blocks=64), overlap=overlap)
    p, d = pair.p, pair.d
    handovers = p.connector.handovers
    aborted = []

    def abort(rid):
        out = p.abort(rid)
        aborted.append(rid)
        if out is not None:
            assert out.finished and out.outputs[0].finish_reason == "abort"
            pair.final.setdefault(rid, out)

    waiting = p.submit(prompts(1, lens=(20,))[0], sp)                  # 1. waiting at P
    abort(waiting)
    prefilling = p.submit(prompts(1, lens=(20,))[0], sp)               # 2. mid-prefill (chunks of 8)
    pair.step("p")
    assert p.requests[prefilling].num_computed_tokens == 8
    abort(prefilling)
    offered = p.submit(prompts(1, lens=(6,))[0], sp)                   # 3. offered, D has not looked yet
    step_until(pair, lambda: offered in handovers, "p")
    abort(offered)
    receiving = p.submit(prompts(1, lens=(6,), seed=1)[0], sp)          # 4. D accepted, KV on its way
    step_until(pair, lambda: receiving in handovers, "p")
    pair.step("d")                                                      # D: Offer in, blocks allocated, Accept out
    assert receiving in d.connector.receiving or receiving in {r.request_id for r in d.scheduler.running}
    abort(receiving)
    decoding = p.submit(prompts(1, lens=(6,), seed=2)[0], sp)           # 5. acked: decoding on D
    step_until(pair, lambda: decoding in d.requests and decoding not in handovers)
    abort(decoding)
    keep = p.submit(prompts(1, lens=(7,), seed=3)[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    p.close()
    pair.run()
    for rid in aborted:
        assert pair.final[rid].outputs[0].finish_reason == "abort", rid
    assert pair.final[keep].outputs[0].finish_reason == "length"
    # conftest: every block free on both engines now


# -- faults ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_cut_link_fails_in_flight_requests_and_both_sides_carry_on(tiny_models, backend):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    pair = LocalPair(tiny_models["llama"], backend, p_kw=dict(block_size=4, num_kv_blocks=128),
                     d_kw=dict(block_size=4, num_kv_blocks=28))
    p, d = pair.p, pair.d
    ids = [p.submit(x, sp) for x in prompts()]
    step_until(pair, lambda: d.scheduler.running and (d.connector.offers or d.connector.receiving)
               and p.connector.handovers)
    running_on_d = {r.request_id for r in d.scheduler.running}
    pair.p_sock.shutdown(socket.SHUT_RDWR)              # the link dies under both engines
    late = p.submit(prompts(1, lens=(5,), seed=9)[0], sp)
    p.close()
    pair.run()
    for rid in ids + [late]:
        out = pair.final[rid]
        if rid in running_on_d:
            assert out.outputs[0].finish_reason == "length"       # D needs nothing from P to finish these
        else:
            assert out.outputs[0].finish_reason in ("length", "error")
    errors = [pair.final[r] for r in ids + [late] if pair.final[r].outputs[0].finish_reason == "error"]
    assert errors and all("engine lost" in e.error for e in errors), [e.error for e in errors]
    assert pair.final[late].outputs[0].finish_reason == "error"    # handed over after the cut: fails at once


def test_silent_decode_engine_loses_its_lease(tiny_models):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    pair = LocalPair(tiny_models["llama"], p_kw=dict(block_size=4, num_kv_blocks=64),
                     d_kw=dict(block_size=4, num_kv_blocks=64), lease_s=0.4)
    p = pair.p
    pair.d.connector.link.channel._stop.set()                   # D's heartbeats stop, and D is not stepped: it hangs
    ids = [p.submit(x, sp) for x in prompts(3)]
    t0 = time.monotonic()
    step_until(pair, lambda: not p.connector.link.alive, "p")
    assert 0.35 < time.monotonic() - t0 < 5
    assert all(pair.final[r].outputs[0].finish_reason == "error" and "silent" in pair.final[r].error for r in ids)
    assert p.block_manager.num_free_blocks == p.block_manager.num_blocks     # freed at once, P stays up
    p.close()
    pair.run()


def test_transfer_that_never_completes_times_out_and_frees(tiny_models):
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ps = prompts(3)
    ref = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=64).generate(ps, sp, use_tqdm=False)
    pair = LocalPair(tiny_models["llama"], "torch_dist", p_kw=dict(block_size=4, num_kv_blocks=64),
                     d_kw=dict(block_size=4, num_kv_blocks=64), timeout_s=0.5)
    transfer = pair.p.connector.link.transfer
    real, calls = transfer.start_send, []
    transfer.start_send = lambda spec: calls.append(spec) if not calls else real(spec)  # lose the first
    ids = [pair.p.submit(x, sp) for x in ps]
    pair.p.close()
    pair.run()
    lost = calls[0].request_id
    assert pair.final[lost].outputs[0].finish_reason == "error"
    assert "timed out" in pair.final[lost].error or "within 0.5 s" in pair.final[lost].error
    for rid, r in zip(ids, ref):
        if rid != lost:
            assert pair.final[rid].outputs[0].token_ids == r.outputs[0].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_pair_in_one_process_matches_colocated(tiny_models, overlap):
    """P and D on one GPU in one process over cuda_ipc (CUDA cannot open a process's own IPC handle, so D
    takes P's cache tensor directly), CUDA graphs on: tokens as the colocated engine's."""
    ps = prompts()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=64)
    ref = LLM(tiny_models["qwen3"], **kw).generate(ps, params, use_tqdm=False)
    pair = LocalPair(tiny_models["qwen3"], "cuda_ipc", p_kw=kw, d_kw=kw, overlap=overlap)
    ids = [pair.p.submit(p, params) for p in ps]
    pair.p.close()
    pair.run()
    assert [pair.final[i].outputs[0].token_ids for i in ids] == [r.outputs[0].token_ids for r in ref]


@pytest.mark.parametrize("overlap", [False, True])
def test_structured_outputs_across_p_and_d_match_colocated(chat_model, overlap):
    """P samples the first token under the grammar, D compiles it too and advances it by P's token, then constrains
    the rest: every output is the colocated engine's (greedy and seeded), and each follows its constraint."""
    import json

    from picovllm import StructuredOutputsParams
    schema = {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "maxLength": 5}, "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
    constraints = [StructuredOutputsParams(json=schema), StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2,4}"),
                   StructuredOutputsParams(choice=["yes", "no", "maybe not"]), StructuredOutputsParams(json_object=True)]
    ps = ["Tell me about a person", "A code:", "Answer:", "Some JSON"]
    params = [SamplingParams(temperature=t, seed=3, max_tokens=40, structured_outputs=so)
              for so in constraints for t in (0.0, 0.9)]
    ps = [p for p in ps for _ in range(2)]
    ref = LLM(chat_model, block_size=4, num_kv_blocks=256).generate(ps, params, use_tqdm=False)
    pair = LocalPair(chat_model, "torch_dist", p_kw=dict(block_size=4, num_kv_blocks=256),
                     d_kw=dict(block_size=4, num_kv_blocks=256), overlap=overlap)
    ids = [pair.p.submit(p, sp) for p, sp in zip(ps, params)]
    pair.p.close()
    pair.run()
    assert_same([pair.final[i] for i in ids], ref)
    outs = [pair.final[i].outputs[0] for i in ids]
    assert any(o.finish_reason == "stop" for o in outs[:2])
    assert all(json.loads(o.text)["age"] in range(100) for o in outs[:2] if o.finish_reason == "stop")
    assert all(o.text in ("yes", "no", "maybe not") for o in outs[4:6])
    assert pair.d.stats.decode_tokens > 0


@pytest.mark.parametrize("where", ["request", "prefill_config"])
def test_a_grammar_after_the_reasoning_across_p_and_d_matches_colocated(thinking_model, where):
    """A constraint with its own reasoning parser (an OpenAI front end's), or none but P's EngineConfig's (D has
    none: the parser goes with the request): P and D each find where the prompt leaves the output (inside a think
    block here), D replays P's first token through its gate, and every output is the colocated engine's; the
    answer after </think> follows the constraint."""
    import re

    from transformers import AutoTokenizer

    from picovllm import StructuredOutputsParams
    tok = AutoTokenizer.from_pretrained(thinking_model)
    bias = {t: 100.0 for t in tok.encode("a</think>b", add_special_tokens=False)}   # a block closes by chance
    engine_parser = {"reasoning_parser": "deepseek_r1"} if where == "prefill_config" else {}
    so = StructuredOutputsParams(regex="[ab]{2,6}", reasoning_parser=None if engine_parser else "deepseek_r1")
    prompt = "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, logit_bias=bias, structured_outputs=so)
              for s in range(8)]
    kw = dict(block_size=4, num_kv_blocks=256)
    ref = LLM(thinking_model, **kw, **engine_parser).generate([prompt] * 8, params, use_tqdm=False)
    pair = LocalPair(thinking_model, "torch_dist", p_kw=dict(kw, **engine_parser), d_kw=kw, overlap=True)
    ids = [pair.p.submit(prompt, sp) for sp in params]
    pair.p.close()
    pair.run()
    assert_same([pair.final[i] for i in ids], ref)
    closed = [r.outputs[0].text.split("</think>", 1)[1] for r in ref if "</think>" in r.outputs[0].text]
    assert closed and all(re.fullmatch("[ab]{2,6}", c) for c in closed)
    assert so.reasoning_parser == (None if engine_parser else "deepseek_r1")     # the caller's params untouched


def test_a_first_token_the_decode_grammar_refuses_names_the_field(chat_model):
    """D advances its own matcher by P's tokens: one the grammar does not allow (P on another tokenizer or grammar
    version) is a ValueError naming the constraint, which refuses the offer."""
    from picovllm import StructuredOutputsParams
    from picovllm.engine.request import Request
    d = Engine(EngineConfig(chat_model, role="d", block_size=4, num_kv_blocks=64))
    tok = d.tokenizer
    params = SamplingParams(max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes"], source="guided_choice"))
    good = Request("a", tok.encode("Answer:"), params)
    good.output_token_ids = tok.encode("y")[:1]
    assert d.grammar_masks.state_on_decode(good, d.eos_token_ids).num_accepted == 1
    bad = Request("b", tok.encode("Answer:"), params)
    bad.output_token_ids = tok.encode("z")[:1]
    with pytest.raises(ValueError, match="^guided_choice: the prefill engine's token .* does not match the grammar"):
        d.grammar_masks.state_on_decode(bad, d.eos_token_ids)
    d.shutdown()


# -- D compiles an offered request's grammar off its loop -----------------------------------------------------------
def d_compiles(pair, monkeypatch, fail: bool = False, timeout_s: float = 10.0):
    """StructuredOutputCompiler.compile on D's compiler (P's runs as it is): held until the returned event is set
    (timeout_s at most), or failing with a ValueError naming the field. Returns the event and a list of (thread, the
    event set when it ended the hold) per such compile."""
    from picovllm.layers.structured_output import StructuredOutputCompiler
    release, calls = threading.Event(), []
    real = StructuredOutputCompiler.compile

    def compile(self, p):
        if self is not pair.d.grammar_masks.compiler:
            return real(self, p)
        calls.append([threading.current_thread(), None])
        if fail:
            raise ValueError(f"{p.field_name}: invalid choice list: not on this decode engine")
        calls[-1][1] = release.wait(timeout_s)
        return real(self, p)

    monkeypatch.setattr(StructuredOutputCompiler, "compile", compile)
    return release, calls


def choice_params():
    from picovllm import StructuredOutputsParams
    return SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no", "maybe not"], source="guided_choice"))


PLAIN = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_d_compiles_an_offered_grammar_off_its_loop(chat_model, monkeypatch, overlap):
    """While D compiles an offered request's grammar (held here), a request decoding on D runs to its end: the
    compile is on a thread of its own, not D's loop, which waited it out (every decode stalled for it). Once
    compiled the request joins D's batch; both outputs are the colocated engine's."""
    ref = LLM(chat_model, block_size=4, num_kv_blocks=256).generate(["A story:", "Answer:"], [PLAIN, choice_params()],
                                                                    use_tqdm=False)
    kw = dict(block_size=4, num_kv_blocks=256)
    pair = LocalPair(chat_model, "torch_dist", p_kw=kw, d_kw=kw, overlap=overlap)
    release, calls = d_compiles(pair, monkeypatch)
    a = pair.p.submit("A story:", PLAIN)
    step_until(pair, lambda: a in pair.d.requests)         # decoding on D
    b = pair.p.submit("Answer:", choice_params())
    step_until(pair, lambda: calls)                         # offered to D, its compile held
    step_until(pair, lambda: a in pair.final)
    assert calls[0][1] is None, "D's loop waited the compile out"      # a ran to its end with the compile held
    assert b not in pair.d.requests and b in pair.d.grammar_masks.offers    # not in the batch before it compiled
    release.set()
    pair.p.close()
    pair.run()
    assert_same([pair.final[a], pair.final[b]], ref)
    assert calls[0][0] is not threading.main_thread() and calls[0][1] is True


def test_an_offer_whose_grammar_does_not_compile_on_d_is_refused_naming_the_field(chat_model, monkeypatch):
    """D's compile of an offered grammar fails (another tokenizer or xgrammar there): D refuses the offer and P
    ends the request with an error naming the field, frees its blocks, and the pair serves on (a plain request's
    output is the colocated engine's). The compile ran off D's loop."""
    ref = LLM(chat_model, block_size=4, num_kv_blocks=256).generate(["A story:"], [PLAIN], use_tqdm=False)
    kw = dict(block_size=4, num_kv_blocks=256)
    pair = LocalPair(chat_model, "torch_dist", p_kw=kw, d_kw=kw)
    _, calls = d_compiles(pair, monkeypatch, fail=True)
    b = pair.p.submit("Answer:", choice_params())
    a = pair.p.submit("A story:", PLAIN)
    pair.p.close()
    pair.run()
    out = pair.final[b]
    assert out.outputs[0].finish_reason == "error"
    assert "guided_choice: invalid choice list: not on this decode engine" in out.error
    assert_same([pair.final[a]], ref)
    assert calls and all(thread is not threading.main_thread() for thread, _ in calls)
    # conftest: every block free on both engines


@pytest.mark.parametrize("how", ["p_aborts", "d_aborts", "d_closes"])
def test_an_offer_ended_while_its_grammar_compiles_on_d_frees_both_sides(chat_model, monkeypatch, how):
    """An offer that ends while D compiles its grammar (P aborts it, D aborts it, or D closes): D gives it back at
    once, P ends it (an abort, or an error saying why) and frees its blocks, and the compile, once it ends, adds
    nothing to D."""
    kw = dict(block_size=4, num_kv_blocks=256)
    pair = LocalPair(chat_model, "torch_dist", p_kw=kw, d_kw=kw)
    release, calls = d_compiles(pair, monkeypatch)
    b = pair.p.submit("Answer:", choice_params())
    step_until(pair, lambda: calls)
    if how == "p_aborts":
        out = pair.p.abort(b)
        assert out.outputs[0].finish_reason == "abort"
        pair.final[b] = out
    elif how == "d_aborts":
        assert pair.d.abort(b) is None          # P answers for it: its KV never came
    else:
        pair.d.close()
    step_until(pair, lambda: b in pair.final and not pair.p.connector.handovers and not pair.d.connector.offers)
    assert not pair.d.grammar_masks.offers
    if how != "p_aborts":
        assert pair.final[b].outputs[0].finish_reason == "error"
        assert ("aborted on the decode engine" if how == "d_aborts" else "closing") in pair.final[b].error
    release.set()
    step_until(pair, lambda: calls[0][1] is not None)      # the compile ended
    pair.p.close()
    pair.run()
    assert b not in pair.d.requests and pair.d.stats.prefill_tokens == 0 and pair.d.stats.decode_tokens == 0
