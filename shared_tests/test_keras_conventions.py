"""Conventions that Keras' own tests check for MultiHeadAttention and GroupQueryAttention, written
for this layer: Keras' layer-test harness over the layer's configurations, `build` with Keras'
attention-layer shapes, `compute_output_spec` outside `__call__` under every dtype policy, `.keras`
files, and honest `from_keras` / `to_keras` (every option the layer cannot hold is refused)."""

import numpy as np
import pytest
import tensorflow as tf
from keras.src.testing import TestCase

from shared_tests.cases import TOLERANCES
from TensorFlow import MultiHeadAttention

keras = tf.keras
OUTPUT_TOL = TOLERANCES["float32"]["output"]
WEIGHTS_TOL = TOLERANCES["float32"]["weights"]
POLICIES = ["float32", "mixed_float16", "mixed_bfloat16", "float64"]
B, T, S, E = 2, 5, 7, 16

rng = np.random.default_rng(0)
X = rng.normal(size=(B, T, E)).astype(np.float32)  # (B, T, E)

# name: (constructor arguments, trainable weights, seed generators)
CONFIGS = {
    "mha": ({}, 8, 0),
    "gqa": ({"num_kv_heads": 2}, 8, 0),
    "mqa": ({"num_kv_heads": 1}, 8, 0),
    "kdim_vdim": ({"kdim": 6, "vdim": 10}, 8, 0),
    "no_bias": ({"bias": False}, 4, 0),
    "head_dim": ({"head_dim": 3, "num_kv_heads": 2}, 8, 0),
    "dropout": ({"dropout": 0.5}, 8, 1),
    "gate": ({"gate": True, "num_kv_heads": 2}, 10, 0),
    "gate_softplus": ({"gate": True, "gate_activation": "softplus", "bias": False}, 5, 0),
}


def _layer(config, **kwargs):
    return MultiHeadAttention(E, 4, **CONFIGS[config][0], **kwargs)


def _shapes(config):
    """Keras' attention-layer build shapes: (B, T, E) query, (B, S, kdim) key, (B, S, vdim) value."""
    arguments = CONFIGS[config][0]
    return {
        "query_shape": (B, T, E),
        "key_shape": (B, S, arguments.get("kdim", E)),
        "value_shape": (B, S, arguments.get("vdim", E)),
    }


def _inputs(config, seed=1):
    local = np.random.default_rng(seed)
    return {
        name[: -len("_shape")]: local.normal(size=shape).astype(np.float32) for name, shape in _shapes(config).items()
    }


@pytest.mark.parametrize("return_attention", [False, True], ids=["output", "with_weights"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_keras_layer_test_harness(config, return_attention):
    """Keras' own `run_layer_test`: config and serialization round trips, `build(**shapes)`,
    weight and seed-generator counts, a symbolic call, an eager call, and the mixed_float16
    check (`compute_output_spec` outside `__call__` has the dtypes of the eager outputs)."""
    arguments, trainable, seed_generators = CONFIGS[config]
    output_shape = (B, T, E)
    TestCase("run_layer_test").run_layer_test(
        MultiHeadAttention,
        init_kwargs={"d_model": E, "num_heads": 4, **arguments},
        input_shape=_shapes(config),
        call_kwargs={"return_attention": return_attention},
        expected_output_shape=(output_shape, (B, 4, T, S)) if return_attention else output_shape,
        expected_num_trainable_weights=trainable,
        expected_num_non_trainable_weights=0,
        expected_num_seed_generators=seed_generators,
        expected_num_losses=0,
        supports_masking=True,
        run_training_check=False,
    )


def test_keras_layer_test_harness_with_training_on_self_attention():
    """The harness's training step (a model calling the layer on one input, `fit` under XLA)."""
    TestCase("run_layer_test").run_layer_test(
        MultiHeadAttention,
        init_kwargs={"d_model": E, "num_heads": 4, "num_kv_heads": 2, "dropout": 0.1},
        input_shape=(B, T, E),
        expected_output_shape=(B, T, E),
        expected_num_trainable_weights=8,
        expected_num_seed_generators=1,
        supports_masking=True,
    )


@pytest.mark.parametrize("return_attention", [False, True], ids=["output", "with_weights"])
@pytest.mark.parametrize("built", [False, True], ids=["unbuilt", "built"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("config", ["mha", "gqa", "kdim_vdim"])
def test_compute_output_spec_outside_call_under_every_policy(config, policy, built, return_attention):
    """Regression: under mixed policies, tracing outside `__call__` (no autocast scope) raised
    `TypeError: Input 'b' of 'MatMul' Op has type float32 that does not match type float16`, and
    mixed_bfloat16 gave float32 specs. The specs have the compute dtype and equal the eager call."""
    layer = _layer(config, dtype=policy)
    inputs = _inputs(config)
    if built:
        layer.build(**_shapes(config))
    specs = {name: keras.KerasTensor(x.shape, dtype=layer.compute_dtype) for name, x in inputs.items()}
    spec = layer.compute_output_spec(**specs, return_attention=return_attention)
    eager = layer(**inputs, return_attention=return_attention)
    specs, eager = (spec, eager) if return_attention else ((spec,), (eager,))
    assert [s.shape for s in specs] == [tuple(e.shape) for e in eager]
    assert [s.dtype for s in specs] == [layer.compute_dtype] * len(eager) == [e.dtype.name for e in eager]
    assert specs[0].shape == layer.compute_output_shape(**_shapes(config)) == (B, T, E)


def test_compute_output_spec_takes_float32_specs_under_a_mixed_policy():
    """Specs as a user makes them (float32): the layer casts them as its call does."""
    layer = MultiHeadAttention(E, 4, dtype="mixed_float16")
    spec = layer.compute_output_spec(keras.KerasTensor((B, T, E)))
    assert spec.shape == (B, T, E) and spec.dtype == "float16"


@pytest.mark.parametrize(
    "build",
    [
        lambda layer: layer.build(),
        lambda layer: layer.build(None),
        lambda layer: layer.build((B, T, E)),  # the old positional input_shape
        lambda layer: layer.build(tf.TensorShape((None, None, E))),
        lambda layer: layer.build((B, T, E), (B, S, 10), (B, S, 6)),  # Keras' order: query, value, key
        lambda layer: layer.build(query_shape=(B, T, E), value_shape=(B, S, 10), key_shape=(B, S, 6)),
        lambda layer: layer.build(query_shape=(None, None, E), key_shape=(None, None, 6), value_shape=(None, 7, 10)),
    ],
    ids=["no_shape", "none", "input_shape", "tensor_shape", "keras_order", "keywords", "unknown_dims"],
)
def test_build_accepts_keras_attention_shapes(build):
    layer = MultiHeadAttention(E, 4, kdim=6, vdim=10)
    build(layer)
    assert layer.built and len(layer.trainable_weights) == 8
    assert (
        layer.query_kernel.shape == (E, E) and layer.key_kernel.shape == (6, E) and layer.value_kernel.shape == (10, E)
    )


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (
            {"query_shape": (B, T, 12)},
            r"`query` must have shape \(B, T, E\) with E=16\. Received: query\.shape=\(2, 5, 12\)",
        ),
        ({"query_shape": (B, E)}, r"`query` must have shape \(B, T, E\) with E=16\. Received: query\.shape=\(2, 16\)"),
        (
            {"query_shape": (B, T, E), "value_shape": (B, S, 6), "key_shape": (B, S, 10)},
            r"`key` must have shape \(B, S, kdim\) with kdim=6\. Received: key\.shape=\(2, 7, 10\)",
        ),
        (
            {"query_shape": (B, T, E), "key_shape": (B, S, 6)},  # value defaults to key, as in the call
            r"`value` must have shape \(B, S, vdim\) with vdim=10\. Received: value\.shape=\(2, 7, 6\)",
        ),
        (
            {"query_shape": (B, T, E), "value_shape": (B, S, 10), "key_shape": (B, S + 1, 6)},
            r"`key` and `value` must have the same length S\. Received: key\.shape=\(2, 8, 6\), value\.shape=\(2, 7, 10\)",
        ),
        (
            {"query_shape": (3, T, E), "value_shape": (B, S, 10), "key_shape": (B, S, 6)},
            r"`query`, `key` and `value` must have the same batch size B\. Received: query\.shape=\(3, 5, 16\)",
        ),
    ],
    ids=["query_width", "query_rank", "key_value_swapped", "value_defaults_to_key", "lengths", "batch"],
)
@pytest.mark.parametrize("method", ["build", "compute_output_shape"])
def test_shapes_that_do_not_match_the_constructor_are_value_errors(method, shapes, message):
    layer = MultiHeadAttention(E, 4, kdim=6, vdim=10)
    with pytest.raises(ValueError, match=message):
        getattr(layer, method)(**shapes)
    assert not layer.built


@pytest.mark.parametrize("config", list(CONFIGS))
def test_keras_file_round_trip(config, tmp_path):
    """A functional model with every input of the layer saved to `.keras` and loaded: same
    outputs and weights; the loaded layer was rebuilt from its recorded build shapes."""
    inputs = _inputs(config)
    symbolic = {name: keras.Input(x.shape[1:], name=name) for name, x in inputs.items()}
    output, weights = _layer(config, name="attention")(**symbolic, return_attention=True)
    model = keras.Model(symbolic, [output, weights])
    expected = model(inputs)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    for got, want in zip(loaded(inputs), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    original, revived = model.get_layer("attention"), loaded.get_layer("attention")
    recorded = [
        {name: tuple(shape) for name, shape in layer.get_build_config()["shapes_dict"].items()}
        for layer in (revived, original)
    ]
    assert recorded[0] == recorded[1] == {name: (None, *shape[1:]) for name, shape in _shapes(config).items()}
    for name, value in original.export_weights().items():
        np.testing.assert_array_equal(revived.export_weights()[name], value)


def _built(layer, query, value, key=None):
    layer(query, value, key)
    for variable in layer.weights:
        if variable.name.endswith("bias"):
            variable.assign(rng.normal(scale=0.1, size=variable.shape).astype(np.float32))
    return layer


# option: (MultiHeadAttention arguments, GroupQueryAttention arguments, the value quoted)
REFUSED = {
    "kernel_regularizer": ({"kernel_regularizer": "l2"}, {"kernel_regularizer": "l2"}, "kernel_regularizer=L2"),
    "bias_regularizer": ({"bias_regularizer": "l1"}, {"bias_regularizer": "l1"}, "bias_regularizer=L1"),
    "activity_regularizer": (
        {"activity_regularizer": "l2"},
        {"activity_regularizer": "l2"},
        "activity_regularizer=L2",
    ),
    "kernel_constraint": ({"kernel_constraint": "unit_norm"}, {"kernel_constraint": "unit_norm"}, "UnitNorm"),
    "bias_constraint": ({"bias_constraint": "non_neg"}, {"bias_constraint": "non_neg"}, "bias_constraint=NonNeg"),
    "value_dim": ({"value_dim": 3}, None, "value_dim=3"),
    "output_shape": ({"output_shape": 5}, None, r"output_shape=\(5,\)"),
}


def _keras_builtin(kind, arguments, query=X, key=X):
    if kind == "mha":
        return _built(keras.layers.MultiHeadAttention(4, 4, **arguments), query, key)
    return _built(keras.layers.GroupQueryAttention(4, 4, 2, **arguments), query, key)


def _refused(kind):
    """The options of REFUSED that the built-in `kind` has, with their arguments."""
    column = 0 if kind == "mha" else 1
    return {option: (row[column], row[2]) for option, row in REFUSED.items() if row[column] is not None}


@pytest.mark.parametrize(("kind", "option"), [(kind, option) for kind in ("mha", "gqa") for option in _refused(kind)])
def test_from_keras_refuses_each_option_it_cannot_hold(kind, option):
    """Regression: the MultiHeadAttention route converted a gate or a sliding window silently
    (then differing by 0.80 and 1.58); now both routes refuse every such option."""
    arguments, quoted = _refused(kind)[option]
    with pytest.raises(ValueError, match=rf"^`layer` must use only options this layer can hold; it uses {option} .*"
                       rf"Received: .*{quoted}"):  # fmt: skip
        MultiHeadAttention.from_keras(_keras_builtin(kind, arguments))


@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_from_keras_lists_every_option_it_cannot_hold_in_one_message(kind):
    refused = _refused(kind)
    arguments = {name: value for arguments, _ in refused.values() for name, value in arguments.items()}
    with pytest.raises(ValueError) as error:
        MultiHeadAttention.from_keras(_keras_builtin(kind, arguments))
    reasons, received = str(error.value).split(". Received: ")
    for option in refused:
        assert f" {option} (" in reasons and (received.startswith(f"{option}=") or f", {option}=" in received)


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_from_keras_and_to_keras_hold_use_gate(kind, use_bias):
    """Keras' `use_gate=True` is `gate=True` (its (E, N, H) gate kernel is `gate_kernel`, its bias
    `gate_bias` with `use_bias`): the same outputs both ways, in cross-attention and in causal
    self-attention."""
    key = rng.normal(size=(B, S, E)).astype(np.float32)
    builtin = _keras_builtin(kind, {"use_gate": True, "use_bias": use_bias}, X, key)
    layer = MultiHeadAttention.from_keras(builtin)
    assert layer.gate and ("gate" in layer.bias) == use_bias
    back = layer.to_keras()
    assert back.get_config()["use_gate"] and type(back) is type(builtin)
    for mine, theirs in ((layer, builtin), (layer, back)):
        np.testing.assert_allclose(mine(X, key), theirs(X, key), atol=OUTPUT_TOL, rtol=0)
        expected = theirs(X, X, use_causal_mask=True)
        np.testing.assert_allclose(mine(X, causal=True), expected, atol=OUTPUT_TOL, rtol=0)


def test_from_keras_holds_the_sliding_window_as_a_window_pair():
    """Keras' sliding_window W keeps |t - s| < W on both sides of the query, with or without
    use_causal_mask: `from_keras(layer, window=(W, W))` gives the layer that window, which keeps
    the same keys where T == S (and with `causal=True` those before the query). Pinned against
    Keras' own numbers."""
    builtin = _keras_builtin("mha", {"sliding_window": 3})
    layer = MultiHeadAttention.from_keras(builtin, window=(3, 3))
    assert layer.window == (3, 3)
    for causal in (False, True):
        expected, expected_w = builtin(X, X, use_causal_mask=causal, return_attention_scores=True)
        output, weights = layer(X, causal=causal, return_attention=True)
        np.testing.assert_allclose(output, expected, atol=OUTPUT_TOL, rtol=0)
        np.testing.assert_allclose(weights, expected_w, atol=WEIGHTS_TOL, rtol=0)
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    _, both_sides = builtin(X, X, return_attention_scores=True)  # without the causal mask: a symmetric band
    np.testing.assert_array_equal(both_sides.numpy()[0, 0] > 0, np.abs(t - s) < 3)


@pytest.mark.parametrize(
    ("arguments", "query", "received"),
    [
        ({"attention_axes": (1, 2)}, np.ones((2, 3, 4, 8), np.float32), r"attention_axes=\(1, 2\)"),
        ({"attention_axes": 2}, np.ones((2, 3, 4, 8), np.float32), r"attention_axes=\(2,\)"),
        ({"attention_axes": 1}, np.ones((2, 3, 4, 8), np.float32), r"attention_axes=\(1,\)"),
    ],
    ids=["default_on_4d", "last_but_one_on_4d", "axis_1_on_4d"],
)
def test_from_keras_refuses_other_attention_axes(arguments, query, received):
    builtin = _keras_builtin("mha", arguments, query, query)
    with pytest.raises(ValueError, match=rf"it uses attention_axes \(attention over axis 1 of 3-D inputs; it has 4-D "
                       rf"inputs\)\. Received: {received}$"):  # fmt: skip
        MultiHeadAttention.from_keras(builtin)


def test_from_keras_refuses_quantized_projections():
    builtin = _keras_builtin("mha", {})
    builtin._query_dense.quantize("int8")
    with pytest.raises(
        ValueError, match=r"query\.quantization_mode \(float kernels\)\. Received: query\.quantization_mode=int8"
    ):
        MultiHeadAttention.from_keras(builtin)


@pytest.mark.parametrize(
    "arguments",
    [{"attention_axes": 1}, {"attention_axes": -2}, {"output_shape": E}, {"output_shape": (E,)}, {"seed": 3}],
    ids=["axis_1", "axis_minus_2", "output_shape_int", "output_shape_tuple", "seed"],
)
def test_from_keras_accepts_options_that_equal_the_defaults(arguments):
    builtin = _keras_builtin("mha", arguments)
    layer = MultiHeadAttention.from_keras(builtin)
    np.testing.assert_allclose(layer(X), builtin(X, X), atol=OUTPUT_TOL, rtol=0)


@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_from_keras_keeps_policy_initializers_and_trainable_and_merges_lora(kind):
    builtin = _keras_builtin(kind, {"kernel_initializer": "he_normal", "dtype": "float64"})
    builtin._value_dense.enable_lora(2)
    builtin._value_dense.lora_kernel_b.assign(rng.normal(size=builtin._value_dense.lora_kernel_b.shape))
    builtin.trainable = False
    layer = MultiHeadAttention.from_keras(builtin)
    assert layer.dtype_policy.name == "float64" and not layer.trainable
    assert type(layer.kernel_initializer).__name__ == "HeNormal"
    np.testing.assert_allclose(layer(X), builtin(X, X), atol=OUTPUT_TOL, rtol=0)


@pytest.mark.parametrize(("kdim", "vdim"), [(3, E), (E, 6), (3, 6)])
def test_group_query_attention_round_trips_with_other_key_and_value_widths(kdim, vdim):
    """Regression: `to_keras()` refused K < N with kdim or vdim != d_model ("needs kdim == vdim ==
    d_model"), though GroupQueryAttention builds with them, so `from_keras(gqa).to_keras()` failed
    on a layer `from_keras` had accepted."""
    key = rng.normal(size=(B, S, kdim)).astype(np.float32)
    value = rng.normal(size=(B, S, vdim)).astype(np.float32)
    builtin = _built(keras.layers.GroupQueryAttention(4, 4, 2), X, value, key)
    layer = MultiHeadAttention.from_keras(builtin)
    assert (layer.kdim, layer.vdim, layer.num_kv_heads) == (kdim, vdim, 2)
    back = layer.to_keras()
    assert type(back) is keras.layers.GroupQueryAttention
    expected, expected_w = builtin(X, value, key, return_attention_scores=True)
    for keras_layer in (builtin, back):
        got, got_w = keras_layer(X, value, key, return_attention_scores=True)
        np.testing.assert_allclose(got, expected, atol=OUTPUT_TOL, rtol=0)
        np.testing.assert_allclose(got_w, expected_w, atol=WEIGHTS_TOL, rtol=0)
    output, weights = layer(X, key=key, value=value, return_attention=True)
    np.testing.assert_allclose(output, expected, atol=OUTPUT_TOL, rtol=0)
    np.testing.assert_allclose(weights, expected_w, atol=WEIGHTS_TOL, rtol=0)
    for name, array in layer.export_weights().items():
        np.testing.assert_array_equal(MultiHeadAttention.from_keras(back).export_weights()[name], array)


@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_to_keras_keeps_policy_initializers_and_trainable(kind):
    layer = MultiHeadAttention(
        E, 4, num_kv_heads=4 if kind == "mha" else 2, kernel_initializer="he_normal", dtype="float64"
    )
    layer.trainable = False
    builtin = layer.to_keras()
    assert builtin.dtype_policy.name == "float64" and not builtin.trainable
    assert type(builtin.get_config()["kernel_initializer"]) is dict
    assert builtin.get_config()["kernel_initializer"]["class_name"] == "HeNormal"


@pytest.mark.parametrize(
    ("attribute", "value"),
    [("softcap", 30.0), ("window", 4), ("rope_theta", 10000.0), ("qk_norm", "head"), ("sinks", True), ("scale", 1.0),
     ("bias", ("query", "key", "value")), ("clip_qkv", 0.5)],
)  # fmt: skip
def test_to_keras_refuses_the_variants_the_builtins_cannot_hold(attribute, value):
    """The variants of docs/SPEC.md, set here on the attributes the constructor keeps them in."""
    layer = MultiHeadAttention(E, 4)
    setattr(layer, attribute, value)
    with pytest.raises(
        ValueError, match=rf"^`to_keras` needs a layer the Keras built-ins can hold.*Received: {attribute}="
    ):
        layer.to_keras()


def test_keras_fully_masked_rows_depend_on_its_code_path():
    """What the README says of Keras 3.15: a query row with every key masked gets weights 0 and
    outputs the output bias only on its explicit path (return_attention_scores=True, or
    dropout > 0); its default path (ops.dot_product_attention) attends every key uniformly."""
    builtin = _keras_builtin("mha", {})
    keep = np.ones((B, T, T), bool)
    keep[0, 1] = False
    bias = builtin._output_dense.bias.numpy()
    explicit, weights = builtin(X, X, attention_mask=keep, return_attention_scores=True)
    np.testing.assert_allclose(explicit[0, 1], bias, atol=OUTPUT_TOL, rtol=0)
    assert (weights.numpy()[0, :, 1] == 0).all()
    default = builtin(X, X, attention_mask=keep)
    values = builtin._value_dense(X).numpy()[0].mean(0)  # (N, H): uniform weights over the keys
    np.testing.assert_allclose(default[0, 1], np.einsum("nh,nhe->e", values, builtin._output_dense.kernel) + bias,
                               atol=OUTPUT_TOL, rtol=0)  # fmt: skip
    assert np.abs(default[0, 1] - bias).max() > 0.1
    layer = MultiHeadAttention.from_keras(builtin)
    for return_attention in (False, True):  # this layer: the output bias on every path
        output = layer(X, attention_mask=keep, return_attention=return_attention)
        output = output[0] if return_attention else output
        np.testing.assert_array_equal(output[0, 1], layer.output_bias.numpy())


def _embedded(ids, vocabulary, seed):
    """Token ids through `Embedding(mask_zero=True)`: (B, L, E) carrying its implicit (B, L) mask."""
    return keras.layers.Embedding(
        vocabulary, E, mask_zero=True, embeddings_initializer=keras.initializers.RandomNormal(seed=seed)
    )(ids)


def test_keras_masking_test_ported_query_and_value_masks_are_the_explicit_mask():
    """Keras' own `test_masking`: the implicit masks of an `Embedding(mask_zero=True)` query and
    value equal the (B, T, S) mask written by hand, and the call is `layer(query=..., value=...)`."""
    query_ids = np.array([[1, 2, 3, 0, 0], [3, 3, 1, 1, 2], [1, 0, 0, 0, 0]])
    value_ids = np.array([[5, 4, 0], [3, 0, 0], [2, 1, 1]])
    query, value = _embedded(query_ids, 4, 0), _embedded(value_ids, 6, 1)
    layer = MultiHeadAttention(E, 2)
    implicit = layer(query=query, value=value)
    mask = (query_ids > 0)[:, :, None] & (value_ids > 0)[:, None, :]  # (B, T, S)
    plain_query, plain_value = tf.identity(query), tf.identity(value)  # no implicit masks
    np.testing.assert_allclose(implicit, layer(plain_query, value=plain_value, attention_mask=mask), atol=OUTPUT_TOL)
    np.testing.assert_array_equal(implicit._keras_mask, query_ids > 0)  # the query's mask goes on


@pytest.mark.parametrize("mask_name", ["mask", "attention_mask"])
def test_an_implicit_mask_is_never_read_as_an_explicit_mask(mask_name, tmp_path):
    """With `Embedding(mask_zero=True)` inputs in a functional model, an explicit `mask=` is the
    attention mask, ANDed with the inputs' implicit masks, and without one Keras' propagated mask
    is never taken for an attention mask; a saved model reloads with the same numbers."""
    ids = keras.Input((4,), dtype="int32")
    embedding = keras.layers.Embedding(10, E, mask_zero=True)
    x = embedding(ids)
    layer = MultiHeadAttention(E, 4)
    causal = np.tril(np.ones((4, 4), bool))
    model = keras.Model(ids, [layer(x, x, x, **{mask_name: causal}), layer(x)])
    tokens = np.array([[1, 2, 3, 0], [4, 5, 0, 0]])
    explicit, implicit = model(tokens)
    keep = tokens > 0
    plain = tf.identity(embedding(tokens))  # the same embeddings, without an implicit mask
    expected = layer(plain, attention_mask=causal[None] & keep[:, None, :], query_mask=keep)
    np.testing.assert_allclose(explicit, expected, atol=OUTPUT_TOL)
    np.testing.assert_allclose(implicit, layer(plain, key_mask=keep, query_mask=keep), atol=OUTPUT_TOL)
    assert not np.allclose(explicit, implicit, atol=1e-3)  # the causal mask mattered
    model.save(tmp_path / "model.keras")
    reloaded = keras.models.load_model(tmp_path / "model.keras")
    for got, want in zip(reloaded(tokens), (explicit, implicit), strict=True):
        np.testing.assert_allclose(got, want, atol=OUTPUT_TOL)


def test_keras_positional_call_of_query_and_value_is_the_same_here():
    """Keras' tests call `layer(query, value)`: one second input is both key and value in both."""
    builtin = keras.layers.MultiHeadAttention(num_heads=4, key_dim=E // 4)
    value = rng.normal(size=(B, S, E)).astype(np.float32)
    expected = builtin(X, value)
    layer = MultiHeadAttention.from_keras(builtin)
    np.testing.assert_allclose(layer(X, value), expected, atol=OUTPUT_TOL)
