"""Every path of every layer file, by name: runs one case (or decode case) from one portable weight dict.

Paths: `numpy` (the float64 oracle), `torch:sdpa` (scaled_dot_product_attention, no weights
returned), `torch:explicit` (return_attention=True), `torch:inference` (return_attention=True
under no_grad: the in-place path, one batch element per block; no gradients), `tf:eager`,
`tf:function` and `tf:memory_efficient` (tf.function, no weights returned, attention run two
queries at a time, forced on every case; its gradients come from the path's own backward), and
the deployed runtimes of shared_tests/runtimes.py (`torch:onnx`, `tf:onnx`, `tf:litert`: output
and weights, no gradients). The Keras file's paths (`keras:tensorflow`, `keras:jax`,
`keras:torch`, shared_tests/keras_backends.py) run in a process per backend and are not in
`PATHS`. Each gives a `Result` (shared_tests/calling.py): output, attention weights (None on
`torch:sdpa`) and gradients of sum(output * grad_output) with respect to the inputs passed and
every portable weight (and `attention_bias`, when the case passes one). TensorFlow is imported
only when a TensorFlow path runs; the PyTorch paths run on `torch_runner.torch_device()`.

This module only dispatches: the paths of each layer file are its runner's
(shared_tests/numpy_runner.py, torch_runner.py, tf_runner.py, keras_backends.py), the deployed
runtimes shared_tests/runtimes.py's.
"""

import os

from shared_tests import keras_backends, numpy_runner, runtimes, tf_runner, torch_runner
from shared_tests.calling import Result, not_implemented
from shared_tests.runtimes import RUNTIME_PATHS
from shared_tests.tf_runner import make_tf_layer
from shared_tests.torch_runner import make_torch_layer

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PATHS = (
    "numpy", "torch:sdpa", "torch:explicit", "torch:inference", "tf:eager", "tf:function", "tf:memory_efficient",
    *RUNTIME_PATHS,
)  # fmt: skip


def run(case, data, path, torch_class=None, tf_class=None, export_cache=None):
    """Runs one path; `torch_class` / `tf_class` swap in another layer class (tests use it).
    A runtime path that cannot hold the case raises `runtimes.UnsupportedCaseError`; it keeps
    the export of the layer file's own layer in the folder `export_cache` (`runtimes.kept_export`).
    A path whose layer file lacks one of the case's options (`calling.not_implemented`) raises
    `runtimes.UnsupportedCaseError` too."""
    reason = not_implemented(case, path)
    if reason is not None:
        raise runtimes.UnsupportedCaseError(reason)
    if path == "numpy":
        return numpy_runner.run(case, data)
    if path in keras_backends.KERAS_PATHS:  # in the backend's own process (kept by `keras_backends.prefetch`)
        return keras_backends.result(case, data, path)
    if path in runtimes.RUNTIME_PATHS:

        def make_layer(case, data):
            if path.startswith("torch"):
                return make_torch_layer(case, data, torch_class)
            return make_tf_layer(case, data, tf_class)

        own_layer = (torch_class if path.startswith("torch") else tf_class) is None  # a kept export is the file's
        return Result(*runtimes.run(case, data, path, make_layer, cache=export_cache if own_layer else None), None)
    if path.startswith("torch"):
        return torch_runner.run(case, data, path, torch_class)
    return tf_runner.run(case, data, path, tf_class)


def run_decode(case, data, path):
    """Decodes one decode case (shared_tests/decoding.py) on one path; a `DecodeResult`. A path
    whose layer file lacks one of the case's options raises `runtimes.UnsupportedCaseError`."""
    reason = not_implemented(case, path)
    if reason is not None:
        raise runtimes.UnsupportedCaseError(reason)
    if path == "numpy":
        return numpy_runner.decode(case, data)
    if path in keras_backends.KERAS_PATHS:  # in the backend's own process
        return keras_backends.decode_result(case, data, path)
    if path.startswith("torch"):
        return torch_runner.decode(case, data, path)
    return tf_runner.decode(case, data, path)
