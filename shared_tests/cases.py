"""The one case table that drives every framework, and the seeded data each case runs on.

Legend: B batch, T query length, S key/value length, E d_model, N num_heads,
K num_kv_heads, H head_dim.
"""

import dataclasses
import math
from unittest import mock

import numpy as np

# SPEC tolerances (absolute). Never loosen one without a comment saying why.
TOLERANCES = {
    "float32": {"output": 1e-5, "weights": 1e-6, "grads": 1e-4},
    "float16": {"output": 1e-2, "weights": 1e-2, "grads": None},  # SPEC: n/a for gradients
    "bfloat16": {"output": 5e-2, "weights": 5e-2, "grads": None},  # SPEC: n/a for gradients
}
# SPEC float64 tolerances (absolute) of PyTorch and TensorFlow float64 layers against NumPy (measured at E = 512,
# T = 64: 7e-15, 1.3e-15, 7e-14). RoPE's angles are float32 in those two files, so with RoPE a float64 layer is held
# to the float32 tolerances (measured there: 1.1e-6, 6e-7, 2.4e-5; about 2e-7 at the property tests' tiny shapes).
# The int8 KV cache against the float pass (docs/SPEC.md, "Tolerances"): the bound derived there from the
# rounding of the keys and values (|dk| <= scale / 2), at the decode cases' sizes (E = 16, Glorot weights, inputs
# N(0, 1)); "cache": one quantization step of a dequantized key or value (the files may round a key a few ulps
# apart to neighbouring integers).
INT8_CACHE_TOLERANCES = {"output": 2e-2, "weights": 2e-2, "cache": 3e-2}
# The fp8 (float8_e4m3fn) KV cache likewise, its keys and values rounded to 3 mantissa bits (|dk| <= |k| / 16);
# "cache": one quantum of the largest fp8 value, 32 scales (absmax / 14), where the files round a key a few ulps
# apart to neighbouring fp8 values.
FP8_CACHE_TOLERANCES = {"output": 0.1, "weights": 5e-2, "cache": 0.25}
FLOAT64_TOLERANCES = {
    "plain": {"output": 1e-12, "weights": 1e-12, "grads": 1e-11},
    "rope": TOLERANCES["float32"],
}

MASK_KINDS = (
    "none",  # no attention_mask
    "bool_ts",  # boolean (T, S)
    "bool_bts",  # boolean (B, T, S)
    "bool_bnts",  # boolean (B, N, T, S)
    "bool_b1s",  # boolean key padding (B, 1, S)
    "bool_bn1s",  # boolean (B, 1, 1, S) with broadcast dimensions in rank 4
    "float_ts",  # floating (T, S): values added to the scores, -inf removes a key
    "float_bts",  # floating (B, T, S) with -inf
    "float_row_inf",  # floating (B, T, S): a row entirely -inf, and the lowest float32 (what converters put for -inf)
    "rows_masked",  # boolean (B, T, S) in which some query rows keep no key
    "batch_masked",  # key padding (B, 1, S) in which one batch element keeps no key
    "float64_far",  # floating float64 (B, T, S): -1e300, float32's lowest, and a row of -1e39 (below float32's range)
    "float_penalty",  # floating float32 (B, T, S) of -1e9 penalties, one row entirely -1e9 (beyond float16's range)
)
LLAMA3_SCALING = {  # Llama 3.1's frequency rewrite, with a short original context so every band is taken at H = 8
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # fmt: skip
EVERYTHING_NEW = {  # every variant of today's models on one layer (test_tensorflow_variants.py, legacy_keras.py)
    "num_kv_heads": 2, "head_dim": 8, "softcap": 3.0, "window": (3, 2), "attention_chunk_size": 3,
    "rope_theta": 50.0, "rope_fraction": 0.75, "rope_sections": (1, 2), "qk_norm": "per_head",
    "qk_norm_type": "layer", "qk_norm_bias": True, "sinks": True, "clip_qkv": 1.0,
}  # fmt: skip
PROPORTIONAL_SCALING = {  # Gemma 4's full layers at H = 8, theta 100: pairs 0, 1 turn (over 1.25), pairs 2, 3 do not
    "rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 1.25,
}  # fmt: skip
YARN_SCALING = {  # YaRN at H = 8, theta 10000: frequency ramp (0, 0.6, 1, 1) over the pairs, attention factor 1.14
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "truncate": False,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration (constructor) plus call options."""

    name: str
    b: int = 2
    t: int = 5
    s: int = 5
    e: int = 16
    n: int = 4
    k: int | None = None  # num_kv_heads; None means N
    h: int | None = None  # head_dim; None means E // N
    kdim: int | None = None
    vdim: int | None = None
    bias: bool | tuple = True  # True, False or the projections that have one
    mask: str = "none"
    causal: bool = False
    self_attention: bool = False  # call layer(query) with key and value left out
    dtype: str = "float32"
    scale: float = 1.0  # standard deviation of the inputs; large values push scores to ~1e3
    variants: tuple = ()  # more constructor arguments as (name, value) pairs: scale, softcap, window, rope_*, ...
    key_mask: bool = False  # pass a (B, S) key_mask in which the last batch element keeps no key
    query_mask: bool = False  # pass a (B, T) query_mask
    attention_bias: str = "none"  # none, 1nts (1, N, T, S) or bts (B, T, S), with some -inf
    positions: str = "none"  # none (the default arange), shifted: (B, T) positions, each row its own offset, or
    # sections: (k, B, T) positions of `rope_sections`, each of the k rows its own (Qwen2-VL's temporal, height, width)
    absorb: bool | None = None  # MLA: the layers' `absorb_latents` (the NumPy oracle always expands)
    segments: str = "none"  # packed sequences: none, packed ((B, T) segment_ids, documents back to back in each
    # row, self-attention) or cross (segment_ids (B, T) and key_segment_ids (B, S))

    @property
    def mla(self):
        """Multi-head latent attention: `key` alone carries keys and values (no `value` input)."""
        return "kv_lora_rank" in dict(self.variants)

    @property
    def config(self):
        """Constructor arguments shared by the three layers."""
        return dict(
            d_model=self.e, num_heads=self.n, num_kv_heads=self.k, head_dim=self.h,
            kdim=self.kdim, vdim=self.vdim, bias=self.bias, **dict(self.variants),
        )  # fmt: skip

    @property
    def tolerance(self):
        """SPEC tolerances, stated for inputs ~ N(0, 1). With inputs of standard deviation
        `scale`, outputs grow like `scale`, attention weights stay in [0, 1], and gradients of
        the kernels (x^T @ dy, through scores that grow like scale^2) grow like scale^2; the
        tolerances grow the same way so the relative bar stays the SPEC's."""
        factors = {"output": self.scale, "weights": 1.0, "grads": self.scale**2}
        return {q: None if tol is None else tol * factors[q] for q, tol in TOLERANCES[self.dtype].items()}


CASES = [
    Case("self_basic", self_attention=True),
    Case("self_b1", b=1, self_attention=True),
    Case("self_t1", t=1, s=1, self_attention=True),
    Case("cross", t=4, s=7),
    Case("cross_s1", t=4, s=1),
    Case("cross_t1_decode", t=1, s=6),
    Case("kdim_vdim", t=4, s=6, kdim=6, vdim=10),
    Case("head_dim_explicit", n=3, h=5, t=4, s=6),
    Case("no_bias", bias=False, t=4, s=6),
    Case("gqa", n=4, k=2, t=4, s=6),
    Case("mqa", n=4, k=1, t=4, s=6),
    Case("single_head", n=1, t=4, s=6),
    Case("gqa_self_causal", n=4, k=2, self_attention=True, causal=True),
    Case("mask_bool_ts", t=4, s=6, mask="bool_ts"),
    Case("mask_bool_bts", t=4, s=6, mask="bool_bts"),
    Case("mask_bool_bnts", t=4, s=6, mask="bool_bnts"),
    Case("mask_key_padding", t=4, s=6, mask="bool_b1s"),
    Case("mask_bool_bn1s", t=4, s=6, mask="bool_bn1s"),
    Case("mask_float_ts", t=4, s=6, mask="float_ts"),
    Case("mask_float_bts_gqa", t=4, s=6, k=2, mask="float_bts"),
    Case("mask_float_inf_row", t=4, s=6, mask="float_row_inf"),
    Case("mask_float_inf_row_causal", k=2, causal=True, self_attention=True, mask="float_row_inf"),
    Case("causal_self", causal=True, self_attention=True),
    Case("packed_causal", t=7, s=7, k=2, causal=True, self_attention=True, segments="packed"),
    Case("packed_cross", t=4, s=6, segments="cross", mask="bool_bts"),
    Case(
        "packed_gemma2_like",
        t=7,
        s=7,
        causal=True,
        self_attention=True,
        segments="packed",
        key_mask=True,
        variants=(("softcap", 3.0), ("window", 3), ("sinks", True), ("rope_theta", 100.0)),
    ),
    Case("causal_t_eq_s_cross", t=6, s=6, causal=True),
    Case("causal_t_lt_s", t=3, s=7, causal=True),
    Case("causal_t_gt_s", t=6, s=3, causal=True),
    Case("causal_plus_padding", t=5, s=5, causal=True, mask="bool_b1s"),
    Case("causal_plus_float_mqa", t=3, s=6, k=1, causal=True, mask="float_ts"),
    Case("rows_fully_masked", t=4, s=6, mask="rows_masked"),
    Case("batch_fully_masked", t=4, s=6, mask="batch_masked"),
    Case("batch_fully_masked_causal", causal=True, mask="batch_masked", self_attention=True),
    Case("large_scores", t=4, s=6, scale=20.0),
    Case("large_scores_masked", t=4, s=6, scale=20.0, mask="bool_bts"),
    Case("wide", e=64, n=8, t=9, s=11, mask="bool_b1s"),
    Case("empty_query", t=0, s=6, mask="bool_bts"),  # T = 0: an empty output, as the built-ins give
    Case("empty_keys", t=4, s=0, causal=True),  # S = 0: no query has a key, so the output is output_bias
    Case("float16_self", dtype="float16", self_attention=True, mask="bool_b1s"),
    Case("float16_cross_causal", dtype="float16", t=4, s=6, causal=True),
    Case("bfloat16_cross", dtype="bfloat16", t=4, s=6, mask="float_ts"),
    Case("bfloat16_gqa_masked", dtype="bfloat16", k=2, t=4, s=6, mask="rows_masked"),
    # The floating mask rule: read in the mask's own dtype, removed at or below max(its lowest, float32's)
    Case("mask_float64_far", t=4, s=6, mask="float64_far"),
    Case("mask_float64_far_gqa_causal", k=2, causal=True, self_attention=True, mask="float64_far"),
    Case("float16_mask_penalty", dtype="float16", t=4, s=6, mask="float_penalty"),
    Case("bfloat16_mask_float64_far", dtype="bfloat16", t=4, s=6, mask="float64_far"),
    # Padding masks and the additive bias
    Case("key_mask", t=4, s=6, key_mask=True),
    Case("query_mask_self", self_attention=True, query_mask=True, causal=True),
    Case("key_and_query_masks", t=4, s=6, key_mask=True, query_mask=True, mask="bool_bts"),
    Case("attention_bias_1nts", t=4, s=6, attention_bias="1nts", mask="bool_b1s"),
    Case("attention_bias_bts_causal", self_attention=True, causal=True, attention_bias="bts", k=2),
    Case("partial_bias_qkv", t=4, s=6, bias=("query", "key", "value")),
    Case("partial_bias_output", self_attention=True, bias=("output",)),
    # Variants of today's models
    Case("scale_custom", self_attention=True, variants=(("scale", 0.3),)),
    Case("softcap", t=4, s=6, mask="bool_bts", scale=3.0, variants=(("softcap", 2.0),)),
    Case("window_causal", self_attention=True, causal=True, variants=(("window", 2),)),
    Case("window_t_lt_s", t=3, s=7, causal=True, variants=(("window", 3),)),
    Case("window_not_causal", t=4, s=6, mask="rows_masked", variants=(("window", 2),)),
    Case("rope_self_causal", self_attention=True, causal=True, variants=(("rope_theta", 10000.0),)),
    Case(
        "rope_partial_gqa",
        e=32,
        k=2,
        self_attention=True,
        causal=True,
        positions="shifted",
        variants=(("rope_theta", 10000.0), ("rope_fraction", 0.5)),
    ),
    Case(
        "rope_interleaved",
        self_attention=True,
        positions="shifted",
        variants=(("rope_theta", 100.0), ("rope_interleaved", True)),
    ),
    Case(
        "rope_llama3",
        e=32,
        self_attention=True,
        causal=True,
        positions="shifted",
        variants=(("rope_theta", 10000.0), ("rope_scaling", LLAMA3_SCALING)),
    ),
    Case(
        "rope_linear_cross",
        t=5,
        s=5,
        mask="bool_b1s",
        variants=(("rope_theta", 10000.0), ("rope_scaling", {"rope_type": "linear", "factor": 2.0})),
    ),
    Case("qk_norm_head_gqa", k=2, self_attention=True, causal=True, variants=(("qk_norm", "head"),)),
    Case(
        "qk_norm_all",  # with BitNet's output norm (an RMSNorm of the merged heads before the output projection)
        t=4,
        s=6,
        k=2,
        variants=(("qk_norm", "all"), ("qk_norm_eps", 1e-5), ("output_norm", "rms")),
    ),
    Case(
        "qk_norm_after_rope",  # HunYuan's QK-norm of the turned heads (query_layernorm, key_layernorm)
        e=32,
        k=2,
        self_attention=True,
        causal=True,
        positions="shifted",
        variants=(("rope_theta", 100.0), ("qk_norm", "head"), ("qk_norm_after_rope", True)),
    ),
    Case(
        "output_norm_layer_gated",  # Kosmos-2's LayerNorm (with its bias) of the merged heads, after the gate
        k=2,
        self_attention=True,
        causal=True,
        mask="rows_masked",
        variants=(("output_norm", "layer"), ("output_norm_eps", 1e-5), ("gate", True)),
    ),
    Case("sinks_rows_masked", t=4, s=6, mask="rows_masked", variants=(("sinks", True),)),
    Case("sinks_gqa_causal", k=2, self_attention=True, causal=True, variants=(("sinks", True),)),
    Case("clip_qkv", t=4, s=6, k=2, mask="bool_bts", variants=(("clip_qkv", 0.5),)),  # ~60% of q, k, v clamped
    Case(
        "clip_qkv_qk_norm_rope",  # the clamp before QK-norm and RoPE (OLMo's order)
        k=2,
        self_attention=True,
        causal=True,
        variants=(("clip_qkv", 0.5), ("qk_norm", "all"), ("rope_theta", 10000.0)),
    ),
    Case(
        "gemma2_like",
        e=32,
        k=2,
        self_attention=True,
        causal=True,
        mask="bool_b1s",
        scale=2.0,
        variants=(("rope_theta", 10000.0), ("softcap", 5.0), ("window", 3), ("scale", 0.25)),
    ),
    Case(
        "gemma3_like",
        e=32,
        k=2,
        self_attention=True,
        causal=True,
        query_mask=True,
        positions="shifted",
        variants=(("rope_theta", 10000.0), ("qk_norm", "head"), ("window", 3), ("scale", 0.25)),
    ),
    Case(
        "gpt_oss_like",
        e=32,
        k=2,
        self_attention=True,
        causal=True,
        query_mask=True,
        variants=(("rope_theta", 150000.0), ("window", 3), ("sinks", True)),
    ),
    Case(
        "gemma4_full_like",  # keys as values (attention_k_eq_v) and the unweighted value norm (v_norm), clamped once
        e=32,
        k=2,
        self_attention=True,
        causal=True,
        mask="bool_b1s",
        positions="shifted",
        variants=(
            ("rope_theta", 10000.0),
            ("qk_norm", "head"),
            ("scale", 1.0),
            ("keys_as_values", True),
            ("value_norm", True),
            ("clip_qkv", 1.0),
        ),
    ),
    Case("t5_like", t=4, s=6, bias=False, key_mask=True, attention_bias="1nts", variants=(("scale", 1.0),)),
    Case(
        "float16_variants",
        dtype="float16",
        e=32,
        self_attention=True,
        causal=True,
        variants=(("rope_theta", 10000.0), ("softcap", 5.0), ("sinks", True), ("window", 3)),
    ),
    Case(
        "bfloat16_variants",
        dtype="bfloat16",
        e=32,
        k=2,
        self_attention=True,
        causal=True,
        attention_bias="bts",
        variants=(("rope_theta", 10000.0), ("qk_norm", "head"), ("window", 3)),
    ),
    Case(
        "rope_yarn_gqa",
        e=32,
        k=2,
        self_attention=True,
        causal=True,
        positions="shifted",
        variants=(("rope_theta", 10000.0), ("rope_scaling", YARN_SCALING)),
    ),
    Case(
        "rope_proportional_gqa",  # theta 100: the unturned pairs 2, 3 would turn by 0.08 and 0.025 per position
        e=32,
        k=2,
        t=6,
        s=6,
        self_attention=True,
        causal=True,
        positions="shifted",
        variants=(("rope_theta", 100.0), ("rope_scaling", PROPORTIONAL_SCALING)),
    ),
    # Two-sided windows, chunked attention, multimodal RoPE, LayerNorm QK-norm
    Case("window_pair", t=4, s=6, variants=(("window", (2, 2)),)),  # a band on both sides, bottom-right aligned
    Case("window_pair_self_gqa", k=2, t=6, s=6, self_attention=True, query_mask=True, variants=(("window", (3, 2)),)),
    Case("attention_chunk_causal", self_attention=True, causal=True, variants=(("attention_chunk_size", 2),)),
    Case("attention_chunk_cross", t=3, s=7, mask="bool_b1s", variants=(("attention_chunk_size", 3),)),
    Case(
        "rope_sections",
        e=32,
        self_attention=True,
        causal=True,
        positions="sections",
        variants=(("rope_theta", 10000.0), ("rope_sections", (1, 2, 1))),
    ),
    Case(
        "query_scaling_positions",  # Mistral 4's `llama_4_scaling_beta`: q times 1 + 0.5 ln(1 + floor(p / 2))
        k=2,
        self_attention=True,
        causal=True,
        positions="shifted",
        variants=(("rope_theta", 10000.0), ("query_scaling", {"type": "positions", "beta": 0.5, "floor": 2})),
    ),
    Case(
        "rope_sections_partial_interleaved",  # (B, T) positions for both sections: plain RoPE
        e=32,
        k=2,
        self_attention=True,
        positions="shifted",
        variants=(("rope_theta", 100.0), ("rope_fraction", 0.5), ("rope_interleaved", True), ("rope_sections", (1, 1))),
    ),
    Case(
        "qk_norm_layer_per_head",  # StableLM, Cohere
        k=2,
        self_attention=True,
        causal=True,
        variants=(("qk_norm", "per_head"), ("qk_norm_type", "layer")),
    ),
    Case(
        "qk_norm_layer_head_bias",  # Phi
        t=4,
        s=6,
        mask="bool_bts",
        variants=(("qk_norm", "head"), ("qk_norm_type", "layer"), ("qk_norm_bias", True)),
    ),
    Case(
        "qk_norm_rms_all_bias",
        k=2,
        self_attention=True,
        causal=True,
        variants=(("qk_norm", "all"), ("qk_norm_bias", True), ("qk_norm_eps", 1e-5), ("rope_theta", 10000.0)),
    ),
    Case(
        "modernbert_like",
        e=32,
        t=7,
        s=7,
        self_attention=True,
        key_mask=True,
        variants=(("rope_theta", 10000.0), ("window", (3, 3))),
    ),
    Case(
        "llama4_like",
        e=32,
        k=2,
        t=7,
        s=7,
        self_attention=True,
        causal=True,
        query_mask=True,
        positions="shifted",
        variants=(
            ("rope_theta", 500000.0),
            ("rope_interleaved", True),
            ("qk_norm", "head"),
            ("attention_chunk_size", 3),
        ),
    ),
    Case(
        "qwen2_vl_like",
        e=32,
        k=2,
        self_attention=True,
        causal=True,
        bias=("query", "key", "value"),
        positions="sections",
        variants=(("rope_theta", 1000000.0), ("rope_sections", (2, 1, 1))),
    ),
    Case(
        "qwen3_vl_like",  # Qwen3-VL's multimodal RoPE: the sections' pairs dealt to the rows in turn
        e=32,
        k=2,
        self_attention=True,
        causal=True,
        positions="sections",
        variants=(("rope_theta", 10000.0), ("rope_sections", (2, 1, 1)), ("rope_sections_interleaved", True)),
    ),
    Case(
        "float16_new_variants",
        dtype="float16",
        e=32,
        k=2,
        self_attention=True,
        causal=True,
        positions="sections",
        variants=(
            ("rope_theta", 10000.0),
            ("rope_sections", (2, 1, 1)),
            ("window", (3, 1)),
            ("attention_chunk_size", 4),
            ("qk_norm", "per_head"),
            ("qk_norm_type", "layer"),
            ("qk_norm_bias", True),
        ),
    ),
    # Output-gated attention (Keras' use_gate, Qwen3-Next): sigmoid(query @ gate_kernel) times each head's result
    Case("gate_mha", t=4, s=6, mask="rows_masked", variants=(("gate", True),)),  # a row of no key gives output_bias
    Case(
        "gate_gqa_causal_padding",  # Qwen3-Next's gate: no bias on it
        k=2,
        self_attention=True,
        causal=True,
        mask="bool_b1s",
        bias=("query", "key", "value", "output"),
        variants=(("gate", True),),
    ),
    Case(
        "qwen3_next_like",
        e=32,
        k=2,
        self_attention=True,
        causal=True,
        query_mask=True,
        positions="shifted",
        bias=False,
        variants=(("gate", True), ("rope_theta", 10000.0), ("rope_fraction", 0.5), ("qk_norm", "head")),
    ),
    Case(  # Laguna's gate: softplus of its projection, no bias
        "laguna_like",
        k=2,
        self_attention=True,
        causal=True,
        query_mask=True,
        bias=False,
        variants=(("gate", True), ("gate_activation", "softplus"), ("rope_theta", 10000.0), ("qk_norm", "head")),
    ),
]


def _both_paths(case):
    """An MLA case on the expanded path and on the absorbed one (`<name>_absorbed`)."""
    return [case, dataclasses.replace(case, name=f"{case.name}_absorbed", absorb=True)]


MLA = (("kv_lora_rank", 8), ("qk_nope_head_dim", 4), ("qk_rope_head_dim", 4), ("v_head_dim", 6))
MLA_YARN_SCALING = {  # DeepSeek-V3's YaRN: mscale == mscale_all_dim, so the factor is 1 and the scale carries it
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
    "mscale": 1.0, "mscale_all_dim": 1.0,
}  # fmt: skip
# Multi-head latent attention (DeepSeek-V2/V3), each through the expanded and the absorbed path. They run in the
# parity report and test_parity; the TensorFlow and Keras columns say "not implemented" until those files have MLA
# (`calling.not_implemented`), so they are not in CASES, which the TensorFlow and Keras tests iterate.
MLA_CASES = [
    variant
    for case in (
        Case("mla_self_causal", self_attention=True, causal=True, variants=(*MLA, ("rope_theta", 10000.0))),
        Case(
            "mla_q_lora_yarn_interleaved",  # DeepSeek-V3: q_lora_rank, interleaved RoPE, YaRN's mscale in the scale
            self_attention=True,
            causal=True,
            query_mask=True,
            positions="shifted",
            bias=("query_a", "key_value_a", "output"),
            variants=(
                *MLA,
                ("q_lora_rank", 6),
                ("rope_theta", 10000.0),
                ("rope_interleaved", True),
                ("rope_scaling", MLA_YARN_SCALING),
                ("scale", (0.1 * math.log(4.0) + 1.0) ** 2 / math.sqrt(8)),
            ),
        ),
        Case("mla_cross_no_rope", t=4, s=6, kdim=10, mask="bool_bts", variants=MLA),  # key from another sequence
        Case(
            "mla_gqa_window_sinks_softcap",  # K < N latent heads, with every variant MLA allows
            k=2,
            self_attention=True,
            causal=True,
            attention_bias="bts",
            variants=(
                *MLA,
                ("q_lora_rank", 6),
                ("rope_theta", 100.0),
                ("window", 3),
                ("sinks", True),
                ("softcap", 5.0),
            ),
        ),
        Case(
            "mla_gate_deepseek",  # DeepSeek-shaped MLA with the output gate (N*Hv wide), K < N, every bias
            k=2,
            self_attention=True,
            causal=True,
            query_mask=True,
            variants=(*MLA, ("q_lora_rank", 6), ("rope_theta", 10000.0), ("rope_interleaved", True), ("gate", True)),
        ),
    )
    for variant in _both_paths(case)
]
# The sparse indexer (DSA) on MLA: k = 4 of 16 keys, so the selection matters. `mla_indexer` (DeepSeek-V3.2's shape:
# q_lora_rank, the indexer's RoPE half-split) runs expanded, `mla_indexer_interleaved` (GLM-MoE-DSA's interleaved
# indexer RoPE, no q_lora_rank, a key padding mask) absorbed. Their data keeps INDEX_MARGIN (`index_seed`).
INDEXER = (("index_topk", 4), ("index_num_heads", 2), ("index_head_dim", 8))
INTERLEAVED_INDEXED = (  # GLM-MoE-DSA's and Mistral Large 4's shape: interleaved RoPE and indexer RoPE, no q latent
    *MLA,
    ("rope_theta", 10000.0),
    ("rope_interleaved", True),
    ("index_topk", 4),
    ("index_num_heads", 3),
    ("index_head_dim", 6),
    ("index_rope_interleaved", True),
)
INDEX_CASES = [
    Case(
        "mla_indexer",
        t=16,
        s=16,
        self_attention=True,
        causal=True,
        variants=(*MLA, ("q_lora_rank", 6), ("rope_theta", 10000.0), *INDEXER),
    ),
    Case(
        "mla_indexer_interleaved",
        t=16,
        s=16,
        self_attention=True,
        causal=True,
        key_mask=True,
        absorb=True,
        variants=INTERLEAVED_INDEXED,
    ),
    Case(
        "mla_indexer_learned_scaling",  # Mistral Large 4: learned log-position query scales, the indexer's query norm
        t=16,
        s=16,
        self_attention=True,
        causal=True,
        positions="shifted",
        variants=(*INTERLEAVED_INDEXED, ("query_scaling", {"type": "learned"}), ("index_query_input_norm", True)),
    ),
]
# SPEC "Sparse indexer (DSA)", Rounding: each row's k-th and (k+1)-th allowed indexer scores differ by at least this
# fraction of the row's largest |score| (float64, NumPy), so that float32 frameworks select the same keys
INDEX_MARGIN = 1e-3
INDEX_SEEDS = 100  # seeds tried from the case's own before giving up
REPORT_CASES = [*CASES, *MLA_CASES, *INDEX_CASES]  # what the parity report runs
CASES_BY_NAME = {case.name: case for case in REPORT_CASES}


def _mask(case, rng):
    """The case's attention_mask as a NumPy array (bool or float32), or None."""
    b, n, t, s = case.b, case.n, case.t, case.s
    shapes = {
        "bool_ts": (t, s),
        "bool_bts": (b, t, s),
        "bool_bnts": (b, n, t, s),
        "bool_b1s": (b, 1, s),
        "bool_bn1s": (b, 1, 1, s),
        "rows_masked": (b, t, s),
        "batch_masked": (b, 1, s),
    }
    if case.mask == "none":
        return None
    if case.mask == "float64_far":
        mask = rng.normal(size=(b, t, s))
        mask = np.where(rng.random((b, t, s)) < 0.2, -1e300, mask)  # finite in float64, far below float32's range
        mask = np.where(rng.random((b, t, s)) < 0.2, np.finfo(np.float32).min, mask)  # as transformers builds masks
        mask[0, t // 2] = -1e39  # a row of penalties below float32's range: no key left
        return mask
    if case.mask == "float_penalty":
        mask = np.where(rng.random((b, t, s)) < 0.3, -1e9, rng.normal(size=(b, t, s))).astype(np.float32)
        mask[0, t // 2] = -1e9  # a row of finite penalties: an ordinary softmax
        return mask
    if case.mask.startswith("float"):
        shape = (t, s) if case.mask == "float_ts" else (b, t, s)
        added = rng.normal(size=shape).astype(np.float32)
        mask = np.where(rng.random(shape) < 0.3, -np.inf, added).astype(np.float32)
        if case.mask == "float_row_inf":
            mask[0, t // 2] = -np.inf  # the middle query of batch 0 keeps no key
            mask[-1, -1, ::2] = np.finfo(np.float32).min  # removes, as -inf does
        return mask
    keep = rng.random(shapes[case.mask]) < 0.7
    if case.mask == "rows_masked":
        keep[0, case.t // 2] = False  # the middle query of batch 0 keeps no key
        keep[-1, -1] = False  # neither does the last query of the last batch element
    if case.mask == "batch_masked":
        keep[-1] = False  # the last batch element keeps no key at all
        keep[:-1, :, 0] = True  # the others keep at least key 0
    return keep


def make_data(case, seed=0):
    """Seeded inputs, mask, upstream gradient and portable weights for one case.

    Returns a dict of NumPy arrays: `query`, `key`, `value` (None for self-attention),
    `attention_mask` (or None), `grad_output` and `weights` (a portable weight dict, float64
    values rounded to float32 so every framework starts from the same numbers).
    """
    from shared_tests import numpy_runner

    return draw_data(case, index_seed(case, seed, draw_data, numpy_runner.run) if indexed(case) else seed)


def draw_data(case, seed):
    """make_data's dict drawn from exactly this seed."""
    rng = np.random.default_rng([seed, sum(map(ord, case.name))])
    kdim, vdim = case.kdim or case.e, case.vdim or case.e
    query = rng.normal(scale=case.scale, size=(case.b, case.t, case.e))
    key = None if case.self_attention else rng.normal(scale=case.scale, size=(case.b, case.s, kdim))
    value = None if case.self_attention or case.mla else rng.normal(scale=case.scale, size=(case.b, case.s, vdim))
    return {
        "query": query.astype(np.float32),
        "key": None if key is None else key.astype(np.float32),
        "value": None if value is None else value.astype(np.float32),
        "attention_mask": _mask(case, rng),
        "grad_output": rng.normal(size=(case.b, case.t, case.e)).astype(np.float32),
        "weights": random_weights(case, rng),
        **_call_inputs(case, rng),
    }


def indexed(case):
    """Whether a case (or decode case) has the sparse indexer."""
    return "index_topk" in dict(case.variants)


def index_seed(case, seed, draw, run):
    """The first seed from `seed` on whose data (`draw(case, seed)`) every ranking the NumPy reference
    makes while `run(case, data)` keeps INDEX_MARGIN (docs/SPEC.md "Sparse indexer (DSA)", Rounding);
    a case with the indexer (`indexed`). Cached by the case's repr (its variants may hold a dict)."""
    key = (repr(case), seed, draw, run)
    if key not in _INDEX_SEEDS_FOUND:
        _INDEX_SEEDS_FOUND[key] = _first_index_seed(case, seed, draw, run)
    return _INDEX_SEEDS_FOUND[key]


_INDEX_SEEDS_FOUND = {}  # index_seed's cache


def _first_index_seed(case, seed, draw, run):
    for tried in range(seed, seed + INDEX_SEEDS):
        if all(index_margin(*ranking) >= INDEX_MARGIN for ranking in index_rankings(case, draw(case, tried), run)):
            return tried
    raise ValueError(f"no seed in [{seed}, {seed + INDEX_SEEDS}) keeps INDEX_MARGIN for case {case.name}")


def index_rankings(case, data, run):
    """(scores (B, T, S), allowed (B, T, S), k) of every top-k the NumPy reference ranks in `run(case, data)`."""
    from NumPy import Multi_Head_Attention as reference

    with mock.patch.object(reference, "_select_topk", wraps=reference._select_topk) as select:
        run(case, data)
    return [called.args for called in select.call_args_list]


def index_margin(scores, allowed, k):
    """The smallest gap, over the rows with more than k allowed keys, between the k-th and (k+1)-th
    allowed scores, as a fraction of the row's largest allowed |score| (inf without such a row;
    0 where that score is 0)."""
    ranked = -np.sort(-np.where(allowed, scores, np.finfo(scores.dtype).min), axis=-1)  # (B, T, S), highest first
    rows = allowed.sum(axis=-1) > k  # (B, T)
    if k >= scores.shape[-1] or not rows.any():
        return np.inf
    gap = (ranked[..., k - 1] - ranked[..., k])[rows]  # (rows,)
    largest = np.abs(np.where(allowed, scores, 0.0)).max(axis=-1)[rows]  # (rows,)
    return float(np.min(np.where(largest > 0, gap / np.where(largest > 0, largest, 1.0), 0.0)))


def _call_inputs(case, rng):
    """key_mask (B, S), query_mask (B, T), attention_bias and positions ((B, T) or (k, B, T)), or None each."""
    b, n, t, s = case.b, case.n, case.t, case.s
    key_mask = query_mask = attention_bias = positions = None
    if case.key_mask:
        key_mask = rng.random((b, s)) < 0.7
        key_mask[:-1, 0] = True  # every batch element but the last keeps key 0
        key_mask[-1] = False  # the last keeps no key
    if case.query_mask:
        query_mask = rng.random((b, t)) < 0.7
        query_mask[:, 0] = True
    if case.attention_bias != "none":
        shape = (1, n, t, s) if case.attention_bias == "1nts" else (b, t, s)
        attention_bias = rng.normal(size=shape).astype(np.float32)
        attention_bias[rng.random(shape) < 0.15] = -np.inf  # the floating mask rule applies to the bias too
    segments = _segments(case, rng)
    if case.positions == "shifted":
        positions = np.arange(t)[None, :] + rng.integers(0, 50, size=(b, 1))  # (B, T), each row its own offset
    if case.positions == "sections":
        k = len(dict(case.variants)["rope_sections"])
        positions = np.arange(t) + rng.integers(0, 50, size=(k, b, 1))  # (k, B, T), each section its own offsets
        positions[1:, :, 1:-1] = rng.integers(0, 8, size=(k - 1, b, t - 2))  # grid rows and columns inside
    called = {"key_mask": key_mask, "query_mask": query_mask, "attention_bias": attention_bias, "positions": positions}
    return {**called, **segments}


def _segments(case, rng):
    """Packed sequences: segment_ids (B, T) (and key_segment_ids (B, S) for `cross`), documents of
    random lengths back to back, their ids increasing in each row; {} without them."""
    if case.segments == "none":
        return {}
    b, t, s = case.b, case.t, case.s
    ids = np.sort(rng.integers(0, 3, size=(b, t)), axis=1)  # (B, T): up to 3 documents a row
    if case.segments == "packed":
        return {"segment_ids": ids, "key_segment_ids": None}
    return {"segment_ids": ids, "key_segment_ids": np.sort(rng.integers(0, 3, size=(b, s)), axis=1)}


_STARTING_AT_ONE = ("_norm", "_scaling_bias")  # vectors drawn near 1: norm scales, learned query scaling's biases


def random_weights(case, rng):
    """Portable weights with Glorot-scale kernels, non-zero biases and sink logits, and QK-norm
    scales near 1 (so a bug in any of them shows)."""
    from NumPy import MultiHeadAttention

    shapes = MultiHeadAttention(**case.config).weight_shapes()
    weights = {}
    for name, shape in shapes.items():
        scale = np.sqrt(2.0 / sum(shape)) if len(shape) == 2 else 1.0 if name == "sinks" else 0.1
        weights[name] = rng.normal(scale=scale, size=shape).astype(np.float32) + name.endswith(_STARTING_AT_ONE)
    return weights
