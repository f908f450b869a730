"""Attention sinks (GPT-OSS) in the Triton attention kernels, against the torch reference (TorchAttentionBackend).

Interpreted on the CPU (TRITON_INTERPRET=1), compiled on a GPU (marked gpu), as tests/test_kernels.py. Every case
has sinks from -2 to +5 across the heads (a dominating sink beside a negligible one; distinct per head, so a head
reading another's sink fails) and checks that they move the output. Decodes whose context is cut into splits (some
splits past a short context's end), padding rows of length 0, a prefill chunk over a cached prefix, a short chunk
through the decode kernel, sliding windows, GQA groups of 1, 2, 3 and 4, an fp8 cache, a work list with and
without split decodes; softcap with sinks is refused; the piecewise CUDA graphs record sinks and pass them back.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from picovllm.engine.piecewise_graph import PiecewiseGraphRunner, _Bucket, _CutAtAttention   # noqa: E402
from picovllm.engine.step_input import StepInput                       # noqa: E402
from picovllm.kernels import work_attention as wa                      # noqa: E402
from picovllm.kernels.backend import TritonAttentionBackend            # noqa: E402
from picovllm.kernels.decode_attention import decode_attention         # noqa: E402
from picovllm.kernels.prefill_attention import prefill_attention       # noqa: E402
from picovllm.layers.attention import TorchAttentionBackend, WorkList  # noqa: E402
from picovllm.layers.attention import store_kv as store_kv_ref         # noqa: E402
from test_fp8_kv_kernels import fp8_batch                              # noqa: E402
from test_kernels import CASES, PagedBatch, rel_err                    # noqa: E402

MOVED = 0.2      # how far the sinks must move the output from attention without them


def sinks_for(hq: int, device) -> torch.Tensor:
    """[hq] float32 logits between -2 and 5, each head's its own."""
    return torch.tensor([5.0, -2.0, 3.0, 0.5, -1.0, 2.0, 4.0, -0.5][:hq]).to(device)


def reference(b, k_cache, v_cache, scale, window=None, sinks=None, kv_scales=None):
    """The torch backend on float32 copies of the batch (fp8 caches as they are), the step's K/V already stored."""
    cast = (lambda c: c) if kv_scales is not None else (lambda c: c.float())   # noqa: E731
    return TorchAttentionBackend().forward(b.q.float(), b.k.float(), b.v.float(), cast(k_cache.clone()),
                                           cast(v_cache.clone()), b.meta, scale, window, None, kv_scales,
                                           sinks=None if sinks is None else sinks.float())


def check(out, b, k_cache, v_cache, scale, tol, window=None, sinks=None, kv_scales=None):
    assert not out.isnan().any()
    assert rel_err(out, reference(b, k_cache, v_cache, scale, window, sinks, kv_scales)) < tol
    assert rel_err(out, reference(b, k_cache, v_cache, scale, window, None, kv_scales)) > MOVED, "sinks ignored"


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("block_size,hq,hkv,ctx,splits,window", [
    (8, 4, 4, [1, 9, 40], 3, None),          # MHA; the 1-token context: splits 1 and 2 are past its end
    (8, 4, 2, [5, 33, 70], 4, None),         # GQA 2, split-K
    (16, 8, 2, [17, 50], 7, None),           # GQA 4, more splits than a short context fills
    (8, 6, 2, [3, 45], 1, None),             # GQA 3 (a padded group), one split: the direct write
    (8, 4, 1, [3, 40, 70], 3, 9),            # MQA under a window: splits over the window only
])
def test_decode_with_sinks_matches_torch(device, dtype, tol, block_size, hq, hkv, ctx, splits, window):
    b = PagedBatch([n - 1 for n in ctx], [1] * len(ctx), block_size, hq, hkv, 16, dtype, device, seed=len(ctx))
    k_cache, v_cache = b.caches()
    store_kv_ref(b.k, b.v, k_cache, v_cache, b.meta.slot_mapping)
    sinks = sinks_for(hq, device)
    out = torch.full_like(b.q, float("nan"))
    decode_attention(b.q, k_cache, v_cache, b.meta.block_tables, b.meta.seq_lens, 0.25, out=out, block_n=16,
                     num_splits=splits, window=window, sinks=sinks)
    check(out, b, k_cache, v_cache, 0.25, tol, window, sinks)


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("hq,hkv,window", [(4, 4, None), (4, 2, 6), (8, 2, None)])
def test_backend_with_sinks_matches_torch(device, dtype, tol, hq, hkv, window):
    """TritonAttentionBackend end to end (store, then the decode and prefill kernels): decodes of which the longer
    splits (into 64-token slices), a fresh prompt and a chunk over a cached prefix."""
    b = PagedBatch([7, 100, 0, 21], [1, 1, 37, 19], 8, hq, hkv, 16, dtype, device, seed=3)
    k_cache, v_cache = b.caches()
    sinks = sinks_for(hq, device)
    out = TritonAttentionBackend().forward(b.q, b.k, b.v, k_cache, v_cache, b.meta, 0.25, window, sinks=sinks)
    check(out, b, k_cache, v_cache, 0.25, tol, window, sinks)


@pytest.mark.parametrize("device,dtype,tol", CASES)
def test_prefill_kernel_with_sinks_over_small_tiles(device, dtype, tol):
    """The prefill kernel alone, tiles of 16 queries and 16 keys: every row of every tile starts from its sink."""
    b = PagedBatch([0, 21], [37, 19], 8, 4, 2, 16, dtype, device, seed=5)
    k_cache, v_cache = b.caches()
    store_kv_ref(b.k, b.v, k_cache, v_cache, b.meta.slot_mapping)
    sinks = sinks_for(4, device)
    out = torch.full_like(b.q, float("nan"))
    prefill_attention(b.q, k_cache, v_cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc,
                      0, 2, 37, 0.25, out, block_m=16, block_n=16, window=5, sinks=sinks)
    check(out, b, k_cache, v_cache, 0.25, tol, 5, sinks)


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("ctx,q_len,window", [(70, 5, None), (40, 12, 9)])
def test_short_prefill_with_sinks(device, dtype, tol, ctx, q_len, window):
    """A short chunk after decodes goes through the decode kernel, one row per query token (backend._short_prefill);
    with rows of length 0 appended (a CUDA graph's padding) the real rows are unchanged."""
    from picovllm.kernels import backend as be
    b = PagedBatch([3, 20, ctx], [1, 1, q_len], 8, 4, 2, 16, dtype, device, seed=6)
    b.meta.num_decodes = 2
    k_cache, v_cache = b.caches()
    sinks = sinks_for(4, device)
    out = TritonAttentionBackend().forward(b.q, b.k, b.v, k_cache, v_cache, b.meta, 0.25, window, sinks=sinks)
    check(out, b, k_cache, v_cache, 0.25, tol, window, sinks)
    pad = 3
    q = torch.cat([b.q, torch.randn(pad, *b.q.shape[1:]).to(b.q)])
    got = torch.empty_like(q)
    b.meta.query_lens_cpu = [1, 1, q_len + pad]
    be.TritonAttentionBackend._short_prefill(q, k_cache, v_cache, b.meta, q_len + pad, 0.25, got, window, None,
                                             None, sinks)
    assert rel_err(got[2:2 + q_len], out[2:2 + q_len]) < tol


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("window", [None, 7])
def test_backend_fp8_with_sinks_matches_torch(device, dtype, tol, window):
    """An fp8 cache (kv_scales): decodes (one split) and chunks, against the torch backend's fp8 path with sinks."""
    b, scales = fp8_batch([7, 30, 0, 5], [1, 1, 20, 3], 8, 4, 2, 16, dtype, device, seed=7, pow2=False)
    k_cache, v_cache = b.caches()
    sinks = sinks_for(4, device)
    out = TritonAttentionBackend().forward(b.q, b.k, b.v, k_cache, v_cache, b.meta, 0.25, window, None, scales,
                                           sinks=sinks)
    k_ref, v_ref = b.caches()
    store_kv_ref(b.k, b.v, k_ref, v_ref, b.meta.slot_mapping, scales)
    check(out, b, k_ref, v_ref, 0.25, tol, window, sinks, scales)


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("ctx,qlen,hq,hkv,window", [
    ([39, 9, 0, 17], [1, 1, 40, 5], 6, 2, None),      # group 3 (a masked head row), decodes then chunks
    ([70, 0, 12], [1, 20, 1], 4, 4, 9),              # no grouping, a window; a decode after a chunk
])
@pytest.mark.parametrize("split_tokens", [512, 16])   # 16: the decodes' keys in shares, then merged
def test_work_list_with_sinks_matches_torch(device, dtype, tol, ctx, qlen, hq, hkv, window, split_tokens,
                                            monkeypatch):
    """The backend given a work list (the mixed-step CUDA graphs' attention, kernels/work_attention.py): a split
    decode's sink is in its first share only, so the merge counts it once."""
    monkeypatch.setattr(wa, "SPLIT_TOKENS", split_tokens)
    b = PagedBatch(ctx, qlen, 8, hq, hkv, 16, dtype, device, seed=4)
    tile = wa.work_tile(hq // hkv)
    seq_lens = [c + q for c, q in zip(ctx, qlen)]
    items, splits = wa.work_items(qlen, seq_lens, wa.max_work_items(sum(qlen), len(qlen), tile), tile)
    assert (splits > 1).any() == (split_tokens == 16)
    to = dict(dtype=torch.int32, device=device)
    b.meta.work = WorkList(torch.tensor(items, **to), torch.tensor(list(splits) + [0, 1], **to))
    k_cache, v_cache = b.caches()
    sinks = sinks_for(hq, device)
    out = TritonAttentionBackend().forward(b.q, b.k, b.v, k_cache, v_cache, b.meta, 0.25, window, sinks=sinks)
    b.meta.work = None                      # the reference walks the host lists
    check(out, b, k_cache, v_cache, 0.25, tol, window, sinks)


def test_sinks_with_softcap_or_the_wrong_length_are_refused():
    """Before any launch, so on any device."""
    b = PagedBatch([3, 0], [1, 5], 8, 4, 2, 16, torch.float32, "cpu")
    m = b.meta
    sinks = sinks_for(4, "cpu")
    items = torch.zeros(1, 4, dtype=torch.int32)
    calls = {
        "decode_attention": lambda **kw: decode_attention(b.q[:1], b.k_cache, b.v_cache, m.block_tables[:1],
                                                          m.seq_lens[:1], 0.25, **kw),
        "prefill_attention": lambda **kw: prefill_attention(b.q, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                                                            m.query_start_loc, 1, 1, 5, 0.25, torch.empty_like(b.q),
                                                            **kw),
        "work_attention": lambda **kw: wa.work_attention(b.q, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                                                         m.query_start_loc, items, m.seq_lens, 0.25,
                                                         torch.empty_like(b.q), **kw),
    }
    for who, call in calls.items():
        with pytest.raises(ValueError, match=f"{who}: attention sinks with softcap"):
            call(softcap=30.0, sinks=sinks)
        with pytest.raises(ValueError, match=f"{who}: sinks of shape \\(2,\\)"):
            call(sinks=sinks[:2])


def test_piecewise_graphs_record_sinks_and_pass_them_back():
    """_CutAtAttention records a layer's sinks with its call; the replay passes them as a keyword, and only when set."""
    graphs = PiecewiseGraphRunner.__new__(PiecewiseGraphRunner)
    graphs.sizes, graphs._static, graphs.device = [64], {}, torch.device("cpu")
    graphs.tokens = torch.zeros(3, 64, dtype=torch.long)

    class Piece:
        def replay(self):
            pass
    graphs._begin_piece = lambda: None
    graphs._end_piece = lambda bucket: bucket.pieces.append(Piece())
    bucket = _Bucket()
    seen = []

    class Backend:
        def forward(self, q, k, v, *args, **kwargs):
            seen.append(kwargs)
            return q
    cut = _CutAtAttention(graphs, Backend(), bucket)
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    sinks = sinks_for(4, "cpu")
    cut.forward(q, k, k, None, None, None, 0.25, sinks=sinks)
    cut.forward(q, None, None, None, None, None, 0.25, kv_stored=True)
    bucket.pieces.append(Piece())
    assert bucket.calls[0].sinks is sinks and bucket.calls[1].sinks is None
    graphs.buckets, graphs.backends = {64: bucket}, [Backend(), Backend()]
    step = StepInput([0] * 4, list(range(4)), list(range(4)), [0, 4], [4], [[0]], 0, [], [])
    assert graphs.run(step) is None
    assert seen[0].keys() == {"sinks"} and seen[0]["sinks"] is sinks and seen[1] == {"kv_stored": True}
