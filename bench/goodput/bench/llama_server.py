"""llama.cpp's own OpenAI-compatible server (`llama-server`) as a benchmark baseline.

Built by ``bench/setup_baselines.sh`` from the llama.cpp source vendored in the llama-cpp-python
sdist, into ``$GOODPUT_BENCH_CACHE/llama-server-build-<version>/bin/llama-server``.

How it is started (:func:`llama_server_cmd`): ``--parallel N`` slots = the client's concurrency,
continuous batching (its default), ``-c`` = N × the per-slot context (each slot gets ``c / N``
when the KV cache is not unified, which is llama-server's default with an explicit ``-np``),
``-t``/``-tb`` = our thread count.

AMX: a ``-DGGML_NATIVE=ON`` build on an AMX CPU (``amx_int8`` in /proc/cpuinfo) compiles ggml's
AMX "extra buffer type", which repacks the quantized weights for AMX tile matmuls; in this VM
that path segfaulted (ggml_backend_amx_mul_mat) in the llama-cpp-python baseline. llama-server's
own switch for it is ``--no-repack`` (``-nr``; env ``LLAMA_ARG_REPACK=false``; it sets
``no_extra_bufts``): the weights stay in the plain CPU buffer and the AVX-512 kernels for the
file's types (Q4_1, Q8_0) run. On x86 ggml-cpu's other repacked layouts (``repack.cpp``) are for
Q4_0, Q2_K/Q4_K/Q5_K/Q6_K, IQ4_NL and MXFP4 (Q8_0's only on ARM/RISC-V) and there is none for
Q4_1, so on this file (Q4_1 layers, Q8_0 embedding/head) the switch removes only the AMX path. :data:`AMX_SWITCH` is applied unless ``GOODPUT_LLAMA_EXTRA_BUFTS=1``.
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


def amx_switch_on() -> bool:
    return os.environ.get("GOODPUT_LLAMA_EXTRA_BUFTS") != "1"


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(ln.startswith("flags") and "amx_int8" in ln.split() for ln in f)
    except OSError:
        return False


def llama_server_cmd(binary: str, gguf_path: str, port: int, parallel: int, ctx_per_slot: int,
                     threads: int) -> list[str]:
    """The llama-server command line for `parallel` slots of `ctx_per_slot` tokens each.

    ValueError for parallel, ctx_per_slot or threads < 1.
    """
    if parallel < 1 or ctx_per_slot < 1 or threads < 1:
        raise ValueError(f"parallel, ctx_per_slot and threads must be >= 1, got {parallel}, "
                         f"{ctx_per_slot}, {threads}")
    cmd = [binary, "-m", gguf_path, "--host", "127.0.0.1", "--port", str(port),
           "--parallel", str(parallel), "-c", str(parallel * ctx_per_slot),
           "-t", str(threads), "-tb", str(threads), "--cont-batching", "--no-webui"]
    if amx_switch_on():
        cmd.append(AMX_SWITCH)
    return cmd


def version(binary: str) -> str:
    """`llama-server --version` (first line that names the version), or '' when it fails."""
    try:
        p = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "version" in ln]
    return lines[0].strip() if lines else ""
