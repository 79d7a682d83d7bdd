"""Properties: random shapes, head counts, masks and causal flags stay in parity across the
three layers and every path (bounded so the suite stays fast on 2 cores)."""

import dataclasses
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import NumPy.Multi_Head_Attention as numpy_layer
from shared_tests import frameworks, parity
from shared_tests.cases import MASK_KINDS, Case, make_data
from shared_tests.runtimes import RUNTIME_PATHS

# The exported runtimes take seconds per example; the case table runs them on every case.
IN_PROCESS_PATHS = tuple(path for path in parity.PATHS if path not in RUNTIME_PATHS)
EAGER_PATHS = ("numpy", "torch:sdpa", "torch:explicit", "torch:inference", "tf:eager")  # mask values readable


@st.composite
def cases(draw):
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))
    t, s = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    self_attention = t == s and draw(st.booleans())
    widths = (
        {}
        if self_attention
        else {"kdim": draw(st.sampled_from([None, 3, 9])), "vdim": draw(st.sampled_from([None, 5]))}
    )
    return Case(
        name="property",
        b=draw(st.integers(1, 3)),
        t=t,
        s=s,
        e=draw(st.integers(1, 12)),
        n=heads,
        k=kv_heads,
        h=draw(st.integers(1, 5)),
        bias=draw(st.booleans()),
        mask=draw(st.sampled_from(MASK_KINDS)),
        causal=draw(st.booleans()),
        self_attention=self_attention,
        **widths,
    )


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), seed=st.integers(0, 2**16))
@example(  # regression: its rows_masked mask keeps key 1 and 2 for query 0, nothing for the others (torch causal's trap)
    case=Case(
        name="property",
        b=1,
        t=3,
        s=3,
        e=3,
        n=1,
        k=1,
        h=1,
        bias=False,
        mask="rows_masked",
        causal=False,
        self_attention=True,
    ),
    seed=0,
)
def test_random_configurations_stay_in_parity(case, seed):
    data = make_data(case, seed)
    mask = data["attention_mask"]
    if mask is not None and mask.ndim == 2 and case.b == case.t > 1:  # (T, S) or a (B, S) padding mask? refused
        for path in IN_PROCESS_PATHS:
            with pytest.raises(ValueError, match=r"A 2-D `attention_mask` is read as \(T, S\), but with B == T"):
                frameworks.run(case, data, path)
        return
    if mask is not None and mask.dtype == np.bool_ and not mask.any():  # drawn so small that it keeps nothing
        for path in IN_PROCESS_PATHS:  # nn.MultiheadAttention's polarity for unpadded sequences
            if path in EAGER_PATHS:  # where the mask's values can be read, refused
                with pytest.raises(ValueError, match="`attention_mask` keeps no key for any query"):
                    frameworks.run(case, data, path)
            else:  # inside a graph: no query keeps a key, so every output row is the output bias
                bias = data["weights"].get("output_bias", np.zeros(case.e, np.float32))
                output = frameworks.run(case, data, path).output
                np.testing.assert_allclose(output, np.broadcast_to(bias, output.shape), atol=case.tolerance["output"])
        return
    if _reads_as_torch_causal_attn_mask(case, mask):  # e.g. rows_masked drawn as [[0, 1, 1], [0, 0, 0], [0, 0, 0]]
        for path in EAGER_PATHS:
            with pytest.raises(ValueError, match="`attention_mask` keeps keys only after each query"):
                frameworks.run(case, data, path)
        graph_paths = tuple(path for path in IN_PROCESS_PATHS if path not in EAGER_PATHS)
        with mock.patch.object(numpy_layer, "_check_keeps_some_at_or_before"):  # the reference, trap check off
            row, _ = parity.run_case(case, data, paths=("numpy", *graph_paths))  # graphs cannot read the mask
        assert row.passed and row.diffs["tf/numpy"]["output"] is not None, (dataclasses.asdict(case), row.failures)
        return
    row, results = parity.run_case(case, data, paths=IN_PROCESS_PATHS)
    assert row.passed, (dataclasses.asdict(case), row.failures)
    assert results["numpy"].output.shape == (case.b, case.t, case.e)


def _reads_as_torch_causal_attn_mask(case, mask):
    """Whether the layers refuse `mask` as nn.MultiheadAttention's causal `attn_mask` (SPEC Masks):
    square (T == S), boolean, keeping no key at or before any query."""
    if mask is None or mask.dtype != np.bool_ or case.t != case.s or mask.size == 0:
        return False
    return not (mask & np.tril(np.ones((case.t, case.s), dtype=bool))).any()
