"""Cross-layer KV sharing in the four files: one producer layer (Gemma 3n's `value_norm`, or Gemma 4's
`keys_as_values` with it) hands its keys and values to a `kv_shared` layer, as a (k, v) pair in a full pass and
as its `KVCache` when decoding; the NumPy reference gives the expected outputs.

Legend: B batch, T tokens, E d_model, N query heads, K key/value heads, H head_dim.

`run(framework)` computes one framework's results as NumPy arrays (the Keras file on the backend
KERAS_BACKEND names, in float32: JAX has no float64 unless enabled; shared_tests/keras_checks.py's
`check_sharing` runs it in each backend's process).
"""

import importlib

import numpy as np

B, T, E, N, K, H = 2, 5, 16, 4, 2, 8
PREFILL = 3  # decoding: a prompt of 3 tokens, then one token at a time
PADDING = 2  # the first row's left padding
CONSUMER = {"num_kv_heads": K, "head_dim": H, "rope_theta": 10000.0, "qk_norm": "head", "kv_shared": True}
PRODUCERS = {  # the producers' own options beside the consumer's RoPE, QK-norm and heads
    "value_norm": {"value_norm": True},  # Gemma 3n's layers and Gemma 4's sliding ones
    "keys_as_values": {"keys_as_values": True, "value_norm": True},  # Gemma 4's full layers (`attention_k_eq_v`)
}


def producer_config(name):
    config = {key: value for key, value in CONSUMER.items() if key != "kv_shared"}
    return {**config, **PRODUCERS[name]}


def inputs():
    """x (producer) and y (consumer) (B, T, E), the (B, T) key mask (row 0 left-padded), (B, T) positions."""
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(B, T, E)), rng.normal(size=(B, T, E))
    key_mask = np.ones((B, T), dtype=bool)
    key_mask[0, :PADDING] = False
    positions = np.maximum(np.cumsum(key_mask, axis=1) - 1, 0)  # (B, T), as transformers counts them
    return x, y, key_mask, positions


def weights(name):
    """The producer's and the consumer's portable weights, from the NumPy layers (seeded)."""
    numpy = importlib.import_module("NumPy.Multi_Head_Attention")
    producer = numpy.MultiHeadAttention(E, N, seed=1, **producer_config(name))
    consumer = numpy.MultiHeadAttention(E, N, seed=2, **CONSUMER)
    return producer.export_weights(), consumer.export_weights()


def run(framework):
    """{producer name: {"producer", "consumer", "decoded"} outputs (B, T, E)}; PyTorch and TensorFlow add the
    consumer's gradients of sum(output * 1) for the shared keys and values, "grad_key" and "grad_value"."""
    adapter = _ADAPTERS[framework]()
    results = {}
    for name in PRODUCERS:
        producer, consumer = (adapter.layer(config, w) for config, w in zip(_configs(name), weights(name), strict=True))
        results[name] = _scenario(adapter, producer, consumer)
    return results


def _configs(name):
    return producer_config(name), CONSUMER


def _scenario(adapter, producer, consumer):
    x, y, key_mask, positions = (adapter.tensor(a) for a in inputs())
    out, shared = producer(x, causal=True, key_mask=key_mask, positions=positions, return_kv=True)
    consumed = consumer(y, causal=True, key_mask=key_mask, positions=positions, shared_kv=shared)
    result = {"producer": adapter.numpy(out), "consumer": adapter.numpy(consumed)}
    result |= adapter.gradients(consumer, y, key_mask, positions, shared)
    cache, decoded = producer.init_cache(B, 8), []
    for start, stop in [(0, PREFILL), *((t, t + 1) for t in range(PREFILL, T))]:
        step = {"causal": True, "positions": positions[:, start:stop]}
        _, cache = producer(x[:, start:stop], key_mask=key_mask[:, start:stop], cache=cache, **step)
        decoded.append(adapter.numpy(consumer(y[:, start:stop], shared_kv=cache, **step)))
    result["decoded"] = np.concatenate(decoded, axis=1)  # (B, T, E)
    return result


class _NumPy:
    def __init__(self):
        self.module = importlib.import_module("NumPy.Multi_Head_Attention")

    def layer(self, config, weights):
        layer = self.module.MultiHeadAttention(E, N, **config)
        layer.import_weights(weights)
        return layer

    def tensor(self, a):
        return a

    def numpy(self, a):
        return np.asarray(a)

    def gradients(self, consumer, y, key_mask, positions, shared):
        consumer(y, causal=True, key_mask=key_mask, positions=positions, shared_kv=shared)
        grads = consumer.backward(np.ones((B, T, E)))
        return {"grad_key": grads["shared_key"], "grad_value": grads["shared_value"]}


class _PyTorch(_NumPy):
    def __init__(self):
        self.module = importlib.import_module("PyTorch.Multi_Head_Attention")
        self.torch = importlib.import_module("torch")

    def layer(self, config, weights):
        layer = self.module.MultiHeadAttention(E, N, dtype=self.torch.float64, **config)
        layer.import_weights(weights)
        return layer

    def tensor(self, a):
        return self.torch.as_tensor(a)

    def numpy(self, a):
        return a.detach().numpy()

    def gradients(self, consumer, y, key_mask, positions, shared):
        k, v = (part.detach().requires_grad_() for part in shared)
        consumer(y, causal=True, key_mask=key_mask, positions=positions, shared_kv=(k, v)).sum().backward()
        return {"grad_key": k.grad.numpy(), "grad_value": v.grad.numpy()}


class _TensorFlow(_NumPy):
    def __init__(self):
        self.module = importlib.import_module("TensorFlow.Multi_Head_Attention")
        self.tf = importlib.import_module("tensorflow")

    def layer(self, config, weights):
        layer = self.module.MultiHeadAttention(E, N, dtype="float64", **config)
        layer.import_weights(weights)
        return layer

    def tensor(self, a):
        return self.tf.constant(a)

    def numpy(self, a):
        return a.numpy()

    def gradients(self, consumer, y, key_mask, positions, shared):
        k, v = (self.tf.Variable(part) for part in shared)
        with self.tf.GradientTape() as tape:
            total = self.tf.reduce_sum(
                consumer(y, causal=True, key_mask=key_mask, positions=positions, shared_kv=(k, v))
            )
        grad_key, grad_value = tape.gradient(total, [k, v])
        return {"grad_key": grad_key.numpy(), "grad_value": grad_value.numpy()}


class _Keras(_NumPy):
    def __init__(self):
        self.module = importlib.import_module("Keras.Multi_Head_Attention")
        self.ops = importlib.import_module("keras").ops

    def layer(self, config, weights):
        layer = self.module.MultiHeadAttention(E, N, **config)  # float32
        layer.import_weights(weights)
        return layer

    def tensor(self, a):
        return self.ops.convert_to_tensor(a.astype(np.float32) if a.dtype == np.float64 else a)

    def numpy(self, a):
        return np.asarray(self.ops.convert_to_numpy(a))

    def gradients(self, consumer, y, key_mask, positions, shared):
        return {}  # the backends' gradients: through the same ops as the forward (test_keras_* cover them)


_ADAPTERS = {"NumPy": _NumPy, "PyTorch": _PyTorch, "TensorFlow": _TensorFlow, "Keras": _Keras}


def compare(got, want, names, tolerance):
    """Asserts each result in `names` within `tolerance` of NumPy's, on the real tokens' rows."""
    real = np.ones((B, T), dtype=bool)
    real[0, :PADDING] = False  # padded queries: transformers leaves their outputs unspecified
    for producer in PRODUCERS:
        for name in names:
            g, w = got[producer][name], want[producer][name]
            g, w = (g[real], w[real]) if g.shape[:2] == real.shape else (g, w)
            np.testing.assert_allclose(g, w, rtol=0, atol=tolerance, err_msg=f"{producer}: {name}")
