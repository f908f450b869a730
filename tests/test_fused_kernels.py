"""The fused Triton kernels of a decoder layer against float64 references computed here (not the layers' own
torch code): residual add + RMSNorm in one pass, and q/k RMSNorm + rotary straight from the QKV projection's
output; the KV store fused into the latter against the two launches it replaces (rope_qkv, then store_kv) and the
torch references; then a tiny Qwen3 run through them (interpreted on the CPU) against HF transformers.

Without CUDA the kernels run under TRITON_INTERPRET=1 (set before any kernel module is imported)."""
import random

import pytest
import torch

# sets TRITON_INTERPRET=1 without CUDA (before a kernel module loads), and skips the module without triton
from test_kernels import INTERPRET, compiled, interpreted

from picovllm import kernels                             # noqa: E402
from picovllm.kernels import rotary                       # noqa: E402
from picovllm.kernels.rmsnorm import rms_norm             # noqa: E402
from picovllm.kernels.store_kv import store_kv            # noqa: E402
from picovllm.layers.attention import KVWrite             # noqa: E402
from picovllm.layers.attention import store_kv as store_kv_ref   # noqa: E402

CASES = [   # (device, dtype, tolerance vs float64)
    interpreted("cpu", torch.float32, 1e-5, id="interp-fp32"),
    compiled("cuda", torch.bfloat16, 1e-2, id="gpu-bf16"),
    compiled("cuda", torch.float32, 1e-5, id="gpu-fp32"),
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


FUSED_CASES = [   # (device, dtype): bitwise comparisons, so bf16 on the interpreter too
    interpreted("cpu", torch.float32, id="interp-fp32"),
    interpreted("cpu", torch.bfloat16, id="interp-bf16"),
    compiled("cuda", torch.bfloat16, id="gpu-bf16"),
    compiled("cuda", torch.float32, id="gpu-fp32"),
]


@pytest.mark.parametrize("device,dtype", FUSED_CASES)
@pytest.mark.parametrize("fp8", [False, True], ids=["cache-dtype", "cache-fp8"])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("hq,hk,d", [(4, 1, 64), (4, 2, 128), (8, 8, 64), (2, 1, 256)])
def test_rope_qkv_stores_kv_as_store_kv_would(device, dtype, fp8, qk_norm, hq, hk, d):
    """rope_qkv given a KVWrite: q and k as without it, and caches byte for byte what store_kv (the Triton kernel
    and the torch reference) writes from rope_qkv's k and v; padding slots (-1) leave the cache untouched; qkv rows
    strided; fp8 with a per-head power-of-two scale small enough that some values clamp."""
    from picovllm.layers.rotary import RotaryEmbedding
    g = torch.Generator().manual_seed(hq * 1000 + hk * 100 + d + 2 * qk_norm + fp8)
    t, width, block_size, num_blocks = 6, (hq + 2 * hk) * d, 4, 5
    wide = (torch.randn(t, width + 16, generator=g) * 4).to(dtype).to(device)
    qkv = wide[:, 8:8 + width]                       # rows of stride width + 16
    pos = torch.tensor([0, 1, 5, 17, 40, 63], device=device)
    slots = torch.tensor([6, -1, 13, 0, -1, 19], device=device)   # shuffled, across blocks, two padding rows
    qw, kw = ((1 + 0.3 * torch.randn(d, generator=g)).to(dtype).to(device) if qk_norm else None for _ in range(2))
    cos_sin = RotaryEmbedding(d, 64, 10000.0).cos_sin.to(device)
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    # a sentinel in every untouched slot: what a padding row must leave as it is
    blank = torch.full((num_blocks, block_size, hk, d), 3.0).to(cache_dtype).to(device)
    scales = tuple(torch.pow(2.0, torch.randint(-9, -5, (hk,), generator=g)).float().to(device)
                   for _ in range(2)) if fp8 else None
    if fp8:
        scales[0][0] = 2.0 ** -9                     # small enough that some of head 0's keys clamp
    caches = [blank.clone() for _ in range(6)]       # fused, two-kernel, torch reference: (k, v) each
    eps = 1e-6
    q, k, v = rotary.rope_qkv(pos, qkv, hq, hk, cos_sin, qw, kw, eps, KVWrite(*caches[:2], slots, scales))
    q2, k2, v2 = rotary.rope_qkv(pos, qkv, hq, hk, cos_sin, qw, kw, eps)
    store_kv(k2, v2, *caches[2:4], slots, scales)
    real = [0, 2, 3, 5]                              # the torch reference knows no padding rows
    store_kv_ref(k2[real], v2[real], *caches[4:6], slots[real], scales)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
    as_bytes = (lambda c: c.view(torch.uint8)) if fp8 else (lambda c: c)   # noqa: E731
    fused, two, ref = [tuple(as_bytes(c).cpu() for c in caches[i:i + 2]) for i in (0, 2, 4)]
    for got, want, oracle in zip(fused, two, ref):
        assert torch.equal(got, want) and torch.equal(got, oracle)
    if fp8:
        assert (k.float().abs() / scales[0][:, None] > 448).any(), "some keys were meant to clamp"
    else:   # the rows stored are k and v themselves
        kc = caches[0].view(-1, hk, d)
        assert torch.equal(kc[slots[real]], k[real])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    assert torch.equal(as_bytes(caches[1]).cpu().view(-1, hk, d)[untouched],
                       as_bytes(blank).cpu().view(-1, hk, d)[untouched])


def test_rope_qkv_refuses_a_cache_it_cannot_write():
    cos_sin = torch.zeros(8, 16)
    qkv, pos, slots = torch.zeros(2, 4 * 16), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    cache = torch.zeros(3, 4, 1, 16)
    with pytest.raises(ValueError, match="kv_scales given"):
        rotary.rope_qkv(pos, qkv, 2, 1, cos_sin, kv_write=KVWrite(cache, cache, slots, (torch.ones(1),) * 2))
    fp8 = cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_scales missing"):
        rotary.rope_qkv(pos, qkv, 2, 1, cos_sin, kv_write=KVWrite(fp8, fp8, slots, None))
    with pytest.raises(ValueError, match="caches"):
        rotary.rope_qkv(pos, qkv, 2, 1, cos_sin, kv_write=KVWrite(torch.zeros(3, 4, 2, 8), cache, slots, None))


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


ROTATION_CASES = [interpreted("cpu", torch.float32, id="interp-fp32"),
                  compiled("cuda", torch.bfloat16, id="gpu-bf16"), compiled("cuda", torch.float32, id="gpu-fp32")]


@pytest.mark.parametrize("device,dtype", ROTATION_CASES)
@pytest.mark.parametrize("fp8", [False, True], ids=["cache-dtype", "cache-fp8"])
@pytest.mark.parametrize("hq,hk,d", [(4, 1, 64), (4, 2, 128), (3, 3, 80)])
def test_rope_qkv_applies_the_cache_rotation(device, dtype, fp8, hq, hk, d):
    """A KVWrite with the cache's rotation R (kv_rotation; d = 80: five 16-blocks, straddling the halves): q and k
    come back as rope(q) R and rope(k) R, and the caches hold what store_kv would store from rope(k) R and v R,
    all against float64 products (for fp8 the same e4m3 bytes but where the two roundings straddle a step)."""
    from picovllm.layers.attention import dequantize, kv_rotation
    from picovllm.layers.rotary import RotaryEmbedding
    g = torch.Generator().manual_seed(hq * 100 + d + fp8)
    t, width, block_size, num_blocks = 5, (hq + 2 * hk) * d, 4, 4
    qkv = (torch.randn(t, width, generator=g) * 2).to(dtype).to(device)
    pos = torch.tensor([0, 3, 9, 17, 30], device=device)
    slots = torch.tensor([5, -1, 0, 14, 9], device=device)
    cos_sin = RotaryEmbedding(d, 64, 10000.0).cos_sin.to(device)
    r = kv_rotation(d, dtype, device)
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    caches = [torch.zeros(num_blocks, block_size, hk, d).to(cache_dtype).to(device) for _ in range(4)]
    scales = tuple(torch.full((hk,), 2.0 ** -6, device=device) for _ in range(2)) if fp8 else None
    q, k, v = rotary.rope_qkv(pos, qkv, hq, hk, cos_sin, kv_write=KVWrite(*caches[:2], slots, scales, r))
    q0, k0, v0 = rotary.rope_qkv(pos, qkv, hq, hk, cos_sin)        # no write, no rotation
    r64 = r.double().cpu()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, plain in ((q, q0), (k, k0)):
        want = plain.double().cpu() @ r64
        assert ((got.double().cpu() - want).norm() / want.norm()).item() < tol
    real = slots >= 0                                # the torch reference knows no padding rows
    k_rot, v_rot = ((x.double().cpu() @ r64)[real.cpu()].to(dtype).to(device) for x in (k0, v0))
    store_kv_ref(k_rot, v_rot, *caches[2:], slots[real], scales)
    for got, want, scale in zip(caches[:2], caches[2:], scales or (None, None)):
        if fp8:
            same = got.view(torch.uint8) == want.view(torch.uint8)
            assert same.float().mean().item() > 0.98
            a, b = (dequantize(c, scale, torch.float64).cpu() for c in (got, want))
            assert ((a - b).abs() <= b.abs() / 8 + 1e-6).all()    # at most one e4m3 step apart
        else:
            assert ((got.double() - want.double()).norm() / want.double().norm()).item() < tol
    assert caches[0].flatten().ne(0).any() and caches[1].flatten().ne(0).any()


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_fp8_engine_with_the_rotation_in_rope_matches_the_torch_path(tiny_models, monkeypatch):
    """A tiny Qwen3 with fp8 KV on its CUDA path, interpreted: rope_qkv rotates q and k and stores K R, V R (no
    matmuls in Attention.forward, no separate store), and the greedy tokens are the torch reference path's."""
    from picovllm import LLM, SamplingParams
    rng = random.Random(7)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (4, 11)]
    kw = dict(device="cpu", block_size=8, num_kv_blocks=16, max_num_batched_tokens=8, kv_cache_dtype="fp8")
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)     # a chunked prefill, then decodes
    ref = [o.outputs[0].token_ids for o in LLM(tiny_models["qwen3"], attention_backend="torch", **kw).generate(
        prompts, sp, use_tqdm=False)]
    monkeypatch.setattr(kernels, "use_triton", lambda x: True)
    llm = LLM(tiny_models["qwen3"], attention_backend="triton", **kw)   # its calibration runs before any cache
    calls = []
    real = rotary.rope_qkv
    monkeypatch.setattr(rotary, "rope_qkv", lambda *a, **k: (
        calls.append(a[8] is not None and a[8].rotation is not None), real(*a, **k))[1])
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert calls and all(calls), "rope_qkv was meant to apply the rotation and store K/V"
    assert [o.outputs[0].token_ids for o in outs] == ref


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_tiny_qwen3_through_the_fused_kernels_matches_hf(tiny_models, monkeypatch):
    """Every layer on its CUDA path (fused norms, rope_qkv, SiLU-and-mul, Triton attention), interpreted on the
    CPU in float32: HF's greedy tokens, chunked prefill and decodes."""
    from picovllm import LLM, SamplingParams
    calls = []
    real = rotary.rope_qkv
    monkeypatch.setattr(kernels, "use_triton", lambda x: True)
    monkeypatch.setattr(rotary, "rope_qkv", lambda *a, **k: (calls.append(a[8] is not None), real(*a, **k))[1])
    rng = random.Random(3)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (4, 13)]
    llm = LLM(tiny_models["qwen3"], device="cpu", attention_backend="triton", block_size=8, num_kv_blocks=16,
              max_num_batched_tokens=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert calls and all(calls), "the model was meant to run rope_qkv, storing K/V in it"
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(tiny_models["qwen3"], prompts, 4)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_engine_with_the_store_in_rope_equals_the_separate_store(tiny_models, monkeypatch):
    """A tiny Qwen3 (q/k norm) on its CUDA path, interpreted: K/V stored by rope_qkv give the tokens and the very
    cache bytes of the separate store_kv launch (the backend made to refuse pre-stored K/V)."""
    from picovllm import LLM, SamplingParams
    from picovllm.kernels.backend import TritonAttentionBackend
    monkeypatch.setattr(kernels, "use_triton", lambda x: True)
    real = rotary.rope_qkv
    rng = random.Random(5)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (3, 10)]
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(TritonAttentionBackend, "accepts_stored_kv", fused)
        llm = LLM(tiny_models["qwen3"], device="cpu", attention_backend="triton", block_size=8, num_kv_blocks=8,
                  max_num_batched_tokens=8, enable_prefix_caching=False)
        calls = []
        monkeypatch.setattr(rotary, "rope_qkv", lambda *a, **k: (calls.append(a[8] is not None), real(*a, **k))[1])
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        assert calls and all(c == fused for c in calls)
        cache = llm.engine.runner.kv_cache
        runs.append(([o.outputs[0].token_ids for o in outs], cache.view(torch.uint8).clone()))
        assert cache.flatten().ne(0).any(), "the cache was meant to be written"
        llm.shutdown()
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1])


def test_kv_write_only_where_the_backend_takes_it_and_the_kernel_can_rotate():
    """Attention.kv_write: the Triton backend with a bound cache gets K/V stored by rope_qkv; not the torch
    reference backend, not before a cache is bound, and not a rotated cache of heads too narrow for rope_qkv's
    rotation (head_dim 16: its half-head products would be 8 wide); a rotated cache of head_dim 64 is passed its
    rotation."""
    from types import SimpleNamespace
    from picovllm.kernels.backend import TritonAttentionBackend
    from picovllm.layers.attention import Attention, kv_rotation
    a = Attention(4, 2, 16)
    meta = SimpleNamespace(slot_mapping=torch.zeros(3, dtype=torch.long))
    cache = torch.zeros(2, 4, 2, 16)
    a.k_cache = a.v_cache = cache
    assert a.kv_write(meta) is None, "the torch reference backend stores K/V itself"
    a.backend = TritonAttentionBackend()
    w = a.kv_write(meta)
    assert w is not None and w.k_cache is cache and w.slot_mapping is meta.slot_mapping and w.kv_scales is None
    a.kv_rotation = kv_rotation(16, torch.float32, "cpu")
    assert a.kv_write(meta) is None
    wide = Attention(4, 2, 64)
    wide.backend, wide.k_cache = TritonAttentionBackend(), torch.zeros(2, 4, 2, 64)
    wide.v_cache, wide.kv_rotation = wide.k_cache, kv_rotation(64, torch.float32, "cpu")
    w = wide.kv_write(meta)
    assert w is not None and w.rotation is wide.kv_rotation
    a.kv_rotation, a.k_cache = None, None
    assert a.kv_write(meta) is None


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", ["olmo2", "cohere2", "phi3_partial", "smollm3"])
def test_the_new_families_through_the_fused_kernels_match_hf(tmp_path, monkeypatch, case):
    """OLMo 2 (q/k normed over the projection before rope_qkv, no per-head norms), Cohere 2 (interleaved pairs
    reordered at load, NoPE global layers, a parallel block), partial rotary and SmolLM3's NoPE layers, every layer
    on its CUDA path (rope_qkv over the reordered or identity tables, Triton attention), interpreted on the CPU in
    float32: HF's greedy tokens through chunked prefill and decodes."""
    import test_more_families
    from picovllm import LLM, SamplingParams
    from test_parity_hf import hf_greedy
    path = test_more_families.build(str(tmp_path / case), case)
    calls = []
    real = rotary.rope_qkv
    monkeypatch.setattr(kernels, "use_triton", lambda x: True)
    monkeypatch.setattr(rotary, "rope_qkv", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    rng = random.Random(4)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (5, 11)]
    llm = LLM(path, device="cpu", attention_backend="triton", block_size=8, num_kv_blocks=16, max_num_batched_tokens=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert calls, "the model was meant to run rope_qkv"
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 4)[0]
