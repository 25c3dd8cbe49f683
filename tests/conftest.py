import pytest
import torch


@pytest.fixture
def gen():
    """A seeded CPU torch.Generator (seed 0) for tests that want their own random stream."""
    return torch.Generator().manual_seed(0)
