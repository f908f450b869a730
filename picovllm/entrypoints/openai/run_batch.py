"""`picovllm run-batch`: a file in OpenAI's batch format (vLLM's `run-batch`), each request run by the server's own
handlers in this process, through no socket, so a line gets exactly the answer `picovllm serve` would give it.

Input, a JSON object a line: {"custom_id": str, "method": "POST", "url": one of URLS, "body": the request}.
Output, a line per input line, in input order (OpenAI's batch output):
    {"id": "batch_req_<hex>", "custom_id": ..., "response": {"status_code": int, "request_id": str,
     "body": the response, or its error object for a 4xx/5xx}, "error": null}
A line that is no request (not JSON, a field missing or of the wrong type, a url or method not served, a streamed
body) gets "response": null and "error": {"code": ..., "message": ...} naming the field; a line that fails in any
other way gets such an error of its own, and the other lines run. Blank lines are skipped; a line number counts
them. A line is written as soon as it and all before it are done. The input and output may be http(s) URLs (GET,
PUT), as in vLLM's. The command exits 0 if every request got a 200, else 1.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import TextIO

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


def add_parser(subparsers) -> argparse.ArgumentParser:
    from picovllm.entrypoints.chat_template import CHAT_TEMPLATE_HELP
    from picovllm.entrypoints.engine_args import add_engine_args
    from picovllm.entrypoints.openai.cli_proxy import add_tool_args
    from picovllm.entrypoints.openai.reasoning import HELP as REASONING_HELP, PARSERS as REASONING_PARSERS

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
    p.add_argument("--served-model-name", default=None, help="the model id a body's \"model\" must name "
                                                              "(default: --model's)")
    p.add_argument("--max-concurrency", type=int, default=256, help="requests in the engine at once (default 256)")
    p.add_argument("--chat-template", default=None, help=CHAT_TEMPLATE_HELP)
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS, help=REASONING_HELP)
    add_tool_args(p)
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                   help="run the engine loop in a process of its own (default: a thread of this one)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_engine_args(p, skip=("reasoning_parser",))
    p.set_defaults(func=main)
    return p


def parse_request(text: str, line: int) -> tuple[dict, dict | None]:
    """(the line's object, None) if it is a request this command runs; ({custom_id if any}, error object) if not."""
    try:
        rec = json.loads(text)
    except ValueError as e:
        return {}, _error("invalid_json", f"line {line}: not JSON: {e}")
    if not isinstance(rec, dict):
        return {}, _error("invalid_request", f"line {line}: must be a JSON object")
    head = {"custom_id": rec.get("custom_id")}
    unknown = sorted(set(rec) - {"custom_id", "method", "url", "body"})
    why = None
    if unknown:
        why = f"unknown field {unknown[0]!r} (a line holds custom_id, method, url and body)"
    elif not isinstance(rec.get("custom_id"), str):
        why = "custom_id must be a string"
    elif rec.get("method") != "POST":
        why = f"method must be \"POST\", got {rec.get('method')!r}"
    elif rec.get("url") not in URLS:
        why = f"url must be one of {', '.join(URLS)}, got {rec.get('url')!r}"
    elif not isinstance(rec.get("body"), dict):
        why = "body must be a JSON object (the request)"
    elif rec["body"].get("stream"):
        why = "body.stream: a batch takes whole responses, not streams"
    return (rec, None) if why is None else (head, _error("invalid_request", f"line {line}: {why}"))


def _error(code: str, message: str) -> dict:
    return {"code": code, "message": message}


async def run_requests(app, lines: list[tuple[int, str]], concurrency: int,
                       write: Callable[[dict], None] = lambda rec: None) -> list[dict]:
    """Each (line number, text)'s output record, in order, every request posted to app (the server's, its engine
    started by its own lifespan) through httpx's ASGI transport, at most `concurrency` at once. Each record goes to
    write as soon as it and all before it are done, so that a run cut short keeps what it answered."""
    import httpx

    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, line: int, text: str) -> dict:
        out = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": None, "response": None, "error": None}
        try:
            rec, out["error"] = parse_request(text, line)
            out["custom_id"] = rec.get("custom_id")
            if out["error"] is None:
                # The body as a client would send it to `serve` (json.dumps: NaN and Infinity as Python's JSON
                # writes them, a lone surrogate \u-escaped), so such a body gets serve's 400, not an encoder's error.
                async with gate:
                    r = await client.post(rec["url"], content=json.dumps(rec["body"]),
                                          headers={"content-type": "application/json"})
                out["response"] = {"status_code": r.status_code,
                                   "request_id": r.headers.get("x-request-id") or f"batch-{uuid.uuid4().hex}",
                                   "body": r.json()}
        except Exception as e:      # this line's failure, never the batch's (vLLM's run_request does the same)
            out["error"] = _error("internal_error", f"line {line}: {type(e).__name__}: {e}")
        return out

    # raise_app_exceptions=False: a handler's exception is that line's 500 (the server's error body), as serve
    # answers it, not an exception out of client.post
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
            tasks = [asyncio.ensure_future(one(client, line, text)) for line, text in lines]
            results = []
            for task in tasks:
                results.append(await task)
                write(results[-1])
            return results


def main(args: argparse.Namespace) -> int:
    import logging

    from picovllm.entrypoints.batch_io import check_input, check_output, is_url, read_lines
    from picovllm.entrypoints.chat_template import load_chat_template
    from picovllm.entrypoints.engine_args import engine_config_from_args
    from picovllm.entrypoints.openai.api_server import ServerSettings, app_for

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError("give the model once (positional or --model)")
    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not is_url(args.input_file):     # a URL is fetched by read_lines, before the model loads all the same
        check_input(args.input_file, "--input-file")
    if not is_url(args.output_file):
        check_output(args.output_file, "--output-file")
    template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    lines = read_lines(args.input_file, "--input-file")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config_from_args(args, model=args.model or args.model_tag, reasoning_parser=None)
    if config.role != "pd":
        raise ValueError("--role: run-batch runs a colocated engine (pd)")
    settings = ServerSettings(served_model_name=args.served_model_name, chat_template=template,
                              reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                              engine_process=args.engine_process, log_level=args.log_level,
                              max_request_bytes=2**62)     # a file's line: no HTTP client to protect against
    app, _, stop = app_for(config, settings)
    try:
        with _output(args.output_file) as out:      # opened once the model has loaded: a failed load costs no file
            results = asyncio.run(run_requests(app, lines, args.max_concurrency,
                                               lambda rec: print(json.dumps(rec), file=out, flush=True)))
    finally:
        stop()
    failed = sum(r["error"] is not None or r["response"]["status_code"] != 200 for r in results)
    if failed:
        print(f"picovllm run-batch: {failed} of {len(results)} requests failed (see their \"error\" or "
              f"\"response.status_code\")", file=sys.stderr)
    return 1 if failed else 0


@contextlib.contextmanager
def _output(path: str) -> Iterator[TextIO]:
    """Where the output lines go: the file at path, stdout ("-"), or, for an http(s) URL, a buffer PUT there once
    every line is in (as vLLM's run-batch does)."""
    from picovllm.entrypoints.batch_io import http_put, is_url

    if path == "-":
        yield sys.stdout
    elif is_url(path):
        buf = io.StringIO()
        yield buf
        http_put(path, buf.getvalue(), "--output-file")
    else:
        with open(path, "w") as f:
            yield f
