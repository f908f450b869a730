"""A served engine's outputs in the API server's process, by output length: what it does each step for every
running request when the engine runs in a process of its own (engine_process.py). The reader thread's part (the
step's message unpickled, each OutputDelta applied to its request's output: PipeEngineClient._take) and the event
loop's (the outputs handed to their streams, each stream's chat handler making its SSE chunk: ChatHandler._events).

    python benchmarks/api_outputs.py [--batch 256] [--at 100 1000 2000] [--steps 20] [--logprobs N] [--n N]

No model and no sockets: the messages are made up as a colocated engine process sends them (OutputDeltas with
Engine.stream_deltas): each request's first output whole, holding `length` tokens of 5 characters already, then one
token a step; the SSE strings are made and dropped. Prints, per length, the median us a step of the reader's part,
the event loop's and both, and the garbage collector's milliseconds over the timed steps (the objects made before
them collected first, as a running server's would have been long since).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import pickle
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from picovllm.entrypoints.openai.engine_client import (AddRequest, CommandAnswer, EngineStats,  # noqa: E402
                                                       StepOutputs)
from picovllm.entrypoints.openai.engine_process import PipeEngineClient  # noqa: E402
from picovllm.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402

PIECE = "word "     # each token's text


class _Sink:
    """The commands' pipe: every add is accepted at once, its engine id kept (the samples' outputs are sent under
    them)."""

    def __init__(self) -> None:
        self.client: PipeEngineClient | None = None
        self.added: list[str] = []

    def send(self, cmd) -> None:
        if isinstance(cmd, AddRequest):
            self.added.append(cmd.request_id)
            self.client._loop.call_soon(self.client._answer, CommandAnswer(cmd.request_id, None))


class _Client(PipeEngineClient):
    """PipeEngineClient without its reader thread: the benchmark hands it each step's message itself."""

    @property
    def is_running(self) -> bool:
        return True

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()


def _logprobs(tokens: range, k: int | None) -> list | None:
    if k is None:
        return None
    return [{t: Logprob(-0.5, 1, PIECE), **{t + j: Logprob(-1.0 - j, j + 1, PIECE) for j in range(1, k + 1)}}
            for t in tokens]


def _first(rid: str, length: int, k: int | None) -> RequestOutput:
    """A request's first output as the engine process sends it: whole, `length` tokens so far."""
    comp = CompletionOutput(0, PIECE * length, list(range(length)), None if k is None else -1.0,
                            _logprobs(range(length), k))
    return RequestOutput(rid, None, list(range(64)), [comp], False)


def _delta(rid: str, at: int, k: int | None, finished: bool) -> tuple:
    """The token after `at` tokens as output_deltas._output_delta makes it (OUTPUT_DELTA's fields)."""
    return (rid, [at], at * len(PIECE), PIECE, _logprobs(range(at, at + 1), k), None if k is None else -1.0,
            "length" if finished else None, None, finished, None, 0, None, None)


async def _serve(handler, req, group, made: list[int]) -> None:
    """One request's SSE stream, read as the HTTP response would (made[0]: the chunks so far, over every request)."""
    async for _ in handler._events(req, group, req.num_logprobs, req.tool_policy(), None, False):
        made[0] += 1


async def run(length: int, args) -> tuple[list[float], list[float], float]:
    from picovllm.entrypoints.openai.protocol import ChatCompletionRequest
    from picovllm.entrypoints.openai.serving import SampleGroup, ServingContext
    from picovllm.entrypoints.openai.serving_chat import ChatHandler
    from picovllm.entrypoints.parallel_sampling import sample_params

    sink = _Sink()
    client = sink.client = _Client(sink, None)
    client.start()
    handler = ChatHandler(ServingContext(client, None, None, "m"))
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True, n=args.n,
                                logprobs=args.logprobs is not None, top_logprobs=args.logprobs)
    params = req.sampling_params(None, req.num_logprobs)
    made, tasks = [0], []
    for _ in range(args.batch):
        group = await SampleGroup(handler.ctx, list(range(64)), sample_params(params), "chatcmpl-b", 0.0).start()
        tasks.append(asyncio.ensure_future(_serve(handler, req, group, made)))

    async def step(items: list) -> tuple[float, float]:
        """One step's message through the reader's part, then the event loop's until every stream has sent its
        chunk: (seconds of the one, of the other)."""
        want = made[0] + len(items)
        msg = pickle.dumps(StepOutputs(items, EngineStats()), protocol=pickle.HIGHEST_PROTOCOL)
        t0 = time.perf_counter()
        client._take(pickle.loads(msg))
        t1 = time.perf_counter()
        while made[0] < want:
            await asyncio.sleep(0)
        return t1 - t0, time.perf_counter() - t1

    await step([_first(rid, length, args.logprobs) for rid in sink.added[:args.batch]])
    if args.n > 1:      # the siblings are added at the first sample's first output
        while len(sink.added) < args.batch * args.n:
            await asyncio.sleep(0)
        await step([_first(rid, length, args.logprobs) for rid in sink.added[args.batch:]])
    rids = sink.added
    for s in range(3):      # warm-up
        await step([_delta(rid, length + s, args.logprobs, False) for rid in rids])
    gc_ms, gc_t0 = [0.0], [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            gc_ms[0] += (time.perf_counter() - gc_t0[0]) * 1e3
    gc.collect()
    gc.callbacks.append(on_gc)
    try:
        times = [await step([_delta(rid, length + 3 + s, args.logprobs, False) for rid in rids])
                 for s in range(args.steps)]
    finally:
        gc.callbacks.remove(on_gc)
    await step([_delta(rid, length + 3 + args.steps, args.logprobs, True) for rid in rids])
    await asyncio.gather(*tasks)
    return [r for r, _ in times], [e for _, e in times], gc_ms[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256, help="requests (each of n samples)")
    p.add_argument("--at", type=int, nargs="+", default=[100, 1000, 2000], help="output lengths to time at")
    p.add_argument("--steps", type=int, default=20, help="steps timed at each length")
    p.add_argument("--logprobs", type=int, default=None, help="top_logprobs (each token's logprobs: N + 1)")
    p.add_argument("--n", type=int, default=1, help="samples a request")
    args = p.parse_args()
    gc.collect()
    gc.freeze()         # the imports, as the server's freeze_for_serving takes them out of the collector's reach
    print(f"batch {args.batch} x n {args.n}, chat streaming, logprobs {args.logprobs}; median of {args.steps} steps")
    for length in args.at:
        reader, loop, gc_ms = asyncio.run(run(length, args))
        both = [r + e for r, e in zip(reader, loop)]
        us = [statistics.median(t) * 1e6 for t in (both, reader, loop)]
        print(f"  out {length:5d}: step {us[0]:7.0f} us (reader {us[1]:6.0f}, event loop {us[2]:6.0f}), "
              f"GC {gc_ms:6.1f} ms over {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
