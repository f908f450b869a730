"""`picovllm plan`: measure an engine's step costs, then predict colocated and xPyD deployments (picovllm/planner)."""
from __future__ import annotations

import argparse
import json
import sys

from picovllm.entrypoints.engine_args import add_engine_args, engine_config_from_args
from picovllm.entrypoints.commands.args import SERVER_ONLY

PREFIX_HITS_WARN = 0.05   # a measured run whose servers took more of its prompt tokens from their prefix cache


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="recommend x prefill : y decode instances and the chunk size for a traffic and SLOs",
        description="Measure what an engine step costs on this machine (--measure-profile, with the engine flags), "
                    "or load such a profile (--profile), then simulate the traffic through colocated and every "
                    "xPyD deployment of --num-instances at each --chunks size, and rank them by goodput under "
                    "the SLOs. --measured compares a prediction with `picovllm bench serve --result-json` runs.")
    p.add_argument("--profile", required=True, help="the step profile (JSON): written by --measure-profile, else read")
    p.add_argument("--measure-profile", action="store_true", help="measure it now on --model (engine flags apply)")
    p.add_argument("--request-rate", type=float, default=4.0, help="requests per second (Poisson)")
    p.add_argument("--input-len", default="256", help="prompt tokens: N or LO-HI (uniform)")
    p.add_argument("--output-len", default="64", help="output tokens: N or LO-HI (uniform)")
    p.add_argument("--num-prompts", type=int, default=1000, help="requests simulated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo-ms", type=float, default=500.0)
    p.add_argument("--itl-slo-ms", type=float, default=50.0, help="holds for every gap of a request (as bench serve)")
    p.add_argument("--num-instances", type=int, default=2, help="instances (GPUs) to split into P and D")
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 2048], help="max_num_batched_tokens to try")
    p.add_argument("--plan-max-num-seqs", type=int, default=256, help="max_num_seqs of the simulated instances")
    p.add_argument("--transfer-gbps", type=float, default=10.0, help="a KV pull's bandwidth, GB/s")
    p.add_argument("--measured", nargs="*", default=[],
                   help="compare with measured runs: DEPLOYMENT:CHUNK:RESULT.json (DEPLOYMENT colocated-N or xPyD; "
                        "rate from the JSON's config, arrivals and lengths from its requests)")
    p.add_argument("--calibrate", nargs="*", default=[],
                   help="measured runs (as --measured) that set what the steps do not hold: HTTP and tokenization "
                        "(a colocated run's TTFT), the router's P-to-D hop (an xPyD run's first gap), and the "
                        "spread of both and of the token gaps as the client sees them (the tails)")
    p.add_argument("--plot", default=None, help="with --measured: a PNG of predicted against measured")
    p.add_argument("--result-json", default=None)
    p.add_argument("--model", default=None, help="with --measure-profile: the model (default: SmolLM2-135M-Instruct)")
    add_engine_args(p, skip=("seed",) + SERVER_ONLY)
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from picovllm.planner.plan import best_by_rate, candidate_deployments, compare, plan, plot_comparisons
    from picovllm.planner.profile import StepProfile, measure_profile
    from picovllm.planner.simulator import Lengths, Traffic

    _check_flags(args)
    traffic = Traffic(args.request_rate, Lengths.parse("--input-len", args.input_len),
                      Lengths.parse("--output-len", args.output_len), args.num_prompts, args.seed)
    deployments = candidate_deployments(args.num_instances, args.chunks, args.plan_max_num_seqs,
                                        args.transfer_gbps * 1e9)
    if args.measure_profile:
        from picovllm.engine.llm_engine import Engine
        engine = Engine(engine_config_from_args(args, model=args.model))   # overlapped as served (GPU)
        profile = measure_profile(engine)
        profile.save(args.profile)
        print(f"step profile of {profile.machine}: coef {[f'{c:.3g}' for c in profile.coef]}, serving "
              f"{profile.serve_per_seq * 1e6:.1f} us a sequence, {profile.serve_per_admission * 1e3:.3f} ms an "
              f"admission -> {args.profile}")
    else:
        try:
            profile = StepProfile.load(args.profile)
        except ValueError as e:         # cli.py prints it as an error line (exit 2); an OSError names the file
            raise ValueError(f"--profile: {e}") from None
    slo_ttft, slo_itl = args.ttft_slo_ms / 1e3, args.itl_slo_ms / 1e3
    runs: dict[str, dict] = {}      # each measured run's JSON, read once (a calibration run is measured too)
    overheads = _overheads(args, profile, runs)
    if overheads:
        print("calibrated overheads: " + "; ".join(f"{kind}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in o.items()
                                                                           if k != "noise")
                                                  for kind, o in overheads.items()))
        deployments = [with_overheads(d, overheads) for d in deployments]
    rows = plan(profile, traffic, deployments, slo_ttft, slo_itl)
    print(f"{'deployment':<28}{'goodput/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}  (ms)")
    for r in rows:
        print(f"{r['deployment']:<28}{r['goodput']:>10.2f}{r['ttft_p50'] * 1e3:>10.1f}{r['ttft_p99'] * 1e3:>10.1f}"
              f"{r['itl_p50'] * 1e3:>9.1f}{r['itl_p99'] * 1e3:>9.1f}")
    print(f"recommended: {rows[0]['deployment']}")
    comparisons = [_compare_one(spec, profile, args, slo_ttft, slo_itl, compare, overheads, runs)
                   for spec in args.measured]
    for c in comparisons:
        errs = ", ".join(f"{m} {v['predicted'] * 1e3:.1f}/{v['measured'] * 1e3:.1f} ms ({v['error']:+.0%})"
                         for m, v in c["comparison"].items() if v["error"] is not None)
        g = c["goodput"]
        print(f"{c['label']}{' (calibration run)' if c['calibration'] else ''}: predicted/measured {errs}, "
              f"goodput {g['predicted']:.2f}/{g['measured']:.2f} req/s")
    best = best_by_rate(comparisons)
    for b in best:
        print(f"@ {b['rate']:g}/s, among those measured: the planner recommends {b['recommended']}; best measured "
              f"goodput: {b['measured_best']} ({'agree' if b['agree'] else 'DISAGREE'})")
    if args.plot and comparisons:
        plot_comparisons(comparisons, args.plot)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"profile": args.profile, "ranked": rows, "measured": comparisons, "best_by_rate": best}, f,
                      indent=1)
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """The numeric flags, each named as typed (the planner's dataclasses name their own fields, not the flags). NaN
    and inf are refused: NaN passes a plain `<= 0` check, and an infinite rate or SLO means nothing to plan for."""
    from picovllm.entrypoints.commands.args import add_model_and_engine_args, flags_given
    from picovllm.planner.profile import check_number
    if not args.measure_profile:        # the engine flags set the engine the profile is measured on, nothing else
        given = flags_given(args, add_model_and_engine_args)
        if given:
            raise ValueError(f"{given[0]} applies to --measure-profile only (the simulated instances take "
                             f"--chunks and --plan-max-num-seqs)")
    if args.plot and not args.measured:
        raise ValueError("--plot draws the --measured runs: give --measured too")
    for flag in ("--request-rate", "--ttft-slo-ms", "--itl-slo-ms", "--transfer-gbps"):
        check_number(getattr(args, flag[2:].replace("-", "_")), flag, above=True)
    for flag in ("--num-prompts", "--num-instances", "--plan-max-num-seqs"):
        check_number(getattr(args, flag[2:].replace("-", "_")), flag, low=1, integer=True)
    for chunk in args.chunks:
        check_number(chunk, "--chunks", low=1, integer=True)


def _read_measured(flag: str, spec: str, args, runs: dict[str, dict]) -> tuple:
    """--measured or --calibrate's DEPLOYMENT:CHUNK:RESULT.json -> (Deployment, the run's request rate, the bench
    serve result). runs: the results read so far, by path; a new one is read into it and checked (plan.check_run),
    with a warning if its servers had most of its prompts cached."""
    from picovllm.planner.plan import check_run, measured_trace
    from picovllm.planner.simulator import Deployment

    try:
        shape, chunk, path = spec.split(":", 2)
        if shape.startswith("colocated-"):
            x, y = 0, int(shape.split("-", 1)[1])
        else:
            x, y = (int(v) for v in shape.upper().removesuffix("D").split("P"))
        dep = Deployment(x, y, int(chunk), args.plan_max_num_seqs, args.transfer_gbps * 1e9)
    except ValueError as e:
        raise ValueError(f"{flag} {spec!r}: not DEPLOYMENT:CHUNK:RESULT.json ({e})") from None
    if path not in runs:
        with open(path) as f:
            try:
                measured = json.load(f)
                check_run(measured)
                measured_trace(measured)        # and it has a successful request to replay
            except ValueError as e:
                raise ValueError(f"{flag} {spec!r}: {path}: {e}") from None
        _warn_prefix_hits(path, measured)
        runs[path] = measured
    return dep, float(runs[path]["config"]["request_rate"]), runs[path]


def _warn_prefix_hits(path: str, measured: dict) -> None:
    hits = measured.get("prefix_cache_hit_rate")     # bench serve's, from the servers' counters (None: unknown)
    if hits is not None and hits > PREFIX_HITS_WARN:
        print(f"warning: {path}: the servers took {hits:.0%} of the run's prompt tokens from their prefix cache, "
              f"which the simulation does not have, so its TTFT is not comparable: send prompts new to the servers "
              f"(bench serve --seed)", file=sys.stderr)


def _overheads(args, profile, runs: dict[str, dict]) -> dict:
    """--calibrate: per kind ("colocated", "xpyd"), what the steps do not hold: the request's overhead (HTTP,
    tokenization; behind the router its hop to P too), xPyD the handover's (P to D), and their noise."""
    from picovllm.planner.plan import calibrate

    found: dict[str, dict] = {}
    for spec in args.calibrate:
        dep, _, measured = _read_measured("--calibrate", spec, args, runs)
        cal = calibrate(profile, dep, measured, args.seed)
        kind = "xpyd" if dep.num_prefill else "colocated"
        found[kind] = {"step_overhead": cal.step_overhead, "request_overhead": cal.request_overhead,
                       "idle_overhead": cal.idle_overhead, "noise": cal.noise}
        if dep.num_prefill:
            found[kind]["handover_overhead"] = cal.handover_overhead
    return found


def with_overheads(dep, overheads: dict):
    import dataclasses
    kind = "xpyd" if dep.num_prefill else "colocated"
    other = "colocated" if kind == "xpyd" else "xpyd"
    mine = {**{k: v for k, v in overheads.get(other, {}).items() if k in ("request_overhead", "idle_overhead")},
            **overheads.get(kind, {})}
    return dataclasses.replace(dep, **mine)


def _compare_one(spec: str, profile, args, slo_ttft: float, slo_itl: float, compare, overheads: dict,
                 runs: dict[str, dict]) -> dict:
    """A measured run against the prediction for its own arrivals and lengths (bursts included)."""
    from picovllm.planner.plan import measured_goodput, predict_measured

    dep, rate, measured = _read_measured("--measured", spec, args, runs)
    dep = with_overheads(dep, overheads)
    predicted = predict_measured(profile, dep, measured, slo_ttft, slo_itl)
    goodput = {"predicted": predicted["goodput"], "measured": measured_goodput(measured, slo_ttft, slo_itl)}
    return {"label": f"{dep.name} @ {rate:g}/s", "deployment": dep.name, "rate": rate,
            "predicted": predicted, "comparison": compare(predicted, measured), "goodput": goodput,
            "calibration": spec in args.calibrate, "prefix_cache_hit_rate": measured.get("prefix_cache_hit_rate")}
