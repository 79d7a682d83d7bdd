"""The comparisons of the parity report, and their tolerances: one row per case from the Results of every path.

`run_case` runs a case (shared_tests/cases.py) on every path (shared_tests/frameworks.py) and
`compare` builds its row: for each pair of frameworks the largest difference of output,
attention weights and gradients against the SPEC tolerance of the case's dtype (twice it between
two low-precision layers), and every position the masks, the causal rule or the window remove
must hold a weight of exactly 0, computed here independently of the layers. `run_decode_case`
and `compare_decode` do the same for a decode case (shared_tests/decoding.py): frameworks
against each other, each against its own full pass, and the final caches.
shared_tests/parity.py formats the rows.

Legend: B batch, T query length, S key/value length, E d_model, N num_heads, P tokens decoded
in all, L cache slots.
"""

import dataclasses
import math

import numpy as np

from shared_tests import keras_backends, runtimes
from shared_tests.cases import make_data
from shared_tests.decode_masks import by_slot, query_ends, slot_positions
from shared_tests.decoding import DECODE_PATHS, make_decode_data
from shared_tests.frameworks import PATHS, run, run_decode
from shared_tests.runtimes import RUNTIME_PATHS, UnsupportedCaseError
from shared_tests.tf_runner import make_tf_layer
from shared_tests.torch_runner import make_torch_layer

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
    if data.get("segment_ids") is not None:  # packed sequences: a query keeps the keys of its document
        key_ids = data["segment_ids"] if data.get("key_segment_ids") is None else data["key_segment_ids"]
        keep &= data["segment_ids"][:, None, :, None] == key_ids[:, None, None, :]
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


@dataclasses.dataclass
class Ran:
    """What the paths of one case gave: {path: Result or DecodeResult}, {path: why it could not
    run}, the failure texts of the paths that raised, and the largest difference of the
    dynamic-shape exports from eager (None: none ran)."""

    results: dict = dataclasses.field(default_factory=dict)
    skipped: dict = dataclasses.field(default_factory=dict)
    errors: list = dataclasses.field(default_factory=list)
    dynamic: float | None = None

    def merged(self, other):
        """Both runs together (the Keras paths' beside the other paths')."""
        dynamic = [d for d in (self.dynamic, other.dynamic) if d is not None]
        return Ran(
            {**self.results, **other.results}, {**self.skipped, **other.skipped}, self.errors + other.errors,
            max(dynamic, default=None),
        )  # fmt: skip


def run_paths(case, data, paths=PATHS, dynamic_paths=(), export_cache=None, **classes):
    """Runs the paths given on one case, and the `dynamic_paths` (runtimes.DYNAMIC_PATHS) against
    the eager layer each exported; a `Ran`. `export_cache`: the folder where the runtimes keep
    their exports (`runtimes.kept_export`), or None."""
    ran = Ran()
    for path in paths:
        try:
            ran.results[path] = run(case, data, path, export_cache=export_cache, **classes)
        except UnsupportedCaseError as reason:
            ran.skipped[path] = str(reason)
        except Exception as error:  # the report goes on; the row says which path raised what
            ran.errors.append(raised(path, error))
    ran.dynamic = run_dynamic_paths(case, data, dynamic_paths, ran.skipped, ran.errors, export_cache, **classes)
    return ran


def judge(case, data, ran, conditioning=False):
    """The report row of one case from what its paths gave (`run_paths`). With `conditioning`
    (--weights) the tolerances of a case that the weights make ill-conditioned are widened
    (`rounding_floor`)."""
    results = ran.results
    floor = rounding_floor(case, data, results["numpy"]) if conditioning and "numpy" in results else None
    row = compare(case, data, results, floor)
    if ran.dynamic is not None:
        row.diffs[DYNAMIC_LABEL] = {"output": ran.dynamic, "weights": None, "grads": None}
        if not ran.dynamic <= case.tolerance["output"]:
            row.failures.append(exceeded(DYNAMIC_LABEL, "output", ran.dynamic, case.tolerance["output"]))
    row.skipped = dict(ran.skipped)
    row.failures = ran.errors + row.failures
    return row


def run_case(case, data=None, paths=PATHS, dynamic_paths=(), conditioning=False, export_cache=None, **classes):
    """Runs every path (or those given) on one case, and the `dynamic_paths` (runtimes.DYNAMIC_PATHS)
    against the eager layer each exported; returns (row, results). A runtime path that cannot hold
    the case is listed in `row.skipped` with its reason; a path that raises anything else fails
    the row, with the error among its failures. With `conditioning` (--weights) the tolerances
    of a case that the weights make ill-conditioned are widened (`rounding_floor`). `export_cache`:
    the folder where the runtimes keep their exports (`runtimes.kept_export`), or None."""
    data = make_data(case) if data is None else data
    ran = run_paths(case, data, paths, dynamic_paths, export_cache, **classes)
    return judge(case, data, ran, conditioning), ran.results


def run_dynamic_paths(case, data, paths, skipped, errors, export_cache=None, torch_class=None, tf_class=None):
    """The largest difference of the dynamic-shape exports from eager (None: none ran); what
    cannot run goes to `skipped`, what raises to `errors`."""
    worst = None
    for path in paths:
        layer_class = torch_class if path.startswith("torch") else tf_class

        def make_layer(case, data, layer_class=layer_class, path=path):
            make = make_torch_layer if path.startswith("torch") else make_tf_layer
            return make(case, data, layer_class)

        try:
            value = runtimes.run_dynamic(case, data, path, make_layer, layer_class, export_cache)
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
    held = slot_positions(case)  # (P, L): the position in each slot
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
    weights = None if result.weights is None else _max_diff(result.weights, by_slot(case, result.full_weights))
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
        return {"cache": tol["output"], **tol}  # cached keys and values are projections, like the output

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


def run_decode_paths(case, data, paths=DECODE_PATHS):
    """Decodes one case on the paths given; a `Ran` (a path whose layer file lacks the case's
    options is in `skipped`)."""
    ran = Ran()
    for path in paths:
        try:
            ran.results[path] = run_decode(case, data, path)
        except UnsupportedCaseError as reason:
            ran.skipped[path] = str(reason)
        except Exception as error:  # the report goes on; the row says which path raised what
            ran.errors.append(raised(path, error))
    return ran


def judge_decode(case, data, ran):
    """The report row of one decode case from what its paths gave (`run_decode_paths`)."""
    if not ran.results:
        return Row(case.name, case.dtype, {}, False, list(ran.errors), dict(ran.skipped))
    row = compare_decode(case, data, ran.results)
    row.failures, row.skipped = ran.errors + row.failures, dict(ran.skipped)
    return row


def run_decode_case(case, data=None, paths=DECODE_PATHS):
    """Decodes one case on every path (or those given); returns (row, results). A path whose layer
    file lacks the case's options is listed in `row.skipped`; a path that raises anything else fails
    the row, with the error among its failures."""
    data = make_decode_data(case) if data is None else data
    ran = run_decode_paths(case, data, paths)
    return judge_decode(case, data, ran), ran.results


def run_each(kind, pairs, options):
    """[`Ran`] of each (case, data) pair: `run_paths` ("cases") or `run_decode_paths` ("decode")
    with `options`; what the parity report's worker processes run."""
    run_one = run_paths if kind == "cases" else run_decode_paths
    return [run_one(case, data, **options) for case, data in pairs]
