"""A KV-cache decode step exported as a deployable graph, and decoding through it.

One graph per layer holds the step (x, cache in) -> (output, cache out) with T unknown: called
once on the prompt (T = PROMPT) and then once per token (T = 1). The cache is four tensors that
go in as inputs and come back as outputs (key, value, keep, index; an int8 cache's scales too:
six), so the runtime holds no
state of its own and the caller feeds each step's cache to the next. B and L are fixed at export.

- `torch:onnx`: `torch.onnx.export(dynamo=True)` with T dynamic, run in onnxruntime.
- `tf:onnx`: a `tf.function` with T = None through tf2onnx, run in onnxruntime.
- `tf:litert`: the same `tf.function` through the TFLite converter, run in the LiteRT
  interpreter (its `x` resized to each call's T).

Legend: B batch, T tokens per call, E d_model, N num_heads, K num_kv_heads, H head_dim, L cache
slots.
"""

import dataclasses
import functools

import numpy as np

from shared_tests.runtimes import quietly, tf2onnx_dynamic, torch_onnx_export

SERVING_PATHS = ("torch:onnx", "tf:onnx", "tf:litert")
PROMPT = 8  # T of the first call
STEPS = 32  # T = 1 calls after the prompt
PADDING = (0, 3)  # left padding of each prompt: the second one is 3 tokens shorter
STEP_TOLERANCE = 1e-5  # float32: each call's output, runtime against eager (SPEC's output tolerance)
CACHE_INPUTS = ("key", "value", "keep", "index")
INT8_CACHE_INPUTS = (*CACHE_INPUTS, "key_scale", "value_scale")  # an int8 cache's: its integers' scales too
INT8_STEP_TOLERANCE = 1e-4  # int8 cache: a runtime may round a key a few ulps apart to the neighbouring integer


@dataclasses.dataclass(frozen=True)
class ServedLayer:
    """A small decoder layer and its cache: RoPE, causal, grouped key/value heads."""

    name: str
    length: int  # L
    variants: tuple = ()
    b: int = 2
    e: int = 32
    n: int = 4
    k: int = 2
    cache_dtype: str | None = None  # `init_cache(..., dtype=...)`: "int8" or "float8_e4m3fn" for a scaled cache

    @property
    def cache_inputs(self):
        """The names of the cache's tensors that go in and come back out."""
        return INT8_CACHE_INPUTS if self.cache_dtype is not None else CACHE_INPUTS

    @property
    def tolerance(self):
        return INT8_STEP_TOLERANCE if self.cache_dtype is not None else STEP_TOLERANCE

    @property
    def config(self):
        return dict(d_model=self.e, num_heads=self.n, num_kv_heads=self.k, rope_theta=10000.0, **dict(self.variants))


MLA_VARIANTS = (  # multi-head latent attention: its latent cache, (B, 1, L, C) and (B, 1, L, Hr), goes in and out
    ("kv_lora_rank", 8), ("q_lora_rank", 12), ("qk_nope_head_dim", 4), ("qk_rope_head_dim", 4), ("v_head_dim", 6),
)  # fmt: skip
SERVED_LAYERS = [
    ServedLayer("rope_gqa", length=PROMPT + STEPS),
    ServedLayer("rolling_window", length=PROMPT, variants=(("window", PROMPT),)),  # L = W: the cache rolls
    ServedLayer("mla_rolling_window", length=PROMPT, variants=(("window", PROMPT), *MLA_VARIANTS)),  # latent cache
    ServedLayer("int8_rolling_window", length=PROMPT, variants=(("window", PROMPT),), cache_dtype="int8"),
]
SERVED_LAYERS_BY_NAME = {layer.name: layer for layer in SERVED_LAYERS}
# No runtime here takes an fp8 cache's step (docs/serving.md): tested as refused, not decoded
FP8_SERVED = ServedLayer(
    "fp8_rolling_window", length=PROMPT, variants=(("window", PROMPT),), cache_dtype="float8_e4m3fn"
)


def make_inputs(served, seed=0):
    """Portable weights, the (B, L) keep of the left-padded prompts, and the input of each call:
    the (B, PROMPT, E) prompt, then STEPS of (B, 1, E), drawn once (no sampling)."""
    from NumPy import MultiHeadAttention

    rng = np.random.default_rng([seed, sum(map(ord, served.name))])
    shapes = MultiHeadAttention(**served.config).weight_shapes()
    weights = {name: rng.normal(scale=np.sqrt(2.0 / sum(s)), size=s).astype(np.float32) for name, s in shapes.items()}
    keep = np.ones((served.b, served.length), bool)
    for row, padding in enumerate(PADDING):
        keep[row, :padding] = False
    calls = [rng.normal(size=(served.b, PROMPT, served.e)).astype(np.float32)]
    calls += [rng.normal(size=(served.b, 1, served.e)).astype(np.float32) for _ in range(STEPS)]
    return weights, keep, calls


def torch_layer(served, weights):
    from PyTorch import MultiHeadAttention

    layer = MultiHeadAttention(**served.config)
    layer.import_weights(weights)
    return layer.eval()


def tf_layer(served, weights):
    from TensorFlow import MultiHeadAttention

    layer = MultiHeadAttention(**served.config)
    layer.import_weights(weights)
    return layer


def decode_eager_torch(served, weights, keep, calls):
    """Each call's (B, T, E) output, decoding in the PyTorch layer."""
    import torch

    layer = torch_layer(served, weights)
    cache = layer.init_cache(served.b, served.length, keep=torch.from_numpy(keep), dtype=served.cache_dtype)
    outputs = []
    with torch.no_grad():
        for x in calls:
            output, cache = layer(torch.from_numpy(x), causal=True, cache=cache)
            outputs.append(output.numpy())
    return outputs


def decode_eager_tf(served, weights, keep, calls):
    """Each call's (B, T, E) output, decoding in the TensorFlow layer (eagerly)."""
    layer = tf_layer(served, weights)
    cache = layer.init_cache(served.b, served.length, keep=keep, dtype=served.cache_dtype)
    outputs = []
    for x in calls:
        output, cache = layer(x, causal=True, cache=cache)
        outputs.append(output.numpy())
    return outputs


def export_torch_step(served, seed=0):
    """The PyTorch decode step as ONNX, for the weights of `make_inputs(served, seed)`, and the
    initial cache: inputs x (B, T, E), key and value (B, K, L, H), keep (B, L), index (); outputs
    the (B, T, E) output and the four cache tensors after the step. T is dynamic; the layer writes
    its cache in place, so the step returns copies. Each `Where` between booleans is rewritten
    (`without_boolean_where`) in the export that `torch.onnx.export` gave."""
    import onnx

    exported, initial = _torch_step_export(served, seed)
    return without_boolean_where(onnx.load_from_string(exported)).SerializeToString(), initial


@functools.cache  # once per process: test_serving's tests decode and rewrite the same export
def _torch_step_export(served, seed):
    """The bytes `torch.onnx.export` gives for the PyTorch decode step, and the initial cache."""
    import torch

    from PyTorch import KVCache

    weights, keep, calls = make_inputs(served, seed)
    example = calls[0]
    layer = torch_layer(served, weights)

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x, key, value, keep, index, key_scale=None, value_scale=None):  # scales: int8 only
            scales = [None if s is None else s.clone() for s in (key_scale, value_scale)]
            cache = KVCache(key.clone(), value.clone(), keep.clone(), index, None, *scales)
            output, cache = self.layer(x, causal=True, cache=cache)
            return output, *(getattr(cache, name) for name in served.cache_inputs)  # not segment_ids

    cache = layer.init_cache(served.b, served.length, keep=torch.from_numpy(keep), dtype=served.cache_dtype)
    fields = tuple(getattr(cache, name) for name in served.cache_inputs)
    tokens = torch.export.Dim("tokens", min=1, max=served.length)
    shapes = ({1: tokens}, *(None,) * len(fields))
    program = torch_onnx_export(Step(), (torch.from_numpy(example), *fields), dynamic_shapes=shapes)
    return program.model_proto.SerializeToString(), tuple(np.asarray(c.numpy()) for c in fields)


def without_boolean_where(model):
    """The ONNX model with each `Where` that selects between booleans (the layer's update of
    `keep`) done on uint8 between two Casts: onnxruntime's CPU provider has no boolean Where."""
    import onnx

    types = {v.name: v.type.tensor_type.elem_type for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    types |= {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    nodes = []
    for node in model.graph.node:
        if node.op_type != "Where" or types.get(node.input[1]) != onnx.TensorProto.BOOL:
            nodes.append(node)
            continue
        as_uint8 = [f"{node.output[0]}_{name}_as_uint8" for name in node.input[1:]]  # a name per Where
        nodes += [
            onnx.helper.make_node("Cast", [given], [cast], to=onnx.TensorProto.UINT8)
            for given, cast in zip(node.input[1:], as_uint8, strict=True)
        ]
        selected = f"{node.output[0]}_as_uint8"
        nodes.append(onnx.helper.make_node("Where", [node.input[0], *as_uint8], [selected], name=node.name))
        nodes.append(onnx.helper.make_node("Cast", [selected], [node.output[0]], to=onnx.TensorProto.BOOL))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _tf_step(served, weights):
    """The TensorFlow decode step as a `tf.function` of (x, key, value, keep, index) (an int8 cache:
    key_scale and value_scale too) with T None."""
    import tensorflow as tf

    from TensorFlow import KVCache

    layer = tf_layer(served, weights)
    cache = layer.init_cache(served.b, served.length, dtype=served.cache_dtype)
    signature = [tf.TensorSpec((served.b, None, served.e), tf.float32, name="x")]
    signature += [tf.TensorSpec(getattr(cache, n).shape, getattr(cache, n).dtype, name=n) for n in served.cache_inputs]

    @tf.function(input_signature=signature)
    def step(x, *fields):
        output, cache = layer(x, causal=True, cache=KVCache(**dict(zip(served.cache_inputs, fields, strict=True))))
        return output, *(getattr(cache, name) for name in served.cache_inputs)  # not segment_ids

    return step, signature, layer


def _tf_initial(served, layer, keep):
    cache = layer.init_cache(served.b, served.length, keep=keep, dtype=served.cache_dtype)
    return tuple(np.asarray(getattr(cache, name).numpy()) for name in served.cache_inputs)


def export_tf_onnx_step(served, seed=0):
    """The TensorFlow decode step through tf2onnx (inputs and outputs as in `export_torch_step`)."""
    return _tf_onnx_step_export(served, seed)


@functools.cache  # once per process: test_serving's tests decode the same export
def _tf_onnx_step_export(served, seed):
    weights, keep, _ = make_inputs(served, seed)
    step, signature, layer = _tf_step(served, weights)
    return tf2onnx_dynamic(step, signature).SerializeToString(), _tf_initial(served, layer, keep)


def export_tf_litert_step(served, seed=0):
    """The TensorFlow decode step through the TFLite converter, as a flatbuffer, and the initial cache."""
    import tensorflow as tf

    weights, keep, _ = make_inputs(served, seed)
    step, _, layer = _tf_step(served, weights)
    converter = tf.lite.TFLiteConverter.from_concrete_functions([step.get_concrete_function()], layer)
    converter.experimental_lower_to_saved_model = False  # lowered, the layer's variables read as garbage
    return quietly(converter.convert), _tf_initial(served, layer, keep)


def decode_onnx(model, initial, calls):
    """Each call's output, decoding in onnxruntime: every step's cache fed to the next."""
    import onnxruntime

    runtime = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    names = [given.name for given in runtime.get_inputs()]
    cache, outputs = initial, []
    for x in calls:
        output, *cache = runtime.run(None, dict(zip(names, [x, *cache], strict=True)))
        outputs.append(output)
    return outputs


def decode_litert(model, initial, calls):
    """Each call's output, decoding in the LiteRT interpreter: `x` resized to each call's T, the
    outputs (Identity, Identity_1, ...) in the step's order."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_content=model)
    inputs = {detail["name"]: detail["index"] for detail in interpreter.get_input_details()}
    results = sorted(interpreter.get_output_details(), key=lambda d: (len(d["name"]), d["name"]))
    cache, outputs = initial, []
    for x in calls:
        interpreter.resize_tensor_input(inputs["x"], x.shape)
        interpreter.allocate_tensors()
        for name, array in zip(("x", *(n for n in INT8_CACHE_INPUTS if n in inputs)), (x, *cache), strict=True):
            interpreter.set_tensor(inputs[name], array)
        interpreter.invoke()
        output, *cache = [interpreter.get_tensor(detail["index"]) for detail in results]
        outputs.append(output)
    return outputs


@functools.cache  # once per process: tf:onnx and tf:litert are judged against the same eager decoding
def decode_eager(served, framework, seed):
    """Each call's (B, T, E) output, decoding `served` eagerly in the layer of `framework` ("torch", "tf")."""
    decode_eager_framework = decode_eager_torch if framework == "torch" else decode_eager_tf
    return decode_eager_framework(served, *make_inputs(served, seed))


def decode(served, path, seed=0):
    """(runtime outputs, eager outputs) of every call, decoding `served` on `path`."""
    _, _, calls = make_inputs(served, seed)
    eager = decode_eager(served, path.split(":")[0], seed)
    if path == "torch:onnx":
        return decode_onnx(*export_torch_step(served, seed), calls), eager
    if path == "tf:onnx":
        return decode_onnx(*export_tf_onnx_step(served, seed), calls), eager
    return decode_litert(*export_tf_litert_step(served, seed), calls), eager
