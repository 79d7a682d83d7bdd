"""What every runner shares: the inputs of a case's data, how they are passed, and what a path returns.

The base of the runners (shared_tests/numpy_runner.py, torch_runner.py, tf_runner.py, runtimes.py
and the Keras runner): a `Result` per attention case and path, a `DecodeResult` per decode case
and path.

Legend: B batch, T query length, S key/value length, E d_model, N num_heads, P tokens decoded
in all, L cache slots, K num_kv_heads, H head_dim.
"""

import dataclasses
import functools
import pathlib
import re

import numpy as np

INPUTS = ("query", "key", "value")
LAYER_FILES = {"torch": "PyTorch", "tf": "TensorFlow", "keras": "Keras"}  # path prefix -> the layer file's folder


@dataclasses.dataclass
class Result:
    """Output, attention weights (None where a path returns none) and gradients (None: not checked)."""

    output: np.ndarray  # (B, T, E)
    weights: np.ndarray | None  # (B, N, T, S)
    grads: dict | None  # name -> gradient of sum(output * grad_output), the shape of what it is of


@dataclasses.dataclass
class DecodeResult:
    """A decoded case: outputs, weights and final cache, and the same tokens in one full pass."""

    output: np.ndarray  # (B, P, E)
    weights: np.ndarray | None  # (B, N, P, L)
    cache: dict  # key, value (B, K, L, H), keep (B, L), index: NumPy arrays
    full_output: np.ndarray  # (B, P, E) of one full causal pass
    full_weights: np.ndarray  # (B, N, P, P)


def layer_classes():
    """{framework: the `MultiHeadAttention` class of its layer file} for `torch`, `tf`, `keras`
    and `numpy`; TensorFlow and Keras imported on the call."""
    from Keras import MultiHeadAttention as KerasMultiHeadAttention
    from NumPy import MultiHeadAttention as NumpyMultiHeadAttention
    from PyTorch import MultiHeadAttention as TorchMultiHeadAttention
    from TensorFlow import MultiHeadAttention as TFMultiHeadAttention

    return {
        "torch": TorchMultiHeadAttention,
        "tf": TFMultiHeadAttention,
        "keras": KerasMultiHeadAttention,
        "numpy": NumpyMultiHeadAttention,
    }


@functools.cache
def layer_source(folder):
    """The text of `<folder>/Multi_Head_Attention.py`."""
    return (pathlib.Path(__file__).parents[1] / folder / "Multi_Head_Attention.py").read_text()


@functools.cache
def has_option(folder, name):
    """Whether `<folder>/Multi_Head_Attention.py` has a constructor option `name` (asked for every
    case and path: one search of the file per option)."""
    return re.search(rf"\b{name}=", layer_source(folder)) is not None


def not_implemented(case, path):
    """Why `path` cannot run `case`: its layer file has no constructor option of that name
    (MLA's, while a file lacks them); None where it has every option the case passes."""
    folder = LAYER_FILES.get(path.split(":")[0])
    if folder is None:
        return None
    missing = [name for name in case.config if not has_option(folder, name)]
    return f"not implemented in {folder}/Multi_Head_Attention.py (no {', '.join(missing)})" if missing else None


def set_path(layer, case):
    """An MLA case's path on a layer of a framework file: `absorb_latents` (expanded or absorbed)."""
    if getattr(case, "absorb", None) is not None:
        layer.absorb_latents = case.absorb
    return layer


def inputs(data):
    """The inputs a case passes: [query] or [query, key, value]."""
    return [data[name] for name in INPUTS if data[name] is not None]


def by_name(args):
    """(query,) and {"key": ..., "value": ...} from [query] or [query, key, value]: key and value
    go by name, as the TensorFlow layer asks (Keras' built-in is called (query, value, key))."""
    return args[:1], dict(zip(INPUTS[1:], args[1:], strict=False))


def as_numpy_cache(cache, to_numpy):
    """A cache's key, value, keep and index as NumPy arrays (`to_numpy` converts one tensor); an
    int8 or fp8 cache's keys and values dequantised (integers or fp8 values * scales, float64; the
    NumPy file's fp8 codes decoded)."""
    arrays = {name: to_numpy(getattr(cache, name)) for name in ("key", "value", "keep", "index")}
    scales = getattr(cache, "key_scale", None)
    if scales is not None and len(scales.shape) == 4:  # (B, K, L, 1): a scaled cache; (B, 0) or None: float
        for name in ("key", "value"):
            values = _fp8_values(arrays[name]) if arrays[name].dtype == np.uint8 else arrays[name]
            arrays[name] = values * np.asarray(to_numpy(getattr(cache, f"{name}_scale")), np.float64)
    return arrays


def _fp8_values(codes):
    """The NumPy file's fp8 cache: its uint8 e4m3fn codes as float64 values."""
    from NumPy import Multi_Head_Attention as numpy_file

    return numpy_file._fp8_values(codes)
