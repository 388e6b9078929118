#!/usr/bin/env bash
# Reproduce all seven benchmark experiments (bench/README.md) on this machine:
#   bash bench/run_all.sh                 # full scale (~30-40 min on 2 idle cores)
#   bash bench/run_all.sh --quick         # half durations and fewer sweep points
#   bash bench/run_all.sh --only 2,3      # a subset
# Writes bench/results/<date>-cpu.md + bench/results/<date>-cpu/*.png (commit these) and raw
# per-request timelines under bench/results/raw/ (ignored by git).
set -euo pipefail
cd "$(dirname "$0")/.."
# the bench extra and the HF baseline (transformers) come with the test set-up
.venv/bin/python -c "import matplotlib, transformers" 2>/dev/null || bash scripts/setup.sh --test
. .venv/bin/activate
# the llama.cpp baseline (cached wheel, separate venv); experiment 5 skips it when missing
bash bench/setup_baselines.sh --with-llama-cpp-python || echo "llama.cpp baselines unavailable; continuing without them" >&2
python -m pip install -q "py-spy>=0.3" 2>/dev/null || true   # the profile in experiment 5 (bench extra)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec python -m goodput.bench experiments "$@"
