"""Checks of the Keras file that run inside one backend's process (shared_tests/keras_backends.py).

Each check raises (an AssertionError saying what differs) or returns None; `CHECKS` names them.
A check named "save:FOLDER" or "load:FOLDER" takes that folder: `save` writes a `.keras` model
with its inputs and outputs there, `load` loads one written by another backend and compares,
waiting until it is written (the backends' processes may run side by side).
"""

import os
import time
import warnings

import numpy as np

TOLERANCE = 1e-5  # float32 outputs, as the SPEC's output tolerance
SAVED_WAIT = 600  # seconds a `load` check waits for another backend's process to save its model
SAVED_CONFIG = dict(
    d_model=16, num_heads=4, num_kv_heads=2, rope_theta=10000.0, rope_sections=[1, 1], qk_norm="per_head",
    qk_norm_type="layer", qk_norm_bias=True, sinks=True, window=(3, 2), attention_chunk_size=4,
)  # fmt: skip
MLA_CONFIG = dict(
    num_kv_heads=2, kv_lora_rank=6, q_lora_rank=5, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=3,
    rope_theta=100.0, rope_interleaved=True, window=(3, 2), sinks=True, bias=("query_b", "key_value_b", "output"),
)  # fmt: skip


def _layer(seed=0, **config):
    from Keras import MultiHeadAttention

    layer = MultiHeadAttention(**{"d_model": 16, "num_heads": 4, "kernel_initializer": "zeros", **config})
    rng = np.random.default_rng(seed)  # the weights imported at once: zeros spare JAX a random program a shape
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
    `torch.compile`: the compiled step's first loss equals the loss of an eager call at the same
    weights, and the loss falls. (`predict` would compile a second program, of about 17 s of CPU.)
    Regression: the layer's call broke dynamo's graph (RoPE's NumPy frequencies, Keras' flash
    check building `SDPAParams`), each break a graph of its own to compile; it traces whole."""
    import keras
    import torch

    from Keras import MultiHeadAttention

    keras.utils.set_random_seed(0)
    tokens, layer = keras.Input((8, 16)), MultiHeadAttention(16, 4, num_kv_heads=2, rope_theta=10000.0)
    attended = layer(tokens, causal=True)
    explained = torch._dynamo.explain(lambda x: layer(x, causal=True))(keras.ops.convert_to_tensor(_inputs((2, 8, 16))))
    assert explained.graph_break_count == 0, [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    model = keras.Model(tokens, keras.layers.Dense(1)(attended))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=True)
    x, y = _inputs((16, 8, 16)), _inputs((16, 8, 1), seed=2)
    eager = keras.losses.MeanSquaredError()(y[:8], model(x[:8], training=True))  # the first batch, before a step
    first = []  # the compiled step's loss of the first batch
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: first.append(logs["loss"]))
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[record]).history["loss"]
    assert np.isfinite(history).all() and history[-1] < history[0], f"the loss did not fall: {history}"
    _close(np.float32(first[0]), eager, "the compiled step's first loss against an eager call")


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
    """`from_keras` of the built-ins (MultiHeadAttention, GroupQueryAttention, with `use_gate` with
    and without `use_bias`) gives their outputs, and `to_keras` gives this layer's, called in Keras'
    order (query, value, key); a softplus gate, which the built-ins' sigmoid gate cannot hold, is refused."""
    import keras

    from Keras import MultiHeadAttention

    x, kv = _inputs(), _inputs((2, 5, 16), seed=4)
    for builtin in (
        keras.layers.MultiHeadAttention(4, 4),
        keras.layers.GroupQueryAttention(4, 4, 2),
        keras.layers.MultiHeadAttention(4, 4, use_gate=True),
        keras.layers.GroupQueryAttention(4, 4, 2, use_gate=True, use_bias=False),
    ):
        expected = builtin(x, kv, kv)
        what = f"from_keras({type(builtin).__name__}, use_gate={builtin.get_config()['use_gate']})"
        _close(MultiHeadAttention.from_keras(builtin)(x, kv, kv), expected, what)
    for layer in (_layer(), _layer(num_kv_heads=2), _layer(gate=True), _layer(num_kv_heads=2, gate=True, bias=False)):
        what = f"to_keras() with K={layer.num_kv_heads}, gate={layer.gate}"
        _close(layer.to_keras()(x, kv, kv), layer(x, kv, kv), what)
    try:
        _layer(gate=True, gate_activation="softplus").to_keras()
    except ValueError as error:
        assert "Received: gate_activation='softplus'" in str(error), f"softplus gate to_keras: {error}"
    else:
        raise AssertionError("to_keras took a softplus gate, which the Keras built-ins cannot hold")


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


def check_float64():
    """Regression: a float64 layer computed in float32 in places, 1e-8 to 2.5e-7 from the NumPy
    file. On torch its output was float32: Keras' type promotion narrows float64 to float32 on
    every backend but TensorFlow in `ops.matmul`, `ops.dot_product_attention`, `ops.mean` (the
    norms) and `ops.maximum` (a float mask). On TensorFlow and torch a `scale` not exact in float32
    was rounded to float32 (`ops.cast` of a Python float). A float64 layer (GQA with a gate, sinks,
    LayerNorm QK-norm; MLA without RoPE, its latents' RMSNorm and a two-sided window), with a
    float64 mask, gives float64 outputs equal to the NumPy file's within the SPEC's float64 tolerance on
    the default, explicit and memory-efficient paths and decoding token by token (JAX, without
    x64, has no float64: not run there)."""
    from keras import ops

    from NumPy import MultiHeadAttention
    from shared_tests.cases import FLOAT64_TOLERANCES

    tolerance = FLOAT64_TOLERANCES["plain"]["output"]
    x = _inputs((2, 5, 16)).astype(np.float64)
    key_mask = np.array([[False, True, True, True, True], [True] * 5])  # left padding
    mask = np.random.default_rng(2).normal(scale=0.3, size=(2, 5, 5))  # (B, T, S) float64, added to the scores
    latent = {name: value for name, value in MLA_CONFIG.items() if not name.startswith("rope")}  # NoPE latents
    gated = {"num_kv_heads": 2, "gate": True, "sinks": True, "qk_norm": "head", "qk_norm_type": "layer", "head_dim": 6}
    for config in (gated, latent):  # scales 6 ** -0.5 and 6 ** -0.5, not exact in float32
        layer = _layer(dtype="float64", **config)
        reference = MultiHeadAttention(d_model=16, num_heads=4, **config)
        reference.import_weights(layer.export_weights())
        masked = reference(x, attention_mask=mask, key_mask=key_mask, causal=True)
        for path, threshold, attention in (("default", None, False), ("explicit", None, True), ("memory", 0, False)):
            if threshold is not None:
                layer.memory_efficient_threshold = threshold
            query = ops.convert_to_tensor(x)
            output = layer(query, attention_mask=mask, key_mask=key_mask, causal=True, return_attention=attention)
            output = output[0] if attention else output
            assert ops.convert_to_numpy(output).dtype == np.float64, (config, path, output.dtype)
            _close(output, masked, f"float64 {path} path of {sorted(config)}", tolerance)
        expected = reference(x, key_mask=key_mask, causal=True)
        cache, outputs = layer.init_cache(2, 5), []
        for t in range(5):
            output, cache = layer(ops.convert_to_tensor(x[:, t : t + 1]), key_mask=key_mask[:, t : t + 1], causal=True,
                                  cache=cache)  # fmt: skip
            outputs.append(_numpy(output))
        _close(np.concatenate(outputs, 1), expected, f"float64 decoding of {sorted(config)}", tolerance)


def check_clip_qkv():
    """`clip_qkv` on this backend: the clamp's gradient is 1 on the bounds and 0 outside (JAX's
    `clip` gives 0.5 on a bound), as the NumPy reference's backward; one token, so the weight is 1
    and d value_bias = (g @ output_kernel^T) where |v| <= c. Then projections already within
    [-c, c] pass unchanged though QK-norm makes them larger: the clamp comes before QK-norm."""
    from shared_tests.cases import Case, make_data
    from shared_tests.keras_paths import case_result

    c = 0.5
    case = Case("clip_qkv_bounds", t=1, s=1, self_attention=True, variants=(("clip_qkv", c),))
    data = make_data(case)
    weights = data["weights"]
    weights["value_kernel"][:, :2], weights["value_bias"][:2] = 0.0, (c, -c)  # v[..., 0] = c, v[..., 1] = -c
    grads = case_result(case, data).grads
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


def _numpy_result(case, data):
    """The NumPy reference's Result (float64) of one case."""
    from shared_tests import numpy_runner

    return numpy_runner.run(case, data)


def _matches_numpy(case, data, what):
    """This backend's output, weights and gradients (float32 cases) of one case against the NumPy
    reference, within the case's tolerances, with exact zeros wherever NumPy's weights are 0."""
    from shared_tests.keras_paths import case_result

    got, expected = case_result(case, data), _numpy_result(case, data)
    _close(got.output, expected.output, f"{what}: output", case.tolerance["output"])
    _close(got.weights, expected.weights, f"{what}: weights", case.tolerance["weights"])
    assert (got.weights[expected.weights == 0] == 0).all(), f"{what}: a removed key has a weight"
    if case.tolerance["grads"] is not None:
        assert set(got.grads) == set(expected.grads), (what, sorted(got.grads), sorted(expected.grads))
        for name, grad in expected.grads.items():
            _close(got.grads[name], grad, f"{what}: d {name}", case.tolerance["grads"])
    return got


def _decodes_like_numpy(case, what):
    """A decode case (shared_tests/decoding.py) on this backend (each step under `jax.jit` on JAX):
    chunk by chunk equals its own full pass and NumPy's decoding, and ends with NumPy's cache."""
    from shared_tests import numpy_runner
    from shared_tests.decoding import make_decode_data
    from shared_tests.keras_paths import decode_result

    data = make_decode_data(case)
    got, expected = decode_result(case, data), numpy_runner.decode(case, data)
    tolerance = case.tolerance
    _close(got.output, got.full_output, f"{what}: decoding against the full pass", tolerance["output"])
    _close(got.output, expected.output, f"{what}: decoded output against NumPy", tolerance["output"])
    _close(got.weights, expected.weights, f"{what}: decoded weights against NumPy", tolerance["weights"])
    assert (got.weights[expected.weights == 0] == 0).all(), f"{what}: a removed slot has a weight"
    for name in ("key", "value"):
        _close(got.cache[name], expected.cache[name], f"{what}: cache.{name}", tolerance["output"])
    assert (got.cache["keep"] == expected.cache["keep"]).all(), f"{what}: cache.keep"


def _while_loop_decode(layer, x, positions=None):
    """Decodes (B, P, E) `x` token by token inside `ops.while_loop` (the cache a loop variable;
    `positions` (..., B, P) sliced per token when given) and returns the (B, P, E) outputs."""
    from keras import ops

    b, p, e = x.shape
    inputs = ops.convert_to_tensor(x)
    given = None if positions is None else ops.convert_to_tensor(positions, "int32")

    def step(i, outputs, cache):
        token = ops.slice(inputs, (0, i, 0), (b, 1, e))  # (B, 1, E)
        extra = {}
        if given is not None:
            start = (0,) * (len(given.shape) - 1) + (i,)
            extra["positions"] = ops.slice(given, start, (*given.shape[:-1], 1))  # (..., B, 1)
        output, cache = layer(token, causal=True, cache=cache, **extra)
        return i + 1, ops.slice_update(outputs, (0, i, 0), output), cache

    start = (0, ops.zeros((b, p, e)), layer.init_cache(b, p))
    _, outputs, _ = ops.while_loop(lambda i, *_: i < p, step, start)
    return _numpy(outputs)


def _saves_and_loads(layer, x, what, **call):
    """A functional model holding `layer` saved to `.keras` and loaded back gives the same outputs,
    and the loaded layer has the same config."""
    import tempfile

    import keras

    import Keras  # noqa: F401  (registers the layer for deserialization)

    inputs = keras.Input(x.shape[1:])
    model = keras.Model(inputs, layer(inputs, **call))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    _close(loaded(x), model(x), f"{what}: the model loaded from .keras", 0.0)
    config = next(lay for lay in loaded.layers if type(lay) is type(layer)).get_config()
    assert {k: v for k, v in config.items() if k != "name"} == {
        k: v for k, v in layer.get_config().items() if k != "name"
    }, f"{what}: the loaded config differs"


def check_window_pair():
    """A two-sided `window=(W_before, W_after)`: outputs, weights and gradients equal NumPy's
    (self-attention, cross-attention with T < S, GQA and a mask); `window_mask` equals NumPy's and
    keeps exactly the band; an int W is the pair (W, large); decoding (rolling cache, causal)
    equals the full pass and NumPy's, in `ops.while_loop` too; `.keras` keeps the pair."""
    from keras import ops

    from Keras.Multi_Head_Attention import window_mask
    from NumPy import Multi_Head_Attention as NumPy
    from shared_tests.cases import Case, make_data
    from shared_tests.decoding import DecodeCase

    for t, s, window in ((6, 6, (2, 3)), (4, 7, (3, 1)), (5, 5, (1, 1)), (7, 7, (65, 65))):
        got = _numpy(window_mask(t, s, window)).astype(bool)
        assert (got == NumPy.window_mask(t, s, window)).all(), f"window_mask({t}, {s}, {window})"
        offset = np.arange(s)[None, :] - np.arange(t)[:, None] - (s - t)  # key minus query position
        assert (got == ((offset > -window[0]) & (offset < window[1]))).all(), f"the band of {window}"
    wide = _numpy(window_mask(5, 8, (3, 100))).astype(bool)
    assert (wide == _numpy(window_mask(5, 8, 3)).astype(bool)).all(), "an int W is (W, beyond every key)"
    cases = (
        Case("window_pair_self", t=7, s=7, self_attention=True, variants=(("window", (2, 3)),)),
        Case("window_pair_cross_gqa", t=4, s=7, k=2, mask="bool_bts", variants=(("window", [3, 2]),)),
        Case("window_pair_causal_rope", t=6, s=6, causal=True, variants=(("window", (3, 2)), ("rope_theta", 100.0))),
    )
    for case in cases:
        _matches_numpy(case, make_data(case), case.name)
    decode = DecodeCase(
        "decode_window_pair", chunks=(3, 1, 1, 1, 1), length=4, k=2, padding=(0, 1),
        variants=(("window", (3, 2)), ("rope_theta", 100.0)),
    )  # fmt: skip
    _decodes_like_numpy(decode, decode.name)
    layer, x = _layer(num_kv_heads=2, window=(3, 2), rope_theta=100.0), _inputs((2, 7, 16))
    _close(_while_loop_decode(layer, x), layer(x, causal=True), "window pair: while_loop decoding", 1e-5)
    assert layer.window == (3, 2) and layer.get_config()["window"] == [3, 2], layer.get_config()["window"]
    _saves_and_loads(layer, ops.convert_to_tensor(x), "window pair")


def check_attention_chunk():
    """`attention_chunk_size=C`: outputs, weights and gradients equal NumPy's (bidirectional in a
    chunk; causal; T < S bottom-right aligned; with a window); `attention_chunk_mask` equals NumPy's;
    decoding (with a prefill that crosses a chunk) equals the full pass and NumPy's, in
    `ops.while_loop` too; `.keras` keeps it."""
    from keras import ops

    from Keras.Multi_Head_Attention import attention_chunk_mask, dot_product_attention
    from NumPy import Multi_Head_Attention as NumPy
    from shared_tests.cases import Case, make_data
    from shared_tests.decoding import DecodeCase

    for t, s, size in ((7, 7, 3), (3, 8, 4), (5, 5, 1), (4, 4, 9)):
        got = _numpy(attention_chunk_mask(t, s, size)).astype(bool)
        assert (got == NumPy.attention_chunk_mask(t, s, size)).all(), f"attention_chunk_mask({t}, {s}, {size})"
    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=shape).astype(np.float32) for shape in ((2, 4, 6, 4), (2, 2, 6, 4), (2, 2, 6, 4)))
    expected = NumPy.dot_product_attention(q, k, v, attention_chunk_size=4, window=(2, 2))
    got = dot_product_attention(*(ops.convert_to_tensor(x) for x in (q, k, v)), attention_chunk_size=4, window=(2, 2))
    for name, a, b in zip(("context", "weights"), got, expected, strict=True):
        _close(a, b, f"dot_product_attention with attention_chunk_size: {name}")
    cases = (
        Case("chunk_self", t=7, s=7, self_attention=True, variants=(("attention_chunk_size", 3),)),
        Case("chunk_causal_gqa", t=7, s=7, k=2, causal=True, variants=(("attention_chunk_size", 3),)),
        Case("chunk_cross", t=3, s=8, mask="bool_ts", variants=(("attention_chunk_size", 4),)),
        Case("chunk_window", t=8, s=8, variants=(("attention_chunk_size", 4), ("window", (2, 2)))),
    )
    for case in cases:
        _matches_numpy(case, make_data(case), case.name)
    decode = DecodeCase(
        "decode_chunk", chunks=(4, 1, 1, 1, 1), length=8, k=2, padding=(1, 0),
        variants=(("attention_chunk_size", 3), ("rope_theta", 100.0)),
    )  # fmt: skip
    _decodes_like_numpy(decode, decode.name)
    layer, x = _layer(attention_chunk_size=3, window=2, sinks=True), _inputs((2, 7, 16))
    _close(_while_loop_decode(layer, x), layer(x, causal=True), "attention chunk: while_loop decoding", 1e-5)
    assert layer.get_config()["attention_chunk_size"] == 3 and layer._non_defaults()["attention_chunk_size"] == 3
    _saves_and_loads(layer, ops.convert_to_tensor(x), "attention chunk")


def check_rope_sections():
    """`rope_sections` (multimodal RoPE): with (k, B, T) positions the outputs, weights and
    gradients equal NumPy's (also with rope_fraction, interleaved pairs and YaRN); one row of
    positions for every section is plain RoPE, and the pairs dealt to the rows in turn
    (`rope_sections_interleaved`) too; decoding with (k, B, 1) positions (each step under
    `jax.jit` on JAX) and in `ops.while_loop` equals the full pass; `.keras` keeps the sections."""
    import keras
    from keras import ops

    from shared_tests.cases import YARN_SCALING, Case, make_data
    from shared_tests.keras_paths import jitted_step

    rng = np.random.default_rng(6)
    cases = (
        (Case("mrope", e=32, t=6, s=6, self_attention=True, variants=(
            ("rope_theta", 100.0), ("rope_sections", (1, 2, 1)),
        )), 3),
        (Case("mrope_fraction_interleaved_gqa", e=32, t=5, s=5, k=2, causal=True, variants=(
            ("rope_theta", 1000.0), ("rope_fraction", 0.5), ("rope_interleaved", True), ("rope_sections", [1, 1]),
        )), 2),
        (Case("mrope_yarn", e=32, t=5, s=5, variants=(
            ("rope_theta", 10000.0), ("rope_scaling", YARN_SCALING), ("rope_sections", (2, 2)),
        )), 2),
        (Case("mrope_dealt", e=32, t=5, s=5, causal=True, variants=(
            ("rope_theta", 100.0), ("rope_sections", (2, 1, 1)), ("rope_sections_interleaved", True),
        )), 3),
    )  # fmt: skip
    for case, k in cases:
        data = make_data(case)
        data["positions"] = rng.integers(0, 40, size=(k, case.b, case.t))  # (k, B, T), one row per section
        _matches_numpy(case, data, case.name)
    layer, x = _layer(num_kv_heads=2, rope_theta=100.0, rope_sections=(1, 1)), _inputs((2, 7, 16))
    plain = _layer(num_kv_heads=2, rope_theta=100.0)
    positions = rng.integers(0, 30, size=(2, 7))  # (B, T)
    for given in (positions, np.stack([positions] * 2)):  # (B, T) and (k, B, T) of equal rows
        _close(layer(x, positions=given), plain(x, positions=positions), "one row for every section is plain RoPE")
    _close(layer(x), plain(x), "the default positions in every section")
    sections = np.stack([np.arange(7)[None].repeat(2, 0), rng.integers(0, 9, size=(2, 7))])  # (k, B, P)
    full = _numpy(layer(x, positions=sections, causal=True))
    step = jitted_step(layer, Case("step", causal=True)) if keras.backend.backend() == "jax" else None
    cache, outputs = layer.init_cache(2, 7), []
    for start, stop in ((0, 3), (3, 4), (4, 5), (5, 7)):
        chunk, extra = {"query": ops.convert_to_tensor(x[:, start:stop])}, {"positions": sections[..., start:stop]}
        if step is None:
            output, _, cache = layer(**chunk, **extra, causal=True, return_attention=True, cache=cache)
        else:
            output, _, cache = step(chunk, None, cache, {"positions": ops.convert_to_tensor(extra["positions"])})
        outputs.append(_numpy(output))
    _close(np.concatenate(outputs, 1), full, "M-RoPE decoding against the full pass")
    _close(_while_loop_decode(layer, x, sections), full, "M-RoPE while_loop decoding", 1e-5)
    _close(_while_loop_decode(layer, x), plain(x, causal=True), "M-RoPE while_loop decoding, default positions", 1e-5)
    assert layer.get_config()["rope_sections"] == [1, 1] and layer.rope_sections == (1, 1)
    dealt = _layer(num_kv_heads=2, rope_theta=100.0, rope_sections=(1, 1), rope_sections_interleaved=True)
    assert type(dealt).from_config(dealt.get_config()).rope_sections_interleaved is True
    _saves_and_loads(layer, ops.convert_to_tensor(x), "rope sections")


def check_qk_norm_variants():
    """QK-norm "per_head" (a scale per head), `qk_norm_type="layer"` (LayerNorm) and
    `qk_norm_bias`: outputs, weights and gradients (the norm biases' included) equal NumPy's; a
    fresh layer's norm scales are ones and its norm biases zeros (whatever `bias_initializer`);
    "per_head" with every head's scale equal is "head"; mixed precision keeps the norm in float32
    (outputs near float32's); decoding equals the full pass and NumPy's; `.keras` keeps the new
    arguments."""
    import keras
    from keras import ops

    from Keras import MultiHeadAttention
    from shared_tests.cases import Case, make_data
    from shared_tests.decoding import DecodeCase

    cases = (
        Case("qk_norm_per_head_gqa", k=2, causal=True, variants=(("qk_norm", "per_head"),)),
        Case("qk_layer_norm_head_bias", variants=(
            ("qk_norm", "head"), ("qk_norm_type", "layer"), ("qk_norm_bias", True),
        )),
        Case("qk_layer_norm_per_head_bias_rope", k=2, variants=(
            ("qk_norm", "per_head"), ("qk_norm_type", "layer"), ("qk_norm_bias", True), ("rope_theta", 100.0),
        )),
        Case("qk_rms_norm_all_bias", k=1, variants=(("qk_norm", "all"), ("qk_norm_bias", True))),
        Case("qk_layer_norm_all", variants=(("qk_norm", "all"), ("qk_norm_type", np.str_("layer")))),
    )  # fmt: skip
    for case in cases:
        _matches_numpy(case, make_data(case), case.name)
    fresh = MultiHeadAttention(16, 4, num_kv_heads=2, qk_norm="per_head", qk_norm_bias=True, bias_initializer="ones")
    fresh.build()
    for name, fill in (("query_norm", 1.0), ("key_norm", 1.0), ("query_norm_bias", 0.0), ("key_norm_bias", 0.0)):
        value = _numpy(fresh._variable(name))
        assert value.shape == fresh.weight_shapes()[name] and (value == fill).all(), f"initial {name}"
    head = _layer(qk_norm="head", qk_norm_type="layer", num_kv_heads=2)
    per_head = _layer(qk_norm="per_head", qk_norm_type="layer", num_kv_heads=2)
    weights = head.export_weights()
    per_head.import_weights(
        {**weights, "query_norm": np.tile(weights["query_norm"], 4), "key_norm": np.tile(weights["key_norm"], 2)}
    )
    x = _inputs()
    _close(per_head(x), head(x), "per_head with equal scales against head", 1e-6)
    config = dict(num_kv_heads=2, qk_norm="per_head", qk_norm_type="layer", qk_norm_bias=True, rope_theta=100.0)
    expected = _numpy(_layer(**config)(x))
    for policy, tolerance in (("mixed_float16", 1e-2), ("mixed_bfloat16", 5e-2)):
        output = _layer(**config, dtype=policy)(x)
        assert keras.backend.standardize_dtype(output.dtype) == policy.split("_")[1], (policy, output.dtype)
        _close(output, expected, f"LayerNorm QK-norm under {policy}", tolerance)
    decode = DecodeCase(
        "decode_qk_layer_norm",
        k=2,
        padding=(0, 2),
        variants=tuple((n, v) for n, v in config.items() if n != "num_kv_heads"),
    )
    _decodes_like_numpy(decode, decode.name)
    layer = _layer(**config)
    assert {name: layer.get_config()[name] for name in ("qk_norm", "qk_norm_type", "qk_norm_bias")} == {
        "qk_norm": "per_head", "qk_norm_type": "layer", "qk_norm_bias": True,
    }  # fmt: skip
    _saves_and_loads(layer, ops.convert_to_tensor(x), "qk_norm variants", causal=True)


def _case_table():
    """This backend's case table: all of shared_tests/cases.py, JAX's trimmed (`JAX_CASES`)."""
    import keras

    from shared_tests.cases import CASES, CASES_BY_NAME
    from shared_tests.keras_paths import JAX_CASES

    return [CASES_BY_NAME[name] for name in JAX_CASES] if keras.backend.backend() == "jax" else CASES


def _every_case_on(path, function, reaches):
    """Every case of `_case_table()` with `path(case)` set on its layer (a call without weights):
    output and gradients against NumPy's; `function`, a fast path of the Keras file, must be
    reached by each case for which `reaches(case)` holds, and only by those."""
    from Keras import Multi_Head_Attention as module
    from shared_tests.cases import make_data
    from shared_tests.keras_paths import case_result

    name, original, reached = function.__name__, function, []

    def counted(*args, **kwargs):
        reached.append(True)
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        for case in _case_table():
            data = make_data(case)
            try:
                expected = _numpy_result(case, data)
            except ValueError:  # a case every file refuses (the reference too): no path to compare
                continue
            got = case_result(case, data, path(case))
            _close(got.output, expected.output, f"{case.name}: output", case.tolerance["output"])
            for grad, value in (expected.grads if case.tolerance["grads"] is not None else {}).items():
                _close(got.grads[grad], value, f"{case.name}: d {grad}", case.tolerance["grads"])
            assert bool(reached) == reaches(case), f"{case.name}: {name} reached: {bool(reached)}"
            reached.clear()
    finally:
        setattr(module, name, original)


def check_memory_efficient():
    """Every case on the memory-efficient path (`memory_efficient_threshold = 0`, two queries per
    chunk, so an odd T leaves a padded chunk), without weights: outputs and gradients (of the
    inputs, `attention_bias`, every weight, the sinks) equal NumPy's."""
    from Keras import Multi_Head_Attention as module

    def path(case):
        def chunked(layer):
            layer.memory_efficient_threshold, layer.fused_attention = 0, False
            layer.query_chunk_elements = 2 * case.b * case.n * max(case.s, 1)

        return chunked

    _every_case_on(path, module._chunked_attention, lambda case: case.t * case.s > 0)


def check_fused():
    """Every case through `ops.dot_product_attention` (`fused_attention = True`, on every backend),
    without weights: outputs and gradients equal NumPy's; soft-capping and empty T or S stay on
    the reference."""
    from Keras import Multi_Head_Attention as module

    def path(case):
        def fused(layer):
            layer.fused_attention = True

        return fused

    reaches = lambda case: case.t * case.s > 0 and "softcap" not in dict(case.variants)  # noqa: E731
    _every_case_on(path, module._fused_attention, reaches)


def _gradients(function, args):
    """The gradients of sum(function(*args)) with respect to each of `args`, on this backend (on
    JAX under one `jax.jit`: eager JAX compiles each op of the backward pass on its own, about
    three times the CPU of one compiled program)."""
    import keras
    from keras import ops

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.jit(jax.grad(lambda *a: ops.sum(function(*a)), argnums=tuple(range(len(args)))))(*args)
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(args)
            total = ops.sum(function(*args))
        return tape.gradient(total, args)
    args = [x.detach().requires_grad_(True) for x in args]
    ops.sum(function(*args)).backward()
    return [x.grad for x in args]


def check_memory_efficient_dropout():
    """Dropout on the memory-efficient path (GQA, causal, a mask, a bias, sinks): two queries per
    chunk equal the reference formula with the same mask (a hash of the seed and each weight's
    index, so whatever the chunk size), output and gradients; the seed changes it."""
    from keras import ops

    from Keras import Multi_Head_Attention as module

    rng = np.random.default_rng(5)
    q, k, v = (
        ops.convert_to_tensor(rng.normal(size=shape).astype(np.float32))
        for shape in [(2, 4, 5, 8)] + [(2, 2, 7, 8)] * 2
    )
    bias = ops.convert_to_tensor(rng.normal(size=(2, 1, 5, 7)).astype(np.float32))
    sinks = ops.convert_to_tensor(rng.normal(size=(4,)).astype(np.float32))
    keep = ops.convert_to_tensor(rng.random((2, 1, 5, 7)) < 0.8)
    seed = ops.convert_to_tensor([3, -9], "int32")
    whole = module._Chunks(None, True, None, None, None, None, 5, 1, 5, 7, 0.4, seed, "float32", (2, 4, 2, 2, 8))
    mask = module._dropout_keep(whole, 0, "float32")  # (B, N, T, S)

    def chunked(q, k, v, bias, sinks):
        return module._chunked_attention(q, k, v, keep, bias, True, 2, 0.4, seed, sinks=sinks)

    def reference(q, k, v, bias, sinks):
        dropout = lambda w: w * mask  # noqa: E731
        return module.dot_product_attention(q, k, v, keep, bias, True, sinks=sinks, dropout=dropout)[0]

    args = [q, k, v, bias, sinks]
    _close(chunked(*args), reference(*args), "dropout in chunks against the reference with its mask")
    pairs = zip(_gradients(chunked, args), _gradients(reference, args), strict=True)
    for name, (got, expected) in zip(("q", "k", "v", "bias", "sinks"), pairs, strict=True):
        _close(got, expected, f"dropout in chunks: d {name}")
    kept = float(ops.mean(ops.cast(mask > 0, "float32")))
    assert 0.5 < kept < 0.7, f"dropout 0.4 kept {kept:.2f} of the weights"
    other = module._dropout_keep(whole._replace(seed=seed + 1), 0, "float32")
    assert float(ops.mean(ops.cast(other != mask, "float32"))) > 0.2, "another seed draws the same mask"


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
    """Saves a functional model holding the layer (GQA, M-RoPE, per-head LayerNorm QK-norm with a
    bias, sinks, a pair window, chunks) beside an MLA layer (`MLA_CONFIG`) to FOLDER/model.keras,
    with its inputs and outputs."""
    import keras

    layer, mla = _layer(**SAVED_CONFIG), _layer(seed=1, **MLA_CONFIG)
    inputs = keras.Input((6, 16))
    model = keras.Model(inputs, keras.layers.Add()([layer(inputs, causal=True), mla(inputs, causal=True)]))
    x = _inputs()
    os.makedirs(folder, exist_ok=True)
    model.save(os.path.join(folder, "model.keras"))
    _save_io(os.path.join(folder, "io.npz"), x, model(x))


def _save_io(path, x, y):
    """Writes the inputs and outputs to `path` whole or not at all (a `load` waits for it)."""
    with open(f"{path}.part", "wb") as handle:
        np.savez(handle, x=x, y=_numpy(y))
    os.replace(f"{path}.part", path)


def _saved_io(path):
    """The inputs and outputs at `path`, waited for up to SAVED_WAIT seconds (written last, after the model)."""
    deadline = time.monotonic() + SAVED_WAIT
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"nothing saved to {path} in {SAVED_WAIT} s"
        time.sleep(0.1)
    return np.load(path)


def check_load(folder):
    """Loads FOLDER/model.keras (saved on another backend) and gives the outputs saved with it."""
    import keras

    import Keras  # noqa: F401  (registers the layer for deserialization)

    saved_io = _saved_io(os.path.join(folder, "io.npz"))
    model = keras.models.load_model(os.path.join(folder, "model.keras"))
    with saved_io as saved:
        _close(model(saved["x"]), saved["y"], f"the model saved in {os.path.basename(folder)}")


def _int8_reference(case, data):
    """The NumPy reference quantized from the case's float weights, its int8 layout, and its output
    (the step of `one_step` is that call's)."""
    from shared_tests.call_args import call_inputs
    from shared_tests.int8 import numpy_layer

    reference = numpy_layer(case, data["weights"])
    reference.quantize("int8")
    inputs = {name: data[name] for name in ("key", "value") if data[name] is not None}
    expected = reference(data["query"], **inputs, **call_inputs(data), causal=case.causal)
    return reference, reference.export_weights(), expected


def _same_layout(got, expected, what):
    """The same int8 integers and scales (and dtypes) as `expected`, and the same names."""
    assert got.keys() == expected.keys(), (what, sorted(got), sorted(expected))
    for name in (name for name in expected if name.endswith(("_kernel", "_kernel_scale"))):
        assert got[name].dtype == expected[name].dtype, (what, name, got[name].dtype)
        assert np.array_equal(got[name], expected[name]), f"{what}: {name} differs"


def check_int8_parity():
    """Each int8 case (shared_tests/int8.py): the NumPy file's int8 layout imported into a float
    layer (which it quantizes) gives the reference's output within one quantization step, and
    gradients (forward and gradient under one `jax.jit` on JAX), and exports that layout again;
    quantizing the float weights here gives NumPy's layout. The inputs' gradient is the float
    layer's with the dequantized kernels within the int8 error (Keras' straight-through
    gradient); the biases train, the int8 kernels and scales get none."""
    from shared_tests.cases import CASES_BY_NAME, make_data
    from shared_tests.int8 import CASE_NAMES, INT8_ERROR, assert_within_a_step, one_step
    from shared_tests.keras_paths import case_result, layer_of

    for name in CASE_NAMES:
        case = CASES_BY_NAME[name]
        data = make_data(case)
        reference, layout, expected = _int8_reference(case, data)
        got = case_result(case, {**data, "weights": layout})
        assert_within_a_step(got.output, expected, one_step(reference), f"{name}: output")
        _same_layout(layer_of(case, {"weights": layout}).export_weights(), layout, f"{name}: imported")
        quantized = layer_of(case, data)
        quantized.quantize("int8")
        _same_layout(quantized.export_weights(), layout, f"{name}: quantized here")
    case = CASES_BY_NAME["self_basic"]
    data = make_data(case)
    layout = _int8_reference(case, data)[1]
    dequantized = {
        name: value * layout[f"{name}_scale"] if name.endswith("_kernel") else value
        for name, value in layout.items()
        if not name.endswith("_scale")
    }
    grads = case_result(case, {**data, "weights": layout}).grads
    _close(grads["query"], case_result(case, {**data, "weights": dequantized}).grads["query"], "d query", INT8_ERROR)
    assert np.abs(grads["query"]).max() > 10 * INT8_ERROR, "the int8 layer's input gradient is zeros"
    assert np.abs(grads["output_bias"]).max() > 0, "the biases of an int8 layer get no gradient"
    assert not any(np.any(grads[name]) for name in layout if "_kernel" in name), "an int8 kernel or scale has a grad"


def check_int8_model_quantize():
    """`model.quantize("int8")` on a functional model holding the layer quantizes it as Keras
    quantizes its built-ins (the policy int8_from_float32, int8 kernels; no warning names the
    layer or its dropout), the output is the reference's within one step, and a `.keras` file
    keeps it (a loaded layer is int8, and quantizing it again is refused). Under mixed_float16
    too, which Keras' own layers refuse: the output float16 and finite, within one step and
    float16's tolerance, the policy int8_from_mixed_float16 saved and loaded."""
    for policy in ("float32", "mixed_float16"):
        _model_quantize(policy)


def _model_quantize(policy):
    import tempfile

    import keras

    import Keras  # the layer, registered for deserialization
    from shared_tests.cases import CASES_BY_NAME, make_data
    from shared_tests.int8 import assert_within_a_step, one_step

    case = CASES_BY_NAME["gqa_self_causal"]
    data = make_data(case)
    query = keras.Input((case.t, case.e))
    layer = Keras.MultiHeadAttention(**{**case.config, "dropout": 0.1}, dtype=policy)
    model = keras.Model(query, layer(query, causal=True))
    layer.import_weights(data["weights"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.quantize("int8")
    refused = [str(w.message) for w in caught if "`quantize`" in str(w.message)]
    assert all("InputLayer" in message for message in refused), refused  # neither this layer nor its dropout
    assert layer.dtype_policy.name == f"int8_from_{policy}", layer.dtype_policy.name
    assert {v.name: v.dtype for v in layer.weights}["output_kernel"] == "int8"
    reference, _, expected = _int8_reference(case, data)
    output = model(data["query"])
    assert keras.backend.standardize_dtype(output.dtype) == layer.compute_dtype, (policy, output.dtype)
    output = _numpy(output)
    assert_within_a_step(output, expected, one_step(reference), f"model.quantize, {policy}", layer.compute_dtype)
    with tempfile.TemporaryDirectory() as folder:
        model.save(os.path.join(folder, "int8.keras"))
        loaded = keras.models.load_model(os.path.join(folder, "int8.keras"))
    _close(loaded(data["query"]), output, f"the int8 model loaded from .keras, {policy}", 0.0)
    assert loaded.layers[-1].dtype_policy == layer.dtype_policy, loaded.layers[-1].dtype_policy.name
    try:
        loaded.layers[-1].quantize("int8")
    except ValueError as error:
        assert "already quantized" in str(error), str(error)
    else:
        raise AssertionError("a loaded int8 layer was quantized again")


def check_int8_decoding():
    """An int8 layer (GQA, RoPE, a rolling window) decodes token by token inside `ops.while_loop`
    (traced on JAX and TensorFlow) as its full causal pass: each token is quantized on its own."""
    layer = _layer(num_kv_heads=2, rope_theta=10000.0, window=3)
    layer.quantize("int8")
    x = _inputs((2, 7, 16))
    _close(_while_loop_decode(layer, x), layer(x, causal=True), "int8 decoding against the full pass")


def check_int8_fit():
    """`fit` of a model whose layer is int8, under XLA on TensorFlow and JAX (eager on torch): the
    loss falls (biases and the dense head train), the int8 kernels and scales stay as they were."""
    import keras

    from Keras import MultiHeadAttention

    keras.utils.set_random_seed(0)
    tokens = keras.Input((None, 16))
    layer = MultiHeadAttention(16, 4, num_kv_heads=2, rope_theta=10000.0, dropout=0.1)
    model = keras.Model(tokens, keras.layers.Dense(1)(layer(tokens, causal=True)))
    layer.quantize("int8")
    frozen = {name: value for name, value in layer.export_weights().items() if "_kernel" in name}
    jit = keras.backend.backend() in ("tensorflow", "jax")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=jit)
    x, y = _inputs((32, 8, 16)), _inputs((32, 8, 1), seed=2)
    history = model.fit(x, y, batch_size=8, epochs=4, verbose=0).history["loss"]
    assert np.isfinite(history).all() and history[-1] < history[0], f"the loss did not fall: {history}"
    after = layer.export_weights()
    assert all(np.array_equal(after[name], value) for name, value in frozen.items()), "an int8 kernel changed"
    _close(model.predict(x[:4], verbose=0), model(x[:4], training=False), "predict against a call")


def check_int8_layout_checks():
    """A float layout into an int8 layer and an int8 layout whose kernels are not integers are
    refused, naming every problem; quantizing twice, to another mode or with another config is
    refused (another mode with `NotImplementedError`, which `model.quantize` turns into a warning)."""
    import keras

    layer = _layer()
    floats = layer.export_weights()
    layer.quantize("int8")
    layout = layer.export_weights()
    refusals = (
        (lambda: layer.import_weights(floats), ValueError, "missing 'query_kernel_scale'"),
        (lambda: _layer().import_weights({**layout, "key_kernel": layout["key_kernel"].astype(np.float32)}), ValueError,
         "'key_kernel' must hold integers in [-127, 127], received dtype float32"),
        (lambda: layer.quantize("int8"), ValueError, "already quantized"),
        (lambda: _layer().quantize("int4"), NotImplementedError, "quantizes to 'int8' only"),
        (lambda: _layer().quantize(config=keras.quantizers.Int8QuantizationConfig(
            weight_quantizer=keras.quantizers.AbsMaxQuantizer(axis=0))), ValueError,
         "`config` must be Keras' default int8 config"),
    )  # fmt: skip
    for refused, error, text in refusals:
        try:
            refused()
        except error as raised:
            assert text in str(raised), str(raised)
        else:
            raise AssertionError(f"nothing raised where {error.__name__} says {text!r}")


def check_save_int8(folder):
    """Saves a functional model holding the layer (the config of `check_save`), quantized by
    `model.quantize("int8")`, to FOLDER/int8.keras with its inputs and outputs."""
    import keras

    layer = _layer(**SAVED_CONFIG)
    inputs = keras.Input((6, 16))
    model = keras.Model(inputs, layer(inputs, causal=True))
    model.quantize("int8")
    x = _inputs()
    os.makedirs(folder, exist_ok=True)
    model.save(os.path.join(folder, "int8.keras"))
    _save_io(os.path.join(folder, "int8_io.npz"), x, model(x))


def check_load_int8(folder):
    """Loads FOLDER/int8.keras (saved on another backend): an int8 layer giving the outputs saved with it."""
    import keras

    import Keras  # noqa: F401  (registers the layer for deserialization)

    saved_io = _saved_io(os.path.join(folder, "int8_io.npz"))
    model = keras.models.load_model(os.path.join(folder, "int8.keras"))
    assert model.layers[-1].dtype_policy.name == "int8_from_float32", model.layers[-1].dtype_policy.name
    with saved_io as saved:
        _close(model(saved["x"]), saved["y"], f"the int8 model saved in {os.path.basename(folder)}")


def _mla_paths(layer, x, key_mask):
    """{(path, absorbed): (output, the query's gradient)} of the MLA `layer` on the reference,
    fused and memory-efficient (two queries per chunk) paths, each expanded and absorbed; on JAX
    each path's output and gradient come from one `jax.jit` (eager, op by op, took 39 s of CPU
    against 10 s)."""
    import keras
    from keras import ops

    def loss(query):
        output = layer(query, key_mask=key_mask, causal=True)
        return ops.sum(output * ops.cos(output)), output

    paths = {"reference": (1 << 26, False), "fused": (1 << 26, True), "memory_efficient": (0, False)}
    query, results = ops.convert_to_tensor(x), {}
    layer.query_chunk_elements = 2 * x.shape[0] * layer.num_heads * x.shape[1]
    for absorb in (False, True):
        for path, (threshold, fused) in paths.items():
            layer.absorb_latents, layer.memory_efficient_threshold, layer.fused_attention = absorb, threshold, fused
            if keras.backend.backend() == "jax":  # output and gradient from one compiled program, not op by op
                import jax

                (_, output), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(query)
            else:
                output = layer(query, key_mask=key_mask, causal=True)
                grad = _gradients(lambda q: loss(q)[0], [query])[0]
            results[(path, absorb)] = (output, grad)
    layer.absorb_latents, layer.memory_efficient_threshold, layer.fused_attention = None, 1 << 26, None
    return results


def check_mla():
    """Multi-head latent attention: the reference, fused and memory-efficient paths, each expanded
    and absorbed, give the same output and query gradient; decoding with the latent cache (left
    padding, a rolling two-sided window; each step under `jax.jit` on JAX) on the expanded, the
    absorbed and the automatic path, and in `ops.while_loop`, equals the full causal pass; an int8
    layer decodes as its full pass on both paths; `.keras` and `get_config` keep the MLA options,
    and `to_keras` refuses them."""
    import keras
    from keras import ops

    from shared_tests.cases import Case
    from shared_tests.keras_paths import jitted_step

    layer, x = _layer(**MLA_CONFIG), _inputs((2, 7, 16))
    key_mask = np.array([[False, True, True, True, True, True, True], [True] * 7])  # left padding
    results = _mla_paths(layer, x, key_mask)
    expected, expected_grad = results[("reference", False)]
    for (path, absorb), (output, grad) in results.items():
        _close(output, expected, f"MLA {path} (absorbed: {absorb}) output")
        _close(grad, expected_grad, f"MLA {path} (absorbed: {absorb}) query gradient", 1e-4)
    full = _numpy(expected)  # the full causal pass (every path gives it, checked above)
    jax = keras.backend.backend() == "jax"
    for absorb in (None, False, True):
        layer.absorb_latents = absorb
        step = jitted_step(layer, Case("step", causal=True)) if jax else None
        cache, outputs = layer.init_cache(2, 4), []
        assert tuple(cache.key.shape) == (2, 1, 4, 6) and tuple(cache.value.shape) == (2, 1, 4, 2)
        for start, stop in ((0, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7)):
            chunk = {"query": ops.convert_to_tensor(x[:, start:stop])}
            extra = {"key_mask": ops.convert_to_tensor(key_mask[:, start:stop])}
            if step is None:
                output, _, cache = layer(**chunk, **extra, causal=True, return_attention=True, cache=cache)
            else:
                output, _, cache = step(chunk, None, cache, extra)
            outputs.append(_numpy(output))
        _close(np.concatenate(outputs, 1), full, f"MLA decoding (absorbed: {absorb}) against the full pass")
    layer.absorb_latents = None
    _close(_while_loop_decode(layer, x[1:]), layer(x[1:], causal=True), "MLA while_loop decoding")
    config = layer.get_config()
    assert (
        config["kv_lora_rank"] == 6
        and config["vdim"] is None
        and type(layer).from_config(config).get_config() == config
    )
    _saves_and_loads(layer, ops.convert_to_tensor(x), "MLA", causal=True)
    try:
        layer.to_keras()
    except ValueError as error:
        assert "kv_lora_rank=6" in str(error), f"MLA to_keras: {error}"
    else:
        raise AssertionError("to_keras took an MLA layer, which the Keras built-ins cannot hold")
    layer.quantize("int8")
    full = layer(x[1:], causal=True)
    for absorb in (False, True):
        layer.absorb_latents = absorb
        _close(_while_loop_decode(layer, x[1:]), full, f"MLA int8 decoding (absorbed: {absorb})")


def check_int8_cache_integers():
    """The int8 KV cache's rule (docs/SPEC.md, "KV-cache decoding"): the same keys give exactly the
    NumPy file's integers and scales (shared_tests/test_int8_cache.py holds the other files to it)."""
    from keras import ops

    from Keras import Multi_Head_Attention as keras_file
    from shared_tests.int8 import cache_keys, reference_cache_integers

    integers, scale = (ops.convert_to_numpy(x) for x in keras_file._quantize_cache_rows(cache_keys()))
    expected_integers, expected_scale = reference_cache_integers(cache_keys())
    if integers.dtype != np.int8 or not np.array_equal(integers, expected_integers):
        raise AssertionError(f"int8 cache integers differ from NumPy's: {integers.dtype}, {integers[0, 0, 0]}")
    if scale.dtype != np.float32 or not np.array_equal(scale, expected_scale):
        raise AssertionError("int8 cache scales differ from NumPy's")


def check_fp8_cache_values():
    """The fp8 KV cache's rule (docs/SPEC.md, "KV-cache decoding"): the same keys give exactly the
    NumPy file's e4m3fn codes (bit for bit, -0 included) and scales (shared_tests/test_fp8_cache.py
    holds the other files to it)."""
    from keras import ops

    from Keras import Multi_Head_Attention as keras_file
    from shared_tests.int8 import fp8_cache_keys, fp8_codes, reference_fp8_codes

    values, scale = keras_file._quantize_cache_rows(fp8_cache_keys(), "float8_e4m3fn")
    expected_codes, expected_scale = reference_fp8_codes(fp8_cache_keys())
    if keras_file._dtype_name(values.dtype) != "float8_e4m3fn":
        raise AssertionError(f"fp8 cache values are {values.dtype}")
    if not np.array_equal(fp8_codes(values), expected_codes):
        raise AssertionError(f"fp8 cache codes differ from NumPy's: {fp8_codes(values)[0, 0, 0]}")
    scale = ops.convert_to_numpy(scale)
    if scale.dtype != np.float32 or not np.array_equal(scale, expected_scale):
        raise AssertionError("fp8 cache scales differ from NumPy's")


def check_sharing():
    """Shared keys and values (shared_tests/sharing.py): Gemma 3n's and Gemma 4's producers hand their keys
    and values to a `kv_shared` layer, as a pair in a full pass and as their cache when decoding, as NumPy's."""
    from shared_tests import sharing

    sharing.compare(sharing.run("Keras"), sharing.run("NumPy"), ("producer", "consumer", "decoded"), TOLERANCE)


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
    "window_pair": check_window_pair,
    "attention_chunk": check_attention_chunk,
    "rope_sections": check_rope_sections,
    "qk_norm_variants": check_qk_norm_variants,
    "memory_efficient": check_memory_efficient,
    "memory_efficient_dropout": check_memory_efficient_dropout,
    "fused": check_fused,
    "mla": check_mla,
    "sharing": check_sharing,
    "float64": check_float64,
    "tensorflow_file_refuses": check_tensorflow_file_refuses,
    "int8_parity": check_int8_parity,
    "int8_model_quantize": check_int8_model_quantize,
    "int8_decoding": check_int8_decoding,
    "int8_fit": check_int8_fit,
    "int8_layout_checks": check_int8_layout_checks,
    "int8_cache_integers": check_int8_cache_integers,
    "fp8_cache_values": check_fp8_cache_values,
    "save": check_save,
    "load": check_load,
    "save_int8": check_save_int8,
    "load_int8": check_load_int8,
}


def run(name):
    """Runs the check "NAME" or "NAME:ARGUMENT"."""
    check, _, argument = name.partition(":")
    return CHECKS[check](argument) if argument else CHECKS[check]()
