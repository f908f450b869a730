"""A request's outputs as what each adds (OutputDeltas), and back into whole, cumulative ones (OutputsFromDeltas).

A RequestOutput is cumulative (the prompt's ids, every token so far); copying each running request's whole output
every step cost in proportion to what it holds (~11 ms a step at batch 256 with 2,000-token outputs:
benchmarks/served_outputs.py), and the garbage collector walked the copies. So an engine makes its outputs as deltas
(Engine.stream_deltas, or add_request's stream_deltas for one request), OutputDeltas turns them into OutputDelta
tuples, and OutputsFromDeltas adds them up into outputs that hold prefixes of one list a request (ListPrefix): an
engine process sends the tuples on its pipe (engine_process.py), a server's engine thread adds them up at once
(async_engine.AsyncEngine).
"""
from __future__ import annotations

from dataclasses import dataclass

from picovllm.disagg.messages import common_prefix
from picovllm.entrypoints.openai.engine_client import AddRequest, Command, CommandAnswer, EngineStepError, OutputDelta
from picovllm.outputs import CompletionOutput, ListPrefix, RequestOutput
from picovllm.sampling_params import RequestOutputKind


class OutputDeltas:
    """The sending end (an engine process's, or a server's engine thread's): each RequestOutput of the engine (one
    completion each: the engine runs one sample per request) as what changed since the one sent before for its
    request; a request's first output, and any that does not extend the last (fewer tokens, other prompt logprobs),
    goes whole. The metrics go with the last output only
    (the server reads them then)."""

    def __init__(self, engine_deltas: bool = False) -> None:
        """engine_deltas: the engine's outputs of CUMULATIVE requests hold only what is new (Engine.stream_deltas):
        each goes as an OutputDelta of itself, once the request's first has gone whole."""
        self._sent: dict[str, tuple[int, str, int]] = {}   # request id -> (tokens, text, prompt logprobs) sent
        self._whole: set[str] = set()     # DELTA requests (SamplingParams.output_kind): new tokens only already
        self._adding: set[str] = set()    # DELTA requests whose add is not answered yet (refused: never in _whole)
        self._engine_deltas = engine_deltas
        self._chars: dict[str, int] = {}  # engine_deltas: request id -> the characters of text sent

    def track(self, cmd: Command) -> None:
        """Commands as the loop takes them: a DELTA request's outputs go whole (each holds only what is new), once
        its add is answered without an error (a refused add, of an id in use, leaves the running request as it is)."""
        if isinstance(cmd, AddRequest) and getattr(cmd.params, "output_kind", None) == RequestOutputKind.DELTA:
            self._adding.add(cmd.request_id)

    def encode(self, out: RequestOutput | CommandAnswer) -> RequestOutput | OutputDelta | CommandAnswer:
        """out: an engine output, or an answer to a command, which goes as it is; an EngineStepError ends its
        request, so the id's next use is a new request (a refused add, a ValueError, leaves the request running under
        that id as it is: its outputs may be on their way)."""
        if isinstance(out, CommandAnswer):
            rid = out.request_id
            if out.error is None:           # an add taken
                if rid in self._adding:
                    self._adding.discard(rid)
                    self._whole.add(rid)
            elif isinstance(out.error, EngineStepError):    # a failed request (or add): the id's next use is new
                self._sent.pop(rid, None)
                self._chars.pop(rid, None)
                self._whole.discard(rid)
                self._adding.discard(rid)
            else:                           # a refused add: the request running under its id (if any) goes on
                self._adding.discard(rid)
            return out
        rid = out.request_id
        if rid in self._whole:
            if out.finished:
                self._whole.discard(rid)
            return out
        if self._engine_deltas:
            return self._of_delta(out)
        prev = self._sent.pop(rid, None)
        c = out.outputs[0] if len(out.outputs) == 1 else None
        scored = len(out.prompt_logprobs or ())
        if not out.finished and c is not None:
            self._sent[rid] = (len(c.token_ids), c.text, scored)
        if prev is None or c is None or len(c.token_ids) < prev[0] or scored != prev[2]:
            return out
        t, text, _ = prev
        # the text so far, unless a stop string trimmed its end (startswith: the usual case, without common_prefix's
        # copies of both texts)
        k = len(text) if c.text.startswith(text) else common_prefix(text, c.text)
        return _output_delta(out, c.token_ids[t:], k, c.text[k:], None if c.logprobs is None else c.logprobs[t:])

    def _of_delta(self, out: RequestOutput) -> RequestOutput | OutputDelta:
        """An engine's DELTA output of a CUMULATIVE request as an OutputDelta; whole while nothing was sent (its
        first output) or it carries prompt logprobs (before its first token: the engine's DELTA output then holds
        all there is, as a cumulative one would)."""
        rid, c = out.request_id, out.outputs[0] if len(out.outputs) == 1 else None
        sent = self._chars.pop(rid, None)
        if sent is None or c is None or out.prompt_logprobs is not None:
            if not out.finished and c is not None:
                self._chars[rid] = len(c.text)
            return out
        if not out.finished:
            self._chars[rid] = sent + len(c.text)
        return _output_delta(out, c.token_ids, sent, c.text, c.logprobs)


def _output_delta(out: RequestOutput, new_token_ids: list[int], text_kept: int, new_text: str,
                  new_logprobs: list | None) -> OutputDelta:
    """OUTPUT_DELTA's tuple of an output of one completion: what is new in it, and the rest of its fields (the
    metrics with the last output only)."""
    c = out.outputs[0]
    return (out.request_id, new_token_ids, text_kept, new_text, new_logprobs, c.cumulative_logprob, c.finish_reason,
            c.stop_reason, out.finished, out.error, out.num_cached_tokens, out.metrics if out.finished else None,
            out.kv_handover)


@dataclass(slots=True)
class _SoFar:
    """A running request's output on the receiving side: the last one handed out, and the lists its token ids
    and logprobs are prefixes of (each delta extends them in place). Made from an output sent whole, whose lists
    are handed out as they are: they are copied once, at the request's first delta (a DELTA request's outputs all go
    whole and never have one: copying them at each of its outputs cost what they hold, unused)."""
    last: RequestOutput
    token_ids: list[int] | None = None      # None: not copied yet (the last output's are all there are)
    logprobs: list | None = None

    def own_lists(self) -> None:
        """The lists, copied from the last output if they were not yet."""
        if self.token_ids is None:
            c = self.last.outputs[0]
            self.token_ids, self.logprobs = list(c.token_ids), None if c.logprobs is None else list(c.logprobs)


class OutputsFromDeltas:
    """The receiving end (the API server's, or the same engine thread's): each OutputDeltas message back into a whole,
    cumulative RequestOutput. A request's token ids and logprobs so far are one list each, extended in place by its
    deltas; each output holds its own prefix of them (ListPrefix), so an output a stream still holds never changes, and
    a step costs what is new in it. Copying every request's lists had cost in proportion to what each holds: at batch
    256 with 2,000-token outputs, ~5 ms a step of this process's ~7.5, the copies and the garbage collector's walks over
    them (benchmarks/api_outputs.py). The text is a new string each step, a copy of its characters (~0.4 us a request at
    2,000 tokens, ~2 at 8,000), which the collector does not walk."""

    def __init__(self) -> None:
        self._so_far: dict[str, _SoFar] = {}

    def decode(self, msg: RequestOutput | OutputDelta | CommandAnswer) -> RequestOutput | CommandAnswer:
        """The output a message holds; an answer as OutputDeltas took it (its EngineStepError forgets the request
        here too)."""
        if type(msg) is tuple:        # an OutputDelta, the usual one first: all but a request's first output
            out = self._applied(msg)
            if out.finished:
                del self._so_far[out.request_id]
            return out
        if isinstance(msg, RequestOutput):
            self._so_far.pop(msg.request_id, None)
            if not msg.finished and msg.outputs:
                self._so_far[msg.request_id] = _SoFar(msg)
        elif isinstance(msg.error, EngineStepError):
            self._so_far.pop(msg.request_id, None)
        return msg

    def _applied(self, delta: OutputDelta) -> RequestOutput:
        """The request's last output with the delta applied."""
        (rid, new_token_ids, text_kept, new_text, new_logprobs, cumulative_logprob, finish_reason, stop_reason,
         finished, error, num_cached_tokens, metrics, kv_handover) = delta     # OUTPUT_DELTA's fields
        so_far = self._so_far[rid]
        so_far.own_lists()
        last, c = so_far.last, so_far.last.outputs[0]
        so_far.token_ids += new_token_ids
        if new_logprobs is None:
            so_far.logprobs = None
        elif so_far.logprobs is None:       # none before: these are all there are
            so_far.logprobs = list(new_logprobs)
        else:
            so_far.logprobs += new_logprobs
        comp = CompletionOutput(c.index, c.text[:text_kept] + new_text, ListPrefix(so_far.token_ids),
                                cumulative_logprob, None if so_far.logprobs is None else ListPrefix(so_far.logprobs),
                                finish_reason, stop_reason)
        so_far.last = RequestOutput(rid, last.prompt, last.prompt_token_ids, [comp], finished,
                                    metrics or last.metrics, error, num_cached_tokens, last.prompt_logprobs,
                                    kv_handover)
        return so_far.last
