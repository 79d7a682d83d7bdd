"""A decode step on a cache the caller built, against the hand-written step
(bench/decode_anchors.py), taking turns step by step in one process.

Each timed run is one T = 1 step at cache length L with L - 1 tokens written (index L - 1), as a
beam search runs it: the cache's batch reordered (`index_select` on B with a fixed permutation,
keys, values and keep), then the step, ours on a `KVCache` rebuilt from the reordered tensors with
a fresh index tensor (`torch.tensor(L - 1)`), the hand-written step on its reordered keys and
values with the index as an int. Also timed: the step alone on a cache rebuilt with a fresh
index (a server resetting the index), and on the cache the last step returned (its index
carried, the reference), against the hand step alone. Both sides reorder the
same tensors, so "beam" differs from "step" by the same copy on both sides.

Legend: B batch, T query length (1), E d_model, N num_heads, L cache length.
"""

import statistics

import numpy as np

from bench import decode_anchors

BEAM_OURS, BEAM_HAND = "beam: reorder + ours", "beam: reorder + hand"
FRESH_OURS, FRESH_HAND = "fresh index: ours", "fresh index: hand"
CARRIED_OURS = "carried index: ours"  # the cache of the last step, as bench/decode_pair.py times it


def rebuilt_steps(config):
    """{label: step} of ours on a caller-built cache and the hand step, checked equal once."""
    import torch

    from PyTorch import KVCache, MultiHeadAttention

    x = torch.from_numpy(np.random.default_rng(0).standard_normal((config.b, config.t, config.e)).astype(np.float32))
    layer = MultiHeadAttention(config.e, config.n).eval()
    last, index = x[:, -1:], config.t - 1
    with torch.no_grad():
        _, cache = layer(x[:, :-1], causal=True, cache=layer.init_cache(config.b, config.t))  # L - 1 tokens
        projections = (layer.query, layer.key, layer.value)
        w_qkv = torch.cat([p.weight for p in projections])  # (3E, E)
        b_qkv = torch.cat([p.bias for p in projections])  # (3E,)
        hand_k, hand_v = cache.key.clone(), cache.value.clone()  # (B, N, L, H) each
    hand, output_kernel = decode_anchors.hand_module(), (layer.output.weight, layer.output.bias)
    order = torch.arange(config.b - 1, -1, -1)  # a fixed beam permutation (B,)

    def carried_ours():
        with torch.no_grad():
            return layer(last, causal=True, cache=cache)[0]

    def fresh_ours():
        with torch.no_grad():
            rebuilt = KVCache(cache.key, cache.value, cache.keep, torch.tensor(index))
            return layer(last, causal=True, cache=rebuilt)[0]

    def fresh_hand():
        with torch.no_grad():
            return hand(last, w_qkv, b_qkv, *output_kernel, hand_k, hand_v, index, config.n)

    def beam_ours():
        with torch.no_grad():
            rebuilt = KVCache(*(t.index_select(0, order) for t in cache[:3]), torch.tensor(index))
            return layer(last, causal=True, cache=rebuilt)[0]

    def beam_hand():
        with torch.no_grad():
            k, v = hand_k.index_select(0, order), hand_v.index_select(0, order)
            return hand(last, w_qkv, b_qkv, *output_kernel, k, v, index, config.n)

    np.testing.assert_allclose(fresh_hand().numpy(), fresh_ours().numpy(), rtol=0, atol=decode_anchors.HAND_ATOL)
    np.testing.assert_allclose(beam_hand().numpy(), beam_ours().numpy(), rtol=0, atol=decode_anchors.HAND_ATOL)
    steps = {CARRIED_OURS: carried_ours, FRESH_OURS: fresh_ours, FRESH_HAND: fresh_hand}
    return {**steps, BEAM_OURS: beam_ours, BEAM_HAND: beam_hand}


def time_rebuilt(config, runs, rounds):
    """{label: [median seconds of each round]}, the four steps run by run."""
    from bench.timing import rounds_of_times

    return rounds_of_times(rebuilt_steps(config), runs, rounds)


def rebuilt_table(times, configs):
    """`times`: {config name: {label: [seconds]}}; `configs`: [(config, target of ours / hand)]."""
    lines = [
        "| configuration (index L - 1) | step | ours (ms) | hand (ms) | target | ours / hand (spread) | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for config, target in configs:
        rows = (("carried index", CARRIED_OURS, FRESH_HAND), ("fresh index", FRESH_OURS, FRESH_HAND))
        for name, ours_label, hand_label in (*rows, ("beam", BEAM_OURS, BEAM_HAND)):
            ours, hand = times[config.name][ours_label], times[config.name][hand_label]
            ratios = [a / b for a, b in zip(ours, hand, strict=True)]
            median = statistics.median(ratios)
            lines.append(
                f"| {config.name} | {name} | {statistics.median(ours) * 1e3:.3f} | {statistics.median(hand) * 1e3:.3f} "
                f"| <= {target}x | **{median:.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) "
                f"| {'yes' if median <= target else 'no'} |"
            )
    return "\n".join(lines)
