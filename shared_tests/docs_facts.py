"""The facts of README.md and docs/*.md that the code determines, generated from the code.

A page holds such a fact between markers, `<!-- facts:KEY -->TEXT<!-- /facts -->`: KEY names a
generator below (with its arguments after a space, `<!-- facts:files_with int8 -->`), and TEXT is
what it returned when the page was last written. `shared_tests/test_docs_facts.py` fails when a
TEXT differs from what the code gives now; one command rewrites every span:

    .venv/bin/python -m shared_tests.docs_facts --write

The generators read the code cheaply: the case tables are imported (NumPy only), the layer files
and the test files are parsed with `ast`, never imported, and the package `interop/hf/` is imported
without torch or transformers; the census's counts are read from the page it writes (docs/census.md).
"""

import argparse
import ast
import copy
import functools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED_PAGES = ("census.md",)  # written whole by a command (`python -m interop.hf.census --write`), no spans
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in GENERATED_PAGES)]
MARKER = re.compile(r"<!-- facts:(?P<key>[^>]*?) -->(?P<text>.*?)<!-- /facts -->", re.DOTALL)
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
LAYER_FILE = "Multi_Head_Attention.py"
# A feature of a layer file, told by a name its source defines (a class attribute, a method or a function).
FEATURES = {
    "memory_efficient": "memory_efficient_threshold",  # the chunked path with its own backward
    "int8": "quantize",
    "cache": "init_cache",
    "in_place_cache": "_write_variables",  # TensorFlow's cache of variables
    "fused_projection": "_project_fused",  # q, k and v in one matmul
    "fused_attention": ("_sdpa_attention", "_fused_attention"),  # a fused kernel: SDPA or ops.dot_product_attention
}


def layer_files():
    """The layer files, one per framework folder, in the order the docs name them."""
    order = ("PyTorch", "TensorFlow", "Keras", "NumPy")
    found = sorted(path.parent.name for path in ROOT.glob(f"*/{LAYER_FILE}"))
    return [name for name in order if name in found] + [name for name in found if name not in order]


@functools.cache
def parsed(path):
    return ast.parse(path.read_text())


def _layer_class(framework):
    tree = parsed(ROOT / framework / LAYER_FILE)
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "MultiHeadAttention")


@functools.cache
def _defined_names(framework):
    """Every name the layer class or its module defines: functions, classes, methods, class attributes."""
    tree = parsed(ROOT / framework / LAYER_FILE)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return names


def has_feature(framework, feature):
    """Whether a layer file has a feature of FEATURES: it defines one of the feature's names."""
    wanted = FEATURES[feature]
    wanted = (wanted,) if isinstance(wanted, str) else wanted
    return any(name in _defined_names(framework) for name in wanted)


FEATURE_NAMES = {
    "memory_efficient": "memory-efficient path (`memory_efficient_threshold`)",
    "int8": "int8 (`quantize`)",
    "cache": "KV cache (`init_cache`)",
    "in_place_cache": "in-place cache of variables",
    "fused_projection": "fused q/k/v projection (`_project_fused`)",
    "fused_attention": "fused attention kernel (SDPA, `ops.dot_product_attention`)",
}


def _feature_table():
    """A Markdown table: each feature of FEATURES, yes or no in each layer file."""
    files = layer_files()
    rows = [f"| feature | {' | '.join(files)} |", "|---|" + "---|" * len(files)]
    for feature, text in FEATURE_NAMES.items():
        rows.append(f"| {text} | " + " | ".join("yes" if has_feature(f, feature) else "no" for f in files) + " |")
    return "\n" + "\n".join(rows) + "\n"


def _fields(name):
    """The fields of the NamedTuple `name` (`_Call`, `_Variants`), the same in every layer file."""
    found = {}
    for framework in layer_files():
        record = next(n for n in parsed(ROOT / framework / LAYER_FILE).body if getattr(n, "name", None) == name)
        found[framework] = tuple(s.target.id for s in record.body if isinstance(s, ast.AnnAssign))
    if len(set(found.values())) != 1:
        raise ValueError(f"the layer files' {name} differ: {found}")
    return "`" + ", ".join(found[layer_files()[0]]) + "`"


def _integer(node):
    """The value of an integer literal or of a shift of two (`1 << 26`)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.LShift):
        return _integer(node.left) << _integer(node.right)
    return ast.literal_eval(node)


def _mebi(framework, name):
    """A power-of-two size the layer file assigns to `name` (module constant or class attribute), in Mi."""
    for node in ast.walk(parsed(ROOT / framework / LAYER_FILE)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return f"{_integer(node.value) >> 20} Mi"
    raise LookupError(f"no {name} in {framework}/{LAYER_FILE}")


def _joined(words):
    words = list(words)
    return "none" if not words else words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _code_list(names):
    return ", ".join(f"`{name}`" for name in names)


def _assigned(name, file="*.py"):
    """The module-level constant assigned to `name` in one of shared_tests/`file`, parsed, not imported."""
    for path in sorted((ROOT / "shared_tests").rglob(file)):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
                return ast.literal_eval(node.value)
    raise LookupError(f"no module-level {name} in shared_tests/")


def _cases():
    from shared_tests.cases import CASES

    return CASES


def _decode_cases():
    from shared_tests.decoding import DECODE_CASES

    return DECODE_CASES


def case_features(case):
    """The variants and options a case exercises, as the docs name them."""
    features = set()
    for name, value in case.variants:
        if name == "window" and isinstance(value, tuple | list):
            features.add("two-sided windows")
        elif name == "qk_norm_type" and value == "layer":
            features.add("LayerNorm QK-norm")
        elif name == "rope_fraction" and value < 1:
            features.add("partial RoPE")
        elif name == "rope_interleaved" and value:
            features.add("interleaved RoPE")
        elif name == "rope_scaling":
            features.add(f"`{value.get('rope_type', value.get('type'))}` RoPE scaling")
        elif name not in ("qk_norm_type", "rope_fraction", "rope_interleaved"):
            features.add(f"`{name}`")
    return features


def _jax_cases():
    by_name = {case.name: case for case in _cases()}
    return [by_name[name] for name in _assigned("JAX_CASES")]


def _missing_from_jax():
    everything = set().union(*(case_features(case) for case in _cases()))
    in_jax = set().union(*(case_features(case) for case in _jax_cases()))
    return sorted(everything - in_jax, key=lambda text: text.strip("`").lower())


def _hypothesis_examples(profile):
    """`max_examples` of a hypothesis profile registered in shared_tests/conftest.py."""
    for node in ast.walk(ast.parse((ROOT / "shared_tests" / "conftest.py").read_text())):
        registers = isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "register_profile"
        if registers and ast.literal_eval(node.args[0]) == profile:
            return str(next(ast.literal_eval(k.value) for k in node.keywords if k.arg == "max_examples"))
    raise LookupError(f"no hypothesis profile {profile!r} in shared_tests/conftest.py")


def _decode_paths():
    from shared_tests.decoding import DECODE_PATHS

    return DECODE_PATHS


def _model_types():
    import interop.hf

    builtin = interop.hf._BUILTIN  # the porters interop/hf/ ships, not those a test registers for a while
    return [name for name in interop.hf.supported_modules() if name in builtin]


@functools.cache
def _census():
    """The committed census (docs/census.md, written by `python -m interop.hf.census --write`): its class rows and
    its family rows, read from the page (transformers is not imported)."""
    from interop.hf import census

    return census.read_table()


def _census_count(status):
    """The number of attention classes of a status (`out_of_scope` for "out of scope")."""
    return str(sum(row[2] == status.replace("_", " ") for row in _census()[0]))


def _census_families(verdict):
    """The number of `*ForCausalLM` families of a verdict of the generated test (`all`: every one)."""
    return str(sum(verdict in ("all", row[2].replace(" ", "_")) for row in _census()[1]))


def _census_types(status):
    """The model types with a class of that status, in the census's order."""
    return _code_list(dict.fromkeys(row[0] for row in _census()[0] if row[2] == status.replace("_", " ")))


def arguments(dotted):
    """The `ast.arguments` of a function (`interop.hf.port_checkpoint`, `NumPy.Multi_Head_Attention.alibi_bias`)
    or of a layer's method (`NumPy.MultiHeadAttention.init_cache`, without `self`), read from its source."""
    module_path, _, name = dotted.rpartition(".")
    if module_path.endswith(".MultiHeadAttention"):
        function = next(f for f in _layer_class(module_path.split(".")[0]).body if getattr(f, "name", None) == name)
        args = copy.copy(function.args)
        args.args = args.args[1:]  # self
        return args
    return next(
        f for path in module_sources(module_path) for f in parsed(path).body
        if isinstance(f, ast.FunctionDef) and f.name == name
    ).args  # fmt: skip


def module_sources(module_path):
    """The source files of a module (`NumPy.Multi_Head_Attention`: its file) or of a package (`interop.hf`: the
    files of its folder, where its functions are defined and imported into `__init__.py`)."""
    path = ROOT / module_path.replace(".", "/")
    return [path.with_suffix(".py")] if path.with_suffix(".py").exists() else sorted(path.glob("*.py"))


def _signature(dotted):
    """`name(parameters)`, in backticks, as the source defines it."""
    return f"`{dotted.rpartition('.')[2]}({ast.unparse(arguments(dotted))})`"


@functools.cache
def _definitions(framework):
    """The functions, classes and methods a layer file defines (methods by their own name)."""
    names = set()
    for node in parsed(ROOT / framework / LAYER_FILE).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
    return frozenset(name for name in names if not name.startswith("__"))


def _names_in_some_files():
    """A Markdown list: for each layer file, the functions, classes and methods it defines that
    not every layer file defines (those in more than one file marked with the others' count)."""
    files = layer_files()
    everywhere = frozenset.intersection(*(_definitions(name) for name in files))
    lines = [""]
    for framework in files:
        own = sorted(_definitions(framework) - everywhere, key=str.lower)
        shared = [name for name in own if sum(name in _definitions(other) for other in files) > 1]
        marked = [f"`{name}`" + ("+" if name in shared else "") for name in own]
        lines.append(f"- **{framework}** ({len(own)}): {', '.join(marked)}")
    return "\n".join(lines) + "\n"


def _section_table():
    """A Markdown table: the core and each section of `core_layout.SECTIONS` (rows, in file
    order), with its line range in each layer file (columns), `-` where a file has no such part."""
    from shared_tests import core_layout

    files = layer_files()
    ranges = {}
    for framework in files:
        found = core_layout.headers(framework)
        ends = [line - 2 for _, line in found[1:]] + [len((ROOT / framework / LAYER_FILE).read_text().splitlines())]
        ranges[framework] = {
            title: f"{1 if i == 0 else line - 1}-{end}"
            for i, ((title, line), end) in enumerate(zip(found, ends, strict=True))
        }
    rows = [f"| part | {' | '.join(files)} |", "|---" * (len(files) + 1) + "|"]
    for title in (core_layout.CORE_HEADER, *core_layout.SECTIONS):
        rows.append(f"| {title} | " + " | ".join(ranges[f].get(title, "-") for f in files) + " |")
    return "\n" + "\n".join(rows) + "\n"


GENERATORS = {
    "cases": lambda: str(len(_cases())),
    "decode_cases": lambda: str(len(_decode_cases())),
    "jax_cases": lambda: str(len(_assigned("JAX_CASES"))),
    "jax_decode_cases": lambda: str(len(_assigned("JAX_DECODE_CASES"))),
    "jax_case_names": lambda: _code_list(_assigned("JAX_CASES")),
    "jax_decode_case_names": lambda: _code_list(_assigned("JAX_DECODE_CASES")),
    "jax_missing": lambda: _joined(_missing_from_jax()),
    "decode_paths": lambda: NUMBER_WORDS[len(_decode_paths())],
    "hypothesis_examples": _hypothesis_examples,
    "combined_cases": lambda: _code_list(c.name for c in _cases() if c.name.endswith("_like") or "variants" in c.name),
    "model_types": lambda: _code_list(_model_types()),
    "file_count": lambda: NUMBER_WORDS[len(layer_files())],
    "mebi": _mebi,
    "memory_efficient_chunk": lambda: NUMBER_WORDS[_assigned("MEMORY_EFFICIENT_CHUNK")],
    "hf_layers": lambda: NUMBER_WORDS[len(_assigned("LAYERS", "test_hf.py"))],
    "hf_keras_backend": lambda: _assigned("KERAS_EVERY_FAMILY", "test_hf.py"),
    "hf_keras_spread": lambda: _code_list(_assigned("KERAS_SPREAD", "test_hf.py")),
    "feature_table": _feature_table,
    "fields": _fields,
    "files_with": lambda feature: _joined(name for name in layer_files() if has_feature(name, feature)),
    "has": lambda framework, feature: "yes" if has_feature(framework, feature) else "no",
    "signature": _signature,
    "sections": _section_table,
    "names_in_some_files": _names_in_some_files,
    "census": _census_count,
    "census_families": _census_families,
    "census_types": _census_types,
}


def generate(key):
    """The text of the span `<!-- facts:KEY -->`, from the code."""
    name, *args = key.split()
    if name not in GENERATORS:
        raise KeyError(f"unknown fact {name!r}: one of {', '.join(GENERATORS)}")
    return GENERATORS[name](*args)


def spans(text):
    """(key, text, line) of every marked span of a page."""
    return [(m["key"], m["text"], text.count("\n", 0, m.start()) + 1) for m in MARKER.finditer(text)]


def rewrite(text):
    """The page with every marked span generated again."""
    return MARKER.sub(lambda m: f"<!-- facts:{m['key']} -->{generate(m['key'])}<!-- /facts -->", text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the stale spans in place")
    args = parser.parse_args(argv)
    stale = 0
    for page in PAGES:
        text = page.read_text()
        new = rewrite(text)
        for (key, old, line), (_, fresh, _) in zip(spans(text), spans(new), strict=True):
            if old != fresh:
                stale += 1
                print(f"{page.relative_to(ROOT)}:{line}: facts:{key} {old!r} -> {fresh!r}")
        if args.write and new != text:
            page.write_text(new)
    if stale and not args.write:
        print(f"{stale} stale spans: run .venv/bin/python -m shared_tests.docs_facts --write")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
