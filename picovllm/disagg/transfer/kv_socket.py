"""A fleet's KV socket: frames, the fleet's mutual HMAC handshake, and D's connection to one P instance.

Frames: a length-prefixed JSON message (picovllm.disagg.messages), optionally followed by raw bytes
whose length the message states (a pull's KVReply.nbytes). The handshake: the server sends a
KVAuthChallenge (its nonce, instance id and lease), the client answers with its proof over both
nonces and its own nonce, the server answers with its proof or a refusal and closes. Neither side
reads or writes anything else for a peer that has not proved the secret.
"""
from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
from collections import deque

import torch

from picovllm.disagg.auth import answer_challenge, challenge_peer
from picovllm.disagg.messages import ClaimKV, Heartbeat, KVHandle, KVReply, PullKV, ReleaseKV, decode, encode

logger = logging.getLogger("picovllm.kv")

_LEN = struct.Struct("!I")
_MAX_HEADER = 1 << 20


# -- frames --------------------------------------------------------------------------------------
def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return buf


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Block in the kernel, for at most `seconds` a call (SO_RCVTIMEO / SO_SNDTIMEO; a call that times out raises
    OSError), instead of Python's timeout. Python's puts the socket in non-blocking mode and returns to the
    interpreter for every chunk the kernel has, so a thread moving 58 MB takes the GIL hundreds of times; when the
    engine's loop holds it (a served instance), each wait is up to the 5 ms switch interval and a pull crawled at
    0.5 GB/s (benchmarks/fleet_pull.py --busy-decode). Blocking, one call moves the whole payload without the GIL."""
    sock.settimeout(None)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill view from the socket (a pull's KV goes into a reused host buffer: no new memory to fault in); on a
    blocking socket one call waits for all of it (MSG_WAITALL)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k


_IOV_BATCH = 512          # buffers per sendmsg call (the kernel's IOV_MAX is 1024)


def send_buffers(sock: socket.socket, buffers: list[memoryview]) -> None:
    """sendall over several buffers without joining them (scatter-gather): a pull's runs of blocks go straight
    from the cache. A call may send part of its buffers; the rest is sent by the next."""
    pending = [b.cast("B") for b in buffers if b.nbytes]
    while pending:
        sent = sock.sendmsg(pending[:_IOV_BATCH])
        i = 0
        while i < len(pending) and sent >= pending[i].nbytes:
            sent -= pending[i].nbytes
            i += 1
        pending = pending[i:]
        if sent:
            pending[0] = pending[0][sent:]


def send_frame(sock: socket.socket, msg, payload: list[memoryview] | None = None) -> None:
    data = encode(msg)
    sock.sendall(_LEN.pack(len(data)) + data)
    if payload:
        send_buffers(sock, payload)


def recv_frame(sock: socket.socket):
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > _MAX_HEADER:
        raise ConnectionError(f"a {n}-byte message header: not a picovllm KV peer")
    return decode(bytes(recv_exact(sock, n)))


def authenticate_client(sock: socket.socket, config) -> None:
    """The KV server's half of the handshake (config: the server's PullConfig); AuthError if the peer fails."""
    challenge_peer(lambda msg: send_frame(sock, msg), lambda: recv_frame(sock), config.secret,
                   config.instance_id, config.lease_s)


class HostBuffers:
    """Host buffers that pulled KV lands in, reused: a fresh buffer of a request's KV (58 MB for 512 tokens of a
    Qwen3-0.6B) costs more to fault in than the socket takes to fill it. Pinned when the cache is on a GPU; a
    buffer given back with a CUDA event is not taken again before the copy out of it is done."""

    def __init__(self, pinned: bool, keep: int = 4, keep_bytes: int = 2 << 30) -> None:
        self.pinned, self.keep, self.keep_bytes = pinned, keep, keep_bytes
        self._free: list[tuple[torch.Tensor, object]] = []     # (uint8 buffer, event or None)
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least nbytes (its contents are whatever was there)."""
        with self._lock:
            fits = [i for i, (buf, done) in enumerate(self._free)
                    if buf.numel() >= nbytes and (done is None or done.query())]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i][0].numel()))[0]
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def give(self, buf: torch.Tensor, event=None) -> None:
        with self._lock:
            self._free.append((buf, event))
            self._free.sort(key=lambda e: -e[0].numel())        # keep the largest within the limits
            total, kept = 0, []
            for e in self._free:
                if len(kept) < self.keep and total + e[0].numel() <= self.keep_bytes:
                    kept.append(e)
                    total += e[0].numel()
            self._free = kept


class PeerConnection:
    """D's connection to one P instance: a thread that runs its claims, pulls and releases one at a time,
    connecting (and authenticating) when it has one to run, and keeping the link audible when idle.

    Claims and releases go before the pulls queued (each in the order sent): a pull moves a request's whole KV
    (~58 MB for 512 tokens of a Qwen3-0.6B), so behind a queue of them a claim would wait past P's lease and P would
    free the KV (BENCHMARKS.md, fourteenth session). A request's pull is only sent after its claim, and a release
    that passes its own pull (an abort) leaves the pull an error D ignores."""

    def __init__(self, address: tuple[str, int], config, results: queue.SimpleQueue,
                 closed: threading.Event, buffers: "HostBuffers | None" = None) -> None:
        self.address, self.config, self.results, self._closed = address, config, results, closed
        self.buffers = buffers or HostBuffers(pinned=False)
        self._cond = threading.Condition()
        self._control: deque = deque()      # (msg, handle, nbytes) of claims and releases
        self._pulls: deque = deque()
        self._closing = False
        self.sock: socket.socket | None = None
        self.claimed: set[str] = set()               # claims P granted on this socket (dropped with it)
        self.heartbeat_s = config.lease_s / 4        # and at most a quarter of the server's lease, once known
        self.alive = True
        self._thread = threading.Thread(target=self._run, name="picovllm-kv-pull", daemon=True)
        self._thread.start()

    def submit(self, msg, handle: KVHandle, nbytes: int = 0) -> None:
        with self._cond:
            (self._pulls if isinstance(msg, PullKV) else self._control).append((msg, handle, nbytes))
            self._cond.notify()

    def close(self) -> None:
        """End the thread once what was submitted has run."""
        with self._cond:
            self._closing = True
            self._cond.notify()

    def _next(self):
        """The next job (claims and releases first), None to end, or () after heartbeat_s with none."""
        with self._cond:
            if not (self._control or self._pulls or self._closing):
                self._cond.wait(self.heartbeat_s)
            if self._control:
                return self._control.popleft()
            if self._pulls:
                return self._pulls.popleft()
            return None if self._closing else ()

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                job = self._next()
                if job is None:
                    return
                if job:
                    self._do(*job)
                else:
                    self._heartbeat()
        finally:
            self.alive = False
            self._disconnect()

    def _do(self, msg, handle: KVHandle, nbytes: int) -> None:
        kind = {ClaimKV: "claim", PullKV: "pull", ReleaseKV: "release"}[type(msg)]
        data = error = None
        broken = False
        try:
            if self.sock is None:
                self._connect(handle.instance_id)
            send_frame(self.sock, msg)
            if kind == "pull":                   # its time limit runs from here, not from the queue
                self.results.put((msg.request_id, "sent", None, None))
            reply = recv_frame(self.sock)
            if not isinstance(reply, KVReply) or reply.request_id != msg.request_id:
                raise ConnectionError(f"expected the KVReply for {msg.request_id!r}, got {reply!r}")
            error = reply.error
            if reply.nbytes and (kind != "pull" or reply.nbytes != nbytes):    # and the stream is out of step
                raise ConnectionError(f"prefill instance {handle.instance_id} sent {reply.nbytes} bytes of KV, "
                                      f"expected {nbytes if kind == 'pull' else 0}")
            if reply.nbytes:
                data = self.buffers.take(nbytes)
                recv_into_exact(self.sock, memoryview(data[:nbytes].numpy()))
            elif kind == "pull" and error is None:
                error = f"prefill instance {handle.instance_id} sent no KV, expected {nbytes} bytes"
        except (OSError, ConnectionError, ValueError, KeyError, TypeError) as e:
            broken = True
            error = (f"prefill instance {handle.instance_id} at {self.address[0]}:{self.address[1]} "
                     f"failed during {kind}: {type(e).__name__}: {e}")
        if data is not None and (error is not None or kind != "pull"):
            self.buffers.give(data)
            data = None
        if kind == "release":
            self.claimed.discard(msg.request_id)
            if error is not None:
                logger.info("KV release of %s not delivered (its lease frees it): %s", msg.request_id, error)
        elif kind == "claim" and error is None:
            self.claimed.add(msg.request_id)
        self.results.put((msg.request_id, kind, data, error))
        if broken:      # after this job's own error, so that it is the one its request reports
            self._disconnect()

    def _connect(self, instance_id: str) -> None:
        c = self.config
        sock = socket.create_connection(self.address, timeout=c.connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            challenge = answer_challenge(lambda msg: send_frame(sock, msg), lambda: recv_frame(sock), c.secret)
            if isinstance(challenge.lease_s, (int, float)) and challenge.lease_s > 0:
                self.heartbeat_s = min(self.config.lease_s, challenge.lease_s) / 4
            if challenge.instance_id != instance_id:
                raise ConnectionError(f"the KV server is instance {challenge.instance_id!r}, not {instance_id!r} "
                                      f"(restarted? its handles are gone)")
            set_io_timeout(sock, c.timeout_s)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def _heartbeat(self) -> None:
        if self.sock is None:
            return
        try:
            send_frame(self.sock, Heartbeat())
        except OSError:
            self._disconnect()

    def _disconnect(self) -> None:
        """Drop the socket. P drops this connection's claims with it: each is reported lost."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        for rid in self.claimed:
            self.results.put((rid, "claim", None, f"lost the connection to the prefill instance at "
                                                  f"{self.address[0]}:{self.address[1]}, and its claim with it"))
        self.claimed.clear()
