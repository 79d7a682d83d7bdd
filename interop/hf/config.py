"""What a `transformers` config says about one layer's attention, read as a dict: the config itself, its head
dimension, layer types, sliding window and RoPE."""

import json
import math
import os
from collections.abc import Mapping

_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "proportional": (),
}
_PROPORTIONAL_OPTIONAL_KEYS = ("factor", "partial_rotary_factor")  # the layer's own keys: R/2 pairs, the last unturned
_YARN_OPTIONAL_KEYS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _load_config(config):
    """A config as a dict: a dict, a `config.json` path (or its directory) or a `transformers` config;
    a multimodal config's text config."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        with open(os.path.join(path, "config.json") if os.path.isdir(path) else path) as file:
            config = json.load(file)
    elif hasattr(config, "get_text_config"):  # a transformers config; of a multimodal model, its text model's
        config = config.get_text_config().to_dict()
    if not isinstance(config, Mapping):
        raise ValueError(
            "`config` must be a dict, a path to config.json or a transformers config. "
            f"Received: {type(config).__name__}"
        )
    if isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    return dict(config)


def _head_dim(config):
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _default_layer_types(config):
    """Configs written before `layer_types` existed: Gemma 2 alternates sliding and full layers, Gemma 3 and
    Cohere2 make every `sliding_window_pattern`-th layer full."""
    model_type, layers = config.get("model_type", ""), config.get("num_hidden_layers", 0)
    pattern = {"gemma2": 2, "cohere2": 4}.get(model_type, config.get("sliding_window_pattern", 6))
    if model_type in ("gemma2", "gemma3", "gemma3_text", "cohere2"):
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    return None


def _layer_type(config, index):
    """The layer's entry in `layer_types` ("sliding_attention", "full_attention"), or None where there is none."""
    types = config.get("layer_types") or _default_layer_types(config)
    if not types:
        return None
    if index is None:
        raise ValueError(
            "`layer_index` must be given for a model whose layers differ (`layer_types`). Received: layer_index=None"
        )
    return types[index]


def _window(config, index):
    """The sliding window of layer `index`: `sliding_window` on its sliding layers (all without `layer_types`)."""
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        return None
    layer_type = _layer_type(config, index)
    return int(window) if layer_type in (None, "sliding_attention") else None


def _rope_parameters(config, layer_type):
    """The RoPE parameters of one layer: `rope_parameters` (or its entry for `layer_type`, Gemma 3), or the
    `rope_theta`, `rope_scaling` and `partial_rotary_factor` of configs written before it."""
    parameters = config.get("rope_parameters")
    if parameters is None:
        parameters = {"rope_theta": config.get("rope_theta", 10000.0), **(config.get("rope_scaling") or {})}
        if config.get("partial_rotary_factor") is not None:
            parameters["partial_rotary_factor"] = config["partial_rotary_factor"]
    if layer_type is not None and isinstance(parameters.get(layer_type), Mapping):
        parameters = parameters[layer_type]
    return parameters


def _rope_fraction(rotary_dim, head_dim):
    """The `rope_fraction` f for which the layer's R = int(head_dim * f) is `rotary_dim` (R / H itself can round
    below: 44 * (30 / 44) = 29.999...)."""
    fraction = rotary_dim / head_dim
    while int(head_dim * fraction) < rotary_dim:
        fraction = math.nextafter(fraction, 2.0)
    return fraction


def _rope_kwargs(parameters, head_dim, rotary_dim=None):
    """`rope_theta`, `rope_fraction` and `rope_scaling` from a `transformers` rope_parameters dict; `rotary_dim`
    where the model gives it in place of a `partial_rotary_factor` (GPT-J)."""
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    rope_type = "default" if rope_type == "mrope" else rope_type  # Qwen2-VL's configs before transformers 5
    if rope_type != "default" and rope_type not in _ROPE_SCALING_KEYS:
        raise ValueError(
            "`config.rope_parameters` must have rope_type 'default', 'linear', 'llama3', 'yarn' or 'proportional' "
            f"(the layer has no other RoPE scaling yet). Received: rope_parameters={parameters!r}"
        )
    kwargs = {"rope_theta": float(parameters["rope_theta"])}
    # transformers rotates int(head_dim * partial_rotary_factor) features, as the layer does with `rope_fraction`.
    fraction = (
        parameters.get("partial_rotary_factor", 1.0) if rotary_dim is None else _rope_fraction(rotary_dim, head_dim)
    )
    fraction = 1.0 if rope_type == "proportional" else fraction  # its own key: pairs (i, i + H/2) over the head
    if fraction != 1.0:
        kwargs["rope_fraction"] = float(fraction)
    if rope_type != "default":
        kwargs["rope_scaling"] = {"rope_type": rope_type} | {k: parameters[k] for k in _ROPE_SCALING_KEYS[rope_type]}
    if rope_type == "yarn":
        kwargs["rope_scaling"] |= _yarn_options(parameters)
    if rope_type == "proportional":
        kwargs["rope_scaling"] |= {
            k: parameters[k] for k in _PROPORTIONAL_OPTIONAL_KEYS if parameters.get(k) is not None
        }
    return kwargs


def _yarn_options(parameters):
    """YaRN's optional parameters as transformers reads them: a None one is absent; `truncate`, where
    given, is read for its truth (None does not truncate)."""
    options = {k: parameters[k] for k in _YARN_OPTIONAL_KEYS if parameters.get(k) is not None}
    if "truncate" in parameters:
        options["truncate"] = bool(parameters["truncate"])
    return options


def _position_scaling(parameters):
    """The layer's `query_scaling` for `llama_4_scaling_beta` in `rope_parameters` (Mistral 4, Ministral 3:
    `get_llama_4_attn_scale`, queries times 1 + beta * ln(1 + floor(position_ids / original_max_position_embeddings))),
    or None where it is 0 or absent."""
    beta = parameters.get("llama_4_scaling_beta")
    if not beta:
        return None
    floor = parameters.get("original_max_position_embeddings")
    if not floor:
        raise ValueError(
            "`config.rope_parameters['original_max_position_embeddings']` must be given with `llama_4_scaling_beta`: "
            f"it is the floor of the queries' scale by position. Received: rope_parameters={parameters!r}"
        )
    return {"type": "positions", "beta": float(beta), "floor": floor}
