"""The generated dtype runs of shared_tests/test_dtypes.py: one `Run` is a layer file (or the
Keras file on a backend), a dtype, float or int8 weights, a variant and a path; it runs through
the file's public API only (constructor, `import_weights`, `quantize`, `init_cache`, the call,
`memory_efficient_threshold` and `query_chunk_elements`) and is judged against the float64 NumPy
reference of the same portable weights.

The Keras file runs in the pytest process on TensorFlow; on JAX and torch `run_batch` runs a list
of runs in a process of that backend (`python -m shared_tests.dtypes BACKEND IN.pkl OUT.pkl`).

Legend: B batch, T query length, E d_model, N num_heads, K num_kv_heads, H head_dim.
"""

import dataclasses
import functools
import itertools
import os
import pickle
import subprocess
import sys
import tempfile

import numpy as np

from shared_tests.call_args import call_inputs
from shared_tests.cases import FLOAT64_TOLERANCES, MLA, TOLERANCES, Case, make_data
from shared_tests.int8 import FLIP_SHARE, numpy_layer, one_step

DTYPES = ("float16", "bfloat16", "float32", "float64")
# Causal self-attention, E = 64 (an int8 sum of 64 products of up to 127 * 127 passes float16's 65,504), B = 2, T = 5.
_BASE = {"e": 64, "n": 4, "b": 2, "t": 5, "s": 5, "self_attention": True, "causal": True}
VARIANTS = {
    "plain": Case("dtype_plain", **_BASE, mask="rows_masked"),  # a query row with no key: its merged heads are zeros
    "gqa": Case("dtype_gqa", **_BASE, k=2, key_mask=True),  # the last batch element keeps no key
    "mla": Case("dtype_mla", **_BASE, k=2, variants=(*MLA, ("q_lora_rank", 6), ("rope_theta", 10000.0))),
    "gate": Case("dtype_gate", **_BASE, k=2, variants=(("gate", True),)),
    "sinks": Case("dtype_sinks", **_BASE, variants=(("sinks", True), ("window", 3))),
    "softcap": Case("dtype_softcap", **_BASE, variants=(("softcap", 5.0),)),
    "rope": Case("dtype_rope", **_BASE, positions="shifted", variants=(("rope_theta", 10000.0),)),
    "qk_norm": Case("dtype_qk_norm", **_BASE, k=2, variants=(("qk_norm", "head"),)),
}
# Paths of each file. `explicit`: return_attention=True; `fused`: the default call (PyTorch: SDPA, or the
# soft-capped tiles); `blocks` (PyTorch): return_attention=True under no_grad, the in-place blocks in float32
# and float64; `memory_efficient` (TensorFlow, Keras): memory_efficient_threshold = 0, two queries a chunk;
# `decode`: T - 2 tokens into an `init_cache` cache of T + 3 slots, then one (PyTorch: the query alone under
# no_grad, the decode fast path), then the last with return_attention=True (over every slot); `compiled`: the
# default call in torch.compile (aot_eager), tf.function or jax.jit.
PATHS = {
    "torch": ("explicit", "fused", "blocks", "decode"),
    "tf": ("explicit", "fused", "memory_efficient", "decode"),
    "keras": ("explicit", "fused", "memory_efficient", "decode"),
}
COMPILED = "compiled"
FRAMEWORKS = ("torch", "tf", "keras:tensorflow", "keras:jax", "keras:torch")
UNWRITTEN = 3  # cache slots `decode` leaves unwritten (zeros, which every step reads but must not attend)
FLOAT16_HEADROOM = float(np.finfo(np.float16).max) / 2  # float32's intermediates of the drawn inputs stay below it


@dataclasses.dataclass(frozen=True)
class Run:
    framework: str  # one of FRAMEWORKS
    dtype: str
    int8: bool
    variant: str  # a key of VARIANTS
    path: str  # one of the framework's PATHS, or COMPILED

    @property
    def id(self):
        return f"{self.framework}-{self.dtype}-{'int8' if self.int8 else 'float'}-{self.variant}-{self.path}"

    @property
    def case(self):
        return dataclasses.replace(VARIANTS[self.variant], dtype=self.dtype)


def runs(framework, dtypes=DTYPES, paths=None, int8=(False, True), variants=tuple(VARIANTS)):
    """Every run of `framework` over the given dtypes, weights, variants and paths (its eager paths by default)."""
    paths = PATHS[framework.split(":")[0]] if paths is None else paths
    return [Run(framework, *combo) for combo in itertools.product(dtypes, int8, variants, paths)]


def paired(framework):
    """The runs of `framework` that hold every dtype with every variant and both weights, each
    (dtype, variant, weights) on one of its eager paths, in turn: every pair of a dtype, a
    variant or the weights with a path is there too (64 runs instead of the whole cross's 256)."""
    paths = PATHS[framework.split(":")[0]]
    return [
        Run(framework, dtype, int8, variant, paths[(i + j + 2 * int8) % len(paths)])
        for i, dtype in enumerate(DTYPES)
        for j, variant in enumerate(VARIANTS)
        for int8 in (False, True)
    ]


def drawn(frameworks, paths, count, seed):
    """`count` runs on `paths`, drawn with `seed` so that they spread over the dimensions: the
    i-th run takes the i-th framework of `frameworks` (in turn) and the i-th dtype, variant and
    path of an order shuffled for each dimension (every dtype, variant and path once `count`
    reaches their number), float or int8 weights at random."""
    rng = np.random.default_rng(seed)
    dimensions = (DTYPES, list(VARIANTS), paths)
    orders = [rng.permutation(len(values)) for values in dimensions]
    picked = []
    for i in range(count):
        dtype, variant, path = (values[order[i % len(order)]] for values, order in zip(dimensions, orders, strict=True))
        picked.append(Run(frameworks[i % len(frameworks)], dtype, bool(rng.integers(2)), variant, path))
    return picked


@functools.cache
def data(variant, int8):
    """The variant's seeded data (inputs N(0, 1), Glorot weights); with `int8`, the weights are the
    NumPy file's int8 layout of them (which every file imports as is)."""
    case = VARIANTS[variant]
    result = make_data(case, seed=48)
    if int8:
        layer = numpy_layer(case, result["weights"])
        layer.quantize("int8")
        result = {**result, "weights": layer.export_weights()}
    return result


def _call_kwargs(data, decode=False):
    """The call's arguments beside the query: the case's masks and positions (none when decoding)."""
    return {"causal": True} if decode else {**call_inputs(data), "causal": True}


@functools.cache
def reference(variant, int8, decode):
    """(float64 output (B, T, E), one quantization step or 0.0, largest float32 intermediate) of the
    NumPy reference: the full pass with the case's masks and positions, or without them (`decode`:
    what decoding the T tokens one chunk after another equals)."""
    case, given = VARIANTS[variant], data(variant, int8)
    layer = numpy_layer(case, given["weights"])
    kwargs = {name: np.asarray(x) for name, x in _call_kwargs(given, decode).items()}
    output = layer(given["query"].astype(np.float64), **kwargs)
    return output, one_step(layer) if int8 else 0.0, _largest_intermediate(case, given)


def _largest_intermediate(case, given):
    """A bound of float32's intermediates before the softmax (which runs in float32 at least): the
    inputs, each projection of them, and the scores |q| |k| * H**-0.5 bounded by H * max|q| * max|k|
    (int8 integer sums, which run in float32 whatever the dtype, are not among them)."""
    x = np.abs(given["query"]).max()
    weights = given["weights"]
    projected = [  # an int8 kernel dequantized
        np.abs(given["query"] @ (np.asarray(kernel, np.float64) * weights.get(f"{name}_scale", 1.0))).max()
        for name, kernel in weights.items()
        if name.endswith("_kernel") and np.shape(kernel)[0] == case.e
    ]
    head = case.h or case.e // case.n
    return float(max(x, *projected, head * max(projected) ** 2))


def tolerance(run):
    """The SPEC's output tolerance of the run's dtype against NumPy (float64: `FLOAT64_TOLERANCES`,
    RoPE's row where the case rotates: its angles are float32)."""
    case = run.case
    if run.dtype == "float64":
        return FLOAT64_TOLERANCES["rope" if "rope_theta" in case.config else "plain"]["output"] * case.scale
    return TOLERANCES[run.dtype]["output"] * case.scale


def judge(run, output):
    """What is wrong with the run's output against the NumPy reference, or None. Float weights:
    within the dtype's tolerance. int8: within one quantization step of it plus the dtype's
    tolerance; in float32 and float64 also at most FLIP_SHARE of the outputs beyond the tolerance
    (shared_tests/int8.py's rule). In float16 and bfloat16 the inputs are rounded before they are
    quantized, which flips the rounding of many tokens (2 to 4% of the outputs beyond float16's
    tolerance, each within a step): there the step alone is the bar."""
    expected, step, largest = reference(run.variant, run.int8, run.path == "decode")
    assert largest < FLOAT16_HEADROOM, f"{run.id}: drawn inputs reach {largest:.3g} in float32"
    output = np.asarray(output, dtype=np.float64)
    if output.shape != expected.shape:
        return f"{run.id}: shape {output.shape}, expected {expected.shape}"
    if not np.isfinite(output).all():
        return f"{run.id}: {np.size(output) - np.isfinite(output).sum()} of {np.size(output)} outputs not finite"
    difference, bar = np.abs(output - expected), tolerance(run)
    worst = difference.max(initial=0.0)
    if worst > step + bar:
        what = "a step and the tolerance" if run.int8 else "the tolerance"
        return f"{run.id}: differs by {worst:.2e}, more than {what} {step + bar:.2e}"
    flipped = np.mean(difference > bar)
    if run.int8 and run.dtype in ("float32", "float64") and flipped > FLIP_SHARE:
        return f"{run.id}: {flipped:.1%} of the outputs beyond the tolerance {bar:.1e}"
    return None


# The runs themselves, in this process.


def run_one(run):
    """The run's output as a float64 NumPy array (B, T, E)."""
    framework = run.framework.split(":")[0]
    return {"torch": _run_torch, "tf": _run_keras_like, "keras": _run_keras_like}[framework](
        run, data(run.variant, run.int8)
    )


def _run_torch(run, given):
    import torch

    from PyTorch import MultiHeadAttention

    case, dtype = run.case, getattr(torch, run.dtype)
    layer = MultiHeadAttention(**case.config, dtype=dtype).eval()
    layer.import_weights(given["weights"])
    query = torch.tensor(given["query"], dtype=dtype)
    kwargs = {name: torch.as_tensor(x) for name, x in call_inputs(given).items()}
    if run.path == "decode":
        with torch.no_grad():  # the query alone, under no_grad: the decode fast path where it applies
            cache = layer.init_cache(case.b, case.t + UNWRITTEN)
            first, cache = layer(query[:, :-2], causal=True, cache=cache)
            step, cache = layer(query[:, -2:-1], causal=True, cache=cache)
            last, _, cache = layer(query[:, -1:], causal=True, cache=cache, return_attention=True)  # all L slots
        return torch.cat([first, step, last], 1).double().numpy()
    if run.path == COMPILED:
        call = torch.compile(lambda q: layer(q, **kwargs, causal=True), backend="aot_eager", fullgraph=True)
        return call(query).detach().double().numpy()
    if run.path == "blocks":
        with torch.no_grad():
            return layer(query, **kwargs, causal=True, return_attention=True)[0].double().numpy()
    result = layer(query, **kwargs, causal=True, return_attention=run.path == "explicit")  # autograd on
    return (result[0] if run.path == "explicit" else result).detach().double().numpy()


def _run_keras_like(run, given):
    """The TensorFlow file, or the Keras file on this process's backend."""
    import keras
    from keras import ops

    if run.framework == "tf":
        from TensorFlow import MultiHeadAttention
    else:
        from Keras import MultiHeadAttention
    case = run.case
    layer = MultiHeadAttention(**case.config, dtype=run.dtype, kernel_initializer="zeros")  # replaced next
    layer.import_weights(given["weights"])
    query = ops.convert_to_tensor(given["query"], dtype=run.dtype)
    kwargs = {name: ops.convert_to_tensor(x) for name, x in call_inputs(given).items()}
    if run.path == "decode":
        cache = layer.init_cache(case.b, case.t + UNWRITTEN)
        first, cache = layer(query[:, :-2], causal=True, cache=cache)
        step, cache = layer(query[:, -2:-1], causal=True, cache=cache)
        last, _, cache = layer(query[:, -1:], causal=True, cache=cache, return_attention=True)
        return _numpy(ops.concatenate([first, step, last], axis=1))
    if run.path == "memory_efficient":
        layer.memory_efficient_threshold = 0  # every call takes the memory-efficient path
        layer.query_chunk_elements = 2 * case.b * case.n * case.s  # two queries a chunk: T = 5 leaves a padded one
    if run.path == COMPILED:
        backend = keras.backend.backend() if run.framework.startswith("keras") else "tensorflow"
        return _numpy(_compiled(backend, lambda q: layer(q, **kwargs, causal=True))(query))
    result = layer(query, **kwargs, causal=True, return_attention=run.path == "explicit")
    return _numpy(result[0] if run.path == "explicit" else result)


def _compiled(backend, call):
    if backend == "jax":
        import jax

        return jax.jit(call)
    if backend == "torch":
        import torch

        return torch.compile(call, backend="aot_eager")
    import tensorflow as tf

    return tf.function(call)


def _numpy(tensor):
    import keras
    from keras import ops

    wide = "float64" if keras.backend.standardize_dtype(tensor.dtype) == "float64" else "float32"
    return ops.convert_to_numpy(ops.cast(tensor, wide)).astype(np.float64)  # NumPy has no bfloat16


def outcome(run):
    """(output, None) of a run, or (None, the error's text) where it raised."""
    try:
        return run_one(run), None
    except Exception as error:  # each run is reported, with what it raised
        return None, f"{type(error).__name__}: {str(error).strip()[:400]}"


# The Keras file on another backend: a list of runs in a process of its own.


def run_batch(backend, batch, timeout=600):
    """{run id: (output, error)} of `batch` (runs of `keras:<backend>`) in a `KERAS_BACKEND=backend` process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as folder:
        given, out = os.path.join(folder, "in.pkl"), os.path.join(folder, "out.pkl")
        with open(given, "wb") as handle:
            pickle.dump(list(batch), handle)
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "shared_tests.dtypes", backend, given, out]
        finished = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
        if finished.returncode != 0:
            raise RuntimeError(f"the {backend} process exited {finished.returncode}: {finished.stderr[-3000:]}")
        with open(out, "rb") as handle:
            return pickle.load(handle)


def _main(backend, given, out):
    import keras

    if keras.backend.backend() != backend:
        raise SystemExit(f"KERAS_BACKEND={backend} expected, Keras runs on {keras.backend.backend()}")
    if backend == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)  # float64 on JAX (SPEC, Numerics); float32 stays float32
    with open(given, "rb") as handle:
        batch = pickle.load(handle)
    results = {run.id: outcome(run) for run in batch}
    with open(out, "wb") as handle:
        pickle.dump(results, handle)


if __name__ == "__main__":
    _main(*sys.argv[1:])
