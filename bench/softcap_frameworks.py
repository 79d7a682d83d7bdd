"""Soft-capping in the TensorFlow file and in the Keras file on each backend, beside PyTorch's
(`python -m bench.softcap_paths`, and the soft-capping table of `make bench`).

Each file's layer with softcap=50 against the same layer without it, at the soft-capping table's
sizes, causal and not, forward and training step, the two taking turns run by run in a fresh
process per file and backend (bench/fresh.py). Each runs the way its users run it
(bench/keras_bench.py): the TensorFlow file and Keras on TensorFlow inside `tf.function`, Keras on
JAX under `jax.jit`, Keras on torch eagerly (forward under `torch.no_grad`).

`python -m bench.softcap_frameworks [--runs N] [--rounds R] [--quick]` prints the table.

Legend: B batch, T query length, S key length, E d_model, N num_heads.
"""

import argparse
import os
import statistics

from bench import benchmark
from bench.timing import ratio_cell, rounds_of_times

SOFTCAP = 50.0
MODES = ("forward", "train step")
FILES = (("TensorFlow", "tensorflow"), ("Keras", "tensorflow"), ("Keras", "jax"), ("Keras", "torch"))


def measure(framework, backend, b, t, e, n, runs, rounds):
    """{"<causal> <mode>": {"plain": [seconds], "capped": [seconds]}} of one file on one backend,
    in this process (KERAS_BACKEND set by its server)."""
    import importlib

    import keras
    import numpy as np

    from bench import keras_bench

    layer_class = importlib.import_module(framework).MultiHeadAttention
    x = keras.ops.convert_to_tensor(np.random.default_rng(0).standard_normal((b, t, e)).astype("float32"))
    plain, capped = layer_class(e, n), layer_class(e, n, softcap=SOFTCAP)
    plain(x), capped(x)
    capped.set_weights(plain.get_weights())
    build = keras_bench.CALLS["tensorflow" if framework == "TensorFlow" else backend]
    times = {}
    for causal in (False, True):
        calls = {name: build(layer, x, True, causal=causal) for name, layer in (("plain", plain), ("capped", capped))}
        for mode in MODES:
            times[f"{causal} {mode}"] = rounds_of_times({name: c[mode] for name, c in calls.items()}, runs, rounds)
    return times


def measure_all(configs, runs, rounds):
    """{(file, configuration name, causal, mode): {"plain": [...], "capped": [...]}}."""
    from bench.fresh import Forks

    times = {}
    with Forks() as forks:
        for framework, backend in FILES:
            label = framework if framework == "TensorFlow" else f"Keras on {backend}"
            for config in configs:
                args = [framework, backend, config.b, config.t, config.e, config.n, runs, rounds]
                result = forks.run(backend, "bench.softcap_frameworks", "measure", args)
                if "error" in result:
                    raise RuntimeError(result["error"])
                for key, measured in result.items():
                    causal, mode = key.split(" ", 1)
                    times[(label, config.name, causal == "True", mode)] = measured
    return times


def table(times):
    lines = [
        "| file | configuration | causal | mode | plain (ms) | soft-capped (ms) | soft-capped / plain (spread) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (label, name, causal, mode), measured in times.items():
        plain, capped = measured["plain"], measured["capped"]
        lines.append(
            f"| {label} | {name} | {'yes' if causal else 'no'} | {mode} | {statistics.median(plain) * 1e3:.1f} "
            f"| {statistics.median(capped) * 1e3:.1f} | {ratio_cell(capped, plain)} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.softcap_frameworks", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="timed runs per round (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per comparison (default 3)")
    parser.add_argument("--quick", action="store_true", help="the smoke size only")
    args = parser.parse_args(argv)
    configs = benchmark.QUICK[:1] if args.quick else benchmark.SOFTCAP_CONFIGS
    times = measure_all(configs, args.runs, args.rounds)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"Machine: {benchmark.machine()}, load average {load} at the end.")
    print(f"{args.rounds} rounds of {args.runs} runs, softcap={SOFTCAP}.\n")
    print(table(times))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
