"""Packed sequences against the dense mask: `python -m bench.packed [--framework PyTorch] [--batch 1 8]`.

Rows of D documents of T / D tokens each (T = 4096, D = 8, E = 512, N = 8, causal): the layer
called with `segment_ids` (docs/SPEC.md, "Packed sequences": the PyTorch file's blocks of
documents, the TensorFlow file's memory-efficient path over each chunk's documents), the same
call with the equivalent dense boolean `attention_mask` (B, T, T) instead, and the call with
neither (causal only: what the projections and one attention over all keys cost), taking turns
run by run in one process: the forward (PyTorch: under `no_grad`) and, in PyTorch, a training
step (forward and backward). The times with glibc's allocator as it is; the peak memory in as
many rounds again by a fresh process of this script whose allocator maps every allocation of
64 KiB or more on its own and returns it when freed (`mallopt`), so that the resident memory
follows the live tensors: a call's peak is VmHWM after it less VmRSS before it
(/proc/self/clear_refs resets VmHWM). The ids and the dense mask are made once, outside the
calls. Prints a Markdown table of the medians and of the ratios packed / dense with their spread
(the lowest and highest round's ratio).

Legend: B batch, T query length (S = T), E d_model, N num_heads, D documents a row.
"""

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.timing import ratio_cell

T, E, N, DOCUMENTS = 4096, 512, 8, 8
LABELS = ("dense", "packed", "causal only")


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


def _ids(batch):
    """(B, T) ids of D documents a row, and the (B, T, T) boolean mask they stand for."""
    import numpy as np

    ids = np.repeat(np.arange(DOCUMENTS), T // DOCUMENTS)[None].repeat(batch, 0)  # (B, T)
    return ids, ids[:, :, None] == ids[:, None, :]  # (B, T), (B, T, T)


def torch_calls(batch):
    """{(mode, label): callable}: the forward and the training step of the PyTorch file."""
    import torch

    from PyTorch.Multi_Head_Attention import MultiHeadAttention

    torch.manual_seed(0)
    layer, x = MultiHeadAttention(E, N), torch.randn(batch, T, E)
    ids, dense = (torch.as_tensor(a) for a in _ids(batch))
    arguments = dict(zip(LABELS, ({"attention_mask": dense}, {"segment_ids": ids}, {}), strict=True))

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


def tf_calls(batch):
    """{(mode, label): callable}: the forward of the TensorFlow file, eagerly (its
    memory-efficient path runs as one `tf.function`)."""
    import tensorflow as tf

    from TensorFlow.Multi_Head_Attention import MultiHeadAttention

    tf.random.set_seed(0)
    layer, x = MultiHeadAttention(E, N), tf.random.normal((batch, T, E))
    ids, dense = (tf.constant(a) for a in _ids(batch))
    arguments = dict(zip(LABELS, ({"attention_mask": dense}, {"segment_ids": ids}, {}), strict=True))

    def forward(kwargs):
        return lambda: layer(x, causal=True, **kwargs).numpy()

    return {("forward", label): forward(kwargs) for label, kwargs in arguments.items()}


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


def table(framework, results_by_batch):
    lines = [
        "| configuration | mode | dense (ms) | packed (ms) | causal only (ms) | packed / dense time (spread) "
        "| dense peak (MiB) | packed peak (MiB) | causal only peak (MiB) | packed / dense peak (spread) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for batch, results in results_by_batch.items():
        for mode in ("forward", "train step"):
            if (mode, "dense") not in results:
                continue
            times = [[r[0] for r in results[(mode, label)]["time"]] for label in LABELS]
            peaks = [[r[1] for r in results[(mode, label)]["memory"]] for label in LABELS]
            config = f"{framework} B={batch} T=S={T} E={E} N={N}, {DOCUMENTS} documents, causal"
            cells = [f"{statistics.median(x) * 1e3:.0f}" for x in times] + [ratio_cell(times[1], times[0])]
            cells += [f"{statistics.median(x):.0f}" for x in peaks] + [ratio_cell(peaks[1], peaks[0])]
            lines.append(f"| {config} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peaks_in_child(args, batch):
    """{key: [(seconds, MiB) of each round]} measured by fresh processes of this script (`--peaks`),
    whose allocator maps each allocation from their start (`map_each_allocation`): freed heap
    memory of earlier calls would hide a call's growth. PyTorch: one process, the calls taking
    turns after a warm-up. TensorFlow keeps what a call allocated for the next ones (a second
    call grows by its output only), so there a process per call and round measures its first
    call (its tracing included, alike for every call)."""
    command = [sys.executable, "-m", "bench.packed", "--peaks", "--batch", str(batch)]
    command += ["--framework", args.framework] + (["--forward-only"] if args.forward_only else [])
    command += ["--threads", str(args.threads)] if args.threads else []
    if args.framework == "PyTorch":
        return _child([*command, "--rounds", str(args.rounds)])
    peaks = {("forward", label): [] for label in LABELS}
    for _ in range(args.rounds):
        for label in LABELS:
            peaks[("forward", label)] += _child([*command, "--rounds", "1", "--label", label])[("forward", label)]
    return peaks


def _child(command):
    output = subprocess.run(command, capture_output=True, text=True, check=True)
    return {tuple(key.split("/")): value for key, value in json.loads(output.stdout.splitlines()[-1]).items()}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.packed", description=__doc__.splitlines()[0])
    parser.add_argument("--framework", default="PyTorch", choices=["PyTorch", "TensorFlow"])
    parser.add_argument("--batch", type=int, nargs="*", default=[1], help="batch sizes (default 1)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of one run each (default 5)")
    parser.add_argument("--forward-only", action="store_true", help="no training step")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads / TensorFlow's op threads")
    parser.add_argument("--peaks", action="store_true", help="(the child process) print the peaks as JSON")
    parser.add_argument("--label", choices=LABELS, help="(a TensorFlow child process) its first call of this one only")
    args = parser.parse_args(argv)
    if args.peaks:
        map_each_allocation()
    if args.threads and args.framework == "PyTorch":
        import torch

        torch.set_num_threads(args.threads)
    elif args.threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    def selected(batch):
        fns = (torch_calls if args.framework == "PyTorch" else tf_calls)(batch)
        return {key: fn for key, fn in fns.items() if key[0] == "forward" or not args.forward_only}

    if args.peaks:
        fns = {key: fn for key, fn in selected(args.batch[0]).items() if args.label in (None, key[1])}
        measured_rounds = rounds(fns, args.rounds, warmup=0 if args.label else 1)
        print(json.dumps({"/".join(key): value for key, value in measured_rounds.items()}))
        return 0
    from bench.benchmark import machine

    results = {}
    for batch in args.batch:
        times = rounds(selected(batch), args.rounds)
        peaks = peaks_in_child(args, batch)
        results[batch] = {key: {"time": times[key], "memory": peaks[key]} for key in times}
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    threads = args.threads or "the framework's own number of"
    print(f"Machine: {machine()}, {threads} threads, load average {load} at the end.")
    print(f"{args.rounds} rounds of 1 run after a warm-up run, the calls taking turns; as many for the peaks.\n")
    print(table(args.framework, results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
