"""Many-to-many KV transfer over TCP through host memory: the PullTransfer that runs anywhere (CI's CPU too).

P runs a KV server (a listening socket, one thread per connected D); D opens one connection per P
instance the first time it claims from it (kv_socket.PeerConnection), with a thread that runs its
claims, pulls and releases one at a time (claims and releases before the pulls queued; a pull's time
limit runs from when it is sent). Every socket starts with the fleet's mutual HMAC challenge-response
(kv_socket, picovllm.disagg.auth): nothing is read or written for a peer that fails it. A pull's KVReply
is followed by its nbytes of blocks, laid out as the cache ([num_layers, 2, n, block_size, kv_heads,
head_dim]): from a CPU cache P sends them straight from the cache (one buffer a layer, K or V, and run
of consecutive blocks: sendmsg), from a GPU through pinned memory; D receives into reused host buffers
(pinned for a GPU cache). On a 2-core CPU that is 1.6-2.4 GB/s, 68-89% of gloo's send/recv
(benchmarks/fleet_pull.py; 0.4-0.7 GB/s with a new buffer and a gather a pull).

Who touches the cache: P's server threads read published blocks (outside the lock, counted as
readers of their handle, until the bytes are sent), and unpublish waits until a handle has no reader,
so once it returns no read is in flight (P's engine never writes a published block: it is held). D's
threads only fill host buffers; poll(), on the engine's thread, copies a finished pull into the cache,
so a timed-out or cancelled pull never writes a block.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass

import torch

from picovllm.disagg.auth import AuthError
from picovllm.disagg.messages import ClaimKV, Heartbeat, KVHandle, KVReply, PullKV, ReleaseKV
from picovllm.disagg.transfer.base import PullTransfer, TransferDone, block_runs
from picovllm.disagg.transfer.kv_socket import (HostBuffers, PeerConnection, authenticate_client, recv_frame,
                                                send_frame, set_io_timeout)

logger = logging.getLogger("picovllm.kv")

def _blocks_nbytes(cache: torch.Tensor, n: int) -> int:
    return cache[:, :, :1].numel() * n * cache.element_size()


@dataclass
class _Published:
    block_ids: list[int]
    since: float
    claimant: int | None = None          # the connection that claimed it
    readers: int = 0                     # server threads copying its blocks now
    retired: TransferDone | None = None  # released or expired while being read: reported when the reads end


@dataclass
class _Pull:
    handle: KVHandle
    dst_block_ids: list[int]
    sent: float | None = None            # when its connection sent it: the time limit runs from there (queued
                                         # behind other pulls it waits, unlimited; each of those has its limit)


class HostTcpTransfer(PullTransfer):
    name = "tcp"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._no_readers = threading.Condition(self._lock)
        self._closed = threading.Event()
        self._done: list[TransferDone] = []            # P: released or expired, for the next poll
        self._handles: dict[str, _Published] = {}      # P
        self._unclaimed: dict[str, _Published] = {}    # P: the handles no D claimed yet, oldest first (the lease)
        self._draining: dict[str, _Published] = {}     # P: retired, still being read
        self._pulls: dict[str, _Pull] = {}             # D: started, not reported
        self._confirmed: set[str] = set()              # D: claims P granted, not yet released or lost
        self._results: queue.SimpleQueue = queue.SimpleQueue()   # D: (request_id, kind, bytes | None, error)
        self._peers: dict[tuple[str, int], PeerConnection] = {}   # D: one per P instance
        self._buffers = HostBuffers(pinned=self.cache.is_cuda)    # D: what pulls land in
        self._server: socket.socket | None = None
        self._conns: set[socket.socket] = set()       # P: connected D instances (closed with the transfer)
        self.address: list | None = None
        if self.role == "p":
            self._listen()

    # -- P: the KV server ------------------------------------------------------------------------
    def _listen(self) -> None:
        c = self.config
        self._server = socket.create_server((c.host, c.port),
                                            family=socket.AF_INET6 if ":" in c.host else socket.AF_INET)
        self._server.settimeout(0.2)
        self.address = [c.advertise_host or c.host, self._server.getsockname()[1]]
        threading.Thread(target=self._accept_loop, name="picovllm-kv-server", daemon=True).start()

    def _accept_loop(self) -> None:
        conn_ids = iter(range(1, 1 << 62))
        while not self._closed.is_set():
            try:
                sock, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, next(conn_ids)), name="picovllm-kv-conn",
                             daemon=True).start()

    def _serve(self, sock: socket.socket, conn: int) -> None:
        why = "it closed the connection"
        with self._lock:
            self._conns.add(sock)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.config.connect_timeout_s)
            authenticate_client(sock, self.config)
            set_io_timeout(sock, self.config.lease_s)   # a D sends a heartbeat every lease / 4 when idle
            while not self._closed.is_set():
                msg = recv_frame(sock)
                if isinstance(msg, Heartbeat):
                    continue
                if isinstance(msg, (ClaimKV, PullKV, ReleaseKV)):
                    self._answer(sock, conn, msg)
                else:
                    raise ConnectionError(f"unexpected {type(msg).__name__} on a KV socket")
        except AuthError as e:
            why = str(e)
            logger.warning("KV server: refused a peer: %s", e)
        except (OSError, ConnectionError, ValueError, KeyError, TypeError) as e:
            why = f"{type(e).__name__}: {e}"
        finally:
            with self._lock:
                self._conns.discard(sock)
            sock.close()
            self._drop_claims(conn, why)

    def _answer(self, sock: socket.socket, conn: int, msg) -> None:
        rid, error, reading = msg.request_id, None, None
        with self._lock:
            h = self._handles.get(rid)
            if h is None:
                error = f"request {rid!r} is not published on prefill instance {self.config.instance_id} " \
                        f"(released, expired or aborted there)"
            elif h.claimant not in (None, conn):
                error = f"request {rid!r} was claimed by another decode instance"
            elif isinstance(msg, ClaimKV):
                h.claimant = conn
                self._unclaimed.pop(rid, None)
            elif isinstance(msg, PullKV):
                reading = h
                h.readers += 1               # unpublish waits for it (a slow D: up to the lease, P's send timeout)
            else:
                self._retire(rid, TransferDone(rid))
        if reading is None:
            send_frame(sock, KVReply(rid, 0, error))
            return
        try:                                 # a CPU cache's blocks are sent from the cache itself: read till sent
            payload = self._read_blocks(reading.block_ids)
            send_frame(sock, KVReply(rid, sum(b.nbytes for b in payload), None), payload)
        finally:
            with self._lock:
                reading.readers -= 1
                if not reading.readers and reading.retired is not None:
                    self._done.append(reading.retired)
                    self._draining.pop(rid, None)
                self._no_readers.notify_all()

    def _read_blocks(self, block_ids: list[int]) -> list[memoryview]:
        """The blocks' bytes in the cache's layout, [num_layers, 2, n, ...]: on the CPU one view a (layer, K/V,
        run of consecutive blocks), nothing copied; from a GPU, gathered there and copied to pinned memory."""
        cache = self.cache
        if cache.is_cuda or not cache.is_contiguous():
            idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
            blocks = cache.index_select(2, idx)
            host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=cache.is_cuda)
            host.copy_(blocks)
            return [memoryview(host.reshape(-1).view(torch.uint8).numpy())]
        whole = memoryview(cache.reshape(-1).view(torch.uint8).numpy())
        block_bytes = cache[0, 0, 0].numel() * cache.element_size()
        starts, lengths = block_runs(block_ids, block_ids)
        runs = [(block_ids[s], block_ids[s] + n) for s, n in zip(starts.tolist(), lengths.tolist())]
        return [whole[(plane * cache.shape[2] + a) * block_bytes:(plane * cache.shape[2] + b) * block_bytes]
                for plane in range(cache.shape[0] * 2) for a, b in runs]

    def _drop_claims(self, conn: int, why: str) -> None:
        with self._lock:
            for rid, h in list(self._handles.items()):
                if h.claimant == conn:
                    self._retire(rid, TransferDone(rid, f"the decode instance that claimed it is gone ({why})"))

    def _retire(self, rid: str, done: TransferDone) -> None:
        """Under the lock: the handle goes; P hears of it (and frees the blocks) once nobody reads them."""
        h = self._handles.pop(rid)
        self._unclaimed.pop(rid, None)
        if h.readers:
            h.retired = done
            self._draining[rid] = h
        else:
            self._done.append(done)

    def publish(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        assert self.role == "p"
        with self._lock:
            if request_id in self._handles:
                raise ValueError(f"request {request_id!r} is already published")
            self._handles[request_id] = self._unclaimed[request_id] = _Published(list(block_ids), time.monotonic())
        c = self.config
        return KVHandle(c.instance_id, self.name, list(self.address), request_id, list(block_ids), num_tokens,
                        self.layout, c.lease_s)

    def claimed(self) -> set[str]:
        """P: the published requests a D has claimed (for metrics and tests)."""
        with self._lock:
            return {rid for rid, h in self._handles.items() if h.claimant is not None}

    def unpublish(self, request_id: str) -> None:
        with self._lock:
            h = self._handles.pop(request_id, None) or self._draining.get(request_id)
            self._unclaimed.pop(request_id, None)
            while h is not None and h.readers:
                self._no_readers.wait()
            if h is not None and h.retired is not None:    # the engine frees it now: not reported again
                self._done = [d for d in self._done if d.request_id != request_id]
                self._draining.pop(request_id, None)

    # -- D: pulling ------------------------------------------------------------------------------
    def _peer(self, handle: KVHandle) -> "PeerConnection":
        key = (str(handle.address[0]), int(handle.address[1]))
        peer = self._peers.get(key)
        if peer is None or not peer.alive:
            peer = self._peers[key] = PeerConnection(key, self.config, self._results, self._closed, self._buffers)
        return peer

    def check_handle(self, handle: KVHandle, dst_block_ids: list[int] | None = None) -> None:
        """D: ValueError naming the field if this instance cannot pull the handle (into dst_block_ids)."""
        if self._closed.is_set():
            raise RuntimeError("the KV transfer is closed")
        if handle.backend != self.name:
            raise ValueError(f"KVHandle.backend: this decode instance pulls with {self.name!r}, "
                             f"the handle is for {handle.backend!r}")
        if not (isinstance(handle.address, list) and len(handle.address) == 2):
            raise ValueError(f"KVHandle.address must be [host, port], got {handle.address!r}")
        why = self.layout.mismatch(handle.layout)
        if why is not None:
            raise ValueError(why)
        if dst_block_ids is not None and len(dst_block_ids) != len(handle.block_ids):
            raise ValueError(f"KVHandle.block_ids has {len(handle.block_ids)} blocks, {len(dst_block_ids)} "
                             f"were allocated here")

    def claim(self, handle: KVHandle) -> None:
        assert self.role == "d"
        self.check_handle(handle)
        self._peer(handle).submit(ClaimKV(handle.request_id), handle)

    def start_pull(self, handle: KVHandle, dst_block_ids: list[int]) -> None:
        assert self.role == "d"
        self.check_handle(handle, dst_block_ids)
        self._pulls[handle.request_id] = _Pull(handle, list(dst_block_ids))
        self._peer(handle).submit(PullKV(handle.request_id), handle, _blocks_nbytes(self.cache, len(dst_block_ids)))

    def release(self, handle: KVHandle) -> None:
        self._pulls.pop(handle.request_id, None)
        self._confirmed.discard(handle.request_id)
        self._peer(handle).submit(ReleaseKV(handle.request_id), handle)

    def claim_confirmed(self, request_id: str) -> bool:
        """D: P granted the claim (as of the last poll), so the handle's blocks have held its KV throughout.
        A backend whose bytes bypass P (nixl, cuda_ipc) reports a pull done only then."""
        return request_id in self._confirmed

    # -- both ------------------------------------------------------------------------------------
    def poll(self) -> list[TransferDone]:
        if self.role == "p":
            return self._poll_published()
        out = []
        while True:
            try:
                rid, kind, data, error = self._results.get_nowait()
            except queue.Empty:
                break
            if kind == "sent":
                if rid in self._pulls:         # on the wire now: its time limit starts
                    self._pulls[rid].sent = time.monotonic()
            elif kind == "claim" and error is None:
                self._confirmed.add(rid)
            elif kind == "claim":
                self._confirmed.discard(rid)
                self._pulls.pop(rid, None)
                out.append(TransferDone(rid, error))
            elif kind == "pull":
                pull = self._pulls.pop(rid, None)
                if pull is not None and error is None:
                    self._write_blocks(pull, data)
                elif data is not None:
                    self._buffers.give(data)
                if pull is not None:
                    out.append(TransferDone(rid, error))
        now = time.monotonic()
        for rid, pull in list(self._pulls.items()):
            if pull.sent is not None and now - pull.sent > self.config.timeout_s:
                del self._pulls[rid]     # a late answer is dropped: only poll() writes blocks
                out.append(TransferDone(rid, f"pulling {len(pull.dst_block_ids)} KV blocks from prefill instance "
                                             f"{pull.handle.instance_id} took over {self.config.timeout_s:g} s"))
        return out

    def _poll_published(self) -> list[TransferDone]:
        now, lease = time.monotonic(), self.config.lease_s
        with self._lock:     # the engine's thread polls often: look at the expired only, not every handle
            expired = []
            for rid, h in self._unclaimed.items():
                if now - h.since <= lease:
                    break
                expired.append(rid)
            for rid in expired:
                self._retire(rid, TransferDone(rid, f"no decode instance claimed it within the lease ({lease:g} s)"))
            out, self._done = self._done, []
        return out

    def _write_blocks(self, pull: _Pull, data: torch.Tensor) -> None:
        """Copy a pull's buffer into its blocks (the engine's thread: queued on its stream), then reuse the buffer."""
        cache = self.cache
        shape = (cache.shape[0], 2, len(pull.dst_block_ids)) + tuple(cache.shape[3:])
        blocks = data[:_blocks_nbytes(cache, len(pull.dst_block_ids))].view(cache.dtype).view(shape)
        idx = torch.tensor(pull.dst_block_ids, dtype=torch.long, device=cache.device)
        if cache.is_cuda:
            cache.index_copy_(2, idx, blocks.to(cache.device, non_blocking=True))
            done = torch.cuda.Event()
            done.record()
            self._buffers.give(data, done)
        else:
            cache.index_copy_(2, idx, blocks)
            self._buffers.give(data)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._server is not None:
            self._server.close()
        for peer in self._peers.values():
            peer.close()
        with self._lock:
            self._handles.clear()
            self._unclaimed.clear()
            for sock in self._conns:     # their threads see the socket fail and end
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for rid in self._pulls:          # reported failed by the next poll; nothing writes their blocks
            self._results.put((rid, "pull", None, "the KV transfer was closed"))
