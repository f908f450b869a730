"""Where a steady decode step's time goes on the GPU, batch by batch: wall time per engine.step (overlapped), the CUDA
graph's replay alone, the kernels of 10 steps (torch profiler: count, total, the top 22 in a table) and the host's
Python (cProfile of 100 steps); tables go to --out/prof_b<batch>_<kv dtype>.txt. GPU only.

    python benchmarks/step_profile.py [--batch 1 64 256] [--ctx 512] [--model random:qwen3-30b-a3b] [--kv-cache-dtype fp8]
"""
import argparse, cProfile, io, json, os, pstats, random, sys, time
import torch
sys.path.insert(0, "benchmarks")
from random_qwen3 import build
from picovllm import LLM, SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
ap.add_argument("--ctx", type=int, default=512)
ap.add_argument("--model", default=None)
ap.add_argument("--kv-cache-dtype", default="auto")
ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
ap.add_argument("--enforce-eager", action="store_true",
                help="no CUDA graphs: the profile then maps kernels to ops and their input shapes (a second table)")
a = ap.parse_args()
model = a.model or build("/tmp/qwen3-0.6b-random")
llm = LLM(model, max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384, gpu_memory_utilization=0.85,
          kv_cache_dtype=a.kv_cache_dtype, enforce_eager=a.enforce_eager)
eng = llm.engine
runner = eng.executor.runner
rng = random.Random(0)
for B in a.batch:
    ids = [eng.add_request([rng.randrange(10000) for _ in range(a.ctx)],
                           SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)) for _ in range(B)]
    while any(not eng.requests[r].output_token_ids for r in ids):
        eng.step()
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter(); n = 100
    for _ in range(n):
        eng.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / n * 1e3
    g = runner.cuda_graphs
    replay = float("nan")
    if g is not None:
        bs = next(s for s in g.sizes if s >= B)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(50):
            g.graphs[bs].replay()
        e1.record(); torch.cuda.synchronize()
        replay = e0.elapsed_time(e1) / 50
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=a.enforce_eager) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ktot = sum(e.device_time for e in kern) / 10 / 1e3
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=22)
    if a.enforce_eager:
        table += "\n\n" + prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=30)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(100):
        eng.step()
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    hs = io.StringIO(); pstats.Stats(pr, stream=hs).sort_stats("cumtime").print_stats(40)
    print(json.dumps({"batch": B, "ctx": a.ctx, "wall_ms_per_step": round(wall, 3), "graph_replay_ms": round(replay, 3),
                      "kernels_per_step": len(kern) / 10, "kernel_ms_per_step": round(ktot, 3)}), flush=True)
    with open(f"{a.out}/prof_b{B}_{a.kv_cache_dtype}{'_eager' if a.enforce_eager else ''}.txt", "w") as f:
        f.write(table + "\n\n" + s.getvalue() + "\n\n" + hs.getvalue())
    for r in ids:
        eng.abort(r)
    for _ in range(3):
        eng.step()
