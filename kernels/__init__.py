"""lamina.kernels: attention over a token-slot KV pool, for memory workers.

Backends: the compiled C++ kernel (CPU pools), Triton kernels (CUDA pools) and a
pure-torch reference (any device).

Data in: per step, q from the compute side, the worker's pool tensors
k/v [num_slots, Hkv, D] and a `SlotBatch` saying which slots each request attends to.
Data out: attention outputs [Nq, Hq, Dv] plus per-row log-sum-exp, which
`merge_attention` combines exactly across disjoint key sets.

    backend = select_backend()            # compiled CPU kernel, or reference + reason
    write_kv(k_pool, v_pool, slots, k, v)  # one index_copy_ per tensor
    o, lse = attend(q, k_pool, v_pool, batch, params, backend)
"""
from __future__ import annotations

__all__ = ["AttentionBackend", "AttentionInputError", "AttentionParams", "BackendUnavailable",
           "CpuBackend", "KernelBuildError", "ReferenceBackend", "SlotBatch", "argmax_rows",
           "masked_argmax_rows", "attend", "build_seconds", "decode_attention", "is_built",
           "load_cpu_kernel", "merge_attention", "prefill_attention", "reference_slot_attention",
           "select_backend", "TritonBackend", "validate", "validate_batch", "write_kv"]


def _hand_over_the_name() -> bool:
    """This folder is `lamina.kernels` (the distribution maps it there). Where the
    checkout's root leads sys.path (pytest's rootdir; `python -m` or `-c` run there), a
    plain `import kernels` finds it first and shadows Hugging Face's `kernels`, which
    transformers >= 5.25 imports. Then this module loads the installed `kernels` in its own place in
    `sys.modules`, which is what that import returns, and says so. With none installed
    it loads as itself, as it always did (transformers' availability check of that name
    imports it and finds no version)."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    root = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)
    return True


if not (__name__ == "kernels" and _hand_over_the_name()):
    from .attention import attend, decode_attention, prefill_attention, write_kv
    from .backends import (
        AttentionBackend,
        AttentionInputError,
        BackendUnavailable,
        CpuBackend,
        ReferenceBackend,
        TritonBackend,
        select_backend,
        validate,
        validate_batch,
    )
    from .cpu_build import KernelBuildError, build_seconds, is_built, load_cpu_kernel
    from .merge import merge_attention
    from .pointwise import argmax_rows, masked_argmax_rows
    from .reference import reference_slot_attention
    from .slots import AttentionParams, SlotBatch
