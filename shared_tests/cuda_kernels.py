"""Every parity case through each CUDA kernel of `scaled_dot_product_attention`.

`python -m shared_tests.cuda_kernels` on a machine with CUDA (no TensorFlow needed). The
`torch:sdpa` path runs on the GPU once per SDPA backend (flash, memory-efficient, cuDNN, math),
forced with `torch.nn.attention.sdpa_kernel`, and its output and gradients are compared with
the NumPy oracle at the SPEC tolerances. Each case runs as in the table, with head_dim 16 (the
fused kernels take multiples of 8 only; the table's heads are 4 wide), and with head_dim 16 in
bfloat16 (flash takes no float32). A backend that cannot take a variant (flash takes no mask) is
listed as refusing it. Exit status 1 if any variant a backend takes fails.
"""

import dataclasses
import os
import sys

from shared_tests import parity
from shared_tests.cases import CASES, make_data
from shared_tests.frameworks import run

BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def check(case, data, expected, backend):
    """'PASS', 'FAIL: ...' or 'refused' for one case on one backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            result = run(case, data, "torch:sdpa")
    except RuntimeError as error:
        if "No available kernel" in str(error):
            return "refused"
        raise
    tolerance = parity.tolerance(case, ("torch", "numpy"))
    failures = [
        f"{quantity} {difference:.1e} > {tolerance[quantity]}"
        for quantity in ("output", "grads")
        if tolerance[quantity] is not None
        for difference in [parity.diff(result, expected, quantity)]
        if not difference <= tolerance[quantity]
    ]
    return "FAIL: " + "; ".join(failures) if failures else "PASS"


def variants(case):
    """The case as in the table, with head_dim 16, and (float32 cases) also in bfloat16."""
    wide = dataclasses.replace(case, name=f"{case.name}/h16", h=16)
    low = [dataclasses.replace(wide, name=f"{case.name}/h16/bf16", dtype="bfloat16")] if case.dtype == "float32" else []
    return [case, wide, *low]


def main():
    os.environ["PARITY_TORCH_DEVICE"] = "cuda"
    print(f"scaled_dot_product_attention backends on {parity.describe_device('cuda')}")
    runs = []
    for variant in (variant for case in CASES for variant in variants(case)):
        data = make_data(variant)
        runs.append((variant, data, run(variant, data, "numpy")))
    status = 0
    for backend in BACKENDS:
        outcomes = {case.name: check(case, data, expected, backend) for case, data, expected in runs}
        passed = [name for name, outcome in outcomes.items() if outcome == "PASS"]
        refused = [name for name, outcome in outcomes.items() if outcome == "refused"]
        failed = {name: outcome for name, outcome in outcomes.items() if outcome.startswith("FAIL")}
        print(f"\n{backend}: {len(passed)} PASS, {len(failed)} FAIL, {len(refused)} refused by the backend")
        print("  passed: " + (", ".join(passed) or "none"))
        print("  refused: " + (", ".join(refused) or "none"))
        for name, outcome in failed.items():
            print(f"  {name}: {outcome}")
        status = status or int(bool(failed))
    return status


if __name__ == "__main__":
    sys.exit(main())
