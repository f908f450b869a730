"""SamplingParams.prompt_logprobs against HF transformers' logits on the same weights (fp32, CPU): every
prompt token's logprob, rank and the top-k, through chunked prefill, prefix-cache hits, preemption,
overlapped scheduling, n > 1 and tensor parallelism."""
import pytest
import torch

from picovllm import LLM, SamplingParams
from test_parity_hf import LOGPROB_ATOL, make_prompts

TOPK = 3


def hf_prompt_logprobs(path, prompts):
    """Per prompt: [(token, its logprob, its rank, top-k ids)] for prompt tokens 1.., from HF's logits."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            logp = model(torch.tensor([p])).logits[0].double().log_softmax(-1)
        rows = []
        for i in range(1, len(p)):
            row = logp[i - 1]
            rows.append((p[i], row[p[i]].item(), int((row > row[p[i]]).sum()) + 1, row.topk(TOPK).indices.tolist()))
        out.append(rows)
    return out


def check(outs, ref):
    for o, rows in zip(outs, ref):
        got = o.prompt_logprobs
        assert got[0] is None and len(got) == len(rows) + 1
        for d, (tok, lp, rank, top) in zip(got[1:], rows):
            assert d[tok].logprob == pytest.approx(lp, abs=LOGPROB_ATOL)
            assert d[tok].rank == rank
            assert sorted(d, key=lambda t: d[t].logprob, reverse=True)[:TOPK] == top or set(top) <= set(d)
            assert {t for t, v in d.items() if v.rank is not None and v.rank <= TOPK} >= set(top)


@pytest.fixture(scope="module")
def reference(tiny_models):
    prompts = make_prompts()
    return prompts, hf_prompt_logprobs(tiny_models["qwen3"], prompts)


@pytest.mark.parametrize("kw", [
    dict(block_size=4, max_num_batched_tokens=7, num_kv_blocks=256, async_scheduling=True),   # chunks, overlap
    dict(block_size=16, max_num_batched_tokens=64, num_kv_blocks=9),                           # preemption
    dict(block_size=8, num_kv_blocks=128),                                                     # prefix cache
])
def test_prompt_logprobs_match_hf(tiny_models, reference, kw):
    prompts, ref = reference
    llm = LLM(tiny_models["qwen3"], device="cpu", **kw)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOPK)
    preempted, real = [], llm.engine.scheduler.preempt
    llm.engine.scheduler.preempt = lambda r: (preempted.append(r), real(r))
    check(llm.generate(prompts, sp, use_tqdm=False), ref)
    if kw["num_kv_blocks"] == 9:
        assert preempted, "the cache was meant to force a preemption"
    if kw.get("block_size") == 8:
        # again: the prompts' blocks are cached now, and scoring must not skip them
        outs = llm.generate(prompts, sp, use_tqdm=False)
        check(outs, ref)
        plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert max(o.num_cached_tokens for o in plain) > 0 and all(o.prompt_logprobs is None for o in plain)


def test_n_samples_share_one_scoring_and_bad_values_name_the_field(tiny_models, reference):
    prompts, ref = reference
    llm = LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=128)
    outs = llm.generate(prompts[4:6], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3,
                                                     prompt_logprobs=0), use_tqdm=False)
    for o, rows in zip(outs, ref[4:6]):
        assert len(o.outputs) == 2
        assert [d[tok].logprob for d, (tok, *_rest) in zip(o.prompt_logprobs[1:], rows)] == \
            pytest.approx([lp for _, lp, _, _ in rows], abs=LOGPROB_ATOL)
        assert all(len(d) == 1 for d in o.prompt_logprobs[1:])    # top-0: the prompt token alone
    for bad in (-2, 1.5, True):     # -1 is vLLM's whole vocabulary
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="prompt_logprobs must be <= the vocabulary size"):
        llm.generate([prompts[0]], SamplingParams(prompt_logprobs=10**6), use_tqdm=False)
    # (P/D: P scores the prompt and the handover carries it to D, test_disagg_engines.py)


def test_tp2_scores_the_prompt_like_tp1(tiny_models, reference):
    prompts, ref = reference
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOPK)
    with LLM(tiny_models["qwen3"], device="cpu", tensor_parallel_size=2, block_size=4, max_num_batched_tokens=16,
             num_kv_blocks=256, async_scheduling=True) as llm:
        check(llm.generate(prompts, sp, use_tqdm=False), ref)
