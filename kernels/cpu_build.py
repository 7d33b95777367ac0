"""Build (once) and load the C++/OpenMP CPU extension: the kernel in
`csrc/slot_attention.cpp`, topk's page selection in `csrc/page_select.cpp`, the data
plane's C++ ends in `csrc/dataplane.cpp` (whose memory end calls the kernel), the dense
slices' fused pointwise ops in `csrc/pointwise.cpp`, bf16 prompt attention in
`csrc/prompt_flash.cpp`, bf16 linears in `csrc/linear_bf16.cpp`, all bound to Python by
`csrc/bindings.cpp` alone.

Data in: the C++ sources beside this file. Data out: the loaded extension module, or a
`KernelBuildError` saying why it could not be had. Builds go to
`$LAMINA_CACHE_DIR/kernels/<key>` (default `~/.cache/lamina/kernels/<key>`), keyed by the
source, flags, torch version, compiler, ninja and CPU, so a build is reused by every later
process and a change to any of those rebuilds. The first build takes 1-2 minutes on 2 cores and says
so as it starts (`lamina doctor` builds it ahead).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("lamina.kernels")

CSRC = Path(__file__).parent / "csrc"
# the kernel, the data plane's C++ ends (lamina.dataplane.protocol), the pointwise ops,
# and the one file that binds them
SOURCES = (CSRC / "slot_attention.cpp", CSRC / "page_select.cpp", CSRC / "dataplane.cpp",
           CSRC / "pointwise.cpp", CSRC / "prompt_flash.cpp", CSRC / "linear_bf16.cpp",
           CSRC / "bindings.cpp")
HEADERS = (CSRC / "lamina_ext.h",)  # hashed into the build key with the sources
BUILD_TIME = "1-2 minutes on 2 cores"  # ~115 s on a Zen 1 EPYC (2026-12-02)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
# -lstdc++ names the shared C++ runtime ahead of what the compiler's driver adds at the
# end: a toolchain that links libstdc++ statically (-static-libstdc++ in its specs or
# flags) then takes nothing from the archive, and the library keeps one C++ runtime, the
# process's. With a second copy inside, every TORCH_CHECK message (an ostringstream)
# mixed the copies' locales: its numbers vanished (gcc 12) or the process died of SIGSEGV
# (the H200 machine's gcc 13, benchmarks/RESULTS.md 2026-12-04) instead of raising.
LDFLAGS = ["-fopenmp", "-lstdc++"]

_lock = threading.Lock()
_state: dict = {}  # "module" | "error" | "build_s"


class KernelBuildError(RuntimeError):
    """The compiled CPU kernel could not be built or loaded."""


def cache_root() -> Path:
    base = os.environ.get("LAMINA_CACHE_DIR") or Path.home() / ".cache" / "lamina"
    return Path(base) / "kernels"


def build_key() -> str:
    """The build's cache folder: the sources' bytes, flags, torch, the compiler and
    ninja, the CPU, and where the sources lie. ninja records their paths, so two
    checkouts sharing one folder would rebuild (1-2 min) each time the other had built."""
    h = hashlib.sha256(str(CSRC.resolve()).encode())
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    h.update(" ".join(CFLAGS + ["--"] + LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(compiler_version().encode())
    h.update(ninja_version().encode())
    h.update(platform.machine().encode())
    h.update(_cpu_model().encode())
    # -march=native builds for these: a "model name" alone (here "AMD EPYC") can stand
    # for CPUs with and without AVX-512, and a build for one crashes on the other
    h.update(" ".join(sorted(cpu_flags())).encode())
    return h.hexdigest()[:16]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.lru_cache(maxsize=1)
def compiler_version() -> str:
    """The first line of `$CXX --version` (torch builds with $CXX, else c++); "" where
    it cannot run. Part of the build key: another compiler builds anew."""
    try:
        out = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0] if out else ""


@functools.lru_cache(maxsize=1)
def ninja_dir() -> str | None:
    """The folder of the ninja that builds the kernel: the `ninja` package's (a
    dependency), else the first on PATH; None with neither. torch runs whichever
    `ninja` PATH finds first, and ninja 1.11 and 1.13 hash a command differently in
    their build log: with both installed (the system's, the venv's) each took the
    other's build for stale and rebuilt it whole (~2 min on 2 cores) whenever PATH
    changed (the venv activated or not), and with no system ninja a process of a venv
    not activated had no build at all."""
    try:
        import ninja

        if (Path(ninja.BIN_DIR) / "ninja").exists():
            return str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    found = shutil.which("ninja")
    return str(Path(found).parent) if found else None


@functools.lru_cache(maxsize=1)
def ninja_version() -> str:
    """`ninja --version` of `ninja_dir()`'s ninja ("" where none runs): part of the
    build key, as the compiler's is."""
    folder = ninja_dir()
    if folder is None:
        return ""
    try:
        return subprocess.run([str(Path(folder) / "ninja"), "--version"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


@contextlib.contextmanager
def _ninja_first():
    """PATH with `ninja_dir()` first while torch builds (and checks for ninja): the one
    ninja every process builds with, whatever its PATH. PATH is as it was once the load
    returns (other threads of the process see the change meanwhile); `_lock` keeps
    builds in this process one at a time."""
    old, folder = os.environ.get("PATH", ""), ninja_dir()
    if folder is not None:
        os.environ["PATH"] = folder + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def is_built() -> bool:
    """Whether this machine has a build for the current key (a load takes ~1 s, not a
    build's minutes); no build is started."""
    try:
        return any((cache_root() / build_key()).glob("*.so"))
    except OSError:
        return False


def load_cpu_kernel():
    """Return the extension module, building it on first use; raise KernelBuildError."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        if "error" in _state:
            raise KernelBuildError(_state["error"])
        try:
            _state["module"] = _build()
            return _state["module"]
        except Exception as e:  # compiler missing, build failure, bad cache ...
            _state["error"] = f"{type(e).__name__}: {e}".strip()[:2000]
            raise KernelBuildError(_state["error"]) from e


def build_seconds() -> float | None:
    """Seconds the build (or cached load) took in this process, if it ran."""
    return _state.get("build_s")


def _build():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise KernelBuildError("no C++ compiler (c++/g++) on PATH")
    from torch.utils import cpp_extension

    cached = is_built()
    build_dir = cache_root() / build_key()
    build_dir.mkdir(parents=True, exist_ok=True)
    if not cached:  # minutes of silence looked like a hang
        log.info("building the CPU kernel in %s: once per machine and kernel version, "
                 "%s", build_dir, BUILD_TIME)
    t0 = time.perf_counter()
    with _ninja_first():
        mod = cpp_extension.load(name="lamina_slot_attention",
                                 sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS,
                                 extra_ldflags=LDFLAGS, build_directory=str(build_dir),
                                 verbose=False)
    _state["build_s"] = time.perf_counter() - t0
    log.info("CPU kernel %s in %.1f s (%s)", "loaded" if cached else "built",
             _state["build_s"], build_dir)
    path = getattr(mod, "__file__", None)
    if path and own_cxx_runtime(path):
        log.warning("the CPU kernel %s carries its own copy of libstdc++ (this toolchain "
                    "links it statically, past -lstdc++): a bad argument that reaches the "
                    "kernel may end the process instead of raising", path)
    return mod


# libstdc++'s own code (std::locale, std::codecvt): defined in a library that links the
# shared runtime, never; in one with a static copy inside, by the hundred
_RUNTIME_SYMBOLS = ("_ZNSt6locale", "_ZNKSt7codecvt")


def own_cxx_runtime(library: str | os.PathLike) -> bool | None:
    """Whether a shared library defines libstdc++'s own symbols, i.e. carries a copy of
    the C++ runtime beside the process's (see LDFLAGS); None where binutils' `nm` cannot
    tell (not installed, not an ELF file)."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    try:
        p = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True,
                           text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if p.returncode != 0:
        return None
    return any(f" {sym}" in p.stdout for sym in _RUNTIME_SYMBOLS)
