"""The model comparison (`make parity ARGS="--model FILE.py"`, shared_tests/model_parity.py).

The example pairs pass; each divergence a user may plant between a PyTorch model and its Keras
rebuild, planted in block 1 of examples/blocks_pair.py's three-block decoder, is named at its
own layer, with every layer before it passing; pair files and models that cannot be compared
are ValueErrors naming what was expected and received. Keras runs on TensorFlow in this process
(one test starts a torch-backend process)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pathlib import Path

import numpy as np
import pytest

from shared_tests import model_parity, parity

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = ROOT / "examples" / "blocks_pair.py"
LOOKUP = ROOT / "examples" / "lookup_pair.py"
LLAMA = ROOT / "examples" / "llama_pair.py"


@pytest.fixture(scope="module")
def blocks():
    return model_parity.load_pair(BLOCKS)


def _transposed_kernel(torch_model, keras_model, inputs):
    """The weights moved, then one square Dense kernel transposed (a port that forgot torch's
    (out, in) layout), compared without moving the weights again."""
    model_parity.compare_models(torch_model, keras_model, inputs)
    kernel = keras_model.get_layer("up_1").kernel
    kernel.assign(np.asarray(kernel).T)
    return model_parity.compare_models(torch_model, keras_model, inputs, move=False)


# (name, block_options of build_keras, a function planting after the build or None, the first failing row)
PLANTED = [
    ("layer_norm_epsilon", {1: {"epsilon": 1e-3}}, None, ("blocks.1.norm1", "norm1_1")),
    ("transposed_dense_kernel", None, _transposed_kernel, ("blocks.1.up", "up_1")),
    ("causal_forgotten", {1: {"causal": False}}, None, ("blocks.1.attention", "attention_1")),
    ("gelu_approximation", {1: {"approximate": True}}, None, ("blocks.1.act", "gelu_1")),
    # block 1's attention relies on the implicit mask, which the Keras `Add` of the embeddings dropped (the README's pitfall)
    ("padding_mask_lost", {1: {"key_mask": False}}, None, ("blocks.1.attention", "attention_1")),
]


def test_the_blocks_example_passes_layer_by_layer(blocks):
    torch_model = blocks.build_torch().eval()
    report = model_parity.compare_models(torch_model, blocks.build_keras(), (blocks.example_inputs(),))
    assert report.passed, model_parity.format_report(report)
    assert len(report.rows) == 4 + 6 * blocks.BLOCKS  # 2 embeddings, 6 layers a block, norm and head
    assert report.verdict == "" and report.notes == []


@pytest.mark.parametrize(("name", "options", "plant", "expected"), PLANTED, ids=[p[0] for p in PLANTED])
def test_a_planted_divergence_is_named_at_its_layer(blocks, name, options, plant, expected):
    torch_model, keras_model = blocks.build_torch().eval(), blocks.build_keras(options)
    inputs = (blocks.example_inputs(),)
    run = plant or model_parity.compare_models
    report = run(torch_model, keras_model, inputs)
    table = model_parity.format_report(report)
    failing = [index for index, row in enumerate(report.rows) if not row.passed]
    assert failing, table
    first = report.rows[failing[0]]
    assert (first.torch_name, first.keras_name) == expected, table
    assert failing[0] == 2 + 6 + [row.torch_name for row in report.rows[8:14]].index(expected[0]), table  # block 1
    assert "the layer itself differs" in report.verdict, table
    assert f"PyTorch '{expected[0]}' / Keras '{expected[1]}'" in report.verdict
    assert not report.passed and not report.output.passed


def test_a_layer_that_only_receives_a_difference_is_not_named(blocks, monkeypatch):
    """With the GELUs not paired (a Keras model without activation layers would do the same),
    the approximate GELU shows first at the Linear after it, which agrees when run alone: the
    verdict names the gap between the two paired layers, not the Linear."""
    torch_model, keras_model = blocks.build_torch().eval(), blocks.build_keras({1: {"approximate": True}})
    original = model_parity.pair_units

    def without_activations(torch_order, keras_order, weight_map=None):
        keras_order = [(unit, index) for unit, index in keras_order if unit.kind != "activation"]
        return original(torch_order, keras_order, weight_map)

    monkeypatch.setattr(model_parity, "pair_units", without_activations)
    report = model_parity.compare_models(torch_model, keras_model, (blocks.example_inputs(),))
    assert "activations not compared on their own" in report.notes[0]
    assert "PyTorch 'blocks.1.down' / Keras 'down_1'" in report.verdict
    assert "it agrees" in report.verdict and "after layer 11 ('blocks.1.up')" in report.verdict


def test_the_command_prints_the_table_and_its_status(capsys):
    """`make parity ARGS="--model examples/lookup_pair.py"`: float32 and float64, the gradients."""
    assert parity.main(["--model", str(LOOKUP), "--keras", "tensorflow,jax,torch", "--grad"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS: 4 paired layers, the output and the gradients of 13 weights agree") == 2
    assert "inputs 'inputs', float32" in out and "inputs 'inputs', float64" in out
    assert "2   attention                   attention                   attention" in out


def test_the_command_runs_the_keras_file_on_another_backend_in_a_process(capfd):
    assert model_parity.main([str(BLOCKS), "--keras", "torch", "--dtype", "float32"]) == 0
    out = capfd.readouterr().out
    assert "Keras on torch" in out and "PASS: 22 paired layers and the output agree" in out


def test_a_failure_exits_1(tmp_path, capsys):
    planted = tmp_path / "planted_pair.py"
    planted.write_text(
        f"import sys\nsys.path.insert(0, {str(BLOCKS.parent)!r})\n"
        "from blocks_pair import build_keras as build, build_torch, example_inputs\n\n\n"
        "def build_keras():\n    return build({0: {'causal': False}})\n"
    )
    assert model_parity.main([str(planted), "--dtype", "float32"]) == 1
    assert "first failing layer: layer 4, PyTorch 'blocks.0.attention'" in capsys.readouterr().out


def test_a_missing_pair_file_is_an_error_with_status_2(capsys):
    assert parity.main(["--model", "no_such_pair.py"]) == 2
    assert (
        "error: --model takes a Python file defining build_torch, build_keras, example_inputs. Received: no_such_pair.py (no such file)"
        in capsys.readouterr().err
    )


def _lookup_models():
    pair = model_parity.load_pair(LOOKUP)
    return pair.build_torch().eval(), pair.build_keras(), (pair.example_inputs(),)


def test_layers_that_cannot_be_paired_are_named():
    import keras

    torch_model, _, inputs = _lookup_models()
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(torch_model.embed.num_embeddings, 64, name="embed")(tokens)
    keras_model = keras.Model(tokens, keras.layers.Dense(16, name="logits")(x))  # no attention, no hidden
    with pytest.raises(
        ValueError,
        match=r"the PyTorch model runs 4 \(embed \(Embedding\), attention \(MultiHeadAttention\), hidden \(Linear\), logits \(Linear\)\), the Keras model 2 \(embed \(Embedding\), logits \(Dense\)\)",
    ):
        model_parity.compare_models(torch_model, keras_model, inputs)


def test_layers_of_other_kinds_or_shapes_are_named():
    import keras

    torch_model, _, inputs = _lookup_models()
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(torch_model.embed.num_embeddings, 64)(tokens)
    x = keras.layers.Dense(64, name="not_attention")(x)
    x = keras.layers.Dense(64, name="hidden")(x)
    keras_model = keras.Model(tokens, keras.layers.Dense(16, name="logits")(x))
    with pytest.raises(
        ValueError,
        match=r"at layer 2 in execution order: PyTorch attention \(MultiHeadAttention\) has query_kernel \(64, 64\), .*; Keras not_attention \(Dense\) has kernel \(64, 64\), bias \(64,\)",
    ):
        model_parity.compare_models(torch_model, keras_model, inputs)


def test_weights_it_cannot_move_are_named():
    import torch

    torch_model, keras_model, inputs = _lookup_models()
    torch_model.scale = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(
        ValueError, match=r"the PyTorch model holds weights the comparison cannot move: 'scale' of LookupModel \(3,\)"
    ):
        model_parity.compare_models(torch_model, keras_model, inputs)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "def build_torch(): pass\n",
            r"must define build_torch\(\), build_keras\(\), example_inputs\(\). Received: pair.py without build_keras, example_inputs",
        ),
        (
            "def build_torch(): pass\ndef build_keras(): pass\ndef example_inputs(): return [1, 2]\n",
            r"example_inputs\(\) must give NumPy arrays. Received: int, int in set 'inputs'",
        ),
    ],
    ids=["missing_functions", "inputs_not_arrays"],
)
def test_a_pair_file_that_does_not_fit_is_named(tmp_path, text, message):
    path = tmp_path / "pair.py"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        model_parity.input_sets(model_parity.load_pair(path))


def test_conv1d_rms_norm_and_activation_layers_move_and_pair():
    """Conv1d's (out, in, k) weight and (B, C, T) layout, RMSNorm's scale, ReLU module and layer."""
    import keras
    import torch
    from torch import nn

    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.norm = nn.Conv1d(4, 8, 3, padding=1), nn.RMSNorm(8, eps=1e-6)
            self.act, self.out = nn.ReLU(), nn.Linear(8, 2)

        def forward(self, x):  # (B, T, C)
            return self.out(self.act(self.norm(self.conv(x.transpose(1, 2)).transpose(1, 2))))

    x = keras.Input((5, 4))
    h = keras.layers.RMSNormalization(epsilon=1e-6, name="norm")(
        keras.layers.Conv1D(8, 3, padding="same", name="conv")(x)
    )
    keras_model = keras.Model(x, keras.layers.Dense(2, name="out")(keras.layers.ReLU(name="act")(h)))
    torch.manual_seed(0)
    inputs = (np.random.default_rng(0).standard_normal((2, 5, 4)).astype(np.float32),)
    report = model_parity.compare_models(Conv().eval(), keras_model, inputs)
    assert report.passed, model_parity.format_report(report)
    assert [(row.keras_name, row.kind) for row in report.rows] == [
        ("conv", "Conv1d"), ("norm", "RMSNorm"), ("act", "activation"), ("out", "Linear/Dense")
    ]  # fmt: skip


def test_weight_map_pairs_by_name_and_the_rest_by_order():
    torch_model, keras_model, inputs = _lookup_models()
    report = model_parity.compare_models(torch_model, keras_model, inputs, weight_map={"logits": "logits"})
    assert report.passed and [row.keras_name for row in report.rows] == ["embed", "attention", "hidden", "logits"]


def test_weight_map_must_name_layers_that_run():
    torch_model, keras_model, inputs = _lookup_models()
    with pytest.raises(
        ValueError,
        match=r"weight_map\(\) must name PyTorch modules and Keras layers that run. Received: hidden -> nowhere",
    ):
        model_parity.compare_models(torch_model, keras_model, inputs, weight_map={"hidden": "nowhere"})


def test_port_llamas_rebuilds_agree_at_their_outputs(capsys):
    """KerasLlama is a plain class of Keras layers: the outputs only, with a note that says so."""
    assert model_parity.main([str(LLAMA)]) == 0
    out = capsys.readouterr().out
    assert "note: the Keras model is not a Keras Model or Layer (KerasPrefill): compared at its outputs only" in out
    assert "PASS: the output agrees" in out and "float64" not in out  # the file runs float32 only


def test_a_subclassed_keras_model_is_compared_layer_by_layer():
    import keras

    torch_model, functional, inputs = _lookup_models()

    class Lookup(keras.Model):
        def __init__(self):
            super().__init__()
            self.embed, self.attention = functional.get_layer("embed"), functional.get_layer("attention")
            self.hidden, self.logits = functional.get_layer("hidden"), functional.get_layer("logits")

        def call(self, tokens, training=False):
            x = self.embed(tokens)
            return self.logits(self.hidden(keras.layers.Add()([x, self.attention(x)])))

    report = model_parity.compare_models(torch_model, Lookup(), inputs)
    assert report.passed and [row.keras_name for row in report.rows] == ["embed", "attention", "hidden", "logits"]
