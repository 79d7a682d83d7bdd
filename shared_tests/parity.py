"""The cross-framework parity report: `python -m shared_tests.parity` (or `make parity`).

For every case of the shared table, one portable weight dict is loaded into the PyTorch, the
TensorFlow and the NumPy layer; their outputs, attention weights and gradients are compared
pairwise against the SPEC tolerances, and every masked position must hold a weight of exactly 0.
A second table decodes the KV-cache cases (shared_tests/decoding.py) chunk by chunk on every
path: outputs and weights are compared between frameworks and against one full causal pass,
and the final caches must be equal. With `--keras tensorflow,jax,torch` (as `make parity` runs
it) the Keras file runs every case on each Keras backend, in a process per backend, in the
columns `keras:tensorflow`, `keras:jax` and `keras:torch`, each against NumPy. Exit status 1 on
any FAIL.

A FAIL row is followed by what failed: the quantity, its value and its tolerance. A path that
raises is an error of its row, never the end of the report. After the tables, one line per path
(and per reason a case was left out) says how many cases did not run there and why (`--verbose`
lists them); the report ends with the two summary lines and the time it took.
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

import numpy as np

from shared_tests import decoding, keras_backends, runtimes
from shared_tests.cases import CASES_BY_NAME, REPORT_CASES, make_data
from shared_tests.decoding import DECODE_CASES_BY_NAME, DECODE_PATHS, REPORT_DECODE_CASES, make_decode_data, query_ends
from shared_tests.frameworks import PATHS, make_tf_layer, make_torch_layer, run
from shared_tests.runtimes import DYNAMIC_PATHS, RUNTIME_PATHS, UnsupportedCaseError

FRAMEWORK_PATHS = {fw: tuple(p for p in PATHS if p.split(":")[0] == fw) for fw in ("torch", "tf", "numpy")}
FRAMEWORK_PATHS.update({path: (path,) for path in keras_backends.KERAS_PATHS})  # each backend a column of its own
PAIRS = (("torch", "tf"), ("torch", "numpy"), ("tf", "numpy"), *((p, "numpy") for p in keras_backends.KERAS_PATHS))
RUNTIMES_LABEL = "onnx+litert/numpy"
DYNAMIC_LABEL = "dynamic/eager"  # the dynamic-shape exports against the eager layer each exported
QUANTITIES = ("output", "weights", "grads")
# Two low-precision layers may each sit a full SPEC tolerance away from the float64 truth, on
# opposite sides, so between themselves they are allowed twice that tolerance.
LOW_PRECISION_PAIR_FACTOR = 2.0


def _max_diff(a, b):
    """Largest absolute difference; NaN or inf anywhere counts as infinitely far."""
    if a.shape != b.shape:
        return math.inf
    diff = np.abs(a - b)
    if diff.size == 0:
        return 0.0  # T = 0 or S = 0: nothing to differ
    return float(diff.max()) if np.isfinite(diff).all() else math.inf


def _grads_diff(a, b):
    if a.keys() != b.keys():
        return math.inf
    return max(_max_diff(a[name], b[name]) for name in a)


def diff(first, second, quantity):
    """Largest difference of one quantity between two Results; None where one has none."""
    a, b = getattr(first, quantity), getattr(second, quantity)
    if a is None or b is None:
        return None
    return _grads_diff(a, b) if quantity == "grads" else _max_diff(a, b)


def removal_threshold(dtype):
    """A floating mask value at or below this removes a key (docs/SPEC.md, Masks)."""
    return max(np.finfo(dtype).min, np.finfo(np.float32).min)


def kept(mask):
    """A boolean or floating mask as the boolean mask of the keys it keeps."""
    return mask if mask.dtype == np.bool_ else mask > removal_threshold(mask.dtype)


def removed_positions(case, data):
    """Boolean (B, N, T, S): positions the masks, the causal rule or the window remove,
    computed here independently of the layers."""
    keep = np.ones((case.b, case.n, case.t, case.s), dtype=bool)
    for name in ("attention_mask", "attention_bias"):
        if data.get(name) is not None:
            mask = kept(data[name])
            keep &= {2: mask[None, None], 3: mask[:, None], 4: mask}[mask.ndim]
    key_mask = data.get("key_mask")
    key_mask = data.get("query_mask") if key_mask is None and data["key"] is None else key_mask
    if key_mask is not None:
        keep &= key_mask[:, None, None, :]
    if data.get("query_mask") is not None:
        keep &= data["query_mask"][:, None, :, None]
    t, s = np.arange(case.t)[:, None], np.arange(case.s)[None, :]
    if case.causal:
        keep &= s <= t + (case.s - case.t)
    variants = dict(case.variants)
    before, after = window_sides(variants.get("window"))
    if before is not None:
        keep &= s > t + (case.s - case.t) - before
    if after is not None:
        keep &= s < t + (case.s - case.t) + after
    chunk = variants.get("attention_chunk_size")
    if chunk is not None:
        keep &= s // chunk == (t + (case.s - case.t)) // chunk
    return ~keep


def window_sides(window):
    """A case's `window` as (before, after): None, W (W, None) or a pair."""
    if window is None or isinstance(window, int):
        return window, None
    return tuple(window)


@dataclasses.dataclass
class Row:
    case: str
    dtype: str
    diffs: dict  # "torch/tf" -> {"output": float, "weights": float, "grads": float | None}
    zeros: bool  # every removed position has a weight of exactly 0, in every path
    failures: list
    skipped: dict = dataclasses.field(default_factory=dict)  # path -> why it cannot run this case
    notes: list = dataclasses.field(default_factory=list)  # printed under the row, PASS or FAIL

    @property
    def passed(self):
        return not self.failures


def tolerance(case, pair):
    tol = dict(case.tolerance)
    if case.dtype != "float32" and "numpy" not in pair:
        tol = {q: None if v is None else v * LOW_PRECISION_PAIR_FACTOR for q, v in tol.items()}
    return tol


# Under --weights a file's weights can make a case ill-conditioned: large scores with two keys
# nearly tied, where float32 rounding alone moves the results past the SPEC tolerances (torch in
# float64 then equals NumPy within 1e-12). The float64 reference is rerun with its float32
# inputs and weights each moved by up to one float32 rounding (relative 2**-24); what that moves
# it by, times ROUNDING_FACTOR (float32 paths round every step, not only their inputs), is the
# smallest difference that can tell a bug. Measured on fresh (16, 4, num_kv_heads=2) files: the
# float32 paths differed by at most 5x what the rounding of their inputs moves the reference by.
ROUNDING_DRAWS = 3
ROUNDING_FACTOR = 10.0
FLOAT32_ROUNDING = 2.0**-24


def _rounded_inputs(data, rng):
    """The case's float32 inputs and weights, in float64, each moved by up to one float32 rounding."""

    def moved(x):
        x = x.astype(np.float64)
        return x * (1 + FLOAT32_ROUNDING * rng.uniform(-1, 1, x.shape))

    inputs = {name: None if data[name] is None else moved(data[name]) for name in ("query", "key", "value")}
    return {**data, **inputs, "weights": {name: moved(w) for name, w in data["weights"].items()}}


def rounding_floor(case, data, reference):
    """{quantity: how far float32 rounding of the inputs and weights alone moves the float64
    NumPy `reference` Result} (largest over ROUNDING_DRAWS draws)."""
    rng = np.random.default_rng(0)
    moved = [run(case, _rounded_inputs(data, rng), "numpy") for _ in range(ROUNDING_DRAWS)]
    return {q: max((diff(reference, m, q) or 0.0) for m in moved) for q in QUANTITIES}


def widened(tol, floor):
    """The tolerances raised to ROUNDING_FACTOR times the rounding floor where that is larger."""
    if floor is None:
        return tol
    return {q: v if v is None else max(v, ROUNDING_FACTOR * floor[q]) for q, v in tol.items()}


def conditioning_note(case, floor):
    """The note of an ill-conditioned row (None if the floor stays within the SPEC tolerances)."""
    tol = case.tolerance
    over = [q for q in QUANTITIES if tol[q] is not None and ROUNDING_FACTOR * floor[q] > tol[q]]
    if not over:
        return None
    moved = ", ".join(f"{q} {floor[q]:.1e}" for q in over)
    raised = ", ".join(f"{q} {ROUNDING_FACTOR * floor[q]:.1e}" for q in over)
    return (
        f"ill-conditioned with these weights: float32 rounding of the inputs and weights alone moves the float64 "
        f"reference by {moved}, so the tolerances are {raised} ({ROUNDING_FACTOR:g}x that); a FAIL above them is a bug"
    )


def label(pair):
    """The column of a pair: "torch/tf", ..., and a Keras backend's own path (against NumPy)."""
    return pair[0] if pair[0] in keras_backends.KERAS_PATHS else "/".join(pair)


def _pairwise(results, paths, quantities, measure, tolerances, diffs, failures):
    """For each framework pair, the largest `measure(first, second, quantity)` over their paths
    that ran, recorded in `diffs` and checked against `tolerances(pair)[quantity]` (None: not
    checked)."""
    for pair in PAIRS:
        tol, name = tolerances(pair), label(pair)
        diffs[name] = dict.fromkeys(quantities)
        if not all(any(p in results for p in paths[side]) for side in pair):
            continue  # a framework none of whose paths ran (a subset of paths was asked for)
        for quantity in quantities:
            values = [
                measure(results[p], results[q], quantity)
                for p in paths[pair[0]]
                for q in paths[pair[1]]
                if p in results and q in results
            ]
            values = [v for v in values if v is not None]
            worst = max(values) if values else None
            diffs[name][quantity] = worst
            if tol[quantity] is not None and (worst is None or not worst <= tol[quantity]):
                failures.append(exceeded(name, quantity, worst, tol[quantity]))


def _fmt_value(value):
    return "missing" if value is None else "inf or NaN" if not math.isfinite(value) else f"{value:.2e}"


def exceeded(label, quantity, value, tol):
    """The failure text of one quantity: which, its value and its tolerance."""
    return f"{label} {quantity} {_fmt_value(value)} > tolerance {tol:.0e}"


def _largest_removed_weight(removed, results):
    """The largest |weight| any path gives a removed position (inf for NaN); must be exactly 0."""
    weights = [np.abs(r.weights[removed]) for r in results.values() if r.weights is not None]
    return max((float(np.nan_to_num(w, nan=math.inf).max(initial=0.0)) for w in weights), default=0.0)


def raised(path, error):
    """The failure text of a path that raised: the exception's type and first line."""
    lines = str(error).strip().splitlines()
    return f"{path} raised {type(error).__name__}: {lines[0] if lines else ''}"[:300]


def _runtimes_vs_numpy(results):
    """The exported runtimes' largest differences from NumPy, shown in a column of their own
    (they are also inside the torch/numpy and tf/numpy columns, which hold the tolerance)."""
    ran = [results[p] for p in RUNTIME_PATHS if p in results]
    worst = {q: max((diff(r, results["numpy"], q) for r in ran), default=None) for q in ("output", "weights")}
    return {**worst, "grads": None}


def compare(case, data, results, floor=None):
    """Builds the report row of one case from the Results of every path; `floor` (from
    `rounding_floor`) widens the tolerances of an ill-conditioned case, and the row says so."""
    diffs, failures = {}, []

    def tolerances(pair):
        return widened(tolerance(case, pair), floor)

    _pairwise(results, FRAMEWORK_PATHS, QUANTITIES, diff, tolerances, diffs, failures)
    diffs[RUNTIMES_LABEL] = _runtimes_vs_numpy(results)
    removed = removed_positions(case, data)
    worst = _largest_removed_weight(removed, results)
    zeros = worst == 0
    if not zeros:
        failures.append(f"zeros: a removed position has weight {_fmt_value(worst)} > tolerance 0 (exactly 0)")
    note = None if floor is None else conditioning_note(case, floor)
    return Row(case.name, case.dtype, diffs, zeros, failures, notes=[] if note is None else [note])


def run_case(case, data=None, paths=PATHS, dynamic_paths=(), conditioning=False, **classes):
    """Runs every path (or those given) on one case, and the `dynamic_paths` (runtimes.DYNAMIC_PATHS)
    against the eager layer each exported; returns (row, results). A runtime path that cannot hold
    the case is listed in `row.skipped` with its reason; a path that raises anything else fails
    the row, with the error among its failures. With `conditioning` (--weights) the tolerances
    of a case that the weights make ill-conditioned are widened (`rounding_floor`)."""
    data = make_data(case) if data is None else data
    results, skipped, errors = {}, {}, []
    for path in paths:
        try:
            results[path] = run(case, data, path, **classes)
        except UnsupportedCaseError as reason:
            skipped[path] = str(reason)
        except Exception as error:  # the report goes on; the row says which path raised what
            errors.append(raised(path, error))
    floor = rounding_floor(case, data, results["numpy"]) if conditioning and "numpy" in results else None
    row = compare(case, data, results, floor)
    dynamic = run_dynamic_paths(case, data, dynamic_paths, skipped, errors, **classes)
    if dynamic is not None:
        row.diffs[DYNAMIC_LABEL] = {"output": dynamic, "weights": None, "grads": None}
        if not dynamic <= case.tolerance["output"]:
            row.failures.append(exceeded(DYNAMIC_LABEL, "output", dynamic, case.tolerance["output"]))
    row.skipped = skipped
    row.failures = errors + row.failures
    return row, results


def run_dynamic_paths(case, data, paths, skipped, errors, torch_class=None, tf_class=None):
    """The largest difference of the dynamic-shape exports from eager (None: none ran); what
    cannot run goes to `skipped`, what raises to `errors`."""
    worst = None
    for path in paths:
        layer_class = torch_class if path.startswith("torch") else tf_class

        def make_layer(case, data, layer_class=layer_class, path=path):
            make = make_torch_layer if path.startswith("torch") else make_tf_layer
            return make(case, data, layer_class)

        try:
            value = runtimes.run_dynamic(case, data, path, make_layer, layer_class)
        except UnsupportedCaseError as reason:
            skipped[path] = str(reason)
            continue
        except Exception as error:  # the report goes on; the row says which path raised what
            errors.append(raised(path, error))
            continue
        worst = value if worst is None else max(worst, value)
    return worst


DECODE_FRAMEWORK_PATHS = {
    fw: tuple(p for p in (*DECODE_PATHS, *keras_backends.KERAS_PATHS) if p == fw or p.split(":")[0] == fw)
    for fw in FRAMEWORK_PATHS
}
DECODE_QUANTITIES = ("output", "weights", "cache")


def _cache_diff(a, b):
    """Largest difference of the cached keys and values; keep and index must be equal."""
    if any(not np.array_equal(a[name], b[name]) for name in ("keep", "index")):
        return math.inf
    return max(_max_diff(a[name], b[name]) for name in ("key", "value"))


def decode_removed_positions(case, data):
    """Boolean (B, N, P, L): the slots each decoded query may not attend, computed here
    independently of the layers."""
    held = decoding.slot_positions(case)  # (P, L): the position in each slot
    queries = np.arange(case.p)[:, None]  # (P, 1)
    allowed = (held >= 0) & (held <= queries if case.causal else held < query_ends(case)[:, None])  # (P, L)
    variants = dict(case.variants)
    before, after = window_sides(variants.get("window"))
    if before is not None:
        allowed = allowed & (held > queries - before)  # (P, L)
    if after is not None:
        allowed = allowed & (held < queries + after)  # (P, L)
    chunk = variants.get("attention_chunk_size")
    if chunk is not None:
        allowed = allowed & (held // chunk == queries // chunk)  # (P, L)
    slot_keep = np.where(held < case.length, data["keep"][:, None, :], True)  # (B, P, L): new tokens past L
    keep = allowed[None, None] & slot_keep[:, None]  # (B, 1, P, L)
    mask = data["attention_mask"]
    if mask is not None:
        mask = kept(mask)
        keep = keep & {2: mask[None, None], 3: mask[:, None], 4: mask}[mask.ndim]
    return ~np.broadcast_to(keep, (case.b, case.n, case.p, case.length))


def _decode_quantity(first, second, quantity):
    if quantity == "cache":
        return _cache_diff(first.cache, second.cache)
    return diff(first, second, quantity)


def _decode_vs_full(case, result):
    """Decoded output and weights against the same path's full causal pass (its weights moved
    to the slots that held their positions)."""
    weights = None if result.weights is None else _max_diff(result.weights, decoding.by_slot(case, result.full_weights))
    return {"output": _max_diff(result.output, result.full_output), "weights": weights}


def _padded_rows_give_output_bias(case, data, removed, results):
    """Every query that no head lets attend any slot outputs exactly `output_bias` (0 without
    bias), rounded to the path's dtype (the NumPy reference computes in float64)."""
    empty = removed.all(axis=(1, 3))  # (B, P)
    bias = data["weights"].get("output_bias", np.zeros(case.e, np.float32))
    for path, result in results.items():
        expected = bias.astype(np.float64 if path == "numpy" else case.dtype).astype(np.float64)
        if not np.array_equal(result.output[empty], np.broadcast_to(expected, result.output[empty].shape)):
            return False
    return True


def compare_decode(case, data, results):
    """The report row of one decode case from the DecodeResults of every path."""
    diffs, failures = {}, []

    def tolerances(pair):
        tol = tolerance(case, pair)
        return {**tol, "cache": tol["output"]}  # cached keys and values are projections, like the output

    _pairwise(results, DECODE_FRAMEWORK_PATHS, DECODE_QUANTITIES, _decode_quantity, tolerances, diffs, failures)
    tols = case.tolerance  # a path against its own full pass: the SPEC tolerance, no pair factor
    vs_full = [_decode_vs_full(case, r) for r in results.values()]
    diffs["decode/full"] = {}
    for quantity in ("output", "weights"):
        worst = max((v[quantity] for v in vs_full if v[quantity] is not None), default=None)
        diffs["decode/full"][quantity] = worst
        if worst is None or not worst <= tols[quantity]:
            failures.append(exceeded("decode/full", quantity, worst, tols[quantity]))
    removed = decode_removed_positions(case, data)
    worst = _largest_removed_weight(removed, results)
    if worst != 0:
        failures.append(f"zeros: a removed slot has weight {_fmt_value(worst)} > tolerance 0 (exactly 0)")
    padded_ok = _padded_rows_give_output_bias(case, data, removed, results)
    if not padded_ok:
        failures.append("zeros: a query with no slot left does not output exactly output_bias")
    return Row(case.name, case.dtype, diffs, worst == 0 and padded_ok, failures)


def run_decode_case(case, data=None, paths=DECODE_PATHS):
    """Decodes one case on every path (or those given); returns (row, results). A path whose layer
    file lacks the case's options is listed in `row.skipped`; a path that raises anything else fails
    the row, with the error among its failures."""
    data = make_decode_data(case) if data is None else data
    results, skipped, errors = {}, {}, []
    for path in paths:
        try:
            results[path] = decoding.run(case, data, path)
        except UnsupportedCaseError as reason:
            skipped[path] = str(reason)
        except Exception as error:  # the report goes on; the row says which path raised what
            errors.append(raised(path, error))
    if not results:
        return Row(case.name, case.dtype, {}, False, errors, skipped), results
    row = compare_decode(case, data, results)
    row.failures, row.skipped = errors + row.failures, skipped
    return row, results


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


def _run_all(cases, run_one, make):
    rows, first_results = [], None
    for index, case in enumerate(cases, 1):
        print(f"\r[{index}/{len(cases)}] {case.name:<40}", end="", file=sys.stderr, flush=True)
        row, results = run_one(case, make(case))
        rows.append(row)
        first_results = first_results or results
    print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    return rows, first_results


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
            backends, [(c, datas[c.name]) for c in cases], [(c, decode_datas[c.name]) for c in decode_cases]
        )
        paths = (*paths, *(f"keras:{backend}" for backend in backends))
        decode_paths = (*decode_paths, *(f"keras:{backend}" for backend in backends))
    run_one = functools.partial(run_case, paths=paths, dynamic_paths=dynamic_paths, conditioning=bool(args.weights))
    rows, results = _run_all(cases, run_one, lambda case: datas[case.name])
    decode_rows, _ = _run_all(
        decode_cases, functools.partial(run_decode_case, paths=decode_paths), lambda case: decode_datas[case.name]
    )
    tables = (
        rows and format_table(rows),
        decode_rows and format_decode_table(decode_rows),
        format_not_run(rows, [*dropped, *decode_dropped], not_run, args.verbose),
    )
    print("\n\n".join(table for table in tables if table))
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
    return 0 if all(row.passed for row in [*rows, *decode_rows]) else 1


if __name__ == "__main__":
    sys.exit(main())
