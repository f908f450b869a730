#!/usr/bin/env bash
# Everything the GPU fast path needs measured, in one device call. Full logs go to $OUT (or /tmp/out).
# Usage: bash benchmarks/gpu_session.sh [tests] [kernels] [splits] [sync] [throughput] [greedy] [eager] [latency] [prefill] [profile]
#        [planner]   (the planner against served runs, colocated: needs fastapi and uvicorn, carried as wheels;
#                     API_SERVERS=N: the colocated server's --api-server-count)
#        [frontend]  (the server's front-end and engine process CPU a request, 1- and 64-token requests;
#                     STREAM_INTERVAL=N: the server's --stream-interval; FRONTEND_RUNS: OUTPUT_LEN:RATE runs)
#        STEP_LOG=1: every engine process writes its steps to $OUT/steps/log.<pid> (PICOVLLM_STEP_LOG; read them
#                    with benchmarks/step_log.py)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${STEP_LOG:-0}" = 1 ]; then mkdir -p "$OUT/steps"; export PICOVLLM_STEP_LOG=$OUT/steps/log; fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
bench() { python3 benchmarks/nano_throughput.py "$@" > "$OUT/$log.log" 2>&1; tail -${lines:-30} "$OUT/$log.log"; }
for what in "$@"; do
  t0=$(date +%s)
  case $what in
    tests) python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -k "${TESTS_K:-}" ${TESTS:-tests/test_kernels.py} > "$OUT/tests.log" 2>&1
           grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -15 ;;
    kernels) python3 benchmarks/attention_kernels.py 2>&1 | tee "$OUT/kernels.log" ;;
    splits) python3 benchmarks/attention_kernels.py splits 2>&1 | tee "$OUT/splits.log" ;;
    sync) log=sync lines=60 bench throughput --timeline --no-overlap ;;
    throughput) log=throughput lines=60 bench throughput --timeline ;;
    greedy) log=greedy lines=12 bench throughput --temperature 0 ;;
    eager) log=eager lines=12 bench throughput --enforce-eager ;;
    latency) log=latency lines=40 bench latency --timeline ;;
    planner) timeout ${PLANNER_TIMEOUT:-520} python3 benchmarks/planner_vs_measured.py "$OUT/planner" --preset qwen3-0.6b --dtype bfloat16 \
               --num-kv-blocks 16384 --rates ${PLANNER_RATES:-10 40 80} --input-len 512 --output-len 64 --num-prompts 400 \
               --min-seconds ${PLANNER_MIN_S:-10} \
               --ttft-slo-ms 50 --itl-slo-ms 20 --api-server-count ${API_SERVERS:-1} > "$OUT/planner.log" 2>&1
             find "$OUT/planner" -name '*.safetensors' -delete
             grep -E "calibrated|predicted/measured|agree" "$OUT/planner.log" ;;
    frontend) python3 benchmarks/frontend_cpu.py "$OUT/frontend" --preset qwen3-0.6b --dtype bfloat16 --num-kv-blocks 16384 \
                --num-prompts 400 --runs ${FRONTEND_RUNS:-1:80 64:160} --stream-interval ${STREAM_INTERVAL:-1} \
                > "$OUT/frontend.log" 2>&1
              find "$OUT/frontend" -name '*.safetensors' -delete
              grep -E "front-end|Error" "$OUT/frontend.log" ;;
    *) log=$what bench "$what" ;;
  esac
  echo "== $what took $(( $(date +%s) - t0 )) s"
done
