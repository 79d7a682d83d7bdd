"""The norms some attention modules place where the Llama and BART kinds have none: a norm of the merged heads
before the output projection, which the layer computes as `output_norm` (BitNet's `attn_sub_norm`, an RMSNorm, the
Llama kind otherwise; Kosmos-2's `inner_attn_ln`, Magneto's sub-LayerNorm, the BART kind otherwise), and HunYuan's
QK-norms under other names (`query_layernorm`, `key_layernorm`), applied after RoPE (`qk_norm_after_rope`); and the
pre-LN copies of BERT's attention (RoBERTa-PreLayerNorm's `LayerNorm`, XLM-RoBERTa-XL's `self_attn_layer_norm`,
Megatron-BERT's `ln`), whose
LayerNorm of the input stays out of the layer, as BERT's LayerNorm after the residual does.

What is read, never computed (no numeric probe): the norm's class (an RMSNorm of `weight` or of `1 + weight`, or a
LayerNorm) and eps, and the module's forward, which must assign the norm of a name and pass that name, next, to the
output projection (`attn_output = self.attn_sub_norm(attn_output)`, then `self.o_proj(attn_output)`).
"""

import ast
import inspect
import re
import textwrap

import numpy as np

from .tensors import _tensor

OUTPUT_NORMS = ("attn_sub_norm", "inner_attn_ln")  # the children read as `output_norm`
QK_NORM_NAMES = {"query_layernorm": "q_norm", "key_layernorm": "k_norm"}  # HunYuan's: the Llama kind's names
_EPS = ("variance_epsilon", "eps")


def _output_norm_options(module, refuse, output):
    """(the name of the module's output norm, {"output_norm": ..., "output_norm_eps": ..., "norm_offset": ...}), or
    (None, {}) where it has none; `refuse(what)` raises the family's refusal; `output`: its output projection."""
    children = dict(module.named_children())
    name = next((n for n in OUTPUT_NORMS if children.get(n) is not None), None)
    if name is None:
        return None, {}
    norm = children[name]
    unread = f"normalizes its merged heads with {type(norm).__name__} (`{name}`), which no porter reads"
    names, eps = _norm_parameters(norm, refuse, unread, needs_weight=True)
    if not _normalizes_before(type(module).forward, name, output):
        refuse(f"applies `{name}` elsewhere than to its merged heads right before `{output}`, which no porter reads")
    kind, offset = _norm_kind(norm, names, refuse, unread)
    return name, {"output_norm": kind, "output_norm_eps": eps, "norm_offset": offset}


def _norm_parameters(norm, refuse, unread, needs_weight=False):
    """The names of a norm module's parameters and its eps; `refuse(unread)` unless it holds a float eps, no
    parameter but `weight` and `bias` (`weight` with `needs_weight`) and no child."""
    names = {n for n, _ in norm.named_parameters()}
    eps = next((getattr(norm, a) for a in _EPS if isinstance(getattr(norm, a, None), float)), None)
    missing = needs_weight and "weight" not in names
    if eps is None or not names <= {"weight", "bias"} or missing or list(norm.children()):
        refuse(unread)
    return names, eps


def _norm_kind(norm, names, refuse, unread):
    """("layer", False) for a LayerNorm, ("rms", whether it scales by 1 + weight) for an RMSNorm without a bias, read
    from its class's source; `refuse(unread)` for another."""
    source = inspect.getsource(type(norm))
    if "LayerNorm" in type(norm).__name__ or "layer_norm" in source:
        return "layer", False
    if "bias" in names or ("rsqrt" not in source and "pow(2)" not in source):
        refuse(unread)
    return "rms", bool(re.search(r"\(\s*1(\.0)?\s*\+\s*self\.weight", source))


def _normalizes_before(forward, name, output):
    """Whether `forward` assigns `x = self.<name>(x)` and the next statement that reads x is `self.<output>(x)`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    statements = [node for node in ast.walk(tree) if isinstance(node, ast.stmt) and not hasattr(node, "body")]
    statements.sort(key=lambda node: node.lineno)
    for i, node in enumerate(statements):
        variable = _self_call_of(node, name)
        if variable is None:
            continue
        later = [s for s in statements[i + 1 :] if any(getattr(n, "id", None) == variable for n in ast.walk(s))]
        return bool(later) and _self_call_of(later[0], output) == variable
    return False


def _self_call_of(node, attribute):
    """The name x of a statement `... = self.<attribute>(x)`, else None."""
    call = getattr(node, "value", None)
    if not (isinstance(node, ast.Assign) and isinstance(call, ast.Call) and len(call.args) == 1):
        return None
    function, argument = call.func, call.args[0]
    called = isinstance(function, ast.Attribute) and function.attr == attribute
    return getattr(argument, "id", None) if called and getattr(function.value, "id", None) == "self" else None


def _with_output_norm(kwargs, weights, tensors, name, options):
    """The port's kwargs and weights with the output norm `name`: `output_norm`, its eps, `context_norm` (1 + weight
    for an RMSNorm of 1 + weight) and, for a LayerNorm, `context_norm_bias` (zeros where it has none)."""
    scale = _tensor(tensors, f"{name}.weight")  # (N*Hv,)
    weights["context_norm"] = scale + 1.0 if options["norm_offset"] else scale
    if options["output_norm"] == "layer":
        bias = f"{name}.bias"
        weights["context_norm_bias"] = _tensor(tensors, bias) if bias in tensors else np.zeros_like(scale)
    return kwargs | {"output_norm": options["output_norm"], "output_norm_eps": options["output_norm_eps"]}, weights


def _renamed_qk_norms(module, children):
    """(the children with HunYuan's QK-norm names as the Llama kind's, whether its forward applies them after
    RoPE); the children as they are, and False, where it has neither name."""
    if not set(QK_NORM_NAMES) & set(children):
        return children, False
    renamed = {QK_NORM_NAMES.get(name, name): child for name, child in children.items()}
    return renamed, _called_after(type(module).forward, "query_layernorm", "apply_rotary_pos_emb")


def _called_after(forward, attribute, function):
    """Whether `forward` calls `self.<attribute>` only on lines after its first call of `function`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    norms = [n.lineno for n in calls if isinstance(n.func, ast.Attribute) and n.func.attr == attribute]
    turns = [n.lineno for n in calls if getattr(n.func, "id", None) == function]
    return bool(norms and turns) and min(norms) > min(turns)


def _renamed_tensors(tensors):
    """The module's tensors with HunYuan's QK-norm names as the Llama kind's (`q_norm.weight`, ...)."""
    renamed = {}
    for name, value in tensors.items():
        head, _, tail = name.partition(".")
        renamed[f"{QK_NORM_NAMES.get(head, head)}.{tail}" if tail else name] = value
    return renamed


INPUT_NORMS = ("LayerNorm", "self_attn_layer_norm", "ln")  # a pre-LN BERT attention's LayerNorm of its input
_PRE_LN_FORWARDS = (  # the pre-LN copies' module, `self` and `output` forwards, as text: (module, its classes)
    (
        "transformers.models.roberta_prelayernorm.modeling_roberta_prelayernorm",
        ("RobertaPreLayerNormAttention", "RobertaPreLayerNormSelfAttention", "RobertaPreLayerNormSelfOutput"),
    ),  # its `self` is BERT's text (XLM-RoBERTa-XL's too)
    (
        "transformers.models.megatron_bert.modeling_megatron_bert",
        ("MegatronBertAttention", "MegatronBertSelfAttention", "MegatronBertSelfOutput"),
    ),
)


def _input_norm(module):
    """The name of a BERT-kind module's LayerNorm of its input (a child of the module itself), else None."""
    children = dict(module.named_children())
    return next((name for name in INPUT_NORMS if type(children.get(name)).__name__ == "LayerNorm"), None)


def _pre_ln_forwards(module, name):
    """Whether the pre-LN module's forward, its `self`'s and its `output`'s are, as text, those of a known pre-LN
    copy of BERT's attention (`_PRE_LN_FORWARDS`; the LayerNorm `name` and the normalized states' name aside)."""
    import importlib

    parts = (module, module.self, module.output)
    for source, classes in _PRE_LN_FORWARDS:
        references = [getattr(importlib.import_module(source), cls) for cls in classes]
        norms = (name, None, None), (_norm_of(references[0]), None, None)
        if all(
            _text(type(part).forward, mine) == _text(reference.forward, theirs)
            for part, reference, mine, theirs in zip(parts, references, *norms, strict=True)
        ):
            return True
    return False


def _norm_of(attention):
    """The name of a reference pre-LN attention class's LayerNorm of its input, read from its forward's first line."""
    first = ast.parse(textwrap.dedent(inspect.getsource(attention.forward))).body[0].body[0]
    return first.value.func.attr


def _text(function, norm):
    """A forward's statements as text, the LayerNorm `self.<norm>` and the name it assigns renamed alike."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    statements = [node for node in tree.body if not isinstance(node, ast.Expr)]  # no docstring
    text = "\n".join(ast.unparse(node) for node in statements)
    first = statements[0] if norm is not None else None
    if isinstance(first, ast.Assign) and _self_call_of(first, norm) is not None:
        text = re.sub(rf"\b{first.targets[0].id}\b", "normed", text)
    return text if norm is None else text.replace(f"self.{norm}(", "self.NORM(")
