"""TensorFlow memory-efficient path: exports with unknown batch and length (LiteRT through the
default converter of a functional model, tf2onnx), and eager calls run as one graph (an eager
tape must not keep every chunk's scores)."""

import numpy as np
import pytest
import tensorflow as tf

import TensorFlow.Multi_Head_Attention as tf_file
from shared_tests.cases import FLOAT64_TOLERANCES, TOLERANCES
from shared_tests.runtimes import quietly
from TensorFlow import MultiHeadAttention

keras = tf.keras
E, N = 16, 4
SHAPES = ((1, 5), (3, 17))  # (B, T): the export runs at both
OUTPUT_TOL = TOLERANCES["float32"]["output"]
GRADS_TOL = TOLERANCES["float32"]["grads"]
EXPLICIT, CHUNKED = 1 << 62, 0  # memory_efficient_threshold: never / always the memory-efficient path
CHUNK_ELEMENTS = 2 * 3 * N * 17  # two queries per chunk at a known B = 3, S = 17 (a padded last chunk); else one

rng = np.random.default_rng(0)


def _inputs(b, t):
    x = rng.normal(size=(b, t, E)).astype(np.float32)  # (B, T, E)
    keep = rng.random((b, t)) < 0.7  # (B, T)
    keep[:, 0] = True
    return x, keep


def _layer(threshold):
    layer = MultiHeadAttention(E, N, num_kv_heads=2, sinks=True, softcap=5.0)
    layer.memory_efficient_threshold, layer.query_chunk_elements = threshold, CHUNK_ELEMENTS
    return layer


def _functional_model(threshold, causal, key_mask):
    """keras.Input((None, E)) (batch unknown too) -> the layer -> keras.Model."""
    x = keras.Input((None, E))
    keep = keras.Input((None,), dtype="bool") if key_mask else None
    output = _layer(threshold)(x, key_mask=keep, query_mask=keep, causal=causal)
    return keras.Model([x, keep] if key_mask else x, output)


@pytest.mark.parametrize(
    "threshold, causal, key_mask",
    [(EXPLICIT, False, False), (CHUNKED, True, True), (1 << 26, True, True)],
    ids=["runs_explicit", "runs_memory_efficient_causal_masks", "default_threshold_causal_masks"],
)
def test_functional_model_with_unknown_batch_and_length_converts_to_litert(threshold, causal, key_mask):
    """The default TFLite converter (builtin ops only) holds both paths with every dimension but
    E unknown, and LiteRT runs the model at two shapes as eager Keras does (with `key_mask`, the
    same (B, T) mask is the `query_mask` too)."""
    from ai_edge_litert.interpreter import Interpreter

    model = _functional_model(threshold, causal, key_mask)
    interpreter = Interpreter(model_content=quietly(tf.lite.TFLiteConverter.from_keras_model(model).convert))
    details = interpreter.get_input_details()
    assert [d["shape_signature"].tolist() for d in details if len(d["shape_signature"]) == 3] == [[-1, -1, E]]
    for b, t in SHAPES:
        x, keep = _inputs(b, t)
        by_rank = {3: x, 2: keep}
        for detail in details:
            interpreter.resize_tensor_input(detail["index"], by_rank[len(detail["shape_signature"])].shape)
        interpreter.allocate_tensors()
        for detail in details:
            interpreter.set_tensor(detail["index"], by_rank[len(detail["shape_signature"])])
        interpreter.invoke()
        output = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])
        expected = model([x, keep] if key_mask else x)
        np.testing.assert_allclose(output, expected, atol=OUTPUT_TOL, rtol=0)


def test_memory_efficient_path_with_unknown_dims_through_tf2onnx():
    """tf2onnx of a tf.function whose batch and length are None, run at two shapes in ONNX Runtime."""
    import onnxruntime
    import tf2onnx

    layer = _layer(CHUNKED)
    signature = [tf.TensorSpec((None, None, E), tf.float32, name="x"), tf.TensorSpec((None, None), tf.bool, name="m")]
    function = tf.function(lambda x, keep: layer(x, key_mask=keep, causal=True), input_signature=signature)
    proto, _ = quietly(lambda: tf2onnx.convert.from_function(function, input_signature=signature))
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for b, t in SHAPES:
        x, keep = _inputs(b, t)
        (output,) = session.run(None, {"x": x, "m": keep})
        np.testing.assert_allclose(output, layer(x, key_mask=keep, causal=True), atol=OUTPUT_TOL, rtol=0)


def _forward_and_grads(layer, x, keep):
    with tf.GradientTape() as tape:
        tape.watch(x)
        output = layer(x, key_mask=keep, causal=True)
        loss = tf.reduce_sum(output * tf.cos(output))
    return output, tape.gradient(loss, [x, *layer.trainable_weights])


def test_regression_eager_memory_efficient_path_taped_every_chunk(monkeypatch):
    """Eagerly, the memory-efficient path ran chunk by chunk, and the GradientTape recorded every
    chunk's ops, keeping all their scores (memory quadratic in T): it now runs as one traced
    graph (no Python per chunk after the first call), with the explicit path's gradients."""
    x, keep = (tf.constant(a) for a in _inputs(*SHAPES[1]))
    layer = _layer(EXPLICIT)
    expected, expected_grads = _forward_and_grads(layer, x, keep)
    layer.memory_efficient_threshold = CHUNKED
    _forward_and_grads(layer, x, keep)  # traces the graph
    chunks_run_in_python = []
    original = tf_file._rows
    monkeypatch.setattr(tf_file, "_rows", lambda *a: chunks_run_in_python.append(a) or original(*a))
    output, grads = _forward_and_grads(layer, x, keep)
    assert chunks_run_in_python == []
    np.testing.assert_allclose(output, expected, atol=OUTPUT_TOL, rtol=0)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=GRADS_TOL, rtol=0)


def test_memory_efficient_gradients_with_unknown_batch_and_length():
    """Traced with batch and length None (the chunks written into a preallocated tensor), the
    memory-efficient path gives the explicit path's output and gradients."""
    x, keep = (tf.constant(a) for a in _inputs(*SHAPES[1]))
    layer = _layer(EXPLICIT)
    expected, expected_grads = _forward_and_grads(layer, x, keep)
    layer.memory_efficient_threshold = CHUNKED
    signature = [tf.TensorSpec((None, None, E)), tf.TensorSpec((None, None), tf.bool)]
    output, grads = tf.function(lambda x, keep: _forward_and_grads(layer, x, keep), input_signature=signature)(x, keep)
    np.testing.assert_allclose(output, expected, atol=OUTPUT_TOL, rtol=0)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=GRADS_TOL, rtol=0)


@pytest.mark.parametrize("threshold", [EXPLICIT, CHUNKED])
def test_d02_float64_gradients_on_the_memory_efficient_path(threshold):
    """Regression D2: the memory-efficient path accumulated the key and value gradients of a
    float64 layer in float32 (about 1.6e-8 off). Both paths now give the NumPy reference's
    gradients within the float64 tolerance."""
    from NumPy import MultiHeadAttention as NumpyMultiHeadAttention

    q, kv, grad = rng.normal(size=(1, 3, 4)), rng.normal(size=(1, 4, 4)), rng.normal(size=(1, 3, 4))
    reference = NumpyMultiHeadAttention(4, 1, num_kv_heads=1, seed=0)
    reference(q, key=kv)
    want = reference.backward(grad)
    layer = MultiHeadAttention(4, 1, dtype="float64")
    layer.import_weights(reference.export_weights())
    layer.memory_efficient_threshold, layer.query_chunk_elements = threshold, 2 * 4  # two queries per chunk
    q, kv = tf.constant(q), tf.constant(kv)
    with tf.GradientTape() as tape:
        tape.watch([q, kv])
        loss = tf.reduce_sum(layer(q, key=kv) * grad)
    got = dict(zip(["query", "key"], tape.gradient(loss, [q, kv]), strict=True))
    for name, value in got.items():
        np.testing.assert_allclose(value.numpy(), want[name], atol=FLOAT64_TOLERANCES["plain"]["grads"], rtol=0)


def test_float64_dropout_on_the_memory_efficient_path():
    """Regression (found beside D2): a float64 layer training with dropout on the memory-efficient
    path multiplied float64 weights by a float32 dropout mask and failed; the mask now takes the
    weights' dtype, and the gradients stay float64."""
    layer = MultiHeadAttention(4, 1, dtype="float64", dropout=0.5)
    layer.memory_efficient_threshold = CHUNKED
    x = tf.constant(rng.normal(size=(1, 3, 4)))
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(layer(x, training=True))
    grad = tape.gradient(loss, x)
    assert grad.dtype == tf.float64 and np.isfinite(grad.numpy()).all()
