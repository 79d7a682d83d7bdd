"""The cross-framework parity report: `python -m shared_tests.parity` (or `make parity`).

For every case of the shared table, one portable weight dict is loaded into the PyTorch, the
TensorFlow and the NumPy layer; their outputs, attention weights and gradients are compared
pairwise against the SPEC tolerances, and every masked position must hold a weight of exactly 0.
A second table decodes the KV-cache cases (shared_tests/decoding.py) chunk by chunk on every
path: outputs and weights are compared between frameworks and against one full causal pass,
and the final caches must be equal. Exit status 1 on any FAIL.
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import sys

import numpy as np

from shared_tests import decoding
from shared_tests.cases import CASES, CASES_BY_NAME, make_data
from shared_tests.decoding import DECODE_CASES, DECODE_CASES_BY_NAME, DECODE_PATHS, make_decode_data, query_ends
from shared_tests.frameworks import PATHS, run
from shared_tests.runtimes import RUNTIME_PATHS, UnsupportedCaseError

FRAMEWORK_PATHS = {fw: tuple(p for p in PATHS if p.split(":")[0] == fw) for fw in ("torch", "tf", "numpy")}
PAIRS = (("torch", "tf"), ("torch", "numpy"), ("tf", "numpy"))
RUNTIMES_LABEL = "onnx+litert/numpy"
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
    window = dict(case.variants).get("window")
    if window is not None:
        keep &= s > t + (case.s - case.t) - window
    return ~keep


@dataclasses.dataclass
class Row:
    case: str
    dtype: str
    diffs: dict  # "torch/tf" -> {"output": float, "weights": float, "grads": float | None}
    zeros: bool  # every removed position has a weight of exactly 0, in every path
    failures: list
    skipped: dict = dataclasses.field(default_factory=dict)  # path -> why it cannot run this case

    @property
    def passed(self):
        return not self.failures


def tolerance(case, pair):
    tol = dict(case.tolerance)
    if case.dtype != "float32" and "numpy" not in pair:
        tol = {q: None if v is None else v * LOW_PRECISION_PAIR_FACTOR for q, v in tol.items()}
    return tol


def _pairwise(results, paths, quantities, measure, tolerances, diffs, failures):
    """For each framework pair, the largest `measure(first, second, quantity)` over their paths
    that ran, recorded in `diffs` and checked against `tolerances(pair)[quantity]` (None: not
    checked)."""
    for pair in PAIRS:
        tol, label = tolerances(pair), "/".join(pair)
        diffs[label] = dict.fromkeys(quantities)
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
            diffs[label][quantity] = worst
            if tol[quantity] is not None and (worst is None or not worst <= tol[quantity]):
                failures.append(f"{label} {quantity} {worst} > {tol[quantity]}")


def _runtimes_vs_numpy(results):
    """The exported runtimes' largest differences from NumPy, shown in a column of their own
    (they are also inside the torch/numpy and tf/numpy columns, which hold the tolerance)."""
    ran = [results[p] for p in RUNTIME_PATHS if p in results]
    worst = {q: max((diff(r, results["numpy"], q) for r in ran), default=None) for q in ("output", "weights")}
    return {**worst, "grads": None}


def compare(case, data, results):
    """Builds the report row of one case from the Results of every path."""
    diffs, failures = {}, []
    _pairwise(results, FRAMEWORK_PATHS, QUANTITIES, diff, lambda pair: tolerance(case, pair), diffs, failures)
    diffs[RUNTIMES_LABEL] = _runtimes_vs_numpy(results)
    removed = removed_positions(case, data)
    zeros = all(np.all(r.weights[removed] == 0) for r in results.values() if r.weights is not None)
    if not zeros:
        failures.append("a removed position has a non-zero weight")
    return Row(case.name, case.dtype, diffs, zeros, failures)


def run_case(case, data=None, paths=PATHS, **classes):
    """Runs every path (or those given) on one case; returns (row, results). A runtime path that
    cannot hold the case is listed in `row.skipped` with its reason."""
    data = make_data(case) if data is None else data
    results, skipped = {}, {}
    for path in paths:
        try:
            results[path] = run(case, data, path, **classes)
        except UnsupportedCaseError as reason:
            skipped[path] = str(reason)
    row = compare(case, data, results)
    row.skipped = skipped
    return row, results


DECODE_FRAMEWORK_PATHS = {fw: tuple(p for p in DECODE_PATHS if p.split(":")[0] == fw) for fw in FRAMEWORK_PATHS}
DECODE_QUANTITIES = ("output", "weights", "cache")


def _cache_diff(a, b):
    """Largest difference of the cached keys and values; keep and index must be equal."""
    if any(not np.array_equal(a[name], b[name]) for name in ("keep", "index")):
        return math.inf
    return max(_max_diff(a[name], b[name]) for name in ("key", "value"))


def decode_removed_positions(case, data):
    """Boolean (B, N, P, L): the slots each decoded query may not attend, computed here
    independently of the layers."""
    slots = np.arange(case.length)[None, :]  # (1, L)
    allowed = slots <= np.arange(case.p)[:, None] if case.causal else slots < query_ends(case)[:, None]  # (P, L)
    keep = allowed[None, None] & data["keep"][:, None, None, :]  # (B, 1, P, L)
    window = dict(case.variants).get("window")
    if window is not None:
        keep = keep & (slots > np.arange(case.p)[:, None] - window)  # (B, 1, P, L)
    mask = data["attention_mask"]
    if mask is not None:
        mask = kept(mask)
        keep = keep & {2: mask[None, None], 3: mask[:, None], 4: mask}[mask.ndim]
    return ~np.broadcast_to(keep, (case.b, case.n, case.p, case.length))


def _decode_quantity(first, second, quantity):
    if quantity == "cache":
        return _cache_diff(first.cache, second.cache)
    return diff(first, second, quantity)


def _decode_vs_full(result):
    """Decoded output and weights against the same path's full causal pass."""
    p = result.full_weights.shape[-1]
    weights = None if result.weights is None else _max_diff(result.weights[..., :p], result.full_weights)
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
    vs_full = [_decode_vs_full(r) for r in results.values()]
    diffs["decode/full"] = {}
    for quantity in ("output", "weights"):
        worst = max(v[quantity] for v in vs_full if v[quantity] is not None)
        diffs["decode/full"][quantity] = worst
        if not worst <= tols[quantity]:
            failures.append(f"decode/full {quantity} {worst} > {tols[quantity]}")
    removed = decode_removed_positions(case, data)
    zeros = all(np.all(r.weights[removed] == 0) for r in results.values() if r.weights is not None)
    zeros = zeros and _padded_rows_give_output_bias(case, data, removed, results)
    if not zeros:
        failures.append("a removed slot has a non-zero weight, or a query with no slot is not output_bias")
    return Row(case.name, case.dtype, diffs, zeros, failures)


def run_decode_case(case, data=None, paths=DECODE_PATHS):
    """Decodes one case on every path (or those given); returns (row, results)."""
    data = make_decode_data(case) if data is None else data
    results = {path: decoding.run(case, data, path) for path in paths}
    return compare_decode(case, data, results), results


def _fmt(value):
    return "-" if value is None else "inf" if value == math.inf else f"{value:.0e}"


def format_table(rows):
    groups = "".join(f"{label:<21}" for label in [*("/".join(pair) for pair in PAIRS), RUNTIMES_LABEL])
    head = f"{'case':<27} {'dtype':<9} {groups}zeros  status"
    sub = f"{'':<27} {'':<9} " + "out   wts   grad   " * (len(PAIRS) + 1)
    lines = [head, sub, "-" * len(head)]
    for row in rows:
        cells = "".join("".join(f"{_fmt(row.diffs[label][q]):<6}" for q in QUANTITIES) + "   " for label in row.diffs)
        lines.append(
            f"{row.case:<27} {row.dtype:<9} {cells}{'ok' if row.zeros else 'NO':<7}{'PASS' if row.passed else 'FAIL'}"
        )
    passed = sum(row.passed for row in rows)
    lines.append("-" * len(head))
    lines.append(f"{passed}/{len(rows)} cases PASS, {len(rows) - passed} FAIL")
    reasons = {}
    for row in rows:
        for path, reason in row.skipped.items():
            reasons.setdefault((path, reason), []).append(row.case)
    lines += [f"skipped on {path} ({reason}): {', '.join(cases)}" for (path, reason), cases in reasons.items()]
    return "\n".join(lines)


def format_decode_table(rows):
    groups = "".join(f"{'/'.join(pair):<21}" for pair in PAIRS) + f"{'decode/full':<14}"
    head = f"{'decode case':<27} {'dtype':<9} {groups}zeros  status"
    sub = f"{'':<27} {'':<9} " + "out   wts   cache  " * len(PAIRS) + "out   wts     "
    lines = [head, sub, "-" * len(head)]
    for row in rows:
        cells = "".join(
            "".join(f"{_fmt(values[q]):<6}" for q in values) + ("   " if len(values) == 3 else "  ")
            for values in row.diffs.values()
        )
        lines.append(
            f"{row.case:<27} {row.dtype:<9} {cells}{'ok' if row.zeros else 'NO':<7}{'PASS' if row.passed else 'FAIL'}"
        )
    passed = sum(row.passed for row in rows)
    lines.append("-" * len(head))
    lines.append(f"{passed}/{len(rows)} decode cases PASS, {len(rows) - passed} FAIL")
    return "\n".join(lines)


def plot(case, results, path):
    """Per-head attention weights of batch element 0: PyTorch, TensorFlow and |difference|."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    torch_w, tf_w = results["torch:explicit"].weights[0], results["tf:eager"].weights[0]  # (N, T, S)
    panels = (("PyTorch", torch_w), ("TensorFlow", tf_w), ("|PyTorch - TensorFlow|", np.abs(torch_w - tf_w)))
    fig, axes = plt.subplots(case.n, 3, figsize=(9, 2.6 * case.n + 0.6), squeeze=False)
    for head in range(case.n):
        for col, (title, weights) in enumerate(panels):
            ax = axes[head, col]
            image = ax.imshow(weights[head], cmap="magma" if col < 2 else "viridis", aspect="auto")
            ax.set_title(f"{title}, head {head}", fontsize=8)
            ax.set_xlabel("key s", fontsize=7)
            ax.set_ylabel("query t", fontsize=7)
            fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle(f"case {case.name}: attention weights, batch 0")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_user_weights(path, num_heads):
    """Reads an exported `.npz`; returns (weights, config overrides) or raises ValueError."""
    with np.load(path, allow_pickle=False) as archive:
        weights = {name: archive[name] for name in archive.files}
    required = ("query_kernel", "key_kernel", "value_kernel", "output_kernel")
    missing = [name for name in required if name not in weights]
    if missing:
        raise ValueError(
            f"{path} is not a portable weight file: missing {', '.join(missing)}. Received: {sorted(weights)}"
        )
    e, nh = weights["query_kernel"].shape
    kh = weights["key_kernel"].shape[1]
    if num_heads is None or nh % num_heads or (kh * num_heads) % nh:
        raise ValueError(
            f"--num-heads must divide the query width N*H={nh} and give a whole number of key/value heads "
            f"(K*H={kh}). Received: --num-heads={num_heads}"
        )
    overrides = dict(
        e=e, n=num_heads, k=kh * num_heads // nh, h=nh // num_heads,
        kdim=weights["key_kernel"].shape[0], vdim=weights["value_kernel"].shape[0], bias="query_bias" in weights,
    )  # fmt: skip
    return weights, overrides


def select_cases(names, overrides):
    cases = [CASES_BY_NAME[name] for name in names if name in CASES_BY_NAME] if names else CASES
    if overrides is None:
        return cases
    fits_self = overrides["kdim"] == overrides["vdim"] == overrides["e"]
    return [
        dataclasses.replace(case, **overrides)
        for case in cases
        if case.dtype == "float32" and (fits_self or not case.self_attention)
    ]


def select_decode_cases(names, overrides):
    """Decode cases named by --case (all without --case); none with user weights."""
    if overrides is not None:
        return []
    return [DECODE_CASES_BY_NAME[name] for name in names if name in DECODE_CASES_BY_NAME] if names else DECODE_CASES


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
    parser.add_argument(
        "--weights", metavar="FILE.npz", help="run the (non-decode) cases through your own exported weights"
    )
    parser.add_argument("--num-heads", type=int, help="N of the layer that exported --weights")
    parser.add_argument(
        "--device",
        default="cpu",
        help="device of the PyTorch paths, e.g. cuda; on any other than cpu only NumPy and the PyTorch paths run",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.plot and args.device != "cpu":
        print("error: --plot compares PyTorch with TensorFlow, which runs only with --device cpu", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(f"{c.name:<28} {c}" for c in [*CASES, *DECODE_CASES]))
        return 0
    user_weights, overrides = None, None
    if args.weights:
        try:
            user_weights, overrides = load_user_weights(args.weights, args.num_heads)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    cases, decode_cases = select_cases(args.case, overrides), select_decode_cases(args.case, overrides)

    def make(case):
        data = make_data(case)
        return data if user_weights is None else {**data, "weights": user_weights}

    paths, decode_paths = PATHS, DECODE_PATHS
    if args.device != "cpu":
        os.environ["PARITY_TORCH_DEVICE"] = args.device
        paths = ("numpy", *(p for p in FRAMEWORK_PATHS["torch"] if p not in RUNTIME_PATHS))
        decode_paths = ("numpy", *DECODE_FRAMEWORK_PATHS["torch"])
        print(f"PyTorch paths on {describe_device(args.device)}; TensorFlow and the runtimes are not run\n")
    rows, results = _run_all(cases, functools.partial(run_case, paths=paths), make)
    decode_rows, _ = _run_all(decode_cases, functools.partial(run_decode_case, paths=decode_paths), make_decode_data)
    print(
        "\n\n".join(
            table for table in (rows and format_table(rows), decode_rows and format_decode_table(decode_rows)) if table
        )
    )
    if args.plot and rows:
        plot(cases[0], results, args.plot)
        print(f"plot of case {cases[0].name} written to {args.plot}")
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
    return 0 if all(row.passed for row in [*rows, *decode_rows]) else 1


if __name__ == "__main__":
    sys.exit(main())
