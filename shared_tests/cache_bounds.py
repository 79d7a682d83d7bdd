"""What the int8 and fp8 KV caches' tests share (docs/SPEC.md, "KV-cache decoding"): the reference's
float q, k and v that their bounds are derived from, and decoding with a quantized cache against the
float cache in NumPy, PyTorch and TensorFlow, held to such a bound.

Legend: B batch, N num_heads, K num_kv_heads, P tokens of the decode case, H head_dim.
"""

import dataclasses

import numpy as np

from NumPy import Multi_Head_Attention as numpy_file
from shared_tests import numpy_runner, tf_runner, torch_runner
from shared_tests.cases import TOLERANCES

FLOAT32 = TOLERANCES["float32"]["output"]  # float32 arithmetic on top of a cache's bound


def reference_qkv(case, data):
    """The NumPy reference layer of a decode case and its float q (B, N, P, H), k and v (B, K, P, H)
    over all P tokens of `data`, the causal full pass's projections."""
    layer = numpy_file.MultiHeadAttention(**case.config)
    layer.import_weights(data["weights"])
    x = data["inputs"]["query"].astype(np.float64)
    call = layer._check_call(x, None, None, None, None, None, None, data["positions"], True, False, None, None)
    return (layer, *layer._project_qkv(call))


def check_decoding_within_bound(case, data, bound, weights_bound):
    """Decodes `case` (a quantized cache) and the same case with a float cache in NumPy, PyTorch and
    TensorFlow: each file's outputs differ by more than 0 (the quantized values are what is attended)
    and at most `bound`, its weights by at most `weights_bound`, and the files' quantized outputs
    from NumPy's by at most twice the bound (float32 arithmetic on top of each)."""
    floats = dataclasses.replace(case, cache_dtype=None)
    runs = {
        "numpy": lambda c: numpy_runner.decode(c, data),
        "torch": lambda c: torch_runner.decode(c, data, "torch:explicit"),
        "tf": lambda c: tf_runner.decode(c, data, "tf:eager"),
    }
    outputs = {}
    for name, run in runs.items():
        quantized, float_ = run(case), run(floats)
        error = np.abs(quantized.output - float_.output).max()
        assert 0 < error <= bound + FLOAT32, name
        assert np.abs(quantized.weights - float_.weights).max() <= weights_bound + FLOAT32, name
        outputs[name] = quantized.output
    for name in ("torch", "tf"):
        assert np.abs(outputs[name] - outputs["numpy"]).max() <= 2 * bound + FLOAT32, name


def cache_without_a_scale(file, dtype):
    """A layer of `file` ("numpy", "torch" or "tf"), its (2, 3, 16) input and an int8 or fp8 (`dtype`) cache
    (B = 2, L = 5) missing a scale: NumPy's and TensorFlow's without `key_scale`, PyTorch's with a `value_scale`
    of the wrong shape."""
    x = np.random.default_rng(0).normal(size=(2, 3, 16))
    if file == "numpy":
        layer = numpy_file.MultiHeadAttention(16, 4, seed=0)
        return layer, x, layer.init_cache(2, 5, dtype=dtype)._replace(key_scale=None)
    if file == "torch":
        import torch

        from PyTorch import Multi_Head_Attention as torch_file

        layer = torch_file.MultiHeadAttention(16, 4)
        cache = layer.init_cache(2, 5, dtype=dtype)._replace(value_scale=torch.zeros(2, 4, 5))
        return layer, torch.from_numpy(x).float(), cache
    from TensorFlow import Multi_Head_Attention as tf_file

    layer = tf_file.MultiHeadAttention(16, 4)
    return layer, x.astype(np.float32), layer.init_cache(2, 5, dtype=dtype)._replace(key_scale=None)


def fast_and_general_decodes(monkeypatch, layer, x, init_cache):
    """A PyTorch layer's prompt x[:, :4] then one step per token of the (B, T, E) `x`, on a cache from
    `init_cache()`: first with the decode fast path spied on, then with it stepping aside. Returns whether each
    call took the fast path, and the two runs' (B, T, E) outputs and last caches."""
    import torch

    from PyTorch import Multi_Head_Attention as torch_file

    real, taken = torch_file._decode_step, []

    def spy(*args):
        step = real(*args)
        taken.append(step[0] is not None)
        return step

    def decode():
        with torch.no_grad():
            output, cache = layer(x[:, :4], causal=True, cache=init_cache())
            outputs = [output]
            for i in range(4, x.shape[1]):
                output, cache = layer(x[:, i : i + 1], causal=True, cache=cache)  # (B, 1, E)
                outputs.append(output)
        return torch.cat(outputs, dim=1), cache  # (B, T, E)

    monkeypatch.setattr(torch_file, "_decode_step", spy)
    fast = decode()
    monkeypatch.setattr(torch_file, "_decode_step", lambda *args: (None, None))
    return taken, fast, decode()
