"""Cross-layer KV sharing: the KV cache a stack of layers holds, each layer with its own cache against the last
layers reading the cache of an earlier one (Gemma 3n's and Gemma 4's `num_kv_shared_layers`), and one decode
step through the stack (`python -m bench.sections shared_cache`).

Gemma 3n E4B's attention shapes scaled down to fit 2 cores: E = 512, N = 8 query heads, K = 2 key/value heads,
H = 64, 8 layers of which the last 4 share (`kv_shared=True`: no key or value projections, `shared_kv` the cache
of the last layer before them), L = 1024 cache slots with L - 1 tokens written. A step is a T = 1 call of every
layer under `torch.no_grad`: a layer with its own cache writes slot L - 1 and attends all L slots (every timed
run writes the same slot again), a shared layer reads the cache its producer just wrote and writes nothing.

Legend: B batch, T query length (1), E d_model, N num_heads, K num_kv_heads, H head_dim, L cache length.
"""

import dataclasses

from bench.timing import ratio_cell, rounds_of_times


@dataclasses.dataclass(frozen=True)
class SharedConfig:
    e: int = 512
    n: int = 8
    k: int = 2
    h: int = 64
    layers: int = 8
    shared: int = 4  # the last layers, reading the cache of layer `layers - shared - 1`
    length: int = 1024  # L

    @property
    def options(self):
        return dict(num_kv_heads=self.k, head_dim=self.h, bias=False, rope_theta=10000.0, qk_norm="head")


CONFIG = SharedConfig()
QUICK_CONFIG = SharedConfig(e=64, n=4, k=2, h=16, layers=4, shared=2, length=32)  # `make bench ARGS=--quick`
BATCHES = (1, 8)
OWN, SHARED = "every layer its own cache", "last layers sharing"


def decode_steps(config, batch):
    """{label: step through the stack} at batch `batch`, and {label: the stack's cache bytes}."""
    import torch

    from PyTorch import MultiHeadAttention

    torch.manual_seed(0)
    first_shared = config.layers - config.shared
    own = [MultiHeadAttention(config.e, config.n, value_norm=True, **config.options) for _ in range(config.layers)]
    shared = own[:first_shared] + [
        MultiHeadAttention(config.e, config.n, kv_shared=True, **config.options) for _ in range(config.shared)
    ]
    x = torch.randn(batch, config.length, config.e)
    steps, sizes = {}, {}
    for label, stack in ((OWN, own), (SHARED, shared)):
        caches = {}
        with torch.no_grad():
            for index, layer in enumerate(stack):
                layer.eval()
                if not layer.kv_shared:
                    _, caches[index] = layer(x[:, :-1], causal=True, cache=layer.init_cache(batch, config.length))
        steps[label] = _step(stack, caches, x[:, -1:], first_shared - 1)
        sizes[label] = sum(cache.key.nbytes + cache.value.nbytes for cache in caches.values())
    return steps, sizes


def _step(stack, caches, token, source):
    """One T = 1 call of every layer of `stack` (B, 1, E); the shared layers read the cache of layer `source`."""
    import torch

    def step():
        with torch.no_grad():
            written = None
            for index, layer in enumerate(stack):
                if layer.kv_shared:
                    layer(token, causal=True, shared_kv=written)
                else:
                    _, cache = layer(token, causal=True, cache=caches[index])  # rewrites slot L - 1 every time
                    written = cache if index == source else written

    return step


def time_shared(runs, rounds, config=CONFIG):
    """{batch: ({label: [seconds of each round]}, {label: cache bytes})}."""
    results = {}
    for batch in BATCHES:
        steps, sizes = decode_steps(config, batch)
        results[batch] = (rounds_of_times(steps, runs, rounds), sizes)
    return results


def shared_table(results, config=CONFIG):
    lines = [
        f"E={config.e}, N={config.n}, K={config.k}, H={config.h}, {config.layers} layers, the last {config.shared} "
        f"sharing, L={config.length}; one T = 1 step through the stack, float32, PyTorch on the CPU, median of rounds.",
        "",
        "| B | stack | KV cache (MiB) | step (ms) | step / own caches |",
        "|---|---|---|---|---|",
    ]
    for batch, (times, sizes) in results.items():
        for label, rounds in times.items():
            ms = sorted(rounds)[len(rounds) // 2] * 1e3
            saving = f"{sizes[label] / 2**20:.2f} ({1 - sizes[label] / sizes[OWN]:.0%} less)"
            lines.append(f"| {batch} | {label} | {saving} | {ms:.2f} | {ratio_cell(rounds, times[OWN])} |")
    return "\n".join(lines)
