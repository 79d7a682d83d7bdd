"""The Llama kind: q_proj, k_proj, v_proj and o_proj with RoPE from the config (Llama, Mistral, Qwen, Gemma,
OLMo, Phi, Phi3, StableLM, Cohere, GLM4, SmolLM3, gpt-oss, ... and Llama 4's text attention), their QK-norms,
softmax scales and the layers that rotate."""

import numpy as np

from .config import _head_dim, _layer_type, _rope_kwargs, _rope_parameters, _window
from .tensors import _blocks, _separate_projections, _split_fused, _tensor


def _rotary(
    config, tensors, index, *, interleaved=False, scale=None, rope="all", norm="rms", mrope=False,
    mrope_interleaved=False, **norm_options,
):  # fmt: skip
    """Llama and its descendants: q_proj, k_proj, v_proj and o_proj (Phi: dense; Phi3: a fused qkv_proj),
    RoPE from the config (`interleaved`: Cohere and GLM pair features 2i and 2i + 1; `scale`: the config
    key of a scale other than 1 / sqrt(H); `rope`: "all", "sliding" (Cohere2) or "no_rope_layers" (SmolLM3)
    for the layers that rotate; `norm`: the QK-norm of `q_norm`, "rms" or "layer" (Cohere); `mrope`: Qwen2-VL's
    multimodal RoPE, `mrope_section` (True: Qwen2-VL's default sections (16, 24, 24) where the config names none;
    a tuple: that family's default; `mrope_interleaved`: Qwen3-VL's, the pairs dealt to the rows in turn, also
    where the config's `mrope_interleaved` says so); `norm_options`: the QK-norm's `norm_eps` and `norm_offset`
    where the module says them, `interop.hf.structure`)."""
    head_dim, num_heads = _head_dim(config), config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    if "qkv_proj.weight" in tensors:  # Phi3
        columns = _blocks(num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        weights, bias = _split_fused(tensors, "qkv_proj", "o_proj", columns)
    else:
        output = "dense" if "dense.weight" in tensors else "o_proj"  # Phi calls it `dense`
        weights, bias = _separate_projections(tensors, ("q_proj", "k_proj", "v_proj", output))
    kwargs = {"d_model": config["hidden_size"], "num_heads": num_heads, "num_kv_heads": num_kv_heads}
    kwargs |= {"head_dim": head_dim, "bias": bias, "scale": _scale(config, scale, head_dim)}
    layer_type = _layer_type(config, index)
    if _rotates(config, index, layer_type, rope):
        parameters = _rope_parameters(config, layer_type)
        kwargs |= _rope_kwargs(parameters, head_dim)
        if interleaved:
            kwargs["rope_interleaved"] = True
        if mrope:  # the rotary embedding's default sections where the config names none
            default = (16, 24, 24) if mrope is True else mrope
            kwargs["rope_sections"] = tuple(int(n) for n in parameters.get("mrope_section", default))
            if mrope_interleaved or parameters.get("mrope_interleaved"):  # Qwen3-VL's: the pairs dealt in turn
                kwargs["rope_sections_interleaved"] = True
    window = _window(config, index)
    if window is not None:
        kwargs["window"] = window
    if config.get("attn_logit_softcapping") is not None:
        kwargs["softcap"] = float(config["attn_logit_softcapping"])
    if "q_norm.weight" in tensors:
        kwargs |= _qk_norm(config, tensors, head_dim, weights, norm, **norm_options)
    elif "q_layernorm.weight" in tensors or "q_layernorm.norms.0.weight" in tensors:
        kwargs |= _qk_layernorm(config, tensors, weights, num_heads, num_kv_heads)
    if "sinks" in tensors:
        kwargs["sinks"] = True
        weights["sinks"] = _tensor(tensors, "sinks")
    if config.get("clip_qkv") is not None:  # OLMo: q, k and v clamped after their projections
        kwargs["clip_qkv"] = float(config["clip_qkv"])
    return kwargs, weights


def _scale(config, key, head_dim):
    """The softmax scale: 1 / sqrt(H), Gemma's `query_pre_attn_scalar ** -0.5` or Granite's `attention_multiplier`."""
    if key == "query_pre_attn_scalar":
        return float(config[key] ** -0.5)
    if key is not None:
        return float(config[key])
    return float(head_dim**-0.5)


def _rotates(config, index, layer_type, rope):
    """Whether layer `index` applies RoPE: every layer, the sliding ones (Cohere2) or SmolLM3's `no_rope_layers`."""
    if rope == "never":  # a NoPE layer (`interop.hf.structure`)
        return False
    if rope == "sliding":
        return layer_type == "sliding_attention"
    if rope == "no_rope_layers":
        if index is None:
            raise ValueError("`layer_index` must be given for SmolLM3 (`no_rope_layers`). Received: layer_index=None")
        return bool(config["no_rope_layers"][index])
    return True


def _qk_norm(config, tensors, head_dim, weights, norm, norm_eps=None, norm_offset=None):
    """QK-norm kwargs and weights from `q_norm` / `k_norm`: RMSNorms (Qwen3, Gemma 3: one scale (H,) shared by the
    heads; OLMo2: over all heads), or Cohere's LayerNorm (`norm="layer"`) of (heads, H), each head its own scale."""
    # Gemma's, Qwen3-Next's and Qwen3.5's RMSNorms multiply by (1 + weight): the portable scale is 1 + weight,
    # computed as they do (float32).
    if norm_offset is None:
        norm_offset = config.get("model_type", "").startswith(_UNIT_OFFSET_NORMS)
    offset = np.float32(1.0 if norm_offset else 0.0)
    query, key = _tensor(tensors, "q_norm.weight"), _tensor(tensors, "k_norm.weight")
    weights["query_norm"] = query.reshape(-1) + offset  # Cohere's (N, H) -> (N*H,), head-major
    weights["key_norm"] = key.reshape(-1) + offset  # (K, H) -> (K*H,)
    kind = "per_head" if query.ndim == 2 else "head" if query.shape == (head_dim,) else "all"
    if norm == "layer":
        eps = config["layer_norm_eps"] if norm_eps is None else norm_eps
        return {"qk_norm": kind, "qk_norm_eps": float(eps), "qk_norm_type": "layer"}
    return {"qk_norm": kind, "qk_norm_eps": float(config["rms_norm_eps"] if norm_eps is None else norm_eps)}


_UNIT_OFFSET_NORMS = ("gemma", "qwen3_next", "qwen3_5")  # model types whose RMSNorm scale is 1 + weight


def _qk_layernorm(config, tensors, weights, num_heads, num_kv_heads):
    """Phi's and StableLM's `qk_layernorm`: `q_layernorm` / `k_layernorm`, LayerNorms over each head's H features,
    one shared by the heads (Phi: with a bias) or one per head (StableLM: `norms.{n}`, no bias)."""
    kwargs = {"qk_norm_eps": float(config["layer_norm_eps"]), "qk_norm_type": "layer"}
    if "q_layernorm.weight" in tensors:  # Phi: one nn.LayerNorm(H)
        kwargs["qk_norm"], names = "head", {"query": ["q_layernorm"], "key": ["k_layernorm"]}
    else:  # StableLM: one nn.LayerNorm(H) per head, concatenated head-major
        kwargs["qk_norm"] = "per_head"
        names = {
            "query": [f"q_layernorm.norms.{n}" for n in range(num_heads)],
            "key": [f"k_layernorm.norms.{n}" for n in range(num_kv_heads)],
        }
    for name, sources in names.items():
        weights[f"{name}_norm"] = np.concatenate([_tensor(tensors, f"{s}.weight") for s in sources])  # (H,) or (N*H,)
        if f"{sources[0]}.bias" in tensors:
            weights[f"{name}_norm_bias"] = np.concatenate([_tensor(tensors, f"{s}.bias") for s in sources])
    if "query_norm_bias" in weights:
        kwargs["qk_norm_bias"] = True
    return kwargs


def _llama4(config, tensors, index):
    """Llama 4's text attention: interleaved RoPE and a weightless RMS QK-norm on its RoPE layers (the norm
    commutes with the rotation, so the layer's norm-then-rotate order computes the same), chunked attention on
    its `chunked_attention` layers, NoPE layers with their attention temperature tuning (`query_scaling`
    "temperature": by the cache's length, the same for every row). Its vision encoder's attention is refused
    (`_REFUSED_CLASSES`)."""
    if index is None:
        raise ValueError(
            "`layer_index` must be given for Llama 4 (`no_rope_layers`, `layer_types`). Received: layer_index=None"
        )
    rotates = _rotates(config, index, None, "no_rope_layers")
    kwargs, weights = _rotary(config, tensors, index, interleaved=True, rope="no_rope_layers")
    if not rotates and config.get("attn_temperature_tuning"):  # queries times 1 + b ln(1 + floor((i + t + 1) / f))
        kwargs["query_scaling"] = {
            "type": "temperature", "beta": float(config["attn_scale"]), "floor": config["floor_scale"],
        }  # fmt: skip
    if config.get("use_qk_norm") and rotates:
        weights["query_norm"] = weights["key_norm"] = np.ones(kwargs["head_dim"], np.float32)
        kwargs |= {"qk_norm": "head", "qk_norm_eps": float(config["rms_norm_eps"])}
    if _layer_type(config, index) == "chunked_attention" and config.get("attention_chunk_size") is not None:
        kwargs["attention_chunk_size"] = int(config["attention_chunk_size"])
    return kwargs, weights


_REFUSED_CLASSES = {  # attention classes of a ported model type that its porter does not read: what they are
    "Llama4VisionAttention": "Llama 4's vision encoder attention, whose 2-D RoPE (`freqs_ci`, Pixtral's) turns the "
    "first half of each head's feature pairs by the image patch's column and the second half by its row, where the "
    "layer's RoPE turns every pair by one position",
}
