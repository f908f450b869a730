"""Every message that crosses a process boundary in a disaggregated run, as typed dataclasses.

Three conversations use them: prefill engine <-> decode engine (the handover protocol, see
picovllm/disagg/__init__.py for its sequence), a fleet's KV sockets (publish, claim, pull, release:
picovllm/disagg/transfer/host_tcp.py) and driver <-> engine worker. On the wire a message
is one JSON object {"type": <class name>, "body": <fields>}: no pickle, so a peer can only ever
make us build one of the classes listed in MESSAGES.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from picovllm.outputs import CompletionOutput, ListPrefix, Logprob, RequestMetrics, RequestOutput


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
    dtype: str                        # torch dtype name without "torch.", e.g. "bfloat16" or "float8_e4m3fn"
    total_kv_heads: int
    kv_head_start: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    order: str = "layer,kv,block,slot,head,dim"
    kv_scales: str = ""               # fp8 caches: a digest of the full-head K/V scales (engine/kv_scales.py)

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def mismatch(self, other: "KVLayout") -> str | None:
        """Why a block of `other`'s cache cannot be copied as-is into ours (None when it can)."""
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "total_kv_heads",
                     "kv_head_start", "order", "kv_scales"):
            if getattr(self, name) != getattr(other, name):
                why = (" (the fp8 KV scales, a digest: both sides must calibrate the same model the same way)"
                       if name == "kv_scales" else "")
                return (f"KVLayout.{name} differs: decode side has {getattr(self, name)!r}, "
                        f"prefill side has {getattr(other, name)!r}{why}")
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
    priority: int = 0                 # the "priority" scheduling policy's (D orders by it if its policy is that)
    prompt_logprobs: list | None = None   # what P scored of the prompt, when asked (prompt_steps_to_wire)
    # what P's outputs gave out (Request.num_streamed_tokens / _chars): a DELTA request's outputs on D follow them
    num_streamed_tokens: int = 0
    num_streamed_chars: int = 0


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


# -- many-to-many pull transfers (a fleet: picovllm.disagg.fleet_prefill / fleet_decode) -------------
@dataclass
class KVHandle:
    """Where a request's KV waits on a prefill instance until a decode instance pulls and releases it."""
    instance_id: str
    backend: str                      # a key of picovllm.disagg.transfer.PULL_BACKENDS
    address: list                     # [host, port] of the instance's KV server
    request_id: str
    block_ids: list[int]              # in that instance's cache, in order
    num_tokens: int                   # tokens whose K/V the blocks hold
    layout: KVLayout
    lease_s: float                    # unclaimed this long after publishing: freed
    info: dict = field(default_factory=dict)   # backend-specific, JSON-safe


@dataclass
class PublishedKV:      # P -> (router) -> D: a request P prefilled and sampled once, and where its KV waits
    request: HandoverRequest
    handle: KVHandle


@dataclass
class KVAuthChallenge:  # KV server -> client, first thing on a new socket
    nonce: str
    instance_id: str
    lease_s: float = 10.0             # the server drops a client silent this long (and its claims)


@dataclass
class KVAuthProof:      # client -> KV server: HMAC over both nonces (picovllm.disagg.auth), and its own nonce
    proof: str
    nonce: str


@dataclass
class KVAuthResult:     # KV server -> client: its own proof, or why the client is refused (then it closes)
    proof: str | None = None
    error: str | None = None


@dataclass
class ClaimKV:          # D -> P: I will pull this; keep it while this connection lives (no lease)
    request_id: str


@dataclass
class PullKV:           # D -> P: send me the blocks
    request_id: str


@dataclass
class ReleaseKV:        # D -> P: done with it (pulled, or given up): free it
    request_id: str


@dataclass
class KVReply:          # P -> D: the answer to ClaimKV / PullKV / ReleaseKV; a pull's nbytes of blocks follow
    request_id: str
    nbytes: int = 0
    error: str | None = None


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
    output: dict                      # a RequestOutput, whole or as a delta: see OutputEncoder


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
    KVHandle, PublishedKV, KVAuthChallenge, KVAuthProof, KVAuthResult, ClaimKV, PullKV, ReleaseKV, KVReply,
    WorkerHello, BuildEngine, WorkerReady, StartSession, Submit, SubmitResult, Abort, CloseSession, Output, SessionEnded, Shutdown)})


def _wire_name(msg: Any) -> str:
    name = type(msg).__name__
    if MESSAGES.get(name) is not type(msg):
        raise TypeError(f"{name} is not a wire message")
    return name


def _plain(obj: Any) -> Any:
    """A dataclass as a dict of its fields, its dataclass fields (X or X | None, as in every message) likewise.
    Not dataclasses.asdict: that copies every list element by element (850 µs for an Offer of a 1024-token
    prompt); a message's lists and dicts are plain JSON already, so they are shared, not copied."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return obj
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _json_default(obj: Any) -> Any:
    """json.dumps' hook for what it cannot write itself: a dataclass field's value, written as _plain's dict."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def to_wire(msg: Any) -> dict:
    """A message as the JSON object that goes on the wire (for a carrier that is itself JSON, e.g. HTTP)."""
    return {"type": _wire_name(msg), "body": _plain(msg)}


def from_wire(obj: Any, expect: type | None = None) -> Any:
    """The message a wire object holds; ValueError if it is none of MESSAGES (or not an `expect`)."""
    cls = MESSAGES.get(obj.get("type")) if isinstance(obj, dict) else None
    if cls is None:
        raise ValueError(f"unknown wire message type {obj.get('type') if isinstance(obj, dict) else obj!r}")
    if expect is not None and cls is not expect:
        raise ValueError(f"expected a {expect.__name__}, got a {cls.__name__}")
    if not isinstance(obj.get("body"), dict):
        raise ValueError(f"{cls.__name__}: body must be an object")
    try:
        return _build(cls, obj["body"])
    except TypeError as e:
        raise ValueError(f"{cls.__name__}: {e}") from None


def encode(msg: Any) -> bytes:
    # the dataclasses go to dicts inside json's encoder (_json_default), the lists of ints in C
    return json.dumps({"type": _wire_name(msg), "body": msg}, separators=(",", ":"), default=_json_default).encode()


def decode(data: bytes) -> Any:
    return from_wire(json.loads(data))


def _build(cls: type, body: dict) -> Any:
    names, nested = _SCHEMAS[cls]
    kwargs = {k: v for k, v in body.items() if k in names}    # fields only: a newer peer's extras are ignored
    for name, inner in nested.items():
        if isinstance(kwargs.get(name), dict):
            kwargs[name] = _build(inner, kwargs[name])
    return cls(**kwargs)


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field holds (`X` or `X | None`), if any."""
    if dataclasses.is_dataclass(hint):
        return hint
    return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)


def _schemas(roots) -> typing.Mapping[type, tuple[frozenset, dict]]:
    """Each message class and each dataclass nested in one: (its field names, {field: the dataclass it holds}).
    Worked out once: typing.get_type_hints costs ~100 µs a call, and every message decoded needed it."""
    out, todo = {}, list(roots)
    while todo:
        cls = todo.pop()
        if cls in out:
            continue
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        nested = {f.name: d for f in fields if (d := _dataclass_in(hints[f.name])) is not None}
        out[cls] = (frozenset(f.name for f in fields), nested)
        todo += nested.values()
    return types.MappingProxyType(out)


_SCHEMAS = _schemas(MESSAGES.values())


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


def _steps_to_wire(steps: list[dict[int, Logprob]] | None) -> list | None:
    return None if steps is None else [[[tok, lp.logprob, lp.rank, lp.decoded_token] for tok, lp in s.items()]
                                       for s in steps]


def _steps_from_wire(data: list | None) -> list[dict[int, Logprob]] | None:
    return None if data is None else [{int(tok): Logprob(lp, rank, text) for tok, lp, rank, text in s} for s in data]


def prompt_steps_to_wire(steps: list[dict[int, Logprob] | None] | None) -> list | None:
    """Prompt logprobs (None for the first token, then {token: Logprob}) as JSON-able lists."""
    return None if steps is None else [None if s is None else _steps_to_wire([s])[0] for s in steps]


def prompt_steps_from_wire(data: list | None) -> list[dict[int, Logprob] | None] | None:
    return None if data is None else [None if s is None else _steps_from_wire([s])[0] for s in data]


def _metrics_to_wire(m: RequestMetrics | None) -> dict | None:
    if m is None:
        return None
    return {"arrival_time": m.arrival_time, "first_scheduled_time": m.first_scheduled_time,
            "first_token_time": m.first_token_time, "finished_time": m.finished_time,
            "token_times": list(m.token_times)}     # a copy: the engine appends to its list in place


def output_to_wire(out: RequestOutput) -> dict:
    """A RequestOutput as JSON-able dicts, field for field (dataclasses.asdict's shape, but its lists copied whole,
    not element by element: asdict took ms for an output of a thousand tokens, on a decode engine's step loop)."""
    comps = [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
              "cumulative_logprob": c.cumulative_logprob, "logprobs": _steps_to_wire(c.logprobs),
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
    prompt_logprobs = prompt_steps_to_wire(out.prompt_logprobs)
    return {"request_id": out.request_id, "prompt": out.prompt, "prompt_token_ids": list(out.prompt_token_ids),
            "outputs": comps, "finished": out.finished, "metrics": _metrics_to_wire(out.metrics), "error": out.error,
            "num_cached_tokens": out.num_cached_tokens, "prompt_logprobs": prompt_logprobs,
            "kv_handover": out.kv_handover, "embedding": out.embedding}


def output_from_wire(d: dict) -> RequestOutput:
    comps = []
    for c in d["outputs"]:
        c = dict(c)
        c["logprobs"] = _steps_from_wire(c["logprobs"])
        comps.append(CompletionOutput(**c))
    metrics = RequestMetrics(**d["metrics"]) if d.get("metrics") else None
    return RequestOutput(d["request_id"], d["prompt"], d["prompt_token_ids"], comps, d["finished"], metrics,
                         d.get("error"), d.get("num_cached_tokens", 0), prompt_steps_from_wire(d.get("prompt_logprobs")),
                         kv_handover=d.get("kv_handover"), embedding=d.get("embedding"))


def common_prefix(a, b) -> int:
    """Length of the common prefix of two sequences (strings or lists); a is usually a prefix of b."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def _snapshot(items: Sequence | None) -> Sequence | None:
    """What an OutputEncoder keeps of a list it sent, to compare the next output's with, in O(1): a ListPrefix as it
    is, a list as a ListPrefix of it (its owner may extend it in place, which leaves that unchanged); anything else
    copied."""
    if items is None or isinstance(items, ListPrefix):
        return items
    return ListPrefix(items) if type(items) is list else list(items)


def _kept(sent: Sequence, now: Sequence) -> int:
    """How many of the items sent a later output's list still begins with: all of them where that list is, or views,
    the one they were sent from (O(1)), else as many as compare equal."""
    if isinstance(sent, ListPrefix) and sent.prefix_of(now):
        return len(sent)
    return common_prefix(sent, now)


class OutputEncoder:
    """One stream of a request's outputs on the wire. Outputs are cumulative (every token so far, the
    prompt's ids, the per-token times), so sending each whole costs O(prompt + tokens) per token: at
    a 5k-token prompt that is what bounds a decode server. The first output goes whole
    ({"output": ...}); each later one as {"delta": ...}: where its token ids, text and logprobs part
    from the last one sent and what follows, the scalars, and the metrics only once finished. The prompt's
    logprobs go with the first output only (they are complete once a request has a token).

    What was sent of a list is kept as a ListPrefix of it, not a copy: an output's lists may grow in place once
    encoded, but nothing else may change them (an engine's are new each output; output_deltas.OutputsFromDeltas's
    only grow). Where an output's lists are views of one list each (ListPrefix: a server's engine loop hands them so,
    in its own process or in the server's) the last ones sent are a prefix of them by construction, and a step costs
    what is new in it; new lists are compared with the last ones, in C, which costs what each holds. Copying and
    comparing every list had cost ~7 ms a step at batch 256 with 2,000-token outputs, ~21 with logprobs 5
    (benchmarks/pd_outputs.py)."""

    def __init__(self) -> None:
        # what was sent of each completion: its token ids, text and logprobs
        self._sent: list[tuple[Sequence, str, Sequence | None]] | None = None

    def encode(self, out: RequestOutput) -> dict:
        last = self._sent
        self._sent = [(_snapshot(c.token_ids), c.text, _snapshot(c.logprobs)) for c in out.outputs]
        if last is None or len(last) != len(out.outputs):
            return {"output": output_to_wire(out)}
        comps = []
        for (tokens, text, logprobs), c in zip(last, out.outputs):
            t = _kept(tokens, c.token_ids)
            # the text sent, unless a stop string cut its end (startswith: the usual case, without copying both texts)
            s = len(text) if c.text.startswith(text) else common_prefix(text, c.text)
            comp = {"index": c.index, "token_start": t, "token_ids": c.token_ids[t:], "text_start": s,
                    "text": c.text[s:], "cumulative_logprob": c.cumulative_logprob,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if c.logprobs is not None:
                k = _kept(logprobs or [], c.logprobs)
                comp["logprobs_start"], comp["logprobs"] = k, _steps_to_wire(c.logprobs[k:])
            comps.append(comp)
        delta = {"request_id": out.request_id, "finished": out.finished, "error": out.error,
                 "num_cached_tokens": out.num_cached_tokens, "outputs": comps}
        if out.finished and out.metrics is not None:
            delta["metrics"] = _metrics_to_wire(out.metrics)
        return {"delta": delta}


@dataclass(slots=True)
class _Received:
    """A completion as its stream has it so far: the text, and the lists that the token ids and logprobs of its
    outputs are prefixes of (the deltas extend them in place)."""
    text: str
    token_ids: list[int]
    logprobs: list | None


def _start(delta: dict, name: str, have: int) -> int:
    """A delta's field `name` (where its part of a list or the text begins): an int from 0 to what the stream has."""
    start = delta[name]
    if type(start) is not int or not 0 <= start <= have:
        raise ValueError(f"an output delta's {name} must be an int from 0 to {have}, got {start!r}")
    return start


def _extended(items: list, start: int, new: list) -> list:
    """items up to start, then new: items itself, extended in place, where the delta extends the last output (the
    usual case), else a new list (the outputs handed out hold prefixes of the old one, which must not change)."""
    if start == len(items):
        items += new
        return items
    return items[:start] + new


class OutputDecoder:
    """The receiving end of an OutputEncoder: each line back into a whole, cumulative RequestOutput.

    A completion's token ids and logprobs so far are one list each, extended in place by the deltas; an unfinished
    output holds its own prefix of them (outputs.ListPrefix), so an output handed out never changes, and a step
    costs what is new in it. A whole output's lists, and a final output's, are its own (the final's copied, once a
    request). New lists for every output had cost what each holds, and the garbage collector's walks over them: at
    batch 256 with 2,000-token outputs and logprobs 5, ~57 ms a step (benchmarks/pd_outputs.py).

    views=False: unfinished outputs hold lists of their own too, as LLM.generate's do (a user's stream: DisaggLLM's
    session(stream=True)), each a copy of what the stream has."""

    def __init__(self, views: bool = True) -> None:
        self._views = views
        self._last: RequestOutput | None = None
        self._so_far: list[_Received] = []

    def decode(self, line: dict) -> RequestOutput:
        if "output" in line:
            self._last = output_from_wire(line["output"])
            self._so_far = [_Received(c.text, list(c.token_ids), None if c.logprobs is None else list(c.logprobs))
                            for c in self._last.outputs]
            return self._last
        if self._last is None:
            raise ValueError("an output delta came before the stream's first whole output")
        d, last = line["delta"], self._last
        if d["request_id"] != last.request_id:
            raise ValueError(f"a delta for request {d['request_id']!r} in the stream of {last.request_id!r}")
        comps = [self._applied(so_far, c, d["finished"]) for so_far, c in zip(self._so_far, d["outputs"])]
        metrics = RequestMetrics(**d["metrics"]) if d.get("metrics") else last.metrics
        self._last = RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, comps, d["finished"],
                                   metrics, d["error"], d["num_cached_tokens"], last.prompt_logprobs)
        return self._last

    def _applied(self, so_far: _Received, c: dict, finished: bool) -> CompletionOutput:
        """One completion's delta applied to what its stream has."""
        so_far.text = so_far.text[:_start(c, "text_start", len(so_far.text))] + c["text"]
        so_far.token_ids = _extended(so_far.token_ids, _start(c, "token_start", len(so_far.token_ids)), c["token_ids"])
        if "logprobs" in c:
            had = so_far.logprobs if so_far.logprobs is not None else []
            so_far.logprobs = _extended(had, _start(c, "logprobs_start", len(had)), _steps_from_wire(c["logprobs"]))
        token_ids, logprobs = so_far.token_ids, so_far.logprobs
        if finished or not self._views:    # the stream's last output: lists of its own, as a whole output's are
            token_ids, logprobs = token_ids[:], None if logprobs is None else logprobs[:]
        else:
            token_ids, logprobs = ListPrefix(token_ids), None if logprobs is None else ListPrefix(logprobs)
        return CompletionOutput(c["index"], so_far.text, token_ids, c["cumulative_logprob"], logprobs,
                                c["finish_reason"], c["stop_reason"])
