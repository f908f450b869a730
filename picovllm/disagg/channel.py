"""A control channel: typed messages (picovllm.disagg.messages) framed over a TCP socket.

Every link in a disaggregated run is one of these: driver <-> engine worker and prefill engine <->
decode engine. TCP works on one host and across hosts, and a dead peer shows up at once as
end-of-file; a hung one shows up as silence, which a lease on `last_heard` catches (the heartbeat
thread keeps a live but busy peer audible). Given the P/D secret, a channel starts with the mutual
HMAC handshake of picovllm.disagg.auth: Channel.connect proves it, Listener.accept demands it and
refuses (and keeps waiting past) a peer that fails.
"""
from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import time
from typing import Any

from picovllm.disagg.auth import AuthError, FleetSecret, answer_challenge, challenge_peer
from picovllm.disagg.messages import Heartbeat, decode, encode

_HEADER = struct.Struct("!I")
HANDSHAKE_TIMEOUT_S = 10.0      # a connected peer has this long to answer the challenge
logger = logging.getLogger("picovllm.disagg")


class PeerGone(ConnectionError):
    """The other end of a channel closed it, died, or stopped reading."""


class Channel:
    """Length-prefixed JSON messages over a connected socket.

    send() may be called from any thread (the heartbeat thread does); recv() from one thread only.
    """

    def __init__(self, sock: socket.socket, send_timeout_s: float = 30.0) -> None:
        sock.settimeout(send_timeout_s)      # a peer that stops reading cannot block us for longer
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # small messages go out at once
        self.sock = sock
        self._buf = bytearray()
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._beat_s = float("inf")
        self._beat_now = threading.Event()      # set: beat at once (a shorter interval), or stop (close)
        self.last_heard = time.monotonic()
        self.closed = False

    @classmethod
    def connect(cls, address: tuple[str, int] | list, timeout_s: float = 30.0,
                secret: FleetSecret | None = None) -> "Channel":
        """Connect; with a secret, prove it and check the listener's proof (AuthError if either fails)."""
        try:
            sock = socket.create_connection((address[0], int(address[1])), timeout=timeout_s)
        except OSError as e:
            raise PeerGone(f"cannot connect to {address[0]}:{address[1]}: {e}") from e
        channel = cls(sock)
        if secret is not None:
            try:
                answer_challenge(channel.send, lambda: channel._expect(HANDSHAKE_TIMEOUT_S), secret)
            except AuthError as e:
                channel.close()
                raise AuthError(f"{address[0]}:{address[1]} {e}") from None
            except BaseException:
                channel.close()
                raise
        return channel

    def _expect(self, timeout_s: float) -> Any:
        msg = self.recv(timeout_s)
        if msg is None:
            raise AuthError(f"no answer within {timeout_s:g} s during the handshake")
        return msg

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: Any) -> None:
        payload = encode(msg)
        with self._send_lock:
            if self.closed:
                raise PeerGone("channel is closed")
            try:
                self.sock.sendall(_HEADER.pack(len(payload)) + payload)
            except (OSError, socket.timeout) as e:
                raise PeerGone(f"send failed: {e}") from e

    def recv(self, timeout_s: float = 0.0) -> Any | None:
        """The next message, waiting up to timeout_s; None if none came. Raises PeerGone at end-of-file."""
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self._pop()
            if msg is not None:
                if isinstance(msg, Heartbeat):
                    continue
                return msg
            if self.closed:
                raise PeerGone("channel is closed")
            left = deadline - time.monotonic()
            try:
                ready, _, _ = select.select([self.sock], [], [], max(0.0, left))
                if not ready:
                    return None
                chunk = self.sock.recv(1 << 20)
            except (OSError, ValueError) as e:
                raise PeerGone(f"receive failed: {e}") from e
            if not chunk:
                raise PeerGone("peer closed the connection")
            self._buf += chunk
            self.last_heard = time.monotonic()

    def recv_all(self) -> list[Any]:
        """Every message that has already arrived, without waiting.

        Raises PeerGone only when there is nothing left to return: the messages a peer sent
        right before closing are delivered first, and the next call raises.
        """
        out = []
        try:
            while (msg := self.recv(0.0)) is not None:
                out.append(msg)
        except PeerGone:
            if not out:
                raise
        return out

    def _pop(self) -> Any | None:
        if len(self._buf) < _HEADER.size:
            return None
        (n,) = _HEADER.unpack_from(self._buf)
        if len(self._buf) < _HEADER.size + n:
            return None
        payload = bytes(self._buf[_HEADER.size:_HEADER.size + n])
        del self._buf[:_HEADER.size + n]
        return decode(payload)

    def start_heartbeat(self, interval_s: float) -> None:
        """Send a Heartbeat every interval_s from a daemon thread, so a busy peer still looks alive. Called again
        with a shorter interval, the one thread beats at once and at that interval from then on."""
        if interval_s >= self._beat_s:
            return
        self._beat_s = interval_s
        if self._heartbeat is not None:
            self._beat_now.set()
            return

        def beat() -> None:
            while True:
                self._beat_now.wait(self._beat_s)
                if self._stop.is_set():
                    return
                self._beat_now.clear()
                try:
                    self.send(Heartbeat())
                except PeerGone:
                    return
        self._heartbeat = threading.Thread(target=beat, name="picovllm-heartbeat", daemon=True)
        self._heartbeat.start()

    def silent_for(self) -> float:
        return time.monotonic() - self.last_heard

    def close(self, linger_s: float = 2.0) -> None:
        """Idempotent and non-blocking. Half-closes now; a daemon thread finishes the close.

        A plain close() with unread bytes in our buffer, or bytes arriving after it, makes the
        kernel answer with RST, and an RST makes the peer's kernel drop what it has not read yet:
        our last messages (an Ack, a Bye) would be lost. So the socket is only half-closed, and
        read (and discarded) until the peer closes its end too, or for at most linger_s.
        """
        if self.closed:
            return
        self._stop.set()
        self._beat_now.set()
        with self._send_lock:
            self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.sock.close()
            return
        threading.Thread(target=_linger_then_close, args=(self.sock, linger_s), name="picovllm-close",
                         daemon=True).start()


def _linger_then_close(sock: socket.socket, linger_s: float) -> None:
    deadline = time.monotonic() + linger_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([sock], [], [], left)
            if ready and not sock.recv(1 << 16):
                break
    except (OSError, ValueError):
        pass
    sock.close()


class Listener:
    """Accepts channels on a TCP port (port 0: any free one). `address` is what peers connect to:
    [advertise_host or host, port] (see picovllm.disagg.hosts). With a secret, only peers that prove
    it are returned; the others are refused (told why, logged, closed) and the wait goes on."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 secret: FleetSecret | None = None) -> None:
        self.sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.address = [advertise_host or host, self.sock.getsockname()[1]]
        self.secret = secret
        self.refused = 0            # peers turned away so far

    def accept(self, timeout_s: float) -> Channel:
        deadline = time.monotonic() + timeout_s
        while True:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"no peer connected to {self.address[0]}:{self.address[1]} "
                                   f"within {timeout_s:.0f} s")
            sock, peer = self.sock.accept()
            channel = Channel(sock)
            if self.secret is None:
                return channel
            try:
                challenge_peer(channel.send, lambda: channel._expect(HANDSHAKE_TIMEOUT_S), self.secret)
                return channel
            except (AuthError, PeerGone, ValueError) as e:    # ValueError: not our messages at all
                self.refused += 1
                logger.warning("refused a peer from %s on %s:%d: %s", peer[0], self.address[0], self.address[1], e)
                channel.close()

    def close(self) -> None:
        self.sock.close()
