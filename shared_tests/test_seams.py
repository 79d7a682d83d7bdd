"""Regression tests for the defects found at the layer's seams (a converter, a Keras functional
model, Python's warnings machinery, a `transformers` subclass, a speed path); each test names
its bug. The Keras file runs here on the TensorFlow backend (test_seam_properties.py runs the
other backends, each in a process of its own).

Legend: B batch, T query length, S key length, E model width, N query heads, H head size.
"""

import re

import numpy as np
import pytest

from NumPy import MultiHeadAttention as NumpyMultiHeadAttention
from shared_tests import keras_seams
from shared_tests.cases import TOLERANCES

OUTPUT_TOL = TOLERANCES["float32"]["output"]
rng = np.random.default_rng(0)
KERAS_FRAME = re.compile(r"Exception encountered when calling .*?\x1b\[1m(.*?)\x1b\[0m", re.DOTALL)


def _message(error):
    """The layer's own message, without Keras' frame around errors raised in `call()`."""
    framed = KERAS_FRAME.match(str(error))
    return framed.group(1) if framed else str(error)


def _layers(framework):
    if framework == "numpy":
        return NumpyMultiHeadAttention, np.asarray
    if framework == "torch":
        import torch

        from PyTorch import MultiHeadAttention

        return MultiHeadAttention, torch.as_tensor
    import tensorflow as tf

    return __import__("TensorFlow" if framework == "tf" else "Keras").MultiHeadAttention, tf.constant


FRAMEWORKS = ("numpy", "torch", "tf", "keras")


@pytest.mark.parametrize(
    ("argument", "pattern"),
    [
        ("attention_mask", r"`attention_mask` must be boolean \(True = attend; for a 0/1 integer mask pass `mask > 0`\) "
                           r"or floating\. Received: attention_mask\.dtype=(str96|string)"),
        ("attention_bias", r"`attention_bias` must be floating\. Received: attention_bias\.dtype=(str96|string)"),
        ("key_mask", r"`key_mask` must be a boolean tensor of shape \(B, S\)=\(2, 5\)\. "
                     r"Received: key_mask\.shape=\(\), key_mask\.dtype=(str96|string)"),
    ],
)  # fmt: skip
def test_regression_a_mask_of_strings_raised_typeerror_in_pytorch(argument, pattern):
    """`attention_mask="abc"` raised torch's TypeError ("new(): invalid data type 'str'") in the
    PyTorch file and a ValueError elsewhere: now the same ValueError text in every file (the
    dtype's name is each framework's own)."""
    query, key = rng.normal(size=(2, 3, 8)).astype(np.float32), rng.normal(size=(2, 5, 8)).astype(np.float32)
    messages = set()
    for framework in FRAMEWORKS:
        layer, tensor = _layers(framework)
        with pytest.raises(ValueError, match=pattern) as error:
            layer(8, 2)(tensor(query), key=tensor(key), value=tensor(key), **{argument: "abc"})
        messages.add(re.sub(r"dtype=\w+", "dtype=?", _message(error.value)))
    assert len(messages) == 1, messages


def test_regression_sinks_on_the_sdpa_path_crashed_with_no_keys():
    """PyTorch's SDPA path with `sinks=True` and S = 0 raised RuntimeError (the sink key was cut
    from the empty keys); the sink alone takes the softmax, so the output is `output_bias`, as on
    the explicit path."""
    import torch

    from PyTorch import MultiHeadAttention

    layer = MultiHeadAttention(8, 2, sinks=True).eval()
    with torch.no_grad():
        layer.sinks.normal_()
        layer.output.bias.normal_()
        query, empty = torch.randn(2, 3, 8), torch.randn(2, 0, 8)
        sdpa = layer(query, empty, empty)  # (B, T, E)
        explicit, _ = layer(query, empty, empty, return_attention=True)
    torch.testing.assert_close(sdpa, explicit, atol=OUTPUT_TOL, rtol=0)
    torch.testing.assert_close(sdpa, layer.output.bias.expand(2, 3, 8), atol=OUTPUT_TOL, rtol=0)


@pytest.mark.parametrize("num_kv_heads", [None, 2])
@pytest.mark.parametrize("module", ["TensorFlow", "Keras"])
def test_regression_tensorflow_file_lost_the_static_query_length_in_a_functional_model(module, num_kv_heads):
    """The TensorFlow file's symbolic output was (None, None, E): the memory-efficient branch
    (`tf.cond`, taken where B is unknown) lost T, and Flatten + Dense failed to build."""
    import keras

    layer = __import__(module).MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads)
    query, value = keras.Input((10, 32)), keras.Input((15, 32))
    output = layer(query, key=value, value=value)
    assert tuple(output.shape) == (None, 10, 32) == tuple(keras.layers.MultiHeadAttention(4, 8)(query, value).shape)
    model = keras.Model([query, value], keras.layers.Dense(3)(keras.layers.Flatten()(output)))
    assert tuple(model.output.shape) == (None, 3)


def _llama_attention(attention_class=None, projection_class=None):
    """A tiny LlamaAttention (GQA), of `attention_class` (a subclass) and with a q_proj of `projection_class`."""
    import torch
    import transformers
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = transformers.LlamaConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, num_hidden_layers=1,
        vocab_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    module = (attention_class or LlamaAttention)(config, layer_idx=0)
    if projection_class is not None:
        projection = projection_class(32, 32, bias=False)
        projection.load_state_dict(module.q_proj.state_dict())
        module.q_proj = projection
    return module, config


def test_regression_port_attention_refused_a_subclass_that_overrides_nothing():
    """`class MyAttention(LlamaAttention): pass` (and a `nn.Linear` subclass with nothing overridden
    as a projection) was refused as a custom projection named ``; it computes what LlamaAttention
    computes, so it ports to the same layer. Overriding `forward` is still refused."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaAttention

    from interop.hf import port_attention

    class MyAttention(LlamaAttention):
        pass

    class MyLinear(torch.nn.Linear):
        pass

    class DoubledLinear(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    expected_kwargs, expected = port_attention(*_llama_attention())
    for module, config in (_llama_attention(MyAttention), _llama_attention(MyAttention, MyLinear)):
        kwargs, weights = port_attention(module, config)
        assert kwargs == expected_kwargs
        assert weights.keys() == expected.keys()
        for name, value in weights.items():
            np.testing.assert_array_equal(value, expected[name], err_msg=name)
    pattern = r"Received: `q_proj` is DoubledLinear from .*, with the forward of DoubledLinear from "
    with pytest.raises(ValueError, match=pattern):
        port_attention(*_llama_attention(MyAttention, DoubledLinear))


HABIT = np.triu(np.ones((4, 4), bool), 1)  # (T, S): nn.MultiheadAttention's causal attn_mask (True = blocked)


def _assert_located(caught, line):
    places = [(type(w.message).__name__, w.filename, w.lineno) for w in caught]
    assert places == [("AttentionMaskWarning", __file__, line)]


@pytest.mark.parametrize("framework", ["numpy", "torch", "tf", "keras"])
def test_regression_attention_mask_warning_named_torch_or_the_layer_file(framework):
    """AttentionMaskWarning named torch/nn/modules/module.py (PyTorch) or a line of the layer file
    (TensorFlow, Keras): it names the caller's line, also where the call sits in a module or
    layer of the user's (the framework's `__call__` frames between)."""
    import sys
    import warnings

    layer_class, tensor = _layers(framework)
    x = tensor(rng.normal(size=(2, 4, 16)).astype(np.float32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        layer_class(16, 2)(x, attention_mask=tensor(HABIT))
    _assert_located(caught, line)
    if framework == "numpy":
        return
    base = __import__("torch").nn.Module if framework == "torch" else __import__("keras").layers.Layer
    attention = layer_class(16, 2)

    class Outer(base):
        def __init__(self):
            super().__init__()
            self.attention = attention

        def forward(self, x):
            return self.attention(x, attention_mask=tensor(HABIT))

        call = forward

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Outer()(x)
    _assert_located(caught, Outer.forward.__code__.co_firstlineno + 1)


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_regression_keras_file_warned_at_its_own_line_and_raised_under_warnings_as_errors(backend):
    """On each backend (a process each): the warning names the caller's line, and under
    `warnings.simplefilter("error")` a masked call raised NumPy's DeprecationWarning (the habit
    check read the mask with `ops.convert_to_numpy`, on torch and TensorFlow)."""
    results = keras_seams.results(backend)
    assert results["warning_location"] is None, results["warning_location"]
    assert results["warnings_as_errors"] is None, results["warnings_as_errors"]


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_regression_keras_file_refused_an_unknown_query_length_with_a_cache_on_torch(backend):
    """A functional model of the Keras file with an unknown T and a cache failed to build on torch:
    Keras traces the call with T made 83, and the cache's room check read the real index and
    refused it ("`cache` is full: ... T=83, L=3"). Now no value is read while Keras infers shapes
    (checked on each backend, in its process; keras_seams.symbolic_length_with_cache)."""
    result = keras_seams.results(backend)["symbolic_length_with_cache"]
    assert result is None, result


def test_tensorflow_file_builds_an_unknown_query_length_with_a_cache():
    """The same seam in the TensorFlow file: the functional model builds with T unknown, and the
    traced call refuses a T that does not fit at run time (a graph's assertion)."""
    import keras
    import tensorflow as tf

    from TensorFlow import MultiHeadAttention

    layer = MultiHeadAttention(4, 2, num_kv_heads=1)
    cache = layer.init_cache(1, 3)
    output, new_cache = layer(keras.Input(batch_shape=(1, None, 4)), cache=cache, causal=True)
    assert tuple(output.shape) == (1, None, 4)
    shapes = [tuple(getattr(new_cache, name).shape) for name in ("key", "value", "keep", "index", "segment_ids")]
    assert shapes == [(1, 1, 3, 2), (1, 1, 3, 2), (1, 3), (), (1, 0)]  # no segment ids written: (B, 0)
    step = tf.function(lambda x: layer(x, cache=cache, causal=True)[0], input_signature=[tf.TensorSpec((1, None, 4))])
    assert tuple(step(tf.ones((1, 2, 4))).shape) == (1, 2, 4)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"`cache` is full"):
        step(tf.ones((1, 4, 4)))


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_regression_keras_file_computed_float64_in_float32_on_torch_and_mla_decode_mixed_them(backend):
    """A float64 Keras-file layer on torch computed in float32: Keras' `ops.matmul` there (and
    `ops.dot_product_attention` on torch and JAX) narrows float64, so outputs came back float32 or
    float32-accurate, and MLA's absorbed decode (`absorb_latents`, a cache and T <= 8) met float32
    queries with the float64 latent cache (reported as "expected scalar type Double but found
    Float"). Now float64 on every path and backend (JAX with x64; keras_seams.float64_throughout)."""
    result = keras_seams.results(backend)["float64_throughout"]
    assert result is None, result


@pytest.mark.parametrize("module", ["TensorFlow", "Keras"])
def test_regression_from_keras_sliding_window_silently_differed_where_t_and_s_differ(module):
    """`from_keras` of a built-in with `sliding_window` W gave `window=(W, W)` silently: Keras counts
    its band from the first query and key, the layer from the last, so at T != S they differed (by
    up to 4). Now refused unless `window=(W, W)` says the layer is for T == S, where they agree."""
    import keras

    layer_class = __import__(module).MultiHeadAttention
    built_in = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, sliding_window=2)
    query, value = rng.normal(size=(2, 5, 16)).astype(np.float32), rng.normal(size=(2, 3, 16)).astype(np.float32)
    built_in(query, value)
    with pytest.raises(ValueError, match=r"For such calls \(self-attention\) pass `window=\(2, 2\)` to `from_keras`\. "
                       r"Received: sliding_window=2$"):  # fmt: skip
        layer_class.from_keras(built_in)
    for window in ((2, 3), 2):
        with pytest.raises(ValueError, match=r"Expected: window=\(2, 2\)\. Received: window="):
            layer_class.from_keras(built_in, window=window)
    plain = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    plain(query, value)
    with pytest.raises(ValueError, match=r"Expected: window=None\. Received: window=\(2, 2\)"):
        layer_class.from_keras(plain, window=(2, 2))
    layer = layer_class.from_keras(built_in, window=(2, 2))
    for t in (1, 5):
        x = query[:, :t]
        np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(built_in(x, x)), atol=OUTPUT_TOL, rtol=0)


def test_a_padding_mask_passed_as_attention_mask_is_sent_to_key_mask():
    """A 2-D `attention_mask` shaped (B, S) where (T, S) is expected (B != T): the ValueError says
    that padding goes in `key_mask`, with the same text in every file; a (T, S) misfit does not."""
    query, key = rng.normal(size=(2, 3, 8)).astype(np.float32), rng.normal(size=(2, 5, 8)).astype(np.float32)
    hint = r"each dimension full or 1\. A \(B, S\) padding mask goes in `key_mask` \(True = a real key\)\. "
    messages = set()
    for framework in FRAMEWORKS:
        layer_class, tensor = _layers(framework)
        layer = layer_class(8, 2)
        with pytest.raises(ValueError, match=hint + r"Expected: \(B, N, T, S\)=\(2, 2, 3, 5\)\. "
                           r"Received: attention_mask\.shape=\(2, 5\)") as error:  # fmt: skip
            layer(tensor(query), key=tensor(key), value=tensor(key), attention_mask=tensor(np.ones((2, 5), bool)))
        messages.add(_message(error.value))
        with pytest.raises(ValueError, match=r"full or 1\. Expected") as error:
            layer(tensor(query), key=tensor(key), value=tensor(key), attention_mask=tensor(np.ones((3, 4), bool)))
    assert len(messages) == 1, messages
