"""Structured outputs: per-token mask time of xgrammar and llguidance on the default model's vocabulary (49k) and on
a 151k vocabulary (the default one grown with made-up tokens to Qwen's size; no Qwen tokenizer is on this machine),
then the engine's decode throughput at batch 8, constrained (a JSON schema) vs not.

    python benchmarks/structured_output.py [--skip-llguidance] [--throughput-only] [--batch 8] [--tokens 64]
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


def throughput(batch: int, tokens: int) -> None:
    from picovllm import LLM, SamplingParams, StructuredOutputsParams
    llm = LLM()
    prompts = [f"Write item {i}:" for i in range(batch)]
    # regex of `tokens` tokens at least: both runs decode exactly `tokens` tokens per request
    so = StructuredOutputsParams(regex="[a-z ]{400}")
    runs = [("warm-up", {})] + [("plain", {}), ("regex", {"structured_outputs": so})] * 3   # interleaved: noise
    for name, extra in runs:
        sp = SamplingParams(temperature=1.0, seed=0, max_tokens=tokens, ignore_eos=True, **extra)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"batch {batch}, {name:7s}: {n} tokens in {dt:.2f} s = {n / dt:.1f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-llguidance", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--throughput-only", action="store_true")
    args = ap.parse_args()
    from picovllm.loader.source import open_model_source
    small = open_model_source(None).load_tokenizer()
    for tok in () if args.throughput_only else (small, grown_tokenizer(small, 151_646)):
        vocab = len(tok)
        for _ in range(2):   # the second round is warm
            report("xgrammar", vocab, xgrammar_times(tok, vocab, tok.encode(json.dumps(VALUE), add_special_tokens=False)))
            if not args.skip_llguidance:   # llguidance's compact JSON has no space after ':' and ','
                compact = json.dumps(VALUE, separators=(",", ":"))
                report("llguidance", vocab, llguidance_times(tok, vocab, tok.encode(compact, add_special_tokens=False)))
    throughput(args.batch, args.tokens)


if __name__ == "__main__":
    main()
