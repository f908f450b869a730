"""Generate with tensor parallelism over ranks that torchrun starts (one host or several).

    torchrun --nproc-per-node 2 -m picovllm.entrypoints.tp_launch --prompt "The capital of France is"

Every rank runs this module. Rank 0 builds the engine (tensor_parallel_size = the world size) and
prints the outputs; the other ranks serve it with run_worker_from_env() and exit when it is done.
"""
from __future__ import annotations

import argparse
import json
import os

from picovllm.engine.tp_executor import run_worker_from_env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="HF folder, .gguf file or Hub id (org/name[/file.gguf]) (default: the bundled SmolLM2-135M)")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], help="a prompt as comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--json", action="store_true", help="print one JSON object per output")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if int(os.environ.get("RANK", "0")) != 0:
        run_worker_from_env()
        return
    from picovllm import LLM, SamplingParams

    prompts = list(args.prompt) + [[int(t) for t in s.split(",")] for s in args.prompt_ids]
    if not prompts:
        raise SystemExit("give at least one --prompt or --prompt-ids")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with LLM(args.model, tensor_parallel_size=world, dtype=args.dtype, device=args.device,
             block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
             max_num_batched_tokens=args.max_num_batched_tokens) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outputs):
        comp = out.outputs[0]
        if args.json:
            print(json.dumps({"index": i, "token_ids": comp.token_ids, "text": comp.text}), flush=True)
        else:
            print(f"[{i}] {comp.text!r}", flush=True)


if __name__ == "__main__":
    main()
