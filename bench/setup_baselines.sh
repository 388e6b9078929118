#!/usr/bin/env bash
# Build llama-cpp-python[server] from its sdist (CPU, cmake) once, cache the wheel outside the repo,
# and install it into its own venv so it never touches the project's .venv.
#   bench/setup_baselines.sh            # idempotent; ~10-20 min the first time on 2 cores
# The server is started through bench/goodput/bench/llama_cpp_launcher.py, which turns off
# llama.cpp's extra CPU buffer types: the -march=native build's AMX matmul segfaults in this VM.
# Env: GOODPUT_BENCH_CACHE (default ~/.cache/goodput-bench), LLAMA_CPP_VERSION (default 0.3.36),
#      BUILD_JOBS (default 1: the machine is shared; raise it on an idle box).
set -euo pipefail
CACHE=${GOODPUT_BENCH_CACHE:-$HOME/.cache/goodput-bench}
VER=${LLAMA_CPP_VERSION:-0.3.36}
JOBS=${BUILD_JOBS:-1}
PY=${PYTHON:-python3}
WHEELS=$CACHE/wheels
VENV=$CACHE/llama-venv
mkdir -p "$WHEELS" "$CACHE/sdist"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp, llama_cpp.server" 2>/dev/null; then
  echo "llama-cpp-python already installed in $VENV"; exit 0
fi

whl=$(ls "$WHEELS"/llama_cpp_python-"$VER"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$whl" ]; then
  ( cd "$CACHE/sdist" && [ -f "llama_cpp_python-$VER.tar.gz" ] || \
      "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$CACHE/sdist" )
  echo "building llama-cpp-python $VER wheel (jobs=$JOBS) ..."
  # Native CPU build; no BLAS (llama.cpp's own ggml kernels), no GPU backends.
  CMAKE_BUILD_PARALLEL_LEVEL=$JOBS CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
    nice -n 19 "$PY" -m pip wheel --no-deps -w "$WHEELS" "$CACHE/sdist/llama_cpp_python-$VER.tar.gz"
  whl=$(ls "$WHEELS"/llama_cpp_python-"$VER"-*.whl | head -1)
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "$whl[server]"
"$VENV/bin/python" -c "import llama_cpp, llama_cpp.server; print('llama_cpp', llama_cpp.__version__)"
