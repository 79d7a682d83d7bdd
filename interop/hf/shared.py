"""Cross-layer KV sharing: Gemma 3n's and Gemma 4's text attention (`gemma3n`, `gemma4`, `gemma4_unified`).

Their layers are q_proj, k_proj, v_proj and o_proj with RMS QK-norms whose scale is the weight itself (not 1 +
weight, as Gemma 1-3's), an RMSNorm without a scale on the values (`v_norm`: the layer's `value_norm`), a softmax
scale of 1 and RoPE per layer type. The last `num_kv_shared_layers` layers ("reuse" in the config's
`kv_sharing_modes`) have no k_proj or v_proj: they attend the keys and values of the last earlier layer of their
type (its "store" layer) and port as `kv_shared=True` (the call takes them through `shared_kv`; `replace_attention`
passes them from layer to layer). Gemma 4's full-attention layers with `attention_k_eq_v` have no v_proj (the
layer's `keys_as_values`), and their own head size and key/value heads (`per_layer_config`); their RoPE, by
default "proportional" (the last pairs of each head unturned), ports as the layer's `rope_scaling`."""

from .config import _head_dim, _layer_type, _rope_kwargs, _rope_parameters, _window
from .tensors import _bias_argument, _linear, _tensor


def _gemma_shared(config, tensors, index):
    """Gemma 3n and Gemma 4: a "reuse" layer as `kv_shared`, a full layer with `attention_k_eq_v` as
    `keys_as_values`, every other layer with `value_norm`."""
    if index is None:
        raise ValueError(
            "`layer_index` must be given for Gemma 3n and Gemma 4 (`layer_types`, `num_kv_shared_layers`). "
            "Received: layer_index=None"
        )
    head_dim, num_kv_heads = _layer_sizes(config, index)
    layer_type = _layer_type(config, index)
    shared = sharing_mode(config, index) == "reuse"
    keys_as_values = not shared and bool(config.get("attention_k_eq_v")) and layer_type != "sliding_attention"
    names = ("query", *(() if shared else ("key",)), *(() if shared or keys_as_values else ("value",)), "output")
    weights, with_bias = {}, []
    for name in names:
        if _linear(name, tensors, _SOURCES[name], weights):
            with_bias.append(name)
    kwargs = {"d_model": config["hidden_size"], "num_heads": config["num_attention_heads"]}
    kwargs |= {"num_kv_heads": num_kv_heads, "head_dim": head_dim, "bias": _bias_argument(with_bias), "scale": 1.0}
    kwargs |= _rope_kwargs(_rope_parameters(config, layer_type), head_dim)
    kwargs |= {"qk_norm": "head", "qk_norm_eps": float(config["rms_norm_eps"])}
    weights["query_norm"] = _tensor(tensors, "q_norm.weight")  # (H,), the scale itself
    if not shared:
        weights["key_norm"] = _tensor(tensors, "k_norm.weight")
    window = _window(config, index)
    kwargs |= {} if window is None else {"window": window}
    kwargs |= {"kv_shared": True} if shared else {"keys_as_values": keys_as_values, "value_norm": True}
    return kwargs, weights


_SOURCES = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj"}


def _layer_sizes(config, index):
    """(H, K) of layer `index`: Gemma 4's `per_layer_config` overrides (its full layers' own sizes) or the config's."""
    overrides = config.get("per_layer_config") or {}
    layer = overrides.get(str(index), overrides.get(index)) or {}
    head_dim = layer.get("head_dim") or _head_dim(config)
    return int(head_dim), int(layer.get("num_key_value_heads") or config["num_key_value_heads"])


def sharing_mode(config, index):
    """transformers' `kv_sharing_modes[index]` from a config dict: "reuse" for the last `num_kv_shared_layers`
    layers, "store" for the last earlier layer of each layer type, else None."""
    layers, shared = config["num_hidden_layers"], config.get("num_kv_shared_layers") or 0
    if not shared:
        return None
    first = layers - shared
    if index >= first:
        return "reuse"
    types = [_layer_type(config, i) for i in range(first)]
    return "store" if types[index] not in types[index + 1 :] else None


def shared_source(config, index):
    """The index of the layer whose keys and values the "reuse" layer `index` attends (its type's "store" layer)."""
    first = config["num_hidden_layers"] - (config.get("num_kv_shared_layers") or 0)
    layer_type = _layer_type(config, index)
    return max(i for i in range(first) if _layer_type(config, i) == layer_type)
