"""The sparse indexer (DSA) of the TensorFlow and Keras files against the NumPy reference: the same
selection and outputs, decoding equal to the full pass, planted ties ranked by the lower key index.
The Keras file runs on this process's backend (TensorFlow); the parity report runs the three.

Legend: B batch, T query length, S key length, E d_model.
"""

import numpy as np
import pytest

from NumPy import MultiHeadAttention as Reference

OUTPUT_TOLERANCE = 1e-5  # docs/SPEC.md, float32 against NumPy
MLA = {"d_model": 16, "num_heads": 4, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 6}
CONFIGS = {
    "q_lora_half_split": {**MLA, "q_lora_rank": 6, "rope_theta": 10000.0},
    "interleaved_padded": {**MLA, "rope_theta": 10000.0, "index_rope_interleaved": True},
}
INDEXER = {"index_topk": 4, "index_num_heads": 2, "index_head_dim": 8}  # k = 4 of S = 16: the selection matters
B, T = 2, 16


def _layer(framework, config, weights):
    if framework == "tf":
        from TensorFlow import MultiHeadAttention
    else:
        from Keras import MultiHeadAttention
    layer = MultiHeadAttention(**config)
    layer.import_weights(weights)
    return layer


def _inputs(seed):
    rng = np.random.default_rng(seed)
    key_mask = np.ones((B, T), bool)
    key_mask[1, :5] = False  # left padding
    return rng.normal(size=(B, T, 16)), key_mask


@pytest.mark.parametrize("framework", ["tf", "keras"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("absorb", [False, True])
def test_selection_and_output_equal_numpy(framework, name, absorb):
    config = {**CONFIGS[name], **INDEXER}
    reference = Reference(**config, seed=0)
    x, key_mask = _inputs(1)
    expected, expected_selection = reference(x, causal=True, key_mask=key_mask, return_topk=True)
    layer = _layer(framework, config, reference.export_weights())
    layer.absorb_latents = absorb
    output, selection = layer(x.astype(np.float32), causal=True, key_mask=key_mask, return_topk=True)
    np.testing.assert_array_equal(np.asarray(selection), expected_selection)
    np.testing.assert_allclose(np.asarray(output), expected, atol=OUTPUT_TOLERANCE, rtol=0)


@pytest.mark.parametrize("framework", ["tf", "keras"])
def test_decoding_equals_the_full_pass(framework):
    config = {**CONFIGS["q_lora_half_split"], **INDEXER}
    reference = Reference(**config, seed=0)
    x, _ = _inputs(2)
    layer = _layer(framework, config, reference.export_weights())
    full = np.asarray(layer(x.astype(np.float32), causal=True))
    cache, outputs = layer.init_cache(B, T), []
    for start, stop in ((0, 5), (5, 6), (6, T)):  # a prompt, one token, the rest
        output, cache = layer(x[:, start:stop].astype(np.float32), causal=True, cache=cache)
        outputs.append(np.asarray(output))
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), full, atol=OUTPUT_TOLERANCE, rtol=0)
    np.testing.assert_allclose(full, reference(x, causal=True), atol=OUTPUT_TOLERANCE, rtol=0)


@pytest.mark.parametrize("framework", ["tf", "keras"])
def test_planted_ties_select_the_earliest_allowed_keys(framework):
    config = {**CONFIGS["interleaved_padded"], **INDEXER}
    reference = Reference(**config, seed=0)
    weights = reference.export_weights()
    weights["index_weights_kernel"] = np.zeros_like(weights["index_weights_kernel"])  # every score exactly 0
    reference.import_weights(weights)
    x, key_mask = _inputs(3)
    _, expected = reference(x, causal=True, key_mask=key_mask, return_topk=True)
    _, selection = _layer(framework, config, weights)(
        x.astype(np.float32), causal=True, key_mask=key_mask, return_topk=True
    )
    np.testing.assert_array_equal(np.asarray(selection), expected)
    np.testing.assert_array_equal(expected[1, -1], [5, 6, 7, 8])  # padded row: its first 4 real keys
    np.testing.assert_array_equal(expected[0, 1], [0, 1, 2, 3])  # an early causal row: its 2 keys, then the rest


@pytest.mark.parametrize("framework", ["tf", "keras"])
def test_sparse_differs_from_dense(framework):
    config = CONFIGS["q_lora_half_split"]
    reference = Reference(**config, **INDEXER, seed=0)
    weights = reference.export_weights()
    x, _ = _inputs(4)
    sparse = np.asarray(_layer(framework, {**config, **INDEXER}, weights)(x.astype(np.float32), causal=True))
    dense_weights = {name: value for name, value in weights.items() if not name.startswith("index_")}
    dense = np.asarray(_layer(framework, config, dense_weights)(x.astype(np.float32), causal=True))
    assert np.abs(sparse[:, 4:] - dense[:, 4:]).max() > 1e-3  # rows with more than k allowed keys
    np.testing.assert_allclose(sparse[:, :4], dense[:, :4], atol=OUTPUT_TOLERANCE, rtol=0)  # k >= allowed: dense
