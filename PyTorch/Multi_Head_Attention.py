"""Multi-head attention for PyTorch: one `nn.Module`, proven equal to the TensorFlow layer.

Copy this one file into your model; it needs only torch, NumPy and the standard library.

Legend (every shape comment in this file uses these letters):
    B: batch size          T: query length        S: key/value length
    E: d_model             N: num_heads           K: num_kv_heads
    H: head_dim            L: slots of a KV cache (its maximum length)
    MLA only: C kv_lora_rank, Q q_lora_rank, Hn qk_nope_head_dim, Hr qk_rope_head_dim, Hv v_head_dim

The math, for query head n (which reads key/value head n // (N // K)):
    q = query @ query_kernel + query_bias                       (B, T, N*H)
    k = key @ key_kernel + key_bias                             (B, S, K*H)
    v = value @ value_kernel + value_bias                       (B, S, K*H)
    scores[n] = q[n] @ k[n // G]^T * scale + float_mask         (B, N, T, S), G = N // K, scale = 1 / sqrt(H)
    weights = softmax(scores where kept, else lowest finite)    zeroed where not kept
    context[n] = weights[n] @ v[n // G]                         (B, N, T, H)
    gate = sigmoid(query @ gate_kernel + gate_bias)             (B, T, N*H), with `gate` only
                                                                (softplus with gate_activation="softplus")
    output = concat_heads(context * gate) @ output_kernel + output_bias

Where things are: first the core, the plain layer: the functions a plain call enters (`_sdpa_attention`
among them), then `MultiHeadAttention`, whose `forward` reads as the steps of docs/SPEC.md ("Order of
the steps"), each option's step behind a one-line guard; then one section per option family,
each with its checks, weights, steps and fast paths, in this order: score modifiers (scale,
soft-capping, window, chunk, sinks, ALiBi, the masks, segment ids and the attention bias,
`dot_product_attention`), positions (RoPE), QK-norm, clip_qkv and the gate, KV cache and decode
steps, multi-head latent attention (MLA), speed paths, int8, framework only (tensor parallelism,
autocast, hooks, mask habits), converters (portable weights, nn.MultiheadAttention).
"""

import itertools
import math
import sys
import warnings
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

__all__ = ["AttentionMaskWarning", "Int8Linear", "KVCache", "MultiHeadAttention", "alibi_bias", "document_positions"]
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


def _check_input(name, x, dim_name, dim):
    """Checks one (B, L, dim) floating input."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"`{name}` must be a floating tensor. Received: {name} of type {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"`{name}` must be a floating tensor. Received: {name}.dtype={_dtype_name(x.dtype)}")
    if x.dim() != 3 or x.shape[-1] != dim:
        letter = "T" if name == "query" else "S"
        raise ValueError(
            f"`{name}` must have shape (B, {letter}, {dim_name}) with {dim_name}={dim}. "
            f"Received: {name}.shape={tuple(x.shape)}"
        )
    return x


def _plain_linear(module, kind=nn.Linear):
    """Whether `module` computes exactly F.linear(x, weight, bias) (`_int8_linear` for Int8Linear):
    a `kind` itself (not a subclass, LoRA wrapper, quantized or FSDP2-sharded module) with no hooks
    of its own (`_own_hooks`: tensor parallelism, pruning) nor for every module (`_global_hooks`)."""
    if type(module) is not kind:
        return False
    own = module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    state = torch.nn.modules.module
    every = state._global_forward_hooks or state._global_forward_pre_hooks or state._global_backward_hooks
    return not (own or every or state._global_backward_pre_hooks)


def _sdpa_attention(q, k, v, keep, bias, dropout, scale, is_causal=False, sinks=None):
    """SDPA with a finite additive mask (`is_causal`: no mask and T == S), rows with no key left 0."""
    if sinks is not None:
        return _sdpa_with_sinks(q, k, v, keep, bias, dropout, scale, is_causal, sinks)
    if v.shape[-1] < q.shape[-1]:  # MLA's narrower values (its section)
        return _sdpa_narrow_values(q, k, v, keep, bias, dropout, scale, is_causal)
    masked, gqa = keep is not None or bias is not None, False
    if q.shape[1] != k.shape[1]:  # grouped heads
        k, v, gqa = _sdpa_heads(q, k, v, masked)
    options = {"dropout_p": dropout, "scale": scale, "enable_gqa": gqa}
    if not masked:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, **options)
    additive = torch.zeros((), dtype=q.dtype, device=q.device) if bias is None else _in_dtype(bias, q.dtype)
    if keep is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=additive, **options)
    has_key = keep.any(dim=-1, keepdim=True)  # (B, N, T, 1), dims may be 1
    additive = torch.where(keep | ~has_key, additive, torch.finfo(q.dtype).min)  # (B, N, T, S), dims may be 1
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, **options)
    return torch.where(has_key, context, 0.0)  # (B, N, T, H), rows with no key are all 0


class MultiHeadAttention(nn.Module):
    """Multi-head attention (MHA, grouped-query GQA and multi-query MQA) as an `nn.Module`.

    Args:
        d_model: E, the width of `query` and of the output.
        num_heads: N, the number of query heads.
        num_kv_heads: K, the number of key/value heads; must divide N. Defaults to N.
        head_dim: H, the width of one head. Defaults to E // N (then N must divide E).
        kdim, vdim: the widths of `key` and `value`. Default to E.
        dropout: probability of dropping attention weights in training mode; 0 <= p < 1.
        bias: True (all the projections have a bias, the gate's with `gate`), False (none), or a
            list, tuple or set of the names of those that have one, among "query", "key", "value",
            "output", "gate" (Qwen2: ("query", "key", "value")), kept as that tuple in that order.
        scale: the factor of the scores, scores = (q . k) * scale. Defaults to 1 / sqrt(H).
        softcap: None or c > 0: the scaled scores become c * tanh(scores / c) (Gemma 2).
        window: None, W or (W_before, W_after): query t keeps key s only if s > t + (S - T) -
            W_before (and s < t + (S - T) + W_after): Mistral's sliding window, ModernBERT's band.
        attention_chunk_size: None or C: query t keeps key s only if s // C == (t + (S - T)) // C.
        rope_theta: None (no RoPE) or the base of rotary position embeddings (Llama: 10000.0).
        rope_fraction: in (0, 1]: the first R = int(H * rope_fraction) features of each head turn.
        rope_interleaved: False pairs feature i with i + R/2 (Llama), True 2i with 2i + 1 (GPT-J).
        rope_scaling: None or a `transformers` rope_scaling dict: "linear", "llama3", "yarn" or "proportional".
        rope_sections: None or the numbers of pairs (summing to R/2) that turn by each row of
            (k, B, T) `positions` (Qwen2-VL's multimodal RoPE).
        rope_sections_interleaved: if True, the sections' pairs are dealt in turn (Qwen3-VL's
            `mrope_interleaved`): pair i by row i % k while i < k * rope_sections[i % k], else row 0.
        qk_norm: None, "head" (one scale for every head: Qwen3), "per_head" (StableLM) or "all"
            (over all heads: OLMo2): q and k normalized by the weights `query_norm`, `key_norm`.
        qk_norm_eps, qk_norm_type, qk_norm_bias: that norm's epsilon, "rms" or "layer" (LayerNorm),
            and if True a learned bias after its scale (`query_norm_bias`, `key_norm_bias`: Phi).
        sinks: if True, one learned logit per query head (the parameter `sinks`, (N,)), an extra
            term in the softmax's denominator (gpt-oss); rows then sum to less than 1.
        clip_qkv: None or c > 0: q, k and v clamped to [-c, c] after their projections (OLMo).
        gate: if True, each head's result times sigmoid(query @ gate_kernel + gate_bias) before
            the heads are merged (Keras' `use_gate`, Qwen3-Next); the `nn.Linear` `gate`.
        gate_activation: "sigmoid" (default) or "softplus" (Laguna): the gate's function of its projection.
        kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: multi-head
            latent attention (MLA, DeepSeek-V2/V3): None or C, the latent's width; None (a plain
            query projection) or Q; Hn and Hr, the features RoPE does not and does turn (H =
            Hn + Hr); Hv, a value head's width (Section: multi-head latent attention).
        latent_norm_eps: the epsilon of MLA's RMSNorms of the latents.
        index_topk, index_num_heads, index_head_dim, index_rope_interleaved: the sparse indexer (DSA,
            with MLA): each query attends its top-k keys by the indexer's Ni heads of width Hi.
        index_query_input_norm: if True, the indexer's queries read a LayerNorm of their input (Mistral Large 4).
        device, dtype: device and dtype of the parameters.
        query_scaling: None, or {"type": "temperature" or "positions", "beta": b, "floor": f}: each
            query row times 1 + b * ln(1 + floor(p / f)) (Llama 4's temperature tuning, Mistral 4's
            `llama_4_scaling_beta`), or {"type": "learned"}: query head n times s_n * ln(1 + p) + b_n,
            learned (Mistral Large 4's `softmax_scaling`; Section: positions).
        kv_shared: if True, the layer has no key or value projections: every call takes another
            layer's keys and values through `shared_kv` (Gemma 3n's and Gemma 4's shared layers).
        keys_as_values: if True, no value projection: v is the key projection before QK-norm and RoPE (Gemma 4).
        value_norm: if True, each value head is RMS-normalized without a scale (eps `qk_norm_eps`; Gemma 3n, 4).
        output_norm, output_norm_eps: None, "rms" or "layer": a norm of the merged heads before the output
            projection (weights `context_norm`, and `context_norm_bias` with "layer"; BitNet, Kosmos-2).
        qk_norm_after_rope: if True, QK-norm normalizes q and k after RoPE instead of before (HunYuan).

    Call arguments:
        query: (B, T, E), or unbatched (T, E).
        key: (B, S, kdim). Defaults to `value`, or to `query` if `value` is None too.
        value: (B, S, vdim). Defaults to `key`. `query`, `key` and `value` share one dtype.
        attention_mask: boolean (True = attend, unlike nn.MultiheadAttention) or floating (added
            to the scores; at most the lowest of float32 or of its dtype, or -inf, removes a key),
            of shape (T, S), (B, T, S) or (B, N, T, S), any dimension of which may be 1.
        key_mask: (B, S) boolean, True for a real key; in self-attention defaults to `query_mask`.
            With `cache`, (B, T): ANDed into the cache's `keep` where written.
        query_mask: (B, T) boolean, True for a real query (others get weights 0).
        attention_bias: floating, broadcasts like `attention_mask`; added to the scores, with a
            gradient (T5's relative position bias, ALiBi from `alibi_bias`).
        positions: integer (B, T) or (T,) RoPE positions, or (k, B, T) with `rope_sections`;
            default arange(T) (+ the cache index).
        causal: if True, query t attends key s only if s <= t + (S - T).
        return_attention: if True, also return the per-head attention weights.
        cache: a `KVCache` from `init_cache`: decode T new tokens (`key` and `value`, if given,
            hold the same T tokens); masks and weights are then over the L slots.
        mask: another name for `attention_mask`; giving both is a ValueError. Masks whose values
            read like another library's convention warn once per layer (`AttentionMaskWarning`).
        shared_kv: with `kv_shared`, a (k, v) pair of (B, K, S, H) keys and values another layer
            attended (its `return_kv`), or that layer's `KVCache` once it wrote this call's T tokens.
        return_kv: if True, also return the (k, v) the call attended (over the L slots with a cache).
        topk_indices, return_topk: another layer's (B, T, k) selection to attend; return the one used.

    Returns:
        output (B, T, E), or (output, weights) with weights (B, N, T, S) (per head, before
        dropout) when `return_attention` is True; with `cache`, the updated cache is appended
        and weights are (B, N, T, L), exactly 0 at unwritten slots. A query row with no key left
        has weights of exactly 0 (its output is `output_bias`). Unbatched inputs, unbatched results.
        With `return_kv`, the (k, v) pair is appended last; a shared cache is read, not returned.

    Example, a key padding mask (the third key of the first sequence is padding):
        >>> layer = MultiHeadAttention(16, 4)
        >>> x = torch.randn(2, 3, 16)  # (B, T, E)
        >>> keep = torch.tensor([[True, True, False], [True, True, True]])  # (B, S)
        >>> out, weights = layer(x, key_mask=keep, return_attention=True)
        >>> tuple(out.shape), tuple(weights.shape)
        ((2, 3, 16), (2, 4, 3, 3))
        >>> bool((weights[0, :, :, 2] == 0).all())
        True
    """

    def __init__(
        self, d_model, num_heads, *, num_kv_heads=None, head_dim=None, kdim=None, vdim=None, dropout=0.0,
        bias=True, scale=None, softcap=None, window=None, attention_chunk_size=None, rope_theta=None,
        rope_fraction=1.0, rope_interleaved=False, rope_scaling=None, rope_sections=None, qk_norm=None,
        qk_norm_eps=1e-6, qk_norm_type="rms", qk_norm_bias=False, sinks=False, clip_qkv=None, gate=False,
        kv_lora_rank=None, q_lora_rank=None, qk_nope_head_dim=None, qk_rope_head_dim=None, v_head_dim=None,
        latent_norm_eps=1e-6, device=None, dtype=None, query_scaling=None, kv_shared=False, keys_as_values=False,
        value_norm=False, index_topk=None, index_num_heads=None, index_head_dim=None, index_rope_interleaved=False,
        index_query_input_norm=False, rope_sections_interleaved=False, output_norm=None, output_norm_eps=1e-6,
        qk_norm_after_rope=False, gate_activation="sigmoid",
    ):  # fmt: skip
        super().__init__()
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
        self.dropout = _dropout_rate(dropout)
        names = _projections(latent)  # the names `bias` takes
        self.bias = _projection_biases(bias, gate, names)
        rope_width = self.head_dim if latent is None else latent.qk_rope_head_dim
        variants = _check_variants(
            self.head_dim, rope_width, scale, softcap, window, attention_chunk_size, rope_theta, rope_fraction,
            rope_interleaved, rope_scaling, rope_sections, qk_norm, qk_norm_eps, qk_norm_type, qk_norm_bias, sinks,
            clip_qkv, gate, latent_norm_eps,
        )  # fmt: skip
        if latent is not None:
            _check_latent_combinations(vdim, variants)
            self.vdim = self.kdim  # the values come from `key`
        self.scale, self.softcap, self.window = variants.scale, variants.softcap, variants.window
        self.attention_chunk_size, self.rope_sections = variants.attention_chunk_size, variants.rope_sections
        self.rope_theta, self.rope_fraction = variants.rope_theta, variants.rope_fraction
        self.rope_interleaved, self.rope_scaling = variants.rope_interleaved, variants.rope_scaling
        self.qk_norm, self.qk_norm_eps = variants.qk_norm, variants.qk_norm_eps
        self.qk_norm_type, self.qk_norm_bias = variants.qk_norm_type, variants.qk_norm_bias
        self.clip_qkv, self.latent_norm_eps = variants.clip_qkv, variants.latent_norm_eps
        self.absorb_latents = None  # MLA: None (absorbed with a cache and T <= 8), True or False
        self._projections = _projection_kinds(names, variants.gate)  # the layer's projections
        self.query_scaling = _check_query_scaling(query_scaling, self.rope_sections)  # its section: positions
        _check_sharing(self, latent, kv_shared, keys_as_values, value_norm)  # self.kv_shared, ... (their section)
        self._rotary_dim = _rotary_dim(self.rope_fraction, rope_width, self.rope_theta is not None)  # None: no RoPE
        _make_weights(self, latent, variants.sinks, variants.gate, {"device": device, "dtype": dtype})
        _make_query_scaling(self)  # learned query scales (positions)
        _init_indexer(self, index_topk, index_num_heads, index_head_dim, index_rope_interleaved, index_query_input_norm)
        self.rope_sections_interleaved = _flag("rope_sections_interleaved", rope_sections_interleaved)  # positions
        _init_norm_options(self, output_norm, output_norm_eps, qk_norm_after_rope)  # section: QK-norm
        self.gate_activation = _check_gate_activation(gate_activation)  # its section: the gate
        self._warned_traps, self._fused = set(), None  # mask habits warned of; q/k/v kernels kept (no_grad)
        self.reset_parameters()

    def forward(
        self, query, key=None, value=None, attention_mask=None, *, key_mask=None, query_mask=None,
        attention_bias=None, positions=None, causal=False, return_attention=False, cache=None, mask=None,
        segment_ids=None, key_segment_ids=None, shared_kv=None, return_kv=False, topk_indices=None, return_topk=False,
    ):  # fmt: skip
        cache = cache if shared_kv is None else _shared_cache(self, query, cache, shared_kv)  # rewound to check
        bare = key is None and value is None and attention_mask is None and mask is None and attention_bias is None
        bare = bare and key_mask is None and query_mask is None and not return_attention and cache is not None
        call, fast = _decode_step(self, query, positions, causal, cache) if bare else (None, None)  # fast path
        if call is None:
            call = self._check_call(
                query, key, value, attention_mask, key_mask, query_mask, attention_bias, positions, causal,
                return_attention, cache, mask,
            )  # 1. defaults and checks  # fmt: skip
        call = call if segment_ids is None is key_segment_ids else _packed(self, call, segment_ids, key_segment_ids)
        masks = (call.attention_mask, call.attention_bias, call.key_mask, call.query_mask)
        keep, bias = self._masks(call) if any(m is not None for m in masks) else (None, None)  # 1. keep and bias
        latent, own = self._latent, not self._sharing  # MLA (its section) takes steps 2, 4 and 6 its own way
        if latent is None:  # 2. (B, N, T, H), (B, K, S, H) x 2; with the sharing options 2 to 4 (their section)
            q, k, v = self._project_qkv(call, fast) if own else _project_sharing(self, call, shared_kv)
        else:
            q, k, v = _project_latent(self, call)  # 2. and 4. MLA: q, the latents and the turned k_rope
        if self.clip_qkv is not None and own:
            q, k, v = _clip(self, q), _clip(self, k), _clip(self, v)  # 2. clamped
        if self.qk_norm is not None and own and not self._qk_norm_late:
            q, k = _normalize_qk(self, q, k)  # 3. QK-norm (in step 4 after RoPE with `qk_norm_after_rope`)
        if self.query_scaling is not None or (self.rope_theta is not None and latent is None and own):
            q, k = _position_step(self, q, k, call, latent is None and own)  # 4. RoPE (MLA's: step 2), 4b. query scales
        if call.cache is not None:
            k, v, keep, call = _update_cache(self, call, k, v, keep, fast)  # 5. KV cache (may fold causal, window...)
        sparse = (topk_indices, return_topk) if self.index_topk or topk_indices is not None or return_topk else ()
        keep, call, selection = _sparse_keep(self, q, k, keep, call, *sparse) if sparse else (keep, call, None)  # 5b.
        if latent is None:  # 6. (B, N, T, H), (B, N, T, S) or None; an int8 cache: `_cache_attend`
            context, weights = (_cache_attend(self, k) if call.cache else self._attend)(q, k, v, keep, bias, call)
        else:
            context, weights = _attend_latent(self, q, k, v, keep, bias, call)  # 6. MLA: expanded or absorbed
        if self.gate is not None:
            context = _gate_heads(self, call, context)  # 6b. output gate
        merged = self._merge_heads(context)  # (B, N, T, H) -> (B, T, N*H)
        merged = merged if self.output_norm is None else _normalize_context(self, merged)  # 7. the output norm
        output = self._project(merged, "output") if fast is None else F.linear(merged, *fast[1])  # 7. (B, T, E)
        if call.cache is not None and fast is None and torch.compiler.is_compiling():  # no room: NaN (cannot raise)
            output = _no_room_as_nan(self, call, output)
        if isinstance(query, torch.Tensor) and query.dim() == 2:  # unbatched: drop B
            output, weights = output[0], None if weights is None else weights[0]
        cache = call.cache if not self.kv_shared else None  # a shared cache is not returned
        if call.return_attention or cache is not None or return_kv or selection is not None:
            return _results(output, weights, cache, call.return_attention, (k, v) if return_kv else None, selection)
        return output

    def _check_call(
        self, query, key, value, attention_mask, key_mask, query_mask, attention_bias, positions, causal,
        return_attention, cache, mask,
    ):  # fmt: skip
        """Step 1: the call's defaults and checks as a `_Call` (unbatched inputs: a batch of one)."""
        attention_mask = attention_mask if mask is None else _attention_mask(attention_mask, mask)
        given = (attention_mask, attention_bias, key_mask, query_mask, positions)
        if any(x is not None and not isinstance(x, torch.Tensor) for x in given):  # lists, NumPy arrays
            attention_mask, attention_bias, key_mask, query_mask, positions = _as_tensors(query, given)
        if isinstance(query, torch.Tensor) and query.dim() == 2:  # unbatched: (L, D) -> (1, L, D)
            query, key, value, key_mask, query_mask = _batch_of_one(query, key, value, key_mask, query_mask)
        self_attention = key is None and value is None  # what key_mask defaults by (SPEC: key and value left out)
        one_input = (key is None or key is query) and (value is None or value is query)  # may fuse the projections
        key = value if key is None else key  # the missing inputs: only `key` or only `value` gives both,
        key = query if key is None else key  # neither gives self-attention on `query`
        value = key if value is None else value
        if self._latent is not None and value is not key:
            _refuse_latent_value()  # MLA reads keys and values from `key`
        query = _check_input("query", query, "E", self.d_model)
        if not (key is query and value is query and self.kdim == self.vdim == self.d_model):  # else checked once
            key, value = _check_key_value(self, query, key, value)
        compute_dtype = self._compute_dtype(query)
        if query.dtype != compute_dtype:
            _check_compute_dtype(query, compute_dtype)  # outside autocast a ValueError
        (b, t), s = query.shape[:2], key.shape[1]
        if cache is not None:
            _check_cache_call(self, cache, query, key, compute_dtype, self._latent)
        if query_mask is not None:  # query_mask first, as in the other files
            _check_token_mask("query_mask", query_mask, b, t, "T")
        if key_mask is not None:
            _check_token_mask("key_mask", key_mask, b, s, "S")
        if positions is not None or self.rope_theta is not None:
            positions = _positions(self, positions, query, key, cache)
        if cache is None and (attention_mask is not None or key_mask is not None):
            _warn_traps(self, attention_mask, key_mask, t, s)
        key_mask = query_mask if key_mask is None and self_attention else key_mask  # (B, S)
        return _Call(
            query, key, value, attention_mask, attention_bias, key_mask, query_mask, positions, causal, self.window,
            self.attention_chunk_size, return_attention, cache, None,
            one_input and (cache is None or _keeps_kernels()) and self._latent is None,  # a step: kept kernels only
        )  # fmt: skip

    def _compute_dtype(self, query):
        """The dtype q, k and v are computed in: autocast's, else the output projection's weight's."""
        if query.device.type != "meta" and torch.is_autocast_enabled(query.device.type):  # `_autocast_enabled`
            return torch.get_autocast_dtype(query.device.type)
        weight = self.output.weight if type(self.output) is nn.Linear else None  # the plain case, read directly
        weight = weight if weight is not None and weight.is_floating_point() else _float_weight(self)
        return query.dtype if weight is None else weight.dtype

    def _masks(self, call):
        """Step 1: every mask -> one boolean keep and one additive bias in the softmax's dtype, both
        broadcasting to (B, N, T, S) (S: the cache's L when decoding), or None. With a cache the
        `key_mask` goes into the cache's keep instead (step 5)."""
        key_mask = call.key_mask if call.cache is None else None
        keep = None if key_mask is None else key_mask[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
        if call.query_mask is not None:
            keep = _and(keep, call.query_mask[:, None, :, None])  # (B, T) -> (B, 1, T, 1)
        if call.attention_mask is None and call.attention_bias is None:
            return keep, None
        (b, t), s = call.query.shape[:2], call.key.shape[1] if call.cache is None else call.cache.key.shape[2]
        target = (b, self.num_heads, t, s)
        mask_keep, mask_add = _split_mask(call.attention_mask, target)
        bias_keep, bias_add = _split_bias(call.attention_bias, target)
        keep = _and(_and(mask_keep, bias_keep), keep)
        dtype = torch.promote_types(self._compute_dtype(call.query), torch.float32)
        bias = _add(*(None if x is None else x.to(dtype) for x in (mask_add, bias_add)))
        if mask_add is not None and bias_add is not None:
            bias = bias.clamp(min=torch.finfo(dtype).min)  # two penalties may add up past the lowest value
        return keep, bias

    def _project_qkv(self, call, fast=None):
        """Step 2: q (B, N, T, H), k and v (B, K, S, H), in one matmul where exact (`_project_fused`)."""
        if fast is not None:  # the decode fast path: the kept q/k/v kernels (`_decode_step`)
            return self._project_fused(call.query, fast[0])  # (B, T, E) -> (B, N, T, H), 2 x (B, K, T, H)
        projections = (self.query, self.key, self.value)
        kind = Int8Linear if type(self.query) is Int8Linear else nn.Linear
        fuse = call.fuse and all(_plain_linear(projection, kind) for projection in projections)
        if fuse and kind is nn.Linear:  # weights of a tensor subclass may not concatenate (torchao, DTensor)
            weights = [projection.weight for projection in projections]
            fuse = all(type(w) in (nn.Parameter, torch.Tensor) for w in weights) or _concatenable(weights)
        if fuse:
            q, k, v = self._project_fused(call.query)  # (B, T, E) -> (B, N, T, H), 2 x (B, K, T, H)
        else:
            q = self._split_heads(self._project(call.query, "query"), self.num_heads)  # (B, T, E) -> (B, N, T, H)
            k = self._split_heads(self._project(call.key, "key"), self.num_kv_heads)  # (B, S, kdim) -> (B, K, S, H)
            v = self._split_heads(self._project(call.value, "value"), self.num_kv_heads)  # (B, S, vdim) -> (B, K, S, H)
        if (q.shape[1], k.shape[1]) != (self.num_heads, self.num_kv_heads):  # tensor parallelism: a share of heads
            _check_local_heads(self, q, k, call.attention_mask, call.attention_bias)
        return q, k, v

    def _project_fused(self, x, kernels=None):
        """Self-attention: q, k and v from one matmul over the projections' weights, biases and int8
        scales concatenated, kept under no_grad while the weights are unchanged (`_kept_fused`)."""
        version = None
        if kernels is None and not torch.is_grad_enabled():
            version, kernels = _kept_fused(self, x)  # (weights' version, kept kernels or None)
        if kernels is None:
            projections = (self.query, self.key, self.value)
            weight = torch.cat([p.weight for p in projections])  # (N*H + 2*K*H, E), int8 for Int8Linear
            biases = [x.new_zeros(p.out_features) if p.bias is None else p.bias for p in projections]  # layer dtype
            bias = None if all(p.bias is None for p in projections) else torch.cat(biases)  # (N*H + 2*K*H,)
            int8 = isinstance(self.query, Int8Linear)
            kernels = (weight, bias, torch.cat([p.weight_scale for p in projections]) if int8 else None)
            if not (torch.compiler.is_compiling() or torch.jit.is_tracing()):  # a graph leaves the layer alone
                self._fused = None if version is None else (version, kernels)
        weight, bias, scale = kernels
        y = F.linear(x, weight, bias) if scale is None else _int8_linear(x, weight, scale, bias)  # (B, T, (N+2K)*H)
        (b, t), n, kv, h = x.shape[:2], self.num_heads, self.num_kv_heads, self.head_dim
        heads = y.view(b, t, n + 2 * kv, h).transpose(1, 2) if t != 1 else y.view(b, n + 2 * kv, 1, h)  # T = 1: as is
        return heads.split_with_sizes([n, kv, kv], dim=1)  # (B, N, T, H), (B, K, T, H), (B, K, T, H)

    def _project(self, x, kind):
        """(B, L, D) -> (B, L, F): the projection `kind`, as F.linear where exact (`_plain_linear`)."""
        module = getattr(self, kind)
        return F.linear(x, module.weight, module.bias) if _plain_linear(module) else module(x)

    def _split_heads(self, y, heads):
        """(B, L, heads*H) -> (B, heads, L, H). Under tensor parallelism a rank holds a share of
        the heads, so the local count is read from the width."""
        b, length, width = y.shape
        if width % self.head_dim:
            _refuse_partial_heads(self, width)
        return y.view(b, length, width // self.head_dim, self.head_dim).transpose(1, 2)  # -> (B, heads, L, H)

    def _merge_heads(self, context):
        """(B, heads, T, H) -> (B, T, heads*H)."""
        b, heads, t, h = context.shape
        return context.reshape(b, 1, heads * h) if t == 1 else context.transpose(1, 2).reshape(b, t, heads * h)

    def _attend(self, q, k, v, keep, bias, call):
        """Step 6, the one entry to the paths: SDPA, else the explicit softmax (`_attend_explicit`)."""
        if self.softcap is not None or call.return_attention or call.segments is not None:
            return _attend_explicit(self, q, k, v, keep, bias, call)
        dropout = self.dropout if self.training else 0.0
        (t, s), sinks = (q.shape[2], k.shape[2]), self.sinks
        masked = any(x is not None for x in (keep, bias, call.window, call.attention_chunk_size))
        if call.causal and not masked and t == s:
            return _sdpa_attention(q, k, v, None, None, dropout, self.scale, True, sinks), None  # (B, N, T, H)
        if masked or call.causal:
            keep, bias = _final_masks(
                keep, bias, call.causal, call.window, call.attention_chunk_size, sinks, t, s, q.device
            )
        return _sdpa_attention(q, k, v, keep, bias, dropout, self.scale, sinks=sinks), None

    def reset_parameters(self):
        """Glorot (Xavier) uniform kernels, zero biases, norm scales of one (`_reset_parameters`)."""
        _reset_parameters(self)

    def _apply(self, fn, recurse=True):
        """`nn.Module`'s moves and casts, then `_inv_freq` made again in float32 (`_reset_rope`)."""
        module = super()._apply(fn, recurse)
        _reset_rope(self)
        return module

    def init_cache(self, batch_size, max_length, *, keep=None, dtype=None):
        """An empty `KVCache` for decoding B = `batch_size` sequences of up to L = `max_length`
        tokens (`keep`: (B, L) boolean, False for left padding; see `_init_cache`)."""
        return _init_cache(self, batch_size, max_length, keep=keep, dtype=dtype)

    def weight_shapes(self):
        """The portable layout {name: shape} (see `_weight_shapes`, converters section)."""
        return _weight_shapes(self)

    def export_weights(self):
        """Returns the portable weights: a dict of NumPy arrays (`_export_weights`)."""
        return _export_weights(self)

    def import_weights(self, weights):
        """Loads portable weights; strict and atomic (`_import_weights`)."""
        _import_weights(self, weights)

    def quantize(self, mode):
        """Replaces the projections by `Int8Linear` modules; `mode`: "int8" (`_quantize`)."""
        _quantize(self, mode)

    @property
    def quantization_mode(self):
        """ "int8" once the projections are `Int8Linear` modules (`quantize`, `import_weights`), else None."""
        return "int8" if all(isinstance(getattr(self, kind), Int8Linear) for kind in self._projections) else None

    def extra_repr(self):
        return _extra_repr(self)

    @classmethod
    def from_torch(cls, module):
        """Builds a layer with the weights of a `torch.nn.MultiheadAttention` (`_from_torch`)."""
        return _from_torch(cls, module)

    def to_torch(self):
        """Returns a `torch.nn.MultiheadAttention` (batch_first=True) with these weights."""
        return _to_torch(self)


class _Call(NamedTuple):
    """One call's arguments, defaulted and checked by `MultiHeadAttention._check_call`."""

    query: torch.Tensor  # (B, T, E), checked
    key: torch.Tensor  # (B, S, kdim), defaulted and checked
    value: torch.Tensor  # (B, S, vdim)
    attention_mask: torch.Tensor | None  # as given after the `mask=` alias
    attention_bias: torch.Tensor | None
    key_mask: torch.Tensor | None  # (B, S), query_mask in self-attention by default; (B, T) with a cache
    query_mask: torch.Tensor | None  # (B, T)
    positions: torch.Tensor | None  # (B, T) integers, (k, B, T) with rope_sections, None without RoPE
    causal: bool  # the cache step replaces it by False once folded into keep
    window: int | tuple[int, int] | None  # self.window; the cache step replaces it by None once folded into keep
    attention_chunk_size: int | None  # self.attention_chunk_size; likewise
    return_attention: bool
    cache: "KVCache | None"  # the cache step replaces it by the written cache
    training: None  # TensorFlow and Keras only
    fuse: bool  # q, k and v may come from one matmul (one input; with a cache, kernels kept between steps)
    segmented: bool = False  # packed sequences: the ids folded into attention_mask (`_packed`)
    segments: tuple | None = None  # packed sequences by blocks of documents: (B, T) and (B, S) ids, the blocks
    selection: torch.Tensor | None = None  # (B, T, k) the sparse indexer's keys, for its gathered route


# -------------------------------------------------------------------------------------------------
# Section: score modifiers
# -------------------------------------------------------------------------------------------------
# The score modifiers, each off by default: `scale` (T5, Gemma), `softcap` (Gemma 2: with its blocks
# and tiles, which SDPA cannot express), `window` (a sliding window: Mistral, gpt-oss; a two-sided
# band (before, after): ModernBERT), `attention_chunk_size` (Llama 4), `sinks` (gpt-oss), ALiBi
# (`alibi_bias`) and the attention bias (T5). Here too the masks, combined into one boolean keep and
# one additive bias (`_split_mask`: a floating mask at most the lowest of float32 or of its dtype,
# or -inf, removes a key; the rest is added), `causal_mask`, and the formula with every modifier,
# `dot_product_attention`, with the explicit softmax's paths (`_attend_explicit`). Soft-capping
# makes the scaled scores c * tanh(scores / c) before `attention_bias` and the floating mask are added.


def _check_score_modifiers(head_dim, scale, softcap, window, attention_chunk_size):
    """The score modifiers' constructor arguments checked, in this order: (scale, softcap, window,
    attention_chunk_size); `scale` None becomes 1 / sqrt(H). `sinks` is a flag (`_check_variants`)."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else _positive_float("scale", scale)
    softcap = _positive_float("softcap", softcap, optional=True)
    window = _check_window(window)
    chunk = None if attention_chunk_size is None else _positive_int("attention_chunk_size", attention_chunk_size)
    return scale, softcap, window, chunk


def _check_window(window):
    """`window` held as an int W or a tuple (W_before, W_after) of Python ints (None passes)."""
    pair = isinstance(window, (list, tuple)) and len(window) == 2
    sides = window if pair else (window,)
    if window is not None and not all(_is_positive_int(side) for side in sides):
        raise ValueError(
            "`window` must be None, a positive integer or a pair (before, after) of positive integers. "
            f"Received: window={window!r}"
        )
    return None if window is None else tuple(int(side) for side in window) if pair else int(window)


def _window_sides(window):
    """`window` -> (W_before, W_after or None): an int W is (W, None), no limit after."""
    if window is None or isinstance(window, tuple):
        return (None, None) if window is None else window
    return window, None


def _score_settings(layer):
    """The score modifiers not at their default's values, {name: value or None} (`_non_defaults`)."""
    return {
        "scale": None if layer.scale == 1.0 / math.sqrt(layer.head_dim) else layer.scale,
        "softcap": layer.softcap,
        "window": layer.window,
        "attention_chunk_size": layer.attention_chunk_size,
    }


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
    """Checks a mask (`attention_mask` or `attention_bias`) against target (B, N, T, S) and returns it as rank 4."""
    if mask.dtype != torch.bool and not _is_floating(mask):
        raise ValueError(
            f"`{name}` must be boolean (True = attend; for a 0/1 integer mask pass `mask > 0`) or floating. "
            f"Received: {name}.dtype={_dtype_name(mask.dtype)}"
        )
    expected = {2: target[2:], 3: (target[0], *target[2:]), 4: target}.get(mask.dim())
    if expected is None or any(m not in (1, e) for m, e in zip(mask.shape, expected, strict=True)):
        raise ValueError(
            f"`{name}` must broadcast to (B, N, T, S) as (T, S), (B, T, S) or "
            f"(B, N, T, S), each dimension full or 1.{_padding_hint(name, tuple(mask.shape), target)} "
            f"Expected: (B, N, T, S)={target}. "
            f"Received: {name}.shape={tuple(mask.shape)}"
        )
    if mask.dim() == 2:
        return mask[None, None]  # (T, S) -> (1, 1, T, S)
    if mask.dim() == 3:
        return mask[:, None]  # (B, T, S) -> (B, 1, T, S)
    return mask


def causal_mask(t, s, device=None):
    """(T, S) boolean mask: query t keeps key s iff s <= t + (S - T) (bottom-right aligned)."""
    rows = torch.arange(t, device=device)[:, None]  # (T, 1)
    return torch.arange(s, device=device)[None, :] <= rows + (s - t)  # (T, S)


def window_mask(t, s, window, device=None):
    """(T, S) boolean mask: query t keeps key s iff s > t + (S - T) - W_before, and with a pair
    `window` (W_before, W_after) also s < t + (S - T) + W_after (bottom-right aligned)."""
    before, after = _window_sides(window)
    rows = torch.arange(t, device=device)[:, None] + (s - t)  # (T, 1), the position of each query
    keys = torch.arange(s, device=device)[None, :]  # (1, S)
    kept = keys > rows - before  # (T, S)
    return kept if after is None else kept & (keys < rows + after)  # (T, S)


def attention_chunk_mask(t, s, size, device=None):
    """(T, S) boolean mask: query t keeps key s iff s // size == (t + (S - T)) // size, the same
    chunk of `size` positions (bottom-right aligned; Llama 4's chunked attention)."""
    rows = torch.arange(t, device=device)[:, None] + (s - t)  # (T, 1)
    return torch.arange(s, device=device)[None, :] // size == rows // size  # (T, S)


def _split_mask(mask, target, name="attention_mask"):
    """Splits a mask into (keep, additive), both rank 4 or None (the floating mask rule).

    A boolean mask is all keep. A floating one removes a key where it is at most the removal
    threshold, the lowest finite value of its dtype or of float32, whichever is higher (-inf
    too), read in its own dtype; the rest is added, in float32 at least (float64 stays float64).
    """
    if mask is None:
        return None, None
    mask = _mask_to_4d(mask, target, name)
    if mask.dtype == torch.bool:
        return mask, None
    threshold = max(torch.finfo(mask.dtype).min, torch.finfo(torch.float32).min)
    removed = mask <= threshold  # (B, N, T, S), dims may be 1
    additive = torch.where(removed, 0.0, mask)  # finite, never 0 * -inf
    return ~removed, additive.to(torch.promote_types(mask.dtype, torch.float32))


def _split_bias(attention_bias, target):
    """`attention_bias` -> (keep, additive) by the floating mask rule; a boolean one is refused."""
    if attention_bias is None:
        return None, None
    if not _is_floating(attention_bias):
        raise ValueError(
            f"`attention_bias` must be floating. Received: attention_bias.dtype={_dtype_name(attention_bias.dtype)}"
        )
    return _split_mask(attention_bias, target, "attention_bias")


def _and(a, b):
    return b if a is None else a if b is None else a & b


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _final_masks(keep, bias, causal, window, chunk, sinks, t, s, device):
    """`keep` with `causal`, `window` and the attention chunk (bottom-right aligned) ANDed in, and
    `bias` less each row's largest kept value (`_centre_rows`; not with sinks, where a softmax is
    not shift-invariant)."""
    rules = [causal_mask(t, s, device)] if causal else []  # (T, S) each
    rules += [] if window is None else [window_mask(t, s, window, device)]
    rules += [] if chunk is None else [attention_chunk_mask(t, s, chunk, device)]
    for rule in rules:
        keep = rule if keep is None else keep & rule  # (B, N, T, S), dims may be 1
    if bias is not None and keep is not None and sinks is None:
        bias = _centre_rows(bias, keep)  # (B, N, T, S), dims may be 1
    return keep, bias


def dot_product_attention(
    q, k, v, keep=None, bias=None, causal=False, *, scale=None, softcap=None, window=None,
    attention_chunk_size=None, sinks=None, dropout=0.0, return_attention=False,
):  # fmt: skip
    """Attention on split heads, the formula written out; returns (context, weights). The layer
    computes the same numbers on its faster paths (`MultiHeadAttention._attend`).

    Args:
        q: (B, N, T, H) queries.
        k: (B, K, S, H) keys, K dividing N.
        v: (B, K, S, H) values.
        keep: None or boolean, broadcasts to (B, N, T, S); True where a query may attend a key.
        bias: None or float, broadcasts to (B, N, T, S); added to the scaled (and soft-capped) scores.
        causal: if True, query t keeps key s only if s <= t + (S - T).
        scale: the factor of the scores; defaults to 1 / sqrt(H).
        softcap: None or c > 0: the scaled scores become c * tanh(scores / c).
        window: None, W, or a pair (W_before, W_after): query t keeps key s only if
            s > t + (S - T) - W_before, and with a pair also s < t + (S - T) + W_after.
        attention_chunk_size: None, or C: query t keeps key s only if s // C == (t + (S - T)) // C.
        sinks: None or (N,) logits, one more term per head in the softmax's denominator.
        dropout: probability of dropping attention weights (pass 0 outside training).
        return_attention: if True, return the weights; else None in their place.

    Returns:
        context (B, N, T, H) and weights (B, N, T, S) (None unless `return_attention`),
        exactly 0 where not kept.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    masks = (causal, window, attention_chunk_size)
    keep, bias = _final_masks(keep, bias, *masks, sinks, q.shape[2], k.shape[2], q.device)
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])  # (B, K, S, H) -> (B, N, S, H)
    dtype = _softmax_dtype(q.dtype, bias, sinks)
    scores = ((q * scale) @ k.transpose(-1, -2)).to(dtype)  # (B, N, T, S), a new tensor; q scaled, not the scores
    scores = _softcap(scores, softcap)  # (B, N, T, S)
    scores = scores if bias is None else scores + bias.to(dtype)  # (B, N, T, S)
    weights = _masked_softmax(scores, keep, sinks).to(q.dtype)  # (B, N, T, S)
    context = F.dropout(weights, dropout, training=dropout > 0) @ v  # (B, N, T, S) @ (B, N, S, H) -> (B, N, T, H)
    return context, weights if return_attention else None


def _repeat_heads(x, heads):
    """(B, K, S, H) -> (B, heads, S, H): each key/value head repeated for its heads // K query heads."""
    groups = heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _softmax_dtype(dtype, bias=None, sinks=None):
    """The dtype the (B, N, T, S) scores are held in: that of q, or float32 at least where a float
    mask or sinks are added to them (so that the sum is not rounded). The softmax of float16 and
    bfloat16 computes in float32 either way."""
    return dtype if bias is None and sinks is None else torch.promote_types(dtype, torch.float32)


def _softcap(scores, softcap):
    """Gemma 2's soft-capping: softcap * tanh(scores / softcap)."""
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def _capped_scores(layer, scores):
    """The scores soft-capped by the layer's `softcap` (as they are without one)."""
    return _softcap(scores, layer.softcap)


def _masked_softmax(scores, keep, sinks=None):
    """Softmax over S (with `sinks` in its denominator) with every position not kept at weight
    exactly 0 (rows with no key are all 0). Without autograd (and outside torch.compile) it
    overwrites `scores`, a tensor the caller owns: no second (B, N, T, S) buffer, as in the
    built-in layer's inference kernel."""
    lowest = torch.finfo(scores.dtype).min
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        scores = scores if keep is None else torch.where(keep, scores, lowest)
        weights = scores.softmax(dim=-1) if sinks is None else (scores - _sink_logsumexp(scores, sinks)).exp()
        return weights if keep is None else torch.where(keep, weights, 0.0)
    removed = None if keep is None else ~keep
    if removed is not None:
        scores.masked_fill_(removed, lowest)
    if sinks is None:
        weights = torch.ops.aten._softmax.out(scores, -1, False, out=scores)  # in place
    else:
        weights = scores.sub_(_sink_logsumexp(scores, sinks)).exp_()  # in place
    return weights if removed is None else weights.masked_fill_(removed, 0.0)


def _centre_rows(bias, keep):
    """`bias` minus each row's largest value where `keep` holds (rows keeping nothing: 0).

    A per-query constant does not change a softmax; this keeps a row of only large finite
    penalties (-1e9) an ordinary softmax instead of scores rounded away in float32 or float16.
    """
    if bias.shape[-1] == 0 or keep.shape[-1] == 0:  # S = 0 (a (T, 1) bias broadcasts over no key)
        return bias
    return bias - _row_top(bias, keep)  # (B, N, T, S), dims may be 1


def _row_top(bias, keep):
    """Each row's largest value of `bias` where `keep` holds (None: everywhere), 0 for a row that
    keeps nothing; (B, N, T, S) -> (B, N, T, 1), dims may be 1. S must not be 0."""
    lowest = torch.finfo(bias.dtype).min
    top = (bias if keep is None else torch.where(keep, bias, lowest)).amax(dim=-1, keepdim=True)  # (B, N, T, 1)
    return torch.where(top == lowest, 0.0, top)  # (B, N, T, 1), dims may be 1


def _sink_logsumexp(scores, sinks):
    """log(exp(sink) + sum over S of exp(scores)): the log of the softmax's denominator with one
    sink logit per head (gpt-oss); (B, N, T, S) -> (B, N, T, 1)."""
    sink = sinks.to(scores.dtype)[:, None, None]  # (N,) -> (N, 1, 1)
    return torch.logaddexp(torch.logsumexp(scores, dim=-1, keepdim=True), sink)  # (B, N, T, 1)


def _alibi_slopes(num_heads):
    """Bloom's slopes: 2 ** (-8 (n + 1) / N) for N a power of two; otherwise those of the nearest
    lower power of two P followed by every other slope of 2P."""
    power = 2 ** math.floor(math.log2(num_heads))
    slopes = [2 ** (-8 * (n + 1) / power) for n in range(power)]
    return slopes + [2 ** (-8 * (n + 1) / (2 * power)) for n in range(0, 2 * (num_heads - power), 2)]


def alibi_bias(num_heads, positions):
    """The ALiBi bias slope[n] * positions[..., s], to pass as `attention_bias` with `causal=True`.

    Args:
        num_heads: N.
        positions: integer key positions, (S,) or (B, S) (Bloom: `cumsum(key_mask) - 1`).

    Returns:
        float32 (1, N, 1, S) for (S,) positions, (B, N, 1, S) for (B, S). A per-query constant
        does not change a softmax, so this equals Press et al.'s -slope * (t - s).
    """
    num_heads = _positive_int("num_heads", num_heads)
    positions = torch.as_tensor(positions)
    if positions.dim() not in (1, 2) or not _is_integer(positions):
        raise ValueError(
            "`positions` must be an integer tensor of shape (S,) or (B, S). "
            f"Received: positions.shape={tuple(positions.shape)}, positions.dtype={_dtype_name(positions.dtype)}"
        )
    slopes = torch.tensor(_alibi_slopes(num_heads), dtype=torch.float64, device=positions.device)  # (N,)
    batched = positions if positions.dim() == 2 else positions[None]  # (S,) -> (1, S)
    return (slopes[None, :, None, None] * batched[:, None, None, :]).float()  # (N,) * (B, S) -> (B, N, 1, S)


def _attend_explicit(layer, q, k, v, keep, bias, call):
    """Step 6 with `softcap` or returned weights, which SDPA cannot give, `dot_product_attention`'s
    numbers: soft-capped attention without returned weights or dropout, eagerly, a tile or a block
    of query rows at a time with its own backward (`_softcapped_attention`); else the explicit
    softmax, in blocks of batch elements under no_grad on the CPU (`_attention_in_blocks`). A
    window or an attention chunk is always folded into the mask: no shortcut. A packed call in
    blocks of documents (`call.segments`) goes to `_attend_documents` first."""
    if call.segments is not None:
        return _attend_documents(layer, q, k, v, keep, bias, call)
    (n, t), s, sinks = q.shape[1:3], k.shape[2], layer.sinks
    dropout = layer.dropout if layer.training else 0.0
    masks = (call.causal, call.window, call.attention_chunk_size)
    if layer.softcap is not None and not (call.return_attention or dropout or torch.compiler.is_compiling()):
        return _softcapped_attention(q, k, v, keep, bias, *masks, layer.scale, layer.softcap, sinks), None
    if not _in_blocks(q, _softmax_dtype(q.dtype, bias, sinks)):
        return dot_product_attention(
            q, k, v, keep, bias, call.causal, scale=layer.scale, softcap=layer.softcap, window=call.window,
            attention_chunk_size=call.attention_chunk_size, sinks=sinks, dropout=dropout,
            return_attention=call.return_attention,
        )  # fmt: skip
    keep, bias = _final_masks(keep, bias, *masks, sinks, t, s, q.device)
    k, v = _repeat_heads(k, n), _repeat_heads(v, n)  # (B, K, S, H) -> (B, N, S, H)
    context, weights = _attention_in_blocks(q, k, v, keep, bias, dropout, layer.scale, layer.softcap, sinks)
    return context, weights if call.return_attention else None


def _in_blocks(q, dtype):
    """Whether the explicit softmax takes `_attention_in_blocks`: inference (no autograd, not
    compiling) on the CPU, with scores held in the dtype of q."""
    inference = not (torch.is_grad_enabled() or torch.compiler.is_compiling())
    return inference and q.device.type == "cpu" and q.dtype == dtype


def _batch_rows(mask, rows):
    """The batch elements `rows` of a mask that broadcasts to (B, N, T, S)."""
    return mask if mask is None or mask.dim() < 4 or mask.shape[0] == 1 else mask[rows]


def _attention_in_blocks(q, k, v, keep, bias, dropout, scale, softcap, sinks):
    """`dot_product_attention` without autograd on N key/value heads, a block of batch elements at a
    time: each block's scores are written into its slice of the weights, soft-capped, softmaxed
    there in place and multiplied by v while they are still in the CPU cache (one (B, N, T, S)
    buffer in all). `keep` and `bias` already hold causal, window, chunk and the rows' centring."""
    (b, n, t, h), s = q.shape, k.shape[2]
    weights = q.new_empty(b, n, t, s)  # (B, N, T, S)
    context = q.new_empty(b, n, t, v.shape[-1])  # (B, N, T, H), v's width (Hv with MLA)
    step = max(1, _BLOCK_SCORES // max(1, n * t * s))
    for start in range(0, b, step):
        rows, r = slice(start, start + step), min(step, b - start)  # r batch elements in this block
        scores = weights[rows].view(r * n, t, s)  # (r*N, T, S)
        q_rows, k_rows = q[rows].reshape(r * n, t, h), k[rows].reshape(r * n, s, h)  # (r*N, T, H), (r*N, S, H)
        torch.baddbmm(scores, q_rows, k_rows.transpose(1, 2), beta=0.0, alpha=scale, out=scores)  # scaled q k^T
        scores = scores.view(r, n, t, s)  # (r*N, T, S) -> (r, N, T, S)
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)  # `_softcap` in place
        if bias is not None:
            scores += _batch_rows(bias, rows)
        _masked_softmax(scores, _batch_rows(keep, rows), sinks)  # in place
        dropped = F.dropout(scores, dropout, training=dropout > 0)
        torch.matmul(dropped, v[rows], out=context[rows])  # (r, N, T, S) @ (r, N, S, H) -> (r, N, T, H)
    return context, weights


_BLOCK_SCORES = 1 << 21  # scores in one block of `_attention_in_blocks`: 8 MiB of float32
_SOFTCAP_BLOCK_SCORES = 1 << 20  # scores in one block of `_Softcapped`: 4 MiB of float32
_SOFTCAP_TILES = {  # (query rows, keys) of a tile of `_SoftcappedTiles`, chosen by `bench.softcap_paths`
    "forward": (512, 512),
    "causal forward": (256, 256),  # smaller tiles skip more of the keys above the diagonal
    "backward": (256, 256),
}


def _score_blocks(b, n, t, s, causal, window):
    """The blocks of `_Softcapped` as (batch elements, query rows, first key, end key), about
    `_SOFTCAP_BLOCK_SCORES` scores each: whole rows of all N heads, a few batch elements a block
    where all T rows fit. A block reads only the keys its rows may see under `causal` and
    `window` (bottom-right aligned); a block whose rows see no key is left out (its rows stay 0)."""
    rows = max(1, min(t, _SOFTCAP_BLOCK_SCORES // max(1, n * s)))
    batch = max(1, _SOFTCAP_BLOCK_SCORES // max(1, n * t * s)) if rows == t else 1
    blocks = []
    for first in range(0, t, rows):
        start, end = _key_range(first, min(t, first + rows), t, s, causal, window)
        if end > start:
            blocks += [(slice(i, i + batch), slice(first, first + rows), start, end) for i in range(0, b, batch)]
    return blocks


def _key_range(first, stop, t, s, causal, window):
    """The keys [start, end) that the query rows [first, stop) may see under `causal` and `window`
    (bottom-right aligned); empty (end <= start) where they see none."""
    before, after = _window_sides(window)
    last = stop - 1 + s - t  # the last row's query, as a key position
    start = 0 if before is None else max(0, first + s - t - before + 1)
    end = min(s, last + 1 if causal else s, s if after is None else last + after)
    return start, end


def _as_4d(x):
    """A mask of rank 2 to 4 as a view of rank 4: (..., T, S) -> (B, N, T, S), dims may be 1."""
    return x[(None,) * (4 - x.dim())]


def _block_of(x, block):
    """The part of a mask that broadcasts to (B, N, T, S) a block reads, as a view: (r, N, tq, S')
    with its dims of 1 kept (r batch elements, tq query rows, S' keys)."""
    if x is None:
        return None
    batch, rows, start, end = block
    x, every = _as_4d(x), slice(None)  # (..., T, S) -> (B, N, T, S), dims may be 1
    keys = slice(start, end) if x.shape[3] > 1 else every
    return x[batch if x.shape[0] > 1 else every, :, rows if x.shape[2] > 1 else every, keys]


def _capped_tanh(q_scaled, k, block, dtype):
    """A block's tanh(scores / softcap) in `dtype`, a new (r, N, tq, S') tensor; `q_scaled` is q
    times scale / softcap."""
    batch, rows, start, end = block
    scores = q_scaled[batch, :, rows] @ k[batch, :, start:end].transpose(-1, -2)  # (r, N, tq, H) @ (r, N, H, S')
    return scores.to(dtype).tanh_()  # (r, N, tq, S')


def _block_weights(scores, keep, bias, sinks, block):
    """A block's weights from its soft-capped `scores`, which become them (in place)."""
    scores = scores if bias is None else scores.add_(_block_of(bias, block))  # (r, N, tq, S')
    return _masked_softmax(scores, _block_of(keep, block), sinks)  # in place (autograd is off here)


def _add_block_gradients(grad_bias, grad_sinks, capped, weights, rowsum, block):
    """A block's share of the gradients of `bias` (that of the capped scores, `capped`, summed
    where the bias broadcasts) and of the sink logits (each row's sink weight, 1 - the sum of
    its `weights`, times minus its `rowsum`), added in place to those not None."""
    if grad_bias is not None:
        part = _block_of(grad_bias, block)  # (r, N, tq, S'), dims may be 1
        part += capped.sum_to_size(part.shape)
    if grad_sinks is not None:
        sink_weight = 1 - weights.sum(dim=-1, keepdim=True)  # (r, N, tq, 1)
        grad_sinks -= (sink_weight * rowsum).sum(dim=(0, 2, 3))  # (N,)


class _Softcapped(torch.autograd.Function):
    """Soft-capped attention a block at a time (`_score_blocks`), forward and backward: each
    block's scores are made, capped, softmaxed and multiplied by v while they are in the CPU
    cache, and the backward makes them again (the flash-attention backward, with tanh's
    derivative 1 - tanh^2), so no (B, N, T, S) tensor is kept. `keep` and `bias` already hold
    causal, window, chunk and the rows' centring; `causal` and `window` only tell each block
    which keys it may skip. Each block's products go straight into their rows of the results
    (`baddbmm_` on (r*N, ., .) views)."""

    @staticmethod
    def forward(ctx, q, k, v, keep, bias, sinks, scale, softcap, causal, window):
        (b, n, t, _), s = q.shape, k.shape[2]
        dtype, q_scaled = _softmax_dtype(q.dtype, bias, sinks), q * (scale / softcap)  # (B, N, T, H)
        context = q.new_zeros(b, n, t, v.shape[-1])  # (B, N, T, Hv), rows no block reaches stay 0
        blocks = _score_blocks(b, n, t, s, causal, window)
        for block in blocks:
            batch, rows, start, end = block
            scores = _capped_tanh(q_scaled, k, block, dtype).mul_(softcap)  # (r, N, tq, S')
            weights = _block_weights(scores, keep, bias, sinks, block).to(v.dtype)  # (r, N, tq, S')
            values = v[batch, :, start:end].flatten(0, 1)  # (r*N, S', Hv)
            context[batch, :, rows].flatten(0, 1).baddbmm_(weights.flatten(0, 1), values)  # (r*N, tq, Hv)
        ctx.save_for_backward(q, k, v, keep, bias, sinks, context)
        ctx.options = (scale, softcap, blocks)
        return context

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, keep, bias, sinks, context = ctx.saved_tensors
        scale, softcap, blocks = ctx.options
        dtype, q_scaled = _softmax_dtype(q.dtype, bias, sinks), q * (scale / softcap)  # (B, N, T, H)
        low, wide = q.dtype, torch.promote_types(q.dtype, torch.float32)  # the products in float32 at least
        q, k, v, grad = (x.to(wide).contiguous() for x in (q, k, v, grad))  # (B, N, T|S, H|Hv)
        grad_q, grad_k, grad_v = (torch.zeros_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
        bias_shape = (
            None if bias is None or not ctx.needs_input_grad[4] else _as_4d(bias).shape
        )  # (B, N, T, S), dims may be 1
        grad_bias = None if bias_shape is None else q.new_zeros(bias_shape, dtype=dtype)
        grad_sinks = (
            None if sinks is None or not ctx.needs_input_grad[5] else q.new_zeros(sinks.shape, dtype=dtype)
        )  # (N,)
        rowsum = (grad * context).sum(dim=-1, keepdim=True).to(dtype)  # (B, N, T, 1): sum of weights * grad of weights
        for block in blocks:
            batch, rows, start, end = block
            tanh = _capped_tanh(q_scaled, k, block, dtype)  # (r, N, tq, S')
            weights = _block_weights(tanh * softcap, keep, bias, sinks, block)  # (r, N, tq, S')
            g, rowsum_block = grad[batch, :, rows].flatten(0, 1), rowsum[batch, :, rows]  # (r*N, tq, Hv), (r, N, tq, 1)
            q_block, k_block, v_block = q[batch, :, rows], k[batch, :, start:end], v[batch, :, start:end]
            grad_v[batch, :, start:end].flatten(0, 1).baddbmm_(weights.to(wide).flatten(0, 1).transpose(1, 2), g)
            capped = (g @ v_block.flatten(0, 1).transpose(1, 2)).view_as(weights).to(dtype)  # (r, N, tq, S')
            capped = capped.sub_(rowsum_block).mul_(weights)  # the gradient of the capped scores
            _add_block_gradients(grad_bias, grad_sinks, capped, weights, rowsum_block, block)
            scores = capped.addcmul_(capped, tanh.mul_(tanh), value=-1).to(wide).flatten(0, 1)  # times 1 - tanh^2
            queries, keys = q_block.flatten(0, 1), k_block.flatten(0, 1)  # (r*N, tq, H), (r*N, S', H)
            grad_q[batch, :, rows].flatten(0, 1).baddbmm_(scores, keys, alpha=scale)  # (r*N, tq, H)
            grad_k[batch, :, start:end].flatten(0, 1).baddbmm_(scores.transpose(1, 2), queries, alpha=scale)
        grad_bias = None if grad_bias is None else grad_bias.view(bias.shape).to(bias.dtype)
        grad_sinks = None if grad_sinks is None else grad_sinks.to(sinks.dtype)
        grads = (grad_q.to(low), grad_k.to(low), grad_v.to(low), None, grad_bias, grad_sinks)
        return *grads, None, None, None, None


def _cap_shift(softcap, dtype):
    """The one number `_SoftcappedTiles` subtracts from every capped score before its exp, or None
    where none fits `dtype`. Capped scores lie in [-softcap, softcap] (a bias centred to at most 0
    on each row's kept keys, one of them 0), so exp(score - shift) stays within [e^-(L - 8),
    e^(L / 2)], L the log of the dtype's largest value (88.7 in float32: softcap up to 62): each
    row's largest term is a normal number and sums of them do not overflow, with no running max."""
    top = math.log(torch.finfo(dtype).max)
    shift = max(0.0, softcap - top / 2)
    return shift if softcap + shift <= top - 8 else None


def _key_tiles(b, t, s, causal, window, size):
    """The tiles of `_SoftcappedTiles` as (batch elements, query rows, [(first key, end key, whole)]):
    blocks of `size[0]` query rows of all N heads (several batch elements a block where T is
    shorter), each with the keys its rows may see (`_key_range`) in tiles of `size[1]`; `whole`
    where `causal` and `window` keep every key of the tile for every row of the block."""
    rows, keys = size
    batch = max(1, rows // max(1, t))
    before, after = _window_sides(window)
    blocks = []
    for first in range(0, t, rows):
        stop = min(t, first + rows)
        near, far = first + s - t, stop - 1 + s - t  # the block's first and last query, as key positions
        start, end = _key_range(first, stop, t, s, causal, window)
        tiles = []
        for key in range(start, end, keys):
            last = min(end, key + keys) - 1  # the tile's last key
            kept = (not causal or last <= near) and (before is None or key > far - before)
            tiles.append((key, last + 1, kept and (after is None or last < near + after)))
        blocks += [(slice(i, i + batch), slice(first, stop), tiles) for i in range(0, b, batch) if tiles]
    return blocks


_LOG2E = 1 / math.log(2)  # exp(x) = exp2(x * _LOG2E)
_TANH_ARGUMENT = 40.0  # 2x is clamped to [-40, 40] in `_tile_tanh`: tanh(20) rounds to 1 in float32 and float64


def _tile_expm1(queries, keys):
    """A tile's expm1(2x) of x = scores / softcap, a new (r*N, tq, S') tensor, 2x clamped to
    [-40, 40]: tanh(x) is expm1(2x) / (expm1(2x) + 2), which torch's CPU kernels compute about
    twice as fast as its `tanh` (docs/benchmark.md, "Soft-capping in PyTorch") and, unlike
    2 * sigmoid(2x) - 1, with tanh's relative precision near 0. `queries` (r*N, tq, H) are q times
    2 * scale / softcap, `keys` (r*N, S', H)."""
    doubled = torch.bmm(queries, keys.transpose(1, 2))  # (r*N, tq, H) @ (r*N, H, S') -> (r*N, tq, S'), 2x
    return doubled.clamp_(-_TANH_ARGUMENT, _TANH_ARGUMENT).expm1_()  # (r*N, tq, S'), in place


def _tile_weights(grown, softcap, keep, bias, offset, part, heads, out=None):
    """exp(softcap * tanh + bias - offset) of a tile's expm1(2 * scores / softcap) (r*N, tq, S')
    (tanh = grown / (grown + 2)), in `out` (`grown` itself where it is not needed again) or a new
    tensor, 0 at every key not kept; `offset` is a number or (r*N, tq, 1), `part` the tile as
    `_block_of` reads it, and `keep` None where the tile is whole. The tanh, the cap and the offset
    are one pass (`torch.addcdiv`), the exp an exp2 of the exponent times log2(e) (torch's CPU
    `exp2` runs about four times faster than its `exp`); the keys not kept are zeroed after the
    exp2 (an exp of the lowest float ran ten times slower than of a score)."""
    start = torch.as_tensor(-offset * _LOG2E, dtype=grown.dtype, device=grown.device)  # () or (r*N, tq, 1)
    weights = torch.addcdiv(start, grown, grown + 2, value=softcap * _LOG2E, out=out)  # (r*N, tq, S')
    if bias is not None:
        weights.unflatten(0, (-1, heads)).add_(_block_of(bias, part), alpha=_LOG2E)  # (r, N, tq, S'), a view
    weights.exp2_()  # (r*N, tq, S')
    mask = _block_of(keep, part)  # (r, N, tq, S'), dims may be 1
    if mask is not None:
        weights.unflatten(0, (-1, heads)).masked_fill_(~mask, 0.0)
    return weights  # (r*N, tq, S')


class _SoftcappedTiles(torch.autograd.Function):
    """Soft-capped attention a tile at a time (`_key_tiles`), forward and backward: each tile's
    scores (a block of query rows against a tile of keys) are made, capped and exponentiated while
    they are in the CPU cache, with the one `shift` of `_cap_shift` instead of a running max, and
    the weighted values and the weights' sums are added up over the tiles. The backward makes each
    tile again from the saved log-sum-exp (flash attention's: dS = P * (dP - rowsum(dO * O)),
    times 1 - tanh^2), so no (B, N, T, S) tensor is kept. `bias` is centred (`_row_top`) and
    `sinks` is one logit per row, (B, N, T, 1) with dims of 1; `keep` holds causal, window and
    chunk, and `whole` says it holds nothing else (a tile they keep whole then needs no mask)."""

    @staticmethod
    def forward(ctx, q, k, v, keep, bias, sinks, scale, softcap, shift, causal, window, whole):
        (b, n, t, _), s, wide = q.shape, k.shape[2], torch.promote_types(q.dtype, torch.float32)
        blocks = _key_tiles(b, t, s, causal, window, _SOFTCAP_TILES["causal forward" if causal else "forward"])
        q_scaled, k_wide, v_wide = q.to(wide) * (2 * scale / softcap), k.to(wide), v.to(wide)  # (B, N, T|S, H|Hv)
        sums = q.new_zeros(b, n, t, v.shape[-1], dtype=wide)  # (B, N, T, Hv): the weighted values
        totals = q.new_zeros(b, n, t, 1, dtype=wide)  # (B, N, T, 1): the weights' sums
        for block in blocks:
            batch, rows, tiles = block
            queries = q_scaled[batch, :, rows].flatten(0, 1)  # (r*N, tq, H)
            out, total = sums[batch, :, rows].flatten(0, 1), totals[batch, :, rows].flatten(0, 1)
            for tile in tiles:
                start, end, kept = tile
                keys, values = (x[batch, :, start:end].flatten(0, 1) for x in (k_wide, v_wide))  # (r*N, S', .)
                mask, part = None if kept and whole else keep, (batch, rows, start, end)
                grown = _tile_expm1(queries, keys)  # (r*N, tq, S')
                weights = _tile_weights(grown, softcap, mask, bias, shift, part, n, out=grown)  # (r*N, tq, S')
                out.baddbmm_(weights, values)  # (r*N, tq, S') @ (r*N, S', Hv)
                total += weights.sum(dim=-1, keepdim=True)  # (r*N, tq, 1)
        empty = totals == 0  # (B, N, T, 1): rows that see no key
        lse = torch.where(empty, math.inf, totals.log() + shift)  # (B, N, T, 1)
        context = sums.div_(torch.where(empty, 1.0, totals))  # (B, N, T, Hv)
        if sinks is not None:
            with_sink = torch.logaddexp(torch.where(empty, torch.finfo(wide).min, lse), sinks.to(wide))
            context.mul_(torch.where(empty, 0.0, (lse - with_sink).exp()))  # (B, N, T, Hv)
            lse = with_sink  # (B, N, T, 1)
        context = context.to(q.dtype)  # (B, N, T, Hv)
        ctx.save_for_backward(q, k, v, keep, bias, sinks, context, lse)
        ctx.options = (scale, softcap, causal, window, whole)  # the backward's tiles are made there, where needed
        return context

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, keep, bias, sinks, context, lse = ctx.saved_tensors
        scale, softcap, causal, window, whole = ctx.options
        (b, n, t, _), s = q.shape, k.shape[2]
        blocks = _key_tiles(b, t, s, causal, window, _SOFTCAP_TILES["backward"])
        low, wide = q.dtype, torch.promote_types(q.dtype, torch.float32)
        q, k, v, grad = (x.to(wide).contiguous() for x in (q, k, v, grad))  # (B, N, T|S, H|Hv)
        q_scaled = q * (2 * scale / softcap)  # (B, N, T, H)
        grad_q, grad_k, grad_v = (torch.zeros_like(x) for x in (q, k, v))
        needs_bias = bias is not None and ctx.needs_input_grad[4]
        grad_bias = q.new_zeros(_as_4d(bias).shape) if needs_bias else None  # (B, N, T, S), dims may be 1
        rowsum = (grad * context.to(wide)).sum(dim=-1, keepdim=True)  # (B, N, T, 1): sum of weights * grad of weights
        for block in blocks:
            batch, rows, tiles = block
            queries, grads = q[batch, :, rows].flatten(0, 1), grad[batch, :, rows].flatten(0, 1)  # (r*N, tq, H|Hv)
            scaled, grad_queries = q_scaled[batch, :, rows].flatten(0, 1), grad_q[batch, :, rows].flatten(0, 1)
            offset, minus_rowsum = lse[batch, :, rows].flatten(0, 1), -rowsum[batch, :, rows].flatten(0, 1)
            for tile in tiles:
                start, end, kept = tile
                keys, values = k[batch, :, start:end].flatten(0, 1), v[batch, :, start:end].flatten(0, 1)
                mask, part = None if kept and whole else keep, (batch, rows, start, end)
                grown = _tile_expm1(scaled, keys)  # (r*N, tq, S')
                weights = _tile_weights(grown, softcap, mask, bias, offset, part, n)  # (r*N, tq, S')
                tanh = grown.div_(grown + 2)  # (r*N, tq, S')
                grad_v[batch, :, start:end].flatten(0, 1).baddbmm_(weights.transpose(1, 2), grads)  # (r*N, S', Hv)
                capped = torch.baddbmm(minus_rowsum, grads, values.transpose(1, 2)).mul_(weights)  # (r*N, tq, S')
                if grad_bias is not None:
                    tile_grad = _block_of(grad_bias, part)  # (r, N, tq, S'), dims may be 1
                    tile_grad += capped.unflatten(0, (-1, n)).sum_to_size(tile_grad.shape)
                scores = capped.addcmul_(capped, tanh.mul_(tanh), value=-1)  # times 1 - tanh^2
                grad_queries.baddbmm_(scores, keys, alpha=scale)  # (r*N, tq, H)
                grad_k[batch, :, start:end].flatten(0, 1).baddbmm_(scores.transpose(1, 2), queries, alpha=scale)
        grad_sinks = None
        if sinks is not None and ctx.needs_input_grad[5]:
            sink_weight = (sinks.to(wide) - lse).exp()  # (B, N, T, 1)
            grad_sinks = (-sink_weight * rowsum).sum_to_size(sinks.shape).to(sinks.dtype)  # (B, N, T, 1), dims may be 1
        grad_bias = None if grad_bias is None else grad_bias.view(bias.shape).to(bias.dtype)
        grads = (grad_q.to(low), grad_k.to(low), grad_v.to(low), None, grad_bias, grad_sinks)
        return *grads, None, None, None, None, None, None


def _softcapped_attention(q, k, v, keep, bias, causal, window, chunk, scale, softcap, sinks):
    """Soft-capped attention without returned weights or dropout, `dot_product_attention`'s
    numbers a tile at a time (`_SoftcappedTiles`), or in blocks of whole rows (`_Softcapped`)
    where no one shift fits the cap (`_cap_shift`); returns the (B, N, T, Hv) context."""
    (n, t), s = q.shape[1:3], k.shape[2]
    k, v = _repeat_heads(k, n), _repeat_heads(v, n)  # (B, K, S, H) -> (B, N, S, H)
    q, k, v = (x.contiguous() for x in (q, k, v))  # a block's or tile's rows as views, not copies
    shift = _cap_shift(softcap, torch.promote_types(q.dtype, torch.float32))
    if shift is None:
        keep, bias = _final_masks(keep, bias, causal, window, chunk, sinks, t, s, q.device)
        return _Softcapped.apply(q, k, v, keep, bias, sinks, scale, softcap, causal, window)  # (B, N, T, Hv)
    whole = keep is None and chunk is None  # the mask then holds causal and window only
    keep, _ = _final_masks(keep, None, causal, window, chunk, None, t, s, q.device)
    sinks = None if sinks is None else sinks[None, :, None, None]  # (N,) -> (1, N, 1, 1)
    if bias is not None and s > 0:
        top = _as_4d(_row_top(bias.detach(), keep))  # (B, N, T, 1), dims may be 1
        bias, sinks = bias - top, None if sinks is None else sinks - top  # the same softmax
    return _SoftcappedTiles.apply(
        q, k, v, keep, bias, sinks, scale, softcap, shift, causal, window, whole
    )  # (B, N, T, Hv)


def _sdpa_heads(q, k, v, masked):
    """Keys, values and `enable_gqa` for SDPA. Grouped heads are read by the flash kernels only
    (on the CPU, and on CUDA in float16 and bfloat16 without a mask); elsewhere SDPA would fall
    back to its math kernel, which holds the (B, N, T, S) scores, so k and v are repeated."""
    if q.shape[1] == k.shape[1]:
        return k, v, False
    if q.device.type == "cpu" or (not masked and q.dtype in (torch.float16, torch.bfloat16)):
        return k, v, True
    return _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1]), False  # (B, K, S, H) -> (B, N, S, H)


def _in_dtype(bias, dtype):
    """An additive mask in SDPA's mask dtype (q's), clamped to its finite range where it is narrower."""
    if bias.dtype == dtype:
        return bias
    info = torch.finfo(dtype)
    return bias.clamp(info.min, info.max).to(dtype)


def _sdpa_with_sinks(q, k, v, keep, bias, dropout, scale, is_causal, sinks):
    """SDPA with the sinks as one more key, the first, whose score is its head's sink logit and
    whose value is 0: the softmax's denominator gains exp(sink) and the context nothing, as in
    `dot_product_attention`. The score comes from one more feature of each head, sink / scale in
    head n's queries and 1 in the sink key (0 in the other keys), so grouped heads still share
    their keys and the sinks' gradient flows through it. The head size is padded to a multiple of
    8 with zeros (v too: the fused kernels want one head size). With `is_causal` one more query,
    the first, keeps the kernel's top-left triangle aligned: query t + 1 sees the sink and keys
    0..t. A row with no key left attends only the sink: a context of exactly 0."""
    (b, n, t, h), s, hv = q.shape, k.shape[2], v.shape[-1]  # hv: H, or Hv with MLA
    width = -(-max(h + 1, hv) // 8) * 8  # H + 1 features (at least Hv), padded to a multiple of 8
    logit = (sinks / scale).to(q.dtype)[:, None, None].expand(b, n, t, 1)  # (N,) -> (B, N, T, 1)
    q = F.pad(torch.cat([q, logit], dim=-1), (0, width - h - 1))  # (B, N, T, H) -> (B, N, T, width)
    one = k.new_ones((*k.shape[:2], 1, 1))  # (B, K, 1, 1), also when S = 0
    sink_key = F.pad(one, (h, width - h - 1))  # (B, K, 1, width): a 1 at feature H
    k = torch.cat([sink_key, F.pad(k, (0, width - h))], dim=2)  # (B, K, S, H) -> (B, K, 1 + S, width)
    v = F.pad(v, (0, width - hv, 1, 0))  # (B, K, S, H) -> (B, K, 1 + S, width), the sink's value 0
    q = F.pad(q, (0, 0, 1, 0)) if is_causal else q  # (B, N, 1 + T, width) with `is_causal`
    keep = None if keep is None else F.pad(keep.expand(*keep.shape[:-1], s), (1, 0), value=True)  # (..., 1 + S)
    bias = None if bias is None else F.pad(bias.expand(*bias.shape[:-1], s), (1, 0))  # (..., 1 + S)
    context = _sdpa_attention(q, k, v, keep, bias, dropout, scale, is_causal)  # (B, N, [1 +] T, width)
    return context[:, :, 1 if is_causal else 0 :, :hv]  # (B, N, T, H)


def segment_ids_from_position_ids(position_ids):
    """Segment ids from positions that restart at each document (transformers' padding-free
    `position_ids`, `DataCollatorWithFlattening`): (B, T) or (T,) integers -> the same shape,
    0 for a row's first document, then 1, 2, ...; a document starts at t = 0 and wherever a
    position is not one more than the one before it."""
    positions = torch.as_tensor(position_ids)
    starts = torch.ones_like(positions, dtype=torch.long)  # (B, T)
    starts[..., 1:] = positions[..., 1:] != positions[..., :-1] + 1
    return starts.cumsum(-1) - 1  # (B, T)


def segment_ids_from_cu_seqlens(cu_seqlens, total_length=None):
    """Segment ids from the cumulative lengths of `varlen_attn` / flash-attention (0, len_0,
    len_0 + len_1, ..., T): (D + 1,) integers -> (1, T), document d at [cu[d], cu[d + 1]).
    `total_length` (default cu[-1]) may exceed cu[-1]: the tail is one more document."""
    cu = _check_cu_seqlens(torch.as_tensor(cu_seqlens))
    length = int(cu[-1]) if total_length is None else int(total_length)
    steps = torch.arange(length, device=cu.device)
    return torch.searchsorted(cu[1:].contiguous(), steps, right=True)[None, :]  # (1, T)


def _check_cu_seqlens(cu):
    integer = not cu.is_floating_point() and not cu.is_complex() and cu.dtype != torch.bool
    if cu.dim() != 1 or cu.numel() < 1 or not integer or cu[0] != 0 or bool((cu.diff() < 0).any()):
        raise ValueError(
            "`cu_seqlens` must be a 1-D integer tensor starting at 0 and non-decreasing. "
            f"Received: cu_seqlens={cu.tolist()}"
        )
    return cu


def _check_segment_ids(name, ids, batch_size, length, letter, device):
    """Checks (B, L) integer segment ids ((L,) for an unbatched call: a batch of one)."""
    ids = torch.as_tensor(ids, device=device)
    ids = ids[None] if ids.dim() == 1 and batch_size == 1 else ids
    integer = not ids.is_floating_point() and not ids.is_complex() and ids.dtype != torch.bool
    if not integer or tuple(ids.shape) != (batch_size, length):
        raise ValueError(
            f"`{name}` must be an integer tensor of shape (B, {letter})=({batch_size}, {length}). "
            f"Received: {name}.shape={tuple(ids.shape)}, {name}.dtype={_dtype_name(ids.dtype)}"
        )
    return ids


def _segment_ids_error(message):
    return ValueError(f"{message} (packed sequences, docs/SPEC.md, 'Packed sequences')")


def _segment_keep(layer, call, segment_ids, key_segment_ids):
    """Packed sequences: (B, 1, T, S) `same` and the call's cache. Query t keeps key s only if
    segment_ids[b, t] == key_segment_ids[b, s],
    ANDed into `attention_mask` (a float mask gets -inf there), so every path computes it through
    its keep. Key ids default to `segment_ids` when S == T (self-attention). With a cache the key
    ids of the T new tokens are written to the cache's `segment_ids` (in place; made at the first
    packed call of an empty cache) and the mask is over its L slots; a call without ids continues
    the document of the last written slot."""
    (b, t), device = call.query.shape[:2], call.query.device
    cache = call.cache
    if segment_ids is None and (cache is None or cache.segment_ids is None):
        raise _segment_ids_error("`key_segment_ids` needs `segment_ids`")
    if cache is not None:
        index, length = int(cache.index), cache.key.shape[2]
        if segment_ids is None:  # the new tokens continue the last written slot's document
            segment_ids = cache.segment_ids[:, (index - 1) % length, None].expand(b, t).clone()
        if cache.segment_ids is None and index > 0:
            raise _segment_ids_error(
                "`cache` holds tokens written without `segment_ids`; pass them from the first call"
            )
    segment_ids, key_ids = _checked_segment_ids(call, segment_ids, key_segment_ids)
    if cache is not None:
        ids = cache.segment_ids
        ids = torch.zeros(b, length, dtype=torch.long, device=device) if ids is None else ids
        ids[:, (index + torch.arange(t, device=device)) % length] = key_ids.to(ids.dtype)  # (B, L), in place
        key_ids, cache = ids, cache._replace(segment_ids=ids)
    return _same_documents(segment_ids, key_ids), cache


def _checked_segment_ids(call, segment_ids, key_segment_ids):
    """The (B, T) query ids and (B, S) key ids of a packed call, checked; the key ids default to
    `segment_ids` when S == T (self-attention)."""
    (b, t), s, device = call.query.shape[:2], call.key.shape[1], call.query.device
    if segment_ids is None:
        raise _segment_ids_error("`key_segment_ids` needs `segment_ids`")
    segment_ids = _check_segment_ids("segment_ids", segment_ids, b, t, "T", device)
    if key_segment_ids is None and s != t:
        raise _segment_ids_error("cross-attention (S != T) needs `key_segment_ids` (B, S)")
    key_ids = segment_ids
    if key_segment_ids is not None:
        key_ids = _check_segment_ids("key_segment_ids", key_segment_ids, b, s, "S", device)
    return segment_ids, key_ids


def _same_documents(segment_ids, key_ids):
    """(B, T) and (B, S) ids -> the (B, 1, T, S) keep of packed sequences."""
    return segment_ids[:, None, :, None] == key_ids[:, None, None, :]  # (B, 1, T, S)


def _packed(layer, call, segment_ids, key_segment_ids):
    """Packed sequences ANDed into `attention_mask` (`_segment_keep`), the call marked `segmented`;
    or, where the blocks of documents apply (`_by_documents`), the call's `segments`, its blocks."""
    if _by_documents(layer, call):
        ids, key_ids = _checked_segment_ids(call, segment_ids, key_segment_ids)  # (B, T), (B, S)
        blocks = _document_blocks(ids.numpy(), key_ids.numpy(), call.causal, call.window)
        return call._replace(segments=(ids, key_ids, blocks), segmented=True)
    same, cache = _segment_keep(layer, call, segment_ids, key_segment_ids)
    mask = call.attention_mask
    if mask is not None:
        mask = mask if mask.dim() == 4 else mask[None, None] if mask.dim() == 2 else mask[:, None]  # rank 4
        same = mask & same if mask.dtype == torch.bool else torch.where(same, mask, float("-inf"))
    return call._replace(attention_mask=same, cache=cache, segmented=True)


def _by_documents(layer, call):
    """Whether a packed call is attended a block of documents at a time (`_attend_documents`): an
    eager call on the CPU (its ids read there, no device sync) without a cache, returned weights
    or dropout. Elsewhere (`torch.compile`, `torch.export`, `torch.jit.trace`, another device, a
    cache) the ids become a dense (B, 1, T, S) keep."""
    dropout = layer.dropout and layer.training
    plain = call.cache is None and not call.return_attention and not dropout
    return plain and call.query.device.type == "cpu" and _eager() and not torch.compiler.is_exporting()


def _document_blocks(ids, key_ids, causal, window):
    """The blocks of `_attend_documents` from (B, T) and (B, S) NumPy ids: [(batch elements,
    [(first query, end query, first key, end key, mixed), ...])], one list for all rows where
    their ids are equal, else one a row. A block is a run of queries of one id (runs shorter than
    `_DOCUMENT_ROWS` joined with the next) with the keys from the first to the last that hold one
    of its ids, within those `causal` and `window` let its rows see (`_key_range`); `mixed`
    where those keys hold another id too. A block whose ids no key holds is left out."""
    b = ids.shape[0]
    same_rows = (ids == ids[:1]).all() and (key_ids == key_ids[:1]).all()
    batches = [slice(None)] if same_rows else [slice(i, i + 1) for i in range(b)]
    return [(batch, _row_blocks(ids[batch][0], key_ids[batch][0], causal, window)) for batch in batches]


def _row_blocks(row, keys, causal, window):
    """`_document_blocks` of one row: (T,) query ids and (S,) key ids."""
    t, s = len(row), len(keys)
    known, first = np.unique(keys, return_index=True)  # each key id and its first key
    last = s - 1 - np.unique(keys[::-1], return_index=True)[1]  # and its last key
    starts = np.flatnonzero(np.concatenate([[True], row[1:] != row[:-1]]))  # where a run of one id starts
    blocks, top = [], 0
    for end in [int(x) for x in starts[1:]] + [t]:
        if end - top < _DOCUMENT_ROWS and end < t:
            continue  # a short run: joined with the next
        own = np.unique(row[top:end])
        found = np.searchsorted(known, own).clip(max=len(known) - 1)
        found = found[known[found] == own]  # the block's ids that some key holds
        near, far = _key_range(top, end, t, s, causal, window)
        if len(found):
            start, stop = max(near, int(first[found].min())), min(far, int(last[found].max()) + 1)
            mixed = len(own) > 1 or bool((keys[start:stop] != own[0]).any())
            blocks += [(top, end, start, stop, mixed)] if stop > start else []
        top = end
    return blocks


def _attend_documents(layer, q, k, v, keep, bias, call):
    """Step 6 of a packed call a block of documents at a time (`_document_blocks`): each block's
    queries attend only its keys, through `_attend` (SDPA or soft-capping's tiles), with the
    block's part of the keep and bias and, where the block is `mixed`, of the ids' keep. `causal`
    and `window` go on to the block where its last query and last key keep the call's alignment
    (S - T); else they, as the attention chunk always, are folded into the block's keep. Rows
    that no block reaches (no key of their document) are 0, as rows with no key. q, k and v are
    cut with one `split` each where the parts do not overlap (`_parts`): the backward adds no
    (B, N, T, H) tensor a block. Under autograd each block is recomputed in the backward
    (`_attend_block`) and the outputs are joined by `_Joined`: the context is kept once."""
    t, s = q.shape[2], k.shape[2]
    ids, key_ids, groups = call.segments  # (B, T), (B, S), the blocks
    single = len(groups) == 1  # all rows' ids alike: the blocks cut every row at once
    rows = zip(*(x.split(1) for x in (q, k, v)), strict=True) if not single else [(q, k, v)]  # (1|B, N|K, T|S, H) each
    outs, places = [], []
    for (batch, blocks), (q_row, k_row, v_row) in zip(groups, rows, strict=True):
        queries = _parts(q_row, [block[:2] for block in blocks])  # (1|B, N, tq, H) each
        keys, values = (_parts(x, [block[2:4] for block in blocks]) for x in (k_row, v_row))  # (1|B, K, S', H) each
        for (top, end, start, stop, mixed), *block in zip(blocks, queries, keys, values, strict=True):
            part = (batch, slice(top, end), start, stop)
            block_keep, block_bias = _block_of(keep, part), _block_of(bias, part)  # (r|1, N|1, tq|1, S'|1)
            if mixed:
                same = _same_documents(ids[batch, top:end], key_ids[batch, start:stop])  # (r, 1, tq, S')
                block_keep = _and(block_keep, same)  # (r, 1, tq, S')
            sub = call._replace(segments=None, attention_chunk_size=None)
            if stop - end != s - t or call.attention_chunk_size is not None:
                rules = _block_rules(call.causal, call.window, call.attention_chunk_size, part, t, s, q.device)
                block_keep, sub = _and(block_keep, rules), sub._replace(causal=False, window=None)  # (tq, S') rules
            outs.append(_attend_block(layer, block, block_keep, block_bias, sub))  # (r, N, tq, Hv)
            places.append((batch, top, end))
    shape = (q.shape[0], q.shape[1], t, v.shape[-1])  # (B, N, T, Hv)
    return (_Joined.apply(shape, places, *outs) if outs else q.new_zeros(shape)), None  # (B, N, T, Hv)


def _attend_block(layer, block, keep, bias, call):
    """One block's `_attend` -> (r, N, tq, Hv). Under autograd it runs again in the backward
    (`torch.utils.checkpoint`): its output is kept once, in the joined context, not a second
    time for its own backward."""
    if not torch.is_grad_enabled():
        return layer._attend(*block, keep, bias, call)[0]
    attend = torch.utils.checkpoint.checkpoint  # no dropout here (`_by_documents`): no random state to keep
    return attend(layer._attend, *block, keep, bias, call, use_reentrant=False, preserve_rng_state=False)[0]


class _Joined(torch.autograd.Function):
    """The context of `_attend_documents`: each block's (r, N, tq, Hv) output written into its
    rows of one (B, N, T, Hv) tensor in SDPA's (B, T, N, Hv) layout, 0 where no block is. The
    backward hands each block its own copy of its rows' gradient: the (B, T, N, Hv) gradient is
    freed before the blocks' backward, each copy after its block's."""

    @staticmethod
    def forward(ctx, shape, places, *outs):
        b, n, t, hv = shape
        joined = outs[0].new_zeros(b, t, n, hv)  # (B, T, N, Hv)
        for (batch, top, end), out in zip(places, outs, strict=True):
            joined[batch, top:end] = out.transpose(1, 2)  # (r, N, tq, Hv) -> (r, tq, N, Hv)
        ctx.places = places
        return joined.transpose(1, 2)  # (B, T, N, Hv) -> (B, N, T, Hv)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.transpose(1, 2)  # (B, N, T, Hv) -> (B, T, N, Hv)
        parts = (grad[batch, top:end].clone().transpose(1, 2) for batch, top, end in ctx.places)  # (r, N, tq, Hv)
        return None, None, *parts


def _parts(x, spans):
    """The parts [first, end) of x (B, heads, L, H) along L: views of one `split` where the spans
    do not overlap (the backward then joins the gradients once, in the (B, L, heads, H) layout of
    the projections and of SDPA's gradients, where a part is one block of memory), else slices."""
    apart = all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    if not apart:
        return [x[:, :, first:end] for first, end in spans]
    bounds = sorted({0, x.shape[2], *(bound for span in spans for bound in span)})
    split = x.transpose(1, 2).split(np.diff(bounds).tolist(), dim=1)  # (B, l, heads, H) each
    pieces = dict(zip(bounds[:-1], (piece.transpose(1, 2) for piece in split), strict=True))  # first -> its part
    return [pieces[first] for first, _ in spans]


def _block_rules(causal, window, chunk, part, t, s, device):
    """The (tq, S') keep of `causal`, `window` and the attention chunk over one block's rows and
    keys (bottom-right aligned over the whole call, as `causal_mask`, `window_mask` and
    `attention_chunk_mask`), or None."""
    _, rows, start, stop = part
    queries = torch.arange(rows.start, rows.stop, device=device)[:, None] + (s - t)  # (tq, 1), as key positions
    keys = torch.arange(start, stop, device=device)[None, :]  # (1, S')
    before, after = _window_sides(window)
    rules = [keys <= queries] if causal else []  # (tq, S') each
    rules += [] if before is None else [keys > queries - before]
    rules += [] if after is None else [keys < queries + after]
    rules += [] if chunk is None else [keys // chunk == queries // chunk]
    keep = None
    for rule in rules:
        keep = _and(keep, rule)
    return keep


_DOCUMENT_ROWS = 128  # queries of a block of `_document_blocks` at least, documents joined up to it


# -------------------------------------------------------------------------------------------------
# Section: positions
# -------------------------------------------------------------------------------------------------
# Rotary position embeddings (`rope_theta`, `rope_fraction`, `rope_interleaved`, `rope_scaling`,
# `rope_sections`: Llama, GPT-NeoX, GPT-J, Llama 3.1, gpt-oss's YaRN, Qwen2-VL's M-RoPE): the checks,
# the frequencies and their scalings, the call's positions and the turn, with its own backward.
# `rope_scaling` is a dict as `transformers` writes it: {"rope_type": "linear", "factor"},
# {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
# "original_max_position_embeddings"} (Llama 3.1) or {"rope_type": "yarn", "factor",
# "original_max_position_embeddings", optional "attention_factor", "beta_fast", "beta_slow", "mscale",
# "mscale_all_dim", "truncate"} (gpt-oss; the rotated features of q and k are also multiplied by its
# attention factor) or {"rope_type": "proportional", optional "factor", "partial_rotary_factor"} (Gemma 4,
# LFM3: the last pairs of the R features unturned). With MLA RoPE turns the last Hr features of q and the
# key part shared by the heads.


_ROPE_SCALING = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "proportional": (),
}


_YARN_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _check_rope(rope_width, rope_theta, rope_fraction, rope_scaling, rope_sections):
    """RoPE's constructor arguments checked, in this order: (rope_theta, rope_fraction,
    rope_scaling, rope_sections); RoPE turns features of heads `rope_width` wide (H, or Hr with
    MLA). `rope_interleaved` is a flag (`_check_variants`)."""
    rope_theta = _positive_float("rope_theta", rope_theta, optional=True)
    rotary = _rotary_dim(rope_fraction, rope_width, rope_theta is not None)  # checks rope_fraction
    rope_scaling = _check_rope_scaling(rope_scaling)
    rope_sections = _check_rope_sections(rope_sections, rotary)
    return rope_theta, float(rope_fraction), rope_scaling, rope_sections


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
    """A copy of `rope_scaling` (None, or a dict as `transformers` writes it), checked."""
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    parameters = _ROPE_SCALING.get(kind, ())
    valid = kind in _ROPE_SCALING and all(_is_positive_number(scaling.get(name)) for name in parameters)
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
    """`rope_sections` as a tuple of Python ints (None passes; at least one section); with RoPE
    (`rotary` R not None) they must sum to R/2, the rotated pairs."""
    if sections is None:
        return None
    valid = isinstance(sections, (list, tuple)) and len(sections) > 0
    if not valid or not all(_is_positive_int(size) for size in sections):
        raise ValueError(
            "`rope_sections` must be None or a list or tuple of positive integers. "
            f"Received: rope_sections={sections!r}"
        )
    if rotary is not None and sum(sections) != rotary // 2:
        raise ValueError(
            f"`rope_sections` must sum to R/2 = {rotary // 2}, the pairs RoPE rotates "
            f"(R = int(head_dim * rope_fraction) = {rotary}). Received: rope_sections={sections!r}"
        )
    return tuple(int(size) for size in sections)


def _positions(layer, positions, query, key, cache):
    """Step 1 for RoPE: checked (B, T) positions ((k, B, T) with `rope_sections`), arange(T)
    (+ the cache's index) by default, the same for every section."""
    if layer.rope_theta is None:
        if positions is not None:
            raise ValueError(
                "`positions` needs RoPE: construct the layer with `rope_theta`. "
                "Received: positions with rope_theta=None"
            )
        return None
    (b, t), s = query.shape[:2], key.shape[1]
    if cache is None and s != t:
        raise ValueError(
            "RoPE needs `key` and `value` to hold the query's own tokens (S == T, or decoding with `cache`). "
            f"Received: query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
        )
    if positions is None:
        start = 0 if cache is None else cache.index
        positions = start + torch.arange(t, device=query.device)  # (T,)
    return _check_positions(positions, b, t, layer.rope_sections)  # (B, T) or (k, B, T)


def _check_positions(positions, b, t, sections=None):
    """Checks integer (B, T) or (T,) `positions` and returns them as (B, T); with k `sections`
    also (k, B, T), and returns them as (k, B, T)."""
    shapes = ((b, t), (t,)) if sections is None else ((b, t), (t,), (len(sections), b, t))
    if not _is_integer(positions) or tuple(positions.shape) not in shapes:
        expected = "(B, T) or (T,)" if sections is None else f"(B, T), (T,) or ({len(sections)}, B, T)"
        rows = "" if sections is None else " (one row per section of `rope_sections`)"
        raise ValueError(
            f"`positions` must be an integer tensor of shape {expected} with B={b}, T={t}{rows}. "
            f"Received: positions.shape={tuple(positions.shape)}, positions.dtype={_dtype_name(positions.dtype)}"
        )
    return positions.expand(b, t) if sections is None else positions.expand(len(sections), b, t)  # (B, T), (k, B, T)


def document_positions(segment_ids):
    """RoPE positions of packed sequences: (B, T) or (T,) segment ids -> positions of the same
    shape that restart at 0 wherever the id changes (each document numbered from 0)."""
    ids = torch.as_tensor(segment_ids)
    steps = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)  # (B, T)
    starts = torch.ones_like(ids, dtype=torch.bool)  # (B, T)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    first = torch.where(starts, steps, 0).cummax(-1).values  # (B, T), where each document starts
    return steps - first  # (B, T)


def rope_frequencies(rotary_dim, theta, scaling=None, *, device=None):
    """The RoPE frequencies inv_freq[i] = theta ** (-2i / R) for i in [0, R/2), rewritten by
    `scaling` (None, or a `transformers` rope_scaling dict: "linear", "llama3", "yarn" or "proportional").

    Returns:
        inv_freq (R/2,) float32, computed in float64 and rounded once.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim  # (R/2,)
    inv_freq = torch.pow(theta, -exponents)  # (R/2,)
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    if kind == "llama3":
        inv_freq = _llama3_frequencies(inv_freq, scaling)
    if kind == "yarn":
        inv_freq = _yarn_frequencies(inv_freq, theta, scaling)
    if kind == "proportional":
        inv_freq = _proportional_frequencies(inv_freq, scaling)
    return inv_freq.float()


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
    scaled = torch.where(wavelength > context / low, inv_freq / factor, smoothed)  # (R/2,)
    return torch.where(wavelength < context / high, inv_freq, scaled)  # (R/2,)


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
    pairs = torch.arange(rotary_dim // 2, dtype=inv_freq.dtype, device=inv_freq.device)  # (R/2,)
    ramp = ((pairs - low) / (high - low)).clamp(0.0, 1.0)  # (R/2,), 1 = interpolated
    return inv_freq / scaling["factor"] * ramp + inv_freq * (1.0 - ramp)  # (R/2,)


def _proportional_frequencies(inv_freq, scaling):
    """Proportional RoPE's rewrite (transformers' `_compute_proportional_rope_parameters`: Gemma 4,
    LFM3): the first A = int(partial_rotary_factor * R // 2) pairs keep inv_freq, the last R/2 - A
    turn by 0 (pass unchanged), all divided by `factor` (both default to 1)."""
    pairs = torch.arange(inv_freq.shape[0], device=inv_freq.device)  # (R/2,)
    turned = int((scaling.get("partial_rotary_factor") or 1.0) * (2 * inv_freq.shape[0]) // 2)
    return torch.where(pairs < turned, inv_freq, 0.0) / (scaling.get("factor") or 1.0)  # (R/2,)


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


def _reset_rope(layer):
    """`_inv_freq` computed (`rope_frequencies`, float32) on the device it is on."""
    if layer._inv_freq is not None:
        device = layer._inv_freq.device
        layer._inv_freq = rope_frequencies(layer._rotary_dim, layer.rope_theta, layer.rope_scaling, device=device)


def _rotate(layer, q, k, positions):
    """Step 4, RoPE: q and k turned at their (B, T) positions by the frequencies `_inv_freq`
    (with `rope_sections`, (k, B, T) positions: each section of pairs by its row). MLA turns its
    own (`_project_latent`)."""
    return _turn_heads(layer, q, positions), _turn_heads(layer, k, positions)


def _turn_heads(layer, x, positions):
    """RoPE of the first R features of each head of x (B, heads, T, H), times YaRN's factor."""
    inv_freq = layer._inv_freq.to(x.device)  # (R/2,) float32
    sections = layer.rope_sections, layer.rope_sections_interleaved  # multimodal RoPE: sections (or None), their layout
    x = apply_rope(x, positions, inv_freq, layer.rope_interleaved, *sections)  # (B, heads, T, H)
    return scale_rotated(x, layer._rotary_dim, rope_attention_factor(layer.rope_scaling))


def scale_rotated(x, rotary_dim, factor):
    """The first R (rotated) features of each head of x (B, heads, T, H) times `factor` (YaRN)."""
    if factor == 1.0:
        return x
    if rotary_dim == x.shape[-1]:
        return x * factor
    return torch.cat((x[..., :rotary_dim] * factor, x[..., rotary_dim:]), dim=-1)  # (B, heads, T, H)


def apply_rope(x, positions, inv_freq, interleaved, sections=None, sections_interleaved=False):
    """Rotary position embeddings: turns the first R = 2 * len(inv_freq) features of each head.

    Args:
        x: (B, heads, T, H) queries or keys.
        positions: (B, T) integer positions, or (k, B, T) with `sections`.
        inv_freq: (R/2,) float32 frequencies from `rope_frequencies`.
        interleaved: False pairs feature i with feature i + R/2 ("rotate half": Llama, GPT-NeoX);
            True pairs features 2i and 2i + 1 (GPT-J).
        sections: None, or k numbers of pairs summing to R/2 (multimodal RoPE, Qwen2-VL): the
            pairs of section j turn by the positions of row j.
        sections_interleaved: if True, the sections' pairs are dealt in turn (`_section_rows`,
            Qwen3-VL), not in runs.

    Returns:
        x with each pair (x1, x2) at position p turned to (x1 cos - x2 sin, x2 cos + x1 sin) by the
        angle p * inv_freq[i] (computed in float32), cast back to x's dtype; the other H - R
        features unchanged.
    """
    angles = rope_angles(positions, inv_freq, sections, sections_interleaved)  # (B, T, R/2)
    angles = angles[:, :, None, :]  # (B, T, R/2) -> (B, T, 1, R/2)
    cos, sin = angles.cos(), angles.sin()  # (B, T, 1, R/2)
    cos, sin = _on_pairs(cos, cos, interleaved), _on_pairs(-sin, sin, interleaved)  # (B, T, 1, R)
    x = x.transpose(1, 2)  # (B, heads, T, H) -> (B, T, heads, H), the projections' memory order
    return _Turn.apply(x, cos, sin, interleaved).transpose(1, 2)  # -> (B, heads, T, H)


def rope_angles(positions, inv_freq, sections=None, sections_interleaved=False):
    """(B, T, R/2) float32 angles: (B, T) positions times the (R/2,) inv_freq; with `sections`
    (multimodal RoPE) pair i turns by positions[j] * inv_freq[i] from (k, B, T) positions, j its
    row (`_section_rows`: runs of the sections' sizes, or dealt in turn with `sections_interleaved`)."""
    if sections is None:
        return positions[:, :, None].float() * inv_freq  # (B, T, 1) * (R/2,) -> (B, T, R/2)
    index = torch.tensor(_section_rows(sections, sections_interleaved), device=positions.device)  # (R/2,)
    return positions.index_select(0, index).permute(1, 2, 0).float() * inv_freq  # (k, B, T) -> (B, T, R/2)


def _section_rows(sections, interleaved):
    """The row of (k, B, T) positions that turns each of the R/2 pairs: row j turns a run of
    `sections[j]` pairs, in order; `interleaved` (Qwen3-VL) deals them in turn: pair i by row
    i % k while i < k * sections[i % k], else by row 0."""
    k = len(sections)
    if not interleaved:
        return [j for j, size in enumerate(sections) for _ in range(size)]
    return [i % k if i < k * sections[i % k] else 0 for i in range(sum(sections))]


def _turn(x, cos, sin, interleaved):
    """(B, T, heads, H) -> (B, T, heads, H): swapped * sin + x * cos on the first R features (cos
    and sin (B, T, 1, R) on pairs, as `apply_rope` makes them), in float32 at least, in place in
    the swapped copy (one new tensor, not three); the other H - R features unchanged."""
    rotary_dim = cos.shape[-1]
    rotary = x[..., :rotary_dim].to(torch.promote_types(x.dtype, torch.float32))  # (B, T, heads, R)
    turned = _swap_pairs(rotary, interleaved).mul_(sin).addcmul_(rotary, cos).to(x.dtype)  # (B, T, heads, R)
    return turned if rotary_dim == x.shape[-1] else torch.cat((turned, x[..., rotary_dim:]), dim=-1)


def _on_pairs(first, second, interleaved):
    """Two (..., R/2) values of each pair -> (..., R): on its first and on its second feature."""
    if interleaved:
        return torch.stack((first, second), dim=-1).flatten(-2)  # (..., R/2, 2) -> (..., R)
    return torch.cat((first, second), dim=-1)  # (..., R)


def _swap_pairs(x, interleaved):
    """(..., R) -> a new (..., R): each pair (x1, x2) as (x2, x1). With cos on both features and
    (-sin, sin) on the pair, x * cos + swapped * sin = (x1 cos - x2 sin, x2 cos + x1 sin)."""
    if interleaved:
        return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (..., R/2, 2) flipped -> (..., R)
    x1, x2 = x.chunk(2, dim=-1)  # (..., R/2) each
    return torch.cat((x2, x1), dim=-1)  # (..., R)


class _Turn(torch.autograd.Function):
    """`_turn` with its own backward, the gradient turned by the opposite angle (a rotation's
    transpose: sin negated), so autograd records one step and a backward is one turn."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _turn(x, cos, sin, interleaved)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _Turn.apply(grad, cos, -sin, ctx.interleaved), None, None, None


# Queries scaled by position (`query_scaling`, docs/SPEC.md "Queries scaled by position"): each query row times
# 1 + beta * ln(1 + floor(p / floor)). "temperature" (Llama 4's attention temperature tuning) counts p = i + t + 1
# from the cache's index i (0 without a cache), the same for every row, left padding included; "positions"
# (Mistral 4's and Ministral 3's `llama_4_scaling_beta`) reads the (B, T) RoPE positions (`positions`, by default
# i + t). A constant per query row, so q's gradient is scaled by it too. "learned" (Mistral Large 4's
# `softmax_scaling`) multiplies query head n by query_scaling_scale[n] * ln(1 + p) + query_scaling_bias[n], p read
# as "positions" reads it; its two (N,) parameters have gradients.


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


def _make_query_scaling(layer):
    """The learned scaling's (N,) parameters `query_scaling_scale` and `query_scaling_bias` (None without it),
    on the layer's device and dtype."""
    shapes, weight = _query_scaling_shapes(layer), layer.output.weight
    for name in ("query_scaling_scale", "query_scaling_bias"):
        value = torch.empty(shapes[name], device=weight.device, dtype=weight.dtype) if shapes else None
        setattr(layer, name, None if value is None else nn.Parameter(value))  # (N,)


def _reset_vectors(layer, names):
    """Each parameter of `names` the layer has: ones for a norm's scale and a learned scaling's bias, else zeros."""
    for name in (name for name in names if getattr(layer, name, None) is not None):
        (nn.init.ones_ if name.endswith(("_norm", "_scaling_bias")) else nn.init.zeros_)(getattr(layer, name))


def _is_finite_number(value):
    number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    return number and math.isfinite(value)


def _position_step(layer, q, k, call, rotate):
    """Steps 4 and 4b: RoPE of q (B, N, T, H) and k (B, K, T, H) where `rotate` (MLA turns its own in step 2),
    then each query row times its scale."""
    if rotate and layer.rope_theta is not None:
        q, k = _rotate(layer, q, k, call.positions)  # 4. RoPE
        q, k = _normalize_qk(layer, q, k) if layer._qk_norm_late else (q, k)  # 4. QK-norm after RoPE
    return (q, k) if layer.query_scaling is None else (q * _query_scales(layer, q, call), k)


def _query_scales(layer, q, call):
    """Step 4b: the (B|1, 1, T, 1) factor of each query row of q (B, N, T, H), 1 + beta * ln(1 + floor(p /
    floor)), computed in float32 (float64 for a float64 q) as transformers does, in q's dtype."""
    scaling, t = layer.query_scaling, q.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    if scaling["type"] != "temperature" and call.positions is not None:
        positions = call.positions.to(dtype)  # (B, T)
    else:
        start = 0 if call.cache is None else call.cache.index
        steps = start + torch.arange(t, device=q.device) + int(scaling["type"] == "temperature")  # (T,)
        positions = steps.to(dtype)[None]  # (1, T)
    if scaling["type"] == "learned":
        return _learned_scales(layer.query_scaling_scale, layer.query_scaling_bias, positions, q.dtype)
    scales = 1.0 + scaling["beta"] * torch.log(1.0 + torch.floor(positions / scaling["floor"]))  # (B|1, T)
    return scales.to(q.dtype)[:, None, :, None]  # (B|1, T) -> (B|1, 1, T, 1)


def _learned_scales(scale, bias, positions, dtype):
    """The learned factor scale[n] * ln(1 + p) + bias[n] of head n at (B|1, T) positions, in `dtype` as
    transformers computes it (ln(1 + p) in float32 at least, then cast): (B|1, heads, T, 1)."""
    logs = torch.log(1.0 + positions.to(torch.promote_types(positions.dtype, torch.float32))).to(dtype)  # (B|1, T)
    scale, bias = scale.to(dtype), bias.to(dtype)  # (heads,)
    return scale[None, :, None, None] * logs[:, None, :, None] + bias[None, :, None, None]  # (B|1, heads, T, 1)


# -------------------------------------------------------------------------------------------------
# Section: QK-norm, clip_qkv and the gate
# -------------------------------------------------------------------------------------------------
# `qk_norm` (RMSNorm or LayerNorm, `qk_norm_bias`: Qwen3, OLMo2, StableLM, Phi), `clip_qkv` (q, k
# and v clamped after the projections: OLMo, DBRX, MPT) and `gate` (each head's result times
# sigmoid(query @ gate_kernel + gate_bias): Keras' `use_gate`, Qwen3-Next; softplus instead with
# `gate_activation="softplus"`: Laguna); `output_norm` (RMSNorm or LayerNorm of the merged heads before
# the output projection, weights `context_norm` and `context_norm_bias`: BitNet, Kosmos-2);
# `qk_norm_after_rope` (QK-norm of the turned q and k, in step 4: HunYuan).


_GATE_ACTIVATIONS = ("sigmoid", "softplus")  # the values `gate_activation` takes


def _check_norms(qk_norm, qk_norm_eps, qk_norm_type, clip_qkv):
    """QK-norm's and clip_qkv's constructor arguments checked, in this order: (qk_norm,
    qk_norm_eps, qk_norm_type, clip_qkv). `qk_norm_bias` and `gate` are flags (`_check_variants`)."""
    if qk_norm not in (None, "head", "per_head", "all"):
        raise ValueError(f"`qk_norm` must be None, 'head', 'per_head' or 'all'. Received: qk_norm={qk_norm!r}")
    qk_norm = None if qk_norm is None else str(qk_norm)  # np.str_ held as str
    qk_norm_eps = _positive_float("qk_norm_eps", qk_norm_eps)
    if not isinstance(qk_norm_type, str) or qk_norm_type not in ("rms", "layer"):
        raise ValueError(f"`qk_norm_type` must be 'rms' or 'layer'. Received: qk_norm_type={qk_norm_type!r}")
    clip_qkv = _positive_float("clip_qkv", clip_qkv, optional=True)
    return qk_norm, qk_norm_eps, str(qk_norm_type), clip_qkv


_CONTEXT_NORMS = ("context_norm", "context_norm_bias")  # `output_norm`'s weights, (N*Hv,) each


def _init_norm_options(layer, output_norm, output_norm_eps, qk_norm_after_rope):
    """Checks `output_norm`, `output_norm_eps` and `qk_norm_after_rope` (after every other argument) and holds
    them as attributes (`_qk_norm_late`: QK-norm runs after RoPE, in step 4, where both are on); makes
    `context_norm` (and `context_norm_bias` with "layer"), (N*Hv,) each on the layer's device and dtype,
    uninitialized (None where absent)."""
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
    shapes, weight = _context_norm_shapes(layer), layer.output.weight
    for name in _CONTEXT_NORMS:
        value = torch.empty(shapes[name], device=weight.device, dtype=weight.dtype) if name in shapes else None
        setattr(layer, name, None if value is None else nn.Parameter(value))  # (N*Hv,)


def _context_norm_shapes(layer):
    """`output_norm`'s portable weights {name: shape}: (N*Hv,) `context_norm`, and `context_norm_bias` with "layer"."""
    if layer.output_norm is None:
        return {}
    width = (layer.output.in_features,)  # N*Hv
    return {"context_norm": width} | ({"context_norm_bias": width} if layer.output_norm == "layer" else {})


def _normalize_context(layer, merged):
    """Step 7, `output_norm`: RMSNorm or LayerNorm of the (B, T, N*Hv) merged heads over all their features,
    times `context_norm`, plus `context_norm_bias` with LayerNorm."""
    norm = rms_norm if layer.output_norm == "rms" else layer_norm
    return norm(merged, layer.context_norm, layer.output_norm_eps, layer.context_norm_bias)


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
    return x if layer.clip_qkv is None else x.clamp(-layer.clip_qkv, layer.clip_qkv)


def _normalize_qk(layer, q, k):
    """Step 3, QK-norm: RMSNorm or LayerNorm (`qk_norm_type`) of q and k over each head with
    one scale ("head") or a scale per head ("per_head"), or over all heads ("all"); plus the
    norm's bias with `qk_norm_bias`."""
    if layer.qk_norm is None:
        return q, k
    return _qk_norm(layer, q, "query"), _qk_norm(layer, k, "key")


def _qk_norm(layer, x, kind):
    """QK-norm of one of q and k (B, heads, L, H), with the scale `<kind>_norm` (and bias `<kind>_norm_bias`)."""
    norm = rms_norm if layer.qk_norm_type == "rms" else layer_norm
    scale, bias = getattr(layer, f"{kind}_norm"), getattr(layer, f"{kind}_norm_bias")
    if layer.qk_norm == "head":
        return norm(x, scale, layer.qk_norm_eps, bias)
    over = _norm_per_head if layer.qk_norm == "per_head" else _norm_over_heads
    return over(norm, x, scale, layer.qk_norm_eps, bias)


def rms_norm(x, scale, eps, bias=None):
    """RMSNorm over the last axis, x / sqrt(mean(x ** 2) + eps) * scale (+ bias), computed in
    float32 at least and cast back to x's dtype."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    y = x.to(dtype)
    y = y * torch.rsqrt(y.square().mean(dim=-1, keepdim=True) + eps)
    return _scale_and_shift(y, scale, bias).to(x.dtype)


def layer_norm(x, scale, eps, bias=None):
    """LayerNorm over the last axis, (x - mean(x)) / sqrt(mean((x - mean(x)) ** 2) + eps) * scale
    (+ bias), the variance biased, computed in float32 at least and cast back to x's dtype."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    y = x.to(dtype)
    y = y - y.mean(dim=-1, keepdim=True)
    y = y * torch.rsqrt(y.square().mean(dim=-1, keepdim=True) + eps)
    return _scale_and_shift(y, scale, bias).to(x.dtype)


def _scale_and_shift(y, scale, bias):
    """y * scale (+ bias), the weights in y's dtype (float32 at least)."""
    y = y * scale.to(y.dtype)
    return y if bias is None else y + bias.to(y.dtype)


def _norm_over_heads(norm, x, scale, eps, bias):
    """`norm` of (B, heads, L, H) x over all its heads' features, with (heads*H,) weights."""
    b, heads, length, h = x.shape
    flat = x.transpose(1, 2).reshape(b, length, heads * h)  # (B, heads, L, H) -> (B, L, heads*H)
    return norm(flat, scale, eps, bias).view(b, length, heads, h).transpose(1, 2)  # -> (B, heads, L, H)


def _norm_per_head(norm, x, scale, eps, bias):
    """`norm` of (B, heads, L, H) x over each head's H features, head n with the weights
    [n*H:(n+1)*H] of the (heads*H,) `scale` and `bias`."""
    heads, h = x.shape[1], x.shape[3]
    scale = scale.view(heads, 1, h)  # (heads*H,) -> (heads, 1, H)
    return norm(x, scale, eps, None if bias is None else bias.view(heads, 1, h))  # (B, heads, L, H)


def _gate_heads(layer, call, context):
    """Step 6b: the (B, N, T, Hv) attention result times sigmoid(query @ gate_kernel + gate_bias)
    (softplus with `gate_activation="softplus"`) split into heads (unchanged without `gate`; Hv = H
    without MLA)."""
    if layer.gate is None:
        return context
    activation = F.softplus if layer.gate_activation == "softplus" else torch.sigmoid
    gate = activation(layer._project(call.query, "gate"))  # (B, T, E) -> (B, T, N*Hv)
    return context * gate.unflatten(-1, (-1, context.shape[-1])).transpose(1, 2)  # -> (B, N, T, Hv)


# -------------------------------------------------------------------------------------------------
# Section: KV cache and decode steps
# -------------------------------------------------------------------------------------------------
# Decoding with a KV cache (L: the cache's max length): `cache = layer.init_cache(B, L)`, then
# `output, cache = layer(x, cache=cache)` for a prompt (T > 1) and then one token at a time (T = 1).
# The keys and values of the T new tokens are written to slots [index, index + T), and query t
# attends slot s iff s < index + T, keep[b, s], (not causal or s <= index + t), (no window or
# s > index + t - W_before, and s < index + t + W_after with a pair), (no chunk or s // C ==
# (index + t) // C) and `attention_mask` (given over L) keeps it; `key_mask` (B, T) is ANDed into
# `keep` at the written slots, and RoPE turns the new tokens by positions index + t. Token-by-token
# equals the full causal pass. With a `window` W (W_before of a pair) the cache rolls: position p
# goes to slot p mod L, so L = W slots decode any number of tokens one at a time (a call that
# wraps needs L >= W + T - 1). The cache's tensors are written in place (for inference; call it
# under `torch.no_grad()`). The decode fast path (`_decode_step`) gives `forward` a checked call
# without the check step; `forward` then runs its own steps.


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

    key: torch.Tensor
    value: torch.Tensor
    keep: torch.Tensor
    index: torch.Tensor
    segment_ids: torch.Tensor | None = None
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    index_key: torch.Tensor | None = None


def _results(output, weights, cache, return_attention, kv=None, selection=None):
    """output, (output, weights), (output, cache) or (output, weights, cache); the sparse indexer's
    selection before the cache where `return_topk` gives one; then `kv` if given."""
    results = (output, weights) if return_attention else (output,)
    results = results if selection is None else (*results, selection)
    results = results if cache is None else (*results, cache)
    results = results if kv is None else (*results, kv)
    return results[0] if len(results) == 1 else results


def _init_cache(layer, batch_size, max_length, *, keep=None, dtype=None):
    """An empty `KVCache` for decoding `batch_size` sequences of up to `max_length` tokens.

    Args:
        batch_size: B.
        max_length: L, the number of slots.
        keep: (B, L) boolean, False for slots no query may attend (left padding of prompts
            of different lengths). Defaults to all True.
        dtype: dtype of the keys and values; defaults to the compute dtype: autocast's where
            autocast is on for the parameters' device, else the parameters'. "int8" (or
            `torch.int8`): an int8 cache, integers with a float32 scale per slot and head;
            "float8_e4m3fn" (or `torch.float8_e4m3fn`): an fp8 cache, likewise scaled.

    Returns:
        A `KVCache` of zeros with index 0, on the parameters' device: keys and values
        (B, K, L, H); with MLA the latent cache, latents (B, 1, L, C) in `key` and turned
        shared key parts (B, 1, L, Hr) in `value`.
    """
    b, length = _positive_int("batch_size", batch_size), _positive_int("max_length", max_length)
    weight = _float_weight(layer)
    device = torch.device("cpu") if weight is None else weight.device  # a quantized module runs on the CPU
    keep = torch.ones(b, length, dtype=torch.bool) if keep is None else _check_keep(keep, b, length)
    key_shape, value_shape = _cache_shapes(layer, b, length)  # (B, K, L, H) each; MLA's its own
    default = torch.get_default_dtype() if weight is None else weight.dtype
    default = torch.get_autocast_dtype(device.type) if _autocast_enabled(device) else default
    dtype = default if dtype is None else dtype
    keep = keep.to(device, copy=True)  # the cache's own: decoding writes it in place
    index = torch.zeros((), dtype=torch.long, device=device)
    if _eager() and device.type != "meta":  # checked once here, carried: a step reads no value (`_carry`)
        _all_kept(keep)
        _carry(index, 0)
    dtype = getattr(torch, dtype) if dtype in _QUANTIZED_CACHE_NAMES else dtype  # int8, fp8: scales too
    index_dtype = default if dtype in _QUANTIZED_CACHE else dtype  # an int8 or fp8 cache keeps the indexer's float
    index_key = None if layer.index_topk is None else torch.zeros(b, length, layer.index_head_dim, dtype=index_dtype)
    key, value = (
        torch.zeros(key_shape, dtype=dtype, device=device),
        torch.zeros(value_shape, dtype=dtype, device=device),
    )
    index_key = None if index_key is None else index_key.to(device)  # (B, L, Hi)
    cache = KVCache(key, value, keep, index, index_key=index_key)
    return cache if dtype not in _QUANTIZED_CACHE else _with_cache_scales(cache)


def _check_keep(keep, batch_size, max_length):
    """Checks the (B, L) boolean `keep` of `init_cache`."""
    keep = torch.as_tensor(keep)
    if keep.dtype != torch.bool or tuple(keep.shape) != (batch_size, max_length):
        raise ValueError(
            f"`keep` must be a boolean array of shape (B, L)=({batch_size}, {max_length}). "
            f"Received: keep.shape={tuple(keep.shape)}, keep.dtype={_dtype_name(keep.dtype)}"
        )
    return keep


def _check_cache_call(layer, cache, query, key, dtype, latent):
    """Step 1 with a cache: its shapes (`_check_cache`; MLA's with the `_Latent` sizes `latent`), its
    dtype (the compute `dtype`) and the room for the T new tokens (`_check_room`: under
    `torch.compile` `forward` gives NaN instead)."""
    _check_cache(cache, query, key, layer.num_kv_heads, layer.head_dim, latent)
    _check_cache_dtype(cache, dtype)
    _check_room(cache.index, query.shape[1], cache.key.shape[2], _window_sides(layer.window)[0])


def _check_cache(cache, query, key, heads, head_dim, latent=None):
    """Checks a KVCache against the call's (B, T, E) query and (B, S, kdim) key: keys and values
    (B, K, L, H), or with MLA the latent cache (B, 1, L, C) and (B, 1, L, Hr)."""
    (b, t), s = query.shape[:2], key.shape[1]
    if t == 0:
        raise ValueError(
            "`query` must hold at least one token (T >= 1) when decoding with `cache`. "
            f"Received: query.shape={tuple(query.shape)}"
        )
    if s != t:
        raise ValueError(
            "`key` and `value` must hold the T tokens of `query` when decoding with `cache` (they are written to "
            f"it). Received: query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
        )
    k, v = cache.key, cache.value
    if latent is not None:
        _check_latent_cache(k, v, b, latent)
    elif k.dim() != 4 or k.shape != v.shape or (k.shape[0], k.shape[1], k.shape[3]) != (b, heads, head_dim):
        raise ValueError(
            f"`cache.key` and `cache.value` must have shape (B, K, L, H) with B={b}, K={heads}, H={head_dim}. "
            f"Received: cache.key.shape={tuple(k.shape)}, cache.value.shape={tuple(v.shape)}"
        )
    if tuple(cache.keep.shape) != (b, k.shape[2]):
        raise ValueError(
            f"`cache.keep` must have shape (B, L)=({b}, {k.shape[2]}). "
            f"Received: cache.keep.shape={tuple(cache.keep.shape)}"
        )


def _check_cache_dtype(cache, dtype):
    if cache.key.dtype in _QUANTIZED_CACHE:
        return _check_quantized_cache(cache)  # int8 section (int8 and fp8)
    if cache.key.dtype != dtype or cache.value.dtype != dtype:
        raise ValueError(
            f"`cache` must hold the layer's compute dtype {_dtype_name(dtype)}; "
            "make it with `init_cache(..., dtype=...)`. "
            f"Received: cache.key.dtype={_dtype_name(cache.key.dtype)}, "
            f"cache.value.dtype={_dtype_name(cache.value.dtype)}"
        )


def _check_room(index, t, length, window):
    """Without a window the T new tokens must fit (index + T <= L); with one (`window` is W_before
    of a pair) the cache rolls, and a call that wraps must leave its first query's keys in place
    (L >= window + T - 1).

    Eagerly a call without room is a ValueError. Under `torch.compile` (where raising needs a
    graph break) it returns a () boolean tensor, True for a call without room, and `forward`
    sets that call's output to NaN. On the meta device (no values) nothing is checked.
    """
    if torch.compiler.is_compiling() or index.device.type == "meta":
        return (index + t > length) & (window is None or length < window + t - 1)  # ()
    known = _carried(index)
    index = int(index) if known is None else known
    if index + t > length and (window is None or length < window + t - 1):
        raise _cache_full_error(index, t, length) if window is None else _cache_too_short_error(window, t, length)
    return False


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


def _no_room_as_nan(layer, call, output):
    """Under `torch.compile` (a graph cannot raise) the output of a call that had no room in its
    cache (`_check_room`, read again from the written cache's index) set to NaN."""
    t, length = call.query.shape[1], call.cache.key.shape[2]
    no_room = _check_room(call.cache.index - t, t, length, _window_sides(layer.window)[0])
    return torch.where(no_room, torch.nan, output)


def _update_cache(layer, call, k, v, keep, fast=None):
    """Step 5, the KV cache: the new keys and values written (`_write_cache`, checked by
    `_check_call`), then k and v are the cache's. A lean decode step (eager, no mask, bias,
    query_mask or returned weights, within the cache's first lap) attends the first index + T
    slots as a full pass attends its keys (causal, window and chunk bottom-right aligned, the
    cache's keep only where it holds a False): no (B, 1, T, L) keep. Every other call attends
    all L slots through that keep, with causal, window and chunk folded into it. The decode fast
    path gives the index it read (`fast`, `_decode_step`)."""
    cache = call.cache
    if cache is None:
        return k, v, keep, call
    if call.cache.segment_ids is not None and not call.segmented:  # packed: the new tokens continue a document
        same, segmented = _segment_keep(layer, call, None, None)  # (B, 1, T, L)
        keep, call = _and(keep, same), call._replace(cache=segmented)
        cache = segmented
    t, length, index = call.query.shape[1], cache.key.shape[2], cache.index
    start = _known_index(index) if fast is None else fast[2]
    write = _write_cache if cache.key_scale is None else _write_quantized_cache  # int8, fp8: values and scales
    cache = write(cache, k, v, call.key_mask, start) if not layer.kv_shared else _written(cache, t)
    lean = keep is None and not call.return_attention  # each mask gives a keep
    if lean and start is not None and start + t <= length:  # lean: the first S = index + T slots
        k, v, keep = _first_slots(cache, start + t)  # (B, K, S, H) x 2, (B, 1, 1, S) or None
        causal = call.causal and t > 1  # `call._replace(causal=causal, cache=cache)`, 2 us cheaper a step:
        lean_call = _Call(*call[:8], causal, *call[9:12], cache, *call[13:])  # fields 8 and 12 replaced
        return k, v, keep, lean_call
    rule = (call.causal, call.window, call.attention_chunk_size)
    keep = _and(keep, _cache_keep(cache.keep, index, t, *rule))  # (B, N, T, L), dims may be 1
    folded = call._replace(causal=False, window=None, attention_chunk_size=None, cache=cache)
    return cache.key, cache.value, keep, folded


def _cache_attend(layer, k):
    """Step 6 of a call with a cache: `_attend`, or over an int8 or fp8 cache `_attend_quantized` (int8 section)."""
    return layer._attend if k.dtype not in _QUANTIZED_CACHE else lambda *args: _attend_quantized(layer, *args)


def _write_cache(cache, k, v, key_mask, start):
    """gpt-fast's `KVCache.update`: the (B, K, T, H) keys and values of positions [index, index + T)
    go to slots position mod L of the cache's own tensors, and the (B, T) `key_mask` (True without
    one) into `keep` there: ANDed into it on the first lap (left padding), in its place once a slot
    holds a new token. Returns the cache with index + T. The caller checks the room first
    (`_check_room`); under `torch.compile` a call without room still writes in range. A call whose
    index is known, `start` (`_known_index`; else None), and that stays in the first lap writes
    slots [index, index + T) as views, without index tensors (the same rule, cheaper for a decode
    step), and its new index carries its value."""
    t, length = k.shape[2], cache.key.shape[2]
    if start is not None and start + t <= length:  # the first lap: slot p holds position p
        cache.key.narrow(2, start, t).copy_(k)  # (B, K, L, H)
        cache.value.narrow(2, start, t).copy_(v)  # (B, K, L, H)
        if key_mask is not None:
            cache.keep.narrow(1, start, t).logical_and_(key_mask)  # (B, L)
        index = _carry(cache.index.new_full((), start + t), start + t)
        return KVCache(cache.key, cache.value, cache.keep, index, *cache[4:])
    positions = cache.index + torch.arange(t, device=k.device)  # (T,)
    slots = positions % length  # (T,)
    cache.key.index_copy_(2, slots, k)  # (B, K, L, H)
    cache.value.index_copy_(2, slots, v)  # (B, K, L, H)
    new = torch.ones(k.shape[0], t, dtype=torch.bool, device=k.device) if key_mask is None else key_mask  # (B, T)
    old = cache.keep.index_select(1, slots)  # (B, T)
    cache.keep.index_copy_(1, slots, torch.where(positions < length, old & new, new))  # (B, L)
    return KVCache(cache.key, cache.value, cache.keep, cache.index + t, *cache[4:])


def _cache_keep(keep, index, t, causal, window, attention_chunk_size):
    """(B, L) cache keep -> (B, 1, T, L): slot s holds a written position p(s), is not padding,
    when causal p(s) is at most the query's own position index + t, with a window p(s) >
    index + t - W_before (and with a pair p(s) < index + t + W_after), and with a chunk C
    p(s) // C == (index + t) // C."""
    held = _slot_positions(keep.shape[-1], index + t - 1)[None, :]  # (1, L), p(s)
    positions = index + torch.arange(t, device=keep.device)[:, None]  # (T, 1), the position of each query
    allowed = (held >= 0) & (held <= positions if causal else held < index + t)  # (T, L)
    before, after = _window_sides(window)
    if before is not None:
        allowed = allowed & (held > positions - before)  # (T, L)
    if after is not None:
        allowed = allowed & (held < positions + after)  # (T, L)
    chunk = attention_chunk_size
    if chunk is not None:
        allowed = allowed & (torch.div(held, chunk, rounding_mode="floor") == positions // chunk)  # (T, L)
    return allowed[None, None] & keep[:, None, None, :]  # (B, 1, T, L)


def _slot_positions(length, last):
    """(L,) the position held by each slot once positions up to `last` are written (position p in
    slot p mod L); negative where nothing is written yet."""
    slots = torch.arange(length, device=last.device)  # (L,)
    return slots + length * torch.div(last - slots, length, rounding_mode="floor")  # (L,)


def _first_slots(cache, stop):
    """The keys and values of a cache's first `stop` slots, written in its first lap, (B, K, S, H)
    with S = stop, and their keep (B, 1, 1, S), None where it holds only True (all kept: not read)."""
    prefix = None if _all_kept(cache.keep) else cache.keep[:, :stop]  # (B, L) -> (B, S)
    keep = None if prefix is None or prefix.all() else prefix[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
    return cache.key.narrow(2, 0, stop), cache.value.narrow(2, 0, stop), keep  # (B, K, L, H) -> (B, K, S, H)


def _decode_step(layer, query, positions, causal, cache):
    """The decode fast path: a call that gives only the query (with `causal`, and `positions` as
    a tensor) and a cache, eagerly under no_grad, over plain projections whose q/k/v kernels the
    layer keeps (`_kept_kernels`; never with MLA) and a cache (of the compute dtype, or int8 or fp8
    with its scales, `_quantized_cache_fits`) whose index carries its value and
    whose T tokens fit in its first lap (`_carried_start`; an index the caller built is read
    once, `_read_index`). Those facts answer the check step's
    checks, so this returns the `_Call` that `_check_call` would give and `fast`: the kept kernels
    (q/k/v, output) and the cache's carried index, for
    `forward`'s own steps 2 to 7 (bit for bit the general call); or (None, None) where it does not
    apply: the call then runs through the check step, which raises where it is invalid."""
    tensors = type(query) is torch.Tensor and (positions is None or type(positions) is torch.Tensor)
    if not tensors or type(cache) is not KVCache or torch.is_grad_enabled() or not _eager():
        return None, None
    if torch._C._is_any_autocast_enabled():  # on any device: read without `query.device`, a new object
        return None, None
    width = query.dim() == 3 and query.shape[2] == layer.d_model
    kernels = _kept_kernels(layer, query.dtype) if width else None  # ((q/k/v kernels), (output kernel))
    if kernels is None:
        return None, None
    (b, t), dtype = query.shape[:2], query.dtype
    start = _carried_start(cache, b, t, layer.num_kv_heads, layer.head_dim, dtype)
    if start is None or kernels[1][0].dtype != dtype:  # the compute dtype (`_compute_dtype`) is the query's
        return None, None
    if positions is not None or layer.rope_theta is not None:
        positions = _positions(layer, positions, query, query, cache)  # checked (B, T)
    call = _Call(
        query, query, query, None, None, None, None, positions, causal, layer.window, layer.attention_chunk_size,
        False, cache, None, True,
    )  # fmt: skip
    return call, (*kernels, start)


def _carried_start(cache, b, t, heads, head_dim, dtype):
    """The index of a cache that passes every check of a T-token call (`_check_cache`,
    `_check_cache_dtype` with the compute `dtype`, `_check_room`) and whose tokens fit in its first
    lap, from the value its index carries (`_carried`: no value read); else None, and the call's
    own checks run."""
    key, value, keep = cache.key, cache.value, cache.keep
    tensors = type(key) is torch.Tensor and type(value) is torch.Tensor and type(keep) is torch.Tensor
    if not tensors or key.dim() != 4:
        return None
    length = key.shape[2]
    shapes = key.shape == value.shape == (b, heads, length, head_dim) and keep.shape == (b, length)
    dtypes = key.dtype == value.dtype == dtype or _quantized_cache_fits(cache)  # an int8 or fp8 cache: its scales
    if not shapes or not dtypes or keep.dtype != torch.bool:
        return None
    start = _carried(cache.index)
    start = _read_index(cache.index) if start is None else start
    return start if start is not None and start >= 0 and 0 < t <= length - start else None


def _read_index(index):
    """The value of an index that carries none (`_carried`): one the caller built (a fresh
    tensor: a server resetting its cache, a beam search rebuilding it) or wrote in place, read as
    one scalar where it is a plain 0-d integer tensor off the meta device (a device sync on a
    GPU), and carried from then on; else None (the check step reads it)."""
    if type(index) is not torch.Tensor or index.dim() != 0 or index.device.type == "meta":
        return None
    if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
        return None
    value = int(index)
    _carry(index, value)
    return value


def _eager():
    """Whether the call runs eagerly: not inside `torch.compile` or `torch.jit.trace`."""
    return not (torch.compiler.is_compiling() or torch.jit.is_tracing())


def _carry(tensor, value):
    """`tensor` with `value`, what a check of it found (a cache's index, whether its keep holds
    only True), attached with its version counter where it has one (an inference-mode tensor has
    none, so a later write in place could not be told). Called eagerly only (`_eager`). A cache
    is checked once, when it is made or first read, and each step reads the result back
    (`_carried`) instead of the tensor's values: no value read (a device sync on a GPU)."""
    if not tensor.is_inference():
        tensor._checked = (tensor._version, value)
    return tensor


def _carried(tensor):
    """The value `_carry` attached to `tensor`, or None where none is attached or the tensor was
    written in place since (its version counter moved)."""
    checked = getattr(tensor, "_checked", None)
    return None if checked is None or checked[0] != tensor._version else checked[1]


def _known_index(index):
    """A cache's index as a Python int where it can be read: eagerly (not inside `torch.compile` or
    `torch.jit.trace`, whose graphs cannot depend on it) and off the meta device; else None. An
    index the last step wrote carries its value (`_carry`, eagerly and never on the meta device):
    not read again."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # not `_eager()`
        return None
    known = _carried(index)
    return known if known is not None else None if index.device.type == "meta" else int(index)


def _all_kept(keep):
    """Whether a cache's (B, L) keep holds only True, read once and carried while it is not written."""
    known = _carried(keep)
    if known is None:
        known = bool(keep.all())
        _carry(keep, known)
    return known


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
    drops the projections they remove from `_projections` and `bias`
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
    layer._projections = tuple(kind for kind in layer._projections if kind not in absent)
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
    return shared_kv._replace(index=shared_kv.index - query.shape[-2])


def _written(cache, t):
    """The shared cache as its producer returned it: the checked cache's index moved on by T."""
    return cache._replace(index=cache.index + t)


def _shared_pair(layer, call, shared_kv):
    """A `kv_shared` layer's (k, v): `shared_kv` checked as a (B, K, S, H) pair for the call's (B, S) key."""
    b, s = call.key.shape[:2]
    expected = (b, layer.num_kv_heads, s, layer.head_dim)
    pair = tuple(shared_kv) if isinstance(shared_kv, (tuple, list)) else ()
    shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in pair)
    if len(pair) != 2 or shapes != (expected, expected) or not all(x.is_floating_point() for x in pair):
        raise ValueError(
            f"`shared_kv` must be a KVCache or a (k, v) pair of floating (B, K, S, H)={expected} tensors. "
            f"Received: {type(shared_kv).__name__} with shapes {shapes}"
        )
    return pair


def _project_sharing(layer, call, shared_kv):
    """Steps 2 to 4 with the sharing options: q (B, N, T, H); k and v (B, K, S, H) projected (v the
    clamped key projection with `keys_as_values`, RMS-normalized with `value_norm`) or `shared_kv`
    (a shared cache, then the call's, gives None: step 5 reads it)."""
    q = _clip(layer, layer._split_heads(layer._project(call.query, "query"), layer.num_heads))  # (B, N, T, H)
    q = q if layer.qk_norm is None else _qk_norm(layer, q, "query")
    q = q if layer.rope_theta is None else _turn_heads(layer, q, call.positions)
    if layer.kv_shared and shared_kv is None:
        raise ValueError(
            "`shared_kv` must be given to a layer built with `kv_shared=True`: it has no key or value projections. "
            "Received: shared_kv=None"
        )
    if layer.kv_shared:
        return (q, None, None) if call.cache is not None else (q, *_shared_pair(layer, call, shared_kv))
    k, v = _own_keys_values(layer, call)  # 2. (B, K, S, H) x 2
    k = k if layer.qk_norm is None else _qk_norm(layer, k, "key")  # 3.
    k = k if layer.rope_theta is None else _turn_heads(layer, k, call.positions)  # 4.
    return q, k, v


def _own_keys_values(layer, call):
    """The clamped key projection and the values (B, K, S, H): with `keys_as_values` the key
    projection again, with `value_norm` RMS-normalized per head without a scale."""
    k = _clip(layer, layer._split_heads(layer._project(call.key, "key"), layer.num_kv_heads))  # (B, K, S, H)
    v = k if layer.keys_as_values else _raw_values(layer, call)  # (B, K, S, H)
    return k, v if not layer.value_norm else rms_norm(v, v.new_ones(()), layer.qk_norm_eps)  # (B, K, S, H)


def _raw_values(layer, call):
    """The values before `value_norm` (B, K, S, H): the clamped value projection, or with `keys_as_values` the key's."""
    kind = "key" if layer.keys_as_values else "value"
    projected = layer._project(getattr(call, kind), kind)  # (B, S, D) -> (B, S, K*H)
    return _clip(layer, layer._split_heads(projected, layer.num_kv_heads))  # -> (B, K, S, H)


# -------------------------------------------------------------------------------------------------
# Section: multi-head latent attention
# -------------------------------------------------------------------------------------------------
# Multi-head latent attention (DeepSeek-V2/V3, `kv_lora_rank` and the sizes after it): its checks,
# its projections (the latents, `query_a`/`query_b`), its cache (the latents and the turned shared
# key part) and its attention, on the latents expanded per head or absorbed into q. Keys and values
# come from one latent c = RMSNorm(first C features of key @ key_value_a_kernel) per token, expanded
# per head by `key_value_b_kernel`; with `q_lora_rank` Q, q = RMSNorm(query @ query_a_kernel) @
# query_b_kernel; the output kernel is (N*Hv, E); the cache holds c and the turned shared key part.


_LATENT_SIZES = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


_ABSORB_MAX_T = 8  # `absorb_latents=None`: a call with a cache and T <= 8 attends on the latents


class _Latent(NamedTuple):
    """The sizes of multi-head latent attention (MLA), checked (`_check_latent`)."""

    kv_lora_rank: int  # C
    q_lora_rank: int | None  # Q, None: a plain query projection
    qk_nope_head_dim: int  # Hn
    qk_rope_head_dim: int  # Hr
    v_head_dim: int  # Hv


def _sdpa_narrow_values(q, k, v, keep, bias, dropout, scale, is_causal):
    """`_sdpa_attention` with MLA's values narrower than q (Hv < H): padded to q's width, since the
    fused kernels want one head width, and the context cut back."""
    width = v.shape[-1]
    v = F.pad(v, (0, q.shape[-1] - width))  # (B, K, S, Hv) -> (B, K, S, H)
    return _sdpa_attention(q, k, v, keep, bias, dropout, scale, is_causal)[..., :width]  # (B, N, T, Hv)


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


def _make_latent_weights(layer, factory):
    """MLA's projections (`nn.Linear`, weight = the portable kernel transposed) and the latents'
    RMSNorm scales `query_a_norm` (Q,) (with `q_lora_rank`) and `key_value_a_norm` (C,)."""
    for kind, (d, f) in _latent_kernels(layer).items():
        setattr(layer, kind, nn.Linear(d, f, bias=kind in layer.bias, **factory))  # (F, D)
    q_norm = None if layer.q_lora_rank is None else nn.Parameter(torch.empty(layer.q_lora_rank, **factory))
    layer.query_a_norm = q_norm  # (Q,)
    layer.key_value_a_norm = nn.Parameter(torch.empty(layer.kv_lora_rank, **factory))  # (C,)


def _cache_shapes(layer, b, length):
    """The shapes of a cache's `key` and `value` (`init_cache`): (B, K, L, H) each, or with MLA the
    latent cache, latents (B, 1, L, C) and turned shared key parts (B, 1, L, Hr)."""
    latent = layer._latent
    if latent is None:
        return ((b, layer.num_kv_heads, length, layer.head_dim),) * 2
    return (b, 1, length, latent.kv_lora_rank), (b, 1, length, latent.qk_rope_head_dim)


def _kernels_and_norms(layer, kernels):
    """The projections' kernels {kind: (D, F)} and the latents' norms {kind: (width,)} of the
    portable layout (`weight_shapes`): `kernels` and none without MLA; with it MLA's."""
    if layer._latent is None:
        return kernels, {}
    return _latent_kernels(layer), {"query_a": (layer.q_lora_rank,), "key_value_a": (layer.kv_lora_rank,)}


def _latent_kernels(layer):
    """MLA's portable kernels {projection: (D, F)}, in the layout's order."""
    n, k, h = layer.num_heads, layer.num_kv_heads, layer.head_dim
    c, q, hn, hr, hv = (
        layer.kv_lora_rank,
        layer.q_lora_rank,
        layer.qk_nope_head_dim,
        layer.qk_rope_head_dim,
        layer.v_head_dim,
    )
    kernels = {
        "query": (layer.d_model, n * h),
        "query_a": (layer.d_model, q),
        "query_b": (q, n * h),
        "key_value_a": (layer.kdim, c + hr),
        "key_value_b": (c, k * (hn + hv)),
        "output": (n * hv, layer.d_model),
        "gate": (layer.d_model, n * hv),
    }
    return {kind: kernels[kind] for kind in layer._projections}


def _latent_norms(layer):
    """MLA's norm scales (`query_a_norm` with `q_lora_rank`, `key_value_a_norm`), none without MLA."""
    if layer._latent is None:
        return ()
    return tuple(norm for norm in (layer.query_a_norm, layer.key_value_a_norm) if norm is not None)


def _project_latent(layer, call):
    """Step 2 with MLA: q (B, N, T, H), through query_a, its RMSNorm and query_b with Q; the
    latents c = RMSNorm(a[..., :C]) (B, 1, S, C) and k_rope = a[..., C:] (B, 1, S, Hr) of
    a = key @ key_value_a_kernel; with RoPE, step 4 too: the last Hr features of q and k_rope turned
    (`_turn_heads`) at the call's positions."""
    if layer.q_lora_rank is None:
        q = layer._project(call.query, "query")  # (B, T, E) -> (B, T, N*H)
    else:
        a = layer._project(call.query, "query_a")  # (B, T, E) -> (B, T, Q)
        q = layer._project(rms_norm(a, layer.query_a_norm, layer.latent_norm_eps), "query_b")  # -> (B, T, N*H)
    a = layer._project(call.key, "key_value_a")  # (B, S, kdim) -> (B, S, C + Hr)
    latent, k_rope = a.split([layer.kv_lora_rank, layer.qk_rope_head_dim], dim=-1)  # (B, S, C), (B, S, Hr)
    latent = rms_norm(latent, layer.key_value_a_norm, layer.latent_norm_eps)  # (B, S, C)
    q, k_rope = layer._split_heads(q, layer.num_heads), k_rope[:, None]  # (B, N, T, H), (B, 1, S, Hr)
    if layer.rope_theta is not None:  # step 4
        q_nope, q_rope = q.split([layer.qk_nope_head_dim, layer.qk_rope_head_dim], dim=-1)  # (B, N, T, Hn), (.., Hr)
        q = torch.cat([q_nope, _turn_heads(layer, q_rope, call.positions)], dim=-1)  # (B, N, T, H)
        k_rope = _turn_heads(layer, k_rope, call.positions)  # (B, 1, S, Hr)
    return q, latent[:, None], k_rope  # (B, N, T, H), (B, 1, S, C), (B, 1, S, Hr)


def _attend_latent(layer, q, k, v, keep, bias, call):
    """Step 6 with MLA: k and v are the (B, 1, S, C) latents and (B, 1, S, Hr) k_rope, attended
    absorbed (`_attend_absorbed`) or expanded per head (`_expand_latents`), through `_attend`."""
    if k.dtype in _QUANTIZED_CACHE:
        k, v = _dequantize_cache(call.cache, k, v, q.dtype)  # an int8 or fp8 cache (int8 section)
    if call.selection is not None:  # the sparse indexer's gathered route
        return _attend_gathered(layer, q, k, v, keep, bias, call)
    if _absorbs(layer, call, q.shape[2]):
        return _attend_absorbed(layer, q, k, v, keep, bias, call)
    k, v = _expand_latents(layer, k, v)  # (B, K, S, H), (B, K, S, Hv)
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
    (b, s, _), heads = kv.shape, layer.num_kv_heads
    kv = kv.view(b, s, heads, -1).transpose(1, 2)  # -> (B, K, S, Hn + Hv)
    k_nope, v = kv.split([layer.qk_nope_head_dim, layer.v_head_dim], dim=-1)  # (B, K, S, Hn), (B, K, S, Hv)
    k_rope = k_rope.expand(b, heads, s, layer.qk_rope_head_dim)  # (B, 1, S, Hr) -> (B, K, S, Hr)
    return torch.cat([k_nope, k_rope], dim=-1), v  # (B, K, S, H), (B, K, S, Hv)


def _up_projections(layer, dtype):
    """key_value_b's kernel in `dtype` as (N, Hn, C) and (N, Hv, C) and its bias (N, Hn) and
    (N, Hv) (None without one), each key/value head's repeated for its N // K query heads; an
    int8 projection's dequantized."""
    weight, _ = _parameter(layer, "key_value_b_kernel")  # (K*(Hn + Hv), C)
    projection, groups = layer.key_value_b, layer.num_heads // layer.num_kv_heads
    scale = projection.weight_scale[:, None] if isinstance(projection, Int8Linear) else 1.0  # (K*(Hn + Hv), 1)
    weight = (weight.to(dtype) * scale).to(dtype).view(layer.num_kv_heads, -1, weight.shape[-1])  # (K, Hn + Hv, C)
    weight = weight.repeat_interleave(groups, dim=0)  # (N, Hn + Hv, C)
    w_kb, w_vb = weight.split([layer.qk_nope_head_dim, layer.v_head_dim], dim=1)  # (N, Hn, C), (N, Hv, C)
    if "key_value_b" not in layer.bias:
        return w_kb, w_vb, None, None
    bias = _parameter(layer, "key_value_b_bias")[0].to(dtype).view(layer.num_kv_heads, -1)  # (K, Hn + Hv)
    b_k, b_v = bias.repeat_interleave(groups, dim=0).split([layer.qk_nope_head_dim, layer.v_head_dim], dim=-1)
    return w_kb, w_vb, b_k, b_v  # ..., (N, Hn), (N, Hv)


def _attend_absorbed(layer, q, latent, k_rope, keep, bias, call):
    """Step 6 with MLA on the latents, through `_attend` (every path): q_lat = q_nope @
    W_kb^T (B, N, T, C) meets the latents and q_rope meets k_rope (and q_nope . b_k a key of
    ones); the values are the latents (and a one, whose output is sum(weights)); each head's
    context is o_lat @ W_vb + sum(weights) * b_v (B, N, T, Hv)."""
    w_kb, w_vb, b_k, b_v = _up_projections(layer, q.dtype)  # (N, Hn, C), (N, Hv, C), (N, Hn), (N, Hv)
    if isinstance(layer.key_value_b, Int8Linear):  # the latents as the int8 up-projection reads them
        latent = _int8_rows(latent)  # (B, 1, S, C)
    q_nope, q_rope = q.split([layer.qk_nope_head_dim, layer.qk_rope_head_dim], dim=-1)  # (B, N, T, Hn), (.., Hr)
    ones = latent.new_ones(*latent.shape[:3], 1)  # (B, 1, S, 1)
    queries, keys, values = [q_nope @ w_kb, q_rope], [latent, k_rope], [latent]  # (B, N, T, C), ...
    if b_k is not None:
        queries.append((q_nope * b_k[:, None, :]).sum(dim=-1, keepdim=True))  # (B, N, T, 1)
        keys.append(ones)
    if b_v is not None:
        values.append(ones)
    q, k, v = (torch.cat(parts, dim=-1) for parts in (queries, keys, values))  # (B, N, T, .), 2 x (B, 1, S, .)
    context, weights = layer._attend(q, k, v, keep, bias, call)  # (B, N, T, C or C + 1)
    output = context[..., : layer.kv_lora_rank] @ w_vb.transpose(-1, -2)  # (B, N, T, C) -> (B, N, T, Hv)
    return output if b_v is None else output + context[..., layer.kv_lora_rank :] * b_v[:, None, :], weights


def _query_latent(layer, query):
    """(B, T, E) -> the sparse indexer's query input: MLA's normalized q latent (B, T, Q) with
    `q_lora_rank`, else `query` itself."""
    if layer.q_lora_rank is None:
        return query
    a = layer._project(query, "query_a")  # (B, T, E) -> (B, T, Q)
    return rms_norm(a, layer.query_a_norm, layer.latent_norm_eps)  # (B, T, Q)


def _index_inputs(layer):
    """What the sparse indexer reads of MLA: whether it is on, Hr where RoPE turns (else None), and
    the width of the indexer's query input (Q with `q_lora_rank`, else E)."""
    rope_width = None if layer.rope_theta is None or layer._latent is None else layer.qk_rope_head_dim
    return layer._latent is not None, rope_width, layer.d_model if layer.q_lora_rank is None else layer.q_lora_rank


def _attend_gathered(layer, q, latent, k_rope, keep, bias, call):
    """Step 6 with MLA on each query's gathered keys: per block of query rows, the k selected
    latents and k_rope (B, Tb, k, .) meet the absorbed queries, with keep, bias, soft-capping and
    sinks gathered alongside: (B, N, T, Hv), never a (B, N, T, S) score tensor."""
    w_kb, w_vb, b_k, b_v = _up_projections(layer, q.dtype)  # (N, Hn, C), (N, Hv, C), (N, Hn), (N, Hv)
    q_nope, q_rope = q.split([layer.qk_nope_head_dim, layer.qk_rope_head_dim], dim=-1)  # (B, N, T, Hn), (.., Hr)
    keys = torch.cat([latent[:, 0], k_rope[:, 0]], dim=-1)  # (B, S, C + Hr)
    (b, n, t, _), s, selection = q.shape, keys.shape[1], call.selection
    width = max(n, keys.shape[-1])  # a block's scores (B, N, Tb, k) and gathered keys (B, Tb, k, C + Hr)
    rows = max(1, _GATHER_BLOCK_SCORES // max(1, b * width * selection.shape[-1]))
    contexts = []
    for first in range(0, t, rows):
        part = slice(first, min(t, first + rows))
        index, valid = _gather_index(selection[:, part], s)  # (B, Tb, k) x 2
        gathered = torch.gather(keys, 1, index.flatten(1)[..., None].expand(-1, -1, keys.shape[-1]))
        gathered = gathered.view(*index.shape, -1)  # (B, Tb, k, C + Hr)
        queries = torch.cat([q_nope[:, :, part] @ w_kb, q_rope[:, :, part]], dim=-1)  # (B, N, Tb, C + Hr)
        scores = torch.einsum("bntd,btjd->bntj", queries, gathered).contiguous()  # (B, N, Tb, k): dense, as the
        # softmax without autograd overwrites it (`_masked_softmax`; einsum may return a permuted view)
        if b_k is not None:
            scores = scores + (q_nope[:, :, part] * b_k[:, None, :]).sum(dim=-1, keepdim=True)  # a key of ones
        weights = _gathered_weights(layer, scores * layer.scale, keep, bias, call, part, index, valid, s)
        o_lat = torch.einsum("bntj,btjc->bntc", weights, gathered[..., : layer.kv_lora_rank])  # (B, N, Tb, C)
        context = o_lat @ w_vb.transpose(-1, -2)  # (B, N, Tb, Hv)
        contexts.append(context if b_v is None else context + weights.sum(-1, keepdim=True) * b_v[:, None, :])
    return torch.cat(contexts, dim=2), None  # (B, N, T, Hv)


# -------------------------------------------------------------------------------------------------
# Section: sparse indexer
# -------------------------------------------------------------------------------------------------
# DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-MoE-DSA) on MLA, `index_topk` and the sizes after it:
# a small indexer scores every key for each query (Ni heads of width Hi, relu, weights per head), in
# blocks of query rows, and each query attends only to its top-k allowed keys, ties ranked by the
# lower key index (a stable sort). `topk_indices` passes another layer's selection in, `return_topk`
# returns the one used. The selection becomes a keep ANDed into the call's (every path), or, above
# `sparse_gather_threshold` score elements, MLA attends each query's gathered latents in blocks (no
# (B, N, T, S) scores). The indexer's keys are cached in `KVCache.index_key`; it runs without autograd.
# Mistral Large 4's indexer: a LayerNorm of the query input (`index_query_input_norm`) and, with the learned
# `query_scaling`, its queries scaled per indexer head by their own learned parameters.

_INDEX_NORM_EPS = 1e-6  # the indexer's key LayerNorm (transformers' `k_norm`)
_INDEX_SIZES = ("index_topk", "index_num_heads", "index_head_dim")
_INDEX_BLOCK_SCORES = 1 << 22  # the indexer's (B, Ni, Tb, S) per-head scores of one block of query rows
_GATHER_BLOCK_SCORES = 1 << 22  # the gathered route's (B, N, Tb, k) scores or (B, Tb, k, C + Hr) keys of a block


def _init_indexer(layer, index_topk, index_num_heads, index_head_dim, index_rope_interleaved, index_query_input_norm):
    """Checks the indexer's options (after every other argument), holds them as attributes and makes
    its weights: `nn.Linear` modules `index_query`, `index_key`, `index_weights` (no bias) and the
    parameters `index_key_norm`, `index_key_norm_bias` (all None without `index_topk`), and those of
    `_INDEX_VECTORS` it has (None otherwise)."""
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
    shapes, weight = _index_shapes(layer), layer.output.weight  # the indexer's device and dtype: the layer's
    factory = {"device": weight.device, "dtype": weight.dtype}
    for kind in ("index_query", "index_key", "index_weights"):
        d, f = shapes[f"{kind}_kernel"] if shapes else (None, None)
        setattr(layer, kind, None if d is None else nn.Linear(d, f, bias=False, **factory))  # (F, D)
    for name in ("index_key_norm", "index_key_norm_bias", *_INDEX_VECTORS):
        setattr(layer, name, nn.Parameter(torch.empty(shapes[name], **factory)) if name in shapes else None)  # (Hi,)
    layer.sparse_gather_threshold = _SPARSE_GATHER_THRESHOLD


_INDEX_VECTORS = (  # Mistral Large 4's: the query input's LayerNorm (E or Q), the learned scaling (Ni)
    "index_query_norm", "index_query_norm_bias", "index_query_scaling_scale", "index_query_scaling_bias",
)  # fmt: skip


_SPARSE_GATHER_THRESHOLD = 1 << 26  # B*N*T*S score elements above which MLA attends the gathered keys


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


def _reset_indexer(layer):
    """Glorot kernels, the key norm's scale one and bias zero (nothing without the indexer)."""
    if layer.index_topk is None:
        return
    for kind in ("index_query", "index_key", "index_weights"):
        nn.init.xavier_uniform_(getattr(layer, kind).weight)
    nn.init.ones_(layer.index_key_norm)
    nn.init.zeros_(layer.index_key_norm_bias)
    _reset_vectors(layer, _INDEX_VECTORS)


def _check_topk_indices(indices, batch_size, t):
    """`topk_indices` as an integer (B, T, k) tensor."""
    indices = torch.as_tensor(indices)
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (batch_size, t) or indices.is_floating_point():
        raise ValueError(
            f"`topk_indices` must be an integer tensor of shape (B, T, k) with B={batch_size}, T={t}. "
            f"Received: topk_indices.shape={tuple(indices.shape)}, topk_indices.dtype={_dtype_name(indices.dtype)}"
        )
    return indices


def _sparse_keep(layer, q, k, keep, call, topk_indices, return_topk):
    """Step 5b: the selection (the layer's indexer's, or `topk_indices`), ANDed into keep (then
    (B, N|1, T, S)), or kept in the call for the gathered route (`_gathers`); with a cache the new
    tokens' indexer keys written to `index_key`. Returns (keep, call, selection (B, T, k) int32 with
    `return_topk`, else None)."""
    (b, t), s = q.shape[0::2], k.shape[2]  # S: the keys attended (a lean decode step's first index + T slots)
    if topk_indices is None and layer.index_topk is None:
        raise ValueError("`return_topk` needs `index_topk` or `topk_indices`. Received: return_topk=True")
    if topk_indices is not None:
        selection = _check_topk_indices(topk_indices, b, t).to(q.device)
    else:
        with torch.no_grad():
            selection, call = _index_selection(layer, keep, call, s)  # (B, T, k)
    if _gathers(layer, q, call, s):
        call = call._replace(selection=selection)  # the gathered route reads it (`_attend_gathered`)
    else:
        keep = _and(keep, _selection_keep(selection, s))  # (B, N|1, T, S)
    return keep, call, selection.to(torch.int32) if return_topk else None


def _gathers(layer, q, call, s):
    """The gathered route: MLA, more than `sparse_gather_threshold` score elements, no weights
    returned, nothing dropped, float projections."""
    dropping = layer.training and layer.dropout > 0.0
    small = q.shape[0] * layer.num_heads * q.shape[2] * s <= layer.sparse_gather_threshold
    latent = _index_inputs(layer)[0]
    return not (small or dropping or call.return_attention or not latent or layer.quantization_mode)


def _index_selection(layer, keep, call, s):
    """The layer's own selection (B, T, k): the indexer's keys (written to the cache's `index_key`
    with one), then each block of query rows scored, its disallowed keys ranked last, sorted."""
    ki = _index_keys(layer, call.key, call.positions)  # (B, T or S, Hi), float32 at least
    if call.cache is not None:
        call = call._replace(cache=_write_index_cache(call.cache, ki.to(call.cache.index_key.dtype)))
        ki = call.cache.index_key[:, :s].to(ki.dtype)  # (B, S, Hi): S = L, or a lean step's first slots
    qi, w = _index_queries(layer, call.query, call.positions, _index_positions(call))  # (B, Ni, T, Hi), (B, T, Ni)
    b, t = call.query.shape[:2]
    k, rows = min(layer.index_topk, s), max(1, _INDEX_BLOCK_SCORES // max(1, b * layer.index_num_heads * s))
    blocks = []
    for first in range(0, t, rows):
        stop = min(t, first + rows)
        scores = _index_scores(qi[:, :, first:stop], w[:, first:stop], ki)  # (B, Tb, S)
        allowed = _block_allowed(keep, call, first, stop, t, s)  # (B|1, Tb, S)
        blocks.append(_select_topk(scores, allowed, k))  # (B, Tb, k)
    return (torch.cat(blocks, dim=1) if blocks else ki.new_zeros(b, 0, k, dtype=torch.long)), call


def _index_keys(layer, key, positions):
    """(B, S, kdim) -> (B, S, Hi): the indexer's keys in float32 at least, LayerNorm (scale and bias)
    and RoPE of their first Hr features."""
    dtype = torch.promote_types(key.dtype, torch.float32)
    ki = F.linear(key.to(dtype), layer.index_key.weight.to(dtype))  # (B, S, kdim) -> (B, S, Hi)
    ki = layer_norm(ki, layer.index_key_norm.to(dtype), _INDEX_NORM_EPS, layer.index_key_norm_bias.to(dtype))
    return _turn_index(layer, ki[:, None], positions)[:, 0]  # (B, 1, S, Hi) -> (B, S, Hi)


def _index_positions(call):
    """The (B|1, T) positions of the indexer's queries: the call's RoPE positions, else i + t from the
    cache's index i before the call (the call's cache is the written one, its index i + T)."""
    if call.positions is not None:
        return call.positions  # (B, T)
    t = call.query.shape[1]
    start = 0 if call.cache is None else call.cache.index - t
    return (start + torch.arange(t, device=call.query.device))[None]  # (1, T)


def _index_queries(layer, query, positions, scaling_positions):
    """(B, T, E) -> the indexer's queries (B, Ni, T, Hi) (from MLA's normalized q latent with
    `q_lora_rank`, LayerNorm-ed with `index_query_input_norm`), scaled by the learned scaling at (B|1, T)
    `scaling_positions`, turned, and its head weights times Ni**-0.5 (B, T, Ni), in float32 at least."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    source = _query_latent(layer, query)  # (B, T, Q), or (B, T, E) without `q_lora_rank`
    if layer.index_query_input_norm:
        source = layer_norm(
            source.to(dtype), layer.index_query_norm.to(dtype), _INDEX_NORM_EPS, layer.index_query_norm_bias.to(dtype)
        )  # (B, T, Q or E)
    b, t, _ = query.shape
    qi = F.linear(source.to(dtype), layer.index_query.weight.to(dtype))  # -> (B, T, Ni*Hi)
    qi = qi.view(b, t, layer.index_num_heads, layer.index_head_dim).transpose(1, 2)  # -> (B, Ni, T, Hi)
    if layer.index_query_scaling_scale is not None:
        scale, bias = layer.index_query_scaling_scale, layer.index_query_scaling_bias
        qi = qi * _learned_scales(scale, bias, scaling_positions, dtype)  # (B, Ni, T, Hi)
    w = F.linear(query.to(dtype), layer.index_weights.weight.to(dtype)) * layer.index_num_heads**-0.5  # (B, T, Ni)
    return _turn_index(layer, qi, positions), w


def _index_scores(qi, w, ki):
    """sum_n w[n] * relu(qi[n] . ki * Hi**-0.5): (B, Ni, Tb, Hi), (B, Tb, Ni), (B, S, Hi) -> (B, Tb, S)."""
    dots = torch.relu(qi @ ki[:, None].transpose(-1, -2) * qi.shape[-1] ** -0.5)  # (B, Ni, Tb, S)
    return torch.einsum("bnts,btn->bts", dots, w)  # (B, Tb, S)


def _turn_index(layer, x, positions):
    """RoPE of the first Hr features of each indexer head of x (B, heads, T, Hi), paired by
    `index_rope_interleaved`, times YaRN's factor; unchanged without RoPE."""
    if layer._inv_freq is None:
        return x
    inv_freq = layer._inv_freq.to(x.device)  # (Hr/2,) float32
    x = apply_rope(x, positions, inv_freq, layer.index_rope_interleaved)  # (B, heads, T, Hi)
    return scale_rotated(x, layer._rotary_dim, rope_attention_factor(layer.rope_scaling))


def _block_allowed(keep, call, first, stop, t, s):
    """(B|1, Tb, S): the keys query rows [first, stop) may attend for some head: `keep` and the
    call's causal, window and chunk (bottom-right aligned)."""
    rows = torch.arange(first, stop, device=call.query.device)[:, None] + (s - t)  # (Tb, 1) query positions
    keys = torch.arange(s, device=call.query.device)[None, :]  # (1, S)
    allowed = keys <= rows if call.causal else torch.ones_like(keys, dtype=torch.bool)  # (Tb, S)
    before, after = _window_sides(call.window)
    allowed = allowed if before is None else allowed & (keys > rows - before)
    allowed = allowed if after is None else allowed & (keys < rows + after)
    chunk = call.attention_chunk_size
    allowed = allowed if chunk is None else allowed & (keys // chunk == rows // chunk)
    if keep is None:
        return allowed[None]  # (1, Tb, S)
    part = keep[..., first:stop, :] if keep.shape[-2] != 1 else keep  # (B|1, N|1, Tb|1, S|1)
    return part.any(dim=1) & allowed  # (B|1, Tb, S)


def _select_topk(scores, allowed, k):
    """The first k keys of each row ranked by score, highest first, equal scores by the lower key index,
    disallowed keys after every allowed one: a stable sort (`torch.topk` promises no order for ties). In an
    ONNX export, ONNX's TopK, which ranks equal values by the lower index (the ONNX spec; ONNX has no stable sort)."""
    ranked = torch.where(allowed, scores, torch.finfo(scores.dtype).min)  # (B, Tb, S)
    if torch.onnx.is_in_onnx_export():
        return torch.topk(ranked, k, dim=-1).indices  # (B, Tb, S) -> (B, Tb, k)
    return torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :k]  # (B, Tb, k)


def _selection_keep(selection, s):
    """(B, T, k) key indices -> (B, 1, T, S) boolean, True at the selected keys (an index outside
    [0, S) selects nothing)."""
    b, t, _ = selection.shape
    index = torch.where((selection >= 0) & (selection < s), selection, s).long()  # (B, T, k), S: nothing
    keep = torch.zeros(b, t, s + 1, dtype=torch.bool, device=selection.device)  # (B, T, S + 1)
    return keep.scatter_(-1, index, True)[:, None, :, :s]  # (B, 1, T, S)


def _write_index_cache(cache, ki):
    """The (B, T, Hi) indexer keys of the T tokens just written (positions [index - T, index)) to
    slots position mod L of the cache's `index_key`, in place."""
    t, length = ki.shape[1], cache.key.shape[2]
    expected = (ki.shape[0], length, ki.shape[2])
    if cache.index_key is None or tuple(cache.index_key.shape) != expected:
        shape = None if cache.index_key is None else tuple(cache.index_key.shape)
        raise ValueError(
            f"`cache.index_key` must have shape (B, L, Hi)={expected} with index_topk (make the cache with "
            f"`init_cache`). Received: cache.index_key.shape={shape}"
        )
    slots = (cache.index - t + torch.arange(t, device=ki.device)) % length  # (T,)
    cache.index_key.index_copy_(1, slots, ki)  # (B, L, Hi)
    return cache


def _gather_index(selection, s):
    """A block's (B, Tb, k) selection -> indices clamped into [0, S) and whether each entry counts:
    in range and not a repeat of an earlier entry of its row."""
    index = selection.long().sort(dim=-1).values  # (B, Tb, k)
    valid = (index >= 0) & (index < s)
    repeat = torch.cat([torch.zeros_like(index[..., :1], dtype=torch.bool), index[..., 1:] == index[..., :-1]], -1)
    return index.clamp(0, max(s - 1, 0)), valid & ~repeat


def _gathered_weights(layer, scores, keep, bias, call, part, index, valid, s):
    """The softmax of one block's gathered (B, N, Tb, k) scores, in float32 at least: soft-capping,
    the bias and keep gathered at `index`, causal, window and chunk at the keys' positions, the sinks."""
    b, n, tb, k = scores.shape
    dtype = scores.dtype
    scores = _softcap(scores.to(torch.promote_types(dtype, torch.float32)), layer.softcap)
    take = index[:, None].expand(b, n, tb, k)  # (B, N, Tb, k)
    if bias is not None:
        scores = scores + _gather_rows(bias, part, take).to(scores.dtype)
    allowed = valid[:, None] & _gathered_rule(call, part, index, s)  # (B, 1, Tb, k)
    if keep is not None:
        allowed = allowed & _gather_rows(keep, part, take)  # (B, N, Tb, k)
    sinks = None if layer.sinks is None else layer.sinks.to(scores.dtype)
    return _masked_softmax(scores, allowed, sinks).to(dtype)


def _gather_rows(x, part, take):
    """A (B|1, N|1, T|1, S|1) keep or bias at the block's query rows `part` and the (B, N, Tb, k) key
    indices `take`."""
    rows = x[..., part, :] if x.shape[-2] != 1 else x  # (B|1, N|1, Tb|1, S|1)
    if rows.shape[-1] == 1:
        return rows.expand(*take.shape[:-1], 1)
    return rows.expand(*take.shape[:-1], rows.shape[-1]).gather(-1, take)  # (B, N, Tb, k)


def _gathered_rule(call, part, index, s):
    """(B, 1, Tb, k): causal, window and chunk of the call (bottom-right aligned) at the gathered
    keys' positions `index` (B, Tb, k) of S keys for query rows `part`."""
    t = call.query.shape[1]
    rows = torch.arange(part.start, part.stop, device=index.device)[None, :, None] + (s - t)  # (1, Tb, 1)
    allowed = index <= rows if call.causal else torch.ones_like(index, dtype=torch.bool)  # (B, Tb, k)
    before, after = _window_sides(call.window)
    allowed = allowed if before is None else allowed & (index > rows - before)
    allowed = allowed if after is None else allowed & (index < rows + after)
    chunk = call.attention_chunk_size
    allowed = allowed if chunk is None else allowed & (index // chunk == rows // chunk)
    return allowed[:, None]  # (B, 1, Tb, k)


# -------------------------------------------------------------------------------------------------
# Section: speed paths
# -------------------------------------------------------------------------------------------------
# The q/k/v kernels kept between decode steps (the fused projection itself, `_project_fused`, is in
# the core: the plain call takes it). The explicit softmax's blocks and soft-capping's tiles are in
# the score modifiers' section.


def _keeps_kernels():
    """Whether the layer keeps the concatenated q/k/v kernels between calls (`_kept_fused`):
    eagerly under `no_grad`. Elsewhere a decode step projects with the three projections:
    concatenating the kernels at every step costs more than the one matmul saves."""
    return not torch.is_grad_enabled() and _eager()


def _versions(tensors, dtype):
    """The storage and version counter of each tensor (None stays None) and `dtype`: what changes
    when a tensor is replaced, moved, cast or written in place. None for an inference-mode tensor
    (no version counter)."""
    try:
        return [None if w is None else (w.data_ptr(), w._version) for w in tensors] + [dtype]
    except RuntimeError:  # an inference-mode tensor: no version counter
        return None


def _kept_fused(layer, x):
    """Under no_grad: the version of the q/k/v weights, biases and int8 scales (`_versions`, None
    where they are not kept: traced, compiled, inference-mode) and the concatenation
    `_project_fused` keeps (`layer._fused`) while it is of that version, else None."""
    projections = (layer.query, layer.key, layer.value)
    names = ("weight", "bias", "weight_scale") if isinstance(layer.query, Int8Linear) else ("weight", "bias")
    tensors = [getattr(p, name) for p in projections for name in names]
    version = _versions(tensors, x.dtype) if _keeps_kernels() else None
    kept = layer._fused
    return version, kept[1] if version is not None and kept is not None and kept[0] == version else None


def _kept_kernels(layer, dtype):
    """The decode fast path's kernels: the q/k/v kernels the layer keeps (`_project_fused`, made
    only where the projections could fuse; never with MLA or the sharing options) while they are current for `dtype`
    (`_versions`: a weight replaced, cast or written in place is another storage or version) and
    the projections are still plain nn.Linear modules with no hooks, and the output projection's
    weight and bias; else None. Read from the modules' own dicts: a read through nn.Module's
    attribute lookup costs about a microsecond, a sizeable share of a T = 1 step."""
    if layer._fused is None:
        return None
    modules, tensors = layer._modules, []  # the weight and bias of query, key, value and output
    for projection in (modules["query"], modules["key"], modules["value"], modules["output"]):
        if type(projection) is not nn.Linear or _own_hooks(projection):
            return None
        parameters = projection._parameters
        tensors += (parameters["weight"], parameters["bias"])
    if _global_hooks() or layer._fused[0] != _versions(tensors[:6], dtype):
        return None
    return layer._fused[1], tensors[6:]


# -------------------------------------------------------------------------------------------------
# Section: int8
# -------------------------------------------------------------------------------------------------
# Keras' scheme (docs/SPEC.md, "int8"): `keras.quantizers.abs_max_quantize` on the kernels (per
# output column, when quantizing) and on the inputs of each projection (per token, at run time).


_INT8_MAX = 127.0
_INT8_EPSILON = 1e-7  # Keras' `backend.epsilon()`, added to the abs-max before dividing


def _quantize(layer, mode):
    """Replaces the `nn.Linear` projections (four, five with `gate`) by `Int8Linear` modules:
    int8 weights with one float32 scale per output feature, the inputs quantized per token at
    each call (Keras' scheme, docs/SPEC.md "int8"). `export_weights` then gives the portable
    int8 layout.

    Args:
        mode: "int8", the only mode.
    """
    if mode != "int8":
        raise ValueError(f"`mode` must be 'int8'. Received: mode={mode!r}")
    others = {kind: type(getattr(layer, kind)).__name__ for kind in layer._projections}
    others = {kind: name for kind, name in others.items() if name != "Linear"}
    if others:
        raise ValueError(f"`quantize` needs the projections as nn.Linear modules. Received: {others}")
    for kind in layer._projections:
        setattr(layer, kind, Int8Linear.from_linear(getattr(layer, kind)))


def _quantize_kernel(kernel):
    """A float (D, F) kernel -> (int8 (D, F) kernel, float32 (F,) kernel_scale), computed in float32
    with NumPy as Keras' `abs_max_quantize(kernel, axis=0, to_numpy=True)`: r = 127 / (max |column|
    + 1e-7), the integers round(kernel * r) (half to even) clipped to [-127, 127], and
    kernel_scale = 1 / r (Keras keeps r and divides by it)."""
    kernel = np.asarray(kernel, dtype=np.float32)
    ratio = np.float32(_INT8_MAX) / (np.max(np.abs(kernel), axis=0) + np.float32(_INT8_EPSILON))  # (F,)
    quantized = np.clip(np.round(kernel * ratio), -_INT8_MAX, _INT8_MAX).astype(np.int8)  # (D, F)
    return quantized, (np.float32(1.0) / ratio).astype(np.float32)


def _int_mm_runs(x, weight):
    """Whether `torch._int_mm` (int8 x int8 -> int32) takes x (..., D) times the (F, D) weight (the
    SPEC's rule, "int8"): on CPU any shape; on CUDA more than 16 rows and D, F multiples of 8 (its
    kernel's limits); elsewhere (MPS, ...) never. The float sum runs where it cannot."""
    if not hasattr(torch, "_int_mm") or x.device != weight.device:
        return False
    if x.device.type == "cpu":
        return True
    rows = x.numel() // max(x.shape[-1], 1)
    return x.device.type == "cuda" and rows > 16 and x.shape[-1] % 8 == 0 and weight.shape[0] % 8 == 0


class _Int8Matmul(torch.autograd.Function):
    """x (..., D) times an int8 (F, D) weight: x quantized per token (r = 127 / (max |row| + 1e-7),
    round(x * r) clipped to [-127, 127]), the integer products summed exactly: in int32 by
    `torch._int_mm` where it runs (`_int_mm_runs`), else in float32 at least (exact while a sum
    stays below 2**24); then * (1 / r) and * weight_scale in place (no (..., F) temporary), in
    float32 at least, cast back to x's dtype. The gradient of x goes through the dequantized weight
    (Keras' straight-through gradient); the weight and its scale get none."""

    @staticmethod
    def forward(ctx, x, weight, weight_scale):
        dtype, x = x.dtype, x.to(torch.promote_types(x.dtype, torch.float32))  # float16 overflows at 65504
        top = torch.linalg.vector_norm(x, math.inf, dim=-1, keepdim=True)  # (..., 1): max |x| of each token
        ratio = _INT8_MAX / (top + _INT8_EPSILON)  # (..., 1)
        ctx.save_for_backward(weight, weight_scale)
        if _int_mm_runs(x, weight):  # int32 sums on the 2-D view, (M, D) @ (D, F)
            # |x * r| <= 127 * top / (top + 1e-7), so round() stays in [-127, 127] without a clamp
            integers = torch.mul(x, ratio).round_().to(torch.int8).reshape(-1, x.shape[-1])  # (M, D)
            accumulated = torch._int_mm(integers, weight.t()).reshape(*x.shape[:-1], weight.shape[0])  # (..., F)
            if x.dtype == torch.float32:  # the sums cast to float32 where they lie (no new (..., F) tensor)
                accumulated = accumulated.view(torch.float32).copy_(accumulated)
            return accumulated.to(x.dtype).mul_(1.0 / ratio).mul_(weight_scale.to(x.dtype)).to(dtype)  # (..., F)
        integers = (x * ratio).round_().clamp_(-_INT8_MAX, _INT8_MAX)  # (..., D), one new tensor
        with torch.autocast(x.device.type, enabled=False):  # autocast would sum in its (half) dtype
            accumulated = F.linear(integers, weight.to(x.dtype))  # (..., D) -> (..., F)
        return accumulated.mul_(1.0 / ratio).mul_(weight_scale.to(x.dtype)).to(dtype)  # (..., F), in place

    @staticmethod
    def backward(ctx, grad):
        weight, weight_scale = ctx.saved_tensors
        dequantized = weight.to(grad.dtype) * weight_scale.to(grad.dtype)[:, None]  # (F, D)
        return grad @ dequantized, None, None  # (..., F) -> (..., D)


def _int8_rows(x):
    """x (..., D) quantized per token and dequantized, round(x * r) / r with r = 127 / (max |row| +
    1e-7), as `_Int8Matmul` reads it (in float32 at least); the gradient passes straight through."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))  # float16: r of a zero row overflows
    top = torch.linalg.vector_norm(wide, math.inf, dim=-1, keepdim=True)  # (..., 1)
    ratio = _INT8_MAX / (top + _INT8_EPSILON)  # (..., 1)
    rounded = ((wide * ratio).round().clamp(-_INT8_MAX, _INT8_MAX) / ratio).to(x.dtype)  # (..., D)
    return x + (rounded - x).detach()


def _int8_linear(x, weight, weight_scale, bias):
    """(..., D) @ an int8 (F, D) weight (+ bias, added in place) -> (..., F)."""
    y = _Int8Matmul.apply(x, weight, weight_scale)
    return y if bias is None else y.add_(bias)


class Int8Linear(nn.Module):
    """A projection quantized by `MultiHeadAttention.quantize("int8")`: an int8 `weight` buffer
    (F, D) (nn.Linear's orientation: the portable kernel transposed), a float32 `weight_scale`
    buffer (F,), and the float `bias` parameter (or None) of the linear it replaced.
    `y = (quantize(x) @ weight.T) * x_scale * weight_scale + bias`, x quantized per token.

    Args:
        weight: (F, D) int8 tensor.
        weight_scale: (F,) float32 tensor.
        bias: None or an (F,) `nn.Parameter`.
    """

    def __init__(self, weight, weight_scale, bias=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)  # (F, D) int8
        self.register_buffer("weight_scale", weight_scale)  # (F,) float32
        self.bias = bias

    @classmethod
    def from_linear(cls, linear):
        """The int8 projection of an `nn.Linear` (its weight quantized in float32 as Keras does; its bias kept)."""
        kernel, scale = _quantize_kernel(linear.weight.detach().float().cpu().numpy().T)  # (D, F), (F,)
        device = linear.weight.device
        weight = torch.from_numpy(np.ascontiguousarray(kernel.T)).to(device)  # (F, D)
        return cls(weight, torch.from_numpy(scale).to(device), linear.bias)

    def forward(self, x):
        return _int8_linear(x, self.weight, self.weight_scale, self.bias)  # (..., D) -> (..., F)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# The int8 and fp8 KV caches (docs/SPEC.md, "KV-cache decoding"): each slot's key and value of each
# head (with MLA its latent and its turned key part) stored as int8 (absmax / 127) or float8_e4m3fn
# (absmax / 448) with one float32 scale, computed in float32. The attention reads the integers (fp8
# values) a block of slots at a time, each slot's key scale multiplied into its scores and its value
# scale into its weights: no float copy of the cache.
_QUANTIZED_CACHE_BLOCK = 1 << 20  # cache elements cast to float at once by `_attend_quantized`
_FP8_MAX = 448.0  # float8_e4m3fn's largest finite value (no infinities)
_QUANTIZED_CACHE = (torch.int8, torch.float8_e4m3fn)  # the cache dtypes that hold scales
_QUANTIZED_CACHE_NAMES = ("int8", "float8_e4m3fn")  # their names, as `init_cache` takes them


def _quantize_cache_rows(x, dtype=torch.int8):
    """(..., D) keys or values -> (int8 integers, or with `dtype` float8_e4m3fn fp8 values (..., D),
    float32 scale (..., 1)), in float32: scale = max |x| / 127 (fp8: / 448) over D; the integers
    round(x / scale) (half to even) clipped to [-127, 127], the fp8 values x / scale clipped to
    [-448, 448] and cast (round to nearest even; the clip spares CUDA's and CPU's casts their
    overflow rules); a row whose scale is 0 stores scale 0 and zeros."""
    x = x.to(torch.float32)
    top = _INT8_MAX if dtype == torch.int8 else _FP8_MAX
    scale = x.abs().amax(dim=-1, keepdim=True) / top  # (..., 1)
    divisor = torch.where(scale == 0, 1.0, scale)  # (..., 1); x is 0 (or below `top` subnormals) there
    if dtype != torch.int8:
        return (x / divisor).clamp_(-_FP8_MAX, _FP8_MAX).to(dtype), scale  # (..., D), (..., 1)
    return torch.round(x / divisor).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8), scale  # (..., D), (..., 1)


def _with_cache_scales(cache):
    """An int8 or fp8 cache's zero scales (B, K, L, 1), one per slot and head, for its keys and values."""
    key_scale = cache.key.new_zeros((*cache.key.shape[:3], 1), dtype=torch.float32)  # (B, K, L, 1)
    value_scale = cache.value.new_zeros((*cache.value.shape[:3], 1), dtype=torch.float32)  # (B, K, L, 1)
    return cache._replace(key_scale=key_scale, value_scale=value_scale)


def _check_quantized_cache(cache):
    """An int8 (fp8) cache: int8 (float8_e4m3fn) keys and values, float32 scales (B, K, L, 1) beside them."""
    dtype = cache.key.dtype
    kind = _dtype_name(dtype)
    for name in ("key", "value"):
        field, scale = getattr(cache, name), getattr(cache, f"{name}_scale")
        shape = (*field.shape[:3], 1)
        if field.dtype != dtype or scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != shape:
            received = None if scale is None else (_dtype_name(scale.dtype), tuple(scale.shape))
            raise ValueError(
                f"{'An' if kind == 'int8' else 'A'} {kind} `cache` must hold {kind} `{name}` and a float32 "
                f"`{name}_scale` of shape {shape}; make it with `init_cache(..., dtype='{kind}')`. "
                f"Received: cache.{name}.dtype={_dtype_name(field.dtype)}, cache.{name}_scale={received}"
            )


def _quantized_cache_fits(cache):
    """Whether a cache passes `_check_quantized_cache` (the decode fast path's check, raising nothing)."""
    scales = (cache.key_scale, cache.value_scale)
    shape = (*cache.key.shape[:3], 1)
    fits = all(type(x) is torch.Tensor and x.dtype == torch.float32 and x.shape == shape for x in scales)
    return fits and cache.key.dtype == cache.value.dtype and cache.key.dtype in _QUANTIZED_CACHE


def _write_quantized_cache(cache, k, v, key_mask, start):
    """`_write_cache` for an int8 or fp8 cache: the new (B, K, T, H) keys and values quantized
    (`_quantize_cache_rows`), their integers (fp8 values) written to `key` and `value` and their
    scales to `key_scale` and `value_scale` by `_write_cache` itself (keep and index written twice,
    the same both times). fp8 is written eagerly through uint8 views of the same bytes (PyTorch's
    `index_copy_` has no fp8 kernel on the CPU; ONNX has no such view)."""
    (k_int, k_scale), (v_int, v_scale) = (_quantize_cache_rows(x, cache.key.dtype) for x in (k, v))
    fields = (cache.key, cache.value, k_int, v_int)
    bits = cache.key.dtype != torch.int8 and _eager()  # fp8, eagerly: uint8 views (an export keeps fp8)
    key, value, k_int, v_int = (x.view(torch.uint8) for x in fields) if bits else fields
    _write_cache(KVCache(key, value, cache.keep, cache.index), k_int, v_int, key_mask, start)
    scales = KVCache(cache.key_scale, cache.value_scale, cache.keep, cache.index)
    written = _write_cache(scales, k_scale, v_scale, key_mask, start)
    return KVCache(cache.key, cache.value, written.keep, written.index, *cache[4:])


def _dequantize_cache(cache, k, v, dtype):
    """MLA over an int8 or fp8 cache: its (B, 1, S, C) and (B, 1, S, Hr) integers (fp8 values; the
    first S slots) times their scales, in float32, cast to the compute `dtype` (MLA's attention makes
    per-step keys of the whole cache anyway: the absorbed keys, or the expanded heads)."""
    s, k, v = k.shape[2], k.to(torch.float32), v.to(torch.float32)  # (B, 1, S, C), (B, 1, S, Hr)
    k, v = k * cache.key_scale[:, :, :s], v * cache.value_scale[:, :, :s]  # (B, 1, S, C), (B, 1, S, Hr)
    return k.to(dtype), v.to(dtype)


def _attend_quantized(layer, q, k, v, keep, bias, call):
    """Step 6 over an int8 or fp8 cache: q (B, N, T, H), its (B, K, S, H) integers (fp8 values) k
    and v (the first S slots), without a float copy of the cache: a block of key/value heads at a time, all S slots
    of each (`_float_blocks`), each slot's key scale multiplied into its scores after q . k and
    its value scale into its weights before weights . v (exact algebra), the explicit softmax
    between, in float32 at least. Returns (context (B, N, T, H), weights (B, N, T, S) or None)."""
    (b, n, t, h), (heads, s), sinks = q.shape, k.shape[1:3], layer.sinks
    keep, bias = _final_masks(keep, bias, call.causal, call.window, call.attention_chunk_size, sinks, t, s, q.device)
    dtype, rows = torch.promote_types(q.dtype, torch.float32), n // heads * t  # rows: G*T
    k_scale, v_scale = (x[:, :, :s].reshape(b * heads, 1, s) for x in (call.cache.key_scale, call.cache.value_scale))
    grouped = (q.to(dtype) * layer.scale).reshape(b * heads, rows, h)  # (B, N, T, H) -> (B*K, G*T, H)
    blocks = [grouped[i : i + len(x)] @ x.transpose(1, 2) for i, x in _float_blocks(k, dtype)]  # (heads, G*T, S)
    scores = (torch.cat(blocks) * k_scale).reshape(b, n, t, s)  # (B*K, G*T, S) -> (B, N, T, S)
    scores = _capped_scores(layer, scores)
    scores = scores if bias is None else scores + bias.to(dtype)  # (B, N, T, S)
    weights = _masked_softmax(scores, keep, sinks)  # (B, N, T, S)
    used = F.dropout(weights, layer.dropout, training=layer.training and layer.dropout > 0)
    used = used.reshape(b * heads, rows, s) * v_scale  # (B, N, T, S) -> (B*K, G*T, S)
    context = torch.cat([used[i : i + len(x)] @ x for i, x in _float_blocks(v, dtype)])  # (B*K, G*T, H)
    context = context.reshape(b, n, t, v.shape[-1]).to(q.dtype)  # (B*K, G*T, H) -> (B, N, T, H)
    return context, weights.to(q.dtype) if call.return_attention else None


def _float_blocks(x, dtype):
    """(B, K, S, H) integers or fp8 values (the first S slots of a cache) -> (first head, (heads,
    S, H) block in `dtype`) for each block of about `_QUANTIZED_CACHE_BLOCK` elements of the B*K
    key/value heads (one head at least; a head's slots lie together in the cache). Eagerly under
    no_grad each block is cast into one buffer, reused: a block is used before the next is made
    (fp8 on the CPU by a lookup, `_fp8_to_float`)."""
    flat = x.reshape(-1, *x.shape[2:])  # (B, K, S, H) -> (B*K, S, H), a view of a cache from `init_cache`
    size = x.shape[2] * x.shape[3]  # one head's elements
    per = max(1, _QUANTIZED_CACHE_BLOCK // max(size, 1))  # heads per block
    reuse = _eager() and not torch.is_grad_enabled()  # a graph or autograd keeps each block
    buffer = x.new_empty(min(per, flat.shape[0]) * size, dtype=dtype) if reuse else None
    looked_up = reuse and x.dtype == torch.float8_e4m3fn and x.device.type == "cpu"
    codes = torch.empty(buffer.shape, dtype=torch.long) if looked_up else None  # the lookup's indices
    for i in range(0, flat.shape[0], per):
        block = flat[i : i + per]  # (heads, S, H)
        if buffer is None:
            yield i, block.to(dtype)
        else:
            yield i, _fp8_to_float(block, buffer, codes) if looked_up else _cast_into(block, buffer)


def _cast_into(block, buffer):
    """A (heads, S, H) block cast into the first elements of `buffer`, viewed as the block."""
    return buffer[: block.numel()].view(block.shape).copy_(block)


def _fp8_to_float(block, buffer, codes):
    """A (heads, S, H) fp8 block on the CPU into `buffer`'s dtype: its codes (uint8 views) index the
    256 values of float8_e4m3fn (`index_select` into `buffer`), the values PyTorch's cast gives,
    about 6 times faster than that cast, which converts element by element on the CPU."""
    n = block.numel()
    indices = _cast_into(block.view(torch.uint8), codes).view(-1)  # (heads*S*H,)
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(buffer.dtype)  # (256,)
    return torch.index_select(table, 0, indices, out=buffer[:n]).view(block.shape)  # (heads, S, H)


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


def _is_int8_layout(weights):
    return any(str(name).endswith("_kernel_scale") for name in weights)


def _torchao_weight(tensor):
    """Whether `tensor` is a weight quantized by torchao's `quantize_` (a tensor subclass holding
    `qdata` and `scale`): int8 with scale abs-max / 127.5 and -128 allowed, activations likewise, so
    not the portable int8 scheme; `export_weights` gives it dequantized."""
    return isinstance(tensor, torch.Tensor) and hasattr(tensor, "qdata") and hasattr(tensor, "dequantize")


# -------------------------------------------------------------------------------------------------
# Section: framework only
# -------------------------------------------------------------------------------------------------
# PyTorch only: tensor parallelism, autocast, the meta device, module hooks, the parameters made
# and initialized; the checks shared by the sections; and the masks' values that read like another
# library's habit (nn.MultiheadAttention's True = ignore, Keras' 0/1 floats), warned of once per layer.


class _Variants(NamedTuple):
    """The variants' constructor arguments, checked (`_check_variants`); `scale` is resolved."""

    scale: float  # 1 / sqrt(H) by default
    softcap: float | None
    window: int | tuple[int, int] | None  # W, or (W_before, W_after)
    attention_chunk_size: int | None
    rope_theta: float | None  # None: no RoPE
    rope_fraction: float
    rope_interleaved: bool
    rope_scaling: dict | None
    rope_sections: tuple[int, ...] | None
    qk_norm: str | None  # None, "head", "per_head" or "all"
    qk_norm_eps: float
    qk_norm_type: str  # "rms" or "layer"
    qk_norm_bias: bool
    sinks: bool
    clip_qkv: float | None  # None: no clamp
    gate: bool
    latent_norm_eps: float


def _check_variants(
    head_dim, rope_width, scale, softcap, window, attention_chunk_size, rope_theta, rope_fraction, rope_interleaved,
    rope_scaling, rope_sections, qk_norm, qk_norm_eps, qk_norm_type, qk_norm_bias, sinks, clip_qkv, gate,
    latent_norm_eps,
):  # fmt: skip
    """The variants' constructor arguments checked by their sections' helpers, in this order (the
    flags last), into a `_Variants` (a ValueError names the first one that is not valid)."""
    scale, softcap, window, chunk = _check_score_modifiers(head_dim, scale, softcap, window, attention_chunk_size)
    rope = _check_rope(rope_width, rope_theta, rope_fraction, rope_scaling, rope_sections)
    qk_norm, qk_norm_eps, qk_norm_type, clip_qkv = _check_norms(qk_norm, qk_norm_eps, qk_norm_type, clip_qkv)
    latent_norm_eps = _positive_float("latent_norm_eps", latent_norm_eps)
    rope_interleaved = _flag("rope_interleaved", rope_interleaved)  # the flags last
    qk_norm_bias, sinks = _flag("qk_norm_bias", qk_norm_bias), _flag("sinks", sinks)
    gate = _flag("gate", gate)
    (rope_theta, rope_fraction, rope_scaling, rope_sections) = rope
    return _Variants(
        scale, softcap, window, chunk, rope_theta, rope_fraction, rope_interleaved, rope_scaling, rope_sections,
        qk_norm, qk_norm_eps, qk_norm_type, qk_norm_bias, sinks, clip_qkv, gate, latent_norm_eps,
    )  # fmt: skip


def _positive_int(name, value):
    if not _is_positive_int(value):
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


def _is_positive_int(value):
    """A Python or NumPy integer (not a bool) >= 1."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value >= 1


def _positive_float(name, value, optional=False):
    """`value` as a float, checked positive (None passes through when `optional`)."""
    if optional and value is None:
        return None
    if not _is_positive_number(value):
        expected = "None or a positive float" if optional else "a positive float"
        raise ValueError(f"`{name}` must be {expected}. Received: {name}={value!r}")
    return float(value)


def _is_positive_number(value):
    number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    return number and 0 < value < float("inf")


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


def _make_weights(layer, latent, sinks, gate, factory):
    """The four projections (with MLA, `latent` not None: its projections and the latents' norm
    scales), the gate's with `gate` (as wide as the output projection's input), the QK-norm
    scales and biases, the sink logits and the RoPE frequencies (a non-persistent float32 buffer
    `_inv_freq` (R/2,), None without RoPE, filled by `reset_parameters`), uninitialized."""
    nh, kh = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    if latent is not None:
        _make_latent_weights(layer, factory)
    else:
        layer.query = nn.Linear(layer.d_model, nh, bias="query" in layer.bias, **factory)  # query_kernel^T: (N*H, E)
        own = {kind: kind in layer._projections for kind in ("key", "value")}  # not with `kv_shared`, ...
        layer.key = (
            nn.Linear(layer.kdim, kh, bias="key" in layer.bias, **factory) if own["key"] else None
        )  # (K*H, kdim)
        layer.value = nn.Linear(layer.vdim, kh, bias="value" in layer.bias, **factory) if own["value"] else None
        layer.output = nn.Linear(nh, layer.d_model, bias="output" in layer.bias, **factory)  # output_kernel^T: (E, N*H)
    nv = layer.output.in_features  # N*H, or N*Hv with MLA
    gated = nn.Linear(layer.d_model, nv, bias="gate" in layer.bias, **factory) if gate else None
    layer.gate = gated  # gate_kernel^T: (N*Hv, E) (Hv = H without MLA), None without `gate`
    norms = {None: (None, None), "head": (layer.head_dim, layer.head_dim)}.get(layer.qk_norm, (nh, kh))
    norms = norms if "key" in layer._projections or latent is not None else (norms[0], None)  # `kv_shared`: no key_norm
    layer.query_norm, layer.key_norm = (
        None if width is None else nn.Parameter(torch.empty(width, **factory)) for width in norms
    )  # (H,) or (N*H,), (H,) or (K*H,)
    biases = norms if layer.qk_norm_bias else (None, None)
    layer.query_norm_bias, layer.key_norm_bias = (
        None if width is None else nn.Parameter(torch.empty(width, **factory)) for width in biases
    )  # shaped as query_norm and key_norm
    layer.sinks = nn.Parameter(torch.empty(layer.num_heads, **factory)) if sinks else None  # (N,)
    rope = layer._rotary_dim is not None
    inv_freq = torch.empty(layer._rotary_dim // 2, device=factory["device"]) if rope else None  # (R/2,)
    layer.register_buffer("_inv_freq", inv_freq, persistent=False)


def _reset_parameters(layer):
    """Glorot (Xavier) uniform kernels, zero biases, QK-norm scales of one, QK-norm biases and
    sink logits of zero, as in the other files; and the RoPE frequencies computed (`_reset_rope`)."""
    for kind in layer._projections:
        projection = getattr(layer, kind)
        nn.init.xavier_uniform_(projection.weight)
        if projection.bias is not None:
            nn.init.zeros_(projection.bias)
    for norm in (layer.query_norm, layer.key_norm, *_latent_norms(layer)):
        if norm is not None:
            nn.init.ones_(norm)
    for norm_bias in (layer.query_norm_bias, layer.key_norm_bias):
        if norm_bias is not None:
            nn.init.zeros_(norm_bias)
    if layer.sinks is not None:
        nn.init.zeros_(layer.sinks)
    _reset_vectors(layer, ("query_scaling_scale", "query_scaling_bias", *_CONTEXT_NORMS))
    _reset_indexer(layer)
    _reset_rope(layer)


def _float_weight(layer):
    """The output projection's float weight (a wrapper's first float parameter, as LoRA's), or
    None where it holds none (a quantized module)."""
    weight = getattr(layer.output, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight
    tensors = (*layer.output.parameters(), *layer.output.buffers())  # an Int8Linear: its bias, else its scale
    return next((p for p in tensors if p.is_floating_point()), None)


def _check_token_mask(name, mask, b, length, letter):
    """Checks a (B, length) boolean `key_mask` or `query_mask`."""
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (b, length)):
        raise ValueError(
            f"`{name}` must be a boolean tensor of shape (B, {letter})=({b}, {length}). "
            f"Received: {name}.shape={tuple(mask.shape)}, {name}.dtype={_dtype_name(mask.dtype)}"
        )
    return mask


def _check_lengths(query, key, value):
    if not query.shape[0] == key.shape[0] == value.shape[0]:
        raise ValueError(
            "`query`, `key` and `value` must have the same batch size B. Received: "
            f"query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
        )
    if key.shape[1] != value.shape[1]:
        raise ValueError(
            "`key` and `value` must have the same length S. Received: "
            f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
        )


def _check_dtypes(query, key, value):
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(
            "`query`, `key` and `value` must have the same dtype. Received: "
            f"query.dtype={_dtype_name(query.dtype)}, key.dtype={_dtype_name(key.dtype)}, "
            f"value.dtype={_dtype_name(value.dtype)}"
        )


def _is_integer(tensor):
    return isinstance(tensor, torch.Tensor) and not (
        tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool
    )


def _is_floating(tensor):
    return isinstance(tensor, torch.Tensor) and tensor.is_floating_point()


def _dtype_name(dtype):
    return dtype.name if isinstance(dtype, np.dtype) else str(dtype).removeprefix("torch.")


def _as_tensors(query, tensors):
    """A call's masks and positions given as lists or NumPy arrays, as tensors on the query's device."""
    device = query.device if isinstance(query, torch.Tensor) else None
    return [_as_tensor(x, device) for x in tensors]


def _batch_of_one(query, key, value, key_mask, query_mask):
    """Unbatched inputs, (L, D) -> (1, L, D), and 1-D token masks, (L,) -> (1, L)."""
    query, key, value = (x if x is None else x.unsqueeze(0) for x in (query, key, value))  # (L, D) -> (1, L, D)
    key_mask, query_mask = (m if m is None or m.ndim != 1 else m[None] for m in (key_mask, query_mask))
    return query, key, value, key_mask, query_mask


def _check_key_value(layer, query, key, value):
    """Cross-attention's `key` and `value`: (B, S, kdim) and (B, S, vdim), the query's batch and dtype."""
    key, value = _check_input("key", key, "kdim", layer.kdim), _check_input("value", value, "vdim", layer.vdim)
    _check_dtypes(query, key, value)
    _check_lengths(query, key, value)
    return key, value


def _as_tensor(x, device):
    """`x` as a tensor on `device`; a value no tensor can hold (strings, objects) stays a NumPy
    array, which the checks refuse by its dtype with the other files' ValueError."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    array = np.asarray(x)
    return torch.as_tensor(x, device=device) if array.dtype.kind in "biufc" else array


def _concatenable(weights):
    """Whether weights of a tensor subclass concatenate into one: not torchao's, not DTensor shards."""
    return not any(_torchao_weight(w) or _is_dtensor(w) for w in weights)


def _is_dtensor(tensor):
    """Whether `tensor` is a DTensor (sharded by tensor parallelism), read from its type so that
    importing this file does not import torch.distributed.tensor (0.7 s)."""
    kind = type(tensor)
    return kind.__name__ == "DTensor" and kind.__module__.startswith("torch.distributed.tensor")


def _autocast_enabled(device):
    """Whether autocast is on for the device's type; never on the meta device, which autocast does not know."""
    return device.type != "meta" and torch.is_autocast_enabled(device.type)


def _check_compute_dtype(query, dtype):
    """Outside autocast the inputs must have the dtype the layer computes in (its parameters'):
    the projections' matmuls would fail with a RuntimeError, or a cast would hide the mismatch."""
    if query.dtype != dtype and not _autocast_enabled(query.device):
        raise ValueError(
            f"`query`, `key` and `value` must have the layer's dtype {_dtype_name(dtype)}: cast them, or the layer "
            f"(`layer.to(dtype)`), or call it under torch.autocast. Received: query.dtype={_dtype_name(query.dtype)}"
        )


def _own_hooks(module):
    """Whether `module` has hooks of its own (tensor parallelism and pruning add hooks)."""
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )


def _global_hooks():
    """Whether module hooks registered for every module (`register_module_forward_hook` and friends) are set."""
    state = torch.nn.modules.module
    hooks = (
        state._global_forward_hooks, state._global_forward_pre_hooks,
        state._global_backward_hooks, state._global_backward_pre_hooks,
    )  # fmt: skip
    return any(hooks)


def _refuse_partial_heads(layer, width):
    """Tensor parallelism: a rank's projection `width` wide must hold whole heads."""
    raise ValueError(
        "Each tensor-parallel rank must hold whole heads: `num_heads` and `num_kv_heads` must be divisible "
        f"by the number of ranks. Received: num_heads={layer.num_heads}, num_kv_heads={layer.num_kv_heads}, "
        f"head_dim={layer.head_dim}, a projection {width} wide on this rank"
    )


def _check_local_heads(layer, q, k, attention_mask, attention_bias):
    """Tensor parallelism: this rank's query and key/value heads must keep the N : K grouping,
    and neither a per-head (B, N, T, S) mask or bias nor the variants that hold numbers of
    every head (sinks, QK-norm over all heads or with a scale per head) can be split with them."""
    local, local_kv = q.shape[1], k.shape[1]
    if (local, local_kv) == (layer.num_heads, layer.num_kv_heads):
        return
    if local * layer.num_kv_heads != local_kv * layer.num_heads:
        raise ValueError(
            "Each tensor-parallel rank must hold whole groups of heads: `num_kv_heads` must be divisible by the "
            f"number of ranks. Received: num_heads={layer.num_heads}, num_kv_heads={layer.num_kv_heads}, "
            f"{local} query and {local_kv} key/value heads on this rank"
        )
    for name, mask in (("attention_mask", attention_mask), ("attention_bias", attention_bias)):
        if mask is not None and mask.dim() == 4 and mask.shape[1] != 1:
            raise ValueError(
                f"A per-head `{name}` (B, N, T, S) cannot be used with heads split across tensor-parallel "
                f"ranks ({local} of {layer.num_heads} heads on this rank); pass (T, S), (B, T, S) or (B, 1, T, S). "
                f"Received: {name}.shape={tuple(mask.shape)}"
            )
    if layer.sinks is not None or layer.qk_norm in ("all", "per_head"):
        raise ValueError(
            "`sinks` and `qk_norm='all'` hold numbers of every head and cannot be split across tensor-parallel "
            f"ranks ({local} of {layer.num_heads} heads on this rank), nor can `qk_norm='per_head'`. "
            f"Received: sinks={layer.sinks is not None}, qk_norm={layer.qk_norm!r}"
        )
    if layer.output_norm is not None:
        raise ValueError(
            "`output_norm` normalizes over every head and cannot be split across tensor-parallel ranks "
            f"({local} of {layer.num_heads} heads on this rank). Received: output_norm={layer.output_norm!r}"
        )


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
    """Warns once per layer for each built-in habit the masks' values suggest (docs/SPEC.md,
    Masks), where reading them is free (eager, on the CPU); a call with a cache is not read."""
    masks = [mask for mask in (attention_mask, key_mask) if mask is not None]
    if not masks or not _values_readable(*masks):
        return
    traps = {}
    for name, mask in (("attention_mask", attention_mask), ("key_mask", key_mask)):
        if mask is not None and mask.dtype == torch.bool and mask.numel() > 0 and not bool(mask.any()):
            traps[name] = _EMPTY_MASK.format(name=name)  # False everywhere: nn.MultiheadAttention's True = ignore
    boolean = attention_mask is not None and attention_mask.dtype == torch.bool
    if boolean and "attention_mask" not in traps and _keeps_only_later(attention_mask, t, s):
        traps["causal"] = _CAUSAL_TRAP
    empty = 0  # the rows keeping no key of a key_mask that reads as nn.MultiheadAttention's key_padding_mask
    if key_mask is not None and "key_mask" not in traps:  # (True = padding): every row False then True,
        kept = key_mask.sum(-1)  # (B,)                   # some row keeping no key and none keeping all
        ordered = bool((key_mask[:, 1:] >= key_mask[:, :-1]).all())
        empty = 0 if not ordered or bool((kept == key_mask.shape[1]).any()) else int((kept == 0).sum())
    if empty:
        traps["padding"] = _PADDING_TRAP.format(empty=empty, b=key_mask.shape[0])
    if attention_mask is not None and attention_mask.is_floating_point() and _zeros_and_ones(attention_mask):
        traps["zeros and ones"] = _ZEROS_AND_ONES
    for kind, message in traps.items():
        if kind not in layer._warned_traps:
            layer._warned_traps.add(kind)
            _warn_at_caller(message)


def _values_readable(*tensors):
    """Whether tensor values can be read here for free: not while torch.compile or torch.jit.trace
    trace, and only on the CPU (reading a CUDA tensor waits for the device; meta holds none)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return all(isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in tensors)


def _keeps_only_later(mask, t, s):
    """A square (T == S) boolean mask that keeps keys only after each query, none where `causal`
    keeps one (nn.MultiheadAttention's causal `attn_mask`, `triu(ones, 1)`). A mask whose last two
    dimensions do not broadcast to (T, S) is not read: `_mask_to_4d` refuses it."""
    fits = mask.dim() >= 2 and mask.shape[-2] in (1, t) and mask.shape[-1] in (1, s)
    return fits and mask.numel() > 0 and t == s > 0 and not bool((mask & causal_mask(t, s, mask.device)).any())


def _zeros_and_ones(mask):
    """A floating mask of only 0s and 1s, some 1 (a Keras mask, which Keras reads as boolean)."""
    ones = mask == 1
    return bool(((mask == 0) | ones).all() and ones.any())


# The packages between the user's call and this file
_FRAMEWORK_MODULES = ("torch",)


def _warn_at_caller(message):
    """Warns `AttentionMaskWarning` at the user's line: the first frame outside this file and the
    framework (a module's or layer's `__call__`, Keras' traceback filter), however deep they call."""
    frame, level = sys._getframe(1), 2  # level 2: the frame that called this function
    while frame is not None and (
        frame.f_globals is globals() or frame.f_globals.get("__name__", "").split(".")[0] in _FRAMEWORK_MODULES
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, AttentionMaskWarning, stacklevel=level)


# -------------------------------------------------------------------------------------------------
# Section: converters
# -------------------------------------------------------------------------------------------------
# Parameters: `query`, `key`, `value` and `output` are `nn.Linear` submodules, so `state_dict` holds
# `query.weight` = query_kernel^T, `query.bias` = query_bias, and so on for the others; with `qk_norm`
# also `query_norm` and `key_norm` (and `query_norm_bias`, `key_norm_bias` with `qk_norm_bias`), with
# `sinks=True` also `sinks` (N,), with `gate=True` the `nn.Linear` `gate`. The portable weights
# (`export_weights`, `import_weights`) name the kernels as the other files do.
# Coming from `nn.MultiheadAttention` (`from_torch`, `to_torch`): a boolean mask here is True where a
# query may attend (there True means "ignore": pass `~attn_mask`, and `key_mask=~key_padding_mask`);
# `need_weights=True, average_attn_weights=False` is `return_attention=True`; `is_causal=True` is
# `causal=True` (bottom-right aligned when T < S); inputs are batch first.


def _weight_shapes(layer):
    """The portable layout: {name: shape}; a bias only where `bias` names its projection, the
    QK-norm scales only with `qk_norm` (and their biases with `qk_norm_bias`), `sinks` only
    with `sinks=True`, the gate's kernel only with `gate=True`; with MLA the latent projections
    and norms instead of key and value."""
    nh, kh = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    kernels = {
        "query": (layer.d_model, nh),
        "key": (layer.kdim, kh),
        "value": (layer.vdim, kh),
        "output": (nh, layer.d_model),
        "gate": (layer.d_model, nh),
    }
    kernels = {kind: shape for kind, shape in kernels.items() if kind in layer._projections}
    kernels, norms = _kernels_and_norms(layer, kernels)  # MLA's projections instead, and its norms
    shapes = {}
    for kind, shape in kernels.items():
        shapes[f"{kind}_kernel"] = shape
        if kind in layer.bias:
            shapes[f"{kind}_bias"] = shape[1:]
        if kind in norms:
            shapes[f"{kind}_norm"] = norms[kind]
    if layer.qk_norm is not None:
        shared = layer.qk_norm == "head"
        shapes["query_norm"] = (layer.head_dim if shared else nh,)
        shapes["key_norm"] = (layer.head_dim if shared else kh,)
    if layer.query_norm_bias is not None:
        shapes["query_norm_bias"], shapes["key_norm_bias"] = shapes["query_norm"], shapes["key_norm"]
    if layer.key_norm is None:  # `kv_shared`: no key projection, no key norm
        shapes = {name: shape for name, shape in shapes.items() if not name.startswith("key_norm")}
    if layer.sinks is not None:
        shapes["sinks"] = (layer.num_heads,)
    shapes.update(_query_scaling_shapes(layer))  # the learned query scaling's
    shapes.update(_index_shapes(layer))  # the sparse indexer's
    shapes.update(_context_norm_shapes(layer))  # `output_norm`'s
    return _with_scales(shapes) if layer.quantization_mode == "int8" else shapes


def _parameter(layer, name):
    """The tensor behind a portable name and whether it is stored transposed. A dynamically
    quantized projection (`torch.ao.quantization.quantize_dynamic`) gives its dequantized weight."""
    if name in (
        "query_norm",
        "key_norm",
        "query_norm_bias",
        "key_norm_bias",
        "sinks",
        "query_a_norm",
        "key_value_a_norm",
        "index_key_norm",
        "index_key_norm_bias",
        "query_scaling_scale",
        "query_scaling_bias",
        *_INDEX_VECTORS,
        *_CONTEXT_NORMS,
    ):
        return getattr(layer, name), False
    if name.endswith("_kernel_scale"):
        return getattr(layer, name.removesuffix("_kernel_scale")).weight_scale, False
    kind, part = name.rsplit("_", 1)
    projection = getattr(layer, kind)
    tensor = projection.weight if part == "kernel" else projection.bias
    if callable(tensor):  # a quantized module's weight() and bias() are methods
        tensor = tensor()
        tensor = tensor.dequantize() if tensor.is_quantized else tensor
    if _torchao_weight(tensor):
        tensor = tensor.dequantize()  # (F, D) float: torchao's int8 is not the portable scheme
    return tensor, part == "kernel"


def _export_weights(layer):
    """Returns the portable weights: a dict of NumPy arrays (bfloat16 is widened to float32; a
    dynamically quantized projection gives its dequantized weight)."""
    weights = {}
    for name in layer.weight_shapes():
        tensor, transposed = _parameter(layer, name)
        tensor = tensor.detach().cpu()
        tensor = tensor.float() if tensor.dtype == torch.bfloat16 else tensor
        weights[name] = (tensor.T if transposed else tensor).numpy().copy()
    return weights


def _import_weights(layer, weights):
    """Loads portable weights; strict and atomic (a ValueError lists every problem). An int8
    layout (with `<kind>_kernel_scale`) quantizes a float layer first; an int8 layer takes only one."""
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
    weights_now = {kind: getattr(getattr(layer, kind), "weight", None) for kind in layer._projections}
    quantized = [kind for kind, weight in weights_now.items() if callable(weight) or _torchao_weight(weight)]
    if quantized:
        raise ValueError(
            "`import_weights` writes float projections: import the weights before quantizing. "
            f"Received: quantized projections {quantized}"
        )
    if int8 and layer.quantization_mode is None:
        layer.quantize("int8")
    with torch.no_grad():
        for name in expected:
            tensor, transposed = _parameter(layer, name)
            value = torch.as_tensor(np.asarray(weights[name]), dtype=tensor.dtype, device=tensor.device)
            tensor.copy_(value.T if transposed else value)


def _non_defaults(layer):
    """The variants not at their default, and a partial `bias`, {name: value} (`rope_sections`
    only with RoPE, `qk_norm_type` and `qk_norm_bias` only with `qk_norm`: what they change)."""
    variants = {
        "bias": list(layer.bias) if layer.bias not in ((), layer._projections) else None,
        **_score_settings(layer),
        "rope_theta": layer.rope_theta,
        "rope_sections": layer.rope_sections if layer.rope_theta is not None else None,
        "rope_sections_interleaved": True if layer.rope_sections_interleaved and layer.rope_sections else None,
        "qk_norm": layer.qk_norm,
        "qk_norm_type": layer.qk_norm_type if layer.qk_norm is not None and layer.qk_norm_type != "rms" else None,
        "qk_norm_bias": True if layer.qk_norm is not None and layer.qk_norm_bias else None,
        "sinks": True if layer.sinks is not None else None,
        "clip_qkv": layer.clip_qkv,
        "gate": True if layer.gate is not None else None,
        "gate_activation": layer.gate_activation
        if layer.gate is not None and layer.gate_activation != "sigmoid"
        else None,
        **{name: getattr(layer, name) for name in _LATENT_SIZES},
        "query_scaling": layer.query_scaling,
        **{name: True for name in _SHARING_FLAGS if getattr(layer, name)},
        **{name: getattr(layer, name) for name in _INDEX_SIZES},
        "index_rope_interleaved": True if layer.index_rope_interleaved else None,
        "index_query_input_norm": True if layer.index_query_input_norm else None,
        "output_norm": layer.output_norm,
        "qk_norm_after_rope": True if layer._qk_norm_late else None,
    }
    return {name: value for name, value in variants.items() if value is not None}


def _extra_repr(layer):
    settings = {"bias": bool(layer.bias), **_non_defaults(layer)}  # a partial `bias` replaces True
    if layer.rope_theta is not None:
        settings |= {"rope_fraction": layer.rope_fraction, "rope_interleaved": layer.rope_interleaved}
        settings |= {"rope_scaling": layer.rope_scaling}
    if layer.qk_norm is not None:
        settings["qk_norm_eps"] = layer.qk_norm_eps
    return ", ".join(
        [
            f"d_model={layer.d_model}, num_heads={layer.num_heads}, num_kv_heads={layer.num_kv_heads}",
            f"head_dim={layer.head_dim}, dropout={layer.dropout}",
            *(f"{name}={value!r}" for name, value in settings.items()),
        ]
    )


def _from_torch(cls, module):
    """Builds a layer with the weights of a `torch.nn.MultiheadAttention`.

    Packed (`in_proj_weight`) and separate (`q/k/v_proj_weight`) projections are read,
    `batch_first` either way (this layer is always batch first), with or without bias.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise ValueError(f"`module` must be a torch.nn.MultiheadAttention. Received: {type(module).__name__}")
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError(
            "`module` uses add_bias_kv or add_zero_attn, which append learned or zero keys "
            "that this layer does not have. Received: "
            f"add_bias_kv={module.bias_k is not None}, add_zero_attn={module.add_zero_attn}"
        )
    e = module.embed_dim
    has_bias = module.in_proj_bias is not None
    reference = module.out_proj.weight
    layer = cls(
        e, module.num_heads, kdim=module.kdim, vdim=module.vdim, dropout=module.dropout,
        bias=has_bias, device=reference.device, dtype=reference.dtype,
    )  # fmt: skip
    if module._qkv_same_embed_dim:
        weights = module.in_proj_weight.detach().split(e)
    else:
        weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
    with torch.no_grad():
        for projection, weight in zip((layer.query, layer.key, layer.value), weights, strict=True):
            projection.weight.copy_(weight)
        layer.output.weight.copy_(module.out_proj.weight)
        if has_bias:
            for projection, bias in zip(
                (layer.query, layer.key, layer.value), module.in_proj_bias.split(e), strict=True
            ):
                projection.bias.copy_(bias)
            layer.output.bias.copy_(module.out_proj.bias)
    return layer


def _to_torch(layer):
    """Returns a `torch.nn.MultiheadAttention` (batch_first=True) with these weights."""
    if layer.num_kv_heads != layer.num_heads:
        raise ValueError(
            "`torch.nn.MultiheadAttention` cannot hold grouped-query attention: it has one key/value "
            f"head per query head. Received: num_heads={layer.num_heads}, num_kv_heads={layer.num_kv_heads}"
        )
    if layer.num_heads * layer.head_dim != layer.d_model:
        raise ValueError(
            "`torch.nn.MultiheadAttention` needs num_heads * head_dim == d_model. "
            f"Received: d_model={layer.d_model}, num_heads={layer.num_heads}, head_dim={layer.head_dim}"
        )
    variants = _non_defaults(layer)
    if variants:
        raise ValueError(
            f"`torch.nn.MultiheadAttention` cannot hold {', '.join(variants)}: it has plain softmax attention "
            "scaled by 1 / sqrt(head_dim), with biases on all four projections or on none. Received: "
            + ", ".join(f"{name}={value!r}" for name, value in variants.items())
        )
    reference = layer.output.weight
    module = nn.MultiheadAttention(
        layer.d_model, layer.num_heads, dropout=layer.dropout, bias=bool(layer.bias), kdim=layer.kdim,
        vdim=layer.vdim, batch_first=True, device=reference.device, dtype=reference.dtype,
    )  # fmt: skip
    projections = (layer.query, layer.key, layer.value)
    with torch.no_grad():
        if module._qkv_same_embed_dim:
            module.in_proj_weight.copy_(torch.cat([p.weight for p in projections]))
        else:
            for target, projection in zip(
                (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight), projections, strict=True
            ):
                target.copy_(projection.weight)
        module.out_proj.weight.copy_(layer.output.weight)
        if layer.bias:
            module.in_proj_bias.copy_(torch.cat([p.bias for p in projections]))
            module.out_proj.bias.copy_(layer.output.bias)
    module.train(layer.training)
    return module
