"""Every Python code block of README.md and docs/*.md runs, as printed: a snippet that stops
working fails here.

The blocks are read from the pages at test time, so an edited snippet is what runs. The blocks
of a page run in order in one namespace (a page reads top to bottom), in a temporary working
directory. What a snippet takes for granted (a `layer`, a `prompt`, a tiny `transformers`
model) is set up by hidden blocks: a ```python block inside an HTML comment, which GitHub does
not render. They run where they stand, before (or after, to check a result) the block beside
them, with `ROOT`, the repository's root, in the namespace. A visible block can be left out
only with `<!-- not run: REASON -->` on the line before it, REASON one of NOT_RUN_REASONS.
A section (from its heading to the next) that needs another Keras backend says so with
`<!-- backend: NAME -->` (jax or torch): its blocks after the marker, hidden ones included, run
in order in a process of their own with `KERAS_BACKEND=NAME` (this process has Keras on
TensorFlow), with the same rules, and the page's other blocks run here.
Code blocks marked `bash` are commands (`make`, the examples), run by their own tests
(test_examples.py); unmarked blocks are signatures and output excerpts.
"""

import dataclasses
import json
import linecache
import os
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN_REASONS = {}  # reason -> why CI cannot run it (CUDA, torchrun): none today, keep it short
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->")
BACKEND = re.compile(r"<!--\s*backend:\s*(\w+)\s*-->")  # the rest of the section runs on that Keras backend
FENCE = "```"


@dataclasses.dataclass(frozen=True)
class Snippet:
    line: int  # of its first line of code, 1-based
    source: str
    hidden: bool  # inside an HTML comment: setup or a check, not shown
    not_run: str | None = None  # the reason of a `<!-- not run: REASON -->` on the line before
    backend: str | None = None  # the Keras backend of a `<!-- backend: NAME -->` section, None: this process's
    section: str = ""  # the text of the heading above it


def _block_end(lines, start):
    """The index of the fence that closes the block whose opening fence is at `start`."""
    return next(i for i in range(start + 1, len(lines)) if lines[i].strip() == FENCE)


def snippets(text):
    """The ```python blocks of a Markdown text, hidden (inside `<!-- -->`) or shown, in order."""
    lines, found, in_comment, not_run, backend, section, i = text.splitlines(), [], False, None, None, "", 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith(FENCE):
            end = _block_end(lines, i)
            if stripped == FENCE + "python":
                source, reason = "\n".join(lines[i + 1 : end]), None if in_comment else not_run
                found.append(Snippet(i + 2, source, in_comment, reason, backend, section))
            not_run = not_run if in_comment else None  # a marker holds for the next shown block only
            i = end + 1
            continue
        marker = NOT_RUN.search(stripped)
        if stripped.startswith("#") and not in_comment:
            backend, section = None, stripped.lstrip("#").strip()  # a heading starts a section
        elif BACKEND.search(stripped):
            backend = BACKEND.search(stripped).group(1)
        if marker:
            not_run = marker.group(1)
        elif stripped and not in_comment:
            not_run = None
        if "<!--" in stripped and "-->" not in stripped:
            in_comment = True
        elif "-->" in stripped:
            in_comment = False
        i += 1
    return found


def run_page(text, name):
    """Runs a page's blocks of this process in order in one namespace, then each `<!-- backend:
    NAME -->` section in a process of that backend (`run_elsewhere`). Returns the namespace."""
    found = snippets(text)
    namespace = run_snippets([s for s in found if s.backend is None], name)
    sections = {}
    for snippet in found:
        if snippet.backend is not None:
            sections.setdefault(snippet.backend, []).append(snippet)
    for backend, section in sections.items():
        run_elsewhere(section, name, backend)
    return namespace


def run_elsewhere(found, name, backend):
    """Runs blocks in order in a `KERAS_BACKEND=backend` process (`_main`), as `run_snippets` runs
    them here, any warning but the libraries' notices an error; a failure raises AssertionError
    with the process's traceback, which names `name:line`."""
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": os.pathsep.join(paths)}
    given = json.dumps([dataclasses.asdict(snippet) for snippet in found])
    command = [sys.executable, "-m", "shared_tests.test_snippets", name]
    done = subprocess.run(command, input=given, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{name}: the blocks on {backend} failed:\n{done.stderr[-4000:]}"


def run_snippets(found, name, restore=True):
    """Runs blocks in order in one namespace; a failing block raises, its traceback naming
    `name:line` (its source registered in linecache, as a file's is, for tracebacks and for
    tf.function's autograph). Returns the namespace. sys.path and the copied layer module
    (`Multi_Head_Attention`) are restored after, and with `restore` Keras' registry too."""
    module, path = types.ModuleType("__snippets__"), sys.path[:]
    module.ROOT, namespace = ROOT, module.__dict__
    sys.modules[module.__name__] = module  # a module of its own, as a user's file is (autograph looks it up)
    registry = _keras_registry() if restore else ()  # a `run_elsewhere` process ends with the page
    saved = [dict(names) for names in registry]
    try:
        for snippet in found:
            if snippet.not_run is not None:
                assert snippet.not_run in NOT_RUN_REASONS, f"{name}:{snippet.line}: unknown reason {snippet.not_run!r}"
                continue
            filename = f"{name}:{snippet.line}"
            linecache.cache[filename] = (len(snippet.source), None, snippet.source.splitlines(True), filename)
            exec(compile(snippet.source, filename, "exec"), namespace)  # the page's own code
    finally:
        for names, before in zip(registry, saved, strict=True):  # a copied Keras file registers its class anew
            names.clear()
            names.update(before)
        sys.path[:] = path
        sys.modules.pop("Multi_Head_Attention", None)
        sys.modules.pop(module.__name__)
    return namespace


def _keras_registry():
    """Keras' registry of serializable classes (name -> class and class -> name), which a copied
    layer file imported by a snippet overwrites for the whole process."""
    from keras.src.saving import object_registration

    return object_registration.GLOBAL_CUSTOM_OBJECTS, object_registration.GLOBAL_CUSTOM_NAMES


PAGES_WITH_SNIPPETS = [page for page in PAGES if any(not s.hidden for s in snippets(page.read_text()))]


LIBRARY_NOTICES = (
    DeprecationWarning,
    PendingDeprecationWarning,
    FutureWarning,
)  # the libraries' own, not the snippet's


@pytest.mark.parametrize("page", PAGES_WITH_SNIPPETS, ids=lambda page: page.name)
def test_every_python_snippet_of_the_page_runs_without_a_warning(page, tmp_path, monkeypatch):
    """As printed, with no warning for the reader to wonder about (an export in training mode
    warned) other than the libraries' deprecation notices."""
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_page(page.read_text(), str(page.relative_to(ROOT)))
    assert [f"{w.category.__name__}: {w.message}" for w in caught if not issubclass(w.category, LIBRARY_NOTICES)] == []


def test_the_pages_with_python_snippets_are_found():
    """The runner reads the pages it should: the README's quickstart and usage, and the docs."""
    names = {page.name for page in PAGES_WITH_SNIPPETS}
    assert {"README.md", "usage.md", "modern.md", "serving.md", "distributed.md"} <= names
    assert sum(not s.hidden for s in snippets((ROOT / "README.md").read_text())) >= 6


BROKEN_PAGE = """# A page

<!-- setup, not shown:
```python
x = 2
```
-->

```python
y = x * 3
```

<!-- not run: {reason} -->
```python
raise SystemExit("a block marked not run ran")
```

```bash
exit 1
```

```python
assert y == 7, "the snippet is wrong"
```
"""


def test_a_broken_snippet_fails_naming_its_line():
    assert [(s.line, s.hidden) for s in snippets(BROKEN_PAGE.format(reason="cuda"))] == [
        (5, True),
        (10, False),
        (15, False),
        (23, False),
    ]
    with pytest.raises(AssertionError, match="unknown reason 'cuda'"):
        run_page(BROKEN_PAGE.format(reason="cuda"), "page.md")
    NOT_RUN_REASONS["cuda"] = "no GPU in CI"
    try:
        with pytest.raises(AssertionError, match="the snippet is wrong") as failure:
            run_page(BROKEN_PAGE.format(reason="cuda"), "page.md")
    finally:
        del NOT_RUN_REASONS["cuda"]
    assert any(str(entry.path) == "page.md:23" for entry in failure.traceback)


BACKEND_PAGE = """# A page

```python
import os

here = os.environ.get("KERAS_BACKEND")
```

## On JAX

<!-- backend: jax -->
<!-- setup, not shown:
```python
import os

backend = os.environ["KERAS_BACKEND"]
```
-->

```python
assert backend == "jax" and "here" not in globals(), "{message}"
```

## Back here

```python
assert here != "jax"
```
"""


def test_a_backend_section_runs_in_its_own_process():
    """The blocks after `<!-- backend: jax -->` up to the next heading run in a process with
    KERAS_BACKEND=jax, in one namespace of their own; a failure there names its page and line."""
    found = snippets(BACKEND_PAGE)
    assert [s.section for s in found] == ["A page", "On JAX", "On JAX", "Back here"]
    assert [(s.line, s.hidden, s.backend) for s in found] == [
        (4, False, None),
        (14, True, "jax"),
        (21, False, "jax"),
        (27, False, None),
    ]
    assert "here" in run_page(BACKEND_PAGE.format(message="unused"), "page.md")
    broken = BACKEND_PAGE.replace('backend == "jax"', 'backend == "torch"')
    with pytest.raises(
        AssertionError, match=r"(?s)page\.md: the blocks on jax failed.*page\.md:21.*the snippet on jax"
    ):
        run_page(broken.format(message="the snippet on jax"), "page.md")


def _main(name):
    """A `run_elsewhere` process: the blocks read from stdin, run as the test runs a page here."""
    found = [Snippet(**fields) for fields in json.load(sys.stdin)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_snippets(found, name, restore=False)
    unexpected = [f"{w.category.__name__}: {w.message}" for w in caught if not issubclass(w.category, LIBRARY_NOTICES)]
    assert unexpected == [], unexpected


if __name__ == "__main__":
    _main(sys.argv[1])
