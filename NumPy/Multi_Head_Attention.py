"""Multi-head attention: the float64 NumPy reference, with an explicit backward.

This file is the oracle the PyTorch and TensorFlow layers are judged by. It follows the
contract in docs/SPEC.md step by step, one operation per line, so a student can check it by hand.

Legend (every shape comment in this file uses these letters):
    B: batch size          T: query length        S: key/value length
    E: d_model             N: num_heads           K: num_kv_heads
    H: head_dim

The math, for query head n (which reads key/value head n // (N // K)):
    q = query @ query_kernel + query_bias                       (B, T, N*H)
    k = key @ key_kernel + key_bias                             (B, S, K*H)
    v = value @ value_kernel + value_bias                       (B, S, K*H)
    scores[n] = q[n] @ k[n // G]^T / sqrt(H) + float_mask       (B, N, T, S), G = N // K
    weights = softmax(scores where kept, else lowest finite)    zeroed where not kept
    context[n] = weights[n] @ v[n // G]                         (B, N, T, H)
    output = concat_heads(context) @ output_kernel + output_bias

Masks: a boolean `attention_mask` is True where a query may attend a key; a floating one is
added to the scores (-inf removes a key). `causal=True` keeps key s for query t iff
s <= t + (S - T). A query row with no key left gets weights of exactly 0, so its output is
`output_bias`. Example, a key padding mask for keys [a, b, <pad>]:
    keep = np.array([[True, True, False]])           # (B, S)
    layer(x, attention_mask=keep[:, None, :])         # (B, 1, S) broadcasts to (B, N, T, S)

Decoding with a KV cache (L: the cache's max length): `cache = layer.init_cache(B, L)`, then
`output, cache = layer(x, cache=cache)` for a prompt (T > 1) and then one token at a time
(T = 1). The keys and values of the T new tokens are written to slots [index, index + T), and
query t attends slot s iff s < index + T, keep[b, s], (not causal or s <= index + t) and
`attention_mask` (given over L) keeps it. Token-by-token equals the full causal pass. The
reference copies the cache: the one passed in is left unchanged.

The reference has no dropout: `dropout` must be 0.
"""

import math
from typing import NamedTuple

import numpy as np

__all__ = ["KVCache", "MultiHeadAttention", "dot_product_attention"]


class KVCache(NamedTuple):
    """The keys and values of the tokens decoded so far (make one with `init_cache`).

    Attributes:
        key: (B, K, L, H) projected keys, one slot per position; L is the cache's max length.
        value: (B, K, L, H) projected values.
        keep: (B, L) boolean; False marks a slot no query may attend (left padding).
        index: scalar integer; slots [0, index) are written, the next call writes from index.
    """

    key: np.ndarray
    value: np.ndarray
    keep: np.ndarray
    index: np.ndarray


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


def _check_input(name, x, width_name, width):
    """Checks one (B, L, width) input and returns it as a float64 array."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"`{name}` must be a floating tensor. Received: {name}.dtype={x.dtype.name}")
    letter = "T" if name == "query" else "S"
    if x.ndim != 3 or x.shape[-1] != width:
        raise ValueError(
            f"`{name}` must have shape (B, {letter}, {width_name}) with {width_name}={width}. "
            f"Received: {name}.shape={tuple(x.shape)}"
        )
    return x.astype(np.float64)


def _apply_defaults(query, key, value):
    """Fills in a missing key or value; returns (key, value, which input was left out)."""
    if key is None and value is None:
        return query, query, "both"  # self-attention
    if key is None:
        return value, value, "key"
    if value is None:
        return key, key, "value"
    return key, value, None


def _check_lengths(query, key, value):
    if not query.shape[0] == key.shape[0] == value.shape[0]:
        raise ValueError(
            "`query`, `key` and `value` must have the same batch size B. Received: "
            f"query.shape={query.shape}, key.shape={key.shape}, value.shape={value.shape}"
        )
    if key.shape[1] != value.shape[1]:
        raise ValueError(
            f"`key` and `value` must have the same length S. Received: key.shape={key.shape}, value.shape={value.shape}"
        )


def _check_cache(cache, query, key, heads, head_dim):
    """Checks a KVCache against the call's (B, T, E) query and (B, S, kdim) key."""
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
    if k.ndim != 4 or k.shape != v.shape or (k.shape[0], k.shape[1], k.shape[3]) != (b, heads, head_dim):
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
    if cache.key.dtype != dtype or cache.value.dtype != dtype:
        raise ValueError(
            f"`cache` must hold the layer's compute dtype {np.dtype(dtype).name}. "
            f"Received: cache.key.dtype={cache.key.dtype.name}, cache.value.dtype={cache.value.dtype.name}"
        )


def _cache_full_error(index, t, length):
    return ValueError(
        f"`cache` is full: index + T must be <= L (call `init_cache` with a larger `max_length`). "
        f"Received: index={index}, T={t}, L={length}"
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


def _cache_keep(keep, index, t, causal):
    """(B, L) cache keep -> (B, 1, T, L): slot s is written, not padding and, when causal, at most
    the query's own position index + t."""
    slots = np.arange(keep.shape[-1])[None, :]  # (1, L)
    positions = index + np.arange(t)[:, None]  # (T, 1), the position of each query
    allowed = slots <= positions if causal else slots < index + t  # (T, L)
    return allowed[None, None] & keep[:, None, None, :]  # (B, 1, T, L)


def _write_cache(cache, k, v):
    """Copies the cache with (B, K, T, H) keys and values written to slots [index, index + T)."""
    index, t, length = int(cache.index), k.shape[2], cache.key.shape[2]
    if index + t > length:
        raise _cache_full_error(index, t, length)
    key, value = cache.key.copy(), cache.value.copy()
    key[:, :, index : index + t] = k  # (B, K, L, H)
    value[:, :, index : index + t] = v  # (B, K, L, H)
    return KVCache(key, value, cache.keep.copy(), np.asarray(index + t))


def _and(a, b):
    return b if a is None else a if b is None else a & b


def _results(output, weights, cache, return_attention):
    """output, (output, weights), (output, cache) or (output, weights, cache)."""
    results = (output, weights) if return_attention else (output,)
    results = results if cache is None else (*results, cache)
    return results[0] if len(results) == 1 else results


def _mask_to_4d(mask, target):
    """Checks `attention_mask` against target (B, N, T, S) and returns it as rank 4."""
    mask = np.asarray(mask)
    if mask.dtype != np.bool_ and not np.issubdtype(mask.dtype, np.floating):
        raise ValueError(
            f"`attention_mask` must be boolean or floating. Received: attention_mask.dtype={mask.dtype.name}"
        )
    expected = {2: target[2:], 3: (target[0], *target[2:]), 4: target}.get(mask.ndim)
    if expected is None or any(m not in (1, e) for m, e in zip(mask.shape, expected, strict=True)):
        raise ValueError(
            "`attention_mask` must broadcast to (B, N, T, S) as (T, S), (B, T, S) or "
            f"(B, N, T, S), each dimension full or 1. Expected: (B, N, T, S)={target}. "
            f"Received: attention_mask.shape={tuple(mask.shape)}"
        )
    if mask.ndim == 2:
        return mask[None, None]  # (T, S) -> (1, 1, T, S)
    if mask.ndim == 3:
        return mask[:, None]  # (B, T, S) -> (B, 1, T, S)
    return mask


def causal_mask(t, s):
    """(T, S) boolean mask: query t keeps key s iff s <= t + (S - T) (bottom-right aligned)."""
    return np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t)  # (T, S)


def _split_mask(attention_mask, target):
    """Splits `attention_mask` into (keep, bias): boolean and additive, both rank 4 or None."""
    if attention_mask is None:
        return None, None
    mask = _mask_to_4d(attention_mask, target)
    if mask.dtype == np.bool_:
        return mask, None
    lowest = np.finfo(mask.dtype).min
    removed = mask <= lowest  # -inf (or the lowest finite value, which converters put for it) removes a key
    return ~removed, np.where(removed, 0.0, np.maximum(mask, lowest).astype(np.float64))  # finite, never 0 * -inf


def dot_product_attention(q, k, v, keep=None, bias=None, causal=False):
    """Pure attention on split heads; returns (context, weights, probs, keep).

    Args:
        q: (B, N, T, H) queries.
        k: (B, K, S, H) keys, K dividing N.
        v: (B, K, S, H) values.
        keep: None or boolean, broadcasts to (B, N, T, S); True where a query may attend a key.
        bias: None or float, broadcasts to (B, N, T, S); added to the scaled scores.
        causal: if True, query t keeps key s only if s <= t + (S - T).

    Returns:
        context (B, N, T, H), weights (B, N, T, S) with exact zeros where not kept, and the
        softmax before zeroing and the keep mask used (both needed by the backward).
    """
    t, s = q.shape[2], k.shape[2]
    keep = np.ones((1, 1, t, s), dtype=bool) if keep is None else keep  # (B, N, T, S), dims may be 1
    keep = keep & causal_mask(t, s) if causal else keep
    groups = q.shape[1] // k.shape[1]
    k = np.repeat(k, groups, axis=1)  # (B, K, S, H) -> (B, N, S, H)
    v = np.repeat(v, groups, axis=1)  # (B, K, S, H) -> (B, N, S, H)
    scores = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])  # (B, N, T, S)
    scores = scores if bias is None else scores + bias  # (B, N, T, S)
    lowest = np.finfo(scores.dtype).min
    scores = np.where(keep, scores, lowest)  # (B, N, T, S)
    shifted = scores - scores.max(axis=-1, keepdims=True, initial=lowest)  # (B, N, T, S); `initial`: S may be 0
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=-1, keepdims=True)  # (B, N, T, S)
    weights = np.where(keep, probs, 0.0)  # (B, N, T, S), rows with no key are all 0
    context = weights @ v  # (B, N, T, S) @ (B, N, S, H) -> (B, N, T, H)
    return context, weights, probs, keep


def _glorot_uniform(rng, fan_in, fan_out):
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=(fan_in, fan_out))


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
        bias: whether the four projections have biases.
        seed: seed for the Glorot uniform initialisation of the kernels (biases start at 0).

    Call arguments:
        query: (B, T, E).
        key: (B, S, kdim). Defaults to `value`, or to `query` if `value` is None too.
        value: (B, S, vdim). Defaults to `key`.
        attention_mask: boolean (True = attend) or floating (added to the scores), of shape
            (T, S), (B, T, S) or (B, N, T, S), any dimension of which may be 1.
        causal: if True, query t attends key s only if s <= t + (S - T).
        return_attention: if True, also return the per-head attention weights.
        cache: a `KVCache` from `init_cache`: decode T new tokens (`key` and `value`, if
            given, hold the same T tokens); masks and weights are then over the L slots.

    Returns:
        output (B, T, E), or (output, weights) with weights (B, N, T, S) when
        `return_attention` is True; with `cache`, the updated cache is appended and weights
        are (B, N, T, L), exactly 0 at unwritten slots.

    Example, a key padding mask (the third key of the first sequence is padding):
        >>> layer = MultiHeadAttention(16, 4, seed=0)
        >>> x = np.random.default_rng(0).normal(size=(2, 3, 16))  # (B, T, E)
        >>> keep = np.array([[True, True, False], [True, True, True]])  # (B, S)
        >>> out, weights = layer(x, attention_mask=keep[:, None, :], return_attention=True)
        >>> out.shape, weights.shape
        ((2, 3, 16), (2, 4, 3, 3))
        >>> bool((weights[0, :, :, 2] == 0).all())
        True
    """

    def __init__(
        self,
        d_model,
        num_heads,
        *,
        num_kv_heads=None,
        head_dim=None,
        kdim=None,
        vdim=None,
        dropout=0.0,
        bias=True,
        seed=None,
    ):
        self.d_model = _positive_int("d_model", d_model)
        self.num_heads = _positive_int("num_heads", num_heads)
        self.num_kv_heads = _positive_int("num_kv_heads", num_heads if num_kv_heads is None else num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"`num_kv_heads` must divide `num_heads`. Received: num_heads={num_heads}, num_kv_heads={num_kv_heads}"
            )
        if head_dim is None and self.d_model % self.num_heads:
            raise ValueError(f"`num_heads` must divide `d_model`. Received: d_model={d_model}, num_heads={num_heads}")
        self.head_dim = _positive_int("head_dim", self.d_model // self.num_heads if head_dim is None else head_dim)
        self.kdim = _positive_int("kdim", self.d_model if kdim is None else kdim)
        self.vdim = _positive_int("vdim", self.d_model if vdim is None else vdim)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1). Received: dropout={dropout!r}")
        if dropout != 0.0:
            raise ValueError(f"`dropout` must be 0: the NumPy reference has no dropout. Received: dropout={dropout!r}")
        self.dropout = 0.0
        self.bias = bool(bias)
        rng = np.random.default_rng(seed)
        self.params = {}
        for name, shape in self.weight_shapes().items():
            is_kernel = name.endswith("_kernel")
            self.params[name] = _glorot_uniform(rng, *shape) if is_kernel else np.zeros(shape)
        self._saved = None

    def init_cache(self, batch_size, max_length, *, keep=None, dtype=None):
        """An empty `KVCache` for decoding `batch_size` sequences of up to `max_length` tokens.

        Args:
            batch_size: B.
            max_length: L, the number of slots.
            keep: (B, L) boolean, False for slots no query may attend (left padding of prompts
                of different lengths). Defaults to all True.
            dtype: dtype of the keys and values; defaults to the compute dtype, float64.

        Returns:
            A `KVCache` of zeros with index 0.
        """
        b, length = _positive_int("batch_size", batch_size), _positive_int("max_length", max_length)
        keep = np.ones((b, length), dtype=bool) if keep is None else _check_keep(keep, b, length)
        shape = (b, self.num_kv_heads, length, self.head_dim)
        dtype = np.float64 if dtype is None else dtype
        return KVCache(np.zeros(shape, dtype), np.zeros(shape, dtype), keep.copy(), np.asarray(0))

    def weight_shapes(self):
        """The portable layout: {name: shape}, biases left out when `bias` is False."""
        nh, kh = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {
            "query_kernel": (self.d_model, nh),
            "query_bias": (nh,),
            "key_kernel": (self.kdim, kh),
            "key_bias": (kh,),
            "value_kernel": (self.vdim, kh),
            "value_bias": (kh,),
            "output_kernel": (nh, self.d_model),
            "output_bias": (self.d_model,),
        }
        return {k: v for k, v in shapes.items() if self.bias or k.endswith("_kernel")}

    def export_weights(self):
        """Returns the portable weights: a dict of float64 arrays (see docs/SPEC.md)."""
        return {name: value.copy() for name, value in self.params.items()}

    def import_weights(self, weights):
        """Loads portable weights; strict and atomic (a ValueError lists every problem)."""
        expected = self.weight_shapes()
        problems = [f"missing '{name}'" for name in expected if name not in weights]
        problems += [f"unexpected '{name}'" for name in weights if name not in expected]
        for name, shape in expected.items():
            if name in weights and tuple(np.shape(weights[name])) != shape:
                problems.append(f"'{name}' has shape {tuple(np.shape(weights[name]))}, expected {shape}")
        if problems:
            raise ValueError(f"`weights` do not match this layer's portable layout: {'; '.join(problems)}")
        self.params = {name: np.array(weights[name], dtype=np.float64) for name in expected}

    def _project(self, x, kind, heads):
        """(B, L, D) -> (B, heads, L, H): one projection split into heads."""
        y = x @ self.params[f"{kind}_kernel"]  # (B, L, D) -> (B, L, heads*H)
        if self.bias:
            y = y + self.params[f"{kind}_bias"]
        b, length, _ = y.shape
        return y.reshape(b, length, heads, self.head_dim).transpose(0, 2, 1, 3)  # -> (B, heads, L, H)

    def __call__(
        self, query, key=None, value=None, attention_mask=None, *, causal=False, return_attention=False, cache=None
    ):
        key, value, defaulted = _apply_defaults(query, key, value)
        query = _check_input("query", query, "E", self.d_model)
        key = _check_input("key", key, "kdim", self.kdim)
        value = _check_input("value", value, "vdim", self.vdim)
        _check_lengths(query, key, value)
        if cache is not None:
            _check_cache(cache, query, key, self.num_kv_heads, self.head_dim)
            _check_cache_dtype(cache, np.float64)
        (b, t, _), s = query.shape, key.shape[1] if cache is None else cache.key.shape[2]
        keep, bias = _split_mask(attention_mask, (b, self.num_heads, t, s))

        q = self._project(query, "query", self.num_heads)  # (B, T, E) -> (B, N, T, H)
        k = self._project(key, "key", self.num_kv_heads)  # (B, S, kdim) -> (B, K, S, H)
        v = self._project(value, "value", self.num_kv_heads)  # (B, S, vdim) -> (B, K, S, H)
        if cache is not None:
            keep = _and(keep, _cache_keep(cache.keep, int(cache.index), t, causal))  # (B, N, T, L), dims may be 1
            cache = _write_cache(cache, k, v)
            k, v, causal = cache.key, cache.value, False  # (B, K, L, H); causality is in `keep`
        context, weights, probs, keep = dot_product_attention(q, k, v, keep, bias, causal)  # (B, N, T, H)
        merged = context.transpose(0, 2, 1, 3).reshape(b, t, self.num_heads * self.head_dim)  # -> (B, T, N*H)
        output = merged @ self.params["output_kernel"]  # (B, T, N*H) -> (B, T, E)
        if self.bias:
            output = output + self.params["output_bias"]

        self._saved = None if cache is not None else dict(
            query=query, key=key, value=value, defaulted=defaulted, q=q, k=k, v=v,
            keep=keep, probs=probs, weights=weights, merged=merged,
        )  # fmt: skip
        return _results(output, weights, cache, return_attention)

    def backward(self, grad_output):
        """Gradients of sum(output * grad_output) after the last call.

        Args:
            grad_output: (B, T, E), the upstream gradient of the output.

        Returns:
            A dict with `query`, `key`, `value` (only for the inputs that were passed; the
            gradient of a defaulted input is added to the one it defaulted to) and every name
            of the portable weight layout.
        """
        if self._saved is None:
            raise ValueError("`backward` needs a forward call without `cache` first. Received: no such call")
        c, p = self._saved, self.params
        g = np.asarray(grad_output, dtype=np.float64)  # (B, T, E)
        if g.shape != (*c["merged"].shape[:2], self.d_model):
            raise ValueError(
                f"`grad_output` must have the output's shape {(*c['merged'].shape[:2], self.d_model)}. "
                f"Received: grad_output.shape={g.shape}"
            )
        b, t, _ = g.shape
        n, kv, h = self.num_heads, self.num_kv_heads, self.head_dim
        grads = {"output_kernel": np.einsum("btm,bte->me", c["merged"], g), "output_bias": g.sum(axis=(0, 1))}
        d_context = (g @ p["output_kernel"].T).reshape(b, t, n, h).transpose(0, 2, 1, 3)  # -> (B, N, T, H)

        groups = n // kv
        k_rep = np.repeat(c["k"], groups, axis=1)  # (B, K, S, H) -> (B, N, S, H)
        v_rep = np.repeat(c["v"], groups, axis=1)  # (B, K, S, H) -> (B, N, S, H)
        d_weights = d_context @ v_rep.swapaxes(-1, -2)  # (B, N, T, H) @ (B, N, H, S) -> (B, N, T, S)
        d_v_rep = c["weights"].swapaxes(-1, -2) @ d_context  # (B, N, S, T) @ (B, N, T, H) -> (B, N, S, H)
        d_probs = np.where(c["keep"], d_weights, 0.0)  # (B, N, T, S)
        probs = c["probs"]
        d_scores = probs * (d_probs - (d_probs * probs).sum(axis=-1, keepdims=True))  # softmax backward
        d_scores = np.where(c["keep"], d_scores, 0.0) / math.sqrt(h)  # (B, N, T, S)
        d_q = d_scores @ k_rep  # (B, N, T, S) @ (B, N, S, H) -> (B, N, T, H)
        d_k_rep = d_scores.swapaxes(-1, -2) @ c["q"]  # (B, N, S, T) @ (B, N, T, H) -> (B, N, S, H)
        s = d_k_rep.shape[2]
        d_k = d_k_rep.reshape(b, kv, groups, s, h).sum(axis=2)  # (B, N, S, H) -> (B, K, S, H)
        d_v = d_v_rep.reshape(b, kv, groups, s, h).sum(axis=2)  # (B, N, S, H) -> (B, K, S, H)

        inputs = {}
        for kind, d_heads in (("query", d_q), ("key", d_k), ("value", d_v)):
            length, width = d_heads.shape[2], d_heads.shape[1] * h
            d_y = d_heads.transpose(0, 2, 1, 3).reshape(b, length, width)  # (B, heads, L, H) -> (B, L, heads*H)
            grads[f"{kind}_kernel"] = np.einsum("bld,blm->dm", c[kind], d_y)
            grads[f"{kind}_bias"] = d_y.sum(axis=(0, 1))
            inputs[kind] = d_y @ p[f"{kind}_kernel"].T  # (B, L, heads*H) -> (B, L, D)
        grads = {name: grads[name] for name in self.weight_shapes()}
        return {**_fold_defaulted(inputs, c["defaulted"]), **grads}


def _fold_defaulted(inputs, defaulted):
    """Adds the gradient of each defaulted input to the input it defaulted to."""
    if defaulted == "both":
        return {"query": inputs["query"] + inputs["key"] + inputs["value"]}
    if defaulted == "key":
        return {"query": inputs["query"], "value": inputs["value"] + inputs["key"]}
    if defaulted == "value":
        return {"query": inputs["query"], "key": inputs["key"] + inputs["value"]}
    return inputs
