"""Compile time of `torch.compile(fullgraph=True)`: our layer's forward plus backward against
`nn.MultiheadAttention`'s at the same shapes, each in a fresh process with cold caches.

`python -m bench.compile_time LAYER B T E N` compiles one layer (`ours` or `builtin`) in this
process and prints JSON {"compile": seconds of the first forward + backward, "step": seconds of
the next one}; `compile_times` runs each layer in its own process (no warm Dynamo, Inductor or
FX caches: TORCHINDUCTOR_FORCE_DISABLE_CACHES) and `compile_table` writes the Markdown rows.

Legend: B batch, T query length, S key/value length (S = T), E d_model, N num_heads.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAYERS = {"ours": "PyTorch ours", "builtin": "nn.MultiheadAttention"}


def _compile_once(which, b, t, e, n):
    """Seconds of the first compiled forward + backward (the compile) and of the next one."""
    import torch

    from PyTorch import MultiHeadAttention

    layer = MultiHeadAttention(e, n)
    layer = layer if which == "ours" else layer.to_torch()
    x = torch.randn(b, t, e, requires_grad=True)

    def forward(x):
        return layer(x) if which == "ours" else layer(x, x, x, need_weights=False)[0]

    compiled = torch.compile(forward, fullgraph=True)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        compiled(x).sum().backward()
        times.append(time.perf_counter() - start)
    return {"compile": times[0], "step": times[1]}


def compile_times(config, processes=1):
    """{label: [compile seconds of each fresh process]} for ours and the built-in, taking turns."""
    times = {label: [] for label in LAYERS.values()}
    environment = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    for _ in range(processes):
        for which, label in LAYERS.items():
            numbers = [str(v) for v in (config.b, config.t, config.e, config.n)]
            command = [sys.executable, "-m", "bench.compile_time", which, *numbers]
            done = subprocess.run(
                command, capture_output=True, text=True, cwd=Path(__file__).parents[1], env=environment, check=True
            )
            times[label].append(json.loads(done.stdout.strip().splitlines()[-1])["compile"])
    return times


def compile_table(times, config):
    ours, theirs = times[LAYERS["ours"]], times[LAYERS["builtin"]]
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return "\n".join(
        [
            "| configuration | ours compile (s) | nn.MultiheadAttention compile (s) | ours / built-in (spread) |",
            "|---|---|---|---|",
            f"| {config.name} | {statistics.median(ours):.1f} | {statistics.median(theirs):.1f} "
            f"| **{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) |",
        ]
    )


if __name__ == "__main__":
    which, *numbers = sys.argv[1:]
    print(json.dumps(_compile_once(which, *(int(v) for v in numbers))))
