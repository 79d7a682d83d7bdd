"""Port the attention of Hugging Face `transformers` models to `MultiHeadAttention`.

One converter for the three layers, two routes to the same `(layer_kwargs, weights)`: the
constructor arguments and the portable weights (docs/SPEC.md, "Weights").

From a loaded PyTorch model (needs torch and transformers):

    layer_kwargs, weights = port_attention(model.model.layers[0].self_attn, model.config)

From a checkpoint, with neither torch nor transformers installed (a Keras or NumPy user):

    layer_kwargs, weights = port_checkpoint("model/config.json", "model/model.safetensors", 0)

and in both cases:

    layer = MultiHeadAttention(**layer_kwargs)  # NumPy, PyTorch or TensorFlow: the same arguments
    layer.import_weights(weights)

Both routes run one porter per family: `porter(config, tensors, layer_index)` reads the config as
a dict and the attention module's own tensors by their names in its `state_dict` (`q_proj.weight`,
...). A family is found by its `transformers` model type (the config's `model_type`; for a module,
the `transformers.models.<type>` package its class comes from), so exact clones port like their
original (RoBERTa as BERT, Qwen3-MoE as Qwen3). A subclass that overrides `forward`, or a module
whose projections are not `torch` or `transformers` modules (LoRA, quantized, user classes), is
refused unless a porter is registered for its class name with `register_porter`.

Only what is attention is ported: the q/k/v projections (their biases where the module has
them), QK-norm, RoPE, the softmax scale, soft-capping, the sliding window, chunked attention,
sinks, the output gate and the output projection. Residual connections, dropout and the layer norms around the
module stay in the model (BERT's module adds the residual and a LayerNorm after `output.dense`;
Bloom's adds the residual after `dense`: the layer's output is the output of that dense projection).

Legend: B batch size, T query length, S key length, E hidden size, N query heads,
K key/value heads, H head dimension.

The module does not hold its masks: `transformers` builds them in the model and passes them in.
These call arguments reproduce them (`attention_mask` is the model's (B, S) 0/1 padding mask,
`position_ids` the (B, T) positions the model was called with):

- Llama, Mistral, Mixtral, Qwen2 (and MoE), Qwen3 (and MoE), Gemma, Gemma 2, Gemma 3, OLMo, OLMo2,
  gpt-oss, Phi, Phi3, GPT-NeoX, GPT-J, Starcoder2, Granite, Cohere, Cohere2, StableLM, SmolLM3,
  GLM4, Falcon, Llama 4, Qwen2-VL, Qwen2.5-VL, the gated Qwen3-Next, Qwen3.5 (and MoE), AFMoE and
  LFM3, and the MLA families (DeepSeek-V2, DeepSeek-V3, GLM-4-MoE-Lite, Youtu, AXK1, Mistral 4,
  MiniCPM3, Kimi Linear, Ling's bailing_hybrid, LongCat-Flash): `causal=True,
  key_mask=attention_mask.bool(), positions=position_ids`; a NoPE layer (no `rope_theta` in its
  kwargs: SmolLM3's `no_rope_layers`, Cohere2's full layers, Llama 4's NoPE layers, AFMoE's full
  layers, Kimi Linear's MLA layers) takes no `positions`.
  Qwen2-VL's and Qwen2.5-VL's multimodal RoPE (`rope_sections`) takes the (3, B, T) positions its
  rotary embedding reads, one row per section (`generate` passes (4, B, T): the text positions,
  then these three; for text alone the three rows are the text positions).
- GPT-2, GPT-Neo, GPTBigCode, OPT, the BART and Whisper decoders' self-attention:
  `causal=True, key_mask=attention_mask.bool()`.
- BERT, RoBERTa, XLM-RoBERTa, the BART encoder: `key_mask=attention_mask.bool()`; ModernBERT
  adds `positions=position_ids`; the Whisper encoder attends every frame (no mask).
- T5 self-attention: `key_mask=attention_mask.bool(), attention_bias=t5_position_bias(module0, T, S)`
  (`module0`: the first layer's T5Attention of that stack); the decoder adds `causal=True`.
- Bloom and MPT: `causal=True, key_mask=attention_mask.bool(),
  attention_bias=alibi_bias(N, alibi_positions(attention_mask))` (`alibi_bias` from the layer's
  file; MPT's slopes are the same for its default `alibi_bias_max=8`, and its key positions differ
  from these by a constant per query, which the softmax does not see).
- Falcon's ALiBi models (`alibi=True`): the same, with the bias times the layer's `scale`
  (Falcon scales its bias with the scores): `attention_bias=alibi_bias(N,
  alibi_positions(attention_mask)) * kwargs["scale"]`.

The sliding window (Mistral, Mixtral, Starcoder2, Qwen2, Gemma 2 and 3, gpt-oss, Phi3, Cohere2,
GPT-Neo's local layers; ModernBERT's local layers, two-sided: |t - s| <= h = local_attention // 2
is `window=(h + 1, h + 1)`) is part of the layer (`window`), so no band mask is needed. With left
padding, `transformers` leaves the padded query rows attending nothing useful; this layer gives
them `output_bias` (no key left): compare real tokens only (and for ModernBERT's local layers, whose
padded queries far from the real tokens have no key either).

Llama 4's chunked layers port as `attention_chunk_size=C`: chunks of C slots counted from the
first slot. `transformers` counts a left-padded row's chunks from its first real token: the same
chunks where every row's left padding is a multiple of C (no padding, right padding, one prompt).
For other left-padded batches, build the layer without `attention_chunk_size` and pass
`attention_mask=(key_positions[:, None, :] // C) == (position_ids[:, :, None] // C)` (B, T, S),
`key_positions` the (B, S) positions of the keys (cumsum(attention_mask) - 1).

Gated attention (`gate=True`): Qwen3-Next's and Qwen3.5's `q_proj` yields, head by head, the query and
the gate, split into `query_kernel` and `gate_kernel`; AFMoE's `gate_proj` is `gate_kernel`; LFM3's
`g_proj`, one gate per head, is repeated over the head's H features. Their hybrid models' other
layers (Qwen3-Next's and Qwen3.5's linear attention, LFM3's convolutions) are refused by their
`layer_types` entry, and so are LFM3's full-attention layers (proportional RoPE: pairs (i, i + H/2),
the last ones not turning) for their RoPE. Qwen3.5's interleaved multimodal RoPE is plain RoPE for
text (its three rows of positions alike): the port takes the (B, T) text positions. Refused with
the reason: Qwen4-Exp (its attention keeps the keys a learned sparse indexer selects) and
Step-3.7 (its per-layer config).

Decoding: `cache = layer.init_cache(B, L)`, then `layer(x, cache=cache, causal=True,
key_mask=<the new tokens' mask>, positions=<their position_ids>)`, one prefill and then one
token at a time, as `transformers` does with its `DynamicCache`; T5, Bloom, MPT and Falcon's ALiBi
models pass their bias
over the L cache slots (`t5_position_bias(module, T, L, past_length=index)`, ALiBi over the
positions of all L slots).

RoPE scaling: `default`, `linear`, `llama3` and `yarn` (gpt-oss' default) port with their
parameters; other types (dynamic, LongRoPE) are a `ValueError` for now. OLMo's and MPT's
`clip_qkv` port as the layer's `clip_qkv`. QK-norms: RMSNorms (Qwen3, Gemma 3, OLMo2, Llama 4) and
LayerNorms (`qk_norm_type="layer"`: Phi's one LayerNorm with a bias, StableLM's and Cohere's scale
per head) port as the layer's. Multi-head latent attention ports as the layer's MLA
(`kv_lora_rank`, ...; YaRN's `mscale_all_dim` correction in `scale`): DeepSeek-V2, V3 and the
families built on their attention (GLM-4-MoE-Lite, Youtu, AXK1, Mistral 4, MiniCPM3, Kimi Linear's
NoPE MLA layers, Ling's MLA layers with their per-head output gate as `gate`, LongCat-Flash's two
sublayers per decoder layer with their LoRA scales folded into the weights). Refused with the
reason: Llama 4's NoPE layers' temperature tuning (and Mistral 4's `llama_4_scaling_beta`), GPT-2
and GPTBigCode cross-attention, the linear-attention layers of Kimi Linear and Ling, and the MLA
model types whose attention adds a sparse-attention indexer or a norm the layer lacks
(DeepSeek-V3.2, GLM-MoE-DSA, GLM-5-Next, Mistral Large 4, HY-V4, AXK2, dots3).
This file imports no framework at module level: `port_attention` reads a module's tensors through its own `state_dict`,
`port_checkpoint` and `load_tensors` read safetensors files with NumPy, and `replace_attention`
imports torch and the PyTorch layer when called.
"""

import functools
import json
import math
import os
import struct
from collections.abc import Mapping

import numpy as np

__all__ = [
    "alibi_positions",
    "load_tensors",
    "port_attention",
    "port_checkpoint",
    "register_porter",
    "replace_attention",
    "supported_modules",
    "t5_position_bias",
]

_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_YARN_OPTIONAL_KEYS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


# ----------------------------------------------------------------------------------------------
# Reading tensors and configs
# ----------------------------------------------------------------------------------------------


def _float32(array):
    """An array as float32 NumPy (a copy)."""
    return np.array(array, dtype=np.float32)


def _tensor(tensors, name):
    """The module's tensor `name` as float32, or a ValueError naming what the module holds."""
    if name not in tensors:
        raise ValueError(
            f"`tensors` must hold `{name}` for this family's attention. Received: {', '.join(sorted(tensors))}"
        )
    return _float32(tensors[name])


def _linear(name, tensors, source, weights):
    """Adds the `nn.Linear` `source` ((out, in) weight) as `{name}_kernel` (in, out) and its bias; True if biased."""
    weights[f"{name}_kernel"] = _tensor(tensors, f"{source}.weight").T.copy()  # (out, in) -> (in, out)
    if f"{source}.bias" not in tensors:
        return False
    weights[f"{name}_bias"] = _tensor(tensors, f"{source}.bias")
    return True


def _bias_argument(names):
    """The constructor's `bias`: True (all four), False (none) or the tuple of names with a bias."""
    if len(names) == 4:
        return True
    return tuple(names) if names else False


def _separate_projections(tensors, sources):
    """Weights and `bias` of four `nn.Linear` projections named by `sources` (query, key, value, output)."""
    weights, with_bias = {}, []
    for name, source in zip(("query", "key", "value", "output"), sources, strict=True):
        if _linear(name, tensors, source, weights):
            with_bias.append(name)
    return weights, _bias_argument(with_bias)


def _split_fused(tensors, fused, output, columns):
    """Weights and `bias` of a fused q/k/v `nn.Linear` and the output one; `columns`: the q, k and v rows of the
    fused weight (`_blocks`, `_per_head`, `_grouped`)."""
    kernel = _tensor(tensors, f"{fused}.weight").T  # (q + k + v widths, E) -> (E, q + k + v widths)
    bias = _tensor(tensors, f"{fused}.bias") if f"{fused}.bias" in tensors else None
    weights, with_bias = {}, []
    for name, index in zip(("query", "key", "value"), columns, strict=True):
        weights[f"{name}_kernel"] = kernel[:, index].copy()  # (E, width)
        if bias is not None:
            weights[f"{name}_bias"] = bias[index].copy()
            with_bias.append(name)
    if _linear("output", tensors, output, weights):
        with_bias.append("output")
    return weights, _bias_argument(with_bias)


def _blocks(*sizes):
    """Rows [q | k | v] of the given widths (Phi3, GPTBigCode and Falcon multi-query, MPT, ModernBERT)."""
    edges = np.cumsum((0, *sizes))
    return [np.arange(edges[part], edges[part + 1]) for part in range(3)]


def _per_head(num_heads, head_dim):
    """Rows [q_n, k_n, v_n] for each head n (GPT-NeoX, Bloom, GPTBigCode and Falcon without multi-query)."""
    order = np.arange(3 * num_heads * head_dim).reshape(num_heads, 3, head_dim)
    return [order[:, part].reshape(-1) for part in range(3)]


def _grouped(num_kv_heads, group, head_dim):
    """Rows [q_g0 .. q_g(G-1), k_g, v_g] for each key/value head g (Falcon's new decoder architecture)."""
    order = np.arange(num_kv_heads * (group + 2) * head_dim).reshape(num_kv_heads, group + 2, head_dim)
    return [order[:, :group].reshape(-1), order[:, group].reshape(-1), order[:, group + 1].reshape(-1)]


class _Prefixed(Mapping):
    """The tensors under `prefix` of a checkpoint's mapping, by their names in the module's `state_dict`."""

    def __init__(self, tensors, prefix):
        self._tensors, self._prefix = tensors, prefix
        self._names = [name[len(prefix) :] for name in tensors if name.startswith(prefix)]

    def __getitem__(self, name):
        return self._tensors[self._prefix + name]

    def __contains__(self, name):
        return self._prefix + name in self._tensors

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)


_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class _SafetensorsFile(Mapping):
    """A `.safetensors` file read with NumPy only, one tensor at a time (bfloat16 widened to float32)."""

    def __init__(self, path):
        self._path = os.fspath(path)
        with open(self._path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            self._header = json.loads(file.read(length))
        self._header.pop("__metadata__", None)
        self._start = 8 + length

    def __getitem__(self, name):
        entry = self._header[name]
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"`tensors` holds `{name}` in a dtype this reader lacks. Received: {entry['dtype']}")
        begin, end = entry["data_offsets"]
        dtype = np.dtype(_SAFETENSORS_DTYPES[entry["dtype"]]).newbyteorder("<")
        with open(self._path, "rb") as file:
            file.seek(self._start + begin)
            array = np.frombuffer(file.read(end - begin), dtype=dtype).reshape(entry["shape"])
        if entry["dtype"] == "BF16":
            return (array.astype(np.uint32) << 16).view(np.float32)  # bfloat16 is float32's top 16 bits
        return array

    def __iter__(self):
        return iter(self._header)

    def __len__(self):
        return len(self._header)


class _ShardedSafetensors(Mapping):
    """A sharded checkpoint: `model.safetensors.index.json` and the files its `weight_map` names."""

    def __init__(self, index_path):
        directory = os.path.dirname(os.fspath(index_path))
        with open(index_path) as file:
            self._map = json.load(file)["weight_map"]
        self._files = {name: _SafetensorsFile(os.path.join(directory, name)) for name in set(self._map.values())}

    def __getitem__(self, name):
        return self._files[self._map[name]][name]

    def __iter__(self):
        return iter(self._map)

    def __len__(self):
        return len(self._map)


def load_tensors(tensors):
    """A checkpoint's tensors as a mapping of names to NumPy arrays, read with NumPy only, one tensor when asked.

    Args:
        tensors: a `.safetensors` file (or the directory holding `model.safetensors`), a sharded
            checkpoint's `model.safetensors.index.json`, or a mapping (returned as it is).

    Returns:
        A mapping: `load_tensors(path)["embeddings.word_embeddings.weight"]` reads that tensor
        (bfloat16 widened to float32; the other dtypes as stored).
    """
    if isinstance(tensors, Mapping):
        return tensors
    if isinstance(tensors, (str, os.PathLike)):
        path = os.fspath(tensors)
        if path.endswith(".json"):
            return _ShardedSafetensors(path)
        if os.path.isdir(path):
            path = os.path.join(path, "model.safetensors")
        return _SafetensorsFile(path)
    raise ValueError(
        "`tensors` must be a mapping of names to arrays or the path of a .safetensors file. "
        f"Received: {type(tensors).__name__}"
    )


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


# ----------------------------------------------------------------------------------------------
# What configs say
# ----------------------------------------------------------------------------------------------


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


def _qk_norm(config, tensors, head_dim, weights, norm):
    """QK-norm kwargs and weights from `q_norm` / `k_norm`: RMSNorms (Qwen3, Gemma 3: one scale (H,) shared by the
    heads; OLMo2: over all heads), or Cohere's LayerNorm (`norm="layer"`) of (heads, H), each head its own scale."""
    # Gemma's, Qwen3-Next's and Qwen3.5's RMSNorms multiply by (1 + weight): the portable scale is 1 + weight,
    # computed as they do (float32).
    offset = np.float32(1.0 if config.get("model_type", "").startswith(_UNIT_OFFSET_NORMS) else 0.0)
    query, key = _tensor(tensors, "q_norm.weight"), _tensor(tensors, "k_norm.weight")
    weights["query_norm"] = query.reshape(-1) + offset  # Cohere's (N, H) -> (N*H,), head-major
    weights["key_norm"] = key.reshape(-1) + offset  # (K, H) -> (K*H,)
    kind = "per_head" if query.ndim == 2 else "head" if query.shape == (head_dim,) else "all"
    if norm == "layer":
        return {"qk_norm": kind, "qk_norm_eps": float(config["layer_norm_eps"]), "qk_norm_type": "layer"}
    return {"qk_norm": kind, "qk_norm_eps": float(config["rms_norm_eps"])}


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


# ----------------------------------------------------------------------------------------------
# The porters: porter(config dict, the module's tensors, layer index) -> (layer_kwargs, weights)
# ----------------------------------------------------------------------------------------------


def _rotary(config, tensors, index, *, interleaved=False, scale=None, rope="all", norm="rms", mrope=False):
    """Llama and its descendants: q_proj, k_proj, v_proj and o_proj (Phi: dense; Phi3: a fused qkv_proj),
    RoPE from the config (`interleaved`: Cohere and GLM pair features 2i and 2i + 1; `scale`: the config
    key of a scale other than 1 / sqrt(H); `rope`: "all", "sliding" (Cohere2) or "no_rope_layers" (SmolLM3)
    for the layers that rotate; `norm`: the QK-norm of `q_norm`, "rms" or "layer" (Cohere); `mrope`: Qwen2-VL's
    multimodal RoPE, `mrope_section`)."""
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
        if mrope:  # transformers' default sections where the config names none
            kwargs["rope_sections"] = tuple(int(n) for n in parameters.get("mrope_section", (16, 24, 24)))
    window = _window(config, index)
    if window is not None:
        kwargs["window"] = window
    if config.get("attn_logit_softcapping") is not None:
        kwargs["softcap"] = float(config["attn_logit_softcapping"])
    if "q_norm.weight" in tensors:
        kwargs |= _qk_norm(config, tensors, head_dim, weights, norm)
    elif "q_layernorm.weight" in tensors or "q_layernorm.norms.0.weight" in tensors:
        kwargs |= _qk_layernorm(config, tensors, weights, num_heads, num_kv_heads)
    if "sinks" in tensors:
        kwargs["sinks"] = True
        weights["sinks"] = _tensor(tensors, "sinks")
    if config.get("clip_qkv") is not None:  # OLMo: q, k and v clamped after their projections
        kwargs["clip_qkv"] = float(config["clip_qkv"])
    return kwargs, weights


def _gated(config, tensors, index, *, gate, rope="all"):
    """Attention with an output gate, sigmoid(hidden @ gate_kernel) times each head's result before `o_proj`
    (`_rotary` for the rest). `gate`: "q_proj" (Qwen3-Next, Qwen3.5: `q_proj` yields, head by head, H query
    features and then H gate features), "gate_proj" (AFMoE: an (N*H, E) projection) or "g_proj" (LFM3: one gate
    per head, (N, E), the same for each of its H features). Layers that are not attention (Qwen3-Next's and
    Qwen3.5's linear attention, LFM3's convolutions) are refused by name."""
    _refuse_layer_type(config, index)
    if "rms_norm_eps" not in config and "norm_eps" in config:  # LFM3's name for it (`attribute_map`)
        config = {**config, "rms_norm_eps": config["norm_eps"]}
    head_dim, num_heads = _head_dim(config), config["num_attention_heads"]
    if gate == "q_proj":  # rows [q_0, g_0, q_1, g_1, ...], H each: split into two projections
        tensors = dict(tensors)
        for part in ("weight", "bias"):
            if f"q_proj.{part}" in tensors:
                fused = _tensor(tensors, f"q_proj.{part}")  # (N*2H, E) or (N*2H,)
                both = fused.reshape(num_heads, 2, head_dim, *fused.shape[1:])  # (N, 2, H, E) or (N, 2, H)
                tensors[f"q_proj.{part}"] = both[:, 0].reshape(num_heads * head_dim, *fused.shape[1:])  # (N*H, ...)
                tensors[f"gate.{part}"] = both[:, 1].reshape(num_heads * head_dim, *fused.shape[1:])
        gate = "gate"
    kwargs, weights = _rotary(config, tensors, index, rope=rope)
    if gate == "g_proj" and "g_proj.weight" not in tensors:
        gate = "gate_proj"  # LFM3's checkpoints name it so (transformers renames it `g_proj` when loading)
    kernel = _tensor(tensors, f"{gate}.weight")  # (N*H, E), or LFM3's (N, E)
    if kernel.shape[0] == num_heads and num_heads != num_heads * head_dim:  # LFM3: one gate per head
        kernel = np.repeat(kernel, head_dim, axis=0)  # (N, E) -> (N*H, E): head n's gate on each of its features
    weights["gate_kernel"] = kernel.T.copy()  # (E, N*H)
    names = {True: _PROJECTION_NAMES, False: ()}.get(kwargs["bias"], kwargs["bias"])
    if f"{gate}.bias" in tensors:
        weights["gate_bias"] = _tensor(tensors, f"{gate}.bias")
        names = (*names, "gate")
    kwargs["bias"] = True if names == (*_PROJECTION_NAMES, "gate") else tuple(names) or False
    return kwargs | {"gate": True}, weights


_PROJECTION_NAMES = ("query", "key", "value", "output")
_NOT_ATTENTION = {"linear_attention": "a linear attention (a gated delta rule)", "conv": "a short convolution"}


def _refuse_layer_type(config, index):
    """Refuses a layer of a hybrid model that is not attention, naming its `layer_types` entry."""
    layer_type = None if index is None else _layer_type(config, index)
    if layer_type in _NOT_ATTENTION:
        raise ValueError(
            f"`layer_index` must name an attention layer: layer {index} of this {config.get('model_type')} model is "
            f"{_NOT_ATTENTION[layer_type]}, not attention. Received: layer_types[{index}]={layer_type!r}"
        )


def _scale(config, key, head_dim):
    """The softmax scale: 1 / sqrt(H), Gemma's `query_pre_attn_scalar ** -0.5` or Granite's `attention_multiplier`."""
    if key == "query_pre_attn_scalar":
        return float(config[key] ** -0.5)
    if key is not None:
        return float(config[key])
    return float(head_dim**-0.5)


def _rotates(config, index, layer_type, rope):
    """Whether layer `index` applies RoPE: every layer, the sliding ones (Cohere2) or SmolLM3's `no_rope_layers`."""
    if rope == "sliding":
        return layer_type == "sliding_attention"
    if rope == "no_rope_layers":
        if index is None:
            raise ValueError("`layer_index` must be given for SmolLM3 (`no_rope_layers`). Received: layer_index=None")
        return bool(config["no_rope_layers"][index])
    return True


def _gptj(config, tensors, index):
    """GPT-J: no biases, interleaved RoPE on the first `rotary_dim` features, base 10000."""
    head_dim = config["n_embd"] // config["n_head"]
    weights, bias = _separate_projections(tensors, ("q_proj", "k_proj", "v_proj", "out_proj"))
    kwargs = {"d_model": config["n_embd"], "num_heads": config["n_head"], "bias": bias}
    kwargs |= {"scale": float(head_dim**-0.5), "rope_interleaved": True}
    kwargs |= _rope_kwargs({"rope_theta": 10000.0}, head_dim, config.get("rotary_dim") or head_dim)
    return kwargs, weights


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


def _bart(config, tensors, index):
    """BART, Whisper, OPT (and the other BART-style models): q/k/v_proj and out_proj, scale 1 / sqrt(H)."""
    width = config.get("d_model") or config["hidden_size"]
    num_heads = _bart_heads(config)
    weights, bias = _separate_projections(tensors, ("q_proj", "k_proj", "v_proj", "out_proj"))
    return {
        "d_model": width,
        "num_heads": num_heads,
        "bias": bias,
        "scale": float((width // num_heads) ** -0.5),
    }, weights


def _bart_heads(config):
    """BART-style configs give encoder and decoder heads apart: they must agree for one porter to read either."""
    heads = {config.get(key) for key in ("encoder_attention_heads", "decoder_attention_heads")} - {None}
    if len(heads) > 1:
        raise ValueError(
            "`config` must have one number of heads for the encoder and the decoder (this porter cannot tell them "
            f"apart). Received: encoder_attention_heads and decoder_attention_heads {sorted(heads)}"
        )
    return heads.pop() if heads else config["num_attention_heads"]


def _bert(config, tensors, index):
    """BERT's `BertAttention`: `self.query/key/value` and `output.dense` (its residual and LayerNorm stay out)."""
    if "output.dense.weight" not in tensors:
        raise ValueError(
            "Pass the `BertAttention` module (`encoder.layer[i].attention`), which holds the output projection "
            f"`output.dense`, not its `self`. Received: a module holding {', '.join(sorted(tensors))}"
        )
    num_heads = config["num_attention_heads"]
    head_dim = config["hidden_size"] // num_heads
    sources = ("self.query", "self.key", "self.value", "output.dense")
    weights, bias = _separate_projections(tensors, sources)
    kwargs = {"d_model": config["hidden_size"], "num_heads": num_heads, "head_dim": head_dim}
    return kwargs | {"bias": bias, "scale": float(head_dim**-0.5)}, weights


def _t5(config, tensors, index):
    """T5: no biases, scale 1.0; the relative position bias is a call argument (`t5_position_bias`)."""
    weights, bias = _separate_projections(tensors, ("q", "k", "v", "o"))
    kwargs = {"d_model": config["d_model"], "num_heads": config["num_heads"], "head_dim": config["d_kv"]}
    return kwargs | {"bias": bias, "scale": 1.0}, weights


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


def _modernbert(config, tensors, index):
    """ModernBERT: a fused Wqkv [q | k | v], Wo, RoPE of the layer type; its local layers attend the keys within
    `local_attention // 2` of each token on both sides (|t - s| <= local_attention // 2)."""
    layer_type = _layer_type(config, index)
    width, num_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = width // num_heads
    weights, bias = _split_fused(tensors, "Wqkv", "Wo", _blocks(width, width, width))
    kwargs = {"d_model": width, "num_heads": num_heads, "bias": bias, "scale": float(head_dim**-0.5)}
    if layer_type == "sliding_attention":
        half = config["local_attention"] // 2 if "local_attention" in config else config["sliding_window"]
        kwargs["window"] = (half + 1, half + 1)  # s > t - (half + 1) and s < t + (half + 1)
    return kwargs | _rope_kwargs(_rope_parameters(config, layer_type), head_dim), weights


def _llama4(config, tensors, index):
    """Llama 4's text attention: interleaved RoPE and a weightless RMS QK-norm on its RoPE layers (the norm
    commutes with the rotation, so the layer's norm-then-rotate order computes the same), chunked attention on
    its `chunked_attention` layers, NoPE layers."""
    rotates = _rotates(config, index, None, "no_rope_layers")
    if not rotates and config.get("attn_temperature_tuning"):
        raise ValueError(
            "`config.attn_temperature_tuning` must be off for a NoPE layer: it scales the queries by their "
            f"position, which the layer cannot. Received: attn_temperature_tuning=True on layer {index}"
        )
    kwargs, weights = _rotary(config, tensors, index, interleaved=True, rope="no_rope_layers")
    if config.get("use_qk_norm") and rotates:
        weights["query_norm"] = weights["key_norm"] = np.ones(kwargs["head_dim"], np.float32)
        kwargs |= {"qk_norm": "head", "qk_norm_eps": float(config["rms_norm_eps"])}
    if _layer_type(config, index) == "chunked_attention" and config.get("attention_chunk_size") is not None:
        kwargs["attention_chunk_size"] = int(config["attention_chunk_size"])
    return kwargs, weights


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
    if interleaved or config.get("rope_interleave", False):
        kwargs["rope_interleaved"] = True
    if parameters.get("rope_type", "default") != "default" and parameters.get("mscale_all_dim"):
        factor = parameters["factor"]
        scale *= (0.1 * parameters["mscale_all_dim"] * math.log(factor) + 1.0) ** 2 if factor > 1 else 1.0
    kwargs["scale"] = float(scale)
    return kwargs, weights


def _latent_rope_parameters(config):
    """The RoPE parameters of an MLA layer, which turns the whole Hr part: a `partial_rotary_factor` (Mistral 4's
    Hr / (Hn + Hr)) only says so. Refuses Llama 4's query scaling by position (Mistral 4's `llama_4_scaling_beta`)."""
    parameters = {k: v for k, v in _rope_parameters(config, None).items() if k != "partial_rotary_factor"}
    if parameters.get("llama_4_scaling_beta"):
        raise ValueError(
            "`config.rope_parameters['llama_4_scaling_beta']` must be 0 or absent: it scales the queries by their "
            "position (Llama 4's temperature tuning), which the layer cannot. "
            f"Received: llama_4_scaling_beta={parameters['llama_4_scaling_beta']!r}"
        )
    return parameters


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


def _family(porter, path, **options):
    """One family: its porter, given `options`, and the path of layer {i}'s attention in its checkpoints."""

    def port(config, tensors, index):
        return porter(config, tensors, index, **options)

    port.__doc__, port.family = porter.__doc__, porter
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
    "longcat_flash": _family(
        _latent, lambda i: f"layers.{i // 2}.self_attn.{i % 2}", interleaved=True, lora_scales=True
    ),
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


def _porter(name):
    if name in _REGISTERED:
        return _REGISTERED[name]
    return _BUILTIN[name][0] if name in _BUILTIN else None


# ----------------------------------------------------------------------------------------------
# The two routes
# ----------------------------------------------------------------------------------------------


def _transformers_model_type(cls):
    """The model type of a `transformers.models.<type>.modeling_<type>` class, else None."""
    parts = cls.__module__.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["transformers", "models"] else None


def _module_porter(module):
    """The porter of a module: registered for a class along its hierarchy, else of its transformers model type,
    refusing a subclass that overrides `forward` and projections that are not torch or transformers modules."""
    for cls in type(module).__mro__:
        if cls.__name__ in _REGISTERED:
            return _REGISTERED[cls.__name__]
        model_type = _transformers_model_type(cls)
        if model_type is not None:
            break
        if cls.__module__.split(".")[0] in ("torch", "builtins"):
            _refuse_unknown(module)
        if "forward" in vars(cls):
            raise ValueError(
                f"`module` must compute what its transformers class computes: {cls.__name__} overrides `forward`. "
                "Register a porter for it with `register_porter`. Received: " + type(module).__name__
            )
    else:
        _refuse_unknown(module)
    _check_submodules(module)
    porter = _porter(model_type)
    if porter is None:
        _refuse_variant(model_type, "module")
        _refuse_unknown(module, f" of model type {model_type!r}")
    return porter


_GATED_REFUSED = {  # gated attention with something more that the layer does not compute
    "qwen4_exp": "Qwen4-Exp's attention keeps only the keys its query-selected sparse attention indexer (`indexer`) "
    "picks, a learned top-k selection per query",
    "step3p7": "Step-3.7's attention reads its head counts, RoPE bases and partial rotary factors from a per-layer "
    "config (`per_layer_config`), which no porter reads",
}
_GATED_REFUSED["qwen4_exp_text"] = _GATED_REFUSED["qwen4_exp"]  # its text config's model type
_GATED_REFUSED["step3p5"] = _GATED_REFUSED["step3p7"]  # its config's model type
_INDEXER = "a learned sparse-attention indexer (`indexer`: each query attends to its top-k keys only)"
_DOTS3 = f"an RMSNorm on the shared rotary key (`k_rope_only_layernorm`) and {_INDEXER}"
_REFUSED = {  # MLA model types of transformers whose attention adds what the layer lacks: who, and what
    "deepseek_v32": ("DeepSeek-V3.2", _INDEXER),
    "glm_moe_dsa": ("GLM-MoE-DSA", _INDEXER),
    "glm5_next": ("GLM-5-Next", f"{_INDEXER} and linear-attention layers"),
    "glm5_next_text": ("GLM-5-Next", f"{_INDEXER} and linear-attention layers"),
    "mistral_large4": ("Mistral Large 4", _INDEXER),
    "mistral_large4_text": ("Mistral Large 4", _INDEXER),
    "hy_v4": ("HY-V4", f"{_INDEXER}, shared by its layers"),
    "axk2": ("AXK2", _INDEXER),
    "dots3_note": ("dots3", _DOTS3),
    "dots3_note_text": ("dots3", _DOTS3),
}


def _refuse_variant(model_type, argument):
    """Refuses a model type whose attention holds more than the layer computes, naming what it holds."""
    if model_type in _REFUSED:
        reason = f"{_REFUSED[model_type][0]}'s MLA adds {_REFUSED[model_type][1]}, which the layer cannot"
    elif model_type in _GATED_REFUSED:
        reason = _GATED_REFUSED[model_type]
    else:
        return
    raise ValueError(
        f"`{argument}` must hold an attention the layer computes: {reason}. Received: model_type={model_type!r}"
    )


def _refuse_unknown(module, detail=""):
    raise ValueError(
        "`module` must be a transformers attention module of one of the model types "
        f"{', '.join(supported_modules())}, or of a class given to `register_porter`. "
        f"Received: {type(module).__name__}{detail}"
    )


def _check_submodules(module):
    """Refuses an instance whose `forward` was replaced, or a projection whose `forward` comes from a class
    outside torch and transformers (a subclass that overrides nothing computes what its base class does;
    the module's own class is checked along its hierarchy by `_module_porter`)."""
    for name, submodule in module.named_modules():
        if "forward" in vars(submodule):
            raise ValueError(f"`module` must use its class's forward: `{name or 'module'}.forward` was replaced.")
        owner = next(cls for cls in type(submodule).__mro__ if "forward" in vars(cls))
        if name and owner.__module__.split(".")[0] not in ("torch", "transformers"):
            raise ValueError(
                f"`module`'s projections must be torch or transformers modules (LoRA, quantized or custom layers "
                f"compute otherwise): register a porter with `register_porter`. Received: `{name}` is "
                f"{type(submodule).__name__} from {type(submodule).__module__}, with the forward of "
                f"{owner.__name__} from {owner.__module__}"
            )


def _layer_index(module):
    """The layer index a module (or its first submodule that knows it) was built with, else None."""
    for submodule in module.modules():
        for attribute in ("layer_idx", "layer_id"):
            if isinstance(getattr(submodule, attribute, None), int):
                return getattr(submodule, attribute)
    return None


def port_attention(module, config):
    """Reads a `transformers` attention module into this project's layer.

    Args:
        module: the attention module of one layer (`model.model.layers[i].self_attn`, BERT's
            `encoder.layer[i].attention`, T5's `block[i].layer[0].SelfAttention`, ...) of a model
            type in `supported_modules()`, or of a class registered with `register_porter`.
        config: the model's config (`model.config`; of a multimodal model, its text config is read),
            or a dict of it.

    Returns:
        `(layer_kwargs, weights)`: `MultiHeadAttention(**layer_kwargs)` followed by
        `import_weights(weights)` computes what the module computes, given the call arguments in
        the module docstring. `weights` holds float32 NumPy arrays in the portable layout.

    Raises:
        ValueError: for a module this converter does not know, a subclass that overrides `forward`
            or its projections, or a variant the layer cannot hold (RoPE scaling other than
            linear, llama3 and yarn, GPT-2 cross-attention).
    """
    porter = _module_porter(module)
    tensors = {name: tensor.detach().cpu().float().numpy() for name, tensor in module.state_dict().items()}
    return porter(_load_config(config), tensors, _layer_index(module))


def port_checkpoint(config, tensors, layer_index, *, prefix=None):
    """Reads one layer's attention from a checkpoint, with NumPy only (no torch, no transformers).

    Args:
        config: the model's `config.json` (a path, its directory, or the dict it holds).
        tensors: the model's weights: a `.safetensors` file (or its directory), a sharded
            checkpoint's `model.safetensors.index.json`, or a dict of names to arrays.
        layer_index: the layer (0-based).
        prefix: the attention module's path in `tensors` (e.g. "decoder.block.0.layer.0.SelfAttention"
            for T5's decoder); by default the family's path for `layer_index` (`layers.{i}.self_attn`,
            `encoder.layer.{i}.attention`, ...) under whatever the checkpoint puts before it.

    Returns:
        `(layer_kwargs, weights)`, as `port_attention` returns them for that layer's module.

    Raises:
        ValueError: for a model type this converter does not know, a layer not in `tensors`, or what
            `port_attention` refuses.
    """
    config = _load_config(config)
    model_type = config.get("model_type")
    porter = _porter(model_type)
    if porter is None:
        _refuse_variant(model_type, "config")
        raise ValueError(
            f"`config` must be of one of the model types {', '.join(supported_modules())}. "
            f"Received: model_type={model_type!r}"
        )
    _refuse_layer_type(config, layer_index)  # before looking for an attention module it does not have
    tensors = load_tensors(tensors)
    if prefix is None:
        prefix = _find_prefix(tensors, _path(model_type, layer_index))
    return porter(config, _Prefixed(tensors, prefix.rstrip(".") + "."), layer_index)


def _path(model_type, layer_index):
    """The family's path of layer `layer_index`'s attention: a format string with {i}, or a function of it
    (LongCat's two attention sublayers per decoder layer: layer i is `layers.{i // 2}.self_attn.{i % 2}`)."""
    path = _BUILTIN.get(model_type, (None, _LAYERS))[1]
    return path(layer_index) if callable(path) else path.format(i=layer_index)


def _find_prefix(tensors, path):
    """The one prefix in `tensors` that ends with `path` ("model.layers.3.self_attn" for "layers.3.self_attn")."""
    marker, found = "." + path + ".", set()
    for name in tensors:
        dotted = "." + name
        if marker in dotted:
            found.add(dotted[1 : dotted.index(marker) + len(marker) - 1])
    if len(found) != 1:
        raise ValueError(
            f"`tensors` must hold one attention module at `{path}` (pass `prefix=` to choose). "
            f"Received: {len(found)} ({', '.join(sorted(found)) or 'none'})"
        )
    return found.pop()


# ----------------------------------------------------------------------------------------------
# Swapping the layer into a transformers model
# ----------------------------------------------------------------------------------------------


def replace_attention(model, layer_class=None):
    """Replaces every attention module of a `transformers` PyTorch model by this project's layer, in place.

    Each module becomes a wrapper that holds the ported `MultiHeadAttention` (its `layer`) and takes
    the module's call: the model's own `forward` and `generate` keep working, with their masks
    (the mask the model builds is the layer's `attention_mask`) and their KV cache (the layer keeps
    the keys and values in its own `KVCache`, grown as decoding goes; the model's cache only counts
    the tokens). Greedy and sampled decoding are supported; beam search, which reorders the model's
    cache, is not. The model is switched to the "eager" attention implementation, whose masks are
    always materialized.

    Args:
        model: a `transformers` PyTorch model of the Llama kind (the families with `q_proj`, `k_proj`,
            `v_proj`, `o_proj`: Llama, Mistral, Qwen, Gemma, OLMo, Phi3, ...; the gated ones, Qwen3-Next, Qwen3.5,
            AFMoE and LFM3, whose other layers (linear attention, convolutions) stay as they are), of the BERT kind
            (BERT, RoBERTa, XLM-RoBERTa) or with multi-head latent attention (DeepSeek-V2, V3 and the MLA families
            `port_attention` reads; the layer's cache holds the latents).
        layer_class: the `MultiHeadAttention` class to build (default: the one in `PyTorch/`).

    Returns:
        The names of the replaced modules.

    Raises:
        ValueError: for a model with no attention module of these kinds, a module `port_attention` refuses,
            or Qwen2-VL's multimodal RoPE (its modules never see their (3, B, T) positions).
    """
    import torch

    if layer_class is None:
        from PyTorch import Multi_Head_Attention as layer_file

        layer_class = layer_file.MultiHeadAttention
    _set_eager(model)
    replaced = []
    for name, module in list(model.named_modules()):
        if any(name.startswith(done + ".") for done in replaced) or not type(module).__name__.endswith(_ATTENTION):
            continue
        if _transformers_model_type(type(module)) is None and not any(
            c.__name__ in _REGISTERED for c in type(module).__mro__
        ):
            continue
        family = getattr(_module_porter(module), "family", None)
        if family not in (_rotary, _gated, _bert, _latent):
            continue
        if getattr(module, "is_cross_attention", False):
            raise ValueError(f"`model` must have self-attention only: `{name}` is a cross-attention. Received: {name}")
        wrapper = _swapped(torch, module, layer_class, family is _bert, model.config)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, wrapper)
        replaced.append(name)
    if not replaced:
        raise ValueError(
            "`model` must hold attention modules of the Llama kind (q_proj, k_proj, v_proj, o_proj), of the BERT "
            f"kind or with multi-head latent attention. Received: {type(model).__name__}"
        )
    return replaced


_ATTENTION = ("Attention", "MLA")  # the endings of the attention modules' class names (LongCat's LongcatFlashMLA)


def _set_eager(model):
    for config in (getattr(model, "config", None), *(m.config for m in model.modules() if hasattr(m, "config"))):
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = "eager"


def _swapped(torch, module, layer_class, bert, model_config):
    """The wrapper module that calls the ported layer as `module` was called."""
    config = getattr(module, "config", None) or getattr(getattr(module, "self", None), "config", None)
    config = config or model_config  # a hybrid's linear-attention module holds none (its refusal reads it)
    kwargs, weights = port_attention(module, config)
    if "rope_sections" in kwargs:
        raise ValueError(
            "`model` must rotate by one row of positions: the (3, B, T) positions of Qwen2-VL's multimodal RoPE "
            f"do not reach its attention modules (they get cos and sin). Received: {type(module).__name__}"
        )
    parameter = next(module.parameters())
    layer = layer_class(**kwargs)
    layer.import_weights(weights)
    layer.to(device=parameter.device, dtype=parameter.dtype)
    wrapper = _wrapper_class(torch)(layer, _layer_index(module), getattr(module, "is_causal", not bert))
    if bert:
        wrapper.norm, wrapper.dropout = module.output.LayerNorm, module.output.dropout
    return wrapper


@functools.cache
def _wrapper_class(torch):
    class SwappedAttention(torch.nn.Module):
        """A `transformers` attention module's call, computed by `layer` (`MultiHeadAttention`).

        BERT's residual, dropout and LayerNorm after the output projection are kept as `norm` and `dropout`.
        """

        def __init__(self, layer, layer_idx, is_causal):
            super().__init__()
            self.layer, self.layer_idx, self.is_causal = layer, layer_idx, is_causal
            self.norm = self.dropout = None
            self._cache = None

        def forward(self, hidden_states, attention_mask=None, *args, past_key_values=None, **kwargs):
            positions = kwargs.get("position_ids")
            if self.layer.rope_theta is None:
                positions = None
            elif positions is None:
                positions = kwargs.get("cache_position")  # (T,)
            elif positions.shape[0] != hidden_states.shape[0]:
                positions = positions.expand(hidden_states.shape[0], -1)  # (1, T) -> (B, T)
            if past_key_values is None:
                output = self.layer(
                    hidden_states, **self._masks(attention_mask, hidden_states, 0, None), positions=positions
                )
            else:
                output = self._step(hidden_states, attention_mask, past_key_values, positions)
            if self.norm is not None:
                output = self.norm(self.dropout(output) + hidden_states)
            return output, None

        def _step(self, hidden_states, attention_mask, past_key_values, positions):
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
            output, self._cache = self.layer(hidden_states, **masks, positions=positions, cache=self._cache)
            return output

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
            keep = cache.keep.new_ones(cache.keep.shape[0], extra)
            self._cache = type(cache)(key, value, torch.cat([cache.keep, keep], 1), cache.index)

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


# ----------------------------------------------------------------------------------------------
# Call arguments
# ----------------------------------------------------------------------------------------------


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
    bias = module.compute_bias(query_length, key_length, past_seen_tokens=past_length)
    return bias.detach().cpu().float().numpy().copy()


def alibi_positions(key_mask):
    """Bloom's ALiBi key positions, (B, S) int64: `(cumsum(key_mask) - 1) * key_mask` (0 at padding).

    Pass `alibi_bias(num_heads, alibi_positions(mask))` (the layer file's function) as `attention_bias`.
    """
    key_mask = np.asarray(key_mask).astype(np.int64)
    return (np.cumsum(key_mask, axis=-1) - 1) * key_mask
