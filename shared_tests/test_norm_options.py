"""The output norm (`output_norm`) and QK-norm after RoPE (`qk_norm_after_rope`), docs/SPEC.md: the output
norm's weights in the portable layout of the four files (with MLA too), their initial values, `get_config` and a
`.keras` file round trip, the NumPy oracle's value of a row with no key; `qk_norm_after_rope` changes the output
only where QK-norm and RoPE are on, and is refused with the sharing options; and the porters' reading of a module's
norms (`interop/hf/norms.py`): the output norm applied to the merged heads right before the output projection,
HunYuan's QK-norms after RoPE. The parity table's `output_norm_layer_gated`, `qk_norm_all` and `qk_norm_after_rope`
compare the four files on every path, `decode_qk_norm_layer` and `decode_qk_norm_after_rope` decoding (the Keras
file on the TensorFlow backend here; test_keras.py runs the case table on the others)."""

import numpy as np
import pytest

from NumPy import MultiHeadAttention as NumpyMultiHeadAttention
from shared_tests.calling import layer_classes
from shared_tests.cases import TOLERANCES

FLOAT64_TOL = 1e-12
OUTPUT_TOL = TOLERANCES["float32"]["output"]
MLA = {"kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 3}
LAYOUTS = {  # constructor arguments: the output norm's weights and their (N*Hv,) shape, N = 2
    "rms": ({"output_norm": "rms"}, {"context_norm": (8,)}),
    "layer": ({"output_norm": "layer"}, {"context_norm": (8,), "context_norm_bias": (8,)}),
    "layer_gated_gqa": (
        {"output_norm": "layer", "gate": True, "num_kv_heads": 1},
        {"context_norm": (8,), "context_norm_bias": (8,)},
    ),
    "rms_mla": ({"output_norm": "rms", **MLA}, {"context_norm": (6,)}),
    "none": ({"output_norm_eps": 1e-3}, {}),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_weights_come_last_in_the_layout_starting_at_one_and_zero(name):
    kwargs, expected = LAYOUTS[name]
    plain = NumpyMultiHeadAttention(8, 2, **{k: v for k, v in kwargs.items() if not k.startswith("output_norm")})
    for framework, cls in layer_classes().items():
        layer = cls(8, 2, **kwargs)
        shapes = layer.weight_shapes()
        assert list(shapes)[len(shapes) - len(expected) :] == list(expected), framework
        assert {name: shapes[name] for name in expected} == expected, framework
        assert list(shapes)[: len(shapes) - len(expected)] == list(plain.weight_shapes()), framework
        weights = layer.export_weights()
        assert all((weights[name] == (1.0 if name == "context_norm" else 0.0)).all() for name in expected), framework


@pytest.mark.parametrize("framework", ["tf", "keras"])
def test_config_round_trip(framework):
    cls = layer_classes()[framework]
    layer = cls(8, 2, output_norm="layer", output_norm_eps=1e-5)
    config = layer.get_config()
    assert (config["output_norm"], config["output_norm_eps"]) == ("layer", 1e-5)
    clone = cls.from_config(config)
    assert clone.get_config() == config and clone.weight_shapes() == layer.weight_shapes()


def test_keras_file_round_trip(tmp_path):
    import keras

    from Keras import MultiHeadAttention

    x = np.random.default_rng(0).normal(size=(2, 3, 8)).astype(np.float32)
    inputs = keras.Input((None, 8))
    layer = MultiHeadAttention(8, 2, output_norm="layer", gate=True)
    model = keras.Model(inputs, layer(inputs, causal=True))
    weights = layer.export_weights()
    rng = np.random.default_rng(1)
    layer.import_weights({name: value + rng.normal(size=value.shape) * 0.3 for name, value in weights.items()})
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(np.asarray(loaded(x)), np.asarray(model(x)), atol=OUTPUT_TOL, rtol=0)
    assert loaded.layers[1].get_config() == model.layers[1].get_config()


def test_a_row_with_no_key_gives_the_norm_bias_through_the_output_projection():
    """Merged heads of 0 (a row with no key) normalize to `context_norm_bias`, never NaN."""
    layer = NumpyMultiHeadAttention(8, 2, output_norm="layer", seed=0)
    rng = np.random.default_rng(2)
    layer.import_weights({name: value + rng.normal(size=value.shape) for name, value in layer.params.items()})
    keep = np.array([[True] * 3, [False] * 3])  # (B, S): the second sequence keeps no key
    output = layer(rng.normal(size=(2, 3, 8)), key_mask=keep)
    p = layer.params
    expected = p["context_norm_bias"] @ p["output_kernel"] + p["output_bias"]  # (E,)
    np.testing.assert_allclose(output[1], np.broadcast_to(expected, (3, 8)), atol=FLOAT64_TOL, rtol=0)


def _modules():
    import torch
    from torch import nn

    class Attention(nn.Module):
        """The Llama kind's names with a norm of its merged heads (`attn_sub_norm`), as BitNet's."""

        def __init__(self, norm):
            super().__init__()
            self.o_proj, self.attn_sub_norm = nn.Linear(8, 8), norm

        def forward(self, attn_output):
            attn_output = self.attn_sub_norm(attn_output)
            attn_output = self.o_proj(attn_output)
            return attn_output

    class Before(Attention):
        def forward(self, attn_output):
            attn_output = self.o_proj(attn_output)
            attn_output = self.attn_sub_norm(attn_output)
            return attn_output

    class Offset(nn.Module):
        """Gemma's RMSNorm: x / rms(x) * (1 + weight)."""

        def __init__(self):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.full((8,), 0.5)), 1e-5

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    return Attention, Before, Offset, nn


def _refuse(what):
    raise ValueError(what)


def test_the_porter_reads_the_norm_class_and_eps():
    from interop.hf.norms import _output_norm_options, _with_output_norm

    attention, _, offset, nn = _modules()
    name, options = _output_norm_options(attention(nn.LayerNorm(8, eps=1e-5, bias=False)), _refuse, "o_proj")
    assert (name, options) == ("attn_sub_norm", {"output_norm": "layer", "output_norm_eps": 1e-5, "norm_offset": False})
    kwargs, weights = _with_output_norm({}, {}, {"attn_sub_norm.weight": np.full(8, 2.0)}, name, options)
    assert kwargs == {"output_norm": "layer", "output_norm_eps": 1e-5}
    assert (weights["context_norm"] == 2.0).all() and (weights["context_norm_bias"] == 0.0).all()  # no bias: zeros
    module = attention(offset())
    name, options = _output_norm_options(module, _refuse, "o_proj")
    assert options == {"output_norm": "rms", "output_norm_eps": 1e-5, "norm_offset": True}
    tensors = {f"attn_sub_norm.{n}": p.detach().numpy() for n, p in module.attn_sub_norm.named_parameters()}
    assert (_with_output_norm({}, {}, tensors, name, options)[1]["context_norm"] == 1.5).all()  # 1 + weight


def test_the_porter_refuses_a_norm_applied_elsewhere_or_of_another_class():
    from interop.hf.norms import _output_norm_options

    attention, before, _, nn = _modules()
    with pytest.raises(ValueError, match=r"^applies `attn_sub_norm` elsewhere than to its merged heads right before"):
        _output_norm_options(before(nn.LayerNorm(8)), _refuse, "o_proj")
    with pytest.raises(ValueError, match=r"^normalizes its merged heads with GroupNorm \(`attn_sub_norm`\)"):
        _output_norm_options(attention(nn.GroupNorm(2, 8)), _refuse, "o_proj")


@pytest.mark.parametrize("framework", ["numpy", "torch", "tf", "keras"])
def test_qk_norm_after_rope_acts_only_with_qk_norm_and_rope(framework):
    cls = layer_classes()[framework]
    x = np.random.default_rng(3).normal(size=(2, 4, 8)).astype(np.float32)
    rng = np.random.default_rng(4)
    for options, changes in (
        ({"qk_norm": "head", "rope_theta": 100.0}, True),
        ({"qk_norm": "head"}, False),
        ({"rope_theta": 100.0}, False),
    ):
        before, after = cls(8, 2, **options), cls(8, 2, qk_norm_after_rope=True, **options)
        weights = {name: value + rng.normal(size=value.shape) for name, value in before.export_weights().items()}
        before.import_weights(weights)
        after.import_weights(weights)
        outputs = [np.asarray(_numpy(layer(_tensor(framework, x), causal=True))) for layer in (before, after)]
        assert bool(np.abs(outputs[0] - outputs[1]).max() > 0.01) is changes, (framework, options)


def test_qk_norm_after_rope_is_refused_with_the_sharing_options():
    for framework, cls in layer_classes().items():
        with pytest.raises(ValueError, match=r"^`qk_norm_after_rope` must be False with `kv_shared`, `keys_as_values`"):
            cls(8, 2, qk_norm="head", rope_theta=100.0, value_norm=True, qk_norm_after_rope=True)
        assert cls(8, 2, value_norm=True, qk_norm_after_rope=True).qk_norm_after_rope, (
            framework
        )  # no QK-norm: no effect


def _tensor(framework, x):
    if framework == "torch":
        import torch

        return torch.from_numpy(x)
    return x


def _numpy(y):
    return y.detach().numpy() if hasattr(y, "detach") else y


def test_the_porter_reads_hunyuans_qk_norms_and_their_order():
    from interop.hf.norms import _renamed_qk_norms, _renamed_tensors

    _, _, _, nn = _modules()

    class After(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.query_layernorm, self.key_layernorm = nn.Linear(8, 8), nn.Identity(), nn.Identity()

        def forward(self, q, k, cos, sin):
            q, k = apply_rotary_pos_emb(q, k, cos, sin)  # noqa: F821 (read as text, never run)
            return self.query_layernorm(q), self.key_layernorm(k)

    class Before(After):
        def forward(self, q, k, cos, sin):
            q, k = self.query_layernorm(q), self.key_layernorm(k)
            return apply_rotary_pos_emb(q, k, cos, sin)  # noqa: F821

    for cls, after in ((After, True), (Before, False)):
        module = cls()
        children, late = _renamed_qk_norms(module, dict(module.named_children()))
        assert (sorted(children), late) == (["k_norm", "q_norm", "q_proj"], after)
    assert _renamed_qk_norms(module, {"q_norm": None}) == ({"q_norm": None}, False)
    assert list(_renamed_tensors({"query_layernorm.weight": 1, "key_layernorm.weight": 2, "sinks": 3})) == [
        "q_norm.weight", "k_norm.weight", "sinks",
    ]  # fmt: skip


def test_a_pre_ln_bert_attention_ports_the_attention_of_its_normalized_input():
    """RoBERTa-PreLayerNorm's attention is its LayerNorm, BERT's attention and the residual: `port_attention`
    ports the attention, so the module's output is x + layer(LayerNorm(x)) (dropout off)."""
    import torch

    from interop.hf import port_attention
    from shared_tests import hf_tiny

    model = hf_tiny.tiny_model("roberta_prelayernorm")
    module = next(m for m in model.modules() if type(m).__name__ == "RobertaPreLayerNormAttention")
    kwargs, weights = port_attention(module, model.config)
    layer = NumpyMultiHeadAttention(**kwargs)
    layer.import_weights(weights)
    x = torch.randn(2, 5, kwargs["d_model"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, normed = module(x)[0].numpy(), module.LayerNorm(x).double().numpy()
    np.testing.assert_allclose(x.double().numpy() + layer(normed), expected, atol=OUTPUT_TOL, rtol=0)


def test_a_pre_ln_module_with_another_forward_is_not_read():
    import torch

    from interop.hf.norms import _input_norm, _pre_ln_forwards
    from shared_tests import hf_tiny

    model = hf_tiny.tiny_model("xlm_roberta_xl")
    module = next(m for m in model.modules() if type(m).__name__ == "XLMRobertaXLAttention")
    assert _input_norm(module) == "self_attn_layer_norm" and _pre_ln_forwards(module, "self_attn_layer_norm")

    class Scaled(type(module)):
        def forward(self, hidden_states, attention_mask=None, **kwargs):
            intermediate = self.self_attn_layer_norm(hidden_states) * 2.0
            attention_output, attn_weights = self.self(intermediate, attention_mask=attention_mask, **kwargs)
            return self.output(attention_output, hidden_states), attn_weights

    module.__class__ = Scaled
    assert not _pre_ln_forwards(module, "self_attn_layer_norm")
    assert _input_norm(torch.nn.Module()) is None
