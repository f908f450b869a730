"""A D engine's decode step against a colocated engine's, on the same batch and context lengths (issue 15).

    python benchmarks/d_step.py [--model PATH] [--batches 1 32 128 256] [--prompt-len 512] [--steps 50]

Both engines are in this process on one device, with the same EngineConfig but the role. Colocated: B requests
of a --prompt-len random prompt each are added and stepped until every one decodes; then --steps steps are
timed. D: a P engine in this process prefills the same requests and hands them over (cuda_ipc: D reads P's
blocks); once all B decode on D, --steps of D's steps are timed with P idle. The time is wall time over the
steps with the device synchronized at both ends, so under overlapped scheduling it is the steady-state step.
Without --model: the Qwen3-0.6B-shaped random checkpoint of nano_throughput.py (GPU); on the CPU give a small model.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from picovllm import EngineConfig, SamplingParams  # noqa: E402
from picovllm.disagg import TransferConfig  # noqa: E402
from picovllm.disagg.channel import Channel  # noqa: E402
from picovllm.engine.llm_engine import Engine  # noqa: E402


def sync(eng: Engine) -> None:
    if eng.executor.device.type == "cuda":
        torch.cuda.synchronize(eng.executor.device)


def add(eng: Engine, batch: int, prompt_len: int, tag: str) -> None:
    rng, vocab = random.Random(batch), min(10000, eng.model_config.vocab_size)
    for i in range(batch):
        eng.add_request([rng.randrange(vocab) for _ in range(prompt_len)],
                        SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True), f"{tag}{i}")


def timed_steps(eng: Engine, steps: int) -> float:
    """ms per step over `steps` steps of eng, every running request decoding."""
    sync(eng)
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync(eng)
    return (time.perf_counter() - t) / steps * 1e3


def decoding(eng: Engine, batch: int) -> bool:
    reqs = list(eng.requests.values())
    return len(reqs) == batch and all(r.output_token_ids for r in reqs) and not eng.scheduler.waiting


def colocated(config: dict, batch: int, args) -> float:
    eng = Engine(EngineConfig(**config))
    try:
        add(eng, batch, args.prompt_len, "c")
        while not decoding(eng, batch):
            eng.step()
        for _ in range(5):                    # the first steps at this batch size (graph replays warm up)
            eng.step()
        return timed_steps(eng, args.steps)
    finally:
        for rid in list(eng.requests):
            eng.abort(rid)
        eng.shutdown()


def disaggregated(config: dict, batch: int, args) -> float:
    p = Engine(EngineConfig(**config, role="p", gpu_memory_utilization=0.3) if "cuda" in config["device"]
               else EngineConfig(**config, role="p"))
    d = Engine(EngineConfig(**config, role="d"))
    a, b = socket.socketpair()
    tc = dict(backend="cuda_ipc", timeout_s=60.0, lease_s=60.0)
    t = threading.Thread(target=d.connect, args=(Channel(b), TransferConfig(async_transfer=True, **tc)))
    t.start()
    p.connect(Channel(a), TransferConfig(async_transfer=True, **tc))
    t.join()
    try:
        add(p, batch, args.prompt_len, "d")
        while not decoding(d, batch):
            p.step()
            d.step()
        for _ in range(5):
            d.step()
        return timed_steps(d, args.steps)
    finally:
        for eng in (p, d):
            for rid in list(eng.requests):
                eng.abort(rid)
        for eng in (p, d):
            eng.close()
        while not (p.is_done() and d.is_done()):
            p.step()
            d.step()
        p.shutdown()
        d.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    if args.model is None:
        from random_qwen3 import build
        args.model = build("/tmp/qwen3-0.6b-random")
    config = dict(model=args.model, device=args.device, max_model_len=args.prompt_len + args.steps + 64,
                  max_num_seqs=max(args.batches), max_num_batched_tokens=16384, enable_prefix_caching=False)
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        config.update(device="cpu", num_kv_blocks=max(args.batches) * (-(-(args.prompt_len + args.steps + 64) // 16)))
    rows = []
    for batch in args.batches:
        c, dd = colocated(config, batch, args), disaggregated(config, batch, args)
        rows.append({"batch": batch, "colocated_ms": round(c, 3), "d_ms": round(dd, 3), "d_over_colocated": round(dd / c, 3)})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"d_step": rows, "prompt_len": args.prompt_len, "steps": args.steps}, indent=1))


if __name__ == "__main__":
    main()
