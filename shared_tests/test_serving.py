"""A KV-cache decode step exported once (T dynamic) and decoded in ONNX Runtime and LiteRT: the
prompt and 32 single-token steps, each call's output equal to eager decoding of the same layer."""

import numpy as np
import pytest

from shared_tests import serving
from shared_tests.serving import SERVED_LAYERS, SERVING_PATHS, STEP_TOLERANCE, STEPS

LITERT_INT8 = ("tf:litert", "int8")


# LiteRT has no scatter of int8 tensors: the int8 cache's step does not convert (docs/serving.md; the refusal
# is tested below)
SERVED = [
    (path, served) for served in SERVED_LAYERS for path in SERVING_PATHS if (path, served.cache_dtype) != LITERT_INT8
]


@pytest.mark.parametrize(("path", "served"), SERVED, ids=[f"{path}-{served.name}" for path, served in SERVED])
def test_exported_decode_step_equals_eager_decoding(path, served):
    runtime, eager = serving.decode(served, path)
    assert len(runtime) == len(eager) == 1 + STEPS
    assert runtime[0].shape == (served.b, serving.PROMPT, served.e)
    assert all(out.shape == (served.b, 1, served.e) for out in runtime[1:])
    worst = max(float(np.abs(r - e).max()) for r, e in zip(runtime, eager, strict=True))
    assert np.isfinite(worst) and worst <= served.tolerance


def test_decoding_reads_the_cache_it_is_fed():
    """A step fed an empty cache instead of the previous step's gives another output: the test
    above cannot pass with a runtime that ignores its cache inputs."""
    served = serving.SERVED_LAYERS_BY_NAME["rope_gqa"]
    _, _, calls = serving.make_inputs(served)
    model, initial = serving.export_tf_onnx_step(served)
    decoded = serving.decode_onnx(model, initial, calls[:2])
    alone = serving.decode_onnx(model, [*initial[:3], np.array(serving.PROMPT, np.int32)], calls[1:2])
    assert np.abs(decoded[1] - alone[0]).max() > 100 * STEP_TOLERANCE


def test_regression_onnxruntime_has_no_boolean_where(monkeypatch):
    """The PyTorch step's update of `keep` selects between booleans, for which onnxruntime's CPU
    provider has no Where kernel: the exported model did not load until the rewrite."""
    import onnxruntime

    served = serving.SERVED_LAYERS_BY_NAME["rope_gqa"]
    monkeypatch.setattr(serving, "without_boolean_where", lambda model: model)
    model, _ = serving.export_torch_step(served)
    with pytest.raises(Exception, match=r"Could not find an implementation for Where"):
        onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])


def test_litert_refuses_the_int8_cache_step():
    """The TFLite converter has no builtin scatter of int8 tensors (`tf.TensorScatterUpdate` on the
    cache's integers): an int8 cache's decode step does not convert (docs/serving.md)."""
    from tensorflow.lite.python.convert_phase import ConverterError

    with pytest.raises(ConverterError, match=r"'tf.TensorScatterUpdate' op is neither a custom op nor a flex op"):
        serving.export_tf_litert_step(serving.SERVED_LAYERS_BY_NAME["int8_rolling_window"])
