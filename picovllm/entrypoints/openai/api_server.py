"""The HTTP layer: a FastAPI app over an engine client (async_engine.py), run under uvicorn with a graceful exit.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /tokenize, POST /detokenize, GET /v1/models,
GET /health, GET /metrics; a pooling model's POST /v1/embeddings (serving_embeddings.py).
Everything the client does wrong comes back as OpenAI's error object with a 4xx status.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from picovllm.config import EngineConfig
from picovllm.entrypoints.openai.engine_client import EngineClient
from picovllm.entrypoints.openai.metrics import ServerMetrics
from picovllm.entrypoints.openai.middleware import APIKeyAuth, BodySizeLimit, route_path
from picovllm.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  TokenizeRequest, error_body)
from picovllm.entrypoints.openai.request_log import RequestLogger
from picovllm.entrypoints.openai.serving import JSONBody, ServingContext
from picovllm.entrypoints.openai.serving_chat import ChatHandler
from picovllm.entrypoints.openai.serving_completion import CompletionHandler
from picovllm.entrypoints.openai.serving_embeddings import EmbeddingHandler, EmbeddingRequest
from picovllm.entrypoints.openai.serving_responses import ResponsesHandler, ResponsesRequest
from picovllm.entrypoints.openai.serving_tokenize import detokenize, tokenize
from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
from picovllm.gc_freeze import freeze_for_serving
from picovllm.generation_config import describe, sampling_defaults
from picovllm.loader.default_model import DEFAULT_FILE
from picovllm.reasoning import reasoning_gate

logger = logging.getLogger("picovllm.server")
# the routes whose 4xx count as rejected requests (picovllm:requests_total{outcome="rejected"})
REQUEST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings")
BACKSTOP_SECONDS = 5.0    # after the grace period and our abort, uvicorn cancels whatever still hangs


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | tuple[str, ...] | None = None     # one key, or several (vLLM's --api-key): any one of them passes
    served_model_name: str | None = None
    served_model_aliases: tuple[str, ...] = ()       # more ids clients may send (vLLM's --served-model-name takes
                                                     # several; replies and /metrics name the first)
    max_request_bytes: int = 4 * 2**20
    shutdown_timeout: float = 10.0      # seconds in-flight requests get to finish after SIGTERM/SIGINT
    log_level: str = "info"
    access_log: bool = False
    chat_template: str | None = None    # the template's text (tokenizer_worker.load_chat_template), or the model's
    trust_request_chat_template: bool = False   # a request's chat_template may replace it
    # split <think> ... </think> from the answer (reasoning.py): qwen3, deepseek_r1, glm45
    reasoning_parser: str | None = None
    tool_call_parser: str = "auto"      # tool calls' format under tool_choice auto (tool_calls.py): auto, hermes, ...
    engine_process: bool = True         # the engine loop in a process of its own (engine_process.py), not a thread
    api_server_count: int = 1           # HTTP processes in front of the one engine process (api_workers.py)
    # CORS (vLLM's --allowed-origins ...): browsers may call the API from these origins; none by default (vLLM
    # allows every origin): a page on any site could otherwise drive a server on the user's own machine
    allowed_origins: tuple[str, ...] = ()
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    root_path: str | None = None        # the path prefix a proxy serves the app under (vLLM's --root-path)
    # HTTPS, as vLLM's --ssl-* flags (uvicorn's): a certificate file (and its key, unless the file holds it)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None     # the CAs a client certificate must chain to
    ssl_cert_reqs: int = 0              # ssl.CERT_NONE (0), CERT_OPTIONAL (1) or CERT_REQUIRED (2): client certificates
    # chat: how a message's text parts reach the template ("auto", "string" or "openai") and the template variables
    # a request's chat_template_kwargs add to (vLLM's --chat-template-content-format, --default-chat-template-kwargs)
    chat_template_content_format: str = "auto"
    default_chat_template_kwargs: dict | None = None
    enable_log_requests: bool = False   # a log line for each request (its prompt ids and sampling parameters)
    max_log_len: int | None = None      # the most prompt ids such a line shows (None: all)

    def serving_context(self, engine: EngineClient, tokenizer, metrics: ServerMetrics, name: str,
                        defaults: dict) -> ServingContext:
        """The app's serving context over engine: the tokenizer's worker with these chat settings, the model's ids,
        the request log. ValueError where the tokenizer cannot serve them (TokenizerWorker's)."""
        worker = TokenizerWorker(tokenizer, self.chat_template, self.trust_request_chat_template,
                                 self.chat_template_content_format, self.default_chat_template_kwargs)
        request_log = RequestLogger(self.max_log_len) if self.enable_log_requests else None
        return ServingContext(engine, worker, metrics, name, defaults, self.reasoning_parser, self.tool_call_parser,
                              model_aliases=self.served_model_aliases, request_logger=request_log)


def build_app(ctx: ServingContext, settings: ServerSettings, openai_routes: bool = True) -> FastAPI:
    """openai_routes=False: no generation routes (a prefill or decode server, reached through the proxy)."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.engine.start()
        yield
        await ctx.engine.shutdown()        # aborts whatever uvicorn's graceful period left running
        ctx.tokenizer.shutdown()

    app = FastAPI(title="picovllm", version="0.1.0", lifespan=lifespan)
    app.root_path = settings.root_path or ""    # as vLLM sets it (not uvicorn's): routes answer with it and without
    completions, chat = CompletionHandler(ctx), ChatHandler(ctx)
    responses = ResponsesHandler(ctx, chat)
    embeddings = EmbeddingHandler(ctx)
    started, version_body = int(time.time()), {"version": package_version()}

    if openai_routes:
        @app.post("/v1/completions")
        async def create_completion(body: CompletionRequest, raw: Request) -> Response:
            return await completions(body, raw)

        @app.post("/v1/chat/completions")
        async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
            return await chat(body, raw)

        @app.post("/v1/responses")
        async def create_response(body: ResponsesRequest, raw: Request) -> Response:
            return await responses(body, raw)

        @app.post("/v1/embeddings")
        async def create_embedding(body: EmbeddingRequest, raw: Request) -> Response:
            return await embeddings(body, raw)

        @app.post("/tokenize")
        async def tokenize_route(body: TokenizeRequest) -> Response:
            return JSONBody(await tokenize(ctx, body))

        @app.post("/detokenize")
        async def detokenize_route(body: DetokenizeRequest) -> Response:
            return JSONBody(await detokenize(ctx, body))

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": started, "owned_by": "picovllm", **ctx.engine.model_info()}
            for name in (ctx.model_name, *ctx.model_aliases)]}

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])     # vLLM's (SageMaker's probe): the same answer
    async def health() -> Response:
        if not ctx.engine.is_running:
            why = getattr(ctx.engine, "ended_why", None) or "the engine loop is not running"   # a proxy has none
            return JSONBody(error_body(why, "service_unavailable"), 503)
        unavailable = getattr(ctx.engine, "unavailable", None)     # a proxy's or router's servers' state
        if unavailable is not None:
            return JSONBody(error_body(unavailable, "service_unavailable"), 503)
        return JSONBody({"status": "ok"})

    @app.get("/version")
    async def version() -> Response:
        return JSONBody(version_body)

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = ctx.metrics.render()
        return Response(data, media_type=content_type)

    refused = functools.partial(count_refusal, ctx)
    _add_error_handlers(app, refused)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes, refused=refused)
    if settings.api_key:
        app.add_middleware(APIKeyAuth, api_key=settings.api_key, refused=refused)   # checked before the body is read
    if settings.allowed_origins:        # outermost: a browser's preflight (no API key) is answered here
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_credentials=settings.allow_credentials, allow_methods=list(settings.allowed_methods),
                           allow_headers=list(settings.allowed_headers))
    return app


def count_refusal(ctx: ServingContext, scope: dict, status: int) -> None:
    """A 4xx of a request route is a rejected request, whoever answered it (a handler, or a middleware before the
    app: a body over the limit, a missing API key)."""
    if 400 <= status < 500 and route_path(scope) in REQUEST_ROUTES:
        ctx.metrics.count_outcome("rejected")


def _add_error_handlers(app: FastAPI, refused: Callable[[dict, int], None]) -> None:
    def reject(request: Request, status: int, body: dict) -> JSONBody:
        refused(request.scope, status)
        return JSONBody(body, status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONBody:
        return reject(request, e.status, e.body())

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONBody:
        errors = e.errors()
        if errors and errors[0].get("type") == "json_invalid":
            why, at = (errors[0].get("ctx") or {}).get("error", ""), errors[0]["loc"][-1]
            return reject(request, 400, error_body(f"the body is not valid JSON: {why} at character {at}"))
        if errors and tuple(errors[0].get("loc", ())) == ("body",):    # not a field's: the body's own
            why = "is empty" if errors[0].get("type") == "missing" else "is not a JSON object"
            return reject(request, 400, error_body(f"the body {why}: send a JSON object (Content-Type: "
                                                   f"application/json)"))
        parts = []
        for err in errors[:3]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {err.get('msg', 'invalid')}" if loc else str(err.get("msg", "invalid")))
        first = errors[0].get("loc", ()) if errors else ()
        param = next((str(x) for x in first if x != "body"), None)
        return reject(request, 400, error_body("; ".join(parts) or "invalid request body", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONBody:
        return reject(request, e.status_code, error_body(_http_detail(e), "invalid_request_error" if e.status_code < 500
                                                else "internal_error"))

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONBody:
        logger.exception("unhandled error")
        # uvicorn drops the connection after an error the app re-raises (Starlette's ServerErrorMiddleware does): a
        # client must not send its next request on it
        return JSONBody(error_body(f"internal error: {type(e).__name__}", "internal_error"), 500,
                        headers={"Connection": "close"})


def _http_detail(e: StarletteHTTPException) -> str:
    """e's message; for FastAPI's 400 on a body that json.loads failed on other than by its syntax, the cause."""
    cause = e.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not valid JSON: not UTF-8 text ({cause.reason} at byte {cause.start})"
    if isinstance(cause, RecursionError):
        return "the body is not valid JSON that this server reads: it is nested too deeply"
    return str(e.detail)


class _Server(uvicorn.Server):
    """uvicorn with our shutdown: on SIGTERM/SIGINT it stops accepting and waits for open requests; after
    grace seconds we abort what is left in the engine, so those streams still end cleanly (finish_reason
    "abort", then [DONE]). A second signal aborts them at once (uvicorn's would cancel the server's tasks: their
    streams cut without an end, tracebacks); a third SIGINT is uvicorn's forced exit. uvicorn's own timeout stays as a
    backstop. And exit 0: uvicorn would re-raise the caught signal after shutting down, killing the process
    with it."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, grace: float) -> None:
        super().__init__(config)
        self.engine, self.grace = engine, grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aborted = False

    def run(self, sockets=None) -> None:
        freeze_for_serving()      # everything built so far lives as long as the process
        super().run(sockets)

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and not self._aborted and self._loop is not None:
            self._aborted = True
            logger.warning("shutdown: a second signal: aborting the requests still running now")
            self._loop.call_soon_threadsafe(self.engine.abort_all)     # a signal handler: not inside the loop
            return
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        async def abort_when_grace_ends() -> None:
            await asyncio.sleep(self.grace)
            logger.warning("shutdown: aborting the requests still running after %.1f s", self.grace)
            self.engine.abort_all()

        aborter = asyncio.create_task(abort_when_grace_ends())
        try:
            await super().shutdown(sockets)
        finally:
            aborter.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


def default_model_name(model: str | None) -> str:
    return model if model is not None else DEFAULT_FILE.split(".")[0]


def package_version() -> str:
    """picovllm's installed version (GET /version, as vLLM's), or the source tree's when it is not installed."""
    import importlib.metadata
    try:
        return importlib.metadata.version("picovllm")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0+source"


def cors_settings(args) -> dict:
    """ServerSettings' CORS fields from the flags of cli_proxy.add_cors_args."""
    return dict(allowed_origins=tuple(args.allowed_origins), allow_credentials=args.allow_credentials,
                allowed_methods=tuple(args.allowed_methods), allowed_headers=tuple(args.allowed_headers))


def generation_defaults(model: str | None, mode: str, override, revision: str | None = None,
                        download_dir: str | None = None) -> dict:
    """The sampling defaults of requests that leave fields unset (picovllm/generation_config.py), logged as vLLM
    logs them; a bad generation config stops the server naming it."""
    try:
        defaults = sampling_defaults(model, mode, override, revision, download_dir)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if defaults:
        logger.info(describe(defaults))
    return defaults


def front_end_app(engine: EngineClient, tokenizer, args, name: str, metrics: ServerMetrics,
                  template: str | None, model: str, revision: str | None = None,
                  download_dir: str | None = None) -> tuple[FastAPI, ServerSettings]:
    """The OpenAI app of a front end over other servers' engines (the proxy's, the router's), from the flags of
    cli_proxy.add_front_end_args; run it with run_app. model (a Hub repository's at revision, in download_dir):
    where the tokenizer and generation config come from."""
    defaults = generation_defaults(model, args.generation_config, args.override_generation_config, revision,
                                   download_dir)
    try:
        worker = TokenizerWorker(tokenizer, template, args.trust_request_chat_template)
        if args.reasoning_parser is not None:      # the engines behind it gate grammars on these tokens
            reasoning_gate(tokenizer, args.reasoning_parser, f"--reasoning-parser {args.reasoning_parser}")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    settings = ServerSettings(host=args.host, port=args.port, api_key=args.api_key, served_model_name=name,
                              max_request_bytes=args.max_request_bytes, shutdown_timeout=args.shutdown_timeout,
                              log_level=args.log_level, reasoning_parser=args.reasoning_parser,
                              tool_call_parser=args.tool_call_parser, **cors_settings(args))
    ctx = ServingContext(engine, worker, metrics, name, defaults, settings.reasoning_parser, settings.tool_call_parser)
    return build_app(ctx, settings), settings


def http_stack() -> tuple[str, str]:
    """uvicorn's HTTP parser and event loop: httptools and uvloop (C; the serve extra installs them) where they
    import, else h11 and asyncio (pure Python). The server process spent ~20% less CPU a request on them
    (BENCHMARKS.md, twentieth session): what a busy front-end can serve before it queues requests."""
    def have(name: str) -> bool:
        return importlib.util.find_spec(name) is not None
    return "httptools" if have("httptools") else "h11", "uvloop" if have("uvloop") else "asyncio"


def make_server(app: FastAPI, engine: EngineClient, settings: ServerSettings) -> _Server:
    """The uvicorn server of every server (serve's, a P or D server's, the proxy's and the router's, whose settings
    keep the access log off): run() serves until SIGTERM/SIGINT, then shuts down gracefully."""
    http, loop = http_stack()
    if (http, loop) != ("httptools", "uvloop"):
        logger.warning("serving HTTP with %s on %s (install uvloop and httptools for less CPU a request)", http, loop)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=settings.access_log, http=http, loop=loop,
                            timeout_graceful_shutdown=settings.shutdown_timeout + BACKSTOP_SECONDS,
                            ssl_keyfile=settings.ssl_keyfile, ssl_certfile=settings.ssl_certfile,
                            ssl_ca_certs=settings.ssl_ca_certs, ssl_cert_reqs=settings.ssl_cert_reqs)
    return _Server(config, engine, settings.shutdown_timeout)


def run_app(app: FastAPI, engine: EngineClient, settings: ServerSettings, sock=None) -> None:
    """Serve app, in front of engine, on settings' host and port (on sock if bound already: api_workers.bind)
    until SIGTERM/SIGINT (make_server)."""
    make_server(app, engine, settings).run(sockets=None if sock is None else [sock])


def base_url(settings: ServerSettings) -> str:
    """Where the server answers, for its log: https with a certificate, and under its root path."""
    scheme = "https" if settings.ssl_certfile else "http"
    return f"{scheme}://{settings.host}:{settings.port}{settings.root_path or ''}"


def served_name(settings: ServerSettings, model: str | None) -> str:
    """The model id clients send: --served-model-name, else the model's."""
    return settings.served_model_name or default_model_name(model)


def serve(engine_config: EngineConfig, settings: ServerSettings) -> int:
    """Load the model, then serve until SIGTERM/SIGINT; returns the exit code after a graceful shutdown (not 0:
    with several API servers, one of the processes died)."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        tokenizer = _reasoning_tokenizer(engine_config, settings)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if settings.api_server_count > 1:
        from picovllm.entrypoints.openai.api_workers import serve_with_api_servers
        return serve_with_api_servers(engine_config, settings, served_name(settings, engine_config.model),
                                      _generation_defaults(engine_config))
    from picovllm.entrypoints.openai.api_workers import bind
    sock = bind(settings.host, settings.port)
    try:
        app, async_engine, _ = app_for(engine_config, settings, tokenizer)
    except TokenizerSetupError as e:
        sock.close()
        raise SystemExit(f"error: {e}") from None
    except BaseException:
        sock.close()
        raise
    logger.info("serving %s on %s", served_name(settings, engine_config.model), base_url(settings))
    server = make_server(app, async_engine, settings)
    died = []
    if hasattr(async_engine, "on_end"):     # an engine process that dies ends the server, as vLLM's: exit 1, so that
        def ended() -> None:                # a supervisor restarts it (several API servers stop the same way)
            if not server.should_exit:      # (not the end a SIGTERM's shutdown brings)
                died.append(True)
                server.should_exit = True
        async_engine.on_end = ended
    server.run(sockets=[sock])
    return 1 if died else 0


class TokenizerSetupError(ValueError):
    """The HTTP side's tokenizer cannot serve the settings (e.g. --chat-template without a tokenizer)."""


def app_for(engine_config: EngineConfig, settings: ServerSettings, tokenizer=None) -> tuple[FastAPI, EngineClient,
                                                                                            Callable[[], None]]:
    """The OpenAI app over a new engine (`serve`'s, and run-batch's in-process one): the app, whose lifespan starts
    and shuts down the engine's loop; the engine's client; and what releases the engine after the app (or if the app
    never runs). tokenizer: the HTTP side's, if already loaded (_reasoning_tokenizer)."""
    if tokenizer is None:
        tokenizer = _reasoning_tokenizer(engine_config, settings)
    name, defaults = served_name(settings, engine_config.model), _generation_defaults(engine_config)
    metrics = ServerMetrics(name, speculative=engine_config.speculative_config is not None)
    from picovllm.entrypoints.openai.engine_process import open_async_engine   # the engine's side: torch
    async_engine, tokenizer, stop = open_async_engine(engine_config, settings, metrics, tokenizer=tokenizer)
    try:
        ctx = settings.serving_context(async_engine, tokenizer, metrics, name, defaults)
    except ValueError as e:
        stop()
        raise TokenizerSetupError(str(e)) from None
    return build_app(ctx, settings), async_engine, stop


def _generation_defaults(engine_config: EngineConfig) -> dict:
    return generation_defaults(engine_config.model, engine_config.generation_config,
                               engine_config.override_generation_config, engine_config.revision,
                               engine_config.download_dir)


def _reasoning_tokenizer(engine_config: EngineConfig, settings: ServerSettings):
    """With --reasoning-parser, the tokenizer, loaded before the engine to check that it has the tokens the parser's
    gates watch for (a ValueError naming the flag if not); None otherwise."""
    if settings.reasoning_parser is None:
        return None
    from picovllm.entrypoints.openai.engine_process import load_tokenizer
    tokenizer = load_tokenizer(engine_config)
    reasoning_gate(tokenizer, settings.reasoning_parser, f"--reasoning-parser {settings.reasoning_parser}")
    return tokenizer
