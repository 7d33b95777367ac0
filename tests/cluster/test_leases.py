"""`ClientLeases` (cluster/leases.py): which requests each client holds and when it was
last heard from; a client silent past the lease gives up its requests, each once."""
import pytest

from lamina.cluster.leases import ClientLeases, Silent


def test_a_silent_clients_requests_are_given_once_and_the_client_forgotten():
    leases = ClientLeases(10.0)
    leases.hold("r1", "a", now=0.0)
    leases.hold("r2", "b", now=1.0)
    leases.hold("r3", "a", now=2.0)  # a is heard from at 2 too
    leases.heard("b", now=9.0)
    assert leases.silent(now=12.0) == []  # a: 10 s exactly, not past the lease
    assert leases.silent(now=12.5) == [Silent("r1", "a", 10.5), Silent("r3", "a", 10.5)]
    assert leases.silent(now=13.0) == []  # given once
    assert leases.clients() == 1  # a forgotten: silent, with no request left
    leases.release("r2")  # b's request ended; b renews no more
    leases.release("r2")  # twice: nothing
    assert leases.clients() == 1 and leases.silent(now=19.5) == []
    assert leases.clients() == 0  # b silent past the lease at 19.5
    leases.hold("r4", "a", now=30.0)  # a client forgotten comes back: a new lease
    assert leases.silent(now=39.0) == [] and leases.clients() == 1


def test_a_lease_must_be_positive():
    with pytest.raises(ValueError, match="a lease must be > 0 s, got 0"):
        ClientLeases(0)
