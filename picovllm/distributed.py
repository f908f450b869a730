"""The tensor-parallel group a model's layers reduce over. Passed explicitly to every layer.

On GPUs of one host, all-reduces of a window of sizes (ONE_SHOT_*_BYTES) take a one-shot path: every
rank copies its part into a buffer the others can read over NVLink (CUDA IPC, set up once through
torch's symmetric memory), and one kernel on each rank waits for all parts and sums them. That is
one kernel and one barrier against NCCL's ring of 2(n-1) steps; larger messages stay with NCCL.
Both paths are captured by the decode CUDA graphs. PICOVLLM_ONE_SHOT_BYTES="min,max" sets the window
("0,0": NCCL only); benchmarks/tp_all_reduce.py measures the two.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None    # a torch.distributed ProcessGroup; None when size == 1
    one_shot: Any = None  # a OneShotAllReduce for small CUDA messages, or None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks; in place when NCCL (or gloo) does it, so use the result."""
        if self.size > 1:
            # fits() reads only the shape and dtype, so every rank takes the same path
            if self.one_shot is not None and self.one_shot.fits(x):
                return self.one_shot(x)
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """x from the group's first rank (rank 0 of this TP group) into x on every rank, in place."""
        if self.size > 1:
            dist.broadcast(x, group=self.group, group_src=0)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=self.group)   # one collective, CUDA-graph capturable
        return torch.cat(out.chunk(self.size), dim=-1)


SINGLE = TPGroup()


# Measured on two H200s (BENCHMARKS.md): NCCL's small all-reduce inside a CUDA graph takes ~7 us, the
# one-shot ~8; the one-shot wins only around 2 MiB (22 us against 29), a batch-256 decode step's
# activations at hidden size 4096. So it takes messages in (min, max]; "0,0" turns it off.
ONE_SHOT_MIN_BYTES, ONE_SHOT_MAX_BYTES = (int(v) for v in os.environ.get("PICOVLLM_ONE_SHOT_BYTES",
                                                                          f"{1 << 20},{4 << 20}").split(","))


class OneShotAllReduce:
    """Sum of small tensors over the ranks of a CUDA group, through a symmetric-memory buffer."""

    def __init__(self, group, device: torch.device, max_bytes: int, min_bytes: int = 0) -> None:
        from torch.distributed import _symmetric_memory as symm_mem
        self.min_bytes, self.max_bytes = min_bytes, max_bytes
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):   # needed by older torch, a no-op in newer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buf = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buf, group)    # collective: every rank maps every other's buffer

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) \
            and self.min_bytes < nbytes <= self.max_bytes and nbytes % 16 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        part = self.buf[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        part.copy_(x)      # our copy: the op's own copy-in needs x aligned as the buffer is
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(part, "sum", self.group_name, out)
        return out


def make_one_shot(group, device: torch.device, max_bytes: int = ONE_SHOT_MAX_BYTES,
                  min_bytes: int = ONE_SHOT_MIN_BYTES) -> OneShotAllReduce | None:
    """Collective over a CUDA group: a OneShotAllReduce on every rank, or None on every rank (the
    ranks agree, so they never take different paths) when torch or the GPUs cannot give one."""
    if device.type != "cuda" or max_bytes <= 0 or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
        return None
    one_shot = None
    with contextlib.suppress(Exception):   # no peer access between the GPUs, or an older torch
        one_shot = OneShotAllReduce(group, device, max_bytes, min_bytes)
    ok = torch.tensor([int(one_shot is not None)], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return one_shot if int(ok) else None
