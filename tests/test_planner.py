"""The planner (picovllm/planner): its fit, its simulation against closed forms (one request by hand, an
M/D/1 queue by Pollaczek-Khinchine), and `picovllm plan` on a profile measured from the tiny model."""
from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from picovllm.entrypoints.cli import main
from picovllm.planner.profile import WAKE_IDLES, StepProfile, fit
from picovllm.planner.simulator import Deployment, Lengths, SimRequest, Traffic, make_requests, simulate

PROFILE = StepProfile([1e-3, 2e-3, 1e-5, 1e-9, 2e-4, 1e-7, 9e-3, 3e-5], kv_bytes_per_token=1000)
SEVEN = StepProfile(PROFILE.coef[:7], kv_bytes_per_token=1000)  # a decode beside a chunk at a lone decode's cost
SIX = StepProfile(PROFILE.coef[:6], kv_bytes_per_token=1000)    # mixed steps at a lone prefill's fixed cost too


def test_step_time_by_kind_of_step():
    """Decode-only, prefill-only and mixed steps each take their own fixed cost (c0, c1, c6), and a decode beside a
    chunk its own slope (c7), by hand; a profile of seven coefficients (saved before c7) charges such a decode c4,
    one of six (measured before mixed steps were) a mixed step c1 too."""
    c0, c1, c2, c3, c4, c5, c6, c7 = PROFILE.coef
    assert PROFILE.step_time(0, 3, 300) == pytest.approx(c0 + 3 * c4 + 300 * c5)
    assert PROFILE.step_time(100, 0, 0) == pytest.approx(c1 + 100 * c2 + 1e4 * c3)
    assert PROFILE.step_time(100, 3, 300) == pytest.approx(c6 + 100 * c2 + 1e4 * c3 + 3 * c7 + 300 * c5)
    assert SEVEN.step_time(100, 3, 300) == pytest.approx(c6 + 100 * c2 + 1e4 * c3 + 3 * c4 + 300 * c5)
    assert SIX.step_time(100, 3, 300) == pytest.approx(c1 + 100 * c2 + 1e4 * c3 + 3 * c4 + 300 * c5)
    assert PROFILE.step_time(0, 0, 0) == 0.0


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
    unmixed = [s for s in samples if not (s["prefill"] and s["batch"])]     # no mixed step: six coefficients
    assert fit(unmixed, 1000).coef == pytest.approx(PROFILE.coef[:6], rel=1e-4, abs=1e-12)
    # mixed steps of one batch size cannot tell c7 from c6: seven coefficients, from a profile with c7 = c4
    one = [dict(s, seconds=SEVEN.step_time(s["prefill"], s["batch"], s["context"])) for s in samples
           if not (s["prefill"] and s["batch"] not in (0, 8))]
    assert fit(one, 1000).coef == pytest.approx(SEVEN.coef, rel=1e-4, abs=1e-12)
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


def test_serving_cost_a_sequence_by_hand():
    """profile.serve_per_seq is added to every step, once per sequence in it: one request alone, then two side by
    side."""
    import dataclasses
    prof, step, extra = dataclasses.replace(PROFILE, serve_per_seq=5e-4), PROFILE.step_time, 5e-4
    one = simulate(prof, Deployment(0, 1, chunk=512), [SimRequest(1.0, 100, 3)]).requests[0]
    want = [1.0 + step(100, 0, 0) + extra]
    for i in range(2):
        want.append(want[-1] + step(0, 1, 101 + i) + extra)
    assert one.token_times == pytest.approx(want)
    # a second request arrives during the first's prompt: its chunk beside the first's decode, then two decodes
    a, b = simulate(prof, Deployment(0, 1, chunk=512),
                    [SimRequest(1.0, 100, 3), SimRequest(1.0 + step(100, 0, 0) / 2, 50, 2)]).requests
    t1 = 1.0 + step(100, 0, 0) + extra
    t2 = t1 + step(50, 1, 101) + 2 * extra
    t3 = t2 + step(0, 2, 102 + 51) + 2 * extra
    assert a.token_times == pytest.approx([t1, t2, t3]) and b.token_times == pytest.approx([t2, t3])


def test_serving_cost_an_admission_by_hand():
    """profile.serve_per_admission is added to the step that takes a request in, once per request, whatever else
    runs in it (colocated: the step of its first chunk; 1P1D: P's first chunk and D's first decode), and to no
    other step."""
    prof, step, adm = dataclasses.replace(PROFILE, serve_per_admission=7e-4), PROFILE.step_time, 7e-4
    a, b = simulate(prof, Deployment(0, 1, chunk=512),
                    [SimRequest(1.0, 100, 3), SimRequest(1.0 + step(100, 0, 0) / 2, 50, 2)]).requests
    t1 = 1.0 + step(100, 0, 0) + adm
    t2 = t1 + step(50, 1, 101) + adm                    # B's admission slows A's decode beside it
    t3 = t2 + step(0, 2, 102 + 51)
    assert a.token_times == pytest.approx([t1, t2, t3]) and b.token_times == pytest.approx([t2, t3])
    both = simulate(prof, Deployment(0, 1, chunk=512), [SimRequest(1.0, 40, 1), SimRequest(1.0, 30, 1)]).requests
    t1 = 1.0 + step(40, 0, 0) + adm                     # the second arrives as the first's step starts
    assert both[0].token_times == pytest.approx([t1])
    assert both[1].token_times == pytest.approx([t1 + step(30, 0, 0) + adm])
    pd = simulate(prof, Deployment(1, 1, chunk=64, transfer_bw=1e6, transfer_latency=0.01),
                  [SimRequest(1.0, 100, 3)]).requests[0]
    first = 1.0 + step(64, 0, 0) + adm + step(36, 0, 0)
    arrive = first + 100 * 1000 / 1e6 + 0.01
    second = arrive + step(0, 1, 101) + adm
    assert pd.token_times == pytest.approx([first, second, second + step(0, 1, 102)])


def test_an_overlapped_engine_admits_an_arrival_a_step_later_by_hand():
    """Under overlap (EngineConfig.async_scheduling: a GPU's default) the step after the running one was planned as
    the running one began: a request that arrives during step 1 joins step 3, not step 2; an engine with nothing
    else planned takes it at once."""
    step = PROFILE.step_time
    assert not PROFILE.overlapped and StepProfile([], 0, machine="cuda m").overlapped
    over = dataclasses.replace(PROFILE, overlap=True)
    reqs = [SimRequest(1.0, 100, 3), SimRequest(1.0005, 50, 1)]
    t1 = 1.0 + step(100, 0, 0)
    plain = simulate(PROFILE, Deployment(0, 1, chunk=512), reqs).requests
    assert plain[1].token_times == pytest.approx([t1 + step(50, 1, 101)])      # step 2: beside A's decode
    got = simulate(over, Deployment(0, 1, chunk=512), reqs).requests
    t2 = t1 + step(0, 1, 101)                                                   # step 2: A's decode alone
    assert got[1].token_times == pytest.approx([t2 + step(50, 1, 102)])
    assert got[0].token_times == pytest.approx([t1, t2, t2 + step(50, 1, 102)])
    alone = simulate(over, Deployment(0, 1, chunk=512), [SimRequest(1.0, 100, 1), SimRequest(1.0005, 50, 1)])
    assert alone.requests[1].token_times == pytest.approx([t1 + step(50, 0, 0)]), "nothing else planned: at once"


def test_colocated_instances_share_the_decodes():
    """Colocated, an arrival that finds no prompt left on any instance goes to the one with the fewest requests: N
    requests, each arriving after the one before has its first token, on N instances run as each would alone (they
    all went to the first instance, decoding side by side there while the others idled)."""
    step = PROFILE.step_time
    reqs = [SimRequest(1.0 + k * (step(100, 0, 0) + 1e-3), 100, 40) for k in range(3)]
    got = simulate(PROFILE, Deployment(0, 3, chunk=512), reqs).requests
    for r, g in zip(reqs, got):
        alone = simulate(PROFILE, Deployment(0, 1, chunk=512), [r]).requests[0]
        assert g.token_times == pytest.approx(alone.token_times)
    # Poisson traffic that rarely holds two requests at once: on 8 instances each decodes alone, within the ITL SLO
    # of a lone decode; and more instances are never worse
    traffic = Traffic(3.0, Lengths(100, 100), Lengths(40, 40), num_requests=60, seed=1)
    slo = step(0, 1, 140) * 1.01
    rows = [simulate(PROFILE, Deployment(0, n, chunk=512), make_requests(traffic)).summary(1.0, slo)
            for n in (1, 2, 4, 8)]
    assert rows[-1]["good_fraction"] == 1.0
    assert [r["goodput"] for r in rows] == sorted(r["goodput"] for r in rows)


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
    saved = StepProfile.load(str(prof))      # load checks the wake's shape: idle ascending, extra non-decreasing
    assert saved.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 and len(saved.samples) >= 12
    assert [w[0] for w in saved.wake] == list(WAKE_IDLES)
    assert 0 < saved.serve_per_seq < 0.01 and 0 < saved.serve_per_admission < 0.05
    ranked = json.loads(out.read_text())["ranked"]
    assert len(ranked) == 3 * 2 and ranked[0]["goodput"] == max(r["goodput"] for r in ranked)
    assert main(["plan", "--profile", str(prof), "--input-len", "0"]) == 2
    assert "picovllm plan: error: --input-len" in capsys.readouterr().err
    assert np.isfinite([r["ttft_p99"] for r in ranked]).all()



GOOD_PROFILE = {"coef": [0.01, 0.02, 0.001, 0, 0.002, 0], "kv_bytes_per_token": 1000}
GOOD_REQUEST = {"success": True, "start": 0.0, "prompt_len": 8, "output_tokens": 2, "ttft": 0.1, "latency": 0.2,
                "itls": [0.1]}
GOOD_RUN = {"config": {"request_rate": 4}, "requests": [GOOD_REQUEST], "median_ttft_ms": 100, "p99_ttft_ms": 100,
            "median_itl_ms": 100, "p99_itl_ms": 100}
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("flags, profile, run, names", [
    (["--transfer-gbps", "0"], {}, {}, "--transfer-gbps"),        # a pull of infinite time: ZeroDivisionError
    (["--transfer-gbps", "-1"], {}, {}, "--transfer-gbps"),       # negative ITLs
    (["--ttft-slo-ms", "0"], {}, {}, "--ttft-slo-ms"),            # no request can meet it, yet a recommendation
    (["--ttft-slo-ms", "-5"], {}, {}, "--ttft-slo-ms"),
    (["--itl-slo-ms", "-1"], {}, {}, "--itl-slo-ms"),
    (["--request-rate", "nan"], {}, {}, "--request-rate"),        # arrivals at NaN: IndexError
    (["--request-rate", "inf"], {}, {}, "--request-rate"),
    (["--num-prompts", "0"], {}, {}, "--num-prompts"),            # not num_requests
    (["--chunks", "0"], {}, {}, "--chunks"),                      # not "chunk and max_num_seqs"
    (["--plan-max-num-seqs", "0"], {}, {}, "--plan-max-num-seqs"),
    (["--max-num-seqs", "8"], {}, {}, "--max-num-seqs applies to --measure-profile only"),   # not the simulation's
    (["--max_num_batched_tokens=1024"], {}, {}, "--max-num-batched-tokens applies to --measure-profile only"),
    (["--model", "m"], {}, {}, "--model applies to --measure-profile only"),
    (["--plot", "p.png"], {}, {}, "--plot draws the --measured runs"),                   # no PNG, not a word
    ([], {"coef": ["a", 0, 0, 0, 0, 0]}, {}, "--profile: PROFILE: coef"),    # TypeError
    ([], {"coef": 5}, {}, "--profile: PROFILE: coef"),
    ([], {"coef": [NAN, 0, 0, 0, 0, 0]}, {}, "--profile: PROFILE: coef"),     # loaded, every step 0 s
    ([], {"kv_bytes_per_token": -1000}, {}, "--profile: PROFILE: kv_bytes_per_token"),
    ([], {"kv_bytes_per_token": "1000"}, {}, "--profile: PROFILE: kv_bytes_per_token"),
    ([], {"overlap": "false"}, {}, "--profile: PROFILE: overlap"),            # loaded as true
    ([], {"serve_per_seq": -1}, {}, "--profile: PROFILE: serve_per_seq"),
    ([], {"serve_per_admission": INF}, {}, "--profile: PROFILE: serve_per_admission"),
    ([], {"samples": [{"prefill": 1}]}, {}, "--profile: PROFILE: samples"),
    ([], {"machine": 3}, {}, "--profile: PROFILE: machine"),
    ([], {"wake": 5}, {}, "--profile: PROFILE: wake"),
    ([], {"wake": [[0.01, NAN]]}, {}, "--profile: PROFILE: wake"),
    (["--measured", "M"], {}, {"config": {"request_rate": None}}, "--measured 'colocated-1:512:RUN': RUN: "
                                                                  "config.request_rate"),   # TypeError
    (["--measured", "M"], {}, {"config": [1]}, "RUN: config must be an object"),            # TypeError
    (["--measured", "M"], {}, {"requests": [[1, 2]]}, "RUN: requests must be a list"),      # AttributeError
    (["--measured", "M"], {}, {"p99_itl_ms": "9"}, "RUN: p99_itl_ms"),
    (["--measured", "M"], {}, {"prefix_cache_hit_rate": "high"}, "RUN: prefix_cache_hit_rate"),
    (["--measured", "M"], {}, {"requests": [dict(GOOD_REQUEST, itls=[-1])]}, "RUN: requests[0].itls"),
    (["--measured", "M"], {}, {"requests": [dict(GOOD_REQUEST, prompt_len=8.5)]}, "RUN: requests[0].prompt_len"),
    (["--calibrate", "M"], {}, {"requests": [{k: v for k, v in GOOD_REQUEST.items() if k != "ttft"}]},
     "--calibrate 'colocated-1:512:RUN': RUN: requests[0].ttft"),                           # KeyError
    (["--calibrate", "M"], {}, {"requests": [dict(GOOD_REQUEST, success=False)]}, "RUN: requests: the run has no"),
])
def test_plan_refuses_bad_input_naming_the_flag_or_field(tmp_path, capsys, flags, profile, run, names):
    """A bad flag, step profile or measured run is an error line that names the flag, or the file and its field
    (exit 2, as cli.py prints a ValueError): not a traceback, not a plan of negative times or of no good request."""
    prof, res = tmp_path / "prof.json", tmp_path / "run.json"
    prof.write_text(json.dumps({**GOOD_PROFILE, **profile}))
    res.write_text(json.dumps({**GOOD_RUN, **run}))
    flags = [f"colocated-1:512:{res}" if f == "M" else f for f in flags]
    assert main(["plan", "--profile", str(prof), "--num-prompts", "20", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("picovllm plan: error: "), err
    assert names.replace("PROFILE", str(prof)).replace("RUN", str(res)) in err, err


def test_plan_takes_the_good_inputs_of_that_table(tmp_path, capsys):
    """The table's inputs but the field it spoils: a plan, calibrated and compared (a run sent all at once has its
    rate written "inf" by bench serve)."""
    prof, res = tmp_path / "prof.json", tmp_path / "run.json"
    prof.write_text(json.dumps(GOOD_PROFILE))
    res.write_text(json.dumps(dict(GOOD_RUN, config={"request_rate": "inf"}, prefix_cache_hit_rate=None)))
    spec = f"colocated-1:512:{res}"
    assert main(["plan", "--profile", str(prof), "--num-prompts", "20", "--calibrate", spec, "--measured", spec]) == 0
    assert "@ inf/s" in capsys.readouterr().out

@pytest.mark.parametrize("make, field", [
    (lambda: Deployment(1, 1, 512, transfer_bw=0.0), "transfer_bw"),       # ZeroDivisionError
    (lambda: Deployment(1, 1, 512, transfer_bw=-1e5), "transfer_bw"),      # the KV at D before P finished
    (lambda: Deployment(1, 1, 512, transfer_bw=NAN), "transfer_bw"),
    (lambda: Deployment(1, 1, 512, transfer_latency=-1.0), "transfer_latency"),
    (lambda: Deployment(1, 1, 512, transfer_latency=INF), "transfer_latency"),
    (lambda: Deployment(1, 1, 0), "chunk"),
    (lambda: Deployment(1, 1, 512, max_num_seqs=0), "max_num_seqs"),
    (lambda: Traffic(NAN, Lengths(8, 8), Lengths(2, 2)), "rate"),             # IndexError in the simulation
    (lambda: Traffic(INF, Lengths(8, 8), Lengths(2, 2)), "rate"),
    (lambda: Traffic(1.0, Lengths(8, 8), Lengths(2, 2), num_requests=0), "num_requests"),
])
def test_a_bad_deployment_or_traffic_is_refused_naming_the_field(make, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        make()


def test_idle_overhead_by_hand():
    """A request that finds its instance with no step running pays idle_overhead on top of request_overhead;
    one that arrives during a step does not."""
    step = PROFILE.step_time
    dep = Deployment(0, 1, chunk=512, request_overhead=2e-3, idle_overhead=1e-3)
    a, b = simulate(PROFILE, dep, [SimRequest(1.0, 100, 1), SimRequest(1.0 + step(100, 0, 0) / 2, 50, 1)]).requests
    assert a.found_idle and not b.found_idle
    assert a.token_times == pytest.approx([1.0 + step(100, 0, 0) + 3e-3])
    assert b.token_times == pytest.approx([1.0 + step(100, 0, 0) + step(50, 0, 0) + 2e-3])


def test_wake_time_by_hand():
    """The wake-up cost between measured points: linear in log(idle) (at the geometric mean, the points' mean),
    from nothing at no idle up to the first point, the last point's beyond the last."""
    prof = dataclasses.replace(PROFILE, wake=[[0.001, 1e-4], [0.1, 9e-4], [1.0, 1e-3]])
    assert prof.wake_time(0.0) == 0.0 and PROFILE.wake_time(5.0) == 0.0      # no wake measured: nothing
    assert prof.wake_time(0.0005) == pytest.approx(5e-5)
    assert prof.wake_time(0.01) == pytest.approx(5e-4)                        # halfway in log from 1 ms to 100 ms
    assert prof.wake_time(0.1) == pytest.approx(9e-4)
    assert prof.wake_time(5.0) == prof.wake_time(float("inf")) == pytest.approx(1e-3)


def test_the_first_step_after_idle_pays_the_wake_by_hand():
    """A step planned on an idle instance lasts wake_time(how long it idled) more (since ever: the last point's);
    a step that follows another at once, nothing more."""
    step = PROFILE.step_time
    prof = dataclasses.replace(PROFILE, wake=[[0.001, 1e-4], [0.1, 9e-4]])
    a_end = 1.0 + step(100, 0, 0) + 9e-4                                      # idle since ever
    reqs = [SimRequest(1.0, 100, 2), SimRequest(a_end + step(0, 1, 101) + 0.01, 50, 1),
            SimRequest(a_end + step(0, 1, 101) + 0.01 + 1e-4, 30, 1)]
    a, b, c = simulate(prof, Deployment(0, 1, chunk=512), reqs).requests
    assert a.token_times == pytest.approx([a_end, a_end + step(0, 1, 101)])   # its decode follows at once
    b_end = reqs[1].arrival + step(50, 0, 0) + 5e-4                            # after 10 ms of quiet
    assert b.token_times == pytest.approx([b_end])
    assert c.token_times == pytest.approx([b_end + step(30, 0, 0)])           # arrived during b's step
    pd = simulate(prof, Deployment(1, 1, chunk=512, transfer_bw=1e6, transfer_latency=0.01), reqs[:1]).requests[0]
    arrive = a_end + 100 * 1000 / 1e6 + 0.01                                  # D idle since ever as well
    assert pd.token_times == pytest.approx([a_end, arrive + step(0, 1, 101) + 9e-4])


@pytest.mark.parametrize("wake", [[[0.01, 1e-3], [0.001, 2e-3]], [[0.001, 2e-3], [0.01, 1e-3]], [[0.0, 1e-3]],
                                  [[0.001]], "x"])
def test_a_bad_wake_is_refused_naming_it(tmp_path, wake):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(dict(dataclasses.asdict(PROFILE), wake=wake)))
    with pytest.raises(ValueError, match="wake"):
        StepProfile.load(str(path))


def test_host_overheads_and_noise_by_hand():
    """The noise pools shift the client's view: the first token by a TTFT residual, each later gap by a gap
    residual (never below zero), an xPyD request's first gap by a handover residual; pools are drawn without
    replacement, a fresh shuffle per pass."""
    from picovllm.planner.simulator import HostNoise
    step = PROFILE.step_time
    req = [SimRequest(1.0, 100, 4)]
    dep = Deployment(0, 1, chunk=512, request_overhead=2e-3, noise=HostNoise(ttft=(5e-3,), gap=(-1.0,)))
    got = simulate(PROFILE, dep, req).requests[0].token_times
    first = 1.0 + step(100, 0, 0)
    assert got == pytest.approx([first + 2e-3 + 5e-3] * 4)          # gaps of a step - 1 s: clamped to 0
    dep = Deployment(0, 1, chunk=512, noise=HostNoise(gap=(1e-3, 3e-3)))
    got = simulate(PROFILE, dep, req).requests[0].token_times
    gaps = np.diff(got) - [step(0, 1, 101 + i) for i in range(3)]
    assert sorted(gaps[:2]) == pytest.approx([1e-3, 3e-3])          # one pass uses each residual once
    pd = Deployment(1, 1, chunk=512, transfer_bw=1e6, transfer_latency=0.01, handover_overhead=4e-3,
                    noise=HostNoise(gap=(0.0,), handover=(2e-3,)))
    t = simulate(PROFILE, pd, req).requests[0].token_times
    first = 1.0 + step(100, 0, 0)
    arrive = first + 100 * 1000 / 1e6 + 0.01 + 4e-3
    assert t[0] == pytest.approx(first)
    assert t[1] == pytest.approx(arrive + step(0, 1, 101) + 2e-3)
    assert t[2] - t[1] == pytest.approx(step(0, 1, 102))


def _bench_json(res, rate: float) -> dict:
    """A `bench serve --result-json` of a simulated run: what the client saw, per request and in percentiles."""
    reqs = [{"success": True, "start": r.arrival, "ttft": r.token_times[0] - r.arrival,
             "latency": r.token_times[-1] - r.arrival, "itls": list(np.diff(r.token_times)),
             "prompt_len": r.prompt, "output_tokens": r.output} for r in res.requests]
    ttft, itl = res.ttfts() * 1e3, res.itls() * 1e3
    return {"requests": reqs, "completed": len(reqs), "median_ttft_ms": float(np.median(ttft)),
            "p99_ttft_ms": float(np.percentile(ttft, 99)), "median_itl_ms": float(np.median(itl)),
            "p99_itl_ms": float(np.percentile(itl, 99)),
            "config": {"request_rate": rate, "input_len": 100, "output_len": 8}}


@pytest.mark.parametrize("num_prefill", [0, 1], ids=["colocated", "1P1D"])
def test_calibration_recovers_what_the_steps_do_not_hold(num_prefill):
    """A run 'measured' from the simulation with known overheads and noise: calibrating on it recovers the
    overheads (a gap noise with a mean would read as a step overhead: the time per token cannot tell them
    apart), and the prediction for another run's own arrivals (burstier: twice the rate) is within 20% of what
    that run 'measured', tails included; without the calibration the tails are far off."""
    from picovllm.planner.plan import calibrate, compare, predict_measured
    from picovllm.planner.simulator import HostNoise
    rng = random.Random(7)
    truth = Deployment(num_prefill, 1, chunk=512, transfer_bw=1e9, step_overhead=1e-3, request_overhead=3e-3,
                       idle_overhead=2e-3, handover_overhead=6e-3 if num_prefill else 0.0,
                       noise=HostNoise(ttft=tuple(rng.expovariate(1 / 2e-3) for _ in range(200)),
                                       gap=tuple(rng.choice([-1e-3] * 4 + [4e-3]) for _ in range(400)),
                                       handover=tuple(rng.uniform(-2e-3, 2e-3) for _ in range(200)) if num_prefill
                                       else (), seed=1))
    runs = {rate: _bench_json(simulate(SIX, truth, make_requests(Traffic(rate, Lengths(100, 100), Lengths(8, 8),
                                                                             300, seed=int(rate)))), rate)
            for rate in (20.0, 40.0)}
    bare = Deployment(num_prefill, 1, chunk=512, transfer_bw=1e9)
    cal = calibrate(SIX, bare, runs[20.0])
    noise_median = float(np.median(truth.noise.ttft))
    assert cal.step_overhead == pytest.approx(1e-3, abs=2e-4)       # the gap noise is zero-mean
    assert cal.request_overhead == pytest.approx(3e-3 + noise_median, rel=0.1)
    assert cal.idle_overhead == pytest.approx(2e-3, abs=6e-4)      # arrivals at an idle instance pay more
    if num_prefill:
        assert cal.handover_overhead == pytest.approx(6e-3, abs=3e-4)
    got = compare(predict_measured(SIX, cal, runs[40.0], 10.0, 10.0), runs[40.0])
    assert all(abs(v["error"]) < 0.2 for v in got.values()), got
    plain = compare(predict_measured(SIX, bare, runs[40.0], 10.0, 10.0), runs[40.0])
    assert abs(plain["itl_p99"]["error"]) > 0.5 and abs(plain["ttft_p99"]["error"]) > 0.5, plain


def test_measured_trace_names_the_field():
    from picovllm.planner.plan import measured_trace
    with pytest.raises(ValueError, match="^requests: the run has no successful request"):
        measured_trace({"requests": [{"success": False}]})
    with pytest.raises(ValueError, match="^requests: each needs start, prompt_len and output_tokens"):
        measured_trace({"requests": [{"success": True, "start": 0.0}]})
    trace, done = measured_trace({"requests": [{"success": True, "start": 2.0, "prompt_len": 5, "output_tokens": 3},
                                               {"success": True, "start": 1.0, "prompt_len": 7, "output_tokens": 2}]})
    assert [(r.arrival, r.prompt, r.output) for r in trace] == [(1.0, 7, 2), (2.0, 5, 3)]


@pytest.mark.parametrize("overlap", [False, True])
def test_profile_times_the_whole_batch(tiny_models, overlap):
    """A decode sample is timed on the batch it names: with a small chunk, filling 8 prompts of 64 tokens takes
    several steps, and the first requests must still decode when the last prompt is in (they used to finish
    first, so a 'batch 32' sample could time a third of that). Overlapped (as a GPU serves), the same steps are
    timed in their stream, and the profile says it overlaps."""
    from picovllm.config import EngineConfig
    from picovllm.engine.llm_engine import Engine
    from picovllm.planner.profile import measure_profile
    engine = Engine(EngineConfig(tiny_models["llama"], block_size=16, num_kv_blocks=128, max_model_len=256,
                                 max_num_batched_tokens=64, async_scheduling=overlap))
    steps = []                       # what each step ran: (prompt tokens computed, requests decoding)
    schedule = engine._schedule

    def recording_schedule():
        sched = schedule()
        if not sched.is_empty():
            steps.append((sum(c.num_new_tokens for c in sched.chunks if not c.is_decode), sched.num_decodes))
        return sched
    engine._schedule = recording_schedule
    prof = measure_profile(engine, prefill_lens=(16,), batches=(8,), contexts=(64,), repeats=3, mixed=((4, 16),),
                           wake_idles=(0.001, 0.01))
    decode = [s for s in prof.samples if s["prefill"] == 0]
    assert [s["batch"] for s in decode] == [8]
    # 8 requests of 64 prompt tokens, each with its first token and at least one more by the timed steps
    assert decode[0]["context"] >= 8 * 66
    mixed = [s for s in prof.samples if s["prefill"] and s["batch"]]
    assert [(s["prefill"], s["batch"]) for s in mixed] == [(16, 4)]
    assert steps.count((16, 4)) >= 3, steps  # the mixed sample's three timed steps: 16 prompt tokens beside 4 decodes
    assert steps.count((0, 8)) >= 3, steps   # and the decode sample's: the whole batch
    assert len(prof.coef) == 7 and not engine.has_unfinished_requests() and prof.overlapped is overlap  # one batch
    assert [w[0] for w in prof.wake] == [0.001, 0.01] and 0 <= prof.wake[0][1] <= prof.wake[1][1]
    # the serving loop's cost a sequence: timed on decode steps of as many requests as the blocks hold, a part of
    # such a step (its outputs' encoding is far less than the step)
    assert max(n for p, n in steps if p == 0) > 8 and 0 < prof.serve_per_seq < decode[0]["seconds"]
    # and an admission's: three requests, each its whole prompt (the chunk's 64 tokens) alone in a step
    assert steps[-6:].count((64, 0)) == 3 and 0 < prof.serve_per_admission < 0.05
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_profile_times_whole_prompts_not_prefix_hits(tiny_models):
    """A lone prompt or a mixed step's chunk is timed on all its tokens: no prompt the profile times begins with the
    blocks of one it ran before (the 64-token prompts used to repeat the 16-token ones' token and found their first
    block cached). Every timed prompt's first chunk starts at token 0, and all of it is computed in its steps."""
    from picovllm.config import EngineConfig
    from picovllm.engine.llm_engine import Engine
    from picovllm.planner.profile import measure_profile
    engine = Engine(EngineConfig(tiny_models["llama"], block_size=8, num_kv_blocks=256, max_model_len=256,
                                 max_num_batched_tokens=128))
    first, computed = {}, {}         # a max_tokens=1 request's (a timed prompt's): where its first chunk began,
    schedule = engine._schedule      # and its prompt tokens scheduled

    def recording_schedule():
        sched = schedule()
        for c in sched.chunks:
            req = c.request
            if not c.is_decode and req.params.max_tokens == 1:
                first.setdefault(req.request_id, req.num_computed_tokens)
                computed[req.request_id] = computed.get(req.request_id, 0) + c.num_new_tokens
        return sched
    engine._schedule = recording_schedule
    prof = measure_profile(engine, prefill_lens=(16, 32, 64), batches=(4,), contexts=(32,), repeats=3,
                           mixed=((4, 16), (4, 32)), wake_idles=(0.001,), passes=1)
    assert set(first.values()) == {0}, first
    timed = [s for s in prof.samples if s["prefill"]]
    assert [s["prefill"] for s in timed] == [16, 32, 64, 16, 32]
    lengths = sorted(computed.values())
    for n in (16, 32, 64):           # three lone prompts and three mixed chunks a length, each whole
        assert lengths.count(n) >= 3 + 3 * (n in (16, 32)), lengths


def test_step_overhead_by_hand_and_calibrated():
    """A served step costs the profile's step plus step_overhead: one request by hand; and a run 'measured'
    with a known step overhead, its client chunks grouping tokens two by two (so no gap is a step), gives
    that overhead back from its time per output token."""
    from picovllm.planner.plan import calibrate
    step = PROFILE.step_time
    so = 0.5e-3
    got = simulate(PROFILE, Deployment(0, 1, chunk=512, step_overhead=so), [SimRequest(1.0, 100, 4)])
    want = [1.0 + step(100, 0, 0) + so]
    for i in range(3):
        want.append(want[-1] + step(0, 1, 101 + i) + so)
    assert got.requests[0].token_times == pytest.approx(want)
    # alone, each request's decode steps are batch 1: its time per token is known in closed form
    reqs = [SimRequest(float(i), 100, 9) for i in range(5)]
    per_token = np.mean([step(0, 1, 101 + i) for i in range(8)]) + so
    records = []
    for r in reqs:
        first = r.arrival + step(100, 0, 0) + so
        chunks = [first + per_token * k for k in (0, 2, 4, 6, 8)]      # tokens 1, 3, 5, 7, 9 close a chunk
        records.append({"success": True, "start": r.arrival, "ttft": first - r.arrival, "prompt_len": 100,
                        "output_tokens": 9, "itls": list(np.diff(chunks))})
    cal = calibrate(PROFILE, Deployment(0, 1, chunk=512), {"requests": records})
    assert cal.step_overhead == pytest.approx(so, rel=1e-3)
    assert cal.request_overhead == pytest.approx(0.0, abs=1e-9)


def test_a_run_without_usage_replays_a_token_a_chunk():
    """A server that sends no usage leaves output_tokens 0 (check_run takes it): as bench serve counts such a request,
    its tokens are its chunks, and the run is predicted and calibrated as the same run with those counts written."""
    from picovllm.planner.plan import calibrate, measured_trace, predict_measured
    records = [{"success": True, "start": 0.3 * i, "prompt_len": 60 + i, "output_tokens": 3 + i, "ttft": 0.01,
                "latency": 0.1, "itls": [0.004 + 1e-4 * k for k in range(2 + i)]} for i in range(4)]
    counted = {"config": {"request_rate": 3}, "requests": records}
    unknown = {"config": {"request_rate": 3}, "requests": [dict(r, output_tokens=0) for r in records]}
    assert [r.output for r in measured_trace(unknown)[0]] == [len(r["itls"]) + 1 for r in records]
    dep = Deployment(0, 1, chunk=512)
    assert predict_measured(PROFILE, dep, unknown, 1.0, 1.0) == predict_measured(PROFILE, dep, counted, 1.0, 1.0)
    assert calibrate(PROFILE, dep, unknown).step_overhead == calibrate(PROFILE, dep, counted).step_overhead > 0


def test_measured_goodput_and_the_best_by_rate():
    """Goodput of a measured run by hand: of three requests over 2 s, one misses the TTFT SLO and one has a
    gap over the ITL SLO; and per rate, the planner's first (predicted goodput) checked against the measured."""
    from picovllm.planner.plan import best_by_rate, measured_goodput
    recs = [{"success": True, "start": 0.0, "ttft": 0.01, "latency": 0.5, "itls": [0.01, 0.02]},
            {"success": True, "start": 1.0, "ttft": 0.30, "latency": 0.6, "itls": [0.01]},
            {"success": True, "start": 1.5, "ttft": 0.01, "latency": 0.5, "itls": [0.2]},
            {"success": False}]
    assert measured_goodput({"requests": recs}, ttft_slo=0.1, itl_slo=0.05) == pytest.approx(1 / 2.0)

    def run(name, rate, pred, meas):
        return {"deployment": name, "rate": rate, "predicted": {"ttft_p99": 0.0},
                "goodput": {"predicted": pred, "measured": meas}}
    got = best_by_rate([run("A", 2.0, 1.9, 2.0), run("B", 2.0, 1.0, 1.5), run("A", 5.0, 4.0, 3.0),
                        run("B", 5.0, 3.0, 4.0)])
    assert [(b["rate"], b["recommended"], b["measured_best"], b["agree"]) for b in got] == \
        [(2.0, "A", "A", True), (5.0, "A", "B", False)]


def test_profile_passes_agree_by_their_median_difference():
    """measure_profile takes its samples again until two passes agree: by hand, the median relative difference of
    the same steps against the tolerance (a drifting machine's pass differs in most samples, a noisy one in few)."""
    from picovllm.planner.profile import _agrees
    a = [{"seconds": s} for s in (1.0, 2.0, 3.0, 4.0, 5.0)]
    noisy = [{"seconds": s} for s in (1.05, 2.0, 3.9, 4.1, 5.0)]        # differences 5, 0, 30, 2.5, 0%: median 2.5%
    slow = [{"seconds": s * 1.3} for s in (1.0, 2.0, 3.0, 4.0, 5.0)]
    assert _agrees(a, noisy, 0.1) and not _agrees(a, slow, 0.1) and _agrees(a, slow, 0.31)
    assert not _agrees(a, a[:4], 0.1)                                    # not the same steps


def test_step_log_records_each_scheduled_step(tiny_models, tmp_path):
    """PICOVLLM_STEP_LOG: each scheduled step's prompt tokens, decodes, sequences, waiting requests, the decodes'
    tokens and the requests it schedules first, written when the process exits. By hand: two 20-token prompts under a 16-token budget, 3 tokens each."""
    import os
    import subprocess
    import sys
    code = ("from picovllm import LLM, SamplingParams\n"
            f"llm = LLM({tiny_models['llama']!r}, max_model_len=64, num_kv_blocks=32, max_num_batched_tokens=16,"
            " enforce_eager=True, enable_prefix_caching=False)\n"
            "llm.generate([[5] * 20, [6] * 20], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)\n"
            "llm.engine.overlap = True\n"     # the same engine overlapped: each step's marks
            "llm.generate([[7] * 20], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)\n")
    env = dict(os.environ, PICOVLLM_STEP_LOG=str(tmp_path / "steps"),
               PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    [log] = [p for p in tmp_path.glob("steps.*") if p.suffix != ".gc"]
    gcs = json.loads(log.with_name(log.name + ".gc").read_text())    # the process's collections: (start, gen, s, n)
    assert gcs and all(g[1] in (0, 1, 2) and 0 <= g[2] < 10 and g[3] >= 0 for g in gcs)
    log = json.loads(log.read_text())
    steps = [tuple(s[1:6]) for s in log]
    # 16 of A; A's last 4 and 12 of B (A samples); A decodes (21 tokens, its next being sampled), B's last 8 (B
    # samples); two decodes (22 + 21); B's last decode (22: A has finished); then C: 16, 4, and three decodes
    assert steps[:5] == [(16, 0, 1, 1, 0), (16, 0, 2, 0, 0), (8, 1, 2, 0, 21), (0, 2, 2, 0, 43), (0, 1, 1, 0, 22)]
    assert steps[5:7] == [(16, 0, 1, 0, 0), (4, 0, 1, 0, 0)] and [s[1] for s in steps[7:]] == [1, 1, 1]
    assert all(s[7:11] == [None] * 4 for s in log[:5])    # not overlapped: no marks
    assert [s[11] for s in log] == [1, 1, 0, 0, 0, 1, 0, 0, 0, 0]     # the steps that took A, B and C in
    cpu = [s[6] for s in log]
    assert cpu == sorted(cpu)
    for s, nxt in zip(log[5:], log[6:] + [None]):   # planned <= prepared <= launched <= read <= returned <= next
        marks = [s[0], s[10], s[7], s[8] if s[8] is not None else s[7], s[9]] + ([nxt[0]] if nxt else [])
        assert marks == sorted(marks) and None not in marks, s
    assert log[5][8] is None and all(s[8] is not None for s in log[6:])    # the first had no step before it
