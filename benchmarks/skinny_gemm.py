"""Skinny (batch 1-8) linear: cuBLAS (F.linear) against picovllm/kernels/skinny_gemm.py's configs, timed inside a CUDA
graph over enough weight copies that L2 never holds them (as a model's layers are read), on Qwen3-0.6B's and -8B's
shapes. GPU only.

    python benchmarks/skinny_gemm.py [shape ...]      # shapes: qkv o gate_up down lm_head 8b_qkv 8b_o 8b_gate_up 8b_down
"""
import json, math, sys
import torch
import torch.nn.functional as F
from picovllm.kernels.skinny_gemm import skinny_linear

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024), "8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (24576, 4096),
          "8b_down": (4096, 12288)}
CONFIGS = [(16, 256, 4, 3), (16, 256, 4, 4), (16, 256, 4, 5), (16, 512, 4, 3), (16, 512, 4, 4), (16, 512, 4, 5),
           (32, 256, 4, 3), (32, 256, 4, 4), (32, 512, 4, 3), (32, 512, 4, 4), (64, 256, 4, 3), (64, 128, 4, 4),
           (16, 1024, 4, 3), (32, 256, 8, 4), (16, 512, 8, 4)]
only = sys.argv[1:]

def graph_time(fn, copies):
    g = torch.cuda.CUDAGraph()
    fn(0); torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        g.replay()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / 10 / copies * 1e3    # us per call

for name, (n, k) in SHAPES.items():
    if only and name not in only:
        continue
    nbytes = n * k * 2
    copies = max(4, math.ceil(300e6 / nbytes))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in (1, 2, 4, 8)}
    row = {"shape": name, "n": n, "k": k, "MB": round(nbytes / 1e6, 1)}
    for m in (1, 8):
        ref = F.linear(xs[m], ws[0])
        row[f"cublas_m{m}_us"] = round(graph_time(lambda i: F.linear(xs[m], ws[i]), copies), 2)
    res = []
    for cfg in CONFIGS:
        if k % cfg[1]:
            continue
        try:
            y = skinny_linear(xs[8], ws[0], config=cfg)
            err = ((y.float() - F.linear(xs[8], ws[0]).float()).norm() / F.linear(xs[8], ws[0]).float().norm()).item()
            us = graph_time(lambda i: skinny_linear(xs[1], ws[i], config=cfg), copies)
            res.append((us, cfg, err))
        except Exception as e:
            print("fail", name, cfg, str(e)[:100])
    res.sort()
    best = res[0][1]
    for m in (1, 2, 4, 8):
        row[f"triton_m{m}_us"] = round(graph_time(lambda i: skinny_linear(xs[m], ws[i], config=best), copies), 2)
    row["best"] = best
    row["top"] = [(round(u, 2), c, round(e, 5)) for u, c, e in res[:5]]
    row["TBps_cublas_m1"] = round(nbytes / row["cublas_m1_us"] / 1e6, 2)
    row["TBps_triton_m1"] = round(nbytes / row["triton_m1_us"] / 1e6, 2)
    print(json.dumps(row), flush=True)
    del ws
    torch.cuda.empty_cache()
