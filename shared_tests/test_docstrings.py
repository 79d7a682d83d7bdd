"""The examples in the layer docstrings run and print what they say (Keras on the default backend)."""

import doctest
import importlib

import pytest


@pytest.mark.parametrize("framework", ["NumPy", "PyTorch", "TensorFlow", "Keras"])
def test_docstring_examples(framework):
    module = importlib.import_module(f"{framework}.Multi_Head_Attention")
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 4
    assert result.failed == 0
