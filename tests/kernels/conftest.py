"""Fixtures for kernel tests: the compiled CPU backend (built once, cached on disk)."""
import pytest

from lamina.workload import scattered_tables  # noqa: F401  (re-exported for the tests)


@pytest.fixture(scope="session")
def cpu():
    from lamina.kernels import CpuBackend

    return CpuBackend()  # must build here: a build failure fails the suite
