"""quantization="fp8": linear and expert weights as float8 e4m3 with a scale per output feature.

Oracles: e4m3's 254 finite values enumerated from its bit fields (sign, 4 exponent bits of bias 7, 3 mantissa bits),
each weight rounded to the nearest in float64; HF transformers with its projections' weights so rounded, for the
engine; the float64 product of the rounded weights, for the kernels (interpreted on the CPU, compiled on a GPU).
"""
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from picovllm import LLM, SamplingParams                       # noqa: E402
from picovllm.layers import fp8_weights                        # noqa: E402
from test_gemma_moe import build as build_family          # noqa: E402
from test_parity_hf import LOGPROB_ATOL, hf_greedy, make_prompts     # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA")]
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")),
           pytest.param("cuda", marks=ON_GPU)]


def e4m3_grid() -> torch.Tensor:
    """Every finite float8 e4m3fn value, in float64, ascending."""
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:      # the NaN code
                continue
            mag = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            vals += [mag, -mag]
    return torch.tensor(sorted(set(vals)), dtype=torch.float64)


def rounded(w: torch.Tensor, pow2: bool = False) -> torch.Tensor:
    """w [..., N, K] with each row scaled by its max |w| / 448 (float32; pow2: the next power of two up), rounded to
    the nearest e4m3 value, scaled back: the weights an fp8 model computes with, in float64."""
    grid = e4m3_grid()
    scale = w.abs().amax(-1).to(torch.float32) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).double()
    if pow2:
        scale = 2.0 ** torch.ceil(torch.log2(scale))
    v = w.double() / scale[..., None]
    nearest = grid[(v[..., None] - grid).abs().argmin(-1)]
    return nearest * scale[..., None]


def rounded_blocks(w: torch.Tensor, bn: int, bk: int, pow2: bool = False) -> torch.Tensor:
    """`rounded` with a scale per bn x bk block (the last ones cut short) instead of per row."""
    out = torch.empty(w.shape, dtype=torch.float64)
    for i in range(0, w.shape[0], bn):
        for j in range(0, w.shape[1], bk):
            blk = w[i:i + bn, j:j + bk]
            out[i:i + bn, j:j + bk] = rounded(blk.reshape(1, -1), pow2).reshape(blk.shape)
    return out


def test_block_scales_round_each_block_to_the_nearest_e4m3_value():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 96, generator=g) * torch.logspace(-2, 1, 70)[:, None]
    w[32:48, 48:] = 0                                      # an all-zero block
    codes, scale = fp8_weights.quantize_rows(w, block=(16, 48))
    assert scale.shape == (5, 2) and scale[2, 1] == 1
    assert torch.allclose(fp8_weights.dequantize(codes, scale, torch.float64, (16, 48)), rounded_blocks(w, 16, 48),
                          rtol=1e-6, atol=0)


def test_quantize_rows_rounds_to_the_nearest_e4m3_value():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(7, 96, generator=g) * torch.logspace(-3, 2, 7)[:, None]
    w[3] = 0                                               # an all-zero row: scale 1, codes 0
    w[5, 10] = -w[5].abs().max() * 2                       # the row's max is negative
    codes, scale = fp8_weights.quantize_rows(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (7,)
    assert scale[3] == 1 and codes[3].float().abs().max() == 0
    assert codes[5, 10].float() == -448                    # the largest magnitude maps to e4m3's largest value
    got = fp8_weights.dequantize(codes, scale, torch.float64)
    assert torch.allclose(got, rounded(w), rtol=1e-6, atol=0)


def fp8_case(m, n, k, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    codes, scale = fp8_weights.quantize_rows(torch.randn(n, k, generator=g) * 0.2)
    b = torch.randn(n, generator=g) if bias else None
    ref = x.double() @ fp8_weights.dequantize(codes, scale, torch.float64).T + (0 if b is None else b.double())
    return x, codes, scale, b, ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,n,k,bias", [(1, 48, 256, False), (5, 40, 200, True), (40, 24, 96, False),
                                        (70, 130, 72, True), (300, 20, 64, False),
                                        *(pytest.param(m, 1024, 3072, False, marks=ON_GPU) for m in (16, 33, 64, 200)),
                                        pytest.param(1, 256, 8192, True, marks=ON_GPU)])     # 1024-wide chunks
def test_fp8_gemm_matches_float64(device, m, n, k, bias):
    """Every tile size fp8_config picks (decode rows, mid batches, prefill), edges of N, K off every block, and the
    widened weight through cuBLAS (prefill's path)."""
    from picovllm.kernels.fp8_gemm import fp8_config, fp8_linear
    x, codes, scale, b, ref = fp8_case(m, n, k, bias)
    for dtype, tol in ([(torch.float32, 1e-5)] if device == "cpu" else [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]):
        bm, bn, bk, warps, stages, _ = fp8_config(m, n, k)
        if device == "cpu":      # the interpreter: small tiles
            bn, bk = min(bn, 32), min(bk, 64)
        from picovllm.kernels.fp8_gemm import TRITON_MAX_ROWS
        for method, w_kn in (("triton", True), ("triton", False), ("widen", None)):
            if method == "triton" and m > TRITON_MAX_ROWS and device == "cuda":
                continue        # past its rows fp8_linear widens; the interpreter still checks its tiles there
            config = (bm, bn, bk, warps, stages, w_kn) if device == "cpu" or w_kn else None   # GPU: fp8_config's
            y = fp8_linear(x.to(device, dtype), codes.to(device), scale.to(device),
                           None if b is None else b.to(device, dtype), config=config, method=method)
            assert y.dtype == dtype and y.shape == (m, n)
            err = ((y.double().cpu() - ref).norm() / ref.norm()).item()
            assert err < tol, (dtype, method, w_kn, err)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,n,k,block", [(3, 40, 96, (16, 32)), (70, 130, 200, (32, 64)), (9, 64, 256, (1, 128)),
                                         *(pytest.param(m, 1024, 3072, (128, 128), marks=ON_GPU)
                                           for m in (1, 64, 300))])
def test_fp8_gemm_with_block_scales_matches_float64(device, m, n, k, block):
    """A scale per block (an FP8 checkpoint's), blocks cut short at both edges; the kernel's chunks within a block."""
    from picovllm.kernels.fp8_gemm import fp8_linear
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g)
    codes, scale = fp8_weights.quantize_rows(torch.randn(n, k, generator=g) * 0.2, block=block)
    ref = x.double() @ fp8_weights.dequantize(codes, scale, torch.float64, block).T
    config = (max(16, 1 << (m - 1).bit_length()) if m <= 64 else 64, 16, 64, 4, 2, False) if device == "cpu" else None
    for method in (("triton", "widen") if m <= 64 or device == "cpu" else ("widen",)):
        y = fp8_linear(x.to(device), codes.to(device), scale.to(device), block=block, config=config, method=method)
        err = ((y.double().cpu() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (method, err)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_experts_with_fp8_weights_match_the_reference(device):
    """fused_experts on float8 experts (decode-sized and prefill-sized batches) against experts_reference on the
    dequantized weights in float64."""
    from picovllm.kernels.moe import fused_experts
    from picovllm.layers.activation import gated_activation
    from picovllm.layers.moe import experts_reference, route
    g = torch.Generator().manual_seed(3)
    experts, h, inter = 8, 32, 24
    gu_w = torch.randn(experts, 2 * inter, h, generator=g) * 0.3
    dn_w = torch.randn(experts, h, inter, generator=g) * 0.3
    act = gated_activation("silu")
    for block in (None, (16, 16)):     # a scale a row; a scale a block, down's K (24) cut short
        gu, gu_s = fp8_weights.quantize_rows(gu_w, block=block)
        dn, dn_s = fp8_weights.quantize_rows(dn_w, block=block)
        for tokens in (3, 150):
            x = torch.randn(tokens, h, generator=g)
            weights, ids = route(torch.randn(tokens, experts, generator=g), 2, True)
            ref = experts_reference(x.double(), weights.double(), ids,
                                    fp8_weights.dequantize(gu, gu_s, torch.float64, block),
                                    fp8_weights.dequantize(dn, dn_s, torch.float64, block), act)
            d = torch.device(device)
            out = fused_experts(x.to(d), weights.to(d), ids.to(d), gu.to(d), dn.to(d), act, None, None, gu_s.to(d),
                                dn_s.to(d), block)
            err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
            assert err < 1e-5, (block, tokens, err)


@pytest.mark.parametrize("device", DEVICES)
def test_to_f16_saturates_at_float16s_largest_value(device):
    """float8 experts' activations pass to float16 clamped at +-65504 (not infinity); NaN stays NaN; the rest is
    float16's rounding (torch's the oracle)."""
    from picovllm.kernels.moe import to_f16
    x = torch.tensor([1e5, -7e4, 65504.0, 65519.0, 1.5, -2.75e-3, 1e-8, 0.0, float("nan")]
                     + [0.1 * i for i in range(40)])
    got = to_f16(x.to(device)).cpu()
    want = x.clamp(-65504.0, 65504.0).to(torch.float16)
    assert got.dtype == torch.float16 and torch.equal(got[:-41].isnan(), want[:-41].isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA")
def test_bf16_activations_of_fp8_experts_take_float16_dots():
    """bfloat16 activations on float8 experts (the dots in float16): within bfloat16's rounding of the float64
    reference on the dequantized weights; an activation past float16's range gives finite outputs (saturated)."""
    from picovllm.kernels.moe import fused_experts
    from picovllm.layers.activation import gated_activation
    from picovllm.layers.moe import experts_reference, route
    g = torch.Generator().manual_seed(5)
    experts, h, inter = 16, 256, 128
    gu, gu_s = fp8_weights.quantize_rows(torch.randn(experts, 2 * inter, h, generator=g) * 0.05)
    dn, dn_s = fp8_weights.quantize_rows(torch.randn(experts, h, inter, generator=g) * 0.05)
    act = gated_activation("silu")
    for tokens in (1, 7, 64, 300):
        x = torch.randn(tokens, h, generator=g).to(torch.bfloat16)
        weights, ids = route(torch.randn(tokens, experts, generator=g), 4, True)
        ref = experts_reference(x.double(), weights.double(), ids,
                                fp8_weights.dequantize(gu, gu_s, torch.float64),
                                fp8_weights.dequantize(dn, dn_s, torch.float64), act)
        out = fused_experts(x.cuda(), weights.cuda(), ids.cuda(), gu.cuda(), dn.cuda(), act, None, None,
                            gu_s.cuda(), dn_s.cuda())
        assert out.dtype == torch.bfloat16
        err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (tokens, err)
        x[0, 3] = 1e5      # past float16's largest value
        assert fused_experts(x.cuda(), weights.cuda(), ids.cuda(), gu.cuda(), dn.cuda(), act, None, None,
                             gu_s.cuda(), dn_s.cuda()).isfinite().all()


def round_projections(model) -> None:
    """Every projection weight of an HF model (attention, MLP, experts) rounded as fp8 rounds it (`rounded`);
    embeddings, norms, routers and the LM head as they are."""
    for name, p in model.named_parameters():
        if "_proj" in name and p.dim() >= 2:
            p.copy_(rounded(p).float())


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return build_family(str(tmp_path_factory.mktemp("fp8moe") / "qwen3_moe"), "qwen3_moe")


def assert_matches_hf_rounded(path, prompts, **engine):
    ref, ref_lp = hf_greedy(path, prompts, 10, edit=round_projections)
    llm = LLM(path, quantization="fp8", block_size=8, num_kv_blocks=64, device="cpu", **engine)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, lp in zip(outs, ref_lp):
        assert [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] == \
            pytest.approx(lp, abs=LOGPROB_ATOL)
    assert llm.engine.scheduler.block_manager.num_free_blocks == 64
    return llm


def test_dense_fp8_engine_matches_hf_with_rounded_weights(tiny_models):
    """Qwen3 (q/k norms) on the CPU: the CPU keeps float32 weights holding the rounded values, its fast kernels
    (packed GEMMs, the C decode stack) run them; chunked prefill."""
    llm = assert_matches_hf_rounded(tiny_models["qwen3"], make_prompts(), max_num_batched_tokens=16)
    proj = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert proj.weight.dtype == torch.float32 and proj.packed is not None, "the CPU path: rounded float32, packed"


def test_moe_fp8_engine_matches_hf_with_rounded_weights(moe_model):
    """Qwen3-MoE (8 experts, top-2, a dense layer): the experts' weights rounded per expert and output row."""
    assert_matches_hf_rounded(moe_model, make_prompts(6))


def test_fp8_rounding_does_not_depend_on_tensor_parallelism(moe_model):
    """A row-parallel layer's rank holds part of each row: the row's scale is the max over the ranks, so TP=2 (gloo)
    gives TP=1's tokens (down_proj and the experts' down projections are row-parallel)."""
    from test_parity_hf import assert_tp2_matches_tp1
    assert_tp2_matches_tp1(moe_model, make_prompts(4), quantization="fp8", device="cpu")


def test_the_kernels_path_on_float8_weights_matches_the_cpu_path(moe_model, monkeypatch):
    """The model holding float8 codes (as on a GPU) with the layers routed through the Triton kernels, interpreted
    on the CPU: the rounded-float32 CPU engine's tokens."""
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1")
    from picovllm import kernels
    prompts = [[random.Random(s).randrange(3, 300) for _ in range(n)] for s, n in ((1, 3), (2, 9))]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kw = dict(quantization="fp8", block_size=8, num_kv_blocks=32, device="cpu", attention_backend="torch",
              enforce_eager=True)
    ref = [o.outputs[0].token_ids for o in LLM(moe_model, **kw).generate(prompts, sp, use_tqdm=False)]
    real = fp8_weights.quantize_model_weights
    monkeypatch.setattr(fp8_weights, "quantize_model_weights",
                        lambda model, keep_fp8, **kw: real(model, True, **kw))
    monkeypatch.setattr(kernels, "use_triton", lambda x: True)
    llm = LLM(moe_model, **kw)
    layer = llm.engine.runner.model.layers[0]
    assert layer.self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.experts.down_proj.dtype == torch.float8_e4m3fn
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == ref


def test_fp8_is_a_listed_quantization():
    from picovllm.config import EngineConfig
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model="x", quantization="fp4")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", ["dense", "moe"])
def test_gpu_fp8_engine_holds_float8_and_matches_the_cpu(tiny_models, moe_model, case):
    """On the GPU (CUDA graphs, float32 activations) the weights are float8 codes, half a bfloat16 model's bytes,
    and the tokens are the CPU fp8 engine's; in bfloat16, the prompts' logprobs stay near the CPU's."""
    path = tiny_models["qwen3"] if case == "dense" else moe_model
    prompts = make_prompts(6)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in LLM(path, quantization="fp8", device="cpu", num_kv_blocks=64)
           .generate(prompts, sp, use_tqdm=False)]
    llm = LLM(path, quantization="fp8", dtype="float32", num_kv_blocks=64)
    model = llm.engine.runner.model
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn if case == "dense" else \
        model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == cpu
    del llm
    bf16 = LLM(path, quantization="fp8", dtype="bfloat16", num_kv_blocks=64)
    ref = LLM(path, quantization="fp8", device="cpu", num_kv_blocks=64)
    lp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    ps = [p for p in prompts if len(p) > 1]
    errs = []
    for a, b in zip(bf16.generate(ps, lp, use_tqdm=False), ref.generate(ps, lp, use_tqdm=False)):
        errs += [abs(x[t].logprob - y[t].logprob) for x, y, t in
                 zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], a.prompt_token_ids[1:])]
    assert sum(errs) / len(errs) < 0.1


@pytest.mark.parametrize("storage", ["float32", "e8m0"])
def test_an_fp8_checkpoint_comes_back_as_its_own_codes(tmp_path, monkeypatch, storage):
    """quantization="fp8" on a block-quantized FP8 checkpoint (Qwen3-*-FP8's form, blocks that divide the weights;
    DeepSeek-V3.1's ue8m0 power-of-two scales): dequantized at load, quantized again in its blocks, the model holds
    the checkpoint's weights exactly (codes times scales; q, k and v's fused, gate and up's fused); run through the
    kernels (interpreted), its greedy tokens and logprobs are HF's on the checkpoint's float64 dequantization."""
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1")
    from conftest import build_tiny_checkpoint
    from safetensors.torch import load_file
    from test_fp8_checkpoints import QWEN3_FP8, assert_matches_hf, fp8_folders

    from picovllm import kernels
    from picovllm.loader.fp8 import scale_values
    src = build_tiny_checkpoint(str(tmp_path / "qwen3"), "qwen3")
    qc = {**QWEN3_FP8, "weight_block_size": [32, 64], "modules_to_not_convert": []}
    if storage == "e8m0":
        qc["scale_fmt"] = "ue8m0"
    fp8_path, dense_path, _ = fp8_folders(src, str(tmp_path), storage,
                                          (qc, (32, 64), "weight_scale_inv", storage, None))
    real = fp8_weights.quantize_model_weights
    monkeypatch.setattr(fp8_weights, "quantize_model_weights", lambda model, keep_fp8, **kw: real(model, True, **kw))
    monkeypatch.setattr(kernels, "use_triton", lambda x: True)
    llm = assert_matches_hf(dense_path, fp8_path, quantization="fp8", attention_backend="torch")
    sd = load_file(os.path.join(fp8_path, "model.safetensors"))

    def checkpoint(names: list[str]) -> torch.Tensor:
        """The named weights, each its codes times its blocks' scales in float64, stacked as the model fuses them."""
        from picovllm.loader.fp8 import Fp8Scheme
        scheme = Fp8Scheme.from_quantization_config(qc)
        return torch.cat([fp8_weights.dequantize(sd[n + ".weight"], scale_values(sd[n + ".weight_scale_inv"],
                                                                                 scheme, n).double(),
                                                 torch.float64, (32, 64)) for n in names])

    p = "model.layers.1."
    qkv = llm.engine.runner.model.layers[1].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_block == (32, 64)
    held = fp8_weights.dequantize(qkv.weight, qkv.weight_scale.double(), torch.float64, (32, 64))
    assert torch.equal(held, checkpoint([p + f"self_attn.{x}_proj" for x in "qkv"]))
    up = llm.engine.runner.model.layers[0].mlp.gate_up_proj
    held = fp8_weights.dequantize(up.weight, up.weight_scale.double(), torch.float64, (32, 64))
    assert torch.equal(held, checkpoint([f"model.layers.0.mlp.{x}_proj" for x in ("gate", "up")]))
    if storage == "e8m0":
        assert torch.equal(torch.exp2(torch.log2(qkv.weight_scale).round()), qkv.weight_scale), "powers of two"
    # the one linear the file kept unquantized (test_fp8_checkpoints.LEFT_DENSE) stays as it is
    assert llm.engine.runner.model.layers[1].mlp.down_proj.weight.dtype == torch.float32


def test_blocks_a_rank_or_a_fused_part_splits_take_a_scale_per_row(monkeypatch):
    """Under tensor parallelism (rank 1 of 2 here, no process group: this rank's own decision) a layer whose slice or
    fused parts cut the checkpoint's blocks takes per-row scales, with a warning; layers that fall on them keep the
    blocks."""
    from torch import nn
    monkeypatch.setattr(fp8_weights, "_fits_on_every_rank", fp8_weights._fits)

    from picovllm.distributed import TPGroup
    from picovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    tp = TPGroup(rank=1, size=2)
    model = nn.Module()
    model.qkv = QKVParallelLinear(64, 16, 4, 2, tp=tp)            # local: q 32 rows from 32, k and v 16 from 16
    model.gate_up = MergedColumnParallelLinear(64, [128, 128], tp=tp)   # gate and up 64 rows each
    for m in (model.qkv, model.gate_up):
        m.weight.data.normal_()
    assert fp8_weights.quantize_model_weights(model, keep_fp8=True, block=(16, 32)) == 2
    assert model.qkv.weight_block == (16, 32) and model.gate_up.weight_block == (16, 32)
    model.qkv = QKVParallelLinear(64, 16, 4, 2, tp=tp)
    model.qkv.weight.data.normal_()
    with pytest.warns(UserWarning, match=r"1 layers \(e\.g\. qkv\).*32x64"):
        fp8_weights.quantize_model_weights(model, keep_fp8=True, block=(32, 64))     # k's 16 rows cut a block
    assert model.qkv.weight_block is None and model.qkv.weight_scale.shape == (64,)


def test_fp8_checkpoint_blocks_under_tensor_parallelism(tmp_path):
    """TP=2 (gloo) on an FP8 checkpoint whose blocks every rank's slices fall on: its weights exactly (the CPU keeps
    them in float32), so HF's tokens on its dequantization."""
    from conftest import build_tiny_checkpoint
    from test_fp8_checkpoints import QWEN3_FP8, fp8_folders, prompts
    from test_parity_hf import hf_greedy as greedy
    src = build_tiny_checkpoint(str(tmp_path / "qwen3"), "qwen3")
    qc = {**QWEN3_FP8, "weight_block_size": [16, 32], "modules_to_not_convert": []}
    fp8_path, dense_path, _ = fp8_folders(src, str(tmp_path), "tp", (qc, (16, 32), "weight_scale_inv", "float32",
                                                                  None))
    ps = prompts()
    ref, _ = greedy(dense_path, ps, 8)
    with LLM(fp8_path, quantization="fp8", tensor_parallel_size=2, device="cpu", num_kv_blocks=64) as llm:
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_ranks_whose_slices_differ_agree_on_blocks(tmp_path, monkeypatch):
    """3 heads and 3 KV heads on 2 ranks: rank 0 holds 2 heads, rank 1 one, so o_proj's slice falls on 16 x 32 blocks
    on rank 0 (columns 0-31) and not on rank 1 (32-47). Both take per-row scales (a rank alone on per-row scales
    would all-reduce with a rank that does not: a hang), and the tokens are those of TP=1 with per-row scales."""
    from conftest import build_tiny_checkpoint
    from test_fp8_checkpoints import QWEN3_FP8, fp8_folders
    src = build_tiny_checkpoint(str(tmp_path / "qwen3"), "qwen3", num_attention_heads=3, num_key_value_heads=3,
                                head_dim=16)
    qc = {**QWEN3_FP8, "weight_block_size": [16, 32], "modules_to_not_convert": []}
    fp8_path, _, _ = fp8_folders(src, str(tmp_path), "uneven", (qc, (16, 32), "weight_scale_inv", "float32", None))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ps = [[5, 6, 7], [9, 10, 11, 12, 13]]
    with pytest.warns(UserWarning, match="fp8 weights"):
        with LLM(fp8_path, quantization="fp8", tensor_parallel_size=2, device="cpu", num_kv_blocks=64) as llm:
            tp2 = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
    from picovllm.layers.linear import RowParallelLinear
    real = fp8_weights._fits      # TP=1 with o_proj per row (48 inputs: the 3 heads), the rest in blocks, as TP=2 took
    monkeypatch.setattr(fp8_weights, "_fits", lambda m, block: real(m, block) and not (
        isinstance(m, RowParallelLinear) and m.weight.shape[1] == 48))
    with pytest.warns(UserWarning, match="fp8 weights"):
        tp1 = LLM(fp8_path, quantization="fp8", device="cpu", num_kv_blocks=64).generate(ps, sp, use_tqdm=False)
    assert tp2 == [o.outputs[0].token_ids for o in tp1]


def test_what_fp8_weights_cannot_run_is_refused(default_model_path):
    with pytest.raises(ValueError, match="quantization 'fp8'.*GGUF"):
        LLM(default_model_path, quantization="fp8", device="cpu")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A tiny Qwen3 FP8 checkpoint in 32 x 64 blocks (float32 scales), one linear (LEFT_DENSE) kept unquantized:
    (its folder, its dense reference's folder)."""
    from conftest import build_tiny_checkpoint
    from test_fp8_checkpoints import QWEN3_FP8, fp8_folders
    root = tmp_path_factory.mktemp("fp8ckpt")
    src = build_tiny_checkpoint(str(root / "qwen3"), "qwen3")
    fp8_path, dense_path, _ = fp8_folders(src, str(root), "blocks", ({**QWEN3_FP8, "weight_block_size": [32, 64]},
                                                                   (32, 64), "weight_scale_inv", "float32", None))
    return fp8_path, dense_path


def test_auto_keeps_in_fp8_what_the_checkpoint_holds_in_fp8(fp8_checkpoint, tmp_path):
    """What quantization "auto" runs in fp8 on a GPU: the layers whose every checkpoint tensor is float8 (q, k, v fused;
    gate, up fused), not the one it kept unquantized; with only those, the rest stays as loaded. Which checkpoints:
    blocks or channels (their codes come back), not per-tensor scales."""
    from conftest import build_tiny_checkpoint
    from test_fp8_checkpoints import LEFT_DENSE, fp8_folders

    from picovllm.loader.fp8 import float8_parameters
    from picovllm.loader.hf_folder import open_folder
    source = open_folder(fp8_checkpoint[0])
    assert source.fp8.block == (32, 64) and source.fp8.comes_back
    model = LLM(fp8_checkpoint[0], device="cpu", num_kv_blocks=16).engine.runner.model
    only = float8_parameters(model, source.fp8)
    linear = {n for n, p in model.named_parameters() if n.endswith("_proj.weight")}
    dense = LEFT_DENSE.removeprefix("model.") + ".weight"        # the model's own parameter names
    assert only == linear - {dense} and "layers.0.self_attn.qkv_proj.weight" in only
    assert fp8_weights.quantize_model_weights(model, keep_fp8=True, block=source.fp8.block, only=only) == len(only)
    assert model.layers[1].mlp.down_proj.weight.dtype == torch.float32
    assert model.layers[1].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    src = build_tiny_checkpoint(str(tmp_path / "qwen3"), "qwen3")
    for fmt, comes_back in (("ct_channel_dynamic", True), ("fp8_per_tensor_static", False)):
        path, _, _ = fp8_folders(src, str(tmp_path), fmt)
        fp8 = open_folder(path).fp8
        assert fp8.block is None and fp8.comes_back == comes_back, fmt


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_runs_an_fp8_checkpoint_in_fp8_by_default(fp8_checkpoint):
    """quantization "auto" on a GPU: the checkpoint's float8 layers hold its codes, its unquantized one stays float;
    the tokens are the CPU's (which runs the dequantized weights), float32 activations on both."""
    from safetensors.torch import load_file
    from test_fp8_checkpoints import prompts
    fp8_path = fp8_checkpoint[0]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in LLM(fp8_path, device="cpu", num_kv_blocks=64).generate(prompts(), sp,
                                                                                                  use_tqdm=False)]
    llm = LLM(fp8_path, dtype="float32", num_kv_blocks=64)
    model = llm.engine.runner.model
    sd = load_file(os.path.join(fp8_path, "model.safetensors"))
    assert torch.equal(model.layers[0].mlp.down_proj.weight.cpu().view(torch.uint8),
                       sd["model.layers.0.mlp.down_proj.weight"].view(torch.uint8))
    assert model.layers[1].mlp.down_proj.weight.dtype == torch.float32
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(), sp, use_tqdm=False)] == cpu
