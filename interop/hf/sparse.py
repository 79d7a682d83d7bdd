"""The learned sparse-attention indexer (DSA): DeepSeek-V3.2, GLM-MoE-DSA and Mistral Large 4 ported as multi-head
latent attention with `index_topk` (the "shared" layers as MLA layers that attend the previous full layer's
`topk_indices`), and the families built on the indexer that add more, refused by name with what they add.

Legend: E hidden size, Q q_lora_rank, Ni indexer heads, Hi indexer head width, N heads, C kv_lora_rank,
Hn + Hr a NoPE layer's query and key width, Hp the zero rotary part it ports with.
"""

import re

import numpy as np

from .latent import _latent
from .tensors import _tensor

_INDEXER_SOURCES = {  # the indexer's portable weights and the `indexer` tensors they come from, transposed or not
    "index_query_kernel": ("indexer.wq_b.weight", True),  # (Ni*Hi, Q) -> (Q, Ni*Hi)
    "index_key_kernel": ("indexer.wk.weight", True),  # (Hi, E) -> (E, Hi)
    "index_key_norm": ("indexer.k_norm.weight", False),  # (Hi,)
    "index_key_norm_bias": ("indexer.k_norm.bias", False),  # (Hi,)
    "index_weights_kernel": ("indexer.weights_proj.weight", True),  # (Ni, E) -> (E, Ni)
}


def _sparse(config, tensors, index, *, interleaved_indexer=False):
    """DeepSeek Sparse Attention: DeepSeek-V3's MLA (interleaved RoPE, YaRN's mscale in the scale) and its indexer
    (`indexer.wq_b` on the normalized q latent, `indexer.wk` and its LayerNorm `k_norm`, `indexer.weights_proj`) as
    `index_topk`, `index_num_heads`, `index_head_dim`; the indexer's RoPE half-split (DeepSeek-V3.2) or interleaved
    (`interleaved_indexer`: GLM-MoE-DSA). A layer without its own indexer (GLM-MoE-DSA's `indexer_types` "shared")
    ports as MLA alone: it takes the previous full layer's selection as `topk_indices`."""
    kwargs, weights = _latent(config, tensors, index, interleaved=True)
    if "indexer.wq_b.weight" not in tensors:
        _check_shared(config, index)
        return kwargs, weights
    for name, (source, transposed) in _INDEXER_SOURCES.items():
        weights[name] = _tensor(tensors, source).T.copy() if transposed else _tensor(tensors, source)
    kwargs |= {
        "index_topk": config["index_topk"], "index_num_heads": config["index_n_heads"],
        "index_head_dim": config["index_head_dim"], "index_rope_interleaved": interleaved_indexer,
    }  # fmt: skip
    return kwargs, weights


def _mistral_large4(config, tensors, index):
    """Mistral Large 4: GLM-MoE-DSA's attention without a q latent (`q_proj`), the learned log-position scaling of
    the queries (`softmax_scaling`: `query_scaling={"type": "learned"}`) and of the indexer's, whose queries read
    a LayerNorm of the hidden states (`indexer.q_input_norm`: `index_query_input_norm`). Its NoPE layers
    (`no_rope_layers`) port with a zero rotary part (`_nope_padded`); its cross-layer KV sharing (`kv_source_layers`)
    is refused with why. Its checkpoints'
    native names (`attention.wq`, `wkv_a_with_mqa`, `ssmax_scaling.s`, ...) read as transformers' own."""
    _check_mistral_large4_layer(config, index)
    tensors = {_transformers_name(name): tensors[name] for name in tensors}
    kwargs, weights = _sparse(config, tensors, index, interleaved_indexer=True)
    if _is_nope_layer(config, index):
        kwargs, weights = _nope_padded(config, kwargs, weights)
    kwargs["latent_norm_eps"] = float(config["rms_norm_eps"])  # its `kv_a_layernorm` reads the config's epsilon
    kwargs["query_scaling"] = {"type": "learned"}
    sources = {"query_scaling_scale": "softmax_scaling.scale", "query_scaling_bias": "softmax_scaling.bias"}
    if "indexer.wq_b.weight" in tensors:
        kwargs["index_query_input_norm"] = True
        sources |= {
            "index_query_norm": "indexer.q_input_norm.weight",
            "index_query_norm_bias": "indexer.q_input_norm.bias",
        }
        sources |= {
            "index_query_scaling_scale": "indexer.softmax_scaling.scale",
            "index_query_scaling_bias": "indexer.softmax_scaling.bias",
        }
    weights |= {name: _tensor(tensors, source) for name, source in sources.items()}  # (N,), (E,) or (Ni,)
    return kwargs, weights


_NATIVE_NAMES = (  # Mistral's checkpoint names of the attention's tensors -> transformers' (its conversion mapping)
    (r"^wq\.", "q_proj."), (r"^wkv_a_with_mqa\.", "kv_a_proj_with_mqa."), (r"^wkv_b\.", "kv_b_proj."),
    (r"^kv_a_norm\.", "kv_a_layernorm."), (r"^wo\.", "o_proj."), (r"ssmax_scaling\.s$", "softmax_scaling.scale"),
    (r"ssmax_scaling\.b$", "softmax_scaling.bias"),
)  # fmt: skip


def _transformers_name(name):
    """A tensor's name in transformers' module, from Mistral's checkpoint name or already transformers'."""
    for pattern, replacement in _NATIVE_NAMES:
        name = re.sub(pattern, replacement, name)
    return name


def _check_mistral_large4_layer(config, index):
    """Refuses a layer that shares its latent KV cache with another (`kv_source_layers`)."""
    layer = 0 if index is None else index
    sources = config.get("kv_source_layers") or []
    sharing = layer < len(sources) and (sources[layer] != layer or sources.count(layer) > 1)
    if sharing:
        raise ValueError(
            "`module` must hold an attention the layer computes: Mistral Large 4's cross-layer KV sharing "
            "(`kv_source_layers`: a layer attends the latent cache of an earlier one) is not ported. "
            f"Received: layer {index}, kv_source_layers={sources}"
        )


_NOPE_ROPE_WIDTH = 2  # the zero rotary part a NoPE layer ports with (Hr: the fewest features RoPE turns, one pair)


def _is_nope_layer(config, index):
    """Whether Mistral Large 4's layer `index` has no RoPE (`no_rope_layers[index] == 0`)."""
    no_rope = config.get("no_rope_layers") or []
    layer = 0 if index is None else index
    return layer < len(no_rope) and not no_rope[layer]


def _nope_padded(config, kwargs, weights):
    """A NoPE layer as the layer's MLA with RoPE whose turned part is zero: its queries (Hn + Hr wide, all unturned)
    as the layer's nope part, a zero rotary part of `_NOPE_ROPE_WIDTH` Hp features (zero query columns, zero shared
    key columns of `key_value_a`: a turned zero stays zero and adds nothing to a score), `scale` as transformers'
    (the port's, from Hn + Hr). Its learned query scaling reads `positions`, which the layer takes with RoPE, as
    transformers' reads `position_ids`. Its indexer, which turns nothing, likewise (`_nope_indexer`)."""
    heads, hp = config["num_attention_heads"], _NOPE_ROPE_WIDTH
    width = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]  # transformers' NoPE query and key width
    weights = dict(weights)
    for name in ("query_kernel", "query_bias"):
        if name in weights:  # (..., N*(Hn + Hr)) -> (..., N*(Hn + Hr + Hp)): zeros after each head's features
            weights[name] = _pad_heads(weights[name], heads, (0, hp))
    for name in ("key_value_a_kernel", "key_value_a_bias"):
        if name in weights:  # (..., C) -> (..., C + Hp): the shared rotary key, zero
            weights[name] = _pad_heads(weights[name], 1, (0, hp))
    kwargs = kwargs | {"qk_nope_head_dim": width, "qk_rope_head_dim": hp}
    if "index_topk" in kwargs:
        kwargs, weights = _nope_indexer(kwargs, weights)
    return kwargs, weights


def _nope_indexer(kwargs, weights):
    """A NoPE layer's indexer (Hi features, none turned) as the layer's, which turns its first Hp: Hi + Hp features,
    the first Hp zero in every query. Its keys' LayerNorm over Hi + Hp features gives transformers' over Hi exactly
    when the Hp key features equal the Hi features' mean and every feature is scaled by c = sqrt((Hi + Hp) / Hi)
    (the mean is c*m, the variance the Hi features' own), the norm's scale divided by c; the query kernel times c
    restores the score scale Hi**-0.5 from the layer's (Hi + Hp)**-0.5, so the scores, not only their ranking, are
    transformers'."""
    hi, heads, hp = kwargs["index_head_dim"], kwargs["index_num_heads"], _NOPE_ROPE_WIDTH
    c = np.float32(np.sqrt((hi + hp) / hi))
    key = weights["index_key_kernel"]  # (E, Hi)
    mean = np.repeat(key.mean(axis=1, keepdims=True), hp, axis=1)  # (E, Hp): the key features' mean, Hp times
    weights = weights | {
        "index_query_kernel": _pad_heads(
            weights["index_query_kernel"] * c, heads, (hp, 0)
        ),  # (E, Ni*Hi) -> (E, Ni*(Hp + Hi))
        "index_key_kernel": np.concatenate([mean, key], axis=1) * c,  # (E, Hi) -> (E, Hp + Hi)
        "index_key_norm": np.pad(weights["index_key_norm"] / c, (hp, 0)),  # (Hi,) -> (Hp + Hi,)
        "index_key_norm_bias": np.pad(weights["index_key_norm_bias"], (hp, 0)),  # (Hi,) -> (Hp + Hi,)
    }
    return kwargs | {"index_head_dim": hi + hp}, weights


def _pad_heads(x, heads, sides):
    """(..., heads*W) -> (..., heads*(before + W + after)): zeros on each side of every head's W features."""
    split = x.reshape(*x.shape[:-1], heads, -1)  # (..., heads*W) -> (..., heads, W)
    padded = np.pad(split, [(0, 0)] * (split.ndim - 1) + [sides])  # -> (..., heads, before + W + after)
    return padded.reshape(*x.shape[:-1], -1).astype(x.dtype)  # -> (..., heads*(before + W + after))


def _check_shared(config, index):
    """A layer without indexer tensors must be a "shared" layer of `indexer_types`."""
    types = config.get("indexer_types")
    kind = None if not types or index is None else types[index]
    if kind != "shared":
        raise ValueError(
            "`tensors` must hold the layer's indexer (`indexer.wq_b.weight`, ...) unless `indexer_types` makes it "
            f"a 'shared' layer (it attends the previous full layer's top-k). Received: layer {index} of type {kind!r}"
        )


_BEYOND = "beyond DeepSeek-V3.2's indexer"
_SPARSE_REFUSED = {  # model types built on the sparse indexer whose attention adds what the layer lacks
    "glm5_next": (
        f"GLM-5-Next adds, {_BEYOND}: linear-attention layers (a recurrent state) and an indexer that scores keys "
        "pooled in groups of `index_kpool` by a learned gate (`index_kpool_compress_gate`)"
    ),
    "hy_v4": (
        f"HY-V4's attention adds, {_BEYOND}: a per-head output gate and attention sinks on MLA with its RoPE in "
        "halves, which `interop.hf` does not port yet"
    ),
    "axk2": (
        f"AXK2's attention adds, {_BEYOND}: a query and output gate projected from both the normalized and the raw "
        "q latent (`q_gate_proj` over [q_a_layernorm(q_a), q_a])"
    ),
    "dots3_note": f"dots3's attention adds, {_BEYOND}: an RMSNorm on the shared rotary key (`k_rope_only_layernorm`)",
    "qwen4_exp": (
        f"Qwen4-Exp's attention adds, {_BEYOND}: an indexer that scores blocks of keys (mean-pooled over "
        "`indexer_compress_ratio` tokens) and keeps whole blocks up to a token budget (`indexer_budget`)"
    ),
    "deepseek_v4": (
        f"DeepSeek-V4's attention adds, {_BEYOND}: compressed keys (its CSA and HCA compressors pool blocks of "
        "tokens) that the indexer scores"
    ),
    "minimax_m3_vl": (
        f"MiniMax-M3's attention adds, {_BEYOND}: an indexer that keeps blocks of `index_block_size` keys (their "
        "max-pooled scores' top `index_topk_blocks`, and the `index_local_blocks` before each query), one selection "
        "per key/value head"
    ),
}
for _name in ("glm5_next", "dots3_note", "qwen4_exp"):
    _SPARSE_REFUSED[f"{_name}_text"] = _SPARSE_REFUSED[_name]  # their text configs' model types


_LEARNED_FREQUENCIES = ("rotary_emb.alpha", "lerope.alpha")  # Mistral Large 4's LeRoPE (its checkpoints: `lerope`)


def _refuse_learned_frequencies(argument, named):
    """Mistral Large 4's LeRoPE turns pair i by inv_freq[i] * exp(alpha[i]), `alpha` learned and held by the model's
    rotary embedding, outside the attention module: the port holds for alpha = 0 (transformers' initial value) only.
    `named`: (name, array) pairs of the model's buffers or of the checkpoint's tensors."""
    for name, value in named:
        if name.endswith(_LEARNED_FREQUENCIES) and np.any(np.asarray(value) != 0):
            raise ValueError(
                f"`{argument}` must hold LeRoPE's learned frequency factors at 0 (Mistral Large 4's "
                "`rotary_emb.alpha`): the layer turns each pair by its RoPE frequency alone, not times "
                f"exp(alpha). Received: {name} with {int(np.count_nonzero(np.asarray(value)))} nonzero entries"
            )
