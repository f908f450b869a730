"""One lifecycle of a DisaggLLM's two engines, seen from the driver: submit, abort, close, poll, wait.

Whoever holds a request sends its final output (P until D acknowledges the KV, D after); if an
abort races a finish, the first final to arrive stands. When both engines have ended the session
(or died), every request still without a final gets an error output naming the reason.
"""
from __future__ import annotations

import dataclasses
import select
import time
from typing import TYPE_CHECKING

from picovllm.disagg.channel import PeerGone
from picovllm.disagg.messages import (Abort, CloseSession, Output, OutputDecoder, SessionEnded, StartSession, Submit,
                                      SubmitResult)
from picovllm.engine.llm_engine import EngineClosedError
from picovllm.outputs import CompletionOutput, RequestOutput
from picovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from picovllm.disagg.driver import DisaggLLM

ROLES = ("p", "d")
NAMES = {"p": "prefill", "d": "decode"}


class DisaggSession:
    """One lifecycle of the two engines, seen from the driver: submit, abort, close, poll, is_done, wait."""

    def __init__(self, llm: DisaggLLM, session: int, opts: dict, stream: bool, fault: dict) -> None:
        self.llm, self.session, self.stream = llm, session, stream
        self.lease_s = opts["lease_s"]     # a worker silent this long (no heartbeat: frozen, or its host hung) is gone
        self._started = time.monotonic()   # (silence counts from the session's start: no beats came between sessions)
        self.results: dict[str, RequestOutput] = {}      # final outputs
        self.rejected: dict[str, str] = {}               # submit refused: request_id -> why
        self.ended: dict[str, SessionEnded] = {}
        self.submitted: list[str] = []
        self._prompts: dict[str, str | list[int]] = {}
        self._unanswered: set[str] = set()               # submits without a SubmitResult yet
        self._closed = False
        self._wire: dict[tuple[str, str], OutputDecoder] = {}   # (role, request_id): streamed outputs
        for role in ROLES:
            start = StartSession(session, opts["backend"], opts["async_transfer"], opts["transfer_timeout_s"],
                                 opts["lease_s"], opts["connect_timeout_s"],
                                 llm.ready["p"].address if role == "d" else None, stream, fault.get(role))
            self._send(role, start)

    def _send(self, role: str, msg) -> bool:
        if role in self.llm.gone:
            return False
        try:
            self.llm.channels[role].send(msg)
            return True
        except PeerGone as e:
            self._lost(role, str(e))
            return False

    def _lost(self, role: str, why: str) -> None:
        proc = self.llm.procs.get(role)
        if proc is None:          # a worker on another host: its channel is all we see of it
            self.llm.gone.setdefault(role, f"the {NAMES[role]} engine (remote) is gone ({why})")
            return
        proc.join(1.0)
        code = proc.exitcode
        self.llm.gone.setdefault(role, f"the {NAMES[role]} engine process died (exit code {code})" if code is not None
                                 else f"the {NAMES[role]} engine process is gone ({why})")

    # -- the surface ---------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None) -> str:
        if self._closed:
            raise EngineClosedError("the session is closed (no more requests): submit refused")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        rid = request_id or self.llm.next_request_id()
        if rid in self._prompts:
            raise ValueError(f"request_id {rid!r} is already in use")
        self._prompts[rid] = prompt
        self.submitted.append(rid)
        self._unanswered.add(rid)
        self._send("p", Submit(rid, prompt, dataclasses.asdict(params), time.time()))
        return rid

    def abort(self, request_id: str) -> None:
        """Abort wherever the request is: P forwards to D what it has handed over."""
        if not self._send("p", Abort(request_id)):
            self._send("d", Abort(request_id))

    def close(self) -> None:
        """No more requests: P refuses further submits, drains, hands over, ends the stream to D. Once per session: a
        second close is a no-op (P's engine serves every session, and a CloseSession sent once this one is over would
        close the session the driver runs next)."""
        if self._closed:
            return
        self._closed = True
        self._send("p", CloseSession())

    def is_done(self) -> bool:
        return all(role in self.ended or role in self.llm.gone for role in ROLES)

    def poll(self, timeout_s: float = 0.0) -> list[RequestOutput]:
        """Outputs that arrived (finals; every output with stream=True), waiting up to timeout_s for one."""
        chans = {role: ch for role, ch in self.llm.channels.items() if role not in self.llm.gone}
        if chans and timeout_s > 0:
            select.select([c.sock for c in chans.values()], [], [], timeout_s)
        outs = []
        for role, ch in chans.items():
            try:
                msgs = ch.recv_all()
            except PeerGone as e:
                msgs = []
                self._lost(role, str(e))
            for msg in msgs:
                outs += self._on_message(role, msg)
            silent = min(ch.silent_for(), time.monotonic() - self._started)
            if role not in self.llm.gone and role not in self.ended and silent > self.lease_s:
                self._lost(role, f"silent for {silent:.1f} s (lease {self.lease_s:g} s)")
        if self.is_done():
            outs += self._fail_unfinished()
        return outs

    def _on_message(self, role: str, msg) -> list[RequestOutput]:
        if isinstance(msg, SubmitResult):
            self._unanswered.discard(msg.request_id)
            if msg.error is not None:
                self.rejected[msg.request_id] = msg.error
            return []
        if isinstance(msg, Output):
            key = (role, (msg.output.get("output") or msg.output["delta"])["request_id"])
            wire = self._wire.pop(key, None) or OutputDecoder(views=not self.stream)    # a user's: lists
            out = wire.decode(msg.output)
            if not out.finished:
                self._wire[(role, out.request_id)] = wire
            if out.request_id in self.results:
                return []                          # a second final (abort raced a finish): the first stands
            if out.finished:
                self.results[out.request_id] = out
            return [out]
        if isinstance(msg, SessionEnded) and msg.session == self.session:
            self.ended[role] = msg
        return []

    def _fail_unfinished(self) -> list[RequestOutput]:
        """Once both sides are done or dead: every request without a final gets an error output."""
        # an engine's own word first (why it failed: a tensor-parallel rank died), then what the driver saw
        said = [e.error for e in self.ended.values() if e.error]
        why = "; ".join(said + list(self.llm.gone.values())) or "the engines ended the session without finishing it"
        outs = []
        for rid in self.submitted:
            if rid not in self.results and rid not in self.rejected:
                prompt = self._prompts[rid]
                out = RequestOutput(rid, prompt if isinstance(prompt, str) else None,
                                    prompt if isinstance(prompt, list) else [],
                                    [CompletionOutput(0, "", [], None, None, "error")], True, None, why)
                self.results[rid] = out
                outs.append(out)
        return outs

    def wait_submitted(self, timeout_s: float | None = None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._unanswered and not self.is_done() and "p" not in self.llm.gone:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the prefill engine did not answer {len(self._unanswered)} submits")
            self.poll(0.05)

    def wait(self, timeout_s: float | None = None, use_tqdm: bool = False) -> dict[str, RequestOutput]:
        """Until both engines have ended the session (call close() first). Returns the final outputs."""
        from tqdm import tqdm
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with tqdm(total=len(self.submitted), desc="Processed prompts", disable=not use_tqdm) as bar:
            while not self.is_done():
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"session {self.session} not done after {timeout_s:g} s")
                bar.update(sum(o.finished for o in self.poll(0.05)))
            self.poll()
        return self.results
