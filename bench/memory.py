"""Peak memory of the TensorFlow layer in eager mode and inside `tf.function`, and against PyTorch;
of the Keras file's forward and train step on each Keras backend.

Each measurement runs in a fresh process, a child that bench/fresh.py forks from a server that
imported only the case's framework: `measure_here` there gives {"growth_mib", "seconds",
"raised_peak"}. The growth is the peak resident memory after one step
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`) minus the resident memory after the layer is built
and the input allocated; the time is that of a second step (tracing is in the first). A forked
child's `ru_maxrss` starts at its own resident memory at the fork (a process started by
`subprocess` would inherit the benchmark's peak, gigabytes). `raised_peak` is False when the
step did not raise the peak above what the process reached before it (then the growth is an
upper bound). THRESHOLD, when given, replaces the TensorFlow and Keras layers'
`memory_efficient_threshold` (smoke runs use it to reach the memory-efficient path at small T).
A Keras case runs in the server of its backend (`KERAS_BACKEND`, fixed when Keras is
imported): compiled on TensorFlow (`tf.function`) and JAX (`jax.jit`), eager on torch.

Legend: B batch, T = S sequence length, E d_model, N num_heads.
"""

import gc
import resource
import statistics
import sys
import time
from pathlib import Path

TF_EAGER_TRAIN = "TensorFlow train step, GradientTape outside tf.function (eager)"
TF_GRAPH_TRAIN = "TensorFlow train step, GradientTape inside tf.function"
TF_FORWARD = "TensorFlow forward, tf.function"
TORCH_FORWARD = "PyTorch forward, no_grad"
KERAS_FORWARD = {backend: f"Keras file forward, KERAS_BACKEND={backend}" for backend in ("tensorflow", "jax", "torch")}
KERAS_TRAIN = {backend: f"Keras file train step, KERAS_BACKEND={backend}" for backend in ("tensorflow", "jax", "torch")}
KERAS_BACKENDS = {case: backend for cases in (KERAS_FORWARD, KERAS_TRAIN) for backend, case in cases.items()}
# What the layers are held to (benchmark targets, not timed tests).
EAGER_GROWTH_MIB = 1024
EAGER_TIME_RATIO = 1.3
FORWARD_GROWTH_RATIO = 1.5


def _rss_mib():
    """The resident memory of this process now, in MiB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def _peak_mib():
    """The peak resident memory of this process so far, in MiB (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _tf_layer(e, n, threshold):
    from TensorFlow import MultiHeadAttention

    layer = MultiHeadAttention(e, n)
    layer.build()
    if threshold is not None:
        layer.memory_efficient_threshold = threshold
    return layer


def _tf_train(b, t, e, n, threshold, eager):
    import tensorflow as tf

    layer, x = _tf_layer(e, n, threshold), tf.random.normal((b, t, e))

    def train():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x, training=True))
        return tape.gradient(loss, layer.trainable_weights)

    step = train if eager else tf.function(train)
    return lambda: [g.numpy() for g in step()]


def _tf_forward(b, t, e, n, threshold):
    import tensorflow as tf

    layer, x = _tf_layer(e, n, threshold), tf.random.normal((b, t, e))
    forward = tf.function(lambda: layer(x))
    return lambda: forward().numpy()


def _torch_forward(b, t, e, n, threshold):
    import torch

    from PyTorch import MultiHeadAttention

    layer, x = MultiHeadAttention(e, n).eval(), torch.randn(b, t, e)

    def forward():
        with torch.no_grad():
            return layer(x)

    return forward


def _keras_layer(b, t, e, n, threshold):
    import keras

    from Keras import MultiHeadAttention

    layer = MultiHeadAttention(e, n)
    layer.build()
    if threshold is not None:
        layer.memory_efficient_threshold = threshold
    return layer, keras.random.normal((b, t, e), seed=0)


def _keras_forward(b, t, e, n, threshold):
    """The Keras file's forward: under `jax.jit` (stateless), `tf.function`, or eager torch in no_grad."""
    import keras
    from keras import ops

    layer, x = _keras_layer(b, t, e, n, threshold)
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        forward = jax.jit(lambda weights, x: layer.stateless_call(weights, [], x)[0])
        return lambda: ops.convert_to_numpy(forward([v.value for v in layer.trainable_variables], x))
    if backend == "tensorflow":
        import tensorflow as tf

        forward = tf.function(lambda: layer(x))
        return lambda: forward().numpy()
    import torch

    def forward():
        with torch.no_grad():
            return layer(x)

    return forward


def _keras_train(b, t, e, n, threshold):
    """The gradients of sum(output) with respect to the Keras file's weights: `jax.jit(jax.grad)`,
    a `GradientTape` inside `tf.function`, or torch autograd."""
    import keras
    from keras import ops

    layer, x = _keras_layer(b, t, e, n, threshold)
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        def loss(weights):
            return ops.sum(layer.stateless_call(weights, [], x, training=True)[0])

        step = jax.jit(jax.grad(loss))
        return lambda: [ops.convert_to_numpy(g) for g in step([v.value for v in layer.trainable_variables])]
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = ops.sum(layer(x, training=True))
            return tape.gradient(loss, layer.trainable_weights)

        return lambda: [g.numpy() for g in step()]

    def step():
        layer.zero_grad()
        ops.sum(layer(x, training=True)).backward()
        return [v.value.grad for v in layer.trainable_variables]

    return step


STEPS = {
    TF_EAGER_TRAIN: lambda *sizes: _tf_train(*sizes, eager=True),
    TF_GRAPH_TRAIN: lambda *sizes: _tf_train(*sizes, eager=False),
    TF_FORWARD: _tf_forward,
    TORCH_FORWARD: _torch_forward,
    **dict.fromkeys(KERAS_FORWARD.values(), _keras_forward),
    **dict.fromkeys(KERAS_TRAIN.values(), _keras_train),
}


def measure_here(case, b, t, e, n, threshold=None):
    """{"growth_mib", "seconds", "raised_peak"} of one step of `case`, in this process."""
    step = STEPS[case](b, t, e, n, threshold)
    gc.collect()
    before, peak_before = _rss_mib(), _peak_mib()
    step()
    peak = _peak_mib()
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return {"growth_mib": round(peak - before, 1), "seconds": seconds, "raised_peak": peak > peak_before}


def measure(case, config, forks, threshold=None):
    """One measurement of `case` at `config` in a fresh process: a child of `forks`' server of
    the case's framework (KERAS_BACKEND, fixed when Keras is imported, for a Keras case)."""
    backend = KERAS_BACKENDS.get(case, "torch" if case == TORCH_FORWARD else "tensorflow")
    result = forks.run(
        backend, "bench.memory", "measure_here", [case, config.b, config.t, config.e, config.n, threshold]
    )
    if "error" in result:
        raise RuntimeError(f"the measurement of {case!r} at {config.name} failed:\n{result['error']}")
    return result


def measure_all(cases, processes, forks, threshold=None):
    """{case: [result of each process]} for [(case, config)], each in `processes` fresh processes."""
    results = {}
    for case, config in cases:
        print(f"memory: {case}, {config.name}", file=sys.stderr, flush=True)
        results[case] = [measure(case, config, forks, threshold) for _ in range(processes)]
    return results


def _growth_cell(results):
    growths = [r["growth_mib"] for r in results]
    bound = "" if all(r["raised_peak"] for r in results) else "<= "
    return f"{bound}{statistics.median(growths):.0f} ({min(growths):.0f}-{max(growths):.0f})"


def _median(results, field):
    return statistics.median(r[field] for r in results)


def memory_table(results, configs):
    """The measurements, then each target with the measured value."""
    lines = [
        "| measurement | configuration | peak growth (MiB): median (min-max) | time (ms): median (min-max) |",
        "|---|---|---|---|",
    ]
    for case, measured in results.items():
        times = [r["seconds"] * 1e3 for r in measured]
        lines.append(
            f"| {case} | {configs[case].name} | {_growth_cell(measured)} "
            f"| {statistics.median(times):.0f} ({min(times):.0f}-{max(times):.0f}) |"
        )
    eager_growth = _median(results[TF_EAGER_TRAIN], "growth_mib")
    eager_ratio = _median(results[TF_EAGER_TRAIN], "seconds") / _median(results[TF_GRAPH_TRAIN], "seconds")
    torch_growth = _median(results[TORCH_FORWARD], "growth_mib")
    forward_ratio = _median(results[TF_FORWARD], "growth_mib") / torch_growth
    targets = [
        ("eager TensorFlow train step: peak growth", f"< {EAGER_GROWTH_MIB} MiB", f"{eager_growth:.0f} MiB",
         eager_growth < EAGER_GROWTH_MIB),
        ("eager TensorFlow train step: time / tf.function time", f"<= {EAGER_TIME_RATIO}x", f"{eager_ratio:.2f}x",
         eager_ratio <= EAGER_TIME_RATIO),
        ("TensorFlow forward: peak growth / PyTorch's", f"<= {FORWARD_GROWTH_RATIO}x", f"{forward_ratio:.2f}x",
         forward_ratio <= FORWARD_GROWTH_RATIO),
    ]  # fmt: skip
    for backend, case in KERAS_FORWARD.items():
        if case in results:
            ratio = _median(results[case], "growth_mib") / torch_growth
            name = f"Keras file forward ({backend}): peak growth / PyTorch's"
            targets.append((name, f"<= {FORWARD_GROWTH_RATIO}x", f"{ratio:.2f}x", ratio <= FORWARD_GROWTH_RATIO))
    lines += ["", "| target | goal | measured (medians) | met |", "|---|---|---|---|"]
    lines += [f"| {name} | {goal} | {value} | {'yes' if met else 'no'} |" for name, goal, value, met in targets]
    return "\n".join(lines)
