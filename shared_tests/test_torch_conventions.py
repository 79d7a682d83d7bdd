"""Conventions that PyTorch's own tests check for nn.MultiheadAttention and SDPA, written for this
layer: `torch.autograd.gradcheck` in float64 (masks, fully masked rows, both code paths, causal,
grouped-query heads), dropout in training mode equal to the built-in's under the same seed, and
the forward pass on the meta device (every path, the KV cache included)."""

import pytest
import torch
from torch import nn

from PyTorch import MultiHeadAttention
from shared_tests.cases import TOLERANCES

OUTPUT_TOL = TOLERANCES["float32"]["output"]
GRADCHECK_EPS = 1e-6  # gradcheck's defaults, named: finite differences in float64
GRADCHECK_ATOL = 1e-5
B, T, S, E = 2, 3, 4, 8


def _randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _keep_with_fully_masked_rows():
    """(B, T, S) boolean: random, with query 1 of batch 0 keeping no key and batch 1 keeping
    only key 0 for query 0 (the other rows of batch 1 keep nothing)."""
    keep = _randn(B, T, S, seed=1) > -0.5
    keep[0, 1] = False
    keep[1] = False
    keep[1, 0, 0] = True
    return keep


GRADCHECK_CONFIGS = {
    "mha_self": ({}, False, False),
    "mha_cross_kdim_vdim": ({"kdim": 5, "vdim": 6}, True, False),
    "gqa_self": ({"num_heads": 4, "num_kv_heads": 2}, False, False),
    "mha_self_causal": ({}, False, True),
    "gqa_cross_causal": ({"num_heads": 4, "num_kv_heads": 2, "head_dim": 3}, True, True),
}


def _masks(kind, length):
    """The `attention_mask` of one kind over `length` keys; each but "none" leaves some rows with
    no key (they output the output bias)."""
    if kind == "bool_with_empty_rows":
        return _keep_with_fully_masked_rows()[:, :, :length]  # (B, T, S)
    if kind == "float_with_empty_rows":
        keep = _keep_with_fully_masked_rows()[:, :, :length]
        return torch.where(keep, _randn(B, T, length, seed=6), -torch.inf)  # (B, T, S): -inf removes
    return None


@pytest.mark.parametrize("return_attention", [False, True], ids=["sdpa", "explicit"])
@pytest.mark.parametrize("mask", ["bool_with_empty_rows", "float_with_empty_rows", "none"])
@pytest.mark.parametrize("config", list(GRADCHECK_CONFIGS))
def test_gradcheck_float64(config, mask, return_attention):
    """Analytic gradients of query, key and value equal finite differences, fully masked rows
    included (there the output is the output bias: a gradient of exactly 0, never NaN). Fast
    mode compares random projections of the Jacobian, 10 times quicker than every column."""
    kwargs, cross, causal = GRADCHECK_CONFIGS[config]
    layer = MultiHeadAttention(E, kwargs.pop("num_heads", 2), dtype=torch.float64, **kwargs)
    with torch.no_grad():
        layer.output.bias.copy_(_randn(E, seed=2))
    query = _randn(B, T, E, seed=3).requires_grad_()
    key = _randn(B, S if cross else T, layer.kdim, seed=4).requires_grad_()
    value = _randn(B, S if cross else T, layer.vdim, seed=5).requires_grad_()
    attention_mask = _masks(mask, key.shape[1])

    def attend(q, k, v):
        return layer(q, k, v, attention_mask, causal=causal, return_attention=return_attention)

    assert torch.autograd.gradcheck(attend, (query, key, value), eps=GRADCHECK_EPS, atol=GRADCHECK_ATOL, fast_mode=True)


@pytest.mark.parametrize("return_attention", [False, True], ids=["sdpa", "explicit"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "key_padding"])
def test_dropout_in_training_equals_the_builtin_under_the_same_seed(return_attention, cross, padded):
    """Both draw one dropout mask over the (B, N, T, S) weights with the global generator and
    nothing else random: SDPA's `dropout_p` on the fast path (the built-in with
    need_weights=False), `F.dropout` of the weights on the explicit path (need_weights=True). So
    under one seed the outputs are equal, and another seed gives other outputs (the test can fail)."""
    layer = MultiHeadAttention(16, 4, dropout=0.3).train()
    builtin = layer.to_torch().train()
    query = _randn(2, 5, 16, seed=7, dtype=torch.float32)
    key = _randn(2, 7, 16, seed=8, dtype=torch.float32) if cross else query
    key_mask = torch.ones(2, key.shape[1], dtype=torch.bool)
    if padded:
        key_mask[0, -2:] = False
    masks = {"attention_mask": key_mask[:, None, :]} if padded else {}  # (B, 1, S)
    builtin_masks = {"key_padding_mask": ~key_mask} if padded else {}

    def ours(seed):
        torch.manual_seed(seed)
        result = layer(query, key, key, **masks, return_attention=return_attention)
        return result[0] if return_attention else result

    def theirs(seed):
        torch.manual_seed(seed)
        output, _ = builtin(query, key, key, **builtin_masks, need_weights=return_attention)
        return output

    torch.testing.assert_close(ours(1), theirs(1), atol=OUTPUT_TOL, rtol=0)
    assert (ours(1) - theirs(2)).abs().max() > 0.1


def test_dropout_builtin_is_the_one_round_tripped_through_from_torch():
    """The seed equality above holds for a layer made by `from_torch` as well."""
    builtin = nn.MultiheadAttention(16, 4, dropout=0.3, batch_first=True).train()
    layer = MultiHeadAttention.from_torch(builtin).train()
    x = _randn(2, 5, 16, seed=9, dtype=torch.float32)
    torch.manual_seed(3)
    expected, _ = builtin(x, x, x, need_weights=False)
    torch.manual_seed(3)
    torch.testing.assert_close(layer(x), expected, atol=OUTPUT_TOL, rtol=0)


@pytest.mark.parametrize("dtype", ["bool", "float"])
def test_builtin_attn_mask_of_shape_t_s_with_batch_equal_to_t(dtype):
    """PyTorch's tests pass 2-D (T, S) `attn_mask`s with any batch size, B == T among them: the
    same mask (inverted when boolean: True means ignore there) gives the built-in's numbers."""
    builtin = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    layer = MultiHeadAttention.from_torch(builtin).eval()
    x = _randn(4, 4, 16, seed=11, dtype=torch.float32)  # B == T == 4
    ignore = torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)  # (T, S), True = ignore
    theirs = ignore if dtype == "bool" else torch.zeros(4, 4).masked_fill(ignore, float("-inf"))
    ours = ~ignore if dtype == "bool" else theirs
    expected, _ = builtin(x, x, x, attn_mask=theirs, need_weights=False)
    torch.testing.assert_close(layer(x, x, x, mask=ours), expected, atol=OUTPUT_TOL, rtol=0)


def test_builtin_key_padding_mask_with_a_fully_padded_sequence():
    """A batch holding a sequence of only padding: the built-in's other rows, and the output bias
    (never NaN) for the padded sequence's rows."""
    builtin = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    layer = MultiHeadAttention.from_torch(builtin).eval()
    x = _randn(2, 3, 16, seed=12, dtype=torch.float32)
    padding = torch.tensor([[False, False, True], [True, True, True]])  # True = padding
    with torch.no_grad():
        expected, _ = builtin(x[:1], x[:1], x[:1], key_padding_mask=padding[:1], need_weights=False)
        output = layer(x, x, x, key_mask=~padding)
    torch.testing.assert_close(output[:1], expected, atol=OUTPUT_TOL, rtol=0)
    torch.testing.assert_close(output[1], builtin.out_proj.bias.expand(3, 16), atol=0, rtol=0)


def _meta_call_inputs(b=2, t=5, s=5, e=16, kdim=16, vdim=16):
    """Values on the CPU for every input a call may take (moved to meta for the meta layer)."""
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[0, :2] = False  # left padding of batch 0
    return {
        "query": _randn(b, t, e, seed=10, dtype=torch.float32),
        "key": _randn(b, s, kdim, seed=11, dtype=torch.float32),
        "value": _randn(b, s, vdim, seed=12, dtype=torch.float32),
        "key_mask": keep,  # (B, S)
        "query_mask": torch.arange(t) < torch.tensor([t, t - 1])[:, None],  # (B, T)
        "bool_mask": torch.ones(t, s, dtype=torch.bool).tril(s - t),  # (T, S)
        "float_mask": _randn(b, 1, t, s, seed=13, dtype=torch.float32),  # (B, 1, T, S)
        "attention_bias": _randn(b, 4, t, s, seed=14, dtype=torch.float32),  # (B, N, T, S)
    }


# name: (constructor arguments, the call's arguments from _meta_call_inputs(), the call's options)
META_PATHS = {
    "sdpa": ({}, ("query",), {}),
    "causal": ({}, ("query",), {"causal": True}),
    "return_attention": ({}, ("query",), {"return_attention": True}),
    "cross_kdim_vdim": ({"kdim": 6, "vdim": 7}, ("query", "key", "value"), {}),
    "key_mask": ({}, ("query",), {"key_mask": "key_mask", "causal": True}),
    "query_mask": ({}, ("query",), {"query_mask": "query_mask", "return_attention": True}),
    "bool_mask": ({}, ("query",), {"attention_mask": "bool_mask"}),
    "float_mask": ({}, ("query",), {"attention_mask": "float_mask", "return_attention": True}),
    "attention_bias": ({}, ("query",), {"attention_bias": "attention_bias"}),
    "softcap": ({"softcap": 5.0}, ("query",), {"causal": True}),
    "sinks": ({"sinks": True}, ("query",), {"key_mask": "key_mask", "return_attention": True}),
    "window": ({"window": 2}, ("query",), {"causal": True}),
    "rope": ({"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ("query",), {}),
    "qk_norm_head": ({"qk_norm": "head"}, ("query",), {"return_attention": True}),
    "qk_norm_all": ({"qk_norm": "all"}, ("query",), {"causal": True}),
    "gqa": ({"num_kv_heads": 2}, ("query",), {"causal": True, "return_attention": True}),
    "gemma2": ({"num_kv_heads": 2, "softcap": 5.0, "window": 3, "rope_theta": 10000.0}, ("query",), {"causal": True}),
}


def _meta_and_cpu(kwargs, run):
    """`run(layer, device)` for a CPU layer and for the same layer built on the meta device."""
    cpu = run(MultiHeadAttention(16, 4, **kwargs), torch.device("cpu"))
    meta = run(MultiHeadAttention(16, 4, device="meta", **kwargs), torch.device("meta"))
    return cpu, meta


def _assert_like_cpu(meta, cpu):
    """The meta results have the CPU results' structure, shapes and dtypes, on the meta device."""
    meta_leaves, cpu_leaves = torch.utils._pytree.tree_leaves(meta), torch.utils._pytree.tree_leaves(cpu)
    assert [leaf is None for leaf in meta_leaves] == [leaf is None for leaf in cpu_leaves]  # a cache's unset fields
    meta_leaves, cpu_leaves = [x for x in meta_leaves if x is not None], [x for x in cpu_leaves if x is not None]
    assert len(meta_leaves) == len(cpu_leaves) > 0
    for got, expected in zip(meta_leaves, cpu_leaves, strict=True):
        assert (got.device.type, got.shape, got.dtype) == ("meta", expected.shape, expected.dtype)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
@pytest.mark.parametrize("path", list(META_PATHS))
def test_forward_on_the_meta_device_gives_the_cpu_shapes_and_dtypes(path, grad):
    """A layer built with device="meta" (deferred initialization, FSDP2, shape inference) runs
    its forward pass on meta tensors: no autocast query for the meta device, no mask value read."""
    kwargs, args, options = META_PATHS[path]
    inputs = _meta_call_inputs(kdim=kwargs.get("kdim", 16), vdim=kwargs.get("vdim", 16))

    def run(layer, device):
        call = {name: inputs[value].to(device) if isinstance(value, str) else value for name, value in options.items()}
        with torch.set_grad_enabled(grad):
            return layer(*(inputs[name].to(device) for name in args), **call)

    cpu, meta = _meta_and_cpu(kwargs, run)
    _assert_like_cpu(meta, cpu)


META_DECODE_PATHS = {
    "lean_step": ({}, {}),
    "padded_prompt": ({}, {"keep": True}),
    "return_attention": ({}, {"return_attention": True}),
    "key_mask": ({}, {"key_mask": True}),
    "rolling_window": ({"window": 3}, {}),
    "gqa_rope_sinks": ({"num_kv_heads": 2, "rope_theta": 10000.0, "sinks": True}, {"return_attention": True}),
    "softcap_qk_norm": ({"softcap": 5.0, "qk_norm": "head"}, {"keep": True}),
}


@pytest.mark.parametrize("path", list(META_DECODE_PATHS))
def test_kv_cache_decoding_on_the_meta_device_gives_the_cpu_shapes_and_dtypes(path):
    """A prefill of 3 tokens then three steps of 1 into a cache of L = 5 (a window rolls it),
    with each call's output, weights and cache on meta shaped as on the CPU."""
    kwargs, options = META_DECODE_PATHS[path]
    inputs = _meta_call_inputs(t=6, s=6)
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[0, 0] = False  # a left-padded prompt
    steps = [(0, 3), (3, 4), (4, 5)] + ([(5, 6)] if "window" in kwargs else [])

    def run(layer, device):
        cache = layer.init_cache(2, 5, keep=keep if options.get("keep") else None)
        results = []
        with torch.no_grad():
            for start, stop in steps:
                key_mask = inputs["key_mask"][:, start:stop].to(device) if options.get("key_mask") else None
                result = layer(
                    inputs["query"][:, start:stop].to(device), causal=True, cache=cache, key_mask=key_mask,
                    return_attention=options.get("return_attention", False),
                )  # fmt: skip
                cache = result[-1]
                results.append(result)
        return results

    cpu, meta = _meta_and_cpu(kwargs, run)
    _assert_like_cpu(meta, cpu)
    assert meta[-1][-1].key.device.type == "meta"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_meta_forward_keeps_the_layers_low_precision_dtype(dtype):
    """A half-precision layer on meta returns its own dtype, as on the CPU."""
    layer = MultiHeadAttention(16, 4, device="meta", dtype=dtype)
    output, weights = layer(torch.empty(2, 5, 16, device="meta", dtype=dtype), causal=True, return_attention=True)
    assert (output.shape, output.dtype, weights.shape, weights.dtype) == ((2, 5, 16), dtype, (2, 4, 5, 5), dtype)
