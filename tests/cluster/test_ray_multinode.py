"""The engine across nodes: a head with `lamina_compute` and two memory nodes with
`lamina_memory`, each raylet with its own temp dir. Where this host can make network
namespaces (root, iproute2), each memory node's raylet runs in a namespace of its own with
its own IP on a veth link (an emulated host), so the data plane really crosses TCP
between "hosts"; elsewhere the memory nodes are plain raylets on this host (said in the
skip of the link test). Each worker lands on a node of its kind (asserted from Ray's node
ids), the compute worker reaches the memory workers over TCP, greedy output equals HF's,
and a memory node whose link goes down mid-generation is detected within the data-plane
timeout and replaced, with HF-exact output; then collective paths (gloo) between the
emulated hosts. (One memory node holding both workers: tests/cluster/test_ray_service.py.)"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import ray

from lamina import LLM, SamplingParams
from lamina.bench.netns import Namespaces, make_namespaces, sh
from lamina.cluster.placement import Placement
from tests.conftest import SHORT_NEW

pytestmark = pytest.mark.multinode
GREEDY = SamplingParams(max_tokens=SHORT_NEW, temperature=0)
PICK = [0, 1, 3, 5, 7, 9, 12, 14]  # 8 prompts of 5-600 tokens
WORKER_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def cluster():
    """-> {"nets": Namespaces or None, "why": why not namespaces, "ids": {node IP: node
    id}, "host_ip", "llm": an LLM with 2 memory workers placed on the cluster}."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    host_ip = ray.util.get_node_ip_address()
    nets, why = None, "this host has no address but loopback for namespaces to reach"
    if not host_ip.startswith("127."):
        nets, why = make_namespaces(3)  # the third host joins later (its own test)
    dirs = [tempfile.mkdtemp(prefix="ln", dir="/tmp") for _ in range(4)]
    # cluster_utils writes the cluster's address into Ray's default temp folder without
    # making it: on a machine where no Ray has run yet, that folder does not exist
    os.makedirs(ray._common.utils.get_default_ray_temp_dir(), exist_ok=True)
    raylets: list[subprocess.Popen] = []
    cluster = llm = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {"lamina_compute": 1}, "temp_dir": dirs[0],
            "include_dashboard": False, "node_ip_address": host_ip,
            # an unreachable node is declared dead in seconds (its bundles placed again)
            "_system_config": {"health_check_period_ms": 1000,
                               "health_check_timeout_ms": 1000,
                               "health_check_failure_threshold": 3}})
        if nets is None:
            for d in dirs[1:3]:
                cluster.add_node(num_cpus=1, resources={"lamina_memory": 2}, temp_dir=d)
        else:
            raylets += [start_raylet(nets, n, cluster.address, dirs[n]) for n in (1, 2)]
        ray.init(address=cluster.address, log_to_driver=False)
        deadline = time.monotonic() + 90
        while sum(x["Alive"] for x in ray.nodes()) < 3:
            assert time.monotonic() < deadline, [r.poll() for r in raylets]
            time.sleep(0.5)
        ids = {x["NodeID"]: x["NodeManagerAddress"] for x in ray.nodes() if x["Alive"]}
        llm = LLM(executor="ray", num_memory_workers=2, num_kv_slots=4096,
                  max_step_tokens=1024, worker_timeout_s=WORKER_TIMEOUT_S,
                  regrow_interval_s=0)  # the count the tests set: no regrow beside them
        yield {"nets": nets, "why": why, "ids": ids, "llm": llm,
               "head": cluster.head_node.node_id, "raylets": raylets, "dirs": dirs,
               "address": cluster.address}
    finally:
        if llm is not None:
            llm.shutdown()
        ray.shutdown()
        for r in raylets:  # by process group: never a host-wide `ray stop`
            try:
                os.killpg(r.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            r.wait(30)
        if cluster is not None:
            cluster.shutdown()
        if nets is not None:
            nets.remove()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def start_raylet(nets: Namespaces, n: int, address: str, temp_dir: str,
                 memory: int = 2) -> subprocess.Popen:
    """A memory node's raylet in namespace n, at its IP, with room for `memory` workers."""
    ray_cli = str(Path(sys.executable).with_name("ray"))
    return subprocess.Popen(
        ["ip", "netns", "exec", nets.names[n - 1], ray_cli, "start", "--block",
         f"--address={address}", f"--node-ip-address={nets.ip(n)}", "--num-cpus=1",
         f'--resources={{"lamina_memory": {memory}}}', f"--temp-dir={temp_dir}",
         "--disable-usage-stats"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_workers_on_their_nodes_over_tcp_greedy_equals_hf(cluster, prompts, hf_greedy):
    llm, ids, nets = cluster["llm"], cluster["ids"], cluster["nets"]
    ex = llm.executor
    assert ex.nodes["compute"] == cluster["head"]
    memory_nodes = sorted(set(ids) - {cluster["head"]})
    assert sorted(ex.nodes["memory"]) == memory_nodes  # SPREAD: one on each
    assert all(t.startswith("tcp ") for t in ex.transports), ex.transports
    # chosen for a reason that names what RDMA lacks on these hosts
    assert all(c.kind == "tcp" and c.why.startswith("different nodes; not RDMA: ")
               for c in ex.transport_choices), ex.transport_choices
    if nets is not None:  # across the veth links, to each namespace's own IP
        hosts = sorted(t.split()[1].rpartition(":")[0] for t in ex.transports)
        assert hosts == [nets.ip(1), nets.ip(2)], ex.transports
    outs = llm.generate([prompts[i] for i in PICK], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy[i][:SHORT_NEW] for i in PICK]
    # a group for the compute worker and one for each memory worker, each on the node
    # the worker runs on
    for group, node in [(ex.placement.group, ex.nodes["computes"][0]),
                        *zip([h.group for h in ex._homes], ex.nodes["memory"])]:
        table = ray.util.placement_group_table(group)
        assert table["state"] == "CREATED" and table["bundles_to_node_id"] == {0: node}


def test_a_memory_node_whose_link_goes_down_is_replaced(cluster, prompts, hf_greedy):
    nets, ids, llm = cluster["nets"], cluster["ids"], cluster["llm"]
    if nets is None:
        pytest.skip(f"no emulated hosts: {cluster['why']}")
    ex = llm.executor
    lost = ex.nodes["memory"][1]  # cut the link of memory worker 1's node
    link = nets.links[[nets.ip(1), nets.ip(2)].index(ids[lost])]
    kept = next(i for i in ex.nodes["memory"] if i != lost)
    steps = len(llm.engine.step_timings)

    def cut_link():  # a few decode steps in
        while len(llm.engine.step_timings) < steps + 6:
            time.sleep(0.01)
        sh("ip", "link", "set", link, "down")
    cutter = threading.Thread(target=cut_link, daemon=True)
    cutter.start()
    outs = llm.generate([prompts[i] for i in PICK], GREEDY, use_tqdm=False)
    cutter.join(5)
    assert [o.token_ids for o in outs] == [hf_greedy[i][:SHORT_NEW] for i in PICK]
    eng = llm.engine
    assert eng.num_recoveries == 1, eng.recoveries
    assert "memory worker 1" in eng.recoveries[0] and "PeerTimeout" in eng.recoveries[0]
    assert f"within {WORKER_TIMEOUT_S:g} s" in eng.recoveries[0]
    # both workers now on the node whose link is up, still over TCP to its IP
    assert ex.nodes["memory"] == [kept, kept]
    assert all(t.startswith(f"tcp {ids[kept]}:") for t in ex.transports), ex.transports


def test_a_memory_node_lost_with_no_room_left_is_dropped_and_the_engine_goes_on(
        cluster, prompts, hf_greedy, monkeypatch, caplog, request):
    """The memory nodes' room left is taken (a placeholder placement group; after the
    link test, the second node is full anyway). A third memory node joins with room for
    one worker and the pools grow onto it (a placement group of its own); mid-generation
    its link goes down. Nowhere has room for its replacement: once its bundle has had no
    live node for `placement_timeout_s` the recovery drops that worker (its group
    removed) and the engine goes on with the other two, HF-exact."""
    nets, llm = cluster["nets"], cluster["llm"]
    if nets is None:
        pytest.skip(f"no emulated hosts: {cluster['why']}")
    ex, eng = llm.executor, llm.engine
    room = int(ray.available_resources().get("lamina_memory", 0))
    if room:
        held = ray.util.placement_group([{"lamina_memory": 1}] * room)
        assert held.wait(30)
        request.addfinalizer(lambda: ray.util.remove_placement_group(held))
    alive = sum(x["Alive"] for x in ray.nodes())
    cluster["raylets"].append(start_raylet(nets, 3, cluster["address"], cluster["dirs"][3],
                                           memory=1))
    deadline = time.monotonic() + 90
    while sum(x["Alive"] for x in ray.nodes()) < alive + 1:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert llm.scale_memory_workers(3).after == 3
    third = {x["NodeManagerAddress"]: x["NodeID"] for x in ray.nodes() if x["Alive"]}[
        nets.ip(3)]
    assert ex.nodes["memory"][2] == third and isinstance(ex._homes[2], Placement)
    group = ex._homes[2].group.id.hex()
    # a replacement's bundle with no live node is given up after placement_timeout_s
    # (30 s by default; 2 s here), not a start's whole bound (120 s more); the failed
    # step's health wait 3 s (10)
    ex.config = replace(ex.config, placement_timeout_s=2.0)  # (the module's last llm)
    monkeypatch.setattr(ex, "health_timeout_s", 3.0)
    steps = len(eng.step_timings)

    def cut_link():  # a few decode steps in
        while len(eng.step_timings) < steps + 6:
            time.sleep(0.01)
        sh("ip", "link", "set", nets.links[2], "down")
    cutter = threading.Thread(target=cut_link, daemon=True)
    cutter.start()
    with caplog.at_level(logging.WARNING):
        outs = llm.generate([prompts[i] for i in PICK], GREEDY, use_tqdm=False)
    cutter.join(5)
    assert [o.token_ids for o in outs] == [hf_greedy[i][:SHORT_NEW] for i in PICK]
    assert ex.memory_lost() == (2,) and len(ex.memory) == len(ex._homes) == 2
    assert eng.memory_workers_lost == 1 and len(eng.allocs) == 2
    assert ray.util.placement_group_table()[group]["state"] == "REMOVED"
    # nor is the replacement's own new group left waiting: no group of the deployment
    # is left for Ray to place again (it would retry without pause)
    assert [g["state"] for g in ray.util.placement_group_table().values()
            if g["state"] not in ("REMOVED", "CREATED")] == []
    assert any("memory worker 2's replacement had no live node for its bundle for 2 s"
               in r.message for r in caplog.records)


def test_collective_paths_across_hosts(cluster, prompts, hf_greedy, monkeypatch):
    """`LAMINA_COLLECTIVE=gloo` across the emulated hosts: each pair's path meets at
    the memory node's IP (its store), the compute end joins from the head's, and the
    tensors take it (the code NCCL runs between GPU nodes). Last here: it replaces the
    module's deployment (the head has room for one compute worker)."""
    nets = cluster["nets"]
    if nets is None:
        pytest.skip(f"no emulated hosts: {cluster['why']}")
    cluster["llm"].shutdown()
    monkeypatch.setenv("LAMINA_COLLECTIVE", "gloo")
    llm = LLM(executor="ray", num_memory_workers=2, num_kv_slots=4096,
              max_step_tokens=1024, worker_timeout_s=WORKER_TIMEOUT_S)
    try:
        ex = llm.executor
        assert [c.kind for c in ex.transport_choices] == ["tcp+gloo"] * 2
        hosts = {a[-1].host for a in ex.addresses}  # each rendezvous: a memory node's IP
        assert hosts <= {nets.ip(1), nets.ip(2)} and hosts, ex.addresses
        pick = PICK[:4]
        outs = llm.generate([prompts[i] for i in pick], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == [hf_greedy[i][:SHORT_NEW] for i in pick]
        health = ray.get([w.health.remote() for w in ex.memory])
        assert all(h["error"] is None and h["path_payloads"] >= 30 * h["steps"] > 0
                   for h in health), health
    finally:
        llm.shutdown()
