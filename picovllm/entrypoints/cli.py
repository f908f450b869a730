"""The `picovllm` command: one argparse subcommand per job, each group of commands in its own module.

A command module has `add_parser(subparsers)`, which adds its subcommand(s) and sets
`func=handler(args) -> int | None` on each. To add a command, write such a module and list it in
COMMAND_MODULES (a `bench` benchmark goes in commands/bench.py's BENCH_COMMANDS instead). Handlers
import the engine themselves, so building the parser stays light.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# OpenMP threads that spin at barriers stall whenever another process holds a core: on 2 busy cores
# the cpu-small benchmark ran 4.5x slower with torch's 2 threads than with sleeping waits, which
# cost a few percent on an idle machine. Set before torch loads OpenMP; the user's setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

COMMAND_MODULES: tuple[str, ...] = (
    "picovllm.entrypoints.commands.generate",   # generate, chat, batch
    "picovllm.entrypoints.openai.cli_serve",    # serve (also --role p|d)
    "picovllm.entrypoints.openai.run_batch",    # run-batch (OpenAI's batch file format, as vLLM's)
    "picovllm.entrypoints.openai.cli_proxy",    # proxy (in front of prefill/decode server pairs)
    "picovllm.entrypoints.openai.cli_router",   # router (in front of a fleet: any prefill to any decode)
    "picovllm.entrypoints.commands.bench",      # bench throughput | latency | serve
    "picovllm.entrypoints.commands.cache",      # cache (list, --clear)
    "picovllm.entrypoints.commands.plan",       # plan (size a PD fleet from a measured step profile)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="picovllm", description="picovllm: a compact LLM inference engine")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "disk_cache", True) is False:    # --no-disk-cache: the kernels' cache too, in every process
        os.environ["PICOVLLM_NO_CACHE"] = "1"
    try:
        return args.func(args) or 0
    except ValueError as e:     # bad input or flag values: EngineConfig and friends name the field
        print(f"picovllm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:        # a file that cannot be read or written (the error names it)
        print(f"picovllm {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
