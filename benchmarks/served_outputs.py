"""A served engine's per-step host cost of its outputs, by output length: what the engine process does each step
for every running request (Engine.make_output, then OutputDeltas.encode and the pickling onto the pipe), with the
engine's outputs cumulative (as before) or DELTA (Engine.stream_deltas, what a colocated engine process runs).
With --thread, the engine loop in the server's own process (`serve --no-engine-process`, AsyncEngine): its outputs
cumulative (before) against delta outputs added up at once (OutputDeltas.encode then OutputsFromDeltas.decode, no
pipe: what AsyncEngine does since its adds_deltas).

    python benchmarks/served_outputs.py [--batch 256] [--at 100 1000 2000] [--window 10] [--logprobs N] [--thread]

A tiny random Llama with a trained tokenizer (tests/serving_fixtures.py), on the CPU, one thread: its forward is
small, so what grows with the output length is the host's. Prints, per mode and length, the median us a step of the
whole step, of make_output (summed over the step's requests) and of encode + pickle (--thread: encode + decode), and
the garbage collector's seconds over the run.
"""
from __future__ import annotations

import argparse
import gc
import os
import pickle
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402


def run(path: str, args, stream_deltas: bool) -> None:
    from picovllm.config import EngineConfig
    from picovllm.engine.llm_engine import Engine
    from picovllm.entrypoints.openai.output_deltas import OutputDeltas, OutputsFromDeltas
    from picovllm.sampling_params import SamplingParams

    longest = max(args.at) + args.window + 8
    max_len = 64 + longest + 16
    eng = Engine(EngineConfig(model=path, device="cpu", max_model_len=max_len, max_num_seqs=args.batch,
                              num_kv_blocks=args.batch * -(-max_len // 16) + 16,
                              max_num_batched_tokens=max(4096, 64 * args.batch)))
    eng.stream_deltas = stream_deltas
    enc, dec = OutputDeltas(stream_deltas), OutputsFromDeltas()
    rng = random.Random(0)
    for i in range(args.batch):
        eng.add_request([rng.randrange(3, 384) for _ in range(64)],
                        SamplingParams(temperature=0, max_tokens=longest, ignore_eos=True, logprobs=args.logprobs),
                        request_id=f"r{i}")
    spent = {"make_output": []}
    make_output = eng.make_output

    def timed(req):
        t0 = time.perf_counter()
        try:
            return make_output(req)
        finally:
            spent["make_output"][-1] += time.perf_counter() - t0
    eng.make_output = timed
    gc_s, gc_t0 = [0.0], [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            gc_s[0] += time.perf_counter() - gc_t0[0]
    gc.callbacks.append(on_gc)
    try:
        def step() -> tuple[float, float]:
            spent["make_output"].append(0.0)
            t0 = time.perf_counter()
            outs = eng.step()
            t1 = time.perf_counter()
            if not args.thread:
                pickle.dumps([enc.encode(o) for o in outs], protocol=pickle.HIGHEST_PROTOCOL)
            elif stream_deltas:     # a thread's outputs added up at once (the cumulative ones go as they are)
                outs = [dec.decode(enc.encode(o)) for o in outs]
            return t1 - t0, time.perf_counter() - t1

        label = "DELTA (stream_deltas)" if stream_deltas else "cumulative"
        if args.thread:
            label = "thread, added up" if stream_deltas else "thread, cumulative"
        for target in sorted(args.at):
            while min(len(r.output_token_ids) for r in eng.requests.values()) < target:
                step()
            spent["make_output"].clear()
            times = [step() for _ in range(args.window)]
            parts = "encode+decode" if args.thread else "encode+pickle"
            print(f"  {label:22s} out {target:5d}: step {statistics.median(t for t, _ in times) * 1e6:8.0f} us, "
                  f"make_output {statistics.median(spent['make_output']) * 1e6:7.0f}, "
                  f"{parts} {statistics.median(e for _, e in times) * 1e6:6.0f}", flush=True)
        print(f"  {label:22s} garbage collector: {gc_s[0]:.2f} s over the run")
    finally:
        gc.callbacks.remove(on_gc)
        eng.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--at", type=int, nargs="+", default=[100, 1000, 2000], help="output lengths to time at")
    p.add_argument("--window", type=int, default=10, help="steps timed at each length")
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--thread", action="store_true", help="the engine loop in the server's process (AsyncEngine)")
    args = p.parse_args()
    torch.set_num_threads(1)
    from serving_fixtures import build_tiny_chat_model
    path = os.path.join(tempfile.gettempdir(), "picovllm-served-outputs-model")
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        build_tiny_chat_model(path, max_position_embeddings=8192)
    print(f"batch {args.batch}, 64-token prompts, greedy, logprobs {args.logprobs}; median of {args.window} steps")
    for stream_deltas in (False, True):
        run(path, args, stream_deltas)


if __name__ == "__main__":
    main()
