"""llama.cpp's own OpenAI-compatible server (`llama-server`) as a benchmark baseline.

Built by ``bench/setup_baselines.sh`` from the llama.cpp source vendored in the llama-cpp-python
sdist, into ``$GOODPUT_BENCH_CACHE/llama-server-build-<version>/bin/llama-server``.

How it is started (:func:`llama_server_cmd`): ``--parallel N`` slots = the client's concurrency,
continuous batching (its default), ``-c`` = N × the per-slot context (each slot gets ``c / N``
when the KV cache is not unified, which is llama-server's default with an explicit ``-np``),
``-t``/``-tb`` = our thread count.

AMX: a ``-DGGML_NATIVE=ON`` build on an AMX CPU (``amx_int8`` in /proc/cpuinfo) compiles ggml's
AMX "extra buffer type", which repacks the quantized weights for AMX tile matmuls. In this VM
that path crashes: llama-server with its defaults dies with SIGILL as its context initializes
(checked 2026-12-01 with this build), and the llama-cpp-python build segfaulted in
``ggml_backend_amx_mul_mat``. llama-server's own switch for it is ``--no-repack`` (``-nr``; env
``LLAMA_ARG_REPACK=false``; it sets ``no_extra_bufts``): the weights stay in the plain CPU buffer
and the AVX-512 kernels for the file's types (Q4_1, Q8_0) run. On x86 ggml-cpu's other repacked
layouts (``repack.cpp``) are for Q4_0, Q2_K/Q4_K/Q5_K/Q6_K, IQ4_NL and MXFP4 (Q8_0's only on
ARM/RISC-V) and there is none for Q4_1, so on this file (Q4_1 layers, Q8_0 embedding/head) the
switch removes only the AMX path. The benchmark decides per machine (:func:`choose_flags`): it
first starts llama-server with llama.cpp's defaults and sends one request; only when that
crashes does it add :data:`AMX_SWITCH`, and the results say which happened.
``GOODPUT_LLAMA_EXTRA_BUFTS=0`` / ``=1`` skips the probe and forces the switch on / off.
"""
from __future__ import annotations

import glob
import os
import subprocess

CACHE = os.environ.get("GOODPUT_BENCH_CACHE", os.path.expanduser("~/.cache/goodput-bench"))
VERSION = os.environ.get("LLAMA_CPP_VERSION", "0.3.36")

#: llama-server's flag that keeps weights out of ggml's extra (AMX / repacked) CPU buffer types
AMX_SWITCH = "--no-repack"


def llama_server_path() -> str | None:
    """The built binary (this VERSION first, else any cached build), or None."""
    exact = os.path.join(CACHE, f"llama-server-build-{VERSION}", "bin", "llama-server")
    if os.access(exact, os.X_OK):
        return exact
    found = sorted(glob.glob(os.path.join(CACHE, "llama-server-build-*", "bin", "llama-server")))
    return found[-1] if found else None


def forced_choice() -> bool | None:
    """GOODPUT_LLAMA_EXTRA_BUFTS: "1" = keep llama.cpp's default extra buffer types (no switch),
    "0" = always add the switch; unset = probe (None)."""
    v = os.environ.get("GOODPUT_LLAMA_EXTRA_BUFTS")
    return None if v is None else v != "1"


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(ln.startswith("flags") and "amx_int8" in ln.split() for ln in f)
    except OSError:
        return False


def llama_server_cmd(binary: str, gguf_path: str, port: int, parallel: int, ctx_per_slot: int,
                     threads: int, no_repack: bool = True) -> list[str]:
    """The llama-server command line for `parallel` slots of `ctx_per_slot` tokens each, with
    :data:`AMX_SWITCH` when `no_repack`.

    ValueError for parallel, ctx_per_slot or threads < 1.
    """
    if parallel < 1 or ctx_per_slot < 1 or threads < 1:
        raise ValueError(f"parallel, ctx_per_slot and threads must be >= 1, got {parallel}, "
                         f"{ctx_per_slot}, {threads}")
    cmd = [binary, "-m", gguf_path, "--host", "127.0.0.1", "--port", str(port),
           "--parallel", str(parallel), "-c", str(parallel * ctx_per_slot),
           "-t", str(threads), "-tb", str(threads), "--cont-batching", "--no-webui"]
    if no_repack:
        cmd.append(AMX_SWITCH)
    return cmd


def probe_defaults(binary: str, gguf_path: str, threads: int, log_path: str) -> tuple[bool, str]:
    """Start llama-server with llama.cpp's defaults (one slot) and complete one 4-token request.
    Returns (worked, what happened: e.g. "exited with signal 4 (SIGILL) while starting")."""
    import signal

    import httpx

    from .servers import Server, free_port
    port = free_port()
    cmd = llama_server_cmd(binary, gguf_path, port, 1, 256, threads, no_repack=False)
    srv = Server(cmd, port, log_path, ready_path="/health", ready_timeout=120)
    try:
        srv.__enter__()
    except RuntimeError:
        rc = srv.proc.returncode if srv.proc else None
        sig = f"signal {-rc} ({signal.Signals(-rc).name})" if rc is not None and rc < 0 else f"exit code {rc}"
        return False, f"exited with {sig} while starting"
    try:
        r = httpx.post(srv.base_url + "/v1/completions", timeout=120,
                       json={"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return True, "started and completed a request"
    except httpx.HTTPError as e:
        rc = srv.proc.poll() if srv.proc else None
        if rc is not None and rc < 0:
            return False, f"exited with signal {-rc} ({signal.Signals(-rc).name}) on its first request"
        return False, f"first request failed: {type(e).__name__}"
    finally:
        srv.stop()


def choose_flags(binary: str, gguf_path: str, threads: int, log_path: str) -> tuple[bool, str]:
    """(add --no-repack?, why) for this machine: forced by GOODPUT_LLAMA_EXTRA_BUFTS, else by
    :func:`probe_defaults`."""
    forced = forced_choice()
    if forced is not None:
        return forced, ("forced by GOODPUT_LLAMA_EXTRA_BUFTS=" + os.environ["GOODPUT_LLAMA_EXTRA_BUFTS"])
    ok, what = probe_defaults(binary, gguf_path, threads, log_path)
    if ok:
        return False, f"with llama.cpp's defaults it {what}, so they are kept"
    return True, f"with llama.cpp's defaults (extra buffer types on) it {what}"


def version(binary: str) -> str:
    """`llama-server --version` (first line that names the version), or '' when it fails."""
    try:
        p = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "version" in ln]
    return lines[0].strip() if lines else ""
