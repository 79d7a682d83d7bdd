"""One decoding step of our layers against two anchors: a hand-written PyTorch decode and
keras-hub's `CachedMultiHeadAttention`.

Each step is a T = 1 call at context length L (`config.t`) with L - 1 tokens in the cache: it
writes slot L - 1 and attends all L slots, and every timed run writes the same slot again, so
every run does the same work. The steps (float32, same weights everywhere) are:

- PyTorch ours under `torch.no_grad`: `output, cache = layer(x, causal=True, cache=cache)`;
- the hand-written PyTorch decode: a fused q/k/v matmul, an in-place cache write,
  `F.scaled_dot_product_attention` over the written slots and the output projection, called
  as the forward of an `nn.Module` (`hand_module`), as a model calls its attention and as our
  layer is called: both sides pay the one module call (`nn.Module.__call__`);
- TensorFlow ours in `tf.function` and in `tf.function(jit_compile=True)`, with the functional
  cache (the step returns the output and the new cache, which it takes as an argument) and with
  the in-place cache of `init_cache(..., in_place=True)` (variables written in place, closed
  over by the step), the latter also as the step's ConcreteFunction called directly;
- keras-hub's `CachedMultiHeadAttention` in `tf.function` and in XLA, with its (B, 2, L, N, H)
  cache and the (B, 1, L) mask of the written slots that keras-hub's decoders pass, when
  keras-hub is importable (it is not in requirements.txt: docs/benchmark.md says why).

Legend: B batch, T query length (1), E d_model, N num_heads, H head_dim, L cache length.
"""

import importlib.util
import statistics

import numpy as np

TORCH_OURS = "PyTorch ours"
HAND = "hand PyTorch"
TF_FUNCTION = "TF ours (tf.function)"
TF_XLA = "TF ours (XLA)"
TF_IN_PLACE_FUNCTION = "TF ours in-place (tf.function)"
TF_IN_PLACE_XLA = "TF ours in-place (XLA)"
TF_IN_PLACE_CONCRETE = "TF ours in-place (XLA, concrete)"
HUB_FUNCTION = "keras-hub (tf.function)"
HUB_XLA = "keras-hub (XLA)"
TF_STEPS = (TF_FUNCTION, TF_XLA, TF_IN_PLACE_FUNCTION, TF_IN_PLACE_XLA, TF_IN_PLACE_CONCRETE)
TF_BEST = TF_IN_PLACE_CONCRETE  # TensorFlow's best documented step (docs/serving.md)
TF_TARGET = 1.2  # TF_BEST / PyTorch ours, at every size; the other steps are printed without one
# Each anchor must compute what ours computes; float32 at E <= 512.
HAND_ATOL = 1e-5
HUB_ATOL = 1e-4


def has_keras_hub():
    return importlib.util.find_spec("keras_hub") is not None


def keras_hub_version():
    import keras_hub

    return keras_hub.__version__


def hand_decode(x, w_qkv, b_qkv, w_out, b_out, cache_k, cache_v, index, num_heads):
    """The anchor: one decoding step written by hand. x (B, 1, E); cache_k, cache_v (B, N, L, H)."""
    import torch.nn.functional as F

    b, t, e = x.shape
    qkv = F.linear(x, w_qkv, b_qkv).view(b, t, 3, num_heads, e // num_heads)  # (B, 1, E) -> (B, 1, 3, N, H)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (B, 1, 3, N, H) -> 3 x (B, N, 1, H)
    cache_k[:, :, index] = k[:, :, 0]
    cache_v[:, :, index] = v[:, :, 0]
    out = F.scaled_dot_product_attention(q, cache_k[:, :, : index + 1], cache_v[:, :, : index + 1])  # (B, N, 1, H)
    return F.linear(out.transpose(1, 2).reshape(b, t, e), w_out, b_out)  # (B, N, 1, H) -> (B, 1, E)


def hand_module():
    """`hand_decode` as the forward of an nn.Module, called through `nn.Module.__call__` as a
    model calls its attention layer: ours is called so too, and the call's bookkeeping (its hook
    and tracing checks) is a sizeable part of a T = 1 step."""
    import torch

    class HandDecode(torch.nn.Module):
        forward = staticmethod(hand_decode)

    return HandDecode()


def torch_steps(config, x):
    """{label: step} for PyTorch ours and the hand decode on the same weights and cache, after
    checking once that they give the same output. x (B, L, E) float32 NumPy."""
    import torch

    from PyTorch import MultiHeadAttention

    layer = MultiHeadAttention(config.e, config.n).eval()
    x = torch.from_numpy(x)
    last, index = x[:, -1:], config.t - 1
    with torch.no_grad():
        _, cache = layer(x[:, :-1], causal=True, cache=layer.init_cache(config.b, config.t))  # L - 1 tokens
        projections = (layer.query, layer.key, layer.value)
        w_qkv = torch.cat([p.weight for p in projections])  # (3E, E)
        b_qkv = torch.cat([p.bias for p in projections])  # (3E,)
        hand_cache = (cache.key.clone(), cache.value.clone())  # (B, N, L, H) each
    hand_step, output_kernel = hand_module(), (layer.output.weight, layer.output.bias)  # read once, as w_qkv

    def ours():
        with torch.no_grad():
            return layer(last, causal=True, cache=cache)[0]

    def hand():
        with torch.no_grad():
            return hand_step(last, w_qkv, b_qkv, *output_kernel, *hand_cache, index, config.n)

    np.testing.assert_allclose(hand().numpy(), ours().numpy(), rtol=0, atol=HAND_ATOL)
    return {TORCH_OURS: ours, HAND: hand}, layer.export_weights()


def tf_layer(config, weights):
    from TensorFlow import MultiHeadAttention

    layer = MultiHeadAttention(config.e, config.n)
    layer.import_weights(weights)
    return layer


def tf_functional_step(layer, x, length, jit_compile):
    """TF ours with the functional cache: the step returns the output and the new cache."""
    import tensorflow as tf

    _, cache = layer(x[:, :-1], causal=True, cache=layer.init_cache(x.shape[0], length))  # L - 1 tokens
    step = tf.function(lambda x, cache: layer(x, causal=True, cache=cache), jit_compile=jit_compile)
    last = x[:, -1:]
    return lambda: step(last, cache)[0].numpy()


def tf_in_place_step(layer, x, length, jit_compile, concrete=False):
    """TF ours with the in-place cache, as docs/serving.md decodes with it: `init_cache(...,
    in_place=True)` holds variables that each step writes in place, and the step closes over
    them, taking only the new token (a cache passed as an argument is walked by tf.function on
    every call). `concrete` calls the step's ConcreteFunction directly. Each timed step first
    sets the index back to L - 1 inside the same graph, so every step rewrites slot L - 1."""
    import tensorflow as tf

    _, cache = layer(x[:, :-1], causal=True, cache=layer.init_cache(x.shape[0], length, in_place=True))

    def rewrite_the_last_slot(x):
        cache.index.assign(length - 1)
        return layer(x, causal=True, cache=cache)[0]

    last = x[:, -1:]
    step = tf.function(rewrite_the_last_slot, jit_compile=jit_compile)
    step = step.get_concrete_function(last) if concrete else step
    return lambda: step(last).numpy()


def keras_hub_step(layer, x, length, jit_compile):
    """keras-hub's CachedMultiHeadAttention holding the layer's weights, its cache filled with
    the same L - 1 keys and values; the step returns the output and the new cache."""
    import keras_hub
    import tensorflow as tf

    hub = keras_hub.layers.CachedMultiHeadAttention(layer.num_heads, layer.head_dim)
    hub.build((None, None, layer.d_model), (None, None, layer.d_model))
    hub.set_weights(layer.to_keras().get_weights())
    _, cache = layer(x[:, :-1], causal=True, cache=layer.init_cache(x.shape[0], length))
    hub_cache = tf.transpose(tf.stack([cache.key, cache.value], axis=1), (0, 1, 3, 2, 4))  # (B, 2, L, N, H)

    def call(x, hub_cache, index):
        written = tf.range(length)[None, None, :] <= index  # (1, 1, L)
        mask = tf.broadcast_to(written, (tf.shape(x)[0], 1, length))  # (B, 1, L)
        return hub(x, x, attention_mask=mask, cache=hub_cache, cache_update_index=index)

    step = tf.function(call, jit_compile=jit_compile)
    last, index = x[:, -1:], tf.constant(length - 1)
    return lambda: step(last, hub_cache, index)[0].numpy()


def tf_steps(config, x, weights):
    """{label: step} for TensorFlow ours (functional and in-place cache, tf.function and XLA)
    and, when importable, keras-hub's layer; every step's output is checked once against the
    first one's."""
    import tensorflow as tf

    layer, x = tf_layer(config, weights), tf.constant(x)
    steps = {
        TF_FUNCTION: tf_functional_step(layer, x, config.t, jit_compile=False),
        TF_XLA: tf_functional_step(layer, x, config.t, jit_compile=True),
        TF_IN_PLACE_FUNCTION: tf_in_place_step(layer, x, config.t, jit_compile=False),
        TF_IN_PLACE_XLA: tf_in_place_step(layer, x, config.t, jit_compile=True),
        TF_IN_PLACE_CONCRETE: tf_in_place_step(layer, x, config.t, jit_compile=True, concrete=True),
    }
    reference = steps[TF_FUNCTION]()
    for label in TF_STEPS[1:]:
        np.testing.assert_allclose(steps[label](), reference, rtol=0, atol=HAND_ATOL)
    if has_keras_hub():
        steps[HUB_FUNCTION] = keras_hub_step(layer, x, config.t, jit_compile=False)
        steps[HUB_XLA] = keras_hub_step(layer, x, config.t, jit_compile=True)
        np.testing.assert_allclose(steps[HUB_FUNCTION](), steps[TF_FUNCTION](), rtol=0, atol=HUB_ATOL)
    return steps


def decode_steps(config):
    """{label: step} of every decoding step at one size, on the same weights and input."""
    x = np.random.default_rng(0).standard_normal((config.b, config.t, config.e)).astype(np.float32)
    steps, weights = torch_steps(config, x)
    steps.update(tf_steps(config, x, weights))
    return steps


def _ratio(times, ours, theirs):
    """(median ratio, min, max) of the per-round ratios ours / theirs."""
    ratios = [a / b for a, b in zip(times[ours], times[theirs], strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def anchor_tables(times, configs):
    """The step times of every size, then the ratios with their targets. `times`: {config name:
    {label: [seconds of each round]}}; `configs`: [(config, target of PyTorch ours / hand)]."""
    labels = list(dict.fromkeys(label for measured in times.values() for label in measured))
    lines = ["| configuration | " + " | ".join(f"{label} (ms)" for label in labels) + " |"]
    lines.append("|---" * (len(labels) + 1) + "|")
    for config, _ in configs:
        measured = times[config.name]
        cells = [f"{statistics.median(measured[label]) * 1e3:.2f}" if label in measured else "-" for label in labels]
        lines.append(f"| {config.name} | " + " | ".join(cells) + " |")
    lines += ["", "| configuration | ratio | target | measured (spread) | met |", "|---|---|---|---|---|"]
    for config, hand_target in configs:
        pairs = [(label, TORCH_OURS, TF_TARGET if label == TF_BEST else None) for label in TF_STEPS]
        for ours, theirs, target in [*pairs, (TORCH_OURS, HAND, hand_target)]:
            median, low, high = _ratio(times[config.name], ours, theirs)
            goal, met = ("-", "-") if target is None else (f"<= {target}x", "yes" if median <= target else "no")
            lines.append(
                f"| {config.name} | {ours} / {theirs} | {goal} | **{median:.2f}x** ({low:.2f}-{high:.2f}) | {met} |"
            )
    return "\n".join(lines)
