"""The engine's configuration: one frozen `EngineConfig`, validated on creation.

Data in: keyword options (from `LLM(...)`, the CLI or a service config).
Data out: an `EngineConfig` the engine, the executors and the workers read; a bad value
raises `ValueError` naming the field.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

from lamina.engine.scheduler import POLICIES, SchedulerConfig
from lamina.engine.speculative import SpeculativeConfig
from lamina.faults import FaultPlan
from lamina.memory.pages import default_huge_pages, default_prefault
from lamina.memory.sparsity_config import SparsityConfig
from lamina.memory.tier_orders import TierConfig

# "rotational" is the paper's rotational staggered pipelining (5.1): n = `num_batches`
# batches (micro-batches of a step) over n - 1 = `num_compute_workers` model replicas;
# the k-th slice of batch j runs on replica (j + k) mod (n - 1), so a batch's context
# (the splitter's per-cut tensors) moves between replicas while its attention runs. With
# n = 2 (one replica) no context moves and rotational and fixed coincide.
# "fixed" (5.1): `num_compute_workers` replicas, each with its own batch (a sequence
# stays on its replica), sharing the memory workers.
# Replicas are threads of one process on the local executor, compute worker processes
# on Ray (rotational: a ring, `lamina.compute.ring`).
# "auto": none or rotational (n = 2, one replica) per step size, whichever measured
# faster (engine/auto_pipeline.py).
PIPELINES = ("none", "rotational", "fixed", "auto")
PREEMPTION_MODES = ("auto", "swap", "recompute")
# The compute side's linears (`lamina.splitter.dense.DENSE_BACKENDS`, which the engine
# does not import: it never loads the model code; a test keeps the two equal).
DENSE_BACKENDS = ("auto", "eager", "onednn", "avx512bf16")
KV_DTYPES = ("float32", "bfloat16", "int8")
# a device name EngineConfig takes (kv_device, compute_device)
DEVICE_NAME = r"cpu|cuda(:\d+)?"


@dataclass(frozen=True)
class EngineConfig:
    num_kv_slots: int = 16384  # token slots in each memory worker's KV pool
    # each memory worker's pool in bytes instead (None: num_kv_slots decides): its slots
    # are then as many tokens' KV as fit, so kv_dtype='int8' holds ~3.8x fp32's tokens
    kv_pool_bytes: int | None = None
    num_memory_workers: int = 1
    num_compute_workers: int = 1  # model replicas (> 1: pipeline "fixed" or "rotational")
    # a step's batches under pipelining (n): None derives it (rotational: replicas + 1,
    # fixed: one per replica, none: 1); given, it must agree with the replicas
    num_batches: int | None = None
    # the pools' dtype; "int8": each token's keys and values as int8 codes with a scale
    # per token and kv head, keys divided by calibrated channel scales first
    # (kernels/quant.py), ~0.27x fp32's bytes
    kv_dtype: str = "float32"
    kv_device: str = "cpu"  # memory workers' pool device: "cpu" (host DRAM) or "cuda[:i]"
    # host pools on transparent huge pages (madvise): attention reads scattered slots
    # faster, but where the kernel hands huge pages out slowly (VMs whose freed memory
    # goes back to their host) a pool takes ~5x longer to allocate; default from
    # $LAMINA_KV_HUGE_PAGES ("0": off), else on
    kv_huge_pages: bool = field(default_factory=default_huge_pages)
    # host pools' pages all touched at start (their memory taken up front, no faults
    # while serving); off, each faulted in at its first write (lamina.memory.pool);
    # default from $LAMINA_KV_PREFAULT ("0": off), else on
    kv_prefault: bool = field(default_factory=default_prefault)
    # the slices', sampling's device: "cpu" or "cuda[:i]" (memory workers on the host
    # get q/k/v through pinned buffers; on the same GPU, directly)
    compute_device: str = "cpu"
    # on a GPU compute device, decode steps of up to max_batch tokens replay each slice
    # as a CUDA graph (compute/graphs.py); False: eager launches
    cuda_graphs: bool = True
    max_batch: int = 64
    max_step_tokens: int = 4096  # tokens a step feeds; longer prompts go in chunks
    # "fcfs" (arrival order) or "priority": requests' `priority` (lower first) orders
    # decoding, admission and preemption; a waiting request may preempt running ones of
    # lower priority (engine/scheduler.py)
    scheduling_policy: str = "fcfs"
    # A sequence preempted for room: "recompute" computes again, at its readmission, what
    # the pool's prefix cache lost of its KV; "swap" saves its KV to its memory worker's
    # host tier (kv_host_bytes > 0) and loads it back instead (vLLM's names); "auto":
    # swap where there is a host tier
    preemption_mode: str = "auto"
    seed: int = 0  # seeds requests that bring no seed of their own
    pipeline: str = "none"  # "none" | "rotational" | "fixed" | "auto" (see PIPELINES)
    split_kv: bool = True  # a sequence's KV may span memory workers (merged by LSE)
    # Ray executor: each memory worker's q/k/v of a layer go as this many groups of its
    # requests, each attended as it arrives while the rest is in flight, each output
    # sent back while the next is attended (paper 5.2's communication-attention overlap;
    # lamina/dataplane/protocol.py). 1: one frame a layer.
    stream_groups: int = 1
    max_recoveries: int = 3  # failed steps in a row the executor may recover from (0: none)
    # Steps failing past max_recoveries in a row with no sequence named, or a request in
    # more than max_recoveries such steps since it last drew: bisect the requests they
    # held to the one behind them, which then fails alone (engine/culprit.py); False:
    # the engine stops there
    find_culprits: bool = True
    worker_timeout_s: float | None = 120.0  # a memory worker silent this long is hung
    # Ray executor: the compute worker answering no step for this long is hung (it is
    # then replaced); None waits forever. Longer than any step may take.
    step_timeout_s: float | None = 600.0
    # Ray executor: while no request is in the engine, its serving loop checks this often
    # that every worker answers, and replaces a dead or silent one before a request
    # needs it (`LLMEngine.check_workers`); None: only steps find them
    idle_check_s: float | None = 10.0
    # Ray executor: how long the workers' placement group may wait for its resources
    # (busy with other deployments) before the deployment fails naming what is missing
    placement_timeout_s: float = 30.0
    # Ray executor: a memory worker that dies and whose replacement cannot start (its
    # node gone and no room left for its bundle, or its start failing) is dropped if at
    # least this many memory workers stay: the engine goes on with fewer pools (the KV
    # that was on it computed again); were fewer to stay, the engine stops instead
    min_live_memory_workers: int = 1
    dense_backend: str = "auto"  # compute side's linears: one of DENSE_BACKENDS
    fuse_pointwise: bool = True  # RMSNorm / rotary / SiLU x up chains as one C++ op each
    # Ray executor: fresh prompts attend on the compute worker, which ships only their
    # KV to the memory workers (paper 5.6); False: the memory workers attend them too
    local_prefill: bool = True
    # A request whose prompt + max_tokens exceeds the model's context: False (default,
    # as vLLM) refuses it naming both numbers; True lowers its max_tokens to what fits.
    clamp_max_tokens: bool = False
    # Automatic prefix caching: finished and prefilled sequences' KV stays in the pools
    # (a radix tree per memory worker, engine/prefix_cache.py) for later requests with
    # the same prefix, until the space is needed
    prefix_caching: bool = True
    # Sessions' KV beyond the pools, per memory worker (requests with a session_id):
    # finished turns are saved to a host-DRAM tier of kv_host_bytes (0: none), demoted
    # to checksummed files under kv_disk_dir (None: none) of at most kv_disk_bytes, and
    # loaded back when the session's next turn is admitted (engine/sessions.py)
    kv_host_bytes: int = 0
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 0
    # A session turn whose history dropped its oldest turns (to fit the context) reuses
    # the saved KV of what it kept at the new positions, keys re-rotated (rotary models
    # only). Not exact: the kept tokens' KV was computed attending to the dropped ones.
    truncation_reuse: bool = False
    # Attention sparsity on the memory workers (memory/sparsity.py): decode rows attend
    # to kv_budget of their keys (a fraction in (0, 1] or a token count), chosen by
    # kv_sparsity ("dense" | "streaming" | "h2o" | "snapkv" | "topk" | "swa"), spread over
    # layers by kv_layer_budgets ("uniform" | "pyramid" | "entropy" | "concentration")
    kv_sparsity: str = "dense"
    kv_budget: float | int = 1.0
    kv_layer_budgets: str = "uniform"
    # topk: 0 ranks pages by their bounds alone; r >= 1 scores the keys of the pages
    # covering r x the budget exactly and keeps the best (closer to dense, reads more)
    kv_topk_rescore: float = 0.0
    # streaming, h2o and snapkv (deployment-wide or a request's own) give back the slots
    # of the keys they will never attend again (h2o / snapkv: left out at every layer),
    # so the pools hold more sequences; False keeps every slot
    kv_evict: bool = True
    # Speculative decoding by n-gram prompt lookup (engine/speculative.py): each decoding
    # sequence is fed up to speculative_tokens guessed tokens (0: off), those that
    # followed the latest earlier occurrence of its last speculative_ngram_max ..
    # speculative_ngram_min tokens; the step keeps the tokens drawing one a step gives
    speculative_tokens: int = 0
    speculative_ngram_max: int = 3
    speculative_ngram_min: int = 2
    faults: FaultPlan | None = None  # test hook: inject step failures (lamina.faults)

    # (cached: the engine asks for each sequence's policy every step; a frozen
    # dataclass's fields never change, and eq, hash and replace read only the fields)
    @cached_property
    def scheduling(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_batch, self.max_step_tokens, self.split_kv,
                               policy=self.scheduling_policy)

    @cached_property
    def tiers(self) -> TierConfig:
        return TierConfig(self.kv_host_bytes, self.kv_disk_dir, self.kv_disk_bytes)

    @cached_property
    def sparsity(self) -> SparsityConfig:
        """The memory workers' sparsity config (entropy weights are measured at start-up
        and added by whoever builds the memory sides)."""
        return SparsityConfig(self.kv_sparsity, self.kv_budget, self.kv_layer_budgets,
                              rescore=self.kv_topk_rescore)

    @cached_property
    def speculative(self) -> SpeculativeConfig:
        return SpeculativeConfig(self.speculative_tokens, self.speculative_ngram_max,
                                 self.speculative_ngram_min)

    @property
    def graph_tokens(self) -> int:
        """The largest decode step replayed as CUDA graphs (0: none): on a GPU compute
        device with `cuda_graphs`, steps of up to `max_batch` tokens."""
        cuda = self.compute_device.startswith("cuda")
        return self.max_batch if self.cuda_graphs and cuda else 0

    @property
    def batches(self) -> int:
        """A step's batches under the pipeline (n): `num_batches`, or derived from the
        replicas (kept None so `dataclasses.replace` of the pipeline re-derives it)."""
        n = self.num_compute_workers
        return {"none": 1, "fixed": n, "rotational": n + 1, "auto": 2}[self.pipeline]

    def _check_pipeline(self) -> None:
        """The replicas and the batches given agree with the pipeline."""
        n, mode, b = self.num_compute_workers, self.pipeline, self.num_batches
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"EngineConfig.num_compute_workers must be an int >= 1, got {n!r}")
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"EngineConfig.num_batches must be an int >= 1 or None, got {b!r}")
        want = self.batches
        if mode == "none" and n > 1:
            raise ValueError(f"EngineConfig: {n} compute workers need a pipeline: 'fixed' "
                             f"(each replica its own batch) or 'rotational' (n batches over "
                             f"n - 1 replicas)")
        if mode == "auto" and n > 1:
            raise ValueError("EngineConfig: pipeline 'auto' chooses between none and "
                             "rotational on one compute replica (num_compute_workers=1)")
        if mode == "fixed" and n < 2:
            raise ValueError("EngineConfig: pipeline 'fixed' runs num_compute_workers >= 2 "
                             "replicas, each with its own batch (got 1)")
        if b is not None and b != want:
            rule = {"none": "no pipeline runs 1 batch",
                    "auto": "auto runs 1 or 2 batches",
                    "fixed": "fixed runs one batch per replica",
                    "rotational": "rotational runs n batches over n - 1 replicas"}[mode]
            raise ValueError(f"EngineConfig: {rule}: num_batches={b} does not fit "
                             f"num_compute_workers={n} (it needs num_batches={want})")

    def __post_init__(self):
        self._check_fields()
        self.scheduling  # noqa: B018 - SchedulerConfig checks its other fields
        self.tiers  # noqa: B018 - TierConfig checks the kv_* tier fields
        self.speculative  # noqa: B018 - SpeculativeConfig checks the speculative_* fields
        try:
            _ = self.sparsity
        except ValueError as e:
            raise ValueError(f"EngineConfig.kv_sparsity/kv_budget/kv_layer_budgets/"
                             f"kv_topk_rescore: {e}") from None
        self._check_pipeline()
        self._check_combinations()

    def _check_fields(self) -> None:
        """Each field on its own: its type and range."""
        _need_int(self, "num_kv_slots", 1, "a positive int")
        _need_int(self, "kv_pool_bytes", 1, "a positive int or None", optional=True)
        _need_int(self, "num_memory_workers", 1, "an int >= 1")
        _need_int(self, "max_recoveries", 0, "an int >= 0")
        _need_int(self, "min_live_memory_workers", 1, "an int >= 1")
        _need_int(self, "stream_groups", 1, "an int in 1..16", high=16)
        for name in ("worker_timeout_s", "step_timeout_s", "idle_check_s"):
            _need_seconds(self, name, "a positive number of seconds or None", optional=True)
        _need_seconds(self, "placement_timeout_s", "a positive number of seconds")
        for name in ("cuda_graphs", "local_prefill", "fuse_pointwise", "prefix_caching",
                     "find_culprits", "kv_evict", "truncation_reuse", "clamp_max_tokens",
                     "kv_huge_pages", "kv_prefault"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, "
                                 f"got {getattr(self, name)!r}")
        for name, allowed in (("kv_dtype", KV_DTYPES), ("dense_backend", DENSE_BACKENDS),
                              ("pipeline", PIPELINES), ("scheduling_policy", POLICIES),
                              ("preemption_mode", PREEMPTION_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"EngineConfig.{name} must be one of {allowed}, "
                                 f"got {getattr(self, name)!r}")
        for name in ("kv_device", "compute_device"):
            d = getattr(self, name)
            if not isinstance(d, str) or not re.fullmatch(DEVICE_NAME, d):
                raise ValueError(f"EngineConfig.{name} must be 'cpu' or 'cuda[:i]', "
                                 f"got {d!r}")
        if self.faults is not None and not isinstance(self.faults, FaultPlan):
            raise ValueError(f"EngineConfig.faults must be a FaultPlan or None, "
                             f"got {type(self.faults).__name__}")

    def _check_combinations(self) -> None:
        """The rules between fields (each field is valid on its own by now)."""
        if self.truncation_reuse and not self.kv_host_bytes:
            raise ValueError("EngineConfig.truncation_reuse needs the session tiers "
                             "(kv_host_bytes > 0): they hold the KV it reuses")
        if self.truncation_reuse and self.kv_dtype == "int8":
            raise ValueError("EngineConfig.truncation_reuse re-rotates saved float keys; "
                             "it is not offered with kv_dtype='int8'")
        if self.preemption_mode == "swap" and not self.kv_host_bytes:
            raise ValueError("EngineConfig.preemption_mode='swap' saves preempted sequences' "
                             "KV to the host tier: set kv_host_bytes > 0")
        if self.kv_host_bytes and not self.prefix_caching:
            raise ValueError("EngineConfig.kv_host_bytes needs prefix_caching (the tiers "
                             "keep what the pool's prefix cache evicts)")
        g = self.stream_groups
        if g > 1 and self.kv_sparsity != "dense":
            raise ValueError(f"EngineConfig: stream_groups={g} streams q/k/v by groups of "
                             f"requests, which kv_sparsity={self.kv_sparsity!r}'s per-layer "
                             f"selection does not follow: use stream_groups=1")


def _need_int(cfg: EngineConfig, name: str, low: int, what: str, optional: bool = False,
              high: int | None = None) -> None:
    """`cfg.name` is an int (not a bool) in low..high (or None where optional)."""
    v = getattr(cfg, name)
    if v is None and optional:
        return
    if (not isinstance(v, int) or isinstance(v, bool) or v < low
            or (high is not None and v > high)):
        raise ValueError(f"EngineConfig.{name} must be {what}, got {v!r}")


def _need_seconds(cfg: EngineConfig, name: str, what: str, optional: bool = False) -> None:
    """`cfg.name` is a finite positive number of seconds (or None where optional)."""
    t = getattr(cfg, name)
    if t is None and optional:
        return
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
        raise ValueError(f"EngineConfig.{name} must be {what}, got {t!r}")
