"""The GPT kind: GPT-2 and GPTBigCode (a fused `c_attn`), GPT-Neo, GPT-J, CodeGen (GPT-J with a fused
`qkv_proj`) and GPT-NeoX."""

from .config import _rope_kwargs, _rope_parameters
from .tensors import _blocks, _per_head, _Prefixed, _separate_projections, _split_fused, _tensor


def _gptj(config, tensors, index):
    """GPT-J: no biases, interleaved RoPE on the first `rotary_dim` features, base 10000."""
    head_dim = config["n_embd"] // config["n_head"]
    weights, bias = _separate_projections(tensors, ("q_proj", "k_proj", "v_proj", "out_proj"))
    kwargs = {"d_model": config["n_embd"], "num_heads": config["n_head"], "bias": bias}
    kwargs |= {"scale": float(head_dim**-0.5), "rope_interleaved": True}
    kwargs |= _rope_kwargs({"rope_theta": 10000.0}, head_dim, config.get("rotary_dim") or head_dim)
    return kwargs, weights


_CODEGEN_SHARDS = 4  # CodeGen's `mp_num`: its fused projection holds 4 model-parallel shards


def _codegen(config, tensors, index):
    """CodeGen: GPT-J's attention with one fused `qkv_proj` (3E, E) of 4 shards, each [query | value | key] for
    a quarter of the heads; read apart into GPT-J's projections."""
    width = config["n_embd"]
    fused = _tensor(tensors, "qkv_proj.weight")  # (3E, E)
    shards = fused.reshape(_CODEGEN_SHARDS, 3, width // _CODEGEN_SHARDS, width)  # (3E, E) -> (4, 3, E / 4, E)
    query, value, key = (shards[:, part].reshape(width, width) for part in range(3))  # (4, E / 4, E) -> (E, E)
    parts = {"q_proj.weight": query, "k_proj.weight": key, "v_proj.weight": value}
    return _gptj(config, parts | {"out_proj.weight": _tensor(tensors, "out_proj.weight")}, index)


def _gpt_neox(config, tensors, index):
    """GPT-NeoX: one fused q/k/v projection, interleaved per head; partial RoPE."""
    num_heads = config["num_attention_heads"]
    head_dim = config["hidden_size"] // num_heads
    weights, bias = _split_fused(tensors, "query_key_value", "dense", _per_head(num_heads, head_dim))
    kwargs = {"d_model": config["hidden_size"], "num_heads": num_heads, "bias": bias}
    kwargs |= {"scale": float(head_dim**-0.5)} | _rope_kwargs(_rope_parameters(config, None), head_dim)
    return kwargs, weights


def _gpt2(config, tensors, index):
    """GPT-2: a fused Conv1D c_attn (E, 3E) = [query | key | value], y = x @ W + b."""
    width, num_heads = config["n_embd"], config["n_head"]
    if "q_attn.weight" in tensors:
        raise ValueError(
            "`module` must be a GPT-2 self-attention (`transformer.h[i].attn`): cross-attention is not ported. "
            "Received: a module with `q_attn`"
        )
    kernel, bias = _tensor(tensors, "c_attn.weight"), _tensor(tensors, "c_attn.bias")  # (E, 3E), (3E,)
    weights = {}
    for part, name in enumerate(("query", "key", "value")):
        weights[f"{name}_kernel"] = kernel[:, part * width : (part + 1) * width].copy()  # (E, E)
        weights[f"{name}_bias"] = bias[part * width : (part + 1) * width].copy()  # (E,)
    weights["output_kernel"], weights["output_bias"] = (
        _tensor(tensors, "c_proj.weight"),
        _tensor(tensors, "c_proj.bias"),
    )
    scale = (width // num_heads) ** -0.5 if config.get("scale_attn_weights", True) else 1.0
    if config.get("scale_attn_by_inverse_layer_idx"):
        if index is None:
            raise ValueError(
                "`layer_index` must be given for GPT-2 with scale_attn_by_inverse_layer_idx. Received: layer_index=None"
            )
        scale /= index + 1
    return {"d_model": width, "num_heads": num_heads, "bias": True, "scale": float(scale)}, weights


def _gpt_bigcode(config, tensors, index):
    """GPTBigCode (StarCoder): a fused c_attn, [q | k | v] with one key/value head (multi-query) or per head."""
    width, num_heads = config["n_embd"], config["n_head"]
    if "q_attn.weight" in tensors:
        raise ValueError(
            "`module` must be a GPTBigCode self-attention: cross-attention is not ported. "
            "Received: a module with `q_attn`"
        )
    head_dim = width // num_heads
    columns = _blocks(width, head_dim, head_dim) if config.get("multi_query", True) else _per_head(num_heads, head_dim)
    weights, bias = _split_fused(tensors, "c_attn", "c_proj", columns)
    scale = head_dim**-0.5 if config.get("scale_attn_weights", True) else 1.0
    kwargs = {
        "d_model": width,
        "num_heads": num_heads,
        "num_kv_heads": 1 if config.get("multi_query", True) else num_heads,
    }
    return kwargs | {"bias": bias, "scale": float(scale)}, weights


def _gpt_neo(config, tensors, index):
    """GPT-Neo: no scale (1.0), no q/k/v biases; its local layers keep the `window_size` most recent keys."""
    if "attention.q_proj.weight" in tensors:  # the GPTNeoAttention wrapper: its `attention` is the module
        tensors = _Prefixed(tensors, "attention.")
    weights, bias = _separate_projections(tensors, ("q_proj", "k_proj", "v_proj", "out_proj"))
    kwargs = {"d_model": config["hidden_size"], "num_heads": config["num_heads"], "bias": bias, "scale": 1.0}
    types = config["attention_types"]  # [[["global", "local"], repeat], ...]
    layers = config.get("attention_layers") or [
        kind for kinds, repeat in types for _ in range(repeat) for kind in kinds
    ]
    if index is None:
        raise ValueError(
            "`layer_index` must be given for GPT-Neo (global and local layers). Received: layer_index=None"
        )
    if layers[index] == "local":
        kwargs["window"] = int(config["window_size"])
    return kwargs, weights
