"""Benchmark: our layers against the built-in ones, measured side by side in one run.

`python -m bench.benchmark` (or `make bench`) times, per configuration, the median of at least
10 runs after warm-up of: our PyTorch layer and `torch.nn.MultiheadAttention` (eval + no_grad for
inference, its fast path), our TensorFlow layer and `keras.layers.MultiHeadAttention` (both inside
`tf.function`), for a forward pass without weights, a forward pass with weights, and a training
step (forward + backward). It prints ours / built-in per row, the fraction of the framework's own
matmul throughput (measured in the same run) each achieves, and the peak memory of the long
configuration, and writes bench/results.md. `--quick` runs a tiny configuration.

Legend: B batch, T query length, S key/value length, E d_model, N num_heads, K num_kv_heads.
"""

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESULTS = Path(__file__).with_name("results.md")
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
LONG = CONFIGS[2]


def median_times(fns, runs, warmup=3):
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


def median_time(fn, runs):
    return median_times({"": fn}, runs)[""]


def torch_matmul_flops(runs):
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048**3 / median_time(lambda: a @ b, runs)


def tf_matmul_flops(runs):
    import tensorflow as tf

    a, b = tf.random.normal((2048, 2048)), tf.random.normal((2048, 2048))
    matmul = tf.function(tf.matmul)
    return 2 * 2048**3 / median_time(lambda: matmul(a, b).numpy(), runs)


def torch_layers(config):
    """{label: {mode: callable}} for ours and the built-in; None where a mode does not apply."""
    import torch

    from PyTorch import MultiHeadAttention

    x = torch.randn(config.b, config.t, config.e)
    ours = MultiHeadAttention(config.e, config.n, num_kv_heads=config.k)
    layers = {"PyTorch ours": ours}
    if config.k is None:
        layers["nn.MultiheadAttention"] = ours.to_torch()

    def calls(label, layer):
        builtin = label != "PyTorch ours"

        def forward(weights):
            if builtin:
                return layer(x, x, x, need_weights=weights, average_attn_weights=False)
            return layer(x, return_attention=weights)

        def inference(weights):
            layer.eval()
            with torch.no_grad():
                forward(weights)

        xg = x.clone().requires_grad_()

        def train():
            layer.train()
            result = layer(xg, xg, xg, need_weights=False)[0] if builtin else layer(xg)
            result.sum().backward()

        return {"forward": lambda: inference(False), "forward+weights": lambda: inference(True), "train step": train}

    return {label: calls(label, layer) for label, layer in layers.items()}


def tf_layers(config):
    import tensorflow as tf

    from TensorFlow import MultiHeadAttention

    x = tf.random.normal((config.b, config.t, config.e))
    ours = MultiHeadAttention(config.e, config.n, num_kv_heads=config.k)
    ours(x)
    builtin = ours.to_keras()
    layers = {"TensorFlow ours": ours, "keras " + type(builtin).__name__: builtin}

    def calls(label, layer):
        theirs = label.startswith("keras")

        def forward(weights, training=False):
            if theirs:
                return layer(x, x, return_attention_scores=weights, training=training)
            return layer(x, return_attention=weights, training=training)

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

    return {label: calls(label, layer) for label, layer in layers.items()}


def time_config(config, runs):
    """Rows of (framework, label, mode, seconds) for one configuration."""
    rows = []
    for framework, build in (("PyTorch", torch_layers), ("TensorFlow", tf_layers)):
        layers = build(config)
        for mode in MODES:
            medians = median_times({label: calls[mode] for label, calls in layers.items()}, runs)
            rows += [(framework, label, mode, seconds) for label, seconds in medians.items()]
    return rows


def peak_memory(config, which):
    """Peak memory growth (MiB) of one forward pass (no weights), measured in a fresh process."""
    code = (
        "import sys, json; sys.path.insert(0, '.'); from bench.benchmark import _measure; "
        f"print(json.dumps(_measure({dataclasses.astuple(config)!r}, {which!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1]
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rss_mib(field):
    """VmRSS or VmHWM (peak) of this process, in MiB, from /proc/self/status."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) / 1024


def _measure(fields, which):
    """Peak RSS growth (MiB) of one warmed-up forward call. The peak is reset through
    /proc/self/clear_refs (getrusage's ru_maxrss is inherited from the parent, so useless here)."""
    config = Config(*fields)
    framework = "PyTorch" if which in ("PyTorch ours", "nn.MultiheadAttention") else "TensorFlow"
    forward = (torch_layers if framework == "PyTorch" else tf_layers)(config)[which]["forward"]
    forward()  # tracing and first-call allocations are not the layer's steady state
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    except OSError:
        return "n/a (needs Linux /proc)"
    before = _rss_mib("VmRSS")
    forward()
    return round(_rss_mib("VmHWM") - before, 1)


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


def table(rows, flops_per_second, configs):
    by_key = {(c, f, label, m): s for c, rows_c in rows.items() for f, label, m, s in rows_c}
    lines = [
        "| configuration | mode | framework | ours (ms) | built-in (ms) | ours / built-in "
        "| ours % of matmul peak | built-in % of matmul peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for config in configs:
        for framework in ("PyTorch", "TensorFlow"):
            labels = [label for c, f, label, _ in by_key if c == config.name and f == framework]
            ours_label = f"{framework} ours"
            others = [label for label in dict.fromkeys(labels) if label != ours_label]
            for mode in MODES:
                ours = by_key[(config.name, framework, ours_label, mode)]
                rate = config.flops(mode) / flops_per_second[framework]
                cells = [config.name, mode, framework, f"{ours * 1e3:.1f}"]
                if others:
                    theirs = by_key[(config.name, framework, others[0], mode)]
                    cells += [
                        f"{theirs * 1e3:.1f} ({others[0]})",
                        f"**{ours / theirs:.2f}x**",
                        f"{rate / ours:.0%}",
                        f"{rate / theirs:.0%}",
                    ]
                else:
                    cells += ["n/a (GQA)", "-", f"{rate / ours:.0%}", "-"]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.benchmark", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny configuration, a few runs (smoke test)")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per measurement (default 10, quick 3)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="where to write the Markdown results")
    args = parser.parse_args(argv)
    configs, runs = (QUICK, args.runs or 3) if args.quick else (CONFIGS, args.runs or 10)
    flops = {"PyTorch": torch_matmul_flops(runs), "TensorFlow": tf_matmul_flops(runs)}
    rows = {}
    for index, config in enumerate(configs, 1):
        print(f"[{index}/{len(configs)}] {config.name}", file=sys.stderr, flush=True)
        rows[config.name] = time_config(config, runs)
    memory_config = configs[0] if args.quick else LONG
    labels = ["PyTorch ours", "nn.MultiheadAttention", "TensorFlow ours", "keras MultiHeadAttention"]
    memory = {label: peak_memory(memory_config, label) for label in labels}
    report = [
        "# Benchmark results",
        "",
        f"Machine: {machine()}.",
        f"Matmul throughput measured in this run (2048x2048 float32): PyTorch {flops['PyTorch'] / 1e9:.0f} GFLOP/s, "
        f"TensorFlow {flops['TensorFlow'] / 1e9:.0f} GFLOP/s. Median of {runs} runs after 3 warm-up runs, "
        "ours and the built-in taking turns run by run; CPU float32.",
        "PyTorch inference runs in eval mode under no_grad (the built-in's fast path); "
        "TensorFlow runs inside tf.function.",
        "",
        table(rows, flops, configs),
        "",
        f"Peak memory of one forward pass without weights, {memory_config.name}: growth of the peak resident "
        "memory over a warmed-up call, each layer in a fresh process.",
        "",
        "| layer | peak growth (MiB) |",
        "|---|---|",
        *(f"| {label} | {growth} |" for label, growth in memory.items()),
        "",
    ]
    text = "\n".join(report)
    print(text)
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
