"""Families recognised by their structure: an attention module of a model type no porter is listed for ports as
the Llama kind (`_rotary`), or gated (`_gated`), when it holds what they read and nothing else.

What is read, never computed (no numeric probe): the module's children and parameters (`q_proj`, `k_proj`,
`v_proj`, `o_proj` as `nn.Linear`, value heads as wide as the key heads or narrower (widened with zeros, the
values times the module's `v_scale` where its forward multiplies them by it); optional `q_norm` and `k_norm`,
`sinks`, a gate `g_proj` or `gate_proj` (a sigmoid or a softplus of it);
dropout and a rotary embedding held by the module), its attributes (`is_causal`, `head_dim`, `scaling`,
`sliding_window`), the class of its norms (an RMSNorm of weight, of 1 + weight, or a LayerNorm, and their
eps), and the source of the RoPE its modeling module applies (`apply_rotary_pos_emb` and `rotate_half`, the
same text as a listed family's, which says whether the features pair in halves or interleaved). Anything else
the module holds is refused by name. A family that has this structure but computes something else is refused
by name in `_REFUSED` with what it adds, and an attention class that computes something else than softmax
attention over projected queries, keys and values (linear attention, block-sparse attention, a mixture of attention
experts, ...) in `_ADDS`; `shared_tests/test_hf_families.py` is the proof of each.
"""

import ast
import functools
import hashlib
import importlib
import inspect
import re
import sys
import textwrap

import numpy as np

from .config import _layer_type, _position_scaling, _rope_parameters
from .gated import _gated
from .llama import _rotary
from .norms import (
    _norm_kind,
    _norm_parameters,
    _output_norm_options,
    _renamed_qk_norms,
    _renamed_tensors,
    _with_output_norm,
)
from .refused import _ADDS, _REFUSED
from .tensors import _tensor

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_ALLOWED = {"q_norm", "k_norm", "rotary_emb", "attention_dropout", "dropout", "attn_dropout", "resid_dropout"}
_GATES = ("g_proj", "gate_proj")
_GATE_ACTIVATIONS = ("sigmoid", "softplus")  # the layer's `gate_activation`s
_ROPE_EXTRA = {"ernie4_5": True}  # GLM's pairing over the whole head, in float32 (the generated test proves it)


def _normalized(function):
    """A function's source without comments, blank lines and its docstring: what it computes, as text."""
    if function is None:
        return None
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    source = re.sub(r'"""(.|\n)*?"""', "", source)
    lines = [re.sub(r"#.*", "", line).rstrip() for line in source.splitlines()]
    return hashlib.sha256("\n".join(line for line in lines if line.strip()).encode()).hexdigest()


def _rope_key(module_name):
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    return tuple(_normalized(getattr(module, name, None)) for name in ("apply_rotary_pos_emb", "rotate_half"))


@functools.cache
def _rope_kinds():
    """{the RoPE functions' key: interleaved} of the listed Llama-kind families (their modeling modules'
    `apply_rotary_pos_emb` and `rotate_half`, and their porter's `interleaved`), and `_ROPE_EXTRA`'s."""
    from .registry import _BUILTIN

    references = dict(_ROPE_EXTRA)
    for model_type, (porter, _) in _BUILTIN.items():
        options = porter.options
        if porter.family in (_rotary, _gated) and "mrope" not in options and model_type not in references:
            references[model_type] = options.get("interleaved", False)
    kinds = {}
    for model_type, interleaved in references.items():
        try:
            key = _rope_key(f"transformers.models.{model_type}.modeling_{model_type}")
        except ImportError:  # a model type whose package is named otherwise (xlm-roberta)
            continue
        if key[0] is not None:
            kinds.setdefault(key, interleaved)
    return kinds


_UNSQUEEZE = (  # the first statements of transformers' `apply_rotary_pos_emb`
    "cos = cos.unsqueeze(unsqueeze_dim)",
    "sin = sin.unsqueeze(unsqueeze_dim)",
)
_PAIRS = {  # rotate_half's statements: whether it pairs features interleaved (2i, 2i + 1) or in halves (i, i + H/2)
    "x1 = x[..., 0::2] | x2 = x[..., 1::2] | return torch.stack((-x2, x1), dim=-1).flatten(-2)": True,
    "x1 = x[..., :x.shape[-1] // 2] | x2 = x[..., x.shape[-1] // 2:] | return torch.cat((-x2, x1), dim=-1)": False,
}
_REPEAT = (  # the interleaved RoPE's cos and sin, each frequency repeated for its pair
    "cos = cos[..., :cos.shape[-1] // 2].repeat_interleave(2, dim=-1)",
    "sin = sin[..., :sin.shape[-1] // 2].repeat_interleave(2, dim=-1)",
)
_RETURN = "return (q_embed, k_embed)"
_ROTATIONS = (  # the rotation over the whole head, or over its first `rotary_dim` features (partial RoPE), returned
    ("q_embed = q * cos + rotate_half(q) * sin", "k_embed = k * cos + rotate_half(k) * sin", _RETURN),
    (
        "rotary_dim = cos.shape[-1]",
        "q_rot, q_pass = (q[..., :rotary_dim], q[..., rotary_dim:])",
        "k_rot, k_pass = (k[..., :rotary_dim], k[..., rotary_dim:])",
        "q_embed = q_rot * cos + rotate_half(q_rot) * sin",
        "k_embed = k_rot * cos + rotate_half(k_rot) * sin",
        "q_embed = torch.cat([q_embed, q_pass], dim=-1)",
        "k_embed = torch.cat([k_embed, k_pass], dim=-1)",
        _RETURN,
    ),
    (  # Nemotron's partial RoPE: the same, its names shorter and the halves joined in the return
        "rot_dim = cos.shape[-1]",
        "q, q_pass = (q[..., :rot_dim], q[..., rot_dim:])",
        "k, k_pass = (k[..., :rot_dim], k[..., rot_dim:])",
        "q_embed = q * cos + rotate_half(q) * sin",
        "k_embed = k * cos + rotate_half(k) * sin",
        "return (torch.cat((q_embed, q_pass), dim=-1), torch.cat((k_embed, k_pass), dim=-1))",
    ),
)


def _rope_pattern(module_name, repeated=False):
    """Where the RoPE functions' text differs from every listed family's: interleaved or in halves, read from
    `rotate_half` (or GLM-4V's `rotate_half_llm`, the one `apply_rotary_pos_emb` calls) and `apply_rotary_pos_emb`
    when they hold nothing but the rotation (over the whole head, or its first features with partial RoPE; cos
    and sin repeated pairwise for the interleaved one, by it or, `repeated`, by the rotary embedding; casts to
    float32 and back aside); None otherwise."""
    module = sys.modules[module_name]
    apply = getattr(module, "apply_rotary_pos_emb", None)
    if apply is None:
        return None
    statements = [
        re.sub(r"\.float\(\)|\.to\(\w+\)", "", s)
        for s in _statements(apply)
        if "dtype" not in s or s.startswith("return")
    ]
    helper = "rotate_half_llm" if any("rotate_half_llm(" in s for s in statements) else "rotate_half"
    rotate = getattr(module, helper, None)
    statements = [s.replace("rotate_half_llm(", "rotate_half(") for s in statements]
    interleaved = None if rotate is None else _PAIRS.get(" | ".join(_statements(rotate)))
    if interleaved is None or tuple(statements[:2]) != _UNSQUEEZE or (repeated and not interleaved):
        return None
    rest = statements[2:]
    if interleaved and not repeated:
        if tuple(rest[:2]) != _REPEAT:
            return None
        rest = rest[2:]
    if tuple(rest) not in _ROTATIONS:
        return None
    return interleaved


def _statements(function):
    """A function's body, one normalized line per statement (its docstring left out)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    body = (
        tree.body[1:]
        if isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant)
        else tree.body
    )
    return [ast.unparse(node).replace("\n", " ") for node in body]


def _refuse(module, model_type, what):
    raise ValueError(
        f"`module` must hold an attention a porter reads: {type(module).__name__} (model type {model_type!r}) "
        f"{what}. Register a porter for it with `register_porter`. Received: {type(module).__name__}"
    )


def _structural_porter(module, model_type):
    """The porter of an attention module of an unlisted model type, recognised by its structure, or a
    `ValueError` naming what it holds that no porter reads."""
    if type(module).__name__ in _ADDS:
        raise ValueError(
            f"`module` must hold an attention the layer computes: {_ADDS[type(module).__name__]}. "
            f"Received: {type(module).__name__}"
        )
    if model_type in _REFUSED:
        raise ValueError(
            f"`module` must hold an attention the layer computes: {_REFUSED[model_type]}, which the layer cannot. "
            f"Received: model_type={model_type!r}"
        )
    children, after_rope = _renamed_qk_norms(module, dict(module.named_children()))  # HunYuan's `query_layernorm`
    missing = [name for name in _PROJECTIONS if name not in children]
    if missing:
        return None
    if any(type(children[name]).__name__ != "Linear" for name in _PROJECTIONS):
        _refuse(module, model_type, "has projections other than nn.Linear")
    value_dim = _value_head_dim(module, model_type, children)
    if getattr(module, "is_causal", None) is not True:
        _refuse(module, model_type, "is not causal (`is_causal`): not a decoder's self-attention")
    scaled = _check_queries(module, model_type)
    gate = next((name for name in _GATES if name in children), None)
    norm, norm_options = _output_norm_options(module, functools.partial(_refuse, module, model_type), "o_proj")
    extra = [n for n in children if n not in (*_PROJECTIONS, *_ALLOWED, gate, norm) and not _is_dropout(children[n])]
    extra += [n for n, _ in module.named_parameters(recurse=False) if n != "sinks"]
    extra += [n for n, _ in module.named_buffers(recurse=False)]
    if extra:
        _refuse(module, model_type, "adds " + ", ".join(f"`{n}`" for n in extra) + ", which no porter reads")
    rotates = _rotates(module, model_type)
    mrope = _multimodal_rope(type(module).__module__)
    if mrope and mrope[1]:  # cos and sin repeated pairwise by the rotary embedding: interleaved pairs only
        interleaved = _rope_pattern(type(module).__module__, repeated=True)
    else:
        interleaved = _rope_kinds().get(_rope_key(type(module).__module__), _rope_pattern(type(module).__module__))
    if interleaved is None and rotates:
        _refuse(module, model_type, "applies a RoPE (`apply_rotary_pos_emb`) that is not one a listed family has")
    options = {"interleaved": bool(interleaved), **_norm_options(module, model_type, children)}
    if gate is not None:
        options["activation"] = _check_gate(module, model_type, gate)
    if not rotates:
        options["rope"] = "never"  # no RoPE: the modeling module's RoPE functions, if any, are not read
    if rotates and mrope == ():
        _refuse(
            module,
            model_type,
            "is turned by a multimodal RoPE other than Qwen2-VL's sections (its rotary embedding reads "
            "`mrope_section`, its `forward` and `recomposition_frequencies` not Qwen2-VL's)",
        )
    if rotates and mrope:
        options["mrope"], options["mrope_interleaved"] = mrope[0], mrope[2]
    attributes = _attributes(module)

    def port(config, tensors, index):
        config, tensors = {**config, **attributes["config"]}, _renamed_tensors(tensors)
        if config.get("hidden_size") != children["q_proj"].in_features:
            _refuse(
                module,
                model_type,
                f"reads {children['q_proj'].in_features} input features, not the model's "
                f"hidden size {config.get('hidden_size')} (another stream concatenated to the hidden states)",
            )
        layer_options = dict(options)
        if value_dim is not None:
            tensors = _widened_values(tensors, attributes["config"], *value_dim)
        if rotates == "layer_rope_theta":
            config, layer_options["rope"] = _layer_theta(module, model_type, config, index)
        if gate is None:
            kwargs, weights = _rotary(config, tensors, index, **layer_options)
        else:
            kwargs, weights = _gated(config, tensors, index, gate=gate, **layer_options)
        kwargs["scale"] = attributes["scale"]
        if norm is not None:  # BitNet's `attn_sub_norm` (`interop.hf.norms`)
            kwargs, weights = _with_output_norm(kwargs, weights, tensors, norm, norm_options)
        if after_rope and "qk_norm" in kwargs and "rope_theta" in kwargs:  # HunYuan's QK-norm of the turned heads
            kwargs["qk_norm_after_rope"] = True
        if scaled and _position_scaling(_rope_parameters(config, None)) is not None:
            kwargs["query_scaling"] = _position_scaling(_rope_parameters(config, None))
        return kwargs, weights

    port.family = _rotary if gate is None else _gated
    port.__doc__ = f"{type(module).__name__}, recognised as the Llama kind by its structure"
    return port


def _value_head_dim(module, model_type, children):
    """None where the value heads are as wide as the key heads and the forward does not scale them; else (Hv, the
    values' factor, the module's `v_scale` where the forward multiplies them by it) of value heads as wide as the
    key heads or narrower (MiMo-V2-Flash: `v_head_dim` 128 of 192, its values times `v_scale`), which port widened
    with zeros (`_widened_values`); wider value heads are refused."""
    head_dim = int(getattr(module, "head_dim", 0))
    v_out, k_out, o_in = (
        children["v_proj"].out_features,
        children["k_proj"].out_features,
        children["o_proj"].in_features,
    )
    source = inspect.getsource(type(module).forward)
    scale = float(getattr(module, "v_scale", 1.0)) if re.search(r"\*\s*self\.v_scale\b", source) else 1.0
    if v_out == k_out and scale == 1.0:
        return None
    kv_heads, heads = (k_out // head_dim, children["q_proj"].out_features // head_dim) if head_dim else (0, 0)
    value_dim = v_out // kv_heads if kv_heads else 0
    if not value_dim or value_dim > head_dim or v_out != kv_heads * value_dim or o_in != heads * value_dim:
        _refuse(
            module,
            model_type,
            "has value heads wider than its key heads, or of no whole width (`v_proj` "
            f"{v_out}, `k_proj` {k_out}, `o_proj` {o_in} features, `head_dim` {head_dim}): only narrower value "
            "heads port (widened with zeros)",
        )
    return value_dim, scale


def _widened_values(tensors, config, value_dim, scale):
    """The value projection (K*Hv, E) and the output projection (E, N*Hv) of value heads narrower than the key
    heads, widened to H features a head: each value head's Hv features times `scale` (the module's `v_scale`),
    then H - Hv features of zeros, which attend to zeros and meet zero rows of the output kernel, so the output
    is exactly the narrow heads'."""
    head_dim, heads, kv_heads = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    tensors = dict(tensors)
    for name, count in (("v_proj.weight", kv_heads), ("v_proj.bias", kv_heads)):
        if name in tensors:
            value = _tensor(tensors, name) * np.float32(scale)  # (K*Hv, E) or (K*Hv,)
            value = value.reshape(count, value_dim, *value.shape[1:])  # (K, Hv, ...)
            padding = [(0, 0), (0, head_dim - value_dim)] + [(0, 0)] * (value.ndim - 2)
            tensors[name] = np.pad(value, padding).reshape(count * head_dim, *value.shape[2:])  # (K*H, ...)
    output = _tensor(tensors, "o_proj.weight")  # (E, N*Hv)
    output = output.reshape(output.shape[0], heads, value_dim)  # (E, N, Hv)
    tensors["o_proj.weight"] = np.pad(output, [(0, 0), (0, 0), (0, head_dim - value_dim)]).reshape(-1, heads * head_dim)
    return tensors


def _multimodal_rope(module_name):
    """The modeling module's multimodal RoPE (a rotary embedding class that reads `mrope_section`) when it is
    Qwen2-VL's kind or Qwen3-VL's (its `forward` and `recomposition_frequencies` the same text as `_SECTIONS`'):
    (its default sections, whether it repeats cos and sin pairwise (GLM-4V's interleaved pairs) rather than over
    the two halves, whether it deals the pairs to the rows in turn (Qwen3-VL's) rather than in runs); `()` for
    another kind, None without one: read from the classes' source."""
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    rotary = [
        value
        for name, value in vars(module).items()
        if name.endswith("RotaryEmbedding") and inspect.isclass(value) and "mrope_section" in inspect.getsource(value)
    ]
    if not rotary:
        return None
    texts = {(" | ".join(_statements(c.forward)), " | ".join(_statements(c.recomposition_frequencies))) for c in rotary}
    default = _default_sections(inspect.getsource(rotary[0]))
    kinds = {_SECTIONS[1].get(r) for _, r in texts}
    if any(f != _SECTIONS[0] for f, _ in texts) or len(kinds) != 1 or None in kinds or default is None:
        return ()
    return default, *kinds.pop()


def _default_sections(source):
    """The default sections a rotary embedding's `source` reads (`.get("mrope_section", [16, 24, 24])`), or None."""
    default = re.search(r'get\("mrope_section", \[([\d, ]+)\]\)', source)
    return None if default is None else tuple(int(n) for n in default.group(1).split(","))


_SECTIONS = (  # Qwen2-VL's multimodal RoPE: its rotary embedding's `forward`; `recomposition_frequencies`: repeated
    "position_ids = position_ids.expand(3, -1, -1) | "
    "freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float) | "
    "cos = freqs.cos() * self.attention_scaling | sin = freqs.sin() * self.attention_scaling | "
    "sin = self.recomposition_frequencies(sin) | cos = self.recomposition_frequencies(cos) | "
    "return (cos.to(dtype=x.dtype), sin.to(dtype=x.dtype))",
    {  # (cos and sin repeated pairwise, not over the two halves; the pairs dealt to the rows in turn)
        **{  # sections of pairs in runs, row i % 3 for section i
            "freq = torch.cat([m[i % 3] for i, m in enumerate(freq.split(self.mrope_section, dim=-1))], dim=-1) | "
            + ending: (repeated, False)
            for ending, repeated in (
                ("return torch.cat((freq, freq), dim=-1)", False),
                ("return torch.cat([freq, freq], dim=-1)", False),
                ("return freq.repeat_interleave(2, dim=-1)", True),
            )
        },
        "freqs_thw = freq[0] | for dim, offset in enumerate((1, 2), start=1):     length = self.mrope_section[dim] * "
        "3     idx = slice(offset, length, 3)     freqs_thw[..., idx] = freq[dim, ..., idx] | "
        "return torch.cat((freqs_thw, freqs_thw), dim=-1)": (False, True),  # Qwen3-VL's, dealt in turn
    },
)


def _rotates(module, model_type):
    """Whether the module's forward applies RoPE: unconditionally, or under a condition on its own attributes
    (`if self.sliding_window is None or self.is_sliding:`, EXAONE 4's NoPE full layers), read from its source
    and evaluated on the module; a call under another condition is refused."""
    source = textwrap.dedent(inspect.getsource(type(module).forward))
    tree = ast.parse(source)
    if not any(
        getattr(n.func, "id", None) == "apply_rotary_pos_emb" for n in ast.walk(tree) if isinstance(n, ast.Call)
    ):
        return False  # no RoPE at all (Jamba)
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        calls = [n for b in node.body for n in ast.walk(b) if isinstance(n, ast.Call)]
        if not any(getattr(c.func, "id", None) == "apply_rotary_pos_emb" for c in calls):
            continue
        if ast.unparse(node.test) == "position_embeddings is not None":  # the model passes None to NoPE layers
            return "layer_rope_theta"  # Granite-SWA's per-layer base, 0 for NoPE: read by the porter, or refused
        names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
        if names != {"self"} or any(isinstance(n, ast.Call) for n in ast.walk(node.test)):
            _refuse(module, model_type, f"applies RoPE only where `{ast.unparse(node.test)}`, which no porter reads")
        return bool(eval(compile(ast.Expression(node.test), "<forward>", "eval"), {}, {"self": module}))
    return True


def _check_queries(module, model_type):
    """Whether the forward scales its queries by position with `get_llama_4_attn_scale(position_ids, ...)`
    (Ministral 3: read from `rope_parameters` as `query_scaling`, exactly 1 below its floor, so only the source
    tells); a forward that multiplies its queries by anything else after projecting them is refused."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(type(module).forward)))
    scaled = False
    for node in ast.walk(tree):
        targets = [getattr(t, "id", None) for t in getattr(node, "targets", [])]
        if (
            isinstance(node, ast.Assign)
            and targets == ["query_states"]
            and isinstance(node.value, ast.BinOp)
            and isinstance(node.value.op, ast.Mult)
        ):
            other = node.value.right if getattr(node.value.left, "id", None) == "query_states" else node.value.left
            if not _scales_by_position(other):
                _refuse(module, model_type, f"scales its queries by `{ast.unparse(other)}`, which no porter reads")
            scaled = True
    return scaled


def _scales_by_position(node):
    """`get_llama_4_attn_scale(position_ids, <llama_4_scaling_beta>, <original_max_position_embeddings>)`, maybe
    cast with `.to(...)`, reading those two keys of the config's `rope_parameters`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to":
        node = node.func.value
    if not isinstance(node, ast.Call) or getattr(node.func, "id", None) != "get_llama_4_attn_scale":
        return False
    arguments = [ast.unparse(a) for a in node.args]
    return (
        len(arguments) == 3
        and arguments[0] == "position_ids"
        and "llama_4_scaling_beta" in arguments[1]
        and ("original_max_position_embeddings" in arguments[2])
    )


def _check_gate(module, model_type, gate):
    """The gate's function of its projection, read from the forward's source: "sigmoid", or "softplus" (Laguna's
    `F.softplus(self.g_proj(...))`), the layer's `gate_activation`; any other is refused."""
    source = inspect.getsource(type(module).forward)
    applied = re.findall(r"([\w.]+)\(\s*self\." + gate + r"\(", source)
    kinds = {next((kind for kind in _GATE_ACTIVATIONS if name.endswith(kind)), name) for name in applied}
    if len(kinds) > 1 or not kinds <= set(_GATE_ACTIVATIONS):
        _refuse(
            module,
            model_type,
            f"gates its heads with {', '.join(applied)} of `{gate}`, where the layer's gate is a sigmoid or a softplus",
        )
    return kinds.pop() if kinds else "sigmoid"


_POSITIONS_BY_THETA = {"olmo_hybrid": "full_attention"}  # the layer type its model passes RoPE to, with a rope_theta


def _layer_theta(module, model_type, config, index):
    """Granite-SWA's `layer_rope_theta`: layer `index`'s RoPE base, 0 for a NoPE layer (its model passes no
    `position_embeddings` there); Granite-MoE-Hybrid's `position_embedding_type`: "rope" in every layer, else
    none; OLMo-Hybrid's `rope_parameters`: RoPE in its `full_attention` layers where they hold a `rope_theta`, none
    where it is None (its released checkpoints); a config with none of these is refused."""
    thetas = config.get("layer_rope_theta")
    if thetas is None and "position_embedding_type" in config:  # Granite-MoE-Hybrid: RoPE in every layer, or none
        return config, "all" if config["position_embedding_type"] == "rope" else "never"
    if thetas is None and model_type in _POSITIONS_BY_THETA:  # its model builds a rotary embedding with a theta only
        theta = _rope_parameters(config, None).get("rope_theta")
        rotates = theta is not None and _layer_type(config, index) == _POSITIONS_BY_THETA[model_type]
        return config, "all" if rotates else "never"
    if not isinstance(thetas, list | tuple) or index is None:
        _refuse(
            module,
            model_type,
            "applies RoPE only where its model passes `position_embeddings`, which its "
            "config does not say per layer (`layer_rope_theta`)",
        )
    theta = thetas[index]
    if not theta:
        return config, "never"
    parameters = dict(config.get("rope_parameters") or {"rope_theta": config.get("rope_theta")})
    return {**config, "rope_parameters": {**parameters, "rope_theta": float(theta)}}, "all"


def _is_dropout(child):
    return type(child).__name__ == "Dropout" or type(child).__name__ == "Identity"


def _norm_options(module, model_type, children):
    """The QK-norm's kind: an RMSNorm of `weight` or of `1 + weight`, or a LayerNorm; its eps."""
    norm = children.get("q_norm")
    if norm is None:
        return {}
    if type(norm).__name__ == "Identity":
        return {}
    refuse = functools.partial(_refuse, module, model_type)
    unread = f"normalizes its queries with {type(norm).__name__}, which no porter reads"
    names, eps = _norm_parameters(norm, refuse, unread)
    kind, offset = _norm_kind(norm, names, refuse, unread)
    return {"norm": "layer", "norm_eps": eps} if kind == "layer" else {"norm_eps": eps, "norm_offset": offset}


def _attributes(module):
    """What the module's attributes say: its head dimension and heads (from its projections), its softmax scale
    and sliding window."""
    head_dim = int(getattr(module, "head_dim", 0)) or None
    q_out, k_out = module.q_proj.out_features, module.k_proj.out_features
    config = {}
    if head_dim:
        config = {"head_dim": head_dim, "num_attention_heads": q_out // head_dim}
        config["num_key_value_heads"] = k_out // head_dim
    return {"config": config, "scale": float(getattr(module, "scaling", (head_dim or 1) ** -0.5))}
