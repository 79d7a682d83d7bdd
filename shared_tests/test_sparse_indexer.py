"""The sparse indexer (DSA, docs/SPEC.md "Sparse indexer (DSA)") in the NumPy reference and the PyTorch
file: the same selection and output on every PyTorch path, decoding equal to the full pass, planted ties
broken by the lower key index, a sparse output that differs from the dense one, and the option errors."""

import numpy as np
import pytest
import torch

from NumPy.Multi_Head_Attention import MultiHeadAttention as NumpyAttention
from PyTorch.Multi_Head_Attention import MultiHeadAttention as TorchAttention

OUTPUT_TOLERANCE = 1e-5  # float32 against the float64 reference (docs/SPEC.md, "Tolerances")
DENSE_DIFFERENCE = 1e-3  # at least this far apart: k = 4 of 16 keys changes the output
E, T = 16, 16
OPTIONS = {
    "half_split": dict(
        num_heads=2, kv_lora_rank=8, q_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
        rope_theta=10000.0, index_topk=4, index_num_heads=2, index_head_dim=8,
    ),
    "interleaved": dict(
        num_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, rope_theta=10000.0,
        index_topk=4, index_num_heads=3, index_head_dim=6, index_rope_interleaved=True, bias=True,
    ),
}  # fmt: skip


def _pair(options, seed=0):
    reference = NumpyAttention(E, seed=seed, **options)
    layer = TorchAttention(E, **options)
    layer.import_weights(reference.export_weights())
    return reference, layer


def _inputs(seed=1):
    return np.random.default_rng(seed).normal(size=(2, T, E))


def _key_mask():
    keep = np.ones((2, T), dtype=bool)
    keep[1, :5] = False  # left padding
    return keep


@pytest.mark.parametrize(
    ("name", "path"),
    [(name, path) for name in sorted(OPTIONS) for path in ("masked", "gathered", "absorbed", "weights")]
    + [("half_split", "compiled")],  # torch.compile once (about 30 s)
)
def test_torch_selects_and_attends_as_the_reference(name, path):
    reference, layer = _pair(OPTIONS[name])
    x, keep = _inputs(), _key_mask()
    expected, expected_selection = reference(x, key_mask=keep, causal=True, return_topk=True)
    layer.sparse_gather_threshold = 0 if path == "gathered" else layer.sparse_gather_threshold
    layer.absorb_latents = True if path == "absorbed" else None
    call = torch.compile(layer, fullgraph=True) if path == "compiled" else layer
    results = call(
        torch.tensor(x, dtype=torch.float32), key_mask=torch.tensor(keep), causal=True, return_topk=True,
        return_attention=path == "weights",
    )  # fmt: skip
    output, selection = results[0], results[-1]
    assert np.array_equal(selection.numpy(), expected_selection)  # ranked alike, disallowed keys last by index
    np.testing.assert_allclose(output.detach().numpy(), expected, atol=OUTPUT_TOLERANCE)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_decoding_equals_the_full_pass(name):
    reference, layer = _pair(OPTIONS[name])
    x = _inputs()
    expected = reference(x, causal=True)
    cache, outputs = reference.init_cache(2, T), []
    torch_cache, torch_outputs = layer.init_cache(2, T), []
    with torch.no_grad():
        for first, stop in ((0, 5), *((t, t + 1) for t in range(5, T))):
            output, cache = reference(x[:, first:stop], causal=True, cache=cache)
            outputs.append(output)
            output, torch_cache = layer(
                torch.tensor(x[:, first:stop], dtype=torch.float32), causal=True, cache=torch_cache
            )
            torch_outputs.append(output.numpy())
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), expected, atol=1e-12)
    np.testing.assert_allclose(np.concatenate(torch_outputs, axis=1), expected, atol=OUTPUT_TOLERANCE)


@pytest.mark.parametrize("framework", ["NumPy", "PyTorch"])
def test_planted_ties_select_the_earliest_keys(framework):
    """Zero head weights make every score exactly 0: each row keeps its k earliest allowed keys."""
    reference, layer = _pair(OPTIONS["half_split"])
    reference.params["index_weights_kernel"][:] = 0.0
    with torch.no_grad():
        layer.index_weights.weight.zero_()
    x, keep = _inputs(), _key_mask()
    if framework == "NumPy":
        _, selection = reference(x, key_mask=keep, causal=True, return_topk=True)
    else:
        _, selection = layer(
            torch.tensor(x, dtype=torch.float32), key_mask=torch.tensor(keep), causal=True, return_topk=True
        )
        selection = selection.numpy()
    for b in range(2):
        for t in range(T):
            allowed = [s for s in range(T) if s <= t and keep[b, s]]
            disallowed = [s for s in range(T) if s not in allowed]
            assert list(selection[b, t]) == (allowed + disallowed)[:4]


def test_sparse_output_differs_from_dense_and_topk_indices_reproduce_it():
    reference, _ = _pair(OPTIONS["half_split"])
    dense = NumpyAttention(E, **{k: v for k, v in OPTIONS["half_split"].items() if not k.startswith("index")})
    dense.import_weights({k: v for k, v in reference.export_weights().items() if not k.startswith("index")})
    x = _inputs()
    sparse, selection = reference(x, causal=True, return_topk=True)
    assert np.abs(sparse - dense(x, causal=True)).max() > DENSE_DIFFERENCE
    np.testing.assert_allclose(dense(x, causal=True, topk_indices=selection), sparse, atol=1e-12)  # a shared layer
    np.testing.assert_allclose(
        dense(x, causal=True, topk_indices=np.arange(T)[None, None].repeat(2, 0).repeat(T, 1)),
        dense(x, causal=True),
        atol=1e-12,
    )


def test_no_gradient_reaches_the_indexer():
    reference, layer = _pair(OPTIONS["half_split"])
    x = _inputs()
    output = reference(x, causal=True)
    grads = reference.backward(np.ones_like(output))
    assert all(not grads[name].any() for name in grads if name.startswith("index_"))
    layer(torch.tensor(x, dtype=torch.float32), causal=True).sum().backward()
    assert layer.index_query.weight.grad is None and layer.key_value_b.weight.grad is not None


@pytest.mark.parametrize("layer_class", [NumpyAttention, TorchAttention])
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(index_topk=4, index_num_heads=2, index_head_dim=8), r"`index_topk` needs `kv_lora_rank`"),
        (
            dict(OPTIONS["half_split"], index_head_dim=None),
            r"`index_topk` needs `index_num_heads` and `index_head_dim`",
        ),
        (dict(index_num_heads=2), r"`index_num_heads` needs `index_topk` \(the sparse indexer\)"),
        (dict(OPTIONS["half_split"], index_head_dim=2), r"`index_head_dim` must be at least qk_rope_head_dim = 4"),
        (dict(OPTIONS["half_split"], index_topk=0), r"`index_topk` must be"),
    ],
)
def test_option_errors(layer_class, options, message):
    with pytest.raises(ValueError, match=message):
        layer_class(E, **{"num_heads": 2, **options})


@pytest.mark.parametrize("layer_class", [NumpyAttention, TorchAttention])
def test_return_topk_needs_a_selection(layer_class):
    layer = layer_class(E, 2)
    x = np.zeros((1, 3, E)) if layer_class is NumpyAttention else torch.zeros(1, 3, E)
    with pytest.raises(ValueError, match=r"`return_topk` needs `index_topk` or `topk_indices`"):
        layer(x, return_topk=True)
