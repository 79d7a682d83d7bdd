"""TensorFlow's decode step at B = 1 in the runtimes TensorFlow users serve with, beside
PyTorch's fast step: a 32-step loop in which each step's cache (input and output) feeds the next.

Each loop starts with L - 33 tokens in the cache and decodes 32 tokens one at a time
(T = 1, causal); a measurement is the loop's time / 32, in a fresh process per framework
(bench/fresh.py), its timed loops taking turns. Rows:
- PyTorch ours, the decode fast path: `output, cache = layer(x, causal=True, cache=cache)`
  under `torch.no_grad`;
- TensorFlow ours in `tf.function`, and in `tf.function(jit_compile=True)` (XLA);
- TensorFlow ours exported through the TFLite converter and run in LiteRT's interpreter
  (set_tensor, invoke, get_tensor per step), as docs/serving.md exports it;
- the floors: each TensorFlow runtime running a step that only doubles x (B, 1, E), with the same
  inputs and outputs as the step (the cache passed through); and the attention alone over the
  in-place cache's variables (x read as the query's heads, `softmax(q k^T / sqrt(H)) v`: no
  projection, mask or cache write), the least a step computes, in tf.function and in XLA; the same
  attention in PyTorch; and XLA's trivial call plus PyTorch's attention alone (the least an XLA
  step can cost: its runtime's call and the attention at the speed PyTorch computes it).

`python -m bench.tf_serving_step [--rounds R]` prints the table.

Legend: B batch (1), T query length (1), E d_model, N num_heads, H head_dim, L cache length.
"""

import argparse
import statistics

import numpy as np

from bench.benchmark import DECODE_ANCHORS, Config

STEPS = 32  # decode steps a loop times
CONFIG = DECODE_ANCHORS[0][0]  # B=1 E=256 N=4 L=1024
TORCH_FAST = "PyTorch ours (fast step)"
TORCH_ATTENTION = "PyTorch, attention alone"
XLA_FLOOR = "XLA, x * 2, x alone + PyTorch, attention alone"
TF_ROWS = (
    "TensorFlow tf.function",
    "TensorFlow XLA (jit_compile)",
    "LiteRT interpreter",
    "TensorFlow tf.function, in-place cache",
    "TensorFlow XLA, in-place cache",
)
FLOORS = (
    "tf.function, x * 2",
    "XLA, x * 2",
    "LiteRT, x * 2",
    "tf.function, x * 2, x alone",
    "XLA, x * 2, x alone",
    "tf.function, attention alone",
    "XLA, attention alone",
)


def _inputs(config):
    rng = np.random.default_rng(0)
    prompt = rng.standard_normal((config.b, config.t - STEPS - 1, config.e)).astype(np.float32)
    steps = rng.standard_normal((STEPS, config.b, 1, config.e)).astype(np.float32)
    return prompt, steps


def _loop_times(loops, rounds, runs=3):
    """{label: [median seconds a step of each round]}: the loops take turns, run by run."""
    from bench.timing import rounds_of_times

    times = rounds_of_times(loops, runs, rounds)
    return {label: [t / STEPS for t in values] for label, values in times.items()}


def torch_times(name, b, t, e, n, rounds):
    """PyTorch ours: a 32-step loop on the decode fast path (a fresh process, bench/fresh.py)."""
    import torch

    from PyTorch import MultiHeadAttention

    config = Config(name, b, t, e, n)
    torch.manual_seed(0)
    layer = MultiHeadAttention(e, n).eval()
    prompt, steps = (torch.from_numpy(a) for a in _inputs(config))
    with torch.no_grad():
        _, filled = layer(prompt, causal=True, cache=layer.init_cache(b, t))

    def loop():
        cache = filled._replace(key=filled.key.clone(), value=filled.value.clone(), index=filled.index.clone())
        with torch.no_grad():
            for x in steps:
                _, cache = layer(x, causal=True, cache=cache)

    def attention():
        with torch.no_grad():
            for x in steps:
                q = x.reshape(b, 1, n, -1).transpose(1, 2)  # (B, 1, E) -> (B, N, 1, H)
                scores = q @ filled.key.transpose(2, 3) * q.shape[-1] ** -0.5  # (B, N, 1, L)
                output = torch.softmax(scores, dim=-1) @ filled.value  # (B, N, 1, H)
        output.numpy()

    return _loop_times({TORCH_FAST: loop, TORCH_ATTENTION: attention}, rounds)


def _tf_step(layer, config, jit_compile):
    """The step as a `tf.function` of (x, key, value, keep, index) -> (output, key, value, keep, index)."""
    import tensorflow as tf

    from TensorFlow import KVCache

    cache = layer.init_cache(config.b, config.t)
    signature = [
        tf.TensorSpec((config.b, 1, config.e), tf.float32, name="x"),
        tf.TensorSpec(cache.key.shape, tf.float32, name="key"),
        tf.TensorSpec(cache.value.shape, tf.float32, name="value"),
        tf.TensorSpec(cache.keep.shape, tf.bool, name="keep"),
        tf.TensorSpec((), tf.int32, name="index"),
    ]

    def step(x, key, value, keep, index):
        output, cache = layer(x, causal=True, cache=KVCache(key, value, keep, index))
        return output, cache.key, cache.value, cache.keep, cache.index

    def floor(x, key, value, keep, index):
        return x * 2.0, key, value, keep, index

    return (tf.function(fn, input_signature=signature, jit_compile=jit_compile) for fn in (step, floor))


def _tf_in_place_steps(layer, prompt, config):
    """The step with the in-place cache (`init_cache(..., in_place=True)`, docs/serving.md) as a
    `tf.function` of x alone, in tf.function and in XLA, the floors of x alone (x * 2, the attention
    alone over the cache), and the cache's index to set back before each loop. (The TFLite
    converter does not convert this step: the cache's variables are written inside a `tf.cond`,
    which it cannot functionalize.)"""
    import tensorflow as tf

    _, cache = layer(prompt, causal=True, cache=layer.init_cache(config.b, config.t, in_place=True))
    signature = [tf.TensorSpec((config.b, 1, config.e), tf.float32, name="x")]

    def step(x):
        return (layer(x, causal=True, cache=cache)[0],)

    def floor(x):
        return (x * 2.0,)

    def attention(x):
        q = tf.transpose(tf.reshape(x, (config.b, 1, config.n, -1)), (0, 2, 1, 3))  # (B, 1, E) -> (B, N, 1, H)
        scores = tf.matmul(q, cache.key, transpose_b=True) * q.shape[-1] ** -0.5  # (B, N, 1, L)
        return (tf.matmul(tf.nn.softmax(scores), cache.value),)  # (B, N, 1, H)

    functions = [
        tf.function(fn, input_signature=signature, jit_compile=jit)
        for jit in (False, True)
        for fn in (step, floor, attention)
    ]
    return functions, cache.index, int(cache.index.numpy())


def _litert(function, layer):
    """A `tf.function` through the TFLite converter into LiteRT's interpreter: a callable of the
    step's five inputs giving its five outputs."""
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    from shared_tests.runtimes import quietly

    concrete = function.get_concrete_function()
    converter = tf.lite.TFLiteConverter.from_concrete_functions([concrete], layer)
    converter.experimental_lower_to_saved_model = False  # lowered, the layer's variables read as garbage
    interpreter = Interpreter(model_content=quietly(converter.convert))
    interpreter.allocate_tensors()
    inputs = {_input_name(d["name"]): d["index"] for d in interpreter.get_input_details()}
    order = [inputs[name] for name in ("x", "key", "value", "keep", "index")]
    outputs = interpreter.get_output_details()  # in the step's order

    def run(*arrays):
        for index, array in zip(order, arrays, strict=True):
            interpreter.set_tensor(index, array)
        interpreter.invoke()
        return [interpreter.get_tensor(d["index"]) for d in outputs]

    return run


def _input_name(name):
    """A converted input's name ("serving_default_key:0", "key") -> the step's argument name ("key")."""
    return name.removeprefix("serving_default_").split(":")[0]


def tf_times(name, b, t, e, n, rounds):
    """TensorFlow ours in tf.function, XLA and LiteRT, and each runtime's floor (a fresh process)."""
    import tensorflow as tf

    from TensorFlow import MultiHeadAttention

    config = Config(name, b, t, e, n)
    tf.random.set_seed(0)
    layer = MultiHeadAttention(e, n)
    prompt, steps = _inputs(config)
    _, filled = layer(prompt, causal=True, cache=layer.init_cache(b, t))
    initial = [np.asarray(a) for a in (filled.key, filled.value, filled.keep, filled.index)]
    step, floor = _tf_step(layer, config, jit_compile=False)
    xla_step, xla_floor = _tf_step(layer, config, jit_compile=True)
    functions, index, start = _tf_in_place_steps(MultiHeadAttention(e, n), prompt, config)
    in_place, in_place_floor, in_place_attention, in_place_xla, in_place_xla_floor, in_place_xla_attention = functions
    runtimes = {
        TF_ROWS[0]: step,
        TF_ROWS[1]: xla_step,
        TF_ROWS[2]: _litert(step, layer),
        TF_ROWS[3]: in_place,
        TF_ROWS[4]: in_place_xla,
        FLOORS[0]: floor,
        FLOORS[1]: xla_floor,
        FLOORS[2]: _litert(floor, layer),
        FLOORS[3]: in_place_floor,
        FLOORS[4]: in_place_xla_floor,
        FLOORS[5]: in_place_attention,
        FLOORS[6]: in_place_xla_attention,
    }

    def loop_of(run, label):
        alone = "in-place" in label or "alone" in label  # the step of x alone (the cache in variables)
        first = [] if alone else [tf.constant(a) for a in initial] if "LiteRT" not in label else initial
        xs = list(steps) if "LiteRT" in label else [tf.constant(x) for x in steps]

        def loop():
            index.assign(start)
            cache = first
            for x in xs:
                output, *cache = run(x, *cache)
            np.asarray(output)  # the last output read, as a server reads each token's

        return loop

    loops = {label: loop_of(run, label) for label, run in runtimes.items()}
    return _loop_times(loops, rounds)


def measure(rounds):
    """{label: [seconds a step, per round]} of every row. Each round is a fresh PyTorch process
    and then a fresh TensorFlow one (bench/fresh.py), so that the two frameworks' rounds run next
    to each other in time on a machine whose load changes."""
    from bench.fresh import Forks

    args = [CONFIG.name, CONFIG.b, CONFIG.t, CONFIG.e, CONFIG.n, 1]
    times = {}
    with Forks() as forks:
        for _ in range(rounds):
            for backend, function in (("torch", "torch_times"), ("tensorflow", "tf_times")):
                result = forks.run(backend, "bench.tf_serving_step", function, args)
                if "error" in result:
                    raise RuntimeError(result["error"])
                for label, values in result.items():
                    times.setdefault(label, []).extend(values)
    return times


def table(times):
    """The rows: ms a step (median of the rounds), ratio to PyTorch's fast step (median and spread)."""
    torch_rounds = times[TORCH_FAST]
    lines = [
        f"| {CONFIG.name}, {STEPS}-step loop | ms a step (median) | / PyTorch fast step (spread) |",
        "|---|---|---|",
    ]
    times = times | {XLA_FLOOR: [a + b for a, b in zip(times[FLOORS[4]], times[TORCH_ATTENTION], strict=True)]}
    for label in (TORCH_FAST, *TF_ROWS, *FLOORS, TORCH_ATTENTION, XLA_FLOOR):
        values = times[label]
        ratios = [a / b for a, b in zip(values, torch_rounds, strict=True)]
        spread = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        lines.append(f"| {label} | {statistics.median(values) * 1e3:.3f} | {spread} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds, each a fresh PyTorch and TensorFlow process timing 3 loops (default 5)",
    )
    args = parser.parse_args(argv)
    print(table(measure(args.rounds)))


if __name__ == "__main__":
    main()
