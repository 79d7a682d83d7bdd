"""PyTorch layer, modern attention: each variant (per-projection bias, scale, softcap, window,
RoPE, QK-norm, sinks, clip_qkv) and each new call argument (key_mask, query_mask, attention_bias,
positions) against a small hand-written float64 reference in the style of `transformers`'
eager attention; every code path equal; compile and export; the refused traps; the fused q/k/v
projection only where it computes what the modules would; and the regressions of the floating
mask rule."""

import copy
import math
import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from NumPy import MultiHeadAttention as NumpyMultiHeadAttention
from PyTorch import (
    AttentionMaskWarning,
    KVCache,
    Multi_Head_Attention,
    MultiHeadAttention,
    alibi_bias,
    dot_product_attention,
)
from shared_tests import numpy_runner, torch_runner
from shared_tests.call_args import call_inputs
from shared_tests.calling import INPUTS, by_name, inputs, set_path
from shared_tests.cases import FLOAT64_TOLERANCES, REPORT_CASES, TOLERANCES, make_data

OUTPUT_TOL = TOLERANCES["float32"]["output"]
WEIGHTS_TOL = TOLERANCES["float32"]["weights"]
GRADS_TOL = TOLERANCES["float32"]["grads"]
FLOAT16_TOL = TOLERANCES["float16"]["output"]
E, N, K, H = 16, 4, 2, 8  # d_model, num_heads, num_kv_heads, head_dim
B, T = 3, 6
YARN = {  # YaRN with a ramp inside R = 4 at theta 100: pair 0 kept, pair 1 blended (0.6); attention factor 1.14
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "truncate": False,
}

VARIANTS = {
    "plain": {},
    "bias_qkv": {"bias": ("query", "key", "value")},
    "bias_output_only": {"bias": ["output"]},
    "no_bias": {"bias": False},
    "scale": {"scale": 0.9},
    "softcap": {"softcap": 1.5},
    "window": {"window": 3},
    "rope": {"rope_theta": 10000.0},
    "rope_partial_interleaved": {"rope_theta": 100.0, "rope_fraction": 0.5, "rope_interleaved": True},
    "rope_yarn_partial": {"rope_theta": 100.0, "rope_fraction": 0.5, "rope_scaling": YARN},
    "qk_norm_head": {"qk_norm": "head"},
    "qk_norm_all": {"qk_norm": "all", "qk_norm_eps": 1e-3},
    "sinks": {"sinks": True},
    "clip_qkv": {"clip_qkv": 0.5},
    "clip_qkv_qk_norm_rope": {"clip_qkv": 0.5, "qk_norm": "all", "rope_theta": 10000.0},
    "gate": {"gate": True},
    "gate_no_bias_rope": {"gate": True, "bias": ("query", "key", "value", "output"), "rope_theta": 100.0},
    "everything": {
        "bias": ("query", "key", "value"),
        "scale": 0.5,
        "softcap": 3.0,
        "window": 4,
        "rope_theta": 500.0,
        "rope_fraction": 0.75,
        "qk_norm": "head",
        "sinks": True,
        "clip_qkv": 1.0,
    },  # fmt: skip  (rope_fraction 0.75: R = 6 of H = 8 rotated)
}


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _layer(seed=0, **config):
    """A layer with every parameter random (biases, QK-norm scales around 1, sink logits)."""
    torch.manual_seed(seed)
    layer = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, **config)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if not name.endswith("weight"):
                offset = 1.0 if name.endswith("norm") else 0.0
                p.copy_(offset + _randn(*p.shape, seed=len(name) + seed) * 0.3)
    return layer.eval()


# ---------------------------------------------------------------------------------------------
# The reference: float64, written the way `transformers` writes eager attention.


def _rms(x, scale, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * scale


def _hf_inv_freq(rotary_dim, theta, scaling=None):
    """transformers' `_compute_default_rope_parameters`, `_compute_llama3_parameters` and
    `_compute_yarn_parameters`, element by element."""
    inv_freq = [1.0 / theta ** (i / rotary_dim) for i in range(0, rotary_dim, 2)]
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = [f / scaling["factor"] for f in inv_freq]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        rewritten = []
        for f in inv_freq:
            wavelen = 2 * math.pi / f
            if wavelen < old / high:
                rewritten.append(f)
            elif wavelen > old / low:
                rewritten.append(f / factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                rewritten.append((1 - smooth) * f / factor + smooth * f)
        inv_freq = rewritten
    if kind == "yarn":
        inv_freq = _hf_yarn(inv_freq, rotary_dim, theta, scaling)
    return torch.tensor(inv_freq, dtype=torch.float64)


def _hf_yarn(inv_freq, dim, base, scaling):
    """YaRN: 1 - ramp of extrapolation (inv_freq) and ramp of interpolation (inv_freq / factor), the
    ramp linear between the correction dims of beta_fast and beta_slow rotations."""
    context = scaling["original_max_position_embeddings"]

    def correction_dim(rotations):
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramps = [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(dim // 2)]
    return [f / scaling["factor"] * ramp + f * (1 - ramp) for f, ramp in zip(inv_freq, ramps, strict=True)]


def _hf_attention_factor(scaling):
    """transformers' YaRN `attention_factor` (1 for the other scalings), which multiplies cos and sin."""
    if scaling is None or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]

    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return get_mscale(scaling["factor"], scaling["mscale"]) / get_mscale(
            scaling["factor"], scaling["mscale_all_dim"]
        )
    return get_mscale(scaling["factor"])


def _rope_reference(x, positions, theta, fraction, interleaved, scaling=None):
    """Rotate-half as in transformers' Llama (`x * cos + rotate_half(x) * sin`, cos and sin times
    YaRN's attention factor), or for interleaved pairs Meta's complex multiplication (GPT-J
    layout); (B, heads, T, H) float64."""
    rotary = int(x.shape[-1] * fraction)
    freqs = positions.double()[..., None] * _hf_inv_freq(rotary, theta, scaling)  # (B, T, R/2)
    factor = _hf_attention_factor(scaling)
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    if interleaved:
        pairs = torch.view_as_complex(x_rot.reshape(*x_rot.shape[:-1], rotary // 2, 2).contiguous())
        turned = torch.view_as_real(pairs * torch.polar(factor * torch.ones_like(freqs), freqs)[:, None]).flatten(-2)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, R)
        half = rotary // 2
        rotate_half = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
        turned = x_rot * (emb.cos() * factor) + rotate_half * (emb.sin() * factor)
    return torch.cat((turned, x_pass), dim=-1)


def reference(layer, query, key=None, value=None, *, keep=None, bias=None, causal=False, positions=None):
    """Float64 attention from the layer's own parameters (so gradients reach them); returns (output, weights)."""
    key = query if key is None else key
    value = key if value is None else value
    query, key, value = (x.double() for x in (query, key, value))
    (b, t, _), s = query.shape, key.shape[1]

    def project(x, module, heads):
        y = x @ module.weight.double().T + (0 if module.bias is None else module.bias.double())
        if layer.clip_qkv is not None:  # OLMo's `clamp_` right after the projection
            y = y.clamp(-layer.clip_qkv, layer.clip_qkv)
        if layer.qk_norm == "all" and module in (layer.query, layer.key):
            y = _rms(y, (layer.query_norm if module is layer.query else layer.key_norm).double(), layer.qk_norm_eps)
        return y.view(b, x.shape[1], heads, H).transpose(1, 2)

    q, k, v = project(query, layer.query, N), project(key, layer.key, K), project(value, layer.value, K)
    if layer.qk_norm == "head":
        q, k = (
            _rms(q, layer.query_norm.double(), layer.qk_norm_eps),
            _rms(k, layer.key_norm.double(), layer.qk_norm_eps),
        )
    if layer.rope_theta is not None:
        positions = torch.arange(t).expand(b, t) if positions is None else positions.expand(b, t)
        rope = (layer.rope_theta, layer.rope_fraction, layer.rope_interleaved, layer.rope_scaling)
        q, k = _rope_reference(q, positions, *rope), _rope_reference(k, positions, *rope)
    k, v = k.repeat_interleave(N // K, 1), v.repeat_interleave(N // K, 1)
    scores = q @ k.transpose(-1, -2) * layer.scale
    if layer.softcap is not None:
        scores = layer.softcap * torch.tanh(scores / layer.softcap)
    if bias is not None:
        scores = scores + bias.double()
    allowed = torch.ones(b, 1, t, s, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)
    if layer.window is not None:
        allowed = allowed & torch.ones(t, s, dtype=torch.bool).triu(diagonal=s - t - layer.window + 1)
    if keep is not None:
        allowed = allowed & keep
    scores = scores.masked_fill(~allowed, -torch.inf)
    if layer.sinks is not None:  # gpt-oss `eager_attention_forward`
        sinks = layer.sinks.double().reshape(1, -1, 1, 1).expand(b, -1, t, -1)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        weights = torch.softmax(combined, dim=-1)[..., :-1]
    else:
        weights = torch.where(allowed.any(-1, keepdim=True), torch.softmax(scores, dim=-1), 0.0)
    merged = (weights @ v).transpose(1, 2).reshape(b, t, N * H)
    if layer.gate is not None:  # Keras' use_gate, Qwen3-Next: sigmoid(query @ gate_kernel) times each head's result
        gate_bias = 0 if layer.gate.bias is None else layer.gate.bias.double()
        merged = merged * torch.sigmoid(query @ layer.gate.weight.double().T + gate_bias)
    output = merged @ layer.output.weight.double().T + (0 if layer.output.bias is None else layer.output.bias.double())
    return output, weights


# ---------------------------------------------------------------------------------------------
# Each variant against the reference, on every path.


def _output_bias(layer):
    """What a query with no key outputs: the output bias (zeros without one)."""
    return torch.zeros(E) if layer.output.bias is None else layer.output.bias.detach()


def _inputs(seed=1, b=B, t=T):
    x = _randn(b, t, E, seed=seed) * 2  # scores of a few units: soft-capping and sinks matter
    keep = torch.rand(b, 1, t, t, generator=torch.Generator().manual_seed(seed + 1)) < 0.8
    keep[..., 0] = True
    keep[0, 0, 2] = False  # query 2 of batch 0 keeps no key
    positions = torch.randint(0, 50, (b, t), generator=torch.Generator().manual_seed(seed + 2))
    return x, keep, positions


def _call(layer, path, *args, **kwargs):
    """(output, weights or None) on one path: sdpa, explicit, inference (in place, one batch element per block)."""
    if path == "sdpa":
        return layer(*args, **kwargs), None
    if path == "explicit":
        return layer(*args, return_attention=True, **kwargs)
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(Multi_Head_Attention, "_BLOCK_SCORES", 1)
        return layer(*args, return_attention=True, **kwargs)


@pytest.mark.parametrize("path", ["sdpa", "explicit", "inference"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_the_reference(variant, causal, path):
    layer = _layer(**VARIANTS[variant])
    x, keep, positions = _inputs()
    rope = {"positions": positions} if layer.rope_theta is not None else {}
    output, weights = _call(layer, path, x, attention_mask=keep, causal=causal, **rope)
    expected, expected_weights = reference(layer, x, keep=keep, causal=causal, **rope)
    torch.testing.assert_close(output.double(), expected, atol=OUTPUT_TOL, rtol=0)
    if weights is not None:
        torch.testing.assert_close(weights.double(), expected_weights, atol=WEIGHTS_TOL, rtol=0)
        assert (weights[0, :, 2] == 0).all()  # the row with no key, exactly


@pytest.mark.parametrize("path", ["sdpa", "explicit"])
@pytest.mark.parametrize(
    "variant", ["plain", "everything", "qk_norm_all", "sinks", "rope_yarn_partial", "clip_qkv_qk_norm_rope", "gate"]
)
def test_variant_gradients_match_the_reference(variant, path):
    """Gradients of the inputs, every parameter (sinks and norm scales too) and attention_bias."""
    layer = _layer(**VARIANTS[variant]).train()
    x, keep, positions = _inputs()
    y = _randn(B, T, E, seed=7)
    bias = (_randn(1, N, T, T, seed=8) * 0.5).requires_grad_()
    rope = {"positions": positions} if layer.rope_theta is not None else {}
    grad_output = _randn(B, T, E, seed=9)
    grads = []
    for run in ("layer", "reference"):
        layer.zero_grad()
        inputs = [x.clone().requires_grad_(), y.clone().requires_grad_()]
        bias.grad = None
        if run == "layer":
            output, _ = _call(layer, path, *inputs, attention_mask=keep, attention_bias=bias, **rope)
        else:
            output, _ = reference(layer, *inputs, keep=keep, bias=bias, **rope)
        (output * grad_output).sum().backward()
        named = {name: p.grad.clone() for name, p in layer.named_parameters()}
        grads.append({**named, "query": inputs[0].grad, "key": inputs[1].grad, "attention_bias": bias.grad.clone()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name].double(), grads[1][name].double(), atol=GRADS_TOL, rtol=0, msg=name)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "truncate": False},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 8, "beta_slow": 2},
    ],
)
def test_rope_frequencies_match_transformers(scaling):
    """Llama 3.1's scaling keeps the short wavelengths, divides the long ones, interpolates between
    (original_max_position_embeddings = 64 puts frequencies of R = 64 in all three bands); YaRN
    ramps from kept to divided between its correction dims (truncated or not)."""
    got = Multi_Head_Attention.rope_frequencies(64, 10000.0, scaling)
    assert got.dtype == torch.float32 and got.shape == (32,)
    torch.testing.assert_close(got.double(), _hf_inv_freq(64, 10000.0, scaling), atol=0, rtol=1e-7)


def test_rope_scaling_changes_the_layer_as_the_frequencies_say():
    scaling = {"rope_type": "linear", "factor": 4.0}
    x, _, positions = _inputs()
    scaled = _layer(rope_theta=100.0, rope_scaling=scaling)
    plain = _layer(rope_theta=100.0)
    # linear scaling by 4 is the same as positions divided by 4: positions 4p against p
    torch.testing.assert_close(
        scaled(x, positions=positions * 4), plain(x, positions=positions), atol=OUTPUT_TOL, rtol=0
    )
    assert not torch.allclose(scaled(x, positions=positions), plain(x, positions=positions), atol=1e-3)


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "linear", "factor": 4.0}, YARN, {**YARN, "attention_factor": 0.5}, {**YARN, "factor": 1.0}],
)
def test_rope_attention_factor_is_transformers(scaling):
    assert Multi_Head_Attention.rope_attention_factor(scaling) == pytest.approx(
        _hf_attention_factor(scaling), rel=1e-15
    )


def test_yarn_attention_factor_changes_the_layer():
    """The same YaRN frequencies with attention factor 1 give other outputs: the factor is applied."""
    x, _, positions = _inputs()
    yarn = _layer(**VARIANTS["rope_yarn_partial"])
    unscaled = _layer(**{**VARIANTS["rope_yarn_partial"], "rope_scaling": {**YARN, "attention_factor": 1.0}})
    assert not torch.allclose(yarn(x, positions=positions), unscaled(x, positions=positions), atol=1e-3)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("rotary", [8, 4], ids=["full", "partial"])
def test_apply_rope_gradient_is_the_turn_by_the_opposite_angle(interleaved, rotary):
    """`apply_rope`'s own backward (the gradient turned back) against finite differences in
    float64, twice differentiable, and cos/sin in float32 whatever the dtype."""
    x = _randn(2, 3, 4, H).double().requires_grad_()  # (B, heads, T, H)
    positions = torch.tensor([[0, 1, 2, 3], [5, 9, 2, 40]])
    inv_freq = Multi_Head_Attention.rope_frequencies(rotary, 100.0)

    def turn(x):
        return Multi_Head_Attention.apply_rope(x, positions, inv_freq, interleaved)

    assert torch.autograd.gradcheck(turn, (x,)) and torch.autograd.gradgradcheck(turn, (x,))
    half = turn(x.detach().half())
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.double(), turn(x.detach().half().double()), atol=FLOAT16_TOL, rtol=0)


def test_rope_positions_default_to_arange_and_broadcast():
    layer = _layer(rope_theta=10000.0)
    x, _, _ = _inputs()
    expected = layer(x, positions=torch.arange(T).expand(B, T))
    torch.testing.assert_close(layer(x), expected, atol=0, rtol=0)
    torch.testing.assert_close(layer(x, positions=torch.arange(T)), expected, atol=0, rtol=0)
    shifted = layer(x, positions=torch.arange(T) + 7)  # relative: only differences of positions count
    torch.testing.assert_close(shifted, expected, atol=OUTPUT_TOL, rtol=0)


def test_cross_attention_with_rope_on_keys_of_the_query_length():
    layer = _layer(rope_theta=10000.0)
    x, keep, positions = _inputs()
    y = _randn(B, T, E, seed=3)
    expected, _ = reference(layer, x, y, keep=keep, positions=positions)
    torch.testing.assert_close(
        layer(x, y, attention_mask=keep, positions=positions).double(), expected, atol=OUTPUT_TOL, rtol=0
    )


def test_sinks_rows_sum_below_one_and_rows_with_no_key_are_zero():
    layer = _layer(sinks=True)
    with torch.no_grad():
        layer.sinks.fill_(1.0)  # as large as the scores of inputs ~ N(0, 1): the sink takes a visible share
    x, keep, _ = _inputs()
    _, weights = layer(x / 2, attention_mask=keep, return_attention=True)
    sums = weights.sum(-1)
    assert (sums[keep.expand(B, N, T, T).any(-1)] < 0.99).all()
    assert (weights[0, :, 2] == 0).all()


@pytest.mark.parametrize("self_attention", [True, False], ids=["fused", "separate"])
def test_clip_qkv_gradient_is_the_clamps(self_attention):
    """One token: the weight is 1, the output clamp(v) @ output.weight^T + output.bias, so the
    gradient of value.bias is (g @ output.weight) where |v| <= c, bounds included (features 0
    and 1 sit exactly on c and -c), and 0 outside; on the fused projection and the separate ones."""
    c = 0.5
    layer = _layer(clip_qkv=c)
    with torch.no_grad():
        layer.value.weight[:2] = 0.0
        layer.value.bias[:2] = torch.tensor([c, -c])
    x, g = _randn(B, 1, E, seed=3) * 2, _randn(B, 1, E, seed=4)
    output = layer(x) if self_attention else layer(x, x.clone(), x.clone())
    (output * g).sum().backward()
    v = x @ layer.value.weight.detach().T + layer.value.bias.detach()  # (B, 1, K*H)
    within = v.abs() <= c
    assert within[..., :2].all() and (~within).float().mean() > 0.3
    expected = (torch.repeat_interleave((g @ layer.output.weight.detach()).view(B, 1, K, N // K, H), 1, 3)
                .sum(3).reshape(B, 1, K * H) * within).sum((0, 1))  # fmt: skip
    torch.testing.assert_close(layer.value.bias.grad, expected, atol=1e-6, rtol=0)
    assert (layer.value.bias.grad[~within.any(1).any(0)] == 0).all()


def test_clip_qkv_clamps_before_qk_norm_and_rope():
    """The clamp sits between the projections and QK-norm: a layer whose projections are already
    within [-c, c] is unchanged by it, while clamping after QK-norm would move it (its outputs are
    of order one, beyond c)."""
    layer = _layer(qk_norm="head", rope_theta=10000.0)
    with torch.no_grad():
        for projection in (layer.query, layer.key, layer.value):
            projection.weight.mul_(0.01)
            projection.bias.mul_(0.01)
    x, _, positions = _inputs()
    clipped = _layer(qk_norm="head", rope_theta=10000.0, clip_qkv=0.5)
    clipped.load_state_dict(layer.state_dict())
    torch.testing.assert_close(clipped(x, positions=positions), layer(x, positions=positions), atol=0, rtol=0)
    with torch.no_grad():
        q = _rms(layer.query(x).view(B, T, N, H), layer.query_norm, layer.qk_norm_eps)  # what QK-norm gives
    assert layer.query(x).abs().max() < 0.5 < q.abs().max()  # a clamp after QK-norm would change the output


def test_softcap_bounds_the_scores():
    """With softcap c the weights are those of scores in (-c, c): the largest ratio of two weights
    of a row is below exp(2c), however large the inputs."""
    layer = _layer(softcap=1.0)
    x = _randn(2, 5, E, seed=4) * 100
    _, weights = layer(x, return_attention=True)
    ratio = weights.amax(-1) / weights.amin(-1)
    assert (ratio < math.exp(2.0) * (1 + 1e-5)).all()


SOFTCAP_CASES = [case for case in REPORT_CASES if "softcap" in dict(case.variants)]


def _float64_run(case, data):
    """Output and gradients of sum(output * grad_output) of a float64 layer without returned
    weights (the soft-capped blocks), as NumPy arrays named as the NumPy layer's `backward` names them."""
    layer = set_path(MultiHeadAttention(**case.config, dtype=torch.float64), case)
    layer.import_weights(data["weights"])
    args = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in inputs(data)]
    kwargs = {name: torch.tensor(x) for name, x in call_inputs(data).items()}
    if "attention_bias" in kwargs:
        kwargs["attention_bias"] = kwargs["attention_bias"].double().requires_grad_()
    query, kv = by_name(args)
    output = layer(*query, **kv, **kwargs, causal=case.causal)
    (output * torch.tensor(data["grad_output"], dtype=torch.float64)).sum().backward()
    grads = {name: x.grad.numpy() for name, x in zip(INPUTS, args, strict=False)}
    if "attention_bias" in kwargs:
        grads["attention_bias"] = kwargs["attention_bias"].grad.numpy()
    for name in layer.weight_shapes():
        tensor, transposed = Multi_Head_Attention._parameter(layer, name)
        grads[name] = (tensor.grad.T if transposed else tensor.grad).numpy()
    return output.detach().numpy(), grads


def _softcap_path(monkeypatch, path):
    """Sends soft-capping without returned weights down `path` at a tiny size and counts its calls:
    "tiles" (`_SoftcappedTiles`, `torch_runner.SOFTCAP_TILES`: tiles of 2 query rows and 3 keys forward, 3 and 2
    causal and backward: several a row, the last ones partial) or "blocks" (`_Softcapped`, which runs where no one shift fits the cap: each query
    row a block of its own)."""
    if path == "blocks":
        monkeypatch.setattr(Multi_Head_Attention, "_cap_shift", lambda softcap, dtype: None)
        monkeypatch.setattr(Multi_Head_Attention, "_SOFTCAP_BLOCK_SCORES", 1)
        return CountingApply(monkeypatch, Multi_Head_Attention._Softcapped)
    monkeypatch.setattr(Multi_Head_Attention, "_SOFTCAP_TILES", torch_runner.SOFTCAP_TILES)
    return CountingApply(monkeypatch, Multi_Head_Attention._SoftcappedTiles)


@pytest.mark.parametrize("path", ["tiles", "blocks"])
@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=lambda case: case.name)
def test_softcapped_paths_match_numpy_in_float64(case, path, monkeypatch):
    """Soft-capping without returned weights runs in tiles or blocks with a backward of their own
    (`_SoftcappedTiles`, `_Softcapped`), here at sizes where the keys each block or tile skips
    (causal, window), the tiles' own masks and every mask's slicing are checked, forward and
    backward, against the NumPy layer's explicit backward in float64."""
    ran = _softcap_path(monkeypatch, path)
    data = make_data(case)
    output, grads = _float64_run(case, data)
    expected = numpy_runner.run(case, data)
    tol = FLOAT64_TOLERANCES["rope" if "rope_theta" in dict(case.variants) else "plain"]
    assert ran.calls == 1 or (case.segments != "none" and ran.calls > 1)  # packed: a call per row's blocks
    np.testing.assert_allclose(output, expected.output, atol=tol["output"], rtol=0)
    assert set(grads) == set(expected.grads)
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, expected.grads[name], atol=tol["grads"], rtol=0, err_msg=name)


class CountingApply:
    """Counts the calls of an autograd.Function's `apply`, which still runs."""

    def __init__(self, monkeypatch, function):
        self.calls, apply = 0, function.apply

        def counted(*args):
            self.calls += 1
            return apply(*args)

        monkeypatch.setattr(function, "apply", counted)


@pytest.mark.parametrize("path", ["tiles", "blocks"])
@pytest.mark.parametrize("causal", [False, True])
def test_softcapped_paths_keep_no_scores_for_the_backward(causal, path, monkeypatch):
    """The soft-capped training step saves no (B, N, T, S) tensor: its backward makes each tile's
    or block's scores again, so memory stays linear in T and S (the explicit softmax keeps several)."""
    ran = _softcap_path(monkeypatch, path)
    layer, x = _layer(softcap=2.0, sinks=True), _randn(2, 16, E, seed=30).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        output = layer(x, causal=causal)
    assert ran.calls == 1
    assert max(saved) < 2 * N * 16 * 16
    output.sum().backward()
    reference = _layer(softcap=2.0, sinks=True)
    reference.load_state_dict(layer.state_dict())
    x_ref = x.detach().clone().requires_grad_()
    expected, _ = reference(x_ref, causal=causal, return_attention=True)
    expected.sum().backward()
    torch.testing.assert_close(output, expected, atol=OUTPUT_TOL, rtol=0)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=GRADS_TOL, rtol=0)


def _softcapped(q, k, v, keep, bias, causal, window, chunk, scale, softcap, sinks):
    """The layer's soft-capped path (tiles or blocks) on split heads: the (B, N, T, Hv) context."""
    return Multi_Head_Attention._softcapped_attention(q, k, v, keep, bias, causal, window, chunk, scale, softcap, sinks)


def _explicit(q, k, v, keep, bias, causal, window, chunk, scale, softcap, sinks):
    """`dot_product_attention`'s explicit softmax with the same arguments: the (B, N, T, Hv) context."""
    options = {"scale": scale, "softcap": softcap, "window": window, "attention_chunk_size": chunk, "sinks": sinks}
    return dot_product_attention(q, k, v, keep, bias, causal, **options)[0]


SOFTCAP_TILE_CALLS = {
    "plain": {},
    "causal window sinks": {"causal": True, "window": 300, "sinks": True},
    "two-sided window, mask, bias": {"window": (200, 90), "keep": True, "bias": True},
    "chunks, bias, sinks": {"causal": True, "chunk": 100, "bias": True, "sinks": True},
}


@pytest.mark.parametrize("call", SOFTCAP_TILE_CALLS.values(), ids=SOFTCAP_TILE_CALLS)
def test_softcapped_tiles_at_their_size_match_the_explicit_softmax(call, monkeypatch):
    """At the tiles' own sizes (512 query rows by 512 keys forward, 256 by 256 backward), T = 300
    and S = 600 make several tiles a row with partial last ones, whole tiles beside masked ones;
    in float64 the tiles' output and gradients equal the explicit softmax's."""
    ran = CountingApply(monkeypatch, Multi_Head_Attention._SoftcappedTiles)
    g = torch.Generator().manual_seed(40)
    q, k, v = (torch.randn(1, N, length, H, generator=g, dtype=torch.float64) for length in (300, 600, 600))
    keep = torch.rand(1, 1, 300, 600, generator=g) > 0.2 if call.get("keep") else None
    bias = torch.randn(1, N, 300, 600, generator=g, dtype=torch.float64) if call.get("bias") else None
    sinks = torch.randn(N, generator=g, dtype=torch.float64) if call.get("sinks") else None
    masks = (call.get("causal", False), call.get("window"), call.get("chunk"))
    results = []
    for attend in (_softcapped, _explicit):
        inputs = [None if x is None else x.clone().requires_grad_() for x in (q, k, v, bias, sinks)]
        output = attend(*inputs[:3], keep, inputs[3], *masks, 0.4, 3.0, inputs[4])
        output.backward(torch.ones_like(output))
        results.append([output] + [x.grad for x in inputs if x is not None])
    assert ran.calls == 1
    for tiled, explicit in zip(*results, strict=True):
        torch.testing.assert_close(tiled, explicit, atol=FLOAT64_TOLERANCES["plain"]["grads"], rtol=0)


@pytest.mark.parametrize("softcap, dtype, path", [
    (50.0, torch.float32, "tiles"), (62.0, torch.float32, "tiles"), (63.0, torch.float32, "blocks"),
    (500.0, torch.float64, "tiles"), (600.0, torch.float64, "blocks"),
])  # fmt: skip
def test_softcap_takes_the_tiles_where_one_shift_fits_the_cap(softcap, dtype, path, monkeypatch):
    """The tiles exponentiate capped scores less one shift (`_cap_shift`), which must keep every
    row's largest term a normal number and the sums finite: up to softcap 62 in float32 and 528
    in float64; above it the blocks' exact softmax runs. At the edge, rows whose every score sits
    at -softcap still give the explicit softmax's output and gradients."""
    ran = {
        name: CountingApply(monkeypatch, getattr(Multi_Head_Attention, name))
        for name in ("_SoftcappedTiles", "_Softcapped")
    }
    g = torch.Generator().manual_seed(41)
    q = torch.randn(2, N, 5, H, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(2, N, 7, H, generator=g, dtype=dtype).abs()
    with torch.no_grad():
        q[0] = -1e4  # batch element 0: every score far below -softcap
    outputs = [
        attend(q, k, k, None, None, False, None, None, 0.5, softcap, None) for attend in (_softcapped, _explicit)
    ]
    grads = [torch.autograd.grad(output.sum(), q)[0] for output in outputs]
    assert ran["_SoftcappedTiles" if path == "tiles" else "_Softcapped"].calls == 1
    assert sum(counter.calls for counter in ran.values()) == 1
    torch.testing.assert_close(outputs[0], outputs[1], atol=OUTPUT_TOL, rtol=0)
    torch.testing.assert_close(grads[0], grads[1], atol=GRADS_TOL, rtol=0)


@pytest.mark.parametrize("softcap", [50.0, 62.0])
def test_regression_softcapped_tiles_keep_tanh_precise_near_zero(softcap, monkeypatch):
    """Regression: the tiles' tanh taken as 2 * sigmoid(2x) - 1 held tanh only to an absolute 6e-8
    near 0, which moved every capped score by about softcap * 1.2e-7: float32 rows of two keys
    with moderate scores came up to 3e-5 from the float64 softmax, over the output tolerance.
    Through expm1 (`_tile_expm1`) the error is the tanh path's, 1.3e-6 and 2.6e-6 here (the sigmoid: 1.7e-5 and 2.5e-5)."""
    ran = CountingApply(monkeypatch, Multi_Head_Attention._SoftcappedTiles)
    g = torch.Generator().manual_seed(43)
    q, k = (torch.randn(8, N, length, 64, generator=g) * 0.3 for length in (16, 2))
    v = torch.randn(8, N, 2, 64, generator=g) * 2
    output = _softcapped(q, k, v, None, None, False, None, None, 0.125, softcap, None)
    scores = q.double() @ k.double().transpose(-1, -2) * 0.125
    expected = torch.softmax(softcap * torch.tanh(scores / softcap), dim=-1) @ v.double()
    assert ran.calls == 1
    torch.testing.assert_close(output.double(), expected, atol=OUTPUT_TOL, rtol=0)


def test_softcapped_tiles_centre_a_large_bias_beside_sinks():
    """Regression: the tiles' one shift bounds the capped scores only with each row's bias
    centred; sinks keep a softmax from being shift-invariant, so the centring moves the sink
    logits with it (and its rows' largest values carry no gradient). A bias of 1e4 beside sinks
    gives in float32, where exp(1e4) is inf, the explicit softmax's output and gradients in
    float64 (the explicit softmax in float32 rounds 1e4 + score to 1e-3)."""
    g = torch.Generator().manual_seed(42)
    inputs = [torch.randn(2, N, 6, H, generator=g) for _ in range(3)]
    inputs += [1e4 + torch.randn(2, 1, 6, 6, generator=g), torch.randn(N, generator=g)]  # bias, sinks
    results = []
    for attend, dtype in ((_softcapped, torch.float32), (_explicit, torch.float64)):
        q, k, v, bias, sinks = (x.to(dtype).requires_grad_() for x in inputs)
        output = attend(q, k, v, None, bias, True, None, None, 0.5, 5.0, sinks)
        results.append([output, *torch.autograd.grad(output.square().sum(), (q, k, v, bias, sinks))])
    for tiled, explicit in zip(*results, strict=True):
        assert torch.isfinite(tiled).all()
        torch.testing.assert_close(tiled.double(), explicit, atol=GRADS_TOL, rtol=0)


@pytest.mark.parametrize("window", [1, 2, 5])
def test_window_band(window):
    """Query t keeps key s iff t + (S - T) - W < s (with causal: the W most recent keys, itself included)."""
    layer = _layer(window=window)
    x, y = _randn(2, 4, E, seed=5), _randn(2, 6, E, seed=6)
    _, weights = layer(x, y, causal=True, return_attention=True)
    t, s = torch.arange(4)[:, None], torch.arange(6)[None, :]
    band = (s <= t + 2) & (s > t + 2 - window)
    assert torch.equal(weights[0, 0] > 0, band)


@pytest.mark.parametrize("variant", ["softcap", "sinks", "everything"])
@pytest.mark.parametrize("path", ["explicit", "inference"])
def test_fully_masked_rows_stay_finite_with_sinks_and_softcap(variant, path):
    layer = _layer(**VARIANTS[variant])
    x = (_randn(2, 4, E, seed=10) * 30).requires_grad_(path != "inference")
    keep = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    keep[0, 0, 1] = False
    keep[1] = False
    keep[1, 0, 0, 0] = True  # not all False: that is refused as nn.MultiheadAttention's habit
    output, weights = _call(layer, path, x, attention_mask=keep)
    assert torch.isfinite(output).all() and torch.isfinite(weights).all()
    assert (weights[0, :, 1] == 0).all() and (weights[1, :, 1:] == 0).all()
    torch.testing.assert_close(output[0, 1], _output_bias(layer), atol=0, rtol=0)
    if path != "inference":
        output.square().sum().backward()
        assert torch.isfinite(x.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


# ---------------------------------------------------------------------------------------------
# Call arguments: key_mask, query_mask, attention_bias, positions.


@pytest.mark.parametrize("path", ["sdpa", "explicit", "inference"])
def test_key_and_query_masks_are_the_keep_they_describe(path):
    layer = _layer(**VARIANTS["everything"])
    x, y = _randn(B, T, E, seed=11), _randn(B, T, E, seed=12)
    key_mask = torch.rand(B, T, generator=torch.Generator().manual_seed(13)) < 0.7
    key_mask[:, 0] = True
    query_mask = torch.ones(B, T, dtype=torch.bool)
    query_mask[1, 3:] = False
    keep = key_mask[:, None, None, :] & query_mask[:, None, :, None]
    output, weights = _call(layer, path, x, y, key_mask=key_mask, query_mask=query_mask, causal=True)
    expected, expected_weights = _call(layer, path, x, y, attention_mask=keep, causal=True)
    torch.testing.assert_close(output, expected, atol=0, rtol=0)
    torch.testing.assert_close(output[1, 3:], _output_bias(layer).expand(3, E), atol=0, rtol=0)
    if weights is not None:
        torch.testing.assert_close(weights, expected_weights, atol=0, rtol=0)


def test_only_a_key_mask_as_passed_is_refused_when_all_false():
    """In self-attention key_mask defaults to query_mask; a query_mask that is all False (no real
    query) is not nn.MultiheadAttention's habit: every output row is the output bias."""
    layer = _layer()
    output = layer(_randn(B, T, E, seed=42), query_mask=torch.zeros(B, T, dtype=torch.bool))
    torch.testing.assert_close(output, layer.output.bias.detach().expand(B, T, E), atol=0, rtol=0)


def test_key_mask_defaults_to_query_mask_in_self_attention():
    layer = _layer()
    x = _randn(B, T, E, seed=14)
    query_mask = torch.ones(B, T, dtype=torch.bool)
    query_mask[0, 4:] = False  # right padding
    expected = layer(x, attention_mask=query_mask[:, None, None, :] & query_mask[:, None, :, None])
    torch.testing.assert_close(layer(x, query_mask=query_mask), expected, atol=0, rtol=0)


@pytest.mark.parametrize("path", ["sdpa", "explicit", "inference"])
def test_attention_bias_is_added_with_the_mask_and_minus_inf_removes(path):
    layer = _layer()
    x, keep, _ = _inputs()
    bias = _randn(B, 1, T, T, seed=15)
    bias[1, 0, :, 3] = -torch.inf  # key 3 of batch 1 removed by the bias
    float_mask = torch.where(keep, _randn(1, T, T, seed=16), -torch.inf)  # (B, T, S) float mask
    output, weights = _call(layer, path, x, attention_mask=float_mask, attention_bias=bias)
    allowed = keep & (bias > -torch.inf)
    expected, expected_weights = reference(
        layer, x, keep=allowed, bias=torch.where(allowed, bias + torch.where(keep, float_mask, 0), 0)
    )
    torch.testing.assert_close(output.double(), expected, atol=OUTPUT_TOL, rtol=0)
    if weights is not None:
        torch.testing.assert_close(weights.double(), expected_weights, atol=WEIGHTS_TOL, rtol=0)
        assert (weights[1, ..., 3] == 0).all()


@pytest.mark.parametrize("mixed", [False, True])
def test_sdpa_gives_attention_bias_a_gradient_equal_to_the_explicit_path(mixed):
    """The SDPA path passes the bias as its additive mask; SDPA differentiates it (on the CPU too)."""
    layer = _layer()
    x, keep, _ = _inputs()
    mask = keep if mixed else None
    grads = []
    for return_attention in (False, True):
        bias = _randn(1, N, T, T, seed=17).requires_grad_()
        result = layer(x, attention_mask=mask, attention_bias=bias, return_attention=return_attention)
        (result[0] if return_attention else result).square().sum().backward()
        grads.append(bias.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=GRADS_TOL, rtol=0)


def test_alibi_bias_is_blooms():
    """Against Bloom's `build_alibi_tensor` (transformers), written out here: N = 8 and N = 6."""
    for heads in (8, 6, 1):
        closest = 2 ** math.floor(math.log2(heads))
        base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
        slopes = [base**p for p in range(1, closest + 1)]
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base**p for p in range(1, 1 + 2 * min(closest, heads - closest), 2)]
        key_mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
        positions = key_mask.cumsum(-1) - 1  # Bloom's positions, -1 at padding
        expected = torch.tensor(slopes)[None, :, None, None] * (positions * key_mask)[:, None, None, :]
        got = alibi_bias(heads, positions * key_mask)
        assert got.shape == (2, heads, 1, 5) and got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=1e-7, rtol=0)
    assert alibi_bias(4, torch.arange(3)).shape == (1, 4, 1, 3)


def test_alibi_equals_press_et_al_linear_bias():
    layer = _layer()
    x = _randn(2, T, E, seed=18)
    slopes = alibi_bias(N, torch.ones(1, dtype=torch.long))[0, :, 0, 0]  # (N,)
    distance = torch.arange(T)[:, None] - torch.arange(T)[None, :]  # t - s
    press = -slopes[:, None, None] * distance  # (N, T, S)
    press = press[None]  # (1, N, T, S)
    expected = layer(x, attention_bias=press, causal=True)
    torch.testing.assert_close(
        layer(x, attention_bias=alibi_bias(N, torch.arange(T)), causal=True), expected, atol=OUTPUT_TOL, rtol=0
    )


# ---------------------------------------------------------------------------------------------
# Code paths: SDPA, explicit and in-place blocks equal for every variant; public function.


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_paths_agree_for_every_variant(variant):
    layer = _layer(**VARIANTS[variant])
    x, keep, positions = _inputs(b=5)
    y = _randn(5, T, E, seed=19)
    bias = _randn(5, 1, T, T, seed=20)
    kwargs = {"attention_mask": keep, "attention_bias": bias, "causal": True, "key_mask": keep[:, 0, 0]}
    kwargs |= {"positions": positions} if layer.rope_theta is not None else {}
    results = {path: _call(layer, path, x, y, **kwargs) for path in ("sdpa", "explicit", "inference")}
    for path in ("explicit", "inference"):
        torch.testing.assert_close(results[path][0], results["sdpa"][0], atol=OUTPUT_TOL, rtol=0)
    torch.testing.assert_close(results["inference"][1], results["explicit"][1], atol=WEIGHTS_TOL, rtol=0)


def test_dot_product_attention_takes_the_variants():
    q, k, v = _randn(2, 4, 5, 8, seed=21), _randn(2, 2, 7, 8, seed=22), _randn(2, 2, 7, 8, seed=23)
    sinks = _randn(4, seed=24)
    context, weights = dot_product_attention(
        q, k, v, causal=True, scale=0.3, softcap=2.0, window=3, sinks=sinks, return_attention=True
    )
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = 2.0 * torch.tanh(q @ kk.transpose(-1, -2) * 0.3 / 2.0)
    t, s = torch.arange(5)[:, None], torch.arange(7)[None, :]
    scores = scores.masked_fill(~((s <= t + 2) & (s > t + 2 - 3)), -torch.inf)
    combined = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(2, -1, 5, 1)], dim=-1)
    expected = combined.softmax(-1)[..., :-1]
    torch.testing.assert_close(weights, expected, atol=WEIGHTS_TOL, rtol=0)
    torch.testing.assert_close(context, expected @ vv, atol=OUTPUT_TOL, rtol=0)
    no_weights, none = dot_product_attention(q, k, v, causal=True, scale=0.3, softcap=2.0, window=3, sinks=sinks)
    assert none is None
    torch.testing.assert_close(no_weights, context, atol=0, rtol=0)  # softcap and sinks: always explicit


@pytest.mark.parametrize("variant", ["everything", "gate_no_bias_rope"])
def test_compile_fullgraph_with_every_variant(variant):
    layer = _layer(**VARIANTS[variant]).train()
    x, keep, positions = _inputs()
    bias = _randn(1, N, T, T, seed=25).requires_grad_()

    def step(x, keep, bias, positions):
        return layer(x, key_mask=keep[:, 0, 0], attention_bias=bias, positions=positions, causal=True)

    expected = step(x, keep, bias, positions)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(x, keep, bias, positions)
    torch.testing.assert_close(got, expected, atol=OUTPUT_TOL, rtol=0)
    got.sum().backward()
    assert torch.isfinite(bias.grad).all() and bias.grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


def _assert_exports(layer, x, key_mask, positions):
    """torch.export of a causal call with `key_mask` and `positions` computes what the layer does
    (within the float32 tolerance: an eager call with `softcap` runs its blocks, the export the
    explicit softmax; exactly otherwise)."""

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = layer

        def forward(self, x, key_mask, positions):
            return self.attention(x, key_mask=key_mask, positions=positions, causal=True)

    program = torch.export.export(Wrapped(), (x, key_mask, positions))
    expected = layer(x, key_mask=key_mask, positions=positions, causal=True)
    tol = 0 if layer.softcap is None else OUTPUT_TOL
    torch.testing.assert_close(program.module()(x, key_mask, positions), expected, atol=tol, rtol=0)


@pytest.mark.parametrize("variant", ["everything", "gate_no_bias_rope"])
def test_torch_export_with_every_variant(variant):
    x, keep, positions = _inputs()
    _assert_exports(_layer(**VARIANTS[variant]), x, keep[:, 0, 0], positions)


# ---------------------------------------------------------------------------------------------
# KV cache with the variants.


def _decode(layer, x, chunks, key_mask=None, length=10):
    cache = layer.init_cache(x.shape[0], length)
    outputs, start = [], 0
    with torch.no_grad():
        for size in chunks:
            chunk = slice(start, start + size)
            mask = None if key_mask is None else key_mask[:, chunk]
            output, cache = layer(x[:, chunk], key_mask=mask, causal=True, cache=cache)
            outputs.append(output)
            start += size
    return torch.cat(outputs, dim=1), cache


@pytest.mark.parametrize("chunks", [(7,), (4, 1, 1, 1), (1,) * 7])
def test_decoding_with_every_variant_equals_the_full_pass(chunks):
    """Window in the cache's keep, RoPE at index + t, key_mask written into keep."""
    layer = _layer(**VARIANTS["everything"])
    x = _randn(2, 7, E, seed=26)
    key_mask = torch.ones(2, 7, dtype=torch.bool)
    key_mask[1, :2] = False  # left padding
    key_mask[0, 4] = False
    output, cache = _decode(layer, x, chunks, key_mask)
    expected = layer(x, key_mask=key_mask, causal=True)
    torch.testing.assert_close(output, expected, atol=OUTPUT_TOL, rtol=0)
    assert torch.equal(cache.keep[:, :7], key_mask) and cache.keep[:, 7:].all()
    assert isinstance(cache, KVCache) and int(cache.index) == 7


@pytest.mark.parametrize("variant", ["everything", "gate_no_bias_rope"])
def test_decoding_compiles_fullgraph_with_every_variant(variant):
    layer = _layer(**VARIANTS[variant])
    x = _randn(2, 5, E, seed=27)
    key_mask = torch.ones(2, 5, dtype=torch.bool)
    key_mask[1, 0] = False

    def step(x, key_mask, cache):
        return layer(x, key_mask=key_mask, causal=True, cache=cache)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    cache = layer.init_cache(2, 8)
    outputs = []
    with torch.no_grad():
        for t in range(5):
            output, cache = compiled(x[:, t : t + 1], key_mask[:, t : t + 1], cache)
            outputs.append(output)
        expected = layer(x, key_mask=key_mask, causal=True)
    torch.testing.assert_close(torch.cat(outputs, 1), expected, atol=OUTPUT_TOL, rtol=0)


ROLLING_CHUNKS = (2, 1, 1, 2, 1, 1, 1, 2, 1)  # 12 tokens through L = 5 slots: the cache wraps twice


def test_rolling_decoding_compiled_equals_eager_and_the_full_pass_one_graph_per_t():
    """A window W = 4 and L = W + 1 slots (room for the T = 2 chunks that wrap): decoding 12
    tokens compiled equals eager and the full pass with the window, and the index being a tensor
    keeps it to one graph per T however often the cache wraps."""
    layer = _layer(**VARIANTS["everything"])
    x = _randn(2, sum(ROLLING_CHUNKS), E, seed=42)
    key_mask = torch.ones(2, x.shape[1], dtype=torch.bool)
    key_mask[1, :2] = False  # left padding, overwritten by the second lap
    key_mask[0, 7] = False  # padding written past the first lap
    counter = CompileCounterWithBackend("aot_eager")  # counts the graphs
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=False)
    with torch.no_grad():
        outputs = {}
        for name, call in (("eager", layer), ("compiled", compiled)):
            cache, steps, start = layer.init_cache(2, 5), [], 0
            for size in ROLLING_CHUNKS:
                chunk = slice(start, start + size)
                output, cache = call(x[:, chunk], key_mask=key_mask[:, chunk], causal=True, cache=cache)
                steps.append(output)
                start += size
            outputs[name] = torch.cat(steps, 1)
        expected = layer(x, key_mask=key_mask, causal=True)
    assert counter.frame_count == 2  # T = 2 and T = 1
    torch.testing.assert_close(outputs["compiled"], outputs["eager"], atol=OUTPUT_TOL, rtol=0)
    torch.testing.assert_close(outputs["eager"], expected, atol=OUTPUT_TOL, rtol=0)
    assert torch.equal(cache.keep, key_mask[:, [10, 11, 7, 8, 9]])  # slot s: the last p with p mod 5 == s


NO_ROOM = {
    "full_without_window": ({}, r"^`cache` is full: index \+ T must be <= L .*Received: index=3, T=3, L=5$"),
    "too_short_with_window": ({"window": 4}, r"^`cache` rolls with `window`: .*Received: window=4, T=3, L=5$"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(NO_ROOM))
def test_a_call_without_room_raises_eagerly_and_gives_nan_under_compile(name):
    """index 3 + T 3 > L 5: without a window the cache is full; with W = 4 it would wrap but
    needs L >= W + T - 1 = 6. A graph cannot raise, so the compiled call's output is NaN (and
    its write stays inside the cache)."""
    config, pattern = NO_ROOM[name]
    layer = _layer(**config)
    x = _randn(2, 3, E, seed=43)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=False)
    with torch.no_grad():
        _, cache = layer(x, causal=True, cache=layer.init_cache(2, 5))
        with pytest.raises(ValueError, match=pattern):
            layer(x, causal=True, cache=cache)
        fits, _ = compiled(x[:, :2], causal=True, cache=layer.init_cache(2, 5))
        output, _ = compiled(x, causal=True, cache=cache)
    assert torch.isfinite(fits).all() and torch.isnan(output).all()


def test_regression_decoding_wrote_into_the_keep_passed_to_init_cache():
    """The cache's keep was the caller's tensor itself, so writing a key_mask (or a slot's new
    token past the first lap) changed the caller's mask."""
    layer = _layer(window=3)
    keep = torch.tensor([[False, True, True], [True, True, True]])
    with torch.no_grad():
        cache = layer.init_cache(2, 3, keep=keep)
        for t in range(4):
            _, cache = layer(_randn(2, 1, E, seed=t), key_mask=torch.tensor([[True], [False]]), cache=cache)
    assert torch.equal(keep, torch.tensor([[False, True, True], [True, True, True]]))
    assert torch.equal(cache.keep, torch.tensor([[True, True, True], [False, False, False]]))


# ---------------------------------------------------------------------------------------------
# The fused q/k/v projection of self-attention: only where it computes what the modules would.


class LoRA(nn.Module):
    """A LoRA adapter: the frozen Linear plus a low-rank delta."""

    def __init__(self, base, rank=2):
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.up.weight)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


class Double(nn.Module):
    def forward(self, weight):
        return weight * 2


def _hooked(layer):
    layer.key.register_forward_hook(lambda module, args, output: output * 3)
    return layer


def _parametrized(layer):
    nn.utils.parametrize.register_parametrization(layer.value, "weight", Double())
    return layer


def _lora(layer):
    layer.query = LoRA(layer.query)
    return layer


def _quantized(layer):
    return torch.ao.quantization.quantize_dynamic(layer, {nn.Linear}, dtype=torch.qint8)


@pytest.mark.parametrize("change", [_hooked, _parametrized, _lora, _quantized], ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("return_attention", [False, True])
def test_changed_projections_act_in_self_attention_as_in_cross_attention(change, return_attention, monkeypatch):
    """Regression (the issue): self-attention concatenated the weights of `query`, `key` and
    `value` and skipped a hook, a parametrization, a LoRA wrapper or a quantized module. (A
    parametrized weight read through `.weight` happens to be right when concatenated, but only
    the modules themselves know what they compute: they are called.)"""
    layer = _layer(**VARIANTS["bias_qkv"])
    x = _randn(B, T, E, seed=28)
    with torch.no_grad():
        plain = layer(x, return_attention=return_attention)
        changed = change(layer)
        monkeypatch.setattr(MultiHeadAttention, "_project_fused", None)  # never reached with a changed projection
        self_attention = changed(x, return_attention=return_attention)
        cross_attention = changed(x, x.clone(), x.clone(), return_attention=return_attention)
    first = (lambda r: r[0]) if return_attention else (lambda r: r)
    torch.testing.assert_close(self_attention, cross_attention, atol=0, rtol=0)
    assert not torch.allclose(first(self_attention), first(plain), atol=1e-3)  # the change does change the result


@pytest.mark.parametrize("cached", [False, True], ids=["full_pass", "decode_step"])
def test_global_hooks_switch_off_the_fused_projection(cached):
    """A module hook registered for every module sees all four projections, in a full pass and
    in a decode step (where a plain projection is otherwise computed with F.linear)."""
    layer = _layer()
    x = _randn(B, T, E, seed=29)
    seen = []
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, output: seen.append(module))
    try:
        with torch.no_grad():
            layer(x, cache=layer.init_cache(B, T) if cached else None)
    finally:
        handle.remove()
    assert {id(layer.query), id(layer.key), id(layer.value), id(layer.output)} <= {id(m) for m in seen}


@pytest.mark.parametrize("cached", [False, True], ids=["full_pass", "decode_step"])
def test_hooked_or_wrapped_output_projection_is_called(cached):
    """Regression guard for computing plain projections with F.linear: a hook on `output` and a
    LoRA wrapper around it still act, with and without a cache."""
    x = _randn(B, T, E, seed=31)

    def run(layer):
        result = layer(x, cache=layer.init_cache(B, T) if cached else None)
        return result[0] if cached else result

    with torch.no_grad():
        plain = run(_layer())
        hooked = _layer()
        hooked.output.register_forward_hook(lambda module, args, output: output * 3)
        torch.testing.assert_close(run(hooked), plain * 3, atol=OUTPUT_TOL, rtol=0)
        wrapped, merged = _layer(), []
        wrapped.output = LoRA(wrapped.output)
        wrapped.output.base.register_forward_hook(lambda module, args, output: merged.append(args[0]))
        result = run(wrapped)
        delta = wrapped.output.up(wrapped.output.down(merged[0]))  # (B, T, E)
        assert delta.abs().max() > 1e-2
        torch.testing.assert_close(result, plain + delta, atol=OUTPUT_TOL, rtol=0)


@pytest.mark.parametrize("change", [_lora, _quantized], ids=lambda f: f.__name__[1:])
def test_decoding_with_changed_projections_equals_their_full_pass(change):
    """Regression: `init_cache` and the compute dtype read `output.weight`, which a LoRA wrapper
    does not have (AttributeError) and a quantized module holds as a method."""
    layer = change(_layer())
    if change is _lora:
        layer.output = LoRA(layer.output)
    x = _randn(B, T, E, seed=32)
    with torch.no_grad():
        cache = layer.init_cache(B, T)
        decoded, cache = layer(x, causal=True, cache=cache)
        full = layer(x, causal=True)
    assert cache.key.dtype == torch.float32 and int(cache.index) == T
    torch.testing.assert_close(decoded, full, atol=OUTPUT_TOL, rtol=0)


def test_plain_layer_still_fuses(monkeypatch):
    calls = []
    real = MultiHeadAttention._project_fused
    monkeypatch.setattr(MultiHeadAttention, "_project_fused", lambda self, x: calls.append(1) or real(self, x))
    _layer(**VARIANTS["bias_output_only"])(_randn(B, T, E, seed=30))
    assert calls == [1]


# ---------------------------------------------------------------------------------------------
# Weights, repr, interop.


@pytest.mark.parametrize("variant", ["everything", "qk_norm_all", "bias_output_only"])
def test_portable_weights_and_state_dict_hold_the_variants(variant):
    layer = _layer(**VARIANTS[variant])
    weights = layer.export_weights()
    assert list(weights) == list(layer.weight_shapes())
    assert {name: w.shape for name, w in weights.items()} == layer.weight_shapes()
    other = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, **VARIANTS[variant])
    other.import_weights(weights)
    x, _, _ = _inputs()
    torch.testing.assert_close(other(x), layer(x), atol=0, rtol=0)
    names = set(layer.state_dict())
    for name in ("query_norm", "key_norm", "sinks"):
        assert (name in names) == (name in weights)


def test_weight_shapes_order_and_names():
    layer = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, bias=("key", "query"), qk_norm="all", sinks=True)
    assert layer.bias == ("query", "key")
    assert layer.weight_shapes() == {
        "query_kernel": (E, N * H), "query_bias": (N * H,), "key_kernel": (E, K * H), "key_bias": (K * H,),
        "value_kernel": (E, K * H), "output_kernel": (N * H, E), "query_norm": (N * H,), "key_norm": (K * H,),
        "sinks": (N,),
    }  # fmt: skip
    assert layer.value.bias is None and layer.output.bias is None
    assert layer.sinks.detach().eq(0).all() and layer.query_norm.detach().eq(1).all()


def test_repr_names_the_variants():
    text = _layer(**VARIANTS["everything"]).extra_repr()
    for part in (
        "bias=['query', 'key', 'value']", "softcap=3.0", "window=4", "rope_theta=500.0", "rope_fraction=0.75",
        "qk_norm='head'", "sinks=True",
    ):  # fmt: skip
        assert part in text
    assert text.count("bias=") == 1
    assert "bias=True" in _layer().extra_repr() and "softcap" not in _layer().extra_repr()


def test_unbatched_inputs_with_the_new_call_arguments():
    layer = _layer(**VARIANTS["everything"])
    x, y = _randn(T, E, seed=38), _randn(T, E, seed=39)
    key_mask, positions = torch.tensor([True, True, False, True, True, True]), torch.arange(T) + 3
    bias = _randn(1, N, T, T, seed=40)  # masks keep their batched shapes, with B = 1
    output, weights = layer(x, y, key_mask=key_mask, attention_bias=bias, positions=positions, return_attention=True)
    expected = layer(x[None], y[None], key_mask=key_mask[None], attention_bias=bias, positions=positions,
                     return_attention=True)  # fmt: skip
    assert output.shape == (T, E) and weights.shape == (N, T, T)
    torch.testing.assert_close(output, expected[0][0], atol=0, rtol=0)
    torch.testing.assert_close(weights, expected[1][0], atol=0, rtol=0)


def test_torch_export_of_a_decoding_step_with_every_variant():
    layer = _layer(**VARIANTS["everything"])
    x = _randn(2, 3, E, seed=41)
    key_mask = torch.tensor([[False, True, True], [True, True, True]])

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = layer

        def forward(self, x, key_mask, key, value, keep, index):
            output, cache = self.attention(x, key_mask=key_mask, causal=True, cache=KVCache(key, value, keep, index))
            return output, cache.index

    with torch.no_grad():
        program = torch.export.export(Step(), (x, key_mask, *layer.init_cache(2, 8)[:4]))
        cache = layer.init_cache(2, 8)
        output, index = program.module()(x, key_mask, *cache[:4])
        expected = layer(x, key_mask=key_mask, causal=True)
    torch.testing.assert_close(output, expected, atol=OUTPUT_TOL, rtol=0)
    assert int(index) == 3 and torch.equal(cache.keep[:, :3], key_mask)  # written in place


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"bias": ("query", "key", "value")}, r"bias=\['query', 'key', 'value'\]"),
        ({"rope_theta": 10000.0}, r"rope_theta=10000\.0"),
        ({"qk_norm": "head"}, r"qk_norm='head'"),
        ({"sinks": True}, r"sinks=True"),
        ({"softcap": 30.0, "window": 8}, r"softcap=30\.0, window=8"),
        ({"scale": 1.0}, r"scale=1\.0"),
        ({"clip_qkv": 0.5}, r"clip_qkv=0\.5"),
        ({"gate": True}, r"gate=True"),
        ({"query_scaling": {"type": "temperature", "beta": 0.1, "floor": 2}}, r"query_scaling=\{'type': 'temperature'"),
        ({"keys_as_values": True}, r"keys_as_values=True"),
    ],
)
def test_to_torch_refuses_the_variants_it_cannot_hold(config, named):
    with pytest.raises(ValueError, match=r"`torch.nn.MultiheadAttention` cannot hold .*Received: " + named):
        MultiHeadAttention(16, 4, **config).to_torch()
    MultiHeadAttention(16, 4, scale=0.5).to_torch()  # 1 / sqrt(4): the default, held


# ---------------------------------------------------------------------------------------------
# Errors (exact texts from the shared API) and the refused traps.

CONSTRUCTOR_ERRORS = {
    "bias_string": ({"bias": "query"}, r"`bias` must be True, False or a list, tuple or set of 'query', 'key', 'value', 'output', 'gate'\. Received: bias='query'"),
    "bias_unknown": ({"bias": ["qkv"]}, r"Received: bias=\['qkv'\]"),
    "scale": ({"scale": 0}, r"`scale` must be a positive float\. Received: scale=0"),
    "softcap": ({"softcap": -1.0}, r"`softcap` must be None or a positive float\. Received: softcap=-1\.0"),
    "window": ({"window": 0}, r"`window` must be None, a positive integer or a pair \(before, after\) of positive integers\. Received: window=0"),
    "rope_theta": ({"rope_theta": "big"}, r"`rope_theta` must be None or a positive float\. Received: rope_theta='big'"),
    "rope_fraction_odd": ({"rope_theta": 10.0, "rope_fraction": 0.375}, re.escape("`rope_fraction` must be in (0, 1] and rotate an even number R = int(head_dim * rope_fraction) >= 2 of features. Received: rope_fraction=0.375, head_dim=8")),
    "rope_fraction_above_one": ({"rope_theta": 10.0, "rope_fraction": 1.5}, r"Received: rope_fraction=1\.5, head_dim=8"),
    "rope_scaling_type": ({"rope_theta": 10.0, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, r"`rope_scaling` must be None or a dict whose rope_type is 'linear', 'llama3', 'yarn' or 'proportional', with its parameters\. Received: rope_scaling=\{'rope_type': 'longrope'"),
    "rope_scaling_missing": ({"rope_theta": 10.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"Received: rope_scaling=\{'rope_type': 'llama3', 'factor': 8\.0\}"),
    "qk_norm": ({"qk_norm": "layer"}, r"`qk_norm` must be None, 'head', 'per_head' or 'all'\. Received: qk_norm='layer'"),
    "qk_norm_eps": ({"qk_norm_eps": 0.0}, r"`qk_norm_eps` must be a positive float\. Received: qk_norm_eps=0\.0"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONSTRUCTOR_ERRORS))
def test_constructor_errors(name):
    config, pattern = CONSTRUCTOR_ERRORS[name]
    with pytest.raises(ValueError, match=pattern):
        MultiHeadAttention(E, N, head_dim=H, **config)


X = _randn(2, 3, E, seed=31)
Y = _randn(2, 5, E, seed=32)
CALL_ERRORS = {
    "positions_without_rope": ({}, {"query": X, "positions": torch.arange(3)}, r"`positions` needs RoPE: construct the layer with `rope_theta`\. Received: positions with rope_theta=None"),
    "positions_shape": ({"rope_theta": 10.0}, {"query": X, "positions": torch.arange(4)}, r"`positions` must be an integer tensor of shape \(B, T\) or \(T,\) with B=2, T=3\. Received: positions\.shape=\(4,\), positions\.dtype=int64"),
    "positions_float": ({"rope_theta": 10.0}, {"query": X, "positions": torch.zeros(2, 3)}, r"Received: positions\.shape=\(2, 3\), positions\.dtype=float32"),
    "rope_cross_lengths": ({"rope_theta": 10.0}, {"query": X, "key": Y}, r"RoPE needs `key` and `value` to hold the query's own tokens \(S == T, or decoding with `cache`\)\. Received: query\.shape=\(2, 3, 16\), key\.shape=\(2, 5, 16\)"),
    "mixed_dtypes": ({}, {"query": X, "key": Y.double(), "value": Y}, r"`query`, `key` and `value` must have the same dtype\. Received: query\.dtype=float32, key\.dtype=float64, value\.dtype=float32"),
    "key_mask_shape": ({}, {"query": X, "key": Y, "key_mask": torch.ones(2, 3, dtype=torch.bool)}, r"`key_mask` must be a boolean tensor of shape \(B, S\)=\(2, 5\)\. Received: key_mask\.shape=\(2, 3\), key_mask\.dtype=bool"),
    "key_mask_dtype": ({}, {"query": X, "key": Y, "key_mask": torch.ones(2, 5)}, r"Received: key_mask\.shape=\(2, 5\), key_mask\.dtype=float32"),
    "query_mask_shape": ({}, {"query": X, "query_mask": torch.ones(3, dtype=torch.bool)}, r"`query_mask` must be a boolean tensor of shape \(B, T\)=\(2, 3\)\. Received: query_mask\.shape=\(3,\), query_mask\.dtype=bool"),
    "attention_bias_bool": ({}, {"query": X, "attention_bias": torch.ones(3, 3, dtype=torch.bool)}, r"`attention_bias` must be floating\. Received: attention_bias\.dtype=bool"),
    "attention_bias_shape": ({}, {"query": X, "key": Y, "attention_bias": torch.ones(3, 4)}, r"`attention_bias` must broadcast to \(B, N, T, S\) .* Expected: \(B, N, T, S\)=\(2, 4, 3, 5\)\. Received: attention_bias\.shape=\(3, 4\)"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CALL_ERRORS))
def test_call_errors(name):
    config, call, pattern = CALL_ERRORS[name]
    layer = MultiHeadAttention(E, N, head_dim=H, **config)
    with pytest.raises(ValueError, match=pattern):
        layer(**call)


def test_traps_that_are_not_traps_pass():
    layer = _layer()
    x = _randn(3, 3, E, seed=33)
    layer(x, attention_mask=torch.ones(1, 3, dtype=torch.bool))  # (1, S): no ambiguity
    layer(x, attention_mask=torch.zeros(3, 3, 3))  # a float mask of only 0s adds nothing: no 1 in it
    layer(x[:2], attention_mask=torch.ones(3, 3, dtype=torch.bool))  # B != T
    layer(x, attention_mask=torch.tensor([[0.0, 1.0, 0.5]]).expand(3, 3)[None])  # not only 0s and 1s


def test_mask_habits_are_not_read_while_compiling():
    """Inside a graph the mask's values are not read (no graph break, no warning): an all-False
    mask is every row with no key, the output bias, as in eager mode."""
    layer = _layer()
    x = _randn(2, 3, E, seed=34)
    compiled = torch.compile(lambda x, m: layer(x, attention_mask=m), fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttentionMaskWarning)
        output = compiled(x, torch.zeros(2, 3, 3, dtype=torch.bool))
    torch.testing.assert_close(output, layer.output.bias.detach().expand(2, 3, E), atol=0, rtol=0)


def test_mask_habits_are_read_only_on_the_cpu():
    """Reading values off the CPU costs a device sync (CUDA) or is impossible (meta): not read."""
    assert Multi_Head_Attention._values_readable(torch.zeros(2, 3))
    assert not Multi_Head_Attention._values_readable(torch.zeros(2, 3), torch.zeros(2, 3, device="meta"))


# ---------------------------------------------------------------------------------------------
# Regressions of the floating mask rule.


def test_regression_float64_mask_minus_1e300_gave_nan_on_the_explicit_path():
    """-1e300 is above float64's lowest, so it was added, cast to float32 as -inf: NaN on rows it filled."""
    layer = _layer()
    x = _randn(2, 4, E, seed=35)
    mask = torch.zeros(2, 4, 4, dtype=torch.float64)
    mask[:, :, 1] = -1e300
    mask[0, 2] = -1e300  # a row with no key left
    for return_attention in (False, True):
        result = layer(x, attention_mask=mask, return_attention=return_attention)
        output = result[0] if return_attention else result
        assert torch.isfinite(output).all()
        torch.testing.assert_close(output[0, 2], layer.output.bias.detach(), atol=0, rtol=0)
        if return_attention:
            assert (result[1][..., 1] == 0).all() and (result[1][0, :, 2] == 0).all()


def test_regression_float64_mask_holding_float32_lowest_removes_the_key():
    """transformers builds masks with float32's lowest; in a float64 NumPy mask that value was
    above the float64 threshold and was added as a finite penalty instead of removing the key."""
    layer = _layer()
    x = _randn(2, 4, E, seed=36)
    lowest = torch.finfo(torch.float32).min
    mask = torch.zeros(2, 4, 4, dtype=torch.float64)
    mask[:, :, 3] = lowest
    mask[1, 0] = lowest  # query 0 of batch 1 keeps no key
    _, weights = layer(x, attention_mask=mask, return_attention=True)
    assert (weights[..., 3] == 0).all() and (weights[1, :, 0] == 0).all()
    output = layer(x, attention_mask=mask)
    torch.testing.assert_close(output[1, 0], layer.output.bias.detach(), atol=0, rtol=0)
    torch.testing.assert_close(output, layer(x, attention_mask=mask > lowest), atol=OUTPUT_TOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_regression_float16_layer_float32_mask_minus_1e9_differed_between_sdpa_and_explicit(dtype):
    """SDPA took the mask cast to q's dtype, where -1e9 is -inf: a row of only -1e9 penalties was
    NaN there and an ordinary softmax on the explicit path. Now -1e9 is a finite penalty on both
    paths, and a row of only penalties an ordinary softmax (the float32 layer's numbers)."""
    reference_layer = _layer()
    layer = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, dtype=dtype).eval()
    layer.import_weights(reference_layer.export_weights())
    x = _randn(2, 4, E, seed=37)
    mask = torch.zeros(2, 4, 4)
    mask[:, :, 0] = -1e9  # a penalty on key 0
    mask[0, 1] = -1e9  # query 1 of batch 0: only penalties
    expected = reference_layer(x, attention_mask=mask)
    sdpa = layer(x.to(dtype), attention_mask=mask)
    explicit, weights = layer(x.to(dtype), attention_mask=mask, return_attention=True)
    tol = TOLERANCES[str(dtype).removeprefix("torch.")]["output"]
    for output in (sdpa, explicit):
        assert torch.isfinite(output).all()
        torch.testing.assert_close(output.float(), expected, atol=tol, rtol=0)
    torch.testing.assert_close(sdpa.float(), explicit.float(), atol=2 * tol, rtol=0)
    assert (weights[1, ..., 0] == 0).all() and (weights[0, :, 1] > 0).all()


@pytest.mark.parametrize("path", ["sdpa", "explicit", "inference"])
def test_a_row_of_only_penalties_among_its_kept_keys_is_an_ordinary_softmax(path):
    """-1e9 on every key a query keeps (the causal rule removes the others, which hold 0): in
    float32, scores + -1e9 round to multiples of 64 unless the row is shifted by its largest
    kept value first (a per-query constant, which does not change a softmax)."""
    layer = _layer()
    x = _randn(2, 4, E, seed=43)
    mask = torch.zeros(2, 4, 4)
    mask[0, 2, :3] = -1e9  # query 2 of batch 0 keeps keys 0..2 (causal), all penalised
    output, weights = _call(layer, path, x, attention_mask=mask, causal=True)
    expected, expected_weights = reference(layer, x, bias=mask[:, None].double(), causal=True)
    torch.testing.assert_close(output.double(), expected, atol=OUTPUT_TOL, rtol=0)
    if weights is not None:
        torch.testing.assert_close(weights.double(), expected_weights, atol=WEIGHTS_TOL, rtol=0)


def test_regression_export_weights_after_quantize_dynamic_failed_on_the_weight_method():
    """`quantize_dynamic` turns `weight` and `bias` into methods: export_weights raised
    AttributeError ('function' object has no attribute 'detach'). It now exports the dequantized
    weights, which a float layer computes the quantized layer's numbers within its quantization
    error with; importing into quantized projections is a ValueError that says what to do."""
    layer = _layer(**VARIANTS["bias_qkv"])
    x = _randn(B, T, E, seed=30)
    quantized = _quantized(copy.deepcopy(layer))
    weights = quantized.export_weights()
    assert set(weights) == set(layer.export_weights())
    for name, value in weights.items():
        np.testing.assert_allclose(value, layer.export_weights()[name], atol=0.02, err_msg=name)
    restored = _layer(**VARIANTS["bias_qkv"])
    restored.import_weights(weights)
    with torch.no_grad():
        torch.testing.assert_close(restored(x), quantized(x), atol=0.05, rtol=0)
    with pytest.raises(
        ValueError,
        match=r"^`import_weights` writes float projections: import the weights before quantizing\. Received: quantized projections \['query', 'key', 'value', 'output'\]$",
    ):
        quantized.import_weights(weights)


# -- the RoPE frequencies: computed once, a float32 buffer outside the state dict ----------------------

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
ROPE_BUFFER = {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}}


def test_rope_frequencies_stay_float32_in_a_half_layer_with_the_same_state_dict():
    """`_inv_freq` is made once (not at every call) and stays float32 when the layer is cast, so the
    angles of a float16 or bfloat16 layer are those of a float32 one; it is not in `state_dict`."""
    layer = _layer(**ROPE_BUFFER)
    expected = Multi_Head_Attention.rope_frequencies(layer._rotary_dim, 10000.0, layer.rope_scaling)
    names = set(layer.state_dict())
    for cast in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.to(torch.float64)):
        cast(layer)
        assert layer._inv_freq.dtype == torch.float32
        torch.testing.assert_close(layer._inv_freq, expected, atol=0, rtol=0)
        assert set(layer.state_dict()) == names and "_inv_freq" not in names
    half = _layer(**ROPE_BUFFER).half()
    x = _randn(2, 5, E, seed=3)
    with torch.no_grad():
        reference = _layer(**ROPE_BUFFER)(x)
        torch.testing.assert_close(half(x.half()).float(), reference, atol=2e-2, rtol=0)
    assert _layer()._inv_freq is None  # no RoPE, no buffer


def test_rope_frequencies_are_made_after_meta_init_to_empty_and_reset_parameters():
    """Meta initialization (no values), `to_empty` (uninitialized memory) then `reset_parameters`
    gives the frequencies and the outputs of a layer made on the CPU."""
    with torch.device("meta"):
        layer = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, **ROPE_BUFFER)
    assert layer._inv_freq.device.type == "meta"
    layer = layer.to_empty(device="cpu")
    expected = Multi_Head_Attention.rope_frequencies(layer._rotary_dim, 10000.0, layer.rope_scaling)
    torch.testing.assert_close(layer._inv_freq, expected, atol=0, rtol=0)
    layer.reset_parameters()
    torch.testing.assert_close(layer._inv_freq, expected, atol=0, rtol=0)
    reference = _layer(**ROPE_BUFFER)
    layer.load_state_dict(reference.state_dict())
    x = _randn(2, 5, E, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, causal=True), reference(x, causal=True), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# Two-sided windows, attention chunks, M-RoPE and LayerNorm / per-head / biased QK-norm, against
# the float64 NumPy reference on every path (SDPA, explicit, blocked inference, the is_causal
# shortcut's condition, fused and separate projections, lean and full decoding, int8, meta).

NEW_VARIANTS = {
    "window_pair": {"window": (3, 2)},
    "window_pair_list": {"window": [2, 4]},
    "chunk": {"attention_chunk_size": 4},
    "chunk_window_pair": {"attention_chunk_size": 4, "window": (2, 3)},
    "mrope": {"rope_theta": 100.0, "rope_sections": (1, 2, 1)},
    "mrope_dealt": {"rope_theta": 100.0, "rope_sections": (2, 1, 1), "rope_sections_interleaved": True},  # Qwen3-VL
    "mrope_partial_interleaved_yarn": {
        "rope_theta": 100.0,
        "rope_fraction": 0.5,
        "rope_interleaved": True,
        "rope_scaling": YARN,
        "rope_sections": [1, 1],
    },
    "qk_norm_per_head": {"qk_norm": "per_head"},
    "qk_norm_per_head_layer_bias": {"qk_norm": "per_head", "qk_norm_type": "layer", "qk_norm_bias": True},
    "qk_norm_head_layer_bias": {"qk_norm": "head", "qk_norm_type": "layer", "qk_norm_bias": True},  # Phi
    "qk_norm_all_layer": {"qk_norm": "all", "qk_norm_type": "layer", "qk_norm_eps": 1e-3},
    "qk_norm_all_rms_bias": {"qk_norm": "all", "qk_norm_bias": True},
    "everything_new": {
        "bias": ("query", "key", "value"),
        "softcap": 3.0,
        "window": (4, 2),
        "attention_chunk_size": 4,
        "rope_theta": 500.0,
        "rope_fraction": 0.75,
        "rope_sections": (2, 1),
        "qk_norm": "per_head",
        "qk_norm_type": "layer",
        "qk_norm_bias": True,
        "sinks": True,
        "clip_qkv": 1.0,
    },  # rope_fraction 0.75: R = 6, three pairs in sections of 2 and 1
}


def _numpy_twin(layer, config):
    """The NumPy reference (float64) holding the layer's portable weights."""
    twin = NumpyMultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, **config, seed=0)
    twin.import_weights(layer.export_weights())
    return twin


def _new_positions(layer, b=B, t=T, seed=3):
    """Random RoPE positions: (k, B, T) with k sections, (B, T) without; {} without RoPE."""
    if layer.rope_theta is None:
        return {}
    rows = () if layer.rope_sections is None else (len(layer.rope_sections),)
    return {"positions": torch.randint(0, 50, (*rows, b, t), generator=torch.Generator().manual_seed(seed))}


def _as_numpy(kwargs):
    return {name: value.numpy() if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}


def _assert_like_numpy(got, expected, tol):
    np.testing.assert_allclose(got.detach().double().numpy(), expected, atol=tol, rtol=0)


@pytest.mark.parametrize("path", ["sdpa", "explicit", "inference"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", sorted(NEW_VARIANTS))
def test_new_variant_matches_numpy(variant, causal, path):
    layer = _layer(**NEW_VARIANTS[variant])
    twin = _numpy_twin(layer, NEW_VARIANTS[variant])
    x, keep, _ = _inputs()
    kwargs = {"attention_mask": keep, "causal": causal, **_new_positions(layer)}
    output, weights = _call(layer, path, x, **kwargs)
    expected, expected_weights = twin(x.double().numpy(), **_as_numpy(kwargs), return_attention=True)
    _assert_like_numpy(output, expected, OUTPUT_TOL)
    if weights is not None:
        _assert_like_numpy(weights, expected_weights, WEIGHTS_TOL)


@pytest.mark.parametrize("projections", ["fused", "separate"])
@pytest.mark.parametrize("variant", sorted(NEW_VARIANTS))
def test_new_variant_without_masks_matches_numpy(variant, projections):
    """Causal with no mask and T == S is where SDPA's own `is_causal` triangle is taken: a window
    (one- or two-sided) or a chunk must keep the layer off it. Fused (one input) and separate
    projections."""
    layer = _layer(**NEW_VARIANTS[variant])
    twin = _numpy_twin(layer, NEW_VARIANTS[variant])
    x, _, _ = _inputs()
    inputs = (x,) if projections == "fused" else (x, x.clone(), x.clone())
    rope = _new_positions(layer)
    for causal in (False, True):
        with torch.no_grad():
            output = layer(*inputs, causal=causal, **rope)
        expected = twin(*(i.double().numpy() for i in inputs), causal=causal, **_as_numpy(rope))
        _assert_like_numpy(output, expected, OUTPUT_TOL)


def _portable_grads(layer):
    """The gradients of the layer's parameters by their portable names (kernels transposed)."""
    grads = {}
    for name in layer.weight_shapes():
        tensor, transposed = Multi_Head_Attention._parameter(layer, name)
        grads[name] = tensor.grad.T if transposed else tensor.grad
    return grads


@pytest.mark.parametrize("path", ["sdpa", "explicit"])
@pytest.mark.parametrize("variant", sorted(NEW_VARIANTS))
def test_new_variant_gradients_match_numpy_backward(variant, path):
    """Autograd through the new pieces (LayerNorm, per-head scales, norm biases, M-RoPE, the
    window pair and the chunk in keep) against NumPy's `backward`: inputs, every weight and
    attention_bias."""
    config = NEW_VARIANTS[variant]
    layer = _layer(**config).train()
    twin = _numpy_twin(layer, config)
    x, keep, _ = _inputs()
    y = _randn(B, T, E, seed=7)
    bias = (_randn(1, N, T, T, seed=8) * 0.5).requires_grad_()
    rope = _new_positions(layer)
    grad_output = _randn(B, T, E, seed=9)
    inputs = [x.clone().requires_grad_(), y.clone().requires_grad_()]
    output, _ = _call(layer, path, *inputs, attention_mask=keep, attention_bias=bias, causal=True, **rope)
    (output * grad_output).sum().backward()
    arrays = {"attention_mask": keep.numpy(), "attention_bias": bias.detach().double().numpy(), **_as_numpy(rope)}
    twin(x.double().numpy(), y.double().numpy(), causal=True, **arrays)
    expected = twin.backward(grad_output.double().numpy())
    got = {**_portable_grads(layer), "query": inputs[0].grad, "key": inputs[1].grad, "attention_bias": bias.grad}
    assert set(expected) == set(got)
    for name, grad in got.items():
        _assert_like_numpy(grad, expected[name], GRADS_TOL)


def test_new_norm_weights_get_gradients():
    """The per-head scales and the norm biases (zeros at initialization) all move."""
    layer = _layer(**NEW_VARIANTS["everything_new"])
    x, _, _ = _inputs()
    layer(x, causal=True).square().sum().backward()
    for name in ("query_norm", "key_norm", "query_norm_bias", "key_norm_bias"):
        grad = getattr(layer, name).grad.view(-1, H)  # (heads, H): each head its own
        assert torch.isfinite(grad).all() and (grad.abs().sum(-1) > 0).all(), name


DECODE_VARIANTS = ["window_pair", "chunk", "chunk_window_pair", "mrope", "mrope_dealt", "everything_new"]


def _decode_steps(layer, x, chunks, length, causal, positions=None, return_attention=False, cache=None):
    """Decodes x chunk by chunk; returns the concatenated outputs and the last cache."""
    cache = layer.init_cache(x.shape[0], length) if cache is None else cache
    outputs, start = [], 0
    for size in chunks:
        chunk = slice(start, start + size)
        rope = {} if positions is None else {"positions": positions[..., chunk]}
        result = layer(x[:, chunk], causal=causal, cache=cache, return_attention=return_attention, **rope)
        outputs.append(result[0])
        cache = result[-1]
        start += size
    return outputs, cache


@pytest.mark.parametrize("return_attention", [False, True], ids=["lean", "full_keep"])
@pytest.mark.parametrize("chunks", [(7,), (4, 1, 1, 1), (1,) * 7])
@pytest.mark.parametrize("variant", DECODE_VARIANTS)
def test_new_variant_decoding_equals_the_full_causal_pass(variant, chunks, return_attention):
    """Token by token (and in chunks) equals the full causal pass: the window pair and the chunk
    in the lean step (bottom-right aligned over index + T slots) and in the cache's keep over L,
    M-RoPE at its (k, B, T) positions."""
    layer = _layer(**NEW_VARIANTS[variant])
    x = _randn(2, 7, E, seed=26)
    rope = _new_positions(layer, b=2, t=7)
    with torch.no_grad():
        outputs, cache = _decode_steps(layer, x, chunks, 10, True, rope.get("positions"), return_attention)
        expected = layer(x, causal=True, **rope)
    torch.testing.assert_close(torch.cat(outputs, 1), expected, atol=OUTPUT_TOL, rtol=0)
    assert int(cache.index) == 7


@pytest.mark.parametrize("return_attention", [False, True], ids=["lean", "full_keep"])
@pytest.mark.parametrize("variant", DECODE_VARIANTS)
def test_new_variant_decoding_without_causal_matches_numpy(variant, return_attention):
    """Not causal, a chunk of T tokens sees the keys after each query within the chunk: the pair's
    after-limit and the attention chunk over the cache's slots, against NumPy's decoding."""
    config = NEW_VARIANTS[variant]
    layer = _layer(**config)
    twin = _numpy_twin(layer, config)
    x = _randn(2, 9, E, seed=27)
    rope = _new_positions(layer, b=2, t=9)
    chunks = (3, 1, 4, 1)
    with torch.no_grad():
        outputs, _ = _decode_steps(layer, x, chunks, 12, False, rope.get("positions"), return_attention)
    expected, _ = _decode_steps(twin, x.double().numpy(), chunks, 12, False, _as_numpy(rope).get("positions"))
    for got, want in zip(outputs, expected, strict=True):
        _assert_like_numpy(got, want, OUTPUT_TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_rolling_cache_with_a_window_pair_rolls_by_w_before_and_matches_numpy(causal):
    """window (3, 2): the cache rolls by W_before = 3 (L = 3 + 2 - 1 = 4 slots take chunks of 2
    that wrap), the after-limit read off each slot's position, against NumPy's rolling cache."""
    config = {**NEW_VARIANTS["everything_new"], "window": (3, 2), "attention_chunk_size": 5}
    layer = _layer(**config)
    twin = _numpy_twin(layer, config)
    x = _randn(2, sum(ROLLING_CHUNKS), E, seed=42)
    rope = _new_positions(layer, b=2, t=x.shape[1])
    with torch.no_grad():
        outputs, cache = _decode_steps(layer, x, ROLLING_CHUNKS, 4, causal, rope["positions"], True)
    expected, _ = _decode_steps(twin, x.double().numpy(), ROLLING_CHUNKS, 4, causal, rope["positions"].numpy())
    for got, want in zip(outputs, expected, strict=True):
        _assert_like_numpy(got, want, OUTPUT_TOL)
    with pytest.raises(ValueError, match=r"^`cache` rolls with `window`: .*Received: window=3, T=3, L=4$"):
        layer(x[:, :3], cache=cache, positions=rope["positions"][..., :3])


def test_new_variants_decode_compiled_fullgraph_equals_eager():
    """Under torch.compile the index is a tensor: every step takes the cache's keep, with the pair
    and the chunk folded in; one graph per T."""
    config = NEW_VARIANTS["everything_new"]
    layer = _layer(**config)
    x = _randn(2, sum(ROLLING_CHUNKS), E, seed=43)
    positions = _new_positions(layer, b=2, t=x.shape[1])["positions"]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=False)
    with torch.no_grad():
        eager, _ = _decode_steps(layer, x, ROLLING_CHUNKS, 5, True, positions)
        got, _ = _decode_steps(compiled, x, ROLLING_CHUNKS, 5, True, positions)
        expected = layer(x, causal=True, positions=positions)
    assert counter.frame_count == 2  # T = 2 and T = 1
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(eager, 1), atol=OUTPUT_TOL, rtol=0)
    torch.testing.assert_close(torch.cat(eager, 1), expected, atol=OUTPUT_TOL, rtol=0)


def test_new_variants_compile_fullgraph_with_gradients():
    layer = _layer(**NEW_VARIANTS["everything_new"]).train()
    x, keep, _ = _inputs()
    positions = _new_positions(layer)["positions"]

    def step(x, keep, positions):
        return layer(x, key_mask=keep[:, 0, 0], positions=positions)

    expected = step(x, keep, positions)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(x, keep, positions)
    torch.testing.assert_close(got, expected, atol=OUTPUT_TOL, rtol=0)
    got.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.mark.parametrize("variant", ["everything_new", "qk_norm_head_layer_bias", "mrope"])
def test_new_variants_int8_match_numpy_int8(variant):
    """Both layers quantized from the same float weights: the NumPy int8 output within one
    quantization step (an input integer rounded the other way in float32)."""
    config = NEW_VARIANTS[variant]
    layer = _layer(**config)
    twin = _numpy_twin(layer, config)
    layer.quantize("int8")
    twin.quantize("int8")
    x, keep, _ = _inputs()
    rope = _new_positions(layer)
    with torch.no_grad():
        outputs = [layer(x, attention_mask=keep, causal=True, return_attention=path, **rope) for path in (0, 1)]
    expected = twin(x.double().numpy(), attention_mask=keep.numpy(), causal=True, **_as_numpy(rope))
    step = float(np.abs(twin._saved["merged"]).max() * twin.params["output_kernel_scale"].max())
    for output in (outputs[0], outputs[1][0]):
        assert np.abs(output.double().numpy() - expected).max() <= step + OUTPUT_TOL


@pytest.mark.parametrize("return_attention", [False, True])
def test_new_variants_on_the_meta_device_give_the_cpu_shapes(return_attention):
    """Forward (SDPA and explicit) and decoding (prefill, steps that roll the cache) on meta."""
    config = NEW_VARIANTS["everything_new"]

    def run(device):
        layer = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, **config, device=device)
        x = _randn(2, 7, E, seed=44).to(device)
        positions = torch.arange(7).expand(2, 2, 7).to(device)
        results = [layer(x, causal=True, positions=positions, return_attention=return_attention)]
        with torch.no_grad():
            cache = layer.init_cache(2, 5)
            for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6), (6, 7)):
                result = layer(x[:, start:stop], causal=True, cache=cache, return_attention=return_attention)
                cache = result[-1]
                results.append(result)
        return results

    cpu, meta = run("cpu"), run("meta")
    cpu_leaves, meta_leaves = torch.utils._pytree.tree_leaves(cpu), torch.utils._pytree.tree_leaves(meta)
    assert [leaf is None for leaf in meta_leaves] == [leaf is None for leaf in cpu_leaves]  # a cache's unset fields
    meta_leaves, cpu_leaves = [x for x in meta_leaves if x is not None], [x for x in cpu_leaves if x is not None]
    assert len(cpu_leaves) == len(meta_leaves) > 0
    for got, expected in zip(meta_leaves, cpu_leaves, strict=True):
        assert (got.device.type, got.shape, got.dtype) == ("meta", expected.shape, expected.dtype)


def test_window_and_chunk_masks_are_their_formulas():
    """`window_mask` with an int and a pair and `attention_chunk_mask`, bottom-right aligned (T < S),
    against a direct loop; `dot_product_attention` takes `attention_chunk_size`."""
    t, s = 5, 9
    for window, (before, after) in ((3, (3, None)), ((3, 2), (3, 2)), ((1, 1), (1, 1))):
        expected = torch.tensor(
            [[j > i + s - t - before and (after is None or j < i + s - t + after) for j in range(s)] for i in range(t)]
        )
        assert torch.equal(Multi_Head_Attention.window_mask(t, s, window), expected)
    expected = torch.tensor([[j // 3 == (i + s - t) // 3 for j in range(s)] for i in range(t)])
    assert torch.equal(Multi_Head_Attention.attention_chunk_mask(t, s, 3), expected)
    q, k, v = _randn(2, 4, t, H, seed=45), _randn(2, 2, s, H, seed=46), _randn(2, 2, s, H, seed=47)
    keep = Multi_Head_Attention.window_mask(t, s, (3, 2)) & expected
    got = dot_product_attention(q, k, v, window=(3, 2), attention_chunk_size=3, return_attention=True)
    want = dot_product_attention(q, k, v, keep, return_attention=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_modernbert_band_is_window_65_65():
    """ModernBERT's local attention keeps |t - s| <= 64: `window=(65, 65)`."""
    t = 150
    band = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).abs() <= 64
    assert torch.equal(Multi_Head_Attention.window_mask(t, t, (65, 65)), band)


def test_mrope_with_one_row_for_every_section_is_plain_rope():
    """(B, T) positions, or the same row in every section, give exactly plain RoPE's numbers;
    rows that differ give other numbers."""
    plain = _layer(rope_theta=100.0)
    sectioned = _layer(rope_theta=100.0, rope_sections=(1, 2, 1))
    x, _, positions = _inputs()
    expected = plain(x, positions=positions)
    torch.testing.assert_close(sectioned(x, positions=positions), expected, atol=0, rtol=0)
    torch.testing.assert_close(sectioned(x, positions=positions.expand(3, B, T)), expected, atol=0, rtol=0)
    torch.testing.assert_close(sectioned(x), plain(x), atol=0, rtol=0)  # arange for every section
    rows = torch.stack([positions, positions + 5, positions * 2])  # (3, B, T)
    assert not torch.allclose(sectioned(x, positions=rows), expected, atol=1e-3)


def test_mrope_turns_each_section_of_pairs_by_its_row():
    """`apply_rope` with sections: pair i of section j turns as plain RoPE at row j's positions."""
    x = _randn(2, 3, 4, H, seed=48)  # (B, heads, T, H)
    inv_freq = Multi_Head_Attention.rope_frequencies(H, 100.0)  # (4,)
    rows = torch.randint(0, 30, (3, 2, 4), generator=torch.Generator().manual_seed(49))
    got = Multi_Head_Attention.apply_rope(x, rows, inv_freq, False, (1, 2, 1))
    owner = [0, 1, 1, 2]  # the section of each pair
    for pair, row in enumerate(owner):
        one = Multi_Head_Attention.apply_rope(x, rows[row], inv_freq, False)
        for feature in (pair, pair + H // 2):
            torch.testing.assert_close(got[..., feature], one[..., feature], atol=0, rtol=0)


def test_layer_norm_qk_norm_is_its_formula_in_float32_for_half_inputs():
    """LayerNorm: the mean removed, the biased variance, then scale and bias; float16 q and k are
    normalized in float32 and cast back."""
    x = _randn(2, 3, 5, H, seed=50)
    scale, bias = _randn(H, seed=51), _randn(H, seed=52)
    centred = x - x.mean(-1, keepdim=True)
    expected = centred / torch.sqrt(centred.square().mean(-1, keepdim=True) + 1e-6) * scale + bias
    torch.testing.assert_close(Multi_Head_Attention.layer_norm(x, scale, 1e-6, bias), expected, atol=1e-6, rtol=0)
    half = Multi_Head_Attention.layer_norm(x.half(), scale.half(), 1e-6, bias.half())
    assert half.dtype == torch.float16
    wide = Multi_Head_Attention.layer_norm(x.half().float(), scale.half().float(), 1e-6, bias.half().float())
    torch.testing.assert_close(half, wide.half(), atol=0, rtol=0)


def test_new_weights_layout_state_dict_and_initialization():
    layer = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, qk_norm="per_head", qk_norm_bias=True, sinks=True)
    assert list(layer.weight_shapes())[-5:] == ["query_norm", "key_norm", "query_norm_bias", "key_norm_bias", "sinks"]
    shapes = layer.weight_shapes()
    assert shapes["query_norm"] == shapes["query_norm_bias"] == (N * H,)
    assert shapes["key_norm"] == shapes["key_norm_bias"] == (K * H,)
    assert layer.query_norm.detach().eq(1).all() and layer.key_norm_bias.detach().eq(0).all()
    assert {"query_norm_bias", "key_norm_bias"} <= set(layer.state_dict())
    head = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, qk_norm="head", qk_norm_bias=True)
    assert head.weight_shapes()["query_norm_bias"] == head.weight_shapes()["key_norm_bias"] == (H,)
    unused = MultiHeadAttention(E, N, qk_norm_bias=True, qk_norm_type="layer")  # checked, no weights
    assert "query_norm_bias" not in unused.weight_shapes() and unused.query_norm_bias is None
    source = _layer(**NEW_VARIANTS["everything_new"])
    other = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, **NEW_VARIANTS["everything_new"])
    other.import_weights(source.export_weights())
    x, _, _ = _inputs()
    torch.testing.assert_close(other(x), source(x), atol=0, rtol=0)


def test_new_arguments_are_held_as_python_values_and_named():
    layer = MultiHeadAttention(
        E, N, head_dim=H, window=[np.int64(65), 65], attention_chunk_size=np.int64(8), rope_theta=10.0,
        rope_sections=[np.int64(1), 3], qk_norm=np.str_("per_head"), qk_norm_type=np.str_("layer"),
        qk_norm_bias=np.bool_(True),
    )  # fmt: skip
    assert layer.window == (65, 65) and all(type(side) is int for side in layer.window)
    assert type(layer.attention_chunk_size) is int and layer.rope_sections == (1, 3)
    assert type(layer.qk_norm_type) is str and layer.qk_norm_bias is True
    text = layer.extra_repr()
    for part in (
        "window=(65, 65)", "attention_chunk_size=8", "rope_sections=(1, 3)", "qk_norm='per_head'",
        "qk_norm_type='layer'", "qk_norm_bias=True",
    ):  # fmt: skip
        assert part in text, part
    assert "qk_norm_type" not in MultiHeadAttention(E, N, qk_norm="head").extra_repr()
    assert MultiHeadAttention(E, N, window=7).window == 7


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"window": (4, 4)}, r"window=\(4, 4\)"),
        ({"attention_chunk_size": 8}, r"attention_chunk_size=8"),
        ({"rope_theta": 10.0, "rope_sections": (1, 1)}, r"rope_sections=\(1, 1\)"),
        ({"qk_norm": "per_head"}, r"qk_norm='per_head'"),
        ({"qk_norm": "head", "qk_norm_type": "layer"}, r"qk_norm_type='layer'"),
        ({"qk_norm": "head", "qk_norm_bias": True}, r"qk_norm_bias=True"),
    ],
)
def test_to_torch_refuses_the_new_variants(config, named):
    with pytest.raises(ValueError, match=r"`torch.nn.MultiheadAttention` cannot hold .*Received: .*" + named):
        MultiHeadAttention(16, 4, **config).to_torch()


WINDOW_TEXT = r"`window` must be None, a positive integer or a pair \(before, after\) of positive integers\. "
NEW_CONSTRUCTOR_ERRORS = {
    "window_zero": ({"window": 0}, WINDOW_TEXT + r"Received: window=0$"),
    "window_bool": ({"window": True}, WINDOW_TEXT + r"Received: window=True$"),
    "window_float": ({"window": 2.0}, WINDOW_TEXT + r"Received: window=2\.0$"),
    "window_string": ({"window": "4"}, WINDOW_TEXT + r"Received: window='4'$"),
    "window_dict": ({"window": {1: 2}}, WINDOW_TEXT + r"Received: window=\{1: 2\}$"),
    "window_none_inside": ({"window": (None, 2)}, WINDOW_TEXT + r"Received: window=\(None, 2\)$"),
    "window_three": ({"window": [1, 2, 3]}, WINDOW_TEXT + r"Received: window=\[1, 2, 3\]$"),
    "window_one": ({"window": (4,)}, WINDOW_TEXT + r"Received: window=\(4,\)$"),
    "window_zero_after": ({"window": (4, 0)}, WINDOW_TEXT + r"Received: window=\(4, 0\)$"),
    "chunk": ({"attention_chunk_size": 0}, r"^`attention_chunk_size` must be a positive integer\. Received: attention_chunk_size=0$"),
    "chunk_float": ({"attention_chunk_size": 4.0}, r"Received: attention_chunk_size=4\.0$"),
    "rope_sections_type": ({"rope_sections": 4}, r"^`rope_sections` must be None or a list or tuple of positive integers\. Received: rope_sections=4$"),
    "rope_sections_empty": ({"rope_sections": ()}, r"Received: rope_sections=\(\)$"),
    "rope_sections_zero": ({"rope_sections": (2, 0)}, r"Received: rope_sections=\(2, 0\)$"),
    "rope_sections_bool": ({"rope_sections": [True, 3]}, r"Received: rope_sections=\[True, 3\]$"),
    "rope_sections_sum": ({"rope_theta": 10.0, "rope_sections": (1, 2)}, re.escape("`rope_sections` must sum to R/2 = 4, the pairs RoPE rotates (R = int(head_dim * rope_fraction) = 8). Received: rope_sections=(1, 2)")),
    "rope_sections_sum_partial": ({"rope_theta": 10.0, "rope_fraction": 0.5, "rope_sections": (1, 2)}, re.escape("R/2 = 2, the pairs RoPE rotates (R = int(head_dim * rope_fraction) = 4)")),
    "qk_norm": ({"qk_norm": "layer"}, r"^`qk_norm` must be None, 'head', 'per_head' or 'all'\. Received: qk_norm='layer'$"),
    "qk_norm_type": ({"qk_norm_type": "rmsnorm"}, r"^`qk_norm_type` must be 'rms' or 'layer'\. Received: qk_norm_type='rmsnorm'$"),
    "qk_norm_type_none": ({"qk_norm": "head", "qk_norm_type": None}, r"Received: qk_norm_type=None$"),
    "qk_norm_bias": ({"qk_norm_bias": 1}, r"^`qk_norm_bias` must be True or False\. Received: qk_norm_bias=1$"),
    "first_named_window_before_chunk": ({"window": 0, "attention_chunk_size": 0}, r"^`window`"),
    "first_named_chunk_before_rope_theta": ({"attention_chunk_size": 0, "rope_theta": -1.0}, r"^`attention_chunk_size`"),
    "first_named_rope_scaling_before_sections": ({"rope_scaling": {}, "rope_sections": 0}, r"^`rope_scaling`"),
    "first_named_sections_before_qk_norm": ({"rope_sections": 0, "qk_norm": "x"}, r"^`rope_sections`"),
    "first_named_qk_norm_type_before_clip": ({"qk_norm_type": "x", "clip_qkv": 0}, r"^`qk_norm_type`"),
    "first_named_clip_before_flags": ({"clip_qkv": 0, "qk_norm_bias": 1}, r"^`clip_qkv`"),
    "first_named_qk_norm_bias_before_sinks": ({"qk_norm_bias": 1, "sinks": 1}, r"^`qk_norm_bias`"),
    "first_named_rope_interleaved_before_qk_norm_bias": ({"rope_interleaved": 1, "qk_norm_bias": 1}, r"^`rope_interleaved`"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(NEW_CONSTRUCTOR_ERRORS))
def test_new_constructor_errors(name):
    config, pattern = NEW_CONSTRUCTOR_ERRORS[name]
    with pytest.raises(ValueError, match=pattern):
        MultiHeadAttention(E, N, head_dim=H, **config)


def test_rope_sections_without_rope_are_only_type_checked():
    assert MultiHeadAttention(E, N, head_dim=H, rope_sections=(5, 7)).rope_sections == (5, 7)


@pytest.mark.parametrize(
    "positions",
    [
        torch.arange(4),
        torch.zeros(2, 2, 3, dtype=torch.long),
        torch.zeros(3, 2, 3),
        torch.zeros(3, 1, 3, dtype=torch.long),
    ],
    ids=["length", "rows", "float", "batch"],
)
def test_positions_with_rope_sections_errors(positions):
    layer = MultiHeadAttention(E, N, head_dim=H, rope_theta=10.0, rope_sections=(1, 2, 1))
    pattern = re.escape(
        "`positions` must be an integer tensor of shape (B, T), (T,) or (3, B, T) with B=2, T=3 (one row per section "
        f"of `rope_sections`). Received: positions.shape={tuple(positions.shape)}, "
        f"positions.dtype={str(positions.dtype).removeprefix('torch.')}"
    )
    with pytest.raises(ValueError, match="^" + pattern + "$"):
        layer(X, positions=positions)
    plain = MultiHeadAttention(E, N, head_dim=H, rope_theta=10.0)
    with pytest.raises(ValueError, match=r"^`positions` must be an integer tensor of shape \(B, T\) or \(T,\) with"):
        plain(X, positions=torch.zeros(3, 2, 3, dtype=torch.long))


def test_torch_export_with_the_new_variants():
    layer = _layer(**NEW_VARIANTS["everything_new"])
    x, keep, _ = _inputs()
    _assert_exports(layer, x, keep[:, 0, 0], _new_positions(layer)["positions"])  # (2, B, T): M-RoPE's rows


@pytest.mark.parametrize("qk_norm", ["per_head", "head"])
def test_tensor_parallel_refuses_per_head_scales_it_cannot_split(qk_norm):
    """A rank holding 2 of 4 query heads (and 1 of 2 key/value heads) cannot tell which heads'
    scales are its own: `qk_norm='per_head'` is refused as 'all' is; 'head' (shared) splits."""
    layer = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, qk_norm=qk_norm)
    q, k = torch.zeros(1, N // 2, 3, H), torch.zeros(1, K // 2, 3, H)
    if qk_norm == "head":
        Multi_Head_Attention._check_local_heads(layer, q, k, None, None)
        return
    with pytest.raises(ValueError, match=r"^`sinks` and `qk_norm='all'` hold numbers of every head .*'per_head'"):
        Multi_Head_Attention._check_local_heads(layer, q, k, None, None)


# ---------------------------------------------------------------------------------------------
# Multi-head latent attention (MLA): compile, export, meta device, the modules, the decode paths.

MLA = {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 6, "q_lora_rank": 6}
MLA_VARIANTS = {**MLA, "rope_theta": 100.0, "rope_interleaved": True, "window": 4, "sinks": True}


@pytest.mark.parametrize("absorb", [None, False, True])
def test_mla_decoding_compiles_fullgraph_and_exports_equal_to_the_full_pass(absorb):
    """The latent cache through torch.compile(fullgraph=True) (one graph per T) and torch.export
    of a step, on the path `absorb_latents` picks (None: absorbed at T <= 8), equal to the full pass."""
    layer = _layer(**MLA_VARIANTS)
    layer.absorb_latents = absorb
    x = _randn(2, 6, E, seed=60)
    key_mask = torch.ones(2, 6, dtype=torch.bool)
    key_mask[1, :2] = False  # left padding

    def step(x, key_mask, cache):
        return layer(x, key_mask=key_mask, causal=True, cache=cache)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    cache = layer.init_cache(2, 8)
    assert (cache.key.shape, cache.value.shape) == ((2, 1, 8, 8), (2, 1, 8, 4))  # (B, 1, L, C), (B, 1, L, Hr)
    with torch.no_grad():
        outputs = []
        for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6)):
            output, cache = compiled(x[:, start:stop], key_mask[:, start:stop], cache)
            outputs.append(output)
        expected = layer(x, key_mask=key_mask, causal=True)
        program = torch.export.export(_Step(layer), (x[:, :3], key_mask[:, :3], *layer.init_cache(2, 8)[:4]))
        exported, index = program.module()(x[:, :3], key_mask[:, :3], *layer.init_cache(2, 8)[:4])
    torch.testing.assert_close(torch.cat(outputs, 1), expected, atol=OUTPUT_TOL, rtol=0)
    torch.testing.assert_close(exported, expected[:, :3], atol=OUTPUT_TOL, rtol=0)
    assert int(index) == 3


class _Step(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.attention = layer

    def forward(self, x, key_mask, key, value, keep, index):
        output, cache = self.attention(x, key_mask=key_mask, causal=True, cache=KVCache(key, value, keep, index))
        return output, cache.index


def test_mla_modules_meta_device_and_to_torch():
    """The projections are `nn.Linear` modules named after the layout (weight = kernel^T), the
    latents' norms parameters; a meta layer made real by to_empty and reset_parameters equals one
    built on the CPU; nn.MultiheadAttention cannot hold MLA."""
    layer = _layer(**MLA)
    assert {name for name, _ in layer.named_children()} == {
        "query_a",
        "query_b",
        "key_value_a",
        "key_value_b",
        "output",
    }
    assert tuple(layer.key_value_b.weight.shape) == (K * 10, 8) and tuple(layer.key_value_a_norm.shape) == (8,)
    assert set(layer.export_weights()) == {
        *(f"{kind}_{part}" for kind in ("query_a", "query_b", "key_value_a", "key_value_b", "output")
          for part in ("kernel", "bias")),
        "query_a_norm", "key_value_a_norm",
    }  # fmt: skip
    meta = MultiHeadAttention(E, N, **MLA, device="meta")
    assert meta(torch.empty(2, 3, E, device="meta")).shape == (2, 3, E)
    real = meta.to_empty(device="cpu")
    real.reset_parameters()
    assert all(torch.isfinite(p).all() for p in real.parameters())
    with pytest.raises(ValueError, match=r"cannot hold .*Received: .*kv_lora_rank=8"):
        MultiHeadAttention(16, 4, kv_lora_rank=8, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=4).to_torch()


def test_mla_absorbed_equals_expanded_with_gradients():
    """Forced absorbed without a cache: outputs, weights and every parameter's gradient equal the
    expanded path's (the up-projection folded into q and the output)."""
    layer = _layer(**MLA_VARIANTS, bias=True, softcap=3.0)
    x = _randn(2, 5, E, seed=61)
    results = {}
    for absorb in (False, True):
        layer.absorb_latents = absorb
        layer.zero_grad()
        output, weights = layer(x, causal=True, return_attention=True)
        output.square().sum().backward()
        results[absorb] = (output, weights, {name: p.grad.clone() for name, p in layer.named_parameters()})
    torch.testing.assert_close(results[True][0], results[False][0], atol=OUTPUT_TOL, rtol=0)
    torch.testing.assert_close(results[True][1], results[False][1], atol=WEIGHTS_TOL, rtol=0)
    for name, grad in results[False][2].items():
        torch.testing.assert_close(results[True][2][name], grad, atol=GRADS_TOL, rtol=0, msg=name)
