"""Multi-head attention for Keras 3 on any backend: one layer in `keras.ops`, proven equal to the others.

Copy this one file into your model; it needs only Keras 3, NumPy and the standard library, and
runs under `KERAS_BACKEND=tensorflow`, `jax` and `torch` (no backend is imported here).

Legend (every shape comment in this file uses these letters):
    B: batch size          T: query length        S: key/value length
    E: d_model             N: num_heads           K: num_kv_heads
    H: head_dim            L: slots of a KV cache (its maximum length)
    C, Q, Hn, Hr, Hv: the sizes of multi-head latent attention (its section)

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
the steps"), each option's step behind a one-line guard; then one section per option family,
each with its checks, weights, steps and fast paths:
    score modifiers            scale, softcap, window, attention chunks, sinks, ALiBi, attention_bias, segment ids
    positions                  RoPE: frequencies, scalings, multimodal sections
    QK-norm, clip_qkv and the gate
    KV cache and decode steps  `KVCache`, `init_cache`, the cache's checks and writes
    multi-head latent attention (MLA)
    speed paths                `ops.dot_product_attention`, the memory-efficient chunked path
    int8                       Keras' int8 scheme
    framework only             Keras backends: dtypes, shapes, implicit masks; the device mesh
    converters                 `from_keras`, `to_keras`
"""

import math
import sys
import warnings
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops
from keras.src.backend import get_keras_mask  # Keras' reader of implicit masks (JAX arrays take no attribute)

__all__ = ["AttentionMaskWarning", "KVCache", "MultiHeadAttention", "alibi_bias", "document_positions"]
__all__ += ["dot_product_attention", "segment_ids_from_cu_seqlens", "segment_ids_from_position_ids"]

_PROJECTIONS = ("query", "key", "value", "output", "gate")  # the names `bias` takes; "gate" only with `gate`
_ATTRIBUTES = {"sinks": "sink_logits"}  # portable weight name -> layer attribute (`layer.sinks` is the flag)
_FLOAT32_LOWEST = float(np.finfo(np.float32).min)
_LOWEST = {"float16": -65504.0, "bfloat16": -3.3895313892515355e38, "float32": _FLOAT32_LOWEST}


# -------------------------------------------------------------------------------------------------
# Core: the plain layer
# -------------------------------------------------------------------------------------------------
# The functions a plain call enters, then the class; each option's code is in its section below.


class AttentionMaskWarning(UserWarning):
    """A mask whose values read like another library's convention (nn.MultiheadAttention's True =
    ignore, Keras' 0/1 floats): the layer computes what docs/SPEC.md says all the same, and warns
    once per layer. `warnings.simplefilter("error", AttentionMaskWarning)` makes it an error."""


def _check_input(name, x, width_name, width):
    """Checks one (B, L, width) floating input; dimensions unknown at trace time are not checked."""
    x = ops.convert_to_tensor(x)
    if not keras.backend.is_float_dtype(keras.backend.standardize_dtype(x.dtype)):
        raise ValueError(f"`{name}` must be a floating tensor. Received: {name}.dtype={_dtype_name(x.dtype)}")
    letter, shape = "T" if name == "query" else "S", tuple(x.shape)
    if len(shape) != 3 or shape[-1] not in (None, width):
        raise ValueError(
            f"`{name}` must have shape (B, {letter}, {width_name}) with {width_name}={width}. "
            f"Received: {name}.shape={shape}"
        )
    return x


def _matmul(a, b):
    """a @ b, broadcast as `ops.matmul`, in the inputs' dtype: float64 through `ops.einsum`, which
    keeps it where `ops.matmul` would narrow it (`_narrows`)."""
    if _narrows(a.dtype) and _dtype_name(a.dtype) == _dtype_name(b.dtype):
        return ops.einsum("...ij,...jk->...ik", a, b)  # (..., I, J) @ (..., J, K) -> (..., I, K)
    return ops.matmul(a, b)  # (..., I, J) @ (..., J, K) -> (..., I, K)


def dot_product_attention(
    q, k, v, keep=None, bias=None, causal=False, *, scale=None, softcap=None, window=None, attention_chunk_size=None,
    sinks=None, dropout=None,
):  # fmt: skip
    """Pure attention on split heads q (B, N, T, H), k and v (B, K, S, H), K dividing N: (context
    (B, N, T, H), weights (B, N, T, S), exactly 0 where not kept). `keep` (boolean, True = attend)
    and `bias` (floating, added to the soft-capped scores) are None or broadcast to (B, N, T, S);
    `causal`, `scale` (None: 1 / sqrt(H)), `softcap`, `window`, `attention_chunk_size` and `sinks`
    ((N,) logits) as the layer's; `dropout`: None or a callable on the weights before their sum."""
    dtype = "float64" if keras.backend.standardize_dtype(q.dtype) == "float64" else "float32"  # the softmax's
    matmul = _matmul if dtype == "float64" else ops.matmul  # float64 kept where Keras would narrow it
    t, s = (x.shape[2] if x.shape[2] is not None else ops.shape(x)[2] for x in (q, k))  # static where known
    if causal:
        keep = causal_mask(t, s) if keep is None else ops.logical_and(keep, causal_mask(t, s))  # dims may be 1
    if window is not None or attention_chunk_size is not None:
        keep = _fold_masks(keep, window, attention_chunk_size, t, s)  # (B, N, T, S), dims may be 1
    groups = q.shape[1] // k.shape[1]
    k = ops.repeat(k, groups, axis=1) if groups > 1 else k  # (B, K, S, H) -> (B, N, S, H)
    v = ops.repeat(v, groups, axis=1) if groups > 1 else v  # (B, K, S, H) -> (B, N, S, H)
    q = q * ops.convert_to_tensor(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, q.dtype)  # not the scores
    scores = ops.cast(matmul(q, ops.swapaxes(k, -1, -2)), dtype)  # (B, N, T, S)
    scores = scores if softcap is None else _softcap(scores, softcap)
    if bias is not None:
        bias = ops.cast(bias, dtype)
        scores = scores + (bias if keep is None or sinks is not None else _centre_rows(bias, keep))  # (B, N, T, S)
    weights = ops.cast(_masked_softmax(scores, keep, sinks), q.dtype)  # (B, N, T, S)
    context = matmul(weights if dropout is None else dropout(weights), v)  # (B, N, T, S) @ (B, N, S, H)
    return context, weights


def _masked_softmax(scores, keep, sinks):
    """Softmax over the last axis of (B, N, T, S) scores, in their dtype: keys not kept removed
    (filled with the lowest finite value), one sink logit per head (N,) in the denominator (a
    softmax over [scores, sink] whose sink column is dropped), rows with no key exactly 0."""
    if keep is not None:
        scores = ops.where(keep, scores, float(np.finfo(keras.backend.standardize_dtype(scores.dtype)).min))
    if sinks is None and scores.shape[-1] == 1:
        weights = ops.ones_like(scores)  # a softmax over one key (which Keras warns about)
    elif sinks is None:
        weights = ops.softmax(scores, axis=-1)  # (B, N, T, S)
    else:
        weights = _softmax_with_sinks(scores, sinks)  # (B, N, T, S)
    if keep is not None:
        weights = ops.where(keep, weights, ops.zeros((), weights.dtype))  # rows with no key are all 0
    return weights


@keras.saving.register_keras_serializable(package="MultiHeadAttentionKeras")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention (MHA, grouped-query GQA and multi-query MQA) as a Keras 3 layer on any backend.

    Args:
        d_model: E, the width of `query` and of the output.
        num_heads: N, the number of query heads.
        num_kv_heads: K, the number of key/value heads; must divide N. Defaults to N.
        head_dim: H, the width of one head. Defaults to E // N (then N must divide E).
        kdim: width of `key`. Defaults to E.
        vdim: width of `value`. Defaults to E.
        dropout: probability of dropping attention weights when training; 0 <= p < 1.
        bias: True (all the projections have a bias, the gate's with `gate`), False (none), or a
            list, tuple or set of the names of those that have one, among "query", "key", "value",
            "output", "gate" (Qwen2: ("query", "key", "value")). Kept as that tuple of names, in
            that order (MLA's names: its section).
        scale, softcap, window, attention_chunk_size, sinks: the score modifiers, each off at its
            default (`scale`: 1 / sqrt(H)); the section "score modifiers" says what each does.
        rope_theta, rope_fraction, rope_interleaved, rope_scaling, rope_sections: RoPE, off while
            `rope_theta` is None (the section "positions").
        rope_sections_interleaved: if True, the sections' pairs are dealt in turn (Qwen3-VL's
            `mrope_interleaved`): pair i by row i % k while i < k * rope_sections[i % k], else row 0.
        qk_norm, qk_norm_eps, qk_norm_type, qk_norm_bias, clip_qkv, gate, output_norm, output_norm_eps,
            qk_norm_after_rope: the section "QK-norm, clip_qkv and the gate".
        gate_activation: "sigmoid" (default) or "softplus" (Laguna): the gate's function of its projection.
        kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, latent_norm_eps:
            multi-head latent attention, off while `kv_lora_rank` is None (its section).
        index_topk, index_num_heads, index_head_dim, index_rope_interleaved: the sparse indexer (DSA),
            off while `index_topk` is None: each query attends its top-k keys (its section).
        index_query_input_norm: if True, the indexer's queries read a LayerNorm of their input (Mistral Large 4).
        kernel_initializer: initializer of the kernels.
        bias_initializer: initializer of the biases.
        query_scaling: None, or {"type": "temperature" or "positions", "beta": b, "floor": f}: each
            query row times 1 + b * ln(1 + floor(p / f)) (Llama 4's temperature tuning, Mistral 4's
            `llama_4_scaling_beta`), or {"type": "learned"}: query head n times s_n * ln(1 + p) + b_n,
            learned (Mistral Large 4's `softmax_scaling`; the section "positions").
        kv_shared: if True, the layer has no key or value projections: every call takes another
            layer's keys and values through `shared_kv` (Gemma 3n's and Gemma 4's shared layers).
        keys_as_values: if True, no value projection: v is the key projection before QK-norm and RoPE (Gemma 4).
        value_norm: if True, each value head is RMS-normalized without a scale (eps `qk_norm_eps`; Gemma 3n, 4).
        **kwargs: base layer arguments (`name`, `dtype` policy, ...).

    Call arguments:
        query: (B, T, E).
        key: (B, S, kdim). Defaults to `value`, or to `query` if `value` is None too (the order is
            (query, key, value); `keras.layers.MultiHeadAttention`'s is (query, value, key)).
        value: (B, S, vdim). Defaults to `key`.
        attention_mask: boolean (True = attend) or floating (added to the scores), of shape
            (T, S), (B, T, S) or (B, N, T, S), any dimension of which may be 1. `mask=` is
            accepted as its alias (not both).
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
        cache: a `KVCache` from `init_cache`: decode T new tokens (its section).
        shared_kv: with `kv_shared`, a (k, v) pair of (B, K, S, H) keys and values another layer
            attended (its `return_kv`), or that layer's `KVCache` once it wrote this call's T tokens.
        return_kv: if True, also return the (k, v) the call attended (over the L slots with a cache).
        topk_indices, return_topk: the keys each query attends (B, T, k), given; return the selection used.

    Returns:
        output (B, T, E), or (output, weights) with weights (B, N, T, S) (per head, before
        dropout) when `return_attention` is True; with `cache`, the updated cache is appended
        and weights are (B, N, T, L), exactly 0 at unwritten slots.
        With `return_kv`, the (k, v) pair is appended last; a shared cache is read, not returned.

    Example, a key padding mask (the third key of the first sequence is padding):
        >>> layer = MultiHeadAttention(16, 4)
        >>> x = keras.random.normal((2, 3, 16), seed=0)  # (B, T, E)
        >>> keep = ops.convert_to_tensor([[True, True, False], [True, True, True]])  # (B, S)
        >>> out, weights = layer(x, key_mask=keep, return_attention=True)
        >>> tuple(out.shape), tuple(weights.shape)
        ((2, 3, 16), (2, 4, 3, 3))
        >>> bool(ops.all(weights[0, :, :, 2] == 0))
        True
    """

    memory_efficient_threshold = 1 << 26  # the speed paths' (their section)
    query_chunk_elements = 1 << 21
    fused_attention = None
    absorb_latents = None  # MLA's (its section)

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
        super().__init__(**kwargs)
        self.d_model = _positive_int("d_model", d_model)
        self.num_heads = _positive_int("num_heads", num_heads)
        self.num_kv_heads = _positive_int("num_kv_heads", num_heads if num_kv_heads is None else num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"`num_kv_heads` must divide `num_heads`. Received: num_heads={num_heads}, num_kv_heads={num_kv_heads}"
            )
        latent = _check_latent(kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)  # MLA
        head_dim = head_dim if latent is None else _latent_head_dim(latent, head_dim)  # MLA: Hn + Hr
        if head_dim is None and self.d_model % self.num_heads:
            raise ValueError(f"`num_heads` must divide `d_model`. Received: d_model={d_model}, num_heads={num_heads}")
        self.head_dim = _positive_int("head_dim", self.d_model // self.num_heads if head_dim is None else head_dim)
        self.kdim = _positive_int("kdim", self.d_model if kdim is None else kdim)
        self.vdim = _positive_int("vdim", self.d_model if vdim is None else vdim)
        self.dropout = _dropout_rate(dropout)
        self.bias = _projection_biases(bias, gate, _projections(latent))
        rope_width = self.head_dim if latent is None else latent.qk_rope_head_dim
        modifiers = _check_score_modifiers(self.head_dim, scale, softcap, window, attention_chunk_size)
        variants = _check_variants(
            modifiers, rope_width, rope_theta, rope_fraction, rope_interleaved, rope_scaling, rope_sections, qk_norm,
            qk_norm_eps, qk_norm_type, qk_norm_bias, sinks, clip_qkv, gate, latent_norm_eps,
        )  # each option checked by its section's helpers, in the signature's order (flags last)  # fmt: skip
        for name, value in variants._asdict().items():
            setattr(self, name, value)  # self.scale, self.softcap, ..., self.latent_norm_eps
        if latent is not None:
            _check_latent_combinations(vdim, variants)
            self.vdim = self.kdim  # MLA reads keys and values from `key`
        for name in _LATENT_SIZES:
            setattr(self, name, None if latent is None else getattr(latent, name))
        self.query_scaling = _check_query_scaling(query_scaling, self.rope_sections)  # its section: positions
        _check_sharing(self, latent, kv_shared, keys_as_values, value_norm)  # self.kv_shared, ... (their section)
        _init_indexer(self, index_topk, index_num_heads, index_head_dim, index_rope_interleaved, index_query_input_norm)
        self.rope_sections_interleaved = _flag("rope_sections_interleaved", rope_sections_interleaved)  # positions
        _init_norm_options(self, output_norm, output_norm_eps, qk_norm_after_rope)  # section: QK-norm
        self.gate_activation = _check_gate_activation(gate_activation)  # its section: the gate
        if self.rope_theta is not None:
            rotary = _rotary_dim(self.rope_fraction, rope_width, True)
            frequencies = rope_frequencies(rotary, self.rope_theta, self.rope_scaling)  # (R/2,) NumPy
            self._inv_freq = tuple(frequencies.tolist())  # (R/2,) floats: an array breaks torch.compile's graph
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.supports_masking = True
        self._convert_input_args = False  # Keras must not cast masks and biases: `_check_call` casts the inputs
        self._allow_non_tensor_positional_args = True  # NumPy inputs reach `call` as they are
        self._warned_traps = set()  # the mask habits warned of, once each
        dropout_layer = keras.layers.Dropout(self.dropout, dtype=_unquantized_policy(self.dtype_policy))
        object.__setattr__(self, "_dropout_layer", dropout_layer)  # no sublayer: `model.quantize` quantizes leaves
        if self.dropout > 0:  # Keras' Dropout has a seed generator only then: its seed is this layer's state
            self._dropout_seed_generator = dropout_layer.seed_generator

    def call(
        self, query, key=None, value=None, attention_mask=None, *, key_mask=None, query_mask=None, attention_bias=None,
        positions=None, causal=False, return_attention=False, training=None, value_mask=None, cache=None,
        segment_ids=None, key_segment_ids=None, shared_kv=None, return_kv=False, topk_indices=None, return_topk=False,
    ):  # fmt: skip
        """The steps of docs/SPEC.md, "Order of the steps"; each option's step behind its guard."""
        cache = cache if shared_kv is None else _shared_cache(self, query, cache, shared_kv)  # rewound to check
        call = self._check_call(
            query, key, value, attention_mask, key_mask, query_mask, attention_bias, positions, causal,
            return_attention, cache, training, value_mask,
        )  # 1. defaults and checks  # fmt: skip
        call = call if segment_ids is None is key_segment_ids else _packed(self, call, segment_ids, key_segment_ids)
        keep, bias = self._masks(call)  # 1. one keep and one bias, (B|1, N|1, T|1, S|1) each
        if self.kv_lora_rank is None:
            q, k, v = self._project_qkv(call) if not self._sharing else _project_sharing(self, call, shared_kv)  # 2-4.
        else:
            q, k, v = _project_latent(self, call)  # 2. MLA: q, c (B, 1, S, C), k_rope (B, 1, S, Hr)
        if self.qk_norm is not None and not self._sharing and not self._qk_norm_late:
            q, k = _normalize_qk(self, q, k)  # 3. QK-norm (in step 4 after RoPE with `qk_norm_after_rope`)
        if self.query_scaling is not None or (self.rope_theta is not None and not self._sharing):  # 4. RoPE, 4b.
            q, k, v = _position_step(self, q, k, v, call, _rotate if self.kv_lora_rank is None else _rotate_latent)
        if call.cache is not None:
            k, v, keep, call = _update_cache(self, call, k, v, keep)  # 5. the cache (then over its L slots)
        sparse = (topk_indices, return_topk) if self.index_topk or topk_indices is not None or return_topk else ()
        keep, call, selection = _sparse_keep(self, call, keep, *sparse) if sparse else (keep, call, None)  # 5b. top-k
        if self.kv_lora_rank is None:  # 6. (B, N, T, H), (B, N, T, S) or None; an int8 cache: `_cache_attend`
            context, weights = (_cache_attend(self, k) if call.cache else self._attend)(q, k, v, keep, bias, call)
        else:
            context, weights = _attend_latent(self, q, k, v, keep, bias, call)  # 6. MLA: (B, N, T, Hv), ...
        context = context if not self.gate else _gate_heads(self, call, context)  # 6b. the output gate
        merged = self._merge_heads(context)  # 7. (B, N, T, Hv) -> (B, T, N*Hv)
        merged = merged if self.output_norm is None else _normalize_context(self, merged)  # 7. the output norm
        output = self._project(merged, "output")  # 7. (B, T, N*Hv) -> (B, T, E)
        cache, selection = call.cache if not self.kv_shared else None, selection if return_topk else None
        if call.return_attention or cache is not None or return_kv or return_topk:  # a shared cache is not returned
            return _results(output, weights, cache, call.return_attention, (k, v) if return_kv else None, selection)
        return output

    def __call__(self, *args, mask=None, **kwargs):
        """`mask=` moved into `attention_mask` (`call` has no `mask` for Keras to fill with an implicit
        mask); then what a cast would hide: inputs of different floating dtypes, a cache of another."""
        args = args if mask is None else _mask_alias(args, kwargs, mask)  # `mask=` into kwargs["attention_mask"]
        names = ("query", "key", "value")  # as passed; `key` defaults to `value`, then to `query`
        query, key, value = (kwargs.get(name, args[i] if len(args) > i else None) for i, name in enumerate(names))
        if query is not None:
            key = query if key is None and value is None else value if key is None else key
            dtypes = [keras.backend.standardize_dtype(np.asarray(x).dtype if isinstance(x, list) else x.dtype)
                      for x in (query, key, key if value is None else value)]  # fmt: skip
            if all(keras.backend.is_float_dtype(d) for d in dtypes) and len(set(dtypes)) > 1:
                raise ValueError(
                    "`query`, `key` and `value` must have the same dtype. "
                    f"Received: query.dtype={dtypes[0]}, key.dtype={dtypes[1]}, value.dtype={dtypes[2]}"
                )
        if kwargs.get("cache") is not None:
            _check_cache_dtype(kwargs["cache"], self.compute_dtype)
        return super().__call__(*args, **kwargs)

    def compute_mask(self, query, previous_mask=None):
        """The output carries the query's mask."""
        return previous_mask

    def _check_call(
        self, query, key, value, attention_mask, key_mask, query_mask, attention_bias, positions, causal,
        return_attention, cache, training, value_mask,
    ):  # fmt: skip
        """Step 1 but the masks' combination: the inputs' defaults and checks, then the masks', the
        cache's and the positions' (`_check_options`); the `_Call`, its inputs in the compute dtype."""
        self_attention = key is None and value is None
        if self.kv_lora_rank is not None:
            _check_latent_value(key, value)  # MLA reads keys and values from `key`
        key = query if self_attention else value if key is None else key  # `key` defaults to `value`, then `query`
        value = key if value is None else value
        implicit = [None if x is None or isinstance(x, np.ndarray) else get_keras_mask(x) for x in (query, key, value)]
        explicit = key_mask is not None and key_mask is not implicit[1]  # passed, not filled in by Keras
        query = _check_input("query", query, "E", self.d_model)
        key = _check_input("key", key, "kdim", self.kdim)
        value = _check_input("value", value, "vdim", self.vdim)
        if not self_attention:
            _check_lengths(query, key, value)
        masks = (attention_mask, key_mask, query_mask, value_mask, attention_bias, positions, cache, *implicit)
        if self.rope_theta is not None or any(x is not None for x in masks):
            attention_mask, attention_bias, key_mask, query_mask, positions = _check_options(
                self, query, key, attention_mask, key_mask, query_mask, value_mask, attention_bias, positions,
                cache, implicit, explicit, self_attention,
            )  # fmt: skip
        query, key, value = (ops.cast(x, self.compute_dtype) for x in (query, key, value))
        return _Call(
            query, key, value, attention_mask, attention_bias, key_mask, query_mask, positions, causal, self.window,
            self.attention_chunk_size, return_attention, cache, training, False,
        )  # fmt: skip

    def _masks(self, call):
        """One boolean keep and one additive bias (softmax dtype), (B|1, N|1, T|1, S|1) each, or None:
        `_split_masks`, and the token masks (the keys' only without a cache, which keeps them)."""
        split = call.attention_mask is not None or call.attention_bias is not None
        keep, bias = _split_masks(self, call) if split else (None, None)
        queries = None if call.query_mask is None else call.query_mask[:, None, :, None]  # (B, T) -> (B, 1, T, 1)
        keys = None if call.key_mask is None or call.cache is not None else call.key_mask[:, None, None, :]
        for token_keep in (mask for mask in (queries, keys) if mask is not None):
            keep = token_keep if keep is None else ops.logical_and(keep, token_keep)  # (B, N, T, S), dims may be 1
        return keep, bias

    def _project_qkv(self, call):
        """The input projections in heads, (B, N, T, H), (B, K, S, H) x 2, clamped by `clip_qkv`."""
        q = self._split_heads(self._project(call.query, "query"), self.num_heads)
        k = self._split_heads(self._project(call.key, "key"), self.num_kv_heads)
        v = self._split_heads(self._project(call.value, "value"), self.num_kv_heads)
        return (q, k, v) if self.clip_qkv is None else (_clip(self, q), _clip(self, k), _clip(self, v))

    def _project(self, x, kind):
        """(B, L, D) @ (D, F) + (F,) -> (B, L, F), the weights read in x's dtype (a no-op inside Keras'
        `__call__`, which autocasts them); an int8 kernel with x quantized per token (`_int8_matmul`)."""
        kernel = getattr(self, f"{kind}_kernel")
        if self.quantization_mode == "int8":  # `_int8`: (B, L, D) -> (B, L, F)
            y = _int8_matmul(x, ops.convert_to_tensor(kernel), getattr(self, f"{kind}_kernel_scale").value)
        else:  # float64 through `_matmul`, which keeps it
            matmul = _matmul if keras.backend.standardize_dtype(x.dtype) == "float64" else ops.matmul
            y = matmul(x, ops.cast(kernel, x.dtype))  # (B, L, D) -> (B, L, F)
        bias = getattr(self, f"{kind}_bias") if kind in self.bias else None
        return y if bias is None else y + ops.cast(bias, x.dtype)

    def _split_heads(self, y, heads, width=None):
        """(B, L, heads*W) -> (B, heads, L, W); the width W defaults to H."""
        b, length = tuple(y.shape)[:2] if None not in tuple(y.shape) else ops.shape(y)[:2]  # `_shape`
        y = ops.reshape(y, (b, length, heads, width or self.head_dim))  # (B, L, heads*W) -> (B, L, heads, W)
        return ops.transpose(y, (0, 2, 1, 3))  # -> (B, heads, L, W)

    def _merge_heads(self, x):
        merged = ops.transpose(x, (0, 2, 1, 3))  # (B, heads, L, H) -> (B, L, heads, H)
        b, length, heads, h = tuple(merged.shape) if None not in tuple(merged.shape) else ops.shape(merged)
        return ops.reshape(merged, (b, length, heads * h))  # -> (B, L, heads*H)

    def _attend(self, q, k, v, keep, bias, call):
        """Step 6, q (B, N, T, H), k and v (B, K, S, H|Hv) -> (context (B, N, T, Hv), weights (B, N, T, S) or None):
        `dot_product_attention`; without weights `_fuses`' fused path, or chunked past `memory_efficient_threshold`."""
        dropout = self.dropout > 0 and call.training is not False and call.training is not None
        sinks = self.sink_logits if self.sinks else None
        fusable = self.fused_attention or (self.fused_attention is None and keras.backend.backend() == "torch")
        b, n, t, s = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        large = all(isinstance(d, int) for d in (b, t, s)) and b * n * t * s > self.memory_efficient_threshold
        if fusable and self.softcap is None and _fuses(self, q, k, call, dropout):
            context, weights = _fused_heads(self, q, k, v, keep, bias, call, sinks), None
        elif large and not call.return_attention:
            context, weights = _chunked_heads(self, q, k, v, keep, bias, call, dropout, sinks), None
        else:
            drop = (lambda w: self._dropout_layer(w, training=call.training)) if dropout else None
            keep = keep if call.segments is None else _and(keep, _same_documents(*call.segments))  # (B, 1, T, S)
            context, weights = dot_product_attention(
                q, k, v, keep, bias, call.causal, scale=self.scale, softcap=self.softcap, window=call.window,
                attention_chunk_size=call.attention_chunk_size, sinks=sinks, dropout=drop,
            )  # fmt: skip
        if call.cache is not None:
            context = _nan_if_misfit(self, q, k, call, context)
        return context, weights

    def build(self, query_shape=None, value_shape=None, key_shape=None):
        """Creates the portable weights (`weight_shapes`), every shape known from the constructor; the
        shapes, optional, in Keras' order (query, value, key), are checked as the call's (`_check_shapes`)."""
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
        """The portable layout: {name: shape}, in its order (`_weight_shapes`)."""
        return _weight_shapes(self)

    def export_weights(self):
        """Returns the portable weights: a dict of NumPy arrays (see docs/SPEC.md)."""
        if not self.built:
            self.build()
        return {name: np.array(ops.convert_to_numpy(self._variable(name).value)) for name in self.weight_shapes()}

    def import_weights(self, weights):
        """Loads portable weights; strict and atomic (a ValueError lists every problem); an int8
        layout (with `<kind>_kernel_scale`) quantizes a float layer first (`_import_weights`)."""
        _import_weights(self, weights)

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        """(B, T, E), whatever S is; shapes in Keras' order (query, value, key), checked as in `build`."""
        query_shape = _check_shapes(self, query_shape, value_shape, key_shape)
        return (query_shape[0], query_shape[1], self.d_model)

    def compute_output_spec(self, *args, **kwargs):
        """Traces `call` on symbolic inputs (`_output_spec`): a functional model gets every check and output."""
        return _output_spec(self, *args, **kwargs)

    def init_cache(self, batch_size, max_length, *, keep=None, dtype=None):
        """An empty `KVCache` for decoding `batch_size` sequences of up to `max_length` tokens
        (`_init_cache` says its arguments and result)."""
        return _init_cache(self, batch_size, max_length, keep, dtype)

    def layout_map(self, mesh, model_axis="model", layout_map=None):
        """The `keras.distribution.LayoutMap` entries of this layer's weights, for `ModelParallel`: the
        heads split over the mesh axis `model_axis` (`_layout_map` says how, with an example)."""
        return _layout_map(self, mesh, model_axis, layout_map)

    def quantize(self, mode=None, type_check=True, config=None):
        """Quantizes the projections to int8 as Keras' `Dense.quantize("int8")` does (`_quantize`
        says how); `type_check` is unused (Keras' signature)."""
        _quantize(self, mode, config)  # type_check: unused

    def _check_quantize_args(self, mode, compute_dtype):
        _check_quantize_args(self, mode, compute_dtype)  # Keras' checks; float16 computes int8 too

    @classmethod
    def from_keras(cls, layer, *, window=None):
        """Builds a layer with the weights of a built `keras.layers.MultiHeadAttention` or
        `GroupQueryAttention` (`_from_keras` says what is kept and refused, and `window`)."""
        return _from_keras(cls, layer, window)

    def to_keras(self):
        """Returns a built `keras.layers.MultiHeadAttention` (K == N) or `GroupQueryAttention`
        (K < N) holding these weights (`_to_keras`)."""
        return _to_keras(self)

    @property
    def _latent(self):
        return _latent_of(self)  # MLA's sizes as a `_Latent`, None without MLA

    @property
    def _projection_names(self):
        return _layer_projections(self)  # the layer's projections, in the layout's order

    @property
    def _int8(self):
        return self.quantization_mode == "int8"  # the dtype policy is "int8_from_..."

    def _variable(self, name):
        return getattr(self, _ATTRIBUTES.get(name, name))  # one portable weight's (`sinks` is `sink_logits`)

    def _int8_call(self, *args, **kwargs):
        return self.call(*args, **kwargs)  # Keras' entry for an int8 policy

    def _non_defaults(self):
        return _non_defaults(self)  # the variants the Keras built-ins cannot hold


# -------------------------------------------------------------------------------------------------
# Section: score modifiers
# -------------------------------------------------------------------------------------------------
# Constructor arguments, each off at its default:
#     scale: the factor of the scores, `scores = (q . k) * scale`. Defaults to 1 / sqrt(H).
#     softcap: None or a positive float c: the scores become c * tanh(scores / c) (Gemma 2).
#     window: None, W, or a pair (W_before, W_after): query t keeps key s only if
#         s > t + (S - T) - W_before, and with a pair also s < t + (S - T) + W_after
#         (Mistral's sliding window: W; ModernBERT's two-sided band: (65, 65)).
#     attention_chunk_size: None, or C: query t keeps key s only if both are in the same chunk of C
#         positions, s // C == (t + (S - T)) // C (Llama 4's chunked attention).
#     sinks: if True, one learned logit per query head in the softmax's denominator (`sinks`, (N,)).
# ALiBi (`alibi_bias`) and the call's `attention_bias` (added to the scores, with a gradient); and
# the masks, which keep keys or add to their scores (after the score modifiers).


def _check_score_modifiers(head_dim, scale, softcap, window, attention_chunk_size):
    """The score modifiers' arguments checked, in the signature's order: (scale, 1 / sqrt(H) for
    None; softcap; window; attention_chunk_size), the first fields of `_Variants`."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else _positive_float("scale", scale)
    softcap = _positive_float("softcap", softcap, optional=True)
    window = _check_window(window)
    chunk = None if attention_chunk_size is None else _positive_int("attention_chunk_size", attention_chunk_size)
    return scale, softcap, window, chunk


def _score_modifiers_at_default(layer):
    """`_non_defaults`' entries of the score modifiers but `sinks` (a flag): {name: at its default}."""
    return {
        "scale": math.isclose(layer.scale, 1 / math.sqrt(layer.head_dim)),
        "softcap": layer.softcap is None,
        "window": layer.window is None,
        "attention_chunk_size": layer.attention_chunk_size is None,
    }


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
    """A checked `window` -> (W_before, W_after or None); (None, None) without a window."""
    if window is None:
        return None, None
    return tuple(window) if isinstance(window, tuple) else (window, None)


def window_mask(t, s, window):
    """(T, S) boolean mask: query t keeps key s iff s > t + (S - T) - W_before, and with a pair
    window (W_before, W_after) also s < t + (S - T) + W_after (bottom-right aligned)."""
    keys, queries = ops.arange(s, dtype="int32")[None, :], ops.arange(t, dtype="int32")[:, None] + (s - t)
    return _in_window(keys, queries, window)  # (T, S)


def _in_window(keys, queries, window):
    """Whether key positions are within the `window` (an int or a pair) of query positions."""
    before, after = _window_sides(window)
    kept = keys > queries - before
    return kept if after is None else ops.logical_and(kept, keys < queries + after)


def attention_chunk_mask(t, s, size):
    """(T, S) boolean mask: query t keeps key s iff s // size == (t + (S - T)) // size, both in
    the same chunk of `size` positions (bottom-right aligned)."""
    keys, queries = ops.arange(s, dtype="int32")[None, :], ops.arange(t, dtype="int32")[:, None] + (s - t)
    return _same_chunk(keys, queries, size)  # (T, S)


def _same_chunk(keys, queries, size):
    """Whether key and query positions (non-negative) are in the same chunk of `size` positions."""
    return ops.floor_divide(keys, size) == ops.floor_divide(queries, size)


def _fold_masks(keep, window, chunk, t, s):
    """`keep` with `window` and the attention chunk (bottom-right aligned) ANDed in, rank 4."""
    if window is not None:
        keep = _and(keep, window_mask(t, s, window)[None, None])  # (B|1, N|1, T, S)
    if chunk is not None:
        keep = _and(keep, attention_chunk_mask(t, s, chunk)[None, None])  # (B|1, N|1, T, S)
    return keep


def _split_bias(attention_bias, dtype):
    """A checked rank-4 floating `attention_bias` -> (keep, additive) by the floating mask rule."""
    return _split_mask(attention_bias, dtype)


def _softcap(scores, softcap):
    """Gemma 2's logit soft-capping: scores -> c * tanh(scores / c)."""
    return scores if softcap is None else softcap * _tanh(scores / softcap)


def _capped_scores(layer, scores):
    """The scores soft-capped by the layer's `softcap` (as they are without one)."""
    return _softcap(scores, layer.softcap)


def _tanh(x):
    """tanh in x's dtype: `ops.tanh` computes float64 in float32 where Keras narrows it (`_narrows`)."""
    return 2.0 * ops.sigmoid(2.0 * x) - 1.0 if _narrows(x.dtype) else ops.tanh(x)


def _score_modifiers(layer, call, sinks):
    """The call's score modifiers as the keyword arguments of the attention functions (`scale`,
    `softcap`, the call's `window` and `attention_chunk_size`, which the cache step may have
    folded into the keep, and `sinks`, the (N,) logits or None)."""
    return dict(
        scale=layer.scale, softcap=layer.softcap, window=call.window,
        attention_chunk_size=call.attention_chunk_size, sinks=sinks,
    )  # fmt: skip


def _capped_chunk(chunks, scores):
    """`_softcap` of one chunk's scores in the memory-efficient path: (scores, tanh(scores / c),
    kept for the backward), or (scores, None) without a softcap."""
    if chunks.softcap is None:
        return scores, None
    capped = _tanh(scores / chunks.softcap)
    return chunks.softcap * capped, capped


def _softmax_with_sinks(scores, sinks):
    """`_masked_softmax` with one sink logit per head (N,) in the denominator: a softmax over
    [scores, sink] whose sink column is dropped."""
    sink = ops.reshape(ops.cast(sinks, scores.dtype), (1, -1, 1, 1))  # (N,) -> (1, N, 1, 1)
    sink = ops.broadcast_to(sink, (*_shape(scores)[:3], 1))  # -> (B, N, T, 1)
    return ops.softmax(ops.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]  # (B, N, T, S + 1) -> S


def _centre_rows(bias, keep):
    """`bias` minus each row's largest value where `keep` holds (rows keeping nothing: unchanged).

    A per-query constant does not change a softmax (without sinks); this keeps a row of only
    large finite penalties (-1e9) an ordinary softmax instead of scores rounded away in float32.
    """
    if bias.shape[-1] == 0:
        return bias
    lowest = _lowest(bias.dtype)
    top = ops.stop_gradient(ops.max(ops.where(keep, bias, lowest), axis=-1, keepdims=True))  # (B, N, T, 1), dims 1
    return bias - ops.where(top == lowest, ops.zeros_like(top), top)  # (B, N, T, S), dims may be 1


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
    positions = ops.convert_to_tensor(positions)
    if not _is_int(positions.dtype) or len(positions.shape) not in (1, 2):
        raise ValueError(
            "`positions` must be an integer tensor of shape (S,) or (B, S). "
            f"Received: positions.shape={tuple(positions.shape)}, positions.dtype={_dtype_name(positions.dtype)}"
        )
    positions = positions[None] if len(positions.shape) == 1 else positions  # (S,) -> (1, S)
    slopes = ops.convert_to_tensor(_alibi_slopes(num_heads).astype(np.float32))[:, None, None]  # (N, 1, 1)
    return slopes * ops.cast(positions, "float32")[:, None, None, :]  # (B, 1, 1, S) -> (B, N, 1, S)


# The masks (docs/SPEC.md, "Masks"), which keep keys or add to their scores: checked past the
# inputs (`_check_options`), combined into one keep and one bias (`_split_masks`), and the
# habits of other libraries they suggest warned of (`_warn_traps`). A boolean `attention_mask`
# (or `mask`, its alias) is True where a query may attend a key; a floating one is added to the
# scores, and -inf or a value at or below the lowest finite value of its dtype (or of float32)
# removes a key. `causal=True` keeps key s for query t iff s <= t + (S - T). `key_mask`,
# `query_mask` and the inputs' implicit Keras masks remove keys and queries. A query row with no
# key left gets weights of exactly 0, so its output is `output_bias`. Masks that read as another
# library's habit warn with `AttentionMaskWarning`.


def _check_options(
    layer, query, key, attention_mask, key_mask, query_mask, value_mask, attention_bias, positions, cache, implicit,
    explicit, self_attention,
):  # fmt: skip
    """`_check_call`'s checks past the inputs, in its order: the token masks ANDed with the inputs'
    implicit Keras masks (`implicit`, as read; in self-attention `key_mask` defaults to
    `query_mask`), the cache, the masks' dtypes and shapes, the habit warnings (of a `key_mask`
    passed, `explicit`, not filled in by Keras), the positions and the cache's room. Returns the
    rank-4 `attention_mask` and `attention_bias`, the (B, S) key keep, the (B, T) query mask and
    the positions (None without RoPE)."""
    (b, t), s = tuple(query.shape)[:2], key.shape[1]
    implicit = [None if mask is None else ops.cast(mask, "bool") for mask in implicit]
    query_mask = None if query_mask is None else _check_token_mask("query_mask", query_mask, b, t, "T")
    query_mask = query_mask if implicit[0] is None else _and(query_mask, implicit[0])  # (B, T)
    key_mask = None if key_mask is None else _check_token_mask("key_mask", key_mask, b, s, "S")
    passed_key_mask = key_mask if explicit else None
    value_mask = None if value_mask is None else _check_token_mask("value_mask", value_mask, b, s, "S")
    key_keep = key_mask if value_mask is None else _and(key_mask, value_mask)  # (B, S)
    key_keep = query_mask if self_attention and key_keep is None else key_keep
    if implicit[1] is not None or implicit[2] is not None:
        key_keep = _and(key_keep, _and(implicit[1], implicit[2]))  # (B, S)
    if cache is not None:
        _check_cache(cache, query, key, layer.num_kv_heads, layer.head_dim, _latent_of(layer))
    target = (b, layer.num_heads, t, s if cache is None else cache.key.shape[2])
    attention_mask = None if attention_mask is None else ops.convert_to_tensor(attention_mask)
    mask = None if attention_mask is None else _mask_to_4d(attention_mask, target)
    if attention_bias is not None:
        attention_bias = _mask_to_4d(ops.convert_to_tensor(attention_bias), target, "attention_bias")
    if cache is None and (attention_mask is not None or passed_key_mask is not None):
        _warn_traps(layer, attention_mask, passed_key_mask, t, s)
    if layer.rope_theta is not None or positions is not None:
        positions = _positions(layer, positions, query, key, cache)
    if cache is not None:
        _check_room(cache.index, _shape(query)[1], cache.key.shape[2], _window_sides(layer.window)[0])
    return mask, attention_bias, key_keep, query_mask, positions


def _check_token_mask(name, mask, b, length, letter):
    """Checks a (B, T) `query_mask` or (B, S) `key_mask` / `value_mask`; dimensions unknown at
    trace time are not checked."""
    mask = ops.convert_to_tensor(mask)
    shape, dtype = tuple(mask.shape), keras.backend.standardize_dtype(mask.dtype)
    differ = len(shape) == 2 and (len({shape[0], b} - {None}) > 1 or len({shape[1], length} - {None}) > 1)
    if dtype != "bool" or len(shape) != 2 or differ:
        raise ValueError(
            f"`{name}` must be a boolean tensor of shape (B, {letter})=({b}, {length}). "
            f"Received: {name}.shape={shape}, {name}.dtype={dtype}"
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


def _mask_to_4d(mask, target, name="attention_mask"):
    """Checks a mask (or `attention_bias`) against target (B, N, T, S) and returns it as rank 4."""
    if name == "attention_bias" and not _is_float(mask.dtype):
        raise ValueError(f"`attention_bias` must be floating. Received: attention_bias.dtype={_dtype_name(mask.dtype)}")
    if not _is_bool(mask) and not _is_float(mask.dtype):
        raise ValueError(
            f"`{name}` must be boolean (True = attend; for a 0/1 integer mask pass `mask > 0`) or floating. "
            f"Received: {name}.dtype={_dtype_name(mask.dtype)}"
        )
    rank = len(mask.shape)
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
    keys, queries = ops.arange(s, dtype="int32")[None, :], ops.arange(t, dtype="int32")[:, None] + (s - t)
    return keys <= queries  # (T, S)


def _split_masks(layer, call):
    """`_masks`' floating mask rule on `attention_mask` and `attention_bias`: (keep, additive bias
    in the softmax's dtype), rank 4 each, or None."""
    dtype = _softmax_dtype(layer.compute_dtype)
    keep, mask_bias = _split_mask(call.attention_mask, dtype)
    bias_keep, bias = _split_bias(call.attention_bias, dtype)
    return _and(keep, bias_keep), _add(mask_bias, bias)


def _split_mask(mask, dtype):
    """Splits a checked rank-4 mask into (keep, additive), both rank 4 or None, by the floating
    mask rule: a boolean mask is `keep`; a floating one, read in its own dtype, removes a key where
    it is -inf or at most max(lowest of its dtype, lowest of float32), and adds every other value
    in `dtype` (the softmax's, float32 at least). No -inf reaches arithmetic."""
    if mask is None:
        return None, None
    if _dtype_name(mask.dtype) == "float64" and dtype == "float32":
        # A float64 mask of a float32 softmax: the cast saturates every value below float32's range
        # to -inf, which removes, as the rule does (JAX without x64 reads float64 as float32 anyway).
        mask = ops.cast(mask, dtype)
    if _is_bool(mask):
        return mask, None
    threshold = _LOWEST.get(_dtype_name(mask.dtype), _FLOAT32_LOWEST)
    removed = mask <= threshold  # (B, N, T, S), dims may be 1
    additive = ops.where(removed, ops.zeros_like(mask), mask)  # finite, never 0 * -inf
    return ops.logical_not(removed), ops.cast(additive, dtype)


def _and(a, b):
    return b if a is None else a if b is None else ops.logical_and(a, b)


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _warn_traps(layer, attention_mask, key_mask, t, s):
    """Warns once per layer for each habit of the built-in layers that the masks' values suggest
    (docs/SPEC.md, Masks), where reading them is free (`_read_values`: eagerly, on the CPU); a
    call with a cache is not read. The call computes what the SPEC says either way. The habits:
    a boolean mask keeping nothing (nn.MultiheadAttention's True = ignore, nothing padded); a
    square (T == S) boolean `attention_mask` keeping keys only after each query, none where
    `causal` keeps one (nn.MultiheadAttention's causal `attn_mask`, `triu(ones, 1)`); a (B, S)
    `key_mask` that reads as its `key_padding_mask` (True = padding): every row False then True,
    some row keeping no key and none keeping all (left padding has its longest sequence all
    True); a floating `attention_mask` of only 0s and 1s, some 1 (a Keras mask, which Keras
    reads as boolean)."""
    values = _read_values(attention_mask, key_mask)  # NumPy arrays, or None where not free
    if values is None:
        return
    attention_mask, key_mask = values
    traps = {}
    for name, mask in (("attention_mask", attention_mask), ("key_mask", key_mask)):
        if mask is not None and mask.dtype == np.bool_ and mask.size > 0 and not mask.any():
            traps[name] = _EMPTY_MASK.format(name=name)
    boolean = attention_mask is not None and attention_mask.dtype == np.bool_
    later = boolean and attention_mask.size > 0 and t == s > 0  # square: may keep only later keys
    if later and "attention_mask" not in traps and not (attention_mask & np.tril(np.ones((t, s), bool))).any():
        traps["causal"] = _CAUSAL_TRAP  # (T, S) causal kept nowhere
    if key_mask is not None and "key_mask" not in traps:
        kept = key_mask.sum(-1)  # (B,)
        ordered = (key_mask[:, 1:] >= key_mask[:, :-1]).all()  # False then True in every row
        empty = 0 if not ordered or (kept == key_mask.shape[1]).any() else int((kept == 0).sum())
        if empty:
            traps["padding"] = _PADDING_TRAP.format(empty=empty, b=key_mask.shape[0])
    floating = attention_mask is not None and attention_mask.dtype != np.bool_
    if floating and ((attention_mask == 0) | (attention_mask == 1)).all() and (attention_mask == 1).any():
        traps["zeros and ones"] = _ZEROS_AND_ONES
    for kind, message in traps.items():
        if kind not in layer._warned_traps:
            layer._warned_traps.add(kind)
            _warn_at_caller(message)


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


# The packages between the user's call and this file
_FRAMEWORK_MODULES = ("keras", "tensorflow", "jax", "torch", "optree")


def _warn_at_caller(message):
    """Warns `AttentionMaskWarning` at the user's line: the first frame outside this file and the
    framework (a module's or layer's `__call__`, Keras' traceback filter), however deep they call."""
    frame, level = sys._getframe(1), 2  # level 2: the frame that called this function
    while frame is not None and (
        frame.f_globals is globals() or frame.f_globals.get("__name__", "").split(".")[0] in _FRAMEWORK_MODULES
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, AttentionMaskWarning, stacklevel=level)


def segment_ids_from_position_ids(position_ids):
    """Segment ids from positions that restart at each document (transformers' padding-free
    `position_ids`, `DataCollatorWithFlattening`): (B, T) or (T,) integers -> the same shape,
    0 for a row's first document, then 1, 2, ...; a document starts at t = 0 and wherever a
    position is not one more than the one before it."""
    positions = ops.convert_to_tensor(position_ids)
    changed = ops.cast(ops.not_equal(positions[..., 1:], positions[..., :-1] + 1), "int32")  # (B, T - 1)
    return ops.cumsum(ops.concatenate([ops.zeros_like(changed[..., :1]), changed], axis=-1), axis=-1)  # (B, T)


def segment_ids_from_cu_seqlens(cu_seqlens, total_length=None):
    """Segment ids from the cumulative lengths of `varlen_attn` / flash-attention (0, len_0,
    len_0 + len_1, ..., T): (D + 1,) integers -> (1, T), document d at [cu[d], cu[d + 1]).
    `total_length` (default cu[-1]) may exceed cu[-1]: the tail is one more document."""
    cu = np.asarray(ops.convert_to_numpy(cu_seqlens))
    if cu.ndim != 1 or cu.size < 1 or not np.issubdtype(cu.dtype, np.integer) or cu[0] != 0 or (np.diff(cu) < 0).any():
        raise ValueError(
            "`cu_seqlens` must be a 1-D integer tensor starting at 0 and non-decreasing. "
            f"Received: cu_seqlens={cu.tolist()}"
        )
    length = int(cu[-1]) if total_length is None else int(total_length)
    return ops.convert_to_tensor(np.searchsorted(cu[1:], np.arange(length), side="right")[None, :], "int32")


def _check_segment_ids(name, ids, batch_size, length, letter):
    """Checks (B, L) integer segment ids (static dimensions where known)."""
    ids = ops.convert_to_tensor(ids)
    shape, dtype = tuple(ids.shape), keras.backend.standardize_dtype(ids.dtype)
    expected = (batch_size, length)
    fits = len(shape) == 2 and all(d is None or e is None or d == e for d, e in zip(shape, expected, strict=True))
    if not dtype.startswith(("int", "uint")) or not fits:
        raise ValueError(
            f"`{name}` must be an integer tensor of shape (B, {letter})=({batch_size}, {length}). "
            f"Received: {name}.shape={shape}, {name}.dtype={dtype}"
        )
    return ops.cast(ids, "int32")


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
    packed call of a cache) and the mask is over its L slots; a call without ids continues the
    document of the last written slot."""
    cache = call.cache
    if segment_ids is None and (cache is None or not _has_segments(cache)):
        raise _segment_ids_error("`key_segment_ids` needs `segment_ids`")
    if cache is not None:
        length, index = cache.key.shape[2], ops.convert_to_tensor(cache.index, "int32")
        if segment_ids is None:  # the new tokens continue the last written slot's document
            last = ops.take(cache.segment_ids, ops.mod(index - 1, length), axis=1)  # (B,)
            segment_ids = ops.repeat(ops.expand_dims(last, 1), _shape(call.query)[1], axis=1)  # (B, T)
    segment_ids, key_ids = _checked_segment_ids(call, segment_ids, key_segment_ids)
    if cache is not None:
        rows_b, rows_t = _shape(key_ids)
        ids = ops.zeros((rows_b, length), "int32") if not _has_segments(cache) else cache.segment_ids
        slots = ops.mod(index + ops.arange(rows_t, dtype="int32"), length)  # (T,)
        grid = ops.meshgrid(ops.arange(rows_b, dtype="int32"), slots, indexing="ij")
        rows = ops.reshape(ops.stack(grid, axis=-1), (-1, 2))  # (B*T, 2): (b, slot)
        ids = ops.scatter_update(ops.cast(ids, "int32"), rows, ops.reshape(key_ids, (-1,)))  # (B, L)
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
    return ops.equal(segment_ids[:, None, :, None], key_ids[:, None, None, :])  # (B, 1, T, S)


def _packed(layer, call, segment_ids, key_segment_ids):
    """Packed sequences: without a cache the checked ids as the call's `segments`, which `_attend`
    ANDs into its keep (the chunked path a chunk of queries at a time: `_chunk_weights`); with
    one, the ids ANDed into `attention_mask` (`_segment_keep`). The call is marked `segmented`."""
    if call.cache is None:
        if segment_ids is None:
            raise _segment_ids_error("`key_segment_ids` needs `segment_ids`")
        return call._replace(segments=_checked_segment_ids(call, segment_ids, key_segment_ids), segmented=True)
    same, cache = _segment_keep(layer, call, segment_ids, key_segment_ids)
    mask = call.attention_mask
    if mask is not None:
        removed = ops.full_like(mask, -np.inf) if not _is_bool(mask) else None
        same = ops.logical_and(mask, same) if removed is None else ops.where(same, mask, removed)
    return call._replace(attention_mask=same, cache=cache, segmented=True)


# -------------------------------------------------------------------------------------------------
# Section: positions
# -------------------------------------------------------------------------------------------------
# Constructor arguments (RoPE is off while `rope_theta` is None; `positions` in the call):
#     rope_theta: None (no RoPE) or the base of rotary position embeddings.
#     rope_fraction: in (0, 1]; RoPE turns the first R = int(H * rope_fraction) features.
#     rope_interleaved: False pairs feature i with i + R/2; True pairs 2i and 2i + 1.
#     rope_scaling: None, {"rope_type": "linear", "factor": f}, a "llama3" dict (factor,
#         low_freq_factor, high_freq_factor, original_max_position_embeddings) or a "yarn" dict
#         (factor, original_max_position_embeddings, optional attention_factor, beta_fast,
#         beta_slow, mscale, mscale_all_dim, truncate; the rotated features of q and k are
#         also multiplied by its attention factor) or a "proportional" dict (optional factor,
#         partial_rotary_factor: Gemma 4, LFM3; the last pairs of the R features unturned).
#     rope_sections: None, or the numbers of rotated pairs (summing to R/2) that turn by each
#         row of (k, B, T) `positions` in turn (Qwen2-VL's multimodal RoPE, `mrope_section`).
# q and k are turned after QK-norm, before the cache.

_ROPE_SCALING = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "proportional": (),
}


_YARN_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


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
    above low_freq_factor; yarn: see `_valid_yarn`; proportional: `_valid_proportional`). Returned as a
    copy whose NumPy scalars are Python's."""
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


def _check_positions(positions, b, t, sections=None):
    """Checks integer (B, T) or (T,) `positions` and returns them as (B, T) or (1, T); with k
    `rope_sections` (k, B, T) is accepted too, and they are returned as (k, B|1, T)."""
    positions = ops.convert_to_tensor(positions)
    shape = _static_shape(positions)
    dims = {1: (t,), 2: (b, t), 3: None if sections is None else (len(sections), b, t)}.get(len(shape))
    expected = dims is not None and not any(_differ(d, e) for d, e in zip(shape, dims, strict=True))
    if not _is_int(positions.dtype) or not expected:
        received = f"Received: positions.shape={shape}, positions.dtype={_dtype_name(positions.dtype)}"
        if sections is None:
            raise ValueError(
                f"`positions` must be an integer tensor of shape (B, T) or (T,) with B={b}, T={t}. {received}"
            )
        raise ValueError(
            f"`positions` must be an integer tensor of shape (B, T), (T,) or ({len(sections)}, B, T) with B={b}, "
            f"T={t} (one row per section of `rope_sections`). {received}"
        )
    positions = positions[None] if len(shape) == 1 else positions  # (T,) -> (1, T)
    return positions if sections is None else _per_section(positions, sections)


def _per_section(positions, sections):
    """(B|1, T) positions -> (k, B|1, T), one row per section; (k, B, T) ones as they are."""
    if len(positions.shape) == 3:
        return positions
    return ops.repeat(positions[None], len(sections), axis=0)  # (B|1, T) -> (k, B|1, T)


def _positions(layer, positions, query, key, cache):
    """Checks `positions` and returns them as (B, T) or (1, T) integers, (k, B|1, T) with
    k `rope_sections` (default arange(T), plus the cache's index), or None without RoPE."""
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
        start = 0 if cache is None else ops.convert_to_tensor(cache.index, "int32")
        positions = (start + ops.arange(_shape(query)[1], dtype="int32"))[None]  # (1, T)
        return positions if layer.rope_sections is None else _per_section(positions, layer.rope_sections)
    return _check_positions(positions, query.shape[0], query.shape[1], layer.rope_sections)


def _rotate(layer, q, k, v, positions):
    """Step 4: RoPE of q (B, N, T, H) and k (B, K, T, H) at (B, T) or (1, T) `positions`,
    (k, B|1, T) with `rope_sections` (MLA: `_rotate_latent`). Returns q, k, v."""
    return _rotate_heads(layer, q, positions), _rotate_heads(layer, k, positions), v


def _rotate_heads(layer, x, positions):
    """x (B, heads, T, W) with its first R features turned, times YaRN's attention factor."""
    inv_freq = layer._inv_freq
    sections = layer.rope_sections, layer.rope_sections_interleaved  # multimodal RoPE: sections (or None), their layout
    x = apply_rope(x, positions, inv_freq, layer.rope_interleaved, *sections)
    return scale_rotated(x, 2 * len(inv_freq), rope_attention_factor(layer.rope_scaling))


def document_positions(segment_ids):
    """RoPE positions of packed sequences: (B, T) or (T,) segment ids -> positions of the same
    shape that restart at 0 wherever the id changes (each document numbered from 0)."""
    ids = np.asarray(ops.convert_to_numpy(segment_ids))
    steps = np.arange(ids.shape[-1])  # (T,)
    starts = np.ones(ids.shape, dtype=bool)  # (B, T)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    first = np.maximum.accumulate(np.where(starts, steps, 0), axis=-1)  # (B, T), where each document starts
    return ops.convert_to_tensor(steps - first, "int32")  # (B, T)


def rope_frequencies(rotary_dim, theta, scaling=None):
    """(R/2,) float32 inverse frequencies `theta ** (-2i / R)` of RoPE, rewritten by `scaling`
    (None, {"rope_type": "linear", "factor": f}, a "llama3", "yarn" or "proportional" dict); computed in
    float64 and returned as a NumPy array (a constant of every trace)."""
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
    return inv_freq.astype(np.float32)


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
    return ops.concatenate([x[..., :rotary_dim] * factor, x[..., rotary_dim:]], axis=-1)  # (B, heads, T, H)


def rope_angles(positions, inv_freq, sections=None, sections_interleaved=False):
    """(B, T, R/2) float32 angles: (B, T) positions times the (R/2,) inv_freq; with `sections`
    (multimodal RoPE) pair i turns by positions[j] * inv_freq[i] from (k, B, T) positions, j its
    row (`_section_rows`: runs of the sections' sizes, or dealt in turn with `sections_interleaved`)."""
    if sections is None:
        return ops.cast(positions, "float32")[..., None] * ops.convert_to_tensor(inv_freq, "float32")  # (B, T, R/2)
    rows = ops.take(positions, _section_rows(sections, sections_interleaved), axis=0)  # (k, B|1, T) -> (R/2, B|1, T)
    return ops.cast(ops.transpose(rows, (1, 2, 0)), "float32") * ops.convert_to_tensor(inv_freq, "float32")


def _section_rows(sections, interleaved):
    """The row of (k, B, T) positions that turns each of the R/2 pairs: row j turns a run of
    `sections[j]` pairs, in order; `interleaved` (Qwen3-VL) deals them in turn: pair i by row
    i % k while i < k * sections[i % k], else by row 0."""
    k = len(sections)
    if not interleaved:
        return [j for j, size in enumerate(sections) for _ in range(size)]
    return [i % k if i < k * sections[i % k] else 0 for i in range(sum(sections))]


def apply_rope(x, positions, inv_freq, interleaved, sections=None, sections_interleaved=False):
    """Rotates the first R = 2 * len(inv_freq) features of each head of x.

    Args:
        x: (B, heads, T, H) queries or keys.
        positions: (B, T) or (1, T) integer positions; with `sections`, (k, B|1, T).
        inv_freq: (R/2,) float32 frequencies from `rope_frequencies`, an array or a sequence of
            floats.
        interleaved: False pairs feature i with i + R/2 (Llama, GPT-NeoX); True pairs 2i and
            2i + 1 (GPT-J).
        sections: None, or the numbers of pairs (summing to R/2) turned by each row of
            `positions` in turn (multimodal RoPE).
        sections_interleaved: if True, the sections' pairs are dealt in turn (`_section_rows`,
            Qwen3-VL), not in runs.

    Returns:
        x rotated, in its dtype; the angles and their cos and sin are float32.
    """
    rotary_dim = 2 * len(inv_freq)
    angles = rope_angles(positions, inv_freq, sections, sections_interleaved)  # (B, T, R/2)
    angles = angles[:, None]  # (B, T, R/2) -> (B, 1, T, R/2)
    dtype = _softmax_dtype(x.dtype)
    cos, sin = ops.cast(ops.cos(angles), dtype), ops.cast(ops.sin(angles), dtype)  # (B, 1, T, R/2)
    rotary = ops.cast(x[..., :rotary_dim], dtype)  # (B, heads, T, R)
    turned = ops.cast(_turn(rotary, cos, sin, interleaved), x.dtype)  # (B, heads, T, R)
    if rotary_dim == x.shape[-1]:
        return turned
    return ops.concatenate([turned, x[..., rotary_dim:]], axis=-1)  # (B, heads, T, H)


def _turn(x, cos, sin, interleaved):
    """Each pair (x1, x2) of x (..., R) turned by its angle, given as (..., R/2) cos and sin:
    (x1 cos - x2 sin, x2 cos + x1 sin)."""
    if interleaved:
        pairs = ops.reshape(x, (*_shape(x)[:-1], x.shape[-1] // 2, 2))  # (..., R/2, 2)
        first, second = pairs[..., 0], pairs[..., 1]  # (..., R/2) each
    else:
        first, second = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]  # (..., R/2) each
    return _on_pairs(first * cos - second * sin, second * cos + first * sin, interleaved)  # (..., R)


def _on_pairs(first, second, interleaved):
    """Two (..., R/2) values of each pair -> (..., R): on its first and on its second feature."""
    if interleaved:
        pairs = ops.stack([first, second], axis=-1)  # (..., R/2, 2)
        return ops.reshape(pairs, (*_shape(first)[:-1], 2 * first.shape[-1]))  # (..., R)
    return ops.concatenate([first, second], axis=-1)  # (..., R)


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


def _position_step(layer, q, k, v, call, rotate):
    """Steps 4 and 4b: RoPE of q and k by `rotate` (`_rotate`, MLA's `_rotate_latent`), then each query row
    times its scale."""
    if layer.rope_theta is not None:
        q, k, v = rotate(layer, q, k, v, call.positions)  # 4. RoPE
        q, k = _normalize_qk(layer, q, k) if layer._qk_norm_late else (q, k)  # 4. QK-norm after RoPE
    return (q, k, v) if layer.query_scaling is None else (q * _query_scales(layer, q, call), k, v)


def _query_scales(layer, q, call):
    """Step 4b: the (B|1, 1, T, 1) factor of each query row of q (B, N, T, H), 1 + beta * ln(1 + floor(p /
    floor)), computed in float32 (float64 for a float64 q) as transformers does, in q's dtype."""
    scaling = layer.query_scaling
    dtype = "float64" if keras.backend.standardize_dtype(q.dtype) == "float64" else "float32"
    if scaling["type"] != "temperature" and call.positions is not None:
        positions = ops.cast(call.positions, dtype)  # (B|1, T)
    else:
        start = 0 if call.cache is None else ops.convert_to_tensor(call.cache.index, "int32")
        steps = ops.cast(start + ops.arange(_shape(q)[2], dtype="int32"), dtype)  # (T,)
        positions = (steps + float(scaling["type"] == "temperature"))[None]  # (1, T)
    if scaling["type"] == "learned":
        return _learned_scales(layer.query_scaling_scale, layer.query_scaling_bias, positions, q.dtype)
    scales = 1.0 + scaling["beta"] * ops.log(1.0 + ops.floor(positions / scaling["floor"]))  # (B|1, T)
    return ops.cast(scales, q.dtype)[:, None, :, None]  # (B|1, T) -> (B|1, 1, T, 1)


def _learned_scales(scale, bias, positions, dtype):
    """The learned factor scale[n] * ln(1 + p) + bias[n] of head n at (B|1, T) float positions, in `dtype` as
    transformers computes it (ln(1 + p) in float32 at least, then cast): (B|1, heads, T, 1)."""
    logs = ops.cast(ops.log(1.0 + positions), dtype)  # (B|1, T): ln(1 + p), as transformers (no Log1p op in ONNX)
    scale, bias = ops.cast(scale, dtype), ops.cast(bias, dtype)  # (heads,)
    return scale[None, :, None, None] * logs[:, None, :, None] + bias[None, :, None, None]  # (B|1, heads, T, 1)


# -------------------------------------------------------------------------------------------------
# Section: QK-norm, clip_qkv and the gate
# -------------------------------------------------------------------------------------------------
# Constructor arguments, each off at its default:
#     qk_norm: None, "head" (each head of q and k normalized, one scale shared by the heads:
#         Qwen3), "per_head" (each head with its own scale: StableLM, Cohere) or "all" (over all
#         heads: OLMo2); its scales are the weights `query_norm` and `key_norm`.
#     qk_norm_eps: the epsilon of that norm.
#     qk_norm_type: "rms" (RMSNorm) or "layer" (LayerNorm: the mean is removed first).
#     qk_norm_bias: if True, the norm adds a learned bias after its scale (`query_norm_bias`,
#         `key_norm_bias`: Phi's LayerNorm).
#     clip_qkv: None or c > 0: q, k and v are clamped to [-c, c] right after their projections
#         (bias included), before QK-norm, RoPE and the cache (OLMo, DBRX, MPT).
#     gate: if True, each head's attention result is multiplied, feature by feature, by
#         sigmoid(query @ gate_kernel + gate_bias), (B, T, N*H), before the heads are merged
#         (Keras' `use_gate`, Qwen3-Next, Qwen3.5).
#     output_norm: None, "rms" (RMSNorm) or "layer" (LayerNorm with a bias): a norm of the merged heads,
#         (B, T, N*Hv) over all their features, before the output projection; its scale is the weight
#         `context_norm`, its bias `context_norm_bias` (BitNet's `attn_sub_norm`, Kosmos-2's `inner_attn_ln`).
#     output_norm_eps: the epsilon of that norm.
#     qk_norm_after_rope: if True, QK-norm normalizes q and k after RoPE (in step 4) instead of before it (step 3):
#         HunYuan's `query_layernorm` and `key_layernorm`; no effect without `qk_norm` or RoPE.
#     gate_activation: "sigmoid" (default) or "softplus" (Laguna): the gate's function of its
#         projection (the last constructor argument).

_GATE_ACTIVATIONS = ("sigmoid", "softplus")  # the values `gate_activation` takes


def rms_norm(x, scale, eps, bias=None):
    """RMSNorm over the last axis, `x / sqrt(mean(x ** 2) + eps) * scale (+ bias)`, computed in
    float32 at least and cast back to x's dtype."""
    dtype = _softmax_dtype(x.dtype)
    y = ops.cast(x, dtype)
    y = y * ops.rsqrt(_mean(ops.square(y)) + eps) * ops.cast(scale, dtype)
    return ops.cast(_add(y, None if bias is None else ops.cast(bias, dtype)), x.dtype)


def layer_norm(x, scale, eps, bias=None):
    """LayerNorm over the last axis, `(x - mean(x)) / sqrt(var(x) + eps) * scale (+ bias)` with
    the biased variance, computed in float32 at least and cast back to x's dtype."""
    dtype = _softmax_dtype(x.dtype)
    y = ops.cast(x, dtype)
    y = y - _mean(y)
    y = y * ops.rsqrt(_mean(ops.square(y)) + eps) * ops.cast(scale, dtype)
    return ops.cast(_add(y, None if bias is None else ops.cast(bias, dtype)), x.dtype)


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
    width = (layer.num_heads * (layer.v_head_dim or layer.head_dim),)  # N*Hv (Hv = H without MLA)
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
    """`clip_qkv`: x clamped to [-c, c] (unchanged when None), with the clamp's gradient, 1 within
    [-c, c] (bounds included) and 0 outside, on every backend (JAX's `clip` gives 0.5 at a bound)."""
    return x if layer.clip_qkv is None else ops.where(ops.abs(x) <= layer.clip_qkv, x, ops.sign(x) * layer.clip_qkv)


def _normalize_qk(layer, q, k):
    """QK-norm (RMSNorm, or LayerNorm with `qk_norm_type="layer"`) of each head of q and k
    ("head": scales (H,) shared by the heads; "per_head": scales (N*H,) and (K*H,), head n's
    [n*H:(n+1)*H]) or of all their heads at once ("all": scales (N*H,) and (K*H,)); with
    `qk_norm_bias`, plus the biases shaped like the scales."""
    return _norm(layer, q, "query", layer.num_heads), _norm(layer, k, "key", layer.num_kv_heads)


def _norm(layer, x, kind, heads):
    """The QK-norm of x (B, heads, L, H) with the `kind` ("query" or "key") weights."""
    norm = layer_norm if layer.qk_norm_type == "layer" else rms_norm
    scale = getattr(layer, f"{kind}_norm")
    bias = getattr(layer, f"{kind}_norm_bias") if layer.qk_norm_bias else None
    if layer.qk_norm == "all":
        merged = norm(layer._merge_heads(x), scale, layer.qk_norm_eps, bias)  # (B, L, heads*H)
        return layer._split_heads(merged, heads)  # (B, heads, L, H)
    if layer.qk_norm == "per_head":
        scale = ops.reshape(scale, (heads, 1, layer.head_dim))  # (heads*H,) -> (heads, 1, H)
        bias = None if bias is None else ops.reshape(bias, (heads, 1, layer.head_dim))  # (heads, 1, H)
    return norm(x, scale, layer.qk_norm_eps, bias)  # (B, heads, L, H)


def _gate_heads(layer, call, context):
    """Step 6b: the (B, N, T, Hv) attention result times sigmoid(query @ gate_kernel + gate_bias)
    (softplus with `gate_activation="softplus"`) split into heads (Hv = H without MLA)."""
    activation = ops.softplus if layer.gate_activation == "softplus" else ops.sigmoid
    gate = activation(layer._project(call.query, "gate"))  # (B, T, E) -> (B, T, N*Hv)
    return context * layer._split_heads(gate, layer.num_heads, context.shape[-1])  # -> (B, N, T, Hv)


# -------------------------------------------------------------------------------------------------
# Section: KV cache and decode steps
# -------------------------------------------------------------------------------------------------
# `cache = layer.init_cache(B, L)`, then `output, cache = layer(x, cache=cache)` for a prompt and
# then one token at a time. The keys (rotated by RoPE) and values of the T new tokens go to slots
# position mod L, and query t attends slot s iff s holds a position before index + T, keep[b, s],
# (not causal or that position <= index + t), (no window or that position > index + t - W_before,
# and < index + t + W_after with a pair), (no chunk or that position in the chunk of index + t) and
# `attention_mask` (given over L) keeps it. Token by token equals the full causal pass. With a
# `window` the cache rolls by W_before: L >= W_before slots decode any number of tokens (a call
# that wraps, index + T > L, needs L >= W_before + T - 1).
# The call's `cache`: a `KVCache` from `init_cache`: decode T new tokens (`key` and `value`, if
# given, hold the same T tokens); masks and weights are then over the L slots, and `key_mask` is
# (B, T).


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

    key: Any
    value: Any
    keep: Any
    index: Any
    segment_ids: Any = None
    key_scale: Any = None
    value_scale: Any = None
    index_key: Any = None


def _results(output, weights, cache, return_attention, kv=None, selection=None):
    """output, (output, weights), (output, cache) or (output, weights, cache); the sparse indexer's
    selection before the cache where `return_topk` gives one; then `kv` if given."""
    results = (output, weights) if return_attention else (output,)
    results = results if selection is None else (*results, selection)
    results = results if cache is None else (*results, cache)
    results = results if kv is None else (*results, kv)
    return results[0] if len(results) == 1 else results


def _init_cache(layer, batch_size, max_length, keep, dtype):
    """An empty `KVCache` for decoding `batch_size` sequences of up to `max_length` tokens.

    Args:
        batch_size: B.
        max_length: L, the number of slots.
        keep: (B, L) boolean, False for slots no query may attend (left padding of prompts
            of different lengths). Defaults to all True.
        dtype: dtype of the keys and values; defaults to the compute dtype of the policy.
            "int8": an int8 cache, integers with a float32 scale per slot and head;
            "float8_e4m3fn": an fp8 cache, likewise scaled.

    Returns:
        A `KVCache` of zeros with index 0 (int32); with MLA, the latent cache: `key` (B, 1, L, C)
        for the normalized latents, `value` (B, 1, L, Hr) for the rotated shared key part.
    """
    b, length = _positive_int("batch_size", batch_size), _positive_int("max_length", max_length)
    keep = ops.ones((b, length), dtype="bool") if keep is None else _check_keep(keep, b, length)
    shapes = _latent_cache_shapes(layer, b, length) or ((b, layer.num_kv_heads, length, layer.head_dim),) * 2
    dtype = _dtype_name(layer.compute_dtype if dtype is None else dtype)
    key, value = (ops.cast(ops.zeros(shape), dtype) for shape in shapes)  # fp8: TensorFlow has no fp8 zeros
    no_ids = ops.zeros((b, 0), "int32")  # segment ids: none yet (a tensor, so the cache is a nest of tensors)
    no_scales = ops.zeros((b, 0), "float32")  # a float cache: none
    index_dtype = layer.compute_dtype if dtype in _QUANTIZED_CACHE else dtype  # int8, fp8: the indexer's float
    index_key = ops.zeros(_index_cache_shape(layer, b, length), index_dtype)  # the indexer's keys, or (B, 0, 0)
    cache = KVCache(key, value, keep, ops.convert_to_tensor(0, "int32"), no_ids, no_scales, no_scales, index_key)
    return cache if dtype not in _QUANTIZED_CACHE else _with_cache_scales(cache)  # int8 section (int8 and fp8)


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
    if _dtype_name(cache.key.dtype) in _QUANTIZED_CACHE:
        return _check_quantized_cache(cache)  # int8 section (int8 and fp8)
    key, value = _dtype_name(cache.key.dtype), _dtype_name(cache.value.dtype)
    if key != dtype or value != dtype:
        raise ValueError(
            f"`cache` must hold the layer's compute dtype {dtype}; "
            "make it with `init_cache(..., dtype=...)`. "
            f"Received: cache.key.dtype={key}, cache.value.dtype={value}"
        )


def _check_keep(keep, batch_size, max_length):
    """Checks the (B, L) boolean `keep` of `init_cache`."""
    keep = ops.convert_to_tensor(keep)
    if not _is_bool(keep) or tuple(keep.shape) != (batch_size, max_length):
        raise ValueError(
            f"`keep` must be a boolean array of shape (B, L)=({batch_size}, {max_length}). "
            f"Received: keep.shape={tuple(keep.shape)}, keep.dtype={_dtype_name(keep.dtype)}"
        )
    return keep


def _check_room(index, t, length, window):
    """Whether the T new tokens do not fit, as a () boolean tensor: without a window index + T must
    be <= L; with one (`window` is W_before here) the cache rolls, and a call that wraps must leave
    its first query's keys in place (L >= window + T - 1). Where the index can be read (eagerly) a
    misfit is a ValueError; in a trace (`jax.jit`, a TensorFlow graph) `_attend` makes that call's
    output NaN."""
    index = ops.convert_to_tensor(index)
    misfit = index + t > length  # ()
    if window is not None:
        misfit = ops.logical_and(misfit, length < window + t - 1)  # ()
    values = _read_values(misfit, index)  # None where not free to read
    if values is not None and bool(values[0]):
        if window is None:
            raise _cache_full_error(int(values[1]), int(t), int(length))
        raise _cache_too_short_error(window, int(t), int(length))
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


def _update_cache(layer, call, k, v, keep):
    """The cache write: the new keys and values go to slots [index, index + T) (mod L with a
    window), `key_mask` into the cache's keep; returns the cache's (B, K, L, H) keys and values,
    `keep` over the L slots with `causal`, `window` and `attention_chunk_size` folded in, and
    the call with the new cache."""
    if _has_segments(call.cache) and not call.segmented:  # packed: the new tokens continue a document
        same, segmented = _segment_keep(layer, call, None, None)  # (B, 1, T, L)
        keep, call = _and(keep, same), call._replace(cache=segmented)
    t, index = _shape(call.query)[1], ops.convert_to_tensor(call.cache.index, "int32")  # the index before this write
    quantized = _dtype_name(call.cache.key.dtype) in _QUANTIZED_CACHE
    write = _write_quantized_cache if quantized else _write_cache  # int8 and fp8: the int8 section
    cache = write(call.cache, k, v, call.key_mask) if not layer.kv_shared else _written(call.cache, t)
    folded = _cache_keep(cache.keep, index, t, call.causal, call.window, call.attention_chunk_size)  # (B, 1, T, L)
    keep = _and(keep, folded)  # (B, N, T, L), dims may be 1
    call = call._replace(causal=False, window=None, attention_chunk_size=None, cache=cache)
    return cache.key, cache.value, keep, call


def _nan_if_misfit(layer, q, k, call, context):
    """`_attend`'s context, NaN where the T new tokens did not fit the cache: a decoding call without
    room raised in `_check_call` where the cache's index can be read; elsewhere (a trace) its output
    is NaN."""
    if _read_values(call.cache.index) is not None:
        return context
    t, before = _shape(q)[2], _window_sides(layer.window)[0]
    misfit = _check_room(call.cache.index - t, t, k.shape[2], before)  # the index before the write
    return ops.where(misfit, ops.cast(float("nan"), context.dtype), context)  # a trace cannot raise


def _slot_positions(length, last):
    """(L,) the position held by each slot once positions up to `last` are written (position p in
    slot p mod L); negative where nothing is written yet."""
    slots = ops.arange(length, dtype="int32")  # (L,)
    return slots + length * ops.floor_divide(last - slots, length)  # (L,)


def _cache_keep(keep, index, t, causal, window, chunk):
    """(B, L) cache keep -> (B, 1, T, L): slot s holds a written position p(s), is not padding,
    when causal p(s) is at most the query's own position index + t, with a window
    p(s) > index + t - W_before (and with a pair p(s) < index + t + W_after), and with a chunk
    size C p(s) // C == (index + t) // C."""
    held = _slot_positions(keep.shape[-1], index + t - 1)[None, :]  # (1, L), p(s)
    positions = index + ops.arange(t, dtype="int32")[:, None]  # (T, 1), the position of each query
    allowed = (held >= 0) & (held <= positions if causal else held < index + t)  # (T, L)
    if window is not None:
        allowed = allowed & _in_window(held, positions, window)  # (T, L)
    if chunk is not None:
        allowed = allowed & _same_chunk(held, positions, chunk)  # (T, L)
    return ops.logical_and(allowed[None, None], keep[:, None, None, :])  # (B, 1, T, L)


def _cache_attend(layer, k):
    """Step 6 of a call with a cache: `_attend`, or over an int8 or fp8 cache `_attend_quantized` (int8 section)."""
    return (
        layer._attend if _dtype_name(k.dtype) not in _QUANTIZED_CACHE else lambda *args: _attend_quantized(layer, *args)
    )


def _write_cache(cache, k, v, key_mask):
    """A new cache with (B, K, T, H) keys and values of positions [index, index + T) written to
    slots position mod L, and `keep` there: the (B, T) `key_mask` ANDed into it on the first lap
    (left padding), in its place once a slot holds a new token."""
    b, heads, t = _shape(k)[:3]
    length, index = cache.key.shape[2], ops.convert_to_tensor(cache.index, "int32")
    positions = index + ops.arange(t, dtype="int32")  # (T,)
    slots = ops.mod(positions, length)  # (T,)
    grid = ops.meshgrid(ops.arange(b, dtype="int32"), ops.arange(heads, dtype="int32"), slots, indexing="ij")
    written = ops.reshape(ops.stack(grid, axis=-1), (-1, 3))  # (B*K*T, 3): (b, head, slot) of every vector
    key = ops.scatter_update(cache.key, written, ops.reshape(k, (-1, k.shape[-1])))  # (B, K, L, H)
    value = ops.scatter_update(cache.value, written, ops.reshape(v, (-1, v.shape[-1])))  # (B, K, L, H)
    new = ops.ones((b, t), "bool") if key_mask is None else key_mask  # (B, T)
    old = ops.take(cache.keep, slots, axis=1)  # (B, T)
    kept = ops.where((positions < length)[None, :], ops.logical_and(old, new), new)  # (B, T)
    rows = ops.reshape(ops.stack(ops.meshgrid(ops.arange(b, dtype="int32"), slots, indexing="ij"), -1), (-1, 2))
    keep = ops.scatter_update(cache.keep, rows, ops.reshape(kept, (-1,)))  # (B, L) at (b, slot)
    return KVCache(key, value, keep, index + t, *cache[4:])


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
# are the options of Gemma 4's full-attention layers (`attention_k_eq_v`) and of Gemma's `v_norm`. Autograd
# carries the gradient to the shared keys and values passed in.

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
    return shared_kv._replace(index=ops.convert_to_tensor(shared_kv.index, "int32") - _shape(query)[-2])


def _written(cache, t):
    """The shared cache as its producer returned it: the checked cache's index moved on by T."""
    return cache._replace(index=ops.convert_to_tensor(cache.index, "int32") + t)


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
    return tuple(ops.cast(x, layer.compute_dtype) for x in pair)


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
    q = q if layer.rope_theta is None else _rotate_heads(layer, q, call.positions)
    if layer.kv_shared and shared_kv is None:
        raise ValueError(
            "`shared_kv` must be given to a layer built with `kv_shared=True`: it has no key or value projections. "
            "Received: shared_kv=None"
        )
    if layer.kv_shared:
        return (q, None, None) if call.cache is not None else (q, *_shared_pair(layer, call, shared_kv))
    k, v = _own_keys_values(layer, call)  # 2. (B, K, S, H) x 2
    k = k if layer.qk_norm is None else _norm(layer, k, "key", layer.num_kv_heads)  # 3.
    k = k if layer.rope_theta is None else _rotate_heads(layer, k, call.positions)  # 4.
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
# MLA (DeepSeek-V2/V3, Kimi, GLM-5), on with `kv_lora_rank` C; Hn, Hr and Hv are `qk_nope_head_dim`,
# `qk_rope_head_dim` and `v_head_dim`, H = Hn + Hr, Q = `q_lora_rank`:
#     q = RMSNorm(query @ query_a_kernel) @ query_b_kernel   (B, T, N*H), or query @ query_kernel
#     c, k_rope = split(key @ key_value_a_kernel)            (B, S, C), (B, S, Hr); c RMS-normalized
#     [k_nope, v] = c @ key_value_b_kernel                   (B, S, K*(Hn + Hv)), per head
#     k = [k_nope, k_rope]; RoPE turns the last Hr features of q and k_rope (shared by the heads)
# The cache holds c in `key` (B, 1, L, C) and the turned k_rope in `value` (B, 1, L, Hr). The
# absorbed path (`absorb_latents`) attends the latents directly: q_nope @ W_kb^T against c, the
# weighted sum of c then @ W_vb, the up-projections folded into the query and the output.
# Constructor arguments (MLA is off while `kv_lora_rank` is None):
#     kv_lora_rank: None, or C: keys and values come from `key` through a latent of C features per
#         token, RMS-normalized, and the cache holds it (`KVCache.key` (B, 1, L, C), `value`
#         (B, 1, L, Hr)); `value` must be None or `key` itself. Not with `vdim`, `qk_norm`,
#         `clip_qkv`, `rope_sections` or `rope_fraction` < 1.
#     q_lora_rank: None (a plain query projection), or Q: the query goes through a latent of Q
#         features, RMS-normalized (`query_a_kernel`, `query_a_norm`, `query_b_kernel`).
#     qk_nope_head_dim: Hn, the features of a query/key head that RoPE does not turn.
#     qk_rope_head_dim: Hr, the features RoPE turns; the key's are shared by the heads. With MLA,
#         H = Hn + Hr (`head_dim`, if given, must equal it).
#     v_head_dim: Hv, the width of a value head; the output kernel is (N*Hv, E).
#     latent_norm_eps: the epsilon of MLA's RMSNorms of the latents.
# `bias` names MLA's projections "query" (or "query_a" and "query_b"), "key_value_a",
# "key_value_b", "output", "gate".
# `absorb_latents` (a class attribute): whether attention runs on the latents with the
# up-projections folded in (the absorbed path: True), on per-head keys and values up-projected
# from them (False), or (None) absorbed when decoding a few tokens with a cache (`_absorbs`).

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


def _latent_of(layer):
    """MLA's sizes as a `_Latent`, or None without `kv_lora_rank` (the layer's `_latent`)."""
    return None if layer.kv_lora_rank is None else _Latent(*(getattr(layer, name) for name in _LATENT_SIZES))


def _layer_projections(layer):
    """The names of the layer's projections, in the layout's order (MLA's with `kv_lora_rank`,
    the gate's with `gate`): the layer's `_projection_names`."""
    kinds = _projection_kinds(_projections(_latent_of(layer)), layer.gate)
    return tuple(kind for kind in kinds if kind not in _absent_projections(layer))  # shared keys and values


def _latent_kernel_shapes(layer):
    """{projection: its kernel's (D, F)} of MLA, in the layout's order; None without MLA."""
    if layer.kv_lora_rank is None:
        return None
    c, hn, hr, hv = layer.kv_lora_rank, layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim
    query = {"query": (layer.d_model, layer.num_heads * layer.head_dim)}
    if layer.q_lora_rank is not None:
        query = {"query_a": (layer.d_model, layer.q_lora_rank), "query_b": (layer.q_lora_rank, query["query"][1])}
    return {
        **query,
        "key_value_a": (layer.kdim, c + hr),
        "key_value_b": (c, layer.num_kv_heads * (hn + hv)),
        "output": (layer.num_heads * hv, layer.d_model),
    }


def _latent_norm_shapes(layer):
    """The shapes of MLA's RMSNorm scales of the latents by projection, `query_a` (Q,) with
    `q_lora_rank` and `key_value_a` (C,); {} without MLA."""
    if layer.kv_lora_rank is None:
        return {}
    norms = {"key_value_a": (layer.kv_lora_rank,)}
    return norms if layer.q_lora_rank is None else {"query_a": (layer.q_lora_rank,), **norms}


def _latent_cache_shapes(layer, batch_size, max_length):
    """The latent cache's shapes, `key` (B, 1, L, C) for the normalized latents and `value`
    (B, 1, L, Hr) for the rotated shared key part; None without MLA."""
    if layer.kv_lora_rank is None:
        return None
    return (batch_size, 1, max_length, layer.kv_lora_rank), (batch_size, 1, max_length, layer.qk_rope_head_dim)


def _rotate_latent(layer, q, latent, k_rope, positions):
    """Step 4 with MLA: RoPE of q's last Hr features and of the shared key part k_rope
    (B, 1, T, Hr), until the cache step (the latents are not turned). Returns q, latent, k_rope."""
    hn = layer.qk_nope_head_dim
    q = ops.concatenate([q[..., :hn], _rotate_heads(layer, q[..., hn:], positions)], axis=-1)  # (B, N, T, H)
    return q, latent, _rotate_heads(layer, k_rope, positions)


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


def _check_latent_value(key, value):
    """With MLA `value` must be None or `key` itself: MLA reads keys and values from `key`."""
    if key is not None and value is not None and value is not key:
        raise ValueError(
            "`value` must be None or `key` itself with `kv_lora_rank`: MLA reads keys and values from `key`. "
            "Received: a value other than key"
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
    c, k_rope = a[..., : layer.kv_lora_rank], a[..., layer.kv_lora_rank :]  # (B, S, C), (B, S, Hr)
    c = rms_norm(c, layer.key_value_a_norm, layer.latent_norm_eps)
    return layer._split_heads(q, layer.num_heads), c[:, None], k_rope[:, None]  # (B, N, T, H), (B, 1, S, C|Hr)


def _attend_latent(layer, q, latent, k_rope, keep, bias, call):
    """Step 6 with MLA: the (B, 1, S, C) latents and (B, 1, S, Hr) k_rope attended absorbed
    (`_attend_absorbed`, where `_absorbs` says so) or expanded into per-head keys (B, K, S, H) and
    values (B, K, S, Hv) (`_expand_latents`), through `_attend`; returns (context (B, N, T, Hv),
    weights or None)."""
    if _dtype_name(latent.dtype) in _QUANTIZED_CACHE:
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
    hn = layer.qk_nope_head_dim
    kv = layer._project(latent[:, 0], "key_value_b")  # (B, 1, S, C) -> (B, S, K*(Hn + Hv))
    kv = layer._split_heads(kv, layer.num_kv_heads, hn + layer.v_head_dim)  # (B, K, S, Hn + Hv)
    k_nope, v = kv[..., :hn], kv[..., hn:]  # (B, K, S, Hn), (B, K, S, Hv)
    k_rope = ops.broadcast_to(k_rope, (*_shape(k_nope)[:3], layer.qk_rope_head_dim))  # (B, K, S, Hr)
    return ops.concatenate([k_nope, k_rope], axis=-1), v  # (B, K, S, H), (B, K, S, Hv)


def _up_projections(layer, dtype):
    """key_value_b's kernel in `dtype` as (N, Hn, C) and (N, Hv, C) and its bias (N, Hn) and
    (N, Hv) (None without one), each key/value head's repeated for its N // K query heads; an
    int8 kernel's dequantized."""
    hn, hv, groups = layer.qk_nope_head_dim, layer.v_head_dim, layer.num_heads // layer.num_kv_heads
    kernel = ops.cast(layer.key_value_b_kernel, dtype)  # (C, K*(Hn + Hv))
    if layer._int8:
        kernel = kernel * ops.cast(layer.key_value_b_kernel_scale, dtype)  # dequantized per column
    kernel = ops.reshape(ops.transpose(kernel), (layer.num_kv_heads, hn + hv, layer.kv_lora_rank))  # (K, Hn + Hv, C)
    kernel = ops.repeat(kernel, groups, axis=0)  # (N, Hn + Hv, C)
    w_kb, w_vb = kernel[:, :hn], kernel[:, hn:]  # (N, Hn, C), (N, Hv, C)
    if "key_value_b" not in layer.bias:
        return w_kb, w_vb, None, None
    bias = ops.reshape(ops.cast(layer.key_value_b_bias, dtype), (layer.num_kv_heads, hn + hv))  # (K, Hn + Hv)
    bias = ops.repeat(bias, groups, axis=0)  # (N, Hn + Hv)
    return w_kb, w_vb, bias[:, :hn], bias[:, hn:]  # ..., (N, Hn), (N, Hv)


def _attend_absorbed(layer, q, latent, k_rope, keep, bias, call):
    """Step 6 with MLA on the latents, through `_attend` (every path): q_lat = q_nope @
    W_kb^T (B, N, T, C) meets the latents and q_rope meets k_rope (and q_nope . b_k a key of
    ones); the values are the latents (and a one, whose output is sum(weights)); each head's
    context is o_lat @ W_vb + sum(weights) * b_v (B, N, T, Hv). An int8 layer reads the
    latents quantized per token, as its int8 up-projection does (straight-through gradient)."""
    w_kb, w_vb, b_k, b_v = _up_projections(layer, q.dtype)  # (N, Hn, C), (N, Hv, C), (N, Hn), (N, Hv)
    if layer._int8:
        latent = latent + ops.stop_gradient(_quantized_rows(latent) - latent)  # (B, 1, S, C)
    q_nope, q_rope = q[..., : layer.qk_nope_head_dim], q[..., layer.qk_nope_head_dim :]  # (B, N, T, Hn|Hr)
    ones = ops.ones_like(latent[..., :1])  # (B, 1, S, 1)
    queries, keys, values = [_matmul(q_nope, w_kb), q_rope], [latent, k_rope], [latent]  # (B, N, T, C), ...
    if b_k is not None:
        queries.append(ops.sum(q_nope * b_k[:, None, :], axis=-1, keepdims=True))  # (B, N, T, 1)
        keys.append(ones)
    if b_v is not None:
        values.append(ones)
    q, k, v = (ops.concatenate(parts, axis=-1) for parts in (queries, keys, values))  # (B, N, T, .), ...
    context, weights = layer._attend(q, k, v, keep, bias, call)  # (B, N, T, C or C + 1)
    output = _matmul(context[..., : layer.kv_lora_rank], ops.swapaxes(w_vb, -1, -2))  # -> (B, N, T, Hv)
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
# first, disallowed keys last: `ops.top_k` on TensorFlow and JAX (each keeps the lower index first
# among equal values), a stable `ops.argsort` on torch (`torch.topk` promises no order for ties).
# The selection is ANDed into the call's keep, so every path of step 6 attends it. The call's
# `topk_indices` (B, T, k') passes another layer's selection instead, and `return_topk=True` returns
# the selection used. The cache holds the indexer keys in `KVCache.index_key` (B, L, Hi).
# Constructor arguments (the indexer is off while `index_topk` is None):
#     index_topk: None, or k: each query attends its k best-scored allowed keys (needs `kv_lora_rank`).
#     index_num_heads, index_head_dim: Ni and Hi (Hi >= Hr with RoPE).
#     index_rope_interleaved: False pairs feature i with i + Hr/2 (DeepSeek-V3.2), True 2i with
#         2i + 1 (GLM-MoE-DSA).
# The int8 mode leaves the indexer float.

_INDEX_SIZES = ("index_topk", "index_num_heads", "index_head_dim")
_INDEX_NORM_EPS = 1e-6  # the indexer's key LayerNorm (transformers' `k_norm`)
_INDEX_BLOCK_SCORES = 1 << 22  # the indexer's (B, Ni, Tb, S) raw scores of one block of query rows


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


def _index_shapes(layer):
    """The indexer's portable weights {name: shape} (after every other), none without `index_topk`."""
    if layer.index_topk is None:
        return {}
    ni, hi = layer.index_num_heads, layer.index_head_dim
    source = layer.d_model if layer.q_lora_rank is None else layer.q_lora_rank  # x_q: query, or the q latent
    shapes = {"index_query_norm": (source,), "index_query_norm_bias": (source,)} if layer.index_query_input_norm else {}
    shapes |= {
        "index_query_kernel": (source, ni * hi),
        "index_key_kernel": (layer.kdim, hi),
        "index_key_norm": (hi,),
        "index_key_norm_bias": (hi,),
        "index_weights_kernel": (layer.d_model, ni),
    }
    learned = layer.query_scaling is not None and layer.query_scaling["type"] == "learned"
    n = ni
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
    b, t = _shape(call.query)[:2]
    s = _shape(call.key)[1] if call.cache is None else call.cache.key.shape[2]
    if topk_indices is not None:
        selection = _check_topk_indices(topk_indices, call.query)
    else:
        ki = _index_keys(layer, call.key, call.positions)  # (B, T or S, Hi)
        if call.cache is not None:
            call = call._replace(cache=_write_index_cache(call.cache, ki))
            ki = ops.cast(call.cache.index_key, ki.dtype)  # (B, L, Hi)
        allowed = _full_keep(keep, b, t, s, call.causal, call.window, call.attention_chunk_size)  # (B, T, S)
        selection = _index_topk(layer, call, ki, allowed)  # (B, T, k)
    keep = _and(keep, _selection_keep(selection, b, t, s))  # (B|1, N|1, T, S)
    return keep, call, ops.cast(selection, "int32") if return_topk else None


def _check_topk_indices(indices, query):
    """`topk_indices` as an integer (B, T, k) tensor (dimensions unknown at trace time not checked)."""
    indices = ops.convert_to_tensor(indices)
    (b, t), shape = tuple(query.shape)[:2], tuple(indices.shape)
    if not _is_int(indices.dtype) or len(shape) != 3 or _differ(shape[0], b) or _differ(shape[1], t):
        raise ValueError(
            f"`topk_indices` must be an integer tensor of shape (B, T, k) with B={b}, T={t}. "
            f"Received: topk_indices.shape={shape}, topk_indices.dtype={_dtype_name(indices.dtype)}"
        )
    return indices


def _index_keys(layer, key, positions):
    """(B, S, kdim) -> (B, S, Hi): the indexer's keys, LayerNorm (scale and bias) and RoPE of their
    first Hr features, outside the gradient."""
    dtype = _softmax_dtype(layer.compute_dtype)  # float32 at least, float64 in a float64 layer
    ki = _matmul(ops.cast(key, dtype), ops.cast(layer.index_key_kernel, dtype))  # (B, S, kdim) -> (B, S, Hi)
    ki = layer_norm(ki, layer.index_key_norm, _INDEX_NORM_EPS, layer.index_key_norm_bias)  # (B, S, Hi)
    return ops.stop_gradient(_turn_index(layer, ki[:, None], positions)[:, 0])  # (B, 1, S, Hi) -> (B, S, Hi)


def _index_positions(call):
    """The (B|1, T) float positions of the indexer's queries: the call's RoPE positions, else i + t from the
    cache's index i before the call (the call's cache is the written one, its index i + T)."""
    if call.positions is not None:
        return ops.cast(call.positions, "float32")  # (B, T)
    t = _shape(call.query)[1]
    start = 0 if call.cache is None else ops.convert_to_tensor(call.cache.index, "int32") - t
    return ops.cast(start + ops.arange(t, dtype="int32"), "float32")[None]  # (1, T)


def _index_queries(layer, query, positions, scaling_positions):
    """(B, T, E) -> the indexer's queries qi (B, Ni, T, Hi) (their input LayerNorm-ed with
    `index_query_input_norm`, scaled by the learned scaling at (B|1, T) `scaling_positions`), their first Hr
    features turned, and the heads' weights w * Ni**-0.5 (B, T, Ni), outside the gradient."""
    dtype = _softmax_dtype(layer.compute_dtype)
    source = query if layer.q_lora_rank is None else _query_latent(layer, query)  # (B, T, E or Q)
    if layer.index_query_input_norm:
        scale, bias = ops.cast(layer.index_query_norm, dtype), ops.cast(layer.index_query_norm_bias, dtype)
        source = layer_norm(ops.cast(source, dtype), scale, _INDEX_NORM_EPS, bias)  # (B, T, E or Q)
    qi = _matmul(ops.cast(source, dtype), ops.cast(layer.index_query_kernel, dtype))  # -> (B, T, Ni*Hi)
    qi = layer._split_heads(qi, layer.index_num_heads, layer.index_head_dim)  # -> (B, Ni, T, Hi)
    if "index_query_scaling_scale" in _index_shapes(layer):
        scale, bias = layer.index_query_scaling_scale, layer.index_query_scaling_bias
        qi = qi * _learned_scales(scale, bias, ops.cast(scaling_positions, dtype), dtype)  # (B, Ni, T, Hi)
    w = _matmul(ops.cast(query, dtype), ops.cast(layer.index_weights_kernel, dtype))  # (B, T, E) -> (B, T, Ni)
    w = w * ops.convert_to_tensor(layer.index_num_heads**-0.5, dtype)
    return ops.stop_gradient(_turn_index(layer, qi, positions)), ops.stop_gradient(w)


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
    return scale_rotated(x, 2 * len(layer._inv_freq), rope_attention_factor(layer.rope_scaling))


def _write_index_cache(cache, ki):
    """The cache with the (B, T, Hi) indexer keys of the T tokens just written (positions
    [index - T, index)) at slots position mod L of `index_key`."""
    (b, t), length = _shape(ki)[:2], cache.key.shape[2]
    shape = None if cache.index_key is None else tuple(cache.index_key.shape)
    if shape is None or len(shape) != 3 or _differ(shape[1], length) or _differ(shape[2], ki.shape[2]):
        raise ValueError(
            f"`cache.index_key` must have shape (B, L, Hi)=({ki.shape[0]}, {length}, {ki.shape[2]}) with "
            f"index_topk (make the cache with `init_cache`). Received: cache.index_key.shape={shape}"
        )
    slots = ops.mod(ops.convert_to_tensor(cache.index, "int32") - t + ops.arange(t, dtype="int32"), length)  # (T,)
    rows = ops.reshape(ops.stack(ops.meshgrid(ops.arange(b, dtype="int32"), slots, indexing="ij"), -1), (-1, 2))
    index_key = ops.scatter_update(
        cache.index_key, rows, ops.reshape(ops.cast(ki, cache.index_key.dtype), (-1, shape[2]))
    )
    return cache._replace(index_key=index_key)  # (B, L, Hi) at (b, slot)


def _full_keep(keep, b, t, s, causal, window, attention_chunk_size):
    """(B, T, S): the keys each query may attend for some head: `keep` (with a cache, the cache's
    rule already in it), `causal`, `window` and the chunk."""
    allowed = ops.ones((b, t, s), "bool")
    if keep is not None:
        allowed = ops.logical_and(allowed, ops.any(keep, axis=1))  # (B|1, N|1, T|1, S|1) -> (B, T, S)
    if causal:
        allowed = ops.logical_and(allowed, causal_mask(t, s)[None])  # (B, T, S)
    return _fold_masks(allowed[:, None], window, attention_chunk_size, t, s)[:, 0]  # (B, T, S)


def _index_topk(layer, call, ki, allowed):
    """The layer's own selection (B, T, k) of k = min(index_topk, S) keys (`_select_topk`), scored in
    blocks of query rows of about `_INDEX_BLOCK_SCORES` raw scores (B, Ni, Tb, S) where the shapes
    are known at trace time, each block's scores ranked and dropped (`_loop`)."""
    qi, w = _index_queries(layer, call.query, call.positions, _index_positions(call))  # (B, Ni, T, Hi), (B, T, Ni)
    (b, _, t, _), s = tuple(qi.shape), allowed.shape[2]
    if not _known(b, t, s) or b * layer.index_num_heads * t * s <= _INDEX_BLOCK_SCORES:
        k = min(layer.index_topk, s) if _known(s) else ops.minimum(layer.index_topk, _shape(allowed)[2])
        return _select_topk(_index_scores(layer, qi, w, ki), allowed, k)
    rows = max(1, _INDEX_BLOCK_SCORES // (b * layer.index_num_heads * s))
    count, k, pad = -(-t // rows), min(layer.index_topk, s), -(-t // rows) * rows - t
    qi, w = ops.pad(qi, ((0, 0), (0, 0), (0, pad), (0, 0))), ops.pad(w, ((0, 0), (0, pad), (0, 0)))  # T padded
    allowed = ops.pad(allowed, ((0, 0), (0, pad), (0, 0)))  # (B, count*rows, S)

    def block(i, totals):
        start = i * rows
        part = (
            ops.slice(qi, (0, 0, start, 0), (b, layer.index_num_heads, rows, qi.shape[3])),
            ops.slice(w, (0, start, 0), (b, rows, w.shape[2])),
        )
        scores = _index_scores(layer, *part, ki)  # (B, Tb, S)
        return totals, (_select_topk(scores, ops.slice(allowed, (0, start, 0), (b, rows, s)), k),)

    _, (blocks,) = _loop(block, count, (), (((b, rows, k), "int32"),))  # (count, B, Tb, k)
    return ops.reshape(ops.transpose(blocks, (1, 0, 2, 3)), (b, count * rows, k))[:, :t]  # (B, T, k)


def _index_scores(layer, qi, w, ki):
    """The indexer's scores (B, T, S) of queries qi (B, Ni, T, Hi) with weights w (B, T, Ni) against
    (B, S, Hi) keys: sum_n w[n] * relu(qi[n] . ki * Hi**-0.5)."""
    dots = ops.einsum("bnth,bsh->bnts", qi, ki) * ops.convert_to_tensor(layer.index_head_dim**-0.5, qi.dtype)
    return ops.einsum("bnts,btn->bts", ops.relu(dots), w)  # (B, Ni, T, S) -> (B, T, S)


def _select_topk(scores, allowed, k):
    """The first k keys of each row ranked by score, highest first, equal scores by the lower key
    index, disallowed keys after every allowed one. (B, T, S) -> (B, T, k) int32: `ops.top_k`
    (TensorFlow's and JAX's keep the lower index first among equal values), on torch a stable
    `ops.argsort` of the negated scores."""
    ranked = ops.where(allowed, scores, float(np.finfo(keras.backend.standardize_dtype(scores.dtype)).min))
    if keras.backend.backend() == "torch":
        return ops.cast(ops.argsort(-ranked, axis=-1)[..., :k], "int32")  # (B, T, k)
    return ops.cast(ops.top_k(ranked, k, sorted=True)[1], "int32")  # (B, T, k)


def _selection_keep(selection, b, t, s):
    """(B, T, k) key indices -> (B, 1, T, S) boolean, True at the selected keys (an index outside
    [0, S) selects nothing, duplicates count once), by one scatter of B*T*k ones."""
    selection = ops.cast(selection, "int32")  # (B, T, k)
    selection = ops.where(ops.logical_and(selection >= 0, selection < s), selection, s)  # out of range: column S
    k = _shape(selection)[2]
    grid = ops.meshgrid(
        ops.arange(b, dtype="int32"), ops.arange(t, dtype="int32"), ops.arange(k, dtype="int32"), indexing="ij"
    )
    at = ops.reshape(ops.stack([grid[0], grid[1], selection], axis=-1), (-1, 3))  # (B*T*k, 3): (b, t, key)
    counts = ops.scatter_update(ops.zeros((b, t, s + 1), "int32"), at, ops.ones((b * t * k,), "int32"))  # (B, T, S + 1)
    return (counts[..., :s] > 0)[:, None]  # (B, 1, T, S)


# -------------------------------------------------------------------------------------------------
# Section: speed paths
# -------------------------------------------------------------------------------------------------
# Two paths without the weights, both with `dot_product_attention`'s numbers: `ops.dot_product_attention`
# (`_fused_attention`: SDPA on torch) with the SPEC's masks made explicit, and the memory-efficient
# path (`_chunked_attention`), a chunk of queries at a time forward (`_chunked_forward`) and backward
# (`_chunked_backward`, the flash-attention backward, which recomputes each chunk's weights), so that
# memory is linear in T and S. This file has no fused q/k/v projection.
# The layer's class attributes of this section: without `return_attention`, (B, N, T, S) score
# elements above which attention runs a chunk of queries at a time (`memory_efficient_threshold`;
# memory linear in T and S; 64 Mi float32 scores are 256 MiB), and the score elements of one chunk
# (`query_chunk_elements`, 8 MiB in float32), as in the TensorFlow file. `fused_attention`:
# whether `ops.dot_product_attention` is taken where it is exact (None: on torch only).

# `ops.dot_product_attention`'s flash_attention by backend: on torch False lets SDPA choose its kernel
# itself (flash where it can), where None has Keras check flash first by building `SDPAParams`,
# which breaks a `torch.compile` graph at every call; None elsewhere (Keras decides).
_FLASH_ATTENTION = {"torch": False}


def _fuses(layer, q, k, call, dropout):
    """Whether `_attend` takes `ops.dot_product_attention` (which cannot express soft-capping: `_attend`
    asks only without it): without the weights and dropout (which it has not), at shapes known at trace time with
    T, S > 0, not in float64 where Keras computes it in float32 (`_narrows`); where
    `fused_attention` is None, only on torch (fused SDPA; on TensorFlow and JAX's
    CPU it is the explicit formula, no faster than `dot_product_attention`)."""
    if call.return_attention or dropout or layer.fused_attention is False:
        return False
    if _narrows(q.dtype):  # the kernel would compute float64 in float32
        return False
    if not _known(*q.shape, *k.shape) or 0 in (q.shape[2], k.shape[2]):
        return False
    return layer.fused_attention or keras.backend.backend() == "torch"


def _query_chunk(layer, q, k):
    """Queries per chunk of the memory-efficient path, or None where the (B, N, T, S) scores
    are at most `memory_efficient_threshold` elements or a shape is unknown at trace time."""
    b, n, t, s = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if not _known(b, t, s) or b * n * t * s <= layer.memory_efficient_threshold:
        return None
    return max(1, min(t, layer.query_chunk_elements // (b * n * s)))


def _fused_heads(layer, q, k, v, keep, bias, call, sinks):
    """`_attend`'s fused path: the window and the attention chunk folded into `keep`, then
    `_fused_attention`; the (B, N, T, Hv) context."""
    t, s = q.shape[2], k.shape[2]
    keep = keep if call.segments is None else _and(keep, _same_documents(*call.segments))  # packed: (B, 1, T, S)
    keep = _fold_masks(keep, call.window, call.attention_chunk_size, t, s)  # (B|1, N|1, T|1, S|1)
    return _fused_attention(q, k, v, keep, bias, call.causal, layer.scale, sinks)


def _chunked_heads(layer, q, k, v, keep, bias, call, dropout, sinks):
    """`_attend`'s memory-efficient path, `_query_chunk` queries at a time, its dropout drawn from
    the Dropout's seed generator; the (B, N, T, Hv) context."""
    chunk = _query_chunk(layer, q, k)
    rate, seed = 0, None
    if dropout:
        rate, seed = layer.dropout, ops.cast(layer._dropout_layer.seed_generator.next(), "int32")
    return _chunked_attention(
        q, k, v, keep, bias, call.causal, chunk, rate, seed, **_score_modifiers(layer, call, sinks),
        segments=call.segments,
    )  # fmt: skip


def _fused_attention(q, k, v, keep, bias, causal, scale, sinks):
    """`ops.dot_product_attention` on (B, N, T, H) q and (B, K, S, H) k, v; returns the (B, N, T, H)
    context. `keep` holds the window and the attention chunk already; `causal` goes in as the
    kernel's own (top-left) `is_causal` only with nothing else masking and T == S, else into the
    mask (bottom-right). The mask is a finite additive one: a row with no key left attends every key
    inside the kernel and is set to exactly 0 after. `sinks`: see `_fused_with_sinks`. Values of
    another width than q and k (MLA's Hv) are padded to the wider one with zeros, or q and k are
    (the scores do not change), and the context is cut back to Hv."""
    t, s, h, hv = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    if h != hv:
        width = max(h, hv)
        q, k = (ops.pad(x, [[0, 0], [0, 0], [0, 0], [0, width - h]]) for x in (q, k))  # (B, N|K, T|S, width)
        v = ops.pad(v, [[0, 0], [0, 0], [0, 0], [0, width - hv]])  # (B, K, S, width)
        return _fused_attention(q, k, v, keep, bias, causal, scale, sinks)[..., :hv]  # (B, N, T, Hv)
    if sinks is not None:
        return _fused_with_sinks(q, k, v, keep, bias, causal, scale, sinks)
    is_causal = causal and keep is None and bias is None and t == s
    keep = _and(keep, causal_mask(t, s)[None, None]) if causal and not is_causal else keep  # (B|1, N|1, T, S)
    if bias is not None and keep is not None:
        bias = _centre_rows(ops.cast(bias, _softmax_dtype(q.dtype)), keep)  # (B, N, T, S), dims may be 1
    has_key = None if keep is None else ops.any(keep, axis=-1, keepdims=True)  # (B, N, T, 1), dims may be 1
    if k.shape[1] == 1 < q.shape[1]:  # one key/value head: Keras groups K > 1 heads itself, TensorFlow not K = 1
        k, v = ops.repeat(k, q.shape[1], axis=1), ops.repeat(v, q.shape[1], axis=1)  # (B, 1, S, H) -> (B, N, S, H)
    additive = _fused_mask(keep, has_key, bias, q.dtype)
    context = ops.dot_product_attention(
        ops.swapaxes(q, 1, 2), ops.swapaxes(k, 1, 2), ops.swapaxes(v, 1, 2), bias=additive, scale=scale,
        is_causal=is_causal, flash_attention=_FLASH_ATTENTION.get(keras.backend.backend()),
    )  # (B, T, N, H), the layout Keras takes  # fmt: skip
    context = ops.swapaxes(context, 1, 2)  # (B, T, N, H) -> (B, N, T, H)
    return context if has_key is None else ops.where(has_key, context, ops.zeros((), context.dtype))


def _fused_mask(keep, has_key, bias, dtype):
    """The additive mask of `_fused_attention` in `dtype` (q's, as Keras casts it), finite: `bias`
    (clamped to the dtype's range) where kept or where a row keeps nothing, its lowest value
    elsewhere; None with neither."""
    if keep is None and bias is None:
        return None
    name = keras.backend.standardize_dtype(dtype)
    lowest = _LOWEST.get(name) or _lowest(name)
    bias = ops.zeros((), dtype) if bias is None else ops.cast(ops.maximum(bias, lowest), dtype)
    if keep is None:
        return bias
    return ops.where(ops.logical_or(keep, ops.logical_not(has_key)), bias, ops.cast(lowest, dtype))


def _fused_with_sinks(q, k, v, keep, bias, causal, scale, sinks):
    """`_fused_attention` with the sinks as one more key, the first, whose score is its head's sink
    logit and whose value is 0: the softmax's denominator gains exp(sink) and the context nothing.
    The score comes from one more feature of each head, sink / scale in head n's queries and 1 in
    the sink key (0 in the other keys), so grouped heads still share their keys and the sinks'
    gradient flows through it; the head size is padded to a multiple of 8 with zeros (v too). With
    the kernel's `is_causal` one more query, the first, keeps its top-left triangle aligned: query
    t + 1 sees the sink and keys 0..t. A row with no key left attends only the sink: a context of 0."""
    (b, n, t, h), s = q.shape, k.shape[2]
    width = -(-(h + 1) // 8) * 8  # H + 1 features, padded to a multiple of 8
    logit = ops.broadcast_to(
        ops.reshape(ops.cast(ops.divide(sinks, scale), q.dtype), (1, n, 1, 1)), (b, n, t, 1)
    )  # (B, N, T, 1)
    q = ops.pad(ops.concatenate([q, logit], axis=-1), [[0, 0], [0, 0], [0, 0], [0, width - h - 1]])  # (B, N, T, width)
    sink_key = ops.broadcast_to(ops.one_hot(h, width, dtype=k.dtype), (b, k.shape[1], 1, width))  # a 1 at feature H
    k = ops.concatenate(
        [sink_key, ops.pad(k, [[0, 0], [0, 0], [0, 0], [0, width - h]])], axis=2
    )  # (B, K, 1 + S, width)
    v = ops.pad(v, [[0, 0], [0, 0], [1, 0], [0, width - h]])  # (B, K, 1 + S, width), the sink's value 0
    is_causal = causal and keep is None and bias is None and t == s
    keep = _and(keep, causal_mask(t, s)[None, None]) if causal and not is_causal else keep  # (B|1, N|1, T, S)
    q = ops.pad(q, [[0, 0], [0, 0], [1, 0], [0, 0]]) if is_causal else q  # (B, N, 1 + T, width) with `is_causal`
    keep = None if keep is None else _first_column(keep, s, True)  # (..., 1 + S)
    bias = None if bias is None else _first_column(bias, s, 0.0)  # (..., 1 + S)
    context = _fused_attention(q, k, v, keep, bias, is_causal, scale, None)  # (B, N, [1 +] T, width)
    return context[:, :, 1 if is_causal else 0 :, :h]  # (B, N, T, H)


def _first_column(mask, s, value):
    """A rank-4 mask (..., S|1) broadcast to S keys, with one more key first holding `value`."""
    mask = ops.broadcast_to(mask, (*mask.shape[:3], s))  # (B|1, N|1, T|1, S)
    return ops.concatenate([ops.full((*mask.shape[:3], 1), value, mask.dtype), mask], axis=-1)  # (..., 1 + S)


class _Chunks(NamedTuple):
    """What every chunk of `_chunked_attention` reads besides q, k, v and the inputs with a gradient."""

    keep: Any  # boolean, rank 4, its T dimension 1 or padded to T' = count * size; or None
    causal: bool
    window: Any  # None, W or (W_before, W_after)
    attention_chunk_size: int | None
    softcap: float | None
    segments: tuple | None  # packed sequences: (B, T') ids (padded) and (B, S) key ids, or None
    size: int  # queries per chunk
    count: int  # the number of chunks
    t: int  # T; causal, window and chunk are bottom-right aligned (query t at position t + S - T)
    s: int  # S
    rate: float  # dropout
    seed: Any  # (2,) int32, or None
    dtype: str  # the softmax's
    heads: tuple  # (B, N, K, G, Hv), G = N // K, Hv the values' width


def _chunked_attention(
    q, k, v, keep, bias, causal, chunk, dropout_rate=0.0, seed=None, *,
    scale=None, softcap=None, window=None, attention_chunk_size=None, sinks=None, segments=None,
):  # fmt: skip
    """`dot_product_attention` without the weights, `chunk` queries at a time, in memory linear
    in T and S: only one chunk's (B, N, chunk, S) scores exist at a time, forward and backward
    (a custom gradient recomputes them). `bias` (the floating mask and `attention_bias`) and
    `sinks` get gradients. Dropout draws its mask from `seed` (shape (2,)) and each weight's
    index (`_dropout_keep`), so the backward drops the same weights as the forward. Shapes are
    known at trace time. `segments` (packed sequences: the (B, T) and (B, S) ids) make each
    chunk's own keep of the ids, so no (B, 1, T, S) keep is made.

    Returns:
        context (B, N, T, Hv).
    """
    (b, n, t, h), kv, s = q.shape, k.shape[1], k.shape[2]
    dtype, count = _softmax_dtype(q.dtype), -(-t // chunk)
    padded = count * chunk - t
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    q = q * ops.convert_to_tensor(scale, q.dtype)  # the (B, N, T, H) queries scaled in their dtype, not the scores
    q = ops.pad(q, [[0, 0], [0, 0], [0, padded], [0, 0]])  # (B, N, T', H), T' a multiple of chunk
    bias = None if bias is None else ops.cast(bias, dtype)
    extras = {"bias": _pad_rows(bias, padded), "sinks": None if sinks is None else ops.cast(sinks, dtype)}
    extras = {name: x for name, x in extras.items() if x is not None}  # the inputs with a gradient besides q, k, v
    heads = (b, n, kv, n // kv, v.shape[3])  # the context's width is Hv, the values'
    segments = None if segments is None else (ops.pad(segments[0], [[0, 0], [0, padded]]), segments[1])  # (B, T')
    masks = (_pad_rows(keep, padded), causal, window, attention_chunk_size, softcap, segments)
    chunks = _Chunks(*masks, chunk, count, t, s, dropout_rate, seed, dtype, heads)

    @ops.custom_gradient
    def attend(q, k, v, *values):
        extra = dict(zip(extras, values, strict=True))
        constants = [ops.stop_gradient(x) for x in (q, k, v, *values)]  # an eager GradientTape records nothing
        context = _chunked_forward(chunks, *constants[:3], dict(zip(extras, constants[3:], strict=True)))

        def grad(*args, upstream=None):
            upstream = args[0] if upstream is None else upstream  # torch passes the inputs, then `upstream=`
            return _chunked_backward(chunks, q, k, v, extra, upstream)

        return context, grad

    return attend(q, k, v, *extras.values())[:, :, :t]  # (B, N, T', Hv) -> (B, N, T, Hv)


def _chunked_forward(chunks, q, k, v, extra):
    """The (B, N, T', Hv) context, one chunk of queries at a time (`_loop`)."""
    b, n, _, _, h = chunks.heads

    def one(i, totals):
        weights, _ = _dropped(chunks, _chunk_weights(chunks, q, k, i, extra)[1], i)
        context = _matmul(_grouped(chunks, ops.cast(weights, v.dtype)), v)  # (B, K, G*chunk, S) @ (B, K, S, Hv)
        return totals, (_by_head(chunks, context),)  # (B, N, chunk, Hv)

    _, (contexts,) = _loop(one, chunks.count, (), [((b, n, chunks.size, h), v.dtype)])  # (count, B, N, chunk, Hv)
    return ops.reshape(ops.transpose(contexts, (1, 2, 0, 3, 4)), (b, n, -1, h))  # -> (B, N, T', Hv)


def _chunked_backward(chunks, q, k, v, extra, d_context):
    """The gradients of q, k, v and of `extra` (`bias`, `sinks`) from the (B, N, T', H)
    `d_context`, one chunk at a time (`_chunk_gradients`): k's and v's accumulated in the softmax's
    dtype, q's and a full-row `bias`'s (its T dimension full) collected per chunk."""
    b, n, h = q.shape[0], q.shape[1], q.shape[3]
    zeros_k = ops.zeros(k.shape, chunks.dtype)  # (B, K, S, H), accumulated in float32 at least (float64 stays)
    zeros_v = ops.zeros(v.shape, chunks.dtype)  # (B, K, S, Hv)
    bias = extra.get("bias")
    bias_rows = bias is not None and bias.shape[2] != 1
    sums = {name: ops.zeros_like(x) for name, x in extra.items() if name != "bias" or not bias_rows}
    rows = [((b, n, chunks.size, h), q.dtype)]  # d q per chunk
    rows += [((*bias.shape[:2], chunks.size, bias.shape[3]), chunks.dtype)] if bias_rows else []

    def one(i, totals):
        return _chunk_gradients(chunks, q, k, v, extra, d_context, i, totals)

    (d_k, d_v, sums), stacks = _loop(one, chunks.count, (zeros_k, zeros_v, sums), rows)
    d_q = ops.reshape(ops.transpose(stacks[0], (1, 2, 0, 3, 4)), q.shape)  # (count, B, N, chunk, H) -> (B, N, T', H)
    if bias_rows:
        sums["bias"] = ops.reshape(ops.transpose(stacks[1], (1, 2, 0, 3, 4)), bias.shape)  # -> (b, n, T', S)
    return (d_q, ops.cast(d_k, k.dtype), ops.cast(d_v, v.dtype), *(sums[name] for name in extra))


def _chunk_weights(chunks, q, k, i, extra):
    """Query rows [i*size, (i+1)*size): their (B, N, size, H) queries, float weights, the
    soft-cap's tanh (or None) and their rows of `bias` (or None)."""
    size = chunks.size
    start = i * size
    q_i = _rows(q, start, size)  # (B, N, chunk, H)
    scores = _matmul(_grouped(chunks, q_i), ops.swapaxes(k, -1, -2))  # (B, K, G*chunk, H) @ (B, K, H, S)
    scores = ops.cast(_by_head(chunks, scores), chunks.dtype)  # (B, N, chunk, S)
    scores, capped = _capped_chunk(chunks, scores)  # capped: the soft-cap's tanh, kept for the backward
    positions = start + ops.arange(size, dtype="int32") + (chunks.s - chunks.t)  # (chunk,)
    keep_i = _and(_chunk_rows(chunks.keep, start, size), _position_keep(positions, chunks))  # (B, N, chunk, S)
    if chunks.segments is not None:
        ids = _rows(chunks.segments[0][:, None, :, None], start, size)  # (B, 1, chunk, 1)
        keep_i = _and(keep_i, ops.equal(ids, chunks.segments[1][:, None, None, :]))  # (B, 1, chunk, S)
    bias_i = _chunk_rows(extra.get("bias"), start, size)
    added = bias_i if bias_i is None or keep_i is None or "sinks" in extra else _centre_rows(bias_i, keep_i)
    scores = scores if added is None else scores + added  # (B, N, chunk, S)
    return q_i, _masked_softmax(scores, keep_i, extra.get("sinks")), capped, bias_i


def _chunk_gradients(chunks, q, k, v, extra, d_context, i, totals):
    """One step of `_chunked_backward`: chunk i's weights recomputed, its gradients of k, v and
    the summed extras added to `totals`; returns them and chunk i's rows of d q (and d bias)."""
    d_k, d_v, sums = totals
    q_i, weights, capped, bias_i = _chunk_weights(chunks, q, k, i, extra)
    kept, mask = _dropped(chunks, weights, i)
    d_out = _grouped(chunks, _rows(d_context, i * chunks.size, chunks.size))  # (B, K, G*chunk, H)
    kept = ops.swapaxes(_grouped(chunks, ops.cast(kept, v.dtype)), -1, -2)  # (B, K, S, G*chunk)
    d_v = d_v + ops.cast(_matmul(kept, d_out), d_v.dtype)  # (B, K, S, H)
    d_weights = ops.cast(_by_head(chunks, _matmul(d_out, ops.swapaxes(v, -1, -2))), chunks.dtype)  # (B, N, chunk, S)
    d_weights = d_weights if mask is None else d_weights * mask
    total = ops.sum(d_weights * weights, axis=-1, keepdims=True)  # (B, N, chunk, 1)
    d_scores = weights * (d_weights - total)  # the softmax's input, after the bias
    sums, bias_rows = _extra_gradients(sums, d_scores, weights, total, bias_i)
    d_scores = d_scores if capped is None else d_scores * (1 - ops.square(capped))  # d tanh
    d_scores = _grouped(chunks, ops.cast(d_scores, q.dtype))  # (B, K, G*chunk, S)
    d_k = d_k + ops.cast(_matmul(ops.swapaxes(d_scores, -1, -2), _grouped(chunks, q_i)), d_k.dtype)  # (B, K, S, H)
    d_q = _by_head(chunks, _matmul(d_scores, k))  # (B, K, G*chunk, H) -> (B, N, chunk, H)
    return (d_k, d_v, sums), (d_q, *bias_rows)


def _extra_gradients(sums, d_scores, weights, total, bias_i):
    """Chunk i's gradient of `bias`, reduced to its shape (added to its sum, or returned as rows
    when its T dimension is full), and of the sink logits (added to their sum)."""
    sums, rows = dict(sums), ()
    if bias_i is not None:
        d_bias = _reduce_to(d_scores, bias_i.shape)  # (B, N, chunk, S) -> bias_i's shape
        if "bias" in sums:
            sums["bias"] = sums["bias"] + d_bias
        else:
            rows = (d_bias,)
    if "sinks" in sums:
        sink_weight = 1 - ops.sum(weights, axis=-1, keepdims=True)  # (B, N, chunk, 1)
        sums["sinks"] = sums["sinks"] - ops.sum(sink_weight * total, axis=(0, 2, 3))  # (N,)
    return sums, rows


def _position_keep(positions, chunks):
    """(R, S) boolean for queries at `positions` (R,) over keys 0 .. S - 1 by `causal`, `window`
    and `attention_chunk_size`; None with none of them."""
    keys, queries = ops.arange(chunks.s, dtype="int32")[None, :], positions[:, None]  # (1, S), (R, 1)
    keep = keys <= queries if chunks.causal else None
    keep = keep if chunks.window is None else _and(keep, _in_window(keys, queries, chunks.window))
    size = chunks.attention_chunk_size
    return keep if size is None else _and(keep, _same_chunk(keys, queries, size))  # (R, S)


def _dropped(chunks, weights, i):
    """Chunk i's weights after dropout, and the dropout mask (None without dropout)."""
    if not chunks.rate:
        return weights, None
    mask = _dropout_keep(chunks, i * chunks.size, weights.dtype)  # (B, N, chunk, S)
    return weights * mask, mask


def _dropout_keep(chunks, start, dtype):
    """The dropout mask of query rows [start, start + size) in `dtype` (0, or 1 / (1 - rate)): a
    hash of the seed and each weight's (b, n, query, key) index in int32 arithmetic (wrapping, and
    shifting arithmetically, alike on every backend), so the same in the forward and the backward
    and whatever the chunk size."""
    b, n, _, _, _ = chunks.heads
    heads = ops.arange(b * n, dtype="int32")[:, None] * chunks.t  # (B*N, 1)
    rows = heads + start + ops.arange(chunks.size, dtype="int32")[None, :]  # (B*N, chunk)
    cells = rows[:, :, None] * chunks.s + ops.arange(chunks.s, dtype="int32")  # (B*N, chunk, S)
    mixed = _mix(ops.bitwise_xor(_mix(ops.bitwise_xor(cells, chunks.seed[0])), chunks.seed[1]))
    draws = ops.cast(ops.bitwise_and(mixed, 0x7FFFFF), "float32") / float(1 << 23)  # uniform in [0, 1)
    keep = ops.cast(draws >= chunks.rate, dtype) / (1.0 - chunks.rate)
    return ops.reshape(keep, (b, n, chunks.size, chunks.s))  # (B*N, chunk, S) -> (B, N, chunk, S)


def _mix(x):
    """MurmurHash3's 32-bit finalizer on int32 (its two constants as signed int32)."""
    x = ops.bitwise_xor(x, ops.right_shift(x, 16)) * -2048144789  # 0x85EBCA6B
    x = ops.bitwise_xor(x, ops.right_shift(x, 13)) * -1028477387  # 0xC2B2AE35
    return ops.bitwise_xor(x, ops.right_shift(x, 16))


def _grouped(chunks, x):
    b, _, kv, groups, _ = chunks.heads
    return ops.reshape(x, (b, kv, groups * chunks.size, -1))  # (B, N, chunk, X) -> (B, K, G*chunk, X)


def _by_head(chunks, x):
    b, n, _, _, _ = chunks.heads
    return ops.reshape(x, (b, n, chunks.size, -1))  # (B, K, G*chunk, X) -> (B, N, chunk, X)


def _rows(x, start, size):
    """Rows [start, start + size) of a rank-4 tensor (a dynamic slice of static size)."""
    return ops.slice(x, (0, 0, start, 0), (x.shape[0], x.shape[1], size, x.shape[3]))  # (., ., size, .)


def _chunk_rows(mask, start, size):
    """Rows [start, start + size) of a rank-4 mask whose T dimension is full; a mask with T = 1
    broadcasts and is returned as is."""
    return mask if mask is None or mask.shape[2] == 1 else _rows(mask, start, size)


def _pad_rows(mask, rows):
    """Appends `rows` kept rows (True, or 0 for a float) to the T dimension of a rank-4 mask when it is full."""
    if mask is None or mask.shape[2] == 1 or not rows:
        return mask
    fill = ops.full((mask.shape[0], mask.shape[1], rows, mask.shape[3]), _is_bool(mask) or 0, mask.dtype)
    return ops.concatenate([mask, fill], axis=2)  # (., ., T + rows, .)


def _reduce_to(gradient, shape):
    """Sums a (B, N, R, S) gradient over the dimensions it was broadcast along from `shape`."""
    axes = tuple(i for i, (d, g) in enumerate(zip(shape, gradient.shape, strict=True)) if d == 1 and g != 1)
    return ops.sum(gradient, axis=axes, keepdims=True) if axes else gradient


def _loop(step, count, totals, rows):
    """Runs `step(i, totals) -> (totals, rows_i)` for i in range(count) and returns the last totals
    and each entry of rows_i stacked, (count, *shape) for each (shape, dtype) of `rows`: by
    `ops.fori_loop` writing each row into a preallocated tensor with `ops.slice_update` (in place
    under XLA); on torch, whose `fori_loop` is a Python loop and whose `slice_update` copies the
    whole tensor, by a Python loop and one stack."""
    if keras.backend.backend() == "torch":
        written = []
        for i in range(count):
            totals, row = step(i, totals)
            written.append(row)
        return totals, tuple(ops.stack(parts) for parts in zip(*written, strict=True))

    def body(i, carry):
        totals, stacks = carry
        totals, row = step(i, totals)
        at = (i,) + (0,) * len(rows[0][0])  # (i, 0, ...)
        return totals, tuple(ops.slice_update(x, at, r[None]) for x, r in zip(stacks, row, strict=True))

    stacks = tuple(ops.zeros((count, *shape), dtype) for shape, dtype in rows)  # (count, *shape) each
    return ops.fori_loop(0, count, body, (totals, stacks))


# -------------------------------------------------------------------------------------------------
# Section: int8
# -------------------------------------------------------------------------------------------------
# Keras' scheme (docs/SPEC.md, "int8"): `keras.quantizers.abs_max_quantize` on the kernels (per
# output column, when quantizing) and on the inputs of each projection (per token, at run time).
# `layer.quantize("int8")` (or `model.quantize("int8")`) makes each kernel int8 with a float32
# `<kind>_kernel_scale` per output column (Keras' int8 `Dense` scheme).

_INT8_MAX = 127.0


_INT8_EPSILON = 1e-7  # Keras' `backend.epsilon()`, added to the abs-max before dividing


def _quantize(layer, mode, config):
    """Quantizes the projections (four, five with `gate`) to int8 as Keras'
    `Dense.quantize("int8")` does: each kernel becomes an int8 variable with one float32
    `<kind>_kernel_scale` per output column, each call quantizes the projections' inputs per
    token, and the dtype policy becomes "int8_from_<policy>". `model.quantize("int8")` calls
    it; other modes raise `NotImplementedError`, which `model.quantize` turns into a warning,
    as for any Keras layer.

    Args:
        mode: "int8".
        type_check: unused (Keras' signature).
        config: None or Keras' default `Int8QuantizationConfig`.
    """
    if mode != "int8":
        raise NotImplementedError(f"{type(layer).__name__} quantizes to 'int8' only. Received: mode={mode!r}")
    _check_int8_config(config)
    for kind in layer._projection_names:
        kernel, scale = _quantize_kernel(ops.convert_to_numpy(getattr(layer, f"{kind}_kernel").value))
        layer._untrack_variable(getattr(layer, f"{kind}_kernel"))  # Keras' `del` would run gc.collect() per kernel
        for name, value in ((f"{kind}_kernel", kernel), (f"{kind}_kernel_scale", scale)):
            options = {"initializer": "zeros", "trainable": False, "dtype": value.dtype.name, "autocast": False}
            setattr(layer, name, layer.add_weight(name=name, shape=value.shape, **options))
            getattr(layer, name).assign(value)
    layer._is_quantized = True  # Keras' flag: setting the policy below must not quantize again
    layer.dtype_policy = _int8_policy(layer.dtype_policy)


def _quantize_kernel(kernel):
    """A float (D, F) kernel -> (int8 (D, F) kernel, float32 (F,) kernel_scale), computed in float32
    with NumPy as Keras' `abs_max_quantize(kernel, axis=0, to_numpy=True)`: r = 127 / (max |column|
    + 1e-7), the integers round(kernel * r) (half to even) clipped to [-127, 127], and
    kernel_scale = 1 / r (Keras keeps r and divides by it)."""
    kernel = np.asarray(kernel, dtype=np.float32)
    ratio = np.float32(_INT8_MAX) / (np.max(np.abs(kernel), axis=0) + np.float32(_INT8_EPSILON))  # (F,)
    quantized = np.clip(np.round(kernel * ratio), -_INT8_MAX, _INT8_MAX).astype(np.int8)  # (D, F)
    return quantized, (np.float32(1.0) / ratio).astype(np.float32)


@ops.custom_gradient
def _int8_matmul(x, kernel, kernel_scale):
    """(B, L, D) @ an int8 (D, F) kernel: x quantized per token as Keras' `AbsMaxQuantizer` does
    (r = 127 / (max |token| + 1e-7), round(x * r) clipped to [-127, 127]), an int8 x int8 -> int32
    matmul, then * (1 / r) * kernel_scale, the quantizing and the scales in float32 at least
    whatever x's dtype (in float16 r of a zero token and a sum of 64 products overflow), the result
    cast to x's dtype. The gradient of `x` goes through the dequantized kernel (Keras'
    straight-through gradient); the kernel and its (float32) scale get none."""
    dtype = _softmax_dtype(x.dtype)  # float32 at least
    wide = ops.cast(x, dtype)  # (B, L, D)
    largest = ops.max(ops.abs(wide), axis=-1, keepdims=True, initial=0.0)  # (B, L, 1); `initial`: L may be 0
    ratio = _INT8_MAX / (largest + _INT8_EPSILON)  # (B, L, 1)
    quantized = ops.cast(ops.clip(ops.round(wide * ratio), -_INT8_MAX, _INT8_MAX), "int8")  # (B, L, D)
    accumulated = ops.matmul(quantized, kernel)  # (B, L, D) @ (D, F) -> int32 (B, L, F)
    y = ops.cast(ops.cast(accumulated, dtype) * ((1.0 / ratio) * ops.cast(kernel_scale, dtype)), x.dtype)  # (B, L, F)

    def grad(*args, upstream=None):
        upstream = args[0] if upstream is None else upstream  # torch passes it by name, after the inputs
        dequantized = ops.cast(kernel, x.dtype) * ops.cast(kernel_scale, x.dtype)  # (D, F)
        return _matmul(upstream, ops.transpose(dequantized)), None, None  # (B, L, F) -> (B, L, D)

    return y, grad


def _quantized_rows(x):
    """x quantized per token as `_int8_matmul` quantizes its input (in float32 at least), and
    dequantized: round(x * r) / r, r = 127 / (max |x| + 1e-7) over the last axis, the integers
    clipped to [-127, 127]; in x's dtype."""
    wide = ops.cast(x, _softmax_dtype(x.dtype))  # float16: r of a zero row overflows
    largest = ops.max(ops.abs(wide), axis=-1, keepdims=True, initial=0.0)  # (..., 1); `initial`: a dim may be 0
    ratio = _INT8_MAX / (largest + _INT8_EPSILON)  # (..., 1)
    return ops.cast(ops.clip(ops.round(wide * ratio), -_INT8_MAX, _INT8_MAX) * (1.0 / ratio), x.dtype)


def _check_quantize_args(layer, mode, compute_dtype):
    """Keras' checks before `quantize` (a built layer, not quantized yet, a known mode) without its
    refusal of a float16 compute dtype (float16, `mixed_float16`): Keras' int8 `Dense` casts the
    int32 sums to float16, which overflows, while `_int8_matmul` scales them in float32."""
    wide = "float32" if compute_dtype == "float16" else compute_dtype
    super(MultiHeadAttention, layer)._check_quantize_args(mode, wide)


# The int8 and fp8 KV caches (docs/SPEC.md, "KV-cache decoding"): each slot's key and value of each
# head (with MLA its latent and its turned key part) stored as int8 (absmax / 127) or float8_e4m3fn
# (absmax / 448) with one float32 scale, computed in float32. The attention reads the integers (fp8
# values) a block of slots at a time, each slot's key scale multiplied into its scores and its value
# scale into its weights: no float copy of the cache.
_QUANTIZED_CACHE_BLOCK = 1 << 20  # cache elements cast to float at once by `_attend_quantized`
_FP8_MAX = 448.0  # float8_e4m3fn's largest finite value (no infinities)
_QUANTIZED_CACHE = ("int8", "float8_e4m3fn")  # the cache dtypes that hold scales


def _quantize_cache_rows(x, dtype="int8"):
    """(..., D) keys or values -> (int8 integers, or with `dtype` float8_e4m3fn fp8 values (..., D),
    float32 scale (..., 1)), in float32: scale = max |x| / 127 (fp8: / 448) over D; the integers
    round(x / scale) (half to even) clipped to [-127, 127], the fp8 values x / scale clipped to
    [-448, 448] and cast (round to nearest even; the backends' casts differ above 464: NaN or
    448); a row whose scale is 0 stores scale 0 and zeros."""
    x, dtype = ops.cast(x, "float32"), _dtype_name(dtype)
    top = _INT8_MAX if dtype == "int8" else _FP8_MAX
    largest = ops.max(ops.abs(x), axis=-1, keepdims=True)  # (..., 1)
    scale = largest / (largest * 0 + top)  # (..., 1); XLA would multiply by 1 / top, a constant, rounding apart
    divisor = ops.where(scale == 0, ops.ones_like(scale), scale)  # (..., 1); x is 0 (or below `top` subnormals) there
    if dtype != "int8":
        return ops.cast(ops.clip(x / divisor, -_FP8_MAX, _FP8_MAX), dtype), scale  # (..., D), (..., 1)
    integers = ops.clip(ops.round(x / divisor), -_INT8_MAX, _INT8_MAX)  # (..., D), half to even
    return ops.cast(integers, "int8"), scale


def _with_cache_scales(cache):
    """An int8 or fp8 cache's zero scales (B, K, L, 1), one per slot and head, for its keys and values."""
    key_scale = ops.zeros((*cache.key.shape[:3], 1), "float32")  # (B, K, L, 1)
    return cache._replace(key_scale=key_scale, value_scale=ops.zeros((*cache.value.shape[:3], 1), "float32"))


def _check_quantized_cache(cache):
    """An int8 (fp8) cache: int8 (float8_e4m3fn) keys and values, float32 scales (B, K, L, 1) beside them."""
    kind = _dtype_name(cache.key.dtype)
    for name in ("key", "value"):
        field, scale = getattr(cache, name), getattr(cache, f"{name}_scale")
        shape, dtype = (*tuple(field.shape)[:3], 1), _dtype_name(field.dtype)
        if dtype != kind or scale is None or _dtype_name(scale.dtype) != "float32" or tuple(scale.shape) != shape:
            received = None if scale is None else (_dtype_name(scale.dtype), tuple(scale.shape))
            raise ValueError(
                f"{'An' if kind == 'int8' else 'A'} {kind} `cache` must hold {kind} `{name}` and a float32 "
                f"`{name}_scale` of shape {shape}; make it with `init_cache(..., dtype='{kind}')`. "
                f"Received: cache.{name}.dtype={dtype}, cache.{name}_scale={received}"
            )


def _write_quantized_cache(cache, k, v, key_mask):
    """`_write_cache` for an int8 or fp8 cache: the new (B, K, T, H) keys and values quantized
    (`_quantize_cache_rows`), their integers (fp8 values) written to `key` and `value` and their
    scales to `key_scale` and `value_scale` by `_write_cache` itself (keep and index written twice,
    the same both times). The fp8 values are written by a gather (`_gathered_write`): TensorFlow
    has no fp8 scatter outside XLA, and one rule serves every backend."""
    kind = _dtype_name(cache.key.dtype)
    (k_int, k_scale), (v_int, v_scale) = (_quantize_cache_rows(x, kind) for x in (k, v))
    if kind == "int8":
        ints = _write_cache(KVCache(cache.key, cache.value, cache.keep, cache.index), k_int, v_int, key_mask)
    else:
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
    t, length = _shape(new)[2], field.shape[2]
    slots = ops.arange(length, dtype="int32")  # (L,)
    offset = ops.mod(slots - ops.convert_to_tensor(index, "int32"), length)  # (L,), the t landing in each slot
    last = offset + length * ops.floor_divide(t - 1 - offset, length)  # (L,), the last such t (where offset < T)
    source = ops.where(offset < t, length + last, slots)  # (L,), the slot or the new token it takes
    return ops.take(ops.concatenate([field, new], axis=2), source, axis=2)  # (B, K, L + T, H) -> (B, K, L, H)


def _dequantize_cache(cache, k, v, dtype):
    """MLA over an int8 or fp8 cache: its (B, 1, L, C) and (B, 1, L, Hr) integers (fp8 values)
    times their scales, in float32, cast to the compute `dtype` (MLA's attention makes per-step keys
    of the whole cache anyway: the absorbed keys, or the expanded heads)."""
    k = ops.cast(k, "float32") * cache.key_scale  # (B, 1, L, C)
    v = ops.cast(v, "float32") * cache.value_scale  # (B, 1, L, Hr)
    return ops.cast(k, dtype), ops.cast(v, dtype)


def _attend_quantized(layer, q, k, v, keep, bias, call):
    """Step 6 over an int8 or fp8 cache: q (B, N, T, H), its (B, K, L, H) integers (fp8 values) k
    and v, without a float copy of the cache: a block of slots at a time, the integers cast to float, each slot's key
    scale multiplied into its scores after q . k and its value scale into its weights before
    weights . v (exact algebra), the explicit softmax between, in float32 at least (the cache
    step folded causal, window and chunk into `keep`). Returns (context (B, N, T, H), weights
    (B, N, T, L))."""
    (b, n, t, h), (heads, length, hv) = _shape(q), (k.shape[1], _shape(k)[2], v.shape[3])
    dtype = "float64" if _dtype_name(q.dtype) == "float64" else "float32"
    matmul = _matmul if dtype == "float64" else ops.matmul  # float64 kept where Keras would narrow it
    sinks = layer.sink_logits if layer.sinks else None
    k_scale, v_scale = (
        ops.cast(ops.swapaxes(x, -1, -2), dtype) for x in (call.cache.key_scale, call.cache.value_scale)
    )
    step = max(1, _QUANTIZED_CACHE_BLOCK // ((q.shape[0] or 1) * heads * h))  # slots per block
    spans = [(i, i + step) for i in range(0, length, step)] if isinstance(length, int) else [(0, None)]
    grouped = ops.reshape(ops.cast(q, dtype) * layer.scale, (b, heads, -1, h))  # (B, N, T, H) -> (B, K, G*T, H)
    blocks = [matmul(grouped, ops.swapaxes(ops.cast(k[:, :, i:j], dtype), -1, -2)) for i, j in spans]
    scores = ops.reshape(ops.concatenate(blocks, axis=-1) * k_scale, (b, n, t, length))  # (B, N, T, L)
    scores = _capped_scores(layer, scores)
    if bias is not None:
        bias = ops.cast(bias, dtype)
        scores = scores + (bias if keep is None or sinks is not None else _centre_rows(bias, keep))  # (B, N, T, L)
    weights = _masked_softmax(scores, keep, sinks)  # (B, N, T, L)
    dropout = layer.dropout > 0 and call.training is not False and call.training is not None
    used = layer._dropout_layer(weights, training=call.training) if dropout else weights
    used = ops.reshape(used, (b, heads, -1, length)) * v_scale  # (B, N, T, L) -> (B, K, G*T, L)
    context = sum(matmul(used[..., i:j], ops.cast(v[:, :, i:j], dtype)) for i, j in spans)  # (B, K, G*T, H)
    context = ops.reshape(context, (b, n, t, hv))  # (B, K, G*T, H) -> (B, N, T, H)
    context = _nan_if_misfit(layer, q, k, call, ops.cast(context, q.dtype))  # a trace cannot raise
    return context, ops.cast(weights, q.dtype)


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


def _int8_policy(policy):
    """The dtype policy of `policy` quantized to int8: Keras' "int8_from_<policy>", or where the
    compute dtype is float16 (float16, `mixed_float16`) the same policy as an
    `_Int8FromFloat16Policy`, since Keras' own refuses float16."""
    if policy.compute_dtype == "float16":
        return _Int8FromFloat16Policy("int8", policy.name)
    return f"int8_from_{policy.name}"


@keras.saving.register_keras_serializable(package="MultiHeadAttentionKeras")
class _Int8FromFloat16Policy(keras.dtype_policies.QuantizedDTypePolicy):
    """Keras' `QuantizedDTypePolicy` "int8_from_float16" (or "int8_from_mixed_float16") without
    its refusal of float16: `_int8_matmul` sums and scales in float32, so the int8 layer
    computes in float16 as in any other dtype. Registered, so a `.keras` file that holds it loads."""

    def _check_quantization_mode(self, mode, compute_dtype):
        super()._check_quantization_mode(mode, "float32" if compute_dtype == "float16" else compute_dtype)


def _unquantized_policy(policy):
    """A quantized dtype policy's source ("int8_from_float32" -> "float32"): the Dropout sublayer
    computes in floats, and a quantized policy would send it to Keras' `quantized_call`."""
    name = getattr(policy, "name", policy)
    return name.partition("_from_")[2] if isinstance(name, str) and "_from_" in name else policy


# -------------------------------------------------------------------------------------------------
# Section: framework only
# -------------------------------------------------------------------------------------------------
# Keras backends: dtypes and shapes (float64 kept where Keras' type promotion would narrow it,
# dimensions unknown at trace time), the values of masks read where it is free; and many devices:
# `layer.layout_map(mesh)` gives the `keras.distribution.LayoutMap` entries that split the layer's
# heads over a mesh axis, for `ModelParallel` on JAX (docs/distributed.md).


def _narrows(dtype):
    """Whether Keras' type promotion computes `dtype` in a narrower one: float64 in float32 on
    every backend but TensorFlow (it follows JAX's default, 64-bit off), in `ops.matmul`,
    `ops.dot_product_attention`, `ops.mean` and `ops.maximum`."""
    name = keras.backend.standardize_dtype(dtype)
    return keras.backend.result_type(name, name) != name


def _mean(x):
    """The mean over the last axis, kept, in x's dtype: `ops.mean` computes float64 in float32
    where Keras narrows it (`_narrows`)."""
    if _narrows(x.dtype):
        return ops.sum(x, axis=-1, keepdims=True) / x.shape[-1]  # (..., D) -> (..., 1)
    return ops.mean(x, axis=-1, keepdims=True)  # (..., D) -> (..., 1)


def _mask_alias(args, kwargs, mask):
    """`__call__`'s `mask=`: moved into `kwargs["attention_mask"]` (with a positional fourth input
    or `attention_mask`, `_attention_mask` refuses both); returns the positional inputs left."""
    given = kwargs.pop("attention_mask", args[3] if len(args) > 3 else None)
    kwargs["attention_mask"] = _attention_mask(given, mask)
    return args[:3]


def _output_spec(layer, *args, **kwargs):
    """`compute_output_spec`: builds the layer if needed, then traces `call` as Keras does."""
    if not layer.built:
        layer.build()
    return super(keras.layers.Layer, layer).compute_output_spec(*args, **kwargs)


def _dtype_name(dtype):
    return keras.backend.standardize_dtype(dtype)


def _is_float(dtype):
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype))


def _is_int(dtype):
    return keras.backend.is_int_dtype(keras.backend.standardize_dtype(dtype))


def _is_bool(x):
    return _dtype_name(x.dtype) == "bool"


def _lowest(dtype):
    """The lowest finite value of a float32 or float64 dtype (the softmax's)."""
    return float(np.finfo(keras.backend.standardize_dtype(dtype)).min)


def _shape(x):
    """The shape of x, static where known; a dimension unknown at trace time (TensorFlow) as a tensor."""
    static = tuple(x.shape)
    if None not in static:
        return static
    dynamic = ops.shape(x)
    return tuple(dynamic[i] if d is None else d for i, d in enumerate(static))


def _static_shape(x):
    return tuple(x.shape)


def _known(*dims):
    """Whether every dimension is known at trace time: an int (not None, not JAX's symbolic
    dimension of a functional model's shape inference)."""
    return all(isinstance(d, int) for d in dims)


def _differ(*dims):
    """Whether the known dimensions (None: unknown at trace time) differ."""
    known = {d for d in dims if d is not None}
    return len(known) > 1


def _shape_tuple(shape):
    """A shape (tuple, list) as a tuple, or None where it or its rank is unknown."""
    if shape is None:
        return None
    try:
        return tuple(None if d is None else int(d) for d in shape)
    except TypeError:  # a shape of unknown rank
        return None


def _read_values(*tensors):
    """The tensors' values as NumPy arrays (None stays None) where reading them is free, else None:
    eagerly, on the CPU, not inside a TensorFlow graph, `jax.jit` or another JAX trace,
    `torch.compile`, nor for a symbolic Keras tensor or a tensor on an accelerator. NumPy arrays
    always can. Nothing can while Keras infers a functional model's shapes (its symbolic scope: on
    torch it calls the layer on placeholder tensors, an unknown dimension made 83 or 89, whose
    values say nothing of the real call's). Read the backend's own way: `ops.convert_to_numpy`
    calls `np.array` on a torch or TensorFlow tensor, whose `__array__` makes NumPy 2 warn (a
    DeprecationWarning: an error where warnings are)."""
    from keras.src.backend import in_symbolic_scope  # Keras' own flag; no public API says it

    if in_symbolic_scope():
        return None
    backend, values = keras.backend.backend(), []
    for x in tensors:
        if x is None or isinstance(x, np.ndarray):
            values.append(None if x is None else np.asarray(x))
        elif isinstance(x, keras.KerasTensor):
            return None
        elif backend == "tensorflow":
            import tensorflow as tf  # the backend in use, already imported by Keras

            if not (tf.executing_eagerly() and "CPU" in x.device.upper()):
                return None
            values.append(x.numpy())
        elif backend == "jax":  # a tracer (jax.jit, grad) holds no values; its class says so, no jax import needed
            if any(kind.__name__.endswith("Tracer") for kind in type(x).__mro__):
                return None
            if not all(d.platform == "cpu" for d in x.devices()):
                return None
            values.append(np.asarray(x))
        elif backend == "torch":
            import torch  # the backend in use, already imported by Keras

            if torch.compiler.is_compiling() or x.device.type != "cpu":
                return None
            x = x.detach()
            values.append((x.float() if x.dtype == torch.bfloat16 else x).numpy())  # NumPy has no bfloat16
        else:
            return None
    return values


# `layout_map`: per axis of each portable weight, the heads laid along it ("N": the query heads,
# "K": the key/value heads), split over the model axis of a device mesh; None: not split. A
# weight's `<name>_scale` (int8) is split as its kernel's columns; a weight missing here is a
# KeyError in `layout_map`, so each new weight needs its line.
_HEAD_AXES = {
    "query_kernel": (None, "N"),
    "query_bias": ("N",),
    "key_kernel": (None, "K"),
    "key_bias": ("K",),
    "value_kernel": (None, "K"),
    "value_bias": ("K",),
    "output_kernel": ("N", None),
    "output_bias": (None,),
    "query_norm": ("N",),  # (N*H,) with qk_norm "per_head" or "all"; the (H,) of "head" is shared
    "key_norm": ("K",),
    "query_norm_bias": ("N",),
    "key_norm_bias": ("K",),
    "sinks": ("N",),
    "gate_kernel": (None, "N"),
    "gate_bias": ("N",),
    "context_norm": ("N",),  # (N*Hv,): the output norm's, over every head
    "context_norm_bias": ("N",),
    "query_a_kernel": (None, None),  # MLA: the latents are shared by every head
    "query_a_bias": (None,),
    "query_a_norm": (None,),
    "query_b_kernel": (None, "N"),
    "query_b_bias": ("N",),
    "key_value_a_kernel": (None, None),
    "key_value_a_bias": (None,),
    "key_value_a_norm": (None,),
    "key_value_b_kernel": (None, "K"),
    "key_value_b_bias": ("K",),
}


def _layout_map(layer, mesh, model_axis, layout_map):
    """The `keras.distribution.LayoutMap` entries of this layer's weights, for `ModelParallel`:
    the heads split over the mesh axis `model_axis`, each device holding whole heads.

    The query, key and value kernels are split by their columns (the heads), the output
    kernel by its rows and each bias, QK-norm scale (per head or over all heads), sink and
    int8 scale as its projection; `output_bias` and the QK-norm's (H,) scales of
    `qk_norm="head"` are replicated. With `num_kv_heads=1` (MQA) the key and value
    projections are replicated: each device computes the one key/value head its query heads
    share. Each entry's key is the regex `(.*/)?<layer name>/<weight name>`, matched in full
    against `variable.path`: the variables are named as the portable weights (docs/SPEC.md,
    "Weights"; `sinks` included), directly under the layer's name. Layers of equal names get
    one entry when they need the same layouts (a ValueError when they differ). The layouts
    apply to the variables created under the distribution (`distribution.scope()`); the KV
    cache of `init_cache` is not a variable: put its key and value on the mesh split by
    heads (axis 1), as in docs/distributed.md.

    Args:
        mesh: a `keras.distribution.DeviceMesh`.
        model_axis: the name of the mesh axis the heads are split over; its size must divide
            `num_heads`, and `num_kv_heads` unless that is 1.
        layout_map: a `LayoutMap` on `mesh` to add the entries to; a new one if None.

    Returns:
        The `LayoutMap`, for `keras.distribution.ModelParallel(layout_map=...)`.

    Example, 4 heads over the 2 devices of a "model" axis:
        >>> mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices=["cpu:0", "cpu:1"])
        >>> layout_map = MultiHeadAttention(16, 4, name="attention").layout_map(mesh)
        >>> layout_map["attention/query_kernel"].axes, layout_map["block/attention/output_kernel"].axes
        ((None, 'model'), ('model', None))
    """
    layout_map, devices = _mesh_layout_map(mesh, model_axis, layout_map)
    _check_head_split(layer, devices, model_axis)
    split = {"N": True, "K": layer.num_kv_heads > 1}  # MQA: the one key/value head on every device
    for name in layer.weight_shapes():
        axes = tuple(model_axis if split.get(heads) else None for heads in _head_axes(layer, name))
        key = f"(.*/)?{_regex_literal(layer.name)}/{name}"
        if key not in tuple(layout_map):  # `in` would match the key against every regex
            layout_map[key] = axes
        elif layout_map[key].axes != axes:
            raise ValueError(
                f"`layout_map` already lays out '{key}' as {layout_map[key].axes}, this layer needs {axes}: "
                "give layers of different configurations different names. "
                f"Received: a layer named {layer.name!r}"
            )
    return layout_map


def _head_axes(layer, name):
    """The table entry of one portable weight (`_HEAD_AXES`): per axis, "N", "K" or None."""
    if name.endswith("_kernel_scale"):
        return _HEAD_AXES[name.removesuffix("_scale")][1:]
    if layer.qk_norm == "head" and name in ("query_norm", "key_norm", "query_norm_bias", "key_norm_bias"):
        return (None,)
    return _HEAD_AXES[name]


def _check_head_split(layer, devices, model_axis):
    """Whole heads on each of `devices`: N divisible by them, and K unless it is 1."""
    kv = layer.num_kv_heads > 1 and layer.num_kv_heads % devices
    if layer.num_heads % devices == 0 and not kv:
        return
    common = layer.num_heads if layer.num_kv_heads == 1 else math.gcd(layer.num_heads, layer.num_kv_heads)
    sizes = [str(d) for d in range(1, common + 1) if common % d == 0]
    sizes = " or ".join([", ".join(sizes[:-1]), sizes[-1]] if len(sizes) > 1 else sizes)
    raise ValueError(
        f"The size of the mesh axis '{model_axis}' must divide `num_heads`, and `num_kv_heads` unless it is 1 "
        "(MQA: the key/value projections are replicated), so that each device holds whole heads. "
        f"Received: num_heads={layer.num_heads}, num_kv_heads={layer.num_kv_heads}, a '{model_axis}' axis of "
        f"{devices} devices. Use a '{model_axis}' axis of {sizes} devices (the others on a batch axis)"
    )


def _mesh_layout_map(mesh, model_axis, layout_map):
    """`layout_map`'s arguments checked: the `LayoutMap` to fill and the size of `model_axis`."""
    if not isinstance(mesh, keras.distribution.DeviceMesh):
        raise ValueError(f"`mesh` must be a keras.distribution.DeviceMesh. Received: mesh={mesh!r}")
    if model_axis not in mesh.axis_names:
        raise ValueError(
            f"`model_axis` must be an axis of `mesh`, one of {tuple(mesh.axis_names)}. "
            f"Received: model_axis={model_axis!r}"
        )
    if layout_map is None:
        layout_map = keras.distribution.LayoutMap(mesh)
    elif not isinstance(layout_map, keras.distribution.LayoutMap) or layout_map.device_mesh is not mesh:
        raise ValueError(f"`layout_map` must be a LayoutMap on `mesh`. Received: layout_map={layout_map!r}")
    return layout_map, mesh.shape[list(mesh.axis_names).index(model_axis)]


def _regex_literal(text):
    """`text` as a regex that matches it alone (`re.escape`, for a layer's name)."""
    return "".join(c if c.isalnum() or c == "_" else f"\\{c}" for c in text)


# The layer's plumbing: the call's record, its results, the constructor's argument types
# (docs/SPEC.md, "Argument types": Python types, as Keras' configs hold them), the weights'
# initializers and options, the shapes Keras passes to `build`.


class _Call(NamedTuple):
    """One call's arguments, checked and defaulted by `_check_call`; the cache step replaces
    `causal`, `window`, `attention_chunk_size` and `cache`."""

    query: Any  # (B, T, E), cast to the compute dtype
    key: Any  # (B, S, kdim)
    value: Any  # (B, S, vdim)
    attention_mask: Any  # None, or checked and rank 4 (dims may be 1), after the `mask=` alias
    attention_bias: Any  # None, or checked floating and rank 4 (dims may be 1)
    key_mask: Any  # (B, S) boolean or None: after the self-attention default and the implicit Keras masks
    query_mask: Any  # (B, T) boolean or None: ANDed with the query's implicit Keras mask
    positions: Any  # (B|1, T) integers, (k, B|1, T) with `rope_sections`, or None without RoPE
    causal: bool
    window: Any  # the layer's window, or None
    attention_chunk_size: Any  # the layer's attention_chunk_size, or None
    return_attention: bool
    cache: Any  # KVCache or None
    training: Any  # the call's training flag
    fuse: bool  # q, k, v from one matmul: never in this file
    segmented: bool = False  # packed sequences: the ids folded into attention_mask (`_packed`)
    segments: tuple | None = None  # packed sequences without a cache: (B, T) and (B, S) ids, ANDed in by `_attend`
    selection: None = None  # PyTorch only: the sparse indexer's gathered route (here always a keep)


def _check_lengths(query, key, value):
    q, k, v = (tuple(x.shape) for x in (query, key, value))
    if _differ(q[0], k[0], v[0]):
        raise ValueError(
            "`query`, `key` and `value` must have the same batch size B. Received: "
            f"query.shape={q}, key.shape={k}, value.shape={v}"
        )
    if _differ(k[1], v[1]):
        raise ValueError(f"`key` and `value` must have the same length S. Received: key.shape={k}, value.shape={v}")


def _softmax_dtype(dtype):
    """Softmax runs in float32 at least (float64 stays float64)."""
    return "float64" if keras.backend.standardize_dtype(dtype) == "float64" else "float32"


class _Variants(NamedTuple):
    """The variants' constructor arguments, checked and held as Python types (docs/SPEC.md,
    "Argument types"); each is off at its default."""

    scale: float  # 1 / sqrt(H) when None was passed
    softcap: Any  # None or float
    window: Any  # None, an int or a pair (before, after) of ints
    attention_chunk_size: Any  # None or int
    rope_theta: Any  # None or float
    rope_fraction: float
    rope_interleaved: bool
    rope_scaling: Any  # None or a dict of Python scalars
    rope_sections: Any  # None or a tuple of ints
    qk_norm: Any  # None, "head", "per_head" or "all"
    qk_norm_eps: float
    qk_norm_type: str  # "rms" or "layer"
    qk_norm_bias: bool
    sinks: bool
    clip_qkv: Any  # None or float
    gate: bool
    latent_norm_eps: float


def _check_variants(
    modifiers, rope_width, rope_theta, rope_fraction, rope_interleaved, rope_scaling, rope_sections, qk_norm,
    qk_norm_eps, qk_norm_type, qk_norm_bias, sinks, clip_qkv, gate, latent_norm_eps,
):  # fmt: skip
    """Checks the variants' arguments after the score modifiers (`modifiers`, checked first by
    `_check_score_modifiers`), each on its own whether its variant is on or off, in the
    signature's order with the flags last (so that every file names the same first bad
    argument); returns them all as a `_Variants`. RoPE turns features of heads `rope_width` wide
    (H, or Hr with MLA)."""
    rope_theta = _positive_float("rope_theta", rope_theta, optional=True)
    rotary_dim = _rotary_dim(rope_fraction, rope_width, rope_theta is not None)
    rope_scaling = _check_rope_scaling(rope_scaling)
    rope_sections = _check_rope_sections(rope_sections, rotary_dim)
    if qk_norm not in (None, "head", "per_head", "all"):
        raise ValueError(f"`qk_norm` must be None, 'head', 'per_head' or 'all'. Received: qk_norm={qk_norm!r}")
    qk_norm = None if qk_norm is None else str(qk_norm)  # np.str_ held as str
    qk_norm_eps = _positive_float("qk_norm_eps", qk_norm_eps)
    if not isinstance(qk_norm_type, str) or qk_norm_type not in ("rms", "layer"):
        raise ValueError(f"`qk_norm_type` must be 'rms' or 'layer'. Received: qk_norm_type={qk_norm_type!r}")
    clip_qkv = _positive_float("clip_qkv", clip_qkv, optional=True)
    latent_norm_eps = _positive_float("latent_norm_eps", latent_norm_eps)
    rope_interleaved = _flag("rope_interleaved", rope_interleaved)
    qk_norm_bias = _flag("qk_norm_bias", qk_norm_bias)
    sinks = _flag("sinks", sinks)
    gate = _flag("gate", gate)
    return _Variants(
        *modifiers, rope_theta, float(rope_fraction), rope_interleaved, rope_scaling, rope_sections, qk_norm,
        qk_norm_eps, str(qk_norm_type), qk_norm_bias, sinks, clip_qkv, gate, latent_norm_eps,
    )  # fmt: skip


def _positive_int(name, value):
    if not _is_positive_int(value):
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


def _is_positive_int(value):
    """A Python or NumPy integer (not a bool) >= 1."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value >= 1


def _is_positive_number(value):
    number = not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, float, np.integer, np.floating))
    return number and math.isfinite(value) and value > 0


def _positive_float(name, value, optional=False):
    """A positive float; None stays None when `optional`."""
    if optional and value is None:
        return None
    if not _is_positive_number(value):
        raise ValueError(
            f"`{name}` must be {'None or ' if optional else ''}a positive float. Received: {name}={value!r}"
        )
    return float(value)


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


def _initializer(layer, name):
    """Kernels and biases from the layer's initializers; QK-norm scales of one, QK-norm biases
    and sinks of zero; the learned query scaling's scales zero and biases one (each factor 1)."""
    if name.endswith(("_norm", "_scaling_bias")):
        return keras.initializers.Ones()
    if name == "sinks" or name.endswith(("_norm_bias", "_scaling_scale")):
        return keras.initializers.Zeros()
    initializer = layer.kernel_initializer if name.endswith("_kernel") else layer.bias_initializer
    return initializer.__class__.from_config(initializer.get_config())  # a fresh instance for each weight


def _weight_options(layer, name):
    """`add_weight` arguments of one portable weight: int8 kernels and their float scales are
    not trainable (as in Keras' int8 `Dense`)."""
    if layer._int8 and name.endswith("_kernel") and not _is_indexer_weight(name):
        return {"initializer": "zeros", "dtype": "int8", "trainable": False}
    if name.endswith("_kernel_scale"):  # read in float32 under a mixed policy too (`_int8_matmul`)
        return {"initializer": "ones", "dtype": "float32", "trainable": False, "autocast": False}
    return {"initializer": _initializer(layer, name)}


def _check_shapes(layer, query_shape, value_shape, key_shape):
    """Shapes given to `build` or `compute_output_shape`, checked as the call checks its
    inputs (the same messages); returns the query's shape. A missing key or value shape is the
    other one's, as in the call; with neither, they are unknown."""
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


# -------------------------------------------------------------------------------------------------
# Section: converters
# -------------------------------------------------------------------------------------------------
# `from_keras` and `to_keras`: the weights of `keras.layers.MultiHeadAttention` and
# `keras.layers.GroupQueryAttention`, and what they cannot hold.
# Coming from `keras.layers.MultiHeadAttention`: it is called `(query, value, key)`, this layer
# `(query, key, value)`. A floating `attention_mask` is added to the scores here, where Keras
# reads a 0/1 float mask as boolean: pass `mask > 0`. `use_causal_mask=True` is `causal=True`
# (bottom-right aligned when T < S); `return_attention_scores=True` is `return_attention=True`.
# Then the portable layout of the weights (`weight_shapes`: `query_kernel` (E, N*H), `query_bias`
# (N*H,), `key_kernel` (kdim, K*H), ..., `output_kernel` (N*H, E), `output_bias` (E,), then each
# option's) and Keras' config.


def _from_keras(cls, layer, window):
    """Builds a layer with the weights of a built `keras.layers.MultiHeadAttention` or
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
        kernel = ops.convert_to_numpy(sublayer.kernel)  # with LoRA, the merged kernel
        rows = kernel.shape[0] * kernel.shape[1] if kind == "output" else kernel.shape[0]
        weights[f"{kind}_kernel"] = kernel.reshape(rows, -1)  # heads flattened as h * H + d
        if new.bias:
            weights[f"{kind}_bias"] = ops.convert_to_numpy(sublayer.bias).reshape(-1)
    new.import_weights(weights)
    return new


def _to_keras(layer):
    """Returns a built `keras.layers.MultiHeadAttention` (K == N) or
    `keras.layers.GroupQueryAttention` (K < N) holding these weights.

    Keras' GroupQueryAttention takes any key and value widths, but its
    `compute_output_shape` refuses a value width other than the query's, so with
    vdim != d_model it runs eagerly but not on symbolic inputs (a functional model).
    """
    _check_keras_can_hold(layer)
    common = dict(
        dropout=layer.dropout, use_bias=bool(layer.bias), kernel_initializer=layer.kernel_initializer,
        bias_initializer=layer.bias_initializer, dtype=layer.dtype_policy, use_gate=layer.gate,
    )  # fmt: skip
    widths = (layer.d_model, layer.vdim, layer.kdim)  # query, value, key: the built-ins' call order
    if layer.num_kv_heads == layer.num_heads:
        builtin = keras.layers.MultiHeadAttention(layer.num_heads, layer.head_dim, **common)
    else:
        builtin = keras.layers.GroupQueryAttention(layer.head_dim, layer.num_heads, layer.num_kv_heads, **common)
    builtin.build(*((None, None, width) for width in widths))
    builtin.trainable = layer.trainable
    weights = layer.export_weights()
    dense = (builtin._query_dense, builtin._key_dense, builtin._value_dense, builtin._output_dense)
    dense += (builtin._gate_dense,) if layer.gate else ()
    for kind, sublayer in zip(_projection_kinds(_PROJECTIONS, layer.gate), dense, strict=True):
        sublayer.kernel.assign(weights[f"{kind}_kernel"].reshape(sublayer.kernel.shape))
        if layer.bias:
            sublayer.bias.assign(weights[f"{kind}_bias"].reshape(sublayer.bias.shape))
    return builtin


def _non_defaults(layer):
    """`MultiHeadAttention._non_defaults`: what the Keras built-ins cannot hold."""
    plain = {
        "bias": layer.bias in ((), layer._projection_names),
        **_score_modifiers_at_default(layer),  # scale, softcap, window, attention_chunk_size
        "rope_theta": layer.rope_theta is None,
        "rope_sections": layer.rope_sections is None or layer.rope_theta is None,
        "rope_sections_interleaved": not layer.rope_sections_interleaved or layer.rope_sections is None,
        "qk_norm": layer.qk_norm is None,
        "qk_norm_type": layer.qk_norm_type == "rms" or layer.qk_norm is None,
        "qk_norm_bias": not layer.qk_norm_bias or layer.qk_norm is None,
        "sinks": not layer.sinks,
        "clip_qkv": layer.clip_qkv is None,
        "gate": not layer.gate,
        "gate_activation": layer.gate_activation == "sigmoid" or not layer.gate,
        **{name: getattr(layer, name) is None for name in _LATENT_SIZES},
        "query_scaling": layer.query_scaling is None,
        **{name: not getattr(layer, name) for name in _SHARING_FLAGS},
        "index_topk": layer.index_topk is None,
        "index_query_input_norm": not layer.index_query_input_norm,
        "output_norm": layer.output_norm is None,
        "qk_norm_after_rope": not layer._qk_norm_late,
    }
    return {name: getattr(layer, name) for name, default in plain.items() if not default}


def _check_keras_can_hold(layer):
    """Refuses, naming them, the variants of docs/SPEC.md that the Keras built-ins cannot hold."""
    held = {name: value for name, value in layer._non_defaults().items() if name != "gate"}  # use_gate holds it
    if held:
        received = ", ".join(f"{name}={value!r}" for name, value in held.items())
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
    """(N, K, H) of a `keras.layers.MultiHeadAttention` (read from its config)."""
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
    if not isinstance(layer, (keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention)):
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
    read_heads = _group_query_heads if isinstance(layer, keras.layers.GroupQueryAttention) else _multi_head_heads
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


def _weight_shapes(layer):
    """The portable layout: {name: shape}, in its order; a projection's bias only when `bias`
    names it, the norm scales only with `qk_norm` (and their biases with `qk_norm_bias`),
    `sinks` only with `sinks=True`, the gate's kernel (and bias) after them with `gate=True`.
    With MLA, the latent projections and their norm scales (`query_a_norm` with `q_lora_rank`,
    `key_value_a_norm`) replace query, key and value (`_latent_kernel_shapes`)."""
    nh, kh = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    kernels = _latent_kernel_shapes(layer) or {
        "query": (layer.d_model, nh),
        "key": (layer.kdim, kh),
        "value": (layer.vdim, kh),
        "output": (nh, layer.d_model),
    }
    kernels = {kind: shape for kind, shape in kernels.items() if kind not in _absent_projections(layer)}
    norms = _latent_norm_shapes(layer)  # {} without MLA
    gate = {"gate": (layer.d_model, kernels["output"][0])} if layer.gate else {}  # (E, N*Hv)
    shapes = {}
    for kind, shape in kernels.items():
        shapes[f"{kind}_kernel"] = shape
        if kind in layer.bias:
            shapes[f"{kind}_bias"] = shape[1:]
        if kind in norms:
            shapes[f"{kind}_norm"] = norms[kind]
    if layer.qk_norm is not None:
        shapes["query_norm"] = (layer.head_dim,) if layer.qk_norm == "head" else (nh,)
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
    """Loads portable weights; strict and atomic (a ValueError lists every problem). An int8
    layout (with `<kind>_kernel_scale`) quantizes a float layer first; an int8 layer takes only one."""
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
        variable.assign(ops.cast(np.asarray(weights[name]), variable.dtype))


_CONFIG_NAMES = (
    "d_model", "num_heads", "num_kv_heads", "head_dim", "kdim", "vdim", "dropout", "bias", *_Variants._fields[:-1],
    *_LATENT_SIZES, "latent_norm_eps", "kernel_initializer", "bias_initializer", "query_scaling", "kv_shared",
    "keys_as_values", "value_norm", *_INDEX_SIZES, "index_rope_interleaved", "index_query_input_norm",
    "rope_sections_interleaved", "output_norm", "output_norm_eps", "qk_norm_after_rope", "gate_activation",
)  # get_config's entries past the base layer's, in the constructor's order  # fmt: skip


def _config(layer):
    """`get_config`'s entries past the base layer's (`_CONFIG_NAMES`), as JSON holds them: `bias`
    True where it names every projection, else its list (or False); a pair `window` and
    `rope_sections` as lists; `vdim` None with MLA (its values come from `key`); the initializers
    serialized."""
    config = {name: getattr(layer, name) for name in _CONFIG_NAMES}
    config["bias"] = True if layer.bias == layer._projection_names else bool(layer.bias) and list(layer.bias)
    config["vdim"] = None if _latent_of(layer) is not None else layer.vdim
    config["window"] = list(layer.window) if isinstance(layer.window, tuple) else layer.window
    config["rope_sections"] = None if layer.rope_sections is None else list(layer.rope_sections)
    config["kernel_initializer"] = keras.initializers.serialize(layer.kernel_initializer)
    config["bias_initializer"] = keras.initializers.serialize(layer.bias_initializer)
    config["query_scaling"] = None if layer.query_scaling is None else dict(layer.query_scaling)
    return config
