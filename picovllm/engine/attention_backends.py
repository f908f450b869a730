"""Attention backends by name: EngineConfig.attention_backend picks one, "auto" the first available
of its device's preference list. A new backend is one entry here (and its module)."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable

import torch

from picovllm.config import EngineConfig
from picovllm.layers.attention import AttentionBackend


@dataclass(frozen=True)
class BackendEntry:
    make: Callable[[], AttentionBackend]
    available: Callable[[EngineConfig, torch.nn.Module], bool]   # can it run this model on this config's device?
    needs: str                                                    # what `available` checks, for the error


def _make_torch() -> AttentionBackend:
    from picovllm.layers.attention import TorchAttentionBackend
    return TorchAttentionBackend()


def _make_triton() -> AttentionBackend:
    from picovllm.kernels.backend import TritonAttentionBackend   # imports triton: only when chosen
    return TritonAttentionBackend()


def _make_cpu() -> AttentionBackend:
    from picovllm.kernels.cpu.decode_attention import CpuAttentionBackend
    return CpuAttentionBackend()


def _triton_available(config: EngineConfig, model: torch.nn.Module) -> bool:
    # a CUDA device, or under TRITON_INTERPRET=1 the CPU (the kernel tests run them so)
    on_device = torch.device(config.device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return on_device and importlib.util.find_spec("triton") is not None


def _cpu_available(config: EngineConfig, model: torch.nn.Module) -> bool:
    # fp8 KV: the C kernels (and the decode stack built on them) read float32 caches only, so "auto" takes torch
    if torch.device(config.device).type != "cpu" or config.torch_dtype != torch.float32 \
            or config.kv_cache_dtype != "auto":
        return False
    from picovllm.kernels.cpu import decode_attention as cpu_kernel
    attn = model.attention_layers()[0]
    return cpu_kernel.available(attn.num_heads, attn.num_kv_heads, attn.head_dim, config.block_size)


ATTENTION_BACKENDS = MappingProxyType({
    "torch": BackendEntry(_make_torch, lambda config, model: True, "nothing"),
    "triton": BackendEntry(_make_triton, _triton_available,
                           "triton installed and a CUDA device (or TRITON_INTERPRET=1)"),
    "cpu": BackendEntry(_make_cpu, _cpu_available, "float32 on the CPU, kv_cache_dtype 'auto' and a C compiler"),
})
AUTO_ORDER = MappingProxyType({"cuda": ("triton", "torch"), "cpu": ("cpu", "torch")})


def make_attention_backend(config: EngineConfig, model: torch.nn.Module) -> AttentionBackend:
    """The backend config.attention_backend names, or for "auto" the device's first available one.
    A named backend that cannot run raises ValueError naming the field."""
    name = config.attention_backend
    if name == "auto":
        order = AUTO_ORDER.get(torch.device(config.device).type, ("torch",))
        name = next(n for n in order if ATTENTION_BACKENDS[n].available(config, model))
    entry = ATTENTION_BACKENDS[name]
    if not entry.available(config, model):
        raise ValueError(f"EngineConfig.attention_backend {name!r} needs {entry.needs}")
    return entry.make()
