"""What a user saved from an earlier release still loads and computes the same: a PyTorch
`state_dict`, a `.keras` file, a `get_config` with its weights and the NumPy reference's portable
weights, written by shared_tests/saved_state.py, and the public surface of each layer file
(signatures, names, methods) as it was then."""

import inspect
import json
import os

import numpy as np
import pytest

from shared_tests import saved_state

SAVED_ATOL = 1e-6  # float32 outputs of the same weights and input, computed again
SAVED = np.load(os.path.join(saved_state.FOLDER, "outputs.npz"))
with open(os.path.join(saved_state.FOLDER, "api.json")) as _handle:
    SAVED_API = json.load(_handle)


def _path(name, kind):
    return os.path.join(saved_state.FOLDER, f"{name}.{kind}")


@pytest.mark.parametrize("name", sorted(saved_state.CONFIGS))
def test_torch_state_dict_loads(name):
    import torch

    import PyTorch

    layer = PyTorch.MultiHeadAttention(**saved_state.CONFIGS[name]).eval()
    layer.load_state_dict(torch.load(_path(name, "torch.pt")), strict=True)
    with torch.no_grad():
        output = layer(torch.tensor(SAVED["x"]), **saved_state.CALL).numpy()
    np.testing.assert_allclose(output, SAVED[f"{name}.torch"], atol=SAVED_ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(saved_state.CONFIGS))
def test_numpy_weights_load(name):
    import NumPy

    layer = NumPy.MultiHeadAttention(**saved_state.CONFIGS[name])
    layer.import_weights(dict(np.load(_path(name, "numpy.weights.npz"))))
    output = layer(SAVED["x"].astype(np.float64), **saved_state.CALL)
    np.testing.assert_allclose(output, SAVED[f"{name}.numpy"], atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", ["tensorflow", "keras"])
@pytest.mark.parametrize("name", sorted(saved_state.CONFIGS))
def test_keras_file_and_config_load(name, kind):
    """The `.keras` file loads whole; the saved `get_config` rebuilds the layer, which takes the
    saved weights; both give the saved output."""
    import keras

    import Keras
    import TensorFlow

    module = {"tensorflow": TensorFlow, "keras": Keras}[kind]
    model = keras.models.load_model(_path(name, f"{kind}.keras"))
    np.testing.assert_allclose(np.asarray(model(SAVED["x"])), SAVED[f"{name}.{kind}"], atol=SAVED_ATOL, rtol=0)
    with open(_path(name, f"{kind}.config.json")) as handle:
        layer = module.MultiHeadAttention.from_config(json.load(handle))
    layer(SAVED["x"], **saved_state.CALL)  # builds
    with np.load(_path(name, f"{kind}.weights.npz")) as weights:
        layer.set_weights([weights[f"arr_{i}"] for i in range(len(weights.files))])
    output = np.asarray(layer(SAVED["x"], **saved_state.CALL))
    np.testing.assert_allclose(output, SAVED[f"{name}.{kind}"], atol=SAVED_ATOL, rtol=0)


def _compatible(now, then):
    """Whether signature `now` takes every call `then` took the same way: then's parameters first,
    in order, with the same kinds and defaults; any new one keyword-only, with a default (before a
    `**kwargs`, which Python keeps last: TensorFlow's and Keras' constructors)."""
    now, then = inspect.signature(_stub(now)).parameters, inspect.signature(_stub(then)).parameters
    (old, old_var), (new, new_var) = (_without_var_keyword(list(p.values())) for p in (then, now))
    added = new[len(old) :]
    same = new[: len(old)] == old and old_var == new_var
    return same and all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in added)


def _without_var_keyword(parameters):
    """(the parameters but a `**kwargs`, [that `**kwargs`] or [])."""
    var = [p for p in parameters if p.kind is p.VAR_KEYWORD]
    return [p for p in parameters if p.kind is not p.VAR_KEYWORD], var


def _stub(signature):
    """A function of that signature (its text, as `saved_state.api` writes it)."""
    namespace = {}
    exec(f"def stub{signature}: pass", namespace)  # a signature's text, parsed by Python itself
    return namespace["stub"]


@pytest.mark.parametrize("framework", saved_state.FRAMEWORKS)
def test_public_surface_is_kept(framework):
    """Constructor and call signatures take every call they took (new arguments keyword-only,
    last, with a default); every public name and method of the saved surface still there."""
    now, then = saved_state.api(saved_state.layer_modules()[framework]), SAVED_API[framework]
    assert _compatible(now["init"], then["init"]), (now["init"], then["init"])
    assert _compatible(now["call"], then["call"]), (now["call"], then["call"])
    assert set(then["names"]) <= set(now["names"]), f"names gone: {set(then['names']) - set(now['names'])}"
    gone = set(then["attributes"]) - set(now["attributes"])
    assert not gone, f"methods gone from {framework}'s MultiHeadAttention: {gone}"
