"""The CPU extension's build: a first build says so before it starts (1-2 minutes of
silence on 2 cores looked like a hang), `is_built` tells a build from a load without
starting either, and a load of a build says nothing. torch's compiler is replaced by a
stand-in that writes the .so and records what had been logged when it was called."""
import logging
import os
import shutil
import subprocess

import pytest

from lamina.kernels import cpu_build, is_built


@pytest.fixture
def stand_in(tmp_path, monkeypatch, caplog):
    """An empty cache folder, no module loaded in this process, and torch's
    `cpp_extension.load` as a stand-in: returns (calls, the logged lines at each call)."""
    from torch.utils import cpp_extension

    caplog.set_level(logging.INFO, logger="lamina")
    monkeypatch.setenv("LAMINA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_state", {})
    calls: list[dict] = []

    def load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        calls.append({"dir": build_directory, "path": os.environ["PATH"],
                      "logged": [r.getMessage() for r in caplog.records]})
        (tmp_path / "kernels" / cpu_build.build_key() / f"{name}.so").write_bytes(b"")
        return f"module {len(calls)}"

    monkeypatch.setattr(cpp_extension, "load", load)
    return calls


def test_a_first_build_says_so_before_it_starts_and_a_load_does_not(stand_in, caplog):
    folder = cpu_build.cache_root() / cpu_build.build_key()
    assert not is_built()
    assert cpu_build.load_cpu_kernel() == "module 1"
    [call] = stand_in
    assert call["dir"] == str(folder)
    assert call["logged"] == [f"building the CPU kernel in {folder}: once per machine and "
                              f"kernel version, {cpu_build.BUILD_TIME}"]
    assert is_built()
    assert cpu_build.load_cpu_kernel() == "module 1"  # this process keeps its module
    caplog.clear()
    cpu_build._state.clear()  # a later process: the build is there, it is loaded
    assert cpu_build.load_cpu_kernel() == "module 2"
    assert stand_in[1]["logged"] == []
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == [
        "CPU kernel loaded"]


def test_is_built_follows_the_build_key(stand_in, monkeypatch):
    cpu_build.load_cpu_kernel()
    assert is_built()
    monkeypatch.setattr(cpu_build, "CFLAGS", [*cpu_build.CFLAGS, "-DOTHER"])
    assert not is_built()  # other flags: another folder, not built yet


def test_every_process_builds_with_one_ninja_whatever_its_path(stand_in, monkeypatch):
    """The `ninja` package's ninja goes first on PATH for the build only: the system's
    ninja 1.11 and the venv's 1.13 each read the other's build log as stale, so a
    process whose PATH found the other one rebuilt the kernel whole."""
    import ninja

    assert cpu_build.ninja_dir() == ninja.BIN_DIR
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # a venv not activated
    cpu_build.load_cpu_kernel()
    assert stand_in[0]["path"] == f"{ninja.BIN_DIR}{os.pathsep}/usr/bin:/bin"
    assert os.environ["PATH"] == "/usr/bin:/bin"  # as it was, after the build
    version = subprocess.run([f"{ninja.BIN_DIR}/ninja", "--version"], capture_output=True,
                             text=True).stdout.strip()
    assert cpu_build.ninja_version() == version
    key = cpu_build.build_key()
    monkeypatch.setattr(cpu_build, "ninja_version", lambda: "1.0.0")
    assert cpu_build.build_key() != key  # another ninja: another folder


# A refusal whose message formats numbers: c10's ostringstream, compiled into the library
CHECK_SRC = r"""
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
void check_width(int64_t got, int64_t want) {
  TORCH_CHECK(got == want, "check_width: width must be ", want, ", got ", got);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("check_width", &check_width); }
"""


def test_a_toolchain_linking_libstdcxx_statically_still_gets_one_cxx_runtime(
        tmp_path, monkeypatch, caplog):
    """On the H200 machine every refusal of the kernel ended the process (SIGSEGV in the
    number formatting of its message): the library held its own copy of libstdc++.
    `-static-libstdc++` stands in for such a toolchain: with the old link flags the copy
    is linked in (here it cuts the message's numbers; gcc 13 crashed), with LDFLAGS the
    library takes the process's runtime and the message is whole."""
    from torch.utils import cpp_extension

    if shutil.which("nm") is None:
        pytest.skip("binutils' nm is not installed: a library's symbols cannot be read")
    src = tmp_path / "check.cpp"
    src.write_text(CHECK_SRC)

    def build(name, ldflags):
        (tmp_path / name).mkdir()
        return cpp_extension.load(name=name, sources=[str(src)], extra_cflags=["-O1"],
                                  extra_ldflags=ldflags, build_directory=str(tmp_path / name))

    try:
        static = build("static_runtime", ["-fopenmp", "-static-libstdc++"])
    except RuntimeError as e:  # torch's build error: no libstdc++.a for the stand-in
        pytest.skip(f"this compiler cannot link libstdc++ statically: {e}")
    assert cpu_build.own_cxx_runtime(static.__file__) is True
    ours = build("with_lamina_ldflags", [*cpu_build.LDFLAGS, "-static-libstdc++"])
    assert cpu_build.own_cxx_runtime(ours.__file__) is False
    with pytest.raises(RuntimeError, match="check_width: width must be 4, got 3"):
        ours.check_width(3, 4)

    # a kernel that still carries a copy is named at load, with what it risks
    caplog.set_level(logging.WARNING, logger="lamina")
    monkeypatch.setenv("LAMINA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_build, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: static)
    assert cpu_build.load_cpu_kernel() is static
    assert [r.getMessage() for r in caplog.records] == [
        f"the CPU kernel {static.__file__} carries its own copy of libstdc++ (this toolchain "
        "links it statically, past -lstdc++): a bad argument that reaches the kernel may "
        "end the process instead of raising"]


def test_the_kernel_uses_the_process_cxx_runtime():
    if shutil.which("nm") is None:
        pytest.skip("binutils' nm is not installed: a library's symbols cannot be read")
    assert cpu_build.own_cxx_runtime(cpu_build.load_cpu_kernel().__file__) is False
