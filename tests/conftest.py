"""Shared test setup."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_compiler():
    """Dynamo caches compiled code per code object (TransformerBlock.forward) for the whole
    process; tests build many models and backends, so each test starts from a clean cache."""
    yield
    torch.compiler.reset()
