"""The tensor-parallel group a model's layers reduce over. Passed explicitly to every layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None    # a torch.distributed ProcessGroup; None when size == 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
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
