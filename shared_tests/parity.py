"""The cross-framework parity report: `python -m shared_tests.parity` (or `make parity`).

For every case of the shared table, one portable weight dict is loaded into the PyTorch, the
TensorFlow and the NumPy layer; their outputs, attention weights and gradients are compared
pairwise against the SPEC tolerances, and every masked position must hold a weight of exactly 0.
Exit status 1 on any FAIL.
"""

import argparse
import dataclasses
import json
import math
import sys

import numpy as np

from shared_tests.cases import CASES, CASES_BY_NAME, make_data
from shared_tests.frameworks import PATHS, run

FRAMEWORK_PATHS = {fw: tuple(p for p in PATHS if p.split(":")[0] == fw) for fw in ("torch", "tf", "numpy")}
PAIRS = (("torch", "tf"), ("torch", "numpy"), ("tf", "numpy"))
QUANTITIES = ("output", "weights", "grads")
# Two low-precision layers may each sit a full SPEC tolerance away from the float64 truth, on
# opposite sides, so between themselves they are allowed twice that tolerance.
LOW_PRECISION_PAIR_FACTOR = 2.0


def _max_diff(a, b):
    """Largest absolute difference; NaN or inf anywhere counts as infinitely far."""
    if a.shape != b.shape:
        return math.inf
    diff = np.abs(a - b)
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


def removed_positions(case, data):
    """Boolean (B, N, T, S): positions the mask or the causal rule removes, computed here
    independently of the layers."""
    keep = np.ones((case.b, case.n, case.t, case.s), dtype=bool)
    mask = data["attention_mask"]
    if mask is not None:
        mask = ~np.isneginf(mask) if mask.dtype != np.bool_ else mask
        mask = {2: mask[None, None], 3: mask[:, None], 4: mask}[mask.ndim]
        keep &= mask
    if case.causal:
        t, s = np.arange(case.t)[:, None], np.arange(case.s)[None, :]
        keep &= s <= t + (case.s - case.t)
    return ~keep


@dataclasses.dataclass
class Row:
    case: str
    dtype: str
    diffs: dict  # "torch/tf" -> {"output": float, "weights": float, "grads": float | None}
    zeros: bool  # every removed position has a weight of exactly 0, in every path
    failures: list

    @property
    def passed(self):
        return not self.failures


def tolerance(case, pair):
    tol = dict(case.tolerance)
    if case.dtype != "float32" and "numpy" not in pair:
        tol = {q: None if v is None else v * LOW_PRECISION_PAIR_FACTOR for q, v in tol.items()}
    return tol


def compare(case, data, results):
    """Builds the report row of one case from the Results of every path."""
    diffs, failures = {}, []
    for pair in PAIRS:
        tol, label = tolerance(case, pair), "/".join(pair)
        diffs[label] = {}
        for quantity in QUANTITIES:
            values = [
                diff(results[p], results[q], quantity)
                for p in FRAMEWORK_PATHS[pair[0]]
                for q in FRAMEWORK_PATHS[pair[1]]
            ]
            values = [v for v in values if v is not None]
            worst = max(values) if values else None
            diffs[label][quantity] = worst
            if tol[quantity] is not None and (worst is None or not worst <= tol[quantity]):
                failures.append(f"{label} {quantity} {worst} > {tol[quantity]}")
    removed = removed_positions(case, data)
    zeros = all(np.all(r.weights[removed] == 0) for r in results.values() if r.weights is not None)
    if not zeros:
        failures.append("a removed position has a non-zero weight")
    return Row(case.name, case.dtype, diffs, zeros, failures)


def run_case(case, data=None, **classes):
    """Runs every path on one case; returns (row, results)."""
    data = make_data(case) if data is None else data
    results = {path: run(case, data, path, **classes) for path in PATHS}
    return compare(case, data, results), results


def _fmt(value):
    return "-" if value is None else "inf" if value == math.inf else f"{value:.0e}"


def format_table(rows):
    groups = "".join(f"{'/'.join(pair):<21}" for pair in PAIRS)
    head = f"{'case':<27} {'dtype':<9} {groups}zeros  status"
    sub = f"{'':<27} {'':<9} " + "out   wts   grad   " * len(PAIRS)
    lines = [head, sub, "-" * len(head)]
    for row in rows:
        cells = "".join("".join(f"{_fmt(row.diffs[label][q]):<6}" for q in QUANTITIES) + "   " for label in row.diffs)
        lines.append(
            f"{row.case:<27} {row.dtype:<9} {cells}{'ok' if row.zeros else 'NO':<7}{'PASS' if row.passed else 'FAIL'}"
        )
    passed = sum(row.passed for row in rows)
    lines.append("-" * len(head))
    lines.append(f"{passed}/{len(rows)} cases PASS, {len(rows) - passed} FAIL")
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
    cases = [CASES_BY_NAME[name] for name in names] if names else CASES
    if overrides is None:
        return cases
    fits_self = overrides["kdim"] == overrides["vdim"] == overrides["e"]
    return [
        dataclasses.replace(case, **overrides)
        for case in cases
        if case.dtype == "float32" and (fits_self or not case.self_attention)
    ]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m shared_tests.parity", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--case", action="append", choices=sorted(CASES_BY_NAME), metavar="NAME", help="run this case (repeatable)"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw the per-head weights of the first case run")
    parser.add_argument("--weights", metavar="FILE.npz", help="run the cases through your own exported weights")
    parser.add_argument("--num-heads", type=int, help="N of the layer that exported --weights")
    parser.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.list:
        print("\n".join(f"{c.name:<28} {c}" for c in CASES))
        return 0
    user_weights, overrides = None, None
    if args.weights:
        try:
            user_weights, overrides = load_user_weights(args.weights, args.num_heads)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    cases = select_cases(args.case, overrides)
    rows = []
    for index, case in enumerate(cases, 1):
        print(f"\r[{index}/{len(cases)}] {case.name:<40}", end="", file=sys.stderr, flush=True)
        data = make_data(case)
        if user_weights is not None:
            data["weights"] = user_weights
        row, results = run_case(case, data)
        rows.append(row)
        if args.plot and index == 1:
            plot(case, results, args.plot)
    print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    print(format_table(rows))
    if args.plot:
        print(f"plot of case {cases[0].name} written to {args.plot}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([dataclasses.asdict(row) | {"passed": row.passed} for row in rows], handle, indent=1)
    return 0 if all(row.passed for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
