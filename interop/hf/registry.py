"""The porters by model type (the families `interop.hf` ships, and the path of layer {i}'s attention in their
checkpoints), and those registered with `register_porter`."""

from .alibi import _bloom, _falcon, _mpt
from .bert import _bert, _modernbert
from .gated import _gated
from .gpt import _codegen, _gpt2, _gpt_bigcode, _gpt_neo, _gpt_neox, _gptj
from .latent import _latent
from .llama import _llama4, _rotary
from .seq2seq import _bart, _t5
from .shared import _gemma_shared
from .sparse import _mistral_large4, _sparse


def _family(porter, path, **options):
    """One family: its porter, given `options`, and the path of layer {i}'s attention in its checkpoints."""

    def port(config, tensors, index):
        return porter(config, tensors, index, **options)

    port.__doc__, port.family, port.options = porter.__doc__, porter, options
    return port, path


_LAYERS = "layers.{i}.self_attn"
_BUILTIN = {
    "llama": _family(_rotary, _LAYERS),
    "mistral": _family(_rotary, _LAYERS),
    "mixtral": _family(_rotary, _LAYERS),
    "starcoder2": _family(_rotary, _LAYERS),
    "granite": _family(_rotary, _LAYERS, scale="attention_multiplier"),
    "cohere": _family(_rotary, _LAYERS, interleaved=True, norm="layer"),
    "cohere2": _family(_rotary, _LAYERS, interleaved=True, rope="sliding"),
    "gemma": _family(_rotary, _LAYERS),
    "gemma2": _family(_rotary, _LAYERS, scale="query_pre_attn_scalar"),
    "gemma3": _family(_rotary, _LAYERS, scale="query_pre_attn_scalar"),
    "gemma3_text": _family(_rotary, _LAYERS, scale="query_pre_attn_scalar"),
    "qwen2": _family(_rotary, _LAYERS),
    "qwen2_moe": _family(_rotary, _LAYERS),
    "qwen3": _family(_rotary, _LAYERS),
    "qwen3_moe": _family(_rotary, _LAYERS),
    "qwen2_vl": _family(_rotary, _LAYERS, mrope=True),
    "qwen2_vl_text": _family(_rotary, _LAYERS, mrope=True),
    "qwen2_5_vl": _family(_rotary, _LAYERS, mrope=True),
    "qwen2_5_vl_text": _family(_rotary, _LAYERS, mrope=True),
    "olmo": _family(_rotary, _LAYERS),
    "olmo2": _family(_rotary, _LAYERS),
    "gpt_oss": _family(_rotary, _LAYERS),
    "phi": _family(_rotary, _LAYERS),
    "phi3": _family(_rotary, _LAYERS),
    "stablelm": _family(_rotary, _LAYERS),
    "smollm3": _family(_rotary, _LAYERS, rope="no_rope_layers"),
    "glm4": _family(_rotary, _LAYERS, interleaved=True),
    "gptj": _family(_gptj, "h.{i}.attn"),
    "gpt_neox": _family(_gpt_neox, "layers.{i}.attention"),
    "gpt2": _family(_gpt2, "h.{i}.attn"),
    "gpt_bigcode": _family(_gpt_bigcode, "h.{i}.attn"),
    "gpt_neo": _family(_gpt_neo, "h.{i}.attn.attention"),
    "opt": _family(_bart, _LAYERS),
    "bart": _family(_bart, "encoder.layers.{i}.self_attn"),
    "bert": _family(_bert, "encoder.layer.{i}.attention"),
    "roberta": _family(_bert, "encoder.layer.{i}.attention"),
    "xlm-roberta": _family(_bert, "encoder.layer.{i}.attention"),
    "xlm_roberta": _family(_bert, "encoder.layer.{i}.attention"),  # its package's name
    "t5": _family(_t5, "encoder.block.{i}.layer.0.SelfAttention"),
    "bloom": _family(_bloom, "h.{i}.self_attention"),
    "falcon": _family(_falcon, "h.{i}.self_attention"),
    "llama4": _family(_llama4, _LAYERS),
    "llama4_text": _family(_llama4, _LAYERS),
    "mpt": _family(_mpt, "blocks.{i}.attn"),
    "modernbert": _family(_modernbert, "layers.{i}.attn"),
    "qwen3_next": _family(_gated, _LAYERS, gate="q_proj"),
    "qwen3_5": _family(_gated, _LAYERS, gate="q_proj"),
    "qwen3_5_text": _family(_gated, _LAYERS, gate="q_proj"),
    "qwen3_5_moe": _family(_gated, _LAYERS, gate="q_proj"),
    "qwen3_5_moe_text": _family(_gated, _LAYERS, gate="q_proj"),
    "afmoe": _family(_gated, _LAYERS, gate="gate_proj", rope="sliding"),
    "lfm3": _family(_gated, _LAYERS, gate="g_proj"),
    "whisper": _family(_bart, "encoder.layers.{i}.self_attn"),
    "deepseek_v2": _family(_latent, _LAYERS, interleaved=True),
    "deepseek_v3": _family(_latent, _LAYERS),
    "glm4_moe_lite": _family(_latent, _LAYERS),
    "youtu": _family(_latent, _LAYERS),
    "axk1": _family(_latent, _LAYERS),
    "mistral4": _family(_latent, _LAYERS),
    "minicpm3": _family(_latent, _LAYERS),
    "kimi_linear": _family(_latent, _LAYERS, rope=False),
    "bailing_hybrid": _family(_latent, "layers.{i}.attention", interleaved=True, gate=True),
    "gemma3n": _family(_gemma_shared, _LAYERS),
    "gemma3n_text": _family(_gemma_shared, _LAYERS),
    "gemma4": _family(_gemma_shared, _LAYERS),
    "gemma4_text": _family(_gemma_shared, _LAYERS),
    "gemma4_unified": _family(_gemma_shared, _LAYERS),
    "gemma4_unified_text": _family(_gemma_shared, _LAYERS),
    "deepseek_v32": _family(_sparse, _LAYERS),
    "glm_moe_dsa": _family(_sparse, _LAYERS, interleaved_indexer=True),
    "mistral_large4": _family(_mistral_large4, "layers.{i}.attention"),  # its checkpoints' names
    "mistral_large4_text": _family(_mistral_large4, "layers.{i}.attention"),
    "longcat_flash": _family(
        _latent, lambda i: f"layers.{i // 2}.self_attn.{i % 2}", interleaved=True, lora_scales=True
    ),
    "codegen": _family(_codegen, "h.{i}.attn"),  # last: the refusals that list these keep their first 400 characters
}
_REGISTERED = {}


def register_porter(name, porter):
    """Adds a porter for a `transformers` model type or an attention class name (a subclass of yours).

    Args:
        name: a model type (`config.model_type`, e.g. "llama") or the name of an attention module's
            class. A class name is looked up along the module's class hierarchy before the checks
            that refuse subclasses, so a subclass that overrides `forward` ports through its porter.
        porter: `porter(config, tensors, layer_index) -> (layer_kwargs, weights)`: `config` a dict,
            `tensors` a mapping from the module's `state_dict` names (`q_proj.weight`, ...) to arrays,
            `layer_index` an int (None where the module does not know its layer).
    """
    if not callable(porter):
        raise ValueError(f"`porter` must be callable. Received: {type(porter).__name__}")
    _REGISTERED[name] = porter


def supported_modules():
    """The `transformers` model types `port_attention` and `port_checkpoint` read, and the names registered."""
    return tuple(_BUILTIN) + tuple(name for name in _REGISTERED if name not in _BUILTIN)


def _registered(name):
    """The porter registered for `name` (a model type or an attention class name), else None."""
    return _REGISTERED.get(name)


def _porter(name):
    if name in _REGISTERED:
        return _REGISTERED[name]
    return _BUILTIN[name][0] if name in _BUILTIN else None


def _builtin(name):
    """The porter `interop.hf` ships for the model type `name`, else None."""
    return _BUILTIN[name][0] if name in _BUILTIN else None


def _path(model_type, layer_index):
    """The family's path of layer `layer_index`'s attention: a format string with {i}, or a function of it
    (LongCat's two attention sublayers per decoder layer: layer i is `layers.{i // 2}.self_attn.{i % 2}`)."""
    path = _BUILTIN.get(model_type, (None, _LAYERS))[1]
    return path(layer_index) if callable(path) else path.format(i=layer_index)
