"""Multi-head latent attention (MLA): the cache's bytes per token and one decode step, expanded
and absorbed, against the same heads without the latent (`python -m bench.sections mla`).

DeepSeek-V3's head shapes scaled down to fit 2 cores: N = 16 heads, C = 128 (kv_lora_rank),
Hr = 16 (qk_rope_head_dim), Hn = 32 (qk_nope_head_dim), Hv = 32 (v_head_dim), Q = 96
(q_lora_rank), E = 512, L = 1024 cache slots with L - 1 tokens written. A step is a T = 1 call
under `torch.no_grad` that writes slot L - 1 and attends all L slots (every timed run writes the
same slot again). The plain layer has the same N and H = Hn + Hr, one head width for keys and
values, so its cache holds 2 * N * H numbers per token; MLA's holds C + Hr.

Legend: B batch, T query length (1), E d_model, N num_heads, H head_dim, L cache length,
C kv_lora_rank, Hr qk_rope_head_dim, Hn qk_nope_head_dim, Hv v_head_dim.
"""

import dataclasses

from bench.timing import ratio_cell, rounds_of_times


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    e: int = 512
    n: int = 16
    c: int = 128
    q: int = 96
    hn: int = 32
    hr: int = 16
    hv: int = 32
    length: int = 1024  # L

    @property
    def options(self):
        return dict(
            kv_lora_rank=self.c, q_lora_rank=self.q, qk_nope_head_dim=self.hn, qk_rope_head_dim=self.hr,
            v_head_dim=self.hv, rope_theta=10000.0, rope_interleaved=True, bias=False,
        )  # fmt: skip


CONFIG = MlaConfig()
QUICK_CONFIG = MlaConfig(e=64, n=4, c=16, q=24, hn=8, hr=8, hv=8, length=32)  # `make bench ARGS=--quick`
BATCHES = (1, 8)
PLAIN, EXPANDED, ABSORBED = "plain MHA (same N, H)", "MLA expanded", "MLA absorbed"


def decode_steps(config, batch):
    """{label: step} at batch `batch`, and {label: cache bytes per token}."""
    import torch

    from PyTorch import MultiHeadAttention

    torch.manual_seed(0)
    layers = {
        PLAIN: MultiHeadAttention(config.e, config.n, head_dim=config.hn + config.hr, bias=False, rope_theta=10000.0),
        EXPANDED: MultiHeadAttention(config.e, config.n, **config.options),
        ABSORBED: MultiHeadAttention(config.e, config.n, **config.options),
    }
    layers[EXPANDED].absorb_latents, layers[ABSORBED].absorb_latents = False, True
    x = torch.randn(batch, config.length, config.e)
    steps, sizes = {}, {}
    for label, layer in layers.items():
        layer.eval()
        with torch.no_grad():
            _, cache = layer(x[:, :-1], causal=True, cache=layer.init_cache(batch, config.length))  # L - 1 tokens

        def step(layer=layer, cache=cache):
            with torch.no_grad():
                layer(x[:, -1:], causal=True, cache=cache)  # rewrites slot L - 1 every time

        steps[label] = step
        sizes[label] = (cache.key[0, :, 0].numel() + cache.value[0, :, 0].numel()) * cache.key.element_size()
    return steps, sizes


def time_mla(runs, rounds, config=CONFIG):
    """{batch: ({label: [seconds of each round]}, {label: cache bytes per token})}."""
    results = {}
    for batch in BATCHES:
        steps, sizes = decode_steps(config, batch)
        results[batch] = (rounds_of_times(steps, runs, rounds), sizes)
    return results


def mla_table(results, config=CONFIG):
    lines = [
        f"E={config.e}, N={config.n}, C={config.c}, Q={config.q}, Hn={config.hn}, Hr={config.hr}, Hv={config.hv}, "
        f"L={config.length}; one T = 1 step at slot L - 1, float32, PyTorch on the CPU, median of rounds.",
        "",
        "| B | layer | cache bytes / token | step (ms) | step / plain |",
        "|---|---|---|---|---|",
    ]
    for batch, (times, sizes) in results.items():
        for label, rounds in times.items():
            ms = sorted(rounds)[len(rounds) // 2] * 1e3
            lines.append(
                f"| {batch} | {label} | {sizes[label]:,} ({sizes[PLAIN] / sizes[label]:.1f}x less) | {ms:.2f} | "
                f"{ratio_cell(rounds, times[PLAIN])} |"
            )
    return "\n".join(lines)
