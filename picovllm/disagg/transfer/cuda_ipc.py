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


def _handle_dtype(h: dict) -> torch.dtype:
    dtype = _DTYPES.get(h.get("dtype"))
    if dtype is None:
        raise ValueError(f"cache handle dtype must be one of {sorted(_DTYPES)}, got {h.get('dtype')!r}")
    return dtype


def map_cache(h: dict) -> torch.Tensor:
    """The tensor export_cache described, mapped into this process (no copy)."""
    dtype = _handle_dtype(h)
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


def _own_cuda_cache(h: dict) -> torch.Tensor:
    """The tensor export_cache described, when it lives in this very process (P and D engines in one process,
    as benchmarks/d_step.py runs them): CUDA refuses to open a process's own IPC handle, so take the storage
    that torch's reduce_tensor remembered under that handle."""
    from torch.multiprocessing.reductions import storage_from_cache
    dtype = _handle_dtype(h)
    storage = storage_from_cache(None, unb64(h["handle"]))
    if storage is None:
        raise RuntimeError("the prefill cache is in this process but its storage is gone")
    return torch.empty(0, dtype=dtype, device=storage.device).set_(
        storage, h["offset"], h["size"], h["stride"])


@dataclass
class _Copy:
    what: str                      # for the timeout's error: "KV copy of 3 blocks"
    started: float
    event: Any = None              # CUDA: recorded after the copy on the side stream; None: already done


class PeerCopies:
    """Block copies out of a peer's mapped cache into ours: on a side stream under CUDA (done when its
    event is), at once on a CPU. Each started copy is reported once by done(): finished, or past the
    timeout (a kernel cannot be stopped, so our main stream then queues behind it)."""

    def __init__(self, cache: torch.Tensor) -> None:
        self.cache = cache
        self.stream = torch.cuda.Stream(cache.device) if cache.is_cuda else None
        self._copies: dict[str, _Copy] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._copies

    def __iter__(self):
        return iter(list(self._copies))

    def start(self, request_id: str, src: torch.Tensor, src_ids: list[int], dst_ids: list[int], what: str) -> None:
        copy = _Copy(what, time.monotonic())
        if self.stream is None:
            copy_blocks(src, self.cache, src_ids, dst_ids)
        else:
            # Blocks just allocated may have been read by kernels still queued on the main stream.
            self.stream.wait_stream(torch.cuda.current_stream(self.cache.device))
            with torch.cuda.stream(self.stream):
                copy_blocks(src, self.cache, src_ids, dst_ids)
                copy.event = torch.cuda.Event()
                copy.event.record(self.stream)
        self._copies[request_id] = copy

    def wait(self, request_id: str) -> None:
        c = self._copies.get(request_id)
        if c is not None and c.event is not None:
            c.event.synchronize()

    def done(self, timeout_s: float, ready=lambda request_id: True) -> list[TransferDone]:
        """Copies finished (and ready(request_id): a fleet's D also waits for P's grant), or failed: not
        finished and ready within timeout_s of their start."""
        out, now, unfinished = [], time.monotonic(), False
        for rid, c in list(self._copies.items()):
            # One stream: copies finish in the order they started (the dict's), so none after an unfinished one
            # has finished; asking each event costs the host microseconds per copy in flight, every step.
            unfinished = unfinished or (c.event is not None and not c.event.query())
            if not unfinished and ready(rid):
                del self._copies[rid]
                out.append(TransferDone(rid))
            elif now - c.started > timeout_s:
                del self._copies[rid]
                if c.event is not None:       # whatever our main stream does with these blocks next queues behind it
                    torch.cuda.current_stream(self.cache.device).wait_event(c.event)
                out.append(TransferDone(rid, f"{c.what} did not finish within {timeout_s:g} s"))
        return out

    def drop(self, request_id: str) -> None:
        self._copies.pop(request_id, None)

    def close(self) -> list[str]:
        """Wait for every copy (none may read a peer's memory once it is unmapped); the ids left unreported."""
        if self.stream is not None:
            self.stream.synchronize()
        left, self._copies = list(self._copies), {}
        return left


class CudaIpcTransfer(KVTransfer):
    name = "cuda_ipc"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.peer_cache: torch.Tensor | None = None
        self.copies = PeerCopies(self.cache)
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
            same = peer.backend_info.get("pid") == os.getpid() and h["kind"] == "cuda"
            mapped = _own_cuda_cache(h) if same else map_cache(h)
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
        self.copies.start(spec.request_id, self.peer_cache, spec.src_block_ids, spec.dst_block_ids,
                          f"KV copy of {len(spec.dst_block_ids)} blocks")

    def poll(self, wait_for: str | None = None) -> list[TransferDone]:
        if wait_for is not None:
            self.copies.wait(wait_for)
        out, self._sent = self._sent, []
        return out + self.copies.done(self.config.timeout_s)

    def close(self) -> None:
        self.copies.close()          # no copy may still read P's memory once it is unmapped
        self.peer_cache = None
