"""Mixture of experts on the GPU (marked gpu; skipped without CUDA): the Triton grouped-GEMM path at Qwen3-30B-A3B's
layer shape against a float64 torch reference, and whole MoE models (Qwen3-MoE top-2 of 8 with a dense layer,
top-1 of 64, Mixtral) against HF transformers on the same tiny weights.

Tolerances: fp32 (exact fp32 dot products in Triton): greedy tokens equal HF's and logprobs within 5e-3 (CUDA's
summation orders); bf16: the kernel within 2e-2 relative error of float64 (bf16's 8-bit mantissa over 2048-long
dot products), and the model's prompt logprobs within 0.1 of HF fp32's on average.
"""
import pytest
import torch

from test_gemma_moe import build, prompts
from test_parity_hf import assert_gpu_bf16_near_hf, assert_gpu_fp32_matches_hf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("tokens", [1, 7, 256, 512, 2048])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_fused_experts_at_qwen3_30b_a3b_shape(tokens, act, dtype, tol):
    """hidden 2048, 128 experts of 768, top-8 renormalised (Qwen3-30B-A3B's MoE layer): every expert picked at
    2048 tokens, most unpicked at 1; 256, 512 and 2048 tokens take each of expert_tiles' three tiles."""
    from picovllm.kernels.moe import fused_experts
    from picovllm.layers.activation import gated_activation
    from picovllm.layers.moe import experts_reference, route
    g = torch.Generator(device="cuda").manual_seed(tokens)
    h, inter, e, k = 2048, 768, 128, 8
    x = torch.randn(tokens, h, generator=g, device="cuda")
    gate_up = torch.randn(e, 2 * inter, h, generator=g, device="cuda") * 0.02
    down = torch.randn(e, h, inter, generator=g, device="cuda") * 0.02
    weights, ids = route(torch.randn(tokens, e, generator=g, device="cuda"), k, renormalize=True)
    xd, gud, dd = (t.to(dtype) for t in (x, gate_up, down))
    ref = experts_reference(xd.double(), weights.double(), ids, gud.double(), dd.double(), gated_activation(act))
    out = fused_experts(xd, weights, ids, gud, dd, gated_activation(act))
    assert out.dtype == dtype and out.shape == (tokens, h)
    assert rel_err(out, ref) < tol


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_gpu")
    return {case: build(str(root / case), case) for case in ("qwen3_moe", "qwen3_moe_64", "mixtral", "qwen2_moe")}


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe_64", "mixtral", "qwen2_moe"])
def test_moe_model_fp32_matches_hf(moe_models, case):
    """CUDA graphs for the decode steps, Triton attention and experts, fp32: HF's greedy tokens and logprobs."""
    assert_gpu_fp32_matches_hf(moe_models[case], prompts())


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_moe_model_bf16_near_hf(moe_models, case):
    """bf16 on the GPU against HF fp32 on the same weights: each prompt token's logprob (the model's prediction at
    every position, routing included)."""
    assert_gpu_bf16_near_hf(moe_models[case], prompts(3))
