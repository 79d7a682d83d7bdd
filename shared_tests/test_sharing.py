"""Shared keys and values (docs/SPEC.md, "Shared keys and values"): the four files against the NumPy
reference (shared_tests/sharing.py), the NumPy backward against finite differences, the weight layouts and
the errors."""

import importlib

import numpy as np
import pytest

from shared_tests import sharing
from shared_tests.cases import FLOAT64_TOLERANCES

TOLERANCE = FLOAT64_TOLERANCES["rope"]  # float64 layers with RoPE (float32 angles in PyTorch, TensorFlow, Keras)
DECODE_TOLERANCE = 1e-12  # NumPy: decoding with a shared cache against the full pass, float64
FD_STEP = 1e-6  # central differences of the float64 NumPy layer
FD_TOLERANCE = 1e-6
FRAMEWORKS = ("NumPy", "PyTorch", "TensorFlow", "Keras")


def _layer_class(framework):
    return importlib.import_module(f"{framework}.Multi_Head_Attention").MultiHeadAttention


@pytest.fixture(scope="module")
def expected():
    return sharing.run("NumPy")


@pytest.mark.parametrize("framework", ["PyTorch", "TensorFlow"])
def test_frameworks_share_like_numpy(framework, expected):
    """Outputs and the gradients of the shared keys and values; the Keras file's: `check_sharing` in
    shared_tests/keras_checks.py, on each backend (test_keras.py)."""
    names = ("producer", "consumer", "decoded", "grad_key", "grad_value")
    sharing.compare(sharing.run(framework), expected, names, TOLERANCE["output"])


def test_numpy_decoding_with_a_shared_cache_equals_the_full_pass(expected):
    decoded = {producer: {"consumer": result["decoded"]} for producer, result in expected.items()}
    sharing.compare(decoded, expected, ("consumer",), DECODE_TOLERANCE)


def _central_difference(f, array, index):
    step = np.zeros_like(array)
    step[index] = FD_STEP
    return (f(array + step) - f(array - step)) / (2 * FD_STEP)


def test_numpy_backward_of_shared_keys_and_values():
    numpy = importlib.import_module("NumPy.Multi_Head_Attention")
    x, y, key_mask, positions = sharing.inputs()
    producer = numpy.MultiHeadAttention(sharing.E, sharing.N, seed=1, **sharing.producer_config("value_norm"))
    consumer = numpy.MultiHeadAttention(sharing.E, sharing.N, seed=2, **sharing.CONSUMER)
    _, (k, v) = producer(x, causal=True, key_mask=key_mask, positions=positions, return_kv=True)
    g = np.random.default_rng(3).normal(size=(sharing.B, sharing.T, sharing.E))

    def loss(k_, v_):
        return (consumer(y, causal=True, key_mask=key_mask, positions=positions, shared_kv=(k_, v_)) * g).sum()

    loss(k, v)
    grads = consumer.backward(g)
    assert set(grads) == {"query", "shared_key", "shared_value", "query_kernel", "query_norm", "output_kernel"} | {
        "query_bias",
        "output_bias",
    }
    for index in [(1, 1, 3, 2), (0, 0, 4, 7)]:
        assert abs(_central_difference(lambda a: loss(a, v), k, index) - grads["shared_key"][index]) < FD_TOLERANCE
        assert abs(_central_difference(lambda a: loss(k, a), v, index) - grads["shared_value"][index]) < FD_TOLERANCE


@pytest.mark.parametrize("producer", ["value_norm", "keys_as_values"])
def test_numpy_backward_of_keys_as_values_and_the_value_norm(producer):
    numpy = importlib.import_module("NumPy.Multi_Head_Attention")
    x, _, key_mask, positions = sharing.inputs()
    config = {**sharing.producer_config(producer), "clip_qkv": 0.5}  # the clamp shared by keys and values
    layer = numpy.MultiHeadAttention(sharing.E, sharing.N, seed=4, **config)
    g = np.random.default_rng(5).normal(size=(sharing.B, sharing.T, sharing.E))

    def loss(x_):
        return (layer(x_, causal=True, key_mask=key_mask, positions=positions) * g).sum()

    loss(x)
    grads = layer.backward(g)
    assert abs(_central_difference(loss, x, (1, 2, 3)) - grads["query"][1, 2, 3]) < FD_TOLERANCE
    kernel = layer.params["key_kernel"]

    def kernel_loss(w):
        layer.params["key_kernel"] = w
        return loss(x)

    assert abs(_central_difference(kernel_loss, kernel, (2, 3)) - grads["key_kernel"][2, 3]) < FD_TOLERANCE
    layer.params["key_kernel"] = kernel


LAYOUTS = {  # the weight names of a layer with bias and QK-norm
    "kv_shared": {"query_kernel", "query_bias", "output_kernel", "output_bias", "query_norm"},
    "keys_as_values": {"query_kernel", "query_bias", "key_kernel", "key_bias", "output_kernel", "output_bias"}
    | {"query_norm", "key_norm"},
}


@pytest.mark.parametrize("framework", FRAMEWORKS[:3])
@pytest.mark.parametrize("option", sorted(LAYOUTS))
def test_weight_layout_without_the_projections_removed(framework, option):
    layer = _layer_class(framework)(16, 4, qk_norm="head", **{option: True})
    assert set(layer.weight_shapes()) == LAYOUTS[option]
    assert layer.bias == (("query", "output") if option == "kv_shared" else ("query", "key", "output"))


ERRORS = [
    ({"kv_shared": True, "value_norm": True}, {}, r"`keys_as_values` and `value_norm` must be False with `kv_shared`"),
    ({"keys_as_values": 1}, {}, r"`keys_as_values` must be True or False\. Received: keys_as_values=1"),
    (
        {"kv_shared": True, "kv_lora_rank": 4, "qk_rope_head_dim": 2, "qk_nope_head_dim": 2, "v_head_dim": 4},
        {},
        r"must be False with `kv_lora_rank`",
    ),
    ({}, {"shared_kv": "pair"}, r"`shared_kv` must be None unless the layer is built with `kv_shared=True`"),
    ({"kv_shared": True}, {}, r"`shared_kv` must be given to a layer built with `kv_shared=True`.*shared_kv=None"),
    ({"kv_shared": True}, {"shared_kv": "short"}, r"`shared_kv` must be a KVCache or a \(k, v\) pair.*\(2, 2, 5, 4\)"),
    ({"kv_shared": True}, {"shared_kv": "pair", "cache": True}, r"`cache` must be None with `shared_kv`"),
]


@pytest.mark.parametrize("framework", FRAMEWORKS[:3])
@pytest.mark.parametrize(("config", "call", "message"), ERRORS)
def test_errors(framework, config, call, message):
    layer_class = _layer_class(framework)
    x = np.random.default_rng(0).normal(size=(2, 5, 16)).astype(np.float32)
    convert = {"PyTorch": importlib.import_module("torch").as_tensor} if framework == "PyTorch" else {}
    tensor = convert.get(framework, lambda a: a)
    pairs = {"pair": (np.zeros((2, 2, 5, 4)), np.zeros((2, 2, 5, 4))), "short": (np.zeros((2, 2, 4, 4)),) * 2}
    with pytest.raises(ValueError, match=message):
        layer = layer_class(16, 4, num_kv_heads=2, **config)
        kwargs = {}
        if "shared_kv" in call:
            kwargs["shared_kv"] = tuple(tensor(a.astype(np.float32)) for a in pairs[call["shared_kv"]])
        if call.get("cache"):
            kwargs["cache"] = layer.init_cache(2, 8)
        layer(tensor(x), **kwargs)
