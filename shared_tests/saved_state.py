"""Saved state that every later version of the layer files must load: for each configuration of
`CONFIGS`, a PyTorch `state_dict`, a `.keras` file and a `get_config` of the TensorFlow and Keras
files (TensorFlow backend), the NumPy reference's portable weights, one input and each file's
output on it. Written once from a released main into shared_tests/data/saved_state/ by
`python -m shared_tests.saved_state`; test_saved_state.py loads them into the current files.
"""

import json
import os
import sys

import numpy as np

FOLDER = os.path.join(os.path.dirname(__file__), "data", "saved_state")
CONFIGS = {
    "plain": {"d_model": 16, "num_heads": 4},
    "modern": {
        "d_model": 16,
        "num_heads": 4,
        "num_kv_heads": 2,
        "bias": ("query", "key", "value"),
        "softcap": 30.0,
        "window": 4,
        "rope_theta": 10000.0,
        "qk_norm": "head",
        "sinks": True,
        "gate": True,
    },
    "latent": {
        "d_model": 16,
        "num_heads": 4,
        "kv_lora_rank": 8,
        "q_lora_rank": 12,
        "qk_nope_head_dim": 4,
        "qk_rope_head_dim": 4,
        "v_head_dim": 6,
        "rope_theta": 10000.0,
    },
}
FRAMEWORKS = ("NumPy", "PyTorch", "TensorFlow", "Keras")
CALL = {"causal": True}  # every saved output is of a causal self-attention call


def inputs():
    """The one input every saved output answers: (B, T, E) = (2, 6, 16), float32."""
    return np.random.default_rng(7).standard_normal((2, 6, 16)).astype(np.float32)


def _path(name, kind):
    return os.path.join(FOLDER, f"{name}.{kind}")


def _write_torch(name, config, x):
    import torch

    import PyTorch

    torch.manual_seed(0)
    layer = PyTorch.MultiHeadAttention(**config).eval()
    torch.save(layer.state_dict(), _path(name, "torch.pt"))
    with torch.no_grad():
        return layer(torch.tensor(x), **CALL).numpy(), layer.export_weights()


def _write_keras_file(name, config, x, module, kind):
    import keras

    layer = module.MultiHeadAttention(**config)
    inputs_ = keras.Input((x.shape[1], x.shape[2]))
    model = keras.Model(inputs_, layer(inputs_, **CALL))
    model.save(_path(name, f"{kind}.keras"))
    with open(_path(name, f"{kind}.config.json"), "w") as handle:
        json.dump(layer.get_config(), handle, indent=1, sort_keys=True)
    np.savez(_path(name, f"{kind}.weights.npz"), *[np.asarray(w) for w in layer.get_weights()])
    return np.asarray(model(x))


def _write_numpy(name, config, x, weights):
    import NumPy

    layer = NumPy.MultiHeadAttention(**config)
    layer.import_weights(weights)
    np.savez(_path(name, "numpy.weights.npz"), **weights)
    return layer(x.astype(np.float64), **CALL)


def api(module):
    """A layer file's public surface: the constructor's and the call's signatures, the public
    names it defines and the public attributes of its class."""
    import inspect

    layer = module.MultiHeadAttention
    call = getattr(layer, "forward", None) or getattr(layer, "call", None) or layer.__call__
    defined = [
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    ]
    return {
        "init": str(inspect.signature(layer.__init__)),
        "call": str(inspect.signature(call)),
        "names": sorted(defined),
        "attributes": sorted(name for name in dir(layer) if not name.startswith("_") and name in _own(layer)),
    }


def _own(cls):
    """The attribute names the layer class itself (not its framework base) defines."""
    return {name for klass in cls.__mro__ if klass.__module__ == cls.__module__ for name in vars(klass)}


def layer_modules():
    """The four layer files' modules, by folder name (the Keras file on the TensorFlow backend
    unless the process chose another)."""
    import importlib

    return {name: importlib.import_module(f"{name}.Multi_Head_Attention") for name in FRAMEWORKS}


def write():
    """Writes every file of FOLDER from the layer files as they are now."""
    os.makedirs(FOLDER, exist_ok=True)
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import Keras
    import TensorFlow

    x = inputs()
    outputs = {"x": x}
    for name, config in CONFIGS.items():
        outputs[f"{name}.torch"], weights = _write_torch(name, config, x)
        outputs[f"{name}.numpy"] = _write_numpy(name, config, x, weights)
        outputs[f"{name}.tensorflow"] = _write_keras_file(name, config, x, TensorFlow, "tensorflow")
        outputs[f"{name}.keras"] = _write_keras_file(name, config, x, Keras, "keras")
    np.savez(os.path.join(FOLDER, "outputs.npz"), **outputs)
    with open(os.path.join(FOLDER, "api.json"), "w") as handle:
        json.dump({name: api(module) for name, module in layer_modules().items()}, handle, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    write()
