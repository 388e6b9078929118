"""Start and stop the servers under test as subprocesses on 127.0.0.1 (free ports, logs to files)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx

CACHE = os.environ.get("GOODPUT_BENCH_CACHE", os.path.expanduser("~/.cache/goodput-bench"))
LLAMA_VENV_PY = os.path.join(CACHE, "llama-venv", "bin", "python")


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Server:
    """A server subprocess; `with Server(cmd, port, log) as s:` waits until GET <ready_path> is 200.

    Raises RuntimeError (with the log's tail) when it exits early or is not ready in time.
    """

    def __init__(self, cmd: list[str], port: int, log_path: str, ready_path: str = "/v1/models",
                 ready_timeout: float = 300.0, env: dict | None = None):
        self.cmd, self.port, self.log_path = cmd, port, log_path
        self.ready_path, self.ready_timeout = ready_path, ready_timeout
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.base_url = f"http://127.0.0.1:{port}"

    def _tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def __enter__(self) -> Server:
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        self._log = open(self.log_path, "w")
        self._log.write("$ " + " ".join(self.cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.time() + self.ready_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self._tail()}")
            try:
                if httpx.get(self.base_url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {self.ready_timeout}s: {self._tail()}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            # our own process group only (start_new_session=True)
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if getattr(self, "_log", None):
            self._log.close()

    def __exit__(self, *exc) -> None:
        self.stop()


def goodput_worker_cmd(port: int, model: str = "smollm2", **flags) -> list[str]:
    """`goodput-worker serve` with flags given as python names (max_num_seqs=8 -> --max-num-seqs 8;
    True -> bare flag; False -> --no-<flag>; None -> omitted)."""
    exe = shutil.which("goodput-worker") or os.path.join(os.path.dirname(sys.executable), "goodput-worker")
    cmd = [exe, "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port)]
    for k, v in flags.items():
        name = "--" + k.replace("_", "-")
        if v is None:
            continue
        if v is True:
            cmd.append(name)
        elif v is False:
            cmd.append("--no-" + k.replace("_", "-"))
        else:
            cmd += [name, str(v)]
    return cmd


def llama_cpp_available() -> bool:
    return os.path.exists(LLAMA_VENV_PY)


def llama_cpp_cmd(port: int, gguf_path: str, n_ctx: int = 4096, n_threads: int | None = None) -> list[str]:
    """llama-cpp-python's OpenAI server (built by bench/setup_baselines.sh) on the GGUF file.

    Started through llama_cpp_launcher.py (extra buffer types off: the AMX path crashes here).
    Note: that server handles one request at a time (a global lock around its one llama context);
    it has no parallel slots, so concurrent clients queue.
    """
    n_threads = n_threads or os.cpu_count() or 1
    launcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_cpp_launcher.py")
    return [LLAMA_VENV_PY, launcher, "--model", gguf_path, "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(n_threads),
            "--n_threads_batch", str(n_threads), "--n_batch", "512", "--verbose", "False",
            # its default aborts the streaming request whenever another arrives; a benchmark queues them
            "--interrupt_requests", "False"]
