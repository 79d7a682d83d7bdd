"""The Keras file's T = 1 decoding step under `jax.jit` against a hand-written `keras.ops` step.

`python -m bench.keras_decode B L E N RUNS ROUNDS` sets KERAS_BACKEND=jax before Keras is
imported and prints JSON {"ours": [seconds of each round], "hand": [...]}: both steps take the
token and the cache and return the output and the new cache (functional, as a JAX decoding loop
carries it), with L - 1 tokens in the cache; each writes slot L - 1 and attends all L slots, and
they take turns run by run. keras_hub (whose `CachedMultiHeadAttention` would be the anchor) is
not installed (docs/benchmark.md says why), so the anchor is written here: one fused q/k/v
matmul, `ops.slice_update` of a (B, L, N, H) cache, the scores of the written slots, softmax and
the output projection. Its output is checked once against ours.

Legend: B batch, T query length (1), E d_model, N num_heads, H head_dim, L cache length.
"""

import json
import os
import statistics
import sys

HAND_ATOL = 1e-5  # float32 at E <= 512
TARGET = 1.0  # ours / the hand-written step: no slower


def hand_step(x, w_qkv, b_qkv, w_out, b_out, cache_k, cache_v, index, num_heads):
    """One decoding step in keras.ops. x (B, 1, E); cache_k, cache_v (B, L, N, H); returns the
    (B, 1, E) output and the written caches."""
    from keras import ops

    b, _, e = x.shape
    h, length = e // num_heads, cache_k.shape[1]
    qkv = ops.reshape(ops.matmul(x, w_qkv) + b_qkv, (b, 1, 3, num_heads, h))  # (B, 1, E) -> (B, 1, 3, N, H)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # 3 x (B, 1, N, H)
    cache_k = ops.slice_update(cache_k, (0, index, 0, 0), k)  # (B, L, N, H)
    cache_v = ops.slice_update(cache_v, (0, index, 0, 0), v)  # (B, L, N, H)
    scores = ops.einsum("bqnh,bknh->bnqk", q, cache_k) / h**0.5  # (B, N, 1, L)
    scores = ops.where(ops.arange(length) <= index, scores, -1e30)  # the written slots
    context = ops.einsum("bnqk,bknh->bqnh", ops.softmax(scores, axis=-1), cache_v)  # (B, 1, N, H)
    return ops.matmul(ops.reshape(context, (b, 1, e)), w_out) + b_out, cache_k, cache_v


def measure(b, length, e, n, runs, rounds):
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import numpy as np
    from keras import ops

    from bench.timing import rounds_of_times
    from Keras import MultiHeadAttention

    x = ops.convert_to_tensor(np.random.default_rng(0).standard_normal((b, length, e)).astype("float32"))
    layer = MultiHeadAttention(e, n)
    _, cache = layer(x[:, :-1], causal=True, cache=layer.init_cache(b, length))  # L - 1 tokens
    trainable = [v.value for v in layer.trainable_variables]
    fixed = [v.value for v in layer.non_trainable_variables]

    @jax.jit
    def ours(x, cache):
        (output, new_cache), _ = layer.stateless_call(trainable, fixed, x, cache=cache, causal=True)
        return output, new_cache

    w = layer.export_weights()
    w_qkv = np.concatenate([w[f"{p}_kernel"] for p in ("query", "key", "value")], axis=1)  # (E, 3E)
    b_qkv = np.concatenate([w[f"{p}_bias"] for p in ("query", "key", "value")])  # (3E,)
    hand_cache = [ops.transpose(c, (0, 2, 1, 3)) for c in (cache.key, cache.value)]  # (B, N, L, H) -> (B, L, N, H)
    hand = jax.jit(lambda x, k, v, i: hand_step(x, w_qkv, b_qkv, w["output_kernel"], w["output_bias"], k, v, i, n))
    last, index = x[:, -1:], ops.convert_to_tensor(length - 1, dtype="int32")
    np.testing.assert_allclose(hand(last, *hand_cache, index)[0], ours(last, cache)[0], rtol=0, atol=HAND_ATOL)
    steps = {
        "ours": lambda: ours(last, cache)[0].block_until_ready(),
        "hand": lambda: hand(last, *hand_cache, index)[0].block_until_ready(),
    }
    return rounds_of_times(steps, runs, rounds)


def keras_decode_times(configs, runs, rounds, forks):
    """{config name: {"ours": [...], "hand": [...]}, or the error text}: a fresh process per size
    (a child of `forks`' JAX server)."""
    results = {}
    for config in configs:
        measured = forks.run(
            "jax", "bench.keras_decode", "measure", [config.b, config.t, config.e, config.n, runs, rounds]
        )
        results[config.name] = measured["error"][-300:] if "error" in measured else measured
    return results


def keras_decode_table(results):
    lines = [
        "| configuration | Keras ours under jax.jit (ms) | hand keras.ops (ms) | target | ours / hand (spread) | met |",
        "|---|---|---|---|---|---|",
    ]
    for name, measured in results.items():
        if isinstance(measured, str):
            lines.append(f"| {name} | failed: {measured.splitlines()[-1]} | | | | |")
            continue
        ours, hand = measured["ours"], measured["hand"]
        ratios = [a / b for a, b in zip(ours, hand, strict=True)]
        median = statistics.median(ratios)
        lines.append(
            f"| {name} | {statistics.median(ours) * 1e3:.3f} | {statistics.median(hand) * 1e3:.3f} "
            f"| <= {TARGET}x | **{median:.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) "
            f"| {'yes' if median <= TARGET else 'no'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(measure(*(int(v) for v in sys.argv[1:]))))
