"""Some sections of `make bench`, measured apart: `python -m bench.sections variants int8 int8_cache keras memory
decode mla shared_cache`.

Each section runs the same functions as the full benchmark (bench/benchmark.py), with its
configuration, rounds and runs, and prints its Markdown table; the whole goes to
out/bench_sections.md (never to bench/results.md, which holds one full run). For re-measuring
what a change touched without the hour of a full run. `--quick` runs the decode and int8_cache
sections at their smoke sizes.
"""

import argparse
import sys
from pathlib import Path

from bench import (
    benchmark,
    compile_time,
    decode_anchors,
    decode_pair,
    decode_rebuilt,
    fresh,
    int8_cache,
    int8_matmul,
    keras_decode,
    memory,
    mla,
    shared_cache,
)

OUTPUT = Path(__file__).parents[1] / "out" / "bench_sections.md"


def _variants(runs, rounds, forks):
    """Each variant against the plain layer, then PyTorch's soft-capping at both sizes, causal and
    not, next to its target."""
    config = benchmark.VARIANT_CONFIGS[0]
    variants = benchmark.variants_table(benchmark.time_variants(config, runs, rounds), config)
    softcap = benchmark.softcap_table(benchmark.time_softcap(benchmark.SOFTCAP_CONFIGS, runs, rounds))
    return f"{variants}\n\n{softcap}"


def _int8(runs, rounds, forks):
    tables = [benchmark.int8_table(benchmark.time_int8(c, runs, rounds), c) for c in benchmark.INT8_CONFIGS]
    return "\n\n".join([*tables, int8_matmul.int8_speed_table(runs, rounds)])


def _int8_cache(runs, rounds, forks, quick=False):
    """The int8 KV cache's bytes per token and PyTorch's decode step over it against the float cache's."""
    return int8_cache.int8_cache_section(runs, rounds, quick)


def _keras(runs, rounds, forks):
    config = benchmark.CONFIGS[0]
    return benchmark.keras_table(benchmark.time_keras(config, runs, rounds, forks), config)


def _memory(runs, rounds, forks):
    """The memory rows in one process each (the full run repeats each in three)."""
    cases = benchmark.MEMORY
    return memory.memory_table(memory.measure_all(cases, 1, forks), dict(cases))


def _decode(runs, rounds, forks, quick=False):
    """The decoding step against its anchors (PyTorch and TensorFlow; the Keras file under jax.jit
    against a hand-written keras.ops step), each ratio next to its target, and the compile time
    of the layer's forward + backward next to nn.MultiheadAttention's (a fresh process each)."""
    anchors = benchmark.QUICK_DECODE_ANCHORS if quick else benchmark.DECODE_ANCHORS
    step_runs = 3 if quick else benchmark.DECODE_ANCHOR_RUNS
    pairs = {config.name: decode_pair.time_torch_pair(config, step_runs, rounds * 3) for config, _ in anchors}
    rebuilt = {config.name: decode_rebuilt.time_rebuilt(config, step_runs, rounds * 3) for config, _ in anchors}
    times = {config.name: benchmark.time_decode_anchors(config, step_runs, rounds) for config, _ in anchors}
    keras_times = keras_decode.keras_decode_times([config for config, _ in anchors], step_runs, rounds, forks)
    compiled = benchmark.QUICK[0] if quick else benchmark.CONFIGS[0]
    compile_times = compile_time.compile_times(compiled)
    return "\n\n".join(
        [
            decode_pair.pair_table(pairs, anchors),
            decode_rebuilt.rebuilt_table(rebuilt, anchors),
            decode_anchors.anchor_tables(times, anchors),
            keras_decode.keras_decode_table(keras_times),
            compile_time.compile_table(compile_times, compiled),
        ]
    )


def _mla(runs, rounds, forks):
    return mla.mla_table(mla.time_mla(runs, rounds))


def _shared_cache(runs, rounds, forks):
    return shared_cache.shared_table(shared_cache.time_shared(runs, rounds))


SECTIONS = {
    "variants": _variants, "int8": _int8, "int8_cache": _int8_cache, "keras": _keras, "memory": _memory,
    "decode": _decode, "mla": _mla, "shared_cache": _shared_cache,
}  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.sections", description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="+", choices=sorted(SECTIONS), help="the sections to measure")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per round (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per comparison (default 3)")
    parser.add_argument("--quick", action="store_true", help="the decode and int8_cache sections at their smoke sizes")
    args = parser.parse_args(argv)
    report = [f"# Benchmark sections\n\nMachine: {benchmark.machine()}. {args.rounds} rounds of {args.runs} runs."]
    with fresh.Forks() as forks:
        for name in args.sections:
            print(name, file=sys.stderr, flush=True)
            options = {"quick": True} if args.quick and name in ("decode", "int8_cache") else {}
            report += [f"## {name}", SECTIONS[name](args.runs, args.rounds, forks, **options)]
    text = "\n\n".join(report) + "\n"
    print(text)
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
