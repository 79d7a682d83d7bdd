"""Bloom, Falcon and MPT: a fused q/k/v projection, and ALiBi as a call argument (`alibi_positions`), or
Falcon's RoPE."""

import numpy as np

from .config import _rope_kwargs, _rope_parameters
from .tensors import _blocks, _grouped, _per_head, _split_fused


def _bloom(config, tensors, index):
    """Bloom: fused q/k/v per head, ALiBi as a call argument; the module's residual add stays out."""
    num_heads = config["n_head"]
    width = config["hidden_size"]
    head_dim = width // num_heads
    weights, bias = _split_fused(tensors, "query_key_value", "dense", _per_head(num_heads, head_dim))
    return {"d_model": width, "num_heads": num_heads, "bias": bias, "scale": float(head_dim**-0.5)}, weights


def _falcon(config, tensors, index):
    """Falcon: a fused query_key_value laid out per head, multi-query or in groups (new decoder architecture);
    RoPE, or ALiBi as a call argument (`alibi=True`: Falcon scales the bias with the scores)."""
    width, num_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = width // num_heads
    if config.get("new_decoder_architecture"):
        num_kv_heads = config["num_kv_heads"]
        columns = _grouped(num_kv_heads, num_heads // num_kv_heads, head_dim)
    elif config.get("multi_query", True):
        num_kv_heads, columns = 1, _blocks(width, head_dim, head_dim)
    else:
        num_kv_heads, columns = num_heads, _per_head(num_heads, head_dim)
    weights, bias = _split_fused(tensors, "query_key_value", "dense", columns)
    kwargs = {"d_model": width, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "bias": bias}
    kwargs["scale"] = float(head_dim**-0.5)
    if not config.get("alibi"):
        kwargs |= _rope_kwargs(_rope_parameters(config, None), head_dim)
    return kwargs, weights


def _mpt(config, tensors, index):
    """MPT: a fused Wqkv [q | k | v], `softmax_scale`, `clip_qkv` (the fused projection clamped); its ALiBi is
    the call's `attention_bias`."""
    attn = config.get("attn_config") or {}
    if attn.get("alibi", True) and attn.get("alibi_bias_max", 8) != 8:
        raise ValueError(
            "`config.attn_config.alibi_bias_max` must be 8 (the slopes of the layer's `alibi_bias`). "
            f"Received: alibi_bias_max={attn['alibi_bias_max']}"
        )
    width, num_heads = config["d_model"], config["n_heads"]
    weights, bias = _split_fused(tensors, "Wqkv", "out_proj", _blocks(width, width, width))
    scale = attn.get("softmax_scale") or (width / num_heads) ** -0.5
    kwargs = {"d_model": width, "num_heads": num_heads, "bias": bias, "scale": float(scale)}
    if attn.get("clip_qkv"):  # MPT clamps only where it is truthy
        kwargs["clip_qkv"] = float(attn["clip_qkv"])
    return kwargs, weights


def alibi_positions(key_mask):
    """Bloom's ALiBi key positions, (B, S) int64: `(cumsum(key_mask) - 1) * key_mask` (0 at padding).

    Pass `alibi_bias(num_heads, alibi_positions(mask))` (the layer file's function) as `attention_bias`.
    """
    key_mask = np.asarray(key_mask).astype(np.int64)
    return (np.cumsum(key_mask, axis=-1) - 1) * key_mask
