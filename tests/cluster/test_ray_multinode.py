"""The engine on a multi-raylet Ray cluster on this host: a compute node (`lamina_compute`)
and memory nodes (`lamina_memory`), each raylet in its own temp dir. Each worker lands on
a node of its kind (asserted from Ray's node ids), the compute worker reaches memory
workers on other nodes over TCP, and greedy output equals HF's."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import ray

from lamina import LLM, SamplingParams

pytestmark = pytest.mark.multinode
GREEDY = SamplingParams(max_tokens=64, temperature=0)
PICK = [0, 1, 3, 5, 7, 9, 12, 14]  # 8 prompts of 5-600 tokens


def start_cluster(memory_nodes: list[int]):
    """A head node with `lamina_compute` and one node per entry of `memory_nodes`
    advertising that many `lamina_memory`. -> (cluster, {"compute": id, "memory": [ids]},
    temp dirs)."""
    from ray.cluster_utils import Cluster

    os.environ["RAY_AUTH_MODE"] = "disabled"  # a stray ~/.ray/auth_token must not matter
    dirs = [tempfile.mkdtemp(prefix="lm", dir="/tmp") for _ in range(1 + len(memory_nodes))]
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"lamina_compute": 1}, "temp_dir": dirs[0],
        "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1, resources={"lamina_memory": n}, temp_dir=d)
             for n, d in zip(memory_nodes, dirs[1:])]
    cluster.wait_for_nodes()
    ids = {"compute": cluster.head_node.node_id, "memory": [n.node_id for n in nodes]}
    return cluster, ids, dirs


@pytest.fixture(scope="module", params=[[1, 1], [2]], ids=["2-memory-nodes", "1-memory-node"])
def deployment(request):
    if ray.is_initialized():
        ray.shutdown()
    cluster, ids, dirs = start_cluster(request.param)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        llm = LLM(executor="ray", num_memory_workers=2, num_kv_slots=4096,
                  max_step_tokens=1024)
        yield llm, ids
        llm.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def test_workers_on_their_nodes_over_tcp_greedy_equals_hf(deployment, prompts, hf_greedy):
    llm, ids = deployment
    ex = llm.executor
    assert ex.nodes["compute"] == ids["compute"]
    if len(ids["memory"]) == 2:  # SPREAD: one memory worker on each memory node
        assert sorted(ex.nodes["memory"]) == sorted(ids["memory"])
    else:  # both on the one memory node
        assert ex.nodes["memory"] == ids["memory"] * 2
    assert all(t.startswith("tcp ") for t in ex.transports), ex.transports
    outs = llm.generate([prompts[i] for i in PICK], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy[i] for i in PICK]
    # the deployment's placement group holds exactly its bundles
    table = ray.util.placement_group_table(ex.placement.group)
    assert table["state"] == "CREATED" and len(table["bundles"]) == 3
