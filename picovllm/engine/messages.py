"""Typed messages that rank 0 of a tensor-parallel engine sends to its workers, and their wire form.

The wire form is versioned, never pickle: a worker only ever builds the dataclasses below from
plain numbers, strings and lists, and a message from another protocol version fails loudly rather
than letting the ranks run different things. RunStep, sent every step, is a compact binary frame
(engine/step_codec.py: a header and one array per field, the block tables as deltas against the step before, which
the sender's SentTables and the receiver's ReceivedTables keep); the rare control messages are JSON.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any, Union

import torch

from picovllm.config import EngineConfig
from picovllm.engine.step_codec import ReceivedTables, SentTables, decode_step, encode_step, is_step_frame
from picovllm.engine.step_input import StepInput

PROTOCOL_VERSION = 8    # 2: RunStep as a binary frame; 3: with the prompt-logprob rows; 4: SamplingRow
                        # without token_bitmask (a step's masks are StepInput.token_bitmasks, never sent);
                        # 5: SamplingRow.allowed (allowed_token_ids); 6: SamplingRow.bad_after, bad_ban;
                        # 7: SamplingRow.penalty_key, num_outputs, ahead; 8: block tables as deltas


@dataclass(frozen=True)
class Setup:
    """First message: the engine config every rank builds its shard of the model from."""
    config: EngineConfig


@dataclass(frozen=True)
class ProfileKVCache:
    """Every rank measures how many KV blocks fit; the minimum is then all-reduced on the control group."""


@dataclass(frozen=True)
class AllocateKVCache:
    num_blocks: int


@dataclass(frozen=True)
class RunStep:
    """Run the forward (and the LM head's all-gather) for one scheduled step."""
    step: StepInput


@dataclass(frozen=True)
class GatherKV:
    """Send this rank's KV heads of these blocks to rank 0 (picovllm.engine.tp_kv: P<->D head re-split)."""
    block_ids: list[int]


@dataclass(frozen=True)
class ScatterKV:
    """Receive full-head KV blocks broadcast by rank 0 and keep this rank's heads (picovllm.engine.tp_kv)."""
    block_ids: list[int]


@dataclass(frozen=True)
class Shutdown:
    """Leave the worker loop and tear down the process groups."""


Message = Union[Setup, ProfileKVCache, AllocateKVCache, RunStep, GatherKV, ScatterKV, Shutdown]
_TYPES: dict[str, type] = {"setup": Setup, "profile_kv_cache": ProfileKVCache, "allocate_kv_cache": AllocateKVCache,
                           "run_step": RunStep, "gather_kv": GatherKV, "scatter_kv": ScatterKV, "shutdown": Shutdown}
_NAMES = {cls: name for name, cls in _TYPES.items()}


def encode(msg: Message, tables: SentTables | None = None) -> bytes:
    """msg's wire form; a RunStep's block tables as deltas against `tables`, the sender's (whole without)."""
    name = _NAMES.get(type(msg))
    if name is None:
        raise TypeError(f"{type(msg).__name__} is not a tensor-parallel message")
    if isinstance(msg, RunStep):
        return encode_step(msg.step, PROTOCOL_VERSION, tables)
    if isinstance(msg, Setup):
        body = {"config": _config_to_dict(msg.config)}
    else:
        body = asdict(msg)
    return json.dumps({"version": PROTOCOL_VERSION, "type": name, "body": body}, separators=(",", ":")).encode()


def decode(data: bytes, tables: ReceivedTables | None = None) -> Message:
    """The message in data, a RunStep's block tables built on `tables`, the receiver's (without, they must come
    whole); ValueError naming the field if it is malformed or of another version."""
    if is_step_frame(data):
        return RunStep(decode_step(data, PROTOCOL_VERSION, "RunStep.step", tables))
    frame = json.loads(data)
    if frame.get("version") != PROTOCOL_VERSION:
        raise ValueError(f"message version {frame.get('version')!r}: this worker speaks version {PROTOCOL_VERSION}")
    cls = _TYPES.get(frame.get("type"))
    if cls is None:
        raise ValueError(f"message type {frame.get('type')!r} is unknown")
    body = frame.get("body")
    if cls is Setup:
        return Setup(EngineConfig(**_fields(EngineConfig, body.get("config"), "Setup.config")))
    if cls is RunStep:
        raise ValueError(f"RunStep: sent as JSON, but version {PROTOCOL_VERSION} sends it as a binary step frame")
    return cls(**_fields(cls, body, cls.__name__))


def _fields(cls: type, data: Any, where: str) -> dict[str, Any]:
    """Check that data has exactly cls's fields, naming the first that is missing or unknown."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    missing, unknown = sorted(names - data.keys()), sorted(data.keys() - names)
    if missing:
        raise ValueError(f"{where}.{missing[0]}: missing")
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown field")
    return dict(data)


def _config_to_dict(config: EngineConfig) -> dict[str, Any]:
    out = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        elif is_dataclass(value):            # PoolerConfig: its fields, which EngineConfig takes back as a dict
            value = asdict(value)
        elif not isinstance(value, (str, int, float, bool, type(None), dict)):    # a dict: JSON (hf_overrides)
            raise TypeError(f"EngineConfig.{f.name} ({type(value).__name__}) cannot be sent to tensor-parallel workers")
        out[f.name] = value
    return out
