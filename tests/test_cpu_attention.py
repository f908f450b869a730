"""The CPU decode-attention kernel (picovllm/kernels/cpu/paged_decode.c) against a float64 reference:
dense softmax attention over each sequence's tokens, gathered from the paged cache by hand."""
import random

import pytest
import torch

from picovllm import LLM, SamplingParams
from picovllm.kernels.cpu import decode_attention as cpu_kernel

pytestmark = pytest.mark.skipif(not cpu_kernel.available(4, 2, 16, 4), reason="no working C compiler")


def reference(q, k_cache, v_cache, tables, lens, scale, window=None, softcap=None):
    """float64, one sequence and one head at a time (the last `window` tokens of each, scores soft-capped)."""
    hq, hkv, bs = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        first = 0 if window is None else max(0, n - window)
        slots = [tables[b][t // bs] * bs + t % bs for t in range(first, n)]
        keys = k_cache.reshape(-1, hkv, q.shape[2])[slots].double()      # [n, Hkv, D]
        vals = v_cache.reshape(-1, hkv, q.shape[2])[slots].double()
        for h in range(hq):
            kv = h // (hq // hkv)
            s = keys[:, kv] @ q[b, h].double() * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            out[b, h] = torch.softmax(s, 0) @ vals[:, kv]
    return out


def scattered_tables(rng: random.Random, lens: list[int], bs: int, spare: int) -> tuple[list[list[int]], int]:
    """Block tables for sequences of these lengths, their blocks shuffled over a cache with `spare` blocks more
    than they need (rows padded with block 0); and that cache's block count."""
    width = max(-(-n // bs) for n in lens)
    num_blocks = sum(-(-n // bs) for n in lens) + spare
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for n in lens:
        need = -(-n // bs)
        tables.append(free[:need] + [0] * (width - need))
        free = free[need:]
    return tables, num_blocks


@pytest.mark.parametrize("hq,hkv,dim,bs", [(4, 4, 16, 4), (9, 3, 64, 16), (8, 2, 80, 5), (6, 1, 32, 1),
                                           (16, 8, 128, 16)])
@pytest.mark.parametrize("threads,entry", [(1, "openmp"), (2, "openmp"), (2, "thread-pool")])
def test_matches_float64_reference(hq, hkv, dim, bs, threads, entry, monkeypatch):
    lib = cpu_kernel._library((hq, hkv, dim, bs))
    if entry == "openmp" and not lib.openmp:
        pytest.skip("built without OpenMP")
    monkeypatch.setattr(lib, "openmp", entry == "openmp")
    rng = random.Random(hq * 100 + bs)
    lens = [0, 1, bs, bs + 1, 2 * bs - 1] + [rng.randint(1, 90) for _ in range(6)]
    tables, num_blocks = scattered_tables(rng, lens, bs, spare=3)
    g = torch.Generator().manual_seed(hq + dim)
    k_cache = torch.randn(num_blocks, bs, hkv, dim, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, dim, generator=g)
    q = torch.randn(len(lens), hq, dim, generator=g) * 2     # sharper softmax than unit scale
    scale = dim ** -0.5
    batch = cpu_kernel.decode_batch(torch.tensor(tables, dtype=torch.int32), lens, threads=threads)
    out = cpu_kernel.paged_decode_attention(q, k_cache, v_cache, batch, scale)
    ref = reference(q, k_cache, v_cache, tables, lens, scale)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), ref, atol=2e-6, rtol=1e-5), (out.double() - ref).abs().max()
    assert not out[0].any()                                   # an empty context gives zeros


@pytest.mark.parametrize("hq,hkv,dim,bs", [(4, 4, 16, 4), (8, 1, 80, 16), (4, 2, 256, 16)])
@pytest.mark.parametrize("window,softcap", [(7, None), (16, None), (1, None), (None, 1.5), (9, 1.5)])
def test_sliding_window_and_softcap_match_float64_reference(hq, hkv, dim, bs, window, softcap):
    """Windows off and on block edges and shorter than most contexts; head dims 80 and 256, one KV head."""
    rng = random.Random(dim + bs)
    lens = [0, 1, window or 3, (window or 3) + 1, bs + 3] + [rng.randint(1, 70) for _ in range(4)]
    tables, num_blocks = scattered_tables(rng, lens, bs, spare=2)
    g = torch.Generator().manual_seed(dim)
    k_cache = torch.randn(num_blocks, bs, hkv, dim, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, dim, generator=g)
    q = torch.randn(len(lens), hq, dim, generator=g) * 2
    batch = cpu_kernel.decode_batch(torch.tensor(tables, dtype=torch.int32), lens, threads=2)
    out = cpu_kernel.paged_decode_attention(q, k_cache, v_cache, batch, dim ** -0.5, window, softcap)
    ref = reference(q, k_cache, v_cache, tables, lens, dim ** -0.5, window, softcap)
    assert torch.allclose(out.double(), ref, atol=2e-6, rtol=1e-5), (out.double() - ref).abs().max()


def test_loading_keeps_denormals():
    """Built with -ffast-math but linked without it: loading must not switch the process to flush-to-zero."""
    assert cpu_kernel.available(4, 2, 16, 4)
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 1.0).item() != 0.0


def test_engine_picks_it_and_matches_the_torch_backend(tiny_models):
    path = tiny_models["qwen3"]
    rng = random.Random(0)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (3, 17, 40, 64)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = LLM(path, block_size=8, num_kv_blocks=64)
    assert type(ours.engine.runner.attn_backend).__name__ == "CpuAttentionBackend"
    torch_backend = LLM(path, block_size=8, num_kv_blocks=64, attention_backend="torch")
    a = [o.outputs[0].token_ids for o in ours.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in torch_backend.generate(prompts, params, use_tqdm=False)]
    assert a == b
