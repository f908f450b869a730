"""NCCL point-to-point bandwidth between two GPUs of this host (the ceiling for torch_dist's KV transfer).

    python benchmarks/nccl_bandwidth.py      # rank 0 on cuda:0 sends to rank 1 on cuda:1; GB/s one way
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, sizes_mib: list[int], port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    out = {}
    for mib in sizes_mib:
        buf = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
        for i in range(13):
            if i == 3:
                torch.cuda.synchronize()
                dist.barrier()
                t = time.perf_counter()
            (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)
        torch.cuda.synchronize()
        out[f"{mib} MiB"] = round(10 * buf.numel() / (time.perf_counter() - t) / 1e9, 1)
    if rank == 1:
        print(json.dumps({"nccl_send_recv_GBps": out}))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=([16, 64, 256, 1024], 29555 + int(sys.argv[1]) if len(sys.argv) > 1 else 29555), nprocs=2)
