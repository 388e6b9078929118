"""Build, cache and call goodput's C++ CPU kernels (``csrc/``): paged decode attention
(``paged_attention.cpp``, used by the ``cpu`` attention backend) and fused decoder-layer ops
(``layer_ops.cpp``: RMSNorm, residual add + RMSNorm, RoPE, SiLU·up; used by ``llama.py``) and
linears over a GGUF file's own 4/8-bit blocks (``block_linear.cpp``, ``block_linear.py``).

Building and loading are separate steps, so a worker never compiles while it starts:

- **Build** (``python -m goodput.worker.model.cpu_kernels``; ``scripts/setup.sh`` runs it once, the
  worker image's Dockerfile at build time): torch's ``torch.utils.cpp_extension.load`` compiles the
  sources (g++ with OpenMP, ``-O3 -march=native``, ~1 min on 2 cores) and the shared library is moved
  into the cache atomically (``os.replace``) as ``<name>.so``. ``<name>`` is
  ``goodput_cpu_kernels_<12 hex>``, a SHA-256 of the sources, the flags, this CPU's instruction-set
  flags and torch's version: a changed source or another CPU is another file, never a stale one.
  Builds of one name are serialized by an exclusive ``flock`` on ``<name>.lock`` (released by the
  kernel if the builder dies), and the builder that gets the lock first checks for the file again:
  concurrent starts build at most once. A build that fails writes ``<name>.failed`` (the compiler's
  last error line), so no later process pays for the same failing compile; ``--force`` retries.
- **Load** (:func:`load`): imports ``<name>.so`` from the cache — no compiler, ninja or source
  timestamps involved (torch's JIT loader re-runs ninja in every new process and recompiles whenever a
  source's mtime is newer than its output, e.g. after a checkout). With ``GOODPUT_CPU_KERNELS`` unset
  or ``1``, a miss builds as above (library use, tests); with ``prebuilt`` — what the operator sets in
  worker pods — a miss never compiles: :func:`load` returns None and :func:`load_error` says why and
  what to run, and the worker uses the torch path (``auto`` attention backend → ``torch``, the model's
  torch ops). ``0`` turns the kernels off (:func:`available`).

Cache directory: ``$GOODPUT_CPU_KERNELS_DIR``, else ``cpu-kernels`` under the worker's cache
(``$GOODPUT_CACHE_DIR``, default ``~/.cache/goodput``).
"""
from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

from goodput.worker.model.gguf_loader import default_cache_dir

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / f
           for f in ("paged_attention.cpp", "layer_ops.cpp", "block_linear.cpp", "bindings.cpp")]
# no FMA contraction: the fused layer ops keep torch's separate roundings of a*b + c*d
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]
POLICY_ENV = "GOODPUT_CPU_KERNELS"  # 0 | prebuilt | 1 (default): see the module docstring
DIR_ENV = "GOODPUT_CPU_KERNELS_DIR"
BUILD_COMMAND = "python -m goodput.worker.model.cpu_kernels"
_error: str | None = None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    """Where built kernels live: ``$GOODPUT_CPU_KERNELS_DIR`` or ``<worker cache>/cpu-kernels``."""
    return Path(os.environ.get(DIR_ENV) or default_cache_dir() / "cpu-kernels")


def kernel_name() -> str:
    """``goodput_cpu_kernels_<12 hex>`` of the current sources, flags, CPU and torch version."""
    src = "\0".join(p.read_text() for p in SOURCES)
    key = hashlib.sha256("\0".join([src, " ".join(CFLAGS), _cpu_flags(), torch.__version__]).encode())
    return f"goodput_cpu_kernels_{key.hexdigest()[:12]}"


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _last_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"


def build(force: bool = False) -> ModuleType:
    """Compile the kernels into the cache unless there already (at most once across processes).

    Returns the loaded module. Raises RuntimeError when the build fails, or failed before for these
    sources (``<name>.failed``; ``force=True`` removes that record and tries again).
    """
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    name = kernel_name()
    so, failed = d / f"{name}.so", d / f"{name}.failed"
    with open(d / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same name: wait for its result
        if force:
            failed.unlink(missing_ok=True)
        if so.exists():
            return _import(name, so)
        if failed.exists():
            raise RuntimeError(f"an earlier build of these sources failed ({failed.read_text().strip()}); "
                               f"`{BUILD_COMMAND} --force` retries")
        log.info("building the C++ CPU kernels %s into %s (~1 min)", name, d)
        from torch.utils import cpp_extension

        work = Path(tempfile.mkdtemp(prefix=f"{name}.build-", dir=d))
        try:
            mod = cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
                                     extra_ldflags=LDFLAGS, build_directory=str(work), verbose=False)
            tmp = d / f".{name}.so.{os.getpid()}"
            shutil.copyfile(work / f"{name}.so", tmp)
            os.replace(tmp, so)  # atomic: a loader sees the whole file or none
            return mod
        except Exception as e:  # noqa: BLE001 - record any build failure for the next processes
            tmp = d / f".{name}.failed.{os.getpid()}"
            tmp.write_text(_last_line(e) + "\n")
            os.replace(tmp, failed)
            raise RuntimeError(f"building the C++ CPU kernels failed: {_last_line(e)}") from e
        finally:
            shutil.rmtree(work, ignore_errors=True)


@functools.cache
def load() -> ModuleType | None:
    """The kernels' extension module, or None (see :func:`load_error`): the cached build, else a new
    build unless ``GOODPUT_CPU_KERNELS=prebuilt`` (never compile: the torch path instead)."""
    global _error
    try:
        name = kernel_name()
        so = cache_dir() / f"{name}.so"
        if so.exists():
            return _import(name, so)
        if os.environ.get(POLICY_ENV, "1") == "prebuilt":
            failed = so.with_suffix(".failed")
            why = f"building them failed: {failed.read_text().strip()}" if failed.exists() else "not built"
            _error = (f"{name} is not in {so.parent} ({why}); {POLICY_ENV}=prebuilt never compiles at start-up: "
                      f"run `{BUILD_COMMAND}` once (scripts/setup.sh does; the worker image ships them)")
        else:
            return build()
    except Exception as e:  # noqa: BLE001 - any failure means "use the torch path"
        _error = _last_line(e) if not isinstance(e, RuntimeError) else str(e)
    log.warning("C++ CPU kernels unavailable (%s); using the torch reference ops", _error)
    return None


def load_error() -> str | None:
    """Why :func:`load` returned None (None when it has not failed)."""
    return _error


def available() -> bool:
    """True when the kernels are loaded here; GOODPUT_CPU_KERNELS=0 says no."""
    return loaded() is not None


def loaded() -> ModuleType | None:
    """:func:`load`, or None when GOODPUT_CPU_KERNELS=0 (the torch reference ops everywhere)."""
    if os.environ.get(POLICY_ENV, "1") == "0":
        return None
    return load()


def main(argv: list[str] | None = None) -> int:
    """``python -m goodput.worker.model.cpu_kernels [--force]``: build into the cache; prints the file."""
    ap = argparse.ArgumentParser(description="Build goodput's C++ CPU kernels once into their cache.")
    ap.add_argument("--force", action="store_true", help="retry a build that failed before for these sources")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        build(force=a.force)
    except RuntimeError as e:
        print(f"CPU kernels unavailable ({e}); the worker uses the torch reference ops", file=sys.stderr)
        return 1
    print(f"CPU kernels (paged decode attention, fused layer ops): ready in {cache_dir() / kernel_name()}.so")
    return 0


def num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, threads: int | None = None,
               min_tokens: int = 256) -> int:
    """Parts each sequence's context is split into so that every thread gets work when there are
    fewer (sequence, KV head) pairs than ~4 per thread, each part at least ``min_tokens`` long; the
    smallest such count up to twice that which gives every thread the same number of parts
    (measured, 1 sequence x 3 KV heads x 8k tokens on 2 threads: 4 parts 10.5 ms, 3 parts 12.1)."""
    threads = threads or torch.get_num_threads()
    units = max(1, num_seqs * num_kv_heads)
    want = -(-4 * threads // units)
    cap = max_seq_len // min_tokens
    even = [s for s in range(want, min(2 * want, cap) + 1) if units * s % threads == 0]
    return even[0] if even else max(1, min(want, cap))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           splits: int = 1) -> torch.Tensor:
    """softmax(scale · q·Kᵀ) · V for one query token per sequence, reading K/V in place.

    q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KV, D] (q's dtype: float32 or
    bfloat16; H a multiple of KV); block_tables: int32 [B, max_blocks]; seq_lens: int32 [B]
    (sequence b attends to its positions [0, seq_lens[b])). Returns [B, H, D] in q's dtype;
    softmax and accumulation in float32. Raises ValueError for block ids outside the pool or
    lengths outside [0, max_blocks · block_size], RuntimeError when the kernels are unavailable
    and for shape/dtype mismatches (from the C++ checks).
    """
    mod = load()
    if mod is None:
        raise RuntimeError(f"C++ CPU kernels unavailable: {load_error()}")
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    if block_tables.numel() and (int(block_tables.min()) < 0 or int(block_tables.max()) >= nb):
        raise ValueError(f"block id outside the pool [0, {nb})")
    if seq_lens.numel() and (int(seq_lens.min()) < 0 or int(seq_lens.max()) > block_tables.shape[1] * bs):
        raise ValueError(f"seq_lens outside [0, {block_tables.shape[1] * bs}]")
    return checked_call(mod, q, k_cache, v_cache, block_tables, seq_lens, scale, splits)


def checked_call(mod: ModuleType, q, k_cache, v_cache, block_tables, seq_lens, scale: float, splits: int):
    """The kernel without the value checks of :func:`paged_decode_attention` (a caller that
    validated block tables and lengths once per step calls this once per layer)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    return mod.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, float(scale), int(splits))


if __name__ == "__main__":
    raise SystemExit(main())
