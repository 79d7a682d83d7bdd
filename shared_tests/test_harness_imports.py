"""The harness imports downward only (docs/design.md, The harness's layers): no import cycle among
the modules of shared_tests/ and bench/, and no module reaching into another's private names.

Static: every `import` and `from ... import` of each file is read with `ast`, those inside
functions included (a lazy import is a dependency too); nothing is imported.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("shared_tests", "bench")


def module_files():
    """{"shared_tests.parity": its path, ...} for every module of the harness's packages."""
    return {
        f"{package}.{path.stem}": path
        for package in PACKAGES
        for path in sorted((ROOT / package).glob("*.py"))
        if path.stem != "__init__"
    }


def _imports(tree, modules):
    """[(module imported, name taken from it or None, line)] of one file's harness imports,
    and {local name: module} of the names bound to a harness module."""
    found, bound = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.append((alias.name, None, node.lineno))
                    bound[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                as_module = f"{node.module}.{alias.name}"
                if as_module in modules:  # from shared_tests import parity
                    found.append((as_module, None, node.lineno))
                    bound[alias.asname or alias.name] = as_module
                elif node.module in modules:  # from shared_tests.parity import run_case
                    found.append((node.module, alias.name, node.lineno))
    return found, bound


def _private_uses(tree, found, bound, name):
    """`module: line: what` for each private name of another harness module this file uses."""
    uses = [
        f"{name}:{line}: from {module} import {taken}"
        for module, taken, line in found
        if _private(taken) and module != name
    ]
    for node in ast.walk(tree):
        reached = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
        if reached and _private(node.attr) and bound[node.value.id] != name:
            uses.append(f"{name}:{node.lineno}: {bound[node.value.id]}.{node.attr}")
    return uses


def _private(name):
    return name is not None and name.startswith("_") and not re.fullmatch(r"__\w+__", name)


def import_graph():
    """({module: {modules it imports}}, [private names reached into])."""
    modules = module_files()
    graph, private = {}, []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        found, bound = _imports(tree, modules)
        graph[name] = {module for module, _, _ in found if module != name}
        private += _private_uses(tree, found, bound, name)
    return graph, private


def find_cycle(graph):
    """One import cycle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state, stack = dict.fromkeys(graph, 0), []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if state.get(nxt) == 0 and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if state[node] == 0 and (cycle := visit(node)):
            return cycle
    return None


def test_the_harness_has_no_import_cycle():
    graph, _ = import_graph()
    assert len(graph) > 20, sorted(graph)  # the packages were found
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_reaches_into_another_modules_private_names():
    _, private = import_graph()
    assert private == [], "\n".join(private)


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": {"b", "c"}, "c": set()}, ["b", "b"]),
    ],
)
def test_find_cycle_finds_a_cycle_and_only_one(graph, expected):
    assert find_cycle(graph) == expected


def test_regression_keras_backends_and_keras_checks_imported_each_other(tmp_path, monkeypatch):
    """keras_backends imported keras_checks (to run its checks) and keras_checks imported
    keras_backends' private `_case_result`: both a cycle and a private name, each found."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "shared_tests" / "keras_backends.py").write_text(
        "def run():\n    from shared_tests import keras_checks\n"
    )
    (tmp_path / "shared_tests" / "keras_checks.py").write_text("from shared_tests.keras_backends import _case_result\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    graph, private = import_graph()
    assert find_cycle(graph) == [
        "shared_tests.keras_backends",
        "shared_tests.keras_checks",
        "shared_tests.keras_backends",
    ]
    assert private == ["shared_tests.keras_checks:1: from shared_tests.keras_backends import _case_result"]


def test_regression_the_tests_sharing_a_subprocess_never_ran_in_one_xdist_worker():
    """pytest-xdist 3.8 groups its `xdist_group` mark by renaming each test's `_nodeid`, which pytest
    9 no longer reads: the groups never formed, and test_distributed's module fixtures (a minute of
    JAX each) and keras_seams' process per backend ran in both workers. conftest's scheduler makes
    each group one work unit from the test ids."""
    from types import SimpleNamespace

    from shared_tests import conftest

    def unit(nodeid):
        return conftest.SharedProcessScheduling._split_scope(None, nodeid)

    assert unit("shared_tests/test_distributed.py::test_keras_data_parallel_equals_one_device") == "distributed"
    assert unit("shared_tests/test_distributed.py::test_keras_model_parallel_equals_one_device[mha_4]") == "distributed"
    assert unit("shared_tests/test_serving.py::test_decoding_reads_the_cache_it_is_fed") == "serving"
    for backend in ("tensorflow", "jax", "torch"):
        for nodeid in (
            f"shared_tests/test_seams.py::test_regression_keras_file_warned_at_its_own_line[{backend}]",
            f"shared_tests/test_seam_properties.py::test_keras_file_symbolic_shapes_hold[{backend}]",
        ):
            assert unit(nodeid) == f"keras_seams_{backend}"
    for alone in (
        "shared_tests/test_seam_properties.py::test_attention_mask_warnings_name_the_callers_line[torch]",
        "shared_tests/test_seams.py::test_regression_attention_mask_warning_named_torch[keras]",
        "shared_tests/test_keras.py::test_every_case_decode_case_and_check_on_the_backend[jax]",
    ):
        assert unit(alone) == alone
    assert conftest.pytest_xdist_make_scheduler(SimpleNamespace(getvalue={"dist": "load"}.get), None) is None
