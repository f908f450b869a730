"""EngineClient: the event loop's side of a served engine, wherever its loop runs, and all the HTTP side needs of it.

Requests go to the loop as typed commands (add, abort, shutdown) on a thread-safe queue; each step's RequestOutputs
(and CommandAnswers) come back to one RequestStream per request. RequestOutputs are cumulative (full text and token
ids so far), so the stream keeps only the newest one not read yet: a slow reader skips to it, losing nothing; a
DELTA request's (SamplingParams.output_kind) are merged into the one not read yet instead (merge_deltas). Its
subclasses say where the loop runs: async_engine.AsyncEngine (a thread of this process),
engine_process.ProcessAsyncEngine (a process of its own), and the fleet's front ends (disagg.proxy, disagg.router:
other servers' engines).

The messages an engine's process sends its API server (engine_process.py) are typed here too, beside the commands
it reads: StepOutputs, LoopEnded, EngineReady, EngineFailed.

Nothing here imports torch: a router or proxy serves the OpenAI API without it (tests/test_cli.py).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from picovllm.outputs import RequestOutput, merge_deltas
from picovllm.sampling_params import RequestOutputKind, SamplingParams


class EngineStepError(RuntimeError):
    """The engine failed while running a step this request was part of; the request was aborted."""


def checked(out: RequestOutput, unsaid: str = "the request failed in the engine") -> RequestOutput:
    """out, unless the engine ended the request in an error (FinishReason.ERROR: a grammar that refused a token, a
    KV transfer that failed): then EngineStepError with the engine's reason (unsaid: where it gave none), so that
    the client gets a 500 or an SSE error event saying why, never a 200 whose finish_reason is "error"."""
    if out.finished and out.outputs and out.outputs[0].finish_reason == "error":
        raise EngineStepError(out.error or unsaid)
    return out


class EngineDeadError(RuntimeError):
    """The engine loop is not running (never started, shut down, or crashed)."""


@dataclass
class EngineStats:
    """A snapshot the loop thread publishes after each iteration (read by /metrics and tests)."""
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    prefill_tokens: int = 0          # cumulative
    decode_tokens: int = 0           # cumulative
    prefix_queried_tokens: int = 0   # cumulative
    prefix_hit_tokens: int = 0       # cumulative
    drafts: int = 0                  # cumulative, speculative decoding's (Engine.stats): speculative chunks,
    draft_tokens: int = 0            # the drafted tokens they fed,
    accepted_tokens: int = 0         # and those kept
    connector: dict = field(default_factory=dict)   # a P or D engine's: AsyncEngine._connector_stats
    accepted_per_pos: list = field(default_factory=list)   # cumulative, drafts kept by position (Engine's)
    preemptions: int = 0                 # cumulative (Scheduler.num_preemptions)
    prefix_requeried_tokens: int = 0     # cumulative, of the prefix cache's: lookups again after a preemption
    prefix_rehit_tokens: int = 0         # (BlockManager.requeried_tokens, rehit_tokens)


# -- commands: event loop -> engine thread -----------------------------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class AbortAll:
    pass


@dataclass
class Shutdown:
    pass


Command = AddRequest | AbortRequest | AbortAll | Shutdown


# -- answers: engine loop -> event loop, among an iteration's RequestOutputs ------------------------------------------
@dataclass(slots=True)
class CommandAnswer:
    """What the loop says of a request outside its outputs: the answer to its AddRequest (error None: accepted; a
    ValueError naming the field, or an EngineStepError), or the failure of a step it was part of (an EngineStepError:
    the engine aborted it)."""
    request_id: str
    error: Exception | None


# -- an engine process's messages to an API server (engine_process.py) ------------------------------------------------
# A request's RequestOutput as what changed since the one sent before it (output_deltas.OutputDeltas): a plain tuple
# of these fields, built in one place (output_deltas._output_delta) and read in one (OutputsFromDeltas._applied).
# One is sent a running request each step; as a dataclass it cost ~0.6 us more on each side of the pipe
# (constructed, pickled), ~150 us a 256-request step (BENCHMARKS.md, thirty-fifth session).
OUTPUT_DELTA = ("request_id", "new_token_ids", "text_kept", "new_text", "new_logprobs", "cumulative_logprob",
                "finish_reason", "stop_reason", "finished", "error", "num_cached_tokens", "metrics", "kv_handover")
OutputDelta = tuple


@dataclass(slots=True)
class StepOutputs:
    """One iteration of the loop: its outputs in order (a RequestOutput whole, an OutputDelta or a CommandAnswer)
    and the engine's stats after it."""
    items: list[RequestOutput | OutputDelta | CommandAnswer]
    stats: EngineStats


@dataclass(slots=True)
class LoopEnded:
    """The loop has ended (or, with several API servers, this one has left it): nothing more will be answered."""
    why: str


@dataclass(slots=True)
class EngineReady:
    """The engine process's first word once its engine is built: what the engine says of itself (EngineClient's
    model_info, role_info, eos_token_ids)."""
    model_info: dict
    role_info: dict
    eos: list[int] | None


@dataclass(slots=True)
class EngineFailed:
    """The engine process's first and last word when its engine could not be built. kind: what the server raises,
    why its message: "ValueError" (a configuration the engine refuses), "SystemExit" (build's own message for the
    command line), else "RuntimeError"."""
    kind: str
    why: str


class RequestStream:
    """One request's outputs on the event loop side. Iterate outputs(); leaving early aborts it."""

    def __init__(self, request_id: str, engine: EngineClient, delta: bool = False) -> None:
        self.request_id = request_id
        self._engine = engine
        self._delta = delta       # SamplingParams.output_kind DELTA: each output holds only what is new
        self._unread: RequestOutput | Exception | None = None     # the newest item not read yet
        self._ready = asyncio.Event()
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.finished = False

    def put(self, item: RequestOutput | Exception) -> None:
        """The newest output replaces one not read yet: outputs are cumulative, so a reader that falls behind (a
        client that does not read its stream) costs one output, not one a step, each a copy of all so far (a queue
        held ~180 MB for one unread 7k-token stream with logprobs). An error is never replaced. vLLM's
        RequestOutputCollector keeps one the same way. A DELTA request's outputs each hold only what is new: the
        newest is merged into the one not read yet (merge_deltas), so a slow reader still gets every token, and what
        is kept is at most the whole output, as one cumulative output is."""
        if isinstance(self._unread, Exception):
            return
        if self._delta and isinstance(self._unread, RequestOutput) and isinstance(item, RequestOutput):
            item = merge_deltas(self._unread, item)
        self._unread = item
        self._ready.set()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                await self._ready.wait()
                self._ready.clear()
                out, self._unread = self._unread, None
                if isinstance(out, Exception):
                    self.finished = True
                    raise out
                self.finished = out.finished
                yield out
        finally:
            self.close()

    def abort(self) -> None:
        """Abort the request even if its stream has ended: a fleet P's request whose last output (the KV's handle)
        went out while the KV stays published for a D, when whoever would hand it to a D has left."""
        self._engine.abort(self.request_id)

    def close(self) -> None:
        """Stop listening; abort the request if it has not finished (frees its KV blocks). The id of a request the
        engine took stays in use until its last output (the abort's) arrives (_dispatch lets it go): a new request
        under that id meanwhile would get the old one's outputs, its abort ending it."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)
            if self.accepted.done() and not self.accepted.cancelled() and self.accepted.exception() is None:
                return
        if self._engine._streams.get(self.request_id) is self:
            del self._engine._streams[self.request_id]


class EngineClient:
    """The event loop's side of an engine loop: requests go out as commands (`_commands.put`), outputs come back
    through _dispatch on the event loop. Its subclasses say where the loop runs (start, shutdown, is_running)."""

    def __init__(self, commands, metrics=None) -> None:
        self.metrics = metrics          # ServerMetrics or None; called where the outputs arrive
        self.stats = EngineStats()
        self._commands = commands       # put(Command): to the loop
        self._streams: dict[str, RequestStream] = {}   # touched only on the event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        # why the loop ended (its last word: shut down, a rank died, ...), set on its side before is_running turns
        # False; None while it runs
        self.ended_why: str | None = None

    def start(self) -> None:
        raise NotImplementedError

    async def shutdown(self) -> None:
        raise NotImplementedError

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    def model_info(self) -> dict:
        """What GET /v1/models shows besides the name."""
        raise NotImplementedError

    def role_info(self) -> dict:
        """What the role's engine says of itself once built (a P or D server's /pd/info): AsyncEngine.role_info."""
        raise NotImplementedError

    def eos_token_ids(self) -> list[int] | None:
        """The engine's end-of-sequence tokens (beam search ends beams on them); None where the engine is other
        servers' (a proxy's, a router's)."""
        raise NotImplementedError

    # -- requests (event loop side) --------------------------------------------------------------
    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                          arrival_time: float | None = None, priority: int = 0) -> RequestStream:
        """Queue a request; return once the engine accepted it. Raises ValueError naming the bad field."""
        if not self.is_running:
            raise EngineDeadError(self.ended_why or "the engine loop is not running")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        delta = getattr(params, "output_kind", None) == RequestOutputKind.DELTA    # (PoolingParams have none)
        stream = self._streams[request_id] = RequestStream(request_id, self, delta)
        self._commands.put(AddRequest(request_id, list(prompt_token_ids), params, arrival_time or time.time(),
                                      priority))
        try:
            await stream.accepted
        except BaseException:   # rejected, or the caller went away: aborting an unknown id is a no-op
            stream.close()
            raise
        return stream

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(prompt_token_ids, params, request_id, arrival_time)
        async for out in stream.outputs():
            yield out

    def abort(self, request_id: str) -> None:
        self._commands.put(AbortRequest(request_id))

    def abort_all(self) -> None:
        """Abort every request in flight: their streams end with finish_reason "abort"."""
        self._commands.put(AbortAll())

    def _finish_outputs(self, outputs: list[RequestOutput | CommandAnswer]) -> None:
        """The requests among outputs that finished or failed, to the metrics: counted here, where the outputs
        arrive, so that each counts once whether the engine loop runs in this process or in its own (whose loop has
        no metrics)."""
        if self.metrics is None:
            return
        for out in outputs:
            if isinstance(out, RequestOutput):
                if out.finished:
                    self.metrics.observe_finished(out)
            elif isinstance(out.error, EngineStepError):   # the engine failed the request (its step, or its add)
                self.metrics.count_outcome("error")

    # -- back on the event loop ------------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput | CommandAnswer]) -> None:
        for out in outputs:
            if isinstance(out, RequestOutput):
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
                    if out.finished:      # its reader may never come (response never started)
                        del self._streams[out.request_id]
            else:
                self._answer(out)

    def _answer(self, answer: CommandAnswer) -> None:
        stream = self._streams.get(answer.request_id)
        if stream is None:
            return
        if not stream.accepted.done():          # the answer to an AddRequest
            if answer.error is None:
                stream.accepted.set_result(None)
            else:
                stream.accepted.set_exception(answer.error)
        elif answer.error is not None:      # the engine failed the request: it has let it go
            stream.put(answer.error)
            # as a finished output does (_dispatch): its reader may be gone already (the client left while the step
            # failed: its abort then finds no request, and no output of it ever comes to let the stream go)
            del self._streams[answer.request_id]

    def _fail_all_streams(self, why: str) -> None:
        err = EngineDeadError(why)
        for stream in list(self._streams.values()):
            if not stream.accepted.done():
                stream.accepted.set_exception(err)
            else:
                stream.put(err)
