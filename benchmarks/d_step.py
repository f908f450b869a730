"""A D engine's decode step against a colocated engine's, on the same batch and context lengths (issue 15).

    python benchmarks/d_step.py [--model PATH | --tiny] [--batches 1 32 128 256] [--prompt-len 512] [--steps 50]

Both kinds of engine run in this process on one device, with the same EngineConfig but the role, one after the
other: first the colocated engine (built once, every batch size in turn, then shut down, which frees its KV cache
on a GPU), then a P and a D engine linked over cuda_ipc (D reads P's blocks). For each batch size B, B requests
of a --prompt-len random prompt each are added (to P for D's row), and once all B decode (on D: P prefills and
offers all B, then D takes them in one step, so none decodes ahead), --steps steps are timed with P idle. P steps
on a thread of its own while it hands over, as it would in its own process: a one-thread loop stalls once P's
Offers and D's Accepts fill the socket between them both ways.

ms: wall time over the steps with the device synchronized at both ends, so under overlapped scheduling it is
the steady-state step. host_us: the part of a step spent outside Executor.resolve (where the host waits for the
device and reads the tokens back): the host's own work per step.
Without --model: the Qwen3-0.6B-shaped random checkpoint of nano_throughput.py; --tiny: a random Qwen3 of hidden
64 and 2 layers (step_host_cost.py's), whose steps are all host work.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from picovllm import EngineConfig, SamplingParams  # noqa: E402
from picovllm.disagg import TransferConfig  # noqa: E402
from picovllm.disagg.channel import Channel, Listener  # noqa: E402
from picovllm.engine.llm_engine import Engine  # noqa: E402
from picovllm.engine.step_loop import StepLoop  # noqa: E402

READY_S = 120.0     # the most a batch may take to be decoding everywhere: past it the run is stuck


def sync(eng: Engine) -> None:
    if eng.executor.device.type == "cuda":
        torch.cuda.synchronize(eng.executor.device)


def add(eng: Engine, batch: int, prompt_len: int, tag: str) -> None:
    rng, vocab = random.Random(batch), min(10000, eng.model_config.vocab_size)
    for i in range(batch):
        eng.add_request([rng.randrange(vocab) for _ in range(prompt_len)],
                        SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True), f"{tag}{batch}-{i}")


def check(outputs) -> None:
    for out in outputs:
        if out.error is not None:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")


class GCTime:
    """Time in Python's garbage collector while counting (gc.callbacks), and collections per generation."""

    def __init__(self) -> None:
        self.counting, self.seconds, self.collections, self._t0 = False, 0.0, [0, 0, 0], 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if not self.counting:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.collections[info["generation"]] += 1

    def start(self) -> None:
        self.counting, self.seconds, self.collections = True, 0.0, [0, 0, 0]

    def stop(self) -> None:
        self.counting = False


GC_TIME = GCTime()


def timed_steps(eng: Engine, steps: int) -> tuple[float, float]:
    """(ms per step, host µs per step outside Executor.resolve) over `steps` steps, every request decoding."""
    waited = [0.0]
    resolve = eng.executor.resolve

    def timed_resolve(launched):
        t0 = time.perf_counter()
        try:
            return resolve(launched)
        finally:
            waited[0] += time.perf_counter() - t0

    eng.executor.resolve = timed_resolve
    try:
        sync(eng)
        GC_TIME.start()
        t = time.perf_counter()
        for _ in range(steps):
            check(eng.step(unfinished_outputs=False))
        sync(eng)
        total = time.perf_counter() - t
    finally:
        GC_TIME.stop()
        del eng.executor.resolve
    print(json.dumps({"role": eng.config.role, "batch": len(eng.requests),
                      "gc_us_per_step": round(GC_TIME.seconds / steps * 1e6, 1), "gc_collections": GC_TIME.collections,
                      "gc_tracked": len(gc.get_objects()), "gc_frozen": gc.get_freeze_count()}), flush=True)
    return total / steps * 1e3, (total - waited[0]) / steps * 1e6


def decoding(eng: Engine, batch: int) -> bool:
    reqs = list(eng.requests.values())
    return len(reqs) == batch and all(r.output_token_ids for r in reqs) and not eng.scheduler.waiting \
        and not eng.scheduler.held


def state(eng: Engine) -> str:
    s = eng.scheduler
    return (f"{eng.config.role}: {len(eng.requests)} requests, waiting {len(s.waiting)}, running {len(s.running)}, "
            f"held {len(s.held)}, decoding {sum(1 for r in eng.requests.values() if r.output_token_ids)}, "
            f"free blocks {eng.block_manager.num_free_blocks}")


def step_until(steppers, ready, what: str, engines=()) -> None:
    deadline = time.monotonic() + READY_S
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready within {READY_S:g} s; " + "; ".join(map(state, engines)))
        for step in steppers:
            check(step())


def measure(eng: Engine, batch: int, args) -> tuple[float, float]:
    for _ in range(5):                    # the first steps at this batch size (graph replays warm up)
        check(eng.step(unfinished_outputs=False))
    if args.freeze:      # as the first engine of its own process, which freezes what exists once it has started
        gc.collect()
        gc.freeze()
    try:
        result = timed_steps(eng, args.steps)
    finally:
        if args.freeze:
            gc.unfreeze()
    if not decoding(eng, batch):
        raise RuntimeError(f"requests finished or left while timed at batch {batch}: raise max_model_len")
    eng.abort_all()
    return result


def colocated(config: dict, args) -> dict[int, tuple[float, float]]:
    eng = Engine(EngineConfig(**config))
    try:
        rows = {}
        for batch in args.batches:
            add(eng, batch, args.prompt_len, "c")
            step_until([eng.step], lambda: decoding(eng, batch), f"colocated batch {batch}", (eng,))
            rows[batch] = measure(eng, batch, args)
        return rows
    finally:
        eng.shutdown()


class PrefillThread:
    """P's StepLoop on a thread until stop(): P serves its peer as its own process would."""

    def __init__(self, p: Engine) -> None:
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(p,), name="d_step-prefill", daemon=True)
        self._thread.start()

    def _run(self, p: Engine) -> None:
        try:
            StepLoop(p, lambda timeout_s: not self._stop.wait(timeout_s)).run_until(lambda: False, check)
        except BaseException as e:      # the main thread raises it
            self.error = e

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"the prefill engine failed: {self.error!r}") from self.error


def roomy(channel: Channel) -> Channel:
    """Socket buffers that hold a whole batch's Offers (~3.6 kB each at 512 tokens), which P sends before D reads."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        channel.sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
    return channel


def disaggregated(config: dict, args) -> dict[int, tuple[float, float]]:
    p = Engine(EngineConfig(**config, role="p", gpu_memory_utilization=0.3) if "cuda" in config["device"]
               else EngineConfig(**config, role="p"))
    d = Engine(EngineConfig(**config, role="d"))
    # TCP over loopback, as between two processes: a socketpair's small buffers fill with a batch's Offers one
    # way and its Accepts the other while both ends send, and neither reads
    listener = Listener()
    tc = TransferConfig(backend="cuda_ipc", timeout_s=60.0, lease_s=60.0, async_transfer=True)
    t = threading.Thread(target=lambda: d.connect(roomy(Channel.connect(listener.address)), tc))
    t.start()
    p.connect(roomy(listener.accept(30.0)), tc)
    t.join()
    listener.close()
    try:
        rows = {}
        for batch in args.batches:
            add(p, batch, args.prompt_len, "d")
            prefill = PrefillThread(p)
            idle = [lambda: time.sleep(0.001) or []]
            try:
                # P prefills the whole batch and offers it before D reads a message, so that D takes it in one go
                # and decodes none ahead (the contexts stay the colocated engine's)
                step_until(idle, lambda: prefill.error is not None or len(p.connector.handovers) == batch,
                           f"P's offers of batch {batch}", (p, d))
                step_until([d.step], lambda: prefill.error is not None or decoding(d, batch), f"D batch {batch}",
                           (p, d))
                # D has acked every request: P only has to read the Acks (D steps no more meanwhile)
                step_until(idle, lambda: prefill.error is not None or not p.requests,
                           f"P's handovers of batch {batch}", (p, d))
            finally:
                prefill.stop()
            rows[batch] = measure(d, batch, args)
        return rows
    finally:
        for eng in (p, d):
            eng.abort_all()
            eng.close()
        try:
            step_until([p.step, d.step], lambda: p.is_done() and d.is_done(), "the P/D session's close", (p, d))
        finally:
            p.shutdown()
            d.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tiny", action="store_true", help="a random Qwen3 of hidden 64, 2 layers: host cost only")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                    help="overlapped scheduling (auto: on for GPUs, as the engine's default)")
    ap.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: torch's default)")
    ap.add_argument("--freeze", action="store_true",
                    help="move every object out of the garbage collector's reach before each engine's timed steps "
                         "(gc.freeze), as the first engine of a process is when it runs alone there")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from random_qwen3 import build
    if args.tiny:
        args.model = build(os.path.join(tempfile.gettempdir(), "picovllm-host-cost-qwen3-64x2"), vocab_size=1024,
                           hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)
    elif args.model is None:
        args.model = build("/tmp/qwen3-0.6b-random")
    max_len = args.prompt_len + args.steps + 64
    # every engine's KV cache exactly what the largest batch needs, on the GPU too: sized from free memory, D found
    # only one block left on an H200 (what the colocated engine had held was not all back)
    config = dict(model=args.model, device=args.device, max_model_len=max_len, max_num_seqs=max(args.batches),
                  max_num_batched_tokens=16384, enable_prefix_caching=False, skip_tokenizer_init=True,
                  async_scheduling={"auto": None, "on": True, "off": False}[args.overlap],
                  num_kv_blocks=max(args.batches) * -(-max_len // 16))
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        config.update(device="cpu")
    c = colocated(config, args)
    gc.collect()            # the colocated engine's weights go before P and D size their caches from free memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    dd = disaggregated(config, args)
    rows = []
    for batch in args.batches:
        (c_ms, c_us), (d_ms, d_us) = c[batch], dd[batch]
        rows.append({"batch": batch, "colocated_ms": round(c_ms, 3), "d_ms": round(d_ms, 3),
                     "d_over_colocated": round(d_ms / c_ms, 3), "colocated_host_us": round(c_us, 1),
                     "d_host_us": round(d_us, 1)})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"d_step": rows, "model": args.model, "prompt_len": args.prompt_len, "steps": args.steps},
                     indent=1))


if __name__ == "__main__":
    main()
