"""GPU benchmark of the PyTorch layer against `torch.nn.MultiheadAttention`, in one run.

`python -m bench.cuda` on a machine with CUDA (no TensorFlow needed) writes
bench/results_cuda.md: the forward pass without weights, with per-head weights, and a training
step, in float32 and bfloat16, timed as `make bench` times the CPU (rounds of runs, ours and the
built-in taking turns run by run, median ratio and min-max spread over the rounds; each run ends
with `torch.cuda.synchronize()`), and the peak GPU memory of one call of each; then, at the
smallest size, inference with ours captured in CUDA graphs (`torch.compile(mode="reduce-overhead")`).

Legend: B batch, T query length, S key/value length, E d_model, N num_heads, K num_kv_heads.
"""

import argparse
import functools
import statistics
import sys
from pathlib import Path

from bench.benchmark import MODES, Config, torch_layers
from bench.timing import ratio_cell, rounds_of_times

RESULTS = Path(__file__).with_name("results_cuda.md")
CONFIGS = [
    Config("B=8 T=S=512 E=512 N=8", 8, 512, 512, 8),
    Config("B=4 T=S=4096 E=1024 N=16", 4, 4096, 1024, 16),
    Config("GQA B=8 T=S=2048 E=1024 N=16 K=4", 8, 2048, 1024, 16, 4),
]
DTYPES = ("float32", "bfloat16")


def synchronized(call):
    import torch

    def run():
        call()
        torch.cuda.synchronize()

    return run


def peak_mib(call):
    """Peak GPU memory allocated during one call, above what was allocated before it, in MiB."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def measure(config, dtype, runs, rounds):
    """{mode: {label: (seconds of each round, peak MiB)}}."""
    import torch

    layers = torch_layers(config, "cuda", getattr(torch, dtype))
    results = {}
    for mode in MODES:
        calls = {label: synchronized(modes[mode]) for label, modes in layers.items()}
        times = rounds_of_times(calls, runs, rounds)
        results[mode] = {label: (times[label], peak_mib(calls[label])) for label in calls}
    return results


def graph_calls(config, dtype):
    """{mode: {label: callable}}: inference by ours, by ours under
    `torch.compile(mode="reduce-overhead")` (CUDA graphs: one launch for the whole call), and by
    the built-in (a native op)."""
    import torch

    from PyTorch import MultiHeadAttention

    x = torch.randn(config.b, config.t, config.e, device="cuda", dtype=dtype)
    layer = MultiHeadAttention(config.e, config.n, device="cuda", dtype=dtype).eval()
    builtin = layer.to_torch().eval()

    def inference(call):
        def run():
            with torch.no_grad():
                call()

        return run

    calls = {}
    for mode, weights in (("forward", False), ("forward+weights", True)):
        ours = functools.partial(layer, return_attention=weights)
        graphs = torch.compile(ours, mode="reduce-overhead", fullgraph=True)
        theirs = functools.partial(builtin, need_weights=weights, average_attn_weights=False)
        calls[mode] = {
            "ours": inference(functools.partial(ours, x)),
            "ours, CUDA graphs": inference(functools.partial(graphs, x)),
            "built-in": inference(functools.partial(theirs, x, x, x)),
        }
    return calls


def measure_graphs(config, dtype, runs, rounds):
    """{mode: {label: seconds of each round}}."""
    import torch

    return {
        mode: rounds_of_times({label: synchronized(call) for label, call in calls.items()}, runs, rounds)
        for mode, calls in graph_calls(config, getattr(torch, dtype)).items()
    }


def graphs_table(measured):
    lines = [
        "| configuration | dtype | mode | ours (ms) | ours, CUDA graphs (ms) | built-in (ms) "
        "| ours / built-in (spread) | CUDA graphs / built-in (spread) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (config, dtype), modes in measured.items():
        for mode, times in modes.items():
            ours, graphs, builtin = times["ours"], times["ours, CUDA graphs"], times["built-in"]
            cells = [config.name, dtype, mode, *(f"{statistics.median(t) * 1e3:.3f}" for t in (ours, graphs, builtin))]
            cells += [ratio_cell(ours, builtin), ratio_cell(graphs, builtin)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(measured):
    lines = [
        "| configuration | dtype | mode | ours (ms) | built-in (ms) | ours / built-in (spread) "
        "| ours peak (MiB) | built-in peak (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (config, dtype), modes in measured.items():
        for mode, by_label in modes.items():
            (ours, ours_peak), *others = by_label.values()
            cells = [config.name, dtype, mode, f"{statistics.median(ours) * 1e3:.2f}"]
            if others:
                theirs, their_peak = others[0]
                cells += [f"{statistics.median(theirs) * 1e3:.2f}", ratio_cell(ours, theirs), f"{ours_peak:.0f}"]
                cells.append(f"{their_peak:.0f}")
            else:
                cells += ["n/a (GQA)", "-", f"{ours_peak:.0f}", "-"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    import torch

    parser = argparse.ArgumentParser(prog="python -m bench.cuda", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="timed runs per round (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per comparison (default 3)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="where to write the Markdown results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device (this benchmark runs the PyTorch layer on a GPU)", file=sys.stderr)
        return 2
    measured, graphs = {}, {}
    for config in CONFIGS:
        for dtype in DTYPES:
            print(f"{config.name} {dtype}", file=sys.stderr, flush=True)
            measured[(config, dtype)] = measure(config, dtype, args.runs, args.rounds)
    for dtype in DTYPES:
        print(f"{CONFIGS[0].name} {dtype} CUDA graphs", file=sys.stderr, flush=True)
        graphs[(CONFIGS[0], dtype)] = measure_graphs(CONFIGS[0], dtype, args.runs, args.rounds)
    text = "\n".join(
        [
            "# GPU benchmark results",
            "",
            f"Machine: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}. "
            f"Each comparison: {args.rounds} rounds of {args.runs} timed runs after 2 warm-up runs, ours and "
            "nn.MultiheadAttention taking turns run by run, each run ending with torch.cuda.synchronize(); times "
            "are the median over the rounds of each round's median, ratios the median of the rounds' ratios with "
            "their min-max spread. Inference in eval mode under no_grad (the built-in's fast path). Peak: GPU "
            "memory allocated during one call above what was allocated before it.",
            "",
            table(measured),
            "",
            "## Small calls: CUDA graphs",
            "",
            f"At {CONFIGS[0].name} a call takes well under a millisecond, and ours spends it launching kernels from "
            'Python (the built-in\'s inference is one native op). Under `torch.compile(mode="reduce-overhead", '
            "fullgraph=True)` the whole call is one CUDA graph. Inference, same rounds.",
            "",
            graphs_table(graphs),
            "",
        ]
    )
    print(text)
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
