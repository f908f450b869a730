"""Many-to-many KV transfer on one host: D maps each P's whole cache once (CUDA IPC; shared memory on a CPU)
and copies blocks straight out of it. The fleet's form of picovllm.disagg.transfer.cuda_ipc.

As with nixl, the bytes move without P's help and everything else (claims, releases, leases, the fleet's
HMAC handshake) rides on the tcp backend's control plane, composed here. A handle carries P's cache
handle (export_cache) in its info; D maps it the first time it pulls from that instance, then a pull
is one copy_blocks on a side stream, done when its event is and P has granted the claim (so the
blocks held the request's KV throughout the copy).
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from picovllm.disagg.messages import KVHandle
from picovllm.disagg.transfer.base import PullTransfer, TransferDone
from picovllm.disagg.transfer.block_copy import copy_blocks
from picovllm.disagg.transfer.cuda_ipc import export_cache, map_cache
from picovllm.disagg.transfer.host_tcp import HostTcpTransfer


@dataclass
class _Copy:
    handle: KVHandle
    started: float
    event: Any = None              # CUDA: recorded after the copy on the side stream; None: already done


class CudaIpcPullTransfer(PullTransfer):
    name = "cuda_ipc"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.control = HostTcpTransfer(self.role, self.cache, self.layout, self.config)
        self.address = self.control.address
        self._info = {"cache": export_cache(self.cache), "pid": os.getpid()} if self.role == "p" else {}
        self.stream = torch.cuda.Stream(self.cache.device) if self.cache.is_cuda else None
        self._mapped: dict[str, torch.Tensor] = {}     # D: P's instance id -> its cache, mapped here
        self._copies: dict[str, _Copy] = {}
        self._done: list[TransferDone] = []

    def _control_handle(self, handle: KVHandle) -> KVHandle:
        if handle.backend != self.name:
            raise ValueError(f"KVHandle.backend: this decode instance pulls with {self.name!r}, "
                             f"the handle is for {handle.backend!r}")
        return dataclasses.replace(handle, backend=self.control.name)

    # -- P ---------------------------------------------------------------------------------------
    def publish(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        handle = self.control.publish(request_id, block_ids, num_tokens)
        return dataclasses.replace(handle, backend=self.name, info=dict(self._info))

    def unpublish(self, request_id: str) -> None:
        # A copy D already started reads P's memory without P: a fleet's P unpublishes only as it shuts down.
        self.control.unpublish(request_id)

    # -- D ---------------------------------------------------------------------------------------
    def claim(self, handle: KVHandle) -> None:
        self.control.claim(self._control_handle(handle))

    def _peer_cache(self, handle: KVHandle) -> torch.Tensor:
        mapped = self._mapped.get(handle.instance_id)
        if mapped is None:
            h = handle.info.get("cache")
            if not isinstance(h, dict) or (h.get("kind") == "cuda") != self.cache.is_cuda:
                raise ValueError(f"KVHandle.info.cache: prefill instance {handle.instance_id}'s cache cannot be "
                                 f"mapped into a cache on {self.cache.device}")
            try:
                mapped = map_cache(h)
            except (RuntimeError, OSError) as e:
                raise ValueError(f"KVHandle.info.cache: cannot map prefill instance {handle.instance_id}'s KV cache "
                                 f"(another host?): {e}") from None
            if tuple(mapped.shape) != handle.layout.block_shape(handle.layout.num_blocks):
                raise ValueError(f"KVHandle.info.cache: mapped {tuple(mapped.shape)}, the layout says otherwise")
            self._mapped[handle.instance_id] = mapped
        return mapped

    def start_pull(self, handle: KVHandle, dst_block_ids: list[int]) -> None:
        self.control._check_handle(self._control_handle(handle), dst_block_ids)
        src = self._peer_cache(handle)
        copy = _Copy(handle, time.monotonic())
        if self.stream is None:
            copy_blocks(src, self.cache, handle.block_ids, dst_block_ids)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.cache.device))
            with torch.cuda.stream(self.stream):
                copy_blocks(src, self.cache, handle.block_ids, dst_block_ids)
                copy.event = torch.cuda.Event()
                copy.event.record(self.stream)
        self._copies[handle.request_id] = copy

    def release(self, handle: KVHandle) -> None:
        self._copies.pop(handle.request_id, None)
        self.control.release(self._control_handle(handle))

    # -- both ------------------------------------------------------------------------------------
    def poll(self) -> list[TransferDone]:
        if self.role == "p":
            return self.control.poll()
        out, self._done = self._done, []
        for done in self.control.poll():            # failed claims: nothing is pulled over tcp here
            self._copies.pop(done.request_id, None)
            out.append(done)
        now = time.monotonic()
        for rid, c in list(self._copies.items()):
            if (c.event is None or c.event.query()) and self.control.claim_confirmed(rid):
                del self._copies[rid]         # P kept the blocks from publishing to its grant: the bytes are good
                out.append(TransferDone(rid))
            elif now - c.started > self.config.timeout_s:
                del self._copies[rid]
                if c.event is not None:                   # a kernel cannot be stopped
                    torch.cuda.current_stream(self.cache.device).wait_event(c.event)
                out.append(TransferDone(rid, f"KV copy from prefill instance {c.handle.instance_id} did not "
                                             f"finish within {self.config.timeout_s:g} s"))
        return out

    def close(self) -> None:
        self.control.close()
        if self.stream is not None:
            self.stream.synchronize()     # no copy may still read a P's memory once it is unmapped
        for rid in self._copies:
            self._done.append(TransferDone(rid, "the KV transfer was closed"))
        self._copies.clear()
        self._mapped.clear()
