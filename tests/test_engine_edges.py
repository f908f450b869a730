"""The engine core at its edges (a helper's randomized stress review; each case its minimal repro): the context's
end under overlapped scheduling, an abort while a step is in flight, num_cached_tokens across a preemption, and a
sliding-window model's prefix-cache hit larger than the cache. Oracles: HF transformers' greedy tokens, the same
engine without the feature, vLLM's definitions; every engine ends with every block free."""
import random

import pytest
import torch

from conftest import assert_engine_clean, build_tiny_checkpoint
from picovllm import LLM, SamplingParams
from test_parity_hf import hf_greedy


@pytest.fixture(scope="module")
def short_model(tmp_path_factory) -> str:
    """The tiny llama with a 256-token context."""
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("short") / "llama"), "llama", max_position_embeddings=256)


@pytest.mark.parametrize("max_tokens", [None, 6, 100])
def test_the_context_end_under_overlapped_scheduling(short_model, max_tokens):
    """A 250-token prompt in a 256-token context runs to exactly 256 tokens with the step in flight too (the
    pending token is the next step's, not one of those known): HF's 6 greedy tokens, finish length."""
    prompt = list(range(1, 251))
    want = hf_greedy(short_model, [prompt], 6)[0][0]
    for overlap in (False, True):
        llm = LLM(short_model, device="cpu", num_kv_blocks=64, async_scheduling=overlap)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert (list(out.token_ids), out.finish_reason) == (want, "length"), overlap
        assert_engine_clean(llm.engine)


def test_an_abort_while_a_step_is_in_flight_leaves_an_idle_loop_waiting(short_model):
    """Aborting the only request while its step is in flight: the engine has no work left, so a step loop waits for
    input (wait None) instead of polling at once (wait 0, a spinning engine thread), overlapped or not."""
    from picovllm.engine.step_loop import StepLoop
    for overlap in (False, True):
        llm = LLM(short_model, device="cpu", num_kv_blocks=64, async_scheduling=overlap)
        eng = llm.engine
        eng.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=50), request_id="a")
        for _ in range(3):
            eng.step()
        eng.abort("a")
        waits = []
        StepLoop(eng, lambda wait_s: waits.append(wait_s) or len(waits) < 5).run_until(lambda: False, lambda o: None)
        assert set(waits) == {None} and not eng.has_work(), (overlap, waits)
        assert_engine_clean(eng)


def test_num_cached_tokens_is_the_first_admissions_prompt_hit(short_model):
    """vLLM's num_cached_tokens: the prompt's tokens the prefix cache held when the request was first scheduled,
    never more than the prompt, and not recounted when a preempted request comes back (whose re-admission finds its
    own prompt and outputs cached). The tokens equal an engine's with room for all."""
    rng = random.Random(1)
    prompts = [[rng.randrange(384) for _ in range(10)] for _ in range(2)]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = LLM(short_model, device="cpu", block_size=4, num_kv_blocks=100,
               enable_prefix_caching=False).generate(prompts, sp, use_tqdm=False)
    llm = LLM(short_model, device="cpu", block_size=4, num_kv_blocks=15, enable_prefix_caching=True)
    preempted = []
    real = llm.engine.scheduler.preempt
    llm.engine.scheduler.preempt = lambda r: (preempted.append(r.request_id), real(r))[1]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert preempted
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert [o.num_cached_tokens for o in outs] == [0, 0]       # nothing of these prompts was cached at first
    again = llm.generate([prompts[0] + [1, 2]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert again.num_cached_tokens == 8                            # its first two blocks of 4
    assert_engine_clean(llm.engine)


def test_a_sliding_window_models_prefix_hit_past_the_cache(tmp_path):
    """Mistral with a 7-token window, a 64-token cache: a 100-token prompt whose first 40 tokens are cached takes
    only the cached blocks its window reads, so it runs (it raised 'cannot hold even its first chunk'), with HF's
    greedy tokens; as it does with prefix caching off."""
    import transformers
    cfg = transformers.MistralConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     rms_norm_eps=1e-5, initializer_range=0.2, sliding_window=7)
    torch.manual_seed(5)
    path = str(tmp_path / "mistral")
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    rng = random.Random(0)
    x = [rng.randrange(384) for _ in range(40)]
    y = [rng.randrange(384) for _ in range(60)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = hf_greedy(path, [x + y], 5)[0][0]
    for caching in (False, True):
        llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=16, max_num_batched_tokens=32,
                  enable_prefix_caching=caching)
        llm.generate([x], sp, use_tqdm=False)
        out = llm.generate([x + y], sp, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == want, caching
        assert out.num_cached_tokens == (40 if caching else 0)
        assert_engine_clean(llm.engine)


def test_another_eos_of_the_model_is_the_stop_reason(tmp_path):
    """A model whose config lists EOS ids [2, 5], its tokenizer's EOS 2: either stops generation (finish stop); 5,
    not the tokenizer's, is the stop_reason (vLLM moves the generation config's other EOS ids into stop_token_ids),
    2 is none. Each forced by logit_bias."""
    import json
    from serving_fixtures import build_tiny_chat_model
    path = build_tiny_chat_model(str(tmp_path / "m"))
    for name in ("config.json", "generation_config.json"):     # the latter's list wins, as in HF
        cfg = json.load(open(f"{path}/{name}"))
        json.dump({**cfg, "eos_token_id": [2, 5]}, open(f"{path}/{name}", "w"))
    llm = LLM(path, device="cpu", num_kv_blocks=32)
    assert llm.get_tokenizer().eos_token_id == 2
    for token, reason in ((2, None), (5, 5)):
        out = llm.generate([[10, 11, 12]], SamplingParams(temperature=0, max_tokens=5, logit_bias={token: 100}),
                           use_tqdm=False)[0].outputs[0]
        assert (list(out.token_ids), out.finish_reason, out.stop_reason) == ([token], "stop", reason)
    assert_engine_clean(llm.engine)


def test_max_tokens_unset_takes_the_room_a_smaller_kv_cache_leaves(short_model):
    """max_tokens unset is the room left (vLLM's): with a KV cache of 64 tokens under a 256-token context, a
    10-token prompt runs to the cache's 64 tokens (54 new, finish length) instead of being refused for asking 246;
    a given max_tokens past the cache is still refused by name."""
    llm = LLM(short_model, device="cpu", block_size=16, num_kv_blocks=4)
    assert llm.engine.max_model_len == 256
    out = llm.generate([list(range(1, 11))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (54, "length")
    with pytest.raises(ValueError, match=r"max_tokens \(60\) tokens exceed the KV cache \(64 tokens\)"):
        llm.generate([list(range(1, 11))], SamplingParams(max_tokens=60), use_tqdm=False)
    assert_engine_clean(llm.engine)


def test_a_sliding_window_models_drafts_keep_their_blocks_cached(tmp_path, monkeypatch):
    """Speculation on a model whose every layer slides (an 8-token window, blocks of 4): a step that keeps 9 drafts
    fills blocks that are already behind the window when the step ends. Each must be cached before it is given
    back, so the same text asked again hits every full block (it lost them: the hit stopped at the first lost one),
    as it does without speculation; and so must the blocks of the step that finishes the request (its kept drafts'
    KV was not counted). The output is forced to one token and the drafts are that token's (n-gram lookup drafts
    one token a step on a run of one token). Oracle: the count of full blocks, by hand."""
    from picovllm.engine import spec_decode
    monkeypatch.setattr(spec_decode, "ngram_drafts", lambda tokens, k, min_n, max_n: [9] * k)
    path = build_tiny_checkpoint(str(tmp_path / "sliding"), "qwen2", use_sliding_window=True, sliding_window=8,
                                 max_window_layers=0)
    prompt = [5, 6, 7, 8] + [9] * 12
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, allowed_token_ids=[9])   # drafts all kept
    spec = {"method": "ngram", "num_speculative_tokens": 9}
    for speculative_config, overlap in ((None, False), (spec, False), (spec, True)):
        llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=64, speculative_config=speculative_config,
                  async_scheduling=overlap)
        out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == [9] * 40
        if speculative_config:
            assert llm.engine.stats.accepted_tokens >= 30
        again = llm.generate([prompt + [9] * 40 + [5]], SamplingParams(temperature=0, max_tokens=1),
                             use_tqdm=False)[0]
        # every full block of the first request's computed tokens (its last token's KV was never computed)
        assert again.num_cached_tokens == (len(prompt) + 40 - 1) // 4 * 4, (speculative_config, overlap)
        assert_engine_clean(llm.engine)


def test_generated_request_ids_skip_those_a_caller_chose(short_model):
    """Requests added through the step API under ids of their caller's ("2", "3", "5") beside requests without one
    (LLM.generate, add_request with no id): the ids the engine makes up skip them. A made-up id was the counter's
    next value as it was, so LLM.generate failed with "request_id '2' is already in use", though it had named no
    id. Oracle: the same prompts generated on their own."""
    llm = LLM(short_model, device="cpu", block_size=4, num_kv_blocks=32)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [[8, 9], [10, 11, 12]]
    want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]   # ids 0 and 1
    eng = llm.engine
    for own in ("2", "3", "5"):
        eng.add_request([5, 6, 7], sp, request_id=own)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    rid = eng.add_request(prompts[0], sp)
    assert rid not in {"2", "3", "5"} | {o.request_id for o in outs}
    final = {}
    while eng.has_unfinished_requests():
        final.update({o.request_id: o for o in eng.step() if o.finished})
    assert list(final[rid].outputs[0].token_ids) == want[0]
    assert_engine_clean(eng)


def test_an_embedding_prompt_past_the_kv_cache_is_refused_naming_the_prompt(short_model):
    """A pooling engine's prompt longer than its KV cache is refused naming the prompt alone: an embedding request
    has no max_tokens, which the error named ("+ max_tokens (0)"). The engine embeds the next prompt as a roomy one
    does."""
    llm = LLM(short_model, device="cpu", runner="pooling", block_size=4, num_kv_blocks=4)      # 16 tokens
    with pytest.raises(ValueError, match=r"^prompt \(27\) tokens exceed the KV cache \(16 tokens\)$"):
        llm.embed([list(range(3, 30))], use_tqdm=False)
    got = llm.embed([list(range(3, 15))], use_tqdm=False)[0].outputs.embedding
    roomy = LLM(short_model, device="cpu", runner="pooling", block_size=4, num_kv_blocks=64)
    want = roomy.embed([list(range(3, 15))], use_tqdm=False)[0].outputs.embedding
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5
    assert_engine_clean(llm.engine)
