"""Does a refused argument in the compiled CPU kernel come back as a RuntimeError here?

    python benchmarks/exception_probe.py [--out DIR]

Every op of the extension refuses bad arguments with TORCH_CHECK, a C++ exception that
pybind11 turns into a RuntimeError naming the problem; the engine's failure isolation
rests on that. On the GPU machines of issue 32 (Ubuntu 24.04, gcc 13.3, Python 3.12,
torch 2.11.0+cu130, an Intel Xeon with AMX) those refusals killed the process with
SIGSEGV instead (the 2026-11-28 GPU entry of benchmarks/RESULTS.md), while a one-function
extension built there with the same flags raised as it should, and the same toolchain in
an Ubuntu 24.04 chroot on an AMD EPYC raised too. This probe narrows it down where it
happens: each case is a child process that loads the extension and calls two ops with
bad arguments, under one change to the environment or the build:

- `default`: as the suite runs it.
- `bind_now`: LD_BIND_NOW=1 (no lazy symbol binding: glibc's lazy-binding trampoline saves
  the registers with XSAVE, whose area grows once a process is allowed AMX state).
- `no_amx`: ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 and ATEN_CPU_CAPABILITY=avx512 (nothing in
  torch asks the kernel for AMX state).
- `minimal`: a one-function extension with the same flags, its op refusing the same way.
- `O1`, `no_native`: the extension rebuilt (into its own cache folder) at -O1, or for
  x86-64-v4 instead of -march=native.

A case's row is "raised" (both calls raised RuntimeError with the op's message), or the
signal or exit code that ended it, with the child's last lines. With --gdb (a gdb, or
cuda-gdb where the machine has no gdb), a case that died of a signal runs again under it
for the native backtrace. Writes exception_probe.json and .md into --out. Nothing is
timed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# The child: load the extension (optionally rebuilt with other flags) and call two ops
# with bad arguments; prints one line per call.
CHILD = r'''
import json, os, sys, faulthandler
faulthandler.enable()
import torch
cflags = json.loads(os.environ.get("PROBE_CFLAGS", "null"))
if os.environ.get("PROBE_MINIMAL"):
    from torch.utils import cpp_extension
    from lamina.kernels import cpu_build
    src = """
#include <torch/extension.h>
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1),
              "rms_norm: weight must be [", x.size(-1), "]");
  return x;
}
at::Tensor silu_mul(at::Tensor g, at::Tensor u) {
  TORCH_CHECK(g.sizes() == u.sizes(), "silu_mul: gate and up must match");
  return g;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("silu_mul", &silu_mul);
}
"""
    ext = cpp_extension.load_inline(name="probe_minimal", cpp_sources=[src],
                                    extra_cflags=cpu_build.CFLAGS, extra_ldflags=["-fopenmp"])
else:
    from lamina.kernels import cpu_build
    if cflags is not None:
        cpu_build.CFLAGS = cflags
    ext = cpu_build.load_cpu_kernel()
print("loaded", flush=True)
x = torch.randn(4, 8)
for name, call in (("rms_norm", lambda: ext.rms_norm(x, torch.randn(7), 1e-5)),
                   ("silu_mul", lambda: ext.silu_mul(x, torch.randn(4, 9)))):
    try:
        call()
        print(name, "returned", flush=True)
    except RuntimeError as e:
        print(name, "raised", str(e).splitlines()[0][:120], flush=True)
'''


def cases(base_flags: list[str]) -> dict[str, dict]:
    """name -> {"env": extra environment, "cflags": the build's flags or None}."""
    def flags(*change: tuple[str, str]) -> list[str]:
        out = list(base_flags)
        for old, new in change:
            out = [new if f == old else f for f in out]
        return out
    return {
        "default": {"env": {}, "cflags": None},
        "bind_now": {"env": {"LD_BIND_NOW": "1"}, "cflags": None},
        "no_amx": {"env": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                           "ATEN_CPU_CAPABILITY": "avx512"}, "cflags": None},
        "minimal": {"env": {"PROBE_MINIMAL": "1"}, "cflags": None},
        "O1": {"env": {}, "cflags": flags(("-O3", "-O1"))},
        "no_native": {"env": {}, "cflags": flags(("-march=native", "-march=x86-64-v4"))},
    }


def run_case(name: str, case: dict, cache: Path, timeout_s: float, gdb: str | None) -> dict:
    env = dict(os.environ, **case["env"])
    if case["cflags"] is not None:  # its own build, beside the shared one
        env["PROBE_CFLAGS"] = json.dumps(case["cflags"])
        env["LAMINA_CACHE_DIR"] = str(cache / name)
    row = {"case": name, **_child([sys.executable, "-c", CHILD], env, timeout_s)}
    if gdb and row["result"] in {s.name for s in signal.Signals}:
        cmd = [gdb, "-batch", "-ex", "run", "-ex", "bt 40", "--args", sys.executable, "-c", CHILD]
        row["backtrace"] = _child(cmd, env, timeout_s, lines=60)["tail"]
    return row


def _child(cmd: list[str], env: dict, timeout_s: float, lines: int = 8) -> dict:
    """Run one child: {"result": "raised" | a signal's name | "exit N, k/2 raised", "tail"}."""
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"result": f"no answer in {timeout_s:.0f} s", "tail": ""}
    out = (p.stdout + p.stderr).strip().splitlines()
    raised = sum(1 for ln in p.stdout.splitlines() if " raised " in ln)
    if p.returncode == 0 and raised == 2:
        result = "raised"
    elif p.returncode < 0:
        result = signal.Signals(-p.returncode).name
    else:
        result = f"exit {p.returncode}, {raised}/2 raised"
    return {"result": result, "tail": "\n".join(out[-lines:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--cases", nargs="+", default=None, help="a subset of the cases")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a case may take")
    ap.add_argument("--gdb", default=None, help="a debugger for the backtrace of a crash")
    args = ap.parse_args()
    from lamina.kernels import cpu_build

    table = cases(list(cpu_build.CFLAGS))
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for name in args.cases or table:
            rows.append(run_case(name, table[name], Path(cache), args.timeout, args.gdb))
            r = rows[-1]
            print(f"{name}: {r['result']}\n{r['tail']}\n{r.get('backtrace', '')}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "exception_probe.json").write_text(json.dumps(rows, indent=1))
    md = ["| case | result |", "|---|---|"] + [f"| {r['case']} | {r['result']} |" for r in rows]
    (out / "exception_probe.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
