"""Host cost of one tensor-parallel step message: encode on rank 0 + decode on a worker, in microseconds.

    python benchmarks/tp_step_codec.py                  # batch 256 decodes, 2,000-token contexts
    python benchmarks/tp_step_codec.py --batch 64 --context 4096

Builds the RunStep that TP rank 0 broadcasts for a decode step (what the workers receive: no sampling
rows) and times picovllm.engine.messages.encode and decode on it, median of --iters runs, two ways:
- whole: every block table sent in full, as to a worker that holds none (a step after many new requests);
- deltas: steady decoding, the same requests step after step, 1 row in --grow-every gaining a block each step
  (a decoding row gains one every block_size tokens): only the new entries travel (engine/step_codec.py).
"""
from __future__ import annotations

import argparse
import statistics
import time

from picovllm.engine.messages import RunStep, decode, encode
from picovllm.engine.model_runner import StepInput
from picovllm.engine.step_codec import ReceivedTables, SentTables


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


def time_deltas(msg: RunStep, iters: int, grow_every: int) -> tuple[float, float, int]:
    """(encode us, decode us, median frame bytes) over iters steps of one rank 0 / worker pair."""
    sent, received = SentTables(), ReceivedTables()
    decode(encode(msg, sent), received)      # the first step: every table whole
    tables, next_block = msg.step.block_tables, 1 << 30
    enc, dec, sizes = [], [], []
    for step in range(iters):
        for table in tables[step % grow_every::grow_every]:   # in place, as BlockManager.allocate does
            table.append(next_block)
            next_block += 1
        t0 = time.perf_counter()
        data = encode(msg, sent)
        t1 = time.perf_counter()
        got = decode(data, received)
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
        sizes.append(len(data))
        assert got.step.block_tables == tables
    return statistics.median(enc) * 1e6, statistics.median(dec) * 1e6, int(statistics.median(sizes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--grow-every", type=int, default=16, help="1 row in this many gains a block each step")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    msg = RunStep(decode_step(args.batch, args.context, args.block_size))
    data = encode(msg)
    assert decode(data) == msg
    enc = time_us(lambda: encode(msg), args.iters)
    dec = time_us(lambda: decode(data), args.iters)
    print(f"batch {args.batch}, context {args.context}, block_size {args.block_size}")
    print(f"  whole:  {len(data)} bytes, encode {enc:.1f} us, decode {dec:.1f} us, total {enc + dec:.1f} us")
    enc, dec, size = time_deltas(msg, args.iters, args.grow_every)
    print(f"  deltas: {size} bytes, encode {enc:.1f} us, decode {dec:.1f} us, total {enc + dec:.1f} us "
          f"(1 row in {args.grow_every} gaining a block a step)")


if __name__ == "__main__":
    main()
