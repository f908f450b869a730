"""A served engine's steps (PICOVLLM_STEP_LOG) beside the planner's step profile: is a served step what the profile
says it is?

    PICOVLLM_STEP_LOG=/tmp/steps picovllm serve ...            # or any run; one file a process: /tmp/steps.<pid>
    python benchmarks/step_log.py /tmp/steps.<pid> --profile profile.json [--bench bench.json] [--top 15]

Each step that has decodes follows one with no idle between (a running request is scheduled every step), so the
time from the step before it to it is the step before's period as served: the engine's step plus whatever the
serving loop did in between (outputs to the HTTP side, new requests in). Printed: the served period over the
profile's step_time of the step before, by kind of step and decode batch; the
`--top` periods furthest above the profile, with what ran and how many requests waited; with `--bench` (a `picovllm
bench serve` result), the requests that arrived in those windows. Where the log has them (an overlapped engine's),
each of those periods is taken apart: prepare (from planning the step to its inputs built), launch (to the launch's
return), wait (reading the step before's result: the device still on it), apply (its outputs), loop (the serving
loop until the next step: outputs out, commands in) and the engine thread's CPU time over the period; and the
process's garbage collections (PATH.gc beside the log) that started in each; and the medians of those parts by the
step's number of sequences.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, ".")
from picovllm.planner.profile import StepProfile  # noqa: E402


def breakdown(prev: list, cur: list) -> tuple | None:
    """The period from prev's planning to cur's, in ms: prepare, launch, wait, apply, loop, and the engine thread's CPU
    time (None where the log has no marks: an older log, or a step that was not launched overlapped)."""
    if len(prev) < 10 or None in prev[7:10] or len(cur) < 10:
        return None
    t, launched, read, returned = prev[0], prev[7], prev[8], prev[9]
    prepared = prev[10] if len(prev) > 10 and prev[10] is not None else t
    return tuple(1e3 * x for x in (prepared - t, launched - prepared, read - launched, returned - read,
                                   cur[0] - returned, cur[6] - prev[6]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log")
    p.add_argument("--profile", required=True)
    p.add_argument("--bench", default=None)
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    steps = json.load(open(a.log))
    prof = StepProfile.load(a.profile)
    rows = []     # (time, period, predicted, prefill, decodes, waiting, breakdown ms or None, sequences)
    for prev, cur in zip(steps, steps[1:]):
        t, prefill, decodes, _, waiting, context = cur[:6]
        if decodes == 0:
            continue          # the engine may have idled before it
        # from planning the step before to planning this one: the step before ran (overlapped, it was launched and
        # the one before it read); predicted as the simulator does, with the serving loop's cost a sequence and an
        # admission (a log before the admissions were recorded: none)
        admitted = prev[11] if len(prev) > 11 else 0
        predicted = prof.step_time(prev[1], prev[2], prev[5]) + prof.serve_per_seq * prev[3] \
            + prof.serve_per_admission * admitted
        rows.append((t, t - prev[0], predicted, prev[1], prev[2], waiting, breakdown(prev, cur), prev[3]))
    if not rows:
        raise SystemExit("no back-to-back steps in the log")
    print(f"{len(steps)} steps, {len(rows)} back to back; served period / profile's step time:")
    print(f"{'steps':<28}{'n':>6}{'median':>8}{'p90':>8}{'p99':>8}{'served p50 ms':>15}")
    groups = {"decode-only": lambda r: r[3] == 0, "mixed (chunk + decodes)": lambda r: r[3] > 0}
    for lo, hi in ((1, 8), (9, 32), (33, 96), (97, 10 ** 9)):
        groups[f"  decodes {lo}-{hi if hi < 10 ** 9 else 'more'}"] = lambda r, lo=lo, hi=hi: lo <= r[4] <= hi
    groups["with requests waiting"] = lambda r: r[5] > 0
    for name, keep in groups.items():
        sel = [r for r in rows if keep(r)]
        if sel:
            ratio = np.array([r[1] / r[2] for r in sel])
            print(f"{name:<28}{len(sel):>6}{np.median(ratio):>8.2f}{np.percentile(ratio, 90):>8.2f}"
                  f"{np.percentile(ratio, 99):>8.2f}{np.median([r[1] for r in sel]) * 1e3:>15.2f}")
    parts = ("prepare", "launch", "wait", "apply", "loop", "cpu")
    marked = [r for r in rows if r[6]]
    if marked:
        print("\neach part of a served period (ms, medians), by the step's sequences:")
        print(f"{'sequences':<12}{'n':>7}" + "".join(f"{p:>9}" for p in parts) + f"{'period':>9}")
        for lo, hi in ((1, 2), (3, 8), (9, 16), (17, 32), (33, 64), (65, 10 ** 9)):
            sel = [r for r in marked if lo <= r[7] <= hi]
            if sel:
                med = np.median([r[6] for r in sel], axis=0)
                print(f"{f'{lo}-{hi}' if hi < 10 ** 9 else f'{lo}+':<12}{len(sel):>7}"
                      + "".join(f"{x:>9.3f}" for x in med) + f"{np.median([r[1] for r in sel]) * 1e3:>9.3f}")
    t0 = steps[0][0]
    worst = sorted(rows, key=lambda r: r[1] - r[2], reverse=True)[:a.top]
    print(f"\nthe {len(worst)} periods furthest above the profile (t from the log's first step):")
    gcs = []     # the process's garbage collections (start, generation, seconds), where the log has them
    if os.path.exists(a.log + ".gc"):
        gcs = [g[:3] for g in json.load(open(a.log + ".gc"))]
        full = [g[2] * 1e3 for g in gcs if g[1] == 2]
        print(f"\n{len(gcs)} garbage collections, {len(full)} of every generation"
              + (f" (ms: median {np.median(full):.2f}, max {max(full):.2f})" if full else ""))
    print(f"{'t s':>9}{'served ms':>10}{'profile ms':>11}{'prompt tok':>11}{'decodes':>8}{'waiting after':>14}"
          + "".join(f"{p:>8}" for p in parts) + ("   gc in the period (generation: ms)" if gcs else ""))
    for r in sorted(worst):
        inside = [f"{g[1]}: {g[2] * 1e3:.2f}" for g in gcs if r[0] - r[1] <= g[0] <= r[0]]
        print(f"{r[0] - t0:>9.3f}{r[1] * 1e3:>10.2f}{r[2] * 1e3:>11.2f}{r[3]:>11}{r[4]:>8}{r[5]:>14}"
              + ("".join(f"{x:>8.2f}" for x in r[6]) if r[6] else " " * 8 * len(parts))
              + ("   " + ", ".join(inside) if inside else ""))
    if a.bench:
        bench = json.load(open(a.bench))
        if "start_time" not in bench:
            raise SystemExit(f"--bench {a.bench}: no start_time (a result of a bench serve before it had one)")
        reqs = [q for q in bench["requests"] if q.get("success")]
        print("\nrequests sent within 50 ms before each of those periods:")
        for r in sorted(worst):
            near = [q for q in reqs if r[0] - 0.05 <= bench["start_time"] + q["start"] <= r[0]]
            print(f"{r[0] - t0:>9.3f}: {len(near)} sent, their TTFT {[round(q['ttft'] * 1e3, 1) for q in near]}")


if __name__ == "__main__":
    main()
