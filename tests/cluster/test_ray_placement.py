"""A deployment the cluster can never hold is refused at once, naming the resource; one
whose resources other deployments hold fails after the placement timeout, naming what
is missing; neither waits forever. A deployment placed but unable to start (its workers
cannot load the weights) fails naming why and gives its resources back."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from lamina.cluster.placement import check_fits, memory_workers_that_fit, worker_options
from lamina.engine.config import EngineConfig
from tests.tiny_models import tiny_model

BUSY = """
import sys, time, ray
ray.init(num_cpus=4, resources={"lamina_compute": 2, "lamina_memory": 2},
         include_dashboard=False)
from lamina import LLM, SamplingParams
from lamina.cluster.placement import PlacementTimeout
model = sys.argv[1]  # a tiny model: placement is the point, not the weights
t = time.perf_counter()
try:  # more memory workers than the cluster's lamina_memory: refused at once
    LLM(model, executor="ray", num_memory_workers=3)
except ValueError as e:
    print("REFUSED", round(time.perf_counter() - t, 1), e)
other = LLM(model, executor="ray", num_memory_workers=1)  # another deployment holds one
t = time.perf_counter()
try:
    LLM(model, executor="ray", num_memory_workers=2, placement_timeout_s=4)
except PlacementTimeout as e:
    print("TIMEOUT", round(time.perf_counter() - t, 1), e)
print("SERVES", [o.finish_reason for o in other.generate(
    [[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)])
t = time.perf_counter()
try:  # placed, but its compute worker cannot load the weights (sys.argv[2]'s are torn)
    LLM(sys.argv[2], executor="ray", num_memory_workers=1)
except Exception as e:
    print("BROKEN", round(time.perf_counter() - t, 1), type(e).__name__, "|", e)
for _ in range(100):  # the removed groups' resources come back through the raylet,
    free = ray.available_resources()  # each group's in its own time
    if free.get("lamina_compute", 0) >= 1 and free.get("lamina_memory", 0) >= 1:
        break
    time.sleep(0.1)
print("FREE", free.get("lamina_compute", 0), free.get("lamina_memory", 0))
print("GROUPS", sorted(g["state"] for g in ray.util.placement_group_table().values()))
ray.shutdown()
"""


@pytest.fixture(scope="module")
def busy(smol, tmp_path_factory) -> dict:
    """One Ray instance (one process, one start) for the deployments below, in order:
    too many memory workers, another deployment holding resources, a timed-out one, and
    a placed one whose weights are torn. -> {"out": its output, "broken": the torn
    model's folder}."""
    tmp = tmp_path_factory.mktemp("placement")
    model = tmp / "tiny"
    tiny_model("llama").save_pretrained(model, safe_serialization=True)
    smol.tokenizer.save_pretrained(model)  # its first 96 ids decode
    broken = tmp / "torn"  # its config and tokenizer, its weights file torn
    shutil.copytree(model, broken)
    (broken / "model.safetensors").write_bytes(b"torn")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "disabled"
    r = subprocess.run([sys.executable, "-c", BUSY, str(model), str(broken)], env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    return {"out": r.stdout + "\n" + r.stderr[-2000:], "broken": str(broken)}


def _line(out: str, head: str) -> str:
    line = next((x for x in out.splitlines() if x.startswith(head)), None)
    assert line is not None, out[-3000:]
    return line


def test_more_memory_workers_than_lamina_memory_is_refused_at_once(busy):
    line = _line(busy["out"], "REFUSED")
    assert "lamina_memory: needs 3, the cluster has 2" in line and "ray status" in line
    assert "3 memory workers" in line
    assert float(line.split()[1]) < 30  # refused before any worker starts


def test_busy_resources_fail_after_the_placement_timeout_naming_them(busy):
    out = busy["out"]
    line = _line(out, "TIMEOUT")
    assert "lamina_memory: needs 2, 1 free" in line and "ray status" in line, line
    assert 4 <= float(line.split()[1]) < 15  # the timeout, not forever
    # the failed deployment's group is removed and what it held is free again (another
    # one-memory-worker deployment fits); the other deployment stays and serves
    assert "SERVES ['length']" in out, out
    # the placed deployment whose worker died loading the weights: the error says so
    # (the worker's own), and its workers and groups are gone (the one that chose the
    # nodes, the compute worker's and the memory worker's removed, as the timed-out
    # one's, the resources back; `other`'s two kept)
    line = _line(out, "BROKEN")
    assert line.split()[2] == "WorkerFailure" and line.split(" | ")[1].startswith(
        f"the compute worker could not start: lamina.model.loader.ModelLoadError: could "
        f"not load model from {busy['broken']}: "), line
    assert float(line.split()[1]) < 120, line  # the worker's own error, not a timeout
    assert "FREE 1.0 1.0" in out, out
    assert "GROUPS ['CREATED', 'CREATED', 'REMOVED', 'REMOVED', 'REMOVED', 'REMOVED', " \
        "'REMOVED']" in out, out


@pytest.mark.parametrize("have, ok", [
    ({"CPU": 2.0}, True),  # 1 + 2 workers at 0.5 CPU each
    ({"CPU": 1.0}, False),
    ({"CPU": 8.0, "lamina_memory": 1.0}, False),
])
def test_check_fits_counts_every_resource(have, ok):
    asks = {"compute worker": ({"num_cpus": 0.5}, 1),
            "memory workers": ({"num_cpus": 0.5, "resources": {"lamina_memory": 1}}
                               if "lamina_memory" in have else {"num_cpus": 0.5}, 2)}
    if ok:
        check_fits(have, asks)
    else:
        with pytest.raises(ValueError, match="cannot hold 1 compute worker, 2 memory workers"):
            check_fits(have, asks)


def test_worker_options_ask_for_what_each_worker_holds():
    """A worker's Ray options: fractional CPUs (compute replicas share one half), the
    role resources the nodes advertise, a GPU where its slices or pool live on one."""
    two = EngineConfig(num_memory_workers=2)
    assert worker_options(two, {"CPU": 2.0}) == ({"num_cpus": 0.5}, {"num_cpus": 0.5})
    roles = {"CPU": 8.0, "lamina_compute": 1.0, "lamina_memory": 2.0}
    assert worker_options(two, roles) == (
        {"num_cpus": 0.5, "resources": {"lamina_compute": 1}},
        {"num_cpus": 0.5, "resources": {"lamina_memory": 1}})
    gpus = EngineConfig(num_memory_workers=2, compute_device="cuda", kv_device="cuda")
    assert worker_options(gpus, {"CPU": 4.0, "GPU": 3.0}) == (
        {"num_cpus": 0.5, "num_gpus": 1}, {"num_cpus": 0.5, "num_gpus": 1})
    with pytest.raises(ValueError, match="each of the 2 memory workers on a GPU of its own, "
                                         "but the Ray cluster has 1 GPU"):
        worker_options(gpus, {"CPU": 4.0, "GPU": 1.0})
    with pytest.raises(ValueError, match="cannot hold 1 compute worker, 2 memory workers: "
                                         "GPU: needs 3, the cluster has 2"):
        worker_options(gpus, {"CPU": 4.0, "GPU": 2.0})
    replicas = EngineConfig(num_compute_workers=2, pipeline="fixed")
    assert worker_options(replicas, {"CPU": 2.0})[0] == {"num_cpus": 0.25}


@pytest.mark.parametrize("have, want", [
    # ray_config.yaml's kind of cluster, a memory node (2 slots) gone: 4 of 6 fit
    ({"CPU": 24.0, "lamina_compute": 1.0, "lamina_memory": 4.0}, (4, "lamina_memory: needs "
                                                                  "6, the cluster has 4")),
    ({"CPU": 24.0, "lamina_compute": 1.0, "lamina_memory": 8.0}, (6, None)),  # all fit
    ({"CPU": 2.0, "lamina_compute": 1.0, "lamina_memory": 8.0}, (3, "CPU: needs 3.5, the "
                                                                 "cluster has 2")),
    ({"CPU": 24.0, "lamina_memory": 8.0}, (6, None)),  # no compute slots: any node
    ({"CPU": 0.5, "lamina_memory": 8.0}, (0, "CPU: needs 3.5, the cluster has 0.5")),
])
def test_memory_workers_that_fit_counts_down_from_the_deployments_size(have, want):
    """A restart short of room deploys as many memory workers as the cluster's total
    resources hold beside the compute worker (0: not even one), and says why not all:
    the message for the whole size."""
    n, why = memory_workers_that_fit(EngineConfig(num_memory_workers=6), have)
    assert n == want[0]
    if want[1] is None:
        assert why is None
    else:
        assert why.startswith("the Ray cluster cannot hold 1 compute worker, 6 memory "
                              "workers: ") and want[1] in why, why


def test_memory_workers_that_fit_in_what_is_free_now_says_free():
    """A restart waiting for room counts what is free now (`ray.available_resources`)."""
    free = {"CPU": 8.0, "lamina_memory": 1.0}  # the compute slot held elsewhere
    n, why = memory_workers_that_fit(EngineConfig(num_memory_workers=2), free, free=True)
    assert n == 1 and why == ("the Ray cluster has no room now for 1 compute worker, 2 "
                              "memory workers: lamina_memory: needs 2, 1 free (its free "
                              "resources; see `ray status`)")
    assert memory_workers_that_fit(EngineConfig(num_memory_workers=2),
                                   {"CPU": 0.4, "lamina_memory": 2.0}, free=True) == (
        0, "the Ray cluster has no room now for 1 compute worker, 2 memory workers: CPU: "
           "needs 1.5, 0.4 free (its free resources; see `ray status`)")


def test_a_restart_short_of_room_tries_again_with_what_is_free_then_gives_up_by_name():
    """`start_when_room`: the first try with the cluster's total resources, the next
    ones every poll with what is free; each new reason said once; started as soon as
    a try fits. With no room for the whole `room_wait_s` (0: none at all), `NoRoom`
    naming the last reason and the wait."""
    from lamina.cluster.placement import PlacementTimeout
    from lamina.cluster.service import NoRoom, start_when_room

    tries, said = [], []
    answers = [NoRoom("no compute node"), PlacementTimeout("room held elsewhere"),
               PlacementTimeout("room held elsewhere"), "started"]

    def start(have, free):
        tries.append((have, free))
        got = answers[len(tries) - 1]
        if isinstance(got, Exception):
            raise got
        return got
    resources = lambda free: {"free": free}  # noqa: E731
    assert start_when_room(start, resources, 5.0, said.append, poll_s=0.01) == "started"
    assert tries == [({"free": False}, False)] + [({"free": True}, True)] * 3
    assert said == ["no compute node", "room held elsewhere"]
    for wait in (0.05, 0.0):
        tries.clear()
        answers[:] = [NoRoom("no compute node")] * 100
        with pytest.raises(NoRoom, match=rf"^no compute node \(no room after 0 s; "
                                         rf"cluster.room_wait_s {wait:g}\)$"):
            start_when_room(start, resources, wait, said.append, poll_s=0.01)
        assert 1 <= len(tries) <= 6 and (wait or len(tries) == 1)


@pytest.mark.parametrize("node, role, threads, want", [
    ({"CPU": 16.0, "lamina_memory": 2.0}, "memory", 1, (8, 8)),  # ray_config.yaml's
    ({"CPU": 8.0, "lamina_compute": 1.0}, "compute", 1, (8, 8)),  # nodes
    ({"CPU": 8.0, "lamina_compute": 1.0, "lamina_memory": 2.0}, "memory", 1, (2, 2)),
    ({"CPU": 8.0, "lamina_compute": 1.0, "lamina_memory": 2.0}, "compute", 1, (2, 2)),
    ({"CPU": 1.0, "lamina_memory": 2.0}, "memory", 1, (1, 1)),  # never below one
    ({"CPU": 8.0, "lamina_compute": 1.0}, "memory", 1, (1, 8)),  # no slot of its role
    ({"CPU": 2.0}, "compute", 1, (1, 2)),  # a local cluster: time-shared, every core
    ({"CPU": 4.0}, "compute", 2, (2, 4)),  # when the memory workers sit idle
    ({}, "memory", 1, (1, 1)),  # the node died after placement
])
def test_a_workers_threads_are_its_share_of_its_nodes_cores(node, role, threads, want):
    """On a node set aside for Lamina (it advertises slots for the worker's role), each
    worker takes its share of the node's CPUs; elsewhere the compute worker's steps
    whose memory workers sit idle take every core of its node."""
    from lamina.cluster.placement import bundle_threads

    assert bundle_threads(node, role, threads) == want
    assert bundle_threads({"CPU": 4.0}, "compute", 1, wide_threads=3) == (1, 3)  # given


def test_removing_a_placement_does_not_wait_on_a_gone_gcs(monkeypatch, caplog):
    """Ray's `remove_placement_group` waits for its GCS without a bound: `remove` gives it
    `timeout_s`, then says so by the group's id and returns False; a call that answers
    returns True, one that fails raises its error."""
    import threading
    import time
    from types import SimpleNamespace

    from lamina.cluster import placement as pl

    gone = threading.Event()  # a GCS that never answers (set at the end, to free the thread)
    monkeypatch.setattr(pl, "remove_placement_group", lambda group: gone.wait())
    group = SimpleNamespace(id=SimpleNamespace(hex=lambda: "d52e9ba2806d"))  # its id only
    p = pl.Placement(group, ({"CPU": 1.0},))
    t = time.perf_counter()
    with caplog.at_level("WARNING", logger=pl.__name__):
        assert p.remove(timeout_s=0.2) is False
    assert 0.2 <= time.perf_counter() - t < 5
    assert "placement group d52e9ba2806d within 0.2 s" in caplog.text
    gone.set()
    removed = []
    monkeypatch.setattr(pl, "remove_placement_group", removed.append)
    assert p.remove() is True and removed == [p.group]

    def refuse(group):
        raise ValueError("placement group not found")

    monkeypatch.setattr(pl, "remove_placement_group", refuse)
    with pytest.raises(ValueError, match="not found"):
        p.remove()
