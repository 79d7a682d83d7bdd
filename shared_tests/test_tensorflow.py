"""TensorFlow layer: Keras built-ins interop, implicit masks, serialization, saving, mixed
precision, graph mode and XLA, unknown shapes, dropout."""

import inspect

import numpy as np
import pytest
import tensorflow as tf

from shared_tests.cases import FLOAT64_TOLERANCES, TOLERANCES
from TensorFlow import MultiHeadAttention

keras = tf.keras
OUTPUT_TOL = TOLERANCES["float32"]["output"]
WEIGHTS_TOL = TOLERANCES["float32"]["weights"]
GRAD_TOL = TOLERANCES["float32"]["grads"]
SUM_TOL = 1e-5  # float32 rounding of a sum, relative to the sum of its terms' sizes
MIXED_TOL = {"mixed_float16": TOLERANCES["float16"]["output"], "mixed_bfloat16": TOLERANCES["bfloat16"]["output"]}

rng = np.random.default_rng(0)
X = rng.normal(size=(2, 5, 16)).astype(np.float32)  # (B, T, E)
Y = rng.normal(size=(2, 7, 16)).astype(np.float32)  # (B, S, E)


def _with_random_biases(layer):
    for variable in layer.weights:
        if variable.name.endswith("bias"):
            variable.assign(rng.normal(scale=0.1, size=variable.shape).astype(np.float32))
    return layer


def _built(layer, *args, **kwargs):
    layer(*args, **kwargs)
    return _with_random_biases(layer)


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=tol, rtol=0)


@pytest.mark.parametrize("cross", [False, True])
def test_from_keras_multi_head_attention(cross):
    builtin = _built(keras.layers.MultiHeadAttention(4, 4), X, Y if cross else X)
    layer = MultiHeadAttention.from_keras(builtin)
    key = Y if cross else X
    keep = rng.random((2, 5, key.shape[1])) < 0.7
    keep[0, 3] = False  # a row with no key: Keras 3 gives it zero weights too
    expected, expected_w = builtin(X, key, attention_mask=keep, return_attention_scores=True)
    output, weights = layer(X, key, attention_mask=keep, return_attention=True)
    _close(output, expected, OUTPUT_TOL)
    _close(weights, expected_w, WEIGHTS_TOL)


def test_causal_matches_keras_use_causal_mask():
    builtin = _built(keras.layers.MultiHeadAttention(4, 4), X, X)
    layer = MultiHeadAttention.from_keras(builtin)
    expected, expected_w = builtin(X, X, use_causal_mask=True, return_attention_scores=True)
    output, weights = layer(X, causal=True, return_attention=True)
    _close(output, expected, OUTPUT_TOL)
    _close(weights, expected_w, WEIGHTS_TOL)


def test_regression_causal_is_bottom_right_when_t_lt_s_unlike_keras():
    """Decoding 2 new tokens against 4 cached keys: Keras' use_causal_mask lets query 0 see
    key 0 only (top-left); here query t sees keys 0 .. t + S - T."""
    builtin = _built(keras.layers.MultiHeadAttention(4, 4), X[:, :2], Y[:, :4])
    _, keras_w = builtin(X[:, :2], Y[:, :4], use_causal_mask=True, return_attention_scores=True)
    _, weights = MultiHeadAttention.from_keras(builtin)(X[:, :2], Y[:, :4], causal=True, return_attention=True)
    np.testing.assert_array_equal(keras_w.numpy()[0, 0] > 0, [[1, 0, 0, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(weights.numpy()[0, 0] > 0, [[1, 1, 1, 0], [1, 1, 1, 1]])


def test_regression_causal_is_kept_beside_an_explicit_mask():
    """causal=True is combined with attention_mask and with implicit masks, never dropped."""
    layer = MultiHeadAttention(16, 4)
    keep = np.ones((2, 5, 5), bool)
    keep[:, :, 4] = False
    _, weights = layer(X, attention_mask=keep, causal=True, return_attention=True)
    upper = np.triu(np.ones((5, 5), bool), 1)
    assert (weights.numpy()[:, :, upper] == 0).all() and (weights.numpy()[..., 4] == 0).all()


def test_from_keras_group_query_attention():
    builtin = _built(keras.layers.GroupQueryAttention(4, 4, 2), X, Y)
    layer = MultiHeadAttention.from_keras(builtin)
    assert (layer.num_heads, layer.num_kv_heads, layer.head_dim) == (4, 2, 4)
    expected, expected_w = builtin(X, Y, return_attention_scores=True)
    output, weights = layer(X, Y, return_attention=True)
    _close(output, expected, OUTPUT_TOL)
    _close(weights, expected_w, WEIGHTS_TOL)


@pytest.mark.parametrize(
    "config",
    [{}, {"num_kv_heads": 2}, {"kdim": 6, "vdim": 10}, {"bias": False}],
    ids=["mha", "gqa", "kdim_vdim", "no_bias"],
)
def test_to_keras_round_trip(config):
    layer = MultiHeadAttention(16, 4, **config)
    key = rng.normal(size=(2, 7, config.get("kdim", 16))).astype(np.float32)
    value = rng.normal(size=(2, 7, config.get("vdim", 16))).astype(np.float32)
    _built(layer, X, key=key, value=value)
    builtin = layer.to_keras()
    expected_type = keras.layers.GroupQueryAttention if "num_kv_heads" in config else keras.layers.MultiHeadAttention
    assert type(builtin) is expected_type
    expected = builtin(X, value, key)  # Keras built-ins take (query, value, key)
    _close(layer(X, key=key, value=value), expected, OUTPUT_TOL)
    back = MultiHeadAttention.from_keras(builtin)
    for name, value in layer.export_weights().items():
        np.testing.assert_array_equal(back.export_weights()[name], value)


def test_from_keras_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match=r"`layer` must be built\. Received: an unbuilt MultiHeadAttention"):
        MultiHeadAttention.from_keras(keras.layers.MultiHeadAttention(2, 4))
    with pytest.raises(ValueError, match=r"must be a keras.layers.MultiHeadAttention or .*Received: Dense"):
        MultiHeadAttention.from_keras(keras.layers.Dense(3))


TOKENS = np.array([[3, 5, 7, 0, 0], [4, 2, 0, 0, 0]])  # 0 is padding
KEY_TOKENS = np.array([[1, 2, 3, 4, 0, 0, 0], [5, 0, 0, 0, 0, 0, 0]])


def _explicit_keep(query_tokens, key_tokens):
    return (query_tokens != 0)[:, :, None] & (key_tokens != 0)[:, None, :]  # (B, T, S)


def test_implicit_masks_in_a_functional_model():
    embed = keras.layers.Embedding(10, 16, mask_zero=True)
    attention = MultiHeadAttention(16, 4)
    q_in, k_in = keras.Input((None,), dtype="int32"), keras.Input((None,), dtype="int32")
    q, k = embed(q_in), embed(k_in)
    output, weights = attention(q, k, return_attention=True)
    model = keras.Model([q_in, k_in], [output, weights])
    got, got_w = model([TOKENS, KEY_TOKENS])
    expected, expected_w = attention(
        embed(TOKENS), embed(KEY_TOKENS), attention_mask=_explicit_keep(TOKENS, KEY_TOKENS), return_attention=True
    )
    _close(got, expected, OUTPUT_TOL)
    _close(got_w, expected_w, 0)
    assert (got_w.numpy()[1, :, 2:] == 0).all()  # padded query rows attend to nothing
    assert model.output_shape == [(None, None, 16), (None, 4, None, None)]


@pytest.mark.parametrize("cross", [False, True])
def test_implicit_masks_match_keras_multi_head_attention(cross):
    """Both layers read Embedding(mask_zero=True) masks and give padded query rows zero
    weights. Each layer gets freshly embedded tensors: the built-in deletes the masks of the
    tensors it is called on."""
    embed = keras.layers.Embedding(10, 16, mask_zero=True)

    def inputs():
        return embed(TOKENS), embed(KEY_TOKENS if cross else TOKENS)

    builtin = keras.layers.MultiHeadAttention(4, 4)
    builtin(*inputs())
    _with_random_biases(builtin)
    query, key = inputs()
    expected, expected_w = builtin(query, key, return_attention_scores=True)
    assert getattr(query, "_keras_mask", None) is None  # the built-in cleared its caller's mask
    query, key = inputs()
    output, weights = MultiHeadAttention.from_keras(builtin)(query, key, return_attention=True)
    real = TOKENS != 0
    np.testing.assert_array_equal(query._keras_mask.numpy(), real)  # this layer leaves it in place
    _close(output, expected, OUTPUT_TOL)
    _close(weights, expected_w, WEIGHTS_TOL)
    assert (weights.numpy()[~real[:, None, :].repeat(4, 1)] == 0).all()  # padded query rows
    np.testing.assert_array_equal(output._keras_mask.numpy(), real)


def test_implicit_mask_on_self_attention_with_one_input_and_mask_propagation():
    """`layer(x)`: Keras fills no *_mask argument for a single input; the layer reads x's
    mask itself, leaves it on x, and puts it on the output."""
    embed = keras.layers.Embedding(10, 16, mask_zero=True)
    attention = MultiHeadAttention(16, 4)
    x = embed(TOKENS)
    output, weights = attention(x, return_attention=True)
    np.testing.assert_array_equal(x._keras_mask.numpy(), TOKENS != 0)  # the caller's mask is not cleared
    np.testing.assert_array_equal(output._keras_mask.numpy(), TOKENS != 0)
    _close(weights, attention(x, attention_mask=_explicit_keep(TOKENS, TOKENS), return_attention=True)[1], 0)


def test_implicit_masks_in_a_subclassed_model_are_combined_with_causal():
    class Decoder(keras.Model):
        def __init__(self):
            super().__init__()
            self.embed = keras.layers.Embedding(10, 16, mask_zero=True)
            self.attention = MultiHeadAttention(16, 4)

        def call(self, tokens):
            x = self.embed(tokens)
            return self.attention(x, key=x, value=x, causal=True, return_attention=True)

    model = Decoder()
    _, weights = model(TOKENS)
    keep = _explicit_keep(TOKENS, TOKENS) & np.tril(np.ones((5, 5), bool))
    assert (weights.numpy()[:, :, ~keep[0]][0] == 0).all()
    _close(weights, model.attention(model.embed(TOKENS), attention_mask=keep, return_attention=True)[1], 0)


def test_fully_masked_rows_give_output_bias_and_finite_gradients():
    layer = _built(MultiHeadAttention(16, 4), X)
    keep = np.ones((2, 5, 5), bool)
    keep[0, 1] = False
    keep[1] = False
    x = tf.constant(X)
    with tf.GradientTape() as tape:
        tape.watch(x)
        output, weights = layer(x, attention_mask=keep, return_attention=True)
        loss = tf.reduce_sum(output**2)
    bias = layer.output_bias.numpy()
    np.testing.assert_array_equal(output.numpy()[0, 1], bias)
    np.testing.assert_array_equal(output.numpy()[1], np.broadcast_to(bias, (5, 16)))
    assert (weights.numpy()[0, :, 1] == 0).all() and (weights.numpy()[1] == 0).all()
    grads = tape.gradient(loss, [x, *layer.trainable_weights])
    assert all(np.isfinite(g.numpy()).all() for g in grads)


def test_config_round_trip():
    layer = MultiHeadAttention(
        16,
        4,
        num_kv_heads=2,
        head_dim=6,
        kdim=5,
        vdim=7,
        dropout=0.1,
        bias=False,
        kernel_initializer="he_normal",
        name="attn",
    )
    clone = MultiHeadAttention.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()
    registered = keras.utils.get_registered_object("MultiHeadAttentionReference>MultiHeadAttention")
    # this file's class (an example run in this process may have loaded the file again under its own name)
    assert inspect.getfile(registered) == inspect.getfile(MultiHeadAttention)


def _model():
    embed_in = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(10, 16, mask_zero=True)(embed_in)
    x = MultiHeadAttention(16, 4, num_kv_heads=2)(x, causal=True)
    return keras.Model(embed_in, keras.layers.Dense(3)(x))


def test_keras_file_round_trip(tmp_path):
    model = _model()
    expected = model(TOKENS)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    _close(loaded(TOKENS), expected, 0)


def test_savedmodel_export_round_trip(tmp_path):
    model = _model()
    expected = model(TOKENS)
    model.export(str(tmp_path / "saved"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "saved"))
    _close(served.serve(tf.constant(TOKENS, tf.int32)), expected, 0)


def _fixed_weights(layer, seed):
    """Glorot-scale portable weights from a local seed: the same whatever ran before."""
    local = np.random.default_rng(seed)
    return {
        name: local.normal(scale=0.25, size=shape).astype(np.float32) for name, shape in layer.weight_shapes().items()
    }


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision(policy):
    """Within the SPEC tolerance of float32 for N(0, 1) inputs; and with inputs 30 times larger
    (scores ~1e3) nothing overflows: the mask fill stays finite and masked weights stay 0."""
    reference = MultiHeadAttention(16, 4)
    reference.import_weights(_fixed_weights(reference, seed=3))
    layer = MultiHeadAttention(16, 4, dtype=policy)
    layer.import_weights(reference.export_weights())
    keep = np.ones((2, 5, 5), bool)
    keep[0, 2] = False
    mask = np.where(keep, 0.0, -np.inf).astype(np.float32)  # a float mask: -inf must not overflow anything
    output, weights = layer(X, attention_mask=mask, causal=True, return_attention=True)
    expected, expected_w = reference(X, attention_mask=mask, causal=True, return_attention=True)
    assert output.dtype == layer.compute_dtype and layer.query_kernel.dtype == "float32"
    _close(output, expected, MIXED_TOL[policy])
    _close(weights, expected_w, MIXED_TOL[policy])

    output, weights = layer(X * 30, attention_mask=mask, causal=True, return_attention=True)
    weights = weights.numpy().astype(np.float32)
    removed = ~(keep & np.tril(np.ones((5, 5), bool)))[:, None].repeat(4, 1)
    assert np.isfinite(output.numpy().astype(np.float32)).all() and np.isfinite(weights).all()
    assert (weights[removed] == 0).all()
    np.testing.assert_allclose(weights[1].sum(-1), 1.0, atol=MIXED_TOL[policy])


def test_jit_compile_and_unknown_shapes():
    layer = _built(MultiHeadAttention(16, 4, num_kv_heads=2), X, Y)
    spec = tf.TensorSpec((None, None, 16), tf.float32)
    mask_spec = tf.TensorSpec((None, 1, None), tf.bool)

    @tf.function(input_signature=[spec, spec, mask_spec], jit_compile=True)
    def attend(query, key, keep):
        return layer(query, key, attention_mask=keep, causal=True, return_attention=True)

    keep = rng.random((2, 1, 7)) < 0.6
    keep[1] = False
    for length in (5, 3):
        output, weights = attend(X[:, :length], Y, keep)
        expected, expected_w = layer(X[:, :length], Y, attention_mask=keep, causal=True, return_attention=True)
        _close(output, expected, OUTPUT_TOL)
        _close(weights, expected_w, WEIGHTS_TOL)


@pytest.mark.parametrize("options", [{}, {"sinks": True}, {"num_kv_heads": 2}], ids=["mha", "sinks", "gqa"])
def test_regression_xla_gradients_with_unknown_shapes(options):
    """With the batch or a length unknown, `_attend` picked its path in a `tf.cond`, and XLA
    compiles the gradient of the branch not taken with placeholders for its tensors (0 for
    unknown dimensions): gradients failed to compile ("shape of dy was [2,4,6,4] instead of
    [2,4,0,4]"). Under XLA such shapes now take the memory-efficient path, without a choice.
    With a per-query bias, whose gradient that path sums chunk by chunk."""
    layer = _built(MultiHeadAttention(16, 4, **options), X)
    spec, bias_spec = tf.TensorSpec((None, None, 16), tf.float32), tf.TensorSpec((None, 1, None, None), tf.float32)

    def gradients(x, attention_bias):
        with tf.GradientTape() as tape:
            tape.watch([x, attention_bias])
            loss = tf.reduce_sum(layer(x, attention_bias=attention_bias, causal=True) ** 2)
        return tape.gradient(loss, [x, attention_bias, *layer.trainable_variables])

    compiled = tf.function(gradients, input_signature=[spec, bias_spec], jit_compile=True)
    for length in (5, 3):
        x, attention_bias = tf.constant(X[:, :length]), tf.constant(rng.normal(size=(2, 1, length, length)), tf.float32)
        for got, expected in zip(compiled(x, attention_bias), gradients(x, attention_bias), strict=True):
            _close(got, expected, GRAD_TOL)


def test_regression_keras_fit_under_xla_with_a_last_partial_batch():
    """`model.fit` with `jit_compile=True` retraces with an unknown batch for a last, smaller
    batch, and failed there (the XLA gradient above)."""
    inputs = keras.Input((None, 16))
    model = keras.Model(inputs, MultiHeadAttention(16, 4)(inputs, causal=True))
    model.compile("sgd", "mse", jit_compile=True)
    data = rng.normal(size=(10, 6, 16)).astype(np.float32)
    history = model.fit(data, data, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def test_shape_errors_are_value_errors_at_trace_time():
    layer = MultiHeadAttention(16, 4)

    @tf.function(input_signature=[tf.TensorSpec((None, None, 12), tf.float32)])
    def attend(query):
        return layer(query)

    with pytest.raises(
        ValueError, match=r"`query` must have shape \(B, T, E\) with E=16\. Received: query\.shape=\(None, None, 12\)"
    ):
        attend.get_concrete_function()


def test_dropout_only_when_training():
    layer = _built(MultiHeadAttention(16, 4, dropout=0.5), X)
    assert np.array_equal(layer(X), layer(X))
    assert np.array_equal(layer(X, training=False), layer(X))
    _, weights = layer(X, return_attention=True)
    first, train_weights = layer(X, training=True, return_attention=True)
    assert not np.array_equal(first, layer(X, training=True))
    _close(train_weights, weights, 0)  # weights are returned before dropout


def test_compute_output_shape_for_s_not_t():
    layer = MultiHeadAttention(16, 4)
    assert layer.compute_output_shape((2, 5, 16), (2, 9, 16), (2, 9, 16)) == (2, 5, 16)
    output, weights = layer(keras.Input((5, 16)), keras.Input((9, 16)), return_attention=True)
    assert output.shape == (None, 5, 16) and weights.shape == (None, 4, 5, 9)


def test_functional_model_checks_shapes_when_built():
    with pytest.raises(
        ValueError, match=r"`query` must have shape \(B, T, E\) with E=16\. Received: query\.shape=\(None, None, 12\)"
    ):
        MultiHeadAttention(16, 4)(keras.Input((None, 12)))
    with pytest.raises(ValueError, match=r"`attention_mask` must broadcast to \(B, N, T, S\)"):
        MultiHeadAttention(16, 4)(keras.Input((5, 16)), attention_mask=keras.Input((4, 5), dtype="bool"))


def test_import_weights_builds_a_fresh_layer():
    layer = MultiHeadAttention(16, 4, num_kv_heads=1)
    assert not layer.built
    weights = {name: rng.normal(size=shape).astype(np.float32) for name, shape in layer.weight_shapes().items()}
    layer.import_weights(weights)
    assert layer.built
    assert [v.name for v in layer.trainable_weights] == list(weights)
    for name, value in layer.export_weights().items():
        np.testing.assert_array_equal(value, weights[name])


def test_regression_memory_efficient_attention_with_a_mask_batch_unknown_at_trace_time():
    """The batch-chunked path this path replaced picked which masks to map from their static
    batch size; a mask traced as (None, 1, S) and fed with batch 1 then failed inside tf.map_fn.
    The memory-efficient path broadcasts masks instead: pinned here."""
    layer = _built(MultiHeadAttention(16, 4), X, Y)
    keep = rng.random((1, 1, 7)) < 0.6
    expected = layer(X, Y, attention_mask=keep)
    layer.memory_efficient_threshold = 0
    signature = [tf.TensorSpec((2, 5, 16)), tf.TensorSpec((2, 7, 16)), tf.TensorSpec((None, 1, 7), tf.bool)]
    attend = tf.function(lambda q, k, m: layer(q, k, attention_mask=m), input_signature=signature)
    _close(attend(X, Y, keep), expected, OUTPUT_TOL)


def test_memory_efficient_path_is_taken_for_large_scores_without_weights(monkeypatch):
    """Above `memory_efficient_threshold` score elements, and only without `return_attention`."""
    import TensorFlow.Multi_Head_Attention as tf_file

    calls = []
    original = tf_file._memory_efficient_attention
    monkeypatch.setattr(
        tf_file, "_memory_efficient_attention", lambda *a, **kw: calls.append(a[6]) or original(*a, **kw)
    )
    layer = _built(MultiHeadAttention(16, 4), X, Y)
    expected = layer(X, Y, causal=True)
    assert calls == []
    layer.memory_efficient_threshold = 2 * 4 * 5 * 7 - 1  # scores of (B, N, T, S) = (2, 4, 5, 7) exceed it
    layer.query_chunk_elements = 2 * 2 * 4 * 7  # two queries per chunk: chunks of rows 0-1, 2-3, 4 (+ padding)
    _close(layer(X, Y, causal=True), expected, OUTPUT_TOL)
    assert calls == [2]
    layer(X, Y, causal=True, return_attention=True)
    assert calls == [2]


def test_default_thresholds_chunk_long_sequences_only():
    import TensorFlow.Multi_Head_Attention as tf_file

    layer = MultiHeadAttention(256, 4)
    long, short = tf.zeros((1, 4, 8192, 64)), tf.zeros((8, 4, 512, 64))
    assert tf_file._query_chunk(layer, long, long) == 64  # (1, 4, 64, 8192) scores per chunk: 2 Mi elements
    assert tf_file._query_chunk(layer, short, short) is None  # (8, 4, 512, 512): 8 Mi elements, attended at once


def test_memory_efficient_path_under_xla_with_shapes_unknown_at_trace_time():
    """Unknown shapes decide between the two paths at run time (tf.cond), under XLA too."""
    layer = _built(MultiHeadAttention(16, 4, num_kv_heads=2), X, Y)
    spec, mask_spec = tf.TensorSpec((None, None, 16), tf.float32), tf.TensorSpec((None, 1, None), tf.bool)
    keep = rng.random((2, 1, 7)) < 0.6
    keep[1] = False

    def attend(query, key, keep):
        with tf.GradientTape() as tape:
            tape.watch(query)
            output = layer(query, key, attention_mask=keep, causal=True)
        return output, tape.gradient(tf.reduce_sum(output**2), query)

    expected = attend(tf.constant(X), tf.constant(Y), keep)
    layer.memory_efficient_threshold, layer.query_chunk_elements = 0, 1  # one query per chunk
    compiled = tf.function(attend, input_signature=[spec, spec, mask_spec], jit_compile=True)
    for got, want in zip(compiled(X, Y, keep), expected, strict=True):
        _close(got, want, OUTPUT_TOL)


def test_memory_efficient_dropout_drops_the_same_weights_forward_and_backward():
    """The context is linear in v, so sum(g * context) == sum(grad_v * v) up to float32 rounding
    when the backward drops the same weights as the forward (a stateless mask per chunk and seed).
    The sum cancels, so the tolerance is relative to the sum of the terms' sizes, not to the sum:
    the draw of the module's generator depends on which tests ran before in the worker."""
    import TensorFlow.Multi_Head_Attention as tf_file

    local = np.random.default_rng(7)
    q, k, v, g = (tf.constant(local.normal(size=(2, 4, 7, 8)), tf.float32) for _ in range(4))
    seed = tf.constant([3, 4])

    def loss_and_grad(rate):
        with tf.GradientTape() as tape:
            tape.watch(v)
            terms = g * tf_file._memory_efficient_attention(q, k, v, None, None, True, 3, rate, seed)
            loss = tf.reduce_sum(terms)
        return loss, tape.gradient(loss, v), float(tf.reduce_sum(tf.abs(terms)))

    loss, grad, size = loss_and_grad(0.5)
    np.testing.assert_allclose(float(loss), float(tf.reduce_sum(grad * v)), rtol=0, atol=SUM_TOL * size)
    assert float(loss) != float(loss_and_grad(0.0)[0])  # something was dropped
    assert float(loss) == float(loss_and_grad(0.5)[0])  # the same seed drops the same weights


def test_memory_efficient_mixed_precision():
    reference = MultiHeadAttention(16, 4)
    reference.import_weights(_fixed_weights(reference, seed=4))
    layer = MultiHeadAttention(16, 4, dtype="mixed_float16")
    layer.import_weights(reference.export_weights())
    layer.memory_efficient_threshold, layer.query_chunk_elements = 0, 2 * 2 * 4 * 5
    output = layer(X, causal=True)
    assert output.dtype == "float16"
    _close(output, reference(X, causal=True), MIXED_TOL["mixed_float16"])


def test_training_with_dropout_on_the_memory_efficient_path():
    layer = _built(MultiHeadAttention(16, 4, dropout=0.5), X)
    layer.memory_efficient_threshold = 0
    first, second = layer(X, training=True), layer(X, training=True)
    assert not np.array_equal(first, second)  # a new seed per call
    assert np.array_equal(layer(X), layer(X, training=False))


def test_regression_float_mask_with_inf_stays_finite_when_where_becomes_arithmetic(monkeypatch):
    """tf2onnx lowers tf.where(c, x, y) to c * x + !c * y, so a -inf in either operand gave NaN
    (0 * -inf) in exported graphs. No operand of any tf.where in the layer holds -inf now."""

    def arithmetic_where(condition, x, y):
        x = tf.convert_to_tensor(x)
        c = tf.cast(condition, x.dtype)
        return c * x + (1 - c) * tf.convert_to_tensor(y, dtype=x.dtype)

    layer = _built(MultiHeadAttention(16, 4), X, Y)
    mask = np.where(rng.random((2, 5, 7)) < 0.3, -np.inf, 0.0).astype(np.float32)
    mask[0, 1] = -np.inf  # a query with no key left
    mask[1, 2, ::2] = np.finfo(np.float32).min  # what the TFLite converter puts for -inf: removes too
    expected, expected_w = layer(X, Y, attention_mask=mask, return_attention=True)
    monkeypatch.setattr(tf, "where", arithmetic_where)
    for threshold in (2**62, 0):  # the explicit and the memory-efficient path
        layer.memory_efficient_threshold = threshold
        output = layer(X, Y, attention_mask=mask, return_attention=threshold > 0)
        output, weights = output if threshold > 0 else (output, None)
        assert np.isfinite(output.numpy()).all()
        _close(output, expected, OUTPUT_TOL)
        if weights is not None:
            _close(weights, expected_w, WEIGHTS_TOL)
    assert (expected_w.numpy()[0, :, 1] == 0).all() and (expected_w.numpy()[1, :, 2, ::2] == 0).all()


@pytest.mark.parametrize("path", ["tf:onnx", "tf:litert"])
def test_memory_efficient_path_exports(path):
    """The memory-efficient path (no weights) through tf2onnx / LiteRT at static shapes: its chunk
    loop converts, and no boolean tensor is padded (ONNX Runtime's Pad has no bool)."""
    from shared_tests import runtimes
    from shared_tests.cases import CASES_BY_NAME, make_data
    from shared_tests.frameworks import make_tf_layer

    case = CASES_BY_NAME["causal_plus_padding"]
    data = make_data(case)
    expected = make_tf_layer(case, data)(
        data["query"], key=data["key"], value=data["value"], attention_mask=data["attention_mask"], causal=True
    )

    def chunked_layer(case, data):
        layer = make_tf_layer(case, data)
        layer.memory_efficient_threshold, layer.query_chunk_elements = 0, 2 * case.b * case.n * case.s
        return layer

    (output,) = runtimes.RUNNERS[path](case, data, chunked_layer, return_attention=False)
    _close(output, expected, OUTPUT_TOL)


@pytest.mark.parametrize("scale", [None, 0.3, 0.1])
def test_d01_float64_layer_keeps_scale_in_float64(scale):
    """Regression D1: a float64 layer multiplied q by `scale` cast through float32 (1/sqrt(2)
    about 1.2e-8 off). It now gives the NumPy reference within the float64 tolerance."""
    from NumPy import MultiHeadAttention as NumpyMultiHeadAttention

    reference = NumpyMultiHeadAttention(8, 4, scale=scale, seed=0)  # H = 2: 1 / sqrt(2) by default
    layer = MultiHeadAttention(8, 4, scale=scale, dtype="float64")
    layer.import_weights(reference.export_weights())
    x = rng.normal(size=(1, 3, 8))
    np.testing.assert_allclose(
        layer(tf.constant(x)).numpy(), reference(x), atol=FLOAT64_TOLERANCES["plain"]["output"], rtol=0
    )
