"""Many-to-many KV transfer with NIXL (UCX inside): D reads P's blocks straight out of P's registered cache,
GPU memory (VRAM) or host memory (DRAM) alike. The PullTransfer that production fleets share.

The bytes move by NIXL; everything else rides on the tcp backend's authenticated control plane
(picovllm.disagg.transfer.control_plane, composed here, not subclassed): claims, releases, leases, and
the fleet's HMAC handshake on every socket. P registers its whole cache with its NIXL agent once;
a handle carries the agent's metadata and the cache's base address (handle.info), so a D that sees
a P for the first time adds it as a remote agent and from then on a pull is one NIXL READ of
num_layers * 2 descriptors per block, posted on the engine thread and polled to completion.

Security: the control plane and the router's calls are authenticated; UCX's data plane is not (a
peer that sniffed a handle's metadata off the network could read P's registered cache): keep the
fleet's network private, as for every backend.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from picovllm.disagg.messages import KVHandle, b64, unb64
from picovllm.disagg.transfer.base import PullTransfer, TransferDone, block_runs
from picovllm.disagg.transfer.control_plane import TcpControlPlane

NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")


def import_nixl():
    """The installed NIXL Python API (nixl-cu12, nixl-cu13 or nixl); ImportError naming them if none is."""
    for name in NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module
    raise ImportError("the nixl KV transfer needs NIXL: pip install nixl-cu12 (or nixl-cu13), after torch")


@dataclass
class _Read:
    handle: KVHandle
    xfer: Any                      # the NIXL transfer handle
    started: float


class NixlTransfer(PullTransfer):
    name = "nixl"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        nixl = import_nixl()
        self.agent_name = f"picovllm-{self.role}-{self.config.instance_id}"
        self.agent = nixl.nixl_agent(self.agent_name, nixl.nixl_agent_config(backends=["UCX"]))
        self._registered = self.agent.register_memory(self.cache)
        self.mem = "VRAM" if self.cache.is_cuda else "DRAM"
        self.device_id = (self.cache.device.index or 0) if self.cache.is_cuda else 0
        info = {"agent_metadata": b64(self.agent.get_agent_metadata()), "base": self.cache.data_ptr(),
                "mem": self.mem, "device_id": self.device_id}     # what every handle of P's carries
        self.control = TcpControlPlane(self.name, self.role, self.cache, self.layout, self.config, info)
        self._remote: dict[str, str] = {}          # D: P's instance id -> its NIXL agent name
        self._reads: dict[str, _Read] = {}
        self._failed: list[TransferDone] = []
        self.address = self.control.address

    # -- P ---------------------------------------------------------------------------------------
    def publish(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        return self.control.publish(request_id, block_ids, num_tokens)

    def unpublish(self, request_id: str) -> None:
        # A READ a D already posted is not stopped by this (UCX reads without P's help): a fleet's P
        # unpublishes only as it shuts down, deregistering its cache (D's READ then fails).
        self.control.unpublish(request_id)

    # -- D ---------------------------------------------------------------------------------------
    def claim(self, handle: KVHandle) -> None:
        self.control.claim(handle)

    def start_pull(self, handle: KVHandle, dst_block_ids: list[int]) -> None:
        self.control.check_pull(handle, dst_block_ids)
        info = handle.info
        if info.get("mem") not in ("DRAM", "VRAM") or not isinstance(info.get("base"), int):
            raise ValueError("KVHandle.info: not a nixl handle (mem, base, agent_metadata)")
        remote = self._remote.get(handle.instance_id)
        if remote is None:
            remote = self._remote[handle.instance_id] = self.agent.add_remote_agent(unb64(info["agent_metadata"]))
        starts, runs = block_runs(handle.block_ids, dst_block_ids)
        src = self._descs(info["base"], handle.layout.num_blocks, handle.block_ids, starts, runs,
                          info.get("device_id", 0))
        dst = self._descs(self.cache.data_ptr(), self.cache.shape[2], dst_block_ids, starts, runs, self.device_id)
        remote_side = self.agent.get_xfer_descs(src, info["mem"])
        local_side = self.agent.get_xfer_descs(dst, self.mem)
        if self.cache.is_cuda:     # blocks just allocated may be read by kernels still queued
            torch.cuda.current_stream(self.cache.device).synchronize()
        xfer = self.agent.initialize_xfer("READ", local_side, remote_side, remote)
        state = self.agent.transfer(xfer)
        read = _Read(handle, xfer, time.monotonic())
        if state == "ERR":
            self._finish(read)
            self._failed.append(TransferDone(handle.request_id, "NIXL could not post the READ from prefill "
                                                                f"instance {handle.instance_id}"))
            return
        self._reads[handle.request_id] = read

    def _descs(self, base: int, num_blocks: int, block_ids: list[int], starts: np.ndarray, runs: np.ndarray,
               device_id: int) -> np.ndarray:
        """(address, length, device) of each (layer, k/v) plane's slice of each run of blocks (block_runs),
        plane-major."""
        block_bytes = self.cache[0, 0, 0].numel() * self.cache.element_size()
        planes = np.arange(self.cache.shape[0] * 2, dtype=np.uint64)[:, None]
        first = np.asarray(block_ids, dtype=np.uint64)[starts][None, :]
        addrs = (np.uint64(base) + (planes * np.uint64(num_blocks) + first) * np.uint64(block_bytes)).reshape(-1)
        out = np.empty((addrs.size, 3), dtype=np.uint64)
        out[:, 0] = addrs
        out[:, 1] = np.tile(runs.astype(np.uint64) * np.uint64(block_bytes), planes.shape[0])
        out[:, 2] = device_id
        return out

    def release(self, handle: KVHandle) -> None:
        read = self._reads.pop(handle.request_id, None)
        if read is not None:
            self._finish(read)
        self.control.release(handle)

    # -- both ------------------------------------------------------------------------------------
    def poll(self) -> list[TransferDone]:
        if self.role == "p":
            return self.control.poll()
        out, self._failed = self._failed, []
        for done in self.control.poll():            # failed claims only: nothing is pulled over tcp here
            read = self._reads.pop(done.request_id, None)
            if read is not None:
                self._finish(read)
            out.append(done)
        now = time.monotonic()
        for rid, read in list(self._reads.items()):
            state = self.agent.check_xfer_state(read.xfer)
            if now - read.started <= self.config.timeout_s and (
                    state == "PROC" or state == "DONE" and not self.control.granted(rid)):
                continue          # done only once P granted the claim: the blocks held the KV throughout
            del self._reads[rid]
            who = f"prefill instance {read.handle.instance_id}"
            if state == "DONE":
                error = None if self.control.granted(rid) else \
                    f"{who} did not grant the claim within {self.config.timeout_s:g} s"
            else:
                error = f"NIXL READ from {who} failed" if state == "ERR" else \
                    f"NIXL READ from {who} took over {self.config.timeout_s:g} s"
            self._finish(read)
            out.append(TransferDone(rid, error))
        return out

    def _finish(self, read: _Read) -> None:
        try:
            self.agent.release_xfer_handle(read.xfer)
        except Exception:   # noqa: BLE001 - a READ that cannot be cancelled keeps its handle (NIXL logs it)
            pass

    def close(self) -> None:
        self.control.close()
        for rid, read in list(self._reads.items()):
            self._finish(read)
            self._failed.append(TransferDone(rid, "the KV transfer was closed"))
        self._reads.clear()
        if self._registered is not None:
            try:
                self.agent.deregister_memory(self._registered)
            except Exception:   # noqa: BLE001 - closing: nothing more to do with it
                pass
            self._registered = None
