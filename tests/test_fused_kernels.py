"""The fused Triton kernels of a decoder layer against float64 references computed here (not the layers' own
torch code): residual add + RMSNorm in one pass, and q/k RMSNorm + rotary straight from the QKV projection's
output; then a tiny Qwen3 run through them (interpreted on the CPU) against HF transformers.

Without CUDA the kernels run under TRITON_INTERPRET=1 (set before any kernel module is imported)."""
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from picovllm import kernels                             # noqa: E402
from picovllm.kernels import rotary                       # noqa: E402
from picovllm.kernels.rmsnorm import rms_norm             # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
CASES = [   # (device, dtype, tolerance vs float64)
    pytest.param("cpu", torch.float32, 1e-5, id="interp-fp32",
                 marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", torch.bfloat16, 1e-2, id="gpu-bf16",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA")]),
    pytest.param("cuda", torch.float32, 1e-5, id="gpu-fp32",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA")]),
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


def rms64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("rows,n", [(1, 64), (7, 48), (33, 200)])
def test_residual_add_rmsnorm_one_pass(device, dtype, tol, rows, n):
    """(out, new residual) = (rmsnorm(x + residual) * w, x + residual), widths not a power of two included."""
    g = torch.Generator().manual_seed(rows * n)
    x, res = (torch.randn(rows, n, generator=g) * 3).to(dtype), torch.randn(rows, n, generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype)
    out, new_res = rms_norm(x.to(device), w.to(device), 1e-6, res.to(device))
    s64 = x.double() + res.double()
    assert rel_err(new_res, s64) < tol
    assert rel_err(out, rms64(s64, w, 1e-6)) < tol
    assert rel_err(rms_norm(x.to(device), w.to(device), 1e-6), rms64(x, w, 1e-6)) < tol   # no residual


def rope64(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """'rotate half' rotary of x [T, H, D] at positions pos, in float64 from the frequencies themselves."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None, None] * inv
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], dim=-1)


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("hq,hk,d", [(4, 2, 16), (3, 1, 24)])
def test_rope_qkv_from_the_projection_output(device, dtype, tol, qk_norm, hq, hk, d):
    """q, k normed per head (Qwen3) and rotated, straight from qkv rows that are strided views of a wider buffer;
    v comes back as a view of qkv itself."""
    from picovllm.layers.rotary import RotaryEmbedding
    g = torch.Generator().manual_seed(hq * 100 + d)
    t, width, theta = 6, (hq + 2 * hk) * d, 10000.0
    wide = torch.randn(t, width + 8, generator=g).to(dtype).to(device)
    qkv = wide[:, 4:4 + width]                       # rows of stride width + 8
    pos = torch.tensor([0, 1, 5, 17, 40, 63])
    qw = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype) if qk_norm else None
    kw = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype) if qk_norm else None
    cos_sin = RotaryEmbedding(d, 64, theta).cos_sin.to(device)
    q, k, v = rotary.rope_qkv(pos.to(device), qkv, hq, hk, cos_sin, qw if qw is None else qw.to(device),
                              kw if kw is None else kw.to(device), 1e-6)
    heads = qkv.cpu().view(t, hq + 2 * hk, d)
    q_in, k_in = heads[:, :hq], heads[:, hq:hq + hk]
    if qk_norm:
        q_in, k_in = rms64(q_in, qw, 1e-6), rms64(k_in, kw, 1e-6)
    assert q.shape == (t, hq, d) and k.shape == (t, hk, d) and q.is_contiguous() and k.is_contiguous()
    assert rel_err(q, rope64(q_in, pos, theta)) < tol and rel_err(k, rope64(k_in, pos, theta)) < tol
    assert v.data_ptr() == qkv.data_ptr() + (hq + hk) * d * qkv.element_size(), "v is a view of qkv"
    assert torch.equal(v.cpu(), heads[:, hq + hk:])


def _hf_greedy(path, prompts, n):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        outs.append(out[0, len(p):].tolist())
    return outs


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_tiny_qwen3_through_the_fused_kernels_matches_hf(tiny_models, monkeypatch):
    """Every layer on its CUDA path (fused norms, rope_qkv, SiLU-and-mul, Triton attention), interpreted on the
    CPU in float32: HF's greedy tokens, chunked prefill and decodes."""
    from picovllm import LLM, SamplingParams
    calls = []
    real = rotary.rope_qkv
    monkeypatch.setattr(kernels, "use_triton", lambda x: True)
    monkeypatch.setattr(rotary, "rope_qkv", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    rng = random.Random(3)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (4, 13)]
    llm = LLM(tiny_models["qwen3"], device="cpu", attention_backend="triton", block_size=8, num_kv_blocks=16,
              max_num_batched_tokens=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert calls, "the model was meant to run rope_qkv"
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(tiny_models["qwen3"], prompts, 4)
