"""Every message that crosses a process boundary in a disaggregated run, as typed dataclasses.

Two conversations use them: prefill engine <-> decode engine (the handover protocol, see
picovllm/disagg/__init__.py for its sequence) and driver <-> engine worker. On the wire a message
is one JSON object {"type": <class name>, "body": <fields>}: no pickle, so a peer can only ever
make us build one of the classes listed in MESSAGES.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from picovllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


# -- the handshake ------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVLayout:
    """How one engine's KV cache is laid out. Exchanged in the handshake: D checks it matches its own.

    The cache is one tensor [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim].
    Under tensor parallelism an engine's rank 0 speaks full heads on the link (num_kv_heads ==
    total_kv_heads, kv_head_start 0; tp_size says how many ranks it gathers from or scatters to),
    so engines of different TP sizes match; picovllm.engine.tp_kv re-splits the heads.
    """
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str                        # torch dtype name without "torch.", e.g. "bfloat16"
    total_kv_heads: int
    kv_head_start: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    order: str = "layer,kv,block,slot,head,dim"

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def mismatch(self, other: "KVLayout") -> str | None:
        """Why a block of `other`'s cache cannot be copied as-is into ours (None when it can)."""
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "total_kv_heads",
                     "kv_head_start", "order"):
            if getattr(self, name) != getattr(other, name):
                return (f"KVLayout.{name} differs: decode side has {getattr(self, name)!r}, "
                        f"prefill side has {getattr(other, name)!r}")
        return None


@dataclass
class Hello:
    """First message each side sends on a new P<->D link."""
    role: str                         # "p" or "d"
    session: int
    backend: str
    layout: KVLayout
    backend_info: dict = field(default_factory=dict)   # backend-specific, JSON-safe (e.g. an IPC handle)
    error: str | None = None          # set by D when it refuses the link (layout mismatch, ...)


# -- the handover protocol (P <-> D) ---------------------------------------------------------------
@dataclass
class HandoverRequest:
    """A request whose prompt P has computed and sampled once: all D needs to decode it to the end."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]       # what P sampled (the first token)
    params: dict                      # SamplingParams fields
    max_tokens: int                   # already resolved against max_model_len by P
    num_kv_tokens: int                # tokens whose K/V the blocks hold (the prompt)
    src_block_ids: list[int]          # where they are in P's cache, in order
    logprobs: list[list] | None       # per output token: [[token, logprob, rank], ...]
    cumulative_logprob: float
    num_cached_tokens: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    token_times: list[float]


@dataclass
class Offer:            # P -> D: this request is ready; take it when you have room
    request: HandoverRequest


@dataclass
class Accept:           # D -> P: blocks allocated and the receive posted; send (or let me pull) now
    request_id: str
    tag: int                          # unique per transfer on this link
    dst_block_ids: list[int]


@dataclass
class Ack:              # D -> P: the KV is in D's cache; free your blocks
    request_id: str


@dataclass
class Release:          # D -> P: I will not take this request (cancelled, refused, failed); free your blocks
    request_id: str
    reason: str


@dataclass
class Cancel:           # P -> D: forget this request (aborted, or its transfer timed out on P)
    request_id: str
    reason: str


@dataclass
class EndOfStream:      # P -> D: no Offer will follow (P was closed and has handed everything over)
    pass


@dataclass
class Bye:              # either way: I am done with this link and have unmapped/released what it shared
    pass


@dataclass
class Heartbeat:        # either way, every lease / 4 seconds, from a background thread
    pass


# -- driver <-> engine worker ----------------------------------------------------------------------
@dataclass
class WorkerHello:      # worker -> driver, first thing after connecting
    role: str
    pid: int


@dataclass
class BuildEngine:      # driver -> worker: load the model and allocate the cache
    config: dict                      # EngineConfig fields (dtype as a string)


@dataclass
class WorkerReady:
    role: str
    pid: int
    num_blocks: int
    address: list | None = None       # P: [host, port] where D engines connect
    error: str | None = None


@dataclass
class StartSession:
    session: int
    backend: str
    async_transfer: bool
    transfer_timeout_s: float
    lease_s: float
    connect_timeout_s: float = 60.0
    peer_address: list | None = None  # D: the P engine's [host, port]
    stream: bool = False              # send every output, not only finals
    fault: str | None = None          # tests only: a fault to inject, see picovllm.disagg.worker


@dataclass
class Submit:
    request_id: str
    prompt: str | list[int]
    params: dict
    arrival_time: float


@dataclass
class SubmitResult:
    request_id: str
    error: str | None = None


@dataclass
class Abort:
    request_id: str


@dataclass
class CloseSession:     # the "no more requests" call, forwarded to the P engine
    pass


@dataclass
class Output:
    output: dict                      # a RequestOutput, see output_to_wire


@dataclass
class SessionEnded:
    session: int
    num_blocks: int
    free_blocks: int
    unfinished: int
    stats: dict = field(default_factory=dict)
    error: str | None = None


@dataclass
class Shutdown:
    pass


MESSAGES: typing.Mapping[str, type] = types.MappingProxyType({c.__name__: c for c in (
    Hello, Offer, Accept, Ack, Release, Cancel, EndOfStream, Bye, Heartbeat,
    WorkerHello, BuildEngine, WorkerReady, StartSession, Submit, SubmitResult, Abort, CloseSession, Output, SessionEnded, Shutdown)})


def encode(msg: Any) -> bytes:
    name = type(msg).__name__
    if MESSAGES.get(name) is not type(msg):
        raise TypeError(f"{name} is not a wire message")
    return json.dumps({"type": name, "body": dataclasses.asdict(msg)}, separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    obj = json.loads(data)
    cls = MESSAGES.get(obj.get("type")) if isinstance(obj, dict) else None
    if cls is None:
        raise ValueError(f"unknown wire message type {obj.get('type') if isinstance(obj, dict) else obj!r}")
    return _build(cls, obj["body"])


def _build(cls: type, body: dict) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in body:
            continue
        value = body[f.name]
        nested = _dataclass_in(hints[f.name])
        kwargs[f.name] = _build(nested, value) if nested is not None and isinstance(value, dict) else value
    return cls(**kwargs)


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field holds (`X` or `X | None`), if any."""
    if dataclasses.is_dataclass(hint):
        return hint
    return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)


# -- payload helpers -------------------------------------------------------------------------------
def b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def logprobs_to_wire(logprobs: list[dict[int, Logprob]] | None) -> list[list] | None:
    if logprobs is None:
        return None
    return [[[tok, lp.logprob, lp.rank] for tok, lp in d.items()] for d in logprobs]


def logprobs_from_wire(data: list[list] | None) -> list[dict[int, Logprob]] | None:
    if data is None:
        return None
    return [{int(tok): Logprob(lp, rank) for tok, lp, rank in d} for d in data]


def output_to_wire(out: RequestOutput) -> dict:
    d = dataclasses.asdict(out)
    for comp, c in zip(d["outputs"], out.outputs):
        comp["logprobs"] = None if c.logprobs is None else [
            [[tok, lp.logprob, lp.rank, lp.decoded_token] for tok, lp in step.items()] for step in c.logprobs]
    return d


def output_from_wire(d: dict) -> RequestOutput:
    comps = []
    for c in d["outputs"]:
        c = dict(c)
        if c["logprobs"] is not None:
            c["logprobs"] = [{int(tok): Logprob(lp, rank, text) for tok, lp, rank, text in step}
                             for step in c["logprobs"]]
        comps.append(CompletionOutput(**c))
    metrics = RequestMetrics(**d["metrics"]) if d.get("metrics") else None
    return RequestOutput(d["request_id"], d["prompt"], d["prompt_token_ids"], comps, d["finished"], metrics,
                         d.get("error"), d.get("num_cached_tokens", 0))
