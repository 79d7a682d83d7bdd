"""The BART, GPT-NeoX and BERT kinds recognised by their structure: an attention module of a model type no porter is
listed for ports as BART's (`_bart`), GPT-NeoX's (`_gpt_neox`) or BERT's (`_bert`) when it holds what they read and
nothing else.

What is read, never computed (no numeric probe):

- the BART kind (Blenderbot, Marian, mBART, Pegasus, PLBart, BioGPT, XGLM, TrOCR, MusicGen, ...): the children
  `q_proj`, `k_proj`, `v_proj`, `out_proj` (`nn.Linear`, all of one width, reading the hidden states) and
  dropout only, no parameter of its own; the attributes its forward reads (`self.<name>`) and the arguments it
  takes, which must be those of BART's (`_BART_READS`, `_BART_ARGUMENTS`: no RoPE, no prompt, no norm inside);
  its softmax scale is its `scaling` attribute (folded into the queries or given to the attention function);
- the Llama kind under LFM2's names (`out_proj`, `q_layernorm`, `k_layernorm`) or ModernBERT-Decoder's (`Wo`): read as
  `interop.hf.structure` reads the Llama kind (its RMSNorms, the RoPE its modeling module applies), renamed;
- the Llama kind with DBRX's fused `Wqkv` (rows [q | k | v]) and `out_proj`, clamped by its `clip_qkv`: its heads,
  key/value heads and scale from the module's attributes, the attributes its forward reads those of DBRX's
  (`_FUSED_READS`), the RoPE its modeling module applies read as `interop.hf.structure` reads the Llama kind's;
- Phi3's fused `qkv_proj` and `o_proj` (Phi-4-multimodal's text attention): the module's forward and its modeling
  module's RoPE functions are, as text, Phi3's own (`interop.hf.structure._normalized`), read with Phi3's porter;
- the GPT-NeoX kind (Persimmon): a fused `query_key_value` (per head [q | k | v]) and `dense`, optional
  LayerNorms over each head's features (`q_layernorm`, `k_layernorm`), dropout, `is_causal`, and the RoPE in
  halves its modeling module applies (`interop.hf.structure._rope_pattern`);
- the BERT kind (CamemBERT, Data2Vec-Text, ELECTRA, ERNIE, RoCBert, ...): the module holds `self` (`query`,
  `key`, `value`) and `output` (`dense`, `LayerNorm`, dropout) and nothing else, and the forwards of the module,
  `self` and `output` are, as text, BERT's own (`interop.hf.structure._normalized`): the copies transformers
  keeps of BERT's attention, and the families of `_BERT_REWRITTEN`, whose forwards compute the same in other words
  (each proven by the generated test).

A module that holds `query`, `key` and `value` only (BERT's `self`, alone) is refused as a part of its attention.
Anything else is refused by name; `shared_tests/test_hf_families.py` is the proof of each family.
"""

import ast
import functools
import importlib
import inspect
import textwrap

from .bert import _bert
from .gpt import _gpt_neox
from .llama import _qk_layernorm, _rotary
from .norms import _input_norm, _output_norm_options, _pre_ln_forwards, _with_output_norm
from .seq2seq import _bart
from .structure import (
    _attributes,
    _check_queries,
    _is_dropout,
    _norm_options,
    _normalized,
    _refuse,
    _rope_key,
    _rope_kinds,
    _rope_pattern,
    _rotates,
)

_BART = ("q_proj", "k_proj", "v_proj", "out_proj")
_BART_READS = {  # the attributes a BART-kind forward may read: its projections, sizes, scale, cache slot, dropout
    *_BART,
    "config",
    "dropout",
    "embed_dim",
    "head_dim",
    "is_causal",
    "is_decoder",
    "layer_idx",
    "num_heads",
    "scaling",
    "training",
}
_BART_ARGUMENTS = {  # the arguments a BART-kind forward may take (MVP's `attn_prompt`: see `_bart_kind`)
    "hidden_states",
    "key_value_states",
    "encoder_hidden_states",
    "past_key_values",
    "attention_mask",
    "output_attentions",
    "cache_position",
    "position_ids",
    "kwargs",
    "attn_prompt",
}
_LINEAR = "Linear"
_BERT = {  # the children of BERT's attention, of its `self` and its `output`, and their classes
    "": {"self": None, "output": None},
    "self": {"query": _LINEAR, "key": _LINEAR, "value": _LINEAR},
    "output": {"dense": _LINEAR, "LayerNorm": "LayerNorm"},
}


def _kind_porter(module, model_type):
    """The porter of an unlisted model type's attention module of the BART or BERT kind, None if it holds neither's
    projections, or a `ValueError` naming what it holds that no porter reads."""
    children = dict(module.named_children())
    if all(name in children for name in _BART[:3]) and ("q_layernorm" in children or "Wo" in children):
        return _renamed_llama(module, model_type, children)
    if all(name in children for name in _BART):
        return _bart_kind(module, model_type, children)
    if set(_BERT[""]) <= set(children) and all(hasattr(children["self"], name) for name in _BERT["self"]):
        return _bert_kind(module, model_type, children)
    if {"query_key_value", "dense"} <= set(children):
        return _neox_kind(module, model_type, children)
    if {"Wqkv", "out_proj"} <= set(children):
        return _fused_llama(module, model_type, children)
    if {"qkv_proj", "o_proj"} <= set(children):
        return _phi3_copy(module, model_type, children)
    if {n for n, child in children.items() if not _is_dropout(child)} == set(_BERT["self"]):
        _refuse(
            module,
            model_type,
            "holds `query`, `key` and `value` and no output projection: the self-attention part of a BERT-kind "
            "attention, which a porter reads whole, with its output (`dense`, `LayerNorm`)",
        )
    return None


def _phi3_copy(module, model_type, children):
    """Phi3's attention as another family copies it (Phi-4-multimodal's): `qkv_proj` and `o_proj`, Phi3's forward and
    RoPE functions as text; read with Phi3's porter."""
    _check_children(module, model_type, children, {"qkv_proj": _LINEAR, "o_proj": _LINEAR})
    phi3 = importlib.import_module("transformers.models.phi3.modeling_phi3")
    if _normalized(type(module).forward) != _normalized(phi3.Phi3Attention.forward) or _rope_key(
        type(module).__module__
    ) != _rope_key(phi3.__name__):
        _refuse(module, model_type, "holds a fused `qkv_proj` with a forward or RoPE other than Phi3's")

    def port(config, tensors, index):
        return _rotary(config, tensors, index)

    port.family, port.__doc__ = _rotary, f"{type(module).__name__}, recognised as Phi3's attention by its text"
    return port


def _bart_kind(module, model_type, children):
    """BART's `q_proj`, `k_proj`, `v_proj`, `out_proj`: read with `_bart`, its heads and scale from the module."""
    norm, norm_options = _output_norm_options(module, functools.partial(_refuse, module, model_type), "out_proj")
    _check_children(module, model_type, children, dict.fromkeys(_BART, _LINEAR) | ({norm: None} if norm else {}))
    query, key, value, output = (children[name] for name in _BART)
    widths = {query.in_features, key.in_features, value.in_features, output.out_features}
    if len(widths) > 1 or len({query.out_features, key.out_features, value.out_features}) > 1:
        _refuse(
            module,
            model_type,
            f"has projections of other widths than one hidden size (`q_proj` {query.in_features} -> "
            f"{query.out_features}, `k_proj` {key.in_features} -> {key.out_features}, `v_proj` "
            f"{value.in_features} -> {value.out_features})",
        )
    reads, arguments = _forward_reads(type(module))
    unknown = sorted(reads - _BART_READS - {norm}) + sorted(arguments - _BART_ARGUMENTS)
    if unknown:
        _refuse(module, model_type, "reads " + ", ".join(f"`{n}`" for n in unknown) + " in its forward")
    num_heads = int(getattr(module, "num_heads", 0) or query.out_features // module.head_dim)
    sizes = {"d_model": query.in_features, "num_attention_heads": num_heads}
    scale = float(module.scaling)

    def port(config, tensors, index):
        if "attn_prompt" in arguments and config.get("use_prompt"):
            _refuse(module, model_type, "prepends learned prompt keys and values (`use_prompt`)")
        kwargs, weights = _bart(sizes, tensors, index)
        if norm is not None:  # Kosmos-2's `inner_attn_ln` (`interop.hf.norms`)
            kwargs, weights = _with_output_norm(kwargs, weights, tensors, norm, norm_options)
        return kwargs | {"scale": scale}, weights

    port.family, port.__doc__ = _bart, f"{type(module).__name__}, recognised as the BART kind by its structure"
    return port


_BERT_REWRITTEN = {  # BERT-kind families whose forwards differ from BERT's as text but compute what they compute
    "rembert": "RemBERT's eager forwards (scores / sqrt(H), the mask added, softmax, its output BERT's SelfOutput)",
}


def _bert_kind(module, model_type, children):
    """BERT's `BertAttention`: `self.query/key/value`, `output.dense` and its LayerNorm, with BERT's forwards; or a
    pre-LN copy: a LayerNorm of the input in the module, `output.dense` and the residual, with the forwards of
    RoBERTa-PreLayerNorm (around BERT's `self`) or Megatron-BERT (`interop.hf.norms`)."""
    pre = _input_norm(module)
    _check_children(module, model_type, children, _BERT[""] | ({pre: "LayerNorm"} if pre else {}))
    for name in ("self", "output"):
        child, expected = children[name], _BERT[name] if not pre or name == "self" else {"dense": _LINEAR}
        _check_children(child, model_type, dict(child.named_children()), expected, f"`{name}` ")
    if pre and not _pre_ln_forwards(module, pre):
        _refuse(module, model_type, "computes a pre-LN attention with forwards of its own, not a known pre-LN copy's")
    for part, reference in zip((module, children["self"], children["output"]), _bert_forwards(), strict=True):
        rewritten = pre or model_type in _BERT_REWRITTEN  # forwards of their own, checked above or by the test
        if not rewritten and _normalized(type(part).forward) != _normalized(reference.forward):
            _refuse(
                module,
                model_type,
                f"computes {type(part).__name__} with a forward of its own, not {reference.__name__}'s",
            )

    def port(config, tensors, index):
        return _bert(config, tensors, index)

    port.family, port.__doc__ = _bert, f"{type(module).__name__}, recognised as the BERT kind by its structure"
    return port


_RENAMED = {  # LFM2's and ModernBERT-Decoder's names: the Llama kind's
    "out_proj": "o_proj",
    "Wo": "o_proj",
    "q_layernorm": "q_norm",
    "k_layernorm": "k_norm",
}


def _renamed_llama(module, model_type, children):
    """The Llama kind under LFM2's names (`out_proj`, `q_layernorm`, `k_layernorm`) or ModernBERT-Decoder's (`Wo`):
    its RMSNorms, RoPE, scale and sizes read as `interop.hf.structure` reads the Llama kind's, its tensors renamed
    for `_rotary`."""
    output = "Wo" if "Wo" in children else "out_proj"
    classes = dict.fromkeys((*_BART[:3], output), _LINEAR)
    if "q_layernorm" in children:
        classes |= {"q_layernorm": None, "k_layernorm": None}
    _check_children(module, model_type, children, classes)
    if getattr(module, "is_causal", None) is not True:
        _refuse(module, model_type, "does not set `is_causal = True`: not known as a decoder's self-attention")
    _check_queries(module, model_type)
    interleaved = _rope_kinds().get(_rope_key(type(module).__module__), _rope_pattern(type(module).__module__))
    if interleaved is None or _rotates(module, model_type) is not True:
        _refuse(module, model_type, "applies a RoPE (`apply_rotary_pos_emb`) that is not one a listed family has")
    norms = {_RENAMED[name]: children[name] for name in ("q_layernorm", "k_layernorm") if name in children}
    options = {"interleaved": interleaved, **_norm_options(module, model_type, norms)}
    attributes = _attributes(module)

    def port(config, tensors, index):
        renamed = {}
        for name in tensors:
            head, _, tail = name.partition(".")
            renamed[f"{_RENAMED.get(head, head)}.{tail}"] = tensors[name]
        kwargs, weights = _rotary({**config, **attributes["config"]}, renamed, index, **options)
        return kwargs | {"scale": attributes["scale"]}, weights

    port.family, port.__doc__ = _rotary, f"{type(module).__name__}, recognised as the Llama kind by its structure"
    return port


_FUSED_READS = {  # the attributes a forward of the Llama kind with a fused `Wqkv` may read (DBRX's)
    "Wqkv",
    "out_proj",
    "clip_qkv",
    "config",
    "head_dim",
    "hidden_size",
    "layer_idx",
    "num_key_value_heads",
    "scaling",
    "training",
    "attention_dropout",
}


def _fused_llama(module, model_type, children):
    """DBRX's fused `Wqkv` (rows [q | k | v]: `hidden_size`, then `num_key_value_heads * head_dim` twice) and
    `out_proj`, q, k and v clamped to [-clip_qkv, clip_qkv] (the fused projection's clamp, element by element),
    read with `_rotary` as Phi3's fused `qkv_proj`."""
    _check_children(module, model_type, children, {"Wqkv": _LINEAR, "out_proj": _LINEAR})
    if getattr(module, "is_causal", None) is not True:
        _refuse(module, model_type, "does not set `is_causal = True`: not known as a decoder's self-attention")
    reads, _ = _forward_reads(type(module))
    if reads - _FUSED_READS:
        _refuse(
            module, model_type, "reads " + ", ".join(f"`{n}`" for n in sorted(reads - _FUSED_READS)) + " in its forward"
        )
    interleaved = _rope_kinds().get(_rope_key(type(module).__module__), _rope_pattern(type(module).__module__))
    if interleaved is None or _rotates(module, model_type) is not True:
        _refuse(module, model_type, "applies a RoPE (`apply_rotary_pos_emb`) that is not one a listed family has")
    head_dim, kv_heads = int(module.head_dim), int(module.num_key_value_heads)
    sizes = {"hidden_size": children["Wqkv"].in_features, "head_dim": head_dim, "num_key_value_heads": kv_heads}
    sizes["num_attention_heads"] = int(module.hidden_size) // head_dim
    if children["Wqkv"].out_features != (sizes["num_attention_heads"] + 2 * kv_heads) * head_dim:
        _refuse(module, model_type, f"has a fused `Wqkv` of {children['Wqkv'].out_features} rows, not [q / k / v]")
    clip = {"clip_qkv": module.clip_qkv} if getattr(module, "clip_qkv", None) is not None else {}
    scale = float(module.scaling)

    def port(config, tensors, index):
        renamed = {f"{_FUSED_NAMES.get(n.partition('.')[0])}.{n.partition('.')[2]}": tensors[n] for n in tensors}
        kwargs, weights = _rotary({**config, **sizes, **clip}, renamed, index, interleaved=interleaved)
        return kwargs | {"scale": scale}, weights

    port.family, port.__doc__ = _rotary, f"{type(module).__name__}, recognised as the Llama kind with a fused `Wqkv`"
    return port


_FUSED_NAMES = {"Wqkv": "qkv_proj", "out_proj": "o_proj"}  # DBRX's names: Phi3's fused projection's


def _neox_kind(module, model_type, children):
    """GPT-NeoX's fused `query_key_value` (per head [q | k | v]) and `dense`, read with `_gpt_neox`, with Persimmon's
    LayerNorms over each head's features (`q_layernorm`, `k_layernorm`); the RoPE in halves its modeling module
    applies (`interop.hf.structure._rope_pattern`)."""
    classes = {"query_key_value": _LINEAR, "dense": _LINEAR}
    if "q_layernorm" in children:
        classes |= {"q_layernorm": "LayerNorm", "k_layernorm": "LayerNorm"}
    _check_children(module, model_type, children, classes)
    if getattr(module, "is_causal", None) is not True:
        _refuse(module, model_type, "does not set `is_causal = True`: not known as a decoder's self-attention")
    if _rope_pattern(type(module).__module__) is not False:
        _refuse(module, model_type, "applies a RoPE (`apply_rotary_pos_emb`) other than the rotation in halves")

    def port(config, tensors, index):
        kwargs, weights = _gpt_neox(config, tensors, index)
        if "q_layernorm" in classes:
            heads = kwargs["num_heads"]
            kwargs |= _qk_layernorm(config, tensors, weights, heads, heads)
        return kwargs, weights

    port.family, port.__doc__ = _gpt_neox, f"{type(module).__name__}, recognised as the GPT-NeoX kind by its structure"
    return port


def _check_children(module, model_type, children, classes, where=""):
    """The children named in `classes` of the classes it gives (None: any), dropout besides, and no parameter or
    buffer of the module's own."""
    wrong = [n for n, name in classes.items() if name is not None and type(children.get(n)).__name__ != name]
    if wrong:
        _refuse(module, model_type, f"has {where}" + ", ".join(f"`{n}`" for n in wrong) + " of another class")
    extra = [n for n, child in children.items() if n not in classes and not _is_dropout(child)]
    extra += [n for n, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))]
    if extra:
        _refuse(module, model_type, f"adds {where}" + ", ".join(f"`{n}`" for n in extra) + ", which no porter reads")


def _forward_reads(cls):
    """The attributes (`self.<name>`) a class's forward reads, and the arguments it takes."""
    forward = cls.forward
    tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    reads = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "self"}
    return reads, set(list(inspect.signature(forward).parameters)[1:])


@functools.cache
def _bert_forwards():
    """BERT's `BertAttention`, `BertSelfAttention` and `BertSelfOutput`: the forwards a BERT-kind module copies."""
    bert = importlib.import_module("transformers.models.bert.modeling_bert")
    return bert.BertAttention, bert.BertSelfAttention, bert.BertSelfOutput
