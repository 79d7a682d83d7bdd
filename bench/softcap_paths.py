"""PyTorch's soft-capping, its paths side by side: `python -m bench.softcap_paths`.

The plain layer, the soft-capped tiles and the soft-capped blocks (docs/design.md,
"Soft-capping"; the blocks by `_cap_shift` patched to None), and any other tile sizes asked for
(`_SOFTCAP_TILES` patched), taking turns run by run in one process at the soft-capping table's
sizes (softcap=50), causal and not, forward and training step. Prints a Markdown table of each
path's ratio to the plain layer. For choosing the rule and the tile sizes on the machine at hand.

Legend: B batch, T query length, S key length, E d_model, N num_heads.
"""

import argparse
import os
import statistics
from unittest import mock

from bench import benchmark
from bench.timing import ratio_cell, rounds_of_times

SOFTCAP = 50.0


def _patched(fn, name, value):
    """`fn` run with the PyTorch file's `name` set to `value`."""
    from PyTorch import Multi_Head_Attention

    def run():
        with mock.patch.object(Multi_Head_Attention, name, value):
            return fn()

    return run


def tile_sizes(text):
    """ "512x512/256x256/256x256" -> {"forward": (512, 512), "causal forward": (256, 256), "backward": (256, 256)};
    two sizes set the forwards and the backward, one size all three."""
    sizes = [tuple(int(x) for x in part.split("x")) for part in text.split("/")]
    return {"forward": sizes[0], "causal forward": sizes[1 if len(sizes) == 3 else 0], "backward": sizes[-1]}


def time_paths(configs, runs, rounds, tiles=()):
    """{(configuration name, causal, mode): {label: [median seconds of each round]}}."""
    times = {}
    for config in configs:
        for causal in (False, True):
            plain = benchmark.torch_layers(config, causal=causal)["PyTorch ours"]
            capped = benchmark.torch_layers(config, variant={"softcap": SOFTCAP}, causal=causal)["PyTorch ours"]
            for mode in benchmark.VARIANT_MODES:
                paths = {"plain": plain[mode], "tiles": capped[mode]}
                paths["blocks"] = _patched(capped[mode], "_cap_shift", lambda softcap, dtype: None)
                paths.update(
                    {f"tiles {size}": _patched(capped[mode], "_SOFTCAP_TILES", tile_sizes(size)) for size in tiles}
                )
                times[(config.name, causal, mode)] = rounds_of_times(paths, runs, rounds)
    return times


def paths_table(times):
    labels = [label for label in next(iter(times.values())) if label != "plain"]
    lines = [
        "| configuration | causal | mode | plain (ms) | "
        + " | ".join(f"{label} / plain (spread)" for label in labels)
        + " |",
        "|---|---|---|---|" + "---|" * len(labels),
    ]
    for (name, causal, mode), measured in times.items():
        plain = measured["plain"]
        cells = " | ".join(ratio_cell(measured[label], plain) for label in labels)
        lines.append(
            f"| {name} | {'yes' if causal else 'no'} | {mode} | {statistics.median(plain) * 1e3:.1f} | {cells} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.softcap_paths", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="timed runs per round (default 1)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per comparison (default 5)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument(
        "--tiles",
        nargs="*",
        default=[],
        help="more tile sizes: forwards/backward (512x512/256x256) or forward/causal forward/backward",
    )
    parser.add_argument("--quick", action="store_true", help="the smoke size only")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    configs = benchmark.QUICK[:1] if args.quick else benchmark.SOFTCAP_CONFIGS
    times = time_paths(configs, args.runs, args.rounds, args.tiles)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"Machine: {benchmark.machine()}, {torch.get_num_threads()} threads, load average {load} at the end.")
    print(f"{args.rounds} rounds of {args.runs} runs, softcap={SOFTCAP}.\n")
    print(paths_table(times))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
