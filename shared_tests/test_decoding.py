"""KV-cache decoding: every decode case in parity on every path and against one full pass,
the same errors in all three files, static graphs (torch.compile, tf.function, XLA), the cache
as a tf.while_loop variable, Keras implicit masks, and mutations the report must catch."""

import re

import numpy as np
import pytest
import torch

import NumPy.Multi_Head_Attention as numpy_file
import PyTorch.Multi_Head_Attention as torch_file
from NumPy import MultiHeadAttention as NumpyMultiHeadAttention
from PyTorch import MultiHeadAttention as TorchMultiHeadAttention
from shared_tests import parity
from shared_tests.calling import not_implemented
from shared_tests.cases import TOLERANCES
from shared_tests.decoding import DECODE_CASES, DECODE_CASES_BY_NAME, INDEX_DECODE_CASES, MLA_DECODE_CASES

OUTPUT_TOL = TOLERANCES["float32"]["output"]
rng = np.random.default_rng(0)
X = rng.normal(size=(2, 7, 8)).astype(np.float32)  # (B, P, E) with E = 8
KEEP = np.ones((2, 10), dtype=bool)  # (B, L)
KEEP[1, :3] = False  # the second prompt is left-padded by 3


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.name)
def test_decode_case_in_parity(case):
    row, results = parity.run_decode_case(case)
    assert row.passed, row.failures
    assert row.zeros
    assert all(np.isfinite(r.output).all() for r in results.values())
    assert all(int(r.cache["index"]) == case.p for r in results.values())


@pytest.mark.parametrize("case", MLA_DECODE_CASES, ids=lambda c: c.name)
def test_mla_decode_case_in_parity(case):
    """The latent cache on every path whose file has MLA (the others listed as not implemented),
    absorbed and expanded, against the full pass and the NumPy oracle's cache."""
    row, results = parity.run_decode_case(case)
    assert row.passed, row.failures
    assert row.zeros
    assert set(row.skipped) == {path for path in parity.DECODE_PATHS if not_implemented(case, path)}
    assert {"numpy", "torch:sdpa", "torch:explicit"} <= set(results)
    assert all(r.cache["key"].shape[1:] == (1, case.length, 8) for r in results.values())  # (B, 1, L, C)
    assert all(int(r.cache["index"]) == case.p for r in results.values())


@pytest.mark.parametrize("case", INDEX_DECODE_CASES, ids=lambda c: c.name)
def test_index_decode_case_in_parity(case):
    """The indexer's key cache on every decode path, absorbed and expanded, against the full pass
    and the NumPy oracle (the torch:sdpa path through the gathered route)."""
    row, results = parity.run_decode_case(case)
    assert row.passed, row.failures
    assert row.zeros
    assert set(results) == set(parity.DECODE_PATHS)
    assert all(int(r.cache["index"]) == case.p for r in results.values())


def test_mla_decode_table_covers_the_issue():
    cases = MLA_DECODE_CASES
    assert any(c.padding for c in cases) and any(c.length < c.p and "window" in dict(c.variants) for c in cases)
    assert any(c.cross for c in cases) and {c.absorb for c in cases} == {None, False}
    assert any("q_lora_rank" in dict(c.variants) for c in cases) and any(c.k == 2 for c in cases)


def test_decode_table_covers_the_issue():
    cases = DECODE_CASES
    assert any(c.chunks == (c.p,) for c in cases) and any(set(c.chunks) == {1} for c in cases)
    assert any(c.chunks[0] > 1 and c.chunks[1:] == (1,) * (len(c.chunks) - 1) for c in cases)
    assert {c.k for c in cases} >= {None, 2, 1} and any(c.padding for c in cases)
    assert {c.mask for c in cases} == {"none", "bool_btl", "bool_bntl", "float_tl"}
    assert any(c.p == c.length for c in cases) and any(not c.causal for c in cases) and any(c.cross for c in cases)


def _off_by_one_causal(keep, index, t, causal, window, attention_chunk_size):
    slots = torch.arange(keep.shape[-1])[None, :]
    positions = index + torch.arange(t)[:, None]
    allowed = slots < positions if causal else slots < index + t  # a query no longer sees its own slot
    allowed = allowed if window is None else allowed & (slots > positions - window)
    return allowed[None, None] & keep[:, None, None, :]


def _numpy_write_one_slot_late(cache, k, v, key_mask):
    shifted = numpy_file.KVCache(cache.key, cache.value, cache.keep, np.asarray(int(cache.index) + 1))
    return numpy_file.KVCache(*_numpy_write(shifted, k, v, key_mask)[:3], np.asarray(int(cache.index) + k.shape[2]))


_numpy_write = numpy_file._write_cache

MUTATIONS = {
    "torch_causal_off_by_one": (torch_file, "_cache_keep", _off_by_one_causal, "decode_prefill_then_steps"),
    "numpy_writes_one_slot_late": (numpy_file, "_write_cache", _numpy_write_one_slot_late, "decode_all_steps"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_broken_decoding_fails_the_report(name, monkeypatch, capsys):
    target, attribute, replacement, case_name = MUTATIONS[name]
    monkeypatch.setattr(target, attribute, replacement)
    assert parity.main(["--case", case_name]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and " raised " not in out  # wrong numbers, not a mutation that no longer fits the call


def test_tf_cache_ignoring_padding_fails_the_report(monkeypatch):
    import TensorFlow.Multi_Head_Attention as tf_file

    real = tf_file._cache_keep
    monkeypatch.setattr(tf_file, "_cache_keep", lambda keep, *rest: real(keep | True, *rest))
    row, _ = parity.run_decode_case(DECODE_CASES_BY_NAME["decode_left_padding_gqa"])
    assert not row.passed


# -- errors: the same ValueError text in all three ------------------------------------------------


def _numpy_layer(config):
    return NumpyMultiHeadAttention(**config, seed=0)


def _torch_layer(config):
    return TorchMultiHeadAttention(**config, dtype=torch.float64)


def _tf_layer(config):
    from TensorFlow import MultiHeadAttention

    return MultiHeadAttention(**config, dtype="float64")


KERAS_FRAME = re.compile(r"Exception encountered when calling .*?\x1b\[1m(.*?)\x1b\[0m", re.DOTALL)


def _convert(framework, value):
    if framework == "torch":
        return torch.from_numpy(np.asarray(value))
    if framework == "tf":
        import tensorflow as tf

        return tf.constant(value)
    return np.asarray(value)


def _call(framework, config, call, cache_args, spoil):
    """Makes a cache (from `cache_args`), spoils it, then calls the layer with it (float64
    layers in all three, so the compute dtype is the same); returns the ValueError's text."""
    layer = {"numpy": _numpy_layer, "torch": _torch_layer, "tf": _tf_layer}[framework](config)
    cache_args = {k: _convert(framework, v) if k == "keep" else v for k, v in cache_args.items()}
    cache = layer.init_cache(**cache_args)
    cache = spoil(framework, cache)
    inputs = {k: _convert(framework, v.astype(np.float64)) for k, v in call.items()}
    try:
        with torch.no_grad():
            layer(**inputs, cache=cache)
    except ValueError as error:
        framed = KERAS_FRAME.match(str(error))
        return framed.group(1) if framed else str(error)
    raise AssertionError(f"{framework}: no ValueError")


def _keep(framework, cache):
    return cache


def _as_dtype(dtype):
    def spoil(framework, cache):
        if framework == "torch":
            return cache._replace(key=cache.key.to(getattr(torch, dtype)), value=cache.value.to(getattr(torch, dtype)))
        if framework == "tf":
            import tensorflow as tf

            return cache._replace(key=tf.cast(cache.key, dtype), value=tf.cast(cache.value, dtype))
        return cache._replace(key=cache.key.astype(dtype), value=cache.value.astype(dtype))

    return spoil


def _at_index(index):
    def spoil(framework, cache):
        return cache._replace(index=cache.index + index)

    return spoil


def _first_head(framework, cache):
    return cache._replace(key=cache.key[:, :1], value=cache.value[:, :1])


BASE = {"d_model": 8, "num_heads": 4, "num_kv_heads": 2}

# name: (constructor kwargs, call inputs, init_cache kwargs, spoil, regex)
CALL_ERRORS = {
    "empty_query": (BASE, {"query": X[:, :0]}, {"batch_size": 2, "max_length": 10}, _keep, r"^`query` must hold at least one token \(T >= 1\) when decoding with `cache`\. Received: query\.shape=\(2, 0, 8\)$"),
    "key_length_not_t": (BASE, {"query": X[:, :2], "key": X[:, :3], "value": X[:, :3]}, {"batch_size": 2, "max_length": 10}, _keep, r"^`key` and `value` must hold the T tokens of `query` when decoding with `cache` \(they are written to it\)\. Received: query\.shape=\(2, 2, 8\), key\.shape=\(2, 3, 8\)$"),
    "batch_not_cache": (BASE, {"query": X[:1, :2]}, {"batch_size": 2, "max_length": 10}, _keep, r"^`cache\.key` and `cache\.value` must have shape \(B, K, L, H\) with B=1, K=2, H=2\. Received: cache\.key\.shape=\(2, 2, 10, 2\), cache\.value\.shape=\(2, 2, 10, 2\)$"),
    "heads_not_cache": (BASE, {"query": X[:, :2]}, {"batch_size": 2, "max_length": 10}, _first_head, r"with B=2, K=2, H=2\. Received: cache\.key\.shape=\(2, 1, 10, 2\), cache\.value\.shape=\(2, 1, 10, 2\)$"),
    "dtype_not_cache": (BASE, {"query": X[:, :2]}, {"batch_size": 2, "max_length": 10}, _as_dtype("float16"), r"^`cache` must hold the layer's compute dtype float64; make it with `init_cache\(\.\.\., dtype=\.\.\.\)`\. Received: cache\.key\.dtype=float16, cache\.value\.dtype=float16$"),
    "cache_full": (BASE, {"query": X[:, :4]}, {"batch_size": 2, "max_length": 10}, _at_index(7), r"^`cache` is full: index \+ T must be <= L \(call `init_cache` with a larger `max_length`\)\. Received: index=7, T=4, L=10$"),
    "rolling_cache_too_short": ({**BASE, "window": 4}, {"query": X[:, :3]}, {"batch_size": 2, "max_length": 5}, _at_index(3), r"^`cache` rolls with `window`: a call that wraps around it \(index \+ T > L\) needs L >= window \+ T - 1 \(call `init_cache` with a larger `max_length`, or decode in shorter chunks\)\. Received: window=4, T=3, L=5$"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CALL_ERRORS))
def test_same_cache_error_in_all_three(name):
    config, call, cache_args, spoil, pattern = CALL_ERRORS[name]
    messages = {fw: _call(fw, config, call, cache_args, spoil) for fw in ("numpy", "torch", "tf")}
    for framework, message in messages.items():
        assert re.search(pattern, message), (framework, message)
    assert len(set(messages.values())) == 1, messages


INIT_ERRORS = {
    "keep_shape": ({"batch_size": 2, "max_length": 10, "keep": KEEP[:, :9]}, r"^`keep` must be a boolean array of shape \(B, L\)=\(2, 10\)\. Received: keep\.shape=\(2, 9\), keep\.dtype=bool$"),
    "keep_dtype": ({"batch_size": 2, "max_length": 10, "keep": KEEP.astype(np.int32)}, r"^`keep` must be a boolean array of shape \(B, L\)=\(2, 10\)\. Received: keep\.shape=\(2, 10\), keep\.dtype=int32$"),
    "max_length_zero": ({"batch_size": 2, "max_length": 0}, r"^`max_length` must be a positive integer\. Received: max_length=0$"),
    "batch_size_float": ({"batch_size": 2.0, "max_length": 4}, r"^`batch_size` must be a positive integer\. Received: batch_size=2\.0$"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(INIT_ERRORS))
def test_same_init_cache_error_in_all_three(name):
    kwargs, pattern = INIT_ERRORS[name]
    messages = {}
    for framework, make in (("numpy", _numpy_layer), ("torch", _torch_layer), ("tf", _tf_layer)):
        converted = {k: _convert(framework, v) if k == "keep" else v for k, v in kwargs.items()}
        with pytest.raises(ValueError, match=pattern) as error:
            make(BASE).init_cache(**converted)
        messages[framework] = str(error.value)
    assert len(set(messages.values())) == 1, messages


# -- PyTorch ---------------------------------------------------------------------------------------


def _torch_decode(layer, x, chunks, keep, call=None):
    call = layer if call is None else call
    cache, outputs = layer.init_cache(x.shape[0], keep.shape[1], keep=keep), []
    for start, stop in chunks:
        output, cache = call(x[:, start:stop], causal=True, cache=cache)
        outputs.append(output)
    return torch.cat(outputs, 1), cache


CHUNKS = [(0, 4), (4, 5), (5, 6), (6, 7)]


def _torch_setup():
    layer = TorchMultiHeadAttention(8, 4, num_kv_heads=2).eval()
    x, keep = torch.from_numpy(X), torch.from_numpy(KEEP)
    with torch.no_grad():
        full = layer(x, attention_mask=keep[:, None, :7], causal=True)
    return layer, x, keep, full


def test_torch_writes_the_cache_in_place():
    layer, x, keep, _ = _torch_setup()
    with torch.no_grad():
        cache = layer.init_cache(2, 10, keep=keep)
        _, new = layer(x[:, :3], causal=True, cache=cache)
    assert new.key is cache.key and new.value is cache.value  # the same tensors, written in place
    assert int(cache.index) == 0 and int(new.index) == 3
    assert cache.key[:, :, :3].abs().sum() > 0 and (cache.key[:, :, 3:] == 0).all()


def test_torch_compile_fullgraph_makes_one_graph_per_t_and_nan_when_full():
    """The index is a tensor, so only a new T makes a new graph; a full cache cannot raise
    inside a graph, so that call's output is NaN."""
    layer, x, keep, full = _torch_setup()
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        output, cache = _torch_decode(layer, x, CHUNKS, keep, call=compiled)
        assert len(graphs) == 2  # T = 4 and T = 1
        torch.testing.assert_close(output, full, atol=OUTPUT_TOL, rtol=0)
        overflow, _ = compiled(x[:, :4], causal=True, cache=cache)  # index 7 + T 4 > L 10
    assert torch.isnan(overflow).all()


def test_torch_compile_inductor_decodes():
    layer, x, keep, full = _torch_setup()
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.no_grad():
        output, _ = _torch_decode(layer, x, CHUNKS, keep, call=compiled)
    torch.testing.assert_close(output, full, atol=OUTPUT_TOL, rtol=0)


def test_torch_unbatched_decoding():
    layer, x, keep, full = _torch_setup()
    with torch.no_grad():
        cache = layer.init_cache(1, 10, keep=keep[1:])
        first, cache = layer(x[1, :4], causal=True, cache=cache)  # (T, E)
        second, cache = layer(x[1, 4:5], causal=True, cache=cache)
    assert first.shape == (4, 8) and second.shape == (1, 8)
    torch.testing.assert_close(torch.cat([first, second]), full[1, :5], atol=OUTPUT_TOL, rtol=0)


def test_torch_cache_takes_the_layer_dtype():
    layer = TorchMultiHeadAttention(8, 2, dtype=torch.float16)
    cache = layer.init_cache(3, 5)
    assert cache.key.dtype == torch.float16 and cache.key.shape == (3, 2, 5, 4)
    assert cache.keep.dtype == torch.bool and cache.keep.all() and cache.index.dtype == torch.long


def test_regression_padded_prompt_rows_are_output_bias_not_nan():
    """Left padding + causal: the padded queries of a prompt have no slot to attend."""
    layer, x, keep, _ = _torch_setup()
    with torch.no_grad():
        layer.output.bias.fill_(0.5)
        output, _ = _torch_decode(layer, x, CHUNKS, keep)
    assert (output[1, :3] == 0.5).all()
    assert torch.isfinite(output).all()


def _spy_fast_steps(monkeypatch):
    """Records, for each call the decode fast path (`_decode_step`) is offered, whether it took it."""
    taken, real = [], torch_file._decode_step

    def spy(layer, *args):
        step = real(layer, *args)
        taken.append(step[0] is not None)
        return step

    monkeypatch.setattr(torch_file, "_decode_step", spy)
    return taken


def _fast_calls(case):
    """What the fast path is offered and takes in a decode case: none of its calls with a mask
    over the slots or in cross-attention (not offered); else, for each call, whether it takes it:
    every call after the first (which keeps the kernels) that ends in the cache's first lap, over
    a float or an int8 cache, never with MLA or the sharing options (their steps 2 to 4 are their
    sections')."""
    if case.mask != "none" or case.cross:
        return []
    sharing = any(dict(case.variants).get(name) for name in ("kv_shared", "keys_as_values", "value_norm"))
    fast = not case.mla and not sharing
    return [i > 0 and stop <= case.length and fast for i, (_, stop) in enumerate(case.spans())]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.name)
def test_torch_fast_decode_step_equals_the_general_call_bit_for_bit(case, monkeypatch):
    """The decode fast path (`_decode_step`) runs the general call's operations less its checks:
    every decode case gives the same outputs and cache with it and without it (`_decode_step`
    stepping aside, so every call goes through `forward`'s steps), and it takes the calls it
    applies to (`_fast_calls`)."""
    from shared_tests import torch_runner
    from shared_tests.decoding import make_decode_data

    data = make_decode_data(case)
    taken = _spy_fast_steps(monkeypatch)
    fast = torch_runner.decode(case, data, "torch:sdpa")
    assert taken == _fast_calls(case)
    monkeypatch.setattr(torch_file, "_decode_step", lambda *args: (None, None))
    general = torch_runner.decode(case, data, "torch:sdpa")
    np.testing.assert_array_equal(fast.output, general.output)
    assert fast.cache.keys() == general.cache.keys()
    for name, written in fast.cache.items():
        np.testing.assert_array_equal(written, general.cache[name])


def _after_fast_steps(layer, monkeypatch):
    """Decodes a prompt and one T = 1 step on a cache of the layer's own, checking that the step
    took the fast path: the layer then keeps its kernels and its caches carry their index."""
    taken = _spy_fast_steps(monkeypatch)
    with torch.no_grad():
        _, cache = layer(torch.from_numpy(X[:, :3]).double(), causal=True, cache=layer.init_cache(2, 10))
        layer(torch.from_numpy(X[:, 3:4]).double(), causal=True, cache=cache)
    assert taken == [False, True]


def _reordered(cache):
    """Beam search: the cache's batch reordered (new key, value and keep tensors), the index kept."""
    order = torch.tensor([1, 0])
    return torch_file.KVCache(*(t.index_select(0, order) for t in cache[:3]), cache.index)


def _fresh_index(cache):
    """A server resetting the index: the same tensors, the index a fresh tensor of its value."""
    return cache._replace(index=torch.tensor(int(cache.index)))


def _index_written(cache):
    """The index written in place by the caller (its version moves: the value it carried is dropped)."""
    cache.index.fill_(int(cache.index))
    return cache


def _rebuilt_beam(cache):
    """Both: the batch reordered and the index a fresh int32 tensor."""
    return _reordered(cache)._replace(index=torch.tensor(int(cache.index), dtype=torch.int32))


@pytest.mark.parametrize(
    "rebuild", [_reordered, _fresh_index, _index_written, _rebuilt_beam], ids=lambda f: f.__name__[1:]
)
@pytest.mark.parametrize("config", [BASE, {**BASE, "rope_theta": 10000.0}], ids=["plain", "rope"])
def test_torch_fast_step_on_a_cache_the_caller_rebuilt(config, rebuild, monkeypatch):
    """Before each T = 1 step the caller rebuilds the cache (beam search reorders its batch, a
    server replaces or writes its index): every step takes the decode fast path, reading the
    index once (`_read_index`), and gives the general call's outputs and cache bit for bit."""
    layer = _torch_layer(config).eval()
    x, keep = torch.from_numpy(X).double(), torch.from_numpy(KEEP)

    def decode():
        outputs = []
        with torch.no_grad():
            output, cache = layer(x[:, :4], causal=True, cache=layer.init_cache(2, 10, keep=keep))
            outputs.append(output)
            for t in range(4, 7):
                output, cache = layer(x[:, t : t + 1], causal=True, cache=rebuild(cache))
                outputs.append(output)
        return torch.cat(outputs, 1), cache

    taken = _spy_fast_steps(monkeypatch)
    fast, fast_cache = decode()
    assert taken == [False, True, True, True]
    monkeypatch.setattr(torch_file, "_decode_step", lambda *args: (None, None))
    general, general_cache = decode()
    assert torch.equal(fast, general)
    for name in ("key", "value", "keep", "index"):
        assert torch.equal(getattr(fast_cache, name), getattr(general_cache, name)), name


@pytest.mark.parametrize(
    "index",
    [torch.tensor(4.0), torch.tensor([4]), torch.tensor(-1), torch.tensor(10)],
    ids=["float", "one_element_1d", "negative", "full"],
)
def test_torch_caller_index_the_fast_path_does_not_read_goes_to_the_check_step(index, monkeypatch):
    """An index that is not a 0-d integer tensor, or whose value is negative or leaves no room:
    the fast path steps aside, and the call does what the check step makes of it."""
    layer = _torch_layer(BASE).eval()
    x = torch.from_numpy(X).double()
    taken = _spy_fast_steps(monkeypatch)
    with torch.no_grad():
        _, cache = layer(x[:, :4], causal=True, cache=layer.init_cache(2, 10))
        rebuilt = cache._replace(index=index)
        try:
            fast = layer(x[:, 4:5], causal=True, cache=rebuilt)[0]
        except (ValueError, RuntimeError, IndexError) as error:
            fast = type(error)
        monkeypatch.setattr(torch_file, "_decode_step", lambda *args: (None, None))
        try:
            general = layer(x[:, 4:5], causal=True, cache=rebuilt)[0]
        except (ValueError, RuntimeError, IndexError) as error:
            general = type(error)
    assert taken == [False, False]
    assert fast is general if isinstance(fast, type) else torch.equal(fast, general)


@pytest.mark.parametrize("name", sorted(CALL_ERRORS))
def test_torch_bad_call_after_a_fast_step_raises_the_same_error(name, monkeypatch):
    """Regression guard for the decode fast path, which checks a call only as far as it takes it:
    after a step that took it, each invalid call still raises its ValueError, the same text."""
    config, call, cache_args, spoil, pattern = CALL_ERRORS[name]
    layer = _torch_layer(config)
    _after_fast_steps(layer, monkeypatch)
    cache = spoil("torch", layer.init_cache(**cache_args))
    inputs = {k: torch.from_numpy(v.astype(np.float64)) for k, v in call.items()}
    with pytest.raises(ValueError, match=pattern), torch.no_grad():
        layer(**inputs, cache=cache)


@pytest.mark.parametrize(
    ("config", "t", "pattern"),
    [
        (BASE, 8, r"^`cache` is full: .* Received: index=4, T=8, L=10$"),
        ({**BASE, "window": 8}, 7, r"^`cache` rolls with `window`: .* Received: window=8, T=7, L=10$"),
    ],
    ids=["full", "wrapping_too_long"],
)
def test_torch_call_past_the_carried_index_raises_after_a_fast_step(config, t, pattern, monkeypatch):
    """A cache whose index carries its value (4, from the fast step) and a call that does not fit:
    the fast path steps aside and the room check raises."""
    layer = _torch_layer(config)
    taken = _spy_fast_steps(monkeypatch)
    x = torch.from_numpy(X).double()
    with torch.no_grad():
        _, cache = layer(x[:, :3], causal=True, cache=layer.init_cache(2, 10))
        _, cache = layer(x[:, 3:4], causal=True, cache=cache)
        with pytest.raises(ValueError, match=pattern):
            layer(torch.cat([x, x], 1)[:, :t], causal=True, cache=cache)
    assert taken == [False, True, False]


def test_numpy_copies_the_cache():
    layer = NumpyMultiHeadAttention(8, 4, num_kv_heads=2, seed=0)
    cache = layer.init_cache(2, 10, keep=KEEP)
    _, new = layer(X[:, :3], causal=True, cache=cache)
    assert int(cache.index) == 0 and (cache.key == 0).all() and int(new.index) == 3


def test_numpy_backward_refuses_a_cached_call():
    layer = NumpyMultiHeadAttention(8, 4, seed=0)
    layer(X[:, :3], cache=layer.init_cache(2, 10))
    with pytest.raises(
        ValueError, match=r"^`backward` needs a forward call without `cache` first\. Received: no such call$"
    ):
        layer.backward(np.ones((2, 3, 8)))


# -- TensorFlow ------------------------------------------------------------------------------------


def _tf_setup():
    import tensorflow as tf

    from TensorFlow import MultiHeadAttention

    layer = MultiHeadAttention(8, 4, num_kv_heads=2)
    x, keep = tf.constant(X), tf.constant(KEEP)
    full = layer(x, attention_mask=keep[:, None, :7], causal=True)
    return tf, layer, x, keep, full.numpy()


def _tf_decode(layer, x, keep, call):
    cache, outputs = layer.init_cache(2, 10, keep=keep), []
    for start, stop in CHUNKS:
        output, cache = call(x[:, start:stop], cache)
        outputs.append(output.numpy())
    return np.concatenate(outputs, 1), cache


def test_tf_function_retraces_per_t_only_and_raises_when_full():
    tf, layer, x, keep, full = _tf_setup()
    step = tf.function(lambda q, cache: layer(q, causal=True, cache=cache))
    output, cache = _tf_decode(layer, x, keep, step)
    np.testing.assert_allclose(output, full, atol=OUTPUT_TOL, rtol=0)
    assert step.experimental_get_tracing_count() == 2  # T = 4 and T = 1
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"`cache` is full: index \+ T must be <= L"):
        step(x[:, :4], cache)


def test_tf_xla_decodes_and_gives_nan_when_full():
    tf, layer, x, keep, full = _tf_setup()
    step = tf.function(lambda q, cache: layer(q, causal=True, cache=cache), jit_compile=True)
    output, cache = _tf_decode(layer, x, keep, step)
    np.testing.assert_allclose(output, full, atol=OUTPUT_TOL, rtol=0)
    assert step.experimental_get_tracing_count() == 2
    overflow, _ = step(x[:, :4], cache)  # XLA drops the assertion; the output says it instead
    assert np.isnan(overflow.numpy()).all()


def test_tf_cache_is_a_while_loop_variable():
    tf, layer, x, keep, full = _tf_setup()

    @tf.function
    def greedy_steps(cache):
        def body(i, cache, outputs):
            output, cache = layer(x[:, i : i + 1], causal=True, cache=cache)
            return i + 1, cache, outputs.write(i, output[:, 0])

        loop_vars = (tf.constant(0), cache, tf.TensorArray(tf.float32, size=7))
        _, cache, outputs = tf.while_loop(lambda i, *_: i < 7, body, loop_vars)
        return tf.transpose(outputs.stack(), [1, 0, 2]), cache

    output, cache = greedy_steps(layer.init_cache(2, 10, keep=keep))
    np.testing.assert_allclose(output.numpy(), full, atol=OUTPUT_TOL, rtol=0)
    assert int(cache.index) == 7


def test_tf_implicit_key_masks_go_into_the_cache_keep():
    tf, layer, _, _, _ = _tf_setup()
    embed = tf.keras.layers.Embedding(20, 8, mask_zero=True)
    tokens = tf.constant([[3, 5, 7, 2], [0, 0, 4, 6]])  # the second prompt is left-padded by 2
    x = embed(tokens)
    _, cache = layer(x, causal=True, cache=layer.init_cache(2, 6))
    np.testing.assert_array_equal(cache.keep.numpy(), [[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    explicit = np.array([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=bool)
    _, expected = layer(x, causal=True, cache=layer.init_cache(2, 6, keep=explicit))
    next_token = embed(tf.constant([[1], [1]]))
    np.testing.assert_allclose(
        layer(next_token, causal=True, cache=cache)[0].numpy(),
        layer(next_token, causal=True, cache=expected)[0].numpy(),
        atol=0,
    )


def test_tf_cache_takes_the_compute_dtype():
    from TensorFlow import MultiHeadAttention

    layer = MultiHeadAttention(8, 2, dtype="mixed_float16")
    cache = layer.init_cache(3, 5)
    assert cache.key.dtype.name == "float16" and tuple(cache.key.shape) == (3, 2, 5, 4)
    output, cache = layer(np.ones((3, 2, 8), np.float32), cache=cache)
    assert output.dtype.name == "float16" and int(cache.index) == 2


# -- TensorFlow in-place cache (init_cache(..., in_place=True)) -------------------------------------

ROLLING_CHUNKS = [(0, 2), (2, 3), (3, 5), (5, 6), (6, 7)]  # the chunk (3, 5) wraps: slots 3 and 0 of L = 4
IN_PLACE_SETUPS = {  # name: (constructor kwargs, L, chunks, keep)
    "gqa_left_padding": ({"num_kv_heads": 2}, 10, CHUNKS, KEEP),
    "rolling_window_wraps": ({"num_kv_heads": 2, "window": 3}, 4, ROLLING_CHUNKS, KEEP[:, :4]),
}


def _tf_step(tf, layer, mode, in_place):
    """A decode step (eager, tf.function or XLA); over an in-place cache it returns no cache."""

    def step(q, cache):
        output, weights, cache = layer(q, causal=True, return_attention=True, cache=cache)
        return (output, weights) if in_place else (output, weights, cache)

    return step if mode == "eager" else tf.function(step, jit_compile=mode == "xla")


def _tf_decode_with(layer, x, length, chunks, keep, step, in_place):
    cache, outputs, weights = layer.init_cache(x.shape[0], length, keep=keep, in_place=in_place), [], []
    for start, stop in chunks:
        output, w, *written = step(x[:, start:stop], cache)
        cache = cache if in_place else written[0]
        outputs.append(output.numpy())
        weights.append(w.numpy())
    as_numpy = {name: getattr(cache, name).numpy() for name in ("key", "value", "keep", "index")}
    return np.concatenate(outputs, 1), np.concatenate(weights, 2), as_numpy


@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
@pytest.mark.parametrize("setup", sorted(IN_PLACE_SETUPS))
def test_tf_in_place_cache_equals_the_functional_one(setup, mode):
    import tensorflow as tf

    from TensorFlow import MultiHeadAttention

    config, length, chunks, keep = IN_PLACE_SETUPS[setup]
    layer = MultiHeadAttention(8, 4, **config)
    x, keep = tf.constant(X[:, : chunks[-1][1]]), tf.constant(keep)
    functional = _tf_decode_with(layer, x, length, chunks, keep, _tf_step(tf, layer, mode, False), False)
    in_place = _tf_decode_with(layer, x, length, chunks, keep, _tf_step(tf, layer, mode, True), True)
    np.testing.assert_allclose(in_place[0], functional[0], atol=OUTPUT_TOL, rtol=0)
    np.testing.assert_allclose(in_place[1], functional[1], atol=OUTPUT_TOL, rtol=0)
    for name in ("key", "value"):
        np.testing.assert_allclose(in_place[2][name], functional[2][name], atol=OUTPUT_TOL, rtol=0)
    np.testing.assert_array_equal(in_place[2]["keep"], functional[2]["keep"])
    assert int(in_place[2]["index"]) == int(functional[2]["index"]) == chunks[-1][1]


@pytest.mark.parametrize("mode", ["function", "xla", "concrete"])
@pytest.mark.parametrize("setup", sorted(IN_PLACE_SETUPS))
def test_tf_step_closing_over_the_in_place_cache_decodes_as_eager(setup, mode):
    """The fast decode loop of docs/serving.md: the step takes only the new tokens and reads and
    writes the in-place cache it closes over (no cache argument for tf.function to walk per call);
    "concrete" calls the ConcreteFunction of each distinct T directly."""
    import tensorflow as tf

    from TensorFlow import MultiHeadAttention

    config, length, chunks, keep = IN_PLACE_SETUPS[setup]
    layer = MultiHeadAttention(8, 4, **config)
    x, keep = tf.constant(X[:, : chunks[-1][1]]), tf.constant(keep)
    eager = _tf_decode_with(layer, x, length, chunks, keep, _tf_step(tf, layer, "eager", False), False)
    cache = layer.init_cache(x.shape[0], length, keep=keep, in_place=True)
    step = tf.function(
        lambda q: layer(q, causal=True, return_attention=True, cache=cache)[:2], jit_compile=mode != "function"
    )
    concrete = {}  # T -> ConcreteFunction
    outputs, weights = [], []
    for start, stop in chunks:
        q = x[:, start:stop]
        call = step if mode != "concrete" else concrete.setdefault(stop - start, step.get_concrete_function(q))
        output, w = call(q)
        outputs.append(output.numpy())
        weights.append(w.numpy())
    np.testing.assert_allclose(np.concatenate(outputs, 1), eager[0], atol=OUTPUT_TOL, rtol=0)
    np.testing.assert_allclose(np.concatenate(weights, 2), eager[1], atol=OUTPUT_TOL, rtol=0)
    np.testing.assert_array_equal(cache.keep.numpy(), eager[2]["keep"])
    assert int(cache.index) == chunks[-1][1]


def test_regression_xla_step_traced_with_t_unknown_is_not_padded_to_a_whole_chunk(monkeypatch):
    """Traced with T unknown under XLA, a call takes the memory-efficient path, which padded a
    T = 1 decode step to a whole chunk of queries (512 at B=1, E=256, L=1024: the step took 15
    times as long). The chunk is now at most T, and decoding equals eager decoding."""
    import tensorflow as tf

    from TensorFlow import Multi_Head_Attention, MultiHeadAttention

    config, length, chunks, keep = IN_PLACE_SETUPS["gqa_left_padding"]
    layer = MultiHeadAttention(8, 4, **config)
    x, keep = tf.constant(X[:, : chunks[-1][1]]), tf.constant(keep)
    eager = _tf_decode_with(layer, x, length, chunks, keep, _tf_step(tf, layer, "eager", False), False)
    sizes = []  # the chunk size of each trace: a Python int, or a tensor of the traced graph
    real = Multi_Head_Attention._query_chunk  # the memory-efficient path's (speed paths section)

    def recorded(layer, q, k):
        sizes.append(real(layer, q, k))
        return sizes[-1]

    monkeypatch.setattr(Multi_Head_Attention, "_query_chunk", recorded)
    cache = layer.init_cache(x.shape[0], length, keep=keep, in_place=True)

    @tf.function(jit_compile=True, input_signature=[tf.TensorSpec((None, None, 8), tf.float32)])
    def step(q):
        return layer(q, causal=True, cache=cache)[0], sizes[-1]

    outputs = []
    for start, stop in chunks:
        output, size = step(x[:, start:stop])
        assert int(size) == stop - start
        outputs.append(output.numpy())
    np.testing.assert_allclose(np.concatenate(outputs, 1), eager[0], atol=OUTPUT_TOL, rtol=0)


def test_regression_tf_in_place_cache_is_written_in_its_variables():
    """The same variable objects come back, written; the traced step makes no new (B, K, L, H)
    tensor (the functional cache's `tensor_scatter_nd_update` makes two) and writes through the
    XLA-compiled writer (TensorFlow's own scatter ops cost a copy of the variable per step once it
    is read: about 20 ms for a 134 MiB cache, 0.4 ms through XLA)."""
    tf, layer, x, keep, full = _tf_setup()
    cache = layer.init_cache(2, 10, keep=keep, in_place=True)
    variables = tuple(cache)
    output, returned = layer(x[:, :3], causal=True, cache=cache)
    assert returned is cache and all(a is b for a, b in zip(returned, variables, strict=True))
    assert all(isinstance(field, tf.Variable) for field in cache)
    assert int(cache.index) == 3 and np.abs(cache.key.numpy()[:, :, :3]).sum() > 0
    assert (cache.key.numpy()[:, :, 3:] == 0).all() and (cache.value.numpy()[:, :, 3:] == 0).all()
    np.testing.assert_allclose(output.numpy(), full[:, :3], atol=OUTPUT_TOL, rtol=0)

    def traced(cache):
        step = tf.function(lambda q, cache: layer(q, causal=True, cache=cache)[0])
        return step.get_concrete_function(x[:, 3:4], cache).graph.get_operations()

    def made(cache):
        shape = tuple(cache.key.shape)
        return {op.type for op in traced(cache) for out in op.outputs if tuple(out.shape) == shape}

    def compiled_calls(cache):
        return [op for op in traced(cache) if "_XlaMustCompile" in op.node_def.attr and op.get_attr("_XlaMustCompile")]

    assert made(cache) == {"ReadVariableOp"}  # the reads the attention needs, nothing else
    assert len(compiled_calls(cache)) == 1
    functional = layer.init_cache(2, 10, keep=keep)
    assert "TensorScatterUpdate" in made(functional) and not compiled_calls(functional)  # the checks can fail


def _as_variables(framework, cache):
    import tensorflow as tf

    return type(cache)(*(tf.Variable(field, trainable=False) for field in cache))


@pytest.mark.parametrize("name", sorted(CALL_ERRORS))
def test_tf_in_place_cache_gives_the_same_errors(name):
    config, call, cache_args, spoil, pattern = CALL_ERRORS[name]
    functional = _call("tf", config, call, cache_args, spoil)
    in_place = _call("tf", config, call, cache_args, lambda fw, cache: _as_variables(fw, spoil(fw, cache)))
    assert re.search(pattern, in_place) and in_place == functional


def test_tf_in_place_cache_raises_in_tf_function_and_is_left_as_it_was_under_xla():
    tf, layer, x, keep, _ = _tf_setup()
    for jit_compile in (False, True):
        cache = layer.init_cache(2, 10, keep=keep, in_place=True)
        step = tf.function(lambda q, cache: layer(q, causal=True, cache=cache)[0], jit_compile=jit_compile)
        step(x[:, :7], cache)
        before = [field.numpy() for field in cache]
        if jit_compile:
            assert np.isnan(step(x[:, :4], cache).numpy()).all()  # index 7 + T 4 > L 10
        else:
            with pytest.raises(tf.errors.InvalidArgumentError, match=r"`cache` is full: index \+ T must be <= L"):
                step(x[:, :4], cache)
        for field, old in zip(cache, before, strict=True):
            np.testing.assert_array_equal(field.numpy(), old)


def test_tf_in_place_cache_takes_the_compute_dtype():
    from TensorFlow import MultiHeadAttention

    layer = MultiHeadAttention(8, 2, dtype="mixed_float16")
    cache = layer.init_cache(3, 5, in_place=True)
    assert cache.key.dtype.name == "float16" and not cache.key.trainable and cache.index.dtype.name == "int32"
    output, cache = layer(np.ones((3, 2, 8), np.float32), cache=cache)
    assert output.dtype.name == "float16" and int(cache.index) == 2


def test_tf_in_place_cache_never_written_fails_the_report(monkeypatch):
    import TensorFlow.Multi_Head_Attention as tf_file

    monkeypatch.setattr(tf_file, "_write_variables", lambda cache, *rest: cache)
    row, _ = parity.run_decode_case(DECODE_CASES_BY_NAME["decode_prefill_then_steps"], paths=("numpy", "tf:in_place"))
    assert not row.passed


def test_tf_in_place_cache_takes_the_implicit_key_mask_into_its_keep():
    tf, layer, _, _, _ = _tf_setup()
    embed = tf.keras.layers.Embedding(20, 8, mask_zero=True)
    x = embed(tf.constant([[3, 5, 7, 2], [0, 0, 4, 6]]))  # the second prompt is left-padded by 2
    cache = layer.init_cache(2, 6, in_place=True)
    layer(x, causal=True, cache=cache)
    np.testing.assert_array_equal(cache.keep.numpy(), [[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
