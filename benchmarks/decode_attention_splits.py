"""Decode attention at batch 1-8 (context 512 and 2048) by num_splits, timed inside a CUDA graph over 28 layers' caches
(as a decode step replays them): us per layer. GPU only. (Qwen3-0.6B's heads: 16 query, 8 KV, head_dim 128.)

    python benchmarks/decode_attention_splits.py
"""
import json

import torch

from picovllm.kernels.decode_attention import decode_attention, num_splits_for

HQ, HKV, D, BS, LAYERS = 16, 8, 128, 16, 28


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(20):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / 20 / LAYERS * 1e3


def main() -> None:
    for b in (1, 4, 8):
        for ctx in (512, 2048):
            nb = b * ctx // BS + 1
            caches = [(torch.randn(nb, BS, HKV, D, device="cuda", dtype=torch.bfloat16),) * 2 for _ in range(LAYERS)]
            tables = torch.arange(b * (ctx // BS), device="cuda", dtype=torch.int32).view(b, -1)
            lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
            q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            row = {"batch": b, "ctx": ctx, "auto_splits": num_splits_for(b, HKV)}
            for splits in (None, 1, 2, 4, 8, 16):
                row[f"splits_{splits or 'auto'}_us"] = round(graph_us(lambda: [decode_attention(
                    q, k, v, tables, lens, D ** -0.5, out=out, num_splits=splits) for k, v in caches]), 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
