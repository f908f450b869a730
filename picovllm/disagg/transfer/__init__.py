"""KV-transfer backends, by name. The contract is picovllm.disagg.transfer.base.KVTransfer."""
from __future__ import annotations

import importlib
import types
from typing import TYPE_CHECKING

from picovllm.disagg.messages import KVLayout
from picovllm.disagg.transfer.base import KVTransfer, PullConfig, PullTransfer, TransferConfig, TransferDone, \
    TransferSpec

if TYPE_CHECKING:
    import torch

BACKENDS = types.MappingProxyType({
    "torch_dist": "picovllm.disagg.transfer.torch_dist:TorchDistTransfer",
    "cuda_ipc": "picovllm.disagg.transfer.cuda_ipc:CudaIpcTransfer",
})


# Many to many (PullTransfer): a fleet behind `picovllm router`.
PULL_BACKENDS = types.MappingProxyType({
    "tcp": "picovllm.disagg.transfer.host_tcp:HostTcpTransfer",
    "nixl": "picovllm.disagg.transfer.nixl:NixlTransfer",      # needs nixl-cu12 / nixl-cu13 installed
    "cuda_ipc": "picovllm.disagg.transfer.cuda_ipc_pull:CudaIpcPullTransfer",   # one host (CPU: shared memory)
})


def make_pull_transfer(role: str, cache: torch.Tensor, layout: KVLayout, config: PullConfig) -> PullTransfer:
    if config.backend not in PULL_BACKENDS:
        raise ValueError(f"PullConfig.backend must be one of {sorted(PULL_BACKENDS)}, got {config.backend!r}")
    module, cls = PULL_BACKENDS[config.backend].split(":")
    return getattr(importlib.import_module(module), cls)(role, cache, layout, config)


def make_transfer(role: str, cache: torch.Tensor, layout: KVLayout, config: TransferConfig,
                  kv_io=None) -> KVTransfer:
    if config.backend not in BACKENDS:
        raise ValueError(f"TransferConfig.backend must be one of {sorted(BACKENDS)}, got {config.backend!r}")
    module, cls = BACKENDS[config.backend].split(":")
    return getattr(importlib.import_module(module), cls)(role, cache, layout, config, kv_io)


__all__ = ["BACKENDS", "PULL_BACKENDS", "KVTransfer", "PullConfig", "PullTransfer", "TransferConfig", "TransferDone",
           "TransferSpec", "make_pull_transfer", "make_transfer"]
