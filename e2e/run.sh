#!/usr/bin/env bash
# e2e/run.sh - the operator e2e suite on a throwaway local cluster (one entry point for CI).
#   installs the cached binaries (first run builds them, ~3-6 min), starts etcd + kube-apiserver +
#   controller-manager + scheduler on 127.0.0.1, runs `pytest e2e` (test kubelet and operator are
#   started by the suite's fixtures), and ALWAYS stops everything and removes the network namespaces,
#   veths and bridge it made (names gpe2e-*) and the Service-CIDR blackhole route.
# Usage: bash e2e/run.sh [pytest args]      Env: GOODPUT_E2E_LOGS (keep logs there), K8S_HOME
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
[ "$(id -u)" = 0 ] || { echo "e2e/run.sh needs root (network namespaces, routes)" >&2; exit 1; }

remove_pod_networks() {
  local n l p
  for n in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^gpe2e-' || true); do
    for p in $(ip netns pids "$n" 2>/dev/null || true); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$n" 2>/dev/null || true
  done
  for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep '^gpe2e-' || true); do
    ip link del "$l" 2>/dev/null || true
  done
}

bash e2e/cluster.sh install
LOGS=${GOODPUT_E2E_LOGS:-$(mktemp -d /tmp/goodput-e2e.XXXXXX)}
export GOODPUT_E2E_LOGS=$LOGS

cleanup() {
  local rc=$?
  bash e2e/cluster.sh stop || true
  remove_pod_networks
  echo "e2e logs: $LOGS" >&2
  exit $rc
}
trap cleanup EXIT
bash e2e/cluster.sh stop >/dev/null 2>&1 || true   # left over by an interrupted run
remove_pod_networks
bash e2e/cluster.sh start
eval "$(bash e2e/cluster.sh env)"
python -m pytest -q -p no:cacheprovider e2e "$@"
