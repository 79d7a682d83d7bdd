"""Reading a module's tensors: by their `state_dict` names, from a dict, a loaded module or a `.safetensors`
checkpoint read with NumPy only, and the q/k/v layouts of fused projections split into the layer's kernels."""

import json
import os
import struct
from collections.abc import Mapping

import numpy as np


def _float32(array):
    """An array as float32 NumPy (a copy)."""
    return np.array(array, dtype=np.float32)


def _tensor(tensors, name):
    """The module's tensor `name` as float32, or a ValueError naming what the module holds."""
    if name not in tensors:
        raise ValueError(
            f"`tensors` must hold `{name}` for this family's attention. Received: {', '.join(sorted(tensors))}"
        )
    return _float32(tensors[name])


def _linear(name, tensors, source, weights):
    """Adds the `nn.Linear` `source` ((out, in) weight) as `{name}_kernel` (in, out) and its bias; True if biased."""
    weights[f"{name}_kernel"] = _tensor(tensors, f"{source}.weight").T.copy()  # (out, in) -> (in, out)
    if f"{source}.bias" not in tensors:
        return False
    weights[f"{name}_bias"] = _tensor(tensors, f"{source}.bias")
    return True


def _bias_argument(names):
    """The constructor's `bias`: True (all four), False (none) or the tuple of names with a bias."""
    if len(names) == 4:
        return True
    return tuple(names) if names else False


def _separate_projections(tensors, sources):
    """Weights and `bias` of four `nn.Linear` projections named by `sources` (query, key, value, output)."""
    weights, with_bias = {}, []
    for name, source in zip(("query", "key", "value", "output"), sources, strict=True):
        if _linear(name, tensors, source, weights):
            with_bias.append(name)
    return weights, _bias_argument(with_bias)


def _split_fused(tensors, fused, output, columns):
    """Weights and `bias` of a fused q/k/v `nn.Linear` and the output one; `columns`: the q, k and v rows of the
    fused weight (`_blocks`, `_per_head`, `_grouped`)."""
    kernel = _tensor(tensors, f"{fused}.weight").T  # (q + k + v widths, E) -> (E, q + k + v widths)
    bias = _tensor(tensors, f"{fused}.bias") if f"{fused}.bias" in tensors else None
    weights, with_bias = {}, []
    for name, index in zip(("query", "key", "value"), columns, strict=True):
        weights[f"{name}_kernel"] = kernel[:, index].copy()  # (E, width)
        if bias is not None:
            weights[f"{name}_bias"] = bias[index].copy()
            with_bias.append(name)
    if _linear("output", tensors, output, weights):
        with_bias.append("output")
    return weights, _bias_argument(with_bias)


def _blocks(*sizes):
    """Rows [q | k | v] of the given widths (Phi3, GPTBigCode and Falcon multi-query, MPT, ModernBERT)."""
    edges = np.cumsum((0, *sizes))
    return [np.arange(edges[part], edges[part + 1]) for part in range(3)]


def _per_head(num_heads, head_dim):
    """Rows [q_n, k_n, v_n] for each head n (GPT-NeoX, Bloom, GPTBigCode and Falcon without multi-query)."""
    order = np.arange(3 * num_heads * head_dim).reshape(num_heads, 3, head_dim)
    return [order[:, part].reshape(-1) for part in range(3)]


def _grouped(num_kv_heads, group, head_dim):
    """Rows [q_g0 .. q_g(G-1), k_g, v_g] for each key/value head g (Falcon's new decoder architecture)."""
    order = np.arange(num_kv_heads * (group + 2) * head_dim).reshape(num_kv_heads, group + 2, head_dim)
    return [order[:, :group].reshape(-1), order[:, group].reshape(-1), order[:, group + 1].reshape(-1)]


class _Prefixed(Mapping):
    """The tensors under `prefix` of a checkpoint's mapping, by their names in the module's `state_dict`."""

    def __init__(self, tensors, prefix):
        self._tensors, self._prefix = tensors, prefix
        self._names = [name[len(prefix) :] for name in tensors if name.startswith(prefix)]

    def __getitem__(self, name):
        return self._tensors[self._prefix + name]

    def __contains__(self, name):
        return self._prefix + name in self._tensors

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)


_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class _SafetensorsFile(Mapping):
    """A `.safetensors` file read with NumPy only, one tensor at a time (bfloat16 widened to float32)."""

    def __init__(self, path):
        self._path = os.fspath(path)
        with open(self._path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            self._header = json.loads(file.read(length))
        self._header.pop("__metadata__", None)
        self._start = 8 + length

    def __getitem__(self, name):
        entry = self._header[name]
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"`tensors` holds `{name}` in a dtype this reader lacks. Received: {entry['dtype']}")
        begin, end = entry["data_offsets"]
        dtype = np.dtype(_SAFETENSORS_DTYPES[entry["dtype"]]).newbyteorder("<")
        with open(self._path, "rb") as file:
            file.seek(self._start + begin)
            array = np.frombuffer(file.read(end - begin), dtype=dtype).reshape(entry["shape"])
        if entry["dtype"] == "BF16":
            return (array.astype(np.uint32) << 16).view(np.float32)  # bfloat16 is float32's top 16 bits
        return array

    def __iter__(self):
        return iter(self._header)

    def __len__(self):
        return len(self._header)


class _ShardedSafetensors(Mapping):
    """A sharded checkpoint: `model.safetensors.index.json` and the files its `weight_map` names."""

    def __init__(self, index_path):
        directory = os.path.dirname(os.fspath(index_path))
        with open(index_path) as file:
            self._map = json.load(file)["weight_map"]
        self._files = {name: _SafetensorsFile(os.path.join(directory, name)) for name in set(self._map.values())}

    def __getitem__(self, name):
        return self._files[self._map[name]][name]

    def __iter__(self):
        return iter(self._map)

    def __len__(self):
        return len(self._map)


def load_tensors(tensors):
    """A checkpoint's tensors as a mapping of names to NumPy arrays, read with NumPy only, one tensor when asked.

    Args:
        tensors: a `.safetensors` file (or the directory holding `model.safetensors`), a sharded
            checkpoint's `model.safetensors.index.json`, or a mapping (returned as it is).

    Returns:
        A mapping: `load_tensors(path)["embeddings.word_embeddings.weight"]` reads that tensor
        (bfloat16 widened to float32; the other dtypes as stored).
    """
    if isinstance(tensors, Mapping):
        return tensors
    if isinstance(tensors, (str, os.PathLike)):
        path = os.fspath(tensors)
        if path.endswith(".json"):
            return _ShardedSafetensors(path)
        if os.path.isdir(path):
            path = os.path.join(path, "model.safetensors")
        return _SafetensorsFile(path)
    raise ValueError(
        "`tensors` must be a mapping of names to arrays or the path of a .safetensors file. "
        f"Received: {type(tensors).__name__}"
    )
