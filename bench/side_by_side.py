"""A layer file against itself at another git revision, side by side in one process: the forward,
the training step and the decode step (B=1 and B=8) of the working tree's file and of the
revision's, in interleaved runs and rounds (bench/timing.py), as ratios new / old with their
spread. For a change that should not move the speed (a restructuring), every ratio is about 1.

    .venv/bin/python -m bench.side_by_side --rev main~3 [--frameworks PyTorch,TensorFlow,Keras] [--quick]

The Keras file runs on the backend KERAS_BACKEND names (TensorFlow by default).
"""

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

import numpy as np

from bench.timing import ratio_cell, rounds_of_times

FORWARD = {"b": 8, "t": 256, "e": 512, "n": 8}
DECODE = {"e": 512, "n": 8, "length": 1024, "prefill": 512}


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def old_file(rev, framework, folder):
    """The layer file of `framework` at `rev`, written into `folder`."""
    source = subprocess.run(
        ["git", "show", f"{rev}:{framework}/Multi_Head_Attention.py"], capture_output=True, text=True, check=True
    ).stdout
    path = os.path.join(folder, f"old_{framework}.py")
    with open(path, "w") as handle:
        handle.write(source)
    return path


def torch_calls(module):
    """{label: callable} of one PyTorch layer file."""
    import torch

    torch.manual_seed(0)
    b, t, e, n = FORWARD.values()
    layer, x = module.MultiHeadAttention(e, n).eval(), torch.randn(b, t, e)

    def forward():
        with torch.no_grad():
            layer(x, causal=True)

    def train():
        layer.zero_grad()
        layer(x, causal=True).sum().backward()

    calls = {"forward": forward, "train step": train}
    for batch in (1, 8):
        calls[f"decode B={batch}"] = _torch_decode(layer, batch)
    return calls


def _torch_decode(layer, batch):
    """One decode step of a cache that each step passes on, restarted at the prefill's index."""
    import torch

    e, _, length, prefill = DECODE.values()
    with torch.no_grad():
        cache = layer.init_cache(batch, length)
        _, cache = layer(torch.randn(batch, prefill, e), causal=True, cache=cache)
    token, start, state = torch.randn(batch, 1, e), cache.index.clone(), [cache]

    def step():
        with torch.no_grad():
            if int(state[0].index) >= length - 1:
                state[0].index.copy_(start)
            _, state[0] = layer(token, causal=True, cache=state[0])

    return step


def keras_calls(module):
    """{label: callable} of a TensorFlow or Keras layer file (tf.function forward and train step,
    eager decode steps), on the TensorFlow backend."""
    import tensorflow as tf

    b, t, e, n = FORWARD.values()
    layer, x = module.MultiHeadAttention(e, n), tf.constant(np.random.default_rng(0).normal(size=(b, t, e)), tf.float32)
    layer(x)
    forward = tf.function(lambda: layer(x, causal=True))

    @tf.function
    def train():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x, causal=True, training=True))
        return tape.gradient(loss, layer.trainable_weights)

    return {"forward": lambda: forward().numpy(), "train step": lambda: [g.numpy() for g in train()]}


def compare(framework, rev, runs, rounds):
    folder = tempfile.mkdtemp()
    new = load(os.path.join(framework, "Multi_Head_Attention.py"), f"new_{framework}")
    old = load(old_file(rev, framework, folder), f"old_{framework}")
    make = torch_calls if framework == "PyTorch" else keras_calls
    new_calls, old_calls = make(new), make(old)
    fns = {**{("new", k): v for k, v in new_calls.items()}, **{("old", k): v for k, v in old_calls.items()}}
    times = rounds_of_times(fns, runs, rounds)
    for label in new_calls:
        print(f"| {framework} | {label} | {ratio_cell(times[('new', label)], times[('old', label)])} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="main")
    parser.add_argument("--frameworks", default="PyTorch,TensorFlow,Keras")
    parser.add_argument("--quick", action="store_true", help="3 runs x 2 rounds instead of 15 x 5")
    args = parser.parse_args(argv)
    runs, rounds = (3, 2) if args.quick else (15, 5)
    print(f"| file | measured | new / old ({args.rev}), median of {rounds} rounds (spread) |\n|---|---|---|")
    for framework in args.frameworks.split(","):
        compare(framework, args.rev, runs, rounds)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, os.getcwd())
    main()
