"""AsyncEngine: drives a (not thread-safe) Engine from one background thread for an asyncio server.

Every engine call happens on the loop thread. The event loop talks to it through EngineClient (engine_client.py):
typed commands on a thread-safe queue (add, abort, shutdown); the loop thread hands each step's RequestOutputs back,
with its answers to commands (CommandAnswer), in one call_soon_threadsafe per step. engine_process.ProcessAsyncEngine
runs the same loop in a process of its own instead. The loop's two ends are seams: _receive (the commands) and
_deliver (an iteration's outputs).

A request's grammar (structured outputs) compiles on a thread of its own (COMPILE_THREADS at once), never the
loop's: a long one takes seconds, and every other request would wait them out. The request is added once it is
compiled (its add answered then: a grammar that cannot be compiled is refused naming the field, as before); the
loop looks for finished ones every COMPILE_POLL_S meanwhile. An add aborted before its compile started is not
compiled at all (answered at once, as an add then an abort), and a compile running when the loop ends is left to
itself: the threads are daemons (CompileThreads), which do not hold up the process's exit.

The requests the loop adds make their outputs as deltas in the engine (Engine.add_request's stream_deltas), which
the loop adds up again before they reach the streams (output_deltas.py): each output then holds a prefix of one
token-id list (and logprobs list) a request, ListPrefix, where the engine's cumulative outputs copied every running
request's whole lists every step (benchmarks/served_outputs.py --thread, batch 256 at 2,000 tokens: make_output 2.6
-> 0.4 ms a step, the garbage collector's time over the run 6.8 -> 2.7 s). The engine's own outputs stay cumulative:
an offline LLM.generate on the same engine is not affected. A loop whose outputs leave for another process
(engine_process.PipeEnds: the engine makes deltas of every request and the other side adds them up) or whose outputs
are re-sent whole (a P's, disagg.pd_http) says adds_deltas = False; a D's makes every request's outputs as deltas
(its requests come from its connector).

An idle loop wakes at least every LIVENESS_S to ask its executor whether every rank is alive (Executor.check_alive):
a tensor-parallel rank that dies while no step runs ends the loop within about a second, as a failed step would,
instead of failing the next request. A busy loop never asks (its steps notice).

This layer knows nothing about HTTP: the OpenAI server (and a PD role) sit on top of it.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from picovllm.engine.grammar_masks import CompileThreads
from picovllm.engine.llm_engine import Engine
from picovllm.engine.model_runner import bind_device
from picovllm.engine.request import FinishReason, Request
from picovllm.engine.step_loop import StepLoop
from picovllm.entrypoints.openai.engine_client import (AbortAll, AbortRequest, AddRequest, Command, CommandAnswer,
                                                       EngineClient, EngineStats, EngineStepError, Shutdown)
from picovllm.entrypoints.openai.output_deltas import OutputDeltas, OutputsFromDeltas
from picovllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

LIVENESS_S = 1.0    # an idle loop's longest wait for a command, and how often it asks Executor.check_alive
COMPILE_POLL_S = 0.002      # while grammars compile: an idle loop's longest wait for a command
# grammars compiling at once: one that takes minutes (a 50,000-value enum) does not hold back the others
COMPILE_THREADS = 4


@dataclass
class _Compiling:
    """An add whose grammar compiles (AsyncEngine._compile_then_add)."""
    cmd: AddRequest
    compiled: Future
    aborted: bool = False   # aborted meanwhile: added once compiled, and aborted at once (as an add then an abort);
    # or, aborted before its compile started, answered so without it

    def abort(self) -> None:
        self.aborted = True
        self.compiled.cancel()      # not started yet: never compiled (CompileThreads skips it)


class AsyncEngine(EngineClient):
    adds_deltas = True      # the requests it adds make delta outputs, added up here (the module's docstring)

    def __init__(self, engine: Engine, metrics=None) -> None:
        super().__init__(queue.SimpleQueue(), metrics)
        self.engine = engine
        self._steps = StepLoop(engine, self._take_commands)     # the engine's one loop, run by the thread
        self._pending: list = []        # this iteration's answers to commands (loop thread only)
        self._next_liveness = 0.0       # time.monotonic() before which an idle loop does not look at the ranks
        self._compiling: dict[str, _Compiling] = {}    # adds whose grammar compiles, by request id (loop thread)
        self._compile_pool: CompileThreads | None = None     # the grammars' threads, at the first one
        self._thread: threading.Thread | None = None
        # adds_deltas: the engine's delta outputs as OutputDelta tuples, and those added up (loop thread only)
        self._adding_up = (OutputDeltas(engine_deltas=True), OutputsFromDeltas()) if self.adds_deltas else None
        self._publish_stats()

    # -- lifecycle (event loop side) -------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="picovllm-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def shutdown(self) -> None:
        """Abort whatever is still in flight and stop the loop thread."""
        if self._thread is None:
            return
        self._commands.put(Shutdown())
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None

    # -- the loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        why = "the engine loop has shut down"
        try:
            config = getattr(self.engine, "config", None)
            if config is not None:
                bind_device(config.device)      # this thread runs the model
            self._deliver([])     # the stats as built (a process's pipe: its server's metrics before any request)
            while self._iteration():
                pass
            failure = self._cannot_step()
            if failure is not None:
                logger.error("%s: stopping the engine loop", failure)
                why = failure
        except BaseException:
            logger.exception("engine loop crashed")
            why = "the engine loop crashed"
            raise
        finally:   # nobody will answer requests still waiting (an add that raced the shutdown)
            if self._compile_pool is not None:      # a grammar compiling is left to finish on its own
                self._compile_pool.shutdown()
            self.ended_why = why        # before the thread ends: a request refused from then on is told why
            self._deliver_end(why)

    def _iteration(self) -> bool:
        engine = self.engine
        self._pending = outputs = []    # _take_commands answers into it
        try:
            stepped = self._steps.run_once()
            if stepped is not None:
                outputs.extend(self._after_step(stepped))
        except Exception as e:   # one bad step must not take the server down: fail its requests
            logger.exception("engine step failed; aborting %d requests", len(engine.requests))
            err = EngineStepError(f"engine step failed: {type(e).__name__}: {e}")
            # each request is answered with the error, not with its abort's output: counted as an error where the
            # answers arrive (_finish_outputs)
            failed = list(engine.requests)
            engine.abort_all()
            outputs.extend(CommandAnswer(rid, err) for rid in failed)
            stepped = []
        if stepped is None:             # shut down: nobody will read what is left
            self._abort_all_into(outputs)
        if self._adding_up is not None:
            outputs = self._added_up(outputs)
        self._finish_outputs(outputs)
        self._publish_stats()
        self._deliver(outputs)
        return stepped is not None and self._cannot_step() is None

    def _added_up(self, outputs: list) -> list:
        """An iteration's outputs, each request's whole so far (adds_deltas: the engine's hold what is new)."""
        deltas, so_far = self._adding_up
        return [so_far.decode(deltas.encode(o)) for o in outputs]

    def _cannot_step(self) -> str | None:
        """Why the engine can never step again (Executor.failure: a tensor-parallel rank died), or None. Then the
        loop ends: /health answers 503 and new requests are refused at once, where stepping on would fail each of
        them in a step of its own."""
        executor = getattr(self.engine, "executor", None)
        failure = getattr(executor, "failure", None)
        return None if failure is None else f"the engine cannot step any more: {failure}"

    def _deliver(self, outputs: list) -> None:
        """An iteration's outputs (and answers to commands), to the event loop."""
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _deliver_end(self, why: str) -> None:
        """The loop has ended: nobody will answer what is still waiting."""
        self._loop.call_soon_threadsafe(self._fail_all_streams, why)

    def _take_commands(self, wait_s: float | None) -> bool:
        """StepLoop's input: the commands queued, waiting up to wait_s for the first (LIVENESS_S at most). False:
        shut down. Idle (wait_s not 0), it also looks at the ranks (_rank_died): once one is found dead the commands
        are left alone, the iteration ends the loop (_cannot_step) and its end fails them naming the rank."""
        timeout = self._poll_timeout(wait_s)
        longest = COMPILE_POLL_S if self._compiling else LIVENESS_S
        cmds = self._receive(longest if timeout is None else min(timeout, longest))
        if wait_s != 0 and self._rank_died():
            return True
        stop = False
        for cmd in cmds:
            stop = self._handle(cmd, self._pending) or stop
        if self._compiling:
            self._add_compiled(self._pending)
        return not stop

    def _rank_died(self) -> bool:
        """Whether the executor finds a rank dead (Executor.check_alive), asked at most once per LIVENESS_S."""
        now = time.monotonic()
        if now < self._next_liveness:
            return False
        self._next_liveness = now + LIVENESS_S
        executor = getattr(self.engine, "executor", None)
        return executor is not None and executor.check_alive() is not None

    def _receive(self, timeout_s: float | None) -> list[Command]:
        """The commands queued, waiting up to timeout_s (None: until one comes) for the first."""
        cmds = self._wait_for_command(timeout_s)
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _poll_timeout(self, wait_s: float | None) -> float | None:
        """How long to wait on the command queue (a subclass whose engine has a peer polls it)."""
        return wait_s

    def _wait_for_command(self, timeout_s: float | None) -> list[Command]:
        if timeout_s == 0:
            return []
        try:
            return [self._commands.get(timeout=timeout_s)]
        except queue.Empty:
            return []

    def _after_step(self, outputs: list) -> list:
        """One engine step's outputs (a subclass may add its own items for _dispatch)."""
        return outputs

    def model_info(self) -> dict:
        """What GET /v1/models shows besides the name (the revision of a Hub repository, where one was asked for:
        a front end in front of this engine reads its tokenizer and generation config at the same one; a pooling
        engine's runner, which the embeddings route asks for)."""
        e = self.engine
        revision = {"revision": e.config.revision} if e.config.revision is not None else {}
        pooling = {"runner": "pooling"} if e.config.runner == "pooling" else {}   # serves /v1/embeddings
        return {"root": e.config.model, **revision, "max_model_len": e.max_model_len,
                "vocab_size": e.model_config.vocab_size, **pooling}

    def eos_token_ids(self) -> list[int] | None:
        return list(self.engine.eos_token_ids)

    def role_info(self) -> dict:
        """What does not change while serving, which the server's routes show (a P or D engine's: its link or
        KV address); the loop's side computes it, so it crosses to a server whose loop runs elsewhere."""
        return {}

    def _connector_stats(self) -> dict:
        """What changes, published with each iteration's stats (EngineStats.connector)."""
        return {}

    def release(self) -> None:
        """After the loop has ended, on its side: let go of what the engine holds beyond itself (a peer link)."""

    def _handle(self, cmd: Command, outputs: list) -> bool:
        if isinstance(cmd, Shutdown):
            return True
        if isinstance(cmd, AbortRequest):
            if cmd.request_id in self._compiling:
                self._compiling[cmd.request_id].abort()
            else:
                self._abort_into(cmd.request_id, outputs)
            return False
        if isinstance(cmd, AbortAll):
            self._abort_all_into(outputs)
            return False
        rid, compiling = cmd.request_id, self._compiling.get(cmd.request_id)
        if compiling is not None and not compiling.aborted:     # refused as the engine refuses an id in use
            outputs.append(CommandAnswer(rid, ValueError(f"request_id {rid!r} is already in use")))
            return False
        if compiling is not None:   # a client lets an id go once the add it aborted is gone: that add is dropped
            del self._compiling[rid]     # (added then aborted, it would refuse and abort this one)
        if getattr(cmd.params, "structured_outputs", None) is not None:
            self._compile_then_add(cmd)
        else:
            self._add(cmd, outputs)
        return False

    def _compile_then_add(self, cmd: AddRequest) -> None:
        """A request with a grammar: compiled on the grammars' thread first (Engine.compile_grammar), added by
        _add_compiled once it is."""
        if self._compile_pool is None:
            self._compile_pool = CompileThreads(COMPILE_THREADS, "picovllm-grammar")
        self._compiling[cmd.request_id] = _Compiling(cmd, self._compile_pool.submit(self.engine.compile_grammar,
                                                                                   cmd.params))

    def _add_compiled(self, outputs: list) -> None:
        """The adds whose grammar has compiled, in the order they came (one that compiles on does not hold back
        those after it): each added (Engine.add_request finds its grammar compiled), or refused with the compile's
        error."""
        for rid, c in list(self._compiling.items()):
            if not c.compiled.done():
                continue
            del self._compiling[rid]
            if c.compiled.cancelled():     # aborted before it compiled: as if added, then aborted
                outputs.append(CommandAnswer(rid, None))
                outputs.append(self._aborted_output(c.cmd))
                continue
            error = c.compiled.exception()
            if isinstance(error, ValueError):
                outputs.append(CommandAnswer(rid, error))
                continue
            if error is not None:
                logger.error("compiling the grammar of %s failed: %r", rid, error)
                outputs.append(CommandAnswer(rid, EngineStepError(
                    f"compiling the grammar failed: {type(error).__name__}: {error}")))
                continue
            self._add(c.cmd, outputs)
            if c.aborted:
                self._abort_into(rid, outputs)

    def _aborted_output(self, cmd: AddRequest) -> RequestOutput:
        """The output of an add aborted before it was added: the abort's of a request added then aborted at once."""
        req = Request(cmd.request_id, cmd.prompt_token_ids, cmd.params, None, cmd.arrival_time)
        req.finish(FinishReason.ABORT)
        return self.engine.make_output(req)

    def _add(self, cmd: AddRequest, outputs: list) -> None:
        error = None
        try:
            if self._adding_up is not None:
                self._adding_up[0].track(cmd)       # a DELTA request's outputs go as they are
            self.engine.add_request(cmd.prompt_token_ids, cmd.params, cmd.request_id, cmd.arrival_time,
                                    cmd.priority, stream_deltas=self.adds_deltas)
        except ValueError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - reported to the caller, never kills the loop
            logger.exception("add_request failed")
            error = EngineStepError(f"add_request failed: {type(e).__name__}: {e}")
        outputs.append(CommandAnswer(cmd.request_id, error))

    def _abort_into(self, request_id: str, outputs: list) -> None:
        out = self.engine.abort(request_id)
        if out is not None:
            outputs.append(out)

    def _abort_all_into(self, outputs: list) -> None:
        """Every request aborted (AbortAll, a shutdown); a subclass that keeps something per request forgets it
        here as in _abort_into. Adds whose grammar compiles are aborted as soon as they are added."""
        for c in self._compiling.values():
            c.abort()
        outputs.extend(self.engine.abort_all())

    def _publish_stats(self) -> None:
        e, bm, counts = self.engine, self.engine.block_manager, self.engine.stats
        self.stats = EngineStats(
            num_running=e.num_running, num_waiting=e.num_waiting,
            num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks,
            prefill_tokens=counts.prefill_tokens, decode_tokens=counts.decode_tokens,
            prefix_queried_tokens=bm.queried_tokens, prefix_hit_tokens=bm.hit_tokens,
            prefix_requeried_tokens=bm.requeried_tokens, prefix_rehit_tokens=bm.rehit_tokens,
            drafts=counts.drafts, draft_tokens=counts.draft_tokens, accepted_tokens=counts.accepted_tokens,
            accepted_per_pos=list(e.accepted_per_pos), preemptions=e.scheduler.num_preemptions,
            connector=self._connector_stats())
        if self.metrics:
            self.metrics.observe_engine(self.stats)
