"""The KV-transfer contracts. A backend is one module implementing one of them; read these classes first.

Two shapes of transfer, one contract each:
- KVTransfer: a fixed P<->D pair, linked at start-up (torch_dist, cuda_ipc). Below.
- PullTransfer: many to many (a fleet behind `picovllm router`): P publishes a request's blocks,
  any D that knows the fleet's secret claims, pulls and releases them (tcp). At the end of this file.

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

import numpy as np
import torch

from picovllm.engine.kv_cache import wire_view

from picovllm.disagg.auth import FleetSecret
from picovllm.disagg.hosts import check_host
from picovllm.disagg.messages import Hello, KVHandle, KVLayout


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
    An fp8 cache is held as its bytes (`self.cache` is a uint8 view, engine.kv_cache.wire_view): a backend
    moves bytes, half of bf16's, and needs no float8 support from gloo, sockets or index_copy_.
    """

    name: ClassVar[str]

    def __init__(self, role: str, cache: torch.Tensor, layout: KVLayout, config: TransferConfig,
                 kv_io=None) -> None:
        if role not in ("p", "d"):
            raise ValueError(f"role must be 'p' or 'd', got {role!r}")
        self.role, self.layout, self.config, self.kv_io = role, layout, config, kv_io
        self.cache = wire_view(cache)

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


# -- many to many -----------------------------------------------------------------------------------
def block_runs(src_ids: list[int], dst_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(first index, length) of each run of positions where both block id lists count up by one: one copy a run and
    plane instead of one a block and plane (nixl: UCX posts every descriptor as a copy of its own, and a 16k-token
    prompt of Qwen3-0.6B's layout is 57,344 of 32 KiB one a block, which ran at 3-5 GB/s on two H200s; tcp: one
    buffer a run and plane for sendmsg). Give one list twice for the runs of that list alone."""
    src, dst = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    if src.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1])
    return starts, np.diff(np.concatenate([starts, [src.size]]))


@dataclass(frozen=True)
class PullConfig:
    secret: FleetSecret              # every KV socket is authenticated with it (picovllm.disagg.auth)
    instance_id: str                 # unique per process start: a handle names the instance that holds it
    backend: str = "tcp"             # a key of picovllm.disagg.transfer.PULL_BACKENDS
    host: str = "127.0.0.1"          # P: where its KV server listens
    port: int = 0                    # P: 0 takes any free port
    advertise_host: str | None = None   # where D instances reach it (default host)
    lease_s: float = 30.0            # an unclaimed handle lives this long; a claimant silent this long is gone
    timeout_s: float = 30.0          # a pull not done this long after it was sent fails (queued, it waits)
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.secret, FleetSecret):
            raise ValueError("PullConfig.secret must be a FleetSecret: a fleet's KV sockets are authenticated")
        if not self.instance_id:
            raise ValueError("PullConfig.instance_id must be a non-empty string")
        for name in ("lease_s", "timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"PullConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"PullConfig.port must be in [0, 65536), got {self.port!r}")
        check_host("PullConfig.host", self.host)
        if self.advertise_host is not None:
            check_host("PullConfig.advertise_host", self.advertise_host)


class PullTransfer(ABC):
    """Moves blocks between any prefill and any decode instance, pulled by D. One object per engine.

    No set-up between pairs: D reaches a P (and both prove the fleet's secret) the first time it
    claims from it, so a D that joins a running fleet takes work at once. All methods are called
    from the engine's step thread and return at once; a backend does its I/O on threads of its own.

        P: publish(request, blocks) -> handle ----(router)----> D: claim(handle)   (request queued)
                                                                D: start_pull(handle, dst blocks)
                                                                D: poll() -> done: blocks written
        P: poll() -> released: free the blocks  <-------------- D: release(handle)

    P frees a request's blocks only after poll() lists it, which happens once: released by a D, or
    expired (error set): unclaimed for lease_s after publishing, or its claimant's connection died
    or went silent for lease_s. After it is listed no read of its blocks is in flight.
    """

    name: ClassVar[str]

    def __init__(self, role: str, cache: torch.Tensor, layout: KVLayout, config: PullConfig) -> None:
        if role not in ("p", "d"):
            raise ValueError(f"role must be 'p' or 'd', got {role!r}")
        self.role, self.layout, self.config = role, layout, config
        self.cache = wire_view(cache)     # fp8: its bytes, as KVTransfer

    # -- P ---------------------------------------------------------------------------------------
    @abstractmethod
    def publish(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        """Make a request's blocks readable by the fleet until released or expired; its handle, JSON-safe.
        The blocks are not written or freed until poll() lists the request."""

    @abstractmethod
    def unpublish(self, request_id: str) -> None:
        """Take a handle back (the request was aborted here). When this returns no read of its blocks
        is in flight and none will start: they may be freed. poll() will not list it."""

    # -- D ---------------------------------------------------------------------------------------
    @abstractmethod
    def claim(self, handle: KVHandle) -> None:
        """This instance will pull it (its request is queued here): P keeps it for as long as this
        instance lives, lease or not. A failed claim comes back from poll() as an error."""

    @abstractmethod
    def start_pull(self, handle: KVHandle, dst_block_ids: list[int]) -> None:
        """Copy the handle's blocks into dst_block_ids (allocated, read by nothing until poll() says
        done). Raises ValueError at once when the handle cannot be pulled here (layout, backend)."""

    @abstractmethod
    def release(self, handle: KVHandle) -> None:
        """Done with it (pulled, or given up): P may free it. Best effort: if P cannot be told, its lease does."""

    # -- both ------------------------------------------------------------------------------------
    @abstractmethod
    def poll(self) -> list[TransferDone]:
        """P: requests released (error None) or expired (error says why) since the last poll.
        D: pulls finished (the blocks hold P's data), failed or past config.timeout_s, and claims
        that failed. Each request at most once."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving and pulling; idempotent, returns within a second. Handles not yet released
        are dropped (P frees them: the engine is going away); D's next poll() fails the pulls in flight."""
