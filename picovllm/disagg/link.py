"""One engine's end of a P<->D link: the control channel, the transfer backend, the peer's liveness."""
from __future__ import annotations

from typing import Any

import torch

from picovllm.disagg.channel import Channel, PeerGone
from picovllm.disagg.messages import Hello, KVLayout
from picovllm.disagg.transfer import KVTransfer, TransferConfig, make_transfer
from picovllm.engine.kv_scales import scales_digest
from picovllm.engine.tp_kv import FullHeadKV


def cache_layout(runner) -> KVLayout:
    """The KVLayout an engine's rank 0 speaks on the link.

    TP=1: its own cache. Under tensor parallelism: full heads, whatever each rank holds, since the
    link moves blocks gathered from (or scattered to) every rank by picovllm.engine.tp_kv.
    """
    cache = runner.kv_cache
    tp = getattr(runner, "tp", None)
    size = tp.size if tp is not None else 1
    total = runner.model_config.num_key_value_heads
    return KVLayout(num_layers=cache.shape[0], num_kv_heads=total if size > 1 else cache.shape[4],
                    head_dim=cache.shape[5], block_size=cache.shape[3], num_blocks=cache.shape[2],
                    dtype=str(cache.dtype).removeprefix("torch."), total_kv_heads=total,
                    kv_head_start=0, tp_rank=tp.rank if tp is not None else 0, tp_size=size,
                    kv_scales=_scales_digest(runner))


def _scales_digest(runner) -> str:
    scales = getattr(runner, "kv_scales", None)
    return "" if scales is None else scales_digest(*scales)


def full_head_io(runner) -> FullHeadKV | None:
    """How a TP engine's transfer reads and writes full-head blocks (None at TP=1: the cache itself)."""
    tp = getattr(runner, "tp", None)
    return FullHeadKV(runner) if tp is not None and tp.size > 1 else None


class PeerLink:
    def __init__(self, role: str, channel: Channel, transfer: KVTransfer, config: TransferConfig,
                 peer: Hello) -> None:
        self.role, self.channel, self.transfer, self.config, self.peer = role, channel, transfer, config, peer
        self.gone: str | None = None       # why the peer is gone (died, went silent, closed on us)
        self.closed = False

    @classmethod
    def open(cls, role: str, channel: Channel, cache: torch.Tensor, layout: KVLayout, config: TransferConfig,
             session: int, kv_io: FullHeadKV | None = None) -> "PeerLink":
        """Handshake on a connected channel; blocks up to config.connect_timeout_s. Raises ConnectionError.

        P speaks first; D checks the layouts match and answers, with an error if they do not.
        kv_io: a TP engine's full-head access to its ranks' blocks (full_head_io).
        """
        transfer = make_transfer(role, cache, layout, config, kv_io)
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
    if (p.layout.tp_size != 1 or d.layout.tp_size != 1) and d.backend == "cuda_ipc":
        return (f"KVLayout.tp_size: backend 'cuda_ipc' maps the peer's one cache, so both engines must run TP=1 "
                f"(prefill TP={p.layout.tp_size}, decode TP={d.layout.tp_size}); use 'torch_dist'")
    return d.layout.mismatch(p.layout)
