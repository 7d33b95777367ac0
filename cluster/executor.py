"""RayExecutor: places the compute worker(s) and N memory workers on a Ray cluster, wires
their data plane, and sends each `StepPlan` to the compute worker over the control
channel (`lamina.dataplane.control`: a socket, not a Ray call; per-layer tensors never go through
Ray either). Ray places, configures and supervises the workers.

Compute replicas (`num_compute_workers` = R > 1, paper 5.1): R compute workers, each a
model replica with its own control channel and its own data-plane connection to every
memory worker; a memory worker serves the R connections over its one pool.
- pipeline "fixed": each replica its own sequences (`lamina.executor.replicas`); a
  step's sub-plans go out at once and their results are merged.
- pipeline "rotational" (n = R + 1 batches): the replicas form a ring
  (`lamina.compute.ring`), each connected to the next; every replica gets the whole
  plan and runs its slices of every micro-batch, contexts move to the next replica
  over the ring and the memory workers send each layer's output there; each returns
  the tokens of the micro-batches whose last slice it ran. One replica failing
  interrupts the others (their sockets shut down), so none waits out its timeout.
Either way a step's session tier orders go to the memory workers before the step
(`apply_tiers`, a Ray call), not in a replica's frames.

Data in: `StepPlan`s from the engine. Data out: `StepResult`s. A dead worker surfaces
as an error naming it; `recover` then resets the live workers and replaces the others
(the engine keeps the KV of the pools kept and recomputes the rest), or the engine
fails loudly when it cannot.
"""
from __future__ import annotations

import logging
import os
import re
import statistics
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace

import ray

from lamina import ONEDNN_CACHE
from lamina.dataplane.collective import Rendezvous, collective_backend
from lamina.dataplane.control import ControlClient, StepError
from lamina.dataplane.rdma import RdmaSupport, TransportChoice, choose_transport, probe
from lamina.dataplane.transport import SocketChannel, connect_stream, shm_enabled
from lamina.engine.messages import StartedMemory, StepPlan, StepResult
from lamina.errors import EngineDead, SequenceFault
from lamina.executor.base import Executor
from lamina.executor.replicas import ReplicaSplit, is_hard, merged, replica_faults
from lamina.kernels import KernelBuildError, is_built, load_cpu_kernel
from lamina.kernels.cpu_build import BUILD_TIME
from lamina.memory.sparsity import SCORED
from lamina.memory.tier_orders import SlotMove, TierMiss, TierMove, sum_stats
from lamina.memory.tiers import PREFETCH_WAIT_S

from .compute_worker import ComputeWorker, ComputeWorkerSpec, WorkerStart
from .connect import connect_ray
from .memory_worker import MemoryWorker
from .placement import (
    Placement,
    bundle_threads,
    memory_workers_that_fit,
    pin,
    place,
    reserve,
    worker_options,
)

log = logging.getLogger(__name__)
RECOVER_TIMEOUT_S = 30  # a live worker answers a ping within this
RECOVER_ATTEMPTS = 3  # a recovery's tries when workers die while it runs
START_TIMEOUT_S = 120  # a worker's model load and setup, once its bundle is placed
PLACE_POLL_S = 1.0  # how often a replacement's wait looks where its bundle is
HEALTH_TIMEOUT_S = 10  # after a failed step: how long the memory workers get to report
# a KV move's dest refuses to write after its deadline; the executor gives up this much
# later, so a write it gave up on never lands (wall clocks of nodes differ by far less)
MOVE_MARGIN_S = 5.0
OMP_SPIN = 3_000  # libgomp spin rounds of an idle worker thread before it sleeps


class WorkerFailure(RuntimeError):
    """A Ray worker died or its data plane broke; the step was not computed."""


class WorkerTimeout(WorkerFailure):
    """Workers did not answer a call within its bound (`RayExecutor._get`)."""


def connect_control(addr: tuple) -> ControlClient:
    """The engine's end of a compute worker's control channel (`serve_control`)."""
    kind, *where = addr
    return ControlClient(SocketChannel(connect_stream(kind, where[0] if kind == "unix"
                                                      else where)))


def prebuild_kernel(here: str, nodes: list, built=is_built) -> Future | None:
    """A first start's CPU kernel build (1-2 min on 2 cores), run in this process on a
    thread when a worker will run on this node (`here`; `nodes`: each bundle's) and the
    node has no build yet; else None. The workers here wait for it (torch's lock on the
    build folder) instead of building it themselves, and `RayExecutor._get` waits for it
    before their start timeout begins: a build on a slow machine took most of that
    timeout, whose message then blamed the cluster's room."""
    if here not in nodes or built():
        return None

    def build() -> None:
        try:
            load_cpu_kernel()
        except KernelBuildError as e:  # the workers fall back and say so in their logs
            log.warning("could not build the CPU kernel: %s", e)

    pool = ThreadPoolExecutor(1, thread_name_prefix="lamina-kernel-build")
    try:
        return pool.submit(build)
    finally:
        pool.shutdown(wait=False)


class RayExecutor(Executor):
    _calls_s: float | None = None  # `_get`'s bound while a recovery wires workers

    def __init__(self, model, dtype, config, threads: int = 1, address: str | None = None,
                 wide_threads: int | None = None, name: str | None = None):
        if not ray.is_initialized():
            connect_ray(address)
        m, r_n = config.num_memory_workers, config.num_compute_workers
        have = ray.cluster_resources()
        self.check(config)
        c_opts, m_opts = worker_options(config, have)
        self._pool_device = "cuda" if config.kv_device.startswith("cuda") else "cpu"
        compute_gpu = config.compute_device.startswith("cuda")
        # Idle OpenMP threads spin only briefly (3000 rounds of libgomp's wait loop, some
        # tens of us), then sleep: long enough to carry the compute worker's threads
        # from one linear to the next, short enough that a memory worker woken for a
        # layer's attention finds that core free (at 10^4 rounds it waited a median
        # ~110 us for it). With the memory workers' SCHED_BATCH (`memory_worker`),
        # B=32 bf16 decode steps took 59.0-63.0 ms against 62.1-65.2 ms at 10^4
        # without it (benchmarks/RESULTS.md); OMP_WAIT_POLICY=PASSIVE (no spin)
        # slows the dense part itself (45 against 41 ms a step).
        env = {"runtime_env": {"env_vars": {
            "GOMP_SPINCOUNT": str(OMP_SPIN),
            # bounded per-shape oneDNN caches (see lamina/__init__.py)
            **{v: os.environ.get(v, ONEDNN_CACHE)
               for v in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}}}}
        self._c_opts, self._m_opts = {**c_opts, **env}, {**m_opts, **env}
        # recovery replaces a compute worker that does not answer a ping within this
        self.ping_timeout_s: float = RECOVER_TIMEOUT_S
        # after a failed step, how long the memory workers get to report
        self.health_timeout_s: float = HEALTH_TIMEOUT_S
        self.config = config
        # every worker's resources reserved at once, or a clear error in bounded time
        # placement group names are unique per cluster: one deployment, one name
        self.placement_name = name or f"lamina-{uuid.uuid4().hex[:8]}"
        # Ray chooses the nodes for all the workers at once; then the compute workers
        # get a group and each memory worker one of its own on those nodes (`pin`)
        chosen = place(c_opts, m_opts, m, config.placement_timeout_s,
                       f"{self.placement_name}-nodes", r_n)
        self.placement, homes = pin(chosen, self.placement_name,
                                    config.placement_timeout_s)
        self._threads_asked = (threads, wide_threads)  # (`_memory_home`)
        self._homes: list[Placement] = homes  # per memory worker, its group
        self._numbering: list[int] = []  # a recovery's: each worker's index before it
        # per compute worker: (threads, threads of steps whose memory workers sit idle)
        self.worker_threads = [bundle_threads(res, "compute", threads, wide_threads)
                               for res in self.placement.node_resources()]
        self.wide_threads = self.worker_threads[0][1]  # compute worker 0's
        self._kernel_build = prebuild_kernel(
            ray.get_runtime_context().get_node_id(),
            self.placement.node_ids() + [h.node_ids()[0] for h in homes])
        # each replica's threads are its bundle's (`_new_compute`)
        self._compute_spec = ComputeWorkerSpec(
            model, dtype, m, dense_backend=config.dense_backend, batch_hint=config.max_batch,
            fuse=config.fuse_pointwise, compute_device="cuda" if compute_gpu else "cpu",
            graph_tokens=config.graph_tokens, stream_groups=config.stream_groups)
        self.computes: list = []  # actor handles, filled by `_start`
        self.memory: list = []
        self.controls: list[ControlClient | None] = [None] * r_n
        self.replica_split: ReplicaSplit | None = None
        self._ring_pool: ThreadPoolExecutor | None = None
        try:
            self._start(r_n)
        except BaseException:
            # a deployment that cannot start gives back what it took: its workers and
            # its placement group (else they stay reserved on a shared cluster and the
            # next deployment waits out its placement timeout)
            try:
                self.shutdown()
            except Exception as e:  # noqa: BLE001 - the start's own error is the one raised
                log.warning("could not clean up the failed deployment: %s: %s",
                            type(e).__name__, e)
            raise

    def _start(self, r_n: int) -> None:
        """The workers, in the placement's bundles, and their wiring."""
        config = self.config
        self.computes = [self._new_compute(r) for r in range(r_n)]
        # the memory workers' processes start (Python, torch, lamina imported) while the
        # compute workers load and split the model: their setup waits on its answers
        self.memory = [self._new_memory(i) for i in range(config.num_memory_workers)]
        # rotational over the replicas: a ring of compute workers (every one runs every
        # step); fixed: each replica's sequences; neither: one compute worker
        self.ring = r_n > 1 and config.pipeline == "rotational"
        self.replica_split = ReplicaSplit(r_n) if r_n > 1 and not self.ring else None
        self._ring_pool = ThreadPoolExecutor(r_n, "lamina-ring") if self.ring else None
        self._told_dropped = False  # the ring's one log line about dropped keys
        self._replaced = {"compute": 0, "memory": 0}  # by recoveries, so far
        self._kv_kept: frozenset[int] = frozenset()  # pools the latest recovery kept
        self._lost: tuple[int, ...] = ()  # memory workers it dropped (`memory_lost`)
        # memory workers that gave no health answer after the failed step: the recovery
        # replaces them without waiting on them a second time
        self._silent: frozenset[int] = frozenset()
        self._silent_computes: frozenset[int] = frozenset()  # the same, of compute workers
        self.dense = self._get(self.compute.dense_choice.remote(), "the compute worker")
        for r, st in enumerate(self.compute_starts()):
            log.info("compute worker %d: %s in %.1f s, split in %.1f s", r, "weights only"
                     if st.weights_only else "model loaded", st.load_s, st.split_s)
        self._start_memory()

    def compute_starts(self) -> list[WorkerStart]:
        """How each compute worker got its slices (`WorkerStart`: its weights alone, or
        the full model load) and how long that took."""
        return self._get([c.start_report.remote() for c in self.computes],
                         "the compute workers")

    @classmethod
    def check(cls, config) -> None:
        """A rotational ring replays no CUDA graphs (each slice runs on another replica
        than the one before); `LAMINA_COLLECTIVE` must suit the devices (checked before
        any worker starts)."""
        collective_backend(config.compute_device, config.kv_device)
        if (config.num_compute_workers > 1 and config.pipeline == "rotational"
                and config.graph_tokens):
            raise ValueError("pipeline 'rotational' over compute workers runs without CUDA "
                             "graphs: pass cuda_graphs=False")

    @property
    def compute(self):
        """The first compute worker (the one that answers model questions)."""
        return self.computes[0]

    @property
    def control(self) -> ControlClient | None:
        return self.controls[0]

    def _new_compute(self, r: int = 0):
        threads, wide = self.worker_threads[r]
        return ComputeWorker.options(**self._c_opts, **self.placement.compute(r)).remote(
            replace(self._compute_spec, replica=r, threads=threads, wide_threads=wide))

    def _new_memory(self, i: int):
        home, threads = self._memory_home(self._homes[i])
        return MemoryWorker.options(**self._m_opts, **home).remote(i, threads)

    def _memory_home(self, home: Placement) -> tuple[dict, int]:
        """A memory worker's actor options and torch threads in its group `home`."""
        threads, wide = self._threads_asked
        return home.memory(0), bundle_threads(home.node_resources()[0], "memory", threads,
                                              wide)[0]

    def _start_memory(self, kept: frozenset[int] = frozenset()) -> frozenset[int]:
        """Fresh memory workers (empty pools) in every place but `kept` (workers `reset`
        by a recovery, already set up), all wired to the compute workers; -> the workers
        whose pools were kept (`kept`, or none when every pool had to be set up again)."""
        cfg = self.config
        if not self.memory:
            self.memory = [self._new_memory(i) for i in range(cfg.num_memory_workers)]
        sparsity = cfg.sparsity
        # prompts whose last queries score their keys (snapkv, h2o, swa) attend on the
        # memory workers, which keep those scores
        local_prefill = cfg.local_prefill and not (sparsity.enabled
                                                   and sparsity.policy in SCORED)
        if local_prefill != cfg.local_prefill:
            log.info("kv_sparsity=%r scores prompts on the memory workers: local_prefill "
                     "off", sparsity.policy)
        # every replica sets its own compute side's share (scratch pool, scales) alike
        pool_cfg, params, sparsity = self._get([c.memory_spec.remote(
            cfg.num_kv_slots, cfg.kv_dtype, self._pool_device, local_prefill, cfg.faults,
            cfg.kv_pool_bytes, sparsity if sparsity.enabled else None, cfg.kv_huge_pages,
            cfg.kv_prefault)
            for c in self.computes], "the compute workers")[0]
        if kept and (pool_cfg != self.pool_config or list(params) != self.params):
            kept = frozenset()  # a new compute worker's differ: set every pool up again
        self.params = list(params)  # per-layer AttentionParams
        self.pool_config = pool_cfg
        self.pool_slots = pool_cfg.num_slots  # kv_pool_bytes may have set it
        tiers = cfg.tiers if cfg.tiers.enabled else None
        rope = self._get(self.compute.rotary.remote(), "the compute worker") if tiers else None
        self._setup_args = (pool_cfg, params, cfg.faults, tiers, rope, sparsity)  # (`add_...`)
        fresh = [i for i in range(len(self.memory)) if i not in kept]
        info = dict(zip(fresh, self._get(
            [self.memory[i].setup.remote(*self._setup_args, len(self.computes)) for i in fresh],
            "the memory workers", start=True)))
        self.memory_info = [info[i] if i in info else self.memory_info[i]
                            for i in range(len(self.memory))]
        self._rotary = rope is not None
        nodes = self._get([w.__ray_call__.remote(
            lambda s: ray.get_runtime_context().get_node_id()) for w in self.memory],
            "the memory workers")
        rdma_seen = [0] * len(self.memory)  # per memory worker, its RDMA connections so far
        wired = [self._wire(r, nodes, rdma_seen) for r in range(len(self.computes))]
        # replica 0's pairs (the one compute worker's, without replicas)
        _, self.addresses, self.transports, self.transport_choices = wired[0]
        computes = [w[0] for w in wired]
        self.nodes = {"compute": computes[0], "computes": computes, "memory": nodes}
        if self.ring:
            self._wire_ring(computes)
        return kept

    def _wire_ring(self, nodes: list[str]) -> None:
        """Connect each compute worker to the next (a Unix socket on one node, else TCP):
        the ring its contexts move on."""
        r_n, c = len(self.computes), self.computes
        addrs = self._get([c[r].listen_ring.remote(nodes[r] == nodes[(r - 1) % r_n])
                           for r in range(r_n)], "the compute workers' ring")
        self._get([c[r].connect_ring.remote(r, r_n, addrs[(r + 1) % r_n],
                                            self.config.worker_timeout_s)
                   for r in range(r_n)], "the compute workers' ring")
        for r in range(r_n):
            log.info("compute worker %d -> compute worker %d (contexts): %s", r,
                     (r + 1) % r_n, transport(addrs[(r + 1) % r_n]))

    def _wire(self, r: int, nodes: list[str], rdma_seen: list[int], first: int = 0) -> tuple:
        """Connect compute worker `r` to every memory worker and open its control
        channel; with `first` > 0, to memory workers `first`.. only (`nodes` theirs;
        added to a deployment that runs: its control channel stays). Each pair's
        transport (`choose_transport`): co-located, a Unix socket (+ shared memory);
        across nodes RDMA where both ends can run it, else TCP.
        -> (its node, addresses, transport names, choices)."""
        cfg, compute, workers = self.config, self.computes[r], self.memory[first:]
        node = self._get(compute.node_id.remote(), f"compute worker {r}")
        choices = self._transports(compute, node, nodes, workers)
        addrs = self._get([w.listen.remote(c.kind) for w, c in zip(workers, choices)],
                          "the memory workers' data plane")
        mine = self._get(compute.connect.remote(addrs, cfg.worker_timeout_s, first),
                         f"compute worker {r}'s data plane")
        self._get([self.memory[i].accept_rdma.remote(ep, rdma_seen[i])
                   for i, ep in mine["rdma"].items()], "the memory workers' RDMA queue pairs")
        for i in mine["rdma"]:
            rdma_seen[i] += 1
        names = [transport(a) for a in addrs]
        for i, (n, t, c) in enumerate(zip(nodes, names, choices), start=first):
            log.info("compute worker %d (node %s) <-> memory worker %d (node %s): %s (%s)",
                     r, node[:8], i, n[:8], t, c.why)
        if first == 0:
            self._open_control(r, node)
        return node, addrs, names, choices

    def _transports(self, compute, node: str, nodes: list[str],
                    workers: list) -> list[TransportChoice]:
        """Each of `workers`' transport choice for `compute` (on `node`; `nodes`: theirs);
        RDMA needs it on both nodes (`probe` runs where each worker runs: devices and
        pyverbs are per host)."""
        far = [w for w, n in zip(workers, nodes) if n != node]
        support = {}
        if far:
            here = self._get(compute.__ray_call__.remote(lambda s: probe()),
                             "the compute worker")
            there = self._get([w.__ray_call__.remote(lambda s: probe()) for w in far],
                              "the memory workers")
            for w, s in zip(far, there):
                if s.ok and not here.ok:  # the memory node could, the compute node cannot
                    s = RdmaSupport(False, s.devices, f"compute node: {here.why}")
                support[w] = s
        near = RdmaSupport(False, (), "same node")
        collective = collective_backend(self.config.compute_device, self.config.kv_device)
        return [choose_transport(n == node, shm_enabled(), support.get(w, near), collective)
                for w, n in zip(workers, nodes)]

    def _get(self, refs, what: str, start: bool = False):
        """`ray.get`, bounded: a worker whose bundle sits on a node that is gone waits
        until Ray declares the node dead and places the bundle elsewhere, or forever
        where no node has room. The bound is a worker's start, but while a recovery
        wires workers that are up (`_calls_s` set) it is that, unless `start` (a call
        whose work takes long: a pool's setup)."""
        if self._kernel_build is not None:  # not part of the workers' own start
            self._kernel_build.result()
            self._kernel_build = None
        if self._calls_s is not None and not start:
            try:
                return ray.get(refs, timeout=self._calls_s)
            except ray.exceptions.GetTimeoutError:
                raise WorkerTimeout(f"{what} gave no answer within {self._calls_s:g} s "
                                    "while the recovery ran") from None
        wait = START_TIMEOUT_S + self.config.placement_timeout_s
        try:
            return ray.get(refs, timeout=wait)
        except ray.exceptions.GetTimeoutError:
            raise WorkerTimeout(
                f"{what} did not start within {wait:g} s: the cluster has no room for "
                "them (see `ray status`), or a node's first start is building the CPU "
                f"kernel ({BUILD_TIME}, once; `lamina doctor` on a node builds it "
                "ahead)") from None
        except ray.exceptions.RayActorError as e:
            if not e.actor_init_failed:
                raise
            # Ray's message is the worker's whole traceback; its last line is the error
            raise WorkerFailure(f"{what} could not start: {_last_line(str(e))}") from e

    def _open_control(self, r: int, compute_node: str) -> None:
        """A fresh control channel to compute worker `r` (Unix socket when the engine runs
        on its node, else TCP)."""
        self._close_control(r)
        here = ray.get_runtime_context().get_node_id()
        addr = self._get(self.computes[r].serve_control.remote(here == compute_node),
                         f"compute worker {r}'s control channel")
        control = connect_control(addr)
        control.channel.set_timeout(self.config.step_timeout_s)
        self.controls[r] = control

    def _close_control(self, r: int | None = None) -> None:
        """Close compute worker `r`'s control channel (None: every one)."""
        for i in range(len(self.controls)) if r is None else (r,):
            if self.controls[i] is not None:
                self.controls[i].close()
                self.controls[i] = None

    def set_worker_timeout(self, seconds: float | None) -> None:
        """How long the compute workers wait on a silent memory worker before the step
        fails (then `recover` replaces it)."""
        self.config = replace(self.config, worker_timeout_s=seconds)  # validates
        self._get([c.set_timeout.remote(seconds) for c in self.computes],
                  "the compute workers")

    def recover(self, error: BaseException) -> bool:
        """After a step broke off mid-way: every worker that is alive and done with the
        step is reset and kept (its slot tables and per-sequence state dropped, as if
        new; the pools' bytes stay), every other one (dead, hung, or still stuck in the
        step) replaced; all are wired afresh. A kept memory worker keeps its pool's bytes
        (`kv_kept`), so the engine recomputes only the KV that was on replaced ones.
        Keeping a worker saves its start (a process, the model, a pool): seconds each.
        A worker that dies while this runs (its reset, setup or wiring raises) or hangs
        (no answer within `ping_timeout_s`; the workers this starts get a start's
        bound) is found by the next attempt, which replaces it: at most
        RECOVER_ATTEMPTS in all.
        A memory worker whose replacement cannot start (`_not_started`: its bundle on
        no live node for `placement_timeout_s`, not up within a start's bound, or its
        start raising) is dropped, the others numbered 0.. again (`memory_lost`), while
        at least `min_live_memory_workers` stay.
        False if the cluster cannot give new workers."""
        self._check_open()  # a shut executor's placement is gone: nothing to start on
        replaced: set[int] = set()  # memory workers new since the step: no KV of theirs
        before = len(self.memory)
        self._numbering, self._lost = list(range(before)), ()
        for attempt in range(1, RECOVER_ATTEMPTS + 1):
            try:
                self._kv_kept = self._recover_once(replaced)
                self._lost = tuple(i for i in range(before) if i not in self._numbering)
                return True
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError,
                    WorkerTimeout) as e:
                if attempt == RECOVER_ATTEMPTS:
                    raise
                log.warning("recovery: a worker failed while it ran (%s: %s); recovering "
                            "again (attempt %d of %d)", type(e).__name__,
                            _last_line(str(e)), attempt + 1, RECOVER_ATTEMPTS)
        raise AssertionError("unreachable")

    def _recover_once(self, replaced: set[int]) -> frozenset[int]:
        """One attempt of `recover`; adds the memory workers it replaces to `replaced`
        (an earlier attempt's stay there: their pools are new) -> the pools kept."""
        silent, self._silent_computes = self._silent_computes, frozenset()
        new = []  # compute workers this attempt starts
        for r in self._reset_all("compute", self.ping_timeout_s, silent):
            ray.kill(self.computes[r])
            self.computes[r] = self._new_compute(r)
            new.append(self.computes[r])
        self._close_control()
        if self.replica_split is not None:
            self.replica_split.reset()
        # a memory worker's serving ends once its compute workers hung up (above)
        lost = self._reset_all("memory", self.health_timeout_s, self._silent)
        self._silent = frozenset()
        homeless = self._rehome(lost)
        for i in lost:
            ray.kill(self.memory[i])
            if i not in homeless:
                self.memory[i] = self._new_memory(i)
        replaced |= lost
        # the new workers up (their start has the whole bound), then the wiring's calls
        # have a live worker's: a kept one that hangs now fails this attempt soon
        pings = {i: self.memory[i].ping.remote() for i in lost if i not in homeless}
        self._get([w.ping.remote() for w in new], "the new compute workers", start=True)
        failed = self._not_started(pings, homeless)
        keep = [i for i in range(len(self.memory)) if i not in failed]
        if failed:
            self._drop_lost(failed, keep, replaced)
        self._calls_s = self.ping_timeout_s
        try:
            self._get([self.memory[j].renumber.remote(j) for j, i in enumerate(keep)
                       if i != j], "the memory workers")
            return self._start_memory(frozenset(range(len(self.memory))) - replaced)
        finally:
            self._calls_s = None

    def _rehome(self, lost: frozenset[int]) -> dict[int, str]:
        """Of the memory workers `lost`, each whose group is on no live node gets a new
        group, the old one removed (Ray would place its bundle again with no pause
        between tries while no node has room: `placement`'s docstring); the new groups
        wait together, at most `placement_timeout_s` -> {index: why} of those that found
        no room (their new group is removed when they are dropped)."""
        order = sorted(lost)
        gone = [i for i, live in zip(order, self._on_live_nodes(
            [self._homes[i] for i in order])) if not live]
        for i in gone:
            self._homes[i].remove()
            self._homes[i] = reserve(self._m_opts,
                                     f"{self.placement_name}-m{i}-{uuid.uuid4().hex[:4]}")
        if not gone:
            return {}
        bare = self.config.placement_timeout_s
        refs = {i: self._homes[i].group.ready() for i in gone}
        ready = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=bare)[0])
        return {i: _homeless(bare) for i, r in refs.items() if r not in ready}

    def _not_started(self, pings: dict, homeless: dict[int, str] | None = None
                     ) -> dict[int, str]:
        """Of the replacement memory workers {index: its ping}, those that did not
        start (`_late`) or whose start raised, and the `homeless` ones (`_rehome`) ->
        {index: why}. Raises (`WorkerTimeout`, `WorkerFailure`) when dropping them would
        leave fewer than `min_live_memory_workers`."""
        why = {**(homeless or {}), **self._late(pings)}
        timed_out = bool(why)
        for i, ref in pings.items():
            try:
                if i not in why:
                    ray.get(ref)
            except ray.exceptions.RayActorError as e:
                why[i] = f"could not start: {_last_line(str(e))}"
        left = len(self.memory) - len(why)
        if why and left < self.config.min_live_memory_workers:
            what = "; ".join(f"memory worker {i}'s replacement {w}" for i, w in why.items())
            raise (WorkerTimeout if timed_out else WorkerFailure)(
                f"{what}; without it {left} memory workers would stay, fewer than "
                f"min_live_memory_workers={self.config.min_live_memory_workers}")
        return why

    def _late(self, pings: dict) -> dict[int, str]:
        """Wait for the replacement memory workers' pings {index: ping}: one whose
        bundle has had no live node for `placement_timeout_s` (its node gone and no
        room on another; Ray places a lost node's bundles again once it declares the
        node dead) is given up then, any other after a start's whole bound -> {index:
        why} of those given up."""
        whole, bare = START_TIMEOUT_S + self.config.placement_timeout_s, \
            self.config.placement_timeout_s
        t0 = time.monotonic()
        pending, late, homeless = dict(pings), {}, {}  # homeless: index -> since when
        while pending:
            ready = ray.wait(list(pending.values()), num_returns=len(pending),
                             timeout=PLACE_POLL_S)[0]
            pending = {i: r for i, r in pending.items() if r not in ready}
            now = time.monotonic()
            if pending and now - t0 >= whole:
                return {**late, **{i: f"did not start within {whole:g} s (see `ray status`)"
                                   for i in pending}}
            live = dict(zip(pending, self._on_live_nodes([self._homes[i] for i in pending])))
            for i in list(pending):
                if live[i]:
                    homeless.pop(i, None)
                elif now - homeless.setdefault(i, now) >= bare:
                    late[i] = _homeless(bare)
                    del pending[i]
        return late

    @staticmethod
    def _on_live_nodes(homes: list[Placement]) -> list[bool]:
        """Whether each memory worker's group (`_homes`) is on a node Ray holds alive."""
        return [bool(h.node_resources()[0]) for h in homes]

    def _drop_lost(self, why: dict[int, str], keep: list[int], replaced: set[int]) -> None:
        """The memory workers `why` names leave the deployment (their replacements
        stopped, their groups freed), the others (`keep`) numbered 0.. in order;
        `replaced` renumbered."""
        for i, w in sorted(why.items()):
            log.warning("memory worker %d's replacement %s: the deployment goes on without "
                        "it, with %d memory workers", i, w, len(keep))
            ray.kill(self.memory[i])
            self._homes[i].remove()
        for lst in (self.memory, self.memory_info, self._homes, self._numbering):
            lst[:] = [lst[i] for i in keep]
        now = {i: j for j, i in enumerate(keep)}
        kept = {now[i] for i in replaced if i in now}
        replaced.clear()
        replaced.update(kept)
        self._counted()

    def memory_lost(self) -> tuple[int, ...]:
        return self._lost

    def memory_workers_room(self, size: int) -> int:
        """`memory_workers_that_fit` in the cluster's total resources now: a lost
        node's are no longer counted, a joined node's are."""
        return memory_workers_that_fit(replace(self.config, num_memory_workers=size),
                                       ray.cluster_resources())[0]

    def workers_replaced(self) -> dict[str, int]:
        return dict(self._replaced)

    def kv_kept(self) -> frozenset[int]:
        return self._kv_kept

    def start_memory_workers(self, first: int, k: int) -> StartedMemory:
        """Workers first..first+k-1, each in a placement group of its own (one bundle,
        as the others'; bounded by `placement_timeout_s`); pinged and set up as the
        others (the same pool layout, tiers, KV policy). Touches nothing the steps use:
        runs beside them."""
        self._check_open()
        got = _Started([], [], [], [])
        try:
            for i in range(first, first + k):
                name = f"{self.placement_name}-m{i}-{uuid.uuid4().hex[:4]}"  # (unique)
                got.homes.append(place({}, self._m_opts, 1, self.config.placement_timeout_s,
                                       name, num_compute=0))
                home, threads = self._memory_home(got.homes[-1])
                got.workers.append(MemoryWorker.options(**self._m_opts, **home).remote(
                    i, threads))
            self._get([w.ping.remote() for w in got.workers], "the new memory workers",
                      start=True)
            got.info.extend(self._get([w.setup.remote(*self._setup_args, len(self.computes))
                                       for w in got.workers], "the new memory workers",
                                      start=True))
            got.nodes.extend(self._get([w.__ray_call__.remote(
                lambda s: ray.get_runtime_context().get_node_id()) for w in got.workers],
                "the new memory workers"))
        except BaseException:
            self._drop_started(got)
            raise
        return StartedMemory(first, k, got)

    def add_memory_workers(self, started: StartedMemory) -> None:
        """The started workers wired to every compute worker while the others stay
        connected (`ComputeWorker.connect(..., first)`), between steps."""
        got, first = started.workers, started.first
        if first != len(self.memory):
            self._drop_started(got)
            raise ValueError(f"memory workers started as {first}.., but there are "
                             f"{len(self.memory)}")
        self.memory += got.workers
        self._calls_s = self.ping_timeout_s  # the workers are up: a hung one fails this soon
        try:
            seen = [0] * len(self.memory)  # per memory worker, its RDMA connections so far
            wired = [self._wire(r, got.nodes, seen, first) for r in range(len(self.computes))]
        except BaseException:
            try:
                self._get([c.keep_memory.remote(first) for c in self.computes],
                          "the compute workers")
            except Exception as e:  # noqa: BLE001 - the add's own error is the one raised
                log.warning("could not unwire the memory workers not added: %s: %s",
                            type(e).__name__, e)
            del self.memory[first:]
            self._drop_started(got)
            raise
        finally:
            self._calls_s = None
        self._homes += got.homes
        self.memory_info += got.info
        self.nodes["memory"] += got.nodes
        self.addresses += wired[0][1]
        self.transports += wired[0][2]
        self.transport_choices += wired[0][3]
        self._counted()
        log.info("memory workers %d..%d added (nodes %s)", first, len(self.memory) - 1,
                 ", ".join(n[:8] for n in got.nodes))

    def discard_memory_workers(self, started: StartedMemory) -> None:
        self._drop_started(started.workers)

    def _drop_started(self, got: _Started) -> None:
        for w in got.workers:
            ray.kill(w)
        for home in got.homes:
            home.remove()

    def move_tiers(self, moves: tuple[TierMove, ...]) -> frozenset[int]:
        """Each source worker exports its entries (one Ray object per source and dest),
        which the dest worker takes straight from the object store: the KV does not
        pass through this process."""
        by: dict[tuple[int, int], list[int]] = {}
        for m in moves:
            by.setdefault((m.source, m.dest), []).append(m.entry)
        refs = [self.memory[d].adopt_tiers.remote(self.memory[s].export_tiers.remote(ids))
                for (s, d), ids in by.items()]
        done = self._get(refs, "the memory workers' tier moves", start=True)
        return frozenset(e for ids in done for e in ids)

    def move_kv(self, moves: tuple[SlotMove, ...]) -> None:
        """One read per source and dest worker of all their slots (a Ray object), which
        the dest worker writes into its pool straight from the object store. Bounded by
        `worker_timeout_s` (60 s if None): a dest that answers later refuses to write
        (the engine has given those slots to others by then: `put_slots`' deadline),
        and is marked silent (a recovery replaces it rather than wait on it again)."""
        by: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for m in moves:
            src, dst = by.setdefault((m.source, m.dest), ([], []))
            src.extend(m.src_slots)
            dst.extend(m.dst_slots)
        wait = self.config.worker_timeout_s or 60.0
        deadline = time.time() + wait  # (wall clocks: the dest may be on another node)
        reads = [self.memory[s].read_slots.remote(src) for (s, _), (src, _) in by.items()]
        puts = [self.memory[d].put_slots.remote(r, dst, deadline)
                for r, ((_, d), (_, dst)) in zip(reads, by.items())]
        ready = set(ray.wait(puts, num_returns=len(puts), timeout=wait + MOVE_MARGIN_S)[0])
        late = [k for k, r in enumerate(puts) if r not in ready]
        if late:
            read = set(ray.wait([reads[k] for k in late], num_returns=len(late), timeout=0)[0])
            pairs = list(by)
            dests = sorted({pairs[k][1] for k in late if reads[k] in read})
            self._silent |= frozenset(dests)  # (a silent source leaves: its move never runs)
            raise WorkerTimeout(f"moving KV between memory workers (source, dest) "
                                f"{[pairs[k] for k in late]} took over {wait:g} s; silent "
                                f"dests: {dests}")
        if not all(ray.get(puts)):  # (each came past its deadline: not written)
            raise WorkerTimeout("a memory worker took the KV moved to it past its deadline")

    def remove_memory_workers(self, n: int) -> None:
        """Memory workers n.. leave: every compute worker hangs up on them, their tier
        files go, their processes are stopped and their placement groups removed (the
        room given back to the cluster)."""
        self._check_open()
        self._calls_s = self.ping_timeout_s
        try:
            self._get([c.keep_memory.remote(n) for c in self.computes], "the compute workers")
        except (ray.exceptions.RayActorError, WorkerTimeout) as e:
            # a compute worker gone or stuck: the next step's recovery replaces it and
            # wires it to the memory workers that stay; these go all the same
            log.warning("a compute worker did not hang up on memory workers %d..: %s: %s",
                        n, type(e).__name__, _last_line(str(e)))
        finally:
            self._calls_s = None
        self._drop_memory(n, self.memory[n:])
        for lst in (self.memory, self.memory_info, self.nodes["memory"], self.addresses,
                    self.transports, self.transport_choices):
            del lst[n:]
        self._silent = frozenset(i for i in self._silent if i < n)
        self._counted()

    def _drop_memory(self, first: int, workers: list) -> None:
        """Stop `workers` (memory workers `first`..) and free their own groups."""
        if self.config.tiers.enabled and workers:  # their files go with them
            ray.wait([w.close_tiers.remote() for w in workers], num_returns=len(workers),
                     timeout=HEALTH_TIMEOUT_S)
        for w in workers:
            ray.kill(w)
        for home in self._homes[first:]:
            home.remove()
        del self._homes[first:]

    def _counted(self) -> None:
        """The memory worker count, where a replaced compute worker reads it."""
        m = len(self.memory)
        self.config = replace(self.config, num_memory_workers=m)
        self._compute_spec = replace(self._compute_spec, num_memory_workers=m)

    def _reset_all(self, role: str, wait: float,
                   silent: frozenset[int] = frozenset()) -> frozenset[int]:
        """Ask every worker of `role` ("compute", "memory") but the `silent` ones (no
        health answer after the failed step) to `reset`, all at once, each with half of
        `wait` for its own part; -> the indices of those that did not and the silent ones
        (dead, hung, or still inside the failed step; logged and counted: the caller
        replaces them)."""
        workers = self.computes if role == "compute" else self.memory
        refs = {i: w.reset.remote(wait / 2) for i, w in enumerate(workers) if i not in silent}
        ready = ray.wait(list(refs.values()), num_returns=len(refs),
                         timeout=wait)[0] if refs else []
        lost = set()
        for i in range(len(workers)):
            ref = refs.get(i)
            why = ("no health answer after the failed step" if ref is None else
                   _not_reset(ref) if ref in ready else f"no answer within {wait:g} s")
            if why is not None:
                log.warning("%s worker %d not reusable (%s); starting a new one", role, i,
                            why)
                lost.add(i)
        self._replaced[role] += len(lost)
        log.info("recovery: %s workers %s reset and kept, %s replaced", role,
                 sorted(set(range(len(workers))) - lost), sorted(lost))
        return frozenset(lost)

    def execute(self, plan: StepPlan) -> StepResult:
        """A failed step raises `SequenceFault` when the compute worker or a memory worker
        blamed particular sequences (clean: the compute worker refused them before any
        frame went out, or after every output came back), else `WorkerFailure` naming
        what each worker reported. `TierMiss` (clean) when a memory worker cannot serve a
        tier load: asked before the step is sent."""
        self._check_open()
        self._check_tier_loads(plan)
        if plan.tier_orders:
            plan = self._tiers_first(plan, self._orders_ahead(plan))
        try:
            if self.ring:
                return self._ring_step(plan)
            if self.replica_split is None:
                return self._call(0, plan)
            return self.replica_split.run(plan, self._call)
        except SequenceFault:
            raise  # a compute worker refused them; nothing else broke
        except Exception as e:  # name the failing worker if one reported
            errors, bad = self._health_errors()
            what = (f"step {plan.step} failed: {type(e).__name__}: {e}"
                    + ("; " + "; ".join(errors) if errors else ""))
            if bad:  # a memory worker refused these sequences and closed its channel
                raise SequenceFault(bad, what, clean=False) from e
            raise WorkerFailure(what) from e

    def _ring_step(self, plan: StepPlan) -> StepResult:
        """The whole plan to every replica of the ring at once; -> their results merged.
        The first replica to fail otherwise than cleanly interrupts the others (they
        would wait on it until their timeouts). Dropped keys are not asked for: the
        memory workers could not tell when the last layer of every micro-batch is done
        (their slots come back when the sequence ends)."""
        if plan.report_dropped:
            if not self._told_dropped:
                log.info("rotational over compute workers: h2o / snapkv dropped keys are "
                         "not reported; their slots come back when each sequence ends")
                self._told_dropped = True
            plan = replace(plan, report_dropped=False)
        assert self._ring_pool is not None
        futures = {self._ring_pool.submit(self._call, r, plan): r
                   for r in range(len(self.computes))}
        pending, interrupted = set(futures), False
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            if not interrupted and any(is_hard(f.exception()) for f in done):
                for c in self.computes:
                    c.interrupt.remote()
                interrupted = True
        errors = {futures[f]: f.exception() for f in futures if f.exception() is not None}
        if not errors:
            return merged(plan, [f.result() for f in sorted(futures, key=lambda f: futures[f])])
        first = next((e for _, e in sorted(errors.items()) if is_hard(e)), None)
        if first is not None:  # every replica's error: the others' often echo the first
            raise WorkerFailure("; ".join(
                str(e) if str(e).startswith("compute worker") else
                f"compute worker {r}: {type(e).__name__}: {e}"
                for r, e in sorted(errors.items()))) from first
        raise replica_faults(errors)

    def _call(self, r: int, plan: StepPlan) -> StepResult:
        """Compute worker `r`'s step; a broken stream closes its control channel."""
        control = self.controls[r]
        who = "the compute worker" if len(self.computes) == 1 else f"compute worker {r}"
        if control is None:
            raise RuntimeError(f"no control channel to {who} (closed after an earlier "
                               "failure)")
        try:
            return control.call(plan)
        except (SequenceFault, StepError):
            raise
        except Exception as e:  # the stream may be mid-message: drop it
            self._close_control(r)
            if len(self.computes) == 1:
                raise
            raise WorkerFailure(f"{who}: {type(e).__name__}: {e}") from e

    def _check_tier_loads(self, plan: StepPlan) -> None:
        loads = [o for o in plan.tier_orders if o.op == "load"]
        if not loads:
            return
        by = sorted({o.worker for o in loads})
        refs = [self.memory[w].tier_missing.remote([o for o in loads if o.worker == w])
                for w in by]
        missed = {s for r in self._before_step(refs, by, plan.step, "tier check") for s in r}
        if missed:
            raise TierMiss(sorted(missed), {o.entry for o in loads if o.seq_id in missed},
                           f"memory workers {by}: no valid saved KV for sequences "
                           f"{sorted(missed)}")

    def _orders_ahead(self, plan: StepPlan) -> list[int]:
        """The memory workers whose tier orders go by call before the step rather than in
        its frames: under compute replicas every one (each replica sends its own step
        head, and in a ring every replica sends the whole plan's); else those with no
        rows this step. A worker's frames with no rows get no answer, so the step could
        return before that worker carried out a save which the next call reads (a
        scale-down's move, the next step's tier check): it would find nothing."""
        by = {o.worker for o in plan.tier_orders}
        if len(self.computes) == 1:
            by -= {w for s in plan.seqs for w, _ in s.placement}
        return sorted(by)

    def _tiers_first(self, plan: StepPlan, by: list[int]) -> StepPlan:
        """Memory workers `by`'s tier orders carried out before the step is sent (answered
        calls); -> the plan without them. The loads were checked, so any error is a
        worker's failure."""
        if not by:
            return plan
        self._before_step([self.memory[w].apply_tiers.remote(
            [o for o in plan.tier_orders if o.worker == w]) for w in by], by, plan.step,
            "tier orders")
        return replace(plan, tier_orders=tuple(o for o in plan.tier_orders
                                               if o.worker not in by))

    def _before_step(self, refs: list, by: list[int], step: int, what: str) -> list:
        """Memory workers `by`'s answers to calls made before step `step` is sent (the
        tier check, the tier orders): -> their results. Bounded by `worker_timeout_s`
        beyond the wait a load may take for its disk read: one that is dead, raises, or
        stays silent fails the step (`WorkerFailure` naming it; a silent one is
        replaced by the recovery without a second wait on it)."""
        wait = self.config.worker_timeout_s
        wait = None if wait is None else wait + PREFETCH_WAIT_S
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=wait)[0])
        silent = [w for w, r in zip(by, refs) if r not in ready]
        if silent:
            self._silent |= frozenset(silent)
            raise WorkerFailure(f"step {step}: memory workers {silent} gave no answer to "
                                f"the {what} within {wait:g} s")
        try:
            return ray.get(refs)
        except Exception as e:  # any of them: the step fails, is recovered
            raise WorkerFailure(f"step {step}: the {what} of memory workers {by}: "
                                f"{type(e).__name__}: {_last_line(str(e))}") from e

    def tier_bytes_per_token(self) -> int | None:
        """KV bytes a token takes in the tiers; None without tiers."""
        return self.pool_config.bytes_per_slot if self.config.tiers.enabled else None

    def tier_rotary(self) -> bool:
        return self._rotary

    def tier_traffic(self) -> dict:
        """The memory workers' tier traffic and misses, summed (asked at most once a
        second: the metrics ask every step)."""
        now = time.monotonic()
        if now - getattr(self, "_traffic_at", -1e9) >= 1.0:
            self._traffic = sum_stats(self._get([w.tier_stats.remote() for w in self.memory],
                                                "the memory workers"))
            self._traffic_at = now
        return self._traffic

    def check_workers(self) -> list[str]:
        """Every worker pinged at once, one bounded wait (`health_timeout_s`): those dead
        or silent, in words; the silent ones `recover` replaces without asking again."""
        workers = [("compute", r, c) for r, c in enumerate(self.computes)] + \
                  [("memory", i, m) for i, m in enumerate(self.memory)]
        refs = [w.ping.remote() for _, _, w in workers]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=self.health_timeout_s)[0])
        found, silent = [], {"compute": set(), "memory": set()}
        for (role, i, _), ref in zip(workers, refs):
            if ref not in ready:
                found.append(f"{role} worker {i}: no answer within {self.health_timeout_s:g} s")
                silent[role].add(i)
                continue
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a dead actor's error, reported
                found.append(f"{role} worker {i}: {type(e).__name__}")
        self._silent = frozenset(silent["memory"])
        self._silent_computes = frozenset(silent["compute"])
        return found

    def _health_errors(self) -> tuple[list[str], list[int]]:
        """After a failed step: what each memory worker reports (asked all at once, one
        bounded wait) -> (error texts, the sequences they blamed). Those that did not
        answer are remembered: `recover` replaces them without asking again."""
        errors, bad, silent = [], [], set()
        refs = [w.health.remote() for w in self.memory]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.health_timeout_s)
        for i, r in enumerate(refs):
            if r not in ready:
                errors.append(f"memory worker {i} unreachable: no health answer in "
                              f"{self.health_timeout_s:g} s")
                silent.add(i)
                continue
            try:
                h = ray.get(r)
            except Exception as he:  # noqa: BLE001
                errors.append(f"memory worker {i} unreachable: {type(he).__name__}")
                continue
            if h["error"]:
                errors.append(h["error"])
            bad += h.get("bad_seqs", [])
        self._silent = frozenset(silent)
        return errors, bad

    def probe(self, tokens, repeat: int = 20) -> dict:
        ex = ray.get(self.compute.probe_exchange.remote(list(tokens), repeat))  # exchange, submit
        call = {}
        for n in tokens:  # a step call carrying n sampled tokens back
            ray.get(self.compute.tokens.remote(n))
            ts = []
            for _ in range(repeat):
                t = time.perf_counter()
                ray.get(self.compute.tokens.remote(n))
                ts.append(time.perf_counter() - t)
            call[n] = statistics.median(ts)
        return {**ex, "call_s": call}

    def start_trace(self) -> None:
        """Every worker records its timeline (`lamina.trace`) from the next step on. The
        lanes line up: the workers of one host share CLOCK_MONOTONIC (workers on other
        hosts do not; their lanes are shifted by the hosts' clock offset)."""
        self._get([a.start_trace.remote() for a in [*self.computes, *self.memory]],
                  "trace start")

    def stop_trace(self) -> list:
        return [s for spans in self._get([a.stop_trace.remote()
                                          for a in [*self.computes, *self.memory]],
                                         "trace stop") for s in spans]

    def _check_open(self) -> None:
        if getattr(self, "_shut", False):
            raise EngineDead("the Ray executor was shut down (LLM.shutdown()): its workers "
                             "and placement group are gone")

    def shutdown(self) -> None:
        """Kill the workers and free their placement; a second call does nothing. Steps
        and recoveries then raise `EngineDead`."""
        if getattr(self, "_shut", False):
            return
        self._shut = True
        self._close_control()
        if self.config.tiers.enabled and self.memory:  # their files go with them
            ray.wait([w.close_tiers.remote() for w in self.memory],
                     num_returns=len(self.memory), timeout=HEALTH_TIMEOUT_S)
        for a in [*self.computes, *self.memory]:
            ray.kill(a)
        if self.replica_split is not None:
            self.replica_split.shutdown()
        if self._ring_pool is not None:
            self._ring_pool.shutdown(wait=False)
        for home in self._homes:
            home.remove()
        self.placement.remove()


@dataclass
class _Started:
    """Memory workers started, not yet added (`StartedMemory.workers`)."""
    workers: list  # actor handles
    homes: list[Placement]  # each one's group (`RayExecutor._homes`)
    info: list[dict]  # what each one's setup answered
    nodes: list[str]  # the node each one runs on


def _homeless(seconds: float) -> str:
    """Why a memory worker's replacement is given up: no node held its bundle."""
    return (f"had no live node for its bundle for {seconds:g} s (its node gone, no room on "
            "another: see `ray status`)")


def _last_line(text: str) -> str:
    """The last non-blank line of `text`, without terminal colour codes."""
    lines = [x.strip() for x in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()]
    return next((x for x in reversed(lines) if x), text)


def _not_reset(ref) -> str | None:
    """Why a worker's answered `reset` call did not reset it (None: it did)."""
    try:
        return None if ray.get(ref) else "still inside the failed step"
    except Exception as e:  # noqa: BLE001 - it died: the caller starts another
        return f"{type(e).__name__}: {e}"


def transport(address: tuple) -> str:
    """How the compute worker reaches a memory worker at `address` (`MemoryWorker.listen`)."""
    if address[0] == "rdma":
        return f"rdma qp {address[1]['qp_num']}"
    if isinstance(address[-1], Rendezvous):  # tensors over a collective path
        return f"{transport(address[:-1])} + {address[-1].backend}"
    if address[0] == "unix":
        return "unix socket + shared memory" if len(address) == 5 else "unix socket"
    return f"tcp {address[1]}:{address[2]}"
