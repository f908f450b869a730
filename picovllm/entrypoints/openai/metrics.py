"""Prometheus metrics for one server, in its own registry (never the process-global one).

Several API server processes (`serve --api-server-count`, api_workers.py) each count their own requests into files
under $PROMETHEUS_MULTIPROC_DIR (prometheus_client's multiprocess mode, chosen when it is imported: the parent sets
the variable before it spawns them); /metrics, in whichever process answers it, adds up every process's files.
One of them observes the engine's stats, so its gauges are taken as the processes' maximum.

Speculative decoding's counters carry vLLM's names (vllm:spec_decode_num_drafts_total, ..._num_draft_tokens_total,
..._num_accepted_tokens_total, ..._num_accepted_tokens_per_pos_total{position}: what vLLM's dashboards and
acceptance-rate queries read) and, as in vLLM, exist only on
a server whose engine has a speculative_config.
"""
from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from picovllm.outputs import RequestOutput

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
OUTCOMES = ("stop", "length", "abort", "error", "rejected")


class ServerMetrics:
    """Written by the engine loop thread (engine stats, finished requests) and the HTTP layer (rejections)."""

    def __init__(self, model_name: str, speculative: bool = False) -> None:
        """speculative: the engine has a speculative_config (its counters are exported)."""
        self.registry = r = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        ln = list(labels)

        def counter(name, doc, extra=()):
            return Counter(name, doc, ln + list(extra), registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, ln, registry=r, multiprocess_mode="max").labels(**labels)

        def hist(name, doc):
            return Histogram(name, doc, ln, buckets=LATENCY_BUCKETS, registry=r).labels(**labels)

        requests = counter("picovllm:requests", "Requests by outcome (stop/length/abort/error/rejected)", ["outcome"])
        self.outcomes = {o: requests.labels(outcome=o, **labels) for o in OUTCOMES}
        self.ttft = hist("picovllm:time_to_first_token_seconds", "Time from arrival to the first output token")
        self.itl = hist("picovllm:inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = hist("picovllm:e2e_request_latency_seconds", "Time from arrival to the last output token")
        self.running = gauge("picovllm:num_requests_running", "Requests holding KV blocks (prefill or decode)")
        self.waiting = gauge("picovllm:num_requests_waiting", "Requests queued for admission")
        self.kv_usage = gauge("picovllm:kv_cache_usage_perc", "Fraction of KV blocks in use, 0 to 1")
        self.kv_free = gauge("picovllm:kv_cache_free_blocks", "Free KV blocks (cached prefix blocks count as free)")
        self.kv_total = gauge("picovllm:kv_cache_num_blocks", "KV blocks in the cache")
        self.tokens = {k: counter(f"picovllm:{k}", doc).labels(**labels) for k, doc in [
            ("prefill_tokens", "Prompt tokens computed (prefill)"),
            ("decode_tokens", "Tokens decoded (a decode's token, and the speculative drafts kept)"),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache")]}
        if speculative:
            self.tokens.update({k: counter(f"vllm:spec_decode_num_{k}", doc).labels(**labels) for k, doc in [
                ("drafts", "Speculative steps of a request: its last token fed with drafted tokens"),
                ("draft_tokens", "Drafted tokens fed"),
                ("accepted_tokens", "Drafted tokens kept (the model sampled each one)")]})
        self.per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                               "Drafted tokens kept, by their position among a step's drafts", ["position"]) \
            if speculative else None
        self._labels = labels
        self._last = {k: 0 for k in self.tokens}
        self._last_pos: list[int] = []

    def observe_engine(self, stats) -> None:
        """Engine-wide state after a loop iteration (an EngineStats)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_free.set(stats.num_free_blocks)
        self.kv_total.set(stats.num_blocks)
        self.kv_usage.set(1.0 - stats.num_free_blocks / max(stats.num_blocks, 1))
        now = {"prefill_tokens": stats.prefill_tokens, "decode_tokens": stats.decode_tokens,
               "prefix_cache_queries": stats.prefix_queried_tokens, "prefix_cache_hits": stats.prefix_hit_tokens,
               "drafts": stats.drafts, "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens}
        for k, counter in self.tokens.items():    # the engine keeps totals; counters take the increments
            if now[k] > self._last[k]:
                counter.inc(now[k] - self._last[k])
                self._last[k] = now[k]
        if self.per_pos is not None:
            self._last_pos += [0] * (len(stats.accepted_per_pos) - len(self._last_pos))
            for pos, total in enumerate(stats.accepted_per_pos):
                if total > self._last_pos[pos] or not self._last_pos[pos]:   # every position shows, at 0 too
                    self.per_pos.labels(position=str(pos), **self._labels).inc(total - self._last_pos[pos])
                    self._last_pos[pos] = total

    def observe_finished(self, out: RequestOutput) -> None:
        reason = out.outputs[0].finish_reason if out.outputs else "error"
        self.count_outcome(reason if reason in self.outcomes else "error")
        m = out.metrics
        if m is None or reason not in ("stop", "length"):
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.itls:
            self.itl.observe(gap)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def count_outcome(self, outcome: str) -> None:
        self.outcomes[outcome].inc()

    def render(self) -> tuple[bytes, str]:
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        every_process = CollectorRegistry()
        MultiProcessCollector(every_process)
        return generate_latest(every_process), CONTENT_TYPE_LATEST
