#!/usr/bin/env bash
# Build the llama.cpp baselines once, cached outside the repo (never in the project's .venv):
#   1. llama.cpp's own `llama-server` (continuous batching over --parallel slots), from the llama.cpp
#      source vendored in the llama-cpp-python sdist: cmake, Release, target llama-server,
#      -DGGML_NATIVE=ON -DLLAMA_CURL=OFF. ~20-40 min the first time on 2 shared cores (nice 19).
#   2. optional (--with-llama-cpp-python): llama-cpp-python[server] in its own venv, the older
#      one-request-at-a-time baseline; another full llama.cpp compile, so off by default.
#
#   bash bench/setup_baselines.sh                          # idempotent; prints the binary's path
#   bash bench/setup_baselines.sh --with-llama-cpp-python
#
# AMX: a -march=native build on an AMX CPU compiles ggml's AMX extra buffer type, which crashes in
# this VM (SIGILL at start). The build keeps it (it is what users get); the benchmark probes
# llama.cpp's defaults and, only when they crash, starts llama-server with its own switch
# `--no-repack` (llama.cpp's `no_extra_bufts`; bench/goodput/bench/llama_server.py says why).
#
# Env: GOODPUT_BENCH_CACHE (default ~/.cache/goodput-bench), LLAMA_CPP_VERSION (default 0.3.36),
#      BUILD_JOBS (default 2), PYTHON (default python3; used for pip download only).
set -euo pipefail
CACHE=${GOODPUT_BENCH_CACHE:-$HOME/.cache/goodput-bench}
VER=${LLAMA_CPP_VERSION:-0.3.36}
JOBS=${BUILD_JOBS:-2}
PY=${PYTHON:-python3}
WITH_LCP=0
for a in "$@"; do
  case "$a" in
    --with-llama-cpp-python) WITH_LCP=1 ;;
    *) echo "unknown argument: $a" >&2; exit 2 ;;
  esac
done
SDIST=$CACHE/sdist/llama_cpp_python-$VER.tar.gz
SRC=$CACHE/src/llama_cpp_python-$VER/vendor/llama.cpp
BUILD=$CACHE/llama-server-build-$VER
BIN=$BUILD/bin/llama-server
mkdir -p "$CACHE/sdist" "$CACHE/src"

fetch_sdist() {
  [ -f "$SDIST" ] || "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$CACHE/sdist"
}

# ---- 1. llama-server --------------------------------------------------------------------------
if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
  echo "llama-server already built: $BIN"
else
  fetch_sdist
  [ -f "$SRC/CMakeLists.txt" ] || tar xzf "$SDIST" -C "$CACHE/src"
  echo "building llama-server from llama-cpp-python $VER's vendored llama.cpp (jobs=$JOBS) ..."
  start=$(date +%s)
  # No network during the build: LLAMA_USE_PREBUILT_UI=OFF skips the web UI download (the server
  # then has no embedded UI, which the benchmark does not use); OpenSSL is only for HTTPS.
  nice -n 19 cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF
  nice -n 19 cmake --build "$BUILD" --target llama-server -j "$JOBS"
  echo "built $BIN in $(( $(date +%s) - start )) s"
  echo "$(( $(date +%s) - start ))" > "$BUILD/.build_seconds"
fi
"$BIN" --version 2>&1 | head -2

# ---- 2. llama-cpp-python (optional) -----------------------------------------------------------
[ "$WITH_LCP" = 1 ] || exit 0
WHEELS=$CACHE/wheels
VENV=$CACHE/llama-venv
mkdir -p "$WHEELS"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp, llama_cpp.server" 2>/dev/null; then
  echo "llama-cpp-python already installed in $VENV"; exit 0
fi
whl=$(ls "$WHEELS"/llama_cpp_python-"$VER"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$whl" ]; then
  fetch_sdist
  echo "building llama-cpp-python $VER wheel (jobs=$JOBS) ..."
  CMAKE_BUILD_PARALLEL_LEVEL=$JOBS CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
    nice -n 19 "$PY" -m pip wheel --no-deps -w "$WHEELS" "$SDIST"
  whl=$(ls "$WHEELS"/llama_cpp_python-"$VER"-*.whl | head -1)
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "$whl[server]"
"$VENV/bin/python" -c "import llama_cpp, llama_cpp.server; print('llama_cpp', llama_cpp.__version__)"
