"""Port the attention modules of Hugging Face `transformers` models to `MultiHeadAttention`.

One converter for the three layers: it reads a `transformers` attention module and its config
and returns the constructor arguments and the portable weights (docs/SPEC.md, "Weights"):

    layer_kwargs, weights = port_attention(model.model.layers[0].self_attn, model.config)
    layer = MultiHeadAttention(**layer_kwargs)  # NumPy, PyTorch or TensorFlow: the same arguments
    layer.import_weights(weights)

Only what is attention is ported: the q/k/v projections (their biases where the module has
them), QK-norm, RoPE, the softmax scale, soft-capping, the sliding window, sinks and the output
projection. Residual connections, dropout and the layer norms around the module stay in the
model (BERT's module adds the residual and a LayerNorm after `output.dense`; Bloom's adds the
residual after `dense`: the layer's output is the output of that dense projection).

Legend: B batch size, T query length, S key length, E hidden size, N query heads,
K key/value heads, H head dimension.

The module does not hold its masks: `transformers` builds them in the model and passes them in.
These call arguments reproduce them (`attention_mask` is the model's (B, S) 0/1 padding mask,
`position_ids` the (B, T) positions the model was called with):

- Llama, Mistral, Mixtral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, OLMo2, gpt-oss, Phi, GPT-NeoX,
  GPT-J, Starcoder2, Granite, Cohere:
  `causal=True, key_mask=attention_mask.bool(), positions=position_ids`.
- GPT-2: `causal=True, key_mask=attention_mask.bool()`.
- BERT (encoder): `key_mask=attention_mask.bool()`.
- T5 self-attention: `key_mask=attention_mask.bool(), attention_bias=t5_position_bias(module0, T, S)`
  (`module0`: the first layer's T5Attention of that stack); the decoder adds `causal=True`.
- Bloom: `causal=True, key_mask=attention_mask.bool(),
  attention_bias=alibi_bias(N, alibi_positions(attention_mask))` (`alibi_bias` from the layer's file).

The sliding window (Mistral, Mixtral, Starcoder2, Qwen2, Gemma 2 and 3, gpt-oss) is part of the
layer (`window`), so no band mask is needed. With left padding, `transformers` leaves the padded query rows attending
nothing useful; this layer gives them `output_bias` (no key left): compare real tokens only.

Decoding: `cache = layer.init_cache(B, L)`, then `layer(x, cache=cache, causal=True,
key_mask=<the new tokens' mask>, positions=<their position_ids>)`, one prefill and then one
token at a time, as `transformers` does with its `DynamicCache`; T5 and Bloom pass their bias
over the L cache slots (`t5_position_bias(module, T, L, past_length=index)`, ALiBi over the
positions of all L slots).

RoPE scaling: `default`, `linear`, `llama3` and `yarn` (gpt-oss' default) port with their
parameters; other types (dynamic, LongRoPE) are a `ValueError` for now. The PyTorch tensors are
read with `torch` only through the modules' own parameters and methods (`.detach().cpu()`), so
this file imports no framework itself.
"""

import functools
import math

import numpy as np

__all__ = ["alibi_positions", "port_attention", "supported_modules", "t5_position_bias"]

_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_YARN_OPTIONAL_KEYS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _array(tensor):
    """A torch parameter or tensor as a float32 NumPy array (a copy)."""
    return tensor.detach().cpu().float().numpy().copy()


def _linear(name, linear, weights):
    """Adds an `nn.Linear` as `{name}_kernel` (in, out) (and `{name}_bias`); returns True if it has a bias."""
    weights[f"{name}_kernel"] = _array(linear.weight).T.copy()  # (out, in) -> (in, out)
    if linear.bias is None:
        return False
    weights[f"{name}_bias"] = _array(linear.bias)
    return True


def _bias_argument(names):
    """The constructor's `bias`: True (all four), False (none) or the tuple of names with a bias."""
    if len(names) == 4:
        return True
    return tuple(names) if names else False


def _separate_projections(module, projections):
    """Weights and `bias` of four `nn.Linear` projections named by `projections` (query, key, value, output)."""
    weights, with_bias = {}, []
    for name, attribute in zip(("query", "key", "value", "output"), projections, strict=True):
        if _linear(name, getattr(module, attribute), weights):
            with_bias.append(name)
    return weights, _bias_argument(with_bias)


def _fused_projections(fused, output, num_heads, head_dim):
    """Weights and `bias` of a fused (3*N*H, E) q/k/v `nn.Linear` whose rows are [q_n, k_n, v_n] for each head n
    (GPT-NeoX, Bloom) and of the output `nn.Linear`."""
    weights, with_bias = {}, []
    kernel = _array(fused.weight).reshape(num_heads, 3, head_dim, -1)  # (3*N*H, E) -> (N, 3, H, E)
    for index, name in enumerate(("query", "key", "value")):
        weights[f"{name}_kernel"] = kernel[:, index].reshape(num_heads * head_dim, -1).T.copy()  # -> (E, N*H)
        if fused.bias is not None:
            bias = _array(fused.bias).reshape(num_heads, 3, head_dim)  # (3*N*H,) -> (N, 3, H)
            weights[f"{name}_bias"] = bias[:, index].reshape(-1)  # -> (N*H,)
            with_bias.append(name)
    if _linear("output", output, weights):
        with_bias.append("output")
    return weights, _bias_argument(with_bias)


def _rope_parameters(config, layer_type):
    """The RoPE parameters of one layer: `config.rope_parameters`, or its entry for `layer_type` (Gemma 3)."""
    parameters = getattr(config, "rope_parameters", None)
    if parameters is None:
        raise ValueError(f"`config` must have `rope_parameters` for a RoPE model. Received: {type(config).__name__}")
    if layer_type is not None and isinstance(parameters.get(layer_type), dict):
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
    where the module gives it in place of a `partial_rotary_factor` (GPT-J)."""
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type != "default" and rope_type not in _ROPE_SCALING_KEYS:
        raise ValueError(
            "`config.rope_parameters` must have rope_type 'default', 'linear', 'llama3' or 'yarn' (the layer has no "
            f"other RoPE scaling yet). Received: rope_parameters={parameters!r}"
        )
    kwargs = {"rope_theta": float(parameters["rope_theta"])}
    # transformers rotates int(head_dim * partial_rotary_factor) features, as the layer does with `rope_fraction`.
    fraction = (
        parameters.get("partial_rotary_factor", 1.0) if rotary_dim is None else _rope_fraction(rotary_dim, head_dim)
    )
    if fraction != 1.0:
        kwargs["rope_fraction"] = float(fraction)
    if rope_type != "default":
        kwargs["rope_scaling"] = {"rope_type": rope_type} | {k: parameters[k] for k in _ROPE_SCALING_KEYS[rope_type]}
    if rope_type == "yarn":
        kwargs["rope_scaling"] |= _yarn_options(parameters)
    return kwargs


def _yarn_options(parameters):
    """YaRN's optional parameters as transformers reads them: a None one is absent; `truncate`, where
    given, is read for its truth (None does not truncate)."""
    options = {k: parameters[k] for k in _YARN_OPTIONAL_KEYS if parameters.get(k) is not None}
    if "truncate" in parameters:
        options["truncate"] = bool(parameters["truncate"])
    return options


def _qk_norm(module, head_dim, weights):
    """QK-norm kwargs and weights from `q_norm` / `k_norm` (Qwen3, Gemma 3: per head; OLMo2: over all heads)."""
    q_norm, k_norm = module.q_norm, module.k_norm
    if type(q_norm).__name__.endswith("LayerNorm"):
        raise ValueError(
            "`q_norm` must be an RMSNorm: a LayerNorm removes the mean first, which the layer's QK-norm does not. "
            f"Received: {type(q_norm).__name__}"
        )
    eps = [getattr(norm, "variance_epsilon", getattr(norm, "eps", None)) for norm in (q_norm, k_norm)]
    if eps[0] != eps[1]:
        raise ValueError(f"`q_norm` and `k_norm` must share one epsilon. Received: eps={eps}")
    # Gemma's RMSNorm multiplies by (1 + weight): the portable scale is 1 + weight, computed as it does (float32).
    offset = 1.0 if type(q_norm).__name__.startswith("Gemma") else 0.0
    weights["query_norm"] = _array(q_norm.weight) + np.float32(offset)
    weights["key_norm"] = _array(k_norm.weight) + np.float32(offset)
    per_head = weights["query_norm"].shape == (head_dim,)
    return {"qk_norm": "head" if per_head else "all", "qk_norm_eps": float(eps[0])}


def _rotary_projections(module, config, interleaved=False):
    """Llama and its descendants: q_proj, k_proj, v_proj and an output projection, RoPE from the config
    (`interleaved`: Cohere pairs features 2i and 2i + 1)."""
    head_dim = module.head_dim
    output = "dense" if hasattr(module, "dense") else "o_proj"  # Phi calls it `dense`
    weights, bias = _separate_projections(module, ("q_proj", "k_proj", "v_proj", output))
    kwargs = {
        "d_model": config.hidden_size,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": head_dim,
        "bias": bias,
        "scale": float(module.scaling),
    }
    layer_type = getattr(module, "layer_type", None)
    kwargs |= _rope_kwargs(_rope_parameters(config, layer_type), head_dim)
    if interleaved:
        kwargs["rope_interleaved"] = True
    # Mistral, Mixtral and Starcoder2 read their window from the config for every layer; the others per layer type.
    window = getattr(module, "sliding_window", getattr(config, "sliding_window", None))
    if window is not None:
        kwargs["window"] = int(window)
    if getattr(module, "attn_logit_softcapping", None) is not None:
        kwargs["softcap"] = float(module.attn_logit_softcapping)
    if getattr(module, "qk_layernorm", False):
        raise ValueError(
            "`qk_layernorm` must be False: Phi's QK-norm is a LayerNorm (mean removed, with a bias), not the layer's "
            "RMSNorm. Received: qk_layernorm=True"
        )
    if hasattr(module, "q_norm"):
        kwargs |= _qk_norm(module, head_dim, weights)
    if hasattr(module, "sinks"):
        kwargs["sinks"] = True
        weights["sinks"] = _array(module.sinks)
    return kwargs, weights


def _gptj(module, config):
    """GPT-J: no biases, interleaved RoPE on the first `rotary_dim` features, base 10000."""
    head_dim = module.head_dim
    weights, bias = _separate_projections(module, ("q_proj", "k_proj", "v_proj", "out_proj"))
    kwargs = {"d_model": module.embed_dim, "num_heads": module.num_attention_heads, "bias": bias}
    kwargs |= {"scale": 1.0 / module.scale_attn, "rope_interleaved": True}
    kwargs |= _rope_kwargs({"rope_theta": 10000.0}, head_dim, module.rotary_dim or head_dim)
    return kwargs, weights


def _gpt_neox(module, config):
    """GPT-NeoX: one fused q/k/v projection, interleaved per head; partial RoPE."""
    num_heads, head_dim = config.num_attention_heads, module.head_size
    weights, bias = _fused_projections(module.query_key_value, module.dense, num_heads, head_dim)
    kwargs = {"d_model": config.hidden_size, "num_heads": num_heads, "bias": bias}
    kwargs |= {"scale": float(module.scaling)} | _rope_kwargs(_rope_parameters(config, None), head_dim)
    return kwargs, weights


def _gpt2(module, config):
    """GPT-2: a fused Conv1D c_attn (E, 3E) = [query | key | value], y = x @ W + b."""
    if module.is_cross_attention:
        raise ValueError(
            "`module` must be a GPT-2 self-attention (`transformer.h[i].attn`): cross-attention is not ported. "
            "Received: is_cross_attention=True"
        )
    width = module.embed_dim
    kernel, bias = _array(module.c_attn.weight), _array(module.c_attn.bias)  # (E, 3E), (3E,)
    weights = {}
    for index, name in enumerate(("query", "key", "value")):
        weights[f"{name}_kernel"] = kernel[:, index * width : (index + 1) * width].copy()  # (E, E)
        weights[f"{name}_bias"] = bias[index * width : (index + 1) * width].copy()  # (E,)
    weights["output_kernel"], weights["output_bias"] = _array(module.c_proj.weight), _array(module.c_proj.bias)
    kwargs = {"d_model": width, "num_heads": module.num_heads, "bias": True, "scale": float(module.scaling)}
    return kwargs, weights


def _bert(module, config):
    """BERT's `BertAttention`: `self.query/key/value` and `output.dense` (its residual and LayerNorm stay out)."""
    attention = module.self
    weights, bias = {}, []
    for name, linear in zip(
        ("query", "key", "value", "output"),
        (attention.query, attention.key, attention.value, module.output.dense),
        strict=True,
    ):
        if _linear(name, linear, weights):
            bias.append(name)
    kwargs = {"d_model": config.hidden_size, "num_heads": attention.num_attention_heads}
    kwargs |= {
        "head_dim": attention.attention_head_size,
        "bias": _bias_argument(bias),
        "scale": float(attention.scaling),
    }
    return kwargs, weights


def _bert_self(module, config):
    raise ValueError(
        "Pass the `BertAttention` module (`encoder.layer[i].attention`), which holds the output projection "
        f"`output.dense`, not its `self`. Received: {type(module).__name__}"
    )


def _t5(module, config):
    """T5: no biases, scale 1.0; the relative position bias is a call argument (`t5_position_bias`)."""
    weights, bias = _separate_projections(module, ("q", "k", "v", "o"))
    kwargs = {"d_model": module.d_model, "num_heads": module.n_heads, "head_dim": module.key_value_proj_dim}
    kwargs |= {"bias": bias, "scale": float(module.scaling)}
    return kwargs, weights


def _bloom(module, config):
    """Bloom: fused q/k/v per head, ALiBi as a call argument; the module's residual add stays out."""
    if module.beta != 1.0:
        raise ValueError(f"Bloom's ALiBi weight `beta` must be 1.0. Received: beta={module.beta}")
    weights, bias = _fused_projections(module.query_key_value, module.dense, module.num_heads, module.head_dim)
    kwargs = {"d_model": module.hidden_size, "num_heads": module.num_heads, "bias": bias}
    kwargs["scale"] = float(module.inv_norm_factor)
    return kwargs, weights


_PORTERS = {
    "LlamaAttention": _rotary_projections,
    "MistralAttention": _rotary_projections,
    "MixtralAttention": _rotary_projections,
    "Starcoder2Attention": _rotary_projections,
    "GraniteAttention": _rotary_projections,
    "CohereAttention": functools.partial(_rotary_projections, interleaved=True),
    "GemmaAttention": _rotary_projections,
    "Qwen2Attention": _rotary_projections,
    "Qwen3Attention": _rotary_projections,
    "Gemma2Attention": _rotary_projections,
    "Gemma3Attention": _rotary_projections,
    "Olmo2Attention": _rotary_projections,
    "GptOssAttention": _rotary_projections,
    "PhiAttention": _rotary_projections,
    "GPTJAttention": _gptj,
    "GPTNeoXAttention": _gpt_neox,
    "GPT2Attention": _gpt2,
    "BertAttention": _bert,
    "BertSelfAttention": _bert_self,
    "T5Attention": _t5,
    "BloomAttention": _bloom,
}


def supported_modules():
    """The class names of the `transformers` attention modules `port_attention` reads."""
    return tuple(name for name, porter in _PORTERS.items() if porter is not _bert_self)


def port_attention(module, config):
    """Reads a `transformers` attention module into this project's layer.

    Args:
        module: the attention module of one layer (`model.model.layers[i].self_attn`, BERT's
            `encoder.layer[i].attention`, T5's `block[i].layer[0].SelfAttention`, ...), or an
            instance of a subclass of one of `supported_modules()`.
        config: the model's config (`model.config`; of a multimodal model, its text config is read).

    Returns:
        `(layer_kwargs, weights)`: `MultiHeadAttention(**layer_kwargs)` followed by
        `import_weights(weights)` computes what the module computes, given the call arguments in
        the module docstring. `weights` holds float32 NumPy arrays in the portable layout.

    Raises:
        ValueError: for a module this converter does not know, or a variant the layer cannot
            hold (RoPE scaling other than linear, llama3 and yarn, Phi's LayerNorm QK-norm, GPT-2
            cross-attention).
    """
    if hasattr(config, "get_text_config"):  # a multimodal config (Gemma 3) holds the text model's
        config = config.get_text_config()
    for cls in type(module).__mro__:
        if cls.__name__ in _PORTERS:
            return _PORTERS[cls.__name__](module, config)
    raise ValueError(
        f"`module` must be one of the attention modules {', '.join(supported_modules())}. "
        f"Received: {type(module).__name__}"
    )


def t5_position_bias(module, query_length, key_length, past_length=0):
    """T5's relative position bias, (1, N, T, S) float32, to pass as `attention_bias`.

    Args:
        module: the `T5Attention` that holds `relative_attention_bias`: the first layer's of the
            encoder or decoder stack (the other layers reuse it).
        query_length: T.
        key_length: S (the L cache slots when decoding).
        past_length: the position of the first query (the cache's index when decoding).
    """
    if not module.has_relative_attention_bias:
        raise ValueError(
            "`module` must hold T5's `relative_attention_bias` (the first layer of its stack holds it, the others "
            "reuse it). Received: a T5Attention with has_relative_attention_bias=False"
        )
    return _array(module.compute_bias(query_length, key_length, past_seen_tokens=past_length))


def alibi_positions(key_mask):
    """Bloom's ALiBi key positions, (B, S) int64: `(cumsum(key_mask) - 1) * key_mask` (0 at padding).

    Pass `alibi_bias(num_heads, alibi_positions(mask))` (the layer file's function) as `attention_bias`.
    """
    key_mask = np.asarray(key_mask).astype(np.int64)
    return (np.cumsum(key_mask, axis=-1) - 1) * key_mask
