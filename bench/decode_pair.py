"""PyTorch ours against the hand-written decode (bench/decode_anchors.py), taking turns step by
step in one process before TensorFlow is imported: on a loaded 2-core machine a PyTorch step
timed after TensorFlow's steps waits for TensorFlow's spinning threads, so this pair is timed
apart from the anchor table's other steps.

Legend: B batch, T query length (1), E d_model, N num_heads, L cache length.
"""

import statistics

import numpy as np

from bench import decode_anchors


def time_torch_pair(config, runs, rounds):
    """{label: [median seconds of each round]} of PyTorch ours and the hand decode, run by run."""
    from bench.timing import rounds_of_times

    x = np.random.default_rng(0).standard_normal((config.b, config.t, config.e)).astype(np.float32)
    steps, _ = decode_anchors.torch_steps(config, x)
    return rounds_of_times(steps, runs, rounds)


def pair_table(times, configs):
    """`times`: {config name: {label: [seconds]}}; `configs`: [(config, target of ours / hand)]."""
    lines = [
        "| configuration | PyTorch ours (ms) | hand PyTorch (ms) | target | ours / hand (spread) | met |",
        "|---|---|---|---|---|---|",
    ]
    for config, target in configs:
        ours, hand = times[config.name][decode_anchors.TORCH_OURS], times[config.name][decode_anchors.HAND]
        ratios = [a / b for a, b in zip(ours, hand, strict=True)]
        median, met = statistics.median(ratios), "yes" if statistics.median(ratios) <= target else "no"
        lines.append(
            f"| {config.name} | {statistics.median(ours) * 1e3:.3f} | {statistics.median(hand) * 1e3:.3f} "
            f"| <= {target}x | **{median:.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) | {met} |"
        )
    return "\n".join(lines)
