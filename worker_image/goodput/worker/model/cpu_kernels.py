"""Build, cache and call goodput's C++ CPU kernels (``csrc/``): paged decode attention
(``paged_attention.cpp``) and paged prefill attention (``paged_prefill.cpp``), both used by the
``cpu`` attention backend, and fused decoder-layer ops
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
- **Prebuilt levels** (``--levels all`` or ``--levels avx2,baseline``; the worker image's build): the same
  sources compiled for an instruction-set level of ``cpu_isa.LEVELS`` (``-march=x86-64-v4``
  ``-mavx512bf16``, ``x86-64-v4``, ``x86-64-v3``, ``x86-64-v2``) instead of ``-march=native``, as
  ``goodput_cpu_kernels_<level>_<12 hex>.so`` (the hash leaves this CPU's flags out): an image built
  on one machine runs on any x86-64 node.
- **Load** (:func:`load`): imports ``<name>.so`` from the cache, else the best prebuilt level this
  CPU runs (``cpu_isa.pick``; ``GOODPUT_CPU_KERNELS_LEVEL`` forces one; the log says which and why) — no compiler, ninja or source
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

from goodput.worker.model import cpu_isa

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / f
           for f in ("paged_attention.cpp", "paged_prefill.cpp", "layer_ops.cpp", "block_linear.cpp", "decode_step.cpp", "bindings.cpp")]
HEADERS = [Path(__file__).with_name("csrc") / f for f in ("kernel_api.h", "kernel_inner.h", "decode_step.h", "fast_math.h")]  # part of the build's key, not compiled
# no FMA contraction: the fused layer ops keep torch's separate roundings of a*b + c*d
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]
_PORTABLE_CFLAGS = [f for f in CFLAGS if not f.startswith("-march=")]  # + a level's -march flags
LDFLAGS = ["-fopenmp"]
POLICY_ENV = "GOODPUT_CPU_KERNELS"  # 0 | prebuilt | 1 (default): see the module docstring
DIR_ENV = "GOODPUT_CPU_KERNELS_DIR"
LEVEL_ENV = "GOODPUT_CPU_KERNELS_LEVEL"  # force one prebuilt level (cpu_isa.LEVELS' names)
BUILD_COMMAND = "python -m goodput.worker.model.cpu_kernels"
_error: str | None = None


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpu_flags() -> str:
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            return line
    import platform
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    """Where built kernels live: ``$GOODPUT_CPU_KERNELS_DIR`` or ``<worker cache>/cpu-kernels``."""
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    # the worker image's kernel stage sets DIR_ENV and has only this module, cpu_isa and torch
    from goodput.worker.model.gguf_loader import default_cache_dir
    return default_cache_dir() / "cpu-kernels"


def _key(*parts: str) -> str:
    src = "\0".join(p.read_text() for p in SOURCES + HEADERS)
    return hashlib.sha256("\0".join([src, *parts, torch.__version__]).encode()).hexdigest()[:12]


def kernel_name(level: str | None = None) -> str:
    """The build's file name: for this CPU (``level`` None), ``goodput_cpu_kernels_<12 hex>`` of the
    sources, flags, CPU flags and torch version; for a prebuilt level,
    ``goodput_cpu_kernels_<level>_<12 hex>`` of the sources, the level's flags and torch's version.
    Raises KeyError for a level not in ``cpu_isa.LEVELS``."""
    if level is None:
        return f"goodput_cpu_kernels_{_key(' '.join(CFLAGS), _cpu_flags())}"
    return f"goodput_cpu_kernels_{level}_{_key(' '.join(_cflags(level)))}"


def _cflags(level: str | None) -> list[str]:
    return CFLAGS if level is None else _PORTABLE_CFLAGS + list(cpu_isa.BY_NAME[level].cflags)


def built_levels(d: Path) -> list[str]:
    """The prebuilt levels (names) whose file for the current sources and torch is in ``d``."""
    return [lv.name for lv in cpu_isa.LEVELS if (d / f"{kernel_name(lv.name)}.so").exists()]


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _last_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"


def build(force: bool = False, level: str | None = None) -> ModuleType:
    """Compile the kernels into the cache unless there already (at most once across processes):
    for this CPU (``-march=native``), or for a prebuilt ``level`` of ``cpu_isa.LEVELS``.

    Returns the loaded module (a level this CPU cannot run is built but not imported: returns None).
    Raises RuntimeError when the build fails, or failed before for these sources
    (``<name>.failed``; ``force=True`` removes that record and tries again).
    """
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    name = kernel_name(level)
    runs_here = level is None or cpu_isa.BY_NAME[level].needs <= cpu_isa.cpu_flags(_cpuinfo())
    so, failed = d / f"{name}.so", d / f"{name}.failed"
    with open(d / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same name: wait for its result
        if force:
            failed.unlink(missing_ok=True)
        if so.exists():
            return _import(name, so) if runs_here else None
        if failed.exists():
            raise RuntimeError(f"an earlier build of these sources failed ({failed.read_text().strip()}); "
                               f"`{BUILD_COMMAND} --force` retries")
        log.info("building the C++ CPU kernels %s into %s (~1 min)", name, d)
        from torch.utils import cpp_extension

        work = Path(tempfile.mkdtemp(prefix=f"{name}.build-", dir=d))
        try:
            kw = dict(name=name, sources=[str(p) for p in SOURCES], extra_cflags=_cflags(level),
                      extra_ldflags=LDFLAGS, build_directory=str(work), verbose=False)
            if runs_here:
                mod = cpp_extension.load(**kw)
            else:  # compile only: importing code for instructions this CPU lacks could die of SIGILL
                cpp_extension._write_ninja_file_and_build_library(
                    **kw, extra_cuda_cflags=None, extra_sycl_cflags=None, extra_include_paths=None,
                    with_cuda=False, with_sycl=False)
            tmp = d / f".{name}.so.{os.getpid()}"
            shutil.copyfile(work / f"{name}.so", tmp)
            os.replace(tmp, so)  # atomic: a loader sees the whole file or none
            return mod if runs_here else None
        except Exception as e:  # noqa: BLE001 - record any build failure for the next processes
            tmp = d / f".{name}.failed.{os.getpid()}"
            tmp.write_text(_last_line(e) + "\n")
            os.replace(tmp, failed)
            raise RuntimeError(f"building the C++ CPU kernels failed: {_last_line(e)}") from e
        finally:
            shutil.rmtree(work, ignore_errors=True)


@functools.cache
def load() -> ModuleType | None:
    """The kernels' extension module, or None (see :func:`load_error`): the cached build for this CPU,
    else the best prebuilt level it runs (``cpu_isa.pick``), else a new build unless
    ``GOODPUT_CPU_KERNELS=prebuilt`` (never compile: the torch path instead). Logs which and why."""
    global _error
    try:
        name = kernel_name()
        so = cache_dir() / f"{name}.so"
        if so.exists() and not os.environ.get(LEVEL_ENV):
            log.info("C++ CPU kernels: %s, built on this machine for its CPU (-march=native)", so)
            return _import(name, so)
        built = built_levels(so.parent)
        if built or os.environ.get(LEVEL_ENV):
            level, why = cpu_isa.pick(cpu_isa.cpu_flags(_cpuinfo()), built, os.environ.get(LEVEL_ENV))
            if level is None:
                raise RuntimeError(f"no prebuilt level of the C++ CPU kernels fits: {why}")
            so = so.parent / f"{kernel_name(level.name)}.so"
            log.info("C++ CPU kernels: level %s (%s) from %s: %s", level.name, " ".join(level.cflags), so.name, why)
            return _import(so.stem, so)
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
    ap.add_argument("--levels", type=_levels, metavar="all|none|LEVEL,...",
                    help="build these prebuilt instruction-set levels (cpu_isa.LEVELS: "
                         f"{', '.join(cpu_isa.BY_NAME)}) instead of one for this CPU (-march=native)")
    ap.add_argument("--prune", action="store_true",
                    help="then delete every other file of the cache directory (older builds, locks)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    levels: list[str | None] = [None] if a.levels is None else a.levels
    for level in levels:
        try:
            build(force=a.force, level=level)
        except RuntimeError as e:
            print(f"CPU kernels unavailable ({e}); the worker uses the torch reference ops", file=sys.stderr)
            return 1
        print(f"CPU kernels (paged decode and prefill attention, block linears, fused layer ops, the native decode step): ready in {cache_dir() / kernel_name(level)}.so")
    if a.prune:
        keep = {f"{kernel_name(level)}.so" for level in levels}
        for f in cache_dir().iterdir():
            if f.name not in keep:
                shutil.rmtree(f) if f.is_dir() else f.unlink()
    return 0


def _levels(text: str) -> list[str]:
    """``--levels``: "all", "none" or level names separated by commas or spaces."""
    names = text.replace(",", " ").split()
    if names == ["all"]:
        return list(cpu_isa.BY_NAME)
    if names == ["none"]:
        return []
    if unknown := [n for n in names if n not in cpu_isa.BY_NAME]:
        raise argparse.ArgumentTypeError(f"unknown level(s) {', '.join(unknown)}; known: {', '.join(cpu_isa.BY_NAME)}")
    return names


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
