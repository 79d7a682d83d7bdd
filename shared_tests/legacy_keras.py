"""The TensorFlow layer under legacy Keras 2 (tf_keras, `TF_USE_LEGACY_KERAS=1`).

Not collected by the main run (TensorFlow picks its Keras once per process): test_legacy_keras.py
runs `pytest shared_tests/legacy_keras.py` in a subprocess with `TF_USE_LEGACY_KERAS=1`. The
checks are those of test_tensorflow.py that apply to Keras 2: parity on every TensorFlow path,
implicit masks (cross-attention included), dtype conversion, the legacy built-in layer both
ways, initialisation, dropout on the memory-efficient path and the KV cache; and the variants
of cases.py's `EVERYTHING_NEW` on the explicit and memory-efficient paths,
eager and under tf.function, against the NumPy file.
"""

import os

import numpy as np
import pytest

assert os.environ.get("TF_USE_LEGACY_KERAS") == "1", "run through test_legacy_keras.py"

import tensorflow as tf  # noqa: E402

from NumPy import MultiHeadAttention as NumpyMultiHeadAttention  # noqa: E402
from shared_tests import parity  # noqa: E402
from shared_tests.cases import CASES_BY_NAME, EVERYTHING_NEW, TOLERANCES  # noqa: E402
from TensorFlow import MultiHeadAttention  # noqa: E402

OUTPUT_TOL = TOLERANCES["float32"]["output"]
TF_PATHS = ("numpy", "tf:eager", "tf:function", "tf:memory_efficient")
rng = np.random.default_rng(0)
X = rng.normal(size=(2, 5, 16)).astype(np.float32)  # (B, T, E)
Y = rng.normal(size=(2, 7, 16)).astype(np.float32)  # (B, S, E)


def _close(a, b, tol=OUTPUT_TOL):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=tol, rtol=0)


def test_this_process_runs_legacy_keras():
    assert tf.keras.__name__.startswith("tf_keras")
    assert not hasattr(tf.keras.layers, "GroupQueryAttention")


@pytest.mark.parametrize(
    "name", ["cross", "gqa", "kdim_vdim", "mask_float_ts", "causal_plus_padding", "rows_fully_masked", "float16_self"]
)
def test_case_in_parity_on_every_tensorflow_path(name):
    row, _ = parity.run_case(CASES_BY_NAME[name], paths=TF_PATHS)
    assert row.passed, row.failures


def test_implicit_masks_of_query_key_and_value():
    """Legacy Keras leaves the masks on the tensors; padded keys must not be attended in
    cross-attention (they silently were)."""
    embed = tf.keras.layers.Embedding(20, 16, mask_zero=True)
    queries, keys = np.array([[3, 5, 7, 0], [4, 2, 0, 0]]), np.array([[1, 2, 3, 0, 0], [5, 6, 0, 0, 0]])
    layer = MultiHeadAttention(16, 4)
    output, weights = layer(embed(queries), embed(keys), return_attention=True)
    keep = (queries != 0)[:, None, :, None] & (keys != 0)[:, None, None, :]  # (B, 1, T, S)
    expected, expected_w = layer(embed(queries), embed(keys), attention_mask=keep, return_attention=True)
    _close(output, expected)
    _close(weights, expected_w)
    assert (weights.numpy()[:, :, :, 3:] == 0).all()


def test_inputs_are_cast_to_the_compute_dtype():
    layer = MultiHeadAttention(16, 4)
    _close(layer(X.astype(np.float64), Y.astype(np.float64)), layer(X, Y))


def test_from_and_to_the_legacy_built_in():
    builtin = tf.keras.layers.MultiHeadAttention(4, 4)
    expected = builtin(X, Y)
    layer = MultiHeadAttention.from_keras(builtin)
    _close(layer(X, Y), expected)
    back = layer.to_keras()
    _close(back(X, Y), expected)


def test_grouped_query_attention_cannot_go_to_legacy_keras():
    with pytest.raises(ValueError, match=r"^Legacy Keras \(tf_keras\) has no GroupQueryAttention"):
        MultiHeadAttention(16, 4, num_kv_heads=2).to_keras()


def test_gated_attention_cannot_go_to_legacy_keras():
    """Legacy Keras' MultiHeadAttention has no `use_gate`; the gated layer itself runs as in Keras 3."""
    layer = MultiHeadAttention(16, 4, gate=True)
    assert layer(X, Y).shape == (X.shape[0], X.shape[1], 16)
    with pytest.raises(ValueError, match=r"^Legacy Keras \(tf_keras\) has no gate \(`use_gate`\)"):
        layer.to_keras()


def test_every_kernel_has_its_own_initial_values():
    """A legacy initializer called twice returns the same values: each weight gets its own."""
    layer = MultiHeadAttention(16, 4)
    layer.build()
    kernels = [layer.query_kernel.numpy(), layer.key_kernel.numpy(), layer.value_kernel.numpy()]
    assert not np.array_equal(kernels[0], kernels[1]) and not np.array_equal(kernels[1], kernels[2])


def test_dropout_on_the_memory_efficient_path():
    layer = MultiHeadAttention(16, 4, dropout=0.5)
    layer.memory_efficient_threshold = 0
    assert not np.array_equal(layer(X, training=True), layer(X, training=True))
    assert np.array_equal(layer(X), layer(X, training=False))


def test_kv_cache_decoding_equals_the_full_pass():
    layer = MultiHeadAttention(16, 4, num_kv_heads=2)
    full = layer(X, causal=True)
    cache, outputs = layer.init_cache(2, 8), []
    for start, stop in ((0, 3), (3, 4), (4, 5)):
        output, cache = layer(X[:, start:stop], causal=True, cache=cache)
        outputs.append(output)
    _close(tf.concat(outputs, 1), full)


def test_the_new_variants_on_the_explicit_and_memory_efficient_paths():
    """Eager and under tf.function, against the NumPy file (M-RoPE positions, causal)."""
    local = np.random.default_rng(0)
    layer = MultiHeadAttention(16, 4, **EVERYTHING_NEW)
    layer.import_weights(
        {
            name: (local.normal(size=shape) * 0.3 + name.endswith("_norm")).astype(np.float32)
            for name, shape in layer.weight_shapes().items()
        }
    )
    twin = NumpyMultiHeadAttention(16, 4, **EVERYTHING_NEW)
    twin.import_weights(layer.export_weights())
    x = local.normal(size=(2, 5, 16)).astype(np.float32)  # (B, T, E)
    positions = local.integers(0, 30, size=(2, 2, 5)).astype(np.int32)  # (k, B, T)
    expected = twin(x.astype(np.float64), positions=positions, causal=True)
    for threshold in (1 << 26, 0):
        layer.memory_efficient_threshold = threshold
        for run in (layer, tf.function(layer)):
            _close(run(x, positions=positions, causal=True), expected)
    assert MultiHeadAttention.from_config(layer.get_config()).window == EVERYTHING_NEW["window"]
