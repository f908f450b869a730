"""The planner (picovllm/planner): its fit, its simulation against closed forms (one request by hand, an
M/D/1 queue by Pollaczek-Khinchine), and `picovllm plan` on a profile measured from the tiny model."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from picovllm.entrypoints.cli import main
from picovllm.planner.profile import StepProfile, fit
from picovllm.planner.simulator import Deployment, Lengths, SimRequest, Traffic, make_requests, simulate

PROFILE = StepProfile([1e-3, 2e-3, 1e-5, 1e-9, 2e-4, 1e-7], kv_bytes_per_token=1000)


def test_fit_recovers_nonnegative_coefficients():
    rng = random.Random(0)
    samples = []
    for _ in range(60):
        p, b = rng.choice([0, 64, 512, 2048]), rng.choice([0, 1, 8, 64])
        c = b * rng.choice([100, 1000])
        if p == b == 0:
            continue
        samples.append({"prefill": p, "batch": b, "context": c, "seconds": PROFILE.step_time(p, b, c)})
    got = fit(samples, 1000)
    assert got.coef == pytest.approx(PROFILE.coef, rel=1e-4, abs=1e-12)
    noisy = fit([dict(s, seconds=s["seconds"] - 5e-3 * (s["batch"] == 1)) for s in samples], 1000)
    assert all(c >= 0 for c in noisy.coef)


def test_one_request_by_hand():
    req = [SimRequest(1.0, 100, 4)]
    step = PROFILE.step_time
    co = simulate(PROFILE, Deployment(0, 1, chunk=512), req).requests[0]
    want = [1.0 + step(100, 0, 0)]
    for i in range(3):
        want.append(want[-1] + step(0, 1, 101 + i))
    assert co.token_times == pytest.approx(want)
    # 1P1D, prompt in chunks of 64: two P steps; then the pull; then D's decodes
    pd = simulate(PROFILE, Deployment(1, 1, chunk=64, transfer_bw=1e6, transfer_latency=0.01), req).requests[0]
    first = 1.0 + step(64, 0, 0) + step(36, 0, 0)
    arrive = first + 100 * 1000 / 1e6 + 0.01
    assert pd.token_times == pytest.approx([first, arrive + step(0, 1, 101), arrive + step(0, 1, 101)
                                            + step(0, 1, 102), arrive + step(0, 1, 101) + step(0, 1, 102)
                                            + step(0, 1, 103)])


def test_queueing_matches_pollaczek_khinchine():
    """Prompts of 256 tokens done at their first token, one per step (chunk 256, one sequence): an M/D/1
    queue with service s, whose mean wait is lambda s^2 / (2 (1 - rho))."""
    s = PROFILE.step_time(256, 0, 0)
    rate = 0.7 / s
    traffic = Traffic(rate, Lengths(256, 256), Lengths(1, 1), num_requests=20000, seed=3)
    res = simulate(PROFILE, Deployment(0, 1, chunk=256, max_num_seqs=1), make_requests(traffic))
    wait = rate * s * s / (2 * (1 - rate * s))
    assert res.ttfts().mean() == pytest.approx(wait + s, rel=0.05)


def test_decode_heavy_traffic_gets_more_decode_instances():
    from picovllm.planner.plan import candidate_deployments, plan
    heavy = StepProfile([1e-3, 1e-3, 2e-6, 0.0, 3e-3, 1e-7], kv_bytes_per_token=1000)   # decode steps dominate
    rows = plan(heavy, Traffic(20.0, Lengths(128, 128), Lengths(200, 200), 400), candidate_deployments(4, [512]),
                ttft_slo=1.0, itl_slo=0.2)
    best = rows[0]
    assert best["num_prefill"] in (0, 1) and best["goodput"] >= max(r["goodput"] for r in rows)
    assert [r["goodput"] for r in rows] == sorted((r["goodput"] for r in rows), reverse=True)


def test_plan_command_measures_and_ranks(tiny_models, tmp_path, capsys):
    prof = tmp_path / "profile.json"
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", tiny_models["llama"], "--measure-profile", "--profile", str(prof),
               "--num-kv-blocks", "256", "--block-size", "16", "--max-model-len", "512", "--num-prompts", "200",
               "--request-rate", "20", "--input-len", "32-96", "--output-len", "16", "--num-instances", "3",
               "--chunks", "64", "256", "--result-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "recommended:" in text and "2P1D, chunk 64" in text
    saved = StepProfile.load(str(prof))
    assert saved.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 and len(saved.samples) >= 12
    ranked = json.loads(out.read_text())["ranked"]
    assert len(ranked) == 3 * 2 and ranked[0]["goodput"] == max(r["goodput"] for r in ranked)
    with pytest.raises(SystemExit, match="--input-len"):
        main(["plan", "--profile", str(prof), "--input-len", "0"])
    assert np.isfinite([r["ttft_p99"] for r in ranked]).all()
