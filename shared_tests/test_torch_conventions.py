"""Conventions that PyTorch's own tests check for nn.MultiheadAttention and SDPA, written for this
layer: `torch.autograd.gradcheck` in float64 (masks, fully masked rows, both code paths, causal,
grouped-query heads), and dropout in training mode equal to the built-in's under the same seed."""

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
