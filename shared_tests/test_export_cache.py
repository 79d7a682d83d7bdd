"""The parity report's export cache (shared_tests/runtimes.py, `kept_export`): a kept artifact is
read back instead of exported again, still run by its runtime, and a change of the layer file,
the case or its data gives another key."""

import dataclasses
import importlib.metadata
import re

import numpy as np
import pytest

from shared_tests import frameworks, keras_backends, runtimes
from shared_tests.cases import CASES_BY_NAME, make_data
from shared_tests.tf_runner import make_tf_layer
from shared_tests.torch_runner import make_torch_layer

CASE = "self_basic"


@pytest.fixture
def cache(tmp_path):
    return tmp_path


def test_a_kept_export_is_read_back_not_exported_again(cache):
    case, calls = CASES_BY_NAME[CASE], []

    def export():
        calls.append(1)
        return b"artifact"

    data = make_data(case)
    assert runtimes.kept_export("torch:onnx", case, data, export, cache) == b"artifact"
    assert runtimes.kept_export("torch:onnx", case, data, export, cache) == b"artifact"
    assert len(calls) == 1 and len(list(cache.iterdir())) == 1
    runtimes.kept_export("torch:onnx", case, data, export, None)  # no folder: exported every time
    assert len(calls) == 2 and len(list(cache.iterdir())) == 1


@pytest.mark.parametrize(("path", "make_layer"), [("torch:onnx", make_torch_layer), ("tf:litert", make_tf_layer)])
def test_a_kept_export_runs_in_its_runtime_and_gives_the_same_results(cache, path, make_layer):
    case = CASES_BY_NAME[CASE]
    data = make_data(case)
    made = runtimes.run(case, data, path, make_layer, cache=cache)
    assert len(list(cache.iterdir())) == 1

    def no_layer(case, data):
        raise AssertionError("exported again although the export is kept")

    kept = runtimes.run(case, data, path, no_layer, cache=cache)
    for first, second in zip(made, kept, strict=True):
        np.testing.assert_array_equal(first, second)


def test_a_planted_layer_class_is_never_kept(cache):
    """A test's own layer class (a planted bug) exports afresh: its export is not the file's."""
    from PyTorch import MultiHeadAttention

    class Planted(MultiHeadAttention):
        pass

    case = CASES_BY_NAME[CASE]
    frameworks.run(case, make_data(case), "torch:onnx", torch_class=Planted, export_cache=cache)
    assert list(cache.iterdir()) == []


def test_the_key_changes_with_the_layer_file_the_case_and_the_data(tmp_path, monkeypatch):
    case = CASES_BY_NAME[CASE]
    data = make_data(case)
    key = runtimes.artifact_key("tf:onnx", case, data)
    assert runtimes.artifact_key("tf:onnx", case, data) == key
    assert runtimes.artifact_key("torch:onnx", case, data) != key
    assert runtimes.artifact_key("tf:onnx", dataclasses.replace(case, causal=not case.causal), data) != key
    moved = {**data, "weights": {**data["weights"], "query_kernel": data["weights"]["query_kernel"] + 1e-7}}
    assert runtimes.artifact_key("tf:onnx", case, moved) != key
    layer_file = tmp_path / "TensorFlow" / "Multi_Head_Attention.py"
    layer_file.parent.mkdir()
    layer_file.write_bytes((runtimes.ROOT / runtimes.LAYER_FILES["tf"]).read_bytes() + b"\n# changed\n")
    monkeypatch.setattr(runtimes, "ROOT", tmp_path)
    runtimes.fingerprint.cache_clear()
    try:
        assert runtimes.artifact_key("tf:onnx", case, data) != key
    finally:
        monkeypatch.undo()
        runtimes.fingerprint.cache_clear()


def test_the_key_names_the_installed_tensorflow_distribution():
    """Regression: TensorFlow installed as `tensorflow-cpu` was keyed as 'tensorflow=none', so
    an upgrade of TensorFlow (and its TFLite converter) reused the old tf:onnx and tf:litert exports."""
    import tensorflow as tf

    assert re.search(rf"\btensorflow(-cpu)?={re.escape(tf.__version__)}\b", runtimes.exporter_versions())


@pytest.mark.parametrize("distribution", ["tensorflow-cpu", "tf2onnx", "onnx", "onnxscript", "torch", "keras"])
def test_the_key_changes_with_an_exporters_version(monkeypatch, distribution):
    case = CASES_BY_NAME[CASE]
    data = make_data(case)
    path = "torch:onnx" if distribution in ("torch", "onnx", "onnxscript") else "tf:onnx"
    runtimes.fingerprint.cache_clear()
    key = runtimes.artifact_key(path, case, data)
    installed = importlib.metadata.version

    def upgraded(name):
        return "99.0" if name == distribution else installed(name)

    monkeypatch.setattr(importlib.metadata, "version", upgraded)
    runtimes.fingerprint.cache_clear()
    try:
        assert runtimes.artifact_key(path, case, data) != key
    finally:
        monkeypatch.undo()
        runtimes.fingerprint.cache_clear()


def test_the_keras_jax_process_reads_back_its_compiled_programs(tmp_path):
    """With a compile cache (the report's is out/exports/jax), a second JAX process compiles
    nothing that the first compiled: every kept program is read back, none written again, and
    the results are the same."""
    case = CASES_BY_NAME[CASE]
    data = make_data(case)

    def run_and_list():
        keras_backends.prefetch(["jax"], [(case, data)], compile_cache=tmp_path)
        try:
            result = keras_backends.result(case, data, "keras:jax")
        finally:
            keras_backends.stop()
        return result, {path.name: path.stat().st_mtime_ns for path in tmp_path.iterdir()}

    first, compiled = run_and_list()
    second, kept = run_and_list()
    assert compiled and kept == compiled
    for made, read in zip(dataclasses.astuple(first), dataclasses.astuple(second), strict=True):
        np.testing.assert_equal(made, read)
