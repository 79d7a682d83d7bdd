"""Error parity: each bad argument or input gives a ValueError with the same message in the
PyTorch, TensorFlow and NumPy layers; a failed import leaves every layer unchanged."""

import re

import numpy as np
import pytest

from NumPy import MultiHeadAttention as NumpyMultiHeadAttention

rng = np.random.default_rng(0)
X = rng.normal(size=(2, 3, 8)).astype(np.float32)  # (B, T, E) with E = 8
Y = rng.normal(size=(2, 5, 8)).astype(np.float32)  # (B, S, E) with S = 5
BASE = {"d_model": 8, "num_heads": 2}

# name: (constructor kwargs, call arguments or None, regex the message must match)
CASES = {
    "heads_do_not_divide_d_model": ({"d_model": 10, "num_heads": 3}, None, r"`num_heads` must divide `d_model`\. Received: d_model=10, num_heads=3"),
    "kv_heads_do_not_divide_heads": ({**BASE, "num_kv_heads": 3}, None, r"`num_kv_heads` must divide `num_heads`\. Received: num_heads=2, num_kv_heads=3"),
    "dropout_above_range": ({**BASE, "dropout": 1.5}, None, r"`dropout` must be in \[0, 1\)\. Received: dropout=1\.5"),
    "dropout_below_range": ({**BASE, "dropout": -0.1}, None, r"`dropout` must be in \[0, 1\)\. Received: dropout=-0\.1"),
    "d_model_zero": ({"d_model": 0, "num_heads": 2}, None, r"`d_model` must be a positive integer\. Received: d_model=0"),
    "head_dim_not_integer": ({**BASE, "head_dim": 2.5}, None, r"`head_dim` must be a positive integer\. Received: head_dim=2\.5"),
    "vdim_negative": ({**BASE, "vdim": -3}, None, r"`vdim` must be a positive integer\. Received: vdim=-3"),
    "query_rank_4": (BASE, {"query": X[None]}, r"`query` must have shape \(B, T, E\) with E=8\. Received: query\.shape=\(1, 2, 3, 8\)"),
    "query_width": (BASE, {"query": X[..., :7]}, r"`query` must have shape \(B, T, E\) with E=8\. Received: query\.shape=\(2, 3, 7\)"),
    "key_width": ({**BASE, "kdim": 6}, {"query": X, "key": Y, "value": Y}, r"`key` must have shape \(B, S, kdim\) with kdim=6\. Received: key\.shape=\(2, 5, 8\)"),
    "value_width": ({**BASE, "vdim": 6}, {"query": X, "key": Y, "value": Y}, r"`value` must have shape \(B, S, vdim\) with vdim=6\. Received: value\.shape=\(2, 5, 8\)"),
    "key_rank_2": (BASE, {"query": X, "key": Y[0], "value": Y}, r"`key` must have shape \(B, S, kdim\) with kdim=8\. Received: key\.shape=\(5, 8\)"),
    "batch_mismatch": (BASE, {"query": X, "key": Y[:1], "value": Y[:1]}, r"`query`, `key` and `value` must have the same batch size B\. Received: query\.shape=\(2, 3, 8\), key\.shape=\(1, 5, 8\), value\.shape=\(1, 5, 8\)"),
    "key_value_length_mismatch": (BASE, {"query": X, "key": Y, "value": Y[:, :4]}, r"`key` and `value` must have the same length S\. Received: key\.shape=\(2, 5, 8\), value\.shape=\(2, 4, 8\)"),
    "mask_not_broadcastable": (BASE, {"query": X, "key": Y, "attention_mask": np.ones((3, 4), bool)}, r"`attention_mask` must broadcast to \(B, N, T, S\) .* Expected: \(B, N, T, S\)=\(2, 2, 3, 5\)\. Received: attention_mask\.shape=\(3, 4\)"),
    "mask_rank_1": (BASE, {"query": X, "key": Y, "attention_mask": np.ones((5,), bool)}, r"Received: attention_mask\.shape=\(5,\)"),
    "mask_rank_3_wrong_batch": (BASE, {"query": X, "key": Y, "attention_mask": np.ones((3, 3, 5), bool)}, r"Received: attention_mask\.shape=\(3, 3, 5\)"),
    "mask_integer_dtype": (BASE, {"query": X, "key": Y, "attention_mask": np.ones((3, 5), np.int32)}, r"`attention_mask` must be boolean or floating\. Received: attention_mask\.dtype=int32"),
    "integer_query": (BASE, {"query": np.ones((2, 3, 8), np.int32)}, r"`query` must be a floating tensor\. Received: query\.dtype=int32"),
    "integer_value": (BASE, {"query": X, "key": Y, "value": np.ones((2, 5, 8), np.int32)}, r"`value` must be a floating tensor\. Received: value\.dtype=int32"),
}  # fmt: skip


def _torch_call(kwargs, call):
    import torch

    from PyTorch import MultiHeadAttention

    layer = MultiHeadAttention(**kwargs)
    if call is not None:
        layer(**{k: torch.from_numpy(np.asarray(v)) for k, v in call.items()})


KERAS_FRAME = re.compile(r"Exception encountered when calling .*?\x1b\[1m(.*?)\x1b\[0m", re.DOTALL)


def _tf_call(kwargs, call):
    """Keras frames every error raised in `call()` ("Exception encountered when calling ...",
    the layer's message in bold, then the arguments received); this compares the layer's own
    message, and checks that Keras kept it verbatim."""
    import tensorflow as tf

    from TensorFlow import MultiHeadAttention

    layer = MultiHeadAttention(**kwargs)
    if call is not None:
        try:
            layer(**{k: tf.constant(v) for k, v in call.items()})
        except ValueError as error:
            framed = KERAS_FRAME.match(str(error))
            raise ValueError(framed.group(1) if framed else str(error)) from error


def _numpy_call(kwargs, call):
    layer = NumpyMultiHeadAttention(**kwargs)
    if call is not None:
        layer(**call)


CALLERS = {"torch": _torch_call, "tf": _tf_call, "numpy": _numpy_call}


def test_table_has_at_least_15_bad_inputs():
    assert len(CASES) >= 15


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_value_error_in_all_three(name):
    kwargs, call, pattern = CASES[name]
    messages = {}
    for framework, caller in CALLERS.items():
        with pytest.raises(ValueError, match=pattern) as error:
            caller(kwargs, call)
        messages[framework] = str(error.value)
    assert messages["torch"] == messages["tf"] == messages["numpy"], messages


def test_numpy_reference_refuses_dropout_with_its_own_message():
    """The one error that only the reference has: it has no dropout at all."""
    with pytest.raises(ValueError, match=r"`dropout` must be 0: the NumPy reference has no dropout"):
        NumpyMultiHeadAttention(8, 2, dropout=0.1)


def _layers():
    from PyTorch import MultiHeadAttention as TorchMultiHeadAttention
    from TensorFlow import MultiHeadAttention as TFMultiHeadAttention

    config = {"d_model": 8, "num_heads": 4, "num_kv_heads": 2}
    return {
        "torch": TorchMultiHeadAttention(**config),
        "tf": TFMultiHeadAttention(**config),
        "numpy": NumpyMultiHeadAttention(**config, seed=0),
    }


BAD_IMPORTS = {
    "missing": (lambda w: {k: v for k, v in w.items() if k != "value_bias"}, r"^`weights` do not match this layer's portable layout: missing 'value_bias'$"),
    "extra": (lambda w: {**w, "gate_kernel": np.zeros((8, 8))}, r"^`weights` do not match this layer's portable layout: unexpected 'gate_kernel'$"),
    "misshaped": (lambda w: {**w, "key_kernel": np.zeros((8, 8))}, r"^`weights` do not match this layer's portable layout: 'key_kernel' has shape \(8, 8\), expected \(8, 4\)$"),
    "all_at_once": (
        lambda w: {**{k: v for k, v in w.items() if k != "query_kernel"}, "x": np.zeros(1), "output_bias": np.zeros(9)},
        r"missing 'query_kernel'; unexpected 'x'; 'output_bias' has shape \(9,\), expected \(8,\)$",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BAD_IMPORTS))
def test_failed_import_is_the_same_error_and_changes_nothing(name):
    spoil, pattern = BAD_IMPORTS[name]
    messages = {}
    for framework, layer in _layers().items():
        before = layer.export_weights()
        bad = spoil({k: np.ones_like(v) for k, v in before.items()})  # the good entries differ from the layer's
        with pytest.raises(ValueError, match=pattern) as error:
            layer.import_weights(bad)
        messages[framework] = str(error.value)
        after = layer.export_weights()
        for key, value in before.items():
            np.testing.assert_array_equal(after[key], value, err_msg=f"{framework} {key}")
    assert len(set(messages.values())) == 1, messages
