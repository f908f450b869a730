"""Small-M float32 GEMM on the CPU: small_gemm against oneDNN (PackedWeight's two paths), per M.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_small_gemm.py [M ...]

Emulates one decode step of SmolLM2-135M: 30 layers of distinct random weights (qkv 960x576,
o 576x576, gate_up 3072x576, down 576x1536, N x K) and the LM head (49152x576, at most 32 rows),
about 540 MB, so the weights stream from memory as in the engine. Best of 7 steps per path
(the machine is shared); GFLOP/s counts 2 * M * N * K.
"""
from __future__ import annotations

import sys
import time

import torch

from picovllm.kernels.cpu import small_gemm
from picovllm.layers.packed_linear import PackedWeight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)
LAYERS = 30


def main(ms: list[int]) -> None:
    weights = [{name: torch.randn(*shape) * 0.02 for name, shape in SHAPES.items()} for _ in range(LAYERS)]
    head = torch.randn(*HEAD) * 0.02
    onednn = [{name: PackedWeight(w, small_m=0) for name, w in layer.items()} for layer in weights]
    onednn_head = PackedWeight(head, small_m=0)
    ours = [{name: small_gemm.pack_panels(w) for name, w in layer.items()} for layer in weights]
    ours_head = small_gemm.pack_panels(head)
    del weights, head
    print(f"threads {torch.get_num_threads()}")
    print("    M   oneDNN ms  GFLOP/s   ours ms  GFLOP/s  speedup")
    for m in ms:
        xs = {name: torch.randn(m, k) for name, (_, k) in SHAPES.items()}
        x_head = torch.randn(min(m, 32), HEAD[1])
        flops = 2 * (m * LAYERS * sum(n * k for n, k in SHAPES.values()) + min(m, 32) * HEAD[0] * HEAD[1])

        def step_onednn():
            for layer in onednn:
                for name, w in layer.items():
                    w(xs[name])
            onednn_head(x_head)

        def step_ours():
            for layer in ours:
                for name, p in layer.items():
                    small_gemm.small_gemm(xs[name], p, SHAPES[name][0])
            small_gemm.small_gemm(x_head, ours_head, HEAD[0])

        best = {step_onednn: float("inf"), step_ours: float("inf")}
        for _ in range(7):
            for step in best:
                t = time.perf_counter()
                step()
                best[step] = min(best[step], time.perf_counter() - t)
        a, b = best[step_onednn], best[step_ours]
        print(f"{m:5d} {a * 1e3:10.1f} {flops / a / 1e9:8.1f} {b * 1e3:9.1f} {flops / b / 1e9:8.1f} {a / b:8.2f}",
              flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128])
