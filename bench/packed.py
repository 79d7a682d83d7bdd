"""Packed sequences against the dense mask: `python -m bench.packed [--batch 1 8] [--rounds 5]`.

Rows of D documents of T / D tokens each (T = 4096, D = 8, E = 512, N = 8, causal), the PyTorch
layer called with `segment_ids` (the blocks of documents, docs/SPEC.md "Packed sequences") and
the same call with the equivalent dense boolean `attention_mask` (B, T, T) instead, taking turns
run by run in one process: the forward under `no_grad` and a training step (forward and
backward). The times first, with glibc's allocator as it is; then the peak memory, in as many
rounds again, with every allocation of 64 KiB or more mapped on its own and returned when freed
(`mallopt`), so that the resident memory follows the live tensors: a call's peak is VmHWM after
it less VmRSS before it (/proc/self/clear_refs resets VmHWM). The ids and the dense mask are
made once, outside the calls. Prints a Markdown table of the medians and of the ratios packed / dense with their
spread (the lowest and highest round's ratio).

Legend: B batch, T query length (S = T), E d_model, N num_heads, D documents a row.
"""

import argparse
import ctypes
import os
import statistics
import time
from pathlib import Path

from bench.timing import ratio_cell

T, E, N, DOCUMENTS = 4096, 512, 8, 8


def _rss_mib(field):
    """VmRSS or VmHWM (peak) of this process, in MiB, from /proc/self/status."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) / 1024


def measured(fn):
    """(seconds, peak RSS growth in MiB) of one call of `fn`."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS
    before, start = _rss_mib("VmRSS"), time.perf_counter()
    fn()
    return time.perf_counter() - start, _rss_mib("VmHWM") - before


def map_each_allocation():
    """glibc's malloc from now on: allocations of 64 KiB or more mapped each on its own and
    unmapped when freed, memory at the heap's top returned as soon as 64 KiB are free."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 << 10)
    libc.mallopt(m_trim_threshold, 64 << 10)


def calls(batch):
    """{(mode, label): callable}: the forward and the training step, packed and dense."""
    import torch

    from PyTorch.Multi_Head_Attention import MultiHeadAttention

    torch.manual_seed(0)
    layer, x = MultiHeadAttention(E, N), torch.randn(batch, T, E)
    ids = torch.arange(T).div(T // DOCUMENTS, rounding_mode="floor").expand(batch, T).contiguous()  # (B, T)
    dense = ids[:, :, None] == ids[:, None, :]  # (B, T, T)
    arguments = {"packed": {"segment_ids": ids}, "dense": {"attention_mask": dense}}

    def forward(kwargs):
        def run():
            with torch.no_grad():
                layer(x, causal=True, **kwargs)

        return run

    def train(kwargs):
        def run():
            layer.zero_grad(set_to_none=True)
            layer(x, causal=True, **kwargs).sum().backward()

        return run

    modes = {"forward": forward, "train step": train}
    return {(mode, label): make(kwargs) for mode, make in modes.items() for label, kwargs in arguments.items()}


def rounds(fns, count, warmup=1):
    """{key: [(seconds, MiB) of each round]}: the callables take turns, one run each a round."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    results = {key: [] for key in fns}
    for _ in range(count):
        for key, fn in fns.items():
            results[key].append(measured(fn))
    return results


def table(results_by_batch):
    lines = [
        "| configuration | mode | dense (ms) | packed (ms) | packed / dense time (spread) "
        "| dense peak (MiB) | packed peak (MiB) | packed / dense peak (spread) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for batch, results in results_by_batch.items():
        for mode in ("forward", "train step"):
            dense, packed = results.get((mode, "dense")), results.get((mode, "packed"))
            if dense is None:
                continue
            times = [[r[0] for r in x] for x in (dense["time"], packed["time"])]
            peaks = [[r[1] for r in x] for x in (dense["memory"], packed["memory"])]
            config = f"B={batch} T=S={T} E={E} N={N}, {DOCUMENTS} documents, causal"
            lines.append(
                f"| {config} | {mode} | {statistics.median(times[0]) * 1e3:.0f} | "
                f"{statistics.median(times[1]) * 1e3:.0f} | {ratio_cell(times[1], times[0])} | "
                f"{statistics.median(peaks[0]):.0f} | {statistics.median(peaks[1]):.0f} | "
                f"{ratio_cell(peaks[1], peaks[0])} |"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.packed", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="*", default=[1], help="batch sizes (default 1)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of one run each (default 5)")
    parser.add_argument("--forward-only", action="store_true", help="no training step")
    args = parser.parse_args(argv)
    import torch

    from bench.benchmark import machine

    fns = {}
    for batch in args.batch:
        fns[batch] = {key: fn for key, fn in calls(batch).items() if key[0] == "forward" or not args.forward_only}
    times = {batch: rounds(fns[batch], args.rounds) for batch in args.batch}
    map_each_allocation()
    peaks = {batch: rounds(fns[batch], args.rounds) for batch in args.batch}
    results = {b: {key: {"time": times[b][key], "memory": peaks[b][key]} for key in times[b]} for b in args.batch}
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"Machine: {machine()}, {torch.get_num_threads()} threads, load average {load} at the end.")
    print(f"{args.rounds} rounds of 1 run after a warm-up run, packed and dense taking turns; as many for the peaks.\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
