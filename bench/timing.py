"""Timing shared by the benchmarks: medians of interleaved runs, in rounds, and their ratios.

The base of bench/: bench/benchmark.py, bench/keras_bench.py and bench/cuda.py import it, and it
imports none of them.
"""

import statistics
import time


def median_times(fns, runs, warmup=2):
    """{label: median seconds}; the callables take turns run by run, so a machine that speeds up
    or slows down during the measurement affects every one of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {label: [] for label in fns}
    for _ in range(runs):
        for label, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(values) for label, values in times.items()}


def rounds_of_times(fns, runs, rounds):
    """{label: [median seconds of each round]}: `median_times` repeated `rounds` times."""
    per_round = [median_times(fns, runs) for _ in range(rounds)]
    return {label: [r[label] for r in per_round] for label in fns}


def median_time(fn, runs):
    return median_times({"": fn}, runs)[""]


def ratio_cell(ours, theirs):
    """Median of the per-round ratios ours / theirs, and their min-max spread."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f})"


def tf_function_calls(forward, layer):
    """{mode: callable} of a TensorFlow layer run as its users run it, inside `tf.function`: the forward
    pass without weights, with weights, and a training step (forward and the gradients of the
    layer's trainable weights). `forward(weights, training=False)` calls the layer (ours or a
    built-in, each with its own argument names). bench/benchmark.py and bench/keras_bench.py both
    time TensorFlow with it."""
    import tensorflow as tf

    plain = tf.function(lambda: forward(False))
    with_weights = tf.function(lambda: forward(True))

    @tf.function
    def train():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(forward(False, training=True))
        return tape.gradient(loss, layer.trainable_weights)

    return {
        "forward": lambda: plain().numpy(),
        "forward+weights": lambda: [r.numpy() for r in with_weights()],
        "train step": lambda: [g.numpy() for g in train()],
    }
