"""The Keras file's seams on one Keras 3 backend, in a process of its own (a backend is fixed when
Keras is imported): where its warnings point, calls under warnings-as-errors, a functional model
with an unknown T and a cache, float64 on every path, and (with hypothesis) functional models'
symbolic shapes against the eager ones and the built-in's, and drawn mask habits warning at the
caller's line eagerly and not at all under the backend's compiler. The habits' strategy and check
(`draw_habit`, `habit_modes_hold`) serve the other files too (test_seam_properties.py).

The parent (`run_checks`) starts `python -m shared_tests.keras_seams BACKEND MAX_EXAMPLES
DERANDOMIZE CHECK...` with `KERAS_BACKEND=BACKEND` (hypothesis as the parent's profile); the child
prints one JSON line, {check: None or the error's traceback}. Run a child by hand:
`KERAS_BACKEND=jax python -m shared_tests.keras_seams jax 25 True warnings_as_errors`.

Legend: B batch, T query length, S key length, E model width, N query heads, K key/value heads,
H head size, L cache slots.
"""

import functools
import json
import os
import subprocess
import sys
import traceback
import warnings

import numpy as np

SUBPROCESS_TIMEOUT = 600  # seconds for one backend's checks
HABIT = np.triu(np.ones((4, 4), bool), 1)  # (T, S): nn.MultiheadAttention's causal attn_mask (True = blocked)


def run_checks(backend, checks, max_examples=25, derandomize=True):
    """Runs the named checks on `backend` in a subprocess; returns {check: None or error text}."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "shared_tests.keras_seams", backend, str(max_examples), str(derandomize), *checks]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=root)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the {backend} process exited {done.returncode}: {done.stderr[-3000:]}")
    return json.loads(lines[-1])


@functools.cache
def results(backend):
    """Every check's result on `backend`, from one process per backend and pytest session, with the
    session's hypothesis profile (`--hypothesis-profile=explore`: more examples, not derandomized)."""
    from hypothesis import settings

    return run_checks(backend, tuple(CHECKS), settings().max_examples, settings().derandomize)


def _located(caught, line):
    """The caught warnings are AttentionMaskWarnings at this file's `line`."""
    from Keras import AttentionMaskWarning

    places = [(type(w.message).__name__, w.filename, w.lineno) for w in caught]
    expected = [("AttentionMaskWarning", __file__, line)]
    assert places == expected, f"expected {expected}, caught {places}"
    assert all(issubclass(w.category, AttentionMaskWarning) for w in caught)


def warning_location():
    """An AttentionMaskWarning names the caller's line: a direct call, and a call inside a Keras
    layer of the user's (Keras' `__call__` frames between it and the layer file)."""
    import keras

    from Keras import MultiHeadAttention

    x = keras.ops.convert_to_tensor(np.random.default_rng(0).standard_normal((2, 4, 16)).astype("float32"))
    habit = keras.ops.convert_to_tensor(HABIT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        MultiHeadAttention(16, 2)(x, attention_mask=habit)
    _located(caught, line)

    class Outer(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.attention = MultiHeadAttention(16, 2)

        def call(self, x):
            return self.attention(x, attention_mask=HABIT)  # OUTER_LINE

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Outer()(x)
    with open(__file__) as handle:
        source = handle.read().splitlines()
    _located(caught, next(i + 1 for i, text in enumerate(source) if text.endswith("# OUTER_LINE")))


def warnings_as_errors():
    """Under `warnings.simplefilter("error")` every masked call (boolean, floating, token masks, a
    decode step) computes without another warning, and a habit is an AttentionMaskWarning error."""
    import keras

    from Keras import AttentionMaskWarning, MultiHeadAttention

    rng = np.random.default_rng(0)
    x = keras.ops.convert_to_tensor(rng.standard_normal((2, 4, 16)).astype("float32"))  # (B, T, E)
    keep = keras.ops.convert_to_tensor(np.array([[True, True, True, False], [True] * 4]))  # (B, S)
    layer = MultiHeadAttention(16, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x, key_mask=keep)
        layer(x, query_mask=keep)
        layer(x, attention_mask=keras.ops.convert_to_tensor(np.tril(np.ones((4, 4), bool))), causal=True)
        layer(x, attention_mask=keras.ops.convert_to_tensor(np.zeros((2, 4, 4), "float32")))
        cache = layer.init_cache(2, 8)
        layer(x, key_mask=keep, cache=cache)
        try:
            MultiHeadAttention(16, 2)(x, attention_mask=keras.ops.convert_to_tensor(HABIT))
        except AttentionMaskWarning:
            pass
        else:
            raise AssertionError("the habit gave no AttentionMaskWarning")


def _shape(x):
    return tuple(None if d is None else int(d) for d in x.shape)


def _shapes(results):
    """The shapes of a call's results: output, weights, a cache's fields."""
    results = results if isinstance(results, (tuple, list)) else (results,)
    flat = [y for x in results for y in (x if hasattr(x, "_fields") else (x,))]
    return [_shape(x) for x in flat]


def _fits(symbolic, eager):
    """A symbolic shape holds an eager one: the same rank, and every static dimension equal."""
    return len(symbolic) == len(eager) and all(d in (None, e) for d, e in zip(symbolic, eager, strict=True))


def _agree(first, second):
    """Two symbolic shapes of the same rank, equal where both know a dimension (Keras' built-in
    gives its scores' S as T at times: only the outputs are compared)."""
    return len(first) == len(second) and all(None in (a, b) or a == b for a, b in zip(first, second, strict=True))


def _real_call(layer, arrays, arguments):
    """The layer called on arrays: eagerly, or on JAX under `jax.jit` (eager JAX compiles each op
    at each drawn shape, about three times the CPU of one program; the shapes are the same, since
    only warnings read values, and not under a trace)."""
    import keras

    if keras.backend.backend() != "jax":
        return layer(**arrays, **arguments)
    import jax

    return jax.jit(lambda arrays: layer(**arrays, **arguments))(arrays)


def functional_shapes_hold(module, draw):
    """One drawn configuration and call of the layer in `module` ("TensorFlow" or "Keras") on
    symbolic inputs (`keras.Input`, batch and lengths static or not) and on arrays (`_real_call`):
    the symbolic shapes hold the real ones with T, E and N static, and agree with the built-in's
    where it takes the call (no cache; it knows S static at times where it is not). `draw` is
    hypothesis' `data.draw`."""
    import keras
    from hypothesis import strategies as st

    kv_heads = draw(st.sampled_from([1, 2]))
    heads, head_dim = kv_heads * draw(st.sampled_from([1, 2])), draw(st.sampled_from([2, 3]))
    e = heads * head_dim
    inputs = draw(st.sampled_from(["self", "key", "cross"]))
    kdim = None if inputs == "self" else draw(st.sampled_from([None, 5]))
    b, t, s = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 5])), draw(st.sampled_from([1, 3, 4]))
    s = t if inputs == "self" else s
    static = {name: draw(st.booleans()) for name in ("b", "t", "s")}
    return_attention, cached = draw(st.booleans()), inputs == "self" and draw(st.booleans())
    zeros = {"kernel_initializer": "zeros"}  # shapes only: no random program per drawn kernel shape on JAX
    widths = {"kdim": kdim, "vdim": kdim}  # the value is the key
    layer = __import__(module).MultiHeadAttention(e, heads, num_kv_heads=kv_heads, **widths, **zeros)
    arguments = {"return_attention": return_attention}
    if cached:
        arguments |= {"cache": layer.init_cache(b, t + 2), "causal": True}
        static["b"] = True  # the cache's batch is static
    batch = b if static["b"] else None
    query = keras.Input(batch_shape=(batch, t if static["t"] else None, e))
    rng = np.random.default_rng(0)
    arrays = {"query": rng.standard_normal((b, t, e)).astype("float32")}
    symbolic = {"query": query}
    if inputs != "self":
        symbolic["key"] = keras.Input(batch_shape=(batch, s if static["s"] else None, kdim or e))
        arrays["key"] = rng.standard_normal((b, s, kdim or e)).astype("float32")
    if inputs == "cross":
        symbolic["value"], arrays["value"] = symbolic["key"], arrays["key"]
    got, want = _shapes(layer(**symbolic, **arguments)), _shapes(_real_call(layer, arrays, arguments))
    assert len(got) == len(want) and all(map(_fits, got, want)), (got, want)
    assert got[0][1:] == ((t if static["t"] else None), e), got  # T and E stay static
    if cached:
        return
    built_in = keras.layers.MultiHeadAttention(heads, head_dim, **zeros) if kv_heads == heads else (
        keras.layers.GroupQueryAttention(head_dim, heads, kv_heads, **zeros)
    )  # fmt: skip
    key = symbolic.get("key", query)
    try:
        expected = _shapes(built_in(query, key, key, return_attention_scores=return_attention))
    except ValueError:  # GroupQueryAttention's compute_output_shape takes no value width but the query's
        assert kv_heads < heads and kdim is not None
        return
    assert _agree(got[0], expected[0]), (got, expected)  # the output (the built-in's scores' S can be wrong)


def functional_shapes():
    """`functional_shapes_hold` for the Keras file, over the profile's examples."""
    from hypothesis import given
    from hypothesis import strategies as st

    given(data=st.data())(lambda data: functional_shapes_hold("Keras", data.draw))()


def symbolic_length_with_cache():
    """A functional model with an unknown query length T and a cache builds: on torch Keras traces
    the call with T made 83 (then 89), and the cache's room check refused it ("`cache` is full:
    ... T=83, L=3"). The model's symbolic shapes keep T unknown; the real call still refuses a T
    that does not fit."""
    import keras

    from Keras import MultiHeadAttention

    layer = MultiHeadAttention(4, 2, num_kv_heads=1)  # GQA: torch's trace falls back from "meta" to the CPU
    cache = layer.init_cache(1, 3)
    query = keras.Input(batch_shape=(1, None, 4))
    output, new_cache = layer(query, cache=cache, causal=True)
    assert _shape(output) == (1, None, 4), _shape(output)
    shapes = [_shape(getattr(new_cache, name)) for name in ("key", "value", "keep", "index", "segment_ids")]
    assert shapes == [(1, 1, 3, 2), (1, 1, 3, 2), (1, 3), (), (1, 0)], shapes  # no segment ids written: (B, 0)
    x = np.random.default_rng(0).standard_normal((1, 4, 4)).astype("float32")  # (B, T, E), T = 4 > L = 3
    assert _shape(layer(x[:, :2], cache=cache, causal=True)[0]) == (1, 2, 4)
    try:
        layer(x, cache=cache, causal=True)
    except ValueError as error:
        assert "`cache` is full" in str(error), error
    else:
        raise AssertionError("a real call with T > L was not refused")


HABITS = ("keeps nothing", "causal", "inverted padding", "zeros and ones")  # docs/SPEC.md, Masks
WARNINGS_TOL = 1e-5  # float32: a compiled call against the eager one (the SPEC's output tolerance)


def draw_habit(draw):
    """A drawn layer configuration and call (NumPy float32 arrays) whose masks hold one of the
    built-in layers' habits (`HABITS`): (config, {query, key?, value?, mask arguments}, causal).
    T != S, T = 1, GQA, cross-attention and `causal` among them. `draw` is hypothesis' `data.draw`."""
    from hypothesis import strategies as st

    kv_heads = draw(st.sampled_from([1, 2]))
    heads, head_dim = kv_heads * draw(st.sampled_from([1, 2])), draw(st.sampled_from([2, 4]))
    config = {"d_model": heads * head_dim, "num_heads": heads, "num_kv_heads": kv_heads, "bias": draw(st.booleans())}
    habit, b, t = draw(st.sampled_from(HABITS)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4]))
    s = t if habit == "causal" else draw(st.sampled_from([t, 1, 3]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    call = {"query": rng.standard_normal((b, t, config["d_model"])).astype("float32")}  # (B, T, E)
    if s != t or draw(st.booleans()):
        call["key"] = call["value"] = rng.standard_normal((b, s, config["d_model"])).astype("float32")  # (B, S, E)
    shape = draw(st.sampled_from([(t, s), (b, t, s), (b, 1, t, s)]))  # an attention_mask's
    if habit == "keeps nothing" and draw(st.booleans()):
        call["key_mask"] = np.zeros((b, s), bool)  # (B, S): True = padding, read as True = attend
    elif habit == "keeps nothing":
        call["attention_mask"] = np.zeros(shape, bool)
    elif habit == "causal":  # nn.MultiheadAttention's causal attn_mask, True = blocked
        call["attention_mask"] = np.broadcast_to(np.triu(np.ones((t, s), bool), 1), shape).copy()
    elif habit == "inverted padding":  # key_padding_mask (True = padding) of right-padded rows, one unpadded
        lengths = draw(st.lists(st.integers(1, s), min_size=b, max_size=b))
        lengths[draw(st.integers(0, b - 1))] = s
        call["key_mask"] = np.arange(s)[None, :] >= np.array(lengths)[:, None]  # (B, S)
    else:  # a Keras 0/1 float mask
        mask = (rng.random(shape) < 0.5).astype("float32")
        mask.reshape(-1)[0] = 1.0
        call["attention_mask"] = mask
    return config, call, draw(st.booleans())


def habit_modes_hold(layer_class, tensor, numpy, compile_, eager_call, where, draw):
    """One drawn habit (`draw_habit`) on a fresh layer of `layer_class`, its arrays made tensors by
    `tensor`: under `compile_` (`torch.compile`, `tf.function`, `jax.jit`; None: eager only) the
    call emits no warning at all (every warning an error); then `eager_call(layer, tensors,
    causal)` (a function in the calling test's file) warns the habit as AttentionMaskWarning only,
    each naming `where` (that file and line), any other warning an error; and the compiled output
    equals the eager one."""
    warning = sys.modules[layer_class.__module__].AttentionMaskWarning
    config, arrays, causal = draw_habit(draw)
    layer = layer_class(**config)
    if hasattr(layer, "build"):
        layer.build()  # weights made eagerly, not inside the compiled call
    tensors = {name: tensor(array) for name, array in arrays.items()}
    if compile_ is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compiled = compile_(lambda tensors: layer(**tensors, causal=causal))(tensors)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error")
        warnings.filterwarnings("always", category=warning)
        output = eager_call(layer, tensors, causal)
    places = {(w.category, w.filename, w.lineno) for w in caught}
    assert caught and places == {(warning, *where)}, f"expected {(warning, *where)}, caught {places}"
    if compile_ is not None:
        np.testing.assert_allclose(numpy(compiled), numpy(output), atol=WARNINGS_TOL, rtol=0)


def marked_line(path, marker):
    """The number of the line of `path` that ends with the comment `# marker`."""
    with open(path) as handle:
        return next(i + 1 for i, text in enumerate(handle) if text.rstrip().endswith(f"# {marker}"))


def _habit_call(layer, tensors, causal):
    return layer(**tensors, causal=causal)  # HABIT_CALL


def generated_warnings():
    """`habit_modes_hold` for the Keras file on this backend, over a fifth of the profile's
    examples, compiled as the backend compiles (`jax.jit`, `tf.function`; on torch eager only:
    `torch.compile` of a Keras layer breaks its graph inside Keras and takes about 25 s)."""
    import keras
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from Keras import MultiHeadAttention

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        compile_ = jax.jit
    elif backend == "tensorflow":
        import tensorflow as tf

        compile_ = tf.function
    else:
        compile_ = None
    where = (__file__, marked_line(__file__, "HABIT_CALL"))
    examples = settings(max_examples=max(2, settings().max_examples // 5), suppress_health_check=[HealthCheck.too_slow])

    @examples
    @given(data=st.data())
    def hold(data):
        arrays = keras.ops.convert_to_tensor, keras.ops.convert_to_numpy
        habit_modes_hold(MultiHeadAttention, *arrays, compile_, _habit_call, where, data.draw)

    hold()


def _numpy_of(x):
    import keras

    return keras.ops.convert_to_numpy(x)


def _run(function, *args, **kwargs):
    """`function(*args, **kwargs)`, on JAX under `jax.jit`: eager JAX compiles each op on its own, about three times
    the CPU of one program, and Keras promotes dtypes alike in both."""
    import keras

    if keras.backend.backend() != "jax":
        return function(*args, **kwargs)
    import jax

    return jax.jit(lambda: function(*args, **kwargs))()


def _decode_in_two(layer, x):
    """(B, T, E) `x` decoded through a fresh cache in two chunks, the first 3 tokens then the rest."""
    import keras

    first, cache = layer(x[:, :3], cache=layer.init_cache(x.shape[0], x.shape[1] + 1), causal=True)  # (B, 3, E)
    second = layer(x[:, 3:], cache=cache, causal=True)[0]  # (B, T - 3, E)
    return keras.ops.concatenate([first, second], 1)  # (B, T, E)


def float64_throughout():
    """A float64 layer computes in float64 on every path (the default, explicit, `fused_attention`
    asked for, memory-efficient, decoding) within the float64 tolerances of the NumPy file, and
    MLA's absorbed decode equals its expanded one: Keras' `ops.matmul` on torch and
    `ops.dot_product_attention` on torch and JAX compute float64 in float32 (Keras' type promotion
    outside TensorFlow), so the layer's outputs were float32 or float32-accurate, and the absorbed
    path mixed float32 queries with the float64 cache. On JAX with x64 (turned on here, last), each
    path under `jax.jit` (`_run`)."""
    import keras

    from Keras import MultiHeadAttention
    from NumPy import MultiHeadAttention as NumpyMultiHeadAttention
    from shared_tests.cases import FLOAT64_TOLERANCES

    if keras.backend.backend() == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 16))  # (B, T, E)
    for config, tolerance in (({"num_kv_heads": 2}, "plain"), (MLA_CONFIG, "rope")):
        layer = MultiHeadAttention(16, 4, **config, dtype="float64")
        reference = NumpyMultiHeadAttention(16, 4, **config)
        layer.build()
        weights = {name: 0.3 * rng.standard_normal(np.shape(w)) for name, w in layer.export_weights().items()}
        layer.import_weights(weights)
        reference.import_weights(weights)
        expected = reference(x, causal=True)  # (B, T, E)
        paths = {
            "default": _run(layer, x, causal=True),
            "explicit": _run(layer, x, causal=True, return_attention=True)[0],
        }
        layer.fused_attention = True  # `ops.dot_product_attention` asked for on every backend
        paths["fused asked"] = _run(layer, x, causal=True)
        layer.fused_attention = None
        layer.memory_efficient_threshold, layer.query_chunk_elements = 0, 2
        paths["memory_efficient"] = _run(layer, x, causal=True)
        layer.memory_efficient_threshold = MultiHeadAttention.memory_efficient_threshold
        for absorb in (False, True) if "kv_lora_rank" in config else (None,):
            layer.absorb_latents = absorb
            paths[f"decode absorb_latents={absorb}"] = _run(_decode_in_two, layer, x)  # (B, T, E)
        for path, output in paths.items():
            assert keras.backend.standardize_dtype(output.dtype) == "float64", (config, path, output.dtype)
            error = np.abs(_numpy_of(output) - expected).max()
            assert error <= FLOAT64_TOLERANCES[tolerance]["output"], (config, path, error)
        if "kv_lora_rank" in config:  # the same RoPE on both: equal to float64's own rounding
            absorbed, expanded = (_numpy_of(paths[f"decode absorb_latents={absorb}"]) for absorb in (True, False))
            error = np.abs(absorbed - expanded).max()
            assert error <= FLOAT64_TOLERANCES["plain"]["output"], error


MLA_CONFIG = {"kv_lora_rank": 8, "qk_rope_head_dim": 2, "qk_nope_head_dim": 4, "v_head_dim": 3, "bias": False}
CHECKS = {
    check.__name__: check
    for check in (
        warning_location,
        warnings_as_errors,
        functional_shapes,
        symbolic_length_with_cache,
        generated_warnings,
        float64_throughout,
    )  # float64_throughout last: on JAX it turns x64 on
}


def main(backend, max_examples, derandomize, names):
    import keras

    if keras.backend.backend() != backend:
        raise SystemExit(f"KERAS_BACKEND={backend} expected, Keras runs on {keras.backend.backend()}")
    from hypothesis import settings

    options = {"max_examples": max_examples, "derandomize": derandomize, "database": None, "deadline": None}
    settings.register_profile("parent", **options)
    settings.load_profile("parent")
    results = {}
    for name in names:
        try:
            CHECKS[name]()
            results[name] = None
        except Exception:  # every failure goes back to the parent as text
            results[name] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "True", sys.argv[4:])
