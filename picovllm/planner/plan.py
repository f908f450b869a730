"""Rank deployments by predicted goodput; compare a prediction with a measured run (`picovllm bench serve`)."""
from __future__ import annotations

import dataclasses

import numpy as np

from picovllm.planner.profile import StepProfile
from picovllm.planner.simulator import Deployment, Traffic, make_requests, simulate

METRICS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")


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


def first_gap_p50(requests) -> float:
    """Median gap between a request's first and second token (a PD request's handover is in it)."""
    gaps = [r.token_times[1] - r.token_times[0] for r in requests if len(r.token_times) > 1]
    return float(np.median(gaps)) if gaps else 0.0


def calibrate(profile: StepProfile, traffic: Traffic, deployment: Deployment, measured: dict) -> Deployment:
    """The deployment with its overheads set so that a measured run's TTFT p50 (and, xPyD, its median first
    inter-token gap) are predicted exactly: what HTTP, tokenization and the router's hops add to the steps."""
    bare = dataclasses.replace(deployment, request_overhead=0.0, handover_overhead=0.0)
    sim = simulate(profile, bare, make_requests(traffic))
    overhead = max(0.0, measured["median_ttft_ms"] / 1e3 - float(np.median(sim.ttfts())))
    handover = 0.0
    if deployment.num_prefill:
        first = [r["itls"][0] for r in measured.get("requests", []) if r.get("success") and r.get("itls")]
        if first:
            handover = max(0.0, float(np.median(first)) - first_gap_p50(sim.requests))
    return dataclasses.replace(deployment, request_overhead=overhead, handover_overhead=handover)


def compare(predicted: dict, measured: dict) -> dict:
    """Predicted against a `bench serve` result (its *_ttft_ms / *_itl_ms fields): seconds and relative error."""
    got = {"ttft_p50": measured["median_ttft_ms"] / 1e3, "ttft_p99": measured["p99_ttft_ms"] / 1e3,
           "itl_p50": measured["median_itl_ms"] / 1e3, "itl_p99": measured["p99_itl_ms"] / 1e3}
    return {m: {"predicted": predicted[m], "measured": got[m],
                "error": (predicted[m] - got[m]) / got[m] if got[m] else None} for m in METRICS}


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
