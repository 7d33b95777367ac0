"""Shared fixtures: the real default model (loaded and split once per session)."""
import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def smol():
    from lamina.models import load

    return load()


@pytest.fixture(scope="session")
def smol_split(smol):
    from lamina.splitter import split_model

    return split_model(smol.model)
