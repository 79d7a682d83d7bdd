"""The sparse indexer (DSA) against dense MLA at a long sequence: peak memory and time of one causal
forward pass of the PyTorch layer (`python -m bench.sparse_indexer`, or `--quick`).

DeepSeek-V3.2's shapes scaled down to fit 2 cores: E = 512, N = 8 heads, C = 128 (kv_lora_rank),
Q = 192 (q_lora_rank), Hn = 32, Hr = 16, Hv = 32; the indexer Ni = 8 heads of Hi = 32, k = 512
(index_topk); B = 1, T = S = 8192, float32, under `torch.no_grad`. Dense MLA takes the layer's own
path (SDPA on the expanded heads); the sparse layer scores the keys in blocks of query rows and,
past `sparse_gather_threshold` score elements (B*N*T*S = 512 Mi here), attends each query's k
gathered latents: no (B, N, T, S) score tensor. Each configuration runs in a process of its own,
whose peak resident memory (`ru_maxrss`) less the memory after building the layer and the inputs is
its peak; the time is the best of `--repeats` passes after one warm-up.

Legend: B batch, T query length, S key length, E d_model, N num_heads, C kv_lora_rank,
Q q_lora_rank, Hn qk_nope_head_dim, Hr qk_rope_head_dim, Hv v_head_dim, Ni index_num_heads,
Hi index_head_dim, k index_topk.
"""

import argparse
import json
import resource
import subprocess
import sys
import time

MLA = dict(
    num_heads=8, kv_lora_rank=128, q_lora_rank=192, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    rope_theta=10000.0, rope_interleaved=True, bias=False,
)  # fmt: skip
INDEXER = dict(index_topk=512, index_num_heads=8, index_head_dim=32)
E, LENGTH, QUICK_LENGTH = 512, 8192, 1024
THRESHOLD = 1 << 26  # the PyTorch layer's default `sparse_gather_threshold`


def _peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux


def measure(kind, length, repeats):
    """One configuration in this process: {"kind", "length", "peak_mib", "seconds"}."""
    import torch

    from PyTorch import MultiHeadAttention

    torch.manual_seed(0)
    layer = MultiHeadAttention(E, **MLA, **(INDEXER if kind == "sparse" else {})).eval()
    x = torch.randn(1, length, E)  # (B, T, E)
    base, times = _peak_mib(), []
    with torch.no_grad():
        for _ in range(1 + repeats):  # a warm-up, then the timed passes
            start = time.perf_counter()
            layer(x, causal=True)
            times.append(time.perf_counter() - start)
    return {"kind": kind, "length": length, "peak_mib": round(_peak_mib() - base), "seconds": min(times[1:])}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"T = S = {QUICK_LENGTH} instead of {LENGTH}")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one", choices=("dense", "sparse"), help=argparse.SUPPRESS)  # a child process's run
    args = parser.parse_args(argv)
    length = QUICK_LENGTH if args.quick else LENGTH
    if args.one:
        print(json.dumps(measure(args.one, length, args.repeats)))
        return
    rows = []
    for kind in ("dense", "sparse"):
        command = [sys.executable, "-m", "bench.sparse_indexer", "--one", kind, "--repeats", str(args.repeats)]
        output = subprocess.run(command + ["--quick"] * args.quick, capture_output=True, text=True, check=True)
        rows.append(json.loads(output.stdout.strip().splitlines()[-1]))
    print("| layer | T = S | peak memory (MiB) | time (s) |\n|---|---|---|---|")
    for row in rows:
        route = "gathered" if MLA["num_heads"] * row["length"] ** 2 > THRESHOLD else "masked"  # B = 1
        name = "dense MLA" if row["kind"] == "dense" else f"MLA + indexer, k = {INDEXER['index_topk']} ({route})"
        print(f"| {name} | {row['length']} | {row['peak_mib']} | {row['seconds']:.2f} |")


if __name__ == "__main__":
    main()
