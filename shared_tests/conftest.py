"""Pytest setup shared by every test: quiet TensorFlow, repository root importable, and a fresh
torch.compile cache for each test."""

import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture(autouse=True)
def _fresh_torch_compile_cache():
    """torch.compile keeps its graphs per code object for the whole process, and a layer's
    `forward` recompiled for more than 8 configurations fails under fullgraph=True: each test
    starts from an empty cache, whatever the tests before it in its worker compiled."""
    if "torch" in sys.modules:
        sys.modules["torch"]._dynamo.reset()
