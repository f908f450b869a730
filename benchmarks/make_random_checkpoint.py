"""Build a random-weight checkpoint (default: Qwen3-0.6B's shape, bf16, no tokenizer) for the GPU benchmark.

    python benchmarks/make_random_checkpoint.py /tmp/qwen3-0.6b-random [--preset qwen3-0.6b] [--dtype bfloat16]
    picovllm bench throughput --workload nano --model /tmp/qwen3-0.6b-random
"""
import argparse

from picovllm.bench.random_checkpoint import PRESETS, make_random_checkpoint

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="output folder")
    p.add_argument("--preset", default="qwen3-0.6b", help=f"one of {', '.join(PRESETS)}, or a config.json path")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(make_random_checkpoint(a.path, a.preset, a.dtype, a.seed))
