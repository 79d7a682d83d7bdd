"""The int8 parity rule (docs/SPEC.md, "int8"), shared by shared_tests/test_int8.py and the Keras
checks that run in each backend's process (shared_tests/keras_checks.py): NumPy only.

Numbers of int8 layers differ between files only where float noise flips the rounding of a
token's input: the output within one quantization step of the NumPy reference's, with at most
`FLIP_SHARE` of the outputs beyond float32's tolerance. Also the keys of the int8 and fp8 KV
caches' rules and their NumPy codes (`fp8_codes` reads a PyTorch tensor's bits through PyTorch).
"""

import numpy as np

from shared_tests.cases import TOLERANCES

FLOAT32 = TOLERANCES["float32"]["output"]  # what float32 arithmetic alone may change
FLIP_SHARE = (
    0.01  # outputs beyond FLOAT32 allowed: a token's rounding flipped by float noise (each costs at most a step)
)
INT8_ERROR = 0.05  # int8 against float32 on these cases (Glorot weights, N(0, 1) inputs): up to 0.032 measured
CASE_NAMES = (
    "self_basic", "kdim_vdim", "no_bias", "gqa_self_causal", "rows_fully_masked", "empty_query", "rope_self_causal",
    "qk_norm_all", "sinks_gqa_causal", "wide", "clip_qkv", "gate_gqa_causal_padding",
)  # fmt: skip


def numpy_layer(case, weights):
    """The NumPy reference of `case` holding `weights` (an int8 layout quantizes it)."""
    from NumPy import Multi_Head_Attention as numpy_file

    layer = numpy_file.MultiHeadAttention(**case.config)
    layer.import_weights(weights)
    return layer


def one_step(reference):
    """One quantization step of the output of the reference's last call: one integer of the output
    projection's input (x_scale = max |row| / 127) times its largest dequantized weight
    (127 * kernel_scale)."""
    merged = reference._saved["merged"]  # (B, T, N*H), the output projection's input
    return float(np.abs(merged).max(initial=0.0) * reference.params["output_kernel_scale"].max())


def assert_within_a_step(output, expected, step, what="", dtype="float32"):
    """Within one step plus the output tolerance of `dtype`, the layer's compute dtype, of the
    reference; in float32 with at most FLIP_SHARE of the outputs beyond float32's tolerance. In
    float16 and bfloat16 the inputs are rounded before they are quantized, which flips the rounding
    of many tokens: there the step alone is the bar (shared_tests/dtypes.py's `judge`)."""
    output = np.asarray(output, dtype=np.float64)
    assert np.isfinite(output).all(), f"{what}: {output.size - np.isfinite(output).sum()} outputs not finite"
    bar = TOLERANCES[dtype]["output"]
    difference = np.abs(output - expected)
    worst = difference.max(initial=0.0)
    assert worst <= step + bar, f"{what}: differs by {worst:.2e}, more than a step {step:.2e} and {dtype}'s {bar:.0e}"
    flipped = np.mean(difference > FLOAT32) if difference.size and dtype == "float32" else 0.0
    assert flipped <= FLIP_SHARE, f"{what}: {flipped:.1%} of the outputs beyond float32's tolerance"


def cache_keys():
    """(2, 2, 4, 8) float32 keys for the int8 KV cache's rule (docs/SPEC.md, "KV-cache decoding"),
    the same in every file: random rows, a row whose scale is exactly 1 holding ties (x.5, rounded
    half to even), and a row of zeros (scale 0, integers 0)."""
    keys = np.random.default_rng(8).normal(scale=3.0, size=(2, 2, 4, 8)).astype(np.float32)
    keys[0, 0, 0] = [127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -127.0]
    keys[1, 1, 3] = 0.0
    return keys


TIED_ROW = [127, 0, 2, 2, 0, -2, 126, -127]  # the integers of keys[0, 0, 0]: its scale is 1


def reference_cache_integers(keys):
    """The NumPy file's int8 cache integers and scales of `keys`."""
    from NumPy import Multi_Head_Attention as numpy_file

    return numpy_file._quantize_cache_rows(keys)


def fp8_cache_keys():
    """(2, 2, 4, 8) float32 keys for the fp8 KV cache's rule: random rows, a row whose scale is
    exactly 1 (max |x| = 448) holding ties between neighbouring e4m3fn values in several binades
    (rounded to the even mantissa) and subnormals (below 2^-6), a row of tiny values beside one
    large (subnormal codes after scaling), a row of zeros (scale 0, codes 0) and negative zeros."""
    keys = np.random.default_rng(9).normal(scale=3.0, size=(2, 2, 4, 8)).astype(np.float32)
    keys[0, 0, 0] = FP8_TIED_ROW_KEYS
    keys[0, 1, 2] = [5.0, 1e-4, -3e-4, 2e-3, -0.011, 0.0, -0.0, 0.02]
    keys[1, 1, 3] = 0.0
    keys[1, 0, 1, :2] = -0.0
    return keys


# ties between neighbours: 1.0625 (1 | 1.125), 1.1875 (1.125 | 1.25), 17 (16 | 18), 2^-10 (0 | 2^-9),
# 3 * 2^-10 (2^-9 | 2^-8), 432 (416 | 448)
FP8_TIED_ROW_KEYS = [448.0, 1.0625, 1.1875, -17.0, 2.0**-10, -3 * 2.0**-10, 432.0, -448.0]
FP8_TIED_ROW = [448.0, 1.0, 1.25, -16.0, 0.0, -(2.0**-8), 448.0, -448.0]  # their fp8 values at scale 1


def reference_fp8_codes(keys):
    """The NumPy file's fp8 cache codes (uint8) and scales of `keys`."""
    from NumPy import Multi_Head_Attention as numpy_file

    return numpy_file._quantize_cache_rows(keys, np.uint8)


def fp8_codes(values):
    """A framework's fp8 tensor (PyTorch, TensorFlow, JAX) -> its uint8 e4m3fn codes, bit for bit
    (a view: -0 stays 0x80)."""
    if type(values).__module__.startswith("torch"):
        import torch

        return values.view(torch.uint8).cpu().numpy()
    array = np.asarray(values)
    assert array.dtype.name == "float8_e4m3fn", array.dtype
    return array.view(np.uint8)
