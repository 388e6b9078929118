# e2e/real-node.sh - the local cluster's REAL node (sourced by e2e/cluster.sh; not run on its own).
#
# A real kubelet ($BIN/kubelet, built by cluster.sh from Debian's `kubernetes` source package with the two
# patches named by KUBELET_PATCHES) runs pods through CRI on containerd + runc (Debian packages), with a CNI
# pod network (Debian's containernetworking-plugins): node "goodput-e2e-real", next to the test kubelet's
# node "goodput-e2e-node". Images come only from OCI archives imported into containerd (images/build.sh's
# output, $GOODPUT_IMAGES): nothing is ever pulled (containerd's only proxy is a closed port on loopback, so
# a pull of a missing image fails at once, ErrImagePull/ImagePullBackOff, without a DNS lookup).
#
#   pod network   bridge gpe2e-cni0 (10.244.1.1/24) + host-local 10.244.1.0/24; no NAT (ipMasq false), no default
#                 route in pods: a pod reaches its subnet and one more address, 10.0.0.1 (below)
#   API server    pods get KUBERNETES_SERVICE_HOST/PORT = Service `kubernetes` (10.0.0.1:443); with no
#                 kube-proxy, 10.0.0.1 is put on gpe2e-cni0 and e2e/api_forward.py forwards it to 127.0.0.1
#   DNS           --resolv-conf= (empty): pods never get the host's resolver
#   kubelet API   127.0.0.1:$REAL_KUBELET_PORT, the cluster CA's certificate (SAN 127.0.0.1), client
#                 certificates of the cluster CA only, Webhook authorization; node address InternalIP
#                 127.0.0.1 (the patched loopback check), so logs/exec/port-forward go over loopback
#   scheduling    the node registers cordoned and is uncordoned once Ready, the test node cordoned
#                 (real_node_schedule): a user's pods run from the images. The e2e suite flips that back for
#                 its files and gives a module that asks for it the real node (e2e/conftest.py)
#   state         all under $RUN/real (containerd root/state/socket, runc root, kubelet root dir, CNI config
#                 and IPAM data, netns mounts). Outside it: the kubelet's /var/log/pods and
#                 /var/log/containers, libcni's cache /var/lib/cni, containerd's shim sockets in
#                 /run/containerd, cgroups named k8s.io, net.ipv4.ip_forward (the bridge plugin sets it):
#                 real_node_down removes what did not exist before and restores the sysctls.
# Kubelet flags for this machine kind (root without CAP_SYS_RESOURCE, cgroup v1/v2 hybrid, 2 cores):
# cgroupfs driver, no QoS cgroups and no node-allocatable enforcement, no eviction, image GC off, no
# OOM-score change of its own, no iptables chains; the kernel tunables are only checked (patched build).

REAL_NODE=goodput-e2e-real
REAL=$RUN/real
REAL_BRIDGE=$NET_PREFIX-cni0
REAL_CIDR=10.244.1.0/24
REAL_GW=10.244.1.1
REAL_KUBELET_PORT=${REAL_KUBELET_PORT:-10262}
API_SERVICE_IP=10.0.0.1   # the ClusterIP of Service `kubernetes` (first address of SERVICE_CIDR)
CTR_SOCK=$REAL/containerd.sock
GOODPUT_IMAGES=${GOODPUT_IMAGES:-${XDG_CACHE_HOME:-$HOME/.cache}/goodput/images}
# sysctls the bridge plugin or an unpatched kubelet would change: saved at up, restored at down
REAL_SYSCTLS="net.ipv4.ip_forward kernel.panic kernel.panic_on_oops vm.overcommit_memory vm.panic_on_oom"
# host paths the kubelet, libcni or containerd create when missing: removed at down when they were made here
REAL_HOST_DIRS="/var/log/pods /var/log/containers /var/lib/cni /run/containerd"

real_node_install() { # the Debian packages of the runtime, when missing
  local need=()
  command -v containerd >/dev/null || need+=(containerd)
  command -v runc >/dev/null || need+=(runc)
  [ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] && [ -x /usr/lib/cni/loopback ] \
    || need+=(containernetworking-plugins)
  if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]}"
    apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null
  fi
}

ctr_() { ctr --address "$CTR_SOCK" --namespace k8s.io "$@"; }

real_images_dir() { # build the images when the repository can (images/build.sh), print the archives' folder
  if [ -f "$ROOT/images/build.sh" ] && [ "${GOODPUT_BUILD_IMAGES:-1}" != 0 ]; then
    say "building the images (bash images/build.sh; cached after the first run)"
    GOODPUT_IMAGES=$GOODPUT_IMAGES bash "$ROOT/images/build.sh" >&2
  fi
  [ -f "$GOODPUT_IMAGES/images.env" ] && [ -f "$GOODPUT_IMAGES/pause.oci.tar" ] \
    || { say "no images in $GOODPUT_IMAGES (images.env, pause.oci.tar): run 'bash images/build.sh'"; return 1; }
  echo "$GOODPUT_IMAGES"
}

save_host_state() {
  local s d
  for s in $REAL_SYSCTLS; do echo "$s=$(sysctl -n "$s")"; done >"$REAL/sysctl.saved"
  : >"$REAL/made"
  for d in $REAL_HOST_DIRS; do [ -e "$d" ] || echo "$d" >>"$REAL/made"; done
  for d in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do [ -e "${d}k8s.io" ] || echo "${d}k8s.io" >>"$REAL/made-cgroups"; done
}

write_cni_config() {
  mkdir -p "$REAL/cni-conf" "$REAL/cni-ipam"
  cat >"$REAL/cni-conf/10-goodput-e2e.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "goodput-e2e",
  "plugins": [{
    "type": "bridge", "bridge": "$REAL_BRIDGE", "isGateway": true, "isDefaultGateway": false,
    "ipMasq": false, "hairpinMode": true,
    "ipam": {"type": "host-local", "dataDir": "$REAL/cni-ipam",
             "ranges": [[{"subnet": "$REAL_CIDR", "gateway": "$REAL_GW"}]],
             "routes": [{"dst": "$API_SERVICE_IP/32", "gw": "$REAL_GW"}]}
  }]
}
EOF
}

write_containerd_config() { # pause image
  local pause=$1
  containerd config default | sed \
    -e "s|^root = .*|root = \"$REAL/containerd\"|" \
    -e "s|^state = .*|state = \"$REAL/containerd-state\"|" \
    -e "s|^  address = \"/run/containerd/containerd.sock\"|  address = \"$CTR_SOCK\"|" \
    -e "s|restrict_oom_score_adj = false|restrict_oom_score_adj = true|" \
    -e "s|netns_mounts_under_state_dir = false|netns_mounts_under_state_dir = true|" \
    -e "s|sandbox_image = .*|sandbox_image = \"$pause\"|" \
    -e "s|bin_dir = \"/opt/cni/bin\"|bin_dir = \"/usr/lib/cni\"|" \
    -e "s|conf_dir = \"/etc/cni/net.d\"|conf_dir = \"$REAL/cni-conf\"|" \
    -e "s|^            Root = \"\"|            Root = \"$REAL/runc\"|" \
    -e "s|path = \"/opt/containerd\"|path = \"$REAL/opt\"|" \
    >"$REAL/containerd.toml"
  grep -q "sandbox_image = \"$pause\"" "$REAL/containerd.toml" && grep -q "$REAL/runc" "$REAL/containerd.toml" \
    || { say "containerd config: a default line was not found"; return 1; }
}

import_images() { # archives folder: every *.oci.tar into containerd's k8s.io namespace
  local f t0
  for f in "$1"/*.oci.tar; do
    t0=$SECONDS
    ctr_ images import "$f" >/dev/null || { say "importing $f failed"; return 1; }
    say "imported $(basename "$f") in $((SECONDS - t0)) s"
  done
}

real_node_ready() {
  kctl get node "$REAL_NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null | grep -qx True
}

real_node_up() {
  local t0=$SECONDS images pause py
  real_node_install
  images=$(real_images_dir)
  pause=$(. "$images/images.env" && echo "$PAUSE_IMAGE")
  mkdir -p "$REAL" "$LOG/real-node"
  save_host_state
  ip link add "$REAL_BRIDGE" type bridge
  ip addr add "$REAL_GW/24" dev "$REAL_BRIDGE"
  ip addr add "$API_SERVICE_IP/32" dev "$REAL_BRIDGE"
  ip link set "$REAL_BRIDGE" up
  write_cni_config
  write_containerd_config "$pause"
  # the proxy is a closed port on loopback: a pull never leaves the machine (nor resolves a name)
  bg containerd env HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 NO_PROXY= \
    containerd --config "$REAL/containerd.toml"
  wait_for containerd 60 ctr_ version
  import_images "$images"
  py=$(python_bin)
  bg api-forward env PYTHONUNBUFFERED=1 "$py" "$ROOT/e2e/api_forward.py" "$API_SERVICE_IP:443=127.0.0.1:$API_PORT"
  mkdir -p "$REAL/kubelet" "$REAL/volume-plugins"
  bg real-kubelet "$BIN/kubelet" --v=2 \
    --kubeconfig="$RUN/kubeconfig" --hostname-override="$REAL_NODE" --node-ip=127.0.0.1 \
    --root-dir="$REAL/kubelet" --cert-dir="$REAL/kubelet/pki" --volume-plugin-dir="$REAL/volume-plugins" \
    --container-runtime=remote --container-runtime-endpoint="unix://$CTR_SOCK" --runtime-request-timeout=5m \
    --pod-infra-container-image="$pause" \
    --cgroup-driver=cgroupfs --cgroups-per-qos=false --enforce-node-allocatable= --fail-swap-on=false \
    --oom-score-adj=0 --eviction-hard= --image-gc-high-threshold=100 --image-gc-low-threshold=99 \
    --make-iptables-util-chains=false --resolv-conf= \
    --address=127.0.0.1 --port="$REAL_KUBELET_PORT" --read-only-port=0 --healthz-port=0 \
    --tls-cert-file="$PKI/kubelet.crt" --tls-private-key-file="$PKI/kubelet.key" \
    --anonymous-auth=false --client-ca-file="$PKI/ca.crt" --authorization-mode=Webhook \
    --node-labels=goodput.dev/e2e-node=real
  wait_for "node $REAL_NODE registered" 120 kctl get node "$REAL_NODE"
  kctl cordon "$REAL_NODE" >&2
  wait_for "node $REAL_NODE Ready" 120 real_node_ready
  # the admission plugin taints a new node not-ready; without the node-lifecycle controller nothing lifts it
  kctl taint nodes "$REAL_NODE" node.kubernetes.io/not-ready:NoSchedule- >&2 || true
  say "real node $REAL_NODE up in $((SECONDS - t0)) s (kubelet log $LOG/real-kubelet.log)"
}

real_node_schedule() { # pods go to the real node: it is uncordoned, the test node cordoned
  kctl uncordon "$REAL_NODE" >&2
  kctl cordon goodput-e2e-node >&2
  say "pods are scheduled to $REAL_NODE (the test node goodput-e2e-node is cordoned; kubectl uncordon it to use both)"
}

real_node_pod_processes() { # ns pod ip: status lines for the pod's containerd tasks; fails when it has none
  [ -S "$CTR_SOCK" ] || return 1
  local ids id pid found=1
  ids=$(kctl -n "$1" get pod "$2" -o jsonpath='{range .status.containerStatuses[*]}{.containerID}{"\n"}{end}' \
    2>/dev/null | sed -n 's|^containerd://||p')
  for id in $ids; do
    pid=$(ctr_ tasks ls 2>/dev/null | awk -v id="$id" '$1 == id && $3 == "RUNNING" {print $2}')
    [ -n "$pid" ] || continue
    ps -o etime=,rss=,args= -p "$pid" 2>/dev/null | awk -v ns="$1" -v pod="$2" -v ip="$3" -v pid="$pid" \
      '{et=$1; rss=$2; $1=""; $2=""; sub(/^ +/, ""); printf "%-20s %-40s %-12s %-10s %8s %10s %8d  %s\n", ns, pod, ip, "(runc)", pid, et, rss/1024, substr($0, 1, 120)}'
    found=0
  done
  return $found
}

stop_pid() { # name expected-exe-basename timeout-seconds: SIGTERM, then SIGKILL
  local f=$RUN/$1.pid pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  [ "$(basename "$(readlink "/proc/$pid/exe" 2>/dev/null)")" = "$2" ] || return 0
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq $(($3 * 5))); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
  say "stopped $1 pid $pid"
}

real_node_delete_pods() { # through the kubelet: it stops the containers and runs CNI DEL
  kctl get node "$REAL_NODE" >/dev/null 2>&1 || return 0
  kctl cordon "$REAL_NODE" >/dev/null 2>&1 || true
  kctl delete pods -A --field-selector "spec.nodeName=$REAL_NODE" --grace-period=3 --wait=false >/dev/null 2>&1 || true
  local i
  for i in $(seq 150); do
    [ -z "$(kctl get pods -A --field-selector "spec.nodeName=$REAL_NODE" -o name 2>/dev/null)" ] \
      && ! ctr_ tasks ls 2>/dev/null | grep -q RUNNING && break
    sleep 0.2
  done
}

unmount_under() { # dir: lazily unmount everything mounted at or below it, deepest first
  local m
  for m in $(awk -v p="$1" '$2 == p || index($2, p "/") == 1 {print $2}' /proc/self/mounts | sort -r); do
    umount -l "$m" 2>/dev/null || say "could not unmount $m"
  done
}

real_node_down() {
  [ -d "$REAL" ] || return 0
  [ -S "$CTR_SOCK" ] && [ -f "$RUN/kubeconfig" ] && real_node_delete_pods
  stop_pid real-kubelet kubelet 20
  stop_pid api-forward "$(basename "$(readlink -f "$(python_bin)")")" 10
  # anything the kubelet left: kill the tasks, then the shims of this containerd
  local t pid d s
  if [ -S "$CTR_SOCK" ]; then
    for t in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s SIGKILL "$t" >/dev/null 2>&1 || true; done
  fi
  stop_pid containerd containerd 20
  for pid in $(pgrep -f "containerd-shim-runc-v2 .*-address $CTR_SOCK" || true); do kill -9 "$pid" 2>/dev/null || true; done
  # every mount under $REAL (container rootfs, sandbox shm, netns files, the kubelet's rshared root)
  unmount_under "$REAL"
  ip link del "$REAL_BRIDGE" 2>/dev/null || true
  if [ -f "$REAL/sysctl.saved" ]; then
    while IFS= read -r s; do sysctl -q -w "$s" >/dev/null 2>&1 || say "could not restore $s"; done <"$REAL/sysctl.saved"
  fi
  if [ -f "$REAL/made-cgroups" ]; then
    while IFS= read -r d; do
      [ -d "$d" ] || continue
      # a container process that outlived its shim is still in its cgroup
      for pid in $(cat "$d"/*/cgroup.procs 2>/dev/null || true); do kill -9 "$pid" 2>/dev/null || true; done
      find "$d" -depth -mindepth 1 -type d -exec rmdir {} + 2>/dev/null; rmdir "$d" 2>/dev/null || true
    done <"$REAL/made-cgroups"
  fi
  if [ -f "$REAL/made" ]; then
    while IFS= read -r d; do rm -rf "$d"; done <"$REAL/made"
  fi
  rm -rf "$REAL"
  say "real node down"
}
