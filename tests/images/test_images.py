"""What of the images can be checked without building them: the Containerfiles' shape, the tags that
images/build.py derives, and the worker's choice of a prebuilt C++ kernel level (cpu_isa.pick)
against real CPUs' flag sets and the compiler's own definition of each level.
(`bash images/build.sh` builds them; images/smoke.sh runs them.)"""
from __future__ import annotations

import ast
import os
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from goodput.worker.model import cpu_isa

ROOT = Path(__file__).resolve().parents[2]


def _load_build():
    spec = importlib.util.spec_from_file_location("images_build", ROOT / "images" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["images_build"] = mod
    spec.loader.exec_module(mod)
    return mod


build = _load_build()

# /proc/cpuinfo flags (the ISA part) of real CPUs
ZEN3 = ("fpu sse sse2 pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand "
        "lahf_lm abm sse4a bmi1 avx2 bmi2 erms rdseed adx sha_ni xsaveopt vaes vpclmulqdq")
ICELAKE = ("fpu sse sse2 pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand lahf_lm abm "
           "bmi1 avx2 bmi2 avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512vbmi avx512_vnni gfni")
SAPPHIRE_RAPIDS = ICELAKE + " avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8 avx_vnni"
ZEN4 = ZEN3 + " avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vnni"
NEHALEM = "fpu sse sse2 pni ssse3 cx16 sse4_1 sse4_2 popcnt lahf_lm"
CORE2 = "fpu sse sse2 pni ssse3 cx16 lahf_lm"
ALL = [lv.name for lv in cpu_isa.LEVELS]


@pytest.mark.parametrize("flags, built, level", [
    (SAPPHIRE_RAPIDS, ALL, "avx512bf16"),
    (ZEN4, ALL, "avx512bf16"),
    (ICELAKE, ALL, "avx512"),
    (ZEN3, ALL, "avx2"),
    (NEHALEM, ALL, "baseline"),
    (CORE2, ALL, None),                        # no SSE4.2/POPCNT: below the lowest level
    (SAPPHIRE_RAPIDS, ["avx2", "baseline"], "avx2"),  # only what was built counts
    (ZEN3, ["avx512bf16", "avx512"], None),
    (ZEN3, [], None),
])
def test_pick_chooses_the_best_built_level_the_cpu_runs(flags, built, level):
    got, why = cpu_isa.pick(flags.split(), built)
    assert (got.name if got else None) == level, why
    assert why


def test_pick_says_which_flags_rule_a_level_out():
    lv, why = cpu_isa.pick(ICELAKE.split(), ALL)
    assert lv.name == "avx512" and "not avx512bf16 (lacks avx512_bf16)" in why
    lv, why = cpu_isa.pick(ZEN3.split(), ALL)
    assert lv.name == "avx2" and "avx512f" in why and "avx512bw" in why
    assert cpu_isa.pick(CORE2.split(), ALL) == (None, "this CPU lacks popcnt, sse4_1, sse4_2 of the lowest "
                                                     "built level baseline")


@pytest.mark.parametrize("forced, level, says", [
    ("baseline", "baseline", "forced by GOODPUT_CPU_KERNELS_LEVEL=baseline"),
    ("avx512", None, "needs avx512bw, avx512cd, avx512dq, avx512f, avx512vl, which this CPU lacks"),
    ("sse9", None, "not among the built levels (avx512bf16, avx512, avx2, baseline)"),
])
def test_a_forced_level_is_taken_only_if_built_and_supported(forced, level, says):
    got, why = cpu_isa.pick(ZEN3.split(), ALL, forced)
    assert (got.name if got else None) == level and says in why


def test_cpu_flags_reads_the_first_flags_line():
    text = "processor\t: 0\nflags\t\t: fpu avx2 fma\nbugs\t: x\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert cpu_isa.cpu_flags(text) == {"fpu", "avx2", "fma"}
    assert cpu_isa.cpu_flags("no flags here") == frozenset()


# the instruction sets the kernels' sources test (csrc/*.cpp #if defined(...)) -> the cpuinfo flag
SOURCE_MACROS = {"__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512VL__": "avx512vl",
                 "__F16C__": "f16c", "__AVX512BF16__": "avx512_bf16", "__AVX2__": "avx2", "__FMA__": "fma"}


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("level", cpu_isa.LEVELS, ids=lambda lv: lv.name)
def test_each_levels_compiler_flags_enable_exactly_the_instructions_it_needs(level):
    """g++'s predefined macros for the level's -march flags: an instruction set the sources use is
    enabled iff the level requires the CPU flag for it (else a level would SIGILL, or leave its
    speed unused)."""
    out = subprocess.run(["g++", *level.cflags, "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True,
                         text=True, check=True).stdout
    defined = {m for m in SOURCE_MACROS if re.search(rf"^#define {m} 1$", out, re.M)}
    assert defined == {m for m, flag in SOURCE_MACROS.items() if flag in level.needs}
    sources = "".join(p.read_text() for p in (ROOT / "worker_image/goodput/worker/model/csrc").glob("*.cpp"))
    used = set(re.findall(r"defined\((__[A-Z0-9_]+__)\)", sources))
    assert used <= set(SOURCE_MACROS), used - set(SOURCE_MACROS)


def test_prebuilt_kernel_names_leave_the_build_machines_cpu_out(monkeypatch):
    from goodput.worker.model import cpu_kernels
    names = {lv.name: cpu_kernels.kernel_name(lv.name) for lv in cpu_isa.LEVELS}
    native = cpu_kernels.kernel_name()
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags : something else")
    assert {lv.name: cpu_kernels.kernel_name(lv.name) for lv in cpu_isa.LEVELS} == names
    assert cpu_kernels.kernel_name() != native
    assert all(n.startswith(f"goodput_cpu_kernels_{lv}_") for lv, n in names.items())
    assert len(set(names.values())) == len(names)


def test_load_refuses_a_prebuilt_level_the_cpu_lacks_without_importing_it(monkeypatch, tmp_path):
    """Only an AVX-512 build is installed and the CPU has AVX2: the worker must not load it (SIGILL);
    the file here is not a library at all, so importing it would raise a different error."""
    from goodput.worker.model import cpu_kernels
    (tmp_path / f"{cpu_kernels.kernel_name('avx512bf16')}.so").write_text("not a library")
    monkeypatch.setenv("GOODPUT_CPU_KERNELS_DIR", str(tmp_path))
    monkeypatch.setenv("GOODPUT_CPU_KERNELS", "prebuilt")
    monkeypatch.setattr(cpu_kernels, "_cpuinfo", lambda: f"flags\t: {ZEN3}\n")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
        assert "lacks avx512" in cpu_kernels.load_error() and "avx512bf16" in cpu_kernels.load_error()
    finally:
        cpu_kernels.load.cache_clear()


def test_the_kernel_stage_copies_everything_cpu_kernels_imports():
    """images/worker/Containerfile builds the kernels from a few copied files: every goodput module
    cpu_kernels imports at module level must be among them."""
    text = (ROOT / "images/worker/Containerfile").read_text()
    stage = text.split("AS kernels", 1)[1].split("\nFROM ", 1)[0]
    copied = set(re.findall(r"worker_image/(goodput/[\w/]+)\.py", stage))
    tree = ast.parse((ROOT / "worker_image/goodput/worker/model/cpu_kernels.py").read_text())
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module.startswith("goodput"):
            imported |= {f"{node.module}.{a.name}".replace(".", "/") for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {a.name.replace(".", "/") for a in node.names if a.name.startswith("goodput")}
    assert imported and imported <= copied, imported - copied
    assert '--levels "${KERNEL_LEVELS}"' in stage and "ARG KERNEL_LEVELS=all" in stage
    assert "worker_image/goodput/worker/model/csrc" in stage


@pytest.mark.parametrize("image", ["worker", "control-plane"])
def test_containerfiles_take_a_base_and_run_as_a_numeric_non_root_user(image):
    text = (ROOT / "images" / image / "Containerfile").read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    first_from = next(i for i, ln in enumerate(lines) if ln.startswith("FROM "))
    assert any(ln.startswith("ARG BASE=") for ln in lines[:first_from])
    stages = [ln for ln in lines if ln.startswith("FROM ")]
    assert stages[-1] == "FROM ${BASE}"                              # the run-time stage is the base
    assert "COPY --from=wheels " in text                              # wheels come from a build context
    assert re.search(r"^USER 65532:65532$", text, re.M)
    assert re.search(r"^ENV [^\n]*HOME=/tmp", text, re.M | re.S) or "HOME=/tmp" in text
    assert not (ROOT / "images" / image / "Dockerfile").exists()
    assert not (ROOT / "worker_image" / "Dockerfile").exists()


def test_worker_image_never_compiles_at_start_and_ships_the_model():
    text = (ROOT / "images/worker/Containerfile").read_text()
    assert "GOODPUT_CPU_KERNELS=prebuilt" in text and "GOODPUT_CPU_KERNELS_DIR=/opt/goodput/cpu-kernels" in text
    assert f'"{build.MODEL_PACKAGE}"' in text
    assert "TORCH=" + build.TORCH in text  # the Containerfile's default torch is the one build.py downloads


@pytest.mark.parametrize("version, commit, dirty, expected", [
    ("0.1.0", "57d02c6", False, ("0.1.0", "0.1.0-g57d02c6")),
    ("0.1.0", "57d02c6", True, ("0.1.0", "0.1.0-g57d02c6-dirty")),
    ("1.2.3rc1", "", False, ("1.2.3rc1", "1.2.3rc1-gunknown")),
])
def test_tags_are_the_version_and_the_commit(version, commit, dirty, expected):
    assert build.tags(version, commit, dirty) == expected


@pytest.mark.parametrize("version, commit", [("0.1.0+local", "abc1234"), ("", "abc1234"), ("0.1.0", "XYZ")])
def test_tags_refuse_what_is_not_a_tag(version, commit):
    with pytest.raises(ValueError):
        build.tags(version, commit, False)


def test_images_env_is_shell_that_names_the_images(tmp_path):
    pair = build.tags("0.1.0", "abc1234", True)
    names = {i: (build.image_name(i, pair[0]), build.image_name(i, pair[1])) for i in ("control-plane", "worker", "pause")}
    env = tmp_path / "images.env"
    env.write_text(build.env_text(names, {i: tmp_path / f"{i}.oci.tar" for i in names}))
    out = subprocess.run(["bash", "-c", f". {env}; echo $CONTROL_PLANE_IMAGE $WORKER_IMAGE $PAUSE_COMMIT_IMAGE "
                                        "$COMMIT_TAG $WORKER_ARCHIVE"], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["goodput/control-plane:0.1.0", "goodput/worker:0.1.0",
                                  "goodput/pause:0.1.0-gabc1234-dirty", "0.1.0-gabc1234-dirty",
                                  str(tmp_path / "worker.oci.tar")]


def test_the_images_carry_the_names_the_chart_and_operator_use():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    version = pyproject["project"]["version"]
    values = (ROOT / "helm/goodput/values.yaml").read_text()
    chart = (ROOT / "helm/goodput/Chart.yaml").read_text()
    repository = re.search(r"^  repository: (\S+)$", values, re.M).group(1)
    app_version = re.search(r"^appVersion: \"?([^\"\s]+)", chart, re.M).group(1)
    assert f"{repository}:{app_version}" == build.image_name("control-plane", version)
    from goodput.api.crd import DEFAULT_IMAGE
    assert DEFAULT_IMAGE == build.image_name("worker", version)
    reqs = build.requirements(pyproject, ("operator", "router"))
    assert reqs[0] == build.TORCH and set(pyproject["project"]["dependencies"]) <= set(reqs)


def test_the_archive_key_covers_every_path_the_containerfiles_copy():
    copied = set()
    for image in build.IMAGES:
        text = (ROOT / "images" / image / "Containerfile").read_text().replace("\\\n", " ")
        for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
            copied |= set(line.split()[:-1])
    copied = {c for c in copied if not c.startswith("--")}
    covered = set(build.SOURCES)
    missing = {c for c in copied if not any(c == s or c.startswith(s + "/") for s in covered)}
    assert not missing, missing


def test_the_archive_index_names_the_image_once_per_tag():
    manifest = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:ab", "size": 3,
                "annotations": {"org.opencontainers.image.ref.name": "docker.io/goodput/worker:0.1.0"}}
    index = build.with_names({"schemaVersion": 2, "manifests": [manifest]},
                             ["docker.io/goodput/worker:0.1.0", "docker.io/goodput/worker:0.1.0-gabc1234"])
    assert [m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]] == [
        "docker.io/goodput/worker:0.1.0", "docker.io/goodput/worker:0.1.0-gabc1234"]
    assert {m["digest"] for m in index["manifests"]} == {"sha256:ab"} and index["schemaVersion"] == 2
    with pytest.raises(ValueError):
        build.with_names({"manifests": [manifest, manifest]}, ["a"])


def test_the_kernel_stage_files_alone_name_and_find_the_builds(tmp_path):
    """The files the kernel stage copies, without the rest of goodput (no .pth of the editable
    install: python -S), find their cache directory and name every level's build."""
    text = (ROOT / "images/worker/Containerfile").read_text()
    stage = text.split("AS kernels", 1)[1].split("\nFROM ", 1)[0]
    for rel in re.findall(r"worker_image/(goodput/[\w/]+\.py)", stage):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "worker_image" / rel, tmp_path / rel)
    shutil.copytree(ROOT / "worker_image/goodput/worker/model/csrc", tmp_path / "goodput/worker/model/csrc")
    code = ("import sys; sys.path[:0] = sys.argv[1:]\n"
            "import goodput.worker.model.cpu_kernels as k\n"
            "print(k.cache_dir()); print(*(k.kernel_name(lv) for lv in ('avx512bf16', 'baseline')))\n")
    import sysconfig
    r = subprocess.run([sys.executable, "-S", "-c", code, str(tmp_path), sysconfig.get_paths()["purelib"]],
                       capture_output=True, text=True,
                       env={"GOODPUT_CPU_KERNELS_DIR": "/opt/goodput/cpu-kernels", "PATH": "/usr/bin:/bin"},
                       timeout=120)
    assert r.returncode == 0, r.stderr
    from goodput.worker.model import cpu_kernels
    assert r.stdout.split() == ["/opt/goodput/cpu-kernels", cpu_kernels.kernel_name("avx512bf16"),
                                cpu_kernels.kernel_name("baseline")]


TINY = """
#include <Python.h>
#define GP_CAT(a, b) a##b
#define GP_INIT(n) GP_CAT(PyInit_, n)
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, nullptr};
PyMODINIT_FUNC GP_INIT(TORCH_EXTENSION_NAME)(void) {
    PyObject *m = PyModule_Create(&def);
    PyModule_AddIntConstant(m, "answer", 42);
    return m;
}
"""
# the image's build (--level ... --prune) and a worker's start (prebuilt), with a tiny source
TINY_PRELUDE = ("import os, sys, logging\nfrom pathlib import Path\nfrom goodput.worker.model import cpu_kernels as k\n"
                "k.SOURCES = [Path(os.environ['GP_TINY_SRC'])]\nk.CFLAGS = ['-O0', '-march=native']\n"
                "k._PORTABLE_CFLAGS = ['-O0']\n")
TINY_BUILD = TINY_PRELUDE + "sys.exit(k.main(sys.argv[1:]))\n"
TINY_START = TINY_PRELUDE + ("logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
                             "m = k.load()\nprint('LOADED', m.answer if m is not None else None, k.load_error())\n")


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_levels_build_without_loading_and_a_start_loads_the_best_one_this_cpu_runs(tmp_path):
    """Real builds of a tiny extension for two levels, one of which (avx512bf16) this CPU may lack:
    built (compile only), never imported where it cannot run; a start with
    GOODPUT_CPU_KERNELS=prebuilt loads the right one and logs it; --prune keeps exactly the builds."""
    (tmp_path / "tiny.cpp").write_text(TINY)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "goodput_cpu_kernels_avx2_000000000000.so").write_text("an older build")
    env = dict(os.environ, GOODPUT_CPU_KERNELS_DIR=str(cache), GP_TINY_SRC=str(tmp_path / "tiny.cpp"),
               TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), GOODPUT_CPU_KERNELS="prebuilt")
    r = subprocess.run([sys.executable, "-c", TINY_BUILD, "--levels", "avx512bf16,baseline", "--prune"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    built = sorted(f.name for f in cache.iterdir())
    assert [n.split("_")[3] for n in built] == ["avx512bf16", "baseline"], built
    flags = cpu_isa.cpu_flags(Path("/proc/cpuinfo").read_text())
    avx512_bf16 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16"} <= flags
    expected = "avx512bf16" if avx512_bf16 else "baseline"
    r = subprocess.run([sys.executable, "-c", TINY_START], env=env, capture_output=True, text=True, timeout=300)
    assert "LOADED 42 None" in r.stdout, r.stdout + r.stderr
    assert f"C++ CPU kernels: level {expected} " in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", TINY_START], env=env | {"GOODPUT_CPU_KERNELS_LEVEL": "avx2"},
                       capture_output=True, text=True, timeout=300)
    assert "LOADED None" in r.stdout and "GOODPUT_CPU_KERNELS_LEVEL=avx2 is not among the built levels" in r.stdout


def test_publish_names_the_cached_image_without_rebuilding_it(tmp_path):
    """A new commit with the same image contents: the published archive is the cached one, blobs
    byte for byte, with the image listed under both names; publishing the same again writes nothing."""
    import json
    import tarfile
    layout = tmp_path / "layout"
    (layout / "blobs/sha256").mkdir(parents=True)
    (layout / "blobs/sha256/ab").write_bytes(b"manifest bytes")
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:ab", "size": 14,
        "annotations": {"org.opencontainers.image.ref.name": "docker.io/goodput/worker:0.1.0"}}]}))
    cached = tmp_path / "cached.oci.tar"
    with tarfile.open(cached, "w") as t:
        for f in sorted(layout.rglob("*")):
            t.add(f, arcname=str(f.relative_to(layout)), recursive=False)
    out = tmp_path / "worker.oci.tar"
    build.publish(cached, out, ("goodput/worker:0.1.0", "goodput/worker:0.1.0-gabc1234"))
    with tarfile.open(out) as t:
        assert t.extractfile("blobs/sha256/ab").read() == b"manifest bytes"
        index = json.load(t.extractfile("index.json"))
    assert [m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]] == [
        "docker.io/goodput/worker:0.1.0", "docker.io/goodput/worker:0.1.0-gabc1234"]
    before = out.stat().st_mtime_ns
    build.publish(cached, out, ("goodput/worker:0.1.0", "goodput/worker:0.1.0-gabc1234"))
    assert out.stat().st_mtime_ns == before
