"""All-reduce between the GPUs of one host: NCCL against picovllm's peer-memory paths (picovllm/distributed.py):
torch's one-shot kernel, and our one-flag kernel (kernels/all_reduce.py) up to its 1 MiB.

    python benchmarks/tp_all_reduce.py [--ranks 2]

Each rank sums a bf16 tensor of each size; both paths run inside a CUDA graph of 32 back-to-back
all-reduces, as a decode step's do, and the time per all-reduce is the graph's time / 32 (median of
20 replays). Each path's result is checked against NCCL's first.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [2 << 10, 8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20, 8 << 20]
CALLS = 32


def graph_time_us(fn, x: torch.Tensor) -> float:
    fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(CALLS):
            y = fn(y) * 0.5     # keeps the values bounded; the scale kernel is timed as well
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return statistics.median(times)


def worker(rank: int, world: int, port: int, result) -> None:
    from picovllm.distributed import make_one_shot, make_small_all_reduce
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    group = dist.group.WORLD
    one_shot = make_one_shot(group, dev, max(SIZES))
    small = make_small_all_reduce(group, dev)
    rows = []

    def nccl(x):
        dist.all_reduce(x, group=group)
        return x

    for size in SIZES:
        g = torch.Generator(device=dev).manual_seed(rank * 1000 + size)
        x = torch.randn(size // 2, generator=g, device=dev).to(torch.bfloat16)
        ref = nccl(x.clone())
        row = {"bytes": size, "nccl_us": round(graph_time_us(nccl, x.clone()), 2)}
        if one_shot is not None:
            got = one_shot(x.clone())
            row["max_abs_diff"] = float((got.float() - ref.float()).abs().max())
            row["one_shot_us"] = round(graph_time_us(one_shot, x.clone()), 2)
        if small is not None and small.fits(x):
            row["small_max_abs_diff"] = float((small(x.clone()).float() - ref.float()).abs().max())
            row["small_us"] = round(graph_time_us(small, x.clone()), 2)
        rows.append(row)
    if rank == 0:
        result.put({"one_shot": one_shot is not None, "small": small is not None, "rows": rows})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.ranks, 29513, q)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
