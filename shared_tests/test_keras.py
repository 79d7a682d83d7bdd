"""The Keras file (Keras/Multi_Head_Attention.py) on every Keras 3 backend, each in its own process.

One process per backend runs its cases, decode cases and checks at once
(shared_tests/keras_backends.py, shared_tests/keras_checks.py); the results are judged here
against the NumPy float64 reference by the parity report's own rules. TensorFlow and torch run
the whole case table and every decode case. JAX compiles every case's gradient and every decode
step (`jax.jit`), about a second each on the 2-core CI machine, so here it runs a trimmed table
that still holds every variant, mask kind, dtype and cache feature; `make parity` runs it all.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from shared_tests import frameworks, parity
from shared_tests.cases import CASES, CASES_BY_NAME, make_data
from shared_tests.decoding import DECODE_CASES, DECODE_CASES_BY_NAME, make_decode_data
from shared_tests.keras_backends import KERAS_BACKENDS, run_batch
from shared_tests.keras_paths import JAX_CASES

JAX_DECODE_CASES = ("decode_rolling_rope_left_padding", "decode_all_variants")
CHECKS = (
    "fit", "dropout", "mask_alias", "implicit_mask", "mask_warnings", "while_loop_decode", "mixed_precision",
    "clip_qkv", "window_pair", "attention_chunk", "rope_sections", "qk_norm_variants", "memory_efficient",
    "memory_efficient_dropout", "fused", "mla", "sharing",
)  # fmt: skip
INT8_CHECKS = ("int8_parity", "int8_model_quantize", "int8_decoding", "int8_fit", "int8_layout_checks")
INT8_CHECKS += ("int8_cache_integers",)  # the int8 KV cache's integers: exactly NumPy's
INT8_CHECKS += ("fp8_cache_values",)  # the fp8 KV cache's values: NumPy's codes, bit for bit


def _tables(backend):
    if backend != "jax":
        return CASES, DECODE_CASES
    return [CASES_BY_NAME[name] for name in JAX_CASES], [DECODE_CASES_BY_NAME[name] for name in JAX_DECODE_CASES]


def _failures(path, cases, results, compare, reference):
    """Each case's failures against the NumPy reference: `compare` and `reference` are the
    parity report's pair for full passes (`parity.compare`, `parity.run`) or decoding."""
    failures = []
    for case, data in cases:
        result = results[case.name]
        if isinstance(result, str):
            failures.append(f"{case.name}: raised {result}")
            continue
        row = compare(case, data, {"numpy": reference(case, data, "numpy"), path: result})
        failures += [f"{case.name}: {failure}" for failure in row.failures]
    return failures


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_every_case_decode_case_and_check_on_the_backend(backend):
    """Parity with NumPy (output, weights, gradients, exact zeros; decoding equal to the full pass
    and the caches equal), fit under XLA, seeded dropout, the mask alias, implicit masks, the
    mask warnings, decoding in `ops.while_loop` and mixed precision; on TensorFlow and torch, the
    built-ins' round trips; on JAX and torch, the TensorFlow file's refusal. The int8 checks
    (docs/SPEC.md, "int8") in the same process: the NumPy file's int8 layout imported gives the
    reference's output within one step (on JAX with its gradient under `jax.jit`) and quantizing
    gives that layout; the straight-through gradient; `model.quantize("int8")` and `.keras` save
    and load; decoding in `ops.while_loop` equal to the full pass; `fit` (under XLA on TensorFlow
    and JAX); the layout and mode checks."""
    cases, decode_cases = _tables(backend)
    cases = [(case, make_data(case)) for case in cases]
    decode_cases = [(case, make_decode_data(case)) for case in decode_cases]
    checks = CHECKS if backend == "jax" else (*CHECKS, "builtins")  # the same ops on every backend; JAX is slow
    checks = checks if backend == "jax" else (*checks, "float64")  # JAX without x64 has no float64
    checks = (*checks, *(("tensorflow_file_refuses",) if backend != "tensorflow" else ()), *INT8_CHECKS)
    out = run_batch(backend, cases, decode_cases, checks)
    path = f"keras:{backend}"
    failures = _failures(path, cases, out["cases"], parity.compare, parity.run)
    failures += _failures(path, decode_cases, out["decode"], parity.compare_decode, frameworks.run_decode)
    failures += [f"check {name}: {error}" for name, error in out["checks"].items() if error is not None]
    assert set(out["checks"]) == set(checks)
    assert not failures, "\n".join(failures)


def test_fit_under_torch_compile():
    """On torch, Keras compiles `fit`'s train step with `torch.compile` when asked
    (`jit_compile=True`); a process of its own, since compiling takes a minute or two."""
    out = run_batch("torch", checks=("fit_compiled",))
    assert out["checks"] == {"fit_compiled": None}, out["checks"]


def test_keras_file_moves_between_backends(tmp_path):
    """A `.keras` model saved on JAX loads on torch and TensorFlow with equal outputs, and the ones
    saved there load on JAX; the same for a model quantized to int8 (`model.quantize("int8")`).
    The three processes run side by side, each `load` waiting for the model it loads to be saved."""
    folders = {backend: str(tmp_path / backend) for backend in KERAS_BACKENDS}

    def both(kind, backend):
        return [f"{kind}:{folders[backend]}", f"{kind}_int8:{folders[backend]}"]

    steps = {
        "jax": [*both("save", "jax"), *both("load", "torch"), *both("load", "tensorflow")],
        "torch": [*both("save", "torch"), *both("load", "jax")],
        "tensorflow": [*both("save", "tensorflow"), *both("load", "jax")],
    }
    with ThreadPoolExecutor(len(steps)) as pool:
        outs = {backend: pool.submit(run_batch, backend, checks=checks) for backend, checks in steps.items()}
    for backend, checks in steps.items():
        out = outs[backend].result()
        failed = {name: error for name, error in out["checks"].items() if error is not None}
        assert set(out["checks"]) == set(checks) and not failed, f"{backend}: {failed}"


def test_a_wrong_keras_result_fails_its_column():
    """The Keras columns are judged: an output off by 1e-3 fails `keras:jax`."""
    case = CASES_BY_NAME["cross"]
    data = make_data(case)
    reference = parity.run(case, data, "numpy")
    wrong = parity.run(case, data, "numpy")
    wrong.output = wrong.output + np.where(np.arange(wrong.output.size).reshape(wrong.output.shape) == 0, 1e-3, 0.0)
    row = parity.compare(case, data, {"numpy": reference, "keras:jax": wrong})
    assert not row.passed
    assert any(failure.startswith("keras:jax output 1.00e-03") for failure in row.failures), row.failures


def test_report_shows_the_keras_columns(tmp_path, monkeypatch, capsys):
    """`--keras` adds a backend's column (the other paths left out here, for time)."""
    monkeypatch.setattr(parity, "PATHS", ("numpy",))
    monkeypatch.setattr(parity, "DECODE_PATHS", ("numpy",))
    monkeypatch.setattr(parity, "DYNAMIC_PATHS", ())
    out_json = tmp_path / "table.json"
    assert parity.main(["--case", "gqa", "--case", "decode_gqa", "--keras", "torch", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "keras:tensorflow" in printed and "keras:jax" in printed and "keras:torch" in printed
    for row in json.loads(out_json.read_text()):
        assert row["passed"] and row["diffs"]["keras:torch"]["output"] is not None, row
        assert row["diffs"]["keras:jax"]["output"] is None
    assert parity.main(["--case", "gqa", "--keras", "theano"]) == 2
    assert "--keras takes tensorflow, jax, torch" in capsys.readouterr().err
