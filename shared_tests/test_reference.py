"""The NumPy float64 reference against an independent formulation, finite differences and
equivalences; its errors; its weight import."""

import math

import numpy as np
import pytest

from NumPy import MultiHeadAttention
from shared_tests.call_args import call_inputs
from shared_tests.cases import CASES, make_data

FLOAT64_FORWARD_TOL = 1e-12  # two float64 formulations of the same sums
FINITE_DIFFERENCE_TOL = 1e-6  # central differences with step 1e-6 on float64
FD_STEP = 1e-6

FLOAT32_CASES = [case for case in CASES if case.dtype == "float32"]
# The loops below know masks and biases; the variants and the other call arguments have their own
# independent formulas in test_reference_variants.py.
LOOP_CASES = [
    case for case in FLOAT32_CASES
    if not case.variants and not (case.key_mask or case.query_mask) and case.attention_bias == case.positions == "none"
]  # fmt: skip


def _layer(case, data):
    layer = MultiHeadAttention(**case.config)
    layer.import_weights(data["weights"])
    return layer


def _args(data):
    return [x.astype(np.float64) for x in (data["query"], data["key"], data["value"]) if x is not None]


def loop_attention(case, data):
    """Plain Python loops over batch, head, query and key: the second, independent formulation."""
    w = {name: value.astype(np.float64) for name, value in data["weights"].items()}
    query = data["query"].astype(np.float64)
    key = query if data["key"] is None else data["key"].astype(np.float64)
    value = query if data["value"] is None else data["value"].astype(np.float64)
    n, kv = case.n, case.k or case.n
    h = case.h or case.e // n
    mask = data["attention_mask"]
    output = np.zeros((case.b, case.t, case.e))
    weights = np.zeros((case.b, n, case.t, case.s))
    for b in range(case.b):
        q = query[b] @ w["query_kernel"] + w.get("query_bias", 0.0)
        k = key[b] @ w["key_kernel"] + w.get("key_bias", 0.0)
        v = value[b] @ w["value_kernel"] + w.get("value_bias", 0.0)
        merged = np.zeros((case.t, n * h))
        for head in range(n):
            g = head // (n // kv)
            for t in range(case.t):
                scores, kept = [], []
                for s in range(case.s):
                    m = (
                        None
                        if mask is None
                        else mask[(t, s) if mask.ndim == 2 else (b, t, s) if mask.ndim == 3 else (b, head, t, s)]
                    )
                    floating = m is not None and mask.dtype != np.bool_
                    threshold = max(np.finfo(mask.dtype).min, np.finfo(np.float32).min) if floating else None
                    keep = (m is None or (m if mask.dtype == np.bool_ else m > threshold)) and (
                        not case.causal or s <= t + case.s - case.t
                    )
                    added = 0.0 if m is None or mask.dtype == np.bool_ or not keep else float(m)
                    scores.append(sum(q[t, head * h + d] * k[s, g * h + d] for d in range(h)) / math.sqrt(h) + added)
                    kept.append(keep)
                if any(kept):
                    top = max(sc for sc, kp in zip(scores, kept, strict=True) if kp)
                    exps = [math.exp(sc - top) if kp else 0.0 for sc, kp in zip(scores, kept, strict=True)]
                    weights[b, head, t] = np.array(exps) / sum(exps)
                for d in range(h):
                    merged[t, head * h + d] = sum(weights[b, head, t, s] * v[s, g * h + d] for s in range(case.s))
        output[b] = merged @ w["output_kernel"] + w.get("output_bias", 0.0)
    return output, weights


def _broadcast_mask(mask, case):
    """Masks of the table in their full rank-4 form for the loop formulation."""
    if mask is None:
        return None
    full = {2: mask[None, None], 3: mask[:, None], 4: mask}[mask.ndim]
    return np.broadcast_to(full, (case.b, case.n, case.t, case.s))


@pytest.mark.parametrize("case", LOOP_CASES, ids=lambda c: c.name)
def test_forward_matches_loops(case):
    data = make_data(case)
    expected_output, expected_weights = loop_attention(
        case, {**data, "attention_mask": _broadcast_mask(data["attention_mask"], case)}
    )
    output, weights = _layer(case, data)(
        *_args(data), attention_mask=data["attention_mask"], causal=case.causal, return_attention=True
    )
    np.testing.assert_allclose(output, expected_output, atol=FLOAT64_FORWARD_TOL, rtol=0)
    np.testing.assert_allclose(weights, expected_weights, atol=FLOAT64_FORWARD_TOL, rtol=0)


FD_CASES = [c for c in FLOAT32_CASES if c.name in {
    "self_basic", "cross", "kdim_vdim", "head_dim_explicit", "no_bias", "gqa", "mqa", "mask_float_ts",
    "causal_t_lt_s", "causal_t_gt_s", "rows_fully_masked", "batch_fully_masked", "gqa_self_causal",
    "mask_float64_far", "key_and_query_masks", "query_mask_self", "attention_bias_1nts", "attention_bias_bts_causal",
    "partial_bias_qkv", "partial_bias_output", "scale_custom", "softcap", "window_causal", "window_not_causal",
    "rope_partial_gqa", "rope_interleaved", "rope_llama3", "rope_linear_cross", "qk_norm_head_gqa", "qk_norm_all",
    "sinks_rows_masked", "sinks_gqa_causal", "gemma2_like", "gemma3_like", "gpt_oss_like", "t5_like", "clip_qkv",
    "clip_qkv_qk_norm_rope", "gate_mha", "gate_gqa_causal_padding", "output_norm_layer_gated",
    "qk_norm_after_rope", "laguna_like",
}]  # fmt: skip


@pytest.mark.parametrize("case", FD_CASES, ids=lambda c: c.name)
def test_backward_matches_finite_differences(case):
    data = make_data(case)
    layer = _layer(case, data)
    args = _args(data)
    upstream = data["grad_output"].astype(np.float64)

    given = call_inputs(data)
    if "attention_bias" in given:
        given["attention_bias"] = given["attention_bias"].astype(np.float64)  # perturbed in place below

    def loss():
        return float((layer(*args, **given, causal=case.causal) * upstream).sum())

    loss()
    grads = layer.backward(upstream)
    arrays = dict(zip(("query", "key", "value"), args, strict=False)) | layer.params
    arrays |= {"attention_bias": given["attention_bias"]} if "attention_bias" in given else {}
    assert grads.keys() == arrays.keys()
    for name, array in arrays.items():
        numeric = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            if not np.isfinite(array[index]):
                continue  # an attention_bias of -inf removes its key: no gradient there (checked below)
            old = array[index]
            array[index] = old + FD_STEP
            plus = loss()
            array[index] = old - FD_STEP
            minus = loss()
            array[index] = old
            numeric[index] = (plus - minus) / (2 * FD_STEP)
        assert np.isfinite(grads[name]).all(), name
        np.testing.assert_allclose(grads[name], numeric, atol=FINITE_DIFFERENCE_TOL, rtol=0, err_msg=name)


@pytest.mark.parametrize("left_out", ["both", "key", "value"])
def test_backward_folds_defaulted_inputs(left_out):
    """An input left out gets no gradient entry; its gradient goes to the one it defaulted to."""
    layer = MultiHeadAttention(8, 2, seed=0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(2, 3, 8)), rng.normal(size=(2, 4, 8))
    upstream = rng.normal(size=(2, 3, 8))
    calls = {"both": ((x,), {}), "key": ((x,), {"value": y}), "value": ((x, y), {})}
    args, kwargs = calls[left_out]
    layer(*args, **kwargs)
    grads = layer.backward(upstream)
    key, value = (x, x) if left_out == "both" else (y, y)
    layer(x, key, value)
    full = layer.backward(upstream)
    if left_out == "both":
        expected = {"query": full["query"] + full["key"] + full["value"]}
    else:
        kept = "value" if left_out == "key" else "key"
        expected = {"query": full["query"], kept: full["key"] + full["value"]}
    assert {k for k in grads if k in ("query", "key", "value")} == expected.keys()
    for name, value in expected.items():
        np.testing.assert_allclose(grads[name], value, atol=1e-12)


def test_bool_mask_equals_its_float_twin():
    rng = np.random.default_rng(1)
    layer = MultiHeadAttention(16, 4, seed=1)
    x, y = rng.normal(size=(2, 4, 16)), rng.normal(size=(2, 6, 16))
    keep = rng.random((2, 4, 6)) < 0.6
    keep[0, 2] = False
    twin = np.where(keep, 0.0, -np.inf)
    out_bool, w_bool = layer(x, y, attention_mask=keep, return_attention=True)
    out_float, w_float = layer(x, y, attention_mask=twin, return_attention=True)
    np.testing.assert_array_equal(out_bool, out_float)
    np.testing.assert_array_equal(w_bool, w_float)


def test_gqa_equals_mha_with_repeated_kv_heads():
    rng = np.random.default_rng(2)
    gqa = MultiHeadAttention(16, 4, num_kv_heads=2, seed=2)
    mha = MultiHeadAttention(16, 4)
    weights = gqa.export_weights()
    h = gqa.head_dim
    for kind in ("key", "value"):
        heads = weights[f"{kind}_kernel"].reshape(16, 2, h)  # (E, K, H)
        weights[f"{kind}_kernel"] = np.repeat(heads, 2, axis=1).reshape(16, 4 * h)  # kv head n // 2
        weights[f"{kind}_bias"] = np.repeat(rng.normal(size=(2, h)), 2, axis=0).reshape(-1)
        gqa.params[f"{kind}_bias"] = weights[f"{kind}_bias"].reshape(4, h)[::2].reshape(-1)
    mha.import_weights(weights)
    x, y = rng.normal(size=(2, 3, 16)), rng.normal(size=(2, 5, 16))
    np.testing.assert_allclose(gqa(x, y, causal=True), mha(x, y, causal=True), atol=1e-12)


def test_single_head_is_plain_attention():
    rng = np.random.default_rng(3)
    layer = MultiHeadAttention(8, 1, seed=3)
    p = {name: rng.normal(size=value.shape) for name, value in layer.params.items()}
    layer.import_weights(p)
    x, y = rng.normal(size=(1, 3, 8)), rng.normal(size=(1, 4, 8))
    q, k, v = (
        x[0] @ p["query_kernel"] + p["query_bias"],
        y[0] @ p["key_kernel"] + p["key_bias"],
        y[0] @ p["value_kernel"] + p["value_bias"],
    )
    scores = q @ k.T / math.sqrt(8)
    weights = np.exp(scores) / np.exp(scores).sum(axis=1, keepdims=True)
    expected = (weights @ v) @ p["output_kernel"] + p["output_bias"]
    np.testing.assert_allclose(layer(x, y)[0], expected, atol=1e-12)


def test_fully_masked_row_gives_output_bias_and_finite_gradients():
    rng = np.random.default_rng(4)
    layer = MultiHeadAttention(8, 2, seed=4)
    layer.params["output_bias"] = rng.normal(size=8)
    x = rng.normal(size=(2, 3, 8))
    keep = np.ones((2, 3, 3), dtype=bool)
    keep[1, 2] = False
    output, weights = layer(x, attention_mask=keep, return_attention=True)
    np.testing.assert_array_equal(weights[1, :, 2], 0.0)
    np.testing.assert_array_equal(output[1, 2], layer.params["output_bias"])
    grads = layer.backward(rng.normal(size=(2, 3, 8)))
    assert all(np.isfinite(g).all() for g in grads.values())


def test_causal_is_bottom_right_aligned_when_t_lt_s():
    layer = MultiHeadAttention(8, 2, seed=5)
    rng = np.random.default_rng(5)
    _, weights = layer(rng.normal(size=(1, 2, 8)), rng.normal(size=(1, 4, 8)), causal=True, return_attention=True)
    expected_zero = np.array([[False, False, False, True], [False, False, False, False]])
    assert (weights[0, :, expected_zero] == 0).all()
    assert (weights[0][:, ~expected_zero] > 0).all()


def test_weights_are_exported_and_imported_exactly():
    layer = MultiHeadAttention(12, 3, num_kv_heads=1, kdim=5, vdim=7, seed=6)
    exported = layer.export_weights()
    assert {name: a.shape for name, a in exported.items()} == {
        "query_kernel": (12, 12), "query_bias": (12,), "key_kernel": (5, 4), "key_bias": (4,),
        "value_kernel": (7, 4), "value_bias": (4,), "output_kernel": (12, 12), "output_bias": (12,),
    }  # fmt: skip
    other = MultiHeadAttention(12, 3, num_kv_heads=1, kdim=5, vdim=7, seed=7)
    other.import_weights(exported)
    for name, value in exported.items():
        np.testing.assert_array_equal(other.params[name], value)


def test_initialisation_is_glorot_uniform_with_zero_biases():
    layer = MultiHeadAttention(64, 4, seed=8)
    limit = math.sqrt(6 / 128)
    kernel = layer.params["query_kernel"]
    assert np.abs(kernel).max() <= limit and np.abs(kernel).max() > 0.9 * limit
    assert abs(kernel.std() - limit / math.sqrt(3)) < 0.01
    np.testing.assert_array_equal(layer.params["query_bias"], 0.0)


def test_bias_false_has_no_bias_entries():
    assert set(MultiHeadAttention(8, 2, bias=False).export_weights()) == {
        "query_kernel", "key_kernel", "value_kernel", "output_kernel",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"d_model": 10, "num_heads": 3}, r"`num_heads` must divide `d_model`\. Received: d_model=10, num_heads=3"),
        (
            {"d_model": 8, "num_heads": 4, "num_kv_heads": 3},
            r"`num_kv_heads` must divide `num_heads`\. Received: num_heads=4, num_kv_heads=3",
        ),
        ({"d_model": 0, "num_heads": 1}, r"`d_model` must be a positive integer\. Received: d_model=0"),
        ({"d_model": 8, "num_heads": 2.0}, r"`num_heads` must be a positive integer\. Received: num_heads=2\.0"),
        (
            {"d_model": 8, "num_heads": 2, "head_dim": -1},
            r"`head_dim` must be a positive integer\. Received: head_dim=-1",
        ),
        ({"d_model": 8, "num_heads": 2, "kdim": 0}, r"`kdim` must be a positive integer\. Received: kdim=0"),
        ({"d_model": 8, "num_heads": 2, "dropout": 1.0}, r"`dropout` must be in \[0, 1\)\. Received: dropout=1\.0"),
        (
            {"d_model": 8, "num_heads": 2, "dropout": 0.1},
            r"`dropout` must be 0: the NumPy reference has no dropout\. Received: dropout=0\.1",
        ),
    ],
)
def test_constructor_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        MultiHeadAttention(**kwargs)


def test_backward_before_forward_is_an_error():
    with pytest.raises(
        ValueError, match=r"^`backward` needs a forward call without `cache` first\. Received: no such call$"
    ):
        MultiHeadAttention(8, 2).backward(np.zeros((1, 1, 8)))


def test_failed_import_names_every_problem_and_changes_nothing():
    layer = MultiHeadAttention(8, 2, seed=9)
    before = layer.export_weights()
    bad = dict(before)
    del bad["query_bias"]
    bad["extra"] = np.zeros(3)
    bad["key_kernel"] = np.zeros((3, 4))
    bad["value_kernel"] = np.ones((8, 8))  # well-formed, must not be written either
    with pytest.raises(
        ValueError,
        match=r"missing 'query_bias'; unexpected 'extra'; 'key_kernel' has shape \(3, 4\), expected \(8, 8\)",
    ):
        layer.import_weights(bad)
    for name, value in before.items():
        np.testing.assert_array_equal(layer.params[name], value)
