"""`picovllm bench latency`: batch-1 decode latency, single-prompt prefill throughput, time to first token.

decode:  one request, an --input-len token prompt, --output-len output tokens (EOS ignored); reports
         ms per output token after the first (the inter-token latency) and the time to first token (cold).
prefill: one --prefill-len token prompt, one output token; reports prompt tokens per second.
ttft, cached prefix: a --prefix-len token prompt is run once, then that prompt plus --suffix-len new tokens:
         the second's time to first token (only the suffix and the prefix's last partial block are computed).
ttft, under load: --load-seqs requests (--input-len prompts) decoding, then one more --input-len prompt: its
         time to first token, while the others keep decoding.
Prompts are random token ids, fresh for every iteration (so the prefix cache never helps); the
median over --num-iters is reported, after one warm-up of each.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from picovllm.bench.throughput import _sync, emit_json, model_label, model_path
from picovllm.entrypoints.commands.args import add_model_and_engine_args, engine_kwargs


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("latency", help="batch-1 decode ms/token and long-prompt prefill tok/s",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prefill-len", type=int, default=None,
                   help="clamped to max_model_len - 1 (default: 8192 on a GPU, 2048 on the CPU)")
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--prefix-len", type=int, default=None,
                   help="cached-prefix TTFT: clamped to max_model_len - 8 (default: 4096 on a GPU, 1024 on the CPU)")
    p.add_argument("--suffix-len", type=int, default=2)
    p.add_argument("--load-seqs", type=int, default=None,
                   help="TTFT under load: requests decoding meanwhile (default: 32 on a GPU, 8 on the CPU)")
    p.add_argument("--random-model", metavar="CONFIG", default=None,
                   help="random weights of this shape (a preset such as qwen3-0.6b, or a config.json)")
    p.add_argument("--random-model-dtype", default="bfloat16")
    p.add_argument("--output-json", default=None)
    add_model_and_engine_args(p)
    p.set_defaults(func=run, max_num_batched_tokens=None)   # None: the whole prefill prompt in one step


# the sizes whose defaults depend on the device: (on a GPU, on the CPU)
CPU_SIZED = {"prefill_len": (8192, 2048), "prefix_len": (4096, 1024), "load_seqs": (32, 8)}


def resolve_sizes(args: argparse.Namespace) -> None:
    """The device-sized flags left unset, set: a GPU's sizes, or the CPU's (a run of about a minute on the default
    model, where the GPU's took many)."""
    import torch
    gpu = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    for name, sizes in CPU_SIZED.items():
        if getattr(args, name) is None:
            setattr(args, name, sizes[0] if gpu else sizes[1])


def _first_token_ms(engine, prompt: list[int]) -> tuple[float, int]:
    """Time to the first (and only) token of `prompt` while other requests keep stepping; the prompt tokens
    computed for it."""
    from picovllm.sampling_params import SamplingParams
    _sync()
    before = engine.stats.prefill_tokens
    t0 = time.time()
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return (out.metrics.token_times[0] - t0) * 1e3, engine.stats.prefill_tokens - before


def _ttft_cached(engine, prompt, prefix_len: int, suffix_len: int) -> tuple[float, int]:
    prefix = prompt(prefix_len)
    _run_one(engine, prefix, 1)                              # computes and caches the prefix's blocks
    return _first_token_ms(engine, prefix + prompt(suffix_len))


def _ttft_under_load(engine, prompt, input_len: int, load_seqs: int, max_len: int) -> float:
    from picovllm.sampling_params import SamplingParams
    load = [engine.add_request(prompt(input_len), SamplingParams(max_tokens=max_len - input_len, ignore_eos=True))
            for _ in range(load_seqs)]
    while any(not engine.requests[r].output_token_ids for r in load if r in engine.requests):
        engine.step()                                        # until all of them decode
    try:
        return _first_token_ms(engine, prompt(input_len))[0]
    finally:
        for rid in load:
            engine.abort(rid)


def _run_one(engine, prompt: list[int], max_tokens: int):
    from picovllm.sampling_params import SamplingParams
    _sync()
    t0 = time.time()
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    final = None
    while final is None:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    _sync()
    return final, t0, time.time()


def run_latency(args: argparse.Namespace) -> dict:
    from picovllm.entrypoints.llm import LLM

    resolve_sizes(args)
    if args.output_len < 2:         # the decode latency is the mean gap between output tokens: it needs two
        raise ValueError(f"--output-len must be >= 2 (ms per token after the first), got {args.output_len}")
    for name in ("input_len", "output_len", "prefill_len", "num_iters", "prefix_len", "suffix_len", "load_seqs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    budget = args.max_num_batched_tokens or max(2048, args.prefill_len)
    with model_path(args) as path:
        llm = LLM(**engine_kwargs(args, model=path, max_num_batched_tokens=budget))
    eng = llm.engine
    limit = eng.max_model_len - 1
    if args.input_len + args.output_len > eng.max_model_len:
        raise ValueError(f"--input-len + --output-len = {args.input_len + args.output_len} exceeds max_model_len "
                         f"{eng.max_model_len}")
    prefill_len = min(args.prefill_len, limit)
    rng = random.Random(0)
    vocab = min(eng.model_config.vocab_size, 10001)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    if args.suffix_len > eng.max_model_len - 9:      # room for a 1-token prefix and the run's 8 outputs
        raise ValueError(f"--suffix-len must be <= max_model_len - 9 = {eng.max_model_len - 9}, got {args.suffix_len}")
    prefix_len = min(args.prefix_len, eng.max_model_len - 8 - args.suffix_len)
    itl, ttft, prefill, cached, loaded = [], [], [], [], []
    for it in range(args.num_iters + 1):                     # iteration 0 warms up
        out, t0, t1 = _run_one(eng, prompt(args.input_len), args.output_len)
        times = out.metrics.token_times
        if it:
            itl.append((times[-1] - times[0]) / (len(times) - 1) * 1e3)
            ttft.append((times[0] - t0) * 1e3)
        out, t0, t1 = _run_one(eng, prompt(prefill_len), 1)
        if it:
            prefill.append(prefill_len / (t1 - t0))
        ms, computed = _ttft_cached(eng, prompt, prefix_len, args.suffix_len)
        if it:
            cached.append((ms, computed))
        ms = _ttft_under_load(eng, prompt, args.input_len, args.load_seqs, min(eng.max_model_len, 4 * args.input_len))
        if it:
            loaded.append(ms)
    cfg = llm.config
    return {
        "model": model_label(args, path),
        "dtype": str(cfg.torch_dtype).removeprefix("torch."), "kv_cache_dtype": cfg.kv_cache_dtype,
        "device": str(cfg.device),
        "input_len": args.input_len, "output_len": args.output_len, "prefill_len": prefill_len,
        "num_iters": args.num_iters,
        "decode_ms_per_token": round(statistics.median(itl), 3), "ttft_ms": round(statistics.median(ttft), 2),
        "prefill_tok_s": round(statistics.median(prefill), 1),
        "prefix_len": prefix_len, "suffix_len": args.suffix_len,
        "ttft_cached_prefix_ms": round(statistics.median(ms for ms, _ in cached), 2),
        "cached_prefix_tokens_computed": max(n for _, n in cached),
        "load_seqs": args.load_seqs, "ttft_under_load_ms": round(statistics.median(loaded), 2),
        "decode_ms_per_token_all": [round(x, 3) for x in itl], "prefill_tok_s_all": [round(x, 1) for x in prefill],
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
    }


def run(args: argparse.Namespace) -> int:
    from picovllm.entrypoints.batch_io import check_output
    check_output(args.output_json, "--output-json")
    res = run_latency(args)
    print(f"decode (batch 1, {res['input_len']}-token prompt, {res['output_len']} tokens): "
          f"{res['decode_ms_per_token']:.2f} ms/token, TTFT {res['ttft_ms']:.1f} ms | "
          f"prefill of {res['prefill_len']} tokens: {res['prefill_tok_s']:.0f} tok/s")
    print(f"TTFT: cached {res['prefix_len']}-token prefix + {res['suffix_len']} tokens "
          f"{res['ttft_cached_prefix_ms']:.1f} ms ({res['cached_prefix_tokens_computed']} computed) | "
          f"{res['input_len']}-token prompt beside "
          f"{res['load_seqs']} decoding requests {res['ttft_under_load_ms']:.1f} ms")
    emit_json(res, args.output_json)
    return 0
