"""The dense families on the GPU (marked gpu; skipped without CUDA): Mistral and Phi-3 with and without a sliding window,
Gemma 2 (soft-capping, sliding layers; head_dim 256 with one KV head too) and Gemma 3 (head_dim 80), each against HF
transformers on the same tiny random weights, as tests/test_moe_gpu.py does for the MoE families.

Tolerances: fp32 (exact fp32 dot products in Triton, CUDA graphs for decode): HF's greedy tokens, logprobs within
5e-3 (CUDA's summation orders); bf16 against HF fp32: each prompt token's logprob within 0.1 on average.
"""
import pytest
import torch

import test_gemma_moe
import test_more_families
from picovllm import LLM, SamplingParams
from test_parity_hf import hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DENSE = {**{c: test_more_families for c in ("mistral", "mistral_window", "phi3", "phi3_window")},
         **{c: test_gemma_moe for c in ("gemma2", "gemma2_hd256_mqa", "gemma3")}}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families_gpu")
    return {case: module.build(str(root / case), case) for case, module in DENSE.items()}


@pytest.mark.parametrize("case", list(DENSE))
def test_fp32_matches_hf(models, case):
    ps = DENSE[case].prompts()
    ref, ref_lp = hf_greedy(models[case], ps, 12)
    llm = LLM(models[case], dtype="float32", num_kv_blocks=128, block_size=16, max_num_batched_tokens=16)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, lp in zip(outs, ref_lp):
        assert [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] == \
            pytest.approx(lp, abs=5e-3)


@pytest.mark.parametrize("case", ["mistral_window", "phi3", "gemma2", "gemma3"])
def test_bf16_near_hf(models, case):
    from transformers import AutoModelForCausalLM
    ps = [p for p in DENSE[case].prompts(3) if len(p) > 1]
    hf = AutoModelForCausalLM.from_pretrained(models[case], dtype=torch.float32, attn_implementation="eager").eval()
    llm = LLM(models[case], dtype="bfloat16", num_kv_blocks=128)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    errs = []
    for p, o in zip(ps, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1)
        errs += [abs(d[t].logprob - ref[i, t].item()) for i, (d, t) in enumerate(zip(o.prompt_logprobs[1:], p[1:]))]
    assert sum(errs) / len(errs) < 0.1, sum(errs) / len(errs)
