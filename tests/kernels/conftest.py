"""Fixtures for kernel tests: the compiled CPU backend (built once, cached on disk)."""
import pytest


@pytest.fixture(scope="session")
def cpu():
    from lamina.kernels import CpuBackend

    return CpuBackend()  # must build here: a build failure fails the suite
