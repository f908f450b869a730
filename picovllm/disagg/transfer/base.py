"""The KV-transfer contract. A backend is one module implementing KVTransfer; read this class first.

Division of labour: the engines (picovllm.disagg.prefill / decode) run the handover protocol over
their control channel (Offer, Accept, Ack, Release, Cancel, EndOfStream) and own every block; a
backend only moves the bytes of blocks it is told about, between the two caches, and says when
it is done. Each engine holds one backend object per P<->D link; all its methods are called
from that engine's step thread.

A transfer, in order:
    P: Offer(request, src_block_ids) ------------------------------------------> D
    D: allocates dst blocks, start_recv(spec), then Accept(tag, dst_block_ids) ---> P
    P: start_send(spec)                 (data moves: P pushes, or D pulls in start_recv)
    D: poll() -> TransferDone(ok)       D writes num_computed_tokens and starts decoding
    D: Ack ------------------------------------------------------------------------> P
    P: frees src blocks                 (never earlier: a pulling backend reads them until Ack)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from picovllm.disagg.hosts import check_host
from picovllm.disagg.messages import Hello, KVLayout


@dataclass(frozen=True)
class TransferSpec:
    request_id: str
    tag: int                       # unique per transfer on a link, chosen by D
    src_block_ids: list[int]       # in P's cache
    dst_block_ids: list[int]       # in D's cache, same length and order


@dataclass(frozen=True)
class TransferDone:
    request_id: str
    error: str | None = None       # None: done (D: blocks written; P: P's part finished)


@dataclass(frozen=True)
class TransferConfig:
    backend: str = "torch_dist"    # a key of picovllm.disagg.transfer.BACKENDS
    async_transfer: bool = True    # False: the engine waits in poll(wait_for=...) after each start
    timeout_s: float = 30.0        # a transfer not done this long after its start fails
    connect_timeout_s: float = 60.0
    lease_s: float = 10.0          # a peer silent this long (heartbeats included) counts as dead
    host: str = "127.0.0.1"        # the interface this side binds (torch_dist: P's rendezvous, gloo)
    advertise_host: str | None = None   # where the peer reaches this side (default host); see disagg/hosts.py
    dist_backend: str = "auto"     # torch_dist: "gloo" | "nccl" | "auto" (NCCL between distinct GPUs)

    def __post_init__(self) -> None:
        if self.dist_backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"TransferConfig.dist_backend must be 'auto', 'gloo' or 'nccl', "
                             f"got {self.dist_backend!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"TransferConfig.timeout_s must be > 0, got {self.timeout_s!r}")
        if self.lease_s <= 0:
            raise ValueError(f"TransferConfig.lease_s must be > 0, got {self.lease_s!r}")
        if self.connect_timeout_s <= 0:
            raise ValueError(f"TransferConfig.connect_timeout_s must be > 0, got {self.connect_timeout_s!r}")
        check_host("TransferConfig.host", self.host)
        if self.advertise_host is not None:
            check_host("TransferConfig.advertise_host", self.advertise_host)

    @property
    def reach(self) -> str:
        return self.advertise_host or self.host


class KVTransfer(ABC):
    """Moves blocks of one engine's KV cache into another's. One object per engine per link.

    `cache` is the engine's whole KV cache ([num_layers, 2, num_blocks, block_size, kv_heads,
    head_dim], ModelRunner.kv_cache); `role` is "p" or "d". Under tensor parallelism `cache` is
    rank 0's shard, `layout` is full-head and `kv_io` (picovllm.engine.tp_kv.FullHeadKV) reads and
    writes full-head blocks across the ranks: a backend that supports it (torch_dist) moves those;
    one that maps the peer's cache (cuda_ipc) is refused at the handshake.
    """

    name: ClassVar[str]

    def __init__(self, role: str, cache: torch.Tensor, layout: KVLayout, config: TransferConfig,
                 kv_io=None) -> None:
        if role not in ("p", "d"):
            raise ValueError(f"role must be 'p' or 'd', got {role!r}")
        self.role, self.cache, self.layout, self.config, self.kv_io = role, cache, layout, config, kv_io

    def local_info(self) -> dict:
        """Backend fields for this side's Hello (JSON-safe). Called once, before the Hello is sent.

        May set things up (P: export a cache handle, open a rendezvous port); must not block.
        """
        return {}

    @abstractmethod
    def connect(self, peer: Hello) -> None:
        """Finish the link once the peer's Hello is in. Called once by each side, before any transfer.

        May block, up to config.connect_timeout_s (a process-group rendezvous, mapping the
        peer's cache); raises ConnectionError when it cannot connect.
        """

    @abstractmethod
    def start_send(self, spec: TransferSpec) -> None:
        """P, on D's Accept: start moving spec's blocks. Never blocks on the peer.

        The src blocks are not freed or written until D's Ack or Release, whatever the backend
        does with them meanwhile.
        """

    @abstractmethod
    def start_recv(self, spec: TransferSpec) -> None:
        """D, after allocating spec.dst_block_ids and before sending Accept. Never blocks on the peer.

        The dst blocks must hold P's data once poll() reports spec done without error; until then
        nothing reads them. A pulling backend may copy right here.
        """

    @abstractmethod
    def poll(self, wait_for: str | None = None) -> list[TransferDone]:
        """Transfers of this side that finished (or failed, or timed out) since the last poll.

        Called once per engine step; returns at once. With wait_for (sync mode), blocks until
        that request's transfer finishes, at most config.timeout_s. Reports each started
        transfer exactly once, and a transfer not done within config.timeout_s as failed.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the link (process group, mapped memory). Idempotent; returns within a second.

        Transfers still in flight are abandoned: buffers an unfinished operation may still
        touch are kept alive, never handed back to an allocator.
        """
