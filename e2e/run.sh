#!/usr/bin/env bash
# e2e/run.sh - the operator e2e suite on a throwaway local cluster (one entry point for CI).
#   `e2e/cluster.sh up` (installs the cached binaries, the first run builds them, ~3-6 min; starts etcd +
#   kube-apiserver + controller-manager + scheduler on 127.0.0.1, the CRD and the test kubelet), runs
#   `pytest e2e` (the operator is started by the suite's fixtures), and ALWAYS runs `cluster.sh down`
#   (stops everything, removes the network namespaces, veths and bridge named gpe2e-* and the
#   Service-CIDR blackhole route).
# Usage: bash e2e/run.sh [pytest args | e2e/test_file.py ...]      Env: GOODPUT_E2E_LOGS (keep logs there), K8S_HOME
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
[ "$(id -u)" = 0 ] || { echo "e2e/run.sh needs root (network namespaces, routes)" >&2; exit 1; }

LOGS=${GOODPUT_E2E_LOGS:-$(mktemp -d /tmp/goodput-e2e.XXXXXX)}
export GOODPUT_E2E_LOGS=$LOGS

cleanup() {
  local rc=$?
  bash e2e/cluster.sh down || true
  echo "e2e logs: $LOGS" >&2
  exit $rc
}
trap cleanup EXIT
bash e2e/cluster.sh down >/dev/null 2>&1 || true   # left over by an interrupted run
eval "$(bash e2e/cluster.sh up)"
# `run.sh e2e/test_x.py ...` runs those files only; otherwise the whole suite (pytest args like -k, -x apply)
targets=(e2e)
for a in "$@"; do case "$a" in e2e/*) targets=() ;; esac; done
python -m pytest -q -p no:cacheprovider "${targets[@]}" "$@"
