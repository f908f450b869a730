"""Python's garbage collector and a long-lived engine: what exists before (the imports) and after start-up (the
engine, its graphs, the HTTP app) is taken out of the collector's reach, so that full collections stay short.

Full collections scan every tracked object: with torch, triton and transformers imported that is some 200k, ~100 ms a
pass, which stalled steady decoding every few seconds (BENCHMARKS.md, fourth and thirteenth sessions). Nothing here
imports torch: the server's front end uses it too.
"""
from __future__ import annotations

import gc

# Whether this process's first engine has frozen what existed before it: a fact about the process, so module state.
_frozen_at_first_engine = False


def freeze_before_first_engine() -> None:
    """The first engine of a process moves what exists before it (the imports; garbage is collected first) out of the
    collector's reach for good. Only the first: a later engine would freeze earlier engines still alive, which could
    then never be collected once dropped. A flag of ours, not gc.get_freeze_count(): an interpreter may freeze its
    own few hundred start-up objects (the GPU image does), which had made every engine there skip this, and one full
    collection over the ~200k cost a D engine 2 ms a step at batch 256."""
    global _frozen_at_first_engine
    if not _frozen_at_first_engine:
        _frozen_at_first_engine = True
        gc.collect()
        gc.freeze()


def freeze_for_serving() -> None:
    """A serving process, its engine built and its app about to serve until the process ends: collect, then take
    what exists out of the collector's reach, as the first engine did with the imports. The engine's warm-up, CUDA
    graphs and the HTTP app leave ~250k more objects (one H200, a Qwen3-0.6B shape), over which a full collection
    stalled the served engine ~140 ms every 10-15 s at 80 requests/s (BENCHMARKS.md, thirteenth session). Only
    where the engine lives as long as the process: a frozen object in a reference cycle is never collected."""
    gc.collect()
    gc.freeze()
