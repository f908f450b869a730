"""The HTTP front-end's CPU: what `picovllm serve`'s own process (not the engine's) spends per request and per
streamed token, under `bench serve` load. Linux only (it reads /proc).

    python benchmarks/frontend_cpu.py OUT_DIR                                   # CPU: a tiny random model
    python benchmarks/frontend_cpu.py OUT_DIR --preset qwen3-0.6b --dtype bfloat16 --num-kv-blocks 16384 \\
        --runs 1:80 64:80 64:120 64:160                                         # one GPU

Each run (OUTPUT_LEN:RATE, --num-prompts requests of --input-len random tokens) reads the front-end's CPU time
(user + system, all its threads) before and after; a run of 1-token outputs gives the cost of a request alone,
the others add their tokens' (per token: (cost per request - the 1-token run's) / (output length - 1)). The
server is warmed first (planner_vs_measured.warm). Its utilization (CPU seconds per second of the run) says how
close the front-end is to being the bottleneck: it is one Python process. The engine process's CPU a request is
printed beside it (it encodes and pipes every output). --stream-interval N serves with that engine flag (a
request's output every N tokens).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from planner_vs_measured import ENGINE, bench, start, warm  # noqa: E402
from picovllm.bench.random_checkpoint import make_random_checkpoint, resolve_config, write_word_tokenizer  # noqa: E402


def children(pid: int) -> list[int]:
    return [int(c) for t in os.listdir(f"/proc/{pid}/task")
            for c in open(f"/proc/{pid}/task/{t}/children").read().split()]


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")     # utime + stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--preset", default="tiny-qwen3")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-kv-blocks", default="2048")
    p.add_argument("--runs", nargs="+", default=["1:10", "32:10"], help="OUTPUT_LEN:RATE each")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--rate-per-client", type=float, default=20.0)
    p.add_argument("--stream-interval", default="1")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = make_random_checkpoint(os.path.join(args.out, "model"), args.preset, args.dtype, 0)
    write_word_tokenizer(model, resolve_config(args.preset)["vocab_size"])
    proc, url = start(args.out, "serve", "serve", "--model", model, *ENGINE, "--dtype", args.dtype,
                      "--num-kv-blocks", args.num_kv_blocks, "--stream-interval", args.stream_interval)
    rows = []
    try:
        warm(url)
        for k, run in enumerate(args.runs):
            out_len, rate = (float(x) for x in run.split(":"))
            path = os.path.join(args.out, f"run{k}.json")
            before, engine_before = cpu_seconds(proc.pid), sum(map(cpu_seconds, children(proc.pid)))
            bench(url, rate, path, argparse.Namespace(**{**vars(args), "output_len": int(out_len)}), 100 + k)
            used = cpu_seconds(proc.pid) - before
            engine_used = sum(map(cpu_seconds, children(proc.pid))) - engine_before
            s = json.load(open(path))
            rows.append({"output_len": int(out_len), "rate": rate, "cpu_s": used, "duration_s": s["duration"],
                         "ms_per_request": used / s["completed"] * 1e3,
                         "engine_ms_per_request": engine_used / s["completed"] * 1e3,
                         "utilization": used / s["duration"],
                         "ttft_p50_ms": s["median_ttft_ms"], "ttft_p99_ms": s["p99_ttft_ms"],
                         "itl_p50_ms": s["median_itl_ms"], "itl_p99_ms": s["p99_itl_ms"]})
    finally:
        proc.terminate()
        proc.wait(60)
    alone = [r["ms_per_request"] for r in rows if r["output_len"] == 1]
    for r in rows:
        if alone and r["output_len"] > 1:
            r["ms_per_token"] = (r["ms_per_request"] - min(alone)) / (r["output_len"] - 1)
        print(f"out {r['output_len']:4d} @ {r['rate']:g}/s: front-end {r['ms_per_request']:.2f} ms a request"
              + (f" ({r['ms_per_token']:.3f} a token)" if "ms_per_token" in r else "")
              + f", {r['utilization']:.0%} of a core; engine process {r['engine_ms_per_request']:.2f} ms a request;"
              f" TTFT p50 {r['ttft_p50_ms']:.1f} p99 {r['ttft_p99_ms']:.1f} ms,"
              f" ITL p50 {r['itl_p50_ms']:.2f} p99 {r['itl_p99_ms']:.2f} ms")
    with open(os.path.join(args.out, "frontend_cpu.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
