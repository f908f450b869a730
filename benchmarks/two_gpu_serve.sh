#!/usr/bin/env bash
# Issue 8's headline run: online serving on two GPUs, (a) one colocated server per GPU (requests round-robin,
# chunked prefill on) against (b) 1P1D (P server on GPU 0, D server on GPU 1, behind `picovllm proxy`), same
# prefill-heavy Poisson workload at each rate. Writes $OUT/serve_summary.json (every run's metrics) and the
# ITL-over-time plots of every rate for both setups.
#
#   bash benchmarks/two_gpu_serve.sh                     # on nvidia-h200-x2 (needs fastapi + uvicorn: see below)
#   DEV0=cpu DEV1=cpu MODEL=/tmp/tiny RATES="4" INPUT_LEN=64 OUTPUT_LEN=8 NUM_PROMPTS=8 bash benchmarks/two_gpu_serve.sh
#
# The device image lacks fastapi and uvicorn: carry their wheels (device README, "carry missing wheels"). Here:
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 -d .whl fastapi==0.165.0 starlette==1.10.0 \
#     pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 uvicorn==0.54.0 \
#     opentelemetry-api==1.45.2 annotated-doc anyio==4.16.0 h11==0.16.0 click==8.5.1 idna==3.20 \
#     typing_extensions==4.16.0 importlib-metadata zipp
# and on the device (carry [".whl"]): python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   && PYTHONPATH=/tmp/site OUT=$OUT bash benchmarks/two_gpu_serve.sh
# Defaults: a random Qwen3-0.6B-shaped checkpoint with a word tokenizer (servers stream text, so every token must
# decode to some), prompts of 2k-8k tokens (INPUT_LEN 5000 +- 60%), outputs of 128-512 (OUTPUT_LEN 320 +- 60%), rates
# 2, 8, 24 req/s with rate x DURATION (30 s) prompts each (at least 40; NUM_PROMPTS fixes it). Goodput under two SLOs:
# TTFT <= 1 s and TPOT <= 50 ms (bench serve's), and TTFT <= 1 s with every gap of the request <= 50 ms (max ITL).
# SETUPS="b" runs only (b). The summary is rewritten after each setup, so a cut-short run still returns what it measured.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=$(mktemp -d); export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
DEV0=${DEV0:-cuda:0}; DEV1=${DEV1:-cuda:1}; RATES=${RATES:-"2 8 24"}; DURATION=${DURATION:-30}
INPUT_LEN=${INPUT_LEN:-5000}; OUTPUT_LEN=${OUTPUT_LEN:-320}; RATIO=${RATIO:-0.6}; KV=${KV:-torch_dist}
MODEL=${MODEL:-$(python3 benchmarks/make_random_checkpoint.py /tmp/qwen3-0.6b-words --word-tokenizer | tail -1)}
ENGINE=(--model "$MODEL" --max-model-len $((INPUT_LEN * 2 + OUTPUT_LEN * 2)) ${ENGINE_ARGS:-})
CLI=(python3 -m picovllm.entrypoints.cli)
PIDS=()

serve() { local name=$1; shift; "${CLI[@]}" "$@" > "$WORK/$name.log" 2>&1 & PIDS+=($!); }   # name, command...
ready() {   # url: wait until it answers /health; give up if a server died
  for _ in $(seq 600); do
    curl -sf "$1/health" > /dev/null && return 0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2> /dev/null || { echo "a server died: $1"; return 1; }; done
    sleep 1
  done
  echo "not ready: $1"; return 1
}
alive() { for pid in "${PIDS[@]}"; do kill -0 "$pid" 2> /dev/null && return 0; done; return 1; }
stop_all() {   # SIGINT, then SIGKILL whatever has not exited after 30 s
  kill -INT "${PIDS[@]}" 2> /dev/null
  for _ in $(seq 30); do alive || break; sleep 1; done
  kill -KILL "${PIDS[@]}" 2> /dev/null; wait "${PIDS[@]}" 2> /dev/null; PIDS=()
}
trap stop_all EXIT
SEED=0
bench() {   # setup-name rate url...: each run its own prompts (one seed for all let a server's prefix cache hold
  local name=$1 rate=$2; shift 2     # the later runs' prompts, sent by the earlier runs)
  SEED=$((SEED + 1))
  local n=${NUM_PROMPTS:-$(python3 -c "print(max(40, round($rate * $DURATION)))")}
  "${CLI[@]}" bench serve --base-url "$@" --num-prompts "$n" --request-rate "$rate" \
      --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --random-range-ratio "$RATIO" --goodput ttft:1000 tpot:50 \
      --seed "$SEED" --result-json "$WORK/$name-$rate.json" --plot "$WORK/$name-$rate.png" \
      > "$WORK/bench-$name-$rate.log" 2>&1
  grep -E "Request throughput|Median TTFT|P99 TTFT|Median ITL|P99 ITL|goodput" "$WORK/bench-$name-$rate.log" \
      | sed "s/^/  [$name @ $rate req\/s] /"
}

summarize() {
python3 - "$WORK" "$OUT" $RATES <<'EOF'
import json, shutil, sys
work, out, rates = sys.argv[1], sys.argv[2], sys.argv[3:]
keys = ["request_throughput", "request_goodput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
        "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "p99_tpot_ms", "completed", "failed", "duration"]
summary = {}
for name in ("colocated", "pd"):
    for r in rates:
        try:
            s = json.load(open(f"{work}/{name}-{r}.json"))
        except OSError:
            continue
        summary[f"{name}@{r}"] = {k: s.get(k) for k in keys}
        good = [q for q in s["requests"] if q["success"] and q["ttft"] <= 1.0 and max(q["itls"], default=0) <= 0.05]
        summary[f"{name}@{r}"]["request_goodput_max_itl"] = len(good) / s["duration"]
json.dump(summary, open(f"{out}/serve_summary.json", "w"), indent=1)
for k, v in summary.items():
    print(f"{k:>16}: " + ", ".join(f"{key}={v[key]:.4g}" if isinstance(v[key], float) else f"{key}={v[key]}"
                                   for key in v))
for name in ("colocated", "pd"):
    for r in rates:
        try:
            shutil.copy(f"{work}/{name}-{r}.png", f"{out}/itl_{name}_{r}.png")
        except OSError:
            pass
EOF
}

if [[ " ${SETUPS:-a b} " == *" a "* ]]; then
echo "== (a) colocated: one server per GPU, round-robin"
serve a0 serve --device "$DEV0" --port 8001 "${ENGINE[@]}"
serve a1 serve --device "$DEV1" --port 8002 "${ENGINE[@]}"
ready http://127.0.0.1:8001 && ready http://127.0.0.1:8002 || { tail -n 20 "$WORK"/*.log; exit 1; }
for r in $RATES; do bench colocated "$r" http://127.0.0.1:8001 http://127.0.0.1:8002; done
stop_all; summarize
fi

[[ " ${SETUPS:-a b} " == *" b "* ]] || exit 0
echo "== (b) 1P1D: P on $DEV0, D on $DEV1 ($KV), behind the proxy"
export PICOVLLM_PD_SECRET="${PICOVLLM_PD_SECRET:-$(head -c 24 /dev/urandom | base64)}"   # P, D and the proxy share it
serve p serve --role p --device "$DEV0" --port 8101 --kv-port 9101 --kv-transfer "$KV" "${ENGINE[@]}"
serve d serve --role d --device "$DEV1" --port 8201 --kv-peer 127.0.0.1:9101 --kv-transfer "$KV" "${ENGINE[@]}"
ready http://127.0.0.1:8101 && ready http://127.0.0.1:8201 || { tail -n 20 "$WORK"/*.log; exit 1; }
serve proxy proxy --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8201 --port 8000 --model "$MODEL"
ready http://127.0.0.1:8000 || { tail -n 20 "$WORK"/*.log; exit 1; }
for r in $RATES; do bench pd "$r" http://127.0.0.1:8000; done
stop_all; summarize

