"""Error parity: each bad argument or input gives a ValueError with the same message in the
PyTorch, TensorFlow, Keras and NumPy layers (the Keras file on the TensorFlow backend here;
test_keras.py runs it on the others); a failed import leaves every layer unchanged."""

import functools
import re
import warnings

import numpy as np
import pytest

from NumPy import MultiHeadAttention as NumpyMultiHeadAttention
from shared_tests.calling import layer_classes
from shared_tests.cases import TOLERANCES

OUTPUT_TOL = TOLERANCES["float32"]["output"]
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
    "mask_integer_dtype": (BASE, {"query": X, "key": Y, "attention_mask": np.ones((3, 5), np.int32)}, r"`attention_mask` must be boolean \(True = attend; for a 0/1 integer mask pass `mask > 0`\) or floating\. Received: attention_mask\.dtype=int32"),
    "integer_query": (BASE, {"query": np.ones((2, 3, 8), np.int32)}, r"`query` must be a floating tensor\. Received: query\.dtype=int32"),
    "integer_value": (BASE, {"query": X, "key": Y, "value": np.ones((2, 5, 8), np.int32)}, r"`value` must be a floating tensor\. Received: value\.dtype=int32"),
    # The variants' constructor arguments
    "bias_unknown_projection": ({**BASE, "bias": ("query", "qkv")}, None, r"`bias` must be True, False or a list, tuple or set of 'query', 'key', 'value', 'output', 'gate'\. Received: bias=\('query', 'qkv'\)"),
    "bias_string": ({**BASE, "bias": "query"}, None, r"`bias` must be True, False or a list, tuple or set .* Received: bias='query'"),
    "scale_zero": ({**BASE, "scale": 0.0}, None, r"`scale` must be a positive float\. Received: scale=0\.0"),
    "softcap_negative": ({**BASE, "softcap": -1.0}, None, r"`softcap` must be None or a positive float\. Received: softcap=-1\.0"),
    "window_zero": ({**BASE, "window": 0}, None, r"`window` must be None, a positive integer or a pair \(before, after\) of positive integers\. Received: window=0"),
    "window_pair_zero": ({**BASE, "window": (2, 0)}, None, r"`window` must be None, a positive integer or a pair \(before, after\) of positive integers\. Received: window=\(2, 0\)"),
    "window_pair_none": ({**BASE, "window": [None, 2]}, None, r"`window` must be None, a positive integer or a pair \(before, after\) of positive integers\. Received: window=\[None, 2\]"),
    "window_triple": ({**BASE, "window": (1, 2, 3)}, None, r"`window` must be None, a positive integer or a pair \(before, after\) of positive integers\. Received: window=\(1, 2, 3\)"),
    "window_string": ({**BASE, "window": "2"}, None, r"`window` must be None, a positive integer or a pair \(before, after\) of positive integers\. Received: window='2'"),
    "window_pair_bool": ({**BASE, "window": (True, 2)}, None, r"`window` must be None, a positive integer or a pair \(before, after\) of positive integers\. Received: window=\(True, 2\)"),
    "attention_chunk_size_zero": ({**BASE, "attention_chunk_size": 0}, None, r"`attention_chunk_size` must be a positive integer\. Received: attention_chunk_size=0"),
    "attention_chunk_size_float": ({**BASE, "attention_chunk_size": 4.0}, None, r"`attention_chunk_size` must be a positive integer\. Received: attention_chunk_size=4\.0"),
    "rope_sections_int": ({**BASE, "rope_theta": 10000.0, "rope_sections": 2}, None, r"`rope_sections` must be None or a list or tuple of positive integers\. Received: rope_sections=2"),
    "rope_sections_zero_without_rope": ({**BASE, "rope_sections": (2, 0)}, None, r"`rope_sections` must be None or a list or tuple of positive integers\. Received: rope_sections=\(2, 0\)"),
    "rope_sections_sum": ({**BASE, "rope_theta": 10000.0, "rope_sections": (1, 2)}, None, r"`rope_sections` must sum to R/2 = 2, the pairs RoPE rotates \(R = int\(head_dim \* rope_fraction\) = 4\)\. Received: rope_sections=\(1, 2\)"),
    "rope_sections_interleaved_int": ({**BASE, "rope_theta": 10000.0, "rope_sections": (1, 1), "rope_sections_interleaved": 1}, None, r"`rope_sections_interleaved` must be True or False\. Received: rope_sections_interleaved=1"),
    "rope_theta_negative": ({**BASE, "rope_theta": -1.0}, None, r"`rope_theta` must be None or a positive float\. Received: rope_theta=-1\.0"),
    "rope_fraction_odd": ({**BASE, "rope_theta": 10000.0, "rope_fraction": 0.25}, None, r"`rope_fraction` must be in \(0, 1\] and rotate an even number R = int\(head_dim \* rope_fraction\) >= 2 of features\. Received: rope_fraction=0\.25, head_dim=4"),
    "rope_scaling_unknown": ({**BASE, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, None, r"`rope_scaling` must be None or a dict whose rope_type is 'linear', 'llama3', 'yarn' or 'proportional', with its parameters\. Received: rope_scaling="),
    "rope_scaling_llama3_bands_swapped": ({**BASE, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 64}}, None, r"`rope_scaling` must be None or a dict"),
    "rope_scaling_yarn_missing_context": ({**BASE, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, None, r"`rope_scaling` must be None or a dict whose rope_type is 'linear', 'llama3', 'yarn' or 'proportional', with its parameters\. Received: rope_scaling=\{'rope_type': 'yarn', 'factor': 4\.0\}"),
    "rope_scaling_yarn_betas_swapped": ({**BASE, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 1.0, "beta_slow": 32.0}}, None, r"`rope_scaling` must be None or a dict .* Received: rope_scaling=.*'beta_fast': 1\.0"),
    "rope_scaling_yarn_attention_factor_negative": ({**BASE, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": -1.0}}, None, r"`rope_scaling` must be None or a dict .* Received: rope_scaling=.*'attention_factor': -1\.0"),
    "rope_scaling_yarn_truncate_not_bool": ({**BASE, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "truncate": "no"}}, None, r"`rope_scaling` must be None or a dict .* Received: rope_scaling=.*'truncate': 'no'"),
    "rope_scaling_proportional_fraction_above_one": ({**BASE, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "proportional", "partial_rotary_factor": 1.5}}, None, r"`rope_scaling` must be None or a dict whose rope_type is 'linear', 'llama3', 'yarn' or 'proportional', with its parameters\. Received: rope_scaling=\{'rope_type': 'proportional', 'partial_rotary_factor': 1\.5\}"),
    "rope_scaling_proportional_factor_zero": ({**BASE, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "proportional", "factor": 0}}, None, r"`rope_scaling` must be None or a dict .* Received: rope_scaling=.*'factor': 0\}"),
    "rope_scaling_missing_factor": ({**BASE, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear"}}, None, r"`rope_scaling` must be None or a dict"),
    "qk_norm_unknown": ({**BASE, "qk_norm": "layer"}, None, r"`qk_norm` must be None, 'head', 'per_head' or 'all'\. Received: qk_norm='layer'"),
    "qk_norm_type_unknown": ({**BASE, "qk_norm": "head", "qk_norm_type": "l2"}, None, r"`qk_norm_type` must be 'rms' or 'layer'\. Received: qk_norm_type='l2'"),
    "qk_norm_type_none_without_qk_norm": ({**BASE, "qk_norm_type": None}, None, r"`qk_norm_type` must be 'rms' or 'layer'\. Received: qk_norm_type=None"),
    "qk_norm_bias_not_bool": ({**BASE, "qk_norm": "head", "qk_norm_bias": 1}, None, r"`qk_norm_bias` must be True or False\. Received: qk_norm_bias=1"),
    "qk_norm_eps_zero": ({**BASE, "qk_norm": "head", "qk_norm_eps": 0.0}, None, r"`qk_norm_eps` must be a positive float\. Received: qk_norm_eps=0\.0"),
    # Regressions D6, D8, D9 (and the flags): one rule for the types each argument takes, in all three files
    "d06_bias_ndarray": ({**BASE, "bias": np.array(["query", "key"])}, None, r"`bias` must be True, False or a list, tuple or set of 'query', 'key', 'value', 'output', 'gate'\. Received: bias=array\("),
    "d06_bias_dict": ({**BASE, "bias": {"query": True}}, None, r"`bias` must be True, False or a list, tuple or set .* Received: bias=\{'query': True\}"),
    "d06_bias_dict_keys": ({**BASE, "bias": {"value": 1}.keys()}, None, r"`bias` must be True, False or a list, tuple or set .* Received: bias=dict_keys\(\['value'\]\)"),
    "d06_bias_none": ({**BASE, "bias": None}, None, r"`bias` must be True, False or a list, tuple or set .* Received: bias=None"),
    "d08_rope_fraction_none_with_rope": ({**BASE, "rope_theta": 10000.0, "rope_fraction": None}, None, r"`rope_fraction` must be in \(0, 1\] .* Received: rope_fraction=None, head_dim=4"),
    "d08_rope_fraction_none_without_rope": ({**BASE, "rope_fraction": None}, None, r"`rope_fraction` must be in \(0, 1\] .* Received: rope_fraction=None, head_dim=4"),
    "rope_fraction_above_one_without_rope": ({**BASE, "rope_fraction": 1.5}, None, r"`rope_fraction` must be in \(0, 1\] .* Received: rope_fraction=1\.5, head_dim=4"),
    "rope_scaling_without_rope": ({**BASE, "rope_scaling": {"rope_type": "linear"}}, None, r"`rope_scaling` must be None or a dict"),
    "qk_norm_eps_without_qk_norm": ({**BASE, "qk_norm_eps": -1.0}, None, r"`qk_norm_eps` must be a positive float\. Received: qk_norm_eps=-1\.0"),
    "d09_dropout_none": ({**BASE, "dropout": None}, None, r"`dropout` must be in \[0, 1\)\. Received: dropout=None"),
    "dropout_bool": ({**BASE, "dropout": True}, None, r"`dropout` must be in \[0, 1\)\. Received: dropout=True"),
    "dropout_string": ({**BASE, "dropout": "0.1"}, None, r"`dropout` must be in \[0, 1\)\. Received: dropout='0\.1'"),
    "sinks_not_bool": ({**BASE, "sinks": 1}, None, r"`sinks` must be True or False\. Received: sinks=1"),
    "rope_interleaved_not_bool": ({**BASE, "rope_interleaved": "yes"}, None, r"`rope_interleaved` must be True or False\. Received: rope_interleaved='yes'"),
    "scale_bool": ({**BASE, "scale": True}, None, r"`scale` must be a positive float\. Received: scale=True"),
    "window_float": ({**BASE, "window": 2.0}, None, r"`window` must be None, a positive integer or a pair \(before, after\) of positive integers\. Received: window=2\.0"),
    "clip_qkv_negative": ({**BASE, "clip_qkv": -1.0}, None, r"`clip_qkv` must be None or a positive float\. Received: clip_qkv=-1\.0"),
    "clip_qkv_bool": ({**BASE, "clip_qkv": True}, None, r"`clip_qkv` must be None or a positive float\. Received: clip_qkv=True"),
    "clip_qkv_string": ({**BASE, "clip_qkv": "1"}, None, r"`clip_qkv` must be None or a positive float\. Received: clip_qkv='1'"),
    # The checks' one order (the signature's, the two flags last): every file names the same first bad argument
    "order_qk_norm_eps_before_flags": ({**BASE, "sinks": 1, "rope_interleaved": 0, "qk_norm_eps": 0.0}, None, r"`qk_norm_eps` must be a positive float\. Received: qk_norm_eps=0\.0"),
    "order_clip_qkv_before_flags": ({**BASE, "sinks": 1, "rope_interleaved": 0, "clip_qkv": 0.0}, None, r"`clip_qkv` must be None or a positive float\. Received: clip_qkv=0\.0"),
    "order_qk_norm_eps_before_clip_qkv": ({**BASE, "clip_qkv": -1.0, "qk_norm_eps": 0.0}, None, r"`qk_norm_eps` must be a positive float\. Received: qk_norm_eps=0\.0"),
    "order_window_before_attention_chunk_size": ({**BASE, "attention_chunk_size": 0, "window": 0}, None, r"`window` must be None"),
    "order_attention_chunk_size_before_rope_theta": ({**BASE, "rope_theta": 0.0, "attention_chunk_size": 0}, None, r"`attention_chunk_size` must be a positive integer"),
    "order_rope_scaling_before_rope_sections": ({**BASE, "rope_sections": "x", "rope_scaling": 1}, None, r"`rope_scaling` must be None or a dict"),
    "order_rope_sections_before_qk_norm": ({**BASE, "qk_norm": "x", "rope_sections": "x"}, None, r"`rope_sections` must be None or a list"),
    "order_qk_norm_eps_before_qk_norm_type": ({**BASE, "qk_norm_type": "x", "qk_norm_eps": 0.0}, None, r"`qk_norm_eps` must be a positive float"),
    "order_qk_norm_type_before_clip_qkv": ({**BASE, "clip_qkv": 0.0, "qk_norm_type": "x"}, None, r"`qk_norm_type` must be 'rms' or 'layer'"),
    "order_rope_interleaved_before_qk_norm_bias": ({**BASE, "qk_norm_bias": 1, "rope_interleaved": 0}, None, r"`rope_interleaved` must be True or False"),
    "order_qk_norm_bias_before_sinks": ({**BASE, "sinks": 1, "qk_norm_bias": 0}, None, r"`qk_norm_bias` must be True or False"),
    "order_rope_interleaved_before_sinks": ({**BASE, "sinks": 1, "rope_interleaved": 0}, None, r"`rope_interleaved` must be True or False\. Received: rope_interleaved=0"),
    "gate_not_bool": ({**BASE, "gate": 1}, None, r"`gate` must be True or False\. Received: gate=1"),
    "order_sinks_before_gate": ({**BASE, "gate": None, "sinks": 0}, None, r"`sinks` must be True or False\. Received: sinks=0"),
    "output_norm_unknown": ({**BASE, "output_norm": "group"}, None, r"^`output_norm` must be None, 'rms' or 'layer'\. Received: output_norm='group'$"),
    "output_norm_eps_zero_without_output_norm": ({**BASE, "output_norm_eps": 0.0}, None, r"^`output_norm_eps` must be a positive float\. Received: output_norm_eps=0\.0$"),
    "order_output_norm_after_the_indexer": ({**BASE, "output_norm": 1, "index_num_heads": 2}, None, r"^`index_num_heads` needs `index_topk`"),
    "order_output_norm_before_output_norm_eps": ({**BASE, "output_norm_eps": -1, "output_norm": True}, None, r"^`output_norm` must be None, 'rms' or 'layer'\. Received: output_norm=True$"),
    "qk_norm_after_rope_not_bool": ({**BASE, "qk_norm_after_rope": 1}, None, r"^`qk_norm_after_rope` must be True or False\. Received: qk_norm_after_rope=1$"),
    "order_output_norm_eps_before_qk_norm_after_rope": ({**BASE, "qk_norm_after_rope": 1, "output_norm_eps": 0}, None, r"^`output_norm_eps` must be a positive float"),
    "gate_activation_unknown": ({**BASE, "gate": True, "gate_activation": "relu"}, None, r"`gate_activation` must be 'sigmoid' or 'softplus'\. Received: gate_activation='relu'"),
    "gate_activation_not_str": ({**BASE, "gate": True, "gate_activation": None}, None, r"`gate_activation` must be 'sigmoid' or 'softplus'\. Received: gate_activation=None"),
    "order_gate_before_gate_activation": ({**BASE, "gate": 1, "gate_activation": "x"}, None, r"`gate` must be True or False\. Received: gate=1"),
    "order_dropout_before_bias": ({**BASE, "bias": None, "dropout": None}, None, r"`dropout` must be in \[0, 1\)\. Received: dropout=None"),
    # The new call arguments
    "mixed_input_dtypes": (BASE, {"query": X, "key": Y.astype(np.float16), "value": Y.astype(np.float16)}, r"`query`, `key` and `value` must have the same dtype\. Received: query\.dtype=float32, key\.dtype=float16, value\.dtype=float16"),
    "positions_without_rope": (BASE, {"query": X, "positions": np.arange(3)}, r"`positions` needs RoPE: construct the layer with `rope_theta`\. Received: positions with rope_theta=None"),
    "positions_shape": ({**BASE, "rope_theta": 10000.0}, {"query": X, "positions": np.arange(4)}, r"`positions` must be an integer tensor of shape \(B, T\) or \(T,\) with B=2, T=3\. Received: positions\.shape=\(4,\), positions\.dtype=int64"),
    "positions_sections_shape": ({**BASE, "rope_theta": 10000.0, "rope_sections": (1, 1)}, {"query": X, "positions": np.zeros((3, 2, 3), np.int64)}, r"`positions` must be an integer tensor of shape \(B, T\), \(T,\) or \(2, B, T\) with B=2, T=3 \(one row per section of `rope_sections`\)\. Received: positions\.shape=\(3, 2, 3\), positions\.dtype=int64"),
    "positions_3d_without_sections": ({**BASE, "rope_theta": 10000.0}, {"query": X, "positions": np.zeros((1, 2, 3), np.int64)}, r"`positions` must be an integer tensor of shape \(B, T\) or \(T,\) with B=2, T=3\. Received: positions\.shape=\(1, 2, 3\)"),
    "positions_float": ({**BASE, "rope_theta": 10000.0}, {"query": X, "positions": np.zeros((2, 3), np.float32)}, r"`positions` must be an integer tensor .* Received: positions\.shape=\(2, 3\), positions\.dtype=float32"),
    "rope_cross_attention": ({**BASE, "rope_theta": 10000.0}, {"query": X, "key": Y, "value": Y}, r"RoPE needs `key` and `value` to hold the query's own tokens \(S == T, or decoding with `cache`\)\. Received: query\.shape=\(2, 3, 8\), key\.shape=\(2, 5, 8\)"),
    "key_mask_shape": (BASE, {"query": X, "key": Y, "value": Y, "key_mask": np.ones((2, 3), bool)}, r"`key_mask` must be a boolean tensor of shape \(B, S\)=\(2, 5\)\. Received: key_mask\.shape=\(2, 3\), key_mask\.dtype=bool"),
    "key_mask_float": (BASE, {"query": X, "key": Y, "value": Y, "key_mask": np.ones((2, 5), np.float32)}, r"`key_mask` must be a boolean tensor .* Received: key_mask\.shape=\(2, 5\), key_mask\.dtype=float32"),
    "query_mask_shape": (BASE, {"query": X, "query_mask": np.ones((2, 5), bool)}, r"`query_mask` must be a boolean tensor of shape \(B, T\)=\(2, 3\)\. Received: query_mask\.shape=\(2, 5\), query_mask\.dtype=bool"),
    "attention_bias_boolean": (BASE, {"query": X, "attention_bias": np.ones((3, 3), bool)}, r"`attention_bias` must be floating\. Received: attention_bias\.dtype=bool"),
    "attention_bias_shape": (BASE, {"query": X, "key": Y, "value": Y, "attention_bias": np.zeros((3, 4), np.float32)}, r"`attention_bias` must broadcast to \(B, N, T, S\) .* Received: attention_bias\.shape=\(3, 4\)"),
}  # fmt: skip


def _torch_call(kwargs, call):

    from PyTorch import MultiHeadAttention

    layer = MultiHeadAttention(**kwargs)
    if call is not None:
        layer(**_converted("torch", call))
    return layer


KERAS_FRAME = re.compile(r"Exception encountered when calling .*?\x1b\[1m(.*?)\x1b\[0m", re.DOTALL)


def _tf_call(kwargs, call, module="TensorFlow"):
    """Keras frames every error raised in `call()` ("Exception encountered when calling ...",
    the layer's message in bold, then the arguments received); this compares the layer's own
    message, and checks that Keras kept it verbatim. `module`: the TensorFlow file, or the Keras
    file (here on the TensorFlow backend; test_keras.py runs it on the others)."""
    layer = __import__(module).MultiHeadAttention(**kwargs)
    if call is not None:
        try:
            layer(**_converted("tf", call))
        except ValueError as error:
            framed = KERAS_FRAME.match(str(error))
            raise ValueError(framed.group(1) if framed else str(error)) from error
    return layer


def _numpy_call(kwargs, call):
    layer = NumpyMultiHeadAttention(**kwargs)
    if call is not None:
        layer(**call)
    return layer


def _converted(framework, call):
    """Call arguments as the framework's tensors (NumPy arrays stay arrays; flags stay flags)."""
    if framework == "numpy":
        return call
    import tensorflow as tf
    import torch

    convert = torch.from_numpy if framework == "torch" else tf.constant  # the Keras file runs on TensorFlow here
    return {k: convert(np.asarray(v)) if isinstance(v, np.ndarray) else v for k, v in call.items()}


# The Keras file runs on the TensorFlow backend here, framed by Keras as the TensorFlow file is
CALLERS = {
    "torch": _torch_call,
    "tf": _tf_call,
    "keras": functools.partial(_tf_call, module="Keras"),
    "numpy": _numpy_call,
}
MASK_CALLERS = CALLERS  # the mask habits, the valid masks and `mask=`: the same four layers


def test_table_has_at_least_15_bad_inputs():
    assert len(CASES) >= 15


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_value_error_in_all_three(name):
    """Every file, the Keras file included (regression: it once lacked the D-rule argument checks
    of docs/SPEC.md "Argument types": `dropout=None`, `rope_fraction=None`, flags of 0 or 1, a
    switched-off variant's arguments)."""
    kwargs, call, pattern = CASES[name]
    messages = {}
    for framework, caller in CALLERS.items():
        with pytest.raises(ValueError, match=pattern) as error:
            caller(kwargs, call)
        messages[framework] = str(error.value)
    assert len(set(messages.values())) == 1, messages


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
# name: constructor kwargs every file accepts, and the attributes they must all give
ACCEPTED_ARGUMENTS = {
    "d07_yarn_truncate_numpy_bool": (
        {**BASE, "rope_theta": 10000.0, "rope_scaling": {**YARN, "truncate": np.bool_(False)}}, {"rope_theta": 10000.0},
    ),
    "numpy_scalars": (
        {"d_model": np.int64(8), "num_heads": np.int32(2), "head_dim": np.int16(4), "scale": np.float32(0.5),
         "softcap": np.float64(3.0), "window": np.uint8(2), "rope_theta": np.int64(100), "rope_fraction": np.float32(0.5),
         "qk_norm_eps": np.float32(1e-5), "rope_interleaved": np.bool_(True), "sinks": np.bool_(True), "dropout": np.float64(0.0),
         "clip_qkv": np.float32(0.5)},
        {"d_model": 8, "num_heads": 2, "head_dim": 4, "scale": 0.5, "softcap": 3.0, "window": 2, "rope_theta": 100.0,
         "rope_fraction": 0.5, "rope_interleaved": True, "sinks": True, "dropout": 0.0, "clip_qkv": 0.5},
    ),
    "bias_numpy_bool": ({**BASE, "bias": np.bool_(False)}, {"bias": ()}),
    "new_variants_numpy_scalars": (
        {**BASE, "window": [np.int64(3), 2], "attention_chunk_size": np.int32(4), "rope_theta": 100.0,
         "rope_sections": [np.int64(1), 1], "qk_norm": np.str_("per_head"), "qk_norm_type": np.str_("layer"),
         "qk_norm_bias": np.bool_(True)},
        {"window": (3, 2), "attention_chunk_size": 4, "rope_sections": (1, 1), "qk_norm": "per_head",
         "qk_norm_type": "layer", "qk_norm_bias": True},
    ),
    "rope_sections_without_rope": ({**BASE, "rope_sections": (5, 7)}, {"rope_sections": (5, 7), "rope_theta": None}),
    "output_norm_numpy_scalars": (
        {**BASE, "output_norm": np.str_("layer"), "output_norm_eps": np.float32(1e-5)},
        {"output_norm": "layer", "output_norm_eps": float(np.float32(1e-5))},
    ),
    "bias_frozenset": ({**BASE, "bias": frozenset({"value", "query"})}, {"bias": ("query", "value")}),
    "bias_list_with_duplicates": ({**BASE, "bias": ["output", "key", "output"]}, {"bias": ("key", "output")}),
    "bias_empty_tuple": ({**BASE, "bias": ()}, {"bias": ()}),
    "bias_names_the_gate": ({**BASE, "gate": np.bool_(True), "bias": ["gate", "query"]}, {"bias": ("query", "gate")}),
    "bias_true_of_a_gated_layer": ({**BASE, "gate": True}, {"bias": ("query", "key", "value", "output", "gate")}),
    "gate_activation_numpy_str": ({**BASE, "gate": True, "gate_activation": np.str_("softplus")}, {"gate_activation": "softplus"}),
    "gate_activation_held_without_gate": ({**BASE, "gate_activation": "softplus"}, {"gate_activation": "softplus"}),
    # a variant switched off: its arguments are checked on their own, never against the others
    "rope_fraction_odd_without_rope": ({**BASE, "rope_fraction": 0.25}, {"rope_fraction": 0.25, "rope_theta": None}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ACCEPTED_ARGUMENTS))
def test_python_and_numpy_arguments_are_accepted_alike(name):
    """Regression D7 (YaRN's `truncate=np.bool_(False)` was refused by PyTorch only), and the rule
    of docs/SPEC.md "Argument types": Python and NumPy scalars alike, a bool or a list, tuple or
    set for `bias`, and a switched-off variant's arguments checked on their own."""
    kwargs, expected = ACCEPTED_ARGUMENTS[name]
    for framework, cls in layer_classes().items():
        layer = cls(**kwargs)
        got = {attribute: getattr(layer, attribute) for attribute in expected}
        if framework == "torch" and "sinks" in got:  # the PyTorch layer holds the sink logits as `sinks`
            got["sinks"] = got["sinks"] is not None
        assert got == expected, (framework, got)
        assert all(type(value) is type(expected[key]) for key, value in got.items()), (framework, got)


def test_regression_rope_scaling_is_held_with_python_scalars():
    """The layer holds a copy of `rope_scaling` whose NumPy scalars are Python's, so none reaches
    `get_config` (the Keras file once kept the dict as given)."""
    scaling = {"rope_type": "yarn", "factor": np.float32(4.0), "original_max_position_embeddings": np.int64(64),
               "beta_fast": np.int32(16), "truncate": np.bool_(False)}  # fmt: skip
    expected = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16,
                "truncate": False}  # fmt: skip
    for framework, cls in layer_classes().items():
        held = cls(**BASE, rope_theta=10000.0, rope_scaling=scaling).rope_scaling
        assert held == expected and held is not scaling, (framework, held)
        assert [type(value) for value in held.values()] == [type(value) for value in expected.values()], framework


def test_proportional_rope_scaling_is_held_and_round_trips_through_get_config():
    """Gemma 4's full-layer `rope_parameters` as the layers' `rope_scaling`: held with Python scalars
    (None, an absent option, kept), `get_config` gives the dict back and `from_config` takes it."""
    scaling = {"rope_type": "proportional", "partial_rotary_factor": np.float32(0.25), "factor": None}
    expected = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": None}
    for framework, cls in layer_classes().items():
        layer = cls(**BASE, rope_theta=100.0, rope_scaling=scaling)
        assert layer.rope_scaling == expected and type(layer.rope_scaling["partial_rotary_factor"]) is float, framework
        if framework in ("tf", "keras"):
            config = layer.get_config()
            assert config["rope_scaling"] == expected and cls.from_config(config).rope_scaling == expected, framework


POSITIONS = {
    "float": np.arange(5.0),
    "bool": np.ones(3, bool),
    "rank_3": np.arange(8).reshape(2, 2, 2),
    "rank_0": np.array(3),
}


@pytest.mark.parametrize("name", sorted(POSITIONS))
def test_d10_alibi_bias_refuses_alike(name):
    """Regression D10: NumPy's `alibi_bias` accepted float, bool and rank-3 positions, which the
    others refuse; all three refuse them with one message (and NumPy/__init__.py exports it)."""
    import torch

    from Keras import alibi_bias as keras_alibi
    from NumPy import alibi_bias as numpy_alibi
    from PyTorch import alibi_bias as torch_alibi
    from TensorFlow import alibi_bias as tf_alibi

    positions = POSITIONS[name]
    messages = {}
    for framework, alibi, convert in (
        ("numpy", numpy_alibi, np.asarray), ("torch", torch_alibi, torch.from_numpy), ("tf", tf_alibi, np.asarray),
        ("keras", keras_alibi, np.asarray),
    ):  # fmt: skip
        with pytest.raises(
            ValueError, match=r"`positions` must be an integer tensor of shape \(S,\) or \(B, S\)\. "
        ) as error:
            alibi(2, convert(positions))
        messages[framework] = str(error.value)
    assert len(set(messages.values())) == 1, messages


# The built-ins' habits, read from mask values: a warning, never an error (docs/SPEC.md, Masks).
# name: (call arguments, regex the warning must match)
HABITS = {
    "torch_polarity_attention_mask": ({"query": X, "key": Y, "value": Y, "attention_mask": np.zeros((2, 1, 5), bool)}, r"^`attention_mask` keeps no key for any query, so every output row is `output_bias`: True means attend \(in nn\.MultiheadAttention True means ignore: pass `~mask`\)\. Received: a boolean attention_mask that is False everywhere$"),
    "torch_polarity_key_mask": ({"query": X, "key": Y, "value": Y, "key_mask": np.zeros((2, 5), bool)}, r"^`key_mask` keeps no key for any query, so every output row is `output_bias`: .* Received: a boolean key_mask that is False everywhere$"),
    "torch_causal_attn_mask": ({"query": X, "attention_mask": np.triu(np.ones((3, 3), bool), 1)}, r"^`attention_mask` keeps keys only after each query, none at or before it: True means attend \(in nn\.MultiheadAttention True means ignore: pass `~mask`, or `causal=True`\)\. Received: a boolean attention_mask False wherever causal attention keeps a key$"),
    "torch_causal_attn_mask_and_causal": ({"query": X, "attention_mask": np.triu(np.ones((3, 3), bool), 1), "causal": True}, r"^`attention_mask` keeps keys only after each query, none at or before it"),
    "torch_key_padding_mask": ({"query": X, "key": Y, "value": Y, "key_mask": np.arange(5) >= np.array([[5], [3]])}, r"^`key_mask` reads as nn\.MultiheadAttention's key_padding_mask \(True = padding\): True means a real key, pass `~mask`\. Received: a key_mask False then True in every row, 1 of 2 rows keeping no key and none keeping all$"),
    "keras_zero_one_float": ({"query": X, "key": Y, "value": Y, "attention_mask": np.ones((2, 3, 5), np.float32)}, r"^`attention_mask` holds only 0s and 1s, but a floating mask is added to the scores \(Keras reads such a mask as boolean\): pass `mask > 0` \(True = attend\) or an additive mask\. Received: a floating attention_mask of 0s and 1s$"),
}  # fmt: skip

# Valid input near the habits, or valid input the habits' checks once refused: no warning.
# name: (call arguments, initial cache keep and prompt length or None)
VALID = {
    "left_padding_with_a_full_row": ({"query": X, "key": Y, "value": Y, "key_mask": np.arange(5) >= np.array([[0], [2]])}, None),
    "empty_left_padded_sequence_as_attention_mask": ({"query": X, "key": Y, "value": Y, "attention_mask": (np.arange(5) >= np.array([[5], [2]]))[:, None, :]}, None),
    "one_sequence_all_padding": ({"query": X, "key_mask": np.array([[True, True, False], [False, False, False]])}, None),
    "anti_causal_with_the_diagonal": ({"query": X, "attention_mask": np.triu(np.ones((3, 3), bool))}, None),
    "cross_attention_keeping_only_later_keys": ({"query": X, "key": Y, "value": Y, "attention_mask": np.triu(np.ones((2, 3, 5), bool), 3)}, None),
    "regression_t_above_s_first_query_only": ({"query": X[:, :2], "key": Y[:, :1], "value": Y[:, :1], "attention_mask": np.array([[[True], [False]]])}, None),  # found by test_properties: T=2, S=1
    "regression_2d_mask_with_b_equal_to_t": ({"query": np.concatenate([X, X[:1]])[:, :3], "attention_mask": np.tril(np.ones((3, 3), bool))}, None),  # B == T == 3: a (T, S) mask, once refused
    "regression_decode_step_all_padding": ({"query": X[:1, :1], "key_mask": np.zeros((1, 1), bool), "causal": True}, (np.ones((1, 4), bool), 2)),  # key_mask [[False]] at B=1, once refused
    "decode_step_padding_in_every_row": ({"query": X[:, :1], "key_mask": np.zeros((2, 1), bool), "causal": True}, (np.ones((2, 4), bool), 2)),
}  # fmt: skip


def _warning_class(framework):
    """Each layer file defines its own AttentionMaskWarning (each file stands alone)."""
    module = {"torch": "PyTorch", "tf": "TensorFlow", "keras": "Keras", "numpy": "NumPy"}[framework]
    return __import__(module).AttentionMaskWarning


def _is_habit(warning):
    return warning.category.__name__ == "AttentionMaskWarning" and issubclass(warning.category, UserWarning)


def _run_all(call, cache=None):
    """The call in all three layers (the same weights) as NumPy outputs, with the warnings each raised:
    {framework: (output, [warning messages])}. `cache`: (keep, P) decodes a prompt of P tokens first."""
    from PyTorch import MultiHeadAttention as TorchMultiHeadAttention
    from TensorFlow import MultiHeadAttention as TFMultiHeadAttention

    reference = NumpyMultiHeadAttention(**BASE, seed=0)
    layers = {
        "numpy": reference,
        "torch": TorchMultiHeadAttention(**BASE),
        "tf": TFMultiHeadAttention(**BASE),
        "keras": __import__("Keras").MultiHeadAttention(**BASE),
    }
    results = {}
    for framework, layer in layers.items():
        layer.import_weights(reference.export_weights())
        args = _converted(framework, call)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cache is None:
                output = layer(**args)
            else:
                keep, prompt = cache
                prompt = {"query": np.full((keep.shape[0], prompt, 8), 0.5, np.float32), "causal": True}
                state = layer.init_cache(keep.shape[0], keep.shape[1], keep=_converted(framework, {"k": keep})["k"])
                _, state = layer(**_converted(framework, prompt), cache=state)
                output, _ = layer(**args, cache=state)
        output = output.detach().numpy() if framework == "torch" else np.asarray(output)
        habits = [str(w.message) for w in caught if _is_habit(w)]
        results[framework] = (output, habits)
    return results


@pytest.mark.parametrize("name", sorted(HABITS))
def test_each_habit_warns_the_same_in_all_three_and_computes_by_the_spec(name):
    call, pattern = HABITS[name]
    results = _run_all(call)
    for framework, (output, habits) in results.items():
        assert len(habits) == 1 and re.search(pattern, habits[0]), (framework, habits)
        np.testing.assert_allclose(output, results["numpy"][0], atol=OUTPUT_TOL, rtol=0, err_msg=framework)
    assert len({habits[0] for _, habits in results.values()}) == 1


@pytest.mark.parametrize("name", sorted(HABITS))
def test_a_habit_is_an_error_where_the_warning_is_made_one(name):
    call, pattern = HABITS[name]
    for framework, caller in MASK_CALLERS.items():
        habit = _warning_class(framework)
        with warnings.catch_warnings():
            warnings.simplefilter("error", habit)
            with pytest.raises(habit) as error:
                caller(BASE, call)
        framed = KERAS_FRAME.match(str(error.value))
        assert re.search(pattern, framed.group(1) if framed else str(error.value)), framework


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_masks_compute_by_the_spec_without_a_warning(name):
    call, cache = VALID[name]
    results = _run_all(call, cache)
    for framework, (output, habits) in results.items():
        assert habits == [], (framework, habits)
        np.testing.assert_allclose(output, results["numpy"][0], atol=OUTPUT_TOL, rtol=0, err_msg=framework)


@pytest.mark.parametrize("mask", ["attention_mask", "key_mask"])
def test_all_false_masks_give_output_bias_rows(mask):
    """A batch of only padding (DDP on uneven inputs): every row has no key, so every output row
    is the output bias, in all three layers (with the polarity warning)."""
    call = {"query": X, mask: np.zeros((2, 3) if mask == "key_mask" else (3, 3), bool)}
    for framework, (output, _) in _run_all(call).items():
        bias = NumpyMultiHeadAttention(**BASE, seed=0).params["output_bias"]
        np.testing.assert_allclose(
            output, np.broadcast_to(bias, output.shape), atol=OUTPUT_TOL, rtol=0, err_msg=framework
        )


def test_a_layer_warns_of_each_habit_once():
    call, _ = HABITS["torch_polarity_key_mask"]
    for framework, caller in MASK_CALLERS.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layer = caller(BASE, call)
            layer(**_converted(framework, call))
            caller(BASE, call)  # a new layer warns again
        assert sum(_is_habit(w) for w in caught) == 2, framework


def test_mask_is_attention_mask_and_both_is_an_error():
    mask = np.tril(np.ones((3, 3), bool))
    results = {name: output for name, (output, _) in _run_all({"query": X, "mask": mask}).items()}
    for framework, (output, _) in _run_all({"query": X, "attention_mask": mask}).items():
        np.testing.assert_array_equal(output, results[framework], err_msg=framework)
    pattern = (
        r"^Pass the attention mask as `attention_mask` or as `mask`, not both\. Received: attention_mask and mask$"
    )
    for caller in MASK_CALLERS.values():
        with pytest.raises(ValueError, match=pattern):
            caller(BASE, {"query": X, "attention_mask": mask, "mask": mask})


def test_the_seed_usage_is_positional_query_key_value_in_all_three():
    """`mha = MultiHeadAttention(d_model=512, num_heads=8); output = mha(query, key, value, mask=None)`."""
    import tensorflow as tf
    import torch

    from PyTorch import MultiHeadAttention as TorchMultiHeadAttention
    from TensorFlow import MultiHeadAttention as TFMultiHeadAttention

    query, key, value = (rng.normal(size=(2, t, 512)).astype(np.float32) for t in (3, 5, 5))
    numpy_layer = NumpyMultiHeadAttention(d_model=512, num_heads=8, seed=0)
    expected = numpy_layer(query, key, value, mask=None)
    torch_layer, tf_layer = (
        TorchMultiHeadAttention(d_model=512, num_heads=8),
        TFMultiHeadAttention(d_model=512, num_heads=8),
    )
    for layer in (torch_layer, tf_layer):
        layer.import_weights(numpy_layer.export_weights())
    outputs = {
        "torch": torch_layer(*(torch.from_numpy(x) for x in (query, key, value)), mask=None).detach().numpy(),
        "tf": np.asarray(tf_layer(*(tf.constant(x) for x in (query, key, value)), mask=None)),
    }
    for framework, output in outputs.items():
        np.testing.assert_allclose(output, expected, atol=OUTPUT_TOL, rtol=0, err_msg=framework)
    swapped = numpy_layer(query, value, key)  # positional order matters: (query, key, value)
    assert not np.allclose(swapped, expected)


def test_numpy_reference_refuses_dropout_with_its_own_message():
    """The one error that only the reference has: it has no dropout at all."""
    with pytest.raises(ValueError, match=r"`dropout` must be 0: the NumPy reference has no dropout"):
        NumpyMultiHeadAttention(8, 2, dropout=0.1)


def _layers():
    config = {"d_model": 8, "num_heads": 4, "num_kv_heads": 2}
    return {
        framework: cls(**config, seed=0) if framework == "numpy" else cls(**config)
        for framework, cls in layer_classes().items()
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


# Multi-head latent attention (docs/SPEC.md "Multi-head latent attention"): every file whose layer has it
MLA_BASE = {**BASE, "kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 3}
MLA_CACHE = {"key": np.zeros((2, 2, 6, 4), np.float32), "value": np.zeros((2, 2, 6, 2), np.float32)}  # K heads: plain
MLA_ERRORS = {
    "mla_q_lora_rank_without_kv_lora_rank": ({**BASE, "q_lora_rank": 4}, None, r"`q_lora_rank` needs `kv_lora_rank` \(multi-head latent attention\)\. Received: q_lora_rank=4, kv_lora_rank=None"),
    "mla_v_head_dim_without_kv_lora_rank": ({**BASE, "v_head_dim": 3}, None, r"`v_head_dim` needs `kv_lora_rank` \(multi-head latent attention\)\. Received: v_head_dim=3, kv_lora_rank=None"),
    "mla_missing_sizes": ({**BASE, "kv_lora_rank": 4, "qk_nope_head_dim": 2}, None, r"`kv_lora_rank` needs `qk_nope_head_dim`, `qk_rope_head_dim` and `v_head_dim`\. Received: kv_lora_rank=4, qk_rope_head_dim=None, v_head_dim=None"),
    "mla_kv_lora_rank_float": ({**MLA_BASE, "kv_lora_rank": 4.0}, None, r"`kv_lora_rank` must be a positive integer\. Received: kv_lora_rank=4\.0"),
    "mla_head_dim_differs": ({**MLA_BASE, "head_dim": 5}, None, r"`head_dim` must equal qk_nope_head_dim \+ qk_rope_head_dim = 4 with `kv_lora_rank`\. Received: head_dim=5"),
    "mla_latent_norm_eps_zero": ({**BASE, "latent_norm_eps": 0.0}, None, r"`latent_norm_eps` must be a positive float\. Received: latent_norm_eps=0\.0"),
    "mla_bias_key": ({**MLA_BASE, "bias": ("key",)}, None, r"`bias` must be True, False or a list, tuple or set of 'query', 'key_value_a', 'key_value_b', 'output', 'gate'\. Received: bias=\('key',\)"),
    "mla_bias_name_without_mla": ({**BASE, "bias": ("key_value_a",)}, None, r"`bias` must be True, False or a list, tuple or set of 'query', 'key', 'value', 'output', 'gate'\. Received: bias=\('key_value_a',\)"),
    "mla_vdim": ({**MLA_BASE, "vdim": 6}, None, r"`vdim` is not supported with `kv_lora_rank`: MLA reads keys and values from `key` \(its width is `kdim`\)\. Received: vdim=6"),
    "mla_qk_norm": ({**MLA_BASE, "qk_norm": "head"}, None, r"`qk_norm` is not supported with `kv_lora_rank`: MLA normalizes the latents instead\. Received: qk_norm='head'"),
    "mla_clip_qkv": ({**MLA_BASE, "clip_qkv": 1.0}, None, r"`clip_qkv` is not supported with `kv_lora_rank`: MLA has no q, k and v to clamp\. Received: clip_qkv=1\.0"),
    "mla_rope_fraction": ({**MLA_BASE, "rope_theta": 100.0, "rope_fraction": 0.5, "qk_rope_head_dim": 4}, None, r"`rope_fraction` is not supported with `kv_lora_rank`: RoPE turns all Hr features\. Received: rope_fraction=0\.5"),
    "mla_value_not_key": (MLA_BASE, {"query": X, "key": Y, "value": Y.copy()}, r"`value` must be None or `key` itself with `kv_lora_rank`: MLA reads keys and values from `key`\. Received: a value other than key"),
    "learned_query_scaling_with_beta": ({**BASE, "query_scaling": {"type": "learned", "beta": 1.0}}, None, r"`query_scaling` must be None, \{'type': 'learned'\} or a dict \{'type': 'temperature' or 'positions', 'beta': a finite number, 'floor': a positive number\}\. Received: query_scaling=\{'type': 'learned', 'beta': 1\.0\}"),
    "learned_query_scaling_sections": ({**BASE, "rope_theta": 10.0, "rope_sections": (1, 1), "query_scaling": {"type": "learned"}}, None, r"`query_scaling` of type 'learned' reads one row of positions, not the \(k, B, T\) of `rope_sections`\. Received: query_scaling=\{'type': 'learned'\}, rope_sections=\(1, 1\)"),
    "index_query_input_norm_without_index_topk": ({**MLA_BASE, "index_query_input_norm": True}, None, r"`index_query_input_norm` needs `index_topk` \(the sparse indexer\)\. Received: index_query_input_norm=True"),
}  # fmt: skip


def _mla_callers():
    """The callers of the layer files that have MLA (the others join once they do)."""
    from shared_tests.calling import LAYER_FILES, layer_source

    folders = {**LAYER_FILES, "numpy": "NumPy"}
    return {name: caller for name, caller in CALLERS.items() if "kv_lora_rank=" in layer_source(folders[name])}


@pytest.mark.parametrize("name", sorted(MLA_ERRORS))
def test_mla_value_errors_alike(name):
    kwargs, call, pattern = MLA_ERRORS[name]
    messages = {}
    callers = _mla_callers()
    assert {"numpy", "torch"} <= set(callers)
    for framework, caller in callers.items():
        with pytest.raises(ValueError, match=pattern) as error:
            caller(kwargs, call)
        messages[framework] = str(error.value)
    assert len(set(messages.values())) == 1, messages


def test_mla_cache_of_another_shape_is_refused_alike():
    """A plain (B, K, L, H) cache given to an MLA layer: the latent cache's shapes are quoted."""
    pattern = (
        r"`cache\.key` and `cache\.value` must have shape \(B, 1, L, C\) and \(B, 1, L, Hr\) with kv_lora_rank: "
        r"B=2, C=4, Hr=2\. Received: cache\.key\.shape=\(2, 2, 6, 4\), cache\.value\.shape=\(2, 2, 6, 2\)"
    )
    for framework in _mla_callers():
        layer = CALLERS[framework](MLA_BASE, None)
        cache = layer.init_cache(2, 6)
        converted = _converted(framework, MLA_CACHE)
        wrong = cache._replace(key=converted["key"], value=converted["value"])
        with pytest.raises(ValueError, match=pattern):
            layer(_converted(framework, {"q": X})["q"], cache=wrong)
