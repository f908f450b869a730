"""`picovllm serve --api-server-count N`: N HTTP server processes in front of one engine process.

One front-end process parses every request and writes every streamed token; on the H200's host that is ~2.1-2.5 ms
of CPU a request and ~0.05 ms a token (BENCHMARKS.md, nineteenth session), so at ~150 requests/s of 64 tokens it
is nearly a full core and bursts queue in it, whatever the GPU could do. With N > 1 the parent process only
supervises: it binds the port, starts the engine process (engine_process.ProcessAsyncEngine, with a pair of pipes
per API server) and N API server processes, each a whole OpenAI app (tokenizer, routes, metrics) over its own
pipes, all accepting on the one listening socket, as vLLM's --api-server-count.

Metrics: each process counts its own requests (prometheus_client's multiprocess mode, files in a directory the
parent makes and removes); /metrics in any of them adds them up; API server 1 alone publishes the engine's stats.

Lifetime: SIGINT or SIGTERM to the parent (or Ctrl-C to the group) drains every API server as a single server
drains (--shutdown-timeout), then the engine stops. If any process dies, the parent stops the rest and exits 1:
a half-alive server would keep taking requests that some of its processes cannot serve.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading

from picovllm.config import EngineConfig
from picovllm.entrypoints.openai.api_server import BACKSTOP_SECONDS, ServerSettings, base_url

logger = logging.getLogger("picovllm.server")


def bind(host: str, port: int) -> socket.socket:
    """A server's listening socket (every API server's, as uvicorn binds its own), bound before the model loads: a
    port in use or a host that does not resolve is an error naming the flags at once, not after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"error: --host {host} --port {port}: cannot listen there: {e.strerror}") from None
    sock.listen(2048)
    return sock


def serve_with_api_servers(config: EngineConfig, settings: ServerSettings, name: str, defaults: dict) -> int:
    """Serve with settings.api_server_count API server processes until SIGINT/SIGTERM; the exit code (1: a process
    died). defaults: the requests' sampling defaults (api_server.generation_defaults)."""
    from picovllm.entrypoints.openai.engine_process import ProcessAsyncEngine   # the engine's side: torch

    n = settings.api_server_count
    sock = bind(settings.host, settings.port)
    metrics_dir = tempfile.mkdtemp(prefix="picovllm-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir      # before the spawns: each process reads it at import
    stop = threading.Event()

    def interrupt(*_) -> None:      # until the engine is ready: what Ctrl-C does anyway, and the cleanup below runs
        raise KeyboardInterrupt

    handlers = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    engine = ProcessAsyncEngine(config, None, settings.log_level, api_servers=n)
    workers: list = []
    code = 0
    try:
        ctx = mp.get_context("spawn")
        for k, (commands, outputs) in enumerate(engine.api_ends, 1):     # they start while the engine is built
            w = ctx.Process(target=_api_server_main, name=f"picovllm-api-{k}",
                            args=(config, settings, name, defaults, sock, commands, outputs, k))
            w.start()
            commands.close()
            outputs.close()
            workers.append(w)
        engine.wait_ready()         # or raises why not, as a single server does
        for sig in handlers:        # serving: a signal drains the API servers, then the engine stops
            signal.signal(sig, lambda *_: stop.set())
        logger.info("serving %s on %s with %d API servers", name, base_url(settings), n)
        while not stop.wait(0.5):
            dead = [w.name for w in workers if not w.is_alive()] + ([] if engine.alive else ["the engine"])
            if dead:
                logger.error("%s exited: stopping the server", ", ".join(dead))
                code = 1
                break
    finally:
        for w in workers:           # each drains as one server does on SIGTERM
            if w.is_alive():
                os.kill(w.pid, signal.SIGTERM)
        for w in workers:
            w.join(settings.shutdown_timeout + BACKSTOP_SECONDS + 10)
            if w.is_alive():
                logger.warning("%s did not stop: killing it", w.name)
                w.kill()
                w.join()
        engine.stop()
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        for s, h in handlers.items():
            signal.signal(s, h)
    return code


def _api_server_main(config: EngineConfig, settings: ServerSettings, name: str, defaults: dict,
                     sock: socket.socket, commands, outputs, index: int) -> None:
    """One API server process: the OpenAI app over its pipes to the engine, on the shared socket. Its tokenizer loads
    while the engine is built; it serves once the engine says it is ready (and exits if it could not be built).
    Until it serves it ignores SIGINT (a terminal's Ctrl-C reaches the whole group; the parent sends SIGTERM)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from picovllm.entrypoints.openai.api_server import build_app, make_server
    from picovllm.entrypoints.openai.engine_process import PipeEngineClient, engine_ready, load_tokenizer
    from picovllm.entrypoints.openai.metrics import ServerMetrics

    tokenizer = load_tokenizer(config)
    try:
        info = engine_ready(outputs)
    except BaseException:       # the parent reports why
        return
    metrics = ServerMetrics(name, speculative=config.speculative_config is not None)
    client = PipeEngineClient(commands, outputs, metrics, info, observe_engine=index == 1)
    try:
        ctx = settings.serving_context(client, tokenizer, metrics, name, defaults)
    except ValueError as e:     # as a single server says it (once the engine is built); the parent stops the rest
        raise SystemExit(f"error: {e}") from None
    server = make_server(build_app(ctx, settings), client, settings)
    client.on_end = lambda: setattr(server, "should_exit", True)   # the engine has gone: stop (the parent stops all)
    server.run([sock])
