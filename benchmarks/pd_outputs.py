"""A P/D server's outputs on their way to the client, by output length: what each step costs for every running request
on the D server's HTTP side (each output encoded for its /pd stream: OutputEncoder, json.dumps) and on the proxy's or
router's (each line read back into a whole output: json.loads, OutputDecoder).

    python benchmarks/pd_outputs.py [--batch 256] [--at 100 1000 2000] [--steps 20] [--logprobs N] [--thread]

No model and no sockets. The outputs are made up as the D server's streams get them: by default from its engine
process (output_deltas.OutputsFromDeltas, fed OutputDeltas of one token a step: each output's lists are
outputs.ListPrefix views, which is also what a D server's engine loop in its own process hands out now: AsyncEngine
adds the deltas up there too); with --thread as such a loop handed them out before that (each output's lists new
copies, as Engine.make_output makes a cumulative output), for comparison. Each request's first output holds `length`
tokens of 5 characters already, then one token a step. Prints, per length, the median us a step of the encoder's
part, the decoder's and both, and the garbage collector's milliseconds within those parts over the timed steps (the
objects made before them collected first, as a running server's would have been long since).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from picovllm.disagg.messages import OutputDecoder, OutputEncoder  # noqa: E402
from picovllm.entrypoints.openai.output_deltas import OutputsFromDeltas  # noqa: E402
from picovllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput  # noqa: E402

PIECE = "word "     # each token's text
PROMPT = list(range(64))


def _logprobs(tokens: range, k: int | None) -> list | None:
    if k is None:
        return None
    return [{t: Logprob(-0.5, 1, PIECE), **{t + j: Logprob(-1.0 - j, j + 1, PIECE) for j in range(1, k + 1)}}
            for t in tokens]


class _Request:
    """One running request's outputs as the D server's stream gets them, a token a step."""

    def __init__(self, rid: str, length: int, k: int | None, thread: bool) -> None:
        self.rid, self.k, self.thread = rid, k, thread
        self.tokens, self.logprobs = list(range(length)), _logprobs(range(length), k)
        self.metrics = RequestMetrics(0.0, 0.0, 0.0, None, [0.0] * length)
        self.api = OutputsFromDeltas()

    def first(self) -> RequestOutput:
        comp = CompletionOutput(0, PIECE * len(self.tokens), list(self.tokens), None if self.k is None else -1.0,
                                None if self.logprobs is None else list(self.logprobs))
        out = RequestOutput(self.rid, None, PROMPT, [comp], False, self.metrics)
        return out if self.thread else self.api.decode(out)

    def next(self, finished: bool) -> RequestOutput:
        at = len(self.tokens)
        new_logprobs = _logprobs(range(at, at + 1), self.k)
        self.tokens.append(at)
        if self.logprobs is not None:
            self.logprobs += new_logprobs
        self.metrics.token_times.append(float(at))
        if finished:
            self.metrics.finished_time = float(at)
        reason = "length" if finished else None
        if self.thread:      # a cumulative output as Engine.make_output makes it: its lists copied
            comp = CompletionOutput(0, PIECE * len(self.tokens), self.tokens[:], None if self.k is None else -1.0,
                                    None if self.logprobs is None else self.logprobs[:], reason)
            return RequestOutput(self.rid, None, PROMPT, [comp], finished, self.metrics)
        return self.api.decode((self.rid, [at], at * len(PIECE), PIECE, new_logprobs, None if self.k is None else -1.0,
                                reason, None, finished, None, 0, self.metrics if finished else None, None))


def run(length: int, args) -> tuple[list[float], list[float], float]:
    reqs = [_Request(f"r{i}", length, args.logprobs, args.thread) for i in range(args.batch)]
    encoders = [OutputEncoder() for _ in reqs]
    decoders = [OutputDecoder() for _ in reqs]
    gc_ms, gc_t0, timing = [0.0], [0.0], [False]

    def on_gc(phase: str, info: dict) -> None:
        if not timing[0]:
            return
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            gc_ms[0] += (time.perf_counter() - gc_t0[0]) * 1e3

    def step(outs: list[RequestOutput]) -> tuple[float, float]:
        """One step's outputs encoded into their lines, then decoded: (seconds of the one, of the other)."""
        timing[0] = True
        t0 = time.perf_counter()
        lines = [json.dumps(enc.encode(out)) for enc, out in zip(encoders, outs)]
        t1 = time.perf_counter()
        for dec, line in zip(decoders, lines):
            dec.decode(json.loads(line))
        t2 = time.perf_counter()
        timing[0] = False
        return t1 - t0, t2 - t1

    step([r.first() for r in reqs])
    for _ in range(3):      # warm-up
        step([r.next(False) for r in reqs])
    gc.collect()
    gc_ms[0] = 0.0
    gc.callbacks.append(on_gc)
    try:
        times = [step([r.next(False) for r in reqs]) for _ in range(args.steps)]
    finally:
        gc.callbacks.remove(on_gc)
    step([r.next(True) for r in reqs])
    return [e for e, _ in times], [d for _, d in times], gc_ms[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256, help="running requests (streams)")
    p.add_argument("--at", type=int, nargs="+", default=[100, 1000, 2000], help="output lengths to time at")
    p.add_argument("--steps", type=int, default=20, help="steps timed at each length")
    p.add_argument("--logprobs", type=int, default=None, help="top logprobs (each token's logprobs: N + 1)")
    p.add_argument("--thread", action="store_true", help="outputs as an engine loop in the server's process made "
                                                         "them before it added deltas up (lists copied)")
    args = p.parse_args()
    gc.collect()
    gc.freeze()         # the imports, as the server's freeze_for_serving takes them out of the collector's reach
    source = "engine loop in the server process" if args.thread else "engine process"
    print(f"batch {args.batch}, outputs from an {source}, logprobs {args.logprobs}; median of {args.steps} steps")
    for length in args.at:
        enc, dec, gc_ms = run(length, args)
        us = [statistics.median(t) * 1e6 for t in ([e + d for e, d in zip(enc, dec)], enc, dec)]
        print(f"  out {length:5d}: step {us[0]:7.0f} us (encode {us[1]:6.0f}, decode {us[2]:6.0f}), "
              f"GC {gc_ms:6.1f} ms over {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
