"""MoE grouped-GEMM tiles at Qwen3-30B-A3B's expert shapes (128 experts, top-8, hidden 2048, expert width 768), GPU only:
decode-sized batches (8-256 tokens: GB/s of the experts' weights read) and prefill-sized ones (512-16384 tokens:
TFLOP/s), each tile checked against the 16x64x32 tile's output. picovllm/kernels/moe.py's expert_tiles comes from it.

    python benchmarks/moe_tiles.py [--fp8]

--fp8: the weights in float8 e4m3 with a scale a row (quantization="fp8"'s layout, layers/fp8_weights.quantize_rows)
and the activations in float16, as fused_experts runs them, with more decode tiles (a float8 weight tile holds half
a bfloat16 one's bytes, so deeper K tiles are tried); the rate counts the float8 bytes. The engine takes bfloat16's
tiles for float8 experts too (expert_tiles) until this says otherwise.
"""
import argparse
import itertools
import json

import torch
import triton

from picovllm.kernels.moe import group_by_expert, grouped_gemm
from picovllm.layers.fp8_weights import quantize_rows

E, K8, H, I = 128, 8, 2048, 768
DECODE = [(bm, bn, bk, 4, 3) for bm, bn, bk in itertools.product((16, 32, 64), (64, 128), (64, 128))] + [
    (16, 64, 32, 4, 3), (16, 128, 128, 8, 3), (32, 128, 128, 8, 4), (16, 64, 128, 4, 4), (16, 128, 64, 4, 4)]
PREFILL = [(16, 64, 128, 4, 3), (32, 64, 128, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 3),
           (128, 128, 64, 8, 3), (64, 128, 128, 8, 3), (128, 64, 64, 4, 3), (64, 256, 64, 8, 3), (128, 128, 32, 4, 4)]


# float8 weights: deeper K tiles (a 16x64x256 e4m3 tile is a 16x64x128 bfloat16 one's bytes) and wider N ones
DECODE_FP8 = DECODE + [(16, 64, 256, 4, 3), (16, 128, 256, 4, 3), (16, 128, 256, 8, 3), (32, 64, 256, 4, 3),
                       (16, 64, 256, 4, 4), (16, 256, 128, 8, 3), (16, 128, 128, 4, 5), (32, 128, 256, 8, 3)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fp8", action="store_true", help="float8 e4m3 weights, a scale a row; float16 activations")
    fp8 = ap.parse_args().fp8
    torch.manual_seed(0)
    act = torch.float16 if fp8 else torch.bfloat16
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    (w13, s13), (w2, s2) = (quantize_rows(w13), quantize_rows(w2)) if fp8 else ((w13, None), (w2, None))
    wbytes = 1 if fp8 else 2
    decode = DECODE_FP8 if fp8 else DECODE
    for tokens, configs in [(8, decode), (64, decode), (256, decode), (512, PREFILL), (2048, PREFILL),
                            (16384, PREFILL)]:
        ids = torch.stack([torch.randperm(E, device="cuda")[:K8] for _ in range(tokens)])
        used = ids.unique().numel()
        x = torch.randn(tokens, H, device="cuda", dtype=act)
        h = torch.randn(tokens * K8, I, device="cuda", dtype=act)
        scale = torch.rand(tokens * K8, device="cuda")
        for name, a, w, ws, div, sc in (("gate_up", x, w13, s13, K8, None), ("down", h, w2, s2, 1, scale)):
            res = []
            for bm, bn, bk, nw, ns in configs:
                rows, te = group_by_expert(ids, E, bm)
                ref = grouped_gemm(a, w, rows, te, tokens * K8, div, sc, block_m=bm, block_n=64, block_k=32,
                                   w_scale=ws)
                f = lambda: grouped_gemm(a, w, rows, te, tokens * K8, div, sc, block_m=bm, block_n=bn,  # noqa: E731
                                         block_k=bk, num_warps=nw, num_stages=ns, w_scale=ws)
                err = ((f().float() - ref.float()).norm() / ref.float().norm()).item()
                ms = triton.testing.do_bench(f, warmup=5, rep=30)
                rate = (used * w.shape[1] * w.shape[2] * wbytes / ms / 1e6 if configs is decode
                        else 2 * tokens * K8 * w.shape[1] * w.shape[2] / ms / 1e9)
                res.append((round(ms * 1e3, 1), round(rate), (bm, bn, bk, nw, ns), round(err, 4)))
            res.sort()
            unit = "GB/s of weights" if configs is decode else "TFLOP/s"
            print(json.dumps({"tokens": tokens, "proj": name, "experts_used": used, "columns": f"us, {unit}, tile, err",
                              "best": res[:4], "16x64x128": [r for r in res if r[2] == (16, 64, 128, 4, 3)],
                              "16x64x32": [r for r in res if r[2] == (16, 64, 32, 4, 3)]}), flush=True)


if __name__ == "__main__":
    main()
