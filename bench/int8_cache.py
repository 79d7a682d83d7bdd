"""The int8 and fp8 KV caches (`init_cache(..., dtype="int8")`, `dtype="float8_e4m3fn"`, docs/SPEC.md
"KV-cache decoding") against the float32 cache: the bytes per token, scales included, and PyTorch's
T = 1 decode step (the decode fast path, as a decoding loop calls it) over each, the three taking
turns step by step in rounds.

    python -m bench.int8_cache [--quick] [--runs 10] [--rounds 5] [--threads 1]

Legend: B batch, E d_model, N num_heads, K num_kv_heads, H head_dim, L cache length.
"""

import argparse
import os
import statistics
from typing import NamedTuple


class StepConfig(NamedTuple):
    name: str
    b: int
    e: int
    n: int
    length: int
    target: float  # int8 (fp8) step / float32 step, at most


STEP_CONFIGS = (
    StepConfig("B=8 E=512 N=8 L=2048", 8, 512, 8, 2048, 1.1),
    StepConfig("B=8 E=512 N=8 L=16384", 8, 512, 8, 16384, 1.0),
)
QUICK_STEP_CONFIGS = (StepConfig("quick B=2 E=32 N=4 L=64", 2, 32, 4, 64, 1.1),)
BYTES_CONFIGS = ((512, 8, 8), (512, 8, 2), (1024, 8, 8))  # (E, N, K): H = 64, 64, 128
FLOAT32, INT8, FP8 = "float32 cache", "int8 cache", "fp8 cache"
SCALED = {INT8: "int8", FP8: "float8_e4m3fn"}  # the scaled caches: label -> `init_cache`'s dtype


def bytes_per_token(layer, dtype):
    """Bytes of one slot of `layer.init_cache(1, 1, dtype=dtype)`: keys, values and their scales."""
    cache = layer.init_cache(1, 1, dtype=dtype)
    fields = (cache.key, cache.value, cache.key_scale, cache.value_scale)
    return sum(x.numel() * x.element_size() for x in fields if x is not None)


def bytes_table(configs=BYTES_CONFIGS):
    import torch

    from PyTorch import MultiHeadAttention

    lines = [
        "| E, N, K (H) | float32 cache (bytes per token) | int8 cache, scales included (bytes per token) "
        "| fp8 cache, scales included (bytes per token) | int8 / float32 | fp8 / float32 | goal at H >= 64 | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e, n, k in configs:
        layer = MultiHeadAttention(e, n, num_kv_heads=k)
        floats = bytes_per_token(layer, torch.float32)
        int8, fp8 = (bytes_per_token(layer, dtype) for dtype in SCALED.values())
        met = "yes" if max(int8, fp8) / floats <= 0.3 else "no"
        lines.append(
            f"| {e}, {n}, {k} ({e // n}) | {floats} | {int8} | {fp8} | {int8 / floats:.3f} | {fp8 / floats:.3f} "
            f"| <= 0.3 | {met} |"
        )
    return "\n".join(lines)


def torch_steps(config):
    """{label: step}: one T = 1 call of the same layer over a float32, an int8 and an fp8 cache
    holding the same L - 1 keys and values (random, N(0, 1); the int8 and fp8 caches them quantized),
    each writing slot L - 1 and attending all L slots, every call again (the cache's index stays L - 1)."""
    import torch

    from PyTorch import Multi_Head_Attention as torch_file

    torch.manual_seed(0)
    layer = torch_file.MultiHeadAttention(config.e, config.n).eval()
    shape = (config.b, config.n, config.length, config.e // config.n)  # (B, K, L, H)
    keys, values = torch.randn(shape), torch.randn(shape)
    caches = {FLOAT32: layer.init_cache(config.b, config.length)}
    caches |= {label: layer.init_cache(config.b, config.length, dtype=dtype) for label, dtype in SCALED.items()}
    with torch.no_grad():
        caches[FLOAT32].key.copy_(keys)
        caches[FLOAT32].value.copy_(values)
        for label, (name, x) in ((label, pair) for label in SCALED for pair in (("key", keys), ("value", values))):
            field = getattr(caches[label], name)
            quantized, scale = torch_file._quantize_cache_rows(x, field.dtype)  # (B, K, L, H), (B, K, L, 1)
            field.copy_(quantized)
            getattr(caches[label], f"{name}_scale").copy_(scale)
    token = torch.randn(config.b, 1, config.e)  # (B, 1, E)

    def step(cache):
        cache = cache._replace(index=torch.tensor(config.length - 1))  # read once, then carried

        def call():
            with torch.no_grad():
                return layer(token, causal=True, cache=cache)[0]

        return call

    return {label: step(cache) for label, cache in caches.items()}


def time_steps(config, runs, rounds):
    """{label: [median seconds of each round]}, the three steps taking turns step by step."""
    from bench.timing import rounds_of_times

    return rounds_of_times(torch_steps(config), runs, rounds)


def steps_table(times, configs):
    """`times`: {config name: {label: [seconds]}}."""
    lines = [
        "| configuration | cache | step (ms) | float32 step (ms) | target | / float32 (spread) | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for config in configs:
        floats = times[config.name][FLOAT32]
        for label in SCALED:
            scaled = times[config.name][label]
            ratios = [a / b for a, b in zip(scaled, floats, strict=True)]
            median = statistics.median(ratios)
            lines.append(
                f"| {config.name} | {label} | {statistics.median(scaled) * 1e3:.3f} "
                f"| {statistics.median(floats) * 1e3:.3f} | <= {config.target}x "
                f"| **{median:.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) "
                f"| {'yes' if median <= config.target else 'no'} |"
            )
    return "\n".join(lines)


def int8_cache_section(runs, rounds, quick=False):
    """The section's Markdown: the bytes table, then the step table with the threads and the load."""
    import torch

    configs = QUICK_STEP_CONFIGS if quick else STEP_CONFIGS
    times = {config.name: time_steps(config, runs, rounds) for config in configs}
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return "\n\n".join(
        [
            bytes_table(),
            steps_table(times, configs),
            f"{torch.get_num_threads()} torch threads; load average {load} at the end ({os.cpu_count()} cores).",
        ]
    )


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.int8_cache", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke sizes")
    parser.add_argument("--runs", type=int, default=10, help="timed steps per round (default 10)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own)")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    print(int8_cache_section(args.runs, args.rounds, args.quick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
