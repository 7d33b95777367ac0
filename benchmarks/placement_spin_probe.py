"""What a placement group with a lost bundle costs Ray's head: `python
benchmarks/placement_spin_probe.py [--seconds S]`.

A local Ray cluster (`ray.cluster_utils`: a head and two worker nodes, one with room for
one `lamina_memory` bundle that the other nodes cannot take) places a group whose bundle
lands on that node; the node is then removed, as when a memory node is lost and no
other has room. Measured: the CPU seconds per second of the GCS and the dashboard
agents over S seconds, in three cases:

- `kept`: the group stays (its bundle RESCHEDULING). Ray's GCS tries to place it again
  with no pause between tries while no node has room (ray-project/ray PR 65007), and
  its metrics agent records each try. This was Lamina's state after a recovery dropped
  a memory worker whose node was lost, for as long as the deployment lived.
- `removed`: the group removed right after the node's loss (Lamina now: a memory
  worker's group of its own goes with it, `lamina.cluster.placement`), then S more
  seconds.
- `pending`: instead, a fresh one-bundle group asked for where there is no room (a
  replacement's group, `RayExecutor._rehome`): Ray backs off between its tries.

Writes JSON and Markdown (benchmarks/results/placement_spin_probe.*).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import psutil
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group

OUT = Path(__file__).with_name("results")
# the GCS; every node's dashboard agent (named so by its process title)
WATCH = {"gcs_server": ("gcs_server",), "dashboard agents": ("DashboardAgent",
                                                             "dashboard/agent.py")}


def ray_processes() -> dict[str, list[psutil.Process]]:
    """The cluster's GCS and its nodes' dashboard agents."""
    found: dict[str, list[psutil.Process]] = {k: [] for k in WATCH}
    for p in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        for name, marks in WATCH.items():
            if any(m in line for m in marks):
                found[name].append(p)
    return found


def cpu_per_s(procs: dict[str, list[psutil.Process]], seconds: float) -> dict[str, float]:
    """Each kind's CPU seconds per wall second over `seconds` (a process gone meanwhile,
    the removed node's, counts 0)."""
    def total(p):
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            return 0.0
        return t.user + t.system

    before = {k: sum(total(p) for p in v) for k, v in procs.items()}
    time.sleep(seconds)
    return {k: round((sum(total(p) for p in v) - before[k]) / seconds, 2)
            for k, v in procs.items()}


def one_case(case: str, seconds: float) -> dict:
    """A fresh cluster; the node holding the group's bundle removed; the case's group
    handling; the GCS and the dashboard agents measured."""
    os.makedirs(ray._common.utils.get_default_ray_temp_dir(), exist_ok=True)
    tmp = [tempfile.mkdtemp(prefix="spin", dir="/tmp") for _ in range(3)]
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "temp_dir": tmp[0],
                                                      "include_dashboard": False})
    c.add_node(num_cpus=2, resources={"lamina_memory": 1}, temp_dir=tmp[1])
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        held = placement_group([{"lamina_memory": 1}])  # the first node's room, taken
        assert held.wait(30)
        extra = c.add_node(num_cpus=2, resources={"lamina_memory": 1}, temp_dir=tmp[2])
        c.wait_for_nodes()
        group = placement_group([{"lamina_memory": 1}])  # on the extra node: no other room
        assert group.wait(30)
        procs = ray_processes()
        idle = cpu_per_s(procs, 2.0)
        c.remove_node(extra)
        time.sleep(2.0)  # Ray marks the node dead
        procs = ray_processes()  # (the removed node's are gone)
        if case in ("removed", "pending"):
            remove_placement_group(group)
        if case == "pending":
            placement_group([{"lamina_memory": 1}])
        return {"case": case, "idle_before": idle, "after": cpu_per_s(procs, seconds)}
    finally:
        ray.shutdown()
        c.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rows = [one_case(case, args.seconds) for case in ("kept", "removed", "pending")]
    OUT.mkdir(exist_ok=True)
    (OUT / "placement_spin_probe.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| case | GCS CPU s/s | dashboard agents CPU s/s | before the loss (GCS, agents) |",
             "|---|---|---|---|"]
    for r in rows:
        a, b = r["after"], r["idle_before"]
        lines.append(f"| {r['case']} | {a['gcs_server']} | {a['dashboard agents']} | "
                     f"{b['gcs_server']}, {b['dashboard agents']} |")
    table = "\n".join(lines)
    (OUT / "placement_spin_probe.md").write_text(
        f"Over {args.seconds:g} s after a node holding a group's only bundle is lost\n\n"
        f"{table}\n")
    print(table)


if __name__ == "__main__":
    main()
