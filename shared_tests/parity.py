"""The cross-framework parity report: `python -m shared_tests.parity` (or `make parity`).

For every case of the shared table, one portable weight dict is loaded into the PyTorch, the
TensorFlow and the NumPy layer; their outputs, attention weights and gradients are compared
pairwise against the SPEC tolerances, and every masked position must hold a weight of exactly 0.
A second table decodes the KV-cache cases (shared_tests/decoding.py) chunk by chunk on every
path: outputs and weights are compared between frameworks and against one full causal pass,
and the final caches must be equal. With `--keras tensorflow,jax,torch` (as `make parity` runs
it) the Keras file runs every case on each Keras backend, in a process per backend, in the
columns `keras:tensorflow`, `keras:jax` and `keras:torch`, each against NumPy. Exit status 1 on
any FAIL. `--model FILE.py` runs only the comparison of a user's PyTorch and Keras models, layer
by layer (shared_tests/model_parity.py).

A FAIL row is followed by what failed: the quantity, its value and its tolerance. A path that
raises is an error of its row, never the end of the report. After the tables, one line per path
(and per reason a case was left out) says how many cases did not run there and why (`--verbose`
lists them); the report ends with the two summary lines and the time it took.

This module is the report (selection, tables, progress, arguments); the rows come from
shared_tests/comparisons.py, the paths from shared_tests/frameworks.py.
"""

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import resource
import shutil
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from shared_tests import keras_backends, runtimes
from shared_tests.cases import CASES_BY_NAME, REPORT_CASES, make_data
from shared_tests.comparisons import (
    DECODE_FRAMEWORK_PATHS,
    DECODE_QUANTITIES,
    DYNAMIC_LABEL,
    FRAMEWORK_PATHS,
    PAIRS,
    QUANTITIES,
    RUNTIMES_LABEL,
    Ran,
    judge,
    judge_decode,
    label,
    raised,
    run_decode_paths,
    run_each,
    run_paths,
)

# The `name as name` imports re-export what the tests reach through the report (`parity.compare`, `parity.run`).
from shared_tests.comparisons import compare as compare
from shared_tests.comparisons import compare_decode as compare_decode
from shared_tests.comparisons import diff as diff
from shared_tests.comparisons import removed_positions as removed_positions
from shared_tests.comparisons import run_case as run_case
from shared_tests.comparisons import run_decode_case as run_decode_case
from shared_tests.comparisons import tolerance as tolerance
from shared_tests.decoding import DECODE_CASES_BY_NAME, DECODE_PATHS, REPORT_DECODE_CASES, make_decode_data
from shared_tests.frameworks import PATHS
from shared_tests.frameworks import run as run
from shared_tests.runtimes import DYNAMIC_PATHS, RUNTIME_PATHS


def _fmt(value):
    return "-" if value is None else "inf" if value == math.inf else f"{value:.0e}"


def _row_lines(row, cells):
    """The row, and under a FAIL row each failure: quantity, value and tolerance, or the error."""
    status = f"{'ok' if row.zeros else 'NO':<7}{'PASS' if row.passed else 'FAIL'}"
    failures = [f"    FAIL: {failure}" for failure in row.failures]
    return [f"{row.case:<27} {row.dtype:<9} {cells}{status}", *failures, *(f"    note: {note}" for note in row.notes)]


def _cells(diffs, labels, quantities, gap):
    """The table cells of one row: `-` where a group has no value (its paths did not run)."""
    return "".join(
        "".join(f"{_fmt(diffs.get(label, {}).get(q)):<6}" for q in quantities[label]) + gap[label] for label in labels
    )


def format_table(rows):
    labels = [*(label(pair) for pair in PAIRS), RUNTIMES_LABEL]
    groups = "".join(f"{label:<21}" for label in labels) + f"{DYNAMIC_LABEL:<14}"
    head = f"{'case':<27} {'dtype':<9} {groups}zeros  status"
    sub = f"{'':<27} {'':<9} " + "out   wts   grad   " * (len(PAIRS) + 1) + "out           "
    lines = [head, sub, "-" * len(head)]
    quantities = {**dict.fromkeys(labels, QUANTITIES), DYNAMIC_LABEL: ("output",)}
    gaps = {**dict.fromkeys(labels, "   "), DYNAMIC_LABEL: "        "}
    for row in rows:
        lines += _row_lines(row, _cells(row.diffs, [*labels, DYNAMIC_LABEL], quantities, gaps))
    lines.append("-" * len(head))
    return "\n".join(lines)


def _counted(by_reason, verbose):
    """`n reason` for each reason (joined by `; `), and with `verbose` each followed by its cases."""
    return "; ".join(
        f"{len(names)} {'case' if len(names) == 1 else 'cases'}" + (f" ({', '.join(names)})" if verbose else "")
        + f": {reason}"
        for reason, names in by_reason.items()
    )  # fmt: skip


def format_not_run(rows, dropped, skipped_paths=(), verbose=False):
    """After the tables: one line for the cases left out (`dropped`: (name, reason) pairs), one
    per path that could not run some cases, and one per path not run at all (`skipped_paths`:
    (paths, reason) pairs): how many and why; `verbose` names the cases. Empty when all ran."""
    by_reason, by_path = {}, {}
    for name, reason in dropped:
        by_reason.setdefault(reason, []).append(name)
    for row in rows:
        for path, reason in row.skipped.items():
            by_path.setdefault(path, {}).setdefault(reason, []).append(row.case)
    lines = [f"  cases left out: {_counted(by_reason, verbose)}"] if by_reason else []
    width = max((len(path) for path in by_path), default=0)
    lines += [f"  {path:<{width}}  {_counted(reasons, verbose)}" for path, reasons in by_path.items()]
    lines += [f"  {', '.join(paths)}: not run, {reason}" for paths, reason in skipped_paths]
    if not lines:
        return ""
    title = "Not run (cases by reason):" if verbose else "Not run (how many cases and why; --verbose names them):"
    return "\n".join([title, *lines])


LINE_WIDTH = 300  # no line of the report is longer: longer lines (reasons, errors) wrap


def wrapped(text, width=LINE_WIDTH):
    """`text` with each line longer than `width` wrapped, its continuation lines indented 4 more
    than the line itself."""
    lines = []
    for line in text.splitlines():
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        lines += [line] if len(line) <= width else textwrap.wrap(line, width, subsequent_indent=indent)
    return "\n".join(lines)


def cpu_line():
    """The CPU time of this process and of the processes it started (workers, Keras backends)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = [usage.ru_utime + usage.ru_stime for usage in (own, children)]
    return f"CPU time: {_duration(seconds[0])} in this process, {_duration(seconds[1])} in the processes it started"


def _duration(seconds):
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def format_decode_table(rows):
    groups = "".join(f"{label(pair):<21}" for pair in PAIRS) + f"{'decode/full':<14}"
    head = f"{'decode case':<27} {'dtype':<9} {groups}zeros  status"
    sub = f"{'':<27} {'':<9} " + "out   wts   cache  " * len(PAIRS) + "out   wts     "
    lines = [head, sub, "-" * len(head)]
    labels = [*(label(pair) for pair in PAIRS), "decode/full"]
    quantities = {**dict.fromkeys(labels, DECODE_QUANTITIES), "decode/full": ("output", "weights")}
    gaps = {**dict.fromkeys(labels, "   "), "decode/full": "  "}
    for row in rows:
        lines += _row_lines(row, _cells(row.diffs, labels, quantities, gaps))
    lines.append("-" * len(head))
    return "\n".join(lines)


def summary(rows, what="cases"):
    """The summary line of one table: how many of its rows PASS and FAIL."""
    passed, noted = sum(row.passed for row in rows), sum(bool(row.notes) for row in rows)
    notes = f" ({noted} ill-conditioned with these weights: see the notes under their rows)" if noted else ""
    return f"{passed}/{len(rows)} {what} PASS{notes}, {len(rows) - passed} FAIL"


def plot(case, results, path):
    """Per-head attention weights of batch element 0: PyTorch, TensorFlow and |difference|."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    torch_w, tf_w = results["torch:explicit"].weights[0], results["tf:eager"].weights[0]  # (N, T, S)
    panels = (("PyTorch", torch_w), ("TensorFlow", tf_w), ("|PyTorch - TensorFlow|", np.abs(torch_w - tf_w)))
    fig, axes = plt.subplots(case.n, 3, figsize=(10, 2.6 * case.n + 0.6), squeeze=False, layout="constrained")
    for head in range(case.n):
        for col, (title, weights) in enumerate(panels):
            ax = axes[head, col]
            image = ax.imshow(weights[head], cmap="magma" if col < 2 else "viridis", aspect="auto")
            ax.set_title(f"{title}, head {head}", fontsize=8)
            ax.set_xlabel("key s", fontsize=7)
            ax.set_ylabel("query t", fontsize=7)
            # Every tick label written out (1e-08, not an offset "1e-8" drawn over the panel's title).
            colorbar = fig.colorbar(image, ax=ax, fraction=0.046, format="%.0e" if col == 2 else "%.2g")
            colorbar.ax.tick_params(labelsize=7)
    fig.suptitle(f"case {case.name}: attention weights, batch 0")
    fig.savefig(path, dpi=110)
    plt.close(fig)


PROJECTIONS = ("query", "key", "value", "output")
LOW_PRECISION_REASON = (
    "float16 and bfloat16 tolerances are stated for the table's Glorot-scale weights; --weights runs float32 cases"
)

SELF_ATTENTION_REASON = (
    "key and value are the query there, so kdim == vdim == d_model; the file has kdim={kdim}, vdim={vdim}, d_model={e}"
)


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """The configuration an exported weight file fits, in the case table's field names.

    `fields`: e, n, k, h, kdim, vdim, bias; `features`: the variants that carry weights
    (`qk_norm`, `sinks`), set on a case only where its table has the field."""

    fields: dict
    features: dict

    @property
    def fits_self_attention(self):
        return self.fields["kdim"] == self.fields["vdim"] == self.fields["e"]


def _num_heads(weights, nh, kh, num_heads, num_kv_heads):
    """N: --num-heads, or what the file tells (`sinks` (N,), a per-head `query_norm` (H,)), or
    the query width over the head width that --num-kv-heads gives."""
    if num_heads is not None:
        return num_heads
    if "sinks" in weights:
        return weights["sinks"].shape[0]
    if "query_norm" in weights and 0 < weights["query_norm"].shape[0] < nh:
        return nh // weights["query_norm"].shape[0]
    if num_kv_heads and kh % num_kv_heads == 0 and nh % (kh // num_kv_heads) == 0:
        return nh // (kh // num_kv_heads)
    raise ValueError(
        f"the shapes do not tell the number of heads (query width N*H={nh}, key/value width K*H={kh}): pass "
        f"--num-heads N (or --num-kv-heads K). Received: --num-heads={num_heads}, --num-kv-heads={num_kv_heads}"
    )


def load_user_weights(path, num_heads=None, num_kv_heads=None):
    """Reads an exported `.npz`; returns (weights, WeightLayout) or raises ValueError.

    The layout comes from the shapes (E, kdim, vdim, N*H, K*H, which biases, QK-norm, sinks)
    plus N, from --num-heads, the file's `sinks` or per-head norm, or --num-kv-heads."""
    with np.load(path, allow_pickle=False) as archive:
        weights = {name: archive[name] for name in archive.files}
    required = [f"{name}_kernel" for name in PROJECTIONS]
    missing = [name for name in required if name not in weights]
    if missing:
        raise ValueError(
            f"{path} is not a portable weight file: missing {', '.join(missing)}. Received: {sorted(weights)}"
        )
    e, nh = weights["query_kernel"].shape
    kh = weights["key_kernel"].shape[1]
    n = _num_heads(weights, nh, kh, num_heads, num_kv_heads)
    h = nh // n if n > 0 and nh % n == 0 else 0
    k = kh // h if h and kh % h == 0 else 0
    if not (k and n % k == 0 and num_kv_heads in (None, k)):
        raise ValueError(
            f"--num-heads must divide the query width N*H={nh} and give a whole number of key/value heads "
            f"(K*H={kh}) that divides it. Received: --num-heads={n}, --num-kv-heads={num_kv_heads}"
        )
    biases = tuple(name for name in PROJECTIONS if f"{name}_bias" in weights)
    norm = weights.get("query_norm")
    fields = dict(
        e=e, n=n, k=k, h=h, kdim=weights["key_kernel"].shape[0], vdim=weights["value_kernel"].shape[0],
        bias={PROJECTIONS: True, (): False}.get(biases, biases),  # a tuple: only some projections have one
    )  # fmt: skip
    features = {
        "qk_norm": None if norm is None else "head" if norm.shape == (h,) else "all",
        "sinks": "sinks" in weights,
    }
    return weights, WeightLayout(fields, features)


def fit_case(case, layout, weights, **changes):
    """The case with the file's layout, or (None, why it cannot run with it)."""
    from NumPy import MultiHeadAttention

    fields = {field.name for field in dataclasses.fields(case)}
    unknown = [name for name, value in layout.features.items() if value and name not in fields]
    if unknown:
        return None, f"the file holds {', '.join(unknown)} weights, which these cases have no field to configure"
    features = {name: value for name, value in layout.features.items() if name in fields}
    try:
        fitted = dataclasses.replace(case, **{**layout.fields, **features, **changes})
        shapes = MultiHeadAttention(**fitted.config).weight_shapes()
    except (TypeError, ValueError) as error:
        return None, f"its own settings do not fit the file's layout: {error}"
    given = {name: tuple(array.shape) for name, array in weights.items()}
    if shapes != given:
        return None, f"its layer's weights {shapes} are not the file's {given}"
    return fitted, None


def _keep_or_drop(cases, layout, weights, needs_self, changes):
    """(cases to run with the file's layout, [(name, reason)] of those that cannot)."""
    kept, dropped = [], []
    for case in cases:
        fitted, reason = None, LOW_PRECISION_REASON
        if case.dtype == "float32" and needs_self(case) and not layout.fits_self_attention:
            reason = SELF_ATTENTION_REASON.format(**layout.fields)
        elif case.dtype == "float32":
            fitted, reason = fit_case(case, layout, weights, **changes(case))
        if fitted is None:
            dropped.append((case.name, reason))
        else:
            kept.append(fitted)
    return kept, dropped


def select_cases(names, layout=None, weights=None):
    """The cases named by --case (all without it), with the file's layout under --weights;
    returns (cases, [(name, reason)] of those left out)."""
    cases = [CASES_BY_NAME[name] for name in names if name in CASES_BY_NAME] if names else REPORT_CASES
    if layout is None:
        return cases, []
    return _keep_or_drop(cases, layout, weights, lambda case: case.self_attention, lambda case: {})


def select_decode_cases(names, layout=None, weights=None):
    """The decode cases named by --case (all without it), with the file's layout under
    --weights (key and value passed apart only in the cases that do); returns (cases, [(name,
    reason)] of those left out)."""
    cases = (
        [DECODE_CASES_BY_NAME[name] for name in names if name in DECODE_CASES_BY_NAME] if names else REPORT_DECODE_CASES
    )
    if layout is None:
        return cases, []

    def widths(case):
        return {} if case.cross else {"kdim": None, "vdim": None}

    return _keep_or_drop(cases, layout, weights, lambda case: not case.cross, widths)


MAX_JOBS = 4
JOBS = min(os.cpu_count() or 1, MAX_JOBS)  # worker processes by default
PARALLEL_FROM = 12  # cases (attention and decode) from which the worker processes start
EXPORT_CACHE = Path(__file__).resolve().parent.parent / "out" / "exports"  # the runtimes' kept exports
JAX_COMPILE_CACHE = "jax"  # the folder in the export cache where the Keras JAX process keeps its compiled programs
PROGRESS_GROUP = 10  # cases per progress line when piped or under CI


class Progress:
    """The progress of one table on stderr. On a terminal (and $CI unset): one line rewritten in
    place with the case running, how many are done and remain, and an estimate of the time left.
    Piped or under CI: a plain line per finished group of PROGRESS_GROUP cases, and at the end."""

    def __init__(self, what, total, stream=None, live=None):
        self.what, self.total, self.stream = what, total, stream or sys.stderr
        self.live = self.stream.isatty() and not os.environ.get("CI") if live is None else live
        self.started = time.perf_counter()

    def _left(self, done):
        if not done:
            return "time left not known yet"
        seconds = (time.perf_counter() - self.started) / done * (self.total - done)
        return f"about {_duration(seconds)} left"

    def running(self, done, name):
        """Case `name` starts, `done` cases of the table finished."""
        if self.live:
            left = f"{self.total - done} to go, {self._left(done)}"
            line = f"{self.what}: {done}/{self.total} done, {left}; running {name}"
            width = shutil.get_terminal_size().columns - 1  # a longer line would wrap, and \r not rewrite it
            print(f"\r{line[:width]:<{width}}", end="", file=self.stream, flush=True)

    def finished(self, done):
        """`done` cases of the table finished."""
        if not self.live and (done % PROGRESS_GROUP == 0 or done == self.total):
            elapsed = _duration(time.perf_counter() - self.started)
            left = "" if done == self.total else f", {self._left(done)}"
            line = f"{self.what}: {done}/{self.total} done in {elapsed}{left}"
            print(line, file=self.stream, flush=True)

    def close(self):
        if self.live:
            print("\r" + " " * (shutil.get_terminal_size().columns - 1) + "\r", end="", file=self.stream, flush=True)


def _started(pool, kind, cases, datas, options, together):
    """{case name: a function giving its `Ran`}: the cases sent to the worker processes of `pool`
    (those with the same `together(case)` to one worker, so that an export made for a group of
    cases is made once), or, without a pool, run here when the function is called."""
    run_here = run_paths if kind == "cases" else run_decode_paths
    if pool is None:
        return {case.name: functools.partial(run_here, case, datas[case.name], **options) for case in cases}
    units = {}
    for case in cases:
        units.setdefault(together(case), []).append(case)
    ran = {}
    for unit in units.values():
        future = pool.submit(run_each, kind, [(case, datas[case.name]) for case in unit], options)
        ran.update({case.name: functools.partial(_ran_in, future, index) for index, case in enumerate(unit)})
    return ran


def _ran_in(future, index):
    """The `Ran` of one case of a worker's unit; a worker that died is an error of each of its cases."""
    try:
        return future.result()[index]
    except Exception as error:  # the report goes on; every row of the unit says what happened
        return Ran(errors=[raised("worker process", error)])


def _run_all(cases, datas, ran, finish, what):
    """The rows of one table, in table order, and the first case's results: `ran[name]()` gives
    what the paths run apart gave, `finish(case, data, ran)` adds the Keras paths and judges."""
    rows, first_results, progress = [], None, Progress(what, len(cases))
    for index, case in enumerate(cases):
        progress.running(index, case.name)
        row, results = finish(case, datas[case.name], ran[case.name]())
        rows.append(row)
        first_results = first_results or results
        progress.finished(index + 1)
    progress.close()
    return rows, first_results


def _pool(jobs, count):
    """Worker processes for the paths run outside the Keras processes (spawned: nothing of this
    process's TensorFlow or torch state is forked), or None to run them here: one job, or fewer
    cases than PARALLEL_FROM (a worker starts by importing TensorFlow and torch)."""
    if jobs <= 1 or count < PARALLEL_FROM:
        return None
    return concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))


def describe_device(device):
    import torch

    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{device} ({name}, torch {torch.__version__})"


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m shared_tests.parity", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--case",
        action="append",
        choices=sorted(CASES_BY_NAME | DECODE_CASES_BY_NAME),
        metavar="NAME",
        help="run this case or decode case (repeatable)",
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw the per-head weights of the first case run")
    parser.add_argument("--weights", metavar="FILE.npz", help="run the float32 cases through your own exported weights")
    parser.add_argument(
        "--num-heads", "--heads", type=int, help="N of the layer that exported --weights (if its shapes do not tell)"
    )
    parser.add_argument(
        "--num-kv-heads", "--kv-heads", type=int, help="K of that layer (enough without --num-heads, or checked)"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="device of the PyTorch paths, e.g. cuda; on any other than cpu only NumPy and the PyTorch paths run",
    )
    parser.add_argument(
        "--no-runtimes",
        action="store_true",
        help="skip the deployed runtimes (ONNX Runtime, LiteRT, the exports): the quick form for iterating",
    )
    parser.add_argument("--verbose", action="store_true", help="name every case a path did not run")
    parser.add_argument(
        "--keras",
        default="",
        metavar="BACKENDS",
        help="also run Keras/Multi_Head_Attention.py on these Keras backends, each in its own process "
        "(comma separated, e.g. tensorflow,jax,torch; `make parity` runs all three)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    parser.add_argument(
        "--jobs",
        type=int,
        default=JOBS,
        metavar="N",
        help=f"worker processes for the paths outside the Keras processes; 1 runs them in this process (from "
        f"{PARALLEL_FROM} cases on; default: the number of CPUs, at most {MAX_JOBS}: %(default)s)",
    )
    parser.add_argument(
        "--export-cache",
        default=str(EXPORT_CACHE),
        metavar="FOLDER",
        help="keep the runtimes' exports here and reuse them while the layer file, the case and the exporters "
        "are the same (each is still run by its runtime), and the Keras JAX process's compiled programs in its "
        f"{JAX_COMPILE_CACHE}/ folder; '' exports and compiles every case afresh (default: %(default)s)",
    )
    parser.add_argument(
        "--model",
        metavar="FILE.py",
        help="compare your PyTorch and Keras models layer by layer instead (build_torch(), build_keras(), "
        "example_inputs() in FILE.py; docs/parity.md); only this comparison runs",
    )
    parser.add_argument("--grad", action="store_true", help="with --model: also compare the gradients of a loss")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    return parser.parse_args(argv)


NO_RUNTIMES_REASON = "--no-runtimes"
OFF_CPU_REASON = "TensorFlow and the runtimes run only with --device cpu"
WEIGHTS_DYNAMIC_REASON = (
    "the shape-polymorphic exports are made once per group of cases (runtimes.DYNAMIC_GROUPS) from the table's own "
    "layers and weights; with --weights the static-shape exports (torch:onnx, tf:onnx, tf:litert) run your file"
)


def device_error(device):
    """Why the PyTorch paths cannot run on `device` (the text after `error: `), or None."""
    import torch

    try:
        device = torch.device(device)
    except RuntimeError as error:
        return f"--device {device!r} is not a PyTorch device: {str(error).splitlines()[0]}"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device (--device cuda runs the PyTorch paths on a GPU)"
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        return f"no CUDA device {device.index} ({torch.cuda.device_count()} found)"
    return None


def _paths(args):
    """(paths, decode paths, dynamic paths, [(paths, reason)] of the paths not run at all)."""
    paths, decode_paths, dynamic_paths, reason = PATHS, DECODE_PATHS, DYNAMIC_PATHS, None
    if args.device != "cpu":
        paths = ("numpy", *(p for p in FRAMEWORK_PATHS["torch"] if p not in RUNTIME_PATHS))
        decode_paths, dynamic_paths = ("numpy", *DECODE_FRAMEWORK_PATHS["torch"]), ()
        reason = OFF_CPU_REASON
    elif args.no_runtimes:
        paths, dynamic_paths, reason = tuple(p for p in PATHS if p not in RUNTIME_PATHS), (), NO_RUNTIMES_REASON
    elif args.weights:
        return paths, decode_paths, (), [(DYNAMIC_PATHS, WEIGHTS_DYNAMIC_REASON)]
    every = dict.fromkeys([*PATHS, *DECODE_PATHS, *DYNAMIC_PATHS])
    left_out = [p for p in every if p not in {*paths, *decode_paths, *dynamic_paths}]
    return paths, decode_paths, dynamic_paths, [(left_out, reason)] if left_out else []


def main(argv=None):
    started = time.perf_counter()
    args = parse_args(argv)
    if args.model:
        from shared_tests import model_parity

        return model_parity.main([args.model, "--keras", args.keras, *["--grad"] * args.grad])
    if args.plot and args.device != "cpu":
        print("error: --plot compares PyTorch with TensorFlow, which runs only with --device cpu", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(f"{c.name:<28} {c}" for c in [*REPORT_CASES, *REPORT_DECODE_CASES]))
        return 0
    error = None if args.device == "cpu" else device_error(args.device)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    user_weights, layout = None, None
    if args.weights:
        try:
            user_weights, layout = load_user_weights(args.weights, args.num_heads, args.num_kv_heads)
        except (OSError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    cases, dropped = select_cases(args.case, layout, user_weights)
    decode_cases, decode_dropped = select_decode_cases(args.case, layout, user_weights)

    def with_user_weights(make_one):
        def make(case):
            data = make_one(case)
            return data if user_weights is None else {**data, "weights": user_weights}

        return make

    paths, decode_paths, dynamic_paths, not_run = _paths(args)
    if args.device != "cpu":
        os.environ["PARITY_TORCH_DEVICE"] = args.device
        print(f"PyTorch paths on {describe_device(args.device)}; TensorFlow and the runtimes are not run\n")
    datas = {case.name: with_user_weights(make_data)(case) for case in cases}
    decode_datas = {case.name: with_user_weights(make_decode_data)(case) for case in decode_cases}
    backends = [backend for backend in args.keras.split(",") if backend]
    unknown = [backend for backend in backends if backend not in keras_backends.KERAS_BACKENDS]
    if unknown:
        print(
            f"error: --keras takes {', '.join(keras_backends.KERAS_BACKENDS)}. Received: {args.keras}", file=sys.stderr
        )
        return 2
    if backends:
        print(f"Keras file on {', '.join(backends)} (a process per backend)", file=sys.stderr, flush=True)
        keras_backends.prefetch(
            backends,
            [(c, datas[c.name]) for c in cases],
            [(c, decode_datas[c.name]) for c in decode_cases],
            compile_cache=args.export_cache and os.path.join(args.export_cache, JAX_COMPILE_CACHE),
        )
    keras_paths = tuple(f"keras:{backend}" for backend in backends)

    def finish(case, data, ran):
        ran = ran.merged(run_paths(case, data, keras_paths))
        return judge(case, data, ran, conditioning=bool(args.weights)), ran.results

    def finish_decode(case, data, ran):
        ran = ran.merged(run_decode_paths(case, data, keras_paths))
        return judge_decode(case, data, ran), ran.results

    def together(case):
        return runtimes.dynamic_group(case) or case.name if dynamic_paths else case.name

    options = {"paths": paths, "dynamic_paths": dynamic_paths, "export_cache": args.export_cache or None}
    pool = _pool(args.jobs, len(cases) + len(decode_cases))
    try:
        ran = _started(pool, "cases", cases, datas, options, together)
        decode_ran = _started(pool, "decode", decode_cases, decode_datas, {"paths": decode_paths}, lambda c: c.name)
        rows, results = _run_all(cases, datas, ran, finish, "cases")
        decode_rows, _ = _run_all(decode_cases, decode_datas, decode_ran, finish_decode, "decode cases")
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        keras_backends.stop()
    tables = (
        rows and format_table(rows),
        decode_rows and format_decode_table(decode_rows),
        format_not_run(rows, [*dropped, *decode_dropped], not_run, args.verbose),
    )
    print(wrapped("\n\n".join(table for table in tables if table)))
    if args.plot and rows and {"torch:explicit", "tf:eager"} <= set(results):
        plot(cases[0], results, args.plot)
        print(f"plot of case {cases[0].name} written to {args.plot}")
    elif args.plot:
        print(f"no plot: the first case's torch:explicit and tf:eager paths did not both run ({args.plot} not written)")
    if args.json:
        tables = [("attention", rows), ("decode", decode_rows)]
        with open(args.json, "w") as handle:
            json.dump(
                [
                    dataclasses.asdict(row) | {"table": name, "passed": row.passed}
                    for name, table in tables
                    for row in table
                ],
                handle,
                indent=1,
            )
    summaries = [summary(rows)] if rows or not decode_rows else []
    summaries += [summary(decode_rows, "decode cases")] if decode_rows or not rows else []
    print("\n" + "\n".join(summaries))
    print(f"report took {_duration(time.perf_counter() - started)}")
    print(cpu_line(), file=sys.stderr)
    return 0 if all(row.passed for row in [*rows, *decode_rows]) else 1


if __name__ == "__main__":
    sys.exit(main())
