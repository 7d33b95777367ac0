"""Attention backends over the token-slot pool, input validation, and backend choice.

Data in: q, the pool tensors, a `SlotBatch` and `AttentionParams` from the memory
worker. Data out: (o [Nq, Hq, Dv], lse [Nq, Hq] fp32) from the chosen backend.
`validate` runs before any backend and raises `AttentionInputError` naming the bad
argument. `select_backend` picks, for a CPU pool, the compiled CPU kernel when it builds,
and for a GPU pool the Triton kernels when triton is installed; else the reference. It
logs which and why.
"""
from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod

import torch

from . import prompt_sdpa
from .cpu_build import KernelBuildError, load_cpu_kernel
from .quant import head_dim, is_quantized
from .reference import reference_slot_attention
from .slots import AttentionParams, SlotBatch

log = logging.getLogger("lamina.kernels")

Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)  # int8: rows of kernels/quant.py


class AttentionInputError(ValueError):
    """An attention call's arguments are malformed; nothing was computed."""


class BackendUnavailable(RuntimeError):
    """The requested attention backend cannot run here."""


def _bad(msg):
    raise AttentionInputError(msg)


def validate(q, k_pool, v_pool, batch: SlotBatch, params: AttentionParams,
             batch_checked: bool = False) -> None:
    """Check every argument. `batch_checked`: the caller already ran `validate_batch` on
    this batch against this pool (a memory worker does it once per step, not per layer),
    so only the per-call shape checks run."""
    bad = _bad

    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(t, torch.Tensor):
            bad(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            bad(f"{name} must be 3-D, got shape {tuple(t.shape)}")
    if not isinstance(batch, SlotBatch):
        bad(f"batch must be a SlotBatch, got {type(batch).__name__}")
    if not isinstance(params, AttentionParams):
        bad(f"params must be AttentionParams, got {type(params).__name__}")
    if q.dtype not in Q_DTYPES:
        bad(f"q dtype {q.dtype} not supported (use one of {Q_DTYPES})")
    if k_pool.dtype not in KV_DTYPES or v_pool.dtype != k_pool.dtype:
        bad(f"k_pool/v_pool dtypes {k_pool.dtype}/{v_pool.dtype}: both must be one of "
            f"{KV_DTYPES}")
    if not (q.device == k_pool.device == v_pool.device):
        bad(f"q, k_pool, v_pool on different devices: {q.device}, {k_pool.device}, "
            f"{v_pool.device}")
    (Nq, Hq, D), (S, Hkv, _), (Sv, Hkv_v, _) = q.shape, k_pool.shape, v_pool.shape
    Dk = head_dim(k_pool)
    if (Sv, Hkv_v) != (S, Hkv):
        bad(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} disagree on "
            f"[num_slots, num_kv_heads]")
    if Dk != D:
        bad(f"q head_dim {D} != k_pool head_dim {Dk}")
    if Hkv == 0 or Hq % Hkv:
        bad(f"{Hq} query heads is not a multiple of {Hkv} kv heads")
    for name in ("cu_q", "q_pos", "slots", "cu_k", "k_pos0"):
        t = getattr(batch, name)
        if t.dtype != torch.int32 or t.dim() != 1:
            bad(f"batch.{name} must be a 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
        if t.device != q.device:
            bad(f"batch.{name} is on {t.device} but q is on {q.device}")
    if batch.num_queries != Nq:
        bad(f"q has {Nq} rows but batch has {batch.num_queries} query positions")
    if not batch_checked:
        validate_batch(batch, S)
    if params.sinks is not None and len(params.sinks) != Hq:
        bad(f"{len(params.sinks)} sinks for {Hq} query heads")


def validate_batch(batch: SlotBatch, num_slots: int) -> None:
    """The scans over a batch's index tensors: CSR offsets and slot ids in range."""
    bad = _bad
    if not isinstance(batch, SlotBatch):
        bad(f"batch must be a SlotBatch, got {type(batch).__name__}")
    for name in ("cu_q", "q_pos", "slots", "cu_k", "k_pos0"):
        t = getattr(batch, name)
        if t.dtype != torch.int32 or t.dim() != 1:
            bad(f"batch.{name} must be a 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
    B, Nq, S = batch.num_requests, batch.num_queries, num_slots
    if B < 0 or batch.cu_k.numel() != B + 1 or batch.k_pos0.numel() != B:
        bad(f"batch has {batch.cu_q.numel()} cu_q, {batch.cu_k.numel()} cu_k and "
            f"{batch.k_pos0.numel()} k_pos0 entries (need B+1, B+1, B)")
    if B >= 0 and (int(batch.cu_q[0]) != 0 or int(batch.cu_q[-1]) != Nq
                   or bool((batch.cu_q.diff() < 0).any())):
        bad(f"batch.cu_q must rise from 0 to {Nq}")
    if B >= 0 and (int(batch.cu_k[0]) != 0 or int(batch.cu_k[-1]) != batch.num_keys
                   or bool((batch.cu_k.diff() < 0).any())):
        bad(f"batch.cu_k must rise from 0 to {batch.num_keys}")
    if batch.num_keys and (int(batch.slots.min()) < 0 or int(batch.slots.max()) >= S):
        bad(f"slot ids out of range [0, {S}): min {int(batch.slots.min())}, "
            f"max {int(batch.slots.max())}")
    if Nq and int(batch.q_pos.min()) < 0:
        bad("batch.q_pos has negative positions")


class AttentionBackend(ABC):
    name: str = "?"
    reason: str = ""

    @abstractmethod
    def attend(self, q, k_pool, v_pool, batch: SlotBatch, params: AttentionParams):
        """Validated inputs -> (o [Nq, Hq, Dv] in q.dtype, lse [Nq, Hq] fp32)."""


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def __init__(self, reason: str = "requested"):
        self.reason = reason

    def attend(self, q, k_pool, v_pool, batch, params):
        return reference_slot_attention(q, k_pool, v_pool, batch, params)


class CpuBackend(AttentionBackend):
    """The compiled C++/OpenMP kernel; threads follow torch.get_num_threads()."""

    name = "cpu"

    def __init__(self):
        self._ext = load_cpu_kernel()  # raises KernelBuildError
        self.reason = "compiled C++/OpenMP kernel built"
        # (the last batch, its `prompt_sdpa.Split`): a step's layers share one batch, so
        # it is cut once a step; one tuple, so threads sharing the backend never mix them
        self._cut: tuple = (None, None)

    def attend(self, q, k_pool, v_pool, batch, params):
        """Requests with many queries (prompts) through torch's flash kernel where they
        can (`prompt_sdpa`), the rest through the slot kernel."""
        if q.device.type != "cpu":
            raise BackendUnavailable(f"the cpu backend cannot read tensors on {q.device}")
        if (batch.most_queries < prompt_sdpa.MIN_QUERIES
                or not prompt_sdpa.takes_layer(k_pool, v_pool, params)):
            return self._slots(q, k_pool, v_pool, batch, params)
        cut = self._cut
        if cut[0] is not batch:
            cut = self._cut = (batch, prompt_sdpa.split(batch))
        sp = cut[1]
        if not sp.taken:
            return self._slots(q, k_pool, v_pool, batch, params)
        o = torch.empty(*q.shape[:2], v_pool.shape[-1], dtype=torch.float32)  # [Nq, Hq, Dv]
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        if sp.rest is not None:
            o_rest, lse[sp.rows] = self._slots(q[sp.rows], k_pool, v_pool, sp.rest, params)
            o[sp.rows] = o_rest.float()
        for b, own in sp.taken.items():
            a, e = int(batch.cu_q[b]), int(batch.cu_q[b + 1])
            o[a:e], lse[a:e] = prompt_sdpa.attend_taken(q, k_pool, v_pool, batch, params,
                                                        b, own)
        return (o if q.dtype == torch.float32 else o.to(q.dtype)), lse

    def _slots(self, q, k_pool, v_pool, batch, params):
        qf = q if q.dtype == torch.float32 and q.is_contiguous() else q.float().contiguous()
        o, lse = self._ext.slot_attention(
            qf, k_pool, v_pool, batch.cu_q, batch.q_pos, batch.slots, batch.cu_k,
            batch.k_pos0, float(params.scale), int(params.sliding_window),
            float(params.softcap), params.sinks_tensor("cpu"), q.dtype == torch.bfloat16)
        return (o if q.dtype == torch.float32 else o.to(q.dtype)), lse


def _check_interpreter(triton_version: str) -> None:
    """Triton's interpreter before 3.7 turns 1-element NumPy arrays into ints, which
    NumPy 2.4 refuses: refuse that pair by name instead of failing inside a kernel."""
    import numpy
    from packaging.version import Version

    triton_v, numpy_v = (Version(v).release[:2] for v in (triton_version, numpy.__version__))
    if triton_v < (3, 7) and numpy_v >= (2, 4):
        raise BackendUnavailable(
            f"Triton {triton_version}'s interpreter cannot run on NumPy {numpy.__version__} "
            f"(it converts 1-element arrays to ints, an error since NumPy 2.4; fixed in "
            f"Triton 3.7): install triton>=3.7 or numpy<2.4 to interpret the kernels")


class TritonBackend(AttentionBackend):
    """Triton kernels (`triton_slot`) for pools on a CUDA GPU. `interpret=True` runs the
    same kernels in Triton's interpreter on CPU tensors (slow; for tests without a GPU;
    TRITON_INTERPRET=1 must be set before triton is imported). `splits` forces the
    key-split count (None: chosen per batch to fill the GPU). `bf16_tensor_cores`: bf16
    pools use bf16 tensor cores (q and p rounded to bf16); False keeps fp32 math.
    `kv_heads_per_program`: decode batches run the head-group kernel with that many kv
    heads a program (it must divide the pool's kv heads); None: bf16 pools on tensor
    cores run it with one kv head a program (on an H200 one head beat all three of
    SmolLM2's in a program at every size, benchmarks/tune_triton.py), fp32 pools the
    broadcasting kernel. `fuse_merge`: the head-group kernel's last program merges its
    key splits (an atomic count) instead of a second kernel; off by default, since the
    H200 ran the second kernel as fast or faster (1.2x at B=8, L=2048).
    `programs_per_sm`: how many programs a step aims for, per SM, when it picks the split
    count (None: 16 for the one-warp kernel, else `HEADS_PROGRAMS_PER_SM`)."""

    name = "triton"
    HEADS_PROGRAMS_PER_SM = 6  # the best split counts of the H200 sweep give ~6 an SM

    def __init__(self, interpret: bool = False, splits: int | None = None,
                 block_n: int | None = None, max_splits: int = 64,
                 num_warps: int | None = None, num_stages: int | None = None,
                 bf16_tensor_cores: bool = True, kv_heads_per_program: int | None = None,
                 fuse_merge: bool = False, programs_per_sm: int | None = None):
        from . import triton_slot

        if triton_slot.triton is None:
            raise BackendUnavailable("triton is not installed (pip install triton)")
        if interpret != triton_slot.interpreting():
            raise BackendUnavailable(
                "Triton's interpreter is " + ("off: set TRITON_INTERPRET=1 before triton is "
                                              "imported" if interpret else
                                              "on (TRITON_INTERPRET=1): unset it to run the "
                                              "triton backend on the GPU"))
        if not interpret and not torch.cuda.is_available():
            raise BackendUnavailable("the triton backend needs a CUDA GPU, and torch sees "
                                     "none")
        if interpret:
            _check_interpreter(triton_slot.triton.__version__)
        for name, val in (("splits", splits), ("kv_heads_per_program", kv_heads_per_program),
                          ("programs_per_sm", programs_per_sm)):
            if val is not None and (not isinstance(val, int) or val < 1):
                raise ValueError(f"{name} must be a positive int or None, got {val!r}")
        self._k, self.interpret, self.splits = triton_slot, interpret, splits
        self.group, self.fuse_merge, self.programs_per_sm = (kv_heads_per_program, fuse_merge,
                                                             programs_per_sm)
        self.block_n, self.max_splits, self.num_warps = block_n, max_splits, num_warps
        # the interpreter computes bf16 dots wrongly (triton 3.9), so it keeps fp32 math
        self.num_stages, self.tensor_cores = num_stages, bf16_tensor_cores and not interpret
        self._plan = (None, None, None)  # (batch, key, plan): layers of a step share it
        self.reason = ("Triton interpreter on CPU tensors" if interpret
                       else "Triton kernels for GPU pools")

    def head_group(self, k_pool) -> int:
        """kv heads a decode program reads (0: the one-kv-head broadcasting kernel)."""
        hkv = k_pool.shape[1]
        if is_quantized(k_pool):
            return 0
        if self.group is not None:
            if hkv % self.group:
                raise BackendUnavailable(f"kv_heads_per_program={self.group} does not divide "
                                         f"the pool's {hkv} kv heads")
            return self.group
        if not (self.tensor_cores and k_pool.dtype == torch.bfloat16):
            return 0  # fp32 dots padded to 16 rows cost more than broadcasting
        return 1

    def plan(self, batch: SlotBatch, rep: int, num_kv_heads: int, device, group: int = 0):
        key = (rep, num_kv_heads, group)
        if self._plan[0] is batch and self._plan[1] == key:
            return self._plan[2]
        sms = 4 if device.type != "cuda" else \
            torch.cuda.get_device_properties(device).multi_processor_count
        per_sm = self.programs_per_sm or (self.HEADS_PROGRAMS_PER_SM if group else 16)
        plan = self._k.SlotAttentionPlan(batch, rep, num_kv_heads, per_sm * sms, self.block_n,
                                         self.max_splits, self.splits,
                                         num_warps=self.num_warps, group=group)
        self._plan = (batch, key, plan)
        return plan

    def attend(self, q, k_pool, v_pool, batch, params):
        if not self.interpret and q.device.type != "cuda":
            raise BackendUnavailable(f"the triton backend cannot read tensors on {q.device}")
        if is_quantized(k_pool) and (head_dim(k_pool) % 4 or head_dim(v_pool) % 4
                                     or k_pool.stride(0) % 4 or v_pool.stride(0) % 4):
            raise BackendUnavailable("the triton kernels read int8 rows whose head dims and "
                                     "slot strides are multiples of 4 (their scales as fp32)")
        plan = self.plan(batch, q.shape[1] // k_pool.shape[1], k_pool.shape[1], q.device,
                         self.head_group(k_pool))
        return self._k.slot_attention(q, k_pool, v_pool, batch, params, plan,
                                      self.interpret, self.num_stages, self.tensor_cores,
                                      self.fuse_merge)


BACKENDS = {"reference": ReferenceBackend, "cpu": CpuBackend, "triton": TritonBackend}


def select_backend(name: str | None = None, device="cpu") -> AttentionBackend:
    """`name` (or $LAMINA_ATTENTION_BACKEND) in {auto, cpu, triton, reference}; auto by
    default: cpu for a CPU pool, triton for a CUDA pool (float or int8)."""
    name = (name or os.environ.get("LAMINA_ATTENTION_BACKEND") or "auto").lower()
    device = torch.device(device)
    if name not in ("auto", *BACKENDS):
        raise BackendUnavailable(f"unknown attention backend {name!r}; choose auto, "
                                 f"{', '.join(BACKENDS)}")
    if name == "reference":
        backend = ReferenceBackend("requested explicitly")
    elif device.type != "cpu":
        if name == "cpu":
            raise BackendUnavailable(f"the cpu backend cannot serve a pool on {device}")
        try:
            if device.type != "cuda":
                raise BackendUnavailable(f"no attention kernel for {device.type} pools")
            backend = TritonBackend()
        except BackendUnavailable as e:
            if name == "triton":
                raise
            backend = ReferenceBackend(f"{e}; pure-torch reference runs on {device}")
    elif name == "triton":
        raise BackendUnavailable(f"the triton backend serves GPU pools, not {device} (its "
                                 f"interpreter is TritonBackend(interpret=True), for tests)")
    else:
        try:
            backend = CpuBackend()
        except KernelBuildError as e:
            if name == "cpu":
                raise BackendUnavailable(f"cpu attention kernel unavailable: {e}") from e
            backend = ReferenceBackend(f"compiled CPU kernel unavailable ({e})")
    level = logging.INFO if backend.name != "reference" or name == "reference" \
        else logging.WARNING
    log.log(level, "attention backend: %s (%s)", backend.name, backend.reason)
    return backend
