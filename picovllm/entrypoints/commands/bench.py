"""`picovllm bench ...`: a command group of its own; each benchmark module adds one subcommand.

To add a benchmark, write a module with `add_parser(subparsers)` and list it in BENCH_COMMANDS.
"""
from __future__ import annotations

import importlib

BENCH_COMMANDS: tuple[str, ...] = (
    "picovllm.bench.throughput",   # offline, fixed workloads (nano, cpu-small)
    "picovllm.bench.latency",      # batch-1 decode ms/token, long-prompt prefill tok/s
    "picovllm.bench.serve",        # online, against an OpenAI-compatible server
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (throughput, latency, serve)",
                              description="Benchmarks of the engine and the server.")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for name in BENCH_COMMANDS:
        importlib.import_module(name).add_parser(sub)
