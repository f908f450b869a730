"""Perplexity of the default model on tests/data/alice_ch1-2.txt (6,039 tokens), three ways on the same tokens:
picovllm with the GGUF's weights kept quantized (quantization="auto"), picovllm on the float32 dequantized path
(quantization="none"), and llama.cpp's logits on the same GGUF file (llama-cpp-python in its own venv).

    python benchmarks/perplexity.py [--tokens N] [--llamacpp-python /work/llamacpp-venv/bin/python]

The tokens are picovllm's tokenization of the text, handed to llama.cpp as ids. One JSON line per engine.

    python benchmarks/perplexity.py --kv-cache-dtype fp8 [--device cuda] [--dtype bfloat16] [--model PATH]

compares KV caches instead: the same engine with kv_cache_dtype "auto" (the model's dtype) and "fp8", the
perplexity of each and the gap, then greedy answers to a fixed set of chat prompts side by side.
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


KV_PROMPTS = ["What is the capital of France?", "Name the three primary colors.",
              "At what temperature does water boil?", "Write a Python function that returns the square of a number.",
              "Who wrote Romeo and Juliet?", "What is the largest planet in the solar system?",
              "How many days are in a week?", "Translate 'thank you' into French."]


def kv_dtype_comparison(args) -> None:
    """Perplexity with the model's KV dtype and with args.kv_cache_dtype, then greedy answers side by side."""
    from picovllm import LLM, SamplingParams
    from picovllm.bench.perplexity import perplexity, token_logprobs

    import torch

    with open(TEXT) as f:
        text = f.read()
    # on the CPU fp8 runs torch's attention: so does the float side, so that only the KV dtype differs
    cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    results, answers = {}, {}
    for kv in ("auto", args.kv_cache_dtype):
        with LLM(args.model, kv_cache_dtype=kv, device=args.device, dtype=args.dtype, enable_prefix_caching=False,
                 attention_backend="torch" if cpu else "auto") as llm:
            ids = llm.get_tokenizer()(text).input_ids
            ids = ids[:args.tokens] if args.tokens else ids
            results[kv] = perplexity(token_logprobs(llm, ids))
            print(json.dumps({"engine": f"picovllm kv_cache_dtype={kv}", "dtype": str(llm.config.torch_dtype),
                              "device": str(llm.config.device), "tokens": len(ids),
                              "perplexity": round(results[kv], 4)}), flush=True)
            outs = [llm.chat([{"role": "user", "content": q}], SamplingParams(temperature=0, max_tokens=48),
                             use_tqdm=False)[0].outputs[0] for q in KV_PROMPTS]
            answers[kv] = [(o.text, o.token_ids) for o in outs]
    for i, q in enumerate(KV_PROMPTS):
        a, b = answers["auto"][i], answers[args.kv_cache_dtype][i]
        print(json.dumps({"prompt": q, "same_tokens": a[1] == b[1], "auto": a[0], args.kv_cache_dtype: b[0]}))
    gap = results[args.kv_cache_dtype] / results["auto"] - 1
    print(json.dumps({"fp8_vs_auto": f"{100 * gap:+.2f}%", "within_1_percent": abs(gap) < 0.01}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=0, help="only the first N tokens (0: all)")
    ap.add_argument("--llamacpp-python", default="/work/llamacpp-venv/bin/python")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--peer", nargs=2, metavar=("GGUF", "IDS_JSON"), help=argparse.SUPPRESS)   # the llama.cpp side
    ap.add_argument("--kv-cache-dtype", default=None, choices=["fp8", "fp8_e4m3"],
                    help="compare this KV cache dtype with the model's own instead (no llama.cpp)")
    ap.add_argument("--model", default=None, help="--kv-cache-dtype: HF folder or .gguf (default: the default model)")
    ap.add_argument("--device", default="auto", help="--kv-cache-dtype: the engines' device")
    ap.add_argument("--dtype", default="auto", help="--kv-cache-dtype: the model's dtype (auto: bf16 on a GPU)")
    args = ap.parse_args()
    if args.kv_cache_dtype:
        kv_dtype_comparison(args)
        return
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
