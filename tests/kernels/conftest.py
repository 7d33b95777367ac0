"""Fixtures for kernel tests: the compiled CPU backend (built once, cached on disk) and
slot tables scattered by a realistic allocator history."""
import random

import pytest

from lamina.kv_allocator import KVAllocator, KVAllocatorConfig


@pytest.fixture(scope="session")
def cpu():
    from lamina.kernels import CpuBackend

    return CpuBackend()  # must build here: a build failure fails the suite


def scattered_tables(lengths, num_slots, seed=0):
    """Slot tables for requests of `lengths`, after allocator churn: other requests
    come and go while ours grow token by token, so slots interleave and LIFO reuse
    scatters them."""
    rng = random.Random(seed)
    alloc = KVAllocator(KVAllocatorConfig(num_slots))
    spare = num_slots - sum(lengths)
    assert spare > 0, "pool too small for the requested lengths"
    others = []
    for i in range(40):  # warm-up churn, at most the spare slots in all
        n = rng.randint(1, max(1, spare // 40))
        if alloc.can_allocate(n):
            alloc.allocate(("o", i), n)
            others.append(("o", i))
    for r in rng.sample(others, len(others) // 2):
        alloc.free(r)
        others.remove(r)
    ours = [("r", b) for b in range(len(lengths))]
    for r in ours:
        alloc.allocate(r, 0)
    remaining = list(lengths)
    step = 0
    while any(remaining):
        for b, r in enumerate(ours):
            if remaining[b]:
                n = min(remaining[b], rng.choice([1, 1, 1, 16]))  # decode or chunked prefill
                alloc.extend(r, n)
                remaining[b] -= n
        step += 1
        if step % 50 == 0 and others:  # a neighbour finishes, its slots get reused
            alloc.free(others.pop(rng.randrange(len(others))))
    return [alloc.slots(r) for r in ours]
