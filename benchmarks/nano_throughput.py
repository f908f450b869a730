"""The nano-vllm benchmark workload through LLM.generate, plus latency, prefill and a step profile.

    python benchmarks/nano_throughput.py throughput [--model PATH] [--enforce-eager] [--no-overlap] [--timeline]
                                                    [--kv-cache-dtype fp8]   # any mode: the KV cache in fp8
    python benchmarks/nano_throughput.py disagg      # the same workload through 1P1D on one GPU (cuda_ipc)
    python benchmarks/nano_throughput.py latency     # batch 1, 512-token prompt, 256 outputs: ms/token
    python benchmarks/nano_throughput.py prefill     # one 8k-token prompt: prefill tokens/s
    python benchmarks/nano_throughput.py profile     # where a batch-256 decode step's time goes

Workload (nano-vllm's bench.py): 256 requests, random.seed(0), prompts of randint(100, 1024)
random token ids in [0, 10000], then max_tokens randint(100, 1024) each, ignore_eos, temperature 0.6.
Without --model it builds a Qwen3-0.6B-shaped checkpoint of random bf16 weights (--shape 8b: Qwen3-8B's).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from picovllm import LLM, SamplingParams  # noqa: E402
from random_qwen3 import build  # noqa: E402


def workload(n: int = 256, max_in: int = 1024, max_out: int = 1024, temperature: float = 0.6):
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_in))] for _ in range(n)]
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=random.randint(100, max_out))
              for _ in range(n)]
    return prompts, params


def make_llm(args, **over) -> LLM:
    kw = dict(max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager,
              enable_prefix_caching=not args.no_prefix_caching,
              gpu_memory_utilization=0.9, async_scheduling=not args.no_overlap,
              tensor_parallel_size=args.tp, warmup=False if args.no_warmup else None,
              prefill_cuda_graphs=args.prefill_cuda_graphs, kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization, block_size=args.block_size)
    kw.update(over)
    return LLM(args.model, **kw)


class StepTimeline:
    """Wraps the engine's step and the executor's execute (launch, when overlapped): wall and GPU time
    of every step. Overlapped, a step's start event is reached on the GPU when the previous step's
    work ends, so the GPU time summed over steps is the time the GPU was busy; the rest of the wall
    time is host work the GPU waited for."""

    def __init__(self, eng) -> None:
        import torch
        self.rows: list[dict] = []
        self.t0 = time.perf_counter()
        name = "launch" if eng.overlap else "execute"
        real_step, real_execute = eng.step, getattr(eng.executor, name)

        def execute(step, *a):
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            t = time.perf_counter()
            res = real_execute(step, *a)
            self.cur.update(execute_ms=(time.perf_counter() - t) * 1e3, batch=len(step.seq_lens),
                            tokens=len(step.input_ids), decode_only=step.num_decodes == len(step.seq_lens),
                            ctx=sum(step.seq_lens), events=(ev0, ev1))
            ev1.record()
            return res

        def step(*a, **kw):
            self.cur = {}
            t = time.perf_counter()
            out = real_step(*a, **kw)
            if self.cur:
                self.cur["step_ms"] = (time.perf_counter() - t) * 1e3
                self.rows.append(self.cur)
            return out

        eng.step = step
        setattr(eng.executor, name, execute)

    def summary(self) -> dict:
        wall = time.perf_counter() - self.t0
        for r in self.rows:
            ev0, ev1 = r.pop("events")
            ev1.synchronize()
            r["gpu_ms"] = ev0.elapsed_time(ev1)
        out = {}
        groups = {"prefill": [r for r in self.rows if not r["decode_only"]]}
        for lo, hi in [(1, 32), (33, 96), (97, 192), (193, 256)]:
            groups[f"decode b{lo}-{hi}"] = [r for r in self.rows if r["decode_only"] and lo <= r["batch"] <= hi]
        for name, rows in groups.items():
            if not rows:
                continue
            tot = lambda k: sum(r[k] for r in rows)  # noqa: E731
            out[name] = {"steps": len(rows), "step_s": round(tot("step_ms") / 1e3, 3),
                         "gpu_s": round(tot("gpu_ms") / 1e3, 3), "execute_s": round(tot("execute_ms") / 1e3, 3),
                         "kv_TBps": round(tot("ctx") * KV_BYTES_PER_TOKEN / (tot("gpu_ms") / 1e3) / 1e12, 2)}
        gpu = sum(r["gpu_ms"] for r in self.rows) / 1e3
        out["total"] = {"wall_s": round(wall, 3), "gpu_busy_s": round(gpu, 3), "gpu_idle_s": round(wall - gpu, 3)}
        slow = sorted(self.rows, key=lambda r: -r["step_ms"])[:5]
        out["slowest"] = [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()} for r in slow]
        return out


KV_BYTES_PER_TOKEN = 28 * 2 * 8 * 128 * 2     # Qwen3-0.6B, bf16 (the timeline's kv_TBps)
SHAPES = {"0.6b": {},   # random_qwen3's default
          "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=False)}


def throughput(args) -> dict:
    llm = make_llm(args)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16), use_tqdm=False)   # warm-up
    prompts, params = workload(args.num_seqs, temperature=args.temperature)
    runs = []
    for i in range(args.repeat):                  # a later run in the process pays no Triton compilation
        timeline = StepTimeline(llm.engine) if args.timeline and i == args.repeat - 1 else None
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        assert n_out == sum(p.max_tokens for p in params)
        runs.append(round(n_out / dt, 1))
    res = {"output_tokens": n_out, "input_tokens": sum(map(len, prompts)), "seconds": round(dt, 3),
           "output_tok_per_s": runs[-1], "runs_tok_per_s": runs, "enforce_eager": args.enforce_eager,
           "temperature": args.temperature, "warmup_s": llm.engine.runner.warmup_seconds}
    if timeline:
        res["timeline"] = timeline.summary()
    return res


def disagg(args) -> dict:
    """The throughput workload through 1P1D on this one GPU: a P and a D engine in processes of their own,
    KV handed over through CUDA IPC (D reads P's blocks); the clock covers DisaggLLM.generate only."""
    from picovllm.disagg.driver import DisaggLLM

    common = dict(max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384,
                  enforce_eager=args.enforce_eager, async_scheduling=not args.no_overlap,
                  enable_prefix_caching=not args.no_prefix_caching, kv_cache_dtype=args.kv_cache_dtype)
    # the two engines size their KV caches one after the other on the one GPU: P a third of it, D the rest
    with DisaggLLM(args.model, backend="cuda_ipc", prefill_device="cuda:0", decode_device="cuda:0",
                   prefill={"gpu_memory_utilization": 0.3}, decode={"gpu_memory_utilization": 0.9}, **common) as llm:
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16))      # warm-up
        prompts, params = workload(args.num_seqs, temperature=args.temperature)
        runs = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t
            failed = [o.error for o in outs if o.error]
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            assert not failed and n_out == sum(p.max_tokens for p in params), failed[:3]
            runs.append(round(n_out / dt, 1))
    return {"output_tokens": n_out, "seconds": round(dt, 3), "output_tok_per_s": runs[-1], "runs_tok_per_s": runs,
            "overlap": not args.no_overlap, "backend": "cuda_ipc"}


def latency(args) -> dict:
    llm = make_llm(args, max_num_seqs=8)
    prompt = [random.Random(1).randint(0, 10000) for _ in range(512)]
    per_tok = []
    for i in range(3):
        timeline = StepTimeline(llm.engine) if args.timeline and i == 2 else None
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=256, ignore_eos=True), use_tqdm=False)[0]
        t = out.metrics.token_times
        per_tok.append((t[-1] - t[0]) / (len(t) - 1) * 1e3)
    res = {"decode_ms_per_token": [round(x, 3) for x in per_tok], "best": round(min(per_tok), 3)}
    if timeline:
        res["timeline"] = timeline.summary()
    return res


def prefill(args) -> dict:
    llm = make_llm(args, max_model_len=8192 + 16, max_num_seqs=8)
    prompt = [random.Random(2).randint(0, 10000) for _ in range(8192)]
    times = []
    for i in range(4):
        p = [i] + prompt[1:]                    # a different first token: no prefix-cache hits
        t = time.perf_counter()
        llm.generate([p], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        times.append(time.perf_counter() - t)
    best = min(times[1:])
    return {"seconds": [round(x, 4) for x in times], "prefill_tok_per_s": round(8192 / best, 0)}


def profile(args) -> dict:
    import torch
    llm = make_llm(args, async_scheduling=False)     # the step taken apart: schedule, execute, postprocess
    eng = llm.engine
    prompts, params = workload(args.num_seqs, temperature=args.temperature)
    for p, sp in zip(prompts, params):
        eng.add_request(p, sp)
    while any(not r.output_token_ids for r in eng.requests.values()):
        eng.step()                              # until every request decodes
    rows = []
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(30):
        t0 = time.perf_counter()
        sched = eng.scheduler.schedule()
        step = eng.executor.prepare(sched, eng.eos_token_ids)
        t1 = time.perf_counter()
        ev0.record()
        result = eng.executor.execute(step)
        ev1.record()
        t2 = time.perf_counter()
        eng.postprocess(sched, result)
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        rows.append(dict(batch=len(step.seq_lens), ctx=sum(step.seq_lens) / len(step.seq_lens),
                         schedule_prepare_ms=(t1 - t0) * 1e3, execute_ms=(t2 - t1) * 1e3,
                         gpu_ms=ev0.elapsed_time(ev1), postprocess_ms=(t3 - t2) * 1e3))
    from torch.profiler import ProfilerActivity, profile as tprofile
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    eng.abort_all()
    med = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
    return {"median_step": med, "kernel_table": table}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["throughput", "disagg", "latency", "prefill", "profile"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1, help="throughput/disagg: runs of the workload in one process")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="a repeated run of the same prompts otherwise hits the prefix cache")
    ap.add_argument("--timeline", action="store_true", help="time every step (wall and GPU)")
    ap.add_argument("--no-overlap", action="store_true", help="async_scheduling=False: host work between steps")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (GPUs)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384,
                    help="the step budget (16384: nano-vllm's; 2048: the engine's default)")
    ap.add_argument("--no-warmup", action="store_true", help="warmup=False: no start-up compilation steps")
    ap.add_argument("--prefill-cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="prefill_cuda_graphs (default: the engine's, on for one GPU)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                    help="the KV cache's dtype: auto (the model's, bf16) or fp8 (e4m3, calibrated scales)")
    ap.add_argument("--quantization", default="auto", choices=["auto", "fp8"],
                    help="fp8: linear weights in float8 e4m3 (layers/fp8_weights.py)")
    ap.add_argument("--block-size", type=int, default=16, help="the KV cache's tokens a block (A/B runs)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b", help="the random checkpoint's shape")
    ap.add_argument("--split-target", type=int, help="decode attention's SPLIT_TARGET_PROGRAMS (A/B runs)")
    args = ap.parse_args()
    if args.split_target:
        import picovllm.kernels.decode_attention as da
        da.SPLIT_TARGET_PROGRAMS = args.split_target
    args.model = args.model or build(f"/tmp/qwen3-{args.shape}-random", **SHAPES[args.shape])
    res = globals()[args.mode](args)
    res["kv_cache_dtype"] = args.kv_cache_dtype
    table = res.pop("kernel_table", None)
    if table:
        print(table)
    print(json.dumps({args.mode: res}, indent=1))


if __name__ == "__main__":
    main()
