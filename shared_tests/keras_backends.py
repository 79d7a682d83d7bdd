"""The Keras file (Keras/Multi_Head_Attention.py) on each Keras 3 backend, one process per backend.

A Keras backend is fixed when Keras is imported, so each backend runs in a subprocess of its
own (`KERAS_BACKEND=...`): the parent pickles the cases and their data, the child runs them all
and pickles back one `Result` (or `DecodeResult`) per case, or the error it raised. The paths
are `keras:tensorflow`, `keras:jax` and `keras:torch`: an eager call with
`return_attention=True` and the gradients of sum(output * grad_output) with respect to the
inputs, `attention_bias` and every portable weight (`tf.GradientTape`, `jax.grad` over
`stateless_call`, torch autograd). Decode cases run chunk by chunk through the functional cache
(under `jax.jit` on JAX) and once as a full causal pass, as shared_tests/decoding.py does.

Run a child by hand: `KERAS_BACKEND=jax python -m shared_tests.keras_backends jax IN.pkl OUT.pkl`.
"""

import os
import pickle
import subprocess
import sys
import tempfile
import traceback

import numpy as np

from shared_tests.cases import call_inputs

KERAS_BACKENDS = ("tensorflow", "jax", "torch")
KERAS_PATHS = tuple(f"keras:{backend}" for backend in KERAS_BACKENDS)
# JAX compiles every case's gradient (about a second each on the 2-core CI machine): shared_tests/test_keras.py
# and the path checks of shared_tests/keras_checks.py run it this trimmed table, which still holds every
# variant, mask kind and dtype.
JAX_CASES = (
    "kdim_vdim", "mask_float_inf_row", "mask_float64_far", "rows_fully_masked", "bfloat16_gqa_masked",
    "attention_bias_bts_causal", "gemma2_like", "gpt_oss_like", "rope_yarn_gqa", "qk_norm_all",
    "clip_qkv_qk_norm_rope", "qwen3_next_like",
)  # fmt: skip
INPUTS = ("query", "key", "value")
SUBPROCESS_TIMEOUT = 900  # seconds for one backend's whole batch

_RESULTS = {}  # (path, case name, table) -> (data, Result or error text): filled by `prefetch`


class KerasBackendError(RuntimeError):
    """A case that raised inside a backend's process; the message is that error's."""


def run_batch(backend, cases=(), decode_cases=(), checks=(), workdir=None):
    """Runs (case, data) pairs, decode (case, data) pairs and named checks (`CHECKS`) on one
    backend in a subprocess; returns {"cases": {name: Result or error text}, "decode": ...,
    "checks": {name: error text or None}}."""
    with tempfile.TemporaryDirectory(dir=workdir) as folder:
        given, received = os.path.join(folder, "in.pkl"), os.path.join(folder, "out.pkl")
        with open(given, "wb") as handle:
            pickle.dump({"cases": list(cases), "decode": list(decode_cases), "checks": list(checks)}, handle)
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "shared_tests.keras_backends", backend, given, received]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=root)
        if done.returncode != 0 or not os.path.exists(received):
            raise KerasBackendError(f"the {backend} process exited {done.returncode}: {done.stderr[-3000:]}")
        with open(received, "rb") as handle:
            return pickle.load(handle)


def prefetch(backends, cases=(), decode_cases=()):
    """Runs every (case, data) and decode (case, data) pair on each backend, one process per
    backend, and keeps the results for `result` and `decode_result`."""
    for backend in backends:
        path = f"keras:{backend}"
        try:
            out = run_batch(backend, cases, decode_cases)
        except (KerasBackendError, subprocess.TimeoutExpired) as error:
            out = {"cases": dict.fromkeys((c.name for c, _ in cases), str(error))}
            out["decode"] = dict.fromkeys((c.name for c, _ in decode_cases), str(error))
        for table, pairs in (("cases", cases), ("decode", decode_cases)):
            for case, data in pairs:
                _RESULTS[(path, case.name, table)] = (data, out[table][case.name])


def _kept(path, case, data, table):
    """The result `prefetch` kept for this case and these very data, or one computed now."""
    kept = _RESULTS.get((path, case.name, table))
    if kept is None or kept[0] is not data:
        batch = run_batch(path.split(":")[1], **{"cases" if table == "cases" else "decode_cases": [(case, data)]})
        kept = (data, batch[table][case.name])
    if isinstance(kept[1], str):
        raise KerasBackendError(kept[1])
    return kept[1]


def result(case, data, path):
    """The `Result` of one case on one `keras:<backend>` path."""
    return _kept(path, case, data, "cases")


def decode_result(case, data, path):
    """The `DecodeResult` of one decode case on one `keras:<backend>` path."""
    return _kept(path, case, data, "decode")


# In the backend's process.


def _to_numpy(x):
    from keras import ops

    array = ops.convert_to_numpy(x)
    return (
        array.astype(np.float64) if np.issubdtype(array.dtype, np.floating) or array.dtype.name == "bfloat16" else array
    )


def _tensor(x, dtype=None):
    from keras import ops

    return ops.convert_to_tensor(x, dtype=dtype)


def _layer(case, data):
    from Keras import MultiHeadAttention

    layer = MultiHeadAttention(**case.config, dtype=case.dtype)
    layer.import_weights(data["weights"])
    return layer


def _forward(layer, case, args, kwargs, weighted=True):
    """(output, weights), weights None when not `weighted` (a call without `return_attention`)."""
    query, kv = args[:1], dict(zip(INPUTS[1:], args[1:], strict=False))
    result = layer(*query, **kv, **kwargs, causal=case.causal, return_attention=weighted)
    return result if weighted else (result, None)


def _case_result(case, data, path=None):
    """Output, weights and (float32 cases) gradients of one case on this process's backend. `path`,
    a function of the layer, sets a path up: the call then returns no weights (`weights` None)."""
    import keras

    from shared_tests.frameworks import Result

    layer = _layer(case, data)
    if path is not None:
        path(layer)
    weighted = path is None
    args = [_tensor(data[name], case.dtype) for name in INPUTS if data[name] is not None]
    kwargs = {name: _tensor(x) for name, x in call_inputs(data).items()}
    if case.tolerance["grads"] is None:
        output, weights = _forward(layer, case, args, kwargs, weighted)
        return Result(_to_numpy(output), weights if weights is None else _to_numpy(weights), None)
    gradient = {"tensorflow": _grads_tensorflow, "jax": _grads_jax, "torch": _grads_torch}[keras.backend.backend()]
    output, weights, grads = gradient(layer, case, data, args, kwargs, weighted)
    grads = {name: _to_numpy(g) for name, g in grads.items()}
    return Result(_to_numpy(output), weights if weights is None else _to_numpy(weights), grads)


def _names(args, bias, layer):
    return [*INPUTS[: len(args)], *([] if bias is None else ["attention_bias"]), *layer.weight_shapes()]


def _grads_tensorflow(layer, case, data, args, kwargs, weighted):
    import tensorflow as tf

    bias = kwargs.pop("attention_bias", None)
    variables = [layer._variable(name).value for name in layer.weight_shapes()]
    with tf.GradientTape() as tape:
        tape.watch([*args, *([] if bias is None else [bias])])
        given = kwargs if bias is None else {**kwargs, "attention_bias": bias}
        output, weights = _forward(layer, case, args, given, weighted)
        loss = tf.reduce_sum(tf.cast(output, tf.float32) * data["grad_output"])
    sources = [*args, *([] if bias is None else [bias]), *variables]
    grads = tape.gradient(loss, sources)
    grads = [tf.zeros_like(x) if g is None else g for x, g in zip(sources, grads, strict=True)]
    return output, weights, dict(zip(_names(args, bias, layer), grads, strict=True))


def _grads_jax(layer, case, data, args, kwargs, weighted):
    import jax
    import jax.numpy as jnp

    bias = kwargs.pop("attention_bias", None)
    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]
    variables = [layer._variable(name) for name in layer.weight_shapes()]
    trainable_ids = [id(v) for v in layer.trainable_variables]
    order = [trainable_ids.index(id(v)) if id(v) in trainable_ids else None for v in variables]  # int8: not trainable

    def loss(args, bias, trainable):
        given = kwargs if bias is None else {**kwargs, "attention_bias": bias}
        query, kv = args[:1], dict(zip(INPUTS[1:], args[1:], strict=False))
        result, _ = layer.stateless_call(
            trainable, non_trainable, *query, **kv, **given, causal=case.causal, return_attention=weighted
        )
        output, weights = result if weighted else (result, None)
        return jnp.sum(output.astype(jnp.float32) * data["grad_output"]), (output, weights)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))  # one compile, not one per op
    (_, (output, weights)), grads = step(args, bias, trainable)
    d_args, d_bias, d_trainable = grads
    d_weights = [jnp.zeros(v.shape) if i is None else d_trainable[i] for i, v in zip(order, variables, strict=True)]
    values = [*d_args, *([] if bias is None else [d_bias]), *d_weights]  # int8 kernels and scales: zeros
    return output, weights, dict(zip(_names(args, bias, layer), values, strict=True))


def _grads_torch(layer, case, data, args, kwargs, weighted):
    import torch

    args = [x.detach().requires_grad_(True) for x in args]
    bias = kwargs.pop("attention_bias", None)
    bias = None if bias is None else bias.detach().requires_grad_(True)
    given = kwargs if bias is None else {**kwargs, "attention_bias": bias}
    output, weights = _forward(layer, case, args, given, weighted)
    (output.float() * torch.as_tensor(data["grad_output"], device=output.device)).sum().backward()
    sources = [*args, *([] if bias is None else [bias]), *(layer._variable(n).value for n in layer.weight_shapes())]
    grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in sources]
    return output, weights, dict(zip(_names(args, bias, layer), grads, strict=True))


def _decode_result(case, data):
    """Decodes one case chunk by chunk (each step under `jax.jit` on JAX), then one full pass."""
    import keras
    from keras import ops

    from shared_tests.decoding import DecodeResult, chunk_mask, chunk_positions, full_pass_mask

    layer = _layer(case, data)
    step = _jitted_step(layer, case) if keras.backend.backend() == "jax" else None
    cache = layer.init_cache(case.b, case.length, keep=_tensor(data["keep"]))
    outputs, weights = [], []
    for start, stop in case.spans():
        chunk = {name: _tensor(x[:, start:stop], case.dtype) for name, x in data["inputs"].items()}
        mask = chunk_mask(data["attention_mask"], start, stop)
        extra = {name: _tensor(x) for name, x in chunk_positions(data, start, stop).items()}
        mask = None if mask is None else _tensor(mask)
        if step is None:
            output, w, cache = layer(
                **chunk, **extra, attention_mask=mask, causal=case.causal, return_attention=True, cache=cache
            )
        else:
            output, w, cache = step(chunk, mask, cache, extra)
        outputs.append(output)
        weights.append(w)
    inputs = {name: _tensor(x, case.dtype) for name, x in data["inputs"].items()}
    extra = {name: _tensor(x) for name, x in chunk_positions(data, 0, case.p).items()}
    full, full_w = layer(
        **inputs, **extra, attention_mask=_tensor(full_pass_mask(case, data)), causal=case.causal,
        return_attention=True,
    )  # fmt: skip
    caches = {name: _to_numpy(getattr(cache, name)) for name in ("key", "value", "keep", "index")}
    return DecodeResult(
        _to_numpy(ops.concatenate(outputs, 1)), _to_numpy(ops.concatenate(weights, 2)), caches,
        _to_numpy(full), _to_numpy(full_w),
    )  # fmt: skip


def _jitted_step(layer, case):
    """One decode step under `jax.jit`, through `stateless_call` (the weights passed in)."""
    import jax

    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]

    @jax.jit
    def step(trainable, chunk, mask, cache, extra):
        outputs, _ = layer.stateless_call(
            trainable, non_trainable, **chunk, **extra, attention_mask=mask, causal=case.causal,
            return_attention=True, cache=cache,
        )  # fmt: skip
        return outputs

    return lambda chunk, mask, cache, extra: step(trainable, chunk, mask, cache, extra)


def _run_each(pairs, run_one):
    """{case name: result, or the text of the error it raised}."""
    results = {}
    for case, data in pairs:
        try:
            results[case.name] = run_one(case, data)
        except Exception as error:  # the report goes on; the row says what this case raised
            lines = str(error).strip().splitlines()
            results[case.name] = f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
            print(traceback.format_exc(), file=sys.stderr)
    return results


def _run_checks(names):
    """{check name: None when it held, else what failed} (shared_tests/keras_checks.py)."""
    results = {}
    for name in names:
        try:
            from shared_tests import keras_checks

            keras_checks.run(name)
            results[name] = None
        except Exception as error:  # every check is reported, each with what it raised
            results[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    return results


def main(argv):
    backend, given, received = argv
    import keras

    if keras.backend.backend() != backend:
        raise SystemExit(f"KERAS_BACKEND={backend} expected, Keras runs on {keras.backend.backend()}")
    with open(given, "rb") as handle:
        task = pickle.load(handle)
    out = {
        "cases": _run_each(task["cases"], _case_result),
        "decode": _run_each(task["decode"], _decode_result),
        "checks": _run_checks(task["checks"]),
    }
    with open(received + ".part", "wb") as handle:
        pickle.dump(out, handle)
    os.replace(received + ".part", received)


if __name__ == "__main__":
    main(sys.argv[1:])
