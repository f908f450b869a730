"""Speculative decoding by n-gram lookup (EngineConfig.speculative_config; engine/spec_decode.py).

Oracles: a brute-force search for the drafts; HF transformers' greedy tokens on the same weights; for sampled
requests, the same engine without speculation (a token's seed stream is its output index's, so a seeded request
samples the very same tokens: any difference is a draft kept that the model did not sample, or a sampling row
resolved for the wrong position). Every test ends with every block free (conftest).
"""
from __future__ import annotations

import random

import pytest

from picovllm import LLM, EngineConfig, SamplingParams
from picovllm.engine.spec_decode import ngram_drafts
from serving_fixtures import chat_model  # noqa: F401 - a fixture
from test_parity_hf import assert_tp2_matches_tp1, hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tiny models on a shared 2-core machine

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def repetitive_prompts(n=6, seed=0, vocab=384):
    """Random phrases said two or three times (the tiny random models also fall into loops of their own): drafts
    are found, some kept, some not."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(vocab) for _ in range(3 + 2 * i)]
        out.append([rng.randrange(vocab) for _ in range(i)] + phrase * (2 + i % 2))
    return out


def brute_force_drafts(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest n in [lo, hi] whose last-n-token suffix occurs earlier; of those occurrences, the latest."""
    L = len(tokens)
    for n in range(min(hi, L - 1), lo - 1, -1):
        for i in range(L - n - 1, -1, -1):
            if tokens[i:i + n] == tokens[L - n:]:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_drafts_match_brute_force():
    import numpy as np
    rng = random.Random(1)
    for trial in range(3000):
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        lo = rng.randrange(1, 5)
        hi = lo + rng.randrange(0, 4)
        k = rng.randrange(1, 6)
        got = ngram_drafts(np.array(tokens, dtype=np.int64), k, lo, hi)
        assert got == brute_force_drafts(tokens, k, lo, hi), (tokens, k, lo, hi)


def spec_stats(llm) -> tuple[int, int]:
    s = llm.engine.stats
    return s.draft_tokens, s.accepted_tokens


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("engine", [dict(), dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=8),
                                    dict(async_scheduling=True),
                                    dict(async_scheduling=True, block_size=4, num_kv_blocks=40, max_num_batched_tokens=8)],
                         ids=["roomy", "chunked_and_preempted", "overlapped", "overlapped_chunked_and_preempted"])
def test_greedy_matches_hf(tiny_models, arch, engine, monkeypatch):
    from picovllm.engine.scheduler import Scheduler
    preempted, preempt = [], Scheduler.preempt
    monkeypatch.setattr(Scheduler, "preempt", lambda self, req: preempted.append(req) or preempt(self, req))
    prompts = repetitive_prompts()
    ref, _ = hf_greedy(tiny_models[arch], prompts, 24)
    llm = LLM(tiny_models[arch], speculative_config=SPEC, **engine)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    fed, kept = spec_stats(llm)
    assert 0 < kept < fed, (fed, kept)      # drafts were both kept and dropped
    assert bool(preempted) == ("num_kv_blocks" in engine)
    per_pos = llm.engine.accepted_per_pos     # a draft is kept only after every one before it
    assert sum(per_pos) == kept and per_pos == sorted(per_pos, reverse=True) and len(per_pos) == 3


def assert_speculation_changes_nothing(model: str, prompts, params, overlap: bool) -> LLM:
    """The engine with SPEC gives the plain engine's tokens, finish and stop reasons and, where asked, logprobs (the
    same top tokens, values within 1e-4); returns the speculating LLM."""
    plain = LLM(model).generate(prompts, params, use_tqdm=False)
    llm = LLM(model, speculative_config=SPEC, async_scheduling=overlap)
    for o, r in zip(llm.generate(prompts, params, use_tqdm=False), plain):
        a, b = o.outputs[0], r.outputs[0]
        assert (a.token_ids, a.finish_reason, a.stop_reason) == (b.token_ids, b.finish_reason, b.stop_reason)
        if b.logprobs is not None:
            for da, db in zip(a.logprobs, b.logprobs):
                assert sorted(da) == sorted(db)
                assert all(da[t].logprob == pytest.approx(db[t].logprob, abs=1e-4) for t in db)
    return llm


def sampled_params():
    return [SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=1.1, top_k=20, seed=4, max_tokens=18, ignore_eos=True,
                           presence_penalty=0.4, frequency_penalty=0.3, logprobs=2),
            SamplingParams(temperature=0.7, seed=5, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                           logit_bias={7: 2.0, 11: -5.0}, min_p=0.05),
            SamplingParams(temperature=0, max_tokens=20, min_tokens=12, stop_token_ids=[5, 9], logprobs=1),
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=-0.5)]


@pytest.mark.parametrize("overlap", [False, True])
def test_sampling_and_processors_equal_the_engine_without_speculation(tiny_models, overlap):
    """Seeded sampling with every filter and penalty, logit bias, min_tokens with stop ids, logprobs: each row of a
    speculative chunk is resolved for its own output position, so outputs equal the plain engine's."""
    prompts = repetitive_prompts(5, seed=2)
    params = sampled_params()
    llm = assert_speculation_changes_nothing(tiny_models["llama"], prompts, params, overlap)
    assert spec_stats(llm)[1 - overlap] > 0      # overlapped, drafts that keep failing back off: fed, maybe not kept


def test_stops_inside_a_kept_run_end_the_request_there(tiny_models):
    """A stop token, a max_tokens limit or max_model_len reached part way through a run of kept drafts: nothing after
    it is output, and the finish reasons are the plain engine's."""
    prompts = repetitive_prompts(6, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    free = LLM(tiny_models["qwen3"]).generate(prompts, greedy, use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[o.outputs[0].token_ids[7 + i]])
              for i, o in enumerate(free)]
    params[0] = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    plain = LLM(tiny_models["qwen3"], max_model_len=64).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_models["qwen3"], max_model_len=64, speculative_config=SPEC)
    outs = llm.generate(prompts, params, use_tqdm=False)
    reasons = set()
    for o, r in zip(outs, plain):
        a, b = o.outputs[0], r.outputs[0]
        assert (a.token_ids, a.finish_reason, a.stop_reason) == (b.token_ids, b.finish_reason, b.stop_reason)
        reasons.add(b.finish_reason)
    assert reasons == {"stop", "length"}
    assert spec_stats(llm)[1] > 0


def test_sliding_window_shorter_than_the_prompts_matches_hf(tmp_path):
    from test_more_families import build
    path = build(str(tmp_path / "mistral_window"), "mistral_window")       # window 20
    prompts = [p * 2 for p in repetitive_prompts(4, seed=4)]            # 12-60 tokens
    ref, _ = hf_greedy(path, prompts, 24)
    llm = LLM(path, block_size=4, speculative_config=SPEC)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert spec_stats(llm)[1] > 0


def test_tp2_matches_tp1(tiny_models):
    assert_tp2_matches_tp1(tiny_models["qwen3"], repetitive_prompts(4), max_tokens=16, speculative_config=SPEC)


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_engine_speculates_and_matches_colocated(tiny_models, overlap):
    from test_disagg_engines import LocalPair
    prompts = repetitive_prompts(4, seed=5)
    params = sampled_params()[:4]
    ref = LLM(tiny_models["llama"]).generate(prompts, params, use_tqdm=False)
    pair = LocalPair(tiny_models["llama"], d_kw=dict(speculative_config=SPEC), overlap=overlap)
    ids = [pair.p.submit(p, sp) for p, sp in zip(prompts, params)]
    pair.p.close()
    pair.run()
    for i, r in zip(ids, ref):
        a, b = pair.final[i].outputs[0], r.outputs[0]
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
    d_stats = pair.d.stats
    assert (d_stats.draft_tokens if overlap else d_stats.accepted_tokens) > 0     # overlapped: failing drafts back off


def test_prompt_logprobs_beside_a_speculating_decode_match_hf(tiny_models):
    """A speculative chunk is several sequences of the step (its decode rows): a prompt scored in the same step is
    still matched to its own request."""
    from test_prompt_logprobs import TOPK, check, hf_prompt_logprobs
    rng = random.Random(7)
    scored = [rng.randrange(384) for _ in range(40)]
    prompts = [list(range(380)), scored]     # the first drafts from its prompt at every step
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOPK)]
    llm = LLM(tiny_models["qwen3"], max_num_batched_tokens=400, speculative_config=SPEC)
    outs = llm.generate(prompts, params, use_tqdm=False)     # the scored prompt's second chunk beside drafts
    check(outs[1:], hf_prompt_logprobs(tiny_models["qwen3"], [scored]))
    assert spec_stats(llm)[0] > 0


@pytest.mark.parametrize("seed,overlap", [(None, False), (3, False), (None, True)])
def test_structured_requests_speculate_within_their_grammar(chat_model, seed, overlap):
    """A request under a grammar drafts only what the grammar takes, and every row is sampled under the grammar
    advanced by the drafts before it: outputs equal the plain engine's (greedy, and seeded sampling), match the
    grammar, and the grammar's requests did speculate."""
    structured_requests_speculate(chat_model, seed, dict(device="cpu", async_scheduling=overlap))


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", [None, 3])
def test_gpu_structured_requests_speculate_within_their_grammar(chat_model, seed):
    """The same on the GPU: the masks of the drafts' rows in the fused sampler (fp32)."""
    structured_requests_speculate(chat_model, seed, dict(dtype="float32", num_kv_blocks=256, async_scheduling=False))


def structured_requests_speculate(chat_model, seed, engine: dict) -> None:
    import json
    import re

    pytest.importorskip("xgrammar")   # the GPU machine's image lacks it unless its wheel is carried

    from picovllm import StructuredOutputsParams as SO
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": ["xy", "zw"]}}},
              "required": ["a"]}
    temp = dict(temperature=0) if seed is None else dict(temperature=0.8, seed=seed)
    prompts = ["abab abab abab abab", '{"a": ["xy", "xy", "zw", "xy", "xy", "zw"]} {"a": ["xy", "xy", "zw"', "hello hello",
               "one two one two one two"]
    params = [SamplingParams(max_tokens=24, structured_outputs=SO(regex="(ab|cd){4,12}"), **temp),
              SamplingParams(max_tokens=40, structured_outputs=SO(json=schema), **temp),
              SamplingParams(max_tokens=16, ignore_eos=True, **temp),
              SamplingParams(max_tokens=16, ignore_eos=True, structured_outputs=SO(choice=["one two one two", "x"]),
                             **temp)]
    plain = LLM(chat_model, **engine).generate(prompts, params, use_tqdm=False)
    llm = LLM(chat_model, speculative_config=SPEC, **engine)
    spied, real = [], llm.engine.scheduler.propose_drafts
    llm.engine.scheduler.propose_drafts = lambda req, room, running: spied.append(
        (req.grammar is not None, len(d := real(req, room, running)))) or d
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch("(ab|cd){4,12}", texts[0]) or outs[0].outputs[0].finish_reason == "length"
    if outs[1].outputs[0].finish_reason == "stop":
        json.loads(texts[1])
    assert texts[3] in ("one two one two", "x")
    # overlapped, a grammar's request drafts only without a token in flight (never, in this run): the others do
    grammar_drafts = sum(n for constrained, n in spied if constrained)
    assert grammar_drafts > 0 if not engine.get("async_scheduling") else sum(n for _, n in spied) > 0


@pytest.mark.parametrize("config,field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, "speculative_config.draft_model"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 1}, "speculative_config.disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max"),
    ('{"num_speculative_tokens": 2', "speculative_config is not valid JSON"),
])
def test_bad_configs_name_the_field(config, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        EngineConfig(speculative_config=config)


@pytest.mark.parametrize("other,field", [(dict(role="p"), "role"), (dict(runner="pooling"), "runner")])
def test_what_cannot_speculate_is_refused(other, field):
    with pytest.raises(ValueError, match=f"EngineConfig.{field} .* with speculative_config"):
        EngineConfig(speculative_config={"num_speculative_tokens": 2}, **other)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch,overlap", [("llama", False), ("qwen3", False), ("qwen3", True)])
def test_gpu_fp32_greedy_matches_hf_through_the_decode_graphs(tiny_models, arch, overlap):
    """On the GPU (fp32: batch shapes do not flip a near tie) speculative steps replay the decode CUDA graphs (the
    drafts as decode rows), steps with a prefill the mixed-step graphs; HF's greedy tokens either way."""
    prompts = repetitive_prompts()
    ref, _ = hf_greedy(tiny_models[arch], prompts, 24)
    llm = LLM(tiny_models[arch], dtype="float32", speculative_config=SPEC, max_num_batched_tokens=32, num_kv_blocks=256,
              async_scheduling=overlap)
    runner = llm.engine.executor.runner
    replays, run = [], runner.cuda_graphs.run
    runner.cuda_graphs.run = lambda step, *a: replays.append(len(step.input_ids) - len(step.seq_lens) == 0
                                                              and len(step.input_ids)) or run(step, *a)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    fed, kept = spec_stats(llm)
    assert 0 < kept < fed
    assert overlap or max(replays) > len(prompts), "no decode graph ran a step with drafts"


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_seeded_sampling_equals_the_engine_without_speculation(tiny_models):
    prompts = repetitive_prompts(5, seed=2)
    params = sampled_params()
    plain = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=256).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_models["llama"], dtype="float32", speculative_config=SPEC, num_kv_blocks=256)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o, r in zip(outs, plain):
        a, b = o.outputs[0], r.outputs[0]
        assert (a.token_ids, a.finish_reason, a.stop_reason) == (b.token_ids, b.finish_reason, b.stop_reason)
    assert spec_stats(llm)[1] > 0


def test_drafts_leave_every_decode_its_token_and_never_preempt():
    """The scheduler gives drafts what the token budget leaves after one token for each decode still to come, and
    the blocks they need only out of the free ones beyond a block of headroom per running request."""
    from picovllm.engine.block_manager import BlockManager
    from picovllm.engine.request import Request, RequestStatus
    from picovllm.engine.scheduler import Scheduler
    asked = []

    def drafts(req, room, running):
        asked.append(room)
        return [5] * min(4, room)

    def decoding(num_blocks, n, budget):
        """n requests of 3 prompt tokens and one output (one block of 4 each), decoding."""
        bm = BlockManager(num_blocks, 4, enable_prefix_caching=False)
        s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=budget, propose_drafts=drafts)
        reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50)) for i in range(n)]
        for r in reqs:
            s.add(r)
            assert bm.allocate(r, 4)
            r.num_computed_tokens, r.status = 3, RequestStatus.DECODING
            r.output_token_ids.append(9)
        s.waiting.clear()
        s.running.extend(reqs)
        return bm, s

    bm, s = decoding(40, 4, 8)
    out = s.schedule()                       # 4 decodes, 8 tokens: 4 left for drafts, the first one's to take
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1", "r2", "r3"]
    assert [len(c.drafts) for c in out.chunks] == [4, 0, 0, 0] and asked == [4]
    assert out.num_tokens == 8 and out.num_decodes == 8 and not out.preempted
    # 2 free blocks for 2 running requests: a draft's new block would eat the headroom, so there are none, and
    # nobody is preempted for them
    bm, s = decoding(4, 2, 64)
    out = s.schedule()
    assert [len(c.drafts) for c in out.chunks] == [0, 0] and not out.preempted and bm.num_free_blocks == 2


def test_disable_by_batch_size_keeps_large_batches_plain(tiny_models):
    prompts = repetitive_prompts(4)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    off = LLM(tiny_models["llama"], speculative_config={**SPEC, "disable_by_batch_size": 3})
    assert [o.outputs[0].token_ids for o in off.generate(prompts, sp, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in LLM(tiny_models["llama"]).generate(prompts, sp, use_tqdm=False)]
    assert off.engine.stats.drafts == 0          # four running: none speculates
    off.generate(prompts[:3], sp, use_tqdm=False)
    assert off.engine.stats.drafts > 0           # three: they do


def test_a_full_batch_still_speculates(tiny_models):
    """Drafts are decode rows beyond max_num_seqs (EngineConfig.max_decode_rows: up to 256, or max_num_seqs x
    (1 + k)): a batch of max_num_seqs requests speculates too."""
    assert EngineConfig(max_num_seqs=4, speculative_config=SPEC).max_decode_rows == 16
    assert EngineConfig(max_num_seqs=100, speculative_config=SPEC).max_decode_rows == 256
    assert EngineConfig(max_num_seqs=300, speculative_config=SPEC).max_decode_rows == 300
    assert EngineConfig(max_num_seqs=100).max_decode_rows == 100
    prompts = repetitive_prompts(4)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(tiny_models["llama"], max_num_seqs=4, speculative_config=SPEC)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_models["llama"], prompts, 12)[0]
    assert llm.engine.stats.drafts > 0


def test_overlapped_engine_backs_off_drafts_that_keep_failing_and_never_idles(tiny_models):
    """Overlapped, a speculative chunk costs its request the next step, so drafts that keep being refused back off
    (a prompt holding every token id always has a match; the model never follows it), and after a step that left
    every request out the engine still has work (a loop that waits for input would idle)."""
    prompt = list(range(384))
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    ref = LLM(tiny_models["llama"], async_scheduling=True).generate([prompt], sp, use_tqdm=False)
    llm = LLM(tiny_models["llama"], async_scheduling=True, speculative_config=SPEC)
    eng, idle = llm.engine, []
    real_step = eng.step

    def step(*a, **kw):
        out = real_step(*a, **kw)
        idle.append(eng.scheduler.has_work() and not eng.has_work())
        return out
    eng.step = step
    outs = llm.generate([prompt], sp, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert 0 < eng.stats.drafts <= 10, eng.stats       # 2 ** misses tokens between tries: not every other step
    assert not any(idle)


@pytest.mark.parametrize("overlap", [False, True])
def test_min_tokens_bans_hold_under_drafts_that_cross_it(tiny_models, overlap):
    """A speculative chunk whose drafts reach past min_tokens samples its later rows unbanned; when fewer drafts are
    kept than reached past it, the next step's first row is still before min_tokens and banned again (the stop ids,
    here every token the unconstrained run gives before min_tokens). Oracle: the engine without speculation."""
    prompts = repetitive_prompts(6, seed=4)
    free = LLM(tiny_models["llama"]).generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                              use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=24, min_tokens=m,
                             stop_token_ids=sorted(set(free[i].outputs[0].token_ids[:m])))
              for i, m in enumerate(range(3, 15, 2))]
    llm = assert_speculation_changes_nothing(tiny_models["llama"], prompts, params, overlap)
    assert spec_stats(llm)[0] > 0
