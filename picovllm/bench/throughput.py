"""`picovllm bench throughput`: offline throughput on a fixed workload (see workloads.py).

All requests are submitted at once and run to their max_tokens (EOS ignored, greedy); the time
covers generate() only, after the model is loaded and warmed up.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time

from picovllm.bench.workloads import WORKLOADS, check_totals, make_workload
from picovllm.entrypoints.commands.args import add_model_and_engine_args, engine_kwargs


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("throughput", help="offline throughput on the nano or cpu-small workload",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=list(WORKLOADS), default="cpu-small")
    p.add_argument("--num-prompts", type=int, default=None, help="only the first N requests of the workload")
    p.add_argument("--random-model", metavar="CONFIG", default=None,
                   help="benchmark random weights of this shape (a preset such as qwen3-0.6b, or a config.json), "
                        "built in a temporary folder, in --random-model-dtype")
    p.add_argument("--random-model-dtype", default="bfloat16")
    p.add_argument("--output-json", default=None, help="also write the result to this file")
    p.add_argument("--no-progress", action="store_true")
    add_model_and_engine_args(p)
    p.set_defaults(func=run, dtype=None)   # None: the workload's dtype


@contextlib.contextmanager
def model_path(args: argparse.Namespace):
    """The --model to use: a random checkpoint built for this run, or the one given."""
    if args.random_model is None:
        yield args.model
        return
    if args.model is not None:
        raise ValueError("give --model or --random-model, not both")
    from picovllm.bench.random_checkpoint import make_random_checkpoint
    with tempfile.TemporaryDirectory(prefix="picovllm-random-") as d:
        yield make_random_checkpoint(d, args.random_model, args.random_model_dtype)


def model_label(args: argparse.Namespace, path: str | None) -> str:
    if args.random_model is not None:
        return f"random:{args.random_model}"
    return path or "default (SmolLM2-135M-Instruct)"


def emit_json(res: dict, path: str | None) -> None:
    """Print a benchmark's result as one JSON line, and write it to `path` when given."""
    print(json.dumps(res))
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=2)


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_throughput(args: argparse.Namespace) -> dict:
    import torch

    from picovllm.entrypoints.llm import LLM
    from picovllm.sampling_params import SamplingParams

    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    w = make_workload(args.workload, args.num_prompts)
    check_totals(w)
    with model_path(args) as path:
        kw = engine_kwargs(args, model=path, dtype=args.dtype or w.spec.dtype)
        t = time.time()
        llm = LLM(**kw)
        load_s = time.time() - t
    warm = [p[:32] for p in w.prompts[:2]]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    llm.engine.block_manager.reset_prefix_cache()     # the warm-up's blocks are the workload's first prompts' prefixes
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in w.max_tokens]
    _sync()
    t = time.time()
    outs = llm.generate(w.prompts, params, use_tqdm=not args.no_progress)
    _sync()
    elapsed = time.time() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    if n_out != w.num_output_tokens:
        raise AssertionError(f"generated {n_out} output tokens, the workload asks for {w.num_output_tokens}")
    cfg = llm.config
    return {
        "workload": w.spec.name, "model": model_label(args, path),
        "dtype": str(cfg.torch_dtype).removeprefix("torch."), "kv_cache_dtype": cfg.kv_cache_dtype,
        "device": str(cfg.device),
        "torch_threads": torch.get_num_threads(),
        "num_requests": len(w.prompts), "prompt_tokens": w.num_prompt_tokens, "output_tokens": n_out,
        "load_s": round(load_s, 2), "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(n_out / elapsed, 1), "total_tok_s": round((n_out + w.num_prompt_tokens) / elapsed, 1),
        "max_num_batched_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs,
        "block_size": cfg.block_size, "num_kv_blocks": llm.engine.block_manager.num_blocks,
    }


def run(args: argparse.Namespace) -> int:
    from picovllm.entrypoints.batch_io import check_output
    check_output(args.output_json, "--output-json")
    res = run_throughput(args)
    print(f"workload {res['workload']}: {res['num_requests']} requests, {res['prompt_tokens']} prompt + "
          f"{res['output_tokens']} output tokens on {res['model']} ({res['dtype']}, {res['device']})", file=sys.stderr)
    print(f"Total time: {res['elapsed_s']:.2f} s | output: {res['output_tok_s']:.1f} tok/s | "
          f"total: {res['total_tok_s']:.1f} tok/s")
    emit_json(res, args.output_json)
    return 0
