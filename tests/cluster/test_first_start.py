"""A first start on a machine builds the CPU kernel (1-2 min on 2 cores). When a worker
will run on the driver's node, the driver builds it (`prebuild_kernel`) and the workers'
start timeout begins once that build is done (`RayExecutor._get`): on a Zen 1 the build
took most of that timeout, whose message then blamed the cluster's room. No Ray cluster
here: the kernel build and `ray.get` are stand-ins."""
import threading
import time
from concurrent.futures import Future

import pytest

from lamina.cluster import executor as ex
from lamina.engine.config import EngineConfig
from lamina.kernels import KernelBuildError


@pytest.fixture
def builds(monkeypatch):
    calls = []

    def build():
        calls.append(threading.current_thread().name)

    monkeypatch.setattr(ex, "load_cpu_kernel", build)
    return calls


def test_the_driver_builds_only_for_a_worker_on_its_node_without_a_build(builds):
    assert ex.prebuild_kernel("here", ["there", "there"], built=lambda: False) is None
    assert ex.prebuild_kernel("here", ["there", "here"], built=lambda: True) is None
    assert builds == []
    fut = ex.prebuild_kernel("here", ["there", "here"], built=lambda: False)
    assert fut.result(10) is None
    assert len(builds) == 1 and builds[0].startswith("lamina-kernel-build")


def test_a_build_that_fails_is_logged_and_leaves_the_workers_their_fallback(monkeypatch,
                                                                             caplog):
    def fail():
        raise KernelBuildError("no C++ compiler (c++/g++) on PATH")

    monkeypatch.setattr(ex, "load_cpu_kernel", fail)
    assert ex.prebuild_kernel("n", ["n"], built=lambda: False).result(10) is None
    assert "could not build the CPU kernel: no C++ compiler" in caplog.text


def test_the_start_timeout_begins_after_the_drivers_build(monkeypatch):
    rex = ex.RayExecutor.__new__(ex.RayExecutor)  # only what `_get` reads
    rex.config = EngineConfig()
    build: Future = Future()
    rex._kernel_build = build
    seen = []

    def get(refs, timeout):
        seen.append((build.done(), timeout, time.monotonic()))
        return refs

    monkeypatch.setattr(ex.ray, "get", get)
    threading.Timer(0.3, build.set_result, (None,)).start()
    t0 = time.monotonic()
    assert rex._get("answer", "the compute worker") == "answer"
    [(done, timeout, at)] = seen
    assert done and at - t0 >= 0.25
    assert timeout == ex.START_TIMEOUT_S + rex.config.placement_timeout_s
    assert rex._kernel_build is None  # awaited once
    assert rex._get("again", "a memory worker") == "again"


def test_the_timeout_message_names_a_first_build_as_well_as_the_room(monkeypatch):
    rex = ex.RayExecutor.__new__(ex.RayExecutor)
    rex.config, rex._kernel_build = EngineConfig(), None

    def get(refs, timeout):
        raise ex.ray.exceptions.GetTimeoutError()

    monkeypatch.setattr(ex.ray, "get", get)
    with pytest.raises(ex.WorkerFailure) as e:
        rex._get("ref", "the compute worker")
    assert str(e.value) == (
        "the compute worker did not start within 150 s: the cluster has no room for them "
        "(see `ray status`), or a node's first start is building the CPU kernel (1-2 "
        "minutes on 2 cores, once; `lamina doctor` on a node builds it ahead)")

