"""The tcp backend's control plane, lent to a PullTransfer whose bytes move some other way (nixl, cuda_ipc).

Claims, releases, leases and the fleet's HMAC handshake on every socket are HostTcpTransfer's
(picovllm.disagg.transfer.host_tcp), composed, not subclassed: a handle goes out under the lending
backend's name with its info (where D finds the bytes), and comes back to the tcp transfer under
"tcp". The lending backend keeps its own half: how a pull moves the bytes and when it is done
(never before P granted the claim: granted(), since P keeps a published handle's blocks untouched
until it is retired, a grant means the bytes read were the request's).
"""
from __future__ import annotations

import dataclasses

import torch

from picovllm.disagg.messages import KVHandle, KVLayout
from picovllm.disagg.transfer.base import PullConfig, TransferDone
from picovllm.disagg.transfer.host_tcp import HostTcpTransfer


class TcpControlPlane:
    def __init__(self, backend: str, role: str, cache: torch.Tensor, layout: KVLayout, config: PullConfig,
                 info: dict) -> None:
        """backend: the lending backend's name; info: what each of P's handles carries for it."""
        self.backend, self.info = backend, info
        self.tcp = HostTcpTransfer(role, cache, layout, config)
        self.address = self.tcp.address

    # -- P ---------------------------------------------------------------------------------------
    def publish(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        handle = self.tcp.publish(request_id, block_ids, num_tokens)
        return dataclasses.replace(handle, backend=self.backend, info=dict(self.info))

    def unpublish(self, request_id: str) -> None:
        """Stops claims and releases. A read D already started bypasses P and is not stopped: a fleet's P
        unpublishes only as it shuts down."""
        self.tcp.unpublish(request_id)

    # -- D ---------------------------------------------------------------------------------------
    def as_tcp(self, handle: KVHandle) -> KVHandle:
        if handle.backend != self.backend:
            raise ValueError(f"KVHandle.backend: this decode instance pulls with {self.backend!r}, "
                             f"the handle is for {handle.backend!r}")
        return dataclasses.replace(handle, backend=self.tcp.name)

    def claim(self, handle: KVHandle) -> None:
        self.tcp.claim(self.as_tcp(handle))

    def check_pull(self, handle: KVHandle, dst_block_ids: list[int]) -> None:
        """ValueError naming the field if the handle cannot be pulled into dst_block_ids here."""
        self.tcp.check_handle(self.as_tcp(handle), dst_block_ids)

    def release(self, handle: KVHandle) -> None:
        self.tcp.release(self.as_tcp(handle))

    def granted(self, request_id: str) -> bool:
        return self.tcp.claim_confirmed(request_id)

    # -- both ------------------------------------------------------------------------------------
    def poll(self) -> list[TransferDone]:
        """P: released or expired handles. D: failed claims (nothing is pulled over tcp)."""
        return self.tcp.poll()

    def close(self) -> None:
        self.tcp.close()
