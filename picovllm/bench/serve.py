"""`picovllm bench serve`: an online benchmark against any OpenAI-compatible /v1/completions server.

Requests arrive as a Poisson process (gamma intervals when --burstiness != 1), each streamed over SSE.
Per request: TTFT (send to first chunk), ITL (gaps between chunks), TPOT ((latency - TTFT) / (tokens - 1)),
end-to-end latency. Reported as vLLM's `bench serve` does: throughput, mean/median/p90/p99 of each,
and goodput (requests per second meeting every --goodput SLO). The plot shows each ITL at the time it
happened, so prefill interference (spikes when new requests join the batch) is visible at a glance.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

SLO_KEYS = ("ttft", "tpot", "itl", "e2el")
# The servers' prefix-cache counters in their Prometheus /metrics (picovllm's and vLLM's names): summed over the
# servers, read before and after the run, they give the share of prompt tokens the servers did not compute.
PREFIX_COUNTERS = {"queries": ("picovllm:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
                   "hits": ("picovllm:prefix_cache_hits_total", "vllm:prefix_cache_hits_total")}


@dataclass
class BenchRequest:
    prompt: list[int]
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    start: float = 0.0             # seconds since the benchmark began
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)   # seconds since the benchmark began
    prompt_len: int = 0
    output_tokens: int = 0


# -- workload ----------------------------------------------------------------------------------------
def random_dataset(n: int, input_len: int, output_len: int, range_ratio: float, vocab: int,
                   rng: random.Random) -> list[BenchRequest]:
    """Random token-id prompts: exact input lengths, whatever the tokenizer."""
    def length(mean: int) -> int:
        lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.randint(lo, hi)

    return [BenchRequest([rng.randrange(vocab) for _ in range(length(input_len))], length(output_len))
            for _ in range(n)]


def arrival_gaps(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds to wait before each request: gamma(shape=burstiness, mean=1/rate); burstiness 1 is Poisson."""
    if rate == float("inf"):
        return [0.0] * n
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


# -- one streamed request ----------------------------------------------------------------------------
async def run_request(client, url: str, body: dict, t0: float, headers: dict) -> RequestResult:
    res = RequestResult(prompt_len=len(body["prompt"]))
    start = time.perf_counter()
    res.start = start - t0
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                # a chunk with a choice carries tokens, its text possibly empty (vLLM's rule): an end-of-sequence
                # token's final chunk, a token whose text waits for the next one's
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if not res.chunk_times:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    res.chunk_times.append(now - t0)
                    last = now
        res.latency = time.perf_counter() - start
        res.success = bool(res.chunk_times)
        if not res.success:
            res.error = "no chunk with a choice came back"
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


def run_benchmark(args: argparse.Namespace) -> dict:
    """Run the workload (across --num-workers client processes) and summarize what the clients saw."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url[0].rstrip("/")
    try:
        r = httpx.get(f"{base}/v1/models", headers=headers, timeout=args.timeout)
        r.raise_for_status()
        models = r.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        raise ValueError(f"--base-url: no OpenAI server answered GET {base}/v1/models: {type(e).__name__}: {e}"
                         ) from None
    model = args.model or models[0]["id"]
    vocab = min(models[0].get("vocab_size") or 1000, args.max_token_id if args.max_token_id is not None else 10**9)
    before = prefix_cache_counters(args.base_url, headers, args.timeout)
    if args.num_workers == 1:
        starts = []

        def start() -> float:
            starts.append(time.time() + 0.05)
            return starts[-1]
        shares = [asyncio.run(run_share(args, model, vocab, 0, start))]
        t0 = starts[0]
    else:
        shares, t0 = _run_workers(args, model, vocab)
    results: list[RequestResult | None] = [None] * args.num_prompts
    for done, _ in shares:
        for i, r in done:
            results[i] = r
    duration = max(end for _, end in shares)
    after = prefix_cache_counters(args.base_url, headers, args.timeout) if before else None
    summary = summarize(results, duration, parse_goodput(args.goodput), vars(args) | {"model": model})
    summary["prefix_cache_hit_rate"] = prefix_hit_rate(before, after)
    summary["start_time"] = t0      # the common start (time.time()): each request's `start` counts from it
    return summary


def prefix_cache_counters(base_urls: list[str], headers: dict, timeout: float) -> dict[str, float] | None:
    """The servers' prefix-cache counters ({"queries", "hits"} prompt tokens, summed over the servers), or None
    where a server does not expose them (a router, another engine) or its /metrics does not answer."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    total = {"queries": 0.0, "hits": 0.0}
    for base in base_urls:
        try:
            text = httpx.get(f"{base.rstrip('/')}/metrics", headers=headers, timeout=timeout).text
            samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        except (httpx.HTTPError, ValueError):
            return None
        for key, names in PREFIX_COUNTERS.items():
            # the first name the server has (a picovllm server exports both: its own, and vLLM's, which leaves
            # a preempted request's second lookup out)
            name = next((n for n in names if any(s.name == n for s in samples)), None)
            if name is None:
                return None
            total[key] += sum(s.value for s in samples if s.name == name)
    return total


def prefix_hit_rate(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Hits over queries between the two readings (other traffic to the servers counts too); None without both
    or without a query."""
    if before is None or after is None or after["queries"] <= before["queries"]:
        return None
    return (after["hits"] - before["hits"]) / (after["queries"] - before["queries"])


async def warm_up(client, bases: list[str], headers: dict) -> None:
    """One request to each server on `client` before the clock starts. A client's first request loads the parts of
    httpx, httpcore, h11 and anyio that load lazily and opens its first connection: 25-45 ms on a 2-core CPU,
    100-170 ms on the H200's host, added to the TTFT of each client process's first request (at 80 requests/s on 4
    clients, exactly the 4 requests at the TTFT p99; BENCHMARKS.md, nineteenth session)."""
    for base in bases:
        (await client.get(f"{base}/v1/models", headers=headers)).raise_for_status()


async def run_share(args: argparse.Namespace, model: str, vocab: int, worker: int,
                    start: Callable[[], float]) -> tuple[list[tuple[int, RequestResult]], float]:
    """Worker `worker`'s requests (every num_workers-th of the workload, which every worker draws alike from the
    seed), each sent at its time after the common start; ((index, result) pairs, when the last one ended, in seconds
    after the start). start() is called once the workload and the client are ready and returns the start (a
    time.time()): taken earlier, a slow machine's set-up made the first requests late (0.28 s of a 0.05 s gap)."""
    import httpx

    bases = [u.rstrip("/") for u in args.base_url]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    reqs = random_dataset(args.num_prompts, args.input_len, args.output_len, args.random_range_ratio, vocab, rng)
    due = list(itertools.accumulate(arrival_gaps(len(reqs), args.request_rate, args.burstiness, rng)))
    mine = range(worker, len(reqs), args.num_workers)
    limits = httpx.Limits(max_connections=args.max_concurrency or len(mine), max_keepalive_connections=100)
    gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:

        async def one(r: BenchRequest, t0: float, url: str) -> RequestResult:
            body = {"model": model, "prompt": r.prompt, "max_tokens": r.output_len, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
            if gate is None:
                return await run_request(client, f"{url}/v1/completions", body, t0, headers)
            async with gate:
                return await run_request(client, f"{url}/v1/completions", body, t0, headers)

        await warm_up(client, bases, headers)
        t0_wall = start()
        t0 = time.perf_counter() + (t0_wall - time.time())     # the common start, on this process's clock
        tasks = []
        for i in mine:      # each at its own time from the start, so a late one does not delay the rest
            wait = t0 + due[i] - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append((i, asyncio.create_task(one(reqs[i], t0, bases[i % len(bases)]))))   # round-robin
        done = [(i, await task) for i, task in tasks]
        return done, time.perf_counter() - t0


def _worker(args: argparse.Namespace, model: str, vocab: int, worker: int, conn) -> None:
    def start() -> float:       # ready: wait for the common start
        conn.send("ready")
        return conn.recv()

    done, end = asyncio.run(run_share(args, model, vocab, worker, start))
    conn.send(([(i, asdict(r)) for i, r in done], end))


def _run_workers(args: argparse.Namespace, model: str, vocab: int) -> tuple[list, float]:
    """--num-workers processes, each with its share of the requests and its own event loop: one Python client
    streaming thousands of chunks a second delays its own reads (at 40 requests/s of 64 tokens one client
    added ~10 ms to the TTFT p99 that two clients measured; BENCHMARKS.md, thirteenth session)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")       # no event loop or client state crosses into the workers
    pipes, procs = [], []
    for w in range(args.num_workers):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(args, model, vocab, w, child), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        for conn in pipes:
            if conn.recv() != "ready":
                raise RuntimeError("a bench worker did not start")
        t0 = time.time() + 0.1
        for conn in pipes:
            conn.send(t0)
        shares = []
        for conn in pipes:
            done, end = conn.recv()
            shares.append(([(i, RequestResult(**r)) for i, r in done], end))
        return shares, t0
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


# -- statistics --------------------------------------------------------------------------------------
def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 0.5, 'tpot': 0.05} (seconds). Raises ValueError naming the item."""
    slos = {}
    for item in items or []:
        key, _, ms = item.partition(":")
        if key not in SLO_KEYS:
            raise ValueError(f"--goodput {item!r}: the metric must be one of {', '.join(SLO_KEYS)}")
        try:
            slos[key] = float(ms) / 1000.0
        except ValueError:
            raise ValueError(f"--goodput {item!r}: the SLO must be a number of milliseconds") from None
        if not slos[key] > 0:       # nan too: no request would meet it
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
    return slos


def tpot(r: RequestResult) -> float | None:
    n = r.output_tokens or len(r.chunk_times)
    return (r.latency - r.ttft) / (n - 1) if n > 1 else None


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    """A request is good if it meets every SLO; the itl SLO applies to every gap of the request."""
    got = {"ttft": r.ttft, "tpot": tpot(r) or 0.0, "itl": max(r.itls, default=0.0), "e2el": r.latency}
    return all(got[k] <= v for k, v in slos.items())


def _stats(name: str, values: list[float]) -> dict:
    import numpy as np

    ms = np.asarray(values, dtype=float) * 1000 if values else np.zeros(1)
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p90_{name}_ms": float(np.percentile(ms, 90)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float], config: dict) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens or len(r.chunk_times) for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    good = [r for r in ok if meets(r, slos)] if slos else []
    summary = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "request_goodput": len(good) / duration if slos else None,
        "goodput_slos_ms": {k: v * 1000 for k, v in slos.items()},
        **_stats("ttft", [r.ttft for r in ok]),
        **_stats("tpot", [t for r in ok if (t := tpot(r)) is not None]),
        **_stats("itl", [x for r in ok for x in r.itls]),
        **_stats("e2el", [r.latency for r in ok]),
        "config": {k: (str(v) if isinstance(v, float) and v == float("inf") else v)
                   for k, v in config.items() if k not in ("func", "api_key")},
        "errors": [r.error for r in results if not r.success],
        "requests": [asdict(r) for r in results],
    }
    return summary


def print_summary(s: dict) -> None:
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", s["duration"]), ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", s["request_throughput"]),
            ("Output token throughput (tok/s)", s["output_throughput"]),
            ("Total token throughput (tok/s)", s["total_token_throughput"])]
    if s["request_goodput"] is not None:
        rows.append(("Request goodput (req/s)", s["request_goodput"]))
    if s.get("prefix_cache_hit_rate") is not None:
        rows.append(("Prefix cache hit rate (servers, %)", 100 * s["prefix_cache_hit_rate"]))
    for name, label in [("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")]:
        rows.append((f"-- {label} --", ""))
        for stat in ("mean", "median", "p90", "p99"):
            rows.append((f"{stat.capitalize()} {name.upper()} (ms)", s[f"{stat}_{name}_ms"]))
    print("=" * 20 + " Serving Benchmark Result " + "=" * 20)
    for k, v in rows:
        print(f"{k:<42}{v:>12.2f}" if isinstance(v, float) else f"{k:<42}{v!s:>12}")
    print("=" * 66)


def plot_itl(s: dict, path: str) -> None:
    """ITL of every chunk against when it arrived; TTFT of each request against when it was sent."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in s["requests"] if r["success"]]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    xs = [t for r in ok for t in r["chunk_times"][1:]]
    ys = [x * 1000 for r in ok for x in r["itls"]]
    ax1.scatter(xs, ys, s=4, alpha=0.5)
    ax1.set_ylabel("inter-token latency (ms)")
    ax1.set_title(f"ITL over time: {s['completed']} requests, rate {s['config'].get('request_rate')} req/s")
    ax2.scatter([r["start"] for r in ok], [r["ttft"] * 1000 for r in ok], s=8, color="tab:orange")
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_xlabel("time since benchmark start (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- command line ------------------------------------------------------------------------------------
def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="online benchmark against a running server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", nargs="+", default=["http://127.0.0.1:8000"],
                   help="server(s); with several, requests go round-robin (e.g. one colocated server per GPU)")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", default="random", choices=["random"])
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-workers", type=int, default=1,
                   help="client processes sharing the requests (one Python client slows at thousands of chunks/s)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- ratio)")
    p.add_argument("--max-token-id", type=int, default=None, help="random prompt token ids are drawn from [0, N)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the output length (default on)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help=f"SLOs for goodput, METRIC in {', '.join(SLO_KEYS)}, e.g. ttft:500 tpot:50")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request waits for its connection, or for its next bytes (httpx's timeout; not a whole "
                        "request's)")
    p.add_argument("--result-json", default=None)
    p.add_argument("--plot", default=None, help="PNG of ITL (and TTFT) over time")
    p.set_defaults(func=main)
    return p


def validate(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    if not 0 < args.burstiness < float("inf"):     # gamma's shape: inf is no distribution
        raise ValueError(f"--burstiness must be > 0 and finite, got {args.burstiness}")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.num_workers < 1 or args.num_workers > args.num_prompts:
        raise ValueError(f"--num-workers must be in [1, --num-prompts], got {args.num_workers}")
    if not 0 < args.timeout < float("inf"):        # httpx takes no infinite timeout
        raise ValueError(f"--timeout must be > 0 and finite, got {args.timeout}")
    if args.max_token_id is not None and args.max_token_id < 1:
        raise ValueError(f"--max-token-id must be >= 1, got {args.max_token_id}")
    if args.num_workers > 1 and args.max_concurrency is not None:
        raise ValueError("--max-concurrency bounds one client: it needs --num-workers 1")
    parse_goodput(args.goodput)


def main(args: argparse.Namespace) -> int:
    from picovllm.entrypoints.batch_io import check_output
    validate(args)
    check_output(args.result_json, "--result-json")
    summary = run_benchmark(args)
    print_summary(summary)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=1)
    if args.plot:
        plot_itl(summary, args.plot)
    if summary["failed"]:
        print(f"{summary['failed']} requests failed, e.g.: {summary['errors'][0]}", file=sys.stderr)
    return 0 if summary["completed"] else 1
