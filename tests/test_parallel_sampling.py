"""n samples per prompt in the offline API: sample i is the request with seed + i (seeded streams do not
depend on the batch: test_sampling.py), and the samples share the prompt's full KV blocks through the
prefix cache. conftest checks every block is free after each test."""
import pytest

from picovllm import LLM, SamplingParams
from picovllm.entrypoints.parallel_sampling import best_of, merge_samples, sample_params
from picovllm.layers.sampler import seeded_stream
from test_parity_hf import make_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_each_sample_is_its_own_seeded_request(tiny_models):
    llm = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=128)
    prompts = make_prompts()[2:5]
    sp = SamplingParams(n=3, temperature=1.0, top_k=30, seed=40, max_tokens=8, ignore_eos=True,
                        repetition_penalty=1.2)
    outs = llm.generate(prompts, [sp, SamplingParams(n=2, temperature=0, max_tokens=5), sp], use_tqdm=False)
    for o, p, n in zip(outs, prompts, (3, 2, 3)):
        assert o.prompt_token_ids == p and o.finished and [c.index for c in o.outputs] == list(range(n))
    for o, p in ((outs[0], prompts[0]), (outs[2], prompts[2])):
        alone = [llm.generate([p], SamplingParams(temperature=1.0, top_k=30, seed=40 + i, max_tokens=8,
                                                  ignore_eos=True, repetition_penalty=1.2),
                              use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
        assert [c.token_ids for c in o.outputs] == alone and len({tuple(t) for t in alone}) == 3
    greedy = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert [c.token_ids for c in outs[1].outputs] == [greedy.outputs[0].token_ids] * 2


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_samples_share_the_prompts_blocks(tiny_models, async_scheduling):
    """The siblings take the first sample's full prompt blocks from the cache: (n - 1) * full-block tokens hit,
    and the prefill work is one prompt plus n - 1 partial last blocks."""
    llm = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=128, async_scheduling=async_scheduling)
    prompt = make_prompts()[6]                            # 47 tokens: 11 full blocks, then 3 tokens
    bm, stats = llm.engine.block_manager, llm.engine.stats
    hits, prefill = bm.hit_tokens, stats.prefill_tokens
    out = llm.generate([prompt], SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert bm.hit_tokens - hits == 3 * 44
    assert stats.prefill_tokens - prefill == 47 + 3 * 3
    assert [len(c.token_ids) for c in out.outputs] == [6] * 4


def test_first_sample_that_ends_at_once_and_no_prefix_caching(tiny_models):
    llm = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    prompt = make_prompts()[4]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=1), use_tqdm=False)[0]
    alone = [llm.generate([prompt], SamplingParams(temperature=1.0, seed=9 + i, max_tokens=1),
                          use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
    assert [c.token_ids for c in out.outputs] == alone


def test_engine_takes_one_sample_per_request(tiny_models):
    llm = LLM(tiny_models["llama"], num_kv_blocks=64)
    with pytest.raises(ValueError, match=r"SamplingParams\.n must be 1 for Engine\.add_request"):
        llm.engine.add_request([1, 2, 3], SamplingParams(n=2))


def test_sample_params_merge_and_best_of_by_hand():
    from picovllm.outputs import CompletionOutput, RequestOutput
    sp = SamplingParams(n=3, seed=None, logit_bias={5: 1.0})
    kids = sample_params(sp)
    assert [k.n for k in kids] == [1, 1, 1] and [k.seed for k in kids] == [None] * 3
    assert kids[0].logit_bias == {5: 1.0} and kids[0].logit_bias is not kids[1].logit_bias
    assert [k.seed for k in sample_params(SamplingParams(n=2, seed=10), 4)] == [10, 11, 12, 13]
    # seed + i modulo 2**64: a negative seed's sample never lands on -1, "no seed" (seed -2, n 3: sample 1 was drawn
    # unseeded, another text each time), and each stream is the one seed + i gives (seeded_stream: modulo 2**63)
    kids = sample_params(SamplingParams(n=3, temperature=1.0, seed=-2))
    assert [k.seed for k in kids] == [2**64 - 2, 2**64 - 1, 0]
    assert [seeded_stream(k.seed, 7) for k in kids] == [seeded_stream(s, 7) for s in (-2, -1, 0)]
    outs = [RequestOutput("r", None, [1], [CompletionOutput(0, t, [i], lp, None, "length")], True, None, None, c)
            for i, (t, lp, c) in enumerate([("a", -3.0, 4), ("b", -1.0, 8), ("c", -2.0, 8)])]
    merged = merge_samples("r", outs)
    assert [(c.index, c.text) for c in merged.outputs] == [(0, "a"), (1, "b"), (2, "c")]
    assert merged.num_cached_tokens == 4 and merged.finished
    assert [(c.index, c.text) for c in best_of(merged, 2)] == [(0, "b"), (1, "c")]
