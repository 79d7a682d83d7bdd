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
from xdist.scheduler import LoadScopeScheduling

KERAS_BACKENDS = ("tensorflow", "jax", "torch")

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


def shared_process_group(nodeid):
    """The group of a test whose subprocess or export is shared with other tests within one
    pytest process (a module fixture of test_distributed.py; keras_seams' process per backend,
    cached; serving.py's decode-step exports, cached), read from its id, or None."""
    path, _, name = nodeid.partition("::")
    if path.endswith("test_distributed.py"):
        return "distributed"
    if path.endswith("test_serving.py"):
        return "serving"
    backend = name.rpartition("[")[2].removesuffix("]")
    if path.endswith(("test_seams.py", "test_seam_properties.py")) and "keras" in name and backend in KERAS_BACKENDS:
        return f"keras_seams_{backend}"
    return None


class SharedProcessScheduling(LoadScopeScheduling):
    """`--dist loadgroup` as this suite needs it: each group of `shared_process_group` is one
    work unit, run in one worker, so its subprocess starts once instead of once in each worker
    that draws one of its tests; every other test is a unit of its own. (pytest-xdist 3.8 groups
    the `xdist_group` mark by renaming each test's `_nodeid`, which pytest 9 no longer reads: its
    groups never form.)"""

    def _split_scope(self, nodeid):
        return shared_process_group(nodeid) or nodeid


@pytest.hookimpl(optionalhook=True)  # unknown where xdist is not loaded (`-p no:xdist`)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None  # another --dist mode, as asked
    return SharedProcessScheduling(config, log)
