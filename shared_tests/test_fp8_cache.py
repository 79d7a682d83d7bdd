"""The fp8 (float8_e4m3fn) KV cache (docs/SPEC.md, "KV-cache decoding"): the NumPy file's emulation
of e4m3fn rounding equals ml_dtypes' cast over every code and rounding boundary, the rule gives the
same codes in every file, decoding stays within the SPEC's bound of the float cache (and the files
within twice it of each other), the bytes per token, the checks of a cache built by hand, the
decode fast path, and the runtimes that refuse its exported step. The Keras file's values are
checked on each backend by the Keras check `fp8_cache_values` (shared_tests/test_keras.py); the
parity report's `decode_fp8_cache` runs the case on every path.

Legend: B batch, K num_kv_heads, L cache slots, T tokens, H head_dim.
"""

import functools

import ml_dtypes
import numpy as np
import pytest
import torch

from NumPy import Multi_Head_Attention as numpy_file
from PyTorch import Multi_Head_Attention as torch_file
from shared_tests import serving
from shared_tests.cache_bounds import (
    cache_without_a_scale,
    check_decoding_within_bound,
    fast_and_general_decodes,
    reference_qkv,
)
from shared_tests.cases import TOLERANCES
from shared_tests.decoding import DECODE_CASES_BY_NAME, make_decode_data
from shared_tests.int8 import FP8_TIED_ROW, fp8_cache_keys, fp8_codes, reference_fp8_codes

CASE = DECODE_CASES_BY_NAME["decode_fp8_cache"]
FLOAT32 = TOLERANCES["float32"]["output"]  # float32 arithmetic on top of the fp8 bound
FP8 = ml_dtypes.float8_e4m3fn
RELATIVE = 2.0**-4  # half a quantum at 3 mantissa bits, relative to the value (normal range)
SUBNORMAL = 2.0**-10  # half the subnormal quantum 2^-9, in scales


def _boundaries():
    """float32 values at every rounding boundary of e4m3fn: each finite value, each midpoint
    between neighbours (a tie) and the float32 neighbours of each midpoint, both signs, and 1e5
    uniform draws in [-448, 448]."""
    values = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float32)
    finite = np.unique(values[np.isfinite(values) & (values >= 0)])  # (127,): 0 to 448
    ties = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)  # exact in float32
    near = [np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(np.inf))]
    draws = np.random.default_rng(0).uniform(-448, 448, 100_000).astype(np.float32)
    positive = np.concatenate([finite, ties, *near]).astype(np.float32)
    return np.concatenate([positive, -positive, draws, np.float32([-0.0])])


def test_the_numpy_emulation_rounds_and_decodes_as_ml_dtypes():
    """`_fp8_codes` (no fp8 type in NumPy: float32 arithmetic) gives ml_dtypes' cast bit for bit at
    every boundary (ties to even, subnormals, 448, -0), and `_fp8_values` decodes all 256 codes as
    ml_dtypes does (0x7F and 0xFF are NaN there; the cache never holds them)."""
    x = _boundaries()
    np.testing.assert_array_equal(numpy_file._fp8_codes(x), x.astype(FP8).view(np.uint8))
    codes = np.arange(256, dtype=np.uint8)
    expected = codes.view(FP8).astype(np.float64)
    finite = np.isfinite(expected)
    assert (~finite).sum() == 2 and not np.isin(numpy_file._fp8_codes(x), codes[~finite]).any()
    np.testing.assert_array_equal(numpy_file._fp8_values(codes)[finite], expected[finite])


def test_the_same_keys_give_the_same_fp8_codes_and_scales_in_every_file():
    from TensorFlow import Multi_Head_Attention as tf_file

    keys = fp8_cache_keys()
    codes, scale = reference_fp8_codes(keys)
    assert codes.dtype == np.uint8 and scale.dtype == np.float32 and scale.shape == (2, 2, 4, 1)
    assert scale[0, 0, 0, 0] == 1.0 and numpy_file._fp8_values(codes[0, 0, 0]).tolist() == FP8_TIED_ROW  # ties
    assert (codes[0, 1, 2] & 0x78 == 0).sum() >= 3  # subnormal codes (exponent bits 0) beside 448
    assert codes[1, 0, 1, 0] == 0x80 and scale[1, 1, 3, 0] == 0 and not codes[1, 1, 3].any()  # -0, a zero row
    assert (codes & 0x7F).max() == 0x7E  # 448, never NaN
    quantized = {
        "torch": torch_file._quantize_cache_rows(torch.from_numpy(keys), torch.float8_e4m3fn),
        "tf": tf_file._quantize_cache_rows(keys, tf_file._FP8),
        "tf:xla": _tf_xla_rows(keys, tf_file._FP8),  # the in-place cache's write
    }
    for name, (values, given_scale) in quantized.items():
        np.testing.assert_array_equal(fp8_codes(values), codes, err_msg=name)
        np.testing.assert_array_equal(np.asarray(given_scale), scale, err_msg=name)


def _tf_xla_rows(keys, dtype):
    import tensorflow as tf

    from TensorFlow import Multi_Head_Attention as tf_file

    return tf.function(lambda x: tf_file._quantize_cache_rows(x, dtype), jit_compile=True)(keys)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_the_scales_under_xla_are_numpys(dtype):
    """XLA rewrites a division by a constant as a multiplication by its reciprocal, which rounds
    half of the scales absmax / 448 (and 4% of absmax / 127) one ulp apart: the files divide by a
    tensor instead, so the in-place TensorFlow cache (written under XLA) stores NumPy's scales and
    values (the Keras file on JAX likewise: the checks `fp8_cache_values`, `int8_cache_integers`)."""
    import tensorflow as tf

    keys = np.random.default_rng(1).normal(size=(16, 4, 16, 8)).astype(np.float32)  # 1024 rows
    values, scale = (x.numpy() for x in _tf_xla_rows(keys, tf.as_dtype(dtype)))
    expected, expected_scale = numpy_file._quantize_cache_rows(keys, np.int8 if dtype == "int8" else np.uint8)
    np.testing.assert_array_equal(scale, expected_scale)
    np.testing.assert_array_equal(values if dtype == "int8" else fp8_codes(values), expected)


def _spec_bound(case, data):
    """docs/SPEC.md's bound on |output(fp8 cache) - output(float cache)|, from the reference's float
    q, k and v of the P tokens: a feature x of a row with scale s moves by at most
    e(x) = |x| / 16 + s / 1024; delta = scale * max over query/key pairs of sum_i |q_i| e(k_i) moves
    each weight row by at most e^(2 delta) - 1 in L1, each context feature by that times max |v|
    plus max e(v), each output by that times the largest column L1 norm of the output kernel."""
    layer, q, k, v = reference_qkv(case, data)  # (B, N, P, H), (B, K, P, H) x 2

    def moved(y):  # (B, K, P, H): the most each feature may move
        return np.abs(y) * RELATIVE + np.abs(y).max(axis=-1, keepdims=True) / 448 * SUBNORMAL

    moved_k = np.repeat(moved(k), q.shape[1] // k.shape[1], axis=1)  # (B, K, P, H) -> (B, N, P, H)
    delta = layer.scale * np.einsum("bnth,bnsh->bnts", np.abs(q), moved_k).max()  # over query/key pairs
    weights = np.expm1(2 * delta)
    context = weights * np.abs(v).max() + moved(v).max()
    return context * np.abs(layer.params["output_kernel"]).sum(axis=0).max(), weights


def test_fp8_decoding_stays_within_the_spec_bound_of_the_float_cache():
    data = make_decode_data(CASE)
    bound, weights_bound = _spec_bound(CASE, data)
    check_decoding_within_bound(CASE, data, bound, weights_bound)


@pytest.mark.parametrize("file", ["numpy", "torch", "tf"])
def test_bytes_per_token_are_the_int8_caches(file):
    """2*K*H + 2*K*4 per slot (H = 64, K = 2: 264), the scales included, in every file (NumPy's
    codes are uint8)."""
    config, b, length = dict(d_model=512, num_heads=8, num_kv_heads=2), 3, 5
    if file == "numpy":
        cache = numpy_file.MultiHeadAttention(**config, seed=0).init_cache(b, length, dtype="float8_e4m3fn")
    elif file == "torch":
        cache = torch_file.MultiHeadAttention(**config).init_cache(b, length, dtype=torch.float8_e4m3fn)
    else:
        from TensorFlow import Multi_Head_Attention as tf_file

        cache = tf_file.MultiHeadAttention(**config).init_cache(b, length, dtype="float8_e4m3fn")
    fields = [np.asarray(fp8_codes(x) if x.dtype != np.uint8 else x) for x in (cache.key, cache.value)]
    fields += [np.asarray(x) for x in (cache.key_scale, cache.value_scale)]
    assert sum(x.nbytes for x in fields) / (b * length) == 2 * 2 * 64 + 2 * 2 * 4


@pytest.mark.parametrize("file", ["numpy", "torch", "tf"])
def test_an_fp8_cache_without_its_scales_is_refused(file):
    layer, x, cache = cache_without_a_scale(file, "float8_e4m3fn")
    with pytest.raises(
        ValueError,
        match=r"A float8_e4m3fn `cache` must hold float8_e4m3fn `(key|value)` and a float32 `\1_scale` of shape "
        r"\(2, 4, 5, 1\); make it with `init_cache\(..., dtype='float8_e4m3fn'\)`",
    ):
        layer(x, causal=True, cache=cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_lookup_gives_the_cast_values(dtype):
    """`_fp8_to_float` (the attention's fp8 blocks on the CPU) gives PyTorch's cast of every code,
    from a block that is not contiguous (the first S of L slots), into a reused buffer."""
    codes = torch.arange(256, dtype=torch.uint8).reshape(2, 4, 32)[:, :3].view(torch.float8_e4m3fn)  # (2, 3, 32)
    buffer, indices = torch.full((300,), 7.0, dtype=dtype), torch.empty(300, dtype=torch.long)
    looked_up = torch_file._fp8_to_float(codes, buffer, indices)
    torch.testing.assert_close(looked_up, codes.to(dtype), rtol=0, atol=0, equal_nan=True)
    assert looked_up.data_ptr() == buffer.data_ptr()


def test_fp8_decode_steps_take_the_fast_path_bit_for_bit(monkeypatch):
    """Every T = 1 step over an fp8 cache (grouped heads, RoPE, left padding, a rolling window)
    after the first takes the decode fast path (`_decode_step`) while the cache's first lap lasts,
    and the outputs and the cache equal the general call's (the fast path stepping aside) bit for bit."""
    torch.manual_seed(0)
    layer = torch_file.MultiHeadAttention(32, 4, num_kv_heads=2, rope_theta=10000.0, window=4).eval()
    x, keep = torch.randn(2, 9, 32), torch.ones(2, 6, dtype=torch.bool)  # (B, T, E), (B, L)
    keep[1, :2] = False  # the second row's prompt is left-padded by 2
    init_cache = functools.partial(layer.init_cache, 2, 6, keep=keep, dtype="float8_e4m3fn")
    taken, (fast, fast_cache), (general, general_cache) = fast_and_general_decodes(monkeypatch, layer, x, init_cache)
    assert taken == [False, True, True, False, False, False]  # slots 4 and 5, then the cache wraps
    torch.testing.assert_close(fast, general, rtol=0, atol=0)
    for name in ("key", "value"):
        np.testing.assert_array_equal(fp8_codes(getattr(fast_cache, name)), fp8_codes(getattr(general_cache, name)))
    for name in ("keep", "index", "key_scale", "value_scale"):
        torch.testing.assert_close(getattr(fast_cache, name), getattr(general_cache, name), rtol=0, atol=0)


def test_mla_decodes_its_latent_cache_in_fp8_as_numpy():
    """MLA's latent cache (B, 1, L, C) and (B, 1, L, Hr) in fp8, rolling, in PyTorch and TensorFlow
    against the NumPy reference (expanded), within the parity report's fp8 tolerance between files;
    the fp8 cache moves the output away from the float cache's (its values are what is attended)."""
    from TensorFlow import Multi_Head_Attention as tf_file

    config = dict(d_model=32, num_heads=4, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)
    config |= dict(rope_theta=10000.0, window=4)
    torch.manual_seed(0)
    x = np.random.default_rng(3).normal(size=(2, 9, 32)).astype(np.float32)  # (B, P, E)
    layers = {"torch": torch_file.MultiHeadAttention(**config).eval()}
    weights = layers["torch"].export_weights()
    layers["numpy"], layers["tf"] = numpy_file.MultiHeadAttention(**config), tf_file.MultiHeadAttention(**config)
    for name in ("numpy", "tf"):
        layers[name].import_weights(weights)
    layers["numpy"].absorb_latents = False  # the oracle: MLA expanded
    given = {"numpy": x.astype(np.float64), "torch": torch.from_numpy(x), "tf": x}

    def decode(name, dtype):
        layer, inputs = layers[name], given[name]
        cache, outputs = layer.init_cache(2, 5, dtype=dtype), []
        with torch.no_grad():
            for start, stop in ((0, 3), *((i, i + 1) for i in range(3, 9))):
                output, cache = layer(inputs[:, start:stop], causal=True, cache=cache)
                outputs.append(np.asarray(output, dtype=np.float64))
        return np.concatenate(outputs, axis=1)  # (B, P, E)

    reference = decode("numpy", "float8_e4m3fn")
    assert np.abs(reference - decode("numpy", None)).max() > 100 * FLOAT32
    for name in ("torch", "tf"):
        assert np.abs(decode(name, "float8_e4m3fn") - reference).max() <= CASE.tolerance["output"], name


def test_litert_and_tf2onnx_refuse_the_fp8_cache_step():
    """Neither converter has a float8_e4m3fn type: the fp8 cache's decode step does not convert
    (docs/serving.md; onnxruntime, which has no fp8 Transpose, refuses PyTorch's ONNX export too)."""
    with pytest.raises(ValueError, match=r"Unsupported TensorFlow type `<dtype: 'float8_e4m3fn'>`"):
        serving.export_tf_litert_step(serving.FP8_SERVED)
    with pytest.raises(KeyError, match=r"float8_e4m3fn"):
        serving.export_tf_onnx_step(serving.FP8_SERVED)
