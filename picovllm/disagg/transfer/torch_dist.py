"""KV transfer over torch.distributed point-to-point: P gathers, sends; D receives, scatters.

The link is its own two-rank process group (P rank 0, D rank 1) built from a TCPStore that P
opens, so it never touches a default process group that tensor parallelism may own. The group
is NCCL when both caches are on CUDA devices that differ (or on different hosts), gloo otherwise
(NCCL refuses two ranks on one GPU); gloo moves host memory, so GPU blocks are staged through the
CPU. The gather and scatter are inherent to this backend: a message is one contiguous tensor.

Gloo's send/recv work objects only learn they are complete inside wait(), so each one gets a
waiter thread (wait() releases the GIL); poll() looks at what the waiters found.
"""
from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from picovllm.disagg.hosts import is_loopback, is_wildcard, local_host
from picovllm.disagg.messages import Hello
from picovllm.disagg.transfer.base import KVTransfer, TransferDone, TransferSpec
from picovllm.disagg.transfer.block_copy import check_block_ids
from picovllm.engine.step_input import to_device

P_RANK, D_RANK = 0, 1


@dataclass
class _Op:
    """One transfer on this side: stage "copy" (P: device-to-host staging copy in flight), "wire"
    (the send/recv), "scatter" (D: host-to-device copy and scatter into the cache in flight)."""
    spec: TransferSpec
    started: float
    stage: str
    buffer: torch.Tensor                  # the message; outlives every operation on it
    keep: tuple = ()                      # device tensors a queued copy still reads or writes
    event: Any = None                     # CUDA event closing the "copy" / "scatter" stage
    work: Any = None
    threaded: bool = False                # gloo: a waiter thread learns when the wire stage ends
    finished: threading.Event = field(default_factory=threading.Event)
    error: str | None = None

    def wire_done(self) -> bool:
        if self.threaded:
            return self.finished.is_set()
        if not self.work.is_completed():
            return False
        try:
            self.work.wait()
        except Exception as e:  # noqa: BLE001 - surfaced to the engine as the request's error
            self.error = f"KV transfer failed: {e}"
        return True


def _wait(op: _Op) -> None:
    try:
        op.work.wait()
    except Exception as e:  # noqa: BLE001
        op.error = f"KV transfer failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    op.finished.set()


class TorchDistTransfer(KVTransfer):
    name = "torch_dist"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dist_backend = self.config.dist_backend
        self.store: dist.TCPStore | None = None
        self.pg = None
        self.use_nccl = False
        self._ops: dict[str, _Op] = {}
        self._abandoned: list[_Op] = []       # timed out: the operation may still write its buffer
        self._info: dict = {}
        self._stream = None                   # D on a GPU: where received blocks are scattered

    def _device_info(self) -> dict:
        return {"host": socket.gethostname(), "device": str(self.cache.device), "dist_backend": self.dist_backend}

    def local_info(self) -> dict:
        info = self._device_info()
        if self.role == "p":    # the store takes over a socket we bind, so it listens on config.host only
            timeout = datetime.timedelta(seconds=self.config.connect_timeout_s)
            host = self.config.host
            sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
            port, fd = sock.getsockname()[1], sock.detach()
            try:
                self.store = dist.TCPStore(local_host(host), port, 2, True, timeout=timeout, wait_for_workers=False,
                                           master_listen_fd=fd)
            except BaseException:
                os.close(fd)
                raise
            info["store"] = [self.config.reach, port]
        self._info = info
        return info

    def connect(self, peer: Hello) -> None:
        mine, theirs = self._info, peer.backend_info
        p_info = theirs if self.role == "d" else mine
        choice = {mine["dist_backend"], theirs.get("dist_backend", "auto")} - {"auto"}
        if len(choice) > 1:
            raise ConnectionError(f"dist_backend differs: {mine['dist_backend']!r} here, {theirs.get('dist_backend')!r} "
                                  f"on the peer")
        if choice:
            self.use_nccl = choice == {"nccl"}
        else:
            both_cuda = mine["device"].startswith("cuda") and theirs["device"].startswith("cuda")
            self.use_nccl = both_cuda and (mine["host"] != theirs["host"] or mine["device"] != theirs["device"])
        timeout = datetime.timedelta(seconds=self.config.connect_timeout_s)
        try:
            if self.role == "d":
                host, port = theirs["store"]
                self.store = dist.TCPStore(host, int(port), 2, False, timeout=timeout)
            store = dist.PrefixStore(f"picovllm-pd/{peer.session}", self.store)
            rank = P_RANK if self.role == "p" else D_RANK
            # Our own deadline (poll) times transfers out. Gloo's must never fire: on a timeout it
            # closes the connection, and the link with it, for every later transfer too.
            op_timeout = datetime.timedelta(days=1)
            if self.use_nccl:
                torch.cuda.set_device(self.cache.device)
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = op_timeout
                self.pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
                # NCCL builds a communicator at a pair's first send/recv, with both ranks taking part:
                # D's first receive (posted before it sends Accept) would wait for P, while P waits for
                # that Accept. Build it now, while both sides are here.
                probe = torch.zeros(1, device=self.cache.device)
                work = self.pg.send([probe], D_RANK, 0) if self.role == "p" else self.pg.recv([probe], P_RANK, 0)
                deadline = time.monotonic() + self.config.connect_timeout_s
                while not work.is_completed():         # never an unbounded wait on a peer that may be gone
                    if time.monotonic() > deadline:
                        raise ConnectionError("torch_dist: the NCCL communicator with the peer was not built in "
                                              f"{self.config.connect_timeout_s:g} s")
                    time.sleep(0.001)
            else:
                self.pg = self._gloo_group(store, rank, op_timeout, self.config.reach, p_info["store"][0])
        except (RuntimeError, OSError, KeyError, TypeError, ValueError) as e:
            raise ConnectionError(f"torch_dist: cannot build the P-D process group: {e}") from e

    @staticmethod
    def _gloo_group(store, rank: int, timeout: datetime.timedelta, own_host: str, store_host: str):
        """Gloo binds one address per side: loopback when P's rendezvous is on loopback (one host, whatever
        the hostname resolves to); else this side's own address, unless it is a wildcard or loopback: then
        the address gloo finds from the hostname (or GLOO_SOCKET_IFNAME)."""
        if is_loopback(store_host):
            device_host = "127.0.0.1"
        elif is_wildcard(own_host) or is_loopback(own_host):
            return dist.ProcessGroupGloo(store, rank, 2, timeout)
        else:
            device_host = own_host
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=device_host)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, 2, opts)

    # -- transfers -----------------------------------------------------------------------------
    # Gloo moves host memory: a GPU cache is staged through pinned buffers, with the copies queued
    # on the GPU and their end seen by polling an event, so no step waits for them either.
    def _staged(self) -> bool:
        return self.cache.is_cuda and not self.use_nccl

    def _wire_device(self) -> torch.device:
        return self.cache.device if self.use_nccl else torch.device("cpu")

    def _post(self, op: _Op) -> None:
        op.stage = "wire"
        op.threaded = not self.use_nccl
        try:
            if self.role == "p":
                op.work = self.pg.send([op.buffer], D_RANK, op.spec.tag)
            else:
                op.work = self.pg.recv([op.buffer], P_RANK, op.spec.tag)
        except Exception as e:  # noqa: BLE001 - the peer is gone: the op ends with this error at the next poll
            op.error = f"KV transfer failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            op.threaded = True
            op.finished.set()
            return
        if op.threaded:
            threading.Thread(target=_wait, args=(op,), name="picovllm-kv-wait", daemon=True).start()

    def start_send(self, spec: TransferSpec) -> None:
        assert self.role == "p" and self.pg is not None
        check_block_ids("src_block_ids", spec.src_block_ids, self.cache.shape[2])
        if self.kv_io is not None:    # tensor parallel: gathered from every rank into full heads, on the CPU
            full = self.kv_io.read(spec.src_block_ids)
            self._ops[spec.request_id] = op = _Op(spec, time.monotonic(), "wire", full.to(self._wire_device()))
            self._post(op)
            return
        # pinned, not torch.tensor(..., device=): that copy waits for the stream, i.e. for the step in flight
        idx = to_device(spec.src_block_ids, torch.long, self.cache.device)
        gathered = self.cache.index_select(2, idx)
        if self._staged():
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._ops[spec.request_id] = _Op(spec, time.monotonic(), "copy", host, (gathered,), event)
        else:
            self._ops[spec.request_id] = op = _Op(spec, time.monotonic(), "wire", gathered)
            self._post(op)

    def start_recv(self, spec: TransferSpec) -> None:
        assert self.role == "d" and self.pg is not None
        check_block_ids("dst_block_ids", spec.dst_block_ids, self.cache.shape[2])
        if len(spec.src_block_ids) != len(spec.dst_block_ids):
            raise ValueError("TransferSpec.src_block_ids and dst_block_ids differ in length")
        shape = self.layout.block_shape(len(spec.dst_block_ids))
        if self.kv_io is not None:
            buf = torch.empty(shape, dtype=self.cache.dtype, device=self._wire_device())
        elif self._staged():
            buf = torch.empty(shape, dtype=self.cache.dtype, pin_memory=True)
        else:
            buf = torch.empty(shape, dtype=self.cache.dtype, device=self.cache.device)
        self._ops[spec.request_id] = op = _Op(spec, time.monotonic(), "wire", buf)
        self._post(op)

    def _scatter(self, op: _Op) -> None:
        """D: write a received message into the cache's dst blocks."""
        if self.kv_io is not None:     # tensor parallel: every rank keeps its heads (synchronous)
            self.kv_io.write(op.spec.dst_block_ids, op.buffer)
            op.stage = "done"
            return
        idx = to_device(op.spec.dst_block_ids, torch.long, self.cache.device)   # no wait for the step in flight
        if not self.cache.is_cuda:
            self.cache.index_copy_(2, idx, op.buffer)
            op.stage = "done"
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.cache.device)
        # The blocks were just allocated: kernels queued on the main stream may still read them.
        self._stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(self._stream):
            data = op.buffer.to(self.cache.device, non_blocking=True)
            self.cache.index_copy_(2, idx, data)
            op.event = torch.cuda.Event()
            op.event.record(self._stream)
        op.keep, op.stage = (data, idx), "scatter"

    def poll(self, wait_for: str | None = None) -> list[TransferDone]:
        done = []
        while True:
            done += self._advance()
            if wait_for is None or wait_for not in self._ops:
                return done
            time.sleep(0.0002)

    def _advance(self) -> list[TransferDone]:
        out, now = [], time.monotonic()
        for rid, op in list(self._ops.items()):
            if op.stage == "copy" and op.event.query():
                op.keep = ()
                self._post(op)
            if op.stage == "wire" and op.wire_done():
                if op.error is not None or self.role == "p":
                    op.stage = "done"
                else:
                    self._scatter(op)
            if op.stage == "scatter" and op.event.query():
                op.stage = "done"
            if op.stage == "done":
                del self._ops[rid]
                out.append(TransferDone(rid, op.error))
            elif now - op.started > self.config.timeout_s:
                del self._ops[rid]
                self._abandoned.append(op)
                if op.stage == "scatter":     # whatever the main stream does with the blocks next waits
                    torch.cuda.current_stream(self.cache.device).wait_event(op.event)
                out.append(TransferDone(rid, f"KV transfer of {len(op.spec.dst_block_ids)} blocks timed out "
                                             f"after {self.config.timeout_s:g} s"))
        return out

    def close(self) -> None:
        # A group with operations still pending could block in its destructor: keep it (and their
        # buffers) referenced until the process exits instead.
        self._abandoned += self._ops.values()
        self._ops = {}
        if not self._abandoned:
            self.pg = None
            self.store = None
