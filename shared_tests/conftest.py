"""Pytest setup shared by every test: quiet TensorFlow, repository root importable, a fresh
torch.compile cache for each test, no export kept by the parity report, the hypothesis profiles,
and the xdist groups of the tests that share a subprocess.

Hypothesis draws the same 25 examples in every run by default (profile "ci": `make test` is
reproducible, a red CI is never a new random draw). `--hypothesis-profile=explore` draws 250
new random examples: run it to look for new failures, then pin what it finds as a regression
case."""

import os
import sys

import pytest
from hypothesis import settings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
settings.register_profile("ci", max_examples=25, derandomize=True, database=None)
settings.register_profile("explore", max_examples=250)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _fresh_torch_compile_cache():
    """torch.compile keeps its graphs per code object for the whole process, and a layer's
    `forward` recompiled for more than 8 configurations fails under fullgraph=True: each test
    starts from an empty cache, whatever the tests before it in its worker compiled."""
    if "torch" in sys.modules:
        sys.modules["torch"]._dynamo.reset()


@pytest.fixture(autouse=True)
def _no_kept_exports(monkeypatch):
    """The parity report keeps the runtimes' exports in out/exports (`--export-cache`); a test
    that runs the report exports afresh and writes nothing in the repository."""
    from shared_tests import parity

    monkeypatch.setattr(parity, "EXPORT_CACHE", "")


def _shared_process_group(item):
    """The xdist group of a test whose subprocess is shared with other tests within one pytest
    process (a module fixture of test_distributed.py; keras_seams' process per backend, cached),
    or None: under `pytest -n 2 --dist loadgroup` a group runs in one worker, so its subprocess
    starts once instead of once in each worker that draws one of its tests."""
    if item.path.name == "test_distributed.py":
        return "distributed"
    backend = getattr(item, "callspec", None) and item.callspec.params.get("backend")
    if item.path.name in ("test_seams.py", "test_seam_properties.py") and backend:
        return f"keras_seams_{backend}"
    return None


def pytest_collection_modifyitems(items):
    for item in items:
        group = _shared_process_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
