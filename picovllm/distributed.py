"""The tensor-parallel group a model's layers reduce over. Passed explicitly to every layer.

On GPUs of one host, all-reduces skip NCCL's ring where a peer-memory path is faster (buffers every
rank maps over NVLink through CUDA IPC, set up once with torch's symmetric memory):
- small messages (up to PICOVLLM_SMALL_AR_BYTES, default 1 MiB): our Triton kernel
  (kernels/all_reduce.py) pushes each rank's part into the peers' buffers and exchanges one flag;
- a middle window (PICOVLLM_ONE_SHOT_BYTES="min,max", default 1-4 MiB): torch's one-shot kernel,
  which reads the peers' parts between two barriers;
- the rest: NCCL. "0" / "0,0" turn a peer-memory path off.
All paths are captured by the decode CUDA graphs; benchmarks/tp_all_reduce.py measures them.
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
    one_shot: Any = None  # a OneShotAllReduce for mid-sized CUDA messages, or None
    small: Any = None     # a OneFlagAllReduce for small CUDA messages, or None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks; in place when NCCL (or gloo) does it, so use the result."""
        if self.size > 1:
            # fits() reads only the shape and dtype, so every rank takes the same path
            if self.small is not None and self.small.fits(x):
                return self.small(x)
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
        _all_gather(out, x, group=self.group)   # one collective, CUDA-graph capturable
        return torch.cat(out.chunk(self.size), dim=-1)


SINGLE = TPGroup()
# torch 2.13 renamed all_gather_into_tensor (deprecated there, with a warning a call); 2.11 has the old name only
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# Measured on two H200s (BENCHMARKS.md): NCCL's small all-reduce inside a CUDA graph takes ~7 us, torch's
# one-shot ~8; the one-shot wins only around 2 MiB (22 us against 29), a batch-256 decode step's
# activations at hidden size 4096. So it takes messages in (min, max]; "0,0" turns it off.
ONE_SHOT_MIN_BYTES, ONE_SHOT_MAX_BYTES = (int(v) for v in os.environ.get("PICOVLLM_ONE_SHOT_BYTES",
                                                                          f"{1 << 20},{4 << 20}").split(","))
SMALL_AR_MAX_BYTES = int(os.environ.get("PICOVLLM_SMALL_AR_BYTES", str(1 << 20)))


def _symmetric_buffer(group, nbytes: int, device: torch.device):
    """A buffer of nbytes on this rank that every rank of the group maps; collective. (buffer, handle)."""
    from torch.distributed import _symmetric_memory as symm_mem
    if hasattr(symm_mem, "enable_symm_mem_for_group"):   # needed by older torch, a no-op in newer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group.group_name)
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    return buf, symm_mem.rendezvous(buf, group)


class OneFlagAllReduce:
    """Sum of small tensors over the ranks of a CUDA group: one Triton kernel, one flag exchange
    (kernels/all_reduce.py says why that is safe)."""

    def __init__(self, group, device: torch.device, max_bytes: int) -> None:
        from picovllm.kernels import all_reduce as kernel
        self.max_bytes = min(max_bytes, kernel.MAX_CHUNKS * kernel.CHUNK_BYTES)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.world > 8:
            raise ValueError("OneFlagAllReduce: at most 8 ranks")
        self.buf, handle = _symmetric_buffer(group, kernel.FLAG_BYTES + 2 * self.world * self.max_bytes, device)
        self.buf.zero_()                      # flags start at 0; every rank's before any rank pushes
        self.bufs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.epochs = torch.zeros(kernel.MAX_CHUNKS, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) \
            and 0 < nbytes <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from picovllm.kernels.all_reduce import one_flag_all_reduce
        x = x.contiguous()
        out = torch.empty_like(x)
        one_flag_all_reduce(x, out, self.bufs, self.epochs, self.max_bytes, self.rank, self.world)
        return out


class OneShotAllReduce:
    """Sum of small tensors over the ranks of a CUDA group, through a symmetric-memory buffer."""

    def __init__(self, group, device: torch.device, max_bytes: int, min_bytes: int = 0) -> None:
        self.min_bytes, self.max_bytes = min_bytes, max_bytes
        self.group_name = group.group_name
        self.buf, _ = _symmetric_buffer(group, max_bytes, device)

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        # torch's kernel has no float16 (NotImplementedError, seen on torch 2.11): NCCL takes those
        return x.is_cuda and x.dtype in (torch.bfloat16, torch.float32) \
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
    return _on_every_rank(one_shot, group, device)


def make_small_all_reduce(group, device: torch.device,
                          max_bytes: int = SMALL_AR_MAX_BYTES) -> OneFlagAllReduce | None:
    """Collective over a CUDA group: a OneFlagAllReduce on every rank, or None on every rank."""
    if device.type != "cuda" or max_bytes <= 0:
        return None
    small = None
    try:
        small = OneFlagAllReduce(group, device, max_bytes)
    except Exception as e:   # no peer access between the GPUs, no triton, an older torch
        warnings.warn(f"small all-reduce kernel unavailable, NCCL takes its messages: {e}")
    return _on_every_rank(small, group, device)


def _on_every_rank(path, group, device: torch.device):
    """Collective: path where every rank of the group made one, else None on every rank (so the ranks never
    take different paths for the same message)."""
    ok = torch.tensor([int(path is not None)], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return path if int(ok) else None
