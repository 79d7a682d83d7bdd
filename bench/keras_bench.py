"""The Keras 3 file against `keras.layers.MultiHeadAttention` on one backend, in this process.

`python -m bench.keras_bench BACKEND B T E N RUNS ROUNDS` sets KERAS_BACKEND before Keras is
imported (a backend is fixed at import, so bench/benchmark.py runs one process per backend) and
prints JSON: {mode: {"ours": [seconds of each round], "builtin": [...]}} for a forward pass
without weights, with weights, and a training step (forward + gradients of the weights). Each
backend runs the way its users run it: JAX under `jax.jit` (`stateless_call`), TensorFlow inside
`tf.function`, torch eagerly (forward under `torch.no_grad`). Then a T = 1 decoding step of ours
with a cache of L slots (JAX: under `jax.jit`), which the built-in cannot do.

Legend: B batch, T query length, S key/value length (S = T), E d_model, N num_heads, L cache slots.
"""

import json
import os
import sys

from bench.timing import rounds_of_times, tf_function_calls

MODES = ("forward", "forward+weights", "train step")
DECODE_WIDTH, DECODE_HEADS, DECODE_LENGTH = 256, 4, 1024  # the decoding step: E (at most), N, L


def _calls_jax(layer, x, ours, **options):
    """`options`: more arguments of our layer's call (`causal`)."""
    import jax
    import jax.numpy as jnp

    trainable = [v.value for v in layer.trainable_variables]
    fixed = [v.value for v in layer.non_trainable_variables]

    def forward(weights, trainable, training=False):
        kwargs = {"return_attention": weights, **options} if ours else {"return_attention_scores": weights}
        args = (x,) if ours else (x, x)
        result, _ = layer.stateless_call(trainable, fixed, *args, training=training, **kwargs)
        return result

    plain = jax.jit(lambda t: forward(False, t))
    with_weights = jax.jit(lambda t: forward(True, t))
    grads = jax.jit(jax.grad(lambda t: jnp.sum(forward(False, t, training=True))))
    return {
        "forward": lambda: plain(trainable).block_until_ready(),
        "forward+weights": lambda: [r.block_until_ready() for r in with_weights(trainable)],
        "train step": lambda: [g.block_until_ready() for g in grads(trainable)],
    }


def _calls_tensorflow(layer, x, ours, **options):
    def forward(weights, training=False):
        if ours:
            return layer(x, return_attention=weights, training=training, **options)
        return layer(x, x, return_attention_scores=weights, training=training)

    return tf_function_calls(forward, layer)


def _calls_torch(layer, x, ours, **options):
    import torch

    def forward(weights, training=False):
        if ours:
            return layer(x, return_attention=weights, training=training, **options)
        return layer(x, x, return_attention_scores=weights, training=training)

    def inference(weights):
        with torch.no_grad():
            forward(weights)

    def train():
        forward(False, training=True).sum().backward()

    return {"forward": lambda: inference(False), "forward+weights": lambda: inference(True), "train step": train}


def _decode_step(layer, backend, b, length, e):
    """A T = 1 step with L - 1 tokens in the cache: writes slot L - 1 and attends all L."""
    import keras
    import numpy as np

    x = keras.ops.convert_to_tensor(np.random.default_rng(1).standard_normal((b, 1, e)).astype("float32"))
    cache = layer.init_cache(b, length)
    cache = cache._replace(index=keras.ops.convert_to_tensor(length - 1, dtype=cache.index.dtype))
    if backend == "jax":
        import jax

        trainable = [v.value for v in layer.trainable_variables]
        fixed = [v.value for v in layer.non_trainable_variables]

        @jax.jit
        def step(x, cache):
            (output, new_cache), _ = layer.stateless_call(trainable, fixed, x, cache=cache, causal=True)
            return output, new_cache

        return lambda: step(x, cache)[0].block_until_ready()
    if backend == "tensorflow":
        import tensorflow as tf

        step = tf.function(lambda x, cache: layer(x, cache=cache, causal=True)[0])
        return lambda: step(x, cache).numpy()
    import torch

    def eager():
        with torch.no_grad():
            layer(x, cache=cache, causal=True)

    return eager


CALLS = {"jax": _calls_jax, "tensorflow": _calls_tensorflow, "torch": _calls_torch}  # by backend


def measure(backend, b, t, e, n, runs, rounds):
    """{mode: {"ours": [...], "builtin": [...]}} and {"decode": {"ours": [...]}}, seconds per round."""
    os.environ["KERAS_BACKEND"] = backend
    import keras
    import numpy as np

    from Keras import MultiHeadAttention

    x = keras.ops.convert_to_tensor(np.random.default_rng(0).standard_normal((b, t, e)).astype("float32"))
    ours = MultiHeadAttention(e, n)
    ours(x)
    builtin = ours.to_keras()
    builtin(x, x)
    build = CALLS[backend]
    calls = {"ours": build(ours, x, True), "builtin": build(builtin, x, False)}
    results = {}
    for mode in MODES:
        results[mode] = rounds_of_times({label: c[mode] for label, c in calls.items()}, runs, rounds)
    width = min(e, DECODE_WIDTH)
    decode_layer = MultiHeadAttention(width, DECODE_HEADS)
    decode_layer(x[:1, :1, :width])
    step = _decode_step(decode_layer, backend, 1, DECODE_LENGTH, width)
    results["decode"] = rounds_of_times({"ours": step}, runs * 6, rounds)
    return results


if __name__ == "__main__":
    backend, *numbers = sys.argv[1:]
    print(json.dumps(measure(backend, *(int(v) for v in numbers))))
