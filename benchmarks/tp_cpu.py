"""Tensor parallelism on the CPU: TP=1 vs TP=2 throughput on the default model (the cpu-small workload).

    python benchmarks/tp_cpu.py                 # TP=1 then TP=2, greedy, ignore_eos
    python benchmarks/tp_cpu.py --tp 1,2,4 --json

A correctness-of-scaling figure, not a speed goal: on a 2-core machine the ranks split the cores
(each rank gets cpu_count // tp threads unless OMP_NUM_THREADS is set), and every layer adds two
all-reduces over gloo. The TP>1 outputs are also compared token by token with TP=1's.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def cpu_small_workload(num_requests: int = 32) -> list[tuple[list[int], int]]:
    """Issue 2's cpu-small draw (all prompts first, then all max_tokens), shared with `picovllm bench`."""
    from picovllm.bench.workloads import make_workload
    w = make_workload("cpu-small", num_requests)
    return list(zip(w.prompts, w.max_tokens))


def run(model: str | None, tp: int, work: list[tuple[list[int], int]]) -> dict:
    from picovllm import LLM, SamplingParams

    t0 = time.perf_counter()
    with LLM(model, tensor_parallel_size=tp, device="cpu") as llm:
        startup = time.perf_counter() - t0
        llm.generate([work[0][0][:16]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)   # warm-up
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in work]
        t1 = time.perf_counter()
        outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
        elapsed = time.perf_counter() - t1
    prompt_tokens = sum(len(p) for p, _ in work)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tp": tp, "startup_s": startup, "elapsed_s": elapsed, "requests": len(work),
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "output_tok_s": output_tokens / elapsed, "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
            "threads_per_rank": max(1, (os.cpu_count() or 1) // tp) if "OMP_NUM_THREADS" not in os.environ
            else int(os.environ["OMP_NUM_THREADS"]),
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled SmolLM2-135M)")
    ap.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = cpu_small_workload(args.num_requests)
    results = [run(args.model, int(tp), work) for tp in args.tp.split(",")]
    base = results[0]
    for r in results:
        same = sum(a == b for a, b in zip(r["token_ids"], base["token_ids"]))
        r["same_tokens_as_first"] = f"{same}/{len(work)}"
        r["speedup"] = r["output_tok_s"] / base["output_tok_s"]
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "token_ids"} for r in results], indent=1))
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {len(work)} requests "
          f"({base['prompt_tokens']} prompt + {base['output_tokens']} output tokens)")
    print(f"{'TP':>3} {'threads/rank':>12} {'startup s':>9} {'elapsed s':>9} {'out tok/s':>9} {'total tok/s':>11} "
          f"{'speedup':>7} {'same tokens':>11}")
    for r in results:
        print(f"{r['tp']:>3} {r['threads_per_rank']:>12} {r['startup_s']:>9.1f} {r['elapsed_s']:>9.2f} "
              f"{r['output_tok_s']:>9.1f} {r['total_tok_s']:>11.1f} {r['speedup']:>7.2f} {r['same_tokens_as_first']:>11}")


if __name__ == "__main__":
    main()
