"""One stream on the CPU, as llama.cpp's peer script measures it (/work/shared/peers/llamacpp_cpu_small.py
--latency): a 512-token random prompt (ids 0..10000), then 256 greedy tokens, EOS ignored; best of 3 of the
decode's ms per output token (after the first) and of the prompt's prefill tok/s (its time to first token).
picovllm with quantization="auto" (the GGUF's Q4_1/Q8_0 kept quantized), "none" (float32) and, with --only,
"bf16" (float32 with bfloat16 decode panels), and the peer.

    python benchmarks/one_stream.py [--runs 3] [--peer /work/shared/peers/llamacpp_cpu_small.py]
                                    [--peer-python /work/llamacpp-venv/bin/python]
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import time


def ours(quantization: str, runs: int) -> dict:
    from picovllm import LLM, SamplingParams
    llm = LLM(quantization=quantization, enable_prefix_caching=False)
    eng, rng = llm.engine, random.Random(0)
    decode, prefill = [], []
    for _ in range(runs + 1):                        # the first warms up
        prompt = [rng.randint(0, 10000) for _ in range(512)]
        t0 = time.time()
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))
        final = None
        while final is None:
            final = next((o for o in eng.step() if o.finished), None)
        times = final.metrics.token_times
        decode.append((times[-1] - times[0]) / (len(times) - 1) * 1e3)
        prefill.append(512 / (times[0] - t0))
    decode, prefill = decode[1:], prefill[1:]
    return {"engine": f"picovllm quantization={quantization}", "ms_per_token": round(min(decode), 2),
            "ms_per_token_all": [round(x, 2) for x in decode], "prefill_tok_s": round(max(prefill), 1),
            "prefill_tok_s_all": [round(x, 1) for x in prefill]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--peer", default="/work/shared/peers/llamacpp_cpu_small.py")
    ap.add_argument("--peer-python", default="/work/llamacpp-venv/bin/python")
    ap.add_argument("--only", choices=["auto", "none", "bf16", "peer"], nargs="*", default=["auto", "none", "peer"])
    args = ap.parse_args()
    for q in ("auto", "none", "bf16"):
        if q in args.only:
            print(json.dumps(ours(q, args.runs)), flush=True)
    if "peer" in args.only:
        version = subprocess.run([args.peer_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                                 capture_output=True, text=True).stdout.strip()
        out = subprocess.run([args.peer_python, args.peer, "--latency"], capture_output=True, text=True)
        print(json.dumps({"engine": f"llama.cpp (llama-cpp-python {version})",
                          "result": (out.stdout.strip().splitlines() or [out.stderr[-500:]])[-1]}))


if __name__ == "__main__":
    main()
