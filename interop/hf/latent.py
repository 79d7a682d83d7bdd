"""Multi-head latent attention (MLA): DeepSeek-V2, V3 and the families built on their attention, their
linear-attention layers refused by name, and the MLA model types refused with what they add."""

import math

import numpy as np

from .config import _layer_type, _position_scaling, _rope_kwargs, _rope_parameters
from .tensors import _linear, _tensor

_LATENT_NORM_EPS = 1e-6  # transformers builds the MLA norms (q_a_layernorm, kv_a_layernorm) without the config's eps


def _latent(config, tensors, index, *, interleaved=False, rope=True, gate=False, lora_scales=False):
    """Multi-head latent attention (DeepSeek-V2, V3 and the families built on their attention): q through
    `q_a_proj`, `q_a_layernorm` and `q_b_proj` (`q_proj` without `q_lora_rank`), the latent and the shared rotary
    key from `kv_a_proj_with_mqa` and `kv_a_layernorm`, the heads' keys and values from `kv_b_proj`; interleaved
    RoPE (`interleaved`: V2's complex turn; the others read `rope_interleave`), and YaRN's `mscale_all_dim`
    correction in the scale as transformers' `yarn_apply_mscale` puts it. `rope=False`: no RoPE (Kimi Linear's
    NoPE latents, scaled by 1/sqrt(Hn + Hr)); `gate`: the per-head output gate `g_proj` (E -> N: Ling's), each
    head's column repeated over its Hv values; `lora_scales`: LongCat's sqrt(E / Q) on the queries and
    sqrt(E / C) on the latents, folded into `q_b_proj` and `kv_a_layernorm`."""
    _refuse_linear_layer(config, index)
    num_heads, hn, hr = config["num_attention_heads"], config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    hv = config["v_head_dim"]
    query_lora = "q_proj.weight" not in tensors  # Ling's q_proj whatever its config's q_lora_rank says
    sources = {"query_a": "q_a_proj", "query_b": "q_b_proj"} if query_lora else {"query": "q_proj"}
    output = "dense" if "dense.weight" in tensors else "o_proj"  # Ling's checkpoints name o_proj `dense`
    sources |= {"key_value_a": "kv_a_proj_with_mqa", "key_value_b": "kv_b_proj", "output": output}
    weights = {}
    biased = tuple(name for name, source in sources.items() if _linear(name, tensors, source, weights))
    if query_lora:
        weights["query_a_norm"] = _tensor(tensors, "q_a_layernorm.weight")  # (Q,)
    weights["key_value_a_norm"] = _tensor(tensors, "kv_a_layernorm.weight")  # (C,)
    kwargs = {
        "d_model": config["hidden_size"], "num_heads": num_heads, "num_kv_heads": num_heads, "bias": biased or False,
        "kv_lora_rank": config["kv_lora_rank"], "q_lora_rank": config["q_lora_rank"] if query_lora else None,
        "qk_nope_head_dim": hn, "qk_rope_head_dim": hr, "v_head_dim": hv, "latent_norm_eps": _LATENT_NORM_EPS,
    }  # fmt: skip
    if gate:
        weights["gate_kernel"] = np.repeat(_tensor(tensors, "g_proj.weight").T, hv, axis=1)  # (E, N) -> (E, N*Hv)
        kwargs["gate"] = True
    if lora_scales:
        _fold_lora_scales(config, weights)
    scale = (hn + hr) ** -0.5
    if not rope:
        return kwargs | {"scale": float(scale)}, weights
    parameters = _latent_rope_parameters(config)
    kwargs |= _rope_kwargs(parameters, hr)
    if _position_scaling(parameters) is not None:  # Mistral 4's `llama_4_scaling_beta`
        kwargs["query_scaling"] = _position_scaling(parameters)
    if interleaved or config.get("rope_interleave", False):
        kwargs["rope_interleaved"] = True
    if parameters.get("rope_type", "default") != "default" and parameters.get("mscale_all_dim"):
        factor = parameters["factor"]
        scale *= (0.1 * parameters["mscale_all_dim"] * math.log(factor) + 1.0) ** 2 if factor > 1 else 1.0
    kwargs["scale"] = float(scale)
    return kwargs, weights


def _latent_rope_parameters(config):
    """The RoPE parameters of an MLA layer, which turns the whole Hr part: a `partial_rotary_factor` (Mistral 4's
    Hr / (Hn + Hr)) only says so."""
    return {k: v for k, v in _rope_parameters(config, None).items() if k != "partial_rotary_factor"}


def _fold_lora_scales(config, weights):
    """LongCat's LoRA scales: sqrt(E / Q) on every query feature, sqrt(E / C) on the normalized latents."""
    query_scale = (config["hidden_size"] / config["q_lora_rank"]) ** 0.5
    weights["query_b_kernel"] = weights["query_b_kernel"] * np.float32(query_scale)  # (Q, N*H)
    if "query_b_bias" in weights:
        weights["query_b_bias"] = weights["query_b_bias"] * np.float32(query_scale)  # (N*H,)
    latent_scale = (config["hidden_size"] / config["kv_lora_rank"]) ** 0.5
    weights["key_value_a_norm"] = weights["key_value_a_norm"] * np.float32(latent_scale)  # (C,)


def _refuse_linear_layer(config, index):
    """Refuses a hybrid model's linear-attention layer (Kimi Linear's, Ling's): a recurrent state, not softmax."""
    layer_type = _layer_type(config, index)
    if layer_type == "linear_attention":
        raise ValueError(
            f"`layer_index` must be a full-attention (MLA) layer of a {config.get('model_type')} model: its "
            "linear_attention layers (gated delta rule with a recurrent state) are not softmax attention, which "
            f"the layer cannot compute. Received: layer {index} of type {layer_type!r}"
        )
