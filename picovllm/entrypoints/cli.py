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
import re
import sys
import warnings

from picovllm.entrypoints.vllm_args import vllm_argv

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


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: a flag it does not know is its error, under its usage line (argparse hands unknown
    flags up to the top level's, whose usage names no flag), and named before a positional it left missing. Its
    arguments are read as vLLM's parser reads them (vllm_args.vllm_argv: --max_model_len, --config FILE.yaml)."""

    def parse_known_args(self, args=None, namespace=None):
        self._given = vllm_argv(list(sys.argv[1:] if args is None else args), self)
        args = self._given
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def error(self, message: str):
        if message.startswith("the following arguments are required"):
            unknown = [a for a in getattr(self, "_given", ()) if _is_unknown_flag(self, a)]
            if unknown:
                message = f"unrecognized arguments: {' '.join(unknown)}"
        super().error(message)


def _is_unknown_flag(parser: argparse.ArgumentParser, arg: str) -> bool:
    found = parser._parse_optional(arg)    # None: a positional (or a negative number); an unknown flag: (None, ...)
    found = found if isinstance(found, list) else [found]       # Python 3.12.7+: a list of matches
    return any(f is not None and f[0] is None for f in found)


class VersionAction(argparse.Action):
    """--version: the server module that knows the version loads fastapi, so only when asked (--help stays light)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from picovllm.entrypoints.openai.api_server import package_version
        print(package_version())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="picovllm", description="picovllm: a compact LLM inference engine")
    parser.add_argument("--version", action=VersionAction)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=CommandParser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command args ran, e.g. `bench throughput`'s."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None:
            return parser
        parser = sub.choices[getattr(args, sub.dest)]


def with_flag_names(message: str, parser: argparse.ArgumentParser) -> str:
    """`EngineConfig.max_model_len ...` as `--max-model-len ...`: a config's field as the flag the user typed, where
    the command has one (EngineConfig and SamplingParams name their fields; the CLI's user knows flags)."""
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}

    def flag(m: re.Match) -> str:       # a field's own field: `--speculative-config's method`
        name = flags.get(m.group(1))
        return m.group(0) if name is None else name + ("'s " if m.group(2) else "")
    return re.sub(r"\b(?:EngineConfig|SamplingParams)\.(\w+)(\.)?", flag, message)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "disk_cache", True) is False:    # --no-disk-cache: the kernels' cache too, in every process
        os.environ["PICOVLLM_NO_CACHE"] = "1"
    prefix = f"picovllm {args.command}"
    with warnings.catch_warnings():
        # a warning is a line for the user, as an error is: no source line (once per place, as Python's default)
        def show(message, category, filename, lineno, file=None, line=None):
            text = str(message).removeprefix("picovllm: ")
            print(f"{prefix}: warning: {text}", file=sys.stderr if file is None else file)
        warnings.showwarning = show
        try:
            return args.func(args) or 0
        except ValueError as e:     # bad input or flag values: EngineConfig and friends name the field
            print(f"{prefix}: error: {with_flag_names(str(e), command_parser(parser, args))}", file=sys.stderr)
            return 2
        except OSError as e:        # a file that cannot be read or written (the error names it)
            print(f"{prefix}: error: {e}", file=sys.stderr)
            return 1
        except SystemExit as e:     # a server's start-up refusal, `raise SystemExit("error: ...")`: as an argument
            if not (isinstance(e.code, str) and e.code.startswith("error: ")):      # error's line and code
                raise
            print(f"{prefix}: {e.code}", file=sys.stderr)
            raise SystemExit(2) from None
        except KeyboardInterrupt:       # Ctrl-C: a streamed line left part way ends, so the shell's prompt does not
            print(file=sys.stderr)      # follow it on the same line
            return 130


if __name__ == "__main__":
    sys.exit(main())
