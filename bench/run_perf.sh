#!/usr/bin/env bash
# CPU decode performance in one run (bench/README.md, "Performance vs llama.cpp's own server"):
# side by side at 1/8/32 streams (goodput bf16 [+ int8/int4 when the worker has --quantization],
# llama.cpp's llama-server with --parallel = streams, HF static batching), weight bytes per step,
# the roofline bound and % of it, and decode cost vs context (512/2k/8k at batch 1 and 16).
#   bash bench/run_perf.sh                 # ~10-15 min on 2 idle cores; writes bench/results/<date>-cpu.md
#   bash bench/run_perf.sh --quick         # smoke scale (a few minutes)
#   bash bench/run_perf.sh --scale 2       # more requests per point (tighter numbers, longer)
# Extra arguments go to `python -m goodput.bench perf` (see --help). Run it on an otherwise idle
# machine: the results file records the load average before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
# the bench extra and the HF baseline (transformers) come with the test set-up
.venv/bin/python -c "import matplotlib, transformers" 2>/dev/null || bash scripts/setup.sh --test
. .venv/bin/activate
# llama.cpp's llama-server, built once into ~/.cache/goodput-bench (20-40 min the first time)
PYTHON=python bash bench/setup_baselines.sh || echo "llama-server baseline unavailable; continuing without it" >&2
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec python -m goodput.bench perf "$@"
