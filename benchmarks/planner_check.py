"""The planner's predictions against a measured run (issue 20): one colocated engine on this machine serves
Poisson traffic in real time at several rates; `picovllm plan`'s simulation predicts the same traffic from a
profile measured on the same engine just before. TTFT and ITL p50/p99, predicted and measured, per rate.

    python benchmarks/planner_check.py [--model M] [--device cpu] [--rates 2 4 8] [--num-requests 60]
                                       [--prompt-len 64:256] [--output-len 16:64]
Without --model: the default model (SmolLM2-135M, GGUF, quantized on the CPU).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from picovllm import EngineConfig, SamplingParams
from picovllm.engine.llm_engine import Engine
from picovllm.entrypoints.commands.plan import _range
from picovllm.planner.profile import measure
from picovllm.planner.simulate import Fleet, Traffic, simulate


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


def serve(eng: Engine, traffic: Traffic) -> dict:
    """Add each request at its arrival time (in real time) and step the engine; latencies from the outputs."""
    reqs, rng = traffic.requests(), random.Random(1)
    vocab = min(eng.model_config.vocab_size, 10000)
    t0, wall0, i, finals = time.perf_counter(), time.time(), 0, []
    while len(finals) < len(reqs):
        now = time.perf_counter() - t0
        while i < len(reqs) and reqs[i][0] <= now:
            at, p, o = reqs[i]
            eng.add_request([rng.randrange(vocab) for _ in range(p)],
                            SamplingParams(temperature=0, max_tokens=o, ignore_eos=True), arrival_time=wall0 + at)
            i += 1
        if eng.has_unfinished_requests():
            finals += [out for out in eng.step() if out.finished]
        elif i < len(reqs):
            time.sleep(max(0.0, reqs[i][0] - (time.perf_counter() - t0)))
    ttft = [o.metrics.token_times[0] - o.metrics.arrival_time for o in finals]
    itl = [g for o in finals for g in o.metrics.itls]
    return {"ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8])
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument("--prompt-len", type=_range, default=(64, 256))
    ap.add_argument("--output-len", type=_range, default=(16, 64))
    args = ap.parse_args()
    eng = Engine(EngineConfig(args.model, device=args.device, enable_prefix_caching=False))
    profile = measure(eng)
    fleet = Fleet(colocated=1, chunk=eng.config.max_num_batched_tokens, max_num_seqs=eng.config.max_num_seqs)
    rows = []
    for rate in args.rates:
        traffic = Traffic(rate, args.prompt_len, args.output_len, args.num_requests, seed=int(rate * 10))
        predicted = simulate(profile, fleet, traffic).summary()
        measured = serve(eng, traffic)
        row = {"rate": rate}
        for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
            row[k] = {"predicted": round(predicted[k] * 1e3, 2), "measured": round(measured[k] * 1e3, 2),
                      "error": round(predicted[k] / measured[k] - 1, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"profile": profile.__dict__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
