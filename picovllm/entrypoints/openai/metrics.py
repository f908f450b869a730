"""Prometheus metrics for one server, in its own registry (never the process-global one).

Several API server processes (`serve --api-server-count`, api_workers.py) each count their own requests into files
under $PROMETHEUS_MULTIPROC_DIR (prometheus_client's multiprocess mode, chosen when it is imported: the parent sets
the variable before it spawns them); /metrics, in whichever process answers it, adds up every process's files.
One of them observes the engine's stats, so its gauges are taken as the processes' maximum.

picovllm's series (picovllm:*) go with vLLM's (VLLMSeries: vllm:*, with vLLM's names, label, buckets and meanings),
which dashboards and alerts written for vLLM read; README's metrics paragraph says where their values differ.
Speculative decoding's counters carry vLLM's names only (vllm:spec_decode_num_drafts_total, ..._num_draft_tokens_total,
..._num_accepted_tokens_total, ..._num_accepted_tokens_per_pos_total{position}: what vLLM's acceptance-rate queries
read) and, as in vLLM, exist only on a server whose engine has a speculative_config.
"""
from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from picovllm.outputs import RequestOutput

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
OUTCOMES = ("stop", "length", "abort", "error", "rejected")
# vLLM's (vllm/v1/metrics/loggers.py), so that its dashboards' quantiles and heatmaps read the same buckets
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's 1-2-5 series stops at max_model_len, which the metrics do not know: this one goes on to a million tokens
VLLM_TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5) if m * 10 ** e <= 10 ** 6)
VLLM_REASONS = ("stop", "length", "abort", "error")    # vLLM's finished_reason values a request of ours ends with


class _Series:
    """Makes one registry's metrics, labelled with the server's model_name."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry, self.labels = registry, {"model_name": model_name}

    def family(self, name: str, doc: str, extra: list[str]) -> Counter:
        """A counter with more labels than model_name (children made by the caller)."""
        return Counter(name, doc, ["model_name", *extra], registry=self.registry)

    def counter(self, name: str, doc: str):
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(**self.labels)

    def gauge(self, name: str, doc: str):
        return Gauge(name, doc, ["model_name"], registry=self.registry, multiprocess_mode="max").labels(**self.labels)

    def hist(self, name: str, doc: str, buckets=LATENCY_BUCKETS):
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(**self.labels)


class VLLMSeries:
    """vLLM's request and engine series. Its engine-wide counters take their increments from ServerMetrics (the
    engine's totals), its per-request ones are observed here, from a request's final output: when it ends (vLLM
    counts tokens and observes latencies per engine step as they come; the totals and samples are the same)."""

    def __init__(self, make: _Series) -> None:
        self.running = make.gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = make.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = make.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.engine = {k: make.counter(f"vllm:{k}", doc) for k, doc in [
            ("num_preemptions", "Cumulative number of preemption from the engine."),
            ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")]}
        self.prompt_tokens = make.counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = make.counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = make.family("vllm:request_success", "Count of successfully processed requests.", ["finished_reason"])
        self.success = {r: success.labels(finished_reason=r, **make.labels) for r in VLLM_REASONS}
        self.prompt_len = make.hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                    VLLM_TOKEN_BUCKETS)
        self.generation_len = make.hist("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                        VLLM_TOKEN_BUCKETS)
        self.ttft = make.hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              VLLM_TTFT_BUCKETS)
        self.itl = make.hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             VLLM_ITL_BUCKETS)
        self.e2e = make.hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             VLLM_REQUEST_BUCKETS)
        self.queue = make.hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", VLLM_REQUEST_BUCKETS)

    def observe_finished(self, out: RequestOutput) -> None:
        """Whatever its end (its count by reason is ServerMetrics.count_outcome's)."""
        prompt, generated = len(out.prompt_token_ids), len(out.outputs[0].token_ids) if out.outputs else 0
        self.prompt_len.observe(prompt)
        self.generation_len.observe(generated)
        self.generation_tokens.inc(generated)
        if generated or out.embedding is not None:    # its prompt was computed: all of it counts, cached or not
            self.prompt_tokens.inc(prompt)
        m = out.metrics
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for a, b in zip(m.token_times, m.token_times[1:]):
            if b > a:       # one gap a step, as vLLM's: a speculative step's tokens share that step's time
                self.itl.observe(b - a)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)


class ServerMetrics:
    """Written where the engine's outputs arrive (engine stats, finished and failed requests: the engine loop's
    thread, or the thread reading the engine process's pipe) and by the HTTP layer (rejections)."""

    def __init__(self, model_name: str, speculative: bool = False) -> None:
        """speculative: the engine has a speculative_config (its counters are exported)."""
        self.registry = CollectorRegistry(auto_describe=True)
        make = _Series(self.registry, model_name)
        requests = make.family("picovllm:requests", "Requests by outcome (stop/length/abort/error/rejected)",
                               ["outcome"])
        self.outcomes = {o: requests.labels(outcome=o, **make.labels) for o in OUTCOMES}
        self.ttft = make.hist("picovllm:time_to_first_token_seconds", "Time from arrival to the first output token")
        self.itl = make.hist("picovllm:inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = make.hist("picovllm:e2e_request_latency_seconds", "Time from arrival to the last output token")
        self.running = make.gauge("picovllm:num_requests_running", "Requests holding KV blocks (prefill or decode)")
        self.waiting = make.gauge("picovllm:num_requests_waiting", "Requests queued for admission")
        self.kv_usage = make.gauge("picovllm:kv_cache_usage_perc", "Fraction of KV blocks in use, 0 to 1")
        self.kv_free = make.gauge("picovllm:kv_cache_free_blocks",
                                  "Free KV blocks (cached prefix blocks count as free)")
        self.kv_total = make.gauge("picovllm:kv_cache_num_blocks", "KV blocks in the cache")
        self.vllm = VLLMSeries(make)
        # counters of the engine's totals (EngineStats), which take their increments
        self.totals = {k: make.counter(f"picovllm:{k}", doc) for k, doc in [
            ("prefill_tokens", "Prompt tokens computed (prefill)"),
            ("decode_tokens", "Tokens decoded (a decode's token, and the speculative drafts kept)"),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache")]}
        self.totals.update({f"vllm:{k}": counter for k, counter in self.vllm.engine.items()})
        if speculative:
            self.totals.update({k: make.counter(f"vllm:spec_decode_num_{k}", doc) for k, doc in [
                ("drafts", "Speculative steps of a request: its last token fed with drafted tokens"),
                ("draft_tokens", "Drafted tokens fed"),
                ("accepted_tokens", "Drafted tokens kept (the model sampled each one)")]})
        self.per_pos = make.family("vllm:spec_decode_num_accepted_tokens_per_pos",
                                   "Drafted tokens kept, by their position among a step's drafts", ["position"]) \
            if speculative else None
        self._labels = make.labels
        self._last = {k: 0 for k in self.totals}
        self._last_pos: list[int] = []

    def observe_engine(self, stats) -> None:
        """Engine-wide state after a loop iteration (an EngineStats)."""
        usage = 1.0 - stats.num_free_blocks / max(stats.num_blocks, 1)
        for gauge, value in [(self.running, stats.num_running), (self.waiting, stats.num_waiting),
                             (self.kv_free, stats.num_free_blocks), (self.kv_total, stats.num_blocks),
                             (self.kv_usage, usage), (self.vllm.running, stats.num_running),
                             (self.vllm.waiting, stats.num_waiting), (self.vllm.kv_usage, usage)]:
            gauge.set(value)
        now = {"prefill_tokens": stats.prefill_tokens, "decode_tokens": stats.decode_tokens,
               "prefix_cache_queries": stats.prefix_queried_tokens, "prefix_cache_hits": stats.prefix_hit_tokens,
               "vllm:num_preemptions": stats.preemptions,
               "vllm:prefix_cache_queries": stats.prefix_queried_tokens - stats.prefix_requeried_tokens,
               "vllm:prefix_cache_hits": stats.prefix_hit_tokens - stats.prefix_rehit_tokens,
               "drafts": stats.drafts, "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens}
        for k, counter in self.totals.items():    # the engine keeps totals; counters take the increments
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
        """A request's final output. Its first token and its tokens' gaps count whatever its end: a client that
        hangs up on a slow stream is the slow tail these histograms are for. Its latency end to end counts if it
        completed (an abort's is the client's patience; vLLM's series counts every end)."""
        reason = out.outputs[0].finish_reason if out.outputs else "error"
        reason = reason if reason in VLLM_REASONS else "error"
        self.count_outcome(reason)
        self.vllm.observe_finished(out)
        m = out.metrics
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.itls:
            self.itl.observe(gap)
        if reason in ("stop", "length") and m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def count_outcome(self, outcome: str) -> None:
        self.outcomes[outcome].inc()
        if outcome in self.vllm.success:         # a rejected request never reached vLLM's engine
            self.vllm.success[outcome].inc()

    def render(self) -> tuple[bytes, str]:
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        every_process = CollectorRegistry()
        MultiProcessCollector(every_process)
        return generate_latest(every_process), CONTENT_TYPE_LATEST
