"""`picovllm run-batch`: a file in OpenAI's batch format (vLLM's `run-batch`), each request run by the server's own
handlers in this process, through no socket, so a line gets exactly the answer `picovllm serve` would give it.

Input, a JSON object a line: {"custom_id": str, unique in the file, "method": "POST", "url": one of URLS, "body": the
request}. Output, a line per input line, in input order (OpenAI's batch output):
    {"id": "batch_req_<hex>", "custom_id": ..., "response": {"status_code": int, "request_id": str,
     "body": the response, or its error object for a 4xx/5xx}, "error": null}
A line that is no request (not JSON or not UTF-8, a field missing or of the wrong type, a url or method not served, a
streamed body, a custom_id an earlier line has) gets "response": null and "error": {"code": ..., "message": ...}
naming the field; a line that fails in any other way gets such an error of its own, and the other lines run. Blank
lines are skipped; a line number counts them. The file is read as it runs, a window of lines at a time, and a line
is written as soon as it and all before it are done: memory does not grow with the file's requests (only its
custom_ids are kept, to refuse a repeated one). The input and output may be http(s) URLs (GET, PUT), as in vLLM's,
through a file in --output-tmp-dir. The command exits 0 if every request got a 200, else 1.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TextIO

from picovllm.entrypoints.vllm_args import ANY, SERVE_ARGS, VllmArg

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
# Lines read ahead of the oldest one not yet written, per request the engine may hold (--max-concurrency): what
# bounds the memory, while a long request at the head leaves room for those behind it to finish.
WINDOW_PER_SLOT = 4
# vLLM's run-batch flags that have no setting here: each means what picovllm does anyway (vllm_args.VllmArg)
VLLM_BATCH_ARGS: tuple[VllmArg, ...] = (
    *(a for a in SERVE_ARGS if a.name in ("response_role", "disable_log_requests")),
    VllmArg("enable_prompt_tokens_details", ANY, "a reply's usage always has prompt_tokens_details", type=None),
    VllmArg("enable_force_include_usage", ANY, "a batch's replies are never streamed, and carry their usage",
            type=None),
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    from picovllm.entrypoints.chat_template import CHAT_TEMPLATE_HELP
    from picovllm.entrypoints.engine_args import add_engine_args
    from picovllm.entrypoints.openai.cli_proxy import add_tool_args, model_name, port, positive
    from picovllm.entrypoints.openai.reasoning import HELP as REASONING_HELP, PARSERS as REASONING_PARSERS
    from picovllm.entrypoints.vllm_args import add_vllm_args

    p = subparsers.add_parser("run-batch", help="run a file of OpenAI batch requests (vLLM's run-batch)",
                              description="Run each line of an OpenAI batch file (custom_id, method, url, body) "
                                          f"through the server's handlers ({', '.join(URLS)}) and write OpenAI's "
                                          "batch output, a line per request, in input order.")
    p.add_argument("model_tag", nargs="?", default=None, help="model (same as --model)")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("-i", "--input-file", required=True,
                   help="the batch file (JSONL; - for stdin; an http(s) URL to GET it from)")
    p.add_argument("-o", "--output-file", required=True,
                   help="where the results go (JSONL; - for stdout; an http(s) URL to PUT them to)")
    p.add_argument("--output-tmp-dir", default=None, metavar="DIR",
                   help="the folder of the files an http(s) input is read from and an http(s) output is written to "
                        "before its PUT (default: the system's temporary folder)")
    p.add_argument("--served-model-name", nargs="+", type=model_name, default=None, metavar="NAME",
                   help="the model ids a body's \"model\" may name; replies name the first (default: --model's)")
    p.add_argument("--max-concurrency", type=int, default=256, help="requests in the engine at once (default 256)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a progress line on stderr every 5 seconds and at the end, as vLLM's (default: on)")
    p.add_argument("--enable-metrics", action="store_true",
                   help="serve Prometheus metrics (serve's /metrics) at http://URL:PORT/metrics while the batch runs")
    p.add_argument("--url", default="127.0.0.1",
                   help="the metrics' address, with --enable-metrics (default: localhost only; vLLM's is 0.0.0.0)")
    p.add_argument("--port", type=port, default=8000, help="the metrics' port, with --enable-metrics (default 8000)")
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="a log line for each request: its prompt token ids and sampling parameters (default: off)")
    p.add_argument("--max-log-len", type=positive, default=None,
                   help="the most prompt token ids such a line shows (default: all)")
    p.add_argument("--chat-template", default=None, help=CHAT_TEMPLATE_HELP)
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS, help=REASONING_HELP)
    add_tool_args(p)
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                   help="run the engine loop in a process of its own (default: a thread of this one)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_engine_args(p, skip=("reasoning_parser",))
    add_vllm_args(p, VLLM_BATCH_ARGS, "vLLM's run-batch flags picovllm has no setting for (a value other than those "
                                      "listed is refused)")
    p.set_defaults(func=main)
    return p


def parse_request(text: str, line: int, seen: dict[str, int] | None = None) -> tuple[dict, dict | None]:
    """(the line's object, None) if it is a request this command runs; ({custom_id if any}, error object) if not.
    seen: the custom_ids of the lines before, each with its line number; this line's is added to it."""
    from picovllm.entrypoints.batch_io import utf8_error

    why = utf8_error(text)
    if why is not None:
        return {}, _error("invalid_request", f"line {line}: {why}")
    try:
        rec = json.loads(text)
    except ValueError as e:
        return {}, _error("invalid_json", f"line {line}: not JSON: {e}")
    if not isinstance(rec, dict):
        return {}, _error("invalid_request", f"line {line}: must be a JSON object")
    custom_id = rec.get("custom_id")
    first = None if seen is None or not isinstance(custom_id, str) else seen.setdefault(custom_id, line)
    unknown = sorted(set(rec) - {"custom_id", "method", "url", "body"})
    why = None
    if unknown:
        why = f"unknown field {unknown[0]!r} (a line holds custom_id, method, url and body)"
    elif not isinstance(custom_id, str):
        why = "custom_id must be a string"
    elif first not in (None, line):
        return {"custom_id": custom_id}, _error(
            "duplicate_custom_id", f"line {line}: custom_id {custom_id!r} is line {first}'s too: a batch's "
                                   f"custom_ids must be unique (OpenAI's rule), each naming one output line")
    elif rec.get("method") != "POST":
        why = f"method must be \"POST\", got {rec.get('method')!r}"
    elif str(rec.get("url")).endswith(("/score", "/rerank")):      # vLLM's, for pooling models
        why = f"url {rec['url']!r}: picovllm serves no score or rerank endpoint (it runs {', '.join(URLS)})"
    elif rec.get("url") not in URLS:
        why = f"url must be one of {', '.join(URLS)}, got {rec.get('url')!r}"
    elif not isinstance(rec.get("body"), dict):
        why = "body must be a JSON object (the request)"
    elif rec["body"].get("stream"):
        why = "body.stream: a batch takes whole responses, not streams"
    return (rec, None) if why is None else ({"custom_id": custom_id}, _error("invalid_request", f"line {line}: {why}"))


def _error(code: str, message: str) -> dict:
    return {"code": code, "message": message}


def _record(custom_id, response: dict | None = None, error: dict | None = None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


@dataclass
class BatchCounts:
    lines: int = 0      # output lines written
    failed: int = 0     # of them, those with an error or a status other than 200

    def add(self, rec: dict) -> None:
        self.lines += 1
        self.failed += rec["error"] is not None or rec["response"]["status_code"] != 200


class Progress:
    """vLLM's progress line on stderr ("Running batch: done/total ..."), every `every` seconds and at the end; the
    total is known once the whole file is read."""

    def __init__(self, enabled: bool, every: float = 5.0) -> None:
        self.enabled, self.every, self.done, self.total = enabled, every, 0, None
        self.start = self.shown = time.monotonic()

    def completed(self) -> None:
        self.done += 1
        if time.monotonic() - self.shown >= self.every:
            self.show()

    def show(self) -> None:
        if self.enabled:
            self.shown, took = time.monotonic(), time.monotonic() - self.start
            print(f"Running batch: {self.done}/{'?' if self.total is None else self.total} requests done "
                  f"[{took:.1f}s, {self.done / max(took, 1e-9):.2f} req/s]", file=sys.stderr, flush=True)


async def run_requests(app, lines: Iterable[tuple[int, str]], concurrency: int,
                       write: Callable[[dict], None] = lambda rec: None, progress: Progress | None = None,
                       metrics_socket: socket.socket | None = None) -> BatchCounts:
    """Each (line number, text)'s output record goes to write, in order, as soon as it and all before it are done,
    so that a run cut short keeps what it answered. Every request is posted to app (the server's, its engine started
    by its own lifespan) through httpx's ASGI transport, at most `concurrency` at once; lines are read as room frees
    up, at most WINDOW_PER_SLOT * concurrency past the oldest one not yet written. metrics_socket: a bound socket
    that serves the app's GET /metrics meanwhile."""
    import httpx

    progress = progress or Progress(False)
    gate, window = asyncio.Semaphore(concurrency), asyncio.Semaphore(WINDOW_PER_SLOT * concurrency)
    in_order: asyncio.Queue[asyncio.Future | None] = asyncio.Queue()
    counts, seen = BatchCounts(), {}

    async def post(client: httpx.AsyncClient, line: int, rec: dict) -> dict:
        try:
            # The body as a client would send it to `serve` (json.dumps: NaN and Infinity as Python's JSON writes
            # them, a lone surrogate \u-escaped), so such a body gets serve's 400, not an encoder's error.
            async with gate:
                r = await client.post(rec["url"], content=json.dumps(rec["body"]),
                                      headers={"content-type": "application/json"})
            request_id = r.headers.get("x-request-id") or f"batch-{uuid.uuid4().hex}"
            return _record(rec["custom_id"], {"status_code": r.status_code, "request_id": request_id, "body": r.json()})
        except Exception as e:      # this line's failure, never the batch's (vLLM's run_request does the same)
            return _record(rec["custom_id"], error=_error("internal_error", f"line {line}: {type(e).__name__}: {e}"))

    def parsed(line: int, text: str) -> dict | None:
        """The line's request, or None once its error record is queued."""
        try:
            rec, error = parse_request(text, line, seen)
        except Exception as e:      # e.g. a line nested too deep for json.loads
            rec, error = {}, _error("internal_error", f"line {line}: {type(e).__name__}: {e}")
        if error is None:
            return rec
        done = asyncio.get_running_loop().create_future()
        done.set_result(_record(rec.get("custom_id"), error=error))
        in_order.put_nowait(done)
        return None

    async def write_in_order() -> None:
        while (task := await in_order.get()) is not None:
            rec = await task
            write(rec)
            counts.add(rec)
            window.release()
            progress.completed()

    # raise_app_exceptions=False: a handler's exception is that line's 500 (the server's error body), as serve
    # answers it, not an exception out of client.post
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
            metrics = None if metrics_socket is None else await asyncio.start_server(
                lambda r, w: _answer_metrics(client, r, w), sock=metrics_socket)
            writer = asyncio.ensure_future(write_in_order())
            try:
                read = 0
                for line, text in lines:
                    await _room(window, writer)
                    read += 1
                    rec = parsed(line, text)
                    if rec is not None:
                        in_order.put_nowait(asyncio.ensure_future(post(client, line, rec)))
                progress.total = read
                in_order.put_nowait(None)
                await writer
            finally:
                writer.cancel()
                while not in_order.empty():     # a failed write leaves these: the engine is shut down below
                    task = in_order.get_nowait()
                    if task is not None:
                        task.cancel()
                if metrics is not None:
                    metrics.close()
            progress.show()
            return counts


async def _room(window: asyncio.Semaphore, writer: asyncio.Future) -> None:
    """A place in the window of lines read but not written; the writer's exception if it fails first (a full disk)."""
    room = asyncio.ensure_future(window.acquire())
    await asyncio.wait((room, writer), return_when=asyncio.FIRST_COMPLETED)
    if not room.done():
        room.cancel()
        writer.result()


async def _answer_metrics(client, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One HTTP request on the metrics port: GET /metrics is the app's (serve's) answer, anything else a 404, so
    that the port serves nothing but the metrics (as vLLM's prometheus_client server)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        method, path = (head.split(b" ", 2) + [b"", b""])[:2]
        if method == b"GET" and path.split(b"?")[0] == b"/metrics":
            r = await client.get("/metrics")
            status, body, kind = f"{r.status_code} {r.reason_phrase}", r.content, r.headers["content-type"]
        else:
            status, body, kind = "404 Not Found", b"this port serves GET /metrics only\n", "text/plain"
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + body)
        await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()


def main(args: argparse.Namespace) -> int:
    import logging

    from picovllm.entrypoints.chat_template import load_chat_template
    from picovllm.entrypoints.engine_args import engine_config_from_args
    from picovllm.entrypoints.openai.api_server import ServerSettings, app_for

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError("give the model once (positional or --model)")
    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    _check_paths(args)
    template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    metrics_socket = _metrics_socket(args) if args.enable_metrics else None
    with contextlib.ExitStack() as stack:
        if metrics_socket is not None:
            stack.callback(metrics_socket.close)
        lines = stack.enter_context(_input(args.input_file, args.output_tmp_dir))   # fetched before the model loads
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        config = engine_config_from_args(args, model=args.model or args.model_tag, reasoning_parser=None)
        if config.role != "pd":
            raise ValueError("--role: run-batch runs a colocated engine (pd)")
        names = list(dict.fromkeys(args.served_model_name or [None]))
        settings = ServerSettings(served_model_name=names[0], served_model_aliases=tuple(names[1:]),
                                  chat_template=template, reasoning_parser=args.reasoning_parser,
                                  tool_call_parser=args.tool_call_parser, engine_process=args.engine_process,
                                  log_level=args.log_level, enable_log_requests=args.enable_log_requests,
                                  max_log_len=args.max_log_len,
                                  max_request_bytes=2**62)     # a file's line: no HTTP client to protect against
        app, _, stop = app_for(config, settings)
        stack.callback(stop)
        # opened once the model has loaded: a failed load costs no file
        out = stack.enter_context(_output(args.output_file, args.output_tmp_dir))
        counts = asyncio.run(run_requests(app, lines, args.max_concurrency,
                                          lambda rec: print(json.dumps(rec), file=out, flush=True),
                                          Progress(args.progress), metrics_socket))
    if counts.failed:
        print(f"picovllm run-batch: {counts.failed} of {counts.lines} requests failed (see their \"error\" or "
              f"\"response.status_code\")", file=sys.stderr)
    return 1 if counts.failed else 0


def _check_paths(args: argparse.Namespace) -> None:
    """Before any work, so that a mistyped path costs no model load and loses no results: ValueError naming the flag."""
    from picovllm.entrypoints.batch_io import check_input, check_not_input, check_output, is_url

    folder = args.output_tmp_dir
    if folder is not None and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        raise ValueError(f"--output-tmp-dir {folder!r}: no such folder, or not writable")
    if not is_url(args.input_file):     # a URL is fetched by _input, before the model loads all the same
        check_input(args.input_file, "--input-file")
    if not is_url(args.output_file):
        check_output(args.output_file, "--output-file")
    check_not_input(args.output_file, args.input_file, "--output-file", "--input-file")


def _metrics_socket(args: argparse.Namespace) -> socket.socket:
    """The metrics' listening socket, bound before the model loads (a port in use is an error naming it)."""
    try:
        sock = socket.create_server((args.url, args.port))
    except OSError as e:
        raise ValueError(f"--enable-metrics: cannot listen on --url {args.url!r} --port {args.port}: "
                         f"{e.strerror or e}") from None
    print(f"picovllm run-batch: metrics at http://{args.url}:{sock.getsockname()[1]}/metrics", file=sys.stderr)
    return sock


@contextlib.contextmanager
def _input(path: str, tmp_dir: str | None) -> Iterator[Iterator[tuple[int, str]]]:
    """The input's numbered lines (batch_io.read_lines): the file at path, stdin ("-"), or, for an http(s) URL, a
    file in tmp_dir it is fetched into now, removed afterwards."""
    from picovllm.entrypoints.batch_io import download, is_url, read_lines

    if not is_url(path):
        yield read_lines(path)
        return
    local = download(path, tmp_dir, "--input-file")
    try:
        yield read_lines(local)
    finally:
        os.unlink(local)


@contextlib.contextmanager
def _output(path: str, tmp_dir: str | None) -> Iterator[TextIO]:
    """Where the output lines go: the file at path, stdout ("-"), or, for an http(s) URL, a file in tmp_dir that
    is PUT there once every line is in (as vLLM's run-batch does), and kept if it cannot be."""
    from picovllm.entrypoints.batch_io import is_url, upload

    if path == "-":
        yield sys.stdout
    elif not is_url(path):
        with open(path, "w", encoding="utf-8") as f:
            yield f
    else:
        import tempfile
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=tmp_dir, prefix="picovllm_batch_output_",
                                         suffix=".jsonl", delete=False) as f:
            try:
                yield f
            except BaseException:
                print(f"picovllm run-batch: the lines answered are in {f.name}, not sent to {path}", file=sys.stderr)
                raise
        try:
            upload(path, f.name, "--output-file")
        except ValueError as e:
            raise ValueError(f"{e}; the output is kept in {f.name}") from None
        os.unlink(f.name)
