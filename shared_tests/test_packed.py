"""Packed sequences (docs/SPEC.md, "Packed sequences"): a packed call with `segment_ids` equals
running each document alone, in every layer file and on every path (float64; the Keras file on
this process's backend), with causal, GQA, the window, sinks, soft-capping and RoPE at the
positions `document_positions` gives; with a key padding tail; in cross-attention with
`key_segment_ids`; and through a cache, a packed prefill then a decode step. The helpers agree
with each other in the four files."""

import importlib

import numpy as np
import pytest

E, N, K = 16, 4, 2
LENGTHS = ((3, 5, 4), (6, 2, 2))  # two rows of 12 tokens: the second ends in a padding tail of 2
PADDING = 2
VARIANTS = {
    "plain": {},
    "modifiers": {"softcap": 5.0, "window": 3, "sinks": True, "rope_theta": 10000.0},
}
PATHS = {
    "NumPy": ("eager",),
    "PyTorch": ("sdpa", "documents", "dense", "explicit", "inference", "softcap_tiles", "softcap_documents"),
    "TensorFlow": ("eager", "function", "memory_efficient"),
    "Keras": ("eager", "chunked"),
}
TORCH_PATCHES = {  # PyTorch paths: the blocks of documents one document a block, or the dense keep (docs/SPEC.md)
    "documents": {"_DOCUMENT_ROWS": 1},
    "softcap_documents": {"_DOCUMENT_ROWS": 1},
    "dense": {"_by_documents": lambda layer, call: False},
}
ATOL = {"NumPy": 1e-12, "PyTorch": 1e-12, "TensorFlow": 1e-12, "Keras": 1e-6}
ROPE_ATOL = {"TensorFlow": 1e-7}  # its RoPE angles are float32, whose vectorised sin and cos round by buffer place


def _module(framework):
    return importlib.import_module(framework)


def _layer(framework, variant, path="eager"):
    options = dict(VARIANTS[variant], num_kv_heads=K)
    if path in ("softcap_tiles", "softcap_documents"):
        options["softcap"] = 5.0
    module = _module(framework)
    if framework == "NumPy":
        return module.MultiHeadAttention(E, N, seed=0, **options)
    if framework == "PyTorch":
        import torch

        torch.manual_seed(0)
        return module.MultiHeadAttention(E, N, **options).double().eval()
    dtype = "float32" if framework == "Keras" else "float64"  # the Keras file in float32 (any backend)
    layer = module.MultiHeadAttention(E, N, dtype=dtype, **options)
    if path in ("memory_efficient", "chunked"):
        layer.memory_efficient_threshold = 0
    return layer


def _call(framework, layer, path, x, **kwargs):
    """The layer's output(s) as NumPy arrays, on `path`."""
    if framework == "PyTorch":
        import torch

        args = {k: torch.as_tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
        grad = path in ("explicit", "softcap_tiles", "softcap_documents")
        with torch.set_grad_enabled(grad):
            results = layer(torch.as_tensor(x), return_attention=path in ("explicit", "inference"), **args)
        return results[0].detach().numpy() if isinstance(results, tuple) else results.detach().numpy()
    if framework in ("TensorFlow", "Keras"):
        if framework == "Keras":
            x = x.astype(np.float32)
            kwargs = {k: v.astype(np.float32) if k == "key" else v for k, v in kwargs.items()}
        if path == "function":
            import tensorflow as tf

            return np.asarray(tf.function(lambda x: layer(x, **kwargs))(x))
        return _to_numpy(framework)(layer(x, **kwargs))
    return layer(x, **kwargs)


def _ids():
    rows = [np.repeat(np.arange(len(lengths)), lengths) for lengths in LENGTHS]
    rows[1] = np.concatenate([rows[1], np.full(PADDING, len(LENGTHS[1]))])  # padding: its own id, and key_mask
    return np.stack(rows)  # (B, T)


def _cases():
    for framework, paths in PATHS.items():
        for path in paths:
            for variant in VARIANTS:
                yield pytest.param(framework, path, variant, id=f"{framework}-{path}-{variant}")


def _patch_path(monkeypatch, framework, path):
    """The PyTorch file's constants and functions that `path` sets (`TORCH_PATCHES`)."""
    if framework == "PyTorch":
        for name, value in TORCH_PATCHES.get(path, {}).items():
            monkeypatch.setattr(importlib.import_module("PyTorch.Multi_Head_Attention"), name, value)


@pytest.mark.parametrize(("framework", "path", "variant"), list(_cases()))
def test_packed_equals_each_document_alone(monkeypatch, framework, path, variant):
    _patch_path(monkeypatch, framework, path)
    module = _module(framework)
    layer = _layer(framework, variant, path)
    ids = _ids()
    b, t = ids.shape
    x = np.random.default_rng(1).normal(size=(b, t, E))
    key_mask = np.ones((b, t), bool)
    key_mask[1, -PADDING:] = False
    rope = layer.rope_theta is not None
    positions = np.asarray(module.document_positions(ids))
    extra = {"positions": positions} if rope else {}
    packed = _call(framework, layer, path, x, segment_ids=ids, causal=True, key_mask=key_mask, **extra)
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            alone_extra = {"positions": np.arange(n)[None]} if rope else {}
            alone = _call(framework, layer, path, x[row : row + 1, start : start + n], causal=True, **alone_extra)
            atol = ROPE_ATOL.get(framework, ATOL[framework]) if rope else ATOL[framework]
            np.testing.assert_allclose(packed[row, start : start + n], alone[0], atol=atol, rtol=0)
            start += n


@pytest.mark.parametrize("framework", list(PATHS))
def test_packed_cross_attention(framework):
    """Cross-attention: query documents of lengths (2, 3) attend key documents of lengths (4, 1)."""
    layer = _layer(framework, "plain")
    rng = np.random.default_rng(2)
    q, kv = rng.normal(size=(1, 5, E)), rng.normal(size=(1, 5, E))
    q_ids, kv_ids = np.array([[0, 0, 1, 1, 1]]), np.array([[0, 0, 0, 0, 1]])
    packed = _call(framework, layer, "eager", q, key=kv, segment_ids=q_ids, key_segment_ids=kv_ids)
    first = _call(framework, layer, "eager", q[:, :2], key=kv[:, :4])
    second = _call(framework, layer, "eager", q[:, 2:], key=kv[:, 4:])
    np.testing.assert_allclose(packed, np.concatenate([first, second], 1), atol=ATOL[framework], rtol=0)


@pytest.mark.parametrize("framework", list(PATHS))
def test_packed_prefill_then_decode(framework):
    """A packed prompt prefills the cache (its `segment_ids` kept per slot), then a token decoded
    without ids continues the last document: it equals that document alone, then the token."""
    module = _module(framework)
    layer = _layer(framework, "modifiers")
    lengths = LENGTHS[0]
    ids = np.repeat(np.arange(3), lengths)[None]
    rng = np.random.default_rng(3)
    dtype = np.float32 if framework == "Keras" else np.float64
    x, y = rng.normal(size=(1, 12, E)).astype(dtype), rng.normal(size=(1, 1, E)).astype(dtype)
    convert = _converter(framework)
    cache = layer.init_cache(1, 14)
    positions = module.document_positions(convert(ids))
    _, cache = layer(convert(x), segment_ids=convert(ids), positions=positions, causal=True, cache=cache)
    np.testing.assert_array_equal(np.asarray(cache.segment_ids)[:, :12], ids)
    step = convert(np.array([[lengths[-1]]]))
    output, cache = layer(convert(y), positions=step, causal=True, cache=cache)
    last = np.concatenate([x[:, -lengths[-1] :], y], axis=1)
    alone = layer(convert(last), positions=convert(np.arange(lengths[-1] + 1)[None]), causal=True)
    to_numpy = _to_numpy(framework)
    atol = ROPE_ATOL.get(framework, ATOL[framework])
    np.testing.assert_allclose(to_numpy(output)[:, 0], to_numpy(alone)[:, -1], atol=atol, rtol=0)


def _converter(framework):
    if framework == "PyTorch":
        import torch

        return torch.as_tensor
    return lambda a: a


def _to_numpy(framework):
    if framework == "PyTorch":
        return lambda a: a.detach().numpy()
    if framework == "Keras":  # on torch a tensor that requires grad has no __array__
        import keras

        return keras.ops.convert_to_numpy
    return np.asarray


@pytest.mark.parametrize("framework", list(PATHS))
def test_helpers(framework):
    module = _module(framework)
    to_numpy = _to_numpy(framework) if framework != "PyTorch" else (lambda a: a.numpy())
    positions = np.array([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    expected = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    given = _converter(framework)(positions)
    np.testing.assert_array_equal(to_numpy(module.segment_ids_from_position_ids(given)), expected)
    np.testing.assert_array_equal(to_numpy(module.segment_ids_from_cu_seqlens(np.array([0, 3, 5, 9]))), expected)
    np.testing.assert_array_equal(to_numpy(module.document_positions(_converter(framework)(expected))), positions)
    with pytest.raises(ValueError, match="cu_seqlens"):
        module.segment_ids_from_cu_seqlens(np.array([1, 3]))


@pytest.mark.parametrize("framework", list(PATHS))
def test_same_errors(framework):
    """Floating ids, ids of another length and cross-attention without key ids: the same ValueError."""
    layer = _layer(framework, "plain")
    x = np.zeros((1, 4, E), np.float32 if framework == "Keras" else np.float64)
    x = _converter(framework)(x)
    messages = []
    for kwargs in (
        {"segment_ids": np.zeros((1, 4), np.float32)},
        {"segment_ids": np.zeros((1, 3), np.int64)},
        {"key": x[:, :3], "segment_ids": np.zeros((1, 4), np.int64)},
    ):
        with pytest.raises(ValueError) as raised:
            layer(x, **kwargs)
        messages.append(str(raised.value))
    expected = [
        "`segment_ids` must be an integer tensor of shape (B, T)=(1, 4).",
        "`segment_ids` must be an integer tensor of shape (B, T)=(1, 4).",
        "cross-attention (S != T) needs `key_segment_ids` (B, S) (packed sequences, docs/SPEC.md, 'Packed sequences')",
    ]  # Keras wraps them in its own message
    assert all(text in message for text, message in zip(expected, messages, strict=True)), messages


@pytest.mark.parametrize("rows", [1, 128])
def test_torch_document_blocks_equal_the_dense_keep(monkeypatch, rows):
    """The PyTorch file's blocks of documents (one document a block, or documents joined) against
    the dense keep: ids that come back later in a row, rows of other ids, the attention chunk, a
    two-sided window (without causal too), a float bias, sinks, soft-capping, GQA and MLA; the output and every gradient."""
    import torch

    torch_module = importlib.import_module("PyTorch.Multi_Head_Attention")
    monkeypatch.setattr(torch_module, "_DOCUMENT_ROWS", rows)
    ids = torch.tensor([[0, 0, 1, 1, 1, 0, 2, 2, 2, 1, 1, 3], [5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7]])
    rng = np.random.default_rng(4)
    x = torch.as_tensor(rng.normal(size=(2, 12, E)))
    bias = torch.as_tensor(rng.normal(size=(2, 1, 12, 12)))
    entered = []
    attend = torch_module._attend_documents
    monkeypatch.setattr(torch_module, "_attend_documents", lambda *a: entered.append(1) or attend(*a))
    cases = (
        ({"attention_chunk_size": 4, "window": (3, 2)}, True),
        ({"softcap": 5.0, "sinks": True, "window": 5}, True),
    )
    latent = {"kv_lora_rank": 6, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 3, "rope_theta": 1e2}
    for options, causal in (*cases, ({"window": (3, 2)}, False), (latent, True)):  # not causal: other alignments
        torch.manual_seed(0)
        layer = torch_module.MultiHeadAttention(E, N, num_kv_heads=K, **options).double()
        results = []
        for by_documents in (True, False):
            monkeypatch.setattr(torch_module, "_by_documents", lambda layer, call, on=by_documents: on)
            layer.zero_grad()
            query = x.clone().requires_grad_()
            output = layer(query, causal=causal, segment_ids=ids, attention_bias=bias)
            output.square().sum().backward()
            grads = [query.grad] + [p.grad for p in layer.parameters()]
            results.append([output.detach(), *grads])
        for blocked, dense in zip(*results, strict=True):
            np.testing.assert_allclose(blocked.numpy(), dense.numpy(), atol=ATOL["PyTorch"], rtol=0)
    assert len(entered) == 4


def test_torch_packed_backward_keeps_the_context_once(monkeypatch):
    """A PyTorch training call in blocks of documents (one document a block) keeps for its
    backward, besides its inputs and weights, only the q, k and v projections (each block's
    parts of them, read again when the block runs again in the backward) and the joined
    (B, T, N*H) context that the output projection reads: no block's output or log-sum-exp, no
    (B, 1, T, S) keep (docs/SPEC.md, "Packed sequences"). Key given apart: no fused q/k/v."""
    import torch

    torch_module = importlib.import_module("PyTorch.Multi_Head_Attention")
    monkeypatch.setattr(torch_module, "_DOCUMENT_ROWS", 1)
    torch.manual_seed(0)
    layer = torch_module.MultiHeadAttention(E, N, num_kv_heads=K)
    ids = torch.as_tensor(_ids())  # (B, T)
    x, key = torch.randn(*ids.shape, E, requires_grad=True), torch.randn(*ids.shape, E)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        output = layer(x, key, causal=True, segment_ids=ids)
    given = {t.untyped_storage().data_ptr() for t in (x, key, *layer.parameters())}
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    kept = sorted(nbytes for pointer, nbytes in kept.items() if pointer not in given)
    heads = ids.numel() * E * 4  # (B, T, N*H) float32: q, and the context
    assert kept == [heads * K // N] * 2 + [heads] * 2  # k and v, then q and the context
    output.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters())


def test_tensorflow_chunks_over_documents_equal_the_dense_mask(monkeypatch):
    """The TensorFlow file's memory-efficient path with `segment_ids`, each chunk of queries over
    the keys of its documents only (outside XLA) or over all keys with its own keep of the ids
    (under XLA), against the same path with the equivalent dense boolean mask: ids that come back
    later in a row, rows of other ids, chunks of 3 queries, the attention chunk, a two-sided
    window, a float bias with its gradient, sinks and soft-capping; the output and the gradients
    of the input and of every weight."""
    import tensorflow as tf

    module = _module("TensorFlow")
    tf_module = importlib.import_module("TensorFlow.Multi_Head_Attention")
    spans, key_spans = [], tf_module._key_spans
    monkeypatch.setattr(tf_module, "_key_spans", lambda *a: spans.append(1) or key_spans(*a))
    ids = np.array([[0, 0, 1, 1, 1, 0, 2, 2, 2, 1, 1, 3], [5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7]])
    rng = np.random.default_rng(5)
    x, bias = tf.constant(rng.normal(size=(2, 12, E))), tf.constant(rng.normal(size=(2, 1, 12, 12)))
    dense = ids[:, :, None] == ids[:, None, :]  # (B, T, S)
    options = {"attention_chunk_size": 4, "window": (3, 2), "sinks": True, "softcap": 5.0}
    layer = module.MultiHeadAttention(E, N, num_kv_heads=K, dtype="float64", **options)
    layer.memory_efficient_threshold, layer.query_chunk_elements = 0, 2 * N * 12 * 3  # chunks of 3 queries

    def run(packed, bias):
        with tf.GradientTape() as tape:
            tape.watch([x, bias])
            masks = {"segment_ids": ids} if packed else {"attention_mask": dense}
            output = layer(x, causal=True, attention_bias=bias, **masks)
            loss = tf.reduce_sum(tf.square(output))
        return [output, *tape.gradient(loss, [x, bias, *layer.trainable_weights])]

    expected = run(False, bias)
    for compiled, traced in ((tf.function(run), 1), (tf.function(run, jit_compile=True), 1)):
        for got, want in zip(compiled(True, bias), expected, strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL["TensorFlow"], rtol=0)
        assert len(spans) == traced  # the documents' key ranges traced outside XLA only
