"""int8 layers (docs/SPEC.md, "int8"): one scheme and one portable layout in the four files.

A layer quantized in any framework, exported and imported into every other, gives the NumPy
reference's numbers within one quantization step (shared_tests/int8.py), and the Keras layers
(the TensorFlow file here; the Keras file on each backend in the process of
shared_tests/test_keras.py, which runs its int8 checks beside the float ones) quantize as the
built-in does (`model.quantize("int8")`, `.keras` save and load). Kept apart from the parity
report: the int8 layers have no gradient to compare (the NumPy reference has no int8 backward).
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
import torch
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

from NumPy import Multi_Head_Attention as numpy_file
from PyTorch import Multi_Head_Attention as torch_file
from shared_tests import runtimes
from shared_tests.call_args import call_inputs
from shared_tests.calling import set_path
from shared_tests.cases import CASES_BY_NAME, MLA_CASES, make_data
from shared_tests.int8 import CASE_NAMES, FLOAT32, INT8_ERROR, assert_within_a_step, one_step
from TensorFlow import Multi_Head_Attention as tf_file

SOURCES = ("numpy", "torch", "tf")
PATHS = ("numpy", "torch:sdpa", "torch:explicit", "tf:eager", "tf:function")
LAYERS = {"numpy": numpy_file.MultiHeadAttention, "torch": torch_file.MultiHeadAttention}


def _float_layer(framework, case, weights):
    layer_class = tf_file.MultiHeadAttention if framework == "tf" else LAYERS[framework]
    layer = layer_class(**case.config)
    layer.import_weights(weights)
    return layer


def _quantized_export(source, case, data):
    layer = _float_layer(source, case, data["weights"])
    layer.quantize("int8")
    return layer.export_weights()


def _call(path, layer, case, data):
    """The int8 layer's output (and weights where the path returns them) as float64 arrays."""
    framework = path.split(":")[0]
    inputs = {name: data[name] for name in ("key", "value") if data[name] is not None}
    kwargs = {**call_inputs(data), "causal": case.causal}
    if framework == "numpy":
        return layer(data["query"], **inputs, **kwargs, return_attention=True)[0]
    if framework == "torch":
        as_tensor = {name: torch.as_tensor(x) for name, x in {**inputs, **call_inputs(data)}.items()}
        with torch.no_grad():
            result = layer(torch.as_tensor(data["query"]), **as_tensor, causal=case.causal)
            if path == "torch:explicit":
                result = layer(torch.as_tensor(data["query"]), **as_tensor, causal=case.causal, return_attention=True)[
                    0
                ]
        return result.double().numpy()

    def call(query, *values):
        return layer(query, **dict(zip(inputs, values, strict=True)), **kwargs)

    call = tf.function(call) if path == "tf:function" else call
    return np.asarray(call(data["query"], *inputs.values()).numpy(), dtype=np.float64)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_every_file_quantizes_to_the_same_layout(name):
    """From the same float weights, the three files give the same int8 integers and scales."""
    case = CASES_BY_NAME[name]
    data = make_data(case)
    layouts = {framework: _quantized_export(framework, case, data) for framework in SOURCES}
    for framework, layout in layouts.items():
        assert layout.keys() == layouts["numpy"].keys()
        for layout_name, value in layout.items():
            if layout_name.endswith(("_kernel", "_kernel_scale")):
                np.testing.assert_array_equal(
                    value, layouts["numpy"][layout_name], err_msg=f"{framework} {layout_name}"
                )
                assert value.dtype == layouts["numpy"][layout_name].dtype


LITERT_REFUSED = {  # int8 cases the LiteRT interpreter cannot hold, with shared_tests/runtimes.py's reason
    name: runtimes.skip_reason(CASES_BY_NAME[name], "tf:litert")
    for name in CASE_NAMES
    if runtimes.skip_reason(CASES_BY_NAME[name], "tf:litert") is not None
}


def test_litert_int8_leaves_out_only_zero_size_tensors():
    assert LITERT_REFUSED == {"empty_query": "the LiteRT interpreter refuses zero-size tensors (Invalid tensor size)"}


@pytest.mark.parametrize("name", [name for name in CASE_NAMES if name not in LITERT_REFUSED])
def test_litert_runs_the_int8_layer(name):
    """The TensorFlow file's int8 layer in a `tf.function`, converted by the default TFLite
    converter (builtin ops) and run in LiteRT: the reference's output within one quantization
    step (every int8 case but those in `LITERT_REFUSED`)."""
    case = CASES_BY_NAME[name]
    data = make_data(case)
    layout = _quantized_export("numpy", case, data)
    reference = _float_layer("numpy", case, layout)
    expected = _call("numpy", reference, case, data)
    (output,) = runtimes.run_tf_litert(case, data, lambda case, data: _float_layer("tf", case, layout), False)
    assert_within_a_step(output, expected, one_step(reference), "tf:litert")


def test_litert_int8_file_holds_int8_kernels():
    """The converted int8 layer keeps its kernels int8 in the flatbuffer (cast to float32 at run
    time): at E = 256 the file is under a third of the float layer's."""
    from ai_edge_litert.interpreter import Interpreter

    x = np.random.default_rng(3).normal(size=(2, 16, 256)).astype(np.float32)
    models = {}
    for mode in ("float", "int8"):
        layer = tf_file.MultiHeadAttention(256, 8)
        layer(x)
        if mode == "int8":
            layer.quantize("int8")
        function = tf.function(lambda x, layer=layer: layer(x), input_signature=[tf.TensorSpec(x.shape)])
        models[mode] = runtimes.litert_model(function, layer)
    int8_elements = sum(
        int(np.prod(detail["shape"]))
        for detail in Interpreter(model_content=models["int8"]).get_tensor_details()
        if detail["dtype"] == np.int8
    )
    assert int8_elements == 4 * 256 * 256  # the four kernels
    assert len(models["int8"]) < len(models["float"]) / 3


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_quantized_anywhere_runs_the_same_everywhere(name, source):
    """Quantized in `source`, exported, imported into a float layer of every file (which the int8
    layout quantizes): the reference's output within one quantization step on every path, and
    the same layout exported again."""
    case = CASES_BY_NAME[name]
    data = make_data(case)
    layout = _quantized_export(source, case, data)
    reference = _float_layer("numpy", case, layout)
    assert reference.quantization_mode == "int8"
    expected = _call("numpy", reference, case, data)
    layers = {framework: _float_layer(framework, case, layout) for framework in ("torch", "tf")}
    for path in PATHS[1:]:
        assert_within_a_step(_call(path, layers[path.split(":")[0]], case, data), expected, one_step(reference))
    for layer in layers.values():
        exported = layer.export_weights()
        for layout_name in (name for name in layout if "kernel" in name):
            np.testing.assert_array_equal(exported[layout_name], layout[layout_name])


@pytest.mark.parametrize("framework", ("numpy", "torch", "tf"))
def test_kernel_quantization_is_keras_abs_max(framework):
    """The integers are Keras' `abs_max_quantize(kernel, axis=0)` exactly, and the scale is the
    reciprocal of Keras' (which divides by it)."""
    kernel = np.random.default_rng(0).normal(size=(24, 10)).astype(np.float32)
    kernel[:, 3] = 0.0  # an all-zero column: integers 0, scale 1e-7 / 127
    integers, keras_scale = keras.quantizers.abs_max_quantize(kernel, axis=0, to_numpy=True)
    file = {"numpy": numpy_file, "torch": torch_file, "tf": tf_file}[framework]
    quantized, scale = file._quantize_kernel(kernel)
    np.testing.assert_array_equal(quantized, np.asarray(integers))
    np.testing.assert_array_equal(scale, np.float32(1.0) / np.asarray(keras_scale)[0])
    assert quantized.dtype == np.int8 and scale.dtype == np.float32


def _keras_model(case, dtype=None):
    query = keras.Input((case.t, case.e))
    layer = tf_file.MultiHeadAttention(**case.config, dtype=dtype)
    return keras.Model(query, layer(query, causal=True)), layer


@pytest.mark.parametrize("policy", ("float32", "mixed_float16", "mixed_bfloat16"))
def test_keras_model_quantize_saves_and_loads(tmp_path, policy):
    """`model.quantize("int8")` quantizes the layer as Keras quantizes its own (int8 kernels, the
    policy int8_from_<policy>), the output is the reference's within a step (and the compute
    dtype's tolerance), and a `.keras` file keeps it. Under mixed_float16 too, which Keras' own
    layers refuse: the integer sums run in float32 (the policy is the file's
    `_Int8FromFloat16Policy`, which the `.keras` file names)."""
    case = CASES_BY_NAME["self_basic"]
    data = make_data(case)
    model, layer = _keras_model(case, policy)
    layer.import_weights(data["weights"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.quantize("int8")
    refused = [str(w.message) for w in caught if "does not have a `quantize`" in str(w.message)]
    assert refused and all("InputLayer" in message for message in refused)  # neither this layer nor its dropout
    assert layer.dtype_policy.name == f"int8_from_{policy}"
    assert {v.name: v.dtype for v in layer.weights}["output_kernel"] == "int8"
    reference = _float_layer("numpy", case, layer.export_weights())
    expected = reference(data["query"], causal=True)
    output = model(data["query"])
    assert output.dtype == layer.compute_dtype
    output = output.numpy().astype(np.float64)
    assert_within_a_step(output, expected, one_step(reference), policy, layer.compute_dtype)
    model.save(tmp_path / "int8.keras")
    loaded = keras.models.load_model(tmp_path / "int8.keras")
    np.testing.assert_array_equal(loaded(data["query"]).numpy().astype(np.float64), output)
    assert loaded.layers[-1].dtype_policy == layer.dtype_policy
    with pytest.raises(ValueError, match="already quantized"):
        loaded.layers[-1].quantize("int8")


def test_keras_layer_equals_built_in_int8():
    """The same float weights quantized in this layer and in Keras' `MultiHeadAttention` (whose
    `EinsumDense` projections quantize per output column, inputs per token): the same integers
    and the same output."""
    x = np.random.default_rng(1).normal(size=(2, 5, 16)).astype(np.float32)
    built_in = keras.layers.MultiHeadAttention(num_heads=4, key_dim=4)
    built_in(x, x)
    layer = tf_file.MultiHeadAttention.from_keras(built_in)
    projections = (built_in._query_dense, built_in._key_dense, built_in._value_dense, built_in._output_dense)
    for projection in projections:
        projection.quantize("int8")
    layer.quantize("int8")
    np.testing.assert_array_equal(layer.query_kernel.numpy(), built_in._query_dense._kernel.numpy().reshape(16, 16))
    np.testing.assert_allclose(layer(x).numpy(), built_in(x, x).numpy(), rtol=0, atol=FLOAT32)


def test_to_keras_of_an_int8_layer_is_refused_and_quantizing_the_built_in_after_computes_the_same():
    """Regression: `to_keras` of an int8 layer copied its integers into the built-in's float kernels
    (wrong numbers, no error). It now refuses; `to_keras` first, then quantizing the built-in's
    projections, gives the int8 layer's numbers (the same scheme)."""
    x = np.random.default_rng(2).normal(size=(2, 5, 16)).astype(np.float32)
    layer = tf_file.MultiHeadAttention(16, 4)
    layer(x)
    built_in = layer.to_keras()
    layer.quantize("int8")
    with pytest.raises(ValueError, match=r"`to_keras` needs float weights .* Received: quantization_mode='int8'"):
        layer.to_keras()
    for projection in (built_in._query_dense, built_in._key_dense, built_in._value_dense, built_in._output_dense):
        projection.quantize("int8")  # what `model.quantize("int8")` does to the built-in
    np.testing.assert_allclose(layer(x).numpy(), built_in(x, x).numpy(), rtol=0, atol=FLOAT32)


@pytest.mark.parametrize("framework", ("numpy", "torch", "tf"))
def test_int8_decoding_equals_the_full_pass(framework):
    """Each token is quantized on its own, so decoding one token at a time equals the full pass."""
    case = CASES_BY_NAME["causal_self"]
    data = make_data(case)
    layer = _float_layer(framework, case, data["weights"])
    layer.quantize("int8")
    convert = {"numpy": np.asarray, "torch": torch.as_tensor, "tf": tf.constant}[framework]
    with torch.no_grad():
        full = np.asarray(layer(convert(data["query"]), causal=True), dtype=np.float64)
        cache, steps = layer.init_cache(case.b, case.t), []
        for t in range(case.t):
            output, cache = layer(convert(data["query"][:, t : t + 1]), causal=True, cache=cache)
            steps.append(np.asarray(output, dtype=np.float64))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=0, atol=FLOAT32)


@pytest.mark.parametrize("framework", ("numpy", "torch", "tf"))
def test_int8_layout_checks(framework):
    """A float layout into an int8 layer and an int8 layout whose kernels are not int8 integers
    are refused, naming every problem; quantizing twice or to another mode is refused."""
    case = CASES_BY_NAME["self_basic"]
    data = make_data(case)
    layout = _quantized_export("numpy", case, data)
    layer = _float_layer(framework, case, data["weights"])
    layer.quantize("int8")
    with pytest.raises(ValueError, match=r"missing 'query_kernel_scale'.*missing 'output_kernel_scale'"):
        layer.import_weights(data["weights"])
    floats = {**layout, "key_kernel": layout["key_kernel"].astype(np.float32)}
    with pytest.raises(ValueError, match=r"'key_kernel' must hold integers in \[-127, 127\], received dtype float32"):
        _float_layer(framework, case, data["weights"]).import_weights(floats)
    with pytest.raises(ValueError, match=r"already quantized|nn.Linear modules"):
        layer.quantize("int8")
    error = NotImplementedError if framework == "tf" else ValueError  # Keras' convention: model.quantize warns
    with pytest.raises(error, match="int8"):
        _float_layer(framework, case, data["weights"]).quantize("int4")


def test_numpy_int8_backward_is_refused():
    case = CASES_BY_NAME["self_basic"]
    data = make_data(case)
    layer = _float_layer("numpy", case, data["weights"])
    layer.quantize("int8")
    layer(data["query"])
    with pytest.raises(ValueError, match=r"`backward` is defined for float weights only.*quantization_mode='int8'"):
        layer.backward(data["grad_output"])


def test_keras_refuses_another_int8_scheme():
    case = CASES_BY_NAME["self_basic"]
    layer = _float_layer("tf", case, make_data(case)["weights"])
    config = keras.quantizers.Int8QuantizationConfig(weight_quantizer=keras.quantizers.AbsMaxQuantizer(axis=0))
    with pytest.raises(ValueError, match="`config` must be Keras' default int8 config"):
        layer.quantize(config=config)


@pytest.mark.parametrize("framework", ("torch", "tf"))
def test_int8_input_gradient_goes_through_the_dequantized_kernel(framework):
    """Keras' straight-through gradient: the inputs' gradient is the float layer's with the
    dequantized kernels, within the int8 error; biases still train."""
    case = CASES_BY_NAME["self_basic"]
    data = make_data(case)
    layout = _quantized_export("numpy", case, data)
    dequantized = {
        name: value * layout[f"{name}_scale"] if name.endswith("_kernel") else value
        for name, value in layout.items()
        if not name.endswith("_scale")
    }
    grads = []
    for weights in (layout, dequantized):
        layer = _float_layer(framework, case, weights)
        if framework == "torch":
            x = torch.tensor(data["query"], requires_grad=True)
            (layer(x) * torch.as_tensor(data["grad_output"])).sum().backward()
            grads.append(x.grad.numpy())
            assert layer.output.bias.grad is not None
        else:
            x = tf.constant(data["query"])
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(layer(x) * data["grad_output"])
            grads.append(tape.gradient(loss, x).numpy())
    np.testing.assert_allclose(grads[0], grads[1], rtol=0, atol=INT8_ERROR)
    assert np.abs(grads[0]).max() > 10 * INT8_ERROR  # a gradient, not zeros


def test_torch_int8_self_attention_fuses_and_equals_three_projections(monkeypatch):
    """Self-attention over int8 projections quantizes its input once and projects q, k and v with
    one matmul; the integer sums are exact, so it equals the three projections (key and value
    given as other tensors, which never fuse) bit for bit."""
    case = CASES_BY_NAME["gqa_self_causal"]
    data = make_data(case)
    layer = _float_layer("torch", case, data["weights"])
    layer.quantize("int8")
    calls = []
    fused = torch_file.MultiHeadAttention._project_fused
    monkeypatch.setattr(layer, "_project_fused", lambda x: calls.append(1) or fused(layer, x))
    query = torch.as_tensor(data["query"])
    with torch.no_grad():
        output = layer(query, causal=True)
        apart = layer(query, query.clone(), query.clone(), causal=True)
    assert calls == [1]
    torch.testing.assert_close(output, apart, rtol=0, atol=0)


def _int8_inputs(shape, d, f, dtype, seed=0):
    """x (*shape, D) of `dtype`, an int8 (F, D) weight and a float32 (F,) scale."""
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, d, generator=generator, dtype=torch.float64) * 3).to(dtype)
    weight = torch.randint(-127, 128, (f, d), generator=generator, dtype=torch.int8)
    return x, weight, torch.rand(f, generator=generator) * 0.01


INT8_SHAPES = {  # name: (leading shape of x, D, F): odd sizes, one row, no rows, a 2-D x
    "batched": ((2, 5), 24, 40),
    "odd": ((3,), 5, 7),
    "one_row": ((1, 1), 13, 9),
    "no_rows": ((0, 4), 8, 16),
    "fused_qkv": ((2, 3), 16, 48),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", sorted(INT8_SHAPES))
def test_torch_int8_integer_matmul_equals_the_float_sum(shape, dtype, monkeypatch):
    """`_Int8Matmul` sums the integer products in int32 (`torch._int_mm`) where `_int_mm_runs`
    says it runs (every shape on the CPU), else as floats: both sums are exact, so the two paths
    give the same output bit for bit, of x's dtype and shape."""
    leading, d, f = INT8_SHAPES[shape]
    x, weight, scale = _int8_inputs(leading, d, f, dtype)
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape) or real(a, b))
    assert torch_file._int_mm_runs(x, weight)
    integer = torch_file._Int8Matmul.apply(x, weight, scale)
    assert calls == [(int(np.prod(leading)), d)]
    monkeypatch.setattr(torch_file, "_int_mm_runs", lambda x, weight: False)
    floats = torch_file._Int8Matmul.apply(x, weight, scale)
    assert len(calls) == 1 and integer.dtype == dtype and integer.shape == (*leading, f)
    assert torch.equal(integer, floats)


def test_torch_int8_integer_sums_stay_exact_past_float32():
    """Rows of integers with |x| <= 127 and a 127 in each (so r = 1 and round(x * r) = x) against
    an int8 weight of 127s and scale 1, D = 2048: sums up to 2048 * 127**2 > 2**24, where a float32
    sum rounds; the int32 sum is exact, so the output is the exact sum rounded once to float32.
    On the meta device (no integer kernel) the float sum runs."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(-127, 128, (6, 2048), generator=generator).float()
    x[:, 0], x[0], x[1] = 127.0, 127.0, -127.0  # rows 0 and 1: the largest sums, +-2048 * 127**2
    weight = torch.full((8, 2048), 127, dtype=torch.int8)
    weight[1::2] = torch.randint(-127, 128, (4, 2048), generator=generator, dtype=torch.int8)
    exact = (x.double() @ weight.double().T).float()  # each sum exact in float64, rounded once
    output = torch_file._Int8Matmul.apply(x, weight, torch.ones(8))
    assert torch.equal(output, exact)
    assert not torch_file._int_mm_runs(x.to("meta"), weight.to("meta"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_torch_int8_half_input_stays_finite_on_the_integer_path(dtype, monkeypatch):
    """A float16 or bfloat16 input, a zero row included: quantized and scaled in float32 (r of a
    zero row, 1.27e9, overflows float16), the output finite and of x's dtype, equal to the
    float32 input's output cast down."""
    x, weight, scale = _int8_inputs((2, 4), 32, 16, torch.float32, seed=2)
    x[0, 0], x[1, 1] = 300.0, 0.0
    x = x.to(dtype)
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(1) or real(a, b))
    output = torch_file._int8_linear(x, weight, scale, None)
    assert calls == [1] and output.dtype == dtype and torch.isfinite(output).all()
    assert torch.equal(output, torch_file._int8_linear(x.float(), weight, scale, None).to(dtype))


def test_torch_int8_state_dict_loads_into_a_quantized_layer():
    """`state_dict` holds the int8 weights and scales as buffers; a layer quantized first loads it."""
    case = CASES_BY_NAME["self_basic"]
    data = make_data(case)
    layer = _float_layer("torch", case, data["weights"])
    layer.quantize("int8")
    state = layer.state_dict()
    assert state["output.weight"].dtype == torch.int8 and state["output.weight_scale"].dtype == torch.float32
    other = torch_file.MultiHeadAttention(**case.config)
    other.quantize("int8")
    other.load_state_dict(state)
    query = torch.as_tensor(data["query"])
    with torch.no_grad():
        torch.testing.assert_close(other(query), layer(query), rtol=0, atol=0)


@pytest.mark.parametrize("config", (Int8WeightOnlyConfig(), Int8DynamicActivationInt8WeightConfig()), ids=str)
def test_torchao_int8_schemes(config):
    """torchao's int8 weight-only and dynamic schemes run the layer (fused projections left out,
    decoding too) within the int8 error of the float layer; their export is the dequantized float
    layout (their scheme, abs-max / 127.5 with -128, is not the portable one); import is refused."""
    case = CASES_BY_NAME["gqa_self_causal"]
    data = make_data(case)
    layer = _float_layer("torch", case, data["weights"])
    query = torch.as_tensor(data["query"])
    with torch.no_grad():
        expected = layer(query, causal=True)
        quantize_(layer, config)
        for return_attention in (False, True):
            result = layer(query, causal=True, return_attention=return_attention)
            output = result[0] if return_attention else result
            assert 0 < (output - expected).abs().max() < INT8_ERROR
        output, _ = layer(query, causal=True, cache=layer.init_cache(case.b, case.t))
    torch.testing.assert_close(output, layer(query, causal=True), rtol=0, atol=FLOAT32)
    exported = layer.export_weights()
    assert exported["query_kernel"].dtype == np.float32 and "query_kernel_scale" not in exported
    with torch.no_grad():
        dequantized = _float_layer("torch", case, exported)(query, causal=True)
    assert (dequantized - output).abs().max() < INT8_ERROR
    with pytest.raises(ValueError, match="import the weights before quantizing"):
        layer.import_weights(exported)


@pytest.mark.parametrize("source", ("numpy", "torch"))
@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: c.name)
def test_mla_latent_projections_quantize_by_the_int8_rule(case, source):
    """MLA's projections (query or query_a and query_b, key_value_a, key_value_b, output; the
    gate's with `gate`) quantized in `source`: the same integers and scales in every file that has
    MLA, and the reference's output within one step on the PyTorch paths, expanded and absorbed
    (which reads the latents per-token quantized, as the int8 up-projection does)."""
    data = make_data(case)
    layout = _quantized_export(source, case, data)
    oracle = numpy_file.MultiHeadAttention(**case.config)
    kinds = numpy_file._projection_kinds(numpy_file._projections(oracle._latent), oracle.gate)  # the gate's with gate
    assert {name for name in layout if name.endswith("_kernel_scale")} == {f"{kind}_kernel_scale" for kind in kinds}
    reference = _float_layer("numpy", case, layout)
    expected = _call("numpy", reference, case, data)
    layer = set_path(_float_layer("torch", case, layout), case)
    for path in ("torch:sdpa", "torch:explicit"):
        assert_within_a_step(_call(path, layer, case, data), expected, one_step(reference), path)
    for layout_name in (name for name in layout if "kernel" in name):
        np.testing.assert_array_equal(layer.export_weights()[layout_name], layout[layout_name])
