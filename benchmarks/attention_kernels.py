"""Decode and prefill attention kernels on Qwen3-0.6B shapes: achieved bandwidth / FLOP rate per config.

    python benchmarks/attention_kernels.py

    python benchmarks/attention_kernels.py splits      # split counts at nano-like batches
    python benchmarks/attention_kernels.py fp8         # bf16 against fp8 caches: tiles, warps, stages, splits
    python benchmarks/attention_kernels.py sweep [B..] # both caches at batches B: the default against tiles x stages x splits

Decode reads K and V once: bytes = sum(ctx) * Hkv * D * 2 (K, V) * 2 bytes (1 byte for fp8). Each config is first
checked against the torch reference (relative error), then timed with triton.testing.do_bench (median).
"""
from __future__ import annotations

import os
import random

import torch
import triton

from picovllm.kernels.decode_attention import decode_attention
from picovllm.kernels.prefill_attention import prefill_attention
from picovllm.layers.attention import AttentionMetadata, TorchAttentionBackend

HQ, HKV, D = 16, 8, 128
BS = int(os.environ.get("BS", 16))    # the cache's block size (A/B runs: BS=64 python benchmarks/attention_kernels.py)


def paged(ctx_lens, dev="cuda"):
    blocks = sum(-(-c // BS) for c in ctx_lens) + 1
    perm = torch.randperm(blocks).tolist()
    tables, width = [], max(-(-c // BS) for c in ctx_lens)
    for c in ctx_lens:
        n = -(-c // BS)
        t, perm = perm[:n], perm[n:]
        tables.append(t + [0] * (width - n))
    k = torch.randn(blocks, BS, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    i32 = dict(dtype=torch.int32, device=dev)
    return k, v, torch.tensor(tables, **i32), torch.tensor(ctx_lens, **i32)


def decode_meta(lens, seq_lens, tables) -> AttentionMetadata:
    """The torch reference's metadata for a decode-only batch of these contexts."""
    return AttentionMetadata(seq_lens=seq_lens, block_tables=tables, num_decodes=len(lens), seq_lens_cpu=lens,
                             slot_mapping=None, query_start_loc=None, max_query_len=1, max_seq_len=max(lens),
                             query_lens_cpu=[1] * len(lens))


def fp8_caches(k, v, scale=0.02):
    """k, v / scale in e4m3 and their (k_scale, v_scale) per KV head: |randn| < 5 fits e4m3 (max 448) times 0.02."""
    ks = torch.full((HKV,), scale, device=k.device)
    return (k / scale).to(torch.float8_e4m3fn), (v / scale).to(torch.float8_e4m3fn), (ks, ks)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_decode():
    print("decode: batch, ctx, block_n, warps, stages, splits -> us, TB/s, rel_err")
    random.seed(0)
    cases = [(256, None), (64, None), (1, 512), (1, 4096), (32, 2048)]
    configs = [(64, 4, 2), (64, 4, 3), (32, 4, 3), (128, 4, 2), (64, 8, 3), (128, 8, 3)]
    best = {}
    for b, ctx in cases:
        lens = [ctx or random.randint(200, 2048) for _ in range(b)]
        k, v, tables, seq_lens = paged(lens)
        q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
        meta = decode_meta(lens, seq_lens, tables)
        ref = TorchAttentionBackend._decode(q.float(), k.float(), v.float(), meta, D ** -0.5)
        nbytes = sum(lens) * HKV * D * 2 * 2
        for bn, w, s in configs:
            f = lambda: decode_attention(q, k, v, tables, seq_lens, D ** -0.5, block_n=bn, num_warps=w,  # noqa
                                         num_stages=s)
            err = rel(f(), ref)
            us = triton.testing.do_bench(f, warmup=20, rep=100, return_mode="median") * 1e3
            tbps = nbytes / us / 1e6
            print(f"  {b:4d} {max(lens):5d} {bn:4d} {w} {s} -> {us:8.1f} us {tbps:5.2f} TB/s err {err:.1e}")
            if err < 2e-2 and tbps > best.get((b, ctx), (0, None))[0]:
                best[(b, ctx)] = (tbps, (bn, w, s))
    print("decode best:", {f"{b}x{c}": v for (b, c), v in best.items()})


def bench_decode_splits():
    """The engine's decode batches: contexts spread 100-2048 tokens. Does splitting long contexts
    (more, shorter programs) beat the default grid of one program per (sequence, kv head)?"""
    print("decode splits: batch, block_n, warps, stages, splits -> us, TB/s")
    random.seed(1)
    for b in (256, 128, 64, 32, 16):
        lens = [random.randint(100, 2048) for _ in range(b)]
        k, v, tables, seq_lens = paged(lens)
        q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
        nbytes = sum(lens) * HKV * D * 2 * 2
        for bn, w, s in [(None, 4, 2), (128, 4, 2), (64, 4, 2), (64, 4, 3)]:
            for splits in (None, 1, 2, 3, 4, 6, 8, 12, 16):
                f = lambda: decode_attention(q, k, v, tables, seq_lens, D ** -0.5, block_n=bn, num_warps=w,  # noqa
                                             num_stages=s, num_splits=splits)
                us = triton.testing.do_bench(f, warmup=20, rep=100, return_mode="median") * 1e3
                print(f"  {b:4d} {str(bn):>4} {w} {s} {str(splits):>4} -> {us:8.1f} us {nbytes / us / 1e6:5.2f} TB/s")


def bench_decode_fp8():
    """The nano workload's decode batches (contexts 200-2048) over a bf16 and an fp8 cache, by tile, warps, stages and
    splits (the kernel's defaults: block_n, num_warps, num_stages None)."""
    print("decode bf16/fp8: kv, batch, block_n, warps, stages, splits -> us, TB/s, rel_err")
    random.seed(2)
    for b in (256, 64):
        lens = [random.randint(200, 2048) for _ in range(b)]
        k, v, tables, seq_lens = paged(lens)
        q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
        meta = decode_meta(lens, seq_lens, tables)
        k8, v8, s8 = fp8_caches(k, v)
        for kv, kc, vc, scales, width in (("bf16", k, v, None, 2), ("fp8", k8, v8, s8, 1)):
            ref = TorchAttentionBackend._decode(q.float(), kc.float() * (0.02 if scales else 1),
                                                vc.float() * (0.02 if scales else 1), meta, D ** -0.5)
            nbytes = sum(lens) * HKV * D * 2 * width
            best = (0.0, None)
            configs = [(bn, w, st, splits) for bn in (64, 128) for w in (2, 4) for st in (2, 3) for splits in (None, 2)]
            for bn, w, st, splits in configs:
                f = lambda: decode_attention(q, kc, vc, tables, seq_lens, D ** -0.5, block_n=bn,  # noqa
                                             num_warps=w, num_stages=st, num_splits=splits, kv_scales=scales)
                try:
                    err = rel(f(), ref)
                except Exception as e:   # e.g. out of shared memory
                    print(f"  {kv} {b:4d} {bn:4d} {w} {st} {str(splits):>4} -> failed: {str(e)[:80]}")
                    continue
                us = triton.testing.do_bench(f, warmup=10, rep=40, return_mode="median") * 1e3
                tbps = nbytes / us / 1e6
                print(f"  {kv} {b:4d} {bn:4d} {w} {st} {str(splits):>4} -> {us:8.1f} us {tbps:5.2f} TB/s "
                      f"err {err:.1e}", flush=True)
                if err < 3e-2 and tbps > best[0]:
                    best = (tbps, (bn, w, st, splits, round(us, 1)))
            print(f"best {kv} batch {b}: {best[1]} at {best[0]:.2f} TB/s", flush=True)


def bench_decode_sweep(batches):
    """The default config against 128/64-token tiles x 2/3 stages x 1-12 splits, bf16 and fp8 caches, nano-like
    contexts (100-2048 tokens); best of two medians each. Prints the default and the five fastest."""
    from picovllm.kernels.decode_attention import num_splits_for
    random.seed(3)
    for b in batches:
        lens = [random.randint(100, 2048) for _ in range(b)]
        k, v, tables, seq_lens = paged(lens)
        q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
        k8, v8, s8 = fp8_caches(k, v)
        for kv, kc, vc, sc in (("bf16", k, v, None), ("fp8", k8, v8, s8)):
            def time(**kw):
                f = lambda: decode_attention(q, kc, vc, tables, seq_lens, D ** -0.5, kv_scales=sc, **kw)  # noqa
                return min(triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median") for _ in range(2)) * 1e3
            dflt = num_splits_for(b, HKV)
            res = sorted((time(block_n=bn, num_stages=st, num_splits=sp), bn, st, sp)
                         for bn in (64, 128) for st in (2, 3) for sp in sorted({1, 2, 3, 4, 6, 8, 12, dflt})
                         if b * HKV * sp <= 12000)
            print(f"{kv} b{b}: default {time():.1f} us (splits {dflt}); best " +
                  "; ".join(f"{u:.1f} bn{bn} st{st} sp{sp}" for u, bn, st, sp in res[:5]), flush=True)


def bench_prefill():
    print("prefill 8k: block_m, block_n, warps, stages -> ms, TFLOP/s, rel_err")
    n = 8192
    k, v, tables, seq_lens = paged([n])
    q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
    qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    flops = 4 * n * n / 2 * D * HQ
    sub = slice(n - 256, n)        # reference on the last 256 queries (the full one needs too much memory)
    keys = k[tables[0].long()].flatten(0, 1)[:n].transpose(0, 1).float()
    vals = v[tables[0].long()].flatten(0, 1)[:n].transpose(0, 1).float()
    mask = torch.arange(n, device="cuda")[None, :] <= torch.arange(n - 256, n, device="cuda")[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q[sub].transpose(0, 1).float(), keys, vals, attn_mask=mask,
                                                           scale=D ** -0.5, enable_gqa=True).transpose(0, 1)
    for bm, bn, w, s in [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2)]:
        out = torch.empty_like(q)
        f = lambda: prefill_attention(q, k, v, tables, seq_lens, qsl, 0, 1, n, D ** -0.5, out,  # noqa
                                      block_m=bm, block_n=bn, num_warps=w, num_stages=s)
        try:
            f()
        except Exception as e:   # e.g. out of shared memory
            print(f"  {bm} {bn} {w} {s} -> failed: {str(e)[:100]}")
            continue
        err = rel(out[sub], ref)
        ms = triton.testing.do_bench(f, warmup=20, rep=100, return_mode="median")
        print(f"  {bm:4d} {bn:4d} {w} {s} -> {ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s err {err:.1e}")
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa
        q.transpose(0, 1)[None], k[tables[0].long()].flatten(0, 1)[:n].transpose(0, 1)[None],
        v[tables[0].long()].flatten(0, 1)[:n].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
    ms = triton.testing.do_bench(sdpa, warmup=20, rep=100, return_mode="median")
    print(f"  torch SDPA (contiguous K/V incl. gather) -> {ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s")


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["splits"]:
        bench_decode_splits()
    elif sys.argv[1:] == ["fp8"]:
        bench_decode_fp8()
    elif sys.argv[1:2] == ["sweep"]:
        bench_decode_sweep([int(b) for b in sys.argv[2:]] or [32, 64, 128, 192, 256])
    else:
        bench_decode()
        bench_prefill()
