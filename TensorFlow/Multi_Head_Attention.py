"""Multi-head attention for TensorFlow: one Keras 3 layer, proven equal to the PyTorch layer.

Copy this one file into your model; it needs only TensorFlow, NumPy and the standard library.

Legend (every shape comment in this file uses these letters):
    B: batch size          T: query length        S: key/value length
    E: d_model             N: num_heads           K: num_kv_heads
    H: head_dim            L: slots of a KV cache (its maximum length)
    MLA only: C kv_lora_rank, Q q_lora_rank, Hn qk_nope_head_dim, Hr qk_rope_head_dim, Hv v_head_dim

The math, for query head n (which reads key/value head n // (N // K)):
    q = query @ query_kernel + query_bias                       (B, T, N*H)
    k = key @ key_kernel + key_bias                             (B, S, K*H)
    v = value @ value_kernel + value_bias                       (B, S, K*H)
    scores[n] = q[n] @ k[n // G]^T * scale + float_mask         (B, N, T, S), G = N // K
    weights = softmax(scores where kept, else lowest finite)    zeroed where not kept
    context[n] = weights[n] @ v[n // G]                         (B, N, T, H)
    output = concat_heads(context) @ output_kernel + output_bias

Where things are: first the core, the plain layer: the functions a plain call enters (`dot_product_attention`
among them), then `MultiHeadAttention`, whose `call` reads as the steps of docs/SPEC.md ("Order of
the steps"), each option's step behind a one-line guard; then one section per option family, in this
order: score modifiers (scale, softcap, window, attention chunks, sinks, ALiBi, attention_bias, the
masks, segment ids), positions (RoPE), QK-norm, clip_qkv and the gate, KV cache and decode steps,
multi-head latent attention (MLA), speed paths (the memory-efficient path), int8, framework only
(Keras conventions, XLA, the masks' habits), converters (the portable weights' layout and import,
Keras config, from_keras / to_keras).
"""

import functools
import math
import sys
import warnings
from typing import NamedTuple

import numpy as np
import tensorflow as tf

__all__ = ["AttentionMaskWarning", "KVCache", "MultiHeadAttention", "alibi_bias", "document_positions"]
__all__ += ["dot_product_attention", "segment_ids_from_cu_seqlens", "segment_ids_from_position_ids"]

_PROJECTIONS = ("query", "key", "value", "output", "gate")  # the names `bias` takes; "gate" only with `gate`
_ATTRIBUTES = {"sinks": "sink_logits"}  # portable weight name -> layer attribute (`layer.sinks` is the flag)


# -------------------------------------------------------------------------------------------------
# Core: the plain layer
# -------------------------------------------------------------------------------------------------
# The functions a plain call enters, then the class; each option's code is in its section below.


class AttentionMaskWarning(UserWarning):
    """A mask whose values read like another library's convention (nn.MultiheadAttention's True =
    ignore, Keras' 0/1 floats): the layer computes what docs/SPEC.md says all the same, and warns
    once per layer. `warnings.simplefilter("error", AttentionMaskWarning)` makes it an error."""


def _check_input(name, x, width_name, width):
    """Checks one (B, L, width) input; dimensions unknown at trace time are not checked."""
    x = tf.convert_to_tensor(x)
    if not x.dtype.is_floating:
        raise ValueError(f"`{name}` must be a floating tensor. Received: {name}.dtype={x.dtype.name}")
    shape = tuple(x.shape) if x.shape.rank is not None else None
    if shape is not None and (len(shape) != 3 or shape[-1] not in (None, width)):
        raise ValueError(
            f"`{name}` must have shape (B, {'T' if name == 'query' else 'S'}, {width_name}) with {width_name}={width}. "
            f"Received: {name}.shape={shape}"
        )
    return x


def _project_fused(layer, x):
    """Self-attention: q, k and v (B, T, heads*H) from one matmul over the concatenated projections."""
    nh, kh = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    return tf.split(layer._project(x, "query", "key", "value"), [nh, kh, kh], axis=-1)  # (B, T, N*H + 2*K*H)


def dot_product_attention(
    q, k, v, keep=None, bias=None, causal=False, *, scale=None, softcap=None, window=None, attention_chunk_size=None,
    sinks=None, dropout=None,
):  # fmt: skip
    """Pure attention on split heads q (B, N, T, H), k and v (B, K, S, H), K dividing N: (context
    (B, N, T, H), weights (B, N, T, S), exactly 0 where not kept). `keep` (boolean, True = attend)
    and `bias` (floating, added to the soft-capped scores) are None or broadcast to (B, N, T, S);
    `causal`, `scale` (None: 1 / sqrt(H)), `softcap`, `window`, `attention_chunk_size` and `sinks`
    ((N,) logits) as the layer's; `dropout`: None or a callable on the weights before their sum."""
    t, s = tf.shape(q)[2], tf.shape(k)[2]
    if window is not None or attention_chunk_size is not None:  # causal too, in one (T, S) keep
        keep = _and(keep, _position_keep(tf.range(t) + (s - t), s, causal, window, attention_chunk_size))
    elif causal:  # `causal_mask(t, s)`, (T, S); keep's dims may be 1
        keep = _and(keep, tf.range(s)[None, :] <= (tf.range(t) + (s - t))[:, None])
    groups = q.shape[1] // k.shape[1]
    k = tf.repeat(k, groups, axis=1) if groups > 1 else k  # (B, K, S, H) -> (B, N, S, H)
    v = tf.repeat(v, groups, axis=1) if groups > 1 else v  # (B, K, S, H) -> (B, N, S, H)
    dtype = tf.float64 if q.dtype == tf.float64 else tf.float32  # the softmax's, float32 at least (`_softmax_dtype`)
    q = q * tf.constant(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, q.dtype)  # not the scores (rounding)
    scores = tf.cast(tf.matmul(q, k, transpose_b=True), dtype)  # (B, N, T, S)
    scores = scores if softcap is None else _softcap(scores, softcap)
    if bias is not None:
        bias = tf.cast(bias, dtype)
        scores = scores + (bias if sinks is not None else _centre_rows(bias, keep))  # (B, N, T, S)
    plain = keep is None and sinks is None
    weights = tf.cast(tf.nn.softmax(scores, axis=-1) if plain else _masked_softmax(scores, keep, sinks), q.dtype)
    context = tf.matmul(weights if dropout is None else dropout(weights), v)  # (B, N, T, S) @ (B, N, S, H)
    return context, weights


@tf.keras.utils.register_keras_serializable(package="MultiHeadAttentionReference")
class MultiHeadAttention(tf.keras.layers.Layer):
    """Multi-head attention (MHA, grouped-query GQA and multi-query MQA) as a Keras layer.

    Args:
        d_model: E, the width of `query` and of the output.
        num_heads: N, the number of query heads.
        num_kv_heads: K, the number of key/value heads; must divide N. Defaults to N.
        head_dim: H, the width of one head. Defaults to E // N (then N must divide E).
        kdim: width of `key`. Defaults to E.
        vdim: width of `value`. Defaults to E.
        dropout: probability of dropping attention weights when training; 0 <= p < 1.
        bias: True (all the projections have a bias, the gate's with `gate`), False (none), or a list,
            tuple or set of the names of those that have one, among "query", "key", "value", "output",
            "gate" (Qwen2: ("query", "key", "value")), kept as that tuple in that order; with MLA, "query"
            (or "query_a" and "query_b"), "key_value_a", "key_value_b", "output", "gate".
        kernel_initializer: initializer of the kernels.
        bias_initializer: initializer of the biases.
        kv_shared: if True, the layer has no key or value projections: every call takes another
            layer's keys and values through `shared_kv` (Gemma 3n's and Gemma 4's shared layers).
        keys_as_values: if True, no value projection: v is the key projection before QK-norm and RoPE (Gemma 4).
        value_norm: if True, each value head is RMS-normalized without a scale (eps `qk_norm_eps`; Gemma 3n, 4).
        output_norm, output_norm_eps: None, "rms" or "layer": a norm of the merged heads before the output
            projection (weights `context_norm`, and `context_norm_bias` with "layer"; BitNet, Kosmos-2).
        qk_norm_after_rope: if True, QK-norm normalizes q and k after RoPE instead of before (HunYuan).
        **kwargs: base layer arguments (`name`, `dtype` policy, ...).
        The options, each off by default, each in full in its section of this file (score modifiers,
        positions, QK-norm, clip_qkv and the gate, multi-head latent attention):
        scale: the factor of the scores, `scores = (q . k) * scale`. Defaults to 1 / sqrt(H).
        softcap: None or c > 0: the scores become c * tanh(scores / c) (Gemma 2).
        window: None, W, or (W_before, W_after): query t keeps key s only if s > t + (S - T) - W_before,
            and with a pair also s < t + (S - T) + W_after (Mistral: W; ModernBERT: (65, 65)).
        attention_chunk_size: None, or C: query t keeps key s only if s // C == (t + (S - T)) // C (Llama 4).
        rope_theta: None (no RoPE) or the base of rotary position embeddings.
        rope_fraction: in (0, 1]; RoPE turns the first R = int(H * rope_fraction) features.
        rope_interleaved: False pairs feature i with i + R/2; True pairs 2i and 2i + 1.
        rope_scaling: None, {"rope_type": "linear", "factor": f}, a "llama3", "yarn" or "proportional" dict.
        rope_sections: None, or the rotated pairs (summing to R/2) turned by each row of (k, B, T) `positions`.
        rope_sections_interleaved: if True, the sections' pairs are dealt in turn (Qwen3-VL's
            `mrope_interleaved`): pair i by row i % k while i < k * rope_sections[i % k], else row 0.
        qk_norm: None, "head" (Qwen3), "per_head" (StableLM, Cohere) or "all" (OLMo2): q's and k's norm.
        qk_norm_eps, qk_norm_type ("rms" or "layer"), qk_norm_bias (a learned bias: Phi): that norm's.
        sinks: if True, one learned logit per query head in the softmax's denominator.
        clip_qkv: None or c > 0: q, k and v clamped to [-c, c] after their projections (OLMo, DBRX, MPT).
        gate: if True, each head's result times sigmoid(query @ gate_kernel + gate_bias) (Qwen3-Next).
        gate_activation: "sigmoid" (default) or "softplus" (Laguna): the gate's function of its projection.
        kv_lora_rank: None, or C: multi-head latent attention (DeepSeek-V2/V3), keys and values from
            `key` through a latent of C features; `value` must be None or `key` itself.
        q_lora_rank: None (a plain query projection), or Q: the query through a latent of Q features.
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA's Hn, Hr (H = Hn + Hr) and Hv.
        latent_norm_eps: the epsilon of MLA's RMSNorms of the latents.
        query_scaling: None, or {"type": "temperature" or "positions", "beta": b, "floor": f}: each
            query row times 1 + b * ln(1 + floor(p / f)) (Llama 4's temperature tuning, Mistral 4's
            `llama_4_scaling_beta`), or {"type": "learned"}: query head n times s_n * ln(1 + p) + b_n,
            learned (Mistral Large 4's `softmax_scaling`; Section: positions).
        index_topk, index_num_heads, index_head_dim, index_rope_interleaved: the sparse indexer (DSA), off
            while `index_topk` is None: each query attends its `index_topk` best-scored keys (its section).
        index_query_input_norm: if True, the indexer's queries read a LayerNorm of their input (Mistral Large 4).

    Call arguments:
        query: (B, T, E).
        key: (B, S, kdim). Defaults to `value`, or to `query` if `value` is None too.
        value: (B, S, vdim). Defaults to `key`.
        attention_mask: boolean (True = attend) or floating (added to the scores), of shape
            (T, S), (B, T, S) or (B, N, T, S), any dimension of which may be 1.
        key_mask: (B, S) boolean, True for a real key; ANDed with the key's and value's Keras
            masks. In self-attention it defaults to `query_mask`.
        query_mask: (B, T) boolean, True for a real query; ANDed with the query's Keras mask.
        attention_bias: floating, added to the scores (with a gradient); shaped like a mask.
        positions: integer (B, T) or (T,) RoPE positions, or (k, B, T) with `rope_sections`;
            default arange(T) (+ the cache index).
        causal: if True, query t attends key s only if s <= t + (S - T).
        return_attention: if True, also return the per-head attention weights.
        training: dropout acts only when True.
        value_mask: (B, S) boolean, ANDed with `key_mask` (Keras fills it from the value's mask).
        cache: a `KVCache` from `init_cache`: decode T new tokens (`key` and `value`, if given, hold the
            same T tokens); masks and weights are then over the L slots, and `key_mask` is (B, T).
        mask: another name for `attention_mask` (`layer(query, key, value, mask=None)`); giving both
            is a ValueError. Never Keras' propagated implicit mask, which the layer reads off the
            inputs. Masks whose values read like another library's convention warn once per layer
            with `AttentionMaskWarning` and compute as given.
        shared_kv: with `kv_shared`, a (k, v) pair of (B, K, S, H) keys and values another layer
            attended (its `return_kv`), or that layer's `KVCache` once it wrote this call's T tokens.
        return_kv: if True, also return the (k, v) the call attended (over the L slots with a cache).
        topk_indices, return_topk: the keys each query attends (B, T, k), given; return the selection used.

    Returns:
        output (B, T, E), or (output, weights) with weights (B, N, T, S) (per head, before dropout)
        when `return_attention` is True; with `cache`, the updated cache is appended and weights are
        (B, N, T, L), exactly 0 at unwritten slots. From `keras.layers.MultiHeadAttention`: converters.
        With `return_kv`, the (k, v) pair is appended last; a shared cache is read, not returned.

    Example, a key padding mask (the third key of the first sequence is padding):
        >>> layer = MultiHeadAttention(16, 4)
        >>> x = tf.random.normal((2, 3, 16))  # (B, T, E)
        >>> keep = tf.constant([[True, True, False], [True, True, True]])  # (B, S)
        >>> out, weights = layer(x, key_mask=keep, return_attention=True)
        >>> tuple(out.shape), tuple(weights.shape)
        ((2, 3, 16), (2, 4, 3, 3))
        >>> bool(tf.reduce_all(weights[0, :, :, 2] == 0))
        True
    """

    absorb_latents = None  # MLA: True attends the latents, False up-projects them, None (`_absorbs`): decide
    memory_efficient_threshold = 1 << 26  # (B, N, T, S) scores above which a call takes the memory-efficient path
    query_chunk_elements = 1 << 21  # the scores of one chunk of queries there (8 MiB in float32)

    def __init__(
        self, d_model, num_heads, *, num_kv_heads=None, head_dim=None, kdim=None, vdim=None, dropout=0.0, bias=True,
        scale=None, softcap=None, window=None, attention_chunk_size=None, rope_theta=None, rope_fraction=1.0,
        rope_interleaved=False, rope_scaling=None, rope_sections=None, qk_norm=None, qk_norm_eps=1e-6,
        qk_norm_type="rms", qk_norm_bias=False, sinks=False, clip_qkv=None, gate=False, kv_lora_rank=None,
        q_lora_rank=None, qk_nope_head_dim=None, qk_rope_head_dim=None, v_head_dim=None, latent_norm_eps=1e-6,
        kernel_initializer="glorot_uniform", bias_initializer="zeros", query_scaling=None, kv_shared=False,
        keys_as_values=False, value_norm=False, index_topk=None, index_num_heads=None, index_head_dim=None,
        index_rope_interleaved=False, index_query_input_norm=False, rope_sections_interleaved=False, output_norm=None,
        output_norm_eps=1e-6, qk_norm_after_rope=False, gate_activation="sigmoid", **kwargs,
    ):  # fmt: skip
        _check_backend()
        super().__init__(**kwargs)
        self.d_model = _positive_int("d_model", d_model)
        self.num_heads = _positive_int("num_heads", num_heads)
        self.num_kv_heads = _positive_int("num_kv_heads", num_heads if num_kv_heads is None else num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"`num_kv_heads` must divide `num_heads`. Received: num_heads={num_heads}, num_kv_heads={num_kv_heads}"
            )
        latent = _check_latent(kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
        head_dim = head_dim if latent is None else _latent_head_dim(latent, head_dim)  # MLA: Hn + Hr
        if head_dim is None and self.d_model % self.num_heads:
            raise ValueError(f"`num_heads` must divide `d_model`. Received: d_model={d_model}, num_heads={num_heads}")
        self.head_dim = _positive_int("head_dim", self.d_model // self.num_heads if head_dim is None else head_dim)
        self.kdim = _positive_int("kdim", self.d_model if kdim is None else kdim)
        self.vdim = _positive_int("vdim", self.d_model if vdim is None else vdim)
        self.dropout = _dropout_rate(dropout)
        self.bias = _projection_biases(bias, gate, _projections(latent))
        rope_width = self.head_dim if latent is None else latent.qk_rope_head_dim  # RoPE turns H, or Hr with MLA
        options = {  # each family checked by its section, in the signature's order with the flags last
            **_check_score_modifiers(self.head_dim, scale, softcap, window, attention_chunk_size),
            **_check_rope(rope_width, rope_theta, rope_fraction, rope_scaling, rope_sections),
            **_check_norms(qk_norm, qk_norm_eps, qk_norm_type, clip_qkv),
            "latent_norm_eps": _positive_float("latent_norm_eps", latent_norm_eps),
        }
        flags = {"rope_interleaved": rope_interleaved, "qk_norm_bias": qk_norm_bias, "sinks": sinks, "gate": gate}
        variants = _Variants(**options, **{name: _flag(name, value) for name, value in flags.items()})
        _set_latent(self, latent, vdim, variants)  # MLA's combinations refused, its sizes set (None without)
        self.query_scaling = _check_query_scaling(query_scaling, variants.rope_sections)  # its section: positions
        for name, value in variants._asdict().items():
            setattr(self, name, value)
        _check_sharing(self, latent, kv_shared, keys_as_values, value_norm)  # self.kv_shared, ... (their section)
        _init_indexer(self, index_topk, index_num_heads, index_head_dim, index_rope_interleaved, index_query_input_norm)
        self.rope_sections_interleaved = _flag("rope_sections_interleaved", rope_sections_interleaved)  # positions
        _init_norm_options(self, output_norm, output_norm_eps, qk_norm_after_rope)  # section: QK-norm
        self.gate_activation = _check_gate_activation(gate_activation)  # its section: the gate
        if self.rope_theta is not None:
            self._inv_freq = _inverse_frequencies(rope_fraction, rope_width, self.rope_theta, self.rope_scaling)
        self.kernel_initializer = tf.keras.initializers.get(kernel_initializer)
        self.bias_initializer = tf.keras.initializers.get(bias_initializer)
        _keras_conventions(self)  # masking, inputs as given, the Dropout sublayer (framework only)

    def compute_mask(self, query, previous_mask=None):
        """The output carries the query's mask."""
        return previous_mask

    def __call__(self, *args, mask=None, **kwargs):
        """`mask=` moved into `attention_mask`; then what a cast would hide: inputs of different dtypes,
        a cache of another dtype."""
        if mask is not None:
            given = kwargs.pop("attention_mask", args[3] if len(args) > 3 else None)
            args, kwargs["attention_mask"] = args[:3], _attention_mask(given, mask)
        inputs = dict(zip(("query", "key", "value"), args, strict=False))
        inputs.update({name: kwargs[name] for name in ("query", "key", "value") if name in kwargs})
        if inputs.get("query") is not None:
            query, key, value = inputs["query"], inputs.get("key"), inputs.get("value")
            key = (query if value is None else value) if key is None else key  # as `_check_call` defaults them
            inputs = (query, key, key if value is None else value)
            dtypes = [tf.as_dtype(x.dtype) if hasattr(x, "dtype") else tf.convert_to_tensor(x).dtype for x in inputs]
            if all(d.is_floating for d in dtypes) and len(set(dtypes)) > 1:
                a, b, c = (d.name for d in dtypes)
                raise ValueError(
                    "`query`, `key` and `value` must have the same dtype. "
                    f"Received: query.dtype={a}, key.dtype={b}, value.dtype={c}"
                )
        if kwargs.get("cache") is not None:
            _check_cache_dtype(kwargs["cache"], self.compute_dtype)
        return super().__call__(*args, **kwargs)

    # The steps of a call, each option behind a one-line guard: a layer without it enters none of its functions.

    def call(
        self, query, key=None, value=None, attention_mask=None, *, key_mask=None, query_mask=None,
        attention_bias=None, positions=None, causal=False, return_attention=False, training=None, value_mask=None,
        cache=None, segment_ids=None, key_segment_ids=None, shared_kv=None, return_kv=False, topk_indices=None,
        return_topk=False,
    ):  # fmt: skip
        """The steps of docs/SPEC.md ("Order of the steps"); the arguments are the class's."""
        cache = cache if shared_kv is None else _shared_cache(self, query, cache, shared_kv)  # rewound to check
        call = self._check_call(  # 1. defaults and checks
            query, key, value, attention_mask, key_mask, query_mask, attention_bias, positions, causal,
            return_attention, cache, training, value_mask,
        )  # fmt: skip
        call = call if segment_ids is None is key_segment_ids else _packed(self, call, segment_ids, key_segment_ids)
        keep, bias = None, (None, None)  # 1. the masks: one keep, (the floating mask's, attention_bias's) biases
        if any(mask is not None for mask in (call.attention_mask, attention_bias, call.key_mask, call.query_mask)):
            keep, bias = _masks(self, call)  # keep (B|1, N|1, T|1, S|1), rank-4 biases
        # 2. q (B, N, T, H), k and v (B, K, S, H); MLA: q, the latents c (B, 1, S, C) and k_rope (B, 1, S, Hr)
        q, k, v = self._project_qkv(call, shared_kv) if self.kv_lora_rank is None else _project_latent(self, call)
        if self.qk_norm is not None and not self._sharing and not self._qk_norm_late:  # 3. QK-norm (or in step 4)
            q, k = _normalize_qk(self, q, k)
        if self.query_scaling is not None or (self.rope_theta is not None and not self._sharing):
            q, k, v = _position_step(self, q, k, v, call)  # 4. RoPE (not with the sharing options: their step 2), 4b.
        if cache is not None:  # 5. KV cache: k, v (B, K, L, H); in a graph, `misfit`: whether the tokens do not fit
            k, v, keep, call, misfit = _update_cache(self, call, k, v, keep)
        selection = None  # 5b. the sparse indexer: keep ANDed with each query's top-k keys (B, T, k)
        if self.index_topk is not None or topk_indices is not None or return_topk:
            keep, call, selection = _sparse_keep(self, call, keep, topk_indices, return_topk)
        if self.kv_lora_rank is None:  # 6. (B, N, T, Hv), (B, N, T, S) or None; an int8 cache: `_cache_attend`
            context, weights = (_cache_attend(self, k) if call.cache else self._attend)(q, k, v, keep, bias, call)
        else:  # 6. MLA: the latents attended, absorbed or expanded
            context, weights = _attend_latent(self, q, k, v, keep, bias, call)
        if self.gate:  # 6b. the output gate, (B, N, T, Hv)
            context = _gate_heads(self, call, context)
        merged = self._merge_heads(context)  # 7. (B, N, T, Hv) -> (B, T, N*Hv)
        merged = merged if self.output_norm is None else _normalize_context(self, merged)  # 7. the output norm
        output = self._project(merged, "output")  # 7. (B, T, N*Hv) -> (B, T, E)
        if cache is not None and misfit is not None:  # XLA cannot raise for a misfit: that call's output is NaN
            output = tf.where(misfit, tf.cast(np.nan, output.dtype), output)
        cache, selection = call.cache if not self.kv_shared else None, selection if return_topk else None
        if return_attention or cache is not None or return_kv or return_topk:  # a shared cache is not returned
            return _results(output, weights, cache, return_attention, (k, v) if return_kv else None, selection)
        return output

    def _check_call(
        self, query, key, value, attention_mask, key_mask, query_mask, attention_bias, positions, causal,
        return_attention, cache, training=None, value_mask=None,
    ):  # fmt: skip
        """Step 1 but the masks' combination: the inputs defaulted (docs/SPEC.md, "Call"), checked and cast
        to the compute dtype; the optional arguments checked in `_check_options`. Returns the `_Call`."""
        fuse = (key is None or key is query) and (value is None or value is query) and cache is None
        fuse = fuse and self.kv_lora_rank is None  # MLA projects its latents apart
        if self.kv_lora_rank is not None:
            _check_latent_inputs(key, value)
        self_attention = key is None and value is None
        explicit_key_mask = None if key_mask is getattr(key, "_keras_mask", None) else key_mask  # not Keras' fill
        key = (query if value is None else value) if key is None else key  # `key` and `value` default to each
        value = key if value is None else value  # other, then to `query`
        one_input = key is query and value is query
        implicit = [getattr(x, "_keras_mask", None) for x in (query, key, value)]  # as legacy Keras passes them
        implicit = [None if mask is None else tf.cast(mask, tf.bool) for mask in implicit]
        query = _check_input("query", query, "E", self.d_model)
        key = _check_input("key", key, "kdim", self.kdim)
        value = _check_input("value", value, "vdim", self.vdim)
        if not one_input:
            _check_lengths(query, key, value)
        options = (query_mask, key_mask, value_mask, cache, positions, attention_mask, attention_bias)
        if self.rope_theta is not None or any(x is not None for x in (*options, *implicit)):  # `_check_options`
            query_mask, key_mask, positions, attention_mask, attention_bias = _check_options(
                self, query, key, self_attention, explicit_key_mask, implicit, *options
            )  # fmt: skip
        query, key, value = (tf.cast(x, self.compute_dtype) for x in (query, key, value))
        return _Call(
            query, key, value, attention_mask, attention_bias, key_mask, query_mask, positions, causal, self.window,
            self.attention_chunk_size, return_attention, cache, training, fuse,
        )  # fmt: skip

    def _project_qkv(self, call, shared_kv=None):
        """Step 2: q (B, N, T, H), k and v (B, K, S, H), in one matmul where `call.fuse` (`_project_fused`)."""
        if self._sharing:  # steps 2 to 4 with the sharing options (their section)
            return _project_sharing(self, call, shared_kv)
        if call.fuse:  # (B, T, E) -> 3 x (B, T, heads*H)
            q, k, v = _project_fused(self, call.query)
        else:
            q, k, v = (self._project(x, kind) for x, kind in zip(call[:3], ("query", "key", "value"), strict=True))
        q = self._split_heads(q, self.num_heads)  # (B, N, T, H)
        k, v = self._split_heads(k, self.num_kv_heads), self._split_heads(v, self.num_kv_heads)  # (B, K, S, H)
        return (q, k, v) if self.clip_qkv is None else tuple(_clip(self, x) for x in (q, k, v))

    def _project(self, x, *kinds):
        """(B, L, D) -> (B, L, F): the projection `kinds` names, as a 2-D matmul and a bias add (fused by
        oneDNN); several `kinds` are one matmul over their concatenated kernels (`_project_fused`)."""
        int8 = getattr(self, "quantization_mode", None) == "int8"
        kernels = [getattr(self, f"{kind}_kernel") for kind in kinds]
        biases = [getattr(self, f"{kind}_bias") if kind in self.bias else None for kind in kinds]
        scales = [getattr(self, f"{kind}_kernel_scale") if int8 else None for kind in kinds]
        kernel, bias, scale = kernels[0], biases[0], scales[0]
        if len(kinds) > 1:
            kernel, scale = tf.concat(kernels, axis=1), tf.concat(scales, axis=0) if int8 else None  # (D, F)
            dtype = next((b.dtype for b in biases if b is not None), None)  # the compute dtype, mixed policies
            if dtype is not None:
                zeros = [tf.zeros(w.shape[1], dtype) if b is None else b for b, w in zip(biases, kernels, strict=True)]
                bias = tf.concat(zeros, axis=0)
        rows = tf.reshape(x, [-1, kernel.shape[0]])  # (B, L, D) -> (B*L, D)
        if scale is None:
            y = tf.matmul(rows, tf.cast(kernel, x.dtype))  # (B*L, D) -> (B*L, F)
        else:
            y = _int8_matmul(rows, tf.convert_to_tensor(kernel), tf.convert_to_tensor(scale))  # -> (B*L, F)
        y = y if bias is None else tf.nn.bias_add(y, tf.cast(bias, x.dtype))
        return tf.reshape(y, tf.concat([tf.shape(x)[:2], [kernel.shape[1]]], 0))  # (B*L, F) -> (B, L, F)

    def _split_heads(self, y, heads, width=None):
        """(B, L, heads*W) -> (B, heads, L, W); the width W defaults to H."""
        b, length = tf.shape(y)[0], tf.shape(y)[1]
        y = tf.reshape(y, [b, length, heads, width or self.head_dim])  # (B, L, heads*W) -> (B, L, heads, W)
        return tf.transpose(y, [0, 2, 1, 3])  # -> (B, heads, L, W)

    def _merge_heads(self, x):
        merged = tf.transpose(x, [0, 2, 1, 3])  # (B, heads, L, H) -> (B, L, heads, H)
        return tf.reshape(merged, tf.concat([tf.shape(merged)[:2], [-1]], 0))  # -> (B, L, heads*H)

    def _attend(self, q, k, v, keep, bias, call):
        """Step 6, the one entry to the paths: q (B, N, T, H), k (B, K, S, H), v (B, K, S, Hv) attended by
        the formula; by `_attend_in_chunks` where the scores may exceed `memory_efficient_threshold`
        elements and no weights are returned. Returns (context (B, N, T, Hv), weights or None)."""
        b, n, t, s = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        if not call.return_attention and (None in (b, t, s) or b * n * t * s > self.memory_efficient_threshold):
            return _attend_in_chunks(self, q, k, v, keep, bias, call)
        keep = keep if call.segments is None else _and(keep, _same_documents(*call.segments))  # packed: (B, 1, T, S)
        dropout = self.dropout > 0 and call.training is not False and call.training is not None
        sinks = self.sink_logits if self.sinks else None
        added = bias[1] if bias[0] is None else bias[0] if bias[1] is None else bias[0] + bias[1]  # the mask's + bias
        return dot_product_attention(
            q, k, v, keep, added, call.causal, scale=self.scale, softcap=self.softcap, window=call.window,
            attention_chunk_size=call.attention_chunk_size, sinks=sinks,
            dropout=functools.partial(self._dropout_layer, training=call.training) if dropout else None,
        )  # fmt: skip

    def build(self, query_shape=None, value_shape=None, key_shape=None):
        """Creates the portable weights; every shape is known from the constructor. The optional shapes
        are Keras' convention, in its order, checked as the call checks its inputs (`_check_shapes`)."""
        _check_shapes(self, query_shape, value_shape, key_shape)
        for name, shape in self.weight_shapes().items():
            variable = self.add_weight(name=name, shape=shape, **_weight_options(self, name))
            setattr(self, _ATTRIBUTES.get(name, name), variable)
        self._is_quantized = self._int8  # Keras' flag: an int8 layer (a loaded `.keras` file) is not quantized again
        self._dropout_layer.build(None)
        self.built = True

    def get_config(self):
        return {**super().get_config(), **_config(self)}

    def weight_shapes(self):
        """The portable layout: {name: shape}, in its order (`_weight_shapes`, docs/SPEC.md "Weights")."""
        return _weight_shapes(self)

    def export_weights(self):
        """Returns the portable weights: a dict of NumPy arrays (see docs/SPEC.md)."""
        if not self.built:
            self.build()
        return {name: self._variable(name).numpy().copy() for name in self.weight_shapes()}

    def import_weights(self, weights):
        """Loads portable weights; strict and atomic (a ValueError lists every problem). An int8
        layout (with `<kind>_kernel_scale`) quantizes a float layer first; an int8 layer takes only one."""
        _import_weights(self, weights)

    def _variable(self, name):
        """The variable of one portable weight (`sinks` is held as `sink_logits`)."""
        return getattr(self, _ATTRIBUTES.get(name, name))

    def quantize(self, mode=None, type_check=True, config=None):
        """Quantizes the projections to int8 as Keras' `Dense.quantize("int8")` does (`_quantize`): `mode`
        "int8", `type_check` unused (Keras' signature), `config` None or Keras' default int8 config."""
        _quantize(self, mode, config)

    def _check_quantize_args(self, mode, compute_dtype):
        _check_quantize_args(self, mode, compute_dtype)  # Keras' checks; float16 computes int8 too

    @property
    def _latent(self):
        """The MLA sizes as a `_Latent`, or None without `kv_lora_rank`."""
        return _latent_of(self)

    @property
    def _projection_names(self):
        """The names of the layer's projections, in the layout's order (MLA's, the gate's with `gate`)."""
        kinds = _projection_kinds(_projections(_latent_of(self)), self.gate)
        return tuple(kind for kind in kinds if kind not in _absent_projections(self))  # shared keys and values

    @property
    def _int8(self):
        """Whether the projections are int8: the dtype policy is "int8_from_..." (Keras 3 only)."""
        return getattr(self, "quantization_mode", None) == "int8"

    def _int8_call(self, *args, **kwargs):
        """Keras' entry for an int8 policy: `call`, whose projections read the int8 variables."""
        return self.call(*args, **kwargs)

    def init_cache(self, batch_size, max_length, *, keep=None, dtype=None, in_place=False):
        """An empty `KVCache` for decoding `batch_size` (B) sequences of up to `max_length` (L) tokens;
        `keep` (B, L) False for slots no query may attend, `dtype` the cache's, `in_place` a cache of
        variables written in place (`_init_cache`)."""
        return _init_cache(self, batch_size, max_length, keep, dtype, in_place)

    @classmethod
    def from_keras(cls, layer, *, window=None):
        """Builds a layer with the weights of a built `keras.layers.MultiHeadAttention` or
        `keras.layers.GroupQueryAttention` (`_from_keras`; `window`: `(W, W)` for its `sliding_window` W)."""
        return _from_keras(cls, layer, window)

    def to_keras(self):
        """Returns a built `keras.layers.MultiHeadAttention` (K == N) or `keras.layers.GroupQueryAttention`
        (K < N) holding these weights (`_to_keras`)."""
        return _to_keras(self)

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        """(B, T, E), whatever S is; shapes in Keras' order (query, value, key), checked as in `build`."""
        query_shape = _check_shapes(self, query_shape, value_shape, key_shape)
        return (query_shape[0], query_shape[1], self.d_model)

    def compute_output_spec(self, *args, **kwargs):
        """Traces `call` on symbolic inputs: a functional model gets every check (`_output_spec`)."""
        return _output_spec(self, *args, **kwargs)


class _Call(NamedTuple):
    """A call's arguments, checked and defaulted by `_check_call` (docs/SPEC.md, "Call")."""

    query: tf.Tensor  # (B, T, E), checked and cast to the compute dtype
    key: tf.Tensor  # (B, S, kdim)
    value: tf.Tensor  # (B, S, vdim)
    attention_mask: tf.Tensor | None  # after the `mask=` alias, checked, rank 4 (dims may be 1)
    attention_bias: tf.Tensor | None  # checked, floating, rank 4 (dims may be 1)
    key_mask: tf.Tensor | None  # (B, S): after the self-attention default and implicit Keras masks
    query_mask: tf.Tensor | None  # (B, T), ANDed with the query's implicit Keras mask
    positions: tf.Tensor | None  # (B|1, T) integers, (k, B|1, T) with `rope_sections`, or None without RoPE
    causal: bool  # the cache step replaces it by False once folded into keep
    window: int | tuple | None  # self.window; the cache step replaces it by None once folded into keep
    attention_chunk_size: int | None  # self.attention_chunk_size; likewise
    return_attention: bool
    cache: "KVCache | None"  # the cache step replaces it by the written cache
    training: bool | None  # the call's training flag
    fuse: bool  # q, k and v may come from one matmul (self-attention without a cache)
    segmented: bool = False  # packed sequences: the ids folded into attention_mask (`_packed`)
    segments: tuple | None = None  # packed sequences without a cache: (B, T) and (B, S) ids, ANDed in by `_attend`
    selection: None = None  # PyTorch only: the sparse indexer's gathered route (here always a keep)


# -------------------------------------------------------------------------------------------------
# Section: score modifiers
# -------------------------------------------------------------------------------------------------
# `scale` (default 1 / sqrt(H)), `softcap` (Gemma 2: scores become c * tanh(scores / c)), `window`
# (query t keeps key s only if s > t + (S - T) - W; a pair (W_before, W_after) also needs
# s < t + (S - T) + W_after), `attention_chunk_size` (keys only in the query's chunk of C positions:
# Llama 4), `sinks` (a learned logit per head in the softmax's denominator), ALiBi (`alibi_bias`,
# passed as `attention_bias`) and the call's `attention_bias` (added to the scores, with a gradient);
# and the masks beyond the plain call's: `attention_mask` (`mask`), `key_mask`, `query_mask`, `causal`.
#
# Masks (docs/SPEC.md, "Masks"): a boolean `attention_mask` is True where a query may attend a key;
# a floating one is added to the scores, read in its own dtype: a value at or below the lowest
# finite value of its dtype or of float32 (whichever is higher), or -inf, removes a key; every other
# value is added in the softmax's dtype (float32 at least). `causal=True` keeps key s for query t
# iff s <= t + (S - T), combined with every other mask. Keras implicit masks are honoured (the
# query's removes query rows, the key's and value's remove keys, ANDed with `query_mask` and
# `key_mask`; the output carries the query's). A query row with no key left gets weights of
# exactly 0, so its output is `output_bias`: never NaN. Example, a key padding mask for keys
# [a, b, <pad>]:
#     keep = tf.constant([[True, True, False]])        # (B, S)
#     layer(x, key_mask=keep)                           # or attention_mask=keep[:, None, :]


def _masks(layer, call):
    """Step 1: the masks combined into one boolean keep, (B|1, N|1, T|1, S|1) or None, and the
    additive biases kept apart (the floating mask's, which gets no gradient on the memory-efficient
    path, and `attention_bias`'s), each None or rank 4 in the softmax's dtype. With a cache,
    `key_mask` goes into the cache's keep instead (step 5)."""
    keep = mask_bias = attention_bias = None
    if call.attention_mask is not None:
        keep, mask_bias = _split_mask(call.attention_mask, _softmax_dtype(layer.compute_dtype))
    if call.attention_bias is not None:
        bias_keep, attention_bias = _split_mask(call.attention_bias, _softmax_dtype(layer.compute_dtype))
        keep = _and(keep, bias_keep)
    if call.query_mask is not None:
        keep = _and(keep, tf.expand_dims(tf.expand_dims(call.query_mask, 1), 3))  # (B, T) -> (B, 1, T, 1)
    if call.key_mask is not None and call.cache is None:
        keep = _and(keep, tf.expand_dims(tf.expand_dims(call.key_mask, 1), 1))  # (B, S) -> (B, 1, 1, S)
    return keep, (mask_bias, attention_bias)


def _check_options(
    layer, query, key, self_attention, explicit_key_mask, implicit, query_mask, key_mask, value_mask, cache,
    positions, attention_mask, attention_bias,
):  # fmt: skip
    """The checks of a call's optional arguments, after its inputs' (`_check_call`), in this order: the
    token masks (checked, ANDed with the inputs' `implicit` Keras masks; `key_mask` defaults to
    `query_mask` in self-attention), the cache, `positions` (`_positions`), `attention_mask` and
    `attention_bias` (rank 4), then the habits the masks suggest warned of (`_warn_traps`). Returns
    query_mask (B, T), key_mask (B, S), positions, attention_mask and attention_bias."""
    (b, t), s = tuple(query.shape)[:2], key.shape[1]
    if any(mask is not None for mask in (query_mask, key_mask, value_mask, *implicit)):  # (B, T), (B, S)
        query_mask = _and(_check_token_mask("query_mask", query_mask, b, t, "T"), implicit[0])
        key_mask = _check_token_mask("key_mask", key_mask, b, s, "S")
        key_mask = _and(key_mask, _check_token_mask("value_mask", value_mask, b, s, "S"))
        key_mask = query_mask if self_attention and key_mask is None else key_mask
        key_mask = _and(key_mask, _and(implicit[1], implicit[2]))
    if cache is not None:
        _check_cache(cache, query, key, layer.num_kv_heads, layer.head_dim, layer._latent)
    if positions is not None or layer.rope_theta is not None:
        positions = _positions(layer, positions, query, key, cache)  # before the masks, as in the other files
    if attention_mask is not None or attention_bias is not None:
        target = (b, layer.num_heads, t, s if cache is None else cache.key.shape[2])
        dtype = _softmax_dtype(layer.compute_dtype)
        attention_mask = _mask_to_4d(attention_mask, target, "attention_mask", dtype)
        attention_bias = _mask_to_4d(attention_bias, target, "attention_bias", dtype)
    if cache is None and (attention_mask is not None or explicit_key_mask is not None):
        _warn_traps(layer, attention_mask, explicit_key_mask, t, s)
    return query_mask, key_mask, positions, attention_mask, attention_bias


def _check_token_mask(name, mask, batch, length, letter):
    """Checks a (B, T) `query_mask` or (B, S) `key_mask` / `value_mask`; dimensions unknown at
    trace time are not checked."""
    if mask is None:
        return None
    mask = tf.convert_to_tensor(mask)
    shape = tuple(mask.shape) if mask.shape.rank is not None else None
    if mask.dtype != tf.bool or shape is None or len(shape) != 2 or any(
        len({dim, expected} - {None}) > 1 for dim, expected in zip(shape, (batch, length), strict=True)
    ):  # fmt: skip
        raise ValueError(
            f"`{name}` must be a boolean tensor of shape (B, {letter})=({batch}, {length}). "
            f"Received: {name}.shape={shape}, {name}.dtype={mask.dtype.name}"
        )
    return mask


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


def _mask_to_4d(mask, target, name, dtype):
    """Checks `attention_mask` (boolean or floating) or `attention_bias` (floating) against
    target (B, N, T, S) and returns it as a rank-4 tensor (None stays None); dimensions unknown at
    trace time are not checked. A floating one wider than the softmax's `dtype` is cast to it
    first: the cast saturates every value below that dtype's range to -inf, which removes, as the
    floating mask rule does; and LiteRT has no float64 comparisons."""
    if mask is None:
        return None
    mask = tf.convert_to_tensor(mask)
    if name == "attention_bias" and not mask.dtype.is_floating:
        raise ValueError(f"`attention_bias` must be floating. Received: attention_bias.dtype={mask.dtype.name}")
    if mask.dtype != tf.bool and not mask.dtype.is_floating:
        raise ValueError(
            f"`{name}` must be boolean (True = attend; for a 0/1 integer mask pass `mask > 0`) or floating. "
            f"Received: {name}.dtype={mask.dtype.name}"
        )
    if mask.dtype.is_floating and mask.dtype.size > tf.as_dtype(dtype).size:
        mask = tf.cast(mask, dtype)  # float64 -> float32
    rank = mask.shape.rank
    expected = {2: target[2:], 3: (target[0], *target[2:]), 4: target}.get(rank)
    if expected is None or any(
        m not in (1, e) and None not in (m, e) for m, e in zip(mask.shape, expected, strict=True)
    ):
        raise ValueError(
            f"`{name}` must broadcast to (B, N, T, S) as (T, S), (B, T, S) or "
            f"(B, N, T, S), each dimension full or 1.{_padding_hint(name, _static_shape(mask), target)} "
            f"Expected: (B, N, T, S)={target}. "
            f"Received: {name}.shape={_static_shape(mask)}"
        )
    if rank == 2:
        return mask[None, None]  # (T, S) -> (1, 1, T, S)
    if rank == 3:
        return mask[:, None]  # (B, T, S) -> (B, 1, T, S)
    return mask


def causal_mask(t, s):
    """(T, S) boolean mask: query t keeps key s iff s <= t + (S - T) (bottom-right aligned)."""
    return tf.range(s)[None, :] <= (tf.range(t) + (s - t))[:, None]  # (1, S) <= (T, 1) -> (T, S)


def _split_mask(mask, dtype):
    """Splits a rank-4 mask (`_mask_to_4d`) into (keep, additive), each None or rank 4, by the
    floating mask rule: a boolean mask is `keep`; a floating one, read in its own dtype, removes
    a key where it is -inf or at most max(lowest of its dtype, lowest of float32), and adds every
    other value in `dtype` (the softmax's, float32 at least). No -inf reaches arithmetic."""
    if mask is None:
        return None, None
    if mask.dtype == tf.bool:
        return mask, None
    threshold = tf.constant(max(mask.dtype.min, tf.float32.min), mask.dtype)
    removed = mask <= threshold  # (B, N, T, S), dims may be 1
    additive = tf.where(removed, tf.zeros_like(mask), tf.maximum(mask, threshold))  # finite
    return tf.logical_not(removed), tf.cast(additive, dtype)


def _and(a, b):
    return b if a is None else a if b is None else a & b


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _masked_softmax(scores, keep, sinks):
    """Softmax over the last axis of (B, N, T, S) scores, in their dtype: keys not kept removed
    (filled with the lowest finite value), one sink logit per head (N,) in the denominator
    (`_sink_softmax`), rows with no key exactly 0."""
    if keep is not None:
        scores = tf.where(keep, scores, scores.dtype.min)  # (B, N, T, S)
    if sinks is None:
        weights = tf.nn.softmax(scores, axis=-1)  # (B, N, T, S)
    else:
        weights = _sink_softmax(scores, tf.reshape(tf.cast(sinks, scores.dtype), [1, -1, 1, 1]))  # (B, N, T, S)
    if keep is not None:
        weights = tf.where(keep, weights, tf.zeros((), weights.dtype))  # rows with no key are all 0
    return weights


def _softmax_dtype(dtype):
    """Softmax runs in float32 at least (float64 stays float64)."""
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


def _check_score_modifiers(head_dim, scale, softcap, window, attention_chunk_size):
    """`scale`, `softcap`, `window` and `attention_chunk_size` checked, in that order (a ValueError
    names the first bad one); `scale` None becomes 1 / sqrt(H). The flag `sinks` is checked with
    the other flags, last."""
    return {
        "scale": 1.0 / math.sqrt(head_dim) if scale is None else _positive_float("scale", scale),
        "softcap": _positive_float("softcap", softcap, optional=True),
        "window": _check_window(window),
        "attention_chunk_size": None
        if attention_chunk_size is None
        else _positive_int("attention_chunk_size", attention_chunk_size),
    }


def _score_modifiers(layer, call):
    """The score modifiers of a call, as the keyword arguments of the attention functions."""
    sinks = layer.sink_logits if layer.sinks else None
    return dict(
        scale=layer.scale, softcap=layer.softcap, window=call.window, attention_chunk_size=call.attention_chunk_size,
        sinks=sinks,
    )  # fmt: skip


def _score_config(layer):
    """The score modifiers' keys of `get_config`, in the signature's order (`window` a list)."""
    window = list(layer.window) if isinstance(layer.window, tuple) else layer.window
    return {
        "scale": layer.scale, "softcap": layer.softcap, "window": window,
        "attention_chunk_size": layer.attention_chunk_size,
    }  # fmt: skip


def _score_settings(layer):
    """The score modifiers not at their default's values, {name: value or None} (`_non_defaults`)."""
    return {
        "scale": None if math.isclose(layer.scale, 1 / math.sqrt(layer.head_dim)) else layer.scale,
        "softcap": layer.softcap,
        "window": layer.window,
        "attention_chunk_size": layer.attention_chunk_size,
    }


def _capped_chunk(chunks, scores):
    """A chunk's scores soft-capped (`_softcap`, (B, N, chunk, S)) and the cap's tanh, which the
    memory-efficient backward reads (None without `softcap`)."""
    capped = None if chunks.softcap is None else tf.tanh(scores / chunks.softcap)
    return (scores if capped is None else chunks.softcap * capped), capped


def _check_window(window):
    """`window` as None, a Python int W, or a tuple (W_before, W_after) of two Python ints (from a
    list or tuple); a bool, a float, a string, a dict, a pair holding anything else is refused."""
    pair = isinstance(window, (list, tuple)) and len(window) == 2
    sides = tuple(window) if pair else (window,)
    if window is not None and not all(_is_positive_int(side) for side in sides):
        raise ValueError(
            "`window` must be None, a positive integer or a pair (before, after) of positive integers. "
            f"Received: window={window!r}"
        )
    return None if window is None else tuple(int(side) for side in sides) if pair else int(window)


def _window_sides(window):
    """`window` -> (W_before, W_after or None): an int W keeps W_before = W and no limit after."""
    if window is None:
        return None, None
    return tuple(window) if isinstance(window, tuple) else (window, None)


def _positive_float(name, value, optional=False):
    """A positive float; None stays None when `optional`."""
    if optional and value is None:
        return None
    if not _is_positive_number(value):
        raise ValueError(
            f"`{name}` must be {'None or ' if optional else ''}a positive float. Received: {name}={value!r}"
        )
    return float(value)


def _is_positive_number(value):
    number = not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, float, np.integer, np.floating))
    return number and math.isfinite(value) and value > 0


def window_mask(t, s, window):
    """(T, S) boolean mask: query t keeps key s iff s > t + (S - T) - W_before, and with a pair
    `window` (W_before, W_after) also s < t + (S - T) + W_after (bottom-right aligned)."""
    return _position_keep(tf.range(t) + (s - t), s, False, window)


def attention_chunk_mask(t, s, size):
    """(T, S) boolean mask: query t keeps key s iff s // size == (t + (S - T)) // size (bottom-right
    aligned): both in the same chunk of `size` positions."""
    return _position_keep(tf.range(t) + (s - t), s, False, None, size)


def _position_keep(positions, s, causal, window, attention_chunk_size=None):
    """(R, S) boolean for queries at `positions` (R,) over keys 0 .. S - 1 (`_held_keep`)."""
    return _held_keep(tf.range(s)[None, :], positions[:, None], causal, window, attention_chunk_size)  # (R, S)


def _held_keep(held, positions, causal, window, attention_chunk_size):
    """Whether a key at position `held` is kept for a query at `positions` (broadcasting, e.g.
    (1, S) and (R, 1)): held <= position (when causal), held > position - W_before and
    held < position + W_after (with a window), held // C == position // C (with a chunk size C);
    None if none of them."""
    before, after = _window_sides(window)
    keep = held <= positions if causal else None
    keep = keep if before is None else _and(keep, held > positions - before)
    keep = keep if after is None else _and(keep, held < positions + after)
    if attention_chunk_size is not None:
        chunk = attention_chunk_size
        keep = _and(keep, tf.math.floordiv(held, chunk) == tf.math.floordiv(positions, chunk))
    return keep


def _softcap(scores, softcap):
    """Gemma 2's logit soft-capping: scores -> softcap * tanh(scores / softcap)."""
    return scores if softcap is None else softcap * tf.tanh(scores / softcap)


def _capped_scores(layer, scores):
    """The scores soft-capped by the layer's `softcap` (as they are without one)."""
    return _softcap(scores, layer.softcap)


@tf.custom_gradient
def _sink_softmax(scores, sink):
    """Softmax of (B, N, T, S) scores with one more logit per head, `sink` (1, N, 1, 1), in its
    denominator, and its gradient written out: the scores' is a softmax's, w * (dw - sum(w * dw)),
    and the sink's -p_sink * sum(w * dw) with p_sink = 1 - sum(w), summed over B, T. (Autograd
    through a softmax over [scores, sink] copied the (B, N, T, S) scores twice more each way.)"""
    top = tf.maximum(tf.reduce_max(scores, axis=-1, keepdims=True), sink)  # (B, N, T, 1)
    exps = tf.exp(scores - top)  # (B, N, T, S)
    weights = exps / (tf.reduce_sum(exps, axis=-1, keepdims=True) + tf.exp(sink - top))  # (B, N, T, S)

    def gradient(d_weights):
        total = tf.reduce_sum(weights * d_weights, axis=-1, keepdims=True)  # (B, N, T, 1)
        sink_weight = 1 - tf.reduce_sum(weights, axis=-1, keepdims=True)  # (B, N, T, 1)
        d_sink = tf.reduce_sum(-sink_weight * total, axis=[0, 2, 3], keepdims=True)  # (1, N, 1, 1)
        return weights * (d_weights - total), d_sink

    return weights, gradient


def _centre_rows(bias, keep):
    """`bias` minus each row's largest value where `keep` holds (rows keeping nothing: unchanged).
    A per-query constant does not change a softmax without sinks: a row of only large finite
    penalties (-1e9) stays an ordinary softmax instead of scores rounded away in float32."""
    if bias is None or keep is None or bias.shape[-1] == 0:
        return bias
    lowest = tf.constant(bias.dtype.min, bias.dtype)
    top = tf.reduce_max(tf.where(keep, bias, lowest), axis=-1, keepdims=True)  # (B, N, T, 1), dims may be 1
    return bias - tf.where(top == lowest, tf.zeros_like(top), top)  # (B, N, T, S), dims may be 1


def _alibi_slopes(num_heads):
    """Bloom's ALiBi slopes: 2 ** (-8 (n + 1) / N) for N a power of two; otherwise those of the
    nearest lower power of two followed by every other slope of twice it."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = 2.0 ** (-8.0 * np.arange(1, closest + 1) / closest)
    extra = 2.0 ** (-4.0 * np.arange(1, 2 * (num_heads - closest), 2) / closest)
    return np.concatenate([slopes, extra])  # (N,)


def alibi_bias(num_heads, positions):
    """The ALiBi bias `slope[n] * positions[..., s]`, float32, to pass as `attention_bias` (with
    `causal=True`; Bloom's key positions are `cumsum(key_mask) - 1`).

    Args:
        num_heads: N.
        positions: integer (S,) or (B, S) key positions.

    Returns:
        (1, N, 1, S) for (S,) positions, (B, N, 1, S) for (B, S).
    """
    num_heads = _positive_int("num_heads", num_heads)
    positions = tf.convert_to_tensor(positions)
    if not positions.dtype.is_integer or positions.shape.rank not in (1, 2):
        raise ValueError(
            "`positions` must be an integer tensor of shape (S,) or (B, S). "
            f"Received: positions.shape={_static_shape(positions)}, positions.dtype={positions.dtype.name}"
        )
    positions = positions[None] if positions.shape.rank == 1 else positions  # (S,) -> (1, S)
    slopes = tf.constant(_alibi_slopes(num_heads), tf.float32)[:, None, None]  # (N, 1, 1)
    return slopes * tf.cast(positions, tf.float32)[:, None, None, :]  # (B, 1, 1, S) -> (B, N, 1, S)


def segment_ids_from_position_ids(position_ids):
    """Segment ids from positions that restart at each document (transformers' padding-free
    `position_ids`, `DataCollatorWithFlattening`): (B, T) or (T,) integers -> the same shape,
    0 for a row's first document, then 1, 2, ...; a document starts at t = 0 and wherever a
    position is not one more than the one before it."""
    positions = tf.convert_to_tensor(position_ids)
    changed = tf.cast(positions[..., 1:] != positions[..., :-1] + 1, tf.int32)  # (B, T - 1)
    return tf.cumsum(tf.concat([tf.zeros_like(changed[..., :1]), changed], axis=-1), axis=-1)  # (B, T)


def segment_ids_from_cu_seqlens(cu_seqlens, total_length=None):
    """Segment ids from the cumulative lengths of `varlen_attn` / flash-attention (0, len_0,
    len_0 + len_1, ..., T): (D + 1,) integers -> (1, T), document d at [cu[d], cu[d + 1]).
    `total_length` (default cu[-1]) may exceed cu[-1]: the tail is one more document."""
    cu = tf.convert_to_tensor(cu_seqlens)
    values = cu.numpy() if tf.executing_eagerly() else None
    if not cu.dtype.is_integer or cu.shape.rank != 1 or (values is not None and _bad_cu_seqlens(values)):
        raise ValueError(
            f"`cu_seqlens` must be a 1-D integer tensor starting at 0 and non-decreasing. Received: cu_seqlens={cu}"
        )
    length = cu[-1] if total_length is None else total_length
    steps = tf.range(length, dtype=cu.dtype)[None, :]  # (1, T)
    return tf.searchsorted(cu[None, 1:], steps, side="right")  # (1, T)


def _bad_cu_seqlens(values):
    return values.size < 1 or values[0] != 0 or bool((np.diff(values) < 0).any())


def _check_segment_ids(name, ids, batch_size, length, letter):
    """Checks (B, L) integer segment ids (static dimensions where known)."""
    ids = tf.convert_to_tensor(ids)
    shape = tuple(ids.shape)
    fits = len(shape) == 2 and all(
        d is None or e is None or not isinstance(e, int) or d == e
        for d, e in zip(shape, (batch_size, length), strict=False)
    )
    if not ids.dtype.is_integer or not fits:
        raise ValueError(
            f"`{name}` must be an integer tensor of shape (B, {letter})=({batch_size}, {length}). "
            f"Received: {name}.shape={shape}, {name}.dtype={ids.dtype.name}"
        )
    return tf.cast(ids, tf.int32)


def _has_segments(cache):
    """Whether the cache holds segment ids: `init_cache` gives (B, 0) ones, none yet."""
    return cache.segment_ids is not None and cache.segment_ids.shape[-1] != 0


def _segment_ids_error(message):
    return ValueError(f"{message} (packed sequences, docs/SPEC.md, 'Packed sequences')")


def _segment_keep(layer, call, segment_ids, key_segment_ids):
    """Packed sequences: (B, 1, T, S) `same` and the call's cache. Query t keeps key s only if
    segment_ids[b, t] == key_segment_ids[b, s],
    ANDed into `attention_mask` (a float mask gets -inf there), so every path computes it through
    its keep. Key ids default to `segment_ids` when S == T (self-attention). With a cache the key
    ids of the T new tokens are written to a copy of the cache's `segment_ids` (made at the first
    packed call of an empty cache) and the mask is over its L slots; a call without ids continues
    the document of the last written slot. An in-place cache does not keep segment ids."""
    dynamic_b, dynamic_t = tf.shape(call.query)[0], tf.shape(call.query)[1]
    cache = call.cache
    if segment_ids is None and (cache is None or not _has_segments(cache)):
        raise _segment_ids_error("`key_segment_ids` needs `segment_ids`")
    if cache is not None:
        if _is_in_place(cache):
            raise _segment_ids_error("an in-place cache (`init_cache(..., in_place=True)`) keeps no segment ids")
        length = _cache_length(cache)
        if segment_ids is None:  # the new tokens continue the last written slot's document
            last = tf.gather(cache.segment_ids, tf.math.floormod(cache.index - 1, length), axis=1)  # (B,)
            segment_ids = tf.tile(last[:, None], [1, dynamic_t])  # (B, T)
        if not _has_segments(cache) and tf.executing_eagerly() and int(cache.index) > 0:
            raise _segment_ids_error(
                "`cache` holds tokens written without `segment_ids`; pass them from the first call"
            )
    segment_ids, key_ids = _checked_segment_ids(call, segment_ids, key_segment_ids)
    if cache is not None:
        ids = tf.zeros((dynamic_b, length), tf.int32) if not _has_segments(cache) else cache.segment_ids
        slots = tf.math.floormod(cache.index + tf.range(dynamic_t), length)  # (T,)
        rows = tf.stack(tf.meshgrid(tf.range(dynamic_b), slots, indexing="ij"), axis=-1)  # (B, T, 2): (b, slot)
        ids = tf.tensor_scatter_nd_update(ids, rows, key_ids)  # (B, L)
        key_ids, cache = ids, cache._replace(segment_ids=ids)
    return _same_documents(segment_ids, key_ids), cache


def _checked_segment_ids(call, segment_ids, key_segment_ids):
    """The (B, T) query ids and (B, S) key ids of a packed call, checked (int32); the key ids
    default to `segment_ids` when S == T (self-attention)."""
    (b, t), s = tuple(call.query.shape)[:2], call.key.shape[1]
    segment_ids = _check_segment_ids("segment_ids", segment_ids, b, t, "T")
    if key_segment_ids is None and None not in (s, t) and s != t:
        raise _segment_ids_error("cross-attention (S != T) needs `key_segment_ids` (B, S)")
    key_ids = segment_ids
    if key_segment_ids is not None:
        key_ids = _check_segment_ids("key_segment_ids", key_segment_ids, b, s, "S")
    return segment_ids, key_ids


def _same_documents(segment_ids, key_ids):
    """(B, T) and (B, S) ids -> the (B, 1, T, S) keep of packed sequences."""
    return segment_ids[:, None, :, None] == key_ids[:, None, None, :]  # (B, 1, T, S)


def _packed(layer, call, segment_ids, key_segment_ids):
    """Packed sequences: without a cache the checked ids as the call's `segments`, which `_attend`
    ANDs into its keep (the memory-efficient path a chunk of queries at a time, over the keys of
    its documents only: `_chunk_keys`); with one, the ids ANDed into `attention_mask`
    (`_segment_keep`). The call is marked `segmented`."""
    if call.cache is None:
        if segment_ids is None:
            raise _segment_ids_error("`key_segment_ids` needs `segment_ids`")
        return call._replace(segments=_checked_segment_ids(call, segment_ids, key_segment_ids), segmented=True)
    same, cache = _segment_keep(layer, call, segment_ids, key_segment_ids)
    mask = call.attention_mask
    if mask is not None:
        same = mask & same if mask.dtype == tf.bool else tf.where(same, mask, tf.cast(-np.inf, mask.dtype))
    return call._replace(attention_mask=same, cache=cache, segmented=True)


# -------------------------------------------------------------------------------------------------
# Section: positions
# -------------------------------------------------------------------------------------------------
# RoPE (`rope_theta`, `rope_fraction`, `rope_interleaved`, `rope_scaling`, `rope_sections` for
# multimodal RoPE; `positions` in the call): the first R = int(H * rope_fraction) features of each
# head of q and k turned by the angles positions * inv_freq (step 4). `rope_scaling`: None,
# {"rope_type": "linear", "factor": f}, a "llama3" dict (factor, low_freq_factor, high_freq_factor,
# original_max_position_embeddings), a "yarn" dict (factor, original_max_position_embeddings,
# optional attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim, truncate; the rotated
# features of q and k are also multiplied by its attention factor) or a "proportional" dict (optional
# factor, partial_rotary_factor: Gemma 4, LFM3; the last pairs of the R features unturned).
# `rope_sections`: the numbers of rotated pairs (summing to R/2) that turn by each row of (k, B, T)
# `positions` in turn (Qwen2-VL's multimodal RoPE, `mrope_section`). With MLA, RoPE turns the last
# Hr features of q and the shared k_rope.

_ROPE_SCALING = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "proportional": (),
}
_YARN_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _check_rope(rope_width, rope_theta, rope_fraction, rope_scaling, rope_sections):
    """`rope_theta`, `rope_fraction`, `rope_scaling` and `rope_sections` checked, in that order; RoPE
    turns features of heads `rope_width` wide (H, or Hr with MLA). The flag `rope_interleaved` is
    checked with the other flags, last."""
    rope_theta = _positive_float("rope_theta", rope_theta, optional=True)
    rotary = _rotary_dim(rope_fraction, rope_width, rope_theta is not None)
    return {
        "rope_theta": rope_theta,
        "rope_fraction": float(rope_fraction),
        "rope_scaling": _check_rope_scaling(rope_scaling),
        "rope_sections": _check_rope_sections(rope_sections, rotary),
    }


def _inverse_frequencies(rope_fraction, rope_width, rope_theta, rope_scaling):
    """The layer's (R/2,) inverse frequencies as a NumPy array: a constant of each graph, not a
    captured tensor (tf2onnx)."""
    rotary = _rotary_dim(rope_fraction, rope_width, True)
    return rope_frequencies(rotary, rope_theta, rope_scaling).numpy()  # (R/2,)


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
    """`rope_scaling` as transformers writes it: None, or a dict whose `rope_type` (or `type`) is
    'linear', 'llama3', 'yarn' or 'proportional', with its positive parameters (llama3: high_freq_factor
    above low_freq_factor; yarn: see `_valid_yarn`; proportional: `_valid_proportional`)."""
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    needed = _ROPE_SCALING.get(kind)
    valid = needed is not None and all(_is_positive_number(scaling.get(name)) for name in needed)
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


def _check_rope_sections(sections, rotary):
    """`rope_sections` as a tuple of Python ints (None stays None): a non-empty list or tuple of
    positive integers, summing to R/2 when RoPE is on (`rotary` R; None without RoPE)."""
    if sections is None:
        return None
    if not isinstance(sections, (list, tuple)) or not sections or not all(map(_is_positive_int, sections)):
        raise ValueError(
            "`rope_sections` must be None or a list or tuple of positive integers. "
            f"Received: rope_sections={sections!r}"
        )
    if rotary is not None and sum(sections) != rotary // 2:
        raise ValueError(
            f"`rope_sections` must sum to R/2 = {rotary // 2}, the pairs RoPE rotates (R = int(head_dim * "
            f"rope_fraction) = {rotary}). Received: rope_sections={sections!r}"
        )
    return tuple(int(n) for n in sections)


def _positions(layer, positions, query, key, cache):
    """Checks `positions` and returns them as (B, T) or (1, T) integers, (k, B, T) or (k, 1, T)
    with `rope_sections` (default arange(T), plus the cache's index), or None without RoPE."""
    if layer.rope_theta is None:
        if positions is not None:
            raise ValueError(
                "`positions` needs RoPE: construct the layer with `rope_theta`. "
                "Received: positions with rope_theta=None"
            )
        return None
    if cache is None and _differ(query.shape[1], key.shape[1]):
        raise ValueError(
            "RoPE needs `key` and `value` to hold the query's own tokens (S == T, or decoding with `cache`). "
            f"Received: query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
        )
    if positions is None:
        start = 0 if cache is None else cache.index
        positions = (start + tf.range(tf.shape(query)[1]))[None]  # (1, T)
        return positions if layer.rope_sections is None else _per_section(positions, layer.rope_sections)
    return _check_positions(positions, query.shape[0], query.shape[1], layer.rope_sections)


def _check_positions(positions, b, t, sections):
    """Checks integer (B, T) or (T,) `positions`, or (k, B, T) with k `sections` (dimensions
    unknown at trace time are not checked), and returns them as (B, T) or (1, T); with sections
    as (k, B, T) or (k, 1, T), one row of positions used for every section."""
    positions = tf.convert_to_tensor(positions)
    shape = _static_shape(positions)
    dims = {1: (t,), 2: (b, t)}
    if sections is not None:
        dims[3] = (len(sections), b, t)
    dims = dims.get(None if shape is None else len(shape))
    expected = dims is not None and not any(_differ(d, e) for d, e in zip(shape, dims, strict=True))
    if not positions.dtype.is_integer or not expected:
        received = f"Received: positions.shape={shape}, positions.dtype={positions.dtype.name}"
        if sections is None:
            raise ValueError(
                f"`positions` must be an integer tensor of shape (B, T) or (T,) with B={b}, T={t}. {received}"
            )
        raise ValueError(
            f"`positions` must be an integer tensor of shape (B, T), (T,) or ({len(sections)}, B, T) with B={b}, "
            f"T={t} (one row per section of `rope_sections`). {received}"
        )
    positions = positions[None] if len(shape) == 1 else positions  # (T,) -> (1, T)
    return positions if sections is None or len(shape) == 3 else _per_section(positions, sections)


def _per_section(positions, sections):
    """(B|1, T) positions -> (k, B|1, T): the same row for each of the k `rope_sections`."""
    return tf.repeat(positions[None], len(sections), axis=0)  # (B|1, T) -> (k, B|1, T)


def _rotate(layer, q, k, v, positions):
    """RoPE of q (B, N, T, H) and k (B, K, T, H) at (B, T) or (1, T) `positions` ((k, B|1, T)
    with `rope_sections`); with MLA, of q's last Hr features and of the shared key part, v
    (B, 1, T, Hr) until the cache step (k, the latents, is not turned). Returns q, k, v."""
    if layer.rope_theta is None:
        return q, k, v
    if layer.kv_lora_rank is None:
        return _turn_heads(layer, q, positions), _turn_heads(layer, k, positions), v
    q_nope, q_rope = tf.split(q, [layer.qk_nope_head_dim, layer.qk_rope_head_dim], axis=-1)  # (B, N, T, Hn|Hr)
    return tf.concat([q_nope, _turn_heads(layer, q_rope, positions)], axis=-1), k, _turn_heads(layer, v, positions)


def _turn_heads(layer, x, positions):
    """x (B, heads, T, W) with its first R features turned, times YaRN's attention factor."""
    inv_freq = layer._inv_freq
    sections = layer.rope_sections, layer.rope_sections_interleaved  # multimodal RoPE: sections (or None), their layout
    x = apply_rope(x, positions, inv_freq, layer.rope_interleaved, *sections)
    return scale_rotated(x, 2 * inv_freq.shape[0], rope_attention_factor(layer.rope_scaling))


def document_positions(segment_ids):
    """RoPE positions of packed sequences: (B, T) or (T,) segment ids -> positions of the same
    shape that restart at 0 wherever the id changes (each document numbered from 0)."""
    ids = tf.convert_to_tensor(segment_ids)
    ones = tf.ones_like(ids, tf.int32)
    steps = tf.cumsum(ones, axis=-1) - 1  # (B, T)
    changed = tf.concat([ones[..., :1], tf.cast(ids[..., 1:] != ids[..., :-1], tf.int32)], axis=-1)  # (B, T)
    document = tf.cumsum(changed, axis=-1) - 1  # (B, T), the document's number in its row
    first = tf.where(changed > 0, steps, tf.zeros_like(steps))  # (B, T), the first step of each document
    starts = tf.math.unsorted_segment_max(tf.reshape(first, [-1]), _row_documents(document), tf.size(ids))
    return steps - tf.reshape(tf.gather(starts, _row_documents(document)), tf.shape(ids))  # (B, T)


def _row_documents(document):
    """(B, T) documents numbered in their row -> (B*T,) numbered over the batch."""
    rows = tf.cumsum(tf.ones_like(document), axis=0) - 1 if document.shape.rank == 2 else tf.zeros_like(document)
    return tf.reshape(document + rows * tf.shape(document)[-1], [-1])


def rope_frequencies(rotary_dim, theta, scaling=None):
    """(R/2,) float32 inverse frequencies `theta ** (-2i / R)` of RoPE, rewritten by `scaling`
    (None, {"rope_type": "linear", "factor": f}, a "llama3", "yarn" or "proportional" dict); computed in
    float64."""
    inv_freq = float(theta) ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)  # (R/2,)
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_frequencies(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq = _yarn_frequencies(inv_freq, theta, scaling)
    elif kind == "proportional":
        inv_freq = _proportional_frequencies(inv_freq, scaling)
    return tf.constant(inv_freq, tf.float32)


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
    return tf.concat([x[..., :rotary_dim] * factor, x[..., rotary_dim:]], axis=-1)  # (B, heads, T, H)


def apply_rope(x, positions, inv_freq, interleaved, sections=None, sections_interleaved=False):
    """Rotates the first R = 2 * len(inv_freq) features of each head of x.

    Args:
        x: (B, heads, T, H) queries or keys.
        positions: (B, T) or (1, T) integer positions; with `sections`, (k, B, T) or (k, 1, T).
        inv_freq: (R/2,) float32 frequencies from `rope_frequencies`.
        interleaved: False pairs feature i with i + R/2 (Llama, GPT-NeoX); True pairs 2i and
            2i + 1 (GPT-J).
        sections: None, or k numbers of pairs summing to R/2 (multimodal RoPE): the pairs of
            section j turn by the positions of row j.
        sections_interleaved: if True, the sections' pairs are dealt in turn (`_section_rows`,
            Qwen3-VL), not in runs.

    Returns:
        x rotated, in its dtype; the angles and their cos and sin are float32.
    """
    inv_freq = tf.convert_to_tensor(inv_freq, tf.float32)
    rotary_dim = 2 * inv_freq.shape[0]
    angles = rope_angles(positions, inv_freq, sections, sections_interleaved)  # (B, T, R/2)
    angles = tf.expand_dims(angles, 1)  # (B, T, R/2) -> (B, 1, T, R/2)
    dtype = _softmax_dtype(x.dtype)
    cos, sin = tf.cast(tf.cos(angles), dtype), tf.cast(tf.sin(angles), dtype)  # (B, 1, T, R/2)
    cos, sin = _on_pairs(cos, cos, interleaved), _on_pairs(-sin, sin, interleaved)  # (B, 1, T, R)
    rotary = tf.cast(x[..., :rotary_dim], dtype)  # (B, heads, T, R)
    turned = tf.cast(_turn(rotary, cos, sin, interleaved), x.dtype)  # (B, heads, T, R)
    if rotary_dim == x.shape[-1]:
        return turned
    return tf.concat([turned, x[..., rotary_dim:]], axis=-1)  # (B, heads, T, H)


def rope_angles(positions, inv_freq, sections=None, sections_interleaved=False):
    """(B, T, R/2) float32 angles: (B, T) positions times the (R/2,) inv_freq; with `sections`
    (multimodal RoPE) pair i turns by positions[j] * inv_freq[i] from (k, B, T) positions, j its
    row (`_section_rows`: runs of the sections' sizes, or dealt in turn with `sections_interleaved`)."""
    positions, inv_freq = tf.cast(positions, tf.float32), tf.convert_to_tensor(inv_freq, tf.float32)
    if sections is None:
        return tf.expand_dims(positions, -1) * inv_freq  # (B, T, 1) * (R/2,) -> (B, T, R/2)
    rows = tf.gather(positions, _section_rows(sections, sections_interleaved))  # (k, B, T) -> (R/2, B, T)
    return tf.transpose(rows, [1, 2, 0]) * inv_freq  # (R/2, B, T) -> (B, T, R/2)


def _section_rows(sections, interleaved):
    """The row of (k, B, T) positions that turns each of the R/2 pairs: row j turns a run of
    `sections[j]` pairs, in order; `interleaved` (Qwen3-VL) deals them in turn: pair i by row
    i % k while i < k * sections[i % k], else by row 0."""
    k = len(sections)
    if not interleaved:
        return [j for j, size in enumerate(sections) for _ in range(size)]
    return [i % k if i < k * sections[i % k] else 0 for i in range(sum(sections))]


def _turn(x, cos, sin, interleaved):
    """x * cos + swapped * sin = (x1 cos - x2 sin, x2 cos + x1 sin) for every pair, with cos on
    both features and (-sin, sin) on the pair. A rotation: its gradient, cos * g + swap(sin * g),
    turns back by the same angles (cheaper than differentiating the swap)."""

    @tf.custom_gradient
    def turn(x):
        def grad(upstream):
            return upstream * cos + _swap_pairs(upstream * sin, interleaved)

        return x * cos + _swap_pairs(x, interleaved) * sin, grad

    return turn(x)


def _on_pairs(first, second, interleaved):
    """Two (..., R/2) values of each pair -> (..., R): on its first and on its second feature."""
    if interleaved:
        pairs = tf.stack([first, second], axis=-1)  # (..., R/2, 2)
        return tf.reshape(pairs, tf.concat([tf.shape(first)[:-1], [2 * first.shape[-1]]], 0))  # (..., R)
    return tf.concat([first, second], axis=-1)  # (..., R)


def _swap_pairs(x, interleaved):
    """(..., R) -> (..., R): each pair (x1, x2) as (x2, x1)."""
    if interleaved:
        pairs = tf.reshape(x, tf.concat([tf.shape(x)[:-1], [x.shape[-1] // 2, 2]], 0))  # (..., R/2, 2)
        return tf.reshape(tf.reverse(pairs, axis=[-1]), tf.shape(x))  # (..., R)
    half = x.shape[-1] // 2
    return tf.concat([x[..., half:], x[..., :half]], axis=-1)  # (..., R): the halves swapped (LiteRT has no roll)


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


def _position_step(layer, q, k, v, call):
    """Steps 4 and 4b: RoPE of q and k (MLA's in `_rotate`), then each query row times its scale."""
    if layer.rope_theta is not None:
        q, k, v = _rotate(layer, q, k, v, call.positions)  # 4. RoPE
        q, k = _normalize_qk(layer, q, k) if layer._qk_norm_late else (q, k)  # 4. QK-norm after RoPE
    return (q, k, v) if layer.query_scaling is None else (q * _query_scales(layer, q, call), k, v)


def _query_scales(layer, q, call):
    """Step 4b: the (B|1, 1, T, 1) factor of each query row of q (B, N, T, H), 1 + beta * ln(1 + floor(p /
    floor)), computed in float32 (float64 for a float64 q) as transformers does, in q's dtype."""
    scaling = layer.query_scaling
    dtype = tf.float64 if q.dtype == tf.float64 else tf.float32
    if scaling["type"] != "temperature" and call.positions is not None:
        positions = tf.cast(call.positions, dtype)  # (B|1, T)
    else:
        start = 0 if call.cache is None else tf.convert_to_tensor(call.cache.index)
        steps = tf.cast(start + tf.range(tf.shape(q)[2]), dtype)  # (T,)
        positions = (steps + float(scaling["type"] == "temperature"))[None]  # (1, T)
    if scaling["type"] == "learned":
        return _learned_scales(layer.query_scaling_scale, layer.query_scaling_bias, positions, q.dtype)
    scales = 1.0 + scaling["beta"] * tf.math.log(1.0 + tf.floor(positions / scaling["floor"]))  # (B|1, T)
    return tf.cast(scales, q.dtype)[:, None, :, None]  # (B|1, T) -> (B|1, 1, T, 1)


def _learned_scales(scale, bias, positions, dtype):
    """The learned factor scale[n] * ln(1 + p) + bias[n] of head n at (B|1, T) float positions, in `dtype` as
    transformers computes it (ln(1 + p) in float32 at least, then cast): (B|1, heads, T, 1)."""
    logs = tf.cast(tf.math.log(1.0 + positions), dtype)  # (B|1, T): ln(1 + p), as transformers (no Log1p op in ONNX)
    scale, bias = tf.cast(scale, dtype), tf.cast(bias, dtype)  # (heads,)
    return scale[None, :, None, None] * logs[:, None, :, None] + bias[None, :, None, None]  # (B|1, heads, T, 1)


# -------------------------------------------------------------------------------------------------
# Section: QK-norm, clip_qkv and the gate
# -------------------------------------------------------------------------------------------------
# `qk_norm` (RMSNorm or LayerNorm, `qk_norm_type`, of q and k: "head", each head normalized with
# one scale shared by the heads, Qwen3; "per_head", each head with its own scale, StableLM, Cohere;
# "all", over all heads at once, OLMo2; its scales are the weights `query_norm` and `key_norm`, and
# `qk_norm_bias` adds `query_norm_bias` and `key_norm_bias`, Phi's LayerNorm), step 3; `clip_qkv`
# (q, k and v clamped to [-c, c] right after their projections, bias included, before QK-norm, RoPE
# and the cache: OLMo, DBRX, MPT), step 2; `gate` (each head's result times
# gate = sigmoid(query @ gate_kernel + gate_bias), (B, T, N*Hv), feature by feature, before the heads
# are merged: output = concat_heads(context * gate) @ output_kernel + output_bias; Keras' `use_gate`,
# Qwen3-Next, Qwen3.5; softplus instead of sigmoid with `gate_activation="softplus"`: Laguna), step 6b;
# `output_norm` (RMSNorm or LayerNorm of the merged heads before the output projection, weights `context_norm`
# and `context_norm_bias`: BitNet, Kosmos-2), step 7; `qk_norm_after_rope` (QK-norm of the turned q and k:
# HunYuan), step 4.


_GATE_ACTIVATIONS = ("sigmoid", "softplus")  # the values `gate_activation` takes


def _check_norms(qk_norm, qk_norm_eps, qk_norm_type, clip_qkv):
    """`qk_norm`, `qk_norm_eps`, `qk_norm_type` and `clip_qkv` checked, in that order. The flags
    `qk_norm_bias` and `gate` are checked with the other flags, last."""
    if qk_norm not in (None, "head", "per_head", "all"):
        raise ValueError(f"`qk_norm` must be None, 'head', 'per_head' or 'all'. Received: qk_norm={qk_norm!r}")
    qk_norm = None if qk_norm is None else str(qk_norm)  # np.str_ held as str
    qk_norm_eps = _positive_float("qk_norm_eps", qk_norm_eps)
    if not isinstance(qk_norm_type, str) or qk_norm_type not in ("rms", "layer"):
        raise ValueError(f"`qk_norm_type` must be 'rms' or 'layer'. Received: qk_norm_type={qk_norm_type!r}")
    clip_qkv = _positive_float("clip_qkv", clip_qkv, optional=True)
    return {"qk_norm": qk_norm, "qk_norm_eps": qk_norm_eps, "qk_norm_type": str(qk_norm_type), "clip_qkv": clip_qkv}


def _init_norm_options(layer, output_norm, output_norm_eps, qk_norm_after_rope):
    """Checks `output_norm`, `output_norm_eps` and `qk_norm_after_rope` (after every other argument) and holds
    them as attributes (`_qk_norm_late`: QK-norm runs after RoPE, in step 4, where both are on); `build` makes
    the output norm's weights (`_context_norm_shapes`)."""
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


def _context_norm_shapes(layer):
    """`output_norm`'s portable weights {name: shape}: (N*Hv,) `context_norm`, and `context_norm_bias` with "layer"."""
    if layer.output_norm is None:
        return {}
    width = (_kernel_shapes(layer)["output"][0],)  # N*Hv
    return {"context_norm": width} | ({"context_norm_bias": width} if layer.output_norm == "layer" else {})


def _normalize_context(layer, merged):
    """Step 7, `output_norm`: RMSNorm or LayerNorm of the (B, T, N*Hv) merged heads over all their features,
    times `context_norm`, plus `context_norm_bias` with LayerNorm."""
    norm = rms_norm if layer.output_norm == "rms" else layer_norm
    bias = layer.context_norm_bias if layer.output_norm == "layer" else None
    return norm(merged, layer.context_norm, layer.output_norm_eps, bias)


def _check_gate_activation(gate_activation):
    """Checks `gate_activation` (held as a str; it has no effect without `gate`)."""
    if not isinstance(gate_activation, str) or gate_activation not in _GATE_ACTIVATIONS:
        raise ValueError(
            f"`gate_activation` must be 'sigmoid' or 'softplus'. Received: gate_activation={gate_activation!r}"
        )
    return str(gate_activation)  # np.str_ held as str


def _clip(layer, x):
    """`clip_qkv` (OLMo, DBRX, MPT): x clamped to [-c, c] (unchanged when None), with the
    clamp's gradient, 1 within [-c, c] (bounds included) and 0 outside."""
    return x if layer.clip_qkv is None else tf.clip_by_value(x, -layer.clip_qkv, layer.clip_qkv)


def _normalize_qk(layer, q, k):
    """QK-norm (`qk_norm_type`: RMSNorm or LayerNorm, plus a bias with `qk_norm_bias`) of each
    head of q and k ("head": scales (H,) shared by the heads; "per_head": (N*H,) and (K*H,),
    each head its own) or of all their heads at once ("all": (N*H,) and (K*H,))."""
    if layer.qk_norm is None:
        return q, k
    return _norm(layer, q, "query", layer.num_heads), _norm(layer, k, "key", layer.num_kv_heads)


def _norm(layer, x, kind, heads):
    """The QK-norm of x (B, heads, L, H) with the `kind` ("query" or "key") scale and bias."""
    norm = rms_norm if layer.qk_norm_type == "rms" else layer_norm
    scale = getattr(layer, f"{kind}_norm")
    bias = getattr(layer, f"{kind}_norm_bias") if layer.qk_norm_bias else None
    if layer.qk_norm == "all":
        merged = norm(layer._merge_heads(x), scale, layer.qk_norm_eps, bias)  # (B, L, heads*H)
        return layer._split_heads(merged, heads)  # (B, heads, L, H)
    if layer.qk_norm == "per_head":
        scale, bias = (None if w is None else tf.reshape(w, [heads, 1, layer.head_dim]) for w in (scale, bias))
    return norm(x, scale, layer.qk_norm_eps, bias)  # (B, heads, L, H); "per_head": scales (heads, 1, H)


def rms_norm(x, scale, eps, bias=None):
    """RMSNorm over the last axis, `x / sqrt(mean(x ** 2) + eps) * scale (+ bias)`, computed in
    float32 at least and cast back to x's dtype."""
    dtype = _softmax_dtype(x.dtype)
    y = tf.cast(x, dtype)
    y = y * tf.math.rsqrt(tf.reduce_mean(tf.square(y), axis=-1, keepdims=True) + eps) * tf.cast(scale, dtype)
    return tf.cast(y if bias is None else y + tf.cast(bias, dtype), x.dtype)


def layer_norm(x, scale, eps, bias=None):
    """LayerNorm over the last axis, `(x - mean(x)) / sqrt(mean((x - mean(x)) ** 2) + eps) * scale
    (+ bias)` (the biased variance), computed in float32 at least and cast back to x's dtype."""
    dtype = _softmax_dtype(x.dtype)
    y = tf.cast(x, dtype)
    y = y - tf.reduce_mean(y, axis=-1, keepdims=True)
    y = y * tf.math.rsqrt(tf.reduce_mean(tf.square(y), axis=-1, keepdims=True) + eps) * tf.cast(scale, dtype)
    return tf.cast(y if bias is None else y + tf.cast(bias, dtype), x.dtype)


def _gate_heads(layer, call, context):
    """Step 6b: the (B, N, T, Hv) attention result times sigmoid(query @ gate_kernel + gate_bias)
    (softplus with `gate_activation="softplus"`) split into heads (unchanged without `gate`; Hv = H
    without MLA)."""
    if not layer.gate:
        return context
    activation = tf.nn.softplus if layer.gate_activation == "softplus" else tf.sigmoid
    gate = activation(layer._project(call.query, "gate"))  # (B, T, E) -> (B, T, N*Hv)
    return context * layer._split_heads(gate, layer.num_heads, context.shape[-1])  # -> (B, N, T, Hv)


# -------------------------------------------------------------------------------------------------
# Section: KV cache and decode steps
# -------------------------------------------------------------------------------------------------
# Decoding with a KV cache: `cache = layer.init_cache(B, L)`, then `output, cache = layer(x,
# cache=cache)` for a prompt and then one token at a time. The keys (rotated by RoPE) and values
# of the T new tokens are written to slots [index, index + T) (slot p mod L with a `window`: the
# cache rolls by W_before), and query t attends the slot s holding position p iff p < index + T,
# keep[b, s], (not causal or p <= index + t), (no window or index + t - W_before < p, and with a
# pair p < index + t + W_after), (no chunk size or p // C == (index + t) // C) and
# `attention_mask` (given over L) keeps it. The cache is functional (a nest of tensors);
# `init_cache(B, L, in_place=True)` makes one of `tf.Variable`s, written in place (step 5).


class KVCache(NamedTuple):
    """The keys and values of the tokens decoded so far (make one with `init_cache`).

    Attributes:
        key: (B, K, L, H) projected keys, one slot per position; L is the cache's max length.
        value: (B, K, L, H) projected values.
        keep: (B, L) boolean; False marks a slot no query may attend (left padding).
        index: scalar integer, the positions written so far; position p is in slot p (with a
            `window`, slot p mod L: the cache rolls), and the next call writes from index.
        segment_ids: (B, L) int32, the document of each slot (packed sequences: written by the
            first call with `segment_ids`; a query attends only the slots of its document); (B, 0)
            from `init_cache` until then (None in a cache built by hand).
        key_scale: with an int8 or fp8 cache (`init_cache(..., dtype="int8")`: `key` and `value`
            hold int8 integers; "float8_e4m3fn": fp8 values) (B, K, L, 1) float32, the scale of
            each slot's key per head (with MLA (B, 1, L, 1), the latent's); (B, 0) from
            `init_cache` of a float cache (None in a cache built by hand).
        value_scale: likewise for the values ((B, 1, L, 1) with MLA: the turned key part's).
        index_key: (B, L, Hi), the sparse indexer's keys of each slot (`index_topk`); (B, 0, 0) from
            `init_cache` without an indexer (None in a cache built by hand).
    """

    key: tf.Tensor
    value: tf.Tensor
    keep: tf.Tensor
    index: tf.Tensor
    segment_ids: tf.Tensor | None = None
    key_scale: tf.Tensor | None = None
    value_scale: tf.Tensor | None = None
    index_key: tf.Tensor | None = None


def _results(output, weights, cache, return_attention, kv=None, selection=None):
    """output, (output, weights), (output, cache) or (output, weights, cache); the sparse indexer's
    selection before the cache where `return_topk` gives one; then `kv` if given."""
    results = (output, weights) if return_attention else (output,)
    results = results if selection is None else (*results, selection)
    results = results if cache is None else (*results, cache)
    results = results if kv is None else (*results, kv)
    return results[0] if len(results) == 1 else results


def _init_cache(layer, batch_size, max_length, keep, dtype, in_place):
    """`init_cache`: a `KVCache` of zeros with index 0 (int32); with MLA, the latent cache: `key`
    (B, 1, L, C) for the normalized latents, `value` (B, 1, L, Hr) for the rotated shared key part.
    `keep` (B, L) boolean is False for slots no query may attend (left padding of prompts of
    different lengths), all True by default; `dtype` defaults to the compute dtype of the policy
    ("int8": integers with a float32 scale per slot and head, `_with_cache_scales`; "float8_e4m3fn":
    fp8 values, likewise scaled).
    `in_place=True`: the cache's four fields are non-trainable `tf.Variable`s that each call
    writes in place, with no copy of the cache (make it outside any `tf.function`); a compiled
    step then returns only its output."""
    b, length = _positive_int("batch_size", batch_size), _positive_int("max_length", max_length)
    keep = tf.ones((b, length), dtype=tf.bool) if keep is None else _check_keep(keep, b, length)
    key_shape, value_shape = _cache_shapes(layer, b, length)
    dtype = tf.as_dtype(layer.compute_dtype if dtype is None else dtype)
    no_ids = tf.zeros((b, 0), tf.int32)  # segment ids: none yet (a tensor, so the cache is a nest of tensors)
    no_scales = tf.zeros((b, 0), tf.float32)  # a float cache: none
    index_dtype = layer.compute_dtype if dtype in _QUANTIZED_CACHE else dtype  # int8, fp8: the indexer's float
    index_key = tf.zeros(
        _index_cache_shape(layer, b, length), index_dtype
    )  # the indexer's keys (B, L, Hi) or (B, 0, 0)
    key, value = (tf.cast(tf.zeros(shape), dtype) for shape in (key_shape, value_shape))  # fp8 has no tf.zeros
    cache = KVCache(key, value, keep, tf.constant(0, tf.int32), no_ids)
    cache = cache._replace(key_scale=no_scales, value_scale=no_scales, index_key=index_key)
    cache = cache if dtype not in _QUANTIZED_CACHE else _with_cache_scales(cache)  # int8 section (int8 and fp8)
    return _as_variables(cache) if in_place else cache


def _update_cache(layer, call, k, v, keep):
    """Step 5. Without a cache, nothing. With one, the (B, K, T, H) new keys and values written
    (`_write_cache`, which takes `key_mask` into the cache's keep), keep ANDed with the
    (B, 1, T, L) slots each query may attend (causal and window folded in), and k, v the
    cache's (B, K, L, H). Returns k, v, keep, the call with its cache, causal and window
    replaced (and the chunk size), and in a graph whether the tokens do not fit (a () boolean tensor: a graph
    cannot raise under XLA, and that call's output becomes NaN), else None."""
    cache = call.cache
    if cache is None:
        return k, v, keep, call, None
    if _has_segments(call.cache) and not call.segmented:  # packed: the new tokens continue a document
        same, segmented = _segment_keep(layer, call, None, None)  # (B, 1, T, L)
        keep, call = _and(keep, same), call._replace(cache=segmented)
        cache = segmented
    t, index = tf.shape(call.query)[1], tf.convert_to_tensor(cache.index)  # the index before this call's write
    misfit = _check_room(index, t, _cache_length(cache), _window_sides(call.window)[0])  # True only under XLA
    if layer.kv_shared:  # a shared cache: written by its producer
        cache = _written(cache, t)
    elif _is_in_place(cache):
        cache = _write_variables(cache, k, v, call.key_mask, misfit)  # the same variables, written
    else:
        quantized = cache.key.dtype in _QUANTIZED_CACHE  # int8 or fp8: values and scales (int8 section)
        cache = (_write_quantized_cache if quantized else _write_cache)(cache, k, v, call.key_mask)
    positional = (call.causal, call.window, call.attention_chunk_size)
    keep = _and(keep, _cache_keep(tf.convert_to_tensor(cache.keep), index, t, *positional))  # (B, 1, T|1, L)
    k, v = tf.convert_to_tensor(cache.key), tf.convert_to_tensor(cache.value)  # (B, K, L, H), read once
    call = call._replace(causal=False, window=None, attention_chunk_size=None, cache=cache)  # all in `keep`
    return k, v, keep, call, None if tf.executing_eagerly() else misfit


def _check_cache(cache, query, key, heads, head_dim, latent=None):
    """Checks a KVCache against the call's (B, T, E) query and (B, S, kdim) key: keys and values
    (B, K, L, H), or with MLA the latent cache (B, 1, L, C) and (B, 1, L, Hr); dimensions unknown
    at trace time are not checked."""
    (b, t), s = tuple(query.shape)[:2], key.shape[1]
    if t == 0:
        raise ValueError(
            "`query` must hold at least one token (T >= 1) when decoding with `cache`. "
            f"Received: query.shape={tuple(query.shape)}"
        )
    if _differ(s, t):
        raise ValueError(
            "`key` and `value` must hold the T tokens of `query` when decoding with `cache` (they are written to "
            f"it). Received: query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
        )
    k, v = tuple(cache.key.shape), tuple(cache.value.shape)
    if latent is not None:
        _check_latent_cache(k, v, b, latent)
    elif (
        len(k) != 4
        or k != v
        or any(_differ(*pair) for pair in zip((k[0], k[1], k[3]), (b, heads, head_dim), strict=True))
    ):
        raise ValueError(
            f"`cache.key` and `cache.value` must have shape (B, K, L, H) with B={b}, K={heads}, H={head_dim}. "
            f"Received: cache.key.shape={k}, cache.value.shape={v}"
        )
    keep = tuple(cache.keep.shape)
    if len(keep) != 2 or _differ(keep[0], b) or _differ(keep[1], k[2]):
        raise ValueError(f"`cache.keep` must have shape (B, L)=({b}, {k[2]}). Received: cache.keep.shape={keep}")


def _check_cache_dtype(cache, dtype):
    if cache.key.dtype in _QUANTIZED_CACHE:
        return _check_quantized_cache(cache)  # int8 section (int8 and fp8)
    if cache.key.dtype != dtype or cache.value.dtype != dtype:
        raise ValueError(
            f"`cache` must hold the layer's compute dtype {tf.as_dtype(dtype).name}; "
            "make it with `init_cache(..., dtype=...)`. "
            f"Received: cache.key.dtype={cache.key.dtype.name}, cache.value.dtype={cache.value.dtype.name}"
        )


def _check_keep(keep, batch_size, max_length):
    """Checks the (B, L) boolean `keep` of `init_cache`."""
    keep = tf.convert_to_tensor(keep)
    if keep.dtype != tf.bool or tuple(keep.shape) != (batch_size, max_length):
        raise ValueError(
            f"`keep` must be a boolean array of shape (B, L)=({batch_size}, {max_length}). "
            f"Received: keep.shape={tuple(keep.shape)}, keep.dtype={keep.dtype.name}"
        )
    return keep


def _check_room(index, t, length, window):
    """Whether the T new tokens do not fit, as a () boolean tensor: without a window index + T must
    be <= L; with one the cache rolls, and a call that wraps must leave its first query's keys in
    place (L >= window + T - 1; `window` is W_before). Eagerly a misfit is a ValueError; in a graph an
    InvalidArgumentError (XLA ignores it, and the caller sets that call's output to NaN)."""
    misfit = index + t > length  # ()
    if window is not None:
        misfit = misfit & (length < window + t - 1)  # ()
    error, first = (_cache_full_error, index) if window is None else (_cache_too_short_error, window)
    if tf.executing_eagerly() and bool(misfit):
        raise error(int(first), int(t), int(length))
    if not tf.executing_eagerly():  # the error's text, then its numbers
        tf.debugging.Assert(~misfit, [str(error("{}", "{}", "{}")), first, t, length])
    return misfit


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
    slots = tf.range(length)  # (L,)
    return slots + length * tf.math.floordiv(last - slots, length)  # (L,)


def _cache_keep(keep, index, t, causal, window, attention_chunk_size):
    """(B, L) cache keep -> (B, 1, T|1, L): slot s holds a written position p(s), is not padding,
    when causal p(s) is at most the query's own position index + t, and with a window
    p(s) > index + t - W_before (and p(s) < index + t + W_after with a pair), with a chunk size C
    p(s) // C == (index + t) // C. Without a window p(s) is s (the cache does not roll, and the
    slots from index + T on are unwritten)."""
    length = keep.shape[-1] or tf.shape(keep)[-1]  # L, static where known
    last = index + t - 1  # the last position written
    held = (tf.range(length) if window is None else _slot_positions(length, last))[None, :]  # (1, L), p(s)
    positions = index + tf.range(t)[:, None]  # (T, 1), the position of each query
    allowed = (held >= 0) & (held < index + t)  # (1, L): written
    allowed = _and(allowed, _held_keep(held, positions, causal, window, attention_chunk_size))  # (T|1, L)
    return allowed[None, None] & keep[:, None, None, :]  # (B, 1, T|1, L)


def _cache_attend(layer, k):
    """Step 6 of a call with a cache: `_attend`, or over an int8 or fp8 cache `_attend_quantized` (int8 section)."""
    return layer._attend if k.dtype not in _QUANTIZED_CACHE else lambda *args: _attend_quantized(layer, *args)


def _write_cache(cache, k, v, key_mask):
    """gpt-fast's `KVCache.update`, rolling: a new cache with the (B, K, T, H) keys and values of
    positions [index, index + T) in slots position mod L, and `keep` there: the (B, T)
    `key_mask` ANDed into it on the first lap (left padding), in its place once a slot holds a
    new token; index + T. An in-place cache takes the same rule (`_write_variables`)."""
    b, heads, t, length = tf.shape(k)[0], tf.shape(k)[1], tf.shape(k)[2], tf.shape(cache.key)[2]
    positions = cache.index + tf.range(t)  # (T,)
    slots = tf.math.floormod(positions, length)  # (T,)
    written = tf.stack(tf.meshgrid(tf.range(b), tf.range(heads), slots, indexing="ij"), axis=-1)  # (B, K, T, 3)
    rows = tf.stack(tf.meshgrid(tf.range(b), slots, indexing="ij"), axis=-1)  # (B, T, 2): (b, slot)
    new = tf.ones((b, t), tf.bool) if key_mask is None else key_mask  # (B, T)
    kept = tf.where(positions < length, tf.gather(cache.keep, slots, axis=1) & new, new)  # (B, T)
    key = tf.tensor_scatter_nd_update(cache.key, written, k)  # (B, K, L, H)
    value = tf.tensor_scatter_nd_update(cache.value, written, v)  # (B, K, L, H)
    keep = tf.tensor_scatter_nd_update(cache.keep, rows, kept)  # (B, L)
    return KVCache(key, value, keep, cache.index + t, *cache[4:])


def _cache_length(cache):
    """L, static where it is known (`tf.shape` of an in-place cache's variable reads all of it)."""
    length = cache.key.shape[2]
    return tf.shape(cache.key)[2] if length is None else length


def _as_variables(cache):
    """The same cache with non-trainable `tf.Variable`s for fields: an in-place cache."""
    return KVCache(*(None if x is None else tf.Variable(x, trainable=False) for x in cache))


def _is_in_place(cache):
    return isinstance(cache.key, tf.Variable)


def _write_variables(cache, k, v, key_mask, misfit):
    """`_write_cache` on an in-place cache: its variables written where they lie, with no copy of
    the cache per step; nothing is written when the tokens do not fit (`misfit`, only ever True
    under XLA). Returns the same cache."""
    scaled = cache.key.dtype in _QUANTIZED_CACHE  # int8 or fp8
    names = ("key", "value", "keep", "index") + (("key_scale", "value_scale") if scaled else ())
    handles = tuple(getattr(cache, name).handle for name in names)
    fields = tuple((name, getattr(cache, name).dtype, tuple(getattr(cache, name).shape)) for name in names)
    _write_compiled(handles, fields, k, v, key_mask, misfit)
    return cache


@tf.function(jit_compile=True, reduce_retracing=True)
def _write_compiled(handles, fields, k, v, key_mask, misfit):
    """The write, compiled with XLA, which updates the variables where they lie, in eager mode
    and in any graph (TensorFlow's own scatter ops on a variable that is also read cost a copy
    of the whole cache per step). It takes the variables' handles (variables passed from one
    traced function into another are not the caller's), and their dtypes and shapes, which key
    its traces: a read takes its static shape from the handle it was traced with."""

    def write():
        pairs = zip(handles, fields, strict=True)
        read = {name: tf.raw_ops.ReadVariableOp(resource=h, dtype=d) for h, (name, d, _) in pairs}
        cache = KVCache(**read)
        written = (
            _write_cache(cache, k, v, key_mask)
            if len(read) == 4
            else _write_quantized_cache(cache, k, v, key_mask, True)
        )
        for handle, (name, _, _) in zip(handles, fields, strict=True):
            tf.raw_ops.AssignVariableOp(resource=handle, value=getattr(written, name))
        return tf.no_op()

    tf.cond(misfit, tf.no_op, write)


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
# are the options of Gemma 4's full-attention layers (`attention_k_eq_v`) and of Gemma's `v_norm`. The
# gradient reaches the shared keys and values passed in.

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
    absent = _absent_projections(layer)  # `_projection_names` leaves them out
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
    return shared_kv._replace(index=tf.convert_to_tensor(shared_kv.index) - tf.shape(query)[-2])


def _written(cache, t):
    """The shared cache as its producer returned it: the checked cache's index moved on by T."""
    return cache._replace(index=tf.convert_to_tensor(cache.index) + t)


def _shared_pair(layer, call, shared_kv):
    """A `kv_shared` layer's (k, v): `shared_kv` checked as a (B, K, S, H) pair for the call's (B, S) key."""
    b, s = call.key.shape[:2]
    expected = (b, layer.num_kv_heads, s, layer.head_dim)
    pair = tuple(shared_kv) if isinstance(shared_kv, (tuple, list)) else ()
    shapes = tuple(tuple(x.shape) if hasattr(x, "shape") else None for x in pair)
    if len(pair) != 2 or not all(_same_shape(shape, expected) for shape in shapes):
        raise ValueError(
            f"`shared_kv` must be a KVCache or a (k, v) pair of floating (B, K, S, H)={expected} tensors. "
            f"Received: {type(shared_kv).__name__} with shapes {shapes}"
        )
    return tuple(tf.cast(x, layer.compute_dtype) for x in pair)


def _same_shape(shape, expected):
    """Whether a (B, K, S, H) shape matches, dimensions unknown at trace time passing."""
    return (
        shape is not None and len(shape) == 4 and not any(_differ(a, b) for a, b in zip(shape, expected, strict=True))
    )


def _project_sharing(layer, call, shared_kv):
    """Steps 2 to 4 with the sharing options: q (B, N, T, H); k and v (B, K, S, H) projected (v the
    clamped key projection with `keys_as_values`, RMS-normalized with `value_norm`) or `shared_kv`
    (a shared cache, then the call's, gives None: step 5 reads it)."""
    q = _clip(layer, layer._split_heads(layer._project(call.query, "query"), layer.num_heads))  # (B, N, T, H)
    q = q if layer.qk_norm is None else _norm(layer, q, "query", layer.num_heads)
    q = q if layer.rope_theta is None else _turn_heads(layer, q, call.positions)
    if layer.kv_shared and shared_kv is None:
        raise ValueError(
            "`shared_kv` must be given to a layer built with `kv_shared=True`: it has no key or value projections. "
            "Received: shared_kv=None"
        )
    if layer.kv_shared:
        return (q, None, None) if call.cache is not None else (q, *_shared_pair(layer, call, shared_kv))
    k, v = _own_keys_values(layer, call)  # 2. (B, K, S, H) x 2
    k = k if layer.qk_norm is None else _norm(layer, k, "key", layer.num_kv_heads)  # 3.
    k = k if layer.rope_theta is None else _turn_heads(layer, k, call.positions)  # 4.
    return q, k, v


def _own_keys_values(layer, call):
    """The clamped key projection and the values (B, K, S, H): with `keys_as_values` the key
    projection again, with `value_norm` RMS-normalized per head without a scale."""
    k = _clip(layer, layer._split_heads(layer._project(call.key, "key"), layer.num_kv_heads))  # (B, K, S, H)
    v = k if layer.keys_as_values else _raw_values(layer, call)  # (B, K, S, H)
    return k, v if not layer.value_norm else rms_norm(v, 1.0, layer.qk_norm_eps)  # (B, K, S, H)


def _raw_values(layer, call):
    """The values before `value_norm` (B, K, S, H): the clamped value projection, or with `keys_as_values` the key's."""
    kind = "key" if layer.keys_as_values else "value"
    projected = layer._project(getattr(call, kind), kind)  # (B, S, D) -> (B, S, K*H)
    return _clip(layer, layer._split_heads(projected, layer.num_kv_heads))  # -> (B, K, S, H)


# -------------------------------------------------------------------------------------------------
# Section: multi-head latent attention
# -------------------------------------------------------------------------------------------------
# Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi, GLM-5), on with `kv_lora_rank` C; Hn, Hr
# and Hv are `qk_nope_head_dim`, `qk_rope_head_dim` and `v_head_dim`, H = Hn + Hr, Q = `q_lora_rank`:
#     q = RMSNorm(query @ query_a_kernel) @ query_b_kernel   (B, T, N*H), or query @ query_kernel
#     c, k_rope = split(key @ key_value_a_kernel)            (B, S, C), (B, S, Hr); c RMS-normalized
#     [k_nope, v] = c @ key_value_b_kernel                   (B, S, K*(Hn + Hv)), per head
#     k = [k_nope, k_rope]; RoPE turns the last Hr features of q and k_rope (shared by the heads)
# The cache holds c in `key` (B, 1, L, C) and the turned k_rope in `value` (B, 1, L, Hr). The
# absorbed path (`absorb_latents`) attends the latents directly: q_nope @ W_kb^T against c, the
# weighted sum of c then @ W_vb, the up-projections folded into the query and the output.
# `q_lora_rank` Q adds `query_a_kernel`, its norm `query_a_norm` and `query_b_kernel`; `head_dim`, if
# given, must equal Hn + Hr; the output kernel is (N*Hv, E). MLA reads keys and values from `key`
# (`value` must be None or `key` itself) and is not taken with `vdim`, `qk_norm`, `clip_qkv`,
# `rope_sections` or `rope_fraction` < 1.
# The portable layout of the weights (`_weight_shapes`, converters) asks this section for the kernels'
# and the latent norms' shapes (`_kernel_shapes`, `_latent_norms`).

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


def _check_latent_inputs(key, value):
    """MLA reads keys and values from `key`: `value` must be None or `key` itself."""
    if key is not None and value is not None and value is not key:
        raise ValueError(
            "`value` must be None or `key` itself with `kv_lora_rank`: MLA reads keys and values from `key`. "
            "Received: a value other than key"
        )


def _set_latent(layer, latent, vdim, variants):
    """The constructor's MLA step: what MLA refuses (`_check_latent_combinations`); `vdim` becomes `kdim`
    (MLA reads keys and values from `key`); the MLA sizes set on the layer (None without MLA)."""
    if latent is not None:
        _check_latent_combinations(vdim, variants)
        layer.vdim = layer.kdim
    for name in _LATENT_SIZES:
        setattr(layer, name, None if latent is None else getattr(latent, name))


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


def _latent_config(layer, vdim_only=False):
    """MLA's keys of `get_config`: its sizes and `latent_norm_eps`; or (`vdim_only`) `vdim`, None with
    MLA (its values come from `key`), else nothing."""
    if vdim_only:
        return {} if layer.kv_lora_rank is None else {"vdim": None}
    return {name: getattr(layer, name) for name in (*_LATENT_SIZES, "latent_norm_eps")}


def _latent_of(layer):
    """The MLA sizes as a `_Latent`, or None without `kv_lora_rank` (`layer._latent`)."""
    return None if layer.kv_lora_rank is None else _Latent(*(getattr(layer, name) for name in _LATENT_SIZES))


def _projections(latent):
    """The names `bias` takes: the layer's projections, query, key, value, output (with MLA query,
    or query_a and query_b, key_value_a, key_value_b, output), then the gate's."""
    if latent is None:
        return _PROJECTIONS
    query = ("query",) if latent.q_lora_rank is None else ("query_a", "query_b")
    return (*query, "key_value_a", "key_value_b", "output", "gate")


def _latent_norms(layer):
    """MLA's norm scales in the layout, {projection: shape}: `query_a_norm` (Q,) with `q_lora_rank`,
    `key_value_a_norm` (C,); none without MLA."""
    if layer.kv_lora_rank is None:
        return {}
    query = {} if layer.q_lora_rank is None else {"query_a": (layer.q_lora_rank,)}
    return {**query, "key_value_a": (layer.kv_lora_rank,)}


def _kernel_shapes(layer):
    """{projection: its kernel's (D, F)}, in the layout's order."""
    nh, kh = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    if layer.kv_lora_rank is None:
        kernels = {
            "query": (layer.d_model, nh),
            "key": (layer.kdim, kh),
            "value": (layer.vdim, kh),
            "output": (nh, layer.d_model),
        }
        return {kind: shape for kind, shape in kernels.items() if kind not in _absent_projections(layer)}
    c, hn, hr, hv = layer.kv_lora_rank, layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim
    query = {"query": (layer.d_model, nh)}
    if layer.q_lora_rank is not None:
        query = {"query_a": (layer.d_model, layer.q_lora_rank), "query_b": (layer.q_lora_rank, nh)}
    return {
        **query,
        "key_value_a": (layer.kdim, c + hr),
        "key_value_b": (c, layer.num_kv_heads * (hn + hv)),
        "output": (layer.num_heads * hv, layer.d_model),
    }


def _cache_shapes(layer, batch_size, length):
    """The shapes of a cache's keys and values: (B, K, L, H) each, or MLA's (B, 1, L, C) latents and
    (B, 1, L, Hr) shared key parts."""
    latent = layer._latent
    if latent is None:
        return (batch_size, layer.num_kv_heads, length, layer.head_dim), (
            batch_size,
            layer.num_kv_heads,
            length,
            layer.head_dim,
        )
    return (batch_size, 1, length, latent.kv_lora_rank), (batch_size, 1, length, latent.qk_rope_head_dim)


def _check_latent_cache(k, v, batch_size, latent):
    """The latent cache: (B, 1, L, C) latents and (B, 1, L, Hr) turned key parts; `k` and `v` are
    their shapes, dimensions unknown at trace time not checked."""
    c, hr = latent.kv_lora_rank, latent.qk_rope_head_dim
    valid = len(k) == len(v) == 4 and not any(_differ(*pair) for pair in zip(k[:3], v[:3], strict=True))
    if not valid or any(_differ(*pair) for pair in zip((k[0], k[1], k[3], v[3]), (batch_size, 1, c, hr), strict=True)):
        raise ValueError(
            "`cache.key` and `cache.value` must have shape (B, 1, L, C) and (B, 1, L, Hr) with kv_lora_rank: "
            f"B={batch_size}, C={c}, Hr={hr}. Received: cache.key.shape={k}, cache.value.shape={v}"
        )


def _project_latent(layer, call):
    """Step 2 with MLA: q = RMSNorm(query @ query_a_kernel) @ query_b_kernel (or query @
    query_kernel without `q_lora_rank`), (B, N, T, H); key @ key_value_a_kernel split into the
    latent c, RMS-normalized by `key_value_a_norm`, and the key part k_rope shared by the heads.
    Returns q, c (B, 1, S, C), k_rope (B, 1, S, Hr)."""
    if layer.q_lora_rank is None:
        q = layer._project(call.query, "query")  # (B, T, E) -> (B, T, N*H)
    else:
        q_latent = layer._project(call.query, "query_a")  # (B, T, E) -> (B, T, Q)
        q_latent = rms_norm(q_latent, layer.query_a_norm, layer.latent_norm_eps)
        q = layer._project(q_latent, "query_b")  # (B, T, Q) -> (B, T, N*H)
    a = layer._project(call.key, "key_value_a")  # (B, S, kdim) -> (B, S, C + Hr)
    c, k_rope = tf.split(a, [layer.kv_lora_rank, layer.qk_rope_head_dim], axis=-1)  # (B, S, C), (B, S, Hr)
    c = rms_norm(c, layer.key_value_a_norm, layer.latent_norm_eps)
    return layer._split_heads(q, layer.num_heads), c[:, None], k_rope[:, None]  # (B, N, T, H), (B, 1, S, C|Hr)


def _attend_latent(layer, q, latent, k_rope, keep, bias, call):
    """Step 6 with MLA: k and v are the (B, 1, S, C) latents and (B, 1, S, Hr) k_rope, attended
    absorbed (`_attend_absorbed`) or up-projected to per-head keys and values (`_expand_latents`)."""
    if latent.dtype in _QUANTIZED_CACHE:
        latent, k_rope = _dequantize_cache(call.cache, latent, k_rope, q.dtype)  # int8 or fp8 (int8 section)
    if _absorbs(layer, call, q.shape[2]):
        return _attend_absorbed(layer, q, latent, k_rope, keep, bias, call)
    k, v = _expand_latents(layer, latent, k_rope)  # (B, K, S, H), (B, K, S, Hv)
    return layer._attend(q, k, v, keep, bias, call)


def _absorbs(layer, call, t):
    """MLA's path: `absorb_latents` if set, else absorbed with a cache and T <= 8 (T known at
    trace time: a decode step, where up-projecting the L latents costs more than folding the
    up-projections into the T queries)."""
    if layer.absorb_latents is not None:
        return bool(layer.absorb_latents)
    return call.cache is not None and t is not None and t <= _ABSORB_MAX_T


def _expand_latents(layer, latent, k_rope):
    """MLA's up-projection: (B, 1, S, C) latents and (B, 1, S, Hr) k_rope -> keys
    concat(k_nope, k_rope) (B, K, S, H) and values (B, K, S, Hv)."""
    hn, hv = layer.qk_nope_head_dim, layer.v_head_dim
    kv = layer._project(tf.squeeze(latent, 1), "key_value_b")  # (B, 1, S, C) -> (B, S, K*(Hn + Hv))
    k_nope, v = tf.split(layer._split_heads(kv, layer.num_kv_heads, hn + hv), [hn, hv], axis=-1)  # (B, K, S, Hn|Hv)
    k_rope = tf.broadcast_to(k_rope, tf.concat([tf.shape(k_nope)[:3], [layer.qk_rope_head_dim]], 0))  # (B, K, S, Hr)
    return tf.concat([k_nope, k_rope], axis=-1), v  # (B, K, S, H), (B, K, S, Hv)


def _up_projections(layer, dtype):
    """key_value_b's kernel in `dtype` as (N, Hn, C) and (N, Hv, C) and its bias (N, Hn) and
    (N, Hv) (None without one), each key/value head's repeated for its N // K query heads; an
    int8 kernel's dequantized."""
    hn, hv, groups = layer.qk_nope_head_dim, layer.v_head_dim, layer.num_heads // layer.num_kv_heads
    kernel = tf.cast(layer.key_value_b_kernel, dtype)  # (C, K*(Hn + Hv))
    if layer._int8:
        kernel = kernel * tf.cast(layer.key_value_b_kernel_scale, dtype)  # dequantized per column
    kernel = tf.reshape(tf.transpose(kernel), [layer.num_kv_heads, hn + hv, -1])  # -> (K, Hn + Hv, C)
    w_kb, w_vb = tf.split(tf.repeat(kernel, groups, axis=0), [hn, hv], axis=1)  # (N, Hn, C), (N, Hv, C)
    if "key_value_b" not in layer.bias:
        return w_kb, w_vb, None, None
    bias = tf.reshape(tf.cast(layer.key_value_b_bias, dtype), [layer.num_kv_heads, hn + hv])  # (K, Hn + Hv)
    b_k, b_v = tf.split(tf.repeat(bias, groups, axis=0), [hn, hv], axis=-1)  # (N, Hn), (N, Hv)
    return w_kb, w_vb, b_k, b_v


def _attend_absorbed(layer, q, latent, k_rope, keep, bias, call):
    """Step 6 with MLA on the latents, through `_attend_heads` (every path): q_lat = q_nope @
    W_kb^T (B, N, T, C) meets the latents and q_rope meets k_rope (and q_nope . b_k a key of
    ones); the values are the latents (and a one, whose output is sum(weights)); each head's
    context is o_lat @ W_vb + sum(weights) * b_v (B, N, T, Hv). An int8 layer reads the
    latents quantized per token, as its int8 up-projection does (straight-through gradient)."""
    w_kb, w_vb, b_k, b_v = _up_projections(layer, q.dtype)  # (N, Hn, C), (N, Hv, C), (N, Hn), (N, Hv)
    if layer._int8:
        latent = latent + tf.stop_gradient(_quantized_rows(latent) - latent)  # (B, 1, S, C)
    q_nope, q_rope = tf.split(q, [layer.qk_nope_head_dim, layer.qk_rope_head_dim], axis=-1)  # (B, N, T, Hn|Hr)
    ones = tf.ones_like(latent[..., :1])  # (B, 1, S, 1)
    queries, keys, values = [tf.matmul(q_nope, w_kb), q_rope], [latent, k_rope], [latent]  # (B, N, T, C), ...
    if b_k is not None:
        queries.append(tf.reduce_sum(q_nope * b_k[:, None, :], axis=-1, keepdims=True))  # (B, N, T, 1)
        keys.append(ones)
    if b_v is not None:
        values.append(ones)
    q, k, v = (tf.concat(parts, axis=-1) for parts in (queries, keys, values))  # (B, N, T, .), 2 x (B, 1, S, .)
    context, weights = layer._attend(q, k, v, keep, bias, call)  # (B, N, T, C or C + 1)
    output = tf.matmul(context[..., : layer.kv_lora_rank], w_vb, transpose_b=True)  # (B, N, T, C) -> (.., Hv)
    return output if b_v is None else output + context[..., layer.kv_lora_rank :] * b_v[:, None, :], weights


# -------------------------------------------------------------------------------------------------
# Section: sparse indexer
# -------------------------------------------------------------------------------------------------
# DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-MoE-DSA), on with `index_topk` k (it needs MLA):
# a "lightning indexer" of Ni = `index_num_heads` heads of width Hi = `index_head_dim` scores every
# key for each query, and each query attends only the k keys it scores highest among those it may
# attend (its allowed keys):
#     qi = x_q @ index_query_kernel                (B, T, Ni, Hi); x_q the q latent with q_lora_rank, else query
#     ki = LayerNorm(key @ index_key_kernel)       (B, S, Hi); RoPE turns the first Hr features of qi and ki
#     w = query @ index_weights_kernel             (B, T, Ni)
#     score[b, t, s] = sum_n w[b, t, n] * Ni**-0.5 * relu(qi[b, t, n] . ki[b, s] * Hi**-0.5)
# in float32 at least, outside the gradient. The tie rule: equal scores rank the lower key index
# first (`tf.math.top_k` keeps the lower index first among equal values); disallowed keys rank last.
# The selection is ANDed into the call's keep, so every path of step 6 attends it. The call's
# `topk_indices` (B, T, k') passes another layer's selection instead, and `return_topk=True` returns
# the selection used. The cache holds the indexer keys in `KVCache.index_key` (B, L, Hi).
# `index_rope_interleaved`: False pairs feature i with i + Hr/2 (DeepSeek-V3.2), True 2i with 2i + 1
# (GLM-MoE-DSA). The int8 mode leaves the indexer float.

_INDEX_SIZES = ("index_topk", "index_num_heads", "index_head_dim")
_INDEX_NORM_EPS = 1e-6  # the indexer keys' LayerNorm, as DeepSeek-V3.2's `k_norm`
_INDEX_BLOCK_SCORES = 1 << 22  # the indexer's (B, Tb, Ni, S) raw scores of one block of query rows


def _init_indexer(layer, index_topk, index_num_heads, index_head_dim, index_rope_interleaved, index_query_input_norm):
    """The constructor's indexer step (after every other argument and MLA's combinations): each size
    None or a positive integer and the flag a bool, in that order, then their combinations
    (`_check_indexer`); holds them as attributes (None without an indexer)."""
    sizes = dict(zip(_INDEX_SIZES, (index_topk, index_num_heads, index_head_dim), strict=True))
    sizes = {name: None if value is None else _positive_int(name, value) for name, value in sizes.items()}
    layer.index_rope_interleaved = _flag("index_rope_interleaved", index_rope_interleaved)
    layer.index_query_input_norm = _flag("index_query_input_norm", index_query_input_norm)
    _check_indexer(sizes, layer.kv_lora_rank, None if layer.rope_theta is None else layer.qk_rope_head_dim)
    if layer.index_query_input_norm and sizes["index_topk"] is None:
        raise ValueError(
            "`index_query_input_norm` needs `index_topk` (the sparse indexer). Received: index_query_input_norm=True"
        )
    for name, value in sizes.items():
        setattr(layer, name, value)  # layer.index_topk, layer.index_num_heads, layer.index_head_dim


def _check_indexer(sizes, kv_lora_rank, rope_width):
    """The indexer's combinations: `index_topk` needs MLA and both sizes, the sizes need `index_topk`,
    and with RoPE (of width Hr = `rope_width`) Hi >= Hr."""
    topk = sizes["index_topk"]
    if topk is None:
        for name in (name for name in _INDEX_SIZES[1:] if sizes[name] is not None):
            raise ValueError(
                f"`{name}` needs `index_topk` (the sparse indexer). Received: {name}={sizes[name]!r}, index_topk=None"
            )
        return
    if kv_lora_rank is None:
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


def _indexer_config(layer):
    """The indexer's keys of `get_config`, in the signature's order."""
    return {name: getattr(layer, name) for name in (*_INDEX_SIZES, "index_rope_interleaved", "index_query_input_norm")}


def _index_shapes(layer):
    """The indexer's weights in the layout, {name: shape} (after MLA's); {} without `index_topk`."""
    if layer.index_topk is None:
        return {}
    width, heads = layer.index_head_dim, layer.index_num_heads
    reads = layer.d_model if layer.q_lora_rank is None else layer.q_lora_rank  # x_q: query, or the q latent
    shapes = {"index_query_norm": (reads,), "index_query_norm_bias": (reads,)} if layer.index_query_input_norm else {}
    shapes |= {
        "index_query_kernel": (reads, heads * width),
        "index_key_kernel": (layer.kdim, width),
        "index_key_norm": (width,),
        "index_key_norm_bias": (width,),
        "index_weights_kernel": (layer.d_model, heads),
    }
    learned = layer.query_scaling is not None and layer.query_scaling["type"] == "learned"
    n = heads
    return shapes | ({"index_query_scaling_scale": (n,), "index_query_scaling_bias": (n,)} if learned else {})


def _is_indexer_weight(name):
    """Whether a portable weight is the indexer's (float in an int8 layer too)."""
    return name.startswith("index_")


def _index_cache_shape(layer, batch_size, length):
    """`KVCache.index_key`'s shape: (B, L, Hi), or (B, 0, 0) without an indexer."""
    return (batch_size, 0, 0) if layer.index_topk is None else (batch_size, length, layer.index_head_dim)


def _sparse_keep(layer, call, keep, topk_indices, return_topk):
    """Step 5b: the selection (the layer's indexer's, or `topk_indices`) ANDed into keep, which then
    broadcasts to (B, N, T, S); with a cache the new tokens' indexer keys written to `index_key`.
    Returns (keep, call, selection (B, T, k) int32 with `return_topk`, else None)."""
    if topk_indices is None and layer.index_topk is None:
        raise ValueError("`return_topk` needs `index_topk` or `topk_indices`. Received: return_topk=True")
    b, t = tf.shape(call.query)[0], tf.shape(call.query)[1]
    s = tf.shape(call.key)[1] if call.cache is None else _cache_length(call.cache)
    if topk_indices is not None:
        selection = _check_topk_indices(topk_indices, call.query)
    else:
        ki = _index_keys(layer, call.key, call.positions)  # (B, T or S, Hi)
        if call.cache is not None:
            call = call._replace(cache=_write_index_cache(call.cache, ki))
            ki = tf.cast(tf.convert_to_tensor(call.cache.index_key), ki.dtype)  # (B, L, Hi)
        allowed = _full_keep(keep, b, t, s, call.causal, call.window, call.attention_chunk_size)  # (B, T, S)
        selection = _index_topk(layer, call, ki, allowed)  # (B, T, k)
    keep = _and(keep, _selection_keep(selection, b, t, s))  # (B|1, N|1, T, S)
    return keep, call, tf.cast(selection, tf.int32) if return_topk else None


def _check_topk_indices(indices, query):
    """`topk_indices` as an integer (B, T, k) tensor (dimensions unknown at trace time not checked)."""
    indices = tf.convert_to_tensor(indices)
    (b, t), shape = tuple(query.shape)[:2], _static_shape(indices)
    if not indices.dtype.is_integer or shape is None or len(shape) != 3 or _differ(shape[0], b) or _differ(shape[1], t):
        raise ValueError(
            f"`topk_indices` must be an integer tensor of shape (B, T, k) with B={b}, T={t}. "
            f"Received: topk_indices.shape={shape}, topk_indices.dtype={indices.dtype.name}"
        )
    return indices


def _index_keys(layer, key, positions):
    """(B, S, kdim) -> (B, S, Hi): the indexer's keys, LayerNorm (scale and bias) and RoPE of their
    first Hr features, outside the gradient."""
    dtype = _softmax_dtype(layer.compute_dtype)
    ki = tf.matmul(tf.cast(key, dtype), tf.cast(layer.index_key_kernel, dtype))  # (B, S, kdim) -> (B, S, Hi)
    ki = layer_norm(ki, layer.index_key_norm, _INDEX_NORM_EPS, layer.index_key_norm_bias)  # (B, S, Hi)
    return tf.stop_gradient(_turn_index(layer, ki[:, None], positions)[:, 0])  # (B, 1, S, Hi) -> (B, S, Hi)


def _index_positions(call):
    """The (B|1, T) float positions of the indexer's queries: the call's RoPE positions, else i + t from the
    cache's index i before the call (the call's cache is the written one, its index i + T)."""
    if call.positions is not None:
        return tf.cast(call.positions, "float32")  # (B, T)
    t = tf.shape(call.query)[1]
    start = 0 if call.cache is None else tf.convert_to_tensor(call.cache.index) - t
    return tf.cast(start + tf.range(t), "float32")[None]  # (1, T)


def _index_queries(layer, query, positions, scaling_positions):
    """(B, T, E) -> the indexer's queries qi (B, Ni, T, Hi) (their input LayerNorm-ed with
    `index_query_input_norm`, scaled by the learned scaling at (B|1, T) `scaling_positions`), their first Hr
    features turned, and the heads' weights w * Ni**-0.5 (B, T, Ni), outside the gradient."""
    dtype = _softmax_dtype(layer.compute_dtype)
    source = query if layer.q_lora_rank is None else _query_latent(layer, query)  # (B, T, E or Q)
    if layer.index_query_input_norm:
        scale, bias = tf.cast(layer.index_query_norm, dtype), tf.cast(layer.index_query_norm_bias, dtype)
        source = layer_norm(tf.cast(source, dtype), scale, _INDEX_NORM_EPS, bias)  # (B, T, E or Q)
    qi = tf.matmul(tf.cast(source, dtype), tf.cast(layer.index_query_kernel, dtype))  # -> (B, T, Ni*Hi)
    qi = layer._split_heads(qi, layer.index_num_heads, layer.index_head_dim)  # -> (B, Ni, T, Hi)
    if "index_query_scaling_scale" in _index_shapes(layer):
        scale, bias = layer.index_query_scaling_scale, layer.index_query_scaling_bias
        qi = qi * _learned_scales(scale, bias, tf.cast(scaling_positions, dtype), dtype)  # (B, Ni, T, Hi)
    w = tf.matmul(tf.cast(query, dtype), tf.cast(layer.index_weights_kernel, dtype))  # (B, T, E) -> (B, T, Ni)
    return tf.stop_gradient(_turn_index(layer, qi, positions)), tf.stop_gradient(w * layer.index_num_heads**-0.5)


def _query_latent(layer, query):
    """(B, T, E) -> (B, T, Q): MLA's normalized q latent, which the indexer's queries read."""
    a = layer._project(query, "query_a")  # (B, T, E) -> (B, T, Q)
    return rms_norm(a, layer.query_a_norm, layer.latent_norm_eps)  # (B, T, Q)


def _turn_index(layer, x, positions):
    """RoPE of the first Hr features of each indexer head of x (B, heads, T, Hi), paired by
    `index_rope_interleaved`, times YaRN's factor; unchanged without RoPE."""
    if layer.rope_theta is None:
        return x
    x = apply_rope(x, positions, layer._inv_freq, layer.index_rope_interleaved)  # (B, heads, T, Hi)
    return scale_rotated(x, 2 * layer._inv_freq.shape[0], rope_attention_factor(layer.rope_scaling))


def _write_index_cache(cache, ki):
    """The cache with the (B, T, Hi) indexer keys of the T tokens just written (positions
    [index - T, index)) at slots position mod L of `index_key` (an in-place cache's variable
    written where it lies)."""
    b, t, length = tf.shape(ki)[0], tf.shape(ki)[1], _cache_length(cache)
    shape = None if cache.index_key is None else tuple(cache.index_key.shape)
    if shape is None or len(shape) != 3 or _differ(shape[1], cache.key.shape[2]) or _differ(shape[2], ki.shape[2]):
        raise ValueError(
            f"`cache.index_key` must have shape (B, L, Hi)=({ki.shape[0]}, {cache.key.shape[2]}, {ki.shape[2]}) with "
            f"index_topk (make the cache with `init_cache`). Received: cache.index_key.shape={shape}"
        )
    slots = tf.math.floormod(tf.convert_to_tensor(cache.index) - t + tf.range(t), length)  # (T,)
    rows = tf.stack(tf.meshgrid(tf.range(b), slots, indexing="ij"), axis=-1)  # (B, T, 2): (b, slot)
    ki = tf.cast(ki, cache.index_key.dtype)
    if _is_in_place(cache):
        cache.index_key.scatter_nd_update(rows, ki)
        return cache
    return cache._replace(index_key=tf.tensor_scatter_nd_update(cache.index_key, rows, ki))  # (B, L, Hi)


def _full_keep(keep, b, t, s, causal, window, attention_chunk_size):
    """(B, T, S): the keys each query may attend for some head: `keep` (with a cache, the cache's
    rule already in it), `causal`, `window` and the chunk."""
    allowed = tf.ones([b, t, s], tf.bool)
    if keep is not None:
        allowed = allowed & tf.reduce_any(keep, axis=1)  # (B|1, N|1, T|1, S|1) -> (B, T, S)
    positional = _position_keep(tf.range(t) + (s - t), s, causal, window, attention_chunk_size)  # (T, S) or None
    return allowed if positional is None else allowed & positional  # (B, T, S)


def _index_topk(layer, call, ki, allowed):
    """The layer's own selection (B, T, k) of k = min(index_topk, S) keys (`_select_topk`), scored in
    blocks of query rows of about `_INDEX_BLOCK_SCORES` raw scores (B, Tb, Ni, S), each block's
    scores ranked and dropped."""
    qi, w = _index_queries(layer, call.query, call.positions, _index_positions(call))  # (B, Ni, T, Hi), (B, T, Ni)
    k = tf.minimum(layer.index_topk, tf.shape(allowed)[2])
    rows = max(1, _INDEX_BLOCK_SCORES // ((qi.shape[0] or 1) * layer.index_num_heads * (ki.shape[1] or 1)))
    if qi.shape[2] is not None and qi.shape[2] <= rows:
        return _select_topk(_index_scores(layer, qi, w, ki), allowed, k)
    t = tf.shape(qi)[2]
    count = (t + rows - 1) // rows
    pad = count * rows - t  # the last block padded to `rows` rows (XLA's TensorArray holds equal blocks)
    qi, w = tf.pad(qi, [[0, 0], [0, 0], [0, pad], [0, 0]]), tf.pad(w, [[0, 0], [0, pad], [0, 0]])  # T -> count*rows
    allowed = tf.pad(allowed, [[0, 0], [0, pad], [0, 0]])  # (B, count*rows, S)

    def block(i, blocks):
        start = i * rows
        scores = _index_scores(layer, qi[:, :, start : start + rows], w[:, start : start + rows], ki)  # (B, Tb, S)
        return i + 1, blocks.write(
            i, tf.transpose(_select_topk(scores, allowed[:, start : start + rows], k), [1, 0, 2])
        )

    blocks = tf.TensorArray(tf.int32, size=count)  # each (Tb, B, k)
    _, blocks = tf.while_loop(lambda i, _: i < count, block, (0, blocks))
    return tf.transpose(blocks.concat()[:t], [1, 0, 2])  # (count*rows, B, k) -> (B, T, k)


def _index_scores(layer, qi, w, ki):
    """The indexer's scores (B, T, S) of queries qi (B, Ni, T, Hi) with weights w (B, T, Ni) against
    (B, S, Hi) keys: sum_n w[n] * relu(qi[n] . ki * Hi**-0.5)."""
    dots = tf.nn.relu(tf.einsum("bnth,bsh->bnts", qi, ki) * layer.index_head_dim**-0.5)  # (B, Ni, T, S)
    return tf.einsum("bnts,btn->bts", dots, w)  # (B, T, S)


def _select_topk(scores, allowed, k):
    """The first k keys of each row ranked by score, highest first, equal scores by the lower key
    index, disallowed keys after every allowed one (`tf.math.top_k` keeps the lower index first
    among equal values). (B, T, S) -> (B, T, k) int32."""
    ranked = tf.where(allowed, scores, scores.dtype.min)  # (B, T, S)
    return tf.math.top_k(ranked, k, sorted=True).indices  # (B, T, k)


def _selection_keep(selection, b, t, s):
    """(B, T, k) key indices -> (B, 1, T, S) boolean, True at the selected keys (an index outside
    [0, S) selects nothing, duplicates count once), by one scatter of B*T*k ones."""
    selection = tf.cast(selection, tf.int32)  # (B, T, k)
    selection = tf.where((selection >= 0) & (selection < s), selection, s)  # out of range: column S
    k = tf.shape(selection)[2]
    grid = tf.meshgrid(tf.range(b), tf.range(t), tf.range(k), indexing="ij")  # 3 x (B, T, k)
    at = tf.stack([grid[0], grid[1], selection], axis=-1)  # (B, T, k, 3): (b, t, key)
    counts = tf.scatter_nd(at, tf.ones([b, t, k], tf.int32), [b, t, s + 1])  # (B, T, S + 1)
    return (counts[..., :s] > 0)[:, None]  # (B, 1, T, S)


# -------------------------------------------------------------------------------------------------
# Section: speed paths
# -------------------------------------------------------------------------------------------------
# The memory-efficient path: `dot_product_attention` without the weights, a chunk of queries at a
# time, forward (`_chunked_forward`) and backward (`_chunked_backward`, the flash-attention
# backward, which recomputes each chunk's weights), so that memory is linear in T and S. The fused
# q/k/v projection (self-attention: one matmul) is the plain call's, in the core (`_project`).


def _attend_in_chunks(layer, q, k, v, keep, bias, call):
    """`_attend` without the weights where the (B, N, T, S) scores may exceed
    `memory_efficient_threshold` elements: the memory-efficient path (where shapes are unknown at
    trace time: decided at run time, or always under XLA, which cannot differentiate that choice).
    Returns (context (B, N, T, Hv), None)."""
    mask_bias, attention_bias = bias
    training = call.training
    dropout = layer.dropout > 0 and training is not False and training is not None
    chunk = _query_chunk(layer, q, k)
    modifiers = _score_modifiers(layer, call)
    drop = functools.partial(layer._dropout_layer, training=training) if dropout else None

    def at_once():
        kept = keep if call.segments is None else _and(keep, _same_documents(*call.segments))  # (B, 1, T, S)
        return dot_product_attention(
            q, k, v, kept, _add(mask_bias, attention_bias), call.causal, **modifiers, dropout=drop
        )

    def in_chunks():
        rate, seed = (layer.dropout, _dropout_seed(layer)) if dropout else (0.0, None)
        return _memory_efficient_attention(
            q, k, v, keep, mask_bias, call.causal, chunk, rate, seed, attention_bias=attention_bias, **modifiers,
            segments=call.segments,
        )  # fmt: skip

    if None not in (q.shape[0], q.shape[2], k.shape[2]) or _compiled_by_xla():
        context = in_chunks()  # (B, N, T, H)
    else:
        scores = tf.reduce_prod(tf.cast(tf.shape(q)[:3], tf.int64)) * tf.cast(tf.shape(k)[2], tf.int64)
        large = scores > layer.memory_efficient_threshold
        context = tf.cond(large, in_chunks, lambda: at_once()[0])  # (B, N, T, H)
    context.set_shape(q.shape[:3].concatenate(v.shape[3:]))  # (B, N, T, H): the static dims the chunks lose
    return context, None


def _query_chunk(layer, q, k):
    """Queries per chunk of the memory-efficient path, or None where the (B, N, T, S) scores
    are known at trace time to be at most `memory_efficient_threshold` elements. With T
    unknown under XLA, a () tensor of at most T that XLA folds to a constant for each T it
    compiles: a short call (a decode step) is not padded to a whole chunk of queries."""
    b, n, t, s = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if None not in (b, t, s) and b * n * t * s <= layer.memory_efficient_threshold:
        return None
    chunk = max(1, layer.query_chunk_elements // (n * (b or 1) * (s or 4096)))  # S unknown: sized for 4096
    if t is None and _compiled_by_xla():
        return tf.maximum(tf.minimum(chunk, tf.shape(q)[2]), 1)  # () int32, 1 <= chunk <= max(T, 1)
    return chunk if t is None else min(chunk, t)


def _dropout_seed(layer):
    """A (2,) seed for the memory-efficient path's stateless dropout: from the Keras dropout
    layer's seed generator (so `keras.utils.set_random_seed` applies), or drawn from the
    global TensorFlow seed under legacy Keras, which has no seed generator."""
    generator = getattr(layer._dropout_layer, "seed_generator", None)
    if generator is not None:
        return generator.next()
    return tf.random.uniform((2,), maxval=2**31 - 1, dtype=tf.int64)


def _memory_efficient_attention(*args, **kwargs):
    """`_chunked_attention`, run as one graph in eager mode: eager ops would run one at a time, and
    a GradientTape would record each chunk's, keeping every chunk's scores alive until the gradient."""
    attention = _chunked_graph if tf.executing_eagerly() else _chunked_attention
    return attention(*args, **kwargs)


class _Chunks(NamedTuple):
    """What every chunk of `_chunked_attention` reads besides q, k, v and the inputs with a gradient."""

    keep: tf.Tensor | None  # boolean, rank 4, its T dimension 1 or padded to T' = count * size
    bias: tf.Tensor | None  # the floating mask's additive (no gradient), likewise
    causal: bool
    window: int | tuple | None
    attention_chunk_size: int | None  # Llama 4's chunks of keys, not the chunks of queries here
    softcap: float | None
    segments: tuple | None  # packed sequences: (B, T') ids (padded) and (B, S) key ids, or None
    spans: tuple | None  # (B, T') first and last key of each query's document (`_key_spans`; not under XLA)
    size: int | tf.Tensor  # queries per chunk (a () tensor under XLA with T unknown)
    count: tf.Tensor  # the number of chunks
    offset: tf.Tensor  # S - T: causal and window are bottom-right aligned
    s: tf.Tensor  # S
    rate: float  # dropout
    seed: tf.Tensor | None  # (2,) int64
    dtype: tf.DType  # the softmax's
    heads: tuple  # (B, N, K, G, Hv), G = N // K, Hv the values' width; B and Hv static where known


def _chunked_attention(
    q, k, v, keep, bias, causal, chunk, dropout_rate=0.0, seed=None, *,
    scale=None, softcap=None, window=None, attention_chunk_size=None, sinks=None, attention_bias=None,
    segments=None,
):  # fmt: skip
    """`dot_product_attention` without the weights, `chunk` queries at a time, in memory linear
    in T and S: only one chunk's (B, N, chunk, S) scores exist at a time, forward and backward
    (a custom gradient recomputes them). `bias` (the floating mask) gets no gradient;
    `attention_bias` (added beside it) and `sinks` do. Dropout draws a stateless mask per chunk
    from `seed` (shape (2,)), so the backward drops the same weights as the forward. With
    `segments` (packed sequences) a chunk makes its own keep of the ids and, outside XLA, attends
    only the keys of its documents (`_chunk_keys`).

    Args: as `dot_product_attention`; `chunk` is a Python int (under XLA, a () tensor that XLA
        folds to a constant); `segments` None or the (B, T) and (B, S) ids.

    Returns:
        context (B, N, T, H).
    """
    b, n = (q.shape[i] if q.shape[i] is not None else tf.shape(q)[i] for i in (0, 1))  # static if known
    h = v.shape[3] if v.shape[3] is not None else tf.shape(v)[3]  # Hv, the context's width
    t, s, dtype = tf.shape(q)[2], tf.shape(k)[2], _softmax_dtype(q.dtype)
    count = (t + chunk - 1) // chunk
    padded = count * chunk - t
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q = q * tf.constant(scale, q.dtype)  # scale the (B, N, T, H) queries, not the scores (no float32 rounding)
    q = tf.pad(q, [[0, 0], [0, 0], [0, padded], [0, 0]])  # (B, N, T', H), T' a multiple of chunk
    attention_bias = None if attention_bias is None else tf.cast(attention_bias, dtype)
    keep, bias, attention_bias = (_pad_rows(_full_rows(m, t), padded) for m in (keep, bias, attention_bias))
    extras = {"attention_bias": attention_bias, "sinks": None if sinks is None else tf.cast(sinks, dtype)}
    extras = {name: x for name, x in extras.items() if x is not None}  # the inputs with a gradient besides q, k, v
    seed = None if seed is None else tf.cast(seed, tf.int64)
    heads = (b, n, k.shape[1], q.shape[1] // k.shape[1], h)
    spans = None if segments is None or _compiled_by_xla() else _key_spans(*segments, s)  # (B, T) twice
    spans = (
        None
        if spans is None
        else tuple(tf.pad(x, [[0, 0], [0, padded]], constant_values=c) for x, c in zip(spans, (s, -1), strict=True))
    )
    segments = None if segments is None else (tf.pad(segments[0], [[0, 0], [0, padded]]), segments[1])  # (B, T')
    chunks = _Chunks(
        keep, bias, causal, window, attention_chunk_size, softcap, segments, spans, chunk, count, s - t, s,
        dropout_rate, seed, dtype, heads,
    )  # fmt: skip

    @tf.custom_gradient
    def attend(q, k, v, *values):
        extra = dict(zip(extras, values, strict=True))
        return _chunked_forward(chunks, q, k, v, extra), functools.partial(_chunked_backward, chunks, q, k, v, extra)

    return attend(q, k, v, *extras.values())[:, :, :t]  # (B, N, T, H)


_chunked_graph = tf.function(_chunked_attention)


def _chunked_forward(chunks, q, k, v, extra):
    """The (B, N, T', Hv) context, one chunk of queries at a time (`_stacked`)."""
    b, n, _, _, h = chunks.heads

    def one(i):
        keys = _chunk_keys(chunks, i)  # (first, end) of the keys chunk i reads, or None: all
        weights, _ = _dropped(chunks, _chunk_weights(chunks, q, _key_cols(k, keys), i, extra, keys)[1], i)
        values = _key_cols(v, keys)  # (B, K, S', Hv)
        return _by_head(chunks, tf.matmul(_grouped(chunks, tf.cast(weights, v.dtype)), values))  # (B, N, chunk, Hv)

    contexts = _stacked(one, chunks.count, (b, n, chunks.size, h), v.dtype)  # (count, B, N, chunk, Hv)
    return tf.reshape(tf.transpose(contexts, [1, 2, 0, 3, 4]), [b, n, -1, h])  # -> (B, N, T', Hv)


def _chunked_backward(chunks, q, k, v, extra, d_context):
    """The gradients of q, k, v and of `extra` (`attention_bias`, `sinks`) from the (B, N, T', H)
    `d_context`, one chunk at a time in a `tf.while_loop` (`_chunk_gradients`): k's and v's
    accumulated in the softmax's dtype, q's and per-row `attention_bias`'s (a bias whose T
    dimension is full) collected per chunk."""
    zeros_k = tf.zeros(tf.shape(k), chunks.dtype)  # (B, K, S, H), accumulated in float32 at least (float64 stays)
    zeros_v = tf.zeros(tf.shape(v), chunks.dtype)  # (B, K, S, Hv)
    d_q = tf.TensorArray(q.dtype, size=chunks.count, element_shape=None, infer_shape=False)
    d_extra = {name: tf.zeros_like(x) for name, x in extra.items()}
    bias_rows = "attention_bias" in extra and extra["attention_bias"].shape[2] != 1
    if bias_rows:
        d_extra["attention_bias"] = tf.TensorArray(
            chunks.dtype, size=chunks.count, element_shape=None, infer_shape=False
        )

    def body(i, d_k, d_v, d_q, d_extra):
        return (i + 1, *_chunk_gradients(chunks, q, k, v, extra, d_context, i, (d_k, d_v, d_q, d_extra)))

    _, d_k, d_v, d_q, d_extra = tf.while_loop(lambda i, *_: i < chunks.count, body, (0, zeros_k, zeros_v, d_q, d_extra))
    d_q = tf.reshape(tf.transpose(d_q.stack(), [1, 2, 0, 3, 4]), tf.shape(q))  # (B, N, T', H)
    if bias_rows:
        rows = tf.transpose(d_extra["attention_bias"].stack(), [1, 2, 0, 3, 4])  # (b, n, count, chunk, S)
        d_extra["attention_bias"] = tf.reshape(rows, tf.shape(extra["attention_bias"]))  # (b, n, T', S)
    return (d_q, tf.cast(d_k, k.dtype), tf.cast(d_v, v.dtype), *(d_extra[name] for name in extra))


def _chunk_weights(chunks, q, k, i, extra, keys=None):
    """Query rows [i*size, (i+1)*size) against the keys `k` (B, K, S', H), those of `keys`
    (first, end) or all: their (B, N, size, H) queries, float weights, the soft-cap's tanh (or
    None) and their part of `attention_bias` (or None)."""
    size = chunks.size
    start = i * size
    q_i = _rows(q, start, size)  # (B, N, chunk, H)
    scores = tf.cast(_by_head(chunks, tf.matmul(_grouped(chunks, q_i), k, transpose_b=True)), chunks.dtype)
    scores, capped = _capped_chunk(chunks, scores)  # capped: the soft-cap's tanh, kept for the backward
    positions = start + tf.range(size) + chunks.offset  # (chunk,)
    held = tf.range(chunks.s)[None, :] if keys is None else tf.range(keys[0], keys[1])[None, :]  # (1, S')
    position_keep = _held_keep(held, positions[:, None], chunks.causal, chunks.window, chunks.attention_chunk_size)
    keep_i = _and(_key_cols(_chunk_rows(chunks.keep, start, size), keys, 3), position_keep)  # (B, N, chunk, S')
    if chunks.segments is not None:
        ids, key_ids = _rows(chunks.segments[0][:, None, :, None], start, size), _key_cols(chunks.segments[1], keys, 1)
        keep_i = _and(keep_i, ids == key_ids[:, None, None, :])  # (B, 1, chunk, S')
    bias_i = _key_cols(_chunk_rows(extra.get("attention_bias"), start, size), keys, 3)
    added = _add(_key_cols(_chunk_rows(chunks.bias, start, size), keys, 3), bias_i)
    added = added if "sinks" in extra else _centre_rows(added, keep_i)
    scores = scores if added is None else scores + added  # (B, N, chunk, S)
    return q_i, _masked_softmax(scores, keep_i, extra.get("sinks")), capped, bias_i


def _chunk_gradients(chunks, q, k, v, extra, d_context, i, totals):
    """One step of `_chunked_backward`: chunk i's weights recomputed, and its gradients added to
    `totals` (d_k, d_v, d_q, d_extra) of the chunks before it."""
    d_k, d_v, d_q, d_extra = totals
    keys = _chunk_keys(chunks, i)  # (first, end) of the keys chunk i reads, or None: all
    k, v = _key_cols(k, keys), _key_cols(v, keys)  # (B, K, S', H), (B, K, S', Hv)
    q_i, weights, capped, bias_i = _chunk_weights(chunks, q, k, i, extra, keys)
    kept, mask = _dropped(chunks, weights, i)
    d_out = _grouped(chunks, _rows(d_context, i * chunks.size, chunks.size))  # (B, K, G*chunk, H)
    d_v_i = tf.matmul(_grouped(chunks, tf.cast(kept, v.dtype)), d_out, transpose_a=True)  # (B, K, S', Hv)
    d_v = _accumulate(d_v, _all_keys(d_v_i, keys, chunks.s, 2))
    d_weights = tf.cast(_by_head(chunks, tf.matmul(d_out, v, transpose_b=True)), chunks.dtype)  # (B, N, chunk, S')
    d_weights = d_weights if mask is None else d_weights * mask
    total = tf.reduce_sum(d_weights * weights, -1, keepdims=True)  # (B, N, chunk, 1)
    d_scores = weights * (d_weights - total)  # the softmax's input, after the bias
    wide = "attention_bias" in extra and extra["attention_bias"].shape[3] != 1  # a bias over all S keys
    d_extra = _extra_gradients(d_extra, i, d_scores, weights, total, bias_i, keys if wide else None, chunks.s)
    d_scores = d_scores if capped is None else d_scores * (1 - tf.square(capped))  # d tanh
    d_scores = _grouped(chunks, tf.cast(d_scores, q.dtype))  # (B, K, G*chunk, S')
    d_k = _accumulate(d_k, _all_keys(tf.matmul(d_scores, _grouped(chunks, q_i), transpose_a=True), keys, chunks.s, 2))
    return d_k, d_v, d_q.write(i, _by_head(chunks, tf.matmul(d_scores, k))), d_extra


def _extra_gradients(d_extra, i, d_scores, weights, total, bias_i, keys=None, s=None):
    """Adds chunk i's gradients of `attention_bias` (reduced to its shape; per-chunk rows when
    its T dimension is full; padded to all S keys where the chunk read those of `keys` and the
    bias has them) and of the sink logits."""
    d_extra = dict(d_extra)
    if "attention_bias" in d_extra:
        d_bias = _all_keys(_reduce_to(d_scores, tf.shape(bias_i)), keys, s, 3)  # (B, N, chunk, S') -> bias's shape
        rows = d_extra["attention_bias"]
        full = isinstance(rows, tf.TensorArray)
        d_extra["attention_bias"] = rows.write(i, d_bias) if full else _accumulate(rows, d_bias)
    if "sinks" in d_extra:
        sink_weight = 1 - tf.reduce_sum(weights, axis=-1, keepdims=True)  # (B, N, chunk, 1)
        d_sinks = -tf.reduce_sum(sink_weight * total, axis=[0, 2, 3])  # (N,)
        d_extra["sinks"] = _accumulate(d_extra["sinks"], d_sinks)
    return d_extra


def _dropped(chunks, weights, i):
    """Chunk i's weights after dropout, and the dropout mask (None without dropout)."""
    mask = _dropout_keep(tf.shape(weights), chunks.rate, chunks.seed, i, weights.dtype)
    return (weights, None) if mask is None else (weights * mask, mask)


def _key_spans(segment_ids, key_ids, s):
    """(B, T) and (B, S) ids -> (B, T) first and last key that hold each query's id (S and -1
    where none does), in O((T + S) log S): the keys sorted by id, each query's id searched."""
    order = tf.argsort(key_ids, axis=-1, stable=True)  # (B, S)
    ordered = tf.gather(key_ids, order, batch_dims=1)  # (B, S) ids, ascending
    low = tf.searchsorted(ordered, segment_ids, side="left")  # (B, T)
    high = tf.searchsorted(ordered, segment_ids, side="right")  # (B, T)
    order = tf.pad(order, [[0, 0], [0, 1]])  # (B, S + 1): low may be S
    first = tf.where(high > low, tf.gather(order, low, batch_dims=1), s)  # (B, T)
    last = tf.where(high > low, tf.gather(order, tf.maximum(high - 1, 0), batch_dims=1), -1)  # (B, T)
    return first, last


def _chunk_keys(chunks, i):
    """The keys [first, end) that chunk i's queries may see, a () pair from the documents of its
    rows (`chunks.spans`, every batch element) within `causal` and `window`; None (all keys)
    without spans."""
    if chunks.spans is None:
        return None
    start, size = i * chunks.size, chunks.size
    first = tf.reduce_min(tf.slice(chunks.spans[0], tf.stack([0, start]), [-1, size]))
    end = tf.reduce_max(tf.slice(chunks.spans[1], tf.stack([0, start]), [-1, size])) + 1
    before, after = _window_sides(chunks.window)
    near, far = start + chunks.offset, start + size - 1 + chunks.offset  # the chunk's first and last query
    end = tf.minimum(end, far + 1) if chunks.causal else end
    first = first if before is None else tf.maximum(first, near - before + 1)
    end = end if after is None else tf.minimum(end, far + after)
    first = tf.minimum(first, chunks.s)
    return first, tf.maximum(end, first)


def _key_cols(x, keys, axis=2):
    """The keys [first, end) of `x` along `axis` (a rank-4 mask's S dimension, axis 3, of 1 as
    is); x as is where `keys` or x is None."""
    if keys is None or x is None or (axis == 3 and x.shape[3] == 1):
        return x
    begin = [0] * x.shape.rank
    size = [-1] * x.shape.rank
    begin[axis], size[axis] = keys[0], keys[1] - keys[0]
    return tf.slice(x, tf.stack(begin), tf.stack(size))


def _all_keys(x, keys, s, axis):
    """A gradient over the keys [first, end) padded with zeros to all S keys along `axis` (as
    is where `keys` is None)."""
    if keys is None:
        return x
    padding = [[0, 0]] * x.shape.rank
    padding[axis] = [keys[0], s - keys[1]]
    return tf.pad(x, padding)


def _grouped(chunks, x):
    b, _, kv, groups, _ = chunks.heads
    return tf.reshape(x, [b, kv, groups * chunks.size, -1])  # (B, N, chunk, X) -> (B, K, G*chunk, X)


def _by_head(chunks, x):
    b, n, _, _, _ = chunks.heads
    return tf.reshape(x, [b, n, chunks.size, -1])  # (B, K, G*chunk, X) -> (B, N, chunk, X)


def _accumulate(total, update):
    return total + tf.ensure_shape(tf.cast(update, total.dtype), total.shape)


def _rows(x, start, size):
    """Rows [start, start + size) of a rank-4 tensor (a dynamic slice of static size, for XLA)."""
    return tf.slice(x, tf.stack([0, 0, start, 0]), [-1, -1, size, -1])


def _chunk_rows(mask, start, size):
    """Rows [start, start + size) of a rank-4 mask whose T dimension is full; a mask with T = 1
    broadcasts and is returned as is."""
    if mask is None or mask.shape[2] == 1:
        return mask
    return _rows(mask, start, size)


def _pad_rows(mask, rows):
    """Appends `rows` kept rows to the T dimension of a rank-4 mask (when it is full); by
    concatenation, since ONNX Runtime cannot pad a boolean tensor."""
    if mask is None or mask.shape[2] == 1:
        return mask
    shape = tf.shape(mask)
    fill = tf.constant(True if mask.dtype == tf.bool else 0, mask.dtype)
    kept = tf.fill(tf.stack([shape[0], shape[1], rows, shape[3]]), fill)
    return tf.concat([mask, kept], axis=2)


def _full_rows(mask, t):
    """A rank-4 mask whose T dimension is unknown at trace time, broadcast to T rows."""
    if mask is None or mask.shape[2] is not None:
        return mask
    shape = tf.shape(mask)
    return tf.broadcast_to(mask, tf.stack([shape[0], shape[1], t, shape[3]]))


def _dropout_keep(shape, rate, seed, chunk, dtype):
    """The dropout mask of one chunk in `dtype`, the same every time it is drawn (forward and backward)."""
    if not rate:
        return None
    draws = tf.random.stateless_uniform(shape, seed=seed + tf.cast(tf.stack([0, chunk]), tf.int64))
    return tf.cast(draws >= rate, dtype) / (1.0 - rate)


def _stacked(fn, count, shape, dtype):
    """`tf.stack([fn(i) for i in range(count)])`, each `fn(i)` of `shape`, by a `tf.while_loop`, one
    step at a time: into a TensorArray where `shape` is known at trace time; else into a
    preallocated (count, *shape) tensor, since LiteRT cannot convert a TensorArray of unknown
    shape (TensorFlow copies that tensor at every step: memory stays linear, time grows)."""
    if all(isinstance(d, int) for d in shape):
        array = tf.TensorArray(dtype, size=count, element_shape=shape)
        _, array = tf.while_loop(
            lambda i, _: i < count, lambda i, array: (i + 1, array.write(i, fn(i))), (0, array), parallel_iterations=1
        )
        return array.stack()  # (count, *shape)

    def write(i, stack):
        return i + 1, tf.tensor_scatter_nd_update(stack, tf.reshape(i, [1, 1]), fn(i)[None])

    stack = tf.zeros(tf.stack([count, *shape]), dtype)  # (count, *shape)
    return tf.while_loop(lambda i, _: i < count, write, (0, stack))[1]


def _reduce_to(gradient, shape):
    """Sums a (B, N, R, S) gradient over the dimensions it was broadcast along from `shape`."""
    axes, _ = tf.raw_ops.BroadcastGradientArgs(s0=shape, s1=tf.shape(gradient))
    return tf.reshape(tf.reduce_sum(gradient, axes), shape)


# -------------------------------------------------------------------------------------------------
# Section: int8
# -------------------------------------------------------------------------------------------------
# Keras' scheme (docs/SPEC.md, "int8"): `keras.quantizers.abs_max_quantize` on the kernels (per
# output column, when quantizing) and on the inputs of each projection (per token, at run time).
# `layer.quantize("int8")` makes each kernel int8 with a float32 `<kind>_kernel_scale` per output
# column (Keras' int8 `Dense` scheme). Keras' quantization API: `layer.quantize("int8")`,
# `model.quantize("int8")`, the "int8_from_<policy>" dtype policies, with the portable int8 layout
# as the variables.

_INT8_MAX = 127.0
_INT8_EPSILON = 1e-7  # Keras' `backend.epsilon()`, added to the abs-max before dividing


def _quantize(layer, mode, config):
    """`quantize`: the projections (four, five with `gate`) to int8 as Keras'
    `Dense.quantize("int8")` does: each kernel becomes an int8 variable with one float32
    `<kind>_kernel_scale` per output column, each call quantizes the projections' inputs per
    token, and the dtype policy becomes "int8_from_<policy>". `model.quantize("int8")` calls
    it; other modes raise `NotImplementedError`, which `model.quantize` turns into a warning,
    as for any Keras layer. `config`: None or Keras' default `Int8QuantizationConfig`."""
    if mode != "int8":
        raise NotImplementedError(f"{type(layer).__name__} quantizes to 'int8' only. Received: mode={mode!r}")
    if not hasattr(layer, "quantization_mode"):
        raise ValueError(f"int8 quantization needs Keras 3 (not legacy Keras 2). Received: mode={mode!r}")
    _check_int8_config(config)
    for kind in layer._projection_names:
        kernel, scale = _quantize_kernel(getattr(layer, f"{kind}_kernel").numpy())
        layer._untrack_variable(getattr(layer, f"{kind}_kernel"))  # Keras' `del` would run gc.collect() per kernel
        for name, value in ((f"{kind}_kernel", kernel), (f"{kind}_kernel_scale", scale)):
            options = {"initializer": "zeros", "trainable": False, "dtype": value.dtype.name, "autocast": False}
            setattr(layer, name, layer.add_weight(name=name, shape=value.shape, **options))
            getattr(layer, name).assign(value)
    layer._is_quantized = True  # Keras' flag: setting the policy below must not quantize again
    layer.dtype_policy = _int8_policy(layer.dtype_policy)


def _weight_options(layer, name):
    """`add_weight` arguments of one portable weight: int8 kernels and their float scales are
    not trainable (as in Keras' int8 `Dense`)."""
    if layer._int8 and name.endswith("_kernel") and not _is_indexer_weight(name):
        return {"initializer": "zeros", "dtype": "int8", "trainable": False}
    if name.endswith("_kernel_scale"):  # read in float32 under a mixed policy too (`_int8_matmul`)
        return {"initializer": "ones", "dtype": "float32", "trainable": False, "autocast": False}
    return {"initializer": _initializer(layer, name)}


def _quantize_kernel(kernel):
    """A float (D, F) kernel -> (int8 (D, F) kernel, float32 (F,) kernel_scale), computed in float32
    with NumPy as Keras' `abs_max_quantize(kernel, axis=0, to_numpy=True)`: r = 127 / (max |column|
    + 1e-7), the integers round(kernel * r) (half to even) clipped to [-127, 127], and
    kernel_scale = 1 / r (Keras keeps r and divides by it)."""
    kernel = np.asarray(kernel, dtype=np.float32)
    ratio = np.float32(_INT8_MAX) / (np.max(np.abs(kernel), axis=0) + np.float32(_INT8_EPSILON))  # (F,)
    quantized = np.clip(np.round(kernel * ratio), -_INT8_MAX, _INT8_MAX).astype(np.int8)  # (D, F)
    return quantized, (np.float32(1.0) / ratio).astype(np.float32)


@tf.custom_gradient
def _int8_matmul(rows, kernel, kernel_scale):
    """(M, D) @ an int8 (D, F) kernel: rows quantized per token as Keras' `AbsMaxQuantizer` does
    (r = 127 / (max |row| + 1e-7), round(rows * r) clipped to [-127, 127]), the integer products
    summed, then * (1 / r) * kernel_scale, all in float32 at least whatever the rows' dtype (in
    float16 r of a zero row and a sum of 64 products overflow), the result cast to the rows' dtype.
    The sums are exact while they stay below 2**24 (always for D <= 1040), so the numbers are those
    of an int8 x int8 -> int32 matmul, which the TFLite converter refuses (its FULLY_CONNECTED takes
    float32 or quantized tensors, not raw int8). The gradient of `rows` goes through the dequantized
    kernel (Keras' straight-through gradient); the kernel and its (float32) scale get none."""
    dtype = _softmax_dtype(rows.dtype)  # float32 at least: float16 holds integers only to 2048
    wide = tf.cast(rows, dtype)  # (M, D)
    ratio = _INT8_MAX / (tf.reduce_max(tf.abs(wide), axis=-1, keepdims=True) + _INT8_EPSILON)  # (M, 1)
    quantized = tf.clip_by_value(tf.round(wide * ratio), -_INT8_MAX, _INT8_MAX)  # (M, D), integers
    accumulated = tf.matmul(quantized, tf.cast(kernel, dtype))  # (M, D) @ (D, F) -> (M, F)
    y = tf.cast(accumulated * ((1.0 / ratio) * tf.cast(kernel_scale, dtype)), rows.dtype)  # (M, F)

    def grad(upstream):
        dequantized = tf.cast(kernel, rows.dtype) * tf.cast(kernel_scale, rows.dtype)  # (D, F)
        return tf.matmul(upstream, dequantized, transpose_b=True), None, None  # (M, F) -> (M, D)

    return y, grad


def _quantized_rows(x):
    """x quantized per token as `_int8_matmul` quantizes its rows (in float32 at least), and
    dequantized: round(x * r) / r, r = 127 / (max |x| + 1e-7) over the last axis, the integers
    clipped to [-127, 127]; in x's dtype."""
    wide = tf.cast(x, _softmax_dtype(x.dtype))  # float16: r of a zero row overflows
    ratio = _INT8_MAX / (tf.reduce_max(tf.abs(wide), axis=-1, keepdims=True) + _INT8_EPSILON)  # (..., 1)
    return tf.cast(tf.clip_by_value(tf.round(wide * ratio), -_INT8_MAX, _INT8_MAX) * (1.0 / ratio), x.dtype)


def _check_quantize_args(layer, mode, compute_dtype):
    """Keras' checks before `quantize` (a built layer, not quantized yet, a known mode) without its
    refusal of a float16 compute dtype (float16, `mixed_float16`): Keras' int8 `Dense` casts the
    int32 sums to float16, which overflows, while `_int8_matmul` sums and scales in float32."""
    wide = "float32" if compute_dtype == "float16" else compute_dtype
    super(MultiHeadAttention, layer)._check_quantize_args(mode, wide)


# The int8 and fp8 KV caches (docs/SPEC.md, "KV-cache decoding"): each slot's key and value of each
# head (with MLA its latent and its turned key part) stored as int8 (absmax / 127) or float8_e4m3fn
# (absmax / 448) with one float32 scale, computed in float32. The attention reads the integers (fp8
# values) a block of slots at a time, each slot's key scale multiplied into its scores and its value
# scale into its weights: no float copy of the cache.
_QUANTIZED_CACHE_BLOCK = 1 << 20  # cache elements cast to float at once by `_attend_quantized`
_FP8 = tf.as_dtype("float8_e4m3fn")
_FP8_MAX = 448.0  # float8_e4m3fn's largest finite value (no infinities)
_QUANTIZED_CACHE = (tf.int8, _FP8)  # the cache dtypes that hold scales


def _quantize_cache_rows(x, dtype=tf.int8):
    """(..., D) keys or values -> (int8 integers, or with `dtype` float8_e4m3fn fp8 values (..., D),
    float32 scale (..., 1)), in float32: scale = max |x| / 127 (fp8: / 448) over D; the integers
    round(x / scale) (half to even) clipped to [-127, 127], the fp8 values x / scale clipped to
    [-448, 448] and cast (round to nearest even; TensorFlow's cast makes NaN above 464); a row whose
    scale is 0 stores scale 0 and zeros."""
    x = tf.cast(x, tf.float32)
    top = _INT8_MAX if dtype == tf.int8 else _FP8_MAX
    largest = tf.reduce_max(tf.abs(x), axis=-1, keepdims=True)  # (..., 1)
    scale = largest / (largest * 0 + top)  # (..., 1); XLA would multiply by 1 / top, a constant, rounding apart
    divisor = tf.where(scale == 0, tf.ones_like(scale), scale)  # (..., 1); x is 0 (or below `top` subnormals) there
    if dtype != tf.int8:
        return tf.cast(tf.clip_by_value(x / divisor, -_FP8_MAX, _FP8_MAX), dtype), scale  # (..., D), (..., 1)
    integers = tf.clip_by_value(tf.round(x / divisor), -_INT8_MAX, _INT8_MAX)  # (..., D), half to even
    return tf.cast(integers, tf.int8), scale


def _with_cache_scales(cache):
    """An int8 or fp8 cache's zero scales (B, K, L, 1), one per slot and head, for its keys and values."""
    key_scale = tf.zeros((*cache.key.shape[:3], 1), tf.float32)  # (B, K, L, 1)
    return cache._replace(key_scale=key_scale, value_scale=tf.zeros((*cache.value.shape[:3], 1), tf.float32))


def _check_quantized_cache(cache):
    """An int8 (fp8) cache: int8 (float8_e4m3fn) keys and values, float32 scales (B, K, L, 1) beside them."""
    dtype = cache.key.dtype
    kind = dtype.name
    for name in ("key", "value"):
        field, scale = getattr(cache, name), getattr(cache, f"{name}_scale")
        shape = (*tuple(field.shape)[:3], 1)
        if field.dtype != dtype or scale is None or scale.dtype != tf.float32 or tuple(scale.shape) != shape:
            received = None if scale is None else (scale.dtype.name, tuple(scale.shape))
            raise ValueError(
                f"{'An' if kind == 'int8' else 'A'} {kind} `cache` must hold {kind} `{name}` and a float32 "
                f"`{name}_scale` of shape {shape}; make it with `init_cache(..., dtype='{kind}')`. "
                f"Received: cache.{name}.dtype={field.dtype.name}, cache.{name}_scale={received}"
            )


def _write_quantized_cache(cache, k, v, key_mask, compiled=False):
    """`_write_cache` for an int8 or fp8 cache: the new (B, K, T, H) keys and values quantized
    (`_quantize_cache_rows`), their integers (fp8 values) written to `key` and `value` and their
    scales to `key_scale` and `value_scale` by `_write_cache` itself (keep and index written twice,
    the same both times). TensorFlow has no fp8 scatter outside XLA: there the fp8 values are
    written by a gather (`_gathered_write`), `compiled` (XLA, the in-place cache) scatters them."""
    (k_int, k_scale), (v_int, v_scale) = (_quantize_cache_rows(x, cache.key.dtype) for x in (k, v))
    if compiled or cache.key.dtype == tf.int8:
        ints = _write_cache(KVCache(cache.key, cache.value, cache.keep, cache.index), k_int, v_int, key_mask)
    else:  # fp8 outside XLA
        key, value = (_gathered_write(x, new, cache.index) for x, new in ((cache.key, k_int), (cache.value, v_int)))
        ints = KVCache(key, value, cache.keep, cache.index)
    scales = KVCache(cache.key_scale, cache.value_scale, cache.keep, cache.index)
    written = _write_cache(scales, k_scale, v_scale, key_mask)
    return cache._replace(key=ints.key, value=ints.value, keep=written.keep, index=written.index)._replace(
        key_scale=written.key, value_scale=written.value
    )


def _gathered_write(field, new, index):
    """(B, K, L, H) `field` with the (B, K, T, H) `new` of positions [index, index + T) in slots
    position mod L (the last of the T where two share a slot), by one gather from the two
    concatenated: what `_write_cache`'s scatter writes, a new tensor as the scatter's is."""
    t, length = tf.shape(new)[2], tf.shape(field)[2]
    offset = tf.math.floormod(tf.range(length) - index, length)  # (L,), the t whose position lands in each slot
    last = offset + length * tf.math.floordiv(t - 1 - offset, length)  # (L,), the last such t (where offset < T)
    source = tf.where(offset < t, length + last, tf.range(length))  # (L,), the slot or the new token it takes
    return tf.gather(tf.concat([field, new], axis=2), source, axis=2)  # (B, K, L + T, H) -> (B, K, L, H)


def _dequantize_cache(cache, k, v, dtype):
    """MLA over an int8 or fp8 cache: its (B, 1, L, C) and (B, 1, L, Hr) integers (fp8 values)
    times their scales, in float32, cast to the compute `dtype` (MLA's attention makes per-step keys
    of the whole cache anyway: the absorbed keys, or the expanded heads)."""
    k = tf.cast(k, tf.float32) * tf.convert_to_tensor(cache.key_scale)  # (B, 1, L, C)
    v = tf.cast(v, tf.float32) * tf.convert_to_tensor(cache.value_scale)  # (B, 1, L, Hr)
    return tf.cast(k, dtype), tf.cast(v, dtype)


def _attend_quantized(layer, q, k, v, keep, bias, call):
    """Step 6 over an int8 or fp8 cache: q (B, N, T, H), its (B, K, L, H) integers (fp8 values) k
    and v, without a float copy of the cache: a block of slots at a time, the integers cast to float, each slot's key
    scale multiplied into its scores after q . k and its value scale into its weights before
    weights . v (exact algebra), the explicit softmax between, in float32 at least (the cache
    step folded causal, window and chunk into `keep`). Returns (context (B, N, T, H), weights
    (B, N, T, L))."""
    n, h, heads, hv = q.shape[1], q.shape[3], k.shape[1], v.shape[3]
    b, t, s = tf.shape(q)[0], tf.shape(q)[2], tf.shape(k)[2]
    dtype = tf.float64 if q.dtype == tf.float64 else tf.float32
    sinks = layer.sink_logits if layer.sinks else None
    scales = (tf.convert_to_tensor(x) for x in (call.cache.key_scale, call.cache.value_scale))
    k_scale, v_scale = (tf.cast(tf.transpose(x, (0, 1, 3, 2)), dtype) for x in scales)  # (B, K, 1, L) each
    length, step = k.shape[2], max(1, _QUANTIZED_CACHE_BLOCK // ((q.shape[0] or 1) * heads * h))  # slots per block
    spans = [(0, None)] if length is None else [(i, i + step) for i in range(0, length, step)]  # L unknown: one
    grouped = tf.reshape(tf.cast(q, dtype) * layer.scale, (b, heads, -1, h))  # (B, N, T, H) -> (B, K, G*T, H)
    blocks = [tf.matmul(grouped, tf.cast(k[:, :, i:j], dtype), transpose_b=True) for i, j in spans]
    scores = tf.reshape(tf.concat(blocks, axis=-1) * k_scale, (b, n, t, s))  # (B, K, G*T, L) -> (B, N, T, L)
    scores = _capped_scores(layer, scores)
    added = bias[1] if bias[0] is None else bias[0] if bias[1] is None else bias[0] + bias[1]  # the mask's + bias
    if added is not None:
        added = tf.cast(added, dtype)
        scores = scores + (added if sinks is not None else _centre_rows(added, keep))  # (B, N, T, L)
    weights = _masked_softmax(scores, keep, sinks)  # (B, N, T, L)
    dropout = layer.dropout > 0 and call.training is not False and call.training is not None
    used = layer._dropout_layer(weights, training=call.training) if dropout else weights
    used = tf.reshape(used, (b, heads, -1, s)) * v_scale  # (B, N, T, L) -> (B, K, G*T, L)
    context = tf.add_n([tf.matmul(used[..., i:j], tf.cast(v[:, :, i:j], dtype)) for i, j in spans])
    context = tf.reshape(context, (b, n, t, hv))  # (B, K, G*T, H) -> (B, N, T, H)
    return tf.cast(context, q.dtype), tf.cast(weights, q.dtype)


def _with_scales(shapes):
    """The int8 layout of a float layout: `<kind>_kernel_scale` (F,) after each (D, F) `<kind>_kernel`."""
    scaled = {}
    for name, shape in shapes.items():
        scaled[name] = shape
        if name.endswith("_kernel") and not _is_indexer_weight(name):
            scaled[f"{name}_scale"] = shape[1:]
    return scaled


def _int8_problems(weights, shapes):
    """The kernels of an int8 layout that are not integers in [-127, 127]."""
    problems = []
    for name in (
        name for name in shapes if name.endswith("_kernel") and name in weights and not _is_indexer_weight(name)
    ):
        value = np.asarray(weights[name])
        integral = np.issubdtype(value.dtype, np.integer)
        if not integral or (value.size and np.abs(value.astype(np.int64)).max() > _INT8_MAX):
            problems.append(f"'{name}' must hold integers in [-127, 127], received dtype {value.dtype.name}")
    return problems


def _is_int8_layout(weights):
    return any(str(name).endswith("_kernel_scale") for name in weights)


def _check_int8_config(config):
    """Keras' default int8 config only (the scheme of the portable layout): no weight quantizer of
    its own and the default per-token `AbsMaxQuantizer` of the inputs."""
    if config is None:
        return
    activation = getattr(config, "activation_quantizer", None)
    default_activation = (
        type(activation).__name__ == "AbsMaxQuantizer"
        and tuple(activation.value_range) == (-127, 127)
        and activation.axis in (None, (-1,))
        and activation.epsilon == _INT8_EPSILON
    )
    if getattr(config, "weight_quantizer", None) is not None or not default_activation:
        raise ValueError(
            "`config` must be Keras' default int8 config (per-column abs-max kernels, per-token abs-max inputs in "
            f"[-127, 127]): the portable int8 layout holds only that scheme. Received: config={config!r}"
        )


_QUANTIZED_POLICY = getattr(getattr(tf.keras, "dtype_policies", None), "QuantizedDTypePolicy", None)  # Keras 3


def _int8_policy(policy):
    """The dtype policy of `policy` quantized to int8: Keras' "int8_from_<policy>", or where the
    compute dtype is float16 (float16, `mixed_float16`) the same policy as an
    `_Int8FromFloat16Policy`, since Keras' own refuses float16."""
    if policy.compute_dtype == "float16":
        return _Int8FromFloat16Policy("int8", policy.name)
    return f"int8_from_{policy.name}"


class _Int8FromFloat16Policy(_QUANTIZED_POLICY or object):  # legacy Keras 2 has no quantization: never made there
    """Keras' `QuantizedDTypePolicy` "int8_from_float16" (or "int8_from_mixed_float16") without
    its refusal of float16: `_int8_matmul` sums and scales in float32, so the int8 layer
    computes in float16 as in any other dtype. Registered, so a `.keras` file that holds it loads."""

    def _check_quantization_mode(self, mode, compute_dtype):
        super()._check_quantization_mode(mode, "float32" if compute_dtype == "float16" else compute_dtype)


if _QUANTIZED_POLICY is not None:
    tf.keras.utils.register_keras_serializable(package="MultiHeadAttentionReference")(_Int8FromFloat16Policy)


def _unquantized_policy(policy):
    """A quantized dtype policy's source ("int8_from_float32" -> "float32"): the Dropout sublayer
    computes in floats, and a quantized policy would send it to Keras' `quantized_call`."""
    name = getattr(policy, "name", policy)
    return name.partition("_from_")[2] if isinstance(name, str) and "_from_" in name else policy


# -------------------------------------------------------------------------------------------------
# Section: framework only
# -------------------------------------------------------------------------------------------------
# Keras conventions (the backend check, inputs as given, the Dropout sublayer, shapes given to
# `build`, initializers, output specs), XLA, and the implicit Keras masks.
# `bias` and the constructor's plain arguments checked; the habits of other libraries that a
# mask's values suggest (nn.MultiheadAttention's True = ignore, Keras' 0/1 floats), warned of once
# per layer (`AttentionMaskWarning`).


class _Variants(NamedTuple):
    """The variants of a layer, checked by their sections' helpers in `__init__`; `scale` is never None."""

    scale: float
    softcap: float | None
    window: int | tuple | None  # W, or (W_before, W_after)
    attention_chunk_size: int | None
    rope_theta: float | None
    rope_fraction: float
    rope_interleaved: bool
    rope_scaling: dict | None
    rope_sections: tuple | None
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


def _check_lengths(query, key, value):
    """`query`, `key` and `value` of one batch size B, `key` and `value` of one length S (dimensions
    unknown at trace time are not checked); not called when all three are the query."""
    q, k, v = (tuple(x.shape) for x in (query, key, value))
    if _differ(q[0], k[0], v[0]):
        raise ValueError(
            "`query`, `key` and `value` must have the same batch size B. Received: "
            f"query.shape={q}, key.shape={k}, value.shape={v}"
        )
    if _differ(k[1], v[1]):
        raise ValueError(f"`key` and `value` must have the same length S. Received: key.shape={k}, value.shape={v}")


def _static_shape(x):
    return tuple(x.shape) if x.shape.rank is not None else None


def _differ(*dims):
    known = {d for d in dims if d is not None}
    return len(known) > 1


_TRAPS = {
    "empty": "`{name}` keeps no key for any query, so every output row is `output_bias`: True means attend (in "
    "nn.MultiheadAttention True means ignore: pass `~mask`). Received: a boolean {name} that is False everywhere",
    "causal": "`attention_mask` keeps keys only after each query, none at or before it: True means attend (in "
    "nn.MultiheadAttention True means ignore: pass `~mask`, or `causal=True`). "
    "Received: a boolean attention_mask False wherever causal attention keeps a key",
    "padding": "`key_mask` reads as nn.MultiheadAttention's key_padding_mask (True = padding): True means a real "
    "key, pass `~mask`. Received: a key_mask False then True in every row, {empty} of {b} rows keeping no key "
    "and none keeping all",
    "zeros and ones": "`attention_mask` holds only 0s and 1s, but a floating mask is added to the scores (Keras "
    "reads such a mask as boolean): pass `mask > 0` (True = attend) or an additive mask. "
    "Received: a floating attention_mask of 0s and 1s",
}
_FRAMEWORK_MODULES = ("tensorflow", "keras", "tf_keras")  # the packages between the user's call and this file


def _warn_traps(layer, attention_mask, key_mask, t, s):
    """Warns once per layer for each built-in habit the masks' values suggest (docs/SPEC.md, Masks),
    where reading them is free (eagerly, on the CPU; a call with a cache is not read); the call
    computes what the SPEC says either way. The habits: a boolean mask False everywhere
    (nn.MultiheadAttention's True = ignore, nothing padded); a square boolean mask keeping keys
    only after each query (its causal `attn_mask`, `triu(ones, 1)`); a `key_mask` whose every row
    is False then True, some row keeping no key and none keeping all (its `key_padding_mask`;
    left padding keeps its longest sequence all True); a floating mask of only 0s and 1s."""
    attention_mask, key_mask = (None if m is None else tf.convert_to_tensor(m) for m in (attention_mask, key_mask))
    masks = [mask for mask in (attention_mask, key_mask) if mask is not None]
    if not masks or not (tf.executing_eagerly() and all("CPU" in x.device.upper() for x in masks)):
        return
    traps = {}
    for name, mask in (("attention_mask", attention_mask), ("key_mask", key_mask)):
        if mask is not None and mask.dtype == tf.bool and int(tf.size(mask)) > 0 and not bool(tf.reduce_any(mask)):
            traps[name] = _TRAPS["empty"].format(name=name)
    boolean = attention_mask is not None and attention_mask.dtype == tf.bool and "attention_mask" not in traps
    if boolean and int(tf.size(attention_mask)) > 0 and t == s > 0:
        traps |= {} if bool(tf.reduce_any(attention_mask & causal_mask(t, s))) else {"causal": _TRAPS["causal"]}
    if key_mask is not None and "key_mask" not in traps:
        kept = tf.reduce_sum(tf.cast(key_mask, tf.int32), -1)  # (B,)
        ordered = bool(tf.reduce_all(tf.cast(key_mask[:, 1:], tf.int8) >= tf.cast(key_mask[:, :-1], tf.int8)))
        empty = int(tf.reduce_sum(tf.cast(kept == 0, tf.int32)))
        if ordered and not bool(tf.reduce_any(kept == key_mask.shape[1])) and empty:
            traps["padding"] = _TRAPS["padding"].format(empty=empty, b=key_mask.shape[0])
    if attention_mask is not None and attention_mask.dtype.is_floating:
        ones = attention_mask == 1
        if bool(tf.reduce_all(ones | (attention_mask == 0))) and bool(tf.reduce_any(ones)):
            traps["zeros and ones"] = _TRAPS["zeros and ones"]
    for kind, message in traps.items():
        if kind not in layer._warned_traps:
            layer._warned_traps.add(kind)
            _warn_at_caller(message)


def _warn_at_caller(message):
    """Warns `AttentionMaskWarning` at the user's line: the first frame outside this file and the
    framework (a module's or layer's `__call__`, Keras' traceback filter), however deep they call."""
    frame, level = sys._getframe(1), 2  # level 2: the frame that called this function
    while frame is not None and (
        frame.f_globals is globals() or frame.f_globals.get("__name__", "").split(".")[0] in _FRAMEWORK_MODULES
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, AttentionMaskWarning, stacklevel=level)


def _check_backend():
    """This file's TensorFlow ops run only on the TensorFlow Keras backend."""
    if tf.keras.backend.backend() != "tensorflow":
        raise ValueError(
            "This layer is written in TensorFlow ops and runs only on the TensorFlow Keras backend: on any "
            "backend, use Keras/Multi_Head_Attention.py. Received: "
            f"KERAS_BACKEND={tf.keras.backend.backend()}"
        )


def _keras_conventions(layer):
    """The constructor's Keras settings: masking supported (the habits a mask suggests warned of once
    each), Keras must not cast masks and biases (`call` casts query, key and value), NumPy inputs
    reach `call` as they are, and the Dropout is held untracked (no sublayer: `model.quantize`
    quantizes leaves), its Keras 3 seed generator this layer's state."""
    layer.supports_masking = True
    layer._warned_traps = set()  # the mask habits warned of, once each
    layer._convert_input_args = False
    layer._allow_non_tensor_positional_args = True
    dropout_layer = tf.keras.layers.Dropout(layer.dropout, dtype=_unquantized_policy(layer.dtype_policy))
    object.__setattr__(layer, "_dropout_layer", dropout_layer)
    if getattr(dropout_layer, "seed_generator", None) is not None:
        layer._dropout_seed_generator = dropout_layer.seed_generator


def _check_shapes(layer, query_shape, value_shape, key_shape):
    """Shapes given to `build` or `compute_output_shape`, checked as the call checks its
    inputs (the same messages); returns the query's shape. A missing key or value shape is the
    other one's, as in the call; with neither, they are unknown (legacy Keras passes only the
    query's shape, whatever the call's key and value are)."""
    query_shape, value_shape, key_shape = (_shape_tuple(shape) for shape in (query_shape, value_shape, key_shape))
    key_shape = value_shape if key_shape is None else key_shape
    value_shape = key_shape if value_shape is None else value_shape
    for name, shape, width_name, width in (
        ("query", query_shape, "E", layer.d_model),
        ("key", key_shape, "kdim", layer.kdim),
        ("value", value_shape, "vdim", layer.vdim),
    ):
        letter = "T" if name == "query" else "S"
        if shape is not None and (len(shape) != 3 or shape[-1] not in (None, width)):
            raise ValueError(
                f"`{name}` must have shape (B, {letter}, {width_name}) with {width_name}={width}. "
                f"Received: {name}.shape={shape}"
            )
    if None in (query_shape, key_shape, value_shape):
        return query_shape
    if _differ(query_shape[0], key_shape[0], value_shape[0]):
        raise ValueError(
            "`query`, `key` and `value` must have the same batch size B. Received: "
            f"query.shape={query_shape}, key.shape={key_shape}, value.shape={value_shape}"
        )
    if _differ(key_shape[1], value_shape[1]):
        raise ValueError(
            f"`key` and `value` must have the same length S. Received: key.shape={key_shape}, value.shape={value_shape}"
        )
    return query_shape


def _initializer(layer, name):
    """Kernels and biases from the layer's initializers; QK-norm scales of one, QK-norm biases
    and sinks of zero; the learned query scaling's scales zero and biases one (each factor 1)."""
    if name.endswith(("_norm", "_scaling_bias")):
        return tf.keras.initializers.Ones()
    if name.endswith(("_norm_bias", "_scaling_scale")) or name == "sinks":
        return tf.keras.initializers.Zeros()
    initializer = layer.kernel_initializer if name.endswith("_kernel") else layer.bias_initializer
    return initializer.__class__.from_config(initializer.get_config())  # a fresh instance: legacy Keras repeats


def _output_spec(layer, *args, **kwargs):
    """`compute_output_spec`: traces `call` on symbolic inputs (what Keras does for a layer without
    `compute_output_shape`), so a functional model gets every shape check when it is built, and
    both outputs with `return_attention=True`. It also works outside `__call__` (Keras' layer tests
    call it there): it builds the layer if needed, and every weight is read in the dtype of the
    input it meets, so under a mixed policy the specs have the compute dtype."""
    if not layer.built:
        layer.build()
    return super(tf.keras.layers.Layer, layer).compute_output_spec(*args, **kwargs)


def _shape_tuple(shape):
    """A shape (tuple, list, TensorShape) as a tuple, or None where it or its rank is unknown."""
    if shape is None or tf.TensorShape(shape).rank is None:
        return None
    return tuple(tf.TensorShape(shape).as_list())


def _compiled_by_xla():
    """Whether the graph being traced is compiled by XLA (`jit_compile=True`). XLA compiles the
    gradient of both branches of a `tf.cond`, the one not taken with placeholders for its tensors
    (0 for unknown dimensions), where the gradients of reshapes and broadcasts fail to compile."""
    return tf.__internal__.get_enclosing_xla_context() is not None


# -------------------------------------------------------------------------------------------------
# Section: converters
# -------------------------------------------------------------------------------------------------
# The portable weights (their layout, `weight_shapes`, and `import_weights`), the Keras config
# (`get_config`), and the Keras built-ins (`from_keras`, `to_keras`).
#
# Coming from `keras.layers.MultiHeadAttention`: it is called `(query, value, key)`, this layer
# `(query, key, value)`: by position, key comes before value (or name them). A floating
# `attention_mask` is added to the scores here, where Keras reads a 0/1 float mask as boolean: pass
# `mask > 0`. `use_causal_mask=True` is `causal=True` (bottom-right aligned when T < S);
# `return_attention_scores=True` is `return_attention=True`.

_GROUP_QUERY_ATTENTION = getattr(tf.keras.layers, "GroupQueryAttention", None)  # None in legacy Keras (tf_keras)
_BUILT_IN_GQA = () if _GROUP_QUERY_ATTENTION is None else (_GROUP_QUERY_ATTENTION,)


def _weight_shapes(layer):
    """`weight_shapes`: a projection's bias only when `bias` names it, the norm scales only with
    `qk_norm` (and their biases with `qk_norm_bias`), `sinks` only with `sinks=True`, the gate's kernel
    (and bias) after them with `gate=True`, each int8 kernel followed by its scale. With MLA, the
    latent projections and their norm scales (`query_a_norm` with `q_lora_rank`, `key_value_a_norm`)
    replace query, key and value.

    The layout: `query_kernel` (E, N*H), `query_bias` (N*H,), `key_kernel` (kdim, K*H), ...,
    `output_kernel` (N*H, E), `output_bias` (E,), `query_norm`, `key_norm`, `query_norm_bias`,
    `key_norm_bias`, `sinks` (N,), `gate_kernel` (E, N*H) and `gate_bias`: the portable layout
    itself, created in `build`."""
    nh, kh = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    kernels, norms = _kernel_shapes(layer), _latent_norms(layer)  # MLA's, or query, key, value, output
    gate = {"gate": (layer.d_model, kernels["output"][0])} if layer.gate else {}  # (E, N*Hv)
    shapes = {}
    for kind, shape in kernels.items():
        shapes[f"{kind}_kernel"] = shape
        if kind in layer.bias:
            shapes[f"{kind}_bias"] = shape[1:]
        if kind in norms:
            shapes[f"{kind}_norm"] = norms[kind]
    if layer.qk_norm is not None:
        shapes["query_norm"] = (layer.head_dim,) if layer.qk_norm == "head" else (nh,)  # "per_head", "all": (N*H,)
        shapes["key_norm"] = (layer.head_dim,) if layer.qk_norm == "head" else (kh,)
    if layer.qk_norm is not None and layer.qk_norm_bias:
        shapes["query_norm_bias"], shapes["key_norm_bias"] = shapes["query_norm"], shapes["key_norm"]
    if layer.kv_shared:  # no key projection, no key norm
        shapes = {name: shape for name, shape in shapes.items() if not name.startswith("key_norm")}
    if layer.sinks:
        shapes["sinks"] = (layer.num_heads,)
    for kind, shape in gate.items():
        shapes[f"{kind}_kernel"] = shape
        if kind in layer.bias:
            shapes[f"{kind}_bias"] = shape[1:]
    shapes.update(_query_scaling_shapes(layer))  # the learned query scaling's
    shapes.update(_index_shapes(layer))  # the sparse indexer's, float in an int8 layer too
    shapes.update(_context_norm_shapes(layer))  # `output_norm`'s
    return _with_scales(shapes) if layer._int8 else shapes


def _import_weights(layer, weights):
    """`import_weights`: strict and atomic (a ValueError lists every problem); an int8 layout (with
    `<kind>_kernel_scale`) quantizes a float layer first; an int8 layer takes only one."""
    int8 = layer._int8 or _is_int8_layout(weights)
    expected = _with_scales(layer.weight_shapes()) if int8 and not layer._int8 else layer.weight_shapes()
    problems = [f"missing '{name}'" for name in expected if name not in weights]
    problems += [f"unexpected '{name}'" for name in weights if name not in expected]
    for name, shape in expected.items():
        if name in weights and tuple(np.shape(weights[name])) != shape:
            problems.append(f"'{name}' has shape {tuple(np.shape(weights[name]))}, expected {shape}")
    problems += _int8_problems(weights, expected) if int8 else []
    if problems:
        raise ValueError(f"`weights` do not match this layer's portable layout: {'; '.join(problems)}")
    if not layer.built:
        layer.build()
    if int8 and not layer._int8:
        layer.quantize("int8")
    for name in expected:
        variable = layer._variable(name)
        variable.assign(np.asarray(weights[name]).astype(tf.as_dtype(variable.dtype).as_numpy_dtype))


def _config(layer):
    """`get_config`'s own keys (after the base layer's), in the signature's order."""
    bias = True if layer.bias == layer._projection_names else bool(layer.bias) and list(layer.bias)
    config = {
        "d_model": layer.d_model,
        "num_heads": layer.num_heads,
        "num_kv_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim,
        "kdim": layer.kdim,
        "vdim": layer.vdim,
        "dropout": layer.dropout,
        "bias": bias,
        **_score_config(layer),
        "rope_theta": layer.rope_theta,
        "rope_fraction": layer.rope_fraction,
        "rope_interleaved": layer.rope_interleaved,
        "rope_scaling": layer.rope_scaling,
        "rope_sections": None if layer.rope_sections is None else list(layer.rope_sections),
        "qk_norm": layer.qk_norm,
        "qk_norm_eps": layer.qk_norm_eps,
        "qk_norm_type": layer.qk_norm_type,
        "qk_norm_bias": layer.qk_norm_bias,
        "sinks": layer.sinks,
        "clip_qkv": layer.clip_qkv,
        "gate": layer.gate,
        **_latent_config(layer),  # MLA's sizes, after its vdim (None: its values come from `key`)
        **_indexer_config(layer),
        "kernel_initializer": tf.keras.initializers.serialize(layer.kernel_initializer),
        "bias_initializer": tf.keras.initializers.serialize(layer.bias_initializer),
        "query_scaling": None if layer.query_scaling is None else dict(layer.query_scaling),
        **{name: getattr(layer, name) for name in _SHARING_FLAGS},
        "rope_sections_interleaved": layer.rope_sections_interleaved,
        "output_norm": layer.output_norm,
        "output_norm_eps": layer.output_norm_eps,
        "qk_norm_after_rope": layer.qk_norm_after_rope,
        "gate_activation": layer.gate_activation,
    }
    return config | _latent_config(layer, vdim_only=True)  # the key keeps its place


def _non_defaults(layer):
    """The variants not at their default, and a partial `bias`, as {name: value} (`rope_sections`
    only with RoPE, `qk_norm_type` and `qk_norm_bias` only with `qk_norm`: what they change)."""
    variants = {
        "bias": list(layer.bias) if layer.bias not in ((), layer._projection_names) else None,
        **_score_settings(layer),
        "rope_theta": layer.rope_theta,
        "rope_sections": layer.rope_sections if layer.rope_theta is not None else None,
        "rope_sections_interleaved": True if layer.rope_sections_interleaved and layer.rope_sections else None,
        "qk_norm": layer.qk_norm,
        "qk_norm_type": layer.qk_norm_type if layer.qk_norm is not None and layer.qk_norm_type != "rms" else None,
        "qk_norm_bias": True if layer.qk_norm is not None and layer.qk_norm_bias else None,
        "sinks": True if layer.sinks else None,
        "clip_qkv": layer.clip_qkv,
        "gate": True if layer.gate else None,
        "gate_activation": layer.gate_activation if layer.gate and layer.gate_activation != "sigmoid" else None,
        **{name: getattr(layer, name) for name in _LATENT_SIZES},
        "query_scaling": layer.query_scaling,
        **{name: True for name in _SHARING_FLAGS if getattr(layer, name)},
        "index_topk": layer.index_topk,
        "index_query_input_norm": True if layer.index_query_input_norm else None,
        "output_norm": layer.output_norm,
        "qk_norm_after_rope": True if layer._qk_norm_late else None,
    }
    return {name: value for name, value in variants.items() if value is not None}


def _from_keras(cls, layer, window):
    """`from_keras`: builds a layer with the weights of a built `keras.layers.MultiHeadAttention` or
    `keras.layers.GroupQueryAttention` (3-D inputs, default attention axes).

    Its dtype policy, initializers and `trainable` are kept; LoRA adapters on its
    projections are merged into the kernels; `use_gate=True` becomes `gate=True`, its
    (E, N, H) kernel `gate_kernel`. Every option this layer cannot hold (regularizers,
    constraints, other attention axes or output shapes, value_dim != key_dim, quantized
    projections) is a ValueError that lists them all.

    Args:
        layer: the built-in.
        window: with a built-in's `sliding_window` W, `(W, W)`: Keras counts its band
            |t - s| < W from the first query and key, this layer from the last (so that
            decoding equals the full pass), so the two keep the same keys only where T == S.
            Passing `(W, W)` says the layer is for such calls; without it `sliding_window` is
            refused.
    """
    config, dense = _keras_config(layer, window)
    new = cls(**config, name=f"{layer.name}_reference", dtype=layer.dtype_policy)
    new.trainable = layer.trainable
    weights = {}
    for kind, sublayer in zip(_projection_kinds(_PROJECTIONS, new.gate), dense, strict=True):
        kernel = sublayer.kernel.numpy()  # with LoRA, the merged kernel
        rows = kernel.shape[0] * kernel.shape[1] if kind == "output" else kernel.shape[0]
        weights[f"{kind}_kernel"] = kernel.reshape(rows, -1)  # heads flattened as h * H + d
        if new.bias:
            weights[f"{kind}_bias"] = sublayer.bias.numpy().reshape(-1)
    new.import_weights(weights)
    return new


def _to_keras(layer):
    """`to_keras`: a built `keras.layers.MultiHeadAttention` (K == N) or
    `keras.layers.GroupQueryAttention` (K < N) holding these weights.

    Keras' GroupQueryAttention takes any key and value widths, but its
    `compute_output_shape` refuses a value width other than the query's, so with
    vdim != d_model it runs eagerly but not on symbolic inputs (a functional model).
    """
    _check_keras_can_hold(layer)
    common = dict(
        dropout=layer.dropout, use_bias=bool(layer.bias), kernel_initializer=layer.kernel_initializer,
        bias_initializer=layer.bias_initializer, dtype=layer.dtype_policy,
    )  # fmt: skip
    if layer.gate and _GROUP_QUERY_ATTENTION is None:
        raise ValueError(
            "Legacy Keras (tf_keras) has no gate (`use_gate`) on its MultiHeadAttention to hold gated attention. "
            "Received: gate=True"
        )
    common |= {"use_gate": True} if layer.gate else {}
    widths = (layer.d_model, layer.vdim, layer.kdim)  # query, value, key: the built-ins' call order
    if layer.num_kv_heads == layer.num_heads:
        built_in = tf.keras.layers.MultiHeadAttention(layer.num_heads, layer.head_dim, **common)
        if hasattr(built_in, "_build_from_signature"):  # legacy Keras builds its projections on a first call
            built_in(*(tf.zeros((1, 1, width)) for width in widths))
        else:
            built_in.build(*((None, None, width) for width in widths))
    else:
        if _GROUP_QUERY_ATTENTION is None:
            raise ValueError(
                "Legacy Keras (tf_keras) has no GroupQueryAttention to hold grouped-query attention. "
                f"Received: num_heads={layer.num_heads}, num_kv_heads={layer.num_kv_heads}"
            )
        built_in = _GROUP_QUERY_ATTENTION(layer.head_dim, layer.num_heads, layer.num_kv_heads, **common)
        built_in.build(*((None, None, width) for width in widths))
    built_in.trainable = layer.trainable
    weights = layer.export_weights()
    dense = (built_in._query_dense, built_in._key_dense, built_in._value_dense, built_in._output_dense)
    dense += (built_in._gate_dense,) if layer.gate else ()
    for kind, sublayer in zip(_projection_kinds(_PROJECTIONS, layer.gate), dense, strict=True):
        sublayer.kernel.assign(weights[f"{kind}_kernel"].reshape(sublayer.kernel.shape))
        if layer.bias:
            sublayer.bias.assign(weights[f"{kind}_bias"].reshape(sublayer.bias.shape))
    return built_in


def _check_keras_can_hold(layer):
    """Refuses, naming them, the variants of docs/SPEC.md that the Keras built-ins cannot hold."""
    held = {name: value for name, value in _non_defaults(layer).items() if name != "gate"}  # use_gate holds it
    if held:
        received = ", ".join(f"{name}={getattr(layer, name)!r}" for name in held)
        raise ValueError(
            "`to_keras` needs a layer the Keras built-ins can hold: all the biases or none, the default "
            "scale, and no softcap, window, attention chunks, RoPE, QK-norm, sinks, clip_qkv, softplus gate or MLA. "
            f"Received: {received}"
        )
    if getattr(layer, "quantization_mode", None) is not None:  # legacy Keras has no quantization
        raise ValueError(
            "`to_keras` needs float weights (the built-ins' kernels are float): call it before `quantize`, then "
            "quantize the built-in (`model.quantize('int8')`), which computes the same. "
            f"Received: quantization_mode={layer.quantization_mode!r}"
        )


def _group_query_heads(layer):
    """(N, K, H) of a `keras.layers.GroupQueryAttention`."""
    return layer.num_query_heads, layer.num_key_value_heads, layer.head_dim


def _multi_head_heads(layer):
    """(N, K, H) of a `keras.layers.MultiHeadAttention` (read from its config, the same in Keras 3
    and legacy Keras)."""
    config = layer.get_config()
    return config["num_heads"], config["num_heads"], config["key_dim"]


def _described(value):
    """A serialized Keras object (regularizer, constraint) as `ClassName(arg=value, ...)`."""
    if not isinstance(value, dict):
        return repr(value)
    arguments = ", ".join(f"{key}={argument!r}" for key, argument in (value.get("config") or {}).items())
    return f"{value.get('class_name')}({arguments})"


def _options_it_cannot_hold(layer, config, dense):
    """{option: (value, why)} for every option of a built Keras built-in that changes its results
    (or its training) and that this layer cannot hold."""
    found = {}
    for name in ("kernel_regularizer", "bias_regularizer", "activity_regularizer"):
        if config.get(name) is not None:
            found[name] = (_described(config[name]), "a loss this layer does not add")
    for name in ("kernel_constraint", "bias_constraint"):
        if config.get(name) is not None:
            found[name] = (_described(config[name]), "a projection of the weights after each update")
    if "key_dim" in config:  # keras.layers.MultiHeadAttention
        if config["value_dim"] not in (None, config["key_dim"]):
            found["value_dim"] = (config["value_dim"], f"value heads as wide as key_dim={config['key_dim']}")
        width = dense[0].kernel.shape[0]
        if config["output_shape"] not in (None, width, (width,), [width]):
            found["output_shape"] = (config["output_shape"], f"an output as wide as the query, {width}")
        rank = len(layer._dot_product_equation.split(",")[0]) - 1  # projected (B, ..., N, H) less the heads
        axes = tuple(layer._attention_axes)
        if axes != (1,) or rank != 3:
            found["attention_axes"] = (axes, f"attention over axis 1 of 3-D inputs; it has {rank}-D inputs")
    for sublayer in dense:
        mode = getattr(sublayer, "quantization_mode", None)
        if mode is not None:
            found[f"{sublayer.name}.quantization_mode"] = (mode, "float kernels")
    return found


def _keras_config(layer, window=None):
    """Constructor arguments and (query, key, value, output) sublayers of a Keras built-in, and the
    gate's after them with `use_gate`; `window`: `from_keras`'s, (W, W) for the built-in's
    `sliding_window` W."""
    if not isinstance(layer, (tf.keras.layers.MultiHeadAttention, *_BUILT_IN_GQA)):
        raise ValueError(
            "`layer` must be a keras.layers.MultiHeadAttention or keras.layers.GroupQueryAttention. "
            f"Received: {type(layer).__name__}"
        )
    if not layer.built:
        raise ValueError(f"`layer` must be built. Received: an unbuilt {type(layer).__name__}")
    dense = (layer._query_dense, layer._key_dense, layer._value_dense, layer._output_dense)
    config = layer.get_config()
    dense += (layer._gate_dense,) if config.get("use_gate") else ()
    found = _options_it_cannot_hold(layer, config, dense)
    if found:
        reasons = "; ".join(f"{name} ({why})" for name, (_, why) in found.items())
        received = ", ".join(f"{name}={value}" for name, (value, _) in found.items())
        raise ValueError(f"`layer` must use only options this layer can hold; it uses {reasons}. Received: {received}")
    read_heads = _group_query_heads if isinstance(layer, _BUILT_IN_GQA) else _multi_head_heads
    heads, kv_heads, head_dim = read_heads(layer)
    arguments = dict(
        d_model=dense[0].kernel.shape[0], num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        kdim=dense[1].kernel.shape[0], vdim=dense[2].kernel.shape[0], dropout=config["dropout"],
        bias=config["use_bias"], kernel_initializer=config["kernel_initializer"],
        bias_initializer=config["bias_initializer"], gate=bool(config.get("use_gate", False)),
    )  # fmt: skip
    arguments["window"] = _keras_window(config.get("sliding_window"), window)
    return arguments, dense


def _keras_window(sliding_window, window):
    """`from_keras`'s window: (W, W) where the built-in's `sliding_window` W is acknowledged by
    `window=(W, W)` (Keras' band |t - s| < W is counted from the first query and key, this layer's
    from the last: the same keys only where T == S); else None."""
    expected = None if sliding_window is None else (sliding_window, sliding_window)
    if window is None and expected is not None:
        raise ValueError(
            f"`layer.sliding_window` keeps |t - s| < W counted from the first query and key; this layer counts its "
            f"window from the last, so that decoding equals the full pass: the two keep the same keys only where "
            f"T == S. For such calls (self-attention) pass `window={expected}` to `from_keras`. "
            f"Received: sliding_window={sliding_window}"
        )
    if window is not None and (not isinstance(window, (tuple, list)) or tuple(window) != expected):
        raise ValueError(
            f"`window` must be (W, W) for the built-in's `sliding_window` W, or None without one. "
            f"Expected: window={expected}. Received: window={window!r}"
        )
    return expected
