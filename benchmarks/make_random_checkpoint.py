"""Build a random-weight checkpoint (default: Qwen3-0.6B's shape, bf16, no tokenizer) for the GPU benchmark.

    python benchmarks/make_random_checkpoint.py /tmp/qwen3-0.6b-random [--preset qwen3-0.6b] [--dtype bfloat16]
        [--word-tokenizer]      # token i = the word "t<i>": text to stream, for `bench serve`
    picovllm bench throughput --workload nano --model /tmp/qwen3-0.6b-random
"""
import argparse

from picovllm.bench.random_checkpoint import PRESETS, make_random_checkpoint, resolve_config, write_word_tokenizer

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="output folder")
    p.add_argument("--preset", default="qwen3-0.6b", help=f"one of {', '.join(PRESETS)}, or a config.json path")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--word-tokenizer", action="store_true", help="add a tokenizer whose token i is the word t<i>")
    a = p.parse_args()
    path = make_random_checkpoint(a.path, a.preset, a.dtype, a.seed)
    if a.word_tokenizer:
        write_word_tokenizer(path, resolve_config(a.preset)["vocab_size"])
    print(path)
