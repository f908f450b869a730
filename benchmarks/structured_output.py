"""Structured outputs: per-token mask time of xgrammar and llguidance on the default model's vocabulary (49k) and on
a 151k vocabulary (the default one grown with made-up tokens to Qwen's size; no Qwen tokenizer is on this machine),
then the engine's decode throughput at batch 8, constrained (a regex) vs not.

    python benchmarks/structured_output.py [--skip-llguidance] [--throughput-only] [--batch 8] [--tokens 64]
    python benchmarks/structured_output.py --host-profile [--batch 64] [--tokens 128] [--overlap] [--cprofile]
                                            [--fill-threads N]

--host-profile: the engine's host cost per constrained row and step, without the forward: the runner's
compute_logits returns fixed random logits, so a step is scheduling, inputs, masks, sampling and outputs only;
(constrained - plain) / (steps * rows) is what one constrained row adds to a step (on the CPU, the masked apply
runs on the host too). --overlap runs it under overlapped scheduling (late masks); --cprofile prints the
constrained run's top functions; --fill-threads sets the threads of xgrammar's batched mask fill.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

SCHEMA = {"type": "object", "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}}
VALUE = {"name": "Alice Smith", "age": 33, "tags": ["a", "b"]}


def grown_tokenizer(tok, size: int):
    """tok's vocabulary grown to `size` with concatenations of its own tokens (no merges reach them)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    d = json.loads(tok.backend_tokenizer.to_str())
    vocab, rng = d["model"]["vocab"], random.Random(0)
    keys = list(vocab)
    while len(vocab) < size:
        s = rng.choice(keys) + rng.choice(keys)
        if len(s) < 16:
            vocab.setdefault(s, len(vocab))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(d)), eos_token=tok.eos_token)


def xgrammar_times(tok, vocab: int, ids: list[int]) -> tuple[float, float, list[float]]:
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    t1 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    t2 = time.perf_counter()
    m, mask, times = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab), []
    for i in ids:
        s = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - s)
        assert m.accept_token(i)
    return t1 - t0, t2 - t1, times


def llguidance_times(tok, vocab: int, ids: list[int]) -> tuple[float, float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t1 = time.perf_counter()
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}))
    t2 = time.perf_counter()
    mask, times = lt.allocate_token_bitmask(1, vocab), []
    for i in ids:
        s = time.perf_counter()
        lt.fill_next_token_bitmask(m, mask, 0)
        times.append(time.perf_counter() - s)
        assert m.consume_token(i), m.get_error()
    return t1 - t0, t2 - t1, times


def report(name: str, vocab: int, result: tuple[float, float, list[float]]) -> None:
    setup, compile_s, times = result
    us = sorted(t * 1e6 for t in times)
    print(f"{name:10s} V={vocab:6d}: tokenizer table {setup * 1e3:6.0f} ms, compile {compile_s * 1e3:5.1f} ms, "
          f"mask median {statistics.median(us):6.1f} us, p90 {us[int(0.9 * len(us))]:6.1f} us, max {us[-1]:6.1f} us "
          f"({len(us)} tokens)")


REGEX = "[a-z ]{4000}"


def timed(obj, names: list[str], totals: dict[str, list]) -> None:
    """Replace obj's methods `names` with wrappers that add their wall time and calls to totals[name] (inclusive)."""
    for name in names:
        fn = getattr(obj, name)

        def wrapper(*a, _fn=fn, _name=name, **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                entry = totals.setdefault(_name, [0.0, 0])
                entry[0] += time.perf_counter() - t
                entry[1] += 1
        setattr(obj, name, wrapper)


def breakdown(llm, prompts, runs, tokens: int) -> None:
    """Host time per step of the engine's parts (inclusive, ms), for each (name, extra params) of `runs` (a plain
    and a constrained one): which part of a constrained step is the host's, and whether it waits for the device
    (resolve) or works."""
    from picovllm import SamplingParams
    from picovllm.engine import sampling
    from picovllm.layers import structured_output
    eng, totals = llm.engine, {}
    timed(eng, ["_schedule", "_prepare", "apply_results", "advance"], totals)
    timed(eng.grammar_masks, ["fill_late"], totals)
    timed(eng.executor, ["launch", "resolve"], totals)
    timed(eng.executor.runner, ["compute_logits", "launch_sampling"], totals)
    timed(structured_output.TokenBitmasks, ["fill", "to_device"], totals)
    timed(sampling, ["apply_token_bitmasks", "adjust_logits", "sample", "_logprob_tensors", "_to_host"], totals)
    timed(structured_output, ["mask_logits"], totals)
    for name, extra in runs:
        totals.clear()
        sp = SamplingParams(temperature=1.0, seed=0, max_tokens=tokens, ignore_eos=True, **extra)
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        print(f"== breakdown, {name}: {wall / tokens * 1e3:.3f} ms a step; per step (ms, inclusive):")
        for k, (sec, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
            print(f"   {k:18s} {sec / tokens * 1e3:7.3f}  ({calls} calls)")


def random_model_with_tokenizer(preset: str) -> str:
    """A "random:<config.json>" model path: `preset`'s shape (picovllm/bench/random_checkpoint.py) with the default
    model's tokenizer and vocabulary, saved beside the config, so grammars can be compiled for it."""
    import os
    import tempfile
    from picovllm.bench.random_checkpoint import resolve_config
    from picovllm.loader.source import open_model_source
    tok = open_model_source(None).load_tokenizer()
    cfg = resolve_config(preset)
    cfg.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    folder = os.path.join(tempfile.gettempdir(), f"picovllm_so_{preset}")
    tok.save_pretrained(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return "random:" + os.path.join(folder, "config.json")


def throughput(batch: int, tokens: int, cprofile: bool = False, fill_threads: int | None = None,
               show_breakdown: bool = False, repeats: int = 3, model: str | None = None) -> None:
    from picovllm import LLM, SamplingParams, StructuredOutputsParams
    from picovllm.layers import structured_output
    if fill_threads is not None:
        structured_output.FILL_THREADS = fill_threads    # read when the engine builds its mask buffers
    llm = LLM(model)
    print(f"model: {model or 'the default'} ({llm.engine.model_config.architecture})")
    prompts = [f"Write item {i}:" for i in range(batch)]
    # a regex no request completes within `tokens` tokens (a token spells 16 letters at most), so that both runs decode
    # exactly `tokens` tokens per request; with {400} some requests ended early (7,138 of 64 x 128 tokens on the
    # H200), and the shrinking batch, not the masks, cost some of the constrained rate
    so = StructuredOutputsParams(regex=REGEX)
    # both warmed up (the grammar's compile out of the timed runs), then interleaved: the host's load drifts
    pair = [("plain", {}), ("regex", {"structured_outputs": so})]
    runs = [("warm-up", {}), ("warm-up", {"structured_outputs": so})] + pair * repeats
    seconds: dict[str, float] = {"plain": 0.0, "regex": 0.0}
    for name, extra in runs:
        sp = SamplingParams(temperature=1.0, seed=0, max_tokens=tokens, ignore_eos=True, **extra)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        assert n == batch * tokens, f"{name}: {n} tokens, not {batch} x {tokens}"
        print(f"batch {batch}, {name:7s}: {n} tokens in {dt:.2f} s = {n / dt:.1f} tok/s")
        if name in seconds:
            seconds[name] += dt
    print(f"batch {batch}, {repeats} runs each: plain {batch * tokens * repeats / seconds['plain']:.1f} tok/s, "
          f"constrained {batch * tokens * repeats / seconds['regex']:.1f} tok/s: cost "
          f"{(1 - seconds['plain'] / seconds['regex']) * 100:.1f}% (1 - plain time / constrained time)")
    if show_breakdown:
        breakdown(llm, prompts, pair, tokens)
    if cprofile:        # where the host's time goes in a plain and a constrained run
        import cProfile
        import pstats
        for name, extra in pair:
            sp = SamplingParams(temperature=1.0, seed=0, max_tokens=tokens, ignore_eos=True, **extra)
            prof = cProfile.Profile()
            prof.runcall(llm.generate, prompts, sp, use_tqdm=False)
            print(f"== cProfile, {name}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def host_profile(batch: int, tokens: int, overlap: bool, cprofile: bool, fill_threads: int | None) -> None:
    import cProfile
    import pstats
    import torch
    from picovllm import LLM, SamplingParams, StructuredOutputsParams
    from picovllm.layers import structured_output
    if fill_threads is not None:
        structured_output.FILL_THREADS = fill_threads    # read when the engine builds its mask buffers
    llm = LLM(async_scheduling=overlap)
    runner = llm.engine.runner
    vocab = runner.model_config.vocab_size
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    letters = [i for i in (llm.get_tokenizer().convert_tokens_to_ids(c) for c in "abcdefghijklmnopqrstuvwxyz")]
    logits[:, letters] += 10     # greedy picks one letter a step: 128 tokens stay within the regex's 400
    logits = logits.to(runner.device)
    runner.compute_logits = lambda step, prev_tokens=None: logits[:step.num_logit_rows]    # no forward
    prompts = [f"Write item {i}:" for i in range(batch)]
    so = StructuredOutputsParams(regex=REGEX)
    runs = [("warm-up", {}), ("warm-up", {"structured_outputs": so})] + [("plain", {}), ("regex", {"structured_outputs": so})] * 3
    best: dict[str, float] = {}
    for name, extra in runs:
        sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, **extra)   # greedy: no seeded rows
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        print(f"batch {batch}, {name:7s}: {dt / tokens * 1e3:6.2f} ms a step (no forward)")
        best[name] = min(best.get(name, dt), dt)
    per_row = (best["regex"] - best["plain"]) / (tokens * batch)
    print(f"host cost of a constrained row: {per_row * 1e6:.1f} us a step (best of 3 each, overlap={overlap})")
    if cprofile:
        sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, structured_outputs=so)
        prof = cProfile.Profile()
        prof.runcall(llm.generate, prompts, sp, use_tqdm=False)
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-llguidance", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--throughput-only", action="store_true")
    ap.add_argument("--host-profile", action="store_true", help="host cost per constrained row (no forward)")
    ap.add_argument("--overlap", action="store_true", help="--host-profile under overlapped scheduling")
    ap.add_argument("--cprofile", action="store_true", help="the top functions of a constrained run (and, with --throughput-only, of a plain one)")
    ap.add_argument("--breakdown", action="store_true", help="host time per step of the engine's parts, plain and constrained")
    ap.add_argument("--fill-threads", type=int, help="threads of xgrammar's batched mask fill (default: the engine's choice)")
    ap.add_argument("--repeats", type=int, default=3, help="--throughput-only: timed runs of each, interleaved")
    ap.add_argument("--random-model", metavar="PRESET",
                    help="--throughput-only on random weights of a preset's shape (e.g. qwen3-0.6b, mistral-7b) "
                         "with the default model's tokenizer, instead of the default model")
    args = ap.parse_args()
    if args.host_profile:
        return host_profile(args.batch, args.tokens, args.overlap, args.cprofile, args.fill_threads)
    from picovllm.loader.source import open_model_source
    small = open_model_source(None).load_tokenizer()
    for tok in () if args.throughput_only else (small, grown_tokenizer(small, 151_646)):
        vocab = len(tok)
        for _ in range(2):   # the second round is warm
            report("xgrammar", vocab, xgrammar_times(tok, vocab, tok.encode(json.dumps(VALUE), add_special_tokens=False)))
            if not args.skip_llguidance:   # llguidance's compact JSON has no space after ':' and ','
                compact = json.dumps(VALUE, separators=(",", ":"))
                report("llguidance", vocab, llguidance_times(tok, vocab, tok.encode(compact, add_special_tokens=False)))
    model = random_model_with_tokenizer(args.random_model) if args.random_model else None
    throughput(args.batch, args.tokens, args.cprofile, args.fill_threads, args.breakdown, args.repeats, model)


if __name__ == "__main__":
    main()
