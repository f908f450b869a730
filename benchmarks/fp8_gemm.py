"""quantization="fp8" on the GPU: the float8-weight GEMM (kernels/fp8_gemm.py) against the bfloat16 weight's own
path (cuBLAS, or the skinny kernel for a row-parallel layer's few rows), and the grouped experts' GEMM with float8
against bfloat16 experts, at model shapes and batch sizes, us per call inside a CUDA graph, weights cold (each
call's weight is one of `copies` copies, together larger than L2).

    python benchmarks/fp8_gemm.py                   # Qwen3-0.6B, -8B and -30B-A3B's shapes
    python benchmarks/fp8_gemm.py --rows 1 8 64     # other batch sizes
"""
from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench_cudagraph

from picovllm.kernels.fp8_gemm import fp8_linear
from picovllm.kernels.moe import fused_experts, route_topk
from picovllm.layers.activation import gated_activation
from picovllm.layers.fp8_weights import quantize_rows

SHAPES = {      # name: (N, K) of a linear layer
    "0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024), "0.6b down": (1024, 3072),
    "8b qkv": (6144, 4096), "8b gate_up": (24576, 4096), "8b down": (4096, 12288),
    "30b-a3b qkv": (5120, 2048), "30b-a3b o": (2048, 4096),
}


def bench_linear(name: str, n: int, k: int, rows: int, copies: int) -> dict:
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    qs = [quantize_rows(w) for w in ws]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    from picovllm.layers.linear import _skinny, _skinny_kernels
    skinny = _skinny(x, ws[0])

    def bf16():
        for w in ws:
            _skinny_kernels().skinny_linear(x, w) if skinny else torch.nn.functional.linear(x, w)

    def fp8():
        for c, s in qs:
            fp8_linear(x, c, s, method="triton")

    def widened():
        for c, s in qs:
            fp8_linear(x, c, s, method="widen")

    ref = torch.nn.functional.linear(x.float(), (qs[0][0].float() * qs[0][1][:, None]))
    err = ((fp8_linear(x, *qs[0]).float() - ref).norm() / ref.norm()).item()
    t16 = do_bench_cudagraph(bf16) * 1000 / copies
    t8 = do_bench_cudagraph(fp8) * 1000 / copies
    tw = do_bench_cudagraph(widened) * 1000 / copies
    return {"shape": name, "rows": rows, "bf16_us": round(t16, 2), "fp8_us": round(t8, 2), "widen_us": round(tw, 2),
            "speedup": round(t16 / t8, 2), "fp8_weight_TBps": round(n * k / t8 / 1e6, 2), "rel_err": f"{err:.1e}"}


def sweep(name: str, n: int, k: int, rows: int, copies: int) -> dict:
    """The fastest fp8_linear kernel config for this shape and batch (us, cold weights), beside fp8_config's."""
    import itertools

    from picovllm.kernels.fp8_gemm import fp8_config
    qs = [quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bm = fp8_config(rows, n, k)[0]
    times = {}
    for bn, bk, w_kn, stages in itertools.product((16, 32, 64), (256, 512, 1024), (True, False), (3, 4)):
        if bm * bk > 16384 or k % bk:
            continue
        cfg = (bm, bn, bk, 4, stages, w_kn)
        try:
            times[cfg] = do_bench_cudagraph(lambda: [fp8_linear(x, c, s, config=cfg) for c, s in qs],
                                            rep=20) * 1000 / copies
        except Exception as e:       # out of shared memory: not a candidate
            times[cfg] = float("inf")
            print("skip", cfg, repr(e)[:80], flush=True)
    best = min(times, key=times.get)
    default = fp8_config(rows, n, k)
    return {"shape": name, "rows": rows, "best": best, "best_us": round(times[best], 2),
            "default": default, "default_us": round(times.get(default, float("nan")), 2)}


def bench_experts(tokens: int, copies: int = 2) -> dict:
    """Qwen3-30B-A3B's experts (128, top-8, hidden 2048, intermediate 768): one layer's routed MLP."""
    e, h, i = 128, 2048, 768
    layers = []
    for _ in range(copies):
        gu = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02
        dn = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02
        layers.append((gu, dn, *quantize_rows(gu), *quantize_rows(dn)))
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    w, ids = route_topk(torch.randn(tokens, e, device="cuda"), 8, True)
    act = gated_activation("silu")

    def bf16():
        for gu, dn, *_ in layers:
            fused_experts(x, w, ids, gu, dn, act)

    def fp8():
        for _, _, gc, gs, dc, ds in layers:
            fused_experts(x, w, ids, gc, dc, act, None, None, gs, ds)

    t16 = do_bench_cudagraph(bf16) * 1000 / copies
    t8 = do_bench_cudagraph(fp8) * 1000 / copies
    return {"shape": "30b-a3b experts", "rows": tokens, "bf16_us": round(t16, 2), "fp8_us": round(t8, 2),
            "speedup": round(t16 / t8, 2)}


def expert_sweep(tokens: int) -> dict:
    """The fastest decode tile of the grouped GEMM on float8 experts (Qwen3-30B-A3B's), beside expert_tiles'."""
    import itertools

    from picovllm.kernels import moe
    e, h, i = 128, 2048, 768
    layers = []
    for _ in range(2):
        gu, dn = (torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02,
                  torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02)
        layers.append((*quantize_rows(gu), *quantize_rows(dn)))
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    w, ids = route_topk(torch.randn(tokens, e, device="cuda"), 8, True)
    act = gated_activation("silu")
    default, real = moe.expert_tiles(tokens * 8, e), moe.expert_tiles
    times = {}
    for bn, bk, stages, warps in itertools.product((32, 64, 128), (128, 256), (3, 4), (4,)):
        tiles = dict(default, block_n=bn, block_k=bk, num_stages=stages, num_warps=warps)
        moe.expert_tiles = lambda pairs, experts: tiles
        try:
            times[(bn, bk, stages, warps)] = do_bench_cudagraph(
                lambda: [fused_experts(x, w, ids, gc, dc, act, None, None, gs, ds) for gc, gs, dc, ds in layers],
                rep=20) * 1000 / 2
        except Exception:
            pass
        finally:
            moe.expert_tiles = real
    best = min(times, key=times.get)
    key = (default["block_n"], default["block_k"], default["num_stages"], default["num_warps"])
    return {"shape": "30b-a3b experts fp8", "rows": tokens, "best": best, "best_us": round(times[best], 2),
            "default": key, "default_us": round(times.get(key, float("nan")), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512, 4096])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--expert-tokens", type=int, nargs="+", default=[1, 8, 64, 256, 4096])
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--expert-sweep", action="store_true", help="the grouped GEMM's best decode tile on fp8 experts")
    ap.add_argument("--sweep", action="store_true", help="the best kernel config per shape and batch, nothing else")
    args = ap.parse_args()
    print(json.dumps({"device": torch.cuda.get_device_name(0)}), flush=True)
    if args.expert_sweep:
        for t in args.expert_tokens:
            print(json.dumps(expert_sweep(t)), flush=True)
        return
    if args.sweep:
        for name in args.shapes:
            for rows in args.rows:
                print(json.dumps(sweep(name, *SHAPES[name], rows, args.copies)), flush=True)
        return
    for name in args.shapes:
        for rows in args.rows:
            print(json.dumps(bench_linear(name, *SHAPES[name], rows, args.copies)), flush=True)
    for t in args.expert_tokens:
        print(json.dumps(bench_experts(t)), flush=True)


if __name__ == "__main__":
    main()
