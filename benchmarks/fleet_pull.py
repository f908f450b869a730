"""A fleet's KV pull (PullTransfer: tcp, nixl) between two processes: GB/s at several prompt lengths.

    python benchmarks/fleet_pull.py                                    # CPU caches, Qwen3-0.6B's layout
    python benchmarks/fleet_pull.py --device cuda:0 --decode-device cuda:1 --backends nixl tcp

P publishes a prompt's blocks, D claims and pulls them; the clock runs from start_pull to the poll()
that reports the blocks written, median of --repeats, checked byte for byte after the first. The
layout defaults to Qwen3-0.6B's (28 layers, 8 KV heads of 128, bf16: 112 KiB per token). NCCL's
send/recv on the same GPUs, for the target's comparison: benchmarks/nccl_bandwidth.py.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
import uuid

import torch

SECRET = b"fleet-pull-benchmark-secret-0123"


def layout_and_cache(args, device: str, num_blocks: int):
    from picovllm.disagg.messages import KVLayout
    dtype = getattr(torch, args.dtype)
    layout = KVLayout(args.layers, args.kv_heads, args.head_dim, args.block_size, num_blocks,
                      str(dtype).removeprefix("torch."), args.kv_heads)
    cache = torch.zeros(layout.block_shape(num_blocks), dtype=dtype, device=device)
    return layout, cache


def fill_pattern(cache: torch.Tensor) -> None:
    """Block b of plane (layer, k/v) holds the value (plane * 7 + b) % 61, exact in every dtype."""
    planes, n = cache.shape[0] * 2, cache.shape[2]
    values = (torch.arange(planes)[:, None] * 7 + torch.arange(n)[None, :]) % 61
    cache.copy_(values.view(cache.shape[0], 2, n, 1, 1, 1).expand(cache.shape).to(cache.dtype))


def config(backend: str):
    from picovllm.disagg.auth import FleetSecret
    from picovllm.disagg.transfer import PullConfig
    return PullConfig(FleetSecret(SECRET), uuid.uuid4().hex[:12], backend=backend, timeout_s=600.0)


def prefill_side(args, backend: str, handles: mp.Queue, done: mp.Queue) -> None:
    from picovllm.disagg.messages import to_wire
    from picovllm.disagg.transfer import make_pull_transfer
    num_blocks = -(-max(args.lengths) // args.block_size)
    layout, cache = layout_and_cache(args, args.device, num_blocks)
    fill_pattern(cache)
    t = make_pull_transfer("p", cache, layout, config(backend))
    for n in args.lengths:
        blocks = list(range(-(-n // args.block_size)))
        for r in range(args.repeats):
            handle = t.publish(f"{n}-{r}", blocks, n)
            handles.put(to_wire(handle))
            while not t.poll():
                time.sleep(0.0005)
    handles.put(None)
    done.get()
    t.close()


def decode_side(args, backend: str, handles: mp.Queue, done: mp.Queue, results: mp.Queue) -> None:
    from picovllm.disagg.messages import KVHandle, from_wire
    from picovllm.disagg.transfer import make_pull_transfer
    num_blocks = -(-max(args.lengths) // args.block_size)
    layout, cache = layout_and_cache(args, args.decode_device or args.device, num_blocks)
    t = make_pull_transfer("d", cache, layout, config(backend))
    times: dict[int, list[float]] = {}
    while (wire := handles.get()) is not None:
        handle = from_wire(wire, KVHandle)
        t.claim(handle)
        t0 = time.perf_counter()
        t.start_pull(handle, handle.block_ids)
        while not (finished := t.poll()):
            time.sleep(0.0001)
        if cache.is_cuda:
            torch.cuda.synchronize(cache.device)
        times.setdefault(handle.num_tokens, []).append(time.perf_counter() - t0)
        assert finished[0].error is None, finished[0].error
        if len(times[handle.num_tokens]) == 1:       # the bytes are P's
            want = torch.empty_like(cache[:, :, :len(handle.block_ids)])
            fill_pattern(want)
            assert torch.equal(cache[:, :, handle.block_ids], want), "pulled blocks differ from P's"
            cache.zero_()
        t.release(handle)
    results.put({n: statistics.median(ts) for n, ts in times.items()})
    done.put(True)
    t.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["tcp", "nixl"])
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 16384])
    p.add_argument("--device", default="cpu")
    p.add_argument("--decode-device", default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    per_token = 2 * args.layers * args.kv_heads * args.head_dim * torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    ctx = mp.get_context("spawn")
    for backend in args.backends:
        handles, done, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=prefill_side, args=(args, backend, handles, done)),
                 ctx.Process(target=decode_side, args=(args, backend, handles, done, results))]
        for proc in procs:
            proc.start()
        medians = results.get()
        for proc in procs:
            proc.join()
        for n, s in sorted(medians.items()):
            print(f"{backend:5s} {n:6d} tokens  {n * per_token / 2**20:8.1f} MiB  {s * 1e3:8.2f} ms  "
                  f"{n * per_token / s / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
