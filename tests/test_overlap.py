"""Overlapped scheduling (EngineConfig.async_scheduling): step N+1 is scheduled and launched before
step N's tokens are read. On CPU the device work is synchronous, but the bookkeeping is the same
as on a GPU: pending tokens, placeholders read from the previous step's sampled tensor, requests
that finish while the next step is in flight. Oracles: HF transformers (greedy) and the
non-overlapped engine, itself tested against HF elsewhere (sampling, stops, logprobs)."""
import random

import pytest

from picovllm import LLM, SamplingParams
from picovllm.engine.request import RequestStatus
from test_parity_hf import hf_greedy, make_prompts


def outputs(llm, prompts, params):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason, o.outputs[0].text)
            for o in llm.generate(prompts, params, use_tqdm=False)]


def test_config_validation():
    from picovllm.config import EngineConfig
    assert EngineConfig(device="cpu").async_scheduling is False          # auto: on for GPUs only
    assert EngineConfig(device="cpu", async_scheduling=True, tensor_parallel_size=2).async_scheduling   # TP too
    assert EngineConfig(device="cpu", async_scheduling=True, role="p").async_scheduling    # P and D overlap too
    assert EngineConfig(device="cpu", async_scheduling=True, role="d").async_scheduling
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(device="cpu", async_scheduling="yes")


@pytest.mark.parametrize("block_size,budget,blocks", [
    (16, 2048, 64),   # plain: prompts in one step, then decodes
    (4, 7, 256),      # chunked prefill mixed with decodes
    (16, 64, 9),      # tiny cache: preemption of requests whose token is still pending
    (5, 16, 40),      # off block boundaries, chunking and preemption together
])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_greedy_matches_hf(tiny_models, block_size, budget, blocks, prefix_caching):
    prompts = make_prompts()
    prompts += [prompts[6] + prompts[7][:20], prompts[6][:20]]      # shared prefixes: cache hits mid-run
    ref, _ = hf_greedy(tiny_models["qwen3"], prompts, 10)
    llm = LLM(tiny_models["qwen3"], block_size=block_size, max_num_batched_tokens=budget, num_kv_blocks=blocks,
              enable_prefix_caching=prefix_caching, async_scheduling=True)
    assert llm.engine.overlap
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_preemption_with_pending_tokens(tiny_models):
    llm = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=30, enable_prefix_caching=False,
              async_scheduling=True)
    eng = llm.engine
    pending_at_preemption = []
    real = eng.scheduler.preempt
    eng.scheduler.preempt = lambda r: (pending_at_preemption.append(r.num_pending_tokens), real(r))
    prompts = make_prompts()
    ref, _ = hf_greedy(tiny_models["llama"], prompts, 8)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert any(pending_at_preemption), "meant to preempt a request whose last token was still in flight"
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_sampling_stops_and_logprobs_equal_sync(tiny_models):
    """Seeds, min_tokens bans, stop ids, max_tokens and logprobs as in the non-overlapped engine."""
    path = tiny_models["llama"]
    prompts = make_prompts(seed=3)
    ref = hf_greedy(path, prompts[:1], 12)[0][0]
    stop_tok = ref[4]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok], ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok], min_tokens=7, ignore_eos=True),
              SamplingParams(temperature=1.3, seed=11, max_tokens=9, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.7, top_k=20, seed=5, max_tokens=1),
              SamplingParams(temperature=1.0, min_p=0.05, seed=2, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, logprobs=0, ignore_eos=True),
              SamplingParams(temperature=2.0, seed=9, max_tokens=12, ignore_eos=True)]
    batch = [prompts[0]] * 3 + prompts[3:8]
    sync = LLM(path, num_kv_blocks=64, max_num_batched_tokens=24)
    over = LLM(path, num_kv_blocks=64, max_num_batched_tokens=24, async_scheduling=True)
    a = sync.generate(batch, params, use_tqdm=False)
    b = over.generate(batch, params, use_tqdm=False)
    assert a[1].outputs[0].finish_reason == "stop" and len(a[1].outputs[0].token_ids) == 5
    for x, y in zip(a, b):
        cx, cy = x.outputs[0], y.outputs[0]
        assert (cy.token_ids, cy.finish_reason, cy.stop_reason) == (cx.token_ids, cx.finish_reason, cx.stop_reason)
        if cx.logprobs is not None:
            assert [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in cy.logprobs] == \
                   [{t: pytest.approx((lp.logprob, lp.rank)) for t, lp in d.items()} for d in cx.logprobs]


def test_stop_strings_equal_sync(default_llm):
    """Text stops are found on the host one step late; the extra token computed is dropped."""
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    base = default_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    stops = [base[0].outputs[0].text.split()[1], ","]
    params = [SamplingParams(temperature=0, max_tokens=12, stop=s) for s in stops]
    want = outputs(default_llm, prompts, params)
    eng = default_llm.engine
    eng.overlap = True             # the same loaded model, overlapped (config validation is tested above)
    try:
        got = outputs(default_llm, prompts, params)
    finally:
        eng.overlap = False
    assert got == want and all(w[1] == "stop" for w in want)


def test_submit_and_abort_while_a_step_is_in_flight(tiny_models):
    """Engine level: requests join between overlapped steps, and aborting one whose token is pending
    frees its blocks at once and drops that token."""
    llm = LLM(tiny_models["qwen2"], num_kv_blocks=64, async_scheduling=True)
    eng = llm.engine
    rng = random.Random(0)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (9, 23, 40)]
    ref, _ = hf_greedy(tiny_models["qwen2"], prompts, 8)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng.add_request(prompts[0], greedy, request_id="a")
    eng.add_request([1, 2, 3], greedy, request_id="victim")
    finished, steps = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 3:
            victim = eng.requests["victim"]
            assert victim.num_pending_tokens == 1 and victim.status == RequestStatus.DECODING
            out = eng.abort("victim")
            assert out.finished and out.outputs[0].finish_reason == "abort"
            assert not victim.block_table
            eng.add_request(prompts[1], greedy, request_id="b")
        if steps == 5:
            eng.add_request(prompts[2], greedy, request_id="c")
    assert "victim" not in finished
    assert [finished[r].outputs[0].token_ids for r in "abc"] == ref


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_overlap_equals_sync(tiny_models):
    """On the GPU (CUDA graphs, Triton kernels, fused sampler, non-blocking copies) the overlapped
    engine makes the same tokens as the one that waits for every step; fp32 so that batch-size
    dependent rounding cannot blur the comparison, and a greedy run checked against HF as well."""
    path = tiny_models["qwen3"]
    prompts = make_prompts() * 3
    params = [SamplingParams(temperature=0, max_tokens=10 + i % 5, ignore_eos=True) if i % 3 == 0 else
              SamplingParams(temperature=0.9, top_p=0.9 if i % 2 else 1.0, seed=i, max_tokens=12, ignore_eos=True,
                             logprobs=2 if i % 4 == 1 else None)
              for i in range(len(prompts))]
    kw = dict(dtype="float32", num_kv_blocks=128, max_num_batched_tokens=64)
    sync = LLM(path, async_scheduling=False, **kw)
    over = LLM(path, async_scheduling=True, **kw)
    assert over.engine.overlap and over.engine.runner.cuda_graphs is not None
    a = [o.outputs[0] for o in sync.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0] for o in over.generate(prompts, params, use_tqdm=False)]
    assert [x.token_ids for x in b] == [x.token_ids for x in a]
    ref, _ = hf_greedy(path, prompts[:8], 10)
    greedy = over.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == ref
    stop = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[x.token_ids[3]], ignore_eos=True)
            for x in a[:8]]
    want = [o.outputs[0].token_ids for o in sync.generate(prompts[:8], stop, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in over.generate(prompts[:8], stop, use_tqdm=False)] == want
