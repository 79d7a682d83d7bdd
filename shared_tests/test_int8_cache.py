"""The int8 KV cache (docs/SPEC.md, "KV-cache decoding"): the quantization rule gives the same
integers in every file, decoding stays within the SPEC's bound of the float cache (and the files
within twice it of each other), the bytes per token, the checks of a cache built by hand, and the
attention's blocks of slots. The Keras file's integers are checked on each backend by the Keras
check `int8_cache_integers` (shared_tests/test_keras.py); the parity report's `decode_int8_cache`
runs the case on every path.

Legend: B batch, K num_kv_heads, L cache slots, T tokens, H head_dim, C kv_lora_rank, Hr qk_rope_head_dim.
"""

import functools

import numpy as np
import pytest
import torch

from PyTorch import Multi_Head_Attention as torch_file
from shared_tests import torch_runner
from shared_tests.cache_bounds import (
    cache_without_a_scale,
    check_decoding_within_bound,
    fast_and_general_decodes,
    reference_qkv,
)
from shared_tests.cases import TOLERANCES
from shared_tests.decoding import DECODE_CASES_BY_NAME, make_decode_data
from shared_tests.int8 import TIED_ROW, cache_keys, reference_cache_integers

CASE = DECODE_CASES_BY_NAME["decode_int8_cache"]
FLOAT32 = TOLERANCES["float32"]["output"]  # float32 arithmetic on top of the int8 bound


def _tf_integers(keys):
    from TensorFlow import Multi_Head_Attention as tf_file

    return tuple(x.numpy() for x in tf_file._quantize_cache_rows(keys))


def _torch_integers(keys):
    return tuple(x.numpy() for x in torch_file._quantize_cache_rows(torch.from_numpy(keys)))


def test_the_same_keys_give_the_same_integers_and_scales_in_every_file():
    keys = cache_keys()
    integers, scale = reference_cache_integers(keys)
    assert integers.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (2, 2, 4, 1)
    assert integers[0, 0, 0].tolist() == TIED_ROW and scale[0, 0, 0, 0] == 1.0  # ties rounded half to even
    assert scale[1, 1, 3, 0] == 0 and not integers[1, 1, 3].any()  # a zero row: scale 0, integers 0
    assert np.abs(integers).max() == 127
    for quantize in (_torch_integers, _tf_integers):
        given_integers, given_scale = quantize(keys)
        assert given_integers.dtype == np.int8 and given_scale.dtype == np.float32
        np.testing.assert_array_equal(given_integers, integers)
        np.testing.assert_array_equal(given_scale, scale)


def _spec_bound(case, data):
    """docs/SPEC.md's bound on |output(int8 cache) - output(float cache)|, from the reference's
    float q, k and v of the P tokens: delta = scale * max ||q||_1 * max s_k / 2 moves each weight
    row by at most e^(2 delta) - 1 in L1, each context feature by that times max |v| plus
    max s_v / 2, each output by that times the largest column L1 norm of the output kernel."""
    layer, q, k, v = reference_qkv(case, data)  # (B, N, P, H), (B, K, P, H) x 2
    k_scale, v_scale = (np.abs(y).max(axis=-1).max() / 127 for y in (k, v))
    delta = layer.scale * np.abs(q).sum(axis=-1).max() * k_scale / 2
    weights = np.expm1(2 * delta)
    context = weights * np.abs(v).max() + v_scale / 2
    return context * np.abs(layer.params["output_kernel"]).sum(axis=0).max(), weights


def test_int8_decoding_stays_within_the_spec_bound_of_the_float_cache():
    data = make_decode_data(CASE)
    bound, weights_bound = _spec_bound(CASE, data)
    check_decoding_within_bound(CASE, data, bound, weights_bound)


@pytest.mark.parametrize(
    ("config", "per_token"),
    [
        (dict(d_model=512, num_heads=8, num_kv_heads=2), 2 * 2 * 64 + 2 * 2 * 4),  # 2*K*H + 2*K*4
        (dict(d_model=64, num_heads=4, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
         32 + 8 + 2 * 4),  # C + Hr + 2*4
    ],
)  # fmt: skip
def test_bytes_per_token(config, per_token):
    layer = torch_file.MultiHeadAttention(**config)
    int8, float32 = layer.init_cache(3, 5, dtype="int8"), layer.init_cache(3, 5, dtype=torch.float32)

    def per_slot(cache):
        fields = (cache.key, cache.value, cache.key_scale, cache.value_scale)
        return sum(x.numel() * x.element_size() for x in fields if x is not None) / (3 * 5)

    assert per_slot(int8) == per_token
    if layer._latent is None:  # H = 64: at most 0.3 of the float32 cache, scales included
        assert per_slot(int8) <= 0.3 * per_slot(float32)


@pytest.mark.parametrize("file", ["numpy", "torch", "tf"])
def test_an_int8_cache_without_its_scales_is_refused(file):
    layer, x, cache = cache_without_a_scale(file, "int8")
    with pytest.raises(
        ValueError,
        match=r"An int8 `cache` must hold int8 `(key|value)` and a float32 `\1_scale` of shape \(2, 4, 5, 1\)",
    ):
        layer(x, causal=True, cache=cache)


def test_the_attention_reads_the_cache_a_block_of_heads_at_a_time(monkeypatch):
    """One key/value head per block (`_QUANTIZED_CACHE_BLOCK` = 1) gives the numbers of one block for all."""
    data = make_decode_data(CASE)
    whole = torch_runner.decode(CASE, data, "torch:explicit")
    monkeypatch.setattr(torch_file, "_QUANTIZED_CACHE_BLOCK", 1)
    sliced = torch_runner.decode(CASE, data, "torch:explicit")
    np.testing.assert_allclose(sliced.output, whole.output, rtol=0, atol=FLOAT32)
    np.testing.assert_allclose(sliced.weights, whole.weights, rtol=0, atol=TOLERANCES["float32"]["weights"])


def test_int8_decode_steps_take_the_fast_path_bit_for_bit(monkeypatch):
    """Every T = 1 step over an int8 cache (grouped heads, RoPE, left padding) after the first
    takes the decode fast path (`_decode_step`), and the outputs and the cache equal the general
    call's (the fast path stepping aside) bit for bit."""
    torch.manual_seed(0)
    layer = torch_file.MultiHeadAttention(32, 4, num_kv_heads=2, rope_theta=10000.0).eval()
    x, keep = torch.randn(2, 9, 32), torch.ones(2, 9, dtype=torch.bool)  # (B, T, E), (B, L)
    keep[1, :2] = False  # the second row's prompt is left-padded by 2
    init_cache = functools.partial(layer.init_cache, 2, 9, keep=keep, dtype="int8")
    taken, (fast, fast_cache), (general, general_cache) = fast_and_general_decodes(monkeypatch, layer, x, init_cache)
    assert taken == [False] + [True] * 5  # the prompt runs the general call, which keeps the kernels
    torch.testing.assert_close(fast, general, rtol=0, atol=0)
    for name in ("key", "value", "keep", "index", "key_scale", "value_scale"):
        torch.testing.assert_close(getattr(fast_cache, name), getattr(general_cache, name), rtol=0, atol=0)
