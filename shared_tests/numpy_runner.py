"""The runner of the NumPy file (NumPy/Multi_Head_Attention.py), the float64 oracle: path `numpy`.

Legend: B batch, T query length, S key/value length, E d_model, N num_heads, P tokens decoded
in all, L cache slots.
"""

import numpy as np

from shared_tests.call_args import call_inputs
from shared_tests.calling import DecodeResult, Result, as_numpy_cache, by_name, inputs
from shared_tests.decode_masks import chunk_mask, chunk_positions, full_pass_mask


def run(case, data):
    """The `numpy` path: output, weights and the gradients of its explicit backward, in float64."""
    from NumPy import MultiHeadAttention

    layer = MultiHeadAttention(**case.config)
    layer.import_weights(data["weights"])
    query, kv = by_name([x.astype(np.float64) for x in inputs(data)])
    output, weights = layer(*query, **kv, **call_inputs(data), causal=case.causal, return_attention=True)
    return Result(output, weights, layer.backward(data["grad_output"].astype(np.float64)))


def decode(case, data):
    """A decode case on the NumPy file: chunk by chunk through its cache, then one full pass."""
    from NumPy import MultiHeadAttention

    layer = MultiHeadAttention(**case.config)
    layer.import_weights(data["weights"])
    layer.absorb_latents = False  # the oracle: MLA expanded
    inputs = {name: x.astype(np.float64) for name, x in data["inputs"].items()}
    cache = layer.init_cache(case.b, case.length, keep=data["keep"], dtype=case.cache_dtype)
    outputs, weights = [], []
    for start, stop in case.spans():
        chunk = {name: x[:, start:stop] for name, x in inputs.items()}
        mask = chunk_mask(data["attention_mask"], start, stop)
        extra = chunk_positions(data, start, stop)
        output, w, cache = layer(
            **chunk, **extra, attention_mask=mask, causal=case.causal, return_attention=True, cache=cache
        )
        outputs.append(output)
        weights.append(w)
    full, full_w = layer(
        **inputs, **chunk_positions(data, 0, case.p), attention_mask=full_pass_mask(case, data), causal=case.causal,
        return_attention=True,
    )  # fmt: skip
    return DecodeResult(
        np.concatenate(outputs, 1), np.concatenate(weights, 2), as_numpy_cache(cache, np.asarray), full, full_w
    )
