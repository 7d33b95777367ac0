"""Does a refused argument in the compiled CPU kernel come back as a RuntimeError here?

    python benchmarks/exception_probe.py [--out DIR] [--cases ...] [--gdb GDB]

Every op of the extension refuses bad arguments with TORCH_CHECK, a C++ exception that
pybind11 turns into a RuntimeError naming the problem; the engine's failure isolation
rests on that. On the H200 machine of issue 32 (Ubuntu 24.04, gcc 13.3, torch
2.11.0+cu130, an Intel Xeon) every refusal killed the process with SIGSEGV instead: its
backtrace (2026-12-04, benchmarks/RESULTS.md) ran through `basic_ostream::_M_insert<long>`
and `codecvt<char16_t>` code inside the extension itself, that is, a copy of libstdc++
linked into the library beside the process's, and the message's number formatting mixed
the two copies' locales. `kernels/cpu_build.py` now links with `-lstdc++` ahead of the
driver's own libraries (its LDFLAGS), so no copy is taken. Each case is a child process
that loads a build and calls two ops with bad arguments:

- `default`: the kernel as the engine builds it.
- `old_link`: the kernel linked as before (`-fopenmp` alone).
- `static`, `static_old_link`: both again with `-static-libstdc++` added, which stands
  in for a toolchain that links the runtime statically (here, where the compiler does
  not: the second cuts the messages' numbers on gcc 12, and is the H200's crash on gcc 13).
- `minimal`: a one-function extension with the kernel's flags, refusing the same way.

A case's row is "raised" (both calls raised RuntimeError with the op's whole message,
its numbers included), "raised, message cut", or the signal or exit code that ended it,
with the child's last lines and whether its library holds a libstdc++ copy
(`cpu_build.own_cxx_runtime`). With --gdb (a gdb, or cuda-gdb where the machine has no
gdb), a case that died of a signal runs again under it for the native backtrace. Writes
exception_probe.json and .md into --out. Nothing is timed.
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

# The child: load the extension (optionally rebuilt with other link flags) and call two
# ops with bad arguments; prints whether its library holds a libstdc++ copy, then one
# line per call.
CHILD = r'''
import json, os, sys, faulthandler
faulthandler.enable()
import torch
from lamina.kernels import cpu_build
ldflags = json.loads(os.environ.get("PROBE_LDFLAGS", "null"))
if ldflags is not None:
    cpu_build.LDFLAGS = ldflags
if os.environ.get("PROBE_MINIMAL"):
    from torch.utils import cpp_extension
    src = """
#include <torch/extension.h>
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1),
              "rms_norm: weight must be [", x.size(-1), "]");
  return x;
}
at::Tensor silu_mul(at::Tensor g, at::Tensor u) {
  TORCH_CHECK(g.sizes() == u.sizes(), "silu_mul: gate and up must match, got ", g.sizes(),
              " and ", u.sizes());
  return g;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("silu_mul", &silu_mul);
}
"""
    ext = cpp_extension.load_inline(name="probe_minimal", cpp_sources=[src],
                                    extra_cflags=cpu_build.CFLAGS,
                                    extra_ldflags=cpu_build.LDFLAGS)
else:
    ext = cpu_build.load_cpu_kernel()
print("loaded; own libstdc++ copy:", cpu_build.own_cxx_runtime(ext.__file__), flush=True)
x = torch.randn(4, 8)
for name, call in (("rms_norm", lambda: ext.rms_norm(x, torch.randn(7), 1e-5)),
                   ("silu_mul", lambda: ext.silu_mul(x, torch.randn(4, 9)))):
    try:
        call()
        print(name, "returned", flush=True)
    except RuntimeError as e:
        print(name, "raised", str(e).splitlines()[0][:120], flush=True)
'''
# what each call's whole message holds: the numbers that a mixed runtime drops
WHOLE = ("rms_norm raised rms_norm: weight must be [8]", "[4, 8]")


def cases(ldflags: list[str]) -> dict[str, dict]:
    """name -> {"env": extra environment, "ldflags": the build's link flags or None}."""
    old, static = ["-fopenmp"], ["-static-libstdc++"]
    return {
        "default": {"env": {}, "ldflags": None},
        "old_link": {"env": {}, "ldflags": old},
        "static": {"env": {}, "ldflags": ldflags + static},
        "static_old_link": {"env": {}, "ldflags": old + static},
        "minimal": {"env": {"PROBE_MINIMAL": "1"}, "ldflags": None},
    }


def run_case(name: str, case: dict, cache: Path, timeout_s: float, gdb: str | None) -> dict:
    env = dict(os.environ, **case["env"])
    if case["ldflags"] is not None:  # its own build, beside the shared one
        env["PROBE_LDFLAGS"] = json.dumps(case["ldflags"])
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
        result = "raised" if all(w in p.stdout for w in WHOLE) else "raised, message cut"
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

    table = cases(list(cpu_build.LDFLAGS))
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
