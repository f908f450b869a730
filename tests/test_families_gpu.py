"""The dense families on the GPU (marked gpu; skipped without CUDA): Mistral and Phi-3 with and without a sliding
window, Granite, SmolLM3 (NoPE layers), Phi-3 with partial rotary, OLMo 2, Gemma 2 (soft-capping, sliding layers; head_dim 256 with one KV head too) and Gemma 3 (head_dim 80), each against HF
transformers on the same tiny random weights, as tests/test_moe_gpu.py does for the MoE families.

Tolerances: fp32 (exact fp32 dot products in Triton, CUDA graphs for decode): HF's greedy tokens, logprobs within
5e-3 (CUDA's summation orders); bf16 against HF fp32: each prompt token's logprob within 0.1 on average.
"""
import pytest
import torch

import test_gemma_moe
import test_more_families
from test_parity_hf import assert_gpu_bf16_near_hf, assert_gpu_fp32_matches_hf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DENSE = {**{c: test_more_families for c in ("mistral", "mistral_window", "phi3", "phi3_window", "granite", "smollm3",
                                            "phi3_partial", "olmo2", "cohere2")},
         **{c: test_gemma_moe for c in ("gemma2", "gemma2_hd256_mqa", "gemma3")}}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families_gpu")
    return {case: module.build(str(root / case), case) for case, module in DENSE.items()}


@pytest.mark.parametrize("case", list(DENSE))
def test_fp32_matches_hf(models, case):
    assert_gpu_fp32_matches_hf(models[case], DENSE[case].prompts())


@pytest.mark.parametrize("case", ["mistral_window", "phi3", "gemma2", "gemma3", "granite", "smollm3", "phi3_partial",
                                  "olmo2", "cohere2"])
def test_bf16_near_hf(models, case):
    assert_gpu_bf16_near_hf(models[case], DENSE[case].prompts(3))
