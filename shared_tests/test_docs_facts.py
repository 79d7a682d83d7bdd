"""The facts of README.md and docs/*.md that the code determines agree with the code.

Generated facts sit between markers (`<!-- facts:KEY -->TEXT<!-- /facts -->`, see
shared_tests/docs_facts.py); when one is stale, `.venv/bin/python -m shared_tests.docs_facts --write`
rewrites it. The other checks guard what markers cannot: a count of cases typed by hand, a wrong
number of layer files, a signature quoted wrongly, a link or a path that leads nowhere, and a
measured number written outside docs/benchmark.md (or docs/gpu.md, the GPU's).
"""

import ast
import re

import pytest

from shared_tests import docs_facts
from shared_tests.docs_facts import PAGES, ROOT

FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# "87 cases", "29 decode cases", "the 24 KV-cache cases", "a 40-case table", "72/72 rows"
CASE_COUNT = re.compile(r"\b\d+\s*(?:/\d+\s*)?(?:-case|(?:decode |KV-cache )?(?:cases?|rows?))\b")
FILE_COUNT = re.compile(r"\b(one|two|three|four|five|six)\s+(?:layer\s+)?(?:files|implementations)\b", re.IGNORECASE)
MEASURED = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?x\b|\b\d+(?:\.\d+)? ?(?:ms|us|MiB|GiB|tokens/s)\b|\b\d+(?:\.\d+)? (?:s|min)\b"
)
MEASUREMENT_PAGES = ("docs/benchmark.md", "docs/gpu.md")  # where a measured ratio or time is written
# Counts of cases that are not the table's today, each with where it stands and why it may.
HISTORICAL_COUNTS = {
    ("docs/SPEC.md", "40-case table"): "the CUDA run of an earlier table (docs/gpu.md)",
    ("docs/gpu.md", "had 40 cases"): "the CUDA run of an earlier table",
    ("docs/gpu.md", "40/40 cases"): "the CUDA run of an earlier table",
    ("docs/gpu.md", "40-case table"): "the CUDA run of an earlier table",
    ("docs/benchmark.md", "72 cases, 23 decode cases"): "the run of parity.md's excerpt, an earlier table",
}
# Phrases naming a number of files other than the layer files.
OTHER_FILES = {("docs/design.md", "two files")}  # the TensorFlow and Keras files' int8 layouts
REPOSITORY_PATH = re.compile(
    r"(?<![\w/.])((?:PyTorch|TensorFlow|Keras|NumPy|shared_tests|interop|bench|examples|docs|\.ci)/[\w./-]*\w)"
)
MODULE = re.compile(r"(?<![\w.])(shared_tests|bench|interop)\.(\w+)\b(?!\.\w*\()")  # not `interop.hf.port_attention(`
# The functions whose quoted signatures and calls are checked, by the name the docs use.
FUNCTIONS = {
    **{
        name: f"interop.hf.{name}"
        for name in (
            "port_attention", "port_checkpoint", "replace_attention", "register_porter", "load_tensors",
            "supported_modules", "t5_position_bias", "alibi_positions",
        )
    },
    "alibi_bias": "NumPy.Multi_Head_Attention.alibi_bias",
    **{name: f"NumPy.MultiHeadAttention.{name}" for name in ("import_weights", "export_weights", "backward")},
}  # fmt: skip


def _page_id(page):
    return str(page.relative_to(ROOT))


def _blank(match):
    return "\n" * match.group().count("\n")  # what is left out keeps its lines, so line numbers hold


def _code_free(text):
    """The page without fenced blocks and HTML comments."""
    return COMMENT.sub(_blank, FENCED.sub(_blank, text))


def _prose(text):
    """The page without fenced blocks, HTML comments and marked spans."""
    return _code_free(docs_facts.MARKER.sub(_blank, text))


def _findings(page, pattern, text=None):
    text = _prose(page.read_text()) if text is None else text
    return [(text.count("\n", 0, m.start()) + 1, m) for m in pattern.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_marked_fact_is_what_the_code_gives(page):
    stale = [
        f"{_page_id(page)}:{line}: facts:{key} says {text!r}, the code gives {docs_facts.generate(key)!r}"
        for key, text, line in docs_facts.spans(page.read_text())
        if text != docs_facts.generate(key)
    ]
    assert not stale, "\n".join([*stale, "run: .venv/bin/python -m shared_tests.docs_facts --write"])


def test_the_pages_mark_the_counts_a_new_case_changes():
    keys = {key for page in PAGES for key, _, _ in docs_facts.spans(page.read_text())}
    assert {"cases", "decode_cases", "file_count", "jax_cases", "model_types"} <= keys


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_no_count_of_cases_is_typed_by_hand(page):
    """A count of cases outside a marker would not follow the table; an earlier table's count says so."""
    unmarked = [
        f"{_page_id(page)}:{line}: {m.group()!r}"
        for line, m in _findings(page, CASE_COUNT)
        if not any(
            where == _page_id(page) and phrase in page.read_text().splitlines()[line - 1]
            for where, phrase in HISTORICAL_COUNTS
        )
    ]
    assert not unmarked, "mark it as <!-- facts:cases -->N<!-- /facts --> (or decode_cases):\n" + "\n".join(unmarked)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_the_number_of_layer_files_is_the_code_s(page):
    """Every "N files" and "N layer files" says how many layer files there are; SPEC History tells the past."""
    text = page.read_text()
    if page.name == "SPEC.md":
        text = text[: text.index("## History")]
    count = docs_facts.generate("file_count")
    wrong = [
        f"{_page_id(page)}:{line}: {m.group()!r}"
        for line, m in _findings(page, FILE_COUNT, _prose(text))
        if m.group(1).lower() != count and (_page_id(page), m.group().lower()) not in OTHER_FILES
    ]
    assert not wrong, f"there are {count} layer files ({docs_facts.layer_files()}):\n" + "\n".join(wrong)


@pytest.mark.parametrize("page", [p for p in PAGES if _page_id(p) not in MEASUREMENT_PAGES], ids=_page_id)
def test_measured_numbers_are_written_once_in_the_benchmark_pages(page):
    found = [f"{_page_id(page)}:{line}: {m.group()!r}" for line, m in _findings(page, MEASURED)]
    assert not found, "write it in docs/benchmark.md with its run, and link there:\n" + "\n".join(found)


def _anchors(page):
    """GitHub's anchors of a page's headings."""
    headings = re.findall(r"^#+ (.*)$", FENCED.sub("", page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_relative_links_resolve_inside_the_repository(page):
    broken = []
    for line, m in _findings(page, LINK, COMMENT.sub(_blank, page.read_text())):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        inside = resolved == ROOT or ROOT in resolved.parents
        if not inside or not resolved.exists():
            broken.append(f"{_page_id(page)}:{line}: {target} (no such file in the repository)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{_page_id(page)}:{line}: {target} (no heading with that anchor)")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_quoted_paths_and_modules_exist(page):
    """Every repository path (`bench/memory.py`, `examples/data/alice.txt`) and module (`shared_tests.parity`)
    a page names, in prose, code and comments alike, exists."""
    missing = []
    for line, m in _findings(page, REPOSITORY_PATH, page.read_text()):
        if not (ROOT / m.group(1)).exists():
            missing.append(f"{_page_id(page)}:{line}: {m.group(1)}")
    for line, m in _findings(page, MODULE, page.read_text()):
        if not docs_facts.module_sources(f"{m.group(1)}.{m.group(2)}"):  # a module's file or a package's folder
            missing.append(f"{_page_id(page)}:{line}: {m.group()}")
    assert not missing, "\n".join(missing)


def _parameters(arguments):
    """(name, kind, default) of each parameter: kind "positional" or "keyword" (after `*`), the default as text."""
    positional = arguments.posonlyargs + arguments.args
    defaults = [None] * (len(positional) - len(arguments.defaults)) + arguments.defaults
    return [(a.arg, "positional", d and ast.unparse(d)) for a, d in zip(positional, defaults, strict=True)] + [
        (a.arg, "keyword", d and ast.unparse(d))
        for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
    ]


def _quoted_calls(page):
    """(line, name, argument text) of each inline `name(...)` of a checked function."""
    pattern = re.compile(rf"(?:^|[.\s])({'|'.join(FUNCTIONS)})\((.*)\)$")
    for line, m in _findings(page, INLINE_CODE, _code_free(page.read_text())):
        call = pattern.search(m.group(1))
        if call:
            yield line, call[1], call[2]


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_quoted_signatures_and_calls_match_the_code(page):
    """A quote with a default or `*` is a signature: it must be the code's. Any other quote is a call:
    it must bind (no more positional arguments than the function takes, no unknown keyword)."""
    wrong = []
    for line, name, text in _quoted_calls(page):
        real = _parameters(docs_facts.arguments(FUNCTIONS[name]))
        if "=" in text or "*" in text:
            try:
                quoted = _parameters(ast.parse(f"def f({text}): pass").body[0].args)
            except SyntaxError:
                continue  # an abridged signature (`...`)
            if quoted != real:
                wrong.append(
                    f"{_page_id(page)}:{line}: {name}({text}) is {docs_facts.generate(f'signature {FUNCTIONS[name]}')}"
                )
            continue
        try:
            call = ast.parse(f"f({text})").body[0].value
        except SyntaxError:
            continue
        names = {p: kind for p, kind, _ in real}
        if len(call.args) > sum(kind == "positional" for kind in names.values()) or any(
            k.arg not in names for k in call.keywords
        ):
            wrong.append(
                f"{_page_id(page)}:{line}: {name}({text}) does not bind to {docs_facts.generate(f'signature {FUNCTIONS[name]}')}"
            )
    assert not wrong, "\n".join(wrong)


def _spec_block(opening):
    """The SPEC's unmarked code block that starts with `opening`, as one line."""
    blocks = re.findall(r"^```\n(.*?)^```", (ROOT / "docs" / "SPEC.md").read_text(), re.DOTALL | re.MULTILINE)
    text = next(block for block in blocks if block.startswith(opening))
    return " ".join(line.split("#")[0].strip() for line in text.splitlines())


def test_the_spec_constructor_is_the_layer_files_constructor():
    """SPEC "Constructor" names every file's core arguments in order with their defaults (the NumPy file's,
    less its extra `seed`); every file takes those first, then its extras, then the arguments the SPEC names
    after `<framework extras>` (added later: last, so that earlier calls and saved states keep their meaning)."""
    head, tail = _spec_block("MultiHeadAttention(").split("<framework extras>")
    quoted = _parameters(ast.parse(f"def {head.rstrip(', ')}): pass").body[0].args)
    later = _parameters(ast.parse(f"def f(*, {tail.strip(', )')}): pass").body[0].args) if tail.strip(", )") else []
    for framework in docs_facts.layer_files():
        real = [
            p for p in _parameters(docs_facts.arguments(f"{framework}.MultiHeadAttention.__init__")) if p[0] != "kwargs"
        ]
        assert real[: len(quoted)] == quoted, f"docs/SPEC.md's constructor differs from {framework}'s: {real}"
        assert real[len(real) - len(later) :] == later, (
            f"docs/SPEC.md's last arguments differ from {framework}'s: {real}"
        )
    numpy = _parameters(docs_facts.arguments("NumPy.MultiHeadAttention.__init__"))
    extras = [p[0] for p in numpy[len(quoted) : len(numpy) - len(later)]]
    assert extras == ["seed"], "NumPy's extras are `seed` only (SPEC, Constructor)"


def test_the_spec_call_is_the_layer_files_call():
    quoted = _spec_block("layer(query,").replace("layer(", "def f(", 1)
    quoted = _parameters(ast.parse(f"{quoted}: pass").body[0].args)
    methods = {"PyTorch": "forward", "TensorFlow": "call", "Keras": "call", "NumPy": "__call__"}
    for framework in docs_facts.layer_files():
        real = _parameters(docs_facts.arguments(f"{framework}.MultiHeadAttention.{methods[framework]}"))
        extras = [p for p in real if p not in quoted]  # TensorFlow's training and value_mask
        assert [p for p in real if p in quoted] == [p for p in quoted if p in real], framework
        assert {p[0] for p in quoted} - {p[0] for p in real} <= {"mask"}, framework  # Keras files: `mask` in __call__
        keras_extras = {"training", "value_mask"} if framework in ("TensorFlow", "Keras") else set()  # SPEC's comment
        assert {p[0] for p in extras} == keras_extras, f"SPEC, Call does not name {extras} ({framework})"


def test_the_family_table_names_only_supported_model_types():
    text = (ROOT / "docs" / "modern.md").read_text()
    table = text[text.index("| family (model types) |") : text.index("Cross-attention:")]
    named = {
        name
        for row in table.splitlines()[2:]
        if row.startswith("| ")
        for name in re.findall(r"`([\w-]+)`", re.sub(r";[^)]*scaling", "", row.split(" | ")[0]))  # not `yarn`
    }
    unknown = named - set(docs_facts.generate("model_types").replace("`", "").split(", "))
    assert not unknown, f"docs/modern.md's families name model types interop.hf does not port: {sorted(unknown)}"


def test_the_refused_model_types_are_not_ported():
    """docs/modern.md's table of refusals names no model type interop.hf ports."""
    text = (ROOT / "docs" / "modern.md").read_text()
    table = text[text.index("| what | families | why |") :].split("\n\n")[0]
    named = {name for row in table.splitlines()[2:] for name in re.findall(r"`([\w-]+)`", row.split(" | ")[1])}
    ported = named & set(docs_facts.generate("model_types").replace("`", "").split(", "))
    assert not ported, f"docs/modern.md calls {sorted(ported)} refused; interop.hf ports them"


def test_the_feature_table_of_the_layer_files_reads_the_source():
    """`files_with` finds each feature by a name the source defines: a feature renamed away fails here."""
    for feature in docs_facts.FEATURES:
        assert docs_facts.generate(f"files_with {feature}") != "none", feature


def test_the_parity_options_table_names_every_option():
    """docs/parity.md's Options table against the options shared_tests/parity.py parses."""
    tree = ast.parse((ROOT / "shared_tests" / "parity.py").read_text())
    options = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
    }
    text = (ROOT / "docs" / "parity.md").read_text()
    table = text[text.index("| option | what it does |") :].split("\n\n")[0]
    documented = set(re.findall(r"`(--[\w-]+)", table))
    assert options == documented, (
        f"parses {sorted(options - documented)} undocumented; documents {sorted(documented - options)}"
    )


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_quoted_case_names_exist(page):
    """`gemma2_like`, `decode_rolling_*`, `large_scores*`: a case (or the prefix of some) of the tables."""
    from shared_tests.cases import REPORT_CASES
    from shared_tests.decoding import REPORT_DECODE_CASES

    names = [case.name for case in [*REPORT_CASES, *REPORT_DECODE_CASES]]  # the report's tables
    quoted = re.compile(r"`((?:decode_|large_scores|empty_)[a-z0-9_]*\*?|[a-z0-9_]+_like)`")
    unknown = [
        f"{_page_id(page)}:{line}: {m.group(1)}"
        for line, m in _findings(page, quoted, page.read_text())
        if not any(
            name == m.group(1) or (m.group(1).endswith("*") and name.startswith(m.group(1)[:-1])) for name in names
        )
    ]
    assert not unknown, "no such case in shared_tests/cases.py or decoding.py:\n" + "\n".join(unknown)


NOT_OURS = {"_compute_yarn_parameters"}  # transformers' function, named where the SPEC follows it


def test_quoted_private_names_exist():
    """A `_name` the docs quote (a helper, a record, a buffer) is in the source of a layer file,
    interop/hf/, shared_tests/ or bench/: a renamed helper fails here."""
    sources = [*ROOT.glob(f"*/{docs_facts.LAYER_FILE}"), *docs_facts.module_sources("interop.hf")]
    tests = [path for path in ROOT.glob("shared_tests/*.py") if "docs_facts" not in path.name]  # not these lists
    text = "\n".join(path.read_text() for path in [*sources, *tests, *ROOT.glob("bench/*.py")])
    unknown = [
        f"{_page_id(page)}:{line}: {m.group(1)}"
        for page in PAGES
        for line, m in _findings(page, re.compile(r"`(_[A-Za-z]\w*)(?:\(\))?`"), page.read_text())
        if m.group(1) not in NOT_OURS and not re.search(rf"\b{m.group(1)}\b", text)
    ]
    assert not unknown, "no such name in the code:\n" + "\n".join(unknown)


def test_the_spec_init_cache_is_each_file_s():
    """SPEC "KV-cache decoding": one `init_cache` line for every file, another for TensorFlow's."""
    block = (ROOT / "docs" / "SPEC.md").read_text().split("## KV-cache decoding")[1].split("```")[1]
    lines = [line for line in block.splitlines() if "init_cache(" in line]
    quoted = {
        "TensorFlow" if "# TensorFlow" in line else "other": line.split("init_cache")[1].split("  #")[0].strip()
        for line in lines
    }
    for framework in docs_facts.layer_files():
        real = docs_facts.generate(f"signature {framework}.MultiHeadAttention.init_cache").strip("`")
        assert "init_cache" + quoted.get(framework, quoted["other"]) == real, framework


def _row(text, opening):
    """The numbers of the Markdown table row that starts with `opening` ("n/a" as None, "same" as is)."""
    row = next(line for line in text.splitlines() if line.startswith(f"| {opening} |"))
    cells = [cell.strip().split(" (")[0] for cell in row.strip("|").split("|")[1:]]
    words = {"n/a": None, "same": "same"}
    return [[words[p.strip()] if p.strip() in words else float(p) for p in cell.split(" / ")] for cell in cells]


def test_the_spec_tolerances_are_the_tests():
    """SPEC "Tolerances" against TOLERANCES and FLOAT64_TOLERANCES of shared_tests/cases.py."""
    from shared_tests.cases import FLOAT64_TOLERANCES, TOLERANCES

    text = (ROOT / "docs" / "SPEC.md").read_text()
    quantities = ("output", "weights", "grads")
    assert _row(text, "PyTorch, TensorFlow or Keras vs NumPy float64") == [
        [TOLERANCES["float32"][q]] for q in quantities
    ]
    low = _row(text, "float16 / bfloat16 vs NumPy")
    assert low[0] == [TOLERANCES["float16"]["output"], TOLERANCES["bfloat16"]["output"]]
    assert low[1] == ["same"] and [TOLERANCES[d]["weights"] for d in ("float16", "bfloat16")] == low[0]
    assert low[2] == [None] and TOLERANCES["float16"]["grads"] is TOLERANCES["bfloat16"]["grads"] is None
    for opening, kind in (("float64, no RoPE", "plain"), ("float64 with RoPE", "rope")):
        assert _row(text, opening) == [[FLOAT64_TOLERANCES[kind][q]] for q in quantities], opening


def test_the_variants_table_names_every_variant():
    """docs/modern.md's table of constructor variants names every field of the files' `_Variants`."""
    variants = docs_facts.generate("fields _Variants").strip("`").split(", ")
    text = (ROOT / "docs" / "modern.md").read_text()
    table = text[text.index("| constructor argument |") :].split("\n\n")[0]
    named = set(re.findall(r"`(\w+)", table))
    assert not set(variants) - named, f"docs/modern.md's variants table lacks {sorted(set(variants) - named)}"


# The names the docs give the pinned packages, and their names in requirements.txt.
PINNED = {
    "torch": "torch", "TensorFlow": "tensorflow-cpu", "Keras": "keras", "JAX": "jax", "transformers": "transformers",
    "torchao": "torchao", "onnxruntime": "onnxruntime", "tf2onnx": "tf2onnx", "LiteRT": "ai-edge-litert",
}  # fmt: skip


def _pins():
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))
    makefile = re.search(r"TF_KERAS := tf_keras==(\S+)", (ROOT / "Makefile").read_text())
    return {**pins, "tf_keras": makefile[1]}


@pytest.mark.parametrize("page", [p for p in PAGES if _page_id(p) not in MEASUREMENT_PAGES], ids=_page_id)
def test_quoted_versions_are_the_pinned_ones(page):
    """`torch==2.13.0`, "TensorFlow 2.21", "JAX is pinned at 0.10.2": the versions requirements.txt pins.
    (The benchmark pages name the versions of their runs.)"""
    pins = _pins()
    quoted = re.compile(
        rf"\b({'|'.join(PINNED)}|{'|'.join(map(re.escape, pins))})(?:==| | is pinned at )(\d+\.\d+(?:\.\d+)?)\b"
    )
    wrong = [
        f"{_page_id(page)}:{line}: {m.group()} (pinned: {pins[PINNED.get(m[1], m[1])]})"
        for line, m in _findings(page, quoted, page.read_text())
        if not pins[PINNED.get(m[1], m[1])].startswith(m[2])
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_make_targets_exist(page):
    """Every `make TARGET` a page runs (in backticks or in a command block) is a target of the Makefile."""
    targets = set(re.findall(r"^([a-z]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    bash = "\n".join(re.findall(r"^```bash\n(.*?)^```", page.read_text(), re.DOTALL | re.MULTILINE))
    commands = [*re.findall(r"`(make [^`\n]+)`", page.read_text()), *bash.splitlines()]
    unknown = sorted(
        {m[1] for line in commands for m in [re.match(r"(?:\S+=\S+ )*make ([a-z]+)", line)] if m} - targets
    )
    assert not unknown, f"{_page_id(page)} runs make targets the Makefile lacks: {unknown}"


def _strings(path):
    """Every string literal of a source file, an f-string's fields as NUL."""
    found = []
    for node in ast.walk(docs_facts.parsed(path)):
        if isinstance(node, ast.JoinedStr):
            found.append("".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append(node.value)
    return found


def _says(text, words):
    """Whether a message literal (its f-string fields NUL) can begin with `words`: the literal pieces, in
    order, that cover most of `words`, with anything where a field stands (`{expected}`)."""
    pieces = text.split("\0")
    for k in range(1, len(pieces) + 1):
        if sum(map(len, pieces[:k])) >= 0.6 * len(words):
            return bool(re.match(".*".join(map(re.escape, pieces[:k])), words, re.DOTALL)) or words in text
    return False


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_quoted_error_messages_are_every_file_s(page):
    """An error message a page quotes ("`window` must be ... Received: ...") is raised with that text by
    every layer file: its words up to the first "..." or "Received:" are in each file's strings."""
    strings = {framework: _strings(ROOT / framework / docs_facts.LAYER_FILE) for framework in docs_facts.layer_files()}
    prose = re.sub(r"\s*\n\s*", " ", page.read_text())  # a quote may wrap
    wrong = []
    for quote in re.findall(r'"((?:`\w+` |Pass the )[^"]*?Received:[^"]*)"', prose):
        words = quote.split("Received:")[0].split("...")[0]
        missing = [f for f, found in strings.items() if not any(_says(text, words) for text in found)]
        if missing:
            wrong.append(f"{_page_id(page)}: {words!r} is not in {missing}")
    assert not wrong, "\n".join(wrong)
