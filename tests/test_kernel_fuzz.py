"""Edge shapes for the Triton kernels against float64 references, and the wrappers' refusals of inputs outside their
contracts (each of which the kernels would otherwise read as other entries, silently).

Without CUDA the kernels run on CPU under TRITON_INTERPRET=1 (set before any kernel module is imported), in float32;
tolerances: attention rel. error 1e-5 (float32 against float64), elementwise 1e-5 absolute.
"""
import math
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from picovllm.kernels import moe                                          # noqa: E402
from picovllm.kernels.activation import silu_and_mul                      # noqa: E402
from picovllm.kernels.decode_attention import decode_attention            # noqa: E402
from picovllm.kernels.fp8_gemm import fp8_linear                          # noqa: E402
from picovllm.kernels.prefill_attention import prefill_attention          # noqa: E402
from picovllm.kernels.rmsnorm import rms_norm                             # noqa: E402
from picovllm.kernels.rotary import rope, rope_qkv                        # noqa: E402
from picovllm.kernels.skinny_gemm import skinny_linear                    # noqa: E402
from picovllm.kernels.store_kv import store_kv                            # noqa: E402
from picovllm.kernels.work_attention import max_work_items, work_attention, work_items, work_tile   # noqa: E402
from picovllm.layers.activation import SiluAndMul                         # noqa: E402
from picovllm.layers.moe import experts_reference, route                  # noqa: E402
from picovllm.layers.rotary import RotaryEmbedding, _rotate               # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (CPU tensors, float32)")


class Batch:
    """Sequences of ctx cached + q new tokens in a paged cache of shuffled blocks (every key already in the cache)."""

    def __init__(self, ctx, qlens, bs, hq, hkv, d, seed=0):
        g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
        self.seq_lens = [c + q for c, q in zip(ctx, qlens)]
        self.qlens, self.bs = list(qlens), bs
        nb = sum(-(-n // bs) for n in self.seq_lens) + 2
        perm = list(range(nb))
        rng.shuffle(perm)
        self.tables = []
        for n in self.seq_lens:
            k = -(-n // bs)
            self.tables.append(perm[:k])
            perm = perm[k:]
        width = max(1, max(len(t) for t in self.tables))
        self.kc, self.vc = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
        self.q = torch.randn(sum(qlens), hq, d, generator=g)
        self.bt = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)
        self.lens = torch.tensor(self.seq_lens, dtype=torch.int32)
        self.qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)

    def ref(self, scale, window=None, softcap=None, sinks=None, kv_scales=None):
        """Every query row's attention in float64, key by key from the block table (zeros for an empty sequence)."""
        kc, vc = self.kc.double(), self.vc.double()
        if kv_scales is not None:
            kc, vc = kc * kv_scales[0].double()[:, None], vc * kv_scales[1].double()[:, None]
        q = self.q.double()
        hq, hkv = q.shape[1], kc.shape[2]
        out = torch.zeros_like(q)
        for s, (n, ql) in enumerate(zip(self.seq_lens, self.qlens)):
            if n == 0:
                continue
            a, tab = int(self.qsl[s]), self.tables[s]
            keys = torch.stack([kc[tab[p // self.bs], p % self.bs] for p in range(n)])
            vals = torch.stack([vc[tab[p // self.bs], p % self.bs] for p in range(n)])
            idx = torch.arange(n)
            for i in range(ql):
                p = n - ql + i
                vis = (idx <= p) & (idx > p - window if window else True)
                for h in range(hq):
                    sc = keys[:, h // (hq // hkv)] @ q[a + i, h] * scale
                    if softcap:
                        sc = softcap * torch.tanh(sc / softcap)
                    sc = sc.masked_fill(~vis, -math.inf)
                    if sinks is not None:
                        sc = torch.cat([sc, sinks[h].double().view(1)])
                    w = sc.softmax(0)[:n]
                    out[a + i, h] = w @ vals[:, h // (hq // hkv)]
        return out

    def fp8(self, hkv, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.kc, self.vc = self.kc.to(torch.float8_e4m3fn), self.vc.to(torch.float8_e4m3fn)
        return torch.rand(hkv, generator=g) + 0.5, torch.rand(hkv, generator=g) + 0.5


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- attention on edge shapes (all pass as they stand)

@pytest.mark.parametrize("ctx,bs,hq,hkv,d,splits,window,softcap,sinks,fp8", [
    ([1, 3, 16, 17], 1, 4, 4, 64, None, None, None, False, False),   # block size 1; a 1-token context
    ([1, 3, 16, 17], 3, 3, 1, 80, 8, None, None, False, False),      # GQA 3, more splits than tiles
    ([16, 32, 33], 16, 8, 1, 96, 3, None, None, False, False),       # GQA 8, contexts ending at block/tile edges
    ([15, 48], 16, 6, 2, 128, 2, 16, None, True, False),             # window of exactly the context (16)
    ([1, 17], 3, 8, 8, 256, 1, 1, None, False, True),                # head_dim 256, window 1, fp8 cache
    ([33, 7], 16, 3, 1, 64, 40, None, 5.0, False, False),            # softcap, 40 splits for 3 tiles
    ([5, 0, 17], 16, 8, 2, 64, 3, None, None, True, True),           # a padding row (seq_len 0), sinks, fp8
])
def test_decode_attention_edges(ctx, bs, hq, hkv, d, splits, window, softcap, sinks, fp8):
    b = Batch([max(c - 1, 0) for c in ctx], [1] * len(ctx), bs, hq, hkv, d, seed=d + len(ctx))
    for i, c in enumerate(ctx):
        if c == 0:
            b.lens[i], b.seq_lens[i] = 0, 0
    sk = torch.randn(hq, generator=torch.Generator().manual_seed(1)) if sinks else None
    kvs = b.fp8(hkv) if fp8 else None
    ref = b.ref(d ** -0.5, window, softcap, sk, kvs)
    out = torch.full_like(b.q, float("nan"))
    decode_attention(b.q, b.kc, b.vc, b.bt, b.lens, d ** -0.5, out=out, block_n=16, num_splits=splits, window=window,
                     softcap=softcap, kv_scales=kvs, sinks=sk)
    assert not out.isnan().any() and rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("ctx,ql,bs,hq,hkv,d,window,softcap,sinks,fp8", [
    ([0, 0, 5], [1, 16, 11], 1, 4, 4, 64, None, None, False, False),   # block size 1; 1-token and tile-sized chunks
    ([3, 0], [13, 32], 3, 3, 1, 80, None, 5.0, False, False),          # GQA 3, softcap, two whole tiles
    ([16, 0], [16, 17], 16, 8, 1, 96, 1, None, True, False),           # GQA 8, window 1, sinks
    ([7, 20], [9, 12], 3, 6, 2, 128, 16, None, False, True),           # window 16 = a context, fp8
    ([0, 10], [16, 6], 16, 2, 1, 256, 16, None, True, True),           # head_dim 256
])
def test_prefill_attention_edges(ctx, ql, bs, hq, hkv, d, window, softcap, sinks, fp8):
    b = Batch(ctx, ql, bs, hq, hkv, d, seed=d + sum(ql))
    sk = torch.randn(hq, generator=torch.Generator().manual_seed(2)) if sinks else None
    kvs = b.fp8(hkv) if fp8 else None
    ref = b.ref(d ** -0.5, window, softcap, sk, kvs)
    out = torch.full_like(b.q, float("nan"))
    prefill_attention(b.q, b.kc, b.vc, b.bt, b.lens, b.qsl, 0, len(ctx), max(ql), d ** -0.5, out, block_m=16,
                      block_n=16, window=window, softcap=softcap, kv_scales=kvs, sinks=sk)
    assert not out.isnan().any() and rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("ctx,ql,bs,hq,hkv,d,window,softcap,sinks,fp8", [
    ([0, 15, 40, 0, 5], [1, 1, 1, 20, 11], 3, 3, 1, 80, None, None, False, False),   # a 1-token decode, chunks
    ([1500, 15, 0, 5], [1, 1, 17, 11], 16, 8, 1, 64, 16, None, True, False),        # split decode, window < a share
    ([1100, 15, 0, 5], [1, 1, 17, 11], 16, 6, 2, 80, None, 3.0, False, True),        # split decode, softcap, fp8
])
def test_work_attention_mixed_steps(ctx, ql, bs, hq, hkv, d, window, softcap, sinks, fp8):
    b = Batch(ctx, ql, bs, hq, hkv, d, seed=d + sum(ql))
    sk = torch.randn(hq, generator=torch.Generator().manual_seed(3)) if sinks else None
    kvs = b.fp8(hkv) if fp8 else None
    ref = b.ref(d ** -0.5, window, softcap, sk, kvs)
    tile, s = work_tile(hq // hkv), len(ql) + 2           # two padding sequences past the step's
    items, splits = work_items(ql, b.seq_lens, max_work_items(sum(ql), s, tile), tile)
    pad = lambda x, n, v: torch.cat([x, torch.full((n, *x.shape[1:]), v, dtype=x.dtype)])   # noqa: E731
    out = torch.full_like(b.q, float("nan"))
    work_attention(b.q, b.kc, b.vc, pad(b.bt, 2, 0), pad(b.lens, 2, 0), pad(b.qsl, 2, int(b.qsl[-1])),
                   torch.from_numpy(items), pad(torch.from_numpy(splits), 2, 0), d ** -0.5, out, block_n=16,
                   window=window, softcap=softcap, kv_scales=kvs, sinks=sk)
    assert (splits > 1).any() == (max(ctx) > 512)      # the long decodes are split
    assert not out.isnan().any() and rel_err(out, ref) < 1e-5


def test_attention_wrappers_refuse_caches_they_would_misread():
    """q's head_dim other than the cache's, or a V cache of other strides than K's (the kernels read V with K's):
    refused, where they read other entries silently before."""
    b = Batch([4], [1], 4, 2, 1, 32)
    wide = torch.zeros(*b.kc.shape[:3], 64)
    strided = torch.zeros(*b.kc.shape[:3], 64)[..., :32]        # the K cache's shape, other strides
    out = torch.empty_like(b.q)
    for kc, vc in [(wide, wide), (b.kc, strided)]:
        with pytest.raises(ValueError, match="decode_attention"):
            decode_attention(b.q, kc, vc, b.bt, b.lens, 0.1, out=out)
        with pytest.raises(ValueError, match="prefill_attention"):
            prefill_attention(b.q, kc, vc, b.bt, b.lens, b.qsl, 0, 1, 1, 0.1, out)
        items, splits = work_items([1], b.seq_lens, 8, work_tile(2))
        with pytest.raises(ValueError, match="work_attention"):
            work_attention(b.q, kc, vc, b.bt, b.lens, b.qsl, torch.from_numpy(items), torch.from_numpy(splits), 0.1,
                           out)
    with pytest.raises(ValueError, match="decode_attention"):           # an out of another shape
        decode_attention(b.q, b.kc, b.vc, b.bt, b.lens, 0.1, out=torch.empty(1, 2, 16))


def test_store_kv_refuses_rows_of_another_head_dim():
    """k of head_dim 16 into a cache of 32: refused (it wrote half rows before), padding slots still skipped."""
    k = torch.randn(3, 2, 16)
    kc = torch.zeros(4, 4, 2, 32)
    with pytest.raises(ValueError, match="store_kv"):
        store_kv(k, k, kc, kc.clone(), torch.arange(3))
    assert not kc.any()
    kc16, vc16 = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    store_kv(k, k, kc16, vc16, torch.tensor([-1, 5, -1]))
    assert torch.equal(kc16.view(-1, 2, 16)[5], k[1]) and kc16.view(-1, 2, 16)[[i for i in range(16) if i != 5]].eq(
        0).all()


# ---------------------------------------------------------------- rotary

@pytest.mark.parametrize("d,rd,hq,hk,norm", [(80, 40, 5, 5, True), (64, 32, 3, 1, False), (96, None, 7, 1, False)])
def test_rope_partial_rotary_and_last_position(d, rd, hq, hk, norm):
    """A partial rotary's padded table, head_dim 80/96 (halves not a power of two), the table's last position."""
    g = torch.Generator().manual_seed(d)
    maxp, t = 9, 4
    rot = RotaryEmbedding(d, maxp, 10000.0, rotary_dim=rd)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g)
    heads = qkv.view(t, hq + 2 * hk, d)
    pos = torch.tensor([0, maxp - 1, 3, maxp - 1])
    qw = kw = None
    q, k = heads[:, :hq].double(), heads[:, hq:hq + hk].double()
    if norm:
        qw, kw = torch.randn(d, generator=g), torch.randn(d, generator=g)
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * qw.double()
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * kw.double()
    cos, sin = rot.cos_sin[pos].double().unsqueeze(1).chunk(2, dim=-1)
    q_out, k_out, v = rope_qkv(pos, qkv, hq, hk, rot.cos_sin, qw, kw, 1e-6)
    assert (q_out.double() - _rotate(q, cos, sin)).abs().max() < 1e-5
    assert (k_out.double() - _rotate(k, cos, sin)).abs().max() < 1e-5
    assert torch.equal(v, heads[:, hq + hk:])


def test_rope_refuses_a_table_narrower_than_the_head():
    """A partial rotary's raw [max_pos, rotary_dim] table for heads of head_dim: the kernel would read sin from the
    next row (and past the table); refused. So are norm weights of another length."""
    qkv = torch.randn(2, 4 * 64)
    narrow = RotaryEmbedding(32, 8, 10000.0).cos_sin         # [8, 32]
    with pytest.raises(ValueError, match="cos_sin"):
        rope_qkv(torch.tensor([0, 1]), qkv, 2, 1, narrow)
    with pytest.raises(ValueError, match="cos_sin"):
        rope(torch.tensor([0, 1]), qkv.view(2, 4, 64)[:, :2], qkv.view(2, 4, 64)[:, 2:3], narrow)
    table = RotaryEmbedding(64, 8, 10000.0).cos_sin
    with pytest.raises(ValueError, match="norm weights"):
        rope_qkv(torch.tensor([0, 1]), qkv, 2, 1, table, torch.ones(32), torch.ones(32))


# ---------------------------------------------------------------- rmsnorm, activation

@pytest.mark.parametrize("n", [1, 7, 129])
def test_rms_norm_odd_sizes_and_a_strided_residual(n):
    """Odd hidden sizes; a residual whose rows are not contiguous (a transposed view) is read as it is, where the
    kernel read its rows at unit stride before (garbage)."""
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(4, n, generator=g), torch.randn(n, generator=g)
    r = torch.randn(n, 4, generator=g).t()
    out, res = rms_norm(x, w, 1e-6, r)
    s = (x + r).double()
    ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert torch.equal(res, x + r) and (out.double() - ref).abs().max() < 1e-5
    with pytest.raises(ValueError, match="rms_norm"):
        rms_norm(x, torch.ones(n + 1), 1e-6)


def test_silu_and_mul_refuses_an_odd_width():
    with pytest.raises(ValueError, match="silu_and_mul"):
        silu_and_mul(torch.randn(2, 7))


# ---------------------------------------------------------------- moe routing

@pytest.mark.parametrize("t,e,k", [(3, 4, 4), (2, 5, 5), (4, 7, 2)])
def test_route_topk_all_experts_and_ties(t, e, k):
    """top_k = the experts (every one chosen), a row of ties: the reference's weights and sets of ids."""
    x = torch.randn(t, e, generator=torch.Generator().manual_seed(e))
    x[0] = 1.0
    w, ids = moe.route_topk(x, k, True)
    w_ref, ids_ref = route(x, k, True)
    assert torch.allclose(w, w_ref, atol=1e-6)
    assert sorted(ids[0].tolist()) == list(range(k)) if k == e else len(set(ids[0].tolist())) == k
    assert all(set(a.tolist()) == set(b.tolist()) for a, b in zip(ids[1:], ids_ref[1:]))


def test_route_topk_refuses_more_than_the_experts_and_keeps_nan_rows_in_range():
    """top_k > E: refused (the kernel took padding lanes: NaN weights, ids past the experts). A row of NaN (or inf)
    logits: ids among the experts, NaN weights, as torch.topk gives; the kernel gave id E before (a padding lane's
    -1 beat every NaN), which grouped_gemm never computes (fused_experts then summed uninitialized rows)."""
    with pytest.raises(ValueError, match="top_k"):
        moe.route_topk(torch.randn(2, 4), 5, True)
    x = torch.randn(3, 6)
    x[0], x[1, 2], x[2, 0] = float("nan"), float("nan"), float("inf")
    w, ids = moe.route_topk(x, 2, True)
    assert ((ids >= 0) & (ids < 6)).all() and all(len(set(r.tolist())) == 2 for r in ids)
    assert w.isnan().all()


def test_fused_experts_of_no_tokens_give_no_rows():
    """A batch of 0 tokens: [0, H] as the reference gives (the final view's -1 could not be inferred, a RuntimeError);
    and a batch of 3 against the float64 reference, to show the same call computes."""
    g = torch.Generator().manual_seed(4)
    e, h, inter, k = 4, 32, 16, 2
    gate_up, down = torch.randn(e, 2 * inter, h, generator=g), torch.randn(e, h, inter, generator=g)
    act = SiluAndMul()
    for t in (0, 3):
        x = torch.randn(t, h, generator=g)
        weights, ids = route(torch.randn(t, e, generator=g), k, True)
        out = moe.fused_experts(x, weights, ids, gate_up, down, act)
        ref = experts_reference(x.double(), weights.double(), ids, gate_up.double(), down.double(), act)
        assert out.shape == (t, h) and (t == 0 or rel_err(out, ref) < 1e-5)


# ---------------------------------------------------------------- GEMMs

def test_skinny_linear_refuses_what_its_kernel_cannot_compute():
    """K not a multiple of BLOCK_K (the kernel read past each row), more rows than MAX_ROWS (it dropped rows past its
    16-row tile): refused, where both returned garbage (rel. error 1e19-1e27) before."""
    g = torch.Generator().manual_seed(0)
    cfg = (16, 256, 4, 1)
    for m, k in [(2, 300), (20, 256), (9, 256)]:
        with pytest.raises(ValueError, match="skinny_linear"):
            skinny_linear(torch.randn(m, k, generator=g), torch.randn(16, k, generator=g), config=cfg)
    with pytest.raises(ValueError, match="skinny_linear"):      # no config: skinny_config's K must be a multiple of 256
        skinny_linear(torch.randn(2, 300, generator=g), torch.randn(16, 300, generator=g))
    x, w = torch.randn(3, 768, generator=g), torch.randn(33, 768, generator=g)
    assert rel_err(skinny_linear(x, w, config=cfg), x.double() @ w.double().T) < 1e-5


@pytest.mark.parametrize("m,n,k,block", [(1, 17, 100, None), (3, 40, 129, None), (5, 33, 300, (16, 32))])
def test_fp8_linear_k_not_a_multiple_of_the_block(m, n, k, block):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g)
    w = (torch.randn(n, k, generator=g) * 3).to(torch.float8_e4m3fn)
    if block is None:
        s = torch.rand(n, generator=g) + 0.5
        wd = w.double() * s.double()[:, None]
    else:
        s = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) + 0.5
        wd = w.double() * s.double().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    b = torch.randn(n, generator=g)
    for method in ("triton", "widen"):
        assert rel_err(fp8_linear(x, w, s, b, block=block, method=method), x.double() @ wd.T + b.double()) < 1e-5


def test_fp8_linear_refuses_scales_of_another_shape():
    """Per-row scales for a blocked weight (or blocks of another size), x of another K: refused (read past)."""
    w = torch.randn(32, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_linear"):
        fp8_linear(torch.randn(2, 64), w, torch.ones(32), block=(16, 32))
    with pytest.raises(ValueError, match="fp8_linear"):
        fp8_linear(torch.randn(2, 64), w, torch.ones(1, 1), block=(16, 32))
    with pytest.raises(ValueError, match="fp8_linear"):
        fp8_linear(torch.randn(2, 48), w, torch.ones(32))
