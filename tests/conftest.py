"""Shared test setup."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_compiler():
    """Dynamo caches compiled code per code object (TransformerBlock.forward) for the whole
    process; tests build many models and backends, so each test starts from a clean cache."""
    yield
    torch.compiler.reset()


@pytest.fixture(autouse=True, scope="session")
def _token_cache(tmp_path_factory):
    """The token cache of every run in the tests: one fresh folder per session, never the
    user's (COMPILETUNE_CACHE_DIR is what --cache-dir defaults to)."""
    import os

    os.environ["COMPILETUNE_CACHE_DIR"] = str(tmp_path_factory.mktemp("token-cache"))
    yield
