"""The `picovllm` command. (Minimal: serve and bench serve; other subcommands live on other branches.)"""
from __future__ import annotations

import argparse
import sys

from picovllm.entrypoints.openai import cli_serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="picovllm")
    sub = parser.add_subparsers(dest="command", required=True)
    cli_serve.add_parser(sub)
    from picovllm.disagg import proxy
    proxy.add_parser(sub)
    from picovllm.bench import serve as bench_serve
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve.add_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:     # bad flag values: EngineConfig and friends name the field
        print(f"picovllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
