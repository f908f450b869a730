"""ProcessAsyncEngine: the server's engine loop in a process of its own (`picovllm serve --engine-process`).

In AsyncEngine the loop thread and the HTTP event loop share one interpreter and its GIL, so under load each waits
for the other (BENCHMARKS.md, thirteenth session: at 80 requests/s on an H200 a request took 4.6 ms at the median and
14 ms at p99 from the client's send to its handler). Here a child process (spawned: CUDA starts there only) builds
the Engine and runs AsyncEngine's own loop, its two ends on pipes: the parent's commands in, each iteration's
outputs and the engine's stats out. The parent keeps EngineClient's streams and one thread that reads the pipe and
hands the outputs to the event loop, as the loop thread did. The parent loads the tokenizer for itself (the HTTP
side encodes and renders chats).

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
from typing import Any

from picovllm.config import EngineConfig
from picovllm.entrypoints.openai.async_engine import AsyncEngine, Command, EngineClient, Shutdown

logger = logging.getLogger(__name__)


def load_tokenizer(config: EngineConfig):
    """The tokenizer the engine would load for itself (None without one), for the HTTP side."""
    from picovllm.loader import open_model_source
    if config.skip_tokenizer_init:
        return None
    source = open_model_source(config.model, config.disk_cache)
    return source.load_tokenizer() if source.load_tokenizer is not None else None


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
    """Spawns the engine's process at once; wait_ready() blocks until the engine is built (or raises why not)."""

    def __init__(self, config: EngineConfig, metrics=None, log_level: str = "info") -> None:
        ctx = mp.get_context("spawn")
        cmd_read, cmd_write = ctx.Pipe(duplex=False)
        out_read, out_write = ctx.Pipe(duplex=False)
        super().__init__(_PipeCommands(cmd_write), metrics)
        # not a daemon: the engine may start processes of its own (tensor-parallel ranks)
        self._proc = ctx.Process(target=_child_main, args=(config, cmd_read, out_write, log_level),
                                 name="picovllm-engine")
        self._proc.start()
        cmd_read.close()
        out_write.close()
        self._out = out_read
        self._model_info: dict[str, Any] | None = None
        self._reader: threading.Thread | None = None
        # Ours runs before multiprocessing's own exit handler, which waits for the child: on a way out that skipped
        # shutdown() (a second Ctrl-C), the closed pipe is what tells the child to end.
        atexit.register(cmd_write.close)

    def wait_ready(self) -> None:
        """Block until the child has built its engine. RuntimeError with the child's reason if it could not."""
        try:
            kind, body = self._out.recv()
        except (EOFError, OSError):
            kind, body = "failed", f"the engine process exited with code {self._proc.join(5) or self._proc.exitcode}"
        if kind != "ready":
            self._proc.join(10)
            raise RuntimeError(body)
        self._model_info = body

    def model_info(self) -> dict:
        return dict(self._model_info or {})

    # -- lifecycle (event loop side) -------------------------------------------------------------
    def start(self) -> None:
        if self._model_info is None:
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
                outputs, self.stats = body
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


class _ChildLoop(AsyncEngine):
    """AsyncEngine's loop in the child's main thread: commands from the parent's pipe, each iteration's outputs and
    the stats (when they change) back over the other."""

    def __init__(self, engine, commands, results) -> None:
        super().__init__(engine)
        self._in, self._out = commands, results
        self._sent_stats = None

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
            self._out.send(("step", outputs, self.stats))
            self._sent_stats = self.stats

    def _deliver_end(self, why: str) -> None:
        try:
            self._out.send(("end", why))
        except OSError:
            pass


def _child_main(config: EngineConfig, commands, results, log_level: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from picovllm.engine.llm_engine import Engine, freeze_for_serving
    try:
        engine = Engine(config)
    except Exception as e:      # noqa: BLE001 - the parent reports it and exits
        logger.exception("the engine could not be built")
        results.send(("failed", f"the engine could not be built: {type(e).__name__}: {e}"))
        return
    loop = _ChildLoop(engine, commands, results)
    freeze_for_serving()        # this process lives as long as the server
    results.send(("ready", loop.model_info()))
    try:
        loop._run()
    finally:
        engine.shutdown()
