"""A test kubelet: registers one node and runs every pod bound to it as local processes.

    python e2e/kubelet.py [--node goodput-e2e-node] [--log-dir DIR] [--gpus 8]
                          [--api-forward 10.244.0.1:6443=127.0.0.1:6443]
                          [--serve 127.0.0.1:10250 --tls-cert F --tls-key F --client-ca F]

Per pod it makes a network namespace with a veth into a host bridge (10.244.0.1/24), gives the pod
the next free address from 10.244.0.0/24, and runs each container's command + args inside it with
``ip netns exec`` and the container's env (values, Secret/ConfigMap keys and fieldRefs resolved as
a kubelet would). It reports hostIP/podIP, phase Running, and Ready from the container's real HTTP
readiness probe, so the Endpoints controller points Services at live processes. A container that
exits is restarted with back-off and reported as a kubelet does: state.waiting CrashLoopBackOff,
restartCount, lastState.terminated with exitCode, reason and message. The message is the container's
termination-message file (at most 4096 bytes) or, with ``terminationMessagePolicy:
FallbackToLogsOnError`` and an error exit, the tail of its log (80 lines, 2048 bytes), as the kubelet
reads them. Processes share the host's /dev, so instead of a file mounted at the container's
terminationMessagePath each run gets its own file, named by GOODPUT_TERMINATION_MESSAGE_PATH.
When a pod is deleted it stops the processes (SIGTERM, then SIGKILL after the pod's grace period, at
most MAX_GRACE_S), removes the namespace and veth, and deletes the pod object.
On SIGTERM/SIGINT it stops everything it started and removes the bridge.

Pods that talk to the API server (the operator and autoscaler of the Helm chart) get what a kubelet
gives them: their ServiceAccount token Secret volume bind-mounted at its mountPath (normally
/var/run/secrets/kubernetes.io/serviceaccount) in the process's private mount namespace, and
KUBERNETES_SERVICE_HOST/PORT pointing at ``--api-forward``'s listen address, a TCP forwarder on the host
bridge to the API server on 127.0.0.1 (pods cannot reach the host's loopback, and no ClusterIP routes).
Other volume kinds (emptyDir, configMap...) are not materialized: the process sees the host's files.
Pods get the kubelet's PYTHONPATH when it has one (e2e/run.sh from a git worktree: the pods run that tree's
code, as an image built from it would).

Pod logs: each container's output goes to ``<log-dir>/<namespace>_<pod>_<container>.log`` (every run
after a ``--- <time> start #N: <command>`` line). With ``--serve`` the kubelet's log endpoint answers
the API server there (HTTPS, client certificates of ``--client-ca`` only), so ``kubectl logs`` (also
``-f``, ``--tail``, ``--limit-bytes``, ``--previous``) works: ``GET /containerLogs/{ns}/{pod}/{container}``
with the query parameters of the kubelet's API (``follow``, ``tailLines``, ``limitBytes``,
``previous``). The node reports that port as its kubelet endpoint and one address, InternalIP
127.0.0.1, and ``cluster.sh`` starts the API server with ``--kubelet-preferred-address-types=InternalIP``:
it reaches the kubelet on loopback and never resolves the node's name.

The namespaces have no default route: a pod can talk only to 10.244.0.0/24 and the host bridge.
Needs root (ip netns), the `ip` tool, and KUBECONFIG (or ~/.kube/config).
Names it creates: netns ``gpe2e-N``, links ``gpe2e-hN`` (host side), bridge ``gpe2e-br0``.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import http.server
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import kubernetes
from kubernetes.client.exceptions import ApiException

# the kubelet's limits on a termination message (pkg/kubelet/kuberuntime: maxMsgSize, and
# kubecontainer.MaxContainerTerminationMessageLogLines/Length for FallbackToLogsOnError)
TERMINATION_MESSAGE_MAX_BYTES = 4096
FALLBACK_LOG_LINES, FALLBACK_LOG_BYTES = 80, 2048
BRIDGE = "gpe2e-br0"
PREFIX = "gpe2e"
HOST_IP = "10.244.0.1"
POD_NET = "10.244.0"
# a worker drains its in-flight streams after SIGTERM, then exits: honour the pod's grace period up to
# this long (a real kubelet honours all of it; the bound keeps a stuck process from stalling a test)
MAX_GRACE_S = 60.0
SECRETS_ROOT = Path("/run/goodput-e2e-kubelet")  # per-pod copies of mounted Secret volumes
# the only mount paths made on the host when missing (empty directories; the bind mount is per process)
MOUNTABLE_PREFIXES = ("/var/run/secrets/", "/run/secrets/")
log = logging.getLogger("e2e.kubelet")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")
    return r


def ensure_bridge() -> None:
    if sh("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")


def remove_bridge() -> None:
    sh("ip", "link", "del", BRIDGE, check=False)


class ApiForwarder:
    """TCP forwarder ``listen`` (host:port on the pod bridge) -> ``target`` (the API server on loopback)."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]):
        self.listen, self.target = listen, target
        self.sock = socket.create_server(listen, reuse_port=False)
        self.sock.settimeout(1.0)
        self.stopping = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._accept, name="api-forward", daemon=True).start()
        log.info("forwarding %s:%d -> %s:%d", *self.listen, *self.target)

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                client, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError as e:
                log.warning("api forward: %s", e)
                client.close()
                continue
            upstream.settimeout(None)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s_ in (src, dst):
                try:
                    s_.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s_.close()

    def stop(self) -> None:
        self.stopping.set()
        self.sock.close()


# the kubelet's own line before each run of a container (see Container.start)
START_LINE = re.compile(rb"^--- \S+ start #\d+: ", re.M)


def split_runs(data: bytes) -> list[bytes]:
    """A container log file's runs, oldest first, without the kubelet's ``--- <time> start #N`` lines.

    Text before the first start line (none in files this kubelet writes) counts as a run of its own.
    """
    runs: list[bytes] = []
    cur: list[bytes] | None = None
    for line in data.splitlines(keepends=True):
        if START_LINE.match(line):
            if cur is not None:
                runs.append(b"".join(cur))
            cur = []
        else:
            cur = cur if cur is not None else []
            cur.append(line)
    if cur is not None:
        runs.append(b"".join(cur))
    return runs


def tail_lines(text: bytes, n: int | None) -> bytes:
    """The last ``n`` lines of ``text`` (all of it for None; nothing for 0)."""
    if n is None:
        return text
    if n <= 0:
        return b""
    return b"".join(text.splitlines(keepends=True)[-n:])


class LogServer:
    """The kubelet's container-log endpoint over HTTPS for the API server (``kubectl logs [-f]``).

    ``GET /containerLogs/{namespace}/{pod}/{container}?follow=&tailLines=&limitBytes=&previous=``
    (kubelet API, pkg/kubelet/server/server.go): the current run's output (``previous``: the run
    before it); ``follow`` then streams what the running container writes until it exits or restarts,
    its pod stops, or the client goes. 404 for an unknown container, 400 for a bad parameter.
    Only clients with a certificate signed by ``client_ca`` (the API server's kubelet client) connect.
    """

    def __init__(self, kubelet: Kubelet, listen: tuple[str, int], cert: Path, key: Path, client_ca: Path):
        self.kubelet = kubelet
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        ctx.load_verify_locations(str(client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:
                log.info("log server: " + fmt, *args)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                server.handle(self)

        self.httpd = http.server.ThreadingHTTPServer(listen, Handler)
        self.httpd.daemon_threads = True
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.listen = listen

    def start(self) -> None:
        threading.Thread(target=self.httpd.serve_forever, name="log-server", daemon=True).start()
        log.info("container logs served on https://%s:%d/containerLogs/", *self.listen)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    @staticmethod
    def _reply(h: http.server.BaseHTTPRequestHandler, code: int, text: str) -> None:
        body = text.encode()
        h.send_response(code)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(h.path)
        parts = url.path.strip("/").split("/")
        if len(parts) != 4 or parts[0] != "containerLogs":
            return self._reply(h, 404, f"not found: {url.path}")
        _, ns, pod, container = parts
        q = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        try:
            tail = int(q["tailLines"]) if "tailLines" in q else None
            limit = int(q["limitBytes"]) if "limitBytes" in q else None
        except ValueError:
            return self._reply(h, 400, "tailLines and limitBytes must be integers")
        follow = q.get("follow", "false").lower() in ("true", "1")
        previous = q.get("previous", "false").lower() in ("true", "1")
        path = self.kubelet.log_dir / f"{ns}_{pod}_{container}.log"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return self._reply(h, 404, f'container "{container}" in pod "{pod}" in namespace "{ns}" has no logs '
                                       "on this node")
        runs = split_runs(data)
        if previous:
            if len(runs) < 2:
                return self._reply(h, 400, f'previous terminated container "{container}" in pod "{pod}" not found')
            out, follow = runs[-2], False
        else:
            out = runs[-1] if runs else b""
        out = tail_lines(out, tail)
        if limit is not None:
            out = out[:limit]
        h.send_response(200)
        h.send_header("Content-Type", "text/plain")
        if not follow:
            h.send_header("Content-Length", str(len(out)))
            h.end_headers()
            h.wfile.write(out)
            return
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        sent = len(out)
        try:
            self._chunk(h, out)
            offset = len(data)
            while not self.kubelet.stopping.is_set() and (limit is None or sent < limit):
                runner = self.kubelet.runner(ns, pod)
                with open(path, "rb") as f:
                    f.seek(offset)
                    new = f.read()
                m = START_LINE.search(new)  # the container restarted: its run ended there
                cut = m.start() if m else -1
                if cut >= 0:
                    new = new[:cut]
                if new:
                    if limit is not None:
                        new = new[:limit - sent]
                    self._chunk(h, new)
                    sent += len(new)
                    offset += len(new)
                if cut >= 0 or runner is None or not runner.running(container):
                    break
                time.sleep(0.2)
            self._chunk(h, b"")
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            pass  # the client went away (kubectl logs -f interrupted)

    @staticmethod
    def _chunk(h: http.server.BaseHTTPRequestHandler, data: bytes) -> None:
        h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        h.wfile.flush()


class PodNetwork:
    """One network namespace + veth pair with address 10.244.0.<index>."""

    def __init__(self, index: int):
        self.index = index
        self.netns = f"{PREFIX}-{index}"
        self.host_if = f"{PREFIX}-h{index}"
        self.ip = f"{POD_NET}.{index}"

    def create(self) -> None:
        self.delete()  # leftovers of a crashed run
        sh("ip", "netns", "add", self.netns)
        peer = f"{PREFIX}-p{self.index}"
        sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", peer)
        sh("ip", "link", "set", peer, "netns", self.netns)
        sh("ip", "link", "set", self.host_if, "master", BRIDGE)
        sh("ip", "link", "set", self.host_if, "up")
        sh("ip", "-n", self.netns, "link", "set", peer, "name", "eth0")
        sh("ip", "-n", self.netns, "addr", "add", f"{self.ip}/24", "dev", "eth0")
        sh("ip", "-n", self.netns, "link", "set", "eth0", "up")
        sh("ip", "-n", self.netns, "link", "set", "lo", "up")

    def delete(self) -> None:
        sh("ip", "netns", "del", self.netns, check=False)  # takes the veth pair with it
        sh("ip", "link", "del", self.host_if, check=False)


class Container:
    """One container's process, restarted with back-off when it exits."""

    def __init__(self, pod: PodRunner, spec: Any):
        self.pod = pod
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.ready = False
        self.started = False
        self.last_exit: int | None = None
        self.started_at = now()
        self.last_terminated: dict[str, Any] | None = None  # lastState.terminated of the previous run
        self._log_offset = 0

    @property
    def termination_log(self) -> Path:
        return self.pod.kubelet.log_dir / f"{self.pod.namespace}_{self.pod.name}_{self.spec.name}.termination-log"

    def start(self, env: dict[str, str]) -> None:
        cmd = list(self.spec.command or []) + list(self.spec.args or [])
        if not cmd:
            raise RuntimeError(f"container {self.spec.name} has no command (images are not run here)")
        self.termination_log.write_bytes(b"")  # each run starts with an empty termination message
        env = {**env, "GOODPUT_TERMINATION_MESSAGE_PATH": str(self.termination_log)}
        logf = open(self.pod.log_path(self.spec.name), "ab")
        logf.write(f"--- {now()} start #{self.restarts}: {' '.join(cmd)}\n".encode())
        logf.flush()
        self._log_offset = logf.tell()
        self.started_at = now()
        mounts = self.pod.mounts_for(self.spec)
        if mounts:
            # `ip netns exec` gives the process a private (slave) mount namespace: bind mounts stay in it
            script = "".join(f'mount --bind "{src}" "{dst}" && mount -o remount,bind,ro "{dst}" && '
                             for src, dst in mounts) + 'exec "$@"'
            cmd = ["sh", "-c", script, "sh", *cmd]
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.pod.net.netns, *cmd], env=env, stdout=logf, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=self.pod.workdir, start_new_session=True)
        logf.close()

    def exited(self, rc: int) -> None:
        """Record the run that just ended as lastState.terminated (exit code, reason, message)."""
        code = rc if rc >= 0 else 128 - rc  # killed by signal N: 128 + N, as container runtimes report
        message = self.termination_log.read_bytes()[:TERMINATION_MESSAGE_MAX_BYTES].decode(errors="replace")
        if not message.strip() and code != 0 and self.spec.termination_message_policy == "FallbackToLogsOnError":
            with open(self.pod.log_path(self.spec.name), "rb") as f:
                f.seek(self._log_offset)
                lines = f.read().decode(errors="replace").splitlines()[-FALLBACK_LOG_LINES:]
            message = "\n".join(lines)[-FALLBACK_LOG_BYTES:]
        self.last_terminated = {"exitCode": code, "reason": "Error" if code else "Completed",
                                "startedAt": self.started_at, "finishedAt": now()}
        if message:
            self.last_terminated["message"] = message

    def stop(self, grace: float) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


class PodRunner:
    """Runs one pod: network, containers, probes, status."""

    def __init__(self, kubelet: Kubelet, pod: Any, index: int):
        self.kubelet = kubelet
        self.namespace = pod.metadata.namespace
        self.name = pod.metadata.name
        self.uid = pod.metadata.uid
        self.pod = pod
        self.net = PodNetwork(index)
        self.workdir = kubelet.log_dir
        self.containers = [Container(self, c) for c in pod.spec.containers]
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"pod-{self.name}", daemon=True)
        self.started_at = now()
        self._last_status: dict | None = None

    def log_path(self, container: str) -> Path:
        return self.kubelet.log_dir / f"{self.namespace}_{self.name}_{container}.log"

    def running(self, container: str) -> bool:
        """Whether ``container``'s process runs now."""
        return not self.stopping.is_set() and any(
            c.spec.name == container and c.proc is not None and c.proc.poll() is None for c in self.containers)

    # -- env, ports, probes
    def _env(self, c: Any) -> dict[str, str]:
        env = {"PATH": self.kubelet.path_env, "HOME": "/root", "HOSTNAME": self.name}
        if os.environ.get("PYTHONPATH"):  # the checkout under test is the "image": a worktree's code, not the venv's
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        if self.kubelet.api_forward is not None:
            host, port = self.kubelet.api_forward.listen
            env.update(KUBERNETES_SERVICE_HOST=host, KUBERNETES_SERVICE_PORT=str(port))
        for e in c.env or []:
            if e.value_from is None:
                env[e.name] = e.value or ""
                continue
            vf = e.value_from
            try:
                if vf.secret_key_ref:
                    s = self.kubelet.v1.read_namespaced_secret(vf.secret_key_ref.name, self.namespace)
                    env[e.name] = base64.b64decode((s.data or {})[vf.secret_key_ref.key]).decode()
                elif vf.config_map_key_ref:
                    cm = self.kubelet.v1.read_namespaced_config_map(vf.config_map_key_ref.name, self.namespace)
                    env[e.name] = (cm.data or {})[vf.config_map_key_ref.key]
                elif vf.field_ref:
                    env[e.name] = {"metadata.name": self.name, "metadata.namespace": self.namespace,
                                   "status.podIP": self.net.ip, "spec.nodeName": self.kubelet.node,
                                   "status.hostIP": "127.0.0.1"}.get(vf.field_ref.field_path, "")
            except (ApiException, KeyError) as exc:
                raise RuntimeError(f"env {e.name}: cannot resolve {vf}: {exc}") from exc
        return env

    def mounts_for(self, c: Any) -> list[tuple[Path, str]]:
        """(host directory, mountPath) for each Secret volume ``c`` mounts; the files written now."""
        secret_vols = {v.name: v.secret for v in self.pod.spec.volumes or [] if v.secret is not None}
        out = []
        for m in c.volume_mounts or []:
            sv = secret_vols.get(m.name)
            if sv is None:
                continue
            if not m.mount_path.startswith(MOUNTABLE_PREFIXES):
                raise RuntimeError(f"volume {m.name}: mountPath {m.mount_path} is not supported by the test kubelet")
            try:
                data = self.kubelet.v1.read_namespaced_secret(sv.secret_name, self.namespace).data or {}
            except ApiException as exc:
                raise RuntimeError(f"volume {m.name}: Secret {sv.secret_name}: {exc.status} {exc.reason}") from exc
            d = SECRETS_ROOT / self.uid / m.name
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(SECRETS_ROOT, 0o700)
            for key, value in data.items():
                (d / key).write_bytes(base64.b64decode(value))
            target = Path(m.mount_path)
            if not target.is_dir():
                # the first missing ancestor: removed again (if still empty) when the kubelet stops
                first = target
                while not first.parent.exists():
                    first = first.parent
                target.mkdir(parents=True, exist_ok=True)
                with self.kubelet.lock:
                    self.kubelet.made_dirs.append((first, target))
            out.append((d, m.mount_path))
        return out

    @staticmethod
    def _port(c: Any, port: Any) -> int:
        if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
            return int(port)
        for p in c.ports or []:
            if p.name == port:
                return int(p.container_port)
        raise RuntimeError(f"container {c.name}: no port named {port!r}")

    def _probe(self, c: Any, probe: Any) -> bool:
        if probe is None:
            return True
        if probe.http_get is None:
            return True  # exec/tcp probes are not run here; treated as passing
        url = f"http://{self.net.ip}:{self._port(c, probe.http_get.port)}{probe.http_get.path or '/'}"
        try:
            return httpx.get(url, timeout=probe.timeout_seconds or 1).status_code < 400
        except httpx.HTTPError:
            return False

    # -- status
    def _patch_status(self) -> None:
        all_ready = all(c.ready for c in self.containers)
        ts = now()
        statuses = []
        for ct in self.containers:
            running = ct.proc is not None and ct.proc.poll() is None
            st: dict[str, Any] = {"name": ct.spec.name, "image": ct.spec.image, "imageID": "local://" + ct.spec.image,
                                  "ready": ct.ready, "started": ct.started, "restartCount": ct.restarts}
            if running:
                st["state"] = {"running": {"startedAt": ct.started_at}}
            elif ct.last_terminated is not None:
                st["state"] = {"waiting": {"reason": "CrashLoopBackOff", "message": (
                    f"back-off restarting failed container={ct.spec.name} pod={self.name}_{self.namespace}")}}
            else:
                st["state"] = {"waiting": {"reason": "ContainerCreating"}}
            if ct.last_terminated is not None:
                st["lastState"] = {"terminated": ct.last_terminated}
            statuses.append(st)
        key = {"ready": all_ready, "statuses": [(s["ready"], s["started"], s["restartCount"], str(s["state"]),
                                                 str(s.get("lastState"))) for s in statuses]}
        if key == self._last_status:
            return
        self._last_status = key
        conds = [{"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"},
                 {"type": "ContainersReady", "status": str(all_ready)}, {"type": "Ready", "status": str(all_ready)}]
        for c in conds:
            c["lastTransitionTime"] = ts
        body = {"status": {"phase": "Running", "hostIP": "127.0.0.1", "podIP": self.net.ip,
                           "podIPs": [{"ip": self.net.ip}], "startTime": self.started_at,
                           "conditions": conds, "containerStatuses": statuses}}
        try:
            self.kubelet.v1.patch_namespaced_pod_status(self.name, self.namespace, body)
        except ApiException as e:
            if e.status != 404:
                log.warning("status of %s/%s: %s %s", self.namespace, self.name, e.status, e.reason)

    # -- lifecycle
    def _run(self) -> None:
        try:
            self.net.create()
            for ct in self.containers:
                ct.start(self._env(ct.spec))
        except Exception as exc:
            log.error("pod %s/%s failed to start: %s", self.namespace, self.name, exc)
            self._fail(str(exc))
            return
        log.info("pod %s/%s running at %s (pids %s)", self.namespace, self.name, self.net.ip,
                 [c.proc.pid for c in self.containers if c.proc])
        self._patch_status()
        backoff_until = [0.0] * len(self.containers)
        while not self.stopping.is_set():
            for i, ct in enumerate(self.containers):
                rc = ct.proc.poll() if ct.proc else 0
                if rc is not None:
                    if ct.ready or ct.last_exit is None:
                        ct.last_exit = rc
                    ct.ready = ct.started = False
                    if backoff_until[i] == 0.0:
                        backoff_until[i] = time.monotonic() + min(2 ** ct.restarts, 30)
                        ct.exited(rc)
                        log.warning("container %s/%s/%s exited %s", self.namespace, self.name, ct.spec.name, rc)
                    elif time.monotonic() >= backoff_until[i]:
                        ct.restarts += 1
                        backoff_until[i] = 0.0
                        try:
                            ct.start(self._env(ct.spec))
                        except Exception as exc:
                            log.error("restart of %s failed: %s", ct.spec.name, exc)
                    continue
                if not ct.started:
                    ct.started = self._probe(ct.spec, ct.spec.startup_probe)
                if ct.started:
                    ct.ready = self._probe(ct.spec, ct.spec.readiness_probe)
            self._patch_status()
            self.stopping.wait(self.kubelet.probe_period)

    def _fail(self, message: str) -> None:
        try:
            self.kubelet.v1.patch_namespaced_pod_status(self.name, self.namespace, {"status": {
                "phase": "Failed", "reason": "StartError", "message": message[:1000]}})
        except ApiException:
            pass

    def start(self) -> None:
        self.thread.start()

    def stop(self, grace: float) -> None:
        self.stopping.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=15)
        for ct in self.containers:
            ct.stop(grace)
        self.net.delete()
        shutil.rmtree(SECRETS_ROOT / self.uid, ignore_errors=True)
        log.info("pod %s/%s stopped", self.namespace, self.name)


class Kubelet:
    def __init__(self, node: str, log_dir: Path, gpus: int, probe_period: float,
                 api_forward: tuple[tuple[str, int], tuple[str, int]] | None = None,
                 serve: tuple[tuple[str, int], Path, Path, Path] | None = None):
        kubernetes.config.load_kube_config()
        self.api_forward_addrs = api_forward
        self.api_forward: ApiForwarder | None = None
        self.serve = serve  # ((host, port), cert, key, client CA) of the log endpoint
        self.log_server: LogServer | None = None
        self.v1 = kubernetes.client.CoreV1Api()
        self.node = node
        self.log_dir = log_dir
        self.gpus = gpus
        self.probe_period = probe_period
        self.pods: dict[str, PodRunner] = {}  # uid -> runner
        self.releasing: set[int] = set()  # pod IP indexes whose namespace is still being torn down
        self.last_index = 1  # the last pod IP index handed out (allocation goes round the range)
        self.made_dirs: list[tuple[Path, Path]] = []  # (first created ancestor, mount path) made on the host
        self.terminating: set[str] = set()  # uids being stopped (one teardown per pod)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        # pods find the project's console scripts (goodput-worker) like an image's PATH would
        bindir = str(Path(sys.executable).parent)
        self.path_env = f"{bindir}:/usr/local/bin:/usr/bin:/bin"

    def register_node(self) -> None:
        try:
            self.v1.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {
                "name": self.node, "labels": {"kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux",
                                              "nvidia.com/gpu.present": "true"}}})
        except ApiException as e:
            if e.status != 409:
                raise
        # the not-ready taint from TaintNodesByCondition is normally lifted by the node-lifecycle controller,
        # which is disabled here (it would evict pods of a node without real heartbeats)
        self.v1.patch_node(self.node, {"spec": {"taints": None}})
        self.heartbeat()

    def runner(self, namespace: str, name: str) -> PodRunner | None:
        """The running pod ``namespace/name``, or None."""
        with self.lock:
            for r in self.pods.values():
                if r.namespace == namespace and r.name == name:
                    return r
        return None

    def heartbeat(self) -> None:
        res = {"cpu": "16", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": str(self.gpus)}
        ts = now()
        extra: dict[str, Any] = {}
        if self.serve is not None:
            extra["daemonEndpoints"] = {"kubeletEndpoint": {"Port": self.serve[0][1]}}
        # one address, on loopback: the API server (--kubelet-preferred-address-types=InternalIP) connects
        # there; a Hostname address would make it resolve the node's name through the host's resolver
        self.v1.patch_node_status(self.node, {"status": {
            "capacity": res, "allocatable": res, **extra,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "goodput e2e test kubelet", "lastHeartbeatTime": ts,
                            "lastTransitionTime": ts}],
            "nodeInfo": {"kubeletVersion": "v1.20.2-goodput-e2e", "operatingSystem": "linux",
                         "architecture": "amd64", "containerRuntimeVersion": "local://processes",
                         "kernelVersion": os.uname().release, "osImage": "local", "kubeProxyVersion": "",
                         "machineID": "", "systemUUID": "", "bootID": ""}}})

    def _free_index(self) -> int:
        """The next free index after the last one handed out, round the range (as the CNI host-local
        IPAM plugin allocates): a pod's address is not reused at once, so no other pod's neighbour
        (ARP) cache still maps it to a deleted pod's veth, which would drop connections to the new pod
        until that entry went stale."""
        used = {r.net.index for r in self.pods.values()} | self.releasing
        for k in range(253):
            i = 2 + (self.last_index - 2 + 1 + k) % 253
            if i not in used:
                self.last_index = i
                return i
        raise RuntimeError("no free pod IP in 10.244.0.0/24")

    def on_pod(self, etype: str, pod: Any) -> None:
        uid = pod.metadata.uid
        with self.lock:
            runner = self.pods.get(uid)
            if etype == "DELETED" or pod.metadata.deletion_timestamp:
                if uid in self.terminating:
                    return
                self.terminating.add(uid)
                if runner is not None:
                    del self.pods[uid]
                    self.releasing.add(runner.net.index)
                threading.Thread(target=self._terminate, args=(runner, pod, etype), daemon=True).start()
                return
            if runner is None and pod.status.phase not in ("Succeeded", "Failed"):
                runner = PodRunner(self, pod, self._free_index())
                self.pods[uid] = runner
                runner.start()

    def _terminate(self, runner: PodRunner | None, pod: Any, etype: str) -> None:
        if runner is not None:
            grace = min(float(pod.spec.termination_grace_period_seconds or 30), MAX_GRACE_S)
            runner.stop(grace)
            with self.lock:
                self.releasing.discard(runner.net.index)
        if etype != "DELETED":
            try:
                # with a body the API server reads DeleteOptions only from it, not from query parameters
                self.v1.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, body={
                    "gracePeriodSeconds": 0, "preconditions": {"uid": pod.metadata.uid}})
            except ApiException as e:
                if e.status not in (404, 409):
                    log.warning("final delete of %s: %s %s", pod.metadata.name, e.status, e.reason)
                    with self.lock:
                        self.terminating.discard(pod.metadata.uid)  # the next event retries

    def run(self) -> None:
        ensure_bridge()
        if self.api_forward_addrs is not None:
            self.api_forward = ApiForwarder(*self.api_forward_addrs)
            self.api_forward.start()
        if self.serve is not None:
            self.log_server = LogServer(self, *self.serve)
            self.log_server.start()
        self.register_node()
        log.info("node %s registered (nvidia.com/gpu: %d)", self.node, self.gpus)
        threading.Thread(target=self._heartbeats, daemon=True).start()
        while not self.stopping.is_set():
            w = kubernetes.watch.Watch()
            try:
                for ev in w.stream(self.v1.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={self.node}",
                                   timeout_seconds=30):
                    self.on_pod(ev["type"], ev["object"])
                    if self.stopping.is_set():
                        break
            except ApiException as e:
                log.warning("watch error %s %s", e.status, e.reason)
                time.sleep(1)
            except Exception as e:
                if self.stopping.is_set():
                    break
                log.warning("watch failed: %s", e)
                time.sleep(1)

    def _heartbeats(self) -> None:
        while not self.stopping.wait(20):
            try:
                self.heartbeat()
            except Exception as e:
                log.warning("heartbeat failed: %s", e)

    def shutdown(self) -> None:
        self.stopping.set()
        with self.lock:
            runners = list(self.pods.values())
            self.pods.clear()
        threads = [threading.Thread(target=r.stop, args=(5.0,)) for r in runners]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        if self.api_forward is not None:
            self.api_forward.stop()
        if self.log_server is not None:
            self.log_server.stop()
        remove_bridge()
        shutil.rmtree(SECRETS_ROOT, ignore_errors=True)
        for first, target in reversed(self.made_dirs):
            d = target
            while True:  # rmdir only empty directories, up to the first one we made
                try:
                    d.rmdir()
                except OSError:
                    break
                if d == first:
                    break
                d = d.parent
        log.info("kubelet stopped; %d pods' processes and namespaces removed", len(runners))


def _forward_spec(text: str) -> tuple[tuple[str, int], tuple[str, int]]:
    try:
        listen, target = text.split("=")
        (lh, lp), (th, tp) = listen.rsplit(":", 1), target.rsplit(":", 1)
        return (lh, int(lp)), (th, int(tp))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT=HOST:PORT, got {text!r}") from None


def _host_port(text: str) -> tuple[str, int]:
    try:
        host, port = text.rsplit(":", 1)
        return host, int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--node", default="goodput-e2e-node")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/goodput-e2e-pods"))
    ap.add_argument("--gpus", type=int, default=8, help="nvidia.com/gpu the node advertises")
    ap.add_argument("--probe-period", type=float, default=1.0, help="seconds between probe rounds")
    ap.add_argument("--api-forward", type=_forward_spec, default=None, metavar="HOST:PORT=HOST:PORT",
                    help="listen on the first address (on the pod bridge) and forward to the API server")
    ap.add_argument("--serve", type=_host_port, default=None, metavar="HOST:PORT",
                    help="serve the container-log endpoint (HTTPS) for the API server there")
    ap.add_argument("--tls-cert", type=Path, help="the log endpoint's certificate (with --serve)")
    ap.add_argument("--tls-key", type=Path, help="its key")
    ap.add_argument("--client-ca", type=Path, help="CA of the client certificates accepted (the API server's)")
    a = ap.parse_args(argv)
    if a.serve is not None and not (a.tls_cert and a.tls_key and a.client_ca):
        ap.error("--serve needs --tls-cert, --tls-key and --client-ca")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kubelet %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe otherwise
    a.log_dir.mkdir(parents=True, exist_ok=True)
    k = Kubelet(a.node, a.log_dir, a.gpus, a.probe_period, a.api_forward,
                (a.serve, a.tls_cert, a.tls_key, a.client_ca) if a.serve else None)

    def _stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        k.stopping.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        k.run()
    except KeyboardInterrupt:
        pass
    finally:
        k.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
