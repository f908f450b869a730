"""The memory-bandwidth floor of the nano workload on a mixture-of-experts model: no engine can beat it.

    python benchmarks/moe_bound.py                       # Qwen3-30B-A3B's shape, 4.0 and 4.8 TB/s
    python benchmarks/moe_bound.py --bandwidth 4.3 --peer 381.5

A decode step must read, at least once, the weights of every expert that one of its tokens routes to, the dense
weights (attention projections, router, embedding rows aside: the LM head), and every running request's KV cache.
With b tokens each routed to k of E experts uniformly at random (what a random checkpoint's router does), the
expected number of experts touched is E (1 - (1 - k/E)^b): at batch 256 all 128 of Qwen3-30B-A3B's, 58 GB a step.
As requests finish the batch shrinks, but a step still touches most experts until only a few tokens are left, and
the workload runs as many steps as its longest request has outputs. Prefill is counted at the GPU's dense bf16
peak (989 TFLOP/s on an H200) over the active parameters. Everything else a real step does (routing, norms,
attention's arithmetic, sampling, launches) is left out, so the real rate is lower.

Prints the floor's output tok/s at each bandwidth, and with --peer its multiple of the peer's rate.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from nano_throughput import workload  # noqa: E402

# Qwen3-30B-A3B (config.json): hidden 2048, 48 layers, 32 q / 4 kv heads of 128, 128 experts of 768, top-8,
# vocabulary 151,936, LM head not tied
SHAPE = dict(hidden=2048, layers=48, q_heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, inter=768,
             vocab=151936)
DENSE_PEAK_FLOPS = 989e12      # H200, bf16 dense


def floor(bandwidth: float, s: dict = SHAPE) -> dict:
    prompts, params = workload()
    p_lens = [len(p) for p in prompts]
    outs = [sp.max_tokens for sp in params]
    h, n_layers, d, e, k = s["hidden"], s["layers"], s["head_dim"], s["experts"], s["top_k"]
    expert_bytes = 3 * h * s["inter"] * 2 * n_layers                       # gate, up, down; bf16; every layer
    dense_bytes = (n_layers * (h * (s["q_heads"] + 2 * s["kv_heads"]) * d + s["q_heads"] * d * h + e * h)
                   + s["vocab"] * h) * 2
    kv_bytes_per_token = n_layers * 2 * s["kv_heads"] * d * 2
    active_params = n_layers * (h * (s["q_heads"] + 2 * s["kv_heads"]) * d + s["q_heads"] * d * h
                                + k * 3 * h * s["inter"]) + s["vocab"] * h
    decode_s, tokens = 0.0, 0
    for step in range(max(outs)):
        running = [i for i in range(len(outs)) if outs[i] > step]
        b = len(running)
        touched = e * (1 - (1 - k / e) ** b)
        context = sum(p_lens[i] + step for i in running)
        decode_s += (touched * expert_bytes + dense_bytes + context * kv_bytes_per_token) / bandwidth
        tokens += b
    prefill_s = 2 * active_params * sum(p_lens) / DENSE_PEAK_FLOPS
    return {"bandwidth_TBps": bandwidth / 1e12, "output_tokens": tokens, "decode_s": round(decode_s, 3),
            "prefill_s": round(prefill_s, 3), "floor_tok_per_s": round(tokens / (decode_s + prefill_s), 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bandwidth", type=float, nargs="+", default=[4.0, 4.8], help="TB/s")
    ap.add_argument("--peer", type=float, help="the peer's output tok/s, to print the floor's multiple of it")
    args = ap.parse_args()
    for bw in args.bandwidth:
        row = floor(bw * 1e12)
        if args.peer:
            row["x_peer"] = round(row["floor_tok_per_s"] / args.peer, 1)
        print(row)


if __name__ == "__main__":
    main()
