"""KV-cache decoding cases: the table, their data, and where each query may attend.

A decode case feeds P tokens to a layer in chunks (a prefill with T > 1, then T = 1 steps, or
any other split) through a cache of L slots; the same P tokens in one full causal pass must give
the same outputs and weights, and every framework must end with the same cache.

Legend: B batch, P tokens decoded in all, L cache slots, E d_model, N num_heads,
K num_kv_heads, H head_dim.
"""

import dataclasses

import numpy as np

from shared_tests.cases import (
    FP8_CACHE_TOLERANCES,
    INDEXER,
    INT8_CACHE_TOLERANCES,
    MLA,
    PROPORTIONAL_SCALING,
    TOLERANCES,
    Case,
    index_seed,
    indexed,
    random_weights,
)

# tf:in_place: a tf.function step over an in-place cache (`init_cache(..., in_place=True)`): tf.Variables written by
# each call, the step returning only its output and weights
DECODE_PATHS = ("numpy", "torch:sdpa", "torch:explicit", "tf:eager", "tf:function", "tf:in_place")


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One configuration, the chunks it is decoded in, and its masks."""

    name: str
    chunks: tuple = (4, 1, 1, 1)  # T of each call; P = sum(chunks)
    length: int = 10  # L, the cache's slots
    b: int = 2
    e: int = 16
    n: int = 4
    k: int | None = None
    h: int | None = None
    kdim: int | None = None  # set kdim or vdim to pass key and value apart from the query
    vdim: int | None = None
    bias: bool = True
    padding: tuple | None = None  # left padding of each batch element (prompts of different lengths)
    mask: str = "none"  # none, bool_btl, bool_bntl, float_tl: an attention_mask over (P, L)
    causal: bool = True
    dtype: str = "float32"
    variants: tuple = ()  # more constructor arguments as (name, value) pairs, as in Case
    positions: bool | str = False  # True: RoPE positions that skip the left padding (as transformers counts them);
    # "sections": those positions times 1, 2, ... k, one row per section of `rope_sections` (k, B, P)
    absorb: bool | None = None  # MLA: the layers' `absorb_latents` (None: absorbed, T <= 8 here; NumPy expands)
    cache_dtype: str | None = None  # `init_cache(..., dtype=...)`: "int8" or "float8_e4m3fn" for a scaled cache

    @property
    def p(self):
        return sum(self.chunks)

    @property
    def cross(self):
        return self.kdim is not None or self.vdim is not None

    config = Case.config  # the same constructor arguments from the same fields
    mla = Case.mla

    @property
    def tolerance(self):
        scaled = {"int8": INT8_CACHE_TOLERANCES, "float8_e4m3fn": FP8_CACHE_TOLERANCES}
        return scaled.get(self.cache_dtype, TOLERANCES[self.dtype])

    def spans(self):
        """(start, stop) of each chunk."""
        stops = np.cumsum(self.chunks)
        return list(zip(stops - self.chunks, stops, strict=True))


DECODE_CASES = [
    DecodeCase("decode_prefill_then_steps"),
    DecodeCase("decode_all_steps", chunks=(1,) * 7),
    DecodeCase("decode_one_prefill", chunks=(7,)),
    DecodeCase("decode_uneven_chunks", chunks=(3, 2, 1, 1), length=7),  # fills every slot
    DecodeCase("decode_gqa", k=2, chunks=(3, 2, 1, 1)),
    DecodeCase("decode_mqa", k=1),
    DecodeCase("decode_left_padding_gqa", k=2, padding=(0, 3), chunks=(5, 1, 1)),
    DecodeCase("decode_left_padding_steps", b=3, padding=(2, 0, 4), chunks=(1,) * 6),
    DecodeCase("decode_mask_bool_btl", mask="bool_btl", padding=(1, 0)),
    DecodeCase("decode_mask_bool_bntl", mask="bool_bntl", k=2),
    DecodeCase("decode_mask_float_tl", mask="float_tl", chunks=(3, 1, 1)),
    DecodeCase("decode_not_causal", causal=False, chunks=(3, 1, 1)),
    DecodeCase("decode_cross_widths", kdim=6, vdim=10, chunks=(2, 1, 1)),
    DecodeCase("decode_head_dim_no_bias", n=3, h=5, bias=False),
    DecodeCase("decode_b1", b=1, chunks=(2, 1, 1, 1)),
    DecodeCase("decode_float16", dtype="float16", k=2, padding=(0, 2)),
    DecodeCase("decode_rope", chunks=(3, 1, 1, 1), variants=(("rope_theta", 10000.0),)),
    DecodeCase(
        "decode_rope_left_padding",
        k=2,
        padding=(0, 3),
        chunks=(5, 1, 1),
        positions=True,
        variants=(("rope_theta", 10000.0), ("rope_fraction", 0.5)),
    ),
    DecodeCase(
        "decode_rope_proportional",  # Gemma 4's full layers: the last pairs of each head unturned
        e=32,
        k=2,
        padding=(0, 3),
        chunks=(5, 1, 1),
        positions=True,
        variants=(("rope_theta", 100.0), ("rope_scaling", PROPORTIONAL_SCALING)),
    ),
    DecodeCase("decode_window", chunks=(4, 1, 1, 1), variants=(("window", 3),)),
    # A rolling cache (window): positions past L overwrite slot p mod L; decoding past L tokens
    DecodeCase("decode_rolling_window", length=4, chunks=(2,) + (1,) * 7, variants=(("window", 3),)),
    DecodeCase("decode_rolling_l_equals_window", length=3, chunks=(1,) * 8, k=2, variants=(("window", 3),)),
    DecodeCase(
        "decode_rolling_rope_left_padding",
        length=5,
        k=2,
        padding=(0, 2),
        chunks=(3, 1, 2, 1, 1, 1),
        positions=True,
        variants=(("rope_theta", 10000.0), ("window", 3), ("sinks", True)),
    ),
    DecodeCase(
        "decode_all_variants",
        e=32,
        k=2,
        padding=(0, 2),
        chunks=(4, 1, 1, 1),
        positions=True,
        mask="bool_btl",
        variants=(
            ("rope_theta", 10000.0),
            ("qk_norm", "head"),
            ("softcap", 5.0),
            ("window", 3),
            ("sinks", True),
            ("scale", 0.3),
            ("clip_qkv", 0.8),
        ),
    ),
    DecodeCase("decode_clip_qkv", k=2, padding=(0, 2), chunks=(3, 1, 1, 1), variants=(("clip_qkv", 0.5),)),
    DecodeCase("decode_window_pair_not_causal", causal=False, chunks=(3, 1, 2, 1), variants=(("window", (3, 2)),)),
    DecodeCase("decode_rolling_window_pair", length=4, chunks=(2,) + (1,) * 6, k=2, variants=(("window", (3, 2)),)),
    DecodeCase(
        "decode_attention_chunk", k=2, padding=(0, 2), chunks=(3, 1, 1, 1, 1), variants=(("attention_chunk_size", 3),)
    ),
    DecodeCase(
        "decode_rope_sections",
        e=32,
        k=2,
        padding=(0, 2),
        chunks=(3, 1, 1, 1),
        positions="sections",
        variants=(("rope_theta", 10000.0), ("rope_sections", (2, 1, 1))),
    ),
    DecodeCase(
        "decode_qk_norm_layer",  # with Kosmos-2's output norm (a LayerNorm of the merged heads)
        k=2,
        chunks=(3, 1, 1),
        variants=(("qk_norm", "per_head"), ("qk_norm_type", "layer"), ("qk_norm_bias", True), ("output_norm", "layer")),
    ),
    DecodeCase(
        "decode_qk_norm_after_rope",  # HunYuan's order: RoPE, then QK-norm, before the cache write
        k=2,
        padding=(0, 2),
        chunks=(3, 1, 1),
        positions=True,
        variants=(("rope_theta", 100.0), ("qk_norm", "head"), ("qk_norm_after_rope", True)),
    ),
    DecodeCase("decode_gate", k=2, padding=(0, 2), chunks=(3, 1, 1, 1), variants=(("gate", True),)),
    # The int8 cache (rolling, left padding, GQA, RoPE), held to the SPEC's int8 cache bound
    DecodeCase(
        "decode_int8_cache",
        length=5,
        k=2,
        padding=(0, 2),
        chunks=(3, 1, 2, 1, 1, 1),
        positions=True,
        variants=(("rope_theta", 10000.0), ("window", 3)),
        cache_dtype="int8",
    ),
    DecodeCase(  # the fp8 cache likewise, held to the SPEC's fp8 cache bound
        "decode_fp8_cache",
        length=5,
        k=2,
        padding=(0, 2),
        chunks=(3, 1, 2, 1, 1, 1),
        positions=True,
        variants=(("rope_theta", 10000.0), ("window", 3)),
        cache_dtype="float8_e4m3fn",
    ),
    DecodeCase(
        "decode_query_scaling_temperature",  # Llama 4's NoPE layers: q times 1 + 0.5 ln(1 + floor((i + t + 1) / 2))
        k=2,
        padding=(0, 2),
        chunks=(3, 1, 1, 1),
        variants=(("query_scaling", {"type": "temperature", "beta": 0.5, "floor": 2}),),
    ),
    DecodeCase(
        "decode_value_norm",  # Gemma 3n's values (v_norm); keys as values in the parity table's gemma4_full_like
        k=2,
        padding=(0, 2),
        chunks=(3, 1, 1, 1),
        positions=True,
        variants=(("rope_theta", 10000.0), ("qk_norm", "head"), ("value_norm", True)),
    ),
    DecodeCase(
        "decode_gate_rope_rolling",
        length=4,
        chunks=(2,) + (1,) * 6,
        bias=False,
        variants=(("gate", True), ("gate_activation", "softplus"), ("rope_theta", 10000.0), ("window", 3)),
    ),
]

# MLA's latent cache (B, 1, L, C) and (B, 1, L, Hr), each case absorbed (the default at T <= 8) and expanded
# (`<name>_expanded`); like MLA_CASES, outside DECODE_CASES until the TensorFlow and Keras files have MLA.
MLA_DECODE_CASES = [
    variant
    for case in (
        DecodeCase(
            "decode_mla_left_padding",
            k=2,
            padding=(0, 3),
            chunks=(5, 1, 1),
            positions=True,
            variants=(*MLA, ("q_lora_rank", 6), ("rope_theta", 10000.0)),
        ),
        DecodeCase(
            "decode_mla_rolling_window",
            length=4,
            chunks=(2,) + (1,) * 7,
            variants=(*MLA, ("rope_theta", 10000.0), ("window", 3), ("sinks", True)),
        ),
        DecodeCase("decode_mla_cross", kdim=6, chunks=(2, 1, 1), mask="bool_btl", variants=MLA),  # key only
        DecodeCase(
            "decode_mla_gate",  # the gate (N*Hv wide) reads only the new queries; every bias, K < N
            k=2,
            padding=(0, 2),
            chunks=(3, 1, 1, 1),
            positions=True,
            variants=(*MLA, ("q_lora_rank", 6), ("rope_theta", 10000.0), ("gate", True)),
        ),
    )
    for variant in (case, dataclasses.replace(case, name=f"{case.name}_expanded", absorb=False))
]
# The sparse indexer's cache (`KVCache.index_key`, (B, L, Hi)): k = 4 of up to 10 slots, one case absorbed and one
# expanded, their data keeping INDEX_MARGIN at every step (`cases.index_seed`)
INDEX_DECODE_CASES = [
    DecodeCase(
        "decode_mla_indexer",
        chunks=(6, 1, 1, 1, 1),
        variants=(*MLA, ("q_lora_rank", 6), ("rope_theta", 10000.0), *INDEXER),
    ),
    DecodeCase(
        "decode_mla_indexer_interleaved",
        padding=(0, 3),
        chunks=(6, 1, 1, 1),
        positions=True,
        absorb=False,
        variants=(
            *MLA,
            ("rope_theta", 10000.0),
            ("rope_interleaved", True),
            ("index_topk", 4),
            ("index_num_heads", 3),
            ("index_head_dim", 6),
            ("index_rope_interleaved", True),
        ),
    ),
]
REPORT_DECODE_CASES = [*DECODE_CASES, *MLA_DECODE_CASES, *INDEX_DECODE_CASES]  # what the parity report runs
DECODE_CASES_BY_NAME = {case.name: case for case in REPORT_DECODE_CASES}


def _cache_keep(case):
    """(B, L) boolean: False at the left padding of each prompt."""
    keep = np.ones((case.b, case.length), dtype=bool)
    for row, pad in enumerate(case.padding or ()):
        keep[row, :pad] = False
    return keep


def _mask(case, rng):
    """The attention_mask over (P, L) slots, as a NumPy array, or None."""
    p, length = case.p, case.length
    if case.mask == "none":
        return None
    if case.mask == "float_tl":
        added = rng.normal(size=(p, length)).astype(np.float32)
        mask = np.where(rng.random((p, length)) < 0.3, -np.inf, added).astype(np.float32)
        mask[1] = -np.inf  # query 1 keeps no key
        return mask
    shape = (case.b, p, length) if case.mask == "bool_btl" else (case.b, case.n, p, length)
    keep = rng.random(shape) < 0.7
    keep[0, ..., 2, :] = False  # query 2 of batch 0 keeps no key
    return keep


def make_decode_data(case, seed=0):
    """Seeded inputs (B, P, E) (and key/value (B, P, kdim/vdim) for cross cases), the cache's
    keep, the attention_mask over (P, L) and portable weights."""
    from shared_tests import numpy_runner

    return _draw_decode(case, index_seed(case, seed, _draw_decode, numpy_runner.decode) if indexed(case) else seed)


def _draw_decode(case, seed):
    """make_decode_data's dict drawn from exactly this seed."""
    rng = np.random.default_rng([seed, sum(map(ord, case.name))])
    width = {"key": case.kdim or case.e, **({} if case.mla else {"value": case.vdim or case.e})}
    inputs = {"query": rng.normal(size=(case.b, case.p, case.e)).astype(np.float32)}
    if case.cross:
        inputs.update({name: rng.normal(size=(case.b, case.p, w)).astype(np.float32) for name, w in width.items()})
    return {
        "inputs": inputs,
        "keep": _cache_keep(case),
        "attention_mask": _mask(case, rng),
        "weights": random_weights(case, rng),
        "positions": _positions(case),
    }


def _positions(case):
    """(B, P) RoPE positions that start at 0 after each prompt's left padding, (k, B, P) with
    "sections", or None."""
    if not case.positions:
        return None
    pads = np.array(case.padding or (0,) * case.b)[:, None]  # (B, 1)
    positions = np.maximum(np.arange(case.p)[None, :] - pads, 0)  # (B, P)
    if case.positions != "sections":
        return positions
    k = len(dict(case.variants)["rope_sections"])
    return np.arange(1, k + 1)[:, None, None] * positions  # (k, B, P), each section its own positions
