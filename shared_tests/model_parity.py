"""Model parity: a PyTorch model and a Keras model built around the layer, compared layer by layer.

`python -m shared_tests.parity --model FILE.py` (`make parity ARGS="--model FILE.py"`) reads a
pair file that defines `build_torch()`, `build_keras()` and `example_inputs()` (and optionally
`weight_map()`, `compare_mask()`, `KERAS_BACKENDS` and `DTYPES`; docs/parity.md), then:

1. runs the PyTorch model once with forward hooks on its layers and the Keras model once with
   each layer's `call` recorded, which gives both models' layers in execution order;
2. pairs the weight-carrying layers in that order (or as `weight_map()` says) and checks that
   each pair is of one kind and of one shape, then moves the PyTorch weights into the Keras
   model: the attention layer through `export_weights` / `import_weights`, `nn.Linear` to
   `Dense`, `LayerNorm` to `LayerNormalization`, `RMSNorm` to `RMSNormalization`, `Embedding`
   and `Conv1d` to `Conv1D`. Activation modules and layers are paired too where both models
   have as many; operations that are a layer in one framework only (Keras' `Add`, `Dropout`,
   an activation written as a function) are left out;
3. runs both models on the same inputs, in float32 and in float64, compares the outputs of the
   paired layers in order and the models' outputs, against the SPEC's output tolerance;
4. re-runs the first layer that fails alone, on the PyTorch model's inputs to it (with the
   Keras layer's own masks and options), to tell a layer that differs itself from a layer that
   only receives a difference made before it;
5. with `grad=True`, compares the gradients of a loss with respect to every moved weight.

A Keras model that is not a Keras Model or Layer (a plain class of Keras layers) is compared at
its outputs only, with the weights its builder gave it.

The result is a table per input set and dtype (`format_report`); `main` prints it and exits 1
on any FAIL. Errors in the pair file or in the pairing are ValueErrors naming what was expected
and what was received.
"""

import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from shared_tests.cases import FLOAT64_TOLERANCES, TOLERANCES

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "float64")
# The SPEC's tolerances (absolute, stated for values of order 1): the output tolerance for each layer's output,
# the gradient tolerance for each weight's gradient. A layer's values of root mean square r > 1 grow its tolerance
# by r, as the SPEC grows its tolerances with the scale of the inputs (embeddings and logits are often larger).
# float64: the SPEC's float64 tolerances (1e-12, 1e-11) are the attention layer's; around it, frameworks' float64
# kernels are not all exact, and every layer after one inherits its error: TensorFlow's exact GELU is 5e-9 off erf's
# in float64, Keras' LayerNormalization 2e-7 to 3e-7 on its JAX and torch backends (examples/blocks_pair.py there:
# outputs up to 5e-7, gradients up to 3e-6). So a model in float64 is held to 1e-6 and 1e-5, a tenth of float32's.
FLOAT64_MODEL_TOLERANCES = {"output": 1e-6, "grads": 1e-5}
OUTPUT_TOLERANCES = {"float32": TOLERANCES["float32"]["output"], "float64": FLOAT64_MODEL_TOLERANCES["output"]}
GRAD_TOLERANCES = {"float32": TOLERANCES["float32"]["grads"], "float64": FLOAT64_MODEL_TOLERANCES["grads"]}
# A float64 attention layer with RoPE keeps float32 angles: the SPEC holds it to the float32 row.
ROPE_FLOAT64_TOLERANCES = {"output": FLOAT64_TOLERANCES["rope"]["output"], "grads": FLOAT64_TOLERANCES["rope"]["grads"]}
DEFAULT_BACKENDS = ("tensorflow",)  # a pair file without KERAS_BACKENDS runs on TensorFlow's Keras
GRAD_SEED = 0  # seed of the fixed random weighting of the outputs whose sum is the loss of `grad=True`
REQUIRED = ("build_torch", "build_keras", "example_inputs")
OUTPUTS_ONLY = (
    "the Keras model is not a Keras Model or Layer ({}): compared at its outputs only, with the weights its "
    "builder gave it (none moved)"
)

TORCH_KINDS = {
    "Linear": "dense",
    "LayerNorm": "layer_norm",
    "RMSNorm": "rms_norm",
    "Embedding": "embedding",
    "Conv1d": "conv1d",
}  # torch.nn classes (and their subclasses) -> kind
KERAS_KINDS = {
    "Dense": "dense",
    "LayerNormalization": "layer_norm",
    "RMSNormalization": "rms_norm",
    "Embedding": "embedding",
    "Conv1D": "conv1d",
}  # keras.layers classes (and their subclasses) -> kind
TORCH_ACTIVATIONS = (
    "ReLU", "GELU", "SiLU", "Tanh", "Sigmoid", "Softmax", "LeakyReLU", "ELU", "Mish", "Softplus", "Hardswish", "SELU",
)  # fmt: skip
KERAS_ACTIVATIONS = ("Activation", "ReLU", "Softmax", "LeakyReLU", "ELU")
MOVED = (
    "MultiHeadAttention (export_weights/import_weights), nn.Linear -> Dense, nn.LayerNorm -> LayerNormalization, "
    "nn.RMSNorm -> RMSNormalization, nn.Embedding -> Embedding, nn.Conv1d -> Conv1D"
)
KIND_NAMES = {
    "attention": "attention",
    "dense": "Linear/Dense",
    "layer_norm": "LayerNorm",
    "rms_norm": "RMSNorm",
    "embedding": "Embedding",
    "conv1d": "Conv1d",
    "activation": "activation",
}


@dataclasses.dataclass
class Unit:
    """One layer of one model: its name (module path in PyTorch, layer names joined by `/` in
    Keras), the layer, its kind, and the calls recorded on one forward: (args, kwargs, output)."""

    name: str
    layer: object
    kind: str
    calls: list = dataclasses.field(default_factory=list)

    @property
    def label(self):
        return f"{self.name} ({type(self.layer).__name__})"


@dataclasses.dataclass
class Row:
    """One compared layer (or the models' outputs, or one weight's gradient)."""

    torch_name: str
    keras_name: str
    kind: str
    max_diff: float
    mean_diff: float
    tolerance: float

    @property
    def passed(self):
        return bool(self.max_diff <= self.tolerance)


@dataclasses.dataclass
class Report:
    """The comparison of one input set in one dtype: rows in execution order, then the outputs."""

    inputs: str
    dtype: str
    rows: list
    output: Row
    grads: list = dataclasses.field(default_factory=list)
    verdict: str = ""  # what the first failure is, after its layer was run alone
    notes: list = dataclasses.field(default_factory=list)

    @property
    def passed(self):
        return self.output.passed and all(row.passed for row in [*self.rows, *self.grads])


# ---------------------------------------------------------------- the pair file


def load_pair(path):
    """Imports a pair file, its folder importable (as a script's would be).

    Args:
        path: the pair file.

    Returns:
        The module.

    Raises:
        ValueError: no such file, or it lacks `build_torch`, `build_keras` or `example_inputs`.
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise ValueError(f"--model takes a Python file defining {', '.join(REQUIRED)}. Received: {path} (no such file)")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"model_pair_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise ValueError(
            f"the pair file must define {', '.join(f'{name}()' for name in REQUIRED)}. "
            f"Received: {path.name} without {', '.join(missing)}"
        )
    return module


def input_sets(pair):
    """The pair file's input sets.

    Args:
        pair: the pair file's module; its `example_inputs()` gives one set (an array or a tuple
            of them) or several ({name: set}, e.g. padded and unpadded batches).

    Returns:
        {name: tuple of NumPy arrays}.

    Raises:
        ValueError: an input that is not a NumPy array.
    """
    given = pair.example_inputs()
    sets = given if isinstance(given, dict) else {"inputs": given}
    result = {}
    for name, inputs in sets.items():
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        bad = [type(x).__name__ for x in inputs if not isinstance(x, np.ndarray)]
        if bad:
            raise ValueError(f"example_inputs() must give NumPy arrays. Received: {', '.join(bad)} in set {name!r}")
        result[name] = inputs
    return result


def _cast(inputs, dtype):
    return tuple(x.astype(dtype) if np.issubdtype(x.dtype, np.floating) else x for x in inputs)


# ---------------------------------------------------------------- the layers of each model


def _is_attention(layer):
    return callable(getattr(layer, "export_weights", None)) and callable(getattr(layer, "import_weights", None))


def torch_kind(module):
    """The kind of a PyTorch module the comparison pairs, or None."""
    from torch import nn

    if _is_attention(module):
        return "attention"
    if isinstance(module, tuple(getattr(nn, name) for name in TORCH_ACTIVATIONS)):
        return "activation"
    return next((kind for name, kind in TORCH_KINDS.items() if isinstance(module, getattr(nn, name))), None)


def keras_kind(layer):
    """The kind of a Keras layer the comparison pairs, or None."""
    import keras

    if _is_attention(layer):
        return "attention"
    if isinstance(layer, keras.layers.LayerNormalization) and getattr(layer, "rms_scaling", False):
        return "rms_norm"
    if isinstance(layer, tuple(getattr(keras.layers, name) for name in KERAS_ACTIVATIONS)):
        return "activation"
    return next((kind for name, kind in KERAS_KINDS.items() if isinstance(layer, getattr(keras.layers, name))), None)


def torch_units(model):
    """The PyTorch model's layers the comparison pairs (not descending into them).

    Args:
        model: an nn.Module.

    Returns:
        [Unit], named by their module paths.

    Raises:
        ValueError: a parameter held outside those layers, which the comparison cannot move.
    """
    units, unmoved = [], []

    def visit(prefix, module):
        unmoved.extend(
            f"'{prefix + name}' of {type(module).__name__} {tuple(p.shape)}"
            for name, p in module.named_parameters(recurse=False)
        )
        for name, child in module.named_children():
            kind = torch_kind(child)
            if kind is None:
                visit(f"{prefix}{name}.", child)
            else:
                units.append(Unit(prefix + name, child, kind))

    if torch_kind(model) is not None:
        units.append(Unit(type(model).__name__, model, torch_kind(model)))
    else:
        visit("", model)
    if unmoved:
        raise ValueError(
            f"the PyTorch model holds weights the comparison cannot move: {', '.join(unmoved)}. "
            f"Expected them in the layers it moves: {MOVED}"
        )
    return units


def _children(layer):
    """A Keras layer's direct sublayers (Keras' own walk: it has no public one)."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def _own_variables(layer):
    """A Keras layer's variables that none of its sublayers holds."""
    held = {id(v) for child in _children(layer) for v in child.weights}
    return [v for v in layer.weights if id(v) not in held]


def keras_units(model):
    """The Keras model's layers the comparison pairs (not descending into them).

    Args:
        model: a Keras Model (functional, Sequential or subclassed) or Layer.

    Returns:
        [Unit], named by their layer names (joined by `/` inside nested layers).

    Raises:
        ValueError: a variable held outside those layers, which the comparison cannot move.
    """
    units, unmoved = [], []

    def visit(prefix, layer):
        for child in _children(layer):
            kind = keras_kind(child)
            if kind is not None:
                units.append(Unit(prefix + child.name, child, kind))
                continue
            unmoved.extend(f"'{prefix + child.name}/{v.name}' of {type(child).__name__}" for v in _own_variables(child))
            visit(f"{prefix}{child.name}/", child)

    visit("", model)
    unmoved += [f"'{v.name}' of {type(model).__name__}" for v in _own_variables(model)]
    if unmoved:
        raise ValueError(
            f"the Keras model holds weights the comparison cannot move: {', '.join(unmoved)}. "
            f"Expected them in the layers it moves: {MOVED}"
        )
    return units


class _Recording:
    """Records each unit's calls, in execution order, while the models run: forward hooks in
    PyTorch, each Keras layer's `call` wrapped (on the instance). `order`: (unit, call index)."""

    def __init__(self, torch_list, keras_list):
        self.torch_list, self.keras_list, self.order = torch_list, keras_list, {"torch": [], "keras": []}
        self._handles = []

    def __enter__(self):
        for unit in self.torch_list:
            self._handles.append(unit.layer.register_forward_hook(self._torch_hook(unit), with_kwargs=True))
        for unit in self.keras_list:
            object.__setattr__(unit.layer, "call", self._keras_call(unit, unit.layer.call))
        return self

    def _torch_hook(self, unit):
        def hook(module, args, kwargs, output):
            self.order["torch"].append((unit, len(unit.calls)))
            unit.calls.append((args, kwargs, output))

        return hook

    def _keras_call(self, unit, call):
        def recorded(*args, **kwargs):
            output = call(*args, **kwargs)
            self.order["keras"].append((unit, len(unit.calls)))
            unit.calls.append((args, kwargs, output))
            return output

        recorded.original = call
        return recorded

    def clear(self):
        for unit in [*self.torch_list, *self.keras_list]:
            unit.calls.clear()
        self.order = {"torch": [], "keras": []}

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        for unit in self.keras_list:
            object.__delattr__(unit.layer, "call")
        return False


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def _numpy(tensor):
    """A float64 NumPy copy of a torch or Keras tensor (or of the first of a tuple of them)."""
    import keras

    tensor = _first(tensor)
    if hasattr(tensor, "detach"):
        return tensor.detach().cpu().double().numpy()
    return np.asarray(keras.ops.convert_to_numpy(tensor), dtype=np.float64)


def _called(order):
    """The units in the order of their first call."""
    seen = {}
    for unit, _ in order:
        seen.setdefault(id(unit), unit)
    return list(seen.values())


# ---------------------------------------------------------------- pairing and weights


def _torch_weights(unit):
    """{Keras weight name: NumPy array} of a PyTorch unit, in the Keras layout."""
    layer, kind = unit.layer, unit.kind
    if kind == "attention":
        return dict(layer.export_weights())

    def value(parameter):
        return parameter.detach().cpu().numpy()

    weights = {}
    if kind == "dense":
        weights["kernel"] = value(layer.weight).T  # torch keeps (out, in), Keras (in, out)
    elif kind == "conv1d":
        weights["kernel"] = value(layer.weight).transpose(2, 1, 0)  # (out, in, k) -> (k, in, out)
    elif kind == "embedding":
        weights["embeddings"] = value(layer.weight)
    elif kind == "layer_norm" and layer.weight is not None:
        weights["gamma"] = value(layer.weight)
    elif kind == "rms_norm" and layer.weight is not None:
        weights["scale"] = value(layer.weight)
    bias = getattr(layer, "bias", None)
    if kind in ("dense", "conv1d", "layer_norm") and bias is not None:
        weights["bias" if kind != "layer_norm" else "beta"] = value(bias)
    return weights


def _keras_weight_shapes(unit):
    """{weight name: shape} of a Keras unit, in the names `_torch_weights` gives."""
    if unit.kind == "attention":
        return dict(unit.layer.weight_shapes())
    names = {"gamma": "scale"} if unit.kind == "rms_norm" else {}  # LayerNormalization(rms_scaling=True)
    return {names.get(v.name, v.name): tuple(v.shape) for v in unit.layer.weights}


def _shapes(weights):
    return {name: tuple(np.shape(value)) for name, value in weights.items()}


def _describe_shapes(shapes):
    return ", ".join(f"{name} {shape}" for name, shape in shapes.items()) or "no weights"


def pair_units(torch_order, keras_order, weight_map=None):
    """Pairs the two models' layers.

    Args:
        torch_order: [(Unit, call index)] of the PyTorch model, in execution order.
        keras_order: the same for the Keras model.
        weight_map: {PyTorch module name: Keras layer name} of pairs fixed by name, or None.

    Returns:
        (pairs, notes): [(PyTorch Unit, Keras Unit)], the weight-carrying layers in the order of
        their first call, then the activations where both models run as many; and the notes
        of the report (activations left out).

    Raises:
        ValueError: names that do not run, a different count of weight-carrying layers, or a
            pair of different kinds or shapes (the first such pair).
    """
    weight_map = dict(weight_map or {})
    torch_list = [u for u in _called(torch_order) if u.kind != "activation"]
    keras_list = [u for u in _called(keras_order) if u.kind != "activation"]
    by_name = {u.name: u for u in keras_list}
    torch_names = {u.name for u in torch_list}
    unknown = [f"{t} -> {k}" for t, k in weight_map.items() if t not in torch_names or k not in by_name]
    if unknown:
        raise ValueError(
            f"weight_map() must name PyTorch modules and Keras layers that run. Received: {', '.join(unknown)}; "
            f"PyTorch: {', '.join(sorted(torch_names))}; Keras: {', '.join(by_name)}"
        )
    fixed = {t: by_name[k] for t, k in weight_map.items()}
    free_keras = [u for u in keras_list if u.name not in set(weight_map.values())]
    free_torch = [u for u in torch_list if u.name not in fixed]
    if len(free_torch) != len(free_keras):
        raise ValueError(
            f"the weight-carrying layers cannot be paired: the PyTorch model runs {len(free_torch)} "
            f"({', '.join(u.label for u in free_torch)}), the Keras model {len(free_keras)} "
            f"({', '.join(u.label for u in free_keras)}). Expected as many, in the same order (or a weight_map())"
        )
    rest = iter(free_keras)
    pairs = [(t, fixed[t.name] if t.name in fixed else next(rest)) for t in torch_list]
    for index, (t, k) in enumerate(pairs, 1):
        given, expected = _shapes(_torch_weights(t)), _keras_weight_shapes(k)
        if t.kind != k.kind or given != expected:
            raise ValueError(
                f"the weight-carrying layers cannot be paired at layer {index} in execution order: PyTorch "
                f"{t.label} has {_describe_shapes(given)}; Keras {k.label} has {_describe_shapes(expected)}. "
                "Expected one kind and the same shapes (or a weight_map())"
            )
    notes = []
    torch_acts = [u for u in _called(torch_order) if u.kind == "activation"]
    keras_acts = [u for u in _called(keras_order) if u.kind == "activation"]
    if len(torch_acts) == len(keras_acts):
        pairs += list(zip(torch_acts, keras_acts, strict=True))
    else:
        notes.append(
            f"activations not compared on their own: the PyTorch model runs {len(torch_acts)} activation modules, "
            f"the Keras model {len(keras_acts)} activation layers (an activation in a Dense, or written as a "
            "function, is compared with the layer it follows)"
        )
    return pairs, notes


def transfer(pairs):
    """Moves each PyTorch unit's weights into its Keras unit.

    Args:
        pairs: [(PyTorch Unit, Keras Unit)] from `pair_units`.
    """
    for t, k in pairs:
        if t.kind == "activation":
            continue
        weights = _torch_weights(t)
        if k.kind == "attention":
            k.layer.import_weights(weights)
            continue
        names = {"gamma": "scale"} if k.kind == "rms_norm" else {}
        for variable in k.layer.weights:
            variable.assign(weights[names.get(variable.name, variable.name)].astype(variable.dtype))


# ---------------------------------------------------------------- running and comparing


def _layout(kind, array):
    """A PyTorch tensor in the Keras layout: Conv1d's (B, C, T) is Keras' (B, T, C)."""
    return np.swapaxes(array, 1, 2) if kind == "conv1d" and np.ndim(array) == 3 else array


def _reference(t, k, call):
    """The PyTorch unit's output of `call` as the Keras unit gives it: in Keras' layout, and
    through the Keras layer's own activation (Dense(activation=...) is Linear then a function)."""
    import keras

    reference = _layout(t.kind, _numpy(call[2]))
    activation = getattr(k.layer, "activation", None)
    if k.kind in ("dense", "conv1d") and activation not in (None, keras.activations.linear):
        reference = _numpy(activation(keras.ops.convert_to_tensor(reference)))
    return reference


def _tolerance(reference, base):
    rms = float(np.sqrt(np.mean(np.square(reference)))) if reference.size else 0.0
    return base * max(1.0, rms)


def keras_keep(output, keep=None):
    """The (B, T) positions to compare: `keep` (the pair file's `compare_mask`) if given, else
    the Keras mask the output carries (Keras layers may give anything at padding), else None."""
    import keras
    from keras.src.backend.common.masking import get_keras_mask

    mask = get_keras_mask(_first(output)) if keep is None else keep
    return None if mask is None else np.asarray(keras.ops.convert_to_numpy(mask), dtype=bool)


def _row(t_name, k_name, kind, reference, value, base, keep=None):
    """The Row of one comparison; `reference` broadcasts to `value`'s shape (a PyTorch layer
    given (T,) positions gives (T, E) where its Keras one gives (B, T, E))."""
    if reference.shape != value.shape and reference.ndim < value.ndim:
        with contextlib.suppress(ValueError):  # not broadcastable: a FAIL row that says so
            reference = np.broadcast_to(reference, value.shape)
    if reference.shape != value.shape:
        return Row(t_name, k_name, f"{kind}, shapes {reference.shape} != {value.shape}", np.inf, np.inf, 0.0)
    if keep is not None and keep.shape == reference.shape[: keep.ndim]:
        reference, value = reference[keep], value[keep]
    diff = np.abs(reference - value)
    return Row(
        t_name, k_name, kind, float(diff.max(initial=0.0)), float(diff.mean()) if diff.size else 0.0,
        _tolerance(reference, base),
    )  # fmt: skip


def _bound(function, args, kwargs):
    """{argument name: value} of a call, by `function`'s signature ({} where it does not bind)."""
    try:
        return dict(inspect.signature(function).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return {}


def _is_tensor(value):
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, (bool, int, float))


def run_alone(t, k, index):
    """Runs a Keras layer alone on the PyTorch layer's inputs.

    Each tensor argument of the Keras layer's call is replaced by the PyTorch layer's argument of
    the same name (`query`, `key`, `value`), or else, if floating, by its next floating positional
    tensor, where the two have one shape (in the Keras layout); the Keras call's other arguments,
    its options and its Keras masks are kept.

    Args:
        t: the PyTorch Unit, its calls recorded.
        k: the Keras Unit, its calls recorded (its `call` still wrapped).
        index: which call.

    Returns:
        The Keras layer's output (float64 NumPy) for its `index`-th call made again so.
    """
    import keras
    from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

    torch_args, torch_kwargs, _ = t.calls[index]
    args, kwargs, _ = k.calls[index]
    call = k.layer.call.original
    torch_named = _bound(t.layer.forward, torch_args, torch_kwargs)
    keras_named = _bound(call, args, kwargs)
    by_name = {
        name for name, arg in keras_named.items() if _is_tensor(arg) and hasattr(torch_named.get(name), "detach")
    }
    named_ids = {id(torch_named[name]) for name in by_name}
    positional = iter(
        [a for a in torch_args if hasattr(a, "detach") and a.is_floating_point() and id(a) not in named_ids]
    )
    replaced = {}
    for name, arg in keras_named.items():
        if not _is_tensor(arg):
            continue
        floating = keras.backend.standardize_dtype(arg.dtype).startswith(("float", "bfloat"))
        source = torch_named[name] if name in by_name else next(positional, None) if floating else None
        if source is None:
            continue
        value = _layout(t.kind, source.detach().cpu().numpy())
        if tuple(value.shape) != tuple(arg.shape):
            continue
        tensor = keras.ops.convert_to_tensor(value.astype(keras.backend.standardize_dtype(arg.dtype)))
        mask = get_keras_mask(arg)
        if mask is not None:
            set_keras_mask(tensor, mask)
        replaced[name] = tensor
    if not keras_named:  # a signature that does not bind: by position
        return _numpy(call(*args, **kwargs))
    names = list(inspect.signature(call).parameters)
    args = [replaced.get(names[i], arg) if i < len(names) else arg for i, arg in enumerate(args)]
    kwargs = {name: replaced.get(name, value) for name, value in kwargs.items()}
    return _numpy(call(*args, **kwargs))


def _rope(pairs):
    return any(getattr(t.layer, "rope_theta", None) is not None for t, _ in pairs if t.kind == "attention")


def _to_torch(inputs, device="cpu"):
    import torch

    return tuple(torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in inputs)


def _call_keras(model, inputs):
    return model(inputs[0] if len(inputs) == 1 else list(inputs), training=False)


def _build(pair, base_torch, dtype):
    """(PyTorch model, Keras model) in `dtype`: a copy of `base_torch` (one initialisation for
    every dtype), and the Keras model built under the dtype policy `dtype` (Keras layers take theirs then)."""
    import keras

    torch_model = copy.deepcopy(base_torch).eval()
    torch_model = torch_model.double() if dtype == "float64" else torch_model.float()
    if dtype == "float64" and keras.backend.backend() == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)  # JAX has no float64 without it (DTYPES: float32 runs first)
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()  # Keras keeps the first policy it read
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    try:
        keras_model = pair.build_keras()
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)
    return torch_model, keras_model


def compare(pair, dtypes=DTYPES, grad=False):
    """Compares the pair file's models on each of its input sets, in each dtype.

    Args:
        pair: the pair file's module (`load_pair`).
        dtypes: the dtypes to run, among the file's `DTYPES`.
        grad: also compare the gradients of a loss.

    Returns:
        [Report], one for each dtype and input set. Where float64 raises a TypeError or
        RuntimeError, its Report has no table and a note that says why.
    """
    reports = []
    sets = input_sets(pair)
    weight_map = pair.weight_map() if callable(getattr(pair, "weight_map", None)) else None
    compare_mask = getattr(pair, "compare_mask", None)
    dtypes = [dtype for dtype in dtypes if dtype in getattr(pair, "DTYPES", DTYPES)]
    base_torch = pair.build_torch()
    for dtype in dtypes:
        torch_model, keras_model = _build(pair, base_torch, dtype)
        for name, inputs in sets.items():
            try:
                report = compare_models(
                    torch_model, keras_model, _cast(inputs, dtype), weight_map, grad, name,
                    compare_mask=compare_mask(*inputs) if compare_mask else None,
                )  # fmt: skip
                reports.append(report)
            except (TypeError, RuntimeError) as error:
                if dtype == "float32":
                    raise
                note = f"not run in float64: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
                reports.append(Report(name, dtype, [], Row("", "", "", 0.0, 0.0, 0.0), notes=[note]))
    return reports


def compare_models(
    torch_model, keras_model, inputs, weight_map=None, grad=False, name="inputs", move=True, compare_mask=None
):
    """The Report of two models on `inputs` (NumPy arrays, in the dtype to compare).

    Args:
        torch_model: the PyTorch model, called as `torch_model(*inputs)`.
        keras_model: the Keras model, called on the input (or the list of them).
        inputs: a tuple of NumPy arrays, floating ones already in the dtype to compare.
        weight_map: {PyTorch module name: Keras layer name} of pairs fixed by name, or None.
        grad: also compare the gradients of a loss with respect to every moved weight.
        name: the name of the input set, in the report.
        move: move the PyTorch weights into the Keras model first (False: compare as they are).
        compare_mask: a (B, T) boolean array of the positions to compare, or None: where a Keras
            layer's output carries a mask, the positions it keeps.

    Returns:
        A Report: the paired layers in execution order, the outputs, and the verdict on the
        first failing layer, run alone on the PyTorch model's inputs to it.

    Raises:
        ValueError: a weight the comparison cannot move, or layers that cannot be paired.
    """
    import keras
    import torch

    floating = [x.dtype for x in inputs if np.issubdtype(x.dtype, np.floating)]
    parameters = [p.dtype for p in torch_model.parameters()]
    dtype = "float64" if torch.float64 in parameters or np.float64 in floating else "float32"
    layered = isinstance(keras_model, keras.layers.Layer)
    t_units, k_units = (torch_units(torch_model), keras_units(keras_model)) if layered else ([], [])
    with _Recording(t_units, k_units) as recording, torch.no_grad():
        torch_model(*_to_torch(inputs))
        _call_keras(keras_model, inputs)  # builds a model not built yet; the order of its layers
        if layered:
            pairs, notes = pair_units(recording.order["torch"], recording.order["keras"], weight_map)
        else:
            pairs, notes = [], [OUTPUTS_ONLY.format(type(keras_model).__name__)]
        if move:
            transfer(pairs)
        recording.clear()
        torch_out = _numpy(torch_model(*_to_torch(inputs)))
        keras_out = _call_keras(keras_model, inputs)
        order = list(recording.order["torch"])
        pairs_of = {id(t): k for t, k in pairs}
        base = OUTPUT_TOLERANCES[dtype] if dtype == "float32" or not _rope(pairs) else ROPE_FLOAT64_TOLERANCES["output"]
        rows, compared = [], []
        for t, index in order:
            k = pairs_of.get(id(t))
            if k is None or index >= len(k.calls):
                continue
            call = t.calls[index]
            name_t = t.name if len(t.calls) == 1 else f"{t.name}#{index}"
            name_k = k.name if len(k.calls) == 1 else f"{k.name}#{index}"
            output = k.calls[index][2]
            keep = keras_keep(output, compare_mask)
            rows.append(_row(name_t, name_k, KIND_NAMES[t.kind], _reference(t, k, call), _numpy(output), base, keep))
            compared.append((t, k, index, keep))
        keep = keras_keep(keras_out, compare_mask)
        output = _row("(model output)", "(model output)", "output", torch_out, _numpy(keras_out), base, keep)
        report = Report(name, dtype, rows, output, notes=notes)
        if layered and not rows:
            report.notes.append("no paired layer was recorded: the models are compared at their outputs only")
        report.verdict = _verdict(rows, compared, base)
    if grad and layered:
        report.grads = compare_grads(torch_model, keras_model, inputs, pairs, dtype, _rope(pairs), keep)
    return report


def _verdict(rows, compared, base):
    """What the first failing row is: the layer itself (it differs when run alone on the PyTorch
    model's inputs to it) or a difference made before it, outside the paired layers."""
    failing = next((i for i, row in enumerate(rows) if not row.passed), None)
    if failing is None:
        return ""
    row, (t, k, index, keep) = rows[failing], compared[failing]
    reference = _reference(t, k, t.calls[index])
    where = f"layer {failing + 1}, PyTorch '{row.torch_name}' / Keras '{row.keras_name}' ({row.kind})"
    try:
        alone = _row(row.torch_name, row.keras_name, row.kind, reference, run_alone(t, k, index), base, keep)
    except Exception as error:  # the report still names the layer, and says why it could not tell more
        return (
            f"first failing layer: {where}: max difference {row.max_diff:.1e} > tolerance {row.tolerance:.0e}; "
            f"run alone on the PyTorch model's inputs to it, it raised {type(error).__name__}: "
            f"{str(error).splitlines()[0][:200] if str(error) else ''}"
        )
    if not alone.passed:
        return (
            f"first failing layer: {where}: max difference {row.max_diff:.1e} > tolerance {row.tolerance:.0e}; "
            f"run alone on the PyTorch model's inputs to it, it differs by {alone.max_diff:.1e}: the layer itself "
            "differs (its weights, its options, or the masks it receives)"
        )
    before = f"after layer {failing} ('{rows[failing - 1].torch_name}')" if failing else "before it"
    return (
        f"first failing layer: {where}: max difference {row.max_diff:.1e} > tolerance {row.tolerance:.0e}, but run "
        f"alone on the PyTorch model's inputs to it, it agrees ({alone.max_diff:.1e}): the difference is made "
        f"{before}, outside the paired layers (a residual, an activation or another operation written as a "
        "function, or a mask)"
    )


def compare_grads(torch_model, keras_model, inputs, pairs, dtype, rope=False, keep=None):
    """Compares the gradients of sum(output * R) with respect to every moved weight.

    Args:
        torch_model: the PyTorch model.
        keras_model: the Keras model, holding the PyTorch model's weights.
        inputs: the inputs (NumPy arrays).
        pairs: [(PyTorch Unit, Keras Unit)].
        dtype: "float32" or "float64", for the tolerance.
        rope: whether an attention layer uses RoPE (float64 is then held to float32's tolerance).
        keep: the (B, T) positions compared, or None; R (fixed, random) is 0 elsewhere.

    Returns:
        [Row], one for each weight, named `layer:weight`.

    Raises:
        ValueError: a Keras backend other than tensorflow, jax and torch.
    """
    import keras
    import torch

    torch_out = torch_model(*_to_torch(inputs))
    weighting = np.random.default_rng(GRAD_SEED).standard_normal(tuple(_first(torch_out).shape))
    if keep is not None and keep.shape == weighting.shape[: keep.ndim]:
        weighting *= keep.reshape(keep.shape + (1,) * (weighting.ndim - keep.ndim))
    torch_model.zero_grad()
    (_first(torch_out) * torch.from_numpy(weighting).to(_first(torch_out).dtype)).sum().backward()
    variables = [(t, k, v) for t, k in pairs if t.kind != "activation" for v in k.layer.weights]
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            out = _first(_call_keras(keras_model, inputs))
            loss = tf.reduce_sum(out * tf.constant(weighting, out.dtype))
        grads = tape.gradient(loss, [v.value for _, _, v in variables])
    elif backend == "torch":
        for _, _, v in variables:
            v.value.grad = None
        out = _first(_call_keras(keras_model, inputs))
        (out * torch.from_numpy(weighting).to(out.dtype)).sum().backward()
        grads = [v.value.grad for _, _, v in variables]
    elif backend == "jax":
        import jax

        trainable = keras_model.trainable_variables
        fixed = [v.value for v in keras_model.non_trainable_variables]
        given = inputs[0] if len(inputs) == 1 else list(inputs)

        def loss(values):
            out, _ = keras_model.stateless_call(values, fixed, given, training=False)
            return (_first(out) * weighting.astype(_first(out).dtype)).sum()

        by_id = dict(zip(map(id, trainable), jax.grad(loss)([v.value for v in trainable]), strict=True))
        grads = [by_id.get(id(v)) for _, _, v in variables]
    else:
        raise ValueError(f"--grad runs on Keras' tensorflow, jax and torch backends. Received: {backend}")
    given = {}
    for (_, k, variable), value in zip(variables, grads, strict=True):
        given.setdefault(id(k), []).append(np.zeros(variable.shape) if value is None else _numpy(value))
    base = GRAD_TOLERANCES[dtype] if dtype == "float32" or not rope else ROPE_FLOAT64_TOLERANCES["grads"]
    rows = []
    for t, k in pairs:
        if t.kind == "activation":
            continue
        reference, value = _torch_grads(t), _keras_grads(k, given[id(k)])
        for name in reference:
            rows.append(_row(f"{t.name}:{name}", f"{k.name}:{name}", "grad", reference[name], value[name], base))
    return rows


def _torch_grads(unit):
    """{Keras weight name: gradient} of a PyTorch unit, in the Keras layout (the attention layer:
    its portable names and layout, by exporting the gradients in the place of its weights)."""
    saved = {name: p.data.clone() for name, p in unit.layer.named_parameters()}
    for _, p in unit.layer.named_parameters():
        p.data.copy_(p.grad if p.grad is not None else 0 * p)
    try:
        return {name: np.array(value, np.float64) for name, value in _torch_weights(unit).items()}  # copies
    finally:
        for name, p in unit.layer.named_parameters():
            p.data.copy_(saved[name])


def _keras_grads(unit, grads):
    """{Keras weight name: gradient} of a Keras unit from the gradients of its `weights`, in their
    order (the attention layer: its portable names and layout, exported in the place of its weights)."""
    names = {"gamma": "scale"} if unit.kind == "rms_norm" else {}
    if unit.kind != "attention":
        return {names.get(v.name, v.name): grad for v, grad in zip(unit.layer.weights, grads, strict=True)}
    saved = [np.array(v.numpy()) for v in unit.layer.weights]
    try:
        for variable, grad in zip(unit.layer.weights, grads, strict=True):
            variable.assign(grad.astype(variable.dtype))
        return {name: np.array(value, np.float64) for name, value in unit.layer.export_weights().items()}
    finally:
        for variable, value in zip(unit.layer.weights, saved, strict=True):
            variable.assign(value)


# ---------------------------------------------------------------- the report


def _fmt(value):
    return "inf" if value == np.inf else f"{value:.1e}"


def format_report(report, title=""):
    """The table of one Report.

    Args:
        report: a Report.
        title: printed before its input set and dtype.

    Returns:
        The text: each paired layer, its largest and mean difference, its tolerance and PASS or
        FAIL; the outputs; the gradients; the notes; and what the first failure is.
    """
    head = f"{'#':<4}{'PyTorch':<28}{'Keras':<28}{'kind':<14}{'max':<10}{'mean':<10}{'tolerance':<11}status"
    lines = [f"{title}inputs {report.inputs!r}, {report.dtype}", head, "-" * len(head)]

    def line(index, row):
        status = "PASS" if row.passed else "FAIL"
        return (
            f"{index:<4}{row.torch_name[:27]:<28}{row.keras_name[:27]:<28}{row.kind[:13]:<14}"
            f"{_fmt(row.max_diff):<10}{_fmt(row.mean_diff):<10}{row.tolerance:<11.0e}{status}"
        )

    lines += [line(i, row) for i, row in enumerate(report.rows, 1)]
    if report.output.kind:
        lines.append(line("", report.output))
    if report.grads:
        lines += ["gradients of sum(output * R):", *(line(i, row) for i, row in enumerate(report.grads, 1))]
    lines.append("-" * len(head))
    lines += [f"note: {note}" for note in report.notes]
    if report.verdict:
        lines.append(report.verdict)
    elif report.output.kind and not report.output.passed:
        lines.append("every paired layer agrees, the outputs do not: the difference is made after the last one")
    elif report.output.kind and not report.passed:
        lines.append("the outputs agree, some gradients do not: see the FAIL rows above")
    elif report.output.kind:
        parts = [f"{len(report.rows)} paired layers"] * bool(report.rows) + ["the output"]
        parts += [f"the gradients of {len(report.grads)} weights"] if report.grads else []
        said = f"{', '.join(parts[:-1])} and {parts[-1]} agree" if len(parts) > 1 else f"{parts[0]} agrees"
        lines.append(f"PASS: {said}")
    return "\n".join(lines)


def run_file(path, dtypes=DTYPES, grad=False):
    """Compares the models of a pair file on this process's Keras backend and prints the tables.

    Args:
        path: the pair file.
        dtypes: the dtypes to run.
        grad: also compare the gradients of a loss.

    Returns:
        0 if every row passes, 1 otherwise.
    """
    import keras

    pair = load_pair(path)
    reports = compare(pair, dtypes, grad)
    title = f"model parity: {path}, Keras on {keras.backend.backend()}: "
    print("\n\n".join(format_report(report, title) for report in reports), flush=True)
    return 0 if all(report.passed for report in reports) else 1


def backends_of(path, asked):
    """The Keras backends to run a pair file on.

    Args:
        path: the pair file; its `KERAS_BACKENDS` line (default tensorflow) says where it runs.
        asked: the backends of `--keras`, possibly none.

    Returns:
        Those asked that the file runs on, or the file's first one if none is asked.
    """
    declared = _declared_backends(path)
    if not asked:
        return [declared[0]]
    return [backend for backend in asked if backend in declared]


def _declared_backends(path):
    """The pair file's `KERAS_BACKENDS`, read from its text (importing it could import Keras on
    the wrong backend); raises ValueError if there is no such file."""
    if not Path(path).is_file():
        raise ValueError(f"--model takes a Python file defining {', '.join(REQUIRED)}. Received: {path} (no such file)")
    text = Path(path).read_text()
    for line in text.splitlines():
        if line.startswith("KERAS_BACKENDS"):
            value = line.split("=", 1)[1].split("#", 1)[0].strip()
            return [name.strip(" '\"") for name in value.strip("()[]").split(",") if name.strip(" '\"")]
    return list(DEFAULT_BACKENDS)


def main(argv=None):
    """`python -m shared_tests.model_parity FILE.py [--keras BACKENDS] [--grad] [--dtype D]`: the
    first backend in this process when Keras can still take it, each other one in a process of its own."""
    parser = argparse.ArgumentParser(prog="python -m shared_tests.model_parity", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the pair file: build_torch(), build_keras(), example_inputs()")
    parser.add_argument("--keras", default="", help="Keras backends (comma separated) among the file's KERAS_BACKENDS")
    parser.add_argument("--grad", action="store_true", help="also compare the gradients of a loss")
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="float32, float64 (default: both)")
    args = parser.parse_args(argv)
    try:
        backends = backends_of(args.model, [b for b in args.keras.split(",") if b])
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not backends:
        print(
            f"error: {args.model} runs on Keras' {', '.join(_declared_backends(args.model))} (its KERAS_BACKENDS). "
            f"Received: --keras {args.keras}",
            file=sys.stderr,
        )
        return 2
    status = 0
    for backend in backends:
        if "keras" not in sys.modules:
            os.environ["KERAS_BACKEND"] = backend
        here = "keras" not in sys.modules or sys.modules["keras"].backend.backend() == backend
        if here:
            try:
                status = max(status, run_file(args.model, tuple(args.dtype or DTYPES), args.grad))
            except ValueError as error:
                print(f"error: {error}", file=sys.stderr)
                return 2
            continue
        command = [sys.executable, "-m", "shared_tests.model_parity", args.model, "--keras", backend]
        command += ["--grad"] * args.grad + [f"--dtype={d}" for d in args.dtype or ()]
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
        status = max(status, subprocess.run(command, env=env, cwd=ROOT, check=False).returncode)
    return status


if __name__ == "__main__":
    sys.exit(main())
