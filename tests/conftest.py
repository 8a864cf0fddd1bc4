"""Shared test setup."""

import os

# Inductor probes each vector ISA the CPU lists by compiling a library and loading it in a
# child Python, about 2 s in every process that compiles (each worker, each training
# subprocess). The ISAs the CPU reports are the ones that probe finds loadable here; this says
# so up front (a documented Inductor switch), for the tests and the processes they start.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
# Under pytest-xdist (`-n auto`: a worker per core) each worker computes on one thread, and so
# do the processes it starts: a worker per core each running a thread per core oversubscribes
# the cores, and the tests' small tensors gain nothing from intra-op threads (a third less wall
# time for the whole run on 2 cores).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Nothing reaches the network: the Hub is offline for every test (and for the processes they
# start), and a stray request goes to a closed loopback port. tests/unit/test_hub.py serves its
# own Hub and turns these back for its tests.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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
    os.environ["COMPILETUNE_CACHE_DIR"] = str(tmp_path_factory.mktemp("token-cache"))
    # No end-of-run plot (a second of matplotlib per run); test_plot.py turns it back on.
    os.environ["COMPILETUNE_PLOT"] = "0"
    yield


def pytest_collection_modifyitems(config, items):
    """The slow cases first (each keeps its order): pytest-xdist hands tests out as workers
    free up, so long ones started last leave the other worker idle at the end of the run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _no_estimates_kept_between_tests():
    """Estimates derived for a later call (`estimate_memory(..., also=...)`) stay in the test
    that made them: a test that patches the estimator must run its own."""
    yield
    import sys

    estimator = sys.modules.get("compiletune.estimate.estimator")  # only once imported
    if estimator is not None:
        estimator._DERIVED.clear()
