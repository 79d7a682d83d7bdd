"""The runner of the PyTorch file (PyTorch/Multi_Head_Attention.py): paths `torch:sdpa`,
`torch:explicit`, `torch:inference`, on `torch_device()`.

`torch:sdpa` calls scaled_dot_product_attention (no weights returned; with `softcap`, the
soft-capped blocks, one query row a block), `torch:explicit` passes
return_attention=True, `torch:inference` returns the weights under no_grad (the in-place path,
one batch element per block; no gradients). The runtime `torch:onnx` is shared_tests/runtimes.py's.

Legend: B batch, T query length, S key/value length, E d_model, N num_heads, P tokens decoded
in all, L cache slots.
"""

import os
from unittest import mock

from shared_tests.call_args import call_inputs
from shared_tests.calling import INPUTS, DecodeResult, Result, as_numpy_cache, by_name, inputs, set_path
from shared_tests.decode_masks import chunk_mask, chunk_positions, full_pass_mask

INFERENCE_BLOCK_SCORES = 1  # scores per block on `torch:inference`: every batch element a block of its own
SOFTCAP_BLOCK_SCORES = 1  # scores per block of the soft-capped blocks on `torch:sdpa`: each query row a block
SOFTCAP_TILES = {"forward": (2, 3), "causal forward": (3, 2), "backward": (3, 2)}  # rows, keys a tile: `torch:sdpa`


def torch_device():
    """The device of the PyTorch paths: $PARITY_TORCH_DEVICE (the parity report's --device), or cpu."""
    return os.environ.get("PARITY_TORCH_DEVICE", "cpu")


def to_torch(array, **kwargs):
    """A NumPy array as a tensor on `torch_device()`."""
    import torch

    return torch.tensor(array, device=torch_device(), **kwargs)


def make_torch_layer(case, data, layer_class=None):
    import torch

    from PyTorch import MultiHeadAttention

    layer = (layer_class or MultiHeadAttention)(**case.config, dtype=getattr(torch, case.dtype), device=torch_device())
    layer.import_weights(data["weights"])
    return set_path(layer, case).eval()


def _sparse_route(layer, explicit):
    """The sparse indexer's routes: the gathered keys (threshold 0) on the paths that return no weights,
    the selection's keep through the explicit softmax on `torch:explicit`."""
    layer.sparse_gather_threshold = layer.sparse_gather_threshold if explicit else 0
    return layer


def _torch_inputs(case, data, requires_grad=False):
    """The case's inputs in its dtype and its other call arguments (masks in their own dtype, an
    attention_bias that requires grad), as tensors on `torch_device()`."""
    import torch

    args = [to_torch(x, dtype=getattr(torch, case.dtype), requires_grad=requires_grad) for x in inputs(data)]
    kwargs = {name: to_torch(x) for name, x in call_inputs(data).items()}
    if requires_grad and "attention_bias" in kwargs:
        kwargs["attention_bias"].requires_grad_(True)
    return args, kwargs


def run(case, data, path, layer_class=None):
    """The paths `torch:sdpa`, `torch:explicit` and `torch:inference` of the PyTorch file (or `layer_class`)."""
    import torch

    from PyTorch import Multi_Head_Attention

    if path == "torch:inference":
        return _run_inference(case, data, layer_class)
    explicit = path == "torch:explicit"
    layer = _sparse_route(make_torch_layer(case, data, layer_class), explicit)
    args, kwargs = _torch_inputs(case, data, requires_grad=True)
    query, kv = by_name(args)
    with (
        mock.patch.object(Multi_Head_Attention, "_SOFTCAP_BLOCK_SCORES", SOFTCAP_BLOCK_SCORES),  # kept for backward
        mock.patch.object(Multi_Head_Attention, "_SOFTCAP_TILES", SOFTCAP_TILES),
    ):
        result = layer(*query, **kv, **kwargs, causal=case.causal, return_attention=explicit)
    output, weights = result if explicit else (result, None)
    grads = None
    if case.tolerance["grads"] is not None:
        (output * to_torch(data["grad_output"])).sum().backward()
        grads = dict(zip(INPUTS, (_numpy(x.grad) for x in args), strict=False))
        if "attention_bias" in kwargs:
            bias = kwargs["attention_bias"]
            grads["attention_bias"] = _numpy(torch.zeros_like(bias) if bias.grad is None else bias.grad)
        for name in layer.weight_shapes():
            tensor, transposed = Multi_Head_Attention._parameter(layer, name)
            grad = torch.zeros_like(tensor) if tensor.grad is None else tensor.grad  # None: autograd never reached it
            grads[name] = _numpy(grad.T if transposed else grad)
    return Result(_numpy(output), None if weights is None else _numpy(weights), grads)


def _run_inference(case, data, layer_class=None):
    import torch

    from PyTorch import Multi_Head_Attention

    layer = make_torch_layer(case, data, layer_class)
    args, kwargs = _torch_inputs(case, data)
    with torch.no_grad(), mock.patch.object(Multi_Head_Attention, "_BLOCK_SCORES", INFERENCE_BLOCK_SCORES):
        query, kv = by_name(args)
        output, weights = layer(*query, **kv, **kwargs, causal=case.causal, return_attention=True)
    return Result(_numpy(output), _numpy(weights), None)


def _numpy(tensor):
    return tensor.detach().double().cpu().numpy()


def decode(case, data, path):
    """A decode case on `torch:sdpa` or `torch:explicit` (weights returned), under no_grad."""
    import torch

    explicit = path == "torch:explicit"
    layer = _sparse_route(make_torch_layer(case, data), explicit)
    dtype = getattr(torch, case.dtype)
    cache = layer.init_cache(case.b, case.length, keep=torch.from_numpy(data["keep"]), dtype=case.cache_dtype)
    outputs, weights = [], []
    with torch.no_grad():
        for start, stop in case.spans():
            chunk = {name: to_torch(x[:, start:stop], dtype=dtype) for name, x in data["inputs"].items()}
            mask = chunk_mask(data["attention_mask"], start, stop)
            mask = None if mask is None else to_torch(mask)
            extra = {name: to_torch(x) for name, x in chunk_positions(data, start, stop).items()}
            result = layer(
                **chunk, **extra, attention_mask=mask, causal=case.causal, return_attention=explicit, cache=cache
            )
            outputs.append(result[0])
            weights.append(result[1] if explicit else None)
            cache = result[-1]
        inputs = {name: to_torch(x, dtype=dtype) for name, x in data["inputs"].items()}
        full_mask = to_torch(full_pass_mask(case, data))
        extra = {name: to_torch(x) for name, x in chunk_positions(data, 0, case.p).items()}
        full, full_w = layer(**inputs, **extra, attention_mask=full_mask, causal=case.causal, return_attention=True)

    def to_numpy(tensor):
        tensor = tensor.cpu()
        return tensor.double().numpy() if tensor.is_floating_point() else tensor.numpy()

    return DecodeResult(
        to_numpy(torch.cat(outputs, 1)),
        to_numpy(torch.cat(weights, 2)) if explicit else None,
        as_numpy_cache(cache, to_numpy),
        to_numpy(full),
        to_numpy(full_w),
    )
