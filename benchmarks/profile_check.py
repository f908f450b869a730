"""The planner's step profile against steps it did not sample: mixed steps of a whole chunk beside many decodes (what
a burst of arrivals runs), decode-only steps between the sampled batches, and repeated lone prompts (the profile's
prefill samples are medians of 7). Each is timed as measure_profile times its own samples (same engine, overlapped as
served) and set beside the fitted profile's step_time.

    python benchmarks/profile_check.py OUT_DIR [--preset qwen3-0.6b --dtype bfloat16 --num-kv-blocks 16384]

The engine is the planner benchmark's (benchmarks/planner_vs_measured.py: 16-token blocks, 512-token chunks,
max_model_len 1024); OUT_DIR gets the checkpoint and profile.json.
"""
import argparse
import json
import os
import sys

import numpy as np

from picovllm.bench.random_checkpoint import make_random_checkpoint, resolve_config, write_word_tokenizer
from picovllm.config import EngineConfig
from picovllm.engine.llm_engine import Engine
from picovllm.planner.profile import _mixed_sample, _timed_prompt, decode_sample, measure_profile


def checks(engine, a, base: int) -> list[tuple[str, dict]]:
    """The steps to check, timed; base: where their prompts' tokens start (each run's prompts its own)."""
    rows = []
    for k, spec in enumerate(a.mixed):
        b, n = map(int, spec.split(":"))
        rows.append(("mixed", _mixed_sample(engine, b, n, a.repeats, first_token=base + 400 + 70 * k)))
    for b in a.decode:
        rows.append(("decode", decode_sample(engine, [[i + base + 900] * 512 for i in range(b)], a.repeats)))
    for j, n in enumerate(a.prefill):
        times = [_timed_prompt(engine, [base + 2000 + 37 * j + i] * n) for i in range(a.repeats)]
        rows.append(("prefill", {"prefill": n, "batch": 0, "context": 0, "seconds": float(np.median(times)),
                                 "all_ms": [round(t * 1e3, 2) for t in times]}))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--preset", default="tiny-qwen3")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--mixed", nargs="+", default=["8:504", "16:496", "32:480", "48:464", "64:448"],
                   help="BATCH:PREFILL mixed steps to time")
    p.add_argument("--decode", type=int, nargs="+", default=[8, 24, 48, 64], help="decode-only batches (512 tokens)")
    p.add_argument("--prefill", type=int, nargs="+", default=[128, 384, 512], help="lone prompts to time")
    p.add_argument("--check-first", action="store_true", help="time the checks before the profile too")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model = make_random_checkpoint(os.path.join(a.out, "model"), a.preset, a.dtype, 0)
    write_word_tokenizer(model, resolve_config(a.preset)["vocab_size"])
    engine = Engine(EngineConfig(model=model, dtype=a.dtype, block_size=16, max_num_batched_tokens=512,
                                 max_model_len=1024, num_kv_blocks=a.num_kv_blocks))
    early = checks(engine, a, 0) if a.check_first else []
    prof = measure_profile(engine)
    prof.save(os.path.join(a.out, "profile.json"))
    print(f"profile of {prof.machine}: coef (ms) {[round(c * 1e3, 4) for c in prof.coef]}")
    for s in prof.samples:
        print(f"  sampled  prefill {s['prefill']:4d} batch {s['batch']:3d} context {s['context']:6d}: "
              f"{s['seconds'] * 1e3:7.3f} ms, fit {prof.step_time(s['prefill'], s['batch'], s['context']) * 1e3:7.3f}")
    rows = [(f"{kind}, before", s) for kind, s in early] + checks(engine, a, 3000)
    for kind, s in rows:
        fit = prof.step_time(s["prefill"], s["batch"], s["context"])
        print(f"  {kind:8s} prefill {s['prefill']:4d} batch {s['batch']:3d} context {s['context']:6d}: "
              f"{s['seconds'] * 1e3:7.3f} ms, fit {fit * 1e3:7.3f} ({(fit / s['seconds'] - 1) * 100:+.0f}%)"
              + (f"  all {s['all_ms']}" if "all_ms" in s else ""))
    with open(os.path.join(a.out, "profile_check.json"), "w") as f:
        json.dump({"coef": prof.coef, "checked": [dict(s, kind=k) for k, s in rows]}, f, indent=1)
    print(f"blocks free: {engine.scheduler.block_manager.num_free_blocks} of {a.num_kv_blocks}", file=sys.stderr)


if __name__ == "__main__":
    main()
