"""What the two ends of the handover protocol share: a KVConnector whose peer is another engine."""
from __future__ import annotations

from typing import ClassVar

from picovllm.disagg.channel import Channel
from picovllm.disagg.link import PeerLink, cache_layout, full_head_io
from picovllm.disagg.transfer import TransferConfig
from picovllm.engine.kv_connector import ConnectorReport, KVConnector


class PeerConnector(KVConnector):
    """One engine's end of a P<->D link (PrefillConnector, DecodeConnector). A session starts at
    connect(); the same connector, engine, weights and cache may serve many sessions in turn."""

    role: ClassVar[str]

    def __init__(self) -> None:
        self.link: PeerLink | None = None
        self.block_size = 0                  # the engine's, known at connect()
        # What happened outside poll() (a transfer that failed to start, one waited for in sync
        # mode): handed to the engine by the next poll().
        self._report = ConnectorReport()

    def connect(self, channel: Channel, transfer: TransferConfig, session: int, runner) -> None:
        """Handshake with the peer on `channel` (blocks up to transfer.connect_timeout_s).

        runner: the engine's ModelRunner, whose KV cache the transfer backend reads or writes."""
        link = PeerLink.open(self.role, channel, runner.kv_cache, cache_layout(runner), transfer, session,
                             full_head_io(runner))
        self.link = link
        self.block_size = runner.block_size
        self._report = ConnectorReport()
        self.new_session()

    def new_session(self) -> None:
        """Reset what one session's lifecycle sets (closing, end of stream)."""

    def shutdown(self) -> None:
        if self.link is not None:
            self.link.close()      # the peer sees us leave

    def take_report(self) -> ConnectorReport:
        assert self.link is not None, f"connect() the {self.role} engine to its peer first"
        report, self._report = self._report, ConnectorReport()
        return report
