"""TensorFlow layer, the modern variants and the built-ins' habits: scale, softcap, window (one- and
two-sided), attention chunks, RoPE (multimodal sections too), QK-norm (RMS or LayerNorm, per head,
with a bias), sinks, clip_qkv, per-projection bias; key_mask, query_mask, attention_bias, positions; the
floating mask rule and the refused traps. Each variant against a small NumPy formula, and every
code path (eager, tf.function, XLA, memory-efficient) against the others, gradients included."""

import math
import re
import warnings

import numpy as np
import pytest
import tensorflow as tf

from NumPy import MultiHeadAttention as NumpyMultiHeadAttention
from shared_tests.cases import EVERYTHING_NEW, TOLERANCES
from TensorFlow import AttentionMaskWarning, KVCache, MultiHeadAttention, alibi_bias, dot_product_attention
from TensorFlow import Multi_Head_Attention as tf_file

keras = tf.keras
OUTPUT_TOL = TOLERANCES["float32"]["output"]
WEIGHTS_TOL = TOLERANCES["float32"]["weights"]
GRADS_TOL = TOLERANCES["float32"]["grads"]
MIXED_TOL = {"mixed_float16": TOLERANCES["float16"]["output"], "mixed_bfloat16": TOLERANCES["bfloat16"]["output"]}
B, T, E, N = 2, 5, 16, 4
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN = {  # R = 4 at theta 10: pair 0 kept, pair 1 blended (0.44); attention factor (0.1 ln 4 + 1) / (0.05 ln 4 + 1)
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "truncate": False,
    "beta_fast": 8.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.5,
}

VARIANTS = {
    "plain": {},
    "scale": {"scale": 1.0},
    "softcap": {"softcap": 1.5},
    "window": {"window": 2},
    "rope": {"rope_theta": 100.0},
    "rope_partial_interleaved": {"rope_theta": 100.0, "rope_fraction": 0.5, "rope_interleaved": True},
    "rope_linear": {"rope_theta": 10.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "rope_llama3": {"rope_theta": 10.0, "rope_scaling": LLAMA3},
    "rope_yarn_partial": {"head_dim": 8, "rope_theta": 10.0, "rope_fraction": 0.5, "rope_scaling": YARN},
    "qk_norm_head": {"qk_norm": "head", "qk_norm_eps": 1e-3},
    "qk_norm_all_gqa": {"qk_norm": "all", "num_kv_heads": 2},
    "sinks_gqa": {"sinks": True, "num_kv_heads": 2},
    "bias_qkv": {"bias": ("query", "key", "value")},
    "bias_output_only": {"bias": ["output"]},
    "clip_qkv": {"clip_qkv": 0.5},
    "clip_qkv_qk_norm_rope": {"clip_qkv": 0.5, "qk_norm": "all", "rope_theta": 100.0},
    "gate": {"gate": True},
    "gate_gqa_no_bias_rope": {"gate": True, "bias": False, "num_kv_heads": 2, "rope_theta": 100.0},
    "everything": {
        "num_kv_heads": 2, "scale": 0.3, "softcap": 3.0, "window": 3, "rope_theta": 50.0, "rope_fraction": 0.5,
        "qk_norm": "head", "sinks": True, "bias": ("key", "output"), "clip_qkv": 1.0,
    },
    "window_pair": {"window": (2, 2)},
    "window_pair_wide_after": {"window": [3, 4], "num_kv_heads": 2},
    "attention_chunk": {"attention_chunk_size": 2},
    "attention_chunk_window_pair": {"attention_chunk_size": 3, "window": (2, 3), "sinks": True},
    "rope_sections": {"rope_theta": 100.0, "rope_sections": (1, 1)},
    "rope_sections_interleaved_yarn": {
        "head_dim": 12, "rope_theta": 10.0, "rope_sections": [1, 2, 3], "rope_interleaved": True, "rope_scaling": YARN,
    },
    "qk_norm_per_head": {"qk_norm": "per_head", "num_kv_heads": 2},
    "qk_norm_layer_head_bias": {"qk_norm": "head", "qk_norm_type": "layer", "qk_norm_bias": True},
    "qk_norm_layer_per_head_bias": {"qk_norm": "per_head", "qk_norm_type": "layer", "qk_norm_bias": True},
    "qk_norm_layer_all_gqa": {"qk_norm": "all", "qk_norm_type": "layer", "num_kv_heads": 2, "qk_norm_eps": 1e-3},
    "qk_norm_rms_all_bias": {"qk_norm": "all", "qk_norm_bias": True},
    "everything_new": EVERYTHING_NEW,
}  # fmt: skip


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=tol, rtol=0)


def _layer(config, seed=0, **kwargs):
    """A layer with random portable weights (norm scales around 1, sink logits around 0)."""
    layer = MultiHeadAttention(E, N, **config, **kwargs)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in layer.weight_shapes().items():
        scale = math.sqrt(2.0 / sum(shape)) if name.endswith("_kernel") else 0.3
        weights[name] = (rng.normal(scale=scale, size=shape) + name.endswith("_norm")).astype(np.float32)
    layer.import_weights(weights)
    return layer


# --- small NumPy formulas, written from docs/SPEC.md ------------------------------------------


def np_attention(
    q, k, v, keep=None, bias=None, causal=False, scale=None, softcap=None, window=None, sinks=None, chunk=None
):
    """float64 attention on (B, N, T, H) / (B, K, S, H): (context, weights); `window` an int or a
    pair (before, after), `chunk` Llama 4's attention chunk size."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, 1), np.repeat(v, groups, 1)
    t, s = q.shape[2], k.shape[2]
    scores = q @ k.swapaxes(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias
    position = np.arange(t)[:, None] + s - t
    kept = np.ones(scores.shape, bool) & (True if keep is None else keep)
    if causal:
        kept &= np.arange(s) <= position
    before, after = (window, None) if window is None or np.ndim(window) == 0 else window
    if before is not None:
        kept &= np.arange(s) > position - before
    if after is not None:
        kept &= np.arange(s) < position + after
    if chunk is not None:
        kept &= np.arange(s) // chunk == position // chunk
    z = np.where(kept, scores, -np.inf)
    top = z.max(-1, keepdims=True, initial=-np.inf)
    sink = None if sinks is None else np.asarray(sinks, np.float64)[None, :, None, None]
    top = top if sink is None else np.maximum(top, sink)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(z - top)
    denominator = e.sum(-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - top))
    weights = np.divide(e, denominator, out=np.zeros_like(e), where=denominator > 0)
    return weights @ v, weights


def np_inv_freq(rotary, theta, scaling=None):
    inv = theta ** (-np.arange(0, rotary, 2) / rotary)
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "yarn":
        return np_yarn(inv, rotary, theta, scaling)
    if kind != "llama3":
        return inv
    out = []
    low = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
    high = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
    for f in inv:  # one frequency at a time, as Meta's reference loop does
        wavelength = 2 * math.pi / f
        if wavelength < high:
            out.append(f)
        elif wavelength > low:
            out.append(f / scaling["factor"])
        else:
            smooth = (scaling["original_max_position_embeddings"] / wavelength - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"]
            )
            out.append((1 - smooth) * f / scaling["factor"] + smooth * f)
    return np.array(out)


def np_yarn(inv, dim, base, scaling):
    """transformers' `_compute_yarn_parameters`, written out: the ramp between the correction dims."""
    context = scaling["original_max_position_embeddings"]
    dims = [dim * math.log(context / (r * 2 * math.pi)) / (2 * math.log(base)) for r in (
        scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1)]  # fmt: skip
    if scaling.get("truncate", True):
        dims = [math.floor(dims[0]), math.ceil(dims[1])]
    low, high = max(dims[0], 0), min(dims[1], dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    return inv / scaling["factor"] * ramp + inv * (1 - ramp)


def np_attention_factor(scaling):
    """YaRN's attention factor: transformers multiplies cos and sin by it (1 for the other scalings)."""
    if scaling is None or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor, m, m_all = scaling["factor"], scaling.get("mscale") or 1.0, scaling.get("mscale_all_dim")
    return (0.1 * m * math.log(factor) + 1) / (0.1 * m_all * math.log(factor) + 1 if m_all else 1.0)


def np_rope(x, positions, inv_freq, interleaved, factor=1.0, sections=None):
    """x (B, heads, T, H), positions (B, T), or (k, B, T) with `sections`: the pairs (x1, x2) ->
    (x1 cos - x2 sin, x2 cos + x1 sin); pair i of section j turns by positions[j] * inv_freq[i]."""
    half = len(inv_freq)
    first = np.arange(0, 2 * half, 2) if interleaved else np.arange(half)
    second = first + 1 if interleaved else first + half
    if sections is None:
        angles = positions[:, None, :, None] * inv_freq
    else:  # one pair at a time: the row of its section
        row = np.repeat(np.arange(len(sections)), sections)  # (R/2,)
        angles = np.stack([positions[row[i]][:, None, :] * inv_freq[i] for i in range(half)], -1)  # (B, 1, T, R/2)
    y = np.array(x, np.float64)
    cos, sin = np.cos(angles) * factor, np.sin(angles) * factor
    y[..., first] = x[..., first] * cos - x[..., second] * sin
    y[..., second] = x[..., second] * cos + x[..., first] * sin
    return y


def np_rms_norm(x, scale, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * scale


def np_layer_norm(x, scale, eps):
    centred = x - x.mean(-1, keepdims=True)
    return centred / np.sqrt((centred**2).mean(-1, keepdims=True) + eps) * scale


def np_qk_norm(layer, x, w, kind):
    """QK-norm of (B, heads, T, H) x from the portable weights: "all" over the merged heads,
    "per_head" with scales (heads*H,) seen as (heads, 1, H), "head" with (H,)."""
    norm = np_rms_norm if layer.qk_norm_type == "rms" else np_layer_norm
    scale, bias = w[f"{kind}_norm"], w.get(f"{kind}_norm_bias", 0.0)
    b, heads, t, h = x.shape
    if layer.qk_norm == "all":
        merged = x.transpose(0, 2, 1, 3).reshape(b, t, heads * h)
        return (norm(merged, scale, layer.qk_norm_eps) + bias).reshape(b, t, heads, h).transpose(0, 2, 1, 3)
    if layer.qk_norm == "per_head":
        scale, bias = scale.reshape(heads, 1, h), np.reshape(bias, (heads, 1, h)) if np.ndim(bias) else bias
    return norm(x, scale, layer.qk_norm_eps) + bias


def np_layer(layer, query, causal=False, key_mask=None, attention_bias=None, positions=None, keep=None):
    """The whole self-attention layer in float64 from its portable weights (steps 2-4, 6, 6b, 7)."""
    w = {name: value.astype(np.float64) for name, value in layer.export_weights().items()}
    kv, h, t = layer.num_kv_heads, layer.head_dim, query.shape[1]

    def project(kind):
        y = query @ w[f"{kind}_kernel"] + w.get(f"{kind}_bias", 0.0)  # (B, T, heads*H)
        return y if layer.clip_qkv is None else np.clip(y, -layer.clip_qkv, layer.clip_qkv)

    def split(x, heads):
        return x.reshape(x.shape[0], t, heads, h).transpose(0, 2, 1, 3)  # (B, heads, T, H)

    q, k, v = split(project("query"), layer.num_heads), split(project("key"), kv), split(project("value"), kv)
    if layer.qk_norm is not None:
        q, k = np_qk_norm(layer, q, w, "query"), np_qk_norm(layer, k, w, "key")
    if layer.rope_theta is not None:
        rotary = int(h * layer.rope_fraction)
        inv = np_inv_freq(rotary, layer.rope_theta, layer.rope_scaling)
        positions = np.arange(t) if positions is None else np.asarray(positions)
        sections = layer.rope_sections
        rows = () if sections is None else (len(sections),)
        positions = np.broadcast_to(positions, (*rows, query.shape[0], t))  # (B, T), or (k, B, T) with sections
        factor = np_attention_factor(layer.rope_scaling)
        q, k = (np_rope(x, positions, inv, layer.rope_interleaved, factor, sections) for x in (q, k))
    keep = (True if keep is None else keep) & (True if key_mask is None else key_mask[:, None, None, :])
    context, weights = np_attention(
        q, k, v, keep, attention_bias, causal, layer.scale, layer.softcap, layer.window, w.get("sinks"),
        layer.attention_chunk_size,
    )  # fmt: skip
    merged = context.transpose(0, 2, 1, 3).reshape(query.shape[0], t, -1)
    if layer.gate:  # Keras' use_gate, Qwen3-Next: sigmoid(query @ gate_kernel + gate_bias) times each head's result
        merged = merged / (1.0 + np.exp(-(query @ w["gate_kernel"] + w.get("gate_bias", 0.0))))
    return merged @ w["output_kernel"] + w.get("output_bias", 0.0), weights


rng = np.random.default_rng(0)
X = rng.normal(size=(B, T, E)).astype(np.float32)  # (B, T, E)
KEY_MASK = np.array([[True, True, True, False, True], [True, False, True, True, True]])  # (B, S)
BIAS_FULL = rng.normal(size=(B, N, T, T)).astype(np.float32)  # (B, N, T, S)
BIAS_HEADS = rng.normal(size=(1, N, 1, T)).astype(np.float32)  # (1, N, 1, S)


# --- each variant against the formulas ------------------------------------------------------


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"scale": 0.7},
        {"softcap": 1.2},
        {"window": 2},
        {"window": 2, "causal": True},
        {"sinks": np.array([0.5, -1.0, 2.0, 0.0])},
        {"softcap": 2.0, "window": 3, "causal": True, "sinks": np.array([1.0, 0.0, -1.0, 3.0]), "scale": 0.4},
    ],
    ids=["plain", "scale", "softcap", "window", "window_causal", "sinks", "all"],
)
def test_dot_product_attention_variants_match_the_formula(variant):
    local = np.random.default_rng(1)
    q = local.normal(size=(2, 4, 3, 8)).astype(np.float32)  # (B, N, T, H) with T < S: bottom-right aligned
    k, v = (local.normal(size=(2, 2, 6, 8)).astype(np.float32) for _ in range(2))  # (B, K, S, H)
    keep = local.random((2, 1, 3, 6)) < 0.8
    keep[0, 0, 1] = False  # a query with no key: exactly 0, with or without sinks
    bias = local.normal(size=(1, 4, 1, 6)).astype(np.float32)
    context, weights = dot_product_attention(q, k, v, keep, bias, **variant)
    expected, expected_w = np_attention(q, k, v, keep, bias, **variant)
    _close(weights, expected_w, WEIGHTS_TOL)
    _close(context, expected, OUTPUT_TOL)
    assert (weights.numpy()[0, :, 1] == 0).all() and (context.numpy()[0, :, 1] == 0).all()


def test_sinks_take_part_of_the_softmax_and_rows_with_no_key_stay_zero():
    q, k, v = (tf.constant(rng.normal(size=(1, 2, 3, 4)), tf.float32) for _ in range(3))  # T = S = 3
    keep = np.array([[True, True, False], [True, False, True], [False, False, False]])  # query 2 keeps no key

    def sums(sinks):
        context, weights = dot_product_attention(q, k, v, keep, sinks=sinks)
        assert (weights.numpy()[0, :, 2] == 0).all() and (context.numpy()[0, :, 2] == 0).all()
        return weights.numpy()[0, :, :2].sum(-1)

    _close(sums(None), 1, WEIGHTS_TOL)
    small, large = sums(np.zeros(2, np.float32)), sums(np.full(2, 3.0, np.float32))
    assert (small < 1 - 1e-3).all() and (large < small).all()  # a larger sink logit takes more of each row


def test_rope_frequencies_match_the_reference_loop():
    for scaling in (None, {"rope_type": "linear", "factor": 4.0}, LLAMA3, {**LLAMA3, "factor": 2.0}, YARN):
        got = tf_file.rope_frequencies(16, 10000.0, scaling)
        assert got.dtype == tf.float32
        _close(got, np_inv_freq(16, 10000.0, scaling), 1e-7)
    llama = np_inv_freq(16, 10000.0, LLAMA3)  # all three regimes: kept, divided and interpolated
    plain = np_inv_freq(16, 10000.0)
    assert np.isclose(llama, plain).any() and np.isclose(llama, plain / 8).any()
    assert (~np.isclose(llama, plain) & ~np.isclose(llama, plain / 8)).any()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary", [8, 4])
def test_apply_rope_matches_the_formula(interleaved, rotary):
    x = rng.normal(size=(2, 3, 5, 8)).astype(np.float32)  # (B, heads, T, H)
    positions = np.array([[0, 1, 2, 3, 4], [7, 3, 0, 9, 100]])
    inv_freq = tf_file.rope_frequencies(rotary, 10000.0)
    got = tf_file.apply_rope(tf.constant(x), positions, inv_freq, interleaved)
    _close(got, np_rope(x, positions, inv_freq.numpy().astype(np.float64), interleaved), OUTPUT_TOL)
    np.testing.assert_array_equal(got.numpy()[..., rotary:], x[..., rotary:])  # partial rotary passes the rest


def test_rms_norm_matches_the_formula_in_float32_for_half_inputs():
    x = rng.normal(size=(2, 3, 8)).astype(np.float32)
    scale = rng.normal(size=(8,)).astype(np.float32)
    _close(tf_file.rms_norm(tf.constant(x), scale, 1e-6), np_rms_norm(x, scale, 1e-6), OUTPUT_TOL)
    half = tf_file.rms_norm(tf.constant(x * 300, tf.float16), scale, 1e-6)  # x ** 2 overflows float16
    assert half.dtype == tf.float16
    _close(half, np_rms_norm(x, scale, 1e-6), TOLERANCES["float16"]["output"] * 3)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_layer_variant_matches_the_formula(name):
    layer = _layer(VARIANTS[name])
    output, weights = layer(X, key_mask=KEY_MASK, attention_bias=BIAS_HEADS, causal=True, return_attention=True)
    expected, expected_w = np_layer(layer, X.astype(np.float64), True, KEY_MASK, BIAS_HEADS)
    _close(weights, expected_w, WEIGHTS_TOL)
    _close(output, expected, OUTPUT_TOL)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "separate"])
def test_clip_qkv_gradient_is_the_clamps(fuse):
    """One token: the weight is 1, the output clamp(v) @ output_kernel + output_bias, so the
    gradient of value_bias is (g @ output_kernel^T) where |v| <= c, bounds included (features 0
    and 1 sit exactly on c and -c), and 0 outside; on the fused projection and the separate ones."""
    c = 0.5
    layer = _layer({"clip_qkv": c})
    weights = layer.export_weights()
    weights["value_kernel"][:, :2], weights["value_bias"][:2] = 0.0, (c, -c)
    layer.import_weights(weights)
    x, g = X[:, :1] * 2, rng.normal(size=(B, 1, E)).astype(np.float32)
    with tf.GradientTape() as tape:
        output = layer(x) if fuse else layer(x, tf.identity(x), tf.identity(x))
        loss = tf.reduce_sum(output * g)
    gradient = tape.gradient(loss, layer.value_bias).numpy()
    v = x @ weights["value_kernel"] + weights["value_bias"]  # (B, 1, E)
    within = np.abs(v) <= c
    assert within[..., :2].all() and (~within).mean() > 0.3
    _close(gradient, ((g @ weights["output_kernel"].T) * within).sum((0, 1)), 1e-6)
    assert (gradient[~within.any((0, 1))] == 0).all()


def test_clip_qkv_clamps_before_qk_norm_and_rope():
    """Projections already within [-c, c] are unchanged by the clamp, though QK-norm makes them of
    order one: a clamp after QK-norm or RoPE would change the output."""
    config = {"qk_norm": "head", "rope_theta": 100.0}
    layer = _layer(config)
    small = {name: w * 0.01 if name.startswith(("query", "key", "value")) and "norm" not in name else w
             for name, w in layer.export_weights().items()}  # fmt: skip
    layer.import_weights(small)
    clipped = _layer({**config, "clip_qkv": 0.5})
    clipped.import_weights(small)
    _close(clipped(X, causal=True), layer(X, causal=True), 0.0)
    q = (X @ small["query_kernel"] + small["query_bias"]).reshape(B, T, N, E // N)
    assert np.abs(q).max() < 0.5 < np.abs(np_rms_norm(q, small["query_norm"], layer.qk_norm_eps)).max()


def test_rope_positions_default_to_arange_and_only_differences_count():
    layer = _layer(VARIANTS["rope"])
    _, weights = layer(X, return_attention=True)
    _close(weights, layer(X, positions=np.arange(T), return_attention=True)[1], 0)
    _, shifted = layer(X, positions=np.arange(T)[None].repeat(B, 0) + 11, return_attention=True)
    _close(shifted, weights, WEIGHTS_TOL)  # RoPE is relative: the same shift of every position changes nothing
    packed = np.array([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])  # two packed sequences in batch 0
    _, packed_w = layer(X, positions=packed, return_attention=True)
    _close(packed_w, np_layer(layer, X.astype(np.float64), positions=packed)[1], WEIGHTS_TOL)
    assert np.abs(packed_w.numpy()[0] - weights.numpy()[0]).max() > 1e-3


def test_alibi_bias_has_blooms_slopes_and_shapes():
    bias = alibi_bias(8, np.arange(4))
    assert bias.shape == (1, 8, 1, 4) and bias.dtype == tf.float32
    _close(bias[0, :, 0, 1], 2.0 ** -np.arange(1, 9), 0)
    six = alibi_bias(6, np.array([[0, 1, 2], [0, 0, 1]]))  # 4 slopes of 4 heads, then every other one of 8 heads
    assert six.shape == (2, 6, 1, 3)
    _close(six[0, :, 0, 1], 2.0 ** -np.array([2, 4, 6, 8, 1, 3]), 0)
    _close(six[1, :, 0, 2], 2.0 ** -np.array([2, 4, 6, 8, 1, 3]), 0)


# --- every code path gives the same numbers, gradients included ----------------------------------

PATHS = ("eager", "function", "jit_compile", "memory_efficient")


def _forward_and_grads(layer, path, attention_bias):
    """Output and gradients of sum(output * cos(output)) with respect to the query, every weight
    and `attention_bias`, on one path."""
    chunked = path.startswith("memory_efficient")
    layer.memory_efficient_threshold = 0 if chunked else 1 << 26
    layer.query_chunk_elements = 2 * B * N * T  # two queries per chunk: 5 rows leave a padded chunk

    def step(x, bias):
        with tf.GradientTape() as tape:
            tape.watch([x, bias])
            output = layer(x, key_mask=KEY_MASK, attention_bias=bias, causal=True)
            loss = tf.reduce_sum(output * tf.cos(output))
        return output, tape.gradient(loss, [x, bias, *layer.trainable_weights])

    if path in ("function", "memory_efficient"):
        step = tf.function(step)
    if path.endswith("jit_compile") or path.endswith("_jit"):
        step = tf.function(step, jit_compile=True)
    return step(tf.constant(X), tf.constant(attention_bias))


def _same_on_every_path(layer, paths, attention_bias):
    expected, expected_grads = _forward_and_grads(layer, "eager", attention_bias)
    assert all(g is not None for g in expected_grads)  # query, attention_bias, every weight
    for path in paths:
        output, grads = _forward_and_grads(layer, path, attention_bias)
        _close(output, expected, OUTPUT_TOL)
        for got, want in zip(grads, expected_grads, strict=True):
            _close(got, want, GRADS_TOL)


NEW_VARIANTS = (
    "window_pair", "window_pair_wide_after", "attention_chunk", "attention_chunk_window_pair", "rope_sections",
    "rope_sections_interleaved_yarn", "qk_norm_per_head", "qk_norm_layer_head_bias", "qk_norm_layer_per_head_bias",
    "qk_norm_layer_all_gqa", "qk_norm_rms_all_bias", "everything_new",
)  # fmt: skip
NUMPY_PATHS = ("eager", "function", "jit_compile", "memory_efficient", "memory_efficient_jit")


def _numpy_paths(name):
    """Every path for everything_new; the masks' variants on the memory-efficient path (its
    per-block masks), with and without XLA; the norms' and RoPE's under XLA."""
    if name == "everything_new":
        return NUMPY_PATHS
    masks = "window" in name or "chunk" in name
    return ("eager", "memory_efficient", "memory_efficient_jit") if masks else ("eager", "jit_compile")


def _bias_of(name):
    """A (B, N, T, S) bias (per-chunk rows of its gradient) for half the variants, a (1, N, 1, S)
    one (its gradient summed over chunks) for the others."""
    return BIAS_FULL if sorted(VARIANTS).index(name) % 2 else BIAS_HEADS


def _paths_against_eager(name):
    """The paths a variant runs against eager: those that
    `test_new_variant_matches_the_numpy_file_on_every_path` does not run with the same call
    (key_mask, the (B, N, T, S) bias, causal) against the NumPy file, gradients included."""
    same_call = name in NEW_VARIANTS and _bias_of(name) is BIAS_FULL
    return [path for path in PATHS[1:] if not (same_call and path in _numpy_paths(name))]


@pytest.mark.parametrize("name", [name for name in sorted(VARIANTS) if _paths_against_eager(name)])
def test_every_path_gives_the_same_output_and_gradients(name):
    """Each variant on the paths of `_paths_against_eager` (everything_new runs all of them against
    the NumPy file)."""
    _same_on_every_path(_layer(VARIANTS[name]), _paths_against_eager(name), _bias_of(name))


@pytest.mark.parametrize("bias", ["full", "heads"])
def test_memory_efficient_path_under_xla_with_every_variant(bias):
    attention_bias = BIAS_FULL if bias == "full" else BIAS_HEADS
    _same_on_every_path(_layer(VARIANTS["everything"]), ["memory_efficient_jit"], attention_bias)


def test_memory_efficient_path_under_xla_with_shapes_unknown_at_trace_time():
    """B, T and S unknown at trace time: the path is picked at run time (tf.cond) and the bias is
    broadcast to full rows inside it; gradients of the bias and the sinks as in eager mode."""
    layer = _layer(VARIANTS["everything"])
    spec = tf.TensorSpec((None, None, E))

    def step(x, bias):
        with tf.GradientTape() as tape:
            tape.watch([x, bias])
            output = layer(x, attention_bias=bias, causal=True)
        return output, tape.gradient(tf.reduce_sum(output**2), [x, bias, layer.sink_logits])

    expected = step(tf.constant(X), tf.constant(BIAS_HEADS))
    layer.memory_efficient_threshold, layer.query_chunk_elements = 0, 1  # one query per chunk
    compiled = tf.function(step, input_signature=[spec, tf.TensorSpec((None, N, None, None))], jit_compile=True)
    output, grads = compiled(X, BIAS_HEADS)
    _close(output, expected[0], OUTPUT_TOL)
    for got, want in zip(grads, expected[1], strict=True):
        _close(got, want, GRADS_TOL)


def test_attention_bias_gradient_is_the_scores_gradient_reduced_to_its_shape():
    """d loss / d bias equals d loss / d scores summed over the broadcast dimensions: compare a
    (1, N, 1, S) bias with the same bias broadcast to (B, N, T, S)."""
    layer = _layer(VARIANTS["sinks_gqa"])
    full = np.broadcast_to(BIAS_HEADS, (B, N, T, T)).copy()
    for path in ("eager", "memory_efficient"):
        _, small = _forward_and_grads(layer, path, BIAS_HEADS)
        _, large = _forward_and_grads(layer, path, full)
        _close(small[1], large[1].numpy().sum(axis=(0, 2), keepdims=True), GRADS_TOL)


# --- masks: the floating mask rule, key_mask and query_mask, regressions -----------------------


def test_regression_float32_mask_on_mixed_float16_stays_a_finite_penalty():
    """Keras cast a float32 mask to float16 before `call`, so -1e9 became -inf and removed keys it
    should only penalise; a row of only penalties then lost every key. Now the mask is read in
    its own dtype and added in float32."""
    reference = _layer({})
    layer = MultiHeadAttention(E, N, dtype="mixed_float16")
    layer.import_weights(reference.export_weights())
    mask = np.zeros((B, T, T), np.float32)
    mask[0, 1] = -1e9  # every key penalised alike: an ordinary softmax, not a row with no key
    mask[1, :, 3] = -1e9  # one key penalised: weight ~0, not removed
    output, weights = layer(X, attention_mask=mask, return_attention=True)
    expected, expected_w = reference(X, attention_mask=mask, return_attention=True)
    _close(output, expected, MIXED_TOL["mixed_float16"])
    _close(weights, expected_w, MIXED_TOL["mixed_float16"])
    assert (weights.numpy()[0, :, 1] > 0).all()  # penalised, not removed: Keras' cast made it -inf, a row with no key
    unmasked = reference(X, return_attention=True)[1][0, :, 1]  # a per-row constant: the same softmax
    _close(weights[0, :, 1], unmasked, MIXED_TOL["mixed_float16"])


@pytest.mark.parametrize("threshold", [1 << 26, 0], ids=["explicit", "memory_efficient"])
def test_a_row_of_large_penalties_is_an_ordinary_softmax_in_float32(threshold):
    """-1e9 + a score is -1e9 in float32 (its spacing there is 64): each row's largest kept mask
    value is taken off first, so the scores are not rounded away."""
    layer = _layer({})
    layer.memory_efficient_threshold = threshold
    mask = np.zeros((B, T, T), np.float32)
    mask[0, 1] = -1e9
    mask[1, 2, 1:] = -1e9 + np.arange(4)  # and -1e9 beside -1e9 + 3
    got = layer(X, attention_mask=mask, causal=False)
    expected, _ = np_layer(layer, X.astype(np.float64), attention_bias=mask.astype(np.float64)[:, None])
    _close(got, expected, OUTPUT_TOL)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_regression_float64_mask_holding_float32_lowest_removes_keys(dtype):
    """transformers builds masks with float32's lowest; in a float64 mask it used to be added (a
    float64 layer, no cast) or removed (a float32 layer, after Keras' cast). Now it removes in
    both, read before any cast, and so does -1e300."""
    layer = MultiHeadAttention(E, N, dtype=dtype)
    mask = np.zeros((B, T, T))
    mask[0, :, 2] = np.finfo(np.float32).min
    mask[1, :, 0] = -1e300
    mask[1, 3] = np.finfo(np.float32).min  # a query with no key left
    output, weights = layer(X.astype(dtype), attention_mask=mask, return_attention=True)
    weights = weights.numpy()
    assert (weights[0, :, :, 2] == 0).all() and (weights[1, :, :, 0] == 0).all() and (weights[1, :, 3] == 0).all()
    _close(output[1, 3], layer.output_bias, 0)
    _close(weights[0].sum(-1), 1, WEIGHTS_TOL)


def test_floating_mask_threshold_is_that_of_the_masks_own_dtype():
    layer = _layer({})
    mask = np.zeros((B, T, T), np.float16)
    mask[:, :, 1] = -65504  # float16's lowest removes
    mask[:, :, 2] = -60000  # a finite penalty, added in float32
    _, weights = layer(X, attention_mask=mask, return_attention=True)
    assert (weights.numpy()[..., 1] == 0).all()
    _close(weights, np_layer(layer, X.astype(np.float64), attention_bias=mask.astype(np.float64)[:, None])[1], 1e-6)


def test_regression_explicit_key_mask_in_self_attention_is_used():
    """`layer(x, key_mask=m)` used to replace m by the query's mask (None): the keys were kept."""
    layer = _layer({})
    _, weights = layer(X, key_mask=KEY_MASK, return_attention=True)
    assert (weights.numpy()[0, :, :, 3] == 0).all() and (weights.numpy()[1, :, :, 1] == 0).all()
    _close(weights, layer(X, attention_mask=KEY_MASK[:, None, :], return_attention=True)[1], 0)
    _, by_value = layer(X, value_mask=KEY_MASK, return_attention=True)
    _close(by_value, weights, 0)


def test_query_mask_gives_output_bias_and_key_mask_defaults_to_it_in_self_attention():
    layer = _layer({})
    query_mask = np.array([[True, True, False, True, True], [True, True, True, True, False]])
    output, weights = layer(X, query_mask=query_mask, return_attention=True)
    _close(output[0, 2], layer.output_bias, 0)
    assert (weights.numpy()[0, :, 2] == 0).all() and (weights.numpy()[0, :, :, 2] == 0).all()
    expected = layer(X, attention_mask=query_mask[:, :, None] & query_mask[:, None, :], return_attention=True)
    _close(weights, expected[1], 0)
    cross = layer(X, key=tf.constant(X), query_mask=query_mask, return_attention=True)[1]
    assert (cross.numpy()[0, :, :, 2] != 0).any()  # with a key given, key_mask does not default to it


def test_explicit_and_implicit_masks_are_anded_in_a_functional_model():
    tokens = np.array([[3, 5, 7, 0, 0], [4, 2, 6, 1, 0]])
    embed = keras.layers.Embedding(10, E, mask_zero=True)
    attention = _layer({"rope_theta": 10.0})
    tokens_in, key_mask_in = keras.Input((None,), dtype="int32"), keras.Input((None,), dtype="bool")
    x = embed(tokens_in)
    output, weights = attention(x, key=x, key_mask=key_mask_in, return_attention=True)
    model = keras.Model([tokens_in, key_mask_in], [output, weights])
    _, got_w = model([tokens, KEY_MASK])
    keep = (tokens != 0) & KEY_MASK
    want = attention(embed(tokens), attention_mask=keep[:, None, :] & (tokens != 0)[:, :, None], return_attention=True)
    _close(got_w, want[1], 0)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_with_every_variant_and_a_float32_bias(policy):
    reference = _layer(VARIANTS["everything"])
    layer = MultiHeadAttention(E, N, **VARIANTS["everything"], dtype=policy)
    layer.import_weights(reference.export_weights())
    for threshold in (1 << 26, 0):  # the explicit and the memory-efficient path
        layer.memory_efficient_threshold = threshold
        output = layer(X, key_mask=KEY_MASK, attention_bias=BIAS_FULL, causal=True)
        assert output.dtype == policy.split("_")[1]
        _close(output, reference(X, key_mask=KEY_MASK, attention_bias=BIAS_FULL, causal=True), MIXED_TOL[policy] * 2)


def test_functional_model_with_every_variant_and_kerastensor_bias():
    x_in, bias_in = keras.Input((T, E)), keras.Input((N, T, T))
    layer = _layer(VARIANTS["everything"])
    model = keras.Model([x_in, bias_in], layer(x_in, attention_bias=bias_in, causal=True))
    _close(model([X, BIAS_FULL]), layer(X, attention_bias=BIAS_FULL, causal=True), OUTPUT_TOL)


# --- configuration, weights, saving -----------------------------------------------------------


def test_weight_layout_order_and_initial_values():
    layer = MultiHeadAttention(E, N, num_kv_heads=2, bias={"value", "query"}, qk_norm="all", sinks=True)
    assert layer.bias == ("query", "value")
    assert layer.weight_shapes() == {
        "query_kernel": (16, 16), "query_bias": (16,), "key_kernel": (16, 8), "value_kernel": (16, 8),
        "value_bias": (8,), "output_kernel": (16, 16), "query_norm": (16,), "key_norm": (8,), "sinks": (4,),
    }  # fmt: skip
    weights = layer.export_weights()
    assert list(weights) == list(layer.weight_shapes())
    assert (weights["query_norm"] == 1).all() and (weights["key_norm"] == 1).all() and (weights["sinks"] == 0).all()
    assert layer.sinks is True and [v.name for v in layer.trainable_weights] == list(weights)
    head = MultiHeadAttention(E, N, qk_norm="head")
    assert head.weight_shapes()["query_norm"] == head.weight_shapes()["key_norm"] == (4,)


def test_scale_is_the_float_actually_used():
    assert MultiHeadAttention(E, N).scale == 0.5 and MultiHeadAttention(E, N, scale=2).scale == 2.0


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_config_round_trip_with_variants(name):
    layer = MultiHeadAttention(E, N, **VARIANTS[name])
    config = layer.get_config()
    assert config["bias"] in (True, False) or isinstance(config["bias"], list)
    clone = MultiHeadAttention.from_config(config)
    assert clone.get_config() == config and clone.weight_shapes() == layer.weight_shapes()


def test_keras_file_round_trip_with_variants(tmp_path):
    x_in = keras.Input((None, E))
    x = _layer(VARIANTS["everything"])(x_in, causal=True)
    x = _layer({"rope_theta": 10.0, "rope_scaling": LLAMA3, "qk_norm": "all", "bias": ["query"]}, seed=1)(x)
    model = keras.Model(x_in, x)
    expected = model(X)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    _close(loaded(X), expected, 0)
    assert loaded.layers[1].get_config() == model.layers[1].get_config()


# --- KV cache with the variants -----------------------------------------------------------------


def test_decoding_with_window_rope_sinks_and_key_mask_equals_the_full_pass():
    layer = _layer({**VARIANTS["everything"], "window": 2})
    key_mask = np.array([[False, True, True, True, True], [True, True, True, False, True]])  # left padding, a hole
    bias = rng.normal(size=(1, N, 1, 8)).astype(np.float32)  # over the L = 8 slots
    full, full_w = layer(X, key_mask=key_mask, attention_bias=bias[..., :T], causal=True, return_attention=True)
    step = tf.function(
        lambda x, m, c: layer(x, key_mask=m, attention_bias=bias, causal=True, return_attention=True, cache=c)
    )
    cache = layer.init_cache(B, 8)
    outputs, weights = [], []
    for start, stop in ((0, 2), (2, 3), (3, 4), (4, 5)):
        output, w, cache = step(X[:, start:stop], key_mask[:, start:stop], cache)
        outputs.append(output)
        weights.append(w[..., :T])
    assert isinstance(cache, KVCache) and int(cache.index) == T
    _close(tf.concat(outputs, 1), full, OUTPUT_TOL)
    _close(tf.concat(weights, 2), full_w, WEIGHTS_TOL)
    np.testing.assert_array_equal(cache.keep.numpy()[:, :T], key_mask)
    assert step.experimental_get_tracing_count() == 2  # one graph for T = 2, one for T = 1


def test_decoding_positions_default_to_the_cache_index():
    layer = _layer(VARIANTS["rope"])
    cache = layer.init_cache(B, T)
    _, cache = layer(X[:, :3], cache=cache, causal=True)
    default, _ = layer(X[:, 3:], cache=cache, causal=True)
    explicit, _ = layer(X[:, 3:], cache=cache, causal=True, positions=[3, 4])
    _close(default, explicit, 0)
    assert np.abs(default - layer(X[:, 3:], cache=cache, causal=True, positions=[0, 1])[0]).max() > 1e-4


ROLLING = {**VARIANTS["everything"], "window": 3}  # GQA, RoPE, sinks, soft-capping, QK-norm and a window of 3
LONG = rng.normal(size=(B, 11, E)).astype(np.float32)  # (B, P, E): 11 tokens, several laps of a small cache
ROLLING_CHUNKS = ((0, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 8), (8, 9), (9, 10), (10, 11))
TOO_SHORT = r"`cache` rolls with `window`: a call that wraps around it \(index \+ T > L\) needs L >= window \+ T - 1"


def _rolling_decode(step, layer, length):
    """Decodes LONG in ROLLING_CHUNKS through `step` with a cache of `length` slots."""
    cache, outputs, weights = layer.init_cache(B, length), [], []
    for start, stop in ROLLING_CHUNKS:
        output, w, cache = step(LONG[:, start:stop], cache)
        outputs.append(output)
        weights.append(w)
    return tf.concat(outputs, 1), tf.concat(weights, 2), cache


def test_rolling_decoding_under_xla_equals_eager_across_wraps_with_one_trace_per_t():
    layer = _layer(ROLLING)
    full = layer(LONG, causal=True)
    eager = _rolling_decode(lambda x, c: layer(x, causal=True, return_attention=True, cache=c), layer, 4)
    step = tf.function(lambda x, c: layer(x, causal=True, return_attention=True, cache=c), jit_compile=True)
    xla = _rolling_decode(step, layer, 4)  # L = 4 = window + T - 1 for the T = 2 chunk at index 6
    _close(eager[0], full, OUTPUT_TOL)
    _close(xla[0], eager[0], OUTPUT_TOL)
    _close(xla[1], eager[1], WEIGHTS_TOL)
    for got, expected in zip(xla[2], eager[2], strict=True):
        _close(got, expected, OUTPUT_TOL)
    assert int(xla[2].index) == LONG.shape[1]
    assert step.experimental_get_tracing_count() == 2  # T = 2 and T = 1, whatever the lap


def test_rolling_cache_is_a_while_loop_variable():
    layer, tokens = _layer(ROLLING), tf.constant(LONG)
    steps = LONG.shape[1]

    @tf.function
    def greedy_steps(cache):
        def body(i, cache, outputs):
            output, cache = layer(tokens[:, i : i + 1], causal=True, cache=cache)
            return i + 1, cache, outputs.write(i, output[:, 0])

        loop_vars = (tf.constant(0), cache, tf.TensorArray(tf.float32, size=steps))
        _, cache, outputs = tf.while_loop(lambda i, *_: i < steps, body, loop_vars)
        return tf.transpose(outputs.stack(), [1, 0, 2]), cache

    padding = np.arange(steps) >= np.array([[0], [1]])  # (B, P): the second prompt is left-padded by 1
    output, cache = greedy_steps(layer.init_cache(B, 3, keep=padding[:, :3]))  # L = window: enough for T = 1
    _close(output, layer(LONG, key_mask=padding, causal=True), OUTPUT_TOL)  # slot 0 holds a real token again
    assert int(cache.index) == steps and tuple(cache.key.shape) == (B, 2, 3, E // N)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["function", "xla"])
def test_rolling_cache_too_short_for_a_wrapping_call(jit_compile):
    """L = 4 < window + T - 1 = 5: the T = 3 call at index 2 would overwrite its first query's keys."""
    layer = _layer(ROLLING)
    step = tf.function(lambda x, c: layer(x, causal=True, cache=c), jit_compile=jit_compile)
    _, cache = step(LONG[:, :2], layer.init_cache(B, 4))
    fits, _ = step(LONG[:, :3], layer.init_cache(B, 4))  # the same T without a wrap is no error
    assert np.isfinite(fits.numpy()).all()
    if not jit_compile:
        with pytest.raises(tf.errors.InvalidArgumentError, match=TOO_SHORT):
            step(LONG[:, 2:5], cache)
    else:
        assert np.isnan(step(LONG[:, 2:5], cache)[0].numpy()).all()  # XLA drops the assertion


def test_rolling_cache_too_short_raises_eagerly():
    layer = _layer(ROLLING)
    _, cache = layer(LONG[:, :2], causal=True, cache=layer.init_cache(B, 4))
    with pytest.raises(ValueError, match=TOO_SHORT + r" .*Received: window=3, T=3, L=4"):
        layer(LONG[:, 2:5], causal=True, cache=cache)


# --- errors --------------------------------------------------------------------------------------

WINDOW_ERROR = r"`window` must be None, a positive integer or a pair \(before, after\) of positive integers\."
CONSTRUCTOR_ERRORS = {
    "bias_string": ({"bias": "query"}, r"^`bias` must be True, False or a list, tuple or set of 'query', 'key', 'value', 'output', 'gate'\. Received: bias='query'$"),
    "bias_unknown_name": ({"bias": ("query", "qkv")}, r"Received: bias=\('query', 'qkv'\)$"),
    "scale_zero": ({"scale": 0.0}, r"^`scale` must be a positive float\. Received: scale=0\.0$"),
    "softcap_negative": ({"softcap": -1.0}, r"^`softcap` must be None or a positive float\. Received: softcap=-1\.0$"),
    "window_zero": ({"window": 0}, rf"^{WINDOW_ERROR} Received: window=0$"),
    "window_float": ({"window": 2.5}, rf"^{WINDOW_ERROR} Received: window=2\.5$"),
    "window_bool": ({"window": True}, rf"^{WINDOW_ERROR} Received: window=True$"),
    "window_pair_zero": ({"window": (3, 0)}, rf"^{WINDOW_ERROR} Received: window=\(3, 0\)$"),
    "window_pair_none": ({"window": [None, 2]}, rf"^{WINDOW_ERROR} Received: window=\[None, 2\]$"),
    "window_triple": ({"window": (1, 2, 3)}, rf"^{WINDOW_ERROR} Received: window=\(1, 2, 3\)$"),
    "window_string": ({"window": "64"}, rf"^{WINDOW_ERROR} Received: window='64'$"),
    "window_dict": ({"window": {"before": 2}}, rf"^{WINDOW_ERROR} Received: window=\{{'before': 2\}}$"),
    "attention_chunk_size_zero": ({"attention_chunk_size": 0}, r"^`attention_chunk_size` must be a positive integer\. Received: attention_chunk_size=0$"),
    "attention_chunk_size_pair": ({"attention_chunk_size": (2, 2)}, r"Received: attention_chunk_size=\(2, 2\)$"),
    "rope_sections_int": ({"rope_sections": 2}, r"^`rope_sections` must be None or a list or tuple of positive integers\. Received: rope_sections=2$"),
    "rope_sections_zero": ({"rope_sections": [2, 0]}, r"Received: rope_sections=\[2, 0\]$"),
    "rope_sections_empty": ({"rope_sections": ()}, r"Received: rope_sections=\(\)$"),
    "rope_sections_sum": ({"rope_theta": 10.0, "rope_sections": (1, 2)}, r"^`rope_sections` must sum to R/2 = 2, the pairs RoPE rotates \(R = int\(head_dim \* rope_fraction\) = 4\)\. Received: rope_sections=\(1, 2\)$"),
    "qk_norm_type": ({"qk_norm_type": "l2"}, r"^`qk_norm_type` must be 'rms' or 'layer'\. Received: qk_norm_type='l2'$"),
    "qk_norm_type_none": ({"qk_norm": "head", "qk_norm_type": None}, r"Received: qk_norm_type=None$"),
    "qk_norm_bias": ({"qk_norm_bias": 1}, r"^`qk_norm_bias` must be True or False\. Received: qk_norm_bias=1$"),
    "first_bad_argument": ({"window": 0, "attention_chunk_size": 0, "qk_norm_type": "x"}, r"^`window` must"),
    "flags_last": ({"qk_norm_bias": "yes", "qk_norm_type": "x"}, r"^`qk_norm_type` must"),
    "rope_theta_zero": ({"rope_theta": 0}, r"^`rope_theta` must be None or a positive float\. Received: rope_theta=0$"),
    "rope_fraction_odd": ({"rope_theta": 10.0, "rope_fraction": 0.75}, r"^`rope_fraction` must be in \(0, 1\] and rotate an even number R = int\(head_dim \* rope_fraction\) >= 2 of features\. Received: rope_fraction=0\.75, head_dim=4$"),
    "rope_fraction_above_one": ({"rope_theta": 10.0, "rope_fraction": 1.5}, r"Received: rope_fraction=1\.5, head_dim=4$"),
    "rope_scaling_type": ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, r"^`rope_scaling` must be None or a dict whose rope_type is 'linear', 'llama3', 'yarn' or 'proportional', with its parameters\. Received: rope_scaling=\{'rope_type': 'longrope', 'factor': 2\.0\}$"),
    "rope_scaling_missing": ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0}}, r"^`rope_scaling` must be None or a dict"),
    "qk_norm": ({"qk_norm": "layer"}, r"^`qk_norm` must be None, 'head', 'per_head' or 'all'\. Received: qk_norm='layer'$"),
    "qk_norm_eps": ({"qk_norm_eps": 0.0}, r"^`qk_norm_eps` must be a positive float\. Received: qk_norm_eps=0\.0$"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONSTRUCTOR_ERRORS))
def test_constructor_errors(name):
    kwargs, pattern = CONSTRUCTOR_ERRORS[name]
    with pytest.raises(ValueError, match=pattern):
        MultiHeadAttention(E, N, **kwargs)


KERAS_FRAME = re.compile(r"Exception encountered when calling .*?\x1b\[1m(.*?)\x1b\[0m", re.DOTALL)
Y = rng.normal(size=(B, 7, E)).astype(np.float32)  # (B, S, E)
SQUARE = rng.normal(size=(2, 2, E)).astype(np.float32)  # B == T == 2

CALL_ERRORS = {
    "positions_without_rope": ({}, {"query": X, "positions": np.arange(T)}, r"^`positions` needs RoPE: construct the layer with `rope_theta`\. Received: positions with rope_theta=None$"),
    "positions_shape": ({"rope_theta": 10.0}, {"query": X, "positions": np.zeros((3, T), np.int32)}, r"^`positions` must be an integer tensor of shape \(B, T\) or \(T,\) with B=2, T=5\. Received: positions\.shape=\(3, 5\), positions\.dtype=int32$"),
    "positions_float": ({"rope_theta": 10.0}, {"query": X, "positions": np.arange(T, dtype=np.float32)}, r"Received: positions\.shape=\(5,\), positions\.dtype=float32$"),
    "positions_sections_rows": ({"rope_theta": 10.0, "rope_sections": (1, 1)}, {"query": X, "positions": np.zeros((3, B, T), np.int32)}, r"^`positions` must be an integer tensor of shape \(B, T\), \(T,\) or \(2, B, T\) with B=2, T=5 \(one row per section of `rope_sections`\)\. Received: positions\.shape=\(3, 2, 5\), positions\.dtype=int32$"),
    "positions_rank3_without_sections": ({"rope_theta": 10.0}, {"query": X, "positions": np.zeros((2, B, T), np.int32)}, r"^`positions` must be an integer tensor of shape \(B, T\) or \(T,\) with B=2, T=5\. Received: positions\.shape=\(2, 2, 5\)"),
    "rope_cross_attention": ({"rope_theta": 10.0}, {"query": X, "key": Y}, r"^RoPE needs `key` and `value` to hold the query's own tokens \(S == T, or decoding with `cache`\)\. Received: query\.shape=\(2, 5, 16\), key\.shape=\(2, 7, 16\)$"),
    "key_mask_shape": ({}, {"query": X, "key": Y, "key_mask": np.ones((B, T), bool)}, r"^`key_mask` must be a boolean tensor of shape \(B, S\)=\(2, 7\)\. Received: key_mask\.shape=\(2, 5\), key_mask\.dtype=bool$"),
    "key_mask_float": ({}, {"query": X, "key_mask": np.ones((B, T), np.float32)}, r"Received: key_mask\.shape=\(2, 5\), key_mask\.dtype=float32$"),
    "query_mask_shape": ({}, {"query": X, "query_mask": np.ones((B, 7), bool)}, r"^`query_mask` must be a boolean tensor of shape \(B, T\)=\(2, 5\)\. Received: query_mask\.shape=\(2, 7\), query_mask\.dtype=bool$"),
    "attention_bias_bool": ({}, {"query": X, "attention_bias": np.ones((T, T), bool)}, r"^`attention_bias` must be floating\. Received: attention_bias\.dtype=bool$"),
    "attention_bias_shape": ({}, {"query": X, "attention_bias": np.ones((3, T, T), np.float32)}, r"^`attention_bias` must broadcast to \(B, N, T, S\) .*Received: attention_bias\.shape=\(3, 5, 5\)$"),
    "mixed_dtypes": ({}, {"query": X, "key": Y.astype(np.float64)}, r"^`query`, `key` and `value` must have the same dtype\. Received: query\.dtype=float32, key\.dtype=float64, value\.dtype=float64$"),
    "mixed_dtypes_value": ({}, {"query": X, "key": Y, "value": tf.constant(Y, tf.float16)}, r"Received: query\.dtype=float32, key\.dtype=float32, value\.dtype=float16$"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CALL_ERRORS))
def test_call_errors(name):
    config, call, pattern = CALL_ERRORS[name]
    layer = MultiHeadAttention(E, N, **config)
    with pytest.raises(ValueError) as error:
        layer(**call)
    framed = KERAS_FRAME.match(str(error.value))
    assert re.search(pattern, framed.group(1) if framed else str(error.value)), str(error.value)


def test_key_and_value_by_position_in_the_project_order():
    """`layer(query, key, value)` as in the other two files (Keras' built-in is called (query, value, key))."""
    layer = MultiHeadAttention(E, N, vdim=3)
    value = rng.normal(size=(B, 7, 3)).astype(np.float32)
    _close(layer(X, Y, value), layer(X, key=Y, value=value), 0)
    layer = MultiHeadAttention(E, N)
    _close(layer(X, Y), layer(X, key=Y, value=Y), 0)


def test_mask_habits_are_not_read_where_values_cannot_be_read():
    """In a graph the values of a mask are unknown (no warning): an all-False mask there is every
    row with no key (weights 0), as in eager mode; a (T, S) mask with B == T is (T, S) in both."""
    layer = _layer({})
    attend = tf.function(lambda x, m: layer(x, attention_mask=m, return_attention=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttentionMaskWarning)
        output, weights = attend(X, np.zeros((T, T), bool))
    assert (weights.numpy() == 0).all()
    _close(output, np.broadcast_to(layer.output_bias.numpy(), X.shape), 0)
    unknown = tf.function(lambda x, m: layer(x, attention_mask=m), input_signature=[
        tf.TensorSpec((None, None, E)), tf.TensorSpec((None, None), tf.bool)
    ])  # fmt: skip
    _close(
        unknown(SQUARE, np.tril(np.ones((2, 2), bool))),
        layer(SQUARE, attention_mask=np.tril(np.ones((1, 2, 2), bool))),
        0,
    )


# --- issue 28: two-sided window, attention chunks, multimodal RoPE, LayerNorm / per-head / biased QK-norm ---
# (NEW_VARIANTS and the paths each runs against the NumPy file: `_numpy_paths`, above)


def _positions_for(layer, seed=3):
    """(k, B, T) positions with rows that differ for a layer with `rope_sections`, else None."""
    if layer.rope_sections is None:
        return None
    local = np.random.default_rng(seed)
    return local.integers(0, 40, size=(len(layer.rope_sections), B, T)).astype(np.int32)


def _numpy_twin(layer):
    twin = NumpyMultiHeadAttention(E, N, **VARIANTS_BY_LAYER[id(layer)])
    twin.import_weights(layer.export_weights())
    return twin


VARIANTS_BY_LAYER = {}


def _new_layer(name, seed=0, **kwargs):
    layer = _layer(VARIANTS[name], seed=seed, **kwargs)
    VARIANTS_BY_LAYER[id(layer)] = VARIANTS[name]
    return layer


def _tf_output_and_grads(layer, path, positions, causal, g):
    """Output and the gradients of sum(output * g) (query, attention_bias, every weight) on one path."""
    layer.memory_efficient_threshold = 0 if path.startswith("memory_efficient") else 1 << 26
    layer.query_chunk_elements = 2 * B * N * T  # two queries per block: 5 rows leave a padded block

    def step(x, bias):
        with tf.GradientTape() as tape:
            tape.watch([x, bias])
            output = layer(x, key_mask=KEY_MASK, attention_bias=bias, positions=positions, causal=causal)
            loss = tf.reduce_sum(output * g)
        return output, tape.gradient(loss, [x, bias, *layer.trainable_weights])

    if path in ("function", "memory_efficient"):
        step = tf.function(step)
    if path.endswith("jit_compile") or path.endswith("_jit"):
        step = tf.function(step, jit_compile=True)
    return step(tf.constant(X), tf.constant(BIAS_FULL))


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("name", NEW_VARIANTS)
def test_new_variant_matches_the_numpy_file_on_every_path(name, causal):
    """Output and attention weights against the NumPy file, and the gradients of the query, the
    attention bias and every weight (norm biases included) against its `backward`, on the paths
    of `_numpy_paths` (tf.function, XLA, the memory-efficient path with and without XLA)."""
    layer = _new_layer(name)
    twin, positions = _numpy_twin(layer), _positions_for(layer)
    x64, g = X.astype(np.float64), rng.normal(size=(B, T, E))
    call = dict(key_mask=KEY_MASK, attention_bias=BIAS_FULL.astype(np.float64), positions=positions, causal=causal)
    expected, expected_w = twin(x64, return_attention=True, **call)
    _, weights = layer(X, return_attention=True, **{**call, "attention_bias": BIAS_FULL})
    _close(weights, expected_w, WEIGHTS_TOL)
    grads = twin.backward(g)
    names = ["query", "attention_bias", *(v.name for v in layer.trainable_weights)]
    assert names[2:] == list(layer.weight_shapes())
    for path in _numpy_paths(name):
        output, got = _tf_output_and_grads(layer, path, positions, causal, tf.constant(g, tf.float32))
        _close(output, expected, OUTPUT_TOL)
        for grad_name, grad in zip(names, got, strict=True):
            assert grad is not None, (path, grad_name)
            _close(grad, grads[grad_name], GRADS_TOL)


def test_new_weights_have_gradients_that_are_not_zero():
    """The norm biases, per-head scales and LayerNorm get a gradient of their own (not just a
    shape): a check that the backward compared above exercises them."""
    layer = _new_layer("everything_new")
    twin = _numpy_twin(layer)
    twin(X.astype(np.float64), positions=_positions_for(layer), causal=True)
    grads = twin.backward(np.ones((B, T, E)))
    for name in ("query_norm", "key_norm", "query_norm_bias", "key_norm_bias"):
        assert np.abs(grads[name]).max() > 1e-6, name


def test_window_pair_and_attention_chunk_masks():
    np.testing.assert_array_equal(
        tf_file.window_mask(4, 6, (2, 2)).numpy(),
        [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]],
    )
    np.testing.assert_array_equal(
        tf_file.window_mask(3, 3, 2).numpy(), [[1, 1, 1], [1, 1, 1], [0, 1, 1]]
    )  # no limit after
    np.testing.assert_array_equal(
        tf_file.attention_chunk_mask(3, 5, 2).numpy(), [[0, 0, 1, 1, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]
    )  # queries at positions 2, 3, 4 (bottom-right aligned)
    modern_bert = tf_file.window_mask(300, 300, (65, 65)).numpy()  # |t - s| <= 64
    distance = np.abs(np.arange(300)[:, None] - np.arange(300)[None])
    np.testing.assert_array_equal(modern_bert, distance <= 64)


@pytest.mark.parametrize(
    "variant",
    [{"window": (2, 1)}, {"window": (1, 3), "causal": True}, {"attention_chunk_size": 2}, {"window": (3, 2),
     "attention_chunk_size": 4, "sinks": np.array([0.5, -1.0, 2.0, 0.0])}],
    ids=["pair", "pair_causal", "chunk", "pair_chunk_sinks"],
)  # fmt: skip
def test_dot_product_attention_new_masks_match_the_formula(variant):
    local = np.random.default_rng(1)
    q = local.normal(size=(2, 4, 3, 8)).astype(np.float32)  # T < S: bottom-right aligned
    k, v = (local.normal(size=(2, 2, 6, 8)).astype(np.float32) for _ in range(2))
    chunk = variant.pop("attention_chunk_size", None)
    context, weights = dot_product_attention(q, k, v, attention_chunk_size=chunk, **variant)
    expected, expected_w = np_attention(q, k, v, chunk=chunk, **variant)
    _close(weights, expected_w, WEIGHTS_TOL)
    _close(context, expected, OUTPUT_TOL)


def test_rope_sections_interleaved_survives_get_config():
    layer = MultiHeadAttention(
        E, N, rope_theta=100.0, head_dim=8, rope_sections=[2, 1, 1], rope_sections_interleaved=True
    )
    assert layer.get_config()["rope_sections_interleaved"] is True
    assert MultiHeadAttention.from_config(layer.get_config()).rope_sections_interleaved is True
    assert MultiHeadAttention(E, N).get_config()["rope_sections_interleaved"] is False


def test_rope_sections_with_one_row_are_plain_rope_and_rows_turn_their_pairs():
    plain = _layer({"rope_theta": 100.0, "head_dim": 8})
    sections = MultiHeadAttention(E, N, rope_theta=100.0, head_dim=8, rope_sections=[1, 3])
    sections.import_weights(plain.export_weights())
    assert sections.rope_sections == (1, 3) and sections.get_config()["rope_sections"] == [1, 3]
    positions = np.array([[0, 1, 2, 0, 1], [5, 6, 7, 8, 9]])
    for given in (None, positions, positions[1], np.stack([positions, positions])):
        rows = positions if np.ndim(given) == 3 else given
        _close(sections(X, positions=given), plain(X, positions=rows), 0)
    rows = np.stack([positions, positions[::-1] * 3])  # (k, B, T): the 3 pairs of section 1 turn by other positions
    _, weights = sections(X, positions=rows, return_attention=True)
    _close(weights, np_layer(sections, X.astype(np.float64), positions=rows)[1], WEIGHTS_TOL)
    assert np.abs(weights.numpy() - plain(X, positions=positions, return_attention=True)[1].numpy()).max() > 1e-3
    angles = tf_file.rope_angles(rows, tf_file.rope_frequencies(8, 100.0), (1, 3)).numpy()  # (B, T, R/2)
    inv = np_inv_freq(8, 100.0)
    _close(angles[..., 0], rows[0] * inv[0], 1e-4)
    _close(angles[..., 1:], rows[1][..., None] * inv[1:], 1e-4)


def test_layer_norm_matches_the_formula_in_float32_for_half_inputs():
    x = rng.normal(size=(2, 3, 8)).astype(np.float32) + 5
    scale, bias = rng.normal(size=(8,)).astype(np.float32), rng.normal(size=(8,)).astype(np.float32)
    _close(tf_file.layer_norm(tf.constant(x), scale, 1e-6, bias), np_layer_norm(x, scale, 1e-6) + bias, OUTPUT_TOL)
    half = tf_file.layer_norm(tf.constant(x * 300, tf.float16), scale, 1e-6, bias)  # x ** 2 overflows float16
    assert half.dtype == tf.float16
    _close(half, np_layer_norm(x, scale, 1e-6) + bias, TOLERANCES["float16"]["output"] * 3)
    _close(tf_file.rms_norm(tf.constant(x), scale, 1e-6, bias), np_rms_norm(x, scale, 1e-6) + bias, OUTPUT_TOL)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_with_the_new_variants(policy):
    reference = _layer(VARIANTS["everything_new"])
    layer = MultiHeadAttention(E, N, **VARIANTS["everything_new"], dtype=policy)
    layer.import_weights(reference.export_weights())
    positions = _positions_for(reference)
    for threshold in (1 << 26, 0):  # the explicit and the memory-efficient path
        layer.memory_efficient_threshold = threshold
        output = layer(X * 100, key_mask=KEY_MASK, positions=positions, causal=True)  # large q, k: norms in float32
        assert output.dtype == policy.split("_")[1]
        expected = reference(X * 100, key_mask=KEY_MASK, positions=positions, causal=True)
        _close(output, expected, MIXED_TOL[policy] * 2)


def test_new_weight_layout_order_initial_values_and_config():
    layer = MultiHeadAttention(E, N, num_kv_heads=2, qk_norm="per_head", qk_norm_type="layer", qk_norm_bias=True,
                               sinks=True, window=[65, 65], attention_chunk_size=8192)  # fmt: skip
    assert list(layer.weight_shapes())[-5:] == ["query_norm", "key_norm", "query_norm_bias", "key_norm_bias", "sinks"]
    assert layer.weight_shapes()["query_norm_bias"] == (16,) and layer.weight_shapes()["key_norm_bias"] == (8,)
    weights = layer.export_weights()
    assert (weights["query_norm"] == 1).all() and (weights["key_norm_bias"] == 0).all()
    assert (weights["query_norm_bias"] == 0).all()
    assert [v.name for v in layer.trainable_weights] == list(weights)
    assert layer.window == (65, 65) and type(layer.window[0]) is int
    config = layer.get_config()
    assert config["window"] == [65, 65] and config["attention_chunk_size"] == 8192
    assert (config["qk_norm"], config["qk_norm_type"], config["qk_norm_bias"]) == ("per_head", "layer", True)
    clone = MultiHeadAttention.from_config(config)
    assert clone.window == (65, 65) and clone.get_config() == config
    assert MultiHeadAttention(E, N, qk_norm_bias=True).weight_shapes().keys().isdisjoint({"query_norm_bias"})
    assert MultiHeadAttention(E, N, window=np.int64(3)).window == 3
    assert MultiHeadAttention(E, N, qk_norm_type=np.str_("layer")).qk_norm_type == "layer"
    assert MultiHeadAttention(E, N, rope_sections=(np.int32(1), 2)).rope_sections == (1, 2)  # only checked


@pytest.mark.parametrize(
    "config",
    [
        {"window": (2, 2)},
        {"attention_chunk_size": 4},
        {"qk_norm": "per_head"},
        {"qk_norm": "head", "qk_norm_type": "layer"},
        {"gate": True, "gate_activation": "softplus"},
    ],
    ids=["window_pair", "chunk", "per_head", "layer_norm", "softplus_gate"],
)
def test_to_keras_refuses_the_new_variants(config):
    with pytest.raises(ValueError, match=r"^`to_keras` needs a layer the Keras built-ins can hold.*Received: "):
        MultiHeadAttention(E, N, **config).to_keras()


def test_to_keras_takes_switched_off_sub_options():
    """`qk_norm_type`, `qk_norm_bias` without `qk_norm` and `rope_sections` without RoPE change
    nothing, so they are not refused (the built-in computes the same numbers)."""
    x = np.random.default_rng(0).normal(size=(2, 3, E)).astype(np.float32)
    layer = MultiHeadAttention(E, N, qk_norm_type="layer", qk_norm_bias=True, rope_sections=(1, 1))
    np.testing.assert_allclose(layer.to_keras()(x, x).numpy(), layer(x).numpy(), atol=OUTPUT_TOL, rtol=0)


def test_keras_file_round_trip_with_the_new_variants(tmp_path):
    x_in = keras.Input((T, E))
    layer = _layer(VARIANTS["everything_new"])
    model = keras.Model(x_in, layer(x_in, causal=True))
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    _close(loaded(X), model(X), 0)
    assert loaded.layers[1].window == (3, 2) and loaded.layers[1].get_config() == layer.get_config()


# --- the new variants with a KV cache --------------------------------------------------------------

DECODE_VARIANTS = (
    "window_pair", "attention_chunk_window_pair", "rope_sections_interleaved_yarn", "everything_new", "gate_gqa_no_bias_rope",
)  # fmt: skip


@pytest.mark.parametrize("name", DECODE_VARIANTS)
def test_token_by_token_with_the_in_place_cache_under_tf_function_equals_the_full_pass(name):
    layer = _new_layer(name)
    positions = _positions_for(layer)
    key_mask = np.array([[False, True, True, True, True], [True, True, True, False, True]])  # left padding, a hole
    full = layer(X, key_mask=key_mask, positions=positions, causal=True)
    cache = layer.init_cache(B, 8, in_place=True)

    @tf.function
    def step(x, m, p):
        return layer(x, key_mask=m, positions=p, causal=True, cache=cache)[0]

    outputs = []
    for t in range(T):
        p = None if positions is None else positions[..., t : t + 1]
        outputs.append(step(X[:, t : t + 1], key_mask[:, t : t + 1], p))
    _close(tf.concat(outputs, 1), full, OUTPUT_TOL)
    assert int(cache.index.numpy()) == T


def _in_place_step(layer, cache, jit_compile):
    """A compiled step writing the in-place `cache`, returning only its output."""
    return tf.function(lambda x, p: layer(x, positions=p, cache=cache)[0], jit_compile=jit_compile)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["function", "xla"])
@pytest.mark.parametrize("name", ["attention_chunk_window_pair", "everything_new"])
def test_bidirectional_calls_with_a_cache_see_their_own_tokens_in_the_window_and_chunk(name, jit_compile):
    """Calls of several tokens, not causal, through a functional cache: each query sees the keys
    up to the end of its own call, within the pair window and its chunk; that is the full pass
    with a block-causal mask. Then the same calls with the in-place cache."""
    layer = _new_layer(name)
    positions = _positions_for(layer)
    calls = ((0, 2), (2, 3), (3, 5))
    ends = np.concatenate([np.full(stop - start, stop) for start, stop in calls])  # (T,): the end of each query's call
    block = np.arange(T)[None, :] < ends[:, None]  # (T, S)
    full = layer(X, attention_mask=block, positions=positions)
    expected = np_layer(layer, X.astype(np.float64), positions=positions, keep=block)[0]
    _close(full, expected, OUTPUT_TOL)
    functional = tf.function(lambda x, p, c: layer(x, positions=p, cache=c), jit_compile=jit_compile)
    for in_place in (False, True):
        cache, outputs = layer.init_cache(B, T, in_place=in_place), []
        written = _in_place_step(layer, cache, jit_compile)
        for start, stop in calls:
            p = None if positions is None else positions[..., start:stop]
            if in_place:
                output = written(X[:, start:stop], p)
            else:
                output, cache = functional(X[:, start:stop], p, cache)
            outputs.append(output)
        _close(tf.concat(outputs, 1), full, OUTPUT_TOL)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["function", "xla"])
def test_rolling_cache_with_a_window_pair_and_chunks(jit_compile):
    """A pair window rolls the cache by W_before (L = W_before slots for one token a step): each
    step equals the full causal pass, with the chunks too."""
    config = {**VARIANTS["everything_new"], "window": (3, 2)}
    layer = _layer(config)
    positions = np.broadcast_to(np.arange(LONG.shape[1]), (2, B, LONG.shape[1])).copy()
    positions[1] = positions[1] * 2  # the second section turns by other positions
    full = layer(LONG, positions=positions, causal=True)
    step = tf.function(lambda x, p, c: layer(x, positions=p, causal=True, cache=c), jit_compile=jit_compile)
    cache, outputs = layer.init_cache(B, 3), []
    for t in range(LONG.shape[1]):
        output, cache = step(LONG[:, t : t + 1], positions[..., t : t + 1], cache)
        outputs.append(output)
    _close(tf.concat(outputs, 1), full, OUTPUT_TOL)
    assert step.experimental_get_tracing_count() == 1
    with pytest.raises(ValueError, match=TOO_SHORT + r" .*Received: window=3, T=3, L=3"):
        layer(LONG[:, :3], positions=positions[..., :3], causal=True, cache=cache)


def test_unknown_shapes_under_tf_function_and_xla_with_the_new_variants():
    """B, T and S unknown at trace time, (k, B, T) positions too: the explicit path picked at run
    time (tf.function) and the memory-efficient path (XLA) give the eager output and gradients."""
    layer = _new_layer("everything_new")
    positions = _positions_for(layer)

    def step(x, p):
        with tf.GradientTape() as tape:
            tape.watch(x)
            output = layer(x, positions=p, key_mask=KEY_MASK)
        return output, tape.gradient(tf.reduce_sum(output**2), [x, *layer.trainable_weights])

    expected = step(tf.constant(X), positions)
    signature = [tf.TensorSpec((None, None, E)), tf.TensorSpec((2, None, None), tf.int32)]
    key_mask_free = tf.function(
        lambda x, p: layer(x, positions=p, attention_mask=KEY_MASK[:, None, :]), input_signature=signature
    )
    _close(key_mask_free(X, positions), expected[0], OUTPUT_TOL)
    layer.memory_efficient_threshold, layer.query_chunk_elements = 0, 1  # one query per block

    def step_any(x, p):
        with tf.GradientTape() as tape:
            tape.watch(x)
            output = layer(x, positions=p, attention_mask=KEY_MASK[:, None, :])
        return output, tape.gradient(tf.reduce_sum(output**2), [x, *layer.trainable_weights])

    output, grads = tf.function(step_any, input_signature=signature, jit_compile=True)(X, positions)
    _close(output, expected[0], OUTPUT_TOL)
    for got, want in zip(grads, expected[1], strict=True):
        _close(got, want, GRADS_TOL)


@pytest.mark.parametrize("name", ["attention_chunk_window_pair", "everything_new"])
def test_int8_with_the_new_variants_runs_as_the_numpy_int8_layer(name):
    layer = _new_layer(name)
    layer.quantize("int8")
    twin = NumpyMultiHeadAttention(E, N, **VARIANTS[name])
    twin.import_weights(layer.export_weights())
    assert twin.quantization_mode == "int8"
    positions = _positions_for(layer)
    expected = twin(X.astype(np.float64), positions=positions, causal=True)
    for threshold in (1 << 26, 0):
        layer.memory_efficient_threshold = threshold
        _close(layer(X, positions=positions, causal=True), expected, 2e-3)


# --- multi-head latent attention (MLA) -------------------------------------------------------------

MLA = {"kv_lora_rank": 6, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 3}
MLA_VARIANTS = {
    "mla": {**MLA, "rope_theta": 100.0},
    "mla_q_lora_gqa_yarn_bias": {
        "kv_lora_rank": 5, "q_lora_rank": 7, "qk_nope_head_dim": 2, "qk_rope_head_dim": 4, "v_head_dim": 5,
        "num_kv_heads": 2, "rope_theta": 10.0, "rope_interleaved": True, "rope_scaling": YARN, "bias": True,
        "latent_norm_eps": 1e-3,
    },
    "mla_everything": {
        **MLA, "q_lora_rank": 5, "num_kv_heads": 2, "scale": 0.3, "softcap": 3.0, "window": (3, 2),
        "attention_chunk_size": 3, "rope_theta": 50.0, "sinks": True, "bias": ("query_b", "key_value_b", "output"),
    },
    "mla_cross_attention": {**MLA, "kdim": 10, "bias": ("key_value_a", "key_value_b"), "sinks": True},
}  # fmt: skip
MLA_DECODE = ("mla", "mla_q_lora_gqa_yarn_bias", "mla_everything")
MLA_AGAINST_NUMPY = ("mla_q_lora_gqa_yarn_bias", "mla_everything")  # every path against the NumPy file
LEFT_PADDED = np.array([[False, True, True, True, True], [True, True, True, False, True]])  # left padding, a hole


def _mla_layer(name, absorb_latents=None):
    layer = _layer(MLA_VARIANTS[name])
    layer.absorb_latents = absorb_latents
    return layer


@pytest.mark.parametrize("absorb", [False, True], ids=["expanded", "absorbed"])
@pytest.mark.parametrize(
    "name", [name for name in MLA_VARIANTS if name not in ("mla_cross_attention", *MLA_AGAINST_NUMPY)]
)
def test_mla_every_path_gives_the_same_output_and_gradients(name, absorb):
    """Eager, tf.function, XLA and the memory-efficient path, on the expanded and the absorbed
    attention (forced without a cache: the same numbers), gradients of every weight included. The
    variants of `MLA_AGAINST_NUMPY` run these paths with the same call against the NumPy file
    (`test_mla_matches_the_numpy_file_on_every_path`)."""
    _same_on_every_path(_mla_layer(name, absorb), PATHS[1:], BIAS_FULL)


def test_mla_absorbed_equals_expanded_in_cross_attention_with_weights():
    layer = _mla_layer("mla_cross_attention")
    key = rng.normal(size=(B, 7, 10)).astype(np.float32)
    results = []
    for absorb in (False, True):
        layer.absorb_latents = absorb
        with tf.GradientTape() as tape:
            output, weights = layer(X, key, return_attention=True, key_mask=np.ones((B, 7), bool))
            loss = tf.reduce_sum(output * tf.cos(output))
        results.append((output, weights, tape.gradient(loss, layer.trainable_weights)))
    (expanded, expanded_w, expanded_g), (absorbed, absorbed_w, absorbed_g) = results
    _close(absorbed, expanded, OUTPUT_TOL)
    _close(absorbed_w, expanded_w, WEIGHTS_TOL)
    for got, want in zip(absorbed_g, expanded_g, strict=True):
        _close(got, want, GRADS_TOL)


@pytest.mark.parametrize("absorb", [None, False, True], ids=["automatic", "expanded", "absorbed"])
@pytest.mark.parametrize("name", MLA_DECODE)
def test_mla_decoding_with_the_latent_cache_equals_the_full_pass(name, absorb):
    """A prompt of 2 tokens, then one token at a time, left padding and a hole in `key_mask`;
    the cache holds (B, 1, L, C) latents and (B, 1, L, Hr) shared key parts."""
    layer = _mla_layer(name, absorb)
    full, full_w = layer(X, key_mask=LEFT_PADDED, causal=True, return_attention=True)
    cache = layer.init_cache(B, 8)
    assert tuple(cache.key.shape) == (B, 1, 8, layer.kv_lora_rank)
    assert tuple(cache.value.shape) == (B, 1, 8, layer.qk_rope_head_dim)
    outputs = []
    for start, stop in ((0, 2), (2, 3), (3, 4), (4, 5)):
        output, weights, cache = layer(
            X[:, start:stop], key_mask=LEFT_PADDED[:, start:stop], causal=True, return_attention=True, cache=cache
        )
        _close(weights[..., :T], full_w[:, :, start:stop], WEIGHTS_TOL)
        assert not np.asarray(weights[..., T:]).any()
        outputs.append(output)
    _close(tf.concat(outputs, 1), full, OUTPUT_TOL)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["function", "xla"])
@pytest.mark.parametrize("absorb", [False, True], ids=["expanded", "absorbed"])
def test_mla_in_place_latent_cache_under_tf_function_equals_the_full_pass(absorb, jit_compile):
    """The in-place cache of `tf.Variable`s, rolling (L = 4 < T with window (3, 2), causal), one
    token a step in a compiled function."""
    layer = _mla_layer("mla_everything", absorb)
    full = layer(X, key_mask=LEFT_PADDED, causal=True)
    cache = layer.init_cache(B, 4, in_place=True)
    step = tf.function(lambda x, m: layer(x, key_mask=m, causal=True, cache=cache)[0], jit_compile=jit_compile)
    outputs = [step(X[:, t : t + 1], LEFT_PADDED[:, t : t + 1]) for t in range(T)]
    _close(tf.concat(outputs, 1), full, OUTPUT_TOL)
    assert int(cache.index.numpy()) == T


@pytest.mark.parametrize("name", ["mla_q_lora_gqa_yarn_bias", "mla_everything"])
def test_mla_int8_decoding_equals_the_full_int8_pass_on_both_paths(name):
    """The latent projections quantized by the int8 rule; the absorbed path reads the latents
    quantized per token and the dequantized key_value_b kernel: the expanded path's products."""
    layer = _mla_layer(name)
    layer.quantize("int8")
    assert {f"{kind}_kernel_scale" for kind in layer._projection_names} <= set(layer.weight_shapes())
    full = layer(X, causal=True)
    for absorb in (False, True):
        layer.absorb_latents = absorb
        cache, outputs = layer.init_cache(B, 8), []
        for t in range(T):
            output, cache = layer(X[:, t : t + 1], causal=True, cache=cache)
            outputs.append(output)
        _close(tf.concat(outputs, 1), full, OUTPUT_TOL)


def test_mla_weight_layout_config_and_keras_file_round_trip(tmp_path):
    layer = _mla_layer("mla_q_lora_gqa_yarn_bias")
    assert layer.weight_shapes() == {
        "query_a_kernel": (E, 7), "query_a_bias": (7,), "query_a_norm": (7,), "query_b_kernel": (7, N * 6),
        "query_b_bias": (N * 6,), "key_value_a_kernel": (E, 5 + 4), "key_value_a_bias": (9,),
        "key_value_a_norm": (5,), "key_value_b_kernel": (5, 2 * (2 + 5)), "key_value_b_bias": (14,),
        "output_kernel": (N * 5, E), "output_bias": (E,),
    }  # fmt: skip
    fresh = MultiHeadAttention(E, N, **MLA_VARIANTS["mla_q_lora_gqa_yarn_bias"])
    assert (fresh.export_weights()["query_a_norm"] == 1).all() and (
        fresh.export_weights()["key_value_a_norm"] == 1
    ).all()
    config = layer.get_config()
    assert config["vdim"] is None and config["head_dim"] == 6 and config["bias"] is True
    assert MultiHeadAttention.from_config(config).get_config() == config
    x_in = keras.Input((T, E))
    model = keras.Model(x_in, layer(x_in, causal=True))
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    _close(loaded(X), model(X), 0)
    assert loaded.layers[1].get_config() == config
    with pytest.raises(ValueError, match=r"^`to_keras` needs a layer .* or MLA\. Received: .*kv_lora_rank=5"):
        layer.to_keras()


MLA_ERRORS = {
    "q_lora_rank_alone": ({"q_lora_rank": 4}, r"^`q_lora_rank` needs `kv_lora_rank` \(multi-head latent attention\)\. Received: q_lora_rank=4, kv_lora_rank=None$"),
    "v_head_dim_alone": ({"v_head_dim": 4}, r"^`v_head_dim` needs `kv_lora_rank`"),
    "missing_sizes": ({"kv_lora_rank": 4, "qk_nope_head_dim": 2}, r"^`kv_lora_rank` needs `qk_nope_head_dim`, `qk_rope_head_dim` and `v_head_dim`\. Received: kv_lora_rank=4, qk_rope_head_dim=None, v_head_dim=None$"),
    "kv_lora_rank_zero": ({**MLA, "kv_lora_rank": 0}, r"^`kv_lora_rank` must be a positive integer\. Received: kv_lora_rank=0$"),
    "head_dim": ({**MLA, "head_dim": 4}, r"^`head_dim` must equal qk_nope_head_dim \+ qk_rope_head_dim = 6 with `kv_lora_rank`\. Received: head_dim=4$"),
    "vdim": ({**MLA, "vdim": 8}, r"^`vdim` is not supported with `kv_lora_rank`: .*Received: vdim=8$"),
    "qk_norm": ({**MLA, "qk_norm": "head"}, r"^`qk_norm` is not supported with `kv_lora_rank`: .*Received: qk_norm='head'$"),
    "clip_qkv": ({**MLA, "clip_qkv": 1.0}, r"^`clip_qkv` is not supported with `kv_lora_rank`"),
    "rope_fraction": ({**MLA, "rope_fraction": 0.5}, r"^`rope_fraction` is not supported with `kv_lora_rank`"),
    "rope_sections": ({**MLA, "rope_theta": 10.0, "rope_sections": (1,)}, r"^`rope_sections` is not supported with `kv_lora_rank`"),
    "rope_odd": ({**MLA, "qk_rope_head_dim": 3, "rope_theta": 10.0}, r"^`rope_fraction` must be in \(0, 1\] and rotate an even number .*head_dim=3$"),
    "latent_norm_eps": ({"latent_norm_eps": 0}, r"^`latent_norm_eps` must be a positive float\. Received: latent_norm_eps=0$"),
    "bias_key_with_mla": ({**MLA, "bias": ("key",)}, r"^`bias` must be True, False or a list, tuple or set of 'query', 'key_value_a', 'key_value_b', 'output', 'gate'\. Received: bias=\('key',\)$"),
    "bias_latent_without_mla": ({"bias": ("key_value_a",)}, r"^`bias` must be True, False or a list, tuple or set of 'query', 'key', 'value', 'output', 'gate'\."),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MLA_ERRORS))
def test_mla_constructor_errors(name):
    kwargs, pattern = MLA_ERRORS[name]
    with pytest.raises(ValueError, match=pattern):
        MultiHeadAttention(E, N, **kwargs)


def test_mla_call_errors_value_other_than_key_and_a_plain_cache():
    layer = MultiHeadAttention(E, N, **MLA)
    _close(layer(X, Y, Y), layer(X, Y), 0)  # value is key: accepted
    with pytest.raises(
        ValueError,
        match=r"`value` must be None or `key` itself with `kv_lora_rank`: MLA reads keys and values from `key`\. Received: a value other than key",
    ):
        layer(X, Y, tf.identity(Y))
    plain_cache = MultiHeadAttention(E, N).init_cache(B, 8)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "must have shape (B, 1, L, C) and (B, 1, L, Hr) with kv_lora_rank: B=2, C=6, Hr=2. Received: cache.key.shape=(2, 4, 8, 4)"
        ),
    ):
        layer(X[:, :1], cache=plain_cache)


@pytest.mark.parametrize("absorb", [False, True], ids=["expanded", "absorbed"])
@pytest.mark.parametrize("name", MLA_AGAINST_NUMPY)
def test_mla_matches_the_numpy_file_on_every_path(name, absorb):
    """Output and weights against the NumPy file, and the gradients of the query, the attention
    bias and every latent weight (norms and biases included) against its `backward`, on the
    eager, tf.function, XLA and memory-efficient paths (with and without XLA)."""
    layer = _mla_layer(name, absorb)
    twin = NumpyMultiHeadAttention(E, N, **MLA_VARIANTS[name])
    twin.import_weights(layer.export_weights())
    x64, g = X.astype(np.float64), rng.normal(size=(B, T, E))
    call = dict(key_mask=KEY_MASK, attention_bias=BIAS_FULL.astype(np.float64), causal=True)
    expected, expected_w = twin(x64, return_attention=True, **call)
    _, weights = layer(X, return_attention=True, **{**call, "attention_bias": BIAS_FULL})
    _close(weights, expected_w, WEIGHTS_TOL)
    grads = twin.backward(g)
    names = ["query", "attention_bias", *(v.name for v in layer.trainable_weights)]
    assert names[2:] == list(layer.weight_shapes())
    for path in NUMPY_PATHS:
        output, got = _tf_output_and_grads(layer, path, None, True, tf.constant(g, tf.float32))
        _close(output, expected, OUTPUT_TOL)
        for grad_name, grad in zip(names, got, strict=True):
            assert grad is not None, (path, grad_name)
            _close(grad, grads[grad_name], GRADS_TOL)


@pytest.mark.parametrize("name", ["mla_q_lora_gqa_yarn_bias", "mla_everything"])
def test_mla_int8_runs_as_the_numpy_int8_layer(name):
    """A TensorFlow int8 MLA layer (the latent projections quantized) imported into NumPy: the same
    layout, and NumPy's output on both paths, explicit and memory-efficient."""
    layer = _mla_layer(name)
    layer.quantize("int8")
    twin = NumpyMultiHeadAttention(E, N, **MLA_VARIANTS[name])
    twin.import_weights(layer.export_weights())
    assert twin.quantization_mode == "int8"
    expected = twin(X.astype(np.float64), causal=True)
    for absorb in (False, True):
        layer.absorb_latents = absorb
        for threshold in (1 << 26, 0):
            layer.memory_efficient_threshold = threshold
            _close(layer(X, causal=True), expected, 2e-3)
