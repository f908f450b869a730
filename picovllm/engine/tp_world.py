"""The process groups of one tensor-parallel engine, and the channel rank 0 drives its workers through.

The ranks of an engine share two explicit subgroups of the torch.distributed world:
- a gloo *control* group for messages and small reductions (CPU tensors, whatever the device);
- the *TP* group the model's layers all-reduce and all-gather over: NCCL on CUDA, gloo on CPU.
Being subgroups, not the default world, lets one world hold several engines (a P and a D group).
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from picovllm.distributed import TPGroup, make_one_shot, make_small_all_reduce
from picovllm.engine.messages import Message, decode, encode
from picovllm.engine.step_codec import ReceivedTables, SentTables

# Workers wait in a control-group recv between requests for as long as the engine is idle, so this
# must not fire; a dead peer is noticed by its closed connection (gloo) or the liveness watchdog.
CONTROL_TIMEOUT = timedelta(days=3650)
# A rank alive but stuck inside one step's collective (a dead one is noticed at once).
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# Joining the world: every rank has started and reached init_process_group.
WORLD_TIMEOUT = timedelta(minutes=2)


class ControlChannel:
    """Rank `src` sends each message to all ranks as two gloo broadcasts: its length, then its bytes. Step messages
    carry their block tables as deltas against the step before (engine/step_codec.py): the sender keeps the tables
    it sent, each receiver those it received; the channel delivers every message, in order, or the engine ends."""

    def __init__(self, group: dist.ProcessGroup, src: int) -> None:
        self.group, self.src = group, src
        self.sent_tables = SentTables()           # used by rank src
        self.received_tables = ReceivedTables()   # used by the others

    def send(self, msg: Message) -> None:
        data = encode(msg, self.sent_tables)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=self.src, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=self.src, group=self.group)

    def recv(self) -> Message:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=self.src, group=self.group)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, src=self.src, group=self.group)
        return decode(data.numpy().tobytes(), self.received_tables)

    def min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t)


def new_control_group(ranks: list[int]) -> dist.ProcessGroup:
    return dist.new_group(ranks, backend="gloo", timeout=CONTROL_TIMEOUT)


def new_tp_group(ranks: list[int], device: torch.device) -> TPGroup:
    """Every rank of the world calls this in the same order (torch.distributed.new_group's rule)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = dist.new_group(ranks, backend=backend, timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(rank=ranks.index(dist.get_rank()), size=len(ranks), group=group,
                   one_shot=make_one_shot(group, device), small=make_small_all_reduce(group, device))


def rank_device(device: str, local_rank: int) -> torch.device:
    """CUDA ranks each take the GPU of their local rank; CPU ranks share the CPU."""
    if str(device).startswith("cuda"):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def launched_externally() -> bool:
    """True under torchrun (or when the caller set up torch.distributed itself): ranks exist already."""
    return dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1


def join_external_world() -> tuple[int, bool]:
    """Join the world torchrun describes in the environment, unless joined already.

    Returns (local rank, whether we initialised the world and so must destroy it)."""
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", init_method="env://", timeout=WORLD_TIMEOUT)
    local = os.environ.get("LOCAL_RANK")
    local_rank = int(local) if local is not None else dist.get_rank() % max(1, torch.cuda.device_count())
    return local_rank, owns
