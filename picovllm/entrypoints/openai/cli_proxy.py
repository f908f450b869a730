"""`picovllm proxy`: the OpenAI API in front of prefill/decode server pairs (picovllm/disagg/proxy.py)."""
from __future__ import annotations

import argparse
import json
import math

from picovllm.entrypoints.chat_template import CHAT_TEMPLATE_HELP, TRUST_TEMPLATE_HELP
from picovllm.entrypoints.openai.reasoning import HELP as REASONING_HELP, PARSERS as REASONING_PARSERS
from picovllm.entrypoints.openai.tool_calls import TOOL_PARSERS


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: one the system picks); uvicorn would bind any int modulo 65536 and log the other."""
    n = int(text)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0-65535, got {n}")
    return n


def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def wait_seconds(text: str) -> float:
    """A finite number of seconds >= 0 (0: no wait)."""
    n = float(text)
    if not (math.isfinite(n) and n >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return n


def model_name(text: str) -> str:
    """A model id clients send: not empty (an empty one would mean the default, unasked)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("proxy", help="the OpenAI API in front of prefill/decode server pairs",
                              description="Route each request through a prefill server, then its decode server.")
    p.add_argument("--prefill", nargs="+", required=True, help="prefill servers' base URLs (serve --role p)")
    p.add_argument("--decode", nargs="+", required=True, help="decode servers' base URLs (serve --role d)")
    p.add_argument("--pd-secret-file", default=None,
                   help="the P/D shared secret the servers were given (first line of the file; default "
                        "$PICOVLLM_PD_SECRET): every call to a /pd route is signed with it")
    p.add_argument("--lease", type=float, default=10.0,
                   help="seconds a server may fail its health checks (or a P report its link down) before its "
                        "pair leaves the rotation and the requests open on it end in an error")
    add_front_end_args(p, "the prefill servers' model path", "the servers")
    p.set_defaults(func=main)
    return p


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, e.g. '[\"https://example.com\"]', "
                                         f"got {text!r}")
    return value


def add_cors_args(p: argparse.ArgumentParser) -> None:
    """CORS, as vLLM's flags (api_server.cors_settings reads them); off unless --allowed-origins names some."""
    g = p.add_argument_group("CORS (browsers calling the API from other origins)")
    g.add_argument("--allowed-origins", type=_json_list, default=[],
                   help="JSON list of origins allowed, e.g. '[\"https://app.example.com\"]' or '[\"*\"]' "
                        "(default: none; vLLM's default is every origin)")
    g.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
                   help="allow cookies and credentials")
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], help="JSON list (default: every method)")
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], help="JSON list (default: every header)")


def add_tool_args(p: argparse.ArgumentParser) -> None:
    """vLLM's tool-calling flags (serve's, the proxy's and the router's)."""
    p.add_argument("--tool-call-parser", default="auto", choices=("auto", *TOOL_PARSERS),
                   help="tool calls' format under tool_choice auto (default: the one the model's tokenizer and "
                        "chat template speak: mistral, deepseek_v3, deepseek_v31, kimi_k2, qwen3_coder, glm45, "
                        "llama3_json, else hermes)")
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=False,
                   help="accepted for vLLM's command lines: tool_choice auto is always on here")


def add_front_end_args(p: argparse.ArgumentParser, model_default: str, waits_for: str) -> None:
    """The flags of an OpenAI front end over other servers' engines (the proxy's and the router's)."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    p.add_argument("--port", type=port, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument("--model", default=None, help=f"where to load the tokenizer from (default: {model_default})")
    p.add_argument("--revision", default=None, help="the --model Hub repository's branch, tag or commit (default: "
                                                    "main; without --model, the servers' revision)")
    p.add_argument("--download-dir", default=None, help="where a Hub repository's configs and tokenizer are fetched "
                                                        "to and looked for (default: the Hub's cache)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", type=model_name, default=None,
                   help="the model id clients send (default: the servers' own)")
    p.add_argument("--chat-template", default=None, help=CHAT_TEMPLATE_HELP)
    p.add_argument("--trust-request-chat-template", action=argparse.BooleanOptionalAction, default=False,
                   help=TRUST_TEMPLATE_HELP)
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS, help=REASONING_HELP)
    add_tool_args(p)
    p.add_argument("--max-request-bytes", type=positive, default=4 * 2**20,
                   help="larger bodies get HTTP 413 (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=wait_seconds, default=10.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT (default: %(default)s)")
    p.add_argument("--startup-timeout", type=wait_seconds, default=300.0,
                   help=f"seconds to wait for {waits_for} (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults for requests that leave them unset: 'auto' (the model folder's "
                        "generation_config.json), 'vllm' (none) or a folder holding one (as serve's)")
    p.add_argument("--override-generation-config", default=None,
                   help='JSON that sets or replaces those defaults, e.g. \'{"temperature": 0.5}\'')
    add_cors_args(p)


def main(args: argparse.Namespace) -> int:
    from picovllm.disagg.proxy import main as run_proxy
    return run_proxy(args)
