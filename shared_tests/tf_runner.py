"""The runner of the TensorFlow file (TensorFlow/Multi_Head_Attention.py): paths `tf:eager`,
`tf:function`, `tf:memory_efficient`, and the decode path `tf:in_place`.

`tf:memory_efficient` is a tf.function without weights returned, attention run two queries at a
time, forced on every case; its gradients come from the path's own backward. `tf:in_place`
decodes in a tf.function step over an in-place cache. The runtimes `tf:onnx` and `tf:litert`
are shared_tests/runtimes.py's.

Legend: B batch, T query length, S key/value length, E d_model, N num_heads, P tokens decoded
in all, L cache slots.
"""

import numpy as np

from shared_tests.call_args import call_inputs
from shared_tests.calling import INPUTS, DecodeResult, Result, as_numpy_cache, by_name, inputs, set_path
from shared_tests.decode_masks import chunk_mask, chunk_positions, full_pass_mask

MEMORY_EFFICIENT_CHUNK = 2  # queries per chunk on `tf:memory_efficient`: odd T leaves a padded chunk


def make_tf_layer(case, data, layer_class=None):
    from TensorFlow import MultiHeadAttention

    layer = (layer_class or MultiHeadAttention)(**case.config, dtype=case.dtype)
    layer.import_weights(data["weights"])
    return set_path(layer, case)


def traced_up_front(function):
    """A tf.function that traces through `get_concrete_function` before it is called. Each case
    builds its own function and traces it at its own shapes, on purpose; called directly, those
    traces (which TensorFlow counts per Python code, so across cases) are reported as retracing."""

    def call(*args):
        function.get_concrete_function(*args)
        return function(*args)

    return call


def run(case, data, path, layer_class=None):
    """The paths `tf:eager`, `tf:function` and `tf:memory_efficient` of the TensorFlow file (or `layer_class`)."""
    import tensorflow as tf

    layer = make_tf_layer(case, data, layer_class)
    weighted = path != "tf:memory_efficient"
    if not weighted:
        layer.memory_efficient_threshold = 0  # every case takes the memory-efficient path
        layer.query_chunk_elements = MEMORY_EFFICIENT_CHUNK * case.b * case.n * case.s
    args = [tf.constant(x, dtype=case.dtype) for x in inputs(data)]
    kwargs = {name: tf.constant(x) for name, x in call_inputs(data).items()}
    bias = kwargs.pop("attention_bias", None)
    variables = [layer._variable(name) for name in layer.weight_shapes()]

    def forward_and_grads(args, bias):
        with tf.GradientTape() as tape:
            tape.watch([*args, *([] if bias is None else [bias])])
            given = kwargs if bias is None else {**kwargs, "attention_bias": bias}
            query, kv = by_name(args)
            result = layer(*query, **kv, **given, causal=case.causal, return_attention=weighted)
            output, weights = result if weighted else (result, None)
            loss = tf.reduce_sum(tf.cast(output, tf.float32) * data["grad_output"])
        sources = [*args, *([] if bias is None else [bias]), *variables]
        grads = tape.gradient(loss, sources)
        # A source the loss never reached has gradient zero (tf gives None).
        return output, weights, [tf.zeros_like(x) if g is None else g for x, g in zip(sources, grads, strict=True)]

    step = forward_and_grads if path == "tf:eager" else traced_up_front(tf.function(forward_and_grads))
    output, weights, grads = step(args, bias)
    names = [*INPUTS[: len(args)], *([] if bias is None else ["attention_bias"]), *layer.weight_shapes()]
    as_numpy = {name: np.asarray(g.numpy(), dtype=np.float64) for name, g in zip(names, grads, strict=True)}
    return Result(
        np.asarray(output.numpy(), dtype=np.float64),
        None if weights is None else np.asarray(weights.numpy(), dtype=np.float64),
        as_numpy if case.tolerance["grads"] is not None else None,
    )


def decode(case, data, path):
    """A decode case on `tf:eager`, `tf:function` (one trace per distinct T) or `tf:in_place`."""
    import tensorflow as tf

    layer = make_tf_layer(case, data)
    in_place = path == "tf:in_place"

    def step(inputs, mask, cache, extra):
        result = layer(**inputs, **extra, attention_mask=mask, causal=case.causal, return_attention=True, cache=cache)
        return result[:2] if in_place else result  # an in-place cache is the one passed in, written

    step = step if path == "tf:eager" else traced_up_front(tf.function(step))  # one trace per distinct T
    keep = tf.constant(data["keep"])
    cache = layer.init_cache(case.b, case.length, keep=keep, dtype=case.cache_dtype, in_place=in_place)
    outputs, weights = [], []
    for start, stop in case.spans():
        chunk = {name: tf.constant(x[:, start:stop], dtype=case.dtype) for name, x in data["inputs"].items()}
        mask = chunk_mask(data["attention_mask"], start, stop)
        extra = {name: tf.constant(x) for name, x in chunk_positions(data, start, stop).items()}
        result = step(chunk, None if mask is None else tf.constant(mask), cache, extra)
        output, w, cache = (*result, cache) if in_place else result
        outputs.append(output)
        weights.append(w)
    inputs = {name: tf.constant(x, dtype=case.dtype) for name, x in data["inputs"].items()}
    extra = {name: tf.constant(x) for name, x in chunk_positions(data, 0, case.p).items()}
    full, full_w = layer(
        **inputs, **extra, attention_mask=tf.constant(full_pass_mask(case, data)), causal=case.causal,
        return_attention=True,
    )  # fmt: skip

    def to_numpy(tensor):
        array = tensor.numpy()
        return array.astype(np.float64) if tensor.dtype.is_floating else array

    return DecodeResult(
        to_numpy(tf.concat(outputs, 1)),
        to_numpy(tf.concat(weights, 2)),
        as_numpy_cache(cache, to_numpy),
        to_numpy(full),
        to_numpy(full_w),
    )
