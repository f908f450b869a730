"""A fleet's KV pull (PullTransfer: tcp, nixl, cuda_ipc) between two processes against torch.distributed's
send/recv of the same bytes (NCCL on GPUs, gloo on CPUs), in the same call: GB/s at several prompt lengths.

    python benchmarks/fleet_pull.py --tiny                             # CPU, a small layout: the same table, fast
    python benchmarks/fleet_pull.py                                    # CPU caches, Qwen3-0.6B's layout
    python benchmarks/fleet_pull.py --device cuda:0 --decode-device cuda:1 --backends send_recv nixl tcp

P publishes a prompt's blocks, D claims and pulls them; the clock runs from start_pull to the poll()
that reports the blocks written, median of --repeats, checked byte for byte after the first. The
layout defaults to Qwen3-0.6B's (28 layers, 8 KV heads of 128, bf16: 112 KiB per token; 1.75 GiB
at 16k tokens). `send_recv`: rank 0 on --device sends one contiguous buffer of the prompt's KV bytes
to rank 1 on --decode-device (dist.send/recv; timed from a barrier to rank 1's synchronize), the
ceiling the target compares nixl with (at least 70% of it at 16k tokens on two H200s). The last
lines say each backend's share of send_recv's bandwidth at the longest prompt.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import socket
import statistics
import time
import uuid

import torch
import torch.distributed as dist

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
            if args.busy_decode:             # a served D's loop: Python between polls, holding the GIL
                spin = time.perf_counter() + 0.002
                while time.perf_counter() < spin:
                    pass
            else:
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


def send_recv_side(rank: int, args, port: int, per_token: int, results: mp.Queue) -> None:
    """torch.distributed's send/recv of each prompt's KV bytes, rank 0 -> rank 1 (NCCL between GPUs)."""
    device = torch.device(args.device if rank == 0 else (args.decode_device or args.device))
    nccl = device.type == "cuda"
    if nccl:
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("nccl" if nccl else "gloo", store=store, rank=rank, world_size=2,
                            **({"device_id": device} if nccl else {}))
    times: dict[int, list[float]] = {}
    for n in args.lengths:
        buf = torch.full((n * per_token,), rank + 1, dtype=torch.uint8, device=device)
        for r in range(args.repeats + 1):            # the first is a warm-up (NCCL's connection set-up)
            dist.barrier()
            t0 = time.perf_counter()
            (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)
            if nccl:
                torch.cuda.synchronize(device)
            if r:
                times.setdefault(n, []).append(time.perf_counter() - t0)
        if rank == 1:
            assert bool((buf == 1).all()), "send_recv: rank 1 did not receive rank 0's bytes"
    if rank == 1:
        results.put({n: statistics.median(ts) for n, ts in times.items()})
    dist.destroy_process_group()


def run_backend(args, backend: str, per_token: int) -> dict[int, float]:
    """The median seconds per prompt length of one backend, each side in a process of its own."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    if backend == "send_recv":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=send_recv_side, args=(rank, args, port, per_token, results)) for rank in (0, 1)]
    else:
        handles, done = ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=prefill_side, args=(args, backend, handles, done)),
                 ctx.Process(target=decode_side, args=(args, backend, handles, done, results))]
    for proc in procs:
        proc.start()
    medians = results.get()
    for proc in procs:
        proc.join()
    return medians


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["send_recv", "tcp", "nixl"],
                   help="send_recv (torch.distributed, the reference) and PullTransfer backends (tcp, nixl, cuda_ipc)")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="prompt lengths in tokens, comma-separated (default 1024,4096,16384; --tiny 64,256,1024)")
    p.add_argument("--tiny", action="store_true", help="a small layout (2 layers, 2 KV heads of 16) and short prompts: "
                                                       "a quick CPU check of the whole run")
    p.add_argument("--device", default="cpu")
    p.add_argument("--decode-device", default=None)
    p.add_argument("--repeats", type=int, default=None, help="timed pulls per length (default 5; --tiny 3)")
    p.add_argument("--layers", type=int, default=None, help="default 28 (--tiny 2)")
    p.add_argument("--kv-heads", type=int, default=None, help="default 8 (--tiny 2)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128 (--tiny 16)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--busy-decode", action="store_true",
                   help="D's main thread runs Python between its polls (as a served engine's loop does) instead of "
                        "sleeping: the pull's threads must then wait for the GIL")
    p.add_argument("--result-json", default=None, help="also write the rows here")
    args = p.parse_args()
    defaults = dict(lengths=[64, 256, 1024], repeats=3, layers=2, kv_heads=2, head_dim=16) if args.tiny else \
        dict(lengths=[1024, 4096, 16384], repeats=5, layers=28, kv_heads=8, head_dim=128)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    unknown = set(args.backends) - {"send_recv", "tcp", "nixl", "cuda_ipc"}
    if unknown:
        raise SystemExit(f"error: --backends: unknown {sorted(unknown)} (send_recv, tcp, nixl, cuda_ipc)")
    per_token = 2 * args.layers * args.kv_heads * args.head_dim * torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    where = f"{args.device} -> {args.decode_device or args.device}"
    print(f"KV of {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} ({args.dtype}): "
          f"{per_token / 1024:g} KiB per token; {where}; median of {args.repeats}")
    medians = {backend: run_backend(args, backend, per_token) for backend in args.backends}
    rows = []
    print("| backend | tokens | MiB | ms | GB/s | of send_recv |")
    print("|---|---|---|---|---|---|")
    for backend, by_len in medians.items():
        for n, sec in sorted(by_len.items()):
            gbps = n * per_token / sec / 1e9
            ref = medians.get("send_recv", {}).get(n)
            share = f"{ref / sec:.0%}" if ref else "-"
            rows.append({"backend": backend, "tokens": n, "bytes": n * per_token, "seconds": sec, "GBps": gbps,
                         "of_send_recv": ref / sec if ref else None})
            print(f"| {backend} | {n} | {n * per_token / 2**20:.3g} | {sec * 1e3:.2f} | {gbps:.3g} | {share} |")
    longest = max(args.lengths)
    for row in rows:
        if row["tokens"] == longest and row["backend"] != "send_recv" and row["of_send_recv"] is not None:
            print(f"{row['backend']} at {longest} tokens: {row['of_send_recv']:.0%} of send_recv's bandwidth "
                  f"(target for nixl on two H200s: >= 70%)")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"device": where, "bytes_per_token": per_token, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
