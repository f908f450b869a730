"""The planner (picovllm/planner): the simulation against hand-computed timelines, the fit against known
coefficients, the recommendation on traffic whose answer is clear, and `picovllm plan` end to end."""
import json

import pytest

from picovllm.planner.profile import Profile, fit
from picovllm.planner.simulate import Fleet, Traffic, recommend, simulate

# 10 ms a step, 1 ms a prompt token, nothing else; handovers take 5 ms
PROFILE = Profile(fixed=0.010, per_prompt_token=0.001, per_decode=0.0, per_context_token=0.0,
                  kv_bytes_per_token=0, transfer_latency=0.005)


def test_one_request_colocated_and_chunked():
    r = simulate(PROFILE, Fleet(colocated=1), [(1.0, 100, 3)])
    assert r.ttft == pytest.approx([0.110])                  # one step: 10 ms + 100 tokens
    assert r.itl == pytest.approx([0.010, 0.010])            # two decode steps
    r = simulate(PROFILE, Fleet(colocated=1, chunk=40), [(1.0, 100, 2)])
    assert r.ttft == pytest.approx([0.050 + 0.050 + 0.030])   # chunks of 40, 40, 20


def test_disaggregated_handover_and_a_prefill_between_decodes():
    r = simulate(PROFILE, Fleet(prefill=1, decode=1), [(0.0, 100, 3)])
    assert r.ttft == pytest.approx([0.110])                  # P samples the first token
    assert r.itl == pytest.approx([0.005 + 0.010, 0.010])     # then 5 ms to D, and D's steps
    # colocated, a second prompt arriving mid-decode shares the first one's steps: the decode waits for it
    r = simulate(PROFILE, Fleet(colocated=1), [(0.0, 100, 4), (0.115, 50, 1)])
    # the second waits for step 2 (the first's decode, 0.110-0.120), then shares step 3: 10 ms + 50 tokens
    assert sorted(r.ttft) == pytest.approx([0.180 - 0.115, 0.110])
    assert max(r.itl) == pytest.approx(0.060)                 # the first request's token in that mixed step
    r = simulate(PROFILE, Fleet(prefill=1, decode=1), [(0.0, 100, 4), (0.115, 50, 1)])
    assert max(r.itl) == pytest.approx(0.015)                 # on D nothing interrupts the decodes


def test_fit_recovers_known_coefficients():
    true = (0.004, 2e-5, 3e-4, 1e-6)
    samples = [(p, d, c, true[0] + true[1] * p + true[2] * d + true[3] * c)
               for p, d, c in [(512, 0, 0), (2048, 0, 0), (0, 1, 600), (0, 64, 40000), (0, 16, 9000), (128, 8, 4000)]]
    prof = fit(samples)
    assert (prof.fixed, prof.per_prompt_token, prof.per_decode, prof.per_context_token) == pytest.approx(true, rel=1e-6)


def test_recommendation_separates_prefill_from_tight_decode_slos():
    """Long prompts and a tight ITL SLO: colocated decodes wait behind prompt chunks, 1P1D's do not."""
    prof = Profile(fixed=0.005, per_prompt_token=2e-5, per_decode=1e-4, per_context_token=1e-8,
                   kv_bytes_per_token=100_000, transfer_gbps=50)
    traffic = Traffic(rate=4, prompt_len=(3000, 6000), output_len=(100, 300), num_requests=120)
    rows = recommend(prof, traffic, engines=2, chunks=[2048], slo_ttft=1.0, slo_itl=0.02)
    assert {r["fleet"] for r in rows} == {"2x colocated", "1P1D"}
    assert rows[0]["fleet"] == "1P1D" and rows[0]["goodput_rps"] > rows[1]["goodput_rps"]
    assert rows[0]["itl_p99"] < rows[1]["itl_p99"]


def test_bad_fleets_and_profiles_are_named(tmp_path):
    with pytest.raises(ValueError, match="Fleet"):
        Fleet(colocated=1, prefill=1, decode=1)
    with pytest.raises(ValueError, match="Fleet"):
        Fleet(prefill=1)
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"fixed": 1}))
    with pytest.raises(ValueError, match="not a planner profile"):
        Profile.load(str(bad))


def test_plan_command_measures_and_recommends(tiny_models, tmp_path, capsys):
    from picovllm.entrypoints.cli import main
    prof = tmp_path / "prof.json"
    assert main(["plan", "--model", tiny_models["llama"], "--device", "cpu", "--save-profile", str(prof),
                 "--rate", "5", "--prompt-len", "16:64", "--output-len", "4:16", "--num-requests", "40",
                 "--engines", "3", "--chunks", "128"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["recommended"]["fleet"] in ("3x colocated", "1P2D", "2P1D")
    assert Profile.load(str(prof)).fixed > 0
    assert main(["plan", "--profile", str(prof), "--rate", "0", "--prompt-len", "8", "--output-len", "8"]) == 2
