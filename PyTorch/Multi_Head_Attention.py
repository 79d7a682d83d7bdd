"""Multi-head attention for PyTorch: one `nn.Module`, proven equal to the TensorFlow layer.

Copy this one file into your model; it needs only torch, NumPy and the standard library.

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

Masks: a boolean `attention_mask` is True where a query may attend a key (the opposite of
`nn.MultiheadAttention`, where True means "ignore"); a floating one is added to the scores
(-inf removes a key). `causal=True` keeps key s for query t iff s <= t + (S - T). A query row
with no key left gets weights of exactly 0, so its output is `output_bias`: never NaN.
Example, a key padding mask for keys [a, b, <pad>]:
    keep = torch.tensor([[True, True, False]])       # (B, S)
    layer(x, attention_mask=keep[:, None, :])         # (B, 1, S) broadcasts to (B, N, T, S)

Parameters: `query`, `key`, `value` and `output` are `nn.Linear` submodules, so `state_dict`
holds `query.weight` = query_kernel^T, `query.bias` = query_bias, and so on for the others.

Decoding with a KV cache (L: the cache's max length): `cache = layer.init_cache(B, L)`, then
`output, cache = layer(x, cache=cache)` for a prompt (T > 1) and then one token at a time
(T = 1). The keys and values of the T new tokens are written to slots [index, index + T), and
query t attends slot s iff s < index + T, keep[b, s], (not causal or s <= index + t) and
`attention_mask` (given over L) keeps it. Token-by-token equals the full causal pass. This
layer writes the keys and values into the cache's tensors in place (for inference; call it
under `torch.no_grad()`); the returned cache shares them, with the index moved on.

Tensor parallelism (`parallelize_module` with `ColwiseParallel` on `query`, `key`, `value` and
`RowwiseParallel` on `output`) splits the heads across ranks: each rank attends its share of
the heads, so `return_attention` returns this rank's heads. K must be divisible by the ranks,
and a per-head (B, N, T, S) mask cannot be split.

Two code paths give the same numbers: without `return_attention`, attention runs in
`torch.nn.functional.scaled_dot_product_attention` (and self-attention projects q, k and v
with one matmul); with it, an explicit softmax returns the per-head weights (under no_grad on
the CPU it runs in place in the returned weights, a block of batch elements at a time).
"""

import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["KVCache", "MultiHeadAttention", "dot_product_attention"]


class KVCache(NamedTuple):
    """The keys and values of the tokens decoded so far (make one with `init_cache`).

    Attributes:
        key: (B, K, L, H) projected keys, one slot per position; L is the cache's max length.
        value: (B, K, L, H) projected values.
        keep: (B, L) boolean; False marks a slot no query may attend (left padding).
        index: scalar integer; slots [0, index) are written, the next call writes from index.
    """

    key: torch.Tensor
    value: torch.Tensor
    keep: torch.Tensor
    index: torch.Tensor


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


def _dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def _is_dtensor(tensor):
    """Whether `tensor` is a DTensor (sharded by tensor parallelism), read from its type so that
    importing this file does not import torch.distributed.tensor (0.7 s)."""
    kind = type(tensor)
    return kind.__name__ == "DTensor" and kind.__module__.startswith("torch.distributed.tensor")


def _check_input(name, x, width_name, width):
    """Checks one (B, L, width) input."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        dtype = _dtype_name(x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"`{name}` must be a floating tensor. Received: {name}.dtype={dtype}")
    letter = "T" if name == "query" else "S"
    if x.dim() != 3 or x.shape[-1] != width:
        raise ValueError(
            f"`{name}` must have shape (B, {letter}, {width_name}) with {width_name}={width}. "
            f"Received: {name}.shape={tuple(x.shape)}"
        )
    return x


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


def _check_cache(cache, query, key, heads, head_dim):
    """Checks a KVCache against the call's (B, T, E) query and (B, S, kdim) key."""
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
    if k.dim() != 4 or k.shape != v.shape or (k.shape[0], k.shape[1], k.shape[3]) != (b, heads, head_dim):
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
            f"`cache` must hold the layer's compute dtype {_dtype_name(dtype)}. "
            f"Received: cache.key.dtype={_dtype_name(cache.key.dtype)}, "
            f"cache.value.dtype={_dtype_name(cache.value.dtype)}"
        )


def _cache_full_error(index, t, length):
    return ValueError(
        f"`cache` is full: index + T must be <= L (call `init_cache` with a larger `max_length`). "
        f"Received: index={index}, T={t}, L={length}"
    )


def _check_keep(keep, batch_size, max_length):
    """Checks the (B, L) boolean `keep` of `init_cache`."""
    keep = torch.as_tensor(keep)
    if keep.dtype != torch.bool or tuple(keep.shape) != (batch_size, max_length):
        raise ValueError(
            f"`keep` must be a boolean array of shape (B, L)=({batch_size}, {max_length}). "
            f"Received: keep.shape={tuple(keep.shape)}, keep.dtype={_dtype_name(keep.dtype)}"
        )
    return keep


def _cache_keep(keep, index, t, causal):
    """(B, L) cache keep -> (B, 1, T, L): slot s is written, not padding and, when causal, at most
    the query's own position index + t."""
    slots = torch.arange(keep.shape[-1], device=keep.device)[None, :]  # (1, L)
    positions = index + torch.arange(t, device=keep.device)[:, None]  # (T, 1), the position of each query
    allowed = slots <= positions if causal else slots < index + t  # (T, L)
    return allowed[None, None] & keep[:, None, None, :]  # (B, 1, T, L)


def _write_cache(cache, k, v):
    """Writes (B, K, T, H) keys and values to slots [index, index + T) of the cache's own tensors.

    Eagerly a full cache is a ValueError. Under `torch.compile` (where raising needs a graph
    break) the write is clamped to the last slot and the caller sets that call's output to NaN.
    """
    t, length = k.shape[2], cache.key.shape[2]
    if not torch.compiler.is_compiling() and int(cache.index) + t > length:
        raise _cache_full_error(int(cache.index), t, length)
    positions = (cache.index + torch.arange(t, device=k.device)).clamp(max=length - 1)  # (T,)
    cache.key.index_copy_(2, positions, k)  # (B, K, L, H)
    cache.value.index_copy_(2, positions, v)  # (B, K, L, H)
    return KVCache(cache.key, cache.value, cache.keep, cache.index + t)


def _and(a, b):
    return b if a is None else a if b is None else a & b


def _results(output, weights, cache, return_attention):
    """output, (output, weights), (output, cache) or (output, weights, cache)."""
    results = (output, weights) if return_attention else (output,)
    results = results if cache is None else (*results, cache)
    return results[0] if len(results) == 1 else results


def _mask_to_4d(mask, target):
    """Checks `attention_mask` against target (B, N, T, S) and returns it as rank 4."""
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(
            f"`attention_mask` must be boolean or floating. Received: attention_mask.dtype={_dtype_name(mask.dtype)}"
        )
    expected = {2: target[2:], 3: (target[0], *target[2:]), 4: target}.get(mask.dim())
    if expected is None or any(m not in (1, e) for m, e in zip(mask.shape, expected, strict=True)):
        raise ValueError(
            "`attention_mask` must broadcast to (B, N, T, S) as (T, S), (B, T, S) or "
            f"(B, N, T, S), each dimension full or 1. Expected: (B, N, T, S)={target}. "
            f"Received: attention_mask.shape={tuple(mask.shape)}"
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


def _split_mask(attention_mask, target):
    """Splits `attention_mask` into (keep, bias): boolean and additive, both rank 4 or None."""
    if attention_mask is None:
        return None, None
    mask = _mask_to_4d(attention_mask, target)
    if mask.dtype == torch.bool:
        return mask, None
    lowest = torch.finfo(mask.dtype).min
    removed = mask <= lowest  # -inf (or the lowest finite value, which converters put for it) removes a key
    return ~removed, torch.where(removed, 0.0, mask.clamp(min=lowest))  # finite, never 0 * -inf


_BLOCK_SCORES = 1 << 21  # scores in one block of `_attention_in_blocks`: 8 MiB of float32


def _scores_dtype(dtype, bias):
    """The dtype the (B, N, T, S) scores are held in: that of q, or float32 where a float mask is
    added to float16 or bfloat16 scores (so that the sum is not rounded). The softmax of float16
    and bfloat16 computes in float32 either way."""
    return dtype if bias is None else torch.promote_types(dtype, torch.float32)


def _masked_softmax(scores, keep):
    """Softmax over S with every position not kept at weight exactly 0 (rows with no key are
    all 0). Without autograd (and outside torch.compile) it overwrites `scores`, a tensor the
    caller owns: no second (B, N, T, S) buffer, as in the built-in layer's inference kernel."""
    lowest = torch.finfo(scores.dtype).min
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        scores = scores if keep is None else torch.where(keep, scores, lowest)
        weights = scores.softmax(dim=-1)
        return weights if keep is None else torch.where(keep, weights, 0.0)
    removed = None if keep is None else ~keep
    if removed is not None:
        scores.masked_fill_(removed, lowest)
    weights = torch.ops.aten._softmax.out(scores, -1, False, out=scores)  # in place
    return weights if removed is None else weights.masked_fill_(removed, 0.0)


def _explicit_attention(q, k, v, keep, bias, dropout):
    """Scores, mask, softmax, weighted sum; returns (context, weights)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)  # (B, K, S, H) -> (B, N, S, H)
        v = v.repeat_interleave(groups, dim=1)  # (B, K, S, H) -> (B, N, S, H)
    scale = 1.0 / math.sqrt(q.shape[-1])
    dtype = _scores_dtype(q.dtype, bias)
    if _in_blocks(q, dtype):
        return _attention_in_blocks(q, k, v, keep, bias, dropout, scale)
    scores = ((q * scale) @ k.transpose(-1, -2)).to(dtype)  # (B, N, T, S), a new tensor; q scaled, not the scores
    scores = scores if bias is None else scores + bias.to(dtype)  # (B, N, T, S)
    weights = _masked_softmax(scores, keep).to(q.dtype)  # (B, N, T, S)
    context = F.dropout(weights, dropout, training=dropout > 0) @ v  # (B, N, T, S) @ (B, N, S, H) -> (B, N, T, H)
    return context, weights


def _in_blocks(q, dtype):
    """Whether `_explicit_attention` takes `_attention_in_blocks`: inference (no autograd, not
    compiling) on the CPU, with scores held in the dtype of q."""
    inference = not (torch.is_grad_enabled() or torch.compiler.is_compiling())
    return inference and q.device.type == "cpu" and q.dtype == dtype


def _batch_rows(mask, rows):
    """The batch elements `rows` of a mask that broadcasts to (B, N, T, S)."""
    return mask if mask is None or mask.dim() < 4 or mask.shape[0] == 1 else mask[rows]


def _attention_in_blocks(q, k, v, keep, bias, dropout, scale):
    """`_explicit_attention` without autograd, a block of batch elements at a time: each block's
    scores are written into its slice of the weights, softmaxed there in place and multiplied by
    v while they are still in the CPU cache (one (B, N, T, S) buffer in all)."""
    (b, n, t, h), s = q.shape, k.shape[2]
    weights = q.new_empty(b, n, t, s)  # (B, N, T, S)
    context = q.new_empty(b, n, t, h)  # (B, N, T, H)
    step = max(1, _BLOCK_SCORES // max(1, n * t * s))
    for start in range(0, b, step):
        rows, r = slice(start, start + step), min(step, b - start)  # r batch elements in this block
        scores = weights[rows].view(r * n, t, s)  # (r*N, T, S)
        q_rows, k_rows = q[rows].reshape(r * n, t, h), k[rows].reshape(r * n, s, h)  # (r*N, T, H), (r*N, S, H)
        torch.baddbmm(scores, q_rows, k_rows.transpose(1, 2), beta=0.0, alpha=scale, out=scores)  # scaled q k^T
        scores = scores.view(r, n, t, s)  # (r*N, T, S) -> (r, N, T, S)
        if bias is not None:
            scores += _batch_rows(bias, rows)
        _masked_softmax(scores, _batch_rows(keep, rows))  # in place
        dropped = F.dropout(scores, dropout, training=dropout > 0)
        torch.matmul(dropped, v[rows], out=context[rows])  # (r, N, T, S) @ (r, N, S, H) -> (r, N, T, H)
    return context, weights


def _sdpa_heads(q, k, v, masked):
    """Keys, values and `enable_gqa` for SDPA. Grouped heads are read by the flash kernels only
    (on the CPU, and on CUDA in float16 and bfloat16 without a mask); elsewhere SDPA would fall
    back to its math kernel, which holds the (B, N, T, S) scores, so k and v are repeated."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v, False
    if q.device.type == "cpu" or (not masked and q.dtype in (torch.float16, torch.bfloat16)):
        return k, v, True
    k = k.repeat_interleave(groups, dim=1)  # (B, K, S, H) -> (B, N, S, H)
    return k, v.repeat_interleave(groups, dim=1), False  # (B, K, S, H) -> (B, N, S, H)


def _fused_attention(q, k, v, keep, bias, dropout, is_causal=False):
    """`scaled_dot_product_attention` with a finite additive mask; returns the context.

    `is_causal` is the kernel's own top-left triangle: pass it only with no mask and T == S.
    A row with no key left attends to every key inside the kernel (finite numbers, forward and
    backward, in any dtype) and is then set to exactly 0.
    """
    k, v, gqa = _sdpa_heads(q, k, v, masked=keep is not None or bias is not None)
    if keep is None and bias is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=is_causal, enable_gqa=gqa)
    additive = torch.zeros((), dtype=q.dtype, device=q.device) if bias is None else bias.to(q.dtype)
    if keep is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=additive, dropout_p=dropout, enable_gqa=gqa)
    has_key = keep.any(dim=-1, keepdim=True)  # (B, N, T, 1), dims may be 1
    additive = torch.where(keep | ~has_key, additive, torch.finfo(q.dtype).min)  # (B, N, T, S), dims may be 1
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, dropout_p=dropout, enable_gqa=gqa)
    return torch.where(has_key, context, 0.0)  # (B, N, T, H), rows with no key are all 0


def dot_product_attention(q, k, v, keep=None, bias=None, causal=False, *, dropout=0.0, return_attention=False):
    """Pure attention on split heads; returns (context, weights).

    Args:
        q: (B, N, T, H) queries.
        k: (B, K, S, H) keys, K dividing N.
        v: (B, K, S, H) values.
        keep: None or boolean, broadcasts to (B, N, T, S); True where a query may attend a key.
        bias: None or float, broadcasts to (B, N, T, S); added to the scaled scores.
        causal: if True, query t keeps key s only if s <= t + (S - T).
        dropout: probability of dropping attention weights (pass 0 outside training).
        return_attention: if True, take the explicit path and return the weights; otherwise
            take `scaled_dot_product_attention` and return None for them.

    Returns:
        context (B, N, T, H) and weights (B, N, T, S) (None unless `return_attention`),
        exactly 0 where not kept.
    """
    t, s = q.shape[2], k.shape[2]
    if causal and keep is None and bias is None and t == s and not return_attention:
        return _fused_attention(q, k, v, None, None, dropout, is_causal=True), None  # (B, N, T, H)
    if causal:
        triangle = causal_mask(t, s, q.device)  # (T, S)
        keep = triangle if keep is None else keep & triangle  # (B, N, T, S), dims may be 1
    if return_attention:
        return _explicit_attention(q, k, v, keep, bias, dropout)
    return _fused_attention(q, k, v, keep, bias, dropout), None


class MultiHeadAttention(nn.Module):
    """Multi-head attention (MHA, grouped-query GQA and multi-query MQA) as an `nn.Module`.

    Args:
        d_model: E, the width of `query` and of the output.
        num_heads: N, the number of query heads.
        num_kv_heads: K, the number of key/value heads; must divide N. Defaults to N.
        head_dim: H, the width of one head. Defaults to E // N (then N must divide E).
        kdim: width of `key`. Defaults to E.
        vdim: width of `value`. Defaults to E.
        dropout: probability of dropping attention weights in training mode; 0 <= p < 1.
        bias: whether the four projections have biases.
        device: device of the parameters.
        dtype: dtype of the parameters.

    Call arguments:
        query: (B, T, E), or unbatched (T, E).
        key: (B, S, kdim). Defaults to `value`, or to `query` if `value` is None too.
        value: (B, S, vdim). Defaults to `key`.
        attention_mask: boolean (True = attend) or floating (added to the scores), of shape
            (T, S), (B, T, S) or (B, N, T, S), any dimension of which may be 1.
        causal: if True, query t attends key s only if s <= t + (S - T).
        return_attention: if True, also return the per-head attention weights.
        cache: a `KVCache` from `init_cache`: decode T new tokens (`key` and `value`, if
            given, hold the same T tokens); masks and weights are then over the L slots.

    Returns:
        output (B, T, E), or (output, weights) with weights (B, N, T, S) (per head, before
        dropout) when `return_attention` is True; with `cache`, the updated cache is appended
        and weights are (B, N, T, L), exactly 0 at unwritten slots. Unbatched inputs give
        unbatched results.

    Example, a key padding mask (the third key of the first sequence is padding):
        >>> layer = MultiHeadAttention(16, 4)
        >>> x = torch.randn(2, 3, 16)  # (B, T, E)
        >>> keep = torch.tensor([[True, True, False], [True, True, True]])  # (B, S)
        >>> out, weights = layer(x, attention_mask=keep[:, None, :], return_attention=True)
        >>> tuple(out.shape), tuple(weights.shape)
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
        device=None,
        dtype=None,
    ):
        super().__init__()
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
        nh, kh = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        factory = {"bias": self.bias, "device": device, "dtype": dtype}
        self.query = nn.Linear(self.d_model, nh, **factory)  # query_kernel^T: (N*H, E)
        self.key = nn.Linear(self.kdim, kh, **factory)  # key_kernel^T: (K*H, kdim)
        self.value = nn.Linear(self.vdim, kh, **factory)  # value_kernel^T: (K*H, vdim)
        self.output = nn.Linear(nh, self.d_model, **factory)  # output_kernel^T: (E, N*H)
        self.reset_parameters()

    def reset_parameters(self):
        """Glorot (Xavier) uniform kernels, zero biases, as in the other two files."""
        for kind in ("query", "key", "value", "output"):
            projection = getattr(self, kind)
            nn.init.xavier_uniform_(projection.weight)
            if projection.bias is not None:
                nn.init.zeros_(projection.bias)

    def init_cache(self, batch_size, max_length, *, keep=None, dtype=None):
        """An empty `KVCache` for decoding `batch_size` sequences of up to `max_length` tokens.

        Args:
            batch_size: B.
            max_length: L, the number of slots.
            keep: (B, L) boolean, False for slots no query may attend (left padding of prompts
                of different lengths). Defaults to all True.
            dtype: dtype of the keys and values; defaults to the compute dtype, the parameters'.

        Returns:
            A `KVCache` of zeros with index 0, on the parameters' device.
        """
        b, length = _positive_int("batch_size", batch_size), _positive_int("max_length", max_length)
        device = self.output.weight.device
        keep = torch.ones(b, length, dtype=torch.bool) if keep is None else _check_keep(keep, b, length)
        shape = (b, self.num_kv_heads, length, self.head_dim)
        dtype = self.output.weight.dtype if dtype is None else dtype
        return KVCache(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            keep.to(device),
            torch.zeros((), dtype=torch.long, device=device),
        )

    def extra_repr(self):
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dropout={self.dropout}"
        )

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

    def _parameter(self, name):
        """The tensor behind a portable name and whether it is stored transposed."""
        kind, part = name.rsplit("_", 1)
        projection = getattr(self, kind)
        return (projection.weight, True) if part == "kernel" else (projection.bias, False)

    def export_weights(self):
        """Returns the portable weights: a dict of NumPy arrays (bfloat16 is widened to float32)."""
        weights = {}
        for name in self.weight_shapes():
            tensor, transposed = self._parameter(name)
            tensor = tensor.detach().cpu()
            tensor = tensor.float() if tensor.dtype == torch.bfloat16 else tensor
            weights[name] = (tensor.T if transposed else tensor).numpy().copy()
        return weights

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
        with torch.no_grad():
            for name in expected:
                tensor, transposed = self._parameter(name)
                value = torch.as_tensor(np.asarray(weights[name]), dtype=tensor.dtype, device=tensor.device)
                tensor.copy_(value.T if transposed else value)

    def _project(self, x, kind, heads):
        """(B, L, D) -> (B, heads, L, H): one projection split into heads."""
        y = getattr(self, kind)(x)  # (B, L, D) -> (B, L, heads*H)
        return self._split_heads(y, heads)

    def _split_heads(self, y, heads):
        """(B, L, heads*H) -> (B, heads, L, H). Under tensor parallelism a rank holds a share of
        the heads, so the local count is read from the width."""
        b, length, width = y.shape
        if width % self.head_dim:
            raise ValueError(
                "Each tensor-parallel rank must hold whole heads: `num_heads` and `num_kv_heads` must be divisible "
                f"by the number of ranks. Received: num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, a projection {width} wide on this rank"
            )
        return y.view(b, length, width // self.head_dim, self.head_dim).transpose(1, 2)  # -> (B, heads, L, H)

    def _project_fused(self, x):
        """Self-attention: q, k and v from one matmul over the concatenated projections."""
        weight = torch.cat([self.query.weight, self.key.weight, self.value.weight])  # (N*H + 2*K*H, E)
        bias = torch.cat([self.query.bias, self.key.bias, self.value.bias]) if self.bias else None
        nh, kh = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, weight, bias).split([nh, kh, kh], dim=-1)  # (B, T, E) -> 3 x (B, T, heads*H)
        return (
            self._split_heads(q, self.num_heads),  # (B, N, T, H)
            self._split_heads(k, self.num_kv_heads),  # (B, K, T, H)
            self._split_heads(v, self.num_kv_heads),  # (B, K, T, H)
        )

    def _check_local_heads(self, q, k, attention_mask):
        """Tensor parallelism: this rank's query and key/value heads must keep the N : K grouping,
        and a per-head (B, N, T, S) mask cannot be split with them."""
        local, local_kv = q.shape[1], k.shape[1]
        if (local, local_kv) == (self.num_heads, self.num_kv_heads):
            return
        if local * self.num_kv_heads != local_kv * self.num_heads:
            raise ValueError(
                "Each tensor-parallel rank must hold whole groups of heads: `num_kv_heads` must be divisible by the "
                f"number of ranks. Received: num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"{local} query and {local_kv} key/value heads on this rank"
            )
        if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] != 1:
            raise ValueError(
                "A per-head `attention_mask` (B, N, T, S) cannot be used with heads split across tensor-parallel "
                f"ranks ({local} of {self.num_heads} heads on this rank); pass (T, S), (B, T, S) or (B, 1, T, S). "
                f"Received: attention_mask.shape={tuple(attention_mask.shape)}"
            )

    def _compute_dtype(self, device_type):
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return self.output.weight.dtype

    def forward(
        self, query, key=None, value=None, attention_mask=None, *, causal=False, return_attention=False, cache=None
    ):
        unbatched = isinstance(query, torch.Tensor) and query.dim() == 2
        if unbatched:
            query, key, value = (x if x is None else x.unsqueeze(0) for x in (query, key, value))  # (L, D) -> (1, L, D)
        self_attention = (key is None or key is query) and (value is None or value is query)
        key = value if key is None else key
        key = query if key is None else key
        value = key if value is None else value
        query = _check_input("query", query, "E", self.d_model)
        key = _check_input("key", key, "kdim", self.kdim)
        value = _check_input("value", value, "vdim", self.vdim)
        _check_lengths(query, key, value)
        if cache is not None:
            _check_cache(cache, query, key, self.num_kv_heads, self.head_dim)
            _check_cache_dtype(cache, self._compute_dtype(query.device.type))
        (b, t, _), s = query.shape, key.shape[1] if cache is None else cache.key.shape[2]
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            attention_mask = torch.as_tensor(attention_mask, device=query.device)
        keep, bias = _split_mask(attention_mask, (b, self.num_heads, t, s))

        if self_attention and not _is_dtensor(self.query.weight):  # sharded weights project one by one
            q, k, v = self._project_fused(query)  # (B, T, E) -> (B, N, T, H), 2 x (B, K, T, H)
        else:
            q = self._project(query, "query", self.num_heads)  # (B, T, E) -> (B, N, T, H)
            k = self._project(key, "key", self.num_kv_heads)  # (B, S, kdim) -> (B, K, S, H)
            v = self._project(value, "value", self.num_kv_heads)  # (B, S, vdim) -> (B, K, S, H)
        self._check_local_heads(q, k, attention_mask)
        if cache is not None:
            keep = _and(keep, _cache_keep(cache.keep, cache.index, t, causal))  # (B, N, T, L), dims may be 1
            full = cache.index + t > cache.key.shape[2]  # only ever True under torch.compile
            cache = _write_cache(cache, k, v)
            k, v, causal = cache.key, cache.value, False  # (B, K, L, H); causality is in `keep`
        dropout = self.dropout if self.training else 0.0
        context, weights = dot_product_attention(
            q, k, v, keep, bias, causal, dropout=dropout, return_attention=return_attention
        )  # (B, N, T, H), (B, N, T, S) or None
        merged = context.transpose(1, 2).reshape(b, t, context.shape[1] * self.head_dim)  # -> (B, T, N*H)
        output = self.output(merged)  # (B, T, N*H) -> (B, T, E)
        if cache is not None and torch.compiler.is_compiling():
            output = torch.where(full, torch.nan, output)  # a full cache cannot raise inside a graph

        if unbatched:
            output, weights = output[0], None if weights is None else weights[0]  # drop B
        return _results(output, weights, cache, return_attention)

    @classmethod
    def from_torch(cls, module):
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

    def to_torch(self):
        """Returns a `torch.nn.MultiheadAttention` (batch_first=True) with these weights."""
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                "`torch.nn.MultiheadAttention` cannot hold grouped-query attention: it has one key/value "
                f"head per query head. Received: num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}"
            )
        if self.num_heads * self.head_dim != self.d_model:
            raise ValueError(
                "`torch.nn.MultiheadAttention` needs num_heads * head_dim == d_model. "
                f"Received: d_model={self.d_model}, num_heads={self.num_heads}, head_dim={self.head_dim}"
            )
        reference = self.output.weight
        module = nn.MultiheadAttention(
            self.d_model, self.num_heads, dropout=self.dropout, bias=self.bias, kdim=self.kdim, vdim=self.vdim,
            batch_first=True, device=reference.device, dtype=reference.dtype,
        )  # fmt: skip
        projections = (self.query, self.key, self.value)
        with torch.no_grad():
            if module._qkv_same_embed_dim:
                module.in_proj_weight.copy_(torch.cat([p.weight for p in projections]))
            else:
                for target, projection in zip(
                    (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight), projections, strict=True
                ):
                    target.copy_(projection.weight)
            module.out_proj.weight.copy_(self.output.weight)
            if self.bias:
                module.in_proj_bias.copy_(torch.cat([p.bias for p in projections]))
                module.out_proj.bias.copy_(self.output.bias)
        module.train(self.training)
        return module
