"""int8 at the CPU's integer speed (docs/benchmark.md, "int8"): `python -m bench.int8_matmul`.

The PyTorch layer quantized with `quantize("int8")` against the same layer in float32, forward
under `no_grad` at B=8, T=S=256, E=1024, N=16, and each framework's int8 matmul of a projection's
shape ((2048, 1024) by (1024, 1024), int32 sums) against its float32 matmul: whether the integer
kernels run faster than float ones on this CPU. Medians of interleaved rounds (bench/timing.py).
"""

import argparse
import copy
import statistics

from bench.timing import ratio_cell, rounds_of_times

B, T, E, N = 8, 256, 1024, 16
M, D, F = B * T, E, E


def torch_calls():
    import torch

    from PyTorch import MultiHeadAttention

    torch.manual_seed(0)
    x = torch.randn(B, T, E)
    layer = MultiHeadAttention(E, N).eval()
    quantized = copy.deepcopy(layer)
    quantized.quantize("int8")
    a = torch.randint(-127, 128, (M, D), dtype=torch.int8)
    w = torch.randint(-127, 128, (F, D), dtype=torch.int8)
    af, wf = a.float(), w.float()

    def forward(module):
        def call():
            with torch.no_grad():
                module(x)

        return call

    return {
        "torch layer float32": forward(layer),
        "torch layer int8": forward(quantized),
        "torch matmul float32": lambda: torch.nn.functional.linear(af, wf),
        "torch matmul int8": lambda: torch._int_mm(a, w.t()),
    }


def tf_calls():
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    a = tf.constant(rng.integers(-127, 128, (M, D)), tf.int8)
    w = tf.constant(rng.integers(-127, 128, (D, F)), tf.int8)
    af, wf = tf.cast(a, tf.float32), tf.cast(w, tf.float32)
    integer = tf.function(lambda: tf.matmul(a, w, output_type=tf.int32))
    floats = tf.function(lambda: tf.matmul(af, wf))
    return {"tf matmul float32": lambda: floats().numpy(), "tf matmul int8": lambda: integer().numpy()}


def keras_calls():
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    a = keras.ops.convert_to_tensor(rng.integers(-127, 128, (M, D)).astype(np.int8))
    w = keras.ops.convert_to_tensor(rng.integers(-127, 128, (D, F)).astype(np.int8))
    af, wf = keras.ops.cast(a, "float32"), keras.ops.cast(w, "float32")
    return {
        f"keras ({keras.backend.backend()}) matmul float32": lambda: np.asarray(keras.ops.matmul(af, wf)),
        f"keras ({keras.backend.backend()}) matmul int8": lambda: np.asarray(keras.ops.matmul(a, w)),
    }


def int8_speed_table(runs, rounds, only=None):
    """Each group (torch, tf, keras) timed in turns, run by run: every int8 row against its
    float32 row, as Markdown table rows."""
    groups = {"torch": torch_calls, "tf": tf_calls, "keras": keras_calls}
    lines = ["| int8 call | int8 (ms) | int8 / float32 (spread) |", "|---|---|---|"]
    for name, build in groups.items():
        if only not in (None, name):
            continue
        times = rounds_of_times(build(), runs, rounds)
        labels = list(times)
        for base, int8 in zip(labels[::2], labels[1::2], strict=True):
            lines.append(
                f"| {int8} | {statistics.median(times[int8]) * 1e3:.1f} | {ratio_cell(times[int8], times[base])} |"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=("torch", "tf", "keras"), default=None)
    args = parser.parse_args(argv)
    print(int8_speed_table(args.runs, args.rounds, args.only))


if __name__ == "__main__":
    main()
