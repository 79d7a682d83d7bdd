"""The layer under distributed engines equals one process: PyTorch DDP, FSDP2 and tensor
parallelism by heads (2 CPU ranks, gloo), and Keras `fit` under tf.distribute.MirroredStrategy
(2 logical CPU devices). Each engine runs in its own subprocess (shared_tests/distributed.py),
with a timeout so nothing hangs; float64 throughout, so equal means within 1e-10."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAME = 1e-10  # float64 rounding between a reduction over ranks and one over the whole batch
MOVED = 1e-3  # training must change the weights, or "equal" would prove nothing
TIMEOUT = 300


def _run(tmp_path_factory, framework, mix_batch):
    out = tmp_path_factory.mktemp(framework) / "results.json"
    args = [sys.executable, "-m", "shared_tests.distributed", framework, str(out)]
    result = subprocess.run(
        [*args, "--mix-batch"] if mix_batch else args, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text())


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
