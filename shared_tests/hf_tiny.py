"""Tiny random models of every `transformers` family with a `*ForCausalLM` class, shrunk from the family's
default configuration, and the check that `replace_attention` keeps what they compute.

`causal_lm_families()` lists the model types of the installed `transformers` with a `*ForCausalLM` class (one
class per model type: the first in its modeling module). `tiny_model(model_type)` builds one: the default
config of the class's `config_class`, shrunk (`shrink`: 2 to 8 layers, hidden size 64, 4 query heads of 16,
2 key/value heads, a vocabulary of 128, small experts and latents; every per-layer list cut to the layers
kept; a sliding window of 3; what the default leaves unset where its model needs it, set as its published
configurations have it), seeded, float32, in eval mode, its parameters moved off their initial values
(norm scales away from 1, biases away from 0) so that each ported variant matters. A family whose tiny model
cannot be built raises `NotBuiltError` with why.

`text_decoder_families()` lists the model types with no `*ForCausalLM` class whose modeling module defines a
text decoder of its own (a `*TextModel` class taking `past_key_values`, its config's model type `<type>_text`:
the language model of a vision-language model): their tiny model is that text model alone, shrunk the same
way, under a linear head to the vocabulary (`TextDecoderLM`), so that the same check runs on it.

`check_replaced(model)` copies the model, runs `replace_attention` on the copy and requires, on a left-padded
batch, the logits of the real tokens within `LOGITS_TOL` (scaled by the logits' spread where it is above 1),
and greedy `generate`'s tokens, compared step by step while the reference's top logit leads the next by
`MARGIN` (a near-tie can flip in any two implementations: the comparison stops at the first such step).
`replace_attention`'s `ValueError` passes through: its message is the refusal's reason.
"""

import contextlib
import copy
import functools
import importlib
import inspect
import pkgutil

import numpy as np

SEED = 0
LOGITS_TOL = 1e-4
MARGIN = 1e-3  # greedy tokens compared while the top logit leads the second by this much
NEW_TOKENS = 6
PROMPT_LENGTHS = (8, 5, 2)  # left-padded to the longest
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 4, 2, 16, 128
WINDOW = 3


class NotBuiltError(Exception):
    """A family's tiny model could not be built from its default configuration: why."""


@functools.cache
def causal_lm_families():
    """{model_type: (modeling module name, *ForCausalLM class name)} of the installed transformers."""
    import transformers.models

    found = {}
    for package in pkgutil.iter_modules(transformers.models.__path__):
        cls = _causal_lm_class(package.name)
        if cls is not None:
            found[package.name] = (cls.__module__, cls.__name__)
    return found


@functools.cache
def _causal_lm_class(model_type):
    """The first `*ForCausalLM` class its modeling modules define, else None (reads that package only)."""
    for name, value in _defined_classes(model_type):
        if name.endswith("ForCausalLM") and not name.startswith("Auto"):  # transformers.models.auto: the factory
            return value
    return None


def _defined_classes(model_type):
    """(name, class) of each class the package's modeling modules define, module by module, in definition order
    (a modeling module that needs a package not installed is skipped)."""
    for module in _modeling_modules(model_type):
        try:
            imported = importlib.import_module(module)
        except Exception:  # a modeling module that needs a package not installed
            continue
        for name, value in vars(imported).items():
            if inspect.isclass(value) and value.__module__ == imported.__name__:
                yield name, value


def _modeling_modules(package):
    import transformers.models

    path = [f"{transformers.models.__path__[0]}/{package}"]
    return [
        f"transformers.models.{package}.{m.name}"
        for m in pkgutil.iter_modules(path)
        if m.name.startswith("modeling_") and not m.name.startswith(("modeling_tf_", "modeling_flax_"))
    ]


def causal_lm_class(model_type):
    cls = _causal_lm_class(model_type)
    if cls is None:
        raise KeyError(f"no *ForCausalLM class in transformers.models.{model_type}")
    return cls


@functools.cache
def text_decoder_families():
    """{model_type: (modeling module name, *TextModel class name)} of the model types with no `*ForCausalLM`
    class that define a text decoder: a `*TextModel` class whose forward takes `past_key_values` and whose config's
    model type is `<model type>_text` (the language model of a vision-language model)."""
    import transformers.models

    causal, found = causal_lm_families(), {}
    for package in pkgutil.iter_modules(transformers.models.__path__):
        cls = None if package.name in causal else _text_decoder_class(package.name)
        if cls is not None:
            found[package.name] = (cls.__module__, cls.__name__)
    return found


def _text_decoder_class(model_type):
    """The first `*TextModel` decoder class its modeling modules define, else None."""
    for name, value in _defined_classes(model_type):
        if (
            name.endswith("TextModel")
            and getattr(getattr(value, "config_class", None), "model_type", None) == f"{model_type}_text"
            and "past_key_values" in inspect.signature(value.forward).parameters
        ):
            return value
    return None


def model_class(model_type):
    """The class the family's tiny model is built from: its `*ForCausalLM` class, else its text decoder's."""
    if model_type in text_decoder_families():
        return _text_decoder_class(model_type)
    return causal_lm_class(model_type)


@functools.cache
def _text_decoder_lm(decoder_class):
    """`TextDecoderLM` of `decoder_class`: a causal language model made of the text decoder and a linear head."""
    import torch
    from transformers import GenerationMixin, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class TextDecoderLM(PreTrainedModel, GenerationMixin):
        """A text decoder (`model`) under a linear head to the vocabulary (`lm_head`): logits and `generate`."""

        config_class = decoder_class.config_class
        base_model_prefix = "model"

        def __init__(self, config):
            config.is_encoder_decoder = False  # the text decoder alone (PP-FormulaNet's: no encoder states)
            super().__init__(config)
            self.model = decoder_class(config)
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None, **kwargs):
            kwargs.pop("logits_to_keep", None)
            states = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                use_cache=use_cache,
                **kwargs,
            )
            logits = self.lm_head(states.last_hidden_state)  # (B, T, E) -> (B, T, vocabulary)
            return CausalLMOutputWithPast(logits=logits, past_key_values=states.past_key_values)

    TextDecoderLM.__name__ = TextDecoderLM.__qualname__ = f"{decoder_class.__name__}LM"
    return TextDecoderLM


_SIZES = {
    "hidden_size": HIDDEN,
    "d_model": HIDDEN,
    "n_embd": HIDDEN,
    "num_attention_heads": HEADS,
    "n_head": HEADS,
    "num_heads": HEADS,
    "encoder_attention_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "encoder_ffn_dim": 96,
    "decoder_ffn_dim": 96,
    "head_dim": HEAD_DIM,
    "intermediate_size": 96,
    "ffn_hidden_size": 96,
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "vocab_size": VOCAB,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "max_position_embeddings": 256,
    "rotary_dim": HEAD_DIM // 2,  # GPT-J's and CodeGen's partial RoPE: within the tiny head
}
_UNSET = {  # fields a default configuration leaves None where its model needs a number (Nemotron, DeepSeek-V2, dots1)
    "num_key_value_heads": KV_HEADS,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "indexer_n_heads": 2,  # Qwen4-Exp's indexer: its default layers are indexed, its sizes left None
    "indexer_kv_heads": 1,
    "indexer_head_dim": HEAD_DIM,
    "indexer_budget": 4,
    "indexer_compress_ratio": 2,
}
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
LAYER_COUNTS = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_encoder_layers",
    "num_decoder_layers",
)


def shrink(config):
    """The config, shrunk in place (a composite config's text config and sub-configs too)."""
    for value in list(vars(config).values()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            shrink(value)
    per_layer, before = _take_per_layer_config(config)
    old_layers = next((getattr(config, n) for n in LAYER_COUNTS if isinstance(getattr(config, n, None), int)), None)
    layers = layers_kept(config, old_layers)
    if isinstance(getattr(config, "num_kv_shared_layers", None), int) and config.num_kv_shared_layers and old_layers:
        layers = min(old_layers, layers + 2)  # Gemma 3n, 4: two layers sharing the keys and values of earlier ones
        config.num_kv_shared_layers = 2
    for name in LAYER_COUNTS:
        if isinstance(getattr(config, name, None), int):
            set_field(config, name, layers)  # ProphetNet: its total refuses, its encoder and decoder counts follow
    if isinstance(getattr(config, "num_layers_per_stack", None), int):  # HRM-Text: its total counts the stacks' calls
        config.num_layers_per_stack = layers
        config.num_hidden_layers = layers * config.H_cycles * (config.L_cycles + 1)
    for name, value in list(vars(config).items()):  # per-layer lists cut to the layers kept
        if old_layers and isinstance(value, list | tuple) and len(value) == old_layers and layers < old_layers:
            setattr(config, name, type(value)(value[:layers]))
    _hybrid_attention(config, layers)
    if hasattr(config, "head_dim") and getattr(config, "head_dim", 0) is None:  # derived from the others
        set_field(config, "head_dim", HEAD_DIM)
    for name, size in _SIZES.items():
        if isinstance(getattr(config, name, None), int) and not isinstance(getattr(config, name), bool):
            set_field(config, name, min(size, getattr(config, name)) if name.startswith("num_experts") else size)
    for name, value in _UNSET.items():
        if name in vars(config) and vars(config)[name] is None:
            set_field(config, name, value)
    for name in _KV_HEADS:
        if isinstance(getattr(config, name, None), int) and not _aliases_query_heads(config, name):
            set_field(config, name, KV_HEADS)
    _mamba_heads(config)
    _unset_experts(config)
    _even_rotary(config)
    if isinstance(getattr(config, "kv_lora_rank", None), int) and hasattr(config, "head_dim"):
        fraction = _rotary_fraction(config) or 1.0  # Mistral 4: RoPE turns head_dim * 0.5 = qk_rope_head_dim
        set_field(config, "head_dim", int(config.qk_rope_head_dim / fraction))  # MLA: the rotary part's width
        for name in _KV_HEADS:
            if isinstance(getattr(config, name, None), int):
                set_field(config, name, HEADS)
    for name in _TOKENS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= VOCAB:
            setattr(config, name, 0)
        elif isinstance(value, list):
            setattr(config, name, [t for t in value if t < VOCAB] or [0])
    if isinstance(getattr(config, "sliding_window", None), int):
        config.sliding_window = WINDOW
    _published_fields(config)
    _shrink_rope(config)
    _put_per_layer_config(config, per_layer, before, layers)
    return config


DBRX_CLIP = 8.0  # DBRX's published `clip_qkv` (its forward clamps by it: None fails)
ERNIE_VL_SECTIONS = (22, 22, 20)  # ERNIE-4.5-VL's rotary embedding's `mrope_section` where the config names none


def _published_fields(config):
    """Fields a default configuration leaves unset where its model needs them, set as its published
    configurations hold them: DBRX's `attn_config.rope_theta` (its attention stores it, and rotates by
    `rope_parameters`) and `attn_config.clip_qkv`; ERNIE-4.5-VL's `mrope_section` (its rotary embedding's default,
    written out so that `_shrink_rope` cuts it to the tiny head); Cohere-Compass's RoPE parameters per layer type
    (its rotary embedding reads one entry per kind of layer, its default configuration holds none)."""
    attention = getattr(config, "attn_config", None)
    if config.model_type == "dbrx" and hasattr(attention, "to_dict"):
        attention.rope_theta = config.rope_parameters["rope_theta"]
        attention.clip_qkv = attention.clip_qkv or DBRX_CLIP
    if config.model_type.startswith("ernie4_5_vl_moe") and isinstance(config.rope_parameters, dict):
        config.rope_parameters.setdefault("mrope_section", list(ERNIE_VL_SECTIONS))
    if config.model_type.startswith("cohere_compass") and set(config.rope_parameters) <= {"mrope_section"}:
        config.rope_parameters = {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in config.layer_types}


def _take_per_layer_config(config):
    """A heterogeneous config's (Gemma 4's) per-layer overrides, taken off so that its sizes shrink as any
    config's: ({layer index: {name: value}}, {name: the global value before shrinking})."""
    if not getattr(config, "is_heterogeneous", False):
        return {}, {}
    per_layer = {int(i): dict(o) for i, o in config.to_dict().get("per_layer_config", {}).items()}
    config.per_layer_config = None
    names = {name for overrides in per_layer.values() for name in overrides}
    return per_layer, {name: getattr(config, name, None) for name in names}


def _put_per_layer_config(config, per_layer, before, layers):
    """The overrides of the layers kept, put back with each size scaled as its global value was (Gemma 4's
    full layers: a head twice as wide as the sliding layers' stays twice as wide)."""
    if not per_layer:
        return
    scaled = {}
    for index, overrides in per_layer.items():
        if index < layers:
            scaled[index] = {
                name: _scaled(value, before[name], getattr(config, name, None)) for name, value in overrides.items()
            }
    config.per_layer_config = scaled


def _scaled(value, old, new):
    """`value` grown or shrunk as a global size went from `old` to `new` (at least 1); other values as they are."""
    sizes = all(isinstance(v, int) and not isinstance(v, bool) for v in (value, old, new))
    return max(1, value * new // old) if sizes and old else value


_ATTENTION_KINDS = ("full_attention", "sliding_attention", "attention")
_OTHER_KIND = {"lfm2_moe": "conv"}  # a hybrid whose default configuration leaves `layer_types` None: its other kind


def _hybrid_attention(config, layers):
    """A hybrid whose default configuration has no attention layer (Bamba's `attn_layer_indices` None, Granite-MoE-
    Hybrid's layers all Mamba, LFM2-MoE's `layer_types` None) gets one, its last layer, as its published
    configurations have: else the attention class under test is not in the model. MLP kinds left None (that the
    model reads per layer) are a dense layer, then mixtures of experts."""
    if "attn_layer_indices" in vars(config) and not config.attn_layer_indices:
        config.attn_layer_indices = [layers - 1]
    types = vars(config).get("layer_types")
    if isinstance(types, list) and "linear_attention" in types and not set(types) & set(_ATTENTION_KINDS):
        config.layer_types = [*types[:-1], "full_attention"]
    if types is None and "layer_types" in vars(config) and config.model_type in _OTHER_KIND:
        config.layer_types = [_OTHER_KIND[config.model_type]] * (layers - 1) + ["full_attention"]
    if "mlp_layer_types" in vars(config) and config.mlp_layer_types is None:  # DeepSeek-OCR 2's text decoder
        config.mlp_layer_types = ["dense"] + ["sparse"] * (layers - 1)


def _mamba_heads(config):
    """Mamba heads that tile the shrunk hidden size, where the default configuration derived their width from the
    default one (Bamba's `mamba_d_head`, "auto" at construction): 8 heads of `mamba_expand * hidden_size / 8`."""
    names = ("mamba_n_heads", "mamba_d_head", "mamba_expand", "hidden_size")
    heads, width, expand, hidden = (getattr(config, n, None) for n in names)
    if getattr(config, "mamba_d_ssm", None) is not None:  # Falcon-H1: the heads tile `mamba_d_ssm`, set apart
        return
    if all(isinstance(v, int) for v in (heads, width, expand, hidden)) and heads * width != expand * hidden:
        config.mamba_n_heads, config.mamba_d_head = 8, expand * config.hidden_size // 8


def _unset_experts(config):
    """Experts where the default configuration leaves their sizes None and its layers build them anyway (DiffusionGemma:
    a router and experts in every layer, no `enable_moe_block` to turn them off as Gemma 4 has)."""
    if "top_k_experts" in vars(config) and config.top_k_experts is None and "enable_moe_block" not in vars(config):
        config.num_experts, config.top_k_experts, config.moe_intermediate_size = 4, 2, 32


def _aliases_query_heads(config, name):
    """Whether a key/value head count is another name of a query head count (Whisper's `num_key_value_heads`
    for `encoder_attention_heads`): the query heads stay as `_SIZES` sets them."""
    return _SIZES.get(getattr(config, "attribute_map", {}).get(name)) == HEADS


def _rotary_fraction(config):
    """The fraction of a head RoPE turns (`partial_rotary_factor`, in the RoPE parameters or the config), or None."""
    parameters = getattr(config, "rope_parameters", None) or {}
    entries = [parameters, *parameters.values()] if isinstance(parameters, dict) else []
    fractions = [e.get("partial_rotary_factor") for e in entries if isinstance(e, dict)]
    return next((f for f in fractions if f), None) or getattr(config, "partial_rotary_factor", None)


def _even_rotary(config):
    """A head wide enough that its partial RoPE turns an even number of features (MiMo-V2-Flash's 0.334)."""
    fraction = _rotary_fraction(config)
    if isinstance(fraction, float) and isinstance(getattr(config, "head_dim", None), int):
        width = next((w for w in (HEAD_DIM, 24, 32, 48, 64) if int(w * fraction) % 2 == 0 and int(w * fraction)), 0)
        if width and width != config.head_dim:
            set_field(config, "head_dim", width)


def set_field(config, name, value):
    with contextlib.suppress(AttributeError, NotImplementedError):  # a property without a setter (Falcon's head_dim)
        setattr(config, name, value)


def layers_kept(config, old_layers):
    """Enough layers to hold each kind of layer of `layer_types` (at least 2), and two `hybrid` layers where there is
    one (Zamba's hybrid layers share one transformer, whose weights tie across them), at most 8, else 2."""
    if not old_layers:
        return 2
    types = getattr(config, "layer_types", None)
    if isinstance(types, list | tuple) and types:
        wanted, sizes = set(types), range(2, min(old_layers, 8) + 1)
        kept = [n for n in sizes if set(types[:n]) == wanted]
        return next((n for n in kept if list(types[:n]).count("hybrid") != 1), kept[0] if kept else min(old_layers, 2))
    return min(old_layers, 2)


def _shrink_rope(config):
    """Multimodal RoPE sections cut to the tiny head's rotated pairs."""
    parameters = getattr(config, "rope_parameters", None) or {}
    for entry in (parameters, *(v for v in parameters.values() if isinstance(v, dict))):
        if isinstance(entry, dict) and entry.get("mrope_section"):
            pairs = int(HEAD_DIM * entry.get("partial_rotary_factor", 1.0)) // 2
            section = list(entry["mrope_section"])
            scaled = [max(1, s * pairs // sum(section)) for s in section]
            scaled[0] += pairs - sum(scaled)
            entry["mrope_section"] = scaled


def _named_sections(config, cls):
    """The config with its multimodal RoPE's default sections written in (`mrope_section`, read from the rotary
    embedding of `cls`'s modeling module), so that `_shrink_rope` cuts them to the tiny head, as the config's own."""
    from interop.hf import structure

    parameters = getattr(config, "rope_parameters", None)
    source = "".join(
        inspect.getsource(value)
        for name, value in vars(importlib.import_module(cls.__module__)).items()
        if name.endswith("RotaryEmbedding") and inspect.isclass(value)
    )
    default = structure._default_sections(source)
    if isinstance(parameters, dict) and default is not None and not parameters.get("mrope_section"):
        parameters["mrope_section"] = list(default)
    return config


def tiny_model(model_type):
    """The family's tiny random model (float32, eval mode), or `NotBuiltError` with why."""
    import torch

    cls = model_class(model_type)
    try:
        config = shrink(_named_sections(cls.config_class(), cls))
        _ungrouped_heads(config, cls)
        torch.manual_seed(SEED)
        if model_type in text_decoder_families():
            cls = _text_decoder_lm(cls)
        model = cls(config).float().eval()
    except Exception as error:
        raise NotBuiltError(f"{type(error).__name__}: {_first_line(error)}") from error
    return perturbed(model)


def _ungrouped_heads(config, cls):
    """As many key/value heads as query heads where the model's modeling module defines an eager attention that
    never repeats key/value heads (UnlimitedOCR's text decoder: no `repeat_kv` in its `eager_attention_forward` nor
    its attention classes): the published configurations have as many, the grouped tiny one would not run."""
    module = inspect.getmodule(cls)
    eager = getattr(module, "eager_attention_forward", None)
    if eager is None or eager.__module__ != module.__name__:
        return
    attentions = [v for n, v in vars(module).items() if inspect.isclass(v) and n.endswith("Attention")]
    if any("repeat_kv" in inspect.getsource(f) for f in (eager, *attentions)):
        return
    for name in _KV_HEADS:
        if isinstance(getattr(config, name, None), int):
            set_field(config, name, config.num_attention_heads)


def perturbed(model):
    """The model with its parameters moved off their initial values, seeded (norm scales away from 1, biases
    away from 0), in place."""
    import torch

    generator = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.is_floating_point():
                noise = torch.randn(parameter.shape, generator=generator) * (0.2 if parameter.ndim == 1 else 0.02)
                parameter.add_(noise)
    return model


def _first_line(error):
    return (str(error).strip().splitlines() or [""])[0][:200]


def prompts(vocab=VOCAB):
    import torch

    length = max(PROMPT_LENGTHS)
    mask = torch.tensor([[0] * (length - n) + [1] * n for n in PROMPT_LENGTHS])
    ids = torch.from_numpy(np.random.default_rng(SEED).integers(1, vocab, size=mask.shape))
    return ids * mask, mask


def check_replaced(model):
    """Raises `AssertionError` where the replaced model differs, `ValueError` where `replace_attention` (or the
    swapped module, called) refuses, `NotBuiltError` where the model itself cannot run the prompts; returns what
    was compared ({"logits": max difference, "tokens": steps compared, "replaced": names})."""
    import torch

    from interop.hf import replace_attention

    ours = copy.deepcopy(model)
    replaced = replace_attention(ours)
    ids, mask = prompts(min(VOCAB, model.config.get_text_config().vocab_size))
    rows = mask.bool().numpy()
    with torch.no_grad():
        theirs = _reference(lambda: model(input_ids=ids, attention_mask=mask).logits.float().numpy())
        mine = ours(input_ids=ids, attention_mask=mask).logits.float().numpy()
    if theirs.shape[:2] != ids.shape:  # CSM's depth decoder: a logit per codebook after the backbone's, not per token
        raise NotBuiltError(
            f"the model's logits cover {tuple(theirs.shape[:2])} (batch, positions) of the prompts' "
            f"{tuple(ids.shape)}: not one logit per token, which the generated test compares"
        )
    tolerance = LOGITS_TOL * max(1.0, float(theirs[rows].std()))
    difference = float(np.abs(mine[rows] - theirs[rows]).max())
    assert difference <= tolerance, f"logits differ by {difference:.3g} (tolerance {tolerance:.3g})"
    settings = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    settings |= {"output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        reference = _reference(lambda: model.generate(input_ids=ids, attention_mask=mask, **settings))
        result = ours.generate(input_ids=ids, attention_mask=mask, **settings)
    compared = 0
    for step, logits in enumerate(reference.logits):
        top = torch.topk(logits.float(), 2, dim=-1).values
        if bool(((top[:, 0] - top[:, 1]) < MARGIN).any()):
            break
        column = ids.shape[1] + step
        assert torch.equal(result.sequences[:, column], reference.sequences[:, column]), f"tokens differ at {step}"
        compared += 1
    return {"logits": difference, "tokens": compared, "replaced": replaced}


def _reference(run):
    """`run()` on the model as transformers built it: an error there is the family's (`NotBuiltError`), never a
    refusal of the port."""
    try:
        return run()
    except Exception as error:
        raise NotBuiltError(f"the model itself raised {type(error).__name__}: {_first_line(error)}") from error
