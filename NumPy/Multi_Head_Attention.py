"""Multi-head attention: the float64 NumPy reference, with an explicit backward.

Copy this one file into your project; it needs only NumPy and the standard library. It is the
oracle the PyTorch, TensorFlow and Keras layers are judged by, following docs/SPEC.md step by
step, one operation per line, so a student can check it by hand.

Legend (every shape comment in this file uses these letters):
    B: batch size          T: query length        S: key/value length
    E: d_model             N: num_heads           K: num_kv_heads
    H: head_dim            L: slots of a KV cache (its maximum length)
    R: the features of a head that RoPE rotates
    MLA (multi-head latent attention): C kv_lora_rank, Q q_lora_rank, Hn qk_nope_head_dim,
    Hr qk_rope_head_dim, Hv v_head_dim (H = Hn + Hr)

The math, for query head n (which reads key/value head n // (N // K)):
    q = query @ query_kernel + query_bias                       (B, T, N*H)
    k = key @ key_kernel + key_bias                             (B, S, K*H)
    v = value @ value_kernel + value_bias                       (B, S, K*H)
    scores[n] = q[n] @ k[n // G]^T * scale + float_mask         (B, N, T, S), G = N // K
    weights = softmax(scores where kept, else lowest finite)    zeroed where not kept
    context[n] = weights[n] @ v[n // G]                         (B, N, T, H)
    gate = sigmoid(query @ gate_kernel + gate_bias)             (B, T, N*H), with `gate` only
                                                                (softplus with gate_activation="softplus")
    output = concat_heads(context * gate) @ output_kernel + output_bias

Where things are: first the core, the plain layer: the functions a plain call enters (`dot_product_attention`
among them), then `MultiHeadAttention`, whose `__call__` reads as the steps of docs/SPEC.md ("Order of
the steps"), each option's step behind a one-line guard; then one section per option family, in this order:
    backward                            `backward`, the gradients of the last call
    score modifiers                     scale, softcap, window, chunk, sinks, ALiBi, attention bias;
                                        the masks (`causal_mask`, ...) and segment ids combined into keep and bias
    positions                           RoPE (frequencies, scaling, multimodal sections)
    QK-norm, clip_qkv and the gate
    KV cache and decode steps           `KVCache`, `init_cache`, the cache's checks and writes
    multi-head latent attention         MLA: checks, weights, latent projection, expand or absorb
    speed paths                         (none: the reference computes every case explicitly)
    int8                                `quantize`, Keras' int8 scheme by hand
    framework only                      the shared checks, the variants' record, the mask habits
    converters                          the portable weight layout (`import_weights`)
"""

import copy
import math
import sys
import warnings
from typing import NamedTuple

import numpy as np

__all__ = ["AttentionMaskWarning", "KVCache", "MultiHeadAttention", "alibi_bias", "document_positions"]
__all__ += ["dot_product_attention", "segment_ids_from_cu_seqlens", "segment_ids_from_position_ids"]

_PROJECTIONS = ("query", "key", "value", "output", "gate")  # the names `bias` takes; "gate" only with `gate`


# -------------------------------------------------------------------------------------------------
# Core: the plain layer
# -------------------------------------------------------------------------------------------------
# The functions a plain call enters, then the class; each option's code is in its section below.


class AttentionMaskWarning(UserWarning):
    """A mask whose values read like another library's convention (nn.MultiheadAttention's True =
    ignore, Keras' 0/1 floats): the layer computes what docs/SPEC.md says all the same, and warns
    once per layer. `warnings.simplefilter("error", AttentionMaskWarning)` makes it an error."""


class _Call(NamedTuple):
    """A call's arguments after `_check_call`: checked, defaulted, cast to float64."""

    query: np.ndarray  # (B, T, E)
    key: np.ndarray  # (B, S, kdim)
    value: np.ndarray  # (B, S, vdim)
    attention_mask: np.ndarray | None  # after the `mask=` alias, made rank 4 by `_mask_to_4d`
    attention_bias: np.ndarray | None  # made rank 4 by `_mask_to_4d`
    key_mask: np.ndarray | None  # (B, S), after the self-attention default
    query_mask: np.ndarray | None  # (B, T)
    positions: np.ndarray | None  # (B, T) integers ((k, B, T) with rope_sections), None without RoPE
    causal: bool  # the cache step replaces it by False once folded into keep
    window: int | tuple[int, int] | None  # self.window; the cache step replaces it by None once folded into keep
    attention_chunk_size: int | None  # self.attention_chunk_size; likewise replaced by None in the cache step
    return_attention: bool
    cache: "KVCache | None"  # the cache step replaces it by the written cache
    training: None  # TF/Keras only
    fuse: bool  # False: the reference projects q, k and v one at a time
    segmented: bool = False  # packed sequences: the ids folded into attention_mask (`_packed`)
    segments: None = None  # PyTorch, TensorFlow and Keras only: packed ids their paths read (here always folded)
    selection: np.ndarray | None = None  # the sparse indexer's gathered route (PyTorch); the reference masks


def _check_input(name, x, width_name, width):
    """Checks one (B, L, width) input and returns it as an array."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"`{name}` must be a floating tensor. Received: {name}.dtype={x.dtype.name}")
    letter = "T" if name == "query" else "S"
    if x.ndim != 3 or x.shape[-1] != width:
        raise ValueError(
            f"`{name}` must have shape (B, {letter}, {width_name}) with {width_name}={width}. "
            f"Received: {name}.shape={tuple(x.shape)}"
        )
    return x


def dot_product_attention(
    q, k, v, keep=None, bias=None, causal=False, *, scale=None, softcap=None, window=None, attention_chunk_size=None,
    sinks=None,
):  # fmt: skip
    """Pure attention on split heads, q (B, N, T, H), k and v (B, K, S, H) with K dividing N:
    returns context (B, N, T, H) and weights (B, N, T, S), exactly 0 where not kept. `keep` (True
    = attend) and `bias` (float, added to the soft-capped scores) broadcast to (B, N, T, S);
    `scale` defaults to 1 / sqrt(H); `causal` and the score modifiers (`softcap`, `window`,
    `attention_chunk_size`, (N,) `sinks`) act as the layer's arguments of those names."""
    t, s = q.shape[2], k.shape[2]
    keep = np.ones((1, 1, t, s), dtype=bool) if keep is None else keep  # (B, N, T, S), dims may be 1
    if causal or window is not None or attention_chunk_size is not None:
        keep = _full_keep(keep, t, s, causal, window, attention_chunk_size)
    groups = q.shape[1] // k.shape[1]
    k = np.repeat(k, groups, axis=1)  # (B, K, S, H) -> (B, N, S, H)
    v = np.repeat(v, groups, axis=1)  # (B, K, S, H) -> (B, N, S, H)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.swapaxes(-1, -2) * scale  # (B, N, T, S)
    scores = scores if softcap is None else _softcap(scores, softcap)
    bias = bias if bias is None or sinks is not None else _centre_rows(bias, keep)  # with sinks the level matters
    scores = scores if bias is None else scores + bias  # (B, N, T, S)
    weights = _masked_softmax(scores, keep, sinks)  # (B, N, T, S)
    return weights @ v, weights  # (B, N, T, S) @ (B, N, S, H) -> (B, N, T, H)


def _masked_softmax(scores, keep, sinks=None):
    """Softmax over S (with one `sinks` logit per head in its denominator) with every position not
    kept at weight exactly 0 (rows with no key are all 0)."""
    lowest = np.finfo(scores.dtype).min
    scores = np.where(keep, scores, lowest)  # (B, N, T, S)
    top = scores.max(axis=-1, keepdims=True, initial=lowest)  # (B, N, T, 1); `initial`: S may be 0
    sink = None if sinks is None else sinks[None, :, None, None]  # (1, N, 1, 1)
    top = top if sink is None else np.maximum(top, sink)
    exp = np.exp(scores - top)  # (B, N, T, S)
    total = exp.sum(axis=-1, keepdims=True)  # (B, N, T, 1)
    total = total if sink is None else total + np.exp(sink - top)  # the sink joins the denominator
    return np.where(keep, exp / total, 0.0)  # (B, N, T, S), rows with no key are all 0


class MultiHeadAttention:
    """Multi-head attention (MHA, grouped-query GQA and multi-query MQA), NumPy float64.

    Args:
        d_model: E, the width of `query` and of the output.
        num_heads: N, the number of query heads.
        num_kv_heads: K, the number of key/value heads; must divide N. Defaults to N.
        head_dim: H, the width of one head. Defaults to E // N (then N must divide E).
        kdim: width of `key`. Defaults to E.
        vdim: width of `value`. Defaults to E.
        dropout: must be 0: the reference has no dropout.
        bias: True (all the projections have a bias, the gate's with `gate`), False (none), or a
            list, tuple or set of the names of those that have one, among "query", "key", "value",
            "output", "gate" (Qwen2: ("query", "key", "value")). Kept as that tuple of names, in
            that order.
        scale: the factor of the scores q . k; defaults to 1 / sqrt(H).
        softcap: None, or c: scores become c * tanh(scores / c) (Gemma 2).
        window: None, W, or a pair (W_before, W_after): query t keeps key s only if
            s > t + (S - T) - W_before, and with a pair also s < t + (S - T) + W_after
            (Mistral's sliding window: W; ModernBERT's two-sided band: (65, 65)).
        attention_chunk_size: None, or C: query t keeps key s only if both are in the same
            chunk of C positions, s // C == (t + (S - T)) // C (Llama 4's chunked attention).
        rope_theta: None (no RoPE), or the base of rotary position embeddings (e.g. 10000.0).
        rope_fraction: the share of each head's features that RoPE rotates (partial rotary).
        rope_interleaved: pair features (2i, 2i + 1) (GPT-J) instead of (i, i + R/2) (Llama).
        rope_scaling: None, or a dict {"rope_type": "linear", "llama3", "yarn" or "proportional", ...} as in
            transformers; YaRN also multiplies the rotated features of q and k by its attention factor.
        rope_sections: None, or the numbers of rotated pairs (summing to R/2) that turn by each
            row of (k, B, T) `positions` in turn (Qwen2-VL's multimodal RoPE, `mrope_section`).
        rope_sections_interleaved: if True, the sections' pairs are dealt in turn (Qwen3-VL's
            `mrope_interleaved`): pair i by row i % k while i < k * rope_sections[i % k], else row 0.
        qk_norm: None, "head" (each head of q and k normalized, one scale shared by the heads:
            Qwen3), "per_head" (each head with its own scale: StableLM, Cohere) or "all" (over all
            heads: OLMo2); its scales are the weights `query_norm` and `key_norm`.
        qk_norm_eps: the epsilon of that norm.
        qk_norm_type: "rms" (RMSNorm) or "layer" (LayerNorm: the mean is removed first).
        qk_norm_bias: if True, the norm adds a learned bias after its scale (`query_norm_bias`,
            `key_norm_bias`: Phi's LayerNorm).
        sinks: if True, one learned logit per head (weight `sinks`) joins the softmax's
            denominator (gpt-oss).
        clip_qkv: None, or c: q, k and v are clamped to [-c, c] right after their projections
            (bias included), before QK-norm, RoPE and the cache (OLMo, DBRX, MPT).
        gate: if True, each head's attention result is multiplied, feature by feature, by
            sigmoid(query @ gate_kernel + gate_bias) before the heads are merged (Keras'
            `use_gate`, Qwen3-Next, Qwen3.5).
        gate_activation: "sigmoid" (default) or "softplus" (Laguna): the gate's function of its projection.
        kv_lora_rank: None, or C: multi-head latent attention (MLA, DeepSeek-V2/V3): keys and
            values come from one latent c = RMSNorm(first C features of key @ key_value_a_kernel)
            per token, expanded per head by `key_value_b_kernel`; the cache holds c and the
            shared turned key part (see `init_cache`).
        q_lora_rank: None (a plain query projection), or Q: with MLA, q = RMSNorm(query @
            query_a_kernel) @ query_b_kernel.
        qk_nope_head_dim: Hn, with MLA the features of a query/key head RoPE does not turn.
        qk_rope_head_dim: Hr, with MLA the features RoPE turns (one key part shared by the heads);
            H = Hn + Hr.
        v_head_dim: Hv, with MLA the width of a value head (the output kernel is (N*Hv, E)).
        latent_norm_eps: the epsilon of MLA's RMSNorms of the latents.
        index_topk, index_num_heads, index_head_dim, index_rope_interleaved: the sparse indexer (DSA,
            with MLA): each query attends its top-k keys by the indexer's Ni heads of width Hi.
        index_query_input_norm: if True, the indexer's queries read a LayerNorm of their input (Mistral Large 4).
        seed: seed for the Glorot uniform initialisation of the kernels (biases start at 0).
        query_scaling: None, or {"type": "temperature" or "positions", "beta": b, "floor": f}: each
            query row times 1 + b * ln(1 + floor(p / f)) (Llama 4's temperature tuning, Mistral 4's
            `llama_4_scaling_beta`), or {"type": "learned"}: query head n times s_n * ln(1 + p) + b_n,
            learned (Mistral Large 4's `softmax_scaling`; the section "positions").
        kv_shared: if True, the layer has no key or value projections: every call takes another
            layer's keys and values through `shared_kv` (Gemma 3n's and Gemma 4's shared layers).
        keys_as_values: if True, no value projection: v is the key projection before QK-norm and RoPE (Gemma 4).
        value_norm: if True, each value head is RMS-normalized without a scale (eps `qk_norm_eps`; Gemma 3n, 4).
        output_norm, output_norm_eps: None, "rms" or "layer": a norm of the merged heads before the output
            projection (weights `context_norm`, and `context_norm_bias` with "layer"; BitNet, Kosmos-2).
        qk_norm_after_rope: if True, QK-norm normalizes q and k after RoPE instead of before (HunYuan).

    Call arguments:
        query: (B, T, E).
        key: (B, S, kdim). Defaults to `value`, or to `query` if `value` is None too.
        value: (B, S, vdim). Defaults to `key`.
        attention_mask: boolean (True = attend) or floating (added to the scores), of shape
            (T, S), (B, T, S) or (B, N, T, S), any dimension of which may be 1.
        key_mask: (B, S) boolean, True for a real key (with `cache`: (B, T), the new tokens).
            In self-attention it defaults to `query_mask`.
        query_mask: (B, T) boolean, True for a real query; other rows output `output_bias`.
        attention_bias: floating, shaped like `attention_mask`, added to the scores (T5's
            relative position bias, ALiBi); it has a gradient.
        positions: integer (B, T) or (T,) RoPE positions, or (k, B, T) with `rope_sections`; default
            arange(T) (+ the cache index).
        causal: if True, query t attends key s only if s <= t + (S - T).
        return_attention: if True, also return the per-head attention weights.
        cache: a `KVCache` from `init_cache`: decode T new tokens (`key` and `value`, if
            given, hold the same T tokens); masks and weights are then over the L slots.
        mask: another name for `attention_mask` (the call `layer(query, key, value, mask=None)`);
            giving both is a ValueError. Masks whose values read like another library's
            convention warn once per layer with `AttentionMaskWarning` and compute as given.
        shared_kv: with `kv_shared`, a (k, v) pair of (B, K, S, H) keys and values another layer
            attended (its `return_kv`), or that layer's `KVCache` once it wrote this call's T tokens.
        return_kv: if True, also return the (k, v) the call attended (over the L slots with a cache).
        topk_indices, return_topk: another layer's (B, T, k) selection to attend; return the one used.

    Returns:
        output (B, T, E), or (output, weights) with weights (B, N, T, S) when
        `return_attention` is True; with `cache`, the updated cache is appended and weights
        are (B, N, T, L), exactly 0 at unwritten slots; `return_topk` puts the selection before it.
        With `return_kv`, the (k, v) pair is appended last; a shared cache is read, not returned.

    Coming from `nn.MultiheadAttention`: a boolean mask here is True where a query may attend
    (there True means "ignore": pass `~attn_mask`, and `key_mask=~key_padding_mask`);
    `need_weights=True, average_attn_weights=False` is `return_attention=True`; `is_causal=True`
    is `causal=True` (bottom-right aligned when T < S); inputs are batch first.

    Example, a key padding mask (the third key of the first sequence is padding):
        >>> layer = MultiHeadAttention(16, 4, seed=0)
        >>> x = np.random.default_rng(0).normal(size=(2, 3, 16))  # (B, T, E)
        >>> keep = np.array([[True, True, False], [True, True, True]])  # (B, S)
        >>> out, weights = layer(x, key_mask=keep, return_attention=True)
        >>> out.shape, weights.shape
        ((2, 3, 16), (2, 4, 3, 3))
        >>> bool((weights[0, :, :, 2] == 0).all())
        True
    """

    def __init__(
        self, d_model, num_heads, *, num_kv_heads=None, head_dim=None, kdim=None, vdim=None, dropout=0.0, bias=True,
        scale=None, softcap=None, window=None, attention_chunk_size=None, rope_theta=None, rope_fraction=1.0,
        rope_interleaved=False, rope_scaling=None, rope_sections=None, qk_norm=None, qk_norm_eps=1e-6,
        qk_norm_type="rms", qk_norm_bias=False, sinks=False, clip_qkv=None, gate=False, kv_lora_rank=None,
        q_lora_rank=None, qk_nope_head_dim=None, qk_rope_head_dim=None, v_head_dim=None, latent_norm_eps=1e-6,
        seed=None, query_scaling=None, kv_shared=False, keys_as_values=False, value_norm=False, index_topk=None,
        index_num_heads=None, index_head_dim=None, index_rope_interleaved=False, index_query_input_norm=False,
        rope_sections_interleaved=False, output_norm=None, output_norm_eps=1e-6, qk_norm_after_rope=False,
        gate_activation="sigmoid",
    ):  # fmt: skip
        self.d_model = _positive_int("d_model", d_model)
        self.num_heads = _positive_int("num_heads", num_heads)
        self.num_kv_heads = _positive_int("num_kv_heads", num_heads if num_kv_heads is None else num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"`num_kv_heads` must divide `num_heads`. Received: num_heads={num_heads}, num_kv_heads={num_kv_heads}"
            )
        self._latent = latent = _check_latent(kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
        for name in _LATENT_SIZES:
            setattr(self, name, None if latent is None else getattr(latent, name))  # self.kv_lora_rank, ...
        if latent is not None:
            head_dim = _latent_head_dim(latent, head_dim)
        elif head_dim is None and self.d_model % self.num_heads:
            raise ValueError(f"`num_heads` must divide `d_model`. Received: d_model={d_model}, num_heads={num_heads}")
        self.head_dim = _positive_int("head_dim", self.d_model // self.num_heads if head_dim is None else head_dim)
        self.kdim = _positive_int("kdim", self.d_model if kdim is None else kdim)
        self.vdim = _positive_int("vdim", self.d_model if vdim is None else vdim)
        if _dropout_rate(dropout) != 0.0:
            raise ValueError(f"`dropout` must be 0: the NumPy reference has no dropout. Received: dropout={dropout!r}")
        self.dropout = 0.0
        self.bias = _projection_biases(bias, gate, _projections(latent))
        rope_width = self.head_dim if latent is None else latent.qk_rope_head_dim
        modifiers = _check_score_modifiers(self.head_dim, scale, softcap, window, attention_chunk_size)
        rope = _check_rope(rope_width, rope_theta, rope_fraction, rope_scaling, rope_sections)
        norms = _check_norms(qk_norm, qk_norm_eps, qk_norm_type, clip_qkv)
        latent_norm_eps = _positive_float("latent_norm_eps", latent_norm_eps)
        flags = {"rope_interleaved": rope_interleaved, "qk_norm_bias": qk_norm_bias, "sinks": sinks, "gate": gate}
        flags = {name: _flag(name, value) for name, value in flags.items()}  # checked last, in this order
        variants = _Variants(**modifiers, **rope, **norms, **flags, latent_norm_eps=latent_norm_eps)
        for name, value in variants._asdict().items():
            setattr(self, name, value)  # self.scale, self.softcap, ..., self.sinks, self.clip_qkv, self.gate
        self._cache_layout = (self.num_kv_heads, self.head_dim, self.head_dim)  # a KVCache's heads and widths
        self.query_scaling = _check_query_scaling(query_scaling, self.rope_sections)  # its section: positions
        if latent is not None:
            _check_latent_combinations(vdim, variants)
            self.vdim = self.kdim  # the values come from `key`
            self._cache_layout = _latent_cache_layout(latent)  # (1, C, Hr)
        self.absorb_latents = None  # MLA: None (absorbed with a cache and T <= 8), True or False
        _check_sharing(self, latent, kv_shared, keys_as_values, value_norm)  # self.kv_shared, ... (their section)
        self._float_layout = _float_shapes(self) if latent is None else _latent_shapes(self)  # {name: shape}
        _init_indexer(self, index_topk, index_num_heads, index_head_dim, index_rope_interleaved, index_query_input_norm)
        _init_rope(self, rope_width, rope_fraction, rope_sections_interleaved)  # self._inv_freq, ... (positions)
        _init_norm_options(self, output_norm, output_norm_eps, qk_norm_after_rope)  # section: QK-norm
        self.gate_activation = _check_gate_activation(gate_activation)  # its section: the gate
        rng = np.random.default_rng(seed)
        self.params = {}  # `weight_shapes` reads it (int8)
        self.params.update({name: _initial_value(rng, name, shape) for name, shape in self.weight_shapes().items()})
        self._saved, self._warned_traps = None, set()  # what `backward` needs from the last call; habits warned of

    # The steps of a call (docs/SPEC.md, "Order of the steps"), one line each in `__call__` (2 to 4 in
    # `_project_qkv`), each option behind a one-line guard (its functions are in its section):
    #     1. defaults and checks; masks combined into one boolean `keep` and one additive `bias`
    #     2. projections          3. QK-norm of q and k        4. RoPE of q and k at `positions`
    #     5. cache write          6. scores * scale, soft-capping, + bias, keys removed by keep,
    #                                causal, window and chunk, softmax with the sinks, weighted sum of v
    #     6b. output gate         7. heads merged (their norm with `output_norm`) and the output projection
    def __call__(
        self, query, key=None, value=None, attention_mask=None, *, key_mask=None, query_mask=None,
        attention_bias=None, positions=None, causal=False, return_attention=False, cache=None, mask=None,
        segment_ids=None, key_segment_ids=None, shared_kv=None, return_kv=False, topk_indices=None, return_topk=False,
    ):  # fmt: skip
        cache = cache if shared_kv is None else _shared_cache(self, query, cache, shared_kv)  # rewound to check
        call = self._check_call(
            query, key, value, attention_mask, key_mask, query_mask, attention_bias, positions, causal,
            return_attention, cache, mask,
        )  # 1. defaults and checks  # fmt: skip
        call = call if segment_ids is None is key_segment_ids else _packed(self, call, segment_ids, key_segment_ids)
        masks = (call.attention_mask, call.attention_bias, call.key_mask, call.query_mask)
        keep, bias = self._masks(call) if any(m is not None for m in masks) else (None, None)  # 1. keep and bias
        q, k, v = self._project_qkv(call) if not self._sharing else _project_sharing(self, call, shared_kv)  # 2-4.
        if call.cache is not None:
            k, v, keep, call = _update_cache(self, call, k, v, keep)  # 5. KV cache, keep over its L slots
        sparse = (topk_indices, return_topk) if self.index_topk or topk_indices is not None or return_topk else ()
        keep, call, selection = _sparse_keep(self, q, k, keep, call, *sparse) if sparse else (keep, call, None)  # 5b.
        attend = self._attend if self._latent is None else lambda *args: _attend_latent(self, *args)  # MLA: 6.
        context, weights = attend(q, k, v, keep, bias, call)  # 6. (B, N, T, H), (B, N, T, S)
        gated, gate = (context, None) if not self.gate else _gate_heads(self, call, context)  # 6b. output gate
        merged = self._merge_heads(gated)  # 7. (B, N, T, H) -> (B, T, N*H)
        merged = merged if self.output_norm is None else _normalize_context(self, merged)  # 7. the output norm
        output = self._project(merged, "output")  # 7. (B, T, N*H) -> (B, T, E)
        saved = dict(call=call, no_key=key is None, no_value=value is None, given_bias=attention_bias, q=q, k=k, v=v)
        saved.update(keep=keep, weights=weights, context=context, gate=gate, merged=merged)
        self._saved = None if call.cache is not None else saved  # what `backward` reads (its section)
        cache = call.cache if not self.kv_shared else None  # a shared cache is not returned
        if call.return_attention or cache is not None or return_kv or selection is not None:
            return _results(output, weights, cache, call.return_attention, (k, v) if return_kv else None, selection)
        return output

    def _check_call(
        self, query, key, value, attention_mask, key_mask, query_mask, attention_bias, positions, causal,
        return_attention, cache, mask,
    ):  # fmt: skip
        """Step 1 but the masks' combination: every check and default, the cast to float64, the
        positions (RoPE's section), the cache's checks (its section) and the habit warnings."""
        attention_mask = attention_mask if mask is None else _attention_mask(attention_mask, mask)
        self_attention = key is None and value is None
        key = (query if value is None else value) if key is None else key  # a missing key: value, else query
        value = key if value is None else value  # a missing value: key
        if self._latent is not None and value is not key:
            _refuse_latent_value()  # MLA reads keys and values from `key`
        query = _check_input("query", query, "E", self.d_model)
        key = _check_input("key", key, "kdim", self.kdim)
        value = _check_input("value", value, "vdim", self.vdim)
        if not query.shape[0] == key.shape[0] == value.shape[0] or key.shape[1] != value.shape[1]:
            raise _lengths_error(query, key, value)
        if len({query.dtype, key.dtype, value.dtype}) > 1:
            raise _dtypes_error(query, key, value)
        query, key, value = (x.astype(np.float64) for x in (query, key, value))
        (b, t, _), s = query.shape, key.shape[1]
        query_mask = None if query_mask is None else _check_token_mask("query_mask", query_mask, b, t, "T")
        explicit_key_mask = None if key_mask is None else _check_token_mask("key_mask", key_mask, b, s, "S")
        key_mask = query_mask if explicit_key_mask is None and self_attention else explicit_key_mask
        s = s if cache is None else _check_cache(cache, query, key, self.num_kv_heads, self.head_dim, self._latent)
        if positions is not None or self.rope_theta is not None:
            positions = _positions(self, positions, query, key, cache)
        target = (b, self.num_heads, t, s)
        attention_mask = None if attention_mask is None else _mask_to_4d(attention_mask, target)
        attention_bias = None if attention_bias is None else _mask_to_4d(attention_bias, target, "attention_bias")
        if cache is None and (attention_mask is not None or explicit_key_mask is not None):
            _warn_traps(self, attention_mask, explicit_key_mask, t, s)
        return _Call(
            query, key, value, attention_mask, attention_bias, key_mask, query_mask, positions, causal, self.window,
            self.attention_chunk_size, return_attention, cache, None, False,
        )  # fmt: skip

    def _masks(self, call):
        """Step 1: one boolean keep and one float64 bias, each None or (B|1, N|1, T|1, S|1); with a
        cache `key_mask` goes into the cache's keep instead (step 5)."""
        keep = bias = None
        if call.attention_mask is not None:
            keep, bias = _split_mask(call.attention_mask)
        if call.attention_bias is not None:
            bias_keep, attention_bias = _split_mask(call.attention_bias)
            keep, bias = _and(keep, bias_keep), _add(bias, attention_bias)
        if call.query_mask is not None:
            keep = _and(keep, call.query_mask[:, None, :, None])  # (B, T) -> (B, 1, T, 1)
        if call.key_mask is not None and call.cache is None:
            keep = _and(keep, call.key_mask[:, None, None, :])  # (B, S) -> (B, 1, 1, S)
        return keep, bias

    def _project_qkv(self, call):
        """Steps 2 to 4: q (B, N, T, H), k and v (B, K, S, H), each with its bias if it has one
        (clamped by `clip_qkv`), QK-norm and RoPE of q and k; MLA's in its section."""
        if self._latent is not None:
            return _project_latent(self, call)  # q, the latents and k_rope in k's and v's places
        q = self._project(call.query, "query")  # 2. (B, T, E) -> (B, T, N*H)
        k = self._project(call.key, "key")  # 2. (B, S, kdim) -> (B, S, K*H)
        v = self._project(call.value, "value")  # 2. (B, S, vdim) -> (B, S, K*H)
        if self.clip_qkv is not None:
            q, k, v = (_clip(self, y) for y in (q, k, v))
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
        if self.qk_norm is not None and not self._qk_norm_late:
            q, k = _normalize_qk(self, q, k)  # 3. QK-norm (in step 4 after RoPE with `qk_norm_after_rope`)
        if self.rope_theta is not None or self.query_scaling is not None:
            q, k = _position_step(self, q, k, call)  # 4. RoPE, 4b. each query row times its scale
        return q, k, v

    def _project(self, x, kind):
        """(B, L, D) -> (B, L, heads*H): one projection (int8: its section), with its bias if it has one."""
        kernel, kernel_scale = self.params[f"{kind}_kernel"], self.params.get(f"{kind}_kernel_scale")
        y = x @ kernel if kernel_scale is None else _int8_matmul(x, kernel, kernel_scale)  # (B, L, heads*H)
        return y + self.params[f"{kind}_bias"] if kind in self.bias else y

    def _split_heads(self, y):
        """(B, L, heads*H) -> (B, heads, L, H)."""
        b, length, width = y.shape
        return y.reshape(b, length, width // self.head_dim, self.head_dim).transpose(0, 2, 1, 3)

    def _merge_heads(self, x):
        """(B, heads, L, H) -> (B, L, heads*H)."""
        b, heads, length, h = x.shape
        return x.transpose(0, 2, 1, 3).reshape(b, length, heads * h)

    def _attend(self, q, k, v, keep, bias, call):
        """Step 6 on split heads: `dot_product_attention` with the layer's variants."""
        return dot_product_attention(
            q, k, v, keep, bias, call.causal, scale=self.scale, softcap=self.softcap, window=call.window,
            attention_chunk_size=call.attention_chunk_size, sinks=self.params.get("sinks"),
        )  # fmt: skip

    def weight_shapes(self):
        """The portable layout: {name: shape}; biases of the projections in `bias`, the norm
        scales with `qk_norm` (and their biases with `qk_norm_bias`), `sinks` with sinks, the gate's
        kernel with `gate`; with MLA the latent projections and norms instead of the key and value
        projections."""
        shapes = dict(self._float_layout)
        return _with_scales(shapes) if self.quantization_mode == "int8" else shapes

    def export_weights(self):
        """Returns the portable weights: a dict of float64 arrays (see docs/SPEC.md); once
        quantized, the kernels are int8 and each has its float32 `<kind>_kernel_scale`."""
        return {name: value.copy() for name, value in self.params.items()}

    def import_weights(self, weights):
        """Loads portable weights; strict and atomic (a ValueError lists every problem). An int8
        layout (with `<kind>_kernel_scale`) quantizes a float layer; an int8 layer takes only one."""
        _import_weights(self, weights)

    def quantize(self, mode):
        """Quantizes the projections' kernels (the gate's too with `gate`) to int8 with one float32
        scale per output column (Keras' scheme, docs/SPEC.md "int8"); each call then quantizes the
        projections' inputs per token. The quantized layer has no `backward`.

        Args:
            mode: "int8", the only mode.
        """
        _quantize(self, mode)

    @property
    def quantization_mode(self):
        """ "int8" once `quantize("int8")` (or an int8 `import_weights`) quantized the projections, else None."""
        return "int8" if "output_kernel_scale" in self.params else None

    def init_cache(self, batch_size, max_length, *, keep=None, dtype=None):
        """An empty `KVCache` for decoding `batch_size` sequences of up to `max_length` tokens.

        Args:
            batch_size: B.
            max_length: L, the number of slots.
            keep: (B, L) boolean, False for slots no query may attend (left padding of prompts
                of different lengths). Defaults to all True.
            dtype: dtype of the keys and values; defaults to the compute dtype, float64.
                "int8": an int8 cache, integers with a float32 scale per slot and head;
                "float8_e4m3fn": an fp8 cache, likewise scaled (its e4m3fn codes held as uint8).

        Returns:
            A `KVCache` of zeros with index 0: keys and values (B, K, L, H); with MLA the latent
            cache, latents (B, 1, L, C) in `key` and turned shared key parts (B, 1, L, Hr) in `value`.
        """
        return _init_cache(self, batch_size, max_length, keep, dtype)

    def backward(self, grad_output):
        """Gradients of sum(output * grad_output) after the last call.

        Args:
            grad_output: (B, T, E), the upstream gradient of the output.

        Returns:
            A dict with `query`, `key`, `value` (only for the inputs that were passed; the
            gradient of a defaulted input is added to the one it defaulted to), `attention_bias`
            (when one was passed) and every name of the portable weight layout.
        """
        return _backward(self, grad_output)


# -------------------------------------------------------------------------------------------------
# Section: backward
# -------------------------------------------------------------------------------------------------
# NumPy only: `backward(grad_output)` after a call without a cache returns the gradients of its inputs and
# weights, running the steps of that call in reverse from what `__call__` kept in `_saved`: the checked call,
# which of key and value were left out, the shape of `attention_bias`, the attended q, k and v, the keep
# (causal, window and chunk are folded in again by `_full_keep`, as `dot_product_attention` folds them), the
# weights, the attention result, the gate and the merged heads. It recomputes the rest (the scores before
# soft-capping, the projections before QK-norm) with the forward's operations. An option's backward is in
# its section.


def _backward(layer, grad_output):
    """`backward`: steps 7 to 2 of the last call in reverse (each option's in its section)."""
    g, c = _check_backward(layer, grad_output), layer._saved  # (B, T, E)
    call, q, k, v = c["call"], c["q"], c["k"], c["v"]
    width = c["merged"].shape[-1] // layer.num_heads  # H (Hv with MLA)
    grads, d_context = _output_backward(g, c["merged"], layer.params["output_kernel"], layer.num_heads, width)
    d_gate_query = None
    if layer.output_norm is not None:
        d_context = _context_norm_backward(layer, d_context, grads)  # 7. the output norm
    if c["gate"] is not None:
        d_context, d_gate_query = _gate_backward(layer, d_context, grads)  # 6b. output gate
    if layer._latent is not None:
        k, v = _expand_latents(layer, k, v)  # MLA: the expanded keys and values
    keep = _full_keep(c["keep"], q.shape[2], k.shape[2], call.causal, call.window, call.attention_chunk_size)
    d_q, d_k, d_v, d_biased, d_sinks = _attention_backward(layer, d_context, q, k, v, keep, c["weights"])  # 6.
    d_q = d_q if layer.query_scaling is None else _query_scaling_backward(layer, call, d_q, grads)  # 4b.
    given = c["given_bias"]  # the call's `attention_bias` as given: its gradient takes its shape
    extra = {} if given is None else {"attention_bias": _sum_to_shape(d_biased, np.shape(given))}
    grads.update({} if d_sinks is None else {"sinks": d_sinks})
    if layer._latent is not None:
        inputs = _latent_backward(layer, call, c["k"], d_q, d_k, d_v, grads)
    elif layer._sharing:
        inputs = _sharing_backward(layer, call, d_q, d_k, d_v, grads, extra)  # their section
    else:
        if layer._qk_norm_late:
            d_q, d_k = _late_qk_norm_backward(layer, call, d_q, d_k, grads)  # 4. QK-norm after RoPE
        if layer._inv_freq is not None:
            d_q, d_k = (_turn_back(layer, d, call.positions) for d in (d_q, d_k))  # 4. RoPE
        inputs = {}
        for kind, d_heads in (("query", d_q), ("key", d_k), ("value", d_v)):  # 3. QK-norm, 2. clip, projections
            inputs[kind] = _project_backward(layer, kind, getattr(call, kind), d_heads, grads)
    inputs["query"] = inputs["query"] if d_gate_query is None else inputs["query"] + d_gate_query
    if layer.index_topk is not None:
        grads.update(_indexer_grads(layer))  # the sparse indexer's: zeros
    grads = {name: grads[name] for name in layer.params}  # in the order of the weight layout
    return {**_fold_defaulted(inputs, c["no_key"], c["no_value"]), **extra, **grads}


def _check_backward(layer, grad_output):
    """`grad_output` as a float64 (B, T, E) array, after the checks that `backward` can run."""
    if layer._saved is None:
        raise ValueError("`backward` needs a forward call without `cache` first. Received: no such call")
    if layer.quantization_mode is not None:
        raise ValueError(
            "`backward` is defined for float weights only: an int8 layer rounds its inputs, which has no "
            f"gradient. Received: quantization_mode={layer.quantization_mode!r}"
        )
    g = np.asarray(grad_output, dtype=np.float64)  # (B, T, E)
    expected = (*layer._saved["merged"].shape[:2], layer.d_model)
    if g.shape != expected:
        raise ValueError(
            f"`grad_output` must have the output's shape {expected}. Received: grad_output.shape={g.shape}"
        )
    return g


def _output_backward(g, merged, output_kernel, heads, head_dim):
    """Step 7 backward: ({output_kernel, output_bias} gradients, d_context (B, N, T, H))."""
    b, t, _ = g.shape
    grads = {"output_kernel": np.einsum("btm,bte->me", merged, g), "output_bias": g.sum(axis=(0, 1))}
    d_context = (g @ output_kernel.T).reshape(b, t, heads, head_dim).transpose(0, 2, 1, 3)  # -> (B, N, T, H)
    return grads, d_context


def _attention_backward(layer, d_context, q, k, v, keep, weights):
    """Step 6 backward, from `dot_product_attention`'s (B, N, T, H) q, (B, K, S, H) k and v, its
    `keep` with causal, window and chunk folded in, and its weights: (d_q, d_k, d_v, d_scores,
    d_sinks) with d_scores (B, N, T, S) the gradient of the biased scores (d_sinks None: no sinks)."""
    scale, sinks = layer.scale, layer.params.get("sinks")
    groups = q.shape[1] // k.shape[1]
    k_rep, v_rep = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)  # (B, N, S, H)
    d_weights = d_context @ v_rep.swapaxes(-1, -2)  # (B, N, T, H) @ (B, N, H, S) -> (B, N, T, S)
    d_v_rep = weights.swapaxes(-1, -2) @ d_context  # (B, N, S, T) @ (B, N, T, H) -> (B, N, S, H)
    d_probs = np.where(keep, d_weights, 0.0)  # (B, N, T, S)
    inner = (d_probs * weights).sum(axis=-1, keepdims=True)  # (B, N, T, 1)
    d_scores = np.where(keep, weights * (d_probs - inner), 0.0)  # softmax backward, (B, N, T, S)
    d_sinks = None
    if sinks is not None:
        sink_probs = 1.0 - weights.sum(axis=-1, keepdims=True)  # (B, N, T, 1): the sink's share
        d_sinks = -(sink_probs * inner).sum(axis=(0, 2, 3))  # (N,)
    d_biased = d_scores
    if layer.softcap is not None:
        d_scores = _softcap_backward(d_scores, q, k_rep, scale, layer.softcap)
    d_scores = d_scores * scale  # (B, N, T, S)
    d_q = d_scores @ k_rep  # (B, N, T, S) @ (B, N, S, H) -> (B, N, T, H)
    d_k_rep = d_scores.swapaxes(-1, -2) @ q  # (B, N, S, T) @ (B, N, T, H) -> (B, N, S, H)
    (b, kv, s, h), hv = k.shape, v.shape[-1]
    d_k = d_k_rep.reshape(b, kv, groups, s, h).sum(axis=2)  # (B, N, S, H) -> (B, K, S, H)
    d_v = d_v_rep.reshape(b, kv, groups, s, hv).sum(axis=2)  # (B, N, S, Hv) -> (B, K, S, Hv)
    return d_q, d_k, d_v, d_biased, d_sinks


def _project_backward(layer, kind, x, d_heads, grads, d_clamped=None):
    """Steps 3 and 2 backward for one of q, k, v: adds the kernel's, bias' and norm's gradients
    to `grads`, returns the input's (B, L, D); `d_clamped` (B, L, heads*H), a gradient of the
    clamped projection from another use of it (keys as values), is added after the norm's."""
    d_y = layer._merge_heads(d_heads)  # (B, heads, L, H) -> (B, L, heads*H)
    y = layer._project(x, kind)  # (B, L, heads*H), the projection before the clamp, recomputed
    if kind != "value" and layer.qk_norm is not None and not layer._qk_norm_late:
        d_y = _qk_norm_backward(layer, kind, _clip(layer, y), d_y, grads)  # at the clamped projection
    d_y = d_y if d_clamped is None else d_y + d_clamped
    if layer.clip_qkv is not None:  # the clamp's gradient: 1 within [-c, c] (bounds included), 0 outside
        d_y = np.where(np.abs(y) <= layer.clip_qkv, d_y, 0.0)
    return _linear_backward(layer, kind, x, d_y, grads)  # (B, L, heads*H) -> (B, L, D)


def _linear_backward(layer, kind, x, d_y, grads):
    """y = x @ kernel + bias backward: adds the kernel's and bias' gradients to `grads`,
    returns x's (B, L, D) from y's (B, L, F)."""
    grads[f"{kind}_kernel"] = np.einsum("bld,blm->dm", x, d_y)
    grads[f"{kind}_bias"] = d_y.sum(axis=(0, 1))
    return d_y @ layer.params[f"{kind}_kernel"].T  # (B, L, F) -> (B, L, D)


def _sum_to_shape(grad, shape):
    """The gradient of a tensor of `shape` broadcast to grad's rank-4 shape: summed back."""
    rank4 = {2: (1, 1, *shape), 3: (shape[0], 1, *shape[1:]), 4: tuple(shape)}[len(shape)]
    axes = tuple(i for i, (g, m) in enumerate(zip(grad.shape, rank4, strict=True)) if m == 1 and g != 1)
    return grad.sum(axis=axes, keepdims=True).reshape(shape)


def _fold_defaulted(inputs, no_key, no_value):
    """Adds the gradient of each input left out of the call to the input it defaulted to."""
    if no_key and no_value:
        return {"query": inputs["query"] + inputs["key"] + inputs["value"]}
    if no_key:
        return {"query": inputs["query"], "value": inputs["value"] + inputs["key"]}
    if no_value:
        return {"query": inputs["query"], "key": inputs["key"] + inputs["value"]}
    return inputs


# -------------------------------------------------------------------------------------------------
# Section: score modifiers
# -------------------------------------------------------------------------------------------------
# `scale` (default 1 / sqrt(H)), `softcap` (scores become c * tanh(scores / c)), `window` (query t keeps key s
# only if s > t + (S - T) - W; a pair (W_before, W_after) also limits the keys after it),
# `attention_chunk_size` (query and key in the same chunk of C positions), `sinks` (a learned logit per head
# in the softmax's denominator, `_masked_softmax`), ALiBi (`alibi_bias`) and the call's `attention_bias`
# (added to the scores, with a gradient). Here too the masks, combined into one boolean keep and one additive
# bias (`_masks`): a boolean `attention_mask` is True where a query may attend a key; a floating one is added
# to the scores, read in its own dtype: a value at or below the lowest finite value of its dtype or of float32
# (whichever is higher), or -inf, removes a key; every other value is added. `causal=True` keeps key s for
# query t iff s <= t + (S - T). A query row with no key left gets weights of exactly 0, so its output is
# `output_bias`. Example, a key padding mask for keys [a, b, <pad>]:
#     keep = np.array([[True, True, False]])           # (B, S)
#     layer(x, key_mask=keep)                           # or attention_mask=keep[:, None, :]


def _check_score_modifiers(head_dim, scale, softcap, window, attention_chunk_size):
    """Checks the score modifiers (a ValueError names the first that is invalid), as fields of
    `_Variants`: `scale` defaults to 1 / sqrt(H)."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else _positive_float("scale", scale)
    softcap = _positive_float("softcap", softcap, optional=True)
    window = _check_window(window)
    attention_chunk_size = (
        None if attention_chunk_size is None else _positive_int("attention_chunk_size", attention_chunk_size)
    )
    return {"scale": scale, "softcap": softcap, "window": window, "attention_chunk_size": attention_chunk_size}


def _check_window(window):
    """`window`: None, a positive integer W (held as an int) or a pair (W_before, W_after) of
    positive integers (a list or tuple, held as a tuple of two ints)."""
    if window is None:
        return None
    if _is_positive_int(window):
        return int(window)
    if isinstance(window, (list, tuple)) and len(window) == 2 and all(_is_positive_int(side) for side in window):
        return int(window[0]), int(window[1])
    raise ValueError(
        "`window` must be None, a positive integer or a pair (before, after) of positive integers. "
        f"Received: window={window!r}"
    )


def _window_sides(window):
    """`window` -> (W_before, W_after): an integer W is (W, None), no limit after the query."""
    if isinstance(window, (list, tuple)):
        return window[0], window[1]
    return window, None


def _attention_mask(attention_mask, mask):
    """`mask=` is another name for `attention_mask` (the seed usage `layer(q, k, v, mask=None)`)."""
    if mask is None:
        return attention_mask
    if attention_mask is not None:
        raise ValueError(
            "Pass the attention mask as `attention_mask` or as `mask`, not both. Received: attention_mask and mask"
        )
    return mask


def _padding_hint(name, shape, target):
    """For a 2-D `attention_mask` shaped (B, S) where (T, S) was expected: padding goes in `key_mask`."""
    padding = name == "attention_mask" and tuple(shape) == (target[0], target[3]) and target[0] != target[2]
    return " A (B, S) padding mask goes in `key_mask` (True = a real key)." if padding else ""


def _mask_to_4d(mask, target, name="attention_mask"):
    """Checks `attention_mask` (or `attention_bias`, which must be floating) against target
    (B, N, T, S), returns it as rank 4."""
    mask = np.asarray(mask)
    if name == "attention_bias" and not np.issubdtype(mask.dtype, np.floating):
        raise ValueError(f"`attention_bias` must be floating. Received: attention_bias.dtype={mask.dtype.name}")
    if mask.dtype != np.bool_ and not np.issubdtype(mask.dtype, np.floating):
        raise ValueError(
            f"`{name}` must be boolean (True = attend; for a 0/1 integer mask pass `mask > 0`) or floating. "
            f"Received: {name}.dtype={mask.dtype.name}"
        )
    expected = {2: target[2:], 3: (target[0], *target[2:]), 4: target}.get(mask.ndim)
    if expected is None or any(m not in (1, e) for m, e in zip(mask.shape, expected, strict=True)):
        raise ValueError(
            f"`{name}` must broadcast to (B, N, T, S) as (T, S), (B, T, S) or "
            f"(B, N, T, S), each dimension full or 1.{_padding_hint(name, mask.shape, target)} "
            f"Expected: (B, N, T, S)={target}. "
            f"Received: {name}.shape={tuple(mask.shape)}"
        )
    if mask.ndim == 2:
        return mask[None, None]  # (T, S) -> (1, 1, T, S)
    if mask.ndim == 3:
        return mask[:, None]  # (B, T, S) -> (B, 1, T, S)
    return mask


def _removal_threshold(dtype):
    """A floating mask value at or below this removes a key: the lowest finite value of the
    mask's dtype or of float32, whichever is higher (so -inf, and what converters put for it)."""
    return max(np.finfo(dtype).min, np.finfo(np.float32).min)


def _split_mask(mask):
    """Splits a rank-4 mask (or `attention_bias`) into (keep, bias): boolean and additive
    (float64, finite), each None or rank 4."""
    if mask is None:
        return None, None
    if mask.dtype == np.bool_:
        return mask, None
    removed = mask <= _removal_threshold(mask.dtype)  # read in the mask's own dtype, before any cast
    return ~removed, np.where(removed, 0.0, mask.astype(np.float64))  # finite, never 0 * -inf


def _and(a, b):
    return b if a is None else a if b is None else a & b


def _add(a, b):
    return b if a is None else a if b is None else a + b


def causal_mask(t, s):
    """(T, S) boolean mask: query t keeps key s iff s <= t + (S - T) (bottom-right aligned)."""
    return np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t)  # (T, S)


def window_mask(t, s, window):
    """(T, S) boolean mask: query t keeps key s iff s > t + (S - T) - W_before, and with a pair
    (W_before, W_after) also s < t + (S - T) + W_after (bottom-right aligned)."""
    before, after = _window_sides(window)
    keys, queries = np.arange(s)[None, :], np.arange(t)[:, None] + (s - t)  # (1, S), (T, 1) positions
    kept = keys > queries - before  # (T, S)
    return kept if after is None else kept & (keys < queries + after)  # (T, S)


def attention_chunk_mask(t, s, size):
    """(T, S) boolean mask: query t keeps key s iff s // size == (t + (S - T)) // size, the same
    chunk of `size` positions (bottom-right aligned)."""
    keys, queries = np.arange(s)[None, :], np.arange(t)[:, None] + (s - t)  # (1, S), (T, 1) positions
    return keys // size == queries // size  # (T, S)


def _full_keep(keep, t, s, causal, window, attention_chunk_size):
    """`keep` (None: all kept) with `causal`, and the score modifiers `window` and
    `attention_chunk_size`, folded in; broadcasts to (B, N, T, S)."""
    keep = np.ones((1, 1, t, s), dtype=bool) if keep is None else keep  # (B, N, T, S), dims may be 1
    keep = keep & causal_mask(t, s) if causal else keep
    keep = keep & window_mask(t, s, window) if window is not None else keep
    return keep & attention_chunk_mask(t, s, attention_chunk_size) if attention_chunk_size is not None else keep


def _softcap(scores, softcap):
    """Gemma 2's soft-capping: softcap * tanh(scores / softcap)."""
    return scores if softcap is None else softcap * np.tanh(scores / softcap)


def _softcap_backward(d_capped, q, k, scale, softcap):
    """Soft-capping's backward, through softcap * tanh(scores / softcap): the gradient of the scaled
    scores (B, N, T, S) from that of the capped ones, the scores recomputed from the (B, N, T, H)
    queries and the (B, N, S, H) keys repeated per query head."""
    capped = np.tanh(q @ k.swapaxes(-1, -2) * scale / softcap)  # (B, N, T, S)
    return d_capped * (1.0 - capped**2)


def _centre_rows(bias, keep):
    """`bias` minus each query row's largest kept value (rows keeping nothing: unchanged), as
    docs/SPEC.md "Numerics" asks: a softmax does not change, and a row whose kept keys all carry
    the same large finite penalty (-1e20) stays an ordinary softmax instead of one rounded away."""
    top = np.where(keep, bias, -np.inf).max(axis=-1, keepdims=True, initial=-np.inf)  # (B, N, T, 1), dims may be 1
    return bias - np.where(np.isfinite(top), top, 0.0)  # (B, N, T, S), dims may be 1


def alibi_bias(num_heads, positions):
    """ALiBi's attention_bias: slope[n] * positions[..., s], (1, N, 1, S) for (S,) positions or
    (B, N, 1, S) for (B, S), float32, with Bloom's slopes."""
    num_heads = _positive_int("num_heads", num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = 2.0 ** (-8.0 * np.arange(1, closest + 1) / closest)  # (closest,)
    extra = 2.0 ** (-4.0 * np.arange(1, 2 * (num_heads - closest), 2) / closest)  # every other slope of 2 * closest
    slopes = np.concatenate([slopes, extra])  # (N,)
    positions = np.asarray(positions)
    if positions.ndim not in (1, 2) or not np.issubdtype(positions.dtype, np.integer):
        raise ValueError(
            "`positions` must be an integer tensor of shape (S,) or (B, S). "
            f"Received: positions.shape={tuple(positions.shape)}, positions.dtype={positions.dtype.name}"
        )
    positions = positions[None] if positions.ndim == 1 else positions  # (B, S)
    return (slopes[None, :, None, None] * positions[:, None, None, :]).astype(np.float32)  # (B, N, 1, S)


def segment_ids_from_position_ids(position_ids):
    """Segment ids from positions that restart at each document (transformers' padding-free
    `position_ids`, `DataCollatorWithFlattening`): (B, T) or (T,) integers -> the same shape,
    0 for a row's first document, then 1, 2, ...; a document starts at t = 0 and wherever a
    position is not one more than the one before it."""
    positions = np.asarray(position_ids)
    starts = np.ones(positions.shape, dtype=np.int64)  # (B, T)
    starts[..., 1:] = positions[..., 1:] != positions[..., :-1] + 1
    return np.cumsum(starts, axis=-1) - 1  # (B, T)


def segment_ids_from_cu_seqlens(cu_seqlens, total_length=None):
    """Segment ids from the cumulative lengths of `varlen_attn` / flash-attention (0, len_0,
    len_0 + len_1, ..., T): (D + 1,) integers -> (1, T), document d at [cu[d], cu[d + 1]).
    `total_length` (default cu[-1]) may exceed cu[-1]: the tail is one more document."""
    cu = _check_cu_seqlens(np.asarray(cu_seqlens))
    length = int(cu[-1]) if total_length is None else int(total_length)
    return np.searchsorted(cu[1:], np.arange(length), side="right")[None, :]  # (1, T)


def _check_token_mask(name, mask, batch_size, length, letter):
    """Checks a (B, L) boolean `key_mask` or `query_mask`."""
    mask = np.asarray(mask)
    if mask.dtype != np.bool_ or mask.shape != (batch_size, length):
        raise ValueError(
            f"`{name}` must be a boolean tensor of shape (B, {letter})=({batch_size}, {length}). "
            f"Received: {name}.shape={tuple(mask.shape)}, {name}.dtype={mask.dtype.name}"
        )
    return mask


def _check_cu_seqlens(cu):
    if cu.ndim != 1 or cu.size < 1 or not np.issubdtype(cu.dtype, np.integer) or cu[0] != 0 or (np.diff(cu) < 0).any():
        raise ValueError(
            "`cu_seqlens` must be a 1-D integer tensor starting at 0 and non-decreasing. "
            f"Received: cu_seqlens={cu.tolist()}"
        )
    return cu


def _check_segment_ids(name, ids, batch_size, length, letter):
    """Checks (B, L) integer segment ids."""
    ids = np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer) or ids.shape != (batch_size, length):
        raise ValueError(
            f"`{name}` must be an integer tensor of shape (B, {letter})=({batch_size}, {length}). "
            f"Received: {name}.shape={tuple(ids.shape)}, {name}.dtype={ids.dtype.name}"
        )
    return ids


def _segment_ids_error(message):
    return ValueError(f"{message} (packed sequences, docs/SPEC.md, 'Packed sequences')")


def _segment_keep(layer, call, segment_ids, key_segment_ids):
    """Packed sequences: (B, 1, T, S) `same` and the call's cache. Query t keeps key s only if
    segment_ids[b, t] == key_segment_ids[b, s],
    ANDed into `attention_mask` (a float mask gets -inf there). Key ids default to `segment_ids`
    when S == T (self-attention). With a cache the key ids of the T new tokens are written to the
    cache's `segment_ids` (made at the first packed call of an empty cache) and the mask is over its
    L slots; a call without ids continues the document of the last written slot."""
    b, t = call.query.shape[:2]
    cache = call.cache
    if cache is None and segment_ids is None:
        raise _segment_ids_error("`key_segment_ids` needs `segment_ids`")
    if cache is not None:
        index, length = int(cache.index), cache.key.shape[2]
        if segment_ids is None and cache.segment_ids is None:
            raise _segment_ids_error("`key_segment_ids` needs `segment_ids`")
        if segment_ids is None:  # the new tokens continue the last written slot's document
            segment_ids = np.repeat(np.asarray(cache.segment_ids)[:, (index - 1) % length, None], t, axis=1)
        if cache.segment_ids is None and index > 0:
            raise _segment_ids_error(
                "`cache` holds tokens written without `segment_ids`; pass them from the first call"
            )
    segment_ids, key_ids = _checked_segment_ids(call, segment_ids, key_segment_ids)
    if cache is not None:
        ids = np.zeros((b, length), np.int64) if cache.segment_ids is None else np.array(cache.segment_ids)
        ids[:, (index + np.arange(t)) % length] = key_ids  # (B, L)
        key_ids, cache = ids, cache._replace(segment_ids=ids)
    return _same_documents(segment_ids, key_ids), cache


def _checked_segment_ids(call, segment_ids, key_segment_ids):
    """The (B, T) query ids and (B, S) key ids of a packed call, checked; the key ids default to
    `segment_ids` when S == T (self-attention)."""
    (b, t), s = call.query.shape[:2], call.key.shape[1]
    segment_ids = _check_segment_ids("segment_ids", segment_ids, b, t, "T")
    if key_segment_ids is None and s != t:
        raise _segment_ids_error("cross-attention (S != T) needs `key_segment_ids` (B, S)")
    key_ids = segment_ids
    if key_segment_ids is not None:
        key_ids = _check_segment_ids("key_segment_ids", key_segment_ids, b, s, "S")
    return segment_ids, key_ids


def _same_documents(segment_ids, key_ids):
    """(B, T) and (B, S) ids -> the (B, 1, T, S) keep of packed sequences."""
    return segment_ids[:, None, :, None] == key_ids[:, None, None, :]  # (B, 1, T, S)


def _packed(layer, call, segment_ids, key_segment_ids):
    """Packed sequences (`_segment_keep`) ANDed into `attention_mask`; the call marked `segmented`."""
    same, cache = _segment_keep(layer, call, segment_ids, key_segment_ids)
    mask = call.attention_mask
    same = same if mask is None else mask & same if mask.dtype == np.bool_ else np.where(same, mask, -np.inf)
    return call._replace(attention_mask=same, cache=cache, segmented=True)


# -------------------------------------------------------------------------------------------------
# Section: positions
# -------------------------------------------------------------------------------------------------
# RoPE (`rope_theta`, `rope_fraction`, `rope_interleaved`, `rope_scaling`, `rope_sections` for multimodal
# RoPE; `positions` in the call): the first R features of each head of q and k turn by position.
# "proportional" `rope_scaling` (Gemma 4, LFM3) leaves the last pairs of the R features unturned.


_ROPE_SCALING = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "proportional": (),
}
_YARN_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _check_rope(rope_width, rope_theta, rope_fraction, rope_scaling, rope_sections):
    """Checks RoPE's arguments (a ValueError names the first that is invalid) but
    `rope_interleaved`, as fields of `_Variants`; RoPE turns features of heads `rope_width` wide
    (H, or Hr with MLA)."""
    rope_theta = _positive_float("rope_theta", rope_theta, optional=True)
    rotary_dim = _rotary_dim(rope_fraction, rope_width, rope_theta is not None)
    rope_scaling = _check_rope_scaling(rope_scaling)
    rope_sections = _check_rope_sections(rope_sections, rotary_dim)
    fraction = float(rope_fraction)
    return {
        "rope_theta": rope_theta,
        "rope_fraction": fraction,
        "rope_scaling": rope_scaling,
        "rope_sections": rope_sections,
    }


def _init_rope(layer, rope_width, rope_fraction, rope_sections_interleaved):
    """`rope_sections_interleaved`, checked, and the RoPE frequencies `_inv_freq` ((R/2,), computed
    once; None without RoPE) of heads `rope_width` wide."""
    layer.rope_sections_interleaved = _flag("rope_sections_interleaved", rope_sections_interleaved)
    layer._inv_freq = None
    if layer.rope_theta is not None:
        rotary_dim = _rotary_dim(rope_fraction, rope_width, True)
        layer._inv_freq = rope_frequencies(rotary_dim, layer.rope_theta, layer.rope_scaling)


def _rotary_dim(rope_fraction, head_dim, rope):
    """R = int(H * rope_fraction), the rotated features of each head (None without RoPE).
    `rope_fraction` is checked whether or not RoPE is on: a Python or NumPy number in (0, 1];
    with RoPE, R must also be even and at least 2."""
    valid = _is_positive_number(rope_fraction) and rope_fraction <= 1
    rotary = int(head_dim * rope_fraction) if valid else 0
    if not valid or (rope and (rotary < 2 or rotary % 2)):
        raise ValueError(
            "`rope_fraction` must be in (0, 1] and rotate an even number R = int(head_dim * rope_fraction) >= 2 of "
            f"features. Received: rope_fraction={rope_fraction!r}, head_dim={head_dim}"
        )
    return rotary if rope else None


def _check_rope_scaling(scaling):
    """Checks `rope_scaling`: None or a dict whose `rope_type` (or `type`) is 'linear', 'llama3',
    'yarn' or 'proportional', with its positive parameters (llama3: high_freq_factor above
    low_freq_factor; yarn: see `_valid_yarn`; proportional: `_valid_proportional`)."""
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    valid = kind in _ROPE_SCALING and all(_is_positive_number(scaling.get(name)) for name in _ROPE_SCALING[kind])
    if valid and kind == "llama3":
        valid = scaling["high_freq_factor"] > scaling["low_freq_factor"]
    if valid and kind == "yarn":
        valid = _valid_yarn(scaling)
    if valid and kind == "proportional":
        valid = _valid_proportional(scaling)
    if not valid:
        raise ValueError(
            "`rope_scaling` must be None or a dict whose rope_type is 'linear', 'llama3', 'yarn' or "
            f"'proportional', with its parameters. Received: rope_scaling={scaling!r}"
        )
    return {name: value.item() if isinstance(value, np.generic) else value for name, value in scaling.items()}


def _check_rope_sections(sections, rotary_dim):
    """`rope_sections`: None or a list or tuple of positive integers (held as a tuple of ints);
    with RoPE (`rotary_dim` R not None) they must sum to R/2, the rotated pairs."""
    if sections is None:
        return None
    if not isinstance(sections, (list, tuple)) or not sections or not all(_is_positive_int(n) for n in sections):
        raise ValueError(
            "`rope_sections` must be None or a list or tuple of positive integers. "
            f"Received: rope_sections={sections!r}"
        )
    if rotary_dim is not None and sum(sections) != rotary_dim // 2:
        raise ValueError(
            f"`rope_sections` must sum to R/2 = {rotary_dim // 2}, the pairs RoPE rotates (R = int(head_dim * "
            f"rope_fraction) = {rotary_dim}). Received: rope_sections={sections!r}"
        )
    return tuple(int(n) for n in sections)


def _valid_yarn(scaling):
    """YaRN's optional parameters: each None (absent) or positive, `truncate` True or False, and
    beta_fast (default 32) at least beta_slow (default 1)."""
    if not all(scaling.get(name) is None or _is_positive_number(scaling[name]) for name in _YARN_OPTIONAL):
        return False
    truncate = isinstance(scaling.get("truncate", True), (bool, np.bool_))
    return truncate and (scaling.get("beta_fast") or 32) >= (scaling.get("beta_slow") or 1)


def _valid_proportional(scaling):
    """Proportional RoPE's optional parameters: `factor` None (absent) or positive,
    `partial_rotary_factor` None (absent) or in (0, 1]."""
    factor, fraction = scaling.get("factor"), scaling.get("partial_rotary_factor")
    valid_factor = factor is None or _is_positive_number(factor)
    return valid_factor and (fraction is None or (_is_positive_number(fraction) and fraction <= 1))


def _positions(layer, positions, query, key, cache):
    """(B, T) RoPE positions ((k, B, T) with `rope_sections`): `positions`, or index + arange(T)
    for every section; None without RoPE. Without a cache RoPE needs the keys to be the
    query's own tokens."""
    (b, t), rope, sections = query.shape[:2], layer._inv_freq is not None, layer.rope_sections
    if cache is None and rope:
        _check_own_tokens(query, key)
    if positions is not None:
        return _check_positions(positions, b, t, rope, sections)
    index = 0 if cache is None else int(cache.index)
    target = (b, t) if sections is None else (len(sections), b, t)
    return None if not rope else np.broadcast_to(index + np.arange(t), target)  # (B, T) or (k, B, T)


def _check_positions(positions, batch_size, t, rope, sections):
    """Integer RoPE positions: (B, T) from `positions` (B, T) or (T,); with `rope_sections` of k
    sections (k, B, T) from those or from (k, B, T), one row per section."""
    if not rope:
        raise ValueError(
            "`positions` needs RoPE: construct the layer with `rope_theta`. Received: positions with rope_theta=None"
        )
    positions = np.asarray(positions)
    target = (batch_size, t) if sections is None else (len(sections), batch_size, t)
    if not np.issubdtype(positions.dtype, np.integer) or positions.shape not in ((batch_size, t), (t,), target):
        raise ValueError(_positions_error(positions, batch_size, t, sections))
    return np.broadcast_to(positions, target)  # (B, T) or (k, B, T)


def _positions_error(positions, batch_size, t, sections):
    received = f"Received: positions.shape={tuple(positions.shape)}, positions.dtype={positions.dtype.name}"
    if sections is None:
        return f"`positions` must be an integer tensor of shape (B, T) or (T,) with B={batch_size}, T={t}. {received}"
    return (
        f"`positions` must be an integer tensor of shape (B, T), (T,) or ({len(sections)}, B, T) with B={batch_size}, "
        f"T={t} (one row per section of `rope_sections`). {received}"
    )


def _check_own_tokens(query, key):
    """RoPE gives query t and key t one position: the keys must be the query's own tokens."""
    if key.shape[1] != query.shape[1]:
        raise ValueError(
            "RoPE needs `key` and `value` to hold the query's own tokens (S == T, or decoding with `cache`). "
            f"Received: query.shape={query.shape}, key.shape={key.shape}"
        )


def document_positions(segment_ids):
    """RoPE positions of packed sequences: (B, T) or (T,) segment ids -> positions of the same
    shape that restart at 0 wherever the id changes (each document numbered from 0)."""
    ids = np.asarray(segment_ids)
    steps = np.arange(ids.shape[-1])  # (T,)
    starts = np.ones(ids.shape, dtype=bool)  # (B, T)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    first = np.maximum.accumulate(np.where(starts, steps, 0), axis=-1)  # (B, T), where each document starts
    return steps - first  # (B, T)


def rope_frequencies(rotary_dim, theta, scaling=None):
    """(R/2,) inverse frequencies `theta ** (-2i / R)`, rewritten by `rope_scaling` (as in transformers)."""
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2) / rotary_dim)  # (R/2,)
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    if kind == "yarn":
        return _yarn_frequencies(inv_freq, theta, scaling)
    if kind == "proportional":
        return _proportional_frequencies(inv_freq, scaling)
    return inv_freq


def _llama3_frequencies(inv_freq, scaling):
    """Llama 3.1's rewrite (transformers' `_compute_llama3_parameters`): wavelengths shorter than
    original_max_position_embeddings / high_freq_factor are kept, those longer than
    original_max_position_embeddings / low_freq_factor divided by `factor`, the ones between
    interpolated smoothly."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq  # (R/2,)
    smooth = (context / wavelength - low) / (high - low)  # (R/2,)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq  # (R/2,)
    scaled = np.where(wavelength > context / low, inv_freq / factor, smoothed)  # (R/2,)
    return np.where(wavelength < context / high, inv_freq, scaled)  # (R/2,)


def _yarn_correction_dim(rotations, rotary_dim, theta, context):
    """The (fractional) pair index whose wavelength turns `rotations` times over `context` positions."""
    return rotary_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def _yarn_frequencies(inv_freq, theta, scaling):
    """YaRN's rewrite (transformers' `_compute_yarn_parameters`): pairs below the correction dim of
    beta_fast rotations keep inv_freq (extrapolation), pairs above that of beta_slow take
    inv_freq / factor (interpolation), a linear ramp between (bounds floored and ceiled when
    `truncate`, the default)."""
    rotary_dim, context = 2 * inv_freq.shape[0], scaling["original_max_position_embeddings"]
    low = _yarn_correction_dim(scaling.get("beta_fast") or 32, rotary_dim, theta, context)
    high = _yarn_correction_dim(scaling.get("beta_slow") or 1, rotary_dim, theta, context)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    high = high + 0.001 if high == low else high  # as transformers: no ramp of zero width
    ramp = np.clip((np.arange(rotary_dim // 2) - low) / (high - low), 0.0, 1.0)  # (R/2,), 1 = interpolated
    return inv_freq / scaling["factor"] * ramp + inv_freq * (1.0 - ramp)  # (R/2,)


def _proportional_frequencies(inv_freq, scaling):
    """Proportional RoPE's rewrite (transformers' `_compute_proportional_rope_parameters`: Gemma 4,
    LFM3): the first A = int(partial_rotary_factor * R // 2) pairs keep inv_freq, the last R/2 - A
    turn by 0 (pass unchanged), all divided by `factor` (both default to 1)."""
    pairs = np.arange(inv_freq.shape[0])  # (R/2,)
    turned = int((scaling.get("partial_rotary_factor") or 1.0) * (2 * inv_freq.shape[0]) // 2)
    return np.where(pairs < turned, inv_freq, 0.0) / (scaling.get("factor") or 1.0)  # (R/2,)


def rope_attention_factor(scaling):
    """The factor of the rotated features of q and k (transformers multiplies cos and sin by it):
    YaRN's `attention_factor`, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when
    both are given, else mscale(factor, 1), with mscale(s, m) = 0.1 * m * ln(s) + 1 (1 for s <= 1);
    1.0 for the other scalings."""
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor, 1.0)


def _yarn_mscale(factor, mscale):
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def scale_rotated(x, rotary_dim, factor):
    """The first R (rotated) features of each head of x (B, heads, T, H) times `factor` (YaRN)."""
    if factor == 1.0:
        return x
    if rotary_dim == x.shape[-1]:
        return x * factor
    return np.concatenate([x[..., :rotary_dim] * factor, x[..., rotary_dim:]], axis=-1)  # (B, heads, T, H)


def rope_angles(positions, inv_freq, sections=None, sections_interleaved=False):
    """(B, T, R/2) angles: (B, T) positions times the (R/2,) inv_freq; with `sections`
    (multimodal RoPE) pair i turns by positions[j] * inv_freq[i] from (k, B, T) positions, j its
    row (`_section_rows`: runs of the sections' sizes, or dealt in turn with `sections_interleaved`)."""
    if sections is None:
        return positions[..., None] * inv_freq  # (B, T, 1) * (R/2,) -> (B, T, R/2)
    rows = positions[_section_rows(sections, sections_interleaved)]  # (k, B, T) -> (R/2, B, T)
    return np.moveaxis(rows, 0, -1) * inv_freq  # (R/2, B, T) -> (B, T, R/2)


def _section_rows(sections, interleaved):
    """The row of (k, B, T) positions that turns each of the R/2 pairs: row j turns a run of
    `sections[j]` pairs, in order; `interleaved` (Qwen3-VL) deals them in turn: pair i by row
    i % k while i < k * sections[i % k], else by row 0."""
    k = len(sections)
    if not interleaved:
        return [j for j, size in enumerate(sections) for _ in range(size)]
    return [i % k if i < k * sections[i % k] else 0 for i in range(sum(sections))]


def apply_rope(x, positions, inv_freq, interleaved, sections=None, sections_interleaved=False):
    """Rotates the first R = 2 * len(inv_freq) features of each head of x (B, heads, T, H) by the
    angles positions * inv_freq (per section with `sections` and `sections_interleaved`, see
    `rope_angles`); `interleaved`
    pairs features (2i, 2i + 1), else (i, i + R/2)."""
    angles = rope_angles(positions, inv_freq, sections, sections_interleaved)  # (B, T, R/2)
    angles = angles[:, None]  # (B, T, R/2) -> (B, 1, T, R/2)
    cos, sin = np.cos(angles), np.sin(angles)
    r = 2 * inv_freq.shape[0]
    rotated, rest = x[..., :r], x[..., r:]  # (B, heads, T, R), (B, heads, T, H - R)
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]  # 2 x (B, heads, T, R/2)
        turned = np.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(rotated.shape)
    else:
        x1, x2 = rotated[..., : r // 2], rotated[..., r // 2 :]  # 2 x (B, heads, T, R/2)
        turned = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # (B, heads, T, R)
    return np.concatenate([turned, rest], axis=-1)  # (B, heads, T, H)


def _rotate(layer, q, k, positions):
    """Step 4: RoPE of the (B, N, T, H) queries and (B, K, T, H) keys at (B, T) positions
    ((k, B, T) with `rope_sections`); MLA turns its own parts (`_rotate_latent`)."""
    return _turn(layer, q, positions), _turn(layer, k, positions)


def _turn(layer, x, positions):
    """RoPE of the first R features of each head of x (B, heads, T, H), times YaRN's factor."""
    sections = layer.rope_sections, layer.rope_sections_interleaved  # multimodal RoPE: sections (or None), their layout
    x = apply_rope(x, positions, layer._inv_freq, layer.rope_interleaved, *sections)  # (B, heads, T, H)
    return scale_rotated(x, 2 * layer._inv_freq.shape[0], rope_attention_factor(layer.rope_scaling))


def _rope_backward(d, positions, inv_freq, interleaved, factor, sections, sections_interleaved=False):
    """Step 4 backward: RoPE is a rotation (times YaRN's factor): its backward scales, turns back
    (each section by its own rows of positions)."""
    d = scale_rotated(d, 2 * inv_freq.shape[0], factor)
    return apply_rope(d, -positions, inv_freq, interleaved, sections, sections_interleaved)


def _turn_back(layer, d, positions):
    """Step 4 backward for a gradient (B, heads, T, H) of turned features (unchanged without RoPE)."""
    if layer._inv_freq is None:
        return d
    factor, sections = rope_attention_factor(layer.rope_scaling), (layer.rope_sections, layer.rope_sections_interleaved)
    return _rope_backward(d, positions, layer._inv_freq, layer.rope_interleaved, factor, *sections)


# Queries scaled by position (`query_scaling`, docs/SPEC.md "Queries scaled by position"): each query row times
# 1 + beta * ln(1 + floor(p / floor)). "temperature" (Llama 4's attention temperature tuning) counts p = i + t + 1
# from the cache's index i (0 without a cache), the same for every row, left padding included; "positions"
# (Mistral 4's and Ministral 3's `llama_4_scaling_beta`) reads the (B, T) RoPE positions (`positions`, by default
# i + t). A constant per query row, so q's gradient is scaled by it too. "learned" (Mistral Large 4's
# `softmax_scaling`) multiplies query head n by query_scaling_scale[n] * ln(1 + p) + query_scaling_bias[n], p read
# as "positions" reads it; its two (N,) weights have gradients.


_QUERY_SCALING_TYPES = ("temperature", "positions")


def _check_query_scaling(scaling, rope_sections):
    """`query_scaling`: None, {"type": "learned"} or {"type": "temperature" or "positions", "beta": a finite
    number, "floor": a positive number}, held with float numbers; "positions" and "learned" read one row of
    positions (not `rope_sections`)."""
    if scaling is None:
        return None
    learned = isinstance(scaling, dict) and scaling == {"type": "learned"}
    valid = learned or (isinstance(scaling, dict) and set(scaling) == {"type", "beta", "floor"})
    valid = valid and (learned or (scaling["type"] in _QUERY_SCALING_TYPES and _is_positive_number(scaling["floor"])))
    if not valid or not (learned or _is_finite_number(scaling["beta"])):
        raise ValueError(
            "`query_scaling` must be None, {'type': 'learned'} or a dict {'type': 'temperature' or 'positions', "
            f"'beta': a finite number, 'floor': a positive number}}. Received: query_scaling={scaling!r}"
        )
    if scaling["type"] != "temperature" and rope_sections is not None:
        raise ValueError(
            f"`query_scaling` of type {scaling['type']!r} reads one row of positions, not the (k, B, T) of "
            f"`rope_sections`. Received: query_scaling={scaling!r}, rope_sections={rope_sections!r}"
        )
    if learned:
        return {"type": "learned"}
    return {"type": scaling["type"], "beta": float(scaling["beta"]), "floor": float(scaling["floor"])}


def _query_scaling_shapes(layer):
    """The learned scaling's portable weights {name: shape}: (N,) `query_scaling_scale` and `query_scaling_bias`."""
    if layer.query_scaling is None or layer.query_scaling["type"] != "learned":
        return {}
    return {"query_scaling_scale": (layer.num_heads,), "query_scaling_bias": (layer.num_heads,)}


def _is_finite_number(value):
    number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    return number and math.isfinite(value)


def _position_step(layer, q, k, call):
    """Steps 4 and 4b: RoPE of q (B, N, T, H) and k (B, K, T, H), then each query row times its scale."""
    if layer.rope_theta is not None:
        q, k = _rotate(layer, q, k, call.positions)  # 4. RoPE
        q, k = _normalize_qk(layer, q, k) if layer._qk_norm_late else (q, k)  # 4. QK-norm after RoPE
    return (q, k) if layer.query_scaling is None else (q * _query_scales(layer, call), k)


def _query_scales(layer, call):
    """Step 4b: the (B|1, 1, T, 1) factor of each query row, 1 + beta * ln(1 + floor(p / floor)), or
    the learned (B|1, N, T, 1) factor of each query head and row."""
    scaling, positions = layer.query_scaling, _scaling_positions(layer, call)  # (B|1, T)
    if scaling["type"] == "learned":
        p = layer.params
        return _learned_scales(p["query_scaling_scale"], p["query_scaling_bias"], positions)  # (B|1, N, T, 1)
    scales = 1.0 + scaling["beta"] * np.log(1.0 + np.floor(positions / scaling["floor"]))  # (B|1, T)
    return scales[:, None, :, None]  # (B|1, T) -> (B|1, 1, T, 1)


def _scaling_positions(layer, call):
    """The (B|1, T) positions p of step 4b: the call's RoPE positions ("positions", "learned"), else
    i + t (+ 1 for "temperature") from the cache's index i before the call."""
    if layer.query_scaling["type"] != "temperature" and call.positions is not None:
        return call.positions  # (B, T)
    index = 0 if call.cache is None else int(call.cache.index)
    return (index + np.arange(call.query.shape[1]) + (layer.query_scaling["type"] == "temperature"))[None]  # (1, T)


def _learned_scales(scale, bias, positions):
    """The learned factor scale[n] * ln(1 + p) + bias[n] of head n at (B|1, T) positions: (B|1, heads, T, 1)."""
    logs = np.log(1.0 + positions)[:, None, :, None]  # (B|1, T) -> (B|1, 1, T, 1)
    return scale[None, :, None, None] * logs + bias[None, :, None, None]  # (B|1, heads, T, 1)


def _query_scaling_backward(layer, call, d_q, grads):
    """Step 4b in reverse: q's gradient times its factor; with "learned", the gradients of its (N,)
    weights (from the queries before the step, recomputed by steps 2 to 4) added to `grads`."""
    if layer.query_scaling["type"] == "learned":
        unscaled = copy.copy(layer)  # the same weights, without step 4b
        unscaled.query_scaling = None
        d_scales = (d_q * unscaled._project_qkv(call)[0]).sum(axis=-1)  # (B, N, T, H) -> (B, N, T)
        logs = np.log(1.0 + _scaling_positions(layer, call))[:, None, :]  # (B|1, T) -> (B|1, 1, T)
        grads["query_scaling_scale"] = (d_scales * logs).sum(axis=(0, 2))  # (N,)
        grads["query_scaling_bias"] = d_scales.sum(axis=(0, 2))  # (N,)
    return d_q * _query_scales(layer, call)


# -------------------------------------------------------------------------------------------------
# Section: QK-norm, clip_qkv and the gate
# -------------------------------------------------------------------------------------------------
# `qk_norm` (RMSNorm or LayerNorm, `qk_norm_type`, of q and k per head, with a scale per head, or over all
# heads; a bias with `qk_norm_bias`), `clip_qkv` (q, k and v clamped to [-c, c] right after their
# projections: OLMo, DBRX, MPT) and `gate` (each head's result times sigmoid(query @ gate_kernel +
# gate_bias): Keras' `use_gate`, Qwen3-Next; softplus instead with `gate_activation="softplus"`:
# Laguna); `output_norm` (RMSNorm or LayerNorm of the merged heads before the output projection,
# weights `context_norm` and `context_norm_bias`: BitNet, Kosmos-2);
# `qk_norm_after_rope` (QK-norm of the turned q and k, in step 4: HunYuan).


_GATE_ACTIVATIONS = ("sigmoid", "softplus")  # the values `gate_activation` takes


def _check_norms(qk_norm, qk_norm_eps, qk_norm_type, clip_qkv):
    """Checks QK-norm's arguments but `qk_norm_bias`, then `clip_qkv` (a ValueError names the first
    that is invalid), as fields of `_Variants` (the flags `qk_norm_bias` and `gate` are checked
    with the others, last)."""
    if qk_norm not in (None, "head", "per_head", "all"):
        raise ValueError(f"`qk_norm` must be None, 'head', 'per_head' or 'all'. Received: qk_norm={qk_norm!r}")
    qk_norm = None if qk_norm is None else str(qk_norm)  # np.str_ held as str
    qk_norm_eps = _positive_float("qk_norm_eps", qk_norm_eps)
    if not isinstance(qk_norm_type, str) or qk_norm_type not in ("rms", "layer"):
        raise ValueError(f"`qk_norm_type` must be 'rms' or 'layer'. Received: qk_norm_type={qk_norm_type!r}")
    clip_qkv = _positive_float("clip_qkv", clip_qkv, optional=True)
    qk_norm_type = str(qk_norm_type)  # np.str_ held as str
    return {"qk_norm": qk_norm, "qk_norm_eps": qk_norm_eps, "qk_norm_type": qk_norm_type, "clip_qkv": clip_qkv}


def _init_norm_options(layer, output_norm, output_norm_eps, qk_norm_after_rope):
    """Checks `output_norm`, `output_norm_eps` and `qk_norm_after_rope` (after every other argument) and holds
    them as attributes (`_qk_norm_late`: QK-norm runs after RoPE, in step 4, where both are on); adds `context_norm`
    (and `context_norm_bias` with "layer"), (N*Hv,) each, to the float layout."""
    if output_norm not in (None, "rms", "layer"):
        raise ValueError(f"`output_norm` must be None, 'rms' or 'layer'. Received: output_norm={output_norm!r}")
    layer.output_norm = None if output_norm is None else str(output_norm)  # np.str_ held as str
    layer.output_norm_eps = _positive_float("output_norm_eps", output_norm_eps)
    layer.qk_norm_after_rope = _flag("qk_norm_after_rope", qk_norm_after_rope)
    layer._qk_norm_late = layer.qk_norm_after_rope and layer.qk_norm is not None and layer.rope_theta is not None
    if layer._qk_norm_late and layer._sharing:
        raise ValueError(
            "`qk_norm_after_rope` must be False with `kv_shared`, `keys_as_values` or `value_norm` (their keys are "
            "normalized before RoPE by their producer's order). Received: qk_norm_after_rope=True"
        )
    layer._float_layout.update(_context_norm_shapes(layer))


def _context_norm_shapes(layer):
    """`output_norm`'s portable weights {name: shape}: (N*Hv,) `context_norm`, and `context_norm_bias` with "layer"."""
    if layer.output_norm is None:
        return {}
    width = (layer._float_layout["output_kernel"][0],)  # N*Hv
    return {"context_norm": width} | ({"context_norm_bias": width} if layer.output_norm == "layer" else {})


def _normalize_context(layer, merged):
    """Step 7, `output_norm`: RMSNorm or LayerNorm of the (B, T, N*Hv) merged heads over all their features,
    times `context_norm`, plus `context_norm_bias` with LayerNorm."""
    if layer.output_norm == "rms":
        return rms_norm(merged, layer.params["context_norm"], layer.output_norm_eps)
    return layer_norm(merged, layer.params["context_norm"], layer.output_norm_eps) + layer.params["context_norm_bias"]


def _check_gate_activation(gate_activation):
    """Checks `gate_activation` (held as a str; it has no effect without `gate`)."""
    if not isinstance(gate_activation, str) or gate_activation not in _GATE_ACTIVATIONS:
        raise ValueError(
            f"`gate_activation` must be 'sigmoid' or 'softplus'. Received: gate_activation={gate_activation!r}"
        )
    return str(gate_activation)  # np.str_ held as str


def _sigmoid(x):
    """1 / (1 + exp(-x)), without overflow for large |x|."""
    return np.exp(-np.logaddexp(0.0, -x))


def _softplus(x):
    """ln(1 + exp(x)), without overflow for large x."""
    return np.logaddexp(0.0, x)


def rms_norm(x, scale, eps):
    """RMSNorm over the last axis: x / sqrt(mean(x ** 2) + eps) * scale."""
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * scale


def layer_norm(x, scale, eps):
    """LayerNorm over the last axis (biased variance): (x - mean(x)) / sqrt(mean((x - mean(x)) ** 2) + eps) * scale."""
    centred = x - np.mean(x, axis=-1, keepdims=True)
    return centred / np.sqrt(np.mean(centred**2, axis=-1, keepdims=True) + eps) * scale


def _normalize_qk(layer, q, k):
    """Step 3: QK-norm of the (B, N, T, H) queries and (B, K, S, H) keys."""
    return _qk_norm(layer, q, "query"), _qk_norm(layer, k, "key")


def _qk_norm(layer, x, kind):
    """QK-norm of one of q and k (B, heads, L, H): RMSNorm or LayerNorm (`qk_norm_type`) of each
    head or of all heads, times its scale, plus its bias with `qk_norm_bias`."""
    merged = layer._merge_heads(x)  # (B, heads, L, H) -> (B, L, heads*H)
    by_norm = _by_norm(layer, merged)  # (B, L, heads, H) or (B, L, heads*H)
    norm = layer_norm if layer.qk_norm_type == "layer" else rms_norm
    y = norm(by_norm, _norm_weight(layer, f"{kind}_norm", by_norm), layer.qk_norm_eps)
    y = y + _norm_weight(layer, f"{kind}_norm_bias", by_norm) if layer.qk_norm_bias else y
    return layer._split_heads(y.reshape(merged.shape))  # -> (B, L, heads*H) -> (B, heads, L, H)


def _by_norm(layer, y):
    """(B, L, heads*H) -> the shape QK-norm normalizes over its last axis: (B, L, heads, H)
    per head ("head", "per_head"), else (B, L, heads*H)."""
    heads = y.shape[-1] // layer.head_dim  # not -1: L may be 0
    per_head = layer.qk_norm in ("head", "per_head")
    return y.reshape(*y.shape[:2], heads, layer.head_dim) if per_head else y  # (B, L, heads, H)


def _norm_weight(layer, name, by_norm):
    """A QK-norm weight (`<kind>_norm` or `<kind>_norm_bias`) shaped to broadcast against
    `by_norm`: (H,) shared by the heads, (heads, H) one row per head, or (heads*H,)."""
    weight = layer.params[name]
    return weight if layer.qk_norm == "head" else weight.reshape(by_norm.shape[2:])  # (heads, H) or (heads*H,)


def _clip(layer, y):
    """`clip_qkv`: a projection clamped to [-c, c] (unchanged when None)."""
    return y if layer.clip_qkv is None else np.clip(y, -layer.clip_qkv, layer.clip_qkv)


def _gate_heads(layer, call, context):
    """Step 6b: the (B, N, T, Hv) attention result times sigmoid(query @ gate_kernel + gate_bias)
    (softplus with `gate_activation="softplus"`) split into heads (Hv = H without MLA); returns
    (gated result, gate). `__call__` runs it with `gate` only."""
    activation = _softplus if layer.gate_activation == "softplus" else _sigmoid
    gate = activation(layer._project(call.query, "gate"))  # (B, T, E) -> (B, T, N*Hv)
    b, t, _ = gate.shape
    gate = gate.reshape(b, t, layer.num_heads, context.shape[-1]).transpose(0, 2, 1, 3)  # -> (B, N, T, Hv)
    return context * gate, gate


def _qk_norm_backward(layer, kind, y, d_y, grads):
    """Step 3 backward for q or k from its (B, L, heads*H) clamped projection y: adds the
    gradients of `<kind>_norm` (and `<kind>_norm_bias`) to `grads`, returns y's (B, L, heads*H)."""
    by_norm = _by_norm(layer, y)  # (B, L, heads, H) or (B, L, heads*H)
    grad = d_y.reshape(by_norm.shape)  # (B, L, heads, H) or (B, L, heads*H)
    scale = _norm_weight(layer, f"{kind}_norm", by_norm)  # (H,), (heads, H) or (heads*H,)
    backward = _layer_norm_backward if layer.qk_norm_type == "layer" else _rms_norm_backward
    d_by_norm, d_scale = backward(by_norm, scale, layer.qk_norm_eps, grad)
    grads[f"{kind}_norm"] = d_scale.reshape(-1)  # (H,), (heads*H,)
    if layer.qk_norm_bias:
        grads[f"{kind}_norm_bias"] = grad.reshape(-1, *scale.shape).sum(axis=0).reshape(-1)  # the bias: summed
    return d_by_norm.reshape(y.shape)  # -> (B, L, heads*H)


def _late_qk_norm_backward(layer, call, d_q, d_k, grads):
    """Step 4 backward of QK-norm after RoPE (`qk_norm_after_rope`) from the (B, heads, L, H) gradients of the
    normalized q and k: adds the norms' gradients to `grads`, returns those of the turned q and k."""
    q, k = (layer._split_heads(_clip(layer, layer._project(getattr(call, kind), kind))) for kind in ("query", "key"))
    q, k = _rotate(layer, q, k, call.positions)  # (B, heads, L, H): the turned q and k, recomputed
    d_q = _qk_norm_backward(layer, "query", layer._merge_heads(q), layer._merge_heads(d_q), grads)  # (B, T, N*H)
    d_k = _qk_norm_backward(layer, "key", layer._merge_heads(k), layer._merge_heads(d_k), grads)  # (B, S, K*H)
    return layer._split_heads(d_q), layer._split_heads(d_k)  # -> (B, heads, L, H)


def _rms_norm_backward(x, scale, eps, grad):
    """Gradients of rms_norm(x, scale, eps) for the upstream `grad`: (d_x, d_scale), d_scale
    summed to the shape of `scale`, which broadcasts against x's trailing axes."""
    rms = np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps)
    normed = x / rms
    d_scale = (grad * normed).reshape(-1, *scale.shape).sum(axis=0)
    g = grad * scale
    return (g - normed * np.mean(g * normed, axis=-1, keepdims=True)) / rms, d_scale


def _layer_norm_backward(x, scale, eps, grad):
    """Gradients of layer_norm(x, scale, eps) for the upstream `grad`: (d_x, d_scale), d_scale
    summed to the shape of `scale`, which broadcasts against x's trailing axes."""
    centred = x - np.mean(x, axis=-1, keepdims=True)
    std = np.sqrt(np.mean(centred**2, axis=-1, keepdims=True) + eps)
    normed = centred / std
    d_scale = (grad * normed).reshape(-1, *scale.shape).sum(axis=0)
    g = grad * scale
    mean_g = np.mean(g, axis=-1, keepdims=True)
    return (g - mean_g - normed * np.mean(g * normed, axis=-1, keepdims=True)) / std, d_scale


def _context_norm_backward(layer, d_context, grads):
    """Step 7 backward of `output_norm` from the (B, N, T, Hv) gradient of the normalized heads: adds the
    gradients of `context_norm` (and `context_norm_bias`) to `grads`, returns the heads' before the norm."""
    c = layer._saved
    gated = c["context"] if c["gate"] is None else c["context"] * c["gate"]  # (B, N, T, Hv), recomputed
    merged, grad = layer._merge_heads(gated), layer._merge_heads(d_context)  # -> (B, T, N*Hv)
    backward = _layer_norm_backward if layer.output_norm == "layer" else _rms_norm_backward
    d_merged, grads["context_norm"] = backward(merged, layer.params["context_norm"], layer.output_norm_eps, grad)
    grads.update({"context_norm_bias": grad.sum(axis=(0, 1))} if layer.output_norm == "layer" else {})
    b, t, width = merged.shape
    return d_merged.reshape(b, t, layer.num_heads, width // layer.num_heads).transpose(0, 2, 1, 3)  # -> (B, N, T, Hv)


def _gate_backward(layer, d_gated, grads):
    """Step 6b backward from the (B, N, T, H) gradient of the gated result: adds the gradients
    of `gate_kernel` and `gate_bias` to `grads`; returns (d_context (B, N, T, H), the query's
    (B, T, E) gradient through the gate); `backward` runs it with `gate` only."""
    c = layer._saved
    gate, query = c["gate"], c["call"].query
    slope = -np.expm1(-gate) if layer.gate_activation == "softplus" else gate * (1.0 - gate)  # softplus' = sigmoid
    d_logits = layer._merge_heads(d_gated * c["context"] * slope)  # (B, N, T, H) -> (B, T, N*H)
    grads["gate_kernel"] = np.einsum("bte,btm->em", query, d_logits)
    grads["gate_bias"] = d_logits.sum(axis=(0, 1))
    return d_gated * gate, d_logits @ layer.params["gate_kernel"].T  # (B, N, T, H), (B, T, N*H) -> (B, T, E)


# -------------------------------------------------------------------------------------------------
# Section: KV cache and decode steps
# -------------------------------------------------------------------------------------------------
# Decoding with a KV cache: `cache = layer.init_cache(B, L)`, then `output, cache = layer(x, cache=cache)`
# for a prompt (T > 1) and then one token at a time (T = 1). The keys (rotated by RoPE) and values of the T
# new tokens are written to slots [index, index + T), and query t attends slot s iff s < index + T,
# keep[b, s], (not causal or s <= index + t), the window and the chunk keep it at position index + t (see
# `_cache_keep`; a window makes the cache roll) and `attention_mask` (given over L) keeps it. Token by token
# equals the full causal pass. The cache passed in is left unchanged: a call writes into copies.


class KVCache(NamedTuple):
    """The keys and values of the tokens decoded so far (make one with `init_cache`).

    Attributes:
        key: (B, K, L, H) projected keys, one slot per position; L is the cache's max length.
        value: (B, K, L, H) projected values.
        keep: (B, L) boolean; False marks a slot no query may attend (left padding).
        index: scalar integer, the positions written so far; position p is in slot p (with a
            `window`, slot p mod L: the cache rolls), and the next call writes from index.
        segment_ids: None, or (B, L) integers, the document of each slot (packed sequences: written
            by the first call with `segment_ids`; a query attends only the slots of its document).
        key_scale: None, or with an int8 cache (`init_cache(..., dtype="int8")`: `key` and `value`
            hold int8 integers) (B, K, L, 1) float32, the scale of each slot's key per head
            (with MLA (B, 1, L, 1), the latent's).
        value_scale: None, or (B, K, L, 1) float32, the scale of each slot's value per head (with
            MLA (B, 1, L, 1), the turned key part's).
        index_key: None, or (B, L, Hi) the sparse indexer's keys (a layer with `index_topk`).
    """

    key: np.ndarray
    value: np.ndarray
    keep: np.ndarray
    index: np.ndarray
    segment_ids: np.ndarray | None = None
    key_scale: np.ndarray | None = None
    value_scale: np.ndarray | None = None
    index_key: np.ndarray | None = None


def _results(output, weights, cache, return_attention, kv=None, selection=None):
    """output, (output, weights), (output, cache) or (output, weights, cache); the sparse indexer's
    selection before the cache where `return_topk` gives one; then `kv` if given."""
    results = (output, weights) if return_attention else (output,)
    results = results if selection is None else (*results, selection)
    results = results if cache is None else (*results, cache)
    results = results if kv is None else (*results, kv)
    return results[0] if len(results) == 1 else results


def _init_cache(layer, batch_size, max_length, keep, dtype):
    """`init_cache`: an empty `KVCache`, keys and values (B, K, L, H), or MLA's latent cache."""
    b, length = _positive_int("batch_size", batch_size), _positive_int("max_length", max_length)
    keep = np.ones((b, length), dtype=bool) if keep is None else _check_keep(keep, b, length)
    heads, key_width, value_width = layer._cache_layout
    dtype = np.float64 if dtype is None else _cache_storage(dtype)  # fp8: its codes as uint8 (int8 section)
    key, value = np.zeros((b, heads, length, key_width), dtype), np.zeros((b, heads, length, value_width), dtype)
    quantized = np.dtype(dtype) in _QUANTIZED_CACHE
    index_dtype = np.float64 if quantized else dtype  # an int8 or fp8 cache keeps the indexer's keys float
    index_key = None if layer.index_topk is None else np.zeros((b, length, layer.index_head_dim), index_dtype)
    cache = KVCache(key, value, keep.copy(), np.asarray(0), index_key=index_key)
    return cache if not quantized else _with_cache_scales(cache)  # int8 and fp8: their scales (int8 section)


def _check_cache(cache, query, key, heads, head_dim, latent):
    """Checks a KVCache against the call's (B, T, E) query and (B, S, kdim) key: keys and values
    (B, K, L, H), or with MLA the latent cache (B, 1, L, C) and (B, 1, L, Hr), in the compute
    dtype float64; returns L."""
    (b, t), s = query.shape[:2], key.shape[1]
    if t == 0:
        raise ValueError(
            "`query` must hold at least one token (T >= 1) when decoding with `cache`. "
            f"Received: query.shape={query.shape}"
        )
    if s != t:
        raise ValueError(
            "`key` and `value` must hold the T tokens of `query` when decoding with `cache` (they are written to "
            f"it). Received: query.shape={query.shape}, key.shape={key.shape}"
        )
    k, v = cache.key, cache.value
    if latent is not None:
        _check_latent_cache(k, v, b, latent)
    elif k.ndim != 4 or k.shape != v.shape or (k.shape[0], k.shape[1], k.shape[3]) != (b, heads, head_dim):
        raise ValueError(
            f"`cache.key` and `cache.value` must have shape (B, K, L, H) with B={b}, K={heads}, H={head_dim}. "
            f"Received: cache.key.shape={tuple(k.shape)}, cache.value.shape={tuple(v.shape)}"
        )
    if tuple(cache.keep.shape) != (b, k.shape[2]):
        raise ValueError(
            f"`cache.keep` must have shape (B, L)=({b}, {k.shape[2]}). "
            f"Received: cache.keep.shape={tuple(cache.keep.shape)}"
        )
    _check_cache_dtype(cache, np.float64)
    return k.shape[2]


def _check_cache_dtype(cache, dtype):
    if cache.key.dtype in _QUANTIZED_CACHE:
        return _check_quantized_cache(cache)  # int8 section (int8 and fp8)
    if cache.key.dtype != dtype or cache.value.dtype != dtype:
        raise ValueError(
            f"`cache` must hold the layer's compute dtype {np.dtype(dtype).name}; "
            "make it with `init_cache(..., dtype=...)`. "
            f"Received: cache.key.dtype={cache.key.dtype.name}, cache.value.dtype={cache.value.dtype.name}"
        )


def _check_keep(keep, batch_size, max_length):
    """Checks the (B, L) boolean `keep` of `init_cache`."""
    keep = np.asarray(keep)
    if keep.dtype != np.bool_ or keep.shape != (batch_size, max_length):
        raise ValueError(
            f"`keep` must be a boolean array of shape (B, L)=({batch_size}, {max_length}). "
            f"Received: keep.shape={tuple(keep.shape)}, keep.dtype={keep.dtype.name}"
        )
    return keep


def _check_room(index, t, length, window):
    """Without a window the T new tokens must fit (index + T <= L); with one the cache rolls, and a
    call that wraps must leave its first query's keys in place (L >= W_before + T - 1)."""
    if index + t <= length:
        return
    if window is None:
        raise _cache_full_error(index, t, length)
    before, _ = _window_sides(window)
    if length < before + t - 1:
        raise _cache_too_short_error(before, t, length)


def _cache_full_error(index, t, length):
    return ValueError(
        f"`cache` is full: index + T must be <= L (call `init_cache` with a larger `max_length`). "
        f"Received: index={index}, T={t}, L={length}"
    )


def _cache_too_short_error(window, t, length):
    return ValueError(
        "`cache` rolls with `window`: a call that wraps around it (index + T > L) needs L >= window + T - 1 "
        f"(call `init_cache` with a larger `max_length`, or decode in shorter chunks). "
        f"Received: window={window}, T={t}, L={length}"
    )


def _slot_positions(length, last):
    """(L,) the position held by each slot once positions up to `last` are written (position p in
    slot p mod L); negative where nothing is written yet."""
    slots = np.arange(length)  # (L,)
    return slots + length * ((last - slots) // length)  # (L,)


def _cache_keep(keep, index, t, causal, window, attention_chunk_size):
    """(B, L) cache keep -> (B, 1, T, L): slot s holds a written position p(s), is not padding,
    when causal p(s) is at most the query's own position index + t, with a window
    p(s) > index + t - W_before (and with a pair p(s) < index + t + W_after), and with chunks
    p(s) // C == (index + t) // C."""
    held = _slot_positions(keep.shape[-1], index + t - 1)[None, :]  # (1, L), p(s)
    positions = index + np.arange(t)[:, None]  # (T, 1), the position of each query
    allowed = (held >= 0) & (held <= positions if causal else held < index + t)  # (T, L)
    if window is not None:
        before, after = _window_sides(window)
        allowed = allowed & (held > positions - before)  # (T, L)
        allowed = allowed if after is None else allowed & (held < positions + after)  # (T, L)
    if attention_chunk_size is not None:
        allowed = allowed & (held // attention_chunk_size == positions // attention_chunk_size)  # (T, L)
    return allowed[None, None] & keep[:, None, None, :]  # (B, 1, T, L)


def _write_cache(cache, k, v, key_mask):
    """Copies the cache with (B, K, T, H) keys and values (with MLA: (B, 1, T, C) latents and
    (B, 1, T, Hr) turned key parts) of positions [index, index + T) written
    to slots position mod L, and `keep` there: the (B, T) `key_mask` ANDed into it on the first
    lap (left padding), in its place once a slot holds a new token. Room is checked before
    (`_check_room`)."""
    index, t, length = int(cache.index), k.shape[2], cache.key.shape[2]
    positions = index + np.arange(t)  # (T,)
    slots = positions % length  # (T,)
    quantized = cache.key.dtype in _QUANTIZED_CACHE
    written = _quantize_cache_entries(k, v, cache.key.dtype) if quantized else {"key": k, "value": v}  # int8 section
    fields = {name: getattr(cache, name).copy() for name in written}
    for name, new in written.items():
        fields[name][:, :, slots] = new  # (B, K, L, H) or (B, 1, L, C) and (B, 1, L, Hr); int8: scales (., 1)
    keep = cache.keep.copy()
    new = np.ones((k.shape[0], t), dtype=bool) if key_mask is None else key_mask  # (B, T)
    keep[:, slots] = np.where(positions < length, keep[:, slots] & new, new)  # (B, L)
    return cache._replace(**fields, keep=keep, index=np.asarray(index + t))


def _update_cache(layer, call, k, v, keep):
    """Step 5: writes the (B, K, T, H) keys and values into a copy of the cache; returns its
    (B, K, L, H) keys and values, keep with the cache's rule folded in (B, N|1, T, L), and the
    call with that cache, `causal` False, `window` and `attention_chunk_size` None (all now in keep)."""
    if call.cache.segment_ids is not None and not call.segmented:  # packed: the new tokens continue a document
        same, segmented = _segment_keep(layer, call, None, None)  # (B, 1, T, L)
        keep, call = _and(keep, same), call._replace(cache=segmented)
    index, t, length = int(call.cache.index), call.query.shape[1], call.cache.key.shape[2]
    _check_room(index, t, length, call.window)
    cache = _write_cache(call.cache, k, v, call.key_mask) if not layer.kv_shared else _written(call.cache, t)
    cache_keep = _cache_keep(cache.keep, index, t, call.causal, call.window, call.attention_chunk_size)
    keep = _and(keep, cache_keep)  # (B, N|1, T, L), dims may be 1
    call = call._replace(causal=False, window=None, attention_chunk_size=None, cache=cache)
    k, v = (cache.key, cache.value) if cache.key.dtype not in _QUANTIZED_CACHE else _dequantize_cache(cache)  # int8
    return k, v, keep, call


# -------------------------------------------------------------------------------------------------
# Section: shared keys and values
# -------------------------------------------------------------------------------------------------
# Cross-layer KV sharing (Gemma 3n, Gemma 4): a layer built with `kv_shared=True` has no key or value
# projections (nor `key_norm`); each call takes the keys and values of the layer that computed them through
# `shared_kv`: the (k, v) pair that layer's call returned with `return_kv=True` (after its QK-norm, RoPE and
# value norm), or, decoding, that layer's `KVCache` once it wrote this call's T tokens. The shared layer reads
# that cache (its index counts the T tokens: the queries sit at positions index - T to index - 1) and writes
# nothing: the cache is written once, by its producer, whose `key_mask` is in its keep. Steps 2 to 4 of a
# layer with any of these options are `_project_sharing`; `keys_as_values` (no value projection: v is the key
# projection, clamped, before QK-norm and RoPE) and `value_norm` (each value head RMS-normalized, no scale)
# are the options of Gemma 4's full-attention layers (`attention_k_eq_v`) and of Gemma's `v_norm`.

_SHARING_FLAGS = ("kv_shared", "keys_as_values", "value_norm")


def _check_sharing(layer, latent, kv_shared, keys_as_values, value_norm):
    """Checks and stores `kv_shared`, `keys_as_values` and `value_norm` (refused with MLA, `latent`);
    drops the projections they remove from `bias`
    (and with `keys_as_values`, vdim is kdim: v comes from `key`)."""
    values = dict(zip(_SHARING_FLAGS, (kv_shared, keys_as_values, value_norm), strict=True))
    flags = {name: _flag(name, value) for name, value in values.items()}
    if any(flags.values()) and latent is not None:
        raise ValueError(
            "`kv_shared`, `keys_as_values` and `value_norm` must be False with `kv_lora_rank` (MLA projects its "
            f"keys and values from one latent). Received: {flags}"
        )
    if any(flags.values()) and layer.query_scaling is not None:
        raise ValueError(
            "`kv_shared`, `keys_as_values` and `value_norm` must be False with `query_scaling` (no model has "
            "both: the sharing options' steps 2 to 4 scale no queries). "
            f"Received: {flags}, query_scaling={layer.query_scaling!r}"
        )
    if flags["kv_shared"] and (flags["keys_as_values"] or flags["value_norm"]):
        raise ValueError(
            "`keys_as_values` and `value_norm` must be False with `kv_shared`: the layer projects no keys or "
            f"values (their producer applies them). Received: {flags}"
        )
    for name, value in flags.items():
        setattr(layer, name, value)  # layer.kv_shared, layer.keys_as_values, layer.value_norm
    layer._sharing = any(flags.values())
    absent = _absent_projections(layer)
    layer.bias = tuple(kind for kind in layer.bias if kind not in absent)
    layer.vdim = layer.kdim if layer.keys_as_values else layer.vdim


def _absent_projections(layer):
    """The projections the sharing options remove: key and value (`kv_shared`), value (`keys_as_values`)."""
    return ("key", "value") if layer.kv_shared else ("value",) if layer.keys_as_values else ()


def _shared_cache(layer, query, cache, shared_kv):
    """`shared_kv` given: the layer must be `kv_shared` and `cache` None; a shared `KVCache` is returned
    with its index moved back by T, so that the call's checks see the cache its producer wrote to (else None)."""
    if not layer.kv_shared:
        raise ValueError(
            "`shared_kv` must be None unless the layer is built with `kv_shared=True` (then it takes its keys and "
            f"values from it). Received: shared_kv={type(shared_kv).__name__} with kv_shared=False"
        )
    if cache is not None:
        raise ValueError(
            "`cache` must be None with `shared_kv`: a layer that shares keys and values writes no cache (pass "
            "the producer's cache as `shared_kv`). Received: a cache and shared_kv"
        )
    if not isinstance(shared_kv, KVCache):
        return None
    return shared_kv._replace(index=np.asarray(shared_kv.index) - np.shape(query)[-2])


def _written(cache, t):
    """The shared cache as its producer returned it: the checked cache's index moved on by T."""
    return cache._replace(index=np.asarray(int(cache.index) + t))


def _shared_pair(layer, call, shared_kv):
    """A `kv_shared` layer's (k, v): `shared_kv` checked as a (B, K, S, H) pair for the call's (B, S) key."""
    b, s = call.key.shape[:2]
    expected = (b, layer.num_kv_heads, s, layer.head_dim)
    pair = tuple(shared_kv) if isinstance(shared_kv, (tuple, list)) else ()
    shapes = tuple(tuple(np.shape(x)) for x in pair)
    if (
        len(pair) != 2
        or shapes != (expected, expected)
        or not all(np.issubdtype(np.asarray(x).dtype, np.floating) for x in pair)
    ):
        raise ValueError(
            f"`shared_kv` must be a KVCache or a (k, v) pair of floating (B, K, S, H)={expected} arrays. "
            f"Received: {type(shared_kv).__name__} with shapes {shapes}"
        )
    return tuple(np.asarray(x, dtype=np.float64) for x in pair)


def _project_sharing(layer, call, shared_kv):
    """Steps 2 to 4 with the sharing options: q (B, N, T, H); k and v (B, K, S, H) projected (v the
    clamped key projection with `keys_as_values`, RMS-normalized with `value_norm`) or `shared_kv`
    (a shared cache, then the call's, gives None: step 5 reads it)."""
    q = layer._split_heads(_clip(layer, layer._project(call.query, "query")))  # (B, T, E) -> (B, N, T, H)
    q = q if layer.qk_norm is None else _qk_norm(layer, q, "query")
    q = q if layer._inv_freq is None else _turn(layer, q, call.positions)
    if layer.kv_shared and shared_kv is None:
        raise ValueError(
            "`shared_kv` must be given to a layer built with `kv_shared=True`: it has no key or value projections. "
            "Received: shared_kv=None"
        )
    if layer.kv_shared:
        return (q, None, None) if call.cache is not None else (q, *_shared_pair(layer, call, shared_kv))
    k, v = _own_keys_values(layer, call)  # 2. (B, K, S, H) x 2
    k = k if layer.qk_norm is None else _qk_norm(layer, k, "key")  # 3.
    k = k if layer._inv_freq is None else _turn(layer, k, call.positions)  # 4.
    return q, k, v


def _own_keys_values(layer, call):
    """The clamped key projection and the values (B, K, S, H): with `keys_as_values` the key
    projection again, with `value_norm` RMS-normalized per head without a scale."""
    k = layer._split_heads(_clip(layer, layer._project(call.key, "key")))  # (B, S, kdim) -> (B, K, S, H)
    v = k if layer.keys_as_values else _raw_values(layer, call)  # (B, K, S, H)
    return k, v if not layer.value_norm else rms_norm(v, 1.0, layer.qk_norm_eps)  # (B, K, S, H)


def _raw_values(layer, call):
    """The values before `value_norm` (B, K, S, H): the clamped value projection, or with `keys_as_values` the key's."""
    kind = "key" if layer.keys_as_values else "value"
    return layer._split_heads(_clip(layer, layer._project(getattr(call, kind), kind)))  # (B, S, D) -> (B, K, S, H)


def _sharing_backward(layer, call, d_q, d_k, d_v, grads, extra):
    """Steps 4 to 2 backward with the sharing options: the inputs' gradients; with `kv_shared` the
    shared keys' and values' gradients go to `extra` as `shared_key` and `shared_value` (B, K, S, H)."""
    d_q = _turn_back(layer, d_q, call.positions)  # 4.
    inputs = {"query": _project_backward(layer, "query", call.query, d_q, grads)}
    if layer.kv_shared:
        extra.update(shared_key=d_k, shared_value=d_v)
        return {**inputs, "key": np.zeros_like(call.key), "value": np.zeros_like(call.value)}
    if layer.value_norm:  # at the values before the norm, recomputed
        d_v, _ = _rms_norm_backward(_raw_values(layer, call), np.float64(1.0), layer.qk_norm_eps, d_v)
    d_k = _turn_back(layer, d_k, call.positions)  # 4.
    if layer.keys_as_values:
        inputs["key"] = _project_backward(layer, "key", call.key, d_k, grads, layer._merge_heads(d_v))
        return {**inputs, "value": np.zeros_like(call.value)}
    inputs["key"] = _project_backward(layer, "key", call.key, d_k, grads)
    inputs["value"] = _project_backward(layer, "value", call.value, d_v, grads)
    return inputs


# -------------------------------------------------------------------------------------------------
# Section: multi-head latent attention
# -------------------------------------------------------------------------------------------------
# MLA (`kv_lora_rank`, docs/SPEC.md "Multi-head latent attention"): q as above (or through query_a, RMSNorm
# and query_b with `q_lora_rank`); a = key @ key_value_a_kernel (B, S, C + Hr), the latent
# c = RMSNorm(a[..., :C]) and the shared k_rope = a[..., C:]; RoPE turns the last Hr features of q and
# k_rope; the cache holds c and k_rope; [k_nope, v] = c @ key_value_b_kernel per head,
# k = concat(k_nope, k_rope), or the absorbed path on the latents (`absorb_latents`).


_LATENT_SIZES = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_ABSORB_MAX_T = 8  # `absorb_latents=None`: a call with a cache and T <= 8 attends on the latents


class _Latent(NamedTuple):
    """The sizes of multi-head latent attention (MLA), checked (`_check_latent`)."""

    kv_lora_rank: int  # C
    q_lora_rank: int | None  # Q, None: a plain query projection
    qk_nope_head_dim: int  # Hn
    qk_rope_head_dim: int  # Hr
    v_head_dim: int  # Hv


def _check_latent(kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim):
    """Checks the MLA sizes (each None or a positive integer, in the signature's order) and returns
    a `_Latent`, or None without `kv_lora_rank`, when the others must be None too."""
    sizes = dict(
        zip(_LATENT_SIZES, (kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim), strict=True)
    )
    for name, value in sizes.items():
        sizes[name] = None if value is None else _positive_int(name, value)
    if sizes["kv_lora_rank"] is None:
        for name in (name for name in _LATENT_SIZES[1:] if sizes[name] is not None):
            raise ValueError(
                f"`{name}` needs `kv_lora_rank` (multi-head latent attention). "
                f"Received: {name}={sizes[name]!r}, kv_lora_rank=None"
            )
        return None
    missing = [name for name in _LATENT_SIZES[2:] if sizes[name] is None]
    if missing:
        raise ValueError(
            "`kv_lora_rank` needs `qk_nope_head_dim`, `qk_rope_head_dim` and `v_head_dim`. "
            f"Received: kv_lora_rank={sizes['kv_lora_rank']}, {', '.join(f'{name}=None' for name in missing)}"
        )
    return _Latent(**sizes)


def _latent_head_dim(latent, head_dim):
    """H with MLA: qk_nope_head_dim + qk_rope_head_dim, which `head_dim`, if given, must equal."""
    width = latent.qk_nope_head_dim + latent.qk_rope_head_dim
    if head_dim is not None and not (_is_positive_int(head_dim) and head_dim == width):
        raise ValueError(
            f"`head_dim` must equal qk_nope_head_dim + qk_rope_head_dim = {width} with `kv_lora_rank`. "
            f"Received: head_dim={head_dim!r}"
        )
    return width


def _check_latent_combinations(vdim, variants):
    """What MLA refuses, each with why (after every argument's own check)."""
    refused = (
        ("vdim", vdim, vdim is not None, "MLA reads keys and values from `key` (its width is `kdim`)"),
        ("qk_norm", variants.qk_norm, variants.qk_norm is not None, "MLA normalizes the latents instead"),
        ("clip_qkv", variants.clip_qkv, variants.clip_qkv is not None, "MLA has no q, k and v to clamp"),
        ("rope_sections", variants.rope_sections, variants.rope_sections is not None, "RoPE turns the Hr features"),
        ("rope_fraction", variants.rope_fraction, variants.rope_fraction != 1.0, "RoPE turns all Hr features"),
    )
    for name, value, given, why in refused:
        if given:
            raise ValueError(f"`{name}` is not supported with `kv_lora_rank`: {why}. Received: {name}={value!r}")


def _projections(latent):
    """The names `bias` takes: the layer's projections, query, key, value, output (with MLA query,
    or query_a and query_b, key_value_a, key_value_b, output), then the gate's."""
    if latent is None:
        return _PROJECTIONS
    query = ("query",) if latent.q_lora_rank is None else ("query_a", "query_b")
    return (*query, "key_value_a", "key_value_b", "output", "gate")


def _refuse_latent_value():
    """MLA reads keys and values from `key`: a call's `value` other than `key` is refused."""
    raise ValueError(
        "`value` must be None or `key` itself with `kv_lora_rank`: MLA reads keys and values from `key`. "
        "Received: a value other than key"
    )


def _latent_shapes(layer):
    """The float portable layout with MLA (docs/SPEC.md "Weights")."""
    latent, n, k, h = layer._latent, layer.num_heads, layer.num_kv_heads, layer.head_dim
    c, q, hn, hr, hv = latent.kv_lora_rank, latent.q_lora_rank, *latent[2:]
    norms = {"query_a": (q,), "key_value_a": (c,)}
    kernels = {
        "query": (layer.d_model, n * h),
        "query_a": (layer.d_model, q),
        "query_b": (q, n * h),
        "key_value_a": (layer.kdim, c + hr),
        "key_value_b": (c, k * (hn + hv)),
        "output": (n * hv, layer.d_model),
    }
    shapes = {}
    for kind in _projections(latent)[:-1]:
        shapes[f"{kind}_kernel"] = kernels[kind]
        shapes.update({f"{kind}_bias": kernels[kind][1:]} if kind in layer.bias else {})
        shapes.update({f"{kind}_norm": norms[kind]} if kind in norms else {})
    shapes.update({"sinks": (n,)} if layer.sinks else {})
    shapes.update({"gate_kernel": (layer.d_model, n * hv)} if layer.gate else {})  # the gate's width is Hv
    shapes.update({"gate_bias": (n * hv,)} if layer.gate and "gate" in layer.bias else {})
    return shapes


def _latent_cache_layout(latent):
    """MLA's KVCache: (heads, key width, value width) = (1, C, Hr), the latents and k_rope."""
    return 1, latent.kv_lora_rank, latent.qk_rope_head_dim


def _check_latent_cache(k, v, batch_size, latent):
    """The latent cache: (B, 1, L, C) latents and (B, 1, L, Hr) turned key parts."""
    c, hr = latent.kv_lora_rank, latent.qk_rope_head_dim
    valid = k.ndim == v.ndim == 4 and k.shape[:3] == v.shape[:3]
    if not valid or (k.shape[0], k.shape[1], k.shape[3], v.shape[3]) != (batch_size, 1, c, hr):
        raise ValueError(
            "`cache.key` and `cache.value` must have shape (B, 1, L, C) and (B, 1, L, Hr) with kv_lora_rank: "
            f"B={batch_size}, C={c}, Hr={hr}. "
            f"Received: cache.key.shape={tuple(k.shape)}, cache.value.shape={tuple(v.shape)}"
        )


def _project_latent(layer, call):
    """Steps 2 to 4 with MLA (no QK-norm): q (B, N, T, H), through query_a, its RMSNorm and
    query_b with Q; the latents c = RMSNorm(a[..., :C]) (B, 1, S, C) and k_rope = a[..., C:]
    (B, 1, S, Hr) of a = key @ key_value_a_kernel; RoPE of q's and k_rope's last Hr features."""
    q = layer._split_heads(_project_query(layer, call.query))  # (B, T, E) -> (B, N, T, H)
    c = layer.kv_lora_rank
    a = layer._project(call.key, "key_value_a")  # (B, S, kdim) -> (B, S, C + Hr)
    latent = rms_norm(a[..., :c], layer.params["key_value_a_norm"], layer.latent_norm_eps)  # (B, S, C)
    k_rope = a[:, None, :, c:]  # (B, 1, S, Hr)
    if layer.rope_theta is not None:
        q, k_rope = _rotate_latent(layer, q, k_rope, call.positions)  # step 4
    q = q if layer.query_scaling is None else q * _query_scales(layer, call)  # step 4b
    return q, latent[:, None], k_rope  # (B, N, T, H), (B, 1, S, C), (B, 1, S, Hr)


def _rotate_latent(layer, q, k_rope, positions):
    """Step 4 with MLA: RoPE of the last Hr features of the (B, N, T, H) queries and of the
    (B, 1, T, Hr) k_rope shared by the heads, at (B, T) positions."""
    hn = layer.qk_nope_head_dim
    q_rope = _turn(layer, q[..., hn:], positions)  # (B, N, T, Hr)
    return np.concatenate([q[..., :hn], q_rope], axis=-1), _turn(layer, k_rope, positions)  # (B, N, T, H)


def _project_query(layer, x):
    """(B, T, E) -> (B, T, N*H): the query projection, with MLA's `q_lora_rank` through
    query_a (B, T, Q), its RMSNorm and query_b."""
    if layer.q_lora_rank is None:
        return layer._project(x, "query")
    a = layer._project(x, "query_a")  # (B, T, E) -> (B, T, Q)
    normed = rms_norm(a, layer.params["query_a_norm"], layer.latent_norm_eps)  # (B, T, Q)
    return layer._project(normed, "query_b")  # (B, T, Q) -> (B, T, N*H)


def _attend_latent(layer, q, latent, k_rope, keep, bias, call):
    """Step 6 with MLA: on the latents (`_attend_absorbed`), or with the keys and values expanded."""
    if _absorbs(layer, call, q.shape[2]):
        return _attend_absorbed(layer, q, latent, k_rope, keep, bias, call)
    k, v = _expand_latents(layer, latent, k_rope)  # (B, K, S, H), (B, K, S, Hv)
    return layer._attend(q, k, v, keep, bias, call)


def _absorbs(layer, call, t):
    """MLA's path: `absorb_latents` if set, else absorbed with a cache and T <= 8."""
    if layer.absorb_latents is not None:
        return bool(layer.absorb_latents)
    return call.cache is not None and t <= _ABSORB_MAX_T


def _expand_latents(layer, latent, k_rope):
    """MLA's up-projection: (B, 1, S, C) latents and (B, 1, S, Hr) k_rope -> keys
    concat(k_nope, k_rope) (B, K, S, H) and values (B, K, S, Hv)."""
    kv = layer._project(latent[:, 0], "key_value_b")  # (B, S, C) -> (B, S, K*(Hn + Hv))
    b, s, _ = kv.shape
    kv = kv.reshape(b, s, layer.num_kv_heads, -1).transpose(0, 2, 1, 3)  # -> (B, K, S, Hn + Hv)
    hn = layer.qk_nope_head_dim
    k_rope = np.broadcast_to(k_rope, (b, layer.num_kv_heads, s, k_rope.shape[-1]))  # (B, K, S, Hr)
    return np.concatenate([kv[..., :hn], k_rope], axis=-1), kv[..., hn:]  # (B, K, S, H), (B, K, S, Hv)


def _up_projections(layer):
    """key_value_b's kernel as float (C, N, Hn) and (C, N, Hv) and its bias (N, Hn) and (N, Hv)
    (None without one), each key/value head's repeated for its N // K query heads."""
    kernel = layer.params["key_value_b_kernel"].astype(np.float64)  # (C, K*(Hn + Hv))
    if layer.quantization_mode == "int8":
        kernel = kernel * layer.params["key_value_b_kernel_scale"]  # dequantized
    groups, hn = layer.num_heads // layer.num_kv_heads, layer.qk_nope_head_dim
    kernel = np.repeat(kernel.reshape(kernel.shape[0], layer.num_kv_heads, -1), groups, axis=1)  # (C, N, Hn + Hv)
    bias = layer.params.get("key_value_b_bias")
    bias = None if bias is None else np.repeat(bias.reshape(layer.num_kv_heads, -1), groups, axis=0)  # (N, Hn + Hv)
    split = (None, None) if bias is None else (bias[:, :hn], bias[:, hn:])
    return kernel[..., :hn], kernel[..., hn:], *split


def _attend_absorbed(layer, q, latent, k_rope, keep, bias, call):
    """Step 6 with MLA on the latents: q_lat = q_nope @ W_kb^T (B, N, T, C) meets the latents,
    q_rope meets k_rope (and q_nope . b_k a key of ones), o_lat = weights @ latents, and each
    head's context is o_lat @ W_vb + sum(weights) * b_v (B, N, T, Hv)."""
    w_kb, w_vb, b_k, b_v = _up_projections(layer)  # (C, N, Hn), (C, N, Hv), (N, Hn), (N, Hv)
    if layer.quantization_mode == "int8":  # the latents as the int8 up-projection reads them
        integers, latent_scale = _quantize_rows(latent)
        latent = integers * latent_scale  # (B, 1, S, C)
    hn = layer.qk_nope_head_dim
    q_nope = q[..., :hn]  # (B, N, T, Hn)
    queries = [np.einsum("bnth,cnh->bntc", q_nope, w_kb), q[..., hn:]]  # (B, N, T, C), (B, N, T, Hr)
    keys = [latent, k_rope]  # (B, 1, S, C), (B, 1, S, Hr)
    if b_k is not None:
        queries.append(np.einsum("bnth,nh->bnt", q_nope, b_k)[..., None])  # (B, N, T, 1)
        keys.append(np.ones((*k_rope.shape[:3], 1)))  # (B, 1, S, 1)
    q_abs, k_abs = np.concatenate(queries, axis=-1), np.concatenate(keys, axis=-1)  # (B, N, T, .), (B, 1, S, .)
    o_lat, weights = layer._attend(q_abs, k_abs, latent, keep, bias, call)  # (B, N, T, C)
    context = np.einsum("bntc,cnv->bntv", o_lat, w_vb)  # (B, N, T, C) -> (B, N, T, Hv)
    if b_v is not None:
        context = context + weights.sum(axis=-1, keepdims=True) * b_v[None, :, None, :]  # (B, N, T, Hv)
    return context, weights


def _latent_backward(layer, call, latent, d_q, d_k, d_v, grads):
    """Steps 6 (the up-projection), 4 and 2 backward with MLA, from the (B, 1, S, C) latents and
    the gradients of q (B, N, T, H), the expanded keys (B, K, S, H) and values (B, K, S, Hv):
    adds every latent weight's gradient to `grads`, returns the inputs' (value: zeros)."""
    hn, c = layer.qk_nope_head_dim, layer.kv_lora_rank
    d_k_rope = d_k[..., hn:].sum(axis=1, keepdims=True)  # (B, K, S, Hr) -> (B, 1, S, Hr), shared by the heads
    d_kv = np.concatenate([d_k[..., :hn], d_v], axis=-1)  # (B, K, S, Hn + Hv)
    d_kv = d_kv.transpose(0, 2, 1, 3).reshape(*d_kv.shape[:1], d_kv.shape[2], -1)  # -> (B, S, K*(Hn + Hv))
    d_latent = _linear_backward(layer, "key_value_b", latent[:, 0], d_kv, grads)  # (B, S, C)
    d_q = np.concatenate([d_q[..., :hn], _turn_back(layer, d_q[..., hn:], call.positions)], axis=-1)  # 4. RoPE
    d_k_rope = _turn_back(layer, d_k_rope, call.positions)[:, 0]  # (B, 1, S, Hr) -> (B, S, Hr)
    a = layer._project(call.key, "key_value_a")  # (B, S, C + Hr), recomputed
    d_a, grads["key_value_a_norm"] = _rms_norm_backward(
        a[..., :c], layer.params["key_value_a_norm"], layer.latent_norm_eps, d_latent
    )
    d_a = np.concatenate([d_a, d_k_rope], axis=-1)  # (B, S, C + Hr)
    d_key = _linear_backward(layer, "key_value_a", call.key, d_a, grads)  # (B, S, kdim)
    d_query = _query_backward(layer, call.query, layer._merge_heads(d_q), grads)  # (B, T, E)
    return {"query": d_query, "key": d_key, "value": np.zeros_like(call.key)}


def _query_backward(layer, x, d_y, grads):
    """The query projection's backward (through query_b, the RMSNorm and query_a with
    `q_lora_rank`) for the (B, T, N*H) gradient of q: returns the (B, T, E) input's."""
    if layer.q_lora_rank is None:
        return _linear_backward(layer, "query", x, d_y, grads)
    a = layer._project(x, "query_a")  # (B, T, Q), recomputed
    normed = rms_norm(a, layer.params["query_a_norm"], layer.latent_norm_eps)  # (B, T, Q)
    d_normed = _linear_backward(layer, "query_b", normed, d_y, grads)  # (B, T, Q)
    d_a, grads["query_a_norm"] = _rms_norm_backward(a, layer.params["query_a_norm"], layer.latent_norm_eps, d_normed)
    return _linear_backward(layer, "query_a", x, d_a, grads)  # (B, T, E)


def _query_latent(layer, query):
    """(B, T, E) -> the sparse indexer's query input: MLA's normalized q latent (B, T, Q) with
    `q_lora_rank`, else `query` itself."""
    if layer.q_lora_rank is None:
        return query
    a = layer._project(query, "query_a")  # (B, T, E) -> (B, T, Q)
    return rms_norm(a, layer.params["query_a_norm"], layer.latent_norm_eps)  # (B, T, Q)


def _index_inputs(layer):
    """What the sparse indexer reads of MLA: whether it is on, Hr where RoPE turns (else None), and
    the width of the indexer's query input (Q with `q_lora_rank`, else E)."""
    rope_width = None if layer.rope_theta is None or layer._latent is None else layer.qk_rope_head_dim
    return layer._latent is not None, rope_width, layer.d_model if layer.q_lora_rank is None else layer.q_lora_rank


# -------------------------------------------------------------------------------------------------
# Section: sparse indexer
# -------------------------------------------------------------------------------------------------
# DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-MoE-DSA) on MLA, `index_topk` and the sizes after it:
# a small indexer scores every key for each query (Ni heads of width Hi, relu, weights per head), and
# each query attends only to its top-k allowed keys, ties ranked by the lower key index (a stable
# sort). `topk_indices` passes another layer's selection in, `return_topk` returns the one used. The
# indexer's keys are cached in `KVCache.index_key`; no gradient reaches the indexer through the top-k.
# Mistral Large 4's indexer: a LayerNorm of the query input (`index_query_input_norm`) and, with the learned
# `query_scaling`, its queries scaled per indexer head by their own learned weights.

_INDEX_NORM_EPS = 1e-6  # the indexer's key LayerNorm (transformers' `k_norm`)
_INDEX_SIZES = ("index_topk", "index_num_heads", "index_head_dim")


def _init_indexer(layer, index_topk, index_num_heads, index_head_dim, index_rope_interleaved, index_query_input_norm):
    """Checks the indexer's options (after every other argument), holds them as attributes and adds
    the learned query scaling's weights, then its own, to the float layout (none without `index_topk`)."""
    sizes = dict(zip(_INDEX_SIZES, (index_topk, index_num_heads, index_head_dim), strict=True))
    sizes = {name: None if value is None else _positive_int(name, value) for name, value in sizes.items()}
    layer.index_rope_interleaved = _flag("index_rope_interleaved", index_rope_interleaved)
    layer.index_query_input_norm = _flag("index_query_input_norm", index_query_input_norm)
    latent, rope_width, layer._index_source = _index_inputs(layer)  # MLA's: on, Hr with RoPE, the query input's width
    _check_indexer(sizes, latent, rope_width)
    if layer.index_query_input_norm and sizes["index_topk"] is None:
        raise ValueError(
            "`index_query_input_norm` needs `index_topk` (the sparse indexer). Received: index_query_input_norm=True"
        )
    for name, value in sizes.items():
        setattr(layer, name, value)  # layer.index_topk, layer.index_num_heads, layer.index_head_dim
    layer._float_layout.update(_query_scaling_shapes(layer))  # the learned query scaling's (section: positions)
    layer._float_layout.update(_index_shapes(layer))


def _check_indexer(sizes, latent, rope_width):
    """The indexer's combinations: `index_topk` needs MLA and both sizes, the sizes need `index_topk`,
    and with RoPE (of width Hr = `rope_width`) Hi >= Hr."""
    topk = sizes["index_topk"]
    if topk is None:
        for name in (name for name in _INDEX_SIZES[1:] if sizes[name] is not None):
            raise ValueError(
                f"`{name}` needs `index_topk` (the sparse indexer). Received: {name}={sizes[name]!r}, index_topk=None"
            )
        return
    if not latent:
        raise ValueError(
            "`index_topk` needs `kv_lora_rank` (multi-head latent attention). "
            f"Received: index_topk={topk}, kv_lora_rank=None"
        )
    missing = [name for name in _INDEX_SIZES[1:] if sizes[name] is None]
    if missing:
        raise ValueError(
            "`index_topk` needs `index_num_heads` and `index_head_dim`. "
            f"Received: index_topk={topk}, {', '.join(f'{name}=None' for name in missing)}"
        )
    if rope_width is not None and sizes["index_head_dim"] < rope_width:
        raise ValueError(
            f"`index_head_dim` must be at least qk_rope_head_dim = {rope_width} with RoPE: the indexer turns its "
            f"first Hr features. Received: index_head_dim={sizes['index_head_dim']}"
        )


def _index_shapes(layer):
    """The indexer's portable weights {name: shape} (docs/SPEC.md "Sparse indexer (DSA)"), none without it."""
    if layer.index_topk is None:
        return {}
    ni, hi = layer.index_num_heads, layer.index_head_dim
    shapes = {"index_query_norm": (layer._index_source,), "index_query_norm_bias": (layer._index_source,)}
    shapes = shapes if layer.index_query_input_norm else {}
    shapes |= {
        "index_query_kernel": (layer._index_source, ni * hi),
        "index_key_kernel": (layer.kdim, hi),
        "index_key_norm": (hi,),
        "index_key_norm_bias": (hi,),
        "index_weights_kernel": (layer.d_model, ni),
    }
    learned = layer.query_scaling is not None and layer.query_scaling["type"] == "learned"
    return shapes | ({"index_query_scaling_scale": (ni,), "index_query_scaling_bias": (ni,)} if learned else {})


def _check_topk_indices(indices, batch_size, t):
    """`topk_indices` as an integer (B, T, k) array."""
    indices = np.asarray(indices)
    if indices.ndim != 3 or indices.shape[:2] != (batch_size, t) or not np.issubdtype(indices.dtype, np.integer):
        raise ValueError(
            f"`topk_indices` must be an integer tensor of shape (B, T, k) with B={batch_size}, T={t}. "
            f"Received: topk_indices.shape={indices.shape}, topk_indices.dtype={indices.dtype}"
        )
    return indices


def _sparse_keep(layer, q, k, keep, call, topk_indices, return_topk):
    """Step 5b: the selection (the layer's indexer's, or `topk_indices`) ANDed into keep, which then
    broadcasts to (B, N, T, S); with a cache the new tokens' indexer keys written to `index_key`.
    Returns (keep, call, selection (B, T, k) int32 with `return_topk`, else None)."""
    (b, t), s = q.shape[0::2], k.shape[2]  # S: the keys attended (the cache's L slots)
    if topk_indices is None and layer.index_topk is None:
        raise ValueError("`return_topk` needs `index_topk` or `topk_indices`. Received: return_topk=True")
    if topk_indices is not None:
        selection = _check_topk_indices(topk_indices, b, t)
    else:
        ki = _index_keys(layer, call.key, call.positions)  # (B, T or S, Hi)
        if call.cache is not None:
            call = call._replace(cache=_write_index_cache(call.cache, ki))
            ki = call.cache.index_key  # (B, L, Hi)
        allowed = _full_keep(keep, t, s, call.causal, call.window, call.attention_chunk_size)  # (B|1, N|1, T, S)
        allowed = np.broadcast_to(allowed.any(axis=1), (b, t, s))  # (B, T, S): kept for some head
        scores = _index_scores(layer, call.query, _index_positions(call), ki)  # (B, T, S)
        selection = _select_topk(scores, allowed, min(layer.index_topk, s))  # (B, T, k)
    keep = _and(keep, _selection_keep(selection, s))  # (B, N|1, T, S)
    return keep, call, selection.astype(np.int32) if return_topk else None


def _index_keys(layer, key, positions):
    """(B, S, kdim) -> (B, S, Hi): the indexer's keys, LayerNorm (scale and bias) and RoPE of their
    first Hr features."""
    p = layer.params
    ki = layer_norm(key @ p["index_key_kernel"], p["index_key_norm"], _INDEX_NORM_EPS) + p["index_key_norm_bias"]
    return _turn_index(layer, ki[:, None], positions)[:, 0]  # (B, 1, S, Hi) -> (B, S, Hi)


def _index_positions(call):
    """The (B|1, T) positions of the indexer's queries: the call's RoPE positions, else i + t from the
    cache's index i before the call (the call's cache is the written one, its index i + T)."""
    if call.positions is not None:
        return call.positions  # (B, T)
    t = call.query.shape[1]
    return ((0 if call.cache is None else int(call.cache.index) - t) + np.arange(t))[None]  # (1, T)


def _index_scores(layer, query, positions, ki):
    """The indexer's scores (B, T, S) of (B, T, E) queries against (B, S, Hi) keys at (B|1, T) positions:
    sum_n w[n] * Ni**-0.5 * relu(qi[n] . ki * Hi**-0.5), in float64."""
    p, ni, hi = layer.params, layer.index_num_heads, layer.index_head_dim
    source = _query_latent(layer, query)  # (B, T, Q), or (B, T, E) without `q_lora_rank`
    if layer.index_query_input_norm:
        source = layer_norm(source, p["index_query_norm"], _INDEX_NORM_EPS) + p["index_query_norm_bias"]
    b, t, _ = query.shape
    qi = (source @ p["index_query_kernel"]).reshape(b, t, ni, hi).transpose(0, 2, 1, 3)  # -> (B, Ni, T, Hi)
    if "index_query_scaling_scale" in p:
        qi = qi * _learned_scales(p["index_query_scaling_scale"], p["index_query_scaling_bias"], positions)
    qi = _turn_index(layer, qi, positions)  # (B, Ni, T, Hi)
    w = (query @ p["index_weights_kernel"]) * ni**-0.5  # (B, T, E) -> (B, T, Ni)
    dots = np.maximum(np.einsum("bnth,bsh->bnts", qi, ki) * hi**-0.5, 0.0)  # (B, Ni, T, S)
    return np.einsum("bnts,btn->bts", dots, w)  # (B, T, S)


def _turn_index(layer, x, positions):
    """RoPE of the first Hr features of each indexer head of x (B, heads, T, Hi), paired by
    `index_rope_interleaved`, times YaRN's factor; unchanged without RoPE."""
    if layer._inv_freq is None:
        return x
    x = apply_rope(x, positions, layer._inv_freq, layer.index_rope_interleaved)  # (B, heads, T, Hi)
    return scale_rotated(x, 2 * layer._inv_freq.shape[0], rope_attention_factor(layer.rope_scaling))


def _select_topk(scores, allowed, k):
    """The first k keys of each row ranked by score, highest first, equal scores by the lower key index,
    disallowed keys after every allowed one: a stable sort. (B, T, S) -> (B, T, k)."""
    ranked = np.where(allowed, scores, np.finfo(scores.dtype).min)  # (B, T, S)
    return np.argsort(-ranked, axis=-1, kind="stable")[..., :k]  # (B, T, k)


def _selection_keep(selection, s):
    """(B, T, k) key indices -> (B, 1, T, S) boolean, True at the selected keys (an index outside
    [0, S) selects nothing)."""
    b, t, _ = selection.shape
    keep = np.zeros((b, t, s + 1), dtype=bool)  # (B, T, S + 1): column S takes the indices out of range
    valid = (selection >= 0) & (selection < s)
    np.put_along_axis(keep, np.where(valid, selection, s), True, axis=-1)
    return keep[:, None, :, :s]  # (B, 1, T, S)


def _write_index_cache(cache, ki):
    """A copy of the cache with the (B, T, Hi) indexer keys of the T tokens just written (positions
    [index - T, index)) at slots position mod L of `index_key`."""
    index, t, length = int(cache.index), ki.shape[1], cache.key.shape[2]
    expected = (ki.shape[0], length, ki.shape[2])
    if cache.index_key is None or tuple(np.shape(cache.index_key)) != expected:
        shape = None if cache.index_key is None else tuple(np.shape(cache.index_key))
        raise ValueError(
            f"`cache.index_key` must have shape (B, L, Hi)={expected} with index_topk (make the cache with "
            f"`init_cache`). Received: cache.index_key.shape={shape}"
        )
    slots = (index - t + np.arange(t)) % length  # (T,)
    index_key = cache.index_key.copy()  # (B, L, Hi)
    index_key[:, slots] = ki
    return cache._replace(index_key=index_key)


def _indexer_grads(layer):
    """The indexer's weights' gradients: zeros (no gradient flows through the top-k)."""
    return {name: np.zeros(shape) for name, shape in _index_shapes(layer).items()}


# -------------------------------------------------------------------------------------------------
# Section: speed paths
# -------------------------------------------------------------------------------------------------
# NumPy has no speed paths: the reference computes every case explicitly, on one code path.


# -------------------------------------------------------------------------------------------------
# Section: int8
# -------------------------------------------------------------------------------------------------


# Keras' scheme (docs/SPEC.md, "int8"): `keras.quantizers.abs_max_quantize` on the kernels (per
# output column) and on the inputs of each projection (per token, at run time).
_INT8_MAX = 127.0
_INT8_EPSILON = 1e-7  # Keras' `backend.epsilon()`, added to the abs-max before dividing


def _quantize(layer, mode):
    """`quantize`: the kernels to int8, each with its float32 scale per output column."""
    if mode != "int8":
        raise ValueError(f"`mode` must be 'int8'. Received: mode={mode!r}")
    if layer.quantization_mode is not None:
        raise ValueError(f"The layer is already quantized. Received: mode={mode!r}")
    params = dict(layer.params)
    for name in (
        name for name in _with_scales(layer.weight_shapes()) if f"{name}_scale" in _with_scales(layer.weight_shapes())
    ):  # the gate's too, not the indexer's
        params[name], params[f"{name}_scale"] = _quantize_kernel(params[name])
    layer.params = {name: params[name] for name in _with_scales(layer.weight_shapes())}


def _quantize_kernel(kernel):
    """A float (D, F) kernel -> (int8 (D, F) kernel, float32 (F,) kernel_scale), computed in float32
    as Keras' `abs_max_quantize(kernel, axis=0)`: r = 127 / (max |column| + 1e-7), the integers
    round(kernel * r) (half to even) clipped to [-127, 127], and kernel_scale = 1 / r (Keras
    keeps r and divides by it)."""
    kernel = np.asarray(kernel, dtype=np.float32)
    ratio = np.float32(_INT8_MAX) / (np.max(np.abs(kernel), axis=0) + np.float32(_INT8_EPSILON))  # (F,)
    quantized = np.clip(np.round(kernel * ratio), -_INT8_MAX, _INT8_MAX).astype(np.int8)  # (D, F)
    return quantized, (np.float32(1.0) / ratio).astype(np.float32)


def _quantize_rows(x):
    """Per-token run-time quantization of x (..., D): (integers (..., D) as floats, x_scale (..., 1))
    with r = 127 / (max |row| + 1e-7), round(x * r) clipped to [-127, 127], x_scale = 1 / r."""
    ratio = _INT8_MAX / (np.max(np.abs(x), axis=-1, keepdims=True) + _INT8_EPSILON)  # (..., 1)
    return np.clip(np.round(x * ratio), -_INT8_MAX, _INT8_MAX), 1.0 / ratio


def _int8_matmul(x, kernel, kernel_scale):
    """(B, L, D) @ an int8 (D, F) kernel: (quantize(x) @ kernel) * x_scale * kernel_scale, (B, L, F)."""
    x_int, x_scale = _quantize_rows(x)  # (B, L, D), (B, L, 1)
    accumulated = x_int @ kernel.astype(np.float64)  # (B, L, D) @ (D, F) -> (B, L, F), exact integers
    return accumulated * (x_scale * kernel_scale.astype(np.float64))  # (B, L, F)


# The int8 and fp8 KV caches (docs/SPEC.md, "KV-cache decoding"): each slot's key and value of each head
# (with MLA its latent and its turned key part) stored as int8 (absmax / 127) or float8_e4m3fn (absmax / 448)
# with one float32 scale, computed in float32. NumPy has no fp8 type: an fp8 cache holds each value's
# e4m3fn code (sign, 4 exponent bits biased by 7, 3 mantissa bits) as uint8, the bits the frameworks
# store, rounded here as their casts round. The reference attends the dequantised cache in float64.
_FP8 = "float8_e4m3fn"
_FP8_MAX = 448.0  # e4m3fn's largest finite value, 1.75 * 2^8 (no infinities; code 0x7F is NaN)
_FP8_MIN_EXPONENT = -6  # the smallest normal's exponent: below it the subnormals, quantum 2^-9
_QUANTIZED_CACHE = (np.dtype(np.int8), np.dtype(np.uint8))  # an int8 cache's integers, an fp8 cache's codes


def _cache_storage(dtype):
    """`init_cache`'s dtype -> the NumPy dtype its keys and values are held in: uint8 codes for
    "float8_e4m3fn" (the name, or any dtype of that name, such as ml_dtypes'), else the dtype."""
    return np.uint8 if str(getattr(dtype, "__name__", dtype)) == _FP8 else dtype


def _quantize_cache_rows(x, dtype=np.int8):
    """(..., D) keys or values -> (int8 integers, or with `dtype` uint8 the fp8 codes (..., D),
    float32 scale (..., 1)), in float32: scale = max |x| / 127 (fp8: / 448) over D; the integers
    round(x / scale) (half to even) clipped to [-127, 127], the codes those of x / scale clipped
    to [-448, 448] and rounded to e4m3fn (`_fp8_codes`); a row whose scale is 0 stores scale 0
    and zeros."""
    x = np.asarray(x, dtype=np.float32)
    top = _INT8_MAX if np.dtype(dtype) == np.int8 else _FP8_MAX
    scale = np.max(np.abs(x), axis=-1, keepdims=True) / np.float32(top)  # (..., 1)
    divisor = np.where(scale == 0, np.float32(1), scale)  # (..., 1); x is 0 (or below `top` subnormals) there
    if np.dtype(dtype) != np.int8:
        return _fp8_codes(np.clip(x / divisor, -_FP8_MAX, _FP8_MAX)), scale.astype(np.float32)  # (..., D), (..., 1)
    integers = np.clip(np.round(x / divisor), -_INT8_MAX, _INT8_MAX).astype(np.int8)  # (..., D)
    return integers, scale.astype(np.float32)


def _fp8_codes(y):
    """float32 y (...) in [-448, 448] -> its uint8 e4m3fn codes (...), rounded to nearest, ties to
    even, at 3 mantissa bits: with e = max(floor(log2 |y|), -6), the quantum is 2^(e - 3) and the
    code 8 (e + 6) + round(|y| / quantum) (a rounding up to the next power of two carries into the
    exponent bits; e = -6 holds the subnormals too, code |y| / 2^-9), plus 128 for a negative sign
    (-0 too, as the frameworks' casts keep it). Every step is exact in float32."""
    magnitude = np.abs(y).astype(np.float32)  # (...)
    exponent = np.frexp(np.maximum(magnitude, np.float32(2.0**_FP8_MIN_EXPONENT)))[1] - 1  # (...), e
    steps = np.round(magnitude / np.ldexp(np.float32(1), exponent - 3))  # (...), |y| / quantum, half to even
    return (8 * (exponent + 6) + steps + 128 * np.signbit(y)).astype(np.uint8)  # (...)


def _fp8_values(codes):
    """uint8 e4m3fn codes (...) -> their values as float64 (...): exponent bits E and mantissa bits
    M give (8 + M) * 2^(E - 10), or M * 2^-9 where E is 0 (subnormal); the sign bit negates."""
    codes = np.asarray(codes).astype(np.int64)  # (...)
    exponent, mantissa = (codes >> 3) & 15, codes & 7  # (...) each
    magnitude = np.ldexp((mantissa + 8 * (exponent > 0)).astype(np.float64), np.maximum(exponent, 1) - 10)
    return np.where(codes >= 128, -magnitude, magnitude)  # (...)


def _quantize_cache_entries(k, v, dtype=np.int8):
    """The (B, K, T, H) new keys and values (with MLA the latents and turned key parts) as the
    fields of an int8 (`dtype` uint8: fp8) cache they are written to: integers (codes) in `key`
    and `value`, scales (., 1)."""
    (key, key_scale), (value, value_scale) = _quantize_cache_rows(k, dtype), _quantize_cache_rows(v, dtype)
    return {"key": key, "value": value, "key_scale": key_scale, "value_scale": value_scale}


def _with_cache_scales(cache):
    """An int8 or fp8 cache's zero scales (B, K, L, 1), one per slot and head, for its keys and values."""
    key_scale = np.zeros((*cache.key.shape[:3], 1), np.float32)  # (B, K, L, 1)
    return cache._replace(key_scale=key_scale, value_scale=np.zeros((*cache.value.shape[:3], 1), np.float32))


def _check_quantized_cache(cache):
    """An int8 (fp8) cache: int8 integers (uint8 fp8 codes) for keys and values, float32 scales
    (B, K, L, 1) beside them."""
    dtype = cache.key.dtype
    kind = "int8" if dtype == np.int8 else _FP8
    for name in ("key", "value"):
        field, scale = getattr(cache, name), getattr(cache, f"{name}_scale")
        shape = (*field.shape[:3], 1)
        if field.dtype != dtype or scale is None or scale.dtype != np.float32 or scale.shape != shape:
            raise ValueError(
                f"{'An' if kind == 'int8' else 'A'} {kind} `cache` must hold {kind} `{name}` and a float32 "
                f"`{name}_scale` of shape {shape}; make it with `init_cache(..., dtype='{kind}')`. "
                f"Received: cache.{name}.dtype={_cache_dtype_name(field.dtype)}, cache.{name}_scale="
                f"{None if scale is None else (scale.dtype.name, tuple(scale.shape))}"
            )


def _cache_dtype_name(dtype):
    """A cache field's dtype as the SPEC names it: uint8 codes are float8_e4m3fn."""
    return _FP8 if dtype == np.uint8 else dtype.name


def _dequantize_cache(cache):
    """An int8 or fp8 cache's keys and values as float64, integers (fp8 values) * scale (exact)."""
    k, v = (x if x.dtype == np.int8 else _fp8_values(x) for x in (cache.key, cache.value))
    return k * cache.key_scale.astype(np.float64), v * cache.value_scale.astype(np.float64)


def _with_scales(shapes):
    """The int8 layout of a float layout: `<kind>_kernel_scale` (F,) after each (D, F) `<kind>_kernel`."""
    scaled = {}
    for name, shape in shapes.items():
        scaled[name] = shape
        if name.endswith("_kernel") and not name.startswith("index_"):  # the sparse indexer stays float
            scaled[f"{name}_scale"] = shape[1:]
    return scaled


def _int8_problems(weights, shapes):
    """The kernels of an int8 layout that are not integers in [-127, 127]."""
    problems = []
    for name in (name for name in shapes if name.endswith("_kernel") and name in weights):
        value = np.asarray(weights[name])
        integral = np.issubdtype(value.dtype, np.integer)
        if not integral or (value.size and np.abs(value.astype(np.int64)).max() > _INT8_MAX):
            problems.append(f"'{name}' must hold integers in [-127, 127], received dtype {value.dtype.name}")
    return problems


def _portable_dtype(name, int8):
    """The dtype an imported entry is held in: int8 kernels and float32 scales in an int8 layout, else float64."""
    if int8 and name.endswith("_kernel"):
        return np.int8
    return np.float32 if name.endswith("_kernel_scale") else np.float64


def _is_int8_layout(weights):
    return any(str(name).endswith("_kernel_scale") for name in weights)


# -------------------------------------------------------------------------------------------------
# Section: framework only
# -------------------------------------------------------------------------------------------------
# NumPy has no devices, autocast, hooks or distribution. Here: the variants' record and the checks that
# the core and the sections share (Python and NumPy scalars alike), the initial weights, and the masks' values
# that read like another library's habit (nn.MultiheadAttention's True = ignore, Keras' 0/1 floats), warned of
# once per layer at the caller's line.


class _Variants(NamedTuple):
    """The variants of the layer, checked by their sections' helpers; each is also the layer's attribute."""

    scale: float
    softcap: float | None
    window: int | tuple[int, int] | None
    attention_chunk_size: int | None
    rope_theta: float | None
    rope_fraction: float
    rope_interleaved: bool
    rope_scaling: dict | None
    rope_sections: tuple[int, ...] | None
    qk_norm: str | None
    qk_norm_eps: float
    qk_norm_type: str
    qk_norm_bias: bool
    sinks: bool
    clip_qkv: float | None
    gate: bool
    latent_norm_eps: float


def _positive_int(name, value):
    if not _is_positive_int(value):
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


def _is_positive_int(value):
    """A Python or NumPy integer (not a bool) >= 1."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value >= 1


def _positive_float(name, value, *, optional=False):
    if value is None and optional:
        return None
    if not _is_positive_number(value):
        raise ValueError(
            f"`{name}` must be {'None or ' if optional else ''}a positive float. Received: {name}={value!r}"
        )
    return float(value)


def _is_positive_number(value):
    number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    return number and 0 < value < math.inf


def _flag(name, value):
    """A constructor flag: a Python or NumPy bool (not 0 or 1, not a string)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be True or False. Received: {name}={value!r}")
    return bool(value)


def _dropout_rate(dropout):
    """`dropout` as a float: a Python or NumPy number (not a bool, not None) in [0, 1)."""
    number = isinstance(dropout, (int, float, np.integer, np.floating)) and not isinstance(dropout, (bool, np.bool_))
    if not (number and 0.0 <= dropout < 1.0):
        raise ValueError(f"`dropout` must be in [0, 1). Received: dropout={dropout!r}")
    return float(dropout)


def _projection_biases(bias, gate, projections=_PROJECTIONS):
    """`bias` -> the names of the projections that have a bias, in the order of `projections`
    (("query", "key", "value", "output", "gate"), or the layer's with MLA: `_projections`). `bias`
    is a Python or NumPy bool (all the layer's projections, the gate's only with `gate` True, or
    none), or a list, tuple, set or frozenset of those names; anything else (a string, a dict or
    its keys, an array) is refused."""
    if isinstance(bias, (bool, np.bool_)):
        return _projection_kinds(projections, gate is True or gate is np.True_) if bias else ()
    names = isinstance(bias, (list, tuple, set, frozenset)) and all(
        isinstance(name, str) and name in projections for name in bias
    )
    if not names:
        raise ValueError(
            f"`bias` must be True, False or a list, tuple or set of {', '.join(map(repr, projections))}. "
            f"Received: bias={bias!r}"
        )
    return tuple(name for name in projections if name in bias)


def _projection_kinds(projections, gate):
    """The layer's projections among `projections` (`_projections`): the gate's only with `gate`."""
    return projections if gate else projections[:-1]


def _glorot_uniform(rng, fan_in, fan_out):
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=(fan_in, fan_out))


def _initial_value(rng, name, shape):
    """Glorot uniform kernels, zero biases and sink logits, QK-norm scales of one; the learned query
    scaling's scales zero and biases one (each factor 1)."""
    if name.endswith("_kernel"):
        return _glorot_uniform(rng, *shape)
    return np.ones(shape) if name.endswith(("_norm", "_scaling_bias")) else np.zeros(shape)


_EMPTY_MASK = (
    "`{name}` keeps no key for any query, so every output row is `output_bias`: True means attend (in "
    "nn.MultiheadAttention True means ignore: pass `~mask`). Received: a boolean {name} that is False everywhere"
)


_CAUSAL_TRAP = (
    "`attention_mask` keeps keys only after each query, none at or before it: True means attend (in "
    "nn.MultiheadAttention True means ignore: pass `~mask`, or `causal=True`). "
    "Received: a boolean attention_mask False wherever causal attention keeps a key"
)


_PADDING_TRAP = (
    "`key_mask` reads as nn.MultiheadAttention's key_padding_mask (True = padding): True means a real key, "
    "pass `~mask`. Received: a key_mask False then True in every row, {empty} of {b} rows keeping no key "
    "and none keeping all"
)


_ZEROS_AND_ONES = (
    "`attention_mask` holds only 0s and 1s, but a floating mask is added to the scores (Keras reads such a "
    "mask as boolean): pass `mask > 0` (True = attend) or an additive mask. "
    "Received: a floating attention_mask of 0s and 1s"
)


def _warn_traps(layer, attention_mask, key_mask, t, s):
    """Warns once per layer for each built-in habit the masks' values suggest; a call with a
    cache is not read."""
    for kind, message in _mask_traps(attention_mask, key_mask, t, s).items():
        if kind not in layer._warned_traps:
            layer._warned_traps.add(kind)
            _warn_at_caller(message)


def _mask_traps(attention_mask, key_mask, t, s):
    """The built-in layers' habits that the masks' values suggest (docs/SPEC.md, Masks), as
    {kind: message}; the call computes what the SPEC says either way."""
    traps = {}
    for name, mask in (("attention_mask", attention_mask), ("key_mask", key_mask)):
        if mask is not None and mask.dtype == np.bool_ and _keeps_nothing(mask):
            traps[name] = _EMPTY_MASK.format(name=name)
    boolean = attention_mask is not None and attention_mask.dtype == np.bool_
    if boolean and "attention_mask" not in traps and _keeps_only_later(attention_mask, t, s):
        traps["causal"] = _CAUSAL_TRAP
    empty = 0 if key_mask is None or "key_mask" in traps else _inverted_padding(key_mask)
    if empty:
        traps["padding"] = _PADDING_TRAP.format(empty=empty, b=key_mask.shape[0])
    if attention_mask is not None and attention_mask.dtype != np.bool_ and _zeros_and_ones(attention_mask):
        traps["zeros and ones"] = _ZEROS_AND_ONES
    return traps


def _keeps_nothing(mask):
    """A boolean mask False everywhere (nn.MultiheadAttention's True = ignore, nothing padded)."""
    return mask.size > 0 and not mask.any()


def _keeps_only_later(mask, t, s):
    """A square (T == S) boolean mask that keeps keys only after each query, none where `causal`
    keeps one (nn.MultiheadAttention's causal `attn_mask`, `triu(ones, 1)`)."""
    return mask.size > 0 and t == s > 0 and not (mask & causal_mask(t, s)).any()


def _inverted_padding(key_mask):
    """The rows keeping no key of a (B, S) `key_mask` that reads as nn.MultiheadAttention's
    `key_padding_mask` (True = padding): every row False then True, some row keeping no key and
    none keeping all (left padding has its longest sequence all True); else 0."""
    kept = key_mask.sum(-1)  # (B,)
    ordered = (key_mask[:, 1:] >= key_mask[:, :-1]).all()  # False then True in every row
    full = (kept == key_mask.shape[1]).any()
    return 0 if not ordered or full else int((kept == 0).sum())


def _zeros_and_ones(mask):
    """A floating mask of only 0s and 1s, some 1 (a Keras mask, which Keras reads as boolean)."""
    ones = mask == 1
    return bool(((mask == 0) | ones).all() and ones.any())


_FRAMEWORK_MODULES = ("numpy",)  # the packages between the user's call and this file


def _warn_at_caller(message):
    """Warns `AttentionMaskWarning` at the user's line: the first frame outside this file and the
    framework (a module's or layer's `__call__`, Keras' traceback filter), however deep they call."""
    frame, level = sys._getframe(1), 2  # level 2: the frame that called this function
    while frame is not None and (
        frame.f_globals is globals() or frame.f_globals.get("__name__", "").split(".")[0] in _FRAMEWORK_MODULES
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, AttentionMaskWarning, stacklevel=level)


def _lengths_error(query, key, value):
    """The error of inputs of different batch sizes, or of a key and value of different lengths."""
    if not query.shape[0] == key.shape[0] == value.shape[0]:
        return ValueError(
            "`query`, `key` and `value` must have the same batch size B. Received: "
            f"query.shape={query.shape}, key.shape={key.shape}, value.shape={value.shape}"
        )
    return ValueError(
        f"`key` and `value` must have the same length S. Received: key.shape={key.shape}, value.shape={value.shape}"
    )


def _dtypes_error(query, key, value):
    return ValueError(
        "`query`, `key` and `value` must have the same dtype. Received: "
        f"query.dtype={query.dtype.name}, key.dtype={key.dtype.name}, value.dtype={value.dtype.name}"
    )


# -------------------------------------------------------------------------------------------------
# Section: converters
# -------------------------------------------------------------------------------------------------
# NumPy has no built-in attention layer to convert from or to. Here: the portable weight layout that
# carries weights between the four files (`weight_shapes`, `export_weights`, `import_weights`).
# Weights (`export_weights`, docs/SPEC.md "Weights"): `<kind>_kernel` (D, heads*H) and
# `<kind>_bias` for kind in query, key, value, output (and gate with `gate`); `query_norm`,
# `key_norm` with `qk_norm` (and `query_norm_bias`, `key_norm_bias` with `qk_norm_bias`); `sinks`
# (N,) with sinks; float64, and int8 kernels with float32 `<kind>_kernel_scale` once
# `quantize("int8")` (Keras' scheme; such a layer has no `backward`).


def _float_shapes(layer):
    """The float portable layout (`weight_shapes` before int8) without MLA (`_latent_shapes`)."""
    nh, kh = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    shapes = {
        "query_kernel": (layer.d_model, nh),
        "query_bias": (nh,),
        "key_kernel": (layer.kdim, kh),
        "key_bias": (kh,),
        "value_kernel": (layer.vdim, kh),
        "value_bias": (kh,),
        "output_kernel": (nh, layer.d_model),
        "output_bias": (layer.d_model,),
        "query_norm": (layer.head_dim,) if layer.qk_norm == "head" else (nh,),
        "key_norm": (layer.head_dim,) if layer.qk_norm == "head" else (kh,),
        "query_norm_bias": (layer.head_dim,) if layer.qk_norm == "head" else (nh,),
        "key_norm_bias": (layer.head_dim,) if layer.qk_norm == "head" else (kh,),
        "sinks": (layer.num_heads,),
        "gate_kernel": (layer.d_model, nh),
        "gate_bias": (nh,),
    }
    absent = _absent_projections(layer)  # shared keys and values, keys as values (their section)
    kinds = [kind for kind in _projection_kinds(_PROJECTIONS, layer.gate) if kind not in absent]
    present = {
        **{f"{kind}_kernel": kind in kinds for kind in _PROJECTIONS},
        **{f"{kind}_bias": kind in layer.bias and kind in kinds for kind in _PROJECTIONS},
        "query_norm": layer.qk_norm is not None,
        "key_norm": layer.qk_norm is not None and "key" in kinds,
        "query_norm_bias": layer.qk_norm is not None and layer.qk_norm_bias,
        "key_norm_bias": layer.qk_norm is not None and layer.qk_norm_bias and "key" in kinds,
        "sinks": layer.sinks,
    }
    return {name: shape for name, shape in shapes.items() if present[name]}


def _import_weights(layer, weights):
    """`import_weights`: strict and atomic, every problem listed in one ValueError."""
    int8 = layer.quantization_mode == "int8" or _is_int8_layout(weights)
    expected = (
        _with_scales(layer.weight_shapes()) if int8 and layer.quantization_mode is None else layer.weight_shapes()
    )
    problems = [f"missing '{name}'" for name in expected if name not in weights]
    problems += [f"unexpected '{name}'" for name in weights if name not in expected]
    for name, shape in expected.items():
        if name in weights and tuple(np.shape(weights[name])) != shape:
            problems.append(f"'{name}' has shape {tuple(np.shape(weights[name]))}, expected {shape}")
    problems += _int8_problems(weights, expected) if int8 else []
    if problems:
        raise ValueError(f"`weights` do not match this layer's portable layout: {'; '.join(problems)}")
    layer.params = {name: np.array(weights[name], dtype=_portable_dtype(name, int8)) for name in expected}
