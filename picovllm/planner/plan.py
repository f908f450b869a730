"""Rank deployments by predicted goodput; compare a prediction with a measured run (`picovllm bench serve`)."""
from __future__ import annotations

import dataclasses

import numpy as np

from picovllm.planner.profile import StepProfile, check_number
from picovllm.planner.simulator import Deployment, HostNoise, SimRequest, Traffic, make_requests, simulate

METRICS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
WARM_UP = 1      # a calibration run's first requests, left out of its noise (they find a cold server)
MIN_GROUP = 20   # requests that found the instance idle (and busy) needed to tell the two overheads apart


def candidate_deployments(num_instances: int, chunks: list[int], max_num_seqs: int = 256,
                          transfer_bw: float = 10e9, transfer_latency: float = 1e-3) -> list[Deployment]:
    """Colocated on every instance, and every xPyD with x + y = num_instances, at each chunk size."""
    if num_instances < 1:
        raise ValueError(f"num_instances must be >= 1, got {num_instances}")
    shapes = [(0, num_instances)] + [(x, num_instances - x) for x in range(1, num_instances)]
    return [Deployment(x, y, c, max_num_seqs, transfer_bw, transfer_latency) for x, y in shapes for c in chunks]


def plan(profile: StepProfile, traffic: Traffic, deployments: list[Deployment], ttft_slo: float,
         itl_slo: float) -> list[dict]:
    """Each deployment's predicted summary, best goodput first (then the lower TTFT p99)."""
    requests = make_requests(traffic)
    rows = [simulate(profile, d, requests).summary(ttft_slo, itl_slo) for d in deployments]
    return sorted(rows, key=lambda r: (-r["goodput"], r["ttft_p99"]))


def check_run(measured) -> None:
    """Raise ValueError naming the field unless a `bench serve --result-json` result holds what the planner reads of
    it, as bench serve writes it: a file edited by hand or cut short fails here, not deep in a simulation."""
    if not isinstance(measured, dict):
        raise ValueError(f"not a bench serve result (a JSON object), got {type(measured).__name__}")
    cfg = measured.get("config")
    if not isinstance(cfg, dict):
        raise ValueError(f"config must be an object, got {cfg!r:.80}")
    if cfg.get("request_rate") != "inf":            # how bench serve writes a run sent all at once
        check_number(cfg.get("request_rate"), "config.request_rate", above=True)
    for key in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms"):
        check_number(measured.get(key), key)
    if measured.get("prefix_cache_hit_rate") is not None:     # None: the servers' counters unknown
        check_number(measured["prefix_cache_hit_rate"], "prefix_cache_hit_rate")
    reqs = measured.get("requests")
    if not isinstance(reqs, list) or not all(isinstance(r, dict) for r in reqs):
        raise ValueError(f"requests must be a list of objects, got {reqs!r:.80}")
    for i, r in enumerate(reqs):
        if not r.get("success"):
            continue
        check_number(r.get("prompt_len"), f"requests[{i}].prompt_len", low=1, integer=True)
        check_number(r.get("output_tokens"), f"requests[{i}].output_tokens", integer=True)   # 0: no usage sent
        for key in ("start", "ttft", "latency"):
            check_number(r.get(key), f"requests[{i}].{key}")
        if r.get("itls") is not None and not isinstance(r["itls"], list):
            raise ValueError(f"requests[{i}].itls must be a list, got {r['itls']!r:.80}")
        for x in r.get("itls") or []:
            check_number(x, f"requests[{i}].itls")


def measured_trace(measured: dict) -> tuple[list[SimRequest], list[dict]]:
    """A `bench serve` result's successful requests as the simulation's input, in arrival order: the very
    arrivals (their bursts), prompt and output lengths the run had; and the measured records, aligned. A request
    whose server sent no usage (output_tokens 0) had a token a chunk, as bench serve counts it."""
    done = sorted((r for r in measured.get("requests", []) if r.get("success")), key=lambda r: r["start"])
    if not done:
        raise ValueError("requests: the run has no successful request with its timings (bench serve --result-json)")
    try:
        trace = [SimRequest(float(r["start"]), int(r["prompt_len"]),
                            int(r["output_tokens"]) or len(r.get("itls") or []) + 1) for r in done]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"requests: each needs start, prompt_len and output_tokens ({e})") from None
    return trace, done


def _later_gaps(times: list[list[float]], skip_first: bool) -> np.ndarray:
    """Every request's token gaps; skip_first: without its first (an xPyD request's handover)."""
    gaps = [np.diff(t[1:] if skip_first else t) for t in times if len(t) > 1]
    return np.concatenate(gaps) if gaps else np.zeros(0)


def calibrate(profile: StepProfile, deployment: Deployment, measured: dict, seed: int = 0) -> Deployment:
    """The deployment with what the steps do not hold, from a measured run replayed through the simulation
    (its own arrivals and lengths): per decode step, the served step's cost beyond the profile's
    (_step_overhead); per request, measured TTFT minus simulated, whose median over the requests that
    found their instance stepping is the request overhead (HTTP, tokenization, the router's hop to P), the
    median over those that found it idle less that the idle overhead (where each group has MIN_GROUP), and
    whose spread around those is the TTFT noise;
    xPyD, the same of the first gap (the router's hop from P to D beyond the pull); per later gap, the
    client's measured chunk gaps minus the simulated step, the delivery noise (a busy host coalesces
    tokens into one chunk and stalls others: the ITL tails). The run's first request is left out of the
    noise: it pays what only a fresh server pays (connections, the first KV socket and its handshake)."""
    trace, done = measured_trace(measured)
    xpyd = bool(deployment.num_prefill)
    skip = int(xpyd)                                    # an xPyD request's first gap is its handover
    bare = dataclasses.replace(deployment, step_overhead=0.0, request_overhead=0.0, handover_overhead=0.0,
                               idle_overhead=0.0, noise=None)
    step_overhead = _step_overhead(done, simulate(profile, bare, trace), skip)
    bare = dataclasses.replace(bare, step_overhead=step_overhead)
    sim = simulate(profile, bare, trace)
    ttft = np.array([m["ttft"] for m in done]) - sim.ttfts()
    idle = np.array([r.found_idle for r in sim.requests])
    overhead, idle_overhead = float(np.median(ttft)), 0.0
    if idle.sum() >= MIN_GROUP and (~idle).sum() >= MIN_GROUP:
        overhead = float(np.median(ttft[~idle]))
        idle_overhead = float(np.median(ttft[idle])) - overhead
    overhead = max(0.0, overhead)
    idle_overhead = max(-overhead, idle_overhead)
    ttft = ttft - idle_overhead * idle
    handover_noise, handover = (), 0.0
    sim_times = [r.token_times for r in sim.requests]
    if xpyd:
        pairs = [(m["itls"][0], t[1] - t[0]) for m, t in zip(done, sim_times) if m.get("itls") and len(t) > 1]
        if pairs:
            resid = np.array([a - b for a, b in pairs])
            handover = max(0.0, float(np.median(resid)))
            handover_noise = tuple(float(x) for x in resid - handover)
    measured_gaps = np.concatenate([np.asarray(m.get("itls") or [], dtype=float)[skip:] for m in done])
    sim_gaps = _later_gaps(sim_times, xpyd)
    step = float(np.median(sim_gaps)) if len(sim_gaps) else 0.0
    noise = HostNoise(ttft=tuple(float(x) for x in (ttft - overhead)[WARM_UP:]),
                      gap=tuple(float(x) for x in measured_gaps - step), handover=handover_noise[WARM_UP:], seed=seed)
    return dataclasses.replace(deployment, step_overhead=step_overhead, request_overhead=overhead,
                               idle_overhead=idle_overhead, handover_overhead=handover, noise=noise)


def _step_overhead(done: list[dict], sim, skip: int) -> float:
    """What a served step costs beyond the profile's: the median over requests of the measured time per
    output token minus the simulated one, both over the gaps after the first `skip` (a request's decode
    steps, one token each). A time per token, unlike a gap, is the same however the client's chunks group
    the tokens; the simulated one holds the batch each request shared its steps with."""
    diffs = []
    for m, r in zip(done, sim.requests):
        itls, gaps = (m.get("itls") or [])[skip:], np.diff(r.token_times)[skip:]
        n = r.output - 1 - skip                         # measured_trace's output tokens
        if itls and n > 0 and len(gaps) == n:
            diffs.append(sum(itls) / n - float(gaps.mean()))
    return max(0.0, float(np.median(diffs))) if diffs else 0.0


def predict_measured(profile: StepProfile, deployment: Deployment, measured: dict, ttft_slo: float,
                     itl_slo: float) -> dict:
    """The deployment's predicted summary for a measured run's own arrivals and lengths."""
    return simulate(profile, deployment, measured_trace(measured)[0]).summary(ttft_slo, itl_slo)


def compare(predicted: dict, measured: dict) -> dict:
    """Predicted against a `bench serve` result (its *_ttft_ms / *_itl_ms fields): seconds and relative error."""
    got = {"ttft_p50": measured["median_ttft_ms"] / 1e3, "ttft_p99": measured["p99_ttft_ms"] / 1e3,
           "itl_p50": measured["median_itl_ms"] / 1e3, "itl_p99": measured["p99_itl_ms"] / 1e3}
    return {m: {"predicted": predicted[m], "measured": got[m],
                "error": (predicted[m] - got[m]) / got[m] if got[m] else None} for m in METRICS}


def measured_goodput(measured: dict, ttft_slo: float, itl_slo: float) -> float:
    """A `bench serve` run's goodput as SimResult.summary counts it: requests whose TTFT and every gap meet
    the SLOs, per second from the first arrival to the last token."""
    done = [r for r in measured.get("requests", []) if r.get("success")]
    if not done:
        return 0.0
    good = sum(1 for r in done if r["ttft"] <= ttft_slo and max(r.get("itls") or [0.0]) <= itl_slo)
    span = max(r["start"] + r["latency"] for r in done) - min(r["start"] for r in done)
    return good / max(span, 1e-9)


def best_by_rate(comparisons: list[dict]) -> list[dict]:
    """Per request rate, the measured deployment the planner ranks first (predicted goodput) against the
    one that measured the best goodput: the planner's recommendation, checked among those measured."""
    out = []
    for rate in sorted({c["rate"] for c in comparisons}):
        runs = [c for c in comparisons if c["rate"] == rate]
        pred = max(runs, key=lambda c: (c["goodput"]["predicted"], -c["predicted"]["ttft_p99"]))
        meas = max(runs, key=lambda c: c["goodput"]["measured"])
        out.append({"rate": rate, "recommended": pred["deployment"], "measured_best": meas["deployment"],
                    "agree": pred["goodput"]["measured"] >= meas["goodput"]["measured"]})
    return out


def plot_comparisons(rows: list[dict], path: str) -> None:
    """Predicted against measured, one point per run and metric, on log axes with the 20% band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    values = []
    for metric, marker in zip(METRICS, "os^v"):
        xs = [r["comparison"][metric]["measured"] * 1e3 for r in rows]
        ys = [r["comparison"][metric]["predicted"] * 1e3 for r in rows]
        values += xs + ys
        ax.scatter(xs, ys, marker=marker, label=metric)
    lo, hi = max(min(values) * 0.5, 1e-3), max(values) * 2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="grey", alpha=0.2, label="±20%")
    ax.set(xscale="log", yscale="log", xlabel="measured (ms)", ylabel="predicted (ms)",
           title="picovllm plan: predicted against measured")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
