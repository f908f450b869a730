"""`picovllm router`: the OpenAI API in front of a fleet of prefill and decode instances (picovllm/disagg/router.py)."""
from __future__ import annotations

import argparse
import math

from picovllm.entrypoints.openai.cli_proxy import add_front_end_args


def seconds(text: str) -> float:
    """A positive, finite number of seconds (a lease of 0 would have the health checks run back to back)."""
    n = float(text)
    if not (math.isfinite(n) and n > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return n


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("router", help="the OpenAI API in front of a fleet of prefill and decode instances",
                              description="Route each request to a prefill instance, then any decode instance "
                                          "(`picovllm serve --role p|d --kv-transfer tcp`); instances may be added "
                                          "and removed at run time (/admin/instances, signed with the fleet's "
                                          "shared secret).")
    p.add_argument("--prefill", nargs="*", default=[], help="prefill instances' base URLs at start-up")
    p.add_argument("--decode", nargs="*", default=[], help="decode instances' base URLs at start-up")
    p.add_argument("--prefill-policy", default="prefix", choices=["round_robin", "least_loaded", "prefix"],
                   help="how a prefill instance is picked (prefix: the one likely to hold the prompt's leading "
                        "blocks, unless it is much busier than the least loaded)")
    p.add_argument("--decode-policy", default="least_loaded", choices=["round_robin", "least_loaded"])
    p.add_argument("--pd-secret-file", default=None,
                   help="the fleet's shared secret (first line of the file; default $PICOVLLM_PD_SECRET)")
    p.add_argument("--lease", type=seconds, default=10.0,
                   help="seconds an instance may fail its health checks before it leaves the rotation")
    add_front_end_args(p, "the first prefill instance's model path", "the instances")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from picovllm.disagg.router_server import main as run_router
    return run_router(args)
