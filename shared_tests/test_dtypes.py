"""Generated dtype tests: float16, bfloat16, float32 and float64, crossed with float and int8
weights, the variants (plain with a query row that keeps no key, GQA with a batch element that
keeps none, MLA, the output gate, sinks with a window, soft-capping, RoPE, QK-norm) and the paths
(explicit, fused, PyTorch's blocks or the memory-efficient path, decoding with the cache, and
compiled), each run through the files' public API (shared_tests/dtypes.py).

Every run's output is finite and within the SPEC's tolerance of its dtype of the float64 NumPy
reference (int8: within one quantization step, shared_tests/int8.py's rule); the drawn inputs
keep float32's intermediates within half of float16's range, so a non-finite number is a step
that ran narrower than float32 (docs/SPEC.md, Numerics: the integer sums, the softmax, the norms).

PyTorch runs the whole cross of its eager paths in every dtype. TensorFlow and the Keras file on
TensorFlow run every (dtype, variant, weights), each on one of their eager paths in turn, which
holds every pair of a path with a dtype, a variant or the weights (`paired`). Compiled runs
(torch.compile, tf.function) and the Keras file on JAX (jax.jit for its compiled runs) and on
torch (each in a process of its own) are drawn: `drawn` spreads them over every dtype, variant
and path. The hypothesis profile sets how much: "ci" (the default) draws the same runs every
time; `--hypothesis-profile=explore` runs the whole cross on TensorFlow and Keras too and draws
ten times as many runs from a new seed, which a failure names (`DTYPES_SEED=<seed>` draws them
again). Beside each draw run the `PINNED` runs of its framework: float16 and bfloat16 with int8
weights on every framework that the draw alone might miss (the integer sums in float32 whatever
the dtype), and runs that found a defect.
"""

import os

import numpy as np
import pytest
from hypothesis import settings

from shared_tests import dtypes
from shared_tests.dtypes import COMPILED, DTYPES, PATHS, VARIANTS, drawn, judge, outcome, paired, run_batch, runs

IN_PROCESS = ("torch", "tf", "keras:tensorflow")
DRAWN = 3, 5  # runs drawn under the "ci" profile (25 examples): compiled ones per file, on each other Keras backend
# The Keras file's paths on JAX and torch. torch.compile of the Keras file took 15 s a run on the 2-core
# machine (test_keras.py compiles its `fit` on torch): drawn on JAX only, in jax.jit.
KERAS_PATHS = {"jax": (*PATHS["keras"], COMPILED), "torch": PATHS["keras"]}
# Run beside each draw of their framework's test: runs that found a defect, and float16 and bfloat16 with int8
# (Keras refuses float16 with int8 in its own layers; `plain`'s query row with no key makes a zero token of the
# output projection) where the ci draw has none: with them every drawn test holds both (`HALF_INT8_DRAWN`).
PINNED = (
    dtypes.Run("keras:jax", "float64", False, "softcap", "explicit"),  # `ops.tanh` computed float64 in float32
    dtypes.Run("tf", "float16", True, "plain", COMPILED),
    dtypes.Run("tf", "bfloat16", True, "gqa", COMPILED),
    dtypes.Run("keras:tensorflow", "float16", True, "plain", COMPILED),
    dtypes.Run("keras:tensorflow", "bfloat16", True, "gqa", COMPILED),
    dtypes.Run("keras:jax", "float16", True, "plain", COMPILED),
    dtypes.Run("keras:torch", "float16", True, "plain", "fused"),
)
# The drawn tests of the TensorFlow and Keras files: (framework, paths drawn, runs drawn under "ci").
HALF_INT8_DRAWN = (
    ("tf", (COMPILED,), DRAWN[0]),
    ("keras:tensorflow", (COMPILED,), DRAWN[0]),
    *((f"keras:{backend}", paths, DRAWN[1]) for backend, paths in KERAS_PATHS.items()),
)


def _scale():
    """How many times the "ci" draw the profile asks for: its examples over ci's 25."""
    return max(1, settings.default.max_examples // 25)


def _seed():
    """ci's fixed seed, else $DTYPES_SEED or a new one."""
    if settings.default.derandomize and "DTYPES_SEED" not in os.environ:
        return 48
    return int(os.environ.get("DTYPES_SEED", np.random.SeedSequence().entropy % 2**32))


def _pinned(framework, paths, batch):
    """The `PINNED` runs of `framework` on `paths` that `batch` does not hold."""
    return [run for run in PINNED if run.framework == framework and run.path in paths and run not in batch]


def _failures(batch, outcome_of):
    """What went wrong in each run: an error, or `judge`'s finding."""
    failures = []
    for run in batch:
        output, error = outcome_of(run)
        problem = f"{run.id}: raised {error}" if error is not None else judge(run, output)
        if problem is not None:
            failures.append(problem)
    return failures


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("framework", IN_PROCESS)
def test_every_variant_path_and_weights_in_the_dtype(framework, dtype):
    """PyTorch: the whole cross in the dtype (float and int8 weights, every variant, every eager
    path). TensorFlow and the Keras file: every variant with both weights, each on one path in
    turn (`paired`); the whole cross under a larger profile (explore)."""
    whole = framework == "torch" or _scale() > 1
    batch = runs(framework, dtypes=(dtype,)) if whole else [run for run in paired(framework) if run.dtype == dtype]
    failures = _failures(batch, outcome)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("framework", IN_PROCESS)
def test_compiled_drawn(framework):
    """Drawn runs in torch.compile (aot_eager, fullgraph) or tf.function, and the `PINNED` ones."""
    seed = _seed()
    batch = drawn((framework,), (COMPILED,), DRAWN[0] * _scale(), seed)
    failures = _failures(batch + _pinned(framework, (COMPILED,), batch), outcome)
    assert not failures, f"seed {seed}:\n" + "\n".join(failures)


@pytest.mark.parametrize("backend", ("jax", "torch"))
def test_keras_file_on_another_backend_drawn(backend):
    """The Keras file on JAX (float64 with x64) and torch, in the backend's own process: drawn runs
    (every dtype and path among them), compiled ones in jax.jit, and the `PINNED` runs."""
    seed = _seed()
    batch = drawn((f"keras:{backend}",), KERAS_PATHS[backend], DRAWN[1] * _scale(), seed)
    batch += _pinned(f"keras:{backend}", KERAS_PATHS[backend], batch)
    results = run_batch(backend, batch)
    failures = _failures(batch, lambda run: results[run.id])
    assert not failures, f"seed {seed}:\n" + "\n".join(failures)


def test_the_designs_spread_over_every_dimension():
    """`paired` holds every (dtype, variant, weights) and every pair of one of them with a path;
    the ci draw of each Keras process holds every dtype and path, and no run twice."""
    for framework in ("tf", "keras:tensorflow"):
        design = paired(framework)
        assert {(r.dtype, r.variant, r.int8) for r in design} == {(r.dtype, r.variant, r.int8) for r in runs(framework)}
        for dimension in ("dtype", "variant", "int8"):
            pairs = {(getattr(r, dimension), r.path) for r in design}
            assert pairs == {(getattr(r, dimension), r.path) for r in runs(framework)}, dimension
    for backend, paths in KERAS_PATHS.items():
        batch = drawn((f"keras:{backend}",), paths, DRAWN[1], 48)
        assert {run.dtype for run in batch} == set(DTYPES)
        assert {run.path for run in batch} == set(paths)
        assert len({run.variant for run in batch}) == len(batch) == len({run.id for run in batch})
    for framework, paths, count in HALF_INT8_DRAWN:  # with the pinned runs: float16 and bfloat16 with int8
        batch = drawn((framework,), paths, count, 48)
        half_int8 = {run.dtype for run in batch + _pinned(framework, paths, batch) if run.int8}
        assert half_int8 >= {"float16", "bfloat16"}, (framework, half_int8)


def test_numpy_computes_float64_whatever_the_input_dtype():
    """The reference: float16 inputs (and an int8 layer) computed in float64, the same numbers."""
    for int8 in (False, True):
        given = dtypes.data("plain", int8)
        layer = dtypes.numpy_layer(VARIANTS["plain"], given["weights"])
        query, mask = given["query"].astype(np.float16), {"attention_mask": given["attention_mask"]}
        output = layer(query, **mask, causal=True)
        assert output.dtype == np.float64 and np.isfinite(output).all()
        np.testing.assert_array_equal(output, layer(query.astype(np.float64), **mask, causal=True))
