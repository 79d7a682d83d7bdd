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
import functools
import hashlib
import importlib.metadata
import io
import logging
import os
import unittest.mock
import warnings
from pathlib import Path

import numpy as np

from shared_tests.call_args import CALL_INPUTS, call_inputs

RUNTIME_PATHS = ("torch:onnx", "tf:onnx", "tf:litert")
ROOT = Path(__file__).resolve().parent.parent
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


def call_arrays(case, data):
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


def quietly(fn):
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


@functools.cache
def _torchlib_registry():
    """The exporter's registry builder, its registries kept per opset: `torch.onnx.export(dynamo=True)`
    builds the registry of ONNX functions from torchlib anew at every export (it parses the source of
    about 1500 functions: half of the CPU time of exporting a case of the table), and it depends on
    the opset alone. The exporter only reads it."""
    from torch.onnx._internal.exporter import _registration

    return functools.cache(_registration.ONNXRegistry.from_torchlib)


_CIA_OPS = {}  # torch.ops' namespaces -> torch.export's set of CompositeImplicitAutograd ops


def _cia_ops_once_per_namespaces():
    """`torch.export`'s `_collect_all_valid_cia_ops`, kept while torch.ops has the same namespaces:
    the exporter asks for it about 50 times an export (it queries the C++ dispatcher and walks every
    namespace each time: a tenth of exporting a case of the table). torch does not cache it because a
    custom op registered later adds to it; our exports use no custom op, and a new namespace
    computes it anew."""
    import torch
    from torch._export import utils

    key = tuple(sorted(torch.ops._dir))
    if key not in _CIA_OPS:
        _CIA_OPS[key] = frozenset(utils._collect_all_valid_cia_ops())
    return _CIA_OPS[key]


def torch_onnx_export(module, tensors, **options):
    """`torch.onnx.export(module, tensors, dynamo=True, **options)`, the same exporter and graph,
    with the torchlib registry built once per process (`_torchlib_registry`) and the
    CompositeImplicitAutograd ops listed once (`_cia_ops_once_per_namespaces`)."""
    import torch
    from torch.export import decomp_utils, exported_program
    from torch.onnx._internal.exporter import _registration

    build = _torchlib_registry()
    with (
        unittest.mock.patch.object(_registration.ONNXRegistry, "from_torchlib", staticmethod(build)),
        unittest.mock.patch.object(exported_program, "_collect_all_valid_cia_ops", _cia_ops_once_per_namespaces),
        unittest.mock.patch.object(decomp_utils, "_collect_all_valid_cia_ops", _cia_ops_once_per_namespaces),
    ):
        return quietly(lambda: torch.onnx.export(module, tensors, dynamo=True, **options))


def _onnxruntime(model_bytes, arrays):
    import onnxruntime

    session = onnxruntime.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    feeds = {given.name: array for given, array in zip(session.get_inputs(), arrays, strict=True)}
    return session.run(None, feeds)


# Exported artifacts kept between reports in a folder (`cache`; the parity report's is out/exports):
# the exports of the layer files' own layers, keyed by a hash of the layer file, this module (the
# export code), the framework's runner (which builds the layer), the installed distributions that
# export and convert (`EXPORTERS`, by name and version), the case and its data. A kept artifact is
# still loaded and run by its runtime every time: only the export and conversion are skipped.
EXPORTERS = ("torch", "onnx", "onnxscript", "tensorflow", "tensorflow-cpu", "tf2onnx", "keras", "ai-edge-litert")
LAYER_FILES = {"torch": "PyTorch/Multi_Head_Attention.py", "tf": "TensorFlow/Multi_Head_Attention.py"}


def exporter_versions():
    """'name=version' of each installed distribution of `EXPORTERS` (TensorFlow is installed as
    `tensorflow` or as `tensorflow-cpu`: whichever is there is named)."""
    found = []
    for name in EXPORTERS:
        try:
            found.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return " ".join(found)


@functools.cache
def fingerprint(framework):
    """What every export of `framework` ("torch", "tf") depends on besides its case: the layer
    file, this module, the framework's runner and the exporters' versions."""
    digest = hashlib.sha256()
    runner = Path(__file__).with_name(f"{framework}_runner.py")  # how the runner builds the layer it exports
    for path in (ROOT / LAYER_FILES[framework], Path(__file__), runner):
        digest.update(path.read_bytes())
    digest.update(exporter_versions().encode())
    return digest.hexdigest()


def artifact_key(what, case, data):
    """The hex key of one export: `what` (path and options), the case, and its data's arrays."""
    digest = hashlib.sha256(f"{what}|{fingerprint(what.split(':')[0])}|{case!r}".encode())
    for name, array in _arrays_of(data):
        array = np.ascontiguousarray(array)
        digest.update(f"{name}:{array.dtype}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()[:40]


def _arrays_of(data, prefix=""):
    """(name, array) of every array in a case's data (weights included), in a fixed order."""
    for name in sorted(data):
        value = data[name]
        if isinstance(value, dict):
            yield from _arrays_of(value, f"{prefix}{name}.")
        elif isinstance(value, list | tuple):
            yield from _arrays_of(dict(enumerate(value)), f"{prefix}{name}.")
        elif isinstance(value, np.ndarray):
            yield f"{prefix}{name}", value


def kept_export(what, case, data, export, cache):
    """The bytes `export()` gives, kept in the folder `cache` (read back there by a later report,
    written there the first time); with `cache` None, `export()` itself."""
    if cache is None:
        return export()
    file = Path(cache) / f"{artifact_key(what, case, data)}.bin"
    if file.exists():
        return file.read_bytes()
    content = export()
    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_suffix(f".{os.getpid()}.part")
    partial.write_bytes(content)
    partial.replace(file)
    return content


def run_torch_onnx(case, data, make_layer, cache=None):
    names, arrays = call_arrays(case, data)

    def export():
        import torch

        layer = make_layer(case, data)

        class Exported(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = layer

            def forward(self, *args):
                return _call(self.layer, names, args, case, return_attention=True)

        tensors = tuple(torch.from_numpy(a) for a in arrays)
        return torch_onnx_export(Exported(), tensors).model_proto.SerializeToString()

    return _onnxruntime(kept_export("torch:onnx", case, data, export, cache), arrays)


_LAST_TF_FUNCTION = []  # [((case, return_attention, layer class), data, what tf_function gave)]: the last made


def tf_function(case, data, make_layer, return_attention=True):
    """The layer of `make_layer` called in a `tf.function` with the case's static input signature;
    returns (function, signature, names, arrays, layer). The last one made is given again for the
    same case, the same `data` object, `return_attention` and layer class: `tf:onnx` and `tf:litert`
    convert one trace of a case."""
    import tensorflow as tf

    layer = make_layer(case, data)
    key = (case, return_attention, type(layer))
    if _LAST_TF_FUNCTION and _LAST_TF_FUNCTION[0][0] == key and _LAST_TF_FUNCTION[0][1] is data:
        return _LAST_TF_FUNCTION[0][2]
    names, arrays = call_arrays(case, data)
    signature = [tf.TensorSpec(a.shape, tf.as_dtype(a.dtype), name=n) for n, a in zip(names, arrays, strict=True)]

    def attend(*args):
        return _call(layer, names, args, case, return_attention)

    made = tf.function(attend, input_signature=signature), signature, names, arrays, layer
    _LAST_TF_FUNCTION[:] = [(key, data, made)]
    return made


class _OptimizerError(Exception):
    """An ONNX optimizer of tf2onnx raised on the graph itself (`tf2onnx_convert` converts again)."""


def tf2onnx_convert(function, signature):
    """`tf2onnx.convert.from_function(function, input_signature=signature)`'s ONNX proto, the same
    graph, with tf2onnx's optimizers run on the graph itself: tf2onnx deep-copies the graph before
    each optimizer of each round, to go on without one that raises (a fifth of converting a case of
    the table). Where an optimizer raises, the function is converted again as tf2onnx converts it."""
    import tf2onnx.optimizer

    optimize = tf2onnx.optimizer.optimize_graph

    def in_place(graph, catch_errors=True, optimizers=None):
        try:
            return optimize(graph, False, optimizers)
        except Exception as error:
            raise _OptimizerError from error

    def convert():
        return quietly(lambda: tf2onnx.convert.from_function(function, input_signature=signature))[0]

    try:
        with unittest.mock.patch.object(tf2onnx.optimizer, "optimize_graph", in_place):
            return convert()
    except _OptimizerError:
        return convert()


def run_tf_onnx(case, data, make_layer, return_attention=True, cache=None):
    _, arrays = call_arrays(case, data)

    def export():
        function, signature, _, _, _ = tf_function(case, data, make_layer, return_attention)
        return tf2onnx_convert(function, signature).SerializeToString()

    what = f"tf:onnx:{'weighted' if return_attention else 'output'}"
    return _onnxruntime(kept_export(what, case, data, export, cache), arrays)


def litert_model(function, layer):
    """The TFLite flatbuffer of a `tf.function` with an input signature holding `layer` (the
    default converter: builtin ops only)."""
    import tensorflow as tf

    converter = tf.lite.TFLiteConverter.from_concrete_functions([function.get_concrete_function()], layer)
    converter.experimental_lower_to_saved_model = False
    return quietly(converter.convert)


def run_tf_litert(case, data, make_layer, return_attention=True, cache=None):
    from ai_edge_litert.interpreter import Interpreter

    names, arrays = call_arrays(case, data)

    def export():
        function, _, _, _, layer = tf_function(case, data, make_layer, return_attention)
        return litert_model(function, layer)

    what = f"tf:litert:{'weighted' if return_attention else 'output'}"
    interpreter = Interpreter(model_content=kept_export(what, case, data, export, cache))
    interpreter.allocate_tensors()
    by_name = dict(zip(names, arrays, strict=True))
    for detail in interpreter.get_input_details():
        interpreter.set_tensor(detail["index"], by_name[detail["name"]])
    interpreter.invoke()
    outputs = sorted(interpreter.get_output_details(), key=lambda d: d["name"])  # Identity, Identity_1
    return [interpreter.get_tensor(d["index"]) for d in outputs]


RUNNERS = {"torch:onnx": run_torch_onnx, "tf:onnx": run_tf_onnx, "tf:litert": run_tf_litert}


def run(case, data, path, make_layer, cache=None):
    """(output, weights) as float64 arrays from one runtime path; raises UnsupportedCaseError.
    With `cache`, a folder (only where `make_layer` makes the layer file's own layer), the export
    is kept there and reused (`kept_export`); the runtime runs it every time."""
    reason = skip_reason(case, path)
    if reason is not None:
        raise UnsupportedCaseError(reason)
    output, weights = RUNNERS[path](case, data, make_layer, cache=cache)
    return np.asarray(output, np.float64), np.asarray(weights, np.float64)


# Exports with unknown batch and lengths: each exported once per group of cases that share the
# constructor arguments, dtype and call options, at a shape of its own (B + 1, T + 2, S + 3), and
# run there and at the shape of every case of its group, each against the eager layer that was
# exported (the group's first case's weights). Served as deployed: the output only.
DYNAMIC_PATHS = ("torch:onnx:dynamic", "tf:onnx:dynamic", "tf:litert:dynamic", "tf:saved_model:dynamic")
DYNAMIC_GROUPS = (  # the first case of each group exported with dynamic shapes, within `make parity`'s time
    "self_basic",  # self_b1, self_t1
    "cross",  # cross_s1, cross_t1_decode, large_scores
    "causal_t_eq_s_cross",  # causal_t_lt_s, causal_t_gt_s, empty_keys
    "key_and_query_masks",
    "rope_partial_gqa",
    "gpt_oss_like",
    "float16_cross_causal",
)
NOT_IN_DYNAMIC_GROUPS = (
    "outside the {groups} groups of cases sharing their layer and call options that the shape-polymorphic exports "
    "run (runtimes.DYNAMIC_GROUPS, few for make parity's time)"
)
DYNAMIC_EMPTY_KEYS_REASON = (  # S = 0 in a graph exported at S >= 2
    "onnxruntime refuses a Reshape of the zero-length keys in the graph torch.onnx exports with a dynamic key length"
)
SHAPE_STEPS = {"b": 1, "t": 2, "s": 3}  # the export's own shape: each size grown by a step of its own
DIMENSION_NAMES = {1: "batch", 2: "query_length", 3: "key_length"}  # a dimension named by how much it grew


def export_key(case):
    """What an export fixes: constructor arguments, dtype, causal and which call inputs are passed."""
    fields = ("dtype", "causal", "self_attention", "mask", "key_mask", "query_mask", "attention_bias", "positions")
    return repr(case.config), *(getattr(case, name) for name in fields)


def dynamic_group(case):
    """The first case of the dynamic-shape group `case` belongs to, or None."""
    from shared_tests.cases import CASES_BY_NAME

    return next((name for name in DYNAMIC_GROUPS if export_key(CASES_BY_NAME[name]) == export_key(case)), None)


def dynamic_skip_reason(case, path):
    """Why the dynamic-shape `path` does not run `case`, or None."""
    static = path.removesuffix(":dynamic")
    if static in RUNTIME_PATHS and skip_reason(case, static) is not None:
        return skip_reason(case, static)
    if case.s == 0 and path == "torch:onnx:dynamic":
        return DYNAMIC_EMPTY_KEYS_REASON
    if dynamic_group(case) is None:
        return NOT_IN_DYNAMIC_GROUPS.format(groups=len(DYNAMIC_GROUPS))
    return None


def export_shape_case(case):
    """The case at the export's own shape: B, T and S each grown by its own step (S with T in
    self-attention), so that every size is >= 2 and each dimension is told by how much it grew."""
    import dataclasses

    t = case.t + SHAPE_STEPS["t"]
    s = t if case.self_attention else case.s + SHAPE_STEPS["s"]
    return dataclasses.replace(case, b=case.b + SHAPE_STEPS["b"], t=t, s=s)


def dynamic_dimensions(arrays, grown):
    """For each input, {axis: name} of its dimensions that change with the shape (batch,
    query_length, key_length), from its shape at the case's and at the export's shape."""
    return [
        {axis: DIMENSION_NAMES[g - a] for axis, (a, g) in enumerate(zip(x.shape, y.shape, strict=True)) if g != a}
        for x, y in zip(arrays, grown, strict=True)
    ]


class DynamicExport:
    """One shape-polymorphic export of a layer: `run(arrays)` in the runtime, `eager(arrays)` in
    the layer exported; both give the (B, T, E) output."""

    def __init__(self, run, eager):
        self.run, self.eager = run, eager


def _polymorphic_shapes(arrays, dimensions):
    """Each input's shape with None at its dynamic dimensions."""
    return [
        tuple(None if axis in dims else size for axis, size in enumerate(a.shape))
        for a, dims in zip(arrays, dimensions, strict=True)
    ]


def _torch_module(layer, names, case, return_attention):
    import torch

    class Exported(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, *args):
            return _call(self.layer, names, args, case, return_attention)

    return Exported()


def _made(export):
    return export()


def export_torch_onnx(layer, names, arrays, dimensions, case, keep=_made):
    """The layer through `torch.onnx.export(dynamo=True)` with `dynamic_shapes`, in onnxruntime.
    `keep(export)` gives the exported bytes (`kept_export`: from the cache when kept there)."""
    import onnxruntime
    import torch

    module = _torch_module(layer, names, case, return_attention=False)

    def export():
        dims = {name: torch.export.Dim(name) for name in DIMENSION_NAMES.values()}
        shapes = tuple({axis: dims[name] for axis, name in given.items()} or None for given in dimensions)
        tensors = tuple(torch.from_numpy(a) for a in arrays)
        program = torch_onnx_export(module, tensors, dynamic_shapes=(shapes,))
        return program.model_proto.SerializeToString()

    session = onnxruntime.InferenceSession(keep(export), providers=["CPUExecutionProvider"])

    def run(arrays):
        return session.run(None, {given.name: a for given, a in zip(session.get_inputs(), arrays, strict=True)})[0]

    def eager(arrays):
        with torch.no_grad():
            return module(*(torch.from_numpy(a) for a in arrays)).numpy()

    return DynamicExport(run, eager)


def _tf_signature(names, arrays, dimensions):
    import tensorflow as tf

    shapes = _polymorphic_shapes(arrays, dimensions)
    return [
        tf.TensorSpec(shape, tf.as_dtype(a.dtype), name=n) for n, a, shape in zip(names, arrays, shapes, strict=True)
    ]


def _tf_eager(layer, names, case):
    import tensorflow as tf

    def eager(arrays):
        return _call(layer, names, [tf.constant(a) for a in arrays], case, return_attention=False).numpy()

    return eager


def tf2onnx_dynamic(function, signature):
    """tf2onnx of a `tf.function` with None dimensions, without tf2onnx's `reshape_optimizer`:
    with unknown lengths it gave the (B, L, F) -> (B, L, heads, H) reshape of a separate key or
    value projection the shape of the (B*L, F) matmul before it, which onnxruntime refuses
    (tf2onnx 1.17; the fused self-attention projection converts either way)."""
    from unittest import mock

    import tf2onnx.optimizer

    optimizers = {name: o for name, o in tf2onnx.optimizer._optimizers.items() if name != "reshape_optimizer"}
    with mock.patch.object(tf2onnx.optimizer, "_optimizers", optimizers):
        return tf2onnx_convert(function, signature)


def export_tf_onnx(layer, names, arrays, dimensions, case, keep=_made):
    """The layer in a `tf.function` with None dimensions through tf2onnx, in onnxruntime."""
    import onnxruntime
    import tensorflow as tf

    def export():
        signature = _tf_signature(names, arrays, dimensions)
        function = tf.function(lambda *args: _call(layer, names, args, case, False), input_signature=signature)
        return tf2onnx_dynamic(function, signature).SerializeToString()

    session = onnxruntime.InferenceSession(keep(export), providers=["CPUExecutionProvider"])

    def run(arrays):
        return session.run(None, {given.name: a for given, a in zip(session.get_inputs(), arrays, strict=True)})[0]

    return DynamicExport(run, _tf_eager(layer, names, case))


def functional_model(layer, names, arrays, dimensions, case):
    """A functional `keras.Model` of the layer whose inputs have None dimensions (batch among them)."""
    import keras

    signature = _tf_signature(names, arrays, dimensions)
    inputs = [keras.Input(batch_shape=spec.shape, dtype=spec.dtype.name, name=spec.name) for spec in signature]
    return keras.Model(inputs, _call(layer, names, inputs, case, return_attention=False))


def export_tf_litert(layer, names, arrays, dimensions, case, keep=_made):
    """The functional model through `TFLiteConverter.from_keras_model`, in the LiteRT interpreter,
    its inputs resized to each call's shapes."""
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    def export():
        model = functional_model(layer, names, arrays, dimensions, case)
        return quietly(tf.lite.TFLiteConverter.from_keras_model(model).convert)

    content = keep(export)

    def run(arrays):
        interpreter = Interpreter(model_content=content)
        details = {detail["name"]: detail["index"] for detail in interpreter.get_input_details()}
        by_input = {index: arrays[names.index(_input_name(name, names))] for name, index in details.items()}
        for index, array in by_input.items():
            interpreter.resize_tensor_input(index, array.shape)
        interpreter.allocate_tensors()
        for index, array in by_input.items():
            interpreter.set_tensor(index, array)
        interpreter.invoke()
        return interpreter.get_tensor(interpreter.get_output_details()[0]["index"])

    return DynamicExport(run, _tf_eager(layer, names, case))


def _input_name(detail_name, names):
    """The input a LiteRT tensor name (`serving_default_query:0`) stands for."""
    return max((name for name in names if name in detail_name), key=len)


def export_tf_saved_model(layer, names, arrays, dimensions, case, keep=_made):
    """The functional model through `model.export` (a SavedModel, kept as the bytes of a tar
    archive of its folder), reloaded by `tf.saved_model.load` and called through its `serve`
    endpoint."""
    import tarfile
    import tempfile

    import tensorflow as tf

    def export():
        model = functional_model(layer, names, arrays, dimensions, case)
        with tempfile.TemporaryDirectory() as directory:
            quietly(lambda: model.export(directory, verbose=False))
            archive = io.BytesIO()
            with tarfile.open(fileobj=archive, mode="w") as tar:
                tar.add(directory, arcname="saved_model")
        return archive.getvalue()

    with tempfile.TemporaryDirectory() as directory:
        with tarfile.open(fileobj=io.BytesIO(keep(export))) as tar:
            tar.extractall(directory, filter="data")
        served = tf.saved_model.load(os.path.join(directory, "saved_model"))

    def run(arrays):
        return served.serve(list(arrays)).numpy()

    return DynamicExport(run, _tf_eager(layer, names, case))


DYNAMIC_EXPORTERS = {
    "torch:onnx:dynamic": export_torch_onnx,
    "tf:onnx:dynamic": export_tf_onnx,
    "tf:litert:dynamic": export_tf_litert,
    "tf:saved_model:dynamic": export_tf_saved_model,
}
EXPORTS = {}  # (path, group, layer class) -> (DynamicExport, its difference from eager at its own shape), or the error


def _max_abs(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"the export gave an output of shape {a.shape}, the eager layer {b.shape}")
    return float(np.abs(a - b).max(initial=0.0)) if np.isfinite(a).all() else np.inf


def dynamic_export(path, group, make_layer, layer_class=None, cache=None):
    """The export of `path` for the group whose first case is `group`, made once (the error it
    raised, raised again for every case of the group), and its difference from eager at its own
    shape. `cache`: the folder of kept exports, or None."""
    from shared_tests.cases import CASES_BY_NAME, make_data

    key = (path, group, layer_class)
    if key not in EXPORTS:
        case = CASES_BY_NAME[group]
        data, grown = make_data(case), export_shape_case(case)
        names, arrays = call_arrays(case, data)
        _, grown_arrays = call_arrays(grown, {**make_data(grown), "weights": data["weights"]})
        try:

            def keep(export):
                return kept_export(path, grown, {**data, "arrays": grown_arrays}, export, cache)

            export = DYNAMIC_EXPORTERS[path](
                make_layer(case, data), names, grown_arrays, dynamic_dimensions(arrays, grown_arrays), case, keep
            )
            EXPORTS[key] = export, _max_abs(export.run(grown_arrays), export.eager(grown_arrays))
        except Exception as error:  # every case of the group reports it
            EXPORTS[key] = error
    if isinstance(EXPORTS[key], Exception):
        raise EXPORTS[key]
    return EXPORTS[key]


def run_dynamic(case, data, path, make_layer, layer_class=None, cache=None):
    """The largest difference between the dynamic-shape export of `path` and the eager layer it
    exported, at the export's own shape and at this case's shape (with this case's inputs and
    the exported weights); raises UnsupportedCaseError for a case it cannot run. `cache`: the
    folder of kept exports (`kept_export`; used only for the layer file's own layer)."""
    reason = dynamic_skip_reason(case, path)
    if reason is not None:
        raise UnsupportedCaseError(reason)
    cache = cache if layer_class is None else None
    export, at_own_shape = dynamic_export(path, dynamic_group(case), make_layer, layer_class, cache)
    _, arrays = call_arrays(case, data)
    return max(at_own_shape, _max_abs(export.run(arrays), export.eager(arrays)))
