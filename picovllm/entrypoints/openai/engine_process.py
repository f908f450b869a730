"""ProcessAsyncEngine: the server's engine loop in a process of its own (`picovllm serve --engine-process`).

In AsyncEngine the loop thread and the HTTP event loop share one interpreter and its GIL, so under load each waits
for the other (BENCHMARKS.md, thirteenth session: at 80 requests/s on an H200 a request took 4.6 ms at the median and
14 ms at p99 from the client's send to its handler). Here a child process (spawned: CUDA starts there only) builds
the Engine and runs AsyncEngine's own loop, its two ends on pipes: the parent's commands in, each iteration's
outputs and the engine's stats out. The parent keeps EngineClient's streams and one thread that reads the pipe and
hands the outputs to the event loop, as the loop thread did. The parent loads the tokenizer for itself (the HTTP
side encodes and renders chats).

What crosses the pipe each step is what changed (OutputDeltas): a RequestOutput is cumulative (the prompt's ids, every
token so far), and pickling 256 of them whole took 3-9 ms a step on the CPU (500-token prompts, 50-1000 tokens out).
A DELTA request's outputs (SamplingParams.output_kind) hold only what is new already: they go whole. A colocated
engine (ChildLoop), and a P/D server's D (disagg.pd_http.PDPipeEnds), makes its CUMULATIVE requests' outputs as DELTA
ones too (Engine.stream_deltas), each sent as an OutputDelta of itself: copying every request's whole output every
step (and the garbage collector's walks over those copies) cost ~11 ms a step at batch 256 with 2,000-token outputs
(benchmarks/served_outputs.py). The parent adds them up (OutputsFromDeltas). Both ends: output_deltas.py.

The child ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; the parent shuts the child down) and
ends when the parent's pipe closes, so it never outlives the server. While it builds the engine it reads no pipe, so
there SIGTERM stops it (the parent's stop() sends it before the engine is ready), and so does its parent's end (a
thread watches for it: a parent killed outright leaves no one to send it).

Several API servers (`serve --api-server-count N`, api_workers.py): one engine process, a pair of pipes per API
server process besides the parent's, which then carries only start-up and shutdown. Each request's outputs go back
on the pipe it came in on; an API server that leaves (its pipe closes, or it says Shutdown) has its requests
aborted, and the engine goes on for the others.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for_pipes
from typing import Any

from picovllm.config import EngineConfig
from picovllm.engine.llm_engine import Engine
from picovllm.entrypoints.openai.async_engine import AsyncEngine
from picovllm.entrypoints.openai.engine_client import (AbortAll, AbortRequest, AddRequest, Command, CommandAnswer,
                                                       EngineClient, EngineFailed, EngineReady, LoopEnded, Shutdown,
                                                       StepOutputs)
from picovllm.gc_freeze import freeze_for_serving
from picovllm.loader import engine_model_source
from picovllm.loader.tokenizer import tokenizer_of
from picovllm.entrypoints.openai.output_deltas import OutputDeltas, OutputsFromDeltas
from picovllm.outputs import RequestOutput

logger = logging.getLogger(__name__)


def load_tokenizer(config: EngineConfig):
    """The tokenizer the engine loads for itself (None without one), for the HTTP side."""
    return tokenizer_of(engine_model_source(config), config)


class _PipeCommands:
    """EngineClient's command sink over a pipe (the event loop is its one sender)."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def put(self, cmd: Command) -> None:
        try:
            self.conn.send(cmd)
        except (OSError, ValueError):     # the child is gone: the reader thread fails the streams
            pass


class PipeEngineClient(EngineClient):
    """The event loop's side of an engine loop in another process, over a pair of pipes (commands out, outputs in):
    one thread reads the outputs and hands them to the event loop. ready: what the engine said of itself once
    built (model, role, eos). observe_engine: whether the engine's stats go to the metrics (with several API
    servers, one of them publishes the engine's gauges and counters). on_end, if set: called on the event loop once
    the engine's side has ended (an API server process then exits)."""

    def __init__(self, commands, outputs, metrics=None, ready: EngineReady | None = None,
                 observe_engine: bool = True) -> None:
        super().__init__(_PipeCommands(commands), metrics)
        self._out = outputs
        self._outputs = OutputsFromDeltas()     # the reader thread's
        self._ready = ready
        self._observe_engine = observe_engine
        self.on_end: Callable[[], None] | None = None
        self._reader: threading.Thread | None = None

    def model_info(self) -> dict:
        return {} if self._ready is None else dict(self._ready.model_info)

    def role_info(self) -> dict:
        return {} if self._ready is None else dict(self._ready.role_info)

    def eos_token_ids(self) -> list[int] | None:
        return [] if self._ready is None else list(self._ready.eos)

    # -- lifecycle (event loop side) -------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read, name="picovllm-engine-reader", daemon=True)
        self._reader.start()

    @property
    def is_running(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    async def shutdown(self) -> None:
        """Leave the engine: what this side still has in flight is aborted, and the engine says its last."""
        self._commands.put(Shutdown())
        if self._reader is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._reader.join, 60)

    # -- the reader thread -----------------------------------------------------------------------
    def _read(self) -> None:
        why = "the engine process has ended"
        try:
            while isinstance(msg := self._out.recv(), StepOutputs):
                self._take(msg)
            why = msg.why           # LoopEnded, the one other message after EngineReady
        except (EOFError, OSError):
            why = self._died()
        finally:
            self.ended_why = why        # before the thread ends: a request refused from then on is told why
            self._to_loop(self._ended, why)

    def _take(self, step: StepOutputs) -> None:
        self.stats = step.stats
        outputs = [self._outputs.decode(m) for m in step.items]
        if self.metrics and self._observe_engine:
            self.metrics.observe_engine(self.stats)
        self._finish_outputs(outputs)
        if outputs:
            self._to_loop(self._dispatch, outputs)

    def _to_loop(self, fn: Callable, *args) -> None:
        """fn(*args) on the event loop, unless that loop has closed: an asyncio.run ended by Ctrl-C (run-batch's)
        closes it before the engine process, which ignores SIGINT, has said its last; nobody is left to tell, and
        the thread raising there printed a traceback on the way out."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:        # "Event loop is closed"
            if not self._loop.is_closed():
                raise

    def _died(self) -> str:
        logger.error("the engine process died")
        return "the engine process died"

    def _ended(self, why: str) -> None:
        self._fail_all_streams(why)
        if self.on_end is not None:
            self.on_end()


def engine_ready(outputs) -> EngineReady:
    """The engine process's first word on an outputs pipe: what it says of itself once built (model, role, eos), or
    why it could not be built (EngineFailed), raised as ValueError, SystemExit or RuntimeError."""
    try:
        msg = outputs.recv()
    except (EOFError, OSError):
        msg = EngineFailed("RuntimeError", "the engine process exited before its engine was built")
    if not isinstance(msg, EngineReady):
        raise {"ValueError": ValueError, "SystemExit": SystemExit}.get(msg.kind, RuntimeError)(msg.why)
    return msg


class ProcessAsyncEngine(PipeEngineClient):
    """Spawns the engine's process at once; wait_ready() blocks until the engine is built (or raises why not).

    build(config) makes the Engine in the child (a P or D server's also links it to its peer); loop_cls runs it
    there: an AsyncEngine subclass with PipeEnds first among its bases. Both are pickled by reference (module-level
    functions and classes, or a functools.partial of one).

    api_servers > 0: the engine also gets that many pairs of pipes (api_ends: each API server's two ends, to hand
    to its process), and this side's pair carries only start-up and shutdown (nothing reads it in between)."""

    def __init__(self, config: EngineConfig, metrics=None, log_level: str = "info",
                 build: Callable[[EngineConfig], Any] | None = None, loop_cls: type | None = None,
                 api_servers: int = 0) -> None:
        ctx = mp.get_context("spawn")
        pairs = [(ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)) for _ in range(1 + api_servers)]
        (cmd_read, cmd_write), (out_read, out_write) = pairs[0]
        super().__init__(cmd_write, out_read, metrics)
        commands = [p[0][0] for p in pairs] if api_servers else cmd_read
        results = [p[1][1] for p in pairs] if api_servers else out_write
        # not a daemon: the engine may start processes of its own (tensor-parallel ranks)
        loop_cls = loop_cls or (SharedChildLoop if api_servers else ChildLoop)
        self._proc = ctx.Process(target=_child_main, name="picovllm-engine",
                                 args=(config, build, loop_cls, commands, results, log_level))
        self._proc.start()
        for (c_read, _), (_, o_write) in pairs:
            c_read.close()
            o_write.close()
        self.api_ends = [(c_write, o_read) for (_, c_write), (o_read, _) in pairs[1:]]
        # Ours runs before multiprocessing's own exit handler, which waits for the child: on a way out that skipped
        # shutdown() (a second Ctrl-C), the closed pipe is what tells the child to end.
        atexit.register(cmd_write.close)

    def wait_ready(self) -> None:
        """Block until the child has built its engine. If it could not: ValueError (a bad configuration, as Engine()
        raises it), SystemExit (what build exits with) or RuntimeError, with the child's reason."""
        try:
            self._ready = engine_ready(self._out)
        except (ValueError, SystemExit, RuntimeError) as e:      # the child is ending
            self._proc.join(10)
            if self._proc.exitcode:     # it died (a reported failure returns: exit code 0)
                raise RuntimeError(f"{e} (exit code {self._proc.exitcode})") from None
            raise

    # -- lifecycle (event loop side) -------------------------------------------------------------
    def start(self) -> None:
        if self._ready is None:
            self.wait_ready()
        super().start()

    @property
    def is_running(self) -> bool:
        return super().is_running and self._proc.is_alive()

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    async def shutdown(self) -> None:
        """Abort whatever is still in flight, stop the child and wait for it."""
        self._commands.put(Shutdown())
        await asyncio.get_running_loop().run_in_executor(None, self.join)

    def join(self, timeout_s: float = 60.0) -> None:
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            logger.warning("the engine process did not stop in %.0f s: killing it", timeout_s)
            self._proc.kill()
            self._proc.join()
        if self._reader is not None:
            self._reader.join(5)

    def stop(self) -> None:
        """From outside an event loop (start-up failed or was interrupted, or the API servers have gone): stop the
        child. One still building its engine reads no commands until it is built: SIGTERM stops it there."""
        if self._ready is None and self._proc.is_alive():
            self._proc.terminate()
        self._commands.put(Shutdown())
        self.join()

    def _died(self) -> str:
        logger.error("the engine process died (exit code %s)", self._proc.exitcode)
        return "the engine process died"


class PipeEnds:
    """The two ends of an AsyncEngine loop (its seams _receive, _deliver, _deliver_end) on the child's pipes:
    commands from the parent, each iteration's outputs and the stats (when they change) back. Mixed in first,
    before AsyncEngine or a subclass (a P or D server's)."""

    # the engine's outputs of CUMULATIVE requests hold only what is new (Engine.stream_deltas): a colocated engine's,
    # and a D's (disagg.pd_http.PDPipeEnds). Not a P's: it re-sends a request's last output when D takes it over
    stream_deltas = False
    adds_deltas = False     # the other process adds up what goes on the pipe (AsyncEngine's own adding up: not here)

    def __init__(self, engine, commands, results) -> None:
        super().__init__(engine)
        self._in, self._out = commands, results
        self._sent_stats = None
        engine.stream_deltas = self.stream_deltas
        self._deltas = OutputDeltas(self.stream_deltas)

    def _receive(self, timeout_s: float | None) -> list[Command]:
        cmds: list[Command] = []
        try:
            if self._in.poll(timeout_s):            # None: until one comes
                cmds.append(self._in.recv())
                while self._in.poll(0):
                    cmds.append(self._in.recv())
        except (EOFError, OSError):                 # the parent is gone
            cmds.append(Shutdown())
        for cmd in cmds:
            self._deltas.track(cmd)
        return cmds

    def _deliver(self, outputs: list) -> None:
        if outputs or self.stats != self._sent_stats:
            self._out.send(StepOutputs([self._deltas.encode(o) for o in outputs], self.stats))
            self._sent_stats = self.stats

    def _deliver_end(self, why: str) -> None:
        try:
            self._out.send(LoopEnded(why))
        except OSError:
            pass


class SharedPipeEnds(PipeEnds):
    """PipeEnds for several API server processes: pipe 0 is the parent's (start-up and shutdown only), pipes 1..N
    the API servers'. Each request's outputs go back on the pipe its AddRequest came in on; the engine's stats go
    to API server 1, which publishes them (the others' metrics would count them again). An API server that says
    Shutdown gets its requests' aborts and then LoopEnded; one whose pipe breaks has its requests aborted. AbortAll
    and AbortRequest reach only the sender's own requests."""

    def __init__(self, engine, commands: list, results: list) -> None:
        super().__init__(engine, commands[0], results[0])
        self._ins, self._outs = commands, results
        self._owner: dict[str, int] = {}            # request id -> the API server that added it
        self._open = set(range(1, len(commands)))   # API servers still sending
        self._leaving: set[int] = set()             # said Shutdown: their last outputs, then LoopEnded

    def _receive(self, timeout_s: float | None) -> list[Command]:
        cmds: list[Command] = []
        for conn in wait_for_pipes([self._ins[0], *(self._ins[k] for k in sorted(self._open))], timeout_s):
            k = self._ins.index(conn)
            try:
                while conn.poll(0):
                    cmds += self._from(k, conn.recv())
            except (EOFError, OSError):             # that process is gone
                cmds += self._leave(k, gone=True)
        for cmd in cmds:
            self._deltas.track(cmd)
        return cmds

    def _from(self, k: int, cmd: Command) -> list[Command]:
        if k == 0:
            return [cmd]
        if isinstance(cmd, AddRequest):
            rid = cmd.request_id
            if rid in self._owner:                  # another API server's: refused here, never taken over
                self._send(k, StepOutputs([CommandAnswer(rid, ValueError(f"request_id {rid!r} is already in use"))],
                                          self.stats))
                return []
            self._owner[rid] = k
            return [cmd]
        if isinstance(cmd, AbortAll):
            return self._aborts(k)
        if isinstance(cmd, Shutdown):
            return self._leave(k, gone=False)
        return [cmd] if self._owner.get(cmd.request_id) == k else []

    def _aborts(self, k: int) -> list[Command]:
        return [AbortRequest(rid) for rid, owner in self._owner.items() if owner == k]

    def _leave(self, k: int, gone: bool) -> list[Command]:
        if k == 0:                                  # the parent: the engine shuts down
            return [Shutdown()]
        self._open.discard(k)
        if not gone:
            self._leaving.add(k)
        aborts = self._aborts(k)
        logger.info("API server %d has left the engine (%d requests aborted)", k, len(aborts))
        return aborts

    def _deliver(self, outputs: list) -> None:
        per: dict[int, list] = {}
        for o in outputs:
            if isinstance(o, RequestOutput):
                rid, item, done = o.request_id, self._deltas.encode(o), o.finished
            else:                                   # a CommandAnswer: an Exception ends the request
                rid, item, done = o.request_id, self._deltas.encode(o), isinstance(o.error, Exception)
            k = self._owner.pop(rid, None) if done else self._owner.get(rid)
            if k is not None:
                per.setdefault(k, []).append(item)
        if self.stats != self._sent_stats:
            per.setdefault(1, [])
            self._sent_stats = self.stats
        for k, items in per.items():
            self._send(k, StepOutputs(items, self.stats))
        for k in self._leaving:
            self._send(k, LoopEnded("this API server has left the engine"))
        self._leaving.clear()

    def _send(self, k: int, msg: StepOutputs | LoopEnded) -> None:
        if k in self._open or k in self._leaving:
            try:
                self._outs[k].send(msg)
            except OSError:                         # gone: its requests are aborted when its pipe reads EOF
                self._open.discard(k)

    def _deliver_end(self, why: str) -> None:
        for k in sorted(self._open | self._leaving):
            self._send(k, LoopEnded(why))
        super()._deliver_end(why)


class ChildLoop(PipeEnds, AsyncEngine):
    """A colocated server's loop in its engine process."""
    stream_deltas = True


class SharedChildLoop(SharedPipeEnds, AsyncEngine):
    """A colocated server's loop in its engine process, for several API server processes."""
    stream_deltas = True


class StopBuilding(BaseException):
    """SIGTERM, or the parent's end, while the child builds its engine (_child_main)."""


def _stop_building(*_) -> None:
    raise StopBuilding


def _watch_parent(parent: int, built: threading.Event, every_s: float = 0.5) -> None:
    """Until built is set: SIGTERM to this process once its parent has gone (it is then another process's child)."""
    while not built.wait(every_s):
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _build_stoppably(config: EngineConfig, build) -> Any:
    """build(config), or None if SIGTERM or the parent's end stopped it (what it had built is released)."""
    engine, built = None, threading.Event()
    signal.signal(signal.SIGTERM, _stop_building)
    threading.Thread(target=_watch_parent, args=(os.getppid(), built), name="picovllm-parent-watch",
                     daemon=True).start()
    try:
        try:
            engine = (build or Engine)(config)
        finally:
            built.set()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except StopBuilding:
        logger.info("stopped while the engine was being built")
        if engine is not None:
            engine.shutdown()
        return None
    return engine


def _child_main(config: EngineConfig, build, loop_cls: type, commands, results, log_level: str) -> None:
    """commands and results: the parent's pipes, or lists of pipes (the parent's first, then each API server's,
    which hear the engine's EngineReady or EngineFailed too: they start while it is built)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    everyone = results if isinstance(results, list) else [results]

    def tell(msg: EngineReady | EngineFailed) -> None:
        for conn in everyone:
            try:
                conn.send(msg)
            except OSError:     # an API server that has gone already: its pipe reads EOF in the loop
                pass

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = _build_stoppably(config, build)
        if engine is None:      # the parent is stopping or gone: nothing to tell
            return
    except ValueError as e:     # a configuration the engine refuses: the parent reports it as the thread would
        tell(EngineFailed("ValueError", str(e)))
        return
    except SystemExit as e:     # build's own message for the command line
        tell(EngineFailed("SystemExit", str(e.code)))
        return
    except Exception as e:      # noqa: BLE001 - the parent reports it and exits
        logger.exception("the engine could not be built")
        tell(EngineFailed("RuntimeError", f"the engine could not be built: {type(e).__name__}: {e}"))
        return
    loop = loop_cls(engine, commands, results)
    freeze_for_serving()        # this process lives as long as the server
    tell(EngineReady(loop.model_info(), loop.role_info(), loop.eos_token_ids()))
    try:
        loop._run()
    finally:
        loop.release()
        engine.shutdown()


def open_async_engine(config: EngineConfig, settings, metrics=None, build: Callable[[EngineConfig], Any] | None = None,
                      loop_cls: type[AsyncEngine] = AsyncEngine, child_loop_cls: type = ChildLoop,
                      client_cls: type[ProcessAsyncEngine] = ProcessAsyncEngine,
                      tokenizer=None) -> tuple[EngineClient, Any, Callable]:
    """A server's engine, its loop in a thread (loop_cls over build(config)) or, with settings.engine_process, in a
    process of its own (client_cls in this process, child_loop_cls in the child); and the tokenizer for the HTTP
    side, and what stops the engine if the server does not start. build: Engine by default. tokenizer: the HTTP
    side's if the caller has loaded it already (with the engine in a process of its own, else it is loaded here)."""
    if not settings.engine_process:
        engine = (build or Engine)(config)
        async_engine = loop_cls(engine, metrics)

        def stop() -> None:
            async_engine.release()
            engine.shutdown()
        return async_engine, engine.tokenizer, stop
    with sigterm_interrupts():
        async_engine = client_cls(config, metrics, settings.log_level, build=build, loop_cls=child_loop_cls)
        try:
            if tokenizer is None:
                tokenizer = load_tokenizer(config)      # while the child builds the engine
            async_engine.wait_ready()
        except BaseException:   # a ValueError reaches the command line as the thread's Engine() would raise it
            async_engine.stop()
            raise
    return async_engine, tokenizer, async_engine.stop


@contextlib.contextmanager
def sigterm_interrupts():
    """While it lasts, SIGTERM is Ctrl-C (KeyboardInterrupt) in the main thread: a server stopped while its engine's
    process builds the engine unwinds and stops that process (ProcessAsyncEngine.stop), where the default action
    would end the server at once and leave the child building. Elsewhere than the main thread: nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(*_) -> None:
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
