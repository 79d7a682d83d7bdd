"""Checks of the PyTorch layer that need CUDA: every SDPA kernel, and torch.compile.

`python -m shared_tests.cuda_checks` on a machine with CUDA (no TensorFlow needed).

SDPA kernels: the `torch:sdpa` path runs on the GPU once per SDPA backend (flash,
memory-efficient, cuDNN, math), forced with `torch.nn.attention.sdpa_kernel`, and its output and
gradients are compared with the NumPy oracle at the SPEC tolerances. Each case runs as in the
table, with head_dim 16 (the fused kernels take multiples of 8 only; the table's heads are 4
wide), and with head_dim 16 in bfloat16 (flash takes no float32). A backend that cannot take a
variant (flash takes no mask) is listed as refusing it.

torch.compile: `torch.compile(fullgraph=True)` (inductor, Triton kernels) of a masked causal GQA
cross-attention call, with and without weights, forward and backward, and of KV-cache decoding
(a prefill, then one token at a time), in float32 and bfloat16, against eager and the full pass.

Exit status 1 if any variant a backend takes fails, or a compiled call differs.
"""

import dataclasses
import os
import sys

from shared_tests import parity
from shared_tests.cases import CASES, TOLERANCES, make_data
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


def compile_checks(dtype):
    """Failures of torch.compile on CUDA in one dtype: compiled against eager, and compiled
    decoding against the full causal pass (and NaN past the cache's end)."""
    import torch

    from PyTorch import MultiHeadAttention

    tolerance = TOLERANCES[str(dtype).removeprefix("torch.")]["output"]
    torch.manual_seed(0)
    layer = MultiHeadAttention(64, 8, num_kv_heads=2, device="cuda", dtype=dtype)
    x, y = torch.randn(2, 9, 64, device="cuda", dtype=dtype), torch.randn(2, 11, 64, device="cuda", dtype=dtype)
    keep = torch.rand(2, 1, 11, device="cuda") < 0.7
    keep[1] = False  # a batch element with no key
    failures = []
    for weights in (False, True):

        def step(x, y, keep, weights=weights):
            result = layer(x, y, attention_mask=keep, causal=True, return_attention=weights)
            return result[0] if weights else result

        expected, got = step(x, y, keep), torch.compile(step, fullgraph=True)(x, y, keep)
        layer.zero_grad()
        got.float().sum().backward()
        difference = (expected - got).abs().max().item()
        if not difference <= tolerance or not all(torch.isfinite(p.grad).all() for p in layer.parameters()):
            failures.append(f"return_attention={weights}: compiled vs eager {difference:.1e}, or a gradient not finite")
    layer.eval()
    with torch.no_grad():
        decode = torch.compile(lambda x, cache: layer(x, causal=True, cache=cache), fullgraph=True)
        tokens = torch.randn(2, 12, 64, device="cuda", dtype=dtype)
        output, cache = decode(tokens[:, :4], layer.init_cache(2, 16))
        outputs = [output]
        for t in range(4, 12):
            output, cache = decode(tokens[:, t : t + 1], cache)
            outputs.append(output)
        difference = (torch.cat(outputs, 1) - layer(tokens, causal=True)).abs().max().item()
        if not difference <= tolerance:
            failures.append(f"compiled decoding vs the full pass {difference:.1e}")
        if not torch.isnan(decode(tokens[:, :8], cache)[0]).all():
            failures.append("compiled decoding past the cache's end is not NaN")
    return failures


def main():
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device (these checks run the PyTorch layer on a GPU)", file=sys.stderr)
        return 2
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
    for dtype in (torch.float32, torch.bfloat16):
        failures = compile_checks(dtype)
        print(f"\ntorch.compile, {dtype}: " + ("; ".join(failures) if failures else "PASS"))
        status = status or int(bool(failures))
    return status


if __name__ == "__main__":
    sys.exit(main())
