"""The NumPy reference's variants (RoPE and multimodal RoPE, QK-norm of every kind, type and bias,
soft-capping, one- and two-sided windows, chunked attention, sinks, attention_bias, padding masks,
per-projection biases, ALiBi) against formulas written out here, independently of the layer's code;
the new variants' gradients against finite differences and their decoding against the full pass;
and the floating mask rule."""

import math

import numpy as np
import pytest

from NumPy import MultiHeadAttention
from NumPy.Multi_Head_Attention import (
    alibi_bias,
    apply_rope,
    dot_product_attention,
    rope_angles,
    rope_attention_factor,
    rope_frequencies,
)
from shared_tests.cases import CASES_BY_NAME, PROPORTIONAL_SCALING, make_data

FLOAT64_TOL = 1e-12  # two float64 formulations of the same sums
FD_STEP = 1e-6
FINITE_DIFFERENCE_TOL = 1e-7  # central differences of a float64 loss of order 1 at step 1e-6
B, T, E, N = 2, 5, 16, 4
H = E // N


def _x(seed=0, shape=(B, T, E)):
    return np.random.default_rng(seed).normal(size=shape)


def _heads(y, heads):
    """(B, L, heads*H) -> (B, heads, L, H)"""
    b, length, width = y.shape
    return y.reshape(b, length, heads, width // heads).transpose(0, 2, 1, 3)


def _scores(layer, x):
    """Scaled q . k of self-attention on x, computed from the exported weights, (B, N, T, T)."""
    w = layer.export_weights()
    q = _heads(x @ w["query_kernel"] + w["query_bias"], layer.num_heads)
    k = _heads(x @ w["key_kernel"] + w["key_bias"], layer.num_heads)
    return q @ k.swapaxes(-1, -2) * layer.scale


def _softmax(scores):
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_is_a_complex_rotation(interleaved):
    """Each feature pair, read as a complex number, is multiplied by exp(i * position * inv_freq)."""
    x = _x(shape=(B, N, T, 8))
    positions = np.arange(T)[None, :] + np.array([[0], [13]])  # (B, T)
    inv_freq = rope_frequencies(6, 10000.0)  # R = 6 of 8 features rotated
    pairs = (x[..., 0:6:2], x[..., 1:6:2]) if interleaved else (x[..., :3], x[..., 3:6])
    z = (pairs[0] + 1j * pairs[1]) * np.exp(1j * positions[:, None, :, None] * inv_freq)
    rotated = apply_rope(x, positions, inv_freq, interleaved)
    first, second = (rotated[..., 0:6:2], rotated[..., 1:6:2]) if interleaved else (rotated[..., :3], rotated[..., 3:6])
    np.testing.assert_allclose(first, z.real, atol=FLOAT64_TOL)
    np.testing.assert_allclose(second, z.imag, atol=FLOAT64_TOL)
    np.testing.assert_array_equal(rotated[..., 6:], x[..., 6:])  # the unrotated features pass unchanged


def test_rope_scores_depend_only_on_relative_positions():
    layer = MultiHeadAttention(E, N, rope_theta=10000.0, seed=0)
    x = _x()
    out = layer(x, causal=True, positions=np.arange(T))
    shifted = layer(x, causal=True, positions=np.arange(T) + 1000)
    np.testing.assert_allclose(out, shifted, atol=1e-9)  # cos/sin of angles near 1000 rad
    moved = layer(x, causal=True, positions=np.arange(T) * 2)
    assert np.abs(out - moved).max() > 1e-3  # other relative positions give other outputs


def test_rope_frequency_scaling_as_transformers_writes_it():
    base = rope_frequencies(8, 10000.0)
    np.testing.assert_allclose(base, 10000.0 ** (-np.arange(0, 8, 2) / 8), atol=FLOAT64_TOL)
    linear = rope_frequencies(8, 10000.0, {"rope_type": "linear", "factor": 4.0})
    np.testing.assert_allclose(linear, base / 4.0, atol=FLOAT64_TOL)
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
    llama3 = rope_frequencies(8, 10000.0, scaling)
    wavelength = 2 * math.pi / base  # (4,): 6.3, 63, 628, 6283
    bands = []
    for i, w in enumerate(wavelength):
        if w < 64 / 4.0:  # high frequency: unchanged
            bands.append("high")
            assert llama3[i] == base[i]
        elif w > 64 / 1.0:  # low frequency: divided by the factor
            bands.append("low")
            assert llama3[i] == pytest.approx(base[i] / 8.0, abs=FLOAT64_TOL)
        else:  # in between: a blend
            bands.append("medium")
            smooth = (64 / w - 1.0) / (4.0 - 1.0)
            assert llama3[i] == pytest.approx((1 - smooth) * base[i] / 8.0 + smooth * base[i], abs=FLOAT64_TOL)
    assert bands == ["high", "medium", "low", "low"]


@pytest.mark.parametrize(
    ("rotary", "fraction", "factor", "turned"), [(8, 0.5, 1.0, 2), (16, 0.25, 2.0, 2), (6, 0.5, 1.0, 1)]
)
def test_proportional_frequencies_leave_the_last_pairs_unturned(rotary, fraction, factor, turned):
    """transformers' `_compute_proportional_rope_parameters` written out: theta ** (-2i / R) for the
    first int(partial_rotary_factor * R // 2) pairs, 0 for the others, all over `factor`."""
    scaling = {"rope_type": "proportional", "partial_rotary_factor": fraction, "factor": factor}
    expected = np.zeros(rotary // 2)
    expected[:turned] = 1.0 / 100.0 ** (np.arange(0, 2 * turned, 2) / rotary) / factor
    np.testing.assert_allclose(rope_frequencies(rotary, 100.0, scaling), expected, rtol=FLOAT64_TOL, atol=0)
    plain = rope_frequencies(rotary, 100.0, {"rope_type": "proportional"})  # partial_rotary_factor 1: plain RoPE
    np.testing.assert_allclose(plain, rope_frequencies(rotary, 100.0), rtol=FLOAT64_TOL, atol=0)


@pytest.mark.parametrize("port", ["last_pairs_turned", "rotate_half_of_the_turned_pairs"])
def test_proportional_case_catches_a_port_that_turns_pairs_otherwise(port):
    """The parity case `rope_proportional_gqa` draws positions far enough apart that a port turning the
    last pairs (plain RoPE over the head, over `factor`), or one pairing only the first 2A features
    (i, i + A) as partial rotary does, leaves its output far outside the tolerance."""
    case = CASES_BY_NAME["rope_proportional_gqa"]
    data = make_data(case)
    factor = PROPORTIONAL_SCALING["factor"]
    wrong = {
        "last_pairs_turned": {"rope_scaling": {"rope_type": "linear", "factor": factor}},
        "rotate_half_of_the_turned_pairs": {
            "rope_fraction": 0.5,
            "rope_scaling": {"rope_type": "linear", "factor": factor},
        },
    }[port]
    outputs = []
    for config in (case.config, {**case.config, **wrong}):
        layer = MultiHeadAttention(**config)
        layer.import_weights(data["weights"])
        outputs.append(layer(data["query"].astype(np.float64), causal=True, positions=data["positions"]))
    assert np.abs(outputs[0] - outputs[1]).max() > 100 * case.tolerance["output"]


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_frequencies_ramp_between_the_correction_dims(truncate):
    """transformers' `_compute_yarn_parameters`: pair i keeps inv_freq below the correction dim of
    beta_fast rotations over the original context, takes inv_freq / factor above that of beta_slow,
    and a linear blend between (bounds floored and ceiled when `truncate`)."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "truncate": truncate}
    base = rope_frequencies(16, 10000.0)

    def correction_dim(rotations):  # the pair whose wavelength 2 pi / inv_freq fits `rotations` times in 4096
        return 16 * math.log(4096 / (rotations * 2 * math.pi)) / (2 * math.log(10000.0))

    low, high = correction_dim(32), correction_dim(1)  # 2.40 and 7.19
    low, high = (math.floor(low), math.ceil(high)) if truncate else (low, high)
    low, high = max(low, 0), min(high, 15)
    for i, (got, f) in enumerate(zip(rope_frequencies(16, 10000.0, scaling), base, strict=True)):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        assert got == pytest.approx(f / 4.0 * ramp + f * (1 - ramp), rel=FLOAT64_TOL)
    ramp_of = (rope_frequencies(16, 10000.0, scaling) - base) / (base / 4.0 - base)  # (8,), 0 kept, 1 divided
    assert ramp_of[0] == pytest.approx(0) and ramp_of[-1] == pytest.approx(1) and 0.1 < ramp_of[4] < 0.9


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, 0.1 * math.log(4.0) + 1),
        ({"attention_factor": 0.8}, 0.8),
        ({"mscale": 1.0, "mscale_all_dim": 0.5}, (0.1 * math.log(4.0) + 1) / (0.05 * math.log(4.0) + 1)),
        ({"mscale": 1.0}, 0.1 * math.log(4.0) + 1),  # mscale alone is not read
        ({"factor": 1.0}, 1.0),
    ],
)
def test_yarn_attention_factor(extra, expected):
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, **extra}
    assert rope_attention_factor(scaling) == pytest.approx(expected, rel=FLOAT64_TOL)
    assert rope_attention_factor({"rope_type": "linear", "factor": 4.0}) == 1.0


def _yarn_layer(attention_factor=None, seed=0):
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "truncate": False}
    scaling |= {} if attention_factor is None else {"attention_factor": attention_factor}
    return MultiHeadAttention(E, N, rope_theta=100.0, rope_fraction=0.5, rope_scaling=scaling, seed=seed)


def test_yarn_attention_factor_multiplies_the_rotated_features_of_q_and_k():
    """YaRN with attention factor f equals the same frequencies with factor 1 and the query and key
    kernels' rotated columns (the first R = 2 of each head's 4) times f: the factor scales exactly
    the rotated features of q and k, and it matters."""
    x, positions = _x(), np.arange(T) + np.array([[0], [7]])
    yarn, plain = _yarn_layer(), _yarn_layer(attention_factor=1.0)
    f = rope_attention_factor(yarn.rope_scaling)
    columns = np.tile(np.r_[np.full(2, f), np.ones(H - 2)], N)  # (N*H,)
    weights = yarn.export_weights()
    for kind in ("query", "key"):
        weights[f"{kind}_kernel"] = weights[f"{kind}_kernel"] * columns
        weights[f"{kind}_bias"] = weights[f"{kind}_bias"] * columns
    plain.import_weights(weights)
    expected = yarn(x, causal=True, positions=positions)
    np.testing.assert_allclose(plain(x, causal=True, positions=positions), expected, atol=FLOAT64_TOL)
    plain.import_weights(yarn.export_weights())
    assert np.abs(plain(x, causal=True, positions=positions) - expected).max() > 1e-3


def test_yarn_backward_matches_finite_differences():
    """The explicit backward carries YaRN's attention factor through q and k."""
    layer = _yarn_layer()
    x, positions, upstream = _x(1, (B, 3, E)), np.arange(3) + 5, _x(2, (B, 3, E))

    def loss():
        return float((layer(x, causal=True, positions=positions) * upstream).sum())

    loss()
    grads = layer.backward(upstream)
    for name, array in {"query": x, **layer.params}.items():
        numeric = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            old = array[index]
            array[index] = old + FD_STEP
            plus = loss()
            array[index] = old - FD_STEP
            numeric[index] = (plus - loss()) / (2 * FD_STEP)
            array[index] = old
        np.testing.assert_allclose(grads[name], numeric, atol=FINITE_DIFFERENCE_TOL, rtol=0, err_msg=name)


def test_softcap_caps_the_scaled_scores_before_the_softmax():
    layer = MultiHeadAttention(E, N, softcap=0.5, seed=0)
    x = _x() * 4
    _, weights = layer(x, return_attention=True)
    expected = _softmax(0.5 * np.tanh(_scores(layer, x) / 0.5))
    np.testing.assert_allclose(weights, expected, atol=FLOAT64_TOL)


def test_sinks_join_the_denominator_as_gpt_oss_computes_them():
    """gpt-oss: concatenate the sink logit to each row, softmax, drop the sink's column."""
    layer = MultiHeadAttention(E, N, sinks=True, seed=0)
    layer.import_weights({**layer.export_weights(), "sinks": np.array([0.5, -1.0, 2.0, 0.0])})
    x = _x()
    _, weights = layer(x, causal=True, return_attention=True)
    scores = np.where(np.tril(np.ones((T, T), bool)), _scores(layer, x), -np.inf)  # (B, N, T, T)
    sinks = np.broadcast_to(np.array([0.5, -1.0, 2.0, 0.0])[None, :, None, None], (B, N, T, 1))
    expected = _softmax(np.concatenate([scores, sinks], axis=-1))[..., :-1]
    np.testing.assert_allclose(weights, expected, atol=FLOAT64_TOL)
    assert (weights.sum(axis=-1) < 1).all()


def test_clip_qkv_clamps_the_projections_before_qk_norm_and_rope():
    """OLMo: q, k and v clamped right after their projections (bias included); QK-norm and RoPE
    then see the clamped values, and the output is the plain layer's on the clamped q, k, v."""
    c, x = 0.5, _x()
    layer = MultiHeadAttention(E, N, clip_qkv=c, qk_norm="all", rope_theta=10000.0, seed=0)
    w = layer.export_weights()
    clamped = {kind: np.clip(x @ w[f"{kind}_kernel"] + w[f"{kind}_bias"], -c, c) for kind in ("query", "key", "value")}
    assert all((np.abs(x @ w[f"{kind}_kernel"] + w[f"{kind}_bias"]) > c).mean() > 0.3 for kind in clamped)

    def normed(y, scale):
        return y / np.sqrt((y**2).mean(axis=-1, keepdims=True) + 1e-6) * scale

    q = _heads(normed(clamped["query"], w["query_norm"]), N)
    k = _heads(normed(clamped["key"], w["key_norm"]), N)
    inv_freq, positions = rope_frequencies(H, 10000.0), np.broadcast_to(np.arange(T), (B, T))
    q, k = apply_rope(q, positions, inv_freq, False), apply_rope(k, positions, inv_freq, False)
    weights = _softmax(np.where(np.tril(np.ones((T, T), bool)), q @ k.swapaxes(-1, -2) * layer.scale, -np.inf))
    context = (weights @ _heads(clamped["value"], N)).transpose(0, 2, 1, 3).reshape(B, T, E)
    expected = context @ w["output_kernel"] + w["output_bias"]
    np.testing.assert_allclose(layer(x, causal=True), expected, atol=FLOAT64_TOL)
    unclamped = MultiHeadAttention(E, N, qk_norm="all", rope_theta=10000.0, seed=0)
    assert np.abs(unclamped(x, causal=True) - expected).max() > 0.1


def test_clip_qkv_gradient_is_zero_outside_and_one_within_the_bounds():
    """The clamp's gradient in `backward`: with one token the weights are 1, so the output is
    clamp(v) @ output_kernel + output_bias and d value_bias = (upstream @ output_kernel^T) where
    |v| <= c (bounds included: features 0 and 1 sit exactly on c and -c), 0 outside.
    (test_reference.py checks the whole backward against finite differences.)"""
    c = 0.5
    layer = MultiHeadAttention(E, N, clip_qkv=c, seed=0)
    w = layer.export_weights()
    kernel, bias = w["value_kernel"].copy(), w["value_bias"].copy()
    kernel[:, :2], bias[:2] = 0.0, (c, -c)  # v[0] = c, v[1] = -c exactly
    layer.import_weights({**w, "value_kernel": kernel, "value_bias": bias})
    x, upstream = _x(1, (B, 1, E)) * 2, _x(2, (B, 1, E))
    layer(x)
    grads = layer.backward(upstream)
    v = x @ kernel + bias  # (B, 1, E)
    within = np.abs(v) <= c
    assert within[..., :2].all() and (~within).mean() > 0.3  # on the bounds, and most features clamped
    expected = ((upstream @ w["output_kernel"].T) * within).sum(axis=(0, 1))
    np.testing.assert_allclose(grads["value_bias"], expected, atol=FLOAT64_TOL)
    np.testing.assert_allclose(
        grads["value_kernel"], np.einsum("bld,blm->dm", x, (upstream @ w["output_kernel"].T) * within), atol=FLOAT64_TOL
    )
    assert (grads["value_kernel"][:, ~within.any(axis=(0, 1))] == 0).all()


def test_window_equals_a_band_mask():
    layer = MultiHeadAttention(E, N, window=2, seed=0)
    x = _x()
    band = np.tril(np.ones((T, T), bool)) & ~np.tril(np.ones((T, T), bool), -2)  # keys t - 1 and t
    windowed = layer(x, causal=True, return_attention=True)
    plain = MultiHeadAttention(E, N, seed=0)(x, attention_mask=band[None], return_attention=True)
    for got, expected in zip(windowed, plain, strict=True):
        np.testing.assert_allclose(got, expected, atol=FLOAT64_TOL)


@pytest.mark.parametrize("kind", ["head", "all"])
def test_qk_norm_is_rms_norm_of_the_projections(kind):
    layer = MultiHeadAttention(E, N, qk_norm=kind, qk_norm_eps=1e-5, seed=0)
    rng = np.random.default_rng(1)
    width = H if kind == "head" else E
    norms = {name: 1 + 0.1 * rng.normal(size=width) for name in ("query_norm", "key_norm")}
    layer.import_weights({**layer.export_weights(), **norms})
    w, x = layer.export_weights(), _x()

    def normed(y, scale):
        y = y.reshape(B, T, N, H) if kind == "head" else y
        return (y / np.sqrt((y**2).mean(axis=-1, keepdims=True) + 1e-5) * scale).reshape(B, T, E)

    q = _heads(normed(x @ w["query_kernel"] + w["query_bias"], norms["query_norm"]), N)
    k = _heads(normed(x @ w["key_kernel"] + w["key_bias"], norms["key_norm"]), N)
    _, weights = layer(x, return_attention=True)
    np.testing.assert_allclose(weights, _softmax(q @ k.swapaxes(-1, -2) / math.sqrt(H)), atol=FLOAT64_TOL)


def test_padding_masks_equal_their_attention_mask_forms():
    layer = MultiHeadAttention(E, N, seed=0)
    x, y = _x(), _x(1, (B, 7, E))
    keys = np.array([[True] * 5 + [False] * 2, [True] * 7])
    queries = np.array([[True] * 3 + [False] * 2, [True] * 5])
    got = layer(x, y, key_mask=keys, query_mask=queries, return_attention=True)
    expected = layer(x, y, attention_mask=keys[:, None, :] & queries[:, :, None], return_attention=True)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got[0][0, 3:], np.broadcast_to(layer.params["output_bias"], (2, E)))


def test_self_attention_key_mask_defaults_to_query_mask():
    layer = MultiHeadAttention(E, N, seed=0)
    x = _x()
    queries = np.array([[True] * 3 + [False] * 2, [True] * 5])
    got = layer(x, query_mask=queries, return_attention=True)
    expected = layer(x, key_mask=queries, query_mask=queries, return_attention=True)
    np.testing.assert_array_equal(got[1], expected[1])
    assert (got[1][0, :, :, 3:] == 0).all()


def test_attention_bias_adds_like_a_floating_mask():
    layer = MultiHeadAttention(E, N, seed=0)
    x, bias = _x(), _x(2, (1, N, T, T))
    got = layer(x, attention_bias=bias, return_attention=True)
    expected = layer(x, attention_mask=bias, return_attention=True)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, atol=FLOAT64_TOL)


def test_partial_biases_are_named_in_the_layout():
    layer = MultiHeadAttention(E, N, bias=["value", "query", "key"])
    assert layer.bias == ("query", "key", "value")
    assert [n for n in layer.weight_shapes() if n.endswith("_bias")] == ["query_bias", "key_bias", "value_bias"]
    assert list(MultiHeadAttention(E, N, qk_norm="all", sinks=True, bias=False).weight_shapes())[-3:] == [
        "query_norm", "key_norm", "sinks",
    ]  # fmt: skip


def test_alibi_slopes_are_blooms():
    """Bloom's build_alibi_tensor: 2 ** (-8 n / N) for N a power of two; for N = 6 the slopes of
    4 heads, then every other slope of 8 (2 ** -1, 2 ** -3)."""
    positions = np.arange(3)
    eight = alibi_bias(8, positions)
    assert eight.shape == (1, 8, 1, 3) and eight.dtype == np.float32
    np.testing.assert_allclose(eight[0, :, 0, 1], 2.0 ** -np.arange(1, 9))
    six = alibi_bias(6, np.stack([positions, positions + 1]))
    assert six.shape == (2, 6, 1, 3)
    np.testing.assert_allclose(six[0, :, 0, 1], [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    np.testing.assert_allclose(six[1, :, 0, 0], six[0, :, 0, 1])


@pytest.mark.parametrize(
    ("value", "dtype", "removes"),
    [
        (-np.inf, np.float64, True),
        (np.finfo(np.float32).min, np.float64, True),  # transformers' mask value, built in float64
        (-1e300, np.float64, True),  # finite, but below float32's range
        (np.finfo(np.float16).min, np.float16, True),  # what a converter puts for -inf in float16
        (-1e9, np.float32, False),  # a finite penalty
        (-60000.0, np.float16, False),
    ],
)
def test_floating_mask_rule(value, dtype, removes):
    """One row of a value: removed, that row keeps no key (output_bias); else an ordinary
    softmax of a constant shift (the unmasked weights)."""
    layer = MultiHeadAttention(E, N, seed=0)
    layer.import_weights({**layer.export_weights(), "output_bias": np.full(E, 0.5)})
    x = _x()
    mask = np.zeros((T, T), dtype)
    mask[2] = value
    mask[0, 0] = 0.5  # not a Keras 0/1 mask
    out, weights = layer(x, attention_mask=mask, return_attention=True)
    assert np.isfinite(out).all()
    if removes:
        np.testing.assert_array_equal(weights[:, :, 2], 0.0)
        np.testing.assert_array_equal(out[:, 2], 0.5)
    else:
        np.testing.assert_allclose(weights[:, :, 2], layer(x, return_attention=True)[1][:, :, 2], atol=1e-9)


@pytest.mark.parametrize("qk_norm", ["head", "all"])
@pytest.mark.parametrize(("t", "s"), [(0, 3), (3, 0), (0, 0)])
def test_d03_qk_norm_with_an_empty_sequence(qk_norm, t, s):
    """Regression D3: qk_norm="head" with T = 0 or S = 0 crashed in a reshape (-1 over no
    element); an empty sequence gives the empty result and gradients, as in the other files."""
    layer = MultiHeadAttention(E, N, qk_norm=qk_norm, seed=0)
    out, weights = layer(_x(0, (B, t, E)), key=_x(1, (B, s, E)), return_attention=True)
    assert out.shape == (B, t, E) and weights.shape == (B, N, t, s)
    grads = layer.backward(np.ones_like(out))
    assert grads["query"].shape == (B, t, E) and grads["key"].shape == (B, s, E)
    np.testing.assert_array_equal(grads["query_norm"], 0.0)


@pytest.mark.parametrize("penalty", [-1e9, -1e20, -1e30, np.nextafter(np.finfo(np.float32).min, 0.0)])
@pytest.mark.parametrize("sinks", [False, True])
def test_d11_a_row_of_one_finite_penalty_is_an_ordinary_softmax(penalty, sinks):
    """Regression D11: the reference added a float mask without taking each row's largest kept
    value off first (docs/SPEC.md "Numerics"), so a row whose kept keys all carry the same large
    finite penalty gave uniform weights (and -1e9 lost digits). Without sinks that row is now the
    unmasked softmax; with sinks the penalty is added as is (the row's level matters), so the
    sink takes nearly all the weight."""
    layer = MultiHeadAttention(E, N, sinks=sinks, seed=0)
    x = _x()
    mask = np.zeros((T, T))
    mask[2] = penalty
    mask[0, 0] = 0.5  # not a Keras 0/1 mask
    weights = layer(x, attention_mask=mask, return_attention=True)[1]
    plain = layer(x, return_attention=True)[1]
    if sinks:
        assert (weights[:, :, 2] < 1e-8).all()
    else:
        np.testing.assert_allclose(weights[:, :, 2], plain[:, :, 2], atol=FLOAT64_TOL)


# -------------------------------------------------------------------------------------------------
# Issue 28: two-sided windows, chunked attention, multimodal RoPE, LayerNorm / per-head / biased QK-norm
# -------------------------------------------------------------------------------------------------


def _loop_keep(t, s, rule):
    """(T, S) boolean mask written as a loop: rule(query position t + (S - T), key position s)."""
    keep = np.zeros((t, s), bool)
    for i in range(t):
        for j in range(s):
            keep[i, j] = rule(i + s - t, j)
    return keep


def _finite_differences(layer, call, upstream, arrays):
    """Checks layer.backward against central differences of sum(call() * upstream) for every
    array in `arrays` (perturbed in place)."""
    call()
    grads = layer.backward(upstream)
    for name, array in arrays.items():
        numeric = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            old = array[index]
            array[index] = old + FD_STEP
            plus = float((call() * upstream).sum())
            array[index] = old - FD_STEP
            numeric[index] = (plus - float((call() * upstream).sum())) / (2 * FD_STEP)
            array[index] = old
        np.testing.assert_allclose(grads[name], numeric, atol=FINITE_DIFFERENCE_TOL, rtol=0, err_msg=name)
    return grads


def _perturbed(layer, seed=3):
    """The layer with every weight moved off its initial value (norm scales off 1, biases off 0)."""
    rng = np.random.default_rng(seed)
    layer.import_weights({name: w + 0.3 * rng.normal(size=w.shape) for name, w in layer.export_weights().items()})
    return layer


def _decode(layer, x, chunks, length, positions=None, **call):
    """Decodes x (B, P, E) in chunks of the given sizes into a cache of `length` slots; returns
    the (B, P, E) outputs. `positions`, if given, (..., B, P) is sliced per chunk."""
    cache, outputs, start = layer.init_cache(x.shape[0], length), [], 0
    for size in chunks:
        given = {} if positions is None else {"positions": positions[..., start : start + size]}
        output, cache = layer(x[:, start : start + size], cache=cache, **given, **call)
        outputs.append(output)
        start += size
    return np.concatenate(outputs, axis=1)


@pytest.mark.parametrize("window", [(3, 2), [1, 1], (2, 4)])
@pytest.mark.parametrize("s", [T, 7])
def test_pair_window_equals_a_two_sided_band_written_as_a_loop(window, s):
    """Not causal, T == S and T < S: query t (at t' = t + S - T) keeps key s iff
    t' - W_before < s < t' + W_after; the layer holds the pair as a tuple of ints."""
    layer = MultiHeadAttention(E, N, window=window, seed=0)
    assert layer.window == tuple(window) and all(type(side) is int for side in layer.window)
    x, y = _x(), _x(1, (B, s, E))
    band = _loop_keep(T, s, lambda t, j: t - window[0] < j < t + window[1])
    got = layer(x, y, return_attention=True)
    expected = MultiHeadAttention(E, N, seed=0)(x, y, attention_mask=band, return_attention=True)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, atol=FLOAT64_TOL)
    assert (got[1][:, :, ~band] == 0).all() and (got[1][:, :, band] > 0).all()


def test_pair_window_reads_as_keras_and_modernbert_bands():
    """(W, W) keeps |t - s| < W (Keras' sliding_window); an int W is (W, no limit after); with
    causal the limit after the query changes nothing."""
    x = _x()
    weights = MultiHeadAttention(E, N, window=(2, 2), seed=0)(x, return_attention=True)[1]
    distance = np.abs(np.arange(T)[:, None] - np.arange(T)[None, :])  # (T, T)
    assert ((weights > 0) == (distance < 2)).all()
    one_sided = MultiHeadAttention(E, N, window=2, seed=0)(x, return_attention=True)
    wide = MultiHeadAttention(E, N, window=(2, 2 * T), seed=0)(x, return_attention=True)
    for a, b in zip(one_sided, wide, strict=True):
        np.testing.assert_array_equal(a, b)
    causal = MultiHeadAttention(E, N, window=(2, 1), seed=0)(x, causal=True, return_attention=True)
    for a, b in zip(
        causal, MultiHeadAttention(E, N, window=2, seed=0)(x, causal=True, return_attention=True), strict=True
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("size", "s"), [(2, T), (3, T), (2, 7), (T, T)])
def test_attention_chunk_equals_same_chunk_mask_written_as_a_loop(size, s, causal):
    """Query t (at t' = t + S - T) keeps key s iff s // C == t' // C (and s <= t' when causal)."""
    layer = MultiHeadAttention(E, N, attention_chunk_size=size, seed=0)
    x, y = _x(), _x(1, (B, s, E))
    chunk = _loop_keep(T, s, lambda t, j: j // size == t // size and (not causal or j <= t))
    got = layer(x, y, causal=causal, return_attention=True)
    expected = MultiHeadAttention(E, N, seed=0)(x, y, attention_mask=chunk, return_attention=True)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, atol=FLOAT64_TOL)


def test_attention_chunk_and_pair_window_in_dot_product_attention():
    """The pure function takes both, ANDed with keep and with each other."""
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(B, N, T, H)), rng.normal(size=(B, 2, 7, H)), rng.normal(size=(B, 2, 7, H))
    keep = rng.random((B, 1, T, 7)) < 0.8
    rule = _loop_keep(T, 7, lambda t, j: j // 3 == t // 3 and t - 4 < j < t + 2)
    got = dot_product_attention(q, k, v, keep, window=(4, 2), attention_chunk_size=3)
    expected = dot_product_attention(q, k, v, keep & rule)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


def _mrope_positions(seed=0):
    """(3, B, T) positions for sections (1, 2, 1) of H = 8 (4 pairs), each row its own."""
    return np.random.default_rng(seed).integers(0, 50, size=(3, B, T))


SECTION_ROWS = {False: [0, 1, 1, 2], True: [0, 1, 2, 0]}  # the row of each pair for sections (1, 2, 1): runs, dealt


@pytest.mark.parametrize("dealt", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_sections_turn_each_pair_by_its_sections_row(interleaved, dealt):
    """Pair i of section j, read as a complex number, is multiplied by exp(i * positions[j] * inv_freq[i]); with
    `rope_sections_interleaved` the pairs are dealt to the rows in turn (pair i by row i % 3 while
    i < 3 * sections[i % 3], else row 0)."""
    positions = _mrope_positions()
    layer = MultiHeadAttention(
        E, N, head_dim=8, rope_theta=100.0, rope_sections=[1, 2, 1], rope_interleaved=interleaved, seed=0,
        rope_sections_interleaved=dealt,
    )  # fmt: skip
    assert layer.rope_sections == (1, 2, 1) and layer.rope_sections_interleaved is dealt
    w, x = layer.export_weights(), _x()
    inv_freq = rope_frequencies(8, 100.0)  # (4,)
    row = np.array(SECTION_ROWS[dealt])  # the row of each pair
    angles = positions[row].transpose(1, 2, 0) * inv_freq  # (B, T, 4): pair i by positions[row[i]]

    def turned(y):
        y = _heads(y, N)  # (B, N, T, 8)
        first, second = (y[..., 0::2], y[..., 1::2]) if interleaved else (y[..., :4], y[..., 4:])
        z = (first + 1j * second) * np.exp(1j * angles[:, None])
        out = np.empty_like(y)
        if interleaved:
            out[..., 0::2], out[..., 1::2] = z.real, z.imag
        else:
            out[..., :4], out[..., 4:] = z.real, z.imag
        return out

    q = turned(x @ w["query_kernel"] + w["query_bias"])
    k = turned(x @ w["key_kernel"] + w["key_bias"])
    _, weights = layer(x, positions=positions, return_attention=True)
    np.testing.assert_allclose(weights, _softmax(q @ k.swapaxes(-1, -2) / math.sqrt(8)), atol=FLOAT64_TOL)


@pytest.mark.parametrize("sections", [(2, 1, 1), (4, 2, 2), (24, 20, 20)])
def test_interleaved_rope_sections_are_qwen3_vls_frequencies(sections):
    """`rope_sections_interleaved`'s angles are those of Qwen3-VL's `recomposition_frequencies` (transformers
    5.23, transcribed): row 0's, overwritten by row d's at pairs d, d + 3, ... below 3 * sections[d], d = 1, 2."""
    positions = np.random.default_rng(0).integers(0, 50, size=(3, B, T))
    inv_freq = rope_frequencies(2 * sum(sections), 100.0)  # (R/2,)
    freq = positions[..., None] * inv_freq  # (3, B, T, R/2)
    expected = freq[0].copy()
    for d in (1, 2):
        expected[..., d : 3 * sections[d] : 3] = freq[d, ..., d : 3 * sections[d] : 3]
    np.testing.assert_array_equal(rope_angles(positions, inv_freq, sections, True), expected)
    assert not np.array_equal(rope_angles(positions, inv_freq, sections), expected)  # the runs differ


def test_interleaved_sections_gradients_match_finite_differences():
    """The backward turns each pair back by the row that turned it: sections (2, 1, 1) dealt in turn give rows
    0, 1, 2, 0 to the 4 pairs, where the runs give 0, 0, 1, 2."""
    layer = MultiHeadAttention(
        8, 2, head_dim=8, rope_theta=100.0, rope_sections=(2, 1, 1), rope_sections_interleaved=True, seed=0
    )
    layer, x, upstream = _perturbed(layer), _x(1, (B, 4, 8)), _x(2, (B, 4, 8))
    positions = np.random.default_rng(4).integers(0, 30, size=(3, B, 4))
    grads = _finite_differences(
        layer, lambda: layer(x, positions=positions, causal=True), upstream, {"query": x, **layer.params}
    )
    assert grads.keys() == {"query", *layer.params}


def test_rope_sections_with_one_row_everywhere_are_plain_rope():
    """(B, T), (T,) and (k, B, T) positions repeating one row give plain RoPE (YaRN's factor too)."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    plain = MultiHeadAttention(E, N, head_dim=8, rope_theta=100.0, rope_scaling=scaling, seed=0)
    sectioned = MultiHeadAttention(
        E, N, head_dim=8, rope_theta=100.0, rope_scaling=scaling, rope_sections=(1, 2, 1), seed=0
    )
    x, positions = _x(), np.arange(T) + np.array([[3], [11]])  # (B, T)
    expected = plain(x, positions=positions, causal=True)
    for given in (positions, np.broadcast_to(positions, (3, B, T)).copy()):
        np.testing.assert_allclose(sectioned(x, positions=given, causal=True), expected, atol=FLOAT64_TOL)
    np.testing.assert_allclose(sectioned(x, positions=np.arange(T)), plain(x), atol=FLOAT64_TOL)
    np.testing.assert_allclose(sectioned(x), plain(x), atol=FLOAT64_TOL)  # default arange(T) in every section
    other = np.stack([positions, positions, 2 * positions])  # (3, B, T), the last section at other distances
    assert np.abs(sectioned(x, positions=other, causal=True) - expected).max() > 1e-3


def test_rope_sections_positions_shape_error():
    layer = MultiHeadAttention(E, N, head_dim=8, rope_theta=100.0, rope_sections=(1, 2, 1), seed=0)
    with pytest.raises(
        ValueError,
        match=r"^`positions` must be an integer tensor of shape \(B, T\), \(T,\) or \(3, B, T\) with B=2, T=5 \(one row per section of `rope_sections`\)\. Received: positions\.shape=\(2, 2, 5\), positions\.dtype=int64$",
    ):
        layer(_x(), positions=np.zeros((2, B, T), np.int64))
    assert MultiHeadAttention(E, N, rope_sections=(5, 7)).rope_sections == (5, 7)  # without RoPE only type-checked


def _qk_normed(y, kind, norm_type, scale, bias, eps, heads):
    """QK-norm written out: y (B, L, heads*H) normalized per head or over all, times scale, plus bias."""
    by = y.reshape(*y.shape[:2], heads, -1) if kind in ("head", "per_head") else y  # (B, L, heads, H)
    scale = scale.reshape(heads, -1) if kind == "per_head" else scale
    bias = bias.reshape(heads, -1) if kind == "per_head" and bias is not None else bias
    centred = by - by.mean(axis=-1, keepdims=True) if norm_type == "layer" else by
    out = centred / np.sqrt((centred**2).mean(axis=-1, keepdims=True) + eps) * scale
    out = out if bias is None else out + bias
    return out.reshape(y.shape)


@pytest.mark.parametrize("kind", ["head", "per_head", "all"])
@pytest.mark.parametrize("norm_type", ["rms", "layer"])
@pytest.mark.parametrize("norm_bias", [False, True])
def test_qk_norm_kinds_types_and_biases_against_the_formula(kind, norm_type, norm_bias):
    layer = MultiHeadAttention(
        E, N, num_kv_heads=2, qk_norm=kind, qk_norm_type=np.str_(norm_type), qk_norm_bias=norm_bias,
        qk_norm_eps=1e-5, seed=0,
    )  # fmt: skip
    assert type(layer.qk_norm_type) is str
    width = {"head": (H, H), "per_head": (E, 2 * H), "all": (E, 2 * H)}[kind]
    names = ["query_norm", "key_norm"] + (["query_norm_bias", "key_norm_bias"] if norm_bias else [])
    assert [n for n in layer.weight_shapes() if "norm" in n] == names
    expected = {"query_norm": (width[0],), "key_norm": (width[1],)}
    expected |= {"query_norm_bias": (width[0],), "key_norm_bias": (width[1],)} if norm_bias else {}
    assert {n: layer.weight_shapes()[n] for n in names} == expected
    for name in names:  # initialisation: scales ones, biases zeros
        np.testing.assert_array_equal(layer.params[name], 0.0 if name.endswith("_bias") else 1.0)
    layer = _perturbed(layer)
    w, x = layer.export_weights(), _x()
    q = _qk_normed(
        x @ w["query_kernel"] + w["query_bias"], kind, norm_type, w["query_norm"], w.get("query_norm_bias"), 1e-5, N
    )
    k = _qk_normed(x @ w["key_kernel"] + w["key_bias"], kind, norm_type, w["key_norm"], w.get("key_norm_bias"), 1e-5, 2)
    q, k = _heads(q, N), np.repeat(_heads(k, 2), 2, axis=1)  # (B, N, T, H) each
    _, weights = layer(x, return_attention=True)
    np.testing.assert_allclose(weights, _softmax(q @ k.swapaxes(-1, -2) / math.sqrt(H)), atol=FLOAT64_TOL)


def test_per_head_qk_norm_with_equal_rows_is_head_qk_norm():
    """per_head scales (N*H,) that repeat one (H,) row equal "head" with that row."""
    head = _perturbed(MultiHeadAttention(E, N, qk_norm="head", qk_norm_type="layer", qk_norm_bias=True, seed=0))
    per_head = MultiHeadAttention(E, N, qk_norm="per_head", qk_norm_type="layer", qk_norm_bias=True, seed=0)
    w = head.export_weights()
    per_head.import_weights({name: np.tile(a, N) if "_norm" in name else a for name, a in w.items()})
    x = _x()
    np.testing.assert_allclose(per_head(x, causal=True), head(x, causal=True), atol=FLOAT64_TOL)


def test_norm_biases_sit_before_sinks_in_the_layout():
    layer = MultiHeadAttention(E, N, qk_norm="per_head", qk_norm_bias=True, sinks=True, bias=False)
    assert list(layer.weight_shapes())[-5:] == ["query_norm", "key_norm", "query_norm_bias", "key_norm_bias", "sinks"]
    assert "query_norm_bias" not in MultiHeadAttention(E, N, qk_norm_bias=True).weight_shapes()  # needs qk_norm


FD_VARIANTS = {
    "per_head_rms": ({"qk_norm": "per_head"}, {}),
    "per_head_layer_bias": ({"qk_norm": "per_head", "qk_norm_type": "layer", "qk_norm_bias": True}, {}),
    "head_layer_bias_phi": ({"qk_norm": "head", "qk_norm_type": "layer", "qk_norm_bias": True}, {"causal": True}),
    "all_layer_bias_clip": (
        {"qk_norm": "all", "qk_norm_type": "layer", "qk_norm_bias": True, "clip_qkv": 0.8},
        {"causal": True},
    ),
    "all_rms_bias": ({"qk_norm": "all", "qk_norm_bias": True}, {}),
    "mrope": ({"rope_theta": 100.0, "rope_sections": (1, 1)}, {"causal": True, "positions": "sections"}),
    "mrope_interleaved_partial_yarn_layer_norm": (
        {
            "rope_theta": 100.0,
            "rope_fraction": 0.5,
            "rope_sections": (1,),
            "rope_interleaved": True,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
            "qk_norm": "per_head",
            "qk_norm_type": "layer",
            "qk_norm_bias": True,
        },
        {"positions": "sections"},
    ),
    "pair_window": ({"window": (2, 2)}, {}),
    "chunk": ({"attention_chunk_size": 2}, {"causal": True}),
    "chunk_pair_window_sinks": ({"attention_chunk_size": 3, "window": (2, 1), "sinks": True}, {}),
    "gate": ({"gate": True}, {"causal": True}),
    "gate_partial_bias_sinks_rope_qk_norm": (
        {"gate": True, "bias": ("query", "gate"), "sinks": True, "rope_theta": 100.0, "qk_norm": "head"},
        {},
    ),
}


@pytest.mark.parametrize("name", FD_VARIANTS)
def test_new_variant_gradients_match_finite_differences(name):
    """Every weight's and the input's gradient, with the new weights (norm scales per head, norm
    biases) moved off their initial values; 2 of 4 query heads per kv head."""
    config, call = FD_VARIANTS[name]
    layer = _perturbed(MultiHeadAttention(8, 4, num_kv_heads=2, head_dim=4, seed=0, **config))
    x, upstream = _x(1, (B, 4, 8)), _x(2, (B, 4, 8))
    if call.get("positions") == "sections":
        k = len(config["rope_sections"])
        call = {**call, "positions": np.random.default_rng(4).integers(0, 30, size=(k, B, 4))}
    grads = _finite_differences(layer, lambda: layer(x, **call), upstream, {"query": x, **layer.params})
    assert grads.keys() == {"query", *layer.params}


def test_gate_gradients_in_cross_attention_match_finite_differences():
    """The query's gradient through the gate alone (key and value are other tensors), with a row
    of no key (its gated result 0), a gate without a bias and GQA."""
    layer = _perturbed(MultiHeadAttention(8, 4, num_kv_heads=2, head_dim=4, gate=True, bias=("value",), seed=0))
    x, y, upstream = _x(1, (B, 4, 8)), _x(2, (B, 6, 8)), _x(3, (B, 4, 8))
    keep = np.ones((B, 4, 6), bool)
    keep[0, 1] = False
    grads = _finite_differences(
        layer, lambda: layer(x, y, attention_mask=keep), upstream, {"query": x, "key": y, **layer.params}
    )
    assert grads.keys() == {"query", "key", *layer.params}


def test_gate_multiplies_each_head_by_the_sigmoid_of_a_query_projection():
    """Keras' use_gate written out: sigmoid(query @ gate_kernel + gate_bias) split into heads,
    times each head's attention result, before the output projection; a row with no key gives
    output_bias."""
    gated = _perturbed(MultiHeadAttention(E, N, gate=True, seed=0))
    weights = gated.export_weights()
    plain = MultiHeadAttention(E, N, seed=0)
    plain.import_weights({name: w for name, w in weights.items() if not name.startswith("gate_")})
    x, keep = _x(7), np.ones((B, T, T), bool)
    keep[1, 2] = False
    _, probs = plain(x, attention_mask=keep, return_attention=True)
    v = _heads(x @ weights["value_kernel"] + weights["value_bias"], N)  # (B, N, T, H)
    gate = 1.0 / (1.0 + np.exp(-(x @ weights["gate_kernel"] + weights["gate_bias"])))  # (B, T, N*H)
    merged = (probs @ v).transpose(0, 2, 1, 3).reshape(B, T, E) * gate  # (B, T, N*H)
    expected = merged @ weights["output_kernel"] + weights["output_bias"]
    np.testing.assert_allclose(gated(x, attention_mask=keep), expected, atol=FLOAT64_TOL)
    np.testing.assert_allclose(gated(x, attention_mask=keep)[1, 2], weights["output_bias"], atol=FLOAT64_TOL)


def test_gate_layout_bias_names_and_int8():
    """`gate_kernel` (E, N*H) and `gate_bias` only with `gate`; True names the gate only on a gated
    layer; int8 quantizes the gate's kernel too."""
    assert MultiHeadAttention(E, N).bias == ("query", "key", "value", "output")
    layer = MultiHeadAttention(E, N, head_dim=3, gate=True, seed=0)
    assert layer.bias == ("query", "key", "value", "output", "gate")
    assert layer.weight_shapes()["gate_kernel"] == (E, N * 3)
    assert layer.weight_shapes()["gate_bias"] == (N * 3,)
    assert "gate_bias" not in MultiHeadAttention(E, N, gate=True, bias=("query",)).weight_shapes()
    assert "gate_kernel" not in MultiHeadAttention(E, N, bias=("gate",)).weight_shapes()
    layer.quantize("int8")
    assert layer.params["gate_kernel"].dtype == np.int8
    assert layer.params["gate_kernel_scale"].shape == (N * 3,)


DECODE_VARIANTS = [
    ({"window": (3, 2)}, 8),  # with causal the limit after the query changes nothing
    ({"attention_chunk_size": 3}, 8),  # the chunk does not make the cache roll
    ({"attention_chunk_size": 3, "window": (2, 5)}, 8),
    ({"gate": True, "window": 3}, 8),  # the gate reads only the new queries
]


@pytest.mark.parametrize(
    ("config", "length", "chunks"),
    [(config, length, chunks) for config, length in DECODE_VARIANTS for chunks in ([1] * 8, [3, 1, 1, 1, 1, 1], [4, 4])]
    + [
        ({"window": (3, 2)}, 3, [1] * 8),  # a rolling cache of W_before slots
        ({"window": (3, 2)}, 5, [3, 1, 1, 1, 1, 1]),  # rolling, a prefill then steps that wrap
        ({"window": (3, 2), "attention_chunk_size": 2}, 6, [4, 4]),  # a wrapping call of T = L - W_before + 1
    ],
)
def test_decoding_with_window_pairs_and_chunks_equals_the_full_causal_pass(config, length, chunks):
    layer = MultiHeadAttention(E, N, num_kv_heads=2, rope_theta=100.0, seed=0, **config)
    x = _x(5, (B, 8, E))
    expected = layer(x, causal=True)
    np.testing.assert_allclose(_decode(layer, x, chunks, length, causal=True), expected, atol=FLOAT64_TOL)


@pytest.mark.parametrize(
    "config", [{"window": (2, 3)}, {"attention_chunk_size": 3}, {"window": (4, 2), "attention_chunk_size": 4}]
)
def test_non_causal_cache_call_equals_a_full_pass_of_its_queries(config):
    """Without causal, a second call's queries sit at positions index + t over the P written keys,
    as a full pass of those T queries over the P keys (T < S, bottom-right aligned); a prefill
    into a longer cache equals the full pass, its weights padded with zeros."""
    layer = MultiHeadAttention(E, N, seed=0, **config)
    x = _x(6, (B, 8, E))
    cache = layer.init_cache(B, 10)
    first, first_weights, cache = layer(x[:, :5], cache=cache, return_attention=True)
    second, second_weights, cache = layer(x[:, 5:], cache=cache, return_attention=True)
    expected, expected_weights = layer(x[:, :5], return_attention=True)
    np.testing.assert_allclose(first, expected, atol=FLOAT64_TOL)
    np.testing.assert_allclose(first_weights[..., :5], expected_weights, atol=FLOAT64_TOL)
    assert (first_weights[..., 5:] == 0).all()
    expected, expected_weights = layer(x[:, 5:], x, return_attention=True)
    np.testing.assert_allclose(second, expected, atol=FLOAT64_TOL)
    np.testing.assert_allclose(second_weights[..., :8], expected_weights, atol=FLOAT64_TOL)


def test_rolling_cache_rolls_by_the_window_before():
    layer = MultiHeadAttention(E, N, window=(4, 2))
    cache = layer.init_cache(B, 5)
    _, cache = layer(_x(0, (B, 3, E)), cache=cache)
    with pytest.raises(ValueError, match=r"Received: window=4, T=3, L=5$"):
        layer(_x(0, (B, 3, E)), cache=cache)


@pytest.mark.parametrize("given", [True, False])
def test_mrope_decoding_with_k_b_1_positions_equals_the_full_pass(given):
    """Steps pass their (3, B, 1) positions (or none: index + arange(T) in every section)."""
    layer = _perturbed(
        MultiHeadAttention(
            E,
            N,
            head_dim=8,
            rope_theta=100.0,
            rope_sections=(1, 2, 1),
            qk_norm="per_head",
            qk_norm_type="layer",
            qk_norm_bias=True,
            seed=0,
        )
    )
    x = _x(7, (B, T, E))
    positions = _mrope_positions() if given else np.broadcast_to(np.arange(T), (3, B, T))
    expected = layer(x, positions=positions, causal=True)
    got = _decode(layer, x, [2, 1, 1, 1], 6, positions=positions if given else None, causal=True)
    np.testing.assert_allclose(got, expected, atol=FLOAT64_TOL)


# Multi-head latent attention (MLA): E = 8, N = 4, C = 4, Hn = 2, Hr = 2, Hv = 3 unless a case says
MLA = {"kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 3}


def _rms(x, scale, eps=1e-6):
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps) * scale


def _turn_half(x, positions, theta):
    """Llama's RoPE of all features of x (..., T, R) at (T,) positions, written out."""
    r = x.shape[-1]
    angles = positions[:, None] * theta ** (-np.arange(0, r, 2) / r)  # (T, R/2)
    x1, x2 = x[..., : r // 2], x[..., r // 2 :]
    return np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles), x2 * np.cos(angles) + x1 * np.sin(angles)], -1)


@pytest.mark.parametrize("q_lora_rank", [None, 3])
@pytest.mark.parametrize("rope", [False, True])
def test_mla_against_deepseeks_formula_written_per_head(q_lora_rank, rope):
    """DeepSeek-V3's attention written out one query head at a time from the exported weights:
    q through its LoRA, the latent and k_rope from key_value_a, k_nope and v from key_value_b, 2
    query heads per key/value head, k_rope shared; causal, with every bias."""
    config = {**MLA, "q_lora_rank": q_lora_rank, "rope_theta": 100.0 if rope else None}
    layer = _perturbed(MultiHeadAttention(8, 4, num_kv_heads=2, seed=0, **config))
    x = _x(1, (B, 5, 8))
    w = layer.export_weights()
    if q_lora_rank is None:
        q = x @ w["query_kernel"] + w["query_bias"]  # (B, T, N*H)
    else:
        q = (
            _rms(x @ w["query_a_kernel"] + w["query_a_bias"], w["query_a_norm"]) @ w["query_b_kernel"]
            + w["query_b_bias"]
        )
    a = x @ w["key_value_a_kernel"] + w["key_value_a_bias"]  # (B, S, C + Hr)
    latent, k_rope = _rms(a[..., :4], w["key_value_a_norm"]), a[..., 4:]
    kv = latent @ w["key_value_b_kernel"] + w["key_value_b_bias"]  # (B, S, K*(Hn + Hv))
    positions, heads = np.arange(5), []
    k_rope = _turn_half(k_rope, positions, 100.0) if rope else k_rope
    for n in range(4):
        q_n = q[..., n * 4 : (n + 1) * 4]  # (B, T, H)
        q_n = np.concatenate([q_n[..., :2], _turn_half(q_n[..., 2:], positions, 100.0) if rope else q_n[..., 2:]], -1)
        kv_g = kv[..., (n // 2) * 5 : (n // 2 + 1) * 5]  # (B, S, Hn + Hv)
        k_n = np.concatenate([kv_g[..., :2], k_rope], -1)  # (B, S, H)
        scores = q_n @ k_n.swapaxes(-1, -2) / math.sqrt(4) + np.where(np.tril(np.ones((5, 5))) > 0, 0.0, -np.inf)
        heads.append(_softmax(scores) @ kv_g[..., 2:])  # (B, T, Hv)
    expected = np.concatenate(heads, -1) @ w["output_kernel"] + w["output_bias"]
    for absorb in (False, True):
        layer.absorb_latents = absorb
        np.testing.assert_allclose(layer(x, causal=True), expected, atol=FLOAT64_TOL)


MLA_FD_VARIANTS = {
    "plain": ({}, {}, False),
    "q_lora_rope_sinks_softcap": (
        {"q_lora_rank": 3, "rope_theta": 100.0, "sinks": True, "softcap": 2.0, "num_kv_heads": 2},
        {"causal": True},
        False,
    ),
    "interleaved_yarn_window_mqa": (
        {
            "rope_theta": 100.0,
            "rope_interleaved": True,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2},
            "window": 2,
            "num_kv_heads": 1,
        },
        {},
        False,
    ),
    "cross_attention_absorbed": ({"q_lora_rank": 3, "kdim": 6, "bias": ("query_b", "key_value_a")}, {}, True),
}


@pytest.mark.parametrize("name", MLA_FD_VARIANTS)
def test_mla_gradients_match_finite_differences(name):
    """Every latent weight's (query_a/b, key_value_a/b kernels, biases and norms) and the inputs'
    gradients; the cross-attention case (key from another sequence, of width 6) after a call on
    the absorbed path, whose backward is the expanded one's."""
    config, call, cross = MLA_FD_VARIANTS[name]
    layer = _perturbed(MultiHeadAttention(8, 4, seed=0, **MLA, **config))
    layer.absorb_latents = cross
    x, upstream = _x(1, (B, 4, 8)), _x(2, (B, 4, 8))
    arrays = {"query": x, **layer.params}
    if cross:
        key = _x(3, (B, 3, 6))
        grads = _finite_differences(layer, lambda: layer(x, key, **call), upstream, {**arrays, "key": key})
        assert grads.keys() == {"query", "key", *layer.params}
    else:
        grads = _finite_differences(layer, lambda: layer(x, **call), upstream, arrays)
        assert grads.keys() == {"query", *layer.params}


@pytest.mark.parametrize("absorb", [None, False, True])
@pytest.mark.parametrize(
    ("config", "length", "chunks"),
    [
        ({"rope_theta": 100.0, "q_lora_rank": 3}, 8, [3, 1, 1, 1, 1, 1]),
        ({"rope_theta": 100.0, "num_kv_heads": 2, "window": 3}, 3, [1] * 8),  # a rolling cache of W slots
        ({"window": (3, 2), "attention_chunk_size": 2, "sinks": True}, 6, [4, 4]),
    ],
)
def test_mla_decoding_equals_the_full_causal_pass(absorb, config, length, chunks):
    """The latent cache (B, 1, L, C) and (B, 1, L, Hr), left padding in its keep, every path."""
    layer = _perturbed(MultiHeadAttention(8, 4, seed=0, **MLA, **config))
    layer.absorb_latents = absorb
    x = _x(5, (B, 8, 8))
    keep = np.ones((B, 8), bool)
    keep[1, :2] = False  # the second sequence is left-padded by 2
    expected = layer(x, causal=True, key_mask=keep)
    cache, outputs, start = layer.init_cache(B, length, keep=keep[:, :length]), [], 0
    assert (cache.key.shape, cache.value.shape) == ((B, 1, length, 4), (B, 1, length, 2))
    for size in chunks:
        output, cache = layer(
            x[:, start : start + size], cache=cache, causal=True, key_mask=keep[:, start : start + size]
        )
        outputs.append(output)
        start += size
    got = np.concatenate(outputs, axis=1)
    np.testing.assert_allclose(got[1, 2:], expected[1, 2:], atol=FLOAT64_TOL)
    np.testing.assert_allclose(got[0], expected[0], atol=FLOAT64_TOL)


LEARNED = {"type": "learned"}  # Mistral Large 4's per-head log-position query scaling
LEARNED_INDEXER = dict(  # MLA with the indexer, its query input LayerNorm and (with LEARNED) its scaling
    kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=5, rope_theta=10000.0, rope_interleaved=True,
    index_topk=3, index_num_heads=3, index_head_dim=6, index_rope_interleaved=True, index_query_input_norm=True,
)  # fmt: skip


@pytest.mark.parametrize("options", [{"rope_theta": 100.0}, {}, LEARNED_INDEXER], ids=["rope", "nope", "indexer"])
def test_learned_query_scaling_backward_matches_finite_differences(options):
    """The learned factors' (N,) weights and the query get their gradients at shifted positions (at i + t
    without RoPE); the indexer's weights get zeros (its selection is a mask)."""
    layer = _perturbed(MultiHeadAttention(E, N, query_scaling=LEARNED, seed=0, **options))
    x, upstream = _x(1), _x(2)
    call = {"positions": np.arange(T) + np.array([[0], [4]])} if "rope_theta" in options else {}
    names = ("query_scaling_scale", "query_scaling_bias", "query_kernel")
    grads = _finite_differences(
        layer, lambda: layer(x, causal=True, **call), upstream, {"query": x} | {n: layer.params[n] for n in names}
    )
    assert all(not grads[name].any() for name in grads if name.startswith("index_"))
    assert np.abs(grads["query_scaling_scale"]).min() > 0 and np.abs(grads["query_scaling_bias"]).min() > 0


def test_learned_query_scaling_starts_at_a_factor_of_one():
    """Initial scales 0 and biases 1 (transformers' too): the layer computes what it computes without it."""
    scaled = MultiHeadAttention(E, N, query_scaling=LEARNED, seed=0, **LEARNED_INDEXER)
    plain = MultiHeadAttention(E, N, seed=0, **{**LEARNED_INDEXER})
    weights = scaled.export_weights()
    assert not weights["query_scaling_scale"].any() and (weights["query_scaling_bias"] == 1).all()
    plain.import_weights({name: w for name, w in weights.items() if "scaling" not in name})
    x = _x(1)
    np.testing.assert_allclose(scaled(x, causal=True), plain(x, causal=True), atol=FLOAT64_TOL)
    weights["query_scaling_bias"] = weights["query_scaling_bias"] * 2.0
    scaled.import_weights(weights)
    assert np.abs(scaled(x, causal=True) - plain(x, causal=True)).max() > 1e-3


def test_learned_index_scaling_and_query_norm_change_the_selection():
    """The indexer's own learned factors and its query input LayerNorm take part in the ranking."""
    layer = _perturbed(MultiHeadAttention(E, N, query_scaling=LEARNED, seed=0, **LEARNED_INDEXER))
    x, weights = _x(1, (B, 12, E)), layer.export_weights()
    selection = layer(x, causal=True, return_topk=True)[1]
    for name in ("index_query_scaling_scale", "index_query_norm", "index_query_norm_bias"):
        moved = dict(weights, **{name: -3.0 * weights[name]})
        layer.import_weights(moved)
        assert not np.array_equal(layer(x, causal=True, return_topk=True)[1], selection), name
    layer.import_weights(weights)
