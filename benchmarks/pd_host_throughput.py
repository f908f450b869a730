"""1P1D against colocated where the host's work is all there is: a tiny random Qwen3 (hidden 64, 2 layers) on the
CPU, P and D in processes of their own linked by cuda_ipc (shared memory on a CPU), one intra-op thread each.

    python benchmarks/pd_host_throughput.py colocated|disagg [--num-seqs 128] [--runs 2]

What a disaggregated run costs the host beyond a colocated one shows here undiluted: the workers' loops, the
handover messages, the outputs on the wire to the driver. Output tok/s, the best of --runs runs after a warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

os.environ["OMP_NUM_THREADS"] = "1"      # before torch: the spawned engines inherit it
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from picovllm import LLM, SamplingParams  # noqa: E402
from picovllm.disagg import DisaggLLM  # noqa: E402
from random_qwen3 import build  # noqa: E402


def workload(n: int) -> tuple[list, list]:
    rng = random.Random(0)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(32, 256))] for _ in range(n)]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=rng.randint(128, 512)) for _ in range(n)]
    return prompts, params


def best_tok_s(generate, n: int, runs: int) -> float:
    prompts, params = workload(n)
    generate([[1, 2, 3]], [SamplingParams(max_tokens=4)])        # warm-up
    best = 0.0
    for _ in range(runs):
        t = time.perf_counter()
        outs = generate(prompts, params)
        dt = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        assert n_out == sum(p.max_tokens for p in params), [o.error for o in outs if o.error][:3]
        best = max(best, n_out / dt)
    return round(best, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["colocated", "disagg"])
    ap.add_argument("--num-seqs", type=int, default=128)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build(os.path.join(tempfile.gettempdir(), "picovllm-host-cost-qwen3-64x2"), vocab_size=1024,
                  hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)
    n = args.num_seqs
    common = dict(max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=16384, enable_prefix_caching=False,
                  skip_tokenizer_init=True)
    if args.mode == "colocated":
        llm = LLM(model, device="cpu", num_kv_blocks=n * 48, **common)
        tok_s = best_tok_s(lambda p, s: llm.generate(p, s, use_tqdm=False), n, args.runs)
    else:
        with DisaggLLM(model, backend="cuda_ipc", prefill_device="cpu", decode_device="cpu",
                       prefill={"num_kv_blocks": n * 20}, decode={"num_kv_blocks": n * 48}, **common) as llm:
            tok_s = best_tok_s(llm.generate, n, args.runs)
    print(json.dumps({"mode": args.mode, "num_seqs": n, "output_tok_per_s": tok_s}))


if __name__ == "__main__":
    main()
