"""PyTorch layer: interop with torch.nn.MultiheadAttention, fully masked rows, compile,
export, state_dict, dtypes, unbatched inputs, dropout, and the fast paths."""

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from PyTorch import Multi_Head_Attention, MultiHeadAttention
from shared_tests.cases import FLOAT64_TOLERANCES, TOLERANCES

OUTPUT_TOL = TOLERANCES["float32"]["output"]
WEIGHTS_TOL = TOLERANCES["float32"]["weights"]
HALF_UPSTREAM = 1e-3  # small upstream gradient: kernel gradients of inputs ~30 must not overflow float16 themselves


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _with_random_biases(layer):
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.copy_(_randn(*p.shape, seed=len(name)) * 0.1)
    return layer


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kdim_vdim", [None, (6, 10)], ids=["packed", "separate"])
@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_matches_builtin(batch_first, kdim_vdim, bias):
    kdim, vdim = kdim_vdim or (None, None)
    builtin = nn.MultiheadAttention(16, 4, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first).eval()
    _with_random_biases(builtin)
    layer = MultiHeadAttention.from_torch(builtin).eval()
    x, y, z = _randn(2, 5, 16, seed=1), _randn(2, 7, kdim or 16, seed=2), _randn(2, 7, vdim or 16, seed=3)
    padding = torch.ones(2, 7, dtype=torch.bool)
    padding[1, 5:] = False  # keys 5 and 6 of batch 1 are padding
    allowed = torch.rand(5, 7, generator=torch.Generator().manual_seed(4)) < 0.7
    allowed[:, 0] = True  # every row keeps a key: the built-in gives NaN otherwise
    # Translate: our True means "attend"; torch's key_padding_mask and boolean attn_mask mean "ignore".
    ours_mask = allowed[None, None] & padding[:, None, None, :]
    args = (x, y, z) if batch_first else (x.transpose(0, 1), y.transpose(0, 1), z.transpose(0, 1))
    expected, expected_w = builtin(*args, key_padding_mask=~padding, attn_mask=~allowed, average_attn_weights=False)
    expected = expected if batch_first else expected.transpose(0, 1)
    output, weights = layer(x, y, z, attention_mask=ours_mask, return_attention=True)
    torch.testing.assert_close(output, expected, atol=OUTPUT_TOL, rtol=0)
    torch.testing.assert_close(weights, expected_w, atol=WEIGHTS_TOL, rtol=0)
    torch.testing.assert_close(layer(x, y, z, attention_mask=ours_mask), expected, atol=OUTPUT_TOL, rtol=0)


def test_causal_matches_builtin_with_an_explicit_mask():
    layer = _with_random_biases(MultiHeadAttention(16, 4)).eval()
    builtin = layer.to_torch().eval()
    x = _randn(2, 6, 16, seed=5)
    upper = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)  # torch: True = ignore
    expected, expected_w = builtin(x, x, x, attn_mask=upper, average_attn_weights=False)
    output, weights = layer(x, causal=True, return_attention=True)
    torch.testing.assert_close(output, expected, atol=OUTPUT_TOL, rtol=0)
    torch.testing.assert_close(weights, expected_w, atol=WEIGHTS_TOL, rtol=0)
    torch.testing.assert_close(layer(x, causal=True), expected, atol=OUTPUT_TOL, rtol=0)


@pytest.mark.parametrize("kdim", [None, 6])
def test_to_torch_round_trip(kdim):
    layer = _with_random_biases(MultiHeadAttention(16, 4, kdim=kdim, vdim=kdim, dropout=0.1))
    builtin = layer.to_torch()
    assert builtin.batch_first and builtin.dropout == 0.1 and builtin._qkv_same_embed_dim == (kdim is None)
    back = MultiHeadAttention.from_torch(builtin)
    for name, value in layer.export_weights().items():
        np.testing.assert_array_equal(back.export_weights()[name], value)


def test_from_torch_refuses_appended_keys():
    for kwargs in ({"add_bias_kv": True}, {"add_zero_attn": True}):
        with pytest.raises(
            ValueError, match=r"add_bias_kv or add_zero_attn.*Received: add_bias_kv=\w+, add_zero_attn=\w+"
        ):
            MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, **kwargs))
    with pytest.raises(ValueError, match=r"`module` must be a torch.nn.MultiheadAttention\. Received: Linear"):
        MultiHeadAttention.from_torch(nn.Linear(2, 2))


def test_to_torch_refuses_what_the_builtin_cannot_hold():
    with pytest.raises(ValueError, match=r"cannot hold grouped-query attention.*num_heads=4, num_kv_heads=2"):
        MultiHeadAttention(16, 4, num_kv_heads=2).to_torch()
    with pytest.raises(
        ValueError, match=r"needs num_heads \* head_dim == d_model\. Received: d_model=16, num_heads=4, head_dim=3"
    ):
        MultiHeadAttention(16, 4, head_dim=3).to_torch()


def test_regression_builtin_nan_on_fully_masked_row_is_zero_here():
    """nn.MultiheadAttention returns NaN for a query row whose keys are all masked; here the
    row gives weights 0, output = output bias, and finite gradients, on both paths."""
    layer = _with_random_biases(MultiHeadAttention(16, 4))
    x = _randn(2, 4, 16, seed=6)
    keep = torch.ones(2, 4, 4, dtype=torch.bool)
    keep[0, 2] = False  # query 2 of batch 0 keeps no key
    keep[1] = False  # batch 1 keeps nothing at all
    builtin_out, _ = layer.to_torch()(x, x, x, attn_mask=~keep.repeat_interleave(4, 0))
    assert torch.isnan(builtin_out).any()  # the bug this layer exists to avoid
    for return_attention in (False, True):
        xg = x.clone().requires_grad_()
        layer.zero_grad()
        result = layer(xg, attention_mask=keep, return_attention=return_attention)
        output = result[0] if return_attention else result
        torch.testing.assert_close(output[0, 2], layer.output.bias.detach(), atol=0, rtol=0)
        torch.testing.assert_close(output[1], layer.output.bias.detach().expand(4, 16), atol=0, rtol=0)
        if return_attention:
            assert (result[1][0, :, 2] == 0).all() and (result[1][1] == 0).all()
        output.square().sum().backward()
        assert torch.isfinite(xg.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("return_attention", [False, True])
def test_fully_masked_rows_have_finite_gradients_in_half_precision(dtype, return_attention):
    layer = MultiHeadAttention(16, 4, dtype=dtype)
    x = (_randn(2, 4, 16, seed=20) * 30).to(dtype).requires_grad_()
    keep = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    keep[0, 0, 1] = False
    keep[1] = False
    result = layer(x, attention_mask=keep, return_attention=return_attention)
    output = result[0] if return_attention else result
    assert torch.isfinite(output).all()
    (output.float() * HALF_UPSTREAM).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_sdpa_never_receives_a_fully_masked_row(monkeypatch):
    """What a kernel makes of a row whose keys are all masked differs (NaN in some, an
    overflow of the finite fill to -inf in half precision in others), so such rows attend to
    every key inside scaled_dot_product_attention and are zeroed afterwards."""
    import PyTorch.Multi_Head_Attention as torch_file

    masks = []

    def spy(q, k, v, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    real_sdpa = torch_file.F.scaled_dot_product_attention
    monkeypatch.setattr(torch_file.F, "scaled_dot_product_attention", spy)
    layer = MultiHeadAttention(16, 4)
    keep = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    keep[0, 0, 1] = False
    keep[1] = False
    output = layer(_randn(2, 4, 16, seed=21), attention_mask=keep)
    (mask,) = masks
    assert (mask.expand(2, 4, 4, 4).max(dim=-1).values > torch.finfo(mask.dtype).min).all()
    torch.testing.assert_close(output[1], layer.output.bias.detach().expand(4, 16), atol=0, rtol=0)


def test_large_negative_float_mask_removes_the_key_and_keeps_rows_finite():
    layer = MultiHeadAttention(8, 2)
    x = _randn(1, 3, 8, seed=7)
    mask = torch.zeros(3, 3)
    mask[:, 1] = -1e9
    _, weights = layer(x, attention_mask=mask, return_attention=True)
    assert (weights[..., 1] == 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 2, 3))


def test_fused_projection_equals_separate_projections():
    layer = _with_random_biases(MultiHeadAttention(16, 4, num_kv_heads=2))
    x = _randn(2, 5, 16, seed=8)
    for return_attention in (False, True):
        fused = layer(x, return_attention=return_attention)
        separate = layer(x, x.clone(), x.clone(), return_attention=return_attention)
        torch.testing.assert_close(fused, separate, atol=OUTPUT_TOL, rtol=0)


def test_unbatched_inputs_give_unbatched_results():
    layer = MultiHeadAttention(8, 2)
    x, y = _randn(3, 8, seed=9), _randn(5, 8, seed=10)
    output, weights = layer(x, y, return_attention=True)
    assert output.shape == (3, 8) and weights.shape == (2, 3, 5)
    torch.testing.assert_close(output, layer(x[None], y[None], return_attention=True)[0][0], atol=0, rtol=0)
    torch.testing.assert_close(layer(x, y), layer(x[None], y[None])[0], atol=0, rtol=0)


def test_state_dict_round_trip_with_weights_only(tmp_path):
    layer = _with_random_biases(MultiHeadAttention(16, 4, num_kv_heads=1))
    assert sorted(layer.state_dict()) == sorted(
        f"{k}.{p}" for k in ("query", "key", "value", "output") for p in ("weight", "bias")
    )
    torch.save(layer.state_dict(), tmp_path / "mha.pt")
    other = MultiHeadAttention(16, 4, num_kv_heads=1)
    other.load_state_dict(torch.load(tmp_path / "mha.pt", weights_only=True))
    x = _randn(2, 3, 16, seed=11)
    torch.testing.assert_close(other(x), layer(x), atol=0, rtol=0)
    np.testing.assert_array_equal(other.export_weights()["query_kernel"], layer.query.weight.detach().T.numpy())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_dtype_round_trip(dtype):
    torch.manual_seed(0)  # the same weights whatever ran before: the tolerances are absolute
    layer = _with_random_biases(MultiHeadAttention(16, 4))
    x = _randn(2, 5, 16, seed=12)
    expected = layer(x, causal=True)
    low = MultiHeadAttention(16, 4, dtype=dtype)
    low.import_weights(layer.export_weights())
    # float64 is compared with the float32 layer, so the float32 tolerance applies
    spec_dtype = {torch.float64: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    tol = TOLERANCES[spec_dtype]["output"]
    for return_attention in (False, True):
        result = low(x.to(dtype), causal=True, return_attention=return_attention)
        output = result[0] if return_attention else result
        assert output.dtype == dtype
        torch.testing.assert_close(output.float(), expected, atol=tol, rtol=0)
    assert {a.dtype for a in low.export_weights().values()} == {
        np.dtype(np.float32 if dtype == torch.bfloat16 else str(dtype)[6:])
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_regression_input_dtype_other_than_the_layers_is_a_value_error(dtype):
    """A float64 or bfloat16 input into a float32 layer failed inside the first matmul with
    "RuntimeError: mat1 and mat2 must have the same dtype"; autocast still decides the dtype."""
    layer = MultiHeadAttention(16, 4)
    x = _randn(2, 5, 16, seed=3).to(dtype)
    message = (
        rf"`query`, `key` and `value` must have the layer's dtype float32: .* Received: query\.dtype={str(dtype)[6:]}"
    )
    with pytest.raises(ValueError, match=message):
        layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x.float()).dtype == torch.bfloat16


def test_dropout_only_in_training_and_weights_before_dropout():
    layer = MultiHeadAttention(16, 4, dropout=0.5)
    x = _randn(2, 6, 16, seed=13)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    _, weights = layer(x, return_attention=True)
    layer.train()
    torch.manual_seed(0)
    first, train_weights = layer(x, return_attention=True)
    assert not torch.equal(first, layer(x, return_attention=True)[0])
    torch.testing.assert_close(train_weights, weights, atol=0, rtol=0)  # before dropout
    assert not torch.equal(layer(x), layer(x))  # the fast path drops too


@pytest.mark.parametrize(
    ("backend", "return_attention"),
    [("aot_eager", False), ("aot_eager", True), ("inductor", False)],
)
def test_compile_fullgraph_forward_and_backward(backend, return_attention):
    layer = _with_random_biases(MultiHeadAttention(16, 4, num_kv_heads=2))
    x, y = _randn(2, 5, 16, seed=14), _randn(2, 7, 16, seed=15)
    keep = torch.rand(2, 1, 7, generator=torch.Generator().manual_seed(16)) < 0.7
    keep[1] = False

    def step(x, y, keep):
        result = layer(x, y, attention_mask=keep, causal=True, return_attention=return_attention)
        return result[0] if return_attention else result

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    expected = step(x, y, keep)
    got = compiled(x, y, keep)
    torch.testing.assert_close(got, expected, atol=OUTPUT_TOL, rtol=0)
    got.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_torch_export():
    layer = _with_random_biases(MultiHeadAttention(16, 4)).eval()
    x, keep = _randn(2, 5, 16, seed=17), torch.ones(2, 1, 5, dtype=torch.bool)
    keep[1, 0, 3:] = False

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = layer

        def forward(self, x, keep):
            return self.attention(x, attention_mask=keep, causal=True)

    program = torch.export.export(Wrapped(), (x, keep))
    torch.testing.assert_close(program.module()(x, keep), layer(x, attention_mask=keep, causal=True), atol=0, rtol=0)


def test_device_and_dtype_arguments_and_repr():
    layer = MultiHeadAttention(16, 4, num_kv_heads=2, device="cpu", dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in layer.parameters())
    assert "num_kv_heads=2" in repr(layer)


@pytest.mark.parametrize("block_scores", [1 << 21, 1, 2 * 4 * 5 * 7])  # one block; 1 per batch element; 2, 2, 1
def test_return_attention_under_no_grad_works_in_place_with_the_same_numbers(monkeypatch, block_scores):
    """Under no_grad, `return_attention=True` writes the scores into the weights and softmaxes
    them in place, a block of batch elements at a time (as the built-in's inference kernel, in
    one buffer); the numbers are those of the autograd path, masks with a batch dimension too.
    H = 4: the scale 1/2 is exact, so both paths agree bit for bit."""
    monkeypatch.setattr(Multi_Head_Attention, "_BLOCK_SCORES", block_scores)
    layer = _with_random_biases(MultiHeadAttention(16, 4, num_kv_heads=2)).eval()
    x, y = _randn(5, 5, 16, seed=11), _randn(5, 7, 16, seed=12)
    keep = torch.rand(5, 1, 5, 7, generator=torch.Generator().manual_seed(13)) < 0.6
    keep[0, 0, 1] = False  # a row with no key
    bias = torch.where(keep, _randn(5, 4, 5, 7, seed=14), -torch.inf)  # per batch element and head
    for mask in (keep, bias):
        with_grad = layer(x, y, attention_mask=mask, causal=True, return_attention=True)
        with torch.no_grad():
            without = layer(x, y, attention_mask=mask, causal=True, return_attention=True)
        for a, b in zip(with_grad, without, strict=True):
            assert torch.equal(a.detach(), b)
        assert (without[1][0, :, 1] == 0).all()


def test_regression_gqa_traces_with_torch_jit_trace():
    """Traced shapes are tensors (torch.jit.trace, the legacy torch.onnx exporter), and SDPA's
    `enable_gqa` refused the tensor that `q.shape[1] != k.shape[1]` then gives."""
    layer = MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    x, keep = _randn(2, 5, 16, seed=14), torch.ones(2, 1, 5, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about Python values
        traced = torch.jit.trace(layer, (x, x, x, keep))
    torch.testing.assert_close(traced(x, x, x, keep), layer(x, x, x, keep), atol=OUTPUT_TOL, rtol=0)


@pytest.mark.parametrize(
    ("device", "dtype", "masked", "native"),
    [
        ("cpu", torch.float32, True, True),  # the CPU flash kernel reads grouped heads, masks too
        ("meta", torch.bfloat16, False, True),  # meta stands for cuda: flash takes bfloat16 without a mask
        ("meta", torch.float16, False, True),
        ("meta", torch.bfloat16, True, False),  # flash takes no mask
        ("meta", torch.float32, False, False),  # nor float32
    ],
)
def test_sdpa_reads_grouped_heads_only_where_a_flash_kernel_can(device, dtype, masked, native):
    """Regression: on CUDA, `enable_gqa` with a mask or in float32 sent SDPA to its math kernel
    (measured on an H100: GQA float32 forward 4.9 GiB and 10.5 ms, more than returning the
    weights), so k and v are repeated to N heads there and the memory-efficient kernel runs."""
    q = torch.empty(2, 8, 3, 16, device=device, dtype=dtype)
    kv = torch.empty(2, 2, 5, 16, device=device, dtype=dtype)
    k, v, gqa = Multi_Head_Attention._sdpa_heads(q, kv, kv, masked)
    assert gqa == native
    assert k.shape[1] == v.shape[1] == (2 if native else 8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_scores_stay_in_their_dtype_with_float32_numbers(monkeypatch, dtype):
    """Without a float mask, float16 and bfloat16 scores are not copied to float32 (half the
    (B, N, T, S) memory; measured on an H100: bfloat16 weights 2.1x faster, 2.9x less memory),
    and the weights are those of a float32 softmax to within one rounding step of the dtype."""
    layer = _with_random_biases(MultiHeadAttention(16, 4, num_kv_heads=2, dtype=dtype)).eval()
    x = (_randn(3, 6, 16, seed=21) * 3).to(dtype)
    keep = torch.rand(3, 1, 6, 6, generator=torch.Generator().manual_seed(22)) < 0.7
    assert Multi_Head_Attention._softmax_dtype(dtype, None) == dtype
    with torch.no_grad():
        _, weights = layer(x, attention_mask=keep, causal=True, return_attention=True)
        monkeypatch.setattr(Multi_Head_Attention, "_softmax_dtype", lambda d, *masks: torch.float32)
        _, float32_weights = layer(x, attention_mask=keep, causal=True, return_attention=True)
    assert weights.dtype == float32_weights.dtype == dtype
    torch.testing.assert_close(weights.float(), float32_weights.float(), atol=torch.finfo(dtype).eps, rtol=0)


# -- the decode step -------------------------------------------------------------------------------

DECODE_CHUNKS = {"steps": (1,) * 7, "prefill_then_steps": (4, 1, 1, 1), "chunks": (3, 2, 2)}


def _decode_chunks(layer, x, chunks, **call):
    """Decodes x in `chunks` into a cache of 10 slots with the first slot of batch row 1 padded."""
    keep = torch.ones(x.shape[0], 10, dtype=torch.bool)
    keep[1, 0] = False
    cache, outputs, start = layer.init_cache(x.shape[0], 10, keep=keep), [], 0
    with torch.no_grad():
        for size in chunks:
            *results, cache = layer(x[:, start : start + size], causal=True, cache=cache, **call)
            outputs.append(results[0])
            start += size
    return torch.cat(outputs, 1), cache


@pytest.mark.parametrize("chunks", DECODE_CHUNKS.values(), ids=DECODE_CHUNKS.keys())
def test_lean_decode_step_equals_the_step_over_all_slots(chunks):
    """Without masks an eager step attends the first index + T slots; with `return_attention` it
    attends all L slots through the (B, 1, T, L) keep. Both give the full causal pass."""
    layer = _with_random_biases(MultiHeadAttention(16, 4, num_kv_heads=2)).eval()
    x = _randn(2, 7, 16, seed=21)
    lean, lean_cache = _decode_chunks(layer, x, chunks)
    over_all, all_cache = _decode_chunks(layer, x, chunks, return_attention=True)
    torch.testing.assert_close(lean, over_all, atol=OUTPUT_TOL, rtol=0)
    torch.testing.assert_close(lean_cache.key, all_cache.key, atol=0, rtol=0)
    assert torch.equal(lean_cache.keep, all_cache.keep) and int(lean_cache.index) == int(all_cache.index) == 7
    keep = torch.ones(2, 1, 7, dtype=torch.bool)
    keep[1, 0, 0] = False
    with torch.no_grad():
        full = layer(x, attention_mask=keep, causal=True)
    torch.testing.assert_close(lean, full, atol=OUTPUT_TOL, rtol=0)


def test_lean_decode_step_skips_the_slot_keep_and_keeps_the_concatenated_kernels(monkeypatch):
    """A step without masks builds no (B, 1, T, L) keep and concatenates the q, k, v kernels once
    for all steps (work that cannot change between steps); a step with a mask still uses the keep."""
    layer = MultiHeadAttention(16, 4).eval()
    x = _randn(2, 7, 16, seed=22)
    calls = []
    real_keep, real_cat = Multi_Head_Attention._cache_keep, torch.cat
    monkeypatch.setattr(Multi_Head_Attention, "_cache_keep", lambda *a: calls.append("keep") or real_keep(*a))
    monkeypatch.setattr(torch, "cat", lambda *a, **k: calls.append("cat") or real_cat(*a, **k))
    _decode_chunks(layer, x, (4, 1, 1))
    assert calls == ["cat", "cat", "cat"]  # the kernels and biases at the first step only; the outputs
    cache = layer.init_cache(2, 10)
    with torch.no_grad():
        layer(x[:, :1], attention_mask=torch.ones(1, 10, dtype=torch.bool), cache=cache)
    assert calls == ["cat", "cat", "cat", "keep"]


def test_decode_step_reads_no_value_of_a_cache_it_checked(monkeypatch):
    """`init_cache` checks its keep and index once and each step carries its new index: a step
    reads no tensor value (a device sync on a GPU). A keep written in place is read again."""
    layer = MultiHeadAttention(16, 4).eval()
    x = _randn(2, 6, 16, seed=23)
    reads = []
    for name in ("all", "item", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, real=real, name=name: reads.append(name) or real(self, *a)
        )
    cache = layer.init_cache(2, 6)
    reads.clear()
    with torch.no_grad():
        for t in range(5):
            _, cache = layer(x[:, t : t + 1], causal=True, cache=cache)
        assert reads == []
        cache.keep[0, 0] = False
        output, cache = layer(x[:, 5:], causal=True, cache=cache)
    assert "all" in reads
    monkeypatch.undo()
    with torch.no_grad():
        full = layer(x, attention_mask=cache.keep[:, None, :], causal=True)
    torch.testing.assert_close(output, full[:, 5:], atol=OUTPUT_TOL, rtol=0)


def test_kept_kernels_follow_a_change_of_the_weights():
    """The concatenated q/k/v kernels kept for decode steps are made again when a weight is
    written in place (an optimizer step), replaced or cast."""
    layer = MultiHeadAttention(16, 4).eval()
    x = _randn(2, 5, 16, seed=24)

    def step_and_full():
        dtype = layer.query.weight.dtype
        with torch.no_grad():
            _, cache = layer(x[:, :4].to(dtype), causal=True, cache=layer.init_cache(2, 5))
            step = layer(x[:, 4:].to(dtype), causal=True, cache=cache)[0]
            return step, layer(x.to(dtype), causal=True)[:, 4:]

    changes = (
        (lambda: layer.query.weight.add_(0.5), True),
        (lambda: setattr(layer.value, "weight", nn.Parameter(layer.value.weight * 2)), True),
        (lambda: layer.double(), False),  # the same numbers in float64: a float32 copy would fail the matmul
    )
    for change, moves in changes:
        before = step_and_full()[0]
        with torch.no_grad():
            change()
        step, full = step_and_full()
        assert step.dtype == full.dtype and torch.allclose(step.float(), before, atol=1e-3) != moves
        torch.testing.assert_close(step, full, atol=OUTPUT_TOL, rtol=0)


class _Recorded(nn.Module):
    """A wrapper that records its calls (as a LoRA wrapper would be called)."""

    def __init__(self, inner, seen):
        super().__init__()
        self.inner, self.seen = inner, seen

    def forward(self, x):
        self.seen.append(self)
        return self.inner(x)


def _change_after_kept(layer, change, seen):
    """Hooks or replaces a projection of a layer that keeps its kernels; returns what undoes it."""
    record = lambda *args: seen.append(args[0])  # noqa: E731
    if change == "own_hook":
        return layer.key.register_forward_pre_hook(record).remove
    if change == "global_hook":
        return nn.modules.module.register_module_forward_hook(record).remove
    layer.value = _Recorded(layer.value, seen)
    return lambda: None


@pytest.mark.parametrize("change", ["own_hook", "global_hook", "replaced"])
def test_decode_fast_path_calls_a_projection_hooked_or_replaced_after_its_kernels_were_kept(change):
    """Regression guard for the decode fast path (`_decode_step`), which reads the kept kernels:
    a hook added, or a projection replaced, after a step that kept them is called by the next step."""
    layer = MultiHeadAttention(16, 4).eval()
    x = _randn(2, 6, 16, seed=25)
    seen = []
    with torch.no_grad():
        _, cache = layer(x[:, :4], causal=True, cache=layer.init_cache(2, 6))
        _, cache = layer(x[:, 4:5], causal=True, cache=cache)  # the fast path, the kernels kept
        undo = _change_after_kept(layer, change, seen)
        try:
            layer(x[:, 5:], causal=True, cache=cache)
        finally:
            undo()
    assert [
        module for module in seen if module is not layer
    ]  # a projection was called (a global hook sees the layer too)


def test_decode_fast_path_steps_aside_under_autocast():
    """Regression guard for the decode fast path, which reads autocast on any device
    (`torch._C._is_any_autocast_enabled`): after a step that took it, a step under CPU autocast
    goes the general way, whose check refuses the float32 cache for the bfloat16 compute dtype."""
    layer = MultiHeadAttention(16, 4).eval()
    x = _randn(2, 6, 16, seed=26)
    with torch.no_grad():
        _, cache = layer(x[:, :4], causal=True, cache=layer.init_cache(2, 6))
        _, cache = layer(x[:, 4:5], causal=True, cache=cache)  # the fast path, the kernels kept
        pattern = r"^`cache` must hold the layer's compute dtype bfloat16; make it with `init_cache\(\.\.\., dtype=\.\.\.\)`\. Received: cache\.key\.dtype=float32"
        with pytest.raises(ValueError, match=pattern), torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x[:, 5:], causal=True, cache=cache)


def test_init_cache_under_autocast_holds_the_autocast_dtype():
    """Regression: under autocast `init_cache` made float32 keys and values, which the same layer
    then refused (its compute dtype is autocast's). It now defaults to autocast's dtype, and the
    refusal of another dtype says how to make the right one."""
    layer = MultiHeadAttention(16, 4).eval()
    x = _randn(2, 5, 16, seed=27)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = layer.init_cache(2, 8)
        assert cache.key.dtype == cache.value.dtype == torch.bfloat16
        output, cache = layer(x, causal=True, cache=cache)
        assert output.dtype == torch.bfloat16
        pattern = r"compute dtype bfloat16; make it with `init_cache\(\.\.\., dtype=\.\.\.\)`"
        with pytest.raises(ValueError, match=pattern):
            layer(x[:, :1], causal=True, cache=layer.init_cache(2, 8, dtype=torch.float32))
    assert layer.init_cache(2, 8).key.dtype == torch.float32  # outside autocast: the parameters' dtype


def test_lean_decode_step_refuses_a_full_cache_and_writes_nothing():
    layer = MultiHeadAttention(16, 4).eval()
    cache = layer.init_cache(2, 5)
    with torch.no_grad():
        _, cache = layer(_randn(2, 4, 16), cache=cache)
        written = cache.key.clone()
        with pytest.raises(ValueError, match=r"^`cache` is full: .*Received: index=4, T=2, L=5$"):
            layer(_randn(2, 2, 16, seed=1), cache=cache)
    assert torch.equal(cache.key, written) and int(cache.index) == 4


FLOAT64_TOL = FLOAT64_TOLERANCES["plain"]["output"]


def _float64_pair(**config):
    """A NumPy reference and a float64 PyTorch layer with its weights."""
    from NumPy import MultiHeadAttention as NumpyMultiHeadAttention

    reference = NumpyMultiHeadAttention(**config, seed=0)
    layer = MultiHeadAttention(**config, dtype=torch.float64)
    layer.import_weights(reference.export_weights())
    return reference, layer


@pytest.mark.parametrize("given", ["key_and_value", "key", "value"])
def test_d04_key_and_value_given_as_the_query_is_not_self_attention(given):
    """Regression D4: `layer(x, key=x, value=x, query_mask=m)` was read as self-attention (the
    same tensor), so `key_mask` defaulted to `query_mask`. Self-attention is defined by the call:
    key and value both left out (docs/SPEC.md, Call); key or value given, the keys are not masked."""
    reference, layer = _float64_pair(d_model=4, num_heads=1)
    x = np.random.default_rng(0).normal(size=(1, 3, 4))  # (B, T, E)
    keep = np.array([[True, False, True]])  # (B, T)
    inputs = {"key_and_value": {"key": x, "value": x}, "key": {"key": x}, "value": {"value": x}}[given]
    want = reference(x, **inputs, query_mask=keep)
    xt = torch.tensor(x)
    got = layer(xt, **{name: xt for name in inputs}, query_mask=torch.tensor(keep))
    np.testing.assert_allclose(got.detach().numpy(), want, atol=FLOAT64_TOL, rtol=0)
    self_attention = layer(xt, query_mask=torch.tensor(keep))  # here key_mask defaults to query_mask
    np.testing.assert_allclose(self_attention.detach().numpy(), reference(x, query_mask=keep), atol=FLOAT64_TOL, rtol=0)
    assert not np.allclose(self_attention.detach().numpy(), want)


@pytest.mark.parametrize("name", ["attention_bias", "attention_mask"])
@pytest.mark.parametrize(
    "options",
    [{"causal": True}, {"key_mask": np.ones((1, 0), bool)}, {"window": 2}, {"causal": True, "window": 1}],
    ids=["causal", "key_mask", "window", "causal_window"],
)
@pytest.mark.parametrize("return_attention", [False, True])
def test_d05_no_keys_with_a_broadcast_float_mask(name, options, return_attention):
    """Regression D5: with S = 0, a (T, 1) floating mask or bias plus causal, a window or a
    key_mask raised IndexError in `_centre_rows` (a (T, 1) bias broadcast over no key). No query
    has a key: the output is `output_bias`, the weights (B, N, T, 0)."""
    options = dict(options)
    window = options.pop("window", None)
    _, layer = _float64_pair(d_model=4, num_heads=1, window=window)
    with torch.no_grad():
        layer.output.bias.copy_(torch.arange(4.0))
    call = {
        name: torch.zeros(2, 1, dtype=torch.float64),
        **{k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in options.items()},
    }
    result = layer(torch.ones(1, 2, 4, dtype=torch.float64), key=torch.ones(1, 0, 4, dtype=torch.float64),
                   **call, return_attention=return_attention)  # fmt: skip
    output = result[0] if return_attention else result
    assert torch.equal(output, torch.arange(4.0, dtype=torch.float64).expand(1, 2, 4))
    if return_attention:
        assert result[1].shape == (1, 1, 2, 0)
