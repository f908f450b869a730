"""KV transfer on one host by mapping P's whole cache into D once: D copies blocks straight out of it.

On CUDA, P exports its cache tensor's CUDA IPC handle (torch's own reduction, the one
torch.multiprocessing uses, with every field carried as JSON rather than pickled); D opens it
once at connect and from then on a transfer is one copy kernel from P's blocks into D's, on a
side stream, with no staging buffer when both caches sit on the same GPU. P does nothing per
transfer: its blocks stay untouched until D's Ack, which is the whole synchronisation.

On CPU the same pull path runs over shared memory (P's cache is moved into a shared segment
and D maps it by name), so the protocol and this backend are exercised in CPU tests too.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from picovllm.disagg.messages import Hello, b64, unb64
from picovllm.disagg.transfer.base import KVTransfer, TransferDone, TransferSpec
from picovllm.disagg.transfer.block_copy import copy_blocks

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.uint8)}


def export_cache(cache: torch.Tensor) -> dict:
    """A JSON-safe handle another process on this host can map `cache` with (see map_cache)."""
    if cache.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor
        _, a = reduce_tensor(cache)
        # a: (cls, size, stride, offset, storage_cls, dtype, device, handle, storage_bytes, storage_offset,
        #     requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)
        return {"kind": "cuda", "size": list(a[1]), "stride": list(a[2]), "offset": a[3],
                "dtype": str(a[5]).removeprefix("torch."), "device": a[6], "handle": b64(a[7]),
                "storage_bytes": a[8], "storage_offset": a[9], "ref_counter_handle": b64(a[11]),
                "ref_counter_offset": a[12], "event_handle": b64(a[13]), "event_sync_required": a[14]}
    if not cache.is_shared():
        cache.share_memory_()      # moves the storage in place: the attention layers' views follow
    manager, name, nbytes = cache.untyped_storage()._share_filename_cpu_()
    return {"kind": "cpu", "size": list(cache.shape), "stride": list(cache.stride()),
            "offset": cache.storage_offset(), "dtype": str(cache.dtype).removeprefix("torch."),
            "manager": b64(manager), "name": b64(name), "storage_bytes": nbytes}


def map_cache(h: dict) -> torch.Tensor:
    """The tensor export_cache described, mapped into this process (no copy)."""
    dtype = _DTYPES.get(h.get("dtype"))
    if dtype is None:
        raise ValueError(f"cache handle dtype must be one of {sorted(_DTYPES)}, got {h.get('dtype')!r}")
    if h.get("kind") == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
        return rebuild_cuda_tensor(torch.Tensor, torch.Size(h["size"]), tuple(h["stride"]), h["offset"],
                                   torch.storage.TypedStorage, dtype, h["device"], unb64(h["handle"]),
                                   h["storage_bytes"], h["storage_offset"], False, unb64(h["ref_counter_handle"]),
                                   h["ref_counter_offset"], unb64(h["event_handle"]), h["event_sync_required"])
    if h.get("kind") == "cpu":
        storage = torch.UntypedStorage._new_shared_filename_cpu(unb64(h["manager"]), unb64(h["name"]),
                                                                h["storage_bytes"])
        return torch.empty(0, dtype=dtype).set_(storage, h["offset"], h["size"], h["stride"])
    raise ValueError(f"cache handle kind must be 'cuda' or 'cpu', got {h.get('kind')!r}")


@dataclass
class _Copy:
    spec: TransferSpec
    started: float
    event: Any = None              # CUDA: recorded after the copy on the side stream; None: already done


class CudaIpcTransfer(KVTransfer):
    name = "cuda_ipc"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.peer_cache: torch.Tensor | None = None
        self.stream = torch.cuda.Stream(self.cache.device) if self.cache.is_cuda else None
        self._copies: dict[str, _Copy] = {}
        self._sent: list[TransferDone] = []

    def local_info(self) -> dict:
        if self.role == "p":
            return {"cache": export_cache(self.cache), "pid": os.getpid()}
        return {"pid": os.getpid()}

    def connect(self, peer: Hello) -> None:
        if self.role == "p":
            return
        h = peer.backend_info.get("cache")
        if h is None:
            raise ConnectionError("cuda_ipc: the prefill side's Hello carries no cache handle")
        if (h["kind"] == "cuda") != self.cache.is_cuda:
            raise ConnectionError(f"cuda_ipc: the prefill cache is on {h['kind']}, this one on {self.cache.device}: "
                                  f"both must be CUDA (or both CPU)")
        try:
            mapped = map_cache(h)
        except (RuntimeError, ValueError, OSError) as e:
            raise ConnectionError(f"cuda_ipc: cannot map the prefill side's KV cache: {e}") from e
        expect = peer.layout.block_shape(peer.layout.num_blocks)
        if tuple(mapped.shape) != expect or mapped.dtype != self.cache.dtype:
            raise ConnectionError(f"cuda_ipc: mapped cache is {tuple(mapped.shape)} {mapped.dtype}, the Hello "
                                  f"says {expect} {peer.layout.dtype}")
        self.peer_cache = mapped

    def start_send(self, spec: TransferSpec) -> None:
        assert self.role == "p"
        self._sent.append(TransferDone(spec.request_id))    # nothing to do: D pulls; our blocks wait for Ack

    def start_recv(self, spec: TransferSpec) -> None:
        assert self.role == "d" and self.peer_cache is not None
        copy = _Copy(spec, time.monotonic())
        if self.stream is None:
            copy_blocks(self.peer_cache, self.cache, spec.src_block_ids, spec.dst_block_ids)
        else:
            # Blocks just allocated may have been read by kernels still queued on the main stream.
            self.stream.wait_stream(torch.cuda.current_stream(self.cache.device))
            with torch.cuda.stream(self.stream):
                copy_blocks(self.peer_cache, self.cache, spec.src_block_ids, spec.dst_block_ids)
                copy.event = torch.cuda.Event()
                copy.event.record(self.stream)
        self._copies[spec.request_id] = copy

    def poll(self, wait_for: str | None = None) -> list[TransferDone]:
        if wait_for is not None and wait_for in self._copies and self._copies[wait_for].event is not None:
            self._copies[wait_for].event.synchronize()
        out, self._sent = self._sent, []
        now = time.monotonic()
        for rid, c in list(self._copies.items()):
            if c.event is None or c.event.query():
                del self._copies[rid]
                out.append(TransferDone(rid))
            elif now - c.started > self.config.timeout_s:
                del self._copies[rid]
                # A kernel cannot be stopped: whatever D's main stream does with these blocks next
                # must queue behind it.
                torch.cuda.current_stream(self.cache.device).wait_event(c.event)
                out.append(TransferDone(rid, f"KV copy of {len(c.spec.dst_block_ids)} blocks did not finish "
                                             f"within {self.config.timeout_s:g} s"))
        return out

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()    # no copy may still read P's memory once it is unmapped
        self._copies = {}
        self.peer_cache = None
