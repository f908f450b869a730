"""Every Triton kernel against its torch reference, plus the Triton backend end to end.

Without CUDA the kernels run on CPU under TRITON_INTERPRET=1 (set here, before any kernel module
is imported; it only changes how triton.jit functions run). With CUDA the same tests run
compiled on the GPU (marked gpu). Shapes are tiny: the interpreter is slow.
"""
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from picovllm.kernels.activation import silu_and_mul                    # noqa: E402
from picovllm.kernels.backend import TritonAttentionBackend             # noqa: E402
from picovllm.kernels.decode_attention import decode_attention          # noqa: E402
from picovllm.kernels.rmsnorm import rms_norm                           # noqa: E402
from picovllm.kernels.rotary import rope                                # noqa: E402
from picovllm.kernels.store_kv import store_kv                          # noqa: E402
from picovllm.layers.activation import SiluAndMul                       # noqa: E402
from picovllm.layers.attention import AttentionMetadata, TorchAttentionBackend   # noqa: E402
from picovllm.layers.attention import store_kv as store_kv_ref          # noqa: E402
from picovllm.layers.layernorm import RMSNorm                           # noqa: E402
from picovllm.layers.rotary import RotaryEmbedding                      # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()


def interpreted(*values, id: str):
    """A parametrize case for the Triton interpreter on the CPU (skipped unless TRITON_INTERPRET=1)."""
    return pytest.param(*values, id=id, marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1"))


def compiled(*values, id: str):
    """A parametrize case compiled on a GPU (marked gpu; skipped without CUDA or under the interpreter)."""
    return pytest.param(*values, id=id,
                        marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA")])


# (device, dtype, tolerance): the interpreter on CPU in fp32; compiled on the GPU in bf16 and fp32
CASES = [
    interpreted("cpu", torch.float32, 1e-4, id="interp-fp32"),
    compiled("cuda", torch.bfloat16, 2e-2, id="gpu-bf16"),
    compiled("cuda", torch.float32, 1e-4, id="gpu-fp32"),
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


class PagedBatch:
    """A batch of sequences in a paged cache whose blocks are shuffled, decodes first."""

    def __init__(self, ctx_lens, query_lens, block_size, hq, hkv, d, dtype, device, seed=0):
        g = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
        need = sum(-(-n // block_size) for n in seq_lens)
        num_blocks = need + 3
        perm = list(range(num_blocks))
        rng.shuffle(perm)
        tables, slots = [], []
        for c, n in zip(ctx_lens, seq_lens):
            nb = -(-n // block_size)
            table, perm = perm[:nb], perm[nb:]
            tables.append(table)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(c, n)]
        width = max(len(t) for t in tables)
        rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)   # noqa: E731
        self.k_cache = rnd(num_blocks, block_size, hkv, d)
        self.v_cache = rnd(num_blocks, block_size, hkv, d)
        t = sum(query_lens)
        self.q, self.k, self.v = rnd(t, hq, d), rnd(t, hkv, d), rnd(t, hkv, d)
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        i32 = dict(dtype=torch.int32, device=device)
        self.meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(qsl, **i32),
            seq_lens=torch.tensor(seq_lens, **i32),
            block_tables=torch.tensor([tb + [0] * (width - len(tb)) for tb in tables], **i32),
            num_decodes=next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens)),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens)

    def caches(self):
        return self.k_cache.clone(), self.v_cache.clone()


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_store_kv(device, dtype, tol, block_size):
    b = PagedBatch([0, 3, 17], [5, 9, 2], block_size, 4, 2, 16, dtype, device)
    k_ref, v_ref = b.caches()
    store_kv_ref(b.k, b.v, k_ref, v_ref, b.meta.slot_mapping)
    # padding rows (slot -1) are skipped; v passed as a strided view
    pad = torch.full((3,), -1, dtype=torch.long, device=device)
    k_in = torch.cat([b.k, b.k[:3] * 0 + 7])
    v_in = torch.cat([b.v, b.v[:3] * 0 + 7], dim=0)
    v_wide = torch.cat([v_in, v_in], dim=-1)[..., :v_in.shape[-1]]
    k_out, v_out = b.caches()
    store_kv(k_in, v_wide, k_out, v_out, torch.cat([b.meta.slot_mapping, pad]))
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("block_size,hq,hkv,d,ctx,splits", [
    (16, 4, 4, 16, [1, 15, 16, 17, 40], None),      # MHA; lengths around the block edge
    (16, 4, 2, 32, [1, 31, 33, 70], 4),            # GQA 2; split-K into up to 4 slices of 16+ tokens
    (8, 8, 1, 16, [9, 24, 65], 3),                 # MQA, block size 8, slices over several blocks
    (32, 6, 2, 24, [5, 95], 2),                    # GQA 3 (padded group), head_dim not a power of 2
    (5, 4, 2, 16, [4, 5, 6, 23], 7),               # a block size that is not a power of two
    (16, 4, 2, 32, [3, 16, 50], 1),                # one split: the partial kernel writes the output itself
])
def test_decode_attention(device, dtype, tol, block_size, hq, hkv, d, ctx, splits):
    b = PagedBatch([n - 1 for n in ctx], [1] * len(ctx), block_size, hq, hkv, d, dtype, device, seed=len(ctx))
    k_cache, v_cache = b.caches()
    store_kv_ref(b.k, b.v, k_cache, v_cache, b.meta.slot_mapping)
    scale = d ** -0.5
    ref = TorchAttentionBackend._decode(b.q.float(), k_cache.float(), v_cache.float(), b.meta, scale)
    out = torch.full_like(b.q, float("nan"))
    decode_attention(b.q, k_cache, v_cache, b.meta.block_tables, b.meta.seq_lens, scale,
                     out=out, block_n=16, num_splits=splits)
    assert not out.isnan().any()
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_padding_rows_give_zeros(device, dtype, tol, splits, sinks):
    """CUDA-graph padding: a row with seq_len 0 reads nothing and yields zeros, not NaN; with attention sinks too
    (no split of it adds the sink)."""
    b = PagedBatch([4, 0], [1, 1], 16, 4, 2, 16, dtype, device)
    b.meta.seq_lens[1] = 0
    out = torch.full_like(b.q, float("nan"))
    decode_attention(b.q, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.seq_lens, 0.25, out=out,
                     num_splits=splits, sinks=torch.tensor([5.0, -2.0, 3.0, 0.5]).to(device) if sinks else None)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and not out[0].isnan().any()


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("block_size,hq,hkv,d,ctx,qlen", [
    (16, 4, 2, 16, [7, 30, 0, 0, 5, 16], [1, 1, 1, 20, 3, 40]),     # decodes, then fresh and chunked prefills
    (8, 4, 1, 32, [0, 9, 33], [70, 1, 17]),                         # prefill-only batch, MQA
    (4, 6, 3, 16, [12, 0], [1, 7]),                                 # GQA 2, block size 4
])
def test_backend_matches_torch(device, dtype, tol, block_size, hq, hkv, d, ctx, qlen):
    b = PagedBatch(ctx, qlen, block_size, hq, hkv, d, dtype, device, seed=7)
    scale = d ** -0.5
    k_ref, v_ref = b.caches()
    ref = TorchAttentionBackend().forward(b.q.float(), b.k.float(), b.v.float(), k_ref.float(), v_ref.float(),
                                          b.meta, scale)
    k_out, v_out = b.caches()
    out = TritonAttentionBackend().forward(b.q, b.k, b.v, k_out, v_out, b.meta, scale)
    assert rel_err(out, ref) < tol
    store_kv_ref(b.k, b.v, k_ref, v_ref, b.meta.slot_mapping)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("window,softcap,splits", [(5, None, 3), (16, None, 1), (1, None, 2), (None, 1.0, 2),
                                                    (9, 1.0, 1)])
def test_sliding_window_and_softcap_match_torch(device, dtype, tol, window, softcap, splits):
    """Decodes within and past the window (split-K over the window only), prefill tiles whose first rows see
    none of a key tile (a window shorter than the tile), a chunk over cached context; head_dim 80, 1 KV head."""
    from picovllm.kernels.prefill_attention import prefill_attention
    b = PagedBatch([3, 40, 70, 0, 21], [1, 1, 1, 37, 19], 8, 4, 1, 80, dtype, device, seed=11)
    b.q *= 3     # scores large enough for the cap to matter
    k_cache, v_cache = b.caches()
    store_kv_ref(b.k, b.v, k_cache, v_cache, b.meta.slot_mapping)
    ref = TorchAttentionBackend().forward(b.q.float(), b.k.float(), b.v.float(), k_cache.float(), v_cache.float(),
                                          b.meta, 0.1, window, softcap)
    out = torch.full_like(b.q, float("nan"))
    decode_attention(b.q[:3], k_cache, v_cache, b.meta.block_tables[:3], b.meta.seq_lens[:3], 0.1, out=out[:3],
                     block_n=16, num_splits=splits, window=window, softcap=softcap)
    prefill_attention(b.q, k_cache, v_cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc,
                      3, 2, 37, 0.1, out, block_m=16, block_n=16, window=window, softcap=softcap)
    assert not out.isnan().any()
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize("device,dtype,tol", CASES)
def test_prefill_tiles_cross_chunk_boundaries(device, dtype, tol):
    """Small query tiles, so a chunk spans several tiles and each tile's causal limit differs."""
    from picovllm.kernels.prefill_attention import prefill_attention
    b = PagedBatch([0, 21], [37, 19], 8, 4, 2, 16, dtype, device, seed=3)
    k_cache, v_cache = b.caches()
    store_kv_ref(b.k, b.v, k_cache, v_cache, b.meta.slot_mapping)
    ref = TorchAttentionBackend().forward(b.q.float(), b.k.float(), b.v.float(), k_cache.float(),
                                          v_cache.float(), b.meta, 0.25)
    out = torch.full_like(b.q, float("nan"))
    prefill_attention(b.q, k_cache, v_cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc,
                      0, 2, 37, 0.25, out, block_m=16, block_n=16)
    assert rel_err(out, ref) < tol


# The layers dispatch to these kernels on CUDA, so their torch references run on CPU copies.

@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(device, dtype, tol, with_residual):
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(48, 1e-5).to(dtype=dtype)
    norm.weight.data = torch.randn(48, generator=g).to(dtype)
    x = torch.randn(7, 48, generator=g).to(dtype)
    res = torch.randn(7, 48, generator=g).to(dtype)
    w = norm.weight.to(device)
    if with_residual:
        ref, ref_res = norm(x, res)
        out, out_res = rms_norm(x.to(device), w, 1e-5, res.to(device))
        assert torch.equal(out_res.cpu(), ref_res)
    else:
        ref, out = norm(x), rms_norm(x.to(device), w, 1e-5)
    assert rel_err(out.cpu(), ref) < tol / 10


@pytest.mark.parametrize("device,dtype,tol", CASES)
def test_silu_and_mul(device, dtype, tol):
    x = torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(2)).to(dtype) * 3
    assert rel_err(silu_and_mul(x.to(device)).cpu(), SiluAndMul()(x)) < tol / 10


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope(device, dtype, tol, qk_norm):
    g = torch.Generator().manual_seed(3)
    hq, hk, d, t = 4, 2, 16, 6
    rot = RotaryEmbedding(d, 64, 10000.0)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)
    q = qkv[:, :hq * d].view(t, hq, d)                     # strided views, as in the model
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    pos = torch.tensor([0, 1, 5, 17, 40, 63])
    qw = kw = None
    if qk_norm:
        qn, kn = RMSNorm(d, 1e-6).to(dtype=dtype), RMSNorm(d, 1e-6).to(dtype=dtype)
        qn.weight.data = torch.randn(d, generator=g).to(dtype)
        kn.weight.data = torch.randn(d, generator=g).to(dtype)
        q_ref, k_ref = rot(pos, qn(q), kn(k))
        qw, kw = qn.weight.to(device), kn.weight.to(device)
    else:
        q_ref, k_ref = rot(pos, q, k)
    qkv_d = qkv.to(device)
    q_out, k_out = rope(pos.to(device), qkv_d[:, :hq * d].view(t, hq, d), qkv_d[:, hq * d:(hq + hk) * d].view(t, hk, d),
                        rot.cos_sin.to(device), qw, kw, 1e-6)
    assert rel_err(q_out.cpu(), q_ref) < tol / 10 and rel_err(k_out.cpu(), k_ref) < tol / 10


def _greedy(path, prompts, max_tokens, **kw):
    from picovllm import LLM, SamplingParams
    llm = LLM(path, block_size=16, num_kv_blocks=48, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _prompts(n_tokens, vocab=384, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in n_tokens]


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_engine_triton_backend_matches_torch_interpreted(tiny_models):
    """The whole engine on the Triton backend (interpreted, CPU, fp32): chunked prefill mixed with
    decodes, prefix-cache hits (the shared 20-token prefix), gives torch's greedy tokens."""
    prompts = _prompts([3, 40, 17])
    prompts.append(prompts[1][:20] + [5, 6, 7])
    kw = dict(max_num_batched_tokens=24, device="cpu")
    ref, _ = _greedy(tiny_models["qwen3"], prompts, 3, attention_backend="torch", **kw)
    out, cached = _greedy(tiny_models["qwen3"], prompts, 3, attention_backend="triton", **kw)
    assert out == ref
    assert cached[3] == 16, "the last prompt was meant to reuse the first block of the second"


needs_gpu = pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA (compiled Triton)")


def _hf_greedy(path, prompts, max_new_tokens):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                               min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        outs.append(g[0, len(p):].tolist())
    return outs


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_gpu_matches_hf(tiny_models, arch):
    """fp32 on the GPU: Triton attention, fused ops, chunked prefill and CUDA-graph decode steps
    give HF transformers' greedy tokens (computed on CPU)."""
    prompts = _prompts([1, 5, 16, 17, 31, 32, 47, 90])
    ref = _hf_greedy(tiny_models[arch], prompts, 12)
    from picovllm import LLM, SamplingParams
    llm = LLM(tiny_models[arch], dtype="float32", block_size=16, num_kv_blocks=64, max_num_batched_tokens=40)
    runner = llm.engine.runner
    assert runner.cuda_graphs is not None
    replays = []
    real_run = runner.cuda_graphs.run
    runner.cuda_graphs.run = lambda step, *a: (replays.append(len(step.seq_lens)), real_run(step, *a))[1]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert replays, "decode steps were meant to replay CUDA graphs"


@pytest.mark.gpu
@needs_gpu
def test_cuda_graph_matches_eager_sampled(tiny_models):
    """Seeded sampling with logprobs: CUDA-graph steps give the same tokens as eager steps."""
    from picovllm import LLM, SamplingParams
    prompts = _prompts([3, 9, 30], seed=5)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=10, ignore_eos=True, logprobs=2)
    res = {}
    for eager in (True, False):
        llm = LLM(tiny_models["qwen3"], dtype="float32", num_kv_blocks=32, enforce_eager=eager)
        graphs = llm.engine.runner.cuda_graphs
        assert (graphs is None) == eager
        if graphs is not None:   # 3 decodes replay the 4-row graph, one row padded
            replays, real_run = [], graphs.run
            graphs.run = lambda step, *a: (replays.append(len(step.seq_lens)), real_run(step, *a))[1]
        outs = llm.generate(prompts, params, use_tqdm=False)
        if graphs is not None:
            assert 3 in replays and 3 not in graphs.sizes
        res[eager] = [(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs,
                                                                            o.outputs[0].token_ids)]) for o in outs]
        del llm
    for (toks_e, lp_e), (toks_g, lp_g) in zip(res[True], res[False]):
        assert toks_e == toks_g
        assert lp_g == pytest.approx(lp_e, abs=1e-4)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_cuda_graph_static_inputs_interpreted(tiny_models):
    """The CUDA-graph runner's static buffers and padding, checked on CPU: a replay stand-in that
    runs the captured forward on the static buffers gives the eager step's logits for real rows."""
    from picovllm import LLM, SamplingParams
    from picovllm.engine.cuda_graph import CUDAGraphRunner
    llm = LLM(tiny_models["qwen3"], device="cpu", attention_backend="triton", block_size=8, num_kv_blocks=40)
    eng, runner = llm.engine, llm.engine.runner
    for p in _prompts([5, 20, 11], seed=2):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while not all(r.output_token_ids for r in eng.requests.values()):   # prefill everything
        eng.step()
    step = runner.prepare(eng.scheduler.schedule(), eng.eos_token_ids)
    assert step.num_decodes == 3
    try:
        _check_static_inputs(runner, step, CUDAGraphRunner)
    finally:
        eng.abort_all()


def _check_static_inputs(runner, step, CUDAGraphRunner):
    graphs = CUDAGraphRunner(runner.model, max_num_seqs=8, max_blocks_per_seq=8, block_size=8, device="cpu")
    graphs.tokens[0].fill_(7)     # stale rows from an earlier, larger batch
    graphs.seq_lens.fill_(5)
    graphs.tokens[2].fill_(3)

    class Replay:
        def __init__(self, bs):
            self.bs = bs

        def replay(self):
            graphs.logits[self.bs] = graphs._forward(self.bs)

    graphs.graphs = {bs: Replay(bs) for bs in graphs.sizes}
    cache_before = runner.kv_cache.clone()
    assert graphs.fits(step)
    with torch.inference_mode():
        got = graphs.run(step).clone()
        cache_graph = runner.kv_cache.clone()
        runner.kv_cache.copy_(cache_before)      # the eager step writes the same slots again
        hidden = runner.model(torch.tensor(step.input_ids), torch.tensor(step.positions), runner._metadata(step))
        want = runner.model.compute_logits(hidden)
    changed = (cache_graph != cache_before).flatten(4).any(-1).any(0).any(0).flatten().nonzero()[:, 0]
    assert sorted(changed.tolist()) == sorted(step.slot_mapping), "only the real rows' slots may be written"
    assert rel_err(cache_graph, runner.kv_cache) < 1e-6
    assert got.shape == want.shape == (3, 384)
    assert rel_err(got, want) < 1e-5
    assert graphs.tokens[2, :4].tolist() == step.slot_mapping + [-1]   # the padding row writes nowhere


@pytest.mark.parametrize("device,dtype,tol", CASES)
def test_gumbel_sample_greedy_rows_and_seeds(device, dtype, tol):
    """Greedy rows give torch's argmax (first index on ties); a seeded row's token depends only on
    its seed and logits, not on its place in the batch."""
    from picovllm.kernels.sampling import gumbel_sample
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 3000, generator=g)
    logits[2, 7] = logits[2, 2900] = logits[2].max() + 1          # a tie: the first index wins
    temps = torch.tensor([0.0, 0.7, 0.0, 1.0, 0.5, 0.0])
    seeds = torch.tensor([1, 2, 3, 4, 5, 6])
    dev = lambda x: x.to(device)   # noqa: E731
    out = gumbel_sample(dev(logits.to(dtype)), dev(temps), dev(seeds), block=256).cpu()
    greedy = [0, 2, 5]
    assert out[greedy].tolist() == logits.to(dtype).float()[greedy].argmax(-1).tolist()
    assert out[2] == 7
    perm = torch.tensor([3, 1, 4, 0, 5, 2])
    for chunks in (1, 4):      # the same tokens however the vocabulary is split across programs
        out_perm = gumbel_sample(dev(logits[perm].to(dtype)), dev(temps[perm]), dev(seeds[perm]), block=256,
                                 num_chunks=chunks).cpu()
        assert out_perm.tolist() == out[perm].tolist()
    other = gumbel_sample(dev(logits.to(dtype)), dev(temps), dev(seeds + 100), block=256).cpu()
    assert other[greedy].tolist() == out[greedy].tolist()
    assert other.tolist() != out.tolist()


@pytest.mark.parametrize("device,dtype,tol", CASES)
def test_gumbel_sample_of_a_row_its_mask_empties_is_token_zero(device, dtype, tol):
    """A row whose grammar mask allows no token, greedy or sampled, gets token 0 as torch's argmax over -inf does
    (the reference path's), an id in the vocabulary (it had been 2**31 - 1, past the embedding); the other rows
    are as without it."""
    from picovllm.kernels.sampling import gumbel_sample
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 384, generator=g)
    words = torch.full((3, 12), -1, dtype=torch.int32)
    words[1] = words[2] = 0
    temps, seeds = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([1, 2, 3])
    out = gumbel_sample(logits.to(dtype).to(device), temps.to(device), seeds.to(device), words=words.to(device)).cpu()
    assert out.tolist() == [logits[0].to(dtype).float().argmax().item(), 0, 0]


@pytest.mark.parametrize("device,dtype,tol", CASES)
def test_gumbel_sample_applies_grammar_masks_in_its_pass(device, dtype, tol):
    """The fused masks (words, word_rows) draw exactly what the sampler draws from logits the torch reference
    (layers.structured_output.mask_logits) masked: rows with their own mask, rows left unmasked (-1), greedy
    rows; a vocabulary past the words' 32 W tokens (those tokens forbidden) and not a multiple of 32."""
    from picovllm.kernels.sampling import gumbel_sample
    from picovllm.layers.structured_output import mask_logits
    g = torch.Generator().manual_seed(7)
    vocab, num_words = 1000, 30                   # 960 tokens covered: 960..999 are forbidden wherever a mask applies
    logits = torch.randn(5, vocab, generator=g)
    logits[:, 970] = 50.0                         # the unmasked rows' winner, forbidden to the masked ones
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (4, num_words), generator=g, dtype=torch.int64).to(torch.int32)
    word_rows = torch.tensor([2, -1, 0, 3, -1], dtype=torch.int32)
    temps = torch.tensor([0.0, 0.8, 1.0, 0.0, 0.0])
    seeds = torch.tensor([11, 12, 13, 14, 15])
    ref = logits.clone()
    for r, w in enumerate(word_rows.tolist()):
        if w >= 0:
            ref[r] = mask_logits(logits[r:r + 1], words[w:w + 1])[0]
    dev = lambda x: x.to(device)   # noqa: E731
    for chunks in (1, 3):
        want = gumbel_sample(dev(ref.to(dtype)), dev(temps), dev(seeds), block=128, num_chunks=chunks).cpu()
        got = gumbel_sample(dev(logits.to(dtype)), dev(temps), dev(seeds), block=128, num_chunks=chunks,
                            words=dev(words), word_rows=dev(word_rows)).cpu()
        assert got.tolist() == want.tolist()
        assert got[1] == got[4] == 970 and got[0] != 970
        assert got[0] == ref[0].to(dtype).float().argmax()
    all_rows = gumbel_sample(dev(logits[:4].to(dtype)), dev(temps[:4]), dev(seeds[:4]), block=128,
                             words=dev(words)).cpu()          # no word_rows: row r takes words[r]
    want = gumbel_sample(dev(mask_logits(logits[:4], words).to(dtype)), dev(temps[:4]), dev(seeds[:4]), block=128).cpu()
    assert all_rows.tolist() == want.tolist()


@pytest.mark.gpu
@needs_gpu
def test_temperature_only_sampling_equals_the_tensor_path():
    """sample_temperature_only (temperatures and seeds in one packed upload) draws exactly what sample() draws from
    SamplingTensors for the same seeded rows, greedy rows and temperatures below GREEDY_BELOW included; its fresh
    seeds come from torch's CPU generator as sample()'s do."""
    from picovllm.layers.sampler import GREEDY_BELOW, SamplingTensors, sample, sample_temperature_only
    g = torch.Generator().manual_seed(5)
    for b in (1, 7, 64):
        logits = torch.randn(b, 5000, generator=g).to("cuda", torch.bfloat16)
        temps = [[0.0, 0.7, 1.0, 1.3, GREEDY_BELOW / 2][i % 5] for i in range(b)]
        seeds = [None if i % 3 == 2 else 1000 + i for i in range(b)]
        t = SamplingTensors(torch.tensor(temps, device="cuda"), torch.zeros(b, dtype=torch.long, device="cuda"),
                            torch.ones(b, device="cuda"), torch.zeros(b, device="cuda"), seeds, False, False, False,
                            False, [False] * b)
        torch.manual_seed(9)
        want = sample(logits, t)
        torch.manual_seed(9)
        got = sample_temperature_only(logits, temps, seeds)
        assert got.tolist() == want.tolist()
        greedy = [i for i, x in enumerate(temps) if x < GREEDY_BELOW]
        assert got[greedy].tolist() == logits.float()[greedy].argmax(-1).tolist()


def test_packed_rows_keep_the_temperatures_16_byte_aligned_for_every_batch_size():
    """The fused sampler's one upload: seeds at 0, float32 temperatures from an even int64 index, so the pointer the
    kernel gets is 16-byte aligned whatever the batch size (Triton compiles a variant per alignment; an odd batch
    had one of its own, which a GPU run after the warm-up compiled: BENCHMARKS.md, twenty-first session)."""
    from picovllm.layers.sampler import GREEDY_BELOW, packed_rows
    for b in range(1, 10):
        temps = [[0.0, 0.7, 1.3, GREEDY_BELOW / 2][i % 4] for i in range(b)]
        seeds = [2 ** 40 + i for i in range(b)]
        host, at = packed_rows(temps, seeds)
        temp_view = host[at:].view(torch.float32)[:b]
        assert (host.data_ptr() + 8 * at) % 16 == 0 and temp_view.data_ptr() % 16 == 0
        assert host[:b].tolist() == seeds
        assert temp_view.tolist() == [x if x >= GREEDY_BELOW else 0.0 for x in torch.tensor(temps).tolist()]


ARGMAX_CASES = [   # exact comparisons: every logits dtype on the interpreter too
    case(device, dt, id=f"{kind}-{str(dt)[6:]}")
    for case, device, kind in ((interpreted, "cpu", "interp"), (compiled, "cuda", "gpu"))
    for dt in (torch.float32, torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("device,dtype", ARGMAX_CASES)
def test_argmax_is_torch_argmax_ties_and_nans_included(device, dtype):
    """kernels.argmax == torch.argmax: a row of few distinct values (ties everywhere: the first maximum), ties
    across chunks and at a chunk's first and last entries, -0.0 against +0.0, -inf rows, +inf, NaNs (the first
    NaN, even after +inf; NaN of either sign), a row of one entry, rows strided, however the row is split."""
    from picovllm.kernels.argmax import argmax
    g = torch.Generator().manual_seed(11)
    v = 1000 if device == "cpu" else 151_936
    x = torch.randn(9, v + 24, generator=g).to(dtype)[:, 8:8 + v]     # rows of stride v + 24
    x[0] = torch.randint(-3, 3, (v,), generator=g).to(dtype)           # many ties
    x[1, [5, 255, 256, v - 1]] = 100.0                                 # ties at block/chunk edges: index 5
    x[2] = float("-inf")
    x[3] = 0.0
    x[3, :7] = -0.0
    x[3, 3:5] = -1.0                                                    # -0.0 at 0 ties +0.0: index 0
    x[4, 17], x[4, 600 % v], x[4, v - 2] = float("inf"), float("nan"), float("-nan")
    x[5, v - 1] = float("nan")                                          # a NaN last
    x[6, 300] = float("inf")
    x[7] = x[7].abs().neg() - 1
    x[7, v // 2] = -0.5                                                 # all negative
    want = x.float().argmax(-1)
    assert want[:7].tolist() == [torch.nonzero(x[0] == x[0].max())[0, 0].item(), 5, 0, 0, 600 % v, v - 1, 300]
    want = x.argmax(-1)
    dev = x.to(device)
    for chunks in (None, 1, 3, 128):
        got = argmax(dev, block=128 if device == "cpu" else 1024, num_chunks=chunks)
        assert got.dtype == torch.int64 and got.tolist() == want.tolist(), chunks
    assert argmax(dev[:, :1]).tolist() == [0] * 9
    assert argmax(dev[:0]).shape == (0,)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_greedy_tokens_take_the_kernel_for_few_rows(monkeypatch):
    """layers.sampler.greedy_tokens: the Triton argmax where the layers run Triton and rows are few, else torch;
    the same ids either way (random logits with forced ties)."""
    from picovllm import kernels
    from picovllm.kernels import argmax as argmax_module
    from picovllm.layers import sampler
    calls = []
    real = argmax_module.argmax
    monkeypatch.setattr(argmax_module, "argmax", lambda x: (calls.append(x.shape[0]), real(x))[1])
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(sampler.ARGMAX_KERNEL_ROWS + 1, 300, generator=g)
    logits[:, 250] = logits[:, 40] = logits.max() + 1
    assert sampler.greedy_tokens(logits[:3]).tolist() == [40] * 3 and not calls, "torch off the Triton path"
    monkeypatch.setattr(kernels, "use_triton", lambda x: True)
    assert sampler.greedy_tokens(logits[:3]).tolist() == [40] * 3 and calls == [3]
    assert sampler.greedy_tokens(logits).tolist() == [40] * len(logits) and calls == [3], "many rows: torch"


@pytest.mark.parametrize("device,dtype,tol", CASES[:1] + CASES[2:])
def test_gumbel_sample_distribution(device, dtype, tol):
    """Over many seeds, sampled frequencies match softmax(logits / T) (the torch sampler's law).
    The interpreter runs few rows (about 25 ms each), so its bound is loose but still separates
    T = 0.5 from T = 1 or 0.25; the GPU runs 20,000 rows."""
    from picovllm.kernels.sampling import gumbel_sample
    n, bound = (300, 0.1) if device == "cpu" else (20000, 0.012)
    temp = 0.5
    row = torch.tensor([1.0, 2.0, 0.5, 0.0, -1.0])
    out = gumbel_sample(row.expand(n, 5).contiguous().to(device), torch.full((n,), temp, device=device),
                        torch.arange(n, device=device) * 7919 + 11, block=16).cpu()
    freq = torch.bincount(out, minlength=5).float() / n
    want = (row / temp).softmax(-1)
    assert (freq - want).abs().max() < bound   # about 4 standard deviations


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("tokens,experts,top_k", [(5, 8, 2), (37, 64, 1), (1, 8, 8), (150, 4, 2)])
def test_fused_experts_match_torch(device, dtype, tol, tokens, experts, top_k):
    """Tokens grouped by expert (segments padded to the row tile), grouped GEMMs, top-k combine; experts no
    token picked, a tile shared by no two experts, every expert picked by one token (top-8 of 8); 75 rows an expert
    (a prefill's 64x128 tiles, expert_tiles)."""
    from picovllm.kernels.moe import fused_experts
    from picovllm.layers.moe import experts_reference, route
    g = torch.Generator().manual_seed(tokens)
    h, inter = 32, 24
    x = torch.randn(tokens, h, generator=g)
    gate_up = torch.randn(experts, 2 * inter, h, generator=g) * 0.3
    down = torch.randn(experts, h, inter, generator=g) * 0.3
    weights, ids = route(torch.randn(tokens, experts, generator=g) * 3, top_k, renormalize=top_k > 1)
    ref = experts_reference(x, weights, ids, gate_up, down, SiluAndMul())
    out = fused_experts(*(t.to(device) for t in (x.to(dtype), weights, ids, gate_up.to(dtype), down.to(dtype))),
                        SiluAndMul())
    assert rel_err(out.cpu(), ref) < tol


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("tokens,experts,top_k", [(5, 8, 2), (150, 4, 2)])
def test_fused_experts_with_biases_match_torch(device, dtype, tol, tokens, experts, top_k):
    """GPT-OSS's experts: a bias on each projection (the down bias scaled by the routing weight with the rest) and
    the clamped SwiGLU; decode-sized and prefill-sized tiles."""
    from picovllm.kernels.moe import fused_experts
    from picovllm.layers.activation import ClampedSwiGLU
    from picovllm.layers.moe import experts_reference, route
    g = torch.Generator().manual_seed(tokens + 1)
    h, inter = 32, 24
    x = torch.randn(tokens, h, generator=g)
    gate_up = torch.randn(experts, 2 * inter, h, generator=g) * 0.3
    down = torch.randn(experts, h, inter, generator=g) * 0.3
    b13, b2 = torch.randn(experts, 2 * inter, generator=g), torch.randn(experts, h, generator=g)
    weights, ids = route(torch.randn(tokens, experts, generator=g) * 3, top_k, renormalize=True)
    act = ClampedSwiGLU(1.702, 1.0)
    ref = experts_reference(x, weights, ids, gate_up, down, act, b13, b2)
    assert rel_err(ref, experts_reference(x, weights, ids, gate_up, down, act)) > 0.1    # the biases matter
    out = fused_experts(*(t.to(device) for t in (x.to(dtype), weights, ids, gate_up.to(dtype), down.to(dtype))),
                        act, b13.to(device, dtype), b2.to(device, dtype))
    assert rel_err(out.cpu(), ref) < tol


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("tokens,experts,top_k", [(5, 8, 3), (70, 16, 4)])
def test_fused_experts_take_sigmoid_routing(device, dtype, tol, tokens, experts, top_k):
    """GLM-4.5's routing on the GPU path: route_sigmoid (torch ops; route_topk is softmax-only) hands its ids, in no
    order, and its weights, scaled (2.5) and renormalised before it, to the grouped GEMMs: experts_reference's
    sum; under the group limit (2 groups of 4 kept) the picked experts are in the kept groups."""
    from picovllm.kernels.moe import fused_experts
    from picovllm.layers.moe import Routing, experts_reference, route_sigmoid
    g = torch.Generator().manual_seed(tokens + 2)
    h, inter = 32, 24
    x = torch.randn(tokens, h, generator=g)
    gate_up = torch.randn(experts, 2 * inter, h, generator=g) * 0.3
    down = torch.randn(experts, h, inter, generator=g) * 0.3
    logits, bias = torch.randn(tokens, experts, generator=g) * 3, torch.randn(experts, generator=g)
    routing = Routing("sigmoid", experts // 4, 2, 2.5)
    weights, ids = route_sigmoid(logits.to(device), bias.to(device), top_k, True, routing)
    assert torch.allclose(weights.sum(-1).cpu(), torch.full((tokens,), 2.5))
    assert max(len(set(row)) for row in (ids // 4).cpu().tolist()) <= 2
    ref = experts_reference(x, weights.cpu(), ids.cpu(), gate_up, down, SiluAndMul())
    out = fused_experts(*(t.to(device) for t in (x.to(dtype), weights, ids, gate_up.to(dtype), down.to(dtype))),
                        SiluAndMul())
    assert rel_err(out.cpu(), ref) < tol


@pytest.mark.parametrize("device", [interpreted("cpu", id="interp"), compiled("cuda", id="gpu")])
@pytest.mark.parametrize("tokens,experts,top_k,renormalize", [(5, 8, 2, True), (33, 128, 8, True), (7, 64, 1, False),
                                                              (3, 60, 4, False), (1, 8, 8, True)])
def test_route_topk_matches_torch(device, tokens, experts, top_k, renormalize):
    """The routing kernel against layers.moe.route: the same experts in the same (descending) order, weights within
    float32 rounding; 60 experts is not a power of two (the kernel pads to 64), top-8 of 8 takes every expert."""
    from picovllm.kernels.moe import route_topk
    from picovllm.layers.moe import route
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(experts + top_k)) * 2
    want_w, want_ids = route(logits.double(), top_k, renormalize)
    got_w, got_ids = route_topk(logits.to(device), top_k, renormalize)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids.cpu(), want_ids)
    assert (got_w.cpu().double() - want_w).abs().max() < 1e-6


@pytest.mark.parametrize("device", [interpreted("cpu", id="interp"), compiled("cuda", id="gpu")])
@pytest.mark.parametrize("tokens,experts,top_k,block_m,used", [
    (5, 8, 2, 16, None), (256, 128, 8, 16, None), (40, 64, 1, 64, 5), (3, 4, 4, 16, None), (70, 8, 2, 128, None),
    (600, 16, 4, 16, None), (70, 16, 4, 16, 11), (1024, 128, 8, 64, None), (4096, 128, 8, 16, None)])
def test_group_kernel_matches_torch_sort(device, tokens, experts, top_k, block_m, used):
    """The counting sort (a program per expert) gives group_by_expert_torch's rows and tile experts exactly: experts
    no token picked (40 tokens of 64 experts at top-1...), segments longer than a tile, a batch's 2048 pairs over 128
    experts (Qwen3-30B-A3B's decode step at batch 256), more pairs than one 1024-pair chunk, and the kernel's most
    pairs (GROUP_KERNEL_MAX_PAIRS: on the GPU only, the interpreter takes minutes)."""
    from picovllm.kernels.moe import GROUP_KERNEL_MAX_PAIRS, group_by_expert, group_by_expert_torch
    from picovllm.layers.moe import route
    if tokens * top_k > 8192 and device == "cpu":
        pytest.skip("the interpreter runs the kernel's most pairs too slowly")
    assert tokens * top_k <= GROUP_KERNEL_MAX_PAIRS      # the kernel, not the torch fallback, is what runs
    g = torch.Generator().manual_seed(tokens * experts)
    _, ids = route(torch.randn(tokens, experts, generator=g), top_k, renormalize=False)
    if used:
        ids = ids % used       # the experts from `used` on empty (70 x 16: triton 3.6 miscompiled the kernel there)
    want_rows, want_tiles = group_by_expert_torch(ids, experts, block_m)
    rows, tiles = group_by_expert(ids.to(device), experts, block_m)
    assert torch.equal(rows.cpu(), want_rows) and torch.equal(tiles.cpu(), want_tiles)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (two real GPUs: test_tp.py)")
def test_one_flag_all_reduce_layout_and_epochs():
    """The small all-reduce kernel of rank 0 and then rank 1, run one after the other on CPU buffers
    (the interpreter runs one program at a time, so rank 1's pushes for rank 0 are made beforehand by a
    torch model of them): every call's sum, over messages of 1-3 chunks that reuse the slots in turn,
    equals the float32 sum of the parts, and the two ranks agree bit for bit."""
    from picovllm.kernels import all_reduce as k
    world, max_bytes = 2, 3 * k.CHUNK_BYTES
    bufs = [torch.zeros(k.FLAG_BYTES + 2 * world * max_bytes, dtype=torch.uint8) for _ in range(world)]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    epochs = [torch.zeros(k.MAX_CHUNKS, dtype=torch.int64) for _ in range(world)]
    calls_of_chunk = [0] * k.MAX_CHUNKS

    def rank1_pushes(x):
        raw = x.view(torch.uint8)
        for p in range(-(-raw.numel() // k.CHUNK_BYTES)):
            calls_of_chunk[p] += 1
            epoch = calls_of_chunk[p]
            lo, hi = p * k.CHUNK_BYTES, min((p + 1) * k.CHUNK_BYTES, raw.numel())
            at = k.FLAG_BYTES + ((epoch % 2) * world + 1) * max_bytes
            bufs[0][at + lo:at + hi] = raw[lo:hi]
            bufs[0][:k.FLAG_BYTES].view(torch.int64)[p * world + 1] = epoch

    g = torch.Generator().manual_seed(0)
    for n, dtype in [(5000, torch.float32), (300, torch.bfloat16), (6000, torch.bfloat16), (5000, torch.bfloat16)]:
        xs = [torch.randn(n, generator=g).to(dtype) for _ in range(world)]
        rank1_pushes(xs[1])
        outs = [torch.empty_like(x) for x in xs]
        for rank in range(world):
            k.one_flag_all_reduce(xs[rank], outs[rank], ptrs, epochs[rank], max_bytes, rank, world)
        want = xs[0].double() + xs[1].double()
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22   # the interpreter may truncate bf16
        assert torch.allclose(outs[0].double(), want, rtol=ulp, atol=1e-6), n
        assert torch.equal(outs[0], outs[1])
    assert epochs[0][:3].tolist() == epochs[1][:3].tolist() == [4, 3, 1]


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("ctx,q_len,window,softcap", [(70, 2, None, None), (40, 12, 9, None), (0, 5, None, 1.0),
                                                      (33, 1, None, None)])
def test_short_prefill_chunk_through_the_decode_kernel(device, dtype, tol, ctx, q_len, window, softcap):
    """A short prefill chunk after decodes (a suffix over a cached prefix) attends through the decode kernel, one
    row per query token; the backend's output equals the torch reference's, and so do padding rows appended past
    the chunk (as a CUDA graph pads it) leave the real rows unchanged."""
    from picovllm.kernels import backend as be
    assert q_len <= be.SHORT_PREFILL
    b = PagedBatch([3, 20, ctx], [1, 1, q_len], 8, 4, 2, 16, dtype, device, seed=5)
    b.meta.num_decodes = 2           # the last sequence is a prefill chunk, even of one token
    b.q *= 2
    k_cache, v_cache = b.caches()
    store_kv_ref(b.k, b.v, k_cache, v_cache, b.meta.slot_mapping)
    ref = TorchAttentionBackend().forward(b.q.float(), b.k.float(), b.v.float(), k_cache.float(), v_cache.float(),
                                          b.meta, 0.2, window, softcap)
    k_cache, v_cache = b.caches()
    out = TritonAttentionBackend().forward(b.q, b.k, b.v, k_cache, v_cache, b.meta, 0.2, window, softcap)
    assert rel_err(out, ref) < tol
    # padded: 3 rows more in the flat batch, the chunk's host-side length as a graph bucket's
    pad = 3
    q = torch.cat([b.q, torch.randn(pad, *b.q.shape[1:]).to(b.q)])
    got = torch.empty_like(q)
    b.meta.query_lens_cpu = [1, 1, q_len + pad]
    be.TritonAttentionBackend._short_prefill(q, k_cache, v_cache, b.meta, q_len + pad, 0.2, got, window, softcap)
    assert rel_err(got[2:2 + q_len], ref[2:2 + q_len]) < tol
