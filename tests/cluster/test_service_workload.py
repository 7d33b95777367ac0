"""Random HTTP workloads on the deploy-once path (`tests/cluster/service_workload.py`): a
Lamina service on Ray, an HTTP front over it, concurrent clients (streamed and plain,
some hanging up, some with a bad field, some poisoned; conversations over the Responses
API) while the service's workers are killed or stopped at random moments. Every answer
that completed equals the same request alone (a conversation's turn: continuing the
same stored turn), every bad one is a 400 naming its field, every poisoned one a 500
`request_failed` while the others go on, and after, the service is alive and holds
nothing. The events are timed, not tied to steps: whether one lands while requests run
varies between runs; the poisoned requests make every seed here recover. Its first run
found what the recovery's second attempt (a worker lost while a recovery runs), the
engine's own alibi request (two bad requests alone) and the errors' pickling (a
`RequestFailed` reached the front as a 503) fix."""
import pytest

from lamina.errors import EngineOverloaded
from tests.cluster import keep_ray_for_the_next_module
from tests.cluster.service_workload import Deployment, check, features, workload

SEEDS = {  # seed: what it draws at least
    0: {"kill-compute", "kill-memory", "poison", "bad", "cut-plain", "json", "stream"},
    6: {"kill-compute", "poison", "bad", "sampled", "responses-chain", "responses-background"},
    8: {"kill-memory", "stop-compute", "poison", "n", "json"},
}


@pytest.fixture(scope="module")
def deployment():
    d = Deployment()
    yield d
    d.close(shutdown_ray=False)
    keep_ray_for_the_next_module()


@pytest.mark.parametrize("seed", sorted(SEEDS))
def test_service_workload_answers_as_each_request_alone(deployment, seed):
    assert SEEDS[seed] <= features(workload(seed, deployment.ids))
    got = check(seed, deployment)
    assert got.problems == ()
    assert got.recoveries > 0


def test_a_full_queue_reaches_the_front_as_engine_overloaded(deployment):
    """The service's own errors cross Ray as themselves: a request that would overfill
    its queue (`ServerConfig.max_waiting`, 1024) is `EngineOverloaded` at the front
    (its 429 with Retry-After), with the queue's figures; before b858382 the front got
    Ray's "failed to deserialize" instead."""
    from lamina.cluster.client import ServiceLoop

    with pytest.raises(EngineOverloaded) as e:
        ServiceLoop(deployment.client).check_capacity(10 ** 6)
    assert (e.value.waiting, e.value.limit) == (0, 1024) and e.value.retry_after_s > 0
