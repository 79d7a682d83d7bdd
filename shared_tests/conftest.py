"""Pytest setup shared by every test: quiet TensorFlow, repository root importable, a fresh
torch.compile cache for each test, no export kept by the parity report, and the hypothesis
profiles.

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
