"""TTFT of a request whose 2,000-token prefix is cached vs not (issue 7).

    python benchmarks/prefix_cache_ttft.py                       # default model, CPU fp32
    python benchmarks/prefix_cache_ttft.py --model DIR --trials 10   # e.g. a random Qwen3-0.6B-shaped folder on GPU

Each trial: a fresh 2,000-token random prefix plus a 32-token suffix, max_tokens=1. Cold: the prefix was
never seen. Warm: the same prefix was computed by an earlier request with another suffix, so only the
suffix (and the partial last block) is prefilled. TTFT is first-token time minus arrival time.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics

from picovllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    args = ap.parse_args()
    llm = LLM(args.model, max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=4096)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    toks = lambda n: [rng.randrange(100, min(vocab, 10000)) for _ in range(n)]
    llm.generate([toks(64)], params, use_tqdm=False)  # warm-up
    cold, warm, hits = [], [], []
    for _ in range(args.trials):
        prefix = toks(args.prefix_len)
        a = llm.generate([prefix + toks(args.suffix_len)], params, use_tqdm=False)[0]
        b = llm.generate([prefix + toks(args.suffix_len)], params, use_tqdm=False)[0]
        cold.append(a.metrics.ttft * 1e3)
        warm.append(b.metrics.ttft * 1e3)
        hits.append(b.num_cached_tokens)
    res = {"device": llm.config.device, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
           "cold_ttft_ms_mean": round(statistics.mean(cold), 2), "warm_ttft_ms_mean": round(statistics.mean(warm), 2),
           "speedup": round(statistics.mean(cold) / statistics.mean(warm), 2), "warm_cached_tokens": hits}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
