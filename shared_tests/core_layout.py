"""The layer files' layout, measured: where the core ends, which option sections follow and in
which order, and what a plain call makes a reader read (the definitions of the layer file that
an eager call enters, traced with sys.settrace). test_core_layout.py holds the limits;
`python -m shared_tests.core_layout [FRAMEWORK ...]` prints the measurements as JSON (the
Keras file on the backend KERAS_BACKEND names)."""

import ast
import importlib
import json
import os
import re
import sys

import numpy as np

CORE_HEADER = "Core: the plain layer"
SECTIONS = (
    "backward",
    "score modifiers",
    "positions",
    "QK-norm, clip_qkv and the gate",
    "KV cache and decode steps",
    "shared keys and values",
    "multi-head latent attention",
    "sparse indexer",
    "speed paths",
    "int8",
    "framework only",
    "converters",
)
ONLY_IN = {"backward": ("NumPy",)}  # a section that exists in some files only
FRAMEWORKS = ("NumPy", "PyTorch", "TensorFlow", "Keras")
HEADER = re.compile(r"^# (Core: the plain layer|Section: (.+))$")
SOFTCAP_NAMES = frozenset({"softcap", "cap"})  # the names the soft-capping option's value is carried by
LATENT_NAMES = frozenset(
    {
        "kv_lora_rank",
        "q_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "absorb_latents",
        "latent_norm_eps",
        "_latent",
    }
)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def path_of(framework):
    return os.path.join(ROOT, framework, "Multi_Head_Attention.py")


def headers(framework):
    """[(title, line)] of the core's and the sections' headers, in file order."""
    with open(path_of(framework)) as handle:
        lines = handle.read().splitlines()
    found = []
    for number, line in enumerate(lines, 1):
        match = HEADER.match(line)
        if match:
            found.append((match.group(2) or CORE_HEADER, number))
    return found


def expected_headers(framework):
    return [CORE_HEADER] + [title for title in SECTIONS if framework in ONLY_IN.get(title, FRAMEWORKS)]


def core_end(framework):
    """The last line of the core: the line before the first section's header (its dash rule)."""
    sections = [line for title, line in headers(framework) if title != CORE_HEADER]
    return sections[0] - 2 if sections else sum(1 for _ in open(path_of(framework)))


def section_of(framework, line):
    """The title of the part of the file that holds `line` (the core from line 1)."""
    title = CORE_HEADER
    for name, start in headers(framework):
        if start <= line:
            title = name
    return title


def definitions(framework):
    """{first line of code: (first line with decorators, last line, node)} of every function."""
    with open(path_of(framework)) as handle:
        tree = ast.parse(handle.read())
    spans = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans[node.lineno] = (first, node.end_lineno, node)
    return spans


def _own_nodes(function):
    """The nodes of `function`'s body, without those of the functions nested in it."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stack.extend(ast.iter_child_nodes(node))


def readers(framework, names):
    """[(function name, line)] of the functions that read any of `names` (a variable, an
    attribute or an argument of that name)."""
    found = []
    for _, (first, _, node) in sorted(definitions(framework).items()):
        arguments = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        used = arguments | {
            n.id if isinstance(n, ast.Name) else n.attr
            for n in _own_nodes(node)
            if isinstance(n, (ast.Name, ast.Attribute))
        }
        if used & names:
            found.append((node.name, first))
    return found


def readers_outside(framework, names, sections):
    """(name, line) of the functions reading `names` outside `sections` (a title or a tuple of titles)."""
    sections = (sections,) if isinstance(sections, str) else sections
    return [(name, line) for name, line in readers(framework, names) if section_of(framework, line) not in sections]


def module_docstring_lines(framework):
    with open(path_of(framework)) as handle:
        tree = ast.parse(handle.read())
    first = tree.body[0]
    return first.end_lineno - first.lineno + 1


def init_body_lines(framework):
    """Lines of MultiHeadAttention.__init__'s body, its docstring left out."""
    for first, _, node in definitions(framework).values():
        if node.name == "__init__" and _class_of(framework, first) == "MultiHeadAttention":
            body = node.body[1:] if ast.get_docstring(node) else node.body
            return body[-1].end_lineno - body[0].lineno + 1
    raise AssertionError(f"no MultiHeadAttention.__init__ in {framework}")


def _class_of(framework, line):
    with open(path_of(framework)) as handle:
        tree = ast.parse(handle.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.lineno <= line <= node.end_lineno:
            return node.name
    return None


def trace(framework, call):
    """Runs `call()` under sys.settrace and measures the layer file's definitions it enters:
    {"defs", "lines" (whole definitions), "last" (their last line), "outside" (those not in the
    core, as 'name:line')}. Lambdas and comprehensions are not counted."""
    path, seen = os.path.realpath(path_of(framework)), set()

    def tracer(frame, event, arg):
        if event == "call" and os.path.realpath(frame.f_code.co_filename) == path:
            seen.add(frame.f_code.co_firstlineno)

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    spans, end = definitions(framework), core_end(framework)
    entered = [spans[line] for line in seen if line in spans]
    return {
        "defs": len(entered),
        "lines": sum(last - first + 1 for first, last, _ in entered),
        "last": max((last for _, last, _ in entered), default=0),
        "outside": sorted(f"{node.name}:{first}" for first, last, node in entered if last > end),
    }


def _inputs(framework):
    """A plain layer (E=64, N=4), the (2, 5, 64) input and a (2, 5) key mask in the framework's types."""
    x = np.random.default_rng(0).standard_normal((2, 5, 64))
    keep = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    module = importlib.import_module(f"{framework}.Multi_Head_Attention")
    if framework == "NumPy":
        return module.MultiHeadAttention(64, 4, seed=0), x, keep
    if framework == "PyTorch":
        import torch

        return module.MultiHeadAttention(64, 4).eval(), torch.tensor(x, dtype=torch.float32), torch.tensor(keep)
    return module.MultiHeadAttention(64, 4), x.astype(np.float32), keep


def measure(framework):
    """{"plain", "masked" (key_mask and causal=True), and with NumPy "backward"}: each `trace`d
    on a second call, after a first one that may build."""
    layer, x, keep = _inputs(framework)
    plain, masked = (lambda: layer(x)), (lambda: layer(x, key_mask=keep, causal=True))
    plain(), masked()
    result = {"plain": trace(framework, plain), "masked": trace(framework, masked)}
    if framework == "NumPy":
        output = plain()
        result["backward"] = trace(framework, lambda: layer.backward(np.ones_like(output)))
    return result


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, ROOT)
    print(json.dumps({name: measure(name) for name in sys.argv[1:] or FRAMEWORKS}))
