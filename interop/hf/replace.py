"""`replace_attention`: this project's PyTorch layer swapped into a `transformers` model, in place, behind a
wrapper that takes the attention module's call (masks and KV cache included)."""

import functools
import inspect

from .bert import _bert
from .gated import _gated
from .gpt import _codegen, _gpt2, _gpt_bigcode, _gpt_neo, _gpt_neox, _gptj
from .latent import _latent
from .llama import _llama4, _rotary
from .norms import _input_norm
from .registry import _registered
from .routes import _layer_index, _module_porter, _transformers_model_type, port_attention
from .seq2seq import _bart
from .shared import _gemma_shared
from .sparse import _LEARNED_FREQUENCIES, _mistral_large4, _refuse_learned_frequencies, _sparse


def replace_attention(model, layer_class=None):
    """Replaces every attention module of a `transformers` PyTorch model by this project's layer, in place.

    Each module becomes a wrapper that holds the ported `MultiHeadAttention` (its `layer`) and takes
    the module's call: the model's own `forward` and `generate` keep working, with their masks
    (the mask the model builds is the layer's `attention_mask`) and their KV cache (the layer keeps
    the keys and values in its own `KVCache`, grown as decoding goes; the model's cache only counts
    the tokens). Greedy and sampled decoding are supported; beam search, which reorders the model's
    cache, is not. The model is switched to the "eager" attention implementation, whose masks are
    always materialized. Gemma 3n's and Gemma 4's layers share keys and values through the model's
    `shared_kv_states`: a "store" layer's wrapper puts its (k, v) there (`return_kv`), or its cache when
    decoding, and a "reuse" layer's (`kv_shared`) passes them to its layer as `shared_kv`. A multimodal RoPE's
    layers (`rope_sections`: Qwen2-VL, Qwen3-VL, GLM-4V, ...) take the (3, B, T) positions the model's rotary
    embedding (`rotary_emb`) is called with, kept by a forward pre-hook on it (the modules get cos and sin).

    Args:
        model: a `transformers` PyTorch model of the Llama kind (the families with `q_proj`, `k_proj`,
            `v_proj`, `o_proj`: Llama, Mistral, Qwen, Gemma, OLMo, Phi3, ...; the gated ones, Qwen3-Next, Qwen3.5,
            AFMoE and LFM3, whose other layers (linear attention, convolutions) stay as they are), of the BERT kind
            (BERT, RoBERTa, XLM-RoBERTa and the copies of BERT's attention), of the BART kind (`q_proj`, `k_proj`,
            `v_proj`, `out_proj`: BART, OPT, Whisper, Blenderbot, Marian, ...; their cross-attention modules,
            `encoder_attn`, stay as they are), of the GPT kind (GPT-2, GPTBigCode, GPT-Neo, GPT-J, CodeGen, GPT-NeoX
            and Persimmon), with multi-head latent attention (DeepSeek-V2, V3 and the MLA
            families `port_attention` reads; the layer's cache holds the latents), the sparse indexer's included
            (DeepSeek-V3.2, GLM-MoE-DSA, Mistral Large 4: each layer's top-k passed to the next where the model's
            decoder does), or Gemma 3n and Gemma 4. A multimodal model's encoders (`vision_tower`, Phi-4-multimodal's
            `embed_tokens_extend`) stay as they are, and so do a hybrid's linear-attention layers (`layer_types[i]`
            "linear_attention": Kimi Linear's, Ling's, MiniMax's).
        layer_class: the `MultiHeadAttention` class to build (default: the one in `PyTorch/`).

    Returns:
        The names of the replaced modules.

    Raises:
        ValueError: for a model with no attention module of these kinds, a module `port_attention` refuses,
            a multimodal RoPE with no rotary embedding (`rotary_emb`) above the modules, or Mistral Large 4's
            LeRoPE factors (`rotary_emb.alpha`) other than 0.
    """
    import torch

    if layer_class is None:
        from PyTorch import Multi_Head_Attention as layer_file

        layer_class = layer_file.MultiHeadAttention
    learned = (
        (n, b.detach().float().cpu().numpy()) for n, b in model.named_buffers() if n.endswith(_LEARNED_FREQUENCIES)
    )
    _refuse_learned_frequencies("model", learned)  # Mistral Large 4's LeRoPE: the port holds for alpha = 0
    _set_eager(model)
    replaced, wrappers = [], {}
    for name, module in list(model.named_modules()):
        if any(name.startswith(done + ".") for done in replaced) or not type(module).__name__.endswith(_ATTENTION):
            continue
        if name.rpartition(".")[2] in _CROSS or set(_TOWERS) & set(name.split(".")):
            continue
        if _transformers_model_type(type(module)) is None and not any(
            _registered(c.__name__) is not None for c in type(module).__mro__
        ):
            continue
        if _linear_layer(module, model.config):
            continue
        family = getattr(_module_porter(module), "family", None)
        if family not in (
            _rotary,
            _gated,
            _bert,
            _latent,
            _llama4,
            _bart,
            _gpt2,
            _gpt_bigcode,
            _gpt_neo,
            _gpt_neox,
            _gptj,
            _codegen,
            _gemma_shared,
            _sparse,
            _mistral_large4,
        ):
            continue
        if getattr(module, "is_cross_attention", False):
            raise ValueError(f"`model` must have self-attention only: `{name}` is a cross-attention. Received: {name}")
        wrappers[name] = _swapped(torch, module, layer_class, family is _bert, model.config)
        replaced.append(name)
    _hook_rope_rows(torch, model, wrappers)
    for name, wrapper in wrappers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, wrapper)
    if not replaced:
        raise ValueError(
            "`model` must hold attention modules of the Llama kind (q_proj, k_proj, v_proj, o_proj), of the BERT "
            f"or BART kind or with multi-head latent attention. Received: {type(model).__name__}"
        )
    return replaced


_ATTENTION = ("Attention", "MLA")  # the endings of the attention modules' class names (LongCat's LongcatFlashMLA)
_CROSS = ("encoder_attn",)  # the BART kind's cross-attention modules: their class is the self-attention's
_TOWERS = (  # a multimodal model's encoders, not swapped: Mistral Large 4's Pixtral, Phi-4-multimodal's image and
    "vision_tower",  # audio encoders (inside its token embedding)
    "embed_tokens_extend",
)
_CROSS_ARGUMENTS = ("key_value_states", "encoder_hidden_states")  # a cross-attention call's keys and values


def _linear_layer(module, config):
    """Whether the module is a hybrid's linear-attention layer (`layer_types[i]` is "linear_attention": a
    recurrence, not softmax attention: Kimi Linear's, Ling's, MiniMax's lightning attention), which stays as it is."""
    index, types = _layer_index(module), getattr(config.get_text_config(), "layer_types", None)
    return (
        isinstance(types, list | tuple)
        and index is not None
        and index < len(types)
        and types[index] == ("linear_attention")
    )


def _hook_rope_rows(torch, model, wrappers):
    """Hands the (3, B, T) positions of a multimodal RoPE (`rope_sections`) to the swapped layers (`wrappers`, by
    the names of the modules they replace): a forward pre-hook on the rotary embedding (`rotary_emb`) of the
    nearest module above them keeps the `position_ids` it is called with (the model calls it before its layers),
    which the wrappers read (`rope_rows`)."""
    hooks = {}
    for name, wrapper in wrappers.items():
        if wrapper.layer.rope_sections is None or wrapper.layer.rope_theta is None:
            continue
        parts = name.split(".")
        owners = (model.get_submodule(".".join(parts[:n])) for n in range(len(parts) - 1, -1, -1))
        rotaries = (getattr(o, "rotary_emb", None) for o in owners)
        rotary = next((r for r in rotaries if isinstance(r, torch.nn.Module)), None)
        if rotary is None:
            raise ValueError(
                "`model` must hold the rotary embedding (`rotary_emb`) of its multimodal RoPE above its attention "
                f"modules: it computes their (3, B, T) positions. Received: none above {name}"
            )
        wrapper.rope_rows = hooks.setdefault(id(rotary), (rotary, _RopeRows()))[1]
    for rotary, rows in hooks.values():
        rotary.register_forward_pre_hook(rows, with_kwargs=True)


class _RopeRows:
    """A forward pre-hook of a rotary embedding (`rotary_emb(x, position_ids)`): keeps `position_ids`, read by
    the swapped layers below it as (3, B, T) (`positions`). A callable object, so that a deep copy of the model
    copies it with the wrappers that read it."""

    def __init__(self):
        self.position_ids = None

    def __call__(self, module, args, kwargs):
        self.position_ids = kwargs["position_ids"] if "position_ids" in kwargs else args[1]

    def positions(self, batch, length):
        """The (3, B, T) positions: `position_ids` (3, B, T), (1, B, T) or (B, T), broadcast as the rotary
        embedding does (`position_ids.expand(3, -1, -1)`) and to the batch."""
        return self.position_ids.expand(3, batch, length)  # (B, T) or (1|3, 1|B, T) -> (3, B, T)


def _set_eager(model):
    for config in (getattr(model, "config", None), *(m.config for m in model.modules() if hasattr(m, "config"))):
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = "eager"


def _swapped(torch, module, layer_class, bert, model_config):
    """The wrapper module that calls the ported layer as `module` was called."""
    config = getattr(module, "config", None) or getattr(getattr(module, "self", None), "config", None)
    config = config or model_config  # a hybrid's linear-attention module holds none (its refusal reads it)
    kwargs, weights = port_attention(module, config)
    parameter = next(module.parameters())
    layer = layer_class(**kwargs)
    layer.import_weights(weights)
    layer.to(device=parameter.device, dtype=parameter.dtype)
    wrapper = _wrapper_class(torch)(layer, _layer_index(module), getattr(module, "is_causal", not bert))
    if getattr(module, "is_kv_shared_layer", False) or getattr(module, "store_full_length_kv", False):
        wrapper.sharing = ("reuse" if module.is_kv_shared_layer else "store", module.layer_type)
    wrapper.passes_topk = "prev_topk_indices" in inspect.signature(module.forward).parameters  # GLM-MoE-DSA's
    if bert:  # BERT's LayerNorm after the residual, or a pre-LN copy's of the input (`interop.hf.norms`)
        wrapper.norm, wrapper.dropout = getattr(module.output, "LayerNorm", torch.nn.Identity()), module.output.dropout
        pre = _input_norm(module)
        wrapper.input_norm = None if pre is None else getattr(module, pre)
    return wrapper


@functools.cache
def _wrapper_class(torch):
    class SwappedAttention(torch.nn.Module):
        """A `transformers` attention module's call, computed by `layer` (`MultiHeadAttention`).

        BERT's residual, dropout and LayerNorm after the output projection are kept as `norm` and `dropout`; a
        pre-LN copy's LayerNorm of the input as `input_norm` (the layer attends the normalized states).
        With `passes_topk` (GLM-MoE-DSA's decoder passes each layer's top-k to the next), the call takes
        `prev_topk_indices` (a layer without its own indexer attends it) and returns the selection it used third.
        With `rope_rows` (a multimodal RoPE), the positions are the (3, B, T) rows the model's rotary embedding
        was last called with (`_RopeRows`), not the call's `position_ids`.
        """

        def __init__(self, layer, layer_idx, is_causal):
            super().__init__()
            self.layer, self.layer_idx, self.is_causal = layer, layer_idx, is_causal
            self.norm = self.dropout = self.sharing = self.input_norm = None  # sharing: ("store" or "reuse", type)
            self.passes_topk = False
            self.rope_rows = None  # a multimodal RoPE's (3, B, T) positions, from the model's rotary embedding
            self._cache = None

        def forward(self, hidden_states, attention_mask=None, *args, past_key_values=None, **kwargs):
            crossed = [name for name in _CROSS_ARGUMENTS if kwargs.get(name) is not None]
            if crossed:
                raise ValueError(
                    f"`{crossed[0]}` must be None: the replaced module computes self-attention. Received: a tensor"
                )
            past_key_values = kwargs.pop("layer_past", None) if past_key_values is None else past_key_values  # GPT kind
            past_key_values = getattr(past_key_values, "self_attention_cache", past_key_values)  # EncoderDecoderCache
            positions = kwargs.get("position_ids")
            if self.layer.rope_theta is None:
                positions = None
            elif self.rope_rows is not None:
                positions = self.rope_rows.positions(*hidden_states.shape[:2])  # (3, B, T)
            elif positions is None:
                positions = kwargs.get("cache_position")  # (T,)
            elif positions.shape[0] != hidden_states.shape[0]:
                positions = positions.expand(hidden_states.shape[0], -1)  # (1, T) -> (B, T)
            sparse = self._sparse(kwargs.get("prev_topk_indices"))
            residual = hidden_states  # a pre-LN copy of BERT's attends its normalized states, adds the states
            hidden_states = hidden_states if self.input_norm is None else self.input_norm(hidden_states)
            if self.sharing is not None:
                output = self._shared(hidden_states, attention_mask, past_key_values, positions, kwargs)
            elif past_key_values is None:
                masks = self._masks(attention_mask, hidden_states, 0, None)
                output = self.layer(hidden_states, **masks, positions=positions, **sparse)
            else:
                output = self._step(hidden_states, attention_mask, past_key_values, positions, sparse)
            output, selection = output if sparse.get("return_topk") else (output, None)
            if self.norm is not None:
                output = self.norm(self.dropout(output) + residual)
            return (output, None, selection) if self.passes_topk else (output, None)

        def _shared(self, hidden_states, attention_mask, past_key_values, positions, kwargs):
            """Gemma 3n and 4: a "store" layer puts its keys and values (its cache when decoding) in the
            model's `shared_kv_states`; a "reuse" layer attends them, its queries the last T tokens."""
            (mode, layer_type), states = self.sharing, kwargs["shared_kv_states"]
            if mode == "store" and past_key_values is None:
                masks = self._masks(attention_mask, hidden_states, 0, None)
                output, states[layer_type] = self.layer(hidden_states, **masks, positions=positions, return_kv=True)
                return output
            if mode == "store":
                output = self._step(hidden_states, attention_mask, past_key_values, positions, {})
                states[layer_type] = self._cache
                return output
            shared, t = states[layer_type], hidden_states.shape[1]
            positions = None if positions is None else positions[..., -t:]  # Gemma 4 keeps the last tokens' queries
            cached = hasattr(shared, "keep")  # a KVCache, else a (k, v) pair
            past, slots = (int(shared.index) - t, shared.key.shape[2]) if cached else (0, None)
            masks = self._masks(attention_mask, hidden_states, past, slots)
            return self.layer(hidden_states, **masks, positions=positions, shared_kv=shared)

        def _sparse(self, previous):
            """The call's sparse-indexer arguments: the previous layer's selection for a layer without an indexer,
            and the selection returned where the decoder passes it on."""
            if not self.passes_topk:
                return {}
            given = {} if self.layer.index_topk is not None or previous is None else {"topk_indices": previous}
            return {**given, "return_topk": True}

        def _step(self, hidden_states, attention_mask, past_key_values, positions, sparse):
            """One call with the model's cache: the layer's own cache holds the keys and values."""
            (b, t, _), past = hidden_states.shape, past_key_values.get_seq_length(self.layer_idx)
            empty = hidden_states.new_zeros(b, 1, t, 1)  # the model's cache counts the tokens only (one number each)
            past_key_values.update(empty, empty, self.layer_idx)
            if past == 0 or self._cache is None:
                self._cache = self.layer.init_cache(b, max(2 * t, 16))
            if int(self._cache.index) != past:
                raise ValueError(
                    "`past_key_values` must grow one call after another (beam search and cache cropping are not "
                    f"supported). Received: {past} past tokens, the layer's cache holds {int(self._cache.index)}"
                )
            self._grow(past + t)
            masks = self._masks(attention_mask, hidden_states, past, self._cache.key.shape[2])
            *output, self._cache = self.layer(hidden_states, **masks, positions=positions, cache=self._cache, **sparse)
            return output if sparse.get("return_topk") else output[0]

        def _grow(self, length):
            """Doubles the layer's cache until it has `length` slots."""
            cache = self._cache
            slots = cache.key.shape[2]
            if length <= slots:
                return
            extra = max(slots, length - slots)
            key, value = (
                torch.cat([part, part.new_zeros(*part.shape[:2], extra, part.shape[3])], 2)
                for part in (cache.key, cache.value)
            )  # MLA's latents (C) and rotary keys (Hr) differ
            keep = torch.cat([cache.keep, cache.keep.new_ones(cache.keep.shape[0], extra)], 1)
            index_key = cache.index_key  # the sparse indexer's keys (B, L, Hi), or None
            if index_key is not None:
                b, _, width = index_key.shape
                index_key = torch.cat([index_key, index_key.new_zeros(b, extra, width)], 1)  # (B, L + extra, Hi)
            self._cache = cache._replace(key=key, value=value, keep=keep, index_key=index_key)

        def _masks(self, attention_mask, hidden_states, past, slots):
            """The model's mask (B, 1, T, S') over the keys up to past + T, as a boolean mask over `slots` keys."""
            if attention_mask is None:
                return {"causal": self.is_causal}
            keep = (
                attention_mask
                if attention_mask.dtype == torch.bool
                else attention_mask > torch.finfo(attention_mask.dtype).min / 2
            )
            if slots is None:
                return {"attention_mask": keep}
            end = past + hidden_states.shape[1]
            full = keep.new_zeros(*keep.shape[:-1], slots)
            full[..., end - keep.shape[-1] : end] = keep  # a sliding layer's mask covers its last keys only
            return {"attention_mask": full}

    return SwappedAttention
