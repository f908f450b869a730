"""Many-to-many KV transfer on one host: D maps each P's whole cache once (CUDA IPC; shared memory on a CPU)
and copies blocks straight out of it. The fleet's form of picovllm.disagg.transfer.cuda_ipc.

As with nixl, the bytes move without P's help and everything else (claims, releases, leases, the fleet's
HMAC handshake) rides on the tcp backend's control plane (transfer/control_plane.py), composed here. A
handle carries P's cache handle (export_cache) in its info; D maps it the first time it pulls from that
instance, then a pull is one copy_blocks on a side stream (cuda_ipc.PeerCopies, as the linked pair's),
done when its event is and P has granted the claim (so the blocks held the request's KV throughout).
"""
from __future__ import annotations

import os

import torch

from picovllm.disagg.messages import KVHandle
from picovllm.disagg.transfer.base import PullTransfer, TransferDone
from picovllm.disagg.transfer.control_plane import TcpControlPlane
from picovllm.disagg.transfer.cuda_ipc import PeerCopies, export_cache, map_cache


class CudaIpcPullTransfer(PullTransfer):
    name = "cuda_ipc"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        info = {"cache": export_cache(self.cache), "pid": os.getpid()} if self.role == "p" else {}
        self.control = TcpControlPlane(self.name, self.role, self.cache, self.layout, self.config, info)
        self.address = self.control.address
        self.copies = PeerCopies(self.cache)
        self._mapped: dict[str, torch.Tensor] = {}     # D: P's instance id -> its cache, mapped here
        self._done: list[TransferDone] = []

    # -- P ---------------------------------------------------------------------------------------
    def publish(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        return self.control.publish(request_id, block_ids, num_tokens)

    def unpublish(self, request_id: str) -> None:
        self.control.unpublish(request_id)

    # -- D ---------------------------------------------------------------------------------------
    def claim(self, handle: KVHandle) -> None:
        self.control.claim(handle)

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
        self.control.check_pull(handle, dst_block_ids)
        self.copies.start(handle.request_id, self._peer_cache(handle), handle.block_ids, dst_block_ids,
                          f"KV copy from prefill instance {handle.instance_id}")

    def release(self, handle: KVHandle) -> None:
        self.copies.drop(handle.request_id)
        self.control.release(handle)

    # -- both ------------------------------------------------------------------------------------
    def poll(self) -> list[TransferDone]:
        if self.role == "p":
            return self.control.poll()
        out, self._done = self._done, []
        for done in self.control.poll():            # failed claims: nothing is pulled over tcp here
            self.copies.drop(done.request_id)
            out.append(done)
        # done once P granted the claim too: P kept the blocks from publishing to its grant, so the bytes are good
        return out + self.copies.done(self.config.timeout_s, ready=self.control.granted)

    def close(self) -> None:
        self.control.close()
        for rid in self.copies.close():      # no copy may still read a P's memory once it is unmapped
            self._done.append(TransferDone(rid, "the KV transfer was closed"))
        self._mapped.clear()
