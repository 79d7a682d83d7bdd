"""The portable layout moves weights between frameworks through `.npz` bit for bit."""

import numpy as np
import pytest

from shared_tests.cases import TOLERANCES

CONFIGS = [
    {"d_model": 16, "num_heads": 4},
    {"d_model": 16, "num_heads": 4, "num_kv_heads": 1, "head_dim": 6, "kdim": 5, "vdim": 7},
    {"d_model": 12, "num_heads": 3, "bias": False},
]


def _torch(config):
    from PyTorch import MultiHeadAttention

    return MultiHeadAttention(**config)


def _tf(config):
    from TensorFlow import MultiHeadAttention

    return MultiHeadAttention(**config)


def _through_npz(weights, path):
    np.savez(path, **weights)
    with np.load(path, allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def _assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == np.float32, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("config", CONFIGS, ids=["mha", "mqa_kdim_vdim_head_dim", "no_bias"])
@pytest.mark.parametrize("order", [(_torch, _tf, _torch), (_tf, _torch, _tf)], ids=["torch_tf_torch", "tf_torch_tf"])
def test_round_trip_through_npz_is_bitwise(config, order, tmp_path):
    first, middle, last = (make(config) for make in order)
    original = first.export_weights()
    middle.import_weights(_through_npz(original, tmp_path / "a.npz"))
    last.import_weights(_through_npz(middle.export_weights(), tmp_path / "b.npz"))
    _assert_bitwise_equal(original, middle.export_weights())
    _assert_bitwise_equal(original, last.export_weights())


def test_moved_weights_give_the_same_numbers(tmp_path):
    import tensorflow as tf
    import torch

    config = CONFIGS[1]
    source = _torch(config)
    target = _tf(config)
    target.import_weights(_through_npz(source.export_weights(), tmp_path / "w.npz"))
    rng = np.random.default_rng(0)
    x, k, v = rng.normal(size=(2, 3, 16)), rng.normal(size=(2, 4, 5)), rng.normal(size=(2, 4, 7))
    expected = source(*(torch.tensor(a, dtype=torch.float32) for a in (x, k, v))).detach().numpy()
    got = target(tf.constant(x, tf.float32), key=tf.constant(k, tf.float32), value=tf.constant(v, tf.float32)).numpy()
    np.testing.assert_allclose(got, expected, atol=TOLERANCES["float32"]["output"], rtol=0)
