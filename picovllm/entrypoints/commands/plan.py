"""`picovllm plan`: which fleet (colocated, or x prefill + y decode engines) and which prefill chunk size serve a
described traffic best under TTFT and inter-token-latency SLOs, by simulating each (picovllm/planner)."""
from __future__ import annotations

import argparse
import json


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI, got {text!r}") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return a, b


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="recommend colocated vs x prefill + y decode engines for a traffic",
                              description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="a profile JSON (from --save-profile)")
    src.add_argument("--model", help="measure a profile of this model on this machine first")
    p.add_argument("--device", default="auto")
    p.add_argument("--save-profile", help="where to write the measured profile")
    p.add_argument("--transfer-gbps", type=float, help="KV transfer bandwidth between engines (GB/s)")
    p.add_argument("--rate", type=float, required=True, help="requests per second (Poisson)")
    p.add_argument("--prompt-len", type=_range, required=True, help="N or LO:HI (uniform)")
    p.add_argument("--output-len", type=_range, required=True, help="N or LO:HI (uniform)")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--engines", type=int, default=2, help="devices to share out among the engines")
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 2048, 8192], help="max_num_batched_tokens to try")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    p.add_argument("--slo-itl", type=float, default=0.05, help="seconds: a request's 99th-percentile gap between tokens")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from picovllm.planner.profile import Profile
    from picovllm.planner.simulate import Traffic, recommend
    if args.rate <= 0 or args.engines < 1 or args.num_requests < 1:
        raise ValueError("--rate must be > 0, --engines and --num-requests >= 1")
    if args.profile:
        profile = Profile.load(args.profile)
    else:
        from picovllm.config import EngineConfig
        from picovllm.engine.llm_engine import Engine
        from picovllm.planner.profile import measure
        engine = Engine(EngineConfig(args.model, device=args.device, enable_prefix_caching=False))
        profile = measure(engine)
        engine.shutdown()
        if args.save_profile:
            profile.save(args.save_profile)
    if args.transfer_gbps:
        profile.transfer_gbps = args.transfer_gbps
    traffic = Traffic(args.rate, args.prompt_len, args.output_len, args.num_requests, args.seed)
    rows = recommend(profile, traffic, args.engines, args.chunks, args.slo_ttft, args.slo_itl, args.max_num_seqs)
    print(f"{'fleet':>16} {'chunk':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'goodput':>8}")
    for r in rows:
        print(f"{r['fleet']:>16} {r['chunk']:>6} {r['ttft_p50']:9.4f} {r['ttft_p99']:9.4f} {r['itl_p50']:8.4f} "
              f"{r['itl_p99']:8.4f} {r['goodput_rps']:8.3f}")
    print(json.dumps({"recommended": rows[0], "profile": profile.__dict__}))
    return 0
