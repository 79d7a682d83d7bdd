"""Deployed runtimes as parity paths: each case exported at its static shapes and run there.

- `torch:onnx`: the PyTorch layer (with `return_attention=True`) through `torch.onnx.export`
  (dynamo exporter, default opset), run in onnxruntime.
- `tf:onnx`: the TensorFlow layer in a `tf.function` converted by tf2onnx, run in onnxruntime.
- `tf:litert`: the same `tf.function` converted by the TFLite converter
  (`experimental_lower_to_saved_model=False`), run in the ai-edge-litert interpreter.

Each gives output and weights (no gradients: these runtimes serve inference). A case a runtime
cannot hold raises `UnsupportedCaseError` with the reason, and the report lists it instead of dropping it.
"""

import contextlib
import io
import logging
import warnings

import numpy as np

from shared_tests.cases import CALL_INPUTS, call_inputs

RUNTIME_PATHS = ("torch:onnx", "tf:onnx", "tf:litert")
BFLOAT16_REASONS = {  # what each runtime said when asked (TensorFlow 2.21, onnxruntime 1.32, LiteRT 2.3)
    "torch:onnx": "NumPy has no bfloat16 to feed onnxruntime with",
    "tf:onnx": "tf2onnx emits a MatMul of float16 and bfloat16, which onnxruntime refuses",
    "tf:litert": "the TFLite converter refuses bfloat16 inputs",
}


EMPTY_REASONS = {  # T = 0 or S = 0, exported at those static shapes
    "tf:onnx": "onnxruntime's shape inference refuses the graph tf2onnx exports for a zero-length sequence",
    "tf:litert": "the LiteRT interpreter refuses zero-size tensors (Invalid tensor size)",
}
GROUPED_EMPTY_KEYS_REASON = (  # S = 0 with K < N; the same case with K = N runs
    "onnxruntime's shape inference refuses a MatMul of the graph torch.onnx exports for grouped key/value heads "
    "of zero length (Incompatible dimensions)"
)


class UnsupportedCaseError(Exception):
    """A path that cannot run a case; the message is the reason shown in the report."""


def skip_reason(case, path):
    """Why `path` cannot run `case`, or None."""
    if case.dtype == "bfloat16":
        return BFLOAT16_REASONS[path]
    if case.dtype == "float16" and path == "tf:litert":
        return "TFLite builtin ops have no float16 BatchMatMul (the converter asks for Flex ops)"
    if 0 in (case.t, case.s) and path in EMPTY_REASONS:
        return EMPTY_REASONS[path]
    if case.s == 0 and (case.k or case.n) < case.n and path == "torch:onnx":
        return GROUPED_EMPTY_KEYS_REASON
    return None


def _arrays(case, data):
    """The case's inputs (in the case's dtype) and its other call arguments as NumPy arrays, and
    their names."""
    names = [name for name in ("query", "key", "value") if data[name] is not None]
    arrays = [data[name].astype(case.dtype) for name in names]
    for name, array in call_inputs(data).items():
        names.append(name)
        arrays.append(array)
    return names, arrays


def _call(layer, names, args, case, return_attention):
    """The layer called on exported inputs: the query by position, the rest by name."""
    inputs = dict(zip(names, args, strict=True))
    kwargs = {name: inputs.pop(name) for name in CALL_INPUTS if name in inputs}
    return layer(inputs.pop("query"), **inputs, **kwargs, causal=case.causal, return_attention=return_attention)


def _quietly(fn):
    """Runs an exporter without its progress prints, warnings and log records below ERROR
    (tf2onnx logs to the root logger, e.g. that it fuses no float16 MatMul into a Gemm)."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            return fn()
        finally:
            logging.disable(logging.NOTSET)


def _onnxruntime(model_bytes, arrays):
    import onnxruntime

    session = onnxruntime.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    feeds = {given.name: array for given, array in zip(session.get_inputs(), arrays, strict=True)}
    return session.run(None, feeds)


def run_torch_onnx(case, data, make_layer):
    import torch

    layer = make_layer(case, data)
    names, arrays = _arrays(case, data)

    class Exported(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, *args):
            return _call(self.layer, names, args, case, return_attention=True)

    tensors = tuple(torch.from_numpy(a) for a in arrays)
    program = _quietly(lambda: torch.onnx.export(Exported(), tensors, dynamo=True))
    return _onnxruntime(program.model_proto.SerializeToString(), arrays)


def _tf_function(case, data, make_layer, return_attention=True):
    import tensorflow as tf

    layer = make_layer(case, data)
    names, arrays = _arrays(case, data)
    signature = [tf.TensorSpec(a.shape, tf.as_dtype(a.dtype), name=n) for n, a in zip(names, arrays, strict=True)]

    def attend(*args):
        return _call(layer, names, args, case, return_attention)

    return tf.function(attend, input_signature=signature), signature, names, arrays, layer


def run_tf_onnx(case, data, make_layer, return_attention=True):
    import tf2onnx

    function, signature, _, arrays, _ = _tf_function(case, data, make_layer, return_attention)
    proto, _ = _quietly(lambda: tf2onnx.convert.from_function(function, input_signature=signature))
    return _onnxruntime(proto.SerializeToString(), arrays)


def run_tf_litert(case, data, make_layer, return_attention=True):
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    function, _, names, arrays, layer = _tf_function(case, data, make_layer, return_attention)
    converter = tf.lite.TFLiteConverter.from_concrete_functions([function.get_concrete_function()], layer)
    converter.experimental_lower_to_saved_model = False
    interpreter = Interpreter(model_content=_quietly(converter.convert))
    interpreter.allocate_tensors()
    by_name = dict(zip(names, arrays, strict=True))
    for detail in interpreter.get_input_details():
        interpreter.set_tensor(detail["index"], by_name[detail["name"]])
    interpreter.invoke()
    outputs = sorted(interpreter.get_output_details(), key=lambda d: d["name"])  # Identity, Identity_1
    return [interpreter.get_tensor(d["index"]) for d in outputs]


RUNNERS = {"torch:onnx": run_torch_onnx, "tf:onnx": run_tf_onnx, "tf:litert": run_tf_litert}


def run(case, data, path, make_layer):
    """(output, weights) as float64 arrays from one runtime path; raises UnsupportedCaseError."""
    reason = skip_reason(case, path)
    if reason is not None:
        raise UnsupportedCaseError(reason)
    output, weights = RUNNERS[path](case, data, make_layer)
    return np.asarray(output, np.float64), np.asarray(weights, np.float64)
