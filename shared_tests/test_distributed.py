"""The layer under distributed engines equals one process: PyTorch DDP, FSDP2 and tensor
parallelism by heads (2 CPU ranks, gloo), and Keras `fit` under tf.distribute.MirroredStrategy
(2 logical CPU devices), in float64, so equal means within 1e-10; and the Keras file under
`keras.distribution` on JAX (4 virtual CPU devices), in float32, equal within the SPEC's float32
tolerances. Each engine runs in its own subprocess (shared_tests/distributed.py), with a timeout
so nothing hangs. The Keras file's `layout_map` is also checked here, in this process (the
Keras file on the TensorFlow backend), with meshes of placeholder devices."""

import json
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from Keras import MultiHeadAttention
from shared_tests.cases import CASES, TOLERANCES
from shared_tests.distributed import DEVICES, KERAS_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
SAME = 1e-10  # float64 rounding between a reduction over ranks and one over the whole batch
MOVED = 1e-3  # training must change the weights, or "equal" would prove nothing
TIMEOUT = 300


FLOAT32 = TOLERANCES["float32"]  # output, weights (here: the weights after `fit`), gradients


def _run(tmp_path_factory, framework, mix_batch):
    out = tmp_path_factory.mktemp(framework) / "results.json"
    args = [sys.executable, "-m", "shared_tests.distributed", framework, str(out)]
    result = subprocess.run(
        [*args, "--mix-batch"] if mix_batch else args, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text())


def _mesh(model_size, devices=DEVICES):
    """A ("batch", "model") mesh of placeholder devices: enough to build a LayoutMap."""
    return keras.distribution.DeviceMesh(
        (devices // model_size, model_size), ("batch", "model"), devices=[f"cpu:{i}" for i in range(devices)]
    )


@pytest.fixture(scope="module")
def torch_ranks(tmp_path_factory):
    return _run(tmp_path_factory, "torch", mix_batch=False)


@pytest.fixture(scope="module")
def torch_ranks_mixing(tmp_path_factory):
    return _run(tmp_path_factory, "torch", mix_batch=True)


@pytest.fixture(scope="module")
def keras_replicas(tmp_path_factory):
    return _run(tmp_path_factory, "keras", mix_batch=False)


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_data_parallel_training_equals_one_process(torch_ranks, engine):
    for rank in torch_ranks:
        assert rank["moved"] > MOVED
        assert rank[engine] < SAME, rank


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_a_layer_that_mixes_the_batch_fails_data_parallel_equality(torch_ranks_mixing, engine):
    assert all(rank[engine] > 1e-4 for rank in torch_ranks_mixing), torch_ranks_mixing


@pytest.mark.parametrize("config", ["mha", "gqa_causal", "padding_mask", "head_dim_cross"])
def test_tensor_parallel_forward_and_gradients_equal_the_whole_layer(torch_ranks, config):
    assert all(rank[f"tp_{config}"] < SAME for rank in torch_ranks), torch_ranks


def test_tensor_parallel_refuses_what_it_cannot_split(torch_ranks):
    for rank in torch_ranks:
        errors = rank["tp_errors"]
        assert errors["per_head_mask"].startswith(
            "A per-head `attention_mask` (B, N, T, S) cannot be used with heads split across tensor-parallel ranks "
            "(2 of 4 heads on this rank)"
        )
        assert errors["per_head_bias"].startswith("A per-head `attention_bias` (B, N, T, S) cannot be used with heads")
        for name in ("sinks", "qk_norm_all"):
            assert errors[name].startswith(
                "`sinks` and `qk_norm='all'` hold numbers of every head and cannot be split across tensor-parallel "
                "ranks (2 of 4 heads on this rank)"
            ), errors[name]
        assert errors["output_norm"] == (
            "`output_norm` normalizes over every head and cannot be split across tensor-parallel ranks "
            "(2 of 4 heads on this rank). Received: output_norm='rms'"
        )
        assert errors["mqa_on_two_ranks"].startswith(
            "Each tensor-parallel rank must hold whole heads: `num_heads` and `num_kv_heads` must be divisible by "
            "the number of ranks. Received: num_heads=4, num_kv_heads=1, head_dim=2, a projection 1 wide on this rank"
        )


def test_keras_fit_under_mirrored_strategy_equals_one_device(keras_replicas):
    assert keras_replicas["replicas"] == 2
    assert keras_replicas["moved"] > MOVED
    assert keras_replicas["mirrored"] < SAME, keras_replicas


def test_a_layer_that_mixes_the_batch_fails_mirrored_equality(tmp_path_factory):
    mixing = _run(tmp_path_factory, "keras", mix_batch=True)
    assert mixing["mirrored"] > 1e-4, mixing


# -- Keras 3 on JAX: keras.distribution ----------------------------------------------------------


@pytest.fixture(scope="module")
def keras_jax(tmp_path_factory):
    results = _run(tmp_path_factory, "keras_jax", mix_batch=False)
    assert results["devices"] == DEVICES
    return results


def _equal_to_one_device(result):
    assert result["moved"] > MOVED
    assert result["output"] < FLOAT32["output"], result
    assert result["gradients"] < FLOAT32["grads"], result
    assert result["fit"] < FLOAT32["weights"], result


def test_keras_data_parallel_equals_one_device(keras_jax):
    _equal_to_one_device(keras_jax["data_parallel"])
    assert all(s["spec"] == [None] * len(s["shard"]) for s in keras_jax["data_parallel"]["shardings"].values())


MODEL_PARALLEL = [f"{name}_{size}" for name, (_, sizes) in KERAS_CONFIGS.items() for size in sizes]


@pytest.mark.parametrize("run", MODEL_PARALLEL)
def test_keras_model_parallel_equals_one_device(keras_jax, run):
    result = keras_jax[run]
    _equal_to_one_device(result)
    assert result["decode"] < FLOAT32["output"], result
    assert result["decode_vs_full"] < FLOAT32["output"], result


@pytest.mark.parametrize("run", MODEL_PARALLEL)
def test_keras_model_parallel_splits_whole_heads(keras_jax, run):
    name, size = run.rsplit("_", 1)
    options, m = KERAS_CONFIGS[name][0], int(size)
    n, k = options["num_heads"], options.get("num_kv_heads", options["num_heads"])
    h = options.get("head_dim", 16 // n)
    kv = (["model"], k // m) if k > 1 else ([None], k)  # MQA: the one key/value head on every device
    expected = {
        "query_kernel": ([None, "model"], [16, n // m * h]),
        "query_bias": (["model"], [n // m * h]),
        "key_kernel": ([None, *kv[0]], [16, kv[1] * h]),
        "key_bias": (kv[0], [kv[1] * h]),
        "value_kernel": ([None, *kv[0]], [16, kv[1] * h]),
        "value_bias": (kv[0], [kv[1] * h]),
        "output_kernel": (["model", None], [n // m * h, 16]),
        "output_bias": ([None], [16]),
    }
    if options.get("qk_norm") == "all":  # over all heads: (N*H,) and (K*H,), split as q and k
        expected.update(query_norm=(["model"], [n // m * h]), key_norm=(kv[0], [kv[1] * h]))
    if options.get("sinks"):
        expected["sinks"] = (["model"], [n // m])
    shardings = {path.removeprefix("attention/"): s for path, s in keras_jax[run]["shardings"].items()}
    assert set(shardings) == {*expected, "head/kernel", "head/bias"}
    for weight, (spec, shard) in expected.items():
        assert (shardings[weight]["spec"], shardings[weight]["shard"]) == (spec, shard), weight
    cache = keras_jax[run]["cache"]  # (B, K, L, H): the key/value heads split as the kernels
    assert cache["shard"] == [2, kv[1], 6, h] and cache["spec"][:2] == ([None, "model"] if k > 1 else []), cache


def test_keras_layout_written_by_hand_that_splits_heads_still_equals_one_device(keras_jax):
    result = keras_jax["head_split_by_hand"]
    _equal_to_one_device(result)
    assert result["shardings"]["attention/query_kernel"]["shard"] == [16, 4]  # half of a head of 8 per device


def test_keras_model_trained_under_model_parallel_loads_on_one_device_and_tensorflow(keras_jax, tmp_path_factory):
    assert keras_jax["saved"] < FLOAT32["output"]
    folder = next(Path(tmp_path_factory.getbasetemp()).glob("keras_jax*"))
    saved = np.load(folder / "model_parallel.npz")
    model = keras.saving.load_model(folder / "model_parallel.keras")  # this process: the TensorFlow backend
    assert keras.backend.backend() == "tensorflow"
    output = model.predict([saved["x"], saved["keep"]], verbose=0)
    np.testing.assert_allclose(output, saved["expected"], rtol=0, atol=FLOAT32["output"])


def test_layout_map_covers_every_weight_of_every_case():
    for case in CASES:
        layer = MultiHeadAttention(**case.config, name="attention")
        layout_map = layer.layout_map(_mesh(1, devices=1))
        assert {key.removeprefix("(.*/)?attention/") for key in layout_map} == set(layer.weight_shapes()), case.name


def test_layout_map_splits_norms_sinks_and_int8_scales_by_heads():
    layer = MultiHeadAttention(16, 4, num_kv_heads=2, qk_norm="per_head", qk_norm_bias=True, sinks=True, name="a")
    layer.build()
    layer.quantize("int8")
    axes = {key.removeprefix("(.*/)?a/"): layout.axes for key, layout in layer.layout_map(_mesh(2)).items()}
    for name in ("query_norm", "key_norm", "query_norm_bias", "key_norm_bias", "sinks", "query_kernel_scale"):
        assert axes[name] == ("model",), name
    assert axes["output_kernel_scale"] == (None,)
    shared = MultiHeadAttention(16, 4, qk_norm="head", name="b").layout_map(_mesh(2))
    assert shared["b/query_norm"].axes == (None,)


def test_layout_map_keys_match_the_variable_paths_of_nested_layers_alone():
    layout_map = MultiHeadAttention(16, 4, name="attention").layout_map(_mesh(2))
    assert layout_map["block_0/attention/query_kernel"].axes == (None, "model")
    assert layout_map["attention/output_kernel"].axes == ("model", None)
    assert layout_map["my_attention/query_kernel"] is None
    assert layout_map["attention/query_kernel_2"] is None


def test_layout_map_shares_entries_of_equal_layers_and_refuses_different_ones():
    mesh = _mesh(2)
    layout_map = MultiHeadAttention(16, 4, num_kv_heads=2, name="attention").layout_map(mesh)
    MultiHeadAttention(16, 4, num_kv_heads=2, name="attention").layout_map(mesh, layout_map=layout_map)
    assert len(layout_map) == 8
    with pytest.raises(
        ValueError,
        match=r"already lays out '\(\.\*/\)\?attention/key_kernel' as \(None, 'model'\), this layer needs "
        r"\(None, None\): give layers of different configurations different names",
    ):
        MultiHeadAttention(16, 4, num_kv_heads=1, name="attention").layout_map(mesh, layout_map=layout_map)
    with pytest.raises(ValueError, match=r"^`layout_map` must be a LayoutMap on `mesh`"):
        MultiHeadAttention(16, 4, name="other").layout_map(_mesh(2), layout_map=layout_map)


@pytest.mark.parametrize(
    "options",
    [
        {"num_heads": 8, "head_dim": 2},
        {"num_heads": 8, "num_kv_heads": 4, "head_dim": 2},
        {"num_heads": 4, "num_kv_heads": 1},
    ],
)
def test_layout_map_holds_whole_heads_on_every_device(options):
    assert len(MultiHeadAttention(16, **options).layout_map(_mesh(4))) == 8


@pytest.mark.parametrize(
    ("options", "size", "sizes"),
    [
        ({"num_heads": 2}, 4, "1 or 2"),
        ({"num_heads": 6, "head_dim": 2}, 4, "1, 2, 3 or 6"),
        ({"num_heads": 4, "num_kv_heads": 2}, 4, "1 or 2"),
        ({"num_heads": 6, "num_kv_heads": 3, "head_dim": 2}, 2, "1 or 3"),
    ],
)
def test_layout_map_refuses_to_split_a_head(options, size, sizes):
    layer = MultiHeadAttention(16, **options)
    received = f"num_heads={layer.num_heads}, num_kv_heads={layer.num_kv_heads}, a 'model' axis of {size} devices"
    with pytest.raises(
        ValueError,
        match=rf"^The size of the mesh axis 'model' must divide `num_heads`, and `num_kv_heads` unless it is 1 "
        rf"\(MQA: .*Received: {received}\. Use a 'model' axis of {sizes} devices \(the others on a batch axis\)$",
    ):
        layer.layout_map(_mesh(size))


def test_layout_map_checks_its_arguments():
    layer = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match=r"^`mesh` must be a keras.distribution.DeviceMesh\. Received: mesh=\(2, 2\)$"):
        layer.layout_map((2, 2))
    with pytest.raises(ValueError, match=r"^`model_axis` must be an axis of `mesh`, one of \('batch', 'model'\)\. "):
        layer.layout_map(_mesh(2), model_axis="heads")
    with pytest.raises(ValueError, match=r"^`layout_map` must be a LayoutMap on `mesh`\. Received: layout_map=\{\}$"):
        layer.layout_map(_mesh(2), layout_map={})
