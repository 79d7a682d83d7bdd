"""Benchmark: our layers against the built-in ones, measured side by side in one run.

`python -m bench.benchmark` (or `make bench`) times our PyTorch layer against
`torch.nn.MultiheadAttention` (eval + no_grad for inference, its fast path) and our TensorFlow
layer against `keras.layers.MultiHeadAttention` (both inside `tf.function`): a forward pass
without weights, with weights, and a training step (forward + backward). Each comparison runs in
`--rounds` rounds (default 3) of `--runs` timed runs (default 5), ours and the built-in taking
turns run by run; a round gives one ratio ours / built-in (of the medians), and the report gives
the median ratio over the rounds with its min-max spread. It also reports KV-cache decoding (one
token with the cache against recomputing the full causal pass), one decoding step against two
anchors (a hand-written PyTorch decode and keras-hub's `CachedMultiHeadAttention`, see
bench/decode_anchors.py), each layer in a fresh process (forked from one that only imported its
framework: bench/fresh.py), time and peak memory at long sequence lengths, and the peak memory
of TensorFlow in eager mode and inside `tf.function` (see bench/memory.py), and writes
bench/results.md. `--quick` runs tiny configurations and writes out/bench_quick.md instead (out/
is not tracked), so a smoke run never replaces the recorded results.

Legend: B batch, T query length, S key/value length, E d_model, N num_heads, K num_kv_heads.
"""

import argparse
import dataclasses
import os
import platform
import statistics
import sys
from pathlib import Path

from bench import (
    compile_time,
    decode_anchors,
    decode_pair,
    fresh,
    int8_cache,
    keras_bench,
    keras_decode,
    memory,
    mla,
    shared_cache,
)
from bench.timing import median_time, ratio_cell, rounds_of_times, tf_function_calls

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESULTS = Path(__file__).with_name("results.md")
QUICK_RESULTS = Path(__file__).parents[1] / "out" / "bench_quick.md"
MODES = ("forward", "forward+weights", "train step")


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    b: int
    t: int
    e: int
    n: int
    k: int | None = None

    @property
    def h(self):
        return self.e // self.n

    def flops(self, mode):
        """Matmul FLOPs of one forward (x3 for a training step: forward + two backward matmuls)."""
        kv = (self.k or self.n) * self.h
        projections = 2 * self.b * self.t * (self.e * self.e * 2 + self.e * kv * 2)
        attention = 2 * 2 * self.b * self.n * self.t * self.t * self.h
        return (projections + attention) * (3 if mode == "train step" else 1)


CONFIGS = [
    Config("B=8 T=S=512 E=512 N=8", 8, 512, 512, 8),
    Config("B=32 T=S=128 E=256 N=4", 32, 128, 256, 4),
    Config("B=1 T=S=4096 E=256 N=4", 1, 4096, 256, 4),
    Config("GQA B=8 T=S=512 E=512 N=8 K=2", 8, 512, 512, 8, 2),
]
QUICK = [Config("quick B=2 T=S=32 E=32 N=4", 2, 32, 32, 4), Config("quick GQA", 2, 32, 32, 4, 2)]
# (configuration, mode) measured each in a fresh process: time and peak memory growth.
LONG = [
    (Config("B=1 T=S=4096 E=256 N=4", 1, 4096, 256, 4), "forward"),
    (Config("B=1 T=S=8192 E=256 N=4", 1, 8192, 256, 4), "train step"),
    (Config("B=1 T=S=16384 E=256 N=4", 1, 16384, 256, 4), "forward"),
    (Config("B=1 T=S=32768 E=256 N=4", 1, 32768, 256, 4), "forward"),
]
QUICK_LONG = [(QUICK[0], "forward"), (QUICK[0], "train step")]
# Decoding one token at context length L (t = L): with the KV cache vs the full causal pass.
DECODE = [
    Config("decode B=1 L=1024 E=256 N=4", 1, 1024, 256, 4),
    Config("decode B=1 L=4096 E=256 N=4", 1, 4096, 256, 4),
]
QUICK_DECODE = [Config("quick decode L=32", 1, 32, 32, 4)]
# One decoding step (T = 1, L - 1 tokens cached) against the anchors, with the target of PyTorch
# ours / the hand-written decode at each size.
DECODE_ANCHORS = [
    (Config("decode B=1 E=256 N=4 L=1024", 1, 1024, 256, 4), 1.3),
    (Config("decode B=8 E=512 N=8 L=2048", 8, 2048, 512, 8), 1.1),
]
QUICK_DECODE_ANCHORS = [(Config("quick decode B=2 E=32 N=4 L=64", 2, 64, 32, 4), 1.3)]
DECODE_ANCHOR_RUNS = 30  # timed steps per round (quick: 3): a step takes 0.1 to 50 ms
INT8_CACHE_RUNS = 10  # steps per round of the int8 cache's step against the float cache's
# TensorFlow in eager mode against tf.function, and against PyTorch: (measurement, configuration).
MEMORY_TRAIN = Config("B=1 T=S=8192 E=256 N=4", 1, 8192, 256, 4)
MEMORY_FORWARD = Config("B=1 T=S=32768 E=256 N=4", 1, 32768, 256, 4)
MEMORY = [
    (memory.TF_EAGER_TRAIN, MEMORY_TRAIN),
    (memory.TF_GRAPH_TRAIN, MEMORY_TRAIN),
    (memory.TF_FORWARD, MEMORY_FORWARD),
    (memory.TORCH_FORWARD, MEMORY_FORWARD),
    *((case, MEMORY_FORWARD) for case in memory.KERAS_FORWARD.values()),  # the Keras file's memory-efficient path
    *((case, MEMORY_TRAIN) for case in memory.KERAS_TRAIN.values()),
]
MEMORY_PROCESSES = 3
# Smoke sizes, one process each, with a threshold that sends them down the memory-efficient path.
QUICK_MEMORY = [(case, Config("quick T=S=256 E=32 N=4", 1, 256, 32, 4)) for case, _ in MEMORY]
QUICK_MEMORY_THRESHOLD = 1 << 12
# The variants of today's models, each against the plain layer (same sizes, same run): what they cost.
VARIANTS = {
    "RoPE": {"rope_theta": 10000.0},
    "RoPE + QK-norm": {"rope_theta": 10000.0, "qk_norm": "head"},
    "window 128": {"window": 128},
    "soft-capping": {"softcap": 50.0},
    "sinks": {"sinks": True},
}
VARIANT_CONFIGS = [CONFIGS[0]]
VARIANT_MODES = ("forward", "train step")
# Soft-capping in PyTorch against the plain layer, causal and not, next to its target (docs/design.md, "Soft-capping").
SOFTCAP_CONFIGS = [CONFIGS[0], CONFIGS[2]]
SOFTCAP_TARGETS = {CONFIGS[2].name: 1.6}  # at most this soft-capped / plain; the others 1.3
# int8 (docs/SPEC.md, "int8"): weight memory and forward time against float32, ours and the built-in's.
INT8_CONFIGS = [CONFIGS[0]]
QUICK_INT8 = [QUICK[0]]
LAYERS = {
    "PyTorch": ("PyTorch ours", "nn.MultiheadAttention"),
    "TensorFlow": ("TensorFlow ours", "keras MultiHeadAttention"),
}


def torch_matmul_flops(runs):
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048**3 / median_time(lambda: a @ b, runs)


def tf_matmul_flops(runs):
    import tensorflow as tf

    a, b = tf.random.normal((2048, 2048)), tf.random.normal((2048, 2048))
    matmul = tf.function(tf.matmul)
    return 2 * 2048**3 / median_time(lambda: matmul(a, b).numpy(), runs)


def torch_layers(config, device="cpu", dtype=None, variant=None, causal=False):
    """{label: {mode: callable}} for ours (with the constructor arguments `variant`, called with
    `causal`) and, for a plain layer without GQA or `causal`, the built-in."""
    import torch

    from PyTorch import MultiHeadAttention

    x = torch.randn(config.b, config.t, config.e, device=device, dtype=dtype)
    ours = MultiHeadAttention(config.e, config.n, num_kv_heads=config.k, device=device, dtype=dtype, **(variant or {}))
    layers = {"PyTorch ours": ours}
    if config.k is None and not variant and not causal:
        layers["nn.MultiheadAttention"] = ours.to_torch()

    def calls(label, layer):
        builtin = label != "PyTorch ours"

        def forward(weights):
            if builtin:
                return layer(x, x, x, need_weights=weights, average_attn_weights=False)
            return layer(x, return_attention=weights, causal=causal)

        def inference(weights):
            layer.eval()
            with torch.no_grad():
                forward(weights)

        xg = x.clone().requires_grad_()

        def train():
            layer.train()
            result = layer(xg, xg, xg, need_weights=False)[0] if builtin else layer(xg, causal=causal)
            result.sum().backward()

        return {"forward": lambda: inference(False), "forward+weights": lambda: inference(True), "train step": train}

    return {label: calls(label, layer) for label, layer in layers.items()}


def tf_layers(config, variant=None):
    """{label: {mode: callable}} for ours (with the constructor arguments `variant`) and, for a
    plain layer, the Keras built-in."""
    import tensorflow as tf

    from TensorFlow import MultiHeadAttention

    x = tf.random.normal((config.b, config.t, config.e))
    ours = MultiHeadAttention(config.e, config.n, num_kv_heads=config.k, **(variant or {}))
    ours.build()
    layers = {"TensorFlow ours": ours}
    if not variant:
        builtin = ours.to_keras()
        layers["keras " + type(builtin).__name__] = builtin

    def calls(label, layer):
        theirs = label.startswith("keras")

        def forward(weights, training=False):
            if theirs:
                return layer(x, x, return_attention_scores=weights, training=training)
            return layer(x, return_attention=weights, training=training)

        return tf_function_calls(forward, layer)

    return {label: calls(label, layer) for label, layer in layers.items()}


def time_config(config, runs, rounds):
    """{(framework, label, mode): [seconds of each round]} for one configuration."""
    times = {}
    for framework, build in (("PyTorch", torch_layers), ("TensorFlow", tf_layers)):
        layers = build(config)
        for mode in MODES:
            measured = rounds_of_times({label: calls[mode] for label, calls in layers.items()}, runs, rounds)
            times.update({(framework, label, mode): seconds for label, seconds in measured.items()})
    return times


def time_variants(config, runs, rounds):
    """{(framework, variant, mode): ([plain seconds], [variant seconds]) of each round}: each
    variant taking turns with the plain layer, run by run."""
    times = {}
    for framework, build in (("PyTorch", torch_layers), ("TensorFlow", tf_layers)):
        plain = next(iter(build(config).values()))
        for name, variant in VARIANTS.items():
            changed = next(iter(build(config, variant=variant).values()))
            for mode in VARIANT_MODES:
                measured = rounds_of_times({"plain": plain[mode], name: changed[mode]}, runs, rounds)
                times[(framework, name, mode)] = (measured["plain"], measured[name])
    return times


def variants_table(times, config):
    lines = [
        "| configuration | framework | variant | mode | plain (ms) | with the variant (ms) "
        "| variant / plain (spread) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (framework, name, mode), (plain, changed) in times.items():
        lines.append(
            f"| {config.name} | {framework} | {name} | {mode} | {statistics.median(plain) * 1e3:.1f} "
            f"| {statistics.median(changed) * 1e3:.1f} | {ratio_cell(changed, plain)} |"
        )
    return "\n".join(lines)


def time_softcap(configs, runs, rounds):
    """{(configuration name, causal, mode): ([plain seconds], [soft-capped seconds]) of each round}:
    the PyTorch layer with soft-capping taking turns with the plain layer, run by run."""
    times = {}
    for config in configs:
        for causal in (False, True):
            plain = torch_layers(config, causal=causal)["PyTorch ours"]
            capped = torch_layers(config, variant=VARIANTS["soft-capping"], causal=causal)["PyTorch ours"]
            for mode in VARIANT_MODES:
                measured = rounds_of_times({"plain": plain[mode], "capped": capped[mode]}, runs, rounds)
                times[(config.name, causal, mode)] = (measured["plain"], measured["capped"])
    return times


def softcap_table(times):
    lines = [
        "| configuration | causal | mode | plain (ms) | soft-capped (ms) | soft-capped / plain (spread) | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for (name, causal, mode), (plain, capped) in times.items():
        lines.append(
            f"| {name} | {'yes' if causal else 'no'} | {mode} | {statistics.median(plain) * 1e3:.1f} "
            f"| {statistics.median(capped) * 1e3:.1f} | {ratio_cell(capped, plain)} "
            f"| at most {SOFTCAP_TARGETS.get(name, 1.3)}x |"
        )
    return "\n".join(lines)


def _torch_bytes(module):
    """Bytes of a module's state: int8 tensors as int8 (torchao's `qdata` and `scale`, a quantized
    tensor's integers), everything else as stored."""
    import torch

    def nbytes(value):
        if isinstance(value, (tuple, list)):
            return sum(nbytes(v) for v in value)
        if not isinstance(value, torch.Tensor):
            return 0
        if hasattr(value, "qdata"):
            return value.qdata.nbytes + value.scale.nbytes
        return value.int_repr().nbytes if value.is_quantized else value.nbytes

    return sum(nbytes(value) for value in module.state_dict().values())


def torch_int8_layers(config):
    """{label: (forward callable, weight bytes)}: ours in float32, `quantize("int8")`, torchao's int8
    dynamic scheme and `quantize_dynamic` (nn.MultiheadAttention cannot be quantized: its input
    projection is a bare parameter and its output projection is excluded from quantize_dynamic)."""
    import copy

    import torch
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    from PyTorch import MultiHeadAttention

    x = torch.randn(config.b, config.t, config.e)
    float_layer = MultiHeadAttention(config.e, config.n, num_kv_heads=config.k).eval()
    int8, torchao, dynamic = (copy.deepcopy(float_layer) for _ in range(3))
    int8.quantize("int8")
    quantize_(torchao, Int8DynamicActivationInt8WeightConfig())
    dynamic = torch.ao.quantization.quantize_dynamic(dynamic, {torch.nn.Linear}, dtype=torch.qint8)
    layers = {"ours float32": float_layer, "ours int8": int8, "ours torchao int8 dynamic": torchao}
    layers["ours quantize_dynamic"] = dynamic

    def forward(layer):
        with torch.no_grad():
            layer(x)

    return {label: ((lambda layer=layer: forward(layer)), _torch_bytes(layer)) for label, layer in layers.items()}


def tf_int8_layers(config):
    """{label: (forward callable, weight bytes)}: ours and Keras' MultiHeadAttention, in float32 and
    quantized to int8 (the built-in's EinsumDense projections, as `model.quantize` does), in tf.function."""
    import keras
    import tensorflow as tf

    from TensorFlow import MultiHeadAttention

    x = tf.random.normal((config.b, config.t, config.e))
    layers = {}
    for quantized in (False, True):
        ours = MultiHeadAttention(config.e, config.n, num_kv_heads=config.k)
        ours.build()
        builtin = ours.to_keras()
        if quantized:
            ours.quantize("int8")
            for dense in builtin._flatten_layers(include_self=False):
                if isinstance(dense, keras.layers.EinsumDense):
                    dense.quantize("int8")
        suffix = "int8" if quantized else "float32"
        layers[f"ours {suffix}"] = (ours, tf.function(lambda layer=ours: layer(x)))
        layers[f"keras {type(builtin).__name__} {suffix}"] = (builtin, tf.function(lambda layer=builtin: layer(x, x)))
    return {
        label: ((lambda call=call: call().numpy()), sum(v.numpy().nbytes for v in layer.weights))
        for label, (layer, call) in layers.items()
    }


def time_int8(config, runs, rounds):
    """{framework: {label: ([seconds of each round], weight bytes)}}, each framework's layers taking turns."""
    results = {}
    for framework, build in (("PyTorch", torch_int8_layers), ("TensorFlow", tf_int8_layers)):
        layers = build(config)
        measured = rounds_of_times({label: call for label, (call, _) in layers.items()}, runs, rounds)
        results[framework] = {label: (measured[label], size) for label, (_, size) in layers.items()}
    return results


def int8_table(results, config):
    """Each layer against its own float32 form (ours against ours float32, the built-in against the
    built-in float32) and, for Keras, ours int8 against the built-in int8."""
    lines = [
        "| configuration | framework | layer | weights (KiB) | weights / float32 | forward (ms) "
        "| forward / float32 (spread) |",
        "|---|---|---|---|---|---|---|",
    ]
    for framework, layers in results.items():
        for label, (seconds, size) in layers.items():
            base_label = label.rsplit(" ", 1)[0] + " float32" if label.startswith("keras") else "ours float32"
            base_seconds, base_size = layers[base_label]
            lines.append(
                f"| {config.name} | {framework} | {label} | {size / 1024:.0f} | {size / base_size:.2f} "
                f"| {statistics.median(seconds) * 1e3:.1f} | {ratio_cell(seconds, base_seconds)} |"
            )
    keras_layers = results["TensorFlow"]
    builtin = next(label for label in keras_layers if label.startswith("keras") and label.endswith("int8"))
    lines += [
        "",
        f"TensorFlow ours int8 / {builtin}, forward: "
        f"{ratio_cell(keras_layers['ours int8'][0], keras_layers[builtin][0])}.",
    ]
    return "\n".join(lines)


def torch_decode(config):
    """{"KV cache": one token at slot L - 1, "full pass": the causal pass over all L tokens}."""
    import torch

    from PyTorch import MultiHeadAttention

    layer = MultiHeadAttention(config.e, config.n, num_kv_heads=config.k).eval()
    x = torch.randn(config.b, config.t, config.e)
    with torch.no_grad():
        _, cache = layer(x[:, :-1], causal=True, cache=layer.init_cache(config.b, config.t))  # L - 1 tokens

    def cached():
        with torch.no_grad():
            layer(x[:, -1:], causal=True, cache=cache)  # rewrites slot L - 1 every time

    def full():
        with torch.no_grad():
            layer(x, causal=True)

    return {"KV cache": cached, "full pass": full}


def tf_decode(config):
    import tensorflow as tf

    from TensorFlow import MultiHeadAttention

    layer = MultiHeadAttention(config.e, config.n, num_kv_heads=config.k)
    x = tf.random.normal((config.b, config.t, config.e))
    _, cache = layer(x[:, :-1], causal=True, cache=layer.init_cache(config.b, config.t))
    step = tf.function(lambda: layer(x[:, -1:], causal=True, cache=cache)[0])
    full = tf.function(lambda: layer(x, causal=True))
    return {"KV cache": lambda: step().numpy(), "full pass": lambda: full().numpy()}


def time_decode(config, runs, rounds):
    return {
        framework: rounds_of_times(build(config), runs, rounds)
        for framework, build in (("PyTorch", torch_decode), ("TensorFlow", tf_decode))
    }


def time_decode_anchors(config, runs, rounds):
    """{label: [seconds of each round]}: the steps of bench/decode_anchors.py, in every round each
    step timed over `runs` steps in a row, as a decoding loop calls it. Not step by step across
    steps: after TensorFlow's steps in `tf.function` its threads keep spinning, and a step timed
    right after another kind took up to twice its time on 2 cores."""
    steps = decode_anchors.decode_steps(config)
    per_round = [{label: median_time(step, runs) for label, step in steps.items()} for _ in range(rounds)]
    return {label: [measured[label] for measured in per_round] for label in steps}


def fits_in_memory(config, which):
    """Whether a layer that materialises the (B, N, T, S) float32 scores (three copies: scores,
    softmax, gradient or temporaries) fits in half of the available memory."""
    if which.endswith("ours"):
        return True
    available = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemAvailable")
    )
    return 3 * 4 * config.b * config.n * config.t * config.t < available / 2


def measure_long(config, mode, which, rounds, forks):
    """Median seconds and peak memory growth (MiB) of one call, in a fresh process (a child of
    `forks`' server of the layer's framework); None where the layer cannot hold the configuration."""
    if not fits_in_memory(config, which):
        return None
    backend = "torch" if which in LAYERS["PyTorch"] else "tensorflow"
    result = forks.run(backend, "bench.benchmark", "measure_here", [dataclasses.astuple(config), mode, which, rounds])
    if isinstance(result, dict):
        raise RuntimeError(f"the long-sequence measurement of {which} at {config.name} failed:\n{result['error']}")
    return result


def _rss_mib(field):
    """VmRSS or VmHWM (peak) of this process, in MiB, from /proc/self/status."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) / 1024


def measure_here(fields, mode, which, rounds):
    """(median seconds, peak RSS growth in MiB) of the first call, then the timed ones, in this
    process. The first call is measured because TensorFlow's allocator keeps what a call freed for
    the next one (the growth of a second call is near 0 whatever it needs); it includes tracing.
    The peak is reset through /proc/self/clear_refs (to the resident memory before the call)."""
    config = Config(*fields)
    framework = "PyTorch" if which in LAYERS["PyTorch"] else "TensorFlow"
    call = (torch_layers if framework == "PyTorch" else tf_layers)(config)[which][mode]
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before = _rss_mib("VmRSS")
    except OSError:
        before = None
    call()
    growth = "n/a" if before is None else round(_rss_mib("VmHWM") - before, 1)
    return median_time(call, rounds), growth


KERAS_BACKENDS = ("tensorflow", "jax", "torch")


def time_keras(config, runs, rounds, forks):
    """{backend: {mode: {"ours": [...], "builtin": [...]}}} from bench/keras_bench.py, a fresh
    process per backend (a Keras backend is fixed at import; a child of `forks`' server of the
    backend); a backend that fails gives its error text."""
    results = {}
    for backend in KERAS_BACKENDS:
        numbers = [config.b, config.t, config.e, config.n, runs, rounds]
        measured = forks.run(backend, "bench.keras_bench", "measure", [backend, *numbers])
        results[backend] = measured["error"][-300:] if "error" in measured else measured
    return results


def keras_table(results, config):
    lines = [
        "| configuration | backend | mode | ours (ms) | keras MultiHeadAttention (ms) | ours / built-in (spread) |",
        "|---|---|---|---|---|---|",
    ]
    for backend, measured in results.items():
        if isinstance(measured, str):
            lines.append(f"| {config.name} | {backend} | failed: {measured.splitlines()[-1]} | | | |")
            continue
        for mode in MODES:
            ours, theirs = measured[mode]["ours"], measured[mode]["builtin"]
            lines.append(
                f"| {config.name} | {backend} | {mode} | {statistics.median(ours) * 1e3:.1f} "
                f"| {statistics.median(theirs) * 1e3:.1f} | {ratio_cell(ours, theirs)} |"
            )
    lines += ["", "| decoding step (ours only) | backend | ms |", "|---|---|---|"]
    for backend, measured in results.items():
        if not isinstance(measured, str):
            step = statistics.median(measured["decode"]["ours"]) * 1e3
            width = min(config.e, keras_bench.DECODE_WIDTH)
            shape = f"B=1 L={keras_bench.DECODE_LENGTH} E={width} N={keras_bench.DECODE_HEADS}"
            lines.append(f"| {shape}, T = 1 | {backend} | {step:.2f} |")
    return "\n".join(lines)


def machine():
    import tensorflow as tf
    import torch

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    versions = f"Python {platform.python_version()}, torch {torch.__version__}, TensorFlow {tf.__version__}"
    return f"{cpu}, {os.cpu_count()} cores, {versions}"


def table(times, flops_per_second, configs):
    lines = [
        "| configuration | mode | framework | ours (ms) | built-in (ms) | ours / built-in (spread) "
        "| ours % of matmul peak | built-in % of matmul peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for config in configs:
        for framework in ("PyTorch", "TensorFlow"):
            labels = list(dict.fromkeys(label for f, label, _ in times[config.name] if f == framework))
            ours_label, others = labels[0], labels[1:]
            for mode in MODES:
                ours = times[config.name][(framework, ours_label, mode)]
                rate = config.flops(mode) / flops_per_second[framework]
                cells = [config.name, mode, framework, f"{statistics.median(ours) * 1e3:.1f}"]
                if others:
                    theirs = times[config.name][(framework, others[0], mode)]
                    cells += [
                        f"{statistics.median(theirs) * 1e3:.1f} ({others[0]})",
                        ratio_cell(ours, theirs),
                        f"{rate / statistics.median(ours):.0%}",
                        f"{rate / statistics.median(theirs):.0%}",
                    ]
                else:
                    cells += ["n/a (GQA)", "-", f"{rate / statistics.median(ours):.0%}", "-"]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decode_table(times, configs):
    lines = [
        "| configuration | framework | KV cache (ms/token) | full pass (ms/token) | KV cache tokens/s "
        "| full pass tokens/s | full pass / KV cache (spread) |",
        "|---|---|---|---|---|---|---|",
    ]
    for config in configs:
        for framework, measured in times[config.name].items():
            cached, full = statistics.median(measured["KV cache"]), statistics.median(measured["full pass"])
            lines.append(
                f"| {config.name} | {framework} | {cached * 1e3:.2f} | {full * 1e3:.1f} | {1 / cached:.0f} "
                f"| {1 / full:.1f} | {ratio_cell(measured['full pass'], measured['KV cache'])} |"
            )
    return "\n".join(lines)


def long_table(results):
    lines = ["| configuration | mode | layer | time (ms) | peak growth (MiB) |", "|---|---|---|---|---|"]
    for (config, mode, which), result in results.items():
        if result is None:
            cells = ["not run: three copies of its (B, N, T, S) float32 scores exceed half the free memory", "-"]
        else:
            cells = [f"{result[0] * 1e3:.0f}", str(result[1])]
        lines.append(f"| {config.name} | {mode} | {which} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def output_path(quick, output=None):
    """Where the results go: `output`, or the default of the run's kind; None when a quick run
    would replace the recorded full results."""
    if output is None:
        return QUICK_RESULTS if quick else RESULTS
    return None if quick and output.resolve() == RESULTS.resolve() else output


def run(args, forks):
    """The Markdown report of one run; `forks` runs the measurements that need a fresh process."""
    configs, long, decode = (QUICK, QUICK_LONG, QUICK_DECODE) if args.quick else (CONFIGS, LONG, DECODE)
    anchors, anchor_runs = (QUICK_DECODE_ANCHORS, 3) if args.quick else (DECODE_ANCHORS, DECODE_ANCHOR_RUNS)
    memory_cases, processes = (QUICK_MEMORY, 1) if args.quick else (MEMORY, MEMORY_PROCESSES)
    variant_config = QUICK[0] if args.quick else VARIANT_CONFIGS[0]
    softcap_configs = QUICK[:1] if args.quick else SOFTCAP_CONFIGS
    int8_configs = QUICK_INT8 if args.quick else INT8_CONFIGS
    runs = args.runs or (2 if args.quick else 5)
    print("decoding step, PyTorch ours and the hand decode", file=sys.stderr, flush=True)
    pair_times = {
        config.name: decode_pair.time_torch_pair(config, anchor_runs, args.rounds * 3) for config, _ in anchors
    }
    flops = {"PyTorch": torch_matmul_flops(runs), "TensorFlow": tf_matmul_flops(runs)}
    times, decode_times = {}, {}
    for index, config in enumerate(configs, 1):
        print(f"[{index}/{len(configs)}] {config.name}", file=sys.stderr, flush=True)
        times[config.name] = time_config(config, runs, args.rounds)
    for config in decode:
        print(config.name, file=sys.stderr, flush=True)
        decode_times[config.name] = time_decode(config, runs, args.rounds)
    anchor_times = {}
    for config, _ in anchors:
        print(config.name, file=sys.stderr, flush=True)
        anchor_times[config.name] = time_decode_anchors(config, anchor_runs, args.rounds)
    mla_config = mla.QUICK_CONFIG if args.quick else mla.CONFIG
    print("multi-head latent attention, decoding step", file=sys.stderr, flush=True)
    mla_results = mla.time_mla(anchor_runs, args.rounds, mla_config)
    shared_config = shared_cache.QUICK_CONFIG if args.quick else shared_cache.CONFIG
    print("shared keys and values, decoding step", file=sys.stderr, flush=True)
    shared_results = shared_cache.time_shared(anchor_runs, args.rounds, shared_config)
    print("Keras decoding step (jax.jit)", file=sys.stderr, flush=True)
    keras_decode_times = keras_decode.keras_decode_times(
        [config for config, _ in anchors], anchor_runs, args.rounds, forks
    )
    compile_rows = "Not run with --quick (two compiles of minutes each): `python -m bench.sections decode --quick`."
    if not args.quick:
        print(f"compile time, {configs[0].name}", file=sys.stderr, flush=True)
        compile_rows = compile_time.compile_table(compile_time.compile_times(configs[0]), configs[0])
    print(f"variants, {variant_config.name}", file=sys.stderr, flush=True)
    variant_times = time_variants(variant_config, runs, args.rounds)
    print("soft-capping, PyTorch", file=sys.stderr, flush=True)
    softcap_times = time_softcap(softcap_configs, runs, args.rounds)
    int8_results = {}
    for config in int8_configs:
        print(f"int8, {config.name}", file=sys.stderr, flush=True)
        int8_results[config.name] = time_int8(config, runs, args.rounds)
    print("int8 KV cache, PyTorch decoding step", file=sys.stderr, flush=True)
    int8_cache_runs = 3 if args.quick else INT8_CACHE_RUNS
    int8_cache_rows = int8_cache.int8_cache_section(int8_cache_runs, args.rounds * 3, args.quick)
    keras_config = QUICK[0] if args.quick else CONFIGS[0]
    print(f"Keras file, {keras_config.name}", file=sys.stderr, flush=True)
    keras_results = time_keras(keras_config, runs, args.rounds, forks)
    long_results = {}
    for config, mode in long:
        for which in (label for pair in LAYERS.values() for label in pair):
            print(f"{config.name} {mode} {which}", file=sys.stderr, flush=True)
            long_results[(config, mode, which)] = measure_long(config, mode, which, args.rounds, forks)
    memory_results = memory.measure_all(memory_cases, processes, forks, QUICK_MEMORY_THRESHOLD if args.quick else None)
    hub = "not installed: see docs/benchmark.md"
    if decode_anchors.has_keras_hub():
        hub = f"keras-hub {decode_anchors.keras_hub_version()}"
    report = [
        "# Benchmark results",
        "",
        f"Machine: {machine()}.",
        f"Matmul throughput measured in this run (2048x2048 float32): PyTorch {flops['PyTorch'] / 1e9:.0f} GFLOP/s, "
        f"TensorFlow {flops['TensorFlow'] / 1e9:.0f} GFLOP/s. CPU float32. Each comparison: {args.rounds} rounds "
        f"of {runs} timed runs after 2 warm-up runs, ours and the built-in taking turns run by run; times are the "
        "median over the rounds of each round's median, ratios the median of the rounds' ratios with their "
        "min-max spread in parentheses.",
        "PyTorch inference runs in eval mode under no_grad (the built-in's fast path); "
        "TensorFlow runs inside tf.function.",
        "",
        table(times, flops, configs),
        "",
        "## KV-cache decoding",
        "",
        "One token at context length L: a T = 1 call with a cache of L slots against the full causal pass over "
        "the L tokens (what a decoder without a cache recomputes for every token). Same layer, same rounds.",
        "",
        decode_table(decode_times, decode),
        "",
        "## Decoding step against anchors",
        "",
        f"One T = 1 step with L - 1 tokens in the cache (it writes slot L - 1 and attends all L), {args.rounds} "
        f"rounds in one process, same weights; in each round every step runs {anchor_runs} times in a row after 2 "
        "warm-up steps, as a decoding loop calls it (not step by step across steps: TensorFlow's threads keep "
        "spinning after a tf.function step). PyTorch under no_grad; the hand-written decode (fused "
        "q/k/v matmul, in-place cache write, scaled_dot_product_attention) is checked once to give ours' output "
        f"within {decode_anchors.HAND_ATOL}. TensorFlow's functional step takes the cache and returns the output "
        "and the new cache; the in-place step closes over the variables of init_cache(in_place=True) and writes "
        "them (setting the index back to L - 1 first, in the same graph), called as a tf.function or as its "
        "ConcreteFunction (concrete); every TensorFlow step is checked once to give the same output. keras-hub's "
        f"CachedMultiHeadAttention ({hub}) holds the same weights and cache, with the mask of the written slots.",
        "",
        decode_anchors.anchor_tables(anchor_times, anchors),
        "",
        f"PyTorch ours and the hand decode again, taking turns step by step in {args.rounds * 3} rounds, timed "
        "first in the run "
        "(before any TensorFlow step, whose spinning threads slow a PyTorch step timed after them):",
        "",
        decode_pair.pair_table(pair_times, anchors),
        "",
        "The Keras file's step under jax.jit (functional cache, taking the token and the cache and returning the "
        "output and the new cache) against a hand-written keras.ops step (bench/keras_decode.py; keras_hub is not "
        "installed), one process per size, taking turns run by run:",
        "",
        keras_decode.keras_decode_table(keras_decode_times),
        "",
        "## Multi-head latent attention",
        "",
        "The latent cache's bytes per token and one decode step of an MLA layer, expanded (keys and values "
        "made from the latents) and absorbed (`absorb_latents`: attention on the latents), against a plain "
        "layer with the same heads (bench/mla.py; `python -m bench.sections mla`).",
        "",
        mla.mla_table(mla_results, mla_config),
        "",
        "## Shared keys and values",
        "",
        "The KV cache of a stack whose last layers read the cache of an earlier one (`kv_shared`, Gemma 3n and "
        "Gemma 4), against the same stack with a cache per layer, and one decode step through each "
        "(bench/shared_cache.py; `python -m bench.sections shared_cache`).",
        "",
        shared_cache.shared_table(shared_results, shared_config),
        "",
        "## Compile time",
        "",
        "torch.compile(fullgraph=True) of the layer's forward + backward (the first call, compile included) "
        "next to nn.MultiheadAttention's at the same shapes, each in a fresh process with Inductor's caches "
        "disabled (bench/compile_time.py).",
        "",
        compile_rows,
        "",
        "## Variants of today's models",
        "",
        "Each variant (docs/modern.md) against the same layer without it, taking turns run by run: what it "
        "costs. PyTorch forward: eval + no_grad, without weights (soft-capping, which SDPA cannot express, "
        "takes its blocks with their own backward; sinks go through SDPA as one more key). TensorFlow inside "
        "tf.function.",
        "",
        variants_table(variant_times, variant_config),
        "",
        "PyTorch's soft-capping (softcap=50) against the plain layer at two sizes, causal and not, next to its target:",
        "",
        softcap_table(softcap_times),
        "",
        "## int8",
        "",
        '`quantize("int8")` (docs/SPEC.md, "int8") against the same layer in float32, forward only (PyTorch '
        "eval + no_grad, TensorFlow inside tf.function), taking turns run by run; weights are the bytes of the "
        "layer's state. Goal: weights 4x smaller (0.25 minus the float biases and scales), a forward no slower "
        "than float32. PyTorch's int8 runs the scheme in float32 arithmetic (its CPU int8 matmul is slower); "
        "torchao's dynamic int8 and quantize_dynamic are other schemes on the same layer (nn.MultiheadAttention "
        "cannot be quantized). Keras' built-in is quantized the same way as ours (its EinsumDense projections).",
        "",
        *(int8_table(int8_results[config.name], config) for config in int8_configs),
        "",
        "## int8 KV cache",
        "",
        'The int8 and fp8 KV caches (`init_cache(..., dtype="int8")`, `dtype="float8_e4m3fn"`, docs/SPEC.md '
        '"KV-cache decoding") against the float32 cache (bench/int8_cache.py): bytes per token, scales included, '
        "then PyTorch's T = 1 decode step "
        "(the decode fast path, under no_grad) over each, holding the same L - 1 keys and values (it writes slot "
        f"L - 1 and attends all L), taking turns step by step in {args.rounds * 3} rounds of {int8_cache_runs} "
        "steps.",
        "",
        int8_cache_rows,
        "",
        "## The Keras 3 file on each backend",
        "",
        "Keras/Multi_Head_Attention.py against keras.layers.MultiHeadAttention with the same weights, one "
        "process per backend, taking turns run by run (bench/keras_bench.py): JAX under jax.jit "
        "(stateless_call), TensorFlow inside tf.function, torch eagerly (forward under no_grad), as each "
        "backend's users run it. Goal: at most 1.0x. Then one T = 1 decoding step of ours with a cache "
        "(JAX: under jax.jit; the built-in has no cache).",
        "",
        keras_table(keras_results, keras_config),
        "",
        "## Long sequences",
        "",
        f"Each layer in a fresh process: median time of {args.rounds} calls after a first call, and the growth "
        "of the peak resident memory during that first call (tracing included; TensorFlow's allocator keeps "
        "freed memory for later calls, so only a first call shows what a call needs). PyTorch eval + no_grad "
        "for forward; tf.function. Built-in layers whose (B, N, T, S) scores cannot fit in memory are not run.",
        "",
        long_table(long_results),
        "",
        "## TensorFlow memory: eager and tf.function",
        "",
        f"Each measurement in a fresh process, repeated in {processes} processes (medians over them, min-max in "
        "parentheses): the growth is the peak "
        "resident memory after one step (getrusage's ru_maxrss) minus the resident memory after the layer is "
        "built and the input allocated; the time is that of a second step. The process is forked from one "
        "that only imported its framework (bench/fresh.py), so its peak does not start at the benchmark's. "
        "The eager training step runs tf.GradientTape outside tf.function; PyTorch's forward is eval + "
        "no_grad. '<=' marks a growth that is an upper bound (the step did not raise the process's earlier peak).",
        "",
        memory.memory_table(memory_results, dict(memory_cases)),
        "",
    ]
    return "\n".join(report)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.benchmark", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny configurations, few runs (smoke test)")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per round (default 5, quick 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per comparison (default 3)")
    parser.add_argument(
        "--output", type=Path, help=f"where to write the Markdown results (default {RESULTS}; --quick: {QUICK_RESULTS})"
    )
    args = parser.parse_args(argv)
    args.output = output_path(args.quick, args.output)
    if args.output is None:
        parser.error(f"--quick results are smoke numbers: write them anywhere but {RESULTS}")
    with fresh.Forks() as forks:
        text = run(args, forks)
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
