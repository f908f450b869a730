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

The child ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; the parent shuts the child down) and
ends when the parent's pipe closes, so it never outlives the server.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing as mp
import signal
import threading
from collections.abc import Callable
from typing import Any

from picovllm.config import EngineConfig
from picovllm.disagg.messages import common_prefix
from picovllm.engine.llm_engine import Engine, tokenizer_of
from picovllm.entrypoints.openai.async_engine import AsyncEngine
from picovllm.entrypoints.openai.engine_client import Command, EngineClient, Shutdown, freeze_for_serving
from picovllm.loader import open_model_source
from picovllm.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)


def load_tokenizer(config: EngineConfig):
    """The tokenizer the engine loads for itself (None without one), for the HTTP side."""
    return tokenizer_of(open_model_source(config.model, config.disk_cache), config)


class OutputDeltas:
    """The child's end: each RequestOutput of the engine (one completion each: the engine runs one sample per
    request) as what changed since the one sent before for its request; a request's first output, and any that does
    not extend the last (fewer tokens, other prompt logprobs), goes whole. The metrics go with the last output only
    (the server reads them then)."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, str, int]] = {}   # request id -> (tokens, text, prompt logprobs) sent

    def encode(self, out: RequestOutput) -> tuple:
        rid = out.request_id
        prev = self._sent.pop(rid, None)
        c = out.outputs[0] if len(out.outputs) == 1 else None
        if not out.finished and c is not None:
            self._sent[rid] = (len(c.token_ids), c.text, len(out.prompt_logprobs or ()))
        if prev is None or c is None or len(c.token_ids) < prev[0] or len(out.prompt_logprobs or ()) != prev[2]:
            return ("whole", out)
        t, text, _ = prev
        k = common_prefix(text, c.text)    # the text so far, unless a stop string trimmed its end
        return ("delta", rid, c.token_ids[t:], k, c.text[k:], None if c.logprobs is None else c.logprobs[t:],
                c.cumulative_logprob, c.finish_reason, c.stop_reason, out.finished, out.error, out.num_cached_tokens,
                out.metrics if out.finished else None, out.kv_handover)


class OutputsFromDeltas:
    """The parent's end: each OutputDeltas message back into a whole, cumulative RequestOutput (its lists new, so
    an output a stream still holds never changes)."""

    def __init__(self) -> None:
        self._last: dict[str, RequestOutput] = {}

    def decode(self, msg: tuple) -> RequestOutput:
        if msg[0] == "whole":
            out = msg[1]
            self._last.pop(out.request_id, None)
        else:
            (_, rid, tokens, k, text, logprobs, cumulative, finish_reason, stop_reason, finished, error, cached,
             metrics, kv_handover) = msg
            last = self._last.pop(rid)
            c = last.outputs[0]
            comp = CompletionOutput(c.index, c.text[:k] + text, c.token_ids + tokens, cumulative,
                                    None if logprobs is None else (c.logprobs or []) + logprobs, finish_reason,
                                    stop_reason)
            out = RequestOutput(rid, last.prompt, last.prompt_token_ids, [comp], finished, metrics or last.metrics,
                                error, cached, last.prompt_logprobs, kv_handover)
        if not out.finished:
            self._last[out.request_id] = out
        return out


class _PipeCommands:
    """EngineClient's command sink over a pipe (the event loop is its one sender)."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def put(self, cmd: Command) -> None:
        try:
            self.conn.send(cmd)
        except (OSError, ValueError):     # the child is gone: the reader thread fails the streams
            pass


class ProcessAsyncEngine(EngineClient):
    """Spawns the engine's process at once; wait_ready() blocks until the engine is built (or raises why not).

    build(config) makes the Engine in the child (a P or D server's also links it to its peer); loop_cls runs it
    there: an AsyncEngine subclass with PipeEnds first among its bases. Both are pickled by reference (module-level
    functions and classes, or a functools.partial of one)."""

    def __init__(self, config: EngineConfig, metrics=None, log_level: str = "info",
                 build: Callable[[EngineConfig], Any] | None = None, loop_cls: type | None = None) -> None:
        ctx = mp.get_context("spawn")
        cmd_read, cmd_write = ctx.Pipe(duplex=False)
        out_read, out_write = ctx.Pipe(duplex=False)
        super().__init__(_PipeCommands(cmd_write), metrics)
        # not a daemon: the engine may start processes of its own (tensor-parallel ranks)
        self._proc = ctx.Process(target=_child_main, name="picovllm-engine",
                                 args=(config, build, loop_cls or ChildLoop, cmd_read, out_write, log_level))
        self._proc.start()
        cmd_read.close()
        out_write.close()
        self._out = out_read
        self._outputs = OutputsFromDeltas()     # the reader thread's
        self._info: dict[str, Any] | None = None      # the child's model_info and role_info, once ready
        self._reader: threading.Thread | None = None
        # Ours runs before multiprocessing's own exit handler, which waits for the child: on a way out that skipped
        # shutdown() (a second Ctrl-C), the closed pipe is what tells the child to end.
        atexit.register(cmd_write.close)

    def wait_ready(self) -> None:
        """Block until the child has built its engine. If it could not: ValueError (a bad configuration, as Engine()
        raises it), SystemExit (what build exits with) or RuntimeError, with the child's reason."""
        try:
            kind, body = self._out.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            kind, body = "failed", ("RuntimeError", f"the engine process exited with code {self._proc.exitcode}")
        if kind != "ready":
            self._proc.join(10)
            error, why = body
            raise {"ValueError": ValueError, "SystemExit": SystemExit}.get(error, RuntimeError)(why)
        self._info = body

    def model_info(self) -> dict:
        return dict((self._info or {}).get("model", {}))

    def role_info(self) -> dict:
        return dict((self._info or {}).get("role", {}))

    def eos_token_ids(self) -> list[int] | None:
        return list((self._info or {}).get("eos", []))

    # -- lifecycle (event loop side) -------------------------------------------------------------
    def start(self) -> None:
        if self._info is None:
            self.wait_ready()
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read, name="picovllm-engine-reader", daemon=True)
        self._reader.start()

    @property
    def is_running(self) -> bool:
        return self._reader is not None and self._reader.is_alive() and self._proc.is_alive()

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
        """From outside an event loop (start-up failed): stop the child."""
        self._commands.put(Shutdown())
        self.join()

    # -- the reader thread -----------------------------------------------------------------------
    def _read(self) -> None:
        why = "the engine process has ended"
        try:
            while True:
                kind, *body = self._out.recv()
                if kind == "end":
                    why = body[0]
                    break
                items, self.stats = body
                outputs = [self._outputs.decode(m) if m[0] != "answer" else m[1] for m in items]
                if self.metrics:
                    self.metrics.observe_engine(self.stats)
                self._finish_outputs(outputs)
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except (EOFError, OSError):
            why = "the engine process died"
            logger.error("the engine process died (exit code %s)", self._proc.exitcode)
        finally:
            self._loop.call_soon_threadsafe(self._fail_all_streams, why)


class PipeEnds:
    """The two ends of an AsyncEngine loop (its seams _receive, _deliver, _deliver_end) on the child's pipes:
    commands from the parent, each iteration's outputs and the stats (when they change) back. Mixed in first,
    before AsyncEngine or a subclass (a P or D server's)."""

    def __init__(self, engine, commands, results) -> None:
        super().__init__(engine)
        self._in, self._out = commands, results
        self._sent_stats = None
        self._deltas = OutputDeltas()

    def _receive(self, timeout_s: float | None) -> list[Command]:
        cmds: list[Command] = []
        try:
            if self._in.poll(timeout_s):            # None: until one comes
                cmds.append(self._in.recv())
                while self._in.poll(0):
                    cmds.append(self._in.recv())
        except (EOFError, OSError):                 # the parent is gone
            cmds.append(Shutdown())
        return cmds

    def _deliver(self, outputs: list) -> None:
        if outputs or self.stats != self._sent_stats:
            items = [self._deltas.encode(o) if isinstance(o, RequestOutput) else ("answer", o) for o in outputs]
            self._out.send(("step", items, self.stats))
            self._sent_stats = self.stats

    def _deliver_end(self, why: str) -> None:
        try:
            self._out.send(("end", why))
        except OSError:
            pass


class ChildLoop(PipeEnds, AsyncEngine):
    """A colocated server's loop in its engine process."""


def _child_main(config: EngineConfig, build, loop_cls: type, commands, results, log_level: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = (build or Engine)(config)
    except ValueError as e:     # a configuration the engine refuses: the parent reports it as the thread would
        results.send(("failed", ("ValueError", str(e))))
        return
    except SystemExit as e:     # build's own message for the command line
        results.send(("failed", ("SystemExit", str(e.code))))
        return
    except Exception as e:      # noqa: BLE001 - the parent reports it and exits
        logger.exception("the engine could not be built")
        results.send(("failed", ("RuntimeError", f"the engine could not be built: {type(e).__name__}: {e}")))
        return
    loop = loop_cls(engine, commands, results)
    freeze_for_serving()        # this process lives as long as the server
    results.send(("ready", {"model": loop.model_info(), "role": loop.role_info(), "eos": loop.eos_token_ids()}))
    try:
        loop._run()
    finally:
        loop.release()
        engine.shutdown()


def open_async_engine(config: EngineConfig, settings, metrics=None, build: Callable[[EngineConfig], Any] | None = None,
                      loop_cls: type[AsyncEngine] = AsyncEngine, child_loop_cls: type = ChildLoop,
                      client_cls: type[ProcessAsyncEngine] = ProcessAsyncEngine) -> tuple[EngineClient, Any, Callable]:
    """A server's engine, its loop in a thread (loop_cls over build(config)) or, with settings.engine_process, in a
    process of its own (client_cls in this process, child_loop_cls in the child); and the tokenizer for the HTTP
    side, and what stops the engine if the server does not start. build: Engine by default."""
    if not settings.engine_process:
        engine = (build or Engine)(config)
        async_engine = loop_cls(engine, metrics)

        def stop() -> None:
            async_engine.release()
            engine.shutdown()
        return async_engine, engine.tokenizer, stop
    async_engine = client_cls(config, metrics, settings.log_level, build=build, loop_cls=child_loop_cls)
    try:
        tokenizer = load_tokenizer(config)      # while the child builds the engine
        async_engine.wait_ready()
    except BaseException:       # a ValueError reaches the command line as the thread's Engine() would raise it
        async_engine.stop()
        raise
    return async_engine, tokenizer, async_engine.stop
