"""fp8 KV cache kernels: the Triton store, decode and prefill kernels (interpreted on the CPU, compiled on a GPU:
marked gpu) against a float64 reference that quantizes and dequantizes by the rule of layers.attention (x / scale,
clamped to +-448, rounded to float8_e4m3fn; read back as x8 * scale), and against the torch backend's fp8 path.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from picovllm.kernels.backend import TritonAttentionBackend             # noqa: E402
from picovllm.kernels.decode_attention import decode_attention          # noqa: E402
from picovllm.kernels.prefill_attention import prefill_attention        # noqa: E402
from picovllm.kernels.store_kv import store_kv                          # noqa: E402
from picovllm.layers.attention import TorchAttentionBackend             # noqa: E402
from picovllm.layers.attention import store_kv as store_kv_ref          # noqa: E402
from test_kernels import CASES, INTERPRET, PagedBatch, rel_err           # noqa: E402

# float16 on the interpreter too: a half-precision q takes the kernels' float16 dot products (fp8_f16_dots)
CASES = CASES + [pytest.param("cpu", torch.float16, 5e-3, id="interp-fp16",
                              marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1"))]

FP8 = torch.float8_e4m3fn


def scales_for(hkv: int, device, seed: int, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head scales in [0.01, 0.03] (N(0, 1) values fit fp8's range, +-448 * scale; scaled up, some clamp);
    powers of two as the engine calibrates them, or arbitrary ones (the kernels take any)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(2, hkv, generator=g, dtype=torch.float64) * 0.02 + 0.01
    if pow2:
        s = torch.pow(2.0, s.log2().round())
    return s[0].float().to(device), s[1].float().to(device)


def quantize64(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float64 oracle of the store: round(clamp(x / scale)) to e4m3fn, computed from float64 values."""
    return (x.double().cpu() / scale.double().cpu()[:, None]).clamp(-448, 448).to(FP8)


def fp8_batch(ctx, qlen, block_size, hq, hkv, d, dtype, device, seed, pow2=True, spread=1.0):
    """A PagedBatch whose caches are fp8: the earlier context quantized with the scales, new K/V not stored yet."""
    b = PagedBatch(ctx, qlen, block_size, hq, hkv, d, dtype, device, seed=seed)
    ks, vs = scales_for(hkv, device, seed, pow2)
    b.k, b.v = b.k * spread, b.v * spread
    b.k_float, b.v_float = b.k_cache.float() * spread, b.v_cache.float() * spread   # before quantization
    b.k_cache = quantize64(b.k_cache.float() * spread, ks.cpu()).to(device)
    b.v_cache = quantize64(b.v_cache.float() * spread, vs.cpu()).to(device)
    return b, (ks, vs)


def reference64(b, k_cache, v_cache, scales, scale, window=None, softcap=None) -> torch.Tensor:
    """Causal (windowed, soft-capped) attention in float64 over the dequantized fp8 caches, all keys from the cache."""
    ks, vs = (s.double().cpu() for s in scales)
    kc = k_cache.cpu().double() * ks[:, None]
    vc = v_cache.cpu().double() * vs[:, None]
    q = b.q.cpu().double()
    meta = b.meta
    bs, hq, hkv = kc.shape[1], q.shape[1], kc.shape[2]
    out = torch.zeros_like(q)
    starts = meta.query_start_loc.tolist()
    for s, n in enumerate(meta.seq_lens_cpu):
        table = meta.block_tables[s].tolist()
        keys = torch.stack([kc[table[p // bs], p % bs] for p in range(n)])     # [n, Hkv, D]
        vals = torch.stack([vc[table[p // bs], p % bs] for p in range(n)])
        a, e = starts[s], starts[s + 1]
        pos_q = torch.arange(n - (e - a), n)[:, None]
        pos_k = torch.arange(n)[None, :]
        visible = pos_k <= pos_q
        if window is not None:
            visible &= pos_k > pos_q - window
        for h in range(hq):
            sc = q[a:e, h] @ keys[:, h // (hq // hkv)].T * scale
            if softcap:
                sc = softcap * torch.tanh(sc / softcap)
            p = sc.masked_fill(~visible, float("-inf")).softmax(-1)
            out[a:e, h] = p @ vals[:, h // (hq // hkv)]
    return out


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("block_size", [4, 16])
def test_store_fp8_matches_float64_quantization(device, dtype, tol, pow2, block_size):
    b, scales = fp8_batch([0, 3, 17], [5, 9, 2], block_size, 4, 2, 16, dtype, device, seed=1, pow2=pow2, spread=6.0)
    assert (b.k.abs().float() / scales[0][:, None] > 448).any(), "some values must hit the clamp"
    k_out, v_out = b.caches()
    pad = torch.full((2,), -1, dtype=torch.long, device=device)        # padding rows: nothing stored
    store_kv(torch.cat([b.k, b.k[:2] + 9]), torch.cat([b.v, b.v[:2] + 9]), k_out, v_out,
             torch.cat([b.meta.slot_mapping, pad]), scales)
    assert k_out.dtype == FP8
    # the float64 oracle: the untouched slots as they were, the new ones quantized from float64 values
    k64, v64 = b.caches()
    flat = lambda c: c.cpu().view(-1, *c.shape[2:]).view(torch.uint8)   # noqa: E731
    slots = b.meta.slot_mapping.cpu()
    k64, v64 = flat(k64).clone(), flat(v64).clone()
    k64[slots], v64[slots] = quantize64(b.k, scales[0]).view(torch.uint8), quantize64(b.v, scales[1]).view(torch.uint8)
    # division in float32 (kernels) and float64 (oracle) round the same unless a quotient falls on an fp8 tie:
    # with power-of-two scales it is exact; otherwise allow that one-in-a-million case, one step apart at most
    for got, want in ((flat(k_out), k64), (flat(v_out), v64)):
        diff = (got.int() - want.int()).abs()
        assert diff.max() <= (0 if pow2 else 1) and (diff > 0).float().mean() < 1e-3
    # and the torch reference (the CPU path) writes the same bytes as the kernel
    k_ref, v_ref = b.caches()
    store_kv_ref(b.k, b.v, k_ref, v_ref, b.meta.slot_mapping, scales)
    assert torch.equal(flat(k_out), flat(k_ref)) and torch.equal(flat(v_out), flat(v_ref))


def test_store_refuses_missing_or_stray_scales():
    b, scales = fp8_batch([0], [3], 4, 2, 1, 16, torch.float32, "cpu", seed=2)
    k_c, v_c = b.caches()
    with pytest.raises(ValueError, match="kv_scales missing"):
        store_kv(b.k, b.v, k_c, v_c, b.meta.slot_mapping)
    with pytest.raises(ValueError, match="kv_scales given"):
        store_kv(b.k, b.v, k_c.float(), v_c.float(), b.meta.slot_mapping, scales)


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("block_size,hq,hkv,d,ctx,splits,pow2", [
    (16, 4, 2, 32, [1, 31, 33, 70], 4, True),     # GQA 2, split-K
    (8, 8, 1, 16, [9, 24, 65], 1, False),         # MQA, one split (direct), arbitrary scales
    (5, 6, 2, 24, [4, 23], 3, True),              # GQA 3 (padded group), odd block size and head_dim
])
def test_decode_fp8_matches_float64(device, dtype, tol, block_size, hq, hkv, d, ctx, splits, pow2):
    b, scales = fp8_batch([n - 1 for n in ctx], [1] * len(ctx), block_size, hq, hkv, d, dtype, device,
                          seed=len(ctx), pow2=pow2)
    k_cache, v_cache = b.caches()
    store_kv(b.k, b.v, k_cache, v_cache, b.meta.slot_mapping, scales)
    scale = d ** -0.5
    out = torch.full_like(b.q, float("nan"))
    decode_attention(b.q, k_cache, v_cache, b.meta.block_tables, b.meta.seq_lens, scale, out=out, block_n=16,
                     num_splits=splits, kv_scales=scales)
    assert not out.isnan().any()
    assert rel_err(out.cpu(), reference64(b, k_cache, v_cache, scales, scale)) < tol
    # the torch backend's fp8 path (float32) agrees, and fp8 stays close to unquantized attention
    q32 = b.q.float()
    torch_out = TorchAttentionBackend._decode(q32, k_cache, v_cache, b.meta, scale, kv_scales=scales)
    assert rel_err(out, torch_out) < tol
    k_f, v_f = b.k_float.clone(), b.v_float.clone()
    store_kv_ref(b.k.float(), b.v.float(), k_f, v_f, b.meta.slot_mapping)
    exact = TorchAttentionBackend._decode(q32, k_f, v_f, b.meta, scale)
    assert rel_err(out, exact) < 0.1


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("window,softcap,pow2", [(None, None, True), (7, None, False), (None, 1.0, True)])
def test_backend_fp8_mixed_batch_matches_float64(device, dtype, tol, window, softcap, pow2):
    """Decodes, a fresh prefill and chunks over cached context through TritonAttentionBackend (store, then the
    decode and prefill kernels), against float64 over the dequantized cache and against the torch backend."""
    b, scales = fp8_batch([7, 30, 0, 5, 16], [1, 1, 20, 3, 40], 8, 4, 2, 16, dtype, device, seed=7, pow2=pow2)
    b.q *= 3
    scale = 0.25
    k_out, v_out = b.caches()
    out = TritonAttentionBackend().forward(b.q, b.k, b.v, k_out, v_out, b.meta, scale, window, softcap, scales)
    assert not out.isnan().any()
    assert rel_err(out.cpu(), reference64(b, k_out, v_out, scales, scale, window, softcap)) < tol
    k_ref, v_ref = b.caches()
    ref = TorchAttentionBackend().forward(b.q.float(), b.k.float(), b.v.float(), k_ref, v_ref, b.meta, scale,
                                          window, softcap, scales)
    assert rel_err(out, ref) < tol
    assert torch.equal(k_out.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_out.view(torch.uint8), v_ref.view(torch.uint8))


@pytest.mark.parametrize("device,dtype,tol", CASES)
def test_prefill_fp8_tiles_cross_chunk_boundaries(device, dtype, tol):
    b, scales = fp8_batch([0, 21], [37, 19], 8, 4, 2, 16, dtype, device, seed=3, pow2=False)
    k_cache, v_cache = b.caches()
    store_kv(b.k, b.v, k_cache, v_cache, b.meta.slot_mapping, scales)
    out = torch.full_like(b.q, float("nan"))
    prefill_attention(b.q, k_cache, v_cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc,
                      0, 2, 37, 0.25, out, block_m=16, block_n=16, kv_scales=scales)
    assert rel_err(out.cpu(), reference64(b, k_cache, v_cache, scales, 0.25)) < tol


@pytest.mark.parametrize("device,dtype,tol", CASES)
def test_prefill_fp8_over_a_work_list(device, dtype, tol, monkeypatch):
    """The mixed-step graphs' attention (kernels/work_attention.py): decodes (the first's keys in shares) and chunks
    in one work list, each program taking a KV head's 3 query heads (a masked row of 4), over an fp8 cache against
    the float64 oracle."""
    from picovllm.kernels import work_attention as wa
    monkeypatch.setattr(wa, "SPLIT_TOKENS", 16)
    qlen, ctx = [1, 1, 40, 5], [39, 9, 0, 17]
    b, scales = fp8_batch(ctx, qlen, 8, 6, 2, 16, dtype, device, seed=4, pow2=False)
    k_cache, v_cache = b.caches()
    store_kv(b.k, b.v, k_cache, v_cache, b.meta.slot_mapping, scales)
    tile = wa.work_tile(3)
    items, splits = wa.work_items(qlen, [c + q for c, q in zip(ctx, qlen)], wa.max_work_items(46, 4, tile), tile)
    assert splits.tolist() == [3, 1, 1, 1]
    to = dict(dtype=torch.int32, device=device)
    out = torch.full_like(b.q, float("nan"))
    wa.work_attention(b.q, k_cache, v_cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc,
                      torch.tensor(items, **to), torch.tensor(splits, **to), 0.25, out, block_n=16, kv_scales=scales)
    assert rel_err(out.cpu(), reference64(b, k_cache, v_cache, scales, 0.25)) < tol
