"""Emulated hosts: each memory node's raylet runs in a network namespace of its own, with
its own IP on a veth link to this host, so the compute worker reaches the memory workers
over TCP across those links (asserted from the chosen transport and addresses). Taking
one memory node's link down mid-generation is detected within the data-plane timeout
and recovered (its worker placed again on the other memory node) with HF-exact greedy
output. Skipped, saying why, where namespaces cannot be made (not root, no `ip`)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import ray

from lamina import LLM, SamplingParams

pytestmark = pytest.mark.multinode
GREEDY = SamplingParams(max_tokens=64, temperature=0)
PICK = [0, 1, 3, 5, 7, 9, 12, 14]  # 8 prompts of 5-600 tokens
SUBNET = "10.213"  # 10.213.<n>.1 this host's end of link n, 10.213.<n>.2 the namespace's
WORKER_TIMEOUT_S = 5.0


def sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise OSError(f"{' '.join(cmd)}: {r.stderr.strip()}")


class Namespaces:
    """Network namespaces `n` = 1, 2, ... each joined to this host by a veth pair."""

    def __init__(self, count: int):
        tag = os.getpid() % 100000
        self.names = [f"lmt{tag}n{n}" for n in range(1, count + 1)]
        self.links = [f"lm{tag}v{n}" for n in range(1, count + 1)]  # this host's ends
        try:
            for n, (ns, link) in enumerate(zip(self.names, self.links), 1):
                sh("ip", "netns", "add", ns)
                sh("ip", "link", "add", link, "type", "veth", "peer", "name", link + "p")
                sh("ip", "link", "set", link + "p", "netns", ns)
                sh("ip", "addr", "add", f"{SUBNET}.{n}.1/24", "dev", link)
                sh("ip", "link", "set", link, "up")
                for cmd in (("ip", "addr", "add", f"{SUBNET}.{n}.2/24", "dev", link + "p"),
                            ("ip", "link", "set", link + "p", "up"),
                            ("ip", "link", "set", "lo", "up"),
                            ("ip", "route", "add", "default", "via", f"{SUBNET}.{n}.1")):
                    sh("ip", "netns", "exec", ns, *cmd)
        except OSError:
            self.remove()
            raise

    def ip(self, n: int) -> str:
        return f"{SUBNET}.{n}.2"

    def remove(self) -> None:
        for ns, link in zip(self.names, self.links):
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def namespaces_or_skip(count: int) -> Namespaces:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    try:
        return Namespaces(count)
    except OSError as e:
        pytest.skip(f"cannot make network namespaces here: {e}")


@pytest.fixture(scope="module")
def emulated():
    """Head (`lamina_compute`) on this host at its own IP; two memory nodes
    (`lamina_memory: 2` each, so either can take both workers), each in a namespace."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    host_ip = ray.util.get_node_ip_address()
    if host_ip.startswith("127."):
        pytest.skip("this host has no address but loopback for the namespaces to reach")
    nets = namespaces_or_skip(2)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    dirs = [tempfile.mkdtemp(prefix="ln", dir="/tmp") for _ in range(3)]
    raylets: list[subprocess.Popen] = []
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {"lamina_compute": 1}, "temp_dir": dirs[0],
            "include_dashboard": False, "node_ip_address": host_ip,
            # an unreachable node is declared dead in seconds (its bundles placed again)
            "_system_config": {"health_check_period_ms": 1000,
                               "health_check_timeout_ms": 1000,
                               "health_check_failure_threshold": 3}})
        ray_cli = str(Path(sys.executable).with_name("ray"))
        for n, (ns, d) in enumerate(zip(nets.names, dirs[1:]), 1):
            raylets.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, ray_cli, "start", "--block",
                 f"--address={cluster.address}", f"--node-ip-address={nets.ip(n)}",
                 "--num-cpus=1", '--resources={"lamina_memory": 2}', f"--temp-dir={d}",
                 "--disable-usage-stats"],
                env={**os.environ, "RAY_AUTH_MODE": "disabled"}, start_new_session=True,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        ray.init(address=cluster.address, log_to_driver=False)
        deadline = time.monotonic() + 90
        while sum(x["Alive"] for x in ray.nodes()) < 3:
            assert time.monotonic() < deadline, [r.poll() for r in raylets]
            time.sleep(0.5)
        ids = {x["NodeManagerAddress"]: x["NodeID"] for x in ray.nodes() if x["Alive"]}
        yield {"nets": nets, "ids": ids, "host_ip": host_ip}
    finally:
        ray.shutdown()
        for r in raylets:  # by process group: never a host-wide `ray stop`
            try:
                os.killpg(r.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            r.wait(30)
        if cluster is not None:
            cluster.shutdown()
        nets.remove()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def test_memory_nodes_in_namespaces_over_tcp_and_a_link_cut_is_recovered(
        emulated, prompts, hf_greedy):
    nets, ids = emulated["nets"], emulated["ids"]
    llm = LLM(executor="ray", num_memory_workers=2, num_kv_slots=4096,
              max_step_tokens=1024, worker_timeout_s=WORKER_TIMEOUT_S)
    try:
        ex = llm.executor
        assert ex.nodes["compute"] == ids[emulated["host_ip"]]
        assert sorted(ex.nodes["memory"]) == sorted([ids[nets.ip(1)], ids[nets.ip(2)]])
        hosts = sorted(t.split()[1].rpartition(":")[0] for t in ex.transports)
        assert hosts == [nets.ip(1), nets.ip(2)], ex.transports  # TCP across the veths
        batch = [prompts[i] for i in PICK]
        want = [hf_greedy[i] for i in PICK]
        assert [o.token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)] == want

        # cut the link of the node holding memory worker 1, a few decode steps in
        lost = ex.nodes["memory"][1]
        by_node = {ids[nets.ip(n)]: n for n in (1, 2)}
        cut = nets.links[by_node[lost] - 1]
        kept = next(i for i in by_node if i != lost)
        steps = len(llm.engine.step_timings)

        def cut_link():
            while len(llm.engine.step_timings) < steps + 6:
                time.sleep(0.01)
            sh("ip", "link", "set", cut, "down")
        cutter = threading.Thread(target=cut_link, daemon=True)
        cutter.start()
        t = time.perf_counter()
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
        took = time.perf_counter() - t
        cutter.join(5)
        assert [o.token_ids for o in outs] == want
        eng = llm.engine
        assert eng.num_recoveries == 1, eng.recoveries
        assert "memory worker 1" in eng.recoveries[0] and "PeerTimeout" in eng.recoveries[0]
        assert took < 120  # detected within the data-plane timeout, then re-placed
        # both workers now on the node whose link is up
        assert ex.nodes["memory"] == [kept, kept]
        assert all(t.startswith(f"tcp {nets.ip(by_node[kept])}:") for t in ex.transports)
    finally:
        llm.shutdown()
