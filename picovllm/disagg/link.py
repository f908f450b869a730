"""One engine's end of a P<->D link: the control channel, the transfer backend, the peer's liveness."""
from __future__ import annotations

from typing import Any

import torch

from picovllm.disagg.channel import Channel, PeerGone
from picovllm.disagg.messages import Hello, KVLayout
from picovllm.disagg.transfer import KVTransfer, TransferConfig, make_transfer


def cache_layout(runner) -> KVLayout:
    """The KVLayout of a ModelRunner's cache (one TP rank's heads under tensor parallelism)."""
    cache = runner.kv_cache
    tp = getattr(runner, "tp", None)
    rank = tp.rank if tp is not None else 0
    size = tp.size if tp is not None else 1
    return KVLayout(num_layers=cache.shape[0], num_kv_heads=cache.shape[4], head_dim=cache.shape[5],
                    block_size=cache.shape[3], num_blocks=cache.shape[2],
                    dtype=str(cache.dtype).removeprefix("torch."),
                    total_kv_heads=runner.model_config.num_key_value_heads,
                    kv_head_start=rank * cache.shape[4], tp_rank=rank, tp_size=size)


class PeerLink:
    def __init__(self, role: str, channel: Channel, transfer: KVTransfer, config: TransferConfig,
                 peer: Hello) -> None:
        self.role, self.channel, self.transfer, self.config, self.peer = role, channel, transfer, config, peer
        self.gone: str | None = None       # why the peer is gone (died, went silent, closed on us)
        self.closed = False

    @classmethod
    def open(cls, role: str, channel: Channel, cache: torch.Tensor, layout: KVLayout, config: TransferConfig,
             session: int) -> "PeerLink":
        """Handshake on a connected channel; blocks up to config.connect_timeout_s. Raises ConnectionError.

        P speaks first; D checks the layouts match and answers, with an error if they do not.
        """
        transfer = make_transfer(role, cache, layout, config)
        try:
            mine = Hello(role, session, config.backend, layout, transfer.local_info())
            if role == "p":
                channel.send(mine)
                peer = _expect_hello(channel, config.connect_timeout_s)
                if peer.error:
                    raise ConnectionError(f"the decode engine refused the link: {peer.error}")
            else:
                peer = _expect_hello(channel, config.connect_timeout_s)
                mine.error = _mismatch(peer, mine)
                channel.send(mine)
                if mine.error:
                    raise ConnectionError(f"refused the prefill engine's link: {mine.error}")
            transfer.connect(peer)
        except PeerGone as e:
            transfer.close()
            raise ConnectionError(f"lost the peer during the handshake: {e}") from e
        except BaseException:
            transfer.close()
            raise
        channel.start_heartbeat(config.lease_s / 4)
        return cls(role, channel, transfer, config, peer)

    @property
    def alive(self) -> bool:
        return self.gone is None and not self.closed

    def send(self, msg: Any) -> None:
        """Send, or note the peer gone (the engine sees `gone` and fails what it holds)."""
        if not self.alive:
            return
        try:
            self.channel.send(msg)
        except PeerGone as e:
            self.gone = str(e)

    def receive(self) -> list[Any]:
        """Every message already in, without waiting. Also where a dead or silent peer is noticed."""
        if not self.alive:
            return []
        try:
            msgs = self.channel.recv_all()
        except PeerGone as e:
            self.gone = str(e)
            return []
        if self.channel.silent_for() > self.config.lease_s:
            self.gone = f"silent for {self.channel.silent_for():.1f} s (lease {self.config.lease_s:g} s)"
        return msgs

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.transfer.close()
        self.channel.close()


def _expect_hello(channel: Channel, timeout_s: float) -> Hello:
    msg = channel.recv(timeout_s)
    if msg is None:
        raise ConnectionError(f"no Hello from the peer within {timeout_s:g} s")
    if not isinstance(msg, Hello):
        raise ConnectionError(f"expected Hello, got {type(msg).__name__}")
    return msg


def _mismatch(p: Hello, d: Hello) -> str | None:
    if p.role != "p":
        return f"Hello.role: expected a prefill engine ('p'), got {p.role!r}"
    if p.backend != d.backend:
        return f"Hello.backend differs: decode side uses {d.backend!r}, prefill side {p.backend!r}"
    if p.layout.tp_size != 1 or d.layout.tp_size != 1:
        return "KVLayout.tp_size: tensor-parallel engines cannot be linked yet (heads would need re-splitting)"
    return d.layout.mismatch(p.layout)
