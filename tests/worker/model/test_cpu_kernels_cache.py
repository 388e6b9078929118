"""The C++ kernels' build/load policy (cpu_kernels.build/load): a start never compiles with
GOODPUT_CPU_KERNELS=prebuilt, concurrent starts build once, a failed build is not retried by later
processes. Real builds through torch's cpp_extension with a tiny extension source (a C++ file with no
torch headers: compiles in about a second) and a compiler wrapper ($CXX) that records each call, so
"how many builds" is counted, not timed: one build is one link (``-shared``) call.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

TINY = textwrap.dedent("""
    #include <Python.h>
    #define GP_CAT(a, b) a##b
    #define GP_INIT(n) GP_CAT(PyInit_, n)
    static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, nullptr};
    PyMODINIT_FUNC GP_INIT(TORCH_EXTENSION_NAME)(void) {
        PyObject *m = PyModule_Create(&def);
        PyModule_AddIntConstant(m, "answer", 42);
        return m;
    }
""")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY)
    calls = tmp_path / "cxx-calls.txt"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec c++ "$@"\n')
    wrapper.chmod(0o755)
    e = dict(os.environ)
    e.update(CXX=str(wrapper), GOODPUT_CPU_KERNELS_DIR=str(tmp_path / "cache"),
             TORCH_EXTENSIONS_DIR=str(tmp_path / "torch-ext"), GP_TINY_SRC=str(src), GP_CALLS=str(calls))
    e.pop("GOODPUT_CPU_KERNELS", None)
    return e


# a process starting up as a worker would: load() with the sources replaced by the tiny one
START = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from goodput.worker.model import cpu_kernels as k
    k.SOURCES = [Path(os.environ["GP_TINY_SRC"])]
    k.CFLAGS = ["-O0"]
    m = k.load()
    print("LOADED", m.answer if m is not None else None)
    print("ERROR", k.load_error())
""")


def start(env: dict[str, str], policy: str | None = None) -> subprocess.Popen:
    e = dict(env)
    if policy is not None:
        e["GOODPUT_CPU_KERNELS"] = policy
    return subprocess.Popen([sys.executable, "-c", START], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def result(p: subprocess.Popen) -> tuple[str, str]:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("LOADED", "ERROR")))
    return lines["LOADED"], lines["ERROR"]


def builds(env: dict[str, str]) -> int:
    calls = Path(env["GP_CALLS"])
    return sum("-shared" in line for line in calls.read_text().splitlines()) if calls.exists() else 0


def test_prebuilt_start_never_compiles_and_says_what_to_run(env):
    loaded, error = result(start(env, "prebuilt"))
    assert loaded == "None"
    assert "not built" in error and "python -m goodput.worker.model.cpu_kernels" in error
    assert not Path(env["GP_CALLS"]).exists(), "the compiler ran"


def test_concurrent_starts_build_once_then_load_without_a_compiler(env):
    procs = [start(env) for _ in range(3)]
    assert [result(p)[0] for p in procs] == ["42"] * 3
    assert builds(env) == 1
    # a later start, prebuilt: loads the cached build; the compiler is not even found
    e = dict(env, CXX="/nonexistent/c++")
    assert result(start(e, "prebuilt")) == ("42", "None")
    assert builds(env) == 1


def test_a_failed_build_is_recorded_and_not_repeated_by_the_next_process(env):
    Path(env["GP_TINY_SRC"]).write_text("#error goodput test: this source does not compile\n")
    loaded, error = result(start(env))
    assert loaded == "None" and "failed" in error
    calls = Path(env["GP_CALLS"]).read_text()
    assert "tiny.cpp" in calls
    for policy in (None, "prebuilt"):  # new processes: no compiler call, the recorded reason
        loaded, error = result(start(env, policy))
        assert loaded == "None" and "failed" in error
        assert Path(env["GP_CALLS"]).read_text() == calls
    # --force retries (and fails again, recording it again)
    r = subprocess.run([sys.executable, "-c", "import os, sys\nfrom pathlib import Path\n"
                        "from goodput.worker.model import cpu_kernels as k\n"
                        "k.SOURCES = [Path(os.environ['GP_TINY_SRC'])]\nk.CFLAGS = ['-O0']\n"
                        "sys.exit(k.main(['--force']))"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "failed" in r.stderr
    assert len(Path(env["GP_CALLS"]).read_text()) > len(calls)


def test_the_operator_starts_workers_with_the_prebuilt_policy():
    from goodput.api import crd as api
    from goodput.operator import resources
    from goodput.worker.model import cpu_kernels

    (c,) = resources.pod_template("x", api.InferenceServiceSpec())["spec"]["containers"]
    assert {"name": cpu_kernels.POLICY_ENV, "value": "prebuilt"} in c["env"]
