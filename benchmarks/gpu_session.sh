#!/usr/bin/env bash
# Everything the GPU fast path needs measured, in one device call. Logs go to $OUT (or /tmp/out).
# Usage: bash benchmarks/gpu_session.sh [tests] [kernels] [throughput] [latency] [prefill] [profile] [eager]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
for what in "$@"; do
  t0=$(date +%s)
  case $what in
    tests) python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 tests/test_kernels.py 2>&1 | tail -25 | tee "$OUT/tests.log" ;;
    kernels) python3 benchmarks/attention_kernels.py 2>&1 | tee "$OUT/kernels.log" ;;
    eager) python3 benchmarks/nano_throughput.py throughput --enforce-eager 2>&1 | tail -3 | tee "$OUT/eager.log" ;;
    *) python3 benchmarks/nano_throughput.py "$what" 2>&1 | tail -40 | tee "$OUT/$what.log" ;;
  esac
  echo "== $what took $(( $(date +%s) - t0 )) s"
done
