"""Perplexity of the default model on tests/data/alice_ch1-2.txt (6,039 tokens), three ways on the same tokens:
picovllm with the GGUF's weights kept quantized (quantization="auto"), picovllm on the float32 dequantized path
(quantization="none"), and llama.cpp's logits on the same GGUF file (llama-cpp-python in its own venv).

    python benchmarks/perplexity.py [--tokens N] [--llamacpp-python /work/llamacpp-venv/bin/python]

The tokens are picovllm's tokenization of the text, handed to llama.cpp as ids. One JSON line per engine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "tests", "data", "alice_ch1-2.txt")


def llamacpp_logprobs(path: str, ids: list[int], threads: int) -> list[float]:
    """Run inside the llama-cpp-python venv: log p(ids[i + 1] | ids[:i + 1]) from llama.cpp's logits."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(path, n_ctx=len(ids) + 16, n_batch=512, logits_all=True, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    llm.eval(ids)
    scores = np.asarray(llm.scores[:len(ids) - 1], dtype=np.float64)
    scores -= scores.max(1, keepdims=True)
    logz = np.log(np.exp(scores).sum(1))
    return (scores[np.arange(len(ids) - 1), ids[1:]] - logz).tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=0, help="only the first N tokens (0: all)")
    ap.add_argument("--llamacpp-python", default="/work/llamacpp-venv/bin/python")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--peer", nargs=2, metavar=("GGUF", "IDS_JSON"), help=argparse.SUPPRESS)   # the llama.cpp side
    args = ap.parse_args()
    if args.peer:
        with open(args.peer[1]) as f:
            print(json.dumps(llamacpp_logprobs(args.peer[0], json.load(f), args.threads)))
        return

    import torch

    from picovllm import LLM
    from picovllm.bench.perplexity import perplexity, token_logprobs
    from picovllm.loader.default_model import default_model_path

    with open(TEXT) as f:
        text = f.read()
    results = {}
    for quantization in ("auto", "none"):
        with LLM(quantization=quantization, enable_prefix_caching=False) as llm:
            ids = llm.get_tokenizer()(text).input_ids
            ids = ids[:args.tokens] if args.tokens else ids
            lp = token_logprobs(llm, ids)
        results[quantization] = perplexity(lp)
        print(json.dumps({"engine": f"picovllm quantization={quantization}", "tokens": len(ids),
                          "perplexity": round(results[quantization], 4)}), flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    try:
        out = subprocess.run([args.llamacpp_python, __file__, "--threads", str(args.threads), "--peer",
                              default_model_path(), f.name], capture_output=True, text=True, check=True).stdout
        version = subprocess.run([args.llamacpp_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                                 capture_output=True, text=True).stdout.strip()
        ppl = perplexity(torch.tensor(json.loads(out.strip().splitlines()[-1]), dtype=torch.float64))
        print(json.dumps({"engine": f"llama.cpp (llama-cpp-python {version})", "tokens": len(ids),
                          "perplexity": round(ppl, 4)}))
    except (OSError, subprocess.CalledProcessError) as e:
        print(json.dumps({"engine": "llama.cpp", "error": str(e)[-500:]}), file=sys.stderr)
    finally:
        os.unlink(f.name)
    gap = results["auto"] / results["none"] - 1
    print(json.dumps({"quantized_vs_float32": f"{100 * gap:+.2f}%", "within_1_percent": abs(gap) < 0.01}))
    if not math.isfinite(gap):
        sys.exit(1)


if __name__ == "__main__":
    main()
