"""Multi-head attention for TensorFlow: one Keras 3 layer, proven equal to the PyTorch layer.

Copy this one file into your model; it needs only TensorFlow, NumPy and the standard library.

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
s <= t + (S - T), and is combined with every other mask (never silently dropped). Keras
implicit masks (`Embedding(mask_zero=True)`) are honoured: the query's mask removes query rows,
the key's and value's masks remove keys, and the output carries the query's mask. A query row
with no key left gets weights of exactly 0, so its output is `output_bias`: never NaN.
Example, a key padding mask for keys [a, b, <pad>]:
    keep = tf.constant([[True, True, False]])        # (B, S)
    layer(x, attention_mask=keep[:, None, :])         # (B, 1, S) broadcasts to (B, N, T, S)

Decoding with a KV cache (L: the cache's max length): `cache = layer.init_cache(B, L)`, then
`output, cache = layer(x, cache=cache)` for a prompt (T > 1) and then one token at a time
(T = 1). The keys and values of the T new tokens are written to slots [index, index + T), and
query t attends slot s iff s < index + T, keep[b, s], (not causal or s <= index + t) and
`attention_mask` (given over L) keeps it. Token-by-token equals the full causal pass. This
layer is functional: it returns a new cache (a nest of tensors, so it can be a `tf.while_loop`
variable), and the keys' implicit Keras mask is ANDed into the new cache's `keep`.

Weights: `query_kernel` (E, N*H), `query_bias` (N*H,), `key_kernel` (kdim, K*H), ...,
`output_kernel` (N*H, E), `output_bias` (E,): the portable layout itself, created in `build`.
"""

import math
from typing import NamedTuple

import numpy as np
import tensorflow as tf

__all__ = ["KVCache", "MultiHeadAttention", "dot_product_attention"]

_GROUP_QUERY_ATTENTION = getattr(tf.keras.layers, "GroupQueryAttention", None)  # None in legacy Keras (tf_keras)
_BUILT_IN_GQA = () if _GROUP_QUERY_ATTENTION is None else (_GROUP_QUERY_ATTENTION,)


class KVCache(NamedTuple):
    """The keys and values of the tokens decoded so far (make one with `init_cache`).

    Attributes:
        key: (B, K, L, H) projected keys, one slot per position; L is the cache's max length.
        value: (B, K, L, H) projected values.
        keep: (B, L) boolean; False marks a slot no query may attend (left padding).
        index: scalar integer; slots [0, index) are written, the next call writes from index.
    """

    key: tf.Tensor
    value: tf.Tensor
    keep: tf.Tensor
    index: tf.Tensor


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


def _static_shape(x):
    return tuple(x.shape) if x.shape.rank is not None else None


def _check_input(name, x, width_name, width):
    """Checks one (B, L, width) input; dimensions unknown at trace time are not checked."""
    x = tf.convert_to_tensor(x)
    if not x.dtype.is_floating:
        raise ValueError(f"`{name}` must be a floating tensor. Received: {name}.dtype={x.dtype.name}")
    letter = "T" if name == "query" else "S"
    shape = _static_shape(x)
    if shape is not None and (len(shape) != 3 or shape[-1] not in (None, width)):
        raise ValueError(
            f"`{name}` must have shape (B, {letter}, {width_name}) with {width_name}={width}. "
            f"Received: {name}.shape={shape}"
        )
    return x


def _differ(*dims):
    known = {d for d in dims if d is not None}
    return len(known) > 1


def _check_lengths(query, key, value):
    q, k, v = (tuple(x.shape) for x in (query, key, value))
    if _differ(q[0], k[0], v[0]):
        raise ValueError(
            "`query`, `key` and `value` must have the same batch size B. Received: "
            f"query.shape={q}, key.shape={k}, value.shape={v}"
        )
    if _differ(k[1], v[1]):
        raise ValueError(f"`key` and `value` must have the same length S. Received: key.shape={k}, value.shape={v}")


def _check_cache(cache, query, key, heads, head_dim):
    """Checks a KVCache against the call's (B, T, E) query and (B, S, kdim) key; dimensions
    unknown at trace time are not checked."""
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
    if (
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
    if cache.key.dtype != dtype or cache.value.dtype != dtype:
        raise ValueError(
            f"`cache` must hold the layer's compute dtype {tf.as_dtype(dtype).name}. "
            f"Received: cache.key.dtype={cache.key.dtype.name}, cache.value.dtype={cache.value.dtype.name}"
        )


def _cache_full_error(index, t, length):
    return ValueError(
        f"`cache` is full: index + T must be <= L (call `init_cache` with a larger `max_length`). "
        f"Received: index={index}, T={t}, L={length}"
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


def _cache_keep(keep, index, t, causal):
    """(B, L) cache keep -> (B, 1, T, L): slot s is written, not padding and, when causal, at most
    the query's own position index + t."""
    slots = tf.range(tf.shape(keep)[-1])[None, :]  # (1, L)
    positions = index + tf.range(t)[:, None]  # (T, 1), the position of each query
    allowed = slots <= positions if causal else slots < index + t  # (T, L)
    return allowed[None, None] & keep[:, None, None, :]  # (B, 1, T, L)


def _check_room(cache, t):
    """Whether the T new tokens overflow the cache (index + T > L), as a boolean tensor. Eagerly
    an overflow is a ValueError; in a graph an InvalidArgumentError (XLA ignores it, and the
    caller sets that call's output to NaN)."""
    length = tf.shape(cache.key)[2]
    if tf.executing_eagerly() and int(cache.index) + int(t) > int(length):
        raise _cache_full_error(int(cache.index), int(t), int(length))
    if not tf.executing_eagerly():
        tf.debugging.assert_less_equal(
            cache.index + t, length, message="`cache` is full: index + T must be <= L (index + T, L follow)"
        )
    return cache.index + t > length


def _write_cache(cache, k, v, key_keep):
    """A new cache with (B, K, T, H) keys and values written to slots [index, index + T) and the
    (B, T) `key_keep` ANDed into `keep` there."""
    shape = tf.shape(k)
    positions = cache.index + tf.range(shape[2])  # (T,)
    grid = tf.meshgrid(tf.range(shape[0]), tf.range(shape[1]), positions, indexing="ij")
    slots = tf.stack(grid, axis=-1)  # (B, K, T, 3): (b, head, slot) of every written vector
    key = tf.tensor_scatter_nd_update(cache.key, slots, k)  # (B, K, L, H)
    value = tf.tensor_scatter_nd_update(cache.value, slots, v)  # (B, K, L, H)
    keep = cache.keep
    if key_keep is not None:
        written = tf.stack(tf.meshgrid(tf.range(shape[0]), positions, indexing="ij"), axis=-1)  # (B, T, 2)
        keep = tf.tensor_scatter_nd_update(keep, written, tf.gather(keep, positions, axis=1) & key_keep)  # (B, L)
    return KVCache(key, value, keep, cache.index + shape[2])


def _results(output, weights, cache, return_attention):
    """output, (output, weights), (output, cache) or (output, weights, cache)."""
    results = (output, weights) if return_attention else (output,)
    results = results if cache is None else (*results, cache)
    return results[0] if len(results) == 1 else results


def _mask_to_4d(mask, target):
    """Checks `attention_mask` against target (B, N, T, S) and returns it as rank 4."""
    if mask.dtype != tf.bool and not mask.dtype.is_floating:
        raise ValueError(
            f"`attention_mask` must be boolean or floating. Received: attention_mask.dtype={mask.dtype.name}"
        )
    rank = mask.shape.rank
    expected = {2: target[2:], 3: (target[0], *target[2:]), 4: target}.get(rank)
    if expected is None or any(
        m not in (1, e) and None not in (m, e) for m, e in zip(mask.shape, expected, strict=True)
    ):
        raise ValueError(
            "`attention_mask` must broadcast to (B, N, T, S) as (T, S), (B, T, S) or "
            f"(B, N, T, S), each dimension full or 1. Expected: (B, N, T, S)={target}. "
            f"Received: attention_mask.shape={_static_shape(mask)}"
        )
    if rank == 2:
        return mask[None, None]  # (T, S) -> (1, 1, T, S)
    if rank == 3:
        return mask[:, None]  # (B, T, S) -> (B, 1, T, S)
    return mask


def causal_mask(t, s):
    """(T, S) boolean mask: query t keeps key s iff s <= t + (S - T) (bottom-right aligned)."""
    rows = tf.range(t)[:, None]  # (T, 1)
    return tf.range(s)[None, :] <= rows + (s - t)  # (T, S)


def _split_mask(attention_mask, target):
    """Splits `attention_mask` into (keep, bias): boolean and additive, both rank 4 or None."""
    if attention_mask is None:
        return None, None
    mask = _mask_to_4d(tf.convert_to_tensor(attention_mask), target)
    if mask.dtype == tf.bool:
        return mask, None
    lowest = mask.dtype.min
    removed = mask <= lowest  # -inf (or the lowest finite value, which converters put for it) removes a key
    return tf.logical_not(removed), tf.where(removed, tf.zeros_like(mask), tf.maximum(mask, lowest))  # finite


def _implicit_keep(query_mask, key_mask):
    """Keras masks: (B, T) query mask and (B, S) key mask -> (B, 1, T, S) keep, or None."""
    keep = None
    if query_mask is not None:
        keep = tf.cast(query_mask, tf.bool)[:, None, :, None]  # (B, T) -> (B, 1, T, 1)
    if key_mask is not None:
        keys = tf.cast(key_mask, tf.bool)[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
        keep = keys if keep is None else keep & keys  # (B, 1, T, S)
    return keep


def _and(a, b):
    return b if a is None else a if b is None else a & b


def _linear(x, kernel, bias):
    """(B, L, D) @ (D, F) + (F,) -> (B, L, F) as a 2-D matmul and a bias add, which oneDNN fuses.
    The weights are read in x's dtype (a no-op inside Keras' `__call__`, which autocasts them)."""
    y = tf.matmul(tf.reshape(x, [-1, kernel.shape[0]]), tf.cast(kernel, x.dtype))  # (B, L, D) -> (B*L, F)
    y = y if bias is None else tf.nn.bias_add(y, tf.cast(bias, x.dtype))
    return tf.reshape(y, tf.concat([tf.shape(x)[:2], [kernel.shape[1]]], 0))  # (B*L, F) -> (B, L, F)


def _softmax_dtype(dtype):
    """Softmax runs in float32 at least (float64 stays float64)."""
    return tf.float64 if dtype == tf.float64 else tf.float32


def dot_product_attention(q, k, v, keep=None, bias=None, causal=False, *, dropout=None):
    """Pure attention on split heads; returns (context, weights).

    Args:
        q: (B, N, T, H) queries.
        k: (B, K, S, H) keys, K dividing N.
        v: (B, K, S, H) values.
        keep: None or boolean, broadcasts to (B, N, T, S); True where a query may attend a key.
        bias: None or float, broadcasts to (B, N, T, S); added to the scaled scores.
        causal: if True, query t keeps key s only if s <= t + (S - T).
        dropout: None, or a callable applied to the weights before the weighted sum.

    Returns:
        context (B, N, T, H) and weights (B, N, T, S), exactly 0 where not kept.
    """
    t, s = tf.shape(q)[2], tf.shape(k)[2]
    if causal:
        keep = _and(keep, causal_mask(t, s))  # (B, N, T, S), dims may be 1
    groups = q.shape[1] // k.shape[1]
    k = tf.repeat(k, groups, axis=1) if groups > 1 else k  # (B, K, S, H) -> (B, N, S, H)
    v = tf.repeat(v, groups, axis=1) if groups > 1 else v  # (B, K, S, H) -> (B, N, S, H)
    dtype = _softmax_dtype(q.dtype)
    q = q * tf.cast(1.0 / math.sqrt(q.shape[-1]), q.dtype)  # scale the (B, N, T, H) queries, not the scores
    scores = tf.cast(tf.matmul(q, k, transpose_b=True), dtype)  # (B, N, T, S)
    scores = scores if bias is None else scores + tf.cast(bias, dtype)  # (B, N, T, S)
    if keep is not None:
        scores = tf.where(keep, scores, dtype.min)  # (B, N, T, S)
    weights = tf.nn.softmax(scores, axis=-1)  # (B, N, T, S)
    if keep is not None:
        weights = tf.where(keep, weights, tf.zeros((), dtype))  # rows with no key are all 0
    weights = tf.cast(weights, q.dtype)  # (B, N, T, S)
    dropped = weights if dropout is None else dropout(weights)
    context = tf.matmul(dropped, v)  # (B, N, T, S) @ (B, N, S, H) -> (B, N, T, H)
    return context, weights


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


def _dropout_keep(shape, rate, seed, chunk):
    """The dropout mask of one chunk, the same every time it is drawn (forward and backward)."""
    if not rate:
        return None
    draws = tf.random.stateless_uniform(shape, seed=seed + tf.cast(tf.stack([0, chunk]), tf.int64))
    return tf.cast(draws >= rate, tf.float32) / (1.0 - rate)


def _memory_efficient_attention(q, k, v, keep, bias, causal, chunk, dropout_rate=0.0, seed=None):
    """`dot_product_attention` without the weights, `chunk` queries at a time, in memory linear
    in T and S: only one chunk's (B, N, chunk, S) scores exist at a time, forward and backward
    (a custom gradient recomputes them; the flash-attention backward). The floating mask gets no
    gradient. Dropout draws a stateless mask per chunk from `seed` (shape (2,)), so the backward
    drops the same weights as the forward.

    Args: as `dot_product_attention`; `chunk` is a Python int.

    Returns:
        context (B, N, T, H).
    """
    b, n, h = (q.shape[i] if q.shape[i] is not None else tf.shape(q)[i] for i in (0, 1, 3))  # static if known
    t, s, kv = tf.shape(q)[2], tf.shape(k)[2], k.shape[1]
    groups, dtype = q.shape[1] // kv, _softmax_dtype(q.dtype)
    chunks = (t + chunk - 1) // chunk
    padded = chunks * chunk - t
    q = q * tf.cast(1.0 / math.sqrt(q.shape[-1]), q.dtype)  # scale the (B, N, T, H) queries, not the scores
    q = tf.pad(q, [[0, 0], [0, 0], [0, padded], [0, 0]])  # (B, N, T', H), T' a multiple of chunk
    keep, bias = (_pad_rows(_full_rows(m, t), padded) for m in (keep, bias))
    seed = None if seed is None else tf.cast(seed, tf.int64)

    def grouped(x):
        return tf.reshape(x, [b, kv, groups * chunk, -1])  # (B, N, chunk, X) -> (B, K, G*chunk, X)

    def by_head(x):
        return tf.reshape(x, [b, n, chunk, -1])  # (B, K, G*chunk, X) -> (B, N, chunk, X)

    def chunk_weights(q, k, i):
        """Query rows [i*chunk, (i+1)*chunk): their (B, N, chunk, H) queries and float weights."""
        start = i * chunk
        q_i = _rows(q, start, chunk)  # (B, N, chunk, H)
        scores = tf.cast(by_head(tf.matmul(grouped(q_i), k, transpose_b=True)), dtype)  # (B, N, chunk, S)
        bias_i = _chunk_rows(bias, start, chunk)
        scores = scores if bias_i is None else scores + tf.cast(bias_i, dtype)
        keep_i = _chunk_rows(keep, start, chunk)
        if causal:
            rows = start + tf.range(chunk)[:, None]  # (chunk, 1)
            keep_i = _and(keep_i, tf.range(s)[None, :] <= rows + (s - t))  # (B, N, chunk, S), dims may be 1
        if keep_i is not None:
            scores = tf.where(keep_i, scores, dtype.min)
        weights = tf.nn.softmax(scores, axis=-1)  # (B, N, chunk, S)
        return q_i, weights if keep_i is None else tf.where(keep_i, weights, tf.zeros((), dtype))

    def dropped(weights, i):
        mask = _dropout_keep(tf.shape(weights), dropout_rate, seed, i)
        return (weights, None) if mask is None else (weights * mask, mask)

    @tf.custom_gradient
    def attend(q, k, v):
        def one(i):
            _, weights = chunk_weights(q, k, i)
            weights, _ = dropped(weights, i)
            return by_head(tf.matmul(grouped(tf.cast(weights, v.dtype)), v))  # (B, N, chunk, H)

        per_chunk = tf.TensorSpec((q.shape[0], q.shape[1], chunk, q.shape[3]), v.dtype)  # static: LiteRT needs it
        contexts = tf.map_fn(one, tf.range(chunks), fn_output_signature=per_chunk)
        context = tf.reshape(tf.transpose(contexts, [1, 2, 0, 3, 4]), [b, n, -1, h])  # -> (B, N, T', H)

        def grad(d_context):
            def accumulate(total, update):
                return total + tf.ensure_shape(tf.cast(update, tf.float32), total.shape)  # (B, K, S, H)

            def body(i, d_k, d_v, d_q):
                q_i, weights = chunk_weights(q, k, i)
                kept, mask = dropped(weights, i)
                d_out = grouped(_rows(d_context, i * chunk, chunk))  # (B, K, G*chunk, H)
                d_v = accumulate(d_v, tf.matmul(grouped(tf.cast(kept, v.dtype)), d_out, transpose_a=True))
                d_weights = tf.cast(by_head(tf.matmul(d_out, v, transpose_b=True)), dtype)  # (B, N, chunk, S)
                d_weights = d_weights if mask is None else d_weights * mask
                d_scores = weights * (d_weights - tf.reduce_sum(d_weights * weights, -1, keepdims=True))
                d_scores = grouped(tf.cast(d_scores, q.dtype))  # (B, K, G*chunk, S)
                d_k = accumulate(d_k, tf.matmul(d_scores, grouped(q_i), transpose_a=True))
                return i + 1, d_k, d_v, d_q.write(i, by_head(tf.matmul(d_scores, k)))

            zeros = tf.zeros(tf.shape(k), tf.float32)
            d_q = tf.TensorArray(q.dtype, size=chunks, element_shape=None, infer_shape=False)
            _, d_k, d_v, d_q = tf.while_loop(lambda i, *_: i < chunks, body, (0, zeros, zeros, d_q))
            d_q = tf.reshape(tf.transpose(d_q.stack(), [1, 2, 0, 3, 4]), tf.shape(q))  # (B, N, T', H)
            return d_q, tf.cast(d_k, k.dtype), tf.cast(d_v, v.dtype)

        return context, grad

    return attend(q, k, v)[:, :, :t]  # (B, N, T, H)


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
        bias: whether the four projections have biases.
        kernel_initializer: initializer of the four kernels.
        bias_initializer: initializer of the four biases.
        **kwargs: base layer arguments (`name`, `dtype` policy, ...).

    Call arguments:
        query: (B, T, E).
        key: (B, S, kdim). Defaults to `value`, or to `query` if `value` is None too.
        value: (B, S, vdim). Defaults to `key`.
        attention_mask: boolean (True = attend) or floating (added to the scores), of shape
            (T, S), (B, T, S) or (B, N, T, S), any dimension of which may be 1.
        causal: if True, query t attends key s only if s <= t + (S - T).
        return_attention: if True, also return the per-head attention weights.
        training: dropout acts only when True.
        query_mask, key_mask, value_mask: (B, T) / (B, S) Keras implicit masks; Keras fills
            them from the inputs' masks, so you rarely pass them yourself.
        cache: a `KVCache` from `init_cache`: decode T new tokens (`key` and `value`, if
            given, hold the same T tokens); masks and weights are then over the L slots.

    Returns:
        output (B, T, E), or (output, weights) with weights (B, N, T, S) (per head, before
        dropout) when `return_attention` is True; with `cache`, the updated cache is appended
        and weights are (B, N, T, L), exactly 0 at unwritten slots.

    Example, a key padding mask (the third key of the first sequence is padding):
        >>> layer = MultiHeadAttention(16, 4)
        >>> x = tf.random.normal((2, 3, 16))  # (B, T, E)
        >>> keep = tf.constant([[True, True, False], [True, True, True]])  # (B, S)
        >>> out, weights = layer(x, attention_mask=keep[:, None, :], return_attention=True)
        >>> tuple(out.shape), tuple(weights.shape)
        ((2, 3, 16), (2, 4, 3, 3))
        >>> bool(tf.reduce_all(weights[0, :, :, 2] == 0))
        True
    """

    # Without `return_attention`, (B, N, T, S) score elements above which attention runs a chunk
    # of queries at a time (memory linear in T and S; 64 Mi float32 scores are 256 MiB), and the
    # score elements of one chunk (8 MiB in float32, the fastest on the benchmark machine).
    memory_efficient_threshold = 1 << 26
    query_chunk_elements = 1 << 21

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
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
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
        self.dropout = float(dropout)
        self.bias = bool(bias)
        self.kernel_initializer = tf.keras.initializers.get(kernel_initializer)
        self.bias_initializer = tf.keras.initializers.get(bias_initializer)
        self.supports_masking = True
        self._dropout_layer = tf.keras.layers.Dropout(self.dropout, dtype=self.dtype_policy)

    def get_config(self):
        return {
            **super().get_config(),
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "kdim": self.kdim,
            "vdim": self.vdim,
            "dropout": self.dropout,
            "bias": self.bias,
            "kernel_initializer": tf.keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": tf.keras.initializers.serialize(self.bias_initializer),
        }

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

    def init_cache(self, batch_size, max_length, *, keep=None, dtype=None):
        """An empty `KVCache` for decoding `batch_size` sequences of up to `max_length` tokens.

        Args:
            batch_size: B.
            max_length: L, the number of slots.
            keep: (B, L) boolean, False for slots no query may attend (left padding of prompts
                of different lengths). Defaults to all True.
            dtype: dtype of the keys and values; defaults to the compute dtype of the policy.

        Returns:
            A `KVCache` of zeros with index 0 (int32).
        """
        b, length = _positive_int("batch_size", batch_size), _positive_int("max_length", max_length)
        keep = tf.ones((b, length), dtype=tf.bool) if keep is None else _check_keep(keep, b, length)
        shape = (b, self.num_kv_heads, length, self.head_dim)
        dtype = self.compute_dtype if dtype is None else dtype
        return KVCache(tf.zeros(shape, dtype), tf.zeros(shape, dtype), keep, tf.constant(0, tf.int32))

    def build(self, query_shape=None, value_shape=None, key_shape=None):
        """Creates the portable weights; every shape is known from the constructor.

        Args:
            query_shape: optional (B, T, E) (the only shape legacy Keras passes, by position).
            value_shape: optional (B, S, vdim).
            key_shape: optional (B, S, kdim). Keras' attention-layer convention, in its order
                (query, value, key); a missing shape defaults as in the call, and a width other
                than the constructor's is a ValueError.
        """
        self._check_shapes(query_shape, value_shape, key_shape)
        for name, shape in self.weight_shapes().items():
            initializer = self.kernel_initializer if name.endswith("_kernel") else self.bias_initializer
            initializer = initializer.__class__.from_config(initializer.get_config())  # legacy Keras repeats
            setattr(self, name, self.add_weight(name=name, shape=shape, initializer=initializer))  # an instance
        self._dropout_layer.build(None)
        self.built = True

    def export_weights(self):
        """Returns the portable weights: a dict of NumPy arrays (see docs/SPEC.md)."""
        if not self.built:
            self.build()
        return {name: getattr(self, name).numpy().copy() for name in self.weight_shapes()}

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
        if not self.built:
            self.build()
        for name in expected:
            variable = getattr(self, name)
            variable.assign(np.asarray(weights[name]).astype(tf.as_dtype(variable.dtype).as_numpy_dtype))

    def _project(self, x, kind, heads):
        """(B, L, D) -> (B, heads, L, H): one projection split into heads."""
        bias = getattr(self, f"{kind}_bias") if self.bias else None
        y = _linear(x, getattr(self, f"{kind}_kernel"), bias)  # (B, L, D) -> (B, L, heads*H)
        return self._split_heads(y, heads)

    def _split_heads(self, y, heads):
        b, length = tf.shape(y)[0], tf.shape(y)[1]
        y = tf.reshape(y, [b, length, heads, self.head_dim])  # (B, L, heads*H) -> (B, L, heads, H)
        return tf.transpose(y, [0, 2, 1, 3])  # -> (B, heads, L, H)

    def _project_fused(self, x):
        """Self-attention: q, k and v from one matmul over the concatenated projections."""
        kinds = ("query", "key", "value")
        kernel = tf.concat([getattr(self, f"{kind}_kernel") for kind in kinds], axis=1)  # (E, N*H + 2*K*H)
        bias = tf.concat([getattr(self, f"{kind}_bias") for kind in kinds], axis=0) if self.bias else None
        y = _linear(x, kernel, bias)  # (B, T, E) -> (B, T, N*H + 2*K*H)
        nh, kh = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = tf.split(y, [nh, kh, kh], axis=-1)  # -> 3 x (B, T, heads*H)
        return (
            self._split_heads(q, self.num_heads),  # (B, N, T, H)
            self._split_heads(k, self.num_kv_heads),  # (B, K, T, H)
            self._split_heads(v, self.num_kv_heads),  # (B, K, T, H)
        )

    def _query_chunk(self, q, k):
        """Queries per chunk of the memory-efficient path, or None where the (B, N, T, S) scores
        are known at trace time to be at most `memory_efficient_threshold` elements."""
        b, n, t, s = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        if None not in (b, t, s) and b * n * t * s <= self.memory_efficient_threshold:
            return None
        chunk = max(1, self.query_chunk_elements // (n * (b or 1) * (s or 4096)))  # S unknown: sized for 4096
        return chunk if t is None else min(chunk, t)

    def _dropout_seed(self):
        """A (2,) seed for the memory-efficient path's stateless dropout: from the Keras dropout
        layer's seed generator (so `keras.utils.set_random_seed` applies), or drawn from the
        global TensorFlow seed under legacy Keras, which has no seed generator."""
        generator = getattr(self._dropout_layer, "seed_generator", None)
        if generator is not None:
            return generator.next()
        return tf.random.uniform((2,), maxval=2**31 - 1, dtype=tf.int64)

    def _attend(self, q, k, v, keep, bias, causal, return_attention, training):
        """Picks the attention path; returns (context, weights or None): without weights, the
        memory-efficient path when the scores exceed `memory_efficient_threshold` elements
        (decided at run time where shapes are unknown at trace time), else
        `dot_product_attention`."""
        dropout_active = self.dropout > 0 and training is not False and training is not None
        chunk = None if return_attention else self._query_chunk(q, k)

        def at_once():
            dropout = (lambda w: self._dropout_layer(w, training=training)) if dropout_active else None
            return dot_product_attention(q, k, v, keep, bias, causal, dropout=dropout)

        def in_chunks():
            rate, seed = (self.dropout, self._dropout_seed()) if dropout_active else (0.0, None)
            return _memory_efficient_attention(q, k, v, keep, bias, causal, chunk, rate, seed)

        if chunk is None:
            return at_once()
        if None not in (q.shape[0], q.shape[2], k.shape[2]):
            return in_chunks(), None
        scores = tf.reduce_prod(tf.cast(tf.shape(q)[:3], tf.int64)) * tf.cast(tf.shape(k)[2], tf.int64)
        large = scores > self.memory_efficient_threshold
        return tf.cond(large, in_chunks, lambda: at_once()[0]), None

    def __call__(self, *args, **kwargs):
        """Checks the cache's dtype before Keras casts every floating input to the compute dtype
        (which would silently convert a cache of another dtype on every call)."""
        if kwargs.get("cache") is not None:
            _check_cache_dtype(kwargs["cache"], self.compute_dtype)
        return super().__call__(*args, **kwargs)

    def call(
        self,
        query,
        key=None,
        value=None,
        attention_mask=None,
        *,
        causal=False,
        return_attention=False,
        training=None,
        query_mask=None,
        key_mask=None,
        value_mask=None,
        cache=None,
    ):
        query_mask, key_mask, value_mask = (  # legacy Keras (tf_keras) leaves them on the tensors only
            getattr(x, "_keras_mask", None) if m is None else m
            for x, m in ((query, query_mask), (key, key_mask), (value, value_mask))
        )
        self_attention = (key is None or key is query) and (value is None or value is query)
        key, key_mask = (value, value_mask) if key is None else (key, key_mask)
        key, key_mask = (query, query_mask) if key is None else (key, key_mask)
        value, value_mask = (key, key_mask) if value is None else (value, value_mask)
        query = _check_input("query", query, "E", self.d_model)
        key = _check_input("key", key, "kdim", self.kdim)
        value = _check_input("value", value, "vdim", self.vdim)
        _check_lengths(query, key, value)
        query, key, value = (tf.cast(x, self.compute_dtype) for x in (query, key, value))  # legacy Keras: query only
        key_keep = _and(key_mask, value_mask)
        if cache is not None:
            _check_cache(cache, query, key, self.num_kv_heads, self.head_dim)
            key_keep = None if key_keep is None else tf.cast(key_keep, tf.bool)  # goes into the cache's keep
        b, t, s = query.shape[0], query.shape[1], key.shape[1] if cache is None else cache.key.shape[2]
        keep, bias = _split_mask(attention_mask, (b, self.num_heads, t, s))
        keep = _and(keep, _implicit_keep(query_mask, key_keep if cache is None else None))

        if self_attention:
            q, k, v = self._project_fused(query)  # (B, T, E) -> (B, N, T, H), 2 x (B, K, T, H)
        else:
            q = self._project(query, "query", self.num_heads)  # (B, T, E) -> (B, N, T, H)
            k = self._project(key, "key", self.num_kv_heads)  # (B, S, kdim) -> (B, K, S, H)
            v = self._project(value, "value", self.num_kv_heads)  # (B, S, vdim) -> (B, K, S, H)
        if cache is not None:
            t = tf.shape(q)[2]
            keep = _and(keep, _cache_keep(cache.keep, cache.index, t, causal))  # (B, N, T, L), dims may be 1
            full = _check_room(cache, t)  # only ever True under XLA
            cache = _write_cache(cache, k, v, key_keep)
            k, v, causal = cache.key, cache.value, False  # (B, K, L, H); causality is in `keep`
        context, weights = self._attend(q, k, v, keep, bias, causal, return_attention, training)  # (B, N, T, H)
        merged = tf.transpose(context, [0, 2, 1, 3])  # (B, N, T, H) -> (B, T, N, H)
        merged = tf.reshape(merged, tf.concat([tf.shape(query)[:2], [-1]], 0))  # -> (B, T, N*H)
        output = _linear(merged, self.output_kernel, self.output_bias if self.bias else None)  # -> (B, T, E)
        if cache is not None and not tf.executing_eagerly():
            output = tf.where(full, tf.cast(np.nan, output.dtype), output)  # XLA cannot raise for a full cache

        return _results(output, weights, cache, return_attention)

    def compute_mask(self, query, previous_mask=None):
        """The output carries the query's mask."""
        return previous_mask

    def _check_shapes(self, query_shape, value_shape, key_shape):
        """Shapes given to `build` or `compute_output_shape`, checked as the call checks its
        inputs (the same messages); returns the query's shape. A missing key or value shape is the
        other one's, as in the call; with neither, they are unknown (legacy Keras passes only the
        query's shape, whatever the call's key and value are)."""
        query_shape, value_shape, key_shape = (_shape_tuple(shape) for shape in (query_shape, value_shape, key_shape))
        key_shape = value_shape if key_shape is None else key_shape
        value_shape = key_shape if value_shape is None else value_shape
        for name, shape, width_name, width in (
            ("query", query_shape, "E", self.d_model),
            ("key", key_shape, "kdim", self.kdim),
            ("value", value_shape, "vdim", self.vdim),
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
                f"`key` and `value` must have the same length S. Received: key.shape={key_shape}, "
                f"value.shape={value_shape}"
            )
        return query_shape

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        """(B, T, E), whatever S is; shapes in Keras' order (query, value, key), checked as in `build`."""
        query_shape = self._check_shapes(query_shape, value_shape, key_shape)
        return (query_shape[0], query_shape[1], self.d_model)

    def compute_output_spec(self, *args, **kwargs):
        """Traces `call` on symbolic inputs (what Keras does for a layer without
        `compute_output_shape`), so a functional model gets every shape check when it is built,
        and both outputs with `return_attention=True`. It also works outside `__call__` (Keras'
        layer tests call it there): it builds the layer if needed, and every weight is read in
        the dtype of the input it meets, so under a mixed policy the specs have the compute dtype."""
        if not self.built:
            self.build()
        return super(tf.keras.layers.Layer, self).compute_output_spec(*args, **kwargs)

    @classmethod
    def from_keras(cls, layer):
        """Builds a layer with the weights of a built `keras.layers.MultiHeadAttention` or
        `keras.layers.GroupQueryAttention` (3-D inputs, default attention axes).

        Its dtype policy, initializers and `trainable` are kept; LoRA adapters on its
        projections are merged into the kernels. Every option this layer cannot hold (a gate,
        a sliding window, regularizers, constraints, other attention axes or output shapes,
        value_dim != key_dim, quantized projections) is a ValueError that lists them all.
        """
        config, dense = _keras_config(layer)
        new = cls(**config, name=f"{layer.name}_reference", dtype=layer.dtype_policy)
        new.trainable = layer.trainable
        weights = {}
        for kind, sublayer in zip(("query", "key", "value", "output"), dense, strict=True):
            kernel = sublayer.kernel.numpy()  # with LoRA, the merged kernel
            rows = kernel.shape[0] * kernel.shape[1] if kind == "output" else kernel.shape[0]
            weights[f"{kind}_kernel"] = kernel.reshape(rows, -1)  # heads flattened as h * H + d
            if new.bias:
                weights[f"{kind}_bias"] = sublayer.bias.numpy().reshape(-1)
        new.import_weights(weights)
        return new

    def to_keras(self):
        """Returns a built `keras.layers.MultiHeadAttention` (K == N) or
        `keras.layers.GroupQueryAttention` (K < N) holding these weights.

        Keras' GroupQueryAttention takes any key and value widths, but its
        `compute_output_shape` refuses a value width other than the query's, so with
        vdim != d_model it runs eagerly but not on symbolic inputs (a functional model).
        """
        _check_keras_can_hold(self)
        common = dict(
            dropout=self.dropout, use_bias=bool(self.bias), kernel_initializer=self.kernel_initializer,
            bias_initializer=self.bias_initializer, dtype=self.dtype_policy,
        )  # fmt: skip
        widths = (self.d_model, self.vdim, self.kdim)  # query, value, key: the built-ins' call order
        if self.num_kv_heads == self.num_heads:
            layer = tf.keras.layers.MultiHeadAttention(self.num_heads, self.head_dim, **common)
            if hasattr(layer, "_build_from_signature"):  # legacy Keras builds its projections on a first call
                layer(*(tf.zeros((1, 1, width)) for width in widths))
            else:
                layer.build(*((None, None, width) for width in widths))
        else:
            if _GROUP_QUERY_ATTENTION is None:
                raise ValueError(
                    "Legacy Keras (tf_keras) has no GroupQueryAttention to hold grouped-query attention. "
                    f"Received: num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}"
                )
            layer = _GROUP_QUERY_ATTENTION(self.head_dim, self.num_heads, self.num_kv_heads, **common)
            layer.build(*((None, None, width) for width in widths))
        layer.trainable = self.trainable
        weights = self.export_weights()
        dense = (layer._query_dense, layer._key_dense, layer._value_dense, layer._output_dense)
        for kind, sublayer in zip(("query", "key", "value", "output"), dense, strict=True):
            sublayer.kernel.assign(weights[f"{kind}_kernel"].reshape(sublayer.kernel.shape))
            if self.bias:
                sublayer.bias.assign(weights[f"{kind}_bias"].reshape(sublayer.bias.shape))
        return layer


def _check_keras_can_hold(layer):
    """Refuses, naming them, the variants of docs/SPEC.md that the Keras built-ins cannot hold
    (read with their defaults, so that a layer without one of them passes)."""
    bias = getattr(layer, "bias", True)
    defaults = {
        "bias": isinstance(bias, bool) or len(bias) in (0, 4),  # a tuple of names: all four or none
        "scale": _default_scale(getattr(layer, "scale", None), layer.head_dim),
        "softcap": getattr(layer, "softcap", None) is None,
        "window": getattr(layer, "window", None) is None,
        "rope_theta": getattr(layer, "rope_theta", None) is None,
        "qk_norm": getattr(layer, "qk_norm", None) is None,
        "sinks": not getattr(layer, "sinks", False),
    }
    held = [name for name, plain in defaults.items() if not plain]
    if held:
        received = ", ".join(f"{name}={getattr(layer, name)!r}" for name in held)
        raise ValueError(
            "`to_keras` needs a layer the Keras built-ins can hold: all four biases or none, the default "
            f"scale, and no softcap, window, RoPE, QK-norm or sinks. Received: {received}"
        )


def _default_scale(scale, head_dim):
    return scale is None or math.isclose(scale, 1 / math.sqrt(head_dim))


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
    if config.get("use_gate"):
        found["use_gate"] = (True, "a sigmoid gate on the attention output")
    window = config.get("sliding_window")
    if window is not None:
        found["sliding_window"] = (
            window,
            f"Keras keeps keys with |t - s| < {window}, on both sides of the query; with causal=True and T == S "
            f"that is this layer's window: construct it with `window={window}` and call it with `causal=True`",
        )
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


def _keras_config(layer):
    """Constructor arguments and (query, key, value, output) sublayers of a Keras built-in."""
    if not isinstance(layer, (tf.keras.layers.MultiHeadAttention, *_BUILT_IN_GQA)):
        raise ValueError(
            "`layer` must be a keras.layers.MultiHeadAttention or keras.layers.GroupQueryAttention. "
            f"Received: {type(layer).__name__}"
        )
    if not layer.built:
        raise ValueError(f"`layer` must be built. Received: an unbuilt {type(layer).__name__}")
    dense = (layer._query_dense, layer._key_dense, layer._value_dense, layer._output_dense)
    config = layer.get_config()
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
        bias_initializer=config["bias_initializer"],
    )  # fmt: skip
    return arguments, dense


def _shape_tuple(shape):
    """A shape (tuple, list, TensorShape) as a tuple, or None where it or its rank is unknown."""
    if shape is None or tf.TensorShape(shape).rank is None:
        return None
    return tuple(tf.TensorShape(shape).as_list())
