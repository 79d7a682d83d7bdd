"""Checks of the Keras file that run inside one backend's process (shared_tests/keras_backends.py).

Each check raises (an AssertionError saying what differs) or returns None; `CHECKS` names them.
A check named "save:FOLDER" or "load:FOLDER" takes that folder: `save` writes a `.keras` model
with its inputs and outputs there, `load` loads one written by another backend and compares.
"""

import os
import warnings

import numpy as np

TOLERANCE = 1e-5  # float32 outputs, as the SPEC's output tolerance
SAVED_CONFIG = dict(d_model=16, num_heads=4, num_kv_heads=2, rope_theta=10000.0, qk_norm="head", sinks=True, window=3)


def _layer(seed=0, **config):
    from Keras import MultiHeadAttention

    layer = MultiHeadAttention(**{"d_model": 16, "num_heads": 4, **config})
    rng = np.random.default_rng(seed)
    layer.import_weights(
        {name: rng.normal(scale=0.3, size=shape).astype(np.float32) for name, shape in layer.weight_shapes().items()}
    )
    return layer


def _inputs(shape=(2, 6, 16), seed=1):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _numpy(x):
    from keras import ops

    return np.asarray(ops.convert_to_numpy(x), dtype=np.float64)


def _close(got, expected, what, tolerance=TOLERANCE):
    worst = float(np.max(np.abs(_numpy(got) - _numpy(expected)), initial=0.0))
    assert worst <= tolerance, f"{what}: differs by {worst:.2e} > {tolerance:.0e}"


def check_fit():
    """`fit` on a functional model, under XLA (`jit_compile=True`) on TensorFlow and JAX (eager on
    torch, where Keras compiles only when asked), lowers the loss; `predict` equals a call."""
    import keras

    from Keras import MultiHeadAttention

    keras.utils.set_random_seed(0)
    tokens = keras.Input((None, 16))  # T unknown when the model is built and traced
    attended = MultiHeadAttention(16, 4, num_kv_heads=2, rope_theta=10000.0, dropout=0.1)(tokens, causal=True)
    model = keras.Model(tokens, keras.layers.Dense(1)(attended))
    jit = keras.backend.backend() in ("tensorflow", "jax")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=jit)
    x, y = _inputs((32, 8, 16)), _inputs((32, 8, 1), seed=2)
    history = model.fit(x, y, batch_size=8, epochs=4, verbose=0).history["loss"]
    assert np.isfinite(history).all() and history[-1] < history[0], f"the loss did not fall: {history}"
    _close(model.predict(x[:4], verbose=0), model(x[:4], training=False), "predict against a call")


def check_fit_compiled():
    """`fit` with `jit_compile=True` on torch, where Keras compiles the train step with
    `torch.compile`: the loss falls and `predict` equals an eager call."""
    import keras

    from Keras import MultiHeadAttention

    keras.utils.set_random_seed(0)
    tokens = keras.Input((8, 16))
    attended = MultiHeadAttention(16, 4, num_kv_heads=2, rope_theta=10000.0)(tokens, causal=True)
    model = keras.Model(tokens, keras.layers.Dense(1)(attended))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=True)
    x, y = _inputs((16, 8, 16)), _inputs((16, 8, 1), seed=2)
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0).history["loss"]
    assert np.isfinite(history).all() and history[-1] < history[0], f"the loss did not fall: {history}"
    _close(model.predict(x[:8], batch_size=8, verbose=0), model(x[:8], training=False), "predict against a call")


def check_dropout():
    """Dropout is drawn from the layer's seed: the same after `keras.utils.set_random_seed`,
    different from the call without training."""
    import keras

    outputs = []
    for _ in range(2):
        keras.utils.set_random_seed(7)
        layer = _layer(dropout=0.5)
        outputs.append(_numpy(layer(_inputs(), training=True)))
    _close(outputs[0], outputs[1], "two seeded dropout calls", 0.0)
    plain = _numpy(layer(_inputs(), training=False))
    assert np.abs(plain - outputs[0]).max() > 1e-3, "dropout dropped nothing"


def check_mask_alias():
    """`mask=` is `attention_mask=`; both is a ValueError."""
    layer, x = _layer(), _inputs()
    mask = np.random.default_rng(3).random((2, 6, 6)) < 0.7
    _close(layer(x, mask=mask), layer(x, attention_mask=mask), "mask= against attention_mask=", 0.0)
    try:
        layer(x, attention_mask=mask, mask=mask)
    except ValueError as error:
        assert "not both" in str(error), str(error)
    else:
        raise AssertionError("attention_mask and mask both given raised nothing")


def check_implicit_mask():
    """An `Embedding(mask_zero=True)` mask removes padded keys and queries (eagerly, in a
    functional model and as the key and value of cross-attention), and the output carries it."""
    import keras
    from keras import ops

    tokens = np.array([[3, 5, 2, 0, 0], [4, 1, 2, 6, 0]])
    embedding = keras.layers.Embedding(8, 16, mask_zero=True)
    layer = _layer()
    embedded = embedding(tokens)
    plain = ops.convert_to_tensor(ops.convert_to_numpy(embedded))  # the same values, no implicit mask
    expected = layer(plain, query_mask=ops.convert_to_tensor(tokens != 0))
    _close(layer(embedded), expected, "eager call on an embedding with mask_zero")
    inputs = keras.Input((5,), dtype="int32")
    model = keras.Model(inputs, layer(embedding(inputs)))
    _close(model(tokens), expected, "functional model on an embedding with mask_zero")
    query = ops.convert_to_tensor(_inputs((2, 3, 16)))
    cross = layer(query, ops.convert_to_tensor(ops.convert_to_numpy(embedded)), key_mask=tokens != 0)
    _close(layer(query, embedded), cross, "cross-attention to an embedding with mask_zero")
    from keras.src.backend import get_keras_mask

    carried = get_keras_mask(layer(embedded))
    assert carried is not None and (_numpy(carried) == (tokens != 0)).all(), "the output does not carry the mask"


def check_mask_warnings():
    """An all-False key_mask computes (every row gives output_bias) and warns once per layer."""
    from Keras import AttentionMaskWarning

    layer, x = _layer(), _inputs()
    empty = np.zeros((2, 6), dtype=bool)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = layer(x, key_mask=empty)
        layer(x, key_mask=empty)
    raised = [w for w in caught if issubclass(w.category, AttentionMaskWarning)]
    assert len(raised) == 1 and "keeps no key" in str(raised[0].message), [str(w.message) for w in caught]
    bias = layer.export_weights()["output_bias"]
    _close(output, np.broadcast_to(bias, (2, 6, 16)), "an all-False key_mask gives output_bias", 0.0)


def check_builtins():
    """`from_keras` of the built-ins (MultiHeadAttention, GroupQueryAttention) gives their outputs,
    and `to_keras` gives this layer's, called in Keras' order (query, value, key)."""
    import keras

    from Keras import MultiHeadAttention

    x, kv = _inputs(), _inputs((2, 5, 16), seed=4)
    for builtin in (keras.layers.MultiHeadAttention(4, 4), keras.layers.GroupQueryAttention(4, 4, 2)):
        expected = builtin(x, kv, kv)
        _close(MultiHeadAttention.from_keras(builtin)(x, kv, kv), expected, f"from_keras({type(builtin).__name__})")
    for layer in (_layer(), _layer(num_kv_heads=2)):
        _close(layer.to_keras()(x, kv, kv), layer(x, kv, kv), f"to_keras() with K={layer.num_kv_heads}")


def check_while_loop_decode():
    """Decoding token by token inside `ops.while_loop` (the cache a loop variable) equals the
    full causal pass, with a rolling window and left padding."""
    from keras import ops

    layer = _layer(num_kv_heads=2, rope_theta=10000.0, window=3)
    x = _inputs((2, 7, 16))
    keep = np.ones((2, 5), dtype=bool)
    keep[1, :2] = False  # the second prompt is left-padded by two tokens
    full = _numpy(layer(x, causal=True, query_mask=np.pad(keep, ((0, 0), (0, 2)), constant_values=True)))
    inputs = ops.convert_to_tensor(x)

    def step(i, outputs, cache):
        token = ops.slice(inputs, (0, i, 0), (2, 1, 16))  # (B, 1, E)
        output, cache = layer(token, causal=True, cache=cache)
        return i + 1, ops.slice_update(outputs, (0, i, 0), output), cache

    start = (0, ops.zeros((2, 7, 16)), layer.init_cache(2, 5, keep=keep))
    _, outputs, _ = ops.while_loop(lambda i, *_: i < 7, step, start)
    rows = np.pad(keep, ((0, 0), (0, 2)), constant_values=True)  # padded queries attend nothing in the full pass
    _close(_numpy(outputs)[rows], full[rows], "while_loop decoding against the full pass")


def check_mixed_precision():
    """Under mixed_float16 and mixed_bfloat16 the output has the compute dtype and is near float32's."""
    import keras

    x = _inputs()
    expected = _numpy(_layer()(x))
    for policy, tolerance in (("mixed_float16", 1e-2), ("mixed_bfloat16", 5e-2)):
        layer = _layer(dtype=policy)
        output = layer(x)
        assert keras.backend.standardize_dtype(output.dtype) == policy.split("_")[1], (policy, output.dtype)
        _close(output, expected, policy, tolerance)


def check_clip_qkv():
    """`clip_qkv` on this backend: the clamp's gradient is 1 on the bounds and 0 outside (JAX's
    `clip` gives 0.5 on a bound), as the NumPy reference's backward; one token, so the weight is 1
    and d value_bias = (g @ output_kernel^T) where |v| <= c. Then projections already within
    [-c, c] pass unchanged though QK-norm makes them larger: the clamp comes before QK-norm."""
    from shared_tests.cases import Case, make_data
    from shared_tests.keras_backends import _case_result

    c = 0.5
    case = Case("clip_qkv_bounds", t=1, s=1, self_attention=True, variants=(("clip_qkv", c),))
    data = make_data(case)
    weights = data["weights"]
    weights["value_kernel"][:, :2], weights["value_bias"][:2] = 0.0, (c, -c)  # v[..., 0] = c, v[..., 1] = -c
    grads = _case_result(case, data).grads
    v = data["query"].astype(np.float64) @ weights["value_kernel"] + weights["value_bias"]  # (B, 1, E)
    within = np.abs(v) <= c
    assert within[..., :2].all() and (~within).mean() > 0.3, "the case does not reach both sides of the clamp"
    expected = ((data["grad_output"] @ weights["output_kernel"].T.astype(np.float64)) * within).sum((0, 1))
    _close(grads["value_bias"], expected, "d value_bias (1 within [-c, c], bounds included; 0 outside)")
    assert (grads["value_bias"][~within.any((0, 1))] == 0).all(), "a clamped feature has a gradient"

    small = _layer(qk_norm="head", rope_theta=100.0)
    small.import_weights(
        {
            name: w * (0.01 if name.startswith(("query", "key", "value")) and "norm" not in name else 1.0)
            for name, w in small.export_weights().items()
        }
    )
    clipped = _layer(qk_norm="head", rope_theta=100.0, clip_qkv=c)
    clipped.import_weights(small.export_weights())
    _close(clipped(_inputs(), causal=True), small(_inputs(), causal=True), "projections within [-c, c]", 0.0)


def check_tensorflow_file_refuses():
    """The TensorFlow file under another backend refuses at construction, naming the Keras file."""
    from TensorFlow import MultiHeadAttention

    try:
        MultiHeadAttention(16, 4)
    except ValueError as error:
        assert "Keras/Multi_Head_Attention.py" in str(error), str(error)
    else:
        raise AssertionError("the TensorFlow file constructed a layer under another backend")


def check_save(folder):
    """Saves a functional model holding the layer (GQA, RoPE, QK-norm, sinks, window) to
    FOLDER/model.keras, with its inputs and outputs."""
    import keras

    layer = _layer(**SAVED_CONFIG)
    inputs = keras.Input((6, 16))
    model = keras.Model(inputs, layer(inputs, causal=True))
    x = _inputs()
    os.makedirs(folder, exist_ok=True)
    model.save(os.path.join(folder, "model.keras"))
    np.savez(os.path.join(folder, "io.npz"), x=x, y=_numpy(model(x)))


def check_load(folder):
    """Loads FOLDER/model.keras (saved on another backend) and gives the outputs saved with it."""
    import keras

    import Keras  # noqa: F401  (registers the layer for deserialization)

    model = keras.models.load_model(os.path.join(folder, "model.keras"))
    with np.load(os.path.join(folder, "io.npz")) as saved:
        _close(model(saved["x"]), saved["y"], f"the model saved in {os.path.basename(folder)}")


CHECKS = {
    "fit_compiled": check_fit_compiled,
    "fit": check_fit,
    "dropout": check_dropout,
    "mask_alias": check_mask_alias,
    "implicit_mask": check_implicit_mask,
    "mask_warnings": check_mask_warnings,
    "builtins": check_builtins,
    "while_loop_decode": check_while_loop_decode,
    "mixed_precision": check_mixed_precision,
    "clip_qkv": check_clip_qkv,
    "tensorflow_file_refuses": check_tensorflow_file_refuses,
    "save": check_save,
    "load": check_load,
}


def run(name):
    """Runs the check "NAME" or "NAME:ARGUMENT"."""
    check, _, argument = name.partition(":")
    return CHECKS[check](argument) if argument else CHECKS[check]()
