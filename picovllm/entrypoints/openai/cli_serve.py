"""`picovllm serve`: the OpenAI-compatible server on one engine."""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from picovllm.entrypoints.chat_template import CHAT_TEMPLATE_HELP, TRUST_TEMPLATE_HELP
from picovllm.entrypoints.openai.reasoning import HELP as REASONING_HELP, PARSERS as REASONING_PARSERS
from picovllm.entrypoints.commands.args import flags_given
from picovllm.entrypoints.engine_args import add_engine_args, engine_config_from_args
from picovllm.entrypoints.openai.cli_proxy import (add_cors_args, add_tool_args, model_name, port, positive,
                                                   wait_seconds)
from picovllm.entrypoints.vllm_args import SERVE_ARGS, add_vllm_args

if TYPE_CHECKING:
    from picovllm.entrypoints.openai.api_server import ServerSettings

# Backends only a fleet has (picovllm.disagg.transfer.PULL_BACKENDS; not imported here: --help stays light).
# cuda_ipc serves both: a linked pair given --kv-port (P) or --kv-peer (D), a fleet instance otherwise.
FLEET_ONLY_BACKENDS = ("tcp", "nixl")


def is_linked_pair(args: argparse.Namespace, role: str) -> bool:
    """A P or D server of a linked pair (serve_pd), rather than a fleet instance (serve_fleet)."""
    if args.kv_transfer in FLEET_ONLY_BACKENDS:
        return False
    return args.kv_transfer != "cuda_ipc" or bool(args.kv_peer if role == "d" else args.kv_port)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics "
                                          "(with --runner pooling: /v1/embeddings).")
    p.add_argument("model_tag", nargs="?", default=None, help="model (same as --model)")
    p.add_argument("--model", default=None,
                   help="HF folder, .gguf file or Hub id (org/name[/file.gguf]) (default: SmolLM2-135M-Instruct)")
    p.add_argument("--config", metavar="FILE.yaml",
                   help="flags from a YAML file of `flag: value` lines, as vLLM's (the command line's flags win)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    p.add_argument("--port", type=port, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1 routes, KEY any one of these (default: "
                        "$VLLM_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", type=model_name, default=None, metavar="NAME",
                   help="the model ids clients may send; replies and /metrics name the first (default: --model)")
    p.add_argument("--max-request-bytes", type=positive, default=4 * 2**20,
                   help="larger bodies get HTTP 413 (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=wait_seconds, default=10.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT before they are aborted "
                        "(default: %(default)s)")
    p.add_argument("--log-level", "--uvicorn-log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="the server's log level (vLLM's --uvicorn-log-level) (default: info)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                   help="a log line for each HTTP request, uvicorn's (default: off)")
    p.add_argument("--disable-uvicorn-access-log", dest="access_log", action="store_false",
                   help="vLLM's: no access log (the default here)")
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="a log line for each request: its prompt token ids and sampling parameters (default: off)")
    p.add_argument("--max-log-len", type=positive, default=None,
                   help="the most prompt token ids such a line shows (default: all)")
    p.add_argument("--chat-template", default=None, help=CHAT_TEMPLATE_HELP)
    p.add_argument("--trust-request-chat-template", action=argparse.BooleanOptionalAction, default=False,
                   help=TRUST_TEMPLATE_HELP)
    p.add_argument("--chat-template-content-format", default="auto", choices=("auto", "string", "openai"),
                   help="a message's list of text parts in the template: string (joined by newlines), openai (the "
                        "list), auto (the list where the template loops over a message's content) (default: auto)")
    p.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                   help="template variables every chat request gets unless its chat_template_kwargs sets them, "
                        "e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS, help=REASONING_HELP)
    add_tool_args(p)
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine loop in a process of its own, not a thread beside the HTTP server's, so the "
                        "two never wait for each other's GIL (default: on; --no-engine-process: one process)")
    p.add_argument("--api-server-count", "-asc", type=positive, default=1,
                   help="HTTP server processes in front of the one engine process, sharing the port: each parses "
                        "requests and streams tokens on a CPU core of its own (default 1; colocated only)")
    add_cors_args(p)
    add_https_args(p)
    add_pd_args(p)
    add_engine_args(p, skip=("reasoning_parser",))    # the HTTP side's, declared above
    add_vllm_args(p, SERVE_ARGS, "vLLM's server flags picovllm has no setting for (a value other than those listed "
                                 "is refused)")
    p.set_defaults(func=main)
    return p


def add_https_args(p: argparse.ArgumentParser) -> None:
    """HTTPS and a path prefix, as vLLM's flags (uvicorn's)."""
    g = p.add_argument_group("HTTPS and proxies")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    g.add_argument("--ssl-keyfile", default=None, help="its private key (default: in --ssl-certfile)")
    g.add_argument("--ssl-ca-certs", default=None, help="the CA certificates client certificates must chain to")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                   help="client certificates: 0 not asked, 1 optional, 2 required (default: 0)")
    g.add_argument("--root-path", default=None,
                   help="the path prefix a proxy serves this server under, e.g. /llm (routes answer with and without "
                        "it)")


def add_pd_args(p: argparse.ArgumentParser) -> None:
    """The flags only a prefill or decode server reads (--role p|d)."""
    pd = p.add_argument_group("disaggregated serving (--role p|d, behind `picovllm proxy` or `picovllm router`)")
    pd.add_argument("--kv-host", default="127.0.0.1", help="--role p: where to listen for the decode server")
    pd.add_argument("--kv-port", type=port, default=0, help="--role p: the port the decode server connects to")
    pd.add_argument("--kv-peer", default=None, help="--role d: the prefill server's HOST:PORT (its --kv-port)")
    pd.add_argument("--kv-transfer", default="torch_dist",
                    help="KV transfer backend: torch_dist or cuda_ipc (a linked pair: --kv-port/--kv-peer), "
                         "or tcp or nixl (a fleet instance behind `picovllm router`: any D pulls from any P; "
                         "cuda_ipc too, without --kv-port/--kv-peer)")
    pd.add_argument("--kv-lease", type=float, default=10.0,
                    help="seconds of silence before the peer counts as dead (a fleet: also how long P keeps "
                         "KV nobody claimed)")
    pd.add_argument("--kv-advertise-host", default=None, help="a fleet instance: the address others reach it at")
    pd.add_argument("--pd-secret-file", default=None,
                    help="the P/D shared secret, required with --role p|d (first line of the file; default "
                         "$PICOVLLM_PD_SECRET): every /pd route, the P-D link and every KV socket is "
                         "authenticated with it; the proxy or router needs the same one")
    pd.add_argument("--router", default=None, help="a fleet instance: register with this router once up")


def main(args: argparse.Namespace) -> int:
    from picovllm.entrypoints.openai.api_server import serve

    if args.model_tag and args.model and args.model_tag != args.model:
        raise SystemExit("error: give the model once (positional or --model)")
    settings = server_settings(args)    # before the engine's config, which imports torch: a bad flag fails in a blink
    if args.api_server_count > 1 and (args.role != "pd" or not args.engine_process):
        raise SystemExit("error: --api-server-count: several API servers need the engine in a process of its own "
                         "(not --no-engine-process) and a colocated server (not --role p or d)")
    pd_only = flags_given(args, add_pd_args) if args.role == "pd" else []
    if pd_only:
        raise SystemExit(f"error: {pd_only[0]} applies to --role p|d only")
    # --reasoning-parser is the HTTP side's: it splits chat replies and sets each constrained request's own parser
    # (StructuredOutputsParams.reasoning_parser), as the proxy and the router do for their engines
    config = engine_config_from_args(args, model=args.model or args.model_tag, reasoning_parser=None)
    for flag, given in (("--chat-template", settings.chat_template is not None),
                        ("--trust-request-chat-template", args.trust_request_chat_template),
                        ("--reasoning-parser", args.reasoning_parser is not None),
                        ("--tool-call-parser", args.tool_call_parser != "auto"),
                        ("--generation-config", args.generation_config != "auto"),
                        ("--override-generation-config", args.override_generation_config is not None)):
        if given and config.role != "pd":
            raise SystemExit(f"error: {flag}: a prefill or decode server reads no OpenAI request (the proxy or the "
                             f"router does): give it to them")
    # flags the proxy and the router do not take either: a colocated server's
    colocated_only = [flag for flag, given in (("--served-model-name with several names",
                                                 bool(settings.served_model_aliases)),
                                                ("--chat-template-content-format",
                                                 settings.chat_template_content_format != "auto"),
                                                ("--default-chat-template-kwargs",
                                                 settings.default_chat_template_kwargs is not None),
                                                ("--enable-log-requests", settings.enable_log_requests),
                                                ("--root-path", settings.root_path is not None)) if given]
    if colocated_only and config.role != "pd":
        raise SystemExit(f"error: {colocated_only[0]} applies to a colocated server only (not --role p or d)")
    if config.role == "pd":
        return serve(config, settings)
    from picovllm.disagg.auth import FleetSecret
    try:
        secret = FleetSecret.load(args.pd_secret_file)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    if is_linked_pair(args, config.role):
        from picovllm.disagg.server import LinkSettings, serve_pd
        serve_pd(config, settings, LinkSettings(secret, args.kv_host, args.kv_port, args.kv_peer, args.kv_transfer,
                                                args.kv_lease))
        return 0
    from picovllm.disagg.fleet_server import FleetSettings, serve_fleet
    serve_fleet(config, settings, FleetSettings(secret, args.kv_transfer, args.kv_host, args.kv_port,
                                                args.kv_advertise_host, args.kv_lease, router=args.router))
    return 0


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The HTTP side's ServerSettings the flags give; SystemExit("error: ...") naming a flag whose value cannot
    serve (a chat template that does not compile, a certificate that does not load, ...)."""
    from picovllm.config import parse_json_object
    from picovllm.entrypoints.chat_template import load_chat_template, template_kwargs
    from picovllm.entrypoints.openai.api_server import ServerSettings, cors_settings

    names = list(dict.fromkeys(args.served_model_name or [None]))
    env_key = os.environ.get("VLLM_API_KEY")       # vLLM's: the key where --api-key gives none
    keys = args.api_key or ([env_key] if env_key else [])
    if not (args.model or args.model_tag) and (len(names) > 1 or len(keys) > 1):
        raise SystemExit("error: --served-model-name and --api-key take several values, and no model is given: "
                         "give it first (`picovllm serve MODEL --api-key KEY ...`) or with --model")
    try:
        template = load_chat_template(args.chat_template) if args.chat_template is not None else None
        template_defaults = parse_json_object(args.default_chat_template_kwargs, "--default-chat-template-kwargs",
                                              "template variables")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    try:
        template_kwargs([], True, False, template_defaults)
    except ValueError as e:
        raise SystemExit(f"error: --default-chat-template-kwargs: {e}") from None
    root = args.root_path
    if root is not None and not root.startswith("/"):
        raise SystemExit(f"error: --root-path must start with /, got {root!r}")
    root = root.rstrip("/") or None if root is not None else None      # "/" is no prefix
    _check_https(args)
    return ServerSettings(host=args.host, port=args.port, api_key=tuple(keys) or None, served_model_name=names[0],
                          served_model_aliases=tuple(names[1:]),
                          max_request_bytes=args.max_request_bytes, shutdown_timeout=args.shutdown_timeout,
                          log_level=args.log_level, access_log=args.access_log, chat_template=template,
                          trust_request_chat_template=args.trust_request_chat_template,
                          reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                          engine_process=args.engine_process, api_server_count=args.api_server_count,
                          root_path=root, ssl_keyfile=args.ssl_keyfile,
                          ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                          ssl_cert_reqs=args.ssl_cert_reqs,
                          chat_template_content_format=args.chat_template_content_format,
                          default_chat_template_kwargs=template_defaults, enable_log_requests=args.enable_log_requests,
                          max_log_len=args.max_log_len, **cors_settings(args))


def _check_https(args: argparse.Namespace) -> None:
    """The --ssl-* files load (uvicorn would fail on them only once the model is loaded, with a traceback)."""
    import ssl

    if args.ssl_certfile is None:
        for flag in ("ssl_keyfile", "ssl_ca_certs"):
            if getattr(args, flag) is not None:
                raise SystemExit(f"error: --{flag.replace('_', '-')} goes with --ssl-certfile (HTTPS)")
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except OSError as e:        # ssl.SSLError is one
        raise SystemExit(f"error: --ssl-certfile {args.ssl_certfile!r}"
                         f"{'' if args.ssl_keyfile is None else f' --ssl-keyfile {args.ssl_keyfile!r}'}: "
                         f"cannot load the certificate and its key: {e}") from None
    if args.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(args.ssl_ca_certs)
        except OSError as e:
            raise SystemExit(f"error: --ssl-ca-certs {args.ssl_ca_certs!r}: cannot load: {e}") from None
