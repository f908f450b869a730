"""MoE grouped-GEMM tiles at Qwen3-30B-A3B's expert shapes (128 experts, top-8, hidden 2048, expert width 768), GPU only:
decode-sized batches (8-256 tokens: GB/s of the experts' weights read) and prefill-sized ones (512-16384 tokens:
TFLOP/s), each tile checked against the 16x64x32 tile's output. picovllm/kernels/moe.py's expert_tiles comes from it.

    python benchmarks/moe_tiles.py
"""
import itertools
import json

import torch
import triton

from picovllm.kernels.moe import group_by_expert, grouped_gemm

E, K8, H, I = 128, 8, 2048, 768
DECODE = [(bm, bn, bk, 4, 3) for bm, bn, bk in itertools.product((16, 32, 64), (64, 128), (64, 128))] + [
    (16, 64, 32, 4, 3), (16, 128, 128, 8, 3), (32, 128, 128, 8, 4), (16, 64, 128, 4, 4), (16, 128, 64, 4, 4)]
PREFILL = [(16, 64, 128, 4, 3), (32, 64, 128, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 3),
           (128, 128, 64, 8, 3), (64, 128, 128, 8, 3), (128, 64, 64, 4, 3), (64, 256, 64, 8, 3), (128, 128, 32, 4, 4)]


def main() -> None:
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    for tokens, configs in [(8, DECODE), (64, DECODE), (256, DECODE), (512, PREFILL), (2048, PREFILL),
                            (16384, PREFILL)]:
        ids = torch.stack([torch.randperm(E, device="cuda")[:K8] for _ in range(tokens)])
        used = ids.unique().numel()
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(tokens * K8, I, device="cuda", dtype=torch.bfloat16)
        scale = torch.rand(tokens * K8, device="cuda")
        for name, a, w, div, sc in (("gate_up", x, w13, K8, None), ("down", h, w2, 1, scale)):
            res = []
            for bm, bn, bk, nw, ns in configs:
                rows, te = group_by_expert(ids, E, bm)
                ref = grouped_gemm(a, w, rows, te, tokens * K8, div, sc, block_m=bm, block_n=64, block_k=32)
                f = lambda: grouped_gemm(a, w, rows, te, tokens * K8, div, sc, block_m=bm, block_n=bn,  # noqa: E731
                                         block_k=bk, num_warps=nw, num_stages=ns)
                err = ((f().float() - ref.float()).norm() / ref.float().norm()).item()
                ms = triton.testing.do_bench(f, warmup=5, rep=30)
                rate = (used * w.shape[1] * w.shape[2] * 2 / ms / 1e6 if configs is DECODE
                        else 2 * tokens * K8 * w.shape[1] * w.shape[2] / ms / 1e9)
                res.append((round(ms * 1e3, 1), round(rate), (bm, bn, bk, nw, ns), round(err, 4)))
            res.sort()
            unit = "GB/s of weights" if configs is DECODE else "TFLOP/s"
            print(json.dumps({"tokens": tokens, "proj": name, "experts_used": used, "columns": f"us, {unit}, tile, err",
                              "best": res[:4], "16x64x128": [r for r in res if r[2] == (16, 64, 128, 4, 3)],
                              "16x64x32": [r for r in res if r[2] == (16, 64, 32, 4, 3)]}), flush=True)


if __name__ == "__main__":
    main()
