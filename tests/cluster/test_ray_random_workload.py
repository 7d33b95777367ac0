"""Random workloads on a Ray deployment (`tests/cluster/ray_workload.py`), its workers
killed and hung mid-run: every request that completed answers as it does alone on a
local engine, each one carrying a fault fails alone, every KV slot is free after, and
the deployment answers on. The seeds were chosen from those `python -m
tests.cluster.ray_workload 0 180` runs to cover what the generator draws; each must
still fire the worker events it is kept for (while requests ran)."""
import pytest

from tests.cluster import keep_ray_for_the_next_module
from tests.cluster.ray_workload import check, deployment, features, workload

SEEDS = {  # seed: (what it draws at least, the worker events that must fire); the note
    23: ({"layer-poison", "memory-poison", "poison", "session", "structured"},
         {"kill-compute"}, "failed before 126cdac: the culprit search named a request "
                           "whose step alone lost the compute worker to the kill"),
    81: ({"preempts", "session", "tiers"}, {"kill-compute", "kill-memory"}, ""),
    87: ({"layer-poison", "memory-poison", "poison", "drafts", "chunks", "session"},
         {"stop-memory"}, ""),
}


@pytest.fixture(scope="module")
def llm():
    llm = deployment()
    yield llm
    llm.shutdown()
    keep_ray_for_the_next_module()


@pytest.mark.parametrize("seed", sorted(SEEDS))
def test_random_workload_on_ray_answers_as_each_request_alone(llm, smol, smol_packed, seed):
    drawn, fire, _ = SEEDS[seed]
    assert drawn <= features(workload(seed, smol))
    got = check(seed, llm, smol, smol_packed)
    assert got.problems == ()
    assert fire <= set(got.fired) and got.recoveries > 0
