"""`picovllm cache`: what the artifact cache holds (picovllm/artifact_cache.py), and clearing it."""
from __future__ import annotations

import argparse
import time


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("cache", help="list or clear the artifact cache (tokenizers, weights, kernels)",
                              description="List the artifact cache's entries (kind, size, what each was made from); "
                                          "--clear removes them. The folder: $PICOVLLM_CACHE_DIR, else "
                                          "$XDG_CACHE_HOME/picovllm, else ~/.cache/picovllm.")
    p.add_argument("--clear", action="store_true", help="remove every entry (or those of --kind)")
    p.add_argument("--kind", choices=("gguf", "gguf_float", "engine", "kernels"), default=None,
                   help="only entries of this kind")
    p.set_defaults(func=run_cache)


def run_cache(args: argparse.Namespace) -> int:
    from picovllm.artifact_cache import ArtifactCache

    cache = ArtifactCache.from_env()
    if cache is None:
        print("picovllm cache: the cache is off (PICOVLLM_NO_CACHE)")
        return 0
    found = [e for e in cache.entries() if args.kind in (None, e["kind"])]
    print(f"{cache.root}: {len(found)} entries, {sum(e['bytes'] for e in found) / 2**20:.1f} MiB")
    for e in found:
        made = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["made"])) if e["made"] else "?"
        print(f"  {e['kind']:8s} {e['key']}  {e['bytes'] / 2**20:9.1f} MiB  {made}  {e['source']}")
        if args.clear:
            cache.remove(e["kind"], e["key"])
    if args.clear:
        print(f"removed {len(found)} entries")
    return 0
