"""Start-up times of the `picovllm` command, as a user meets them: wall time of whole commands, repeated.

    python benchmarks/startup.py [--repeat 5] [--llamacpp-python PATH]

Rows (min / median / max over --repeat runs, each a fresh process):
  import          python3 -c "import picovllm"
  help            picovllm --help
  generate-first  picovllm generate "Name the capital of France." with an empty cache folder (a fresh machine)
  generate-later  the same with the cache the first run filled
  serve-health    picovllm serve, until GET /health answers 200 (warm cache)
  llama.cpp       (with --llamacpp-python: the python of the llama-cpp-python venv, see
                  ../shared/peers/llamacpp_cpu_small.py) opening the same GGUF and answering the same chat prompt
                  (the whole process: interpreter, import, load, answer)
Each run gets its own PICOVLLM_CACHE_DIR under a temporary folder, removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

PROMPT = "Name the capital of France."
# llama.cpp gets the chat prompt as token ids (ours): this old llama-cpp-python neither applies the GGUF's chat
# template nor parses special tokens in text, and answers nonsense otherwise
LLAMACPP = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=2048, verbose=False)
out = llm.create_completion([int(t) for t in sys.argv[2].split(",")], temperature=0, max_tokens=256)
print(out["choices"][0]["text"])
"""


def timed(cmd: list[str], env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{cmd} failed: {r.stderr[-2000:]}")
    return dt, r.stdout.strip()


def serve_health(env: dict, port: int) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(["picovllm", "serve", "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def summary(name: str, times: list[float], note: str = "") -> dict:
    row = {"what": name, "n": len(times), "min_s": round(min(times), 3), "median_s": round(statistics.median(times), 3),
           "max_s": round(max(times), 3)}
    print(f"{name:16s} min {row['min_s']:6.2f} s   median {row['median_s']:6.2f} s   "
          f"max {row['max_s']:6.2f} s   {note}")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--llamacpp-python", default=None)
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="picovllm-startup-")
    env = dict(os.environ, PICOVLLM_CACHE_DIR=os.path.join(root, "cache"))
    env.pop("PICOVLLM_NO_CACHE", None)
    rows = []
    try:
        rows.append(summary("import", [timed([sys.executable, "-c", "import picovllm"], env)[0]
                                       for _ in range(args.repeat)]))
        rows.append(summary("help", [timed(["picovllm", "--help"], env)[0] for _ in range(args.repeat)]))
        first, answer = [], ""
        for i in range(args.repeat):
            fresh = dict(env, PICOVLLM_CACHE_DIR=os.path.join(root, f"fresh{i}"))
            dt, answer = timed(["picovllm", "generate", PROMPT], fresh)
            first.append(dt)
            shutil.rmtree(fresh["PICOVLLM_CACHE_DIR"])
        rows.append(summary("generate-first", first, repr(answer)))
        timed(["picovllm", "generate", PROMPT], env)                    # fill the cache the next rows use
        later = [timed(["picovllm", "generate", PROMPT], env) for _ in range(args.repeat)]
        rows.append(summary("generate-later", [t for t, _ in later], repr(later[-1][1])))
        rows.append(summary("serve-health", [serve_health(env, args.port) for _ in range(args.repeat)]))
        if args.llamacpp_python:
            from picovllm.entrypoints.llm import chat_prompt_ids
            from picovllm.loader import open_model_source
            from picovllm.loader.default_model import default_model_path

            ids = chat_prompt_ids(open_model_source(None).load_tokenizer(), [{"role": "user", "content": PROMPT}])
            runs = [timed([args.llamacpp_python, "-c", LLAMACPP, default_model_path(), ",".join(map(str, ids))], env)
                    for _ in range(args.repeat)]
            rows.append(summary("llama.cpp", [t for t, _ in runs], repr(runs[-1][1])))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
