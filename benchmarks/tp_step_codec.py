"""Host cost of one tensor-parallel step message: encode on rank 0 + decode on a worker, in microseconds.

    python benchmarks/tp_step_codec.py                  # batch 256 decodes, 1024-token contexts
    python benchmarks/tp_step_codec.py --batch 64 --context 4096

Builds the RunStep that TP rank 0 broadcasts for a decode step (what the workers receive: no sampling
rows) and times picovllm.engine.messages.encode and decode on it; median of --iters runs.
"""
from __future__ import annotations

import argparse
import statistics
import time

from picovllm.engine.messages import RunStep, decode, encode
from picovllm.engine.model_runner import StepInput


def decode_step(batch: int, context: int, block_size: int) -> StepInput:
    """A decode-only step: every sequence at `context` tokens, block tables of distinct blocks."""
    blocks = -(-(context + 1) // block_size)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    pos = [context] * batch
    slots = [t[context // block_size] * block_size + context % block_size for t in tables]
    return StepInput(input_ids=[1000 + i for i in range(batch)], positions=pos, slot_mapping=slots,
                     query_start_loc=list(range(batch + 1)), seq_lens=[context + 1] * batch,
                     block_tables=tables, num_decodes=batch, sample_indices=list(range(batch)), sampling=[],
                     prev_dst=list(range(batch)), prev_src=list(range(batch)))


def time_us(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    msg = RunStep(decode_step(args.batch, args.context, args.block_size))
    data = encode(msg)
    assert decode(data) == msg
    enc = time_us(lambda: encode(msg), args.iters)
    dec = time_us(lambda: decode(data), args.iters)
    print(f"batch {args.batch}, context {args.context}, block_size {args.block_size}: {len(data)} bytes, "
          f"encode {enc:.1f} us, decode {dec:.1f} us, total {enc + dec:.1f} us")


if __name__ == "__main__":
    main()
