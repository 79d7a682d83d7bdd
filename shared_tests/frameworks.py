"""Runs one case through every layer and code path from one portable weight dict.

Paths: `numpy` (the float64 oracle), `torch:sdpa` (scaled_dot_product_attention, no weights
returned), `torch:explicit` (return_attention=True), `torch:inference` (return_attention=True
under no_grad: the in-place path, one batch element per block; no gradients), `tf:eager`,
`tf:function` and `tf:memory_efficient` (tf.function, no weights returned, attention run two
queries at a time, forced on every case; its gradients come from the path's own backward), and
the deployed runtimes of shared_tests/runtimes.py (`torch:onnx`, `tf:onnx`, `tf:litert`: output
and weights, no gradients). The Keras file's paths (`keras:tensorflow`, `keras:jax`,
`keras:torch`, shared_tests/keras_backends.py) run in a process per backend and are not in
`PATHS`. Each gives a `Result`: output, attention weights (None on `torch:sdpa`) and
gradients of sum(output * grad_output) with respect to the inputs passed and every portable
weight (and `attention_bias`, when the case passes one). TensorFlow is imported
only when a TensorFlow path runs; the PyTorch paths run on `torch_device()`.
"""

import dataclasses
import functools
import os
import pathlib
import re
from unittest import mock

import numpy as np

from shared_tests import keras_backends, runtimes
from shared_tests.cases import call_inputs
from shared_tests.runtimes import RUNTIME_PATHS

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PATHS = (
    "numpy", "torch:sdpa", "torch:explicit", "torch:inference", "tf:eager", "tf:function", "tf:memory_efficient",
    *RUNTIME_PATHS,
)  # fmt: skip
INFERENCE_BLOCK_SCORES = 1  # scores per block on `torch:inference`: every batch element a block of its own
MEMORY_EFFICIENT_CHUNK = 2  # queries per chunk on `tf:memory_efficient`: odd T leaves a padded chunk
INPUTS = ("query", "key", "value")
LAYER_FILES = {"torch": "PyTorch", "tf": "TensorFlow", "keras": "Keras"}  # path prefix -> the layer file's folder


@dataclasses.dataclass
class Result:
    output: np.ndarray
    weights: np.ndarray | None
    grads: dict | None


def _inputs(data):
    return [data[name] for name in INPUTS if data[name] is not None]


def by_name(args):
    """(query,) and {"key": ..., "value": ...} from [query] or [query, key, value]: key and value
    go by name, as the TensorFlow layer asks (Keras' built-in is called (query, value, key))."""
    return args[:1], dict(zip(INPUTS[1:], args[1:], strict=False))


@functools.cache
def _layer_source(folder):
    return (pathlib.Path(__file__).parents[1] / folder / "Multi_Head_Attention.py").read_text()


def not_implemented(case, path):
    """Why `path` cannot run `case`: its layer file has no constructor option of that name
    (MLA's, while a file lacks them); None where it has every option the case passes."""
    folder = LAYER_FILES.get(path.split(":")[0])
    if folder is None:
        return None
    missing = [name for name in case.config if not re.search(rf"\b{name}=", _layer_source(folder))]
    return f"not implemented in {folder}/Multi_Head_Attention.py (no {', '.join(missing)})" if missing else None


def set_path(layer, case):
    """An MLA case's path on a layer of a framework file: `absorb_latents` (expanded or absorbed)."""
    if getattr(case, "absorb", None) is not None:
        layer.absorb_latents = case.absorb
    return layer


def run_numpy(case, data):
    from NumPy import MultiHeadAttention

    layer = MultiHeadAttention(**case.config)
    layer.import_weights(data["weights"])
    query, kv = by_name([x.astype(np.float64) for x in _inputs(data)])
    output, weights = layer(*query, **kv, **call_inputs(data), causal=case.causal, return_attention=True)
    return Result(output, weights, layer.backward(data["grad_output"].astype(np.float64)))


def torch_device():
    """The device of the PyTorch paths: $PARITY_TORCH_DEVICE (the parity report's --device), or cpu."""
    return os.environ.get("PARITY_TORCH_DEVICE", "cpu")


def to_torch(array, **kwargs):
    """A NumPy array as a tensor on `torch_device()`."""
    import torch

    return torch.tensor(array, device=torch_device(), **kwargs)


def make_torch_layer(case, data, layer_class=None):
    import torch

    from PyTorch import MultiHeadAttention

    layer = (layer_class or MultiHeadAttention)(**case.config, dtype=getattr(torch, case.dtype), device=torch_device())
    layer.import_weights(data["weights"])
    return set_path(layer, case).eval()


def _torch_inputs(case, data, requires_grad=False):
    """The case's inputs in its dtype and its other call arguments (masks in their own dtype, an
    attention_bias that requires grad), as tensors on `torch_device()`."""
    import torch

    args = [to_torch(x, dtype=getattr(torch, case.dtype), requires_grad=requires_grad) for x in _inputs(data)]
    kwargs = {name: to_torch(x) for name, x in call_inputs(data).items()}
    if requires_grad and "attention_bias" in kwargs:
        kwargs["attention_bias"].requires_grad_(True)
    return args, kwargs


def run_torch(case, data, path, layer_class=None):
    import torch

    if path == "torch:inference":
        return run_torch_inference(case, data, layer_class)
    layer = make_torch_layer(case, data, layer_class)
    args, kwargs = _torch_inputs(case, data, requires_grad=True)
    explicit = path == "torch:explicit"
    query, kv = by_name(args)
    result = layer(*query, **kv, **kwargs, causal=case.causal, return_attention=explicit)
    output, weights = result if explicit else (result, None)
    grads = None
    if case.tolerance["grads"] is not None:
        (output * to_torch(data["grad_output"])).sum().backward()
        grads = dict(zip(INPUTS, (_numpy(x.grad) for x in args), strict=False))
        if "attention_bias" in kwargs:
            bias = kwargs["attention_bias"]
            grads["attention_bias"] = _numpy(torch.zeros_like(bias) if bias.grad is None else bias.grad)
        for name in layer.weight_shapes():
            tensor, transposed = layer._parameter(name)
            grad = torch.zeros_like(tensor) if tensor.grad is None else tensor.grad  # None: autograd never reached it
            grads[name] = _numpy(grad.T if transposed else grad)
    return Result(_numpy(output), None if weights is None else _numpy(weights), grads)


def run_torch_inference(case, data, layer_class=None):
    import torch

    from PyTorch import Multi_Head_Attention

    layer = make_torch_layer(case, data, layer_class)
    args, kwargs = _torch_inputs(case, data)
    with torch.no_grad(), mock.patch.object(Multi_Head_Attention, "_BLOCK_SCORES", INFERENCE_BLOCK_SCORES):
        query, kv = by_name(args)
        output, weights = layer(*query, **kv, **kwargs, causal=case.causal, return_attention=True)
    return Result(_numpy(output), _numpy(weights), None)


def _numpy(tensor):
    return tensor.detach().double().cpu().numpy()


def make_tf_layer(case, data, layer_class=None):
    from TensorFlow import MultiHeadAttention

    layer = (layer_class or MultiHeadAttention)(**case.config, dtype=case.dtype)
    layer.import_weights(data["weights"])
    return set_path(layer, case)


def traced_up_front(function):
    """A tf.function that traces through `get_concrete_function` before it is called. Each case
    builds its own function and traces it at its own shapes, on purpose; called directly, those
    traces (which TensorFlow counts per Python code, so across cases) are reported as retracing."""

    def call(*args):
        function.get_concrete_function(*args)
        return function(*args)

    return call


def run_tensorflow(case, data, path, layer_class=None):
    import tensorflow as tf

    layer = make_tf_layer(case, data, layer_class)
    weighted = path != "tf:memory_efficient"
    if not weighted:
        layer.memory_efficient_threshold = 0  # every case takes the memory-efficient path
        layer.query_chunk_elements = MEMORY_EFFICIENT_CHUNK * case.b * case.n * case.s
    args = [tf.constant(x, dtype=case.dtype) for x in _inputs(data)]
    kwargs = {name: tf.constant(x) for name, x in call_inputs(data).items()}
    bias = kwargs.pop("attention_bias", None)
    variables = [layer._variable(name) for name in layer.weight_shapes()]

    def forward_and_grads(args, bias):
        with tf.GradientTape() as tape:
            tape.watch([*args, *([] if bias is None else [bias])])
            given = kwargs if bias is None else {**kwargs, "attention_bias": bias}
            query, kv = by_name(args)
            result = layer(*query, **kv, **given, causal=case.causal, return_attention=weighted)
            output, weights = result if weighted else (result, None)
            loss = tf.reduce_sum(tf.cast(output, tf.float32) * data["grad_output"])
        sources = [*args, *([] if bias is None else [bias]), *variables]
        grads = tape.gradient(loss, sources)
        # A source the loss never reached has gradient zero (tf gives None).
        return output, weights, [tf.zeros_like(x) if g is None else g for x, g in zip(sources, grads, strict=True)]

    step = forward_and_grads if path == "tf:eager" else traced_up_front(tf.function(forward_and_grads))
    output, weights, grads = step(args, bias)
    names = [*INPUTS[: len(args)], *([] if bias is None else ["attention_bias"]), *layer.weight_shapes()]
    as_numpy = {name: np.asarray(g.numpy(), dtype=np.float64) for name, g in zip(names, grads, strict=True)}
    return Result(
        np.asarray(output.numpy(), dtype=np.float64),
        None if weights is None else np.asarray(weights.numpy(), dtype=np.float64),
        as_numpy if case.tolerance["grads"] is not None else None,
    )


def run(case, data, path, torch_class=None, tf_class=None):
    """Runs one path; `torch_class` / `tf_class` swap in another layer class (tests use it).
    A runtime path that cannot hold the case, or a path whose layer file lacks one of its
    options (`not_implemented`), raises `runtimes.UnsupportedCaseError`."""
    reason = not_implemented(case, path)
    if reason is not None:
        raise runtimes.UnsupportedCaseError(reason)
    if path == "numpy":
        return run_numpy(case, data)
    if path in keras_backends.KERAS_PATHS:  # in the backend's own process (kept by `keras_backends.prefetch`)
        return keras_backends.result(case, data, path)
    if path in runtimes.RUNTIME_PATHS:

        def make_layer(case, data):
            if path.startswith("torch"):
                return make_torch_layer(case, data, torch_class)
            return make_tf_layer(case, data, tf_class)

        return Result(*runtimes.run(case, data, path, make_layer), None)
    if path.startswith("torch"):
        return run_torch(case, data, path, torch_class)
    return run_tensorflow(case, data, path, tf_class)
