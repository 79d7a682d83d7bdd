"""Generated tests of the layer's seams, as test_properties.py generates the layer's own: random
configurations and calls (T != S, T = 1, S = 0, masks, causal) through

- the converters both ways (`from_torch`/`to_torch`, `from_keras`/`to_keras`, the MHA and GQA
  built-ins with their constructor options): the converted layer computes what its source
  computes on every call both take, else the conversion itself raises ValueError;
- functional models (the TensorFlow file here, the Keras file on each backend in a process of its
  own, shared_tests/keras_seams.py): symbolic output shapes equal the eager ones, and the
  built-in's where it takes the call, with `return_attention`, key and value given or not, a cache;
- warnings: drawn masks holding each habit make every `AttentionMaskWarning` name the calling
  test's line in eager mode, in every file and Keras backend, with any other warning an error;
  where the values cannot be read (`torch.compile`, `tf.function`, `jax.jit`) the call warns
  nothing and equals the eager one.

Few examples by default ("ci"); `--hypothesis-profile=explore` draws ten times more.

Legend: B batch, T query length, S key length, E model width, N query heads, K key/value heads,
H head size, L cache slots.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shared_tests import keras_seams
from shared_tests.cases import TOLERANCES

OUTPUT_TOL = TOLERANCES["float32"]["output"]
WEIGHTS_TOL = TOLERANCES["float32"]["weights"]
FLOAT64_TOL = 1e-10  # a converted float64 layer computes the same sums in another order
# A fifth of the profile's examples (5 in "ci", 50 in "explore"): each builds layers in two frameworks
SEAM = settings(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors],
    max_examples=max(2, settings.default.max_examples // 5),
)  # fmt: skip


def _keep(rng, b, t, s):
    """A random (B, T, S) keep in which every query keeps key 0 (rows with no key are where the
    built-ins and the layer differ by design: NaN or a uniform average against `output_bias`)."""
    keep = rng.random((b, t, s)) < 0.6  # (B, T, S)
    keep[..., :1] = True
    return keep


@st.composite
def shapes(draw, empty_keys=True):
    """(B, T, S): T != S, T = 1 and (with `empty_keys`) S = 0 among them."""
    t = draw(st.sampled_from([1, 1, 2, 3, 5]))
    s = draw(st.sampled_from([0, 1, 3, 4] if empty_keys else [1, 3, 4]))
    return draw(st.integers(1, 2)), t, s


# -------------------------------------------------------------------------------------------------
# from_torch / to_torch
# -------------------------------------------------------------------------------------------------


@st.composite
def torch_modules(draw):
    """Constructor arguments of `torch.nn.MultiheadAttention` (dropout 0: the calls are compared)."""
    heads = draw(st.sampled_from([1, 2, 4]))
    return {
        "embed_dim": heads * draw(st.sampled_from([1, 2, 3])),
        "num_heads": heads,
        "bias": draw(st.booleans()),
        "add_bias_kv": draw(st.sampled_from([False, False, True])),
        "add_zero_attn": draw(st.sampled_from([False, False, True])),
        "kdim": draw(st.sampled_from([None, 3])),
        "vdim": draw(st.sampled_from([None, 5])),
        "batch_first": draw(st.booleans()),
    }


def _torch_call(module, query, key, value, keep, causal):
    """nn.MultiheadAttention's output and per-head weights for `keep` (B, T, S) (True = attend)."""
    import torch

    s = keep.shape[2]
    blocked = ~torch.as_tensor(keep).repeat_interleave(module.num_heads, 0)  # (B*N, T, S), True = ignore
    if not module.batch_first:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))  # (B, L, D) -> (L, B, D)
    output, weights = module(
        query, key, value, attn_mask=blocked if s else None, need_weights=True, average_attn_weights=False,
        is_causal=False,
    )  # fmt: skip
    return (output if module.batch_first else output.transpose(0, 1)), weights


@SEAM
@given(arguments=torch_modules(), shape=shapes(), causal=st.booleans(), seed=st.integers(0, 2**16))
@example(
    arguments={"embed_dim": 4, "num_heads": 2, "bias": True, "add_bias_kv": False, "add_zero_attn": False,
               "kdim": None, "vdim": 5, "batch_first": False},
    shape=(2, 3, 4), causal=True, seed=0,
).via("a module with every bias, T != S")  # fmt: skip
def test_from_torch_and_back_compute_what_the_module_computes(arguments, shape, causal, seed):
    """`from_torch(module)` equals the module on its calls (masks translated: True = attend), and
    `to_torch()` of it equals both; a module with what the layer cannot hold is a ValueError."""
    import torch

    from PyTorch import MultiHeadAttention

    torch.manual_seed(seed)
    module = torch.nn.MultiheadAttention(**arguments, dtype=torch.float64).eval()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_()  # biases too: a dropped bias shows
    if arguments["add_bias_kv"] or arguments["add_zero_attn"]:
        with pytest.raises(ValueError, match=r"`module` uses add_bias_kv or add_zero_attn"):
            MultiHeadAttention.from_torch(module)
        return
    layer = MultiHeadAttention.from_torch(module)
    (b, t, s), e, rng = shape, arguments["embed_dim"], np.random.default_rng(seed)
    query = torch.tensor(rng.normal(size=(b, t, e)))
    key = torch.tensor(rng.normal(size=(b, s, arguments["kdim"] or e)))
    value = torch.tensor(rng.normal(size=(b, s, arguments["vdim"] or e)))
    keep = _keep(rng, b, t, s)
    if causal and s:
        keep &= np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t)  # bottom-right, as `causal=True`
        keep[..., :1] |= ~keep.any(-1, keepdims=True)  # a query before every key keeps key 0
    with torch.no_grad():
        expected, expected_weights = _torch_call(module, query, key, value, keep, False)
        output, weights = layer(query, key, value, attention_mask=torch.as_tensor(keep), return_attention=True)
        torch.testing.assert_close(output, expected, atol=FLOAT64_TOL, rtol=0)
        torch.testing.assert_close(weights, expected_weights, atol=FLOAT64_TOL, rtol=0)
        back = layer.to_torch()
        again, again_weights = _torch_call(back, query, key, value, keep, False)
    torch.testing.assert_close(again, expected, atol=FLOAT64_TOL, rtol=0)
    torch.testing.assert_close(again_weights, expected_weights, atol=FLOAT64_TOL, rtol=0)


@st.composite
def torch_layers(draw):
    """This layer's constructor arguments, variants included (those `to_torch` must refuse)."""
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2]))
    return {
        "d_model": heads * 2 if draw(st.booleans()) else 5,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": 2,
        "kdim": draw(st.sampled_from([None, 3])),
        "vdim": draw(st.sampled_from([None, 5])),
        "bias": draw(st.sampled_from([True, False, ("query", "output")])),
        **draw(st.sampled_from([{}, {}, {"scale": 0.3}, {"softcap": 2.0}, {"window": 2}, {"sinks": True}])),
    }


@SEAM
@given(arguments=torch_layers(), shape=shapes(), seed=st.integers(0, 2**16))
def test_to_torch_and_back_compute_what_the_layer_computes_or_refuse(arguments, shape, seed):
    """`to_torch()` of any layer equals it, or raises ValueError; `from_torch` of the result
    gives the layer back (the same weights)."""
    import torch

    from PyTorch import MultiHeadAttention

    torch.manual_seed(seed)
    layer = MultiHeadAttention(**arguments, dtype=torch.float64)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_()
    try:
        module = layer.to_torch().eval()
    except ValueError:
        return
    (b, t, s), rng = shape, np.random.default_rng(seed)
    query = torch.tensor(rng.normal(size=(b, t, layer.d_model)))
    key, value = torch.tensor(rng.normal(size=(b, s, layer.kdim))), torch.tensor(rng.normal(size=(b, s, layer.vdim)))
    keep = _keep(rng, b, t, s)
    with torch.no_grad():
        expected = layer(query, key, value, attention_mask=torch.as_tensor(keep))
        got, _ = _torch_call(module, query, key, value, keep, False)
    torch.testing.assert_close(got, expected, atol=FLOAT64_TOL, rtol=0)
    again = MultiHeadAttention.from_torch(module).export_weights()
    for name, weight in layer.export_weights().items():
        np.testing.assert_array_equal(again[name], weight, err_msg=name)


# -------------------------------------------------------------------------------------------------
# from_keras / to_keras (the TensorFlow file, and the Keras file on the TensorFlow backend)
# -------------------------------------------------------------------------------------------------


@st.composite
def keras_built_ins(draw):
    """("mha" or "gqa", constructor arguments) of a Keras built-in, options the layer cannot
    hold among them (those `from_keras` must refuse)."""
    kind = draw(st.sampled_from(["mha", "gqa"]))
    refused = [{"kernel_regularizer": "l2"}] + ([{"output_shape": 4}] if kind == "mha" else [])  # the query's is 6
    options = {"use_bias": draw(st.booleans()), **draw(st.sampled_from([{}, {}, {}, {"sliding_window": 2}, *refused]))}
    if kind == "mha":
        key_dim = draw(st.sampled_from([2, 3]))
        value_dim = draw(st.sampled_from([None, None, key_dim + 1]))
        return kind, {"num_heads": draw(st.sampled_from([1, 2])), "key_dim": key_dim, "value_dim": value_dim, **options}
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = {"num_query_heads": kv_heads * draw(st.sampled_from([1, 2])), "num_key_value_heads": kv_heads}
    return kind, {"head_dim": draw(st.sampled_from([2, 3])), **heads, **options}


@pytest.mark.parametrize("module", ["TensorFlow", "Keras"])
@SEAM
@given(built_in=keras_built_ins(), shape=shapes(empty_keys=False), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_from_keras_and_back_compute_what_the_built_in_computes_or_refuse(module, built_in, shape, causal, seed):
    """`from_keras(layer)` equals the built-in on its calls (T != S included; `use_causal_mask`
    where T == S, the one place both align it alike), and `to_keras()` of it equals both; a
    built-in with what the layer cannot hold is a ValueError. With `sliding_window` W the layer is
    built with `window=(W, W)`, for calls with T == S."""
    import keras

    layer_class = __import__(module).MultiHeadAttention
    kind, arguments = built_in
    keras.utils.set_random_seed(seed)
    built = (keras.layers.MultiHeadAttention if kind == "mha" else keras.layers.GroupQueryAttention)(**arguments)
    (b, t, s), width, rng = shape, 6, np.random.default_rng(seed)
    window = arguments.get("sliding_window")
    s = t if window is not None else s  # where the bands agree
    causal = causal and t == s
    query = rng.normal(size=(b, t, width)).astype(np.float32)
    value = rng.normal(size=(b, s, width)).astype(np.float32)
    keep = _keep(rng, b, t, s)
    built(query, value)
    for weight in built.weights:
        weight.assign(rng.normal(size=weight.shape).astype(np.float32))  # biases too: a dropped bias shows
    refused = "output_shape" in arguments or "kernel_regularizer" in arguments or arguments.get("value_dim")
    try:
        layer = layer_class.from_keras(built, window=None if window is None else (window, window))
    except ValueError as error:
        assert refused, error
        return
    assert not refused, arguments
    expected, expected_weights = built(
        query, value, attention_mask=keep, use_causal_mask=causal, return_attention_scores=True
    )
    output, weights = layer(query, key=value, value=value, attention_mask=keep, causal=causal, return_attention=True)
    np.testing.assert_allclose(np.asarray(output), np.asarray(expected), atol=OUTPUT_TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(weights), np.asarray(expected_weights), atol=WEIGHTS_TOL, rtol=0)
    if window is not None:
        with pytest.raises(ValueError, match=r"`layer` must use only options|cannot hold|window"):
            layer.to_keras()
        return
    back = layer.to_keras()
    again = back(query, value, attention_mask=keep, use_causal_mask=causal)
    np.testing.assert_allclose(np.asarray(again), np.asarray(expected), atol=OUTPUT_TOL, rtol=0)


# -------------------------------------------------------------------------------------------------
# Functional models
# -------------------------------------------------------------------------------------------------


@SEAM
@given(data=st.data())
def test_tensorflow_file_symbolic_shapes_hold_the_eager_ones_and_the_built_ins(data):
    """The TensorFlow file on `keras.Input`s: symbolic shapes keep every static dimension, hold
    the eager shapes and equal the built-in's (return_attention, key and value given or not, a
    cache); shared_tests/keras_seams.py holds the check."""
    keras_seams.functional_shapes_hold("TensorFlow", data.draw)


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_keras_file_symbolic_shapes_hold_the_eager_ones_and_the_built_ins(backend):
    """The same for the Keras file on each backend (in the backend's process; on JAX the real call
    under `jax.jit`)."""
    result = keras_seams.results(backend)["functional_shapes"]
    assert result is None, result


# -------------------------------------------------------------------------------------------------
# Warnings
# -------------------------------------------------------------------------------------------------


def _habit_call(layer, tensors, causal):
    return layer(**tensors, causal=causal)  # HABIT_CALL


def _torch_compile(function):
    """`torch.compile` with dynamo's "eager" backend: the layer's check runs (or not) while dynamo
    traces, whatever the backend; inductor adds about 25 s a graph and torch's own
    DeprecationWarnings while it compiles. Dynamo's cache is emptied first: each example's layer is
    a new module, and recompiling one function more than 8 times falls back to eager."""
    import torch

    torch._dynamo.reset()
    return torch.compile(function, backend="eager", fullgraph=True)


def _modes(framework):
    """(layer class, to tensor, to NumPy, compiler or None) of a file in this process."""
    if framework == "numpy":
        from NumPy import MultiHeadAttention

        return MultiHeadAttention, np.asarray, np.asarray, None
    if framework == "torch":
        import torch

        from PyTorch import MultiHeadAttention

        return MultiHeadAttention, torch.as_tensor, lambda x: x.detach().numpy(), _torch_compile
    import tensorflow as tf

    from TensorFlow import MultiHeadAttention

    return MultiHeadAttention, tf.constant, np.asarray, tf.function


@pytest.mark.parametrize("framework", ["numpy", "torch", "tf"])
@SEAM
@given(data=st.data())
def test_attention_mask_warnings_name_the_callers_line_and_compiled_calls_warn_nothing(framework, data):
    """A drawn habit (keras_seams.draw_habit: configurations, T != S, T = 1, masks, causal): in
    eager mode each AttentionMaskWarning names this file's calling line and no other warning is
    raised (warnings as errors); under `torch.compile` and `tf.function` the call emits no warning
    at all and its output equals eager's. The Keras file on each backend: the next test."""
    where = (__file__, keras_seams.marked_line(__file__, "HABIT_CALL"))
    keras_seams.habit_modes_hold(*_modes(framework), _habit_call, where, data.draw)


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_keras_file_attention_mask_warnings_name_the_callers_line_in_every_mode(backend):
    """The same for the Keras file, in its backend's process (`jax.jit`, `tf.function`; torch eager)."""
    result = keras_seams.results(backend)["generated_warnings"]
    assert result is None, result
