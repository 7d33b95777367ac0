"""Placement: the deployment's workers' resources, reserved before any worker starts.

Data in: the engine's config and the cluster's resources, from which `worker_options`
makes the compute workers' and the memory workers' actor options (CPU, GPU, the
`lamina_compute` / `lamina_memory` custom resources their nodes advertise), refused by
name where the cluster can never hold them all; and the number of each. Data out: a
`Placement` of the compute workers (bundle r: compute worker r, a model replica) and one
`Placement` per memory worker (a group of one bundle); once placed, the torch threads
each worker takes on its node (`node_threads`, `bundle_threads`).

Ray chooses the nodes in one group of every bundle (`place`), strategy SPREAD: the
bundles go to distinct nodes where they can (the memory workers over the memory nodes)
and are packed where they cannot (several memory workers on one node, or everything on
a one-node local cluster); the custom resources keep each kind on its own node type. A
group Ray cannot place within the timeout (its resources held by other deployments, or
split over nodes so that none holds a bundle) is removed again and `PlacementTimeout`
names what was missing: never an endless wait. `pin` then reserves the same bundles
again, each memory worker's in a group of its own, pinned to the node Ray chose.

Why a group per memory worker: Ray cannot take one bundle out of a group, and a group
with a bundle whose node is gone keeps Ray's GCS placing that bundle again with no pause
between its tries while no node has room (its single thread busy, and the head's
metrics agent recording each try: both cores of a 2-core head, measured in
`docs/cluster.md`; ray-project/ray PR 65007 adds the missing backoff, not merged). A
memory worker dropped for good (`RayExecutor.recover`) or removed (`remove_memory_workers`)
takes its group with it, and a replacement whose node is gone gets a new group, whose
wait Ray backs off. Workers replaced after a failure on a live node start in their group.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

log = logging.getLogger(__name__)
REMOVE_TIMEOUT_S = 5.0  # how long `Placement.remove` waits for Ray to confirm
NODE_LABEL = "ray.io/node-id"  # the label Ray gives every node: its id


class PlacementTimeout(TimeoutError):
    """The cluster did not give the deployment's resources within the timeout."""


def bundle(opts: dict) -> dict[str, float]:
    """The resources an actor started with `opts` (`num_cpus`, `num_gpus`, `resources`)."""
    res = {"CPU": opts.get("num_cpus", 0), "GPU": opts.get("num_gpus", 0),
           **opts.get("resources", {})}
    return {k: float(v) for k, v in res.items() if v}


@dataclass(frozen=True)
class Placement:
    group: PlacementGroup
    # per bundle its resources: the compute workers', then the memory workers' (the
    # group `place` chooses the nodes with: all; after `pin`, a group holds either)
    bundles: tuple
    computes: int = 1  # compute workers (model replicas)

    def compute(self, r: int = 0) -> dict:
        """Actor options starting compute worker `r` in its bundle."""
        return self._in(r)

    def memory(self, i: int) -> dict:
        """Actor options starting memory worker `i` in its bundle."""
        return self._in(self.computes + i)

    def _in(self, index: int) -> dict:
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=index)}

    def node_ids(self) -> list[str | None]:
        """Per bundle, the id of the node Ray placed it on."""
        where = ray.util.placement_group_table(self.group)["bundles_to_node_id"]
        return [where.get(b) for b in range(len(self.bundles))]

    def node_resources(self) -> list[dict]:
        """Per bundle, the total resources of the node Ray placed it on ({} for a node
        no longer alive)."""
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        return [nodes.get(node, {}) for node in self.node_ids()]

    def remove(self, timeout_s: float = REMOVE_TIMEOUT_S) -> bool:
        """Free the group's resources -> whether Ray confirmed it within `timeout_s`.
        Why the bound: Ray's call waits for its GCS without one. When the local Ray
        instance went down together with this process (a SIGTERM to the whole process
        group, as systemd and `timeout` send), a server's shutdown waited there until
        Ray's core worker gave up on the GCS after 60 s and ended the process, exit 1."""
        error: list[BaseException] = []

        def call():
            try:
                remove_placement_group(self.group)
            except BaseException as e:  # noqa: BLE001 - raised in the caller below
                error.append(e)

        worker = threading.Thread(target=call, name="lamina-placement-remove", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if error:
            raise error[0]
        if worker.is_alive():
            log.warning("Ray did not confirm removing placement group %s within %g s (its "
                        "GCS gone with this process?); not waiting for it",
                        self.group.id.hex(), timeout_s)
            return False
        return True


def node_threads(resources: dict, role: str) -> int | None:
    """The torch threads a Lamina worker of `role` ("compute" or "memory") takes on a node
    with these total resources: on a node that advertises slots for its role, the node's
    CPUs split evenly over every Lamina worker slot it advertises (`lamina_compute` plus
    `lamina_memory` units: a node set aside for Lamina's workers, as `ray_config.yaml`'s
    memory nodes hold two memory workers each); None elsewhere (a local cluster, whose
    cores the workers time-share: `compute_worker.step_threads`)."""
    if resources.get(f"lamina_{role}", 0) <= 0:
        return None
    slots = resources.get("lamina_compute", 0) + resources.get("lamina_memory", 0)
    return max(1, int(resources.get("CPU", 0) // slots))


def place(compute_opts: dict, memory_opts: dict, num_memory: int, timeout_s: float,
          name: str = "", num_compute: int = 1) -> Placement:
    """Reserve `num_compute` compute bundles and `num_memory` memory bundles; wait at most
    `timeout_s`."""
    bundles = (bundle(compute_opts),) * num_compute + (bundle(memory_opts),) * num_memory
    group = placement_group(list(bundles), strategy="SPREAD", name=name)
    if not group.wait(timeout_s):
        free = ray.available_resources()
        remove_placement_group(group)
        raise PlacementTimeout(shortfall(bundles, free, num_memory, timeout_s, num_compute))
    log.info("placement group %s: %d bundles %s", group.id.hex()[:12], len(bundles),
             bundles)
    return Placement(group, bundles, num_compute)


def pin(chosen: Placement, name: str, timeout_s: float) -> tuple[Placement, list[Placement]]:
    """The bundles of `chosen` (placed by `place`, at least one compute worker's) reserved
    again on the nodes Ray chose for them -> (the compute workers' group, a group per
    memory worker). `chosen` is removed first (its resources are what the new groups
    take); the new groups are placed within `timeout_s` or all removed again
    (`PlacementTimeout`: the room taken by another deployment in between)."""
    nodes, c = chosen.node_ids(), chosen.computes
    chosen.remove()
    on = [{NODE_LABEL: n} for n in nodes]
    groups = [placement_group(list(chosen.bundles[:c]), strategy="SPREAD", name=name,
                              bundle_label_selector=on[:c])]
    groups += [placement_group([b], name=f"{name}-m{i}", bundle_label_selector=[n])
               for i, (b, n) in enumerate(zip(chosen.bundles[c:], on[c:]))]
    ready = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
    if len(ready[0]) < len(groups):
        for g in groups:
            remove_placement_group(g)
        raise PlacementTimeout(f"the nodes Ray chose for the deployment's workers had no "
                               f"room for them again within {timeout_s:g} s (another "
                               "deployment took it in between: see `ray status`)")
    log.info("placement groups %s: %d bundles pinned to their nodes", ", ".join(
        g.id.hex()[:12] for g in groups), len(chosen.bundles))
    return (Placement(groups[0], chosen.bundles[:c], c),
            [Placement(g, (b,), 0) for g, b in zip(groups[1:], chosen.bundles[c:])])


def reserve(memory_opts: dict, name: str) -> Placement:
    """A group of one memory bundle, not waited for (`Placement.group.ready()`)."""
    return Placement(placement_group([bundle(memory_opts)], name=name),
                     (bundle(memory_opts),), 0)


def shortfall(bundles: tuple, free: dict, num_memory: int, timeout_s: float,
              num_compute: int = 1) -> str:
    """The message of a placement that timed out: each resource the bundles need more of
    than the cluster has free now."""
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    short = [f"{k}: needs {v:g}, {free.get(k, 0):g} free" for k, v in need.items()
             if free.get(k, 0) + 1e-9 < v]
    what = (", ".join(short) if short else
            "enough is free in total, but no node has room for one bundle "
            f"({', '.join(str(b) for b in bundles)})")
    computes = (f"{num_compute} compute worker{'s' * (num_compute > 1)} and "
                if num_compute else "")
    return (f"could not place {computes}{num_memory} memory worker{'s' * (num_memory > 1)} "
            "within "
            f"{timeout_s:g} s: {what}; other deployments may hold them (see `ray status`; "
            "raise placement_timeout_s to wait longer)")


def check_fits(have: dict, asks: dict[str, tuple[dict, int]], free: bool = False) -> None:
    """Refuse, before any actor starts, workers the cluster's total resources can never
    hold (Ray would wait for them forever). `asks`: {what: (actor options, count)}.
    `free`: `have` is what is free now (`ray.available_resources()`), not the total."""
    need: dict[str, float] = {}
    for opts, n in asks.values():
        for key, v in {"CPU": opts.get("num_cpus", 0), "GPU": opts.get("num_gpus", 0),
                       **opts.get("resources", {})}.items():
            need[key] = need.get(key, 0.0) + v * n
    has = "{:g} free" if free else "the cluster has {:g}"
    short = [f"{k}: needs {v:g}, " + has.format(have.get(k, 0))
             for k, v in need.items() if v and have.get(k, 0) + 1e-9 < v]
    if short:
        counts = ", ".join(f"{n} {what}" for what, (_, n) in asks.items())
        raise ValueError(f"the Ray cluster {'has no room now for' if free else 'cannot hold'} "
                         f"{counts}: " + "; ".join(short) + (
                             " (its free resources; see `ray status`)" if free else
                             " (its total resources; see `ray status`)"))


def worker_options(config, have: dict, free: bool = False) -> tuple[dict, dict]:
    """The Ray options of a compute worker and of a memory worker on a cluster with
    resources `have` (`free`: those free now, else its total); a clear error where the
    cluster cannot hold them all."""
    m, r_n = config.num_memory_workers, config.num_compute_workers
    c_opts, m_opts = _options(config, have)
    if config.kv_device.startswith("cuda") and have.get("GPU", 0) < m:
        raise ValueError(f"kv_device={config.kv_device!r} puts each of the {m} memory "
                         f"workers on a GPU of its own, but the Ray cluster has "
                         f"{int(have.get('GPU', 0))} GPU(s)")
    check_fits(have, {("compute worker" if r_n == 1 else "compute workers"): (c_opts, r_n),
                      "memory workers": (m_opts, m)}, free)
    return c_opts, m_opts


def memory_workers_that_fit(config, have: dict, free: bool = False) -> tuple[int, str | None]:
    """How many memory workers, at most `config.num_memory_workers`, the cluster's
    resources `have` (its total, or `free`: those free now) hold beside its compute
    workers -> (that count, why not all: `check_fits`' message for all of them; None
    when all fit). 0 when not even one fits (or the compute workers do not)."""
    why = None
    for m in range(config.num_memory_workers, 0, -1):
        try:
            worker_options(replace(config, num_memory_workers=m), have, free)
        except ValueError as e:
            why = why or str(e)
            continue
        return m, why
    return 0, why


def _options(config, have: dict) -> tuple[dict, dict]:
    """`worker_options`' two option dicts, unchecked."""
    r_n = config.num_compute_workers
    # Fractional CPUs so 1 compute + 2 memory workers fit a 2-core node (the compute
    # workers share what one would take); on a cluster whose nodes advertise
    # lamina_compute / lamina_memory (ray_config.yaml), use them.
    c_opts: dict = {"num_cpus": 0.5 / r_n}
    m_opts: dict = {"num_cpus": 0.5}
    if "lamina_compute" in have:
        c_opts["resources"] = {"lamina_compute": 1}
    if "lamina_memory" in have:
        m_opts["resources"] = {"lamina_memory": 1}
    # A GPU pool: each memory worker holds one GPU of its own (Ray sets its
    # CUDA_VISIBLE_DEVICES, so inside the worker it is "cuda").
    if config.kv_device.startswith("cuda"):
        m_opts["num_gpus"] = 1
    if config.compute_device.startswith("cuda"):  # the slices on a GPU of their own
        c_opts["num_gpus"] = 1
    return c_opts, m_opts


def bundle_threads(node: dict, role: str, threads: int = 1,
                   wide_threads: int | None = None) -> tuple[int, int]:
    """A `role` worker's torch threads on a node with total resources `node`: (for every
    step, for the compute worker's steps whose memory workers sit idle). On a node set
    aside for Lamina's workers of its role, its share of the node's CPUs
    (`node_threads`) for both; elsewhere `threads`, and for those steps every
    core of the node, which its memory workers then leave idle
    (`compute_worker.step_threads`)."""
    share = node_threads(node, role)
    if share is not None:
        return share, share
    return threads, wide_threads or max(threads, int(node.get("CPU", 1)))
