"""`picovllm router`'s start-up and its admin API (the routing itself: picovllm/disagg/router.py)."""
from __future__ import annotations

import argparse
import logging
import time

import httpx
from fastapi import FastAPI, Request

from picovllm.disagg.auth import FleetSecret, SignedRoutes
from picovllm.disagg.router import InstancePool, InstanceRefused, RouterEngine, RouterMetrics
from picovllm.disagg.router_policy import make_policy
from picovllm.entrypoints.openai.protocol import APIError

logger = logging.getLogger("picovllm.router")


def fetch_info(pool: InstancePool, url: str, deadline: float) -> dict:
    """An instance's /pd/info, retrying while it starts (start-up only)."""
    while True:
        try:
            r = httpx.get(url + "/pd/info", headers=pool.headers("GET", "/pd/info"), timeout=5.0)
            if r.status_code == 200:
                return r.json()
            why = f"HTTP {r.status_code}: {r.text[:200]}"
            if r.status_code in (401, 404):
                raise ValueError(f"{url}/pd/info answered {why} (a fleet instance with the same secret?)")
        except httpx.HTTPError as e:
            why = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer in time ({why})")
        time.sleep(0.25)


def add_admin_routes(app: FastAPI, engine: RouterEngine) -> None:
    pool = engine.pool

    @app.get("/admin/instances")
    async def list_instances() -> dict:
        return {"instances": [i.describe() for i in pool.instances.values()]}

    @app.post("/admin/instances")
    async def add_instance(raw: Request) -> dict:
        body = await _json_object(raw)
        url, role = body.get("url"), body.get("role")
        if role not in ("p", "d"):
            raise APIError(400, f"role must be 'p' or 'd', got {role!r}", param="role")
        url = _base_url(url)
        try:
            r = await engine.client.get(url + "/pd/info", headers=pool.headers("GET", "/pd/info"), timeout=5.0)
        except httpx.HTTPError as e:
            raise APIError(502, f"url: {url} is unreachable: {type(e).__name__}: {e}", param="url") from None
        if r.status_code != 200:
            raise APIError(502 if r.status_code >= 500 else 400, f"url: {url}/pd/info answered HTTP "
                           f"{r.status_code}", param="url")
        try:
            info = r.json()
        except ValueError as e:
            raise APIError(502, f"url: {url}/pd/info is not JSON: {e}", param="url") from None
        try:
            inst = pool.add(url, role, info)
        except InstanceRefused as e:
            raise APIError(e.status, str(e), param=e.param) from None
        logger.info("instance %s (%s) added", url, role)
        return {"instance": inst.describe()}

    @app.post("/admin/instances/remove")
    async def remove_instance(raw: Request) -> dict:
        body = await _json_object(raw)
        try:
            inst = pool.remove(str(body.get("url", "")).rstrip("/"))
        except KeyError:
            raise APIError(404, f"url: no instance {body.get('url')!r} in the fleet", param="url") from None
        logger.info("instance %s (%s) removed", inst.url, inst.role)
        return {"instance": inst.describe()}


def _base_url(url: object) -> str:
    """The admin request's url as an instance's base URL; a 400 naming it if it is not one."""
    try:
        parsed = httpx.URL(url) if isinstance(url, str) and not any(c.isspace() for c in url) else None
    except httpx.InvalidURL:     # a port not a number, an unclosed [ ...
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host or (parsed.port or 0) > 65535:
        raise APIError(400, f"url: an http(s) base URL is required, got {url!r}", param="url")
    return url.rstrip("/")


async def _json_object(raw: Request) -> dict:
    try:
        body = await raw.json()
    except ValueError as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


def main(args: argparse.Namespace) -> int:
    """`picovllm router`: add the instances given, load the tokenizer, serve until SIGTERM/SIGINT."""
    from picovllm.entrypoints.chat_template import load_chat_template
    from picovllm.entrypoints.openai.api_server import front_end_app, run_app
    from picovllm.entrypoints.openai.metrics import ServerMetrics
    from picovllm.loader.source import open_model_source

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        template = load_chat_template(args.chat_template) if args.chat_template is not None else None
        secret = FleetSecret.load(args.pd_secret_file)
        prefill_policy = make_policy(args.prefill_policy, "p")
        decode_policy = make_policy(args.decode_policy, "d")
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    pool = InstancePool(secret, args.lease)
    deadline = time.monotonic() + args.startup_timeout
    try:
        for role, urls in (("p", args.prefill), ("d", args.decode)):
            for url in (u.rstrip("/") for u in urls):
                pool.add(url, role, fetch_info(pool, url, deadline))
    except (ValueError, TimeoutError) as e:      # an instance that does not fit, or never answered
        raise SystemExit(f"error: {e}") from None
    model = args.model
    card = {}
    if pool.candidates("p"):
        card = httpx.get(pool.candidates("p")[0].url + "/v1/models", timeout=10.0).json()["data"][0]
    elif model is None:
        raise SystemExit("error: --model: needed when no --prefill instance is given (the router tokenizes)")
    name = args.served_model_name or card.get("id") or model
    # the P servers' model at their revision, unless --model names one
    model, revision = (model, args.revision) if model is not None else (card["root"], card.get("revision"))
    source = open_model_source(model, weights_needed=False, revision=revision, download_dir=args.download_dir)
    tokenizer = source.load_tokenizer() if source.load_tokenizer is not None else None
    info = {"root": card.get("root", model), **({"revision": revision} if revision else {}),
            "max_model_len": card.get("max_model_len"),
            "vocab_size": card.get("vocab_size", source.config.vocab_size)}
    metrics = ServerMetrics(name)
    pool.metrics = RouterMetrics(metrics.registry)
    for inst in pool.instances.values():
        pool.observe(inst)
    engine = RouterEngine(pool, prefill_policy, decode_policy, info, metrics, pool.metrics)
    app, settings = front_end_app(engine, tokenizer, args, name, metrics, template, model, revision,
                                  args.download_dir)
    add_admin_routes(app, engine)
    app.add_middleware(SignedRoutes, secret=secret, prefixes=("/admin/",))
    logger.info("router on http://%s:%d: %d prefill and %d decode instances; policies %s (P), %s (D)", args.host,
                args.port, len(args.prefill), len(args.decode), prefill_policy.name, decode_policy.name)
    run_app(app, engine, settings)
    return 0
