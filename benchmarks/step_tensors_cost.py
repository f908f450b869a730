"""Host cost of an eager step's input tensors (engine/step_input.step_tensors): the CPU's steps, enforce_eager and the
GPU's piecewise steps build them every step; microseconds, median of --iters.

    python benchmarks/step_tensors_cost.py                        # batch 256 decodes, 2,000-token contexts
    python benchmarks/step_tensors_cost.py --batch 64 --context 4096

Steady decoding: the same requests step after step, 1 row in --grow-every gaining a block each step (a decoding row
gains one every block_size tokens). Two ways: every block table converted anew (no StagedTables), and staged (the
model runner's kept array, writing only what each table gained).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from picovllm.engine.cuda_graph import StagedTables
from picovllm.engine.step_input import StepInput, step_tensors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--grow-every", type=int, default=16)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    b, bs = args.batch, args.block_size
    blocks = -(-(args.context + 1) // bs)
    tables = [list(range(i * 10 * blocks, i * 10 * blocks + blocks)) for i in range(b)]
    step = StepInput(input_ids=list(range(b)), positions=[args.context] * b, slot_mapping=list(range(b)),
                     query_start_loc=list(range(b + 1)), seq_lens=[args.context + 1] * b, block_tables=tables,
                     num_decodes=b, sample_indices=list(range(b)), sampling=[])
    cpu = torch.device("cpu")
    for name, staged in (("anew", None), ("staged", StagedTables(b, blocks + args.iters + 8))):
        times = []
        for it in range(args.iters + 5):
            for row in range(it % args.grow_every, b, args.grow_every):   # a block gained, in place
                tables[row].append(tables[row][-1] + 1)
            t0 = time.perf_counter()
            step_tensors(step, cpu, staged=staged)
            if it >= 5:
                times.append(time.perf_counter() - t0)
        print(f"batch {b}, {args.context}-token contexts, {name:6}: {statistics.median(times) * 1e6:8.1f} us a step")


if __name__ == "__main__":
    main()
