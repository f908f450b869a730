"""Greedy outputs and logprobs against HF transformers on the same weights (fp32, on the CPU even where a GPU is)."""
import random

import pytest
import torch

from picovllm import LLM, SamplingParams

LOGPROB_ATOL = 1e-3   # fp32 on both sides; differences come from summation order only


def hf_greedy(path, prompts, max_new_tokens, auto: str = "AutoModelForCausalLM", edit=None):
    """HF's greedy tokens and their logprobs; edit(model): a change to its weights first (under no_grad)."""
    import transformers
    # eager attention: the reference math in every transformers version (an older one's default sdpa path skips
    # Gemma 2's attention soft-capping)
    model = getattr(transformers, auto).from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    if edit is not None:
        with torch.no_grad():
            edit(model)
    outs, logps = [], []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                               min_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        toks = g.sequences[0, len(p):].tolist()
        outs.append(toks)
        logps.append([torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(g.logits, toks)])
    return outs, logps


def assert_gpu_fp32_matches_hf(path, prompts):
    """On the GPU in fp32 (CUDA graphs for decode, the Triton kernels): HF's greedy tokens, and their logprobs
    within 5e-3 (CUDA's summation orders)."""
    ref, ref_lp = hf_greedy(path, prompts, 12)
    llm = LLM(path, dtype="float32", num_kv_blocks=128, block_size=16, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, lp in zip(outs, ref_lp):
        assert [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] == \
            pytest.approx(lp, abs=5e-3)


def assert_tp2_matches_tp1(path, prompts, max_tokens: int = 8, **engine):
    """TP=2 (gloo on the CPU) gives TP=1's greedy tokens; engine: more LLM arguments for both."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tp1 = LLM(path, num_kv_blocks=64, **engine).generate(prompts, sp, use_tqdm=False)
    with LLM(path, tensor_parallel_size=2, num_kv_blocks=64, **engine) as llm:
        tp2 = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tp2] == [o.outputs[0].token_ids for o in tp1]


def assert_gpu_bf16_near_hf(path, prompts):
    """bf16 on the GPU against HF fp32 on the same weights: each prompt token's logprob (the model's prediction at
    every position) within 0.1 of HF's on average."""
    from transformers import AutoModelForCausalLM
    ps = [p for p in prompts if len(p) > 1]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=128)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    errs = []
    for p, o in zip(ps, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1)
        errs += [abs(d[t].logprob - ref[i, t].item()) for i, (d, t) in enumerate(zip(o.prompt_logprobs[1:], p[1:]))]
    assert sum(errs) / len(errs) < 0.1, sum(errs) / len(errs)


def make_prompts(n=8, seed=0, vocab=384):
    rng = random.Random(seed)
    lens = [1, 5, 16, 17, 31, 32, 47, 90][:n]
    return [[rng.randrange(vocab) for _ in range(L)] for L in lens]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama3", "llama_untied", "qwen3_tied"])
def test_greedy_matches_hf(tiny_models, arch):
    prompts = make_prompts()
    ref, ref_lp = hf_greedy(tiny_models[arch], prompts, 12)
    llm = LLM(tiny_models[arch], block_size=16, num_kv_blocks=64, device="cpu")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, lp in zip(outs, ref_lp):
        ours = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        assert ours == pytest.approx(lp, abs=LOGPROB_ATOL)


@pytest.mark.parametrize("block_size,budget,blocks", [
    (4, 7, 256),     # chunked prefill: every prompt over 7 tokens split across steps, mixed with decodes
    (8, 3, 256),     # tiny budget: chunks of 3 mixed with decodes
    (16, 64, 9),     # tiny cache: forces preemption and recompute
    (5, 16, 40),     # block size off every boundary, chunking and preemption together
])
def test_chunking_and_preemption_match_hf(tiny_models, block_size, budget, blocks):
    prompts = make_prompts()
    ref, _ = hf_greedy(tiny_models["qwen3"], prompts, 10)
    llm = LLM(tiny_models["qwen3"], block_size=block_size, max_num_batched_tokens=budget, num_kv_blocks=blocks,
              enable_prefix_caching=False, device="cpu")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_preemption_actually_happens(tiny_models):
    llm = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=30, enable_prefix_caching=False, device="cpu")
    eng = llm.engine
    preempted = []
    real = eng.scheduler.preempt
    eng.scheduler.preempt = lambda r: (preempted.append(r.request_id), real(r))
    prompts = make_prompts()
    ref, _ = hf_greedy(tiny_models["llama"], prompts, 8)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert preempted, "the cache was meant to be too small to hold every request"
    assert [o.outputs[0].token_ids for o in outs] == ref
