"""The gated families: attention with an output gate (Qwen3-Next, Qwen3.5, AFMoE, LFM3), the layers of their
hybrid models that are not attention, and the gated attentions refused with what they add."""

import numpy as np

from .config import _head_dim, _layer_type
from .llama import _rotary
from .tensors import _tensor


def _gated(config, tensors, index, *, gate, rope="all", activation="sigmoid", **rotary_options):
    """Attention with an output gate, sigmoid(hidden @ gate_kernel) times each head's result before `o_proj`
    (`_rotary` for the rest). `gate`: "q_proj" (Qwen3-Next, Qwen3.5: `q_proj` yields, head by head, H query
    features and then H gate features), "gate_proj" (AFMoE: an (N*H, E) projection) or "g_proj" (LFM3, Laguna:
    one gate per head, (N, E), the same for each of its H features; Laguna's per feature, (N*H, E), with
    `gating="per-feature"`). `activation`: "sigmoid", or "softplus" (Laguna), the layer's `gate_activation`.
    Layers that are not attention (Qwen3-Next's and Qwen3.5's linear attention, LFM3's convolutions) are
    refused by name."""
    _refuse_layer_type(config, index)
    if "rms_norm_eps" not in config and "norm_eps" in config:  # LFM3's name for it (`attribute_map`)
        config = {**config, "rms_norm_eps": config["norm_eps"]}
    head_dim, num_heads = _head_dim(config), config["num_attention_heads"]
    if gate == "q_proj":  # rows [q_0, g_0, q_1, g_1, ...], H each: split into two projections
        tensors = dict(tensors)
        for part in ("weight", "bias"):
            if f"q_proj.{part}" in tensors:
                fused = _tensor(tensors, f"q_proj.{part}")  # (N*2H, E) or (N*2H,)
                both = fused.reshape(num_heads, 2, head_dim, *fused.shape[1:])  # (N, 2, H, E) or (N, 2, H)
                tensors[f"q_proj.{part}"] = both[:, 0].reshape(num_heads * head_dim, *fused.shape[1:])  # (N*H, ...)
                tensors[f"gate.{part}"] = both[:, 1].reshape(num_heads * head_dim, *fused.shape[1:])
        gate = "gate"
    kwargs, weights = _rotary(config, tensors, index, rope=rope, **rotary_options)
    if gate == "g_proj" and "g_proj.weight" not in tensors:
        gate = "gate_proj"  # LFM3's checkpoints name it so (transformers renames it `g_proj` when loading)
    kernel = _tensor(tensors, f"{gate}.weight")  # (N*H, E), or LFM3's (N, E)
    if kernel.shape[0] == num_heads and num_heads != num_heads * head_dim:  # LFM3: one gate per head
        kernel = np.repeat(kernel, head_dim, axis=0)  # (N, E) -> (N*H, E): head n's gate on each of its features
    weights["gate_kernel"] = kernel.T.copy()  # (E, N*H)
    names = {True: _PROJECTION_NAMES, False: ()}.get(kwargs["bias"], kwargs["bias"])
    if f"{gate}.bias" in tensors:
        weights["gate_bias"] = _tensor(tensors, f"{gate}.bias")
        names = (*names, "gate")
    kwargs["bias"] = True if names == (*_PROJECTION_NAMES, "gate") else tuple(names) or False
    kwargs |= {} if activation == "sigmoid" else {"gate_activation": activation}
    return kwargs | {"gate": True}, weights


_PROJECTION_NAMES = ("query", "key", "value", "output")
_NOT_ATTENTION = {"linear_attention": "a linear attention (a gated delta rule)", "conv": "a short convolution"}


def _refuse_layer_type(config, index):
    """Refuses a layer of a hybrid model that is not attention, naming its `layer_types` entry."""
    layer_type = None if index is None else _layer_type(config, index)
    if layer_type in _NOT_ATTENTION:
        raise ValueError(
            f"`layer_index` must name an attention layer: layer {index} of this {config.get('model_type')} model is "
            f"{_NOT_ATTENTION[layer_type]}, not attention. Received: layer_types[{index}]={layer_type!r}"
        )


_GATED_REFUSED = {  # gated attention with something more that the layer does not compute
    "step3p7": "Step-3.7's attention reads its head counts, RoPE bases and partial rotary factors from a per-layer "
    "config (`per_layer_config`), which no porter reads",
}
_GATED_REFUSED["step3p5"] = _GATED_REFUSED["step3p7"]  # its config's model type
