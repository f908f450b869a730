"""EngineConfig's fields as command-line flags (--max-model-len, --num-kv-blocks, ...), read back into an EngineConfig.

Generated from the dataclass, so a new EngineConfig field is a new flag with no edit here.
"""
from __future__ import annotations

import argparse
import dataclasses

from picovllm.config import EngineConfig

SKIP = ("model",)   # each command declares --model itself (positional or not)


def _flag_type(annotation: str, default):
    if "bool" in annotation:
        return None
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """skip: fields the command declares itself (e.g. `seed`, which generate uses for sampling)."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in SKIP or f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _flag_type(str(f.type), f.default)
        if kind is None:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            group.add_argument(flag, dest=f.name, type=kind, default=f.default, help=f"(default: {f.default})")


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """Raises ValueError naming the bad field (EngineConfig validates)."""
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    kw.update(overrides)
    return EngineConfig(**kw)
